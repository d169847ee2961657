"""What the gradient tests share: small asymmetric problems with every feature of the forward
(B 2, Hq 4, Hkv 2, Lq 3, Lk 5, D 3, Dv 2, so that a transposed axis, a wrong group or a wrong key
cannot hide), and a dense torch implementation of attention that autograd differentiates (the
yardstick of what float32 and torch's arithmetic cost on the same problem)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

B, HQ, HKV, LQ, LK, D, DV = 2, 4, 2, 3, 5, 3, 2


def _cases() -> dict[str, Callable[[np.random.Generator], dict[str, Any]]]:
    """Keyword sets of the forward, each a function of a random generator."""
    def bool_mask(rng: np.random.Generator) -> np.ndarray:
        mask = rng.random((B, 1, LQ, LK)) < 0.6
        mask[0, 0, 1] = False  # a row with no visible key
        return mask

    def float_mask(rng: np.random.Generator) -> np.ndarray:
        bias = rng.standard_normal((B, HQ, LQ, LK))
        bias[rng.random(bias.shape) < 0.3] = -np.inf
        return bias

    def slopes(rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(0.1, 1.0, HQ)

    def sinks(rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(HQ)

    return {
        "plain": lambda rng: {},
        "causal": lambda rng: {"causal": True},
        "causal-q_offset": lambda rng: {"causal": True, "q_offset": np.array([0, 1])},
        "kv_lens": lambda rng: {"kv_lens": np.array([LK, 3])},
        "bool-mask": lambda rng: {"attn_mask": bool_mask(rng)},
        "float-mask": lambda rng: {"attn_mask": float_mask(rng)},
        "window": lambda rng: {"window_size": (1, 1)},
        "window-causal": lambda rng: {"window_size": (1, 0), "causal": True},
        "softcap": lambda rng: {"softcap": 1.5, "scale": 1.3},
        "alibi": lambda rng: {"alibi_slopes": slopes(rng)},
        "alibi-per-sequence": lambda rng: {"alibi_slopes": rng.uniform(0.1, 1.0, (B, HQ))},
        "sinks": lambda rng: {"sinks": sinks(rng)},
        "empty-rows": lambda rng: {"causal": True, "q_offset": 0, "kv_lens": np.array([0, 2])},
        "empty-rows-sinks": lambda rng: {"causal": True, "q_offset": 0, "kv_lens": np.array([0, 2]), "sinks": sinks(rng)},
        "everything": lambda rng: {
            "causal": True, "q_offset": np.array([1, 2]), "kv_lens": np.array([4, LK]), "attn_mask": float_mask(rng),
            "window_size": (2, 0), "softcap": 2.0, "alibi_slopes": slopes(rng), "sinks": sinks(rng),
        },
    }


CASES = _cases()


def problem(case: str, seed: int = 0, dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in ((B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, DV)))
    kwargs = CASES[case](rng)
    for name in ("alibi_slopes", "sinks"):
        if name in kwargs:
            kwargs[name] = kwargs[name].astype(np.float64 if dtype == np.float64 else np.float32)
    if "attn_mask" in kwargs and kwargs["attn_mask"].dtype != np.bool_:
        kwargs["attn_mask"] = kwargs["attn_mask"].astype(np.float64 if dtype == np.float64 else np.float32)
    return q, k, v, kwargs


def math_attention(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """twinattn.torch.attention's result written densely in torch ops (autograd differentiates
    it), in q's dtype: scores, softcap, ALiBi and the bias, the visible keys, the sink as one more
    column of the softmax. Rows with no visible key give zeros (and zero gradients)."""
    import torch

    batch, q_heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    visible, bias = dense_mask(tuple(q.shape), tuple(k.shape), **kwargs)
    visible_t = torch.from_numpy(np.ascontiguousarray(visible))
    group = q_heads // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = kwargs.get("scale") or head_dim**-0.5
    scores = scale * (q @ k_rep.transpose(-1, -2))
    softcap = kwargs.get("softcap", 0.0)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + torch.from_numpy(bias).to(q.dtype)
    any_visible = visible_t.any(-1, keepdim=True)
    scores = torch.where(visible_t, scores, float("-inf"))
    scores = torch.where(any_visible, scores, 0.0)  # a row with no key: finite, then zeroed
    sinks = kwargs.get("sinks")
    if sinks is not None:
        sink_t = sinks if isinstance(sinks, torch.Tensor) else torch.from_numpy(sinks)
        sink_column = sink_t.to(q.dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, q_len, 1)
        scores = torch.cat([torch.where(any_visible, scores, float("-inf")), sink_column], -1)
        weights = torch.softmax(scores, -1)[..., :-1]
    else:
        weights = torch.where(any_visible, torch.softmax(scores, -1), 0.0)
    return weights @ v_rep


def dense_mask(q_shape: tuple[int, ...], k_shape: tuple[int, ...], **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """The forward's keywords as a dense problem: visible (B, Hq, Lq, Lk) bool and the additive
    float64 bias (ALiBi and a float mask's finite part) of the same shape."""
    batch, q_heads, q_len, _ = q_shape
    k_len = k_shape[2]
    causal = kwargs.get("causal", False)
    lens = np.broadcast_to(np.asarray(kwargs.get("kv_lens", k_len)), (batch,))
    left, right = kwargs.get("window_size", (-1, -1))
    slopes = kwargs.get("alibi_slopes")
    offset = kwargs.get("q_offset")
    offsets = lens - q_len if offset is None else np.broadcast_to(np.asarray(offset), (batch,))
    position = offsets[:, None, None, None] + np.arange(q_len)[None, None, :, None]
    key = np.arange(k_len)[None, None, None, :]
    visible = np.broadcast_to(key < lens[:, None, None, None], (batch, q_heads, q_len, k_len))
    if causal:
        visible = visible & (key <= position)
    if left >= 0:
        visible = visible & (position - key <= left)
    if right >= 0 and not causal:
        visible = visible & (key - position <= right)
    mask = kwargs.get("attn_mask")
    bias = np.zeros((batch, q_heads, q_len, k_len))
    if mask is not None and mask.dtype == np.bool_:
        visible = visible & mask
    elif mask is not None:
        visible = visible & (mask != -np.inf)
        bias = bias + np.where(mask == -np.inf, 0, mask)
    if slopes is not None:
        bias = bias - np.broadcast_to(np.asarray(slopes, np.float64), (batch, q_heads))[:, :, None, None] * np.abs(position - key)
    return np.ascontiguousarray(visible), bias
