"""The standard suite, defined once: the cases, the work each does, their inputs, the check of
a result and the outcome of a run. twinattn-bench and the pytest-benchmark suites in benchmarks/
both take their cases here.

A kernel case is one attention call, q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D), always with
bottom-right causal alignment (the queries are the last Lq positions of each sequence, the
KV-cache convention of twinattn.attention with q_offset=None).

Every case is defined in float32 and can be run in float16 or bfloat16 as well (Case.dtype,
`with_dtypes`): the inputs are drawn in float32 and rounded to the dtype (NumPy's float16,
ml_dtypes.bfloat16), the output is in that dtype, and the reference is float64 from the rounded
inputs. K/V bytes count the dtype's size (2 bytes per element for float16 and bfloat16).

A kernel case can also run with an int8 K/V cache (dtype "int8"): q stays float32, K and V
are the float32 draws quantized by twinattn.quantize_kv (int8, one float32 scale per (sequence, KV
head, token) for each), passed with k_scale / v_scale; the output is float32 and the reference is
float64 attention over twinattn.dequantize_kv of them (the contract: int8 attention is attention over
the dequantized K/V). K/V bytes are the int8 payload plus the two float32 scales of every key read:
(D + Dv) x 1 + 2 x 4 bytes per (key, KV head). The layer case (nn.Attention) has no int8 run.

A case may carry a variant: a sliding window (window_left, as window_size=(window_left, 0)) or a
softcap; both are passed to twinattn.attention and to the reference.

Work is counted exactly, from the visible (query row, key) pairs of every query head:
    row i of sequence b sits at p = q_offset[b] + i, q_offset[b] = kv_len[b] - Lq, and sees keys
    max(0, p - window_left) <= j < min(kv_len[b], p + 1)   (no lower bound without a window),
    FLOPs = 2 x pairs x (D + Dv)          (Q.K^T and P.V, one multiply-add = 2 FLOPs)
    K/V bytes = keys some row sees x Hkv x ((D + Dv) x itemsize + scale bytes), summed over b
                (each read once; itemsize 4 for float32, 2 for float16 and bfloat16, 1 for int8;
                scale bytes 2 x 4 for int8's float32 scales of K and V, else 0)
GB/s is reported for decode cases, where reading K and V is the cost.

One case is a layer, not a kernel call: layer-decode times one decode step of twinattn.nn.Attention
(q/k/v projections, RoPE, KV-cache append, attention, o_proj) on a cache of `k_len - q_len` tokens,
and beside it twinattn.attention alone on the same cache views. Its work counts (pairs, FLOPs, K/V
bytes) are the attention kernel's; its check is the whole step against the same step computed in
float64 by the package's own pieces (RotaryEmbedding, KVCache, the NumPy reference).

A train case is a prefill case run forward and backward: the forward with its lse, then the
gradients of sum(out * dout) for a fixed random dout (twinattn.core.backward on the ports, torch's
autograd through scaled_dot_product_attention for the peer). Its FLOPs count the forward's and the
backward's, the backward as 2.5 times the forward (FlashAttention-2's count: the five matrix
products dV, dP, dQ, dK and the recomputed S, where the forward has two):
    FLOPs = 2 x pairs x (D + Dv) x (1 + 2.5)
Beside that, the backward alone is timed from one forward made before timing (its GFLOP/s count
the backward's 2.5 parts of those). Its check, of both, is dq on the checked rows against float64
(dq of row i needs only row i's weights).

Every result is compared with a float64 reference computed by twinattn's NumPy backend.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.util
import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

import twinattn

INT8 = "int8"  # K/V int8 with float32 scales, q and out float32 (see the module docstring)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # "all" on --dtype
DTYPES = (*FLOAT_DTYPES, INT8)  # the dtypes a case runs in (--dtype)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, INT8: 1}  # of a K/V element
SCALE_BYTES = {INT8: 2 * 4}  # per (key, KV head): the float32 scales of K and V
# unit roundoff (half an ulp at 1.0) of the output: 24, 11 and 8 significand bits (int8: out is float32)
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, INT8: 2.0**-24}


DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16", "i8": INT8}


def parse_dtypes(spec: str) -> list[str]:
    """--dtype: a comma-separated list of DTYPES (or their short names: f32, fp16, bf16, i8 ...), or
    "all" (the FLOAT_DTYPES: int8 is named on its own); in DTYPES order. Raises ValueError naming
    the valid values, saying how to get ml_dtypes when bfloat16 is asked for without it."""
    wanted = [w.strip().lower() for w in spec.split(",") if w.strip()]
    if not wanted:
        raise ValueError(f"--dtype: expected a comma-separated list of {', '.join(DTYPES)} (or all), got {spec!r}")
    chosen: set[str] = set()
    for word in wanted:
        if word == "all":
            chosen.update(FLOAT_DTYPES)
            continue
        name = DTYPE_ALIASES.get(word, word)
        if name not in DTYPES:
            raise ValueError(f"--dtype: unknown dtype {word!r}; valid: {', '.join(DTYPES)}, all")
        chosen.add(name)
    if "bfloat16" in chosen and importlib.util.find_spec("ml_dtypes") is None:
        raise ValueError("--dtype bfloat16 needs ml_dtypes (NumPy's bfloat16): pip install ml_dtypes")
    return [d for d in DTYPES if d in chosen]


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a DTYPES name (bfloat16: ml_dtypes', imported only when asked for). int8:
    that of K and V; q and out are float32 (out_dtype)."""
    if name == "bfloat16":
        import ml_dtypes

        bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return np.dtype(name)


def out_dtype(name: str) -> np.dtype:
    """The dtype of q and out in a case of dtype `name` (float32 for an int8 K/V cache)."""
    return np.dtype(np.float32) if name == INT8 else numpy_dtype(name)


PREFILL = "prefill"
DECODE = "decode"
LAYER = "layer"  # one step of twinattn.nn.Attention with a KVCache (see LayerProblem)
TRAIN = "train"  # a prefill case forward and backward (see TrainProblem)
BACKWARD_FLOPS_FACTOR = 2.5  # the backward's FLOPs over the forward's (module docstring)


@dataclass(frozen=True)
class Case:
    """One benchmark problem. `group` is the suite entry it belongs to; `x` its value of N."""

    name: str
    group: str
    kind: str  # PREFILL (compute-bound), DECODE (one query row per sequence, read-bound), LAYER or TRAIN
    q_len: int
    k_len: int
    batch: int = 1
    q_heads: int = 32  # Llama-3-8B's attention: Hq 32, Hkv 8, D 128
    kv_heads: int = 8
    head_dim: int = 128
    value_dim: int = 128
    causal: bool = True
    kv_lens: Optional[tuple[int, ...]] = None  # None: every sequence has k_len keys
    threads: Optional[int] = None  # None: the run's thread count (--threads)
    x: int = 0  # N, for plots
    note: str = ""
    hidden_size: int = 0  # LAYER: the model width of nn.Attention; 0 for a kernel case
    window_left: int = -1  # a sliding window: window_size=(window_left, 0); -1 for none
    softcap: float = 0.0  # attention logit softcapping; 0 for none
    dtype: str = "float32"  # q, k, v and out: one of DTYPES (int8: k and v; q and out float32)

    @property
    def variant_kwargs(self) -> dict[str, Any]:
        """The variant keywords of twinattn.attention this case passes (none for a plain case)."""
        kwargs: dict[str, Any] = {}
        if self.window_left >= 0:
            kwargs["window_size"] = (self.window_left, 0)
        if self.softcap:
            kwargs["softcap"] = self.softcap
        return kwargs

    @property
    def cached(self) -> int:
        """LAYER: tokens in the cache before the step (the step appends q_len more: k_len keys)."""
        return self.k_len - self.q_len

    @property
    def lens(self) -> np.ndarray:
        if self.kv_lens is None:
            return np.full(self.batch, self.k_len, dtype=np.int64)
        return np.asarray(self.kv_lens, dtype=np.int64)

    @property
    def q_offsets(self) -> np.ndarray:
        """Bottom-right alignment: the queries are the last Lq positions of each sequence."""
        return self.lens - self.q_len

    def shape_text(self) -> str:
        if self.kind == LAYER:
            return (
                f"nn.Attention hidden={self.hidden_size} Hq={self.q_heads} Hkv={self.kv_heads} D={self.head_dim} "
                f"B={self.batch}: {self.q_len} new token{'s' if self.q_len > 1 else ''} on {self.cached} cached"
            )
        lens = f", kv_lens {self.kv_lens[0]}..{self.kv_lens[-1]}" if self.kv_lens else ""
        heads = f"H={self.q_heads}" if self.q_heads == self.kv_heads else f"Hq={self.q_heads} Hkv={self.kv_heads}"
        return (
            f"B={self.batch} {heads} Lq={self.q_len} Lk={self.k_len} D={self.head_dim}"
            f"{'' if self.value_dim == self.head_dim else f' Dv={self.value_dim}'}"
            f"{' causal' if self.causal else ''}{lens}"
            f"{f' window=({self.window_left}, 0)' if self.window_left >= 0 else ''}"
            f"{f' softcap={self.softcap:g}' if self.softcap else ''}"
        )

    def shrunk(self, factor: int) -> "Case":
        """The same case with every sequence length divided by `factor` (at least 1 key)."""
        if factor == 1:
            return self
        if self.kind == LAYER:  # the cache is the sequence; the model width stays
            cached = max(1, self.cached // factor)
            return dataclasses.replace(self, k_len=cached + self.q_len, x=cached)

        def cut(n: int) -> int:
            return max(1, n // factor)

        q_len = self.q_len if self.kind == DECODE else cut(self.q_len)
        k_len = max(cut(self.k_len), q_len)
        lens = None if self.kv_lens is None else tuple(max(q_len, min(k_len, cut(n))) for n in self.kv_lens)
        window = self.window_left if self.window_left < 0 else cut(self.window_left + 1) - 1
        return dataclasses.replace(self, q_len=q_len, k_len=k_len, kv_lens=lens, x=max(1, self.x // factor),
                                   window_left=window)


@dataclass(frozen=True)
class Work:
    pairs: int  # visible (query row, key) pairs, summed over batch and query heads
    flops: int  # 2 x pairs x (D + Dv)
    kv_bytes: int  # bytes of K and V that must be read (visible keys only, each once)


def visible_key_range(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(B, Lq) first and one-past-last key row i of sequence b may attend to (first >= end: none)."""
    lens = case.lens[:, None]
    shape = (case.batch, case.q_len)
    end = np.broadcast_to(lens, shape).copy()
    position = case.q_offsets[:, None] + np.arange(case.q_len, dtype=np.int64)[None, :]
    if case.causal:
        end = np.clip(position + 1, 0, lens)
    first = np.zeros(shape, np.int64) if case.window_left < 0 else np.maximum(position - case.window_left, 0)
    return first, end


def visible_keys_per_row(case: Case) -> np.ndarray:
    """(B, Lq) number of keys row i of sequence b may attend to."""
    first, end = visible_key_range(case)
    counts: np.ndarray = np.maximum(end - first, 0)
    return counts


def work(case: Case) -> Work:
    pairs = int(visible_keys_per_row(case).sum()) * case.q_heads
    flops = 2 * pairs * (case.head_dim + case.value_dim)
    if case.kind == TRAIN:  # the forward and the backward
        flops = int(flops * (1 + BACKWARD_FLOPS_FACTOR))
    # A key is read if any row sees it: the rows' windows slide together, so per sequence the keys
    # from the earliest first to the latest end.
    first, end = visible_key_range(case)
    seen = end > first
    read = np.where(seen.any(axis=1), np.max(np.where(seen, end, 0), axis=1, initial=0)
                    - np.min(np.where(seen, first, case.k_len), axis=1, initial=case.k_len), 0)
    per_key = (case.head_dim + case.value_dim) * ITEMSIZE[case.dtype] + SCALE_BYTES.get(case.dtype, 0)
    kv_bytes = int(read.sum()) * case.kv_heads * per_key
    return Work(pairs=pairs, flops=flops, kv_bytes=kv_bytes)


def layer_decode_case(
    hidden_size: int, q_heads: int, kv_heads: int, head_dim: int, cached: int, name: str = "layer-decode"
) -> Case:
    note = f"one nn.Attention decode step on a {cached}-token cache, and the kernel alone"
    return Case(name, name, LAYER, 1, cached + 1, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                value_dim=head_dim, x=cached, hidden_size=hidden_size, note=note)


def with_dtypes(cases: Sequence[Case], dtypes: Sequence[str]) -> list[Case]:
    """Each case in each dtype, case by case: a case's dtypes side by side, in `dtypes` order. The
    layer case has no int8 run (int8 K/V is a kernel-case dtype: twinattn.attention with scales),
    nor do the train cases (int8 keys and values carry no gradient)."""
    return [dataclasses.replace(case, dtype=dtype) for case in cases for dtype in dtypes
            if not (dtype == INT8 and case.kind in (LAYER, TRAIN))]


def standard_suite(all_threads: int) -> list[Case]:
    """Every case, float32 (with_dtypes makes the other dtypes), B=1 unless said. `all_threads` is
    the scaling case's top count."""
    cases = [Case(f"prefill-causal/N={n}", "prefill-causal", PREFILL, n, n, x=n) for n in (512, 1024, 2048, 4096)]
    cases.append(Case("prefill-mha-d64/N=2048", "prefill-mha-d64", PREFILL, 2048, 2048, q_heads=16, kv_heads=16,
                      head_dim=64, value_dim=64, x=2048))
    cases.append(Case("chunk", "chunk", PREFILL, 256, 4096, x=4096, note="256 new queries after 3840 cached tokens"))
    cases.extend(Case(f"decode/N={n}", "decode", DECODE, 1, n, x=n) for n in (1024, 4096, 16384, 32768))
    lens = tuple(range(1024, 8193, 1024))
    cases.append(Case("decode-batch", "decode-batch", DECODE, 1, 8192, batch=8, kv_lens=lens, x=8192,
                      note="per-sequence kv_lens 1024..8192"))
    cases.append(Case("tiny", "tiny", PREFILL, 16, 16, q_heads=1, kv_heads=1, head_dim=64, value_dim=64, x=16,
                      note="per-call overhead"))
    for t in sorted({1, all_threads}):
        note = f"prefill-causal N=2048 on {t} thread{'s' if t > 1 else ''}"
        cases.append(Case(f"threads/T={t}", "threads", PREFILL, 2048, 2048, threads=t, x=t, note=note))
    # Llama-3-8B's attention layer, one decode step on a 4096-token cache
    cases.append(layer_decode_case(hidden_size=4096, q_heads=32, kv_heads=8, head_dim=128, cached=4096))
    # the variants: a Mistral-style sliding window of 4096 on a 32768-token cache (reads 4096 keys:
    # compare decode/N=4096 and decode/N=32768), and Gemma 2's softcap on prefill-causal/N=2048
    cases.append(Case("decode-window", "decode-window", DECODE, 1, 32768, x=32768, window_left=4095,
                      note="sliding window 4096 (window_size=(4095, 0)) on a 32768-token cache"))
    cases.append(Case("prefill-softcap/N=2048", "prefill-softcap", PREFILL, 2048, 2048, x=2048, softcap=50.0,
                      note="prefill-causal N=2048 with softcap=50"))
    # training: causal prefill forward and backward (train cases, module docstring)
    cases.extend(Case(f"train-causal/N={n}", "train-causal", TRAIN, n, n, x=n,
                      note=f"prefill-causal N={n} forward and backward") for n in (512, 2048))
    return cases


QUICK_CASES = ("prefill-causal/N=2048", "chunk", "decode/N=16384", "decode-batch", "tiny", "layer-decode")


def select(suite: Sequence[Case], spec: Optional[str], quick: bool) -> list[Case]:
    """Cases named by a comma-separated list of case names, group names or globs (in suite order).

    Raises ValueError listing the valid names when a name matches nothing.
    """
    if spec is None:
        return [c for c in suite if c.name in QUICK_CASES] if quick else list(suite)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    if not wanted:
        raise ValueError("--cases: expected a comma-separated list of case or group names, got nothing")
    chosen: set[str] = set()
    for pattern in wanted:
        hits = [c.name for c in suite if pattern in (c.name, c.group) or fnmatch.fnmatchcase(c.name, pattern)]
        if not hits:
            groups = list(dict.fromkeys(c.group for c in suite))
            raise ValueError(
                f"--cases: unknown case {pattern!r}; valid groups: {', '.join(groups)}; "
                f"valid cases: {', '.join(c.name for c in suite)}"
            )
        chosen.update(hits)
    return [c for c in suite if c.name in chosen]


# ----------------------------------------------------------------------------------------------
# The check of a result

# A float32 kernel's error on these problems is ~1e-6 of the output's size; a wrong mask, offset or
# head mapping moves some output by a whole visible key's weight, ~1/N of it or more.
RELATIVE_TOLERANCE = 2e-4


@dataclass
class Check:
    ok: bool
    max_abs_err: float
    max_abs_ref: float
    tolerance: float
    reason: str = ""


# What running a case on one backend gave (twinattn.bench.timing runs it, report shows it)
@dataclass
class Outcome:
    status: str  # "ok", "wrong", "skipped", "error"
    note: str = ""
    times: Optional[list[float]] = None
    warmup: int = 0
    first_call_s: Optional[float] = None
    check: Optional[Check] = None
    # the layer case: the attention kernel alone, timed after the step (times are the steps'); a
    # train case: the backward alone, timed after forward and backward
    kernel_times: Optional[list[float]] = None
    kernel_check: Optional[Check] = None

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    @property
    def kernel_median_s(self) -> Optional[float]:
        return statistics.median(self.kernel_times) if self.kernel_times else None


def check_close(got: object, expected: np.ndarray, what: str = "output", rounding: float = 0.0) -> Check:
    """Every element of `got` against the float64 `expected`, within RELATIVE_TOLERANCE x the
    largest |expected|, plus `rounding` (the bound of a narrower dtype's rounding, see
    Problem.rounding); an element that is not finite (or was never written: outputs start as NaN
    where the backend allows) fails."""
    got = np.asarray(got)
    if got.shape != expected.shape:
        return Check(False, math.inf, 0.0, 0.0, f"{what} shape {got.shape}, expected {expected.shape}")
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    tolerance = RELATIVE_TOLERANCE * max(scale, 1e-3) + rounding
    values = got.astype(np.float64)  # bfloat16 and float16 widen exactly
    if not np.isfinite(values).all():
        return Check(False, math.inf, scale, tolerance, f"non-finite (or unwritten) {what} elements")
    err = float(np.max(np.abs(values - expected))) if got.size else 0.0
    if err > tolerance:
        return Check(False, err, scale, tolerance, f"{what}: max abs error {err:.2e} > tolerance {tolerance:.2e}")
    return Check(True, err, scale, tolerance)


def check_rows(case: Case, count: int = 4, seed: int = 1) -> list[tuple[int, int, int]]:
    """The (sequence, query head, query row) triples a kernel result is checked on.

    Every sequence; the first, last and a middle query head (they read different KV heads); the
    first, last and middle row plus a few random ones (the diagonal moves from row to row).
    """
    rng = np.random.default_rng(seed)
    heads = sorted({0, case.q_heads // 2, case.q_heads - 1})
    rows = {0, case.q_len // 2, case.q_len - 1}
    rows.update(int(r) for r in rng.integers(0, case.q_len, size=count))
    return [(b, h, i) for b in range(case.batch) for h in heads for i in sorted(rows)]


# ----------------------------------------------------------------------------------------------
# Inputs: made once per case from a fixed seed and shared (read-only) by every backend


def _random(rng: np.random.Generator, *shape: int, scale: float = 1.0, dtype: str = "float32") -> np.ndarray:
    """Standard normal values drawn in float32 (the same draws for every dtype), rounded to `dtype`."""
    a = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        a *= np.float32(scale)
    if dtype != "float32":
        a = a.astype(numpy_dtype(dtype))  # round to nearest even
    a.flags.writeable = False  # shared by every backend: none may change them
    return a


@dataclass
class Problem:
    """A kernel case's arrays; its output (B, Hq, Lq, Dv) is checked on check_rows(case)."""

    case: Case
    q: np.ndarray  # (B, Hq, Lq, D) in case.dtype (int8: float32)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    kv_lens: Optional[np.ndarray]  # (B,) int64, or None
    scale: float
    k_scale: Optional[np.ndarray] = None  # int8: (B, Hkv, Lk) float32, from twinattn.quantize_kv
    v_scale: Optional[np.ndarray] = None
    parts = ("output",)  # what a prepared backend times and hands back, in order

    @property
    def scale_kwargs(self) -> dict[str, np.ndarray]:
        """k_scale / v_scale for twinattn.attention (int8), else nothing."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def values64(self, which: str) -> np.ndarray:
        """K ("k") or V ("v") as the kernel must see them, in float64: int8 dequantized
        (twinattn.dequantize_kv, float32, exact in float64), else widened."""
        stored, scale = (self.k, self.k_scale) if which == "k" else (self.v, self.v_scale)
        if scale is not None:
            wide: np.ndarray = twinattn.dequantize_kv(stored, scale).astype(np.float64)
            return wide
        return stored.astype(np.float64)

    def _reference_rows(self, values: np.ndarray) -> np.ndarray:
        """Per checked row, attention over `values` (B, Hkv, Lk, Dv) in float64 from the (rounded)
        inputs: per (sequence, query head), twinattn's NumPy backend on those rows, each row masked
        to the keys it sees."""
        case = self.case
        rows = check_rows(case)
        first, end = visible_key_range(case)
        group = case.q_heads // case.kv_heads
        result = np.zeros((len(rows), case.value_dim))
        keys = self.values64("k")
        for b, h in dict.fromkeys((b, h) for b, h, _ in rows):
            picked = [n for n, row in enumerate(rows) if row[:2] == (b, h)]
            queries = [rows[n][2] for n in picked]
            key = np.arange(case.k_len)[None, :]
            mask = (key >= first[b, queries][:, None]) & (key < end[b, queries][:, None])  # (rows, Lk)
            result[picked] = twinattn.attention(
                self.q[b, h, queries][None, None].astype(np.float64),
                keys[b, h // group][None, None],
                values[b, h // group][None, None].astype(np.float64),
                attn_mask=mask[None, None],
                scale=self.scale,
                softcap=case.softcap,
                backend="numpy",
            )[0, 0]
        return result

    @functools.cached_property
    def expected(self) -> tuple[list[tuple[int, int, int]], np.ndarray]:
        """The checked rows and their float64 reference (len(rows), Dv)."""
        return check_rows(self.case), self._reference_rows(self.values64("v"))

    @functools.cached_property
    def rounding(self) -> float:
        """What a narrower dtype's rounding may add to an output element's error, beyond float32
        arithmetic: the output rounded to the dtype, u x |out| (u its unit roundoff); for
        bfloat16 also the bf16 dot-product path's probabilities P rounded to bfloat16 before P.V,
        u x sum_j P_j |v_j| per element (that sum is attention over |V|). Both taken at their
        largest over the checked rows. 0 for float32 and int8 (out is float32; the reference is
        from the dequantized K/V, so quantization is no error)."""
        if self.case.dtype in ("float32", INT8):
            return 0.0
        u = UNIT_ROUNDOFF[self.case.dtype]
        bound = u * float(np.max(np.abs(self.expected[1]), initial=0.0))
        if self.case.dtype == "bfloat16":
            bound += u * float(np.max(self._reference_rows(np.abs(self.values64("v"))), initial=0.0))
        return bound

    def check(self, out: object, part: int = 0) -> Check:
        """The output against the reference on the checked rows, its dtype the case's, and every
        element finite."""
        case, (rows, expected) = self.case, self.expected
        out = np.asarray(out)
        shape = (case.batch, case.q_heads, case.q_len, case.value_dim)
        if out.shape != shape:
            return Check(False, math.inf, 0.0, 0.0, f"output shape {out.shape}, expected {shape}")
        if out.dtype != out_dtype(case.dtype):
            return Check(False, math.inf, 0.0, 0.0, f"output dtype {out.dtype}, expected {out_dtype(case.dtype)}")
        if not np.isfinite(out.astype(np.float32)).all():  # outside the checked rows too
            return Check(False, math.inf, 0.0, 0.0, "non-finite (or unwritten) output elements")
        return check_close(np.stack([out[b, h, i] for b, h, i in rows]), expected, rounding=self.rounding)


ROPE_BASE = 500000.0  # Llama 3's rope_theta


@dataclass
class LayerProblem:
    """One decode step's inputs. weights: torch Linear orientation (out_features, in_features),
    float32, for load_state_dict. past_k, past_v: (B, Hkv, cached, D) what the cache holds before
    the step (keys as stored, i.e. already rotated; random, so their positions do not matter).
    hidden: (B, q_len, hidden_size)."""

    case: Case
    hidden: np.ndarray
    weights: dict[str, np.ndarray]
    past_k: np.ndarray
    past_v: np.ndarray
    rope_base: float = ROPE_BASE
    parts = ("step output", "kernel output")  # the step, then twinattn.attention alone

    @property
    def cached(self) -> int:
        return self.case.cached

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.head_dim)

    def rope(self) -> twinattn.RotaryEmbedding:
        return twinattn.RotaryEmbedding(self.case.head_dim, base=self.rope_base)

    def cache(self, dtype: Any = None) -> twinattn.KVCache:
        """A KVCache in `dtype` (default: the case's) holding the cached tokens, with room for
        exactly one step: a step taken without cropping the cache back first overflows it, loudly.
        A float16 / bfloat16 cache holds the float32 draws rounded."""
        case = self.case
        dtype = numpy_dtype(case.dtype) if dtype is None else dtype
        cache = twinattn.KVCache(
            num_layers=1,
            batch_size=case.batch,
            num_kv_heads=case.kv_heads,
            head_dim=case.head_dim,
            max_seq_len=case.k_len,
            dtype=dtype,
        )
        cache.update(self.past_k.astype(dtype), self.past_v.astype(dtype), 0)
        return cache

    def kernel_arguments(
        self, cache: twinattn.KVCache, rope: twinattn.RotaryEmbedding, dtype: type = np.float32
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What nn.Attention passes twinattn.attention in this step, computed in `dtype`: the new
        queries (projected, rotated at their positions; rounded to the cache's dtype when that is
        narrower, as nn.Attention rounds them), the cache views after the new keys and values are
        appended (this appends them to `cache`, which rounds them to its dtype), q_offset and
        kv_lens."""
        case, length = self.case, self.case.q_len
        x: np.ndarray = self.hidden.astype(dtype, copy=False)

        def heads(weight: str, count: int) -> np.ndarray:  # (B, L, H * D) -> (B, H, L, D)
            y: np.ndarray = x @ self.weights[weight].astype(dtype, copy=False).T
            return y.reshape(case.batch, length, count, case.head_dim).transpose(0, 2, 1, 3)

        positions = cache.positions(length, 0)
        q = rope.apply(heads("q_proj.weight", case.q_heads), positions)
        k = np.ascontiguousarray(rope.apply(heads("k_proj.weight", case.kv_heads), positions))
        v = np.ascontiguousarray(heads("v_proj.weight", case.kv_heads))
        q_offset = cache.seq_lens(0)
        keys, values = cache.update(k, v, 0)
        if cache.dtype.itemsize < np.dtype(dtype).itemsize:
            q = q.astype(cache.dtype)
        return q, keys, values, q_offset, cache.seq_lens(0)

    def _attention64(self, dtype: Any, absolute_values: bool = False) -> np.ndarray:
        """The step's attention (B, Hq, q_len, D) in float64 from its inputs computed in `dtype`
        (float64; or float32 into the case's cache, then widened), over |values| if asked."""
        q, keys, values, q_offset, kv_lens = self.kernel_arguments(
            self.cache(np.float64 if dtype == np.float64 else None), self.rope(), dtype
        )
        wide = [a.astype(np.float64) for a in (q, keys, values)]
        if absolute_values:
            wide[2] = np.abs(wide[2])
        out: np.ndarray = twinattn.attention(
            *wide, causal=True, q_offset=q_offset, kv_lens=kv_lens, scale=self.scale, backend="numpy"
        )
        return out

    def _output64(self, attn: np.ndarray) -> np.ndarray:
        """The output projection in float64 of attention (B, Hq, q_len, D): (B, q_len, hidden)."""
        merged = attn.transpose(0, 2, 1, 3).reshape(self.case.batch, self.case.q_len, -1)
        out: np.ndarray = merged @ self.weights["o_proj.weight"].astype(np.float64).T
        return out

    @functools.cached_property
    def expected(self) -> tuple[np.ndarray, np.ndarray]:
        """(output (B, q_len, hidden), attention output (B, Hq, q_len, D)) in float64, the step
        recomputed from its pieces: RotaryEmbedding, a KVCache, the NumPy reference, the
        projections. float32: everything in float64 from the float32 inputs. float16 / bfloat16:
        q, k and v exactly as the step has them (projected and rotated in float32, rounded by the
        cache and to the cache's dtype), then attention and o_proj in float64."""
        attn = self._attention64(np.float64 if self.case.dtype == "float32" else np.float32)
        return self._output64(attn), attn

    @functools.cached_property
    def rounding(self) -> tuple[float, float]:
        """Per part, what the narrow dtype's rounding may add to an element's error (0 for float32):
        the kernel's output, u x |attn| for its rounding, plus for bfloat16 u x sum_j P_j |v_j|
        (P rounded before P.V), at their largest; the step's, that bound per attention element e
        carried through the output projection, max_i sum_e |W_o[i, e]| bound_e."""
        dtype = self.case.dtype
        if dtype == "float32":
            return 0.0, 0.0
        u = UNIT_ROUNDOFF[dtype]
        bound = u * np.abs(self.expected[1])
        if dtype == "bfloat16":
            bound = bound + u * self._attention64(np.float32, absolute_values=True)
        merged = bound.transpose(0, 2, 1, 3).reshape(self.case.batch, self.case.q_len, -1)
        through = merged @ np.abs(self.weights["o_proj.weight"].astype(np.float64)).T
        return float(np.max(through, initial=0.0)), float(np.max(bound, initial=0.0))

    def check(self, out: object, part: int = 0) -> Check:
        """Part 0: the step's output (float32); part 1: the kernel's (the case's dtype); every
        element against float64."""
        out = np.asarray(out)
        want = np.dtype(np.float32) if part == 0 else numpy_dtype(self.case.dtype)
        if out.dtype != want:
            return Check(False, math.inf, 0.0, 0.0, f"{self.parts[part]} dtype {out.dtype}, expected {want}")
        return check_close(out, self.expected[part], self.parts[part], rounding=self.rounding[part])


@dataclass
class TrainProblem(Problem):
    """A train case's arrays: a kernel problem and dout (B, Hq, Lq, Dv), the gradient of the loss
    with respect to out, in the case's dtype. What is checked is dq (B, Hq, Lq, D)."""

    dout: Optional[np.ndarray] = None
    parts = ("dq",)

    @functools.cached_property
    def expected(self) -> tuple[list[tuple[int, int, int]], np.ndarray]:
        """The checked rows and their dq in float64 (len(rows), D): for row i,
        dq_i = scale sum_j P_ij (dout_i . v_j - dout_i . out_i) k_j over the keys it sees."""
        return self._reference[:2]

    @functools.cached_property
    def _reference(self) -> tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray]:
        """expected's rows and dq, and beside dq the sums of its terms' magnitudes,
        scale sum_j |dS_ij| |k_j| (len(rows), D)."""
        case, rows = self.case, check_rows(self.case)
        assert self.dout is not None
        first, end = visible_key_range(case)
        group = case.q_heads // case.kv_heads
        keys, values = self.values64("k"), self.values64("v")
        result, magnitudes = np.zeros((len(rows), case.head_dim)), np.zeros((len(rows), case.head_dim))
        for n, (b, h, i) in enumerate(rows):
            seen = slice(int(first[b, i]), int(end[b, i]))
            k, v = keys[b, h // group, seen], values[b, h // group, seen]
            scores = self.scale * (k @ self.q[b, h, i].astype(np.float64))
            if case.softcap:
                scores = case.softcap * np.tanh(scores / case.softcap)
            weights = np.exp(scores - scores.max(initial=-np.inf)) if scores.size else scores
            weights = weights / weights.sum() if weights.size else weights
            dout = self.dout[b, h, i].astype(np.float64)
            dweights = v @ dout
            dscores = weights * (dweights - weights @ dweights)
            if case.softcap:
                dscores = dscores * (1 - (scores / case.softcap) ** 2)
            result[n] = self.scale * (dscores @ k)
            magnitudes[n] = self.scale * (np.abs(dscores) @ np.abs(k))
        return rows, result, magnitudes

    @functools.cached_property
    def rounding(self) -> float:
        """What a narrower dtype's rounding may add to a dq element's error, beyond float32
        arithmetic: dq rounded to the dtype, u x |dq|; for bfloat16 also dS rounded to bfloat16
        before dS K (as the bfloat16 tile products, twinattn's and torch's, take it), u x
        scale sum_j |dS_ij| |k_j| per element (the backward's counterpart of the forward's P
        rounded before P.V). Both at their largest over the checked rows; 0 for float32."""
        if self.case.dtype == "float32":
            return 0.0
        u = UNIT_ROUNDOFF[self.case.dtype]
        bound = u * float(np.max(np.abs(self.expected[1]), initial=0.0))
        if self.case.dtype == "bfloat16":
            bound += u * float(np.max(self._reference[2], initial=0.0))
        return bound

    def check(self, out: object, part: int = 0) -> Check:
        """dq against the reference on the checked rows, its dtype the case's, every element finite."""
        case, (rows, expected) = self.case, self.expected
        dq = np.asarray(out)
        shape = (case.batch, case.q_heads, case.q_len, case.head_dim)
        if dq.shape != shape or dq.dtype != out_dtype(case.dtype):
            return Check(False, math.inf, 0.0, 0.0, f"dq shape {dq.shape} dtype {dq.dtype}, expected {shape} {out_dtype(case.dtype)}")
        if not np.isfinite(dq.astype(np.float32)).all():
            return Check(False, math.inf, 0.0, 0.0, "non-finite (or unwritten) dq elements")
        return check_close(np.stack([dq[b, h, i] for b, h, i in rows]), expected, "dq", rounding=self.rounding)


AnyProblem = Union[Problem, LayerProblem]


def make_problem(case: Case, seed: int = 0) -> AnyProblem:
    """Random inputs from a fixed seed, drawn in float32 and rounded to the case's dtype (int8: q
    float32, K and V quantized by twinattn.quantize_kv). A layer's weights are normal /
    sqrt(in_features), so q, k, v and the output stay O(1)."""
    rng = np.random.default_rng(seed)
    b, d, dtype = case.batch, case.head_dim, case.dtype
    if case.kind != LAYER:
        drawn = "float32" if dtype == INT8 else dtype
        q = _random(rng, b, case.q_heads, case.q_len, d, dtype=drawn)
        k = _random(rng, b, case.kv_heads, case.k_len, d, dtype=drawn)
        v = _random(rng, b, case.kv_heads, case.k_len, case.value_dim, dtype=drawn)
        kv_lens = None if case.kv_lens is None else np.asarray(case.kv_lens, dtype=np.int64)
        if case.kind == TRAIN:
            dout = _random(rng, b, case.q_heads, case.q_len, case.value_dim, dtype=drawn)
            return TrainProblem(case, q, k, v, kv_lens, 1.0 / math.sqrt(d), dout=dout)
        if dtype != INT8:
            return Problem(case, q, k, v, kv_lens, 1.0 / math.sqrt(d))
        quantize = twinattn.quantize_kv
        (k8, k_scale), (v8, v_scale) = quantize(k), quantize(v)
        for a in (k8, k_scale, v8, v_scale):
            a.flags.writeable = False  # shared by every backend
        return Problem(case, q, k8, v8, kv_lens, 1.0 / math.sqrt(d), k_scale, v_scale)
    h, q_out, kv_out = case.hidden_size, case.q_heads * d, case.kv_heads * d
    weights = {
        "q_proj.weight": _random(rng, q_out, h, scale=h**-0.5),
        "k_proj.weight": _random(rng, kv_out, h, scale=h**-0.5),
        "v_proj.weight": _random(rng, kv_out, h, scale=h**-0.5),
        "o_proj.weight": _random(rng, h, q_out, scale=q_out**-0.5),
    }
    hidden = _random(rng, b, case.q_len, h)
    past_k = _random(rng, b, case.kv_heads, case.cached, d)
    past_v = _random(rng, b, case.kv_heads, case.cached, d)
    return LayerProblem(case, hidden, weights, past_k, past_v)
