// attention_reference: exact scaled-dot-product attention, the seeds' kernel grown to the full
// contract (docs/native_api.md).
//
// Shapes (strides in elements, see problem.hpp):
//   q   (B, Hq,  Lq, D)      k (B, Hkv, Lk, D)      v (B, Hkv, Lk, Dv)
//   out (B, Hq,  Lq, Dv)     lse (B, Hq, Lq)        mask (B, Hq, Lq, Lk)
//   q_offset (B,), kv_lens (B,); query head h reads KV head h / (Hq / Hkv).
//   alibi_slopes (B, Hq), sinks (Hq,) when given.
//
// For each query row i of sequence b, head h, at position p = q_offset[b] + i:
//   1. select the visible keys and score them: key j is visible iff j < kv_len[b], and
//      (not causal or j <= p), and (window_left < 0 or j >= p - window_left), and
//      (window_right < 0 or j <= p + window_right), and (bool mask[b,h,i,j] or no bool mask),
//      and its float bias is not -inf; score_j = scale * (q_i . k_j), then
//      softcap * tanh(score_j / softcap) when softcap > 0, then - slope[b,h] * |p - j| (ALiBi),
//      then + bias_ij.
//   2. row_max = max(sink[h], max_j score_j) (sink = -inf without sinks; NaN when any score is
//      NaN).
//   3. e_j = exp(score_j - row_max), row_sum = exp(sink[h] - row_max) + sum_j e_j.
//   4. normalise: p_j = e_j / row_sum.
//   5. out_i = sum_j p_j v_j, lse_i = row_max + log(row_sum) (+inf when row_max is +inf).
// Only visible keys are ever touched after pass 1 (and k_j is read in pass 1 only once j has
// passed the position, length, window and mask tests), so hidden keys cannot contribute, not
// even as 0 * NaN. A key whose score is -inf (bias, or inf in q or k) is left out like a hidden
// one. A row with no visible key gets out = 0 and lse = sink[h] (-inf without sinks).
// Non-finite inputs at visible positions propagate as in twinattn/reference.py: a NaN score
// makes the row's out and lse NaN; a +inf score makes out NaN (inf / inf) and lse +inf; NaN or
// inf in v reaches the columns it is in. Everything after the loads is computed in double, as
// in the seeds. float16 / bfloat16 problems: q, k and v are converted exactly to float32 as they
// are read, and out is the float32 result rounded to the dtype (element.hpp).
#include "twinattn/reference_kernel.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "element.hpp"

namespace twinattn {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct VisibleKey {
    int64_t key;   // j
    double score;  // score_j, then e_j, then p_j as the passes go
};

// Per-thread scratch, allocated once per call before any thread starts.
struct RowScratch {
    std::vector<VisibleKey> visible;  // capacity: the longest kv_len
    std::vector<double> out_row;      // Dv accumulators
};

// 128-bit arithmetic (GCC and Clang): q_offset may be any int64 when not causal.
__extension__ typedef __int128 int128;

// The absolute position q_offset[b] + i of row i (exact: no int64 overflow).
int128 position_of(const AttentionProblem& p, int64_t b, int64_t i) {
    return static_cast<int128>(p.q_offset[b]) + i;
}

// Whether key j < kv_len[b] is visible to row i by position (causal and window).
bool in_window(const AttentionProblem& p, int64_t b, int64_t i, int64_t j) {
    if (!p.causal && p.window_left < 0 && p.window_right < 0) return true;
    const int128 position = position_of(p, b, i);
    if (p.causal && j > position) return false;
    if (p.window_left >= 0 && j < position - p.window_left) return false;
    if (p.window_right >= 0 && j > position + p.window_right) return false;
    return true;
}

// T: the element type of q and out (float, Float16 or BFloat16), KV that of k and v (T, or
// int8_t: dequantized as float32(x) * scale in float32, then used as float32 inputs are).
template <typename T, typename KV = T>
void attend_row(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, RowScratch& scratch) {
    const int64_t head_dim = p.q.shape[3];
    const int64_t value_dim = p.v.shape[3];
    const int64_t kv_head = h / (p.q.shape[1] / p.k.shape[1]);
    const T* q_row = static_cast<const T*>(p.q.data) + b * p.q.stride[0] + h * p.q.stride[1] + i * p.q.stride[2];
    const KV* k_head = static_cast<const KV*>(p.k.data) + b * p.k.stride[0] + kv_head * p.k.stride[1];
    const KV* v_head = static_cast<const KV*>(p.v.data) + b * p.v.stride[0] + kv_head * p.v.stride[1];
    constexpr bool int8 = std::is_same<KV, int8_t>::value;
    const float* k_scale = int8 ? p.k_scale.data + b * p.k_scale.stride[0] + kv_head * p.k_scale.stride[1] : nullptr;
    const float* v_scale = int8 ? p.v_scale.data + b * p.v_scale.stride[0] + kv_head * p.v_scale.stride[1] : nullptr;
    T* out_row = static_cast<T*>(p.out.data) + b * p.out.stride[0] + h * p.out.stride[1] + i * p.out.stride[2];
    // out32 (float16 / bfloat16, when given): out before its rounding to T
    float* out32_row = p.out32.data == nullptr ? nullptr
                                               : static_cast<float*>(p.out32.data) + b * p.out32.stride[0] +
                                                     h * p.out32.stride[1] + i * p.out32.stride[2];
    const int64_t mask_row = b * p.mask.stride[0] + h * p.mask.stride[1] + i * p.mask.stride[2];

    // 1. Select the visible keys and score them.
    std::vector<VisibleKey>& visible = scratch.visible;
    visible.clear();  // keeps capacity: no allocation here
    const int64_t kv_len = p.kv_lens[b];
    const double softcap = p.softcap;
    const double slope = p.alibi_slopes.data == nullptr
                             ? 0.0
                             : p.alibi_slopes.data[b * p.alibi_slopes.stride[0] +
                                                   h * p.alibi_slopes.stride[1]];
    const double sink = p.sinks.data == nullptr ? kNegInf : p.sinks.data[h * p.sinks.stride[0]];
    for (int64_t j = 0; j < kv_len; ++j) {
        if (!in_window(p, b, i, j)) continue;
        double bias = 0.0;
        const int64_t mask_index = mask_row + j * p.mask.stride[3];
        if (p.mask.kind == MaskKind::Bool) {
            // Read as a byte: any nonzero value means "may attend".
            if (static_cast<const unsigned char*>(p.mask.data)[mask_index] == 0) continue;
        } else if (p.mask.kind == MaskKind::Float) {
            bias = static_cast<const float*>(p.mask.data)[mask_index];
            if (bias == kNegInf) continue;  // hidden before k_j is read
        }
        const KV* k_row = k_head + j * p.k.stride[2];
        const float k_multiplier = int8 ? k_scale[j * p.k_scale.stride[2]] : 1.0f;
        double dot = 0.0;
        for (int64_t d = 0; d < head_dim; ++d) {
            const float k_value = int8 ? to_f32(k_row[d]) * k_multiplier : to_f32(k_row[d]);
            dot += static_cast<double>(to_f32(q_row[d])) * static_cast<double>(k_value);
        }
        double score = static_cast<double>(p.scale) * dot;
        if (softcap > 0.0) score = softcap * std::tanh(score / softcap);
        if (p.alibi_slopes.data != nullptr) {
            const int128 distance = position_of(p, b, i) - j;
            score -= slope * static_cast<double>(distance < 0 ? -distance : distance);
        }
        score += bias;
        if (score == kNegInf) continue;  // an all-(-inf) row ends up with no visible key
        visible.push_back(VisibleKey{j, score});
    }

    float* lse = p.lse.data == nullptr
                     ? nullptr
                     : p.lse.data + b * p.lse.stride[0] + h * p.lse.stride[1] + i * p.lse.stride[2];
    if (visible.empty()) {
        for (int64_t d = 0; d < value_dim; ++d) from_f32(0.0f, &out_row[d]);
        for (int64_t d = 0; out32_row != nullptr && d < value_dim; ++d) out32_row[d] = 0.0f;
        if (lse != nullptr) *lse = static_cast<float>(sink);  // -inf without sinks
        return;
    }

    // 2. Row max (the sink is a key without a value).
    double row_max = sink;
    for (const VisibleKey& key : visible)  // NaN-propagating: a NaN score stays the row max
        if (row_max == row_max && (key.score != key.score || key.score > row_max)) row_max = key.score;

    // 3. Exponentiate and sum.
    double row_sum = sink == kNegInf ? 0.0 : std::exp(sink - row_max);
    for (VisibleKey& key : visible) {
        key.score = std::exp(key.score - row_max);  // <= 1: no large positive exponentials
        row_sum += key.score;
    }

    // 4. Normalise.
    for (VisibleKey& key : visible) key.score /= row_sum;

    // 5. Weight the values; write out and lse.
    std::vector<double>& out_acc = scratch.out_row;
    std::fill(out_acc.begin(), out_acc.end(), 0.0);
    for (const VisibleKey& key : visible) {
        const KV* v_row = v_head + key.key * p.v.stride[2];
        const float v_multiplier = int8 ? v_scale[key.key * p.v_scale.stride[2]] : 1.0f;
        for (int64_t d = 0; d < value_dim; ++d) {
            const float v_value = int8 ? to_f32(v_row[d]) * v_multiplier : to_f32(v_row[d]);
            out_acc[d] += key.score * static_cast<double>(v_value);
        }
    }
    for (int64_t d = 0; d < value_dim; ++d) from_f32(static_cast<float>(out_acc[d]), &out_row[d]);
    for (int64_t d = 0; out32_row != nullptr && d < value_dim; ++d) out32_row[d] = static_cast<float>(out_acc[d]);
    if (lse != nullptr)  // a +inf score: log(sum) = +inf, though the weights are inf / inf
        *lse = row_max == -kNegInf ? std::numeric_limits<float>::infinity()
                                   : static_cast<float>(row_max + std::log(row_sum));
}

// Every row of the (sequence, query head) pairs [pair_begin, pair_end), pair = b * Hq + h.
void attend_pairs(const AttentionProblem& p, int64_t pair_begin, int64_t pair_end,
                  RowScratch& scratch) {
    const int64_t q_heads = p.q.shape[1];
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
        const int64_t b = pair / q_heads, h = pair % q_heads;
        for (int64_t i = 0; i < p.q.shape[2]; ++i) {
            switch (p.dtype) {
                case ElementType::Float32:
                    p.kv_int8 ? attend_row<float, int8_t>(p, b, h, i, scratch) : attend_row<float>(p, b, h, i, scratch);
                    break;
                case ElementType::Float16:
                    p.kv_int8 ? attend_row<Float16, int8_t>(p, b, h, i, scratch)
                              : attend_row<Float16>(p, b, h, i, scratch);
                    break;
                case ElementType::BFloat16:
                    p.kv_int8 ? attend_row<BFloat16, int8_t>(p, b, h, i, scratch)
                              : attend_row<BFloat16>(p, b, h, i, scratch);
                    break;
            }
        }
    }
}

}  // namespace

void attention_reference(const AttentionProblem& p, int num_threads) {
    check_problem(p);
    check_num_threads(num_threads);
    const int64_t pair_count = p.q.shape[0] * p.q.shape[1];
    if (pair_count == 0 || p.q.shape[2] == 0) return;

    // Scratch for every thread, allocated here so that std::bad_alloc reaches the caller.
    int64_t longest_kv_len = 0;
    for (int64_t b = 0; b < p.q.shape[0]; ++b) longest_kv_len = std::max(longest_kv_len, p.kv_lens[b]);
    const int64_t thread_count = std::min<int64_t>(num_threads, pair_count);
    std::vector<RowScratch> scratch(static_cast<size_t>(thread_count));
    for (RowScratch& s : scratch) {
        s.visible.reserve(static_cast<size_t>(longest_kv_len));
        s.out_row.resize(static_cast<size_t>(p.v.shape[3]));
    }

    if (thread_count == 1) {
        attend_pairs(p, 0, pair_count, scratch[0]);
        return;
    }
    // Contiguous chunks of pairs; chunk t is [pair_count * t / T, pair_count * (t + 1) / T).
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(thread_count));
    try {
        for (int64_t t = 0; t < thread_count; ++t) {
            const int64_t begin = pair_count * t / thread_count;
            const int64_t end = pair_count * (t + 1) / thread_count;
            threads.emplace_back(attend_pairs, std::cref(p), begin, end, std::ref(scratch[t]));
        }
    } catch (...) {  // a thread failed to start: join the started ones before reporting
        for (std::thread& thread : threads) thread.join();
        throw;
    }
    for (std::thread& thread : threads) thread.join();
}

}  // namespace twinattn
