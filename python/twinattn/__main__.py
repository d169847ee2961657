"""python -m twinattn: run one default problem on every available backend and check it.

Prints one row per backend: instruction set, max abs error against the float64 reference, and
the median time of a few calls.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import attention, backends, build_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinattn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.q_heads, args.seq_len, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, args.seq_len, args.head_dim)
    q = rng.standard_normal(shape_q, dtype=np.float32)
    k = rng.standard_normal(shape_kv, dtype=np.float32)
    v = rng.standard_normal(shape_kv, dtype=np.float32)
    expected = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True, backend="numpy")

    info = build_info()
    print(f"twinattn {info['version']}: causal attention, q {shape_q}, k/v {shape_kv}, float32")
    print(f"{'backend':<8} {'isa':<8} {'threads':>7} {'max abs err':>12} {'median ms':>10}")
    failed = False
    for backend in backends():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            got = attention(q, k, v, causal=True, backend=backend)
            times.append(time.perf_counter() - start)
        err = float(np.max(np.abs(got - expected)))
        ok = err < 1e-4
        failed |= not ok
        port = info[backend]
        print(
            f"{backend:<8} {port['isa']:<8} {port['threads']:>7} {err:>12.2e} "
            f"{1e3 * float(np.median(times)):>10.2f}{'' if ok else '  WRONG'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
