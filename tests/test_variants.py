"""The variants current models use: sliding window (window_size), logit softcapping (softcap),
ALiBi (alibi_slopes) and attention sinks (sinks), alone and combined with everything else, on
every backend and every instruction set, against the float64 reference.

Sizes sit around the kernels' tiles: query tiles of 48 packed rows, key blocks of 256, split-key
decode chunks of 1024 keys, decode with Lq * G <= 24 rows on the direct path and 25..48 on the
panel path. Tolerances: helpers.py (a multiple of float32's own error on the same problem).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinattn
from conftest import _require
from helpers import UNIT_ROUNDOFF, assert_close_to_reference, assert_lse_close, forced_isa, rand
from test_isa import ISAS, port_isa  # noqa: F401  (the fixture: every port x instruction set)

VARIANTS = ("window", "softcap", "alibi", "sinks", "all")


def _variant_kwargs(variant: str, rng: np.random.Generator, b: int, hq: int) -> dict[str, Any]:
    """One variant's keywords with values that change the result (slopes and sinks asymmetric)."""
    kwargs: dict[str, Any] = {}
    if variant in ("window", "all"):
        kwargs["window_size"] = (5, 2)
    if variant in ("softcap", "all"):
        kwargs["softcap"] = 1.5
    if variant in ("alibi", "all"):
        kwargs["alibi_slopes"] = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32)
    if variant in ("sinks", "all"):
        kwargs["sinks"] = rng.uniform(-1.0, 2.0, hq).astype(np.float32)
    return kwargs


def check(backend: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """out and lse of `backend` against the float64 reference; returns them."""
    out, lse = twinattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    assert_close_to_reference(out, q, k, v, **kwargs)
    assert_lse_close(lse, q, k, v, **kwargs)
    return out, lse


# ---- every variant, alone and with everything else -------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("extra", ["plain", "q_offset", "kv_lens", "bool_mask", "float_mask"])
def test_variant_combined_with_everything(backend: str, variant: str, causal: bool, extra: str) -> None:
    rng = np.random.default_rng(VARIANTS.index(variant) * 31 + 7 * causal + len(extra))
    b, hq, hkv, lq, lk, d = 2, 4, 2, 9, 23, 16  # GQA, small and asymmetric
    q = rand(rng, b, lq, hq, d).swapaxes(1, 2)  # strided: (B, L, H, D) storage read as (B, H, L, D)
    k = rand(rng, b, hkv, lk + 5, d)[:, :, 3 : lk + 3]  # a slice of a longer cache
    v = rand(rng, b, hkv, lk, d + 3)
    kwargs = _variant_kwargs(variant, rng, b, hq)
    kwargs["causal"] = causal
    if extra == "q_offset":
        kwargs["q_offset"] = np.array([0, 11])
    elif extra == "kv_lens":
        kwargs["kv_lens"] = np.array([lk, 12])
    elif extra == "bool_mask":
        kwargs["attn_mask"] = rng.random((b, 1, lq, lk)) > 0.3
    elif extra == "float_mask":
        bias = rng.standard_normal((hq, lq, lk)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        kwargs["attn_mask"] = bias
    out, _ = check(backend, q, k, v, **kwargs)
    # the variant changes the answer (the comparison above would not notice a variant ignored
    # everywhere, the reference included)
    plain = {name: value for name, value in kwargs.items() if name not in ("window_size", "softcap", "alibi_slopes", "sinks")}
    assert not np.allclose(out, twinattn.attention(q, k, v, backend=backend, **plain), atol=1e-3)


def test_out_and_rank(backend: str) -> None:
    """out= (strided) and 3-D inputs, with every variant at once."""
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 4, 7, 8), rand(rng, 2, 12, 8), rand(rng, 2, 12, 6)
    kwargs = _variant_kwargs("all", rng, 1, 4)
    storage = np.full((4, 7, 12), np.nan, np.float32)
    out = storage[:, :, ::2]
    got, lse = twinattn.attention(q, k, v, causal=True, out=out, return_lse=True, backend=backend, **kwargs)
    assert got is out and lse.shape == (4, 7)
    assert np.isnan(storage[:, :, 1::2]).all()  # nothing written between the strided elements
    assert_close_to_reference(np.array(got), q, k, v, causal=True, **kwargs)
    assert_lse_close(lse, q, k, v, causal=True, **kwargs)


def test_small_window_by_hand(backend: str) -> None:
    """A problem whose answer is written down: one head, D=1, scale 1, window (1, 0) causal; row i
    averages v[i-1] and v[i] with weights softmax(q_i k_{i-1}, q_i k_i)."""
    q = np.array([[1.0], [2.0], [0.5], [-1.0]], np.float32)
    k = np.array([[0.0], [1.0], [-1.0], [2.0]], np.float32)
    v = np.array([[1.0], [10.0], [100.0], [1000.0]], np.float32)
    got, lse = twinattn.attention(q, k, v, causal=True, window_size=(1, 0), scale=1.0, return_lse=True, backend=backend)
    want, want_lse = [], []
    for i in range(4):
        keys = range(max(0, i - 1), i + 1)
        s = np.array([q[i, 0] * k[j, 0] for j in keys], np.float64)
        want.append(np.exp(s) @ v[list(keys), 0] / np.exp(s).sum())
        want_lse.append(np.log(np.exp(s).sum()))
    np.testing.assert_allclose(got[:, 0], want, rtol=4e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=4e-6, atol=4e-7)


def test_window_right_is_capped_under_causal(backend: str) -> None:
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 1, 2, 6, 8), rand(rng, 1, 2, 10, 8), rand(rng, 1, 2, 10, 8)
    capped = twinattn.attention(q, k, v, causal=True, window_size=(3, 0), backend=backend)
    for right in (-1, 5):
        np.testing.assert_array_equal(twinattn.attention(q, k, v, causal=True, window_size=(3, right), backend=backend), capped)


def test_windows_wider_than_int64(backend: str) -> None:
    """A side beyond any distance (up to ints past int64) is as unbounded as -1."""
    rng = np.random.default_rng(10)
    q, k, v = rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 9, 8), rand(rng, 1, 2, 9, 8)
    unbounded = twinattn.attention(q, k, v, backend=backend)
    for window in [(2**70, 2**70), (2**63 - 1, 2**63 - 1), (2**62, -1), (-1, 2**64)]:
        np.testing.assert_array_equal(twinattn.attention(q, k, v, window_size=window, backend=backend), unbounded)


# ---- positions without causal ----------------------------------------------------------------


def test_default_offset_may_be_negative_without_causal(backend: str) -> None:
    """Lq > Lk: with a window or ALiBi and no causal, the default q_offset Lk - Lq < 0 is used as
    it is; the first rows then see nothing through a (0, 0) window."""
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 1, 2, 9, 8), rand(rng, 1, 2, 4, 8), rand(rng, 1, 2, 4, 8)
    out, lse = check(backend, q, k, v, window_size=(0, 0))
    assert (out[:, :, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all()  # positions -5..-1
    assert np.isfinite(lse[:, :, 5:]).all()
    check(backend, q, k, v, alibi_slopes=np.array([0.5, 0.25], np.float32))
    check(backend, q, k, v, window_size=(2, 1), q_offset=np.array([-3]))  # explicit negative too
    with pytest.raises(ValueError, match="q_offset: the default bottom-right alignment"):
        twinattn.attention(q, k, v, causal=True, window_size=(0, 0), backend=backend)
    with pytest.raises(ValueError, match="q_offset: expected non-negative values"):
        twinattn.attention(q, k, v, causal=True, window_size=(2, 0), q_offset=-1, backend=backend)


# ---- rows that see no key --------------------------------------------------------------------


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_rows_without_keys(backend: str, with_sinks: bool) -> None:
    """A window past the end of the sequence, a window before its start, a fully masked row and
    an empty sequence: zeros, lse -inf (or the sink)."""
    rng = np.random.default_rng(11)
    b, hq, hkv, lq, lk, d = 3, 4, 2, 5, 12, 8
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, d)
    sinks = np.array([0.5, -2.0, 3.0, 0.0], np.float32) if with_sinks else None
    mask = np.ones((b, hq, lq, lk), bool)
    mask[2, :, 1] = False
    kwargs: dict[str, Any] = dict(
        q_offset=np.array([30, 0, 3]), kv_lens=np.array([12, 0, 12]), window_size=(2, 0), attn_mask=mask, sinks=sinks
    )
    out, lse = check(backend, q, k, v, **kwargs)
    empty = np.zeros((b, hq, lq), bool)
    empty[0] = True  # positions 30..34 with keys 0..11 and a window of 2 to the left
    empty[1] = True  # no key at all
    empty[2, :, 1] = True  # masked row
    assert (out[empty] == 0).all()
    want = np.broadcast_to(-np.inf if sinks is None else sinks[None, :, None], empty.shape)
    np.testing.assert_array_equal(lse[empty], want[empty])
    assert np.isfinite(lse[~empty]).all()


# ---- tile and split-key boundaries -----------------------------------------------------------

# (B, Hq, Hkv, Lq, Lk, window_size, causal): windows that start and end just inside, at and just
# past key blocks (256), query tiles (48 rows) and decode chunks (1024), on the direct (Lq * G <=
# 24) and panel (25..48 rows) decode paths.
BOUNDARY_CASES = [
    (1, 2, 1, 50, 600, (255, 0), True),
    (1, 2, 1, 47, 600, (256, 0), True),
    (1, 2, 1, 49, 513, (257, 0), True),
    (1, 2, 2, 96, 700, (100, 100), False),
    (1, 1, 1, 130, 130, (47, 48), False),
    (1, 8, 1, 3, 2049, (1023, 0), True),  # 24 rows: direct path
    (1, 25, 1, 1, 2049, (1024, 0), True),  # 25 rows: panel path
    (1, 48, 1, 1, 3000, (1100, 0), True),  # 48 rows, window straddling chunk 2048
    (1, 16, 2, 1, 4100, (4095, 0), True),
    (2, 4, 4, 1, 1025, (0, 0), True),
    (1, 13, 1, 2, 2500, (1500, -1), False),  # 26 rows, left bound only
    (1, 4, 2, 1, 5000, (-1, 0), True),  # no left bound: as plain causal
]


@pytest.mark.parametrize("case", BOUNDARY_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-w{c[5][0]}_{c[5][1]}")
def test_windows_across_tiles_and_chunks(backend: str, case: tuple[Any, ...]) -> None:
    b, hq, hkv, lq, lk, window, causal = case
    rng = np.random.default_rng(lk + lq + hq)
    q, k, v = rand(rng, b, hq, lq, 64), rand(rng, b, hkv, lk, 64), rand(rng, b, hkv, lk, 64)
    kv_lens = np.array([lk, lk - 37][:b])
    check(backend, q, k, v, causal=causal, window_size=window, kv_lens=kv_lens)
    check(backend, q, k, v, causal=causal, window_size=window, kv_lens=kv_lens, softcap=20.0,
          sinks=np.linspace(-1, 1, hq).astype(np.float32), alibi_slopes=np.full(hq, 0.01, np.float32))


# ---- non-finite values -----------------------------------------------------------------------


@pytest.mark.parametrize("lq, lk, hq", [(1, 3000, 8), (1, 600, 32), (40, 700, 2)], ids=["decode", "decode-panel", "prefill"])
def test_nan_outside_the_window_never_leaks(backend: str, lq: int, lk: int, hq: int) -> None:
    """NaN in k and v just left of every row's window, in masked and padded positions: the result
    is finite and the reference's. NaN just inside the window: that row is NaN."""
    rng = np.random.default_rng(lq + lk)
    left, kv_len = 300, lk - 20
    q, k, v = rand(rng, 1, hq, lq, 32), rand(rng, 1, 2, lk, 32), rand(rng, 1, 2, lk, 32)
    first = kv_len - lq  # position of row 0
    outside = first - left - 1  # the key just left of row 0's window
    k[:, :, outside], v[:, :, outside] = np.nan, np.nan
    k[:, :, kv_len:], v[:, :, kv_len:] = np.nan, np.inf  # padding
    mask = np.ones((1, hq, lq, lk), bool)
    mask[..., first - 5] = False  # inside the window but masked
    k[:, :, first - 5] = np.nan
    kwargs: dict[str, Any] = dict(causal=True, window_size=(left, 0), kv_lens=kv_len, attn_mask=mask, softcap=30.0)
    out, lse = check(backend, q, k, v, **kwargs)
    assert np.isfinite(out).all() and np.isfinite(lse).all()

    inside = first - left  # row 0's first key: outside every later row's window
    k[:, :, inside] = np.nan
    out, lse = check(backend, q, k, v, **kwargs)
    assert np.isnan(out[:, :, 0]).all() and np.isnan(lse[:, :, 0]).all()
    assert np.isfinite(out[:, :, 1:]).all()


# ---- softcap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1.0, 50.0, 0.03])
def test_softcap_tanh_over_the_whole_range(backend: str, cap: float) -> None:
    """The kernels' tanh alone: query row i sees only key i (window (0, 0)), so lse[i] is the
    capped score cap * tanh(s_i / cap) itself, s_i spanning [-50, 50] x cap and tiny values; it
    must be np.tanh's to float32 accuracy."""
    x = np.concatenate([np.linspace(-50, 50, 2001), [0.0, 1e-30, -1e-20, 1e-8, 3e-4, -0.2, 0.55, 8.9, 9.1, -9.0]])
    s = (x * cap).astype(np.float32)  # the scores, exactly representable
    n = s.size
    q = s.reshape(1, n, 1)
    k = np.ones((1, n, 1), np.float32)
    v = np.ones((1, n, 1), np.float32)
    _, lse = twinattn.attention(q, k, v, window_size=(0, 0), q_offset=0, scale=1.0, softcap=cap, return_lse=True,
                                backend=backend)
    xs = s.astype(np.float64) / np.float32(cap)
    want = cap * np.tanh(xs)
    # a few roundings of the result, plus the rounding of s / cap carried through tanh's slope
    tol = 6 * UNIT_ROUNDOFF * np.abs(want) + 2 * UNIT_ROUNDOFF * np.abs(s) / np.cosh(np.minimum(np.abs(xs), 300)) ** 2
    err = np.abs(lse[0].astype(np.float64) - want)
    worst = int(np.argmax(err / np.maximum(tol, 1e-45)))
    assert (err <= tol).all(), f"x={xs[worst]}: got {lse[0, worst]!r}, want {want[worst]!r}"


def test_softcap_with_large_scores(backend: str) -> None:
    rng = np.random.default_rng(13)
    q, k, v = 40 * rand(rng, 2, 4, 60, 32), 40 * rand(rng, 2, 2, 300, 32), rand(rng, 2, 2, 300, 32)
    out, _ = check(backend, q, k, v, causal=True, softcap=50.0)
    assert np.isfinite(out).all()
    check(backend, q, k, v, softcap=5.0, window_size=(20, 20), alibi_slopes=np.full(4, 0.1, np.float32))


# ---- ALiBi -----------------------------------------------------------------------------------


def test_alibi_per_head_and_per_sequence(backend: str) -> None:
    rng = np.random.default_rng(17)
    b, hq, hkv = 3, 4, 1
    q, k, v = rand(rng, b, hq, 7, 16), rand(rng, b, hkv, 300, 16), rand(rng, b, hkv, 300, 16)
    slopes = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32)
    per_head = check(backend, q, k, v, causal=True, alibi_slopes=slopes)[0]
    per_seq = np.ascontiguousarray(np.broadcast_to(slopes, (b, hq)))
    np.testing.assert_array_equal(twinattn.attention(q, k, v, causal=True, alibi_slopes=per_seq, backend=backend), per_head)
    distinct = rng.uniform(0, 0.5, (b, hq)).astype(np.float32)
    check(backend, q, k, v, causal=True, alibi_slopes=distinct)
    check(backend, q, k, v, alibi_slopes=distinct[:, ::-1], kv_lens=np.array([300, 10, 150]))  # strided, no causal
    check(backend, q, k, v, alibi_slopes=-distinct, window_size=(64, 64))  # negative slopes favour distance


# ---- sinks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("lk", [1024, 1025, 4096, 9000])
def test_sinks_counted_once_in_split_key_decode(backend: str, lk: int) -> None:
    """A decode over several split-key chunks: the merge must count the sink once (lse shows it)."""
    rng = np.random.default_rng(lk)
    hq, hkv = 8, 2
    q, k, v = rand(rng, 2, hq, 1, 64), rand(rng, 2, hkv, lk, 64), rand(rng, 2, hkv, lk, 64)
    sinks = np.linspace(-3.0, 9.0, hq).astype(np.float32)  # up to a sink that outweighs every key
    kv_lens = np.array([lk, lk // 3 + 1])
    check(backend, q, k, v, causal=True, sinks=sinks, kv_lens=kv_lens)
    check(backend, q, k, v, causal=True, sinks=sinks, kv_lens=kv_lens, window_size=(lk // 2, 0))
    check(backend, q, k, v, causal=True, sinks=sinks, kv_lens=kv_lens, num_threads=3)


def test_sinks_lse_is_log_of_the_denominator(backend: str) -> None:
    """With one visible key of score s and a sink z: lse = log(e^s + e^z), out = v e^s / (e^s + e^z)."""
    q = np.array([[[2.0]], [[-1.0]]], np.float32)
    k = np.array([[[1.5]], [[1.5]]], np.float32)
    v = np.array([[[4.0]], [[4.0]]], np.float32)
    sinks = np.array([1.0, -30.0], np.float32)
    out, lse = twinattn.attention(q, k, v, scale=1.0, sinks=sinks, return_lse=True, backend=backend)
    s = np.array([3.0, -1.5])
    np.testing.assert_allclose(lse[:, 0], np.logaddexp(s, sinks), rtol=4e-7)
    np.testing.assert_allclose(out[:, 0, 0], 4.0 / (1 + np.exp(sinks - s)), rtol=4e-6)


# ---- validation ------------------------------------------------------------------------------

BAD_CALLS = [
    (dict(window_size=3), TypeError, "window_size: expected a pair"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size: expected a pair"),
    (dict(window_size=(1.0, 0)), TypeError, "window_size: expected a pair .* got float"),
    (dict(window_size=(True, 0)), TypeError, "window_size: expected a pair .* got bool"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size: expected each side >= -1 .* got \(-2, 0\)"),
    (dict(window_size=[0, -5]), ValueError, r"window_size: expected each side >= -1 .* got \(0, -5\)"),
    (dict(softcap="1"), TypeError, "softcap: expected a float, got str"),
    (dict(softcap=-1.0), ValueError, "softcap: expected a finite float >= 0 .* got -1.0"),
    (dict(softcap=float("inf")), ValueError, "softcap: expected a finite float >= 0 .* got inf"),
    (dict(softcap=float("nan")), ValueError, "softcap: expected a finite float >= 0 .* got nan"),
    (dict(alibi_slopes=[0.5, 0.25, 0.1, 0.0]), TypeError, "alibi_slopes: expected a float32 numpy array .* got list"),
    (dict(alibi_slopes=np.ones(4)), TypeError, "alibi_slopes: expected float32 .* got float64"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes: expected shape \(Hq=4,\) or \(B=2, Hq=4\), got \(3,\)"),
    (dict(alibi_slopes=np.ones((2, 4, 1), np.float32)), ValueError, r"alibi_slopes: expected shape .* got \(2, 4, 1\)"),
    (dict(alibi_slopes=np.array([0, np.nan, 0, 0], np.float32)), ValueError, r"alibi_slopes: expected finite values, got alibi_slopes\[1\]=nan"),
    (dict(alibi_slopes=np.array([[0, 0, 0, 0], [0, 0, 0, np.inf]], np.float32)), ValueError,
     r"alibi_slopes: expected finite values, got alibi_slopes\[1, 3\]=inf"),
    (dict(sinks=np.ones(4, np.int32)), TypeError, "sinks: expected float32 .* got int32"),
    (dict(sinks=np.ones((2, 4), np.float32)), ValueError, r"sinks: expected shape \(Hq=4,\), got \(2, 4\)"),
    (dict(sinks=np.array([0, 0, -np.inf, 0], np.float32)), ValueError, r"sinks: expected finite values, got sinks\[2\]=-inf"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_CALLS, ids=lambda x: None if isinstance(x, dict) else "")
def test_validation_errors_identical_on_every_backend(
    native_backend: str, kwargs: dict[str, Any], error: type, match: str
) -> None:
    """Each native port raises what the numpy backend raises, message for message (a port that is
    not built skips the comparison, or fails it under TWINATTN_REQUIRE_BACKENDS: never a comparison
    of numpy with itself)."""
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 2, 4, 3, 8), rand(rng, 2, 2, 5, 8), rand(rng, 2, 2, 5, 8)
    messages = []
    for port in ("numpy", native_backend):
        with pytest.raises(error, match=match) as info:
            twinattn.attention(q, k, v, backend=port, **kwargs)
        messages.append(str(info.value))
    assert messages[0] == messages[1], messages


def test_float64_slopes_and_sinks_only_with_a_float64_problem() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    twinattn.attention(q, k, v, alibi_slopes=np.ones(2), sinks=np.zeros(2), backend="numpy")  # float64 problem: fine
    with pytest.raises(TypeError, match="sinks: expected float32"):
        twinattn.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), sinks=np.zeros(2),
                           backend="numpy")


# ---- every instruction set; the ports against each other ------------------------------------


def _isa_problems(seed: int) -> list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]]:
    """A fixed sweep of variant combinations around the tile sizes."""
    rng = np.random.default_rng(seed)
    problems = []
    for n in range(14):
        b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        hq = hkv * int(rng.choice([1, 4, 13, 24]))
        decode = n % 3 == 0
        lk = int(rng.integers(200, 3000 if decode else 700))
        lq = 1 if decode else int(rng.integers(1, 100))
        d = int(rng.choice([16, 64, 80, 128]))
        q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, d)
        kwargs: dict[str, Any] = dict(causal=bool(rng.integers(0, 2) or decode), return_lse=True)
        kwargs["kv_lens"] = rng.integers(max(lq, 1), lk + 1, size=b)
        kwargs["window_size"] = (int(rng.choice([-1, 0, 47, 255, 256, 1023, 1500])), int(rng.choice([-1, 0, 48, 300])))
        if n % 2:
            kwargs["softcap"] = float(rng.choice([0.5, 30.0]))
        if n % 4 in (1, 2):
            kwargs["alibi_slopes"] = rng.uniform(0, 0.2, (b, hq) if n % 3 else (hq,)).astype(np.float32)
        if n % 5 < 3:
            kwargs["sinks"] = rng.uniform(-2, 4, hq).astype(np.float32)
        if n % 7 == 3:
            kwargs["attn_mask"] = rng.random((b, 1, lq, lk)) > 0.2
        problems.append(((q, k, v), kwargs))
    return problems


def test_every_isa_matches_reference(port_isa: tuple[str, str]) -> None:  # noqa: F811
    port, _ = port_isa
    for (q, k, v), kwargs in _isa_problems(77):
        out, lse = twinattn.attention(q, k, v, backend=port, **kwargs)
        reference_kwargs = {name: value for name, value in kwargs.items() if name != "return_lse"}
        assert_close_to_reference(out, q, k, v, **reference_kwargs)
        assert_lse_close(lse, q, k, v, **reference_kwargs)


@pytest.mark.parametrize("seed", range(4))
def test_fast_kernel_matches_plain_kernel(port_isa: tuple[str, str], seed: int) -> None:  # noqa: F811
    """The native entry point against the same port's plain reference kernel, with the variants
    passed directly (a negative q_offset without causal included)."""
    port, _ = port_isa
    module = importlib.import_module(f"twinattn._{port}")
    rng = np.random.default_rng(300 + seed)
    b, hkv = 2, int(rng.integers(1, 3))
    hq = hkv * int(rng.choice([1, 3, 24]))
    lq, lk = int(rng.choice([1, 2, 50])), int(rng.integers(300, 2600))
    q, k, v = rand(rng, b, hq, lq, 64), rand(rng, b, hkv, lk, 64), rand(rng, b, hkv, lk, 64)
    causal = bool(seed % 2)
    args: dict[str, Any] = dict(
        q=q, k=k, v=v, q_offset=(rng.integers(0, lk, b) if causal else rng.integers(-60, lk, b)).astype(np.int64),
        kv_lens=rng.integers(1, lk + 1, b).astype(np.int64), mask=None, causal=causal, scale=0.125, num_threads=2,
        window_left=int(rng.choice([0, 255, 1024])), window_right=0 if causal else int(rng.choice([-1, 3, 300])),
        softcap=float(rng.choice([0.0, 2.0])), alibi_slopes=rng.uniform(0, 0.1, (b, hq)).astype(np.float32),
        sinks=rng.uniform(-1, 3, hq).astype(np.float32),
    )
    results = []
    for kernel in ("attention_forward", "attention_reference"):
        out, lse = np.empty((b, hq, lq, 64), np.float32), np.empty((b, hq, lq), np.float32)
        getattr(module, kernel)(out=out, lse=lse, **args)
        results.append((out, lse))
    (fast, fast_lse), (plain, plain_lse) = results
    np.testing.assert_allclose(fast, plain, rtol=0, atol=64 * UNIT_ROUNDOFF * float(np.abs(v).max()))
    np.testing.assert_allclose(fast_lse, plain_lse, rtol=0, atol=64 * UNIT_ROUNDOFF * max(1.0, float(np.abs(plain_lse).max())))
    reference_kwargs = dict(q_offset=args["q_offset"], kv_lens=args["kv_lens"], causal=causal, scale=0.125,
                            window_size=(args["window_left"], args["window_right"]), softcap=args["softcap"],
                            alibi_slopes=args["alibi_slopes"], sinks=args["sinks"])
    assert_close_to_reference(fast, q, k, v, **reference_kwargs)


@pytest.mark.parametrize("isa", ISAS)
def test_ports_agree_bit_for_bit(isa: str) -> None:
    _require("cpp")
    _require("rust")
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        for (q, k, v), kwargs in _isa_problems(78):
            out_cpp, lse_cpp = twinattn.attention(q, k, v, backend="cpp", **kwargs)
            out_rust, lse_rust = twinattn.attention(q, k, v, backend="rust", **kwargs)
            np.testing.assert_array_equal(out_cpp, out_rust)
            np.testing.assert_array_equal(lse_cpp, lse_rust)


def _tanh_inputs() -> np.ndarray:
    """The whole float32 range: a dense sweep of [-60, 60], tiny and huge magnitudes, +-0, +-inf, NaN."""
    sweep = np.linspace(-60, 60, 200001)
    tiny = np.concatenate([np.geomspace(1e-38, 1.0, 2000), -np.geomspace(1e-38, 1.0, 2000)])
    huge = np.concatenate([np.geomspace(60, 3e38, 500), -np.geomspace(60, 3e38, 500)])
    special = [0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, np.nan]
    return np.concatenate([sweep, tiny, huge, special]).astype(np.float32)


def test_softcap_tanh_alone(port_isa: tuple[str, str]) -> None:  # noqa: F811
    """The kernels' vectorised tanh alone against np.tanh in float64, on every instruction set:
    within a few float32 roundings of the exact value, odd, NaN kept, and exactly +-1 far out;
    strided input too."""
    port, isa = port_isa
    tanh = importlib.import_module(f"twinattn._{port}").softcap_tanh
    x = _tanh_inputs()
    got = np.asarray(tanh(x))
    assert got.dtype == np.float32 and got.shape == x.shape
    want = np.tanh(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=4 * UNIT_ROUNDOFF, atol=0, err_msg=f"{port} {isa}")
    nonzero = x != 0  # the sign of a zero result does not reach a score (tanh(-0.0) may give +0.0)
    np.testing.assert_array_equal(np.signbit(got[nonzero]), np.signbit(x[nonzero]))  # odd
    assert (got[np.abs(x) >= 10] == np.sign(x[np.abs(x) >= 10])).all()
    np.testing.assert_array_equal(np.asarray(tanh(x[::3])), got[::3])
    with pytest.raises(TypeError, match="x: expected dtype float32, got float64"):
        tanh(x.astype(np.float64))


@pytest.mark.parametrize("isa", ISAS)
def test_softcap_tanh_same_bits_in_both_ports(isa: str) -> None:
    _require("cpp")
    _require("rust")
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        x = _tanh_inputs()
        cpp, rust = (importlib.import_module(f"twinattn._{port}") for port in ("cpp", "rust"))
        np.testing.assert_array_equal(cpp.softcap_tanh(x), rust.softcap_tanh(x))


# ---- property test ---------------------------------------------------------------------------

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def variant_problems(draw: st.DrawFn) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]:
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 25]))
    hq = hkv * group
    lk = draw(st.integers(1, 1300))
    lq = draw(st.sampled_from([1, 1, 2, 7, 49]))
    d = draw(st.sampled_from([1, 8, 33, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, d)
    kwargs: dict[str, Any] = {"causal": draw(st.booleans())}
    side = st.sampled_from([-1, 0, 1, 5, 47, 48, 255, 256, 1024])
    if draw(st.booleans()):
        kwargs["window_size"] = (draw(side), draw(side))
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.sampled_from([0.0, 0.1, 2.0, 50.0]))
    if draw(st.booleans()):
        kwargs["alibi_slopes"] = rng.uniform(-0.1, 0.5, draw(st.sampled_from([(hq,), (b, hq)]))).astype(np.float32)
    if draw(st.booleans()):
        kwargs["sinks"] = rng.uniform(-5, 5, hq).astype(np.float32)
    if draw(st.booleans()):
        kwargs["kv_lens"] = rng.integers(0, lk + 1, b)
    if draw(st.booleans()):
        kwargs["q_offset"] = rng.integers(0, lk + 3, b)
    elif kwargs["causal"]:
        kwargs["q_offset"] = 0 if lq > lk or "kv_lens" in kwargs else None
    mask = draw(st.sampled_from([None, "bool", "float"]))
    if mask == "bool":
        kwargs["attn_mask"] = rng.random((b, hq, lq, lk)) > 0.5
    elif mask == "float":
        kwargs["attn_mask"] = np.where(rng.random((1, hq, lq, lk)) > 0.8, -np.inf, rng.standard_normal((1, hq, lq, lk))).astype(np.float32)
    if draw(st.booleans()):  # a NaN somewhere in k: it shows exactly where the reference says
        k[rng.integers(0, b), rng.integers(0, hkv), rng.integers(0, lk)] = np.nan
    return (q, k, v), kwargs


@FUZZ
@given(problem=variant_problems())
def test_random_variant_combinations(backend: str, problem: tuple[tuple[np.ndarray, ...], dict[str, Any]]) -> None:
    (q, k, v), kwargs = problem
    check(backend, q, k, v, **kwargs)


# ---- the torch-style wrapper and nn.Attention --------------------------------------------------


def test_sdpa_passes_the_variants_through(backend: str) -> None:
    rng = np.random.default_rng(21)
    q, k, v = rand(rng, 2, 4, 6, 8), rand(rng, 2, 2, 6, 8), rand(rng, 2, 2, 6, 8)
    kwargs = _variant_kwargs("all", rng, 2, 4)
    got = twinattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend, **kwargs)
    assert_close_to_reference(got, q, k, v, causal=True, q_offset=0, **kwargs)


def _window_mask(length: int, window: int) -> np.ndarray:
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return j > i - window  # with causal: keys i - window + 1 .. i


@pytest.mark.parametrize("window", [1, 4, 9])
def test_nn_sliding_window_prefill_and_cached_decode(backend: str, window: int) -> None:
    """Prefill, then decode token by token with a KVCache: every output is the full recompute's
    with a sliding window (Hugging Face's: each query sees itself and the window - 1 keys before)."""
    from test_nn import HEAD_DIM, HEADS, HIDDEN, assert_close, make_module, make_params, reference_forward, tolerance

    rng = np.random.default_rng(window)
    kv_heads, length, prompt = 2, 20, 6
    params = make_params(rng, kv_heads)
    x = rand(rng, 2, length, HIDDEN)
    mask = _window_mask(length, window)
    want64 = reference_forward(x, params, kv_heads, mask=mask)
    tol = tolerance(want64, reference_forward(x, params, kv_heads, mask=mask, dtype=np.float32))
    module = make_module(backend, kv_heads, params)
    module.sliding_window = window
    assert_close(module(x), want64, tol, "uncached")
    if window < length:  # the window is what makes the difference
        assert not np.allclose(module(x), reference_forward(x, params, kv_heads), atol=1e-3)
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=kv_heads, head_dim=HEAD_DIM, max_seq_len=length)
    outputs = [module(x[:, :prompt], cache=cache)]
    outputs += [module(x[:, t : t + 1], cache=cache) for t in range(prompt, length)]
    assert_close(np.concatenate(outputs, axis=1), want64, tol, "cached")
    assert HEADS % kv_heads == 0


def test_nn_window_decode_ignores_keys_before_the_window(backend: str) -> None:
    """A cached decode step reads only the last w keys: NaN in the cache before them does not matter."""
    from test_nn import HEAD_DIM, HIDDEN, make_params

    rng = np.random.default_rng(4)
    module = twinattn.nn.Attention(HIDDEN, 4, 2, HEAD_DIM, sliding_window=5, backend=backend)
    module.load_state_dict(make_params(rng, 2))
    cache = twinattn.KVCache(1, 1, 2, HEAD_DIM, 32)
    module(rand(rng, 1, 20, HIDDEN), cache=cache)
    step = rand(rng, 1, 1, HIDDEN)
    clean = module(step, cache=cache)
    cache.crop(20)
    keys, values = cache.keys(0), cache.values(0)
    keys[:, :, :16], values[:, :, :16] = np.nan, np.nan  # positions 0..15; the step at 20 sees 16..20
    np.testing.assert_array_equal(module(step, cache=cache), clean)
    cache.crop(20)
    keys[:, :, 16] = np.nan  # the oldest key in the window: now it shows
    assert np.isnan(module(step, cache=cache)).all()


def test_nn_softcap_and_sinks(backend: str) -> None:
    from test_nn import HEAD_DIM, HIDDEN, assert_close, make_params, tolerance

    rng = np.random.default_rng(8)
    params = make_params(rng, 2)
    params["sinks"] = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    module = twinattn.nn.Attention(HIDDEN, 4, 2, HEAD_DIM, softcap=0.7, sinks=True, backend=backend)
    with pytest.raises(KeyError, match="missing \\['sinks'\\]"):
        module.load_state_dict({name: value for name, value in params.items() if name != "sinks"})
    module.load_state_dict(params)
    np.testing.assert_array_equal(module.state_dict()["sinks"], params["sinks"])
    x = rand(rng, 2, 7, HIDDEN)

    def forward(dtype: type) -> np.ndarray:  # the module's definition, computed in dtype
        xd = x.astype(dtype)

        def heads(name: str, count: int) -> np.ndarray:
            return (xd @ params[name].astype(dtype).T).reshape(2, 7, count, HEAD_DIM).transpose(0, 2, 1, 3)

        attn = twinattn.attention(heads("q_proj.weight", 4), heads("k_proj.weight", 2), heads("v_proj.weight", 2),
                                  causal=True, q_offset=0, softcap=0.7, sinks=params["sinks"].astype(dtype), backend="numpy")
        return attn.transpose(0, 2, 1, 3).reshape(2, 7, -1) @ params["o_proj.weight"].astype(dtype).T

    want64 = forward(np.float64)
    assert_close(module(x), want64, tolerance(want64, forward(np.float32)), "softcap and sinks")
    with pytest.raises(ValueError, match="causal: a sliding_window=3"):
        twinattn.nn.Attention(HIDDEN, 4, 2, HEAD_DIM, sliding_window=3, backend=backend)(x, causal=False)
    assert re.search("sinks=True", repr(module))
