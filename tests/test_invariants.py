"""Invariants that hold whatever the numbers: permutation, padding, all-masked rows, threads."""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

import twinattn
from helpers import assert_close_to_reference, rand


def test_permuting_keys_and_values_together_changes_nothing(backend: str) -> None:
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 2, 4, 6, 16), rand(rng, 2, 2, 23, 16), rand(rng, 2, 2, 23, 8)
    perm = rng.permutation(23)
    out = twinattn.attention(q, k, v, backend=backend)
    permuted = twinattn.attention(q, k[:, :, perm], v[:, :, perm], backend=backend)
    np.testing.assert_allclose(permuted, out, rtol=1e-5, atol=1e-6)
    # Permuting only the keys does change the output (the test can fail).
    assert not np.allclose(twinattn.attention(q, k[:, :, perm], v, backend=backend), out, atol=1e-3)


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e30])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_key_slots_are_never_read(backend: str, garbage: float, causal: bool) -> None:
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 3, 4, 5, 16), rand(rng, 3, 2, 30, 16), rand(rng, 3, 2, 30, 8)
    kv_lens = np.array([30, 12, 5])
    clean = twinattn.attention(q, k, v, kv_lens=kv_lens, causal=causal, backend=backend)
    for b, n in enumerate(kv_lens):
        k[b, :, n:] = garbage
        v[b, :, n:] = garbage
    dirty = twinattn.attention(q, k, v, kv_lens=kv_lens, causal=causal, backend=backend)
    np.testing.assert_array_equal(dirty, clean)
    assert np.all(np.isfinite(dirty))


def test_causally_hidden_values_never_enter(backend: str) -> None:
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, 1, 2, 4, 8), rand(rng, 1, 1, 10, 8), rand(rng, 1, 1, 10, 8)
    clean = twinattn.attention(q, k, v, causal=True, q_offset=3, backend=backend)
    v[:, :, 7:] = np.nan  # positions after the last query (3 + 3 = 6) are in every row's future
    k[:, :, 7:] = np.nan
    dirty = twinattn.attention(q, k, v, causal=True, q_offset=3, backend=backend)
    assert np.all(np.isfinite(dirty))
    np.testing.assert_allclose(dirty, clean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["bool", "float-inf", "kv_lens", "causal"])
def test_all_masked_rows_give_zeros_and_minus_inf(backend: str, how: str) -> None:
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 2, 2, 4, 8), rand(rng, 2, 2, 6, 8), rand(rng, 2, 2, 6, 8)
    kwargs: dict = {}
    if how == "bool":
        mask = np.ones((2, 2, 4, 6), dtype=bool)
        mask[1, 0, 2] = False
        kwargs["attn_mask"] = mask
    elif how == "float-inf":
        mask = np.zeros((2, 2, 4, 6), dtype=np.float32)
        mask[1, 0, 2] = -np.inf
        kwargs["attn_mask"] = mask
    elif how == "kv_lens":
        kwargs["kv_lens"] = [6, 0]
    else:  # a causal row before its sequence's first key can't happen with q_offset >= 0: use a mask on key 0
        mask = np.ones((6,), dtype=bool)
        mask[0] = False
        kwargs.update(causal=True, q_offset=0, attn_mask=mask)
    with np.errstate(all="raise"):
        out, lse = twinattn.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    empty = np.isneginf(lse)
    assert empty.any()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[empty], 0.0)
    assert_close_to_reference(out, q, k, v, **kwargs)


def test_thread_counts_agree(native_backend: str) -> None:
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 2, 8, 33, 64), rand(rng, 2, 2, 77, 64), rand(rng, 2, 2, 77, 64)
    one = twinattn.attention(q, k, v, causal=True, backend=native_backend, num_threads=1)
    for threads in (2, 3, 7):
        many = twinattn.attention(q, k, v, causal=True, backend=native_backend, num_threads=threads)
        np.testing.assert_allclose(many, one, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("side", [-1, 1], ids=["below", "above"])
def test_calls_beside_the_serial_bound_agree_across_thread_counts(native_backend: str, side: int) -> None:
    # below build_info's serial_work (B * Hq * Lq * Lk * (D + Dv) multiply-adds) a call runs on the
    # calling thread whatever num_threads says; above it, on the pool: the same bits either way
    bound = importlib.import_module(f"twinattn._{native_backend}").build_info()["constants"]["serial_work"]
    keys = bound // (9 * 128) + side  # one-token decode, 9 query / 3 KV heads, D 64
    assert (9 * keys * 128 < bound) == (side < 0)
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, 1, 9, 1, 64), rand(rng, 1, 3, keys, 64), rand(rng, 1, 3, keys, 64)
    one = twinattn.attention(q, k, v, causal=True, q_offset=keys - 1, backend=native_backend, num_threads=1)
    for threads in (2, 3):
        many = twinattn.attention(q, k, v, causal=True, q_offset=keys - 1, backend=native_backend, num_threads=threads)
        np.testing.assert_array_equal(many, one)
    assert_close_to_reference(one, q, k, v, causal=True, q_offset=keys - 1)


def test_the_python_thread_policy_states_the_cores_serial_bound(native_backend: str) -> None:
    from twinattn.core._threads import SERIAL_WORK, SERIAL_WORK_BESIDE_SPINNING_THREADS, threads_for

    assert importlib.import_module(f"twinattn._{native_backend}").build_info()["constants"]["serial_work"] == SERIAL_WORK
    # the cores decide below their bound; a caller beside spinning threads runs small calls on one
    assert threads_for(SERIAL_WORK - 1) is None and threads_for(10**12) is None
    assert threads_for(SERIAL_WORK_BESIDE_SPINNING_THREADS - 1, beside_spinning_threads=True) == 1
    assert threads_for(SERIAL_WORK_BESIDE_SPINNING_THREADS, beside_spinning_threads=True) is None


def test_concurrent_calls_from_python_threads(native_backend: str) -> None:
    rng = np.random.default_rng(5)
    problems = [(rand(rng, 1, 4, 20 + i, 32), rand(rng, 1, 2, 50 + i, 32), rand(rng, 1, 2, 50 + i, 16)) for i in range(6)]
    expected = [twinattn.attention(*p, causal=True, backend=native_backend) for p in problems]
    failures: list[str] = []

    def worker(index: int) -> None:
        for _ in range(10):
            got = twinattn.attention(*problems[index], causal=True, backend=native_backend, num_threads=2)
            if not np.array_equal(got, expected[index]):
                failures.append(f"problem {index} differs")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
