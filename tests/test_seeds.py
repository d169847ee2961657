"""The seeds' checks, through every backend (the same checks run under ctest and cargo test)."""

from __future__ import annotations

import numpy as np
import pytest

import twinattn
from helpers import assert_close_to_reference, rand

# The seeds' 3-token example: one head, two query/key coordinates, two value coordinates.
SEED_QUERIES = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
SEED_VALUES = np.array([[2, 0], [0, 3], [-1, 1]], dtype=np.float32)


def test_first_causal_row_has_one_legal_key(backend: str) -> None:
    out = twinattn.attention(SEED_QUERIES, SEED_QUERIES, SEED_VALUES, causal=True, q_offset=0, backend=backend)
    np.testing.assert_array_equal(out[0], SEED_VALUES[0])  # exactly v[0]


def test_cached_row_equals_full_run(backend: str) -> None:
    full = twinattn.attention(SEED_QUERIES, SEED_QUERIES, SEED_VALUES, causal=True, q_offset=0, backend=backend)
    cached = twinattn.attention(SEED_QUERIES[2:], SEED_QUERIES, SEED_VALUES, causal=True, q_offset=2, backend=backend)
    np.testing.assert_allclose(cached[0], full[2], rtol=0, atol=1e-6)
    # The default alignment is bottom-right: the one query is the last position.
    default = twinattn.attention(SEED_QUERIES[2:], SEED_QUERIES, SEED_VALUES, causal=True, backend=backend)
    np.testing.assert_array_equal(default, cached)


def test_future_value_does_not_leak_backwards(backend: str) -> None:
    full = twinattn.attention(SEED_QUERIES, SEED_QUERIES, SEED_VALUES, causal=True, q_offset=0, backend=backend)
    changed_values = SEED_VALUES.copy()
    changed_values[-1] = [100, 100]
    changed = twinattn.attention(SEED_QUERIES, SEED_QUERIES, changed_values, causal=True, q_offset=0, backend=backend)
    np.testing.assert_array_equal(full[:2], changed[:2])  # bit-identical
    assert not np.array_equal(full[2], changed[2])


def test_worked_example(backend: str) -> None:
    q = np.array([[1, 0]], dtype=np.float32)
    keys = np.array([[1, 0], [0, 1]], dtype=np.float32)
    values = np.array([[2, 0], [0, 4]], dtype=np.float32)
    out, lse = twinattn.attention(q, keys, values, return_lse=True, backend=backend)
    np.testing.assert_allclose(out[0], [1.3395, 1.3210], atol=5e-5)
    np.testing.assert_allclose(lse[0], np.log(np.exp(1 / np.sqrt(2)) + 1), rtol=1e-6)
    # At the first position of a causal sequence the second key is hidden: weights [1, 0].
    hidden = twinattn.attention(q, keys, values, causal=True, q_offset=0, backend=backend)
    np.testing.assert_array_equal(hidden[0], [2, 0])


def test_equal_scores_average_the_values(backend: str) -> None:
    q = np.array([[0, 0]], dtype=np.float32)
    keys = np.array([[1, 0], [0, 1]], dtype=np.float32)
    values = np.array([[2, 0], [0, 4]], dtype=np.float32)
    np.testing.assert_allclose(twinattn.attention(q, keys, values, backend=backend)[0], [1, 2], atol=1e-6)
    np.testing.assert_allclose(twinattn.attention(q, keys, 2 * values, backend=backend)[0], [2, 4], atol=1e-6)


@pytest.mark.parametrize("prompt_len", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_causal_equals_full(backend: str, prompt_len: int, chunk: int) -> None:
    rng = np.random.default_rng(prompt_len * 100 + chunk)
    total = prompt_len + 2 * chunk
    q, k, v = rand(rng, 1, 4, total, 16), rand(rng, 1, 2, total, 16), rand(rng, 1, 2, total, 8)
    full = twinattn.attention(q, k, v, causal=True, backend=backend)
    assert_close_to_reference(full, q, k, v, causal=True)
    start = prompt_len
    while start < total:
        stop = min(start + chunk, total)
        # The cache holds keys [0, stop); the chunk's queries are the last stop - start positions.
        part = twinattn.attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], causal=True, backend=backend)
        np.testing.assert_allclose(part, full[:, :, start:stop], rtol=1e-5, atol=1e-5)
        # The same with an explicit offset over a larger cache whose tail is padding.
        padded = twinattn.attention(
            q[:, :, start:stop], k, v, causal=True, q_offset=start, kv_lens=[stop], backend=backend
        )
        np.testing.assert_allclose(padded, full[:, :, start:stop], rtol=1e-5, atol=1e-5)
        start = stop
