"""Load and memory checks (not timed unit tests): run with the installed package.

    python scripts/stress.py [--threads 8] [--iterations 300] [--decode-steps 100000] [--million]

1. Concurrency: N Python threads call both native ports at once on mixed shapes (prefill,
   chunks, decode, masks, ragged kv_lens) for a fixed number of iterations; every result must
   equal the one computed alone beforehand (to float32 tolerance), no thread may hang (each join
   has a deadline), and resident memory must stay flat after warm-up.
2. A long decode loop through KVCache and nn.Attention: resident memory must not grow (the cache
   is a sliding window cropped back when full, so the work per step stays bounded).
3. (--million) one decode over a cache of 1,000,000 keys: works, with peak memory linear in the
   cache (K + V plus a small constant).
Exits 1 on any failure and prints what it measured.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time

import numpy as np

import twinattn

PAGE = 4096


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_problems(rng: np.random.Generator) -> list[tuple[tuple[np.ndarray, ...], dict]]:
    problems = []
    for lq, lk, hq, hkv, d in [(1, 4096, 32, 8, 128), (64, 700, 8, 2, 64), (300, 300, 4, 4, 80), (3, 9000, 8, 1, 128), (16, 16, 1, 1, 64)]:
        q = rng.standard_normal((2, hq, lq, d), dtype=np.float32)
        k = rng.standard_normal((2, hkv, lk, d), dtype=np.float32)
        v = rng.standard_normal((2, hkv, lk, d), dtype=np.float32)
        lens = np.array([lk, max(lq, lk // 2)])
        problems.append(((q, k, v), dict(causal=True, kv_lens=lens)))
        mask = rng.random((lq, lk)) < 0.9
        problems.append(((q, k, v), dict(causal=False, attn_mask=mask)))
    return problems


def concurrency(threads: int, iterations: int) -> bool:
    rng = np.random.default_rng(0)
    problems = make_problems(rng)
    ports = [p for p in ("cpp", "rust") if p in twinattn.backends()]
    expected = {(port, i): twinattn.attention(*args, backend=port, **kw) for port in ports for i, (args, kw) in enumerate(problems)}
    failures: list[str] = []
    rss_after_warmup: list[float] = []

    def worker(index: int) -> None:
        local = np.random.default_rng(index)
        for it in range(iterations):
            i = int(local.integers(len(problems)))
            port = ports[int(local.integers(len(ports)))]
            args, kw = problems[i]
            got = twinattn.attention(*args, backend=port, num_threads=int(local.integers(1, 3)), **kw)
            want = expected[(port, i)]
            if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                failures.append(f"thread {index} iteration {it}: {port} problem {i} differs by {np.abs(got - want).max():.3g}")
            if index == 0 and it == iterations // 5:
                rss_after_warmup.append(rss_mib())

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + 900
    for t in pool:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in pool)
    end_rss = rss_mib()
    warm = rss_after_warmup[0] if rss_after_warmup else end_rss
    grew = end_rss - warm
    print(f"concurrency: {threads} threads x {iterations} calls on {ports}, {time.perf_counter() - start:.1f} s; "
          f"{len(failures)} wrong results, {hung} hung threads; RSS {warm:.0f} MiB after warm-up, {end_rss:.0f} MiB at the end")
    for line in failures[:5]:
        print("  ", line)
    return not failures and not hung and grew < 64


def decode_loop(steps: int, backend: str) -> bool:
    rng = np.random.default_rng(1)
    hidden, heads, kv_heads, head_dim, window = 128, 4, 2, 32, 512
    attn = twinattn.nn.Attention(hidden, heads, kv_heads, head_dim, rope=twinattn.RotaryEmbedding(head_dim), backend=backend)
    cache = twinattn.KVCache(1, 1, kv_heads, head_dim, max_seq_len=window)
    attn(rng.standard_normal((1, 8, hidden), dtype=np.float32), cache=cache)
    token = rng.standard_normal((1, 1, hidden), dtype=np.float32)
    samples = []
    start = time.perf_counter()
    for step in range(steps):
        if cache.seq_lens(0)[0] >= window:
            cache.crop(window // 2)
        out = attn(token, cache=cache)
        if not np.all(np.isfinite(out)):
            print(f"decode loop ({backend}): non-finite output at step {step}")
            return False
        if step % max(1, steps // 10) == 0:
            samples.append(rss_mib())
    grew = samples[-1] - samples[1] if len(samples) > 2 else 0.0
    print(f"decode loop ({backend}): {steps} steps in {time.perf_counter() - start:.1f} s; RSS samples (MiB) "
          f"{', '.join(f'{s:.0f}' for s in samples)}; growth after warm-up {grew:.1f} MiB")
    return grew < 16


def million_keys(backend: str) -> bool:
    keys, head_dim = 1_000_000, 128
    before = rss_mib()
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, 1, keys, head_dim), dtype=np.float32)
    v = rng.standard_normal((1, 1, keys, head_dim), dtype=np.float32)
    q = rng.standard_normal((1, 8, 1, head_dim), dtype=np.float32)
    payload = (k.nbytes + v.nbytes) / 2**20
    start = time.perf_counter()
    out = twinattn.attention(q, k, v, causal=True, backend=backend)
    took = time.perf_counter() - start
    # float64 check of one head, done in chunks so the check itself stays linear in memory
    m, total, acc = -np.inf, 0.0, np.zeros(head_dim)
    for s in range(0, keys, 100_000):
        scores = (k[0, 0, s : s + 100_000].astype(np.float64) @ q[0, 3, 0].astype(np.float64)) / np.sqrt(head_dim)
        new_m = max(m, scores.max())
        w = np.exp(scores - new_m)
        total = total * np.exp(m - new_m) + w.sum()
        acc = acc * np.exp(m - new_m) + w @ v[0, 0, s : s + 100_000].astype(np.float64)
        m = new_m
    err = float(np.abs(out[0, 3, 0] - acc / total).max())
    extra = rss_mib() - before - payload
    print(f"one million keys ({backend}): {took * 1e3:.1f} ms, K+V {payload:.0f} MiB, memory beyond K+V {extra:.0f} MiB, "
          f"peak RSS {peak_mib():.0f} MiB, max error {err:.2e}")
    return err < 1e-5 and extra < 0.25 * payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--decode-steps", type=int, default=100_000)
    parser.add_argument("--million", action="store_true")
    args = parser.parse_args()
    print(f"twinattn {twinattn.__version__}, backends {twinattn.backends()}")
    ok = concurrency(args.threads, args.iterations)
    for backend in [p for p in ("cpp", "rust") if p in twinattn.backends()]:
        ok &= decode_loop(args.decode_steps, backend)
        if args.million:
            ok &= million_keys(backend)
    print("stress: OK" if ok else "stress: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
