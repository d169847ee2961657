"""twinattn.nn (layer 1): the Python layer on NumPy arrays, built on twinattn.core: RoPE (rope),
the KV cache (cache), torch's scaled_dot_product_attention signature (sdpa) and the Attention
module (attention), which runs Hugging Face Llama attention weights.

    attn = twinattn.nn.Attention(hidden_size=4096, num_heads=32, num_kv_heads=8,
                                 rope=twinattn.RotaryEmbedding(128, base=500000.0))
"""

from .attention import Attention

__all__ = ["Attention"]
