"""Honest timing of one (case, backend): check first, warm up, then time until the budget is spent.

1. Skip what cannot run: an unsupported case, a backend whose scratch memory would not fit, or a
   call predicted to take longer than `max_call_s` (predicted from the backend's rate on an earlier
   case of the same kind and thread count, or from two calls on the case shrunk 4-8x).
2. The first call's output (a NaN-filled buffer where the backend writes in place) is checked
   against the float64 reference on a subset of rows; a wrong result stops here, untimed.
3. Warm-up calls (none beyond the checked call when that took over 0.5 s), then timed calls,
   each timed alone with perf_counter and the garbage collector off: at least `min_repeats`,
   then more until `time_s` is spent (or exactly --repeat calls).
4. The last timed call's output is checked again, so what was timed is what was checked.

The layer case (run_layer) follows the same rules for one nn.Attention decode step, with the
cache cropped back before every step (outside the timed region), then times the attention kernel
alone on the same cache views the same way; the step's output and the kernel's are both checked
against the float64 recomputation, before and after timing.

The two native ports are then timed once more, alternately (run_pair): both prepared at once,
calls taken in turns (C++ then Rust, Rust then C++ in the next round, and so on), each timed
alone, both outputs checked before and after. Machines like these drift by tens of percent over
seconds; drift then slows both ports alike, so the C++/Rust ratio is read from these medians.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .cases import (
    DECODE,
    Case,
    LAYER,
    Check,
    LayerExpected,
    LayerProblem,
    Problem,
    check_close,
    check_output,
    check_rows,
    make_problem,
    reference_rows,
    work,
)
from .runners import Runner, prepared, prepared_layer


@dataclass
class Budget:
    time_s: float = 2.0  # timed calls stop once this much time is spent (after min_repeats)
    min_repeats: int = 3
    max_repeats: int = 2000
    repeat: Optional[int] = None  # --repeat: exactly this many timed calls
    max_call_s: float = 10.0  # a call predicted slower than this is skipped
    memory_bytes: int = 8 << 30  # scratch memory a backend may need beyond inputs and output
    warmup_s: float = 0.05  # warm-up calls continue (up to 10) until this much time is spent


@dataclass
class Outcome:
    status: str  # "ok", "wrong", "skipped", "error"
    note: str = ""
    times: Optional[list[float]] = None
    warmup: int = 0
    first_call_s: Optional[float] = None
    check: Optional[Check] = None
    # the layer case: the attention kernel alone, timed beside the step (times are the steps')
    kernel_times: Optional[list[float]] = None
    kernel_check: Optional[Check] = None

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    @property
    def kernel_median_s(self) -> Optional[float]:
        return statistics.median(self.kernel_times) if self.kernel_times else None


# A case this small is simply run: probing it would cost as much as running it.
PROBE_ABOVE_FLOPS = 20e9
PROBE_ABOVE_BYTES = 1 << 30


class Rates:
    """Per (backend, kind, threads): work per second seen so far, to predict a bigger case."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, str, int], float] = {}

    @staticmethod
    def amount(case: Case) -> float:
        w = work(case)
        return float(w.kv_bytes if case.kind == DECODE else w.flops) or 1.0

    def predict(self, backend: str, case: Case, threads: int) -> Optional[float]:
        rate = self._rates.get((backend, case.kind, threads))
        return None if rate is None else self.amount(case) / rate

    def record(self, backend: str, case: Case, threads: int, seconds: float) -> None:
        # per-call overhead dominates small cases: their rate would predict big ones badly
        w = work(case)
        if seconds > 0 and (w.flops >= PROBE_ABOVE_FLOPS / 16 or w.kv_bytes >= PROBE_ABOVE_BYTES / 16):
            self._rates[(backend, case.kind, threads)] = self.amount(case) / seconds


def estimate_call_s(runner: Runner, case: Case, threads: int, rates: Rates) -> Optional[float]:
    """Seconds one call of a big case is expected to take (None for small cases: just run them)."""
    w = work(case)
    if w.flops <= PROBE_ABOVE_FLOPS and w.kv_bytes <= PROBE_ABOVE_BYTES:
        return None
    predicted = rates.predict(runner.name, case, threads)
    return _probe(runner, case, threads) if predicted is None else predicted


def _probe(runner: Runner, case: Case, threads: int) -> float:
    """Seconds per call predicted for `case` from the faster of two calls on a shrunk copy of it
    (the first call of a backend pays for starting threads and touching pages)."""
    factor = 8 if case.kind == DECODE else 4
    small = case.shrunk(factor)
    problem = make_problem(small)
    seconds = math.inf
    with prepared(runner, problem, threads) as ready:
        for _ in range(2):
            t0 = time.perf_counter()
            ready.call()
            seconds = min(seconds, time.perf_counter() - t0)
    return seconds * Rates.amount(case) / Rates.amount(small)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def run_one(
    runner: Runner,
    problem: Problem,
    threads: int,
    budget: Budget,
    rates: Rates,
    expected: tuple[list[tuple[int, int, int]], np.ndarray],
    between: Callable[[], None] = lambda: None,
) -> Outcome:
    """Check, warm up and time `runner` on `problem` (see the module docstring)."""
    case = problem.case
    if case.kind == LAYER:
        raise ValueError(f"run_one: {case.name} is a layer case; use run_layer")
    why = runner.supports(case)
    if why is not None:
        return Outcome("skipped", f"unsupported: {why}")
    need = runner.peak_bytes(case)
    if need > budget.memory_bytes:
        return Outcome("skipped", f"needs ~{_fmt_bytes(need)} of scratch (> {_fmt_bytes(budget.memory_bytes)} allowed)")
    try:
        predicted = estimate_call_s(runner, case, threads, rates)
        if predicted is not None and predicted > budget.max_call_s:
            return Outcome(
                "skipped", f"too slow: ~{predicted:.1f} s per call estimated (> {budget.max_call_s:g} s budget)"
            )
        between()
        rows, reference = expected
        with prepared(runner, problem, threads) as ready:
            t0 = time.perf_counter()
            ready.call()
            first = time.perf_counter() - t0
            check = check_output(problem, ready.output(), rows, reference)
            if not check.ok:
                return Outcome("wrong", f"WRONG: {check.reason}", first_call_s=first, check=check)
            if first > budget.max_call_s:
                rates.record(runner.name, case, threads, first)
                return Outcome(
                    "skipped",
                    f"too slow: first call {first:.1f} s (> {budget.max_call_s:g} s budget)",
                    first_call_s=first,
                    check=check,
                )
            warmup = _warm_up(ready.call, first, budget)
            times = _time_calls(ready.call, budget)
            after = check_output(problem, ready.output(), rows, reference)
            note = "; ".join(ready.notes)
        if not after.ok:
            return Outcome("wrong", f"WRONG after timing: {after.reason}", first_call_s=first, check=after)
        rates.record(runner.name, case, threads, statistics.median(times))
        check = after if after.max_abs_err > check.max_abs_err else check
        return Outcome("ok", note, times=times, warmup=warmup, first_call_s=first, check=check)
    except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the run
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Outcome("error", f"error: {detail}")


def run_layer(
    runner: Runner,
    problem: LayerProblem,
    threads: int,
    budget: Budget,
    expected: LayerExpected,
    between: Callable[[], None] = lambda: None,
) -> Outcome:
    """Check, warm up and time one nn.Attention step, the cache cropped back before each step
    (untimed); then the kernel alone on the same views. `times` are the steps', `kernel_times`
    the kernel's."""
    case = problem.case
    why = runner.supports(case)
    if why is not None:
        return Outcome("skipped", why)
    need = runner.peak_bytes(case)
    if need > budget.memory_bytes:
        return Outcome("skipped", f"needs ~{_fmt_bytes(need)} of scratch (> {_fmt_bytes(budget.memory_bytes)} allowed)")
    try:
        between()
        with prepared_layer(runner, problem, threads) as ready:
            ready.reset()
            t0 = time.perf_counter()
            ready.step()
            first = time.perf_counter() - t0
            check = check_close(ready.output(), expected.out, "step output")
            if not check.ok:
                return Outcome("wrong", f"WRONG: {check.reason}", first_call_s=first, check=check)
            t0 = time.perf_counter()
            ready.kernel()
            kernel_first = time.perf_counter() - t0
            kernel_check = check_close(ready.kernel_output(), expected.attn, "kernel output")
            if not kernel_check.ok:
                return Outcome(
                    "wrong", f"WRONG: {kernel_check.reason}", first_call_s=first, check=check, kernel_check=kernel_check
                )
            if first > budget.max_call_s:
                return Outcome(
                    "skipped",
                    f"too slow: first step {first:.1f} s (> {budget.max_call_s:g} s budget)",
                    first_call_s=first,
                    check=check,
                )
            warmup = _warm_up(ready.step, first, budget, untimed=ready.reset)
            times = _time_calls(ready.step, budget, untimed=ready.reset)
            after = check_close(ready.output(), expected.out, "step output")
            _warm_up(ready.kernel, kernel_first, budget)
            kernel_times = _time_calls(ready.kernel, budget)
            kernel_after = check_close(ready.kernel_output(), expected.attn, "kernel output")
            note = "; ".join(ready.notes)
        for final, what in ((after, "step"), (kernel_after, "kernel")):
            if not final.ok:
                return Outcome("wrong", f"WRONG after timing ({what}): {final.reason}", first_call_s=first, check=final)
        check = after if after.max_abs_err > check.max_abs_err else check
        kernel_check = kernel_after if kernel_after.max_abs_err > kernel_check.max_abs_err else kernel_check
        return Outcome(
            "ok",
            note,
            times=times,
            warmup=warmup,
            first_call_s=first,
            check=check,
            kernel_times=kernel_times,
            kernel_check=kernel_check,
        )
    except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the run
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Outcome("error", f"error: {detail}")


@dataclass
class _Turn:
    """One backend's part in an alternate timing."""

    name: str
    call: Callable[[], Any]  # the timed call
    check: Callable[[], Check]  # its latest output against the reference
    reset: Optional[Callable[[], Any]] = None  # untimed, before each call


def _checker(output: Callable[[], np.ndarray], check: Callable[[np.ndarray], Check]) -> Callable[[], Check]:
    return lambda: check(output())


def _take_turns(turns: Sequence[_Turn], budget: Budget) -> tuple[Optional[list[list[float]]], str]:
    """Check and warm up each, time them alternately, check each again."""
    for turn in turns:
        if turn.reset is not None:
            turn.reset()
        t0 = time.perf_counter()
        turn.call()
        first = time.perf_counter() - t0
        check = turn.check()
        if not check.ok:
            return None, f"{turn.name} WRONG: {check.reason}"
        _warm_up(turn.call, first, budget, untimed=turn.reset)
    times = _time_alternately([t.call for t in turns], budget, untimed=[t.reset for t in turns])
    for turn in turns:
        after = turn.check()
        if not after.ok:
            return None, f"{turn.name} WRONG after timing: {after.reason}"
    return times, ""


def run_pair(
    runners: Sequence[Runner],
    problem: Problem,
    threads: int,
    budget: Budget,
    expected: tuple[list[tuple[int, int, int]], np.ndarray],
) -> tuple[Optional[list[list[float]]], str]:
    """`runners` timed alternately on `problem` (see the module docstring): one list of times per
    runner, or None and why not."""
    rows, reference = expected
    try:
        with contextlib.ExitStack() as stack:
            turns = []
            for runner in runners:
                ready = stack.enter_context(prepared(runner, problem, threads))
                check = _checker(ready.output, lambda out: check_output(problem, out, rows, reference))
                turns.append(_Turn(runner.name, ready.call, check))
            return _take_turns(turns, budget)
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return None, "error: " + traceback.format_exception_only(type(exc), exc)[-1].strip()


def run_layer_pair(
    runners: Sequence[Runner], problem: LayerProblem, threads: int, budget: Budget, expected: LayerExpected
) -> tuple[Optional[list[list[float]]], str]:
    """As run_pair for the layer case's decode step, the cache cropped back (untimed) before each."""
    try:
        with contextlib.ExitStack() as stack:
            turns = []
            for runner in runners:
                ready = stack.enter_context(prepared_layer(runner, problem, threads))
                check = _checker(ready.output, lambda out: check_close(out, expected.out, "step output"))
                turns.append(_Turn(runner.name, ready.step, check, ready.reset))
            return _take_turns(turns, budget)
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return None, "error: " + traceback.format_exception_only(type(exc), exc)[-1].strip()


def _time_alternately(
    calls: Sequence[Callable[[], Any]],
    budget: Budget,
    untimed: Optional[Sequence[Optional[Callable[[], Any]]]] = None,
) -> list[list[float]]:
    """Rounds of one timed call each, the order reversed every round, until every call has
    min_repeats times and len(calls) x time_s is spent (or exactly --repeat times each)."""
    times: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        while True:
            done = len(times[0])
            if budget.repeat is not None:
                if done >= budget.repeat:
                    break
            elif done >= budget.min_repeats and (
                time.perf_counter() - start >= budget.time_s * len(calls) or done >= budget.max_repeats
            ):
                break
            for i in order:
                reset = untimed[i] if untimed is not None else None
                if reset is not None:
                    reset()
                t0 = time.perf_counter()
                calls[i]()
                times[i].append(time.perf_counter() - t0)
            order.reverse()
    finally:
        if enabled:
            gc.enable()
    return times


def _warm_up(
    call: Callable[[], Any], first: float, budget: Budget, untimed: Optional[Callable[[], Any]] = None
) -> int:
    """One more call after the checked one, more (up to 10) while they are cheap. A call of over
    half a second needs none beyond the checked one: that call started the threads, touched the
    pages and filled the caches that a call this long can keep. `untimed` runs before each call,
    outside its time."""
    count, spent = 0, first
    min_count = 0 if first > 0.5 else 1
    while count < min_count or (spent < budget.warmup_s and count < 10):
        if untimed is not None:
            untimed()
        t0 = time.perf_counter()
        call()
        spent += time.perf_counter() - t0
        count += 1
    return count


def _time_calls(
    call: Callable[[], Any], budget: Budget, untimed: Optional[Callable[[], Any]] = None
) -> list[float]:
    """Each call timed alone; `untimed` (the layer case's cache crop) runs before each, outside
    its time but inside the budget's."""
    times: list[float] = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        while True:
            if budget.repeat is not None:
                if len(times) >= budget.repeat:
                    break
            elif len(times) >= budget.min_repeats and (
                time.perf_counter() - start >= budget.time_s or len(times) >= budget.max_repeats
            ):
                break
            if untimed is not None:
                untimed()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    finally:
        if enabled:
            gc.enable()
    return times


def expected_rows(problem: Problem) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    rows = check_rows(problem.case)
    return rows, reference_rows(problem, rows)


def finite_or_none(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None
