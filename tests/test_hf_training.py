"""Training through twinattn.hf: a training-mode forward (dropout 0) and loss.backward() give the
model's gradients, on small random models (Llama, and the variants' Mistral, Qwen2, Gemma 2 and
Gemma 3: sliding windows, softcapping) and on real SmolLM2 weights (a few SGD steps).

Reference and tolerance: the small models' gradients against the same model in float64 with
transformers' eager attention; twinattn (float32) may differ from it by at most FACTOR times what
transformers' own float32 attentions (eager, and sdpa where the model supports it) differ from it,
plus a floor of a few float32 ulps of the largest gradient. SmolLM2: the losses of a few SGD steps
with "twinattn" and with "sdpa" agree to a relative 1e-4.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from conftest import import_optional, require_package  # noqa: E402

torch = import_optional("torch", "twinattn.hf needs it: pip install torch transformers")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install torch transformers")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
import twinattn.models  # noqa: E402
from hf_helpers import one_thread, tolerance  # noqa: E402, F401
from test_hf_variants import MODELS as VARIANT_MODELS, _small  # noqa: E402

PROMPT = 20
VOCAB = 128


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_small(num_hidden_layers=2))


MODELS: dict[str, Callable[[], Any]] = {"llama": _llama}
MODELS.update({name: VARIANT_MODELS[name] for name in ("mistral", "qwen2", "gemma2", "gemma3")})


def _build(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # attention far from uniform, so that its gradient matters
        for param_name, param in model.named_parameters():
            if param_name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 0.3)
    model.train()
    return model


def _batch() -> tuple[Any, Any, Any]:
    """Two right-padded sequences (20 and 13 tokens, longer than the variants' window of 8), and
    their labels (-100 on padding)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=generator)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, 13:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _gradients(model: Any, impl: str) -> dict[str, Any]:
    model.set_attn_implementation(impl)
    model.zero_grad()
    ids, mask, labels = _batch()
    model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_training_gradients_match_transformers_attention(name: str) -> None:
    model = _build(name)
    reference = copy.deepcopy(model).to(torch.float64)
    want = _gradients(reference, "eager")
    got = _gradients(model, "twinattn")
    others = [_gradients(model, impl) for impl in (["eager", "sdpa"] if model._supports_sdpa else ["eager"])]
    assert set(got) == set(want)
    attention_grads = 0
    for param_name, w in want.items():
        err = float((got[param_name].double() - w).abs().max())
        gap = max(float((other[param_name].double() - w).abs().max()) for other in others)
        tol = tolerance(gap, w)
        assert err <= tol, f"{name} {param_name}: max |twinattn - eager float64| = {err:.3g} > {tol:.3g} (transformers' float32: {gap:.3g})"
        attention_grads += param_name.endswith(("q_proj.weight", "k_proj.weight")) and float(w.abs().max()) > 0
    assert attention_grads > 0  # the gradient reached the queries' and keys' projections


def test_training_bfloat16_model_backward_runs() -> None:
    """A bfloat16 model trains too: gradients in bfloat16, finite, close to the float32 ones."""
    model = _build("llama")
    want = _gradients(model, "twinattn")
    got = _gradients(copy.deepcopy(model).to(torch.bfloat16), "twinattn")
    for param_name, w in want.items():
        g = got[param_name]
        assert g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()), param_name
    rel = float((got["model.layers.0.self_attn.q_proj.weight"].float() - want["model.layers.0.self_attn.q_proj.weight"]).norm())
    assert rel <= 0.1 * float(want["model.layers.0.self_attn.q_proj.weight"].norm())


PARAGRAPH = (
    "The city of Paris is the capital of France. It stands on the river Seine, in the north of the "
    "country, and is known for its museums, its cafes and the tower that Gustave Eiffel built for "
    "the world's fair of 1889."
)


def test_smollm2_sgd_steps_give_the_losses_of_sdpa() -> None:
    spec = twinattn.models.MODELS["smollm2"]
    require_package(spec.package, spec.install)
    model, tokenizer = twinattn.models.load("smollm2", attn_implementation="twinattn")
    batch = tokenizer([PARAGRAPH], return_tensors="pt")
    losses = {}
    for impl in ("twinattn", "sdpa"):
        trained = copy.deepcopy(model)
        trained.set_attn_implementation(impl)
        trained.train()
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
        losses[impl] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = trained(**batch, labels=batch["input_ids"], use_cache=False).loss
            loss.backward()
            optimizer.step()
            losses[impl].append(loss.item())
        del trained, optimizer
    assert losses["twinattn"][-1] < losses["twinattn"][0], losses  # the steps train
    for got, want in zip(losses["twinattn"], losses["sdpa"]):
        assert abs(got - want) <= 1e-4 * abs(want), losses
