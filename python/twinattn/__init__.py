"""twinattn: exact scaled-dot-product attention for CPUs, written twice (C++ and Rust).

    import twinattn
    out = twinattn.attention(q, k, v, causal=True)          # q (B, Hq, Lq, D) float32
    twinattn.backends()                                      # ['cpp', 'rust', 'numpy']
    twinattn.build_info()                                    # ISA, threads, compiler per port
"""

from . import reference
from ._backends import BackendUnavailableError, backends, build_info
from ._threads import get_num_threads, set_num_threads
from ._version import __version__
from .api import attention

__all__ = [
    "BackendUnavailableError",
    "__version__",
    "attention",
    "backends",
    "build_info",
    "get_num_threads",
    "reference",
    "set_num_threads",
]
