"""twinattn on torch CPU tensors (needs `pip install twinattn[torch]`).

    import twinattn.torch
    out = twinattn.torch.attention(q, k, v, causal=True)        # q (B, Hq, Lq, D) float32 CPU tensors
    out = torch.ops.twinattn.attention(q, k, v, True, None, None, None, None)[0]   # the custom op

`attention` takes the keywords of twinattn.attention and reads the tensors in place: each one is
viewed as a NumPy array (Tensor.numpy(), strides as they are, no copy), the result is allocated as
a torch tensor and written through such a view, and the GIL is released while the kernel runs.

The same computation is registered as the torch custom ops `twinattn::attention` (returns out and
lse) and `twinattn::attention_out` (writes a given out, returns lse), each with a fake
implementation, so torch.compile(fullgraph=True) and torch.export see one opaque op. In eager mode
`attention` calls the implementation directly: the dispatcher's per-call cost would be several
times that of the tiny problems it exists for.

Forward only: inputs that require grad raise (there is no backward). float32 for now (float64 with
backend="numpy"); bfloat16 and float16 raise TypeError until the kernels take them.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("twinattn.torch needs torch: pip install 'twinattn[torch]'") from error

from . import api
from . import sdpa as _sdpa

__all__ = ["attention", "scaled_dot_product_attention"]

_ACCEPTED = (torch.float32, torch.float64)


def _array(name: str, t: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor that takes part in no autograd graph."""
    # the common case first, in the fewest attribute reads (this runs four times a call)
    if type(t) is torch.Tensor and t.is_cpu and t.dtype is torch.float32 and not t.requires_grad:
        return t.numpy()  # type: ignore[no-any-return]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name}: twinattn runs on the CPU; expected a CPU tensor, got one on {t.device} "
            f"(move it with {name}.cpu(), or use torch's own attention on that device)"
        )
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: requires grad, but twinattn computes the forward pass only (no backward); "
            "call it under torch.no_grad() or torch.inference_mode(), or pass a detached tensor"
        )
    if t.is_floating_point() and t.dtype not in _ACCEPTED:
        raise TypeError(
            f"{name}: expected float32, got {t.dtype}; twinattn's kernels take float32 for now: "
            f"pass {name}.float()"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense strided tensor, got layout {t.layout}")
    return t.detach().numpy()  # type: ignore[no-any-return]


def _optional_array(name: str, t: Any) -> Any:
    return _array(name, t) if isinstance(t, torch.Tensor) else t


def _compute(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    causal: bool,
    q_offset: Any,
    kv_lens: Any,
    attn_mask: Any,
    scale: Optional[float],
    return_lse: bool,
    backend: str,
    num_threads: Optional[int],
) -> Any:
    """The shared implementation: torch tensors in, twinattn.attention on their NumPy views."""
    offsets = _optional_array("q_offset", q_offset)
    if isinstance(offsets, np.ndarray) and offsets.ndim == 0:
        offsets = int(offsets)  # an int q_offset crosses the op's schema as a 0-d tensor
    result = api.attention(
        _array("q", q),
        _array("k", k),
        _array("v", v),
        causal=causal,
        q_offset=offsets,
        kv_lens=_optional_array("kv_lens", kv_lens),
        attn_mask=_optional_array("attn_mask", attn_mask),
        scale=scale,
        return_lse=return_lse,
        # without out, twinattn allocates with NumPy and torch.from_numpy shares that memory: cheaper
        # per call than torch.empty and a view of it
        out=None if out is None else _array("out", out),
        backend=backend,
        num_threads=num_threads,
    )
    if return_lse:
        return out if out is not None else torch.from_numpy(result[0]), torch.from_numpy(result[1])
    return out if out is not None else torch.from_numpy(result)


# ---- the custom ops: what torch.compile and torch.export see -------------------------------------
# Their signatures need one type per argument: q_offset and kv_lens are int64 tensors (B,) or None
# (twinattn.torch.attention converts an int), and lse always comes back (it costs Lq floats a head).


def _attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    q_offset: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: str = "auto",
    num_threads: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _compute(q, k, v, None, causal, q_offset, kv_lens, attn_mask, scale, True, backend, num_threads)
    return out, lse


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    q_offset: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: str = "auto",
    num_threads: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_fake_ranks(q, k, v)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    return out, q.new_empty(q.shape[:-1])


def _attention_out_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    q_offset: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: str = "auto",
    num_threads: Optional[int] = None,
) -> torch.Tensor:
    _, lse = _compute(q, k, v, out, causal, q_offset, kv_lens, attn_mask, scale, True, backend, num_threads)
    return lse


def _attention_out_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    q_offset: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: str = "auto",
    num_threads: Optional[int] = None,
) -> torch.Tensor:
    _check_fake_ranks(q, k, v)
    return q.new_empty(q.shape[:-1])


# (registered by call rather than as decorators: torch is typed Any here, and mypy --strict rejects
# untyped decorators)
_attention_op = torch.library.custom_op("twinattn::attention", _attention_impl, mutates_args=())
_attention_op.register_fake(_attention_fake)
_attention_out_op = torch.library.custom_op("twinattn::attention_out", _attention_out_impl, mutates_args=("out",))
_attention_out_op.register_fake(_attention_out_fake)


def _check_fake_ranks(q: Any, k: Any, v: Any) -> None:
    # the shapes the fake results are built from; the real op checks everything else
    if not (q.dim() == k.dim() == v.dim() and 2 <= q.dim() <= 4):
        raise ValueError(
            f"q, k, v: expected 2, 3 or 4 dimensions (B, H, L, D), one rank for all three, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def _as_index_tensor(name: str, value: Any) -> Any:
    """An int or a sequence as an int64 tensor, for the ops' schema (an int64 tensor passes as is)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int or an int array of shape (B,), got bool")
    return torch.as_tensor(np.asarray(value, dtype=np.int64))


# ---- the public functions -------------------------------------------------------------------------


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    q_offset: Any = None,
    kv_lens: Any = None,
    attn_mask: Any = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    out: Any = None,
    backend: str = "auto",
    num_threads: Optional[int] = None,
) -> Any:
    """twinattn.attention on torch CPU tensors: same keywords, same semantics, tensors back.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) float32 -> out (B, Hq, Lq, Dv)
    [and lse (B, Hq, Lq) with return_lse=True]. q_offset: None, an int or an int tensor (B,);
    kv_lens: None or an int tensor (B,); attn_mask: bool (True = may attend) or float32 bias
    broadcastable to (B, Hq, Lq, Lk); out: a preallocated float32 tensor (any strides with a
    unit last one), written in place and returned. Forward only.
    """
    if not torch.compiler.is_compiling():
        return _compute(q, k, v, out, causal, q_offset, kv_lens, attn_mask, scale, return_lse, backend, num_threads)
    # Traced (torch.compile, torch.export): one custom op in the graph.
    offsets = _as_index_tensor("q_offset", q_offset)
    lens = _as_index_tensor("kv_lens", kv_lens)
    if out is None:
        out, lse = torch.ops.twinattn.attention(q, k, v, causal, offsets, lens, attn_mask, scale, backend, num_threads)
    else:
        lse = torch.ops.twinattn.attention_out(q, k, v, out, causal, offsets, lens, attn_mask, scale, backend, num_threads)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: Optional[str] = None,
    backend: str = "auto",
) -> Any:
    """torch.nn.functional.scaled_dot_product_attention's signature on torch CPU tensors.

    The same function as twinattn.scaled_dot_product_attention (see twinattn.sdpa), reading the
    tensors in place: is_causal with L != S asks for causal_alignment ('upper_left', torch's, or
    'lower_right', the KV-cache case) instead of guessing; dropout_p must be 0.0.
    """
    result = _sdpa.scaled_dot_product_attention(
        _array("query", query),
        _array("key", key),
        _array("value", value),
        attn_mask=_optional_array("attn_mask", attn_mask),
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
        backend=backend,
    )
    return torch.from_numpy(result)
