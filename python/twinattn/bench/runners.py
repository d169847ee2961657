"""The backends the benchmark times: the two native ports, the NumPy reference, and two peers.

Each runner turns a Problem into a Prepared call: everything a backend needs (layout changes,
masks, models, sessions, output buffers) is made in `prepare`, outside the timed region; `call`
is the one thing timed; `output` hands back the latest result as (B, Hq, Lq, Dv) for the check.

    cpp, rust    twinattn.attention(..., backend=port, out=preallocated, num_threads=T)
    numpy        twinattn.attention(..., backend="numpy"), NumPy's BLAS limited to T threads
    torch        torch.nn.functional.scaled_dot_product_attention with enable_gqa; bottom-right
                 causal alignment through is_causal when Lq == Lk, else an explicit bool mask
    onnxruntime  a one-node model of com.microsoft::GroupQueryAttention on the CPU provider;
                 with a KV cache (Lq < Lk) the cache is bound in place through IOBinding
                 (past_key and present_key share one buffer), so no cache copy is timed

The layer case (kind LAYER) runs on twinattn's backends only, through `prepare_layer`: a
twinattn.nn.Attention(backend=port) with the problem's weights (load_state_dict) and a KVCache
holding the problem's cached tokens. `step` is one decode step; `reset` crops the cache back
(untimed, before every step, so every step does the same work); `kernel` is twinattn.attention
alone with the arguments the layer passes it (the step's q, the cache views, q_offset, kv_lens).
The native threads (twinattn.set_num_threads) and NumPy's BLAS threads (the projections) are both
set to the run's thread count; both are restored on close.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import twinattn

from .cases import LAYER, Case, LayerProblem, Problem

PEERS = ("torch", "onnxruntime")
ALL_BACKENDS = ("cpp", "rust", "numpy") + PEERS
ALIASES = {"ort": "onnxruntime", "c++": "cpp"}
LAYER_ONLY = "layer case: twinattn backends only"


@dataclass
class Prepared:
    call: Callable[[], object]  # the timed call
    output: Callable[[], np.ndarray]  # the latest output as (B, Hq, Lq, Dv), outside timing
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


@dataclass
class PreparedLayer:
    step: Callable[[], object]  # the timed call: one nn.Attention step with the cache
    reset: Callable[[], None]  # crop the cache back to the problem's cached tokens (untimed)
    kernel: Callable[[], object]  # twinattn.attention alone, as the step calls it (timed apart)
    output: Callable[[], np.ndarray]  # the latest step output (B, q_len, hidden_size)
    kernel_output: Callable[[], np.ndarray]  # the latest kernel output (B, Hq, q_len, D)
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


class Runner:
    """A backend the benchmark can time. Subclasses override available/version/prepare."""

    name = ""

    def available(self) -> Optional[str]:
        """None when usable, else why not."""
        return None

    def version(self) -> str:
        return ""

    def supports(self, case: Case) -> Optional[str]:
        """None when this backend can run the case, else why not."""
        return LAYER_ONLY if case.kind == LAYER else None

    def peak_bytes(self, case: Case) -> int:
        """Memory one call needs beyond its inputs and output (for skipping huge cases)."""
        return 0

    def prepare(self, problem: Problem, threads: int) -> Prepared:
        raise NotImplementedError

    def prepare_layer(self, problem: LayerProblem, threads: int) -> PreparedLayer:
        raise NotImplementedError(LAYER_ONLY)


def _nan_output(case: Case) -> np.ndarray:
    return np.full((case.batch, case.q_heads, case.q_len, case.value_dim), np.nan, dtype=np.float32)


class TwinattnRunner(Runner):
    """One of twinattn's own backends, called exactly as a user would, writing into `out`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def available(self) -> Optional[str]:
        if self.name in twinattn.backends():
            return None
        return str(twinattn.build_info()[self.name].get("error", "not built"))

    def version(self) -> str:
        info = twinattn.build_info()[self.name]
        built = ", ".join(str(info[key]) for key in ("isa", "compiler") if key in info)
        return f"{self.name} {twinattn.__version__} ({built})"

    def prepare(self, problem: Problem, threads: int) -> Prepared:
        out = _nan_output(problem.case)
        causal, lens, name = problem.case.causal, problem.kv_lens, self.name
        q, k, v = problem.q, problem.k, problem.v

        def call() -> object:
            return twinattn.attention(q, k, v, causal=causal, kv_lens=lens, out=out, backend=name, num_threads=threads)

        return Prepared(call, lambda: out)

    def supports(self, case: Case) -> Optional[str]:
        return None

    def prepare_layer(self, problem: LayerProblem, threads: int) -> PreparedLayer:
        case, name = problem.case, self.name
        rope = twinattn.RotaryEmbedding(case.head_dim, base=problem.rope_base)
        layer = twinattn.nn.Attention(
            hidden_size=case.hidden_size,
            num_heads=case.q_heads,
            num_kv_heads=case.kv_heads,
            head_dim=case.head_dim,
            rope=rope,
            backend=name,
        )
        layer.load_state_dict(problem.weights)
        cached, length = problem.cached, case.q_len
        cache = twinattn.KVCache(
            num_layers=1,
            batch_size=case.batch,
            num_kv_heads=case.kv_heads,
            head_dim=case.head_dim,
            max_seq_len=case.k_len,  # exactly one step's room: a missed crop overflows, loudly
        )
        cache.update(problem.past_k, problem.past_v, 0)
        hidden = problem.hidden

        # The kernel alone gets what nn.Attention passes it: the new queries (projected and rotated
        # as the layer does it), views of the cache after the append, q_offset and kv_lens.
        positions = cache.positions(length, 0)

        def heads(weight: str, count: int) -> np.ndarray:
            y: np.ndarray = hidden @ problem.weights[weight].T
            return y.reshape(case.batch, length, count, case.head_dim).transpose(0, 2, 1, 3)

        q = rope.apply(heads("q_proj.weight", case.q_heads), positions)
        k_new = np.ascontiguousarray(rope.apply(heads("k_proj.weight", case.kv_heads), positions))
        v_new = np.ascontiguousarray(heads("v_proj.weight", case.kv_heads))
        q_offset = cache.seq_lens(0)
        keys, values = cache.update(k_new, v_new, 0)  # the step writes these same rows again
        kv_lens = cache.seq_lens(0)
        cache.crop(cached)

        previous_threads = twinattn.get_num_threads()
        twinattn.set_num_threads(threads)
        limits = _blas_limits(threads)
        notes: list[str] = []
        if limits is None:
            notes.append("BLAS threads not limited (threadpoolctl missing)")
        result: dict[str, Any] = {}

        def reset() -> None:
            cache.crop(cached)

        def step() -> object:
            result["out"] = layer(hidden, cache=cache)
            return result["out"]

        def kernel() -> object:
            result["kernel"] = twinattn.attention(
                q, keys, values, causal=True, q_offset=q_offset, kv_lens=kv_lens, scale=layer.scale, backend=name
            )
            return result["kernel"]

        def close() -> None:
            twinattn.set_num_threads(previous_threads)
            if limits is not None:
                limits.restore_original_limits()

        return PreparedLayer(
            step, reset, kernel, lambda: result["out"], lambda: result["kernel"], close=close, notes=notes
        )


class NumpyRunner(TwinattnRunner):
    """The NumPy reference (float32): it materialises the (B, Hq, Lq, Lk) scores several times."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def available(self) -> Optional[str]:
        return None

    def version(self) -> str:
        return f"numpy {np.__version__}"

    def peak_bytes(self, case: Case) -> int:
        scores = case.batch * case.q_heads * case.q_len * case.k_len
        # scores, exp, weights (float32) and visible/legal masks (bool) live together, plus K/V
        # with padding zeroed (a copy) and repeated over the query heads (another, Hq/Hkv times)
        row_bytes = 4 * case.batch * case.k_len * (case.head_dim + case.value_dim)
        return scores * (4 * 4 + 3) + row_bytes * (case.kv_heads + case.q_heads)

    def prepare(self, problem: Problem, threads: int) -> Prepared:
        prepared = super().prepare(problem, threads)
        limits = _blas_limits(threads)
        if limits is None:
            prepared.notes.append("BLAS threads not limited (threadpoolctl missing)")
        else:
            prepared.close = limits.restore_original_limits
        return prepared


def _blas_limits(threads: int) -> Any:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=threads, user_api="blas")


class TorchRunner(Runner):
    name = "torch"

    def available(self) -> Optional[str]:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def version(self) -> str:
        return f"torch {importlib.import_module('torch').__version__}"

    def peak_bytes(self, case: Case) -> int:
        # torch's CPU flash kernel works in blocks; its math fallback (explicit masks on old
        # versions) materialises the scores
        return case.batch * case.q_heads * case.q_len * case.k_len * 4 * 3

    def prepare(self, problem: Problem, threads: int) -> Prepared:
        import torch
        import torch.nn.functional as F

        case = problem.case
        notes: list[str] = []
        q, k, v = (torch.from_numpy(np.array(a)) for a in (problem.q, problem.k, problem.v))  # writeable copies
        kwargs: dict[str, Any] = {"scale": problem.scale}
        mask = None
        needs_mask = problem.kv_lens is not None or (case.causal and case.q_len != case.k_len)
        if needs_mask:
            key = np.arange(case.k_len)[None, None, :]
            allowed = key < case.lens[:, None, None]
            if case.causal:
                rows = np.arange(case.q_len)[None, :, None]
                allowed = allowed & (key <= case.q_offsets[:, None, None] + rows)  # bottom-right
            mask = torch.from_numpy(np.ascontiguousarray(allowed[:, None]))  # (B, 1, Lq, Lk) bool
            kwargs["attn_mask"] = mask
        elif case.causal:
            kwargs["is_causal"] = True  # Lq == Lk: top-left and bottom-right agree
        if case.q_heads != case.kv_heads:
            if _torch_has_gqa(F):
                kwargs["enable_gqa"] = True
            else:
                group = case.q_heads // case.kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                notes.append("torch without enable_gqa: K/V repeated over the group before timing")
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        result: dict[str, Any] = {}

        def call() -> object:
            with torch.inference_mode():
                result["out"] = F.scaled_dot_product_attention(q, k, v, **kwargs)
            return result["out"]

        return Prepared(
            call,
            lambda: result["out"].numpy(),
            close=lambda: torch.set_num_threads(previous_threads),
            notes=notes,
        )


def _torch_has_gqa(functional: Any) -> bool:
    try:
        import inspect

        return "enable_gqa" in inspect.signature(functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: enable_gqa came in torch 2.5
        import torch

        major, minor = (int(p) for p in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 5)


class OnnxRuntimeRunner(Runner):
    name = "onnxruntime"

    def available(self) -> Optional[str]:
        missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return f"{' and '.join(missing)} not installed"
        return None

    def version(self) -> str:
        return f"onnxruntime {importlib.import_module('onnxruntime').__version__}"

    def supports(self, case: Case) -> Optional[str]:
        if case.kind == LAYER:
            return LAYER_ONLY
        if not case.causal:
            return "GroupQueryAttention is causal only"
        if case.head_dim != case.value_dim:
            return "GroupQueryAttention needs Dv == D"
        if case.q_len > 1 and case.kv_lens is not None and len(set(case.kv_lens)) > 1:
            return "GroupQueryAttention prompts of several lengths are not timed here"
        return None

    def peak_bytes(self, case: Case) -> int:
        # the CPU kernel materialises the probabilities of every (sequence, head)
        return case.batch * case.q_heads * case.q_len * case.k_len * 4

    def prepare(self, problem: Problem, threads: int) -> Prepared:
        import onnxruntime as ort

        case = problem.case
        batch, q_len, k_len = case.batch, case.q_len, case.k_len
        lens = case.lens
        # GroupQueryAttention takes (B, S, H x D) inputs: the last S tokens of each sequence are
        # "new" (query, key, value); with a cache, the earlier ones are in past_key/past_value
        # (B, Hkv, max_len, D), a buffer shared with present_key/present_value.
        with_cache = q_len < k_len or problem.kv_lens is not None

        def tokens_last(a: np.ndarray) -> np.ndarray:  # (B, H, S, D) -> (B, S, H x D)
            return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1))

        query = tokens_last(problem.q)
        new_k = np.stack([problem.k[b, :, lens[b] - q_len : lens[b]] for b in range(batch)])
        new_v = np.stack([problem.v[b, :, lens[b] - q_len : lens[b]] for b in range(batch)])
        key, value = tokens_last(new_k), tokens_last(new_v)
        seqlens_k = (lens - 1).astype(np.int32)  # "total sequence lengths - 1"
        total = np.array(k_len if with_cache else q_len, dtype=np.int32)
        output = np.full((batch, q_len, case.q_heads * case.value_dim), np.nan, dtype=np.float32)

        model = _gqa_model(case, problem.scale, with_cache)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        binding = session.io_binding()
        keep: list[Any] = []

        def bind_input(name: str, array: np.ndarray) -> Any:
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the numpy buffer, no copy on CPU
            keep.append((array, value))
            binding.bind_ortvalue_input(name, value)
            return value

        bind_input("query", query)
        bind_input("key", key)
        bind_input("value", value)
        bind_input("seqlens_k", seqlens_k)
        bind_input("total_sequence_length", total)
        out_value = ort.OrtValue.ortvalue_from_numpy(output)
        keep.append((output, out_value))
        binding.bind_ortvalue_output("output", out_value)
        if with_cache:
            # the cache holds every key; each call rewrites the new tokens' rows with the same values
            for past, present, array in (
                ("past_key", "present_key", problem.k),
                ("past_value", "present_value", problem.v),
            ):
                cache = bind_input(past, np.array(array))
                binding.bind_ortvalue_output(present, cache)  # shared buffer: updated in place
        else:
            for present, dim in (("present_key", case.head_dim), ("present_value", case.value_dim)):
                buffer = np.empty((batch, case.kv_heads, q_len, dim), dtype=np.float32)
                value = ort.OrtValue.ortvalue_from_numpy(buffer)
                keep.append((buffer, value))
                binding.bind_ortvalue_output(present, value)

        def call() -> object:
            session.run_with_iobinding(binding)
            return output

        def result() -> np.ndarray:
            return output.reshape(batch, q_len, case.q_heads, case.value_dim).transpose(0, 2, 1, 3)

        def close() -> None:
            keep.clear()

        return Prepared(call, result, close=close)


def _gqa_model(case: Case, scale: float, with_cache: bool) -> Any:
    from onnx import TensorProto, helper

    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    batch, q_len, k_len = case.batch, case.q_len, case.k_len
    inputs = [
        helper.make_tensor_value_info("query", f32, [batch, q_len, case.q_heads * case.head_dim]),
        helper.make_tensor_value_info("key", f32, [batch, q_len, case.kv_heads * case.head_dim]),
        helper.make_tensor_value_info("value", f32, [batch, q_len, case.kv_heads * case.value_dim]),
        helper.make_tensor_value_info("seqlens_k", i32, [batch]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    present_len = k_len if with_cache else q_len
    outputs = [
        helper.make_tensor_value_info("output", f32, [batch, q_len, case.q_heads * case.value_dim]),
        helper.make_tensor_value_info("present_key", f32, [batch, case.kv_heads, present_len, case.head_dim]),
        helper.make_tensor_value_info("present_value", f32, [batch, case.kv_heads, present_len, case.value_dim]),
    ]
    node_inputs = ["query", "key", "value", "", "", "seqlens_k", "total_sequence_length"]
    if with_cache:
        inputs[3:3] = [
            helper.make_tensor_value_info("past_key", f32, [batch, case.kv_heads, k_len, case.head_dim]),
            helper.make_tensor_value_info("past_value", f32, [batch, case.kv_heads, k_len, case.value_dim]),
        ]
        node_inputs[3:5] = ["past_key", "past_value"]
    node = helper.make_node(
        "GroupQueryAttention",
        node_inputs,
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=case.q_heads,
        kv_num_heads=case.kv_heads,
        scale=float(scale),
    )
    graph = helper.make_graph([node], "twinattn_bench_gqa", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8  # old enough for every onnxruntime that has GroupQueryAttention on CPU
    return model


def make_runners() -> dict[str, Runner]:
    return {
        "cpp": TwinattnRunner("cpp"),
        "rust": TwinattnRunner("rust"),
        "numpy": NumpyRunner(),
        "torch": TorchRunner(),
        "onnxruntime": OnnxRuntimeRunner(),
    }


@contextlib.contextmanager
def prepared(runner: Runner, problem: Problem, threads: int) -> Any:
    ready = runner.prepare(problem, threads)
    try:
        yield ready
    finally:
        ready.close()


@contextlib.contextmanager
def prepared_layer(runner: Runner, problem: LayerProblem, threads: int) -> Any:
    ready = runner.prepare_layer(problem, threads)
    try:
        yield ready
    finally:
        ready.close()


def parse_backends(spec: Optional[str], runners: dict[str, Runner]) -> list[str]:
    """Backends to run: the requested ones (error if one is unknown or not available), or every
    available one."""
    if spec is None:
        return [name for name, runner in runners.items() if runner.available() is None]
    names = []
    for raw in spec.split(","):
        name = ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if not name:
            continue
        if name not in runners:
            raise ValueError(f"--backends: unknown backend {raw.strip()!r}; valid: {', '.join(runners)}")
        why = runners[name].available()
        if why is not None:
            raise ValueError(f"--backends: backend {name!r} is not available here: {why}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"--backends: expected a comma-separated list of backends ({', '.join(runners)})")
    return names
