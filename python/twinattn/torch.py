"""twinattn on torch CPU tensors (needs torch: `pip install torch`, or the `torch` extra).

    import twinattn.torch
    out = twinattn.torch.attention(q, k, v, causal=True)        # q (B, Hq, Lq, D) CPU tensors
    out = torch.ops.twinattn.attention(q, k, v, True, None, None, None, None)[0]   # the custom op

`attention` takes the keywords of twinattn.attention and reads the tensors in place: each one is
viewed as a NumPy array (Tensor.numpy(), strides as they are, no copy; a bfloat16 tensor through an
int16 view of its bytes, as ml_dtypes.bfloat16), the result is allocated by NumPy and handed back as
a tensor sharing its memory, and the GIL is released while the kernel runs.

dtypes: q, k and v all torch.float32, all torch.float16 or all torch.bfloat16 (float64 with
backend="numpy"); out comes back in q's dtype (a given out must have it), lse in float32. Mixed
dtypes raise TypeError naming the conversion; nothing is cast silently. attn_mask: bool, or an
additive float bias (float32, or q's dtype, widened).

The same computation is registered as the torch custom ops `twinattn::attention` (returns out and
lse) and `twinattn::attention_out` (writes a given out, returns lse), each with a fake
implementation, so torch.compile(fullgraph=True) and torch.export see one opaque op. In eager mode
`attention` calls the implementation directly: the dispatcher's per-call cost would be several
times that of the tiny problems it exists for. For the same reason a call that gives no option but
causal, scale and return_lse goes to the native port itself (twinattn.core.api.plain_attention),
without twinattn.attention's keyword handling and checks, which the native call repeats; whatever
it refuses goes through twinattn.attention, for its message.

Gradients: when grad mode is on and q, k, v or sinks requires grad, `attention` goes through the
op `twinattn::attention`, whose backward (`twinattn::attention_backward`, registered with
torch.library.register_autograd) gives dq, dk, dv and dsinks in the inputs' dtypes: autograd,
torch.compile training graphs and torch.autograd.gradcheck (float64 on backend="numpy") work. In
float16 and bfloat16 the op is `twinattn::attention_for_training` instead, which also returns the
output before its rounding (float32), saved for the backward's row sums. The mask and
alibi_slopes get no gradient; int8 keys and values carry none (asking raises).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("twinattn.torch needs torch: pip install torch") from error

from ._torch_views import BFLOAT16 as _BFLOAT16, INT16 as _INT16, NP_BFLOAT16 as _NP_BFLOAT16
from ._torch_views import array as _array, checked_array as _checked_array, from_numpy as _from_numpy
from ._torch_views import NUMPY_DTYPES as _NUMPY_DTYPES, tensor as _tensor, to_dlpack as _to_dlpack
from ._torch_views import to_numpy as _numpy, view as _view
from .core import _checks, api
from .core import backward as _backward
from .core import varlen as api_varlen
from .core._backends import resolve_backend
from .core.api import _NO_WINDOW
from .nn import sdpa as _sdpa

__all__ = ["attention", "attention_paged", "attention_varlen", "scaled_dot_product_attention"]

_Tensor = torch.Tensor
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
# q, k and v: float32, float16 or bfloat16 (the fast path); float64 with backend="numpy" (_inputs' slow path)
_FAST_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))
_DTYPES = _FAST_DTYPES | {torch.float64}
_DTYPES_TEXT = "torch.float32, torch.float16 or torch.bfloat16"


def _views(q: Any, k: Any, v: Any) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The NumPy views of q, k and v in the common case: three CPU tensors of one dtype, float32,
    float16 or bfloat16, that take part in no autograd graph; each dtype read once, the three
    converted the same way. None for anything else (nothing raised)."""
    try:
        dtype = q.dtype
        if k.dtype is dtype and v.dtype is dtype and dtype in _FAST_DTYPES:
            if dtype is not _BFLOAT16:
                return _numpy(q), _numpy(k), _numpy(v)
            # the int16 view would drop requires_grad (Tensor.numpy refuses it for the other dtypes)
            if not (q.requires_grad or k.requires_grad or v.requires_grad):
                return (
                    _numpy(_view(q, _INT16)).view(_NP_BFLOAT16),
                    _numpy(_view(k, _INT16)).view(_NP_BFLOAT16),
                    _numpy(_view(v, _INT16)).view(_NP_BFLOAT16),
                )
    except (AttributeError, TypeError, RuntimeError):
        pass
    return None


def _plain(q: Any, k: Any, v: Any, causal: Any, scale: Any, return_lse: Any, backend: str) -> Any:
    """api.plain_attention on q, k and v read in place through DLPack capsules: three CPU tensors
    of one dtype, float32, float16 or bfloat16, that take part in no autograd graph. A capsule
    costs 0.2 us a tensor, against 0.6 for Tensor.numpy() and 1.3 for a bfloat16 tensor's NumPy
    view through int16. None for anything else (nothing raised), or where plain_attention has
    something to say."""
    try:
        dtype = q.dtype
        if (
            k.dtype is dtype and v.dtype is dtype and dtype in _FAST_DTYPES
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
        ):
            capsules = (_to_dlpack(q), _to_dlpack(k), _to_dlpack(v))
            return api.plain_attention(q, k, v, causal, scale, return_lse, backend, capsules, _NUMPY_DTYPES[dtype])
    except (AttributeError, TypeError, RuntimeError, BufferError):  # BufferError: to_dlpack of a meta tensor
        pass
    return None


def _inputs(q: Any, k: Any, v: Any, backend: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The NumPy views of q, k and v, one dtype for the three (float32, float16 or bfloat16;
    float64 too, for backend="numpy"): _views in the common case; anything else takes the checked
    path, whose messages name the argument and the conversion in torch's terms."""
    views = _views(q, k, v)
    if views is not None:
        return views
    # q's dtype first, then k's and v's, then what Tensor.numpy refused (device, grad, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        raise _RecordsGrad
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: expected dtype {_DTYPES_TEXT}, got {q.dtype}; convert with q.float()")
    for name, t in (("k", k), ("v", v)):
        # int8 k and v (with k_scale and v_scale) under float q: twinattn.attention checks the pair
        if t.dtype is not q.dtype and not (t.dtype is torch.int8 and q.dtype is not torch.float64):
            raise TypeError(f"{name}: expected dtype {q.dtype} (q's dtype), got {t.dtype}; convert with {name}.to({q.dtype})")
    if q.dtype is torch.float64:
        port = resolve_backend(backend)
        if port != "numpy":
            raise TypeError(
                f"q: backend {port!r} computes in float32 and does not cast silently; got torch.float64: "
                "pass q.float() (and k.float(), v.float()), or use backend='numpy' for float64"
            )
    return _checked_array("q", q), _checked_array("k", k), _checked_array("v", v)


def _optional_array(name: str, t: Any) -> Any:
    return _array(name, t) if isinstance(t, torch.Tensor) else t


class _RecordsGrad(Exception):
    """Raised on the eager path when an input requires grad and grad mode is on: the call then goes
    through the op, whose autograd formula records the backward."""


def _grad_or_array(name: str, t: Any) -> Any:
    """_optional_array for the options autograd may see (attn_mask, alibi_slopes, sinks)."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        raise _RecordsGrad
    return _optional_array(name, t)


# ---- the custom ops: what torch.compile and torch.export see -------------------------------------
# Their signatures need one type per argument: q_offset and kv_lens are int64 tensors (B,) or None
# (twinattn.torch.attention converts an int), window_size is two ints, and lse always comes back
# (it costs Lq floats a head).


# The options after q, k, v (and out), one list for both ops' schemas: (type, name, default), in
# twinattn.attention's keywords; the dispatcher passes the options a caller gave, the rest are the
# defaults here
_REQUIRED = object()
_OPTIONS = (
    ("bool", "causal", _REQUIRED), ("Tensor?", "q_offset", _REQUIRED), ("Tensor?", "kv_lens", _REQUIRED),
    ("Tensor?", "attn_mask", _REQUIRED), ("float?", "scale", _REQUIRED), ("str", "backend", "auto"),
    ("int?", "num_threads", None), ("int", "window_left", -1), ("int", "window_right", -1), ("float", "softcap", 0.0),
    ("Tensor?", "alibi_slopes", None), ("Tensor?", "sinks", None), ("Tensor?", "k_scale", None), ("Tensor?", "v_scale", None),
)
_OPTIONS_SCHEMA = ", ".join(f"{kind} {name}" + ("" if default is _REQUIRED else f"={default!r}") for kind, name, default in _OPTIONS)
_OPTION_DEFAULTS = tuple(default for _, _, default in _OPTIONS)


def _run_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor], options: Tuple[Any, ...]) -> Any:
    """The ops' implementation: twinattn.torch.attention (eager) with the options of the schema."""
    options += _OPTION_DEFAULTS[len(options):]
    causal, q_offset, kv_lens, attn_mask, scale, backend, num_threads, left, right, softcap, slopes, sinks, k_scale, v_scale = options
    return attention(
        q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens, attn_mask=attn_mask, scale=scale, return_lse=True,
        out=out, backend=backend, num_threads=num_threads, window_size=_window(left, right), softcap=softcap,
        alibi_slopes=slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _run_op(q, k, v, None, options)
    return out, lse


def _attention_out_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *options: Any) -> torch.Tensor:
    _, lse = _run_op(q, k, v, out, options)
    return lse


def _window(left: int, right: int) -> Tuple[int, int]:
    # twinattn.attention's own default object when there is no window: it then checks nothing
    return _NO_WINDOW if left == -1 and right == -1 else (left, right)


# The fake implementations: the results' shapes and dtypes, from q, k and v alone (the options
# after them change neither)
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_options: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    lse = _lse_fake(q, k, v)
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), lse


def _attention_out_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *_options: Any) -> torch.Tensor:
    return _lse_fake(q, k, v)


def _lse_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # the shapes the fake results are built from; the real op checks everything else
    if not (q.dim() == k.dim() == v.dim() and 2 <= q.dim() <= 4):
        raise ValueError(
            f"q, k, v: expected 2, 3 or 4 dimensions (B, H, L, D), one rank for all three, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    # lse is float32 whatever q's dtype (float64 for a float64 problem, backend="numpy")
    return q.new_empty(q.shape[:-1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


# (registered by call rather than as decorators: torch is typed Any here, and mypy --strict rejects
# untyped decorators)
_attention_op = torch.library.custom_op(
    "twinattn::attention", _attention_impl, mutates_args=(), schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor)"
)
_attention_op.register_fake(_attention_fake)
_attention_out_op = torch.library.custom_op(
    "twinattn::attention_out", _attention_out_impl, mutates_args=("out",),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_OPTIONS_SCHEMA}) -> Tensor",
)
_attention_out_op.register_fake(_attention_out_fake)


def _as_index_tensor(name: str, value: Any) -> Any:
    """An int or a sequence as an int64 tensor, for the ops' schema (an int64 tensor passes as is)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int or an int array of shape (B,), got bool")
    return torch.as_tensor(np.asarray(value, dtype=np.int64))


def _through_op(
    q: Any, k: Any, v: Any, causal: bool, q_offset: Any, kv_lens: Any, attn_mask: Any, scale: Optional[float], return_lse: bool,
    out: Any, backend: str, num_threads: Optional[int], window_size: Tuple[int, int], softcap: float, alibi_slopes: Any,
    sinks: Any, k_scale: Any, v_scale: Any,
) -> Any:
    """attention through the custom ops: what torch.compile and torch.export trace, and what
    autograd records (eager calls whose inputs require grad)."""
    offsets = _as_index_tensor("q_offset", q_offset)
    lens = _as_index_tensor("kv_lens", kv_lens)
    variants = (*_checks.window_size(window_size), _checks.softcap(softcap), alibi_slopes, sinks, k_scale, v_scale)
    if out is None and _keeps_out32(q, k, v, sinks):
        out, lse, _ = torch.ops.twinattn.attention_for_training(
            q, k, v, causal, offsets, lens, attn_mask, scale, backend, num_threads, *variants
        )
    elif out is None:
        out, lse = torch.ops.twinattn.attention(q, k, v, causal, offsets, lens, attn_mask, scale, backend, num_threads, *variants)
    else:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, sinks)):
            raise RuntimeError(
                "out: twinattn.torch.attention(..., out=...) does not record gradients (as torch's out= functions); "
                "call it without out= when q, k, v or sinks require grad"
            )
        lse = torch.ops.twinattn.attention_out(q, k, v, out, causal, offsets, lens, attn_mask, scale, backend, num_threads, *variants)
    return (out, lse) if return_lse else out


# ---- the backward: an op of its own, so that torch.compile traces training graphs -----------------


def _attention_backward_impl(
    dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *options: Any,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (q's dtype) and dsinks (float32; float64 for a float64 problem; empty without
    sinks) by twinattn.core.backward, on the tensors' NumPy views."""
    qa, ka, va, keywords = _numpy_problem(q, k, v, options)
    grads = _backward.attention_backward(
        qa, ka, va, _array("out", out), _array("dout", dout), _array("lse", lse),
        dlse=None if dlse is None else _array("dlse", dlse), **keywords,
    )
    sinks = keywords["sinks"]
    dsinks = _dsinks_fake(q, sinks) if grads.dsinks is None else _from_numpy(grads.dsinks)
    return _tensor(grads.dq), _tensor(grads.dk), _tensor(grads.dv), dsinks


def _numpy_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """The NumPy views of q, k, v and the schema's options as twinattn.attention's keywords (the
    training ops' implementations)."""
    options += _OPTION_DEFAULTS[len(options):]
    causal, q_offset, kv_lens, attn_mask, scale, backend, num_threads, left, right, softcap, slopes, sinks, k_scale, v_scale = options
    if isinstance(q_offset, torch.Tensor):
        q_offset = _array("q_offset", q_offset)
        q_offset = int(q_offset) if q_offset.ndim == 0 else q_offset
    with torch.no_grad():  # saved leaves that require grad are read as they are (no double backward)
        qa, ka, va = _inputs(q, k, v, backend)
    keywords = dict(
        causal=causal, q_offset=q_offset, kv_lens=_optional_array("kv_lens", kv_lens),
        attn_mask=_optional_array("attn_mask", attn_mask), scale=scale, backend=backend, num_threads=num_threads,
        window_size=_window(left, right), softcap=softcap, alibi_slopes=_optional_array("alibi_slopes", slopes),
        sinks=_optional_array("sinks", sinks), k_scale=_optional_array("k_scale", k_scale),
        v_scale=_optional_array("v_scale", v_scale),
    )
    return qa, ka, va, keywords


def _attention_backward_fake(
    dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *options: Any,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    sinks = options[_SINKS] if len(options) > _SINKS else None
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), _dsinks_fake(q, sinks)


def _dsinks_fake(q: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    # (Hq,) with sinks, else empty: an op returns a tensor in every slot of its schema
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((0,) if sinks is None else sinks.shape, dtype=dtype)


_SINKS = [name for _, name, _ in _OPTIONS].index("sinks")
_attention_backward_op = torch.library.custom_op(
    "twinattn::attention_backward", _attention_backward_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
_attention_backward_op.register_fake(_attention_backward_fake)


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, torch.Tensor]) -> None:
    """Saves what the backward needs: q, k, v, out, lse and the options (tensors among them
    through save_for_backward)."""
    q, k, v, *options = inputs
    if k.dtype == torch.int8 or v.dtype == torch.int8:
        raise ValueError(
            "k, v: int8 keys and values carry no gradient; detach q (and sinks) from the graph, or compute with "
            "the float keys and values (twinattn.dequantize_kv)"
        )
    ctx.save_for_backward(q, k, v, *output, *(o if isinstance(o, torch.Tensor) else None for o in options))
    ctx.options = tuple(None if isinstance(o, torch.Tensor) else o for o in options)
    # An output the loss does not use gets None, not zeros of its shape (lse's; the training
    # forward's out32, float32 and as large as out)
    ctx.set_materialize_grads(False)


def _attention_backward(ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor]) -> Tuple[Any, ...]:
    q, k, v, out, lse, *saved = ctx.saved_tensors
    options = tuple(t if t is not None else o for t, o in zip(saved, ctx.options))
    if dout is None:
        dout = torch.zeros_like(out, dtype=q.dtype)  # out: q's dtype, or float32 (out32)
    dq, dk, dv, dsinks = torch.ops.twinattn.attention_backward(dout, dlse, q, k, v, out, lse, *options)
    # one gradient per input of the op: q, k, v, then the options (only sinks has one)
    option_grads: list[Any] = [None] * len(options)
    if options[_SINKS] is not None:
        option_grads[_SINKS] = dsinks
    return (dq, dk, dv, *option_grads)


_attention_op.register_autograd(_attention_backward, setup_context=_setup_context)


# ---- a float16 / bfloat16 call whose gradient autograd records: the forward keeps out32 -----------
# (out before its rounding, float32) for the backward's D = rowsum(dout * out), which then needs no
# float32 forward of its own (twinattn.core.backward.attention_for_training)

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _keeps_out32(q: Any, k: Any, v: Any, sinks: Any) -> bool:
    """Whether _through_op runs attention_for_training: a float16 / bfloat16 call (float keys)
    whose gradient autograd records."""
    dtype = getattr(q, "dtype", None)
    return (
        dtype in _HALF_DTYPES and getattr(k, "dtype", None) is dtype and torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, sinks))
    )


def _attention_for_training_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options: Any
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qa, ka, va, keywords = _numpy_problem(q, k, v, options)
    out, lse, out32 = _backward.attention_for_training(qa, ka, va, **keywords)
    return _tensor(out), _from_numpy(lse), _tensor(out32)


def _attention_for_training_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options: Any
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse = _attention_fake(q, k, v)
    return out, lse, out.new_empty(out.shape, dtype=torch.float32)


def _for_training_setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, ...]) -> None:
    """_setup_context with out32 saved as the backward's out."""
    _, lse, out32 = output
    ctx.mark_non_differentiable(out32)
    _setup_context(ctx, inputs, (out32, lse))


def _attention_for_training_backward(
    ctx: Any, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor], _dout32: Optional[torch.Tensor]
) -> Tuple[Any, ...]:
    return _attention_backward(ctx, dout, dlse)


_attention_for_training_op = torch.library.custom_op(
    "twinattn::attention_for_training", _attention_for_training_impl, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)
_attention_for_training_op.register_fake(_attention_for_training_fake)
_attention_for_training_op.register_autograd(
    _attention_for_training_backward, setup_context=_for_training_setup_context
)


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
    window_size: Tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """twinattn.attention on torch CPU tensors: same keywords, same semantics, tensors back.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), all float32, all float16 or all
    bfloat16 -> out (B, Hq, Lq, Dv) in q's dtype [and lse (B, Hq, Lq) float32 with
    return_lse=True]. q_offset: None, an int or an int tensor (B,); kv_lens: None or an int
    tensor (B,); attn_mask: bool (True = may attend) or a float bias (float32 or q's dtype)
    broadcastable to (B, Hq, Lq, Lk); out: a preallocated tensor in q's dtype (any strides),
    written in place and returned. window_size, softcap, alibi_slopes and sinks (float32 tensors)
    as twinattn.attention; int8 k and v with their float32 k_scale and v_scale (B, Hkv, Lk)
    tensors.

    Differentiable with respect to q, k, v and sinks (module docstring): gradients in the inputs'
    dtypes, accumulated in float32. Not with out= (as torch's out= functions), nor with int8 k
    and v.
    """
    if not ((type(q) is _Tensor and not _is_dynamo_compiling()) or not torch.compiler.is_compiling()):
        # Traced (torch.compile, torch.export): one custom op in the graph. (A plain Tensor outside
        # Dynamo is eager, which is_dynamo_compiling says in 15 ns; anything else, a subclass or
        # torch.export's fake tensors, asks is_compiling, 110 ns.)
        return _through_op(
            q, k, v, causal, q_offset, kv_lens, attn_mask, scale, return_lse, out, backend, num_threads, window_size, softcap,
            alibi_slopes, sinks, k_scale, v_scale,
        )

    # Eager (and the custom ops' implementation): twinattn.attention on the tensors' NumPy views,
    # called directly (the dispatcher would cost several times the tiny problems this exists for).
    # Every step here is per call: q, k and v share one dtype read and one conversion.
    if (
        # (a chain of `is`: all of them None) every other option at its default: twinattn.attention's
        # plain call without its keyword handling and the checks of options not given, which cost
        # more than the tiny problems this exists for; None for what needs those checks
        q_offset is kv_lens is attn_mask is out is num_threads is alibi_slopes is sinks is k_scale is v_scale is None
        and window_size is _NO_WINDOW and type(softcap) is float and softcap == 0.0
    ):
        plain: Any = _plain(q, k, v, causal, scale, return_lse, backend)
        if plain is not None:
            return (_tensor(plain[0]), _from_numpy(plain[1])) if return_lse else _tensor(plain)
    views = _views(q, k, v)
    # An input that requires grad (grad mode on) raises _RecordsGrad in _inputs: autograd's path, the op.
    try:
        qa, ka, va = _inputs(q, k, v, backend) if views is None else views
        attn_mask_array = None if attn_mask is None else _grad_or_array("attn_mask", attn_mask)
        slopes_array = None if alibi_slopes is None else _grad_or_array("alibi_slopes", alibi_slopes)
        sinks_array = None if sinks is None else _grad_or_array("sinks", sinks)
    except _RecordsGrad:
        return _through_op(
            q, k, v, causal, q_offset, kv_lens, attn_mask, scale, return_lse, out, backend, num_threads, window_size, softcap,
            alibi_slopes, sinks, k_scale, v_scale,
        )
    out_array = None
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype is not q.dtype:
            raise TypeError(f"out: expected dtype {q.dtype} (q's dtype), got {out.dtype}; allocate it with dtype={q.dtype}")
        out_array = _array("out", out)
    if q_offset is not None:
        q_offset = _optional_array("q_offset", q_offset)
        if isinstance(q_offset, np.ndarray) and q_offset.ndim == 0:
            q_offset = int(q_offset)  # an int q_offset crosses the op's schema as a 0-d tensor
    result: Any = api.attention(
        qa,
        ka,
        va,
        causal=causal,
        q_offset=q_offset,
        kv_lens=None if kv_lens is None else _optional_array("kv_lens", kv_lens),
        attn_mask=attn_mask_array,
        scale=scale,
        return_lse=return_lse,
        # without out, twinattn allocates with NumPy and torch.from_numpy shares that memory:
        # cheaper per call (0.45 us) than torch.empty (1.05 us) and a view of it
        out=out_array,
        backend=backend,
        num_threads=num_threads,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=slopes_array,
        sinks=sinks_array,
        k_scale=None if k_scale is None else _optional_array("k_scale", k_scale),
        v_scale=None if v_scale is None else _optional_array("v_scale", v_scale),
    )
    if return_lse:
        return out if out is not None else _tensor(result[0]), _from_numpy(result[1])
    return out if out is not None else _tensor(result)


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

    The same function as twinattn.scaled_dot_product_attention (see twinattn.nn.sdpa), reading the
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


# ---- packed (varlen) and paged attention ------------------------------------------------------------
# The same pattern as attention: eager calls run twinattn.attention_varlen / attention_paged on the
# tensors' NumPy views; traced calls see one custom op each, whose fake implementation gives the
# shapes (out (total_q, Hq, Dv) in q's dtype, lse (Hq, total_q) float32).

_PACKED_OPTIONS = (
    "bool causal, float? scale, str backend, int? num_threads, int window_left, int window_right, float softcap, "
    "Tensor? alibi_slopes, Tensor? sinks, Tensor? k_scale, Tensor? v_scale"
)


def _packed_views(names: Tuple[str, ...], tensors: Tuple[Any, ...], backend: str) -> list[Any]:
    """q, the keys and values (one dtype, as attention's _inputs), and the other tensors' NumPy views.
    These calls have no backward: an input that requires grad (grad mode on) gets _checked_array's
    error, naming it."""
    try:
        views = list(_inputs(tensors[0], tensors[1], tensors[2], backend))
    except _RecordsGrad:
        views = [_checked_array(name, t) for name, t in zip(names[:3], tensors[:3])]  # raises for the first
    return views + [_optional_array(name, t) for name, t in zip(names[3:], tensors[3:])]


def _packed_result(result: Any, out: Any, return_lse: bool) -> Any:
    out_array, lse = result if return_lse else (result, None)
    tensor_out = out if out is not None else _tensor(out_array)
    return (tensor_out, _from_numpy(lse)) if return_lse else tensor_out


def _out_view(out: Any, q: Any) -> Any:
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype is not q.dtype:
        raise TypeError(f"out: expected dtype {q.dtype} (q's dtype), got {out.dtype}; allocate it with dtype={q.dtype}")
    return _array("out", out)


def _variants(window_size: Any, softcap: Any) -> Tuple[int, int, float]:
    left, right = _checks.window_size(window_size)
    return left, right, _checks.softcap(softcap)


def _traced(op: Any, tensors: Tuple[Any, ...], causal: bool, scale: Any, backend: str, num_threads: Any, window_size: Any,
            softcap: Any, extras: Tuple[Any, ...], out: Any, return_lse: bool) -> Any:
    result, lse = op(*tensors, causal, scale, backend, num_threads, *_variants(window_size, softcap), *extras)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


def _packed_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_rest: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


_VARLEN_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
_PAGED_TENSORS = ("q", "k_cache", "v_cache", "block_table", "seq_lens", "cu_seqlens_q")


def _varlen_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool,
                 scale: Optional[float], backend: str, num_threads: Optional[int], left: int, right: int, softcap: float,
                 *extras: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    slopes, sinks, k_scale, v_scale = extras
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, backend=backend, num_threads=num_threads,
                                window_size=_window(left, right), softcap=softcap, alibi_slopes=slopes, sinks=sinks,
                                k_scale=k_scale, v_scale=v_scale, return_lse=True)
    return out, lse


def _paged_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                cu_q: Optional[torch.Tensor], causal: bool, scale: Optional[float], backend: str, num_threads: Optional[int],
                left: int, right: int, softcap: float, *extras: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    slopes, sinks, k_scale, v_scale = extras
    out, lse = attention_paged(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu_q, causal=causal, scale=scale, backend=backend,
                               num_threads=num_threads, window_size=_window(left, right), softcap=softcap, alibi_slopes=slopes,
                               sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    return out, lse


_varlen_op = torch.library.custom_op(
    "twinattn::attention_varlen", _varlen_impl, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, {_PACKED_OPTIONS}) -> (Tensor, Tensor)",
)
_varlen_op.register_fake(_packed_fake)
_paged_op = torch.library.custom_op(
    "twinattn::attention_paged", _paged_impl, mutates_args=(),
    schema=(
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, Tensor? cu_seqlens_q, "
        f"{_PACKED_OPTIONS}) -> (Tensor, Tensor)"
    ),
)
_paged_op.register_fake(_packed_fake)


def attention_varlen(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False, scale: Optional[float] = None,
    window_size: Tuple[int, int] = _NO_WINDOW, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    return_lse: bool = False, out: Any = None, backend: str = "auto", num_threads: Optional[int] = None,
    k_scale: Any = None, v_scale: Any = None,
) -> Any:
    """twinattn.attention_varlen on torch CPU tensors, read in place: q (total_q, Hq, D), k and v
    (total_k, Hkv, D / Dv), cu_seqlens_q and cu_seqlens_k int32 or int64 tensors (B + 1,) ->
    out (total_q, Hq, Dv) in q's dtype [, lse (Hq, total_q) float32]. Forward only."""
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    if not ((type(q) is _Tensor and not _is_dynamo_compiling()) or not torch.compiler.is_compiling()):
        extras = (alibi_slopes, sinks, k_scale, v_scale)
        return _traced(torch.ops.twinattn.attention_varlen, tensors, causal, scale, backend, num_threads, window_size, softcap,
                       extras, out, return_lse)
    qa, ka, va, cu_q, cu_k = _packed_views(_VARLEN_TENSORS, tensors, backend)
    result = api_varlen.attention_varlen(
        qa, ka, va, cu_q, cu_k, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
        alibi_slopes=_optional_array("alibi_slopes", alibi_slopes), sinks=_optional_array("sinks", sinks),
        return_lse=return_lse, out=_out_view(out, q), backend=backend, num_threads=num_threads,
        k_scale=_optional_array("k_scale", k_scale), v_scale=_optional_array("v_scale", v_scale),
    )
    return _packed_result(result, out, return_lse)


def attention_paged(
    q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any, *, cu_seqlens_q: Any = None, causal: bool = True,
    scale: Optional[float] = None, window_size: Tuple[int, int] = _NO_WINDOW, softcap: float = 0.0, alibi_slopes: Any = None,
    sinks: Any = None, k_scale: Any = None, v_scale: Any = None, return_lse: bool = False, out: Any = None,
    backend: str = "auto", num_threads: Optional[int] = None,
) -> Any:
    """twinattn.attention_paged on torch CPU tensors, read in place: q (total_q, Hq, D), k_cache
    and v_cache (num_blocks, block_size, Hkv, D / Dv) (any strides: interleaved K/V pages too),
    block_table int32 (B, max_blocks), seq_lens (B,), cu_seqlens_q (B + 1,) or None (decode) ->
    out (total_q, Hq, Dv) in q's dtype [, lse (Hq, total_q) float32]. Forward only."""
    tensors = (q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q)
    if not ((type(q) is _Tensor and not _is_dynamo_compiling()) or not torch.compiler.is_compiling()):
        extras = (alibi_slopes, sinks, k_scale, v_scale)
        return _traced(torch.ops.twinattn.attention_paged, tensors, causal, scale, backend, num_threads, window_size, softcap,
                       extras, out, return_lse)
    qa, kc, vc, table, lens, cu_q = _packed_views(_PAGED_TENSORS, tensors, backend)
    result = api_varlen.attention_paged(
        qa, kc, vc, table, lens, cu_seqlens_q=cu_q, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
        alibi_slopes=_optional_array("alibi_slopes", alibi_slopes), sinks=_optional_array("sinks", sinks),
        k_scale=_optional_array("k_scale", k_scale), v_scale=_optional_array("v_scale", v_scale),
        return_lse=return_lse, out=_out_view(out, q), backend=backend, num_threads=num_threads,
    )
    return _packed_result(result, out, return_lse)
