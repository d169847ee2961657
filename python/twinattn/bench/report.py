"""What a run reports: progress on stderr, result rows with derived figures, the text on stdout
(header, table, C++/Rust and layer tables), JSON, and the plot."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from . import e2e
from .machine import BFLOAT16_PEAKS, PEAK_KINDS, bfloat16_path, peak_for
from .peers import PEERS, PORTS
from .suite import BACKWARD_FLOPS_FACTOR, DECODE, LAYER, TRAIN, Case, Outcome, work


class Progress:
    """A plain progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        filled = 24 * self.done // max(self.total, 1)
        text = (
            f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} "
            f"{time.perf_counter() - self.start:5.0f}s  {label}"
        )
        sys.stderr.write("\r\x1b[2K" + text[:160] if self.tty else text + "\n")
        sys.stderr.flush()

    def step(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def result_row(
    case: Case, backend: str, threads: int, outcome: Outcome, ceiling: dict[str, Any], beside: list[float]
) -> dict[str, Any]:
    """One (case, dtype, backend) of the JSON's results: the outcome, the work, and the rates
    against the ceilings of the case's thread count (`ceiling`: GEMM, the arithmetic peak of the
    dtype, see machine.peak_for) and the read bandwidth measured beside the run (`beside`, decode
    only)."""
    w = work(case)
    gemm_gflops = ceiling.get("gemm_gflops")
    path = bfloat16_path(backend, case)
    peak_kind, peak_gflops = peak_for(case.dtype, ceiling, path)
    median = outcome.median_s if outcome.status == "ok" else None
    check, kernel_check = outcome.check, outcome.kernel_check
    layer = case.kind == LAYER
    kernel = outcome.kernel_median_s if layer and median is not None else None
    overhead = median - kernel if median is not None and kernel is not None else None
    # the layer case: pairs, flops and kv_bytes are its attention kernel's; a rate over the step's
    # time would mix in the projections, so none is given
    gflops = w.flops / median / 1e9 if median and not layer else None
    gbps = w.kv_bytes / median / 1e9 if median and case.kind == DECODE else None
    # a train case: the backward alone (timed after forward and backward), its FLOPs the
    # backward's share of the case's (BACKWARD_FLOPS_FACTOR times the forward's)
    backward = outcome.kernel_median_s if case.kind == TRAIN and median is not None else None
    backward_gflops = (
        w.flops * BACKWARD_FLOPS_FACTOR / (1 + BACKWARD_FLOPS_FACTOR) / backward / 1e9 if backward else None
    )
    row: dict[str, Any] = {
        "case": case.name,
        "dtype": case.dtype,
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
        "gflops": gflops,
        "gbps": gbps,
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
        # train case only (None elsewhere): the backward alone, median, GFLOP/s and over the peak
        "backward_s": backward,
        "backward_gflops": backward_gflops,
        "backward_peak_fraction": backward_gflops / peak_gflops if backward_gflops and peak_gflops else None,
        "backward_max_abs_err": kernel_check.max_abs_err if backward is not None and kernel_check else None,
        "shape": {
            **{k: getattr(case, k) for k in ("batch", "q_heads", "kv_heads", "q_len", "k_len", "head_dim", "value_dim")},
            "causal": case.causal,
            "kv_lens": list(case.kv_lens) if case.kv_lens else None,
            "hidden_size": case.hidden_size or None,
            "cached": case.cached if layer else None,
        },
        "gemm_fraction": gflops / gemm_gflops if gflops and gemm_gflops else None,
        "peak_kind": peak_kind,  # the arithmetic peak of the dtype: "fma32", "bf16dot" or "bf16tile" (None: not measured)
        "bfloat16_path": path,  # a port's bfloat16 case: "amx", "dot" or "convert", the path whose peak applies
        "peak_fraction": gflops / peak_gflops if gflops and peak_gflops else None,
    }
    if beside:
        row["read_gbps_beside"] = sum(beside) / len(beside)
        row["read_gbps_beside_each"] = beside
        row["read_fraction"] = gbps / row["read_gbps_beside"] if gbps else None
    return row


def add_pair(rows: list[dict[str, Any]], times: Optional[list[list[float]]], why: str) -> None:
    """The alternate timing's median (and its call count, or why it failed) on both ports' rows."""
    for row in rows:
        if row["backend"] not in PORTS:
            continue
        if times is None:
            row["paired_median_s"], row["paired_repeats"], row["paired_note"] = None, 0, why
        else:
            mine = times[PORTS.index(row["backend"])]
            row["paired_median_s"], row["paired_repeats"] = statistics.median(mine), len(mine)


def case_key(row: dict[str, Any]) -> tuple[str, str]:
    """A row's case in its dtype (rows of JSON written before dtypes existed are float32)."""
    return row["case"], row.get("dtype", "float32")


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedups within each case and dtype: over numpy, over torch (in the same dtype), over the
    fastest peer present; C++/Rust; and over the same backend's float32 and bfloat16 runs of the
    case."""
    by_case: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(case_key(row), {})[row["backend"]] = row

    def time_of(backends: dict[str, dict[str, Any]], name: str) -> Optional[float]:
        row = backends.get(name)
        return row["median_s"] if row is not None and row["status"] == "ok" else None

    for backends in by_case.values():
        numpy_s, torch_s = time_of(backends, "numpy"), time_of(backends, "torch")
        peers = {p: time_of(backends, p) for p in PEERS}
        best_peer = min(((s, p) for p, s in peers.items() if s is not None), default=None)
        cpp_s, rust_s = port_times(backends)
        ratio = cpp_s / rust_s if cpp_s and rust_s else None
        for row in backends.values():
            mine = row["median_s"] if row["status"] == "ok" else None
            row["speedup_vs_numpy"] = numpy_s / mine if mine and numpy_s else None
            row["speedup_vs_torch"] = torch_s / mine if mine and torch_s else None
            row["best_peer"] = best_peer[1] if best_peer else None
            row["speedup_vs_best_peer"] = best_peer[0] / mine if mine and best_peer else None
            row["cpp_over_rust"] = ratio
    for (case, _dtype), backends in by_case.items():
        for row in backends.values():
            mine = row["median_s"] if row["status"] == "ok" else None
            f32_s = time_of(by_case.get((case, "float32"), {}), row["backend"])
            row["speedup_vs_float32"] = f32_s / mine if mine and f32_s else None
            bf16_s = time_of(by_case.get((case, "bfloat16"), {}), row["backend"])
            row["speedup_vs_bfloat16"] = bf16_s / mine if mine and bf16_s else None


def port_times(ports: dict[str, dict[str, Any]]) -> tuple[Optional[float], Optional[float]]:
    """The C++ and Rust medians to compare: those of the alternate timing when it ran, else (an
    older JSON, or the alternate timing failed) those of the separate runs."""
    cpp, rust = ports.get("cpp"), ports.get("rust")
    if cpp is None or rust is None or cpp["status"] != "ok" or rust["status"] != "ok":
        return None, None
    if cpp.get("paired_median_s") and rust.get("paired_median_s"):
        return cpp["paired_median_s"], rust["paired_median_s"]
    return cpp["median_s"], rust["median_s"]


# ----------------------------------------------------------------------------------------------
# Table


def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if abs(s) < 1e-3:  # abs: the layer's overhead (step - kernel) can come out negative
        return f"{s * 1e6:.1f} us"
    if abs(s) < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _num(x: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:{spec}}{suffix}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


NUMBERS = ("thr", "median", "GFLOP/s", "%gemm", "%peak", "GB/s", "%read", "vs f32", "vs numpy", "vs torch",
           "vs peer", "max err")
# (heading, alignment) of the table's columns: text left, numbers right; the note runs to the end of the line
COLUMNS = [("case", "<"), ("backend", "<"), ("dtype", "<")] + [(name, ">") for name in NUMBERS] + [("note", "<")]


def _cells(row: dict[str, Any]) -> list[str]:
    ok = row["status"] == "ok"
    err = row.get("max_abs_err")
    cells = [row["case"], row["backend"], row.get("dtype", "float32"), str(row["threads"])]
    if ok:
        cells += [
            fmt_time(row["median_s"]),
            _num(row["gflops"], ".1f"),
            _pct(row.get("gemm_fraction")),
            _pct(row.get("peak_fraction")),
            _num(row.get("gbps"), ".1f"),
            _pct(row.get("read_fraction")),
            _num(row.get("speedup_vs_float32") if row.get("dtype", "float32") != "float32" else None, ".2f", "x"),
            _num(row.get("speedup_vs_numpy"), ".2f", "x"),
            _num(row.get("speedup_vs_torch"), ".2f", "x"),
            _num(row.get("speedup_vs_best_peer"), ".2f", "x"),
            _num(err, ".1e"),
        ]
    elif row["status"] == "wrong":
        cells += ["WRONG"] + ["-"] * 9 + [_num(err, ".1e")]
    else:
        cells += ["-"] * 11
    note = row.get("note") or ""
    if ok and row.get("layer_s") is not None:
        layer = (
            f"one decode step; kernel alone {fmt_time(row.get('kernel_s'))}, "
            f"overhead {fmt_time(row.get('overhead_s'))} ({_pct(row.get('overhead_fraction'))})"
        )
        note = f"{layer}; {note}" if note else layer
    if ok and row.get("backward_s") is not None:
        alone = (
            f"backward alone {fmt_time(row['backward_s'])}, {_num(row.get('backward_gflops'), '.1f')} GFLOP/s, "
            f"{_pct(row.get('backward_peak_fraction'))} of peak"
        )
        note = f"{alone}; {note}" if note else alone
    cells.append(note)
    return cells


def table(rows: Sequence[dict[str, Any]]) -> str:
    body = [_cells(r) for r in rows]
    header = [name for name, _ in COLUMNS]
    widths = [max(len(header[i]), *(len(c[i]) for c in body)) if body else len(header[i]) for i in range(len(header))]
    widths[-1] = 0  # the note runs to the end of the line

    def line(cells: Sequence[str]) -> str:
        parts = [f"{c:{align}{w}}" for c, (_, align), w in zip(cells, COLUMNS, widths)]
        return "  ".join(parts).rstrip()

    out = [line(header), line(["-" * w for w in widths[:-1]] + ["----"])]
    previous = None
    for row, cells in zip(rows, body):
        if previous is not None and row["case"] != previous:  # a case's dtypes stay together
            out.append("")
        previous = row["case"]
        out.append(line(cells))
    return "\n".join(out)


def set_peak_fractions(rows: Sequence[dict[str, Any]], ceilings: dict[str, Any]) -> None:
    """Each row's %peak against its thread count's peak as the run ended (see machine.raise_peak)."""
    for row in rows:
        kind, peak = peak_for(row["dtype"], ceilings["by_threads"].get(str(row["threads"]), {}), row.get("bfloat16_path"))
        row["peak_kind"] = kind
        row["peak_fraction"] = row["gflops"] / peak if row.get("gflops") and peak else None
        backward = row.get("backward_gflops")
        row["backward_peak_fraction"] = backward / peak if backward and peak else None


def port_table(rows: Sequence[dict[str, Any]]) -> str:
    """C++ against Rust, case by case: the ratio of their median times (< 1: C++ is faster)."""
    cases: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row["backend"] in ("cpp", "rust"):
            cases.setdefault(case_key(row), {})[row["backend"]] = row
    lines = []
    for (name, dtype), ports in cases.items():
        case = name if dtype == "float32" else f"{name} {dtype}"
        if len(ports) < 2:
            continue
        cpp_s, rust_s = port_times(ports)
        ratio = cpp_s / rust_s if cpp_s and rust_s else None
        verdict = (
            "-" if ratio is None else ("C++ faster" if ratio < 0.97 else "Rust faster" if ratio > 1.03 else "within 3%")
        )
        paired = bool(ports["cpp"].get("paired_median_s") and ports["rust"].get("paired_median_s"))
        why = ports["cpp"].get("paired_note") or ""
        if ratio is not None and not paired:
            verdict += " (separate runs" + (f"; alternate timing failed: {why}" if why else "") + ")"
        lines.append(f"{case:<33} {fmt_time(cpp_s):>10} {fmt_time(rust_s):>10} {_num(ratio, '.3f'):>9}  {verdict}")
    if not lines:
        return ""
    head = f"{'case':<33} {'cpp':>10} {'rust':>10} {'cpp/rust':>9}"
    return "\n".join([head, "-" * len(head)] + lines + [port_gap_line(cases)])


def port_gap_line(cases: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The target "C++ and Rust within PORT_GAP of each other on every case": met, or the cases
    where the slower port is more than that behind (by the alternate timing where it ran)."""
    gaps = []
    for (name, dtype), ports in cases.items():
        cpp_s, rust_s = port_times(ports)
        if cpp_s and rust_s:
            gaps.append((max(cpp_s / rust_s, rust_s / cpp_s) - 1, name if dtype == "float32" else f"{name} {dtype}"))
    missed = [f"{case} {100 * gap:.0f}%" for gap, case in gaps if gap > PORT_GAP]
    verdict = "met" if not missed else "missed on " + ", ".join(missed)
    return f"ports within {100 * PORT_GAP:.0f}% of each other on every case timed by both ({len(gaps)}): {verdict}"


def layer_table(rows: Sequence[dict[str, Any]]) -> str:
    """The layer case, backend by backend: the step, the kernel alone, and what the layer adds."""
    layer_rows = [r for r in rows if r.get("kind") == "layer"]
    if not layer_rows:
        return ""
    head = (
        f"{'case':<16} {'backend':<11} {'dtype':<8} {'thr':>3} {'step':>10} {'kernel':>10} {'overhead':>10} "
        f"{'of step':>7} {'max err':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in layer_rows:
        start = f"{r['case']:<16} {r['backend']:<11} {r.get('dtype', 'float32'):<8} {r['threads']:>3}"
        if r["status"] == "ok":
            lines.append(
                f"{start} {fmt_time(r['layer_s']):>10} "
                f"{fmt_time(r['kernel_s']):>10} {fmt_time(r['overhead_s']):>10} "
                f"{_pct(r['overhead_fraction']):>7} {_num(r.get('max_abs_err'), '.1e'):>8}"
            )
        else:
            status = "WRONG" if r["status"] == "wrong" else r["status"]
            lines.append(f"{start} {status:>10}  {r.get('note') or ''}")
    return "\n".join(lines)


# the float16 / bfloat16 targets, as ratios within one run: (case, dtype, row field, minimum, what it is)
TARGETS = (
    ("prefill-causal/N=2048", "bfloat16", "speedup_vs_float32", 1.6, "vs its float32"),
    ("prefill-causal/N=2048", "bfloat16", "speedup_vs_torch", 2.2, "vs torch bfloat16"),
    ("prefill-causal/N=2048", "float16", "speedup_vs_float32", 1.0, "vs its float32"),
    ("decode/N=32768", "bfloat16", "speedup_vs_float32", 1.8, "vs its float32"),
    ("decode/N=32768", "float16", "speedup_vs_float32", 1.8, "vs its float32"),
)
# the int8 K/V targets (bytes read = int8 payload + float32 scales); "ports within 10% on every
# int8 case" is int8_port_lines'
INT8_TARGETS = (
    ("decode/N=32768", "int8", "speedup_vs_float32", 3.0, "vs its float32"),
    ("decode/N=32768", "int8", "speedup_vs_bfloat16", 1.5, "vs its bfloat16"),
    ("decode/N=32768", "int8", "read_fraction", 0.75, "of the read bandwidth"),
    ("decode-batch", "int8", "speedup_vs_float32", 2.5, "vs its float32"),
)
PORT_GAP = 0.10  # C++ and Rust within 10% of each other on every case (int8 too)
# the targets at the machine's limits: prefill against the arithmetic peak of its path (float32:
# FMA; bfloat16 on the dot path: VDPBF16PS), decode against the read bandwidth measured beside it
# (int8's, 75%, is among INT8_TARGETS)
MACHINE_TARGETS = (
    ("prefill-causal/N=2048", "float32", "peak_fraction", 0.80, "of the FMA peak"),
    ("prefill-causal/N=2048", "bfloat16", "peak_fraction", 0.75, "of its path's peak"),
    ("decode/N=32768", "float32", "read_fraction", 0.85, "of the read bandwidth"),
    ("decode/N=32768", "float16", "read_fraction", 0.85, "of the read bandwidth"),
    ("decode/N=32768", "bfloat16", "read_fraction", 0.85, "of the read bandwidth"),
)
# the training targets: forward and backward against torch's SDPA forward and backward, and the
# backward alone against the float32 FMA peak
TRAIN_TARGETS = (
    ("train-causal/N=2048", "float32", "speedup_vs_torch", 2.0, "fwd+bwd vs torch"),
    ("train-causal/N=2048", "bfloat16", "speedup_vs_torch", 2.0, "fwd+bwd vs torch"),
    ("train-causal/N=2048", "float32", "backward_peak_fraction", 0.55, "backward alone of peak"),
)


def targets_table(rows: Sequence[dict[str, Any]], targets: Sequence[tuple[str, str, str, float, str]] = TARGETS) -> str:
    """The dtype targets this run can speak to, port by port: the figure, the target, met or by how
    much it is missed. Empty when the run has none of those cases."""
    lines = []
    for case, dtype, field, minimum, what in targets:
        for row in rows:
            if case_key(row) != (case, dtype) or row["backend"] not in PORTS:
                continue
            value = row.get(field) if row["status"] == "ok" else None
            fraction = field.endswith("fraction")
            shown = "-" if value is None else (_pct(value) if fraction else f"{value:.2f}x")
            wanted = _pct(minimum) if fraction else f"{minimum:g}x"
            verdict = (
                f"not measured ({row['status'] if row['status'] != 'ok' else 'no figure to compare with in this run'})"
                if value is None
                else "met" if value >= minimum else f"missed by {100 * (1 - value / minimum):.0f}%"
            )
            lines.append(f"{case + ' ' + dtype:<31} {row['backend']:<5} {what:<22} {shown:>6}  (>= {wanted}): {verdict}")
    return "\n".join(lines)


def int8_port_lines(rows: Sequence[dict[str, Any]]) -> str:
    """The int8 target "ports within 10%": per int8 case with both ports timed, C++ / Rust (the
    alternate timing's medians where it ran), met when neither is more than PORT_GAP slower."""
    lines = []
    for name, dtype in dict.fromkeys(case_key(r) for r in rows if r.get("dtype") == "int8"):
        ratio = next((r.get("cpp_over_rust") for r in rows if case_key(r) == (name, dtype)), None)
        if ratio is None:
            continue
        gap = max(ratio, 1 / ratio) - 1
        verdict = "met" if gap <= PORT_GAP else f"missed: {100 * gap:.0f}% apart"
        lines.append(f"{name + ' ' + dtype:<31} cpp/rust {ratio:.2f}  (within {100 * PORT_GAP:.0f}%): {verdict}")
    return "\n".join(lines)


def header(document: dict[str, Any]) -> str:
    m, c = document["machine"], document["ceilings"]
    isa = ", ".join(f"{port} {isa}" for port, isa in m["isa"].items()) or "no native port built"
    lines = [
        f"twinattn-bench: {document['command']}",
        f"machine: {m['cpu']} ({', '.join(m['cpu_flags'])}), {m['usable_cores']} usable cores, {m['threads']} threads",
        f"ports:   {isa}",
        f"timed:   {'; '.join(m['backends'].values())}",
        f"ceilings ({m['threads']} thr): NumPy float32 GEMM {c['gemm_gflops']:.1f} GFLOP/s "
        f"(OpenBLAS kernel {c['gemm_kernel']}), read bandwidth {c['read_gbps']:.1f} GB/s",
    ]
    for t, entry in c["by_threads"].items():
        if int(t) != m["threads"]:
            lines.append(
                f"          ({t} thr): GEMM {entry['gemm_gflops']:.1f} GFLOP/s, read {entry['read_gbps']:.1f} GB/s"
            )
    for t, entry in c["by_threads"].items():
        peaks = []
        for kind, peak in entry.get("peaks", {}).items():
            name = PEAK_KINDS.get(kind, kind)
            if peak.get("gflops"):
                how = f"best of {peak['repeats']}" if peak.get("repeats") else ""
                how = "; ".join(t for t in (how, peak.get("note")) if t)
                peaks.append(f"{name} {peak['gflops']:.1f} GFLOP/s ({peak['port']} measure_peak{', ' + how if how else ''})")
            else:
                peaks.append(f"{name}: not measured ({peak.get('why', 'unknown')})")
        if peaks:
            lines.append(f"peaks ({t} thr): " + "; ".join(peaks))
    if "bfloat16" in document.get("dtypes", ()):
        lines.append(bfloat16_line(m["ports"]))
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


def bfloat16_line(ports: dict[str, Any]) -> str:
    """Which bfloat16 path each port took and why, and so which peak its rows' %peak is against."""
    said, threshold = [], None
    for port, info in ports.items():
        path = info.get("bfloat16_path")
        if not info.get("available") or path is None:
            continue
        ratio = info.get("bf16dot_over_fma32")
        said.append(f"{port} {path} path ({f'VDPBF16PS {ratio:.2f}x FMA' if ratio is not None else 'isa ' + info['isa']})")
        threshold = threshold if ratio is None else info["constants"]["bf16_dot_min_ratio"]
    rule = f"; the dot path needs {threshold:g}x" if threshold is not None else ""
    return (f"bfloat16: {', '.join(said) or 'no native port built'}{rule}. %peak: convert against "
            f"{PEAK_KINDS[BFLOAT16_PEAKS['convert']]}, dot against {PEAK_KINDS[BFLOAT16_PEAKS['dot']]}, "
            f"amx against {PEAK_KINDS[BFLOAT16_PEAKS['amx']]}; split-key calls (decode) convert; peers against the "
            "highest peak")


def text(document: dict[str, Any]) -> str:
    """The run on stdout: header, the table, C++ against Rust, the layer case, what was not run."""
    rows = document["results"]
    parts = [header(document)] + ([table(rows)] if rows else [])  # --cases e2e alone has no kernel rows
    ports = port_table(rows)
    if ports:
        heading = "C++ against Rust, timed alternately call by call (ratio of median times; < 1: C++ faster):"
        parts.append(f"{heading}\n{ports}")
    targets = targets_table(rows)
    if targets:
        parts.append(f"float16 / bfloat16 targets (ratios within this run):\n{targets}")
    int8_targets = "\n".join(t for t in (targets_table(rows, INT8_TARGETS), int8_port_lines(rows)) if t)
    if int8_targets:
        parts.append(
            "int8 K/V targets (ratios within this run; bytes = int8 payload + float32 scales; "
            f"torch has no int8 attention, so no peer):\n{int8_targets}"
        )
    machine_targets = targets_table(rows, MACHINE_TARGETS)
    if machine_targets:
        parts.append(
            "at the machine's limits (within this run; %read: over the read bandwidth measured beside the "
            f"case):\n{machine_targets}"
        )
    train_targets = targets_table(rows, TRAIN_TARGETS)
    if train_targets:
        parts.append(f"training targets (ratios within this run; %peak: the backward alone):\n{train_targets}")
    layers = layer_table(rows)
    if layers:
        heading = (
            "nn.Attention decode step against the kernel alone "
            "(overhead = step - kernel: projections, RoPE, cache append, o_proj, Python):"
        )
        parts.append(f"{heading}\n{layers}")
    end_to_end = document.get("e2e")
    if end_to_end and end_to_end.get("rows"):
        heading = (
            f"end to end: transformers {end_to_end['transformers']}, torch {end_to_end['torch']}, "
            f"{end_to_end['threads']} threads; prefill of a random prompt, then {end_to_end['steps']} greedy decode "
            "steps (median) at each context; split: attention and cache appends timed in one more pass, matrix products "
            "profiled in another:"
        )
        parts.append(f"{heading}\n{e2e.format_rows(end_to_end['rows'])}")
        goals = e2e.targets(end_to_end["rows"], e2e.plans_by_title(), end_to_end.get("shrink", 1))
        if goals:
            parts.append(f"end-to-end targets (ratios within this run):\n{goals}")
    if end_to_end and end_to_end.get("generate"):
        heading = (
            "plain generate() with no cache argument (twinattn gets the TwinattnCache generate makes for it, sdpa a "
            "DynamicCache): decode tokens/s of the median step over interleaved rounds in one process:"
        )
        parts.append(f"{heading}\n{e2e.format_generate(end_to_end['generate'])}")
    if end_to_end and end_to_end.get("overhead"):
        heading = "per call on the tiny case (B=1, H=1, Lq=Lk=16, D=64, causal), fastest of interleaved rounds:"
        parts.append(f"{heading}\n{e2e.format_overhead(end_to_end['overhead'])}")
    if end_to_end and (end_to_end.get("generate") or end_to_end.get("overhead")):
        goals = e2e.generate_targets(end_to_end.get("generate", []), end_to_end.get("overhead", []))
        parts.append(f"plain generate() and per-call targets (ratios within this run):\n{goals}")
    if end_to_end and end_to_end.get("error"):
        parts.append(f"end to end: failed: {end_to_end['error']}")
    for entry in (end_to_end or {}).get("models", {}).values():
        if entry.get("error"):
            parts.append(f"end to end: {entry['title']} failed: {entry['error']}")
    missing = {**document["peers_missing"], **document.get("not_timed_in_dtype", {})}
    if end_to_end and end_to_end.get("skipped"):
        missing["e2e"] = end_to_end["skipped"]
    for entry in (end_to_end or {}).get("models", {}).values():
        if entry.get("skipped"):
            missing[f"e2e {entry['title']}"] = entry["skipped"]
    if missing:
        parts.append("not run: " + "; ".join(f"{name} ({why})" for name, why in missing.items()))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------
# JSON


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(_clean(document), f, indent=2, allow_nan=False)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# Plot

STYLE = {
    "cpp": ("tab:blue", "o"),
    "rust": ("tab:orange", "s"),
    "numpy": ("tab:gray", "v"),
    "torch": ("tab:red", "^"),
    "onnxruntime": ("tab:green", "D"),
    "openvino": ("tab:purple", "P"),
    "flex": ("tab:brown", "X"),
}


DTYPE_LINES = {"float32": "-", "bfloat16": "--", "float16": ":", "int8": "-."}


def plot(path: str, document: dict[str, Any]) -> None:
    """GFLOP/s against N for causal prefill, GB/s against N for decode; one line per backend and
    dtype (the dtype's line style), the measured ceilings as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in document["results"] if r["status"] == "ok"]
    ceilings, threads = document["ceilings"], document["machine"]["threads"]
    dtypes = document.get("dtypes", ["float32"])
    gemm, read = ceilings.get("gemm_gflops"), ceilings.get("read_gbps")
    compute = [(gemm, f"NumPy sgemm {gemm or 0:.0f} GFLOP/s ({ceilings.get('gemm_kernel', '')}, {threads} thr)")]
    for kind, peak in ceilings.get("peaks", {}).items():
        if peak.get("gflops"):
            compute.append((peak["gflops"], f"{PEAK_KINDS.get(kind, kind)} peak {peak['gflops']:.0f} GFLOP/s"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = (
        (left, "prefill-causal", "gflops", "GFLOP/s", "causal prefill, Hq 32 / Hkv 8, D 128", "N (query = key tokens)",
         compute),
        (right, "decode", "gbps", "GB/s of K and V read", "decode, 1 query, Hq 32 / Hkv 8, D 128", "N (cached tokens)",
         [(read, f"read bandwidth {read or 0:.1f} GB/s (start of run)")]),
    )
    for ax, group, key, ylabel, title, xlabel, lines in panels:
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r["group"] == group and r.get(key) is not None:
                series.setdefault((r["backend"], r.get("dtype", "float32")), []).append((r["x"], r[key]))
        for (backend, dtype), points in series.items():
            points.sort()
            color, marker = STYLE.get(backend, (None, "x"))
            label = backend if len(dtypes) == 1 else f"{backend} {dtype}"
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=color, label=label, lw=1.8,
                    ls=DTYPE_LINES.get(dtype, "-"))
        for ceiling, ceiling_label in lines:
            if ceiling:
                ax.axhline(ceiling, color="black", ls="--", lw=1)
                ax.annotate(ceiling_label, (0.01, ceiling), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
        beside = sorted((r["x"], r["read_gbps_beside"]) for r in rows if r["group"] == group and r.get("read_gbps_beside"))
        if beside:
            ax.scatter(*zip(*beside), color="black", marker="_", s=120, label="read bandwidth beside each run", zorder=3)
        ax.set_xscale("log", base=2)
        xs = sorted({r["x"] for r in rows if r["group"] == group})
        if xs:
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, f"no {group} results in this run", transform=ax.transAxes, ha="center")
    machine = document["machine"]
    fig.suptitle(f"twinattn {machine['twinattn']} on {machine['cpu']}, {threads} threads, {', '.join(dtypes)}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
