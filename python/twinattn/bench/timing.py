"""Honest timing: check first, warm up, then time until the budget is spent; and the run of a suite.

1. Skip what cannot run: an unsupported case, a backend whose scratch memory would not fit, or a
   call predicted to take longer than `max_call_s` (predicted from the backend's rate on an earlier
   case of the same kind and thread count, or from two calls on the case shrunk 4-8x).
2. The first call's output (a NaN-filled buffer where the backend writes in place) is checked
   against the float64 reference; a wrong result stops here, untimed.
3. Warm-up calls (none beyond the checked call when that took over 0.5 s), then timed calls,
   each timed alone with perf_counter and the garbage collector off: at least `min_repeats`,
   then more until `time_s` is spent (or exactly --repeat calls).
4. The last timed call's output is checked again, so what was timed is what was checked.

The layer case has two parts, each checked, warmed up and timed this way: the nn.Attention decode
step (the cache cropped back before every step, outside the timed region), then the attention
kernel alone on the same cache views.

The two native ports are then timed once more, alternately (run_pair): both prepared at once,
calls taken in turns (C++ then Rust, Rust then C++ in the next round, and so on), each timed
alone, both outputs checked before and after. Machines like these drift by tens of percent over
seconds; drift then slows both ports alike, so the C++/Rust ratio is read from these medians.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import machine, report
from .peers import PORTS, Part, Runner, prepared
from .suite import DECODE, LAYER, AnyProblem, Case, Check, Outcome, make_problem, work


@dataclass
class Budget:
    time_s: float = 2.0  # timed calls stop once this much time is spent (after min_repeats)
    min_repeats: int = 3
    max_repeats: int = 2000
    repeat: Optional[int] = None  # --repeat: exactly this many timed calls
    max_call_s: float = 10.0  # a call predicted slower than this is skipped
    memory_bytes: int = 8 << 30  # scratch memory a backend may need beyond inputs and output
    warmup_s: float = 0.05  # warm-up calls continue (up to 10) until this much time is spent


# A case this small is simply run: probing it would cost as much as running it.
PROBE_ABOVE_FLOPS = 20e9
PROBE_ABOVE_BYTES = 1 << 30


class Rates:
    """Per (backend, kind, dtype, threads): work per second seen so far, to predict a bigger case."""

    def __init__(self) -> None:
        self._rates: dict[tuple[str, str, str, int], float] = {}

    @staticmethod
    def amount(case: Case) -> float:
        w = work(case)
        return float(w.kv_bytes if case.kind == DECODE else w.flops) or 1.0

    def predict(self, backend: str, case: Case, threads: int) -> Optional[float]:
        rate = self._rates.get((backend, case.kind, case.dtype, threads))
        return None if rate is None else self.amount(case) / rate

    def record(self, backend: str, case: Case, threads: int, seconds: float) -> None:
        # per-call overhead dominates small cases: their rate would predict big ones badly
        w = work(case)
        if seconds > 0 and (w.flops >= PROBE_ABOVE_FLOPS / 16 or w.kv_bytes >= PROBE_ABOVE_BYTES / 16):
            self._rates[(backend, case.kind, case.dtype, threads)] = self.amount(case) / seconds


def estimate_call_s(runner: Runner, case: Case, threads: int, rates: Rates) -> Optional[float]:
    """Seconds one call of a big case is expected to take (None for small cases: just run them).
    A case without an earlier rate is predicted from the faster of two calls on a shrunk copy of
    it (the first call of a backend pays for starting threads and touching pages)."""
    w = work(case)
    if w.flops <= PROBE_ABOVE_FLOPS and w.kv_bytes <= PROBE_ABOVE_BYTES:
        return None
    predicted = rates.predict(runner.name, case, threads)
    if predicted is not None:
        return predicted
    small = case.shrunk(8 if case.kind == DECODE else 4)
    with prepared(runner, make_problem(small), threads) as ready:
        seconds = min(timed_call(ready.parts[0]) for _ in range(2))
    return seconds * Rates.amount(case) / Rates.amount(small)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _error(exc: Exception) -> str:
    return "error: " + traceback.format_exception_only(type(exc), exc)[-1].strip()


def run_one(
    runner: Runner,
    problem: AnyProblem,
    threads: int,
    budget: Budget,
    rates: Optional[Rates] = None,
    between: Callable[[], None] = lambda: None,
) -> Outcome:
    """Check, warm up and time `runner` on `problem`, part by part (see the module docstring)."""
    case, rates = problem.case, rates or Rates()
    why = runner.supports(case)
    if why is not None:
        return Outcome("skipped", why if case.kind == LAYER else f"unsupported: {why}")
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
        with prepared(runner, problem, threads) as ready:
            firsts, checks = [], []
            for index, part in enumerate(ready.parts):
                firsts.append(timed_call(part))
                checks.append(problem.check(part.output(), index))
                if not checks[-1].ok:
                    return Outcome("wrong", f"WRONG: {checks[-1].reason}", first_call_s=firsts[0], check=checks[-1])
            if firsts[0] > budget.max_call_s:
                rates.record(runner.name, case, threads, firsts[0])
                return Outcome(
                    "skipped",
                    f"too slow: first call {firsts[0]:.1f} s (> {budget.max_call_s:g} s budget)",
                    first_call_s=firsts[0],
                    check=checks[0],
                )
            warmups, times, afters = [], [], []
            for index, (part, first) in enumerate(zip(ready.parts, firsts)):
                warmups.append(_warm_up(part, first, budget))
                times.append(_time_calls([part], budget)[0])
                afters.append(problem.check(part.output(), index))
            note = "; ".join(ready.notes)
        for after in afters:
            if not after.ok:
                return Outcome("wrong", f"WRONG after timing: {after.reason}", first_call_s=firsts[0], check=after)
        rates.record(runner.name, case, threads, statistics.median(times[0]))
        worst = [max(before, after, key=lambda c: c.max_abs_err) for before, after in zip(checks, afters)]
        outcome = Outcome("ok", note, times=times[0], warmup=warmups[0], first_call_s=firsts[0], check=worst[0])
        if len(times) > 1:
            outcome.kernel_times, outcome.kernel_check = times[1], worst[1]
        return outcome
    except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the run
        return Outcome("error", _error(exc))


def run_pair(
    runners: Sequence[Runner], problem: AnyProblem, threads: int, budget: Budget
) -> tuple[Optional[list[list[float]]], str]:
    """`runners` timed alternately on `problem`'s first part (see the module docstring): one list
    of times per runner, or None and why not."""
    try:
        with contextlib.ExitStack() as stack:
            parts = [stack.enter_context(prepared(r, problem, threads)).parts[0] for r in runners]
            for runner, part in zip(runners, parts):
                first = timed_call(part)
                check = problem.check(part.output())
                if not check.ok:
                    return None, f"{runner.name} WRONG: {check.reason}"
                _warm_up(part, first, budget)
            times = _time_calls(parts, budget)
            for runner, part in zip(runners, parts):
                after = problem.check(part.output())
                if not after.ok:
                    return None, f"{runner.name} WRONG after timing: {after.reason}"
            return times, ""
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return None, _error(exc)


def timed_call(part: Part) -> float:
    """One call, its reset first and outside its time."""
    part.reset()
    t0 = time.perf_counter()
    part.call()
    return time.perf_counter() - t0


def _warm_up(part: Part, first: float, budget: Budget) -> int:
    """One more call after the checked one, more (up to 10) while they are cheap. A call of over
    half a second needs none beyond the checked one: that call started the threads, touched the
    pages and filled the caches that a call this long can keep."""
    count, spent = 0, first
    min_count = 0 if first > 0.5 else 1
    while count < min_count or (spent < budget.warmup_s and count < 10):
        spent += timed_call(part)
        count += 1
    return count


def _time_calls(parts: Sequence[Part], budget: Budget) -> list[list[float]]:
    """Rounds of one call per part, each timed alone, the order reversed every round (several
    parts: the alternate timing), until every part has min_repeats times and len(parts) x time_s
    is spent (or exactly --repeat times each). Resets run outside the times, inside the budget."""
    times: list[list[float]] = [[] for _ in parts]
    order = list(range(len(parts)))
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
                time.perf_counter() - start >= budget.time_s * len(parts) or done >= budget.max_repeats
            ):
                break
            for i in order:
                times[i].append(timed_call(parts[i]))
            order.reverse()
    finally:
        if enabled:
            gc.enable()
    return times


# ----------------------------------------------------------------------------------------------
# The run of a suite: every case on every backend, then the two ports alternately


def run_suite(
    cases: Sequence[Case],
    backends: Sequence[str],
    runners: dict[str, Runner],
    threads: int,
    budget: Budget,
    progress: report.Progress,
    bandwidth: machine.ReadBandwidth,
    ceilings: dict[str, Any],
) -> list[dict[str, Any]]:
    """The result rows of a run (report.result_row), with the comparisons between backends. A
    backend is left out of the dtypes it is not timed in (Runner.dtype_support; the CLI names them)."""
    rows: list[dict[str, Any]] = []
    rates = Rates()
    for case in cases:
        case_threads = case.threads or threads
        label = case.name if case.dtype == "float32" else f"{case.name} {case.dtype}"
        timed = [b for b in backends if runners[b].dtype_support(case.dtype) is None]
        progress.show(f"{label}: making inputs and the reference")
        try:
            problem = make_problem(case)
            _ = problem.expected  # computed once, before any timing
        except Exception as exc:  # noqa: BLE001 - e.g. a KVCache of a dtype this build lacks: the case's rows say so
            for backend in timed:
                outcome = Outcome("error", f"{_error(exc)} (making the inputs and the reference)")
                rows.append(report.result_row(case, backend, case_threads, outcome, {}, []))
                progress.step()
            continue
        case_rows = []
        for backend in timed:
            progress.show(f"{label} on {backend}")
            beside: list[float] = []  # decode: read bandwidth measured right before and after the run

            def before() -> None:
                machine.settle()
                if case.kind == DECODE:
                    beside.append(bandwidth.measure(case_threads)["gbps"])

            outcome = run_one(runners[backend], problem, case_threads, budget, rates, between=before)
            if case.kind == DECODE and outcome.status == "ok":
                beside.append(bandwidth.measure(case_threads)["gbps"])
            ceiling = ceilings["by_threads"].get(str(case_threads), {})
            row = report.result_row(case, backend, case_threads, outcome, ceiling, beside)
            # the row's fastest rate against the peak (a train case's backward alone runs faster than its
            # forward and backward together)
            fraction, gflops = max((row["peak_fraction"] or 0.0, row["gflops"]),
                                   (row["backward_peak_fraction"] or 0.0, row["backward_gflops"]), key=lambda pair: pair[0])
            if fraction > 1.0:
                progress.show(f"{label} on {backend}: faster than the {row['peak_kind']} peak, measuring it again")
                machine.raise_peak(ceiling, row["peak_kind"], case_threads, machine.peak_seconds(quick=False),
                                   gflops, f"{label} on {backend}")
            case_rows.append(row)
            progress.step()
        ran = {r["backend"] for r in case_rows if r["status"] == "ok"}
        if all(p in timed and p in ran for p in PORTS):
            progress.show(f"{label}: cpp and rust alternately")
            machine.settle()
            report.add_pair(case_rows, *run_pair([runners[p] for p in PORTS], problem, case_threads, budget))
            progress.step()
        rows.extend(case_rows)
        del problem
    progress.show("done")
    report.set_peak_fractions(rows, ceilings)  # against the final peaks (raise_peak may have raised one)
    report.add_comparisons(rows)
    return rows
