"""Non-finite inputs: NaN and inf at visible positions give the float64 reference's pattern, row by
row, in out and lse; hidden positions never matter (twinattn/core/reference.py states the rule).

Every test runs on numpy, cpp and rust (the `backend` fixture) and, for the native ports, on every
instruction set (the `isa` fixture, forced with set_isa; one the CPU or build lacks is skipped with
the reason), with q, k and v in float32, float16 and bfloat16 (the non-finite values placed before
rounding: NaN and inf are the same in every dtype). The shapes reach each path of the fast kernels:
- direct: split-key with Lq * G <= kDirectScoreRows (24) rows, scores read from K in place;
- panels: split-key with 25..48 rows, K packed per block;
- prefill: more than kQTileRows (48) rows, several key blocks, causal diagonal tiles.
Each split-key shape has more than kSplitKeyChunk (1024) keys, so its partials are merged.
The prefill shapes are also the bfloat16 dot path of avx512bf16, where a block of keys that is
partly hidden and holds NaN or inf in V must not turn 0 * NaN into NaN (it takes the convert path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import twinattn
from helpers import (
    BACKEND_ISA_IDS, BACKEND_ISA_PAIRS, DOT_PATHS, FLOAT32_ERROR_FACTOR, FLOOR_ULPS, HALF_DTYPES, UNIT_ROUNDOFF, as32, as64, assert_close_to_reference,
    assert_half_within, assert_lse_close, assert_lse_within, forced_isa, max_abs, rand, reference32, reference64,
)

DTYPES = pytest.mark.parametrize("dtype", (np.dtype(np.float32),) + HALF_DTYPES, ids=str)


# numpy once, each port once per instruction set: conftest's `backend` fixture and `isa` below,
# parametrized together (indirect), so numpy is not repeated per instruction set
ACROSS_ISAS = pytest.mark.parametrize(("backend", "isa"), BACKEND_ISA_PAIRS, indirect=True, ids=BACKEND_ISA_IDS)


@pytest.fixture
def isa(request: pytest.FixtureRequest, backend: str) -> Iterator[str]:
    """Forces the native port's instruction set for the test (set_isa), restoring it after."""
    with forced_isa(backend, request.param):
        yield request.param


# name: (B, Hq, Hkv, Lq, Lk, D, Dv, causal)
PATHS = {
    "direct": (1, 4, 1, 3, 1500, 40, 24, False),  # 12 rows, two key chunks
    "direct-causal": (2, 8, 4, 4, 1100, 33, 17, True),  # 8 rows
    "panels": (1, 8, 2, 8, 1300, 40, 24, False),  # 32 rows
    "panels-causal": (1, 12, 2, 7, 1030, 24, 40, True),  # 42 rows
    "prefill": (1, 4, 2, 52, 300, 24, 16, False),  # 104 rows: three tiles, two key blocks
    "prefill-causal": (2, 4, 2, 30, 300, 24, 16, True),  # 60 rows, diagonal tiles
}
VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def each_value_on_each_path(test: Callable[..., None]) -> Callable[..., None]:
    """The tests of one non-finite value at a visible position: every backend and instruction set,
    dtype, value (VALUES) and path (PATHS); the parameters (backend, isa, dtype, path, value)."""
    for mark in (pytest.mark.parametrize("path", PATHS), pytest.mark.parametrize("value", VALUES, ids=str), DTYPES, ACROSS_ISAS):
        test = mark(test)
    return test


def _problem(path: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    b, hq, hkv, lq, lk, d, dv, causal = PATHS[path]
    rng = np.random.default_rng(seed)
    return rand(rng, b, hq, lq, d), rand(rng, b, hkv, lk, d), rand(rng, b, hkv, lk, dv), {"causal": causal}


def _assert_pattern(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN pattern of {what}")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"+inf pattern of {what}")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"-inf pattern of {what}")


def _check(backend: str, isa: str, dtype: np.dtype, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """out and lse of `backend` with q, k, v rounded to dtype, against the float64 reference on
    the rounded inputs: the same NaN / +inf / -inf pattern, the finite values within float32
    tolerance (float16 / bfloat16: helpers.assert_half_within's). Returns the reference's (out, lse)."""
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    out, lse = twinattn.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    want_out, want_lse = reference64(q, k, v, return_lse=True, **kwargs)
    f32_out, f32_lse = reference32(as32(q), as32(k), as32(v), return_lse=True, **kwargs)
    if dtype in HALF_DTYPES:
        _assert_pattern(out.astype(np.float64), want_out, "out")
        weighted = reference64(q, k, np.abs(as64(v)), **kwargs) if (isa, dtype) in DOT_PATHS else None
        assert_half_within(out, want_out, f32_out, max_abs(as64(v)), dtype, weighted)
        _assert_pattern(lse, want_lse, "lse")
        assert_lse_within(lse, want_lse, f32_lse)
        return want_out, want_lse
    for got, want, f32, what in ((out, want_out, f32_out, "out"), (lse, want_lse, f32_lse, "lse")):
        _assert_pattern(got, want, what)
        # finite values: helpers.py's tolerance (a multiple of float32's own error, plus a floor)
        finite = np.isfinite(want)
        f32_err = float(np.max(np.abs(f32[finite] - want[finite]), initial=0.0))
        scale_of = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
        tol = FLOAT32_ERROR_FACTOR * f32_err + FLOOR_ULPS * UNIT_ROUNDOFF * scale_of
        err = float(np.max(np.abs(got[finite].astype(np.float64) - want[finite]), initial=0.0))
        assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g}"
    return want_out, want_lse


@each_value_on_each_path
def test_nonfinite_query_row(backend: str, isa: str, dtype: np.dtype, path: str, value: str) -> None:
    q, k, v, kwargs = _problem(path, 1)
    b, h, i = q.shape[0] - 1, q.shape[1] // 2 + 1, q.shape[2] - 2
    q[b, h, i, 5] = VALUES[value]
    want_out, want_lse = _check(backend, isa, dtype, q, k, v, **kwargs)
    # the reference's own pattern: that row alone is NaN; NaN also in lse unless a score is +inf
    assert np.isnan(want_out[b, h, i]).all()
    assert np.isnan(want_out).sum() == want_out.shape[-1]
    assert np.isnan(want_lse[b, h, i]) or want_lse[b, h, i] == np.inf
    if value == "nan":
        assert np.isnan(want_lse[b, h, i])


@each_value_on_each_path
def test_nonfinite_visible_key(backend: str, isa: str, dtype: np.dtype, path: str, value: str) -> None:
    """One element of one key row: the rows that see that key score NaN (NaN rows) or +-inf (rows
    with a +inf score are NaN with lse +inf; a -inf score leaves the key out)."""
    q, k, v, kwargs = _problem(path, 2)
    j = 3 if kwargs["causal"] else k.shape[2] - 300  # seen by every row (also in a later key block)
    k[-1, 0, j, 2] = VALUES[value]
    want_out, _ = _check(backend, isa, dtype, q, k, v, **kwargs)
    group = q.shape[1] // k.shape[1]
    assert np.isnan(want_out[-1, :group]).any()
    assert not np.isnan(want_out[:, group:]).any()


@each_value_on_each_path
def test_nonfinite_visible_value(backend: str, isa: str, dtype: np.dtype, path: str, value: str) -> None:
    """One element of one value row: the column it is in becomes NaN or +-inf in every row that
    sees the key; the other columns stay finite."""
    q, k, v, kwargs = _problem(path, 3)
    j, c = (5 if kwargs["causal"] else v.shape[2] // 2), v.shape[3] - 1
    v[0, -1, j, c] = VALUES[value]
    want_out, _ = _check(backend, isa, dtype, q, k, v, **kwargs)
    group = q.shape[1] // k.shape[1]
    column = want_out[0, -group:, :, c]
    assert (np.isnan(column) if value == "nan" else np.isinf(column)).all()
    assert np.isfinite(np.delete(want_out, c, axis=-1)).all()


@each_value_on_each_path
def test_nonfinite_float_mask(backend: str, isa: str, dtype: np.dtype, path: str, value: str) -> None:
    """NaN or +inf in a visible bias makes that row NaN (lse NaN or +inf); -inf hides the key."""
    q, k, v, kwargs = _problem(path, 4)
    b, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = (0.5 * np.random.default_rng(5).standard_normal((b, hq, lq, lk))).astype(np.float32)
    i, j = lq - 1, 2
    mask[0, 1, i, j] = VALUES[value]
    want_out, want_lse = _check(backend, isa, dtype, q, k, v, attn_mask=mask, **kwargs)
    if value == "-inf":
        assert np.isfinite(want_out).all()
    else:
        assert np.isnan(want_out[0, 1, i]).all() and np.isnan(want_out).sum() == want_out.shape[-1]
        assert want_lse[0, 1, i] == np.inf if value == "inf" else np.isnan(want_lse[0, 1, i])


POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@ACROSS_ISAS
@DTYPES
@pytest.mark.parametrize("poison", POISONS, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_hidden_positions_never_matter(backend: str, isa: str, dtype: np.dtype, path: str, poison: str) -> None:
    """k, v and the bias hold NaN / inf wherever a key is hidden: past kv_lens, under a False bool
    mask, under a -inf bias (there k and v are poisoned, the bias stays -inf), above the causal
    diagonal. The result equals the reference on the same inputs with those positions zeroed, and
    a native port gives the same bits on both (but for the bfloat16 dot path: see below)."""
    q, k, v, kwargs = _problem(path, 6)
    b, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    group = hq // k.shape[1]
    rng = np.random.default_rng(7)
    kv_lens = np.array([lk - 37] + [lk] * (b - 1))
    q_offset = np.full(b, 0 if kwargs["causal"] and lq > lk - 37 else lk - 37 - lq)
    key = np.arange(lk)
    # hidden[b, h, i, j] for every reason but the masks
    hidden = key[None, None, None, :] >= kv_lens[:, None, None, None]
    if kwargs["causal"]:
        hidden = hidden | (key[None, None, None, :] > (q_offset[:, None, None, None] + np.arange(lq)[None, None, :, None]))
    hidden = np.broadcast_to(hidden, (b, hq, lq, lk))
    for mask_kind in ("bool", "float"):
        # whole key columns hidden for every query head of KV head 0, so that k and v there may be poisoned
        hidden_keys = rng.random(lk) < 0.1
        hidden_keys[kv_lens[0] :] = True
        if mask_kind == "bool":
            mask: np.ndarray = np.broadcast_to(~hidden_keys, (b, hq, lq, lk)).copy()
        else:
            mask = (0.5 * rng.standard_normal((b, hq, lq, lk))).astype(np.float32)
            mask[..., hidden_keys] = -np.inf
        all_hidden = hidden | hidden_keys[None, None, None, :]
        poisoned_k, poisoned_v, poisoned_mask = k.copy(), v.copy(), mask.copy()
        clean_k, clean_v, clean_mask = k.copy(), v.copy(), mask.copy()
        # keys hidden from every row of a sequence: poison k and v (and zero them for the clean run)
        for s in range(b):
            never_seen = all_hidden[s].all(axis=(0, 1))
            poisoned_k[s][:, never_seen] = POISONS[poison]
            poisoned_v[s][:, never_seen] = POISONS[poison]
            clean_k[s][:, never_seen] = 0.0
            clean_v[s][:, never_seen] = 0.0
        if mask_kind == "float":  # a bias where a key is hidden by length or position
            poisoned_mask[hidden] = POISONS[poison]
            clean_mask[hidden] = 0.0
        assert all_hidden[..., : kv_lens[0]].any(), "the masks hide some key before kv_len"
        args = dict(kv_lens=kv_lens, q_offset=q_offset, **kwargs)
        qd = q.astype(dtype)
        poisoned_k, poisoned_v, clean_k, clean_v = (a.astype(dtype) for a in (poisoned_k, poisoned_v, clean_k, clean_v))
        got, got_lse = twinattn.attention(
            qd, poisoned_k, poisoned_v, attn_mask=poisoned_mask, return_lse=True, backend=backend, **args
        )
        assert np.isfinite(got.astype(np.float32)).all() and not np.isnan(got_lse).any()
        if dtype in HALF_DTYPES:
            want, want_lse = reference64(qd, clean_k, clean_v, attn_mask=clean_mask, return_lse=True, **args)
            f32, f32_lse = reference32(as32(qd), as32(clean_k), as32(clean_v), attn_mask=clean_mask, return_lse=True, **args)
            weighted = reference64(qd, clean_k, np.abs(as64(clean_v)), attn_mask=clean_mask, **args) if (isa, dtype) in DOT_PATHS else None
            assert_half_within(got, want, f32, max_abs(as64(clean_v)), dtype, weighted)
            assert_lse_within(got_lse, want_lse, f32_lse)
        else:
            assert_close_to_reference(got, q, clean_k, clean_v, attn_mask=clean_mask, **args)
            assert_lse_close(got_lse, q, clean_k, clean_v, attn_mask=clean_mask, **args)
        clean, clean_lse = twinattn.attention(
            qd, clean_k, clean_v, attn_mask=clean_mask, return_lse=True, backend=backend, **args
        )
        # never read: the same bits. Except on the bfloat16 dot path (avx512bf16), where a block of
        # keys that is masked and holds a non-finite value takes the convert path (float32 P, so
        # no 0 * NaN) while the clean run's block takes VDPBF16PS (P rounded to bfloat16): both
        # are within the dot path's tolerance (checked above), not the same bits (docs/kernels.md)
        if backend != "numpy" and (isa, dtype) not in DOT_PATHS:
            np.testing.assert_array_equal(got, clean)
            np.testing.assert_array_equal(got_lse, clean_lse)


@ACROSS_ISAS
@DTYPES
@pytest.mark.parametrize("hidden_by", ["causal", "bool-mask"])
@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_value_hidden_from_some_rows(backend: str, isa: str, dtype: np.dtype, path: str, hidden_by: str) -> None:
    """NaN and inf in the value rows of keys that some rows see and others do not (the causal
    diagonal, or a bool mask that hides them from every other query row): the rows that see them
    get NaN / inf in those columns, the others stay finite (a hidden key's value never enters, not
    even as 0 * NaN, also where keys and values are packed in blocks)."""
    q, k, v, kwargs = _problem(path, 10)
    b, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if hidden_by == "causal":
        kwargs = {"causal": True, "q_offset": 0}
        keys = [min(lq // 2, lk - 1), min(lq // 2 + 1, lk - 1)]  # visible from row j on
    else:
        keys = [lk // 3, lk // 3 + 1]
        mask = np.ones((b, hq, lq, lk), bool)
        mask[:, :, ::2, keys] = False  # even rows do not see them
        kwargs = {**kwargs, "attn_mask": mask}
    v[:, :, keys[0], 0] = np.nan
    v[:, :, keys[1], 1] = np.inf
    want_out, _ = _check(backend, isa, dtype, q, k, v, **kwargs)
    if hidden_by == "causal":
        assert np.isfinite(want_out[:, :, : keys[0]]).all() and np.isnan(want_out[:, :, keys[0] :, 0]).all()
    else:
        assert np.isfinite(want_out[:, :, ::2]).all() and np.isnan(want_out[:, :, 1::2, 0]).all()


@ACROSS_ISAS
@DTYPES
def test_all_scores_minus_inf_is_an_empty_row(backend: str, isa: str, dtype: np.dtype) -> None:
    """A row whose every visible score is -inf (inf in q against keys of the other sign) has no
    key above -inf: zeros and lse = -inf, like a row with no visible key."""
    rng = np.random.default_rng(8)
    q, k, v = rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 40, 8), rand(rng, 1, 2, 40, 8)
    k[..., 0] = np.abs(k[..., 0]) + 0.5
    q[0, 1, 2, 0] = -np.inf
    want_out, want_lse = _check(backend, isa, dtype, q, k, v)
    assert (want_out[0, 1, 2] == 0).all() and want_lse[0, 1, 2] == -np.inf


@ACROSS_ISAS
@DTYPES
@pytest.mark.parametrize("path", PATHS)
def test_all_scores_minus_inf_over_nonfinite_values_is_an_empty_row(backend: str, isa: str, dtype: np.dtype, path: str) -> None:
    """As above, with NaN and inf in the values those -inf scores would weight (0 * NaN must not
    enter): the row is zeros and lse = -inf on every path, while the rows that see those values
    are NaN."""
    batch, q_heads, kv_heads, q_len, k_len, dim, value_dim, causal = PATHS[path]
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, batch, q_heads, q_len, dim), rand(rng, batch, kv_heads, k_len, dim), rand(rng, batch, kv_heads, k_len, value_dim)
    k[..., 0] = np.abs(k[..., 0]) + 0.5
    row = q_len - 1  # the last row sees every key, causal or not
    q[0, 0, row, 0] = -np.inf
    v[0, 0, 1, 0] = np.nan
    v[0, 0, k_len // 2, 1] = np.inf
    want_out, want_lse = _check(backend, isa, dtype, q, k, v, causal=causal)
    assert (want_out[0, 0, row] == 0).all() and want_lse[0, 0, row] == -np.inf
    assert np.isnan(want_out[0, 0, 0, 0])  # row 0 weights key 1's NaN by a positive weight


@ACROSS_ISAS
def test_nan_column_in_q_proj_weight_gives_nan(backend: str, isa: str) -> None:
    """A corrupted checkpoint: one NaN column of q_proj makes every query NaN, so every output of
    the layer is NaN (not plausible zeros), on every backend."""
    rng = np.random.default_rng(9)
    hidden, heads, kv_heads, head_dim = 24, 4, 2, 8
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    params = {f"{name}.weight": (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for name, shape in shapes.items()}
    params["q_proj.weight"][:, 3] = np.nan
    module = twinattn.nn.Attention(hidden, heads, kv_heads, head_dim, backend=backend)
    module.load_state_dict(params)
    x = rand(rng, 2, 30, hidden)
    out = module(x)
    assert out.shape == x.shape
    assert np.isnan(out).all()
    # without the NaN column the same layer is finite: the NaN came from the weight
    params["q_proj.weight"][:, 3] = 0.0
    module.load_state_dict(params)
    assert np.isfinite(module(x)).all()
