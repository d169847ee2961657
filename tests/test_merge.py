"""twinattn.merge_attention: attention over disjoint key sets, merged, against attention over the union.

Each part is computed by a backend (numpy, cpp, rust) in float32 and merged; the result is compared
with the float64 reference over all the keys at once, with the tolerance of tests/helpers.py.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import twinattn
from helpers import assert_close_to_reference, assert_lse_close, rand


def _parts(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_sets: list[np.ndarray], backend: str, **kwargs: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Attention of q over each key set (indices along Lk), computed separately."""
    outs, lses = [], []
    for keys in key_sets:
        out, lse = twinattn.attention(q, k[..., keys, :], v[..., keys, :], return_lse=True, backend=backend, **kwargs)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize(
    "lq, lk, splits",
    [(5, 11, [3, 7]), (1, 40, [1, 2, 30]), (17, 64, [16, 32, 48]), (9, 7, [])],
    ids=["two-parts", "decode-four-parts", "prefill-four-parts", "one-part"],
)
def test_merge_of_contiguous_parts_equals_attention_over_the_union(backend: str, lq: int, lk: int, splits: list[int]) -> None:
    rng = np.random.default_rng(lq * 100 + lk)
    q, k, v = rand(rng, 2, 4, lq, 8), rand(rng, 2, 2, lk, 8), rand(rng, 2, 2, lk, 5)
    outs, lses = _parts(q, k, v, np.split(np.arange(lk), splits), backend)
    out, lse = twinattn.merge_attention(outs, lses)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_close_to_reference(out, q, k, v)
    assert_lse_close(lse, q, k, v)


def test_merge_of_interleaved_key_sets_small_asymmetric(backend: str) -> None:
    # distinct, non-repeating values (equal keys would hide a misplaced weight); keys dealt out
    # to three parts in a scrambled order
    q = (np.arange(3 * 4, dtype=np.float32).reshape(1, 3, 4) / 7 - 0.5)
    k = (np.arange(10 * 4, dtype=np.float32).reshape(1, 10, 4) ** 1.3 / 40 - 0.3).astype(np.float32)
    v = (np.arange(10 * 3, dtype=np.float32).reshape(1, 10, 3) ** 0.7 - 2).astype(np.float32)
    key_sets = [np.array([7, 0, 4]), np.array([9, 2]), np.array([1, 3, 5, 6, 8])]
    outs, lses = _parts(q, k, v, key_sets, backend)
    out, lse = twinattn.merge_attention(outs, lses)
    assert_close_to_reference(out, q, k, v)
    assert_lse_close(lse, q, k, v)


def test_empty_and_masked_parts(backend: str) -> None:
    """A part with no keys at all, a part that some rows cannot see (causal), rows no part sees."""
    rng = np.random.default_rng(3)
    lq, lk = 6, 12
    q, k, v = rand(rng, 2, lq, 8), rand(rng, 2, lk, 8), rand(rng, 2, lk, 8)
    # a bool mask: row i sees keys j <= i - 2 (rows 0 and 1 see nothing in any part)
    visible = np.arange(lk)[None, :] <= np.arange(lq)[:, None] - 2
    empty = np.arange(0)
    key_sets = [np.arange(0, 2), empty, np.arange(2, 5), np.arange(5, 12)]
    outs, lses = [], []
    for keys in key_sets:
        out, lse = twinattn.attention(q, k[:, keys], v[:, keys], attn_mask=visible[:, keys], return_lse=True, backend=backend)
        outs.append(out)
        lses.append(lse)
    # the empty part, and a part no row sees, really are empty; the third part only rows 4 and 5 see
    assert np.all(lses[1] == -np.inf) and np.all(lses[3] == -np.inf) and np.all(lses[2][:, :4] == -np.inf)
    out, lse = twinattn.merge_attention(outs, lses)
    assert_close_to_reference(out, q, k, v, attn_mask=visible)
    assert_lse_close(lse, q, k, v, attn_mask=visible)
    np.testing.assert_array_equal(out[:, :2], 0)
    assert np.all(lse[:, :2] == -np.inf)


def test_a_part_with_no_visible_key_is_not_read() -> None:
    # where a part's lse is -inf its out row takes no part, whatever it holds (NaN included)
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 3, 4), rand(rng, 5, 4), rand(rng, 5, 4)
    out0, lse0 = twinattn.attention(q, k, v, return_lse=True, backend="numpy")
    garbage = np.full_like(out0, np.nan)
    out, lse = twinattn.merge_attention([out0, garbage], [lse0, np.full_like(lse0, -np.inf)])
    np.testing.assert_allclose(out, out0, rtol=1e-6, atol=0)
    np.testing.assert_allclose(lse, lse0, rtol=1e-6, atol=0)


def test_sinks_are_added_once_by_the_merge(backend: str) -> None:
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 2, 3, 7, 8), rand(rng, 2, 1, 9, 8), rand(rng, 2, 1, 9, 8)
    sinks = np.array([0.5, -1.0, 2.5], dtype=np.float32)
    key_sets = np.split(np.arange(9), [4])
    # the parts without sinks, the merge adding them
    outs, lses = _parts(q, k, v, key_sets, backend)
    out, lse = twinattn.merge_attention(outs, lses, sinks=sinks)
    assert_close_to_reference(out, q, k, v, sinks=sinks)
    assert_lse_close(lse, q, k, v, sinks=sinks)
    # or exactly one part computed with sinks, merged without them: the same
    with_sinks = twinattn.attention(q, k[..., :4, :], v[..., :4, :], return_lse=True, sinks=sinks, backend=backend)
    out1, lse1 = twinattn.merge_attention([with_sinks[0], outs[1]], [with_sinks[1], lses[1]])
    assert_close_to_reference(out1, q, k, v, sinks=sinks)
    assert_lse_close(lse1, q, k, v, sinks=sinks)


def test_sinks_on_rows_that_see_nothing_give_zeros_and_the_sink() -> None:
    sinks = np.array([1.5, -0.25], dtype=np.float32)
    outs = [np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 4), np.float32)]
    lses = [np.full((2, 3), -np.inf, np.float32), np.full((2, 3), -np.inf, np.float32)]
    out, lse = twinattn.merge_attention(outs, lses, sinks=sinks)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], (2, 3)))


def test_merged_lse_merges_again() -> None:
    # merging is associative: ((a, b), c) == (a, b, c)
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, 4, 6, 8), rand(rng, 4, 15, 8), rand(rng, 4, 15, 8)
    outs, lses = _parts(q, k, v, np.split(np.arange(15), [5, 10]), "numpy")
    ab = twinattn.merge_attention(outs[:2], lses[:2])
    nested = twinattn.merge_attention([ab[0], outs[2]], [ab[1], lses[2]])
    flat = twinattn.merge_attention(outs, lses)
    np.testing.assert_allclose(nested[0], flat[0], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(nested[1], flat[1], rtol=2e-6, atol=1e-6)


def test_float64_parts_merge_in_float64() -> None:
    rng = np.random.default_rng(7)
    q, k, v = (rand(rng, 3, 5, 8).astype(np.float64) for _ in range(3))
    outs, lses = _parts(q, k, v, np.split(np.arange(5), [2]), "numpy")
    out, lse = twinattn.merge_attention(outs, lses)
    want, want_lse = twinattn.attention(q, k, v, return_lse=True, backend="numpy")
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=1e-14)


def test_float16_parts_merge_in_float32_and_round_once() -> None:
    rng = np.random.default_rng(8)
    q, k, v = rand(rng, 2, 6, 8), rand(rng, 2, 20, 8), rand(rng, 2, 20, 8)
    ref_outs, lses = _parts(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), np.split(np.arange(20), [7, 13]), "numpy")
    outs = [o.astype(np.float16) for o in ref_outs]
    out, lse = twinattn.merge_attention(outs, [lse.astype(np.float32) for lse in lses])
    assert out.dtype == np.float16 and lse.dtype == np.float32
    want, want_lse = twinattn.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), return_lse=True, backend="numpy")
    # each part rounded to float16 (half an ulp, 2^-11 relative), merged in float32, rounded again
    bound = 2 * 2.0**-11 * np.abs(want).max()
    assert np.abs(out.astype(np.float64) - want).max() <= bound
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_nan_and_inf_lse_follow_attention() -> None:
    outs = [np.ones((1, 3, 2), np.float32), np.full((1, 3, 2), 2, np.float32)]
    lses = [np.array([[0.0, np.nan, np.inf]], np.float32), np.array([[0.0, 0.0, 0.0]], np.float32)]
    out, lse = twinattn.merge_attention(outs, lses)
    np.testing.assert_allclose(out[0, 0], [1.5, 1.5])
    assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 1])
    assert np.isnan(out[0, 2]).all() and lse[0, 2] == np.inf


@pytest.mark.parametrize(
    "outs, lses, sinks, error, match",
    [
        ([], [], None, ValueError, "outs: expected at least one part"),
        ([np.zeros((2, 3), np.float32)], [], None, ValueError, "expected one lse per part, got 1 outs and 0 lses"),
        (np.zeros((1, 2, 3), np.float32), [np.zeros(2, np.float32)], None, TypeError, "sequences"),
        ([np.zeros((2, 3), np.float32), np.zeros((3, 3), np.float32)], [np.zeros(2, np.float32)] * 2, None, ValueError, r"outs\[1\]: expected shape \(2, 3\)"),
        ([np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float64)], [np.zeros(2, np.float32)] * 2, None, TypeError, r"outs\[1\]: expected float32"),
        ([np.zeros((2, 3), np.float32)], [np.zeros(3, np.float32)], None, ValueError, r"lses\[0\]: expected shape \(2,\)"),
        ([np.zeros((2, 3), np.float32)], [np.zeros(2, np.float64)], None, TypeError, r"lses\[0\]: expected float32"),
        ([np.zeros((2, 3), np.int32)], [np.zeros(2, np.float32)], None, TypeError, "outs: expected float32, float64, float16 or bfloat16, got int32"),
        ([np.zeros((2, 3), np.float32)], [[0.0, 0.0]], None, TypeError, r"lses\[0\]: expected numpy arrays"),
        ([np.zeros((4, 2, 3), np.float32)], [np.zeros((4, 2), np.float32)], np.zeros(3, np.float32), ValueError, r"sinks: expected shape \(Hq=4,\)"),
        ([np.zeros((4, 2, 3), np.float32)], [np.zeros((4, 2), np.float32)], np.zeros(4, np.float64), TypeError, "sinks: expected float32"),
    ],
    ids=["no-parts", "count-mismatch", "not-a-list", "shape-mismatch", "dtype-mismatch", "lse-shape", "lse-dtype",
         "int-outs", "lse-list", "sinks-shape", "sinks-dtype"],
)
def test_bad_arguments_name_what_is_wrong(outs: Any, lses: Any, sinks: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        twinattn.merge_attention(outs, lses, sinks=sinks)


def test_import_twinattn_and_merge_do_not_import_torch() -> None:
    code = "import sys, numpy as np, twinattn; twinattn.merge_attention([np.zeros((1, 2), np.float32)], [np.zeros(1, np.float32)]); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---- torch tensors ------------------------------------------------------------------------------------


def test_torch_parts_merge_like_numpy_parts() -> None:
    torch = _torch()
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 13, 8), rand(rng, 1, 2, 13, 4)
    outs, lses = _parts(q, k, v, np.split(np.arange(13), [6]), "cpp" if "cpp" in twinattn.backends() else "numpy")
    sinks = np.array([0.3, -0.7], np.float32)
    want = twinattn.merge_attention(outs, lses, sinks=sinks)
    got = twinattn.merge_attention([torch.from_numpy(o) for o in outs], [torch.from_numpy(l) for l in lses], sinks=torch.from_numpy(sinks))
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_torch_narrow_parts_merge_in_float32(dtype_name: str) -> None:
    torch = _torch()
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(10)
    q, k, v = (rand(rng, 2, length, 16).astype(np.float64) for length in (7, 30, 30))
    ref_outs, lses = _parts(q, k, v, np.split(np.arange(30), [10, 20]), "numpy")
    outs = [torch.from_numpy(o).to(dtype) for o in ref_outs]
    out, lse = twinattn.merge_attention(outs, [torch.from_numpy(l.astype(np.float32)) for l in lses])
    assert out.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = twinattn.attention(q, k, v, return_lse=True, backend="numpy")
    # each part rounded to the dtype (half an ulp), merged in float32, the result rounded once more
    half_ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype_name]
    assert float((out.double() - torch.from_numpy(want)).abs().max()) <= 2 * half_ulp * float(np.abs(want).max())
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6)


def test_torch_and_numpy_parts_do_not_mix() -> None:
    torch = _torch()
    with pytest.raises(TypeError, match=r"outs\[1\]: expected torch tensors like outs\[0\], got ndarray"):
        twinattn.merge_attention([torch.zeros(2, 3), np.zeros((2, 3), np.float32)], [torch.zeros(2)] * 2)
    with pytest.raises(TypeError, match=r"lses\[0\]: expected numpy arrays like outs\[0\], got Tensor"):
        twinattn.merge_attention([np.zeros((2, 3), np.float32)], [torch.zeros(2)])
    with pytest.raises(RuntimeError, match=r"outs\[0\]: requires grad"):
        twinattn.merge_attention([torch.zeros(2, 3, requires_grad=True)], [torch.zeros(2)])


def _torch() -> Any:
    from conftest import import_optional

    return import_optional("torch", "merge_attention on torch tensors")
