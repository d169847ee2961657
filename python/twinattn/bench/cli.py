"""twinattn-bench: time the standard attention suite on every available backend.

Backends: cpp and rust (twinattn's ports), numpy (the reference), and, when importable, torch
(scaled_dot_product_attention) and onnxruntime (com.microsoft::GroupQueryAttention on the CPU).
Every output is checked against a float64 reference before its time counts; a wrong result is
reported as WRONG and the command exits with status 1. The layer-decode case times one decode step
of twinattn.nn.Attention on the twinattn backends and, beside it, the attention kernel alone.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import twinattn

from . import machine, report
from .cases import (
    DECODE,
    LAYER,
    Case,
    layer_reference,
    make_layer_problem,
    make_problem,
    select,
    standard_suite,
    work,
)
from .measure import Budget, Outcome, Rates, expected_rows, run_layer, run_layer_pair, run_one, run_pair
from .runners import Runner, make_runners, parse_backends

EPILOG = """\
columns:
  median    median wall time of one call (timed alone, after warm-up)
  GFLOP/s   2 x visible query-key pairs x (D + Dv) / median: work above the causal diagonal
            or past kv_lens is not counted
  %gemm     GFLOP/s over NumPy's float32 matrix-multiply throughput with the same threads
  GB/s      decode only: bytes of K and V that must be read / median
  %read     GB/s over the read bandwidth measured right beside that run
  vs ...    speedup: the other backend's median / this one's (>1: this one is faster);
            "peer" is the fastest of torch and onnxruntime present
  max err   max |out - float64 reference| over the checked rows

layer-decode (twinattn backends only; torch and onnxruntime are skipped):
  median    one twinattn.nn.Attention decode step, hidden 4096, Hq 32 / Hkv 8, D 128, on a
            4096-token KVCache: q/k/v projections, RoPE, cache append, attention over 4097 keys,
            o_proj; the cache is cropped back to 4096 tokens before every step, untimed
  kernel    twinattn.attention alone with the arguments the step passes it (same cache views)
  overhead  step - kernel: what the Python layer (projections included) adds to the kernel
  max err   max |step output - float64 recomputation of the step| over the whole output

examples:
  twinattn-bench --quick
  twinattn-bench --cases prefill-causal,decode --backends cpp,rust --json out.json --plot out.png
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE twinattn-bench   # the GEMM ceiling unhobbled
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinattn-bench",
        description="Time the standard attention suite on every available backend.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a subset with short budgets that finishes in about a minute: " + ", ".join(_quick_names()),
    )
    parser.add_argument(
        "--cases", metavar="LIST", help="comma-separated case names, group names or globs (see --list); default: all"
    )
    parser.add_argument(
        "--backends",
        metavar="LIST",
        help="comma-separated: cpp, rust, numpy, torch, onnxruntime (ort); default: every one available",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        help="threads for every backend (default: twinattn.get_num_threads(), the usable cores)",
    )
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        metavar="N",
        help="exactly N timed calls per case and backend (default: at least 3, more until the time budget is spent)",
    )
    parser.add_argument(
        "--time-budget",
        type=_positive_float,
        metavar="S",
        help="seconds of timed calls per case and backend (default 2, --quick 0.4)",
    )
    parser.add_argument(
        "--max-call",
        type=_positive_float,
        metavar="S",
        help="skip a backend on a case when one call is estimated to take longer (default 10, --quick 3)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure of the run as JSON")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG plot (needs matplotlib: pip install twinattn[plot])"
    )
    parser.add_argument(
        "--shrink",
        type=_positive_int,
        default=1,
        metavar="K",
        help="divide every sequence length by K: a smoke run, not comparable with the suite",
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _quick_names() -> list[str]:
    from .cases import QUICK_CASES

    return list(QUICK_CASES)


class Progress:
    """A plain progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        text = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{time.perf_counter() - self.start:5.0f}s  {label}"
        )
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + text[:160])
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def step(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def _memory_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _settle() -> None:
    """Let the previous library's worker threads stop spinning (OpenBLAS, OpenMP, ORT's pool) so
    they do not steal cores from the next measurement."""
    time.sleep(0.1)


def _settle_and_measure(bandwidth: Optional[machine.ReadBandwidth], threads: int, into: list[float]) -> None:
    _settle()
    if bandwidth is not None:
        into.append(bandwidth.measure(threads)["gbps"])


def _row(case: Case, backend: str, threads: int, outcome: Outcome) -> dict[str, Any]:
    w = work(case)
    median = outcome.median_s if outcome.status == "ok" else None
    check = outcome.check
    layer = case.kind == LAYER
    kernel = outcome.kernel_median_s if layer and median is not None else None
    overhead = median - kernel if median is not None and kernel is not None else None
    kernel_check = outcome.kernel_check
    return {
        "case": case.name,
        "group": case.group,
        "kind": case.kind,
        "x": case.x,
        "backend": backend,
        "threads": threads,
        "status": outcome.status,
        "note": outcome.note,
        "median_s": median,
        "min_s": min(outcome.times) if median is not None and outcome.times else None,
        "repeats": len(outcome.times) if outcome.times else 0,
        "warmup": outcome.warmup,
        "first_call_s": outcome.first_call_s,
        # the layer case: pairs, flops and kv_bytes are its attention kernel's; a rate over the
        # step's time would mix in the projections, so none is given
        "gflops": w.flops / median / 1e9 if median and not layer else None,
        "gbps": w.kv_bytes / median / 1e9 if median and case.kind == DECODE else None,
        "pairs": w.pairs,
        "flops": w.flops,
        "kv_bytes": w.kv_bytes,
        "max_abs_err": check.max_abs_err if check else None,
        "tolerance": check.tolerance if check else None,
        # layer case only (None elsewhere): median step, median kernel alone, step - kernel
        "layer_s": median if layer else None,
        "kernel_s": kernel,
        "overhead_s": overhead,
        "overhead_fraction": overhead / median if overhead is not None and median else None,
        "kernel_min_s": min(outcome.kernel_times) if kernel is not None and outcome.kernel_times else None,
        "kernel_repeats": len(outcome.kernel_times) if layer and outcome.kernel_times else 0,
        "kernel_max_abs_err": kernel_check.max_abs_err if kernel_check else None,
        "cache_cropped": "before every step, untimed" if layer and median is not None else None,
        "shape": {
            "batch": case.batch,
            "q_heads": case.q_heads,
            "kv_heads": case.kv_heads,
            "q_len": case.q_len,
            "k_len": case.k_len,
            "head_dim": case.head_dim,
            "value_dim": case.value_dim,
            "causal": case.causal,
            "kv_lens": list(case.kv_lens) if case.kv_lens else None,
            "hidden_size": case.hidden_size or None,
            "cached": case.cached if layer else None,
        },
    }


def run(
    cases: Sequence[Case],
    backends: Sequence[str],
    runners: dict[str, Runner],
    threads: int,
    budget: Budget,
    progress: Progress,
    bandwidth: machine.ReadBandwidth,
    ceilings: dict[str, Any],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rates = Rates()
    for case in cases:
        case_threads = case.threads or threads
        if case.kind == LAYER:
            rows.extend(_run_layer_case(case, backends, runners, case_threads, budget, progress))
            continue
        progress.show(f"{case.name}: making inputs and the reference")
        problem = make_problem(case)
        expected = expected_rows(problem)
        for backend in backends:
            progress.show(f"{case.name} on {backend}")
            decode = case.kind == DECODE
            beside: list[float] = []  # read bandwidth measured right before and after a decode run
            before = functools.partial(_settle_and_measure, bandwidth if decode else None, case_threads, beside)
            outcome = run_one(runners[backend], problem, case_threads, budget, rates, expected, between=before)
            if decode and outcome.status == "ok":
                beside.append(bandwidth.measure(case_threads)["gbps"])
            row = _row(case, backend, case_threads, outcome)
            gemm = ceilings["by_threads"].get(str(case_threads), {}).get("gemm_gflops")
            row["gemm_fraction"] = row["gflops"] / gemm if row["gflops"] and gemm else None
            if beside:
                row["read_gbps_beside"] = sum(beside) / len(beside)
                row["read_gbps_beside_each"] = beside
                row["read_fraction"] = row["gbps"] / row["read_gbps_beside"] if row["gbps"] else None
            rows.append(row)
            progress.step()
        if _pairable(rows, case, backends):
            progress.show(f"{case.name}: cpp and rust alternately")
            _settle()
            pair = run_pair([runners[p] for p in PORTS], problem, case_threads, budget, expected)
            _record_pair(rows, case, pair)
            progress.step()
        del problem
    progress.show("done")
    report.add_comparisons(rows)
    return rows


def _run_layer_case(
    case: Case, backends: Sequence[str], runners: dict[str, Runner], threads: int, budget: Budget, progress: Progress
) -> list[dict[str, Any]]:
    progress.show(f"{case.name}: making weights, cache and the float64 step")
    problem = make_layer_problem(case)
    expected = layer_reference(problem)
    rows = []
    for backend in backends:
        progress.show(f"{case.name} on {backend}")
        outcome = run_layer(runners[backend], problem, threads, budget, expected, between=_settle)
        row = _row(case, backend, threads, outcome)
        row["gemm_fraction"] = None
        rows.append(row)
        progress.step()
    if _pairable(rows, case, backends):
        progress.show(f"{case.name}: cpp and rust alternately")
        _settle()
        _record_pair(rows, case, run_layer_pair([runners[p] for p in PORTS], problem, threads, budget, expected))
        progress.step()
    return rows


PORTS = ("cpp", "rust")


def _pairable(rows: Sequence[dict[str, Any]], case: Case, backends: Sequence[str]) -> bool:
    """Both ports are being compared and both ran this case."""
    ok = {r["backend"] for r in rows if r["case"] == case.name and r["status"] == "ok"}
    return all(p in backends for p in PORTS) and all(p in ok for p in PORTS)


def _record_pair(
    rows: list[dict[str, Any]], case: Case, pair: tuple[Optional[list[list[float]]], str]
) -> None:
    """The alternate timing's median (and its call count, or why it failed) on both ports' rows."""
    times, why = pair
    for row in rows:
        if row["case"] != case.name or row["backend"] not in PORTS:
            continue
        if times is None:
            row["paired_median_s"], row["paired_repeats"], row["paired_note"] = None, 0, why
        else:
            mine = times[PORTS.index(row["backend"])]
            row["paired_median_s"], row["paired_repeats"] = statistics.median(mine), len(mine)


def measure_ceilings(
    thread_counts: Sequence[int], quick: bool, bandwidth: machine.ReadBandwidth, progress: Progress
) -> dict[str, Any]:
    by_threads: dict[str, dict[str, Any]] = {}
    for t in thread_counts:
        progress.show(f"ceilings: NumPy float32 GEMM and read bandwidth, {t} thread(s)")
        _settle()
        gemm = machine.gemm_gflops(t, budget_s=0.5 if quick else 1.5)
        _settle()
        read = bandwidth.measure(t)
        by_threads[str(t)] = {
            "gemm_gflops": gemm["gflops"],
            "gemm_kernel": gemm["kernel"],
            "gemm_n": gemm["n"],
            "read_gbps": read["gbps"],
        }
    top = by_threads[str(max(thread_counts))]
    return {
        "gemm_gflops": top["gemm_gflops"],
        "read_gbps": top["read_gbps"],
        "gemm_kernel": top["gemm_kernel"],
        "gemm_method": f"numpy.matmul float32 {machine.GEMM_N}x{machine.GEMM_N}, median, BLAS threads = case threads",
        "read_method": machine.READ_METHOD.format(size=f"{bandwidth.nbytes >> 20} MiB", threads="T"),
        "by_threads": by_threads,
    }


def header(document: dict[str, Any]) -> str:
    m, c = document["machine"], document["ceilings"]
    isa = ", ".join(f"{port} {isa}" for port, isa in m["isa"].items()) or "no native port built"
    versions = "; ".join(m["backends"].values())
    lines = [
        f"twinattn-bench: {document['command']}",
        f"machine: {m['cpu']} ({', '.join(m['cpu_flags'])}), {m['usable_cores']} usable cores, {m['threads']} threads",
        f"ports:   {isa}",
        f"timed:   {versions}",
        f"ceilings ({m['threads']} thr): NumPy float32 GEMM {c['gemm_gflops']:.1f} GFLOP/s "
        f"(OpenBLAS kernel {c['gemm_kernel']}), read bandwidth {c['read_gbps']:.1f} GB/s",
    ]
    for t, entry in c["by_threads"].items():
        if int(t) != m["threads"]:
            lines.append(
                f"          ({t} thr): GEMM {entry['gemm_gflops']:.1f} GFLOP/s, read {entry['read_gbps']:.1f} GB/s"
            )
    env = {k: v for k, v in m["env"].items() if v is not None and k.startswith("OPENBLAS_")}
    if env.get("OPENBLAS_CORETYPE") or env.get("OPENBLAS_L2_SIZE"):
        lines.append(
            "note:    "
            + " ".join(f"{k}={v}" for k, v in env.items())
            + " is set: it picks NumPy's GEMM kernel and may lower the GEMM ceiling; "
            "run under `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` to measure the machine's own"
        )
    if document["shrink"] != 1:
        lines.append(f"note:    --shrink {document['shrink']}: every sequence length divided by {document['shrink']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = args.threads or twinattn.get_num_threads()
    suite = [case.shrunk(args.shrink) for case in standard_suite(threads)]
    if args.list:
        for case in suite:
            print(f"{case.name:<24} {case.shape_text()}{'  (' + case.note + ')' if case.note else ''}")
        return 0
    runners = make_runners()
    try:
        cases = select(suite, args.cases, args.quick)
        backends = parse_backends(args.backends, runners)
    except ValueError as exc:
        parser.error(str(exc))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib (or twinattn[plot])")
    skipped_peers = {name: why for name, r in runners.items() if name not in backends and (why := r.available())}

    budget = Budget(
        time_s=args.time_budget or (0.4 if args.quick else 2.0),
        repeat=args.repeat,
        max_call_s=args.max_call or (3.0 if args.quick else 10.0),
        memory_bytes=int(0.4 * _memory_available()),
    )
    pairs = len(cases) if all(p in backends for p in PORTS) else 0  # the ports timed alternately
    progress = Progress(len(cases) * len(backends) + pairs, enabled=not args.no_progress)
    bandwidth = machine.ReadBandwidth()
    started = time.perf_counter()
    try:
        thread_counts = sorted({case.threads or threads for case in cases} | {threads})
        ceilings = measure_ceilings(thread_counts, args.quick, bandwidth, progress)
        rows = run(cases, backends, runners, threads, budget, progress, bandwidth, ceilings)
    except KeyboardInterrupt:
        progress.close()
        print("twinattn-bench: interrupted", file=sys.stderr)
        return 130
    finally:
        bandwidth.close()
    progress.close()

    document = {
        "command": " ".join(["twinattn-bench", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - started,
        "shrink": args.shrink,
        "budget": {
            "time_s": budget.time_s,
            "min_repeats": budget.min_repeats,
            "repeat": budget.repeat,
            "max_call_s": budget.max_call_s,
            "memory_bytes": budget.memory_bytes,
        },
        "machine": machine.describe({name: runners[name].version() for name in backends}, threads),
        "peers_missing": skipped_peers,
        "ceilings": ceilings,
        "results": rows,
    }
    print(header(document))
    print()
    print(report.table(rows))
    ports = report.port_table(rows)
    if ports:
        print()
        print("C++ against Rust, timed alternately call by call (ratio of median times; < 1: C++ faster):")
        print(ports)
    layers = report.layer_table(rows)
    if layers:
        print()
        print(
            "nn.Attention decode step against the kernel alone "
            "(overhead = step - kernel: projections, RoPE, cache append, o_proj, Python):"
        )
        print(layers)
    if skipped_peers:
        print()
        print("not run: " + "; ".join(f"{name} ({why})" for name, why in skipped_peers.items()))
    bad = [r for r in rows if r["status"] in ("wrong", "error")]
    if args.json:
        report.write_json(args.json, document)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.plot(args.plot, document)
        print(f"wrote {args.plot}")
    print(
        f"\n{len(rows)} runs in {document['wall_s']:.0f} s"
        + (f"; {len(bad)} WRONG or failed: " + ", ".join(f"{r['case']} on {r['backend']}" for r in bad) if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
