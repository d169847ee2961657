"""One benchmark per (case, backend); `pytest benchmarks/ --benchmark-only` (see conftest.py)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import pytest
import twinattn
from twinattn.bench import measure, runners
from twinattn.bench.cases import DECODE, Case, check_output, work

RUNNERS = runners.make_runners()


def test_attention(
    benchmark: Any,
    case: Case,
    backend: str,
    problem_for: Callable[[Case], Any],
    rates: measure.Rates,
    request: pytest.FixtureRequest,
) -> None:
    runner = RUNNERS[backend]
    why = runner.available() or runner.supports(case)
    if why:
        pytest.skip(f"{backend}: {why}")
    config = request.config
    max_call = config.getoption("--bench-max-call")
    threads = case.threads or twinattn.get_num_threads()
    need = runner.peak_bytes(case)
    if need > 8 << 30:
        pytest.skip(f"{backend} needs ~{need / 2**30:.1f} GiB of scratch on {case.name}")
    predicted = measure.estimate_call_s(runner, case, threads, rates)
    if predicted is not None and predicted > max_call:
        pytest.skip(f"too slow: ~{predicted:.1f} s per call estimated (> {max_call:g} s)")

    problem, (rows, reference) = problem_for(case)
    w = work(case)
    benchmark.group = case.name
    benchmark.extra_info.update(
        {
            "case": case.name,
            "backend": backend,
            "threads": threads,
            "pairs": w.pairs,
            "flops": w.flops,
            "kv_bytes": w.kv_bytes,
            "shape": case.shape_text(),
        }
    )
    with runners.prepared(runner, problem, threads) as ready:
        t0 = time.perf_counter()
        ready.call()
        first = time.perf_counter() - t0
        check = check_output(problem, ready.output(), rows, reference)
        assert check.ok, f"{backend} is WRONG on {case.name}: {check.reason}"
        if first > max_call:
            pytest.skip(f"too slow: first call {first:.1f} s (> {max_call:g} s)")
        rounds = max(3, min(1000, math.ceil(config.getoption("--bench-time") / max(first, 1e-6))))
        benchmark.pedantic(ready.call, rounds=rounds, warmup_rounds=1, iterations=1)
        after = check_output(problem, ready.output(), rows, reference)
        assert after.ok, f"{backend} is WRONG on {case.name} after timing: {after.reason}"
    benchmark.extra_info["max_abs_err"] = max(check.max_abs_err, after.max_abs_err)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        rates.record(backend, case, threads, median)
        benchmark.extra_info["gflops"] = w.flops / median / 1e9
        benchmark.extra_info["gbps"] = w.kv_bytes / median / 1e9 if case.kind == DECODE else None
