"""Hostile input never breaks twinattn: every call returns the reference's answer or raises a
clear exception (TypeError / ValueError), on every backend; nothing crashes, hangs or reads out
of bounds. The same hostile arguments also go straight to the native entry points.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinattn
from twinattn.core.reference import attention_reference
from conftest import _require
from helpers import (
    FLOAT32_ERROR_FACTOR,
    FLOOR_ULPS,
    UNIT_ROUNDOFF,
    assert_close_to_reference,
    assert_lse_close,
    rand,
    reference64,
)

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
CLEAR_ERRORS = (TypeError, ValueError)
# (Huge finite values are not drawn: a score that overflows float32 but not float64 is outside the
# rule the native ports follow, see twinattn/core/reference.py.)
NONFINITE = [np.nan, np.inf, -np.inf]
FUZZ = settings(
    max_examples=100, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _array(draw: st.DrawFn, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["c", "reversed", "strided", "fortran", "readonly", "broadcast"]))
    if layout == "strided" and shape:
        a = rng.standard_normal(shape[:-1] + (shape[-1] * 2,))[..., ::2]
    elif layout == "fortran":
        a = np.asfortranarray(rng.standard_normal(shape))
    elif layout == "broadcast" and shape and shape[0] > 0:
        a = np.broadcast_to(rng.standard_normal((1,) + shape[1:]), shape)
    else:
        a = rng.standard_normal(shape)
        if layout == "reversed" and a.ndim:
            a = a[::-1]
    a = a.astype(dtype) if a.dtype != dtype else a
    if draw(st.booleans()) and a.dtype.kind == "f" and a.size:  # anywhere: visible or hidden
        a = np.array(a)
        a.flat[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from(NONFINITE))
    if layout == "readonly":
        a = np.array(a)
        a.flags.writeable = False
    return a


def _place_visible(draw: st.DrawFn, a: np.ndarray) -> np.ndarray:
    """A copy of a with NaN or +-inf at one element whose second-to-last index (a key of k, v or
    the mask; a query row of q) is 0, so the key is one that every row with kv_len > 0 sees
    unless a mask hides it. Arrays that are not float or are empty come back unchanged."""
    if a.dtype.kind != "f" or a.size == 0 or a.ndim < 2:
        return a
    readonly = not a.flags.writeable
    a = np.array(a)
    index = [draw(st.integers(0, n - 1)) for n in a.shape]
    index[-2] = 0
    a[tuple(index)] = draw(st.sampled_from(NONFINITE))
    if readonly:
        a.flags.writeable = False
    return a


@st.composite
def hostile_calls(draw: st.DrawFn) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]:
    b, hkv, lq, lk = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 9)), draw(st.integers(0, 12))
    hq = hkv * draw(st.integers(0, 3)) + draw(st.sampled_from([0, 0, 0, 1]))
    d, dv = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    rank_drop = draw(st.sampled_from([0, 0, 0, 1, 2]))
    shapes = [(b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv)]
    if draw(st.integers(0, 5)) == 0:  # a wrong shape somewhere
        which, axis = draw(st.integers(0, 2)), draw(st.integers(0, 3))
        shape = list(shapes[which])
        shape[axis] += draw(st.sampled_from([-1, 1, 2]))
        shapes[which] = tuple(max(0, n) for n in shape)
    dtype = np.float32 if draw(st.integers(0, 4)) else draw(st.sampled_from(DTYPES))
    q, k, v = (_array(draw, s, dtype if i == draw(st.integers(0, 2)) else np.float32) for i, s in enumerate(shapes))
    if draw(st.integers(0, 2)) == 0:  # a non-finite value at a visible position: key 0 of k or v, or q
        which = draw(st.integers(0, 2))
        q, k, v = (_place_visible(draw, a) if i == which else a for i, a in enumerate((q, k, v)))
    if rank_drop:
        q, k, v = (a.reshape(a.shape[rank_drop:]) if all(n == 1 for n in a.shape[:rank_drop]) else a for a in (q, k, v))
    kwargs: dict[str, Any] = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["q_offset"] = draw(st.one_of(
            st.integers(-3, 20), st.just(2**62), st.lists(st.integers(-2, 20), min_size=0, max_size=4).map(np.array),
            st.just(np.array([1.5])), st.just(True),
        ))
    if draw(st.booleans()):
        kwargs["kv_lens"] = draw(st.one_of(
            st.lists(st.integers(-2, 14), min_size=0, max_size=4).map(np.array), st.just(np.array([2**40])),
            st.just(np.array([3.0])), st.integers(0, 5),
        ))
    if draw(st.booleans()):
        mshape = draw(st.sampled_from([(lq, lk), (1, lk), (b, 1, lq, lk), (lq + 1, lk), (2, 2, 2, 2, 2), ()]))
        mdtype = draw(st.sampled_from([np.bool_, np.float32, np.float64, np.int8]))
        kwargs["attn_mask"] = _array(draw, mshape, mdtype)
        if draw(st.integers(0, 2)) == 0:  # a non-finite bias on key 0, which most rows see
            kwargs["attn_mask"] = _place_visible(draw, kwargs["attn_mask"])
    if draw(st.integers(0, 3)) == 0:
        kwargs["scale"] = draw(st.sampled_from([0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), "x", None]))
    if draw(st.integers(0, 3)) == 0:
        out_shape = tuple(q.shape[:-1]) + (v.shape[-1] if v.ndim else 0,)
        choice = draw(st.sampled_from(["good", "shape", "dtype", "alias-q", "readonly"]))
        if choice == "good":
            kwargs["out"] = np.full(out_shape, np.nan, np.float32)
        elif choice == "shape":
            kwargs["out"] = np.zeros(out_shape + (1,), np.float32)
        elif choice == "dtype":
            kwargs["out"] = np.zeros(out_shape, np.float64)
        elif choice == "alias-q":
            kwargs["out"] = q
        else:
            kwargs["out"] = np.zeros(out_shape, np.float32)
            kwargs["out"].flags.writeable = False
    kwargs["return_lse"] = draw(st.booleans())
    return (q, k, v), kwargs


def _outcome(backend: str, args: tuple[np.ndarray, ...], kwargs: dict[str, Any]) -> Any:
    if "out" in kwargs and isinstance(kwargs["out"], np.ndarray) and kwargs["out"].flags.writeable:
        kwargs = {**kwargs, "out": np.array(kwargs["out"])}  # each backend writes its own copy
    try:
        return twinattn.attention(*args, backend=backend, **kwargs)
    except CLEAR_ERRORS as exc:
        assert str(exc), "an exception without a message"
        return exc


@FUZZ
@given(call=hostile_calls())
def test_hostile_calls_match_the_reference_or_raise_the_same_error(native_backend: str, call: Any) -> None:
    args, kwargs = call
    expected = _outcome("numpy", args, kwargs)
    got = _outcome(native_backend, args, kwargs)
    # float64 inputs are the one legitimate difference: numpy computes them, native ports refuse
    if isinstance(got, TypeError) and "computes in float32" in str(got):
        return
    if isinstance(expected, Exception):
        if isinstance(got, Exception):
            assert type(got) is type(expected) and str(got) == str(expected)
        else:
            pytest.fail(f"reference raised {expected!r}, {native_backend} returned a result")
        return
    assert not isinstance(got, Exception), f"{native_backend} raised {got!r}, the reference returned a result"
    out = got[0] if kwargs.get("return_lse") else got
    q, k, v = args
    ref_kwargs = {key: val for key, val in kwargs.items() if key not in ("return_lse", "out")}
    assert_close_to_reference(np.asarray(out), q, k, v, **ref_kwargs)
    # non-finite inputs: the reference's NaN / +inf / -inf pattern, in out and in lse
    want_out, want_lse = reference64(q, k, v, return_lse=True, **ref_kwargs)
    patterns = [(np.asarray(out), np.asarray(want_out), "out")]
    if kwargs.get("return_lse"):
        patterns.append((np.asarray(got[1]), np.asarray(want_lse), "lse"))
        assert_lse_close(np.asarray(got[1]), q, k, v, **ref_kwargs)
    for array, want, what in patterns:
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(array), test(want), err_msg=f"{test.__name__} pattern of {what}")


@st.composite
def nonfinite_calls(draw: st.DrawFn) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]:
    """Valid calls (GQA, causal with offsets, kv_lens, bool or float masks, all three paths of the
    fast kernels) with one to three NaN / +-inf values in q, k, v or the bias, mostly at positions
    some row sees (key 0 and the first kv_len keys), sometimes anywhere."""
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4, 8]))
    lq = draw(st.sampled_from([1, 2, 3, 7, 13, 30]))  # packed rows from 1 (direct) to 240 (prefill)
    lk, d, dv = draw(st.sampled_from([1, 5, 40, 300, 1100])), draw(st.integers(1, 20)), draw(st.integers(1, 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((b, hkv * group, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv)))
    kwargs: dict[str, Any] = {"causal": draw(st.booleans()), "return_lse": True}
    kv_lens = rng.integers(0, lk + 1, b)
    if draw(st.booleans()):
        kwargs["kv_lens"] = kv_lens
        if kwargs["causal"]:
            kwargs["q_offset"] = rng.integers(0, lk + 1, b)
    elif kwargs["causal"] and lq > lk:
        kwargs["q_offset"] = 0
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind == "bool":
        kwargs["attn_mask"] = rng.random((b, hkv * group, lq, lk)) < 0.8
    elif mask_kind == "float":
        bias = rng.standard_normal((b, hkv * group, lq, lk)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kwargs["attn_mask"] = bias
    arrays = {"q": q, "k": k, "v": v}
    if mask_kind == "float":
        arrays["attn_mask"] = kwargs["attn_mask"]
    seen_keys = max(1, int(kv_lens.min()) if "kv_lens" in kwargs else lk)  # keys [0, seen_keys) are not padding
    key_axis = {"q": None, "k": 2, "v": 2, "attn_mask": 3}
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(arrays)))
        a = arrays[name]
        index = [draw(st.integers(0, n - 1)) for n in a.shape]
        if key_axis[name] is not None and draw(st.integers(0, 3)):  # mostly a key before every kv_len
            index[key_axis[name]] = draw(st.integers(0, seen_keys - 1))
        a[tuple(index)] = draw(st.sampled_from(NONFINITE))
    return (q, k, v), kwargs


@FUZZ
@given(call=nonfinite_calls())
def test_nonfinite_inputs_give_the_reference_pattern(backend: str, call: Any) -> None:
    """NaN / inf anywhere in a valid call: out and lse have the float64 reference's NaN, +inf and
    -inf pattern and its finite values within float32 tolerance (twinattn/core/reference.py's rule)."""
    (q, k, v), kwargs = call
    out, lse = twinattn.attention(q, k, v, backend=backend, **kwargs)
    ref_kwargs = {key: val for key, val in kwargs.items() if key != "return_lse"}
    want_out, want_lse = reference64(q, k, v, return_lse=True, **ref_kwargs)
    for array, want, what in ((out, want_out, "out"), (lse, want_lse, "lse")):
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(array), test(want), err_msg=f"{test.__name__} pattern of {what}")
    assert_close_to_reference(out, q, k, v, **ref_kwargs)
    assert_lse_close(lse, q, k, v, **ref_kwargs)


NATIVE_ARGS = ["q", "k", "v", "out", "lse", "q_offset", "kv_lens", "mask", "causal", "scale", "num_threads",
               "window_left", "window_right", "softcap", "alibi_slopes", "sinks"]


@st.composite
def native_calls(draw: st.DrawFn) -> dict[str, Any]:
    dims = [draw(st.integers(1, 4)) for _ in range(7)]
    empty_axis = draw(st.sampled_from([None, None, None, *range(7)]))  # empty axes, now and then
    if empty_axis is not None:
        dims[empty_axis] = 0
    b, hkv, lq, lk, d, dv, group = dims
    hq = hkv * group
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    args: dict[str, Any] = dict(
        q=rand(rng, b, hq, lq, d), k=rand(rng, b, hkv, lk, d), v=rand(rng, b, hkv, lk, dv),
        out=np.full((b, hq, lq, dv), np.nan, np.float32), lse=np.full((b, hq, lq), np.nan, np.float32),
        q_offset=rng.integers(0, lk + 1, b).astype(np.int64), kv_lens=rng.integers(0, lk + 1, b).astype(np.int64),
        mask=None, causal=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 0.3, -2.0])),
        num_threads=draw(st.integers(1, 4)),
        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
    )
    # unchanged now and then: the valid calls are the ones whose values get checked
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        name = draw(st.sampled_from(NATIVE_ARGS))
        args[name] = draw(st.sampled_from([
            None, 0, -1, 2**62, 1.5, "text", [1, 2], np.zeros(3, np.int64), np.full(max(b, 1), -5, np.int64),
            np.full(max(b, 1), 2**40, np.int64), np.zeros((1, 1, 1, 1), np.float32), rng.random((b, hq, lq, lk)) < 0.5,
            np.zeros((b, hq, lq, lk), np.int32), np.zeros((2, 2), np.float64), float("nan"), True,
            np.zeros((b, hq, lq, max(d, 1) * 2), np.float32)[..., ::2],
            -2, 2**63 - 1, float("inf"), np.full((b, hq), np.nan, np.float32), np.ones((b, hq), np.float32),
            np.ones(hq, np.float32), np.ones(max(hq, 1) * 2, np.float32)[::2],
        ]))
    return args


def _assert_native_result_matches_reference(args: dict[str, Any]) -> None:
    """A native call that returned wrote out (and lse, when given) as the float64 reference says,
    within the error float32 arithmetic makes on the same problem (see helpers.py)."""
    q, k, v, out, lse = (args[name] for name in ("q", "k", "v", "out", "lse"))
    # None is the keyword's default
    defaults = dict(causal=False, q_offset=np.zeros(q.shape[0], np.int64), kv_lens=np.full(q.shape[0], k.shape[2], np.int64),
                    window_left=-1, window_right=-1, softcap=0.0)
    given = {name: defaults[name] if args[name] is None else args[name] for name in defaults}
    problem = dict(
        causal=bool(given["causal"]), q_offset=np.asarray(given["q_offset"]), kv_lens=np.asarray(given["kv_lens"]),
        mask=args["mask"], scale=float(args["scale"]),
        window_left=int(given["window_left"]), window_right=int(given["window_right"]),
        softcap=float(given["softcap"]), alibi_slopes=args["alibi_slopes"], sinks=args["sinks"],
    )
    want, want_lse = attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **problem)
    f32, f32_lse = attention_reference(q, k, v, **problem)
    for got, want_, f32_ in ((out, want, f32), (lse, want_lse, f32_lse)):
        if got is None:
            continue
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want_))
        np.testing.assert_array_equal(got[~np.isfinite(want_)], want_[~np.isfinite(want_)].astype(np.float32))
        finite = np.isfinite(want_)
        f32_err = float(np.max(np.abs(f32_[finite] - want_[finite]), initial=0.0))
        scale_of = float(np.max(np.abs(want_[finite]), initial=0.0)) + float(np.max(np.abs(v), initial=0.0))
        tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, scale_of)
        err = float(np.max(np.abs(got[finite].astype(np.float64) - want_[finite]), initial=0.0))
        assert err <= tol, f"max abs error {err:.3g} > tolerance {tol:.3g}"


@FUZZ
@given(args=native_calls())
def test_native_entry_points_raise_or_compute(native_backend: str, args: dict[str, Any]) -> None:
    """Called directly with hostile arguments, a native entry point raises a clear error or
    computes the reference's answer."""
    module = importlib.import_module(f"twinattn._{native_backend}")
    try:
        module.attention_forward(**args)
    except CLEAR_ERRORS as exc:
        assert str(exc)
        return
    _assert_native_result_matches_reference(args)


@pytest.mark.parametrize("port", ["cpp", "rust"])
def test_key_axis_longer_than_2_31_raises_or_works(port: str) -> None:
    """A key axis of 2**31 + 64 (a broadcast K/V: no memory behind it) with kv_lens=[5] either
    computes the five visible keys or raises a clear error. (Index arithmetic past 32 bits is
    shown by test_offsets_past_32_bits_do_not_wrap: here every key holds the same value.)"""
    _require(port)
    lk = 2**31 + 64
    q = np.ones((1, 1, 1, 1), np.float32)
    kv = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (1, 1, lk, 1))
    try:
        out = twinattn.attention(q, kv, kv, kv_lens=[5], backend=port)
    except CLEAR_ERRORS:
        return
    np.testing.assert_allclose(out, 1.0)


# Element offsets of the views in test_offsets_past_32_bits_do_not_wrap: each tensor's batch 0 sits
# near the start of one sparse buffer and its batch 1 past 2**31 (signed 32-bit) or 2**32
# (unsigned 32-bit) elements, so an index computed in 32 bits reads the wrong (or unmapped) memory.
_WRAP_LAYOUT = {  # name: (offset of batch 0, batch stride), in float32 elements
    "q": (0, 2**31 + 2**18),
    "k": (2**17, 2**32),
    "v": (2**18, 2**31 + 2**19),
}
_WRAP_BUFFER = 2**32 + 2**20  # elements: 16 GiB of address space, a few pages of it ever touched


@pytest.mark.parametrize("port", ["cpp", "rust"])
@pytest.mark.parametrize("q_len", [1, 40], ids=["decode", "prefill"])
def test_offsets_past_32_bits_do_not_wrap(port: str, q_len: int, tmp_path: Any) -> None:
    """q, k and v whose second sequence lies past 2**31 and 2**32 elements of one buffer (a sparse
    memory-mapped file: only the pages written here are ever backed) give the bits that the same
    port gives on small contiguous copies, and those match the float64 reference."""
    _require(port)
    resource = pytest.importorskip("resource")
    rng = np.random.default_rng(q_len)
    hq, hkv, lk, d = 4, 2, 300, 64
    small = {"q": rand(rng, 2, hq, q_len, d), "k": rand(rng, 2, hkv, lk, d), "v": rand(rng, 2, hkv, lk, d)}
    buffer = np.memmap(tmp_path / "sparse.f32", dtype=np.float32, mode="w+", shape=(_WRAP_BUFFER,))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    views = {}
    for name, (offset, batch_stride) in _WRAP_LAYOUT.items():
        a = small[name]
        item = a.itemsize
        view = np.lib.stride_tricks.as_strided(
            buffer[offset:], shape=a.shape, strides=(batch_stride * item,) + a.strides[1:], writeable=True
        )
        view[...] = a
        np.testing.assert_array_equal(view, a)
        views[name] = view
    assert views["k"][1].__array_interface__["data"][0] - buffer.ctypes.data >= 2**32 * 4
    kwargs: dict[str, Any] = dict(causal=True, kv_lens=np.array([lk, 217]), return_lse=True)
    out, lse = twinattn.attention(views["q"], views["k"], views["v"], backend=port, **kwargs)
    want_out, want_lse = twinattn.attention(small["q"], small["k"], small["v"], backend=port, **kwargs)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    del kwargs["return_lse"]
    assert_close_to_reference(out, small["q"], small["k"], small["v"], **kwargs)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 256, f"resident memory grew by {grown_mib:.0f} MiB: the sparse buffer was read whole"
    del views, buffer
