"""The NumPy reference: what every native port is checked against.

Written for clarity, not speed. It follows the seeds' algorithm: choose the legal keys first,
subtract the row max, exponentiate, normalise, mix the values. It computes in the inputs' dtype
(float32 or float64); the tests call it in float64.

Shapes (after the Python layer has normalised the call, see twinattn.attention):
    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), q_offset (B,), kv_lens (B,),
    mask None or (B, Hq, Lq, Lk) bool (True = may attend) or float (additive bias)
    -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq)
"""

from __future__ import annotations

from typing import Any

import numpy as np


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool,
    q_offset: np.ndarray,
    kv_lens: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    # Non-finite inputs (NaN, inf, overflowing scores) are the caller's: they propagate into the
    # result as IEEE arithmetic says, without warnings.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _attention_reference(q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens, mask=mask, scale=scale)


def _attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool,
    q_offset: np.ndarray,
    kv_lens: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    dtype = q.dtype
    batch, q_heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads if kv_heads else 1

    # 1. Legal keys: inside the sequence's length, not in its future, allowed by the mask.
    key_index = np.arange(k_len).reshape(1, 1, 1, k_len)
    query_index = np.arange(q_len).reshape(1, 1, q_len, 1)
    visible = key_index < kv_lens.reshape(batch, 1, 1, 1)
    if causal:
        visible = visible & (key_index <= q_offset.reshape(batch, 1, 1, 1) + query_index)
    if mask is not None and mask.dtype == np.bool_:
        visible = visible & mask
    visible = np.broadcast_to(visible, (batch, q_heads, q_len, k_len))

    # Padded keys are never read: whatever their memory holds (NaN too) is replaced by zeros.
    valid_key = (np.arange(k_len)[None, :] < kv_lens[:, None])[:, None, :, None]
    k = np.where(valid_key, k, 0).astype(dtype, copy=False)
    v = np.where(valid_key, v, 0).astype(dtype, copy=False)
    # Query head h reads KV head h // group.
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)

    # 2. Scores of the legal keys; every other key scores -inf.
    scores = (q @ np.swapaxes(k, -1, -2)) * dtype.type(scale)
    if mask is not None and mask.dtype != np.bool_:
        scores = scores + mask.astype(dtype, copy=False)
    legal = visible & (scores != -np.inf)  # a bias of -inf hides a key too
    scores = np.where(legal, scores, dtype.type(-np.inf))

    # 3. Subtract the row max, exponentiate, normalise. A row with no legal key gives zeros.
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    empty_row = row_max == -np.inf
    safe_max = np.where(empty_row, 0, row_max).astype(dtype, copy=False)
    weights = np.where(empty_row, 0, np.exp(scores - safe_max)).astype(dtype, copy=False)
    row_sum = weights.sum(axis=-1, keepdims=True)
    weights = weights / np.where(empty_row, 1, row_sum)

    # 4. Mix the values. A hidden key's value never enters, not even as 0 * NaN: when v holds
    #    non-finite numbers, each row sums over its legal keys alone.
    if np.isfinite(v).all():
        out = weights @ v
    else:
        out = np.zeros(weights.shape[:-1] + v.shape[-1:], dtype=dtype)
        for b, h, i in np.ndindex(*weights.shape[:-1]):
            keys = legal[b, h, i]
            out[b, h, i] = weights[b, h, i, keys] @ v[b, h, keys]
    lse = np.where(empty_row, -np.inf, safe_max + np.log(np.where(empty_row, 1, row_sum)))
    return out.astype(dtype, copy=False), lse[..., 0].astype(dtype, copy=False)


def attention(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """twinattn.attention computed by the NumPy reference (accepts float32 and float64)."""
    from .api import attention as _attention

    kwargs.pop("backend", None)
    return _attention(q, k, v, backend="numpy", **kwargs)
