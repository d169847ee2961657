"""twinattn in transformers' continuous batching: `model.generate_batch(...)` and
ContinuousBatchingManager (what `transformers serve` runs) with every attention call computed by
twinattn, for a model loaded with attn_implementation="twinattn". Imported by twinattn.hf.

What transformers hands the attention function. Continuous batching packs every scheduled request
into one row: prefill chunks and decode tokens, query (1, Hq, total_q, D) with `cu_seq_lens_q`,
and the paged cache's `update` returns each request's keys and values, cached and new, packed the
same way, key (1, Hkv, total_k, D) with `cu_seq_lens_k`; attention_mask is None (transformers
builds no mask for an implementation that is not "sdpa" or "paged|eager") and every request's
queries are its last positions. `packed_attention_forward` computes that as one
twinattn.torch.attention_varlen call: causal, bottom-right aligned, GQA without repeat_kv, no
(Lq, Lk) mask, the output written in place into the (1, total_q, Hq, Dv) tensor the model reshapes.

transformers reads keys and values in place from its pages, through a block table, only on its
decode fast path, which it enables for flash-attention 2/3 on CUDA or XPU alone; on CPU every
step's keys and values are gathered (one torch.index_select of K and one of V per layer, of
total_k rows) before the attention function sees them.

The one patch. transformers 5.24's ContinuousBatchingManager.switch_to_cb_friendly_attn accepts
only "sdpa", "paged|eager" and implementations whose name contains "flash" (and those it then
loads as flash-attention kernels); it raises "Implementation twinattn is not supported for
continuous batching" for any other registered implementation. `accept_in_continuous_batching`
wraps that public method so that a model whose implementation is "twinattn" keeps it; every other
implementation goes through transformers' own method unchanged. Written for transformers
TRANSFORMERS_VERSION; where a later transformers accepts registered implementations itself, the
wrapper changes nothing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager

from .core._threads import threads_for
from .torch import attention_varlen

__all__ = ["TRANSFORMERS_VERSION", "accept_in_continuous_batching", "continuous_batching_config", "packed_attention_forward"]

# the transformers version the wrapper of switch_to_cb_friendly_attn was written for
TRANSFORMERS_VERSION = "5.24"


def continuous_batching_config(
    prompt_lengths: Sequence[int], max_new_tokens: int, *, page_size: int = 32, max_batch_tokens: Optional[int] = None,
    **options: Any,
) -> Any:
    """A transformers ContinuousBatchingConfig whose paged cache holds exactly this work: every
    request's prompt and max_new_tokens, in pages of page_size tokens (num_blocks), so that no
    request waits for blocks (safety_margin 0). Without num_blocks, transformers sizes the cache
    from the free memory and allocates and zero-fills all of it at the first call. max_batch_tokens
    (the most tokens one step computes, prefill chunks included) stays transformers' default when
    None. Other keywords go to ContinuousBatchingConfig as they are."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 4:
        raise ValueError(f"page_size: expected an int of at least 4 (transformers' minimum), got {page_size!r}")
    num_blocks = sum(-(-(int(n) + max_new_tokens) // page_size) for n in prompt_lengths)
    if num_blocks == 0:
        raise ValueError("prompt_lengths: expected at least one request")
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **{"safety_margin": 0.0, **options}
    )


def packed_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    scaling: Optional[float],
    cu_seq_lens_q: Any,
    cu_seq_lens_k: Any,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Any = None,
) -> tuple[Any, None]:
    """A packed batch: query (1, Hq, total_q, D), key (1, Hkv, total_k, D), value (1, Hkv, total_k,
    Dv), request b's queries rows cu_seq_lens_q[b]:cu_seq_lens_q[b+1] (its last positions), its
    keys rows cu_seq_lens_k[b]:cu_seq_lens_k[b+1] -> ((1, total_q, Hq, Dv), None). Continuous
    batching's calls are causal; bidirectional packed sequences (causal=False) take no window."""
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(
            f"query: packed sequences (cu_seq_lens_q) come as a batch of one row, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    q_heads, total_q = query.shape[1], query.shape[2]
    variants: dict[str, Any] = {}
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError(
                f"sliding_window: twinattn applies a window to packed sequences with causal attention only; "
                f"got sliding_window={sliding_window} on bidirectional attention"
            )
        # transformers' window: key j is visible to the query at position p iff p - w < j <= p
        variants["window_size"] = (sliding_window - 1, 0)
    if softcap:
        variants["softcap"] = float(softcap)
    if s_aux is not None:
        variants["sinks"] = s_aux.float()
    num_threads = None  # threads_for's answer for a float32 model: counting the work is left out
    if query.dtype != torch.float32:
        # the work of the whole call (every request's Lq * Lk), as threads_for counts it
        q_lens = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
        k_lens = cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]
        work = q_heads * int((q_lens.long() * k_lens.long()).sum()) * (query.shape[-1] + value.shape[-1])
        num_threads = threads_for(work, beside_spinning_threads=True)
    # (total, heads, D) views of the packed rows: read in place
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        result = attention_varlen(
            q, k, v, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scaling, num_threads=num_threads, **variants
        )
        return result[None], None
    out = torch.empty((1, total_q, q_heads, value.shape[-1]), dtype=query.dtype)
    attention_varlen(
        q, k, v, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scaling, out=out[0], num_threads=num_threads, **variants
    )
    return out, None


def accept_in_continuous_batching(name: str) -> None:
    """Let transformers' continuous batching keep the attention implementation `name` (the module
    docstring says why and how). Calling it again changes nothing."""
    original: Callable[..., Any] = ContinuousBatchingManager.switch_to_cb_friendly_attn
    accepted: set[str] = getattr(original, "_twinattn_accepted", set())
    if accepted:
        accepted.add(name)
        return

    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self: Any, model: Any, auto_switch_to_flash: bool = True) -> None:
        if model.config._attn_implementation in accepted_names:
            return None  # computes continuous batching's packed batches itself
        original(self, model, auto_switch_to_flash)
        return None

    accepted_names = {name}
    switch_to_cb_friendly_attn._twinattn_accepted = accepted_names  # type: ignore[attr-defined]
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
