"""scaled_dot_product_attention against the reference implementation printed in torch's
documentation (bias of -inf above the tril diagonal, masked_fill for bool masks, added float
masks, repeat_interleave for GQA), written in NumPy float64."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import twinattn
from helpers import FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF, rand


def torch_doc_reference(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, diagonal=0, dtype: Any = np.float64):
    """torch's documented SDPA; `diagonal` shifts the causal tril (0: torch's upper-left)."""
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    length, keys = q.shape[-2], k.shape[-2]
    scale_factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = np.zeros((length, keys), dtype=dtype)
    if is_causal:
        bias = np.where(np.tril(np.ones((length, keys), dtype=bool), k=diagonal), bias, -np.inf)
    if attn_mask is not None:
        bias = np.where(attn_mask, bias, -np.inf) if attn_mask.dtype == np.bool_ else attn_mask.astype(dtype) + bias
    if enable_gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    weights = (q @ np.swapaxes(k, -2, -1)) * dtype(scale_factor) + bias
    weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights @ v


def check(got: np.ndarray, *args: Any, **kwargs: Any) -> None:
    want = torch_doc_reference(*args, **kwargs)
    f32 = torch_doc_reference(*args, dtype=np.float32, **kwargs)
    tol = FLOAT32_ERROR_FACTOR * float(np.abs(f32 - want).max()) + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape and got.dtype == np.float32
    err = float(np.abs(got - want).max())
    assert err <= tol, f"max abs error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_square_inputs_behave_as_torch(backend: str, is_causal: bool) -> None:
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 2, 3, 9, 8), rand(rng, 2, 3, 9, 8), rand(rng, 2, 3, 9, 5)
    out = twinattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend=backend)
    check(out, q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_and_scale(backend: str, kind: str) -> None:
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 2, 2, 4, 8), rand(rng, 2, 2, 6, 8), rand(rng, 2, 2, 6, 8)
    if kind == "bool":
        mask = rng.random((2, 1, 4, 6)) < 0.7
        mask[..., 0] = True  # every row keeps a key (torch's reference would give NaN otherwise)
    else:
        mask = rand(rng, 4, 6)
    out = twinattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, backend=backend)
    check(out, q, k, v, attn_mask=mask, scale=0.3)


@pytest.mark.parametrize("alignment, diagonal", [("upper_left", 0), ("lower_right", 5 - 3)])
def test_non_square_causal_alignments(backend: str, alignment: str, diagonal: int) -> None:
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 5, 8)
    out = twinattn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment=alignment, backend=backend)
    check(out, q, k, v, is_causal=True, diagonal=diagonal)


def test_non_square_causal_without_alignment_raises() -> None:
    q, k = np.zeros((1, 1, 2, 4), np.float32), np.zeros((1, 1, 5, 4), np.float32)
    with pytest.raises(ValueError, match=r"L=2 differs from key length S=5.*causal_alignment='upper_left'.*'lower_right'"):
        twinattn.scaled_dot_product_attention(q, k, k, is_causal=True)
    with pytest.raises(ValueError, match=r"'lower_right' with L=5 > S=2"):
        twinattn.scaled_dot_product_attention(k, q, q, is_causal=True, causal_alignment="lower_right")
    with pytest.raises(ValueError, match=r"causal_alignment: expected one of .*got 'top'"):
        twinattn.scaled_dot_product_attention(q, k, k, is_causal=True, causal_alignment="top")


def test_gqa(backend: str) -> None:
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 2, 6, 4, 8), rand(rng, 2, 2, 4, 8), rand(rng, 2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"key, value: expected 6 heads like query.*got 2 and 2; pass enable_gqa=True"):
        twinattn.scaled_dot_product_attention(q, k, v, backend=backend)
    out = twinattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    check(out, q, k, v, is_causal=True, enable_gqa=True)


def test_higher_rank_inputs(backend: str) -> None:
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 2, 3, 2, 4, 8), rand(rng, 2, 3, 2, 4, 8), rand(rng, 2, 3, 2, 4, 8)
    out = twinattn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    check(out, q, k, v, is_causal=True)


def test_dropout_and_mask_with_causal_raise() -> None:
    q = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(NotImplementedError, match=r"dropout_p: .*expected 0.0, got 0.1"):
        twinattn.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"attn_mask: expected None when is_causal=True"):
        twinattn.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((2, 2), bool), is_causal=True)
    twinattn.scaled_dot_product_attention(q, q, q, dropout_p=0.0)  # zero is fine
