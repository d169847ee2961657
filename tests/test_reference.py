"""The NumPy reference against the seeds' algorithm written out row by row in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest

import twinattn


def seed_attention(q, k, v, *, causal, q_offset, kv_lens, mask, bias, scale):
    """The seeds' kernel, one (b, h, row) at a time: legal keys first, max, exp, normalise."""
    batch, q_heads, q_len, _ = q.shape
    group = q_heads // k.shape[1]
    out = np.zeros(q.shape[:3] + v.shape[3:])
    lse = np.full(q.shape[:3], -math.inf)
    for b in range(batch):
        for h in range(q_heads):
            for i in range(q_len):
                legal = [
                    j for j in range(kv_lens[b])
                    if (not causal or j <= q_offset[b] + i) and (mask is None or mask[b, h, i, j])
                ]
                scores = [scale * float(q[b, h, i] @ k[b, h // group, j]) + (0 if bias is None else bias[b, h, i, j]) for j in legal]
                legal = [j for j, s in zip(legal, scores) if s != -math.inf]
                scores = [s for s in scores if s != -math.inf]
                if not legal:
                    continue
                maximum = max(scores)
                weights = [math.exp(s - maximum) for s in scores]
                denominator = sum(weights)
                for j, w in zip(legal, weights):
                    out[b, h, i] += w / denominator * v[b, h // group, j]
                lse[b, h, i] = maximum + math.log(denominator)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_reference_matches_seed_algorithm(causal: bool, mask_kind: str) -> None:
    rng = np.random.default_rng(42)
    q = rng.standard_normal((2, 4, 5, 3))
    k = rng.standard_normal((2, 2, 9, 3))
    v = rng.standard_normal((2, 2, 9, 2))
    q_offset, kv_lens = np.array([4, 0]), np.array([9, 4])
    mask = bias = None
    if mask_kind == "bool":
        mask = rng.random((2, 4, 5, 9)) < 0.6
    elif mask_kind == "float":
        bias = rng.standard_normal((2, 4, 5, 9))
        bias[rng.random((2, 4, 5, 9)) < 0.3] = -np.inf
    want_out, want_lse = seed_attention(q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens, mask=mask, bias=bias, scale=0.7)
    out, lse = twinattn.attention(
        q, k, v, causal=causal, q_offset=q_offset, kv_lens=kv_lens,
        attn_mask=mask if mask is not None else bias, scale=0.7, return_lse=True, backend="numpy",
    )
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)
