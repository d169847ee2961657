"""twinattn.flash: flash-attn 2.x's functions against a float64 reference of flash-attn's documented
semantics, written here in plain torch: softmax over the scaled scores (softcap first), with
bottom-right causality and windows (query row i of a sequence with Lq queries and Lk keys sits at
p = Lk - Lq + i) and ALiBi -slope * |p - j|. Every test runs on numpy, cpp and rust (use_backend).
Inputs are random normal with distinct seeds per test, so that transposed heads or positions show."""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import pytest

from conftest import import_optional

torch = import_optional("torch", "twinattn.flash needs it: pip install torch")
flash = import_optional("twinattn.flash", "flash-attn's API on torch")
tt = import_optional("twinattn.torch", "the torch integration")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# machine epsilon of each dtype: the output is rounded once to it (and half-precision products
# pass through it), so the error against the float64 reference is a few epsilons of max|v|
EPS = {torch.float32: 2.0**-23 * 64, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture
def port(backend: str) -> Iterator[str]:
    with flash.use_backend(backend):
        yield backend


def reference(q: Any, k: Any, v: Any, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None) -> tuple[Any, Any]:
    """flash-attn's attention in float64: q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) ->
    out (B, Lq, Hq, Dv), lse (B, Hq, Lq). Differentiable (torch autograd)."""
    q, k, v = q.double(), k.double(), v.double()
    batch, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(hq // hkv, dim=2), v.repeat_interleave(hq // hkv, dim=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    p = (torch.arange(lq) + lk - lq)[:, None]
    j = torch.arange(lk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1 if alibi_slopes.dim() == 2 else 1, hq)
        scores = scores - slopes[:, :, None, None] * (p - j).abs()
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= p - left
    if right >= 0:
        visible &= j <= p + right
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse


def assert_close(got: Any, want: Any, dtype: Any, scale: float) -> None:
    assert torch.isfinite(got.double()).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * EPS[dtype] * scale, f"max error {err} > {2 * EPS[dtype] * scale}"


def rand(gen: Any, *shape: int, dtype: Any = torch.float32) -> Any:
    return torch.randn(*shape, generator=gen).to(dtype)


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_square": dict(causal=True, lq=7),
    "window": dict(window_size=(3, 1)),
    "causal_window": dict(causal=True, window_size=(2, 0)),
    "softcap": dict(softcap=2.0, softmax_scale=0.9),
    "alibi_heads": dict(causal=True, alibi=(4,)),
    "alibi_batch": dict(alibi=(2, 4)),
    "gqa_dv": dict(hkv=1, dv=12),
}


def _problem(seed: int, dtype: Any, lq: int = 3, hkv: int = 2, dv: int = 16, alibi: Any = None, **options: Any) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = rand(gen, 2, lq, 4, 16, dtype=dtype), rand(gen, 2, 7, hkv, 16, dtype=dtype), rand(gen, 2, 7, hkv, dv, dtype=dtype)
    if alibi is not None:
        options["alibi_slopes"] = torch.rand(*alibi, generator=gen) * 0.5
    return q, k, v, options


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_func_matches_reference(port: str, dtype: str, case: str) -> None:
    q, k, v, options = _problem(11, DTYPES[dtype], **CASES[case])
    out, lse, probs = flash.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    want, want_lse = reference(q, k, v, **options)
    assert out.shape == want.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 4, q.shape[1]) and lse.dtype == torch.float32 and probs is None
    assert_close(out, want, q.dtype, v.double().abs().max().item())
    assert_close(lse, want_lse, torch.float32, want_lse.abs().max().item())
    assert torch.equal(flash.flash_attn_func(q, k, v, **options), out)


@pytest.mark.parametrize("case", ["plain", "causal", "causal_window", "softcap", "alibi_heads", "gqa_dv"])
def test_func_gradients(port: str, case: str) -> None:
    q, k, v, options = _problem(12, torch.float32, **CASES[case])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    dout = rand(torch.Generator().manual_seed(13), *q.shape[:-1], v.shape[-1])
    flash.flash_attn_func(*leaves, **options).backward(dout)
    reference(*leaves64, **options)[0].backward(dout.double())
    for name, got, want in zip("qkv", leaves, leaves64):
        bound = 1e-4 * max(1.0, want.grad.abs().max().item())
        assert (got.grad.double() - want.grad).abs().max().item() <= bound, name


def _packed(seed: int, q_lens: list[int], k_lens: list[int], dtype: Any = torch.float32) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = rand(gen, sum(q_lens), 4, 16, dtype=dtype)
    k, v = rand(gen, sum(k_lens), 2, 16, dtype=dtype), rand(gen, sum(k_lens), 2, 8, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _varlen_reference(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, **options: Any) -> tuple[Any, Any]:
    outs, lses = [], []
    slopes = options.pop("alibi_slopes", None)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq_slopes = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        out, lse = reference(q[None, rows], k[None, keys], v[None, keys], alibi_slopes=seq_slopes, **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


VARLEN_CASES = {"plain": dict(), "causal": dict(causal=True), "window_alibi": dict(window_size=(2, 1), alibi=True),
                "softcap_causal": dict(causal=True, softcap=1.5)}
Q_LENS, K_LENS = [3, 1, 0, 5, 2], [4, 6, 3, 5, 9]  # a sequence without queries too


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_reference(port: str, dtype: str, case: str) -> None:
    q, k, v, cu_q, cu_k = _packed(21, Q_LENS, K_LENS, DTYPES[dtype])
    options = dict(VARLEN_CASES[case])
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(len(Q_LENS), 4, generator=torch.Generator().manual_seed(22))
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), return_attn_probs=True, **options)
    want, want_lse = _varlen_reference(q, k, v, cu_q, cu_k, **options)
    assert out.shape == (sum(Q_LENS), 4, 8) and out.dtype == q.dtype and lse.shape == (4, sum(Q_LENS))
    assert_close(out, want, q.dtype, v.double().abs().max().item())
    assert_close(lse, want_lse, torch.float32, want_lse.abs().max().item())


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_gradients(port: str, case: str) -> None:
    q, k, v, cu_q, cu_k = _packed(23, Q_LENS, K_LENS)
    options = dict(VARLEN_CASES[case])
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(4, generator=torch.Generator().manual_seed(24))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    dout = rand(torch.Generator().manual_seed(25), sum(Q_LENS), 4, 8)
    out, lse, _ = flash.flash_attn_varlen_func(*leaves, cu_q, cu_k, 5, 9, return_attn_probs=True, **options)
    assert lse.shape == (4, sum(Q_LENS))
    with torch.no_grad():  # the packed native call gives the same forward
        packed = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, **options)
    assert (out.detach() - packed).abs().max().item() <= 1e-5
    out.backward(dout)
    _varlen_reference(*leaves64, cu_q, cu_k, **options)[0].backward(dout.double())
    for name, got, want in zip("qkv", leaves, leaves64):
        assert got.grad.shape == want.shape
        bound = 1e-4 * max(1.0, want.grad.abs().max().item())
        assert (got.grad.double() - want.grad).abs().max().item() <= bound, name


def _to_blocks(dense: Any, table: Any, block_size: int, num_blocks: int) -> Any:
    """A dense cache (B, L, H, D) as blocks (num_blocks, block_size, H, D) through the table;
    the blocks nobody uses, and the tails past L, hold NaN."""
    blocks = torch.full((num_blocks, block_size, *dense.shape[2:]), float("nan"), dtype=dense.dtype)
    for b in range(table.shape[0]):
        for i in range(table.shape[1]):
            chunk = dense[b, i * block_size:(i + 1) * block_size]
            blocks[table[b, i], : len(chunk)] = chunk
    return blocks


def _kvcache_reference(q: Any, keys: list[Any], values: list[Any], **options: Any) -> tuple[Any, Any]:
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = reference(q[b:b + 1], keys[b][None], values[b][None], **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _rotate64(x: Any, cos: Any, sin: Any, positions: Any, interleaved: bool) -> Any:
    """flash-attn's rotary embedding in float64: x (B, L, H, D), positions (B, L)."""
    x = x.double().clone()
    half = cos.shape[1]
    c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]
    idx_a = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    idx_b = idx_a + 1 if interleaved else idx_a + half
    a, b = x[..., idx_a].clone(), x[..., idx_b].clone()
    x[..., idx_a], x[..., idx_b] = a * c - b * s, b * c + a * s
    return x


KV_CASES = {
    "dense": dict(),
    "dense_batch_idx": dict(batch_idx=True),
    "paged_1": dict(block_size=1),
    "paged_16": dict(block_size=16),
    "dense_rotary_interleaved": dict(rotary=(16, True), causal=True),
    "dense_rotary_half_partial": dict(rotary=(8, False), causal=True),
    "paged_rotary_noncausal": dict(block_size=16, rotary=(8, True)),
    "batch_idx_rotary_window": dict(batch_idx=True, rotary=(16, False), window_size=(4, 0)),
    "no_append": dict(new=0, causal=True),
    "paged_1_no_append_alibi": dict(block_size=1, new=0, alibi=True),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KV_CASES))
def test_with_kvcache(port: str, dtype: str, case: str) -> None:
    """The new k and v land in the cache in place (rotated k where rotary is given), the rest of
    the cache is untouched, and out and lse follow the reference over the updated cache."""
    spec = dict(KV_CASES[case])
    gen = torch.Generator().manual_seed(31)
    dt = DTYPES[dtype]
    batch, batch_cache, length, lq, new = 3, 5, 20, 2, spec.pop("new", 2)
    lens = [5, 0, 11] if new else [5, 2, 11]
    q = rand(gen, batch, lq, 4, 16, dtype=dt)
    dense_k, dense_v = rand(gen, batch_cache, length, 2, 16, dtype=dt), rand(gen, batch_cache, length, 2, 16, dtype=dt)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32) if spec.pop("batch_idx", False) else None
    options: dict[str, Any] = {key: spec[key] for key in ("causal", "window_size") if key in spec}
    if spec.get("alibi"):
        options["alibi_slopes"] = torch.rand(4, generator=gen)
    k_new = rand(gen, batch, new, 2, 16, dtype=dt) if new else None
    v_new = rand(gen, batch, new, 2, 16, dtype=dt) if new else None
    kwargs: dict[str, Any] = dict(k=k_new, v=v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32), cache_batch_idx=rows)
    q_ref, k_ref = q, k_new
    if "rotary" in spec:
        rotary_dim, interleaved = spec["rotary"]
        angle = torch.rand(length, rotary_dim // 2, generator=gen) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dt), torch.sin(angle).to(dt)
        kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
        lens_t = torch.tensor(lens)[:, None]
        k_ref = _rotate64(k_new, cos, sin, lens_t + torch.arange(new), interleaved)
        q_pos = lens_t + torch.arange(lq) if options.get("causal") or "window_size" in options else lens_t.expand(batch, lq)
        q_ref = _rotate64(q, cos, sin, q_pos, interleaved)
    cache_rows = rows.long() if rows is not None else torch.arange(batch)
    keys = [torch.cat([dense_k[r, :n].double(), k_ref[b].double().to(dt).double()]) if new else dense_k[r, :n].double()
            for b, (r, n) in enumerate(zip(cache_rows.tolist(), lens))]
    values = [torch.cat([dense_v[r, :n], v_new[b]]) if new else dense_v[r, :n] for b, (r, n) in enumerate(zip(cache_rows.tolist(), lens))]
    if "block_size" in spec:
        size = spec["block_size"]
        per_seq = -(-length // size)
        order = torch.randperm(batch * per_seq + 3, generator=gen)  # shuffled, 3 spare blocks nobody uses
        table = order[: batch * per_seq].reshape(batch, per_seq).to(torch.int32)
        k_cache, v_cache = _to_blocks(dense_k, table, size, len(order)), _to_blocks(dense_v, table, size, len(order))
        kwargs["block_table"] = table
    else:
        k_cache, v_cache = dense_k.clone(), dense_v.clone()
    before_k = k_cache.clone()

    out, lse = flash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs, **options)
    want, want_lse = _kvcache_reference(q_ref.to(dt), keys, values, **options)
    assert out.shape == (batch, lq, 4, 16) and out.dtype == dt and lse.shape == (batch, 4, lq) and lse.dtype == torch.float32
    assert_close(out, want, dt, dense_v.double().abs().max().item())
    assert_close(lse, want_lse, torch.float32, want_lse.abs().max().item())

    # the cache now holds the new keys and values where flash-attn writes them, and nothing else changed
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(batch):
        for i in range(new):
            pos = lens[b] + i
            if "block_size" in spec:
                where = (int(table[b, pos // spec["block_size"]]), pos % spec["block_size"])
            else:
                where = (int(cache_rows[b]), pos)
            assert torch.equal(v_cache[where], v_new[b, i])
            if "rotary" in spec:  # rotated in float32, rounded once to the cache's dtype
                assert_close(k_cache[where], k_ref[b, i], dt, k_ref.abs().max().item())
            else:
                assert torch.equal(k_cache[where], k_new[b, i])
            written[where] = True
    assert torch.equal(k_cache[~written].isnan(), before_k[~written].isnan())
    assert torch.equal(k_cache[~written].nan_to_num(), before_k[~written].nan_to_num())


def test_kvcache_int_seqlens_and_whole_cache(port: str) -> None:
    gen = torch.Generator().manual_seed(41)
    q, k_cache, v_cache = rand(gen, 2, 1, 4, 16), rand(gen, 2, 9, 2, 16), rand(gen, 2, 9, 2, 16)
    whole = flash.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert_close(whole, reference(q, k_cache, v_cache)[0], torch.float32, 4.0)
    part = flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6, causal=True)
    assert_close(part, reference(q, k_cache[:, :6], v_cache[:, :6], causal=True)[0], torch.float32, 4.0)
    rows = rand(gen, 2, 3, 4, 16)  # more queries than keys: fine without causal (one key, weight 1)
    few = flash.flash_attn_with_kvcache(rows, k_cache, v_cache, cache_seqlens=1)
    assert_close(few, reference(rows, k_cache[:, :1], v_cache[:, :1])[0], torch.float32, 4.0)


def test_use_backend_reaches_twinattn(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = tt.attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["backend"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tt, "attention", spy)
    q = torch.randn(1, 2, 2, 8)
    with flash.use_backend(backend):
        flash.flash_attn_func(q, q, q)
    flash.flash_attn_func(q, q, q)
    assert seen == [backend, "auto"]
    with pytest.raises(ValueError, match="backend"):
        flash.use_backend("cuda")


def test_errors() -> None:
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3], dtype=torch.int32),
                                     torch.tensor([0, 3], dtype=torch.int32), 3, 3, dropout_p=0.5)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flash.flash_attn_with_kvcache(q, q, q, cache_leftpad=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions \(batch, seqlen, nheads, headdim\)"):
        flash.flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match="k: twinattn.flash runs on the CPU"):
        flash.flash_attn_func(q, torch.empty(1, 3, 2, 8, device="meta"), q)
    with pytest.raises(TypeError, match="torch.float32"):
        flash.flash_attn_func(q, q.half(), q)
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash.flash_attn_with_kvcache(q, q, q, cache_seqlens=2.0)
    with pytest.raises(ValueError, match="rotary_cos"):
        flash.flash_attn_with_kvcache(q, q, q, rotary_cos=torch.ones(3, 4), rotary_sin=torch.ones(3, 4))
    with pytest.raises(TypeError, match="k: expected the cache's dtype torch.float32"):
        flash.flash_attn_with_kvcache(q, q, q, k=q[:, :1].half(), v=q[:, :1].half(), cache_seqlens=1)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected values in \[0, 3\]"):
        flash.flash_attn_with_kvcache(q, q, q, cache_seqlens=4)
    with pytest.raises(ValueError, match="capacity"):
        flash.flash_attn_with_kvcache(q, q, q, k=q[:, :2], v=q[:, :2], cache_seqlens=2)
    with pytest.raises(NotImplementedError, match="block_table"):
        leaf = q[0].clone().requires_grad_()
        flash.flash_attn_varlen_func(leaf, q, q, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                                     3, 3, block_table=torch.zeros(1, 1, dtype=torch.int32))


# flash-attn 2.x's parameter lists (flash_attn_interface.py), in order: code calling positionally works
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic return_attn_probs",
    "flash_attn_varlen_func": (
        "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal window_size softcap "
        "alibi_slopes deterministic return_attn_probs block_table"
    ),
    "flash_attn_with_kvcache": (
        "q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad block_table softmax_scale "
        "causal window_size softcap rotary_interleaved alibi_slopes num_splits return_softmax_lse"
    ),
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_signatures_are_flash_attn_s(name: str) -> None:
    import inspect

    assert list(inspect.signature(getattr(flash, name)).parameters) == FLASH_ATTN_SIGNATURES[name].split()
