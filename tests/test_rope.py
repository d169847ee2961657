"""RoPE: the seeds' identity, rotation matrices built from the RoFormer formula, and each of
Hugging Face's scaling types against its published formula (written here element by element,
independently of twinattn.nn.rope's vectorised code)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import twinattn
from helpers import UNIT_ROUNDOFF

# A frequency of pi/4 per position on a single pair: inv_freq[0] = base**0 = 1, divided by 4/pi.
QUARTER_TURN = {"rope_type": "linear", "factor": 4 / math.pi}


def pairs(head_dim: int, rotary_dim: int, interleaved: bool) -> list[tuple[int, int]]:
    """The feature pairs (a, b) rotated together, pair p at frequency index p."""
    if interleaved:
        return [(2 * p, 2 * p + 1) for p in range(rotary_dim // 2)]
    return [(p, p + rotary_dim // 2) for p in range(rotary_dim // 2)]


def rotation_matrix(angles: list[float], head_dim: int, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """R (head_dim, head_dim) float64 with y = R x: each pair (a, b) turned by its angle."""
    rot = np.eye(head_dim)
    for (a, b), angle in zip(pairs(head_dim, rotary_dim, interleaved), angles):
        c, s = math.cos(angle), math.sin(angle)
        rot[a, a], rot[a, b], rot[b, a], rot[b, b] = c, -s, s, c
    return rot


def default_inv_freq(base: float, dim: int) -> list[float]:
    return [base ** (-(2 * p) / dim) for p in range(dim // 2)]


# ---- the seeds' identity ----------------------------------------------------------------------


def test_seed_identity_quarter_turn() -> None:
    rope = twinattn.RotaryEmbedding(2, scaling=QUARTER_TURN)
    unit = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)

    def dot(m: int, n: int) -> float:
        return float((rope.apply(unit, [m]) * rope.apply(unit, [n])).sum())

    assert dot(1, 2) == pytest.approx(math.cos(math.pi / 4), abs=1e-15)
    assert dot(5, 6) == pytest.approx(dot(1, 2), abs=1e-15)
    assert dot(1, 3) == pytest.approx(0.0, abs=1e-15)  # a gap of two quarter-turns is orthogonal


def test_seed_identity_through_every_backend(backend: str) -> None:
    """One key: lse = scale * q.k, so the kernels see the rotated score cos(pi/4) / sqrt(2)."""
    rope = twinattn.RotaryEmbedding(2, scaling=QUARTER_TURN)
    unit = np.array([1.0, 0.0], dtype=np.float32).reshape(1, 1, 1, 2)
    for m, n in ((1, 2), (5, 6), (100, 101)):
        q, k = rope.apply(unit, [n]), rope.apply(unit, [m])
        _, lse = twinattn.attention(q, k, k, return_lse=True, backend=backend)
        assert float(lse[0, 0, 0]) == pytest.approx(math.cos(math.pi / 4) / math.sqrt(2), abs=4 * UNIT_ROUNDOFF)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_relative_position_identity_every_frequency(interleaved: bool) -> None:
    """R(m)q . R(n)k == q . R(n - m)k for random q, k on each pair alone (each frequency)."""
    head_dim, base = 16, 10000.0
    rope = twinattn.RotaryEmbedding(head_dim, base=base, interleaved=interleaved)
    inv_freq = default_inv_freq(base, head_dim)
    rng = np.random.default_rng(0)
    for p, (a, b) in enumerate(pairs(head_dim, head_dim, interleaved)):
        q, k = np.zeros(head_dim), np.zeros(head_dim)
        q[[a, b]], k[[a, b]] = rng.standard_normal(2), rng.standard_normal(2)
        for m, n in ((0, 3), (7, 2), (1000, 1013), (12345, 12345)):
            left = float(rope.apply(q.reshape(1, 1, 1, -1), [m]).ravel() @ rope.apply(k.reshape(1, 1, 1, -1), [n]).ravel())
            gap = rotation_matrix([(n - m) * f for f in inv_freq], head_dim, head_dim, interleaved)
            right = float(q @ gap @ k)
            assert left == pytest.approx(right, abs=1e-9 * (1 + abs(m) + abs(n))), (p, m, n)
        # and shifting both positions leaves it unchanged, on full random vectors too
    q, k = rng.standard_normal((1, 1, 1, head_dim)), rng.standard_normal((1, 1, 1, head_dim))
    base_score = float((rope.apply(q, [3]) * rope.apply(k, [10])).sum())
    for shift in (1, 50, 4096):
        shifted = float((rope.apply(q, [3 + shift]) * rope.apply(k, [10 + shift])).sum())
        assert shifted == pytest.approx(base_score, abs=1e-9 * shift)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 4], ids=["full", "partial"])
def test_apply_equals_rotation_matrix(interleaved: bool, rotary_dim: int) -> None:
    head_dim, base = 8, 500.0
    rope = twinattn.RotaryEmbedding(head_dim, base=base, rotary_dim=rotary_dim, interleaved=interleaved)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, head_dim))
    positions = np.array([[0, 1, 2, 3], [17, 18, 40, 1000]])
    got = rope.apply(x, positions)
    inv_freq = default_inv_freq(base, rotary_dim)
    for b, h, i in np.ndindex(2, 3, 4):
        rot = rotation_matrix([positions[b, i] * f for f in inv_freq], head_dim, rotary_dim, interleaved)
        np.testing.assert_allclose(got[b, h, i], rot @ x[b, h, i], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # pass-through, bit for bit
    # Norm preserved: rotations are orthogonal.
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_partial_rotary_equals_rope_of_the_slice() -> None:
    """GPT-NeoX's partial rotary: frequencies from rotary_dim, pairing inside the first rotary_dim."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 12))
    partial = twinattn.RotaryEmbedding(12, rotary_dim=4).apply(x, np.arange(5))
    np.testing.assert_array_equal(partial[..., :4], twinattn.RotaryEmbedding(4).apply(x[..., :4].copy(), np.arange(5)))


def test_batched_positions_equal_per_sequence() -> None:
    rope = twinattn.RotaryEmbedding(8)
    x = np.random.default_rng(3).standard_normal((3, 2, 4, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3], [5, 6, 7, 8], [90, 91, 92, 93]])
    got = rope.apply(x, positions)
    for b in range(3):
        np.testing.assert_array_equal(got[b : b + 1], rope.apply(x[b : b + 1], positions[b]))


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_float32_angles_are_computed_in_float64(interleaved: bool) -> None:
    """At large positions a float32 angle is off by ~1e-2 rad; angles in float64 cast once keep
    the float32 result within a few roundoffs of the float64 one."""
    rope = twinattn.RotaryEmbedding(8, interleaved=interleaved)
    x = np.random.default_rng(4).standard_normal((1, 1, 3, 8))
    positions = np.array([100_000, 1_000_003, 30_000_001])
    exact = rope.apply(x, positions)
    got = rope.apply(x.astype(np.float32), positions)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=0, atol=8 * UNIT_ROUNDOFF * np.abs(x).max())


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_cos_sin_layout(interleaved: bool) -> None:
    rope = twinattn.RotaryEmbedding(8, base=100.0, rotary_dim=6, interleaved=interleaved)
    cos, sin = rope.cos_sin(np.array([[3, 4]]), dtype=np.float64)
    assert cos.shape == sin.shape == (1, 2, 6)
    inv_freq = default_inv_freq(100.0, 6)
    for i, pos in enumerate((3, 4)):
        for p, (a, b) in enumerate(pairs(8, 6, interleaved)):
            for feature in (a, b):
                assert cos[0, i, feature] == pytest.approx(math.cos(pos * inv_freq[p]), abs=1e-15)
                assert sin[0, i, feature] == pytest.approx(math.sin(pos * inv_freq[p]), abs=1e-15)
    assert rope.cos_sin([1, 2])[0].dtype == np.float32


# ---- scaling types ---------------------------------------------------------------------------


def test_linear_scaling() -> None:
    rope = twinattn.RotaryEmbedding(16, scaling={"rope_type": "linear", "factor": 4.0})
    plain = twinattn.RotaryEmbedding(16)
    np.testing.assert_allclose(rope.inv_freq, [f / 4.0 for f in default_inv_freq(10000.0, 16)], rtol=1e-15)
    # Position interpolation: position 4p scaled is position p unscaled.
    x = np.random.default_rng(5).standard_normal((1, 1, 3, 16))
    np.testing.assert_allclose(rope.apply(x, [0, 8, 40]), plain.apply(x, [0, 2, 10]), rtol=0, atol=1e-12)


def test_dynamic_ntk_scaling() -> None:
    dim, base, factor, original = 16, 10000.0, 2.0, 64
    rope = twinattn.RotaryEmbedding(
        dim, base=base, scaling={"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": original}
    )
    # Within the original context: the default frequencies.
    np.testing.assert_allclose(rope.inv_freq_for(np.arange(64)), default_inv_freq(base, dim), rtol=1e-15)
    for last in (64, 100, 1000):  # beyond it: base' = base * (s * n / L0 - (s - 1)) ** (d / (d - 2)), n = P + 1
        n = last + 1
        new_base = base * (factor * n / original - (factor - 1)) ** (dim / (dim - 2))
        np.testing.assert_allclose(rope.inv_freq_for(np.arange(last + 1)), default_inv_freq(new_base, dim), rtol=1e-13)
        assert rope.inv_freq_for([last])[0] == 1.0  # the fastest pair keeps its frequency
        angles = rope.angles(np.array([last]))
        np.testing.assert_allclose(angles[0], [last * f for f in default_inv_freq(new_base, dim)], rtol=1e-13)


def yarn_inv_freq_and_factor(dim: int, base: float, params: dict) -> tuple[list[float], float]:
    """YaRN (Peng et al. 2023) as transformers' modeling_rope_utils states it, one pair at a time."""
    factor, original = params["factor"], params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast", 32), params.get("beta_slow", 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if "attention_factor" in params:
        attention_factor = params["attention_factor"]
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    else:
        attention_factor = mscale(factor)

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    result = []
    for p in range(dim // 2):
        ramp = min(max((p - low) / (high - low), 0.0), 1.0)
        extrapolation = base ** (-2 * p / dim)
        result.append(extrapolation / factor * ramp + extrapolation * (1 - ramp))
    return result, attention_factor


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 2048},
        {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
        {"factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.5, "truncate": False},
    ],
    ids=["defaults", "betas", "mscale", "attention_factor_untruncated"],
)
def test_yarn_scaling(params: dict) -> None:
    dim, base = 64, 10000.0
    rope = twinattn.RotaryEmbedding(dim, base=base, scaling={"rope_type": "yarn", **params})
    want, attention_factor = yarn_inv_freq_and_factor(dim, base, params)
    np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-14)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-15)
    # The fastest pair is extrapolated (kept), the slowest interpolated (divided by factor).
    assert rope.inv_freq[0] == 1.0
    assert rope.inv_freq[-1] == pytest.approx(base ** (-(dim - 2) / dim) / params["factor"], rel=1e-14)
    # cos and sin carry the attention factor: cos^2 + sin^2 = factor^2, lengths grow by it.
    cos, sin = rope.cos_sin(np.arange(10), dtype=np.float64)
    np.testing.assert_allclose(cos**2 + sin**2, attention_factor**2, rtol=1e-14)
    x = np.random.default_rng(6).standard_normal((1, 2, 10, dim))
    np.testing.assert_allclose(
        np.linalg.norm(rope.apply(x, np.arange(10)), axis=-1), attention_factor * np.linalg.norm(x, axis=-1), rtol=1e-13
    )


def test_yarn_default_attention_factor_published_value() -> None:
    rope = twinattn.RotaryEmbedding(
        64, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    )
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)  # sqrt(1/t) = 0.1 ln(s) + 1


def test_llama3_scaling_published_llama31_parameters() -> None:
    """Llama 3.1: base 500000, head 128, factor 8, low 1, high 4, original context 8192."""
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope = twinattn.RotaryEmbedding(128, base=500000.0, scaling={"rope_type": "llama3", **params})
    bands = {"kept": 0, "divided": 0, "blended": 0}
    for p, (got, f) in enumerate(zip(rope.inv_freq, default_inv_freq(500000.0, 128))):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want, band = f, "kept"
        elif wavelen > 8192 / 1.0:
            want, band = f / 8.0, "divided"
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want, band = (1 - smooth) * f / 8.0 + smooth * f, "blended"
        bands[band] += 1
        assert got == pytest.approx(want, rel=1e-14), p
    assert all(count > 0 for count in bands.values()), bands  # the test covers all three bands
    assert rope.attention_factor == 1.0


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"head_dim": 0}, ValueError, r"head_dim: expected a positive int, got 0"),
        ({"head_dim": 8, "rotary_dim": 10}, ValueError, r"rotary_dim: expected at most head_dim=8, got 10"),
        ({"head_dim": 8, "rotary_dim": 5}, ValueError, r"rotary_dim: expected an even number.*got 5"),
        ({"head_dim": 8, "base": -1.0}, ValueError, r"base: expected a positive finite float, got -1.0"),
        ({"head_dim": 8, "scaling": {"rope_type": "ntk2"}}, ValueError, r"rope_type.*expected one of .*got 'ntk2'"),
        ({"head_dim": 8, "scaling": {"rope_type": "linear"}}, ValueError, r"requires keys \['factor'\]; missing \['factor'\]"),
        (
            {"head_dim": 8, "scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1.0}},
            ValueError,
            r"got unknown \['beta'\]",
        ),
        (
            {"head_dim": 8, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
            ValueError,
            r"high_freq_factor > low_freq_factor",
        ),
    ],
    ids=["head_dim", "rotary_dim_large", "rotary_dim_odd", "base", "type", "missing", "unknown", "llama3_bands"],
)
def test_constructor_errors(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        twinattn.RotaryEmbedding(**kwargs)


def test_legacy_type_key_is_accepted() -> None:
    rope = twinattn.RotaryEmbedding(8, scaling={"type": "linear", "factor": 2.0})
    assert rope.rope_type == "linear"


def test_apply_errors() -> None:
    rope = twinattn.RotaryEmbedding(8)
    x = np.zeros((1, 2, 3, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"positions: expected an int array .* got dtype float64"):
        rope.apply(x, np.arange(3.0))
    with pytest.raises(ValueError, match=r"positions: expected shape \(L=3,\) or \(B=1, L=3\), got \(4,\)"):
        rope.apply(x, np.arange(4))
    with pytest.raises(ValueError, match=r"x: expected shape \(B, H, L, D=8\), got \(1, 2, 3, 6\)"):
        rope.apply(np.zeros((1, 2, 3, 6), dtype=np.float32), np.arange(3))
    with pytest.raises(TypeError, match=r"x: expected float32, float64, float16 or bfloat16 \(ml_dtypes.bfloat16\), got int32"):
        rope.apply(x.astype(np.int32), np.arange(3))
