"""The backward pass of twinattn.attention: the gradients of a loss with respect to q, k, v and
sinks, given the gradient with respect to out (and to lse).

    out, lse, out32 = attention_for_training(q, k, v, causal=True, ...)
    dq, dk, dv, dsinks = attention_backward(q, k, v, out32, dout, lse, causal=True, ...)

q, k, v and the keywords are those of the forward call (attention checks and normalises them,
the same way, with the same messages); out and lse are what that call returned (lse from
return_lse=True). backend="numpy" is the float64 reference's exact gradient
(reference.attention_backward_reference); "cpp" and "rust" run the native FlashAttention-2
backward (attention_backward in docs/native_api.md), which recomputes the weights from lse.
Gradients come back in q's dtype (accumulated in float32 natively, rounded once), dsinks in
float32 (float64 for a float64 problem). In float16 and bfloat16 the row term D = rowsum(dout * out)
is taken from out before its rounding: the forward's float32 output out32 when the caller passes
it as out (attention_for_training returns it beside out), else out recomputed by one more forward
in float32. int8 keys and values carry no gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from . import api, reference
from ._backends import native_module
from ._checks import FLOAT32, FLOAT64, HALF_DTYPES, INT8, shape_str
from .api import _unit_last_stride

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Gradients", "TrainingForward", "attention_backward", "attention_for_training"]


class Gradients(NamedTuple):
    """dq, dk, dv in the shapes and dtype of q, k and v; dsinks (Hq,) with sinks, else None."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None


class TrainingForward(NamedTuple):
    """out in q's dtype, lse (float32; float64 for a float64 problem) and out32: for float16 and
    bfloat16, the output in float32 before its rounding (backend "numpy": out widened); otherwise
    out."""

    out: np.ndarray
    lse: np.ndarray
    out32: np.ndarray


def attention_for_training(q: ArrayLike, k: ArrayLike, v: ArrayLike, /, **keywords: Unpack[api._Keywords]) -> TrainingForward:
    """attention(q, k, v, return_lse=True, **keywords) and out32, in one forward: what a training
    step keeps for attention_backward (pass out32 as its out). On the native ports a float16 or
    bfloat16 forward writes out32 beside out (attention_forward's out32, docs/native_api.md), so
    the backward needs no float32 forward of its own."""
    problem = _float_problem(q, k, v, keywords)
    q4, k4, v4 = problem.q, problem.k, problem.v
    if problem.port == "numpy" or q4.dtype not in HALF_DTYPES:
        out, lse = api.attention(q, k, v, return_lse=True, **keywords)
        # NumPy's reference rounds once from float64 (its backward reads no out): out widened
        return TrainingForward(out, lse, out.astype(FLOAT32) if q4.dtype in HALF_DTYPES else out)
    shape = q4.shape[:3] + v4.shape[3:]
    out4, out32, lse = np.empty(shape, q4.dtype), np.empty(shape, FLOAT32), np.empty(q4.shape[:3], FLOAT32)
    native_module(problem.port).attention_forward(
        q4, k4, v4, out4, lse=lse, out32=out32, num_threads=problem.num_threads, **problem.options
    )
    lead = 4 - np.ndim(q)
    return TrainingForward(out4.reshape(shape[lead:]), lse.reshape(lse.shape[lead:]), out32.reshape(shape[lead:]))


def attention_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    /,
    *,
    dlse: np.ndarray | None = None,
    **keywords: Unpack[api._Keywords],
) -> Gradients:
    """The gradients of attention(q, k, v, **keywords) (module docstring): the keywords are the
    forward call's (out and return_lse aside).

    out (..., Hq, Lq, Dv) in q's dtype, or for float16 / bfloat16 in float32: the forward's out32
    (attention_for_training); dout, out's gradient, in q's dtype; lse (..., Hq, Lq) float32
    (float64 for a float64 problem) as the forward returned it; dlse None or lse's shape and
    dtype: the gradient with respect to lse, when the loss uses it.
    """
    problem = _float_problem(q, k, v, keywords)
    q4, k4, v4 = problem.q, problem.k, problem.v
    rank = np.ndim(q)
    lse_dtype = FLOAT64 if q4.dtype == FLOAT64 else FLOAT32
    half = q4.dtype in HALF_DTYPES
    out4 = _as_4d("out", out, q4.shape[:3] + v4.shape[3:], q4.dtype, rank, FLOAT32 if half else None)
    dout4 = _as_4d("dout", dout, q4.shape[:3] + v4.shape[3:], q4.dtype, rank)
    lse3 = _as_4d("lse", lse, q4.shape[:3], lse_dtype, rank - 1)
    dlse3 = None if dlse is None else _as_4d("dlse", dlse, q4.shape[:3], lse_dtype, rank - 1)
    options = problem.options
    with_sinks = options["sinks"] is not None

    if problem.port == "numpy":
        dq, dk, dv, dsinks = reference.attention_backward_reference(q4, k4, v4, dout4, dlse=dlse3, **options)
    else:
        dq, dk, dv = np.empty(q4.shape, q4.dtype), np.empty(k4.shape, q4.dtype), np.empty(v4.shape, q4.dtype)
        dsinks = np.empty(q4.shape[1], FLOAT32) if with_sinks else None
        native = native_module(problem.port)
        # The native backward takes D = rowsum(dout * out) - dlse and gives dS = P * (dP - D). In
        # float16 / bfloat16, D comes from out before its rounding (the rounding, up to half an ulp
        # of out per element, is what the few-key rows of a window or a causal start would carry
        # whole into dq and dk): the forward's out32 when the caller passed it, else out recomputed
        # by one more forward in float32.
        if half and out4.dtype != FLOAT32:
            out32 = np.empty(out4.shape, FLOAT32)
            native.attention_forward(
                q4.astype(FLOAT32), k4.astype(FLOAT32), v4.astype(FLOAT32), out32, num_threads=problem.num_threads,
                **options,
            )
            out4 = out32
        native.attention_backward(
            q4, k4, v4, out4, dout4, lse3, dq, dk, dv, num_threads=problem.num_threads, dsinks=dsinks, dlse=dlse3,
            **options,
        )
    lead = 4 - rank
    return Gradients(
        dq.reshape(dq.shape[lead:]), dk.reshape(dk.shape[lead:]), dv.reshape(dv.shape[lead:]), dsinks
    )


def _float_problem(q: ArrayLike, k: ArrayLike, v: ArrayLike, keywords: Any) -> api.Problem:
    """The forward call's problem, checked and normalised by attention (its messages), with
    float keys and values (int8 ones carry no gradient)."""
    problems: list[api.Problem] = []
    normalise: Any = api.attention  # its private _problem keyword is outside the public overloads
    normalise(q, k, v, **keywords, _problem=problems)
    if problems[0].k.dtype == INT8:
        raise ValueError(
            "k, v: int8 keys and values carry no gradient; compute the gradient with the float keys and values "
            "(twinattn.dequantize_kv) or detach q from the graph"
        )
    return problems[0]


def _as_4d(
    name: str, a: Any, shape: tuple[int, ...], dtype: np.dtype, rank: int, or_dtype: np.dtype | None = None
) -> np.ndarray:
    """out, dout (rank q's) or lse, dlse (one less) checked against the forward's shape and dtype
    (or or_dtype: out's float32 out32), viewed in the 4-D form (3-D for lse) with a unit last
    stride."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype and (or_dtype is None or a.dtype != or_dtype):
        alternative = "" if or_dtype is None else f" or {or_dtype} (the forward's out32)"
        raise TypeError(f"{name}: expected dtype {dtype}{alternative}, got {a.dtype}")
    wanted = shape[len(shape) - rank:]
    if a.shape != wanted:
        raise ValueError(f"{name}: expected shape {shape_str(wanted)}, got {shape_str(a.shape)}")
    return _unit_last_stride(a.reshape(shape))

