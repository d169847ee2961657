"""twinattn.distributed: the zig-zag layout, the ring's schedule and cost, and ring attention run in
2, 3 and 4 local processes (gloo on 127.0.0.1) against attention over the whole sequence.

The process tests start their ranks with tests/dist_workers.py's harness: a rank that raises ends
the test with every failed rank's traceback, the first failure first; ranks still running after a
limit are killed and the test fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import import_optional

torch = import_optional("torch", "twinattn.distributed builds on torch.distributed")
import torch.multiprocessing  # noqa: E402

import twinattn.distributed as td  # noqa: E402
from twinattn.distributed import _blocks  # noqa: E402

import dist_workers  # noqa: E402

LENGTHS = [0, 1, 3, 5, 13, 40, 41]


# ---- layout --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_chunks_cut_the_sequence_in_order_longer_ones_first(seq_len: int, world_size: int) -> None:
    chunks = td.zigzag_chunks(seq_len, world_size)
    assert len(chunks) == 2 * world_size
    assert chunks[0][0] == 0 and chunks[-1][1] == seq_len
    assert all(chunks[c][1] == chunks[c + 1][0] for c in range(2 * world_size - 1))
    lengths = [stop - start for start, stop in chunks]
    base, longer = divmod(seq_len, 2 * world_size)
    assert lengths == [base + 1] * longer + [base] * (2 * world_size - longer)


def test_shard_holds_chunks_rank_and_mirror() -> None:
    # 11 tokens over 2 ranks: chunks [0:3] [3:6] [6:9] [9:11]; rank 0 holds 0 and 3, rank 1 holds 1 and 2
    x = np.arange(11.0).reshape(1, 1, 11, 1)
    np.testing.assert_array_equal(td.shard(x, 0, 2)[0, 0, :, 0], [0, 1, 2, 9, 10])
    np.testing.assert_array_equal(td.shard(x, 1, 2)[0, 0, :, 0], [3, 4, 5, 6, 7, 8])
    assert td.shard_positions(11, 0, 2).tolist() == [0, 1, 2, 9, 10]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_shard_then_unshard_is_the_identity(seq_len: int, world_size: int) -> None:
    x = torch.randn(2, 3, seq_len, 4)
    parts = [td.shard(x, r, world_size) for r in range(world_size)]
    assert torch.equal(td.unshard(parts), x)
    for r, part in enumerate(parts):
        assert torch.equal(part[0, 0, :, 0], x[0, 0, td.shard_positions(seq_len, r, world_size), 0])
    # (B, L, hidden) along dim 1, as NumPy arrays
    y = np.random.default_rng(0).standard_normal((2, seq_len, 5))
    pieces = [td.shard(y, r, world_size, dim=1) for r in range(world_size)]
    np.testing.assert_array_equal(td.unshard(pieces, dim=1), y)


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size=2, got 2"):
        td.shard(torch.zeros(1, 1, 4, 2), 2, 2)
    with pytest.raises(ValueError, match=r"parts: expected the zig-zag shards of a sequence of 9 tokens over 2 ranks, of lengths \[5, 4\] along dim -2, got lengths \[4, 5\]"):
        td.unshard([torch.zeros(1, 4, 2), torch.zeros(1, 5, 2)])
    with pytest.raises(TypeError, match=r"parts\[1\]: expected a torch.Tensor like parts\[0\], got ndarray"):
        td.unshard([torch.zeros(1, 5, 2), np.zeros((1, 5, 2))])
    with pytest.raises(ValueError, match="dim: expected an axis of x"):
        td.shard(torch.zeros(4, 2), 0, 2, dim=2)


# ---- the schedule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_schedule_computes_every_visible_pair_once_and_nothing_else(seq_len: int, world_size: int, causal: bool) -> None:
    """Mapped back to sequence positions, the blocks of all steps of all ranks cover each visible
    (query, key) pair exactly once: nothing above the diagonal, nothing twice, nothing missed."""
    covered = np.zeros((seq_len, seq_len), dtype=np.int64)
    for rank in range(world_size):
        rows = td.shard_positions(seq_len, rank, world_size).numpy()
        for step in range(world_size):
            source = (rank - step) % world_size
            keys = td.shard_positions(seq_len, source, world_size).numpy()
            for block in _blocks(rank, source, world_size, seq_len, causal):
                i = np.arange(block.q_stop - block.q_start)[:, None]
                j = np.arange(block.k_stop - block.k_start)[None, :]
                visible = np.ones((i.size, j.size), bool) if block.causal_offset is None else j <= block.causal_offset + i
                assert block.pairs() == int(visible.sum()), block
                q_pos = rows[block.q_start : block.q_stop, None]
                k_pos = keys[None, block.k_start : block.k_stop]
                np.add.at(covered, (np.broadcast_to(q_pos, visible.shape)[visible], np.broadcast_to(k_pos, visible.shape)[visible]), 1)
    want = np.tril(np.ones((seq_len, seq_len), np.int64)) if causal else np.ones((seq_len, seq_len), np.int64)
    np.testing.assert_array_equal(covered, want)


# ---- the cost model -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("seq_len", [1000, 4096, 8191, 131072])
def test_causal_zigzag_arithmetic_is_balanced_across_ranks(seq_len: int, world_size: int) -> None:
    cost = td.ring_cost(seq_len, world_size, causal=True, q_heads=4, kv_heads=2, head_dim=16)
    assert cost.imbalance() <= 0.10, cost.rank_flops()
    # and every step is about as long as every other, so no rank waits on its neighbour
    steps = [f for rank in cost.flops for f in rank]
    assert max(steps) <= 1.10 * min(steps)
    # the whole triangle (diagonal included), 2 (D + Dv) flops per pair per query head
    assert sum(cost.rank_flops()) == seq_len * (seq_len + 1) // 2 * 2 * 32 * 4


def test_contiguous_sharding_would_not_be_balanced() -> None:
    # the point of the zig-zag: with one contiguous chunk per rank the last rank does 2P-1 times the
    # first's work; with zig-zag chunks the ranks are equal (counted with the same schedule code)
    zigzag = td.ring_cost(4096, 4, causal=True, head_dim=8).rank_flops()
    contiguous = [sum(min(p + 1, 4096) for p in range(r * 1024, (r + 1) * 1024)) for r in range(4)]
    assert contiguous[-1] / contiguous[0] > 6
    assert max(zigzag) / min(zigzag) < 1.001


def test_bytes_sent_per_step_are_the_shard_held() -> None:
    # 11 tokens over 2 ranks: shards of 5 (rank 0) and 6 (rank 1) tokens; one transfer each (P - 1)
    cost = td.ring_cost(11, 2, causal=True, batch=2, q_heads=4, kv_heads=2, head_dim=8, value_dim=3, itemsize=2)
    assert cost.bytes_sent == [[2 * 2 * 5 * (8 + 3) * 2], [2 * 2 * 6 * (8 + 3) * 2]]
    cost = td.ring_cost(24, 3, causal=False, head_dim=4)
    assert cost.bytes_sent == [[8 * 8 * 4] * 2] * 3
    assert cost.rank_flops() == [8 * 24 * 2 * 8] * 3


def test_ring_attention_needs_an_initialised_group() -> None:
    x = torch.zeros(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        td.ring_attention(x, x, x)


# ---- ring attention in 2, 3 and 4 processes ------------------------------------------------------


def _case(seq_len: int, causal: bool, backend: str, *, batch: int = 2, q_heads: int = 4, kv_heads: int = 2,
          head_dim: int = 16, value_dim: int = 8, sinks: bool = False, transposed: bool = False) -> dict[str, Any]:
    return dict(seq_len=seq_len, causal=causal, backend=backend, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                head_dim=head_dim, value_dim=value_dim, sinks=sinks, transposed=transposed)


# lengths that do not divide into 2P chunks, shorter than 2P (empty chunks; with L=2 over 3 ranks
# rank 2 holds no token), GQA, MQA, MHA, Dv != D,
# sinks, q/k/v strided as (B, L, H, D) memory; both native ports
CASES = {
    2: [_case(23, True, "cpp"), _case(23, False, "rust"), _case(64, True, "rust", q_heads=2, kv_heads=2, sinks=True),
        _case(3, True, "cpp", batch=1)],
    3: [_case(37, True, "cpp", transposed=True), _case(37, False, "cpp", sinks=True), _case(50, True, "rust", q_heads=3, kv_heads=1),
        _case(5, True, "rust", batch=1), _case(2, True, "cpp", batch=1)],
    4: [_case(45, True, "cpp", value_dim=16), _case(45, False, "rust"), _case(7, True, "cpp", batch=1),
        _case(66, True, "rust", q_heads=8, kv_heads=2, sinks=True)],
}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention_equals_attention_over_the_whole_sequence(world_size: int) -> None:
    # then the first case on a subgroup: the last rank and the first, group ranks 0 and 1
    members = [0, world_size - 1]
    dist_workers.run_ranks(world_size, dist_workers.check_against_single_process, CASES[world_size], members)


def test_bad_inputs_raise_on_every_rank() -> None:
    dist_workers.run_ranks(2, dist_workers.check_errors)


def test_a_rank_that_never_calls_makes_the_others_time_out() -> None:
    released = torch.multiprocessing.get_context("spawn").Event()
    dist_workers.run_ranks(2, dist_workers.check_timeout, released)


def test_a_failing_rank_fails_the_test_instead_of_hanging() -> None:
    with pytest.raises(dist_workers.RankFailure, match="rank 1 failed first") as failure:
        dist_workers.run_ranks(2, dist_workers.fail_on_one_rank)
    assert "RuntimeError: rank 1 fails on purpose" in str(failure.value)


def test_ring_attention_in_float16_and_bfloat16() -> None:
    # both ports, causal (the bfloat16 dot path runs in the prefill-sized parts) and not
    cases = [_case(40, True, "cpp", q_heads=4, kv_heads=2, head_dim=32, value_dim=32),
             _case(29, False, "rust", q_heads=4, kv_heads=1, head_dim=32, value_dim=16),
             _case(96, True, "rust", batch=1, q_heads=8, kv_heads=2, head_dim=64, value_dim=64)]
    dist_workers.run_ranks(2, dist_workers.check_half_against_reference, cases)
