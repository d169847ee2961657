"""What tests/test_distributed.py runs in its worker processes, and the harness that starts them.

Kept apart from the test module so that each spawned process imports only torch, NumPy and
twinattn (not pytest and the test module's fixtures). Workers check their own results and raise
AssertionError: the harness turns a failing rank into an error in the test.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

import twinattn
import twinattn.distributed as td
from helpers import FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF

# every collective of the tests' process groups gives up after this long (ring_attention's own
# waits use a shorter timeout where a test asks for one)
GROUP_TIMEOUT = datetime.timedelta(seconds=30)


# Ranks start from multiprocessing's fork server, a clean process (started on first use, no threads
# running) that has already imported torch and twinattn: each rank is a fork of it, not a fresh
# interpreter importing torch again (several seconds a process on these 2 cores). The "spawn" start
# method behaves the same, only slower.
START_METHOD = "forkserver"
torch.multiprocessing.get_context(START_METHOD).set_forkserver_preload(["torch", "torch.distributed", "twinattn.distributed", "dist_workers"])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, report_dir: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    # one thread per rank: the ranks share the machine's cores
    torch.set_num_threads(1)
    twinattn.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
        target(rank, world_size, *args)
    except BaseException:
        # for the harness, which lists the ranks' errors in the order they happened
        with open(os.path.join(report_dir, f"rank{rank}"), "w") as report:
            report.write(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        raise
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """One or more ranks raised or died; the message has their tracebacks, the first failure first."""


# after the first rank fails, how long the others have to fail in turn (a broken connection) or
# finish before they are killed
GRACE_S = 3.0


def run_ranks(world_size: int, target: Callable[..., None], *args: Any, limit_s: float = 60.0) -> None:
    """Runs target(rank, world_size, *args) in world_size processes joined by a gloo group on
    127.0.0.1 (a free port each time), and returns when every rank has returned.

    A rank that raises or dies ends the run: the others get GRACE_S seconds, then are killed, and
    RankFailure lists every failed rank's traceback, the one that failed first first (the others
    usually fail because it left). Ranks still running after limit_s are killed: TimeoutError."""
    context = torch.multiprocessing.get_context(START_METHOD)
    with tempfile.TemporaryDirectory() as report_dir:
        port = _free_port()
        processes = [context.Process(target=_entry, args=(rank, world_size, port, report_dir, target, args), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + limit_s
        failed_at: float | None = None
        timed_out = False
        while any(process.is_alive() for process in processes):
            multiprocessing.connection.wait([process.sentinel for process in processes if process.is_alive()], timeout=0.5)
            now = time.monotonic()
            if failed_at is None and any(process.exitcode not in (None, 0) for process in processes):
                failed_at = now
            timed_out = now > deadline
            if timed_out or (failed_at is not None and now > failed_at + GRACE_S):
                for process in processes:
                    if process.is_alive():
                        process.kill()
                for process in processes:
                    process.join(5)
        failures = []
        for rank, process in enumerate(processes):
            path = os.path.join(report_dir, f"rank{rank}")
            if os.path.exists(path):
                with open(path) as report:
                    stamp, text = report.read().split("\n", 1)
                failures.append((int(stamp), rank, text))
            elif process.exitcode != 0:
                failures.append((2**63, rank, f"exit code {process.exitcode}, no Python exception (killed, or died)\n"))
    if failed_at is not None:
        failures.sort()
        _, rank, text = failures[0]
        raise RankFailure(f"rank {rank} failed first:\n{text}" + "".join(f"then rank {r}:\n{t}" for _, r, t in failures[1:]))
    if timed_out:
        raise TimeoutError(f"{world_size} ranks still running after {limit_s} s: killed")


# ---- the comparison with single-process attention ----------------------------------------------------


def _problem(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The full sequence's q, k, v (and sinks), the same on every rank (seeded by the case)."""
    rng = np.random.default_rng(case["seq_len"] * 7 + case["kv_heads"])
    b, hq, hkv, d, dv, n = case["batch"], case["q_heads"], case["kv_heads"], case["head_dim"], case["value_dim"], case["seq_len"]
    q = rng.standard_normal((b, hq, n, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, n, dv)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    return tuple(torch.from_numpy(a) for a in (q, k, v, sinks))


def _within(got: torch.Tensor, want64: torch.Tensor, f32: torch.Tensor, scale_of: float, what: str) -> float:
    """|got - want64| within FLOAT32_ERROR_FACTOR x the float32 reference's own error plus a floor
    (tests/helpers.py's rule); returns the tolerance used."""
    finite = torch.isfinite(want64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want64)), f"{what}: -inf pattern differs"
    f32_err = float((f32.double() - want64)[finite].abs().max()) if finite.any() else 0.0
    tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, scale_of)
    err = float((got.double() - want64)[finite].abs().max()) if finite.any() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g}"
    return tol


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the finite entries, after checking that the rest match exactly."""
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]), "non-finite entries differ"
    return float((got - want)[finite].abs().max()) if finite.any() else 0.0


def check_against_single_process(rank: int, world_size: int, cases: list[dict[str, Any]], members: list[int]) -> None:
    """Each case: ring_attention over the shards against attention over the whole sequence, both
    the float64 reference (with the float32 tolerance) and the same port in one process. Then the
    first case again on a subgroup of the ranks `members` (group ranks differ from global ranks)."""
    for case in cases:
        _check_case(case, rank, world_size, None)
    subgroup = dist.new_group(members)  # every rank takes part in creating it
    if rank in members:
        _check_case(cases[0], dist.get_group_rank(subgroup, rank), len(members), subgroup)


def _check_case(case: dict[str, Any], rank: int, world_size: int, group: Any) -> None:
    """rank and world_size: within `group` (None: the default group)."""
    what = f"rank {rank}/{world_size}, {case}"
    q, k, v, sinks = _problem(case)
    kwargs: dict[str, Any] = {"causal": case["causal"]}
    if case["sinks"]:
        kwargs["sinks"] = sinks.numpy()
    want, want_lse = twinattn.attention(*(t.double().numpy() for t in (q, k, v)), return_lse=True, backend="numpy", **kwargs)
    f32, f32_lse = twinattn.attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True, backend="numpy", **kwargs)
    # the same port in one process (twinattn.attention: twinattn.torch takes no sinks)
    single, single_lse = (torch.from_numpy(a) for a in twinattn.attention(
        q.numpy(), k.numpy(), v.numpy(), return_lse=True, backend=case["backend"], **kwargs))

    shards = [td.shard(t, rank, world_size) for t in (q, k, v)]
    if case.get("transposed"):
        # (B, H, L, D) views of (B, L, H, D) memory, as attention projections give them
        shards = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in shards]
        assert not shards[1].is_contiguous()
    out, lse = td.ring_attention(
        *shards, causal=case["causal"], sinks=sinks if case["sinks"] else None, return_lse=True,
        backend=case["backend"], group=group, timeout=20,
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == shards[0].shape[:3] + (case["value_dim"],), what
    mine = {name: td.shard(torch.from_numpy(a), rank, world_size) for name, a in
            (("want", want), ("f32", f32), ("want_lse", want_lse[..., None]), ("f32_lse", f32_lse[..., None]))}
    tol = _within(out, mine["want"], mine["f32"], float(v.abs().max()), f"{what}: out")
    lse_scale = float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1.0))
    _within(lse, mine["want_lse"][..., 0], mine["f32_lse"][..., 0], lse_scale, f"{what}: lse")
    # and against the same kernel run in one process over the whole sequence
    assert _max_diff(out, td.shard(single, rank, world_size)) <= 2 * tol, f"{what}: differs from single-process attention"
    assert _max_diff(lse, td.shard(single_lse[..., None], rank, world_size)[..., 0]) <= 1e-5 * max(1.0, lse_scale), what

    # without return_lse: the same output; unshard of every rank's output is the whole sequence's
    alone = td.ring_attention(*shards, causal=case["causal"], sinks=sinks if case["sinks"] else None, backend=case["backend"], group=group, timeout=20)
    assert torch.equal(alone, out), what
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, out, group=group)
    full = td.unshard(gathered)
    assert full.shape == single.shape, what
    assert _max_diff(full, single) <= 2 * tol, what


# ---- errors ---------------------------------------------------------------------------------------


def _raises(kind: type, text: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except kind as exc:
        assert text in str(exc), f"expected {text!r} in {exc!r}"
        return
    raise AssertionError(f"expected {kind.__name__} containing {text!r}, nothing raised")


def check_errors(rank: int, world_size: int) -> None:
    """Bad inputs raise on every rank, the same way, instead of leaving a rank waiting."""
    q, k, v, _ = _problem({"seq_len": 11, "batch": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 4, "value_dim": 4})
    shards = [td.shard(t, rank, world_size) for t in (q, k, v)]

    # one rank's shard one token short: not the zig-zag layout of any sequence's shards
    short = [t[:, :, :-1] if rank == 0 else t for t in shards]
    _raises(ValueError, "expected the zig-zag shards of a sequence of 10 tokens", lambda: td.ring_attention(*short, timeout=10))

    # one rank's own inputs refused: that rank says why, the others that it refused
    flat = [shards[0][0] if rank == 0 else shards[0], *shards[1:]]
    if rank == 0:
        _raises(ValueError, "q: expected 4 dimensions (B, H, L, D), got shape (2, 5, 4)", lambda: td.ring_attention(*flat, timeout=10))
    else:
        _raises(RuntimeError, "rank(s) [0] refused their inputs", lambda: td.ring_attention(*flat, timeout=10))

    # one rank's sinks of the wrong shape: refused before any compute, on every rank
    sinks = torch.zeros(3 if rank == 1 else 2)
    if rank == 1:
        _raises(ValueError, "sinks: expected shape (Hq=2,), got (3,)", lambda: td.ring_attention(*shards, sinks=sinks, timeout=10))
    else:
        _raises(RuntimeError, "rank(s) [1] refused their inputs", lambda: td.ring_attention(*shards, sinks=sinks, timeout=10))

    # ranks that disagree on causal
    _raises(ValueError, "every rank must pass the same causal, got [True, False]", lambda: td.ring_attention(*shards, causal=rank == 0, timeout=10))

    # the group still works after all that
    out = td.ring_attention(*shards, causal=True, timeout=10)
    assert out.shape == shards[0].shape


def check_timeout(rank: int, world_size: int, released: Any) -> None:
    """Rank 1 never calls ring_attention: rank 0 raises after its timeout instead of waiting forever."""
    q, k, v, _ = _problem({"seq_len": 8, "batch": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 4, "value_dim": 4})
    if rank == 0:
        shards = [td.shard(t, rank, world_size) for t in (q, k, v)]
        _raises(RuntimeError, "timed out", lambda: td.ring_attention(*shards, timeout=1.0))
        released.set()
    else:
        assert released.wait(30), "rank 0 did not time out"
    # the group is left with a collective that never completed: leave without tearing it down
    os._exit(0)


def fail_on_one_rank(rank: int, world_size: int) -> None:
    """Rank 1 raises; rank 0 waits inside ring_attention (the group's timeout, 30 s)."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    q, k, v, _ = _problem({"seq_len": 8, "batch": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 4, "value_dim": 4})
    td.ring_attention(*(td.shard(t, rank, world_size) for t in (q, k, v)))


# ---- float16 / bfloat16 ---------------------------------------------------------------------------


def check_half_against_reference(rank: int, world_size: int, cases: list[dict[str, Any]]) -> None:
    """Each case in float16 and bfloat16: the shards hold the rounded inputs; out comes back in
    that dtype, lse float32, against the float64 reference on the same rounded inputs. Allowed on
    top of the float32 tolerance: the rounding of out (half an ulp), and per part (a part's out is
    rounded to the dtype before the float32 merge, and on the bfloat16 dot path P too) half an
    ulp of max|v| each, 2^-8 max|v| for bfloat16 (P and the part), 2^-11 for float16 (the part)."""
    import ml_dtypes
    from helpers import half_ulp

    for case in cases:
        for torch_dtype, np_dtype, part_unit in ((torch.bfloat16, ml_dtypes.bfloat16, 2.0**-8), (torch.float16, np.float16, 2.0**-11)):
            what = f"rank {rank}/{world_size}, {torch_dtype}, {case}"
            q, k, v, _ = (t.to(torch_dtype) for t in _problem(case))
            as_np = [t.float().numpy().astype(np_dtype) for t in (q, k, v)]
            want, want_lse = twinattn.attention(*(a.astype(np.float64) for a in as_np), return_lse=True, backend="numpy", causal=case["causal"])
            f32 = twinattn.attention(*(a.astype(np.float32) for a in as_np), backend="numpy", causal=case["causal"])
            out, lse = td.ring_attention(*(td.shard(t, rank, world_size) for t in (q, k, v)), causal=case["causal"],
                                         return_lse=True, backend=case["backend"], timeout=20)
            assert out.dtype == torch_dtype and lse.dtype == torch.float32, what
            mine_want = td.shard(torch.from_numpy(want), rank, world_size).numpy()
            mine_f32 = td.shard(torch.from_numpy(f32), rank, world_size).numpy()
            got = out.float().numpy().astype(np.float64)
            v_max = float(np.abs(as_np[2].astype(np.float64)).max())
            f32_err = float(np.abs(mine_f32 - mine_want).max(initial=0.0))
            tol = (FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, v_max) + part_unit * v_max
                   + half_ulp(np.maximum(np.abs(got), np.abs(mine_want)), np.dtype(np_dtype)))
            err = np.abs(got - mine_want)
            assert (err <= tol).all(), f"{what}: worst error {float(err.max()):.3g}, tolerance there {float(tol.flat[np.argmax(err)]):.3g}"
            # lse: computed in float32 from the exact values, merged in float32
            mine_lse = td.shard(torch.from_numpy(want_lse[..., None]), rank, world_size).numpy()[..., 0]
            lse_scale = float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1.0))
            assert np.abs(lse.numpy() - mine_lse).max() <= 1e-5 * max(1.0, lse_scale), what
