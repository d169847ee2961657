"""Packed (varlen) and paged attention: many sequences of different lengths in one call.

attention_varlen: flash-attn's varlen layout, sequences packed one after another, no padding:
    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_q (B + 1,),
    cu_seqlens_k (B + 1,) -> out (total_q, Hq, Dv) [, lse (Hq, total_q) float32]
    Sequence b: query rows cu_seqlens_q[b]:cu_seqlens_q[b+1], keys cu_seqlens_k[b]:cu_seqlens_k[b+1].

attention_paged: flash-attn's paged KV layout, each sequence's keys in fixed-size blocks anywhere
in one pool:
    q (total_q, Hq, D), k_cache (num_blocks, block_size, Hkv, D), v_cache (num_blocks,
    block_size, Hkv, Dv), block_table (B, max_blocks) int32, seq_lens (B,),
    cu_seqlens_q (B + 1,) or None (one query row per sequence: decode)
    -> out (total_q, Hq, Dv) [, lse (Hq, total_q) float32]
    Key position j of sequence b lives at cache[block_table[b, j // block_size], j % block_size].

In both, a sequence's queries are its last positions (bottom-right): query row i of sequence b
sits at p = Lk_b - Lq_b + i, which causal, window_size and alibi_slopes use. Arguments shared
with twinattn.attention are checked by the same helpers and with the same messages; what is
checked here (offsets, tables, lengths) is checked once, and every backend gets the same
normalised call: the numpy backend gathers each sequence into contiguous arrays and runs the
float64 reference on it; the native ports read the packed or paged memory in place.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Union, overload

import numpy as np
from numpy.typing import ArrayLike

from . import _checks, reference
from ._backends import native_module
from ._checks import FLOAT32, FLOAT64, INT8, count, dtype_in_code, shape_str
from ._threads import get_num_threads
from .api import _NO_WINDOW, _as_input, _check_like_query, _check_query_dtype, _check_scale, _checked_scale
from .api import _prepare_out, _resolve, _unit_last_stride

__all__ = ["attention_paged", "attention_varlen"]

Result = Union[np.ndarray, "tuple[np.ndarray, np.ndarray]"]
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)


class _Problem:
    """What both functions check alike: flags, q and the key/value dtypes, the variants, scale."""

    def __init__(self, function: str, q: object, causal: object, return_lse: object, backend: object, num_threads: object) -> None:
        self.port = _resolve(backend)
        for name, flag in (("causal", causal), ("return_lse", return_lse)):
            if flag is not True and flag is not False and not isinstance(flag, np.bool_):
                raise TypeError(f"{name}: expected bool, got {type(flag).__name__}")
        self.causal = bool(causal)
        self.return_lse = bool(return_lse)
        self.threads = get_num_threads() if num_threads is None else count("num_threads", num_threads)
        self.function = function
        self.call = "q, k, v, cu_seqlens_q, cu_seqlens_k, ..." if function == "attention_varlen" else "q, k_cache, v_cache, block_table, seq_lens, ..."
        self.int8 = False
        self.q = _unit_last_stride(self.input("q", q, "(total_q, Hq, D)", 3))
        _check_query_dtype(self.q, self.port)
        self.dtype = self.q.dtype
        self.total_q, self.q_heads, self.head_dim = self.q.shape

    def input(self, name: str, value: object, layout: str, rank: int) -> np.ndarray:
        a = value if type(value) is np.ndarray else _as_input(name, value, self.port, self.function, self.call)
        if a.ndim != rank:
            raise ValueError(f"{name}: expected {rank} dimensions {layout}, got shape {shape_str(a.shape)}")
        return a

    def keys_values(self, k: np.ndarray, v: np.ndarray, k_name: str, v_name: str) -> tuple[np.ndarray, np.ndarray]:
        """k and v of q's dtype (or both int8), the query heads a multiple of the KV heads."""
        _check_like_query(k_name, k, self.dtype, k.dtype)
        _check_like_query(v_name, v, self.dtype, k.dtype)
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"{k_name}: expected the last axis D={self.head_dim} (q's), got shape {shape_str(k.shape)}")
        kv_heads = k.shape[-2]
        if kv_heads == 0 and self.q_heads > 0 or kv_heads > 0 and self.q_heads % kv_heads != 0:
            raise ValueError(
                f"q, {k_name}: the query heads Hq={self.q_heads} must be a multiple of the key/value heads Hkv={kv_heads} "
                "(grouped-query attention: query head h reads KV head h // (Hq // Hkv))"
            )
        self.int8 = k.dtype == INT8
        return _unit_last_stride(k), _unit_last_stride(v)

    def variants(
        self, batch: int, scale: object, window_size: object, softcap: object, alibi_slopes: object, sinks: object
    ) -> None:
        window = _NO_WINDOW if window_size is _NO_WINDOW else _checks.window_size(window_size)
        self.window_left, self.window_right = window
        if self.causal and window != _NO_WINDOW:
            self.window_right = 0  # causality already hides every key right of the query
        self.softcap = 0.0 if type(softcap) is float and softcap == 0.0 else _checks.softcap(softcap)
        self.slopes = None
        if alibi_slopes is not None:
            heads = self.q_heads
            slopes = _checks.per_head_floats(
                "alibi_slopes", alibi_slopes, ((heads,), (batch, heads)), f"(Hq={heads},) or (B={batch}, Hq={heads})", self.dtype
            )
            self.slopes = np.broadcast_to(slopes, (batch, heads))  # (Hq,): a stride-0 view
        self.sinks = None
        if sinks is not None:
            self.sinks = _checks.per_head_floats("sinks", sinks, ((self.q_heads,),), f"(Hq={self.q_heads},)", self.dtype)
        if scale is None:
            self.scale = 1.0 / math.sqrt(self.head_dim) if self.head_dim > 0 else 1.0
        else:
            self.scale = _checked_scale(scale, self.dtype)

    def scales(
        self, k_scale: object, v_scale: object, k_dtype: np.dtype, shape: tuple[int, ...], names: tuple[str, ...]
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        if not self.int8 and k_scale is None and v_scale is None:
            return None, None
        return (
            _check_scale("k_scale", k_scale, self.int8, k_dtype, shape, names),
            _check_scale("v_scale", v_scale, self.int8, k_dtype, shape, names),
        )

    def outputs(
        self, out: object, value_dim: int, inputs: list[np.ndarray | None], names: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """out (total_q, Hq, Dv) in q's dtype, given or new; lse (Hq, total_q) float32 (float64 for
        a float64 problem) with return_lse."""
        shape = (self.total_q, self.q_heads, value_dim)
        result = np.empty(shape, self.dtype) if out is None else _prepare_out(out, shape, self.dtype, inputs, names)
        lse = None
        if self.return_lse:
            lse = np.empty((self.q_heads, self.total_q), FLOAT64 if self.dtype == FLOAT64 else FLOAT32)
        return result, lse

    def native_keywords(self) -> dict[str, Any]:
        return dict(
            scale=self.scale, causal=self.causal, num_threads=self.threads, window_left=self.window_left,
            window_right=self.window_right, softcap=self.softcap, alibi_slopes=self.slopes, sinks=self.sinks,
        )

    def reference_sequence(
        self, b: int, rows: slice, result: np.ndarray, lse: np.ndarray | None, k: np.ndarray, v: np.ndarray,
        k_scale: np.ndarray | None, v_scale: np.ndarray | None,
    ) -> None:
        """The float64 reference for sequence b: its queries q[rows] against its contiguous keys
        k, v (Lk, Hkv, D) (and scales (Lk, Hkv)), bottom-right; written into result[rows] and lse."""
        q_len, k_len = rows.stop - rows.start, k.shape[0]
        if q_len == 0:
            return
        # (L, H, D) -> (1, H, L, D), the reference's layout
        q4, k4, v4 = (a.swapaxes(0, 1)[None] for a in (self.q[rows], k, v))
        ks = None if k_scale is None else k_scale.T[None]
        vs = None if v_scale is None else v_scale.T[None]
        ref_out, ref_lse = reference.attention_reference(
            q4, k4, v4, causal=self.causal, q_offset=np.array([k_len - q_len]), kv_lens=np.array([k_len]), mask=None,
            scale=self.scale, window_left=self.window_left, window_right=self.window_right, softcap=self.softcap,
            alibi_slopes=None if self.slopes is None else self.slopes[b : b + 1], sinks=self.sinks, k_scale=ks, v_scale=vs,
        )
        result[rows] = ref_out[0].swapaxes(0, 1)
        if lse is not None:
            lse[:, rows] = ref_lse[0]

    def call_native(self, entry: str, result: np.ndarray, *arguments: Any, **keywords: Any) -> None:
        target = result if result.shape[-1] <= 1 or result.strides[-1] == result.itemsize else np.empty(result.shape, self.dtype)
        getattr(native_module(self.port), entry)(*arguments[:3], target, *arguments[3:], **keywords, **self.native_keywords())
        if target is not result:
            result[...] = target

    def finish(self, result: np.ndarray, lse: np.ndarray | None) -> Result:
        if lse is None:
            return result
        return result, lse


def _int_array(name: str, value: object, dtypes: tuple[np.dtype, ...], layout: str) -> np.ndarray:
    """An integer array argument of one of `dtypes` (a list or tuple is converted to the first)."""
    if isinstance(value, (list, tuple)):
        value = np.asarray(value, dtype=dtypes[0])
    if not isinstance(value, np.ndarray):
        if type(value).__module__.partition(".")[0] == "torch" or not hasattr(value, "__array__"):
            raise TypeError(f"{name}: expected a numpy array {layout} of {' or '.join(map(str, dtypes))}, got {type(value).__name__}")
        value = np.asarray(value)
    if value.dtype not in dtypes:
        raise TypeError(
            f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {value.dtype}; convert with {name}.astype({dtype_in_code(dtypes[0])})"
        )
    return value


def _cu_seqlens(name: str, value: object, total: int, total_name: str, batch: int | None = None) -> np.ndarray:
    """cu_seqlens: int32 or int64 (B + 1,), 0 first, non-decreasing, total last -> int64."""
    cu = _int_array(name, value, (_INT64, _INT32), "(B + 1,)")
    expected = "(B + 1,)" if batch is None else f"(B + 1 = {batch + 1},)"
    if cu.ndim != 1 or cu.shape[0] < 1 or batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name}: expected shape {expected}, got {shape_str(cu.shape)}")
    cu = cu.astype(_INT64, copy=False)
    if cu[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(cu[0])}")
    steps = np.diff(cu)
    if steps.size and steps.min() < 0:
        b = int(np.argmax(steps < 0))
        raise ValueError(
            f"{name}: expected non-decreasing values, got {name}[{b}]={int(cu[b])} > {name}[{b + 1}]={int(cu[b + 1])}"
        )
    if cu[-1] != total:
        raise ValueError(f"{name}: expected the last value {name}[B] == {total_name}={total}, got {int(cu[-1])}")
    return cu


if TYPE_CHECKING:
    from typing_extensions import TypedDict, Unpack

    class _VarlenKeywords(TypedDict, total=False):
        """attention_varlen's keywords other than return_lse, for its overloads."""

        causal: bool
        scale: float | None
        window_size: tuple[int, int]
        softcap: float
        alibi_slopes: ArrayLike | None
        sinks: ArrayLike | None
        out: np.ndarray | None
        backend: str
        num_threads: int | None
        k_scale: ArrayLike | None
        v_scale: ArrayLike | None

    class _PagedKeywords(_VarlenKeywords, total=False):
        """attention_paged's keywords other than return_lse, for its overloads."""

        cu_seqlens_q: ArrayLike | None


# return_lse=False (the default) gives out; return_lse=True gives (out, lse)
@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
    return_lse: Literal[False] = False, **keywords: Unpack[_VarlenKeywords],
) -> np.ndarray: ...
@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
    return_lse: Literal[True], **keywords: Unpack[_VarlenKeywords],
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
    return_lse: bool = False, **keywords: Unpack[_VarlenKeywords],
) -> Result: ...


def attention_varlen(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_lse: bool = False,
    out: np.ndarray | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
    k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None,
) -> Result:
    """Attention over a packed batch of sequences of different lengths (flash-attn's varlen layout).

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
        Every sequence's queries, one after another. float32, float16 or bfloat16 (float64 with
        backend="numpy"), as twinattn.attention.
    k, v : array_like, shapes (total_k, Hkv, D) and (total_k, Hkv, Dv)
        Every sequence's keys and values, one after another; q's dtype, or int8 with k_scale and
        v_scale float32 (total_k, Hkv). Hq must be a multiple of Hkv. Any strides on the first
        two axes (a slice of a fused QKV projection is read in place).
    cu_seqlens_q, cu_seqlens_k : int32 or int64 arrays of shape (B + 1,)
        Cumulative lengths: 0 first, non-decreasing, total_q (total_k) last. Sequence b's queries
        are rows cu_seqlens_q[b]:cu_seqlens_q[b+1], its keys likewise.
    causal : bool, default False
        Bottom-right per sequence: query row i of sequence b sits at position
        p = Lk_b - Lq_b + i (its queries are its last positions) and sees keys j <= p.
    scale, window_size, softcap, alibi_slopes, sinks, out, backend, num_threads
        As twinattn.attention, positions being p above; alibi_slopes (Hq,) or (B, Hq).
    return_lse : bool, default False
        Also return lse (Hq, total_q) float32 (flash-attn's layout).

    Returns
    -------
    out : numpy.ndarray (total_q, Hq, Dv) in q's dtype [, lse (Hq, total_q) float32]

    Raises
    ------
    TypeError, ValueError
        As twinattn.attention for the arguments they share; ValueError for cu_seqlens that do not
        start at 0, decrease, or do not end at total_q / total_k, or of different lengths.
    """
    problem = _Problem("attention_varlen", q, causal, return_lse, backend, num_threads)
    keys = problem.input("k", k, "(total_k, Hkv, D)", 3)
    values = problem.input("v", v, "(total_k, Hkv, Dv)", 3)
    keys, values = problem.keys_values(keys, values, "k", "v")
    total_k, kv_heads = keys.shape[:2]
    if values.shape[:2] != (total_k, kv_heads):
        raise ValueError(f"v: expected shape (total_k={total_k}, Hkv={kv_heads}, Dv), got {shape_str(values.shape)}")
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, problem.total_q, "total_q")
    batch = cu_q.shape[0] - 1
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k", batch)
    problem.variants(batch, scale, window_size, softcap, alibi_slopes, sinks)
    k_scales, v_scales = problem.scales(k_scale, v_scale, keys.dtype, (total_k, kv_heads), ("total_k", "Hkv"))
    result, lse = problem.outputs(
        out, values.shape[2], [problem.q, keys, values, k_scales, v_scales], ("q", "k", "v", "k_scale", "v_scale")
    )

    if problem.port == "numpy":
        for b in range(batch):
            kv = slice(int(cu_k[b]), int(cu_k[b + 1]))
            problem.reference_sequence(
                b, slice(int(cu_q[b]), int(cu_q[b + 1])), result, lse, keys[kv], values[kv],
                None if k_scales is None else k_scales[kv], None if v_scales is None else v_scales[kv],
            )
    else:
        problem.call_native(
            "attention_varlen", result, problem.q, keys, values, cu_q, cu_k, lse=lse, k_scale=k_scales, v_scale=v_scales
        )
    return problem.finish(result, lse)


@overload
def attention_paged(
    q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, block_table: ArrayLike, seq_lens: ArrayLike, *,
    return_lse: Literal[False] = False, **keywords: Unpack[_PagedKeywords],
) -> np.ndarray: ...
@overload
def attention_paged(
    q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, block_table: ArrayLike, seq_lens: ArrayLike, *,
    return_lse: Literal[True], **keywords: Unpack[_PagedKeywords],
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def attention_paged(
    q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, block_table: ArrayLike, seq_lens: ArrayLike, *,
    return_lse: bool = False, **keywords: Unpack[_PagedKeywords],
) -> Result: ...


def attention_paged(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    block_table: ArrayLike,
    seq_lens: ArrayLike,
    *,
    cu_seqlens_q: ArrayLike | None = None,
    causal: bool = True,
    scale: float | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None,
    return_lse: bool = False,
    out: np.ndarray | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
) -> Result:
    """Attention of new queries over keys and values stored in a paged KV cache (flash-attn's
    paged layout; twinattn.PagedKVCache manages one).

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
        The new queries of every sequence, one after another (one row each when decoding).
    k_cache, v_cache : array_like, shapes (num_blocks, block_size, Hkv, D) and (..., Dv)
        The block pools. Any strides on the first three axes (K and V pages may interleave in one
        buffer); q's dtype, or int8 with k_scale and v_scale float32 (num_blocks, block_size, Hkv).
    block_table : int32 array (B, max_blocks)
        Key position j of sequence b lives at cache[block_table[b, j // block_size],
        j % block_size]. Entries past a sequence's last block are never read (-1, say).
    seq_lens : int32 or int64 array (B,)
        Keys of each sequence, the new ones included; at most max_blocks * block_size.
    cu_seqlens_q : None or int32 / int64 array (B + 1,)
        Which rows of q belong to which sequence (as attention_varlen); None means one row per
        sequence (decode). A sequence's queries are its last positions, so one call mixes decode
        steps and prefill chunks: row i of sequence b sits at p = seq_lens[b] - Lq_b + i.
    causal : bool, default True
        Row i of sequence b sees keys j <= p.
    scale, window_size, softcap, alibi_slopes, sinks, out, backend, num_threads
        As twinattn.attention; alibi_slopes (Hq,) or (B, Hq).
    return_lse : bool, default False
        Also return lse (Hq, total_q) float32.

    Sequences whose block_table rows start with the same block ids (a shared prompt, parallel
    samples) share the work on those blocks in the native ports: each shared block is read once
    per call and KV head.

    Returns
    -------
    out : numpy.ndarray (total_q, Hq, Dv) in q's dtype [, lse (Hq, total_q) float32]
    """
    problem = _Problem("attention_paged", q, causal, return_lse, backend, num_threads)
    keys = problem.input("k_cache", k_cache, "(num_blocks, block_size, Hkv, D)", 4)
    values = problem.input("v_cache", v_cache, "(num_blocks, block_size, Hkv, Dv)", 4)
    keys, values = problem.keys_values(keys, values, "k_cache", "v_cache")
    num_blocks, block_size, kv_heads = keys.shape[:3]
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"v_cache: expected shape (num_blocks={num_blocks}, block_size={block_size}, Hkv={kv_heads}, Dv), "
            f"got {shape_str(values.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"k_cache: expected block_size >= 1 (axis 1), got shape {shape_str(keys.shape)}")
    table = _int_array("block_table", block_table, (_INT32, _INT64), "(B, max_blocks)")
    if table.ndim != 2:
        raise ValueError(f"block_table: expected shape (B, max_blocks), got {shape_str(table.shape)}")
    batch, max_blocks = table.shape
    lens = _int_array("seq_lens", seq_lens, (_INT64, _INT32), f"(B={batch},)")
    if lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected shape (B={batch},) (block_table's rows), got {shape_str(lens.shape)}")
    lens = lens.astype(_INT64, copy=False)
    capacity = max_blocks * block_size
    if batch and (lens.min() < 0 or lens.max() > capacity):
        b = int(np.argmax((lens < 0) | (lens > capacity)))
        raise ValueError(
            f"seq_lens: expected values in [0, max_blocks * block_size = {max_blocks} * {block_size} = {capacity}], "
            f"got seq_lens[{b}]={int(lens[b])}"
        )
    # every block a sequence uses must be in the pool; the entries past its last block are never read
    used = np.arange(max_blocks)[None, :] < -(-lens // block_size)[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table: expected block ids in [0, num_blocks={num_blocks}) for the blocks a sequence uses, got "
            f"block_table[{b}, {j}]={int(table[b, j])} (sequence {b} has {int(lens[b])} keys, blocks of {block_size})"
        )
    if table.dtype != _INT32:
        table = np.where(used, table, -1).astype(_INT32)  # ids < num_blocks fit; unused entries become -1
    if cu_seqlens_q is None:
        if problem.total_q != batch:
            raise ValueError(
                f"q: expected one row per sequence (total_q = B = {batch}) without cu_seqlens_q, got shape "
                f"{shape_str(problem.q.shape)}; pass cu_seqlens_q for several rows per sequence"
            )
        cu_q = np.arange(batch + 1, dtype=_INT64)
    else:
        cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, problem.total_q, "total_q", batch)
    q_lens = np.diff(cu_q)
    if batch and (q_lens > lens).any():
        b = int(np.argmax(q_lens > lens))
        raise ValueError(
            f"cu_seqlens_q: sequence {b} has {int(q_lens[b])} query rows but seq_lens[{b}]={int(lens[b])} keys; "
            "the queries are a sequence's last positions, their keys included in seq_lens"
        )
    problem.variants(batch, scale, window_size, softcap, alibi_slopes, sinks)
    k_scales, v_scales = problem.scales(
        k_scale, v_scale, keys.dtype, (num_blocks, block_size, kv_heads), ("num_blocks", "block_size", "Hkv")
    )
    result, lse = problem.outputs(
        out, values.shape[3], [problem.q, keys, values, k_scales, v_scales], ("q", "k_cache", "v_cache", "k_scale", "v_scale")
    )

    if problem.port == "numpy":
        for b in range(batch):
            # gather the sequence's blocks into contiguous (Lk, Hkv, D) arrays
            length = int(lens[b])
            blocks = table[b, : -(-length // block_size)]

            def gather(pool: np.ndarray) -> np.ndarray:
                gathered: np.ndarray = pool[blocks].reshape((-1,) + pool.shape[2:])
                return gathered[:length]

            problem.reference_sequence(
                b, slice(int(cu_q[b]), int(cu_q[b + 1])), result, lse, gather(keys), gather(values),
                None if k_scales is None else gather(k_scales), None if v_scales is None else gather(v_scales),
            )
    else:
        problem.call_native(
            "attention_paged", result, problem.q, keys, values, table, lens, cu_q,
            lse=lse, k_scale=k_scales, v_scale=v_scales,
        )
    return problem.finish(result, lse)
