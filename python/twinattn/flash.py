"""flash-attn 2.x's functions on torch CPU tensors (needs torch): code written for flash-attn runs
on the CPU by changing one import.

    from twinattn.flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The three functions keep flash-attn's signatures, layouts and semantics: q, k, v are (B, L, H, D)
(flash_attn_func, flash_attn_with_kvcache) or packed (total, H, D) (flash_attn_varlen_func);
softmax_scale defaults to 1 / sqrt(D); causal is bottom-right (query row i of a sequence with Lq
queries and Lk keys sits at position Lk - Lq + i), and so are window_size, ALiBi (-slope * |Lk -
Lq + i - j|) and softcap; GQA/MQA by Hq a multiple of Hkv; the log-sum-exp comes back in float32,
(B, Hq, Lq) or (Hq, total_q) for varlen. They are computed by twinattn.torch (exact attention,
float32 accumulation), reading the tensors in place through strided views.

What a CPU cannot honour raises instead of being ignored: dropout_p > 0 (NotImplementedError:
twinattn is for inference and deterministic training, it has no random number stream to match
flash-attn's), cache_leftpad (NotImplementedError), tensors on another device (ValueError).
`deterministic` is accepted: twinattn's backward is always deterministic. `max_seqlen_q`,
`max_seqlen_k` and `num_splits` are flash-attn's launch hints; the lengths come from cu_seqlens
and the CPU kernel splits work itself, so they change nothing.

Backend: flash-attn's signatures have no backend argument, so these functions use the fastest
port built ("auto"); `use_backend("cpp" | "rust" | "numpy" | "auto")` chooses another, as a
context manager (`with twinattn.flash.use_backend("rust"): ...`) or for the rest of the current
context (`twinattn.flash.use_backend("rust")` without `with`).
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, Optional, Tuple, Union

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("twinattn.flash needs torch: pip install torch") from error

from . import torch as _twin
from .core._backends import resolve_backend

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "use_backend"]

_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("twinattn_flash_backend", default="auto")


class use_backend:
    """Chooses the backend of twinattn.flash's functions: "auto" (the default: the fastest port
    built), "cpp", "rust" or "numpy". Called, it sets it for the current context; used as a
    context manager, it restores the previous choice on exit."""

    def __init__(self, backend: str) -> None:
        resolve_backend(backend)  # an unknown or unbuilt name raises here, not at the first call
        self._token = _BACKEND.set(backend)

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *_exc: Any) -> None:
        _BACKEND.reset(self._token)


def _check_tensor(name: str, t: Any, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: twinattn.flash runs on the CPU; expected a CPU tensor, got one on {t.device} (move it with {name}.cpu())")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected {rank} dimensions {layout}, got shape {tuple(t.shape)}")


def _check_dropout(dropout_p: Any) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p: twinattn.flash supports inference and deterministic training only, dropout_p=0.0; got {dropout_p} "
            "(attention dropout would need flash-attn's random number stream on the GPU)"
        )


def _options(q: torch.Tensor, softmax_scale: Optional[float], causal: bool, window_size: Any, softcap: float,
             alibi_slopes: Any) -> dict[str, Any]:
    """flash-attn's keywords as twinattn.torch's (softmax_scale None: 1 / sqrt(headdim))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return dict(causal=causal, scale=scale, window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
                backend=_BACKEND.get(), return_lse=True)


def flash_attn_func(
    q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash_attn.flash_attn_func: q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) CPU
    tensors, float32, float16 or bfloat16 -> out (B, Lq, Hq, Dv) in q's dtype; with
    return_attn_probs, (out, softmax_lse (B, Hq, Lq) float32, None) (the probabilities themselves
    are returned by flash-attn only with dropout, as here: None).

    Differentiable with respect to q, k and v (twinattn's native backward, deterministic). The
    tensors are read in place through transposed views; without gradients the result is written
    straight into flash-attn's layout, with them it is made contiguous once (as flash-attn's).
    """
    _check_dropout(dropout_p)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4, "(batch, seqlen, nheads, headdim)")
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out_t, lse = _twin.attention(qt, kt, vt, **options)
        out = out_t.transpose(1, 2).contiguous()
    else:
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        _, lse = _twin.attention(qt, kt, vt, out=out.transpose(1, 2), **options)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
    return_attn_probs: bool = False, block_table: Any = None,
) -> Any:
    """flash_attn.flash_attn_varlen_func: sequences packed without padding. q (total_q, Hq, D),
    k and v (total_k, Hkv, D / Dv), cu_seqlens_q and cu_seqlens_k int32 (B + 1,) -> out
    (total_q, Hq, Dv) in q's dtype; with return_attn_probs, (out, softmax_lse (Hq, total_q)
    float32, None). With block_table int32 (B, max_blocks), k and v are a paged cache
    (num_blocks, block_size, Hkv, D) and sequence b's keys are its first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] positions in its blocks.

    Without gradients one packed call (twinattn.torch.attention_varlen / attention_paged) does
    every sequence. When q, k or v requires grad (packed k and v only, no block_table), each
    sequence is computed by twinattn.torch.attention on views of the packed tensors and the
    outputs concatenated, so autograd returns packed gradients: a loop over the sequences,
    meant for training (short Python overhead per sequence), not for serving.
    """
    _check_dropout(dropout_p)
    _check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    rank, layout = (3, "(total_k, nheads_k, headdim)") if block_table is None else (4, "(num_blocks, block_size, nheads_k, headdim)")
    _check_tensor("k", k, rank, layout)
    _check_tensor("v", v, rank, layout)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, t, 1, "(batch_size + 1,)")
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if block_table is not None:
        if wants_grad:
            raise NotImplementedError(
                "block_table: a paged cache is for inference; gradients need packed k and v (block_table=None), "
                "or call under torch.no_grad()"
            )
        seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        out, lse = _twin.attention_paged(q, k, v, block_table, seq_lens, cu_seqlens_q=cu_seqlens_q, **options)
    elif wants_grad:
        out, lse = _varlen_by_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    else:
        out, lse = _twin.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    return (out, lse, None) if return_attn_probs else out


def _varlen_by_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        options: dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func with gradients: sequence b is q[cu_q[b]:cu_q[b+1]] viewed as
    (1, Hq, Lq_b, D) against its keys, bottom-right (twinattn's default q_offset); the outputs and
    lses are concatenated along the packed axis."""
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected one shape (B + 1,), got {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    if starts_q[-1] != q.shape[0] or starts_k[-1] != k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q, cu_seqlens_k: expected to end at total_q={q.shape[0]} and total_k={k.shape[0]}, "
            f"got {starts_q[-1]} and {starts_k[-1]}"
        )
    slopes = options.pop("alibi_slopes")
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        rows = slice(starts_q[b], starts_q[b + 1])
        keys = slice(starts_k[b], starts_k[b + 1])
        seq_slopes = slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        out, lse = _twin.attention(q[None, rows].transpose(1, 2), k[None, keys].transpose(1, 2),
                                   v[None, keys].transpose(1, 2), alibi_slopes=seq_slopes, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def flash_attn_with_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
    cache_seqlens: Union[int, Any, None] = None, cache_batch_idx: Any = None, cache_leftpad: Any = None,
    block_table: Any = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
    alibi_slopes: Any = None, num_splits: int = 0, return_softmax_lse: bool = False,
) -> Any:
    """flash_attn.flash_attn_with_kvcache: decode and chunked prefill over a KV cache.

    q (B, Lq, Hq, D). The cache: dense (B_cache, L_cache, Hkv, D / Dv), or paged (num_blocks,
    block_size, Hkv, D / Dv) with block_table int32 (B, max_blocks) (key position p of sequence
    b at cache[block_table[b, p // block_size], p % block_size]). cache_seqlens: an int or an
    int32 tensor (B,), the keys already in the cache (None: L_cache, the whole dense cache);
    cache_batch_idx int32 (B,): the cache rows of the batch (dense cache; None: rows 0..B-1).

    k, v (B, L_new, Hkv, D / Dv), optional: new keys and values, written IN PLACE into the cache
    at positions cache_seqlens .. cache_seqlens + L_new - 1 (through the block table when paged)
    before attending; the sequences then have cache_seqlens + L_new keys. rotary_cos and
    rotary_sin (L_rot, rotary_dim / 2), only with k and v: rotary embedding of q and the new k
    (rotary_dim <= D, the features past it unrotated), interleaved (pairs 2i, 2i + 1) or not
    (pairs i, i + rotary_dim / 2); the new k at positions cache_seqlens + i, q likewise when
    causal or windowed, and otherwise all of q at position cache_seqlens (flash-attn's rule).
    Rotation is computed in float32 and rounded once to q's dtype.

    Queries are bottom-right: row i at position cache_seqlens + L_new - Lq + i. Returns out
    (B, Lq, Hq, Dv) in q's dtype [, softmax_lse (B, Hq, Lq) float32]. Forward only, as
    flash-attn's (the result carries no gradient). num_splits is a performance hint of
    flash-attn's GPU kernel; the CPU kernel splits the key axis itself. cache_leftpad raises
    NotImplementedError: twinattn's dense and paged caches start every sequence at position 0.
    """
    if cache_leftpad is not None:
        raise NotImplementedError(
            "cache_leftpad: twinattn's caches start every sequence's keys at position 0; store the sequences "
            "left-aligned and pass their lengths as cache_seqlens"
        )
    _check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    layout = "(num_blocks, block_size, nheads_k, headdim)" if paged else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    _check_tensor("k_cache", k_cache, 4, layout)
    _check_tensor("v_cache", v_cache, 4, layout)
    batch, seqlen_q = q.shape[0], q.shape[1]
    if paged:
        _check_tensor("block_table", block_table, 2, "(batch, max_blocks)")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not with block_table (the block table already says where each sequence's keys are)")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    lens = _cache_seqlens(cache_seqlens, batch, capacity)
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: pass both, or neither")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos: rotary embedding applies to new keys; pass k and v with it (as flash-attn)")
    rows = torch.arange(batch) if paged else _cache_rows(cache_batch_idx, batch, k_cache.shape[0])  # (paged: unused)
    with torch.no_grad():
        if k is not None:
            _check_tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
            _check_tensor("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
            for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
                if new.dtype != cache.dtype:
                    raise TypeError(f"{name}: expected the cache's dtype {cache.dtype}, got {new.dtype}; convert with {name}.to({cache.dtype})")
                if new.shape[0] != batch or new.shape[2:] != cache.shape[2:] or new.shape[1] != k.shape[1]:
                    raise ValueError(
                        f"{name}: expected shape (batch={batch}, seqlen_new, {', '.join(map(str, cache.shape[2:]))}), got {tuple(new.shape)}"
                    )
            if batch and int(lens.max()) + k.shape[1] > capacity:
                raise ValueError(
                    f"k: cache_seqlens + seqlen_new = {int(lens.max()) + k.shape[1]} exceeds the cache's capacity {capacity}"
                )
            positions = lens[:, None] + torch.arange(k.shape[1], dtype=torch.int64)  # (B, L_new)
            if rotary_cos is not None:
                windowed = tuple(window_size) != (-1, -1)
                q_positions = lens[:, None] + torch.arange(seqlen_q, dtype=torch.int64) if causal or windowed else lens[:, None].expand(batch, seqlen_q)
                q = _rotate(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
                k = _rotate(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
            if paged:
                blocks = torch.gather(block_table.long(), 1, positions // k_cache.shape[1])
                index = (blocks, positions % k_cache.shape[1])
            else:
                index = (rows[:, None].expand_as(positions), positions)
            k_cache[index] = k
            v_cache[index] = v
            lens = lens + k.shape[1]
        options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
        out = q.new_empty(q.shape[:-1] + v_cache.shape[-1:])
        if paged or cache_batch_idx is not None:
            # a dense cache with chosen rows is a paged cache of one block per row (no copy)
            table = block_table if paged else rows[:, None].to(torch.int32)
            cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
            packed_out = out.view(batch * seqlen_q, *out.shape[2:])
            _, lse = _twin.attention_paged(q.reshape(batch * seqlen_q, *q.shape[2:]), k_cache, v_cache, table, lens,
                                           cu_seqlens_q=cu_q, out=packed_out, **options)
            lse = lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1).contiguous()
        else:
            keys = slice(0, batch)
            _, lse = _twin.attention(q.transpose(1, 2), k_cache[keys].transpose(1, 2), v_cache[keys].transpose(1, 2),
                                     kv_lens=lens, out=out.transpose(1, 2), **options)  # q_offset: bottom-right, kv_lens - Lq
    return (out, lse) if return_softmax_lse else out


def _cache_seqlens(cache_seqlens: Any, batch: int, capacity: int) -> torch.Tensor:
    """cache_seqlens as int64 (B,): an int for every sequence, a tensor (B,), or None (capacity)."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int64)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int64)
    elif not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor (batch,), got {cache_seqlens!r}")
    else:
        _check_tensor("cache_seqlens", cache_seqlens, 1, "(batch,)")
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens: expected shape (batch={batch},), got {tuple(cache_seqlens.shape)}")
        lens = cache_seqlens.long()
    if batch and (int(lens.min()) < 0 or int(lens.max()) > capacity):
        raise ValueError(f"cache_seqlens: expected values in [0, {capacity}] (the cache's length), got {lens.tolist()}")
    return lens


def _cache_rows(cache_batch_idx: Any, batch: int, batch_cache: int) -> torch.Tensor:
    if cache_batch_idx is None:
        if batch > batch_cache:
            raise ValueError(f"k_cache: expected at least batch={batch} rows, got {batch_cache}; or pass cache_batch_idx")
        return torch.arange(batch, dtype=torch.int64)
    _check_tensor("cache_batch_idx", cache_batch_idx, 1, "(batch,)")
    if cache_batch_idx.dtype not in (torch.int32, torch.int64) or cache_batch_idx.shape[0] != batch:
        raise ValueError(f"cache_batch_idx: expected an int32 tensor (batch={batch},), got {cache_batch_idx.dtype} {tuple(cache_batch_idx.shape)}")
    rows = cache_batch_idx.long()
    if batch and (int(rows.min()) < 0 or int(rows.max()) >= batch_cache):
        raise ValueError(f"cache_batch_idx: expected rows in [0, {batch_cache}), got {rows.tolist()}")
    return rows


def _rotate(x: torch.Tensor, cos: Any, sin: Any, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (B, L, H, D) rotated at positions (B, L) by the tables cos, sin (L_rot, rotary_dim / 2):
    pair (a, b) -> (a cos - b sin, b cos + a sin), in float32, rounded once to x's dtype.
    (twinattn.nn.RotaryEmbedding computes its own angles from a base; flash-attn passes the tables,
    so the rotation is done here on them.)"""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        _check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos, rotary_sin: expected one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    half = cos.shape[1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {half} exceeds headdim {x.shape[-1]}")
    if positions.numel() and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"rotary_cos: expected at least {int(positions.max()) + 1} rows (the largest position + 1), got {cos.shape[0]}")
    c = cos.float()[positions][:, :, None]  # (B, L, 1, rotary_dim / 2)
    s = sin.float()[positions][:, :, None]
    work = x.float()
    if interleaved:
        first, second = work[..., 0:2 * half:2], work[..., 1:2 * half:2]
    else:
        first, second = work[..., :half], work[..., half:2 * half]
    rotated_first, rotated_second = first * c - second * s, second * c + first * s
    out = work.clone()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = rotated_first, rotated_second
    else:
        out[..., :half], out[..., half:2 * half] = rotated_first, rotated_second
    return out.to(x.dtype)
