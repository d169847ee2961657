"""twinattn.attention: validation once, in Python, then one backend call.

Every backend receives the same normalised problem, so every backend raises the same exceptions
with the same messages:
    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) all float32, all float16 or all
    bfloat16 (float64: numpy only), unit last stride; q_offset and kv_lens int64 (B,); mask None
    or a (B, Hq, Lq, Lk) broadcast view, bool or float32 (float64 for a float64 problem);
    out (B, Hq, Lq, Dv) in q's dtype; lse None or (B, Hq, Lq) float32 (float64 for float64).
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike

from . import reference
from ._backends import BackendUnavailableError, native_module, resolve_backend
from . import _checks
from ._checks import (
    ATTENTION_DTYPES, ATTENTION_DTYPES_TEXT, FLOAT32, FLOAT64, INT8, count, dtype_in_code, elements_overlap, shape_str,
)
from ._threads import get_num_threads

Result = Union[np.ndarray, "tuple[np.ndarray, np.ndarray]"]

_RANK_NAMES = {4: "(B, H, L, D)", 3: "(H, L, D)", 2: "(L, D)"}


def _as_array(name: str, value: object) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__array__") or isinstance(value, (list, tuple)):
        return np.asarray(value)
    raise TypeError(f"{name}: expected a numpy array, got {type(value).__name__}")


def _as_input(name: str, value: object, port: str, function: str = "attention", call: str = "q, k, v, ...") -> np.ndarray:
    """q, k or v that is not an ndarray (the slow path): an array-like converted, or a TypeError
    that says what to pass instead of a torch tensor or of a list that converts to a dtype the
    backend refuses. torch is recognised by the type's module, never imported. `function` is the
    twinattn function the caller is (twinattn.torch has its twin of the same name)."""
    if type(value).__module__.partition(".")[0] == "torch":
        raise TypeError(
            f"{name}: got a torch tensor, and twinattn.{function} takes NumPy arrays; for torch tensors call "
            f"twinattn.torch.{function}({call}), which takes the same keywords and returns tensors"
        )
    a = _as_array(name, value)
    if isinstance(value, (list, tuple)) and a.dtype not in ATTENTION_DTYPES and not (a.dtype == FLOAT64 and port == "numpy"):
        raise TypeError(
            f"{name}: got a {type(value).__name__} (of {a.dtype} values); pass a numpy array, "
            f"e.g. np.asarray({name}, dtype=np.float32)"
        )
    return a


def _check_query_dtype(a: np.ndarray, backend: str) -> None:
    """q: float32, float16 or bfloat16 on every backend; float64 on backend="numpy" only."""
    if a.dtype in ATTENTION_DTYPES:
        return
    if a.dtype == FLOAT64:
        if backend == "numpy":
            return
        raise TypeError(
            f"q: backend {backend!r} computes in float32 and does not cast silently; "
            "got float64: pass q.astype(np.float32), or use backend='numpy' for float64"
        )
    raise TypeError(f"q: expected {ATTENTION_DTYPES_TEXT}, got {a.dtype}; convert with q.astype(np.float32)")


def _check_like_query(name: str, a: np.ndarray, dtype: np.dtype, k_dtype: np.dtype) -> None:
    """k: q's dtype, or int8 (with scales) when q is float32, float16 or bfloat16; v: k's dtype
    when that is int8, else q's (nothing is cast silently, mixed dtypes included). The keys may
    be named k or k_cache, the values v or v_cache."""
    is_key = name[0] == "k"
    if a.dtype == dtype and (is_key or k_dtype != INT8):
        return
    int8_allowed = dtype in ATTENTION_DTYPES
    if is_key and int8_allowed:
        if a.dtype == INT8:
            return
        raise TypeError(
            f"k: expected dtype {dtype} (q's dtype) or int8, got {a.dtype}; convert with k.astype({dtype_in_code(dtype)}), "
            "or quantize both k and v with twinattn.quantize_kv"
        )
    if not is_key and k_dtype == INT8 and int8_allowed:
        if a.dtype == INT8:
            return
        raise TypeError(f"{name}: expected dtype int8 (k's dtype), got {a.dtype}; quantize it with twinattn.quantize_kv({name})")
    raise TypeError(
        f"{name}: expected dtype {dtype} (q's dtype), got {a.dtype}; convert with {name}.astype({dtype_in_code(dtype)})"
    )


def _check_scale(
    name: str, value: object, int8: bool, k_dtype: np.dtype, shape: tuple[int, ...], names: tuple[str, ...] | None = None
) -> np.ndarray | None:
    """k_scale / v_scale: a float32 array of k's shape without D when k and v are int8, else None.
    Any strides (a broadcast view of one scale per head, say); values are not checked (a NaN
    scale of a visible token gives NaN, of a hidden one never matters). `names`: the axes'
    names, when they are not attention's (B, Hkv, Lk)."""
    if value is None:
        if int8:
            layout = "B, Hkv, Lk" if names is None else ", ".join(names)
            raise ValueError(f"{name}: required with int8 k and v (float32, shape ({layout})), got None")
        return None
    if not int8:
        raise ValueError(f"{name}: expected None with {k_dtype} k and v (scales are only for int8), got an array")
    if not isinstance(value, np.ndarray):
        if not hasattr(value, "__array__"):
            layout = "B, Hkv, Lk" if names is None else ", ".join(names)
            raise TypeError(f"{name}: expected a float32 numpy array of shape ({layout}), got {type(value).__name__}")
        value = np.asarray(value)
    if value.dtype != FLOAT32:
        raise TypeError(f"{name}: expected dtype float32, got {value.dtype}; convert with {name}.astype(np.float32)")
    if names is None:
        names = ("B", "Hkv", "Lk")[3 - len(shape):]
    if value.ndim != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dimensions ({', '.join(names)}), got shape {shape_str(value.shape)}")
    if value.shape != shape:
        wanted = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
        raise ValueError(f"{name}: expected shape ({wanted}), got {shape_str(value.shape)}")
    return value


# the smallest magnitude that rounds to inf in float32 (half an ulp above its largest finite value)
_FLOAT32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)
_filled_cache: dict[tuple[int, int], np.ndarray] = {}
_NO_WINDOW = (-1, -1)


def _checked_scale(scale: object, dtype: np.dtype) -> float:
    """A given scale: a real number, finite in the problem's arithmetic (float32 unless float64)."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    scale_value = float(scale)
    if not math.isfinite(scale_value):
        raise ValueError(f"scale: expected a finite float, got {scale_value}")
    if dtype != FLOAT64 and abs(scale_value) >= _FLOAT32_OVERFLOW:
        raise ValueError(f"scale: expected a finite float, got {scale_value}, which is inf in float32")
    return scale_value


def _resolve(backend: object) -> str:
    port = _resolved.get(backend) if isinstance(backend, str) else None
    return port if port is not None else resolve_backend(backend)


_resolved: dict[str, str] = {"cpp": "cpp", "rust": "rust", "numpy": "numpy"}


def default_scale(head_dim: int) -> float:
    """scale=None's factor: 1 / sqrt(D) (1 for D = 0, where no product has a term)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _filled(batch: int, value: int) -> np.ndarray:
    """A read-only int64 (B,) array of one value, cached: the common call allocates nothing here."""
    key = (batch, value)
    arr = _filled_cache.get(key)
    if arr is None:
        if len(_filled_cache) > 256:
            _filled_cache.clear()
        arr = np.full(batch, value, dtype=np.int64)
        arr.flags.writeable = False
        _filled_cache[key] = arr
    return arr


def _unit_last_stride(a: np.ndarray) -> np.ndarray:
    """The last axis must have unit stride; any other strides are read in place."""
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    return a


def _per_sequence(name: str, value: object, batch: int) -> np.ndarray:
    """An int or an int array (B,) as int64 (B,)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int or an int array of shape (B={batch},), got bool")
    if isinstance(value, numbers.Integral):
        return np.full(batch, int(value), dtype=np.int64)
    arr = _as_array(name, value)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an int or an int array of shape (B={batch},), got dtype {arr.dtype}")
    if arr.shape != (batch,):
        raise ValueError(f"{name}: expected an int or an int array of shape (B={batch},), got shape {shape_str(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: values must fit in int64, got {arr.max()}")
    return arr.astype(np.int64)


def _prepare_mask(attn_mask: object, dtype: np.dtype, full_shape: tuple[int, int, int, int]) -> np.ndarray:
    mask = _as_array("attn_mask", attn_mask)
    if mask.dtype.kind in "iu":
        raise TypeError(
            f"attn_mask: integer masks are ambiguous (is 1 'attend' or 'masked'?); got {mask.dtype}: "
            "pass a bool mask (True = may attend) or a float additive bias"
        )
    if mask.dtype != np.bool_:
        # an additive float32 bias (float64 for a float64 problem); one in q's dtype is widened
        bias_dtype = FLOAT64 if dtype == FLOAT64 else FLOAT32
        if mask.dtype != bias_dtype and mask.dtype != dtype and mask.dtype != FLOAT32:
            accepted = bias_dtype.name if dtype in (FLOAT32, FLOAT64) else f"float32 or {dtype}"
            raise TypeError(f"attn_mask: expected bool (True = may attend) or {accepted} (additive bias), got {mask.dtype}")
        mask = mask.astype(bias_dtype, copy=False)
    if mask.ndim > 4:
        raise ValueError(f"attn_mask: expected at most 4 dimensions broadcastable to (B, Hq, Lq, Lk) = {full_shape}, got shape {shape_str(mask.shape)}")
    try:
        return np.broadcast_to(mask, full_shape)
    except ValueError:
        raise ValueError(
            f"attn_mask: expected a shape broadcastable to (B, Hq, Lq, Lk) = {full_shape}, got {shape_str(mask.shape)}"
        ) from None


_INPUT_NAMES = ("q", "k", "v", "attn_mask", "k_scale", "v_scale")


def _prepare_out(
    out: object, shape: tuple[int, ...], dtype: np.dtype, inputs: list[np.ndarray | None], names: tuple[str, ...] = _INPUT_NAMES
) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} (q's dtype), got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {shape_str(out.shape)}")
    if not out.flags.writeable:
        raise ValueError("out: expected a writeable array, got a read-only one")
    if elements_overlap(out):
        # each element is written by one thread: aliased elements would race (and be wrong)
        raise ValueError(
            f"out: expected an array whose elements do not overlap each other, got strides {out.strides} "
            f"(bytes) for shape {shape_str(out.shape)}: pass a fresh array such as np.empty({shape_str(out.shape)}, {dtype_in_code(dtype)})"
        )
    for name, a in zip(names, inputs):
        if a is not None and np.may_share_memory(out, a):
            raise ValueError(f"out: must not overlap the memory of {name}")
    return out


class Problem(NamedTuple):
    """A call of attention checked and normalised, as every backend receives it (4-D q, k, v; the
    keywords of attention_reference, which the native calls take too, with num_threads)."""

    port: str
    num_threads: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict[str, Any]


if TYPE_CHECKING:
    from typing_extensions import TypedDict, Unpack

    class _Keywords(TypedDict, total=False):
        """attention's keywords other than return_lse, for its overloads (the defaults and the
        meaning: attention itself)."""

        causal: bool
        q_offset: int | ArrayLike | None
        kv_lens: ArrayLike | None
        attn_mask: ArrayLike | None
        scale: float | None
        out: np.ndarray | None
        backend: str
        num_threads: int | None
        window_size: tuple[int, int]
        softcap: float
        alibi_slopes: ArrayLike | None
        sinks: ArrayLike | None
        k_scale: ArrayLike | None
        v_scale: ArrayLike | None


# return_lse=False (the default) gives out; return_lse=True gives (out, lse); the other keywords
# as attention below (_Keywords, one entry each)
@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[False] = False, **keywords: Unpack[_Keywords]
) -> np.ndarray: ...
@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[True], **keywords: Unpack[_Keywords]
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: bool = False, **keywords: Unpack[_Keywords]
) -> Result: ...


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    q_offset: int | ArrayLike | None = None,
    kv_lens: ArrayLike | None = None,
    attn_mask: ArrayLike | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    out: np.ndarray | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None,
    _problem: list[Problem] | None = None,
) -> Result:
    """Exact scaled-dot-product attention on the CPU: softmax(scale * q k^T + bias) v, with the
    variants current models use (sliding window, logit softcapping, ALiBi, attention sinks).

    Every backend gets the same checked arguments and gives the same result within float32
    rounding (the cpp and rust backends bit for bit). For torch tensors use
    twinattn.torch.attention, which takes the same keywords and returns tensors.
    float16 and bfloat16 (ml_dtypes.bfloat16) inputs are computed in float32 from their exact
    values, and out is rounded once to their dtype.

    Parameters
    ----------
    q : array_like, shape (B, Hq, Lq, D), (Hq, Lq, D) or (Lq, D)
        Queries. 3-D inputs mean B=1 and 2-D inputs B=1 and Hq=1; the results come back with
        the same rank. float32, float16 or bfloat16 (ml_dtypes.bfloat16); float64 only with
        backend="numpy". Nothing is cast silently.
    k : array_like, shape (B, Hkv, Lk, D), same rank and dtype as q (or int8, see k_scale)
        Keys. Grouped-query attention: Hq must be a multiple of Hkv, and query head h reads
        KV head h // (Hq // Hkv) (Hkv == Hq is multi-head, Hkv == 1 multi-query).
    v : array_like, shape (B, Hkv, Lk, Dv), same rank and dtype as q
        Values. Dv may differ from D. Any strides on the B, H and L axes of q, k and v are read
        in place (``cache[:, :, :n]``, ``x.swapaxes(1, 2)``); an array whose last axis is not
        contiguous is copied once.
    causal : bool, default False
        Key j is visible to query row i of sequence b only if j <= q_offset[b] + i.
    q_offset : None, int or int array of shape (B,), default None
        Absolute position of query row 0 of each sequence (keys sit at positions 0, 1, ...):
        row i sits at p = q_offset[b] + i. None means bottom-right alignment, q_offset[b] =
        kv_lens[b] - Lq: the queries are the last Lq positions of the sequence, as when
        decoding after a KV cache. Used only with causal=True, a window_size other than
        (-1, -1) or alibi_slopes. Non-negative, except without causal once window_size or
        alibi_slopes is given: then a negative value (the default's too) is used as it is.
        For a right-padded batch of prompts pass q_offset=0.
    kv_lens : None, int or int array of shape (B,), default None
        Number of valid keys of each sequence, 0 <= kv_lens[b] <= Lk; None means Lk. Keys
        j >= kv_lens[b] are padding: never read, whatever they hold.
    attn_mask : None or array_like broadcastable to (B, Hq, Lq, Lk), default None
        bool: True means the key may be attended (torch's polarity); float32: an additive bias,
        -inf hiding the key (a bias in q's dtype is widened to float32; float64 for a float64
        problem). Applied on top of causal and kv_lens. Integer masks
        are refused, their polarity being ambiguous.
    scale : float, optional
        Factor applied to q k^T; None (the default) means 1 / sqrt(D). Must be finite.
    return_lse : bool, default False
        Also return lse, the natural log of each row's softmax denominator:
        lse[b, h, i] = log(sum over visible j of exp(s_ij)), s_ij the score described under
        softcap and alibi_slopes (scale * q_i . k_j + bias_ij without them), plus exp(sinks[h])
        inside the sum when sinks is given.
    out : numpy.ndarray, optional
        A writeable array of the output's shape and dtype (q's), written in place and returned. It
        must not share memory with q, k, v or attn_mask. Any strides.
    backend : {"auto", "cpp", "rust", "numpy"}, default "auto"
        "auto" takes the first of twinattn.backends() (a native port when one is built);
        "numpy" is the float64-capable reference.
    num_threads : int, optional
        Threads for the native ports (>= 1); None means twinattn.get_num_threads(): the value
        of twinattn.set_num_threads(), else TWINATTN_NUM_THREADS, else the usable cores.
        Results do not depend on it. The numpy backend ignores it.
    window_size : (int, int), default (-1, -1)
        (left, right), flash-attn's convention: key j is visible to the query at position p
        only if p - left <= j <= p + right; -1 means unbounded on that side. With causal=True
        right is capped at 0. Hugging Face's sliding_window=w is window_size=(w - 1, 0) with
        causal=True. Keys outside the window are never read: a windowed decode costs O(window).
    softcap : float, default 0.0
        When > 0, each score s = scale * q.k becomes softcap * tanh(s / softcap) (Gemma 2),
        before the ALiBi term and the mask's bias are added. 0 turns it off.
    alibi_slopes : None or float32 array of shape (Hq,) or (B, Hq), default None
        ALiBi: adds -alibi_slopes[b, h] * |p - j| to the score of key j for the query at
        position p (after softcap), by index arithmetic (no bias matrix is built).
    sinks : None or float32 array of shape (Hq,), default None
        Attention sinks (gpt-oss): one learned logit per query head, a virtual key of score
        sinks[h] (not multiplied by scale) that takes softmax mass and carries no value.
    k_scale, v_scale : None or float32 arrays of k's shape without D, e.g. (B, Hkv, Lk)
        Required when k and v are int8 (twinattn.quantize_kv), None otherwise: the result is
        attention over dequantize_kv(k, k_scale), dequantize_kv(v, v_scale) (float32(x) * scale)
        within float32 tolerance. Any strides. Not checked for finiteness: a NaN scale of a
        visible key gives NaN, of a hidden one never matters.

    Returns
    -------
    out : numpy.ndarray, shape (..., Hq, Lq, Dv), q's rank and dtype
        float16 / bfloat16: the float32 result rounded to nearest (ties to even).
        A row with no visible key is all zeros (masking never produces NaN).
    lse : numpy.ndarray, shape (..., Hq, Lq), only with return_lse=True
        float32 (float64 for a float64 problem), whatever q's dtype.
        -inf for a row with no visible key (sinks[h] with sinks).

    Raises
    ------
    TypeError
        An argument of the wrong type: q, k, v, attn_mask or out not an array (a torch tensor:
        the message names twinattn.torch.attention; a list: np.asarray); a dtype other
        than float32, float16 or bfloat16 (float64 outside backend="numpy"); q, k and v of
        different dtypes (the message names the fix, k.astype(...)); an
        integer mask; causal or return_lse not a bool; q_offset, kv_lens or num_threads not
        ints; scale or softcap not a real number; window_size not a pair of ints;
        alibi_slopes or sinks not float32 arrays; out of the wrong dtype.
    ValueError
        A wrong rank or shape (k, v, attn_mask or out not matching q); Hq not a multiple of
        Hkv; kv_lens outside [0, Lk]; a negative q_offset, or with causal=True a default
        q_offset that comes out negative (Lq > kv_len); a scale that is not finite; num_threads
        below 1; out read-only or overlapping an input; an unknown backend name; a window side
        below -1; a softcap that is negative or not finite; alibi_slopes or sinks of the wrong
        shape or holding a non-finite value.
    BackendUnavailableError
        backend="cpp" or "rust" names a port this installation was built without; the message
        says how to build it.

    Notes
    -----
    Non-finite values: a NaN or inf in any visible position of q, k, v or a float mask gives
    the same NaN/inf pattern in out and lse as the float64 reference. Positions that are not
    visible (kv_lens padding, a False bool mask, a -inf bias, keys outside causality or the
    window) are never read and never matter.

    The native ports release the GIL while they compute; calls from several Python threads at
    once are safe.

    Examples
    --------
    >>> q = np.ones((1, 32, 16, 128), np.float32)    # 16 new queries
    >>> k = v = np.ones((1, 8, 1040, 128), np.float32)  # 1024 cached keys + 16
    >>> attention(q, k, v, causal=True).shape         # queries at positions 1024..1039
    (1, 32, 16, 128)
    """
    port = _resolve(backend)
    if causal is not True and causal is not False and not isinstance(causal, np.bool_):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    if return_lse is not True and return_lse is not False and not isinstance(return_lse, np.bool_):
        raise TypeError(f"return_lse: expected bool, got {type(return_lse).__name__}")
    threads = get_num_threads() if num_threads is None else count("num_threads", num_threads)

    # Ranks and dtypes.
    if type(q) is not np.ndarray:
        q = _as_input("q", q, port)
    if type(k) is not np.ndarray:
        k = _as_input("k", k, port)
    if type(v) is not np.ndarray:
        v = _as_input("v", v, port)
    rank = q.ndim
    dtype = q.dtype
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != rank or rank not in _RANK_NAMES:
            if a.ndim not in _RANK_NAMES:
                raise ValueError(f"{name}: expected 2, 3 or 4 dimensions (B, H, L, D), got shape {shape_str(a.shape)}")
            raise ValueError(f"{name}: expected {rank} dimensions {_RANK_NAMES[rank]} like q, got shape {shape_str(a.shape)}")
        if a.dtype != FLOAT32 or dtype != FLOAT32 or name == "v" and k.dtype != FLOAT32:
            if name == "q":
                _check_query_dtype(a, port)
            else:
                _check_like_query(name, a, dtype, k.dtype)

    # Shapes, in the 4-D form every backend sees (views, no copies).
    if rank == 4:
        q4, k4, v4 = q, k, v
    else:
        lead = (1,) * (4 - rank)
        q4, k4, v4 = q.reshape(lead + q.shape), k.reshape(lead + k.shape), v.reshape(lead + v.shape)
    batch, q_heads, q_len, head_dim = q4.shape
    kv_batch, kv_heads, k_len, k_dim = k4.shape
    if kv_batch != batch or k_dim != head_dim:
        raise ValueError(f"k: expected shape (B={batch}, Hkv, Lk, D={head_dim}), got {shape_str(k.shape)}")
    if v4.shape[:3] != (batch, kv_heads, k_len):
        raise ValueError(f"v: expected shape (B={batch}, Hkv={kv_heads}, Lk={k_len}, Dv), got {shape_str(v.shape)}")
    value_dim = v4.shape[3]
    if kv_heads == 0 and q_heads > 0 or kv_heads > 0 and q_heads % kv_heads != 0:
        raise ValueError(
            f"q, k: the query heads Hq={q_heads} must be a multiple of the key/value heads Hkv={kv_heads} "
            "(grouped-query attention: query head h reads KV head h // (Hq // Hkv))"
        )
    q4, k4, v4 = _unit_last_stride(q4), _unit_last_stride(k4), _unit_last_stride(v4)

    # Variants; at their defaults (the common call) nothing is computed here.
    window = _NO_WINDOW if window_size is _NO_WINDOW else _checks.window_size(window_size)
    cap = 0.0 if type(softcap) is float and softcap == 0.0 else _checks.softcap(softcap)
    slopes = None
    if alibi_slopes is not None:
        slopes = _checks.per_head_floats(
            "alibi_slopes", alibi_slopes, ((q_heads,), (batch, q_heads)), f"(Hq={q_heads},) or (B={batch}, Hq={q_heads})", dtype
        )
        slopes = np.broadcast_to(slopes, (batch, q_heads))  # (Hq,): a stride-0 view
    sink_logits = None
    if sinks is not None:
        sink_logits = _checks.per_head_floats("sinks", sinks, ((q_heads,),), f"(Hq={q_heads},)", dtype)
    windowed = window is not _NO_WINDOW and window != _NO_WINDOW
    window_left, window_right = window
    if causal and windowed:
        window_right = 0  # causality already hides every key right of the query
    # without causal, a window or ALiBi makes positions matter: the default offset may be negative
    signed_offsets = not causal and (windowed or slopes is not None)
    # int8 k and v: their scales, (B, Hkv, Lk) in the 4-D form
    int8 = k.dtype == INT8
    k_scales = v_scales = None
    if int8 or k_scale is not None or v_scale is not None:
        k_scales = _check_scale("k_scale", k_scale, int8, k.dtype, k.shape[:-1])
        v_scales = _check_scale("v_scale", v_scale, int8, k.dtype, k.shape[:-1])
        if int8 and rank != 4:
            assert k_scales is not None and v_scales is not None
            k_scales = k_scales.reshape((1,) * (4 - rank) + k_scales.shape)
            v_scales = v_scales.reshape((1,) * (4 - rank) + v_scales.shape)

    # Positions and lengths.
    if kv_lens is None:
        lens = _filled(batch, k_len)
        shortest = k_len
    else:
        lens = _per_sequence("kv_lens", kv_lens, batch)
        shortest = int(lens.min()) if batch else k_len
        if batch and (shortest < 0 or lens.max() > k_len):
            raise ValueError(f"kv_lens: expected values in [0, Lk={k_len}], got {lens.tolist()}")
    if q_offset is None:
        # bottom-right: the queries are the last Lq positions of each sequence
        if causal and shortest < q_len and batch:
            offsets = lens - q_len
            raise ValueError(
                f"q_offset: the default bottom-right alignment puts the queries at kv_len - Lq = "
                f"{offsets.tolist()}, which is negative (Lq={q_len} > kv_len); for a right-padded batch "
                "of prompts pass q_offset=0"
            )
        if causal or signed_offsets:
            offsets = _filled(batch, k_len - q_len) if kv_lens is None else lens - q_len
        else:
            offsets = _filled(batch, 0)  # positions unused
    else:
        offsets = _per_sequence("q_offset", q_offset, batch)
        if batch and not signed_offsets and offsets.min() < 0:
            raise ValueError(f"q_offset: expected non-negative values, got {offsets.tolist()}")

    # Mask, scale, output.
    mask = None if attn_mask is None else _prepare_mask(attn_mask, dtype, (batch, q_heads, q_len, k_len))
    if scale is None:
        scale_value = default_scale(head_dim)
    elif type(scale) is float and abs(scale) < _FLOAT32_OVERFLOW:
        scale_value = scale  # a finite Python float (what callers pass): nothing more to check
    else:
        scale_value = _checked_scale(scale, dtype)
    if _problem is not None:
        # twinattn.core.backward's entry: the checked, normalised problem, and nothing computed
        options = dict(
            scale=scale_value, q_offset=offsets, kv_lens=lens, mask=mask, causal=bool(causal), window_left=window_left,
            window_right=window_right, softcap=cap, alibi_slopes=slopes, sinks=sink_logits,
        )
        _problem.append(Problem(port, threads, q4, k4, v4, options))
        return q
    out_shape = q.shape[:-1] + (value_dim,)
    if out is None:
        result = np.empty(out_shape, dtype=dtype)
    else:
        result = _prepare_out(out, out_shape, dtype, [q, k, v, None if attn_mask is None else mask, k_scales, v_scales])
    out4 = result if rank == 4 else result.reshape((1,) * (4 - rank) + out_shape)
    # lse is float32 whatever q's dtype (float64 for a float64 problem)
    lse = np.empty((batch, q_heads, q_len), dtype=FLOAT64 if dtype == FLOAT64 else FLOAT32) if return_lse else None

    # Compute.
    if port == "numpy":
        ref_out, ref_lse = reference.attention_reference(
            q4, k4, v4, causal=bool(causal), q_offset=offsets, kv_lens=lens, mask=mask, scale=scale_value,
            window_left=window_left, window_right=window_right, softcap=cap, alibi_slopes=slopes, sinks=sink_logits,
            k_scale=k_scales, v_scale=v_scales,
        )
        out4[...] = ref_out
        if lse is not None:
            lse[...] = ref_lse
    else:
        target = out4 if value_dim <= 1 or out4.strides[-1] == out4.itemsize else np.empty(out4.shape, dtype)
        native_module(port).attention_forward(
            q4, k4, v4, target, scale=scale_value, lse=lse, q_offset=offsets, kv_lens=lens, mask=mask,
            causal=bool(causal), num_threads=threads, window_left=window_left, window_right=window_right,
            softcap=cap, alibi_slopes=slopes, sinks=sink_logits, k_scale=k_scales, v_scale=v_scales,
        )
        if target is not out4:
            out4[...] = target

    if not return_lse:
        return result
    assert lse is not None
    return result, lse.reshape(q.shape[:-1])


# ---- the plain call without attention()'s keyword handling: twinattn.torch's eager calls ---------


def plain_attention(q: Any, k: Any, v: Any, causal: object, scale: object, return_lse: object, backend: object,
                    capsules: tuple[object, object, object] | None = None, dtype: np.dtype[Any] | None = None) -> Result | None:
    """attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse, backend=backend), bit
    for bit, for 4-D NumPy q, k and v on a native port: the same native call without attention()'s
    keyword handling and checks, for twinattn.torch's eager calls, whose tiny problems cost less
    than those. None where attention() has something to say (the numpy backend, a causal or
    return_lse that is not a bool, a scale that is not a float, another rank, and whatever the
    native call refuses: the native ports check everything attention() checks of such a call, a
    default causal offset that comes out negative included): attention() then checks the call
    and says what is wrong in its own words.

    capsules: DLPack capsules of q, k and v, which the native call reads in their place (q, k and
    v then only give the shapes: twinattn.torch's tensors), and dtype the NumPy dtype of out."""
    port = _resolve(backend)
    if (
        port == "numpy" or (causal is not True and causal is not False) or (return_lse is not True and return_lse is not False)
        or (scale is not None and type(scale) is not float)
    ):
        return None
    shape, kv_shape, value_shape = q.shape, k.shape, v.shape
    if len(shape) != 4 or len(kv_shape) != 4 or len(value_shape) != 4:
        return None
    batch, q_heads, q_len, head_dim = shape
    if scale is None:
        scale = default_scale(head_dim)
    out = np.empty((batch, q_heads, q_len, value_shape[3]), q.dtype if dtype is None else dtype)
    lse = np.empty((batch, q_heads, q_len), dtype=FLOAT32) if return_lse else None
    threads = get_num_threads()
    try:
        # attention()'s q_offset (bottom-right, Lk - Lq) and kv_lens (Lk): the native call's own
        # defaults, 0 and Lk, where they are the same
        native_module(port).attention_forward(
            *((q, k, v) if capsules is None else capsules), out, scale=scale, lse=lse,
            q_offset=_filled(batch, kv_shape[2] - q_len) if causal else None, causal=causal, num_threads=threads,
        )
    except (ValueError, TypeError, BackendUnavailableError):
        return None
    return out if lse is None else (out, lse)
