"""The machine a run measured, and its ceilings, measured in the same run.

GEMM ceiling: float32 C = A @ B through NumPy (n x n, 2 n^3 FLOPs), with NumPy's BLAS limited to
the case's thread count; the OpenBLAS kernel that ran ("architecture", e.g. SkylakeX or Haswell)
is named from threadpoolctl. OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the environment change that
kernel (OPENBLAS_CORETYPE=Haswell halves the throughput on AVX-512 machines); they are reported.

Read bandwidth: a buffer far larger than the last-level cache is summed by T Python threads at
once, each reducing its own contiguous slice with np.add.reduce (NumPy releases the GIL in the
reduction, so the slices are read in parallel). Bytes read / wall time is the read bandwidth of
T threads. Bandwidth on these machines drifts by up to 1.5x over minutes, so decode cases are
reported against a measurement taken right beside each of them (see the CLI).

Arithmetic peaks: the native ports' measure_peak(kind, threads, seconds), a register-resident loop
of independent instructions on the port's own thread pool: "fma32" (float32 FMA: AVX-512, or AVX2
where there is none) and, when the run has bfloat16 cases, "bf16dot" (VDPBF16PS, bf16 pairs into
float32: 64 FLOPs per instruction) and "bf16tile" (AMX TDPBF16PS, 16 x 16 float32 tiles from
16 x 32 bfloat16: 16384 FLOPs per instruction). A CPU without AVX512_BF16 (or AMX-BF16), or a build
without measure_peak, gives no figure and the reason instead. float32 and float16 cases (float16 is
converted to float32 and multiplied in float32) are reported against the FMA peak; bfloat16 against
the peak of the path that ran (bfloat16_path): on a twinattn port, the tile peak where it took the
AMX path, the dot-product peak where it took the dot path (VDPBF16PS), the FMA peak where it
converted to float32 (the port's choice for this CPU, see build_info()'s "bfloat16_path", and
always in the split-key path of decode); on a peer, whose kernels are its own, the highest of them. A peak is the
best of PEAK_REPEATS measurements (another process on the machine only ever lowers one), and a case
that runs faster than that has the peak measured again (raise_peak): %peak never passes 100% by a
low measurement.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np

import twinattn
from twinattn.core._backends import native_module

GEMM_N = 2048
READ_BYTES = 1 << 30  # 1 GiB: 32x the 32 MiB L3 of the development machines
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def _cpuinfo(*keys: str) -> Optional[str]:
    """The value of the first /proc/cpuinfo line that starts with one of `keys`."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(keys)), None)
    except OSError:
        return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    present = set((_cpuinfo("flags", "Features") or "").split())
    wanted = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx2", "fma", "f16c", "asimd",
              "bf16", "sve")
    return [flag for flag in wanted if flag in present]


def blas_info() -> dict[str, Any]:
    """NumPy's BLAS as threadpoolctl sees it: library, version, kernel ("architecture"), threads."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {"kernel": "unknown (install threadpoolctl to name it)"}
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    # prefer the BLAS that NumPy itself loaded (torch may bring another)
    pools.sort(key=lambda p: "numpy" not in str(p.get("filepath", "")))
    if not pools:
        return {"kernel": "unknown (threadpoolctl found no BLAS)"}
    pool = pools[0]
    return {
        "library": pool.get("internal_api"),
        "version": pool.get("version"),
        "kernel": pool.get("architecture") or "unknown",
        "threading_layer": pool.get("threading_layer"),
        "num_threads": pool.get("num_threads"),
        "filepath": pool.get("filepath"),
    }


def describe(backends: dict[str, str], threads: int) -> dict[str, Any]:
    info = twinattn.build_info()
    ports = {port: info[port] for port in ("cpp", "rust") if port in info}
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "arch": platform.machine(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": threads,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "twinattn": twinattn.__version__,
        "ports": ports,  # per native port: available, isa chosen at run time, threads, compiler
        "isa": {port: p.get("isa") for port, p in ports.items() if p.get("available")},
        "backends": backends,  # name -> version of everything timed
        "blas": blas_info(),
        "env": {name: os.environ.get(name) for name in OPENBLAS_ENV + ("TWINATTN_ISA", "TWINATTN_NUM_THREADS")},
    }


def blas_limits(threads: int) -> Any:
    """NumPy's BLAS limited to `threads` (undo with .restore_original_limits()), or None without
    threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=threads, user_api="blas")


def settle() -> None:
    """Let the previous library's worker threads stop spinning (OpenBLAS, OpenMP, ORT's pool) so
    they do not steal cores from the next measurement."""
    time.sleep(0.1)


def memory_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def gemm_gflops(threads: int, n: Optional[int] = None, budget_s: float = 1.0, min_repeats: int = 3) -> dict[str, Any]:
    """Median float32 n x n matrix-multiply throughput through NumPy with `threads` BLAS threads."""
    n = n or GEMM_N
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    limits = blas_limits(threads)
    try:
        np.matmul(a, b, out=c)  # warm-up: BLAS threads started, pages touched
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < 50):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            times.append(time.perf_counter() - t0)
        kernel = blas_info().get("kernel")
    finally:
        if limits is not None:
            limits.restore_original_limits()
    median = statistics.median(times)
    return {"gflops": 2 * n**3 / median / 1e9, "n": n, "threads": threads, "kernel": kernel, "repeats": len(times)}


class ReadBandwidth:
    """Read bandwidth of `threads` threads over a buffer much larger than the caches."""

    def __init__(self, nbytes: Optional[int] = None) -> None:
        self.nbytes = nbytes or READ_BYTES
        self.buffer: Optional[np.ndarray] = None
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def _data(self) -> np.ndarray:
        if self.buffer is None:
            self.buffer = np.ones(self.nbytes // 4, dtype=np.float32)  # written: every page is real
        return self.buffer

    def measure(self, threads: int, repeats: int = 5) -> dict[str, Any]:
        data = self._data()
        slices = np.array_split(data, threads)
        if threads == 1:

            def read() -> None:
                np.add.reduce(data)
        else:
            pool = self._pools.get(threads)
            if pool is None:
                pool = self._pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="twinattn-bw")

            def read() -> None:
                list(pool.map(np.add.reduce, slices))

        read()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        return {"gbps": data.nbytes / median / 1e9, "threads": threads, "bytes": data.nbytes, "repeats": repeats}

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        self._pools.clear()
        self.buffer = None


READ_METHOD = (
    "np.add.reduce over a float32 buffer of {size}, split into one contiguous slice per thread, "
    "the slices summed at once by {threads} Python thread(s) (NumPy releases the GIL); median of 5"
)


PEAK_KINDS = {"fma32": "float32 FMA", "bf16dot": "BF16 dot product (VDPBF16PS)", "bf16tile": "BF16 tiles (AMX TDPBF16PS)"}
PEAK_REPEATS = 5  # a peak is the best of this many measurements


def native_peak(kind: str, threads: int, seconds: float, repeats: int = PEAK_REPEATS) -> dict[str, Any]:
    """The best of `repeats` calls of measure_peak(kind, threads, seconds) of the first native port
    that has it: {"gflops", "port", "repeats", "each"}, or {"gflops": None, "why"} where no port
    measures it (the CPU lacks the instruction: the port's own message; no port built; a build
    without measure_peak)."""
    why = "no native port built"
    for port in ("cpp", "rust"):
        if port not in twinattn.backends():
            continue
        measure = getattr(native_module(port), "measure_peak", None)
        if measure is None:
            why = "no native port of this build has measure_peak"
            continue
        try:
            each = [float(measure(kind, threads, seconds)) for _ in range(repeats)]
        except ValueError as exc:  # the CPU lacks the instruction (the message says which)
            return {"gflops": None, "port": port, "why": str(exc)}
        return {"gflops": max(each), "port": port, "repeats": repeats, "each": each}
    return {"gflops": None, "why": why}


def raise_peak(entry: dict[str, Any], kind: str, threads: int, seconds: float, gflops: float, what: str) -> None:
    """A case (`what`) ran at `gflops`, above the `kind` peak of one thread count's ceilings
    (`entry`): the peak is measured again and becomes the best of all its measurements; if the case
    is still faster, the case's own figure becomes the peak. Either way entry's peak says so in
    its "note"."""
    peak = entry["peaks"][kind]
    first = peak["gflops"]
    again = native_peak(kind, threads, seconds)
    best = max(first, again["gflops"] or 0.0)
    peak["each"] = peak.get("each", []) + again.get("each", [])
    note = f"measured again after {what} ran at {gflops:.1f} GFLOP/s, above the {first:.1f} measured first"
    if gflops > best:
        best = gflops
        note += f"; still above, so the peak is {what}'s own figure"
    peak["gflops"], peak["note"] = best, note


BFLOAT16_PEAKS = {"amx": "bf16tile", "dot": "bf16dot", "convert": "fma32"}  # the peak of each bfloat16 path


def bfloat16_path(backend: str, case: Any) -> Optional[str]:
    """The path a bfloat16 `case` (suite.Case) takes on `backend`: "amx" (TDPBF16PS tiles), "dot"
    (VDPBF16PS) or "convert" (widened to float32, FMA) on a twinattn port, from its build_info()["bfloat16_path"], except
    that groups of at most q_tile_rows packed query rows (Lq x Hq / Hkv: decode, short chunks) take
    the split-key path, which converts on every instruction set (docs/kernels.md); None for a
    peer (its kernels are its own) and for every other dtype."""
    if case.dtype != "bfloat16" or backend not in ("cpp", "rust"):
        return None
    info = twinattn.build_info()[backend]
    if not info.get("available"):
        return None
    if case.q_len * (case.q_heads // case.kv_heads) <= info["constants"]["q_tile_rows"]:
        return "convert"
    return str(info["bfloat16_path"])


def peak_for(
    dtype: str, entry: dict[str, Any], path: Optional[str] = None
) -> tuple[Optional[str], Optional[float]]:
    """The arithmetic peak a case in `dtype` is measured against (module docstring), from one
    thread count's ceilings: (kind, GFLOP/s), or (None, None) where none was measured. `path`:
    bfloat16's path where known (bfloat16_path), else the highest of its peaks."""
    peaks = entry.get("peaks", {})
    kinds = ["fma32"]
    if dtype == "bfloat16":
        kinds = [BFLOAT16_PEAKS[path]] if path is not None else ["bf16tile", "bf16dot", "fma32"]
    measured = [(peaks[kind]["gflops"], kind) for kind in kinds if peaks.get(kind, {}).get("gflops")]
    if not measured:
        return None, None
    gflops, kind = max(measured)
    return kind, gflops


def peak_seconds(quick: bool) -> float:
    """Seconds of each measure_peak call."""
    return 0.1 if quick else 0.25


def measure_ceilings(
    thread_counts: Sequence[int],
    quick: bool,
    bandwidth: ReadBandwidth,
    show: Callable[[str], None],
    dtypes: Sequence[str] = ("float32",),
) -> dict[str, Any]:
    """GEMM, read bandwidth and the arithmetic peaks (bf16dot and bf16tile only with bfloat16 among `dtypes`)
    for every thread count of the run; the top-level figures are the largest count's. `show`
    reports progress."""
    by_threads: dict[str, dict[str, Any]] = {}
    kinds = ["fma32"] + (["bf16dot", "bf16tile"] if "bfloat16" in dtypes else [])
    for t in thread_counts:
        show(f"ceilings: NumPy float32 GEMM and read bandwidth, {t} thread(s)")
        settle()
        gemm = gemm_gflops(t, budget_s=0.5 if quick else 1.5)
        settle()
        read = bandwidth.measure(t)
        peaks = {}
        for kind in kinds:
            show(f"ceilings: {PEAK_KINDS[kind]} peak, {t} thread(s)")
            settle()
            peaks[kind] = native_peak(kind, t, peak_seconds(quick))
        by_threads[str(t)] = {
            "gemm_gflops": gemm["gflops"],
            "gemm_kernel": gemm["kernel"],
            "gemm_n": gemm["n"],
            "read_gbps": read["gbps"],
            "peaks": peaks,
        }
    top = by_threads[str(max(thread_counts))]
    return {
        "gemm_gflops": top["gemm_gflops"],
        "read_gbps": top["read_gbps"],
        "gemm_kernel": top["gemm_kernel"],
        "peaks": top["peaks"],
        "gemm_method": f"numpy.matmul float32 {GEMM_N}x{GEMM_N}, median, BLAS threads = case threads",
        "read_method": READ_METHOD.format(size=f"{bandwidth.nbytes >> 20} MiB", threads="T"),
        "peak_method": f"the best of {PEAK_REPEATS} calls of the native port's measure_peak(kind, threads, seconds): "
        "independent register-resident FMA (fma32), VDPBF16PS (bf16dot) or TDPBF16PS (bf16tile) instructions on its "
        "thread pool; "
        "measured again when a case runs faster (raise_peak)",
        "by_threads": by_threads,
    }
