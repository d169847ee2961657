"""twinattn-bench: time the standard attention suite on every available backend.

Backends: cpp and rust (twinattn's ports), numpy (the reference), and, when importable, torch
(scaled_dot_product_attention), onnxruntime (com.microsoft::GroupQueryAttention on the CPU),
openvino (opset13 ScaledDotProductAttention on the CPU plugin; float32 and bfloat16) and flex
(torch.compile(flex_attention), compiled before timing; float32 and bfloat16).
Each case runs in every dtype of --dtype (float32 by default; float16 and bfloat16 on the ports and
torch; numpy and onnxruntime are timed in float32 only), and, named on its own, in int8: q float32,
K/V int8 with float32 scales (twinattn.quantize_kv), on the ports only (torch has no int8 attention).
Every output is checked against a float64 reference before its time counts; a wrong result is
reported as WRONG and the command exits with status 1. The layer-decode case times one decode step
of twinattn.nn.Attention on the twinattn backends and, beside it, the attention kernel alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import twinattn

from .. import models
from . import e2e, machine, memory, report, serving
from .peers import PORTS, make_runners, parse_backends
from .suite import QUICK_CASES, parse_dtypes, select, standard_suite, with_dtypes
from .timing import Budget, run_suite

EPILOG = """\
columns:
  dtype     q, k, v and out (--dtype): inputs drawn in float32 and rounded; out in that dtype;
            checked against float64 from the rounded inputs, within float32 arithmetic plus the
            dtype's rounding of out (and, for bfloat16, of P before P.V)
  median    median wall time of one call (timed alone, after warm-up)
  GFLOP/s   2 x visible query-key pairs x (D + Dv) / median: work above the causal diagonal
            or past kv_lens is not counted
  %gemm     GFLOP/s over NumPy's float32 matrix-multiply throughput with the same threads
  %peak     GFLOP/s over the arithmetic peak of the path that ran, measured by the native
            port's measure_peak: float32 FMA for float32 and float16; for bfloat16 on a port, the
            BF16 dot product (VDPBF16PS) where it took the dot path, FMA where it converted (the
            header says which; decode always converts), on a peer the higher of the two; the
            best of 5 measurements, measured again when a case runs faster (the header says
            so), so it never passes 100%
  GB/s      decode only: bytes of K and V that must be read / median (2 bytes per element in
            float16 and bfloat16; int8: 1 byte per element plus the 2 x 4 bytes of scales per
            key and KV head)
  %read     GB/s over the read bandwidth measured right beside that run
  dtype     int8: q and out float32, K and V int8 with one float32 scale per (sequence, KV head,
            token) each; checked against float64 attention over the dequantized K/V
  vs f32    float16 / bfloat16 / int8: the same backend's float32 median / this one's
  vs ...    speedup: the other backend's median / this one's (>1: this one is faster), in the
            same dtype; "peer" is the fastest of torch, onnxruntime, openvino and flex present
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
  twinattn-bench --dtype all --cases prefill-causal/N=2048,decode/N=32768   # the float16 / bfloat16 targets
  twinattn-bench --dtype f32,bf16,int8 --cases decode/N=32768,decode-batch --backends cpp,rust   # the int8 targets
  twinattn-bench --cases prefill-causal,decode --backends cpp,rust --json out.json --plot out.png
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE twinattn-bench   # the GEMM ceiling unhobbled
"""


E2E = "e2e"
E2E_TEXT = (
    "real models through transformers, sdpa + DynamicCache against twinattn + TwinattnCache: prefill and decode "
    "tokens/s, plain generate() with no cache argument, and twinattn.torch.attention's per-call overhead (needs twinattn's hf and models extras and the model packages): " + ", ".join(f"{E2E}/{name}" for name in e2e.PLANS)
)


def _e2e_text(name: str) -> str:
    plan = e2e.PLANS[name]
    generate = f"; plain generate() with {', '.join(case.label() for case in plan.generate)}" if plan.generate else ""
    return (f"{models.MODELS[name].title}: decode at {', '.join(map(str, plan.contexts))} context, prefill of "
            f"{', '.join(map(str, plan.prefill))}{generate} ({models.MODELS[name].install})")


def _e2e_models(names: Sequence[str]) -> list[str]:
    """The end-to-end models that --cases names: "e2e" is all of them, "e2e/NAME" one."""
    chosen: list[str] = []
    for name in names:
        if name == E2E:
            chosen += list(e2e.PLANS)
        elif name.startswith(E2E + "/"):
            model = name[len(E2E) + 1:]
            if model not in e2e.PLANS:
                raise ValueError(f"--cases: no end-to-end model {model!r}; expected one of "
                                 + ", ".join(f"{E2E}/{m}" for m in e2e.PLANS))
            chosen.append(model)
    return list(dict.fromkeys(chosen))


def _positive(kind: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse type: `kind` (int or float) of the text, which must be > 0."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_positive_int = _positive(int, "a positive integer")
_positive_float = _positive(float, "a positive number")


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
        help="a subset with short budgets that finishes in about a minute: " + ", ".join(QUICK_CASES),
    )
    parser.add_argument(
        "--cases", metavar="LIST", help="comma-separated case names, group names or globs (see --list); default: all"
    )
    parser.add_argument(
        "--backends",
        metavar="LIST",
        help="comma-separated: cpp, rust, numpy, torch, onnxruntime (ort), openvino (ov), flex (flex_attention); "
        "default: every one available",
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
    parser.add_argument(
        "--dtype",
        default="float32",
        metavar="LIST",
        help="dtypes of q, k, v and out, comma-separated: float32, float16, bfloat16 (bf16, fp16), int8 (i8: "
        "K/V int8 with scales, q float32; kernel cases only), or all (the three floating-point ones); "
        "each case runs in each (default: float32)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure of the run as JSON")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG plot (needs matplotlib: pip install matplotlib)"
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """twinattn-bench; a reader that goes away early (`twinattn-bench --list | head -3`) ends the
    command quietly, as it ends any Unix tool, with status 141 (128 + SIGPIPE)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # what is still buffered must not be written again at exit: point stdout at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    threads = args.threads or twinattn.get_num_threads()
    suite = [case.shrunk(args.shrink) for case in standard_suite(threads)]
    if args.list:
        for case in suite:
            print(f"{case.name:<24} {case.shape_text()}{'  (' + case.note + ')' if case.note else ''}")
        print(f"{E2E:<24} {E2E_TEXT}")
        for name in e2e.PLANS:
            print(f"{E2E + '/' + name:<24} {_e2e_text(name)}")
        for serving_case in serving.CASES.values():
            print(f"{serving_case.name:<24} {serving_case.title} (paged against contiguous, torch SDPA as the peer)")
        print(f"{e2e.SERVING:<24} {e2e.SERVING_TEXT}")
        print(f"{memory.MEMORY:<24} {memory.TEXT}")
        return 0
    runners = make_runners()
    # the end-to-end case is not a kernel case: --cases e2e (or e2e/MODEL) asks for it, a full run
    # includes it
    names = [n.strip() for n in args.cases.split(",")] if args.cases is not None else []
    kernel_names = [n for n in names if n and n != E2E and not n.startswith(E2E + "/")]
    # the serving cases (twinattn.bench.serving) likewise: --cases serving (or serving/CASE)
    kernel_names = [n for n in kernel_names if n != serving.SERVING and not n.startswith(serving.SERVING + "/")]
    # and the serving case through transformers' continuous batching: --cases e2e-serving, never by default
    want_serving_e2e = e2e.SERVING in names
    kernel_names = [n for n in kernel_names if n != e2e.SERVING]
    # and the training step's memory, in fresh processes: --cases train-memory, never by default
    want_memory = memory.MEMORY in names
    kernel_names = [n for n in kernel_names if n != memory.MEMORY]
    try:
        e2e_models = _e2e_models(names) if args.cases is not None else ([] if args.quick else list(e2e.PLANS))
        want_e2e = bool(e2e_models)
        serving_cases = serving.names_in(names)  # only when asked for: --cases serving (or serving/CASE)
        dtypes = parse_dtypes(args.dtype)
        if (want_e2e or serving_cases or want_serving_e2e or want_memory) and args.cases is not None and not kernel_names:
            selected = []  # --cases e2e, serving or train-memory alone
        else:
            selected = select(suite, ",".join(kernel_names) if args.cases is not None else None, args.quick)
        backends = parse_backends(args.backends, runners)
    except ValueError as exc:
        parser.error(str(exc))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
    skipped_peers = {name: why for name, r in runners.items() if name not in backends and (why := r.available())}
    cases = with_dtypes(selected, dtypes)
    # backends not timed in a dtype of the run's kernel cases: named once, not a skipped row each
    not_in_dtype = {
        f"{name} in {dtype}": why
        for dtype in dtypes
        for name in backends
        if selected and (why := runners[name].dtype_support(dtype))
    }

    budget = Budget(
        time_s=args.time_budget or (0.4 if args.quick else 2.0),
        repeat=args.repeat,
        max_call_s=args.max_call or (3.0 if args.quick else 10.0),
        memory_bytes=int(0.4 * machine.memory_available()),
    )
    timed = [(case, b) for case in cases for b in backends if runners[b].dtype_support(case.dtype) is None]
    pairs = len(cases) if all(p in backends for p in PORTS) else 0  # the ports timed alternately
    # the end-to-end case moves the bar per model loaded, per prefill and per context's decode steps
    e2e_units = (e2e.units(e2e_models, dtypes, args.shrink) or 1) if want_e2e and e2e.missing() is None else int(want_e2e)
    serving_e2e_units = (e2e.serving_units() + 1 if e2e.missing(e2e.SERVING_MODEL) is None else 1) if want_serving_e2e else 0
    memory_units = memory.units(backends, dtypes) if want_memory else 0
    progress = report.Progress(len(timed) + pairs + e2e_units + len(serving_cases) + serving_e2e_units + memory_units,
                               enabled=not args.no_progress)
    bandwidth = machine.ReadBandwidth()
    started = time.perf_counter()
    try:
        thread_counts = sorted({case.threads or threads for case in cases} | {threads})
        ceilings = machine.measure_ceilings(thread_counts, args.quick, bandwidth, progress.show, dtypes)
        rows = run_suite(cases, backends, runners, threads, budget, progress, bandwidth, ceilings)
        end_to_end = _run_e2e(e2e_models, dtypes, threads, args, progress) if want_e2e else None
        serving_entries = _run_serving(serving_cases, backends, budget, args.shrink, progress)
        serving_e2e = _run_serving_e2e(dtypes, threads, args.shrink, progress) if want_serving_e2e else None
        train_memory = memory.run_case(backends, dtypes, threads, args.shrink, progress) if want_memory else None
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
        "dtypes": dtypes,
        "budget": {
            "time_s": budget.time_s,
            "min_repeats": budget.min_repeats,
            "repeat": budget.repeat,
            "max_call_s": budget.max_call_s,
            "memory_bytes": budget.memory_bytes,
        },
        "machine": machine.describe({name: runners[name].version() for name in backends}, threads),
        "peers_missing": skipped_peers,
        "not_timed_in_dtype": not_in_dtype,
        "ceilings": ceilings,
        "results": rows,
    }
    if end_to_end is not None:
        document["e2e"] = end_to_end
    if serving_entries:
        document["serving"] = serving_entries
    if serving_e2e is not None:
        document["e2e_serving"] = serving_e2e
    if train_memory is not None:
        document["train_memory"] = train_memory
    print(report.text(document))
    if serving_entries:
        print(f"\nserving (float32, {threads} threads)\n{serving.format_rows(serving_entries)}")
    if serving_e2e is not None:
        print(f"\n{e2e.SERVING} ({threads} threads)\n" + _serving_e2e_text(serving_e2e))
    if train_memory is not None:
        print(f"\n{memory.MEMORY}: {memory.TEXT} ({threads} threads)\n" + memory.format_rows(train_memory))
    if args.json:
        report.write_json(args.json, document)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.plot(args.plot, document)
        print(f"wrote {args.plot}")
    bad = [f"{r['case']} {r['dtype']} on {r['backend']}" for r in rows if r["status"] in ("wrong", "error")]
    e2e_rows = (end_to_end or {}).get("rows", [])
    bad += [f"e2e {r['dtype']} {r['impl']}" for r in e2e_rows if r.get("status") == "error"]
    if end_to_end is not None and end_to_end.get("error"):
        bad.append("e2e")
    bad += [f"e2e {m['title']}" for m in (end_to_end or {}).get("models", {}).values() if m.get("error")]
    bad += [f"{r['case']} {r['way']} on {r['backend']}" for e in serving_entries for r in e["rows"] if r["status"] in ("wrong", "error")]
    bad += [f"{e2e.SERVING} {r['requests']} requests {r['dtype']} {r['impl']}" for r in (serving_e2e or {}).get("rows", [])
            if r["status"] in ("wrong", "error")]
    if (serving_e2e or {}).get("error"):
        bad.append(e2e.SERVING)
    bad += [f"{memory.MEMORY} {r['dtype']} on {r['backend']}" for r in (train_memory or {}).get("rows", [])
            if r["status"] == "error"]
    done = ([f"{len(rows)} runs"] if rows else []) + (["the end-to-end case"] if e2e_rows else [])
    done += [f"the {memory.MEMORY} case"] if train_memory is not None else []
    print(
        f"\n{' and '.join(done or ['0 runs'])}"
        f" in {document['wall_s']:.0f} s"
        + (f"; {len(bad)} WRONG or failed: " + ", ".join(bad) if bad else "")
    )
    return 1 if bad else 0


def _run_serving(
    names: Sequence[str], backends: Sequence[str], budget: Budget, shrink: int, progress: report.Progress
) -> list[dict[str, Any]]:
    """The serving cases `names` on twinattn's backends among `backends` (torch's SDPA as the peer
    when torch is among them)."""
    entries = []
    for name in names:
        progress.show(serving.CASES[name].name)
        ports = [b for b in backends if b in serving.TWINATTN_BACKENDS]
        entries.append(serving.run_case(name, ports, budget, shrink, with_torch="torch" in backends))
        progress.step()
    return entries


def _run_serving_e2e(dtypes: Sequence[str], threads: int, shrink: int, progress: report.Progress) -> dict[str, Any]:
    """The serving case through transformers' continuous batching (twinattn.bench.e2e.run_serving_case),
    {"skipped": why} when what it needs is not installed, {"error": message} when it failed."""
    progress.show(f"{e2e.SERVING}: {e2e.SERVING_TEXT}")
    try:
        return e2e.run_serving_case(dtypes, threads, shrink, progress=None, bar=progress)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the status, never a traceback
        return {"error": f"{type(exc).__name__}: {exc}"}


def _serving_e2e_text(entry: dict[str, Any]) -> str:
    if "skipped" in entry:
        return f"not run: {entry['skipped']}"
    if "error" in entry:
        return f"error: {entry['error']}"
    return str(e2e.format_serving_rows(entry["rows"]))


def _run_e2e(
    names: Sequence[str], dtypes: Sequence[str], threads: int, args: argparse.Namespace, progress: report.Progress
) -> dict[str, Any]:
    """The end-to-end case (twinattn.bench.e2e.run_case) on the models `names`, or why it did not
    run: {"skipped": why} when torch, transformers or the GGUF loaders are not installed (a missing
    model package skips that model alone), {"error": message} when it failed outside a model."""
    why = e2e.missing()
    if why is not None:
        progress.step()
        return {"skipped": why}
    progress.show(f"{E2E}: " + "; ".join(_e2e_text(name) for name in names))
    try:
        # the bar shows what runs (its lines, when stderr is not a terminal); the figures come in the table
        entry = e2e.run_case(dtypes, threads, steps=args.repeat or 16, shrink=args.shrink, progress=None, names=names,
                             bar=progress)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the status, never a traceback
        entry = {"error": f"{type(exc).__name__}: {exc}"}
    if not e2e.units(names, dtypes, args.shrink):
        progress.step()  # no model installed: the case's one step
    return entry
