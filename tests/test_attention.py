"""Every backend against the float64 reference over the contract's space."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinattn
from helpers import assert_close_to_reference, assert_lse_close, rand

# (B, Hq, Hkv, Lq, Lk, D, Dv)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 1, 1), id="all-ones"),
    pytest.param((1, 1, 1, 7, 7, 3, 3), id="d3"),
    pytest.param((2, 4, 2, 5, 9, 16, 16), id="gqa2"),
    pytest.param((3, 8, 1, 13, 300, 64, 80), id="mqa-dv80"),
    pytest.param((1, 6, 3, 70, 70, 80, 64), id="d80"),
    pytest.param((2, 8, 8, 33, 129, 128, 128), id="mha-d128"),
    pytest.param((1, 2, 1, 17, 31, 256, 1), id="d256-dv1"),
    pytest.param((1, 4, 4, 64, 257, 1, 256), id="d1-dv256"),
    pytest.param((3, 2, 2, 70, 65, 64, 3), id="lq-gt-lk"),
]


def _problem(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b, hq, hkv, lq, lk, d, dv = shape
    rng = np.random.default_rng(seed)
    return rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)


def _check(backend: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> None:
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    assert_close_to_reference(out, q, k, v, **kwargs)
    assert_lse_close(lse, q, k, v, **kwargs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes(backend: str, shape: tuple[int, ...], causal: bool) -> None:
    q, k, v = _problem(shape, seed=sum(shape))
    lq, lk = shape[3], shape[4]
    kwargs: dict[str, Any] = {"causal": causal}
    if causal and lq > lk:
        kwargs["q_offset"] = 0  # bottom-right would put the first rows before position 0
    _check(backend, q, k, v, **kwargs)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_per_sequence_offsets_and_lengths(backend: str, causal: bool) -> None:
    q, k, v = _problem((3, 4, 2, 6, 40, 16, 8), seed=1)
    kv_lens = np.array([40, 0, 17])
    q_offset = np.array([34, 0, 3])
    _check(backend, q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens)
    # bottom-right default per sequence: kv_len - Lq
    _check(backend, q, k, v, causal=causal, kv_lens=np.array([40, 6, 17]))
    _check(backend, q, k, v, causal=causal, q_offset=5)


MASK_SHAPES = [
    pytest.param((2, 4, 9, 21), id="full"),
    pytest.param((9, 21), id="lq-lk"),
    pytest.param((2, 1, 1, 21), id="padding-like"),
    pytest.param((1, 4, 9, 1), id="per-head-row"),
    pytest.param((4, 1, 21), id="per-head-key"),
    pytest.param((), id="scalar"),
]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masks(backend: str, mask_shape: tuple[int, ...], kind: str, causal: bool) -> None:
    q, k, v = _problem((2, 4, 2, 9, 21, 16, 16), seed=7)
    rng = np.random.default_rng(len(mask_shape))
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.7
    else:
        mask = rng.standard_normal(mask_shape).astype(np.float32)
        if mask.ndim:
            mask[rng.random(mask_shape) < 0.2] = -np.inf
    _check(backend, q, k, v, attn_mask=np.asarray(mask), causal=causal, kv_lens=[21, 15])


def test_bool_mask_polarity_true_attends(backend: str) -> None:
    q = np.array([[1.0, 0.0]], dtype=np.float32)
    k = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    v = np.array([[2.0, 0.0], [0.0, 4.0]], dtype=np.float32)
    out = twinattn.attention(q, k, v, attn_mask=np.array([[False, True]]), backend=backend)
    np.testing.assert_array_equal(out, [[0.0, 4.0]])


def test_float_bias_shifts_scores(backend: str) -> None:
    q, k, v = _problem((1, 2, 2, 5, 11, 8, 8), seed=3)
    bias = np.linspace(-2, 2, 11, dtype=np.float32)
    _check(backend, q, k, v, attn_mask=bias)


def test_non_contiguous_views(backend: str) -> None:
    rng = np.random.default_rng(11)
    # A (B, L, H, D) projection output read as (B, H, L, D) without copying.
    q = rand(rng, 2, 12, 4, 16).swapaxes(1, 2)
    # Slices of a larger preallocated cache, garbage in the unused tail.
    cache_k = rand(rng, 2, 2, 64, 16)
    cache_v = rand(rng, 2, 2, 64, 24)
    cache_k[:, :, 40:] = np.nan
    cache_v[:, :, 40:] = np.nan
    k, v = cache_k[:, :, :40], cache_v[:, :, :40]
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    _check(backend, q, k, v, causal=True)
    # Negative strides along L and H, and a non-unit last stride (copied once by the Python layer).
    _check(backend, q[:, ::-1, ::-1], k[:, ::-1], v, causal=False)
    _check(backend, q, rand(rng, 2, 2, 40, 32)[..., ::2], v)


def test_out_argument(backend: str) -> None:
    q, k, v = _problem((2, 4, 2, 7, 10, 8, 6), seed=5)
    out = np.full((2, 4, 7, 6), np.nan, dtype=np.float32)
    result = twinattn.attention(q, k, v, causal=True, out=out, backend=backend)
    assert result is out
    assert_close_to_reference(out, q, k, v, causal=True)
    # A strided out is written in place too.
    big = np.zeros((2, 7, 4, 12), dtype=np.float32)
    view = big.swapaxes(1, 2)[..., ::2]
    twinattn.attention(q, k, v, causal=True, out=view, backend=backend)
    np.testing.assert_array_equal(view, out)
    assert np.all(big[..., 1::2] == 0)


@pytest.mark.parametrize("rank", [2, 3])
def test_lower_ranks(backend: str, rank: int) -> None:
    q, k, v = _problem((1, 1, 1, 9, 13, 16, 4), seed=rank)
    q, k, v = (a.reshape(a.shape[4 - rank :]) for a in (q, k, v))
    out, lse = twinattn.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == q.shape[:-1] + (4,) and lse.shape == q.shape[:-1]
    assert_close_to_reference(out, q, k, v, causal=True)


@pytest.mark.parametrize(
    "shape",
    [(0, 2, 2, 5, 5, 8, 8), (2, 2, 2, 0, 5, 8, 8), (2, 0, 0, 3, 5, 8, 8), (1, 2, 1, 4, 5, 8, 0)],
    ids=["b0", "lq0", "h0", "dv0"],
)
def test_empty_axes(backend: str, shape: tuple[int, ...]) -> None:
    q, k, v = _problem(shape, seed=0)
    out, lse = twinattn.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == shape[:2] + (shape[3], shape[6]) and out.size == 0
    assert lse.shape == shape[:2] + (shape[3],)


def test_no_keys_gives_zero_rows(backend: str) -> None:
    q, k, v = _problem((2, 2, 1, 3, 0, 8, 5), seed=0)
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=backend)
    np.testing.assert_array_equal(out, np.zeros((2, 2, 3, 5), dtype=np.float32))
    assert np.all(np.isneginf(lse))


def test_scale(backend: str) -> None:
    q, k, v = _problem((1, 2, 2, 5, 9, 8, 8), seed=9)
    _check(backend, q, k, v, scale=0.3)
    _check(backend, q, k, v, scale=0.0)  # uniform weights over the visible keys
    _check(backend, q, k, v, scale=-1.5, causal=True)


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 4))
    q_heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    q_len = draw(st.integers(1, 70))
    k_len = draw(st.integers(1, 300))
    head_dim = draw(st.sampled_from([1, 3, 16, 64, 80, 128, 256]))
    value_dim = draw(st.sampled_from([1, 3, 16, 64, 80, 128, 256]))
    causal = draw(st.booleans())
    kv_lens = draw(st.lists(st.integers(0, k_len), min_size=batch, max_size=batch))
    q_offset = draw(st.one_of(st.none(), st.lists(st.integers(0, k_len), min_size=batch, max_size=batch)))
    if q_offset is None and causal and min(kv_lens) < q_len:
        q_offset = [0] * batch
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_shape = draw(
        st.sampled_from([(batch, q_heads, q_len, k_len), (q_len, k_len), (batch, 1, 1, k_len), (q_heads, 1, 1)])
    )
    layout = draw(st.sampled_from(["contiguous", "blhd", "cache-slice"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, k_len=k_len, head_dim=head_dim,
        value_dim=value_dim, causal=causal, kv_lens=kv_lens, q_offset=q_offset, mask_kind=mask_kind,
        mask_shape=mask_shape, layout=layout, seed=seed,
    )


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_property_matches_reference(backend: str, p: dict[str, Any]) -> None:
    rng = np.random.default_rng(p["seed"])
    b, hq, hkv, lq, lk = p["batch"], p["q_heads"], p["kv_heads"], p["q_len"], p["k_len"]
    d, dv = p["head_dim"], p["value_dim"]
    if p["layout"] == "blhd":
        q = rand(rng, b, lq, hq, d).swapaxes(1, 2)
        k = rand(rng, b, lk, hkv, d).swapaxes(1, 2)
        v = rand(rng, b, lk, hkv, dv).swapaxes(1, 2)
    elif p["layout"] == "cache-slice":
        q = rand(rng, b, hq, lq, d)
        k = rand(rng, b, hkv, lk + 5, d)[:, :, :lk]
        v = rand(rng, b, hkv, lk + 5, dv)[:, :, :lk]
    else:
        q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)
    mask = None
    if p["mask_kind"] == "bool":
        mask = rng.random(p["mask_shape"]) < 0.8
    elif p["mask_kind"] == "float":
        mask = rng.standard_normal(p["mask_shape"]).astype(np.float32)
    kwargs = dict(causal=p["causal"], kv_lens=p["kv_lens"], q_offset=p["q_offset"], attn_mask=mask)
    _check(backend, q, k, v, **kwargs)
