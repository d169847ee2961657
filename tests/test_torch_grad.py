"""Gradients of twinattn.torch.attention on every backend: autograd, torch.compile training graphs,
torch.autograd.gradcheck, and what carries no gradient.

References and tolerances. The gradient every backend is held to is the float64 reference's
(twinattn.core.backward on backend="numpy", itself checked against finite differences in
test_backward.py), computed from the same (already rounded) inputs.
- float32: what float32 arithmetic costs on the problem is measured, not guessed, as in
  helpers.py: the same attention written densely in torch ops (grad_helpers.math_attention) and
  differentiated by autograd in float32 sets the scale; twinattn may be FLOAT32_ERROR_FACTOR times
  its error, plus a floor of a few float32 units of roundoff per summed term of the largest gradient.
- float16 / bfloat16: no worse than twice the error of torch's own SDPA backward in that dtype on
  the same inputs (the features SDPA takes, as a materialised bias), plus half a unit in the last
  place of the largest gradient (ours are rounded once to the dtype).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import import_optional

torch = import_optional("torch", "twinattn.torch needs it: pip install torch")
tt = import_optional("twinattn.torch", "the torch integration")

from grad_helpers import CASES, LK, LQ, dense_mask, math_attention, problem  # noqa: E402
from helpers import BFLOAT16, FLOAT32_ERROR_FACTOR, FLOOR_ULPS, UNIT_ROUNDOFF, forced_isa, half_ulp  # noqa: E402
from twinattn.core.backward import attention_backward, attention_for_training  # noqa: E402

NAMES = ("dq", "dk", "dv", "dsinks")
HALF_DTYPES = {"float16": (torch.float16, np.dtype(np.float16)), "bfloat16": (torch.bfloat16, BFLOAT16)}
# the keywords of each case that SDPA can take as well (as a bias): no empty row, no softcap, no sink
SDPA_CASES = ["plain", "causal", "causal-q_offset", "kv_lens", "window", "window-causal", "alibi", "alibi-per-sequence"]


def _torch_problem(case: str, seed: int, dtype: Any) -> tuple[list[Any], dict[str, Any]]:
    """q, k, v (and sinks, when the case has them) as leaf tensors of dtype that require grad, and
    the keywords (tensors where twinattn.torch takes tensors)."""
    q, k, v, kwargs = problem(case, seed=seed, dtype=np.float32)
    leaves = [torch.from_numpy(a).to(dtype).requires_grad_() for a in (q, k, v)]
    for name in ("alibi_slopes", "attn_mask", "kv_lens", "q_offset"):
        if isinstance(kwargs.get(name), np.ndarray):
            kwargs[name] = torch.from_numpy(kwargs[name])
    if "sinks" in kwargs:
        # float32 sinks (float64 for a float64 problem), as twinattn takes them
        sinks = torch.from_numpy(kwargs["sinks"]).to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        leaves.append(sinks)
        kwargs["sinks"] = sinks
    return leaves, kwargs


def _numpy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords for dense_mask and math_attention: NumPy arrays, sinks left a tensor (its gradient)."""
    return {n: a.detach().numpy() if isinstance(a, torch.Tensor) and n != "sinks" else a for n, a in kwargs.items()}


def _grads(function: Any, leaves: list[Any], kwargs: dict[str, Any], dout: Any) -> list[Any]:
    """The gradients of sum(function(q, k, v, **kwargs) * dout) w.r.t. the leaves."""
    for leaf in leaves:
        leaf.grad = None
    out = function(*leaves[:3], **kwargs)
    (out * dout.to(out.dtype)).sum().backward()
    return [leaf.grad for leaf in leaves]


def _reference_grads(leaves: list[Any], kwargs: dict[str, Any], dout: Any) -> list[Any]:
    """The float64 reference's gradients, through twinattn.torch on backend="numpy"."""
    leaves64 = [leaf.detach().double().requires_grad_() for leaf in leaves]
    kwargs64 = {n: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for n, a in kwargs.items()}
    if "sinks" in kwargs64:
        kwargs64["sinks"] = leaves64[3]
    return _grads(lambda q, k, v, **kw: tt.attention(q, k, v, backend="numpy", **kw), leaves64, kwargs64, dout.double())


def _error(got: Any, want: Any) -> float:
    return float((got.double() - want).abs().max())


def _dout(seed: int, leaves: list[Any]) -> Any:
    q, v = leaves[0], leaves[2]
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((*q.shape[:3], v.shape[-1])))


@pytest.mark.parametrize("case", list(CASES))
def test_float32_gradients_match_the_reference(backend: str, case: str) -> None:
    leaves, kwargs = _torch_problem(case, seed=11, dtype=torch.float32)
    dout = _dout(12, leaves)
    got = _grads(lambda q, k, v, **kw: tt.attention(q, k, v, backend=backend, **kw), leaves, kwargs, dout)
    want = _reference_grads(leaves, kwargs, dout)
    math32 = _grads(lambda q, k, v, **kw: math_attention(q, k, v, **_numpy_kwargs(kw)), leaves, kwargs, dout)
    for name, g, w, m in zip(NAMES, got, want, math32):
        assert g is not None and g.dtype == torch.float32 and g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        floor = FLOOR_ULPS * LQ * LK * UNIT_ROUNDOFF * max(1.0, float(w.abs().max()))
        tol = FLOAT32_ERROR_FACTOR * _error(m, w) + floor
        assert _error(g, w) <= tol, f"{backend} {case} {name}: error {_error(g, w):.3g} > {tol:.3g}"


def test_the_dense_yardstick_is_the_reference_in_float64() -> None:
    """math_attention (the float32 yardstick) computes the same function: in float64 its gradient
    is the reference's to float64 roundoff."""
    for case in CASES:
        leaves, kwargs = _torch_problem(case, seed=13, dtype=torch.float64)
        dout = _dout(14, leaves)
        got = _grads(lambda q, k, v, **kw: math_attention(q, k, v, **_numpy_kwargs(kw)), leaves, kwargs, dout)
        want = _reference_grads(leaves, kwargs, dout)
        for name, g, w in zip(NAMES, got, want):
            assert _error(g, w) <= 1e-12 * max(1.0, float(w.abs().max())), (case, name)


def _sdpa(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """torch's SDPA on the same problem: visibility and ALiBi as one materialised float bias."""
    visible, bias = dense_mask(tuple(q.shape), tuple(k.shape), **_numpy_kwargs(kwargs))
    mask = torch.from_numpy(np.where(visible, bias, -np.inf)).to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kwargs.get("scale"), enable_gqa=True)


@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
@pytest.mark.parametrize("case", SDPA_CASES)
def test_half_gradients_no_worse_than_twice_sdpa(backend: str, case: str, dtype: str) -> None:
    torch_dtype, np_dtype = HALF_DTYPES[dtype]
    leaves, kwargs = _torch_problem(case, seed=21, dtype=torch_dtype)
    dout = _dout(22, leaves).to(torch_dtype)
    got = _grads(lambda q, k, v, **kw: tt.attention(q, k, v, backend=backend, **kw), leaves, kwargs, dout)
    want = _reference_grads(leaves, kwargs, dout.double())
    sdpa = _grads(_sdpa, leaves, kwargs, dout)
    for name, g, w, s in zip(NAMES, got, want, sdpa):
        if w is None:
            continue
        assert g.dtype == torch_dtype and g.shape == w.shape, name
        half = float(half_ulp(np.array([float(w.abs().max())]), np_dtype)[0])
        tol = 2 * _error(s, w) + half
        assert _error(g, w) <= tol, f"{backend} {case} {dtype} {name}: error {_error(g, w):.3g} > {tol:.3g}"


# amxbf16's bfloat16 tile path (D a multiple of 32; docs/kernels.md, "Backward") under the same
# rule, on problems of several query tiles and key blocks
TILE_CASES = {
    "causal": lambda rng: {"causal": True},
    "window-causal-kv_lens": lambda rng: {"causal": True, "window_size": (50, 0), "kv_lens": np.array([140, 97]),
                                          "q_offset": np.array([80, 37])},
    "alibi": lambda rng: {"alibi_slopes": rng.uniform(0.01, 0.1, 8).astype(np.float32)},
}


@pytest.mark.parametrize("case", list(TILE_CASES))
def test_bf16_tile_path_no_worse_than_twice_sdpa(native_backend: str, case: str) -> None:
    rng = np.random.default_rng(31)
    shapes = ((2, 8, 60, 64), (2, 2, 140, 64), (2, 2, 140, 64))
    leaves = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16).requires_grad_()
              for shape in shapes]
    kwargs = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in TILE_CASES[case](rng).items()}
    dout = torch.from_numpy(rng.standard_normal((2, 8, 60, 64))).to(torch.bfloat16)
    with forced_isa(native_backend, "amxbf16"):
        got = _grads(lambda q, k, v, **kw: tt.attention(q, k, v, backend=native_backend, **kw), leaves, kwargs, dout)
    want = _reference_grads(leaves, kwargs, dout.double())
    sdpa = _grads(_sdpa, leaves, kwargs, dout)
    for name, g, w, s in zip(NAMES, got, want, sdpa):
        half = float(half_ulp(np.array([float(w.abs().max())]), BFLOAT16)[0])
        tol = 2 * _error(s, w) + half
        assert _error(g, w) <= tol, f"{native_backend} {case} {name}: error {_error(g, w):.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_half_training_step_keeps_out32_no_worse_than_twice_sdpa(native_backend: str, case: str, dtype: str) -> None:
    """A float16 / bfloat16 step on this machine's instruction set (the bfloat16 pair paths round
    P for P.V: out32 adds the remainder's pairs): autograd's forward keeps out32, which the backward
    reads as out (the same bits as attention_backward given out32 from attention_for_training),
    within the rule above."""
    torch_dtype, np_dtype = HALF_DTYPES[dtype]
    rng = np.random.default_rng(32)
    shapes = ((2, 8, 60, 64), (2, 2, 140, 64), (2, 2, 140, 64))
    leaves = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch_dtype).requires_grad_()
              for shape in shapes]
    kwargs = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in TILE_CASES[case](rng).items()}
    dout = torch.from_numpy(rng.standard_normal((2, 8, 60, 64))).to(torch_dtype)
    got = _grads(lambda q, k, v, **kw: tt.attention(q, k, v, backend=native_backend, **kw), leaves, kwargs, dout)
    arrays = [leaf.detach().float().numpy().astype(np_dtype) for leaf in leaves]
    np_kwargs = _numpy_kwargs(kwargs)
    _, lse, out32 = attention_for_training(*arrays, backend=native_backend, **np_kwargs)
    assert out32.dtype == np.float32
    direct = attention_backward(*arrays, out32, dout.float().numpy().astype(np_dtype), lse, backend=native_backend,
                                **np_kwargs)
    want = _reference_grads(leaves, kwargs, dout.double())
    sdpa = _grads(_sdpa, leaves, kwargs, dout)
    for name, g, w, s, d in zip(NAMES, got, want, sdpa, direct):
        assert np.array_equal(g.float().numpy(), d.astype(np.float32)), name
        half = float(half_ulp(np.array([float(w.abs().max())]), np_dtype)[0])
        tol = 2 * _error(s, w) + half
        assert _error(g, w) <= tol, f"{native_backend} {case} {dtype} {name}: error {_error(g, w):.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", ["everything", "empty-rows-sinks", "float-mask"])
def test_gradcheck_on_numpy_float64(case: str) -> None:
    leaves, kwargs = _torch_problem(case, seed=31, dtype=torch.float64)
    kwargs = {n: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for n, a in kwargs.items()}
    kwargs.pop("sinks", None)
    leaves = [leaf.detach().double().requires_grad_() for leaf in leaves]

    def function(*inputs: Any) -> Any:
        extra = {"sinks": inputs[3]} if len(inputs) > 3 else {}
        return tt.attention(*inputs[:3], backend="numpy", return_lse=True, **kwargs, **extra)

    assert torch.autograd.gradcheck(function, tuple(leaves))


def test_compiled_training_graph_gives_eager_gradients(backend: str) -> None:
    leaves, kwargs = _torch_problem("everything", seed=41, dtype=torch.float32)
    sinks = kwargs.pop("sinks")

    def loss(q: Any, k: Any, v: Any, sinks: Any) -> Any:
        out, lse = tt.attention(q, k, v, backend=backend, sinks=sinks, return_lse=True, **kwargs)
        return (out * out).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    compiled = torch.compile(loss, fullgraph=True)
    compiled(*leaves).backward()
    got = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    loss(*leaves).backward()
    assert sinks is leaves[3]
    for name, g, leaf in zip(NAMES, got, leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-6, atol=1e-6, msg=name)
        assert bool(g.abs().max() > 0), name


def test_gradients_through_strided_inputs_and_an_expanded_dout(backend: str) -> None:
    """q, k, v as views of (B, L, H, D) tensors, and out.sum()'s stride-0 gradient."""
    rng = np.random.default_rng(51)
    blhd = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).requires_grad_()
            for shape in ((2, 3, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8))]
    views = [t.transpose(1, 2) for t in blhd]
    tt.attention(*views, causal=True, backend=backend).sum().backward()
    contiguous = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in blhd]
    tt.attention(*contiguous, causal=True, backend=backend).sum().backward()
    for view_leaf, leaf in zip(blhd, contiguous):
        torch.testing.assert_close(view_leaf.grad.transpose(1, 2), leaf.grad, rtol=0, atol=0)


def test_only_q_k_v_and_sinks_get_gradients(backend: str) -> None:
    leaves, kwargs = _torch_problem("everything", seed=61, dtype=torch.float32)
    bias = kwargs["attn_mask"].clone().requires_grad_()
    slopes = kwargs["alibi_slopes"].clone().requires_grad_()
    kwargs.update(attn_mask=bias, alibi_slopes=slopes)
    q, k, v, sinks = leaves
    kwargs["sinks"] = sinks
    tt.attention(q.detach(), k.detach(), v.detach(), backend=backend, **kwargs).sum().backward()
    assert sinks.grad is not None and bool(sinks.grad.abs().max() > 0)
    assert bias.grad is None and slopes.grad is None


def test_int8_keys_and_values_refuse_a_gradient(backend: str) -> None:
    rng = np.random.default_rng(71)
    q = torch.from_numpy(rng.standard_normal((1, 2, 3, 8)).astype(np.float32)).requires_grad_()
    (k8, k_scale), (v8, v_scale) = (tt_quantize(rng) for _ in range(2))
    with pytest.raises(ValueError, match=r"^k, v: int8 keys and values carry no gradient; detach q"):
        tt.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, backend=backend)
    with torch.no_grad():  # without a graph, int8 keys are fine
        assert tt.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, backend=backend).shape == (1, 2, 3, 8)


def tt_quantize(rng: np.random.Generator) -> tuple[Any, Any]:
    import twinattn

    x8, scale = twinattn.quantize_kv(rng.standard_normal((1, 1, 4, 8)).astype(np.float32))
    return torch.from_numpy(x8), torch.from_numpy(scale)


def test_eager_calls_without_grad_stay_off_the_op(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No grad needed (no input requires grad, or torch.no_grad): the eager path, never the op."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("went through the op")

    monkeypatch.setattr(tt, "_through_op", refuse)
    leaves, kwargs = _torch_problem("sinks", seed=81, dtype=torch.float32)
    tt.attention(*(leaf.detach() for leaf in leaves[:3]), backend=backend, sinks=leaves[3].detach())
    with torch.no_grad():
        tt.attention(*leaves[:3], backend=backend, **kwargs)
    with pytest.raises(AssertionError, match="went through the op"):
        tt.attention(*leaves[:3], backend=backend, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("uses", ["out", "lse"])
def test_a_loss_of_one_output_gives_the_gradients_of_zeros_for_the_other(backend: str, uses: str, dtype: Any) -> None:
    """An output the loss does not use gets no gradient tensor (None, not zeros of its shape:
    the bfloat16 training forward's out32 is float32 and as large as out); the backward reads it
    as zeros: the same gradients, bit for bit, as a loss that adds the other output times 0."""
    leaves, kwargs = _torch_problem("causal", seed=61, dtype=dtype)
    grads = []
    for explicit_zero in (False, True):
        for leaf in leaves:
            leaf.grad = None
        out, lse = tt.attention(*leaves[:3], backend=backend, return_lse=True, **kwargs)
        used, other = (out.float(), lse) if uses == "out" else (lse, out.float())
        loss = (used * used).sum() + ((other * 0).sum() if explicit_zero else 0)
        loss.backward()
        grads.append([leaf.grad.clone() for leaf in leaves[:3]])
    for name, g, zero in zip(NAMES, *grads):
        torch.testing.assert_close(g, zero, rtol=0, atol=0, msg=name)
        # (lse does not depend on v)
        assert bool(g.abs().max() > 0) is not (uses == "lse" and name == "dv"), name
