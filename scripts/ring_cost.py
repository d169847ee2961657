"""The cost of twinattn.distributed.ring_attention: counted, predicted, measured.

    python scripts/ring_cost.py model   [shape options] [--gflops F] [--gbytes-per-s B] [--ranks 2 4 8 ...]
    python scripts/ring_cost.py measure [shape options] [--local-ranks 2] [--threads 1] [--repeats 7]
    torchrun --nnodes P --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        scripts/ring_cost.py measure [shape options]

model: per rank, the arithmetic (counted from the schedule ring_attention runs: twinattn.distributed.
ring_cost) and the bytes sent per step; its spread across ranks; and, from a compute rate F
(GFLOP/s per machine) and a link bandwidth B (GB/s each way), the predicted time per step,
max(compute, transfer), since each step's transfer runs during its compute, against one machine
computing the whole sequence alone.

measure: runs ring_attention on real processes (spawned here with gloo on 127.0.0.1, or started by
torchrun across machines) and times, on every rank, the ring as it runs, the same steps' compute
alone (the blocks against K/V buffers of the same lengths, no transfer) and the same transfers
alone (no compute), taking turns, --repeats runs of each, each after a barrier; the best and the
median runs are reported. Two measures of how much of the communication is hidden:
  - the time the ring waits for its transfers once a step's compute is done (the exposed part),
    against the transfers' time alone: 1 - waited / transfers;
  - end to end, ring minus compute alone, against the transfers alone. On a machine whose cores
    all compute, the transfers' copies (a loopback's are done by the CPU) and any other load show
    here; the wait measure is the one the overlap decides.
Then the transfers once more, each posted before a sleep as long as a step's compute: how far they
proceed in the background when a core is free for gloo's transport thread. (The private helpers
imported below are the ring's own steps, so what is timed alone is exactly what the ring runs.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import twinattn
import twinattn.distributed as td
from twinattn.distributed import _attend, _blocks, _exchange


def _shape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens in the whole sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="bidirectional attention (default: causal)")


def _cost(args: argparse.Namespace, world_size: int) -> td.RingCost:
    return td.ring_cost(args.seq_len, world_size, causal=not args.full, batch=args.batch, q_heads=args.q_heads,
                        kv_heads=args.kv_heads, head_dim=args.head_dim)


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError


def model(args: argparse.Namespace) -> None:
    rate, bandwidth = args.gflops * 1e9, args.gbytes_per_s * 1e9
    alone = _cost(args, 1).rank_flops()[0] / rate
    print(f"L={args.seq_len} B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"{'full' if args.full else 'causal'}; {args.gflops:g} GFLOP/s per machine, {args.gbytes_per_s:g} GB/s links, {args.latency_us:g} us a transfer; "
          f"one machine alone: {alone:.3g} s")
    print(f"{'P':>4} {'GFLOP/rank':>11} {'spread':>7} {'MB sent/step':>13} {'compute/step':>13} {'transfer/step':>14} "
          f"{'predicted':>10} {'speedup':>8}")
    for world_size in args.ranks:
        cost = _cost(args, world_size)
        per_rank = cost.rank_flops()
        steps = max(max(rank) for rank in cost.flops) / rate  # the slowest rank's longest step
        sent = max((max(rank) for rank in cost.bytes_sent if rank), default=0)
        transfer = args.latency_us * 1e-6 + sent / bandwidth if sent else 0.0
        # P steps; the transfers of the first P-1 run during their step's compute
        predicted = world_size * steps + max(0.0, transfer - steps) * (world_size - 1)
        print(f"{world_size:>4} {max(per_rank) / 1e9:>11.4g} {100 * cost.imbalance():>6.2f}% {sent / 1e6:>13.4g} "
              f"{_duration(steps):>13} {_duration(transfer):>14} {_duration(predicted):>10} {alone / predicted:>7.3g}x")


# ---- measure ----------------------------------------------------------------------------------------


def _timed(calls: list[Any], repeats: int) -> list[list[float]]:
    """For each call, the slowest rank's wall time of each of `repeats` runs. The calls take turns
    (one run of each per round, each run after a barrier), so a drift in the machine's speed
    reaches all of them alike. (Process CPU time is not reported: in this project's virtual
    machines it reads about half the time the counted arithmetic needs.)"""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times):
            dist.barrier()
            start = time.perf_counter()
            call()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            spent.append(float(elapsed))
    return times


def _measure_rank(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    causal = not args.full
    gen = torch.Generator().manual_seed(rank)
    length = td._shard_length(args.seq_len, rank, world_size)
    q = torch.randn(args.batch, args.q_heads, length, args.head_dim, generator=gen)
    k = torch.randn(args.batch, args.kv_heads, length, args.head_dim, generator=gen)
    v = torch.randn(args.batch, args.kv_heads, length, args.head_dim, generator=gen)
    lengths = [td._shard_length(args.seq_len, r, world_size) for r in range(world_size)]
    # K/V of every source's length, to compute the ring's steps without receiving anything
    held = {r: (torch.randn(args.batch, args.kv_heads, lengths[r], args.head_dim, generator=gen),
                torch.randn(args.batch, args.kv_heads, lengths[r], args.head_dim, generator=gen)) for r in range(world_size)}
    peers = ((rank + 1) % world_size, (rank - 1) % world_size)
    threads = args.threads

    # the time ring_attention spends waiting for its transfers once a step's compute is done: the
    # part of the communication that was not hidden (the first wait of a run, its shape all_gather,
    # is left out)
    waits: list[list[float]] = []
    wait_for = td._wait

    def timed_wait(work: Any, timeout: Any) -> None:
        start = time.perf_counter()
        wait_for(work, timeout)
        waits[-1].append(time.perf_counter() - start)

    def ring() -> None:
        waits.append([])
        td.ring_attention(q, k, v, causal=causal, num_threads=threads)

    def compute() -> None:
        acc_out = torch.zeros(q.shape[:3] + (v.shape[3],)).numpy()
        acc_lse = torch.full(q.shape[:3], float("-inf")).numpy()
        for step in range(world_size):
            source = (rank - step) % world_size
            k_now, v_now = held[source]
            _attend(q, k_now, v_now, _blocks(rank, source, world_size, args.seq_len, causal), acc_out, acc_lse, None, "auto", threads)

    def transfer() -> None:
        k_now, v_now = k, v
        for step in range(world_size - 1):
            source = (rank - step) % world_size
            k_now, v_now, works = _exchange(k_now, v_now, lengths[(source - 1) % world_size], None, peers)
            for work in works:
                work.wait()

    pause = [0.0]

    def transfer_while_idle() -> None:
        # the same transfers, each posted before a sleep as long as a step's compute: whether they
        # proceed in the background when a core is free for gloo's transport thread
        k_now, v_now = k, v
        for step in range(world_size - 1):
            source = (rank - step) % world_size
            k_now, v_now, works = _exchange(k_now, v_now, lengths[(source - 1) % world_size], None, peers)
            time.sleep(pause[0])
            for work in works:
                work.wait()

    td._wait = timed_wait
    ring()  # warm-up: thread pools, first-touch, connections
    rings, computes, transfers = _timed([ring, compute, transfer], args.repeats)
    waited = torch.tensor([statistics.median(sum(run[1:]) for run in waits[1:])], dtype=torch.float64)
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    t_waited = float(waited)
    pause[0] = statistics.median(computes) / world_size
    (idles,) = _timed([transfer_while_idle], args.repeats)
    if rank != 0:
        return
    cost = _cost(args, world_size)
    sent = max((max(r) for r in cost.bytes_sent if r), default=0)
    median = statistics.median
    t_transfer = median(transfers)
    print(f"P={world_size} L={args.seq_len} B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"{'full' if args.full else 'causal'}, {threads or twinattn.get_num_threads()} kernel thread(s) a rank, "
          f"{args.repeats} runs of each, the slowest rank's times")
    print(f"  arithmetic: {max(cost.rank_flops()) / 1e9:.4g} GFLOP on the busiest rank, spread {100 * cost.imbalance():.2f}%; "
          f"sent per step: {sent / 1e6:.4g} MB")
    # the best run of each (the one the machine's other work disturbed least), and the median
    for name, stat in (("best", min), ("median", median)):
        print(f"  {name:>6} wall: ring {1e3 * stat(rings):.1f} ms | compute alone {1e3 * stat(computes):.1f} ms "
              f"({max(cost.rank_flops()) / stat(computes) / 1e9:.1f} GFLOP/s) | transfers alone {1e3 * stat(transfers):.1f} ms")
    print(f"  waited for transfers after the compute: {1e3 * t_waited:.2f} ms a run (median): "
          f"{100 * (1 - t_waited / t_transfer) if t_transfer > 0 else 100:.0f}% of the transfers' time hidden behind compute")
    print(f"  wall, ring - compute alone: {1e3 * (median(rings) - median(computes)):.1f} ms (median), "
          f"{1e3 * (min(rings) - min(computes)):.1f} ms (best)")
    sleeps = pause[0] * (world_size - 1)
    print(f"  the transfers posted before sleeps of a step's length ({1e3 * pause[0]:.1f} ms) took "
          f"{1e3 * (median(idles) - sleeps):.1f} ms beyond the sleeps (median)")


def _local_rank_entry(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        _measure_rank(args)
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: one rank of many
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        try:
            _measure_rank(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_local_rank_entry, args=(args.local_ranks, port, args), nprocs=args.local_ranks,
                                          start_method="spawn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("model", help="counted arithmetic and traffic, and the predicted time for P machines")
    _shape_options(p)
    p.add_argument("--gflops", type=float, default=190.0, help="attention GFLOP/s of one machine (default: this 2-core one)")
    p.add_argument("--gbytes-per-s", type=float, default=1.25, help="link bandwidth, GB/s each way (default 10 Gbit/s)")
    p.add_argument("--latency-us", type=float, default=50.0, help="fixed cost of one transfer, microseconds")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p = commands.add_parser("measure", help="time the ring, its compute alone and its transfers alone")
    _shape_options(p)
    p.add_argument("--local-ranks", type=int, default=2, help="processes to spawn here when not under torchrun")
    p.add_argument("--threads", type=int, default=None, help="kernel threads a rank (default: twinattn's; 1 when spawned here)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    args = parser.parse_args(argv)
    if args.command == "model":
        model(args)
    else:
        if args.threads is None and "RANK" not in os.environ:
            args.threads = 1  # the spawned ranks share this machine's cores
        measure(args)


if __name__ == "__main__":
    main()
