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
                            const int64_t* stride, int rank = 4) {
    // An empty array has no element to read, so its strides do not matter (NumPy may give 0).
    if (shape[rank - 1] > 1 && stride[rank - 1] != 1 && element_count(shape, rank) != 0)
        reject(std::string(argument) + ": expected unit stride on the last axis (" + axis_name +
             "=" + std::to_string(shape[rank - 1]) + "), got stride " + std::to_string(stride[rank - 1]) +
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

// Step 2 of every problem: query head h reads KV head h / (Hq / Hkv).
void check_group(const char* argument, int64_t q_heads, int64_t kv_heads) {
    if (q_heads > 0 && (kv_heads == 0 || q_heads % kv_heads != 0))
        reject(std::string(argument) + ": expected Hkv dividing Hq=" + std::to_string(q_heads) +
             " (query head h reads KV head h // (Hq // Hkv)), got Hkv=" + std::to_string(kv_heads));
}

// Step 6 of every problem: window sides, softcap, ALiBi slopes (B, Hq) and sinks (Hq,), all finite.
void check_variants(int64_t window_left, int64_t window_right, float softcap, const ParamView2& alibi_slopes,
                    const ParamView1& sinks, const Dim& b, const Dim& hq) {
    if (window_left < -1)
        reject("window_left: expected an int >= -1 (-1: unbounded), got " + std::to_string(window_left));
    if (window_right < -1)
        reject("window_right: expected an int >= -1 (-1: unbounded), got " + std::to_string(window_right));
    if (!std::isfinite(softcap) || softcap < 0.0f)
        reject("softcap: expected a finite number >= 0 (0: off), got " + float_string(softcap));
    if (alibi_slopes.data != nullptr) {
        const Dim slope_dims[2] = {b, hq};
        check_shape("alibi_slopes", alibi_slopes.shape, slope_dims, 2);
        check_finite_values("alibi_slopes", alibi_slopes.data, alibi_slopes.shape, alibi_slopes.stride, 2);
    }
    if (sinks.data != nullptr) {
        const Dim sink_dims[1] = {hq};
        check_shape("sinks", sinks.shape, sink_dims, 1);
        check_finite_values("sinks", sinks.data, sinks.shape, sinks.stride, 1);
    }
}

// An int8 scale (k_scale, v_scale) is given exactly when k and v are int8; `shape` names its axes.
void check_scale_given(const char* argument, bool given, bool kv_int8, ElementType dtype, const char* shape) {
    if (kv_int8 && !given)
        reject(std::string(argument) + ": required with int8 k and v (float32, shape " + shape + "), got None");
    if (!kv_int8 && given)
        reject(std::string(argument) + ": expected None with " + element_name(dtype) +
             " k and v (scales are only for int8), got an array");
}

// Step 7's last part: out and lse disjoint from every input (and from each other).
void check_outputs_disjoint(const Extent& out, const Extent& lse,
                            const std::pair<const char*, Extent>* inputs, size_t count) {
    const std::pair<const char*, Extent> outputs[] = {{"out", out}, {"lse", lse}};
    for (const auto& output : outputs)
        for (size_t input = 0; input < count; ++input)
            if (std::strcmp(inputs[input].first, output.first) != 0 &&
                extents_overlap(output.second, inputs[input].second))
                reject(std::string(output.first) + ": expected memory disjoint from " + inputs[input].first +
                     ", got arrays that overlap");
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
    check_group("k", q_heads, kv_heads);

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
    check_variants(p.window_left, p.window_right, p.softcap, p.alibi_slopes, p.sinks, b, hq);
    // int8 K/V: both scales (B, Hkv, Lk), any values (a NaN scale acts like a NaN in K or V).
    const Dim scale_dims[3] = {b, {"Hkv", kv_heads}, {"Lk", key_len}};
    const std::pair<const char*, const ParamView3*> scales[] = {{"k_scale", &p.k_scale},
                                                                {"v_scale", &p.v_scale}};
    for (const auto& scale : scales) {
        check_scale_given(scale.first, scale.second->data != nullptr, p.kv_int8, p.dtype, "(B, Hkv, Lk)");
        if (scale.second->data != nullptr) check_shape(scale.first, scale.second->shape, scale_dims, 3);
    }

    // 7. Outputs: every element written once, by one thread, never read as input.
    check_distinct_elements("out", p.out.shape, p.out.stride, 4);
    if (p.lse.is_requested()) check_distinct_elements("lse", p.lse.shape, p.lse.stride, 3);
    const std::array<std::pair<const char*, Extent>, kProblemInputs> inputs = problem_extents(p);
    const Extent out = byte_extent(p.out.data, p.out.shape, p.out.stride, 4, element_size(p.dtype));
    check_outputs_disjoint(out, inputs[kProblemInputs - 1].second, inputs.data(), inputs.size());

    // 8. out32 (float16 / bfloat16 only): out's shape, unit last stride, every element written
    // once, disjoint from every input, out and lse.
    if (p.out32.data == nullptr) return;
    if (p.dtype == ElementType::Float32)
        reject("out32: expected None for a float32 problem (out is float32 already), got an array");
    check_shape("out32", p.out32.shape, out_dims, 4);
    check_unit_last_stride("out32", "Dv", p.out32.shape, p.out32.stride);
    check_distinct_elements("out32", p.out32.shape, p.out32.stride, 4);
    const Extent out32 = byte_extent(p.out32.data, p.out32.shape, p.out32.stride, 4, 4);
    for (const auto& input : inputs)
        if (extents_overlap(out32, input.second))
            reject(std::string("out32: expected memory disjoint from ") + input.first + ", got arrays that overlap");
    if (extents_overlap(out32, out)) reject("out32: expected memory disjoint from out, got arrays that overlap");
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

    // 4. dsinks: the sinks' gradient, (Hq,), only with sinks; dlse (B, Hq, Lq).
    const bool has_dsinks = bp.dsinks.data != nullptr;
    if (has_dsinks && p.sinks.data == nullptr)
        reject("dsinks: expected None without sinks (it is the sinks' gradient), got an array");
    if (has_dsinks) {
        const Dim dsink_dims[1] = {hq};
        check_shape("dsinks", bp.dsinks.shape, dsink_dims, 1);
    }
    if (bp.dlse.data != nullptr) {
        const Dim dlse_dims[3] = {b, hq, lq};
        check_shape("dlse", bp.dlse.shape, dlse_dims, 3);
    }

    // 5. Gradients: every element written once, by one thread, never read as input.
    check_distinct_elements("dq", bp.dq.shape, bp.dq.stride, 4);
    check_distinct_elements("dk", bp.dk.shape, bp.dk.stride, 4);
    check_distinct_elements("dv", bp.dv.shape, bp.dv.stride, 4);
    if (has_dsinks) check_distinct_elements("dsinks", bp.dsinks.shape, bp.dsinks.stride, 1);
    const int64_t item = element_size(p.dtype);
    const std::array<std::pair<const char*, Extent>, kProblemInputs> forward_inputs = problem_extents(p);
    std::vector<std::pair<const char*, Extent>> inputs(forward_inputs.begin(), forward_inputs.end());
    inputs.push_back({"out", byte_extent(p.out.data, p.out.shape, p.out.stride, 4, bp.out_float32 ? 4 : item)});
    if (bp.dlse.data != nullptr)
        inputs.push_back({"dlse", byte_extent(bp.dlse.data, bp.dlse.shape, bp.dlse.stride, 3, 4)});
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

// ---- Packed (varlen) and paged batches ----------------------------------------------------------
namespace {

// cu_seqlens (B + 1,): cu[0] == 0, non-decreasing, cu[B] == total (the rows of `total_name`).
// batch < 0: this argument defines B (at least one entry).
void check_cu_seqlens(const char* argument, const Int64Span& cu, int64_t batch, const char* total_name,
                      int64_t total) {
    const std::string name(argument);
    if (batch < 0 && cu.size < 1) reject(name + ": expected shape (B + 1,) with B >= 0, got (0,)");
    if (batch >= 0 && cu.size != batch + 1)
        reject(name + ": expected shape (B + 1=" + std::to_string(batch + 1) + ",), got (" +
             std::to_string(cu.size) + ",)");
    check_data(argument, cu.data, &cu.size, 1);
    if (cu[0] != 0) reject(name + ": expected " + name + "[0]=0, got " + std::to_string(cu[0]));
    for (int64_t b = 1; b < cu.size; ++b)
        if (cu[b] < cu[b - 1])
            reject(name + ": expected non-decreasing values, got " + name + "[" + std::to_string(b) +
                 "]=" + std::to_string(cu[b]) + " after " + name + "[" + std::to_string(b - 1) + "]=" +
                 std::to_string(cu[b - 1]));
    const int64_t last = cu.size - 1;
    if (cu[last] != total)
        reject(name + ": expected " + name + "[" + std::to_string(last) + "]=" + total_name + "=" +
             std::to_string(total) + ", got " + std::to_string(cu[last]));
}

// Steps 1 (q, out, lse), 3 (their memory) of a packed problem: q (total_q, Hq, D) defines
// total_q, Hq and D; out (total_q, Hq, Dv) with Dv given; lse (Hq, total_q).
void check_packed_rows(const TensorView3& q, const MutTensorView3& out, const LseView2& lse, int64_t value_dim) {
    const Dim q_dims[3] = {{"total_q", -1}, {"Hq", -1}, {"D", -1}};
    check_shape("q", q.shape, q_dims, 3);
    const Dim out_dims[3] = {{"total_q", q.shape[0]}, {"Hq", q.shape[1]}, {"Dv", value_dim}};
    check_shape("out", out.shape, out_dims, 3);
    if (lse.data != nullptr) {
        const Dim lse_dims[2] = {{"Hq", q.shape[1]}, {"total_q", q.shape[0]}};
        check_shape("lse", lse.shape, lse_dims, 2);
    }
}

void check_packed_memory(const TensorView3& q, const MutTensorView3& out) {
    check_data("q", q.data, q.shape, 3);
    check_data("out", out.data, out.shape, 3);
    check_unit_last_stride("q", "D", q.shape, q.stride, 3);
    check_unit_last_stride("out", "Dv", out.shape, out.stride, 3);
}

// Steps 5 to 7 for a packed problem (scale, variants with B sequences, outputs): `inputs` are
// the problem's own (k, v, block_table, scales); q, alibi_slopes and sinks are added here.
void check_packed_options(const PackedOptions& o, const TensorView3& q, const MutTensorView3& out,
                          const LseView2& lse, int64_t batch, std::vector<std::pair<const char*, Extent>> inputs) {
    if (!std::isfinite(o.scale)) reject("scale: expected a finite number, got " + float_string(o.scale));
    check_variants(o.window_left, o.window_right, o.softcap, o.alibi_slopes, o.sinks, Dim{"B", batch},
                   Dim{"Hq", q.shape[1]});
    check_distinct_elements("out", out.shape, out.stride, 3);
    if (lse.data != nullptr) check_distinct_elements("lse", lse.shape, lse.stride, 2);
    const int64_t item = element_size(o.dtype);
    const Extent lse_extent = lse.data != nullptr ? byte_extent(lse.data, lse.shape, lse.stride, 2, 4)
                                                  : Extent{true, 0, 0};
    inputs.insert(inputs.begin(), {"q", byte_extent(q.data, q.shape, q.stride, 3, item)});
    inputs.push_back({"alibi_slopes", o.alibi_slopes.data != nullptr
                                          ? byte_extent(o.alibi_slopes.data, o.alibi_slopes.shape,
                                                        o.alibi_slopes.stride, 2, 4)
                                          : Extent{true, 0, 0}});
    inputs.push_back({"sinks", o.sinks.data != nullptr
                                   ? byte_extent(o.sinks.data, o.sinks.shape, o.sinks.stride, 1, 4)
                                   : Extent{true, 0, 0}});
    inputs.push_back({"lse", lse_extent});
    check_outputs_disjoint(byte_extent(out.data, out.shape, out.stride, 3, item), lse_extent, inputs.data(),
                           inputs.size());
}

// The int8 scales of a packed problem (ParamView2 (total_k, Hkv) or ParamView3 (num_blocks,
// block_size, Hkv)): given exactly with int8 k and v, of shape `dims`; added to `inputs`.
template <typename View, int Rank>
void check_packed_scales(const View& k_scale, const View& v_scale, const PackedOptions& o, const char* shape,
                         const Dim (&dims)[Rank], std::vector<std::pair<const char*, Extent>>& inputs) {
    const std::pair<const char*, const View*> scales[] = {{"k_scale", &k_scale}, {"v_scale", &v_scale}};
    for (const auto& scale : scales) {
        check_scale_given(scale.first, scale.second->data != nullptr, o.kv_int8, o.dtype, shape);
        if (scale.second->data == nullptr) continue;
        check_shape(scale.first, scale.second->shape, dims, Rank);
        inputs.push_back({scale.first, byte_extent(scale.second->data, scale.second->shape, scale.second->stride, Rank, 4)});
    }
}

const void* element_at(const void* data, int64_t offset, int64_t item) {
    return offset == 0 ? data : static_cast<const char*>(data) + offset * item;
}

// The dense problem of sequence b (B = 1): its query rows [row_begin, row_begin + rows) of q and
// out, its lse columns, its ALiBi row; q_offset and kv_len at position[0] and position[1]. The
// caller sets k, v, the scales (and pages).
AttentionProblem sequence_problem(const TensorView3& q, const MutTensorView3& out, const LseView2& lse,
                                  const PackedOptions& o, int64_t b, int64_t row_begin, int64_t rows,
                                  const int64_t* position) {
    const int64_t item = element_size(o.dtype);
    AttentionProblem p{};
    p.q = TensorView4{element_at(q.data, row_begin * q.stride[0], item),
                      {1, q.shape[1], rows, q.shape[2]},
                      {0, q.stride[1], q.stride[0], q.stride[2]}};
    p.out = MutTensorView4{const_cast<void*>(element_at(out.data, row_begin * out.stride[0], item)),
                           {1, out.shape[1], rows, out.shape[2]},
                           {0, out.stride[1], out.stride[0], out.stride[2]}};
    p.lse = LseView{nullptr, {1, q.shape[1], rows}, {0, 0, 0}};
    if (lse.data != nullptr) {
        p.lse.data = lse.data + row_begin * lse.stride[1];
        p.lse.stride[1] = lse.stride[0];
        p.lse.stride[2] = lse.stride[1];
    }
    p.dtype = o.dtype;
    p.kv_int8 = o.kv_int8;
    p.q_offset = Int64Span(position, 1);
    p.kv_lens = Int64Span(position + 1, 1);
    p.mask.kind = MaskKind::None;
    p.causal = o.causal;
    p.scale = o.scale;
    p.window_left = o.window_left;
    p.window_right = o.window_right;
    p.softcap = o.softcap;
    if (o.alibi_slopes.data != nullptr)
        p.alibi_slopes = ParamView2{o.alibi_slopes.data + b * o.alibi_slopes.stride[0],
                                    {1, o.alibi_slopes.shape[1]},
                                    {0, o.alibi_slopes.stride[1]}};
    p.sinks = o.sinks;
    return p;
}

// A per-token scale of packed keys (total_k, Hkv) as the (1, Hkv, Lk_b) view of sequence rows
// [key_begin, key_begin + keys); the whole array's row axis as slots when paged.
ParamView3 scale_rows(const ParamView2& scale, int64_t key_begin, int64_t keys) {
    if (scale.data == nullptr) return ParamView3{nullptr, {0, 0, 0}, {0, 0, 0}};
    return ParamView3{scale.data + key_begin * scale.stride[0], {1, scale.shape[1], keys}, {0, scale.stride[1], scale.stride[0]}};
}

}  // namespace

std::vector<AttentionProblem> varlen_sequences(const VarlenProblem& p, std::vector<int64_t>& positions) {
    const PackedOptions& o = p.options;
    // 1. Shapes: q defines total_q, Hq, D; k total_k and Hkv; v Dv.
    const Dim k_dims[3] = {{"total_k", -1}, {"Hkv", -1}, {"D", p.q.shape[2]}};
    const Dim q_dims[3] = {{"total_q", -1}, {"Hq", -1}, {"D", -1}};
    check_shape("q", p.q.shape, q_dims, 3);
    check_shape("k", p.k.shape, k_dims, 3);
    const int64_t total_k = p.k.shape[0], kv_heads = p.k.shape[1];
    const Dim v_dims[3] = {{"total_k", total_k}, {"Hkv", kv_heads}, {"Dv", -1}};
    check_shape("v", p.v.shape, v_dims, 3);
    check_packed_rows(p.q, p.out, p.lse, p.v.shape[2]);
    // 2. Grouped-query heads.
    check_group("k", p.q.shape[1], kv_heads);
    // 3. Memory.
    check_packed_memory(p.q, p.out);
    check_data("k", p.k.data, p.k.shape, 3);
    check_data("v", p.v.data, p.v.shape, 3);
    check_unit_last_stride("k", "D", p.k.shape, p.k.stride, 3);
    check_unit_last_stride("v", "Dv", p.v.shape, p.v.stride, 3);
    // 4. The sequences.
    check_cu_seqlens("cu_seqlens_q", p.cu_seqlens_q, -1, "total_q", p.q.shape[0]);
    const int64_t batch = p.cu_seqlens_q.size - 1;
    check_cu_seqlens("cu_seqlens_k", p.cu_seqlens_k, batch, "total_k", total_k);
    // 5 - 7. Scale, variants, int8 scales (total_k, Hkv), outputs.
    const Dim scale_dims[2] = {{"total_k", total_k}, {"Hkv", kv_heads}};
    const int64_t kv_item = o.kv_int8 ? 1 : element_size(o.dtype);
    std::vector<std::pair<const char*, Extent>> inputs = {
        {"k", byte_extent(p.k.data, p.k.shape, p.k.stride, 3, kv_item)},
        {"v", byte_extent(p.v.data, p.v.shape, p.v.stride, 3, kv_item)}};
    check_packed_scales(p.k_scale, p.v_scale, o, "(total_k, Hkv)", scale_dims, inputs);
    check_packed_options(o, p.q, p.out, p.lse, batch, inputs);

    positions.assign(static_cast<size_t>(2 * batch), 0);
    std::vector<AttentionProblem> sequences;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t rows = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        const int64_t key_begin = p.cu_seqlens_k[b], keys = p.cu_seqlens_k[b + 1] - key_begin;
        int64_t* position = positions.data() + 2 * b;
        position[0] = keys - rows;  // bottom-right
        position[1] = keys;
        if (rows == 0) continue;
        AttentionProblem s = sequence_problem(p.q, p.out, p.lse, o, b, p.cu_seqlens_q[b], rows, position);
        s.k = TensorView4{element_at(p.k.data, key_begin * p.k.stride[0], kv_item),
                          {1, kv_heads, keys, p.k.shape[2]},
                          {0, p.k.stride[1], p.k.stride[0], p.k.stride[2]}};
        s.v = TensorView4{element_at(p.v.data, key_begin * p.v.stride[0], kv_item),
                          {1, kv_heads, keys, p.v.shape[2]},
                          {0, p.v.stride[1], p.v.stride[0], p.v.stride[2]}};
        s.k_scale = scale_rows(p.k_scale, key_begin, keys);
        s.v_scale = scale_rows(p.v_scale, key_begin, keys);
        sequences.push_back(s);
    }
    return sequences;
}

std::vector<AttentionProblem> paged_sequences(const PagedProblem& p, std::vector<int64_t>& positions) {
    const PackedOptions& o = p.options;
    // 1. Shapes: q defines total_q, Hq, D; k_cache num_blocks, block_size and Hkv; v_cache Dv;
    // block_table B and max_blocks.
    const Dim q_dims[3] = {{"total_q", -1}, {"Hq", -1}, {"D", -1}};
    check_shape("q", p.q.shape, q_dims, 3);
    const Dim k_dims[4] = {{"num_blocks", -1}, {"block_size", -1}, {"Hkv", -1}, {"D", p.q.shape[2]}};
    check_shape("k_cache", p.k_cache.shape, k_dims, 4);
    const int64_t num_blocks = p.k_cache.shape[0], block_size = p.k_cache.shape[1], kv_heads = p.k_cache.shape[2];
    if (block_size < 1)
        reject("k_cache: expected block_size >= 1, got shape " + shape_string(p.k_cache.shape, 4));
    const Dim v_dims[4] = {{"num_blocks", num_blocks}, {"block_size", block_size}, {"Hkv", kv_heads}, {"Dv", -1}};
    check_shape("v_cache", p.v_cache.shape, v_dims, 4);
    check_packed_rows(p.q, p.out, p.lse, p.v_cache.shape[3]);
    const Dim table_dims[2] = {{"B", -1}, {"max_blocks", -1}};
    check_shape("block_table", p.block_table.shape, table_dims, 2);
    const int64_t batch = p.block_table.shape[0], max_blocks = p.block_table.shape[1];
    // 2. Grouped-query heads.
    check_group("k_cache", p.q.shape[1], kv_heads);
    // 3. Memory.
    check_packed_memory(p.q, p.out);
    check_data("k_cache", p.k_cache.data, p.k_cache.shape, 4);
    check_data("v_cache", p.v_cache.data, p.v_cache.shape, 4);
    check_data("block_table", p.block_table.data, p.block_table.shape, 2);
    check_unit_last_stride("k_cache", "D", p.k_cache.shape, p.k_cache.stride);
    check_unit_last_stride("v_cache", "Dv", p.v_cache.shape, p.v_cache.stride);
    // 4. The sequences: lengths, query rows, the blocks they use.
    if (p.seq_lens.size != batch)
        reject("seq_lens: expected shape (B=" + std::to_string(batch) + ",), got (" + std::to_string(p.seq_lens.size) + ",)");
    check_data("seq_lens", p.seq_lens.data, &p.seq_lens.size, 1);
    check_cu_seqlens("cu_seqlens_q", p.cu_seqlens_q, batch, "total_q", p.q.shape[0]);
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t keys = p.seq_lens[b], rows = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
        if (keys < 0 || keys / block_size + (keys % block_size != 0) > max_blocks)
            reject("seq_lens: expected values in [0, max_blocks * block_size=" +
                 std::to_string(static_cast<int128>(max_blocks) * block_size > INT64_MAX
                                    ? INT64_MAX : max_blocks * block_size) +
                 "], got seq_lens[" + std::to_string(b) + "]=" + std::to_string(keys));
        if (rows > keys)
            reject("cu_seqlens_q: expected at most seq_lens[b] query rows in sequence b, got " +
                 std::to_string(rows) + " rows in sequence " + std::to_string(b) + " (seq_lens[" +
                 std::to_string(b) + "]=" + std::to_string(keys) + ")");
        for (int64_t entry = 0; entry * block_size < keys; ++entry) {
            const int32_t block = p.block_table.data[b * p.block_table.stride[0] + entry * p.block_table.stride[1]];
            if (block < 0 || block >= num_blocks)
                reject("block_table: expected block ids in [0, num_blocks=" + std::to_string(num_blocks) +
                     ") for the blocks sequence b uses, got block_table[" + std::to_string(b) + ", " +
                     std::to_string(entry) + "]=" + std::to_string(block));
        }
    }
    // 5 - 7. Scale, variants, int8 scales (num_blocks, block_size, Hkv), outputs.
    const Dim scale_dims[3] = {{"num_blocks", num_blocks}, {"block_size", block_size}, {"Hkv", kv_heads}};
    const int64_t kv_item = o.kv_int8 ? 1 : element_size(o.dtype);
    std::vector<std::pair<const char*, Extent>> inputs = {
        {"k_cache", byte_extent(p.k_cache.data, p.k_cache.shape, p.k_cache.stride, 4, kv_item)},
        {"v_cache", byte_extent(p.v_cache.data, p.v_cache.shape, p.v_cache.stride, 4, kv_item)},
        {"block_table", byte_extent(p.block_table.data, p.block_table.shape, p.block_table.stride, 2, 4)}};
    check_packed_scales(p.k_scale, p.v_scale, o, "(num_blocks, block_size, Hkv)", scale_dims, inputs);
    check_packed_options(o, p.q, p.out, p.lse, batch, inputs);

    positions.assign(static_cast<size_t>(2 * batch), 0);
    std::vector<AttentionProblem> sequences;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t rows = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b], keys = p.seq_lens[b];
        int64_t* position = positions.data() + 2 * b;
        position[0] = keys - rows;  // the sequence's last positions
        position[1] = keys;
        if (rows == 0) continue;
        AttentionProblem s = sequence_problem(p.q, p.out, p.lse, o, b, p.cu_seqlens_q[b], rows, position);
        // Axis 0 steps pages, axis 2 slots (KeyPages).
        const TensorView4& kc = p.k_cache;
        const TensorView4& vc = p.v_cache;
        s.k = TensorView4{kc.data, {1, kv_heads, keys, kc.shape[3]}, {kc.stride[0], kc.stride[2], kc.stride[1], kc.stride[3]}};
        s.v = TensorView4{vc.data, {1, kv_heads, keys, vc.shape[3]}, {vc.stride[0], vc.stride[2], vc.stride[1], vc.stride[3]}};
        const std::pair<ParamView3*, const ParamView3*> scale_views[] = {{&s.k_scale, &p.k_scale}, {&s.v_scale, &p.v_scale}};
        for (const auto& view : scale_views)
            if (view.second->data != nullptr)
                *view.first = ParamView3{view.second->data, {1, kv_heads, keys},
                                         {view.second->stride[0], view.second->stride[2], view.second->stride[1]}};
        s.pages = KeyPages{p.block_table.data + b * p.block_table.stride[0], p.block_table.stride[1], block_size};
        sequences.push_back(s);
    }
    return sequences;
}

}  // namespace twinattn
