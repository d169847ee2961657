"""End to end: real models' prefill and decode, transformers' sdpa + DynamicCache against
twinattn + TwinattnCache (needs torch, transformers, gguf and accelerate, the `hf` and `models` extras,
and the model packages, see twinattn.models).

    python -m twinattn.bench.e2e --model smollm2 --threads 2 --contexts 16,4096,8192 --prefill 4096
    twinattn-bench --cases e2e [--dtype float32,bfloat16]      # every model, as a case of the benchmark
    twinattn-bench --cases e2e/gemma3                          # one model

Models (twinattn.models, float32 as converted from the packages' GGUF files), and where each is
measured (PLANS): SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, D 64) at decode
contexts 16, 1024, 4096 and 8192 and prefill lengths 1024, 4096 and 8192; Gemma 3 270M (18 layers,
MQA 4/1, D 256, a 512-token window on 5 of 6 layers) at decode contexts 16 and 8192 and a prefill of
8192. For each context N (ascending): prefill N tokens into a fresh cache (timed when N is a prefill
length), then `steps` greedy single-token decode steps on that cache (timed one by one; the median
counts). Then two more decode passes split the step (_split): the attention calls and cache
appends (timed around them), the matrix products (q/k/v/o and MLP projections, lm_head; their self
time under torch's profiler, in the second pass), and the rest (norms, RoPE, embedding, Python).

SmolLM2 also runs its Plan's plain-generate() cases (measure_generate: model.generate() with no
cache argument, sdpa against twinattn in interleaved rounds), and the case ends with
measure_overhead (twinattn.torch.attention against the NumPy API per call, the tiny case).

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
import contextlib
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TextIO, Tuple

from .. import models
from ..core._threads import configured_num_threads
from .suite import parse_dtypes

IMPLS = ("sdpa", "twinattn")
# the self time of these ops is the matrix products (torch's linear lowers to them)
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


@dataclass(frozen=True)
class Plan:
    """Where a model is measured: decode contexts (the first, short one is the baseline the longer
    steps are compared with) and prefill lengths; and its targets, if it has any: the
    decode step at `growth_at` at most `growth` times the step at the first context, twinattn's
    decode tokens/s at least `decode` times sdpa's (per context), its prefill at least `prefill`
    times sdpa's (per length)."""

    contexts: Tuple[int, ...]
    prefill: Tuple[int, ...]
    growth_at: Optional[int] = None
    growth: float = 0.0
    decode: Tuple[Tuple[int, float], ...] = ()
    prefill_ratio: Tuple[Tuple[int, float], ...] = ()
    generate: Tuple["GenerateCase", ...] = ()


@dataclass(frozen=True)
class GenerateCase:
    """A plain model.generate() with no cache argument, as most users call it, sdpa against
    twinattn (measure_generate): `batch` prompts of `prompt` tokens (a batch: random lengths from
    a quarter of that up, left-padded), in `dtype`; the target is twinattn's decode tokens/s at
    least `bound` times sdpa's. `loop`: instead of generate(), a hand-written greedy loop that
    lets the model make its cache (use_cache=True without one) and hands each step the cache the
    last one returned."""

    dtype: str
    prompt: int
    batch: int
    bound: float
    loop: bool = False

    def label(self, shrink: int = 1) -> str:
        prompt = max(1, self.prompt // shrink)
        prompts = f"{prompt}-token prompt" if self.batch == 1 else f"left-padded batch of {self.batch} prompts of <= {prompt} tokens"
        return f"{prompts} (step-by-step loop, the cache the forward makes)" if self.loop else prompts


SMOLLM2_GENERATE = (
    GenerateCase("float32", 16, 1, 1.0),
    GenerateCase("bfloat16", 16, 1, 1.0),
    GenerateCase("float32", 4096, 1, 1.15),
    GenerateCase("float32", 16, 16, 1.0),
    GenerateCase("float32", 16, 1, 1.0, loop=True),
)

PLANS = {
    "smollm2": Plan(contexts=(16, 1024, 4096, 8192), prefill=(1024, 4096, 8192), growth_at=4096, growth=1.15,
                    decode=((4096, 1.4), (8192, 1.8)), prefill_ratio=((4096, 1.1),), generate=SMOLLM2_GENERATE),
    # Gemma 3 at 8192: its figures against sdpa are reported, with no target
    "gemma3": Plan(contexts=(16, 8192), prefill=(8192,)),
}


def _say(progress: Optional[TextIO], message: str) -> None:
    if progress is not None:
        print(message, file=progress, flush=True)


class Bar(Protocol):
    """A progress bar (twinattn-bench's report.Progress) that run_case and measure move as they go:
    show(label) as each unit of work starts (loading a model, a prefill, a context's decode steps),
    step() as it ends. units() counts them."""

    def show(self, label: str) -> None: ...

    def step(self) -> None: ...


def _starts(bar: Optional[Bar], label: str) -> None:
    if bar is not None:
        bar.show(label)


def _ends(bar: Optional[Bar]) -> None:
    if bar is not None:
        bar.step()


def _lengths(plan: Plan, shrink: int) -> Tuple[list[int], list[int]]:
    """The plan's decode contexts and prefill lengths divided by `shrink` (at least 1 token)."""
    return sorted({max(1, n // shrink) for n in plan.contexts}), sorted({max(1, n // shrink) for n in plan.prefill})


def units(names: Sequence[str], dtypes: Sequence[str], shrink: int = 1, impls: Sequence[str] = IMPLS) -> int:
    """The steps run_case moves its bar by: per model whose package is installed, its loading, then
    per dtype and implementation one per prompt prefilled and one per decode context."""
    total = 0
    for name in names:
        if missing(name) is None:
            contexts, prefill = _lengths(PLANS[name], shrink)
            total += 1 + len(dtypes) * len(impls) * (len(set(contexts) | set(prefill)) + len(contexts))
            total += len(PLANS[name].generate)  # one per plain-generate() case
    # the per-call overhead of twinattn.torch.attention, once
    return total + 1 if total else 0


# what the end-to-end case needs beyond twinattn and the model packages (import names), and how to get it
NEEDS = ("torch", "transformers", "gguf", "accelerate")
HOW_TO_INSTALL = "pip install torch transformers gguf accelerate (twinattn's hf and models extras)"


def missing(name: Optional[str] = None) -> Optional[str]:
    """Why the end-to-end case (of model `name`, if given) cannot run here: what is not installed,
    and how to install it; or None."""
    absent = [package for package in NEEDS if importlib.util.find_spec(package) is None]
    if absent:
        return f"needs {', '.join(absent)}: {HOW_TO_INSTALL}"
    if name is not None and not models.installed(name):
        return f"needs {models.MODELS[name].title}: {models.MODELS[name].install}"
    return None


def load_model(name: str) -> Any:
    """Model `name` of twinattn.models, float32, in eval mode (converted once, then cached), without
    transformers' own progress bar for the loading of its weights (the benchmark has its own)."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        return models.load(name)[0]
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def model_in(model: Any, dtype: str) -> Any:
    """`model` itself for float32, else a copy of it in `dtype` ("float16" or "bfloat16")."""
    import copy

    import torch

    return model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))


def dtype_of(model: Any) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


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
    # with the config, transformers' cache keeps a sliding layer's last window only (as generate does)
    return DynamicCache(config=model.config)


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
    title: Optional[str] = None,
    bar: Optional[Bar] = None,
) -> list[dict[str, Any]]:
    """Prefill and decode tokens/s of `model` (a transformers causal LM) per attention
    implementation; see the module docstring for the procedure and the rows (whose "model" is
    `title`, default the config's model_type). Progress lines go to `progress`; `bar` moves one
    step per prefill and per context's decode steps."""
    from .. import hf  # noqa: F401  registers "twinattn"

    vocab, dtype = model.config.vocab_size, dtype_of(model)
    title = title or model.config.model_type
    lengths = sorted(set(contexts) | set(prefill))
    rows: list[dict[str, Any]] = []
    first_logits: dict[int, Any] = {}  # the first implementation's last-position prefill logits
    with _threads(threads):
        for impl in impls:
            try:
                rows.extend(_measure_impl(model, title, impl, dtype, vocab, lengths, contexts, prefill, steps, threads,
                                          progress, first_logits, bar))
            except Exception as exc:  # noqa: BLE001 - one implementation failing must not stop the other
                message = f"{type(exc).__name__}: {exc}"
                _say(progress, f"[e2e] {title} {impl} {dtype}: error: {message}")
                rows.append({"model": title, "dtype": dtype, "impl": impl, "phase": "error", "context": 0,
                             "threads": threads, "tokens_per_s": None, "ms": None, "status": "error", "note": message})
    return rows


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    """torch's and twinattn's thread counts set to `threads` for the block, and put back after it."""
    import torch

    import twinattn

    previous_torch, previous_twinattn = torch.get_num_threads(), configured_num_threads()
    torch.set_num_threads(threads)
    twinattn.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous_torch)
        twinattn.set_num_threads(previous_twinattn)


def _measure_impl(
    model: Any,
    title: str,
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
    bar: Optional[Bar],
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
            cache = _cache(impl, model, length + 3 * steps + 2)  # the timed steps and _split's two passes
            _say(progress, f"[e2e] {title} {impl} {dtype}: prefill {length} tokens ...")
            _starts(bar, f"e2e {title} {dtype} {impl}: prefill of {length} tokens")
            start = time.perf_counter()
            logits = _forward(model, prompt, cache)
            seconds = time.perf_counter() - start
            _ends(bar)
            last = logits[0, -1].float()
            if length in prefill:
                row = _row(title, impl, cache_name, "prefill", length, threads, length / seconds, seconds * 1e3, dtype)
                if length in first_logits:
                    row["max_logit_diff"] = float((last - first_logits[length]).abs().max())
                rows.append(row)
                _say(progress, f"[e2e] {title} {impl} {dtype}: prefill {length}: {length / seconds:.0f} tokens/s")
            first_logits.setdefault(length, last)
            if length not in contexts:
                continue
            _starts(bar, f"e2e {title} {dtype} {impl}: decode steps at {length} tokens")
            times = []
            token = logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                start = time.perf_counter()
                logits = _forward(model, token, cache)
                times.append(time.perf_counter() - start)
                token = logits[:, -1].argmax(-1, keepdim=True)
            step = statistics.median(times)
            split = _split(model, impl, cache, token, steps)
            rows.append(_row(title, impl, cache_name, "decode", length, threads, 1 / step, step * 1e3, dtype, **split))
            _ends(bar)
            _say(
                progress,
                f"[e2e] {title} {impl} {dtype}: decode at {length}: {1 / step:.1f} tokens/s ({step * 1e3:.1f} ms/step; "
                + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
                + ")",
            )
    return rows


def _split(model: Any, impl: str, cache: Any, token: Any, steps: int) -> dict[str, float]:
    """Two more decode passes: one with the attention function and the cache's update timed
    around (their per-step milliseconds, and the pass's own), one under torch's profiler (the
    matrix products' self time). The rest is the timed pass's step less the three. (The cache
    appends are not timed under the profiler: there DynamicCache's concatenations ran several
    times slower than without it.)"""
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
        start = time.perf_counter()
        token = _decode(model, cache, token, steps)
        total = (time.perf_counter() - start) / steps
    finally:
        AttentionInterface._global_mapping[impl] = original
        del cache.update
    with _without_profiler_log(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _decode(model, cache, token, steps)
    matmul = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in _MATMUL_OPS) / 1e6 / steps
    attention = sum(attention_calls) / steps
    appends = sum(cache_calls) / steps
    # under sdpa the attention function's time includes its matmul-free kernel only; twinattn's too
    return {
        "timed_ms": total * 1e3,
        "matmul_ms": matmul * 1e3,
        "attention_ms": attention * 1e3,
        "cache_ms": appends * 1e3,
        "rest_ms": (total - matmul - attention - appends) * 1e3,
    }


# a line of the profiler's C++ logger (kineto), e.g. "USDT:2026-12-01 10:00:00 11:11 X.cpp:39] profiler_start"
# or, on a machine without a GPU, "ERROR:... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35"
_PROFILER_LOG = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_profiler_log() -> Iterator[None]:
    """Runs the block with the process's stderr (file descriptor 2, where torch's profiler logs from
    C++) captured, and writes back every captured line but the profiler's own log lines: its
    start/stop notices and the failed GPU count of a CPU-only machine are not the benchmark's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not _PROFILER_LOG.match(line)]
            if kept:
                sys.stderr.write(b"".join(kept).decode(errors="replace"))
                sys.stderr.flush()


def _decode(model: Any, cache: Any, token: Any, steps: int) -> Any:
    """`steps` greedy decode steps from `token`; the last token chosen."""
    for _ in range(steps):
        logits = _forward(model, token, cache)
        token = logits[:, -1].argmax(-1, keepdim=True)
    return token


# ---- plain generate(), and the per-call overhead of twinattn.torch.attention ----------------------


def _left_padded_prompts(case: GenerateCase, vocab: int, shrink: int, generator: Any) -> tuple[Any, Any]:
    """(input_ids, attention_mask) of `case`: random tokens; a batch's prompts of random lengths
    from a quarter of the longest up, left-padded (padding token 0, masked out)."""
    import torch

    longest = max(1, case.prompt // shrink)
    ids = torch.randint(1, vocab, (case.batch, longest), generator=generator)
    mask = torch.ones(case.batch, longest, dtype=torch.long)
    if case.batch > 1:
        lengths = torch.randint(max(1, longest // 4), longest + 1, (case.batch,), generator=generator)
        lengths[0] = longest
        for row, length in enumerate(lengths.tolist()):
            ids[row, : longest - length] = 0
            mask[row, : longest - length] = 0
    return ids, mask


class _StepClock:
    """A logits processor that notes the time of each call (one per generated token, after its
    forward) and changes nothing: the decode steps are the time from the first call to the last."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def _greedy_loop(model: Any, ids: Any, mask: Any, new_tokens: int, clock: _StepClock) -> Any:
    """`new_tokens` greedy tokens by hand: the first forward makes the cache (use_cache=True
    without one), each next step is given the cache the last one returned; the clock is called
    after each token's forward. The prompts and the new tokens, as generate returns them."""
    import torch

    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    tokens = [ids]
    for step in range(new_tokens):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        clock(ids, None)
        tokens.append(token)
        if step + 1 < new_tokens:
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=out.cache, use_cache=True)
    return torch.cat(tokens, dim=1)


def measure_generate(
    base: Any,
    cases: Sequence[GenerateCase],
    *,
    new_tokens: int = 16,
    rounds: int = 3,
    shrink: int = 1,
    threads: int = 2,
    title: str = "",
    bar: Optional[Bar] = None,
) -> list[dict[str, Any]]:
    """Each case: `rounds` interleaved rounds of model.generate() with no cache argument (greedy,
    `new_tokens` new tokens; a loop case, _greedy_loop's hand-written loop), sdpa then twinattn, on the same prompts in one process; twinattn
    gets what generate makes for it (a TwinattnCache), sdpa a DynamicCache. Decode tokens/s per
    implementation from its median step: batch over the median of the intervals between
    consecutive generated tokens, over every round (a round's total swung by several percent with
    the host's noise, more than the difference measured; the median of its rounds x
    (new_tokens - 1) steps does not). Their ratio, and whether twinattn's tokens were sdpa's in every round. One row per
    case; `base` is the float32 model (model_in makes each dtype's copy)."""
    import torch
    from transformers import LogitsProcessorList

    from .. import hf  # noqa: F401 - registers "twinattn" and its default cache

    import twinattn

    previous_torch, previous_twinattn = torch.get_num_threads(), configured_num_threads()
    torch.set_num_threads(threads)
    twinattn.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    models_by_dtype: dict[str, Any] = {}
    try:
        for case in cases:
            _starts(bar, f"e2e {title} {case.dtype}: plain generate(), {case.label(shrink)}")
            model = models_by_dtype.setdefault(case.dtype, model_in(base, case.dtype))
            generator = torch.Generator().manual_seed(1)
            ids, mask = _left_padded_prompts(case, model.config.vocab_size, shrink, generator)
            settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
            steps: dict[str, list[float]] = {impl: [] for impl in IMPLS}  # seconds per decode step
            tokens: dict[str, list[Any]] = {impl: [] for impl in IMPLS}
            with torch.inference_mode():
                for _ in range(rounds):
                    for impl in IMPLS:
                        model.set_attn_implementation(impl)
                        clock = _StepClock()
                        if case.loop:
                            out = _greedy_loop(model, ids, mask, new_tokens, clock)
                        else:
                            out = model.generate(input_ids=ids, attention_mask=mask, logits_processor=LogitsProcessorList([clock]),
                                                 pad_token_id=0, **settings)
                        steps[impl].extend(b - a for a, b in zip(clock.times, clock.times[1:]))
                        tokens[impl].append(out)
            rates = {impl: case.batch / statistics.median(steps[impl]) for impl in IMPLS}
            rows.append({
                "model": title, "dtype": case.dtype, "prompt": max(1, case.prompt // shrink), "batch": case.batch,
                "label": case.label(shrink), "loop": case.loop, "new_tokens": new_tokens, "rounds": rounds, "threads": threads,
                "sdpa_tokens_per_s": rates["sdpa"], "twinattn_tokens_per_s": rates["twinattn"],
                "ratio": rates["twinattn"] / rates["sdpa"], "bound": case.bound,
                "same_tokens": all(torch.equal(a, b) for a, b in zip(tokens["twinattn"], tokens["sdpa"])),
            })
            _ends(bar)
    finally:
        torch.set_num_threads(previous_torch)
        twinattn.set_num_threads(previous_twinattn)
    return rows


# twinattn.torch.attention's per-call cost on the tiny case, at most this many times the NumPy API's
OVERHEAD_BOUND = 1.3
OVERHEAD_DTYPES = ("float32", "float16", "bfloat16")


def measure_overhead(
    dtypes: Sequence[str] = OVERHEAD_DTYPES, *, calls: int = 100, rounds: int = 300, bar: Optional[Bar] = None
) -> list[dict[str, Any]]:
    """Per-call time of twinattn.torch.attention on torch tensors against twinattn.attention on
    NumPy arrays, the tiny case (B=1, H=1, Lq=Lk=16, D=64, causal), per dtype: `rounds`
    interleaved rounds of `calls` calls each, the fastest round of each. One row per dtype.

    Many short rounds (about a millisecond each): the fastest of them runs without another
    process's time slice in it, so a loaded machine gives nearly a quiet one's figures (float32 on
    2 cores beside 3 compilers: 8.8 / 12.5 us, where 7 rounds of 2000 calls gave 10.8 / 17.6 us)."""
    import numpy as np
    import torch

    import twinattn
    import twinattn.torch as twinattn_torch

    from .._torch_views import array

    _starts(bar, "e2e per-call overhead of twinattn.torch.attention against the NumPy API (tiny case)")
    rows = []
    generator = torch.Generator().manual_seed(2)
    for dtype in dtypes:
        q, k, v = (torch.randn(1, 1, 16, 64, generator=generator).to(getattr(torch, dtype)) for _ in range(3))
        qa, ka, va = array("q", q), array("k", k), array("v", v)
        best = {"numpy": np.inf, "torch": np.inf}
        for _ in range(rounds):
            for api, call in (("numpy", lambda: twinattn.attention(qa, ka, va, causal=True)),
                              ("torch", lambda: twinattn_torch.attention(q, k, v, causal=True))):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                best[api] = min(best[api], (time.perf_counter() - start) / calls)
        rows.append({"dtype": dtype, "numpy_us": best["numpy"] * 1e6, "torch_us": best["torch"] * 1e6,
                     "ratio": best["torch"] / best["numpy"], "bound": OVERHEAD_BOUND})
    _ends(bar)
    return rows


def format_generate(rows: Sequence[dict[str, Any]]) -> str:
    """The plain-generate() rows as a table."""
    lines = [f"{'model':22} {'dtype':8} {'prompts':50} {'sdpa tok/s':>10} {'twinattn':>9} {'ratio':>6}  tokens"]
    for r in rows:
        same = "the same" if r["same_tokens"] else "DIFFERENT"
        lines.append(f"{r['model']:22} {r['dtype']:8} {r['label']:50} {r['sdpa_tokens_per_s']:>10.1f} "
                     f"{r['twinattn_tokens_per_s']:>9.1f} {r['ratio']:>5.2f}x  {same}")
    return "\n".join(lines)


def format_overhead(rows: Sequence[dict[str, Any]]) -> str:
    """The per-call overhead rows as a table."""
    lines = [f"{'dtype':8} {'NumPy API':>10} {'twinattn.torch':>14} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['dtype']:8} {r['numpy_us']:>8.2f}us {r['torch_us']:>12.2f}us {r['ratio']:>5.2f}x")
    return "\n".join(lines)


def generate_targets(generate: Sequence[dict[str, Any]], overhead: Sequence[dict[str, Any]]) -> str:
    """A target line per plain-generate() case (twinattn / sdpa decode tokens/s, and the same
    tokens) and per overhead dtype (twinattn.torch.attention / NumPy API per call)."""
    lines = []
    for r in generate:
        verdict = "met" if r["ratio"] >= r["bound"] else f"missed by {100 * (1 - r['ratio'] / r['bound']):.0f}%"
        if not r["same_tokens"]:
            verdict += "; tokens DIFFER from sdpa's"
        how = "" if r.get("loop") else "plain generate(), "
        lines.append(f"{r['model']} {r['dtype']}: {how}{r['label']}: twinattn / sdpa decode tokens/s "
                     f"{r['ratio']:.2f}x (>= {r['bound']}x): {verdict}")
    for r in overhead:
        verdict = "met" if r["ratio"] <= r["bound"] else f"missed by {100 * (r['ratio'] / r['bound'] - 1):.0f}%"
        lines.append(f"twinattn.torch.attention / NumPy API per call, tiny case, {r['dtype']}: {r['ratio']:.2f}x "
                     f"(<= {r['bound']}x): {verdict}")
    return "\n".join(lines)


def _row(
    title: str,
    impl: str, cache: str, phase: str, context: int, threads: int, rate: float, ms: float, dtype: str, **extra: float
) -> dict[str, Any]:
    return {
        "model": title,
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
    """A plain table, with twinattn's speedup over sdpa on each (model, dtype, phase, context)."""
    width = max([len("model")] + [len(str(r.get("model", ""))) for r in rows])
    header = (
        f"{'model':{width}} {'dtype':8} {'phase':8} {'context':>7} {'impl':22} {'tokens/s':>9} {'ms':>9} {'vs sdpa':>8}  "
        "split per step (ms) / note"
    )
    lines = [header]

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r.get("model"), r.get("dtype"), r["phase"], r["context"]

    base = {key(r): r["tokens_per_s"] for r in rows if r["impl"].startswith("sdpa") and r.get("tokens_per_s")}
    order = list(dict.fromkeys(r.get("model", "") for r in rows))  # models in the order they ran
    for r in sorted(rows, key=lambda r: (order.index(r.get("model", "")), r.get("dtype", ""), r["phase"], r["context"],
                                         r["impl"])):
        model, dtype = r.get("model", ""), r.get("dtype", "float32")
        if r.get("status", "ok") != "ok":
            lines.append(f"{model:{width}} {dtype:8} {'-':8} {'-':>7} {r['impl']:22} {'error':>9}  {r.get('note', '')}")
            continue
        ref = base.get(key(r))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        extra = ""
        if r["phase"] == "decode":
            extra = "  ".join(f"{k[:-3]} {r[k]:.1f}" for k in ("matmul_ms", "attention_ms", "cache_ms", "rest_ms"))
        elif r.get("max_logit_diff") is not None:
            extra = f"last-position logits differ from sdpa's by at most {r['max_logit_diff']:.2e}"
        lines.append(
            f"{model:{width}} {dtype:8} {r['phase']:8} {r['context']:>7} {r['impl']:22} {r['tokens_per_s']:>9.1f} "
            f"{r['ms']:>9.1f} {ratio:>8}  {extra}"
        )
    return "\n".join(lines)


def verdict(value: Optional[float], bound: float, at_most: bool = False) -> str:
    """"met", "missed by N%" or "not measured": `value` against a target of at least (at most) `bound`."""
    if value is None:
        return "not measured"
    if (value <= bound) if at_most else (value >= bound):
        return "met"
    return f"missed by {100 * abs(value / bound - 1):.0f}%"


def targets(rows: Sequence[dict[str, Any]], plans: dict[str, Plan], shrink: int = 1) -> str:
    """The end-to-end targets that these rows speak to, per model (`plans`: its Plan by the rows'
    "model") and dtype: twinattn's decode step at growth_at against its own at the first context,
    its decode and prefill tokens/s against sdpa's; a model without targets gets its ratios to
    sdpa at the longest context, reported. Contexts as the plan's, divided by `shrink`."""

    def rate(model: str, dtype: str, impl: str, phase: str, context: int) -> Optional[float]:
        found = [r["tokens_per_s"] for r in rows if (r.get("model"), r.get("dtype"), r["phase"], r["context"])
                 == (model, dtype, phase, context) and r["impl"].startswith(impl) and r.get("status", "ok") == "ok"]
        return found[0] if found else None

    def ratio(model: str, dtype: str, phase: str, context: int) -> Optional[float]:
        ours, theirs = rate(model, dtype, "twinattn", phase, context), rate(model, dtype, "sdpa", phase, context)
        return ours / theirs if ours and theirs else None

    def text(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def at(n: int) -> int:
        return max(1, n // shrink)

    lines = []
    for model in dict.fromkeys(r.get("model", "") for r in rows):
        plan = plans.get(model)
        if plan is None:
            continue
        for dtype in dict.fromkeys(r.get("dtype", "float32") for r in rows if r.get("model") == model):
            name = f"{model} {dtype}:"
            if plan.growth_at is not None:
                short, long = at(plan.contexts[0]), at(plan.growth_at)
                ours_short = rate(model, dtype, "twinattn", "decode", short)
                ours_long = rate(model, dtype, "twinattn", "decode", long)
                growth = ours_short / ours_long if ours_short and ours_long else None
                lines.append(f"{name} twinattn decode step at {long} / at {short}: {text(growth)} "
                             f"(<= {plan.growth}x): {verdict(growth, plan.growth, True)}")
            for context, bound in plan.decode:
                value = ratio(model, dtype, "decode", at(context))
                lines.append(f"{name} twinattn / sdpa decode tokens/s at {at(context)}: {text(value)} "
                             f"(>= {bound}x): {verdict(value, bound)}")
            for length, bound in plan.prefill_ratio:
                value = ratio(model, dtype, "prefill", at(length))
                lines.append(f"{name} twinattn / sdpa prefill tokens/s of {at(length)}: {text(value)} "
                             f"(>= {bound}x): {verdict(value, bound)}")
            if not (plan.growth_at or plan.decode or plan.prefill_ratio):
                longest, prompt = at(plan.contexts[-1]), at(plan.prefill[-1])
                lines.append(f"{name} twinattn / sdpa decode tokens/s at {longest}: "
                             f"{text(ratio(model, dtype, 'decode', longest))}, prefill of {prompt}: "
                             f"{text(ratio(model, dtype, 'prefill', prompt))} (reported; no target)")
    return "\n".join(lines)


def run_case(
    dtypes: Sequence[str],
    threads: int,
    steps: int = 16,
    shrink: int = 1,
    progress: Optional[TextIO] = sys.stderr,
    names: Sequence[str] = tuple(PLANS),
    bar: Optional[Bar] = None,
) -> dict[str, Any]:
    """The end-to-end case of twinattn-bench: each model of `names` (twinattn.models names) loaded
    once (load_model), then measure() in each of `dtypes` (a copy of the model in that dtype) at its
    Plan's contexts and prefill lengths divided by `shrink`, and measure_generate() on its Plan's
    plain-generate() cases (entry "generate"); then, once, measure_overhead() (entry "overhead"). A model whose package is not installed
    is skipped, one that fails to load reported, and the others run. Returns the JSON's "e2e"
    entry: settings, per-model plans (or why not run), rows, and the versions of torch and
    transformers. `bar` moves units(names, dtypes, shrink) steps in all."""
    import torch
    import transformers

    entry: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "steps": steps,
        "shrink": shrink,
        "dtypes": list(dtypes),
        "models": {},
        "rows": [],
    }
    for name in names:
        title, plan = models.MODELS[name].title, PLANS[name]
        why = missing(name)
        if why is not None:
            entry["models"][name] = {"title": title, "skipped": why}
            _say(progress, f"[e2e] {title}: not run ({why})")
            continue
        contexts, prefill = _lengths(plan, shrink)
        _say(progress, f"[e2e] loading {title} ...")
        _starts(bar, f"e2e loading {title} (converted from its GGUF the first time: up to a few minutes)")
        try:
            base = load_model(name)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the status; the other models run
            entry["models"][name] = {"title": title, "error": f"{type(exc).__name__}: {exc}"}
            continue
        _ends(bar)
        entry["models"][name] = {"title": title, "contexts": contexts, "prefill": prefill}
        for dtype in dtypes:
            model = model_in(base, dtype)
            entry["rows"] += measure(model, contexts=contexts, prefill=prefill, steps=steps, threads=threads,
                                     progress=progress, title=title, bar=bar)
            del model
        if plan.generate:
            _say(progress, f"[e2e] {title}: plain generate() ...")
            entry.setdefault("generate", []).extend(
                measure_generate(base, plan.generate, new_tokens=max(steps, 2), shrink=shrink, threads=threads, title=title, bar=bar)
            )
        del base
    if entry["models"] and any("contexts" in m for m in entry["models"].values()):
        entry["overhead"] = measure_overhead(bar=bar)
    return entry


# ---- serving: many requests through transformers' continuous batching --------------------------------

SERVING = "e2e-serving"  # its --cases name: opt in (a few minutes), a full run leaves it out
SERVING_MODEL = "smollm2"
SERVING_REQUESTS = (16, 32)
SERVING_NEW_TOKENS = 32
SERVING_PROMPTS = (32, 512)  # each request's prompt length, drawn uniformly from this range (seeded)
# the ways each set of requests is generated: continuous batching with each attention, and a padded
# static batch through generate()
SERVING_WAYS = ("twinattn+generate_batch", "sdpa+generate_batch", "sdpa+generate(padded)")
# twinattn generate_batch's tokens/s at the most requests over those at the fewest: at least this
SERVING_SCALE_TARGET = 1.3
# what a first generate_batch call (a fresh manager: its paged cache made) spends beyond the
# prefill of its prompts: at most this many seconds
SERVING_FIRST_CALL_TARGET_S = 2.0
SERVING_TEXT = (
    f"{models.MODELS[SERVING_MODEL].title}: {' and '.join(map(str, SERVING_REQUESTS))} requests of "
    f"{SERVING_PROMPTS[0]}-{SERVING_PROMPTS[1]} prompt tokens, {SERVING_NEW_TOKENS} new tokens each: generate_batch "
    "with twinattn and with sdpa (warm manager), and a padded batch through generate() with sdpa (opt-in: --cases "
    f"{SERVING})"
)


def serving_units(requests: Sequence[int] = SERVING_REQUESTS) -> int:
    """The steps measure_serving moves its bar by (run_serving_case adds one for the loading)."""
    return len(requests) * len(SERVING_WAYS)


def measure_serving(
    model: Any,
    *,
    requests: Sequence[int] = SERVING_REQUESTS,
    new_tokens: int = SERVING_NEW_TOKENS,
    prompt_lengths: Tuple[int, int] = SERVING_PROMPTS,
    threads: int = 2,
    progress: Optional[TextIO] = sys.stderr,
    title: Optional[str] = None,
    bar: Optional[Bar] = None,
) -> list[dict[str, Any]]:
    """Generated tokens/s of `model` serving `requests` greedy requests at once (each count in
    turn), each of a random prompt (lengths uniform in `prompt_lengths`, the same for every way) and
    `new_tokens` new tokens, every way of SERVING_WAYS:

    - generate_batch (transformers' continuous batching) with twinattn and with sdpa: a first call on
      other prompts of the same lengths warms the manager (persistent_manager=True), the second is
      timed; the paged cache is sized to the work (twinattn.hf.continuous_batching_config), not to
      the free memory, and no prefix is shared between the calls;
    - a static batch through generate() with sdpa: the prompts left-padded to the longest.

    Rows: model, dtype, impl (the way), phase "serving", requests, new_tokens, prompt_tokens,
    threads, tokens_per_s (generated tokens over the call's seconds), ms, status, and same_tokens:
    whether the way's tokens are sdpa generate_batch's. twinattn's must be (status "wrong"
    otherwise); the padded batch's are reported (its padding changes the floats it rounds).
    generate_batch's rows also carry first_call_ms, prefill_ms, attention_ms, cache_ms and
    split_call_ms (_serve says what each is)."""
    from .. import hf  # noqa: F401  registers "twinattn"

    dtype = dtype_of(model)
    title = title or model.config.model_type
    rows: list[dict[str, Any]] = []
    with _threads(threads), _continuous_batching_quiet():
        for count in requests:
            warm, timed = _serving_prompts(count, model.config.vocab_size, prompt_lengths)
            tokens: dict[str, list[list[int]]] = {}
            for way in SERVING_WAYS:
                _starts(bar, f"{SERVING} {title} {dtype}: {count} requests, {way}")
                base = {"model": title, "dtype": dtype, "impl": way, "phase": "serving", "requests": count,
                        "new_tokens": new_tokens, "prompt_tokens": sum(map(len, timed)), "threads": threads}
                try:
                    seconds, tokens[way], split = _serve(model, way, warm, timed, new_tokens)
                except Exception as exc:  # noqa: BLE001 - one way failing must not stop the others
                    message = f"{type(exc).__name__}: {exc}"
                    _say(progress, f"[{SERVING}] {title} {way} {dtype}: error: {message}")
                    rows.append({**base, "tokens_per_s": None, "ms": None, "status": "error", "note": message})
                    continue
                finally:
                    _ends(bar)
                rate = count * new_tokens / seconds
                rows.append({**base, "tokens_per_s": rate, "ms": seconds * 1e3, "status": "ok", **split})
                _say(progress, f"[{SERVING}] {title} {dtype}: {count} requests, {way}: {rate:.1f} tokens/s")
            reference = tokens.get("sdpa+generate_batch")
            for row in rows[-len(SERVING_WAYS):]:
                if row["status"] == "ok" and row["impl"] != "sdpa+generate_batch" and reference is not None:
                    row["same_tokens"] = tokens[row["impl"]] == reference
                    if row["impl"].startswith("twinattn") and not row["same_tokens"]:
                        row["status"] = "wrong"
    return rows


def _serving_prompts(count: int, vocab: int, lengths: Tuple[int, int]) -> Tuple[list[list[int]], list[list[int]]]:
    """Two sets of `count` random prompts of the same lengths (seeded): the warm-up call's and the timed one's."""
    import torch

    generator = torch.Generator().manual_seed(count)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist()
    return tuple(  # type: ignore[return-value]
        [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in sizes] for _ in range(2)
    )


def _serve(
    model: Any, way: str, warm: list[list[int]], prompts: list[list[int]], new_tokens: int
) -> Tuple[float, list[list[int]], dict[str, float]]:
    """(seconds, each request's new tokens, split) of one way of SERVING_WAYS on `prompts`. For
    generate_batch, split holds the milliseconds of a first call on the warm-up prompts with one new
    token each, on a fresh manager (first_call_ms: its paged cache made, then every prompt's
    prefill), of the same call again on the now warm manager (prefill_ms: the prefill alone), and
    of a call after the timed one (on the warm-up prompts): the time in the attention function
    (attention_ms) and in the paged cache's update (cache_ms: the new keys and values written, and
    every key of the step gathered out of the pages where transformers gathers them), with the
    call's own (split_call_ms); the padded batch has none."""
    import torch
    from transformers import GenerationConfig

    from ..hf import continuous_batching_config

    impl, how = way.split("+")
    model.set_attn_implementation(impl)
    split: dict[str, float] = {}
    if how == "generate_batch":
        # eos -1: no request stops early, every way generates new_tokens per request
        settings = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        first_token = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0)
        config = continuous_batching_config([len(p) for p in prompts], new_tokens, allow_block_sharing=False)
        model.destroy_cached_continuous_batching_manager()
        try:
            with torch.inference_mode():
                for name in ("first_call_ms", "prefill_ms"):
                    start = time.perf_counter()
                    model.generate_batch(warm, generation_config=first_token, continuous_batching_config=config,
                                         persistent_manager=True, progress_bar=False)
                    split[name] = (time.perf_counter() - start) * 1e3
                model.generate_batch(warm, generation_config=settings, continuous_batching_config=config,
                                     persistent_manager=True, progress_bar=False)
                start = time.perf_counter()
                out = model.generate_batch(prompts, generation_config=settings, continuous_batching_config=config,
                                           persistent_manager=True, progress_bar=False)
                seconds = time.perf_counter() - start
                with _timed_attention_and_cache(impl) as (attention, cache):
                    start = time.perf_counter()
                    model.generate_batch(warm, generation_config=settings, continuous_batching_config=config,
                                         persistent_manager=True, progress_bar=False)
                    split.update(attention_ms=sum(attention) * 1e3, cache_ms=sum(cache) * 1e3,
                                 split_call_ms=(time.perf_counter() - start) * 1e3)
        finally:
            model.destroy_cached_continuous_batching_manager()
        generated = [result.generated_tokens for result in out.values()]
    else:
        settings = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        longest = max(map(len, prompts))
        ids = torch.zeros((len(prompts), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
            seconds = time.perf_counter() - start
        generated = out[:, longest:].tolist()
    if len(generated) != len(prompts) or any(len(tokens) != new_tokens for tokens in generated):
        raise RuntimeError(f"{way}: expected {new_tokens} new tokens for each of {len(prompts)} requests, got "
                           f"{[len(tokens) for tokens in generated]}")
    return seconds, generated, split


@contextlib.contextmanager
def _timed_attention_and_cache(impl: str) -> Iterator[Tuple[list[float], list[float]]]:
    """The seconds of every call of attention implementation `impl` and of PagedAttentionCache.update
    in the block (continuous batching's generation thread makes them), collected into two lists."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import PagedAttentionCache

    attention: list[float] = []
    cache: list[float] = []
    original, update = AttentionInterface._global_mapping[impl], PagedAttentionCache.update
    AttentionInterface._global_mapping[impl] = _timed(attention, original)
    PagedAttentionCache.update = _timed(cache, update)
    try:
        yield attention, cache
    finally:
        AttentionInterface._global_mapping[impl] = original
        PagedAttentionCache.update = update


@contextlib.contextmanager
def _continuous_batching_quiet() -> Iterator[None]:
    """transformers' continuous-batching logger held to errors for the block (its warnings about
    persistent managers and eos tokens are not the benchmark's output)."""
    import logging

    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def format_serving_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A plain table of measure_serving's rows, with each way's tokens/s against sdpa generate_batch's."""
    lines = [f"{'model':24} {'dtype':8} {'requests':>8} {'impl':24} {'tokens/s':>9} {'ms':>9} {'vs sdpa':>8}  note"]
    base = {(r["model"], r["dtype"], r["requests"]): r["tokens_per_s"] for r in rows
            if r["impl"] == "sdpa+generate_batch" and r.get("tokens_per_s")}
    for r in rows:
        if r.get("tokens_per_s") is None:
            lines.append(f"{r['model']:24} {r['dtype']:8} {r['requests']:>8} {r['impl']:24} {'error':>9}  {r.get('note', '')}")
            continue
        ref = base.get((r["model"], r["dtype"], r["requests"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        same = r.get("same_tokens")
        note = "" if same is None else "tokens = sdpa generate_batch's" if same else "tokens differ from sdpa generate_batch's"
        if r["status"] == "wrong":
            note = "WRONG: " + note
        if r.get("split_call_ms"):
            note += (f"{'; ' if note else ''}a call of {r['split_call_ms']:.0f} ms: attention {r['attention_ms']:.0f}, "
                     f"cache update {r['cache_ms']:.0f}; prefill {r['prefill_ms']:.0f}, first call "
                     f"{r['first_call_ms']:.0f}")
        lines.append(f"{r['model']:24} {r['dtype']:8} {r['requests']:>8} {r['impl']:24} {r['tokens_per_s']:>9.1f} "
                     f"{r['ms']:>9.1f} {ratio:>8}  {note}")
    return "\n".join(lines + serving_targets(rows))


def serving_targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The serving targets of twinattn generate_batch, per model and dtype: its tokens/s at the most
    requests over those at the fewest (>= SERVING_SCALE_TARGET), with the share of each call that is
    the prompts' prefill (prefill_ms / ms: linear in the prompts, it bounds that ratio), and the
    time a first call spends beyond its prefill (first_call_ms - prefill_ms, at most
    SERVING_FIRST_CALL_TARGET_S), the most over the request counts."""
    lines = []
    ours = [r for r in rows if r["impl"] == "twinattn+generate_batch" and r["status"] == "ok"]
    for model, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in ours):
        mine = sorted((r for r in ours if (r["model"], r["dtype"]) == (model, dtype)), key=lambda r: r["requests"])
        few, most = mine[0], mine[-1]
        if most["requests"] > few["requests"]:
            scale = most["tokens_per_s"] / few["tokens_per_s"]
            shares = ", ".join(f"{100 * r['prefill_ms'] / r['ms']:.0f}% at {r['requests']}" for r in (few, most))
            lines.append(f"{model} {dtype}: twinattn generate_batch tokens/s at {most['requests']} requests / at "
                         f"{few['requests']}: {scale:.2f}x (>= {SERVING_SCALE_TARGET}x): {verdict(scale, SERVING_SCALE_TARGET)}"
                         f"; the prompts' prefill is {shares} of the call")
        beyond = max((r["first_call_ms"] - r["prefill_ms"]) / 1e3 for r in mine)
        lines.append(f"{model} {dtype}: twinattn generate_batch's first call beyond its prefill: {beyond:.2f} s "
                     f"(<= {SERVING_FIRST_CALL_TARGET_S:g} s): {verdict(beyond, SERVING_FIRST_CALL_TARGET_S, True)}")
    return lines


def run_serving_case(
    dtypes: Sequence[str], threads: int, shrink: int = 1, progress: Optional[TextIO] = sys.stderr, bar: Optional[Bar] = None
) -> dict[str, Any]:
    """The serving case of twinattn-bench (--cases e2e-serving): SERVING_MODEL loaded once, then
    measure_serving in each of `dtypes`, prompt lengths and new tokens divided by `shrink`. Returns
    the JSON's "e2e_serving" entry: settings, rows and versions, or {"skipped": why}, or
    {"error": message} when the model failed to load. `bar` moves serving_units() + 1 steps."""
    import torch
    import transformers

    why = missing(SERVING_MODEL)
    if why is not None:
        _ends(bar)
        return {"skipped": why}
    new_tokens = max(1, SERVING_NEW_TOKENS // shrink)
    lengths = (max(1, SERVING_PROMPTS[0] // shrink), max(1, SERVING_PROMPTS[1] // shrink))
    entry: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
                             "requests": list(SERVING_REQUESTS), "new_tokens": new_tokens, "prompt_lengths": list(lengths),
                             "dtypes": list(dtypes), "rows": []}
    title = models.MODELS[SERVING_MODEL].title
    _starts(bar, f"{SERVING} loading {title}")
    try:
        base = load_model(SERVING_MODEL)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the status
        _ends(bar)
        return {"error": f"{type(exc).__name__}: {exc}"}
    _ends(bar)
    for dtype in dtypes:
        entry["rows"] += measure_serving(model_in(base, dtype), new_tokens=new_tokens, prompt_lengths=lengths,
                                         threads=threads, progress=progress, title=title, bar=bar)
    return entry


def plans_by_title() -> dict[str, Plan]:
    """PLANS keyed by the models' titles (the rows' "model")."""
    return {models.MODELS[name].title: plan for name, plan in PLANS.items()}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinattn.bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(PLANS), help="the model (default smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=_ints, help="decode contexts (comma-separated; default the model's plan)")
    parser.add_argument("--prefill", type=_ints, help="prefill lengths (comma-separated; default the model's plan)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--impls", default=",".join(IMPLS), help="attention implementations (comma-separated)")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (comma-separated)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    try:
        dtypes = parse_dtypes(args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    why = missing(args.model)
    if why is not None:
        parser.error(f"--model {args.model} {why}")
    plan, title = PLANS[args.model], models.MODELS[args.model].title
    _say(sys.stderr, f"[e2e] loading {title} ...")
    base = load_model(args.model)
    rows = []
    for dtype in dtypes:
        rows += measure(
            model_in(base, dtype),
            impls=[i for i in args.impls.split(",") if i],
            contexts=args.contexts or plan.contexts,
            prefill=args.prefill or plan.prefill,
            steps=args.steps,
            threads=args.threads,
            title=title,
        )
    print(format_rows(rows))
    print(targets(rows, plans_by_title()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
