"""The serving cases: packed and paged attention against the same problem laid out contiguously.

Each case is one problem computed several ways; every way is checked against a float64 reference
(on a few rows of every sequence) before it is timed, and the table gives each way's median and
the ratio to the paged call on the same backend (> 1: the paged call is faster). Llama-3-8B's
attention shape (Hq 32, Hkv 8, D 128), float32, causal with the queries at each sequence's last
positions:

  paged-decode         8 sequences x 4096 keys, one query each, in blocks of 16 shuffled through
                       the pool: attention_paged, against twinattn.attention on the same keys
                       stored contiguously (B, Hkv, L, D) with kv_lens ("contiguous"), and torch's
                       scaled_dot_product_attention on those contiguous tensors ("torch-sdpa")
  paged-decode-block1  the same with blocks of one token (every key a random row of the pool)
  cascade              16 sequences sharing a 4096-token prefix (the same block ids) plus 64
                       tokens of their own, one query each: attention_paged on the shared table,
                       against private copies of the prefix per sequence ("private-copies", the
                       same keys in 16x the blocks) and torch SDPA on the gathered (16, 8, 4160, 128)
  chunked-prefill      one mixed call: 4 decode rows and 2 prefill chunks of 512 queries, every
                       sequence 2048 keys long: attention_paged once, against two paged calls (the
                       decode rows, then the chunks: "separate-calls") and torch SDPA on the
                       gathered keys (one call for the decode rows, one with a bottom-right mask
                       for the chunks)

twinattn's ways run on each of its backends asked for (--backends: cpp, rust, numpy), torch's
once when torch is asked for and importable; `--shrink K` divides every length by K (a smoke run).
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

import twinattn

from .peers import PORTS, Part
from .suite import Check, check_close
from .timing import Budget, _time_calls, _warm_up, timed_call

SERVING = "serving"
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGED = "paged"  # the way every ratio is against
TWINATTN_BACKENDS = (*PORTS, "numpy")  # the backends twinattn's ways run on (torch's way runs once)


@dataclass(frozen=True)
class ServingCase:
    name: str  # "serving/<what>"
    title: str


CASES = {
    "paged-decode": ServingCase(f"{SERVING}/paged-decode", "decode, 8 x 4096 keys in shuffled blocks of 16"),
    "paged-decode-block1": ServingCase(f"{SERVING}/paged-decode-block1", "decode, 8 x 4096 keys in blocks of 1 token"),
    "cascade": ServingCase(f"{SERVING}/cascade", "decode, 16 sequences sharing a 4096-token prefix + 64 own tokens"),
    "chunked-prefill": ServingCase(f"{SERVING}/chunked-prefill", "4 decode rows + 2 chunks of 512 queries, 2048 keys each"),
}


@dataclass
class Scenario:
    """One problem: the ways to compute it (name -> (backend, call returning the packed output
    (total_q, Hq, Dv))), and the float64 reference on `check_rows` of that output."""

    ways: list[tuple[str, str, Callable[[], np.ndarray]]]
    check_rows: np.ndarray
    expected: np.ndarray
    notes: list[str] = field(default_factory=list)


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


class _Pool:
    """Sequences' keys and values (each (L_b, Hkv, D)) scattered into shuffled blocks of a pool,
    with the sequences named in `shared` reusing the blocks of the first one for their first
    `shared_tokens` positions."""

    def __init__(self, rng: np.random.Generator, keys: list[np.ndarray], values: list[np.ndarray], block_size: int,
                 shared_tokens: int = 0) -> None:
        shared_blocks = shared_tokens // block_size
        counts = [-(-k.shape[0] // block_size) for k in keys]
        owned = [c - (shared_blocks if b else 0) for b, c in enumerate(counts)]
        ids = rng.permutation(sum(owned))
        pool_shape = (len(ids), block_size, KV_HEADS)
        self.k_cache = np.zeros(pool_shape + (keys[0].shape[2],), np.float32)
        self.v_cache = np.zeros(pool_shape + (values[0].shape[2],), np.float32)
        self.table = np.full((len(keys), max(counts)), -1, np.int32)
        self.seq_lens = np.array([k.shape[0] for k in keys], np.int64)
        taken = 0
        for b, (k, v) in enumerate(zip(keys, values)):
            first = shared_blocks if b else 0
            self.table[b, :first] = self.table[0, :first]
            mine = ids[taken : taken + owned[b]]
            taken += owned[b]
            self.table[b, first : counts[b]] = mine
            for pool, data in ((self.k_cache, k), (self.v_cache, v)):
                padded = np.zeros((counts[b] * block_size,) + data.shape[1:], np.float32)
                padded[: data.shape[0]] = data
                pool[mine] = padded[first * block_size :].reshape((owned[b], block_size) + data.shape[1:])

    def call(self, q: np.ndarray, port: str, cu_seqlens_q: Optional[np.ndarray] = None, rows: slice = slice(None)) -> np.ndarray:
        return twinattn.attention_paged(q, self.k_cache, self.v_cache, self.table[rows], self.seq_lens[rows],
                                        cu_seqlens_q=cu_seqlens_q, backend=port)


def _reference(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray], cu_q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """float64 attention of the packed query rows `rows` over their sequence's keys, bottom-right causal."""
    expected = []
    for row in rows:
        b = int(np.searchsorted(cu_q, row, side="right") - 1)
        k, v = keys[b].astype(np.float64).swapaxes(0, 1), values[b].astype(np.float64).swapaxes(0, 1)
        position = k.shape[1] - int(cu_q[b + 1] - cu_q[b]) + int(row - cu_q[b])
        out = twinattn.attention(q[row][:, None].astype(np.float64), k, v, causal=True, q_offset=position, backend="numpy")
        expected.append(out[:, 0])
    return np.stack(expected)


def _torch_sdpa(keys: list[np.ndarray], values: list[np.ndarray]) -> Optional[Callable[[np.ndarray, slice, int], np.ndarray]]:
    """torch's SDPA over the gathered contiguous keys of sequences [rows] (all of one length), q
    (Lq * len, Hq, D) packed; None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    k_all = torch.from_numpy(np.stack(keys).transpose(0, 2, 1, 3).copy())  # (B, Hkv, L, D)
    v_all = torch.from_numpy(np.stack(values).transpose(0, 2, 1, 3).copy())

    def call(q: np.ndarray, rows: slice, q_len: int) -> np.ndarray:
        k, v = k_all[rows], v_all[rows]
        batch, length = k.shape[0], k.shape[2]
        qt = torch.from_numpy(q).reshape(batch, q_len, Q_HEADS, -1).transpose(1, 2)
        mask = None
        if q_len > 1:  # bottom-right causal: row i sits at length - q_len + i
            mask = torch.arange(length)[None, :] <= (length - q_len + torch.arange(q_len))[:, None]
        with torch.inference_mode():
            out = torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=True)
        result: np.ndarray = out.transpose(1, 2).reshape(batch * q_len, Q_HEADS, -1).numpy()
        return result

    return call


def build(name: str, ports: Sequence[str], shrink: int = 1, with_torch: bool = True, seed: int = 0) -> Scenario:
    """The problem of case `name` and its ways, on the native ports `ports` (and torch)."""
    rng = np.random.default_rng(seed)
    ways: list[tuple[str, str, Callable[[], np.ndarray]]] = []
    notes: list[str] = []
    if name in ("paged-decode", "paged-decode-block1"):
        batch, length = 8, max(4096 // shrink, 1)
        block = 1 if name == "paged-decode-block1" else 16
        keys = [_rand(rng, length, KV_HEADS, HEAD_DIM) for _ in range(batch)]
        values = [_rand(rng, length, KV_HEADS, HEAD_DIM) for _ in range(batch)]
        pool = _Pool(rng, keys, values, block)
        q = _rand(rng, batch, Q_HEADS, HEAD_DIM)
        cu_q = np.arange(batch + 1)
        k_dense = np.stack(keys).transpose(0, 2, 1, 3)  # (B, Hkv, L, D), a view of the stacked keys
        v_dense = np.stack(values).transpose(0, 2, 1, 3)
        lens = pool.seq_lens
        def contiguous(port: str) -> np.ndarray:
            out: np.ndarray = twinattn.attention(q[:, :, None], k_dense, v_dense, causal=True, kv_lens=lens, backend=port)
            return out[:, :, 0]

        for port in ports:
            ways.append((PAGED, port, functools.partial(pool.call, q, port)))
            ways.append(("contiguous", port, functools.partial(contiguous, port)))
        torch_call = _torch_sdpa(keys, values) if with_torch else None
        if torch_call is not None:
            ways.append(("torch-sdpa", "torch", functools.partial(torch_call, q, slice(None), 1)))
        rows = np.arange(batch)
    elif name == "cascade":
        batch, prefix, own = 16, max(4096 // shrink, 16), max(64 // shrink, 1)
        shared_k, shared_v = _rand(rng, prefix, KV_HEADS, HEAD_DIM), _rand(rng, prefix, KV_HEADS, HEAD_DIM)
        keys = [np.concatenate([shared_k, _rand(rng, own, KV_HEADS, HEAD_DIM)]) for _ in range(batch)]
        values = [np.concatenate([shared_v, _rand(rng, own, KV_HEADS, HEAD_DIM)]) for _ in range(batch)]
        shared = _Pool(rng, keys, values, 16, shared_tokens=prefix)
        private = _Pool(rng, keys, values, 16)
        notes.append(f"pool blocks: shared {shared.k_cache.shape[0]}, private copies {private.k_cache.shape[0]}")
        q = _rand(rng, batch, Q_HEADS, HEAD_DIM)
        cu_q = np.arange(batch + 1)
        for port in ports:
            ways.append((PAGED, port, functools.partial(shared.call, q, port)))
            ways.append(("private-copies", port, functools.partial(private.call, q, port)))
        torch_call = _torch_sdpa(keys, values) if with_torch else None
        if torch_call is not None:
            ways.append(("torch-sdpa", "torch", functools.partial(torch_call, q, slice(None), 1)))
        rows = np.arange(batch)
    elif name == "chunked-prefill":
        decode, chunks, chunk, length = 4, 2, max(512 // shrink, 2), max(2048 // shrink, 4)
        keys = [_rand(rng, length, KV_HEADS, HEAD_DIM) for _ in range(decode + chunks)]
        values = [_rand(rng, length, KV_HEADS, HEAD_DIM) for _ in range(decode + chunks)]
        pool = _Pool(rng, keys, values, 16)
        q_lens = [1] * decode + [chunk] * chunks
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
        q = _rand(rng, int(cu_q[-1]), Q_HEADS, HEAD_DIM)
        chunk_cu = cu_q[decode:] - decode

        def separate(port: str) -> np.ndarray:
            first = pool.call(q[:decode], port, rows=slice(0, decode))
            second = pool.call(q[decode:], port, chunk_cu, rows=slice(decode, None))
            return np.concatenate([first, second])

        for port in ports:
            ways.append((PAGED, port, functools.partial(pool.call, q, port, cu_q)))
            ways.append(("separate-calls", port, functools.partial(separate, port)))
        torch_call = _torch_sdpa(keys, values) if with_torch else None
        if torch_call is not None:
            sdpa = torch_call

            def torch_ways() -> np.ndarray:
                return np.concatenate([sdpa(q[:decode], slice(0, decode), 1), sdpa(q[decode:], slice(decode, None), chunk)])

            ways.append(("torch-sdpa", "torch", torch_ways))
        ends = cu_q[decode + 1 :]
        rows = np.concatenate([np.arange(decode), ends - 1, ends - chunk, ends - chunk // 2])
    else:
        raise ValueError(f"serving case: expected one of {', '.join(CASES)}, got {name!r}")
    rows = np.unique(rows)
    return Scenario(ways, rows, _reference(q, keys, values, cu_q, rows), notes)


def run_case(name: str, ports: Sequence[str], budget: Budget, shrink: int = 1, with_torch: bool = True) -> dict[str, Any]:
    """Every way of case `name`: checked, warmed up and timed (as the kernel cases are); the rows
    carry each median and its ratio to the paged call on the same backend."""
    scenario = build(name, ports, shrink, with_torch)
    rows: list[dict[str, Any]] = []
    for way, backend, call in scenario.ways:
        row: dict[str, Any] = {"case": CASES[name].name, "way": way, "backend": backend}
        try:
            part = Part(call=call, output=call)
            first = timed_call(part)
            check: Check = check_close(call()[scenario.check_rows], scenario.expected)
            row["max_err"] = check.max_abs_err
            if not check.ok:
                row.update(status="wrong", note=check.reason)
                rows.append(row)
                continue
            row["warmup"] = _warm_up(part, first, budget)
            times = _time_calls([part], budget)[0]
            row.update(status="ok", median_s=statistics.median(times), times=times)
        except Exception as exc:  # noqa: BLE001 - reported in the table, never a traceback
            row.update(status="error", note=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    paged = {r["backend"]: r.get("median_s") for r in rows if r["way"] == PAGED}
    fastest_paged = min((t for t in paged.values() if t), default=None)
    for row in rows:
        base = paged.get(row["backend"], fastest_paged) if row["backend"] in TWINATTN_BACKENDS else fastest_paged
        if row.get("median_s") and base:
            row["vs_paged"] = row["median_s"] / base
    return {"case": CASES[name].name, "title": CASES[name].title, "notes": scenario.notes, "rows": rows}


def format_rows(entries: Sequence[dict[str, Any]]) -> str:
    """The serving table: per case, per way and backend, the median and the ratio to the paged call
    (on the same port; torch's against the fastest port's paged call)."""
    lines = [f"{'case':<28} {'way':<16} {'backend':<8} {'median':>10} {'vs paged':>9}  max err"]
    for entry in entries:
        for row in entry["rows"]:
            median = row.get("median_s")
            shown = f"{median * 1e3:.3f} ms" if median else row["status"].upper()
            ratio = f"{row['vs_paged']:.2f}x" if "vs_paged" in row else "-"
            err = f"{row['max_err']:.1e}" if "max_err" in row else row.get("note", "")
            lines.append(f"{entry['case']:<28} {row['way']:<16} {row['backend']:<8} {shown:>10} {ratio:>9}  {err}")
        lines.extend(f"{'':<28} {note}" for note in entry["notes"])
    lines.append("vs paged: this way's median / the paged call's (> 1: the paged call is faster)")
    return "\n".join(lines)


def names_in(spec: Sequence[str]) -> list[str]:
    """The serving cases named in --cases: "serving" (all of them) or "serving/<case>"."""
    chosen: list[str] = []
    for word in spec:
        if word == SERVING:
            chosen.extend(CASES)
        elif word.startswith(SERVING + "/"):
            case = word[len(SERVING) + 1 :]
            if case not in CASES:
                raise ValueError(f"--cases: unknown serving case {word!r}; valid: {', '.join(c.name for c in CASES.values())}")
            chosen.append(case)
    return list(dict.fromkeys(chosen))
