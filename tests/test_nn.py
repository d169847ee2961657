"""nn.Attention: Llama attention against an independent float64 forward pass, and cached decoding
equal to the full causal pass for every prompt length 1..64 and chunk sizes 1, 3 and 16, on every
backend, MHA and GQA, both RoPE pairings."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import twinattn
from helpers import (
    FLOAT32_ERROR_FACTOR, FLOOR_ULPS, HALF_DTYPES, UNIT_ROUNDOFF, half_ulp, rand, reference64, reference32,
)
from twinattn.core.reference import round_to_dtype

half_dtypes = pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)

HIDDEN, HEADS, HEAD_DIM, BASE = 24, 4, 8, 10000.0  # hidden != heads * head_dim: orientation errors show


def make_params(rng: np.random.Generator, kv_heads: int, bias: bool = False) -> dict[str, np.ndarray]:
    """Random weights in torch Linear orientation (out_features, in_features)."""
    q_out, kv_out = HEADS * HEAD_DIM, kv_heads * HEAD_DIM
    shapes = {"q_proj": (q_out, HIDDEN), "k_proj": (kv_out, HIDDEN), "v_proj": (kv_out, HIDDEN), "o_proj": (HIDDEN, q_out)}
    params = {f"{name}.weight": (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32) for name, shape in shapes.items()}
    if bias:
        params.update({f"{name}.bias": rand(rng, shape[0]) for name, shape in shapes.items()})
    return params


def reference_forward(
    x: np.ndarray,
    params: dict[str, np.ndarray],
    kv_heads: int,
    *,
    rope: bool = True,
    interleaved: bool = False,
    positions: Any = None,
    mask: np.ndarray | None = None,
    dtype: Any = np.float64,
) -> np.ndarray:
    """Llama attention written out from its definition (causal, RoPE inv_freq = base^(-2p/D),
    query head h reads KV head h // group). In dtype; RoPE angles in float64."""
    batch, length, _ = x.shape
    x = x.astype(dtype)
    p = {name: value.astype(dtype) for name, value in params.items()}

    def project(h: np.ndarray, name: str, heads: int) -> np.ndarray:
        y = h @ p[f"{name}.weight"].T + p.get(f"{name}.bias", dtype(0))
        return y.reshape(batch, length, heads, HEAD_DIM).transpose(0, 2, 1, 3)

    q, k, v = project(x, "q_proj", HEADS), project(x, "k_proj", kv_heads), project(x, "v_proj", kv_heads)
    if rope:
        pos = np.broadcast_to(np.arange(length) if positions is None else np.asarray(positions), (batch, length))
        half = HEAD_DIM // 2
        angles = pos[..., None].astype(np.float64) * BASE ** (-2.0 * np.arange(half) / HEAD_DIM)
        cos, sin = np.cos(angles).astype(dtype)[:, None], np.sin(angles).astype(dtype)[:, None]
        first = np.arange(half) * 2 if interleaved else np.arange(half)
        second = first + 1 if interleaved else first + half

        def rotate(t: np.ndarray) -> np.ndarray:
            out = t.copy()
            out[..., first] = t[..., first] * cos - t[..., second] * sin
            out[..., second] = t[..., second] * cos + t[..., first] * sin
            return out

        q, k = rotate(q), rotate(k)
    group = HEADS // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = (q @ k.swapaxes(-1, -2)) * dtype(1 / math.sqrt(HEAD_DIM))
    allowed = np.tril(np.ones((length, length), dtype=bool))
    if mask is not None:
        allowed = allowed & mask
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    empty = row_max == -np.inf
    weights = np.where(empty, 0, np.exp(scores - np.where(empty, 0, row_max)))
    weights = weights / np.where(empty, 1, weights.sum(axis=-1, keepdims=True))
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, length, HEADS * HEAD_DIM)
    return out @ p["o_proj.weight"].T + p.get("o_proj.bias", dtype(0))


def tolerance(want64: np.ndarray, want32: np.ndarray) -> float:
    """As helpers.assert_close_to_reference: the float32 reference's own error sets the scale."""
    f32_err = float(np.max(np.abs(want32 - want64), initial=0.0))
    return FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(want64).max(initial=0.0)))


def assert_close(got: np.ndarray, want64: np.ndarray, tol: float, what: str = "") -> None:
    assert got.dtype == np.float32 and got.shape == want64.shape, (got.dtype, got.shape, want64.shape)
    err = float(np.max(np.abs(got.astype(np.float64) - want64), initial=0.0))
    assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g}"


def make_module(backend: str, kv_heads: int, params: dict[str, np.ndarray], interleaved: bool = False, rope: bool = True,
                bias: bool = False) -> twinattn.nn.Attention:
    embedding = twinattn.RotaryEmbedding(HEAD_DIM, base=BASE, interleaved=interleaved) if rope else None
    module = twinattn.nn.Attention(HIDDEN, HEADS, kv_heads, HEAD_DIM, bias=bias, rope=embedding, backend=backend)
    module.load_state_dict(params)
    return module


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_forward_matches_float64_definition(backend: str, kv_heads: int, bias: bool) -> None:
    rng = np.random.default_rng(kv_heads + 10 * bias)
    params = make_params(rng, kv_heads, bias)
    x = rand(rng, 2, 9, HIDDEN)
    got = make_module(backend, kv_heads, params, bias=bias)(x)
    want = reference_forward(x, params, kv_heads)
    assert_close(got, want, tolerance(want, reference_forward(x, params, kv_heads, dtype=np.float32)))


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_cached_decode_equals_full_forward(backend: str, chunk: int, kv_heads: int, interleaved: bool) -> None:
    """For every prompt length 1..64: prefill the prompt, then feed the rest in chunks (the last
    one shorter); the outputs, token by token, are the full causal pass's."""
    rng = np.random.default_rng(chunk * 7 + kv_heads + 100 * interleaved)
    params = make_params(rng, kv_heads)
    longest = 64 + 2 * chunk + 1
    x = rand(rng, 2, longest, HIDDEN)
    want64 = reference_forward(x, params, kv_heads, interleaved=interleaved)
    tol = tolerance(want64, reference_forward(x, params, kv_heads, interleaved=interleaved, dtype=np.float32))
    module = make_module(backend, kv_heads, params, interleaved)
    assert_close(module(x), want64, tol, "uncached")
    cache = twinattn.KVCache(num_layers=1, batch_size=2, num_kv_heads=kv_heads, head_dim=HEAD_DIM, max_seq_len=longest)
    for prompt in range(1, 65):
        cache.reset()
        total = prompt + 2 * chunk + 1
        outputs = [module(x[:, :prompt], cache=cache)]
        done = prompt
        while done < total:
            step = min(chunk, total - done)
            outputs.append(module(x[:, done : done + step], cache=cache))
            done += step
        np.testing.assert_array_equal(cache.seq_lens(0), [total, total])
        assert_close(np.concatenate(outputs, axis=1), want64[:, :total], tol, f"prompt {prompt}")


def test_changed_future_token_leaves_earlier_outputs_unchanged(backend: str) -> None:
    rng = np.random.default_rng(5)
    params = make_params(rng, 2)
    module = make_module(backend, 2, params)
    x = rand(rng, 1, 12, HIDDEN)
    changed = x.copy()
    changed[:, 9] += 3.0
    full, full_changed = module(x), module(changed)
    np.testing.assert_array_equal(full[:, :9], full_changed[:, :9])  # bit-identical
    assert not np.allclose(full[:, 9], full_changed[:, 9])
    outputs = []
    for tokens in (x, changed):
        cache = twinattn.KVCache(1, 1, 2, HEAD_DIM, 12)
        outputs.append(np.concatenate([module(tokens[:, :8], cache=cache), module(tokens[:, 8:], cache=cache)], axis=1))
    np.testing.assert_array_equal(outputs[0][:, :9], outputs[1][:, :9])
    assert not np.allclose(outputs[0][:, 9:], outputs[1][:, 9:])


def test_ragged_batch_matches_each_sequence_alone(backend: str) -> None:
    """Prompts of lengths 5, 2 and 7 prefilled together (right-padded), then three decode steps:
    each sequence's new tokens sit at its own cache length."""
    rng = np.random.default_rng(6)
    params = make_params(rng, 2)
    module = make_module(backend, 2, params)
    lengths, steps = np.array([5, 2, 7]), 3
    sequences = [rand(rng, 1, n + steps, HIDDEN) for n in lengths]
    padded = np.zeros((3, 7, HIDDEN), dtype=np.float32)
    for b, n in enumerate(lengths):
        padded[b, :n] = sequences[b][0, :n]
    cache = twinattn.KVCache(1, 3, 2, HEAD_DIM, 16)
    prefill = module(padded, cache=cache, num_new=lengths)
    np.testing.assert_array_equal(cache.seq_lens(0), lengths)
    decoded = []
    for step in range(steps):
        np.testing.assert_array_equal(cache.positions(1)[:, 0], lengths + step)
        x_step = np.stack([sequences[b][0, lengths[b] + step] for b in range(3)])[:, None]
        decoded.append(module(x_step, cache=cache))
    for b, n in enumerate(lengths):
        want64 = reference_forward(sequences[b], params, 2)
        tol = tolerance(want64, reference_forward(sequences[b], params, 2, dtype=np.float32))
        got = np.concatenate([prefill[b : b + 1, :n]] + [d[b : b + 1] for d in decoded], axis=1)
        assert_close(got, want64, tol, f"sequence {b}")


def test_two_layers_share_one_cache(backend: str) -> None:
    """Positions come from each layer's own cache lengths: layer 1 runs after layer 0 has
    appended, and must still place its tokens at the positions layer 0 used."""
    rng = np.random.default_rng(7)
    params0, params1 = make_params(rng, 2), make_params(rng, 2)
    layer0, layer1 = make_module(backend, 2, params0), make_module(backend, 2, params1)
    x = rand(rng, 2, 10, HIDDEN)
    mid64 = reference_forward(x, params0, 2)
    want64 = reference_forward(mid64, params1, 2)
    want32 = reference_forward(reference_forward(x, params0, 2, dtype=np.float32), params1, 2, dtype=np.float32)
    cache = twinattn.KVCache(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=HEAD_DIM, max_seq_len=10)
    outputs = []
    for start, stop in ((0, 6), (6, 7), (7, 10)):
        hidden = layer0(x[:, start:stop], cache=cache, layer_idx=0)
        outputs.append(layer1(hidden, cache=cache, layer_idx=1))
    assert_close(np.concatenate(outputs, axis=1), want64, tolerance(want64, want32))


def test_explicit_positions(backend: str) -> None:
    rng = np.random.default_rng(8)
    params = make_params(rng, 2)
    module = make_module(backend, 2, params)
    x = rand(rng, 2, 6, HIDDEN)
    positions = np.array([[3, 4, 5, 6, 7, 8], [100, 101, 102, 103, 104, 105]])
    want64 = reference_forward(x, params, 2, positions=positions)
    tol = tolerance(want64, reference_forward(x, params, 2, positions=positions, dtype=np.float32))
    got = module(x, positions=positions)
    assert_close(got, want64, tol)
    # RoPE scores depend on relative positions only: a shifted sequence gives the unshifted outputs.
    assert_close(got, reference_forward(x, params, 2), tol, "shift invariance")


def test_attn_mask_is_applied_on_top_of_causal(backend: str) -> None:
    rng = np.random.default_rng(9)
    params = make_params(rng, 2)
    x = rand(rng, 1, 5, HIDDEN)
    mask = np.ones((5, 5), dtype=bool)
    mask[:, 1] = False  # nobody may read token 1
    want64 = reference_forward(x, params, 2, mask=mask)
    tol = tolerance(want64, reference_forward(x, params, 2, mask=mask, dtype=np.float32))
    assert_close(make_module(backend, 2, params)(x, attn_mask=mask), want64, tol)


def test_without_rope(backend: str) -> None:
    rng = np.random.default_rng(10)
    params = make_params(rng, 4)
    x = rand(rng, 1, 7, HIDDEN)
    want64 = reference_forward(x, params, 4, rope=False)
    tol = tolerance(want64, reference_forward(x, params, 4, rope=False, dtype=np.float32))
    assert_close(make_module(backend, 4, params, rope=False)(x), want64, tol)


def test_state_dict_round_trip_and_copy() -> None:
    params = make_params(np.random.default_rng(11), 2, bias=True)
    module = twinattn.nn.Attention(HIDDEN, HEADS, 2, HEAD_DIM, bias=True, backend="numpy")
    module.load_state_dict(params)
    params["q_proj.weight"][0, 0] = 123.0  # the module copied: later edits do not leak in
    state = module.state_dict()
    assert state["q_proj.weight"][0, 0] != 123.0
    assert sorted(state) == sorted(params)


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda p: p.pop("k_proj.weight"), KeyError, r"missing \['k_proj.weight'\], unexpected \[\]"),
        (lambda p: p.update({"q_proj.bias": np.zeros(32, np.float32)}), KeyError, r"unexpected \['q_proj.bias'\].*bias=True"),
        (
            lambda p: p.update({"q_proj.weight": p["q_proj.weight"].T}),
            ValueError,
            r"state_dict\['q_proj.weight'\]: expected shape \(32, 24\) \(out_features, in_features\), got \(24, 32\)",
        ),
        (lambda p: p.update({"o_proj.weight": np.zeros((24, 32), np.int32)}), TypeError, r"expected a float array, got dtype int32"),
    ],
    ids=["missing", "unexpected_bias", "transposed", "int"],
)
def test_load_state_dict_errors(edit, error: type, match: str) -> None:
    params = make_params(np.random.default_rng(12), 2)
    module = twinattn.nn.Attention(HIDDEN, HEADS, 2, HEAD_DIM, backend="numpy")
    before = module.state_dict()
    edit(params)
    with pytest.raises(error, match=match):
        module.load_state_dict(params)
    for name, value in module.state_dict().items():  # nothing was loaded
        np.testing.assert_array_equal(value, before[name])


def test_constructor_and_call_errors() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads: expected a divisor of num_heads=4.*got 3"):
        twinattn.nn.Attention(HIDDEN, 4, 3)
    with pytest.raises(ValueError, match=r"rope: expected a RotaryEmbedding with head_dim=8, got head_dim=16"):
        twinattn.nn.Attention(HIDDEN, 4, head_dim=8, rope=twinattn.RotaryEmbedding(16))
    with pytest.raises(ValueError, match=r"head_dim: hidden_size=30 is not a multiple of num_heads=4"):
        twinattn.nn.Attention(30, 4)
    with pytest.raises(ValueError, match=r"backend: expected one of .*got 'gpu'"):
        twinattn.nn.Attention(HIDDEN, 4, head_dim=8, backend="gpu")
    module = twinattn.nn.Attention(HIDDEN, 4, 2, head_dim=8, backend="numpy")
    with pytest.raises(TypeError, match=r"hidden_states: expected float32, got float64"):
        module(np.zeros((1, 2, HIDDEN)))
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \(B, L, hidden_size=24\), got \(1, 2, 16\)"):
        module(np.zeros((1, 2, 16), np.float32))
    with pytest.raises(ValueError, match=r"cache: expected \(batch_size, num_kv_heads, head_dim\) = \(1, 2, 8\), got \(1, 4, 8\)"):
        module(np.zeros((1, 2, HIDDEN), np.float32), cache=twinattn.KVCache(1, 1, 4, 8, 4))
    with pytest.raises(ValueError, match=r"positions: expected shape \(L=2,\) or \(B=1, L=2\), got \(3,\)"):
        module(np.zeros((1, 2, HIDDEN), np.float32), positions=np.arange(3))
    cache = twinattn.KVCache(1, 1, 2, 8, 3)
    module(np.zeros((1, 2, HIDDEN), np.float32), cache=cache)
    with pytest.raises(twinattn.CacheOverflowError):
        module(np.zeros((1, 2, HIDDEN), np.float32), cache=cache)
    np.testing.assert_array_equal(cache.seq_lens(0), [2])


# ---- with a float16 / bfloat16 cache ------------------------------------------------------------


def _attention_module(backend: str) -> tuple[twinattn.nn.Attention, np.random.Generator]:
    rng = np.random.default_rng(12)
    hidden, heads, kv_heads, head_dim = 64, 8, 2, 16
    module = twinattn.nn.Attention(hidden, heads, kv_heads, head_dim, rope=twinattn.RotaryEmbedding(head_dim), backend=backend)
    return module, rng


# prefill 9 tokens, then three decode steps: (start, end) of each call
_STEPS = ((0, 9), (9, 10), (10, 11), (11, 12))


def _projected_by_hand(module: twinattn.nn.Attention, x: np.ndarray, start: int, end: int) -> tuple[np.ndarray, ...]:
    """q, k and v (B, H, L, 16) of x[:, start:end] by hand: the layer's float32 projections and RoPE
    (the same operations, so the same bits)."""
    params = module.state_dict()
    chunk, length, positions = x[:, start:end], end - start, np.arange(start, end)
    q, k, v = ((chunk @ params[f"{n}_proj.weight"].T).reshape(2, length, -1, 16).transpose(0, 2, 1, 3) for n in "qkv")
    q, k = module.rope.apply(q, positions), module.rope.apply(k, positions)  # type: ignore[union-attr]
    return q, k, v


@half_dtypes
def test_nn_attention_with_a_half_cache(backend: str, dtype: np.dtype) -> None:
    """Prefill then three decode steps with a float16 / bfloat16 cache, against the same steps done
    by hand: float32 projections and RoPE (the same operations, so the same bits), q, k and v
    rounded to the dtype, the float64 reference attention over everything cached, out rounded to
    the dtype, the output projection in float64. The layer may differ from that by its float32
    attention error and by one ulp of out in the dtype (it rounds its float32 result, the
    reference the exact one) carried through o_proj: sum_c |W_o[r, c]| ulp(out_c), plus float32
    roundoff of the output projection."""
    module, rng = _attention_module(backend)
    w_o = module.state_dict()["o_proj.weight"]
    x = rand(rng, 2, 12, 64)
    cache = twinattn.KVCache(1, 2, 2, 16, 20, dtype=dtype)
    stored_k, stored_v = np.zeros((2, 2, 0, 16), dtype), np.zeros((2, 2, 0, 16), dtype)
    for start, end in _STEPS:
        got = module(x[:, start:end], cache=cache)
        assert got.dtype == np.float32
        q, k, v = _projected_by_hand(module, x, start, end)
        length = end - start
        stored_k = np.concatenate([stored_k, k.astype(dtype)], axis=2)
        stored_v = np.concatenate([stored_v, v.astype(dtype)], axis=2)
        exact = reference64(q.astype(dtype), stored_k, stored_v, causal=True, q_offset=start, scale=0.25)
        out = round_to_dtype(exact, dtype).astype(np.float64)
        merged = out.transpose(0, 2, 1, 3).reshape(2, length, -1)
        want = merged @ w_o.T.astype(np.float64)
        ulp = 2 * half_ulp(np.abs(exact), dtype).transpose(0, 2, 1, 3).reshape(2, length, -1)
        tol = ulp @ np.abs(w_o.T).astype(np.float64) + 64 * UNIT_ROUNDOFF * (np.abs(merged) @ np.abs(w_o.T).astype(np.float64))
        err = np.abs(got - want)
        assert (err <= tol).all(), f"max error {float(err.max()):.3g}, tolerance there {float(tol.flat[np.argmax(err)]):.3g}"
    np.testing.assert_array_equal(cache.keys(0).view(np.uint16), stored_k.view(np.uint16))
    assert cache.keys(0).dtype == dtype and cache.nbytes * 2 == twinattn.KVCache(1, 2, 2, 16, 20).nbytes


def test_nn_attention_with_an_int8_cache(backend: str) -> None:
    """Prefill then three decode steps with an int8 cache, against the same steps by hand: float32
    projections and RoPE (the same bits), k and v quantized (quantize_kv: the cache must hold
    exactly those), q float32, the float64 reference attention over the dequantized cache, the
    output projection in float64. Tolerance: the float32 attention error (a multiple of the NumPy
    float32 reference's, plus a floor) carried through o_proj, plus float32 roundoff of o_proj."""
    module, rng = _attention_module(backend)
    w_o = module.state_dict()["o_proj.weight"]
    x = rand(rng, 2, 12, 64)
    cache = twinattn.KVCache(1, 2, 2, 16, 20, dtype="int8")
    stored_k, stored_v = np.zeros((2, 2, 0, 16), np.float32), np.zeros((2, 2, 0, 16), np.float32)
    w_o64 = np.abs(w_o.T).astype(np.float64)
    for start, end in _STEPS:
        got = module(x[:, start:end], cache=cache)
        assert got.dtype == np.float32
        q, k, v = _projected_by_hand(module, x, start, end)
        length = end - start
        stored_k = np.concatenate([stored_k, twinattn.dequantize_kv(*twinattn.quantize_kv(np.ascontiguousarray(k)))], axis=2)
        stored_v = np.concatenate([stored_v, twinattn.dequantize_kv(*twinattn.quantize_kv(np.ascontiguousarray(v)))], axis=2)
        exact = reference64(q, stored_k, stored_v, causal=True, q_offset=start, scale=0.25)
        f32 = reference32(q, stored_k, stored_v, causal=True, q_offset=start, scale=0.25)
        attn_tol = FLOAT32_ERROR_FACTOR * float(np.abs(f32 - exact).max()) + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(stored_v).max()))
        merged = exact.transpose(0, 2, 1, 3).reshape(2, length, -1)
        want = merged @ w_o.T.astype(np.float64)
        tol = attn_tol * w_o64.sum(axis=0) + 64 * UNIT_ROUNDOFF * (np.abs(merged) @ w_o64)
        err = np.abs(got - want)
        assert (err <= tol).all(), f"max error {float(err.max()):.3g}, tolerance there {float(tol.flat[np.argmax(err)]):.3g}"
    np.testing.assert_array_equal(twinattn.dequantize_kv(cache.keys(0).copy(), cache.scales(0)[0].copy()), stored_k)
    assert cache.keys(0).dtype == np.int8 and cache.nbytes == 2 * 2 * 2 * 20 * (16 + 4)


def test_nn_attention_refuses_a_float64_cache(backend: str) -> None:
    module, rng = _attention_module(backend)
    with pytest.raises(TypeError, match=r"cache: expected a KVCache of dtype float32, float16, bfloat16 \(ml_dtypes.bfloat16\) or int8, got float64"):
        module(rand(rng, 2, 3, 64), cache=twinattn.KVCache(1, 2, 2, 16, 20, dtype=np.float64))
