"""int8 keys and values: one float32 scale per (sequence, KV head, token) for each of K and V.

quantize_kv(x) -> (x_int8, scale) is symmetric, computed in float32 on the exact values of x:
    amax = max |x| over the last axis;  scale = amax / 127  (float32 division);
    x_int8 = clip(rint(x / scale), -127, 127)  (float32 division, round half to even).
A zero row (amax == 0) gives scale 0 and zeros. NaN and inf cannot be stored in int8: a row
holding one gets the scale the arithmetic gives (NaN or inf) and 0 where x / scale is NaN, so the
row attends as NaN through its scale. dequantize_kv(x_int8, scale) = float32(x_int8) * scale.
twinattn.attention(q, k_int8, v_int8, k_scale=..., v_scale=...) equals attention over
dequantize_kv(k_int8, k_scale), dequantize_kv(v_int8, v_scale) within float32 tolerance.
"""

from __future__ import annotations

import numpy as np

from ._checks import ATTENTION_DTYPES, ATTENTION_DTYPES_TEXT, FLOAT32, INT8, shape_str

__all__ = ["dequantize_kv", "quantize_kv"]

_INT8_MAX = 127


def quantize_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., T, D) float32, float16 or bfloat16 -> (x_int8 (..., T, D) int8, scale (..., T) float32).

    Raises TypeError for a non-array or another dtype, ValueError for fewer than 1 dimension.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x: expected a numpy array (..., T, D) of {ATTENTION_DTYPES_TEXT}, got {type(x).__name__}")
    if x.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"x: expected dtype {ATTENTION_DTYPES_TEXT}, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"x: expected at least 1 dimension (..., D), got shape {shape_str(x.shape)}")
    x32 = x.astype(FLOAT32, copy=False)  # exact for float16 / bfloat16
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(x32), axis=-1, initial=FLOAT32.type(0))
        scale = (amax / FLOAT32.type(_INT8_MAX)).astype(FLOAT32, copy=False)
        # a zero row divides 0 / 0: NaN, stored as 0 below
        ratio = x32 / scale[..., None]
        rounded = np.clip(np.rint(ratio), -_INT8_MAX, _INT8_MAX)
        payload = np.where(np.isnan(rounded), 0, rounded).astype(INT8)
    return payload, scale


def dequantize_kv(x_int8: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32(x_int8) * scale[..., None]: x_int8 (..., T, D) int8, scale (..., T) float32."""
    if not isinstance(x_int8, np.ndarray) or x_int8.dtype != INT8:
        got = x_int8.dtype if isinstance(x_int8, np.ndarray) else type(x_int8).__name__
        raise TypeError(f"x_int8: expected an int8 numpy array (..., T, D), got {got}")
    if not isinstance(scale, np.ndarray) or scale.dtype != FLOAT32:
        got = scale.dtype if isinstance(scale, np.ndarray) else type(scale).__name__
        raise TypeError(f"scale: expected a float32 numpy array (..., T), got {got}")
    if x_int8.ndim < 1 or scale.shape != x_int8.shape[:-1]:
        raise ValueError(
            f"scale: expected shape {shape_str(x_int8.shape[:-1])} (x_int8's without its last axis), got {shape_str(scale.shape)}"
        )
    with np.errstate(invalid="ignore", over="ignore"):
        result: np.ndarray = x_int8.astype(FLOAT32) * scale[..., None]
    return result
