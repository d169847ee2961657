"""attention_varlen and attention_paged of both native modules, called directly.

Every test calls twinattn._cpp and twinattn._rust with the same arguments and asserts the same
result bit for bit (or the same exception and message), and checks each sequence against the
float64 NumPy reference on its own gathered, contiguous K/V with the float32 tolerance of
helpers.py. docs/native_api.md is the contract (attention_varlen, attention_paged).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from test_port_parity import modules  # noqa: F401  (the fixture: both native modules, or skip)
from helpers import (
    as32,
    assert_close_to_reference,
    assert_half_close_to_reference,
    assert_half_within,
    assert_lse_close,
    assert_lse_close_half,
    max_abs,
    reference32,
    reference64,
)

PORTS = ("cpp", "rust")
BF16 = ml_dtypes.bfloat16


def _cu(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _packed(rng: np.random.Generator, lq: list[int], lk: list[int], hq: int, hkv: int, d: int, dv: int,
            dtype: Any = np.float32) -> tuple[np.ndarray, ...]:
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_q, cu_seqlens_k."""
    q = rng.standard_normal((sum(lq), hq, d)).astype(dtype)
    k = rng.standard_normal((sum(lk), hkv, d)).astype(dtype)
    v = rng.standard_normal((sum(lk), hkv, dv)).astype(dtype)
    return q, k, v, _cu(lq), _cu(lk)


def _paged(rng: np.random.Generator, k: np.ndarray, v: np.ndarray, cu_k: np.ndarray, block_size: int,
           interleaved: bool = False, spare_blocks: int = 3) -> tuple[np.ndarray, ...]:
    """k, v of each sequence copied into shuffled pages; every unused slot and page NaN (-128 for
    int8), unused block table entries -1. interleaved: K and V pages alternate in one buffer."""
    batch = len(cu_k) - 1
    seq_lens = np.diff(cu_k)
    used = [-(-int(n) // block_size) for n in seq_lens]
    num_blocks = sum(used) + spare_blocks
    max_blocks = max(used + [0]) + 2
    fill = -128 if k.dtype == np.int8 else np.nan
    hkv, d, dv = k.shape[1], k.shape[2], v.shape[2]
    if interleaved:
        width = max(d, dv)
        pages = np.full((num_blocks, 2, block_size, hkv, width), fill, dtype=k.dtype)
        k_cache, v_cache = pages[:, 0, :, :, :d], pages[:, 1, :, :, :dv]
    else:
        k_cache = np.full((num_blocks, block_size, hkv, d), fill, dtype=k.dtype)
        v_cache = np.full((num_blocks, block_size, hkv, dv), fill, dtype=v.dtype)
    order = rng.permutation(num_blocks)
    table = np.full((batch, max_blocks), -1, dtype=np.int32)
    taken = 0
    for b in range(batch):
        table[b, : used[b]] = order[taken : taken + used[b]]
        taken += used[b]
        for j in range(int(seq_lens[b])):
            k_cache[table[b, j // block_size], j % block_size] = k[cu_k[b] + j]
            v_cache[table[b, j // block_size], j % block_size] = v[cu_k[b] + j]
    return k_cache, v_cache, table, seq_lens.astype(np.int64)


def _paged_scales(scale: np.ndarray, table: np.ndarray, seq_lens: np.ndarray, cu_k: np.ndarray, num_blocks: int,
                  block_size: int) -> np.ndarray:
    """A (total_k, Hkv) scale laid out as the pages are: (num_blocks, block_size, Hkv), NaN elsewhere."""
    paged = np.full((num_blocks, block_size, scale.shape[1]), np.nan, np.float32)
    for b in range(len(seq_lens)):
        for j in range(int(seq_lens[b])):
            paged[table[b, j // block_size], j % block_size] = scale[cu_k[b] + j]
    return paged


def _both(modules: dict[str, ModuleType], entry: str, q: np.ndarray, args: tuple[Any, ...], dv: int,
          lse: bool = True, **keywords: Any) -> tuple[np.ndarray, np.ndarray]:
    """Runs `entry` on both ports; asserts their out and lse are bit-identical; returns them."""
    results = []
    for port in PORTS:
        out = np.full((q.shape[0], q.shape[1], dv), np.nan, dtype=q.dtype)
        lse_out = np.full((q.shape[1], q.shape[0]), np.nan, np.float32) if lse else None
        getattr(modules[port], entry)(q, *args[:2], out, *args[2:], lse=lse_out, **keywords)
        results.append((out, lse_out))
    (out_cpp, lse_cpp), (out_rust, lse_rust) = results
    np.testing.assert_array_equal(out_cpp.view(np.uint8), out_rust.view(np.uint8), err_msg="out differs between ports")
    if lse:
        np.testing.assert_array_equal(lse_cpp, lse_rust, err_msg="lse differs between ports")
    return out_cpp, lse_cpp


def _reference_keywords(keywords: dict[str, Any], b: int) -> dict[str, Any]:
    """The native keywords of sequence b as twinattn.attention's."""
    ref: dict[str, Any] = {"scale": keywords["scale"], "causal": bool(keywords.get("causal"))}
    left, right = keywords.get("window_left"), keywords.get("window_right")
    if left is not None or right is not None:
        ref["window_size"] = (-1 if left is None else left, -1 if right is None else right)
    if keywords.get("softcap") is not None:
        ref["softcap"] = keywords["softcap"]
    if keywords.get("alibi_slopes") is not None:
        ref["alibi_slopes"] = np.ascontiguousarray(keywords["alibi_slopes"][b])
    if keywords.get("sinks") is not None:
        ref["sinks"] = keywords["sinks"]
    return ref


def _check_sequences(out: np.ndarray, lse: np.ndarray | None, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     cu_q: np.ndarray, cu_k: np.ndarray, keywords: dict[str, Any],
                     scales: tuple[np.ndarray, np.ndarray] | None = None, isa: str = "-") -> None:
    """Every sequence against the reference on its own rows and keys, (H, L, D) views; isa: the
    instruction set of a float16 / bfloat16 call (its tolerance on the bfloat16 dot path)."""
    half = q.dtype != np.float32
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        ref = _reference_keywords(keywords, b)
        qb, kb, vb = (np.ascontiguousarray(x.swapaxes(0, 1)) for x in (q[rows], k[keys], v[keys]))
        got = np.ascontiguousarray(out[rows].swapaxes(0, 1))
        if scales is not None:  # int8: against the attention over the dequantized K/V (float32)
            kb, vb = (np.ascontiguousarray((x[keys].astype(np.float32) * s[keys][:, :, None]).swapaxes(0, 1))
                      for x, s in ((k, scales[0]), (v, scales[1])))
            qb = as32(qb)
            if half:
                assert_half_within(got, np.asarray(reference64(qb, kb, vb, **ref)),
                                   np.asarray(reference32(qb, kb, vb, **ref)), max_abs(vb), q.dtype)
            else:
                assert_close_to_reference(got, qb, kb, vb, **ref)
            if lse is not None:
                assert_lse_close(np.ascontiguousarray(lse[:, rows]), qb, kb, vb, **ref)
            continue
        if half:
            assert_half_close_to_reference(got, qb, kb, vb, isa=isa, **ref)
        else:
            assert_close_to_reference(got, qb, kb, vb, **ref)
        if lse is not None:
            check_lse = assert_lse_close_half if half else assert_lse_close
            check_lse(np.ascontiguousarray(lse[:, rows]), qb, kb, vb, **ref)


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_left": 5},
    "window_both_sides": {"window_left": 3, "window_right": 2},
    "softcap": {"causal": True, "softcap": 1.5},
    "alibi": {"causal": True, "alibi": True},
    "sinks": {"causal": True, "sinks": True},
}

# Query rows and keys per sequence: an empty sequence, decode rows, a prefill longer than a tile
# (48 packed rows), a split-key decode (more than 1024 keys), keys without queries.
LQ = [3, 0, 70, 1, 2, 0]
LK = [5, 4, 90, 1500, 7, 3]


def _keywords(name: str, hq: int, batch: int) -> dict[str, Any]:
    keywords = {key: value for key, value in FEATURES[name].items() if key not in ("alibi", "sinks")}
    keywords["scale"] = 0.3
    keywords["num_threads"] = 2
    if FEATURES[name].get("alibi"):
        keywords["alibi_slopes"] = np.linspace(0.05, 0.4, batch * hq, dtype=np.float32).reshape(batch, hq)
    if FEATURES[name].get("sinks"):
        keywords["sinks"] = np.linspace(-1.0, 1.5, hq, dtype=np.float32)
    return keywords


@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_matches_reference(modules: dict[str, ModuleType], feature: str) -> None:
    rng = np.random.default_rng(1)
    hq, hkv, d, dv = 4, 2, 16, 12
    q, k, v, cu_q, cu_k = _packed(rng, LQ, LK, hq, hkv, d, dv)
    keywords = _keywords(feature, hq, len(LQ))
    out, lse = _both(modules, "attention_varlen", q, (k, v, cu_q, cu_k), dv, **keywords)
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, keywords)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "alibi", "sinks", "softcap"])
def test_paged_equals_varlen(modules: dict[str, ModuleType], block_size: int, feature: str) -> None:
    """The paged call reads the same keys through the block table: bit-identical to varlen on
    the contiguous keys (one kernel), whatever the pages' order, size or unused contents."""
    rng = np.random.default_rng(block_size)
    hq, hkv, d, dv = 6, 2, 8, 16
    lq, lk = [1, 5, 60, 1, 0], [9, 5, 64, 1100, 2]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq, hkv, d, dv)
    keywords = _keywords(feature, hq, len(lq))
    k_cache, v_cache, table, seq_lens = _paged(rng, k, v, cu_k, block_size)
    paged, paged_lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv, **keywords)
    packed, packed_lse = _both(modules, "attention_varlen", q, (k, v, cu_q, cu_k), dv, **keywords)
    np.testing.assert_array_equal(paged, packed)
    np.testing.assert_array_equal(paged_lse, packed_lse)
    _check_sequences(paged, paged_lse, q, k, v, cu_q, cu_k, keywords)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [3, 16])
def test_paged_half_dtypes(modules: dict[str, ModuleType], dtype: Any, block_size: int) -> None:
    rng = np.random.default_rng(7)
    hq, hkv, d, dv = 4, 1, 32, 16
    lq, lk = [1, 50, 2], [40, 80, 1030]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq, hkv, d, dv, dtype)
    keywords = {"scale": 0.2, "causal": True, "num_threads": 2}
    k_cache, v_cache, table, seq_lens = _paged(rng, k, v, cu_k, block_size, interleaved=True)
    out, lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv, **keywords)
    assert out.dtype == dtype
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, keywords, isa=modules["cpp"].build_info()["isa"])


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
def test_int8_paged_and_varlen(modules: dict[str, ModuleType], q_dtype: Any) -> None:
    """int8 K/V with per-token scales, laid out as the pages (paged) or the packed rows (varlen)."""
    rng = np.random.default_rng(3)
    hq, hkv, d, dv, block_size = 4, 2, 16, 8, 5
    lq, lk = [1, 49, 3], [12, 60, 1050]
    q = rng.standard_normal((sum(lq), hq, d)).astype(q_dtype)
    k = rng.integers(-127, 128, (sum(lk), hkv, d)).astype(np.int8)
    v = rng.integers(-127, 128, (sum(lk), hkv, dv)).astype(np.int8)
    k_scale = rng.uniform(0.001, 0.02, (sum(lk), hkv)).astype(np.float32)
    v_scale = rng.uniform(0.001, 0.02, (sum(lk), hkv)).astype(np.float32)
    cu_q, cu_k = _cu(lq), _cu(lk)
    keywords = {"scale": 0.25, "causal": True, "num_threads": 2}
    packed, packed_lse = _both(modules, "attention_varlen", q, (k, v, cu_q, cu_k), dv, k_scale=k_scale,
                               v_scale=v_scale, **keywords)
    k_cache, v_cache, table, seq_lens = _paged(rng, k, v, cu_k, block_size)
    paged_scales = [_paged_scales(s, table, seq_lens, cu_k, k_cache.shape[0], block_size) for s in (k_scale, v_scale)]
    paged, paged_lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv,
                             k_scale=paged_scales[0], v_scale=paged_scales[1], **keywords)
    np.testing.assert_array_equal(paged.view(np.uint8), packed.view(np.uint8))
    np.testing.assert_array_equal(paged_lse, packed_lse)
    _check_sequences(paged, paged_lse, q, k, v, cu_q, cu_k, keywords, scales=(k_scale, v_scale))


def test_mixed_decode_and_prefill_chunks(modules: dict[str, ModuleType]) -> None:
    """One call with decode rows and prefill chunks: each sequence's rows are its last positions."""
    rng = np.random.default_rng(5)
    hq, hkv, d, dv = 8, 2, 16, 16
    lq, lk = [1, 17, 1, 64, 1], [33, 17, 300, 100, 2]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq, hkv, d, dv)
    k_cache, v_cache, table, seq_lens = _paged(rng, k, v, cu_k, 16)
    keywords = {"scale": 0.25, "causal": True, "num_threads": 2}
    out, lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv, **keywords)
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, keywords)
    # The result does not depend on the thread count.
    for port in PORTS:
        single = np.zeros_like(out)
        getattr(modules[port], "attention_paged")(q, k_cache, v_cache, single, table, seq_lens, cu_q,
                                                  **{**keywords, "num_threads": 1})
        np.testing.assert_array_equal(single, out)


def test_strided_views_are_read_in_place(modules: dict[str, ModuleType]) -> None:
    """q, out and lse as strided views; K and V pages interleaved in one buffer."""
    rng = np.random.default_rng(9)
    hq, hkv, d, dv = 4, 2, 8, 8
    lq, lk = [2, 55], [6, 70]
    q_wide, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq, hkv, 2 * d, dv)
    q = q_wide[:, :, ::1][:, :, :d]
    k = np.ascontiguousarray(k[:, :, :d])
    k_cache, v_cache, table, seq_lens = _paged(rng, k, v, cu_k, 4, interleaved=True)
    table_view = np.asfortranarray(table)
    for port in PORTS:
        out_buffer = np.zeros((hq, q.shape[0], dv), np.float32)
        lse_buffer = np.zeros((q.shape[0], hq), np.float32)
        out, lse = out_buffer.swapaxes(0, 1), lse_buffer.T
        getattr(modules[port], "attention_paged")(q, k_cache, v_cache, out, table_view, seq_lens, cu_q,
                                                  scale=0.3, causal=True, lse=lse)
        _check_sequences(out, lse, q, k, v, cu_q, cu_k, {"scale": 0.3, "causal": True})


def _error_cases() -> dict[str, tuple[str, dict[str, Any], type, str]]:
    """name -> (entry, overrides, exception, message)."""
    return {
        "cu_seqlens_q_start": ("attention_varlen", {"cu_seqlens_q": np.array([1, 3, 4], np.int64)}, ValueError,
                               "cu_seqlens_q: expected cu_seqlens_q[0]=0, got 1"),
        "cu_seqlens_q_decreasing": ("attention_varlen", {"cu_seqlens_q": np.array([0, 3, 2, 4], np.int64),
                                                         "cu_seqlens_k": np.array([0, 2, 4, 6], np.int64)},
                                    ValueError, "cu_seqlens_q: expected non-decreasing values, got "
                                    "cu_seqlens_q[2]=2 after cu_seqlens_q[1]=3"),
        "cu_seqlens_q_total": ("attention_varlen", {"cu_seqlens_q": np.array([0, 1, 3], np.int64)}, ValueError,
                               "cu_seqlens_q: expected cu_seqlens_q[2]=total_q=4, got 3"),
        "cu_seqlens_k_length": ("attention_varlen", {"cu_seqlens_k": np.array([0, 6], np.int64)}, ValueError,
                                "cu_seqlens_k: expected shape (B + 1=3,), got (2,)"),
        "cu_seqlens_q_empty": ("attention_varlen", {"cu_seqlens_q": np.zeros(0, np.int64)}, ValueError,
                               "cu_seqlens_q: expected shape (B + 1,) with B >= 0, got (0,)"),
        "cu_seqlens_int32": ("attention_varlen", {"cu_seqlens_q": np.array([0, 3, 4], np.int32)}, TypeError,
                             "cu_seqlens_q: expected dtype int64, got int32"),
        "varlen_k_shape": ("attention_varlen", {"k": np.zeros((6, 2, 5), np.float32)}, ValueError,
                           "k: expected shape (total_k, Hkv, D=8), got (6, 2, 5)"),
        "varlen_lse_shape": ("attention_varlen", {"lse": np.zeros((4, 3), np.float32)}, ValueError,
                             "lse: expected shape (Hq=4, total_q=4), got (4, 3)"),
        "varlen_scale_shape": ("attention_varlen", {"k": np.zeros((6, 2, 8), np.int8), "v": np.zeros((6, 2, 8), np.int8),
                                                    "k_scale": np.ones((6, 1), np.float32),
                                                    "v_scale": np.ones((6, 2), np.float32)},
                               ValueError, "k_scale: expected shape (total_k=6, Hkv=2), got (6, 1)"),
        "varlen_scale_missing": ("attention_varlen", {"k": np.zeros((6, 2, 8), np.int8),
                                                      "v": np.zeros((6, 2, 8), np.int8)}, ValueError,
                                 "k_scale: required with int8 k and v (float32, shape (total_k, Hkv)), got None"),
        "varlen_alibi_shape": ("attention_varlen", {"alibi_slopes": np.ones((3, 4), np.float32)}, ValueError,
                               "alibi_slopes: expected shape (B=2, Hq=4), got (3, 4)"),
        "varlen_out_overlaps_q": ("attention_varlen", {"out": "q"}, ValueError,
                                  "out: expected memory disjoint from q, got arrays that overlap"),
        "block_id_out_of_range": ("attention_paged", {"block_table": np.array([[0, 9], [1, 2]], np.int32)},
                                  ValueError, "block_table: expected block ids in [0, num_blocks=4) for the blocks "
                                  "sequence b uses, got block_table[0, 1]=9"),
        "block_id_negative": ("attention_paged", {"block_table": np.array([[0, 3], [-1, 2]], np.int32)},
                              ValueError, "block_table: expected block ids in [0, num_blocks=4) for the blocks "
                              "sequence b uses, got block_table[1, 0]=-1"),
        "seq_lens_too_long": ("attention_paged", {"seq_lens": np.array([5, 7], np.int64)}, ValueError,
                              "seq_lens: expected values in [0, max_blocks * block_size=6], got seq_lens[1]=7"),
        "seq_lens_length": ("attention_paged", {"seq_lens": np.array([5], np.int64)}, ValueError,
                            "seq_lens: expected shape (B=2,), got (1,)"),
        "too_many_query_rows": ("attention_paged", {"seq_lens": np.array([5, 0], np.int64)}, ValueError,
                                "cu_seqlens_q: expected at most seq_lens[b] query rows in sequence b, got 1 rows "
                                "in sequence 1 (seq_lens[1]=0)"),
        "block_table_dtype": ("attention_paged", {"block_table": np.array([[0, 3], [1, 2]], np.int64)}, TypeError,
                              "block_table: expected dtype int32, got int64"),
        "block_table_rank": ("attention_paged", {"block_table": np.array([0, 3], np.int32)}, ValueError,
                             "block_table: expected 2 dimensions (B, max_blocks), got shape (2,)"),
        "block_size_zero": ("attention_paged", {"k_cache": np.zeros((4, 0, 2, 8), np.float32),
                                                "v_cache": np.zeros((4, 0, 2, 8), np.float32)}, ValueError,
                            "k_cache: expected block_size >= 1, got shape (4, 0, 2, 8)"),
        "v_cache_shape": ("attention_paged", {"v_cache": np.zeros((4, 2, 2, 8), np.float32)}, ValueError,
                          "v_cache: expected shape (num_blocks=4, block_size=3, Hkv=2, Dv), got (4, 2, 2, 8)"),
        "paged_gqa": ("attention_paged", {"k_cache": np.zeros((4, 3, 3, 8), np.float32),
                                          "v_cache": np.zeros((4, 3, 3, 8), np.float32)}, ValueError,
                      "k_cache: expected Hkv dividing Hq=4 (query head h reads KV head h // (Hq // Hkv)), got Hkv=3"),
        "paged_scale_shape": ("attention_paged", {"k_cache": np.zeros((4, 3, 2, 8), np.int8),
                                                  "v_cache": np.zeros((4, 3, 2, 8), np.int8),
                                                  "k_scale": np.ones((4, 3, 2), np.float32),
                                                  "v_scale": np.ones((4, 2, 2), np.float32)}, ValueError,
                              "v_scale: expected shape (num_blocks=4, block_size=3, Hkv=2), got (4, 2, 2)"),
        "paged_window": ("attention_paged", {"window_left": -2}, ValueError,
                         "window_left: expected an int >= -1 (-1: unbounded), got -2"),
        "paged_out_overlaps_block_table": ("attention_paged", {"out": "block_table"}, ValueError,
                                           "out: expected memory disjoint from block_table, got arrays that overlap"),
    }


@pytest.mark.parametrize("case", list(_error_cases()))
def test_bad_input_raises_the_same_in_both_ports(modules: dict[str, ModuleType], case: str) -> None:
    entry, overrides, exception, message = _error_cases()[case]
    q = np.zeros((4, 4, 8), np.float32)  # two sequences: rows 0:3 and 3:4
    base: dict[str, Any] = {"q": q, "out": np.zeros((4, 4, 8), np.float32), "cu_seqlens_q": np.array([0, 3, 4], np.int64)}
    if entry == "attention_varlen":
        base.update(k=np.zeros((6, 2, 8), np.float32), v=np.zeros((6, 2, 8), np.float32),
                    cu_seqlens_k=np.array([0, 4, 6], np.int64))
        order = ["q", "k", "v", "out", "cu_seqlens_q", "cu_seqlens_k"]
    else:
        base.update(k_cache=np.zeros((4, 3, 2, 8), np.float32), v_cache=np.zeros((4, 3, 2, 8), np.float32),
                    block_table=np.array([[0, 3], [1, 2]], np.int32), seq_lens=np.array([5, 1], np.int64))
        order = ["q", "k_cache", "v_cache", "out", "block_table", "seq_lens", "cu_seqlens_q"]
    args = {**base, **overrides}
    if isinstance(args["out"], str) and args["out"] == "q":  # out aliasing an input: q itself,
        args["out"] = args["q"]
    elif isinstance(args["out"], str):  # or the block table inside out's memory
        buffer = np.zeros(4 * 4 * 8, np.float32)
        args["out"] = buffer.reshape(4, 4, 8)
        args["block_table"] = buffer[-4:].view(np.int32).reshape(2, 2)
        args["block_table"][...] = base["block_table"]
    keywords = {name: value for name, value in args.items() if name not in order}
    errors = []
    for port in PORTS:
        with pytest.raises(exception) as raised:
            getattr(modules[port], entry)(*(args[name] for name in order), scale=0.5, **keywords)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] == message


def _shared_pages(rng: np.random.Generator, groups: list[list[int]], shared_blocks: list[int], block_size: int,
                  hkv: int, d: int, dv: int, dtype: Any = np.float32) -> tuple[np.ndarray, ...]:
    """Pages where the sequences of each group have the same first shared_blocks[g] block ids (a
    common prefix, read from the same memory); every other block is the sequence's own, its
    unused slots NaN. Returns k_cache, v_cache, block_table, seq_lens."""
    seq_lens = [n for group in groups for n in group]
    own = [-(-n // block_size) - shared for group, shared in zip(groups, shared_blocks) for n in group]
    num_blocks = sum(shared_blocks) + sum(own) + 2
    k_cache = np.full((num_blocks, block_size, hkv, d), np.nan, dtype=dtype)
    v_cache = np.full((num_blocks, block_size, hkv, dv), np.nan, dtype=dtype)
    order = list(rng.permutation(num_blocks))
    table = np.full((len(seq_lens), max(-(-n // block_size) for n in seq_lens) + 1), -1, np.int32)
    b = 0
    for group, shared in zip(groups, shared_blocks):
        prefix = [order.pop() for _ in range(shared)]
        for block in prefix:  # whole blocks: the longer sequences use their tail slots too
            k_cache[block] = rng.standard_normal((block_size, hkv, d)).astype(dtype)
            v_cache[block] = rng.standard_normal((block_size, hkv, dv)).astype(dtype)
        for n in group:
            blocks = prefix + [order.pop() for _ in range(-(-n // block_size) - shared)]
            table[b, : len(blocks)] = blocks
            for j in range(shared * block_size, n):
                k_cache[blocks[j // block_size], j % block_size] = rng.standard_normal((hkv, d)).astype(dtype)
                v_cache[blocks[j // block_size], j % block_size] = rng.standard_normal((hkv, dv)).astype(dtype)
            b += 1
    return k_cache, v_cache, table, np.array(seq_lens, np.int64)


def _gathered(cache: np.ndarray, table: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence's keys (or values) read through the block table, packed: (total_k, H, D), cu."""
    block_size = cache.shape[1]
    rows = [cache[table[b, j // block_size], j % block_size] for b in range(len(seq_lens)) for j in range(seq_lens[b])]
    return np.stack(rows), _cu(list(seq_lens))


# name -> (groups of seq_lens, shared blocks per group, block_size, query rows per sequence, keywords)
CASCADES: dict[str, tuple[list[list[int]], list[int], int, list[int], dict[str, Any]]] = {
    "decode_whole_blocks": ([[261, 256, 296]], [16], 16, [1, 1, 1], {}),
    "partial_block": ([[300, 303, 310, 340]], [19], 16, [1, 1, 1, 1], {}),
    "several_groups": ([[400, 420], [700, 702, 800], [50]], [133, 233, 0], 3, [1, 1, 1, 1, 1, 1], {}),
    "prefix_in_chunks": ([[2500, 2600]], [150], 16, [1, 1], {}),
    "chunked_rows": ([[520, 530, 600]], [32], 16, [3, 12, 1], {}),
    "too_many_rows_falls_back": ([[520, 600]], [32], 16, [1, 20], {}),
    "sinks_softcap": ([[300, 310, 330]], [18], 16, [1, 2, 1], {"sinks": True, "softcap": 2.0}),
    "window_falls_back": ([[300, 310]], [18], 16, [1, 1], {"window_left": 100}),
    "not_causal": ([[300, 310]], [18], 16, [2, 1], {"causal": False}),
}


@pytest.mark.parametrize("case", CASCADES)
def test_cascade_shared_prefixes(modules: dict[str, ModuleType], case: str) -> None:
    """Sequences whose block tables start with the same block ids (read once for all their rows
    and merged with each sequence's own keys, or the plain path where a row would not see the
    whole prefix): both ports bit-identical, every sequence against the reference on its own
    gathered keys."""
    groups, shared_blocks, block_size, rows, extra = CASCADES[case]
    rng = np.random.default_rng(len(case))
    hq, hkv, d, dv = 8, 2, 16, 8
    k_cache, v_cache, table, seq_lens = _shared_pages(rng, groups, shared_blocks, block_size, hkv, d, dv)
    cu_q = _cu(rows)
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(np.float32)
    keywords: dict[str, Any] = {"scale": 0.25, "causal": extra.get("causal", True), "num_threads": 2}
    keywords.update({name: value for name, value in extra.items() if name not in ("sinks", "causal")})
    if extra.get("sinks"):
        keywords["sinks"] = np.linspace(-0.5, 1.0, hq, dtype=np.float32)
    out, lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv, **keywords)
    k, cu_k = _gathered(k_cache, table, seq_lens)
    v, _ = _gathered(v_cache, table, seq_lens)
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, keywords)


def test_cascade_bfloat16(modules: dict[str, ModuleType]) -> None:
    rng = np.random.default_rng(21)
    hq, hkv, d, dv = 4, 1, 32, 16
    k_cache, v_cache, table, seq_lens = _shared_pages(rng, [[700, 720, 760]], [43], 16, hkv, d, dv, BF16)
    cu_q = _cu([1, 4, 1])
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(BF16)
    keywords = {"scale": 0.2, "causal": True, "num_threads": 2}
    out, lse = _both(modules, "attention_paged", q, (k_cache, v_cache, table, seq_lens, cu_q), dv, **keywords)
    k, cu_k = _gathered(k_cache, table, seq_lens)
    v, _ = _gathered(v_cache, table, seq_lens)
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, keywords, isa=modules["cpp"].build_info()["isa"])
