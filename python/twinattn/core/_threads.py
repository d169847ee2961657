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
