"""twinattn in Hugging Face transformers (needs torch and transformers: `pip install torch transformers`,
or the `hf` extra).

    import twinattn.hf                                    # registers "twinattn"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="twinattn")
    model.generate(**inputs)                              # makes a TwinattnCache (default_cache_in_generate)
    cache = twinattn.hf.TwinattnCache(max_cache_len=4096, config=model.config)
    model.generate(**inputs, cache=cache)                 # decode appends in place, never copies
                                                          # (past_key_values=cache before transformers 5)

Importing this module registers "twinattn" twice under the same name, as transformers needs
(and makes generate() give such a model a TwinattnCache where it would make a DynamicCache, and
the DynamicCache its forward makes when given none append in place: default_cache_in_forward):
- with AttentionInterface, `attention_forward`: the attention of every layer, on the model's
  (B, H, L, D) query/key/value tensors, read in place (GQA without repeat_kv), written straight
  into the (B, L, H, D) layout the model reshapes next;
- with AttentionMaskInterface, `mask_function`: what the model builds once per forward instead of
  an (Lq, Lk) mask. For causal or bidirectional attention over a growing cache it returns None (no
  padding) or the (B, Lk) padding mask itself; attention_forward turns that into kv_lens (right
  padding) or a (B, 1, 1, Lk) broadcast mask (left padding). Sliding-window causal masks
  (transformers' sliding_window_causal_mask_function, recognised by its structure and its
  local_size) get the same treatment: the layer's `sliding_window` keyword then reaches
  attention_forward, which passes window_size=(sliding_window - 1, 0) to twinattn, so the window
  is index arithmetic, never a mask. Any other pattern (a custom mask function, an or/and overlay,
  a static cache's offsets) is materialised by transformers' own sdpa_mask, so it stays correct,
  only slower; a materialised mask already holds the window, so sliding_window is then not
  applied a second time.

Variants, as transformers' eager attention computes them: `sliding_window=w` (Mistral, Qwen2,
Gemma 2/3, gpt-oss) is key j visible to the query at position p only if p - w < j <= p;
`softcap` (Gemma 2's attn_logit_softcapping) turns each scaled score s into
softcap * tanh(s / softcap) before the mask; `s_aux` (gpt-oss's sinks, one logit per query head)
is a virtual key that takes softmax mass and carries no value. A learned `position_bias` raises
NotImplementedError.

Training: a forward with gradients enabled (dropout 0) records twinattn's backward, so
loss.backward() gives the model's gradients (twinattn.torch's gradients: q, k, v and s_aux).

Continuous batching: `model.generate_batch(...)` and transformers' ContinuousBatchingManager keep
"twinattn" (twinattn.hf_serving): each step's prefill chunks and decode tokens, packed by
transformers, are one twinattn call per layer, attention_paged reading the cached keys in place
from transformers' pages (attention_varlen on a step of whole prompts);
continuous_batching_config(prompt_lengths, max_new_tokens) sizes transformers' paged cache to the
work.

dtypes: float32, bfloat16 and float16 models. Query, key and value reach twinattn in the model's
dtype (computed in float32, out rounded once to that dtype), and TwinattnCache stores keys and
values in it (a bfloat16 cache is half a float32 one). TwinattnCache(..., kv_dtype="int8") stores
them as int8 with one float32 scale per (sequence, KV head, token) each (twinattn.quantize_kv of
the model's keys and values as they are appended): about a quarter of a float32 cache.
It is a twinattn.KVCache(dtype="int8"); update returns its int8 views and hands their scale views
to attention_forward, which passes them to twinattn as k_scale / v_scale when it is called with
those very views: attention over the dequantized keys and values, read in place.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Optional

import numpy as np

try:
    import torch
    from transformers import AttentionInterface
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("twinattn.hf needs torch and transformers: pip install torch transformers") from error
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, get_layer_types_and_kwargs
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
)

from ._torch_views import NUMPY_DTYPES, array, tensor
from .core import api
from .core._backends import NATIVE_PORTS, _load
from .core._threads import get_num_threads, threads_for
from .hf_serving import PAGES, accept_in_continuous_batching, attention_variants, continuous_batching_config, packed_attention_forward
from .nn.cache import KVCache
from .torch import attention

__all__ = [
    "NAME", "TwinattnCache", "attention_forward", "continuous_batching_config", "default_cache_in_forward",
    "default_cache_in_generate", "mask_function", "register",
]

NAME = "twinattn"
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling

# keywords that ask for attention twinattn does not compute yet: never silently dropped
_UNSUPPORTED = {
    "position_bias": "a learned position bias",
}


# ---- the mask function: what the model builds once per forward -----------------------------------


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: Any = None,
    **kwargs: Any,
) -> Any:
    """transformers' mask-interface signature (as sdpa_mask). Returns None, the (B, kv_offset +
    kv_length) bool padding mask, or, for patterns that causality, the layer's window and lengths cannot
    describe, the materialised (B, 1, q_length, kv_length) bool mask from sdpa_mask.

    The window of a sliding-window layer is not in what this returns: attention_forward takes it
    from the layer's sliding_window keyword, which transformers passes with the mask that
    create_sliding_window_causal_mask built (local_size here)."""
    window = _sliding_window_of(mask_function)
    plain = (
        mask_function is causal_mask_function
        or mask_function is bidirectional_mask_function
        or (window is not None and window == kwargs.get("local_size"))
    )
    # the keys are positions kv_offset .. kv_offset + kv_length - 1 (a cache that grows by what it
    # is given, or transformers' own sliding cache that keeps the last window - 1); causal
    # queries are the last q_length of them
    aligned = isinstance(kv_offset, int) and (
        mask_function is bidirectional_mask_function
        or (isinstance(q_offset, int) and q_offset - kv_offset + q_length == kv_length)
    )
    fits = attention_mask is None or (
        attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_offset + kv_length
    )
    if plain and aligned and fits:
        # the whole (B, kv_offset + kv_length) padding mask, not the slice the keys cover:
        # attention_forward takes its last Lk columns, and generate, which may hand what this
        # returns back to it as the 2D mask of the same step, gets the same answer again
        if attention_mask is None or bool(attention_mask.all()):
            return None
        # a new tensor for each forward, even from a bool mask, that nobody else writes to:
        # attention_forward keeps what it derives from it for the forward's other layers (_padding_of)
        made = attention_mask.to(torch.bool, copy=True)
        _last_padding.made = made
        return made
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        device=kwargs.get("device", "cpu"),
    )


def _sliding_window_of(function: Any) -> Optional[int]:
    """w when function is transformers' sliding_window_causal_mask_function(w) (an and_masks of
    sliding_window_overlay(w) and causal_mask_function, nothing else), else None."""
    if getattr(function, "__qualname__", None) != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(function).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", None) != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = _closure(parts[0]).get("sliding_window")
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


def _closure(function: Any) -> dict[str, Any]:
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or cells is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


class _LastPadding(threading.local):
    """The padding mask mask_function last made on this thread (`made`: a copy of its own for each
    forward, which nobody writes to), and once attention_forward has turned it into (kv_lens,
    attn_mask) for k_len keys, that answer: every layer of the forward gets the same mask object
    and the same key count, so the first layer's answer serves the others. A mask from anywhere
    else is turned into its answer at each call."""

    made: Any = None
    mask: Any = None
    k_len = -1
    answer: Any = None
    # a decode step's left padding: the answer's mask and its broadcast NumPy view (_left_padding_mask)
    broadcast_of: Any = None
    broadcast: Any = None


_last_padding = _LastPadding()


def _padding_of(attention_mask: Any, k_len: int) -> tuple[Any, Any]:
    """_padding of the last k_len columns of a (B, >= k_len) padding mask, computed once per
    forward for the mask mask_function made."""
    last = _last_padding
    if last.mask is attention_mask and last.k_len == k_len:
        answer: tuple[Any, Any] = last.answer
        return answer
    answer = _padding(attention_mask[:, attention_mask.shape[-1] - k_len :])
    if attention_mask is last.made:
        last.mask, last.k_len, last.answer = attention_mask, k_len, answer
    return answer


def _padding(mask: Any) -> tuple[Any, Any]:
    """(kv_lens, attn_mask) for a (B, Lk) padding mask: kv_lens (B,) when every row is a prefix of
    real tokens (right padding), else a (B, 1, 1, Lk) broadcast view of the mask (left padding)."""
    lens = mask.sum(dim=-1)
    prefix = torch.arange(mask.shape[-1]) < lens[:, None]
    if torch.equal(prefix, mask):
        return lens, None
    return None, mask[:, None, None, :]


# ---- the attention function -----------------------------------------------------------------------


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-interface signature: query (B, Hq, Lq, D), key (B, Hkv, Lk, D),
    value (B, Hkv, Lk, Dv) -> ((B, Lq, Hq, Dv), None). attention_mask is what mask_function
    returned (None, a (B, >= Lk) padding mask whose last Lk columns are the keys') or a 4D bool/float
    mask a caller built."""
    sliding_window = softcap = sinks = None
    if kwargs:
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"{name}: twinattn does not compute {what} yet, and will not silently compute full "
                    f"attention instead; load this model with attn_implementation='sdpa'"
                )
        sliding_window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(f"dropout: twinattn computes inference attention only; got dropout={dropout} in training mode")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:
        # continuous batching's packed batch (twinattn.hf_serving): one attention_varlen call
        return packed_attention_forward(
            module, query, key, value, scaling=scaling, cu_seq_lens_q=kwargs["cu_seq_lens_q"],
            cu_seq_lens_k=kwargs["cu_seq_lens_k"], causal=causal, sliding_window=sliding_window, softcap=softcap,
            s_aux=sinks, pages=kwargs.get(PAGES),
        )
    if causal and not softcap and sinks is None and (attention_mask is None or attention_mask.dim() == 2):
        # every layer of every decode step over a TwinattnCache (or the DynamicCache a twinattn
        # model's forward makes), without padding or with a generate batch's left padding: the
        # native call itself when that is what twinattn.attention would make
        step = _decode_step(query, key, value, scaling, sliding_window, attention_mask)
        if step is not None:
            return step, None
    batch, q_heads, q_len, _ = query.shape
    k_len = key.shape[2]

    kv_lens = None
    attn_mask = None
    if attention_mask is not None and attention_mask.dim() == 2:
        if attention_mask.shape[-1] < k_len:
            raise ValueError(
                f"attention_mask: a 2D padding mask needs a column for each of the {k_len} keys, got shape {tuple(attention_mask.shape)}"
            )
        # the keys are the last k_len positions the padding mask covers (a sliding cache keeps those)
        kv_lens, attn_mask = _padding_of(attention_mask, k_len)
    elif attention_mask is not None:
        # a materialised mask already holds causality, the window and offsets: apply it as it is
        attn_mask, causal, sliding_window = attention_mask, False, None
    # the variants only when they are used: the plain call passes what it always did
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    variants = attention_variants(sliding_window, softcap, sinks, causal=causal, where="without a materialised mask to causal attention only")
    if causal and kv_lens is not None:
        # the queries are the last q_len positions of a cache holding k_len keys (HF's alignment),
        # said explicitly so that right-padded rows (kv_lens < q_len) stay causal rather than
        # raise; without kv_lens that is twinattn's default (bottom-right) alignment
        variants["q_offset"] = k_len - q_len
    # A float16/bfloat16 model's call runs beside torch's OpenMP threads, which keep spinning on
    # every core between the model's torch ops (threads_for says what that does to a call of this
    # work). This work is per sequence (Hq * Lq * Lk * (D + Dv)), as measured on a batch of one.
    work = q_heads * q_len * k_len * (query.shape[-1] + value.shape[-1])
    num_threads = threads_for(work, beside_spinning_threads=query.dtype is not torch.float32)
    # a decode step's (B, Hq, 1, Dv) as twinattn allocates it is already (B, 1, Hq, Dv) in memory:
    # its transpose is the model's layout (torch.empty and a checked out cost more than such a
    # step's attention); longer queries are written straight into the model's layout
    out = None if q_len == 1 else torch.empty((batch, q_len, q_heads, value.shape[-1]), dtype=query.dtype)
    handed = _handed_over(key, value)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks))
    if handed is not None and not training and type(query) is torch.Tensor and not _is_dynamo_compiling():
        # a TwinattnCache's own views, in eager mode: twinattn.attention on the arrays it handed
        # over (converting the tensors back would cost more than a short step's attention)
        keys, values, scales = handed
        if scales is not None:
            variants["k_scale"], variants["v_scale"] = scales
        if "sinks" in variants:
            variants["sinks"] = array("s_aux", variants["sinks"])
        result = api.attention(
            array("query", query),
            keys,
            values,
            causal=causal,
            kv_lens=None if kv_lens is None else array("kv_lens", kv_lens),
            attn_mask=None if attn_mask is None else array("attention_mask", attn_mask),
            scale=scaling,
            out=None if out is None else array("out", out.transpose(1, 2)),
            num_threads=num_threads,
            **variants,
        )
        return (tensor(result).transpose(1, 2) if out is None else out), None
    if handed is not None and handed[2] is not None:
        variants["k_scale"], variants["v_scale"] = (tensor(scale) for scale in handed[2])
    if training:
        # the differentiable call (twinattn.torch's op and its backward), out allocated by it
        result = attention(
            query, key, value, causal=causal, kv_lens=kv_lens, attn_mask=attn_mask, scale=scaling, num_threads=num_threads,
            **variants,
        )
        return result.transpose(1, 2), None
    # twinattn.torch.attention: its custom op under torch.compile
    result = attention(
        query,
        key,
        value,
        causal=causal,
        kv_lens=kv_lens,
        attn_mask=attn_mask,
        scale=scaling,
        out=None if out is None else out.transpose(1, 2),
        num_threads=num_threads,
        **variants,
    )
    return (result.transpose(1, 2) if out is None else out), None


def _decode_step(query: Any, key: Any, value: Any, scaling: Any, sliding_window: Any, padding: Any = None) -> Any:
    """attention_forward of one decode step, causal, without softcap or sinks, over the key and
    value views a cache layer has just handed over (_CacheViews), in eager mode without
    gradients, without a mask or with a left-padded (B, >= Lk) padding mask (`padding`, as
    mask_function returns it for generate's batches): query (B, Hq, 1, D) -> (B, 1, Hq, Dv);
    else None (nothing handed over then).

    Bit for bit twinattn.attention on the handed-over arrays as attention_forward calls it (first
    native port, same threads), without its Python checks, which cost more than such a step's
    native call (30 layers a step): the keys and values are the cache's own buffers, checked as
    they were stored, and what twinattn.attention would check of the rest (the query's dtype,
    shape and last stride, the scale, the window) is checked here to pass unchanged. Anything else
    returns None, and attention_forward's checked call says what is wrong."""
    views = _cache_views
    if (
        key is not views.keys or value is not views.values or views.scales is not None or type(query) is not torch.Tensor
        or (sliding_window is not None and (type(sliding_window) is not int or sliding_window < 1))
        or _is_dynamo_compiling() or (query.requires_grad and torch.is_grad_enabled())
    ):
        return None
    keys, values = views.arrays
    q = array("query", query)
    shape, kv_shape = q.shape, keys.shape
    if len(shape) != 4 or shape[2] != 1 or q.dtype != keys.dtype or q.dtype != values.dtype:
        return None
    batch, q_heads, _, head_dim = shape
    kv_batch, kv_heads, k_len, k_dim = kv_shape
    value_dim = values.shape[3]
    if not (
        kv_batch == batch and k_dim == head_dim and values.shape[:3] == kv_shape[:3] and k_len
        and kv_heads and q_heads % kv_heads == 0
        and (head_dim <= 1 or q.strides[3] == q.itemsize and keys.strides[3] == keys.itemsize)
        and (value_dim <= 1 or values.strides[3] == values.itemsize)
    ):
        return None
    if scaling is None:
        scale = api.default_scale(head_dim)
    elif type(scaling) is float and abs(scaling) < api._FLOAT32_OVERFLOW:
        scale = scaling  # a finite float, which twinattn.attention takes as it is
    else:
        return None
    # backend="auto": the first native port built (_load raises, as there, for one that refuses to load)
    for port in NATIVE_PORTS:
        module = _load(port)
        if module is not None:
            break
    else:
        return None
    mask = None if padding is None else _left_padding_mask(padding, batch, q_heads, k_len)
    if padding is not None and mask is None:
        return None
    views.keys = views.values = views.arrays = None  # handed over once
    # attention_forward's threads (threads_for), the same work counted the same way
    num_threads = threads_for(q_heads * k_len * (head_dim + value_dim), beside_spinning_threads=q.dtype != _FLOAT32)
    out = np.empty((batch, q_heads, 1, value_dim), dtype=q.dtype)
    offsets, lens = api._filled(batch, k_len - 1), api._filled(batch, k_len)
    # twinattn.attention's arguments, less those it passes at their defaults (None, 0); a causal
    # window is (sliding_window - 1, 0), its right side capped at 0 as twinattn.attention caps it
    threads = get_num_threads() if num_threads is None else num_threads
    if sliding_window is None and mask is None:
        module.attention_forward(q, keys, values, out, scale=scale, q_offset=offsets, kv_lens=lens, causal=True, num_threads=threads)
    elif sliding_window is None:
        module.attention_forward(
            q, keys, values, out, scale=scale, q_offset=offsets, kv_lens=lens, mask=mask, causal=True, num_threads=threads
        )
    else:
        module.attention_forward(
            q, keys, values, out, scale=scale, q_offset=offsets, kv_lens=lens, mask=mask, causal=True, num_threads=threads,
            window_left=sliding_window - 1, window_right=0,
        )
    # (B, Hq, 1, Dv) is (B, 1, Hq, Dv) in memory: the model's layout
    return tensor(out.reshape(batch, 1, q_heads, value_dim))


_FLOAT32 = np.dtype(np.float32)


def _left_padding_mask(padding: Any, batch: int, q_heads: int, k_len: int) -> Any:
    """The mask twinattn.attention hands the native call for the (B, 1, 1, Lk) bool mask that
    _padding_of makes of a left-padded (B, >= k_len) padding mask: that mask broadcast to
    (B, Hq, 1, k_len), made once per forward (every layer gets the same mask object); None for
    anything else (right padding, which is kv_lens, or a mask twinattn.attention would refuse),
    which attention_forward's checked call takes."""
    if padding.shape[-1] < k_len:
        return None
    kv_lens, attn_mask = _padding_of(padding, k_len)
    if kv_lens is not None or attn_mask is None or attn_mask.dtype is not torch.bool or attn_mask.shape[0] != batch:
        return None
    last = _last_padding
    if last.broadcast_of is not attn_mask or last.broadcast.shape[1] != q_heads:
        last.broadcast_of, last.broadcast = attn_mask, np.broadcast_to(array("attention_mask", attn_mask), (batch, q_heads, 1, k_len))
    return last.broadcast


class _CacheViews(threading.local):
    """The key and value views a TwinattnCache layer last returned on this thread, with their
    NumPy views and, from an int8 cache, their float32 scales. transformers calls the cache's
    update and then the attention function with those very tensors, and nothing else passes
    between the two: the arrays are handed over here, to the call whose key and value are those
    tensors, once (it then reads them without converting the tensors back)."""

    keys: Any = None
    values: Any = None
    arrays: Any = None
    scales: Any = None


_cache_views = _CacheViews()


def _handed_over(key: Any, value: Any) -> Optional[tuple[Any, Any, Any]]:
    """(keys, values, scales) as NumPy arrays, scales None or (k_scale, v_scale), when key and value
    are the views a TwinattnCache layer just returned; else None. int8 keys and values come only
    that way (their scales with them)."""
    views = _cache_views
    if key is views.keys and value is views.values:
        handed: tuple[Any, Any, Any] = (*views.arrays, views.scales)
        views.keys = views.values = views.arrays = views.scales = None  # handed over once: nothing kept alive
        return handed
    if key.dtype is torch.int8 or value.dtype is torch.int8:
        raise TypeError(
            "key: int8 keys and values reach twinattn with their scales only from a TwinattnCache(kv_dtype='int8'); "
            f"got {key.dtype} key and {value.dtype} value without them"
        )
    return None


def _hand_over(keys: Any, values: Any, arrays: tuple[Any, Any], scales: Any = None) -> None:
    views = _cache_views
    views.keys, views.values, views.arrays, views.scales = keys, values, arrays, scales


# ---- the cache --------------------------------------------------------------------------------------


class _TwinattnLayer(CacheLayerMixin):  # type: ignore[misc]
    """One layer of a TwinattnCache: views into the shared twinattn.KVCache."""

    is_compileable = False
    is_croppable = True
    is_sliding = False  # sliding-window layers too: stored at full length, the window selects

    def __init__(self, owner: TwinattnCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self._layer_idx = layer_idx

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self._owner._allocate(key_states, value_states)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        owner = self._owner
        if owner.kv is None:
            self.lazy_initialization(key_states, value_states)
        appended = owner._append(self._layer_idx, key_states, value_states)
        return self._update_checked(key_states, value_states) if appended is None else appended

    def _update_checked(self, key_states: Any, value_states: Any) -> tuple[Any, Any]:
        """update through KVCache.update: int8 caches, and whatever the fast path does not take,
        which KVCache checks (and names in its errors)."""
        kv = self._owner.kv
        assert kv is not None
        self.is_initialized = True
        # one slice assignment of the new tokens into the preallocated buffers; the result is a
        # view (B, Hkv, stored, D) of them: nothing already cached is copied
        try:
            keys, values = kv.update(array("key_states", key_states.detach()), array("value_states", value_states.detach()), self._layer_idx)
        except ValueError:
            if key_states.shape[0] != kv.batch_size:
                raise ValueError(
                    f"key_states: this TwinattnCache holds a batch of {kv.batch_size}, fixed at its first forward, "
                    f"got a batch of {key_states.shape[0]}; pass a new TwinattnCache(max_cache_len=..., "
                    "config=model.config) for each generate call or batch (it allocates for the batch it first sees)"
                ) from None
            raise
        self._owner._sync_lengths(self._layer_idx)
        self.keys, self.values = tensor(keys), tensor(values)
        # the arrays (and an int8 cache's scales) for attention_forward (_CacheViews)
        _hand_over(self.keys, self.values, (keys, values), kv.scales(self._layer_idx) if self._owner.kv_dtype == "int8" else None)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner._lengths[self._layer_idx]

    def get_max_length(self) -> int:
        return self._owner.max_cache_len

    def reset(self) -> None:
        self._owner._reset_layer(self._layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._owner._crop_layer(self._layer_idx, tokens_to_remove)

    def reorder_cache(self, beam_idx: Any) -> None:
        self._owner._reorder_layer(self._layer_idx, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "TwinattnCache fixes its batch at its first forward: pass generate a new, empty TwinattnCache, which "
            "then allocates for the expanded batch (batch_size x num_return_sequences), instead of repeating a filled one"
        )

    def batch_select_indices(self, indices: Any) -> None:
        raise NotImplementedError("TwinattnCache preallocates a fixed batch: selecting sequences out of it is not supported")


class TwinattnCache(Cache):  # type: ignore[misc]
    """A transformers Cache that preallocates and appends in place.

    Backed by one twinattn.KVCache: per layer, keys and values (B, Hkv, max_cache_len, D) in the
    model's dtype (float32, bfloat16 or float16), allocated at the first update (when batch, heads
    and width are known). update() writes the new tokens at the stored length and returns views of
    the stored prefix, so a decode step copies one token per layer, where DynamicCache
    re-concatenates the whole cache.

        cache = TwinattnCache(max_cache_len=4096, config=model.config)
        model.generate(**inputs, cache=cache)

    kv_dtype="int8" stores keys and values as int8 with float32 scales (module docstring): 1 byte
    per element plus 8 bytes per (sequence, KV head, token), a little over a quarter of float32;
    the model's attention must then be attn_implementation="twinattn" (only it takes the scales).

    num_layers may be given instead of config. Sliding-window layers (Mistral, Qwen2, Gemma 2/3,
    gpt-oss) are stored like full-attention ones, at full length: attention_forward's window
    selects the keys (twinattn never reads those outside it, so a windowed decode step still costs
    O(window)), and max_cache_len must cover the whole sequence, as for the full layers. Layers of
    other kinds (chunked, linear attention) raise NotImplementedError.
    """

    def __init__(
        self, max_cache_len: int, config: Any = None, *, num_layers: Optional[int] = None, kv_dtype: Optional[str] = None
    ) -> None:
        if (config is None) == (num_layers is None):
            raise TypeError("TwinattnCache: pass exactly one of config= (the model's config) or num_layers=")
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            layer_types, _ = get_layer_types_and_kwargs(text_config)
            other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
            if other:
                raise NotImplementedError(
                    f"config: TwinattnCache holds full-attention and sliding-window layers only; this model also has {other}"
                )
            num_layers = len(layer_types)
        assert num_layers is not None
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len: expected a positive int, got {max_cache_len!r}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
        if kv_dtype not in (None, "int8"):
            raise ValueError(f"kv_dtype: expected None (the model's dtype) or 'int8', got {kv_dtype!r}")
        self.max_cache_len = max_cache_len
        self.num_layers = num_layers
        self.kv_dtype = kv_dtype
        self.kv: Optional[KVCache] = None
        # once allocated (not int8): per layer, the KVCache's whole key and value buffers
        # (B, Hkv, max_cache_len, D), which _append writes into, and the layer; and per layer the
        # stored length (every sequence of a generate batch has the same one, left padding
        # included), kept equal to the KVCache's
        self._stores: Optional[list[tuple[Any, Any, _TwinattnLayer]]] = None
        self._kv_lens: Any = None
        self._dtype: Any = None  # the model's torch dtype, once allocated
        self._lengths = [0] * num_layers
        super().__init__(layers=[_TwinattnLayer(self, i) for i in range(num_layers)])

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Cache.update: _append for the common case, else the layer's update (a TwinattnCache has all
        its layers from the start and never offloads them, the two things Cache.update checks for on
        each call first)."""
        appended = self._append(layer_idx, key_states, value_states)
        if appended is not None:
            return appended
        keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        return keys, values

    def _append(self, layer_idx: int, key_states: Any, value_states: Any) -> Optional[tuple[Any, Any]]:
        """The common case of an update, every step of every layer, once allocated (not int8): the
        new tokens written at the layer's length into its buffers, views of the stored prefix back
        (also the layer's keys and values), and their NumPy views handed to attention_forward
        (_CacheViews); None for anything else, which the layer's _update_checked takes
        (KVCache.update's general checks and per-sequence lengths cost several times this).

        update calls it itself, not through the layer's update: in a real decode step this runs
        with the processor's caches cold (each layer's weights have just streamed through them),
        where every Python call and lookup it saves costs several times what it costs in a loop."""
        stores, dtype = self._stores, self._dtype
        if (
            stores is None or key_states.dtype is not dtype or value_states.dtype is not dtype
            or key_states.requires_grad or value_states.requires_grad
        ):
            return None
        new_keys, new_values = array("key_states", key_states), array("value_states", value_states)
        keys, values, layer = stores[layer_idx]
        start = self._lengths[layer_idx]
        shape, stored = new_keys.shape, keys.shape
        end = start + shape[2]
        if (
            end > self.max_cache_len or shape[0] != stored[0] or shape[1] != stored[1] or shape[3] != stored[3]
            or new_values.shape != shape
        ):
            return None
        layer.is_initialized = True
        keys[:, :, start:end] = new_keys
        values[:, :, start:end] = new_values
        # every sequence of the layer now holds `end` tokens: here and in the KVCache
        self._lengths[layer_idx] = end
        self._kv_lens[layer_idx] = end
        keys, values = keys[:, :, :end], values[:, :, :end]
        layer.keys, layer.values = key_tensor, value_tensor = tensor(keys), tensor(values)
        views = _cache_views  # (_hand_over, inline)
        views.keys, views.values, views.arrays, views.scales = key_tensor, value_tensor, (keys, values), None
        return key_tensor, value_tensor

    def _allocate(self, key_states: Any, value_states: Any) -> None:
        if self.kv is not None:
            return
        # keys and values are stored in the model's dtype, as it computes them
        dtype = NUMPY_DTYPES.get(key_states.dtype)
        if dtype is None:
            raise TypeError(
                f"key_states: TwinattnCache stores torch.float32, torch.float16 or torch.bfloat16 (the model's dtype), "
                f"got {key_states.dtype}; load the model with dtype=torch.bfloat16 or torch.float32"
            )
        if value_states.dtype != key_states.dtype:
            raise TypeError(f"value_states: expected dtype {key_states.dtype} (key_states'), got {value_states.dtype}")
        if key_states.device.type != "cpu":
            raise ValueError(f"key_states: TwinattnCache lives in CPU memory, got a tensor on {key_states.device}")
        batch, kv_heads, _, head_dim = key_states.shape
        if value_states.shape[-1] != head_dim:
            raise NotImplementedError(
                f"value_states: TwinattnCache stores keys and values of one width, got {head_dim} and {value_states.shape[-1]}"
            )
        # int8: quantized as they are appended (KVCache.update), from the model's dtype
        stored = "int8" if self.kv_dtype == "int8" else dtype
        self.kv = KVCache(self.num_layers, batch, kv_heads, head_dim, self.max_cache_len, dtype=stored)
        self._dtype = key_states.dtype
        if stored != "int8":
            # the buffers themselves (KVCache's keys() and values() end at the stored length), with
            # the layer they belong to, and the KVCache's lengths (which it only ever writes in place)
            self._stores = [(self.kv._keys[i], self.kv._values[i], self.layers[i]) for i in range(self.num_layers)]
            self._kv_lens = self.kv._lens

    def _sync_lengths(self, layer_idx: Optional[int] = None) -> None:
        """_lengths from the KVCache, after an edit that went through it (all layers, or one)."""
        kv = self.kv
        for i in range(self.num_layers) if layer_idx is None else (layer_idx,):
            self._lengths[i] = 0 if kv is None or kv.batch_size == 0 else int(kv.seq_lens(i).max())

    def _reset_layer(self, layer_idx: int) -> None:
        # KVCache.reset empties every layer at once: transformers calls this for each layer in turn
        if self.kv is not None:
            self.kv.reset()
            self._sync_lengths()

    def _crop_layer(self, layer_idx: int, tokens_to_remove: int) -> None:
        if self.kv is None or tokens_to_remove == 0:
            return
        if layer_idx == 0:  # KVCache.crop applies to every layer
            stored = self.get_seq_length(0)
            keep = stored + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
            self.kv.crop(max(keep, 0))
            self._sync_lengths()

    def _reorder_layer(self, layer_idx: int, beam_idx: Any) -> None:
        if self.kv is not None and layer_idx == 0:  # KVCache.reorder applies to every layer
            self.kv.reorder(np.asarray(beam_idx.cpu() if isinstance(beam_idx, torch.Tensor) else beam_idx))
            self._sync_lengths()

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated keys and values, int8's scales included (0 before the first update)."""
        return 0 if self.kv is None else self.kv.nbytes


# ---- the DynamicCache a twinattn model's forward makes ---------------------------------------------


class _AppendingLayer(DynamicLayer):  # type: ignore[misc]
    """A full-attention layer of the DynamicCache that transformers makes for a model whose attention
    is "twinattn" (default_cache_in_forward): DynamicLayer, appending in place. keys and values
    are views (B, Hkv, stored, D) of buffers with room to grow (twice what they hold when they
    are made or outgrown), so a decode step copies its new token where DynamicLayer's torch.cat
    copies the whole cache, and their NumPy views go to attention_forward as TwinattnCache's do.
    Whatever replaced keys or values since the last update (crop, reorder_cache,
    batch_select_indices and the like assign new tensors) is copied into new buffers first.
    States that require grad, or that NumPy cannot view, are appended by DynamicLayer's torch.cat."""

    keys: Any
    values: Any
    # the NumPy buffers (B, Hkv, capacity, D), and the tensors update last returned (views of
    # them) with their length
    _buffers: Any = None
    _returned: Any = None

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        dtype = key_states.dtype
        if (
            value_states.dtype is not dtype
            or dtype not in NUMPY_DTYPES
            or not key_states.is_cpu
            or key_states.requires_grad
            or value_states.requires_grad
            or _is_dynamo_compiling()
        ):
            return self._concatenated(key_states, value_states, *args, **kwargs)
        new_keys, new_values = array("key_states", key_states), array("value_states", value_states)
        returned, buffers = self._returned, self._buffers
        if returned is not None and returned[0] is self.keys and returned[1] is self.values:
            start = returned[2]  # what update last returned is still what keys and values are
        else:
            buffers = None  # new tensors since the last update (or none yet): copied below
            stored_keys: Any = self.keys
            start = stored_keys.shape[2] if stored_keys.dim() == 4 else 0
        end = start + new_keys.shape[2]
        if buffers is None or end > buffers[0].shape[2] or buffers[0].dtype != new_keys.dtype:
            buffers = self._grow(new_keys, new_values, start, 2 * end)
        if buffers is None:
            return self._concatenated(key_states, value_states, *args, **kwargs)
        key_buffer, value_buffer = buffers
        new_key_shape, new_value_shape, key_shape, value_shape = new_keys.shape, new_values.shape, key_buffer.shape, value_buffer.shape
        if (
            new_key_shape[:2] != key_shape[:2] or new_key_shape[3] != key_shape[3]
            or new_value_shape[:2] != value_shape[:2] or new_value_shape[3] != value_shape[3]
        ):
            # stored and new states of other batches, heads or widths: torch.cat says how
            return self._concatenated(key_states, value_states, *args, **kwargs)
        key_buffer[:, :, start:end] = new_keys
        value_buffer[:, :, start:end] = new_values
        keys, values = key_buffer[:, :, :end], value_buffer[:, :, :end]
        self.keys, self.values = key_tensor, value_tensor = tensor(keys), tensor(values)
        self._buffers, self._returned = buffers, (key_tensor, value_tensor, end)
        _hand_over(key_tensor, value_tensor, (keys, values))
        return key_tensor, value_tensor

    def _concatenated(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """DynamicLayer's update (torch.cat); the buffers are then no longer what keys and values view."""
        self._buffers = self._returned = None
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys, values

    def _grow(self, new_keys: Any, new_values: Any, stored: int, capacity: int) -> Optional[tuple[Any, Any]]:
        """New buffers of `capacity` tokens holding the `stored` tokens of keys and values, or None
        when those do not match the new states' batch, heads and widths."""
        shapes = (new_keys.shape, new_values.shape)
        buffers = tuple(np.empty((*shape[:2], capacity, shape[3]), dtype=new_keys.dtype) for shape in shapes)
        if stored:
            kept_states: tuple[Any, Any] = (self.keys, self.values)
            for buffer, kept in zip(buffers, kept_states):
                if kept.dim() != 4 or (kept.shape[:2], kept.shape[3], kept.shape[2]) != (buffer.shape[:2], buffer.shape[3], stored):
                    return None
                kept_array = array("keys", kept.detach())
                if kept_array.dtype != buffer.dtype:
                    return None
                buffer[:, :, :stored] = kept_array
        return buffers[0], buffers[1]


def _is_twinattn(config: Any) -> bool:
    """Whether a model's config says its (decoder's) attention is "twinattn"."""
    text_config = config.get_text_config(decoder=True)
    return bool(getattr(text_config, "_attn_implementation", None) == NAME)


def default_cache_in_forward() -> None:
    """A DynamicCache made with the config of a model whose attention is "twinattn" appends in
    place: its full-attention layers are _AppendingLayer instead of DynamicLayer. That is the
    cache a model's forward makes when it is given none (use_cache=True: `cache =
    DynamicCache(config=self.config)` in every transformers model), so a loop that hands each
    step the cache the previous step returned copies one token per layer per step, not the whole
    cache; it stays a DynamicCache in every other respect.

    transformers (written against 5.24) has no registry of default caches, and its layer registry
    (DYNAMIC_LAYER_TYPE_MAPPING) is keyed by layer type, not by the model's attention: this wraps
    DynamicCache.__init__, once, the one place every such cache is made, and changes only the
    layers of a cache made with a twinattn model's config (other attentions, a DynamicCache()
    without config and sliding-window layers keep transformers' own layers)."""
    original = DynamicCache.__init__
    if getattr(original, "_twinattn_default_cache", False):
        return
    signature = inspect.signature(original)
    if "config" not in signature.parameters:
        return  # a transformers this was not written for: its DynamicCache is left as it is

    def init(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        call = signature.bind(*args, **kwargs).arguments
        config = call.get("config")
        if config is not None and _is_twinattn(config):
            cache = call["self"]
            cache.layers = [
                _AppendingLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer for layer in cache.layers
            ]

    init._twinattn_default_cache = True  # type: ignore[attr-defined]
    init.__wrapped__ = original  # type: ignore[attr-defined]
    DynamicCache.__init__ = init


# ---- registration -------------------------------------------------------------------------------------


def register() -> None:
    """Register "twinattn" with transformers' AttentionInterface and AttentionMaskInterface, and
    make generate() give a model whose attention is "twinattn" a TwinattnCache by default
    (default_cache_in_generate) and the DynamicCache its forward makes append in place
    (default_cache_in_forward), and let continuous batching keep it; done on import, calling it
    again changes nothing."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
    default_cache_in_generate()
    default_cache_in_forward()
    # generate_batch / ContinuousBatchingManager keep "twinattn" (twinattn.hf_serving)
    accept_in_continuous_batching(NAME)


def _twinattn_cache_for(model: Any, max_cache_len: int) -> Optional[TwinattnCache]:
    """The TwinattnCache that generate gives `model` in place of the DynamicCache it made, or None
    where it keeps that one: attention other than twinattn, an encoder-decoder, a layer kind
    TwinattnCache does not hold."""
    config = model.config
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "_attn_implementation", None) != NAME or getattr(config, "is_encoder_decoder", False):
        return None
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    if any(kind not in ("full_attention", "sliding_attention") for kind in layer_types):
        return None
    return TwinattnCache(max_cache_len=max(int(max_cache_len), 1), config=config)


def default_cache_in_generate() -> None:
    """generate() without a cache argument gives a model whose attention is "twinattn" a
    TwinattnCache of generate's own maximum length where it would make a DynamicCache (no
    cache_implementation, or "dynamic"): decode steps append in place instead of concatenating.

    transformers (written against 5.24) has no registry of default caches: generate makes its
    cache in GenerationMixin._prepare_cache_for_generation, which this wraps, once. The wrapper
    calls it as it is and replaces only a DynamicCache it has just made; a cache the caller passed,
    use_cache=False, cache_implementation="static" / "offloaded" / "quantized", assisted
    decoding's assistant and other models' attentions are left as transformers makes them."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "_twinattn_default_cache", False):
        return
    signature = inspect.signature(original)
    if not {"self", "generation_config", "model_kwargs", "max_cache_length"} <= set(signature.parameters):
        return  # a transformers this was not written for: generate keeps its own default

    def prepare(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs).arguments
        model_kwargs, generation_config = call["model_kwargs"], call["generation_config"]
        # the cache's keyword: "cache" in transformers 5.24, "past_key_values" before
        names = [name for name in ("cache", "past_key_values") if model_kwargs.get(name) is None]
        result = original(*args, **kwargs)
        made = [name for name in names if type(model_kwargs.get(name)) is DynamicCache]
        if (
            made
            and generation_config.cache_implementation in (None, "dynamic")
            and not getattr(generation_config, "is_assistant", False)
        ):
            cache = _twinattn_cache_for(call["self"], call["max_cache_length"])
            if cache is not None:
                model_kwargs[made[0]] = cache
        return result

    prepare._twinattn_default_cache = True  # type: ignore[attr-defined]
    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    GenerationMixin._prepare_cache_for_generation = prepare


register()
