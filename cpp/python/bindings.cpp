// twinattn._cpp: the Python face of the C++ port (docs/native_api.md). Thin on purpose: it
// checks and converts NumPy arrays into an AttentionProblem without copying or casting,
// releases the GIL and calls the kernel. The algorithm lives in cpp/src/.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "twinattn/constants.hpp"
#include "twinattn/flash_attention.hpp"
#include "twinattn/problem.hpp"
#include "twinattn/reference_kernel.hpp"

#ifndef TWINATTN_VERSION
#define TWINATTN_VERSION "0.0.0"
#endif

namespace py = pybind11;
using namespace twinattn;

namespace {

std::string str(const py::handle& object) { return py::str(object).cast<std::string>(); }

std::string shape_of(const py::array& array) {
    std::string text = "(";
    for (py::ssize_t axis = 0; axis < array.ndim(); ++axis)
        text += (axis ? ", " : "") + std::to_string(array.shape(axis));
    return text + (array.ndim() == 1 ? ",)" : ")");
}

// The argument as an ndarray, never converted: lists and other objects raise TypeError.
py::array as_ndarray(const py::handle& object, const char* name) {
    if (!py::isinstance<py::array>(object))
        throw py::type_error(std::string(name) + ": expected a numpy.ndarray, got " +
                             str(py::type::handle_of(object).attr("__name__")));
    return py::reinterpret_borrow<py::array>(object);
}

// Exact dtype matches: dtype equality also rejects non-native byte order.
bool is_float32(const py::array& a) { return a.dtype().equal(py::dtype::of<float>()); }
bool is_int64(const py::array& a) { return a.dtype().equal(py::dtype::of<int64_t>()); }
bool is_bool(const py::array& a) { return a.dtype().kind() == 'b'; }

void require_dtype(const py::array& a, bool ok, const char* name, const char* expected) {
    if (!ok)
        throw py::type_error(std::string(name) + ": expected dtype " + expected + ", got " +
                             str(a.dtype()));
}

// Rank, whole-element byte strides and aligned data, so element strides are exact.
void require_layout(const py::array& a, const char* name, py::ssize_t ndim, const char* axes) {
    if (a.ndim() != ndim)
        throw py::value_error(std::string(name) + ": expected ndim " + std::to_string(ndim) +
                              " " + axes + ", got ndim " + std::to_string(a.ndim()) +
                              " with shape " + shape_of(a));
    for (py::ssize_t axis = 0; axis < ndim; ++axis)
        if (a.size() > 0 && a.strides(axis) % a.itemsize() != 0)
            throw py::value_error(std::string(name) + ": expected byte strides that are multiples of the item size " +
                                  std::to_string(a.itemsize()) + ", got " +
                                  std::to_string(a.strides(axis)) + " on axis " + std::to_string(axis));
    if (a.size() > 0 && reinterpret_cast<std::uintptr_t>(a.data()) % a.itemsize() != 0)
        throw py::value_error(std::string(name) + ": expected data aligned to its item size " +
                              std::to_string(a.itemsize()) + ", got a misaligned array");
}

void require_writeable(const py::array& a, const char* name) {
    if (!a.writeable())
        throw py::value_error(std::string(name) + ": expected a writeable array, got a read-only one");
}

// [lowest byte, highest byte] that an array's elements occupy; empty arrays occupy none.
struct ByteExtent {
    bool empty;
    std::uintptr_t lowest, highest;
};

ByteExtent byte_extent(const py::array& a) {
    if (a.size() == 0) return ByteExtent{true, 0, 0};
    std::intptr_t low = 0, high = 0;
    for (py::ssize_t axis = 0; axis < a.ndim(); ++axis) {
        const std::intptr_t span = static_cast<std::intptr_t>(a.strides(axis)) * (a.shape(axis) - 1);
        (span < 0 ? low : high) += span;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(a.data());
    return ByteExtent{false, base + low, base + high + static_cast<std::uintptr_t>(a.itemsize()) - 1};
}

void require_disjoint(const py::array& written, const char* written_name, const py::array& other,
                      const char* other_name) {
    const ByteExtent w = byte_extent(written), o = byte_extent(other);
    if (!w.empty && !o.empty && w.lowest <= o.highest && o.lowest <= w.highest)
        throw py::value_error(std::string(written_name) + ": expected memory disjoint from " +
                              other_name + ", got arrays that overlap");
}

template <typename View, int Rank>
void fill_shape_strides(const py::array& a, View& view) {
    for (int axis = 0; axis < Rank; ++axis) {
        view.shape[axis] = a.shape(axis);
        view.stride[axis] = a.strides(axis) / a.itemsize();
    }
}

TensorView4 tensor_view(const py::array& a) {
    TensorView4 view{static_cast<const float*>(a.data()), {}, {}};
    fill_shape_strides<TensorView4, 4>(a, view);
    return view;
}

// A (B,) int64 array copied out (it is tiny, and the copy frees the kernel from its strides).
std::vector<int64_t> int64_per_sequence(const py::handle& object, const char* name, int64_t batch) {
    const py::array a = as_ndarray(object, name);
    require_dtype(a, is_int64(a), name, "int64");
    require_layout(a, name, 1, "(B,)");
    if (a.shape(0) != batch)
        throw py::value_error(std::string(name) + ": expected shape (B=" + std::to_string(batch) +
                              ",), got " + shape_of(a));
    std::vector<int64_t> values(static_cast<size_t>(batch));
    const char* base = static_cast<const char*>(a.data());
    for (int64_t b = 0; b < batch; ++b) std::memcpy(&values[b], base + b * a.strides(0), sizeof(int64_t));
    return values;
}

using Kernel = void (*)(const AttentionProblem&, int);

// Checks and converts the arguments, then runs `kernel` without the GIL.
void run_attention(Kernel kernel, const py::object& q_obj, const py::object& k_obj, const py::object& v_obj,
                       const py::object& out_obj, const py::object& lse_obj,
                       const py::object& q_offset_obj, const py::object& kv_lens_obj,
                       const py::object& mask_obj, bool causal, double scale, int num_threads) {
    // 1. Arrays, dtypes and layouts; nothing is converted or copied.
    const py::array q = as_ndarray(q_obj, "q"), k = as_ndarray(k_obj, "k"), v = as_ndarray(v_obj, "v");
    py::array out = as_ndarray(out_obj, "out");
    require_dtype(q, is_float32(q), "q", "float32");
    require_dtype(k, is_float32(k), "k", "float32");
    require_dtype(v, is_float32(v), "v", "float32");
    require_dtype(out, is_float32(out), "out", "float32");
    require_layout(q, "q", 4, "(B, Hq, Lq, D)");
    require_layout(k, "k", 4, "(B, Hkv, Lk, D)");
    require_layout(v, "v", 4, "(B, Hkv, Lk, Dv)");
    require_layout(out, "out", 4, "(B, Hq, Lq, Dv)");
    require_writeable(out, "out");

    py::array lse;
    const bool has_lse = !lse_obj.is_none();
    if (has_lse) {
        lse = as_ndarray(lse_obj, "lse");
        require_dtype(lse, is_float32(lse), "lse", "float32");
        require_layout(lse, "lse", 3, "(B, Hq, Lq)");
        require_writeable(lse, "lse");
    }

    py::array mask;
    MaskKind mask_kind = MaskKind::None;
    const bool has_mask = !mask_obj.is_none();
    if (has_mask) {
        mask = as_ndarray(mask_obj, "mask");
        mask_kind = is_bool(mask) ? MaskKind::Bool : is_float32(mask) ? MaskKind::Float : MaskKind::None;
        require_dtype(mask, mask_kind != MaskKind::None, "mask",
                      "bool (True = may attend) or float32 (additive bias)");
        require_layout(mask, "mask", 4, "(B, Hq, Lq, Lk)");
        const py::ssize_t expected[4] = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
        for (int axis = 0; axis < 4; ++axis)
            if (mask.shape(axis) != expected[axis])
                throw py::value_error("mask: expected shape (B=" + std::to_string(expected[0]) +
                                      ", Hq=" + std::to_string(expected[1]) + ", Lq=" +
                                      std::to_string(expected[2]) + ", Lk=" +
                                      std::to_string(expected[3]) + "), got " + shape_of(mask));
    }

    const std::vector<int64_t> q_offset = int64_per_sequence(q_offset_obj, "q_offset", q.shape(0));
    const std::vector<int64_t> kv_lens = int64_per_sequence(kv_lens_obj, "kv_lens", q.shape(0));

    // 2. What is written must not alias what is read (nor each other).
    const std::pair<const py::array*, const char*> inputs[] = {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&mask, "mask"}};
    for (const auto& input : inputs) {
        if (input.first == &mask && !has_mask) continue;
        require_disjoint(out, "out", *input.first, input.second);
        if (has_lse) require_disjoint(lse, "lse", *input.first, input.second);
    }
    if (has_lse) require_disjoint(out, "out", lse, "lse");

    if (num_threads < 1)
        throw py::value_error("num_threads: expected >= 1, got " + std::to_string(num_threads));

    // 3. The problem, checked by the core before the GIL is released.
    AttentionProblem problem{};
    problem.q = tensor_view(q);
    problem.k = tensor_view(k);
    problem.v = tensor_view(v);
    problem.out = MutTensorView4{static_cast<float*>(out.mutable_data()), {}, {}};
    fill_shape_strides<MutTensorView4, 4>(out, problem.out);
    problem.lse = LseView{nullptr, {0, 0, 0}, {0, 0, 0}};
    if (has_lse) {
        problem.lse.data = static_cast<float*>(lse.mutable_data());
        fill_shape_strides<LseView, 3>(lse, problem.lse);
    }
    problem.mask = MaskView{mask_kind, has_mask ? mask.data() : nullptr, {0, 0, 0, 0}};
    if (has_mask)
        for (int axis = 0; axis < 4; ++axis) problem.mask.stride[axis] = mask.strides(axis) / mask.itemsize();
    problem.q_offset = q_offset.data();
    problem.kv_lens = kv_lens.data();
    problem.causal = causal;
    problem.scale = static_cast<float>(scale);  // out of float range becomes inf: rejected

    // std::invalid_argument -> ValueError (pybind11 maps it too; this makes it explicit).
    try {
        check_problem(problem);
        py::gil_scoped_release release;
        kernel(problem, num_threads);
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    }
}

// The fast kernel with the instruction set in use (docs/kernels.md).
void attention_forward_py(const py::object& q, const py::object& k, const py::object& v,
                          const py::object& out, const py::object& lse, const py::object& q_offset,
                          const py::object& kv_lens, const py::object& mask, bool causal,
                          double scale, int num_threads) {
    run_attention(&twinattn::attention_forward, q, k, v, out, lse, q_offset, kv_lens, mask, causal,
                  scale, num_threads);
}

// The plain scalar reference kernel, which every fast path is tested against.
void attention_reference_py(const py::object& q, const py::object& k, const py::object& v,
                            const py::object& out, const py::object& lse, const py::object& q_offset,
                            const py::object& kv_lens, const py::object& mask, bool causal,
                            double scale, int num_threads) {
    run_attention(&twinattn::attention_reference, q, k, v, out, lse, q_offset, kv_lens, mask,
                  causal, scale, num_threads);
}

void set_isa_py(const std::string& name) {
    try {
        twinattn::set_isa(name);
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
    // Every shared constant (constants.hpp), keyed as the Rust constants lowercased.
    py::dict constants;
    constants["q_tile_rows"] = kQTileRows;
    constants["micro_rows"] = kMicroRows;
    constants["key_block"] = kKeyBlock;
    constants["key_panel"] = kKeyPanel;
    constants["split_key_chunk"] = kSplitKeyChunk;
    constants["pool_spin_microseconds"] = kPoolSpinMicroseconds;
    constants["direct_score_rows"] = kDirectScoreRows;
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
    info["constants"] = constants;
    return info;
}

}  // namespace

PYBIND11_MODULE(_cpp, m) {
    m.doc() = "twinattn's C++ port (private; use the twinattn package).";
    // TWINATTN_ISA naming an instruction set this build or CPU cannot run fails the import.
    try {
        init_isa_from_environment();
    } catch (const std::invalid_argument& error) {
        throw py::value_error(error.what());
    }
    m.def("attention_forward", &attention_forward_py, py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("out"), py::arg("lse"), py::arg("q_offset"), py::arg("kv_lens"), py::arg("mask"),
          py::arg("causal"), py::arg("scale"), py::arg("num_threads"),
          "Exact scaled-dot-product attention into out (and lse) with the fast kernel and the "
          "instruction set in use; see docs/native_api.md.");
    m.def("attention_reference", &attention_reference_py, py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("out"), py::arg("lse"), py::arg("q_offset"), py::arg("kv_lens"), py::arg("mask"),
          py::arg("causal"), py::arg("scale"), py::arg("num_threads"),
          "attention_forward computed by the plain scalar reference kernel (for tests).");
    m.def("set_isa", &set_isa_py, py::arg("name"),
          "Switches the instruction set among build_info()['isa_available']; ValueError otherwise.");
    m.def("build_info", &build_info,
          "Instruction set in use, those available, compiler and version of this build.");
}
