"""Type stubs for twinattn._rust, the Rust (PyO3) port (private: use the twinattn package).

Hand-written from docs/native_api.md; `python -m mypy.stubtest twinattn._cpp twinattn._rust`
(run by scripts/test.sh) checks them against the built module. Both native modules expose the
same five functions with the same signatures, and raise the same exceptions with the same
messages (docs/native_api.md lists them; tests/test_port_parity.py compares the two), so
_cpp.pyi and _rust.pyi differ only in this docstring and __all__.
"""

from typing import Any

from typing_extensions import TypeAlias

import numpy as np
from numpy.typing import NDArray

# PyO3 lists the module's functions in __all__ (pybind11 does not, so _cpp.pyi has none)
__all__ = [
    "attention_forward",
    "attention_reference",
    "build_info",
    "measure_peak",
    "set_isa",
    "softcap_tanh",
]

# float32 (B, Hq, Lq) lse, (B, Hq) ALiBi slopes, (Hq,) sinks; int64 (B,) for q_offset and kv_lens
_F32: TypeAlias = NDArray[np.float32]
# q, k, v, out (B, H, L, D): all float32, all float16, or all ml_dtypes.bfloat16 (a NumPy user
# dtype that NumPy's typing cannot name, hence Any)
_Data: TypeAlias = NDArray[np.float32] | NDArray[np.float16] | NDArray[Any]
_I64: TypeAlias = NDArray[np.int64]
# k and v: q's dtype, or both int8 with their float32 (B, Hkv, Lk) scales k_scale / v_scale
_KV: TypeAlias = _Data | NDArray[np.int8]
# float32 (B, Hq) ALiBi slopes (any strides: a (Hq,) vector as a stride-0 view) and (Hq,) sinks
# bool (True = may attend) or float32 additive bias, shape exactly (B, Hq, Lq, Lk)
_Mask: TypeAlias = NDArray[np.bool_] | NDArray[np.float32]

def attention_forward(
    q: _Data,
    k: _KV,
    v: _KV,
    out: _Data,
    lse: _F32 | None,
    q_offset: _I64,
    kv_lens: _I64,
    mask: _Mask | None,
    causal: bool,
    scale: float,
    num_threads: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: _F32 | None,
    sinks: _F32 | None,
    k_scale: _F32 | None = None,
    v_scale: _F32 | None = None,
) -> None:
    """Exact attention into out (and lse) with the fast kernel and the ISA in use (set_isa)."""

def attention_reference(
    q: _Data,
    k: _KV,
    v: _KV,
    out: _Data,
    lse: _F32 | None,
    q_offset: _I64,
    kv_lens: _I64,
    mask: _Mask | None,
    causal: bool,
    scale: float,
    num_threads: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: _F32 | None,
    sinks: _F32 | None,
    k_scale: _F32 | None = None,
    v_scale: _F32 | None = None,
) -> None:
    """As attention_forward, computed by the plain scalar reference kernel (for tests)."""

def softcap_tanh(x: _F32) -> _F32:
    """tanh of a float32 vector with the fast kernel's vectorised tanh (softcap), for tests."""

def measure_peak(kind: str, num_threads: int, seconds: float) -> float:
    """GFLOP/s of a register-resident loop of "fma32" (FMA) or "bf16dot" (VDPBF16PS) operations."""

def set_isa(name: str) -> None:
    """Switches the instruction set among build_info()["isa_available"]; ValueError otherwise."""

def build_info() -> dict[str, Any]:
    """{"isa": str, "isa_available": list[str], "compiler": str, "version": str,
    "constants": dict[str, int | float | list[float]]}."""
