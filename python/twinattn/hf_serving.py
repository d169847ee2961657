"""twinattn in transformers' continuous batching: `model.generate_batch(...)` and
ContinuousBatchingManager (what `transformers serve` runs) with every attention call computed by
twinattn, for a model loaded with attn_implementation="twinattn". Imported by twinattn.hf.

What transformers hands the attention function. Continuous batching packs every scheduled request
into one row: prefill chunks and decode tokens, query (1, Hq, total_q, D) with `cu_seq_lens_q`,
and the paged cache's `update` returns each request's keys and values, cached and new, packed the
same way, key (1, Hkv, total_k, D) with `cu_seq_lens_k`; attention_mask is None (transformers
builds no mask for an implementation that is not "sdpa" or "paged|eager") and every request's
queries are its last positions. `packed_attention_forward` computes that as one twinattn call
(attention_varlen, or attention_paged on the pages as below): causal, bottom-right aligned, GQA
without repeat_kv, no (Lq, Lk) mask, the output written in place into the (1, total_q, Hq, Dv)
tensor the model reshapes.

Keys and values read in place. On CPU, transformers' paged cache gathers every request's keys
and values out of its pages at every step (PagedAttentionCache.update: one torch.index_select of
K and one of V per layer, of total_k rows); it hands the pages and a block table to the attention
function only on its decode fast path, which it enables for flash-attention 2/3 on CUDA or XPU
alone. For a model whose implementation is twinattn, `_reads_pages_in_place` wraps that public
method: a full-attention layer's update of a step that reads cached keys writes the step's new
keys and values (transformers' own write-only path, taken with an empty read index), and hands
the attention function, under the keyword PAGES, the layer's page views (the allocator's
get_cache_for_block_table, the views transformers' decode fast path reads) and a block table of
every request's pages, built once per step from the read index transformers computed (a page
starts at a multiple of page_size rows of the layer's token view). `packed_attention_forward` then
reads the keys in place with one twinattn.torch.attention_paged call (prefill chunks and decode
rows alike). Sliding-window layers (a ring of pages), steps without cached keys (nothing is
gathered) and every other implementation go through transformers' update unchanged.

The two patches, both in `accept_in_continuous_batching` and both of public methods.
transformers 5.24's ContinuousBatchingManager.switch_to_cb_friendly_attn accepts only "sdpa",
"paged|eager" and implementations whose name contains "flash" (and those it then loads as
flash-attention kernels); it raises "Implementation twinattn is not supported for continuous
batching" for any other registered implementation: the wrapper lets a model whose implementation
is "twinattn" keep it. PagedAttentionCache.update is wrapped as above. Every other implementation
goes through transformers' methods unchanged. Written for transformers TRANSFORMERS_VERSION; where
a later transformers accepts registered implementations itself, the first wrapper changes nothing.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, Sequence, cast

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, PagedAttentionCache

from .core._threads import threads_for
from .torch import attention_paged, attention_varlen

__all__ = [
    "MAX_BATCH_TOKENS", "PAGES", "TRANSFORMERS_VERSION", "accept_in_continuous_batching", "attention_variants", "continuous_batching_config", "packed_attention_forward",
    "page_table",
]

# the transformers version the wrappers of switch_to_cb_friendly_attn and PagedAttentionCache.update were written for
TRANSFORMERS_VERSION = "5.24"
# the attention keyword under which the wrapped update hands over (k_pages, v_pages, block_table)
PAGES = "twinattn_pages"
# continuous_batching_config's tokens per step (prefill chunks and decode rows), where transformers'
# default is 8192. A step's largest activations (tokens x intermediate_size x 4 bytes for a float32
# MLP) above glibc's 32 MiB mmap ceiling are mapped anew and page-faulted in at every layer: an
# MLP of SmolLM2-135M (intermediate 1536) costs 25% more per token at 8192 tokens than at 2048,
# and 32 requests' prefill (8273 prompt tokens) took 15% less CPU time in steps of 2048.
MAX_BATCH_TOKENS = 2048


def continuous_batching_config(
    prompt_lengths: Sequence[int], max_new_tokens: int, *, page_size: int = 32,
    max_batch_tokens: Optional[int] = MAX_BATCH_TOKENS, **options: Any,
) -> Any:
    """A transformers ContinuousBatchingConfig whose paged cache holds exactly this work: every
    request's prompt and max_new_tokens, in pages of page_size tokens (num_blocks), so that no
    request waits for blocks (safety_margin 0). Without num_blocks, transformers sizes the cache
    from the free memory and allocates and zero-fills all of it at the first call. max_batch_tokens
    is the most tokens one step computes, prefill chunks included (MAX_BATCH_TOKENS says why 2048;
    None: transformers' default). Other keywords go to ContinuousBatchingConfig as they are."""
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
    pages: Optional[tuple[Any, Any, Any]] = None,
) -> tuple[Any, None]:
    """A packed batch: query (1, Hq, total_q, D), key (1, Hkv, total_k, D), value (1, Hkv, total_k,
    Dv), request b's queries rows cu_seq_lens_q[b]:cu_seq_lens_q[b+1] (its last positions), its
    keys rows cu_seq_lens_k[b]:cu_seq_lens_k[b+1] -> ((1, total_q, Hq, Dv), None). With `pages`
    (k_pages, v_pages (num_pages, page_size, Hkv, D / Dv), block_table int32 (B, max_pages)), what
    the wrapped PagedAttentionCache.update hands over, request b's cu_seq_lens_k[b+1] -
    cu_seq_lens_k[b] keys are read in place from its pages instead, and key and value (the step's
    new keys, already written there) are not read. Continuous batching's calls are causal;
    bidirectional packed sequences (causal=False) take no window."""
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(
            f"query: packed sequences (cu_seq_lens_q) come as a batch of one row, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    q_heads, total_q = query.shape[1], query.shape[2]
    variants = attention_variants(sliding_window, softcap, s_aux, causal=causal, where="to packed sequences with causal attention only")
    num_threads = None  # threads_for's answer for a float32 model: counting the work is left out
    if query.dtype != torch.float32:
        # the work of the whole call (every request's Lq * Lk), as threads_for counts it
        q_lens = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]
        k_lens = cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]
        work = q_heads * int((q_lens.long() * k_lens.long()).sum()) * (query.shape[-1] + value.shape[-1])
        num_threads = threads_for(work, beside_spinning_threads=True)
    # (total, heads, D) views of the packed rows: read in place
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if pages is None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        result = attention_varlen(
            q, k, v, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scaling, num_threads=num_threads, **variants
        )
        return result[None], None
    out = torch.empty((1, total_q, q_heads, value.shape[-1]), dtype=query.dtype)
    if pages is not None:  # forward only: the wrapped update hands pages over with gradients off
        k_pages, v_pages, table = pages
        attention_paged(
            q, k_pages, v_pages, table, cu_seq_lens_k[1:] - cu_seq_lens_k[:-1], cu_seqlens_q=cu_seq_lens_q, causal=causal,
            scale=scaling, out=out[0], num_threads=num_threads, **variants,
        )
        return out, None
    attention_varlen(
        q, k, v, cu_seq_lens_q, cu_seq_lens_k, causal=causal, scale=scaling, out=out[0], num_threads=num_threads, **variants
    )
    return out, None


def attention_variants(sliding_window: Any, softcap: Any, sinks: Any, *, causal: bool, where: str) -> dict[str, Any]:
    """twinattn's keywords for transformers' attention variants, only those in use: its sliding
    window (key j is visible to the query at position p iff p - w < j <= p), softcap (0 or None:
    none) and sinks (s_aux, as float32: a bfloat16 model's converts exactly). A window on
    bidirectional attention raises NotImplementedError, `where` saying which calls take a window."""
    variants: dict[str, Any] = {}
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError(
                f"sliding_window: twinattn applies a window {where}; "
                f"got sliding_window={sliding_window} on bidirectional attention"
            )
        variants["window_size"] = (sliding_window - 1, 0)
    if softcap:
        variants["softcap"] = float(softcap)
    if sinks is not None:
        variants["sinks"] = sinks.float()
    return variants


def page_table(read_index: Any, cu_seq_lens_k: Any, page_size: int) -> Any:
    """The block table of a paged cache's page views from transformers' read index: read_index
    (total_k,) int64, the rows of a layer's token view holding request b's keys at
    cu_seq_lens_k[b]:cu_seq_lens_k[b+1], in position order, every page_size of them one page that
    starts at a multiple of page_size rows -> int32 (B, max_pages): request b's page j is page
    read_index[cu_seq_lens_k[b] + j * page_size] // page_size, -1 past its last page."""
    starts = cu_seq_lens_k[:-1].long()
    pages = (cu_seq_lens_k[1:].long() - starts + page_size - 1) // page_size
    offsets = torch.arange(int(pages.max()) if pages.numel() else 0) * page_size
    used = offsets[None, :] < (pages * page_size)[:, None]
    rows = torch.where(used, starts[:, None] + offsets[None, :], 0)
    return torch.where(used, read_index[rows] // page_size, -1).to(torch.int32)


class _StepTable(threading.local):
    """The last block table built, with the read index and cu_seq_lens_k it came from: every
    full-attention layer of a step gets the same two tensors (transformers makes new views of its
    index storage for each step), so the table is built once per step and per generation thread."""

    key: tuple[Any, Any] = (None, None)
    table: Any = None


_STEP_TABLE = _StepTable()


def _step_table(read_index: Any, cu_seq_lens_k: Any, page_size: int) -> Any:
    last = _STEP_TABLE
    if last.key[0] is not read_index or last.key[1] is not cu_seq_lens_k:
        last.table = page_table(read_index, cu_seq_lens_k, page_size)
        last.key = (read_index, cu_seq_lens_k)
    return last.table


def accept_in_continuous_batching(name: str) -> None:
    """Let transformers' continuous batching keep the attention implementation `name` and read its
    keys and values in place from the paged cache (the module docstring says why and how). Calling
    it again changes nothing."""
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
    PagedAttentionCache.update = _reads_pages_in_place(PagedAttentionCache.update, accepted_names)


def _reads_pages_in_place(update: Callable[..., Any], accepted_names: set[str]) -> Callable[..., Any]:
    """PagedAttentionCache.update wrapped (the module docstring says what it does and when)."""

    @functools.wraps(update)
    def reads_pages_in_place(self: Any, key_states: Any, value_states: Any, layer_idx: int, kwargs: dict[str, Any]) -> Any:
        allocator = self.layer_to_allocator[layer_idx]
        read_index = kwargs.get("read_index")
        if (
            self.config._attn_implementation not in accepted_names
            or not allocator.supports_block_table
            or kwargs.get("block_table") is not None
            or not read_index
            or read_index[allocator.index].numel() == 0
            or torch.is_grad_enabled()
        ):
            return update(self, key_states, value_states, layer_idx, kwargs)
        # transformers' write-only path: the new keys and values written, nothing gathered
        kwargs["read_index"] = [index[:0] for index in read_index]
        try:
            key_states, value_states = update(self, key_states, value_states, layer_idx, kwargs)
        finally:
            kwargs["read_index"] = read_index
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
        table = _step_table(read_index[allocator.index], kwargs["cu_seq_lens_k"], allocator.tokens_per_page)
        kwargs[PAGES] = (k_pages, v_pages, table)
        return key_states, value_states

    reads_pages_in_place._twinattn_accepted = accepted_names  # type: ignore[attr-defined]
    # not traced, as transformers' update is not: the views of the cache tensor
    return cast(Callable[..., Any], torch.compiler.disable(reads_pages_in_place))
