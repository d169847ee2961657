"""twinattn.attention_varlen on every backend: each sequence of a packed batch against the dense
API on that sequence alone (tests/packed_helpers.py), for every dtype, int8, the variants,
strides, lse and out; its bad inputs raise messages naming the argument, the same on every
backend."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from packed_helpers import assert_bad_call, assert_matches_dense, random_packed

# (q_lens, k_lens): asymmetric, empty sequences, decode rows, a prefill chunk over a longer context
LENGTHS = {
    "mixed": ([3, 0, 5, 1], [7, 4, 5, 9]),
    "decode": ([1, 1, 1], [6, 1, 11]),
    "one": ([6], [13]),
    "no-keys": ([0, 2], [0, 3]),
}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_size": (2, 0)},
    "window-bidirectional": {"window_size": (2, 1)},
    "softcap": {"causal": True, "softcap": 1.5, "scale": 0.9},
    "alibi": {"causal": True, "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)},
    "sinks": {"causal": True, "sinks": np.array([0.3, -1.0, 2.0, 0.0], np.float32)},
}


def _call(packed: Any, backend: str, **kwargs: Any) -> Any:
    k, v, cu_k, scales = packed.packed_kv()
    return twinattn.attention_varlen(packed.q, k, v, packed.cu_q, cu_k, backend=backend, **scales, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_matches_dense_per_sequence(backend: str, lengths: tuple[list[int], list[int]], dtype: Any) -> None:
    rng = np.random.default_rng(1)
    packed = random_packed(rng, *lengths, dtype=dtype)
    out, lse = _call(packed, backend, causal=True, return_lse=True)
    assert out.shape == (packed.q.shape[0], 4, 6)
    assert_matches_dense(out, lse, packed, causal=True)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_variants(backend: str, variant: dict[str, Any]) -> None:
    rng = np.random.default_rng(2)
    packed = random_packed(rng, [3, 1, 4], [5, 8, 4])
    out, lse = _call(packed, backend, return_lse=True, **variant)
    assert_matches_dense(out, lse, packed, **variant)


def test_alibi_per_sequence_and_int32_offsets(backend: str) -> None:
    rng = np.random.default_rng(3)
    packed = random_packed(rng, [2, 3], [4, 6], q_heads=2, kv_heads=1)
    slopes = np.array([[0.5, 0.1], [0.2, 0.9]], np.float32)
    k, v, cu_k, _ = packed.packed_kv()
    out = twinattn.attention_varlen(
        packed.q, k, v, packed.cu_q.astype(np.int32), cu_k.astype(np.int32), causal=True, alibi_slopes=slopes, backend=backend
    )
    assert_matches_dense(out, None, packed, causal=True, alibi_slopes=slopes)


def test_strided_inputs_and_out(backend: str) -> None:
    """q, k and v as slices of fused projections (read in place), out written in place."""
    rng = np.random.default_rng(4)
    packed = random_packed(rng, [2, 3], [3, 5])
    k, v, cu_k, _ = packed.packed_kv()
    fused_q = np.zeros((5, 4, 16), np.float32)
    fused_q[:, :, 3:11] = packed.q
    fused_kv = np.zeros((8, 2, 20), np.float32)
    fused_kv[:, :, :8], fused_kv[:, :, 10:16] = k, v
    out = np.full((5, 4, 6), np.nan, np.float32)
    result = twinattn.attention_varlen(
        fused_q[:, :, 3:11], fused_kv[:, :, :8], fused_kv[:, :, 10:16], packed.cu_q, cu_k, causal=True, out=out, backend=backend
    )
    assert result is out
    assert_matches_dense(out, None, packed, causal=True)


def test_keys_of_other_sequences_never_leak(backend: str) -> None:
    """NaN in one sequence's keys and values leaves every other sequence's rows finite."""
    rng = np.random.default_rng(5)
    packed = random_packed(rng, [2, 2, 2], [3, 3, 3])
    packed.keys[1][:] = np.nan
    packed.values[1][:] = np.nan
    out = _call(packed, backend, causal=True)
    assert np.isnan(out[2:4]).all()
    assert np.isfinite(out[:2]).all() and np.isfinite(out[4:]).all()


def test_empty_batch(backend: str) -> None:
    q = np.zeros((0, 2, 4), np.float32)
    k = v = np.zeros((0, 1, 4), np.float32)
    out, lse = twinattn.attention_varlen(q, k, v, np.array([0]), np.array([0]), return_lse=True, backend=backend)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)


def test_float64_numpy_only() -> None:
    rng = np.random.default_rng(6)
    packed = random_packed(rng, [2, 1], [3, 2])
    k, v, cu_k, _ = packed.packed_kv()
    q64, k64, v64 = packed.q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    out = twinattn.attention_varlen(q64, k64, v64, packed.cu_q, cu_k, causal=True, backend="numpy")
    assert out.dtype == np.float64
    with pytest.raises(TypeError, match="q: backend 'cpp' computes in float32"):
        twinattn.attention_varlen(q64, k64, v64, packed.cu_q, cu_k, backend="cpp")


def _bad_calls() -> list[tuple[str, dict[str, Any], type, str]]:
    q = np.zeros((5, 4, 8), np.float32)
    k = np.zeros((7, 2, 8), np.float32)
    v = np.zeros((7, 2, 6), np.float32)
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 7])
    base = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    return [
        ("q-rank", {**base, "q": q[None]}, ValueError, r"q: expected 3 dimensions \(total_q, Hq, D\), got shape \(1, 5, 4, 8\)"),
        ("k-dtype", {**base, "k": k.astype(np.float16)}, TypeError, "k: expected dtype float32 .q's dtype. or int8, got float16"),
        ("v-shape", {**base, "v": v[:6]}, ValueError, r"v: expected shape \(total_k=7, Hkv=2, Dv\), got \(6, 2, 6\)"),
        ("k-width", {**base, "k": k[..., :4]}, ValueError, r"k: expected the last axis D=8 \(q's\)"),
        ("gqa", {**base, "k": np.zeros((7, 3, 8), np.float32), "v": np.zeros((7, 3, 6), np.float32)}, ValueError,
         "Hq=4 must be a multiple of the key/value heads Hkv=3"),
        ("cu-dtype", {**base, "cu_seqlens_q": cu_q.astype(np.float32)}, TypeError,
         "cu_seqlens_q: expected dtype int64 or int32, got float32"),
        ("cu-start", {**base, "cu_seqlens_q": np.array([1, 2, 5])}, ValueError, r"cu_seqlens_q: expected cu_seqlens_q\[0\] == 0, got 1"),
        ("cu-decreasing", {**base, "cu_seqlens_k": np.array([0, 5, 3, 7]), "cu_seqlens_q": np.array([0, 2, 2, 5])}, ValueError,
         r"cu_seqlens_k: expected non-decreasing values, got cu_seqlens_k\[1\]=5 > cu_seqlens_k\[2\]=3"),
        ("cu-total", {**base, "cu_seqlens_k": np.array([0, 3, 6])}, ValueError,
         r"cu_seqlens_k: expected the last value cu_seqlens_k\[B\] == total_k=7, got 6"),
        ("cu-batch", {**base, "cu_seqlens_k": np.array([0, 7])}, ValueError, r"cu_seqlens_k: expected shape \(B \+ 1 = 3,\), got \(2,\)"),
        ("cu-2d", {**base, "cu_seqlens_q": cu_q[None]}, ValueError, r"cu_seqlens_q: expected shape \(B \+ 1,\), got \(1, 3\)"),
        ("int8-no-scale", {**base, "k": k.astype(np.int8), "v": v.astype(np.int8)}, ValueError,
         r"k_scale: required with int8 k and v \(float32, shape \(total_k, Hkv\)\), got None"),
        ("scale-shape", {**base, "k": k.astype(np.int8), "v": v.astype(np.int8), "k_scale": np.ones((7, 3), np.float32),
                         "v_scale": np.ones((7, 2), np.float32)}, ValueError, r"k_scale: expected shape \(total_k=7, Hkv=2\), got \(7, 3\)"),
        ("alibi-shape", {**base, "alibi_slopes": np.ones(3, np.float32)}, ValueError,
         r"alibi_slopes: expected shape \(Hq=4,\) or \(B=2, Hq=4\), got \(3,\)"),
        ("window", {**base, "window_size": (-2, 0)}, ValueError, "window_size: expected each side >= -1"),
        ("out-shape", {**base, "out": np.zeros((5, 4, 8), np.float32)}, ValueError, r"out: expected shape \(5, 4, 6\)"),
        ("out-overlap", {**base, "out": q[..., :6]}, ValueError, "out: must not overlap the memory of q"),
        ("causal-type", {**base, "causal": 1}, TypeError, "causal: expected bool, got int"),
    ]


@pytest.mark.parametrize("name, arguments, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs(backend: str, name: str, arguments: dict[str, Any], error: type, message: str) -> None:
    assert_bad_call(twinattn.attention_varlen, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), backend, arguments, error, message)


def test_torch_tensor_names_the_torch_function() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"twinattn.torch.attention_varlen\(q, k, v, cu_seqlens_q, cu_seqlens_k, ...\)"):
        twinattn.attention_varlen(torch.zeros(2, 1, 4), np.zeros((2, 1, 4), np.float32), np.zeros((2, 1, 4), np.float32),
                                  np.array([0, 2]), np.array([0, 2]))
