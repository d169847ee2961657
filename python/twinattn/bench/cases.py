"""The standard suite: named cases, the work each one does, its inputs, and the check of a result.

A case is one attention call, q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D), float32, always with
bottom-right causal alignment (the queries are the last Lq positions of each sequence, the
KV-cache convention of twinattn.attention with q_offset=None).

Work is counted exactly, from the visible (query row, key) pairs of every query head:
    row i of sequence b sees keys j < min(kv_len[b], q_offset[b] + i + 1),
    q_offset[b] = kv_len[b] - Lq,
    FLOPs = 2 x pairs x (D + Dv)          (Q.K^T and P.V, one multiply-add = 2 FLOPs)
    K/V bytes = sum_b kv_len[b] x Hkv x (D + Dv) x 4    (each K and V row read once)
GB/s is reported for decode cases, where reading K and V is the cost.

One case is a layer, not a kernel call: layer-decode times one decode step of twinattn.nn.Attention
(q/k/v projections, RoPE, KV-cache append, attention, o_proj) on a cache of `k_len - q_len` tokens,
and beside it twinattn.attention alone on the same cache views. Its work counts (pairs, FLOPs, K/V
bytes) are the attention kernel's; its check is the whole step against a float64 recomputation.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

PREFILL = "prefill"
DECODE = "decode"
LAYER = "layer"  # one step of twinattn.nn.Attention with a KVCache (see LayerProblem)


@dataclass(frozen=True)
class Case:
    """One benchmark problem. `group` is the suite entry it belongs to; `x` its value of N."""

    name: str
    group: str
    kind: str  # PREFILL (compute-bound), DECODE (one query row per sequence, read-bound) or LAYER
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    value_dim: int
    causal: bool = True
    kv_lens: Optional[tuple[int, ...]] = None  # None: every sequence has k_len keys
    threads: Optional[int] = None  # None: the run's thread count (--threads)
    x: int = 0  # N, for plots
    note: str = ""
    hidden_size: int = 0  # LAYER: the model width of nn.Attention; 0 for a kernel case

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
        return dataclasses.replace(self, q_len=q_len, k_len=k_len, kv_lens=lens, x=max(1, self.x // factor))


@dataclass(frozen=True)
class Work:
    pairs: int  # visible (query row, key) pairs, summed over batch and query heads
    flops: int  # 2 x pairs x (D + Dv)
    kv_bytes: int  # bytes of K and V that must be read (visible keys only, each once)


def visible_keys_per_row(case: Case) -> np.ndarray:
    """(B, Lq) number of keys row i of sequence b may attend to."""
    lens = case.lens[:, None]
    if not case.causal:
        return np.broadcast_to(lens, (case.batch, case.q_len)).copy()
    rows = np.arange(case.q_len, dtype=np.int64)[None, :]
    return np.clip(case.q_offsets[:, None] + rows + 1, 0, lens)


def work(case: Case) -> Work:
    pairs = int(visible_keys_per_row(case).sum()) * case.q_heads
    flops = 2 * pairs * (case.head_dim + case.value_dim)
    # A key is read if any row sees it: the longest row's visible prefix, per sequence.
    read = visible_keys_per_row(case).max(axis=1, initial=0) if case.q_len else np.zeros(case.batch, np.int64)
    kv_bytes = int(read.sum()) * case.kv_heads * (case.head_dim + case.value_dim) * 4
    return Work(pairs=pairs, flops=flops, kv_bytes=kv_bytes)


def _prefill(group: str, n: int, q_heads: int, kv_heads: int, head_dim: int, **extra: object) -> Case:
    return Case(
        name=f"{group}/N={n}",
        group=group,
        kind=PREFILL,
        batch=1,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=n,
        k_len=n,
        head_dim=head_dim,
        value_dim=head_dim,
        x=n,
        **extra,  # type: ignore[arg-type]
    )


def _decode(n: int) -> Case:
    return Case(
        name=f"decode/N={n}",
        group="decode",
        kind=DECODE,
        batch=1,
        q_heads=32,
        kv_heads=8,
        q_len=1,
        k_len=n,
        head_dim=128,
        value_dim=128,
        x=n,
    )


def layer_decode_case(
    hidden_size: int, q_heads: int, kv_heads: int, head_dim: int, cached: int, name: str = "layer-decode"
) -> Case:
    return Case(
        name=name,
        group=name,
        kind=LAYER,
        batch=1,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=1,
        k_len=cached + 1,
        head_dim=head_dim,
        value_dim=head_dim,
        x=cached,
        hidden_size=hidden_size,
        note=f"one nn.Attention decode step on a {cached}-token cache, and the kernel alone",
    )


def standard_suite(all_threads: int) -> list[Case]:
    """Issue 3's suite, float32, B=1 unless said. `all_threads` is the scaling case's top count."""
    cases = [_prefill("prefill-causal", n, 32, 8, 128) for n in (512, 1024, 2048, 4096)]
    cases.append(_prefill("prefill-mha-d64", 2048, 16, 16, 64))
    cases.append(
        Case(
            name="chunk",
            group="chunk",
            kind=PREFILL,
            batch=1,
            q_heads=32,
            kv_heads=8,
            q_len=256,
            k_len=4096,
            head_dim=128,
            value_dim=128,
            x=4096,
            note="256 new queries after 3840 cached tokens",
        )
    )
    cases.extend(_decode(n) for n in (1024, 4096, 16384, 32768))
    cases.append(
        Case(
            name="decode-batch",
            group="decode-batch",
            kind=DECODE,
            batch=8,
            q_heads=32,
            kv_heads=8,
            q_len=1,
            k_len=8192,
            head_dim=128,
            value_dim=128,
            kv_lens=tuple(range(1024, 8193, 1024)),
            x=8192,
            note="per-sequence kv_lens 1024..8192",
        )
    )
    cases.append(
        Case(
            name="tiny",
            group="tiny",
            kind=PREFILL,
            batch=1,
            q_heads=1,
            kv_heads=1,
            q_len=16,
            k_len=16,
            head_dim=64,
            value_dim=64,
            x=16,
            note="per-call overhead",
        )
    )
    thread_counts = sorted({1, all_threads})
    for t in thread_counts:
        cases.append(
            dataclasses.replace(
                _prefill("threads", 2048, 32, 8, 128, threads=t),
                name=f"threads/T={t}",
                x=t,
                note=f"prefill-causal N=2048 on {t} thread{'s' if t > 1 else ''}",
            )
        )
    # issue 6, item 5: Llama-3-8B's attention layer, one decode step on a 4096-token cache
    cases.append(layer_decode_case(hidden_size=4096, q_heads=32, kv_heads=8, head_dim=128, cached=4096))
    return cases


QUICK_CASES = ("prefill-causal/N=2048", "chunk", "decode/N=16384", "decode-batch", "tiny", "layer-decode")


def select(suite: Sequence[Case], spec: Optional[str], quick: bool) -> list[Case]:
    """Cases named by a comma-separated list of case names, group names or globs (in suite order).

    Raises ValueError listing the valid names when a name matches nothing.
    """
    if spec is None:
        if not quick:
            return list(suite)
        return [c for c in suite if c.name in QUICK_CASES]
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    if not wanted:
        raise ValueError("--cases: expected a comma-separated list of case or group names, got nothing")
    chosen: set[str] = set()
    for pattern in wanted:
        hits = [
            c.name for c in suite if c.name == pattern or c.group == pattern or fnmatch.fnmatchcase(c.name, pattern)
        ]
        if not hits:
            groups = list(dict.fromkeys(c.group for c in suite))
            raise ValueError(
                f"--cases: unknown case {pattern!r}; valid groups: {', '.join(groups)}; "
                f"valid cases: {', '.join(c.name for c in suite)}"
            )
        chosen.update(hits)
    return [c for c in suite if c.name in chosen]


# ----------------------------------------------------------------------------------------------
# Inputs and the check of a result


@dataclass
class Problem:
    """The arrays of one case, made once and shared (read-only) by every backend."""

    case: Case
    q: np.ndarray  # (B, Hq, Lq, D) float32
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    kv_lens: Optional[np.ndarray]  # (B,) int64, or None
    scale: float


def make_problem(case: Case, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    q = normal(case.batch, case.q_heads, case.q_len, case.head_dim)
    k = normal(case.batch, case.kv_heads, case.k_len, case.head_dim)
    v = normal(case.batch, case.kv_heads, case.k_len, case.value_dim)
    for a in (q, k, v):
        a.flags.writeable = False  # shared by every backend: none may change them
    kv_lens = None if case.kv_lens is None else np.asarray(case.kv_lens, dtype=np.int64)
    return Problem(case, q, k, v, kv_lens, 1.0 / math.sqrt(case.head_dim))


def check_rows(case: Case, count: int = 4, seed: int = 1) -> list[tuple[int, int, int]]:
    """The (sequence, query head, query row) triples a result is checked on.

    Every sequence; the first, last and a middle query head (they read different KV heads); the
    first, last and middle row plus a few random ones (the diagonal moves from row to row).
    """
    rng = np.random.default_rng(seed)
    heads = sorted({0, case.q_heads // 2, case.q_heads - 1})
    rows = {0, case.q_len // 2, case.q_len - 1}
    rows.update(int(r) for r in rng.integers(0, case.q_len, size=count))
    return [(b, h, i) for b in range(case.batch) for h in heads for i in sorted(rows)]


@dataclass
class Check:
    ok: bool
    max_abs_err: float
    max_abs_ref: float
    tolerance: float
    reason: str = ""


# A float32 kernel's error on these problems is ~1e-6 of the output's size; a wrong mask, offset or
# head mapping moves some output by a whole visible key's weight, ~1/N of it or more.
RELATIVE_TOLERANCE = 2e-4


def reference_rows(problem: Problem, rows: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The float64 reference output of the chosen rows, computed directly: (len(rows), Dv)."""
    case = problem.case
    group = case.q_heads // case.kv_heads
    visible = visible_keys_per_row(case)
    result = np.zeros((len(rows), case.value_dim))
    for n, (b, h, i) in enumerate(rows):
        keys = int(visible[b, i])
        if keys == 0:
            continue
        q = problem.q[b, h, i].astype(np.float64)
        k = problem.k[b, h // group, :keys].astype(np.float64)
        v = problem.v[b, h // group, :keys].astype(np.float64)
        scores = (k @ q) * problem.scale
        weights = np.exp(scores - scores.max())
        result[n] = (weights / weights.sum()) @ v
    return result


def check_output(
    problem: Problem, out: np.ndarray, rows: Sequence[tuple[int, int, int]], expected: np.ndarray
) -> Check:
    """Compare a backend's output (B, Hq, Lq, Dv) with the reference on `rows`, and check that every
    element was written and is finite (outputs are prefilled with NaN where the backend allows)."""
    case = problem.case
    shape = (case.batch, case.q_heads, case.q_len, case.value_dim)
    out = np.asarray(out)
    if out.shape != shape:
        return Check(False, math.inf, 0.0, 0.0, f"output shape {out.shape}, expected {shape}")
    got = np.stack([out[b, h, i] for b, h, i in rows]).astype(np.float64)
    err = float(np.max(np.abs(got - expected))) if got.size else 0.0
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    tolerance = RELATIVE_TOLERANCE * max(scale, 1e-3)
    if not math.isfinite(err):
        return Check(False, math.inf, scale, tolerance, "non-finite output on checked rows")
    if not np.isfinite(out).all():
        return Check(False, err, scale, tolerance, "non-finite (or unwritten) output elements")
    if err > tolerance:
        return Check(False, err, scale, tolerance, f"max abs error {err:.2e} > tolerance {tolerance:.2e}")
    return Check(True, err, scale, tolerance)


# ----------------------------------------------------------------------------------------------
# The layer case: inputs and the float64 recomputation of the step

ROPE_BASE = 500000.0  # Llama 3's rope_theta


@dataclass
class LayerProblem:
    """One decode step's inputs, made once and shared (read-only) by every backend.

    weights: torch Linear orientation (out_features, in_features), float32, for load_state_dict.
    past_k, past_v: (B, Hkv, cached, D) what the cache holds before the step (keys as stored, i.e.
    already rotated; random, so their positions do not matter). hidden: (B, q_len, hidden_size).
    """

    case: Case
    hidden: np.ndarray
    weights: dict[str, np.ndarray]
    past_k: np.ndarray
    past_v: np.ndarray
    rope_base: float = ROPE_BASE

    @property
    def cached(self) -> int:
        return self.case.cached

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.head_dim)


def make_layer_problem(case: Case, seed: int = 0) -> LayerProblem:
    """Random weights (normal / sqrt(in_features), so q, k, v and the output stay O(1)), hidden
    state and cache, all float32 from a fixed seed."""
    if case.kind != LAYER:
        raise ValueError(f"make_layer_problem: {case.name} is not a layer case")
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
        a = rng.standard_normal(shape, dtype=np.float32)
        if scale != 1.0:
            a *= np.float32(scale)
        a.flags.writeable = False  # shared by every backend: none may change them
        return a

    h, d = case.hidden_size, case.head_dim
    q_out, kv_out = case.q_heads * d, case.kv_heads * d
    weights = {
        "q_proj.weight": normal(q_out, h, scale=h**-0.5),
        "k_proj.weight": normal(kv_out, h, scale=h**-0.5),
        "v_proj.weight": normal(kv_out, h, scale=h**-0.5),
        "o_proj.weight": normal(h, q_out, scale=q_out**-0.5),
    }
    hidden = normal(case.batch, case.q_len, h)
    past_k = normal(case.batch, case.kv_heads, case.cached, d)
    past_v = normal(case.batch, case.kv_heads, case.cached, d)
    return LayerProblem(case, hidden, weights, past_k, past_v)


@dataclass
class LayerExpected:
    out: np.ndarray  # (B, q_len, hidden_size) float64: the step's output
    attn: np.ndarray  # (B, Hq, q_len, D) float64: the attention output inside it (the kernel's result)


def rope_rotate(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Llama's default RoPE (rotate-half, every feature rotated) of x (..., L, D) at positions (L,),
    in x's dtype; written out here so the check does not share twinattn.RotaryEmbedding's code."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    theta = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (L, D/2)
    cos = np.concatenate([np.cos(theta)] * 2, axis=-1).astype(x.dtype)
    sin = np.concatenate([np.sin(theta)] * 2, axis=-1).astype(x.dtype)
    half = d // 2
    rotated_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    rotated: np.ndarray = x * cos + rotated_half * sin
    return rotated


def layer_reference(problem: LayerProblem) -> LayerExpected:
    """The step recomputed in float64 from the float32 inputs: projections, RoPE at positions
    cached .. cached + q_len - 1, the new keys and values after the cached ones, causal attention
    (row i sees keys j <= cached + i), output projection. nn.Attention takes float32 only, so this
    is a direct NumPy recomputation rather than nn.Attention(backend="numpy") in float64."""
    case = problem.case
    b, length, d, hq, hkv = case.batch, case.q_len, case.head_dim, case.q_heads, case.kv_heads
    w = {name: a.astype(np.float64) for name, a in problem.weights.items()}
    x = problem.hidden.astype(np.float64)

    def heads(a: np.ndarray, count: int) -> np.ndarray:  # (B, L, H * D) -> (B, H, L, D)
        return a.reshape(b, length, count, d).transpose(0, 2, 1, 3)

    positions = problem.cached + np.arange(length)
    q = rope_rotate(heads(x @ w["q_proj.weight"].T, hq), positions, problem.rope_base)
    k = rope_rotate(heads(x @ w["k_proj.weight"].T, hkv), positions, problem.rope_base)
    v = heads(x @ w["v_proj.weight"].T, hkv)
    keys = np.concatenate([problem.past_k.astype(np.float64), k], axis=2)  # (B, Hkv, S, D)
    values = np.concatenate([problem.past_v.astype(np.float64), v], axis=2)
    group = hq // hkv
    qg = q.reshape(b, hkv, group, length, d)  # query head h reads KV head h // group
    scores = qg @ keys[:, :, None].swapaxes(-1, -2) * problem.scale  # (B, Hkv, G, L, S)
    visible = np.arange(keys.shape[2])[None, :] <= positions[:, None]  # (L, S)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    attn = (weights / weights.sum(axis=-1, keepdims=True)) @ values[:, :, None]  # (B, Hkv, G, L, D)
    attn = attn.reshape(b, hq, length, d)
    merged = attn.transpose(0, 2, 1, 3).reshape(b, length, hq * d)
    return LayerExpected(out=merged @ w["o_proj.weight"].T, attn=attn)


def check_close(got: object, expected: np.ndarray, what: str = "output") -> Check:
    """Every element of `got` against the float64 `expected`, tolerance RELATIVE_TOLERANCE x the
    largest |expected| (the rule of check_output, on the whole array)."""
    got = np.asarray(got)
    if got.shape != expected.shape:
        return Check(False, math.inf, 0.0, 0.0, f"{what} shape {got.shape}, expected {expected.shape}")
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    tolerance = RELATIVE_TOLERANCE * max(scale, 1e-3)
    if not np.isfinite(got).all():
        return Check(False, math.inf, scale, tolerance, f"non-finite {what} elements")
    err = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    if err > tolerance:
        return Check(False, err, scale, tolerance, f"{what}: max abs error {err:.2e} > tolerance {tolerance:.2e}")
    return Check(True, err, scale, tolerance)
