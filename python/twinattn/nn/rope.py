"""Rotary position embedding (RoPE), with Hugging Face's rope scaling types.

Feature pair p of a head is rotated by the angle position * inv_freq[p], where
inv_freq[p] = base ** (-2p / rotary_dim) before scaling (RoFormer). Two pairings of features:
    interleaved=False  pair p = features (p, p + rotary_dim/2): "rotate half", Hugging Face Llama, GPT-NeoX
    interleaved=True   pair p = features (2p, 2p + 1): RoFormer, GPT-J
Features at and past rotary_dim pass through unchanged (partial rotary, GPT-NeoX's rotary_pct).

Angles are computed in float64 (positions * inv_freq, then cos and sin) and cast once to the
dtype of the input: at position 100 000 a float32 angle would be off by about 0.004 rad.

`scaling` takes Hugging Face's `rope_scaling` / `rope_parameters` dictionaries, with their names
(see transformers' modeling_rope_utils); s is `factor`, L0 `original_max_position_embeddings`:
    {"rope_type": "linear", "factor": s}                 inv_freq / s (position interpolation)
    {"rope_type": "dynamic", "factor": s, "original_max_position_embeddings": L0}
        dynamic NTK: for a call whose largest position is P, with n = max(P + 1, L0),
        base' = base * (s * n / L0 - (s - 1)) ** (rotary_dim / (rotary_dim - 2))
    {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L0, optional
        "beta_fast" (32), "beta_slow" (1), "attention_factor", "mscale", "mscale_all_dim",
        "truncate" (True)}: YaRN's ramp between extrapolated and interpolated frequencies, cos and
        sin multiplied by the attention factor (default 0.1 ln s + 1)
    {"rope_type": "llama3", "factor": s, "low_freq_factor": a, "high_freq_factor": b,
        "original_max_position_embeddings": L0}: Llama 3.1's wavelength-banded scaling
    {"rope_type": "default"} or None: no scaling
Hugging Face reads L0 for "dynamic" from config.max_position_embeddings; here the dictionary
carries it, since there is no config. The legacy key "type" is accepted for "rope_type"; a
top-level "rope_theta" in the dictionary must agree with `base`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np

from ..core._checks import FLOAT32, FLOAT64, HALF_DTYPES, count

__all__ = ["RotaryEmbedding", "ROPE_TYPES"]

# rope_type -> (required keys, optional keys), "rope_type" itself not included.
ROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
        frozenset(),
    ),
}
_ALWAYS_ALLOWED = frozenset({"rope_type", "type", "rope_theta"})


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
    result = float(value)
    if not (math.isfinite(result) and result > 0):
        raise ValueError(f"{name}: expected a positive finite float, got {result}")
    return result


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(s) + 1 for s > 1, else 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding:
    """RoPE for queries and keys x (B, H, L, D) at integer positions (B, L) or (L,).

    >>> rope = RotaryEmbedding(128, base=500000.0, scaling={"rope_type": "llama3", "factor": 8.0,
    ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    >>> q = rope.apply(q, positions)          # same shape and dtype as q
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        self.head_dim = count("head_dim", head_dim)
        self.rotary_dim = self.head_dim if rotary_dim is None else count("rotary_dim", rotary_dim)
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: expected at most head_dim={self.head_dim}, got {self.rotary_dim}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even number (features are rotated in pairs), got {self.rotary_dim}")
        self.base = _positive_float("base", base)
        if not isinstance(interleaved, (bool, np.bool_)):
            raise TypeError(f"interleaved: expected bool, got {type(interleaved).__name__}")
        self.interleaved = bool(interleaved)
        self.scaling: dict[str, Any] = self._check_scaling(scaling)
        self.rope_type: str = self.scaling["rope_type"]
        # Pair p's exponent 2p / rotary_dim, and its unscaled inverse frequency, in float64.
        self._exponent: np.ndarray = np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim
        self._default_inv_freq: np.ndarray = self.base ** (-self._exponent)
        self.attention_factor = 1.0
        self.inv_freq = self._static_inv_freq()

    # ---- scaling ---------------------------------------------------------------------------

    def _check_scaling(self, scaling: Mapping[str, Any] | None) -> dict[str, Any]:
        if scaling is None:
            return {"rope_type": "default"}
        if not isinstance(scaling, Mapping):
            raise TypeError(f"scaling: expected None or a dict like Hugging Face's rope_scaling, got {type(scaling).__name__}")
        params = dict(scaling)
        rope_type = params.pop("rope_type", None)
        legacy = params.pop("type", None)
        rope_type = rope_type if rope_type is not None else legacy
        if rope_type is None:
            raise ValueError(f"scaling: expected a 'rope_type' key (one of {sorted(ROPE_TYPES)}), got keys {sorted(scaling)}")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"scaling['rope_type']: expected one of {sorted(ROPE_TYPES)}, got {rope_type!r}")
        theta = params.pop("rope_theta", None)
        if theta is not None and float(theta) != self.base:
            raise ValueError(f"scaling['rope_theta']: expected it to equal base={self.base}, got {theta}")
        required, optional = ROPE_TYPES[rope_type]
        missing = sorted(required - params.keys())
        if missing:
            raise ValueError(f"scaling: rope_type {rope_type!r} requires keys {sorted(required)}; missing {missing}")
        unknown = sorted(params.keys() - required - optional - _ALWAYS_ALLOWED)
        if unknown:
            raise ValueError(
                f"scaling: rope_type {rope_type!r} accepts keys {sorted(required | optional)}; got unknown {unknown}"
            )
        checked: dict[str, Any] = {"rope_type": rope_type}
        for key, value in params.items():
            if key == "original_max_position_embeddings":
                checked[key] = count(f"scaling[{key!r}]", value)
            elif key == "truncate":
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError(f"scaling['truncate']: expected bool, got {type(value).__name__}")
                checked[key] = bool(value)
            elif value is None and key in optional:
                continue  # Hugging Face treats an explicit None as "use the default"
            else:
                checked[key] = _positive_float(f"scaling[{key!r}]", value)
        if rope_type == "llama3" and checked["high_freq_factor"] <= checked["low_freq_factor"]:
            raise ValueError(
                "scaling: llama3 expects high_freq_factor > low_freq_factor, got "
                f"high_freq_factor={checked['high_freq_factor']}, low_freq_factor={checked['low_freq_factor']}"
            )
        if rope_type == "yarn" and self.base == 1.0:
            raise ValueError("base: yarn needs a base other than 1 (its ramp divides by ln(base)), got 1.0")
        if rope_type == "dynamic" and self.rotary_dim <= 2:
            raise ValueError(f"scaling: dynamic NTK needs rotary_dim > 2 (exponent d / (d - 2)), got {self.rotary_dim}")
        return checked

    def _static_inv_freq(self) -> np.ndarray:
        """inv_freq (rotary_dim / 2,) float64 for every type whose frequencies do not depend on positions."""
        s = self.scaling
        inv_freq = self._default_inv_freq
        if self.rope_type == "linear":
            factor: float = s["factor"]
            return inv_freq / factor
        if self.rope_type == "yarn":
            return self._yarn_inv_freq()
        if self.rope_type == "llama3":
            return self._llama3_inv_freq()
        return inv_freq.copy()  # default; dynamic at lengths within original_max_position_embeddings

    def _dynamic_inv_freq(self, seq_len: int) -> np.ndarray:
        """Dynamic NTK: the base grows with the sequence length once it exceeds the original context."""
        factor: float = self.scaling["factor"]
        original: int = self.scaling["original_max_position_embeddings"]
        n = max(seq_len, original)
        d = self.rotary_dim
        base = self.base * (factor * n / original - (factor - 1.0)) ** (d / (d - 2))
        inv_freq: np.ndarray = base ** (-self._exponent)
        return inv_freq

    def _yarn_inv_freq(self) -> np.ndarray:
        """YaRN (Peng et al. 2023): pairs that rotate many times within the original context keep
        their frequency (extrapolation), slow pairs are interpolated by `factor`, and a linear ramp
        over pair indices blends the two between the beta_fast and beta_slow rotation counts."""
        s = self.scaling
        factor: float = s["factor"]
        original: int = s["original_max_position_embeddings"]
        beta_fast, beta_slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)
        d = self.rotary_dim
        if "attention_factor" in s:
            self.attention_factor = s["attention_factor"]
        elif s.get("mscale") and s.get("mscale_all_dim"):
            self.attention_factor = _mscale(factor, s["mscale"]) / _mscale(factor, s["mscale_all_dim"])
        else:
            self.attention_factor = _mscale(factor)

        def correction_dim(rotations: float) -> float:
            # The (fractional) feature index whose pair turns `rotations` times over the original context.
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as Hugging Face: avoid dividing by zero
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolated = self._default_inv_freq
        interpolated = self._default_inv_freq / factor
        return interpolated * ramp + extrapolated * (1.0 - ramp)

    def _llama3_inv_freq(self) -> np.ndarray:
        """Llama 3.1: wavelengths shorter than L0 / high_freq_factor unchanged, longer than
        L0 / low_freq_factor divided by factor, and in between a blend linear in L0 / wavelength."""
        s = self.scaling
        factor, low_ff, high_ff = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        original = s["original_max_position_embeddings"]
        inv_freq = self._default_inv_freq
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
        return np.where(
            wavelen < original / high_ff, inv_freq, np.where(wavelen > original / low_ff, inv_freq / factor, blended)
        )

    # ---- positions and angles ---------------------------------------------------------------

    @staticmethod
    def _check_positions(positions: object) -> np.ndarray:
        if isinstance(positions, (bool, np.bool_)):
            raise TypeError("positions: expected an int array of shape (L,) or (B, L), got bool")
        arr = np.asarray(positions)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"positions: expected an int array of shape (L,) or (B, L), got dtype {arr.dtype}")
        if arr.ndim not in (1, 2):
            raise ValueError(f"positions: expected shape (L,) or (B, L), got {tuple(arr.shape)}")
        return arr

    def inv_freq_for(self, positions: object) -> np.ndarray:
        """The float64 inverse frequencies (rotary_dim / 2,) used for these positions (they depend
        on the positions only for "dynamic", through the largest one)."""
        arr = self._check_positions(positions)
        if self.rope_type == "dynamic" and arr.size:
            return self._dynamic_inv_freq(int(arr.max()) + 1)
        return self.inv_freq

    def angles(self, positions: object) -> np.ndarray:
        """float64 angles positions[..., None] * inv_freq, shape positions.shape + (rotary_dim / 2,)."""
        arr = self._check_positions(positions)
        angles: np.ndarray = arr.astype(np.float64)[..., None] * self.inv_freq_for(arr)
        return angles

    def cos_sin(self, positions: object, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, shape positions.shape + (rotary_dim,), in the layout of the rotated features
        (rotate-half: [c_0 .. c_{d/2-1}, c_0 .. c_{d/2-1}]; interleaved: [c_0, c_0, c_1, c_1, ...]),
        times the attention factor (1 except for yarn), as Hugging Face's rotary embeddings return
        them. Computed in float64, cast once to dtype."""
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype: expected a floating dtype, got {dtype}")
        theta = self.angles(positions)
        cos, sin = np.cos(theta) * self.attention_factor, np.sin(theta) * self.attention_factor
        if self.interleaved:
            cos, sin = np.repeat(cos, 2, axis=-1), np.repeat(sin, 2, axis=-1)
        else:
            cos, sin = np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)
        return cos.astype(dtype), sin.astype(dtype)

    def apply(self, x: np.ndarray, positions: object) -> np.ndarray:
        """Rotate x (B, H, L, D) with D = head_dim at positions (L,) or (B, L); a new array of
        x's dtype (float32, float64, float16 or bfloat16). Pair p: (a, b) -> (a cos - b sin,
        b cos + a sin). float16 and bfloat16 are rotated in float32 and rounded once (to nearest,
        ties to even)."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x: expected a numpy array (B, H, L, D), got {type(x).__name__}")
        if x.dtype not in (FLOAT32, FLOAT64) + HALF_DTYPES:
            raise TypeError(f"x: expected float32, float64, float16 or bfloat16 (ml_dtypes.bfloat16), got {x.dtype}")
        if x.ndim != 4 or x.shape[3] != self.head_dim:
            raise ValueError(f"x: expected shape (B, H, L, D={self.head_dim}), got {tuple(x.shape)}")
        arr = self._check_positions(positions)
        batch, _, length, _ = x.shape
        if arr.ndim == 1 and arr.shape != (length,):
            raise ValueError(f"positions: expected shape (L={length},) or (B={batch}, L={length}), got {tuple(arr.shape)}")
        if arr.ndim == 2 and arr.shape != (batch, length):
            raise ValueError(f"positions: expected shape (L={length},) or (B={batch}, L={length}), got {tuple(arr.shape)}")

        theta = self.angles(arr)  # (L, d/2) or (B, L, d/2), float64
        if theta.ndim == 3:
            theta = theta[:, None]  # (B, 1, L, d/2): one rotation for every head
        scale = self.attention_factor
        work = FLOAT32 if x.dtype in HALF_DTYPES else x.dtype  # half precision: rotated in float32
        cos = (np.cos(theta) * scale).astype(work)  # the one cast
        sin = (np.sin(theta) * scale).astype(work)

        given = x.dtype
        if work != given:
            x = x.astype(work)
        out = np.empty_like(x)
        r = self.rotary_dim
        if self.interleaved:
            first, second = x[..., 0:r:2], x[..., 1:r:2]
            out[..., 0:r:2] = first * cos - second * sin
            out[..., 1:r:2] = second * cos + first * sin
        else:
            half = r // 2
            first, second = x[..., :half], x[..., half:r]
            out[..., :half] = first * cos - second * sin
            out[..., half:r] = second * cos + first * sin
        out[..., r:] = x[..., r:]
        return out if given == work else out.astype(given)

    def __repr__(self) -> str:
        return (
            f"RotaryEmbedding(head_dim={self.head_dim}, base={self.base}, rotary_dim={self.rotary_dim}, "
            f"interleaved={self.interleaved}, scaling={self.scaling if self.rope_type != 'default' else None})"
        )
