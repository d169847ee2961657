// check_problem: everything the kernels rely on, checked once per call, so that no kernel can
// read or write out of bounds (or race on an output) whatever its caller passes. Twin of
// rust/src/problem.rs: the same checks in the same order (docs/native_api.md lists them).
#include "twinattn/problem.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace twinattn {
namespace {

[[noreturn]] void reject(const std::string& message) { throw std::invalid_argument(message); }

std::string shape_string(const int64_t* shape, int rank) {
    std::ostringstream text;
    text << "(";
    for (int axis = 0; axis < rank; ++axis) text << (axis ? ", " : "") << shape[axis];
    text << (rank == 1 ? ",)" : ")");
    return text.str();
}

// "name=value" when the dimension is already fixed by an earlier argument, else just "name".
struct Dim {
    const char* name;
    int64_t value;  // < 0: free (this argument defines it)
};

std::string dim_string(const Dim& dim) {
    return dim.value < 0 ? dim.name : std::string(dim.name) + "=" + std::to_string(dim.value);
}

void check_shape(const char* argument, const int64_t* shape, const Dim* expected, int rank) {
    bool ok = true;
    for (int axis = 0; axis < rank; ++axis) {
        if (shape[axis] < 0 || (expected[axis].value >= 0 && shape[axis] != expected[axis].value))
            ok = false;
    }
    if (ok) return;
    std::string wanted = "(";
    for (int axis = 0; axis < rank; ++axis)
        wanted += (axis ? ", " : "") + dim_string(expected[axis]);
    wanted += rank == 1 ? ",)" : ")";
    reject(std::string(argument) + ": expected shape " + wanted + ", got " +
         shape_string(shape, rank));
}

int64_t element_count(const int64_t* shape, int rank) {
    int64_t count = 1;
    for (int axis = 0; axis < rank; ++axis) count *= shape[axis];
    return count;
}

void check_data(const char* argument, const void* data, const int64_t* shape, int rank) {
    if (data == nullptr && element_count(shape, rank) != 0)
        reject(std::string(argument) + ": expected data for a non-empty array of shape " +
             shape_string(shape, rank) + ", got a null pointer");
}

void check_unit_last_stride(const char* argument, const char* axis_name, const int64_t* shape,
                            const int64_t* stride) {
    // An empty array has no element to read, so its strides do not matter (NumPy may give 0).
    if (shape[3] > 1 && stride[3] != 1 && element_count(shape, 4) != 0)
        reject(std::string(argument) + ": expected unit stride on the last axis (" + axis_name +
             "=" + std::to_string(shape[3]) + "), got stride " + std::to_string(stride[3]) +
             " elements");
}

// 128-bit arithmetic (GCC and Clang): the strides of an as_strided view may be anything.
__extension__ typedef __int128 int128;

// Byte addresses [lowest, end) that a strided view's elements occupy; empty views occupy none.
struct Extent {
    bool empty;
    int128 lowest, end;
};

Extent byte_extent(const void* data, const int64_t* shape, const int64_t* stride, int rank,
              int64_t item) {
    if (element_count(shape, rank) == 0) return Extent{true, 0, 0};
    int128 lowest = static_cast<int128>(reinterpret_cast<std::uintptr_t>(data));
    int128 highest = lowest;
    for (int axis = 0; axis < rank; ++axis) {
        const int128 reach = static_cast<int128>(shape[axis] - 1) * stride[axis] * item;
        (reach < 0 ? lowest : highest) += reach;
    }
    return Extent{false, lowest, highest + item};
}

bool extents_overlap(const Extent& a, const Extent& b) {
    return !a.empty && !b.empty && a.lowest < b.end && b.lowest < a.end;
}

// Whether two distinct indices of a view may address the same element. Sufficient test: sorted
// by |stride|, each axis of length > 1 must step past everything the smaller axes reach (exotic
// interleaved layouts that do not overlap are reported too; outputs never need them).
bool may_overlap_itself(const int64_t* shape, const int64_t* stride, int rank) {
    if (element_count(shape, rank) == 0) return false;
    std::pair<int128, int128> axes[4];  // (|stride|, length), sorted as they come (insertion)
    int count = 0;
    for (int axis = 0; axis < rank && axis < 4; ++axis) {
        if (shape[axis] <= 1) continue;
        const std::pair<int128, int128> next{
            stride[axis] < 0 ? -static_cast<int128>(stride[axis]) : stride[axis], shape[axis]};
        int at = count++;
        for (; at > 0 && next < axes[at - 1]; --at) axes[at] = axes[at - 1];
        axes[at] = next;
    }
    int128 reach = 0;  // the largest offset the smaller axes reach, in elements
    for (int axis = 0; axis < count; ++axis) {
        if (axes[axis].first <= reach) return true;
        reach += (axes[axis].second - 1) * axes[axis].first;
    }
    return false;
}

void check_distinct_elements(const char* argument, const int64_t* shape, const int64_t* stride,
                             int rank) {
    if (may_overlap_itself(shape, stride, rank))
        reject(std::string(argument) + ": expected elements that do not overlap each other, got strides " +
             shape_string(stride, rank));
}

// A float as std::to_chars writes it: the shortest digits that read back as the same float
// ("-1.2345678", "-3e+38", "inf", "nan").
std::string float_string(float value) {
    char text[32];
    return std::string(text, std::to_chars(text, text + sizeof text, value).ptr);
}

// Every element of a float32 vector (rank 1) or matrix (rank 2) finite; names the first that is
// not, e.g. "sinks: expected finite values, got sinks[3]=nan".
void check_finite_values(const char* argument, const float* data, const int64_t* shape,
                         const int64_t* stride, int rank) {
    const int64_t rows = rank == 2 ? shape[0] : 1, columns = shape[rank - 1];
    for (int64_t row = 0; row < rows; ++row)
        for (int64_t column = 0; column < columns; ++column) {
            const float value =
                data[(rank == 2 ? row * stride[0] : 0) + column * stride[rank - 1]];
            if (std::isfinite(value)) continue;
            const std::string index = rank == 2 ? std::to_string(row) + ", " + std::to_string(column)
                                                : std::to_string(column);
            reject(std::string(argument) + ": expected finite values, got " + argument + "[" + index +
                 "]=" + float_string(value));
        }
}

// The dtype's name as NumPy prints it.
const char* element_name(ElementType dtype) {
    return dtype == ElementType::Float32 ? "float32" : dtype == ElementType::Float16 ? "float16" : "bfloat16";
}

// The byte extents of the arrays a forward call reads (lse last: an output of the forward, an
// input of the backward), in the order the overlap messages name them.
constexpr size_t kProblemInputs = 9;

std::array<std::pair<const char*, Extent>, kProblemInputs> problem_extents(const AttentionProblem& p) {
    const int64_t item = element_size(p.dtype);  // q and out
    const int64_t kv_item = p.kv_int8 ? 1 : item;  // k and v
    const Extent mask = p.mask.kind == MaskKind::None
                            ? Extent{true, 0, 0}
                            : byte_extent(p.mask.data, p.mask.shape, p.mask.stride, 4,
                                     p.mask.kind == MaskKind::Float ? 4 : 1);
    return {{
        {"q", byte_extent(p.q.data, p.q.shape, p.q.stride, 4, item)},
        {"k", byte_extent(p.k.data, p.k.shape, p.k.stride, 4, kv_item)},
        {"v", byte_extent(p.v.data, p.v.shape, p.v.stride, 4, kv_item)},
        {"mask", mask},
        {"alibi_slopes", p.alibi_slopes.data != nullptr
                             ? byte_extent(p.alibi_slopes.data, p.alibi_slopes.shape,
                                      p.alibi_slopes.stride, 2, 4)
                             : Extent{true, 0, 0}},
        {"sinks", p.sinks.data != nullptr
                      ? byte_extent(p.sinks.data, p.sinks.shape, p.sinks.stride, 1, 4)
                      : Extent{true, 0, 0}},
        {"k_scale", p.k_scale.data != nullptr
                        ? byte_extent(p.k_scale.data, p.k_scale.shape, p.k_scale.stride, 3, 4)
                        : Extent{true, 0, 0}},
        {"v_scale", p.v_scale.data != nullptr
                        ? byte_extent(p.v_scale.data, p.v_scale.shape, p.v_scale.stride, 3, 4)
                        : Extent{true, 0, 0}},
        {"lse", p.lse.is_requested() ? byte_extent(p.lse.data, p.lse.shape, p.lse.stride, 3, 4)
                                     : Extent{true, 0, 0}}}};
}

}  // namespace

// The order of the checks is the same in problem.rs.
void check_problem(const AttentionProblem& p) {
    // 1. Shapes: q defines B, Hq, Lq, D; k defines Hkv, Lk; v defines Dv.
    const Dim free_b{"B", -1}, free_hq{"Hq", -1}, free_lq{"Lq", -1}, free_d{"D", -1};
    const Dim q_dims[4] = {free_b, free_hq, free_lq, free_d};
    check_shape("q", p.q.shape, q_dims, 4);
    const int64_t batch = p.q.shape[0], q_heads = p.q.shape[1], q_len = p.q.shape[2];
    const Dim b{"B", batch}, hq{"Hq", q_heads}, lq{"Lq", q_len}, d{"D", p.q.shape[3]};

    const Dim k_dims[4] = {b, {"Hkv", -1}, {"Lk", -1}, d};
    check_shape("k", p.k.shape, k_dims, 4);
    const int64_t kv_heads = p.k.shape[1], key_len = p.k.shape[2];
    const Dim hkv{"Hkv", kv_heads}, lk{"Lk", key_len};

    const Dim v_dims[4] = {b, hkv, lk, {"Dv", -1}};
    check_shape("v", p.v.shape, v_dims, 4);
    const Dim dv{"Dv", p.v.shape[3]};

    const Dim out_dims[4] = {b, hq, lq, dv};
    check_shape("out", p.out.shape, out_dims, 4);

    if (p.lse.is_requested()) {
        const Dim lse_dims[3] = {b, hq, lq};
        check_shape("lse", p.lse.shape, lse_dims, 3);
    }
    if (p.mask.kind != MaskKind::None) {
        const Dim mask_dims[4] = {b, hq, lq, lk};
        check_shape("mask", p.mask.shape, mask_dims, 4);
    }

    // 2. Grouped-query heads: query head h reads KV head h / (Hq / Hkv).
    if (q_heads > 0 && (kv_heads == 0 || q_heads % kv_heads != 0))
        reject("k: expected Hkv dividing Hq=" + std::to_string(q_heads) +
             " (query head h reads KV head h // (Hq // Hkv)), got Hkv=" + std::to_string(kv_heads));

    // 3. Memory: data present when non-empty, unit stride on the feature axes.
    check_data("q", p.q.data, p.q.shape, 4);
    check_data("k", p.k.data, p.k.shape, 4);
    check_data("v", p.v.data, p.v.shape, 4);
    check_data("out", p.out.data, p.out.shape, 4);
    if (p.mask.kind != MaskKind::None) check_data("mask", p.mask.data, p.mask.shape, 4);
    check_unit_last_stride("q", "D", p.q.shape, p.q.stride);
    check_unit_last_stride("k", "D", p.k.shape, p.k.stride);
    check_unit_last_stride("v", "Dv", p.v.shape, p.v.stride);
    check_unit_last_stride("out", "Dv", p.out.shape, p.out.stride);

    // 4. Per-sequence lengths and positions: B entries each.
    const std::pair<const char*, const Int64Span*> per_sequence[] = {{"q_offset", &p.q_offset},
                                                                     {"kv_lens", &p.kv_lens}};
    for (const auto& values : per_sequence) {
        if (values.second->size != batch)
            reject(std::string(values.first) + ": expected shape (B=" + std::to_string(batch) +
                 ",), got (" + std::to_string(values.second->size) + ",)");
        // A Rust slice cannot be null; a C++ pointer can.
        check_data(values.first, values.second->data, &values.second->size, 1);
    }
    for (int64_t seq = 0; seq < batch; ++seq)
        if (p.kv_lens[seq] < 0 || p.kv_lens[seq] > key_len)
            reject("kv_lens: expected values in [0, Lk=" + std::to_string(key_len) + "], got kv_lens[" +
                 std::to_string(seq) + "]=" + std::to_string(p.kv_lens[seq]));
    for (int64_t seq = 0; p.causal && seq < batch; ++seq)
        if (p.q_offset[seq] < 0)
            reject("q_offset: expected values >= 0 when causal, got q_offset[" + std::to_string(seq) +
                 "]=" + std::to_string(p.q_offset[seq]));

    // 5. Scale.
    if (!std::isfinite(p.scale))
        reject("scale: expected a finite number, got " + float_string(p.scale));

    // 6. Variants: window sides, softcap, ALiBi slopes (B, Hq) and sinks (Hq,), all finite.
    if (p.window_left < -1)
        reject("window_left: expected an int >= -1 (-1: unbounded), got " +
             std::to_string(p.window_left));
    if (p.window_right < -1)
        reject("window_right: expected an int >= -1 (-1: unbounded), got " +
             std::to_string(p.window_right));
    if (!std::isfinite(p.softcap) || p.softcap < 0.0f)
        reject("softcap: expected a finite number >= 0 (0: off), got " + float_string(p.softcap));
    if (p.alibi_slopes.data != nullptr) {
        const Dim slope_dims[2] = {b, hq};
        check_shape("alibi_slopes", p.alibi_slopes.shape, slope_dims, 2);
        check_finite_values("alibi_slopes", p.alibi_slopes.data, p.alibi_slopes.shape,
                            p.alibi_slopes.stride, 2);
    }
    if (p.sinks.data != nullptr) {
        const Dim sink_dims[1] = {hq};
        check_shape("sinks", p.sinks.shape, sink_dims, 1);
        check_finite_values("sinks", p.sinks.data, p.sinks.shape, p.sinks.stride, 1);
    }
    // int8 K/V: both scales (B, Hkv, Lk), any values (a NaN scale acts like a NaN in K or V).
    const Dim scale_dims[3] = {b, {"Hkv", kv_heads}, {"Lk", key_len}};
    const std::pair<const char*, const ParamView3*> scales[] = {{"k_scale", &p.k_scale},
                                                                {"v_scale", &p.v_scale}};
    for (const auto& scale : scales) {
        if (p.kv_int8 && scale.second->data == nullptr)
            reject(std::string(scale.first) +
                 ": required with int8 k and v (float32, shape (B, Hkv, Lk)), got None");
        if (!p.kv_int8 && scale.second->data != nullptr)
            reject(std::string(scale.first) + ": expected None with " + element_name(p.dtype) +
                 " k and v (scales are only for int8), got an array");
        if (scale.second->data != nullptr) check_shape(scale.first, scale.second->shape, scale_dims, 3);
    }

    // 7. Outputs: every element written once, by one thread, never read as input.
    check_distinct_elements("out", p.out.shape, p.out.stride, 4);
    if (p.lse.is_requested()) check_distinct_elements("lse", p.lse.shape, p.lse.stride, 3);
    const std::array<std::pair<const char*, Extent>, kProblemInputs> inputs = problem_extents(p);
    const Extent out = byte_extent(p.out.data, p.out.shape, p.out.stride, 4, element_size(p.dtype));
    const std::pair<const char*, Extent> outputs[] = {{"out", out}, {"lse", inputs[kProblemInputs - 1].second}};
    for (const auto& output : outputs)
        for (const auto& input : inputs)
            if (std::strcmp(input.first, output.first) != 0 && extents_overlap(output.second, input.second))
                reject(std::string(output.first) + ": expected memory disjoint from " + input.first +
                     ", got arrays that overlap");
}

// The order of the checks is the same in problem.rs.
void check_backward(const BackwardProblem& bp) {
    const AttentionProblem& p = bp.forward;
    // 1. The forward part: float keys and values, lse given, then check_problem's checks.
    if (p.kv_int8) reject("k: expected q's dtype, got int8 (int8 keys and values carry no gradient)");
    if (!p.lse.is_requested())
        reject("lse: required (the forward's lse, float32, shape (B, Hq, Lq)), got None");
    check_problem(p);

    // 2. Shapes: dout as out, dq as q, dk as k, dv as v.
    const Dim b{"B", p.q.shape[0]}, hq{"Hq", p.q.shape[1]}, lq{"Lq", p.q.shape[2]}, d{"D", p.q.shape[3]};
    const Dim hkv{"Hkv", p.k.shape[1]}, lk{"Lk", p.k.shape[2]}, dv{"Dv", p.v.shape[3]};
    const Dim dout_dims[4] = {b, hq, lq, dv}, dq_dims[4] = {b, hq, lq, d};
    const Dim dk_dims[4] = {b, hkv, lk, d}, dv_dims[4] = {b, hkv, lk, dv};
    check_shape("dout", bp.dout.shape, dout_dims, 4);
    check_shape("dq", bp.dq.shape, dq_dims, 4);
    check_shape("dk", bp.dk.shape, dk_dims, 4);
    check_shape("dv", bp.dv.shape, dv_dims, 4);

    // 3. Memory: data present when non-empty, unit stride on the feature axes.
    check_data("dout", bp.dout.data, bp.dout.shape, 4);
    check_data("dq", bp.dq.data, bp.dq.shape, 4);
    check_data("dk", bp.dk.data, bp.dk.shape, 4);
    check_data("dv", bp.dv.data, bp.dv.shape, 4);
    check_unit_last_stride("dout", "Dv", bp.dout.shape, bp.dout.stride);
    check_unit_last_stride("dq", "D", bp.dq.shape, bp.dq.stride);
    check_unit_last_stride("dk", "D", bp.dk.shape, bp.dk.stride);
    check_unit_last_stride("dv", "Dv", bp.dv.shape, bp.dv.stride);

    // 4. dsinks: the sinks' gradient, (Hq,), only with sinks.
    const bool has_dsinks = bp.dsinks.data != nullptr;
    if (has_dsinks && p.sinks.data == nullptr)
        reject("dsinks: expected None without sinks (it is the sinks' gradient), got an array");
    if (has_dsinks) {
        const Dim dsink_dims[1] = {hq};
        check_shape("dsinks", bp.dsinks.shape, dsink_dims, 1);
    }

    // 5. Gradients: every element written once, by one thread, never read as input.
    check_distinct_elements("dq", bp.dq.shape, bp.dq.stride, 4);
    check_distinct_elements("dk", bp.dk.shape, bp.dk.stride, 4);
    check_distinct_elements("dv", bp.dv.shape, bp.dv.stride, 4);
    if (has_dsinks) check_distinct_elements("dsinks", bp.dsinks.shape, bp.dsinks.stride, 1);
    const int64_t item = element_size(p.dtype);
    const std::array<std::pair<const char*, Extent>, kProblemInputs> forward_inputs = problem_extents(p);
    std::vector<std::pair<const char*, Extent>> inputs(forward_inputs.begin(), forward_inputs.end());
    inputs.push_back({"out", byte_extent(p.out.data, p.out.shape, p.out.stride, 4, item)});
    inputs.push_back({"dout", byte_extent(bp.dout.data, bp.dout.shape, bp.dout.stride, 4, item)});
    const std::pair<const char*, Extent> outputs[] = {
        {"dq", byte_extent(bp.dq.data, bp.dq.shape, bp.dq.stride, 4, item)},
        {"dk", byte_extent(bp.dk.data, bp.dk.shape, bp.dk.stride, 4, item)},
        {"dv", byte_extent(bp.dv.data, bp.dv.shape, bp.dv.stride, 4, item)},
        {"dsinks", has_dsinks ? byte_extent(bp.dsinks.data, bp.dsinks.shape, bp.dsinks.stride, 1, 4)
                              : Extent{true, 0, 0}}};
    for (const auto& output : outputs) {
        for (const auto& input : inputs)
            if (extents_overlap(output.second, input.second))
                reject(std::string(output.first) + ": expected memory disjoint from " + input.first +
                     ", got arrays that overlap");
        for (const auto& other : outputs)
            if (&other < &output && extents_overlap(output.second, other.second))
                reject(std::string(output.first) + ": expected memory disjoint from " + other.first +
                     ", got arrays that overlap");
    }
}

int64_t element_size(ElementType dtype) { return dtype == ElementType::Float32 ? 4 : 2; }

int check_num_threads(int64_t num_threads) {
    if (num_threads < 1)
        reject("num_threads: expected an int >= 1, got " + std::to_string(num_threads));
    return static_cast<int>(std::min<int64_t>(num_threads, std::numeric_limits<int>::max()));
}

const char* const kOutOfMemoryMessage =
    "out of memory: the kernel's scratch buffers for this call could not be allocated";

TensorView4 contiguous_view(const float* data, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    return TensorView4{data, {d0, d1, d2, d3}, {d1 * d2 * d3, d2 * d3, d3, 1}};
}

MutTensorView4 contiguous_mut_view(float* data, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    return MutTensorView4{data, {d0, d1, d2, d3}, {d1 * d2 * d3, d2 * d3, d3, 1}};
}

LseView contiguous_lse_view(float* data, int64_t d0, int64_t d1, int64_t d2) {
    return LseView{data, {d0, d1, d2}, {d1 * d2, d2, 1}};
}

}  // namespace twinattn
