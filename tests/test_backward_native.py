"""The native backward pass, attention_backward of both ports, called directly.

Each case runs the C++ forward for out and lse, then both ports' attention_backward on the same
inputs, and asserts (a) the two ports' dq, dk, dv and dsinks bit for bit, (b) agreement with a
float64 NumPy backward written here (_backward64), within a bound that follows from float32
arithmetic, (c) every gradient element written (the arrays start as NaN), and the same exception
type and message from both ports for bad input. docs/native_api.md, "attention_backward", is the
contract.
"""

from __future__ import annotations

import ctypes
import importlib
import platform
import threading
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from conftest import _require
from helpers import forced_isa

UNIT_ROUNDOFF = 2.0**-24  # float32
BF16 = np.dtype(ml_dtypes.bfloat16)
# Relative half-ulp of each gradient dtype: the one rounding of the float32 sums.
HALF_ULP = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, BF16: 2.0**-8}


@pytest.fixture(scope="module")
def ports() -> dict[str, ModuleType]:
    for port in ("cpp", "rust"):
        _require(port)
    return {port: importlib.import_module(f"twinattn._{port}") for port in ("cpp", "rust")}


def _problem(seed: int, b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int,
             dtype: Any = np.float32, strided: bool = False) -> dict[str, np.ndarray]:
    """q, k, v and dout from standard normals (rounded to dtype); strided: each a view of a
    (B, L, H, D) array, as transformers' layout gives them."""
    rng = np.random.default_rng(seed)

    def tensor(heads: int, length: int, width: int) -> np.ndarray:
        if strided:
            return rng.standard_normal((b, length, heads, width)).astype(dtype).swapaxes(1, 2)
        return rng.standard_normal((b, heads, length, width)).astype(dtype)

    return {"q": tensor(hq, lq, d), "k": tensor(hkv, lk, d), "v": tensor(hkv, lk, dv), "dout": tensor(hq, lq, dv)}


def _visible_scores(q: np.ndarray, k: np.ndarray, kw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """S (natural log units) of every (row, key) in float64, tanh of the softcap (or None), and
    which keys each row may see; S is -inf where it may not."""
    bsz, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    keys = np.repeat(k, hq // hkv, axis=1)
    scores = kw["scale"] * np.einsum("bhid,bhjd->bhij", q, keys)
    capped = None
    if kw.get("softcap"):
        capped = np.tanh(scores / kw["softcap"])
        scores = kw["softcap"] * capped
    offset = kw.get("q_offset", np.zeros(bsz, np.int64))
    position = (offset[:, None] + np.arange(lq)[None, :])[:, None, :, None]  # (B, 1, Lq, 1)
    key = np.arange(lk)[None, None, None, :]
    kv_lens = kw.get("kv_lens", np.full(bsz, lk, np.int64))
    visible = np.broadcast_to(key < kv_lens[:, None, None, None], scores.shape).copy()
    if kw.get("causal"):
        visible &= key <= position
    if kw.get("window_left", -1) >= 0:
        visible &= key >= position - kw["window_left"]
    if kw.get("window_right", -1) >= 0:
        visible &= key <= position + kw["window_right"]
    if kw.get("alibi_slopes") is not None:
        scores = scores - kw["alibi_slopes"].astype(np.float64)[:, :, None, None] * np.abs(position - key)
    mask = kw.get("mask")
    if mask is not None and mask.dtype == np.bool_:
        visible &= mask
    elif mask is not None:
        visible &= mask != -np.inf
        scores = scores + np.where(mask == -np.inf, 0.0, mask)
    return np.where(visible, scores, -np.inf), capped, visible


def _backward64(inputs: dict[str, np.ndarray], out: np.ndarray, kw: dict[str, Any]) -> dict[str, np.ndarray]:
    """The gradients in float64 (FlashAttention-2's formulas on exact P), and a bound on each
    element's float32 error: unit roundoff times sqrt(terms summed) plus the size of the scores
    and lse (P's relative error), times the element's sum of absolute terms."""
    q, k, v, dout = (inputs[name].astype(np.float64) for name in ("q", "k", "v", "dout"))
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    scores, capped, visible = _visible_scores(q, k, kw)
    sinks = kw.get("sinks")
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks.astype(np.float64)[None, :, None, None])
    top = np.where(np.isfinite(top), top, 0.0)
    total = np.exp(scores - top).sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.astype(np.float64)[None, :, None, None] - top)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + top  # -inf for a row with no legal key
    probs = np.where(visible, np.exp(scores - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    values = np.repeat(v, group, axis=1)
    keys = np.repeat(k, group, axis=1)
    # Drow from the out the kernel is given (its rounding is the forward's, not the backward's)
    delta = (dout * out.astype(np.float64)).sum(axis=-1)
    dprobs = np.einsum("bhic,bhjc->bhij", dout, values)
    dscores = probs * (dprobs - delta[..., None])
    dscores_abs = probs * (np.abs(dprobs) + np.abs(delta[..., None]))
    if capped is not None:
        dscores = dscores * (1.0 - capped**2)
        dscores_abs = dscores_abs * (1.0 - capped**2)
    scale = kw["scale"]

    def grouped(x: np.ndarray) -> np.ndarray:  # (B, Hq, ...) summed over each KV head's group
        return x.reshape(x.shape[0], hkv, group, *x.shape[2:]).sum(axis=2)

    grads = {
        "dq": scale * np.einsum("bhij,bhjd->bhid", dscores, keys),
        "dk": grouped(scale * np.einsum("bhij,bhid->bhjd", dscores, q)),
        "dv": grouped(np.einsum("bhij,bhic->bhjc", probs, dout)),
    }
    magnitudes = {
        "dq": abs(scale) * np.einsum("bhij,bhjd->bhid", dscores_abs, np.abs(keys)),
        "dk": grouped(abs(scale) * np.einsum("bhij,bhid->bhjd", dscores_abs, np.abs(q))),
        "dv": grouped(np.einsum("bhij,bhic->bhjc", probs, np.abs(dout))),
    }
    terms = {"dq": k.shape[2], "dk": q.shape[2] * group, "dv": q.shape[2] * group}
    finite_scores = np.abs(np.where(visible, scores, 0.0)).max(initial=0.0)
    size = 2.0 + finite_scores + np.abs(np.where(np.isfinite(lse), lse, 0.0)).max(initial=0.0)
    size += np.sqrt(max(q.shape[3], v.shape[3]))
    bounds = {name: 4.0 * UNIT_ROUNDOFF * (np.sqrt(terms[name]) + size) * magnitudes[name] for name in grads}
    if sinks is not None:
        sink_probs = np.exp(sinks.astype(np.float64)[None, :, None] - lse[..., 0])
        grads["dsinks"] = -(sink_probs * delta).sum(axis=(0, 2))
        bounds["dsinks"] = 4.0 * UNIT_ROUNDOFF * (np.sqrt(delta.shape[0] * delta.shape[2]) + size) * (
            sink_probs * np.abs(delta)).sum(axis=(0, 2))
    return {"grads": grads, "bounds": bounds, "magnitudes": magnitudes}


def _run(module: ModuleType, inputs: dict[str, np.ndarray], out: np.ndarray, lse: np.ndarray,
         kw: dict[str, Any], num_threads: int = 1) -> dict[str, np.ndarray]:
    """attention_backward of one port into NaN-filled gradients (so an element left unwritten
    shows)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    grads = {"dq": np.full(q.shape, np.nan, q.dtype), "dk": np.full(k.shape, np.nan, q.dtype),
             "dv": np.full(v.shape, np.nan, q.dtype)}
    extra = {}
    if kw.get("sinks") is not None:
        grads["dsinks"] = extra["dsinks"] = np.full(q.shape[1], np.nan, np.float32)
    module.attention_backward(q, k, v, out, inputs["dout"], lse, grads["dq"], grads["dk"], grads["dv"],
                              num_threads=num_threads, **kw, **extra)
    return grads


def _forward(ports: dict[str, ModuleType], inputs: dict[str, np.ndarray], kw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    q, v = inputs["q"], inputs["v"]
    out = np.zeros((*q.shape[:3], v.shape[3]), q.dtype)
    lse = np.zeros(q.shape[:3], np.float32)
    ports["cpp"].attention_forward(q, inputs["k"], v, out, lse=lse, **kw)
    return out, lse


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


B, HQ, HKV, LQ, LK, D, DV = 2, 4, 2, 5, 7, 8, 6
RNG = np.random.default_rng(5)
_BOOL_MASK = RNG.random((B, HQ, LQ, LK)) < 0.7
_BOOL_MASK[1, 2, 3, :] = False  # a row with no visible key
_FLOAT_MASK = np.where(RNG.random((B, HQ, LQ, LK)) < 0.25, -np.inf, RNG.standard_normal((B, HQ, LQ, LK))).astype(np.float32)
_FLOAT_MASK[0, 1, 4, :] = -np.inf
_SLOPES = np.array([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.7]], np.float32)
_SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)

# (id, keyword arguments of both passes) on the small problem (B, Hq, Hkv, Lq, Lk, D, Dv above)
SMALL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("causal_offset", dict(causal=True, q_offset=np.array([2, 0], np.int64))),
    ("kv_lens", dict(kv_lens=np.array([7, 3], np.int64))),
    ("kv_len_zero", dict(kv_lens=np.array([0, 5], np.int64))),
    ("causal_row_sees_nothing", dict(causal=True, q_offset=np.array([0, 0], np.int64), kv_lens=np.array([7, 0], np.int64))),
    ("window", dict(window_left=2, window_right=1, q_offset=np.array([1, 3], np.int64))),
    ("softcap", dict(softcap=2.5)),
    ("alibi", dict(alibi_slopes=_SLOPES, q_offset=np.array([1, 2], np.int64))),
    ("sinks", dict(sinks=_SINKS)),
    ("sinks_causal_kv_lens", dict(sinks=_SINKS, causal=True, kv_lens=np.array([4, 0], np.int64))),
    ("bool_mask", dict(mask=_BOOL_MASK)),
    ("float_mask", dict(mask=_FLOAT_MASK)),
    ("everything", dict(causal=True, q_offset=np.array([2, 1], np.int64), kv_lens=np.array([6, 5], np.int64),
                        window_left=3, softcap=4.0, alibi_slopes=_SLOPES, sinks=_SINKS, mask=_FLOAT_MASK)),
]


def _check(ports: dict[str, ModuleType], inputs: dict[str, np.ndarray], kw: dict[str, Any],
           num_threads: int = 1) -> dict[str, np.ndarray]:
    out, lse = _forward(ports, inputs, kw)
    got = {port: _run(module, inputs, out, lse, kw, num_threads) for port, module in ports.items()}
    # (a) the ports agree bit for bit
    for name in got["cpp"]:
        assert np.array_equal(_bits(got["cpp"][name]), _bits(got["rust"][name])), name
    # (b) the float64 backward, within float32's error and the dtype's one rounding
    want = _backward64(inputs, out, kw)
    half_ulp = HALF_ULP[inputs["q"].dtype]
    for name, grad in got["cpp"].items():
        reference = want["grads"][name]
        bound = want["bounds"][name] + half_ulp * np.abs(reference)
        if half_ulp:
            bound = bound + np.finfo(inputs["q"].dtype).smallest_subnormal
        error = np.abs(grad.astype(np.float64) - reference)
        # (c) every element written: NaN-filled arrays come back finite
        assert np.isfinite(grad).all(), name
        assert (error <= bound).all(), (name, float((error / np.maximum(bound, 1e-300)).max()))
    return got["cpp"]


@pytest.mark.parametrize(("case", "kw"), SMALL_CASES, ids=[case for case, _ in SMALL_CASES])
def test_small_problems_match_float64_and_agree_bitwise(ports: dict[str, ModuleType], case: str, kw: dict[str, Any]) -> None:
    kw = {"scale": 0.4, **kw}
    grads = _check(ports, _problem(1, B, HQ, HKV, LQ, LK, D, DV), kw)
    if case == "kv_lens":  # keys past kv_lens get zero gradients
        assert not grads["dk"][1, :, 3:].any() and not grads["dv"][1, :, 3:].any()
    if case == "bool_mask":  # a row with no visible key gets a zero dq
        assert not grads["dq"][1, 2, 3].any()


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(("case", "kw"), [SMALL_CASES[1], SMALL_CASES[-1]], ids=["causal_offset", "everything"])
def test_half_precision(ports: dict[str, ModuleType], dtype: Any, case: str, kw: dict[str, Any]) -> None:
    _check(ports, _problem(2, B, HQ, HKV, LQ, LK, D, DV, dtype=dtype), {"scale": 0.4, **kw})


@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize(
    ("case", "kw"),
    [("causal", dict(causal=True, q_offset=np.array([80, 0], np.int64))),
     ("window_kv_lens", dict(window_left=40, window_right=9, kv_lens=np.array([150, 97], np.int64))),
     ("softcap_alibi_sinks", dict(softcap=5.0, causal=True, alibi_slopes=np.full((2, 8), 0.05, np.float32),
                                  sinks=np.linspace(-1, 1, 8).astype(np.float32)))],
    ids=["causal", "window_kv_lens", "softcap_alibi_sinks"])
def test_several_tiles_and_key_blocks(ports: dict[str, ModuleType], num_threads: int, case: str, kw: dict[str, Any]) -> None:
    """GQA 8/2 over 70 positions (280 packed rows: 6 query tiles) and 150 keys (3 key blocks),
    strided inputs; the result does not depend on the thread count (3 threads run passes 2 and 3 on
    its 4 (sequence, KV head) pairs, 1 thread the fused pass: the same bits)."""
    inputs = _problem(3, 2, 8, 2, 70, 150, 20, 12, strided=True)
    kw = {"scale": 0.2, **kw}
    grads = _check(ports, inputs, kw, num_threads)
    if num_threads > 1:
        out, lse = _forward(ports, inputs, kw)
        serial = _run(ports["rust"], inputs, out, lse, kw, 1)
        for name, grad in grads.items():
            assert np.array_equal(_bits(grad), _bits(serial[name])), name


# the instruction sets a build for this machine's architecture may offer (the backward's inner
# products are each one's own kernels)
ISAS = ("scalar", "neon") if platform.machine().lower() in ("aarch64", "arm64") else (
    "scalar", "avx2", "avx512", "avx512bf16")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("case", "kw"),
    [("causal", dict(causal=True, q_offset=np.array([60, 0], np.int64))),
     ("everything", dict(causal=True, q_offset=np.array([70, 40], np.int64), kv_lens=np.array([130, 111], np.int64),
                         window_left=90, softcap=6.0, alibi_slopes=np.full((2, 4), 0.02, np.float32),
                         sinks=np.linspace(-1, 1, 4).astype(np.float32)))],
    ids=["causal", "everything"])
def test_every_isa_matches_float64_and_agrees_bitwise(ports: dict[str, ModuleType], isa: str, case: str,
                                                      kw: dict[str, Any]) -> None:
    """Both ports forced to each instruction set: the same bits, within the float64 bound.
    Two sequences, GQA 4/2 over 71 positions (142 packed rows: query tiles of 48, the last one 46 rows, not a
    whole micro-kernel strip) and 150 keys (key blocks of 64, the last one 22 keys); D = 136 and
    Dv = 120 leave every chunk size and a tail of the kernels' vectors."""
    inputs = _problem(9, 2, 4, 2, 71, 150, 136, 120)
    kw = {"scale": 0.1, **kw}
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        _check(ports, inputs, kw, num_threads=2)


def test_keys_past_kv_lens_never_read(ports: dict[str, ModuleType]) -> None:
    """NaN in the keys and values past kv_lens changes no bit of any gradient, and those keys'
    dk and dv are 0."""
    kw = dict(scale=0.4, causal=True, q_offset=np.array([3, 1], np.int64), kv_lens=np.array([5, 2], np.int64))
    clean = _problem(6, B, HQ, HKV, LQ, LK, D, DV)
    poisoned = {name: array.copy() for name, array in clean.items()}
    for b, kv_len in enumerate(kw["kv_lens"]):
        poisoned["k"][b, :, kv_len:] = np.nan
        poisoned["v"][b, :, kv_len:] = np.nan
    out, lse = _forward(ports, clean, kw)
    for module in ports.values():
        want = _run(module, clean, out, lse, kw)
        got = _run(module, poisoned, out, lse, kw)
        for name in want:
            assert np.array_equal(_bits(got[name]), _bits(want[name])), name
        assert not got["dk"][0, :, 5:].any() and not got["dv"][1, :, 2:].any()


def test_strided_gradients_same_bits(ports: dict[str, ModuleType]) -> None:
    """dq, dk, dv and dsinks written through views with other strides give the same bits."""
    kw = dict(scale=0.4, causal=True, sinks=_SINKS)
    inputs = _problem(7, B, HQ, HKV, LQ, LK, D, DV)
    out, lse = _forward(ports, inputs, kw)
    for module in ports.values():
        want = _run(module, inputs, out, lse, kw)
        grads = {"dq": np.full((B, LQ, HQ, D), np.nan, np.float32).swapaxes(1, 2),
                 "dk": np.full((HKV, B, LK, D), np.nan, np.float32).swapaxes(0, 1),
                 "dv": np.full((B, HKV, LK + 3, DV), np.nan, np.float32)[:, :, ::-1][:, :, :LK],
                 "dsinks": np.full(2 * HQ, np.nan, np.float32)[::2]}
        module.attention_backward(inputs["q"], inputs["k"], inputs["v"], out, inputs["dout"], lse,
                                  grads["dq"], grads["dk"], grads["dv"], dsinks=grads["dsinks"], **kw)
        for name in want:
            assert np.array_equal(_bits(np.ascontiguousarray(grads[name])), _bits(want[name])), name


def test_no_query_rows_zero_key_gradients(ports: dict[str, ModuleType]) -> None:
    """Lq = 0: no row sees any key, so dk and dv are all written as 0 (and dsinks 0)."""
    kw = dict(scale=0.4, sinks=_SINKS)
    inputs = _problem(8, B, HQ, HKV, 0, LK, D, DV)
    out = np.zeros((B, HQ, 0, DV), np.float32)
    lse = np.zeros((B, HQ, 0), np.float32)
    for module in ports.values():
        grads = _run(module, inputs, out, lse, kw)
        assert grads["dq"].size == 0
        for name in ("dk", "dv", "dsinks"):
            assert np.array_equal(grads[name], np.zeros_like(grads[name])), name


# ---- The bfloat16 tile path (avx512bf16, amxbf16) ---------------------------------------------
# bfloat16 with D a multiple of 32 on avx512bf16 and amxbf16: the five products on bfloat16 pairs
# (VDPBF16PS, or AMX tiles), P and scale dS rounded to bfloat16 (docs/kernels.md, "Backward").
# Each term then carries up to one bfloat16 rounding (2^-8 of itself) on top of float32's error,
# so an element is within 2^-8 of its sum of absolute terms beyond the float32 bound, plus the
# dtype's one rounding of the result.
BF16_ROUNDOFF = 2.0**-8
TILE_ISAS = ("avx512bf16", "amxbf16")

TILE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("causal", dict(causal=True, q_offset=np.array([80, 0], np.int64))),
    ("everything", dict(causal=True, q_offset=np.array([70, 40], np.int64), kv_lens=np.array([150, 111], np.int64),
                        window_left=90, softcap=6.0, alibi_slopes=np.full((2, 8), 0.02, np.float32),
                        sinks=np.linspace(-1, 1, 8).astype(np.float32))),
    ("bool_mask", dict(mask=np.random.default_rng(10).random((2, 8, 70, 150)) < 0.8,
                       kv_lens=np.array([150, 0], np.int64))),
    ("float_mask", dict(mask=np.broadcast_to(np.where(
        np.random.default_rng(11).random((2, 1, 70, 150)) < 0.3, -np.inf,
        np.random.default_rng(12).standard_normal((2, 1, 70, 150))).astype(np.float32), (2, 8, 70, 150)))),
]


def _tile_problem(seed: int) -> dict[str, np.ndarray]:
    """GQA 8/2 over 70 positions: 280 packed rows, query tiles of 96 (the last one 88 rows, not a
    whole pair chunk); 150 keys: key blocks of 64 (the last one 22 keys); D = 64, Dv = 32;
    strided, as transformers' layout gives them."""
    return _problem(seed, 2, 8, 2, 70, 150, 64, 32, dtype=BF16, strided=True)


def _tile_check(ports: dict[str, ModuleType], isa: str, inputs: dict[str, np.ndarray], kw: dict[str, Any],
                reference: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Both ports on isa (a tile path's), 1 and 3 threads: the same bits everywhere, every
    element written and finite, within the tile path's bound of the float64 backward (of
    `reference`'s inputs when given: the same function)."""
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        out, lse = _forward(ports, reference or inputs, kw)
        got = {(port, threads): _run(module, inputs, out, lse, kw, threads)
               for port, module in ports.items() for threads in (1, 3)}
    first = got["cpp", 1]
    for key, grads in got.items():
        for name in first:
            assert np.array_equal(_bits(grads[name]), _bits(first[name])), (key, name)
    want = _backward64(reference or inputs, out, kw)
    for name, grad in first.items():
        assert np.isfinite(grad).all(), name
        reference_grad = want["grads"][name]
        bound = (want["bounds"][name] + HALF_ULP[BF16] * np.abs(reference_grad)
                 + np.finfo(BF16).smallest_subnormal)
        if name in want["magnitudes"]:
            bound = bound + BF16_ROUNDOFF * want["magnitudes"][name]
        error = np.abs(grad.astype(np.float64) - reference_grad)
        assert (error <= bound).all(), (name, float((error / bound).max()))
    return first


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize(("case", "kw"), TILE_CASES, ids=[case for case, _ in TILE_CASES])
def test_bf16_tile_path_agrees_bitwise_across_ports_and_threads(ports: dict[str, ModuleType], case: str,
                                                                kw: dict[str, Any], isa: str) -> None:
    grads = _tile_check(ports, isa, _tile_problem(13), {"scale": 0.125, **kw})
    if case == "bool_mask":  # sequence 1 has no key: zero gradients
        assert not grads["dq"][1].any() and not grads["dk"][1].any() and not grads["dv"][1].any()


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_bf16_tile_path_pads_value_columns(ports: dict[str, ModuleType], isa: str) -> None:
    """Dv = 33: V and dO padded to 64 columns of zeros on the pairs, the same rules."""
    inputs = _problem(17, 2, 8, 2, 70, 150, 64, 33, dtype=BF16, strided=True)
    _tile_check(ports, isa, inputs, dict(scale=0.125, causal=True, q_offset=np.array([80, 0], np.int64),
                                    kv_lens=np.array([150, 120], np.int64)))


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_bf16_tile_path_taken_where_documented(ports: dict[str, ModuleType], isa: str) -> None:
    """A tile path's instruction set runs bfloat16 with D a multiple of 32 on bfloat16 pairs
    (bits unlike avx512's float32 products), and anything else as avx512 does (the same bits:
    the backward alone, from one forward's out and lse)."""
    kw = dict(scale=0.125, causal=True, q_offset=np.array([80, 0], np.int64))
    problems = {"tiles": _tile_problem(14),
                "d_40": _problem(14, 2, 8, 2, 70, 150, 40, 32, dtype=BF16),
                "float32": _problem(14, 2, 8, 2, 70, 150, 64, 32)}
    for name, inputs in problems.items():
        for port, module in ports.items():
            with forced_isa("cpp", "avx512"):
                out, lse = _forward(ports, inputs, kw)
            grads = {}
            for run_isa in (isa, "avx512"):
                with forced_isa(port, run_isa):
                    grads[run_isa] = _run(module, inputs, out, lse, kw)
            same = all(np.array_equal(_bits(grads[isa][g]), _bits(grads["avx512"][g])) for g in grads[isa])
            assert same == (name != "tiles"), (name, port)


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_bf16_tile_path_never_reads_hidden_keys(ports: dict[str, ModuleType], isa: str) -> None:
    """NaN in K and V rows that no query row sees (a bool mask hides them from every row; causal
    hides the last keys below kv_lens) gives finite gradients within the bound of the clean
    problem's, and those keys' dk and dv are 0."""
    clean = _tile_problem(15)
    mask = np.random.default_rng(16).random((2, 1, 70, 150)) < 0.8
    hidden = np.zeros(150, bool)
    hidden[[3, 64, 65, 100]] = True
    mask[:, :, :, hidden] = False
    kw = dict(scale=0.125, causal=True, q_offset=np.array([60, 70], np.int64),
              mask=np.broadcast_to(mask, (2, 8, 70, 150)))
    poisoned = {name: array.copy() for name, array in clean.items()}
    for name in ("k", "v"):
        poisoned[name][:, :, hidden] = np.nan
        poisoned[name][0, :, 131:] = np.inf  # past sequence 0's last position (60 + 69)
    grads = _tile_check(ports, isa, poisoned, kw, reference=clean)
    assert not grads["dk"][:, :, hidden].any() and not grads["dv"][:, :, hidden].any()
    assert not grads["dk"][0, :, 131:].any() and not grads["dv"][0, :, 131:].any()


# ---- Bad input: the same exception and message from both ports ---------------------------------

_IN = _problem(4, B, HQ, HKV, LQ, LK, D, DV)
_OUT = np.zeros((B, HQ, LQ, DV), np.float32)
_LSE = np.zeros((B, HQ, LQ), np.float32)


def _bad_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(q=_IN["q"], k=_IN["k"], v=_IN["v"], out=_OUT, dout=_IN["dout"], lse=_LSE,
                                dq=np.zeros((B, HQ, LQ, D), np.float32), dk=np.zeros((B, HKV, LK, D), np.float32),
                                dv=np.zeros((B, HKV, LK, DV), np.float32), scale=0.5)
    args.update(overrides)
    return args


_read_only = np.zeros((B, HQ, LQ, D), np.float32)
_read_only.flags.writeable = False
_q_writeable = _IN["q"].copy()
_int8_k = np.zeros((B, HKV, LK, D), np.int8)
_int8_v = np.zeros((B, HKV, LK, DV), np.int8)

BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("dq_shape", dict(dq=np.zeros((B, HQ, LQ, D + 1), np.float32)), ValueError,
     "dq: expected shape (B=2, Hq=4, Lq=5, D=8), got (2, 4, 5, 9)"),
    ("dk_shape", dict(dk=np.zeros((B, HQ, LK, D), np.float32)), ValueError,
     "dk: expected shape (B=2, Hkv=2, Lk=7, D=8), got (2, 4, 7, 8)"),
    ("dout_shape", dict(dout=np.zeros((B, HQ, LQ, D), np.float32)), ValueError,
     "dout: expected shape (B=2, Hq=4, Lq=5, Dv=6), got (2, 4, 5, 8)"),
    ("dv_dtype", dict(dv=np.zeros((B, HKV, LK, DV), np.float64)), TypeError,
     "dv: expected dtype float32 (q's dtype), got float64"),
    ("dq_rank", dict(dq=np.zeros((B, HQ, LQ), np.float32)), ValueError,
     "dq: expected 4 dimensions (B, Hq, Lq, D), got shape (2, 4, 5)"),
    ("dq_read_only", dict(dq=_read_only), ValueError, "dq: expected a writeable array, got a read-only one"),
    ("dq_not_array", dict(dq=[0.0]), TypeError, "dq: expected a numpy.ndarray, got list"),
    ("int8", dict(k=_int8_k, v=_int8_v), ValueError,
     "k: expected q's dtype, got int8 (int8 keys and values carry no gradient)"),
    ("lse_none", dict(lse=None), ValueError, "lse: required (the forward's lse, float32, shape (B, Hq, Lq)), got None"),
    ("lse_shape", dict(lse=np.zeros((B, HQ, LQ + 1), np.float32)), ValueError,
     "lse: expected shape (B=2, Hq=4, Lq=5), got (2, 4, 6)"),
    ("dsinks_without_sinks", dict(dsinks=np.zeros(HQ, np.float32)), ValueError,
     "dsinks: expected None without sinks (it is the sinks' gradient), got an array"),
    ("dsinks_shape", dict(sinks=_SINKS, dsinks=np.zeros(HQ + 1, np.float32)), ValueError,
     "dsinks: expected shape (Hq=4,), got (5,)"),
    ("dq_is_q", dict(q=_q_writeable, dq=_q_writeable), ValueError,
     "dq: expected memory disjoint from q, got arrays that overlap"),
    ("dk_is_dq", dict(k=_IN["q"][:, :2, :, :].copy(), v=np.zeros((B, 2, LQ, DV), np.float32),
                      dq=_q_writeable.copy(), dk=None, dv=np.zeros((B, 2, LQ, DV), np.float32)), ValueError,
     "dk: expected memory disjoint from dq, got arrays that overlap"),
    ("dv_shape", dict(dv=np.zeros((B, HQ, LQ, DV), np.float32)), ValueError,
     "dv: expected shape (B=2, Hkv=2, Lk=7, Dv=6), got (2, 4, 5, 6)"),
    ("num_threads", dict(num_threads=0), ValueError, "num_threads: expected an int >= 1, got 0"),
    ("scale_type", dict(scale="x"), TypeError, "scale: expected a float, got str"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), [case[1:] for case in BAD_CALLS],
                         ids=[case[0] for case in BAD_CALLS])
def test_bad_backward_call_same_error_in_both_ports(ports: dict[str, ModuleType], overrides: dict[str, Any],
                                                    error: type[Exception], message: str) -> None:
    for module in ports.values():
        args = _bad_args(**overrides)
        if "dk" in overrides and overrides["dk"] is None:  # dk over dq's memory
            args["dk"] = args["dq"][:, :2]
        with pytest.raises(error) as raised:
            module.attention_backward(**args)
        assert str(raised.value) == message


# ---- A training step's float32 out (out32) and lse's gradient (dlse) ---------------------------
# attention_forward(..., out32=) writes out before its rounding beside out (float16 / bfloat16);
# attention_backward takes it as out (Drow from it) and folds dlse into Drow natively
# (docs/native_api.md).

def _forward_out32(module: ModuleType, inputs: dict[str, np.ndarray], kw: dict[str, Any], num_threads: int = 1,
                   kernel: str = "attention_forward") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """out, lse and out32 of one port's forward (or reference kernel), from NaN-filled arrays."""
    q, v = inputs["q"], inputs["v"]
    out = np.full((*q.shape[:3], v.shape[3]), np.nan, q.dtype)
    out32 = np.full(out.shape, np.nan, np.float32)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    getattr(module, kernel)(q, inputs["k"], v, out, lse=lse, out32=out32, num_threads=num_threads, **kw)
    return out, lse, out32


# prefill (packed rows past one query tile: the pair paths on avx512bf16 and amxbf16, D = 64 and
# D = 40 for the tiles and the dot products), decode (one row against many keys, split across
# threads and merged) and a small problem with the variants
OUT32_CASES: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("prefill_causal", (2, 8, 2, 70, 150, 64, 32), dict(causal=True, q_offset=np.array([80, 0], np.int64))),
    ("prefill_d40_window", (2, 8, 2, 70, 150, 40, 24), dict(causal=True, window_left=5, q_offset=np.array([80, 3], np.int64))),
    ("decode", (2, 8, 2, 1, 3000, 64, 32), dict(kv_lens=np.array([3000, 1700], np.int64))),
    ("small_everything", (B, HQ, HKV, LQ, LK, D, DV), SMALL_CASES[-1][1]),
]


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(("case", "shape", "kw"), OUT32_CASES, ids=[case[0] for case in OUT32_CASES])
def test_forward_out32_is_out_before_rounding(ports: dict[str, ModuleType], dtype: Any, case: str,
                                              shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    """out and lse keep their bits with out32 requested; out32 rounds to out (float16), or stays
    within out's own P rounding of it (bfloat16: the pair paths add P.V's remainder pairs to out32
    only); both ports and the reference kernel write it (the same bits between the ports), within
    float32's error of the float64 output."""
    inputs = _problem(21, *shape, dtype=dtype)
    kw = {"scale": 0.2, **kw}
    plain_out, plain_lse = _forward(ports, inputs, {**kw, "num_threads": 2})
    got = {port: _forward_out32(module, inputs, kw, num_threads=2) for port, module in ports.items()}
    for port, (out, lse, out32) in got.items():
        assert np.array_equal(_bits(out), _bits(plain_out)) and np.array_equal(_bits(lse), _bits(plain_lse)), port
        if dtype == np.float16:
            assert np.array_equal(_bits(out32.astype(dtype)), _bits(out)), port
        apart = np.abs(out32.astype(np.float64) - out.astype(np.float64))
        bound = HALF_ULP[np.dtype(dtype)] * np.abs(out.astype(np.float64)) + 2.0**-9 * np.abs(inputs["v"]).max()
        assert (apart <= bound).all(), port
    assert np.array_equal(_bits(got["cpp"][2]), _bits(got["rust"][2]))
    out32 = got["cpp"][2]
    assert not np.array_equal(out32, plain_out.astype(np.float32))  # more than out widened
    q, k, v = (inputs[name].astype(np.float32) for name in ("q", "k", "v"))
    exact = np.zeros(out32.shape, np.float32)
    ports["cpp"].attention_reference(q, k, v, exact, **kw)
    values = np.abs(v).max()
    assert np.abs(out32 - exact).max() <= 2.0**-14 * values, float(np.abs(out32 - exact).max())
    for port, module in ports.items():
        ref_out, _, ref_out32 = _forward_out32(module, inputs, kw, kernel="attention_reference")
        assert np.array_equal(_bits(ref_out32.astype(dtype)), _bits(ref_out)), port
        assert np.abs(ref_out32 - exact).max() <= 2.0**-20 * values, port


def _with_column(a: np.ndarray, column: np.ndarray) -> np.ndarray:
    return np.concatenate([a, column[..., None].astype(a.dtype)], axis=-1)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_dlse_folded_natively_equals_the_value_column(ports: dict[str, ModuleType], dtype: Any) -> None:
    """dlse folded into Drow natively: the same bits in both ports, and within float32's error of
    the same gradients by one more value column (0 in v, 1 in dout, -dlse in out), which moves
    Drow alike; dlse = 0 gives the bits of no dlse. For bfloat16, out is the forward's out32."""
    kw = dict(scale=0.2, causal=True, q_offset=np.array([80, 0], np.int64), sinks=np.linspace(-1, 1, 8).astype(np.float32))
    inputs = _problem(22, 2, 8, 2, 70, 150, 64, 32, dtype=dtype)
    if dtype == np.float32:
        out, lse = _forward(ports, inputs, kw)
    else:
        _, lse, out = _forward_out32(ports["cpp"], inputs, kw)
    dlse = np.random.default_rng(23).standard_normal(lse.shape).astype(np.float32)
    got = {}
    for port, module in ports.items():
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        grads = {"dq": np.full(q.shape, np.nan, q.dtype), "dk": np.full(k.shape, np.nan, q.dtype),
                 "dv": np.full(v.shape, np.nan, q.dtype), "dsinks": np.full(8, np.nan, np.float32)}
        module.attention_backward(q, k, v, out, inputs["dout"], lse, grads["dq"], grads["dk"], grads["dv"],
                                  dsinks=grads["dsinks"], dlse=dlse, **kw)
        got[port] = grads
        zero = _run(module, inputs, out, lse, {**kw, "dlse": np.zeros_like(dlse)})
        plain = _run(module, inputs, out, lse, kw)
        for name in plain:
            assert np.array_equal(_bits(zero[name]), _bits(plain[name])), (port, name)
    for name in got["cpp"]:
        assert np.array_equal(_bits(got["cpp"][name]), _bits(got["rust"][name])), name
    columns = {"q": inputs["q"], "k": inputs["k"], "v": _with_column(inputs["v"], np.zeros(inputs["v"].shape[:3])),
               "dout": _with_column(inputs["dout"], np.ones(inputs["dout"].shape[:3]))}
    column = _run(ports["cpp"], columns, _with_column(out, -dlse), lse, kw)
    column["dv"] = column["dv"][..., :-1]
    want = _backward64(inputs, out, kw)
    for name, grad in got["cpp"].items():
        reference = column[name].astype(np.float64)
        bound = (want["bounds"].get(name, 0.0) + 2 * HALF_ULP[np.dtype(dtype)] * np.abs(reference)
                 + 2.0**-20 * np.abs(reference).max())
        assert (np.abs(grad.astype(np.float64) - reference) <= bound).all(), name


_HALF_IN = _problem(4, B, HQ, HKV, LQ, LK, D, DV, dtype=BF16)
_big = np.zeros(B * HQ * LQ * DV, np.float32)

OUT32_BAD_CALLS: list[tuple[str, str, dict[str, Any], type[Exception], str]] = [
    ("out32_float32_problem", "attention_forward", dict(out32=np.zeros((B, HQ, LQ, DV), np.float32)), ValueError,
     "out32: expected None for a float32 problem (out is float32 already), got an array"),
    ("out32_shape", "attention_forward", dict(q=_HALF_IN["q"], k=_HALF_IN["k"], v=_HALF_IN["v"],
                                              out=np.zeros((B, HQ, LQ, DV), BF16),
                                              out32=np.zeros((B, HQ, LQ, DV + 1), np.float32)), ValueError,
     "out32: expected shape (B=2, Hq=4, Lq=5, Dv=6), got (2, 4, 5, 7)"),
    ("out32_dtype", "attention_forward", dict(q=_HALF_IN["q"], k=_HALF_IN["k"], v=_HALF_IN["v"],
                                              out=np.zeros((B, HQ, LQ, DV), BF16),
                                              out32=np.zeros((B, HQ, LQ, DV), np.float16)), TypeError,
     "out32: expected dtype float32, got float16"),
    ("out32_read_only", "attention_forward", dict(q=_HALF_IN["q"], k=_HALF_IN["k"], v=_HALF_IN["v"],
                                                  out=np.zeros((B, HQ, LQ, DV), BF16),
                                                  out32=np.zeros((B, HQ, LQ, DV), np.float32)), ValueError,
     "out32: expected a writeable array, got a read-only one"),
    ("out32_over_lse", "attention_forward", dict(q=_HALF_IN["q"], k=_HALF_IN["k"], v=_HALF_IN["v"],
                                                 out=np.zeros((B, HQ, LQ, DV), BF16), out32=_big.reshape(B, HQ, LQ, DV),
                                                 lse=_big[:B * HQ * LQ].reshape(B, HQ, LQ)), ValueError,
     "out32: expected memory disjoint from lse, got arrays that overlap"),
    ("out_dtype_half", "attention_backward", dict(q=_HALF_IN["q"], k=_HALF_IN["k"], v=_HALF_IN["v"],
                                                  out=np.zeros((B, HQ, LQ, DV), np.float16), dout=_HALF_IN["dout"],
                                                  dq=np.zeros((B, HQ, LQ, D), BF16), dk=np.zeros((B, HKV, LK, D), BF16),
                                                  dv=np.zeros((B, HKV, LK, DV), BF16)), TypeError,
     "out: expected dtype bfloat16 (q's dtype) or float32 (the forward's out32), got float16"),
    ("out_dtype_float32_problem", "attention_backward", dict(out=np.zeros((B, HQ, LQ, DV), np.float64)), TypeError,
     "out: expected dtype float32 (q's dtype), got float64"),
    ("dlse_shape", "attention_backward", dict(dlse=np.zeros((B, HQ, LQ + 1), np.float32)), ValueError,
     "dlse: expected shape (B=2, Hq=4, Lq=5), got (2, 4, 6)"),
    ("dlse_dtype", "attention_backward", dict(dlse=np.zeros((B, HQ, LQ), np.float64)), TypeError,
     "dlse: expected dtype float32, got float64"),
    ("dq_over_dlse", "attention_backward", dict(dlse=None), ValueError,
     "dq: expected memory disjoint from dlse, got arrays that overlap"),
]


@pytest.mark.parametrize(("entry", "overrides", "error", "message"), [case[1:] for case in OUT32_BAD_CALLS],
                         ids=[case[0] for case in OUT32_BAD_CALLS])
def test_bad_out32_or_dlse_same_error_in_both_ports(ports: dict[str, ModuleType], entry: str, overrides: dict[str, Any],
                                                    error: type[Exception], message: str) -> None:
    for module in ports.values():
        args = _bad_args(**overrides)
        if entry == "attention_forward":
            for name in ("dout", "dq", "dk", "dv"):
                del args[name]
        if "dlse" in overrides and overrides["dlse"] is None:  # dlse over dq's memory
            args["dlse"] = args["dq"].reshape(-1)[:B * HQ * LQ].reshape(B, HQ, LQ)
        if message.endswith("read-only one"):
            args["out32"].flags.writeable = False
        with pytest.raises(error) as raised:
            getattr(module, entry)(**args)
        assert str(raised.value) == message


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def _reset_peak_rss() -> None:
    """VmHWM back to the current resident size (Linux's /proc/self/clear_refs), after the memory
    the allocator holds free goes back to the system (glibc's malloc_trim), so that what a call
    allocates shows as growth even where earlier tests' freed memory would have served it; skips
    elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except (OSError, AttributeError):
        pytest.skip("needs Linux's /proc/self/clear_refs and glibc's malloc_trim to measure the peak resident size")


@pytest.mark.parametrize("port", ["cpp", "rust"])
def test_forward_packs_its_panels_in_waves_not_per_call(ports: dict[str, ModuleType], port: str) -> None:
    """A prefill packs the K^T and V panels of as many (b, KV head) groups as fit in
    prefill_pack_bytes, runs their tiles, then packs the next: a call whose every head's panels
    would take 32 MiB (8 KV heads, 4096 keys, D = Dv = 128, float32) grows the peak resident memory
    by about one wave's. The call runs on a new thread, whose packed buffers (kept per calling
    thread across calls) start empty; its result is the reference's."""
    budget = ports[port].build_info()["constants"]["prefill_pack_bytes"] / 2**20
    inputs = _problem(12, 1, 8, 8, 4096, 4096, 128, 128)
    panels = 2 * inputs["k"].nbytes / 2**20  # K^T and V panels of every head, float32
    assert panels >= budget + 12
    out = np.full(inputs["q"].shape, np.nan, np.float32)  # written now, not in the call
    grown: list[float] = []

    def forward() -> None:
        _reset_peak_rss()
        before = _peak_rss_mib()
        ports[port].attention_forward(inputs["q"], inputs["k"], inputs["v"], out, scale=0.125, causal=True,
                                      num_threads=1)
        grown.append(_peak_rss_mib() - before)

    _reset_peak_rss()  # (skips where it cannot)
    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert grown and grown[0] < budget + 6, (
        f"peak resident memory grew {grown[0]:.1f} MiB in the forward (waves of {budget:.0f} MiB; "
        f"every head's panels: {panels:.0f} MiB)")
    rows = slice(0, 4096, 311)  # a few rows of each head against the float64 reference
    q, k, v = (inputs[name].astype(np.float64) for name in ("q", "k", "v"))
    scores = 0.125 * np.einsum("bhid,bhjd->bhij", q[:, :, rows], k)
    scores = np.where(np.arange(4096)[None, :] > np.arange(4096)[rows][:, None], -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhij,bhjd->bhid", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out[:, :, rows], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("port", ["cpp", "rust"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_fused_pass_keeps_per_thread_memory_not_per_call(ports: dict[str, ModuleType], port: str,
                                                         dtype: np.dtype) -> None:
    """The fused pass (one thread) packs a head's keys and a chunk of its rows at a time into the
    thread's scratch: float32 copies (the fused float32 pass, and bfloat16 without the tile path)
    or bfloat16 pairs and their transposes (the tile path) of the whole call's K, V, Q and dO would
    take 35 MiB or more (16 query heads on 2 KV heads, 4096 positions, D = 64); the backward grows
    the peak resident memory by far less than that beyond its (already written) gradients."""
    _reset_peak_rss()
    inputs = _problem(11, 1, 16, 2, 4096, 4096, 64, 64, dtype=dtype)
    kw = {"scale": 0.125, "causal": True}
    out, lse = _forward(ports, inputs, kw)
    grads = {name: np.ones(inputs[of].shape, dtype) for name, of in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    q_bytes, k_bytes = inputs["q"].nbytes, inputs["k"].nbytes
    # what pass 0 would pack per call: Q, Q scaled, dO and K, K^T, V^T in float32; in pairs, Q, dO
    # and their transposes, and K, K rows, V
    copies = (3 * (q_bytes + k_bytes) if dtype == np.float32 else 4 * q_bytes + 3 * k_bytes) / 2**20
    assert copies >= 35
    _reset_peak_rss()
    before = _peak_rss_mib()
    ports[port].attention_backward(inputs["q"], inputs["k"], inputs["v"], out, inputs["dout"], lse, grads["dq"],
                                   grads["dk"], grads["dv"], num_threads=1, **kw)
    grown = _peak_rss_mib() - before
    assert grown < 12, f"peak resident memory grew {grown:.1f} MiB in the backward (per-call copies: {copies:.0f} MiB)"
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads.values())
