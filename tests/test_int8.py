"""int8 keys and values (issue 15): quantize_kv / dequantize_kv bit for bit, and attention over
int8 K/V with their float32 scales on every backend, instruction set and feature.

What is asserted:
- quantize_kv follows its float32 rule exactly (an independent bit-level computation in float64
  with explicit round-half-to-even, ties, zero rows, non-finite rows, float16 / bfloat16 inputs);
  dequantize_kv is float32(x) * scale; bad inputs raise naming the argument;
- attention(q, k_int8, v_int8, k_scale=, v_scale=) is within float32 tolerance of the float64
  reference on dequantize_kv(k), dequantize_kv(v) (plus out's rounding for a float16 / bfloat16
  q), for masks, q_offset, kv_lens, GQA, strides (stride-0 scales included), lse, out=, window,
  softcap, ALiBi, sinks, decode and prefill, on numpy and each native port per instruction set;
- a NaN scale at a hidden position never matters (same bits as a finite one); at a visible key
  it gives NaN (k_scale: the whole row; v_scale: the row's output);
- missing, superfluous or malformed scales raise the same messages on every backend.
The ports' bits and native messages: tests/test_port_parity.py.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from helpers import BFLOAT16, FLOAT16, assert_close_to_reference, assert_half_close_to_reference, assert_lse_close, rand
from helpers import backend_isa  # noqa: F401  (the fixture: numpy, and each port per instruction set)

# ---- quantize_kv / dequantize_kv ------------------------------------------------------------------


def _quantize_by_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule computed independently: each float32 operation as the float64 one rounded to
    float32 (exact for one division of float32 operands: 53 >= 2 * 24 + 2 bits), the rounding to
    an integer by floor and an explicit tie rule."""
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(x64).max(axis=-1)
        scale = (amax / 127.0).astype(np.float32)
        ratio = (x64 / scale.astype(np.float64)[..., None]).astype(np.float32).astype(np.float64)
        low = np.floor(ratio)
        frac = ratio - low
        odd = np.mod(low, 2) == 1
        nearest = low + ((frac > 0.5) | ((frac == 0.5) & odd))
        nearest = np.minimum(np.maximum(nearest, -127), 127)
    return np.where(np.isnan(nearest), 0, nearest).astype(np.int8), scale


def test_quantize_small_rows_by_hand() -> None:
    x = np.array([[127, 0.5, 1.5, 2.5, -0.5, -2.5, -126.5, 3.25],  # scale 1: ties go to even
                  [0, 0, 0, 0, 0, 0, 0, 0],                         # a zero row: scale 0, zeros
                  [-254, 127, 1, -1, 3, 0, 253, 0.9999]], np.float32)
    payload, scale = twinattn.quantize_kv(x)
    assert payload.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3,)
    np.testing.assert_array_equal(scale, np.float32([1, 0, 2]))
    np.testing.assert_array_equal(payload, [[127, 0, 2, 2, 0, -2, -126, 3], [0] * 8, [-127, 64, 0, 0, 2, 0, 126, 0]])


@pytest.mark.parametrize("dtype", [np.float32, FLOAT16, BFLOAT16], ids=["float32", "float16", "bfloat16"])
def test_quantize_matches_the_bit_level_rule(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    spread = 6 if dtype == FLOAT16 else 20  # float16 stays finite below 65504
    x = (rng.standard_normal((3, 2, 33, 24)) * np.exp(rng.uniform(-spread, spread, (3, 2, 33, 1)))).astype(np.float32)
    x[0, 0, 3] = 0.0  # a zero row
    x[1, 1, 5] = np.arange(24) - 11.5  # ties: amax 12, x / scale lands on halves after rounding
    x[2, 0, 7, :] = 1e-44  # subnormal rows: amax / 127 underflows
    x[2, 0, 8, :3] = [np.float32(2.0**-140), -np.float32(2.0**-141), np.float32(3 * 2.0**-149)]
    x = x.astype(dtype)
    payload, scale = twinattn.quantize_kv(x)
    want_payload, want_scale = _quantize_by_bits(x.astype(np.float32))
    np.testing.assert_array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(payload, want_payload)
    assert payload.shape == x.shape and scale.shape == x.shape[:-1]
    # every value comes back within half a step of its row (max |x| / 127) where the scale is normal,
    # plus the float32 roundings of x / scale and of the product
    back = twinattn.dequantize_kv(payload, scale).astype(np.float64)
    normal = scale >= np.finfo(np.float32).tiny
    step = scale.astype(np.float64)[..., None]
    err = np.abs(back - x.astype(np.float64))
    assert (err <= 0.5 * step + 2.0**-22 * np.abs(x.astype(np.float64)))[normal].all()


def test_quantize_non_finite_rows_follow_the_arithmetic() -> None:
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 1.0, -3.0], [-np.inf, np.inf, 0.0]], np.float32)
    payload, scale = twinattn.quantize_kv(x)
    assert np.isnan(scale[0]) and scale[1] == np.inf and scale[2] == np.inf
    # NaN / inf cannot be stored: NaN ratios (x / NaN, inf / inf) store 0, x / inf = 0
    np.testing.assert_array_equal(payload, np.zeros((3, 3), np.int8))
    assert np.isnan(twinattn.dequantize_kv(payload, scale)[0]).all()


def test_dequantize_is_float32_times_scale() -> None:
    rng = np.random.default_rng(1)
    payload = rng.integers(-127, 128, (2, 3, 5, 7)).astype(np.int8)
    scale = rng.uniform(0, 3, (2, 3, 5)).astype(np.float32)
    got = twinattn.dequantize_kv(payload, scale)
    assert got.dtype == np.float32
    want = (payload.astype(np.float64) * scale.astype(np.float64)[..., None]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("call, exc, message", [
    (lambda: twinattn.quantize_kv([[1.0]]), TypeError, "x: expected a numpy array (..., T, D) of float32, float16 or bfloat16 (ml_dtypes.bfloat16), got list"),
    (lambda: twinattn.quantize_kv(np.ones((2, 3))), TypeError, "x: expected dtype float32, float16 or bfloat16 (ml_dtypes.bfloat16), got float64"),
    (lambda: twinattn.quantize_kv(np.array(1.0, np.float32)), ValueError, "x: expected at least 1 dimension (..., D), got shape ()"),
    (lambda: twinattn.dequantize_kv(np.ones((2, 3), np.int16), np.ones(2, np.float32)), TypeError, "x_int8: expected an int8 numpy array (..., T, D), got int16"),
    (lambda: twinattn.dequantize_kv(np.ones((2, 3), np.int8), np.ones(2)), TypeError, "scale: expected a float32 numpy array (..., T), got float64"),
    (lambda: twinattn.dequantize_kv(np.ones((2, 3), np.int8), np.ones(3, np.float32)), ValueError, "scale: expected shape (2,) (x_int8's without its last axis), got (3,)"),
], ids=["x-list", "x-float64", "x-0d", "x_int8-int16", "scale-float64", "scale-shape"])
def test_quantize_and_dequantize_reject_bad_inputs(call: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc) as info:
        call()
    assert str(info.value) == message


# ---- attention over int8 K/V ------------------------------------------------------------------------

B, HQ, HKV, D, DV = 2, 4, 2, 16, 12


def _problem(rng: np.random.Generator, lq: int, lk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q, then k and v quantized (payload, scale) from rows of different magnitudes."""
    q = rand(rng, B, HQ, lq, D)
    k = rand(rng, B, HKV, lk, D) * np.exp(rng.uniform(-1, 1, (B, HKV, lk, 1))).astype(np.float32)
    v = rand(rng, B, HKV, lk, DV) * np.exp(rng.uniform(-1, 1, (B, HKV, lk, 1))).astype(np.float32)
    (k8, ks), (v8, vs) = twinattn.quantize_kv(k), twinattn.quantize_kv(v)
    return q, k8, ks, v8, vs


def _features(rng: np.random.Generator, lq: int, lk: int) -> dict[str, dict[str, Any]]:
    mask = rng.random((B, 1, lq, lk)) < 0.7
    mask[..., 0] = True
    bias = np.where(rng.random((1, HQ, lq, lk)) < 0.2, -np.inf, rng.standard_normal((1, HQ, lq, lk))).astype(np.float32)
    bias[..., 0] = 0.0
    return {
        "plain": {},
        "causal-q_offset": {"causal": True, "q_offset": np.array([lk - lq, max(lk - lq - 3, 0)])},
        "kv_lens": {"causal": True, "kv_lens": np.array([lk, lk - 5])},
        "bool-mask": {"attn_mask": mask},
        "float-mask": {"attn_mask": bias},
        "window": {"causal": True, "window_size": (6, 0)},
        "softcap": {"softcap": 5.0, "scale": 1.0},
        "alibi": {"causal": True, "alibi_slopes": rng.uniform(0.01, 0.5, HQ).astype(np.float32)},
        "sinks": {"sinks": rng.standard_normal(HQ).astype(np.float32)},
    }


_SHAPES = {"decode": (1, 300), "prefill": (20, 45)}
_FEATURES = ["plain", "causal-q_offset", "kv_lens", "bool-mask", "float-mask", "window", "softcap", "alibi", "sinks"]


def _check(got: Any, q: np.ndarray, kd: np.ndarray, vd: np.ndarray, isa: str, kwargs: dict[str, Any]) -> None:
    """got (out, lse) against the float64 reference on the dequantized K/V."""
    out, lse = got
    assert out.dtype == q.dtype and lse.dtype == np.float32
    if q.dtype == np.float32:
        assert_close_to_reference(out, q, kd, vd, **kwargs)
    else:
        assert_half_close_to_reference(out, q, kd, vd, isa=isa, **kwargs)
    assert_lse_close(lse, q.astype(np.float32), kd, vd, **kwargs)


@pytest.mark.parametrize("shape", list(_SHAPES), ids=str)
@pytest.mark.parametrize("feature", _FEATURES)
def test_int8_attention_against_the_dequantized_reference(backend_isa: tuple[str, str], shape: str, feature: str) -> None:
    port, isa = backend_isa
    rng = np.random.default_rng(sum(map(ord, feature + shape)))
    lq, lk = _SHAPES[shape]
    q, k8, ks, v8, vs = _problem(rng, lq, lk)
    kwargs = _features(rng, lq, lk)[feature]
    got = twinattn.attention(q, k8, v8, k_scale=ks, v_scale=vs, backend=port, return_lse=True, num_threads=2, **kwargs)
    _check(got, q, twinattn.dequantize_kv(k8, ks), twinattn.dequantize_kv(v8, vs), isa, kwargs)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(_SHAPES), ids=str)
def test_int8_attention_with_a_half_query(backend_isa: tuple[str, str], shape: str, dtype: np.dtype) -> None:
    port, isa = backend_isa
    rng = np.random.default_rng(5)
    lq, lk = _SHAPES[shape]
    q, k8, ks, v8, vs = _problem(rng, lq, lk)
    q = q.astype(dtype)
    kwargs = {"causal": True}
    got = twinattn.attention(q, k8, v8, k_scale=ks, v_scale=vs, backend=port, return_lse=True, **kwargs)
    _check(got, q, twinattn.dequantize_kv(k8, ks), twinattn.dequantize_kv(v8, vs), isa, kwargs)


def test_int8_attention_strides_out_and_ranks(backend_isa: tuple[str, str]) -> None:
    """Views read in place: k and v slices of a longer cache, a transposed q, stride-0 scales (one
    per head, broadcast over tokens), a strided out=; 3-D and 2-D calls give the 4-D result."""
    port, isa = backend_isa
    rng = np.random.default_rng(9)
    q = rand(rng, B, 20, HQ, D).swapaxes(1, 2)  # (B, HQ, 20, D), strided
    k8 = rng.integers(-127, 128, (B, HKV, 60, D)).astype(np.int8)[:, :, 5:50]
    v8 = rng.integers(-127, 128, (B, HKV, 60, DV)).astype(np.int8)[:, :, 5:50]
    ks = np.broadcast_to(rng.uniform(0.001, 0.03, (B, HKV, 1)).astype(np.float32), (B, HKV, 45))
    vs = rng.uniform(0.001, 0.03, (B, HKV, 90)).astype(np.float32)[:, :, ::2]
    assert ks.strides[-1] == 0 and not vs.flags.c_contiguous
    out = np.zeros((B, HQ, 20, 2 * DV), np.float32)[..., ::2]
    got = twinattn.attention(q, k8, v8, k_scale=ks, v_scale=vs, causal=True, out=out, backend=port)
    assert got is out
    kd = twinattn.dequantize_kv(np.ascontiguousarray(k8), np.ascontiguousarray(ks))
    vd = twinattn.dequantize_kv(np.ascontiguousarray(v8), np.ascontiguousarray(vs))
    assert_close_to_reference(out, q, kd, vd, causal=True)
    three = twinattn.attention(q[0], k8[0], v8[0], k_scale=ks[0], v_scale=vs[0], causal=True, backend=port)
    np.testing.assert_array_equal(three, out[0])
    two = twinattn.attention(q[0, 0], k8[0, 0], v8[0, 0], k_scale=ks[0, 0], v_scale=vs[0, 0], causal=True, backend=port)
    np.testing.assert_array_equal(two, twinattn.attention(q[:1, :1], k8[:1, :1], v8[:1, :1], k_scale=ks[:1, :1],
                                                          v_scale=vs[:1, :1], causal=True, backend=port)[0, 0])


@pytest.mark.parametrize("shape", list(_SHAPES), ids=str)
def test_nan_scale_hidden_never_matters_visible_gives_nan(backend_isa: tuple[str, str], shape: str) -> None:
    port, _ = backend_isa
    rng = np.random.default_rng(3)
    lq, lk = _SHAPES[shape]
    q, k8, ks, v8, vs = _problem(rng, lq, lk)
    kv_lens = np.array([lk - 4, lk])
    mask = np.ones((B, HQ, lq, lk), bool)
    mask[:, :, :, 7] = False  # key 7 hidden by the mask
    kwargs: dict[str, Any] = {"causal": True, "q_offset": np.array([lk - 4 - lq - 2, lk - lq - 2]), "kv_lens": kv_lens,
                              "attn_mask": mask, "backend": port, "return_lse": True}
    clean = twinattn.attention(q, k8, v8, k_scale=ks, v_scale=vs, **kwargs)
    assert np.isfinite(clean[0]).all()
    ks_nan, vs_nan = ks.copy(), vs.copy()
    # hidden: padding past kv_lens[0], the future of every query of sequence 1, masked key 7
    for scales in (ks_nan, vs_nan):
        scales[0, :, lk - 4 :] = np.nan
        scales[1, :, lk - 1] = np.nan
        scales[:, :, 7] = np.nan
    hidden = twinattn.attention(q, k8, v8, k_scale=ks_nan, v_scale=vs_nan, **kwargs)
    np.testing.assert_array_equal(hidden[0], clean[0])
    np.testing.assert_array_equal(hidden[1], clean[1])
    # visible key 3 of sequence 0, KV head 1 (query heads 2 and 3)
    for name in ("k_scale", "v_scale"):
        scales = {"k_scale": ks.copy(), "v_scale": vs.copy()}
        scales[name][0, 1, 3] = np.nan
        out, lse = twinattn.attention(q, k8, v8, **scales, **kwargs)
        assert np.isnan(out[0, 2:]).all() and np.isfinite(out[0, :2]).all() and np.isfinite(out[1]).all()
        assert np.isnan(lse[0, 2:]).all() == (name == "k_scale")
        np.testing.assert_array_equal(out[1], clean[0][1])


_QI = np.ones((1, 2, 3, 4), np.float32)
_K8 = np.ones((1, 1, 5, 4), np.int8)
_S = np.ones((1, 1, 5), np.float32)


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"k": _K8, "v": _K8.astype(np.float32)}, TypeError, "v: expected dtype int8 (k's dtype), got float32; quantize it with twinattn.quantize_kv(v)"),
    ({"k": _K8.astype(np.float32), "v": _K8}, TypeError, "v: expected dtype float32 (q's dtype), got int8; convert with v.astype(np.float32)"),
    ({"k": _K8.astype(np.uint8), "v": _K8}, TypeError,
     "k: expected dtype float32 (q's dtype) or int8, got uint8; convert with k.astype(np.float32), or quantize both k and v with twinattn.quantize_kv"),
    ({"k_scale": None}, ValueError, "k_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"),
    ({"v_scale": None}, ValueError, "v_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"),
    ({"k": _K8.astype(np.float32), "v": _K8.astype(np.float32)}, ValueError,
     "k_scale: expected None with float32 k and v (scales are only for int8), got an array"),
    ({"k": _K8.astype(np.float32), "v": _K8.astype(np.float32), "k_scale": None}, ValueError,
     "v_scale: expected None with float32 k and v (scales are only for int8), got an array"),
    ({"k_scale": _S.astype(np.float16)}, TypeError, "k_scale: expected dtype float32, got float16; convert with k_scale.astype(np.float32)"),
    ({"v_scale": _S[0]}, ValueError, "v_scale: expected 3 dimensions (B, Hkv, Lk), got shape (1, 5)"),
    ({"k_scale": np.ones((1, 1, 4), np.float32)}, ValueError, "k_scale: expected shape (B=1, Hkv=1, Lk=5), got (1, 1, 4)"),
    ({"v_scale": "x"}, TypeError, "v_scale: expected a float32 numpy array of shape (B, Hkv, Lk), got str"),
    ({"q": _QI.astype(np.float64)}, TypeError, None),
], ids=["v-float32", "v-int8-only", "k-uint8", "k_scale-missing", "v_scale-missing", "k_scale-superfluous",
        "v_scale-superfluous", "k_scale-float16", "v_scale-rank", "k_scale-shape", "v_scale-str", "q-float64"])
def test_int8_bad_calls_same_message_on_every_backend(backend: str, kwargs: dict[str, Any], exc: type[Exception], message: str | None) -> None:
    args: dict[str, Any] = {"q": _QI, "k": _K8, "v": _K8, "k_scale": _S, "v_scale": _S, **kwargs}
    with pytest.raises(exc) as info:
        twinattn.attention(args.pop("q"), args.pop("k"), args.pop("v"), backend=backend, **args)
    if message is not None:
        assert str(info.value) == message
