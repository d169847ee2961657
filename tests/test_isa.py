"""Every instruction-set path of both native ports against the float64 reference and against
each port's plain reference kernel; the two ports against each other.

The fast kernels tile queries (kQTileRows packed rows, kMicroRows micro-kernel rows) and keys
(kKeyBlock, kSplitKeyChunk for decode); the sizes below sit just below, at and above those
boundaries. Tolerances: see helpers.py (a multiple of the error float32 arithmetic makes on the
same problem, plus a few units of roundoff).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import twinattn
from conftest import _require
from helpers import (
    BFLOAT16, FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF, assert_close_to_reference, assert_half_close_to_reference,
    assert_lse_close, forced_isa, rand, reference32, reference64,
)

# the instruction sets a build for this machine's architecture may offer
ISAS = ("scalar", "neon") if platform.machine().lower() in ("aarch64", "arm64") else ("scalar", "avx2", "avx512")


def _module(port: str) -> ModuleType:
    return importlib.import_module(f"twinattn._{port}")


@pytest.fixture(params=[(port, isa) for port in ("cpp", "rust") for isa in ISAS], ids=lambda p: f"{p[0]}-{p[1]}")
def port_isa(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    port, isa = request.param
    _require(port)
    with forced_isa(port, isa):
        yield port, isa


# (B, Hq, Hkv, Lq, Lk, D, Dv) around the tile sizes: micro rows 6, vectors of 8/16 lanes, query
# tiles of 48 packed rows, key blocks of 256, split-key chunks of 1024.
BOUNDARY_SHAPES = [
    (1, 1, 1, 5, 15, 7, 9),
    (1, 1, 1, 6, 16, 16, 16),
    (1, 1, 1, 7, 17, 17, 15),
    (1, 4, 1, 12, 64, 64, 63),
    (1, 4, 1, 13, 65, 65, 64),
    (2, 2, 2, 47, 255, 63, 65),
    (1, 1, 1, 48, 256, 128, 128),
    (1, 1, 1, 49, 257, 129, 127),
    (1, 8, 2, 11, 300, 80, 80),
    (1, 8, 2, 13, 300, 80, 80),
    (1, 6, 3, 96, 513, 32, 48),
    (1, 2, 2, 97, 97, 256, 256),
    (2, 4, 4, 1, 1023, 64, 64),
    (2, 4, 4, 1, 1025, 64, 64),
    (1, 32, 8, 1, 2049, 128, 128),
    (1, 3, 1, 130, 130, 3, 1),
]


@pytest.mark.parametrize("shape", BOUNDARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_boundaries_match_reference(port_isa: tuple[str, str], shape: tuple[int, ...], causal: bool) -> None:
    port, _ = port_isa
    b, hq, hkv, lq, lk, d, dv = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)
    kwargs: dict[str, Any] = {"causal": causal}
    if causal and lq > lk:
        kwargs["q_offset"] = 0
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=port, **kwargs)
    assert_close_to_reference(out, q, k, v, **kwargs)
    assert_lse_close(lse, q, k, v, **kwargs)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_offsets_lengths_masks(port_isa: tuple[str, str], mask_kind: str) -> None:
    port, _ = port_isa
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, 3, 8, 50, 64), rand(rng, 3, 2, 600, 64), rand(rng, 3, 2, 600, 32)
    kv_lens = np.array([600, 257, 0])
    q_offset = np.array([550, 100, 0])
    mask: np.ndarray | None = None
    if mask_kind == "bool":
        mask = rng.random((3, 1, 50, 600)) < 0.9
    elif mask_kind == "float":
        mask = rng.standard_normal((8, 1, 600)).astype(np.float32)
        mask[:, :, 300:310] = -np.inf
    k[1, :, 257:] = np.nan  # padding is never read
    v[1, :, 257:] = np.nan
    kwargs = dict(causal=True, q_offset=q_offset, kv_lens=kv_lens, attn_mask=mask)
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=port, **kwargs)
    assert_close_to_reference(out, q, k, v, **kwargs)
    assert_lse_close(lse, q, k, v, **kwargs)


@functools.lru_cache(maxsize=None)
def _long_cache_problem(q_len: int) -> tuple[Any, ...]:
    """One decode problem over 32k keys per q_len, with its float64 and float32 reference results,
    computed once and shared by every port and instruction set (the references dominate the time)."""
    rng = np.random.default_rng(q_len)
    lk = 32768
    q, k, v = rand(rng, 2, 8, q_len, 64), rand(rng, 2, 2, lk, 64), rand(rng, 2, 2, lk, 64)
    kwargs = dict(causal=True, kv_lens=np.array([lk, 20000]))
    return q, k, v, kwargs, reference64(q, k, v, return_lse=True, **kwargs), reference32(q, k, v, return_lse=True, **kwargs)


def _assert_within_float32_error(got: np.ndarray, want: np.ndarray, f32: np.ndarray, magnitude: float) -> None:
    """helpers.assert_close_to_reference's tolerance, on precomputed references."""
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    f32_err = float(np.max(np.abs(f32[finite] - want[finite]), initial=0.0))
    tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, magnitude)
    err = float(np.max(np.abs(got[finite].astype(np.float64) - want[finite]), initial=0.0))
    assert err <= tol, f"max abs error {err:.3g} > tolerance {tol:.3g} (float32 reference error {f32_err:.3g})"


@pytest.mark.parametrize("q_len", [1, 4, 16])
def test_long_cache_decode(port_isa: tuple[str, str], q_len: int) -> None:
    port, _ = port_isa
    q, k, v, kwargs, (want, want_lse), (f32, f32_lse) = _long_cache_problem(q_len)
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=port, **kwargs)
    _assert_within_float32_error(out, want, f32, float(np.abs(v).max()))
    _assert_within_float32_error(lse, want_lse, f32_lse, float(np.abs(want_lse[np.isfinite(want_lse)]).max()))


def test_thread_counts_agree(port_isa: tuple[str, str]) -> None:
    port, _ = port_isa
    rng = np.random.default_rng(3)
    for lq, lk in ((1, 5000), (200, 700)):
        q, k, v = rand(rng, 2, 8, lq, 64), rand(rng, 2, 2, lk, 64), rand(rng, 2, 2, lk, 64)
        one = twinattn.attention(q, k, v, causal=True, backend=port, num_threads=1)
        for threads in (2, 3, 8):
            many = twinattn.attention(q, k, v, causal=True, backend=port, num_threads=threads)
            np.testing.assert_allclose(many, one, rtol=0, atol=16 * UNIT_ROUNDOFF * float(np.abs(v).max()))


def _native_args(q: np.ndarray, k: np.ndarray, v: np.ndarray, **overrides: Any) -> dict[str, Any]:
    b, hq, lq, _ = q.shape
    args: dict[str, Any] = dict(
        q=q, k=k, v=v, out=np.empty((b, hq, lq, v.shape[-1]), np.float32), lse=np.empty((b, hq, lq), np.float32),
        q_offset=np.zeros(b, np.int64), kv_lens=np.full(b, k.shape[2], np.int64), mask=None,
        causal=False, scale=float(q.shape[-1]) ** -0.5, num_threads=2,
        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_plain_kernel(port_isa: tuple[str, str], seed: int) -> None:
    """The fast kernel against the same port's plain reference kernel, called directly."""
    port, _ = port_isa
    module = _module(port)
    rng = np.random.default_rng(100 + seed)
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    hq = hkv * int(rng.choice([1, 2, 4]))
    lq, lk = int(rng.integers(1, 120)), int(rng.integers(1, 1500))
    d, dv = int(rng.choice([16, 64, 80, 128])), int(rng.choice([16, 64, 96, 128]))
    q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)
    offsets = rng.integers(0, lk + 1, b).astype(np.int64)
    lens = rng.integers(0, lk + 1, b).astype(np.int64)
    fast = _native_args(q, k, v, q_offset=offsets, kv_lens=lens, causal=True)
    plain = _native_args(q, k, v, q_offset=offsets, kv_lens=lens, causal=True)
    module.attention_forward(**fast)
    module.attention_reference(**plain)
    tol = 64 * UNIT_ROUNDOFF * float(np.abs(v).max())
    np.testing.assert_allclose(fast["out"], plain["out"], rtol=0, atol=tol)
    np.testing.assert_array_equal(np.isneginf(fast["lse"]), np.isneginf(plain["lse"]))
    finite = np.isfinite(plain["lse"])
    np.testing.assert_allclose(fast["lse"][finite], plain["lse"][finite], rtol=0, atol=64 * UNIT_ROUNDOFF * max(1.0, float(np.abs(plain["lse"][finite]).max(initial=0))))


@pytest.mark.parametrize("isa", ISAS)
def test_ports_agree_bit_for_bit(isa: str) -> None:
    """C++ and Rust on a shared random sweep (GQA, causal or not, offsets, kv_lens, masks, lse) on
    the same instruction set: one algorithm, the same operations in the same order, so the same
    bits (C++ is built with -ffp-contract=off: GCC fusing a*b + c on its own broke this)."""
    _require("cpp")
    _require("rust")
    with forced_isa("cpp", isa), forced_isa("rust", isa):
        rng = np.random.default_rng(2024)
        for _ in range(16):
            b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 4))
            hq = hkv * int(rng.choice([1, 2, 4, 8]))
            lk = int(rng.integers(1, 1500))
            lq = int(rng.integers(1, min(120, lk) + 1))
            d, dv = int(rng.choice([17, 32, 64, 128])), int(rng.choice([24, 64, 128]))
            q, k, v = rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv)
            kwargs: dict[str, Any] = dict(causal=bool(rng.integers(0, 2)), return_lse=True)
            kwargs["kv_lens"] = rng.integers(0 if not kwargs["causal"] else lq, lk + 1, size=b)
            if rng.integers(0, 3) == 0:
                kwargs["attn_mask"] = rng.random((b, hq, lq, lk)) > 0.3
            out_cpp, lse_cpp = twinattn.attention(q, k, v, backend="cpp", **kwargs)
            out_rust, lse_rust = twinattn.attention(q, k, v, backend="rust", **kwargs)
            np.testing.assert_array_equal(out_cpp, out_rust)
            np.testing.assert_array_equal(lse_cpp, lse_rust)


def test_ports_share_constants() -> None:
    _require("cpp")
    _require("rust")
    cpp, rust = _module("cpp").build_info()["constants"], _module("rust").build_info()["constants"]
    assert cpp == rust
    assert cpp["q_tile_rows"] % cpp["micro_rows"] == 0


def test_set_isa_rejects_unknown(native_backend: str) -> None:
    module = _module(native_backend)
    with pytest.raises(ValueError, match="sse9"):
        module.set_isa("sse9")
    assert module.build_info()["isa"] in module.build_info()["isa_available"]


@pytest.mark.parametrize("value, ok", [("scalar", True), ("quantum", False)])
def test_twinattn_isa_environment_variable(native_backend: str, value: str, ok: bool) -> None:
    code = f"import twinattn._{native_backend} as m; print(m.build_info()['isa'])"
    env = {**os.environ, "TWINATTN_ISA": value}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if ok:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == value
    else:
        assert result.returncode != 0
        assert "TWINATTN_ISA" in result.stderr and value in result.stderr


# ---- bfloat16: the tile path (AMX) where usable, else the dot path (VDPBF16PS) or the convert path,
# ---- chosen by what the CPU does faster

def _clean_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "TWINATTN_ISA"}


def test_bfloat16_path_is_reported_and_follows_the_measurement(native_backend: str) -> None:
    """build_info says which path bfloat16 prefill takes (the tile path exactly on amxbf16, the dot
    path exactly on avx512bf16), the default instruction set (amxbf16 wherever it is available),
    and, where the default had the choice, the measured ratio that chose it against the shared
    threshold."""
    info = _module(native_backend).build_info()
    assert info["bfloat16_path"] == {"amxbf16": "amx", "avx512bf16": "dot"}.get(info["isa"], "convert")
    assert info["isa_default"] in info["isa_available"]
    if not os.environ.get("TWINATTN_ISA") and "amxbf16" in info["isa_available"]:
        assert info["isa_default"] == "amxbf16"
    ratio = info["bf16dot_over_fma32"]
    if ratio is None:  # no choice measured: TWINATTN_ISA or AMX decided, or there is no VDPBF16PS
        assert (os.environ.get("TWINATTN_ISA") or "amxbf16" in info["isa_available"]
                or "avx512bf16" not in info["isa_available"])
    else:
        assert ratio > 0
        threshold = info["constants"]["bf16_dot_min_ratio"]
        assert info["isa_default"] == ("avx512bf16" if ratio >= threshold else "avx512")


@pytest.mark.parametrize("isa, path", [("avx512", "convert"), ("avx512bf16", "dot"), ("amxbf16", "amx")])
def test_either_bfloat16_path_can_be_forced(native_backend: str, isa: str, path: str) -> None:
    """set_isa (and so TWINATTN_ISA, below) forces any path whatever the measurement said; each
    stays within the documented bfloat16 tolerance (helpers: float32's error, out's rounding, and
    on the dot and tile paths P's rounding to bfloat16)."""
    rng = np.random.default_rng(11)
    q = rand(rng, 1, 8, 40, 64).astype(BFLOAT16)  # 40 rows x group 4 > q_tile_rows: the prefill path
    k, v = rand(rng, 1, 2, 300, 64).astype(BFLOAT16), rand(rng, 1, 2, 300, 48).astype(BFLOAT16)
    with forced_isa(native_backend, isa):
        assert _module(native_backend).build_info()["bfloat16_path"] == path
        out = twinattn.attention(q, k, v, causal=True, backend=native_backend)
    assert_half_close_to_reference(out, q, k, v, isa=isa, causal=True)


@pytest.mark.parametrize("isa, path", [("avx512", "convert"), ("avx512bf16", "dot"), ("amxbf16", "amx")])
def test_twinattn_isa_forces_the_bfloat16_path_without_measuring(native_backend: str, isa: str, path: str) -> None:
    info = _module(native_backend).build_info()
    if isa not in info["isa_available"]:
        pytest.skip(f"{native_backend}: {isa} not available on this CPU/build ({info['isa_available']})")
    code = (f"import twinattn._{native_backend} as m; i = m.build_info(); "
            "print(i['isa'], i['bfloat16_path'], i['bf16dot_over_fma32'])")
    result = subprocess.run([sys.executable, "-c", code], env={**_clean_environment(), "TWINATTN_ISA": isa},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [isa, path, "None"]


def test_both_ports_choose_the_same_bfloat16_path() -> None:
    """In a fresh process without TWINATTN_ISA: each port alone follows its own measurement, and
    through the package both run the same default (the one loaded second follows the first)."""
    _require("cpp")
    _require("rust")
    alone = ("import json, twinattn._cpp as c, twinattn._rust as r; "
             "print(json.dumps([m.build_info() for m in (c, r)]))")
    package = "import json, twinattn; i = twinattn.build_info(); print(json.dumps([i['cpp'], i['rust']]))"
    for code in (alone, package):
        result = subprocess.run([sys.executable, "-c", code], env=_clean_environment(), capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        cpp, rust = json.loads(result.stdout)
        for info in (cpp, rust):
            ratio = info["bf16dot_over_fma32"]
            if ratio is not None:
                threshold = info["constants"]["bf16_dot_min_ratio"]
                assert info["isa_default"] == ("avx512bf16" if ratio >= threshold else "avx512")
        if code == package:
            assert (cpp["isa"], cpp["bfloat16_path"]) == (rust["isa"], rust["bfloat16_path"])


class _FakePort:
    """A native module as _backends sees it: build_info and set_isa."""

    def __init__(self, isa: str, isa_default: str) -> None:
        self.isa, self.isa_default = isa, isa_default

    def build_info(self) -> dict[str, Any]:
        return {"isa": self.isa, "isa_default": self.isa_default, "isa_available": ["avx512bf16", "avx512", "scalar"]}

    def set_isa(self, name: str) -> None:
        self.isa = name


@pytest.mark.parametrize(
    "first, second, expected",
    [
        (("avx512", "avx512"), ("avx512bf16", "avx512bf16"), "avx512"),  # the measurements disagreed: follow
        (("avx512bf16", "avx512"), ("avx512bf16", "avx512bf16"), "avx512"),  # the first's default, not its set_isa
        (("avx512", "avx512"), ("scalar", "avx512bf16"), "scalar"),  # switched by set_isa already: left alone
        (("avx512bf16", "avx512bf16"), ("avx512bf16", "avx512bf16"), "avx512bf16"),  # agreeing: untouched
    ],
    ids=["follows", "default-not-current", "switched-left-alone", "agreeing"],
)
def test_the_port_loaded_second_follows_the_first(
    monkeypatch: pytest.MonkeyPatch, first: tuple[str, str], second: tuple[str, str], expected: str
) -> None:
    from twinattn.core import _backends

    monkeypatch.setattr(_backends, "_modules", {"cpp": _FakePort(*first)})
    module = _FakePort(*second)
    assert _backends._follow_first_port(module) is module  # type: ignore[arg-type]
    assert module.isa == expected
