"""float16 and bfloat16 (ml_dtypes.bfloat16): every backend and instruction set, every feature.

What is asserted, for q, k, v all float16 or all bfloat16 (the inputs rounded from random or small
hand-made float32 values):
- out has q's dtype and lse is float32, and both are within tolerance of the float64 reference
  computed from the same rounded inputs (helpers.assert_half_within says where the tolerance
  comes from: the float32 kernel's error, half an ulp of out in its dtype, and on the bfloat16
  dot path of avx512bf16 the rounding of P to bfloat16);
- on every path but that one (the convert path), out is exactly the float32 kernel's result on
  the converted inputs rounded to q's dtype, and lse is exactly its lse (docs/kernels.md);
- accuracy against torch: the largest error of twinattn in a dtype is at most twice that of
  torch.nn.functional.scaled_dot_product_attention in the same dtype on the same inputs (random,
  large logits, long rows), on every backend and instruction set;
- bad dtypes raise the same TypeError, with the fix in the message, on every backend;
- scaled_dot_product_attention passes them through; RoPE rotates them in float32.
KVCache and nn.Attention in float16 / bfloat16: tests/test_cache.py and tests/test_nn.py; the
ports' bits and messages: tests/test_port_parity.py; NaN and inf: tests/test_nonfinite.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from conftest import import_optional
from helpers import (
    BFLOAT16, DOT_PATHS, FLOAT16, HALF_DTYPES, as32, as64, assert_half_within, assert_lse_within, forced_isa, max_abs,
    rand, reference32, reference64,
)
from helpers import backend_isa  # noqa: F401  (the fixture: numpy, and each port per instruction set)
from twinattn.core.reference import round_to_dtype

DTYPE_IDS = {FLOAT16: "float16", BFLOAT16: "bfloat16"}
half_dtypes = pytest.mark.parametrize("dtype", HALF_DTYPES, ids=DTYPE_IDS.get)


# ---- problems: float32 values and keywords; the test rounds q, k, v (and a "dtype" mask) -------


def _small_asymmetric(rng: np.random.Generator) -> tuple[Any, ...]:
    """B=1, Hq=2, Hkv=1, Lq=3, Lk=5, D=4, Dv=3, every value distinct and exact in both dtypes
    (multiples of 1/16 below 8): equal keys or rows would hide a transposed or misrouted index."""
    q = (np.arange(24).reshape(1, 2, 3, 4) % 7 - 3.0) / 4 + np.arange(4) / 16
    k = (np.arange(20).reshape(1, 1, 5, 4)[..., ::-1] % 9 - 4.0) / 8 + np.arange(5)[:, None] / 16
    v = np.arange(15).reshape(1, 1, 5, 3) / 4 - np.array([1.0, 0.5, 2.0])
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), {"causal": True, "q_offset": 2}


def _shape(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int, **kwargs: Any) -> Callable[[np.random.Generator], tuple[Any, ...]]:
    def make(rng: np.random.Generator) -> tuple[Any, ...]:
        return rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv), dict(kwargs)
    return make


def _with(make: Callable[[np.random.Generator], tuple[Any, ...]], extra: Callable[[np.random.Generator, tuple[int, ...], tuple[int, ...]], dict[str, Any]]) -> Callable[[np.random.Generator], tuple[Any, ...]]:
    def made(rng: np.random.Generator) -> tuple[Any, ...]:
        q, k, v, kwargs = make(rng)
        kwargs.update(extra(rng, q.shape, k.shape))
        return q, k, v, kwargs
    return made


def _ragged(rng: np.random.Generator) -> tuple[Any, ...]:
    """Causal with explicit offsets and lengths; NaN in the padding (never read)."""
    q, k, v = rand(rng, 2, 8, 60, 40), rand(rng, 2, 2, 400, 40), rand(rng, 2, 2, 400, 24)
    k[1, :, 150:] = np.nan
    v[1, :, 150:] = np.nan
    return q, k, v, {"causal": True, "q_offset": np.array([340, 10]), "kv_lens": np.array([400, 150])}


def _bool_mask(rng: np.random.Generator, qs: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    return {"attn_mask": rng.random((qs[0], 1, qs[2], ks[2])) < 0.8}


def _float_mask(rng: np.random.Generator, qs: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    bias = rng.standard_normal((qs[1], qs[2], ks[2])).astype(np.float32)
    bias[:, :, 7:19] = -np.inf
    return {"attn_mask": bias}


def _dtype_mask(rng: np.random.Generator, qs: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    return {"attn_mask": rng.standard_normal((qs[2], ks[2])).astype(np.float32), "mask_in_dtype": True}


def _alibi(rng: np.random.Generator, qs: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    return {"alibi_slopes": rng.uniform(0.0, 0.2, (qs[0], qs[1])).astype(np.float32)}


def _sinks(rng: np.random.Generator, qs: tuple[int, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    return {"sinks": rng.uniform(-1.0, 4.0, qs[1]).astype(np.float32)}


PREFILL = _shape(1, 4, 2, 100, 300, 64, 48)  # 200 packed rows: several query tiles and key blocks
DECODE = _shape(2, 8, 2, 1, 2100, 64, 64, kv_lens=np.array([2100, 1500]))  # split-key, merged partials
CASES: dict[str, Callable[[np.random.Generator], tuple[Any, ...]]] = {
    "small-asymmetric": _small_asymmetric,
    "prefill": PREFILL,
    "prefill-causal": _shape(1, 4, 2, 100, 100, 64, 48, causal=True),
    "odd-dims": _shape(1, 3, 3, 55, 257, 17, 9),  # odd D: bfloat16 pairs padded
    "mqa": _shape(1, 6, 1, 50, 130, 32, 32, causal=True, q_offset=80),
    "decode": DECODE,
    "decode-direct": _shape(1, 8, 2, 3, 1500, 40, 24, causal=True),  # 12 rows, K read in place
    "decode-panels": _shape(1, 16, 2, 4, 1300, 40, 24, causal=True),  # 32 rows, K packed per block
    "ragged": _ragged,
    "mask-bool": _with(PREFILL, _bool_mask),
    "mask-float": _with(PREFILL, _float_mask),
    "mask-in-dtype": _with(PREFILL, _dtype_mask),
    "decode-mask-float": _with(DECODE, _float_mask),
    "window": _shape(1, 4, 2, 100, 300, 64, 48, window_size=(37, 5)),
    "sliding-causal": _shape(1, 4, 2, 100, 300, 64, 48, causal=True, window_size=(63, 0)),
    "decode-window": _shape(2, 8, 2, 1, 2100, 64, 64, causal=True, window_size=(300, 0)),
    "softcap": _shape(1, 4, 2, 100, 300, 64, 48, causal=True, scale=0.5, softcap=5.0),
    "alibi": _with(_shape(1, 4, 2, 100, 300, 64, 48, causal=True), _alibi),
    "sinks": _with(PREFILL, _sinks),
    "decode-sinks-alibi": _with(_with(DECODE, _sinks), _alibi),
}


@functools.lru_cache(maxsize=None)
def _problem(case: str, dtype: np.dtype) -> tuple[Any, ...]:
    """The rounded inputs of a case and its references, computed once for every backend and
    instruction set: (q, k, v, kwargs, want, want_lse, f32, f32_lse, weighted)."""
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v, kwargs = CASES[case](rng)
    if kwargs.pop("mask_in_dtype", False):
        kwargs["attn_mask"] = kwargs["attn_mask"].astype(dtype)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    want, want_lse = reference64(q, k, v, return_lse=True, **kwargs)
    f32, f32_lse = reference32(as32(q), as32(k), as32(v), return_lse=True, **{n: as32(x) for n, x in kwargs.items()})
    weighted = reference64(q, k, np.abs(as64(v)), **kwargs) if dtype == BFLOAT16 else None
    return q, k, v, kwargs, want, want_lse, f32, f32_lse, weighted


def _assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """The same values bit for bit (NaN matching NaN whatever its payload)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(got.astype(np.float64))
    np.testing.assert_array_equal(nan, np.isnan(want.astype(np.float64)))
    unsigned = np.uint16 if got.itemsize == 2 else np.uint32
    np.testing.assert_array_equal(np.where(nan, 0, got.view(unsigned)), np.where(nan, 0, want.view(unsigned)))


@half_dtypes
@pytest.mark.parametrize("case", CASES)
def test_against_float64_reference(backend_isa: tuple[str, str], case: str, dtype: np.dtype) -> None:
    port, isa = backend_isa
    q, k, v, kwargs, want, want_lse, f32, f32_lse, weighted = _problem(case, dtype)
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=port, **kwargs)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert_half_within(out, want, f32, max_abs(as64(v)), dtype, weighted if (isa, dtype) in DOT_PATHS else None)
    assert_lse_within(lse, want_lse, f32_lse)
    if port != "numpy" and (isa, dtype) not in DOT_PATHS:
        # the convert path: the float32 kernel on the exactly converted inputs, rounded once
        out32, lse32 = twinattn.attention(as32(q), as32(k), as32(v), return_lse=True, backend=port,
                                          **{n: as32(x) for n, x in kwargs.items()})
        _assert_bits_equal(out, round_to_dtype(out32, dtype))
        _assert_bits_equal(lse, lse32)


@pytest.mark.parametrize("wide_isa", ["avx512bf16", "amxbf16"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), FLOAT16, BFLOAT16], ids=str)
def test_avx512bf16_is_avx512_but_for_bfloat16_prefill(native_backend: str, dtype: np.dtype, wide_isa: str) -> None:
    """float32 and float16 on avx512bf16 and amxbf16 run exactly the avx512 kernels (the same
    bits); so does bfloat16 decode (the split-key path converts). bfloat16 prefill takes the dot
    path or the tiles there, checked against the reference by test_against_float64_reference."""
    cases = ("prefill", "decode", "mask-float", "odd-dims") if dtype != BFLOAT16 else ("decode", "decode-window", "decode-sinks-alibi")
    results: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for isa in ("avx512", wide_isa):
        with forced_isa(native_backend, isa):
            results[isa] = []
            for case in cases:
                q, k, v, kwargs = _problem(case, BFLOAT16)[:4]
                if dtype != BFLOAT16:
                    q, k, v = (a.astype(dtype) for a in (q, k, v))
                results[isa].append(twinattn.attention(q, k, v, return_lse=True, backend=native_backend, **kwargs))
    for (out_a, lse_a), (out_b, lse_b) in zip(results["avx512"], results[wide_isa]):
        _assert_bits_equal(out_a, out_b)
        _assert_bits_equal(lse_a, lse_b)


def test_amxbf16_runs_the_dot_path_where_d_is_not_a_multiple_of_32(native_backend: str) -> None:
    """The tiles cover D 32 at a time: any other D takes the dot path on amxbf16 (the same bits as
    avx512bf16's)."""
    rng = np.random.default_rng(17)
    q = rand(rng, 1, 8, 40, 48).astype(BFLOAT16)  # 40 rows x group 4 > q_tile_rows: the prefill path
    k, v = rand(rng, 1, 2, 300, 48).astype(BFLOAT16), rand(rng, 1, 2, 300, 40).astype(BFLOAT16)
    results = []
    for isa in ("avx512bf16", "amxbf16"):
        with forced_isa(native_backend, isa):
            results.append(twinattn.attention(q, k, v, causal=True, return_lse=True, backend=native_backend))
    _assert_bits_equal(results[0][0], results[1][0])
    _assert_bits_equal(results[0][1], results[1][1])


@half_dtypes
def test_strided_views_and_out(backend_isa: tuple[str, str], dtype: np.dtype) -> None:
    """q as a (B, L, H, D) array seen as (B, H, L, D), k and v slices of a longer cache, out a
    preallocated view (unit last stride: written in place; stride 2: through a temporary)."""
    port, isa = backend_isa
    rng = np.random.default_rng(21)
    q = rand(rng, 2, 70, 4, 32).astype(dtype).swapaxes(1, 2)
    cache_k, cache_v = rand(rng, 2, 2, 500, 32).astype(dtype), rand(rng, 2, 2, 500, 24).astype(dtype)
    k, v = cache_k[:, :, :333], cache_v[:, :, :333]
    kwargs: dict[str, Any] = {"causal": True, "kv_lens": np.array([333, 200]), "q_offset": np.array([263, 0])}
    want = reference64(q, k, v, **kwargs)
    f32 = reference32(as32(q), as32(k), as32(v), **kwargs)
    weighted = reference64(q, k, np.abs(as64(v)), **kwargs) if (isa, dtype) in DOT_PATHS else None
    in_place = np.full((2, 70, 4, 24), 7, dtype).swapaxes(1, 2)
    every_other = np.full((2, 4, 70, 48), 7, dtype)[..., ::2]
    for out in (in_place, every_other):
        result = twinattn.attention(q, k, v, out=out, backend=port, **kwargs)
        assert result is out
        assert_half_within(out, want, f32, max_abs(as64(v)), dtype, weighted)
    np.testing.assert_array_equal(every_other.base[..., 1::2].astype(np.float64), 7.0)  # the gaps untouched
    np.testing.assert_array_equal(in_place, every_other)
    if port != "numpy" and (isa, dtype) not in DOT_PATHS:
        _assert_bits_equal(np.ascontiguousarray(in_place), round_to_dtype(
            twinattn.attention(as32(q), as32(k), as32(v), backend=port, **kwargs), dtype))


@half_dtypes
def test_empty_rows_and_axes(backend_isa: tuple[str, str], dtype: np.dtype) -> None:
    port, _ = backend_isa
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, 2, 2, 3, 8).astype(dtype) for _ in range(3))
    out, lse = twinattn.attention(q, k, v, kv_lens=np.array([0, 3]), return_lse=True, backend=port)
    assert out.dtype == dtype and (out[0].astype(np.float32) == 0).all() and (lse[0] == -np.inf).all()
    assert np.isfinite(out[1].astype(np.float32)).all()
    empty = twinattn.attention(q[:, :, :0], k, v, backend=port)
    assert empty.shape == (2, 2, 0, 8) and empty.dtype == dtype


@half_dtypes
def test_float16_and_bfloat16_round_out_not_truncate(backend_isa: tuple[str, str], dtype: np.dtype) -> None:
    """One visible key per row: out is that key's value exactly. Two keys of equal score: the mean
    of two values whose midpoint needs one more bit: rounded to nearest, ties to even."""
    port, _ = backend_isa
    one = np.float32(1.0)
    bits = 11 if dtype == FLOAT16 else 8
    ulp = 2.0 ** (1 - bits)
    q = np.zeros((1, 1, 3, 2), np.float32)
    k = np.zeros((1, 1, 2, 2), np.float32)
    # values at 1, 1 + ulp, 1 + 2 ulp, ...: means of neighbours are ties, even mantissas win
    v = np.array([[1.0, 1 + ulp, 1 + 2 * ulp, 1 + 3 * ulp], [1 + ulp, 1 + 2 * ulp, 1 + 3 * ulp, 1 + 4 * ulp]], np.float32)[None, None]
    mask = np.array([[True, False], [True, True], [False, True]])
    out = twinattn.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), attn_mask=mask, backend=port)
    got = out[0, 0].astype(np.float64)
    np.testing.assert_array_equal(got[0], v[0, 0, 0])
    np.testing.assert_array_equal(got[2], v[0, 0, 1])
    # midpoints 1 + ulp/2 (-> 1), 1 + 3ulp/2 (-> 1 + 2ulp), 1 + 5ulp/2 (-> 1 + 2ulp), 1 + 7ulp/2 (-> 1 + 4ulp)
    np.testing.assert_array_equal(got[1], [one, 1 + 2 * ulp, 1 + 2 * ulp, 1 + 4 * ulp])


# ---- accuracy against torch in the same dtype ------------------------------------------------

# name: (B, Hq, Hkv, Lq, Lk, D, input scale, causal)
TORCH_CASES = {
    "random": (1, 8, 2, 128, 512, 64, 1.0, True),
    "large-logits": (1, 4, 2, 96, 384, 64, 4.0, False),  # scores of standard deviation 16
    "long-rows": (1, 4, 2, 64, 8192, 64, 1.0, False),  # 8192 keys per row, prefill
    "long-decode": (1, 8, 2, 1, 16384, 128, 1.0, False),  # one query, 16384 keys, split-key
}


@functools.lru_cache(maxsize=None)
def _torch_problem(case: str, dtype: np.dtype) -> tuple[Any, ...]:
    torch = import_optional("torch", "the accuracy comparison with torch's SDPA")
    b, hq, hkv, lq, lk, d, spread, causal = TORCH_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)) + 7)
    q, k, v = ((spread * rand(rng, b, h, n, d)).astype(dtype) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    kwargs: dict[str, Any] = {"causal": causal, "q_offset": 0} if causal else {}
    want = reference64(q, k, v, **kwargs)
    torch_dtype = {FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}[dtype]
    tq, tk, tv = (torch.from_numpy(as32(a)).to(torch_dtype) for a in (q, k, v))
    # torch's causal mask is top-left aligned: with q_offset=0 that is the same mask
    theirs = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    torch_err = float(np.max(np.abs(theirs.float().numpy().astype(np.float64) - want)))
    return q, k, v, kwargs, want, torch_err


@half_dtypes
@pytest.mark.parametrize("case", TORCH_CASES)
def test_error_at_most_twice_torchs(backend_isa: tuple[str, str], case: str, dtype: np.dtype) -> None:
    port, _ = backend_isa
    q, k, v, kwargs, want, torch_err = _torch_problem(case, dtype)
    out = twinattn.attention(q, k, v, backend=port, **kwargs)
    err = float(np.max(np.abs(out.astype(np.float64) - want)))
    assert torch_err > 0
    assert err <= 2 * torch_err, f"max error {err:.3g} > 2 x torch's {torch_err:.3g}"


# ---- bad dtypes: the same TypeError, with the fix, on every backend --------------------------

_Q = np.random.default_rng(0).standard_normal((2, 4, 5, 8)).astype(np.float32)
_K = np.random.default_rng(1).standard_normal((2, 2, 7, 8)).astype(np.float32)
_V = np.random.default_rng(2).standard_normal((2, 2, 7, 6)).astype(np.float32)
_B16 = ml_dtypes.bfloat16
BAD_DTYPES: list[tuple[str, dict[str, Any], str]] = [
    ("k-float32-for-bfloat16", {"q": _Q.astype(_B16), "k": _K, "v": _V.astype(_B16)},
     "k: expected dtype bfloat16 (q\'s dtype) or int8, got float32; convert with k.astype(ml_dtypes.bfloat16), or quantize both k and v with twinattn.quantize_kv"),
    ("v-bfloat16-for-float16", {"q": _Q.astype(np.float16), "k": _K.astype(np.float16), "v": _V.astype(_B16)},
     "v: expected dtype float16 (q's dtype), got bfloat16; convert with v.astype(np.float16)"),
    ("k-float16-for-float32", {"k": _K.astype(np.float16)},
     "k: expected dtype float32 (q\'s dtype) or int8, got float16; convert with k.astype(np.float32), or quantize both k and v with twinattn.quantize_kv"),
    ("q-int8", {"q": _Q.astype(np.int8)},
     "q: expected float32, float16 or bfloat16 (ml_dtypes.bfloat16), got int8; convert with q.astype(np.float32)"),
    ("q-float16-big-endian", {"q": _Q.astype(">f2"), "k": _K.astype(">f2"), "v": _V.astype(">f2")},
     "q: expected float32, float16 or bfloat16 (ml_dtypes.bfloat16), got >f2; convert with q.astype(np.float32)"),
    ("out-float32-for-bfloat16", {"q": _Q.astype(_B16), "k": _K.astype(_B16), "v": _V.astype(_B16),
                                  "out": np.empty((2, 4, 5, 6), np.float32)},
     "out: expected dtype bfloat16 (q's dtype), got float32"),
    ("mask-float64-for-float16", {"q": _Q.astype(np.float16), "k": _K.astype(np.float16), "v": _V.astype(np.float16),
                                  "attn_mask": np.zeros((5, 7))},
     "attn_mask: expected bool (True = may attend) or float32 or float16 (additive bias), got float64"),
    ("mask-bfloat16-for-float32", {"attn_mask": np.zeros((5, 7), _B16)},
     "attn_mask: expected bool (True = may attend) or float32 (additive bias), got bfloat16"),
    ("sinks-bfloat16", {"q": _Q.astype(_B16), "k": _K.astype(_B16), "v": _V.astype(_B16), "sinks": np.zeros(4, _B16)},
     "sinks: expected float32 of shape (Hq=4,), got bfloat16; convert with sinks.astype(np.float32)"),
]


@pytest.mark.parametrize("overrides, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_DTYPES])
def test_bad_dtypes_same_error_on_every_backend(overrides: dict[str, Any], message: str) -> None:
    args = {"q": _Q, "k": _K, "v": _V, **overrides}
    outcomes = set()
    for backend in twinattn.backends():
        kwargs = dict(args)
        with pytest.raises(TypeError) as info:
            twinattn.attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), backend=backend, **kwargs)
        outcomes.add(str(info.value))
    assert outcomes == {message}


@half_dtypes
def test_float64_still_numpy_only_and_half_runs_everywhere(dtype: np.dtype) -> None:
    for backend in twinattn.backends():
        out = twinattn.attention(_Q.astype(dtype), _K.astype(dtype), _V.astype(dtype), backend=backend)
        assert out.dtype == dtype
    with pytest.raises(TypeError, match="computes in float32 and does not cast silently"):
        twinattn.attention(_Q.astype(np.float64), _K.astype(np.float64), _V.astype(np.float64), backend="cpp" if "cpp" in twinattn.backends() else "rust")


@half_dtypes
def test_sdpa_takes_half_inputs(backend: str, dtype: np.dtype) -> None:
    """twinattn.scaled_dot_product_attention: torch's signature, the same dtypes as attention."""
    rng = np.random.default_rng(8)
    q, k, v = (rand(rng, 2, 3, 4, 6, 16).astype(dtype) for _ in range(3))  # rank 5: flattened batch
    mask = rng.standard_normal((6, 6)).astype(np.float32)
    got = twinattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    want = twinattn.attention(q.reshape(6, 4, 6, 16), k.reshape(6, 4, 6, 16), v.reshape(6, 4, 6, 16), attn_mask=mask, backend=backend)
    assert got.dtype == dtype and got.shape == (2, 3, 4, 6, 16)
    _assert_bits_equal(got.reshape(want.shape), want)


# ---- RoPE in half precision ----------------------------------------------------------------


@half_dtypes
def test_rope_on_half_inputs_rounds_the_float32_rotation_once(dtype: np.dtype) -> None:
    rope = twinattn.RotaryEmbedding(16)
    rng = np.random.default_rng(3)
    x = rand(rng, 2, 3, 5, 16).astype(dtype)
    positions = np.arange(100, 105)
    got = rope.apply(x, positions)
    assert got.dtype == dtype
    _assert_bits_equal(got, rope.apply(x.astype(np.float32), positions).astype(dtype))
