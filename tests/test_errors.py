"""Every error path of the contract, on every backend, with the same exception and message."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

import twinattn

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 4, 5, 8)).astype(np.float32)
K = RNG.standard_normal((2, 2, 7, 8)).astype(np.float32)
V = RNG.standard_normal((2, 2, 7, 6)).astype(np.float32)

# (id, kwargs overriding q/k/v/options, exception, substring of the message)
CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("q-int32", {"q": Q.astype(np.int32)}, TypeError,
     "q: expected float32, float16 or bfloat16 (ml_dtypes.bfloat16), got int32; convert with q.astype(np.float32)"),
    ("k-int", {"k": K.astype(np.int32)}, TypeError, "k: expected dtype float32 (q\'s dtype) or int8, got int32; convert with k.astype(np.float32), or quantize both k and v with twinattn.quantize_kv"),
    ("v-float16", {"v": V.astype(np.float16)}, TypeError,
     "v: expected dtype float32 (q's dtype), got float16; convert with v.astype(np.float32)"),
    ("q-not-array", {"q": "abc"}, TypeError, "q: expected a numpy array"),
    ("q-rank5", {"q": Q[None]}, ValueError, "q: expected 2, 3 or 4 dimensions"),
    ("k-rank3", {"k": K[0]}, ValueError, "k: expected 4 dimensions"),
    ("batch-mismatch", {"k": K[:1], "v": V[:1]}, ValueError, "k: expected shape (B=2, Hkv, Lk, D=8)"),
    ("head-dim-mismatch", {"k": K[..., :4]}, ValueError, "k: expected shape (B=2, Hkv, Lk, D=8)"),
    ("v-len-mismatch", {"v": V[:, :, :3]}, ValueError, "v: expected shape (B=2, Hkv=2, Lk=7, Dv)"),
    ("gqa-not-multiple", {"k": K[:, :1].repeat(3, 1), "v": V[:, :1].repeat(3, 1)}, ValueError, "multiple of the key/value heads Hkv=3"),
    ("causal-not-bool", {"causal": 1}, TypeError, "causal: expected bool"),
    ("negative-default-offset", {"causal": True, "kv_lens": [7, 3]}, ValueError, "pass q_offset=0"),
    ("negative-offset", {"causal": True, "q_offset": -1}, ValueError, "q_offset: expected non-negative values"),
    ("offset-shape", {"q_offset": [1, 2, 3]}, ValueError, "q_offset: expected an int or an int array of shape (B=2,)"),
    ("offset-float", {"q_offset": np.array([1.0, 2.0])}, TypeError, "q_offset: expected an int or an int array"),
    ("offset-bool", {"q_offset": True}, TypeError, "q_offset: expected an int or an int array"),
    ("kv-lens-too-long", {"kv_lens": [8, 7]}, ValueError, "kv_lens: expected values in [0, Lk=7]"),
    ("kv-lens-negative", {"kv_lens": [-1, 7]}, ValueError, "kv_lens: expected values in [0, Lk=7]"),
    ("kv-lens-shape", {"kv_lens": [7]}, ValueError, "kv_lens: expected an int or an int array of shape (B=2,)"),
    ("mask-int", {"attn_mask": np.ones((5, 7), dtype=np.int8)}, TypeError, "attn_mask: integer masks are ambiguous"),
    ("mask-float64", {"attn_mask": np.zeros((5, 7))}, TypeError, "attn_mask: expected bool (True = may attend) or float32"),
    ("mask-shape", {"attn_mask": np.ones((5, 6), dtype=bool)}, ValueError, "attn_mask: expected a shape broadcastable to (B, Hq, Lq, Lk) = (2, 4, 5, 7)"),
    ("scale-nan", {"scale": float("nan")}, ValueError, "scale: expected a finite float"),
    ("scale-str", {"scale": "1"}, TypeError, "scale: expected a float"),
    ("scale-beyond-float32", {"scale": 1e39}, ValueError, "scale: expected a finite float, got 1e+39, which is inf in float32"),
    ("out-shape", {"out": np.empty((2, 4, 5, 8), np.float32)}, ValueError, "out: expected shape (2, 4, 5, 6)"),
    ("out-dtype", {"out": np.empty((2, 4, 5, 6), np.float64)}, TypeError, "out: expected dtype float32 (q's dtype), got float64"),
    ("out-readonly", {"out": np.broadcast_to(np.empty((1, 1, 1, 6), np.float32), (2, 4, 5, 6))}, ValueError, "out: expected a writeable array"),
    ("num-threads-zero", {"num_threads": 0}, ValueError, "num_threads: expected a positive int"),
    ("backend-name", {"backend": "cuda"}, ValueError, "backend: expected one of 'auto', 'cpp', 'rust', 'numpy'"),
]


@pytest.mark.parametrize("overrides, exc, message", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_error_paths(backend: str, overrides: dict[str, Any], exc: type[Exception], message: str) -> None:
    args = {"q": Q, "k": K, "v": V, "backend": backend, **overrides}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc) as info:
        twinattn.attention(q, k, v, **args)
    assert message in str(info.value)


def test_out_overlapping_an_input_raises(backend: str) -> None:
    buf = np.zeros((2, 4, 5, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="out: must not overlap the memory of q"):
        twinattn.attention(buf, K, K, out=buf, backend=backend)


def test_float64_only_on_numpy(native_backend: str) -> None:
    with pytest.raises(TypeError, match="computes in float32 and does not cast silently"):
        twinattn.attention(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64), backend=native_backend)
    out = twinattn.attention(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64), backend="numpy")
    assert out.dtype == np.float64


def test_same_message_on_every_backend(native_backend: str) -> None:
    messages = []
    for backend in ("numpy", native_backend):
        with pytest.raises(ValueError) as info:
            twinattn.attention(Q, K, V, kv_lens=[9, 1], backend=backend)
        messages.append(str(info.value))
    assert messages[0] == messages[1], messages


def test_a_list_says_to_pass_a_numpy_array(backend: str) -> None:
    """A list of Python numbers converts to float64 or int64: where the backend refuses that dtype,
    the message says how to make the array (the numpy backend computes a float64 list in float64)."""
    ints = tuple(np.ones((2, 2, 7, 8), int).tolist())
    with pytest.raises(TypeError) as info:
        twinattn.attention(Q, ints, V, backend=backend)
    assert str(info.value) == "k: got a tuple (of int64 values); pass a numpy array, e.g. np.asarray(k, dtype=np.float32)"
    if backend == "numpy":
        assert twinattn.attention(Q.tolist(), K.tolist(), V.tolist(), backend=backend).dtype == np.float64
        return
    with pytest.raises(TypeError) as info:
        twinattn.attention(Q.tolist(), K, V, backend=backend)
    assert str(info.value) == "q: got a list (of float64 values); pass a numpy array, e.g. np.asarray(q, dtype=np.float32)"


# ---- the native entry points, called directly -------------------------------------------------


def _native_args(**overrides: Any) -> dict[str, Any]:
    """q, k, v, out and scale; the other keywords at their defaults unless overridden."""
    args: dict[str, Any] = dict(q=Q, k=K, v=V, out=np.empty((2, 4, 5, 6), np.float32), scale=0.5)
    args.update(overrides)
    return args


# Bad direct calls of the native entry points: tests/test_port_parity.py, which calls both ports
# and asserts the same exception type from each, and the same message where the ports share its
# wording.


def test_native_entry_point_accepts_good_input(native_backend: str) -> None:
    module = importlib.import_module(f"twinattn._{native_backend}")
    args = _native_args(lse=np.empty((2, 4, 5), np.float32))
    module.attention_forward(**args)
    want, want_lse = twinattn.attention(Q, K, V, scale=0.5, return_lse=True, backend="numpy")
    np.testing.assert_allclose(args["out"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(args["lse"], want_lse, rtol=1e-5, atol=1e-6)
