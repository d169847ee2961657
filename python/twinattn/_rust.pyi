"""Type stubs for twinattn._rust, the Rust (PyO3) port (private: use the twinattn package).

Hand-written from docs/native_api.md; `python -m mypy.stubtest twinattn._cpp twinattn._rust`
(run by scripts/test.sh) checks them against the built module. Both native modules expose the
same six functions with the same signatures, and raise the same exceptions with the same
messages (docs/native_api.md lists them; tests/test_port_parity.py compares the two), so
_cpp.pyi and _rust.pyi differ only in this docstring and __all__; their argument types are
written once, in _native_types.pyi. The functions stay written in both files: stubtest checks
only what a stub defines itself, so signatures imported from the other stub would go unchecked
(the Rust ones, which PyO3 exposes and pybind11 does not, included).
"""

from typing import Any

from twinattn._native_types import F32, KV, Data, I64, Mask

# PyO3 lists the module's functions in __all__ (pybind11 does not, so _cpp.pyi has none)
__all__ = [
    "attention_forward",
    "attention_reference",
    "build_info",
    "measure_peak",
    "set_isa",
    "softcap_tanh",
]

def attention_forward(
    q: Data,
    k: KV,
    v: KV,
    out: Data,
    lse: F32 | None,
    q_offset: I64,
    kv_lens: I64,
    mask: Mask | None,
    causal: bool,
    scale: float,
    num_threads: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: F32 | None,
    sinks: F32 | None,
    k_scale: F32 | None = None,
    v_scale: F32 | None = None,
) -> None:
    """Exact attention into out (and lse) with the fast kernel and the ISA in use (set_isa)."""

# as attention_forward, computed by the plain scalar reference kernel (for tests); an alias, which
# stubtest checks against the module's attention_reference like a function
attention_reference = attention_forward

def softcap_tanh(x: F32) -> F32:
    """tanh of a float32 vector with the fast kernel's vectorised tanh (softcap), for tests."""

def set_isa(name: str) -> None:
    """Switches the instruction set among build_info()["isa_available"]; ValueError otherwise."""

def measure_peak(kind: str, num_threads: int, seconds: float) -> float:
    """GFLOP/s of a register-resident loop of "fma32" (FMA) or "bf16dot" (VDPBF16PS) operations
    on num_threads threads."""

def build_info() -> dict[str, Any]:
    """{"isa": str, "isa_available": list[str], "compiler": str, "version": str,
    "constants": dict[str, int | float | list[float]]}."""
