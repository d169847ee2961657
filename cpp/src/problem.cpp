// check_problem: everything the kernels rely on, checked once per call, so that no kernel can
// read or write out of bounds whatever its caller passes.
#include "twinattn/problem.hpp"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace twinattn {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

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
    wanted += ")";
    fail(std::string(argument) + ": expected shape " + wanted + ", got " +
         shape_string(shape, rank));
}

int64_t element_count(const int64_t* shape, int rank) {
    int64_t count = 1;
    for (int axis = 0; axis < rank; ++axis) count *= shape[axis];
    return count;
}

void check_data(const char* argument, const void* data, const int64_t* shape, int rank) {
    if (data == nullptr && element_count(shape, rank) != 0)
        fail(std::string(argument) + ": expected data for a non-empty array of shape " +
             shape_string(shape, rank) + ", got a null pointer");
}

void check_unit_last_stride(const char* argument, const char* axis_name, const int64_t* shape,
                            const int64_t* stride) {
    // An empty array has no element to read, so its strides do not matter (NumPy may give 0).
    if (shape[3] > 1 && stride[3] != 1 && element_count(shape, 4) != 0)
        fail(std::string(argument) + ": expected unit stride on the last axis (" + axis_name +
             "=" + std::to_string(shape[3]) + "), got stride " + std::to_string(stride[3]) +
             " elements");
}

}  // namespace

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

    if (p.lse.data != nullptr) {
        const Dim lse_dims[3] = {b, hq, lq};
        check_shape("lse", p.lse.shape, lse_dims, 3);
    }

    // 2. Grouped-query heads: every KV head serves Hq / Hkv query heads.
    if (q_heads >= 1 && kv_heads < 1)
        fail("k: expected Hkv >= 1 when Hq=" + std::to_string(q_heads) + ", got Hkv=" +
             std::to_string(kv_heads));
    if (kv_heads >= 1 && q_heads % kv_heads != 0)
        fail("k: expected Hq % Hkv == 0 (query heads Hq=" + std::to_string(q_heads) +
             " shared evenly by KV heads), got Hkv=" + std::to_string(kv_heads));

    // 3. Memory: data present when non-empty, unit stride on the feature axes.
    check_data("q", p.q.data, p.q.shape, 4);
    check_data("k", p.k.data, p.k.shape, 4);
    check_data("v", p.v.data, p.v.shape, 4);
    check_data("out", p.out.data, p.out.shape, 4);
    check_unit_last_stride("q", "D", p.q.shape, p.q.stride);
    check_unit_last_stride("k", "D", p.k.shape, p.k.stride);
    check_unit_last_stride("v", "Dv", p.v.shape, p.v.stride);
    check_unit_last_stride("out", "Dv", p.out.shape, p.out.stride);
    if (p.mask.kind != MaskKind::None) {
        const int64_t mask_shape[4] = {batch, q_heads, q_len, key_len};
        check_data("mask", p.mask.data, mask_shape, 4);
    }

    // 4. Per-sequence lengths and positions.
    if (batch > 0 && p.causal && p.q_offset == nullptr)
        fail("q_offset: expected one offset per sequence (B=" + std::to_string(batch) +
             ") when causal, got none");
    for (int64_t seq = 0; seq < batch; ++seq) {
        if (p.kv_lens != nullptr && (p.kv_lens[seq] < 0 || p.kv_lens[seq] > key_len))
            fail("kv_lens[" + std::to_string(seq) + "]: expected 0 <= kv_lens[b] <= Lk=" +
                 std::to_string(key_len) + ", got " + std::to_string(p.kv_lens[seq]));
        if (p.causal && p.q_offset[seq] < 0)
            fail("q_offset[" + std::to_string(seq) + "]: expected >= 0 when causal, got " +
                 std::to_string(p.q_offset[seq]));
    }

    // 5. Scale.
    if (!std::isfinite(p.scale)) {
        std::ostringstream given;
        given << p.scale;
        fail("scale: expected a finite number, got " + given.str());
    }
}

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
