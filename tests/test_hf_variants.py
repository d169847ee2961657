"""twinattn.hf on the attention variants: sliding windows (Mistral, Qwen2, Gemma 2, Gemma 3,
gpt-oss), logit softcapping (Gemma 2) and attention sinks (gpt-oss), on small randomly initialised
models built from transformers' config classes (nothing downloaded).

Every model runs prompts longer than its window (window 8, prompts of 20 tokens, then decode
steps), so the window changes which keys each query sees, and its weights are drawn large enough
that softcapping and sinks change the logits (the last tests check that dropping any one variant
fails these comparisons).

Reference and tolerance: the same model in float64 with transformers' eager attention, run on each
sequence alone (its real tokens, no padding, no cache, recomputed at every step). twinattn
(float32, padded batch, cache) may differ from it by at most FACTOR times what transformers' own
float32 attentions on the same padded batch differ from it (eager, and sdpa where the model
supports it), plus a floor of a few float32 ulps of the largest logit. (Run on the padded batch,
the float64 eager model gives NaN: its softmax runs in float32, where the float64 mask's minimum
is -inf, so a padding query that sees no key gets NaN, which 0 * NaN carries into real rows.)
Each model runs in bfloat16 too, against the same reference, the scale being the error of
transformers' own bfloat16 attentions.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from conftest import import_optional  # noqa: E402

torch = import_optional("torch", "twinattn.hf needs it: pip install torch transformers")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install torch transformers")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
from hf_helpers import BF16_FLOOR_ULPS, BF16_ROUNDOFF, cache_kw, forward_logits, one_thread, tolerance  # noqa: E402, F401
from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

WINDOW = 8
PROMPT = 20
DECODE_STEPS = 10
GENERATED = 16
VOCAB = 128


# ---- the models ----------------------------------------------------------------------------------


def _small(**extra: Any) -> dict[str, Any]:
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    sizes.update(extra)
    return sizes


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_small(num_hidden_layers=2, sliding_window=WINDOW))


def _qwen2() -> Any:
    from transformers import Qwen2Config

    # layer 0 full attention, layers 1-2 sliding (max_window_layers)
    return Qwen2Config(**_small(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_small(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        )
    )


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # the real model's pattern, shortened: sliding, sliding, sliding, full
    return Gemma3TextConfig(
        **_small(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=4)
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    # alternating sliding / full layers, as gpt-oss has; every layer has sinks
    return GptOssConfig(
        **_small(num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    )


MODELS: dict[str, Callable[[], Any]] = {
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
}
if hasattr(transformers, "GptOssConfig"):
    MODELS["gpt_oss"] = _gpt_oss


def _build(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    config = MODELS[name]()
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # weights large enough that attention is far from uniform, softcapping bites and sinks take
    # real softmax mass (the default 0.02 leaves every score near 0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 0.3)
            elif param_name.endswith("sinks"):
                param.normal_(0.0, 1.5)
    model.eval()
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def models(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    """(name, the float32 model, its float64 copy for the reference)."""
    model = _build(request.param)
    return request.param, model, _float64(model)


def _float64(model: Any) -> Any:
    reference = copy.deepcopy(model).to(torch.float64)
    if any(n.endswith(".experts") for n, _ in reference.named_modules()):
        # gpt-oss's default grouped-matmul experts take no float64: the plain loop does
        reference.set_experts_implementation("eager")
    reference.set_attn_implementation("eager")
    return reference


def _impls(model: Any) -> list[str]:
    # transformers' float32 attentions on this model: what the tolerance is measured on
    return ["eager", "sdpa"] if model._supports_sdpa else ["eager"]


def _prompts(case: str) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(7)
    lengths = [PROMPT] if case == "single" else [PROMPT, 13, 5]
    ids = torch.randint(3, VOCAB, (len(lengths), PROMPT), generator=generator)
    mask = torch.zeros(len(lengths), PROMPT, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, PROMPT - length :] = 1  # left padding
    return ids.masked_fill(mask == 0, 0), mask


def _check(got: Any, want: Any, others: list[Any], what: str, bfloat16: bool = False) -> None:
    err = float((got - want).abs().max())
    gap = max(float((other - want).abs().max()) for other in others)
    tol = tolerance(gap, want, BF16_ROUNDOFF, BF16_FLOOR_ULPS) if bfloat16 else tolerance(gap, want)
    assert err <= tol, f"{what}: max |twinattn - eager float64| = {err:.3g} > {tol:.3g} (transformers' {'bfloat16' if bfloat16 else 'float32'} attentions: {gap:.3g})"


def _compare_steps(name: str, model: Any, reference: Any, case: str, twinattn_cache: str) -> None:
    bfloat16 = model.dtype == torch.bfloat16
    ids, mask = _prompts(case)
    real = mask.bool()
    caches: dict[str, Any] = {impl: DynamicCache(config=model.config) for impl in _impls(model)}
    if twinattn_cache == "TwinattnCache":
        caches["twinattn"] = hf.TwinattnCache(max_cache_len=PROMPT + DECODE_STEPS + 1, config=model.config)
    else:  # transformers' DynamicCache: its sliding layers keep the last window - 1 keys only
        caches["twinattn"] = DynamicCache(config=model.config)
    history = ids
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            logits = {impl: forward_logits(model, impl, ids, mask, cache).to(torch.float64) for impl, cache in caches.items()}
            rows = real[:, -ids.shape[1] :]
            want = _reference(reference, history, mask, rows)
            _check(
                logits["twinattn"][rows],
                want,
                [logits[impl][rows] for impl in _impls(model)],
                f"{name}, {case}, {twinattn_cache}, step {step}",
                bfloat16,
            )
            ids = logits["eager"][:, -1].argmax(-1, keepdim=True)  # the same next tokens for every impl
            history = torch.cat([history, ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            real = mask.bool()


def _reference(reference: Any, history: Any, mask: Any, rows: Any) -> Any:
    """The float64 eager logits of each sequence's real tokens that rows selects, in the order of
    logits[rows]: each sequence alone, from its first real token, without a cache."""
    reference.set_attn_implementation("eager")
    out = []
    for b in range(history.shape[0]):
        tokens = history[b][mask[b].bool()][None]
        logits = reference(input_ids=tokens, use_cache=False).logits[0]
        out.append(logits[logits.shape[0] - int(rows[b].sum()) :])
    return torch.cat(out).to(torch.float64)


# ---- prefill and every decode step ---------------------------------------------------------------


@pytest.mark.parametrize("cache", ["TwinattnCache", "DynamicCache"])
@pytest.mark.parametrize("case", ["single", "left-padded"])
def test_prefill_and_every_decode_step_match_eager(models: tuple[str, Any, Any], case: str, cache: str) -> None:
    name, model, reference = models
    _compare_steps(name, model, reference, case, cache)


def test_bfloat16_prefill_and_every_decode_step_match_eager(models: tuple[str, Any, Any]) -> None:
    # the model in bfloat16 (each variant's inputs, s_aux included, in bfloat16; TwinattnCache
    # storing bfloat16) against the same float64 reference, within FACTOR times the error of
    # transformers' own bfloat16 attentions, plus BF16_FLOOR_ULPS bfloat16 ulps
    name, model, reference = models
    half = copy.deepcopy(model).to(torch.bfloat16)
    _compare_steps(name, half, reference, "left-padded", "TwinattnCache")
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("cache", ["TwinattnCache", "default cache"])
@pytest.mark.parametrize("case", ["single", "left-padded"])
def test_greedy_generation_gives_eagers_tokens(models: tuple[str, Any, Any], case: str, cache: str) -> None:
    name, model, _ = models
    ids, mask = _prompts(case)
    settings = {"max_new_tokens": GENERATED, "min_new_tokens": GENERATED, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(input_ids=ids, attention_mask=mask, **settings)
        model.set_attn_implementation("twinattn")
        extra = {}
        if cache == "TwinattnCache":
            extra[cache_kw(model)] = hf.TwinattnCache(max_cache_len=PROMPT + GENERATED, config=model.config)
        got = model.generate(input_ids=ids, attention_mask=mask, **settings, **extra)
    assert got.shape == want.shape == (ids.shape[0], PROMPT + GENERATED)
    assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"


# ---- each variant matters: the comparisons fail without it ---------------------------------------


def _without(keyword: str) -> Callable[..., Any]:
    def attention_forward(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(keyword, None)
        return hf.attention_forward(*args, **kwargs)

    return attention_forward


@pytest.mark.parametrize(
    ("name", "keyword"),
    [("mistral", "sliding_window"), ("gemma3", "sliding_window"), ("gemma2", "softcap"), ("gpt_oss", "s_aux")],
)
def test_dropping_a_variant_fails_the_comparison(name: str, keyword: str) -> None:
    if name not in MODELS:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {name} model")
    model = _build(name)
    reference = _float64(model)
    AttentionInterface.register("twinattn", _without(keyword))
    try:
        with pytest.raises(AssertionError, match="max \\|twinattn - eager float64\\|"):
            _compare_steps(name, model, reference, "left-padded", "TwinattnCache")
    finally:
        hf.register()
    assert AttentionInterface()["twinattn"] is hf.attention_forward


# ---- the mask stays small -------------------------------------------------------------------------


def test_sliding_masks_are_padding_only() -> None:
    from transformers.masking_utils import create_sliding_window_causal_mask, sliding_window_causal_mask_function

    config = _mistral()
    config._attn_implementation = "twinattn"
    embeds = torch.zeros(2, PROMPT, config.hidden_size)
    _, padding = _prompts("left-padded")
    padding = padding[:2]
    got = create_sliding_window_causal_mask(config, embeds, padding, DynamicCache(config=config))
    assert got.shape == (2, PROMPT) and torch.equal(got, padding.bool())  # (B, Lk), never (Lq, Lk)
    assert create_sliding_window_causal_mask(config, embeds, torch.ones_like(padding), DynamicCache(config=config)) is None
    # transformers' sliding cache keeps the last window - 1 keys (kv_offset > 0): still the padding
    # mask alone, of which attention_forward reads the last columns
    cache = DynamicCache(config=config)
    keys = torch.zeros(2, 2, PROMPT, 16)
    cache.update(keys, keys, 0)
    longer = torch.cat([padding, torch.ones(2, 1, dtype=padding.dtype)], dim=1)
    assert cache.get_mask_sizes(1, 0) == (WINDOW, PROMPT + 1 - WINDOW)
    got = create_sliding_window_causal_mask(config, embeds[:, :1], longer, cache)
    assert got.shape == (2, PROMPT + 1) and torch.equal(got, longer.bool())
    # a window of another size than local_size, or an overlay on top, is not recognised: materialised
    other = hf.mask_function(2, 5, 5, mask_function=sliding_window_causal_mask_function(3), local_size=4)
    assert other.shape == (2, 1, 5, 5)


def test_bidirectional_sliding_window_without_a_mask_raises() -> None:
    q, k, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(NotImplementedError, match="sliding_window: .* causal attention only"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=False, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window: expected a positive int"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=0)


def test_cache_takes_sliding_layers() -> None:
    config = _gemma3()
    cache = hf.TwinattnCache(max_cache_len=32, config=config)
    assert len(cache.layers) == config.num_hidden_layers


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_static_cache_goes_through_the_materialised_mask(name: str) -> None:
    # StaticCache hands attention its buffers with offsets that lengths do not describe: the mask
    # is materialised by transformers, with the window in it, and the window must not be applied
    # a second time (the keys' indices are no longer positions)
    from transformers import StaticCache

    model = _build(name)
    ids, mask = _prompts("left-padded")
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(input_ids=ids, attention_mask=mask, **settings)
        model.set_attn_implementation("twinattn")
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + 8)
        got = model.generate(input_ids=ids, attention_mask=mask, **settings, **{cache_kw(model): cache})
    assert torch.equal(got, want)


def test_a_cache_is_bound_to_its_first_batch() -> None:
    """TwinattnCache allocates for the batch of its first forward: generate's expanded batch (beams
    and num_return_sequences) fits a new cache, and a cache given another batch size says to make
    a new one."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(_mistral()).eval()
    ids = torch.randint(3, VOCAB, (2, 5))
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, num_beams=3, num_return_sequences=2,
                    do_sample=False)
    got = {}
    for impl in ("eager", "twinattn"):
        model.set_attn_implementation(impl)
        cache = {cache_kw(model): hf.TwinattnCache(max_cache_len=16, config=model.config)} if impl == "twinattn" else {}
        with torch.inference_mode():
            got[impl] = model.generate(ids, **settings, **cache)
    assert got["twinattn"].shape == (4, 9) and torch.equal(got["twinattn"], got["eager"])

    cache = hf.TwinattnCache(max_cache_len=16, num_layers=1)
    states = torch.zeros(2, 2, 3, 16)
    cache.update(states, states, 0)
    other = torch.zeros(3, 2, 1, 16)
    with pytest.raises(ValueError, match=r"key_states: this TwinattnCache holds a batch of 2, fixed at its first forward, "
                                         r"got a batch of 3; pass a new TwinattnCache\(max_cache_len=\.\.\., config=model.config\)"):
        cache.update(other, other, 0)
