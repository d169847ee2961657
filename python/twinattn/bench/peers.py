"""Everything the benchmark times, behind one interface: twinattn's backends and its peers.

A runner turns a problem (suite.Problem or suite.LayerProblem) into a Prepared call: everything a
backend needs (layout changes, masks, models, sessions, output buffers) is made in `prepare`,
outside the timed region. Its `parts` are what is timed, each with the output it hands back for
the problem's check (part i is checked by problem.check(output, i)):

    cpp, rust    twinattn.attention(..., backend=port, out=preallocated, num_threads=T)
    numpy        twinattn.attention(..., backend="numpy"), NumPy's BLAS limited to T threads
    torch        torch.nn.functional.scaled_dot_product_attention with enable_gqa; bottom-right
                 causal alignment through is_causal when Lq == Lk, else an explicit bool mask
    onnxruntime  a one-node model of com.microsoft::GroupQueryAttention on the CPU provider;
                 with a KV cache (Lq < Lk) the cache is bound in place through IOBinding
                 (past_key and present_key share one buffer), so no cache copy is timed
    openvino     a one-node model of opset13 ScaledDotProductAttention compiled for the CPU, in
                 q's precision (INFERENCE_PRECISION_HINT f32 or bf16); causal=True (top-left)
                 only when Lq == Lk, else an explicit bool mask; no GQA in that op, so K/V
                 are repeated over each group before timing
    flex         torch.compile(flex_attention) (torch.nn.attention.flex_attention) with
                 enable_gqa, a block mask (create_block_mask) of the visible keys, bottom-right
                 aligned, and softcap as a score_mod; compiled in `prepare`, before timing

The layer case runs on twinattn's backends only: part 0 is one decode step of a
twinattn.nn.Attention(backend=port) holding the problem's weights, on a KVCache holding its cached
tokens, the cache cropped back before every step (untimed, so every step does the same work);
part 1 is twinattn.attention alone with the arguments the layer passes it (the step's q, the cache
views, q_offset, kv_lens). The native threads (twinattn.set_num_threads) and NumPy's BLAS threads
(the projections) are both set to the run's thread count, and restored on close.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

import twinattn

from ..core._threads import configured_num_threads
from .machine import blas_limits
from .suite import (
    INT8, LAYER, TRAIN, AnyProblem, Case, LayerProblem, Problem, TrainProblem, numpy_dtype, out_dtype, visible_key_range,
)

PORTS = ("cpp", "rust")  # twinattn's two native ports, also timed alternately
PEERS = ("torch", "onnxruntime", "openvino", "flex")
ALIASES = {"ort": "onnxruntime", "c++": "cpp", "ov": "openvino", "flex_attention": "flex"}
LAYER_ONLY = "layer case: twinattn backends only"
VARIANT_ONLY = "sliding window / softcap case: twinattn backends only"
TRAIN_ONLY = "forward and backward: twinattn's ports and torch only"


def _nothing() -> None:
    return None


@dataclass
class Part:
    """One timed call of a prepared backend."""

    call: Callable[[], object]  # the timed call
    output: Callable[[], np.ndarray]  # its latest output, for the check (outside timing)
    reset: Callable[[], None] = _nothing  # before every call, untimed (the layer's cache crop)


@dataclass
class Prepared:
    parts: list[Part]  # a kernel case: the call; the layer case: the step, then the kernel alone; a
    # train case: forward and backward, then the backward alone
    close: Callable[[], None] = _nothing
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def prepared(runner: "Runner", problem: AnyProblem, threads: int) -> Iterator[Prepared]:
    ready = runner.prepare(problem, threads)
    try:
        yield ready
    finally:
        ready.close()


class Runner:
    """A backend the benchmark can time. Subclasses override available/version/prepare."""

    name = ""

    def available(self) -> Optional[str]:
        """None when usable, else why not."""
        return None

    def version(self) -> str:
        return ""

    def dtype_support(self, dtype: str) -> Optional[str]:
        """None when this backend is timed in `dtype`, else why not (then it is left out of that
        dtype's rows, and the run says so once)."""
        return None if dtype == "float32" else "float32 only"

    def supports(self, case: Case) -> Optional[str]:
        """None when this backend can run the case, else why not."""
        return _forward_kernel_only(case) or (VARIANT_ONLY if case.variant_kwargs else None)

    def peak_bytes(self, case: Case) -> int:
        """Memory one call needs beyond its inputs and output (for skipping huge cases)."""
        return 0

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        raise NotImplementedError


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

    def dtype_support(self, dtype: str) -> Optional[str]:
        return None

    def supports(self, case: Case) -> Optional[str]:
        return None

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        layer = isinstance(problem, LayerProblem)
        parts = self._layer_parts(problem) if isinstance(problem, LayerProblem) else self._call(problem, threads)
        previous_threads = configured_num_threads()
        twinattn.set_num_threads(threads)
        limits = blas_limits(threads)  # NumPy's BLAS: the numpy backend and the layer's projections

        def close() -> None:
            twinattn.set_num_threads(previous_threads)
            if limits is not None:
                limits.restore_original_limits()

        missing = limits is None and (self.name == "numpy" or layer)
        return Prepared(parts, close, ["BLAS threads not limited (threadpoolctl missing)"] if missing else [])

    def _call(self, problem: Problem, threads: int) -> list[Part]:
        if isinstance(problem, TrainProblem):
            return self._train_parts(problem, threads)
        case, name = problem.case, self.name
        shape = (case.batch, case.q_heads, case.q_len, case.value_dim)
        out = np.full(shape, np.nan, dtype=out_dtype(case.dtype))
        q, k, v, causal, lens = problem.q, problem.k, problem.v, case.causal, problem.kv_lens
        variants = {**case.variant_kwargs, **problem.scale_kwargs}  # int8: k_scale, v_scale

        def call() -> object:
            return twinattn.attention(
                q, k, v, causal=causal, kv_lens=lens, out=out, backend=name, num_threads=threads, **variants
            )

        return [Part(call, lambda: out)]

    def _train_parts(self, problem: TrainProblem, threads: int) -> list[Part]:
        """The forward (with lse, and out32 in float16 / bfloat16) and the backward
        (twinattn.core.backward), as a training step calls them; then the backward alone, from one
        such forward made here (untimed). The output checked is dq, of each."""
        from ..core.backward import attention_backward, attention_for_training

        case, name, dout = problem.case, self.name, problem.dout
        assert dout is not None
        q, k, v, lens = problem.q, problem.k, problem.v, problem.kv_lens
        keywords = {"causal": case.causal, "kv_lens": lens, "backend": name, "num_threads": threads, **case.variant_kwargs}
        result: dict[str, Any] = {}

        def call() -> object:
            _, lse, out32 = attention_for_training(q, k, v, **keywords)
            result["grads"] = attention_backward(q, k, v, out32, dout, lse, **keywords)
            return result["grads"]

        forward = attention_for_training(q, k, v, **keywords)

        def backward() -> object:
            result["backward"] = attention_backward(q, k, v, forward.out32, dout, forward.lse, **keywords)
            return result["backward"]

        return [Part(call, lambda: result["grads"].dq), Part(backward, lambda: result["backward"].dq)]

    def _layer_parts(self, problem: LayerProblem) -> list[Part]:
        case, name, cached, hidden = problem.case, self.name, problem.cached, problem.hidden
        rope = problem.rope()
        layer = twinattn.nn.Attention(
            hidden_size=case.hidden_size,
            num_heads=case.q_heads,
            num_kv_heads=case.kv_heads,
            head_dim=case.head_dim,
            rope=rope,
            backend=name,
        )
        layer.load_state_dict(problem.weights)
        cache = problem.cache()
        # the kernel alone gets what the layer passes it; the step writes these same rows again
        q, keys, values, q_offset, kv_lens = problem.kernel_arguments(cache, rope)
        cache.crop(cached)
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

        return [Part(step, lambda: result["out"], reset), Part(kernel, lambda: result["kernel"])]


class NumpyRunner(TwinattnRunner):
    """The NumPy reference (float32): it materialises the (B, Hq, Lq, Lk) scores several times."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def available(self) -> Optional[str]:
        return None

    def version(self) -> str:
        return f"numpy {np.__version__}"

    def dtype_support(self, dtype: str) -> Optional[str]:
        if dtype == "float32":
            return None
        if dtype == INT8:
            return "not timed in int8: the NumPy backend computes over the dequantized K/V, as the reference"
        # the NumPy backend computes a narrow dtype in float64 from the rounded inputs: a check, not a peer
        return (
            "float32 only: NumPy has no bfloat16 arithmetic (float16 it widens per operation), so the "
            "NumPy backend computes these dtypes in float64 from the rounded inputs, as the reference"
        )

    def supports(self, case: Case) -> Optional[str]:
        if case.kind == TRAIN:
            return "forward and backward: the NumPy reference's backward is a dense float64 check, not timed"
        return None

    def peak_bytes(self, case: Case) -> int:
        scores = case.batch * case.q_heads * case.q_len * case.k_len
        # scores, exp, weights (float32) and visible/legal masks (bool) live together, plus K/V
        # with padding zeroed (a copy) and repeated over the query heads (another, Hq/Hkv times)
        row_bytes = 4 * case.batch * case.k_len * (case.head_dim + case.value_dim)
        return scores * (4 * 4 + 3) + row_bytes * (case.kv_heads + case.q_heads)


def _version(module: str) -> str:
    return f"{module} {importlib.import_module(module).__version__}"


def _missing(*modules: str) -> Optional[str]:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


class TorchRunner(Runner):
    name = "torch"

    def available(self) -> Optional[str]:
        return "torch is not installed" if _missing("torch") else None

    def version(self) -> str:
        return _version("torch")

    def dtype_support(self, dtype: str) -> Optional[str]:
        if dtype == INT8:  # no int8 K/V in torch's CPU SDPA: no peer to time
            return ("not timed: torch has no int8 attention (scaled_dot_product_attention takes floating-point "
                    "q, k, v of one dtype; no scales)")
        return None  # scaled_dot_product_attention in the same dtype: the peer

    def supports(self, case: Case) -> Optional[str]:
        return _masked_op_supports(case, "torch's scaled_dot_product_attention")

    def peak_bytes(self, case: Case) -> int:
        # torch's CPU flash kernel works in blocks; its math fallback (explicit masks on old
        # versions) materialises the scores
        return case.batch * case.q_heads * case.q_len * case.k_len * 4 * 3

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        import torch
        import torch.nn.functional as F

        assert isinstance(problem, Problem), LAYER_ONLY
        case = problem.case
        notes: list[str] = []
        q, k, v = (to_torch(a) for a in (problem.q, problem.k, problem.v))
        kwargs: dict[str, Any] = {"scale": problem.scale}
        allowed = visible_mask(problem)
        if allowed is not None:
            kwargs["attn_mask"] = torch.from_numpy(allowed)
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

        parts = [Part(call, lambda: from_torch(result["out"]))]
        if isinstance(problem, TrainProblem):
            parts = self._train_parts(problem, q, k, v, kwargs, result)
        return Prepared(parts, lambda: torch.set_num_threads(previous_threads), notes)

    @staticmethod
    def _train_parts(
        problem: TrainProblem, q: Any, k: Any, v: Any, kwargs: dict[str, Any], result: dict[str, Any]
    ) -> list[Part]:
        """SDPA forward and backward (autograd) of sum(out * dout), result["out"] its dq; then the
        backward alone (torch.autograd.grad through one forward's graph, kept), result["backward"]
        its dq."""
        import torch
        import torch.nn.functional as F

        assert problem.dout is not None
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        dout = to_torch(problem.dout)

        def call() -> object:
            for leaf in leaves:
                leaf.grad = None
            with torch.enable_grad():
                F.scaled_dot_product_attention(*leaves, **kwargs).backward(dout)
            result["out"] = leaves[0].grad
            return result["out"]

        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*leaves, **kwargs)

        def backward() -> object:
            result["backward"] = torch.autograd.grad(out, leaves, dout, retain_graph=True)[0]
            return result["backward"]

        return [Part(call, lambda: from_torch(result["out"])), Part(backward, lambda: from_torch(result["backward"]))]


def _forward_kernel_only(case: Case) -> Optional[str]:
    """Why a peer that times only attention's forward kernel skips the case (None: it is one)."""
    if case.kind == LAYER:
        return LAYER_ONLY
    if case.kind == TRAIN:
        return TRAIN_ONLY
    return None


def _masked_op_supports(case: Case, op: str) -> Optional[str]:
    """Runner.supports of a peer whose attention op takes a bool mask (a sliding window becomes
    one) but has no softcap (torch's SDPA, which also times the train cases; OpenVINO's)."""
    if case.kind == LAYER:
        return LAYER_ONLY
    if case.softcap:
        return f"softcap: not in {op}"
    return None


def visible_mask(problem: Problem) -> Optional[np.ndarray]:
    """(B, 1, Lq, Lk) bool, True where a query row may see a key (kv_lens, causality bottom-right,
    the window), for a peer whose own causal flag cannot say it: None when that flag can (every
    sequence full and, if causal, Lq == Lk, where top-left and bottom-right agree)."""
    case = problem.case
    if problem.kv_lens is None and not (case.causal and case.q_len != case.k_len) and case.window_left < 0:
        return None
    first, end = visible_key_range(case)  # (B, Lq)
    key = np.arange(case.k_len)[None, None, :]
    return np.ascontiguousarray(((key >= first[:, :, None]) & (key < end[:, :, None]))[:, None])


def to_torch(array: np.ndarray) -> Any:
    """A writeable torch copy of `array`, in its dtype: float32, float16, or ml_dtypes.bfloat16
    (which torch.from_numpy does not know: its bits travel as int16 and are viewed as bfloat16)."""
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def from_torch(tensor: Any) -> np.ndarray:
    """A CPU tensor's values as NumPy, in its dtype (torch.bfloat16 as ml_dtypes.bfloat16)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return np.asarray(tensor.contiguous().view(torch.int16).numpy().view(numpy_dtype("bfloat16")))
    return np.asarray(tensor.numpy())


def _torch_has_gqa(functional: Any) -> bool:
    try:
        return "enable_gqa" in inspect.signature(functional.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: enable_gqa came in torch 2.5
        import torch

        major, minor = (int(p) for p in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 5)


class OnnxRuntimeRunner(Runner):
    name = "onnxruntime"

    def available(self) -> Optional[str]:
        return _missing("onnxruntime", "onnx")

    def version(self) -> str:
        return _version("onnxruntime")

    def supports(self, case: Case) -> Optional[str]:
        if _forward_kernel_only(case):
            return _forward_kernel_only(case)
        if case.variant_kwargs:
            return VARIANT_ONLY
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

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        import onnxruntime as ort

        assert isinstance(problem, Problem), LAYER_ONLY
        case = problem.case
        batch, q_len, k_len, lens = case.batch, case.q_len, case.k_len, case.lens
        # GroupQueryAttention takes (B, S, H x D) inputs: the last S tokens of each sequence are
        # "new" (query, key, value); with a cache, the earlier ones are in past_key/past_value
        # (B, Hkv, max_len, D), a buffer shared with present_key/present_value.
        with_cache = q_len < k_len or problem.kv_lens is not None

        def tokens_last(a: np.ndarray) -> np.ndarray:  # (B, H, S, D) -> (B, S, H x D)
            return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1))

        def new_tokens(a: np.ndarray) -> np.ndarray:
            return tokens_last(np.stack([a[b, :, lens[b] - q_len : lens[b]] for b in range(batch)]))

        output = np.full((batch, q_len, case.q_heads * case.value_dim), np.nan, dtype=np.float32)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        model = _gqa_model(case, problem.scale, with_cache).SerializeToString()
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        binding = session.io_binding()
        keep: list[Any] = []

        def wrap(array: np.ndarray) -> Any:
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the numpy buffer, no copy on CPU
            keep.append((array, value))
            return value

        inputs = {
            "query": tokens_last(problem.q),
            "key": new_tokens(problem.k),
            "value": new_tokens(problem.v),
            "seqlens_k": (lens - 1).astype(np.int32),  # "total sequence lengths - 1"
            "total_sequence_length": np.array(k_len if with_cache else q_len, dtype=np.int32),
        }
        for name, array in inputs.items():
            binding.bind_ortvalue_input(name, wrap(array))
        binding.bind_ortvalue_output("output", wrap(output))
        for past, present, array in (("past_key", "present_key", problem.k), ("past_value", "present_value", problem.v)):
            if with_cache:  # the cache holds every key; each call rewrites the new tokens' rows, same values
                cache = wrap(np.array(array))
                binding.bind_ortvalue_input(past, cache)
                binding.bind_ortvalue_output(present, cache)  # shared buffer: updated in place
            else:
                shape = (batch, case.kv_heads, q_len, array.shape[-1])
                binding.bind_ortvalue_output(present, wrap(np.empty(shape, dtype=np.float32)))

        def call() -> object:
            session.run_with_iobinding(binding)
            return output

        def result() -> np.ndarray:
            return output.reshape(batch, q_len, case.q_heads, case.value_dim).transpose(0, 2, 1, 3)

        return Prepared([Part(call, result)], keep.clear)


def _gqa_model(case: Case, scale: float, with_cache: bool) -> Any:
    from onnx import TensorProto, helper

    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    batch, q_len, k_len, hkv = case.batch, case.q_len, case.k_len, case.kv_heads

    def tensor(name: str, kind: int, *shape: int) -> Any:
        return helper.make_tensor_value_info(name, kind, list(shape))

    inputs = [
        tensor("query", f32, batch, q_len, case.q_heads * case.head_dim),
        tensor("key", f32, batch, q_len, hkv * case.head_dim),
        tensor("value", f32, batch, q_len, hkv * case.value_dim),
        tensor("seqlens_k", i32, batch),
        tensor("total_sequence_length", i32),
    ]
    present_len = k_len if with_cache else q_len
    outputs = [
        tensor("output", f32, batch, q_len, case.q_heads * case.value_dim),
        tensor("present_key", f32, batch, hkv, present_len, case.head_dim),
        tensor("present_value", f32, batch, hkv, present_len, case.value_dim),
    ]
    node_inputs = ["query", "key", "value", "", "", "seqlens_k", "total_sequence_length"]
    if with_cache:
        inputs[3:3] = [
            tensor("past_key", f32, batch, hkv, k_len, case.head_dim),
            tensor("past_value", f32, batch, hkv, k_len, case.value_dim),
        ]
        node_inputs[3:5] = ["past_key", "past_value"]
    node = helper.make_node(
        "GroupQueryAttention",
        node_inputs,
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=case.q_heads,
        kv_num_heads=hkv,
        scale=float(scale),
    )
    graph = helper.make_graph([node], "twinattn_bench_gqa", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8  # old enough for every onnxruntime that has GroupQueryAttention on CPU
    return model


FLOAT32_AND_BFLOAT16 = ("float32", "bfloat16")


class OpenVinoRunner(Runner):
    name = "openvino"

    def available(self) -> Optional[str]:
        return _missing("openvino")

    def version(self) -> str:
        return _version("openvino")

    def dtype_support(self, dtype: str) -> Optional[str]:
        return None if dtype in FLOAT32_AND_BFLOAT16 else "timed in float32 and bfloat16 only"

    def supports(self, case: Case) -> Optional[str]:
        return _forward_kernel_only(case) or _masked_op_supports(case, "OpenVINO's ScaledDotProductAttention")

    def peak_bytes(self, case: Case) -> int:
        # K/V repeated over the group, and the scores where the plugin materialises them
        repeated = case.batch * case.q_heads * case.k_len * (case.head_dim + case.value_dim) * 4
        return repeated + case.batch * case.q_heads * case.q_len * case.k_len * 4 * 2

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        import openvino as ov
        import openvino.opset13 as ops

        assert isinstance(problem, Problem), LAYER_ONLY
        case = problem.case
        bf16 = case.dtype == "bfloat16"
        element = ov.Type.bf16 if bf16 else ov.Type.f32
        notes: list[str] = []
        group = case.q_heads // case.kv_heads
        k, v = problem.k, problem.v
        if group > 1:
            # the op broadcasts K/V heads only as leading dimensions; a (B, Hkv, G, L, D) broadcast
            # runs as MatMul + Softmax (the scores materialised), so the heads are repeated instead
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            notes.append("OpenVINO's ScaledDotProductAttention has no GQA: K/V repeated over the group before timing")
        inputs = {"q": problem.q, "k": k, "v": v}
        params = [ops.parameter(list(a.shape), element, name=name) for name, a in inputs.items()]
        scale = ops.constant(np.array(problem.scale, dtype=np.float32))
        if bf16:
            scale = ops.convert(scale, element)
        allowed = visible_mask(problem)
        if allowed is not None:  # causal=True is top-left: bottom-right needs the mask
            inputs["mask"] = allowed
            params.append(ops.parameter(list(allowed.shape), ov.Type.boolean, name="mask"))
            node = ops.scaled_dot_product_attention(*params, scale=scale, causal=False)
        else:
            no_mask = ops.constant(np.array(0.0, dtype=np.float32))
            if bf16:
                no_mask = ops.convert(no_mask, element)
            node = ops.scaled_dot_product_attention(*params, no_mask, scale=scale, causal=case.causal)
        config = {
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32",  # f32 models otherwise run in bf16 on AMX CPUs
        }
        compiled = ov.Core().compile_model(ov.Model([node], params, "twinattn_bench_sdpa"), "CPU", config)
        request = compiled.create_infer_request()
        for name, array in inputs.items():
            if bf16 and array.dtype != np.bool_:  # numpy has no bfloat16: the bits, through a float16 view
                tensor = ov.Tensor(element, list(array.shape))
                tensor.data[...] = np.ascontiguousarray(array).view(np.float16)
            else:
                tensor = ov.Tensor(np.ascontiguousarray(array))  # a copy (the problem's arrays are read-only)
            request.set_tensor(name, tensor)

        def call() -> object:
            return request.infer(share_outputs=True)

        def result() -> np.ndarray:
            data = request.get_output_tensor(0).data  # bf16 comes back as float16-typed bits
            return np.array(data.view(numpy_dtype("bfloat16")) if bf16 else data)

        return Prepared([Part(call, result)], notes=notes)


class FlexAttentionRunner(Runner):
    name = "flex"

    def available(self) -> Optional[str]:
        spec = importlib.util.find_spec("torch")  # found, not imported
        if spec is None or spec.origin is None:
            return "torch is not installed"
        if not (Path(spec.origin).parent / "nn" / "attention" / "flex_attention.py").exists():
            return "this torch has no torch.nn.attention.flex_attention (torch >= 2.5)"
        return None

    def version(self) -> str:
        return f"{_version('torch')} torch.compile(flex_attention)"

    def dtype_support(self, dtype: str) -> Optional[str]:
        return None if dtype in FLOAT32_AND_BFLOAT16 else "timed in float32 and bfloat16 only"

    def supports(self, case: Case) -> Optional[str]:
        return _forward_kernel_only(case)  # windows in the block mask, softcap a score_mod

    def peak_bytes(self, case: Case) -> int:
        # create_block_mask evaluates the mask at every (row, key) of each sequence, int64 indices
        return case.batch * case.q_len * case.k_len * 8 * 4

    def prepare(self, problem: AnyProblem, threads: int) -> Prepared:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        assert isinstance(problem, Problem), LAYER_ONLY
        case = problem.case
        q, k, v = (to_torch(a) for a in (problem.q, problem.k, problem.v))
        kwargs: dict[str, Any] = {"scale": problem.scale, "enable_gqa": case.q_heads != case.kv_heads}
        if case.causal or problem.kv_lens is not None or case.window_left >= 0:
            first, end = (torch.from_numpy(a) for a in visible_key_range(case))  # (B, Lq), bottom-right

            def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (kv_idx >= first[b, q_idx]) & (kv_idx < end[b, q_idx])

            kwargs["block_mask"] = create_block_mask(visible, case.batch, None, case.q_len, case.k_len, device="cpu")
        if case.softcap:
            cap = float(case.softcap)

            def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return cap * torch.tanh(score / cap)

            kwargs["score_mod"] = softcap
        # a fresh compile per case: cases differ in shape and mask, and dynamo recompiles one
        # function only so many times before it falls back to the (slow) eager flex_attention
        torch._dynamo.reset()
        attend = torch.compile(flex_attention)
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        result: dict[str, Any] = {}

        def call() -> object:
            with torch.inference_mode():
                result["out"] = attend(q, k, v, **kwargs)
            return result["out"]

        started = time.perf_counter()
        call()  # compiles: not timed
        notes = [f"compiled in {time.perf_counter() - started:.0f} s before timing"]
        return Prepared(
            [Part(call, lambda: from_torch(result["out"]))], lambda: torch.set_num_threads(previous_threads), notes
        )


def make_runners() -> dict[str, Runner]:
    return {
        "cpp": TwinattnRunner("cpp"),
        "rust": TwinattnRunner("rust"),
        "numpy": NumpyRunner(),
        "torch": TorchRunner(),
        "onnxruntime": OnnxRuntimeRunner(),
        "openvino": OpenVinoRunner(),
        "flex": FlexAttentionRunner(),
    }


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
