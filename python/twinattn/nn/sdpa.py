"""torch.nn.functional.scaled_dot_product_attention's signature and semantics, on NumPy arrays.

    out = twinattn.scaled_dot_product_attention(q, k, v, is_causal=True)   # q (N, ..., L, E)

Where torch's behaviour would be a silent surprise, this raises instead:
- is_causal=True with L != S: torch aligns the causal mask to the upper left (query i sees keys
  j <= i), which is wrong for queries that continue a cached sequence. Say which you mean with
  causal_alignment="upper_left" (torch's) or "lower_right" (query i sees keys j <= i + S - L,
  the KV-cache case). Square problems need no choice: the two coincide.
- dropout_p != 0 raises NotImplementedError: this is an inference library.
One documented difference: a row whose mask hides every key returns zeros (twinattn's contract),
where torch's math backend before 2.5 returned NaN.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..core._checks import shape_str
from ..core.api import _as_input, attention

__all__ = ["scaled_dot_product_attention"]

_ALIGNMENTS = (None, "upper_left", "lower_right")


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: str | None = None,
    backend: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> np.ndarray:
    """torch.nn.functional.scaled_dot_product_attention on NumPy arrays, computed by twinattn.

    Takes torch's arguments in torch's order, with torch's meaning, and raises where torch would
    silently surprise (see causal_alignment). Computed by twinattn.attention, whose contract
    (help(twinattn.attention)) applies: float32, float16 or bfloat16 in, the same dtype out, nothing
    cast silently.

    Parameters
    ----------
    query : array_like, shape (N, ..., Hq, L, E)
        float32, float16 or bfloat16 (ml_dtypes.bfloat16); float64 only with backend="numpy".
        Ranks 2 to 4 are passed on as they are
        ((L, E) and (Hq, L, E) meaning N=1); higher ranks have their leading axes flattened
        into one batch axis and restored on the way out.
    key : array_like, shape (N, ..., Hkv, S, E), same rank and dtype as query
    value : array_like, shape (N, ..., Hkv, S, Ev), same rank and dtype as query
    attn_mask : array_like, optional
        Broadcastable to (N, ..., Hq, L, S). bool: True means the key takes part in attention
        (torch's polarity); float32 (or query's dtype, widened to float32): an additive bias. Integer masks are
        refused. Not together with is_causal=True (as in torch).
    dropout_p : float, default 0.0
        Must be 0.0: twinattn computes inference attention only.
    is_causal : bool, default False
        Causal mask. When L != S, causal_alignment must say how it is aligned.
    scale : float, optional
        Factor applied to query key^T; None (the default) means 1 / sqrt(E), as in torch.
    enable_gqa : bool, default False
        Allow Hq to be a multiple of Hkv: query head h reads KV head h // (Hq // Hkv) (torch's
        repeat_interleave). Without it, query, key and value need equal head counts (dim -3).
    causal_alignment : {None, "upper_left", "lower_right"}, keyword-only, default None
        Where the causal diagonal sits when is_causal=True and L != S. "upper_left" is torch's
        (query i sees keys j <= i); "lower_right" puts the queries at the end of the sequence
        (query i sees keys j <= i + S - L, queries continuing a cached sequence; needs L <= S).
        None is allowed only when L == S, where the two coincide.
    backend : {"auto", "cpp", "rust", "numpy"}, keyword-only, default "auto"
        As in twinattn.attention. The thread count is twinattn.get_num_threads().
    window_size, softcap, alibi_slopes, sinks : keyword-only
        As in twinattn.attention (sliding window, logit softcapping, ALiBi, attention sinks),
        passed through. Positions follow the causal alignment: query i sits at i ("upper_left",
        and without is_causal when L == S) or at i + S - L ("lower_right", and the default
        without is_causal). alibi_slopes of shape (N, Hq) needs query of rank 4 at most.

    Returns
    -------
    numpy.ndarray, shape (N, ..., Hq, L, Ev), query's dtype
        A row whose mask hides every key is all zeros (torch's math backend before 2.5 gave
        NaN there).

    Raises
    ------
    TypeError
        dropout_p not a real number; is_causal or enable_gqa not a bool; a dtype other than
        float32, float16 or bfloat16 (float64 outside backend="numpy"); mixed dtypes; an
        integer mask.
    ValueError
        Inputs of rank below 2 or of different ranks, or mismatched shapes; unequal head counts
        without enable_gqa, or Hq not a multiple of Hkv with it; attn_mask given with
        is_causal=True, or not broadcastable; is_causal=True with L != S and no
        causal_alignment; causal_alignment="lower_right" with L > S; an unknown
        causal_alignment or backend; a scale that is not finite; an invalid window_size,
        softcap, alibi_slopes or sinks (as twinattn.attention).
    NotImplementedError
        dropout_p != 0.
    BackendUnavailableError
        backend names a port this installation was built without.

    Notes
    -----
    Non-finite values follow twinattn.attention: a NaN or inf in any visible position gives the
    float64 reference's NaN/inf pattern; hidden positions are never read.
    """
    q, k, v = (
        a if isinstance(a, np.ndarray) else _as_input(name, a, backend, "scaled_dot_product_attention", "query, key, value, ...")
        for name, a in (("query", query), ("key", key), ("value", value))
    )
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dimensions (..., L, E), got shape {shape_str(a.shape)}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"query, key, value: expected one rank, got shapes {shape_str(q.shape)}, {shape_str(k.shape)}, {shape_str(v.shape)}")

    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p: twinattn computes inference attention only; expected 0.0, got {dropout_p}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal: expected bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa: expected bool, got {type(enable_gqa).__name__}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment: expected one of {_ALIGNMENTS}, got {causal_alignment!r}")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (as torch: pass one or the other), got a mask")

    # Heads: torch without enable_gqa wants equal head counts.
    if q.ndim >= 3:
        q_heads, kv_heads = q.shape[-3], k.shape[-3]
        if not enable_gqa and (kv_heads != q_heads or v.shape[-3] != q_heads):
            raise ValueError(
                f"key, value: expected {q_heads} heads like query (dim -3) when enable_gqa=False, got "
                f"{kv_heads} and {v.shape[-3]}; pass enable_gqa=True for grouped-query attention"
            )

    # Causal alignment: only a non-square problem forces a choice.
    q_len, k_len = q.shape[-2], k.shape[-2]
    q_offset: int | None = None
    if is_causal:
        if q_len != k_len and causal_alignment is None:
            raise ValueError(
                f"is_causal: query length L={q_len} differs from key length S={k_len}, so the causal mask's "
                "alignment matters: pass causal_alignment='upper_left' (torch's: query i sees keys j <= i) or "
                "'lower_right' (query i sees keys j <= i + S - L, queries continuing a cached sequence)"
            )
        if causal_alignment == "lower_right":
            if q_len > k_len:
                raise ValueError(
                    f"causal_alignment: 'lower_right' with L={q_len} > S={k_len} leaves the first {q_len - k_len} "
                    "queries with no key; use 'upper_left' or fewer queries"
                )
            q_offset = k_len - q_len
        else:
            q_offset = 0

    # Rank: twinattn.attention takes 2-D to 4-D; flatten further leading axes into the batch.
    lead = q.shape[:-3]
    if q.ndim > 4:
        for name, a in (("key", k), ("value", v)):
            if a.shape[:-3] != lead:
                raise ValueError(f"{name}: expected leading dimensions {lead} like query, got shape {shape_str(a.shape)}")
        q, k, v = (a.reshape((-1,) + a.shape[-3:]) for a in (q, k, v))
        if attn_mask is not None:
            mask = np.asarray(attn_mask)
            full = lead + (q.shape[-3], q_len, k_len)
            try:
                mask = np.broadcast_to(mask, full)
            except ValueError:
                raise ValueError(f"attn_mask: expected a shape broadcastable to {full}, got {shape_str(mask.shape)}") from None
            attn_mask = mask.reshape((-1,) + full[-3:])

    out = attention(
        q, k, v, causal=bool(is_causal), q_offset=q_offset, attn_mask=attn_mask, scale=scale, backend=backend,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    assert isinstance(out, np.ndarray)
    return out.reshape(lead + out.shape[-3:]) if len(lead) > 1 else out
