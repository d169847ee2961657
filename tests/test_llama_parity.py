"""Optional: Hugging Face Llama attention (torch + transformers) against twinattn.nn.Attention.

torch and transformers are optional (pip install torch transformers); without them this file is skipped,
with the reason, unless TWINATTN_REQUIRE_OPTIONAL names them (the test command does), which fails it.
A randomly initialised LlamaAttention with a DynamicCache and twinattn's Attention with a KVCache,
holding the same weights, see the same prefill, decode steps and a multi-token chunk.

Tolerance: the difference between Hugging Face's own float32 and float64 runs of the layer sets
the float32 scale, as helpers.assert_close_to_reference does (Hugging Face computes RoPE angles in
float32 even in a float64 model; twinattn computes them in float64).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import numpy as np
import pytest

import twinattn
from conftest import import_optional, optional_required
from helpers import FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF

torch = import_optional("torch", "the Llama parity test needs it")
transformers = import_optional("transformers", "the Llama parity test needs it")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # their import-time deprecation notices are not this test's subject
    from transformers.models.llama import modeling_llama

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POSITIONS = 64, 4, 2, 16, 256

ROPE_CASES = {
    "default": (10000.0, None),
    "linear": (10000.0, {"rope_type": "linear", "factor": 2.0}),
    "llama3": (
        500000.0,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32},
    ),
    "yarn": (10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


def llama_config(base: float, scaling: dict | None) -> Any:
    common = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        attention_bias=False,
        attention_dropout=0.0,
    )
    probe = transformers.LlamaConfig(**common)
    if hasattr(probe, "rope_parameters"):  # transformers >= 5
        config = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": base, **(scaling or {})})
    else:  # transformers 4.x
        config = transformers.LlamaConfig(**common, rope_theta=base, rope_scaling=scaling)
    config._attn_implementation = "eager"
    return config


def cache_keyword() -> str:
    parameters = inspect.signature(modeling_llama.LlamaAttention.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in parameters:
            return name
    reason = f"LlamaAttention.forward of transformers {transformers.__version__} takes no cache argument we know"
    if optional_required("transformers"):
        pytest.fail(reason)
    pytest.skip(reason)


def additive_causal_mask(past: int, length: int, dtype: Any) -> Any:
    """(1, 1, L, past + L): 0 where key j <= past + i, -inf elsewhere (no row is empty)."""
    allowed = torch.arange(past + length)[None, :] <= past + torch.arange(length)[:, None]
    mask = torch.zeros(length, past + length, dtype=dtype)
    return mask.masked_fill(~allowed, float("-inf"))[None, None]


def run_hf(layer: Any, rotary: Any, chunks: list[Any], dtype: Any) -> list[np.ndarray]:
    layer = layer.to(dtype)
    cache = transformers.DynamicCache()
    keyword, past, outputs = cache_keyword(), 0, []
    with torch.no_grad():
        for chunk in chunks:
            x = chunk.to(dtype)
            positions = torch.arange(past, past + x.shape[1])[None]
            cos_sin = rotary(x, positions)
            out, _ = layer(x, position_embeddings=cos_sin, attention_mask=additive_causal_mask(past, x.shape[1], dtype),
                           **{keyword: cache})
            outputs.append(out.double().numpy())
            past += x.shape[1]
    return outputs


@pytest.mark.parametrize("rope_case", list(ROPE_CASES))
def test_rope_frequencies_match_hugging_face(rope_case: str) -> None:
    base, scaling = ROPE_CASES[rope_case]
    rotary = modeling_llama.LlamaRotaryEmbedding(llama_config(base, scaling))
    ours = twinattn.RotaryEmbedding(HEAD_DIM, base=base, scaling=scaling)
    # Hugging Face holds inv_freq in float32: agreement to float32 roundoff.
    np.testing.assert_allclose(ours.inv_freq, rotary.inv_freq.double().numpy(), rtol=4 * UNIT_ROUNDOFF, atol=0)
    assert ours.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("rope_case", ["default", "llama3", "yarn"])
def test_llama_attention_prefill_decode_chunk(backend: str, rope_case: str) -> None:
    base, scaling = ROPE_CASES[rope_case]
    config = llama_config(base, scaling)
    torch.manual_seed(0)
    layer = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    state = {name: tensor.detach().numpy().copy() for name, tensor in layer.state_dict().items()}

    batch = 2
    chunks = [torch.randn(batch, n, HIDDEN) for n in (7, 1, 1, 1, 4)]  # prefill, three decode steps, a chunk
    want64 = run_hf(layer, rotary, chunks, torch.float64)
    want32 = run_hf(layer, rotary, chunks, torch.float32)

    attn = twinattn.nn.Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM,
                                 rope=twinattn.RotaryEmbedding(HEAD_DIM, base=base, scaling=scaling), backend=backend)
    attn.load_state_dict(state)
    cache = twinattn.KVCache(num_layers=1, batch_size=batch, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=32)
    for step, (chunk, hf64, hf32) in enumerate(zip(chunks, want64, want32)):
        got = attn(chunk.numpy(), cache=cache)
        tol = FLOAT32_ERROR_FACTOR * float(np.abs(hf32 - hf64).max()) + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(hf64).max()))
        err = float(np.abs(got.astype(np.float64) - hf64).max())
        assert err <= tol, f"step {step}: max abs error {err:.3g} > tolerance {tol:.3g}"
    np.testing.assert_array_equal(cache.seq_lens(0), [14, 14])
