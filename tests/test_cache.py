"""KVCache: per-sequence offsets, views not copies, overflow leaves it unchanged, crop / reset /
reorder, the seeds' byte formula, and the kernel reading the cache in place on every backend."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from helpers import (
    BFLOAT16, FLOAT16, HALF_DTYPES, assert_close_to_reference, assert_half_close_to_reference, rand,
    round_bits_rne,
)

DTYPE_IDS = {FLOAT16: "float16", BFLOAT16: "bfloat16"}
half_dtypes = pytest.mark.parametrize("dtype", HALF_DTYPES, ids=DTYPE_IDS.get)

MiB, GiB = 2**20, 2**30


def test_seed_worked_figures() -> None:
    assert twinattn.kv_cache_bytes(32, 1, 8, head_dim=128, tokens=4096, bytes_per_entry=2) == 512 * MiB
    assert twinattn.kv_cache_bytes(32, 1, 32, head_dim=128, tokens=4096, bytes_per_entry=2) == 2 * GiB
    # Doubling both cache length and batch quadruples the storage (the seeds' check-yourself).
    assert twinattn.kv_cache_bytes(32, 2, 8, head_dim=128, tokens=8192, bytes_per_entry=2) == 4 * 512 * MiB


def test_nbytes_is_the_formula() -> None:
    cache = twinattn.KVCache(num_layers=3, batch_size=2, num_kv_heads=4, head_dim=16, max_seq_len=40)
    assert cache.nbytes == 2 * 3 * 2 * 4 * 40 * 16 * 4
    assert cache.nbytes == twinattn.kv_cache_bytes(3, 2, 4, head_dim=16, tokens=40, bytes_per_entry=4)
    wide = twinattn.KVCache(1, 1, 2, 8, 10, dtype=np.float64)  # head_dim 8, max_seq_len 10
    assert wide.nbytes == twinattn.kv_cache_bytes(1, 1, 2, head_dim=8, tokens=10, bytes_per_entry=8)


def test_kv_cache_bytes_old_positional_order_is_deprecated_and_still_counts() -> None:
    # The former order (layers, batch, kv_heads, tokens, head_dim, bytes_per_entry), all positional.
    # Distinct primes: an argument dropped, repeated or left at its default would change the
    # bytes (a swap of tokens and head_dim cannot, the product being the same either way).
    expected = 2 * 2 * 3 * 5 * 7 * 11 * 13
    with pytest.warns(DeprecationWarning, match=r"name them, in KVCache's order"):
        old = twinattn.kv_cache_bytes(2, 3, 5, 7, 11, 13)
    assert old == expected
    assert twinattn.kv_cache_bytes(2, 3, 5, head_dim=11, tokens=7, bytes_per_entry=13) == expected
    # Old order with the trailing arguments named: tokens is the 4th positional one.
    with pytest.warns(DeprecationWarning):
        assert twinattn.kv_cache_bytes(2, 3, 5, 7, head_dim=11, bytes_per_entry=13) == expected
    # The old order's tokens check still names tokens.
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"tokens: expected a non-negative int, got -1"):
        twinattn.kv_cache_bytes(1, 1, 1, -1, 1, 2)


def test_kv_cache_bytes_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match=r"tokens: expected a non-negative int, got -1"):
        twinattn.kv_cache_bytes(1, 1, 1, head_dim=1, tokens=-1, bytes_per_entry=2)
    with pytest.raises(TypeError, match=r"bytes_per_entry: expected an int, got float"):
        twinattn.kv_cache_bytes(1, 1, 1, head_dim=1, tokens=1, bytes_per_entry=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"missing keyword argument\(s\) tokens"):
        twinattn.kv_cache_bytes(1, 1, 1, head_dim=1, bytes_per_entry=2)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"got head_dim both by position and by keyword"):
        twinattn.kv_cache_bytes(1, 1, 1, 4, 8, head_dim=8, bytes_per_entry=2)
    with pytest.raises(TypeError, match=r"expected at most 6 arguments, got 7 positional ones"):
        twinattn.kv_cache_bytes(1, 1, 1, 1, 1, 1, 1)


def test_update_appends_at_each_sequence_length() -> None:
    rng = np.random.default_rng(0)
    cache = twinattn.KVCache(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=4, max_seq_len=10)
    first = rand(rng, 3, 2, 4, 4), rand(rng, 3, 2, 4, 4)
    cache.update(*first, 0, num_new=np.array([4, 1, 2]))  # prompts of lengths 4, 1 and 2
    np.testing.assert_array_equal(cache.seq_lens(0), [4, 1, 2])
    np.testing.assert_array_equal(cache.seq_lens(1), [0, 0, 0])  # layers are independent
    np.testing.assert_array_equal(cache.positions(2, 0), [[4, 5], [1, 2], [2, 3]])

    second = rand(rng, 3, 2, 2, 4), rand(rng, 3, 2, 2, 4)
    keys, values = cache.update(*second, 0)
    np.testing.assert_array_equal(cache.seq_lens(0), [6, 3, 4])
    assert keys.shape == values.shape == (3, 2, 6, 4)
    for b, prompt in enumerate((4, 1, 2)):
        want_k = np.concatenate([first[0][b, :, :prompt], second[0][b]], axis=1)
        want_v = np.concatenate([first[1][b, :, :prompt], second[1][b]], axis=1)
        np.testing.assert_array_equal(keys[b, :, : prompt + 2], want_k)
        np.testing.assert_array_equal(values[b, :, : prompt + 2], want_v)


def test_update_returns_views_not_copies() -> None:
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=4, max_seq_len=8)
    states = np.ones((2, 2, 3, 4), dtype=np.float32)
    keys, values = cache.update(states, 2 * states, 0)
    assert not keys.flags.owndata and not values.flags.owndata
    # Writing through the view is visible in the next view: both are the cache's memory.
    keys[0, 0, 0, 0] = 42.0
    assert cache.keys(0)[0, 0, 0, 0] == 42.0
    again, _ = cache.update(states[:, :, :1], states[:, :, :1], 0)
    assert np.shares_memory(keys, again)
    assert again[0, 0, 0, 0] == 42.0


def test_lengths_are_tracked_not_inferred_from_zeros() -> None:
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_seq_len=8)
    zeros = np.zeros((2, 1, 3, 4), dtype=np.float32)
    keys, _ = cache.update(zeros, zeros, 0)
    np.testing.assert_array_equal(cache.seq_lens(0), [3, 3])
    assert keys.shape[2] == 3


def test_overflow_raises_and_leaves_the_cache_unchanged() -> None:
    rng = np.random.default_rng(1)
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=4, max_seq_len=5)
    cache.update(rand(rng, 2, 2, 4, 4), rand(rng, 2, 2, 4, 4), 0, num_new=np.array([4, 2]))
    before_k, before_v, before_lens = cache.keys(0).copy(), cache.values(0).copy(), cache.seq_lens(0)
    full_k, full_v = cache._keys.copy(), cache._values.copy()
    with pytest.raises(twinattn.CacheOverflowError, match=r"exceeds max_seq_len=5 for sequence\(s\) \[0\]"):
        cache.update(rand(rng, 2, 2, 2, 4), rand(rng, 2, 2, 2, 4), 0)
    assert issubclass(twinattn.CacheOverflowError, ValueError)
    np.testing.assert_array_equal(cache.seq_lens(0), before_lens)
    np.testing.assert_array_equal(cache.keys(0), before_k)
    np.testing.assert_array_equal(cache.values(0), before_v)
    np.testing.assert_array_equal(cache._keys, full_k)  # not even sequence 1, which had room, moved
    np.testing.assert_array_equal(cache._values, full_v)
    cache.update(rand(rng, 2, 2, 1, 4), rand(rng, 2, 2, 1, 4), 0)  # exactly full is fine
    np.testing.assert_array_equal(cache.seq_lens(0), [5, 3])


def test_crop_reset_reorder() -> None:
    rng = np.random.default_rng(2)
    cache = twinattn.KVCache(num_layers=2, batch_size=3, num_kv_heads=1, head_dim=2, max_seq_len=8)
    k, v = rand(rng, 3, 1, 5, 2), rand(rng, 3, 1, 5, 2)
    for layer in (0, 1):
        cache.update(k, v, layer, num_new=np.array([5, 3, 4]))

    cache.reorder(np.array([2, 0, 0]))  # beam search: beams 1 and 2 continue from old beam 0
    np.testing.assert_array_equal(cache.seq_lens(1), [4, 5, 5])
    np.testing.assert_array_equal(cache.keys(1)[0, :, :4], k[2, :, :4])
    np.testing.assert_array_equal(cache.keys(1)[1], k[0])
    np.testing.assert_array_equal(cache.values(0)[2], v[0])

    cache.crop(4)
    np.testing.assert_array_equal(cache.seq_lens(0), [4, 4, 4])
    cache.crop(10)  # longer than every sequence: nothing changes
    np.testing.assert_array_equal(cache.seq_lens(1), [4, 4, 4])

    cache.reset(1)
    np.testing.assert_array_equal(cache.seq_lens(0), [4, 0, 4])
    np.testing.assert_array_equal(cache.seq_lens(1), [4, 0, 4])
    cache.reset([0, 2])
    np.testing.assert_array_equal(cache.seq_lens(0), [0, 0, 0])
    cache.update(k[:, :, :1], v[:, :, :1], 0)
    cache.reset()
    np.testing.assert_array_equal(cache.seq_lens(0), [0, 0, 0])


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: np.zeros((2, 3, 1, 4), np.float32), ValueError, r"key_states: expected shape \(B=2, Hkv=2, L, D=4\), got \(2, 3, 1, 4\)"),
        (lambda: np.zeros((2, 2, 1, 5), np.float32), ValueError, r"key_states: expected shape \(B=2, Hkv=2, L, D=4\), got \(2, 2, 1, 5\)"),
        (lambda: np.zeros((2, 2, 1, 4), np.float64), TypeError, r"key_states: expected dtype float32 \(the cache's\), got float64"),
        (lambda: [[0.0]], TypeError, r"key_states: expected a numpy array .*got list"),
    ],
    ids=["heads", "head_dim", "dtype", "not_array"],
)
def test_update_rejects_wrong_states(make, error: type, match: str) -> None:
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=4, max_seq_len=4)
    good = np.zeros((2, 2, 1, 4), np.float32)
    with pytest.raises(error, match=match):
        cache.update(make(), good, 0)
    np.testing.assert_array_equal(cache.seq_lens(0), [0, 0])


def test_other_argument_errors() -> None:
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_seq_len=4)
    s = np.zeros((2, 1, 2, 2), np.float32)
    with pytest.raises(IndexError, match=r"layer_idx: expected 0 <= layer_idx < num_layers=1, got 1"):
        cache.update(s, s, 1)
    with pytest.raises(ValueError, match=r"value_states: expected the shape of key_states \(2, 1, 2, 2\), got \(2, 1, 1, 2\)"):
        cache.update(s, s[:, :, :1], 0)
    with pytest.raises(ValueError, match=r"num_new: expected values in \[0, L=2\], got \[3, 0\]"):
        cache.update(s, s, 0, num_new=np.array([3, 0]))
    with pytest.raises(IndexError, match=r"indices: expected values in \[0, batch_size=2\), got \[0, 2\]"):
        cache.reorder(np.array([0, 2]))
    with pytest.raises(ValueError, match=r"indices: expected an int array of shape \(B=2,\), got shape \(3,\)"):
        cache.reorder(np.array([0, 1, 1]))
    with pytest.raises(IndexError, match=r"batch_idx: expected values in \[0, batch_size=2\), got \[5\]"):
        cache.reset(5)
    with pytest.raises(ValueError, match=r"n: expected a non-negative int, got -1"):
        cache.crop(-1)
    with pytest.raises(TypeError, match=r"dtype: expected float32, float16 or bfloat16 \(ml_dtypes.bfloat16\), or float64 \(backend='numpy' only\), got int32"):
        twinattn.KVCache(1, 1, 1, 1, 1, dtype=np.int32)
    np.testing.assert_array_equal(cache.seq_lens(0), [0, 0])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_kernel_reads_a_ragged_cache_in_place(backend: str, kv_heads: int, dtype: np.dtype) -> None:
    """Decode against a cache whose sequences hold 7, 2 and 5 tokens: the views go to the kernel
    with explicit offsets and lengths and match the float64 reference on each sequence alone
    (float16 / bfloat16 caches: q rounded to the cache's dtype, helpers' half tolerance)."""
    rng = np.random.default_rng(3)
    cache = twinattn.KVCache(num_layers=1, batch_size=3, num_kv_heads=kv_heads, head_dim=8, max_seq_len=16, dtype=dtype)
    prompt = np.array([7, 2, 5])
    cache.update(rand(rng, 3, kv_heads, 7, 8), rand(rng, 3, kv_heads, 7, 8), 0, num_new=prompt)
    cache._keys[0, 1, :, 2:] = np.nan  # whatever lies past a sequence's length is never read
    q = rand(rng, 3, 4, 2, 8).astype(dtype)
    offsets = cache.seq_lens(0)
    keys, values = cache.update(rand(rng, 3, kv_heads, 2, 8), rand(rng, 3, kv_heads, 2, 8), 0)
    lens = cache.seq_lens(0)
    out = twinattn.attention(q, keys, values, causal=True, q_offset=offsets, kv_lens=lens, backend=backend)
    for b in range(3):
        n = int(lens[b])
        k_b, v_b = keys[b : b + 1, :, :n].copy(), values[b : b + 1, :, :n].copy()
        if dtype in HALF_DTYPES:
            assert_half_close_to_reference(out[b : b + 1], q[b : b + 1], k_b, v_b, causal=True)
        else:
            assert_close_to_reference(out[b : b + 1], q[b : b + 1], k_b, v_b, causal=True)


# ---- float16 / bfloat16 caches ----------------------------------------------------------------


@half_dtypes
def test_kv_cache_stores_in_its_dtype(dtype: np.dtype) -> None:
    cache = twinattn.KVCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=16, max_seq_len=40, dtype=dtype)
    assert cache.dtype == dtype
    assert cache.nbytes == twinattn.kv_cache_bytes(2, 2, 3, head_dim=16, tokens=40, bytes_per_entry=2)
    assert cache.nbytes * 2 == twinattn.KVCache(2, 2, 3, 16, 40).nbytes  # half of float32's bytes
    rng = np.random.default_rng(4)
    # float32 states (what projections give): values at and between the dtype's neighbours, ties
    k = rand(rng, 2, 3, 5, 16) * 3
    bits = 11 if dtype == FLOAT16 else 8
    k[0, 0, 0, :4] = [1 + 2.0**-bits, 1 + 3 * 2.0**-bits, -(1 + 2.0**-bits), 1 + 2.0**-bits + 2.0**-20]  # ties, and just above one
    v = rand(rng, 2, 3, 5, 16)
    keys, values = cache.update(k, v, 1)
    assert keys.dtype == values.dtype == dtype
    np.testing.assert_array_equal(keys.view(np.uint16), round_bits_rne(k, dtype))
    np.testing.assert_array_equal(values.view(np.uint16), round_bits_rne(v, dtype))
    assert keys[0, 0, 0, 0] == 1 and keys[0, 0, 0, 1] == 1 + 4 * 2.0**-bits and keys[0, 0, 0, 3] == 1 + 2 * 2.0**-bits
    # states already in the dtype are stored as they are; other dtypes are refused
    more = (rand(rng, 2, 3, 1, 16)).astype(dtype)
    keys, _ = cache.update(more, more, 1)
    np.testing.assert_array_equal(keys[:, :, 5:].view(np.uint16), more.view(np.uint16))
    with pytest.raises(TypeError, match=rf"key_states: expected dtype {DTYPE_IDS[dtype]} \(the cache's\) or float32 \(rounded to {DTYPE_IDS[dtype]} as it is stored\), got float64"):
        cache.update(np.zeros((2, 3, 1, 16)), more, 1)
    np.testing.assert_array_equal(cache.seq_lens(1), [6, 6])


@pytest.mark.parametrize("dtype, accepted", [
    ("bfloat16", BFLOAT16), (ml_dtypes.bfloat16, BFLOAT16), (np.float16, FLOAT16), ("float32", np.dtype(np.float32)),
    ("int8", np.dtype(np.int8)), (np.int8, np.dtype(np.int8)),
])
def test_kv_cache_dtype_spellings(dtype: Any, accepted: np.dtype) -> None:
    assert twinattn.KVCache(1, 1, 1, 2, 3, dtype=dtype).dtype == accepted


@pytest.mark.parametrize("dtype, shown", [(np.uint8, "uint8"), (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"), ("float128x", "'float128x'"), (np.complex64, "complex64")])
def test_kv_cache_rejects_other_dtypes_naming_the_accepted_ones(dtype: Any, shown: str) -> None:
    with pytest.raises(TypeError) as info:
        twinattn.KVCache(1, 1, 1, 2, 3, dtype=dtype)
    assert str(info.value) == (
        f"dtype: expected float32, float16 or bfloat16 (ml_dtypes.bfloat16), or float64 (backend='numpy' only), got {shown}"
        ", or int8 (quantized with scales)"
    )


# ---- int8 caches ------------------------------------------------------------------------------


def test_int8_cache_quantizes_on_update_and_counts_its_scales() -> None:
    cache = twinattn.KVCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=16, max_seq_len=40, dtype="int8")
    assert cache.dtype == np.int8
    payload = twinattn.kv_cache_bytes(2, 2, 3, head_dim=16, tokens=40, bytes_per_entry=1)
    scales = twinattn.kv_cache_bytes(2, 2, 3, head_dim=1, tokens=40, bytes_per_entry=4)
    assert cache.nbytes == payload + scales == 2 * 2 * 2 * 3 * 40 * (16 + 4)
    rng = np.random.default_rng(8)
    # ragged: sequence 1 appends 3 of 5 tokens, then both append one bfloat16 token
    k, v = rand(rng, 2, 3, 5, 16), rand(rng, 2, 3, 5, 16)
    cache.update(k, v, 1, num_new=np.array([5, 3]))
    more_k, more_v = rand(rng, 2, 3, 1, 16).astype(BFLOAT16), rand(rng, 2, 3, 1, 16).astype(FLOAT16)
    keys, values = cache.update(more_k, more_v, 1)
    k_scale, v_scale = cache.scales(1)
    assert keys.dtype == values.dtype == np.int8 and k_scale.dtype == v_scale.dtype == np.float32
    assert keys.shape == (2, 3, 6, 16) and k_scale.shape == v_scale.shape == (2, 3, 6)
    assert np.shares_memory(k_scale, cache._k_scales) and np.shares_memory(keys, cache._keys)  # views, in place
    for b, n in ((0, 5), (1, 3)):
        for stored, scale, first, last in ((keys, k_scale, k, more_k), (values, v_scale, v, more_v)):
            want_q, want_s = twinattn.quantize_kv(np.concatenate([first[b, :, :n], last[b].astype(np.float32)], axis=1))
            np.testing.assert_array_equal(stored[b, :, : n + 1], want_q)
            np.testing.assert_array_equal(scale[b, :, : n + 1], want_s)
    np.testing.assert_array_equal(cache.seq_lens(1), [6, 4])
    # reorder moves the scales with the payload
    before = (keys[0].copy(), k_scale[0].copy(), v_scale[0].copy())
    cache.reorder(np.array([0, 0]))
    np.testing.assert_array_equal(cache.keys(1)[1], before[0])
    np.testing.assert_array_equal(cache.scales(1)[0][1], before[1])
    np.testing.assert_array_equal(cache.scales(1)[1][1], before[2])
    with pytest.raises(TypeError, match=r"key_states: expected dtype float32, float16 or bfloat16 \(ml_dtypes.bfloat16\) \(quantized to the int8 cache as it is stored\), got int8"):
        cache.update(np.zeros((2, 3, 1, 16), np.int8), v[:, :, :1], 1)
    with pytest.raises(ValueError, match=r"scales: only an int8 KVCache has scales, this one is float32"):
        twinattn.KVCache(1, 1, 1, 2, 3).scales(0)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_kernel_reads_a_ragged_int8_cache_in_place(backend: str, kv_heads: int) -> None:
    """Decode against an int8 cache whose sequences hold 7, 2 and 5 tokens: the int8 views and
    their scales go to the kernel and match the float64 reference on the dequantized keys and
    values of each sequence alone; a NaN scale past a sequence's length is never read."""
    rng = np.random.default_rng(13)
    cache = twinattn.KVCache(num_layers=1, batch_size=3, num_kv_heads=kv_heads, head_dim=8, max_seq_len=16, dtype=np.int8)
    cache.update(rand(rng, 3, kv_heads, 7, 8), rand(rng, 3, kv_heads, 7, 8), 0, num_new=np.array([7, 2, 5]))
    cache._k_scales[0, 1, :, 2:] = np.nan
    cache._v_scales[0, 1, :, 2:] = np.nan
    q = rand(rng, 3, 4, 2, 8)
    offsets = cache.seq_lens(0)
    keys, values = cache.update(rand(rng, 3, kv_heads, 2, 8), rand(rng, 3, kv_heads, 2, 8), 0)
    k_scale, v_scale = cache.scales(0)
    lens = cache.seq_lens(0)
    out = twinattn.attention(q, keys, values, k_scale=k_scale, v_scale=v_scale, causal=True, q_offset=offsets,
                             kv_lens=lens, backend=backend)
    for b in range(3):
        n = int(lens[b])
        k_b = twinattn.dequantize_kv(keys[b : b + 1, :, :n].copy(), k_scale[b : b + 1, :, :n].copy())
        v_b = twinattn.dequantize_kv(values[b : b + 1, :, :n].copy(), v_scale[b : b + 1, :, :n].copy())
        assert_close_to_reference(out[b : b + 1], q[b : b + 1], k_b, v_b, causal=True)
