"""A paged key/value cache: fixed-size blocks in one pool, shared between sequences.

Each layer holds k_cache (num_blocks, block_size, Hkv, D) and v_cache (num_blocks, block_size,
Hkv, Dv), flash-attn's paged layout, which twinattn.attention_paged reads in place. A sequence owns
a list of block ids (its row of block_table); key position p lives at
cache[blocks[p // block_size], p % block_size] in every layer. Blocks are reference counted:

    cache = PagedKVCache(num_blocks=1024, block_size=16, num_layers=2, num_kv_heads=8, head_dim=128)
    seq = cache.add(tokens=prompt_ids)     # reuses the stored blocks of a known prefix
    cache.append(seq, 0, k_new, v_new)     # (n, Hkv, D) each, written in place
    k_cache, v_cache = cache.layer(0)
    out = twinattn.attention_paged(q, k_cache, v_cache, cache.block_table([seq]), cache.seq_lens([seq]))

- Prefix caching: add(tokens) looks each full block of the prompt up by a hash of the whole token
  prefix it ends (so a block matches only after the same tokens before it). Matching blocks are
  shared read-only; the rest of the prompt is the caller's to compute and append. A block enters
  the lookup once every layer has filled it with tokens that add() was given.
- fork(seq): a new sequence sharing all of seq's blocks (parallel samples, beams). Writing into a
  shared block copies it first (copy-on-write), so no sequence ever sees another's tokens.
- free(seq): its blocks lose a reference; an unreferenced block that holds a cached prefix stays
  in the lookup, reusable, until its space is needed: least recently used first.
- Running out of blocks raises CacheFullError and changes nothing.

dtype: float32 (the default), float16, bfloat16, float64 (backend="numpy"), or int8: keys and
values quantized as they are appended (twinattn.quantize_kv), one float32 scale per (block, slot,
KV head) in scales(layer).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Iterable, Sequence

import numpy as np

from ..core._checks import FLOAT32, INT8, count, shape_str
from ..core.quant import quantize_kv
from .cache import _cache_dtype, check_state_dtype, layer_index

__all__ = ["CacheFullError", "PagedKVCache"]


class CacheFullError(RuntimeError):
    """The cache has too few free blocks for the request; nothing was changed."""


class _Sequence:
    """One sequence: its blocks, its length in each layer, and the prompt tokens add() was given."""

    def __init__(self, num_layers: int, blocks: list[int], tokens: tuple[int, ...], hashes: list[bytes]) -> None:
        self.blocks = blocks
        self.lens = [0] * num_layers
        self.tokens = tokens
        # hashes[i]: the prefix hash of full block i of tokens (the ones that can be looked up)
        self.hashes = hashes
        self.registered = 0  # blocks [0, registered) are in the prefix lookup (or were skipped)

    def copy(self) -> _Sequence:
        other = _Sequence(len(self.lens), list(self.blocks), self.tokens, self.hashes)
        other.lens = list(self.lens)
        other.registered = self.registered
        return other


class PagedKVCache:
    """Keys and values of `num_layers` attention layers in `num_blocks` blocks of `block_size`
    token slots each, shared by any number of sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: Any = np.float32,
        value_dim: int | None = None,
    ) -> None:
        self.num_blocks = count("num_blocks", num_blocks)
        self.block_size = count("block_size", block_size)
        self.num_layers = count("num_layers", num_layers)
        self.num_kv_heads = count("num_kv_heads", num_kv_heads)
        self.head_dim = count("head_dim", head_dim)
        self.value_dim = self.head_dim if value_dim is None else count("value_dim", value_dim)
        self.dtype = _cache_dtype(dtype)
        pool = (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads)
        # np.zeros maps pages lazily: blocks never written cost no memory
        self._keys = np.zeros(pool + (self.head_dim,), self.dtype)
        self._values = np.zeros(pool + (self.value_dim,), self.dtype)
        self._k_scales = self._v_scales = None
        if self.dtype == INT8:
            self._k_scales = np.zeros(pool, FLOAT32)
            self._v_scales = np.zeros(pool, FLOAT32)
        self._refs = np.zeros(self.num_blocks, np.int64)
        self._free: collections.deque[int] = collections.deque(range(self.num_blocks))  # empty blocks
        # unreferenced blocks that hold a cached prefix, least recently used first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lookup: dict[bytes, int] = {}  # prefix hash -> block
        self._block_hash: dict[int, bytes] = {}  # block -> its prefix hash, for blocks in the lookup
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0

    # ---- inspection ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the block pools of every layer (keys, values, and the scales of an int8 cache)."""
        scales = 0 if self._k_scales is None or self._v_scales is None else self._k_scales.nbytes + self._v_scales.nbytes
        return int(self._keys.nbytes + self._values.nbytes + scales)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: empty ones and unreferenced cached prefixes (reusable)."""
        return len(self._free) + len(self._evictable)

    @property
    def sequences(self) -> list[int]:
        """The ids of the live sequences, in the order they were added."""
        return list(self._sequences)

    def ref_count(self, block: int) -> int:
        """How many sequences hold block `block`."""
        return int(self._refs[block])

    def _sequence(self, seq: object) -> _Sequence:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise TypeError(f"seq: expected a sequence id (an int from add or fork), got {type(seq).__name__}")
        found = self._sequences.get(int(seq))
        if found is None:
            raise KeyError(f"seq: no live sequence {int(seq)} in this cache (ids come from add or fork; freed ids are gone)")
        return found

    def _sequence_list(self, seqs: Iterable[int]) -> list[_Sequence]:
        if isinstance(seqs, (int, np.integer)):
            raise TypeError(f"seqs: expected a list of sequence ids, got an int ({seqs}); pass [{seqs}]")
        return [self._sequence(seq) for seq in seqs]

    def blocks(self, seq: int) -> list[int]:
        """The block ids of sequence seq, in position order (a copy)."""
        return list(self._sequence(seq).blocks)

    def block_table(self, seqs: Iterable[int]) -> np.ndarray:
        """int32 (len(seqs), max_blocks): row b holds seqs[b]'s block ids, then -1 (never read)."""
        found = self._sequence_list(seqs)
        width = max([len(s.blocks) for s in found] + [1])
        table = np.full((len(found), width), -1, np.int32)
        for row, s in zip(table, found):
            row[: len(s.blocks)] = s.blocks
        return table

    def seq_lens(self, seqs: Iterable[int], layer: int = 0) -> np.ndarray:
        """int64 (len(seqs),): the tokens each sequence has stored in layer `layer`."""
        index = layer_index(layer, self.num_layers, "layer")
        return np.array([s.lens[index] for s in self._sequence_list(seqs)], np.int64)

    def positions(self, seqs: Iterable[int], num_new: int, layer: int = 0) -> np.ndarray:
        """Absolute positions (len(seqs), num_new) of the next num_new tokens of each sequence."""
        return self.seq_lens(seqs, layer)[:, None] + np.arange(count("num_new", num_new, positive=False), dtype=np.int64)

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(k_cache, v_cache) of layer `layer`: views (num_blocks, block_size, Hkv, D) and (..., Dv)
        of the pools, for attention_paged (with scales(layer) for an int8 cache)."""
        index = layer_index(layer, self.num_layers, "layer")
        return self._keys[index], self._values[index]

    def scales(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """int8 caches: (k_scale, v_scale), float32 views (num_blocks, block_size, Hkv) of layer
        `layer`'s scales, attention_paged's k_scale and v_scale."""
        index = layer_index(layer, self.num_layers, "layer")
        if self._k_scales is None or self._v_scales is None:
            raise ValueError(f"scales: only an int8 PagedKVCache has scales, this one is {self.dtype}")
        return self._k_scales[index], self._v_scales[index]

    # ---- sequences -------------------------------------------------------------------------

    def add(self, tokens: Sequence[int] | np.ndarray | None = None) -> int:
        """A new, empty sequence; its id. With the prompt's token ids, every full block whose whole
        token prefix is stored already is shared with it (read-only): seq_lens then says how many
        of the prompt's tokens are cached, in every layer, and the caller computes and appends the
        rest. At least the last token is left to compute, so the next step has a query row."""
        token_ids: tuple[int, ...] = ()
        if tokens is not None:
            arr = np.asarray(tokens)
            if arr.ndim != 1 or arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"tokens: expected None or a 1-D sequence of int token ids, got {shape_str(arr.shape)} of {arr.dtype}")
            token_ids = tuple(int(t) for t in arr)
        hashes = self._prefix_hashes(token_ids)
        matched: list[int] = []
        for i, digest in enumerate(hashes):
            block = self._lookup.get(digest)
            if block is None or (i + 1) * self.block_size >= len(token_ids):
                break
            matched.append(block)
        for block in matched:
            self._retain(block)
        sequence = _Sequence(self.num_layers, matched, token_ids, hashes)
        sequence.lens = [len(matched) * self.block_size] * self.num_layers
        sequence.registered = len(matched)
        seq = self._next_id
        self._next_id += 1
        self._sequences[seq] = sequence
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of seq (its lengths and prompt too); its id. Either
        may then append: a shared block is copied before it is written."""
        sequence = self._sequence(seq).copy()
        for block in sequence.blocks:
            self._retain(block)
        new = self._next_id
        self._next_id += 1
        self._sequences[new] = sequence
        return new

    def free(self, seq: int) -> None:
        """Drop sequence seq: its blocks lose a reference; blocks no sequence holds become free,
        those holding a cached prefix stay reusable until their space is needed."""
        sequence = self._sequence(seq)
        del self._sequences[int(seq)]
        # the last blocks first: a long prefix's tail is evicted before the blocks it extends
        for block in reversed(sequence.blocks):
            self._release(block)

    def append(self, seq: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write k (n, Hkv, D) and v (n, Hkv, Dv) at sequence seq's next n positions of layer
        `layer`, in place, in the cache's dtype (float32 states are rounded to nearest, ties to
        even; an int8 cache quantizes them). Blocks are taken as needed; a shared block about to
        be written is copied first. Raises CacheFullError, changing nothing, when too few blocks
        are free."""
        sequence = self._sequence(seq)
        index = layer_index(layer, self.num_layers, "layer")
        keys = self._check_states("k", k, self.head_dim)
        values = self._check_states("v", v, self.value_dim)
        if values.shape[0] != keys.shape[0]:
            raise ValueError(f"v: expected {keys.shape[0]} tokens (k's), got shape {shape_str(values.shape)}")
        start, n = sequence.lens[index], keys.shape[0]
        if n == 0:
            return
        new_blocks, shared = self._blocks_to_take(sequence, index, n)
        needed = new_blocks + len(shared)
        if needed > self.num_free_blocks:
            raise CacheFullError(
                f"PagedKVCache: appending {n} tokens to sequence {int(seq)} (layer {index}, {start} stored) needs {needed} "
                f"free blocks, {self.num_free_blocks} of {self.num_blocks} are free; the cache is unchanged "
                "(free finished sequences, or allocate more blocks)"
            )

        # Checked everything: now change the cache.
        for i in shared:
            sequence.blocks[i] = self._copy_block(sequence.blocks[i])
        for _ in range(new_blocks):
            sequence.blocks.append(self._take())
        positions = np.arange(start, start + n)
        ids = np.asarray(sequence.blocks, np.int64)[positions // self.block_size]
        slots = positions % self.block_size
        if self._k_scales is not None and self._v_scales is not None:
            (keys, key_scale), (values, value_scale) = quantize_kv(keys), quantize_kv(values)
            self._k_scales[index, ids, slots] = key_scale
            self._v_scales[index, ids, slots] = value_scale
        self._keys[index, ids, slots] = keys
        self._values[index, ids, slots] = values
        sequence.lens[index] = start + n
        self._register_full_blocks(sequence)

    def blocks_needed(self, seq: int, layer: int, n: int) -> int:
        """How many free blocks append(seq, layer, ...) of n tokens takes: new blocks past the
        sequence's last, and copies of shared blocks it would write into."""
        new_blocks, shared = self._blocks_to_take(self._sequence(seq), layer_index(layer, self.num_layers, "layer"),
                                                  count("n", n, positive=False))
        return new_blocks + len(shared)

    def _blocks_to_take(self, sequence: _Sequence, layer: int, n: int) -> tuple[int, list[int]]:
        """(new blocks, indices of the shared blocks to copy) for n more tokens in layer `layer`."""
        if n == 0:
            return 0, []
        start = sequence.lens[layer]
        first, last = start // self.block_size, (start + n - 1) // self.block_size
        shared = [i for i in range(first, min(last + 1, len(sequence.blocks))) if self._refs[sequence.blocks[i]] > 1]
        return max(0, last + 1 - len(sequence.blocks)), shared

    def _check_states(self, name: str, states: object, width: int) -> np.ndarray:
        if not isinstance(states, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array (n, Hkv, D), got {type(states).__name__}")
        check_state_dtype(name, states, self.dtype)
        if states.ndim != 3 or states.shape[1:] != (self.num_kv_heads, width):
            raise ValueError(
                f"{name}: expected shape (n, Hkv={self.num_kv_heads}, {'D' if name == 'k' else 'Dv'}={width}), "
                f"got {shape_str(states.shape)}"
            )
        return states

    # ---- blocks ----------------------------------------------------------------------------

    def _prefix_hashes(self, tokens: tuple[int, ...]) -> list[bytes]:
        """For each full block of tokens, a hash of every token up to its end (chained)."""
        hashes: list[bytes] = []
        digest = b""
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            block = np.asarray(tokens[end - self.block_size : end], np.int64).tobytes()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            hashes.append(digest)
        return hashes

    def _register_full_blocks(self, sequence: _Sequence) -> None:
        """Blocks every layer has filled with prompt tokens enter the prefix lookup (unless an
        equal prefix is there already: that block stays this sequence's own)."""
        full = min(min(sequence.lens) // self.block_size, len(sequence.hashes))
        for i in range(sequence.registered, full):
            digest, block = sequence.hashes[i], sequence.blocks[i]
            if digest not in self._lookup and block not in self._block_hash:
                self._lookup[digest] = block
                self._block_hash[block] = digest
        sequence.registered = max(sequence.registered, full)

    def _retain(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._block_hash:
                self._evictable[block] = None  # the most recently used end
            else:
                self._free.append(block)

    def _take(self) -> int:
        """A block for new tokens (reference count 1): an empty one, else the least recently used
        cached prefix, dropped from the lookup. The caller has checked num_free_blocks."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._lookup[self._block_hash.pop(block)]
        self._refs[block] = 1
        return block

    def _copy_block(self, block: int) -> int:
        """Copy-on-write: a private copy of a shared block, every layer; the original loses a reference."""
        copy = self._take()
        for pool in (self._keys, self._values, self._k_scales, self._v_scales):
            if pool is not None:
                pool[:, copy] = pool[:, block]
        self._release(block)
        return copy

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype.name}, "
            f"sequences={len(self._sequences)}, free_blocks={self.num_free_blocks})"
        )
