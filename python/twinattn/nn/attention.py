"""Attention modules on NumPy arrays that run Hugging Face Llama attention weights.

    attn = twinattn.nn.Attention(hidden_size=4096, num_heads=32, num_kv_heads=8,
                                 rope=twinattn.RotaryEmbedding(128, base=500000.0))
    attn.load_state_dict({name: w.numpy() for name, w in llama_layer.self_attn.state_dict().items()})
    cache = twinattn.KVCache(num_layers=1, batch_size=1, num_kv_heads=8, head_dim=128, max_seq_len=4096)
    y = attn(prompt_hidden, cache=cache)       # prefill (B, L, hidden) -> (B, L, hidden)
    y = attn(next_hidden, cache=cache)         # decode: positions and offsets come from the cache

The forward pass is Llama's: q, k, v = x W_q^T (+ b_q), ...; q and k rotated at their absolute
positions; k and v appended to the cache (keys stored rotated, as Hugging Face does); causal
attention of the new queries over the stored prefix with explicit q_offset (each sequence's
cache length before the update) and kv_lens (after it), so sequences of different cached lengths
batch together; out = attention x W_o^T (+ b_o).

Reduced precision: with a KVCache of dtype float16 or bfloat16 the projections stay float32, keys
and values are stored in the cache's dtype (rounded to nearest, half the bytes), q is rounded to
it for the attention call (the kernels take one dtype), and the attention output is widened back
to float32 for the output projection. With an int8 KVCache keys and values are quantized as
they are stored (twinattn.quantize_kv) and read with their scales; q stays float32.

The variants of Mistral / Gemma 2 / gpt-oss: sliding_window=w (Hugging Face's meaning: each query
sees itself and the w - 1 keys before it, window_size=(w - 1, 0) with causal), softcap (attention
logit softcapping) and sinks=True (a learned per-head logit, state_dict key "sinks", gpt-oss).

Paged: with a twinattn.PagedKVCache, pass seqs (one sequence id per batch row); each row's new
keys and values are appended to its sequence and its queries attend over that sequence's blocks
through twinattn.attention_paged (shared prefix blocks read in place, no padding to the longest).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from ..core import _checks
from ..core._checks import ATTENTION_DTYPES, FLOAT32, INT8, count, shape_str
from ..core._backends import BACKENDS, native_module, resolve_backend
from ..core.api import attention
from ..core.varlen import attention_paged
from .cache import KVCache, layer_index, new_token_counts
from .paged_cache import CacheFullError, PagedKVCache
from .rope import RotaryEmbedding

__all__ = ["Attention"]


class Attention:
    """Multi-head, grouped-query (num_kv_heads < num_heads) or multi-query (num_kv_heads=1)
    self-attention with Q/K/V/O projections, optional RoPE and an optional KV cache.

    Weights are float32 in torch Linear orientation (out_features, in_features):
        q_proj.weight (num_heads * head_dim, hidden_size)
        k_proj.weight, v_proj.weight (num_kv_heads * head_dim, hidden_size)
        o_proj.weight (hidden_size, num_heads * head_dim)
    and, with bias=True, q_proj.bias ... o_proj.bias (out_features,). They start as torch's
    Linear does, uniform in +-1/sqrt(in_features); load_state_dict replaces them. With
    sinks=True there is one more: sinks (num_heads,), gpt-oss's learned per-head logit, starting at 0.

    sliding_window: None, or w >= 1: each query sees itself and the w - 1 keys before it
    (Hugging Face's sliding_window; Mistral, Gemma 2's local layers). softcap: attention logit
    softcapping, each score s -> softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping;
    0 = off).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        rope: RotaryEmbedding | None = None,
        backend: str = "auto",
        sliding_window: int | None = None,
        softcap: float = 0.0,
        sinks: bool = False,
    ) -> None:
        self.hidden_size = count("hidden_size", hidden_size)
        self.num_heads = count("num_heads", num_heads)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else count("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={self.num_heads} (grouped-query attention), "
                f"got {self.num_kv_heads}"
            )
        if head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"head_dim: hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                    "pass head_dim explicitly"
                )
            head_dim = self.hidden_size // self.num_heads
        self.head_dim = count("head_dim", head_dim)
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"bias: expected bool, got {type(bias).__name__}")
        self.bias = bool(bias)
        if rope is not None:
            if not isinstance(rope, RotaryEmbedding):
                raise TypeError(f"rope: expected None or a twinattn.RotaryEmbedding, got {type(rope).__name__}")
            if rope.head_dim != self.head_dim:
                raise ValueError(f"rope: expected a RotaryEmbedding with head_dim={self.head_dim}, got head_dim={rope.head_dim}")
        self.rope = rope
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        if backend not in ("auto", "numpy"):
            native_module(backend)  # a port that is not built fails here, saying how to build it
        self.backend = backend
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.sliding_window = None if sliding_window is None else count("sliding_window", sliding_window)
        self.softcap = _checks.softcap(softcap)
        if not isinstance(sinks, (bool, np.bool_)):
            raise TypeError(f"sinks: expected bool, got {type(sinks).__name__}")
        self.sinks = bool(sinks)

        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._shapes: dict[str, tuple[int, ...]] = {
            "q_proj.weight": (q_out, self.hidden_size),
            "k_proj.weight": (kv_out, self.hidden_size),
            "v_proj.weight": (kv_out, self.hidden_size),
            "o_proj.weight": (self.hidden_size, q_out),
        }
        if self.bias:
            self._shapes.update(
                {"q_proj.bias": (q_out,), "k_proj.bias": (kv_out,), "v_proj.bias": (kv_out,), "o_proj.bias": (self.hidden_size,)}
            )
        if self.sinks:
            self._shapes["sinks"] = (self.num_heads,)
        rng = np.random.default_rng()
        self._params: dict[str, np.ndarray] = {}
        for name, shape in self._shapes.items():
            if name == "sinks":  # a logit of 0 per head until load_state_dict replaces it
                self._params[name] = np.zeros(shape, np.float32)
                continue
            fan_in = self._shapes[name.replace(".bias", ".weight")][1]
            bound = 1.0 / math.sqrt(fan_in)
            self._params[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)

    # ---- weights ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the weights, under Hugging Face / torch names."""
        return {name: value.copy() for name, value in self._params.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load q_proj / k_proj / v_proj / o_proj weights (and biases when bias=True) in torch
        Linear orientation (out_features, in_features). Values may be NumPy arrays or anything
        with __array__ (a CPU torch tensor: pass tensor.detach() or .numpy()); float16, float32
        and float64 are stored as float32. Every key must be present and no other key may be:
        nothing is loaded unless everything checks."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        missing = sorted(self._shapes.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - self._shapes.keys())
        if missing or unexpected:
            raise KeyError(
                f"state_dict: expected exactly the keys {sorted(self._shapes)}; missing {missing}, unexpected {unexpected}"
                + ("" if self.bias or not any(k.endswith(".bias") for k in unexpected) else " (construct with bias=True)")
                + ("" if self.sinks or "sinks" not in unexpected else " (construct with sinks=True)")
            )
        loaded: dict[str, np.ndarray] = {}
        for name, shape in self._shapes.items():
            value = np.asarray(state_dict[name])
            if value.dtype.kind != "f":
                raise TypeError(f"state_dict[{name!r}]: expected a float array, got dtype {value.dtype}")
            if value.shape != shape:
                orientation = " (out_features, in_features)" if name.endswith(".weight") else ""
                raise ValueError(
                    f"state_dict[{name!r}]: expected shape {shape_str(shape)}{orientation}, got {shape_str(value.shape)}"
                )
            loaded[name] = np.array(value, dtype=np.float32)  # a copy: later edits to the source do not leak in
        self._params = loaded

    # ---- forward ---------------------------------------------------------------------------

    def _project(self, x: np.ndarray, name: str) -> np.ndarray:
        y: np.ndarray = x @ self._params[f"{name}.weight"].T
        if self.bias:
            y += self._params[f"{name}.bias"]
        return y

    def _positions(
        self, positions: object, batch: int, length: int, cache: KVCache | PagedKVCache | None, layer: int, seqs: list[int]
    ) -> np.ndarray:
        if positions is None:
            if isinstance(cache, PagedKVCache):
                return cache.positions(seqs, length, layer)
            if cache is not None:
                return cache.positions(length, layer)
            return np.arange(length, dtype=np.int64)
        arr = np.asarray(positions)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"positions: expected an int array of shape (L,) or (B, L), got dtype {arr.dtype}")
        if arr.shape not in ((length,), (batch, length)):
            raise ValueError(f"positions: expected shape (L={length},) or (B={batch}, L={length}), got {shape_str(arr.shape)}")
        return arr

    def __call__(
        self,
        hidden_states: np.ndarray,
        *,
        positions: object = None,
        cache: KVCache | PagedKVCache | None = None,
        layer_idx: int = 0,
        attn_mask: ArrayLike | None = None,
        causal: bool = True,
        num_new: object = None,
        seqs: Sequence[int] | None = None,
    ) -> np.ndarray:
        """hidden_states (B, L, hidden_size) float32 -> (B, L, hidden_size) float32.

        positions: the absolute positions (L,) or (B, L) used by RoPE; default
            cache.positions(L, layer_idx) with a cache, arange(L) without.
        cache, layer_idx: keys and values are appended to cache layer layer_idx and the queries
            attend over everything stored there (in the cache's dtype: float32, float16 or
            bfloat16; the output is float32 in every case); query row i of sequence b sits at cache slot
            seq_lens[b] + i (q_offset), keys past each sequence's length are never read (kv_lens).
        num_new: with a cache, an int array (B,): sequence b appends only its first num_new[b]
            rows (a right-padded batch of prompts of different lengths; the outputs of the padding
            rows are to be ignored).
        attn_mask: passed to twinattn.attention (bool, True = may attend, or a float32 additive
            bias) broadcastable to (B, num_heads, L, S), S the keys attended (the stored prefix with
            a cache); it is applied on top of the causal mask.
        causal: False for bidirectional attention (an encoder); True (Llama) by default. A module
            with a sliding_window needs causal=True.
        seqs: with a PagedKVCache, the sequence id of each batch row (B ids, no repeats); row b's
            first num_new[b] (default L) tokens are appended to sequence seqs[b] of layer layer_idx
            and attend over its blocks. attn_mask is not taken then.
        With sliding_window=w each query (at its absolute position p) attends to keys p - w + 1 .. p
        only: a cached decode step reads the last w keys, not the whole cache.
        """
        if not isinstance(hidden_states, np.ndarray):
            raise TypeError(f"hidden_states: expected a numpy array (B, L, hidden_size), got {type(hidden_states).__name__}")
        if hidden_states.dtype != np.float32:
            raise TypeError(
                f"hidden_states: expected float32, got {hidden_states.dtype}; convert with hidden_states.astype(np.float32)"
            )
        if hidden_states.ndim != 3 or hidden_states.shape[2] != self.hidden_size:
            raise ValueError(
                f"hidden_states: expected shape (B, L, hidden_size={self.hidden_size}), got {shape_str(hidden_states.shape)}"
            )
        seq_ids: list[int] = []
        if isinstance(cache, PagedKVCache):
            seq_ids = self._check_paged(cache, hidden_states.shape[0], seqs, attn_mask)
            layer = layer_index(layer_idx, cache.num_layers)
        elif seqs is not None:
            got_cache = "cache=None" if cache is None else f"a {type(cache).__name__}"
            raise ValueError(f"seqs: only meaningful with a twinattn.PagedKVCache, got sequence ids and {got_cache}")
        elif cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache: expected None, a twinattn.KVCache or a twinattn.PagedKVCache, got {type(cache).__name__}")
            expected = (hidden_states.shape[0], self.num_kv_heads, self.head_dim)
            got = (cache.batch_size, cache.num_kv_heads, cache.head_dim)
            if got != expected:
                raise ValueError(
                    "cache: expected (batch_size, num_kv_heads, head_dim) = "
                    f"({expected[0]}, {expected[1]}, {expected[2]}), got ({got[0]}, {got[1]}, {got[2]})"
                )
            if cache.dtype not in ATTENTION_DTYPES and cache.dtype != INT8:
                raise TypeError(
                    f"cache: expected a KVCache of dtype float32, float16, bfloat16 (ml_dtypes.bfloat16) or int8, got {cache.dtype}"
                )
            layer = cache._layer(layer_idx)
        elif num_new is not None:
            raise ValueError("num_new: only meaningful with a cache, got a value and cache=None")
        else:
            layer = 0
        if self.sliding_window is not None and not causal:
            raise ValueError(
                f"causal: a sliding_window={self.sliding_window} attends to the keys before each query "
                "(window_size=(w - 1, 0) with causal, as Hugging Face); expected causal=True, got False"
            )
        batch, length, _ = hidden_states.shape
        pos = self._positions(positions, batch, length, cache, layer, seq_ids)

        # Projections, split into heads: (B, L, H * D) -> (B, H, L, D).
        q = self._project(hidden_states, "q_proj").reshape(batch, length, self.num_heads, self.head_dim)
        k = self._project(hidden_states, "k_proj").reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self._project(hidden_states, "v_proj").reshape(batch, length, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if self.rope is not None:
            q, k = self.rope.apply(q, pos), self.rope.apply(k, pos)

        if isinstance(cache, PagedKVCache):
            out = self._attend_paged(q, k, v, cache, seq_ids, layer, num_new, causal)
        else:
            out = self._attend_dense(q, k, v, cache, layer, num_new, causal, attn_mask)
        # (B, L, H, D) -> (B, L, H * D) -> output projection (in float32, whatever the cache's dtype).
        merged = out.reshape(batch, length, self.num_heads * self.head_dim).astype(FLOAT32, copy=False)
        return self._project(merged, "o_proj")

    def _variant_keywords(self) -> dict[str, Any]:
        """The attention keywords the module's configuration gives, dense and paged alike."""
        return dict(
            scale=self.scale,
            backend=resolve_backend(self.backend),
            window_size=(-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0),
            softcap=self.softcap,
            sinks=self._params["sinks"] if self.sinks else None,
        )

    def _check_paged(self, cache: PagedKVCache, batch: int, seqs: Sequence[int] | None, attn_mask: object) -> list[int]:
        if seqs is None:
            raise ValueError(f"seqs: a PagedKVCache needs the sequence id of each of the B={batch} rows, got None")
        seq_ids = [int(seq) for seq in seqs]
        if len(seq_ids) != batch or len(set(seq_ids)) != batch:
            raise ValueError(f"seqs: expected B={batch} distinct sequence ids (one per row), got {seq_ids}")
        got = (cache.num_kv_heads, cache.head_dim, cache.value_dim)
        if got != (self.num_kv_heads, self.head_dim, self.head_dim):
            raise ValueError(
                f"cache: expected (num_kv_heads, head_dim, value_dim) = ({self.num_kv_heads}, {self.head_dim}, {self.head_dim}), got {got}"
            )
        if cache.dtype not in ATTENTION_DTYPES and cache.dtype != INT8:
            raise TypeError(
                f"cache: expected a PagedKVCache of dtype float32, float16, bfloat16 (ml_dtypes.bfloat16) or int8, got {cache.dtype}"
            )
        if attn_mask is not None:
            raise ValueError("attn_mask: not taken with a PagedKVCache (positions and seq_lens say what each query sees)")
        return seq_ids

    def _attend_paged(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: PagedKVCache, seqs: list[int], layer: int,
        num_new: object, causal: bool,
    ) -> np.ndarray:
        """Append each row's first num_new[b] tokens to sequence seqs[b], then attend its queries
        over its blocks: q (B, H, L, D), k and v (B, Hkv, L, D) -> (B, L, H, D) (padding rows zero)."""
        batch, _, length, _ = q.shape
        counts = new_token_counts(num_new, batch, length)
        # every row's blocks are counted first: a full cache raises before any row is appended
        needed = sum(cache.blocks_needed(seq, layer, int(n)) for seq, n in zip(seqs, counts))
        if needed > cache.num_free_blocks:
            raise CacheFullError(
                f"cache: appending {counts.tolist()} tokens to sequences {seqs} (layer {layer}) needs {needed} free blocks, "
                f"{cache.num_free_blocks} of {cache.num_blocks} are free; the cache is unchanged"
            )
        for b, seq in enumerate(seqs):
            cache.append(seq, layer, k[b, :, : counts[b]].swapaxes(0, 1), v[b, :, : counts[b]].swapaxes(0, 1))
        valid = np.arange(length)[None, :] < counts[:, None]
        packed_q = q.transpose(0, 2, 1, 3)[valid]  # (total_q, H, D), row by row
        if cache.dtype not in (FLOAT32, INT8):
            packed_q = packed_q.astype(cache.dtype)
        k_cache, v_cache = cache.layer(layer)
        k_scale, v_scale = cache.scales(layer) if cache.dtype == INT8 else (None, None)
        packed = attention_paged(
            packed_q, k_cache, v_cache, cache.block_table(seqs), cache.seq_lens(seqs, layer),
            cu_seqlens_q=np.concatenate([[0], np.cumsum(counts)]), causal=causal, k_scale=k_scale, v_scale=v_scale,
            **self._variant_keywords(),
        )
        out = np.zeros((batch, length) + packed.shape[1:], packed.dtype)
        out[valid] = packed
        return out

    def _attend_dense(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache | None, layer: int, num_new: object, causal: bool,
        attn_mask: ArrayLike | None,
    ) -> np.ndarray:
        """q (B, H, L, D), k and v (B, Hkv, L, D), appended to the dense cache when there is one
        -> attention (B, L, H, D)."""
        # Keys are cached rotated; the kernel gets each sequence's offset and length explicitly.
        # A float16 / bfloat16 cache rounds k and v as it stores them; q is rounded to match. An
        # int8 cache quantizes them, and attention reads them with their scales; q stays float32.
        k_scale = v_scale = None
        if cache is not None:
            q_offset: Any = cache.seq_lens(layer)
            keys, values = cache.update(np.ascontiguousarray(k), np.ascontiguousarray(v), layer, num_new=num_new)
            kv_lens: Any = cache.seq_lens(layer)
            if cache.dtype == INT8:
                k_scale, v_scale = cache.scales(layer)
            elif cache.dtype != FLOAT32:
                q = q.astype(cache.dtype)
        else:
            q_offset, kv_lens, keys, values = 0, None, k, v
        out = attention(
            q,
            keys,
            values,
            causal=causal,
            q_offset=q_offset if causal else None,
            kv_lens=kv_lens,
            attn_mask=attn_mask,
            k_scale=k_scale,
            v_scale=v_scale,
            **self._variant_keywords(),
        )
        result: np.ndarray = out.transpose(0, 2, 1, 3)
        return result

    def __repr__(self) -> str:
        return (
            f"Attention(hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, bias={self.bias}, rope={self.rope!r}, backend={self.backend!r}"
            + ("" if self.sliding_window is None else f", sliding_window={self.sliding_window}")
            + ("" if self.softcap == 0.0 else f", softcap={self.softcap}")
            + (", sinks=True" if self.sinks else "")
            + ")"
        )
