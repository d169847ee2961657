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
from conftest import _require
from helpers import assert_close_to_reference

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
CLEAR_ERRORS = (TypeError, ValueError)
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
    if draw(st.booleans()) and a.dtype.kind == "f" and a.size:
        a = np.array(a)
        a.flat[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    if layout == "readonly":
        a = np.array(a)
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


NATIVE_ARGS = ["q", "k", "v", "out", "lse", "q_offset", "kv_lens", "mask", "causal", "scale", "num_threads",
               "window_left", "window_right", "softcap", "alibi_slopes", "sinks"]


@st.composite
def native_calls(draw: st.DrawFn) -> dict[str, Any]:
    b, hkv, lq, lk, d, dv = (draw(st.integers(0, 3)) for _ in range(6))
    hq = hkv * draw(st.integers(0, 3))
    args: dict[str, Any] = dict(
        q=np.zeros((b, hq, lq, d), np.float32), k=np.zeros((b, hkv, lk, d), np.float32),
        v=np.zeros((b, hkv, lk, dv), np.float32), out=np.zeros((b, hq, lq, dv), np.float32),
        lse=np.zeros((b, hq, lq), np.float32), q_offset=np.zeros(b, np.int64), kv_lens=np.full(b, lk, np.int64),
        mask=None, causal=draw(st.booleans()), scale=1.0, num_threads=draw(st.integers(1, 4)),
        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
    )
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(NATIVE_ARGS))
        args[name] = draw(st.sampled_from([
            None, 0, -1, 2**62, 1.5, "text", [1, 2], np.zeros(3, np.int64), np.full(max(b, 1), -5, np.int64),
            np.full(max(b, 1), 2**40, np.int64), np.zeros((1, 1, 1, 1), np.float32), np.zeros((b, hq, lq, lk), bool),
            np.zeros((b, hq, lq, lk), np.int32), np.zeros((2, 2), np.float64), float("nan"), True,
            np.zeros((b, hq, lq, max(d, 1) * 2), np.float32)[..., ::2],
            -2, 2**63 - 1, float("inf"), np.full((b, hq), np.nan, np.float32), np.ones((b, hq), np.float32),
            np.ones(hq, np.float32), np.ones(max(hq, 1) * 2, np.float32)[::2],
        ]))
    return args


@FUZZ
@given(args=native_calls())
def test_native_entry_points_raise_or_compute(native_backend: str, args: dict[str, Any]) -> None:
    module = importlib.import_module(f"twinattn._{native_backend}")
    try:
        module.attention_forward(**args)
    except CLEAR_ERRORS as exc:
        assert str(exc)


@pytest.mark.parametrize("port", ["cpp", "rust"])
def test_huge_sizes_raise_or_work_without_wraparound(port: str) -> None:
    """Element counts beyond 32-bit indexing: a broadcast K/V of 2**31 + keys (no memory behind
    it) either computes or raises a clear error; it never wraps an index around."""
    _require(port)
    lk = 2**31 + 64
    q = np.ones((1, 1, 1, 1), np.float32)
    kv = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (1, 1, lk, 1))
    try:
        out = twinattn.attention(q, kv, kv, kv_lens=[5], backend=port)
    except CLEAR_ERRORS:
        return
    np.testing.assert_allclose(out, 1.0)
