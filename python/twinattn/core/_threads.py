"""Thread count used by the native ports."""

from __future__ import annotations

import os

from ._checks import count

_ENV = "TWINATTN_NUM_THREADS"
_num_threads: int | None = None


_cores: int | None = None


def _usable_cores() -> int:
    """The cores this process may run on (CPU affinity respected), read once."""
    global _cores
    if _cores is None:
        try:
            _cores = max(1, len(os.sched_getaffinity(0)))  # Linux
        except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
            _cores = max(1, os.cpu_count() or 1)
    return _cores


def configured_num_threads() -> int | None:
    """What set_num_threads last set (None: the default), for a caller that sets it for a while
    and then puts back what was there (restoring get_num_threads() would pin the default)."""
    return _num_threads


def get_num_threads() -> int:
    """Threads the native ports use when a call passes num_threads=None.

    set_num_threads(n) wins; otherwise TWINATTN_NUM_THREADS when set; otherwise the usable cores
    (CPU affinity respected).
    """
    if _num_threads is not None:
        return _num_threads
    env = os.environ.get(_ENV)
    if env is not None and env.strip():
        try:
            return count(_ENV, int(env))
        except ValueError:
            raise ValueError(f"{_ENV}: expected a positive int, got {env!r}") from None
    return _usable_cores()


def set_num_threads(n: int | None) -> None:
    """Set the default thread count of the native ports; None restores the default."""
    global _num_threads
    _num_threads = None if n is None else count("n", n)


# The cores' own bound (build_info()[port]["constants"]["serial_work"], a test checks they agree):
# a call of fewer multiply-adds than this runs on the calling thread whatever num_threads says.
SERIAL_WORK = 2**19
# The bound beside threads that keep spinning between calls, as torch's OpenMP threads do between
# the torch ops of a float16/bfloat16 model: waking a second twinattn thread there costs more than
# it saves. SmolLM2-135M bfloat16 in transformers, 2 cores, one decode step of 30 layers: 20.1 /
# 25.7 / 28.8 ms at 16 / 1024 / 4096 tokens of context with 2 threads, 16.3 / 17.5 / 21.1 ms with 1
# (about 0.1 ms of work on one core: every decode step up to ~30k tokens of context, no prefill).
# A float32 model's torch ops leave the cores sooner and its decode reads twice the bytes: it keeps
# both threads (one thread took its step at 4096 from 46.2 to 55.8 ms).
SERIAL_WORK_BESIDE_SPINNING_THREADS = 2**25


def threads_for(work: int, *, beside_spinning_threads: bool = False) -> int | None:
    """num_threads for a call of `work` multiply-adds (Hq * Lq * Lk * (D + Dv), B times over for
    the cores; twinattn.hf counts one sequence, as measured):
    None (get_num_threads(); the cores run a call below SERIAL_WORK on the calling thread
    themselves), or 1 for a caller whose own threads keep spinning between calls
    (beside_spinning_threads) when work is below SERIAL_WORK_BESIDE_SPINNING_THREADS."""
    return 1 if beside_spinning_threads and work < SERIAL_WORK_BESIDE_SPINNING_THREADS else None
