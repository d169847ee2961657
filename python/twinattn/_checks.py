"""Small validators shared by every module of the package, so each message is written once."""

from __future__ import annotations

import numbers
from typing import Iterable

import numpy as np


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
