// twinattn._cpp: the Python face of the C++ port (docs/native_api.md). It only converts: NumPy
// arrays into an AttentionProblem without copying or casting (TypeError / ValueError when an
// argument cannot be viewed so), releases the GIL and calls the kernel, whose core checks the
// problem (check_problem). Twin of rust/src/python.rs: same steps, same messages.
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "twinattn/constants.hpp"
#include "twinattn/flash_attention.hpp"
#include "twinattn/flash_backward.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

#ifndef TWINATTN_VERSION
#define TWINATTN_VERSION "0.0.0"
#endif

namespace py = pybind11;
using namespace twinattn;

namespace {

std::string type_name(const py::handle& object) {
    return py::type::handle_of(object).attr("__name__").cast<std::string>();
}

// "(2, 3)", "(2,)", "()": Python's tuple notation.
std::string tuple_string(const py::ssize_t* values, py::ssize_t count) {
    std::string text = "(";
    for (py::ssize_t i = 0; i < count; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
    return text + (count == 1 ? ",)" : ")");
}

// Element: float32, float16 or bfloat16 (q); Like: like's dtype (v and out take q's);
// LikeOrInt8: like's dtype or int8 (k); Int8: int8 (v when k is int8, "k's dtype");
// LikeOrFloat32: like's dtype, or float32 when like's is float16 / bfloat16 (the backward's out:
// the forward's out32).
enum class Dtype { Float32, Int64, BoolOrFloat32, Element, Like, LikeOrInt8, Int8, LikeOrFloat32 };

std::string dtype_string(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

// NumPy's float16 and ml_dtypes.bfloat16 dtypes, made (imported) once, under the GIL
// (gil_safe_call_once_and_store: a plain function-local static can deadlock against it).
const py::dtype& float16_dtype() {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::dtype> stored;
    return stored.call_once_and_store_result([] { return py::dtype("float16"); }).get_stored();
}

const py::dtype& bfloat16_dtype() {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::dtype> stored;
    return stored
        .call_once_and_store_result([] { return py::dtype::from_args(py::module_::import("ml_dtypes").attr("bfloat16")); })
        .get_stored();
}

// The element type of q, k, v and out: float32, NumPy's float16, or ml_dtypes.bfloat16 (a user
// dtype without the buffer protocol, known by char 'E', name "bfloat16" and itemsize 2), in
// native byte order; false for anything else. ml_dtypes' own bfloat16 dtype object (the one its
// arrays share) is known by identity, without reading two attributes (about 0.3 us an array).
bool element_type_of(const py::dtype& dtype, ElementType* type) {
    if (dtype.equal(py::dtype::of<float>())) {  // equality also rejects non-native byte order
        *type = ElementType::Float32;
        return true;
    }
    if (dtype.equal(float16_dtype())) {
        *type = ElementType::Float16;
        return true;
    }
    if (dtype.char_() == 'E' && dtype.itemsize() == 2 &&
        (dtype.is(bfloat16_dtype()) ||
         (dtype.attr("isnative").cast<bool>() && dtype.attr("name").cast<std::string>() == "bfloat16"))) {
        *type = ElementType::BFloat16;
        return true;
    }
    return false;
}

// ---- DLPack capsules (docs/native_api.md, "DLPack capsules") -----------------------------------
// The DLPack ABI (dlpack.h, versions 0.x and 1.x), the fields read here. A capsule named
// "dltensor" holds a DLManagedTensor, one named "dltensor_versioned" a DLManagedTensorVersioned.
struct DLDevice {
    int32_t device_type;  // 1: kDLCPU
    int32_t device_id;
};
struct DLDataType {
    uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
    uint8_t bits;
    uint16_t lanes;
};
struct DLTensor {
    void* data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t* shape;
    int64_t* strides;  // in elements; null: row-major and compact
    uint64_t byte_offset;
};
struct DLManagedTensor {
    DLTensor dl_tensor;
    void* manager_ctx;
    void* deleter;  // never called here
};
struct DLPackVersion {
    uint32_t major;
    uint32_t minor;
};
struct DLManagedTensorVersioned {
    DLPackVersion version;
    void* manager_ctx;
    void* deleter;  // never called here
    uint64_t flags;  // bit 0: read-only
    DLTensor dl_tensor;
};
constexpr int32_t kDlCpu = 1;
constexpr uint64_t kDlReadOnlyFlag = 1;

// The NumPy dtype of a DLPack element type (ml_dtypes.bfloat16 for bfloat 16); None for one NumPy
// has not (vectors of lanes, float8, ...).
py::object numpy_dtype_of(const DLDataType& type) {
    if (type.lanes != 1) return py::none();
    const int bits = type.bits;
    switch (type.code) {
        case 0:
            return bits == 8 ? py::dtype::of<int8_t>() : bits == 16 ? py::dtype::of<int16_t>()
                 : bits == 32 ? py::dtype::of<int32_t>() : bits == 64 ? py::dtype::of<int64_t>() : py::object(py::none());
        case 1:
            return bits == 8 ? py::dtype::of<uint8_t>() : bits == 16 ? py::dtype::of<uint16_t>()
                 : bits == 32 ? py::dtype::of<uint32_t>() : bits == 64 ? py::dtype::of<uint64_t>() : py::object(py::none());
        case 2:
            return bits == 16 ? py::object(float16_dtype()) : bits == 32 ? py::dtype::of<float>()
                 : bits == 64 ? py::dtype::of<double>() : py::object(py::none());
        case 4:
            return bits == 16 ? py::object(bfloat16_dtype()) : py::object(py::none());
        case 5:
            return bits == 64 ? py::dtype("complex64") : bits == 128 ? py::dtype("complex128") : py::object(py::none());
        case 6:
            return bits == 8 ? py::dtype::of<bool>() : py::object(py::none());
        default:
            return py::none();
    }
}

// An ndarray viewing the tensor of a DLPack capsule, the capsule its base. The capsule is read, not
// consumed: it keeps its name, and its producer's tensor (which it owns) lives as long as the
// capsule, through the call that was handed it.
py::array dlpack_view(const py::handle& capsule, const char* name) {
    const char* capsule_name = PyCapsule_GetName(capsule.ptr());
    if (capsule_name == nullptr) throw py::error_already_set();
    const DLTensor* tensor = nullptr;
    bool read_only = false;
    if (std::strcmp(capsule_name, "dltensor") == 0) {
        const auto* managed = static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
        if (managed == nullptr) throw py::error_already_set();
        tensor = &managed->dl_tensor;
    } else if (std::strcmp(capsule_name, "dltensor_versioned") == 0) {
        const auto* managed = static_cast<const DLManagedTensorVersioned*>(
            PyCapsule_GetPointer(capsule.ptr(), "dltensor_versioned"));
        if (managed == nullptr) throw py::error_already_set();
        if (managed->version.major != 1)
            throw py::type_error(std::string(name) + ": expected a DLPack capsule of version 1, got version " +
                                 std::to_string(managed->version.major) + "." + std::to_string(managed->version.minor));
        tensor = &managed->dl_tensor;
        read_only = (managed->flags & kDlReadOnlyFlag) != 0;
    } else {
        throw py::type_error(std::string(name) + ": expected a DLPack capsule named \"dltensor\" or "
                             "\"dltensor_versioned\", got a capsule named \"" + capsule_name + "\"" +
                             (std::strncmp(capsule_name, "used_", 5) == 0 ? " (already consumed)" : ""));
    }
    if (tensor->device.device_type != kDlCpu)
        throw py::value_error(std::string(name) + ": twinattn runs on the CPU; expected a DLPack tensor on the CPU "
                              "(device type 1), got device type " + std::to_string(tensor->device.device_type));
    const py::object dtype_obj = numpy_dtype_of(tensor->dtype);
    if (dtype_obj.is_none())
        throw py::type_error(std::string(name) + ": expected a DLPack tensor of a NumPy dtype, got type code " +
                             std::to_string(tensor->dtype.code) + " with " + std::to_string(tensor->dtype.bits) +
                             " bits and " + std::to_string(tensor->dtype.lanes) + " lanes");
    if (tensor->ndim < 0 || tensor->ndim > 32)
        throw py::value_error(std::string(name) + ": expected a DLPack tensor of at most 32 dimensions, got " +
                              std::to_string(tensor->ndim));
    const auto dtype = py::reinterpret_borrow<py::dtype>(dtype_obj);
    const auto ndim = static_cast<size_t>(tensor->ndim);
    const auto item = static_cast<int64_t>(dtype.itemsize());
    std::vector<py::ssize_t> shape(ndim), strides(ndim);
    int64_t compact = item;  // a null strides pointer: row-major and compact
    for (size_t axis = ndim; axis-- > 0;) {
        if (tensor->shape[axis] < 0)
            throw py::value_error(std::string(name) + ": expected a DLPack tensor of extents >= 0, got " +
                                  std::to_string(tensor->shape[axis]) + " on axis " + std::to_string(axis));
        shape[axis] = tensor->shape[axis];
        strides[axis] = tensor->strides != nullptr ? tensor->strides[axis] * item : compact;
        compact *= std::max<int64_t>(tensor->shape[axis], 1);
    }
    char* data = static_cast<char*>(tensor->data) + tensor->byte_offset;
    // A base that is not an ndarray makes pybind11's view writeable: a read-only capsule's is not.
    py::array view(dtype, std::move(shape), std::move(strides), data, capsule);
    if (read_only) view.attr("flags").attr("writeable") = false;
    return view;
}

// The argument as an ndarray: itself, or the view of a DLPack capsule's tensor.
py::array ndarray_of(const py::handle& object, const char* name) {
    if (PyCapsule_CheckExact(object.ptr())) return dlpack_view(object, name);
    if (!py::isinstance<py::array>(object))
        throw py::type_error(std::string(name) + ": expected a numpy.ndarray, got " + type_name(object));
    return py::reinterpret_borrow<py::array>(object);
}

// The argument (an ndarray or a DLPack capsule) as an ndarray of the expected dtype and rank
// whose elements can be addressed by element strides (byte strides multiples of the item size,
// data aligned). Nothing is copied.
py::array as_array(const py::handle& object, const char* name, Dtype dtype, py::ssize_t ndim,
                   const char* axes, const py::array* like = nullptr) {
    const py::array a = ndarray_of(object, name);
    if (dtype == Dtype::LikeOrInt8) {
        if (!a.dtype().equal(like->dtype()) && !a.dtype().equal(py::dtype::of<int8_t>()))
            throw py::type_error(std::string(name) + ": expected dtype " + dtype_string(*like) +
                                 " (q's dtype) or int8, got " + dtype_string(a));
    } else if (dtype == Dtype::Int8) {
        if (!a.dtype().equal(py::dtype::of<int8_t>()))
            throw py::type_error(std::string(name) + ": expected dtype int8 (k's dtype), got " + dtype_string(a));
    } else if (dtype == Dtype::Element) {
        ElementType type;
        if (!element_type_of(a.dtype(), &type))
            throw py::type_error(std::string(name) + ": expected dtype float32, float16 or bfloat16, got " +
                                 dtype_string(a));
    } else if (dtype == Dtype::LikeOrFloat32 && !like->dtype().equal(py::dtype::of<float>())) {
        if (!a.dtype().equal(like->dtype()) && !a.dtype().equal(py::dtype::of<float>()))
            throw py::type_error(std::string(name) + ": expected dtype " + dtype_string(*like) +
                                 " (q's dtype) or float32 (the forward's out32), got " + dtype_string(a));
    } else if (dtype == Dtype::Like || dtype == Dtype::LikeOrFloat32) {
        if (!a.dtype().equal(like->dtype()))
            throw py::type_error(std::string(name) + ": expected dtype " + dtype_string(*like) +
                                 " (q's dtype), got " + dtype_string(a));
    } else {
        // dtype equality also rejects non-native byte order
        const bool is_float32 = a.dtype().equal(py::dtype::of<float>());
        const bool ok = dtype == Dtype::Float32 ? is_float32
                        : dtype == Dtype::Int64 ? a.dtype().equal(py::dtype::of<int64_t>())
                                                : is_float32 || a.dtype().equal(py::dtype::of<bool>());
        if (!ok) {
            const char* expected = dtype == Dtype::Float32 ? "float32"
                                   : dtype == Dtype::Int64 ? "int64"
                                                           : "bool or float32";
            throw py::type_error(std::string(name) + ": expected dtype " + expected + ", got " +
                                 dtype_string(a));
        }
    }
    if (a.ndim() != ndim)
        throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) +
                              " dimensions " + axes + ", got shape " + tuple_string(a.shape(), a.ndim()));
    if (a.size() == 0) return a;  // no element to address
    for (py::ssize_t axis = 0; axis < ndim; ++axis)
        if (a.strides(axis) % a.itemsize() != 0)
            throw py::value_error(std::string(name) + ": expected byte strides that are multiples of the item size " +
                                  std::to_string(a.itemsize()) + ", got strides " + tuple_string(a.strides(), ndim));
    if (reinterpret_cast<std::uintptr_t>(a.data()) % static_cast<std::uintptr_t>(a.itemsize()) != 0)
        throw py::value_error(std::string(name) + ": expected data aligned to its item size " +
                              std::to_string(a.itemsize()) + ", got a misaligned array");
    return a;
}

void require_writeable(const py::array& a, const char* name) {
    if (!a.writeable())
        throw py::value_error(std::string(name) + ": expected a writeable array, got a read-only one");
}

template <typename View, int Rank>
void fill_shape_strides(const py::array& a, View& view) {
    for (int axis = 0; axis < Rank; ++axis) {
        view.shape[axis] = a.shape(axis);
        view.stride[axis] = a.strides(axis) / a.itemsize();
    }
}

TensorView4 tensor_view(const py::array& a) {
    TensorView4 view{a.data(), {}, {}};
    fill_shape_strides<TensorView4, 4>(a, view);
    return view;
}

// A per-sequence int64 vector (q_offset, kv_lens) copied out (its length is the core's to
// check; the copy frees the kernel from its strides); None: `batch` copies of `fill`.
std::vector<int64_t> per_sequence(const py::handle& object, const char* name, int64_t batch, int64_t fill) {
    if (object.is_none()) return std::vector<int64_t>(static_cast<size_t>(batch), fill);
    const py::array a = as_array(object, name, Dtype::Int64, 1, "(B,)");
    std::vector<int64_t> values(static_cast<size_t>(a.shape(0)));
    const char* base = static_cast<const char*>(a.data());
    for (size_t i = 0; i < values.size(); ++i)
        std::memcpy(&values[i], base + static_cast<py::ssize_t>(i) * a.strides(0), sizeof(int64_t));
    return values;
}

// Python scalars, converted by hand so that both ports treat every type alike (a bool is not a
// number here).
bool as_bool(const py::handle& object, const char* name) {
    if (!PyBool_Check(object.ptr()))
        throw py::type_error(std::string(name) + ": expected a bool, got " + type_name(object));
    return object.ptr() == Py_True;
}

double as_float(const py::handle& object, const char* name) {
    const double value = PyBool_Check(object.ptr()) ? -1.0 : PyFloat_AsDouble(object.ptr());
    if (PyBool_Check(object.ptr()) || (value == -1.0 && PyErr_Occurred())) {
        PyErr_Clear();
        throw py::type_error(std::string(name) + ": expected a float, got " + type_name(object));
    }
    return value;
}

// Any int (operator.index), saturated to int64: the core then says what range it accepts.
int64_t as_int64(const py::handle& object, const char* name) {
    PyObject* index = PyBool_Check(object.ptr()) ? nullptr : PyNumber_Index(object.ptr());
    if (index == nullptr) {
        PyErr_Clear();
        throw py::type_error(std::string(name) + ": expected an int, got " + type_name(object));
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (overflow != 0) return overflow > 0 ? INT64_MAX : INT64_MIN;
    return value;
}

// A float32 parameter array (alibi_slopes, sinks, k_scale, v_scale) of rank N; None: not given.
template <typename View, int Rank>
View param_view(const py::handle& object, const char* name, const char* axes) {
    View view{};
    if (object.is_none()) return view;
    const py::array a = as_array(object, name, Dtype::Float32, Rank, axes);
    view.data = static_cast<const float*>(a.data());
    fill_shape_strides<View, Rank>(a, view);
    return view;
}

using Kernel = void (*)(const AttentionProblem&, int);

// The scalars and the variants' parameter arrays every entry takes, converted in this order:
// causal, scale, num_threads (returned), window_left, window_right, softcap, alibi_slopes, sinks.
int64_t convert_options(const py::handle& causal_obj, const py::handle& scale_obj, const py::handle& num_threads_obj,
                        const py::handle& window_left_obj, const py::handle& window_right_obj,
                        const py::handle& softcap_obj, const py::handle& alibi_slopes_obj, const py::handle& sinks_obj,
                        PackedOptions& options) {
    options.causal = !causal_obj.is_none() && as_bool(causal_obj, "causal");
    options.scale = static_cast<float>(as_float(scale_obj, "scale"));  // beyond float32: inf, rejected
    const int64_t num_threads = num_threads_obj.is_none() ? 1 : as_int64(num_threads_obj, "num_threads");
    options.window_left = window_left_obj.is_none() ? -1 : as_int64(window_left_obj, "window_left");
    options.window_right = window_right_obj.is_none() ? -1 : as_int64(window_right_obj, "window_right");
    options.softcap = softcap_obj.is_none() ? 0.0f : static_cast<float>(as_float(softcap_obj, "softcap"));  // likewise
    options.alibi_slopes = param_view<ParamView2, 2>(alibi_slopes_obj, "alibi_slopes", "(B, Hq)");
    options.sinks = param_view<ParamView1, 1>(sinks_obj, "sinks", "(Hq,)");
    return num_threads;
}

// The forward's arguments converted (run_kernel; attention_backward_py, whose out and lse are
// inputs): the problem, the per-sequence vectors its spans point into, and num_threads.
struct ConvertedProblem {
    AttentionProblem problem{};
    std::vector<int64_t> q_offset, kv_lens;
    int64_t num_threads = 1;
    bool out_float32 = false;  // out is float32 (the backward: the forward's out32 of a half q)
};

// Converts the forward's arguments into `converted` (not moved afterwards: the problem's spans
// point into it). outputs: out and lse are written (the forward: writeable), else read (the
// backward). Every keyword but scale may be None: its default.
void convert_problem(ConvertedProblem& converted, bool outputs, const py::handle& q_obj,
                     const py::handle& k_obj, const py::handle& v_obj, const py::handle& out_obj,
                     const py::handle& scale_obj, const py::handle& lse_obj,
                     const py::handle& q_offset_obj, const py::handle& kv_lens_obj,
                     const py::handle& mask_obj, const py::handle& causal_obj,
                     const py::handle& num_threads_obj, const py::handle& window_left_obj,
                     const py::handle& window_right_obj, const py::handle& softcap_obj,
                     const py::handle& alibi_slopes_obj, const py::handle& sinks_obj,
                     const py::handle& k_scale_obj, const py::handle& v_scale_obj) {
    // 1. Arrays, each whole (dtype, rank, strides, alignment) before the next: q, k, v and out
    // of q's dtype (float32, float16 or bfloat16), or k and v both int8 (docs/kernels.md,
    // "int8 K/V"); writeable outputs.
    const py::array q = as_array(q_obj, "q", Dtype::Element, 4, "(B, Hq, Lq, D)");
    const py::array k = as_array(k_obj, "k", Dtype::LikeOrInt8, 4, "(B, Hkv, Lk, D)", &q);
    const bool kv_int8 = k.dtype().equal(py::dtype::of<int8_t>());
    const py::array v = kv_int8 ? as_array(v_obj, "v", Dtype::Int8, 4, "(B, Hkv, Lk, Dv)")
                                : as_array(v_obj, "v", Dtype::Like, 4, "(B, Hkv, Lk, Dv)", &q);
    const py::array out = as_array(out_obj, "out", outputs ? Dtype::Like : Dtype::LikeOrFloat32, 4, "(B, Hq, Lq, Dv)", &q);
    if (outputs) require_writeable(out, "out");
    AttentionProblem& problem = converted.problem;
    element_type_of(q.dtype(), &problem.dtype);
    converted.out_float32 = out.dtype().equal(py::dtype::of<float>());
    problem.q = tensor_view(q);
    problem.k = tensor_view(k);
    problem.v = tensor_view(v);
    problem.out = MutTensorView4{const_cast<void*>(out.data()), {}, {}};  // read only when !outputs
    fill_shape_strides<MutTensorView4, 4>(out, problem.out);
    problem.kv_int8 = kv_int8;
    if (!lse_obj.is_none()) {
        const py::array lse = as_array(lse_obj, "lse", Dtype::Float32, 3, "(B, Hq, Lq)");
        if (outputs) require_writeable(lse, "lse");
        problem.lse.data = static_cast<float*>(const_cast<void*>(lse.data()));
        fill_shape_strides<LseView, 3>(lse, problem.lse);
    }
    if (!mask_obj.is_none()) {
        const py::array mask = as_array(mask_obj, "mask", Dtype::BoolOrFloat32, 4, "(B, Hq, Lq, Lk)");
        problem.mask.kind = mask.dtype().kind() == 'b' ? MaskKind::Bool : MaskKind::Float;
        problem.mask.data = mask.data();
        fill_shape_strides<MaskView, 4>(mask, problem.mask);
    }
    converted.q_offset = per_sequence(q_offset_obj, "q_offset", q.shape(0), 0);
    converted.kv_lens = per_sequence(kv_lens_obj, "kv_lens", q.shape(0), k.shape(2));
    problem.q_offset = converted.q_offset;
    problem.kv_lens = converted.kv_lens;

    // 2. Scalars; then the parameter arrays.
    PackedOptions options;
    converted.num_threads = convert_options(causal_obj, scale_obj, num_threads_obj, window_left_obj,
                                            window_right_obj, softcap_obj, alibi_slopes_obj, sinks_obj, options);
    problem.causal = options.causal;
    problem.scale = options.scale;
    problem.window_left = options.window_left;
    problem.window_right = options.window_right;
    problem.softcap = options.softcap;
    problem.alibi_slopes = options.alibi_slopes;
    problem.sinks = options.sinks;
    problem.k_scale = param_view<ParamView3, 3>(k_scale_obj, "k_scale", "(B, Hkv, Lk)");
    problem.v_scale = param_view<ParamView3, 3>(v_scale_obj, "v_scale", "(B, Hkv, Lk)");
}

// out32 (attention_forward, attention_reference): float32 (B, Hq, Lq, Dv), writeable, into
// problem.out32 (the core checks it against the problem); None: not requested.
void convert_out32(AttentionProblem& problem, const py::handle& out32_obj) {
    if (out32_obj.is_none()) return;
    py::array out32 = as_array(out32_obj, "out32", Dtype::Float32, 4, "(B, Hq, Lq, Dv)");
    require_writeable(out32, "out32");
    problem.out32 = MutTensorView4{out32.mutable_data(), {}, {}};
    fill_shape_strides<MutTensorView4, 4>(out32, problem.out32);
}

// Runs `compute` (which calls a kernel) without the GIL; the kernel checks its problem first,
// once per call. std::invalid_argument is ValueError, std::bad_alloc MemoryError.
template <typename Compute>
void run_without_gil(int64_t num_threads, const Compute& compute) {
    try {
        const int threads = check_num_threads(num_threads);
        py::gil_scoped_release release;
        compute(threads);
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    } catch (const std::bad_alloc&) {
        PyErr_SetString(PyExc_MemoryError, kOutOfMemoryMessage);
        throw py::error_already_set();
    }
}

// Converts the arguments into an AttentionProblem and runs `kernel` without the GIL; the kernel
// checks the problem first (check_problem: shapes against each other, lengths, ranges, scales
// required or not, overlaps), once per call.
void run_kernel(Kernel kernel, const py::handle& q_obj, const py::handle& k_obj,
                const py::handle& v_obj, const py::handle& out_obj, const py::handle& scale_obj,
                const py::handle& lse_obj, const py::handle& q_offset_obj,
                const py::handle& kv_lens_obj, const py::handle& mask_obj,
                const py::handle& causal_obj, const py::handle& num_threads_obj,
                const py::handle& window_left_obj, const py::handle& window_right_obj,
                const py::handle& softcap_obj, const py::handle& alibi_slopes_obj,
                const py::handle& sinks_obj, const py::handle& k_scale_obj,
                const py::handle& v_scale_obj, const py::handle& out32_obj) {
    ConvertedProblem converted;
    convert_problem(converted, true, q_obj, k_obj, v_obj, out_obj, scale_obj, lse_obj, q_offset_obj,
                    kv_lens_obj, mask_obj, causal_obj, num_threads_obj, window_left_obj,
                    window_right_obj, softcap_obj, alibi_slopes_obj, sinks_obj, k_scale_obj, v_scale_obj);
    convert_out32(converted.problem, out32_obj);
    run_without_gil(converted.num_threads, [&](int threads) { kernel(converted.problem, threads); });
}

// ---- attention_forward and attention_reference: their arguments matched by hand -------------
// pybind11's dispatcher matches each keyword parameter by making a str of its C name and looking
// it up in the call's kwargs: 15 lookups per call, about 1 us, which made the tiny case 18%
// slower than through Rust's PyO3. These two entries take (*args, **kwargs) and match each name
// given against their parameters' interned names (a call's keywords are interned too: one
// pointer comparison each), and say what does not fit in PyO3's words.
constexpr const char* kAttentionNames[] = {"q", "k", "v", "out", "scale", "lse", "q_offset", "kv_lens",
                                           "mask", "causal", "num_threads", "window_left", "window_right",
                                           "softcap", "alibi_slopes", "sinks", "k_scale", "v_scale", "out32"};
constexpr size_t kAttentionArgs = sizeof(kAttentionNames) / sizeof(kAttentionNames[0]);
constexpr size_t kAttentionPositional = 4;  // q, k, v, out (by position or name); scale required too
using AttentionArgs = std::array<py::handle, kAttentionArgs>;

// "'a'", "'a' and 'b'", "'a', 'b', and 'c'": PyO3's list of missing parameters.
std::string name_list(const std::vector<const char*>& names) {
    std::string text;
    for (size_t i = 0; i < names.size(); ++i) {
        if (i != 0) text += std::string(names.size() > 2 ? "," : "") + (i + 1 == names.size() ? " and " : " ");
        text += std::string("'") + names[i] + "'";
    }
    return text;
}

// The arguments of a call in signature order, None where not given; TypeError for a call that
// does not fit the signature.
AttentionArgs attention_arguments(const char* function, const py::args& args, const py::kwargs& kwargs) {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<std::array<py::object, kAttentionArgs>> interned;
    const auto& names = interned
                            .call_once_and_store_result([] {
                                std::array<py::object, kAttentionArgs> made;
                                for (size_t i = 0; i < kAttentionArgs; ++i)
                                    made[i] = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(kAttentionNames[i]));
                                return made;
                            })
                            .get_stored();
    AttentionArgs slots{};
    if (args.size() > kAttentionPositional)
        throw py::type_error(std::string(function) + "() takes " + std::to_string(kAttentionPositional) +
                             " positional arguments but " + std::to_string(args.size()) + " were given");
    for (size_t i = 0; i < args.size(); ++i) slots[i] = args[i];
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(kwargs.ptr(), &position, &key, &value)) {
        size_t index = kAttentionArgs;
        for (size_t i = 0; i < kAttentionArgs && index == kAttentionArgs; ++i)
            if (key == names[i].ptr()) index = i;
        for (size_t i = 0; i < kAttentionArgs && index == kAttentionArgs; ++i)  // a str not interned
            if (PyUnicode_Check(key) && PyUnicode_Compare(key, names[i].ptr()) == 0) index = i;
        if (index == kAttentionArgs)
            throw py::type_error(std::string(function) + "() got an unexpected keyword argument '" +
                                 py::str(key).cast<std::string>() + "'");
        if (slots[index])
            throw py::type_error(std::string(function) + "() got multiple values for argument '" + kAttentionNames[index] + "'");
        slots[index] = value;
    }
    std::vector<const char*> missing;
    for (size_t i = 0; i < kAttentionPositional; ++i)
        if (!slots[i]) missing.push_back(kAttentionNames[i]);
    if (!missing.empty())
        throw py::type_error(std::string(function) + "() missing " + std::to_string(missing.size()) + " required positional argument" +
                             (missing.size() > 1 ? "s" : "") + ": " + name_list(missing));
    if (!slots[kAttentionPositional])
        throw py::type_error(std::string(function) + "() missing 1 required keyword argument: 'scale'");
    for (py::handle& slot : slots)
        if (!slot) slot = py::none();
    return slots;
}

// attention_forward (the fast kernel with the instruction set in use, docs/kernels.md) and
// attention_reference (the plain scalar reference kernel, which every fast path is tested
// against): the same arguments, handed to run_kernel with another kernel.
template <Kernel kernel>
void attention_py(const char* function, const py::args& args, const py::kwargs& kwargs) {
    const AttentionArgs a = attention_arguments(function, args, kwargs);
    run_kernel(kernel, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
               a[14], a[15], a[16], a[17], a[18]);
}

// attention_backward (docs/native_api.md): the forward's arguments (its out and lse now inputs,
// lse required; out of q's dtype, or float32 for float16 / bfloat16: the forward's out32), dout,
// the gradients dq, dk, dv (q's dtype) and dsinks (float32, (Hq,)), written in place, and dlse
// (float32, (B, Hq, Lq)). Conversion order: the forward's arguments as the forward converts them,
// then dout, dq, dk, dv, dsinks and dlse; then the core's checks (check_backward).
void attention_backward_py(const py::object& q, const py::object& k, const py::object& v,
                           const py::object& out, const py::object& dout_obj, const py::object& lse,
                           const py::object& dq_obj, const py::object& dk_obj, const py::object& dv_obj,
                           const py::object& scale, const py::object& q_offset, const py::object& kv_lens,
                           const py::object& mask, const py::object& causal, const py::object& num_threads,
                           const py::object& window_left, const py::object& window_right,
                           const py::object& softcap, const py::object& alibi_slopes,
                           const py::object& sinks, const py::object& dsinks_obj, const py::object& dlse_obj) {
    ConvertedProblem converted;
    convert_problem(converted, false, q, k, v, out, scale, lse, q_offset, kv_lens, mask, causal, num_threads,
                    window_left, window_right, softcap, alibi_slopes, sinks, py::none(), py::none());
    BackwardProblem problem{};
    problem.forward = converted.problem;
    const py::array q_array = ndarray_of(q, "q");  // converted above: the backward's arrays take its dtype
    problem.dout = tensor_view(as_array(dout_obj, "dout", Dtype::Like, 4, "(B, Hq, Lq, Dv)", &q_array));
    const std::pair<const char*, MutTensorView4*> gradients[] = {
        {"dq", &problem.dq}, {"dk", &problem.dk}, {"dv", &problem.dv}};
    const char* const axes[] = {"(B, Hq, Lq, D)", "(B, Hkv, Lk, D)", "(B, Hkv, Lk, Dv)"};
    const py::handle handles[] = {dq_obj, dk_obj, dv_obj};
    for (int index = 0; index < 3; ++index) {
        py::array gradient = as_array(handles[index], gradients[index].first, Dtype::Like, 4, axes[index], &q_array);
        require_writeable(gradient, gradients[index].first);
        *gradients[index].second = MutTensorView4{gradient.mutable_data(), {}, {}};
        fill_shape_strides<MutTensorView4, 4>(gradient, *gradients[index].second);
    }
    if (!dsinks_obj.is_none()) {
        py::array dsinks = as_array(dsinks_obj, "dsinks", Dtype::Float32, 1, "(Hq,)");
        require_writeable(dsinks, "dsinks");
        problem.dsinks = MutParamView1{static_cast<float*>(dsinks.mutable_data()), {}, {}};
        fill_shape_strides<MutParamView1, 1>(dsinks, problem.dsinks);
    }
    problem.out_float32 = problem.forward.dtype != ElementType::Float32 && converted.out_float32;
    problem.dlse = param_view<ParamView3, 3>(dlse_obj, "dlse", "(B, Hq, Lq)");
    run_without_gil(converted.num_threads, [&](int threads) { attention_backward(problem, threads); });
}

// ---- attention_varlen and attention_paged (docs/native_api.md) --------------------------------

template <typename View>
View view3(const py::array& a) {
    View view{nullptr, {}, {}};
    fill_shape_strides<View, 3>(a, view);
    return view;
}

// q (total_q, Hq, D) of float32, float16 or bfloat16; k and v `k_axes` / `v_axes` of rank
// `kv_rank`, q's dtype or both int8; out (total_q, Hq, Dv) writeable; each whole before the next.
struct PackedArrays {
    py::array q, k, v, out;
    bool kv_int8;
};

PackedArrays packed_arrays(const py::handle& q_obj, const py::handle& k_obj, const py::handle& v_obj,
                           const py::handle& out_obj, const char* k_name, const char* v_name, py::ssize_t kv_rank,
                           const char* k_axes, const char* v_axes) {
    PackedArrays arrays;
    arrays.q = as_array(q_obj, "q", Dtype::Element, 3, "(total_q, Hq, D)");
    arrays.k = as_array(k_obj, k_name, Dtype::LikeOrInt8, kv_rank, k_axes, &arrays.q);
    arrays.kv_int8 = arrays.k.dtype().equal(py::dtype::of<int8_t>());
    arrays.v = arrays.kv_int8 ? as_array(v_obj, v_name, Dtype::Int8, kv_rank, v_axes)
                              : as_array(v_obj, v_name, Dtype::Like, kv_rank, v_axes, &arrays.q);
    arrays.out = as_array(out_obj, "out", Dtype::Like, 3, "(total_q, Hq, Dv)", &arrays.q);
    require_writeable(arrays.out, "out");
    return arrays;
}

// lse (Hq, total_q), writeable, float32; None: not requested.
LseView2 packed_lse(const py::handle& lse_obj) {
    LseView2 view{nullptr, {0, 0}, {0, 0}};
    if (lse_obj.is_none()) return view;
    py::array lse = as_array(lse_obj, "lse", Dtype::Float32, 2, "(Hq, total_q)");
    require_writeable(lse, "lse");
    view.data = static_cast<float*>(lse.mutable_data());
    fill_shape_strides<LseView2, 2>(lse, view);
    return view;
}

// The options (convert_options, after the arrays) with the arrays' dtype; returns num_threads.
int64_t packed_options(const PackedArrays& arrays, const py::handle& scale_obj, const py::handle& causal_obj,
                       const py::handle& num_threads_obj, const py::handle& window_left_obj,
                       const py::handle& window_right_obj, const py::handle& softcap_obj,
                       const py::handle& alibi_slopes_obj, const py::handle& sinks_obj, PackedOptions& options) {
    const int64_t num_threads = convert_options(causal_obj, scale_obj, num_threads_obj, window_left_obj,
                                                window_right_obj, softcap_obj, alibi_slopes_obj, sinks_obj, options);
    element_type_of(arrays.q.dtype(), &options.dtype);
    options.kv_int8 = arrays.kv_int8;
    return num_threads;
}

// q and out of a packed problem.
template <typename Problem>
void packed_rows(PackedArrays& arrays, Problem& problem) {
    problem.q = view3<TensorView3>(arrays.q);
    problem.q.data = arrays.q.data();
    problem.out = view3<MutTensorView3>(arrays.out);
    problem.out.data = arrays.out.mutable_data();
}

// cu_seqlens_q, cu_seqlens_k, seq_lens: int64 (any stride), copied out (per_sequence).
std::vector<int64_t> int64_vector(const py::handle& object, const char* name, const char* axes) {
    if (object.is_none()) throw py::type_error(std::string(name) + ": expected a numpy.ndarray, got NoneType");
    const py::array a = as_array(object, name, Dtype::Int64, 1, axes);
    return per_sequence(a, name, 0, 0);
}

void attention_varlen_py(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                         const py::object& out_obj, const py::object& cu_seqlens_q_obj,
                         const py::object& cu_seqlens_k_obj, const py::object& scale_obj, const py::object& lse_obj,
                         const py::object& causal_obj, const py::object& num_threads_obj,
                         const py::object& window_left_obj, const py::object& window_right_obj,
                         const py::object& softcap_obj, const py::object& alibi_slopes_obj,
                         const py::object& sinks_obj, const py::object& k_scale_obj, const py::object& v_scale_obj) {
    // 1. Arrays; 2. scalars and parameter arrays; 3. the kernel (its core checks the problem).
    PackedArrays arrays = packed_arrays(q_obj, k_obj, v_obj, out_obj, "k", "v", 3, "(total_k, Hkv, D)",
                                        "(total_k, Hkv, Dv)");
    VarlenProblem problem{};
    packed_rows(arrays, problem);
    problem.lse = packed_lse(lse_obj);
    problem.k = view3<TensorView3>(arrays.k);
    problem.k.data = arrays.k.data();
    problem.v = view3<TensorView3>(arrays.v);
    problem.v.data = arrays.v.data();
    const std::vector<int64_t> cu_seqlens_q = int64_vector(cu_seqlens_q_obj, "cu_seqlens_q", "(B + 1,)");
    const std::vector<int64_t> cu_seqlens_k = int64_vector(cu_seqlens_k_obj, "cu_seqlens_k", "(B + 1,)");
    problem.cu_seqlens_q = cu_seqlens_q;
    problem.cu_seqlens_k = cu_seqlens_k;
    const int64_t num_threads = packed_options(arrays, scale_obj, causal_obj, num_threads_obj, window_left_obj,
                                               window_right_obj, softcap_obj, alibi_slopes_obj, sinks_obj,
                                               problem.options);
    problem.k_scale = param_view<ParamView2, 2>(k_scale_obj, "k_scale", "(total_k, Hkv)");
    problem.v_scale = param_view<ParamView2, 2>(v_scale_obj, "v_scale", "(total_k, Hkv)");
    run_without_gil(num_threads, [&](int threads) { attention_varlen(problem, threads); });
}

void attention_paged_py(const py::object& q_obj, const py::object& k_cache_obj, const py::object& v_cache_obj,
                        const py::object& out_obj, const py::object& block_table_obj,
                        const py::object& seq_lens_obj, const py::object& cu_seqlens_q_obj,
                        const py::object& scale_obj, const py::object& lse_obj, const py::object& causal_obj,
                        const py::object& num_threads_obj, const py::object& window_left_obj,
                        const py::object& window_right_obj, const py::object& softcap_obj,
                        const py::object& alibi_slopes_obj, const py::object& sinks_obj,
                        const py::object& k_scale_obj, const py::object& v_scale_obj) {
    PackedArrays arrays =
        packed_arrays(q_obj, k_cache_obj, v_cache_obj, out_obj, "k_cache", "v_cache", 4,
                      "(num_blocks, block_size, Hkv, D)", "(num_blocks, block_size, Hkv, Dv)");
    PagedProblem problem{};
    packed_rows(arrays, problem);
    problem.lse = packed_lse(lse_obj);
    problem.k_cache = tensor_view(arrays.k);
    problem.v_cache = tensor_view(arrays.v);
    const py::array table = ndarray_of(block_table_obj, "block_table");
    if (!table.dtype().equal(py::dtype::of<int32_t>()))
        throw py::type_error("block_table: expected dtype int32, got " + dtype_string(table));
    if (table.ndim() != 2)
        throw py::value_error("block_table: expected 2 dimensions (B, max_blocks), got shape " +
                              tuple_string(table.shape(), table.ndim()));
    for (py::ssize_t axis = 0; axis < 2 && table.size() > 0; ++axis)
        if (table.strides(axis) % 4 != 0 || reinterpret_cast<std::uintptr_t>(table.data()) % 4 != 0)
            throw py::value_error("block_table: expected byte strides that are multiples of the item size 4 and "
                                  "aligned data, got strides " + tuple_string(table.strides(), 2));
    problem.block_table = BlockTableView{static_cast<const int32_t*>(table.data()), {}, {}};
    fill_shape_strides<BlockTableView, 2>(table, problem.block_table);
    const std::vector<int64_t> seq_lens = int64_vector(seq_lens_obj, "seq_lens", "(B,)");
    const std::vector<int64_t> cu_seqlens_q = int64_vector(cu_seqlens_q_obj, "cu_seqlens_q", "(B + 1,)");
    problem.seq_lens = seq_lens;
    problem.cu_seqlens_q = cu_seqlens_q;
    const int64_t num_threads = packed_options(arrays, scale_obj, causal_obj, num_threads_obj, window_left_obj,
                                               window_right_obj, softcap_obj, alibi_slopes_obj, sinks_obj,
                                               problem.options);
    problem.k_scale = param_view<ParamView3, 3>(k_scale_obj, "k_scale", "(num_blocks, block_size, Hkv)");
    problem.v_scale = param_view<ParamView3, 3>(v_scale_obj, "v_scale", "(num_blocks, block_size, Hkv)");
    run_without_gil(num_threads, [&](int threads) { attention_paged(problem, threads); });
}

// tanh of a float32 vector (any stride) with the fast kernel's vectorised tanh (softcap) and the
// instruction set in use, into a new array: the kernel's own code, for tests.
py::array softcap_tanh_py(const py::object& x_obj) {
    const py::array x = as_array(x_obj, "x", Dtype::Float32, 1, "(n,)");
    const py::ssize_t n = x.shape(0);
    py::array_t<float> y(n);
    try {
        twinattn::softcap_tanh(static_cast<const float*>(x.data()), n > 0 ? x.strides(0) / 4 : 0,
                               y.mutable_data(), n);
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    } catch (const std::bad_alloc&) {
        PyErr_SetString(PyExc_MemoryError, kOutOfMemoryMessage);
        throw py::error_already_set();
    }
    return y;
}

void set_isa_py(const py::object& name) {
    if (!PyUnicode_Check(name.ptr()))
        throw py::type_error("name: expected a str, got " + type_name(name));
    try {
        twinattn::set_isa(name.cast<std::string>());
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    }
}

// The arithmetic peak for the benchmark (measure_peak.cpp). Conversion order: kind (a str),
// num_threads (an int), seconds (a float; > 0 and at most 1e6, said with Python's repr), then the
// core's checks (kind known, kind runnable here, num_threads >= 1): ValueError.
double measure_peak_py(const py::object& kind, const py::object& num_threads_obj, const py::object& seconds_obj) {
    if (!PyUnicode_Check(kind.ptr())) throw py::type_error("kind: expected a str, got " + type_name(kind));
    const int64_t num_threads = as_int64(num_threads_obj, "num_threads");
    const double seconds = as_float(seconds_obj, "seconds");
    if (!(seconds > 0.0 && seconds <= 1e6))
        throw py::value_error("seconds: expected a number > 0 and <= 1e6, got " +
                              py::repr(py::float_(seconds)).cast<std::string>());
    try {
        const std::string name = kind.cast<std::string>();
        py::gil_scoped_release release;
        return twinattn::measure_peak(name, num_threads, seconds);
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    }
}

std::string compiler_name() {
#if defined(__clang__)
    return std::string("Clang ") + __clang_version__;
#elif defined(__GNUC__)
    return std::string("GCC ") + __VERSION__;
#elif defined(_MSC_VER)
    return "MSVC " + std::to_string(_MSC_VER);
#else
    return "unknown";
#endif
}

py::dict build_info() {
    py::dict info;
    info["isa"] = current_isa();
    py::list available;
    for (const std::string& name : available_isas()) available.append(name);
    info["isa_available"] = available;
    info["compiler"] = compiler_name();
    info["version"] = TWINATTN_VERSION;
    // bfloat16's path with the instruction set in use ("dot" or "convert"), the instruction set
    // chosen at first use, and the measurement that chose it (None where none was needed).
    info["isa_default"] = default_isa();
    info["bfloat16_path"] = bfloat16_path();
    const std::optional<double> ratio = bf16dot_over_fma32();
    info["bf16dot_over_fma32"] = ratio ? py::object(py::float_(*ratio)) : py::object(py::none());
    // Every shared constant (constants.hpp), keyed as the Rust constants lowercased.
    py::dict constants;
    constants["q_tile_rows"] = kQTileRows;
    constants["micro_rows"] = kMicroRows;
    constants["key_block"] = kKeyBlock;
    constants["key_panel"] = kKeyPanel;
    constants["split_key_chunk"] = kSplitKeyChunk;
    constants["prefill_pack_bytes"] = kPrefillPackBytes;
    constants["pool_spin_microseconds"] = kPoolSpinMicroseconds;
    constants["serial_work"] = kSerialWork;
    constants["direct_score_rows"] = kDirectScoreRows;
    constants["decode_prefetch_bytes"] = kDecodePrefetchBytes;
    constants["decode_near_prefetch_bytes"] = kDecodeNearPrefetchBytes;
    constants["score_prefetch_bytes"] = kScorePrefetchBytes;
    constants["value_key_chunk"] = kValueKeyChunk;
    constants["value_panel"] = kValuePanel;
    constants["backward_key_block"] = kBackwardKeyBlock;
    constants["backward_tile_rows"] = kBackwardTileRows;
    constants["backward_tile_group"] = kBackwardTileGroup;
    constants["backward_chunk_tiles"] = kBackwardChunkTiles;
    constants["avx512_score_vectors"] = kAvx512ScoreVectors;
    constants["avx512_value_vectors"] = kAvx512ValueVectors;
    constants["avx2_score_vectors"] = kAvx2ScoreVectors;
    constants["avx2_value_vectors"] = kAvx2ValueVectors;
    constants["neon_score_vectors"] = kNeonScoreVectors;
    constants["neon_value_vectors"] = kNeonValueVectors;
    constants["scalar_width"] = kScalarWidth;
    constants["scalar_score_vectors"] = kScalarScoreVectors;
    constants["scalar_value_vectors"] = kScalarValueVectors;
    constants["avx512_direct_strip_rows"] = kAvx512DirectStripRows;
    constants["avx2_direct_strip_rows"] = kAvx2DirectStripRows;
    constants["neon_direct_strip_rows"] = kNeonDirectStripRows;
    constants["scalar_direct_strip_rows"] = kScalarDirectStripRows;
    constants["exp2_degree"] = kExp2Degree;
    py::list coefficients;
    for (float c : kExp2Coefficients) coefficients.append(static_cast<double>(c));
    constants["exp2_coefficients"] = coefficients;
    constants["exp2_min"] = static_cast<double>(kExp2Min);
    constants["log2_e"] = static_cast<double>(kLog2E);
    constants["ln2"] = static_cast<double>(kLn2);
    constants["tanh_degree"] = kTanhDegree;
    py::list tanh_coefficients;
    for (float c : kTanhCoefficients) tanh_coefficients.append(static_cast<double>(c));
    constants["tanh_coefficients"] = tanh_coefficients;
    constants["tanh_small"] = static_cast<double>(kTanhSmall);
    constants["bf16_dot_min_ratio"] = kBf16DotMinRatio;
    constants["bf16_choice_rounds"] = kBf16ChoiceRounds;
    constants["bf16_choice_instructions"] = kBf16ChoiceInstructions;
    info["constants"] = constants;
    return info;
}

}  // namespace

PYBIND11_MODULE(_cpp, m) {
    m.doc() = "twinattn's C++ port (private; use the twinattn package).";
    // TWINATTN_ISA naming an instruction set this build or CPU cannot run fails the import:
    // pybind11 raises the std::invalid_argument as ImportError with its message, as Rust does.
    init_isa_from_environment();
    // attention_forward and attention_reference: the same arguments (attention_py, matched by
    // attention_arguments), another kernel. q, k, v and out positional, the rest keyword-only;
    // every keyword but scale defaults to None (its default: no lse, q_offset 0, kv_lens Lk, no
    // mask, not causal, one thread, no window, no softcap, no ALiBi, no sinks, no scales, no out32).
    // The docstrings give the signature (pybind11's would be (*args, **kwargs)).
    {
        py::options options;
        options.disable_function_signatures();
        const char* const signature =
            "(q, k, v, out, *, scale, lse=None, q_offset=None, kv_lens=None, mask=None, causal=None, "
            "num_threads=None, window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None, "
            "k_scale=None, v_scale=None, out32=None) -> None\n\n";
        static const std::string forward_doc = std::string("attention_forward") + signature +
            "Exact scaled-dot-product attention into out (and lse) with the fast kernel and the instruction set in "
            "use; see docs/native_api.md.";
        static const std::string reference_doc = std::string("attention_reference") + signature +
            "attention_forward computed by the plain scalar reference kernel (for tests).";
        m.def("attention_forward", [](const py::args& args, const py::kwargs& kwargs) {
            attention_py<&twinattn::attention_forward>("attention_forward", args, kwargs);
        }, forward_doc.c_str());
        m.def("attention_reference", [](const py::args& args, const py::kwargs& kwargs) {
            attention_py<&twinattn::attention_reference>("attention_reference", args, kwargs);
        }, reference_doc.c_str());
    }
    m.def("attention_backward", &attention_backward_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("dout"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::kw_only(),
          py::arg("scale"), py::arg("q_offset") = py::none(), py::arg("kv_lens") = py::none(),
          py::arg("mask") = py::none(), py::arg("causal") = py::none(), py::arg("num_threads") = py::none(),
          py::arg("window_left") = py::none(), py::arg("window_right") = py::none(),
          py::arg("softcap") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
          py::arg("dsinks") = py::none(), py::arg("dlse") = py::none(),
          "The gradients of attention_forward with respect to q, k, v (and sinks: dsinks) from dout, "
          "the forward's out and lse, written into dq, dk, dv (and dsinks); see docs/native_api.md.");
    // attention_varlen and attention_paged: packed query rows, keys packed alike or in pages.
    m.def("attention_varlen", &attention_varlen_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::kw_only(), py::arg("scale"),
          py::arg("lse") = py::none(), py::arg("causal") = py::none(), py::arg("num_threads") = py::none(),
          py::arg("window_left") = py::none(), py::arg("window_right") = py::none(),
          py::arg("softcap") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
          py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
          "Attention over sequences packed one after another (flash-attn's varlen layout) into out "
          "(and lse); see docs/native_api.md.");
    m.def("attention_paged", &attention_paged_py, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("out"), py::arg("block_table"), py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::kw_only(),
          py::arg("scale"), py::arg("lse") = py::none(), py::arg("causal") = py::none(),
          py::arg("num_threads") = py::none(), py::arg("window_left") = py::none(),
          py::arg("window_right") = py::none(), py::arg("softcap") = py::none(),
          py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("k_scale") = py::none(),
          py::arg("v_scale") = py::none(),
          "Attention of packed query rows over keys and values in a paged cache (block table) into "
          "out (and lse); see docs/native_api.md.");
    m.def("set_isa", &set_isa_py, py::arg("name"),
          "Switches the instruction set among build_info()['isa_available']; ValueError otherwise.");
    m.def("softcap_tanh", &softcap_tanh_py, py::arg("x"),
          "tanh of a float32 vector with the fast kernel's vectorised tanh (softcap), for tests.");
    m.def("measure_peak", &measure_peak_py, py::arg("kind"), py::arg("num_threads"), py::arg("seconds"),
          "GFLOP/s of a register-resident loop of independent 'fma32' (AVX-512 / AVX2 FMA), "
          "'bf16dot' (VDPBF16PS) or 'bf16tile' (AMX TDPBF16PS) operations on num_threads threads for "
          "about `seconds`.");
    m.def("build_info", &build_info,
          "Instruction set in use, those available, compiler and version of this build.");
}
