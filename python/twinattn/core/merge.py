"""merge_attention: attention over a union of disjoint key sets, from the attention over each set.

Attention over keys K = K_1 u ... u K_P (disjoint) is a weighted mean of the attention over each
part, weighted by each part's share of the softmax denominator. With lse_p the natural log of part
p's denominator (twinattn.attention(..., return_lse=True) returns it):

    lse = log(sum_p exp(lse_p))                  the union's denominator
    out = sum_p exp(lse_p - lse) * out_p         each part's rows, reweighted

computed around the row max of the lse_p, so nothing overflows. This is how the native kernels
merge the key-axis splits of a decode, and how twinattn.distributed merges the K/V shards of a
ring. Parts may be empty (a part with no key visible to a row has lse -inf there and weight 0).

NumPy arrays or torch CPU tensors; the arithmetic is NumPy's, in float32 (float64 when the inputs
are float64), so float16 and bfloat16 partial outputs are merged in float32 and rounded once at
the end. This module does not import torch: a torch tensor can only reach it once torch is loaded.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from ._checks import per_head_floats, shape_str

__all__ = ["merge_attention"]

_WIDE = (np.dtype(np.float32), np.dtype(np.float64))


def _is_tensor(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_narrow_float(dtype: np.dtype) -> bool:
    """float16, or ml_dtypes' bfloat16 (recognised by name: it is not imported here)."""
    return dtype == np.float16 or dtype.name == "bfloat16"


def _tensor_as_array(name: str, t: Any) -> np.ndarray:
    """A NumPy array with t's values: a view for float32/float64, a float32 copy for float16/bfloat16."""
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device} (move it with .cpu())")
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: requires grad, but merge_attention computes the forward pass only (no backward); "
            "call it under torch.no_grad() or torch.inference_mode(), or pass a detached tensor"
        )
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.detach().float().numpy()  # type: ignore[no-any-return]
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: expected float32, float64, float16 or bfloat16, got {t.dtype}")
    return t.detach().numpy()  # type: ignore[no-any-return]


def merge_parts(outs: Sequence[np.ndarray], lses: Sequence[np.ndarray], sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The merge on checked NumPy arrays of one float dtype, float32 or float64 (the caller's job):
    outs P arrays (..., Lq, Dv), lses P arrays (..., Lq), sinks None or one logit per row of the
    head axis, already shaped to broadcast against an lse (..., Lq).
    -> out (..., Lq, Dv), lse (..., Lq), in that dtype.

    A row whose parts all have lse -inf (and no sink) gives zeros and -inf. A part's weight is
    exp(lse_p - row_max); where it is 0, that part's out row is not read (whatever it holds). A
    NaN lse makes the row NaN; a +inf lse makes out NaN and lse +inf, as attention itself does."""
    dtype = outs[0].dtype
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # 1. The row max over the parts (and the sink), NaN-propagating.
        row_max = lses[0].copy()
        for lse in lses[1:]:
            np.maximum(row_max, lse, out=row_max)
        if sinks is not None:
            np.maximum(row_max, sinks, out=row_max)
        empty_row = row_max == -np.inf
        safe_max = np.where(empty_row, 0, row_max).astype(dtype, copy=False)

        # 2. Each part's share of the denominator, relative to the max, and its reweighted rows.
        row_sum = np.zeros_like(safe_max)
        out = np.zeros(outs[0].shape, dtype=dtype)
        for part_out, lse in zip(outs, lses):
            weight = np.exp(lse - safe_max)
            row_sum += weight
            weight = weight[..., None]
            # weight 0 (an empty part, or an underflow): the row is left out, not multiplied by 0
            out += np.where(weight == 0, 0, weight * part_out)
        if sinks is not None:
            row_sum += np.exp(sinks - safe_max)

        # 3. Normalise; the union's lse is the max plus the log of the summed shares.
        denominator = np.where(empty_row, 1, row_sum).astype(dtype, copy=False)
        out /= denominator[..., None]
        lse_out = np.where(empty_row, -np.inf, safe_max + np.log(denominator)).astype(dtype, copy=False)
        lse_out[row_max == np.inf] = np.inf  # the log of an infinite sum, not inf + log(NaN)
    return out, lse_out


def merge_attention(outs: Sequence[Any], lses: Sequence[Any], *, sinks: Any = None) -> tuple[Any, Any]:
    """Exact attention over the union of disjoint key sets, from the attention over each set.

    Each (outs[p], lses[p]) is what twinattn.attention(q, k_p, v_p, return_lse=True) returns for
    the same queries q and one part k_p, v_p of the keys (parts disjoint: a key in two parts counts
    twice). The result equals twinattn.attention over all the parts' keys, within rounding.

    Parameters
    ----------
    outs : sequence of P >= 1 arrays, each (..., Lq, Dv)
        The parts' outputs, one shape and one dtype: float32, float64, float16 or bfloat16.
        NumPy arrays or torch CPU tensors (all of one kind, lses too).
    lses : sequence of P arrays, each (..., Lq)
        The parts' lse: float32 (float64 when outs are float64). -inf where a part has no key
        visible to a row (that part's row is then not read).
    sinks : None or float32 array of shape (Hq,), default None
        Attention sinks, added once here: the parts are computed without sinks, and the merge adds
        each head's virtual key exp(sinks[h]) to the union's denominator, as
        twinattn.attention(..., sinks=sinks) over the union does. (Computing exactly one part with
        sinks= and merging without them gives the same result.) Hq is the head axis of outs,
        (..., Hq, Lq, Dv); 1 for 2-D outs (Lq, Dv). A torch tensor when the parts are tensors.

    Returns
    -------
    out : array (..., Lq, Dv), outs' dtype and kind
        Merged in float32 (float64 for float64 inputs) and rounded once to float16/bfloat16.
        A row where every part saw nothing (and no sink) is zeros.
    lse : array (..., Lq), float32 (float64 for float64 inputs)
        The union's lse: -inf for a row where every part saw nothing, sinks[h] for such a row with
        sinks. Merging again with further parts is exact too.

    Raises
    ------
    TypeError
        outs or lses not sequences of arrays; NumPy arrays and tensors mixed; dtypes other than
        those above, or different dtypes among the parts; sinks not float32.
    ValueError
        No parts; len(outs) != len(lses); parts of different shapes; an lse not of shape
        outs[p].shape[:-1]; sinks of the wrong shape or not finite; a tensor not on the CPU.
    """
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(
            f"outs, lses: expected sequences (lists or tuples) of arrays, got {type(outs).__name__} and {type(lses).__name__}"
        )
    if len(outs) == 0:
        raise ValueError("outs: expected at least one part, got an empty sequence")
    if len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected one lse per part, got {len(outs)} outs and {len(lses)} lses")
    tensors = _is_tensor(outs[0])
    kind = "torch tensors" if tensors else "numpy arrays"
    for name, parts in (("outs", outs), ("lses", lses)):
        for p, part in enumerate(parts):
            if _is_tensor(part) != tensors or not (tensors or isinstance(part, np.ndarray)):
                raise TypeError(f"{name}[{p}]: expected {kind} like outs[0], got {type(part).__name__}")
    if tensors:
        torch = sys.modules["torch"]
        out_dtype = outs[0].dtype
        for p, part in enumerate(outs):
            if part.dtype != out_dtype:
                raise TypeError(f"outs[{p}]: expected {out_dtype} like outs[0], got {part.dtype}")
        out_arrays = [_tensor_as_array(f"outs[{p}]", part) for p, part in enumerate(outs)]
        lse_arrays = [_tensor_as_array(f"lses[{p}]", part) for p, part in enumerate(lses)]
        if sinks is not None:
            if not _is_tensor(sinks):
                raise TypeError(f"sinks: expected a torch tensor like the parts, got {type(sinks).__name__}")
            sinks = _tensor_as_array("sinks", sinks)
        out, lse = _merge_arrays(out_arrays, lse_arrays, sinks, narrow=out_dtype in (torch.float16, torch.bfloat16))
        return torch.from_numpy(out).to(out_dtype), torch.from_numpy(lse)
    out, lse = _merge_arrays(list(outs), list(lses), sinks, narrow=False)
    return out, lse


def _merge_arrays(outs: list[np.ndarray], lses: list[np.ndarray], sinks: Any, *, narrow: bool) -> tuple[np.ndarray, np.ndarray]:
    """Checks NumPy parts, merges them in float32/float64, returns out in outs' dtype. narrow: the
    parts were float16/bfloat16 tensors already widened to float32 (their lse must be float32)."""
    out_dtype = outs[0].dtype
    shape = outs[0].shape
    if len(shape) < 2:
        raise ValueError(f"outs[0]: expected at least 2 dimensions (..., Lq, Dv), got shape {shape_str(shape)}")
    for p, part in enumerate(outs):
        if part.dtype != out_dtype:
            raise TypeError(f"outs[{p}]: expected {out_dtype} like outs[0], got {part.dtype}")
        if part.shape != shape:
            raise ValueError(f"outs[{p}]: expected shape {shape_str(shape)} like outs[0], got {shape_str(part.shape)}")
    if out_dtype not in _WIDE and not _is_narrow_float(out_dtype):
        raise TypeError(f"outs: expected float32, float64, float16 or bfloat16, got {out_dtype}")
    wide = np.dtype(np.float64) if out_dtype == np.float64 else np.dtype(np.float32)
    narrow = narrow or _is_narrow_float(out_dtype)
    for p, lse in enumerate(lses):
        if lse.dtype != wide:
            raise TypeError(
                f"lses[{p}]: expected {wide.name} (the lse of {'float16/bfloat16' if narrow else out_dtype.name} "
                f"attention is {wide.name}), got {lse.dtype}"
            )
        if lse.shape != shape[:-1]:
            raise ValueError(f"lses[{p}]: expected shape {shape_str(shape[:-1])} (outs' shape without Dv), got {shape_str(lse.shape)}")
    sink_rows = None
    if sinks is not None:
        heads = shape[-3] if len(shape) >= 3 else 1
        sink_rows = per_head_floats("sinks", sinks, ((heads,),), f"(Hq={heads},)", wide).astype(wide, copy=False)
        # broadcasts against an lse (..., Hq, Lq), or (Lq,) for 2-D parts
        sink_rows = sink_rows.reshape(heads, 1) if len(shape) >= 3 else sink_rows
    parts = outs if out_dtype in _WIDE else [part.astype(np.float32) for part in outs]
    out, lse = merge_parts(parts, lses, sink_rows)
    return out.astype(out_dtype, copy=False), lse
