"""twinattn-bench --cases train-memory: what one training step's attention keeps in memory.

One forward and backward of causal attention (Hq 32, Hkv 8, D 128, N = 8192 positions by
default, as a long-context fine-tuning step), each backend in each dtype in a fresh Python
process, so that nothing an earlier call allocated (the ports keep their packing buffers per
thread across calls; the allocator keeps freed memory) serves this one. The process makes the
inputs and dout, hands the memory its allocator holds free back to the system (glibc's
malloc_trim), resets its peak resident size (Linux's /proc/self/clear_refs), runs the step, and
reports the peak resident growth beyond the step's outputs and gradients:

  twinattn (cpp, rust)  twinattn.core.backward.attention_for_training, then attention_backward, as
                        twinattn.torch's autograd and the train cases call them: outputs out and
                        lse, in float16 / bfloat16 also out32 (the output before its rounding,
                        float32, which the forward keeps for the backward: its own column), and
                        the gradients dq, dk, dv
  torch                 scaled_dot_product_attention on tensors that require grad, then
                        backward(dout): out and the three gradients

The figure that remains is the attention's own working memory: packed panels, per-thread
scratch, row statistics; a kernel that stored the (Lq, Lk) scores of even one head in float32
would need Lq Lk 4 bytes (256 MiB at N = 8192). The target, from the gradients issue: under
TARGET_MIB. Linux only (it reads /proc/self/status); `--shrink K` divides N by K.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any, Optional, Sequence

import numpy as np

MEMORY = "train-memory"  # its --cases name: opt in (about a minute), a full run leaves it out
LENGTH, Q_HEADS, KV_HEADS, HEAD_DIM = 8192, 32, 8, 128
TARGET_MIB = 64.0
BACKENDS = ("cpp", "rust", "torch")
DTYPES = ("float32", "float16", "bfloat16")
TEXT = (
    f"forward+backward, causal N={LENGTH} (Hq {Q_HEADS}, Hkv {KV_HEADS}, D {HEAD_DIM}): peak resident memory "
    "beyond inputs, outputs and gradients, each backend and dtype in a fresh process"
)
MIB = 2.0**20


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024


def _reset_peak() -> float:
    """Hands free memory back (malloc_trim, where glibc has it) and resets the peak resident size
    to the current one, which it returns (MiB)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: the peak may then miss what freed memory serves
        pass
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_mib("VmRSS:")


def measure(backend: str, dtype: str, length: int, threads: int) -> dict[str, Any]:
    """One forward and backward on `backend` in this process: the peak resident growth (MiB) and
    what of it the outputs, gradients and (twinattn, float16 / bfloat16) out32 take."""
    import ml_dtypes

    numpy_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, Q_HEADS, length, HEAD_DIM), np.float32).astype(numpy_dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, KV_HEADS, length, HEAD_DIM), np.float32).astype(numpy_dtype) for _ in range(2))
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        from .peers import _torch_has_gqa, to_torch

        torch.set_num_threads(threads)
        leaves = [to_torch(a).requires_grad_() for a in (q, k, v)]
        grad = to_torch(dout)
        gqa = _torch_has_gqa(F)  # without it, K and V repeated over the group inside the step
        base = _reset_peak()
        keys, values = leaves[1:] if gqa else (t.repeat_interleave(Q_HEADS // KV_HEADS, dim=1) for t in leaves[1:])
        out = F.scaled_dot_product_attention(leaves[0], keys, values, is_causal=True,
                                             **({"enable_gqa": True} if gqa else {}))
        out.backward(grad)
        peak = _status_mib("VmHWM:") - base
        counted = [out, *(leaf.grad for leaf in leaves)]
        outputs = sum(t.numel() * t.element_size() for t in counted) / MIB
        out32 = 0.0
    else:
        from ..core.backward import attention_backward, attention_for_training

        base = _reset_peak()
        forward = attention_for_training(q, k, v, causal=True, backend=backend, num_threads=threads)
        grads = attention_backward(q, k, v, forward.out32, dout, forward.lse, causal=True, backend=backend,
                                   num_threads=threads)
        peak = _status_mib("VmHWM:") - base
        halves = forward.out32 is not forward.out
        outputs = sum(a.nbytes for a in (forward.out, forward.lse, grads.dq, grads.dk, grads.dv)) / MIB
        out32 = forward.out32.nbytes / MIB if halves else 0.0
    return {"backend": backend, "dtype": dtype, "length": length, "threads": threads, "peak_mib": peak,
            "outputs_mib": outputs, "out32_mib": out32, "beyond_mib": peak - outputs - out32}


def _measure_in_child(backend: str, dtype: str, length: int, threads: int) -> dict[str, Any]:
    """measure() in a fresh interpreter (this module run as a script); {"error": ...} when it
    failed."""
    command = [sys.executable, "-m", "twinattn.bench.memory", backend, dtype, str(length), str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    row = {"backend": backend, "dtype": dtype, "length": length, "threads": threads}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {**row, "status": "error", "error": tail}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "status": "ok"}


def missing(backend: str) -> Optional[str]:
    """Why `backend` cannot be measured here (None: it can)."""
    import importlib.util

    if not sys.platform.startswith("linux"):
        return "needs Linux's /proc/self/status and clear_refs"
    if backend == "torch":
        return None if importlib.util.find_spec("torch") is not None else "torch is not installed"
    from ..core._backends import native_module

    try:
        native_module(backend)
    except ImportError as exc:
        return str(exc)
    return None


def run_case(backends: Sequence[str], dtypes: Sequence[str], threads: int, shrink: int, bar: Any = None) -> dict[str, Any]:
    """Every backend of `backends` among BACKENDS in every dtype of `dtypes` among DTYPES, each in
    its own process."""
    length = max(LENGTH // shrink, 1)
    rows = []
    for dtype in [d for d in dtypes if d in DTYPES]:
        for backend in [b for b in backends if b in BACKENDS]:
            why = missing(backend)
            if bar is not None:
                bar.show(f"{MEMORY}: {backend} {dtype} N={length}")
            if why is not None:
                rows.append({"backend": backend, "dtype": dtype, "length": length, "threads": threads,
                             "status": "skipped", "error": why})
            else:
                rows.append(_measure_in_child(backend, dtype, length, threads))
            if bar is not None:
                bar.step()
    return {"length": length, "target_mib": TARGET_MIB, "rows": rows}


def units(backends: Sequence[str], dtypes: Sequence[str]) -> int:
    """The progress bar's steps of run_case."""
    return sum(1 for d in dtypes if d in DTYPES for b in backends if b in BACKENDS)


def format_rows(entry: dict[str, Any]) -> str:
    """The table and, per twinattn backend and dtype, the target line."""
    lines = [f"{'backend':<7} {'dtype':<9} {'peak growth':>12} {'outputs+grads':>14} {'out32 kept':>11} "
             f"{'beyond them':>12}"]
    targets = []
    for row in entry["rows"]:
        if row["status"] != "ok":
            lines.append(f"{row['backend']:<7} {row['dtype']:<9} {row['status']}: {row['error']}")
            continue
        lines.append(
            f"{row['backend']:<7} {row['dtype']:<9} {row['peak_mib']:>8.1f} MiB {row['outputs_mib']:>10.1f} MiB "
            f"{row['out32_mib']:>7.1f} MiB {row['beyond_mib']:>8.1f} MiB"
        )
        if row["backend"] != "torch":
            verdict = "met" if row["beyond_mib"] < entry["target_mib"] else "missed"
            targets.append(f"{MEMORY} N={entry['length']} {row['dtype']:<9} {row['backend']:<5} beyond inputs, outputs "
                           f"and gradients {row['beyond_mib']:6.1f} MiB  (< {entry['target_mib']:g} MiB): {verdict}")
    return "\n".join(lines + ([""] + targets if targets else []))


if __name__ == "__main__":  # one measurement, for _measure_in_child: BACKEND DTYPE LENGTH THREADS
    name, kind, size, count = sys.argv[1:5]
    result = measure(name, kind, int(size), int(count))
    print(json.dumps({key: result[key] for key in ("peak_mib", "outputs_mib", "out32_mib", "beyond_mib")}))
