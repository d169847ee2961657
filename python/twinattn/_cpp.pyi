"""Type stubs for twinattn._cpp, the C++ (pybind11) port (private: use the twinattn package).

Hand-written from docs/native_api.md; `python -m mypy.stubtest twinattn._cpp twinattn._rust`
(run by scripts/test.sh) checks them against the built module. Both native modules expose the
same nine functions with the same signatures, and raise the same exception types (docs/native_api.md
lists them; tests/test_port_parity.py compares the two), so
_cpp.pyi and _rust.pyi differ only in this docstring and __all__; their argument types are
written once, in _native_types.pyi. The functions stay written in both files: stubtest checks
only what a stub defines itself, so signatures imported from the other stub would go unchecked
(the Rust ones, which PyO3 exposes and pybind11 does not, included).
"""

from typing import Any

import numpy as np
from numpy.typing import NDArray

from twinattn._native_types import F32, I32, KV, Data, I64, Mask

def attention_forward(
    q: Data,
    k: KV,
    v: KV,
    out: Data,
    *,
    scale: float,
    lse: F32 | None = None,
    q_offset: I64 | None = None,
    kv_lens: I64 | None = None,
    mask: Mask | None = None,
    causal: bool | None = None,
    num_threads: int | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: F32 | None = None,
    sinks: F32 | None = None,
    k_scale: F32 | None = None,
    v_scale: F32 | None = None,
    out32: F32 | None = None,
) -> None:
    """Exact attention into out (and lse) with the fast kernel and the ISA in use (set_isa).

    None (or leaving a keyword out) means its default: no lse, q_offset 0 and kv_lens Lk for
    every sequence, no mask, causal False, one thread, no window (-1, -1), softcap 0, no ALiBi,
    no sinks, no int8 scales, no out32 (float16 / bfloat16 only: the output in float32, before its rounding)."""

def attention_backward(
    q: Data,
    k: Data,
    v: Data,
    out: Data,
    dout: Data,
    lse: F32 | None,
    dq: Data,
    dk: Data,
    dv: Data,
    *,
    scale: float,
    q_offset: I64 | None = None,
    kv_lens: I64 | None = None,
    mask: Mask | None = None,
    causal: bool | None = None,
    num_threads: int | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: F32 | None = None,
    sinks: F32 | None = None,
    dsinks: F32 | None = None,
    dlse: F32 | None = None,
) -> None:
    """The gradients of attention_forward with respect to q, k, v (and sinks) from dout and the
    forward's out (q's dtype, or for float16 / bfloat16 its float32 out32) and lse (required),
    written into dq, dk, dv (q's dtype) and dsinks (float32); dlse (B, Hq, Lq), lse's gradient.

    The keywords are the forward's, with the same defaults; dsinks only together with sinks."""

# as attention_forward, computed by the plain scalar reference kernel (for tests); an alias, which
# stubtest checks against the module's attention_reference like a function
attention_reference = attention_forward

def attention_varlen(
    q: Data,
    k: KV,
    v: KV,
    out: Data,
    cu_seqlens_q: I64,
    cu_seqlens_k: I64,
    *,
    scale: float,
    lse: F32 | None = None,
    causal: bool | None = None,
    num_threads: int | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: F32 | None = None,
    sinks: F32 | None = None,
    k_scale: F32 | None = None,
    v_scale: F32 | None = None,
) -> None:
    """Attention over sequences packed one after another (flash-attn's varlen layout): q
    (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), out (total_q, Hq, Dv), lse
    (Hq, total_q); cu_seqlens_q / cu_seqlens_k int64 (B + 1,); causal bottom-right per sequence;
    alibi_slopes (B, Hq); k_scale / v_scale (total_k, Hkv) with int8 k and v."""

def attention_paged(
    q: Data,
    k_cache: KV,
    v_cache: KV,
    out: Data,
    block_table: I32,
    seq_lens: I64,
    cu_seqlens_q: I64,
    *,
    scale: float,
    lse: F32 | None = None,
    causal: bool | None = None,
    num_threads: int | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: F32 | None = None,
    sinks: F32 | None = None,
    k_scale: F32 | None = None,
    v_scale: F32 | None = None,
) -> None:
    """Attention of packed query rows over keys in pages: k_cache (num_blocks, block_size, Hkv,
    D), v_cache (.., Hkv, Dv), key j of sequence b at cache[block_table[b, j // block_size],
    j % block_size]; block_table int32 (B, max_blocks), seq_lens int64 (B,), cu_seqlens_q int64
    (B + 1,), each sequence's rows its last positions; k_scale / v_scale (num_blocks,
    block_size, Hkv) with int8 caches."""

def softcap_tanh(x: F32) -> NDArray[np.float32]:
    """tanh of a float32 vector with the fast kernel's vectorised tanh (softcap), for tests."""

def set_isa(name: str) -> None:
    """Switches the instruction set among build_info()["isa_available"]; ValueError otherwise."""

def measure_peak(kind: str, num_threads: int, seconds: float) -> float:
    """GFLOP/s of a register-resident loop of "fma32" (FMA), "bf16dot" (VDPBF16PS) or "bf16tile"
    (AMX TDPBF16PS) operations on num_threads threads."""

def build_info() -> dict[str, Any]:
    """{"isa": str, "isa_available": list[str], "compiler": str, "version": str,
    "isa_default": str, "bfloat16_path": "amx" | "dot" | "convert", "bf16dot_over_fma32": float | None,
    "constants": dict[str, int | float | list[float]]}."""
