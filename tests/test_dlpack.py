"""The native ports read a DLPack capsule wherever they take an array (docs/native_api.md,
"DLPack capsules"): the same bits as the array it describes, in every entry and dtype, and the
same errors from both ports for a capsule they cannot read.

The capsules here are built with ctypes from NumPy arrays (so that every field can be set: the
name, version and flags, the device, the element type, null strides, a byte offset); NumPy's
and torch's own capsules are read too.
"""

from __future__ import annotations

import ctypes
import importlib
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import twinattn
from helpers import BFLOAT16, FLOAT16, rand

c_int64_p = ctypes.POINTER(ctypes.c_int64)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", c_int64_p), ("strides", c_int64_p), ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

# (type code, bits) of each NumPy dtype (DLPack: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool)
_CODES = {
    np.dtype(np.float32): (2, 32), FLOAT16: (2, 16), BFLOAT16: (4, 16), np.dtype(np.float64): (2, 64),
    np.dtype(np.int8): (0, 8), np.dtype(np.int32): (0, 32), np.dtype(np.int64): (0, 64), np.dtype(np.bool_): (6, 8),
}
_KEEP: list[Any] = []  # what the capsules point into (they have no destructor): kept for the session


def capsule(a: np.ndarray, *, name: bytes = b"dltensor", version: tuple[int, int] = (1, 0), read_only: bool = False,
            device_type: int = 1, code_bits: tuple[int, int] | None = None, lanes: int = 1, ndim: int | None = None,
            compact: bool = False, byte_offset: int = 0, shape: tuple[int, ...] | None = None) -> Any:
    """A DLPack capsule of `a` ("dltensor_versioned" names carry `version` and `read_only`);
    compact: null strides (a must be C-contiguous); byte_offset: data that many bytes before a's,
    the offset carrying the rest; shape: another shape claimed for a's memory."""
    code, bits = _CODES[a.dtype] if code_bits is None else code_bits
    extents = (ctypes.c_int64 * max(a.ndim, 1))(*(a.shape if shape is None else shape))
    assert not compact or a.flags.c_contiguous
    strides = None if compact else (ctypes.c_int64 * max(a.ndim, 1))(*(s // a.itemsize for s in a.strides))
    tensor = DLTensor(
        a.ctypes.data - byte_offset, DLDevice(device_type, 0), a.ndim if ndim is None else ndim, DLDataType(code, bits, lanes),
        ctypes.cast(extents, c_int64_p), None if strides is None else ctypes.cast(strides, c_int64_p), byte_offset,
    )
    if name == b"dltensor_versioned":
        managed: Any = DLManagedTensorVersioned(DLPackVersion(*version), None, None, int(read_only), tensor)
    else:
        managed = DLManagedTensor(tensor, None, None)
    name_buffer = ctypes.create_string_buffer(name)
    _KEEP.extend((a, extents, strides, managed, name_buffer))
    return _capsule_new(ctypes.addressof(managed), ctypes.addressof(name_buffer), None)


def _module(port: str) -> ModuleType:
    return importlib.import_module(f"twinattn._{port}")


FORMS = {
    "dltensor": {},
    "versioned": {"name": b"dltensor_versioned"},
    "compact": {"compact": True},
    "byte-offset": {"byte_offset": 96},
}


def _as_capsules(args: dict[str, Any], form: dict[str, Any]) -> dict[str, Any]:
    """Every array of a call's arguments as its capsule (compact only where the array is)."""
    def one(a: Any) -> Any:
        if not isinstance(a, np.ndarray):
            return a
        return capsule(a, **{key: value for key, value in form.items() if key != "compact" or a.flags.c_contiguous})
    return {key: one(value) for key, value in args.items()}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _forward_args(dtype: np.dtype, int8: bool) -> dict[str, Any]:
    # asymmetric on purpose: GQA 4/2, Lq 5 against Lk 9, D 8 against Dv 6, k a strided view
    # (every other key of a wider array), per-sequence offsets and lengths, sinks
    rng = np.random.default_rng(7)
    q = rand(rng, 2, 4, 5, 8).astype(dtype)
    k = rand(rng, 2, 2, 18, 8).astype(dtype)[:, :, ::2]
    v = rand(rng, 2, 2, 9, 6).astype(dtype)
    args: dict[str, Any] = dict(
        q=q, k=k, v=v, out=np.zeros((2, 4, 5, 6), dtype), lse=np.zeros((2, 4, 5), np.float32), scale=0.4,
        q_offset=np.array([4, 1], np.int64), kv_lens=np.array([9, 6], np.int64), causal=True,
        sinks=np.linspace(-1, 1, 4).astype(np.float32),
    )
    if int8:
        k8, k_scale = twinattn.quantize_kv(np.ascontiguousarray(k).astype(np.float32))
        v8, v_scale = twinattn.quantize_kv(v.astype(np.float32))
        args.update(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
    else:
        mask = np.ones((2, 4, 5, 9), np.bool_)
        mask[:, 1, :, 3] = False  # one head never sees key 3
        args["mask"] = mask
    return args


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "int8"])
def test_forward_reads_capsules_as_the_arrays_they_describe(native_backend: str, kind: str, form: str) -> None:
    module = _module(native_backend)
    dtype = np.dtype(np.float32) if kind == "int8" else np.dtype(kind if kind != "bfloat16" else ml_dtypes.bfloat16)
    args = _forward_args(dtype, kind == "int8")
    module.attention_forward(**args)
    assert float(np.abs(args["out"].astype(np.float32)).max()) > 0  # a result that could differ
    through = _forward_args(dtype, kind == "int8")
    module.attention_forward(**_as_capsules(through, FORMS[form]))
    np.testing.assert_array_equal(_bits(through["out"]), _bits(args["out"]))  # written through its capsule
    np.testing.assert_array_equal(through["lse"], args["lse"])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=str)
def test_backward_reads_capsules_as_the_arrays_they_describe(native_backend: str, dtype: np.dtype) -> None:
    module = _module(native_backend)
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 1, 4, 6, 8).astype(dtype), rand(rng, 1, 2, 7, 8).astype(dtype), rand(rng, 1, 2, 7, 5).astype(dtype)
    out, lse = np.zeros((1, 4, 6, 5), dtype), np.zeros((1, 4, 6), np.float32)
    module.attention_forward(q, k, v, out, scale=0.35, lse=lse, causal=True)
    dout = rand(rng, 1, 4, 6, 5).astype(dtype)

    def gradients(wrap: Any) -> list[np.ndarray]:
        grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
        module.attention_backward(*(wrap(a) for a in (q, k, v, out, dout, lse, *grads)), scale=0.35, causal=True)
        return grads

    want = gradients(lambda a: a)
    got = gradients(capsule)
    for w, g in zip(want, got):
        assert float(np.abs(w.astype(np.float32)).max()) > 0
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_packed_calls_read_capsules_as_the_arrays_they_describe(native_backend: str) -> None:
    module = _module(native_backend)
    rng = np.random.default_rng(10)
    # varlen: two sequences of 3 and 4 query rows over 5 and 6 keys
    q, k, v = rand(rng, 7, 4, 8), rand(rng, 11, 2, 8), rand(rng, 11, 2, 6)
    cu_q, cu_k = np.array([0, 3, 7], np.int64), np.array([0, 5, 11], np.int64)
    want, got = np.zeros((7, 4, 6), np.float32), np.zeros((7, 4, 6), np.float32)
    module.attention_varlen(q, k, v, want, cu_q, cu_k, scale=0.3, causal=True)
    module.attention_varlen(*(capsule(a) for a in (q, k, v, got, cu_q, cu_k)), scale=0.3, causal=True)
    np.testing.assert_array_equal(got, want)
    # paged: pages of 4 keys, the two sequences' pages in reverse order
    k_cache, v_cache = rand(rng, 6, 4, 2, 8), rand(rng, 6, 4, 2, 6)
    table = np.array([[5, 4], [3, 2]], np.int32)
    seq_lens = np.array([6, 7], np.int64)
    want, got = np.zeros((7, 4, 6), np.float32), np.zeros((7, 4, 6), np.float32)
    module.attention_paged(q, k_cache, v_cache, want, table, seq_lens, cu_q, scale=0.3, causal=True)
    module.attention_paged(*(capsule(a) for a in (q, k_cache, v_cache, got, table, seq_lens, cu_q)), scale=0.3, causal=True)
    np.testing.assert_array_equal(got, want)
    assert float(np.abs(want).max()) > 0


def test_numpy_capsules_are_read_too(native_backend: str) -> None:
    # NumPy's own exporter (ndarray.__dlpack__: a "dltensor" capsule, and where NumPy offers it,
    # a versioned one)
    module = _module(native_backend)
    args = _forward_args(np.dtype(np.float32), False)
    module.attention_forward(**args)
    exporters: list[Any] = [lambda a: a.__dlpack__()]
    try:
        np.zeros(1).__dlpack__(max_version=(1, 0))
        exporters.append(lambda a: a.__dlpack__(max_version=(1, 0)))
    except TypeError:  # NumPy < 2.1: no versioned capsules
        pass
    for export in exporters:
        through = _forward_args(np.dtype(np.float32), False)
        module.attention_forward(**{key: export(a) if isinstance(a, np.ndarray) else a for key, a in through.items()})
        np.testing.assert_array_equal(through["out"], args["out"])
        np.testing.assert_array_equal(through["lse"], args["lse"])


def test_torch_capsules_are_read_and_left_unconsumed(native_backend: str) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.dlpack import from_dlpack, to_dlpack

    module = _module(native_backend)
    rng = np.random.default_rng(12)
    q, k, v = (torch.from_numpy(rand(rng, *shape)).to(torch.bfloat16) for shape in ((1, 2, 3, 8), (1, 1, 4, 8), (1, 1, 4, 8)))
    want = np.zeros((1, 2, 3, 8), ml_dtypes.bfloat16)
    module.attention_forward(*(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for t in (q, k, v)), want, scale=0.5)
    out = torch.empty(1, 2, 3, 8, dtype=torch.bfloat16)
    capsules = [to_dlpack(t) for t in (q, k, v, out)]
    module.attention_forward(*capsules, scale=0.5)
    np.testing.assert_array_equal(out.view(torch.int16).numpy(), want.view(np.int16))
    # read, not consumed: the capsule still hands its tensor over, once
    assert torch.equal(from_dlpack(capsules[0]), q)
    with pytest.raises(TypeError, match=r'^q: expected a DLPack capsule named "dltensor" or "dltensor_versioned", '
                                        r'got a capsule named "used_dltensor" \(already consumed\)$'):
        module.attention_forward(*capsules, scale=0.5)


Q = np.zeros((1, 2, 3, 8), np.float32)
KV = np.zeros((1, 1, 4, 8), np.float32)
BAD_CAPSULES: list[tuple[str, str, dict[str, Any], type[Exception], str]] = [
    # (id, argument, capsule() keywords, exception, message)
    ("consumed", "q", {"name": b"used_dltensor"}, TypeError,
     'q: expected a DLPack capsule named "dltensor" or "dltensor_versioned", got a capsule named "used_dltensor" (already consumed)'),
    ("other-name", "k", {"name": b"arrow_array"}, TypeError,
     'k: expected a DLPack capsule named "dltensor" or "dltensor_versioned", got a capsule named "arrow_array"'),
    ("version-2", "v", {"name": b"dltensor_versioned", "version": (2, 1)}, TypeError,
     "v: expected a DLPack capsule of version 1, got version 2.1"),
    ("device-cuda", "q", {"device_type": 2}, ValueError,
     "q: twinattn runs on the CPU; expected a DLPack tensor on the CPU (device type 1), got device type 2"),
    ("lanes", "q", {"lanes": 2}, TypeError, "q: expected a DLPack tensor of a NumPy dtype, got type code 2 with 32 bits and 2 lanes"),
    ("float8", "k", {"code_bits": (2, 8)}, TypeError, "k: expected a DLPack tensor of a NumPy dtype, got type code 2 with 8 bits and 1 lanes"),
    ("float64", "q", {"code_bits": (2, 64)}, TypeError, "q: expected dtype float32, float16 or bfloat16, got float64"),
    ("int32-k", "k", {"code_bits": (0, 32)}, TypeError, "k: expected dtype float32 (q's dtype) or int8, got int32"),
    ("too-many-dims", "q", {"ndim": 33}, ValueError, "q: expected a DLPack tensor of at most 32 dimensions, got 33"),
    ("negative-extent", "v", {"shape": (1, 1, -4, 8)}, ValueError, "v: expected a DLPack tensor of extents >= 0, got -4 on axis 2"),
    ("read-only-out", "out", {"name": b"dltensor_versioned", "read_only": True}, ValueError,
     "out: expected a writeable array, got a read-only one"),
]


@pytest.mark.parametrize(("argument", "keywords", "error", "message"), [c[1:] for c in BAD_CAPSULES], ids=[c[0] for c in BAD_CAPSULES])
def test_a_capsule_that_cannot_be_read_gets_the_same_error_in_both_ports(
    native_backend: str, argument: str, keywords: dict[str, Any], error: type[Exception], message: str
) -> None:
    module = _module(native_backend)
    args: dict[str, Any] = dict(q=Q, k=KV, v=KV, out=np.zeros((1, 2, 3, 8), np.float32), scale=0.5)
    # (ndim 33: a rank checked before the shape, which holds 4 entries, is read)
    args[argument] = capsule(args[argument], **keywords)
    with pytest.raises(error) as raised:
        module.attention_forward(**args)
    assert str(raised.value) == message


def test_a_read_only_capsule_is_read_where_nothing_is_written(native_backend: str) -> None:
    module = _module(native_backend)
    rng = np.random.default_rng(13)
    q, k, v = rand(rng, 1, 2, 3, 8), rand(rng, 1, 1, 4, 8), rand(rng, 1, 1, 4, 8)
    want, got = np.zeros((1, 2, 3, 8), np.float32), np.zeros((1, 2, 3, 8), np.float32)
    module.attention_forward(q, k, v, want, scale=0.5)
    read_only = {"name": b"dltensor_versioned", "read_only": True}
    module.attention_forward(*(capsule(a, **read_only) for a in (q, k, v)), got, scale=0.5)
    np.testing.assert_array_equal(got, want)
