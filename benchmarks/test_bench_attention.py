"""One benchmark per (case, backend); `pytest benchmarks/ --benchmark-only` (see conftest.py).

The skip rules and checks are twinattn-bench's (timing.py); pytest-benchmark does the timing. The
layer case times its first part, the nn.Attention step, with the cache cropped back (untimed)
before every round."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import twinattn
from twinattn.bench import peers, suite, timing

RUNNERS = peers.make_runners()


def test_attention(
    benchmark: Any,
    case: suite.Case,
    backend: str,
    problem_for: Callable[[suite.Case], Any],
    rates: timing.Rates,
    request: pytest.FixtureRequest,
) -> None:
    runner = RUNNERS[backend]
    why = runner.available() or runner.supports(case)
    if why:
        pytest.skip(f"{backend}: {why}")
    max_call = request.config.getoption("--bench-max-call")
    threads = case.threads or twinattn.get_num_threads()
    need = runner.peak_bytes(case)
    if need > 8 << 30:
        pytest.skip(f"{backend} needs ~{need / 2**30:.1f} GiB of scratch on {case.name}")
    predicted = timing.estimate_call_s(runner, case, threads, rates)
    if predicted is not None and predicted > max_call:
        pytest.skip(f"too slow: ~{predicted:.1f} s per call estimated (> {max_call:g} s)")

    problem, w = problem_for(case), suite.work(case)
    benchmark.group = case.name
    info = {"case": case.name, "backend": backend, "threads": threads, "shape": case.shape_text()}
    benchmark.extra_info.update(info, pairs=w.pairs, flops=w.flops, kv_bytes=w.kv_bytes)
    with peers.prepared(runner, problem, threads) as ready:
        part = ready.parts[0]
        first = timing.timed_call(part)
        check = problem.check(part.output())
        assert check.ok, f"{backend} is WRONG on {case.name}: {check.reason}"
        if first > max_call:
            pytest.skip(f"too slow: first call {first:.1f} s (> {max_call:g} s)")
        rounds = max(3, min(1000, math.ceil(request.config.getoption("--bench-time") / max(first, 1e-6))))
        benchmark.pedantic(part.call, setup=part.reset, rounds=rounds, warmup_rounds=1, iterations=1)
        after = problem.check(part.output())
        assert after.ok, f"{backend} is WRONG on {case.name} after timing: {after.reason}"
    benchmark.extra_info["max_abs_err"] = max(check.max_abs_err, after.max_abs_err)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        rates.record(backend, case, threads, median)
        benchmark.extra_info["gflops"] = w.flops / median / 1e9 if case.kind != suite.LAYER else None
        benchmark.extra_info["gbps"] = w.kv_bytes / median / 1e9 if case.kind == suite.DECODE else None
