"""What a run reports: result rows with derived figures, the table on stdout, JSON, and the plot."""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

PEERS = ("torch", "onnxruntime")


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedups within each case: over numpy, over torch, over the fastest peer present; C++/Rust."""
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["backend"]] = row

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
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _num(x: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:{spec}}{suffix}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


COLUMNS = (
    ("case", "<"),
    ("backend", "<"),
    ("thr", ">"),
    ("median", ">"),
    ("GFLOP/s", ">"),
    ("%gemm", ">"),
    ("GB/s", ">"),
    ("%read", ">"),
    ("vs numpy", ">"),
    ("vs torch", ">"),
    ("vs peer", ">"),
    ("max err", ">"),
    ("note", "<"),
)


def _cells(row: dict[str, Any]) -> list[str]:
    ok = row["status"] == "ok"
    err = row.get("max_abs_err")
    cells = [row["case"], row["backend"], str(row["threads"])]
    if ok:
        cells += [
            fmt_time(row["median_s"]),
            _num(row["gflops"], ".1f"),
            _pct(row.get("gemm_fraction")),
            _num(row.get("gbps"), ".1f"),
            _pct(row.get("read_fraction")),
            _num(row.get("speedup_vs_numpy"), ".2f", "x"),
            _num(row.get("speedup_vs_torch"), ".2f", "x"),
            _num(row.get("speedup_vs_best_peer"), ".2f", "x"),
            _num(err, ".1e"),
        ]
    elif row["status"] == "wrong":
        cells += ["WRONG"] + ["-"] * 7 + [_num(err, ".1e")]
    else:
        cells += ["-"] * 9
    note = row.get("note") or ""
    if ok and row.get("layer_s") is not None:
        layer = (
            f"one decode step; kernel alone {fmt_time(row.get('kernel_s'))}, "
            f"overhead {fmt_time(row.get('overhead_s'))} ({_pct(row.get('overhead_fraction'))})"
        )
        note = f"{layer}; {note}" if note else layer
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
        if previous is not None and row["case"] != previous:
            out.append("")
        previous = row["case"]
        out.append(line(cells))
    return "\n".join(out)


def port_table(rows: Sequence[dict[str, Any]]) -> str:
    """C++ against Rust, case by case: the ratio of their median times (< 1: C++ is faster)."""
    cases: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["backend"] in ("cpp", "rust"):
            cases.setdefault(row["case"], {})[row["backend"]] = row
    lines = []
    for case, ports in cases.items():
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
        lines.append(f"{case:<24} {fmt_time(cpp_s):>10} {fmt_time(rust_s):>10} {_num(ratio, '.3f'):>9}  {verdict}")
    if not lines:
        return ""
    head = f"{'case':<24} {'cpp':>10} {'rust':>10} {'cpp/rust':>9}"
    return "\n".join([head, "-" * len(head)] + lines)


def layer_table(rows: Sequence[dict[str, Any]]) -> str:
    """The layer case, backend by backend: the step, the kernel alone, and what the layer adds."""
    layer_rows = [r for r in rows if r.get("kind") == "layer"]
    if not layer_rows:
        return ""
    head = (
        f"{'case':<16} {'backend':<11} {'thr':>3} {'step':>10} {'kernel':>10} {'overhead':>10} "
        f"{'of step':>7} {'max err':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in layer_rows:
        if r["status"] == "ok":
            lines.append(
                f"{r['case']:<16} {r['backend']:<11} {r['threads']:>3} {fmt_time(r['layer_s']):>10} "
                f"{fmt_time(r['kernel_s']):>10} {fmt_time(r['overhead_s']):>10} "
                f"{_pct(r['overhead_fraction']):>7} {_num(r.get('max_abs_err'), '.1e'):>8}"
            )
        else:
            status = "WRONG" if r["status"] == "wrong" else r["status"]
            lines.append(f"{r['case']:<16} {r['backend']:<11} {r['threads']:>3} {status:>10}  {r.get('note') or ''}")
    return "\n".join(lines)


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
}


def plot(path: str, document: dict[str, Any]) -> None:
    """GFLOP/s against N for causal prefill, GB/s against N for decode; one line per backend, the
    measured ceilings as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in document["results"] if r["status"] == "ok"]
    ceilings = document["ceilings"]
    threads = document["machine"]["threads"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = (
        (left, "prefill-causal", "gflops", "GFLOP/s", "causal prefill, Hq 32 / Hkv 8, D 128", "N (query = key tokens)"),
        (right, "decode", "gbps", "GB/s of K and V read", "decode, 1 query, Hq 32 / Hkv 8, D 128", "N (cached tokens)"),
    )
    for ax, group, key, ylabel, title, xlabel in panels:
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["group"] == group and r.get(key) is not None:
                series.setdefault(r["backend"], []).append((r["x"], r[key]))
        for backend, points in series.items():
            points.sort()
            color, marker = STYLE.get(backend, (None, "x"))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=color, label=backend, lw=1.8)
        if group == "prefill-causal":
            gemm = ceilings.get("gemm_gflops")
            if gemm:
                kernel = ceilings.get("gemm_kernel", "")
                ax.axhline(gemm, color="black", ls="--", lw=1)
                ax.annotate(
                    f"NumPy sgemm {gemm:.0f} GFLOP/s ({kernel}, {threads} thr)",
                    (0.01, gemm),
                    xycoords=("axes fraction", "data"),
                    va="bottom",
                    fontsize=8,
                )
        else:
            read = ceilings.get("read_gbps")
            if read:
                ax.axhline(read, color="black", ls="--", lw=1)
                ax.annotate(
                    f"read bandwidth {read:.1f} GB/s (start of run)",
                    (0.01, read),
                    xycoords=("axes fraction", "data"),
                    va="bottom",
                    fontsize=8,
                )
            beside = sorted(
                (r["x"], r["read_gbps_beside"]) for r in rows if r["group"] == group and r.get("read_gbps_beside")
            )
            if beside:
                ax.scatter(
                    [b[0] for b in beside],
                    [b[1] for b in beside],
                    color="black",
                    marker="_",
                    s=120,
                    label="read bandwidth beside each run",
                    zorder=3,
                )
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
    fig.suptitle(f"twinattn {machine['twinattn']} on {machine['cpu']}, {threads} threads, float32", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
