"""The NumPy reference: what every native port is checked against.

Written for clarity, not speed. It follows the seeds' algorithm: choose the legal keys first,
subtract the row max, exponentiate, normalise, mix the values. It computes in the inputs' dtype
(float32 or float64); the tests call it in float64. float16 and bfloat16 inputs are computed in
float64 from the given (already rounded) values, and out is rounded once to q's dtype (to
nearest, ties to even); lse is float32 then.

Shapes (after the Python layer has normalised the call, see twinattn.attention):
    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), q_offset (B,), kv_lens (B,),
    mask None or (B, Hq, Lq, Lk) bool (True = may attend) or float (additive bias),
    window_left, window_right ints >= -1 (-1 unbounded; the caller caps the right side at 0 under
    causal), softcap >= 0 (0 = off), alibi_slopes None or (B, Hq), sinks None or (Hq,);
    int8 k and v come with k_scale and v_scale (B, Hkv, Lk) float32: the reference dequantizes
    them (float32(x) * scale, in float32) and computes in float64, out rounded to q's dtype
    -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq)

Query row i of sequence b sits at position p = q_offset[b] + i; key j at position j.
Key j is visible to it iff j < kv_lens[b], (not causal or j <= p), (window_left < 0 or
j >= p - window_left), (window_right < 0 or j <= p + window_right), the bool mask allows it and
a float bias is not -inf. The score of a visible key, in this order:
    s = scale * q.k;  s = softcap * tanh(s / softcap) if softcap > 0;
    s -= slope[b, h] * |p - j|;  s += bias[b, h, i, j]
A sink is one more term exp(sinks[h]) in the softmax denominator (and lse) with no value.

Visible keys and non-finite inputs (the rule every backend follows, row by row):
- Key j is visible to row i iff j < kv_lens[b], (not causal or j <= p), inside the window, the bool
  mask (if any) is True and the float bias (if any) is not -inf. A hidden key is never read:
  whatever k, v or the bias hold there (NaN, inf) does not matter. A -inf bias hides a key
  exactly like False, even when its k or v row holds NaN.
- score_j = scale * q_i . k_j + bias_ij for visible keys, in IEEE arithmetic. A score of -inf
  (from inf in q or k) gives the key weight 0 and leaves its value out, as for a hidden key. A
  row with no key scoring above -inf returns zeros and lse = -inf.
- A NaN score (NaN in q_i, in a visible k_j or bias, or inf * 0 in the dot product) makes the
  whole row NaN: every column of out_i, and lse_i.
- Otherwise a score of +inf makes out_i NaN (its weights are inf / inf) and lse_i = +inf (the log
  of an infinite sum).
- NaN or inf in a visible v_j reaches the output columns it is in, for every row that gives key j
  a weight above 0 (p_j * inf = inf; inf - inf = NaN).
The native kernels compute in float32: they follow this rule as long as no finite score
overflows float32 and no key holding a non-finite value has a weight that underflows to 0 there
(a score more than about 87 below its row's max).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._checks import BFLOAT16, FLOAT32, FLOAT64, HALF_DTYPES, INT8

_INT64_MAX = int(np.iinfo(np.int64).max)


def round_to_dtype(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x (float64 or float32) rounded once to float32, float16 or bfloat16: to nearest, ties to
    even, subnormals kept, overflow to inf, NaN stays NaN.

    NumPy rounds float64 to float16 directly; ml_dtypes takes float64 to bfloat16 through float32,
    which rounds twice (1 + 2^-8 + 2^-40 would become 1, not 1 + 2^-7). Rounding to float32 to odd
    first (toward zero, then the last bit set when inexact) keeps the 16 extra bits honest, so the
    second rounding is the only one.
    """
    dtype = np.dtype(dtype)
    if dtype != BFLOAT16 or x.dtype != FLOAT64:
        with np.errstate(over="ignore"):
            return x.astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = np.ascontiguousarray(x, dtype=FLOAT32)
        away = np.abs(x32.astype(FLOAT64)) > np.abs(x)  # rounded away from zero (beyond float32: to inf)
        x32 = np.where(away, np.nextafter(x32, FLOAT32.type(0)), x32)
        inexact = x32.astype(FLOAT64) != x  # NaN too: setting a mantissa bit keeps it NaN
        x32 = (x32.view(np.uint32) | inexact.astype(np.uint32)).view(FLOAT32)
        rounded: np.ndarray = x32.astype(BFLOAT16)
        return rounded


# Non-finite inputs (NaN, inf, overflowing scores) are the caller's: they propagate into the result as
# IEEE arithmetic says, without warnings.
@np.errstate(over="ignore", invalid="ignore", divide="ignore")
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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    if k.dtype == INT8 or q.dtype in HALF_DTYPES:
        if k.dtype == INT8:
            # int8 k and v with float32 scales (B, Hkv, Lk): dequantized in float32 (float32(x) * scale,
            # one rounding), then computed in float64 like a float16 / bfloat16 problem
            assert k_scale is not None and v_scale is not None, "int8 k and v need k_scale and v_scale"
            k = k.astype(FLOAT32) * k_scale[..., None]
            v = v.astype(FLOAT32) * v_scale[..., None]
        # float16 / bfloat16 (and dequantized int8): float64 from the given values (exact), out
        # rounded once to q's dtype, lse float32
        out, lse = attention_reference(
            q.astype(FLOAT64), k.astype(FLOAT64), v.astype(FLOAT64), causal=causal, q_offset=q_offset,
            kv_lens=kv_lens, mask=mask if mask is None or mask.dtype == np.bool_ else mask.astype(FLOAT64),
            scale=scale, window_left=window_left, window_right=window_right, softcap=softcap,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.astype(FLOAT64),
            sinks=None if sinks is None else sinks.astype(FLOAT64),
        )
        return round_to_dtype(out, q.dtype), lse.astype(FLOAT32)

    dtype = q.dtype
    soft = _softmax(
        q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens, mask=mask, scale=scale, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    weights, legal, v, empty_row, safe_max, row_sum = soft.weights, soft.legal, soft.v, soft.empty_row, soft.safe_max, soft.row_sum

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
    lse = np.where(soft.row_max == np.inf, np.inf, lse)  # log of an infinite sum, not inf + log(NaN)
    return out.astype(dtype, copy=False), lse[..., 0].astype(dtype, copy=False)


class _Softmax(NamedTuple):
    """What passes 1-3 give the forward (and the backward, which recomputes them)."""

    weights: np.ndarray  # (B, Hq, Lq, Lk): the softmax weights, 0 for keys that are not legal
    legal: np.ndarray  # (B, Hq, Lq, Lk) bool: visible and scoring above -inf
    k: np.ndarray  # (B, Hq, Lk, D): keys repeated per query head, padding zeroed
    v: np.ndarray  # (B, Hq, Lk, Dv): values likewise
    empty_row: np.ndarray  # (B, Hq, Lq, 1) bool: no legal key and no sink
    safe_max: np.ndarray  # (B, Hq, Lq, 1): the row max, 0 for an empty row
    row_max: np.ndarray  # (B, Hq, Lq, 1): the row max (sink included), -inf for an empty row
    row_sum: np.ndarray  # (B, Hq, Lq, 1): the softmax denominator (sink included) after the max
    capped: np.ndarray | None  # (B, Hq, Lq, Lk): softcap * tanh(s / softcap) with softcap > 0, else None


@np.errstate(over="ignore", invalid="ignore", divide="ignore")
def _softmax(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, q_offset: np.ndarray, kv_lens: np.ndarray,
    mask: np.ndarray | None, scale: float, window_left: int, window_right: int, softcap: float,
    alibi_slopes: np.ndarray | None, sinks: np.ndarray | None,
) -> _Softmax:
    """Passes 1-3 of the reference, on float32 or float64 q, k, v of one dtype."""
    dtype = q.dtype
    batch, q_heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads if kv_heads else 1

    # 1. Visible keys: inside the sequence's length, not in its future, inside the window, allowed
    #    by the mask (a bias of -inf hides a key as False does). Positions: query row i at
    #    p = q_offset[b] + i, key j at j.
    key_index = np.arange(k_len).reshape(1, 1, 1, k_len)
    position = q_offset.reshape(batch, 1, 1, 1) + np.arange(q_len).reshape(1, 1, q_len, 1)
    visible = key_index < kv_lens.reshape(batch, 1, 1, 1)
    if causal:
        visible = visible & (key_index <= position)
    # p - left <= j <= p + right, written as distances so that no side (up to any int) overflows
    if window_left >= 0:
        visible = visible & (position - key_index <= min(window_left, _INT64_MAX))
    if window_right >= 0:
        visible = visible & (key_index - position <= min(window_right, _INT64_MAX))
    if mask is not None:
        visible = visible & (mask if mask.dtype == np.bool_ else mask != -np.inf)
    visible = np.broadcast_to(visible, (batch, q_heads, q_len, k_len))

    # Padded keys are never read: whatever their memory holds (NaN too) is replaced by zeros.
    valid_key = (np.arange(k_len)[None, :] < kv_lens[:, None])[:, None, :, None]
    k = np.where(valid_key, k, 0).astype(dtype, copy=False)
    v = np.where(valid_key, v, 0).astype(dtype, copy=False)
    # Query head h reads KV head h // group.
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)

    # 2. Scores of the visible keys (softcap, then ALiBi, then the bias); a hidden key scores -inf,
    #    whatever q k^T or the bias gave there (NaN from a hidden NaN key, say). A visible key
    #    scoring -inf is left out too: "legal" = visible and scoring above -inf.
    scores = (q @ np.swapaxes(k, -1, -2)) * dtype.type(scale)
    capped = None
    if softcap > 0:
        cap = dtype.type(softcap)
        scores = cap * np.tanh(scores / cap)
        capped = scores
    if alibi_slopes is not None:
        distance = np.abs(position - key_index).astype(dtype)  # (B, 1, Lq, Lk)
        scores = scores - alibi_slopes.astype(dtype, copy=False).reshape(batch, q_heads, 1, 1) * distance
    if mask is not None and mask.dtype != np.bool_:
        scores = scores + mask.astype(dtype, copy=False)
    legal = visible & (scores != -np.inf)
    scores = np.where(legal, scores, dtype.type(-np.inf))

    # 3. Subtract the row max, exponentiate, normalise. A sink is one more (virtual) score in the
    #    max and the denominator, with no value. A row with no legal key and no sink gives zeros.
    #    The max propagates NaN, so a NaN score makes the row NaN; a +inf max gives inf - inf = NaN.
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    if sinks is not None:
        sink = np.broadcast_to(sinks.astype(dtype, copy=False).reshape(1, q_heads, 1, 1), row_max.shape)
        row_max = np.maximum(row_max, sink)
    empty_row = row_max == -np.inf
    safe_max = np.where(empty_row, 0, row_max).astype(dtype, copy=False)
    weights = np.where(empty_row, 0, np.exp(scores - safe_max)).astype(dtype, copy=False)
    row_sum = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + np.where(empty_row, 0, np.exp(sink - safe_max))
    weights = weights / np.where(empty_row, 1, row_sum)
    return _Softmax(weights, legal, k, v, empty_row, safe_max, row_max, row_sum, capped)


@np.errstate(over="ignore", invalid="ignore", divide="ignore")
def attention_backward_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    *,
    dlse: np.ndarray | None = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The exact gradient of attention_reference, computed in float64 whatever the inputs' dtype.

    q, k, v and the options (causal, q_offset, kv_lens, mask, scale, window_left, window_right,
    softcap, alibi_slopes, sinks) as attention_reference takes them (float32, float16, bfloat16 or
    float64; no int8: quantized keys and values carry no gradient); dout (B, Hq, Lq, Dv) the
    gradient of the loss with respect to out, dlse None or (B, Hq, Lq) that with respect to lse
    -> dq, dk, dv in q's dtype (rounded once), dsinks (Hq,) (float32; float64 for a float64
    problem) with sinks, else None. The float mask (bias) and alibi_slopes get no gradient.

    With P the softmax weights (the sink's weight P_sink = exp(sinks[h] - lse)) and
    D = rowsum(dout * out) - dlse:
        dv = P^T dout;  dP = dout v^T;  dS = P * (dP - D);
        softcap: dS *= 1 - (capped / softcap)^2 (tanh's derivative, capped the score after
        softcap, before ALiBi and the bias);  dq = scale * dS k;  dk = scale * dS^T q;
        dsinks[h] = -sum over b, i of P_sink * D.
    GQA: dk and dv are summed over the query heads of each group. Keys that are not legal
    (hidden, padding, scoring -inf) get no weight and so no gradient; a row with no legal key
    gives zero gradients.
    """
    q64, k64, v64, dout64 = (a.astype(FLOAT64) for a in (q, k, v, dout))
    dlse64 = None if dlse is None else dlse.astype(FLOAT64)
    options = {**options}
    for name in ("alibi_slopes", "sinks", "mask"):
        value = options.get(name)
        if value is not None and value.dtype != np.bool_:
            options[name] = value.astype(FLOAT64)
    options.setdefault("window_left", -1)
    options.setdefault("window_right", -1)
    options.setdefault("softcap", 0.0)
    sinks64 = options.setdefault("sinks", None)
    options.setdefault("alibi_slopes", None)
    softcap, scale = options["softcap"], options["scale"]
    soft = _softmax(q64, k64, v64, **options)
    legal = soft.legal
    weights = np.where(legal, soft.weights, 0)
    # a key that is not legal enters nothing, not even as 0 * NaN
    used_key = np.any(legal, axis=2, keepdims=True).swapaxes(-1, -2)  # (B, Hq, Lk, 1): legal for some row
    k_legal = np.where(used_key, soft.k, 0)
    v_legal = np.where(used_key, soft.v, 0)
    out = weights @ v_legal
    row_dot = np.sum(dout64 * out, axis=-1, keepdims=True)  # D, (B, Hq, Lq, 1)
    if dlse64 is not None:
        row_dot = row_dot - dlse64[..., None]
    dv_heads = np.swapaxes(weights, -1, -2) @ dout64
    dweights = np.where(legal, dout64 @ np.swapaxes(v_legal, -1, -2), 0)
    dscores = weights * (dweights - row_dot)
    if soft.capped is not None:
        dscores = dscores * np.where(legal, 1 - (soft.capped / softcap) ** 2, 0)
    dq = scale * (dscores @ k_legal)
    dk_heads = scale * (np.swapaxes(dscores, -1, -2) @ q64)

    batch, q_heads = q.shape[:2]
    kv_heads = k.shape[1]
    group = q_heads // kv_heads if kv_heads else 1
    dk = dk_heads.reshape(batch, kv_heads, group, *dk_heads.shape[2:]).sum(axis=2)
    dv = dv_heads.reshape(batch, kv_heads, group, *dv_heads.shape[2:]).sum(axis=2)

    dsinks = None
    if sinks64 is not None:
        lse = np.where(soft.empty_row, -np.inf, soft.safe_max + np.log(np.where(soft.empty_row, 1, soft.row_sum)))
        sink_weight = np.where(soft.empty_row, 0, np.exp(sinks64.reshape(1, q_heads, 1, 1) - lse))
        dsinks = -np.sum(sink_weight * row_dot, axis=(0, 2, 3)).astype(FLOAT64 if q.dtype == FLOAT64 else FLOAT32)
    grads = tuple(round_to_dtype(g, q.dtype) if q.dtype != FLOAT64 else g for g in (dq, dk, dv))
    return grads[0], grads[1], grads[2], dsinks
