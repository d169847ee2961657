"""The two native ports behave identically on every input, bad inputs included.

Every test here calls BOTH native modules (twinattn._cpp and twinattn._rust) directly, or both
through twinattn, and asserts the same exception type (and, for good input, the same output),
and the same message wherever the ports share its wording: every message but the few that print
a float, which each core writes its own way (C++'s std::to_chars, Rust's Display).
docs/native_api.md is the contract these tests hold the ports to.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from types import ModuleType
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import twinattn
from helpers import HALF_DTYPES, ISAS, assert_close_to_reference, forced_isa, rand

PORTS = ("cpp", "rust")
KERNELS = ("attention_forward", "attention_reference")

RNG = np.random.default_rng(11)
Q = RNG.standard_normal((2, 4, 5, 8)).astype(np.float32)
K = RNG.standard_normal((2, 2, 7, 8)).astype(np.float32)
V = RNG.standard_normal((2, 2, 7, 6)).astype(np.float32)
OUT_SHAPE = (2, 4, 5, 6)
BF16 = ml_dtypes.bfloat16
HALF = {"q": Q.astype(np.float16), "k": K.astype(np.float16), "v": V.astype(np.float16), "out": np.zeros(OUT_SHAPE, np.float16)}


@pytest.fixture(scope="module")
def modules() -> dict[str, ModuleType]:
    required = {p.strip() for p in os.environ.get("TWINATTN_REQUIRE_BACKENDS", "").split(",") if p.strip()}
    found: dict[str, ModuleType] = {}
    for port in PORTS:
        try:
            found[port] = importlib.import_module(f"twinattn._{port}")
        except ImportError as exc:
            if port in required:
                pytest.fail(f"backend {port!r} is required (TWINATTN_REQUIRE_BACKENDS) but not available: {exc}")
            pytest.skip(f"comparing the ports needs both; {port!r} is not built: {exc}")
    return found


def _args(**overrides: Any) -> dict[str, Any]:
    """A direct native call: q, k, v, out and the one required keyword, scale; every other
    keyword at its default (q_offset 0, kv_lens Lk, no mask, one thread, ...) unless overridden."""
    args: dict[str, Any] = dict(q=Q, k=K, v=V, out=np.zeros(OUT_SHAPE, np.float32), scale=0.5)
    args.update(overrides)
    return args


class Prefix(str):
    """The start of a message, up to a float that each port writes its own way."""


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the point is to compare whatever is raised
        return type(exc).__name__, str(exc)
    return "no error", ""


def _kernel_outcomes(modules: dict[str, ModuleType], overrides: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    """(port, kernel) -> what each native kernel of each port does with _args(**overrides)."""
    outcomes = {}
    for port, module in modules.items():
        for kernel in KERNELS:
            args = _args(**overrides)
            outcomes[port, kernel] = _outcome(lambda: getattr(module, kernel)(**args))
    return outcomes


def _strided(shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A writeable float32 view with arbitrary byte strides over a zeroed, aligned buffer (NumPy
    checks that it stays inside the buffer)."""
    buffer = np.zeros(4096 + 64, np.uint8)
    return np.ndarray(shape, np.float32, buffer=buffer, offset=(-buffer.ctypes.data) % 64, strides=strides)


def _misaligned(shape: tuple[int, ...]) -> np.ndarray:
    raw = np.zeros(int(np.prod(shape)) * 4 + 8, np.uint8)
    start = 1 + (-raw.ctypes.data) % 4  # data address 1 byte past a multiple of 4
    return np.ndarray(shape, np.float32, buffer=raw, offset=start)


_shared = np.zeros((2, 4, 5, 8), np.float32)  # q and out over the same memory
_mask_and_out = np.zeros((2, 4, 5, 7), np.float32)

# (id, overrides, exception type, the message both ports must give: in full, or its Prefix)
BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    # conversion (the bindings)
    ("q-list", {"q": Q.tolist()}, TypeError, "q: expected a numpy.ndarray, got list"),
    # dtypes (docs/native_api.md): q first, then k, v and out against q's dtype
    ("q-float64", {"q": Q.astype(np.float64)}, TypeError, "q: expected dtype float32, float16 or bfloat16, got float64"),
    ("q-int8", {"q": Q.astype(np.int8)}, TypeError, "q: expected dtype float32, float16 or bfloat16, got int8"),
    ("q-float16-big-endian", {"q": Q.astype(">f2"), "k": Q.astype(">f2")}, TypeError,
     "q: expected dtype float32, float16 or bfloat16, got >f2"),
    ("q-float8", {"q": Q.astype(ml_dtypes.float8_e4m3fn)}, TypeError,
     "q: expected dtype float32, float16 or bfloat16, got float8_e4m3fn"),
    ("v-big-endian", {"v": V.astype(">f4")}, TypeError, "v: expected dtype float32 (q's dtype), got >f4"),
    ("out-int32", {"out": np.zeros(OUT_SHAPE, np.int32)}, TypeError, "out: expected dtype float32 (q's dtype), got int32"),
    ("v-bfloat16-for-float16", {"q": Q.astype(np.float16), "k": K.astype(np.float16), "v": V.astype(BF16),
                                "out": np.zeros(OUT_SHAPE, np.float16)}, TypeError,
     "v: expected dtype float16 (q's dtype), got bfloat16"),
    ("out-float32-for-bfloat16", {"q": Q.astype(BF16), "k": K.astype(BF16), "v": V.astype(BF16)}, TypeError,
     "out: expected dtype bfloat16 (q's dtype), got float32"),
    ("out-bfloat16-for-float16", {**HALF, "out": np.zeros(OUT_SHAPE, BF16)}, TypeError,
     "out: expected dtype float16 (q's dtype), got bfloat16"),
    ("lse-float16", {**HALF, "lse": np.zeros((2, 4, 5), np.float16)}, TypeError, "lse: expected dtype float32, got float16"),
    ("mask-float16", {**HALF, "mask": np.zeros((2, 4, 5, 7), np.float16)}, TypeError,
     "mask: expected dtype bool or float32, got float16"),
    ("sinks-bfloat16", {"q": Q.astype(BF16), "k": K.astype(BF16), "v": V.astype(BF16), "out": np.zeros(OUT_SHAPE, BF16),
                        "sinks": np.zeros(4, BF16)}, TypeError, "sinks: expected dtype float32, got bfloat16"),
    ("half-q-rank3", {**HALF, "q": Q[0].astype(np.float16)}, ValueError, "q: expected 4 dimensions (B, Hq, Lq, D), got shape (4, 5, 8)"),
    ("q-rank3", {"q": Q[0]}, ValueError, "q: expected 4 dimensions (B, Hq, Lq, D), got shape (4, 5, 8)"),
    ("k-rank5", {"k": K[None]}, ValueError, "k: expected 4 dimensions (B, Hkv, Lk, D), got shape (1, 2, 2, 7, 8)"),
    ("out-rank1", {"out": np.zeros(6, np.float32)}, ValueError, "out: expected 4 dimensions (B, Hq, Lq, Dv), got shape (6,)"),
    ("q-byte-strides", {"q": _strided((2, 4, 5, 8), (640, 160, 32, 2))}, ValueError,
     "q: expected byte strides that are multiples of the item size 4, got strides (640, 160, 32, 2)"),
    ("k-misaligned", {"k": _misaligned((2, 2, 7, 8))}, ValueError,
     "k: expected data aligned to its item size 4, got a misaligned array"),
    ("out-readonly", {"out": np.broadcast_to(np.zeros((1, 1, 1, 6), np.float32), OUT_SHAPE)}, ValueError,
     "out: expected a writeable array, got a read-only one"),
    ("lse-dtype", {"lse": np.zeros((2, 4, 5))}, TypeError, "lse: expected dtype float32, got float64"),
    ("lse-rank", {"lse": np.zeros((2, 4), np.float32)}, ValueError, "lse: expected 3 dimensions (B, Hq, Lq), got shape (2, 4)"),
    ("lse-readonly", {"lse": np.broadcast_to(np.zeros(1, np.float32), (2, 4, 5))}, ValueError,
     "lse: expected a writeable array, got a read-only one"),
    ("mask-int8", {"mask": np.ones((2, 4, 5, 7), np.int8)}, TypeError, "mask: expected dtype bool or float32, got int8"),
    ("mask-float64", {"mask": np.zeros((2, 4, 5, 7))}, TypeError, "mask: expected dtype bool or float32, got float64"),
    ("mask-rank", {"mask": np.ones((5, 7), bool)}, ValueError, "mask: expected 4 dimensions (B, Hq, Lq, Lk), got shape (5, 7)"),
    ("q-offset-int32", {"q_offset": np.zeros(2, np.int32)}, TypeError, "q_offset: expected dtype int64, got int32"),
    ("q-offset-int", {"q_offset": 0}, TypeError, "q_offset: expected a numpy.ndarray, got int"),
    ("q-offset-rank", {"q_offset": np.zeros((2, 1), np.int64)}, ValueError, "q_offset: expected 1 dimensions (B,), got shape (2, 1)"),
    ("causal-int", {"causal": 1}, TypeError, "causal: expected a bool, got int"),
    ("scale-str", {"scale": "0.5"}, TypeError, "scale: expected a float, got str"),
    ("scale-bool", {"scale": True}, TypeError, "scale: expected a float, got bool"),
    ("scale-none", {"scale": None}, TypeError, "scale: expected a float, got NoneType"),
    ("num-threads-float", {"num_threads": 2.0}, TypeError, "num_threads: expected an int, got float"),
    ("num-threads-bool", {"num_threads": True}, TypeError, "num_threads: expected an int, got bool"),
    ("window-left-float", {"window_left": 1.0}, TypeError, "window_left: expected an int, got float"),
    ("window-right-bool", {"window_right": True}, TypeError, "window_right: expected an int, got bool"),
    ("softcap-str", {"softcap": "1"}, TypeError, "softcap: expected a float, got str"),
    ("softcap-bool", {"softcap": True}, TypeError, "softcap: expected a float, got bool"),
    ("alibi-list", {"alibi_slopes": [[0.5] * 4] * 2}, TypeError, "alibi_slopes: expected a numpy.ndarray, got list"),
    ("alibi-float64", {"alibi_slopes": np.ones((2, 4))}, TypeError, "alibi_slopes: expected dtype float32, got float64"),
    ("alibi-rank1", {"alibi_slopes": np.ones(4, np.float32)}, ValueError,
     "alibi_slopes: expected 2 dimensions (B, Hq), got shape (4,)"),
    ("sinks-float64", {"sinks": np.ones(4)}, TypeError, "sinks: expected dtype float32, got float64"),
    ("sinks-rank2", {"sinks": np.ones((1, 4), np.float32)}, ValueError, "sinks: expected 1 dimensions (Hq,), got shape (1, 4)"),
    # invariants (the cores' check_problem)
    ("mask-shape", {"mask": np.ones((2, 4, 5, 6), bool)}, ValueError,
     "mask: expected shape (B=2, Hq=4, Lq=5, Lk=7), got (2, 4, 5, 6)"),
    ("q-offset-shape", {"q_offset": np.zeros(3, np.int64)}, ValueError, "q_offset: expected shape (B=2,), got (3,)"),
    ("kv-lens-shape", {"kv_lens": np.array([7])}, ValueError, "kv_lens: expected shape (B=2,), got (1,)"),
    ("k-batch", {"k": K[:1], "v": V[:1]}, ValueError, "k: expected shape (B=2, Hkv, Lk, D=8), got (1, 2, 7, 8)"),
    ("k-head-dim", {"k": K[..., :4]}, ValueError, "k: expected shape (B=2, Hkv, Lk, D=8), got (2, 2, 7, 4)"),
    ("v-len", {"v": V[:, :, :3]}, ValueError, "v: expected shape (B=2, Hkv=2, Lk=7, Dv), got (2, 2, 3, 6)"),
    ("v-heads", {"v": V[:, :1]}, ValueError, "v: expected shape (B=2, Hkv=2, Lk=7, Dv), got (2, 1, 7, 6)"),
    ("out-shape", {"out": np.zeros((2, 4, 5, 5), np.float32)}, ValueError,
     "out: expected shape (B=2, Hq=4, Lq=5, Dv=6), got (2, 4, 5, 5)"),
    ("lse-shape", {"lse": np.zeros((2, 4, 4), np.float32)}, ValueError, "lse: expected shape (B=2, Hq=4, Lq=5), got (2, 4, 4)"),
    ("gqa", {"k": np.repeat(K[:, :1], 3, 1), "v": np.repeat(V[:, :1], 3, 1)}, ValueError,
     "k: expected Hkv dividing Hq=4 (query head h reads KV head h // (Hq // Hkv)), got Hkv=3"),
    ("gqa-zero-kv-heads", {"k": K[:, :0], "v": V[:, :0]}, ValueError,
     "k: expected Hkv dividing Hq=4 (query head h reads KV head h // (Hq // Hkv)), got Hkv=0"),
    ("q-last-stride", {"q": np.zeros((2, 4, 5, 16), np.float32)[..., ::2]}, ValueError,
     "q: expected unit stride on the last axis (D=8), got stride 2 elements"),
    ("out-last-stride", {"out": np.zeros((2, 4, 5, 12), np.float32)[..., ::2]}, ValueError,
     "out: expected unit stride on the last axis (Dv=6), got stride 2 elements"),
    ("kv-lens-too-long", {"kv_lens": np.array([7, 8])}, ValueError, "kv_lens: expected values in [0, Lk=7], got kv_lens[1]=8"),
    ("kv-lens-negative", {"kv_lens": np.array([-1, 7])}, ValueError, "kv_lens: expected values in [0, Lk=7], got kv_lens[0]=-1"),
    ("q-offset-negative", {"q_offset": np.array([0, -2]), "causal": True}, ValueError,
     "q_offset: expected values >= 0 when causal, got q_offset[1]=-2"),
    ("scale-nan", {"scale": float("nan")}, ValueError, Prefix("scale: expected a finite number, got ")),
    ("scale-minus-inf", {"scale": float("-inf")}, ValueError, "scale: expected a finite number, got -inf"),
    ("scale-beyond-float32", {"scale": 1e39}, ValueError, "scale: expected a finite number, got inf"),
    ("window-left-below-minus-one", {"window_left": -2}, ValueError,
     "window_left: expected an int >= -1 (-1: unbounded), got -2"),
    ("window-right-below-minus-one", {"window_right": -5}, ValueError,
     "window_right: expected an int >= -1 (-1: unbounded), got -5"),
    ("softcap-negative", {"softcap": -1.0}, ValueError, "softcap: expected a finite number >= 0 (0: off), got -1"),
    # both ports print the shortest digits that read back as the float32; exponents and NaN's
    # spelling differ (C++ -3e+38, -1e-07, nan; Rust -300000000000000000000000000000000000000,
    # -0.0000001, NaN)
    ("softcap-negative-fraction", {"softcap": -1.2345678}, ValueError,
     "softcap: expected a finite number >= 0 (0: off), got -1.2345678"),
    ("softcap-negative-huge", {"softcap": -3e38}, ValueError, Prefix("softcap: expected a finite number >= 0 (0: off), got ")),
    ("softcap-negative-tiny", {"softcap": -1e-7}, ValueError, Prefix("softcap: expected a finite number >= 0 (0: off), got ")),
    ("softcap-nan", {"softcap": float("nan")}, ValueError, Prefix("softcap: expected a finite number >= 0 (0: off), got ")),
    ("softcap-beyond-float32", {"softcap": 1e39}, ValueError, "softcap: expected a finite number >= 0 (0: off), got inf"),
    ("alibi-shape", {"alibi_slopes": np.ones((2, 3), np.float32)}, ValueError,
     "alibi_slopes: expected shape (B=2, Hq=4), got (2, 3)"),
    ("alibi-nan", {"alibi_slopes": np.array([[0, 0, 0, 0], [0, 0, np.nan, 0]], np.float32)}, ValueError,
     Prefix("alibi_slopes: expected finite values, got alibi_slopes[1, 2]=")),
    ("sinks-shape", {"sinks": np.ones(3, np.float32)}, ValueError, "sinks: expected shape (Hq=4,), got (3,)"),
    ("sinks-inf", {"sinks": np.array([0, 0, 0, -np.inf], np.float32)}, ValueError,
     "sinks: expected finite values, got sinks[3]=-inf"),
    ("out-overlaps-itself", {"out": _strided(OUT_SHAPE, (480, 0, 24, 4))}, ValueError,
     "out: expected elements that do not overlap each other, got strides (120, 0, 6, 1)"),
    ("out-rows-interleaved", {"out": _strided(OUT_SHAPE, (480, 120, 16, 4))}, ValueError,
     "out: expected elements that do not overlap each other, got strides (120, 30, 4, 1)"),
    ("lse-overlaps-itself", {"lse": _strided((2, 4, 5), (80, 4, 4))}, ValueError,
     "lse: expected elements that do not overlap each other, got strides (20, 1, 1)"),
    ("out-aliases-q", {"q": _shared, "out": _shared[..., :6], "v": np.zeros((2, 2, 7, 6), np.float32)}, ValueError,
     "out: expected memory disjoint from q, got arrays that overlap"),
    ("out-aliases-mask", {"mask": _mask_and_out, "out": _mask_and_out[..., :6]}, ValueError,
     "out: expected memory disjoint from mask, got arrays that overlap"),
    ("lse-aliases-k", {"lse": K.reshape(-1)[:40].reshape(2, 4, 5)}, ValueError,
     "lse: expected memory disjoint from k, got arrays that overlap"),
    ("num-threads-zero", {"num_threads": 0}, ValueError, "num_threads: expected an int >= 1, got 0"),
    ("num-threads-negative", {"num_threads": -3}, ValueError, "num_threads: expected an int >= 1, got -3"),
    ("num-threads-beyond-int64", {"num_threads": -(2**70)}, ValueError,
     "num_threads: expected an int >= 1, got -9223372036854775808"),
]


@pytest.mark.parametrize("overrides, exc, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_CALLS])
def test_bad_native_call_same_error_in_both_ports(
    modules: dict[str, ModuleType], overrides: dict[str, Any], exc: type[Exception], message: str
) -> None:
    outcomes = _kernel_outcomes(modules, overrides)
    assert {kind for kind, _ in outcomes.values()} == {exc.__name__}, outcomes
    if isinstance(message, Prefix):
        assert all(text.startswith(message) and text != message for _, text in outcomes.values()), outcomes
    else:
        assert {text for _, text in outcomes.values()} == {message}, outcomes


# calls that do not fit the signature (C++ matches the arguments by hand, Rust through PyO3): the
# same TypeError text from both ports and both kernels ({f}: the function's name)
_OUT = np.zeros(OUT_SHAPE, np.float32)
SIGNATURE_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any], str]] = [
    ("scale-missing", (Q, K, V, _OUT), {}, "{f}() missing 1 required keyword argument: 'scale'"),
    ("out-missing", (Q, K, V), {"scale": 0.5}, "{f}() missing 1 required positional argument: 'out'"),
    ("two-missing", (Q, K), {"scale": 0.5}, "{f}() missing 2 required positional arguments: 'v' and 'out'"),
    ("three-missing", (Q,), {"scale": 0.5}, "{f}() missing 3 required positional arguments: 'k', 'v', and 'out'"),
    ("scale-by-position", (Q, K, V, _OUT, 0.5), {}, "{f}() takes 4 positional arguments but 5 were given"),
    ("unknown-keyword", (Q, K, V, _OUT), {"scale": 0.5, "causl": True}, "{f}() got an unexpected keyword argument 'causl'"),
    ("q-twice", (Q, K, V, _OUT), {"q": Q, "scale": 0.5}, "{f}() got multiple values for argument 'q'"),
    ("positional-before-keyword", (Q, K, V, _OUT), {"causal": True, "foo": 1, "scale": 0.5},
     "{f}() got an unexpected keyword argument 'foo'"),
]


@pytest.mark.parametrize(("args", "kwargs", "message"), [c[1:] for c in SIGNATURE_CALLS], ids=[c[0] for c in SIGNATURE_CALLS])
def test_a_call_that_does_not_fit_the_signature_same_error_in_both_ports(
    modules: dict[str, ModuleType], args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    for kernel in KERNELS:
        outcomes = {port: _outcome(lambda: getattr(module, kernel)(*args, **kwargs)) for port, module in modules.items()}
        assert set(outcomes.values()) == {("TypeError", message.format(f=kernel))}, outcomes


def test_every_argument_by_name_or_a_str_built_at_run_time_in_both_ports(modules: dict[str, ModuleType]) -> None:
    # q, k, v and out by name, and keywords whose names are not interned (built at run time):
    # the call by position's bits
    names = {"".join(["ca", "usal"]): True, "".join(["num_", "threads"]): 2, "".join(["sc", "ale"]): 0.5}
    for port, module in modules.items():
        for kernel in KERNELS:
            want, got = np.zeros(OUT_SHAPE, np.float32), np.zeros(OUT_SHAPE, np.float32)
            getattr(module, kernel)(Q, K, V, want, scale=0.5, causal=True, num_threads=2)
            getattr(module, kernel)(out=got, v=V, k=K, q=Q, **names)
            np.testing.assert_array_equal(got, want, err_msg=f"{port} {kernel}")
            assert float(np.abs(want).max()) > 0


def test_none_means_the_default_in_both_ports(modules: dict[str, ModuleType]) -> None:
    """Every keyword but scale may be None or left out: its default, the same bits either way."""
    defaults = dict(lse=None, q_offset=np.zeros(2, np.int64), kv_lens=np.full(2, 7, np.int64), mask=None, causal=False,
                    num_threads=1, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                    k_scale=None, v_scale=None)
    for module in modules.values():
        for kernel in KERNELS:
            outs = []
            for keywords in ({}, dict.fromkeys(defaults), defaults):
                args = _args(**keywords)
                getattr(module, kernel)(**args)
                outs.append(args["out"])
            assert outs[0].any()
            for out in outs[1:]:
                np.testing.assert_array_equal(out.view(np.uint32), outs[0].view(np.uint32))


def _sweep_problem(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """Problem n of a same-bits sweep: float32 q, k, v and the keywords. GQA, causal or not,
    kv_lens, odd D; a decode step every fourth, a bool mask or a float bias two in three, and every
    fifth the variants (window, softcap, ALiBi, sinks)."""
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    hq = hkv * int(rng.choice([1, 2, 4, 8]))
    lk = int(rng.integers(1, 1500))
    lq = 1 if n % 4 == 0 else int(rng.integers(1, min(120, lk) + 1))
    d, dv = int(rng.choice([17, 32, 64, 128])), int(rng.choice([9, 24, 64, 128]))
    q, k, v = (rand(rng, b, h, n_, w) for h, n_, w in ((hq, lq, d), (hkv, lk, d), (hkv, lk, dv)))
    kwargs: dict[str, Any] = dict(causal=bool(rng.integers(0, 2)), return_lse=True)
    kwargs["kv_lens"] = rng.integers(0 if not kwargs["causal"] else lq, lk + 1, size=b)
    if n % 3 == 0:
        kwargs["attn_mask"] = rng.random((b, hq, lq, lk)) > 0.3
    elif n % 3 == 1:
        kwargs["attn_mask"] = rng.standard_normal((1, hq, 1, lk)).astype(np.float32)
    if n % 5 == 2:
        kwargs.update(window_size=(int(rng.integers(0, 300)), -1), softcap=3.0,
                      alibi_slopes=rng.uniform(0, 0.1, hq).astype(np.float32), sinks=rng.standard_normal(hq).astype(np.float32))
    return q, k, v, kwargs


def _assert_ports_same_bits(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> None:
    """twinattn.attention with backend="cpp" and "rust": the same bits in out (q's dtype) and lse."""
    out_cpp, lse_cpp = twinattn.attention(q, k, v, backend="cpp", **kwargs)
    out_rust, lse_rust = twinattn.attention(q, k, v, backend="rust", **kwargs)
    assert out_cpp.dtype == out_rust.dtype == q.dtype
    np.testing.assert_array_equal(out_cpp.view(np.uint8), out_rust.view(np.uint8))
    np.testing.assert_array_equal(lse_cpp, lse_rust)


def _assert_kernels_same_bits(modules: dict[str, ModuleType], out_dtype: np.dtype, **overrides: Any) -> None:
    """Both ports' plain kernels, called directly (causal, offsets and kv_lens set), write the same
    bits to out and lse; each call gets its own out and lse."""
    for kernel in KERNELS:
        outs = []
        for module in modules.values():
            args = _args(out=np.zeros(OUT_SHAPE, out_dtype), lse=np.zeros((2, 4, 5), np.float32), causal=True,
                         kv_lens=np.array([7, 4]), q_offset=np.array([2, 0]), **overrides)
            getattr(module, kernel)(**args)
            outs.append((args["out"].view(np.uint8), args["lse"]))
        for a, b_ in zip(*outs):
            np.testing.assert_array_equal(a, b_)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_half_precision_same_bits_in_both_ports(modules: dict[str, ModuleType], isa: str, dtype: np.dtype) -> None:
    """float16 and bfloat16 on each instruction set: one algorithm in both ports, so the same bits
    in out and lse (a random sweep of GQA, causal or not, offsets, kv_lens, masks, odd D, decode
    and prefill, and the variants), through twinattn and through both native kernels."""
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        rng = np.random.default_rng(4242)
        for n in range(14):
            q, k, v, kwargs = _sweep_problem(rng, n)
            _assert_ports_same_bits(q.astype(dtype), k.astype(dtype), v.astype(dtype), **kwargs)
        _assert_kernels_same_bits(modules, dtype, q=Q.astype(dtype), k=K.astype(dtype), v=V.astype(dtype))


K8, V8 = twinattn.quantize_kv(K)[0], twinattn.quantize_kv(V)[0]
SCALES = np.full((2, 2, 7), 0.02, np.float32)
INT8 = {"k": K8, "v": V8, "k_scale": SCALES, "v_scale": SCALES}

# int8 K/V (the order and wording: docs/native_api.md): the bindings convert k (q's dtype or int8),
# v (k's dtype when that is int8) and, after sinks, each scale given (float32, rank 3); the cores
# then require both scales with int8 k and v, refuse them otherwise, and check their shape
INT8_BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("k-float16", {"k": K.astype(np.float16)}, TypeError, "k: expected dtype float32 (q's dtype) or int8, got float16"),
    ("k-float32-for-bfloat16", {"q": Q.astype(BF16), "v": V.astype(BF16), "out": np.zeros(OUT_SHAPE, BF16)}, TypeError,
     "k: expected dtype bfloat16 (q's dtype) or int8, got float32"),
    ("k-uint8", {**INT8, "k": K8.view(np.uint8)}, TypeError, "k: expected dtype float32 (q's dtype) or int8, got uint8"),
    ("v-float32-for-int8-k", {**INT8, "v": V}, TypeError, "v: expected dtype int8 (k's dtype), got float32"),
    ("v-int8-for-float32-k", {"v": V8}, TypeError, "v: expected dtype float32 (q's dtype), got int8"),
    ("out-int8", {**INT8, "out": np.zeros(OUT_SHAPE, np.int8)}, TypeError, "out: expected dtype float32 (q's dtype), got int8"),
    ("k_scale-missing", {**INT8, "k_scale": None}, ValueError,
     "k_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"),
    ("v_scale-missing", {**INT8, "v_scale": None}, ValueError,
     "v_scale: required with int8 k and v (float32, shape (B, Hkv, Lk)), got None"),
    ("k_scale-superfluous", {"k_scale": SCALES}, ValueError,
     "k_scale: expected None with float32 k and v (scales are only for int8), got an array"),
    ("v_scale-superfluous-half", {**HALF, "v_scale": SCALES}, ValueError,
     "v_scale: expected None with float16 k and v (scales are only for int8), got an array"),
    ("k_scale-float16", {**INT8, "k_scale": SCALES.astype(np.float16)}, TypeError, "k_scale: expected dtype float32, got float16"),
    ("v_scale-float64", {**INT8, "v_scale": SCALES.astype(np.float64)}, TypeError, "v_scale: expected dtype float32, got float64"),
    ("k_scale-rank", {**INT8, "k_scale": SCALES[0]}, ValueError, "k_scale: expected 3 dimensions (B, Hkv, Lk), got shape (2, 7)"),
    ("v_scale-shape", {**INT8, "v_scale": SCALES[:, :, :6]}, ValueError, "v_scale: expected shape (B=2, Hkv=2, Lk=7), got (2, 2, 6)"),
    ("sinks-before-k_scale", {**INT8, "k_scale": None, "sinks": np.zeros(4, np.float64)}, TypeError, None),
]


@pytest.mark.parametrize("overrides, exc, message", [pytest.param(*c[1:], id=c[0]) for c in INT8_BAD_CALLS])
def test_bad_int8_native_call_same_error_in_both_ports(
    modules: dict[str, ModuleType], overrides: dict[str, Any], exc: type[Exception], message: str | None
) -> None:
    outcomes = _kernel_outcomes(modules, overrides)
    assert len(set(outcomes.values())) == 1, outcomes
    kind, text = next(iter(outcomes.values()))
    assert kind == exc.__name__, outcomes
    if message is None:  # the binding converts the sinks before the core asks for the scales
        assert text.startswith("sinks:"), outcomes
    else:
        assert text == message, outcomes


@pytest.mark.parametrize("isa", ISAS)
def test_int8_same_bits_in_both_ports(modules: dict[str, ModuleType], isa: str) -> None:
    """int8 K/V on each instruction set: the same bits in out and lse from both ports (a random
    sweep of q dtypes, GQA, causal or not, kv_lens, masks, odd D, decode and prefill, strided and
    stride-0 scales, the variants), through twinattn and through both native kernels."""
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        rng = np.random.default_rng(1515)
        for n in range(12):
            q, k, v, kwargs = _sweep_problem(rng, n)
            k8, k_scale = twinattn.quantize_kv(k)
            v8, v_scale = twinattn.quantize_kv(v)
            if n % 4 == 1:
                k_scale = np.broadcast_to(k_scale[:, :, :1], k_scale.shape)  # stride 0
            dtype = (np.dtype(np.float32), *HALF_DTYPES)[n % 3]
            _assert_ports_same_bits(q.astype(dtype), k8, v8, k_scale=k_scale, v_scale=v_scale, **kwargs)
        _assert_kernels_same_bits(modules, np.dtype(np.float32), **INT8)


def test_numbers_in_messages_read_back_exactly_in_both_ports(modules: dict[str, ModuleType]) -> None:
    # Each port writes a float its own way (C++'s std::to_chars, Rust's Display), both with the
    # shortest digits that read back as the same float32. A sweep over float32's whole range,
    # normal and subnormal, exact ties of the shortest digits included.
    rng = np.random.default_rng(7)
    magnitudes = np.exp(rng.uniform(-103.0, 88.7, 1500)).astype(np.float32)
    ties = (rng.integers(1, 2**24, 500) * 2.0 ** rng.integers(-30, 10, 500)).astype(np.float32)
    for value in np.concatenate([magnitudes, ties]):
        for module in modules.values():
            kind, text = _outcome(lambda: module.attention_forward(**_args(softcap=-float(value))))
            assert kind == "ValueError" and np.float32(text.rsplit("got ", 1)[1]) == -value, (float(value), text)


def test_lse_overlapping_out_same_error_in_both_ports(modules: dict[str, ModuleType]) -> None:
    buffer = np.zeros(2 * 4 * 5 * 6 + 40, np.float32)
    outcomes = set()
    for module in modules.values():
        out = buffer[:240].reshape(OUT_SHAPE)
        lse = buffer[200:240].reshape(2, 4, 5)
        outcomes.add(_outcome(lambda: module.attention_forward(**_args(out=out, lse=lse))))
    assert outcomes == {("ValueError", "out: expected memory disjoint from lse, got arrays that overlap")}


@pytest.mark.parametrize("num_threads", [1, 2, 2**31, 2**40, 2**70], ids=["1", "2", "2^31", "2^40", "2^70"])
def test_any_positive_thread_count_runs_in_both_ports(modules: dict[str, ModuleType], num_threads: int) -> None:
    # C++ used to raise TypeError above 2^31 - 1, and Rust took 0 as 1: now both run any count
    # >= 1 (a count only caps the threads; there are never more than work items) with the same
    # bits, and reject the rest with the same message (BAD_CALLS).
    results = {}
    for port, module in modules.items():
        for kernel in KERNELS:
            args = _args(lse=np.zeros((2, 4, 5), np.float32), num_threads=num_threads, causal=True,
                         q_offset=np.array([2, 0]), kv_lens=np.array([7, 4]))
            getattr(module, kernel)(**args)
            results[port, kernel] = args["out"], args["lse"]
            assert_close_to_reference(args["out"], Q, K, V, causal=True, q_offset=np.array([2, 0]),
                                      kv_lens=np.array([7, 4]), scale=0.5)
    for kernel in KERNELS:
        for a, b in zip(results["cpp", kernel], results["rust", kernel]):
            np.testing.assert_array_equal(a, b)


def test_set_isa_same_errors_in_both_ports(modules: dict[str, ModuleType]) -> None:
    for bad, exc in (("sse9", "ValueError"), (3, "TypeError"), (None, "TypeError")):
        outcomes = {_outcome(lambda: module.set_isa(bad)) for module in modules.values()}
        assert len(outcomes) == 1 and next(iter(outcomes))[0] == exc, outcomes
    available = modules["cpp"].build_info()["isa_available"]
    assert available == modules["rust"].build_info()["isa_available"]
    assert {_outcome(lambda: m.set_isa("sse9"))[1] for m in modules.values()} == {
        "isa: expected one of the instruction sets this build and CPU can run "
        f"({', '.join(available)}), got 'sse9'"
    }


# ---- (a) an out whose elements alias each other, through the public API --------------------------


def test_self_overlapping_out_rejected_by_every_backend(backend: str) -> None:
    base = np.zeros(4 * 5 * 6 + 6, np.float32)
    # rows of out step 1 float: out[b, h, i, :] and out[b, h, i + 1, :] share 5 of their 6 floats
    out = np.lib.stride_tricks.as_strided(base, shape=OUT_SHAPE, strides=(0, 120, 4, 4))
    with pytest.raises(ValueError) as info:
        twinattn.attention(Q, K, V, out=out, backend=backend)
    assert str(info.value) == (
        "out: expected an array whose elements do not overlap each other, got strides (0, 120, 4, 4) (bytes) "
        "for shape (2, 4, 5, 6): pass a fresh array such as np.empty((2, 4, 5, 6), np.float32)"
    )
    assert not base.any()  # nothing was written


# ---- (b) a bad TWINATTN_ISA: loud, and the same from both ports ---------------------------------

_ISA_PROBE = r"""
import json, sys
import numpy as np
results = {}
def outcome(name, call):
    try:
        call()
        results[name] = ["no error", ""]
    except Exception as exc:
        results[name] = [type(exc).__name__, str(exc)]
import importlib
for port in ("cpp", "rust"):
    outcome("import " + port, lambda: importlib.import_module("twinattn._" + port))
import twinattn
q = np.zeros((1, 1, 2, 4), np.float32)
outcome("backends", twinattn.backends)
outcome("build_info", twinattn.build_info)
for backend in ("auto", "cpp", "rust", "numpy"):
    outcome("attention " + backend, lambda: twinattn.attention(q, q, q, backend=backend))
print(json.dumps(results))
"""


def _probe(code: str, env: dict[str, str]) -> dict[str, list[str]]:
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_bad_twinattn_isa_same_error_from_both_ports_and_the_api(modules: dict[str, ModuleType]) -> None:
    available = ", ".join(modules["cpp"].build_info()["isa_available"])
    expected = ["ImportError", f"TWINATTN_ISA: expected one of the instruction sets this build and CPU can run ({available}), got 'quantum'"]
    results = _probe(_ISA_PROBE, {"TWINATTN_ISA": "quantum"})
    for name in ("import cpp", "import rust", "backends", "build_info", "attention auto", "attention cpp", "attention rust"):
        assert results[name] == expected, (name, results)
    assert results["attention numpy"] == ["no error", ""]  # NumPy does not read TWINATTN_ISA


def test_good_twinattn_isa_still_loads_both_ports(modules: dict[str, ModuleType]) -> None:
    results = _probe(_ISA_PROBE, {"TWINATTN_ISA": "scalar"})
    assert all(outcome == ["no error", ""] for outcome in results.values()), results


# ---- (e) out of memory: MemoryError from both ports, the interpreter alive -----------------------

_OOM_PROBE = r"""
import importlib, json, resource
import numpy as np
modules = [importlib.import_module("twinattn._" + port) for port in ("cpp", "rust")]
# Keys broadcast over 2^31 positions cost no memory, but the kernels' scratch for them (packed K
# panels, a score per key) would take 8-128 GiB; the address-space limit makes that allocation
# fail at once on any machine, without touching memory.
with open("/proc/self/status") as status:
    vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib + 2 * 1024 * 1024) * 1024, resource.getrlimit(resource.RLIMIT_AS)[1]))
key_len = 2**31
q = np.ones((1, 1, 256, 16), np.float32)  # 256 rows: the prefill path, which packs K
k = np.broadcast_to(np.ones((1, 1, 1, 16), np.float32), (1, 1, key_len, 16))
results = []
for module in modules:
    for kernel in ("attention_forward", "attention_reference"):
        out = np.zeros((1, 1, 256, 16), np.float32)
        try:
            getattr(module, kernel)(q, k, k, out, scale=0.25, kv_lens=np.full(1, key_len, np.int64), num_threads=2)
            results.append(["no error", ""])
        except Exception as exc:
            results.append([type(exc).__name__, str(exc)])
# still alive, and still computing
small = np.ones((1, 1, 2, 4), np.float32)
for module in modules:
    out = np.zeros_like(small)
    module.attention_forward(small, small, small, out, scale=0.5, num_threads=2)
    results.append(["ok" if np.all(out == 1.0) else "wrong", ""])
print(json.dumps(results))
"""


def test_out_of_memory_raises_memory_error_in_both_ports(modules: dict[str, ModuleType]) -> None:
    result = subprocess.run([sys.executable, "-c", _OOM_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the interpreter died (rc={result.returncode}): {result.stderr[-2000:]}"
    results = json.loads(result.stdout.strip().splitlines()[-1])
    message = "out of memory: the kernel's scratch buffers for this call could not be allocated"
    assert results == [["MemoryError", message]] * 4 + [["ok", ""]] * 2, results
