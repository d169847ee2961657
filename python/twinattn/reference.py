"""twinattn.reference: the NumPy reference, the definition of correct.

    out = twinattn.reference.attention(q, k, v, causal=True)    # twinattn.attention, backend="numpy"

attention takes twinattn.attention's arguments (float64 as well) and computes them with
attention_reference, the algorithm on checked arrays, whose module (twinattn.core.reference) states
the rule every backend follows, non-finite inputs included; round_to_dtype is the one rounding of a
float64 result to float32, float16 or bfloat16.
"""

from __future__ import annotations

from typing import Any

from .core.api import attention as _attention
from .core.reference import attention_reference, round_to_dtype

__all__ = ["attention", "attention_reference", "round_to_dtype"]


def attention(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """twinattn.attention computed by the NumPy reference (float32, float16, bfloat16 and float64;
    float16 and bfloat16 are computed in float64 and rounded once to q's dtype)."""
    kwargs.pop("backend", None)
    return _attention(q, k, v, backend="numpy", **kwargs)
