"""twinattn.torch: the NumPy API's results on torch CPU tensors, read in place; the custom op as
torch.compile and torch.export see it; the errors for what it does not do (GPU, out= under autograd, dtypes)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import twinattn
from helpers import FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF, rand, reference64

from conftest import import_optional  # noqa: E402

torch = import_optional("torch", "twinattn.torch needs it: pip install torch")
tt = import_optional("twinattn.torch", "the torch integration")
import ml_dtypes  # noqa: E402  (a dependency of twinattn)

# (torch dtype, NumPy dtype, unit roundoff: half an ulp relative, 2^-p for p significand bits)
DTYPES = {
    "float32": (torch.float32, np.dtype(np.float32), 2.0**-24),
    "float16": (torch.float16, np.dtype(np.float16), 2.0**-11),
    "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16), 2.0**-8),
}
HALF = ["float16", "bfloat16"]


def _as_tensor(a: np.ndarray) -> Any:
    """The tensor over a NumPy array's memory (ml_dtypes.bfloat16 as torch.bfloat16), for inputs
    whose values are exactly those the NumPy API gets."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _as_array(t: Any) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _tensors(seed: int, batch: int, q_heads: int, kv_heads: int, q_len: int, k_len: int, dim: int, vdim: int):
    rng = np.random.default_rng(seed)
    return (
        rand(rng, batch, q_heads, q_len, dim),
        rand(rng, batch, kv_heads, k_len, dim),
        rand(rng, batch, kv_heads, k_len, vdim),
    )


CASES = [
    # (id, shapes, keywords with NumPy values: each becomes a tensor for the torch call)
    ("tiny", (1, 1, 1, 16, 16, 64, 64), {"causal": True}),
    ("gqa-decode", (2, 6, 2, 1, 37, 32, 32), {"causal": True}),
    ("kv-lens-offsets", (2, 4, 4, 5, 19, 16, 24), {"causal": True, "q_offset": np.array([3, 11]), "kv_lens": np.array([9, 19])}),
    ("bool-mask", (2, 2, 1, 7, 9, 8, 8), {"attn_mask": np.arange(9) % 3 != 1}),
    ("float-bias-scale", (1, 3, 3, 4, 6, 8, 5), {"attn_mask": np.linspace(-2, 1, 6, dtype=np.float32), "scale": 0.3}),
    ("rank3", (1, 2, 2, 3, 5, 4, 4), {"causal": True}),
    # the variants: every keyword of twinattn.attention reaches it through twinattn.torch
    ("window-softcap", (2, 4, 2, 3, 11, 16, 16), {"causal": True, "window_size": (4, 0), "softcap": 0.8}),
    ("alibi-sinks", (1, 4, 2, 5, 9, 8, 8), {
        "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32), "sinks": np.array([0.3, -1.0, 2.0, 0.0], np.float32)}),
]


@pytest.mark.parametrize(("case", "shapes", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_api_bit_for_bit(native_backend: str, case: str, shapes: tuple[int, ...], kwargs: dict) -> None:
    q, k, v = _tensors(7, *shapes)
    if case == "rank3":  # (H, L, D) in, (H, L, Dv) out
        q, k, v = q[0], k[0], v[0]
    want, want_lse = twinattn.attention(q, k, v, return_lse=True, backend=native_backend, **kwargs)
    as_torch = {n: torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}
    got, lse = tt.attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), return_lse=True, backend=native_backend, **as_torch
    )
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and lse.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # and the NumPy API itself against the float64 reference, so this test cannot pass on a wrong kernel
    ref = reference64(q, k, v, **kwargs)
    f32 = twinattn.attention(q, k, v, backend="numpy", **kwargs)
    tol = FLOAT32_ERROR_FACTOR * float(np.abs(f32 - ref).max()) + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(ref).max()))
    assert float(np.abs(got.numpy() - ref).max()) <= tol


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("case", "shapes", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_half_matches_numpy_api_bit_for_bit(
    backend: str, dtype: str, case: str, shapes: tuple[int, ...], kwargs: dict
) -> None:
    # float16 / bfloat16 tensors: the NumPy API's result on the same values (bfloat16 as
    # ml_dtypes.bfloat16), bit for bit, out in q's dtype, lse float32
    torch_dtype, np_dtype, roundoff = DTYPES[dtype]
    q, k, v = (x.astype(np_dtype) for x in _tensors(23, *shapes))
    if case == "rank3":
        q, k, v = q[0], k[0], v[0]
    want, want_lse = twinattn.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    as_torch = {n: torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}
    got, lse = tt.attention(_as_tensor(q), _as_tensor(k), _as_tensor(v), return_lse=True, backend=backend, **as_torch)
    assert got.dtype == torch_dtype and lse.dtype == torch.float32
    np.testing.assert_array_equal(_as_array(got).view(np.int16), want.view(np.int16))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # and against the float64 reference on the same (rounded) inputs: the float32 computation's
    # error (as measured on the float32 reference), then out rounded once to the dtype (half an ulp,
    # relative: roundoff x |out|; float16's subnormals: half the smallest one, 2^-25, absolute), and
    # for bfloat16 the ports' dot-product path rounds each p to bfloat16 before P.V (8 significant
    # bits: relative 2^-8, so 2^-8 sum p |v| <= 2^-8 max |v|)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref = reference64(q64, k64, v64, **kwargs)
    f32 = twinattn.attention(*(x.astype(np.float32) for x in (q, k, v)), backend="numpy", **kwargs)
    tol32 = FLOAT32_ERROR_FACTOR * float(np.abs(f32 - ref).max()) + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(np.abs(ref).max()))
    p_rounding = 2.0**-8 * float(np.abs(v64).max()) if dtype == "bfloat16" else 0.0
    tol = tol32 + p_rounding + roundoff * (np.abs(ref) + tol32 + p_rounding) + 2.0**-25
    err = np.abs(_as_array(got).astype(np.float64) - ref)
    assert (err <= tol).all(), f"max error {err.max():.3g}, where the tolerance is {tol.flat[err.argmax()]:.3g}"


@pytest.mark.parametrize("dtype", HALF)
def test_half_bias_in_qs_dtype_is_the_float32_bias(backend: str, dtype: str) -> None:
    # an additive bias given in q's dtype is widened to float32 (exactly), so it gives what the
    # float32 bias of the same values gives
    torch_dtype = DTYPES[dtype][0]
    q, k, v = (torch.from_numpy(a).to(torch_dtype) for a in _tensors(29, 2, 4, 2, 5, 9, 8, 8))
    bias = torch.linspace(-3, 2, 9).to(torch_dtype)
    got = tt.attention(q, k, v, attn_mask=bias, backend=backend)
    want = tt.attention(q, k, v, attn_mask=bias.float(), backend=backend)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got, tt.attention(q, k, v, backend=backend))  # the bias changes the result


@pytest.mark.parametrize("dtype", HALF)
def test_half_reads_strided_inputs_and_writes_strided_out_in_place(backend: str, dtype: str) -> None:
    torch_dtype = DTYPES[dtype][0]
    rng = np.random.default_rng(31)
    q_blhd, k_blhd, v_blhd = (torch.from_numpy(rand(rng, 2, 11, h, 16)).to(torch_dtype) for h in (6, 3, 3))
    q, k, v = (t.transpose(1, 2) for t in (q_blhd, k_blhd, v_blhd))
    # read in place: the NumPy view twinattn.attention gets starts at the tensor's first element,
    # with its strides (bfloat16 through the int16 view: no copy)
    view = tt._array("q", q)
    assert view.__array_interface__["data"][0] == q.data_ptr() and view.strides == tuple(2 * s for s in q.stride())
    out_blhd = torch.full((2, 11, 6, 16), float("nan"), dtype=torch_dtype)
    out = out_blhd.transpose(1, 2)
    got = tt.attention(q, k, v, causal=True, out=out, backend=backend)
    assert got is out and got.data_ptr() == out_blhd.data_ptr()
    want = twinattn.attention(*(_as_array(t.contiguous()) for t in (q, k, v)), causal=True, backend=backend)
    np.testing.assert_array_equal(_as_array(out_blhd.transpose(1, 2).contiguous()).view(np.int16), want.view(np.int16))


def test_reads_strided_inputs_and_writes_strided_out_in_place() -> None:
    # the layout a model has: (B, L, H, D) projections viewed as (B, H, L, D), and the output
    # written straight into a (B, L, H, Dv) buffer through its transposed view
    rng = np.random.default_rng(3)
    q_blhd, k_blhd, v_blhd = (torch.from_numpy(rand(rng, 2, 11, h, 16)) for h in (6, 3, 3))
    q, k, v = (t.transpose(1, 2) for t in (q_blhd, k_blhd, v_blhd))
    assert not q.is_contiguous()
    out_blhd = torch.full((2, 11, 6, 16), float("nan"))
    out = out_blhd.transpose(1, 2)
    got = tt.attention(q, k, v, causal=True, out=out)
    assert got is out and got.data_ptr() == out_blhd.data_ptr()
    want = twinattn.attention(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), causal=True)
    np.testing.assert_array_equal(out_blhd.transpose(1, 2).numpy(), want)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_works_under_inference_mode_and_no_grad(dtype: str) -> None:
    q, k, v = (torch.from_numpy(a).to(DTYPES[dtype][0]) for a in _tensors(5, 1, 2, 1, 4, 6, 8, 8))
    want = tt.attention(q, k, v, causal=True)
    assert want.dtype == q.dtype
    with torch.inference_mode():
        qi, ki, vi = q.clone(), k.clone(), v.clone()
        got = tt.attention(qi, ki, vi, causal=True)
    assert got.is_inference()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():  # grad-requiring leaves are fine where no graph is recorded
        got = tt.attention(q.requires_grad_(), k, v, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_errors_name_the_argument_and_the_fix() -> None:
    q, k, v = (torch.from_numpy(a) for a in _tensors(5, 1, 2, 1, 4, 6, 8, 8))
    with pytest.raises(RuntimeError, match=r"out: .*does not record gradients.*call it without out="):
        tt.attention(q.clone().requires_grad_(), k, v, out=torch.empty(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"k: twinattn runs on the CPU.*meta"):
        tt.attention(q, k.to("meta"), v)
    with pytest.raises(TypeError, match=r"q: expected a torch.Tensor, got ndarray"):
        tt.attention(q.numpy(), k, v)
    # dtypes: q's first, then k and v against q's, then out; each with the conversion that fixes it
    with pytest.raises(TypeError, match=r"q: expected dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int64"):
        tt.attention(q.long(), k, v)
    with pytest.raises(TypeError, match=r"v: expected dtype torch.float32 \(q's dtype\), got torch.bfloat16; convert with v.to\(torch.float32\)"):
        tt.attention(q, k, v.to(torch.bfloat16))
    with pytest.raises(TypeError, match=r"k: expected dtype torch.float16 \(q's dtype\), got torch.float32; convert with k.to\(torch.float16\)"):
        tt.attention(q.half(), k, v.half())
    with pytest.raises(TypeError, match=r"out: expected dtype torch.float32 \(q's dtype\), got torch.bfloat16"):
        tt.attention(q, k, v, out=torch.empty(1, 2, 4, 8, dtype=torch.bfloat16))
    # the NumPy API's own checks come through with the same messages
    with pytest.raises(ValueError, match=r"query heads Hq=2 must be a multiple"):
        tt.attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8))


def test_float64_on_a_port_names_the_torch_conversion(native_backend: str) -> None:
    """float64 is the numpy backend's: on a port the message names the fix in torch's terms."""
    q, k, v = (torch.from_numpy(a).double() for a in _tensors(5, 1, 2, 1, 4, 6, 8, 8))
    with pytest.raises(TypeError, match=rf"^q: backend '{native_backend}' computes in float32 and does not cast silently; "
                                        r"got torch.float64: pass q.float\(\) \(and k.float\(\), v.float\(\)\), or use "
                                        r"backend='numpy' for float64$"):
        tt.attention(q, k, v, backend=native_backend)
    assert tt.attention(q, k, v, backend="numpy").dtype == torch.float64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float32, requires grad"])
def test_numpy_api_given_tensors_names_twinattn_torch(dtype: str) -> None:
    """twinattn.attention takes NumPy arrays: torch tensors (of any dtype, requiring grad or not)
    raise TypeError naming twinattn.torch.attention, never torch's own error nor an ndarray back."""
    q, k, v = (torch.from_numpy(a).to(DTYPES[dtype.split(",")[0]][0]) for a in _tensors(5, 1, 2, 1, 4, 6, 8, 8))
    if "grad" in dtype:
        q.requires_grad_()
    for backend in twinattn.backends():
        with pytest.raises(TypeError, match=r"^q: got a torch tensor, and twinattn.attention takes NumPy arrays; for "
                                            r"torch tensors call twinattn.torch.attention\(q, k, v, ...\), which takes "
                                            r"the same keywords and returns tensors$"):
            twinattn.attention(q, k, v, causal=True, backend=backend)
    with pytest.raises(TypeError, match=r"^v: got a torch tensor"):
        twinattn.attention(_as_array(q.detach()), _as_array(k), v)
    # the NumPy sdpa likewise names its torch twin, and never returns an ndarray for tensors
    with pytest.raises(TypeError, match=r"^query: got a torch tensor, and twinattn.scaled_dot_product_attention takes "
                                        r"NumPy arrays; for torch tensors call twinattn.torch.scaled_dot_product_attention"
                                        r"\(query, key, value, ...\)"):
        twinattn.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_custom_op_real_and_fake_agree(dtype: str) -> None:
    q, k, v = (torch.from_numpy(a).to(DTYPES[dtype][0]) for a in _tensors(9, 2, 4, 2, 3, 7, 8, 8))
    lens = torch.tensor([5, 7])
    out, lse = torch.ops.twinattn.attention(q, k, v, True, None, lens, None, 0.5)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    want, want_lse = twinattn.attention(
        _as_array(q), _as_array(k), _as_array(v), causal=True, kv_lens=lens.numpy(), scale=0.5, return_lse=True
    )
    np.testing.assert_array_equal(_as_array(out), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # opcheck: schema, fake (meta) shapes, strides and dtypes against the real kernel, and dispatch
    torch.library.opcheck(torch.ops.twinattn.attention.default, (q, k, v, True, None, lens, None, 0.5))
    out_buf = torch.empty(2, 4, 3, 8, dtype=q.dtype)
    torch.library.opcheck(torch.ops.twinattn.attention_out.default, (q, k, v, out_buf, True, None, lens, None, 0.5))


def _int8_problem(dtype: str) -> tuple[Any, ...]:
    """q in `dtype`, k and v int8 with their float32 scales (twinattn.quantize_kv), as tensors."""
    q, k, v = _tensors(31, 2, 4, 2, 3, 9, 8, 8)
    (k8, k_scale), (v8, v_scale) = twinattn.quantize_kv(k), twinattn.quantize_kv(v)
    return (_as_tensor(q.astype(DTYPES[dtype][1])), *(torch.from_numpy(a) for a in (k8, v8, k_scale, v_scale)))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_kv_with_scales_matches_numpy_api_bit_for_bit(backend: str, dtype: str) -> None:
    q, k8, v8, k_scale, v_scale = _int8_problem(dtype)
    got, lse = tt.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, causal=True, return_lse=True, backend=backend)
    want, want_lse = twinattn.attention(
        _as_array(q), k8.numpy(), v8.numpy(), k_scale=k_scale.numpy(), v_scale=v_scale.numpy(), causal=True,
        return_lse=True, backend=backend,
    )
    assert got.dtype == q.dtype
    np.testing.assert_array_equal(_as_array(got), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # and what int8 attention means: attention over the dequantized keys and values
    dequantized = [twinattn.dequantize_kv(x.numpy(), s.numpy()) for x, s in ((k8, k_scale), (v8, v_scale))]
    over = twinattn.attention(_as_array(q).astype(np.float32), *dequantized, causal=True, backend="numpy")
    np.testing.assert_allclose(_as_array(got).astype(np.float32), over, rtol=DTYPES[dtype][2] * 4, atol=1e-5)
    with pytest.raises(ValueError, match="k_scale: required with int8 k and v"):
        tt.attention(q, k8, v8, backend=backend)


def test_custom_op_takes_the_variants_and_int8() -> None:
    q, k, v = (torch.from_numpy(a) for a in _tensors(9, 2, 4, 2, 3, 7, 8, 8))
    slopes, sinks = torch.tensor([0.5, 0.25, 0.125, 0.0625]), torch.tensor([0.3, -1.0, 2.0, 0.0])
    # (backend, num_threads, window_left, window_right, softcap, alibi_slopes, sinks, k_scale, v_scale)
    variants = ("auto", None, 3, 0, 0.7, slopes, sinks, None, None)
    out, lse = torch.ops.twinattn.attention(q, k, v, True, None, None, None, 0.5, *variants)
    want, want_lse = twinattn.attention(
        q.numpy(), k.numpy(), v.numpy(), causal=True, scale=0.5, window_size=(3, 0), softcap=0.7,
        alibi_slopes=slopes.numpy(), sinks=sinks.numpy(), return_lse=True,
    )
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    torch.library.opcheck(torch.ops.twinattn.attention.default, (q, k, v, True, None, None, None, 0.5, *variants))
    torch.library.opcheck(
        torch.ops.twinattn.attention_out.default, (q, k, v, torch.empty(2, 4, 3, 8), True, None, None, None, 0.5, *variants)
    )
    q, k8, v8, k_scale, v_scale = _int8_problem("bfloat16")
    int8 = (q, k8, v8, False, None, None, None, None, "auto", None, -1, -1, 0.0, None, None, k_scale, v_scale)
    out, _ = torch.ops.twinattn.attention(*int8)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(_as_array(out), _as_array(tt.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale)))
    torch.library.opcheck(torch.ops.twinattn.attention.default, int8)


def test_custom_op_float64_on_the_numpy_backend() -> None:
    # float64 (backend="numpy" only): out float64, and lse float64 too, in the real op and the fake
    q, k, v = (torch.from_numpy(a).double() for a in _tensors(9, 1, 2, 1, 3, 5, 8, 8))
    out, lse = torch.ops.twinattn.attention(q, k, v, True, None, None, None, None, "numpy")
    assert out.dtype == lse.dtype == torch.float64
    torch.library.opcheck(torch.ops.twinattn.attention.default, (q, k, v, True, None, None, None, None, "numpy"))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compile_fullgraph_sees_one_op(dtype: str) -> None:
    seen: list[object] = []

    def record(gm, example_inputs):  # a torch.compile backend that keeps the traced graph
        seen.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def block(q, k, v):
        return tt.attention(q * 2.0, k, v, causal=True, q_offset=3, window_size=(2, 0), softcap=0.9) + 1.0

    q, k, v = (torch.from_numpy(a).to(DTYPES[dtype][0]) for a in _tensors(11, 1, 2, 1, 4, 7, 8, 8))
    compiled = torch.compile(block, backend=record, fullgraph=True)
    got = compiled(q, k, v)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got, block(q, k, v), rtol=0, atol=0)
    assert sum(1 for t in seen if "twinattn" in str(t)) == 1, seen


def test_export_sees_one_op_and_runs() -> None:
    class Block(torch.nn.Module):
        def forward(self, q, k, v, out):
            tt.attention(q, k, v, causal=True, out=out)
            return tt.attention(q, k, v, kv_lens=torch.tensor([5]))

    q, k, v = (torch.from_numpy(a) for a in _tensors(13, 1, 2, 2, 4, 6, 8, 8))
    exported = torch.export.export(Block(), (q, k, v, torch.empty(1, 2, 4, 8)))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("twinattn.attention_out" in t for t in targets) and any(t.startswith("twinattn.attention.") for t in targets), targets
    out = torch.empty(1, 2, 4, 8)
    got = exported.module()(q, k, v, out)
    np.testing.assert_array_equal(got.numpy(), twinattn.attention(q.numpy(), k.numpy(), v.numpy(), kv_lens=np.array([5])))
    np.testing.assert_array_equal(out.numpy(), twinattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=True))


@pytest.mark.parametrize(
    ("shapes", "kwargs"),
    [
        ((2, 4, 4, 9, 9, 16, 16), {"is_causal": True}),
        ((1, 6, 2, 5, 8, 8, 12), {"enable_gqa": True, "attn_mask": "bool"}),
        ((2, 2, 2, 3, 7, 8, 8), {"attn_mask": "float", "scale": 0.25}),
    ],
    ids=["causal", "gqa-bool-mask", "float-mask"],
)
def test_sdpa_matches_torch(shapes: tuple[int, ...], kwargs: dict) -> None:
    q, k, v = (torch.from_numpy(a) for a in _tensors(17, *shapes))
    rng = np.random.default_rng(1)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.from_numpy(rng.random((shapes[3], shapes[4])) < 0.7) | (torch.arange(shapes[4]) == 0)
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.from_numpy(rand(rng, 1, 1, shapes[3], shapes[4]))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **{
        n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kwargs.items()})
    f32 = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    got = tt.scaled_dot_product_attention(q, k, v, **kwargs)
    err32 = float((f32.double() - want).abs().max())
    tol = FLOAT32_ERROR_FACTOR * err32 + FLOOR_ULPS * UNIT_ROUNDOFF * max(1.0, float(want.abs().max()))
    assert float((got.double() - want).abs().max()) <= tol


def test_sdpa_asks_for_the_causal_alignment() -> None:
    q, k, v = (torch.from_numpy(a) for a in _tensors(19, 1, 2, 2, 2, 5, 8, 8))
    with pytest.raises(ValueError, match="causal_alignment"):
        tt.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = tt.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="lower_right")
    np.testing.assert_array_equal(got.numpy(), twinattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=True))


def test_import_twinattn_does_not_import_torch() -> None:
    code = "import sys, twinattn; twinattn.attention; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---- the plain eager call: twinattn.attention's native call without its keyword handling -------

PLAIN_CASES = [
    # (id, shapes (B, Hq, Hkv, Lq, Lk, D, Dv), keywords): causal, scale and return_lse only
    ("tiny-causal", (1, 1, 1, 16, 16, 64, 64), {"causal": True}),
    ("gqa-decode", (2, 6, 2, 1, 37, 32, 32), {"causal": True}),
    ("prefill-after-cache", (2, 4, 2, 5, 19, 16, 24), {"causal": True, "scale": 0.3}),
    ("bidirectional-more-queries", (1, 3, 1, 9, 4, 8, 8), {}),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("case", "shapes", "kwargs"), PLAIN_CASES, ids=[c[0] for c in PLAIN_CASES])
def test_plain_call_skips_the_numpy_api_and_matches_it_bit_for_bit(
    native_backend: str, dtype: str, case: str, shapes: tuple[int, ...], kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # causal, scale and return_lse with every other keyword at its default: the native call itself
    # (twinattn.core.api.plain_attention), never twinattn.attention, with its result bit for bit
    q, k, v = (x.astype(DTYPES[dtype][1]) for x in _tensors(41, *shapes))
    want, want_lse = twinattn.attention(q, k, v, return_lse=True, backend=native_backend, **kwargs)
    tensors = [_as_tensor(x) for x in (q, k, v)]

    def numpy_api(*args: Any, **keywords: Any) -> Any:
        raise AssertionError("twinattn.attention called for a plain call")

    monkeypatch.setattr(twinattn.core.api, "attention", numpy_api)
    got, lse = tt.attention(*tensors, return_lse=True, backend=native_backend, **kwargs)
    alone = tt.attention(*tensors, backend=native_backend, **kwargs)
    assert got.dtype == alone.dtype == DTYPES[dtype][0] and lse.dtype == torch.float32
    np.testing.assert_array_equal(_as_array(got).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(_as_array(alone).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    assert float(np.abs(want.astype(np.float32)).max()) > 0  # a result that could differ


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_plain_call_reads_transposed_and_sliced_tensors_in_place(native_backend: str, dtype: str) -> None:
    # the layouts models hand over: (B, L, H, D) transposed to (B, H, L, D), and keys and values
    # sliced out of a longer cache; read in place through DLPack capsules (strides and the
    # offset of the slice), the result bit for bit that of contiguous copies through the NumPy API
    rng = np.random.default_rng(53)
    q = _as_tensor(rand(rng, 2, 3, 4, 16).astype(DTYPES[dtype][1])).transpose(1, 2)  # (2, 4, 3, 16)
    cache = _as_tensor(rand(rng, 2, 2, 2, 11, 16).astype(DTYPES[dtype][1]))
    k, v = cache[0, :, :, 2:9], cache[1, :, :, 1:8]  # (2, 2, 7, 16) at an offset, row stride 11
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    want = twinattn.attention(*(np.ascontiguousarray(_as_array(t)) for t in (q, k, v)), causal=True, backend=native_backend)
    got = tt.attention(q, k, v, causal=True, backend=native_backend)
    np.testing.assert_array_equal(_as_array(got).view(np.uint8), want.view(np.uint8))
    assert float(np.abs(want.astype(np.float32)).max()) > 0


def test_plain_call_leaves_what_needs_checking_to_the_numpy_api(native_backend: str) -> None:
    # what the native call refuses, or the plain call does not take, goes through twinattn.attention:
    # its messages, or its result where it accepts the call (a copy of a non-contiguous last axis)
    q, k, v = (torch.from_numpy(a) for a in _tensors(43, 1, 4, 2, 6, 5, 8, 8))
    with pytest.raises(ValueError, match=r"^q_offset: the default bottom-right alignment puts the queries at kv_len - Lq = \[-1\]"):
        tt.attention(q, k, v, causal=True, backend=native_backend)
    with pytest.raises(ValueError, match=r"^scale: expected a finite float, got inf$"):
        tt.attention(q, k, v, scale=float("inf"), backend=native_backend)
    with pytest.raises(ValueError, match=r"^scale: expected a finite float, got 1e\+200, which is inf in float32$"):
        tt.attention(q, k, v, scale=1e200, backend=native_backend)
    with pytest.raises(TypeError, match=r"^causal: expected bool, got int$"):
        tt.attention(q, k, v, causal=1, backend=native_backend)
    with pytest.raises(ValueError, match=r"^q, k: the query heads Hq=4 must be a multiple of the key/value heads Hkv=3"):
        tt.attention(q, torch.zeros(1, 3, 5, 8), torch.zeros(1, 3, 5, 8), backend=native_backend)
    with pytest.raises(ValueError, match=r"^v: expected shape \(B=1, Hkv=2, Lk=5, Dv\), got \(1, 2, 4, 8\)"):
        tt.attention(q, k, v[:, :, :4], backend=native_backend)
    with pytest.raises(ValueError, match=r"^backend: expected one of"):
        tt.attention(q, k, v, backend="cuda")
    # the last axis read with a stride: twinattn.attention copies it, the result is the contiguous one's
    wide = torch.from_numpy(_tensors(47, 1, 4, 2, 6, 5, 16, 8)[0])
    strided_q = wide[..., ::2]
    assert strided_q.stride(-1) == 2
    want = twinattn.attention(strided_q.contiguous().numpy(), k.numpy(), v.numpy(), backend=native_backend)
    np.testing.assert_array_equal(tt.attention(strided_q, k, v, backend=native_backend).numpy(), want)
    # an integer scale is twinattn.attention's to convert: the same result as the float
    np.testing.assert_array_equal(
        tt.attention(q, k, v, scale=1, backend=native_backend).numpy(), tt.attention(q, k, v, scale=1.0, backend=native_backend).numpy()
    )
