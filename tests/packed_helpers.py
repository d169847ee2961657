"""Packed and paged problems for the tests, and their check against the dense API.

The truth for a packed or paged call is twinattn.attention on each sequence alone, with its keys
contiguous and its queries at its last positions (the dense default), compared with helpers'
float64-reference tolerances. int8 keys and values are compared against attention over their
dequantized values (float32 q).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

import twinattn
from helpers import HALF_DTYPES, assert_close_to_reference, assert_half_close_to_reference, assert_lse_close, assert_lse_close_half

INT8 = np.dtype(np.int8)


@dataclass
class Packed:
    """Sequences of different lengths: q packed (total_q, Hq, D) with cu_q; per sequence its keys
    and values (Lk_b, Hkv, D / Dv) (int8 payloads with scales (Lk_b, Hkv) when int8)."""

    q: np.ndarray
    cu_q: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]
    k_scales: list[np.ndarray] = field(default_factory=list)
    v_scales: list[np.ndarray] = field(default_factory=list)

    @property
    def int8(self) -> bool:
        return self.keys[0].dtype == INT8

    def packed_kv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """k, v (total_k, Hkv, D / Dv), cu_k, and the packed scales as keywords when int8."""
        cu_k = np.concatenate([[0], np.cumsum([k.shape[0] for k in self.keys])]).astype(np.int64)
        scales = {}
        if self.int8:
            scales = {"k_scale": np.concatenate(self.k_scales), "v_scale": np.concatenate(self.v_scales)}
        return np.concatenate(self.keys), np.concatenate(self.values), cu_k, scales


def random_packed(
    rng: np.random.Generator, q_lens: list[int], k_lens: list[int], *, q_heads: int = 4, kv_heads: int = 2,
    head_dim: int = 8, value_dim: int = 6, dtype: Any = np.float32,
) -> Packed:
    """dtype: float32 / float16 / bfloat16 (q, k, v alike) or int8 (float32 q, int8 k and v)."""
    dtype = np.dtype(dtype)
    float_dtype = np.dtype(np.float32) if dtype == INT8 else dtype
    q = rng.standard_normal((sum(q_lens), q_heads, head_dim)).astype(float_dtype)
    keys = [rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32) for n in k_lens]
    values = [rng.standard_normal((n, kv_heads, value_dim)).astype(np.float32) for n in k_lens]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    if dtype != INT8:
        return Packed(q, cu_q, [k.astype(dtype) for k in keys], [v.astype(dtype) for v in values])
    quantized_k = [twinattn.quantize_kv(k) for k in keys]
    quantized_v = [twinattn.quantize_kv(v) for v in values]
    return Packed(
        q, cu_q, [k for k, _ in quantized_k], [v for v, _ in quantized_v],
        [s for _, s in quantized_k], [s for _, s in quantized_v],
    )


@dataclass
class Paged:
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    scales: dict[str, np.ndarray]


def to_paged(
    rng: np.random.Generator, packed: Packed, block_size: int, *, spare_blocks: int = 3, max_blocks: int | None = None,
    shared_prefix_blocks: int = 0,
) -> Paged:
    """The sequences' keys and values in shuffled blocks of a pool; every slot no sequence uses
    (spare blocks, the tail of a last block) holds NaN (int8: a NaN scale), and table entries past
    a sequence's last block hold -1 or out-of-range ids. shared_prefix_blocks: that many leading
    blocks of sequence 0 are used by every sequence (their keys must be equal: the caller made them)."""
    lens = [k.shape[0] for k in packed.keys]
    counts = [-(-n // block_size) for n in lens]
    own = [c - (shared_prefix_blocks if b else 0) for b, c in enumerate(counts)]
    num_blocks = sum(own) + spare_blocks
    ids = rng.permutation(num_blocks)
    width = max(counts + [1]) + 2 if max_blocks is None else max_blocks
    table = np.full((len(lens), width), -1, np.int32)
    table[:, -1] = num_blocks + 5  # an out-of-range id past every sequence's blocks: never read
    first = packed.keys[0]
    store = np.int8 if packed.int8 else first.dtype
    kv_heads = first.shape[1]
    k_shape = (num_blocks, block_size, kv_heads, first.shape[2])
    v_shape = (num_blocks, block_size, kv_heads, packed.values[0].shape[2])
    scales = {}
    if packed.int8:
        k_cache = rng.integers(-127, 128, k_shape).astype(np.int8)
        v_cache = rng.integers(-127, 128, v_shape).astype(np.int8)
        scales = {name: np.full((num_blocks, block_size, kv_heads), np.nan, np.float32) for name in ("k_scale", "v_scale")}
    else:
        k_cache = np.full(k_shape, np.nan, store)
        v_cache = np.full(v_shape, np.nan, store)
    used = 0
    for b, n in enumerate(lens):
        for j in range(counts[b]):
            if b and j < shared_prefix_blocks:
                table[b, j] = table[0, j]
                continue
            block = int(ids[used])
            used += 1
            table[b, j] = block
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            k_cache[block, : rows.stop - rows.start] = packed.keys[b][rows]
            v_cache[block, : rows.stop - rows.start] = packed.values[b][rows]
            if packed.int8:
                scales["k_scale"][block, : rows.stop - rows.start] = packed.k_scales[b][rows]
                scales["v_scale"][block, : rows.stop - rows.start] = packed.v_scales[b][rows]
    return Paged(k_cache, v_cache, table, np.array(lens, np.int64), scales)


def assert_matches_dense(
    out: np.ndarray, lse: np.ndarray | None, packed: Packed, *, alibi_slopes: np.ndarray | None = None, **kwargs: Any
) -> None:
    """Each sequence's rows of out (and columns of lse) against twinattn.attention's tolerance
    on that sequence alone (its queries bottom-right: the dense default q_offset)."""
    assert out.dtype == packed.q.dtype
    for b in range(len(packed.keys)):
        rows = slice(int(packed.cu_q[b]), int(packed.cu_q[b + 1]))
        if rows.stop == rows.start:
            continue
        q = packed.q[rows].swapaxes(0, 1)
        k, v = packed.keys[b].swapaxes(0, 1), packed.values[b].swapaxes(0, 1)
        if packed.int8:
            k = twinattn.dequantize_kv(packed.keys[b], packed.k_scales[b]).swapaxes(0, 1)
            v = twinattn.dequantize_kv(packed.values[b], packed.v_scales[b]).swapaxes(0, 1)
        extra = dict(kwargs)
        if alibi_slopes is not None:
            extra["alibi_slopes"] = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]
        got = out[rows].swapaxes(0, 1)
        if q.dtype in HALF_DTYPES:
            assert_half_close_to_reference(got, q, k, v, **extra)
        else:
            assert_close_to_reference(got, q, k, v, **extra)
        if lse is not None:
            assert lse.dtype == np.float32 and lse.shape == (packed.q.shape[1], packed.q.shape[0])
            (assert_lse_close_half if q.dtype in HALF_DTYPES else assert_lse_close)(lse[:, rows], q, k, v, **extra)


def assert_bad_call(function: Callable[..., Any], positional: tuple[str, ...], backend: str, arguments: dict[str, Any],
                    error: type, message: str) -> None:
    """function(*the positional arguments, backend=backend, **the rest) raises error matching message."""
    arguments = dict(arguments)
    values = [arguments.pop(name) for name in positional]
    with pytest.raises(error, match=message):
        function(*values, backend=backend, **arguments)
