"""A preallocated key/value cache for incremental decoding.

Per layer: keys and values (B, Hkv, max_seq_len, D), and the number of tokens each sequence has
stored, tracked as integers (never inferred from the data: a stored zero vector is a token).
`update` writes each sequence's new tokens at that sequence's own length and returns views over
the stored prefix, which twinattn.attention reads in place with kv_lens = seq_lens(layer):

    cache = KVCache(num_layers=1, batch_size=2, num_kv_heads=8, head_dim=128, max_seq_len=4096)
    q_offset = cache.seq_lens(0)                         # where the new tokens go
    keys, values = cache.update(k_new, v_new, 0)         # (B, Hkv, max(seq_lens), D) views
    out = twinattn.attention(q, keys, values, causal=True, q_offset=q_offset, kv_lens=cache.seq_lens(0))

Payload bytes: kv_cache_bytes(layers, batch, kv_heads, head_dim=..., tokens=..., bytes_per_entry=...),
2 x layers x batch x KV heads x head width x tokens x bytes per entry.

dtype: float32 (the default), float16 or bfloat16 (ml_dtypes.bfloat16), which halve the bytes the
cache holds and decode streams; float64 too, for backend="numpy". update() takes states in the
cache's dtype or float32 (what projections give) and rounds them to nearest, ties to even.

dtype="int8" (or np.int8) stores keys and values as int8 with one float32 scale per (sequence, KV
head, token) for each (twinattn.quantize_kv, applied by update to float32, float16 or bfloat16
states): a quarter of float32's payload plus 4 bytes per token and head for each of K and V.
Attention reads the int8 views in place with their scales:

    keys, values = cache.update(k_new, v_new, 0)
    k_scale, v_scale = cache.scales(0)                   # (B, Hkv, max(seq_lens)) float32 views
    out = twinattn.attention(q, keys, values, k_scale=k_scale, v_scale=v_scale, ...)
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import numpy as np

from ..core._checks import ATTENTION_DTYPES, ATTENTION_DTYPES_TEXT, FLOAT32, INT8, count, shape_str, storage_dtype
from ..core.quant import quantize_kv

__all__ = ["CacheOverflowError", "KVCache", "kv_cache_bytes"]


class CacheOverflowError(ValueError):
    """An update would store more tokens than max_seq_len; the cache is left unchanged."""


_KV_CACHE_BYTES_OLD_ORDER = ("tokens", "head_dim", "bytes_per_entry")


def kv_cache_bytes(
    layers: int,
    batch: int,
    kv_heads: int,
    *deprecated_positional: int,
    head_dim: int | None = None,
    tokens: int | None = None,
    bytes_per_entry: int | None = None,
) -> int:
    """Payload bytes of a dense KV cache: 2 x layers x batch x kv_heads x head_dim x tokens x
    bytes_per_entry (the 2 is keys and values; allocator overhead and metadata excluded).

    head_dim, tokens and bytes_per_entry are keyword-only, named in the order of
    KVCache(num_layers, batch_size, num_kv_heads, head_dim, max_seq_len): two ints of the same
    kind cannot be told apart by position, so naming them is what keeps them from being swapped.

    >>> kv_cache_bytes(32, 1, 8, head_dim=128, tokens=4096, bytes_per_entry=2) == 512 * 2**20
    True

    The former all-positional order kv_cache_bytes(layers, batch, kv_heads, tokens, head_dim,
    bytes_per_entry) still works and gives the same bytes, with a DeprecationWarning.

    Raises TypeError for a count that is not an int (or a missing one), ValueError for a
    negative one.
    """
    named = {"head_dim": head_dim, "tokens": tokens, "bytes_per_entry": bytes_per_entry}
    if deprecated_positional:
        if len(deprecated_positional) > len(_KV_CACHE_BYTES_OLD_ORDER):
            raise TypeError(
                f"kv_cache_bytes: expected at most 6 arguments, got {3 + len(deprecated_positional)} positional ones"
            )
        warnings.warn(
            "kv_cache_bytes(layers, batch, kv_heads, tokens, head_dim, bytes_per_entry) with positional "
            "tokens and head_dim is deprecated: name them, in KVCache's order: "
            "kv_cache_bytes(layers, batch, kv_heads, head_dim=..., tokens=..., bytes_per_entry=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        for name, value in zip(_KV_CACHE_BYTES_OLD_ORDER, deprecated_positional):
            if named[name] is not None:
                raise TypeError(f"kv_cache_bytes: got {name} both by position and by keyword")
            named[name] = value
    missing = [name for name, value in named.items() if value is None]
    if missing:
        raise TypeError(f"kv_cache_bytes: missing keyword argument(s) {', '.join(missing)}")
    counts: dict[str, object] = {"layers": layers, "batch": batch, "kv_heads": kv_heads, **named}
    total = 2
    for name, given in counts.items():
        total *= count(name, given, positive=False)
    return total


class KVCache:
    """Keys and values of `num_layers` attention layers for a batch of sequences.

    Every layer keeps its own per-sequence lengths: a model updates layer 0, then layer 1, ...,
    and each layer's new tokens go at that layer's lengths.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: Any = np.float32,
    ) -> None:
        self.num_layers = count("num_layers", num_layers)
        self.batch_size = count("batch_size", batch_size, positive=False)
        self.num_kv_heads = count("num_kv_heads", num_kv_heads)
        self.head_dim = count("head_dim", head_dim)
        self.max_seq_len = count("max_seq_len", max_seq_len, positive=False)
        self.dtype = _cache_dtype(dtype)
        shape = (self.num_layers, self.batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim)
        # np.zeros maps pages lazily: untouched capacity costs no memory until written.
        self._keys = np.zeros(shape, dtype=self.dtype)
        self._values = np.zeros(shape, dtype=self.dtype)
        # int8: the scales beside the payload, one per (layer, sequence, KV head, token)
        self._k_scales = self._v_scales = None
        if self.dtype == INT8:
            self._k_scales = np.zeros(shape[:-1], dtype=FLOAT32)
            self._v_scales = np.zeros(shape[:-1], dtype=FLOAT32)
        self._lens = np.zeros((self.num_layers, self.batch_size), dtype=np.int64)

    # ---- inspection ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated keys and values: kv_cache_bytes(num_layers, batch_size,
        num_kv_heads, head_dim=head_dim, tokens=max_seq_len, bytes_per_entry=dtype.itemsize),
        plus for int8 the float32 scales: kv_cache_bytes(..., head_dim=1, tokens=max_seq_len,
        bytes_per_entry=4)."""
        scales = 0 if self._k_scales is None or self._v_scales is None else self._k_scales.nbytes + self._v_scales.nbytes
        return int(self._keys.nbytes + self._values.nbytes + scales)

    def _layer(self, layer_idx: object) -> int:
        return layer_index(layer_idx, self.num_layers)

    def seq_lens(self, layer_idx: int = 0) -> np.ndarray:
        """Tokens stored per sequence in this layer, int64 (B,) (a copy)."""
        lens: np.ndarray = self._lens[self._layer(layer_idx)]
        return lens.copy()

    def positions(self, num_new: int, layer_idx: int = 0) -> np.ndarray:
        """Absolute positions (B, num_new) of the next num_new tokens of each sequence:
        seq_lens(layer_idx)[:, None] + arange(num_new)."""
        num_new = count("num_new", num_new, positive=False)
        lens: np.ndarray = self._lens[self._layer(layer_idx)]
        return lens[:, None] + np.arange(num_new, dtype=np.int64)

    def keys(self, layer_idx: int = 0) -> np.ndarray:
        """View (B, Hkv, max(seq_lens), D) of this layer's stored keys."""
        layer = self._layer(layer_idx)
        return self._keys[layer, :, :, : self._stored(layer)]

    def values(self, layer_idx: int = 0) -> np.ndarray:
        """View (B, Hkv, max(seq_lens), D) of this layer's stored values."""
        layer = self._layer(layer_idx)
        return self._values[layer, :, :, : self._stored(layer)]

    def scales(self, layer_idx: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """int8 caches: views (k_scale, v_scale), each (B, Hkv, max(seq_lens)) float32, of this
        layer's scales, to pass to attention with keys() and values()."""
        layer = self._layer(layer_idx)
        if self._k_scales is None or self._v_scales is None:
            raise ValueError(f"scales: only an int8 KVCache has scales, this one is {self.dtype}")
        stored = self._stored(layer)
        return self._k_scales[layer, :, :, :stored], self._v_scales[layer, :, :, :stored]

    def _stored(self, layer: int) -> int:
        return int(self._lens[layer].max()) if self.batch_size else 0

    # ---- writing ---------------------------------------------------------------------------

    def _check_states(self, name: str, states: object) -> np.ndarray:
        if not isinstance(states, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array (B, Hkv, L, D), got {type(states).__name__}")
        check_state_dtype(name, states, self.dtype)
        expected = (self.batch_size, self.num_kv_heads, self.head_dim)
        if states.ndim != 4 or (states.shape[0], states.shape[1], states.shape[3]) != expected:
            raise ValueError(
                f"{name}: expected shape (B={self.batch_size}, Hkv={self.num_kv_heads}, L, D={self.head_dim}), "
                f"got {shape_str(states.shape)}"
            )
        return states

    def update(
        self,
        key_states: np.ndarray,
        value_states: np.ndarray,
        layer_idx: int,
        *,
        num_new: object = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Append key_states and value_states (B, Hkv, L, D) to layer layer_idx, each sequence's
        tokens at its own length, and return (keys, values): views (B, Hkv, max(seq_lens), D) of
        the stored prefix, in the cache's dtype. The states are in the cache's dtype or float32;
        float32 states are rounded to the cache's dtype (to nearest, ties to even) as they are
        stored. An int8 cache takes float32, float16 or bfloat16 states and stores
        twinattn.quantize_kv of each (the scales: scales(layer_idx)). Sequence b's keys past seq_lens(layer_idx)[b] are not its own (pass
        kv_lens=seq_lens(layer_idx) to attention).

        num_new: None (every sequence appends all L tokens) or an int array (B,) with
        0 <= num_new[b] <= L: sequence b appends only its first num_new[b] tokens, the rest of
        its rows being right padding (a batch of prompts of different lengths).

        Raises CacheOverflowError, leaving the cache unchanged, if a sequence would exceed
        max_seq_len.
        """
        layer = self._layer(layer_idx)
        keys = self._check_states("key_states", key_states)
        values = self._check_states("value_states", value_states)
        if values.shape != keys.shape:
            raise ValueError(f"value_states: expected the shape of key_states {shape_str(keys.shape)}, got {shape_str(values.shape)}")
        length = keys.shape[2]
        counts = new_token_counts(num_new, self.batch_size, length)

        lens = self._lens[layer]
        ends = lens + counts
        if ends.size and ends.max() > self.max_seq_len:
            over = [b for b in range(self.batch_size) if ends[b] > self.max_seq_len]
            raise CacheOverflowError(
                f"KVCache layer {layer}: appending {counts.tolist()} tokens to sequences of lengths "
                f"{lens.tolist()} exceeds max_seq_len={self.max_seq_len} for sequence(s) {over}; "
                "the cache is unchanged (crop, reset, or allocate a longer cache)"
            )

        # Checked everything: now write. Equal lengths take one slice assignment.
        stores: list[tuple[np.ndarray, np.ndarray]] = [(self._keys[layer], keys), (self._values[layer], values)]
        if self._k_scales is not None and self._v_scales is not None:
            (key_payload, key_scale), (value_payload, value_scale) = quantize_kv(keys), quantize_kv(values)
            stores = [(self._keys[layer], key_payload), (self._values[layer], value_payload),
                      (self._k_scales[layer], key_scale), (self._v_scales[layer], value_scale)]
        if self.batch_size and (lens == lens[0]).all() and (counts == length).all():
            start = int(lens[0])
            for store, new in stores:
                store[:, :, start : start + length] = new
        else:
            for b in range(self.batch_size):
                start, count = int(lens[b]), int(counts[b])
                for store, new in stores:
                    store[b, :, start : start + count] = new[b, :, :count]
        self._lens[layer] = ends
        return self.keys(layer), self.values(layer)

    # ---- editing ---------------------------------------------------------------------------

    def crop(self, n: int) -> None:
        """Keep at most the first n tokens of every sequence in every layer (speculative decoding
        rollback). n >= 0; sequences already shorter are unchanged."""
        n = count("n", n, positive=False)
        np.minimum(self._lens, n, out=self._lens)

    def reset(self, batch_idx: object = None) -> None:
        """Empty every sequence (batch_idx=None), or the sequence(s) batch_idx (an int or a list of
        ints), in every layer, so a finished sequence's slot can take a new prompt."""
        if batch_idx is None:
            self._lens[:] = 0
            return
        arr = np.asarray(batch_idx)
        if arr.dtype.kind not in "iu" or arr.ndim > 1:
            raise TypeError(f"batch_idx: expected None, an int or a 1-D int array, got {batch_idx!r}")
        arr = arr.reshape(-1).astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.batch_size):
            raise IndexError(f"batch_idx: expected values in [0, batch_size={self.batch_size}), got {arr.tolist()}")
        self._lens[:, arr] = 0

    def reorder(self, indices: object) -> None:
        """Beam search: sequence b becomes the former sequence indices[b] (keys, values and lengths,
        every layer). indices is an int array (B,) with values in [0, B); repeats are allowed."""
        arr = np.asarray(indices)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"indices: expected an int array of shape (B={self.batch_size},), got dtype {arr.dtype}")
        if arr.shape != (self.batch_size,):
            raise ValueError(f"indices: expected an int array of shape (B={self.batch_size},), got shape {shape_str(arr.shape)}")
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.batch_size):
            raise IndexError(f"indices: expected values in [0, batch_size={self.batch_size}), got {arr.tolist()}")
        stored = int(self._lens.max()) if self._lens.size else 0
        # Fancy indexing gathers into a temporary before the assignment, so overlapping moves are safe.
        self._keys[:, :, :, :stored] = self._keys[:, arr, :, :stored]
        self._values[:, :, :, :stored] = self._values[:, arr, :, :stored]
        if self._k_scales is not None and self._v_scales is not None:
            self._k_scales[:, :, :, :stored] = self._k_scales[:, arr, :, :stored]
            self._v_scales[:, :, :, :stored] = self._v_scales[:, arr, :, :stored]
        self._lens[:] = self._lens[:, arr]

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, dtype={self.dtype.name}, "
            f"seq_lens(0)={self._lens[0].tolist()})"
        )


def new_token_counts(num_new: object, batch: int, length: int) -> np.ndarray:
    """num_new: None (every sequence appends all L tokens) or an int array (B,) in [0, L] -> int64 (B,)."""
    if num_new is None:
        return np.full(batch, length, dtype=np.int64)
    counts_arr = np.asarray(num_new)
    if counts_arr.dtype.kind not in "iu":
        raise TypeError(f"num_new: expected an int array of shape (B={batch},), got dtype {counts_arr.dtype}")
    if counts_arr.shape != (batch,):
        raise ValueError(f"num_new: expected an int array of shape (B={batch},), got shape {shape_str(counts_arr.shape)}")
    counts = counts_arr.astype(np.int64)
    if counts.size and (counts.min() < 0 or counts.max() > length):
        raise ValueError(f"num_new: expected values in [0, L={length}], got {counts.tolist()}")
    return counts


def layer_index(layer_idx: object, num_layers: int, name: str = "layer_idx") -> int:
    """A layer argument: an int in [0, num_layers)."""
    if isinstance(layer_idx, (bool, np.bool_)) or not isinstance(layer_idx, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(layer_idx).__name__}")
    if not 0 <= int(layer_idx) < num_layers:
        raise IndexError(f"{name}: expected 0 <= {name} < num_layers={num_layers}, got {int(layer_idx)}")
    return int(layer_idx)


def check_state_dtype(name: str, states: np.ndarray, cache_dtype: np.dtype) -> None:
    """New keys or values for a cache: its dtype or float32 (rounded as stored); for an int8 cache
    float32, float16 or bfloat16 (quantized as stored)."""
    if cache_dtype == INT8:
        if states.dtype not in ATTENTION_DTYPES:
            raise TypeError(f"{name}: expected dtype {ATTENTION_DTYPES_TEXT} (quantized to the int8 cache as it is stored), got {states.dtype}")
    elif states.dtype != cache_dtype and states.dtype != FLOAT32:
        also = "" if cache_dtype == FLOAT32 else f" or float32 (rounded to {cache_dtype} as it is stored)"
        raise TypeError(f"{name}: expected dtype {cache_dtype} (the cache's){also}, got {states.dtype}")


def _cache_dtype(value: object) -> np.dtype:
    """KVCache's dtype: float32, float16, bfloat16, float64 (backend="numpy") or int8 (with scales)."""
    try:
        if np.dtype(value) == INT8:  # type: ignore[call-overload]
            return INT8
    except TypeError:
        pass
    try:
        return storage_dtype("dtype", value, float64_too=True)
    except TypeError as exc:
        raise TypeError(f"{exc}, or int8 (quantized with scales)") from None
