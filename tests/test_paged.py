"""twinattn.attention_paged on every backend against the dense API on each sequence alone (keys
gathered through the block table), for every dtype, int8, block sizes 1 / 3 / 16, shuffled
blocks with NaN in every slot no sequence uses, the variants, mixed decode and prefill rows, and
shared prefix blocks; its bad inputs; and twinattn.PagedKVCache: reference counts, fork,
copy-on-write, prefix reuse, least-recently-used reuse of freed prefixes, CacheFullError leaving
the cache unchanged, and nn.Attention on it against the dense KVCache."""

from __future__ import annotations

import copy
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from packed_helpers import assert_bad_call, Packed, assert_matches_dense, random_packed, to_paged

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8}
BLOCK_SIZES = (1, 3, 16)
VARIANTS: dict[str, dict[str, Any]] = {
    "causal": {},
    "bidirectional": {"causal": False},
    "window": {"window_size": (4, 0)},
    "softcap": {"softcap": 2.0, "scale": 0.7},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)},
    "sinks": {"sinks": np.array([0.3, -1.0, 2.0, 0.0], np.float32)},
}


def _paged_call(packed: Packed, block_size: int, backend: str, *, rng_seed: int = 0, decode: bool = False,
                **kwargs: Any) -> tuple[Any, Any]:
    paged = to_paged(np.random.default_rng(rng_seed), packed, block_size)
    cu = None if decode else packed.cu_q
    return twinattn.attention_paged(
        packed.q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, cu_seqlens_q=cu, return_lse=True,
        backend=backend, **paged.scales, **kwargs,
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_decode_and_prefill(backend: str, block_size: int, dtype: Any) -> None:
    """Decode rows, a prefill chunk over a longer context, a whole prompt and an empty row set in
    one call; causal by default."""
    rng = np.random.default_rng(block_size)
    packed = random_packed(rng, [1, 4, 0, 5, 1], [9, 20, 3, 5, 1], dtype=dtype)
    out, lse = _paged_call(packed, block_size, backend)
    assert out.shape == (11, 4, 6)
    assert_matches_dense(out, lse, packed, causal=True)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_default_rows(backend: str, block_size: int) -> None:
    rng = np.random.default_rng(7)
    packed = random_packed(rng, [1, 1, 1], [17, 2, 33])
    out, lse = _paged_call(packed, block_size, backend, decode=True)
    assert_matches_dense(out, lse, packed, causal=True)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_variants(backend: str, variant: dict[str, Any]) -> None:
    rng = np.random.default_rng(8)
    packed = random_packed(rng, [2, 1, 3], [7, 12, 3])
    out, lse = _paged_call(packed, 3, backend, **variant)
    assert_matches_dense(out, lse, packed, **{"causal": True, **variant})


@pytest.mark.parametrize("block_size", (1, 4))
def test_shared_prefix_blocks(backend: str, block_size: int) -> None:
    """Sequences whose tables start with the same blocks (a shared prompt): each sees the prefix
    and its own tail, as if it held a private copy."""
    rng = np.random.default_rng(9)
    prefix_blocks, q_heads, kv_heads = 3, 4, 2
    prefix = prefix_blocks * block_size
    packed = random_packed(rng, [1, 2, 1, 3], [prefix + 5, prefix + 2, prefix + 1, prefix + 7])
    for b in range(1, 4):
        packed.keys[b][:prefix] = packed.keys[0][:prefix]
        packed.values[b][:prefix] = packed.values[0][:prefix]
    paged = to_paged(rng, packed, block_size, shared_prefix_blocks=prefix_blocks)
    assert (paged.block_table[1:, :prefix_blocks] == paged.block_table[0, :prefix_blocks]).all()
    out, lse = twinattn.attention_paged(
        packed.q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, cu_seqlens_q=packed.cu_q,
        return_lse=True, backend=backend,
    )
    assert_matches_dense(out, lse, packed, causal=True)
    assert q_heads % kv_heads == 0


def test_interleaved_pages_and_int32_lengths(backend: str) -> None:
    """K and V pages interleaved in one buffer (transformers' continuous batching layout), int32
    seq_lens and cu_seqlens_q, out written in place."""
    rng = np.random.default_rng(10)
    packed = random_packed(rng, [2, 1], [6, 4], value_dim=8)
    paged = to_paged(rng, packed, 2)
    both = np.stack([paged.k_cache, paged.v_cache], axis=1)  # (num_blocks, 2, block_size, Hkv, D)
    out = np.empty((3, 4, 8), np.float32)
    result = twinattn.attention_paged(
        packed.q, both[:, 0], both[:, 1], paged.block_table, paged.seq_lens.astype(np.int32),
        cu_seqlens_q=packed.cu_q.astype(np.int32), out=out, backend=backend,
    )
    assert result is out
    assert_matches_dense(out, None, packed, causal=True)


def test_int64_block_table_is_converted(backend: str) -> None:
    rng = np.random.default_rng(11)
    packed = random_packed(rng, [1, 1], [5, 3])
    paged = to_paged(rng, packed, 2)
    out = twinattn.attention_paged(packed.q, paged.k_cache, paged.v_cache, paged.block_table.astype(np.int64),
                                   paged.seq_lens, backend=backend)
    assert_matches_dense(out, None, packed, causal=True)


def _bad_calls() -> list[tuple[str, dict[str, Any], type, str]]:
    q = np.zeros((3, 4, 8), np.float32)
    kc = np.zeros((5, 2, 2, 8), np.float32)
    vc = np.zeros((5, 2, 2, 6), np.float32)
    table = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    lens = np.array([3, 2])
    base = {"q": q[:2], "k_cache": kc, "v_cache": vc, "block_table": table, "seq_lens": lens}
    mixed = {**base, "q": q, "cu_seqlens_q": np.array([0, 1, 3])}
    return [
        ("cache-rank", {**base, "k_cache": kc[0]}, ValueError,
         r"k_cache: expected 4 dimensions \(num_blocks, block_size, Hkv, D\), got shape \(2, 2, 8\)"),
        ("v-shape", {**base, "v_cache": vc[:4]}, ValueError,
         r"v_cache: expected shape \(num_blocks=5, block_size=2, Hkv=2, Dv\), got \(4, 2, 2, 6\)"),
        ("v-dtype", {**base, "v_cache": vc.astype(np.float16)}, TypeError, r"v_cache: expected dtype float32 \(q's dtype\), got float16"),
        ("table-dtype", {**base, "block_table": table.astype(np.float32)}, TypeError,
         "block_table: expected dtype int32 or int64, got float32"),
        ("table-rank", {**base, "block_table": table[0]}, ValueError, r"block_table: expected shape \(B, max_blocks\), got \(3,\)"),
        ("block-range", {**base, "block_table": np.array([[0, 5, -1], [2, -1, -1]], np.int32)}, ValueError,
         r"block_table: expected block ids in \[0, num_blocks=5\) for the blocks a sequence uses, got block_table\[0, 1\]=5"),
        ("block-negative", {**base, "block_table": np.array([[0, 1, -1], [-1, -1, -1]], np.int32)}, ValueError,
         r"got block_table\[1, 0\]=-1"),
        ("lens-shape", {**base, "seq_lens": np.array([3])}, ValueError, r"seq_lens: expected shape \(B=2,\) \(block_table's rows\), got \(1,\)"),
        ("lens-over", {**base, "seq_lens": np.array([7, 2])}, ValueError,
         r"seq_lens: expected values in \[0, max_blocks \* block_size = 3 \* 2 = 6\], got seq_lens\[0\]=7"),
        ("lens-dtype", {**base, "seq_lens": np.array([3.0, 2.0])}, TypeError, "seq_lens: expected dtype int64 or int32, got float64"),
        ("decode-rows", {**base, "q": q}, ValueError, r"q: expected one row per sequence \(total_q = B = 2\) without cu_seqlens_q"),
        ("rows-over-keys", {**mixed, "cu_seqlens_q": np.array([0, 0, 3])}, ValueError,
         r"cu_seqlens_q: sequence 1 has 3 query rows but seq_lens\[1\]=2 keys"),
        ("cu-total", {**mixed, "cu_seqlens_q": np.array([0, 1, 2])}, ValueError,
         r"cu_seqlens_q: expected the last value cu_seqlens_q\[B\] == total_q=3, got 2"),
        ("int8-no-scale", {**base, "k_cache": kc.astype(np.int8), "v_cache": vc.astype(np.int8)}, ValueError,
         r"k_scale: required with int8 k and v \(float32, shape \(num_blocks, block_size, Hkv\)\), got None"),
        ("scale-not-int8", {**base, "k_scale": np.ones((5, 2, 2), np.float32)}, ValueError,
         "k_scale: expected None with float32 k and v"),
        ("out-overlap", {**base, "out": kc.reshape(-1)[:48].reshape(2, 4, 6)}, ValueError, "out: must not overlap the memory of k_cache"),
    ]


@pytest.mark.parametrize("name, arguments, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs(backend: str, name: str, arguments: dict[str, Any], error: type, message: str) -> None:
    assert_bad_call(twinattn.attention_paged, ("q", "k_cache", "v_cache", "block_table", "seq_lens"), backend, arguments, error, message)


# ---- PagedKVCache ----------------------------------------------------------------------------------


def _states(rng: np.random.Generator, n: int, heads: int = 2, width: int = 4) -> np.ndarray:
    return rng.standard_normal((n, heads, width)).astype(np.float32)


def _stored(cache: twinattn.PagedKVCache, seq: int, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's keys and values gathered from the pools, (L, Hkv, D)."""
    k_cache, v_cache = cache.layer(layer)
    blocks = cache.blocks(seq)
    length = int(cache.seq_lens([seq], layer)[0])
    return (k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:length], v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:length])


def _refcounts_consistent(cache: twinattn.PagedKVCache) -> None:
    held = np.zeros(cache.num_blocks, np.int64)
    for seq in cache.sequences:
        for block in cache.blocks(seq):
            held[block] += 1
    assert [cache.ref_count(b) for b in range(cache.num_blocks)] == held.tolist()
    assert cache.num_free_blocks == int((held == 0).sum())


def test_append_writes_in_place_and_grows_by_blocks() -> None:
    rng = np.random.default_rng(20)
    cache = twinattn.PagedKVCache(8, 3, 2, 2, 4, value_dim=5)
    seq = cache.add()
    k, v = _states(rng, 7), rng.standard_normal((7, 2, 5)).astype(np.float32)
    cache.append(seq, 0, k[:4], v[:4])
    assert len(cache.blocks(seq)) == 2 and cache.num_free_blocks == 6
    cache.append(seq, 0, k[4:], v[4:])
    cache.append(seq, 1, k, v)  # layer 1 fills the blocks layer 0 took
    assert len(cache.blocks(seq)) == 3 and cache.num_free_blocks == 5
    for layer in (0, 1):
        got_k, got_v = _stored(cache, seq, layer)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    assert cache.seq_lens([seq]).tolist() == [7]
    table = cache.block_table([seq, seq])
    assert table.dtype == np.int32 and table.shape == (2, 3)
    assert cache.nbytes == 2 * 8 * 3 * 2 * (4 + 5) * 4
    _refcounts_consistent(cache)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_cache_rounds_float32_states(dtype: Any) -> None:
    rng = np.random.default_rng(21)
    cache = twinattn.PagedKVCache(4, 2, 1, 2, 4, dtype=dtype)
    seq = cache.add()
    k = _states(rng, 3)
    cache.append(seq, 0, k, k)
    np.testing.assert_array_equal(_stored(cache, seq)[0], k.astype(dtype))


def test_int8_cache_quantizes_with_paged_scales() -> None:
    rng = np.random.default_rng(22)
    cache = twinattn.PagedKVCache(4, 2, 1, 2, 4, dtype="int8")
    seq = cache.add()
    k, v = _states(rng, 3), _states(rng, 3)
    cache.append(seq, 0, k, v)
    k8, ks = twinattn.quantize_kv(k)
    k_scale, v_scale = cache.scales(0)
    blocks = cache.blocks(seq)
    np.testing.assert_array_equal(_stored(cache, seq)[0], k8)
    np.testing.assert_array_equal(k_scale[blocks].reshape(-1, 2)[:3], ks)
    assert cache.nbytes == 2 * 4 * 2 * 2 * 4 * 1 + 2 * 4 * 2 * 2 * 4
    with pytest.raises(ValueError, match="scales: only an int8 PagedKVCache has scales"):
        twinattn.PagedKVCache(4, 2, 1, 2, 4).scales(0)


def test_fork_shares_blocks_and_copies_on_write() -> None:
    rng = np.random.default_rng(23)
    cache = twinattn.PagedKVCache(8, 4, 1, 2, 4)
    parent = cache.add()
    prompt = _states(rng, 6)
    cache.append(parent, 0, prompt, prompt)
    child = cache.fork(parent)
    assert cache.blocks(child) == cache.blocks(parent)
    assert all(cache.ref_count(b) == 2 for b in cache.blocks(parent))
    _refcounts_consistent(cache)
    # the last block (2 of 4 slots used) is shared: the child's write copies it first
    mine = _states(rng, 1)
    cache.append(child, 0, mine, mine)
    assert cache.blocks(child)[0] == cache.blocks(parent)[0]
    assert cache.blocks(child)[1] != cache.blocks(parent)[1]
    np.testing.assert_array_equal(_stored(cache, child)[0], np.concatenate([prompt, mine]))
    np.testing.assert_array_equal(_stored(cache, parent)[0], prompt)
    theirs = _states(rng, 1)
    cache.append(parent, 0, theirs, theirs)  # the parent's block is its own again: no copy
    np.testing.assert_array_equal(_stored(cache, parent)[0], np.concatenate([prompt, theirs]))
    np.testing.assert_array_equal(_stored(cache, child)[0], np.concatenate([prompt, mine]))
    _refcounts_consistent(cache)
    cache.free(parent)
    assert cache.ref_count(cache.blocks(child)[0]) == 1
    cache.free(child)
    assert cache.num_free_blocks == 8
    _refcounts_consistent(cache)


def _fill_prompt(cache: twinattn.PagedKVCache, seq: int, k: np.ndarray) -> None:
    start = int(cache.seq_lens([seq])[0])
    for layer in range(cache.num_layers):
        cache.append(seq, layer, k[start:], k[start:] * 2)


def test_prefix_caching_reuses_full_blocks_read_only() -> None:
    rng = np.random.default_rng(24)
    cache = twinattn.PagedKVCache(16, 4, 2, 2, 4)
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks
    k = _states(rng, 11)
    first = cache.add(tokens)
    assert cache.seq_lens([first]).tolist() == [0]
    _fill_prompt(cache, first, k)
    second = cache.add(tokens[:9] + [7, 7, 7])  # shares the first 2 blocks (8 tokens)
    assert cache.seq_lens([second], 1).tolist() == [8]
    assert cache.blocks(second) == cache.blocks(first)[:2]
    assert cache.ref_count(cache.blocks(first)[0]) == 2
    other = cache.add([1] + tokens[1:])  # differs in the first token: nothing is shared
    assert cache.seq_lens([other]).tolist() == [0] and cache.blocks(other) == []
    same_block_later = cache.add(tokens[4:8] + tokens[4:8] + [0])  # block 1's tokens, another prefix
    assert cache.seq_lens([same_block_later]).tolist() == [0]
    exact = cache.add(tokens[:8])  # a whole-block prompt: its last token is left to compute
    assert cache.seq_lens([exact]).tolist() == [4]
    # the shared blocks are read-only: the second sequence's own tokens go to a new block
    k2 = _states(rng, 12)
    k2[:8] = k[:8]
    _fill_prompt(cache, second, k2)
    np.testing.assert_array_equal(_stored(cache, first, 1)[0], k)
    np.testing.assert_array_equal(_stored(cache, second, 1)[0], k2)
    _refcounts_consistent(cache)


def test_freed_prefixes_stay_reusable_least_recently_used_first() -> None:
    rng = np.random.default_rng(25)
    cache = twinattn.PagedKVCache(4, 2, 1, 1, 4)
    old = cache.add([1, 2, 3])
    _fill_prompt(cache, old, _states(rng, 3, heads=1))
    recent = cache.add([5, 6, 7])
    _fill_prompt(cache, recent, _states(rng, 3, heads=1))
    old_block, recent_block = cache.blocks(old)[0], cache.blocks(recent)[0]
    cache.free(old)
    cache.free(recent)
    assert cache.num_free_blocks == 4
    # one new block: an empty one first, then the least recently used cached prefix's tail
    taker = cache.add()
    cache.append(taker, 0, _states(rng, 4, heads=1), _states(rng, 4, heads=1))
    assert old_block not in cache.blocks(taker) and recent_block not in cache.blocks(taker)
    again = cache.add([5, 6, 7])
    assert cache.blocks(again) == [recent_block]
    cache.free(again)
    cache.append(taker, 0, _states(rng, 2, heads=1), _states(rng, 2, heads=1))  # evicts the older prefix first
    assert old_block in cache.blocks(taker)
    assert cache.blocks(cache.add([1, 2, 3])) == []
    assert cache.blocks(cache.add([5, 6, 7])) == [recent_block]
    _refcounts_consistent(cache)


def test_cache_full_changes_nothing() -> None:
    rng = np.random.default_rng(26)
    cache = twinattn.PagedKVCache(3, 2, 1, 2, 4)
    seq = cache.add([1, 2, 3])
    cache.append(seq, 0, _states(rng, 3), _states(rng, 3))
    child = cache.fork(seq)
    before = (copy.deepcopy(cache.__dict__), cache.layer(0)[0].copy())
    with pytest.raises(twinattn.CacheFullError, match=r"needs 3 free blocks, 1 of 3 are free; the cache is unchanged"):
        cache.append(child, 0, _states(rng, 4), _states(rng, 4))  # a copy of the shared block and 2 new ones
    after = (cache.__dict__, cache.layer(0)[0])
    assert isinstance(twinattn.CacheFullError("x"), RuntimeError)
    np.testing.assert_array_equal(before[1], after[1])
    assert cache.blocks(child) == cache.blocks(seq) and cache.seq_lens([child]).tolist() == [3]
    assert cache.num_free_blocks == 1 and [cache.ref_count(b) for b in cache.blocks(seq)] == [2, 2]
    assert before[0]["_lookup"] == after[0]["_lookup"] and list(before[0]["_free"]) == list(after[0]["_free"])


def test_cache_argument_errors() -> None:
    cache = twinattn.PagedKVCache(4, 2, 2, 2, 4)
    seq = cache.add()
    with pytest.raises(KeyError, match="seq: no live sequence 9"):
        cache.append(9, 0, _states(np.random.default_rng(0), 1), _states(np.random.default_rng(0), 1))
    with pytest.raises(IndexError, match=r"layer: expected 0 <= layer < num_layers=2, got 2"):
        cache.layer(2)
    with pytest.raises(ValueError, match=r"k: expected shape \(n, Hkv=2, D=4\), got \(1, 3, 4\)"):
        cache.append(seq, 0, np.zeros((1, 3, 4), np.float32), np.zeros((1, 3, 4), np.float32))
    with pytest.raises(TypeError, match="k: expected dtype float32"):
        cache.append(seq, 0, np.zeros((1, 2, 4), np.int32), np.zeros((1, 2, 4), np.float32))
    with pytest.raises(TypeError, match=r"seqs: expected a list of sequence ids, got an int \(0\); pass \[0\]"):
        cache.block_table(0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks: expected a positive int, got 0"):
        twinattn.PagedKVCache(0, 2, 1, 1, 4)
    cache.free(seq)
    with pytest.raises(KeyError):
        cache.free(seq)


# ---- attention through the cache ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_attention_through_cache_matches_dense(backend: str, dtype: Any) -> None:
    """A prompt shared by prefix caching plus each sequence's own tokens, then decode steps:
    attention_paged over the cache equals the dense attention over each sequence's tokens."""
    rng = np.random.default_rng(30)
    heads, kv_heads, dim = 4, 2, 8
    cache = twinattn.PagedKVCache(32, 3, 1, kv_heads, dim, dtype=dtype)
    prompt = list(range(10))
    first = cache.add(prompt)
    keys = {first: rng.standard_normal((10, kv_heads, dim)).astype(np.float32)}
    values = {first: rng.standard_normal((10, kv_heads, dim)).astype(np.float32)}
    cache.append(first, 0, keys[first], values[first])
    second = cache.add(prompt[:9] + [42])  # shares 3 blocks (9 tokens)
    assert cache.seq_lens([second]).tolist() == [9]
    keys[second] = np.concatenate([keys[first][:9], rng.standard_normal((3, kv_heads, dim)).astype(np.float32)])
    values[second] = np.concatenate([values[first][:9], rng.standard_normal((3, kv_heads, dim)).astype(np.float32)])
    cache.append(second, 0, keys[second][9:], values[second][9:])
    seqs = [first, second]
    q_float = rng.standard_normal((2, heads, dim)).astype(np.float32)
    q = q_float if dtype == np.int8 else q_float.astype(dtype)
    k_cache, v_cache = cache.layer(0)
    scales = dict(zip(("k_scale", "v_scale"), cache.scales(0))) if dtype == np.int8 else {}
    out = twinattn.attention_paged(q, k_cache, v_cache, cache.block_table(seqs), cache.seq_lens(seqs), backend=backend, **scales)
    stored = [_stored(cache, seq) for seq in seqs]
    packed = Packed(q, np.arange(3), [k for k, _ in stored], [v for _, v in stored])
    if dtype == np.int8:
        k_scale, v_scale = cache.scales(0)
        packed.k_scales = [k_scale[cache.blocks(s)].reshape(-1, kv_heads)[: len(keys[s])] for s in seqs]
        packed.v_scales = [v_scale[cache.blocks(s)].reshape(-1, kv_heads)[: len(keys[s])] for s in seqs]
    else:
        for seq, (k, _) in zip(seqs, stored):
            np.testing.assert_array_equal(k, keys[seq].astype(dtype))
    assert_matches_dense(out, None, packed, causal=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nn_attention_paged_equals_dense(backend: str, dtype: Any) -> None:
    """twinattn.nn.Attention on a PagedKVCache gives the dense KVCache's outputs: a right-padded
    prefill (num_new) and two decode steps, RoPE, GQA, a sliding window."""
    rng = np.random.default_rng(31)
    rope = twinattn.RotaryEmbedding(8)
    attn = twinattn.nn.Attention(32, 4, 2, rope=rope, backend=backend, sliding_window=5)
    dense = twinattn.KVCache(2, 2, 2, 8, 16, dtype=dtype)
    paged = twinattn.PagedKVCache(12, 2, 2, 2, 8, dtype=dtype)
    seqs = [paged.add(), paged.add()]
    prompt = rng.standard_normal((2, 6, 32)).astype(np.float32)
    num_new = np.array([6, 3])
    for layer in (0, 1):
        want = attn(prompt, cache=dense, layer_idx=layer, num_new=num_new)
        got = attn(prompt, cache=paged, layer_idx=layer, num_new=num_new, seqs=seqs)
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got[1, :3], want[1, :3], rtol=0, atol=1e-5)
        assert (got[1, 3:] == attn._project(np.zeros((3, 32), np.float32), "o_proj")).all()
    for _ in range(2):
        step = rng.standard_normal((2, 1, 32)).astype(np.float32)
        want = attn(step, cache=dense)
        got = attn(step, cache=paged, seqs=seqs)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert paged.seq_lens(seqs).tolist() == dense.seq_lens(0).tolist() == [8, 5]
    with pytest.raises(ValueError, match=r"seqs: a PagedKVCache needs the sequence id of each of the B=2 rows, got None"):
        attn(step, cache=paged)
    with pytest.raises(ValueError, match=r"seqs: expected B=2 distinct sequence ids \(one per row\), got \[0, 0\]"):
        attn(step, cache=paged, seqs=[0, 0])
    with pytest.raises(ValueError, match="seqs: only meaningful with a twinattn.PagedKVCache"):
        attn(step, cache=dense, seqs=seqs)


def test_ports_agree_bit_for_bit() -> None:
    """The C++ and Rust ports give the same bits for packed and paged calls (shared prefixes,
    mixed rows, variants), at the same thread count."""
    from conftest import NATIVE_BACKENDS, _require

    for port in NATIVE_BACKENDS:
        _require(port)
    rng = np.random.default_rng(40)
    packed = random_packed(rng, [1, 3, 2, 1], [20, 9, 20, 31], dtype=ml_dtypes.bfloat16)
    for b in (1, 2):  # sequences 1 and 2 share sequence 0's first 6 keys (2 blocks of 3)
        packed.keys[b][:6] = packed.keys[0][:6]
        packed.values[b][:6] = packed.values[0][:6]
    paged = to_paged(rng, packed, 3, shared_prefix_blocks=2)
    k, v, cu_k, _ = packed.packed_kv()
    variants = {"softcap": 1.5, "sinks": np.array([0.3, -1.0, 2.0, 0.0], np.float32), "window_size": (7, 0), "num_threads": 2}
    results = {}
    for port in NATIVE_BACKENDS:
        results[port] = (
            twinattn.attention_paged(packed.q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens,
                                     cu_seqlens_q=packed.cu_q, return_lse=True, backend=port, **variants),
            twinattn.attention_varlen(packed.q, k, v, packed.cu_q, cu_k, causal=True, return_lse=True, backend=port, **variants),
        )
    for (cpp_out, cpp_lse), (rust_out, rust_lse) in zip(results["cpp"], results["rust"]):
        np.testing.assert_array_equal(cpp_out.view(np.uint16), rust_out.view(np.uint16))
        np.testing.assert_array_equal(cpp_lse, rust_lse)


def test_nn_attention_full_cache_appends_no_row() -> None:
    attn = twinattn.nn.Attention(16, 2, 1, backend="numpy")
    cache = twinattn.PagedKVCache(3, 2, 1, 1, 8)
    seqs = [cache.add(), cache.add()]
    assert cache.blocks_needed(seqs[0], 0, 3) == 2
    with pytest.raises(twinattn.CacheFullError, match=r"needs 4 free blocks, 3 of 3 are free; the cache is unchanged"):
        attn(np.zeros((2, 3, 16), np.float32), cache=cache, seqs=seqs)
    assert cache.seq_lens(seqs).tolist() == [0, 0] and cache.num_free_blocks == 3
