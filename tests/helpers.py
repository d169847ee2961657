"""Shared helpers: random problems, the float64 reference, and the float32 tolerance.

Tolerance. Each backend computes in float32 and is compared with the float64 reference. What
float32 arithmetic costs on a given problem is measured, not guessed: the same problem is run
through the NumPy reference in float32, and its error against float64 sets the scale (as the
flash-attention test suite does). A backend may be at most FLOAT32_ERROR_FACTOR times that error,
plus a floor of a few units of roundoff of the largest value (for problems where float32 happens
to be exact, e.g. one visible key).
"""

from __future__ import annotations

import contextlib
import importlib
import platform
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from conftest import _require
from twinattn.core.reference import round_to_dtype

UNIT_ROUNDOFF = 2.0**-24  # float32
FLOAT32_ERROR_FACTOR = 3.0
FLOOR_ULPS = 8.0

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALF_DTYPES = (FLOAT16, BFLOAT16)
# significant bits (the implicit one included) and the smallest normal exponent of each
_HALF_FORMAT = {FLOAT16: (11, -14), BFLOAT16: (8, -126)}
# the instruction sets a build for this machine's architecture may offer (TWINATTN_ISA's names);
# avx512bf16 is AVX-512F plus AVX512_BF16: VDPBF16PS in the bfloat16 prefill path; amxbf16 adds
# AMX-BF16: TDPBF16PS on tiles there
ISAS = (
    ("scalar", "neon")
    if platform.machine().lower() in ("aarch64", "arm64")
    else ("scalar", "avx2", "avx512", "avx512bf16", "amxbf16")
)
# the (instruction set, dtype) whose result is not the float32 kernel's on the converted inputs:
# bfloat16 prefill on avx512bf16 (VDPBF16PS) and amxbf16 (TDPBF16PS) multiplies bfloat16 pairs
# and rounds P to bfloat16
DOT_PATHS = (("avx512bf16", BFLOAT16), ("amxbf16", BFLOAT16))


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def as64(x: Any) -> Any:
    if isinstance(x, np.ndarray) and (x.dtype == np.float32 or x.dtype in HALF_DTYPES):
        return x.astype(np.float64)
    return x


def as32(x: Any) -> Any:
    """float16 / bfloat16 arrays widened (exactly) to float32; everything else as it is."""
    if isinstance(x, np.ndarray) and x.dtype in HALF_DTYPES:
        return x.astype(np.float32)
    return x


@contextlib.contextmanager
def forced_isa(port: str, isa: str) -> Iterator[None]:
    """Runs the block with port's instruction set forced to isa (set_isa), restoring it after;
    skips with the reason when this CPU or build lacks it. numpy ignores isa."""
    if port == "numpy":
        yield
        return
    module = importlib.import_module(f"twinattn._{port}")
    info = module.build_info()
    if isa not in info["isa_available"]:
        pytest.skip(f"{port}: {isa} not available on this CPU/build ({info['isa_available']})")
    previous = info["isa"]
    module.set_isa(isa)
    try:
        assert module.build_info()["isa"] == isa
        yield
    finally:
        module.set_isa(previous)


# numpy once, each native port once per instruction set; "-": numpy has none
BACKEND_ISA_PAIRS = [("numpy", "-")] + [(port, isa) for port in ("cpp", "rust") for isa in ISAS]
BACKEND_ISA_IDS = [port if isa == "-" else f"{port}-{isa}" for port, isa in BACKEND_ISA_PAIRS]


@pytest.fixture(params=BACKEND_ISA_PAIRS, ids=BACKEND_ISA_IDS)
def backend_isa(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(backend, isa): numpy once, each native port once per instruction set (forced with set_isa);
    a test module imports it to use it."""
    port, isa = request.param
    if port != "numpy":
        _require(port)
    with forced_isa(port, isa):
        yield port, isa


def half_ulp(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Half a unit in the last place of |x| in dtype (float16 / bfloat16), elementwise, in float64:
    the most that rounding a value of that magnitude to dtype can move it (subnormals included)."""
    bits, min_exponent = _HALF_FORMAT[np.dtype(dtype)]
    magnitude = np.abs(x.astype(np.float64))
    _, exponent = np.frexp(magnitude)  # |x| = m 2^e, 0.5 <= m < 1 (e = 0 for 0)
    exponent = np.where(magnitude == 0, min_exponent, np.maximum(exponent - 1, min_exponent))
    return np.ldexp(0.5, exponent - (bits - 1))


def assert_half_close_to_reference(
    got: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, isa: str = "-", **kwargs: Any
) -> None:
    """got (float16 or bfloat16, q's dtype) against the float64 reference on the same rounded inputs.

    Tolerance per element, from the arithmetic: the float32 kernel's error on the converted inputs
    (helpers' float32 tolerance: a multiple of the NumPy float32 reference's error, plus a floor),
    plus half an ulp of the value in q's dtype (out is rounded once, to nearest), plus on the
    bfloat16 dot and tile paths (avx512bf16, amxbf16) the rounding of each weight p_j to bfloat16 before P.V: each
    p_j moves by at most 2^-8 p_j (8 significant bits), so the output by at most
    2^-8 sum_j p_j |v_j| (the reference's attention over |v|)."""
    dtype = q.dtype
    want = np.asarray(reference64(q, k, v, **kwargs))
    f32 = np.asarray(reference32(*(as32(a) for a in (q, k, v)), **{n: as32(x) for n, x in kwargs.items()}))
    weighted = np.asarray(reference64(q, k, np.abs(as64(v)), **kwargs)) if (isa, dtype) in DOT_PATHS else None
    assert_half_within(got, want, f32, max_abs(as64(v)), dtype, weighted)


def max_abs(x: np.ndarray) -> float:
    """The largest finite |x| (0 when there is none)."""
    finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


def assert_half_within(
    got: np.ndarray, want: np.ndarray, f32: np.ndarray, v_max: float, dtype: np.dtype, weighted: np.ndarray | None = None
) -> None:
    """assert_half_close_to_reference on precomputed references: want (float64 on the rounded
    inputs), f32 (the NumPy float32 reference on them), v_max (the largest finite |v|) and, on the
    bfloat16 dot path, weighted = sum_j p_j |v_j| (else None)."""
    assert got.dtype == dtype and dtype in HALF_DTYPES, (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    got64 = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got64), np.isnan(want), err_msg="NaN pattern differs from the reference")
    # inf where the exact value rounds to inf in dtype (float16 overflows beyond 65504)
    np.testing.assert_array_equal(np.isinf(got64), np.isinf(round_to_dtype(want, dtype).astype(np.float64)),
                                  err_msg="inf pattern differs from the reference")
    both = np.isfinite(want) & np.isfinite(got64)
    f32_err = float(np.max(np.abs(f32[both] - want[both]), initial=0.0))
    tol = (FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, v_max)
           + half_ulp(np.maximum(np.abs(got64), np.abs(want)), dtype))
    if weighted is not None:
        tol = tol + 2.0**-8 * weighted
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf: not compared
        err = np.abs(got64 - want)
    bad = both & ~(err <= tol)
    assert not bad.any(), (
        f"{int(bad.sum())} elements beyond tolerance; worst error {float(err[bad].max()):.3g} "
        f"where the tolerance is {float(tol[bad][np.argmax(err[bad])]):.3g} (float32 reference error {f32_err:.3g})"
    )


def assert_lse_close_half(got_lse: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> None:
    """lse (float32) of a float16 / bfloat16 call: the float32 tolerance on the converted inputs
    (lse is computed in float32 from the exact values; only out is rounded to q's dtype)."""
    assert got_lse.dtype == np.float32
    assert_lse_close(got_lse, *(as32(a) for a in (q, k, v)), **{n: as32(x) for n, x in kwargs.items()})


def reference64(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> Any:
    """The float64 reference on the same problem (float masks are widened, nothing else changes)."""
    kwargs = {name: as64(value) for name, value in kwargs.items()}
    kwargs.pop("out", None)
    return twinattn.attention(as64(q), as64(k), as64(v), backend="numpy", **kwargs)


def reference32(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> Any:
    kwargs.pop("out", None)
    return twinattn.attention(q, k, v, backend="numpy", **kwargs)


def _finite_max_abs(x: np.ndarray) -> float:
    finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


def assert_close_to_reference(got: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> None:
    """got (the output of a float32 backend) against the float64 reference, with the tolerance above."""
    want = np.asarray(reference64(q, k, v, **kwargs))
    f32 = np.asarray(reference32(q, k, v, **kwargs))
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN pattern differs from the reference")
    both = np.isfinite(want)
    f32_err = float(np.max(np.abs(f32[both] - want[both]), initial=0.0))
    tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, _finite_max_abs(v))
    err = float(np.max(np.abs(got[both].astype(np.float64) - want[both]), initial=0.0))
    assert err <= tol, f"max abs error {err:.3g} > tolerance {tol:.3g} (float32 reference error {f32_err:.3g})"


def assert_lse_close(got_lse: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> None:
    _, want = reference64(q, k, v, return_lse=True, **kwargs)
    _, f32 = reference32(q, k, v, return_lse=True, **kwargs)
    assert_lse_within(got_lse, want, f32)


def assert_lse_within(got_lse: np.ndarray, want: np.ndarray, f32: np.ndarray) -> None:
    """assert_lse_close on precomputed references (float64 and the NumPy float32 reference)."""
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want), err_msg="-inf pattern of lse differs")
    finite = np.isfinite(want)
    f32_err = float(np.max(np.abs(f32[finite] - want[finite]), initial=0.0))
    scale_of = max(1.0, _finite_max_abs(want))
    tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * scale_of
    err = float(np.max(np.abs(got_lse[finite].astype(np.float64) - want[finite]), initial=0.0))
    assert err <= tol, f"lse max abs error {err:.3g} > tolerance {tol:.3g}"


def round_bits_rne(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 -> bfloat16 bits by the integer rule (to nearest, ties to even; NaN kept quiet), or
    float32 -> float16 through float64 (NumPy rounds float64 to float16 directly, once)."""
    if dtype == BFLOAT16:
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), (bits >> 16).astype(np.uint16) | 0x0040, rounded).astype(np.uint16)
    return x.astype(np.float64).astype(np.float16).view(np.uint16)
