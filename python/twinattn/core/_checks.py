"""Small validators shared by every module of the package, so each message is written once."""

from __future__ import annotations

import math
import numbers
from typing import Iterable

import ml_dtypes
import numpy as np

# The dtypes of attention's q, k, v and out, and of KVCache's storage. float16 and bfloat16 are
# storage formats: the kernels convert them exactly to float32 and compute in float32.
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT64 = np.dtype(np.float64)
INT8 = np.dtype(np.int8)  # keys and values only, with float32 scales (twinattn.quantize_kv)
HALF_DTYPES = (FLOAT16, BFLOAT16)
ATTENTION_DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
ATTENTION_DTYPES_TEXT = "float32, float16 or bfloat16 (ml_dtypes.bfloat16)"


def dtype_in_code(dtype: np.dtype) -> str:
    """How a dtype is written in a fix a message suggests: np.float32, ml_dtypes.bfloat16."""
    return "ml_dtypes.bfloat16" if dtype == BFLOAT16 else f"np.{dtype.name}"


def storage_dtype(name: str, value: object, *, float64_too: bool) -> np.dtype:
    """A dtype argument that must be float32, float16 or bfloat16 (float64 too when float64_too).
    Accepts anything np.dtype does (np.float16, "bfloat16", ml_dtypes.bfloat16, np.dtype(...))."""
    accepted = ATTENTION_DTYPES + ((FLOAT64,) if float64_too else ())
    text = ATTENTION_DTYPES_TEXT + (", or float64 (backend='numpy' only)" if float64_too else "")
    try:
        dtype: np.dtype = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name}: expected {text}, got {value!r}") from None
    if dtype not in accepted:
        raise TypeError(f"{name}: expected {text}, got {dtype}")
    return dtype


def shape_str(shape: Iterable[int]) -> str:
    """A shape in Python's tuple notation: "(2, 3)", "(2,)"."""
    return str(tuple(int(n) for n in shape))


def count(name: str, value: object, *, positive: bool = True) -> int:
    """An int (a Python or NumPy integer, not a bool) that is >= 1, or >= 0 when not positive."""
    if type(value) is int and value >= positive:  # the common case, without the ABC check below
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    result = int(value)
    if result < (1 if positive else 0):
        raise ValueError(f"{name}: expected {'a positive' if positive else 'a non-negative'} int, got {result}")
    return result


def elements_overlap(a: np.ndarray) -> bool:
    """Whether two distinct indices of `a` may address the same bytes (an as_strided view, say).

    Sufficient test, the same as the native cores': sorted by |stride|, each axis of length > 1
    must step past everything the smaller axes reach. Exotic interleaved layouts that do not
    overlap are reported too; an output never needs one.
    """
    if a.size == 0 or a.flags.c_contiguous:  # the common case, decided by NumPy's flag
        return False
    reach = a.itemsize - 1  # the last byte the smaller axes reach
    for step, length in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if step <= reach:
            return True
        reach += (length - 1) * step
    return False


def window_size(value: object) -> tuple[int, int]:
    """window_size=(left, right): a pair of ints each >= -1 (-1 = unbounded on that side)."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        left, right = value  # the common case, without the ABC checks below
    else:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"window_size: expected a pair (left, right) of ints, got {value!r}")
        for side in value:
            if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
                raise TypeError(f"window_size: expected a pair (left, right) of ints, got {type(side).__name__} in {value!r}")
        left, right = int(value[0]), int(value[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected each side >= -1 (-1 = unbounded), got ({left}, {right})")
    return left, right


def softcap(value: object) -> float:
    """softcap: a finite real number >= 0 (0 = off)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softcap: expected a float, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {result}")
    return result


def per_head_floats(name: str, value: object, shapes: tuple[tuple[int, ...], ...], shape_text: str, dtype: np.dtype) -> np.ndarray:
    """alibi_slopes / sinks: a float32 array (float64 too when the problem is float64) of one of
    `shapes`, every value finite. Nothing is cast silently."""
    if not isinstance(value, np.ndarray):
        if not hasattr(value, "__array__"):
            raise TypeError(f"{name}: expected a float32 numpy array of shape {shape_text}, got {type(value).__name__}")
        value = np.asarray(value)
    if value.dtype != np.float32 and not (dtype == np.float64 and value.dtype == np.float64):
        raise TypeError(
            f"{name}: expected float32 of shape {shape_text}, got {value.dtype}; convert with {name}.astype(np.float32)"
        )
    if value.shape not in shapes:
        raise ValueError(f"{name}: expected shape {shape_text}, got {shape_str(value.shape)}")
    finite = np.isfinite(value)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{name}: expected finite values, got {name}[{', '.join(map(str, where))}]={value[where]}")
    return value
