// One attention call, described without Python: views over caller-owned memory plus the
// per-sequence positions, the mask and the scale. The native bindings build an
// AttentionProblem from NumPy arrays; C++ tests build one from std::vector storage.
//
// Shapes (docs/native_api.md):
//   q   (B, Hq,  Lq, D)      k (B, Hkv, Lk, D)      v (B, Hkv, Lk, Dv)
//   out (B, Hq,  Lq, Dv)     lse (B, Hq, Lq)        mask (B, Hq, Lq, Lk)
//   q_offset (B,)            kv_lens (B,)
//   alibi_slopes (B, Hq)     sinks (Hq,)
// Strides count elements, not bytes, and may be negative or zero; data points at element
// [0, 0, 0, 0]. The last axis of q, k, v and out has unit stride unless its length is <= 1.
// Twin of rust/src/problem.rs: the same fields with the same meaning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace twinattn {

// q, k, v and out hold elements of the problem's dtype (ElementType); every other array is float32
// (lse, a float mask, alibi_slopes, sinks) or bool / int64 as stated.
enum class ElementType { Float32, Float16, BFloat16 };

// Bytes per element of q, k, v and out.
int64_t element_size(ElementType dtype);

struct TensorView4 {
    const void* data;  // elements of AttentionProblem::dtype
    int64_t shape[4];
    int64_t stride[4];  // in elements
};

struct MutTensorView4 {
    void* data;  // elements of AttentionProblem::dtype
    int64_t shape[4];
    int64_t stride[4];  // in elements
};

// lse: natural-log softmax denominators, (B, Hq, Lq). data == nullptr: not requested.
struct LseView {
    float* data;
    int64_t shape[3];
    int64_t stride[3];  // in elements

    bool is_requested() const { return data != nullptr; }
};

enum class MaskKind { None, Bool, Float };

// mask: shape (B, Hq, Lq, Lk) (check_problem checks it against q and k; a broadcast mask has
// zero strides). Bool: one byte per element, nonzero means "may attend". Float: float32
// additive bias, -inf hides the key. Strides in elements (bytes for Bool), any sign, on every
// axis. kind None: no mask (data and shape unused).
struct MaskView {
    MaskKind kind;
    const void* data;
    int64_t shape[4];
    int64_t stride[4];
};

// Per-sequence int64 values (q_offset, kv_lens): a pointer and a length, Rust's &[i64] (C++17
// has no std::span). Converts from a C array or a std::vector, which must outlive the call.
struct Int64Span {
    const int64_t* data = nullptr;
    int64_t size = 0;

    Int64Span() = default;
    Int64Span(const int64_t* values, int64_t count) : data(values), size(count) {}
    template <size_t N>
    Int64Span(const int64_t (&values)[N]) : data(values), size(static_cast<int64_t>(N)) {}
    Int64Span(const std::vector<int64_t>& values)
        : data(values.data()), size(static_cast<int64_t>(values.size())) {}
    const int64_t& operator[](int64_t index) const { return data[index]; }
};

// A float32 vector or matrix (alibi_slopes (B, Hq), sinks (Hq,)); data == nullptr: not given.
// Strides in elements, any sign (a (Hq,) slope vector arrives as a stride-0 (B, Hq) view).
struct ParamView2 {
    const float* data;
    int64_t shape[2];
    int64_t stride[2];
};

struct ParamView1 {
    const float* data;
    int64_t shape[1];
    int64_t stride[1];
};

// A float32 array of rank 3 (k_scale, v_scale (B, Hkv, Lk)); data == nullptr: not given.
struct ParamView3 {
    const float* data;
    int64_t shape[3];
    int64_t stride[3];
};

// Paged keys and values (attention_paged; docs/kernels.md, "Key rows"): data == nullptr means k,
// v, k_scale and v_scale are the dense (B, Hkv, Lk, ...) views above. Otherwise the problem holds
// one sequence (B = 1) whose key j lives in page data[(j / block_size) * stride], slot
// j % block_size: axis 0 of k, v, k_scale and v_scale then steps pages (its stride is the page
// stride), axis 2 steps slots within a page, and only the pages of keys j < kv_lens[0] are read.
struct KeyPages {
    const int32_t* data = nullptr;
    int64_t stride = 0;  // in elements, between consecutive entries of the sequence's block table
    int64_t block_size = 1;
};

struct AttentionProblem {
    TensorView4 q, k, v;
    MutTensorView4 out;
    LseView lse;
    // The element type of q, k, v and out (all four alike, except k and v when kv_int8); lse is
    // float32 whatever it is.
    // float16 / bfloat16: the kernels convert the inputs exactly to float32, compute in float32
    // and round out to the dtype (docs/kernels.md, "Reduced precision").
    ElementType dtype = ElementType::Float32;
    // Absolute position of query row 0 of each sequence, B entries: query row i sits at
    // q_offset[b] + i (read when causal, windowed or with ALiBi); >= 0 when causal, any value
    // otherwise.
    Int64Span q_offset;
    // Number of valid keys of each sequence, B entries, each in [0, Lk]; keys j >= kv_lens[b]
    // are never read.
    Int64Span kv_lens;
    MaskView mask;
    bool causal;
    float scale;
    // Sliding window (flash-attn's convention): key j is visible to position p only if
    // p - window_left <= j <= p + window_right; -1 leaves that side unbounded.
    int64_t window_left = -1, window_right = -1;
    // > 0: each scaled score s becomes softcap * tanh(s / softcap); 0: off.
    float softcap = 0.0f;
    // ALiBi: adds -alibi_slopes[b, h] * |p - j| to the score (after softcap).
    ParamView2 alibi_slopes = {nullptr, {0, 0}, {0, 0}};
    // One extra logit per query head (natural-log units, not scaled): softmax mass, no value.
    ParamView1 sinks = {nullptr, {0}, {0}};
    // int8 K/V (docs/kernels.md, "int8 K/V"): k and v hold int8 (q and out keep dtype), and
    // k_scale / v_scale (B, Hkv, Lk), both required, give each token's float32 scale: the kernels
    // attend over float32(k) * k_scale, float32(v) * v_scale. false: k and v have dtype, and the
    // scales must not be given.
    bool kv_int8 = false;
    ParamView3 k_scale = {nullptr, {0, 0, 0}, {0, 0, 0}};
    ParamView3 v_scale = {nullptr, {0, 0, 0}, {0, 0, 0}};
    // Paged K/V (KeyPages): set by attention_paged for its per-sequence problems only.
    KeyPages pages;
    // float16 / bfloat16 only, optional (data == nullptr: none): float32 (B, Hq, Lq, Dv), the
    // output before its rounding to dtype, which the forward writes beside out (for the backward's
    // D; on the bfloat16 pair paths with P.V's remainder added, flash_bf16_pairs.hpp).
    MutTensorView4 out32 = {nullptr, {0, 0, 0, 0}, {0, 0, 0, 0}};
};

// ---- Packed (varlen) and paged batches (docs/native_api.md, attention_varlen / attention_paged)
// Rank-3 views of packed rows, (total, H, D): strides in elements, the last axis unit stride.
struct TensorView3 {
    const void* data;  // elements of the problem's dtype (int8 for int8 k and v)
    int64_t shape[3];
    int64_t stride[3];
};

struct MutTensorView3 {
    void* data;
    int64_t shape[3];
    int64_t stride[3];
};

// lse of packed rows, (Hq, total_q) (flash-attn's layout); data == nullptr: not requested.
struct LseView2 {
    float* data;
    int64_t shape[2];
    int64_t stride[2];
};

// The block table, int32 (B, max_blocks), strides in elements.
struct BlockTableView {
    const int32_t* data;
    int64_t shape[2];
    int64_t stride[2];
};

// What attention_varlen and attention_paged share with each other: the options of
// AttentionProblem (same meaning), alibi_slopes (B, Hq) with B the number of sequences.
struct PackedOptions {
    ElementType dtype = ElementType::Float32;
    bool kv_int8 = false;
    bool causal = false;
    float scale = 1.0f;
    int64_t window_left = -1, window_right = -1;
    float softcap = 0.0f;
    ParamView2 alibi_slopes = {nullptr, {0, 0}, {0, 0}};
    ParamView1 sinks = {nullptr, {0}, {0}};
};

// Sequences packed one after another: sequence b has query rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] and keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1]; its query row i sits at
// position (Lk_b - Lq_b) + i (bottom-right).
//   q (total_q, Hq, D)   k (total_k, Hkv, D)   v (total_k, Hkv, Dv)   out (total_q, Hq, Dv)
//   lse (Hq, total_q)    cu_seqlens_q, cu_seqlens_k (B + 1,)   k_scale, v_scale (total_k, Hkv)
struct VarlenProblem {
    TensorView3 q, k, v;
    MutTensorView3 out;
    LseView2 lse = {nullptr, {0, 0}, {0, 0}};
    Int64Span cu_seqlens_q, cu_seqlens_k;
    PackedOptions options;
    ParamView2 k_scale = {nullptr, {0, 0}, {0, 0}};
    ParamView2 v_scale = {nullptr, {0, 0}, {0, 0}};
};

// Keys in pages: key j of sequence b at k_cache[block_table[b, j / block_size], j % block_size];
// sequence b has seq_lens[b] keys and query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1], its last
// positions (row i at seq_lens[b] - Lq_b + i).
//   q (total_q, Hq, D)   k_cache (num_blocks, block_size, Hkv, D)   v_cache (.., Hkv, Dv)
//   out (total_q, Hq, Dv)   lse (Hq, total_q)   block_table (B, max_blocks)   seq_lens (B,)
//   cu_seqlens_q (B + 1,)   k_scale, v_scale (num_blocks, block_size, Hkv)
struct PagedProblem {
    TensorView3 q;
    TensorView4 k_cache, v_cache;
    MutTensorView3 out;
    LseView2 lse = {nullptr, {0, 0}, {0, 0}};
    BlockTableView block_table;
    Int64Span seq_lens, cu_seqlens_q;
    PackedOptions options;
    ParamView3 k_scale = {nullptr, {0, 0, 0}, {0, 0, 0}};
    ParamView3 v_scale = {nullptr, {0, 0, 0}, {0, 0, 0}};
};

// The checks of check_problem for packed and paged batches (same order, same style of message),
// then one dense problem (B = 1) per sequence, views into the caller's arrays (no copy):
// `positions` receives per sequence its q_offset and kv_len, which the problems point into.
std::vector<AttentionProblem> varlen_sequences(const VarlenProblem& problem, std::vector<int64_t>& positions);
std::vector<AttentionProblem> paged_sequences(const PagedProblem& problem, std::vector<int64_t>& positions);

// Throws std::invalid_argument naming the argument, what was expected and what was given,
// e.g. "k: expected shape (B=2, Hkv, Lk, D=64), got (2, 4, 10, 32)". After it returns, the
// kernels may index every element of every view without further checks, and no two threads
// write the same output element. The same checks in the same order as Rust's check_problem
// (docs/native_api.md lists them side by side).
void check_problem(const AttentionProblem& problem);

// ---- The backward pass (attention_backward, flash_backward.hpp) --------------------------------

// A writeable float32 vector (dsinks, (Hq,)); data == nullptr: not requested.
struct MutParamView1 {
    float* data;
    int64_t shape[1];
    int64_t stride[1];
};

// One backward call: the forward's problem (its out and lse now inputs, lse required), the
// gradient of the loss with respect to out, and the gradients, written in place:
//   dout (B, Hq, Lq, Dv)    dq (B, Hq, Lq, D)    dk (B, Hkv, Lk, D)    dv (B, Hkv, Lk, Dv)
//   dsinks (Hq,) float32, only together with forward.sinks
// dout, dq, dk and dv hold elements of forward.dtype (float32, float16 or bfloat16; int8 k and v
// carry no gradient); the last axis has unit stride, as q's.
struct BackwardProblem {
    AttentionProblem forward;
    TensorView4 dout;
    MutTensorView4 dq, dk, dv;
    MutParamView1 dsinks = {nullptr, {0}, {0}};
    // forward.out holds float32 (the forward's out32) instead of forward.dtype: D = rowsum(dout * out)
    // is then taken from the output before its rounding (for a float32 problem it changes nothing).
    bool out_float32 = false;
    // Optional (data == nullptr: none): float32 (B, Hq, Lq), the loss's gradient with respect to
    // lse, folded into the row term: dS = P (dP - (D - dlse)).
    ParamView3 dlse = {nullptr, {0, 0, 0}, {0, 0, 0}};
};

// check_problem's checks on the forward part (lse required, k and v not int8), then dout, dq,
// dk, dv, dsinks, out_float32 and dlse: shapes, data, unit last strides, dsinks only with sinks, and the gradients
// written once each (no element twice, no overlap with each other or any input). Throws
// std::invalid_argument as check_problem does; the same checks in the same order as Rust's
// check_backward.
void check_backward(const BackwardProblem& problem);

// The thread count of a call: throws std::invalid_argument unless num_threads >= 1; returns it
// capped to what an int holds (the kernels start at most one thread per work item).
int check_num_threads(int64_t num_threads);

// The message of the MemoryError both ports raise when a kernel's scratch cannot be allocated
// (the kernels throw std::bad_alloc; the binding raises MemoryError with this text).
extern const char* const kOutOfMemoryMessage;

// Row-major (contiguous) views over shape (d0, d1, d2, d3); a convenience for tests and for
// callers that own contiguous buffers.
TensorView4 contiguous_view(const float* data, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
MutTensorView4 contiguous_mut_view(float* data, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
LseView contiguous_lse_view(float* data, int64_t d0, int64_t d1, int64_t d2);

}  // namespace twinattn
