// attention_forward: planning of the fast kernel (docs/kernels.md, steps 1, 2, 5, 6, 7).
//
// Shapes (strides in elements, see problem.hpp):
//   q   (B, Hq,  Lq, D)      k (B, Hkv, Lk, D)      v (B, Hkv, Lk, Dv)
//   out (B, Hq,  Lq, Dv)     lse (B, Hq, Lq)        mask (B, Hq, Lq, Lk)
// G = Hq / Hkv query heads share a KV head; their rows are packed, position-major, into
// rows_per_group = Lq * G packed rows per (b, kv_head) (flash_kernel.hpp).
//
//   1. Plan: rows_per_group > kQTileRows -> prefill (tiles of packed rows), else split-key.
//   2. Prefill: in waves of (b, kv_head) groups whose panels fit in kPrefillPackBytes (at
//      least one group), pack the wave's K^T (and V) panels once (parallel), then its tiles
//      (b, kv_head, tile) most expensive first, each against all of its visible keys.
//   6. Split-key: items (b, kv_head, chunk of kSplitKeyChunk keys) write partial (m, l, O);
//      a second parallel pass merges each group's partials by log-sum-exp (merge_partials). A
//      group with one chunk writes out directly.
// Buffers: per-thread scratch (thread_local, grown on demand, reused across calls) and, on the
// calling thread, one wave's packed K and V and the partials (thread_local too, so concurrent callers on
// different threads never share them).
#include "twinattn/flash_attention.hpp"

#include <math.h>  // exp2f, log2f

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dispatch.hpp"
#include "flash_kernel.hpp"
#include "thread_pool.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {

// 128-bit arithmetic (GCC and Clang): q_offset may be any int64 when not causal.
__extension__ typedef __int128 int128;

void flash_row_key_range(const AttentionProblem& p, int64_t b, int64_t group, int64_t r,
                         int64_t* begin, int64_t* end) {
    const int64_t kv_len = p.kv_lens[b];
    *begin = 0;
    *end = kv_len;
    if (!p.causal && p.window_left < 0 && p.window_right < 0) return;
    const int128 position = static_cast<int128>(p.q_offset[b]) + r / group;
    int128 last = kv_len - 1;  // the last key the row may see, then the first
    if (p.causal) last = std::min<int128>(last, position);
    if (p.window_right >= 0) last = std::min<int128>(last, position + p.window_right);
    const int128 first = p.window_left >= 0 ? std::max<int128>(0, position - p.window_left) : 0;
    *end = static_cast<int64_t>(std::max<int128>(0, last + 1));
    *begin = static_cast<int64_t>(std::min<int128>(first, kv_len));
}

int64_t flash_row_position(const AttentionProblem& p, int64_t b, int64_t group, int64_t r) {
    const int128 bound = static_cast<int128>(1) << 62;
    const int128 position = static_cast<int128>(p.q_offset[b]) + r / group;
    return static_cast<int64_t>(std::max<int128>(-bound, std::min<int128>(bound, position)));
}

void flash_key_rows(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_begin, int64_t n,
                    const void** key_rows, const void** value_rows, float* key_scales, float* value_scales) {
    if (n <= 0) return;
    const int64_t item = p.kv_int8 ? 1 : element_size(p.dtype);
    const char* const k_data = static_cast<const char*>(p.k.data);
    const char* const v_data = static_cast<const char*>(p.v.data);
    // A run of count keys from output j0 on: consecutive slots from `slot` of page `page` (the
    // sequence b when dense). Entry offsets are page * stride[0] + kv_head * stride[1] + slot *
    // stride[2], in elements; within a run each output steps by its own stride[2] from the first
    // key's entry, one loop per output, with no multiply and no reload of the strides per key.
    const auto fill_run = [&](int64_t j0, int64_t page, int64_t slot, int64_t count) {
        const auto rows = [&](const void** dst, const char* data, const int64_t* stride) {
            const char* const first = data + (page * stride[0] + kv_head * stride[1] + slot * stride[2]) * item;
            const int64_t step = stride[2] * item;
            for (int64_t t = 0; t < count; ++t) dst[j0 + t] = first + t * step;
        };
        const auto scales = [&](float* dst, const float* data, const int64_t* stride) {
            const float* const first = data + page * stride[0] + kv_head * stride[1] + slot * stride[2];
            const int64_t step = stride[2];
            for (int64_t t = 0; t < count; ++t) dst[j0 + t] = first[t * step];
        };
        if (key_rows != nullptr) rows(key_rows, k_data, p.k.stride);
        if (value_rows != nullptr) rows(value_rows, v_data, p.v.stride);
        if (key_scales != nullptr) scales(key_scales, p.k_scale.data, p.k_scale.stride);
        if (value_scales != nullptr) scales(value_scales, p.v_scale.data, p.v_scale.stride);
    };
    if (p.pages.data == nullptr) {
        fill_run(0, b, key_begin, n);
        return;
    }
    // Paged: one run per page, the first from key_begin's slot.
    int64_t entry = key_begin / p.pages.block_size, slot = key_begin % p.pages.block_size;
    for (int64_t j = 0; j < n; ++entry, slot = 0) {
        const int64_t page = p.pages.data[entry * p.pages.stride];
        const int64_t count = p.pages.block_size - slot < n - j ? p.pages.block_size - slot : n - j;
        fill_run(j, page, slot, count);
        j += count;
    }
}

float flash_row_lse(float m, float l) {
    if (l == 0.0f) return -std::numeric_limits<float>::infinity();
    if (m == std::numeric_limits<float>::infinity()) return m;
    return kLn2 * (m + log2f(l));
}

// The multiply-adds of a problem, in double (the product of five int64 extents may overflow).
double problem_work(const AttentionProblem& p) {
    return static_cast<double>(p.q.shape[0]) * static_cast<double>(p.q.shape[1]) * static_cast<double>(p.q.shape[2]) *
           static_cast<double>(p.k.shape[2]) * static_cast<double>(p.q.shape[3] + p.v.shape[3]);
}

FlashPlan flash_plan(const AttentionProblem& p) {
    FlashPlan plan{};
    plan.problem = &p;
    plan.group = p.q.shape[1] / p.k.shape[1];
    plan.rows_per_group = p.q.shape[2] * plan.group;
    plan.head_dim = p.q.shape[3];
    plan.value_dim = p.v.shape[3];
    plan.value_stride = (plan.value_dim + 15) / 16 * 16;
    plan.has_softcap = p.softcap > 0.0f;
    // Softcap: Q times scale / softcap, then tanh(S) times softcap * log2(e) (flash_kernel.hpp).
    plan.q_multiplier = plan.has_softcap ? p.scale / p.softcap : p.scale * kLog2E;
    // A denormal softcap can make scale / softcap overflow: the largest float instead, so that a
    // zero in q stays 0 (not 0 * inf = NaN); every score that matters saturates tanh either way.
    if (std::isinf(plan.q_multiplier))
        plan.q_multiplier = std::copysign(std::numeric_limits<float>::max(), plan.q_multiplier);
    plan.softcap_multiplier = p.softcap * kLog2E;
    plan.has_mask = p.mask.kind != MaskKind::None;
    plan.has_alibi = p.alibi_slopes.data != nullptr;
    plan.has_sinks = p.sinks.data != nullptr;
    return plan;
}

namespace {

// A 64-byte aligned buffer that only grows; its contents are not preserved when it grows.
template <typename T>
class AlignedBuffer {
public:
    AlignedBuffer() = default;
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
    ~AlignedBuffer() { std::free(data_); }

    T* ensure(int64_t count) {
        if (count > capacity_) {
            const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
            T* grown = static_cast<T*>(std::aligned_alloc(64, bytes));
            if (grown == nullptr) throw std::bad_alloc();
            std::free(data_);
            data_ = grown;
            capacity_ = count;
        }
        return data_;
    }

private:
    T* data_ = nullptr;
    int64_t capacity_ = 0;
};

// Everything one thread needs for a work item (flash_kernel.hpp, ThreadScratch).
struct ScratchBuffers {
    AlignedBuffer<float> q_tile, scores, out_acc, row_max, row_sum, rescale, key_panels, key_scales, value_scales;
    AlignedBuffer<int64_t> row_key_begin, row_key_end;
    AlignedBuffer<uint32_t> probs_pairs;
    AlignedBuffer<const void*> key_rows, value_rows;
    AlignedBuffer<float> out_acc_lo;

    ThreadScratch view(int64_t D, int64_t value_stride, bool split_key, bool bf16_pairs, bool out32) {
        ThreadScratch s;
        s.q_tile = q_tile.ensure(kQTileRows * std::max<int64_t>(D, 1));
        s.scores = scores.ensure(kQTileRows * kKeyBlock);
        s.out_acc = out_acc.ensure(kQTileRows * std::max<int64_t>(value_stride, 1));
        s.row_max = row_max.ensure(kQTileRows);
        s.row_sum = row_sum.ensure(kQTileRows);
        s.rescale = rescale.ensure(kQTileRows);
        s.row_key_begin = row_key_begin.ensure(kQTileRows);
        s.row_key_end = row_key_end.ensure(kQTileRows);
        s.key_panels = split_key ? key_panels.ensure(kKeyBlock * std::max<int64_t>(D, 1)) : nullptr;
        s.probs_pairs = bf16_pairs ? probs_pairs.ensure(kQTileRows * kKeyBlock / 2) : nullptr;
        s.out_acc_lo = bf16_pairs && out32 ? out_acc_lo.ensure(kQTileRows * std::max<int64_t>(value_stride, 1)) : nullptr;
        s.key_scales = key_scales.ensure(kKeyBlock);
        s.value_scales = value_scales.ensure(kKeyBlock);
        s.key_rows = key_rows.ensure(2 * kKeyBlock);  // the block's, then the next block's (read-ahead)
        s.value_rows = value_rows.ensure(kKeyBlock);
        return s;
    }
};

ScratchBuffers& thread_scratch() {
    thread_local ScratchBuffers buffers;
    return buffers;
}

// Buffers owned by the calling thread for the length of one call.
struct CallerBuffers {
    AlignedBuffer<float> packed_keys, partial_out, partial_max, partial_sum;
    AlignedBuffer<float> value_panels;
    AlignedBuffer<uint32_t> packed_values;
    AlignedBuffer<unsigned char> value_finite;
};

CallerBuffers& caller_buffers() {
    thread_local CallerBuffers buffers;
    return buffers;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a > b ? a : b, and NaN when either is NaN (as flash_kernel.hpp's max_nan).
float max_nan(float a, float b) { return a != a || a > b ? a : b; }

// Items are taken in the order of their run's cost (run_cost), most expensive first, a run's
// items one after another, most expensive first. A run is the tiles of one (sequence, KV head) of
// a prefill plan, which read the same K and V panels: taken in a row, each core finds the panels
// of its last tile still in its L2 (docs/kernels.md, "What bounds prefill"). A split-key item is
// a run of its own.
struct CostedItem {
    const FlashPlan* plan;
    WorkItem item;
    int64_t cost;      // visible keys times rows
    int64_t run_cost;  // the cost of its run's most expensive item
};

// 8. A problem's part in a cascade (attention_paged's shared prefixes): a shared prefix
// (`shared`: every row of the sequences that share it against the shared keys, in row tiles and
// key chunks, all written as partials), or a sequence that shares one (its own keys from
// key_begin on, as partials; the merge adds the shared plan's partials, its rows from shared_row
// on). Default: no cascade.
struct CascadePart {
    bool shared = false;
    int64_t key_begin = 0;
    int64_t shared_plan = -1;
    int64_t shared_row = 0;
};

// A call's problems (attention_forward: one; attention_varlen and attention_paged: one per
// sequence) and what each plan takes of the caller's buffers.
struct PlanLayout {
    bool prefill;
    bool pairs;                      // prefill by bfloat16 dot products (avx512bf16)
    int64_t panel_size;              // floats (or pairs) per K panel
    int64_t keys_per_head;           // panels_per_head * kKeyPanel
    // What one head takes of the wave buffers (step 2): K^T panel floats (or pairs); the pair
    // path's V pairs and finite flags (0 elsewhere; the float32 V panels: plan.value_head_floats).
    int64_t head_floats, head_value_pairs, head_flags;
    // The plan's part of the current wave's buffers (plan.packed_keys etc., writeable): its heads
    // in the wave from plan.first_packed_head on.
    float* packed;
    float* value_panels;             // the float32 V panels (not the pair path)
    uint32_t* packed_values;
    unsigned char* value_finite;
    std::vector<int64_t> slot_base;  // split-key: first slot of (b, kv_head 0), B + 1 entries
    int64_t partial_at;              // its first slot among the call's
    CascadePart cascade;             // its part in a cascade (step 8), if any
};

void run_items(const FlashKernels& kernels, std::vector<CostedItem>& items, int num_threads) {
    std::stable_sort(items.begin(), items.end(), [](const CostedItem& a, const CostedItem& b) {
        if (a.run_cost != b.run_cost) return a.run_cost > b.run_cost;
        if (a.plan != b.plan) return a.plan < b.plan;  // plans lie in one vector, in call order
        if (a.item.b != b.item.b) return a.item.b < b.item.b;
        if (a.item.kv_head != b.item.kv_head) return a.item.kv_head < b.item.kv_head;
        return a.cost > b.cost;
    });
    parallel_for(static_cast<int64_t>(items.size()), num_threads, [&](int64_t index, int) {
        const CostedItem& costed = items[static_cast<size_t>(index)];
        const FlashPlan& plan = *costed.plan;
        const ThreadScratch scratch = thread_scratch().view(plan.head_dim, plan.value_stride, plan.packed_keys == nullptr,
                                                            plan.packed_values != nullptr,
                                                            plan.problem->out32.data != nullptr);
        const int dtype = static_cast<int>(plan.problem->dtype);
        const AttendRowsFn attend = plan.problem->kv_int8 ? kernels.attend_rows_int8[dtype] : kernels.attend_rows[dtype];
        attend(plan, costed.item, scratch);
    });
}

// 2. Prefill: what plan's K^T panels take (layout), then its tiles (after the panels are packed).
void layout_prefill(FlashPlan& plan, const FlashKernels& kernels, PlanLayout& layout) {
    const AttentionProblem& p = *plan.problem;
    plan.panels_per_head = ceil_div(p.k.shape[2], kKeyPanel);
    // bfloat16 with dot products (avx512bf16): K and V pair panels (a pair fills a float's slot).
    // (Not with int8 K/V: those take the convert path.)
    layout.pairs = kernels.pack_pairs != nullptr && p.dtype == ElementType::BFloat16 && !p.kv_int8;
    layout.panel_size = (layout.pairs ? ceil_div(plan.head_dim, 2) : plan.head_dim) * kKeyPanel;
    layout.keys_per_head = plan.panels_per_head * kKeyPanel;
    plan.value_head_floats = layout.pairs ? 0 : ceil_div(plan.value_dim, kValuePanel) * layout.keys_per_head * kValuePanel;
    layout.head_floats = plan.panels_per_head * layout.panel_size;
    layout.head_value_pairs = layout.pairs ? layout.keys_per_head / 2 * plan.value_stride : 0;
    layout.head_flags = layout.pairs ? layout.keys_per_head : 0;
}

// The bytes one head of a prefill plan takes of the wave buffers.
int64_t head_bytes(const FlashPlan& plan, const PlanLayout& layout) {
    return static_cast<int64_t>(sizeof(float)) * (layout.head_floats + plan.value_head_floats) +
           static_cast<int64_t>(sizeof(uint32_t)) * layout.head_value_pairs + layout.head_flags;
}

// Packs the panels of (b, kv_head) that some row may see: from the first row's window start
// (rounded down to a panel) to the last row's visible end. Its wave holds the head.
void pack_head(const FlashPlan& plan, const FlashKernels& kernels, const PlanLayout& layout, int64_t b,
               int64_t kv_head) {
    const AttentionProblem& p = *plan.problem;
    const int64_t head = b * p.k.shape[1] + kv_head - plan.first_packed_head;
    int64_t key_begin, key_end, unused;
    flash_row_key_range(p, b, plan.group, 0, &key_begin, &unused);
    flash_row_key_range(p, b, plan.group, plan.rows_per_group - 1, &unused, &key_end);
    const int64_t first_panel = key_begin / kKeyPanel;
    if (key_end <= first_panel * kKeyPanel) return;
    const int64_t first_key = first_panel * kKeyPanel;
    float* packed = layout.packed + (head * plan.panels_per_head + first_panel) * layout.panel_size;
    if (layout.pairs)
        kernels.pack_pairs(p, b, kv_head, first_key, key_end, reinterpret_cast<uint32_t*>(packed),
                           layout.packed_values + (head * layout.keys_per_head + first_key) / 2 * plan.value_stride,
                           layout.value_finite + head * layout.keys_per_head + first_key, plan.value_stride);
    else
        (p.kv_int8 ? kernels.pack_keys_int8 : kernels.pack_keys[static_cast<int>(p.dtype)])(p, b, kv_head, first_key,
                                                                                            key_end, packed);
    if (!layout.pairs)
        (p.kv_int8 ? kernels.pack_values_int8 : kernels.pack_values[static_cast<int>(p.dtype)])(
            p, b, kv_head, first_key, key_end, layout.value_panels + head * plan.value_head_floats + first_key * kValuePanel,
            layout.keys_per_head * kValuePanel);
}

void prefill_items(const FlashPlan& plan, std::vector<CostedItem>& items) {
    const AttentionProblem& p = *plan.problem;
    const int64_t B = p.q.shape[0], Hkv = p.k.shape[1];
    const int64_t tiles = ceil_div(plan.rows_per_group, kQTileRows);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) {
            const size_t run_begin = items.size();
            for (int64_t tile = 0; tile < tiles; ++tile) {
                const int64_t row_begin = tile * kQTileRows;
                const int64_t row_end = std::min(row_begin + kQTileRows, plan.rows_per_group);
                // Keys from the first row's window start (rounded down to a panel: blocks are
                // whole panels) to the last row's visible end; none when that is empty.
                int64_t first_key, last_key, unused;
                flash_row_key_range(p, b, plan.group, row_begin, &first_key, &unused);
                flash_row_key_range(p, b, plan.group, row_end - 1, &unused, &last_key);
                first_key = first_key / kKeyPanel * kKeyPanel;
                last_key = std::max(last_key, first_key);
                const int64_t cost = (last_key - first_key + kKeyBlock) * (row_end - row_begin);
                items.push_back(CostedItem{&plan, WorkItem{b, kv_head, row_begin, row_end, first_key, last_key, -1},
                                           cost, cost});
            }
            int64_t run_cost = 0;
            for (size_t i = run_begin; i < items.size(); ++i) run_cost = std::max(run_cost, items[i].cost);
            for (size_t i = run_begin; i < items.size(); ++i) items[i].run_cost = run_cost;
        }
}

// Chunks first_slot .. first_slot + chunks of a plan's partials, for the rows of a group that start
// at packed row first_row there.
struct PartialChunks {
    const FlashPlan* plan;
    int64_t first_slot, chunks, first_row;

    int64_t slot_row(int64_t chunk, int64_t r) const {
        return (first_slot + chunk) * plan->rows_per_group + first_row + r;
    }
};

// Step 6's merge: for every row of group (b, kv_head), chunks in order, m* = max_c m_c,
// l* = sum_c l_c 2^(m_c - m*), out = sum_c O_c 2^(m_c - m*) / l* and lse = ln 2 (m* + log2 l*).
// A chunk whose row saw a NaN or +inf score has m_c = NaN or +inf and l_c = NaN (flash_kernel.hpp,
// softmax_row), so m* (NaN-propagating) and the weights carry it into out and lse
// (flash_row_lse); a chunk that saw nothing has l_c = 0. A sink s (base 2) counts here once: m*
// starts at s and l* at 2^(s - m*). The row is summed in float32 (in out itself for float32, in
// row_buffer, Dv floats of this thread's, for the halves), then rounded to T once (and copied into
// out32 when given). The chunks come from `sources` in order: a cascade's shared prefix first (its
// plan's rows from first_row on), then the group's own.
template <typename T>
void merge_partials(const FlashPlan& plan, int64_t b, int64_t kv_head, const PartialChunks* sources, int count,
                    float* row_buffer) {
    const AttentionProblem& p = *plan.problem;
    const int64_t G = plan.group, Dv = plan.value_dim, rows = plan.rows_per_group;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = kv_head * G + r % G, i = r / G;
        const float sink = plan.has_sinks ? p.sinks.data[h * p.sinks.stride[0]] * kLog2E
                                          : -std::numeric_limits<float>::infinity();
        float m_star = sink;
        for (int source = 0; source < count; ++source) {
            const PartialChunks& chunks = sources[source];
            for (int64_t c = 0; c < chunks.chunks; ++c)
                m_star = max_nan(m_star, chunks.plan->partial_max[chunks.slot_row(c, r)]);
        }
        T* out_row = static_cast<T*>(p.out.data) + b * p.out.stride[0] + h * p.out.stride[1] + i * p.out.stride[2];
        float* dst = std::is_same<T, float>::value ? reinterpret_cast<float*>(out_row) : row_buffer;
        for (int64_t d = 0; d < Dv; ++d) dst[d] = 0.0f;
        float l_star = plan.has_sinks ? exp2f(sink - m_star) : 0.0f;
        for (int source = 0; source < count && m_star != -std::numeric_limits<float>::infinity(); ++source) {
            const PartialChunks& chunks = sources[source];
            for (int64_t c = 0; c < chunks.chunks; ++c) {
                const int64_t slot_row = chunks.slot_row(c, r);
                const float l_c = chunks.plan->partial_sum[slot_row];
                if (l_c == 0.0f) continue;
                const float weight = exp2f(chunks.plan->partial_max[slot_row] - m_star);
                l_star += l_c * weight;
                const float* o_c = chunks.plan->partial_out + slot_row * Dv;
                for (int64_t d = 0; d < Dv; ++d) dst[d] += o_c[d] * weight;
            }
        }
        if (l_star != 0.0f) {
            const float inverse = 1.0f / l_star;
            for (int64_t d = 0; d < Dv; ++d) dst[d] *= inverse;
        }
        if (!std::is_same<T, float>::value)
            for (int64_t d = 0; d < Dv; ++d) from_f32(dst[d], &out_row[d]);
        if (!std::is_same<T, float>::value && p.out32.data != nullptr) {
            float* out32_row = static_cast<float*>(p.out32.data) + b * p.out32.stride[0] + h * p.out32.stride[1] +
                               i * p.out32.stride[2];
            for (int64_t d = 0; d < Dv; ++d) out32_row[d] = dst[d];
        }
        if (p.lse.data != nullptr)
            p.lse.data[b * p.lse.stride[0] + h * p.lse.stride[1] + i * p.lse.stride[2]] = flash_row_lse(m_star, l_star);
    }
}

// 6. Split-key: chunks of every group's visible keys (slots numbered from 0 in each plan; the
// merge then combines each group's partials by log-sum-exp). A cascade's parts (step 8) always
// write partials, a shared plan in row tiles of at most kQTileRows rows, a sequence that shares
// a prefix from its key_begin on (no chunk when the prefix holds all its keys).
void split_key_items(const FlashPlan& plan, PlanLayout& layout, std::vector<CostedItem>* items) {
    const AttentionProblem& p = *plan.problem;
    const int64_t B = p.q.shape[0], Hkv = p.k.shape[1];
    const int64_t rows = plan.rows_per_group;
    const bool cascade = layout.cascade.shared || layout.cascade.shared_plan >= 0;
    layout.slot_base.assign(static_cast<size_t>(B) + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
        // Only the group's visible range is split: the first row's window start to the last
        // row's visible end.
        int64_t key_begin0, key_end, unused;
        flash_row_key_range(p, b, plan.group, 0, &key_begin0, &unused);
        flash_row_key_range(p, b, plan.group, rows - 1, &unused, &key_end);
        key_begin0 = std::max(key_begin0, layout.cascade.key_begin);
        key_end = std::max(key_end, key_begin0);
        const int64_t chunks = cascade ? ceil_div(key_end - key_begin0, kSplitKeyChunk)
                                       : std::max<int64_t>(1, ceil_div(key_end - key_begin0, kSplitKeyChunk));
        const bool partial = cascade || chunks > 1;
        layout.slot_base[b + 1] = layout.slot_base[b] + (partial ? chunks * Hkv : 0);
        if (items == nullptr) continue;  // counting slots only
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head)
            for (int64_t chunk = 0; chunk < chunks; ++chunk)
                for (int64_t row_begin = 0; row_begin < rows; row_begin += kQTileRows) {
                    const int64_t row_end = std::min(row_begin + kQTileRows, rows);
                    const int64_t key_begin = key_begin0 + chunk * kSplitKeyChunk;
                    const int64_t chunk_end = std::min(key_begin + kSplitKeyChunk, key_end);
                    const int64_t slot = partial ? layout.slot_base[b] + kv_head * chunks + chunk : -1;
                    const int64_t cost = (chunk_end - key_begin + kKeyBlock) * (row_end - row_begin);
                    items->push_back(CostedItem{
                        &plan, WorkItem{b, kv_head, row_begin, row_end, key_begin, partial ? chunk_end : key_end, slot},
                        cost, cost});
                }
    }
}

// One (plan, b, kv_head) of a call: a group to pack (prefill) or to merge (split-key).
struct Group {
    size_t plan;
    int64_t b, kv_head;
};

// Runs every problem of a call (none empty): the prefill plans' (b, kv_head) groups in waves
// (step 2: a wave's K^T and V panels packed in one parallel pass, then its tiles in another; the
// split-key items run with the first wave), then the merge of every split group (one parallel
// pass).
void run_problems(const std::vector<AttentionProblem>& problems, const std::vector<CascadePart>& cascade,
                  const FlashKernels& kernels, int num_threads) {
    double work = 0.0;
    for (const AttentionProblem& p : problems) work += problem_work(p);
    if (work < static_cast<double>(kSerialWork)) num_threads = 1;
    std::vector<FlashPlan> plans;
    std::vector<PlanLayout> layouts(problems.size());
    plans.reserve(problems.size());
    for (const AttentionProblem& p : problems) plans.push_back(flash_plan(p));

    // The prefill groups to pack, in call order, and every split plan's part of the partials.
    std::vector<Group> pack_groups;
    std::vector<size_t> first_group(plans.size(), 0);  // a prefill plan's first in pack_groups
    int64_t partial_rows = 0, partial_floats = 0;
    for (size_t i = 0; i < plans.size(); ++i) {
        FlashPlan& plan = plans[i];
        PlanLayout& layout = layouts[i];
        const int64_t B = plan.problem->q.shape[0], Hkv = plan.problem->k.shape[1];
        if (!cascade.empty()) layout.cascade = cascade[i];
        layout.prefill = plan.rows_per_group > kQTileRows && !layout.cascade.shared;
        if (layout.prefill) {
            layout_prefill(plan, kernels, layout);
            first_group[i] = pack_groups.size();
            for (int64_t b = 0; b < B; ++b)
                for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) pack_groups.push_back(Group{i, b, kv_head});
        } else {
            split_key_items(plan, layout, nullptr);
            layout.partial_at = partial_rows;
            partial_rows += layout.slot_base.back() * plan.rows_per_group;
            partial_floats += layout.slot_base.back() * plan.rows_per_group * plan.value_dim;
        }
    }

    // 2. Waves: consecutive groups, as many as fit in kPrefillPackBytes (at least one), groups
    // [wave_begin[w], wave_begin[w + 1]); the buffers hold the largest. With no prefill group, one
    // empty wave (the split-key items').
    std::vector<size_t> wave_begin{0};
    std::vector<size_t> wave_of_group(pack_groups.size(), 0);
    int64_t packed_floats = 0, value_panel_floats = 0, value_pairs = 0, finite_flags = 0;
    {
        int64_t bytes = 0, floats = 0, panel_floats = 0, pairs = 0, flags = 0;
        for (size_t g = 0; g < pack_groups.size(); ++g) {
            const FlashPlan& plan = plans[pack_groups[g].plan];
            const PlanLayout& layout = layouts[pack_groups[g].plan];
            const int64_t head = head_bytes(plan, layout);
            if (g > wave_begin.back() && bytes + head > kPrefillPackBytes) {
                wave_begin.push_back(g);
                bytes = floats = panel_floats = pairs = flags = 0;
            }
            bytes += head;
            floats += layout.head_floats;
            panel_floats += plan.value_head_floats;
            pairs += layout.head_value_pairs;
            flags += layout.head_flags;
            packed_floats = std::max(packed_floats, floats);
            value_panel_floats = std::max(value_panel_floats, panel_floats);
            value_pairs = std::max(value_pairs, pairs);
            finite_flags = std::max(finite_flags, flags);
            wave_of_group[g] = wave_begin.size() - 1;
        }
        wave_begin.push_back(pack_groups.size());
    }
    const size_t waves = wave_begin.size() - 1;

    CallerBuffers& buffers = caller_buffers();
    // (at least one element each: a prefill plan's packed_keys is never null, even with Lk = 0)
    float* packed = buffers.packed_keys.ensure(std::max<int64_t>(packed_floats, 1));
    uint32_t* packed_values = buffers.packed_values.ensure(std::max<int64_t>(value_pairs, 1));
    float* value_panels = buffers.value_panels.ensure(std::max<int64_t>(value_panel_floats, 1));
    unsigned char* value_finite = buffers.value_finite.ensure(std::max<int64_t>(finite_flags, 1));
    float* partial_out = partial_rows > 0 ? buffers.partial_out.ensure(std::max<int64_t>(partial_floats, 1)) : nullptr;
    float* partial_max = partial_rows > 0 ? buffers.partial_max.ensure(partial_rows) : nullptr;
    float* partial_sum = partial_rows > 0 ? buffers.partial_sum.ensure(partial_rows) : nullptr;
    std::vector<Group> merge_groups;
    int64_t partial_floats_at = 0;
    for (size_t i = 0; i < plans.size(); ++i) {
        FlashPlan& plan = plans[i];
        PlanLayout& layout = layouts[i];
        const int64_t B = plan.problem->q.shape[0], Hkv = plan.problem->k.shape[1];
        if (!layout.prefill && layout.slot_base.back() > 0) {
            plan.partial_out = partial_out + partial_floats_at;
            plan.partial_max = partial_max + layout.partial_at;
            plan.partial_sum = partial_sum + layout.partial_at;
            partial_floats_at += layout.slot_base.back() * plan.rows_per_group * plan.value_dim;
        }
        if (layout.prefill || layout.cascade.shared) continue;
        for (int64_t b = 0; b < B; ++b)  // a sequence that shares a prefix merges even with no chunk of its own
            for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head)
                if (layout.slot_base[b + 1] > layout.slot_base[b] || layout.cascade.shared_plan >= 0)
                    merge_groups.push_back(Group{i, b, kv_head});
    }

    // 2 and 6. Every plan's work items, each prefill tile in its group's wave.
    std::vector<std::vector<CostedItem>> wave_items(waves);
    for (size_t i = 0; i < plans.size(); ++i) {
        if (!layouts[i].prefill) {
            split_key_items(plans[i], layouts[i], &wave_items[0]);
            continue;
        }
        std::vector<CostedItem> items;
        prefill_items(plans[i], items);
        const int64_t Hkv = plans[i].problem->k.shape[1];
        for (const CostedItem& costed : items)
            wave_items[wave_of_group[first_group[i] + static_cast<size_t>(costed.item.b * Hkv + costed.item.kv_head)]]
                .push_back(costed);
    }
    for (size_t w = 0; w < waves; ++w) {
        // The wave's groups laid out in order: each plan's heads in it are consecutive, from the
        // first one's b * Hkv + kv_head (plan.first_packed_head).
        int64_t floats_at = 0, panel_floats_at = 0, pairs_at = 0, flags_at = 0;
        for (size_t g = wave_begin[w]; g < wave_begin[w + 1]; ++g) {
            const Group& group = pack_groups[g];
            FlashPlan& plan = plans[group.plan];
            PlanLayout& layout = layouts[group.plan];
            if (g == wave_begin[w] || pack_groups[g - 1].plan != group.plan) {
                plan.first_packed_head = group.b * plan.problem->k.shape[1] + group.kv_head;
                layout.packed = packed + floats_at;
                plan.packed_keys = layout.packed;
                if (layout.pairs) {
                    layout.packed_values = packed_values + pairs_at;
                    layout.value_finite = value_finite + flags_at;
                    plan.packed_values = layout.packed_values;
                    plan.value_finite = layout.value_finite;
                } else {
                    layout.value_panels = value_panels + panel_floats_at;
                    plan.value_panels = layout.value_panels;
                }
            }
            floats_at += layout.head_floats;
            panel_floats_at += plan.value_head_floats;
            pairs_at += layout.head_value_pairs;
            flags_at += layout.head_flags;
        }
        // 2. The wave's K^T (and V) panels, then its tiles (and, in the first, every split-key item).
        if (wave_begin[w + 1] > wave_begin[w])
            parallel_for(static_cast<int64_t>(wave_begin[w + 1] - wave_begin[w]), num_threads, [&](int64_t index, int) {
                const Group& group = pack_groups[wave_begin[w] + static_cast<size_t>(index)];
                pack_head(plans[group.plan], kernels, layouts[group.plan], group.b, group.kv_head);
            });
        run_items(kernels, wave_items[w], num_threads);
    }
    if (merge_groups.empty()) return;

    // 6. Merge, in chunk order.
    const int64_t max_value_dim = std::max_element(plans.begin(), plans.end(), [](const FlashPlan& a, const FlashPlan& b) {
                                      return a.value_dim < b.value_dim;
                                  })->value_dim;
    std::vector<std::vector<float>> merge_rows(static_cast<size_t>(
        problems[0].dtype == ElementType::Float32 ? 0
                                                  : std::min<int64_t>(num_threads, static_cast<int64_t>(merge_groups.size()))));
    for (std::vector<float>& row : merge_rows) row.resize(static_cast<size_t>(max_value_dim));
    parallel_for(static_cast<int64_t>(merge_groups.size()), num_threads, [&](int64_t index, int thread) {
        const Group& group = merge_groups[static_cast<size_t>(index)];
        const FlashPlan& plan = plans[group.plan];
        const std::vector<int64_t>& slot_base = layouts[group.plan].slot_base;
        const int64_t Hkv = plan.problem->k.shape[1];
        const int64_t chunks = (slot_base[group.b + 1] - slot_base[group.b]) / Hkv;
        float* row_buffer = merge_rows.empty() ? nullptr : merge_rows[static_cast<size_t>(thread)].data();
        // The shared prefix's chunks (a cascade: its plan's b is 0), then the group's own.
        PartialChunks sources[2];
        int count = 0;
        const CascadePart& part = layouts[group.plan].cascade;
        if (part.shared_plan >= 0) {
            const std::vector<int64_t>& shared_base = layouts[static_cast<size_t>(part.shared_plan)].slot_base;
            const int64_t shared_chunks = shared_base[1] / Hkv;
            sources[count++] = PartialChunks{&plans[static_cast<size_t>(part.shared_plan)],
                                             group.kv_head * shared_chunks, shared_chunks, part.shared_row};
        }
        sources[count++] = PartialChunks{&plan, slot_base[group.b] + group.kv_head * chunks, chunks, 0};
        switch (plan.problem->dtype) {
            case ElementType::Float32: merge_partials<float>(plan, group.b, group.kv_head, sources, count, row_buffer); break;
            case ElementType::Float16: merge_partials<Float16>(plan, group.b, group.kv_head, sources, count, row_buffer); break;
            case ElementType::BFloat16: merge_partials<BFloat16>(plan, group.b, group.kv_head, sources, count, row_buffer); break;
        }
    });
}

}  // namespace

void softcap_tanh(const float* x, int64_t x_stride, float* y, int64_t n) {
    const FlashKernels kernels = current_kernels();
    // Whole vectors only: the values padded with zeros to a multiple of the vector width.
    std::vector<float> values(static_cast<size_t>(ceil_div(n, kernels.width) * kernels.width), 0.0f);
    for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = x[i * x_stride];
    kernels.tanh_values(values.data(), static_cast<int64_t>(values.size()));
    std::copy(values.begin(), values.begin() + n, y);
}

void attention_forward(const AttentionProblem& p, int num_threads) {
    check_problem(p);
    check_num_threads(num_threads);
    const FlashKernels kernels = current_kernels();
    if (p.q.shape[0] == 0 || p.q.shape[1] == 0 || p.q.shape[2] == 0) return;
    run_problems(std::vector<AttentionProblem>{p}, {}, kernels, num_threads);
}

namespace {

// The checked sequences of a packed call (none empty), after num_threads and the kernels.
void run_sequences(const std::vector<AttentionProblem>& sequences, const std::vector<CascadePart>& cascade,
                   int64_t q_heads, int num_threads) {
    check_num_threads(num_threads);
    const FlashKernels kernels = current_kernels();
    if (sequences.empty() || q_heads == 0) return;
    run_problems(sequences, cascade, kernels, num_threads);
}

// 8. Cascade: runs of consecutive sequences (each with query rows) whose block tables start with
// the same block ids share their first `shared` keys, shared = min(common blocks * block_size,
// the shortest sequence's keys); a shared part of at least kKeyBlock keys that every query row of
// the run sees whole (each sequence's first row sees up to it, its last row from key 0: causal
// with the prefix before the rows, no left window) and no ALiBi (its bias differs per sequence),
// each sequence split-key (at most kQTileRows packed rows), becomes one more problem: all the
// run's rows (contiguous in q) against the shared keys, not causal. Appends those problems to
// `sequences` (their q_offset and kv_len in `positions`) and returns every problem's part.
std::vector<CascadePart> plan_cascade(const PagedProblem& p, std::vector<AttentionProblem>& sequences,
                                      std::vector<int64_t>& positions) {
    std::vector<CascadePart> parts(sequences.size());
    if (p.options.alibi_slopes.data == nullptr && p.q.shape[1] > 0) {
        const int64_t batch = p.block_table.shape[0], block_size = p.k_cache.shape[1];
        const auto entry = [&](int64_t b, int64_t e) {
            return p.block_table.data[b * p.block_table.stride[0] + e * p.block_table.stride[1]];
        };
        std::vector<int64_t> index(static_cast<size_t>(batch), -1);  // each sequence's problem
        for (int64_t b = 0, n = 0; b < batch; ++b)
            if (p.cu_seqlens_q[b + 1] > p.cu_seqlens_q[b]) index[static_cast<size_t>(b)] = n++;
        const auto member = [&](int64_t b) { return index[static_cast<size_t>(b)] >= 0 && p.seq_lens[b] > 0; };
        struct Run {
            int64_t first, last, shared;
        };
        std::vector<Run> runs;
        for (int64_t first = 0, last = 0; first < batch; first = last + 1) {
            last = first;
            if (!member(first)) continue;
            while (last + 1 < batch && member(last + 1) && entry(last + 1, 0) == entry(first, 0)) ++last;
            if (last == first) continue;
            int64_t shortest = p.seq_lens[first];
            for (int64_t b = first; b <= last; ++b) shortest = std::min(shortest, p.seq_lens[b]);
            int64_t common = 0;
            for (bool same = true; same && common < ceil_div(shortest, block_size); common += same) {
                for (int64_t b = first + 1; b <= last; ++b) same = same && entry(b, common) == entry(first, common);
            }
            const int64_t shared = std::min(common * block_size, shortest);
            bool whole = shared >= kKeyBlock;
            for (int64_t b = first; b <= last && whole; ++b) {
                const AttentionProblem& s = sequences[static_cast<size_t>(index[static_cast<size_t>(b)])];
                const int64_t group = s.q.shape[1] / s.k.shape[1], rows = s.q.shape[2] * group;
                int64_t begin, end, unused;
                flash_row_key_range(s, 0, group, 0, &unused, &end);
                flash_row_key_range(s, 0, group, rows - 1, &begin, &unused);
                whole = rows <= kQTileRows && end >= shared && begin == 0;
            }
            if (whole) runs.push_back(Run{first, last, shared});
        }
        positions.assign(2 * runs.size(), 0);
        for (size_t r = 0; r < runs.size(); ++r) {
            const Run& run = runs[r];
            const int64_t first_index = index[static_cast<size_t>(run.first)];
            AttentionProblem shared = sequences[static_cast<size_t>(first_index)];
            const int64_t group = shared.q.shape[1] / shared.k.shape[1];
            shared.q.shape[2] = shared.out.shape[2] = p.cu_seqlens_q[run.last + 1] - p.cu_seqlens_q[run.first];
            shared.lse.data = nullptr;
            shared.k.shape[2] = shared.v.shape[2] = run.shared;
            if (shared.kv_int8) shared.k_scale.shape[2] = shared.v_scale.shape[2] = run.shared;
            shared.causal = false;
            shared.window_left = shared.window_right = -1;
            shared.sinks = ParamView1{nullptr, {0}, {0}};
            positions[2 * r + 1] = run.shared;
            shared.q_offset = Int64Span(&positions[2 * r], 1);
            shared.kv_lens = Int64Span(&positions[2 * r + 1], 1);
            for (int64_t b = run.first; b <= run.last; ++b) {
                CascadePart& part = parts[static_cast<size_t>(index[static_cast<size_t>(b)])];
                part.key_begin = run.shared;
                part.shared_plan = static_cast<int64_t>(sequences.size());
                part.shared_row = (p.cu_seqlens_q[b] - p.cu_seqlens_q[run.first]) * group;
            }
            sequences.push_back(shared);
            parts.push_back(CascadePart{true, 0, -1, 0});
        }
    }
    return parts;
}

}  // namespace

void attention_varlen(const VarlenProblem& problem, int num_threads) {
    std::vector<int64_t> positions;
    run_sequences(varlen_sequences(problem, positions), {}, problem.q.shape[1], num_threads);
}

void attention_paged(const PagedProblem& problem, int num_threads) {
    std::vector<int64_t> positions, shared_positions;
    std::vector<AttentionProblem> sequences = paged_sequences(problem, positions);
    const std::vector<CascadePart> cascade = plan_cascade(problem, sequences, shared_positions);
    run_sequences(sequences, cascade, problem.q.shape[1], num_threads);
}

}  // namespace twinattn
