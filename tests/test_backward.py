"""The backward pass at the core level (twinattn.core.backward): the float64 reference's gradient
against finite differences of the float64 reference forward, and every backend against it.

Shapes are small and asymmetric (B 2, Hq 4, Hkv 2, Lq 3, Lk 5, D 3, Dv 2), so that a transposed
axis, a wrong group or a wrong key cannot hide.

Tolerances. Finite differences: central, step 1e-6 on O(1) values, so their own error (step^2
times the third derivative, plus the float64 roundoff of the loss divided by the step) stays far
below 1e-6 of the largest gradient. The float32 backends: each gradient element is a sum of
O(Lq * Lk) products of O(1) terms, each term carrying a few float32 roundings, so the error is
bounded by a small multiple of Lq * Lk float32 units of roundoff of the largest term.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import twinattn
from grad_helpers import B, CASES, DV, HKV, HQ, LK, LQ, problem as _problem
from helpers import BFLOAT16
from twinattn.core.backward import attention_backward, attention_for_training

UNIT_ROUNDOFF = 2.0**-24  # float32
FD_STEP = 1e-6
FD_TOLERANCE = 1e-6
FLOAT32_TERMS_FACTOR = 8.0


def _loss_weights(seed: int, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dout and dlse of the loss sum(out * dout) + sum(lse * dlse) (dlse 0 where lse is -inf)."""
    rng = np.random.default_rng(seed + 100)
    dout = rng.standard_normal((B, HQ, LQ, DV))
    dlse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0)
    return dout, dlse


def _finite_differences(q: np.ndarray, k: np.ndarray, v: np.ndarray, kwargs: dict[str, Any], dout: np.ndarray, dlse: np.ndarray) -> list[np.ndarray]:
    def loss(q_: np.ndarray, k_: np.ndarray, v_: np.ndarray, sinks: Any) -> float:
        extra = {} if sinks is None else {"sinks": sinks}
        out, lse = twinattn.attention(q_, k_, v_, backend="numpy", return_lse=True, **{**kwargs, **extra})
        return float(np.sum(out * dout) + np.sum(np.where(dlse != 0, lse, 0) * dlse))

    inputs = [q, k, v] + ([kwargs["sinks"]] if "sinks" in kwargs else [])
    grads = []
    for which, x in enumerate(inputs):
        grad = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            values = []
            for step in (FD_STEP, -FD_STEP):
                moved = [a.copy() for a in inputs]
                moved[which][index] += step
                values.append(loss(moved[0], moved[1], moved[2], moved[3] if len(moved) > 3 else None))
            grad[index] = (values[0] - values[1]) / (2 * FD_STEP)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("with_dlse", [False, True], ids=["out", "out-and-lse"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_gradient_matches_finite_differences(case: str, with_dlse: bool) -> None:
    q, k, v, kwargs = _problem(case)
    out, lse = twinattn.attention(q, k, v, backend="numpy", return_lse=True, **kwargs)
    dout, dlse = _loss_weights(0, lse)
    if not with_dlse:
        dlse = np.zeros_like(dlse)
    got = attention_backward(q, k, v, out, dout, lse, dlse=dlse if with_dlse else None, backend="numpy", **kwargs)
    want = _finite_differences(q, k, v, kwargs, dout, dlse)
    names = ["dq", "dk", "dv", "dsinks"]
    for name, g, w in zip(names, [got.dq, got.dk, got.dv, got.dsinks], want):
        assert g is not None and g.shape == w.shape and g.dtype == np.float64, name
        scale_of = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max())
        assert err <= FD_TOLERANCE * scale_of, f"{name}: max error {err:.3g} against finite differences"
    assert (got.dsinks is None) == ("sinks" not in kwargs)


def test_reference_rows_without_keys_and_padding_get_zero_gradients() -> None:
    q, k, v, kwargs = _problem("empty-rows")
    out, lse = twinattn.attention(q, k, v, backend="numpy", return_lse=True, **kwargs)
    dout, _ = _loss_weights(0, lse)
    got = attention_backward(q, k, v, out, dout, lse, backend="numpy", **kwargs)
    assert np.all(got.dq[0] == 0)  # sequence 0 has no key
    assert np.all(got.dk[0] == 0) and np.all(got.dv[0] == 0)
    assert np.all(got.dk[1, :, 2:] == 0) and np.all(got.dv[1, :, 2:] == 0)  # padding of sequence 1
    assert np.any(got.dq[1] != 0)


def _float32_tolerance(want: np.ndarray, terms: float) -> float:
    return FLOAT32_TERMS_FACTOR * terms * UNIT_ROUNDOFF * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("case", list(CASES))
def test_backends_match_the_reference_gradient(backend: str, case: str) -> None:
    q, k, v, kwargs = _problem(case, seed=1, dtype=np.float32)
    out, lse = twinattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    dout = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
    got = attention_backward(q, k, v, out, dout, lse, backend=backend, **kwargs)
    kwargs64 = {n: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for n, a in kwargs.items()}
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    out64, lse64 = twinattn.attention(q64, k64, v64, backend="numpy", return_lse=True, **kwargs64)
    want = attention_backward(q64, k64, v64, out64, dout.astype(np.float64), lse64, backend="numpy", **kwargs64)
    for name in ("dq", "dk", "dv", "dsinks"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == np.float32 and g.shape == w.shape, name
        err = float(np.abs(g.astype(np.float64) - w).max())
        tol = _float32_tolerance(w, LQ * LK)
        assert err <= tol, f"{backend} {name}: max error {err:.3g} > {tol:.3g}"


def test_backward_lse_gradient_on_every_backend(backend: str) -> None:
    """The gradient through lse (the native ports take it as one more value column)."""
    q, k, v, kwargs = _problem("everything", seed=2, dtype=np.float32)
    out, lse = twinattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    rng = np.random.default_rng(3)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dlse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0).astype(np.float32)
    got = attention_backward(q, k, v, out, dout, lse, dlse=dlse, backend=backend, **kwargs)
    kwargs64 = {n: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for n, a in kwargs.items()}
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    out64, lse64 = twinattn.attention(q64, k64, v64, backend="numpy", return_lse=True, **kwargs64)
    want = attention_backward(q64, k64, v64, out64, dout.astype(np.float64), lse64, dlse=dlse.astype(np.float64),
                              backend="numpy", **kwargs64)
    assert got.dv.shape == (B, HKV, LK, DV)
    for name in ("dq", "dk", "dv", "dsinks"):
        g, w = getattr(got, name), getattr(want, name)
        err = float(np.abs(g.astype(np.float64) - w).max())
        assert err <= _float32_tolerance(w, LQ * LK), f"{backend} {name}: max error {err:.3g}"


def test_backward_of_3d_inputs_keeps_their_rank(backend: str) -> None:
    q, k, v, _ = _problem("plain", dtype=np.float32)
    q3, k3, v3 = q[0], k[0], v[0]
    out, lse = twinattn.attention(q3, k3, v3, backend=backend, return_lse=True)
    got = attention_backward(q3, k3, v3, out, np.ones_like(out), lse, backend=backend)
    assert got.dq.shape == q3.shape and got.dk.shape == k3.shape and got.dv.shape == v3.shape


def test_backward_refuses_int8_keys(backend: str) -> None:
    q, k, v, _ = _problem("plain", dtype=np.float32)
    (k8, k_scale), (v8, v_scale) = twinattn.quantize_kv(k), twinattn.quantize_kv(v)
    out, lse = twinattn.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, backend=backend, return_lse=True)
    with pytest.raises(ValueError, match="int8 keys and values carry no gradient"):
        attention_backward(q, k8, v8, out, out, lse, k_scale=k_scale, v_scale=v_scale, backend=backend)


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_attention_for_training_returns_out_lse_and_out32(backend: str, dtype: Any) -> None:
    """out and lse as twinattn.attention's (the same bits); out32: out itself for float32, else
    float32 (out widened on NumPy's reference, the output before its rounding on the native ports,
    within out's rounding and P's); attention_backward takes it as out."""
    q, k, v, kwargs = _problem("everything", seed=4, dtype=np.float32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    out, lse, out32 = attention_for_training(q, k, v, backend=backend, **kwargs)
    want_out, want_lse = twinattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    assert np.array_equal(out.view(np.uint8), want_out.view(np.uint8)) and np.array_equal(lse, want_lse)
    if dtype == np.float32:
        assert out32 is out
    else:
        assert out32.dtype == np.float32
        apart = np.abs(out32.astype(np.float64) - out.astype(np.float64))
        assert (apart <= 2.0**-9 * np.abs(out.astype(np.float64)) + 2.0**-9 * np.abs(v.astype(np.float64)).max()).all()
    dout = np.ones_like(out)
    grads = attention_backward(q, k, v, out32, dout, lse, backend=backend, **kwargs)
    assert grads.dq.dtype == dtype and grads.dq.shape == q.shape


def test_backward_names_out32_in_a_half_out_dtype_error(backend: str) -> None:
    q, k, v, _ = _problem("plain", dtype=np.float32)
    q, k, v = q.astype(BFLOAT16), k.astype(BFLOAT16), v.astype(BFLOAT16)
    out, lse = twinattn.attention(q, k, v, backend=backend, return_lse=True)
    with pytest.raises(TypeError, match=r"out: expected dtype bfloat16 or float32 \(the forward's out32\), got float16"):
        attention_backward(q, k, v, out.astype(np.float16), out, lse, backend=backend)


@pytest.mark.parametrize(
    ("name", "change", "error", "message"),
    [
        ("dout", lambda a: a[..., :1], ValueError, r"dout: expected shape \(2, 4, 3, 2\)"),
        ("dout", lambda a: a.astype(np.float64), TypeError, "dout: expected dtype float32"),
        ("lse", lambda a: a[:, :, :2], ValueError, r"lse: expected shape \(2, 4, 3\)"),
        ("out", lambda a: a.tolist(), TypeError, "out: expected a numpy array"),
    ],
)
def test_backward_checks_out_dout_and_lse(name: str, change: Callable[[Any], Any], error: type, message: str) -> None:
    q, k, v, _ = _problem("plain", dtype=np.float32)
    out, lse = twinattn.attention(q, k, v, backend="numpy", return_lse=True)
    arrays = {"out": out, "dout": np.ones_like(out), "lse": lse}
    arrays[name] = change(arrays[name])
    with pytest.raises(error, match=message):
        attention_backward(q, k, v, arrays["out"], arrays["dout"], arrays["lse"], backend="numpy")
