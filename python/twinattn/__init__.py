"""twinattn: exact scaled-dot-product attention for CPUs, written twice (C++ and Rust).

    import twinattn
    out = twinattn.attention(q, k, v, causal=True)          # q (B, Hq, Lq, D) float32
    twinattn.backends()                                      # ['cpp', 'rust', 'numpy']
    twinattn.build_info()                                    # ISA, threads, compiler per port

The Python layer: twinattn.RotaryEmbedding, twinattn.KVCache, twinattn.nn.Attention (runs Hugging
Face Llama attention weights) and twinattn.scaled_dot_product_attention (torch's signature).
twinattn.quantize_kv / dequantize_kv make int8 keys and values with float32 scales (attention's
k_scale and v_scale; KVCache(..., dtype="int8")). twinattn.merge_attention merges attention computed over disjoint key sets; ring attention across
processes or machines is in twinattn.distributed (imports torch; import it explicitly).
Serving: twinattn.attention_varlen (packed sequences), twinattn.attention_paged and
twinattn.PagedKVCache (paged keys and values, shared prefixes).
flash-attn's functions on torch CPU tensors are in twinattn.flash (imports torch; import it
explicitly).
"""

from ._version import __version__
from . import reference
from .core._backends import BackendUnavailableError, backends, build_info
from .core._threads import get_num_threads, set_num_threads
from .core.api import attention
from .core.merge import merge_attention
from .core.quant import dequantize_kv, quantize_kv
from .core.varlen import attention_paged, attention_varlen
from . import nn
from .nn.cache import CacheOverflowError, KVCache, kv_cache_bytes
from .nn.paged_cache import CacheFullError, PagedKVCache
from .nn.rope import RotaryEmbedding
from .nn.sdpa import scaled_dot_product_attention

__all__ = [
    "BackendUnavailableError",
    "CacheFullError",
    "CacheOverflowError",
    "KVCache",
    "PagedKVCache",
    "RotaryEmbedding",
    "__version__",
    "attention",
    "attention_paged",
    "attention_varlen",
    "backends",
    "build_info",
    "dequantize_kv",
    "get_num_threads",
    "kv_cache_bytes",
    "merge_attention",
    "nn",
    "quantize_kv",
    "reference",
    "scaled_dot_product_attention",
    "set_num_threads",
]
