"""twinattn.distributed: exact context-parallel (ring) attention over torch.distributed.

    import torch.distributed as dist, twinattn.distributed as td
    dist.init_process_group("gloo")                    # torchrun sets rank, world size, address
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (td.shard(x, rank, world) for x in (q_full, k_full, v_full))   # or build shards locally
    out = td.ring_attention(q, k, v, causal=True)      # this rank's rows of attention over everything
    full = td.unshard(all_gathered_outs)               # back in sequence order, where needed

Layout (zig-zag). A sequence of L tokens is cut into 2P chunks (the first L % 2P one token
longer); rank r holds chunks r and 2P-1-r, one early and one late, concatenated along L. Under
causal attention every rank then has the same number of (query, key) pairs to compute, within
the rounding of the chunk lengths. shard/unshard convert; shard_positions gives a shard's token
positions (for RoPE).

The ring. Each rank keeps its queries; the K/V shards travel around the ring, rank r sending to
r+1 and receiving from r-1, P-1 times. At step s a rank holds the K/V of rank (r - s) mod P: it
posts the transfer of that shard to the next rank (isend/irecv) before it attends its queries to
it, so the transfer proceeds during the compute, and waits for it after. The partial results are
merged by their log-sum-exp into a float32 accumulator (twinattn.merge_attention's arithmetic).
Under causal attention, which chunk pairs a step needs follows from the layout (_blocks):
  - its own shard (step 0): early chunk causally on itself; late chunk on both, causally;
  - an earlier rank's shard: all of this rank's queries on that shard's early chunk only;
  - a later rank's shard: this rank's late chunk on the whole shard;
and nothing above the diagonal is computed or masked: every rank computes 2 (L/2P)^2 query-key
pairs a step (per head), 2P (L/2P)^2 in all.

Every collective and transfer waits at most `timeout` (else the process group's): a rank that
dies or never calls makes the others raise RuntimeError, not hang. The ranks first exchange their
shapes, so inconsistent inputs raise the same ValueError on every rank, and a rank whose own
inputs are refused makes the others raise too.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
from typing import Any, Optional, Sequence, Union

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("twinattn.distributed needs torch: pip install torch") from error

from .core._checks import count, per_head_floats, shape_str
from .core.merge import _merge_arrays, _tensor_as_array, merge_parts
from .torch import attention as _attention

__all__ = ["RingCost", "ring_attention", "ring_cost", "shard", "shard_positions", "unshard", "zigzag_chunks"]

Timeout = Union[datetime.timedelta, float, None]


# ---- the layout ------------------------------------------------------------------------------------


def zigzag_chunks(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """The 2P chunks [start, stop) a sequence of seq_len tokens is cut into, in sequence order: the
    first seq_len % 2P chunks one token longer than the others. Rank r holds chunks r and 2P-1-r."""
    seq_len = count("seq_len", seq_len, positive=False)
    world_size = count("world_size", world_size)
    pieces = 2 * world_size
    base, longer = divmod(seq_len, pieces)
    bounds = [0]
    for c in range(pieces):
        bounds.append(bounds[-1] + base + (c < longer))
    return [(bounds[c], bounds[c + 1]) for c in range(pieces)]


def _shard_chunks(seq_len: int, rank: int, world_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    chunks = zigzag_chunks(seq_len, world_size)
    rank = count("rank", rank, positive=False)
    if rank >= world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    return chunks[rank], chunks[2 * world_size - 1 - rank]


def _shard_length(seq_len: int, rank: int, world_size: int) -> int:
    (a, b), (c, d) = _shard_chunks(seq_len, rank, world_size)
    return (b - a) + (d - c)


def shard_positions(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """The positions (int64, in shard order) of the tokens rank `rank` holds in the zig-zag layout:
    what RoPE needs for that rank's queries and keys."""
    (a, b), (c, d) = _shard_chunks(seq_len, rank, world_size)
    return torch.cat([torch.arange(a, b), torch.arange(c, d)])


def _axis(name: str, x: Any, dim: int) -> int:
    ndim = int(x.ndim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: expected an axis of {name} (shape {shape_str(x.shape)}), got {dim}")
    return dim % ndim


def _concat(parts: list[Any], axis: int) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def shard(x: Any, rank: int, world_size: int, *, dim: int = -2) -> Any:
    """Rank `rank`'s zig-zag shard of x, a torch tensor or NumPy array cut along `dim` (the sequence
    axis: -2 is L of (B, H, L, D) and of (B, L, hidden)): chunks rank and 2P-1-rank, concatenated
    (a new contiguous tensor or array)."""
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        raise TypeError(f"x: expected a torch tensor or a numpy array, got {type(x).__name__}")
    axis = _axis("x", x, dim)
    (a, b), (c, d) = _shard_chunks(x.shape[axis], rank, world_size)
    index: list[Any] = [slice(None)] * x.ndim
    early, late = list(index), list(index)
    early[axis], late[axis] = slice(a, b), slice(c, d)
    return _concat([x[tuple(early)], x[tuple(late)]], axis)


def unshard(parts: Sequence[Any], *, dim: int = -2) -> Any:
    """The full sequence from all P shards in rank order (shard's inverse): a torch tensor or a
    NumPy array like the parts."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"parts: expected a non-empty list of the P shards in rank order, got {parts!r:.80}")
    kind = torch.Tensor if isinstance(parts[0], torch.Tensor) else np.ndarray
    for r, part in enumerate(parts):
        if not isinstance(part, (torch.Tensor, np.ndarray)) or not isinstance(part, kind):
            raise TypeError(f"parts[{r}]: expected a {kind.__module__}.{kind.__name__} like parts[0], got {type(part).__name__}")
    axis = _axis("parts[0]", parts[0], dim)
    world_size = len(parts)
    seq_len = sum(int(part.shape[axis]) for part in parts)
    lengths = [int(part.shape[axis]) for part in parts]
    expected = [_shard_length(seq_len, r, world_size) for r in range(world_size)]
    if lengths != expected:
        raise ValueError(
            f"parts: expected the zig-zag shards of a sequence of {seq_len} tokens over {world_size} ranks, "
            f"of lengths {expected} along dim {dim}, got lengths {lengths}"
        )
    early: list[Any] = []
    late: list[Any] = []
    for r, part in enumerate(parts):
        (a, b), _ = _shard_chunks(seq_len, r, world_size)
        index: list[Any] = [slice(None)] * part.ndim
        index[axis] = slice(0, b - a)
        early.append(part[tuple(index)])
        index[axis] = slice(b - a, None)
        late.append(part[tuple(index)])
    return _concat(early + late[::-1], axis)


# ---- the schedule: which query rows attend to which keys at each step ------------------------------


@dataclasses.dataclass(frozen=True)
class _Block:
    """Rows q_start:q_stop of this rank's shard attend to keys k_start:k_stop of the shard it holds
    at this step; causal_offset None: every key visible; else key j is visible to row i iff
    j <= causal_offset + i (positions relative to the block's first row and key)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal_offset: Optional[int]

    def pairs(self) -> int:
        """How many (query, key) pairs are visible in this block."""
        rows, keys = self.q_stop - self.q_start, self.k_stop - self.k_start
        if self.causal_offset is None:
            return rows * keys
        # row i sees min(keys, offset + i + 1) keys (offset >= 0 here)
        full_from = max(0, min(rows, keys - self.causal_offset))  # first row that sees every key
        partial = full_from * (self.causal_offset + 1) + full_from * (full_from - 1) // 2
        return partial + (rows - full_from) * keys


def _blocks(rank: int, source: int, world_size: int, seq_len: int, causal: bool) -> list[_Block]:
    """The blocks rank `rank` computes against the K/V shard of rank `source` (empty ones left out).
    Chunk order decides causality: chunk i attends to chunk j fully if j < i, causally if j == i,
    not at all if j > i. Rank r holds chunks r < 2P-1-r."""
    (a, b), (c, d) = _shard_chunks(seq_len, rank, world_size)
    q_early, q_len = b - a, (b - a) + (d - c)
    (a, b), (c, d) = _shard_chunks(seq_len, source, world_size)
    k_early, k_len = b - a, (b - a) + (d - c)
    if not causal:
        blocks = [_Block(0, q_len, 0, k_len, None)]
    elif source == rank:
        # early on early, causally; late on early (fully) and on late (causally): one causal block
        # whose keys are the whole shard, the late chunk's row i sitting at position q_early + i
        blocks = [_Block(0, q_early, 0, q_early, 0), _Block(q_early, q_len, 0, k_len, q_early)]
    elif source < rank:
        # source's early chunk precedes both of ours; its late chunk follows both
        blocks = [_Block(0, q_len, 0, k_early, None)]
    else:
        # source's chunks both follow our early chunk and precede our late one
        blocks = [_Block(q_early, q_len, 0, k_len, None)]
    return [block for block in blocks if block.q_stop > block.q_start and block.k_stop > block.k_start]


# ---- the cost model ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RingCost:
    """What ring_attention computes and sends, counted from the schedule it runs.

    flops[r][s]: floating-point operations of rank r at step s, 2 (D + Dv) per visible
    (query, key) pair per query head and sequence (the two matrix products; the softmax's
    exponentials are not counted). bytes_sent[r][s]: bytes rank r sends at step s < P-1 (the K
    and V shard it holds, to rank r+1); every rank receives as much from rank r-1."""

    flops: list[list[int]]
    bytes_sent: list[list[int]]

    def rank_flops(self) -> list[int]:
        return [sum(steps) for steps in self.flops]

    def imbalance(self) -> float:
        """max over ranks of the arithmetic / the mean, minus 1 (0 when perfectly balanced)."""
        totals = self.rank_flops()
        mean = sum(totals) / len(totals)
        return max(totals) / mean - 1 if mean else 0.0


def ring_cost(
    seq_len: int,
    world_size: int,
    *,
    causal: bool,
    batch: int = 1,
    q_heads: int = 1,
    kv_heads: int = 1,
    head_dim: int,
    value_dim: Optional[int] = None,
    itemsize: int = 4,
) -> RingCost:
    """The arithmetic and the traffic of ring_attention over a sequence of seq_len tokens on
    world_size ranks (zig-zag layout), per rank and per step, as its schedule computes them."""
    seq_len, world_size = count("seq_len", seq_len, positive=False), count("world_size", world_size)
    value_dim = head_dim if value_dim is None else value_dim
    per_pair = 2 * (head_dim + value_dim) * q_heads * batch
    flops, sent = [], []
    for rank in range(world_size):
        sources = [(rank - step) % world_size for step in range(world_size)]
        flops.append([per_pair * sum(b.pairs() for b in _blocks(rank, src, world_size, seq_len, causal)) for src in sources])
        sent.append([
            batch * kv_heads * _shard_length(seq_len, src, world_size) * (head_dim + value_dim) * itemsize
            for src in sources[:-1]
        ])
    return RingCost(flops=flops, bytes_sent=sent)


# ---- the ring -----------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FIELDS = ("B", "Hq", "Hkv", "D", "Dv", "dtype", "causal")


def _wait_time(timeout: Timeout) -> Optional[datetime.timedelta]:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, a datetime.timedelta or None, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _wait(work: Any, timeout: Optional[datetime.timedelta]) -> None:
    if timeout is None:
        work.wait()  # the process group's timeout (init_process_group(timeout=...))
    else:
        work.wait(timeout)


def _local_error(q: Any, k: Any, v: Any, sinks: Any) -> Optional[Exception]:
    """What is wrong with this rank's own inputs, as the exception to raise, or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            return ValueError(f"{name}: expected 4 dimensions (B, H, L, D), got shape {shape_str(t.shape)}")
        if t.dtype != q.dtype:
            return TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if t.device.type != "cpu":
            return ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")
    if q.dtype not in _DTYPES:
        return TypeError(f"q: expected float32, float16 or bfloat16 (float64 with backend='numpy'), got {q.dtype}")
    batch, q_heads, length, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != length or k.shape[3] != head_dim:
        return ValueError(f"k: expected shape (B={batch}, Hkv, L={length}, D={head_dim}) like q, got {shape_str(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        return ValueError(f"v: expected shape (B={batch}, Hkv={k.shape[1]}, L={length}, Dv), got {shape_str(v.shape)}")
    if k.shape[1] == 0 or q_heads % k.shape[1]:
        return ValueError(f"q, k: the query heads Hq={q_heads} must be a multiple of the key/value heads Hkv={k.shape[1]}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            return TypeError(f"sinks: expected a float32 torch tensor of shape (Hq={q_heads},), got {type(sinks).__name__}")
        try:
            per_head_floats("sinks", _tensor_as_array("sinks", sinks), ((q_heads,),), f"(Hq={q_heads},)", np.dtype(np.float32))
        except (TypeError, ValueError, RuntimeError) as error:
            return error
    return None


def _agree(q: Any, k: Any, v: Any, sinks: Any, causal: bool, group: Any, timeout: Optional[datetime.timedelta]) -> list[int]:
    """Every rank's shape, dtype and causal flag, exchanged (all_gather) and checked the same way on
    every rank, so that every rank raises or none does. Returns the shard lengths by rank."""
    world_size = dist.get_world_size(group)
    error = _local_error(q, k, v, sinks)
    if error is None:
        mine = [1, *q.shape[:2], k.shape[1], q.shape[3], v.shape[3], _DTYPES.index(q.dtype), int(causal), q.shape[2]]
    else:
        mine = [0] * (len(_FIELDS) + 2)
    everyone = [torch.empty(len(mine), dtype=torch.int64) for _ in range(world_size)]
    _wait(dist.all_gather(everyone, torch.tensor(mine, dtype=torch.int64), group=group, async_op=True), timeout)
    table = [row.tolist() for row in everyone]
    if error is not None:
        raise error
    refused = [r for r, row in enumerate(table) if row[0] == 0]
    if refused:
        raise RuntimeError(f"ring_attention: rank(s) {refused} refused their inputs (their own exception says why); every rank stops")
    for f, field in enumerate(_FIELDS):
        values = [row[1 + f] for row in table]
        if len(set(values)) > 1:
            if field == "dtype":
                values = [str(_DTYPES[n]) for n in values]
            elif field == "causal":
                values = [bool(n) for n in values]
            raise ValueError(f"ring_attention: every rank must pass the same {field}, got {values} by rank")
    lengths = [row[-1] for row in table]
    seq_len = sum(lengths)
    expected = [_shard_length(seq_len, r, world_size) for r in range(world_size)]
    if lengths != expected:
        raise ValueError(
            f"q, k, v: expected the zig-zag shards of a sequence of {seq_len} tokens over {world_size} ranks, "
            f"of lengths {expected} by rank (twinattn.distributed.shard), got lengths {lengths}"
        )
    return lengths


def _exchange(
    k: torch.Tensor, v: torch.Tensor, incoming: int, group: Any, peers: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Posts the transfer of (k, v) to the next rank and of the previous rank's (incoming tokens
    long) into new buffers; returns the buffers and the pending works. Nothing waits here."""
    send_to, receive_from = peers
    k_next = torch.empty((k.shape[0], k.shape[1], incoming, k.shape[3]), dtype=k.dtype)
    v_next = torch.empty((v.shape[0], v.shape[1], incoming, v.shape[3]), dtype=v.dtype)
    ops = [
        dist.P2POp(dist.isend, k, send_to, group),
        dist.P2POp(dist.isend, v, send_to, group),
        dist.P2POp(dist.irecv, k_next, receive_from, group),
        dist.P2POp(dist.irecv, v_next, receive_from, group),
    ]
    return k_next, v_next, dist.batch_isend_irecv(ops)


def _wide(t: torch.Tensor) -> np.ndarray:
    """A NumPy float32 (float64) view of a kernel result; float16/bfloat16 widened to float32."""
    return t.numpy() if t.dtype in (torch.float32, torch.float64) else t.float().numpy()  # type: ignore[no-any-return]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[_Block],
    acc_out: np.ndarray,
    acc_lse: np.ndarray,
    scale: Optional[float],
    backend: str,
    num_threads: Optional[int],
) -> None:
    """One step's compute: each block through twinattn's kernel, merged into the accumulators."""
    for block in blocks:
        rows = slice(block.q_start, block.q_stop)
        keys = slice(block.k_start, block.k_stop)
        part_out, part_lse = _attention(
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            causal=block.causal_offset is not None,
            q_offset=block.causal_offset,
            scale=scale,
            return_lse=True,
            backend=backend,
            num_threads=num_threads,
        )
        acc_out[:, :, rows], acc_lse[:, :, rows] = merge_parts(
            [acc_out[:, :, rows], _wide(part_out)], [acc_lse[:, :, rows], part_lse.numpy()], None
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: Any = None,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    num_threads: Optional[int] = None,
    timeout: Timeout = None,
) -> Any:
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group.

    Every rank of `group` calls it at once with its own zig-zag shard (see shard()) and gets its
    shard's rows of attention over the whole sequence: the same as twinattn.torch.attention over
    the full sequence, shard()-ed, within float32 rounding.

    Parameters
    ----------
    q : tensor (B, Hq, Lr, D); k : tensor (B, Hkv, Lr, D); v : tensor (B, Hkv, Lr, Dv)
        This rank's shard: its Lr tokens in the zig-zag layout. CPU tensors, one dtype: float32,
        float16 or bfloat16 where twinattn.torch takes them (float64 with backend="numpy").
        Grouped-query attention as in twinattn.attention (Hq % Hkv == 0); K/V travel with Hkv heads.
    causal : bool, default False
        Causal over the whole sequence: a token attends to those at or before its position.
    group : torch.distributed process group, default None (the default group)
        The ranks holding the sequence, in shard order by their rank in the group. gloo for CPU.
    scale : float, optional
        As twinattn.attention (1 / sqrt(D) by default).
    sinks : float32 tensor (Hq,), optional
        Attention sinks (gpt-oss), counted once for the whole sequence, as twinattn.attention's.
    return_lse : bool, default False
        Also return lse (B, Hq, Lr) float32, over the whole sequence.
    backend, num_threads :
        As twinattn.attention, for each rank's kernel calls.
    timeout : datetime.timedelta or seconds, optional
        The longest any exchange (the shape check and every transfer) may wait; None means the
        process group's timeout. A rank that fails or never calls makes the others raise
        RuntimeError after at most this long.

    Returns
    -------
    out : tensor (B, Hq, Lr, Dv) in q's dtype (partials merged in float32, rounded once)
    lse : tensor (B, Hq, Lr) float32, only with return_lse=True

    Raises
    ------
    RuntimeError
        torch.distributed not initialised; another rank refused its inputs; a timeout.
    ValueError, TypeError
        Inputs that are not 4-D CPU tensors of one dtype with matching shapes; ranks that disagree
        on B, Hq, Hkv, D, Dv, dtype or causal; shard lengths that are not the zig-zag layout of
        their sum (every rank raises the same). The kernel's own checks (twinattn.torch.attention).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attention: torch.distributed is not initialised: call torch.distributed.init_process_group('gloo') "
            "first (torchrun sets its rank, world size and address)"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    wait_time = _wait_time(timeout)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise RuntimeError("ring_attention: this process is not a member of `group`")
    # point-to-point ops name their peers by global rank
    peers = ((rank + 1) % world_size, (rank - 1) % world_size)
    if group is not None:
        peers = (int(dist.get_global_rank(group, peers[0])), int(dist.get_global_rank(group, peers[1])))
    lengths = _agree(q, k, v, sinks, causal, group, wait_time)
    seq_len = sum(lengths)

    # the accumulators: float32, float64 for float64 inputs
    acc_out = np.zeros((*q.shape[:3], v.shape[3]), dtype=np.float64 if q.dtype == torch.float64 else np.float32)
    acc_lse = np.full(acc_out.shape[:-1], -np.inf, dtype=acc_out.dtype)
    # gloo sends contiguous tensors only: a strided view (a (B, L, H, D) projection transposed,
    # say) is copied once here; the kernel reads q in place whatever its strides
    k_now, v_now = k.contiguous(), v.contiguous()
    for step in range(world_size):
        source = (rank - step) % world_size
        works: list[Any] = []
        if step < world_size - 1:
            # the next shard's transfer runs during this step's compute (gloo's own threads)
            k_next, v_next, works = _exchange(k_now, v_now, lengths[(source - 1) % world_size], group, peers)
        try:
            _attend(q, k_now, v_now, _blocks(rank, source, world_size, seq_len, causal), acc_out, acc_lse, scale, backend, num_threads)
        finally:
            # a failing kernel call still completes (or times out) this step's transfers, so the
            # neighbours are not left waiting on this rank
            for work in works:
                _wait(work, wait_time)
        if works:
            k_now, v_now = k_next, v_next

    if sinks is not None:
        # added once, to the merged denominator (the steps were computed without them)
        acc_out, acc_lse = _merge_arrays([acc_out], [acc_lse], _tensor_as_array("sinks", sinks), narrow=False)
    out = torch.from_numpy(acc_out).to(q.dtype)
    return (out, torch.from_numpy(acc_lse)) if return_lse else out
