"""twinattn in transformers' continuous batching (twinattn.hf_serving): model.generate_batch and
ContinuousBatchingManager with attn_implementation="twinattn" give sdpa's greedy tokens, every
attention call of theirs is one twinattn call (attention_varlen on a step's new keys, attention_paged
on the paged cache's pages once keys are cached, read in place), and a step can hold decode rows and
a prefill chunk over cached keys together.

Greedy tokens are compared exactly: both are float32 computations of the same model, so on these
short runs the argmax of every step agrees (a near tie would show as a differing token)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import import_optional, require_package

torch = import_optional("torch", "twinattn.hf needs it: pip install torch transformers")
transformers = import_optional("transformers", "twinattn.hf needs it: pip install torch transformers")
hf = import_optional("twinattn.hf", "the Hugging Face integration")

import twinattn.hf_serving as hf_serving  # noqa: E402
from hf_helpers import one_thread  # noqa: E402, F401

NEW_TOKENS = 8


class _Spy:
    """Records (call, query lengths, key lengths) of every attention_varlen and attention_paged call
    twinattn.hf_serving makes, and the size of every key/value gather of transformers' paged cache."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, list[int], list[int]]] = []
        self.gathered = 0
        varlen, paged = hf_serving.attention_varlen, hf_serving.attention_paged

        def spy_varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, **kwargs: Any) -> Any:
            self.calls.append(("varlen", torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()))
            return varlen(q, k, v, cu_q, cu_k, **kwargs)

        def spy_paged(q: Any, k_pages: Any, v_pages: Any, table: Any, seq_lens: Any, **kwargs: Any) -> Any:
            self.calls.append(("paged", torch.diff(kwargs["cu_seqlens_q"]).tolist(), seq_lens.tolist()))
            return paged(q, k_pages, v_pages, table, seq_lens, **kwargs)

        index_select = torch.index_select

        def spy_index_select(source: Any, dim: int, index: Any) -> Any:
            self.gathered += index.numel()
            return index_select(source, dim, index)

        monkeypatch.setattr(hf_serving, "attention_varlen", spy_varlen)
        monkeypatch.setattr(hf_serving, "attention_paged", spy_paged)
        monkeypatch.setattr(torch, "index_select", spy_index_select)

    def lengths(self) -> list[tuple[list[int], list[int]]]:
        return [(q_lens, k_lens) for _, q_lens, k_lens in self.calls]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "variant", [{}, {"sliding_window": 3}, {"softcap": 2.0}, {"s_aux": "sinks"}, {"is_causal": False}], ids=str
)
def test_packed_call_is_each_sequences_own_attention(dtype: str, variant: dict[str, Any]) -> None:
    """What generate_batch hands the attention function (one packed row, cu_seq_lens_q/k, no mask):
    each request's rows are what attention_forward gives that request alone, its queries at its
    last positions."""
    torch.manual_seed(1)
    q_lens, k_lens = [1, 5, 1, 3], [7, 5, 1, 11]  # decode rows, a first chunk, a later chunk
    q_heads, kv_heads, head_dim = 6, 2, 16
    query = torch.randn(1, sum(q_lens), q_heads, head_dim).to(getattr(torch, dtype)).transpose(1, 2)
    key = torch.randn(1, sum(k_lens), kv_heads, head_dim).to(query.dtype).transpose(1, 2)
    value = torch.randn(1, sum(k_lens), kv_heads, head_dim).to(query.dtype).transpose(1, 2)
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32) for lens in (q_lens, k_lens))
    options = {"is_causal": True, **{name: torch.randn(q_heads) if value == "sinks" else value for name, value in variant.items()}}
    module = torch.nn.Module()
    got, _ = hf.attention_forward(module, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                                  max_length_q=max(q_lens), max_length_k=max(k_lens), **options)
    assert got.shape == (1, sum(q_lens), q_heads, head_dim) and got.dtype == query.dtype
    for b in range(len(q_lens)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want, _ = hf.attention_forward(module, query[:, :, rows], key[:, :, keys], value[:, :, keys], None, scaling=0.3,
                                       **options)
        tol = 1e-6 if dtype == "float32" else 2.0**-7  # float32 rounding; one bfloat16 rounding of out
        torch.testing.assert_close(got[:, rows].float(), want.float(), rtol=tol, atol=tol)


def _paged_layout(keys: Any, values: Any, lens: list[int], page: int, layers: int = 3, layer: int = 1) -> tuple[Any, Any, Any]:
    """`keys` and `values` (total_k, Hkv, D), sequences of `lens` keys, scattered over shuffled blocks
    of a pool laid out as transformers' paged cache lays it out: a block holds a page of keys and a
    page of values for each of `layers` layers, so the keys of a layer are the rows
    block * (2 * layers * page) + 2 * layer * page + j of the pool, its values page rows further.
    Returns the layer's page views (k_pages, v_pages) (as get_cache_for_block_table's) and the read
    index of the sequences' keys in its token view."""
    blocks = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks) + 2, generator=torch.Generator().manual_seed(3))
    pool = torch.full(((sum(blocks) + 2) * 2 * layers * page, *keys.shape[1:]), float("nan"), dtype=keys.dtype)
    k_view, v_view = pool[2 * layer * page :], pool[(2 * layer + 1) * page :]
    stride, first, rows = 2 * layers * page, 0, []
    for n, count in zip(lens, blocks):
        mine = order[first : first + count].tolist()
        first += count
        rows += [mine[j // page] * stride + j % page for j in range(n)]
    read_index = torch.tensor(rows)
    k_view[read_index], v_view[read_index] = keys, values
    num_pages = v_view.shape[0] // page
    k_pages, v_pages = (view[: num_pages * page].view(num_pages, page, *view.shape[1:]) for view in (k_view, v_view))
    return k_pages, v_pages, read_index


def test_page_table_follows_the_read_index() -> None:
    lens, page = [6, 4, 9, 1], 4
    _, _, read_index = _paged_layout(torch.zeros(sum(lens), 1, 1), torch.zeros(sum(lens), 1, 1), lens, page)
    cu_k = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    table = hf_serving.page_table(read_index, cu_k, page)
    assert table.dtype == torch.int32 and table.shape == (4, 3)
    for b, n in enumerate(lens):
        rows = read_index[int(cu_k[b]) : int(cu_k[b + 1])]
        assert table[b, : -(-n // page)].tolist() == (rows[::page] // page).tolist()
        assert (table[b, -(-n // page) :] == -1).all()
    assert hf_serving.page_table(read_index, cu_k, page) is not table  # built anew from its arguments


@pytest.mark.parametrize("variant", [{}, {"softcap": 2.0}, {"s_aux": "sinks"}], ids=str)
def test_packed_call_reads_pages_in_place(variant: dict[str, Any]) -> None:
    """With PAGES (what the wrapped PagedAttentionCache.update hands over), each request's keys and
    values are read through the block table from pages interleaved as transformers' cache holds
    them: the same rows as the same call on the keys gathered out of the pages."""
    torch.manual_seed(2)
    q_lens, k_lens, page = [1, 5, 1, 3], [7, 5, 1, 11], 4  # decode rows, a first chunk, a later chunk
    q_heads, kv_heads, head_dim = 6, 2, 16
    query = torch.randn(1, sum(q_lens), q_heads, head_dim).transpose(1, 2)
    keys, values = torch.randn(2, sum(k_lens), kv_heads, head_dim)
    k_pages, v_pages, read_index = _paged_layout(keys, values, k_lens, page)
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32) for lens in (q_lens, k_lens))
    options = {name: torch.randn(q_heads) if value == "sinks" else value for name, value in variant.items()}
    module = torch.nn.Module()
    common = dict(scaling=0.3, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, is_causal=True, **options)
    gathered = keys[None].transpose(1, 2), values[None].transpose(1, 2)
    want, _ = hf.attention_forward(module, query, *gathered, None, **common)
    table = hf_serving.page_table(read_index, cu_k, page)
    new_keys = gathered[0][:, :, : sum(q_lens)], gathered[1][:, :, : sum(q_lens)]  # not read on this path
    got, _ = hf.attention_forward(module, query, *new_keys, None, **common, **{hf_serving.PAGES: (k_pages, v_pages, table)})
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _generate_batch(model: Any, impl: str, prompts: list[list[int]], config: Any) -> dict[str, list[int]]:
    model.set_attn_implementation(impl)
    settings = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate_batch(prompts, generation_config=settings, continuous_batching_config=config)
    assert model.config._attn_implementation == impl  # kept, not switched to another implementation
    return {request: result.generated_tokens for request, result in out.items()}


def _tiny(kind: str) -> Any:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "qwen2-hybrid":
        # a sliding-window layer, then a full-attention one: two groups of pages in one cache
        layer_types = ["sliding_attention", "full_attention"]
        config = transformers.Qwen2Config(**common, layer_types=layer_types, sliding_window=6, use_sliding_window=True)
        return transformers.Qwen2ForCausalLM(config).eval()
    # every layer a sliding-window one: transformers' sliding cache reads at most the window back
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=6)).eval()


# a long prompt in chunks of at most MAX_BATCH_TOKENS: later chunks read the cache, beside decode rows
PROMPTS = [[5, 9, 3], [7] + list(range(10, 50)), [100], list(range(60, 77))]
MAX_BATCH_TOKENS = 16


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen2-hybrid"])
def test_generate_batch_gives_sdpas_tokens_through_twinattn(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny(kind)
    config = hf.continuous_batching_config([len(p) for p in PROMPTS], NEW_TOKENS, page_size=8, max_batch_tokens=MAX_BATCH_TOKENS)
    spy = _Spy(monkeypatch)
    want = _generate_batch(model, "sdpa", PROMPTS, config)
    assert spy.calls == [] and spy.gathered > 0  # sdpa reads keys gathered out of the pages
    spy.gathered = 0
    got = _generate_batch(model, "twinattn", PROMPTS, config)
    assert got == want
    assert all(len(tokens) == NEW_TOKENS for tokens in got.values()) and len(got) == len(PROMPTS)
    # every step's attention went through twinattn: as many calls as steps times layers, and the
    # queries of all the steps cover every prompt token and every generated token but the last
    assert len(spy.calls) % model.config.num_hidden_layers == 0
    queries = sum(sum(q_lens) for q_lens, _ in spy.lengths()) // model.config.num_hidden_layers
    assert queries == sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    # one call held a decode row and a prefill chunk that reads keys cached by an earlier step
    mixed = [
        (q_lens, k_lens) for q_lens, k_lens in spy.lengths()
        if 1 in q_lens and any(1 < q < k for q, k in zip(q_lens, k_lens))
    ]
    assert mixed, spy.calls
    reads_cache = {(call, any(q < k for q, k in zip(q_lens, k_lens))) for call, q_lens, k_lens in spy.calls}
    if kind == "llama":
        # full attention: a step over cached keys reads them in place from the pages, a step of
        # whole prompts takes its new keys as they are; nothing is gathered
        assert reads_cache == {("varlen", False), ("paged", True)} and spy.gathered == 0, spy.calls
    elif kind == "mistral-window":
        # sliding-window layers (a ring of pages) keep transformers' gather
        assert {call for call, _, _ in spy.calls} == {"varlen"} and spy.gathered > 0
    else:
        # the full-attention layer reads its pages in place, the sliding one reads what is gathered
        assert ("paged", True) in reads_cache and ("varlen", True) in reads_cache and spy.gathered > 0, spy.calls


def test_continuous_batching_manager_serves_twinattn(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny("llama")
    config = hf.continuous_batching_config([len(p) for p in PROMPTS], NEW_TOKENS, page_size=8)
    want = _generate_batch(model, "twinattn", PROMPTS, config)
    spy = _Spy(monkeypatch)
    settings = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=settings, continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in PROMPTS]
        got = {}
        for _ in ids:
            result = manager.get_result(timeout=120)
            assert result is not None
            got[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True)
    assert [got[i] for i in ids] == list(want.values())
    assert spy.calls


def test_continuous_batching_config_holds_the_work() -> None:
    config = hf.continuous_batching_config([3, 41, 1], 8, page_size=16)
    # ceil(11 / 16) + ceil(49 / 16) + ceil(9 / 16) pages
    assert (config.num_blocks, config.page_size, config.safety_margin) == (1 + 4 + 1, 16, 0.0)
    # steps of at most 2048 tokens (hf_serving.MAX_BATCH_TOKENS), transformers' own default on None
    assert config.max_batch_tokens == hf_serving.MAX_BATCH_TOKENS == 2048
    assert hf.continuous_batching_config([3], 8, max_batch_tokens=None).max_batch_tokens is None
    assert hf.continuous_batching_config([3], 8, max_batch_tokens=64).max_batch_tokens == 64
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.continuous_batching_config([3], 0)
    with pytest.raises(ValueError, match="page_size"):
        hf.continuous_batching_config([3], 4, page_size=2)
    with pytest.raises(ValueError, match="prompt_lengths"):
        hf.continuous_batching_config([], 4)


def test_the_wrapper_is_what_lets_twinattn_in() -> None:
    """transformers (TRANSFORMERS_VERSION) rejects "twinattn" on its own; the wrapper accepts it.
    When a transformers release accepts it unwrapped, this fails: the wrapper can go."""
    manager_class = transformers.generation.continuous_batching.ContinuousBatchingManager
    wrapper = manager_class.switch_to_cb_friendly_attn
    assert "twinattn" in wrapper._twinattn_accepted
    model = _tiny("llama")
    model.set_attn_implementation("twinattn")
    manager = manager_class.__new__(manager_class)
    manager._original_attn_impl = None
    with pytest.raises(ValueError, match="Implementation twinattn is not supported for continuous batching"):
        wrapper.__wrapped__(manager, model, auto_switch_to_flash=False)
    wrapper(manager, model, auto_switch_to_flash=False)
    assert model.config._attn_implementation == "twinattn"


def test_other_implementations_still_go_through_transformers_check() -> None:
    model = _tiny("llama")
    model.set_attn_implementation("eager")
    manager = transformers.generation.continuous_batching.ContinuousBatchingManager.__new__(
        transformers.generation.continuous_batching.ContinuousBatchingManager
    )
    manager._original_attn_impl = None
    manager.switch_to_cb_friendly_attn(model, auto_switch_to_flash=False)
    assert model.config._attn_implementation == "paged|eager"  # transformers' own switch, unchanged


# ---- SmolLM2 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    import twinattn.models

    spec = twinattn.models.MODELS["smollm2"]
    require_package(spec.package, spec.install)
    return twinattn.models.load("smollm2", attn_implementation="twinattn")


def test_smollm2_generate_batch_gives_sdpas_tokens(smol: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = smol
    texts = ["The capital of France is", "Hi", "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,"]
    prompts = [tok(text).input_ids for text in texts]
    config = hf.continuous_batching_config([len(p) for p in prompts], NEW_TOKENS, page_size=16, max_batch_tokens=24)
    spy = _Spy(monkeypatch)
    try:
        want = _generate_batch(model, "sdpa", prompts, config)
        got = _generate_batch(model, "twinattn", prompts, config)
    finally:
        model.set_attn_implementation("twinattn")
    assert got == want, [tok.decode(t) for t in got.values()] + [tok.decode(t) for t in want.values()]
    assert len(spy.calls) >= model.config.num_hidden_layers * NEW_TOKENS
