"""Shared helpers: random problems, the float64 reference, and the float32 tolerance.

Tolerance. Each backend computes in float32 and is compared with the float64 reference. What
float32 arithmetic costs on a given problem is measured, not guessed: the same problem is run
through the NumPy reference in float32, and its error against float64 sets the scale (as the
flash-attention test suite does). A backend may be at most FLOAT32_ERROR_FACTOR times that error,
plus a floor of a few units of roundoff of the largest value (for problems where float32 happens
to be exact, e.g. one visible key).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import twinattn

UNIT_ROUNDOFF = 2.0**-24  # float32
FLOAT32_ERROR_FACTOR = 3.0
FLOOR_ULPS = 8.0


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def as64(x: Any) -> Any:
    if isinstance(x, np.ndarray) and x.dtype == np.float32:
        return x.astype(np.float64)
    return x


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
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want), err_msg="-inf pattern of lse differs")
    finite = np.isfinite(want)
    f32_err = float(np.max(np.abs(f32[finite] - want[finite]), initial=0.0))
    scale_of = max(1.0, _finite_max_abs(want))
    tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * scale_of
    err = float(np.max(np.abs(got_lse[finite].astype(np.float64) - want[finite]), initial=0.0))
    assert err <= tol, f"lse max abs error {err:.3g} > tolerance {tol:.3g}"
