"""The backward pass of twinattn.attention: the gradients of a loss with respect to q, k, v and
sinks, given the gradient with respect to out (and to lse).

    dq, dk, dv, dsinks = attention_backward(q, k, v, out, dout, lse, causal=True, ...)

q, k, v and the keywords are those of the forward call (attention checks and normalises them,
the same way, with the same messages); out and lse are what that call returned (lse from
return_lse=True). backend="numpy" is the float64 reference's exact gradient
(reference.attention_backward_reference); "cpp" and "rust" run the native FlashAttention-2
backward (attention_backward in docs/native_api.md), which recomputes the weights from lse.
Gradients come back in q's dtype (accumulated in float32 natively, rounded once), dsinks in
float32 (float64 for a float64 problem). In float16 and bfloat16 the row term D = rowsum(dout * out)
is taken from out recomputed in float32 (one more forward), not from the rounded out. int8 keys
and values carry no gradient.
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

__all__ = ["Gradients", "attention_backward"]


class Gradients(NamedTuple):
    """dq, dk, dv in the shapes and dtype of q, k and v; dsinks (Hq,) with sinks, else None."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None


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

    out (..., Hq, Lq, Dv) and dout, its gradient, in q's dtype; lse (..., Hq, Lq) float32
    (float64 for a float64 problem) as the forward returned it; dlse None or lse's shape and
    dtype: the gradient with respect to lse, when the loss uses it.
    """
    problems: list[api.Problem] = []
    normalise: Any = api.attention  # its private _problem keyword is outside the public overloads
    normalise(q, k, v, **keywords, _problem=problems)
    problem = problems[0]
    q4, k4, v4 = problem.q, problem.k, problem.v
    if k4.dtype == INT8:
        raise ValueError(
            "k, v: int8 keys and values carry no gradient; compute the gradient with the float keys and values "
            "(twinattn.dequantize_kv) or detach q from the graph"
        )
    rank = np.ndim(q)
    lse_dtype = FLOAT64 if q4.dtype == FLOAT64 else FLOAT32
    out4 = _as_4d("out", out, q4.shape[:3] + v4.shape[3:], q4.dtype, rank)
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
        value_dim = v4.shape[3]
        native = native_module(problem.port)
        # The native backward takes D = rowsum(dout * out) and gives dS = P * (dP - D). Two terms
        # correct that D: lse's gradient (dS = P * (dP - D + dlse)), and in float16 / bfloat16
        # the rounding of out (up to half an ulp of out per element, which the few-key rows of a
        # window or a causal start carry whole into dq and dk): D is then taken from out
        # recomputed in float32 (one more forward). Both enter as one more value column, 0 in v,
        # 1 in dout and the correction in out, which leaves dP as it is and moves D (dv's extra
        # column is dropped).
        correction = None if dlse3 is None or not np.any(dlse3 != 0) else -dlse3.astype(np.float64)
        if q4.dtype in HALF_DTYPES:
            out32 = np.empty(out4.shape, FLOAT32)
            native.attention_forward(
                q4.astype(FLOAT32), k4.astype(FLOAT32), v4.astype(FLOAT32), out32, num_threads=problem.num_threads,
                **options,
            )
            # rowsum(dout * (out32 - out)) in float32: the difference is exact where the two are
            # within a factor of 2 of each other, and the sum's own rounding (~1e-7 of the drift)
            # is far below the correction's rounding to q's dtype; the float64 form took 3x longer
            drift = np.einsum("...j,...j->...", dout4.astype(FLOAT32), out32 - out4.astype(FLOAT32))
            correction = drift if correction is None else correction + drift
        if correction is not None:
            v4 = _with_column(v4, np.zeros(v4.shape[:3], v4.dtype))
            dout4 = _with_column(dout4, np.ones(dout4.shape[:3], dout4.dtype))
            out4 = _with_column(out4, correction.astype(out4.dtype))
            dv = np.empty(v4.shape, q4.dtype)
        native.attention_backward(
            q4, k4, v4, out4, dout4, lse3, dq, dk, dv, num_threads=problem.num_threads, dsinks=dsinks, **options
        )
        dv = np.ascontiguousarray(dv[..., :value_dim])  # contiguous, as the torch op's fake says
    lead = 4 - rank
    return Gradients(
        dq.reshape(dq.shape[lead:]), dk.reshape(dk.shape[lead:]), dv.reshape(dv.shape[lead:]), dsinks
    )


def _as_4d(name: str, a: Any, shape: tuple[int, ...], dtype: np.dtype, rank: int) -> np.ndarray:
    """out, dout (rank q's) or lse, dlse (one less) checked against the forward's shape and dtype,
    viewed in the 4-D form (3-D for lse) with a unit last stride."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    wanted = shape[len(shape) - rank:]
    if a.shape != wanted:
        raise ValueError(f"{name}: expected shape {shape_str(wanted)}, got {shape_str(a.shape)}")
    return _unit_last_stride(a.reshape(shape))


def _with_column(a: np.ndarray, column: np.ndarray) -> np.ndarray:
    """a (B, H, L, W) with column (B, H, L) appended as its last: (B, H, L, W + 1)."""
    return np.concatenate([a, column[..., None]], axis=-1)
