// attention_backward: FlashAttention-2's backward pass (docs/kernels.md, "Backward").
//
// Shapes (strides in elements, problem.hpp):
//   q, dq (B, Hq, Lq, D)    k, dk (B, Hkv, Lk, D)    v, dv (B, Hkv, Lk, Dv)
//   out, dout (B, Hq, Lq, Dv)    lse (B, Hq, Lq)    dsinks (Hq,)
// Query rows are packed as in the forward (flash_kernel.hpp): packed row r of (b, kv_head) is
// position i = r / G of query head h = kv_head * G + r % G, so one pass over a group's packed
// rows sums dK and dV over its G query heads without copying K or V.
//
//   0. K, K^T and V^T of every (b, kv_head) in float32, packed once per call (the keys a
//      pass reads: below kv_lens[b]), and the query side, Q, Q times the Q multiplier and dO of
//      every packed row, in float32 once per call; shared read-only by every item of passes 2
//      and 3.
//   1. Drow = rowsum(dO * O) of every query row (float32, into a (B, Hq, Lq) buffer); dsinks.
//   2. dK, dV: items (b, kv_head, key block of kBackwardKeyBlock keys), each owning its dk and
//      dv rows. For every query tile (kQTileRows packed rows) that sees the block: S recomputed
//      as the forward scores it (scale, softcap, ALiBi, mask, visibility: the forward's plan and
//      mask_block), P = 2^(S - lse log2 e), dP = dO V^T, dS = P (dP - Drow) (softcap: times
//      1 - tanh^2), dV += P^T dO, dK += scale dS^T Q. Rounded once into dk and dv.
//   3. dQ: items (b, kv_head, query tile), each owning its dq rows: for every key block the tile
//      sees, P and dS recomputed as in 2, dQ += scale dS K. Rounded once into dq.
//
// Passes 2 and 3 fused (head_gradients, when fused_pass says it pays): items (b, kv_head), each
// owning the head's dq, dk and dv: pass 2 over the head's key blocks in order, each tile's
// dQ += scale dS K summed into the head's float32 dQ sums as it goes, so S and dP are computed
// once.
// Determinism: every gradient element is summed by the one item that owns it, in a fixed order
// (query rows ascending for dK and dV, keys ascending for dQ), so the results depend neither on
// num_threads nor on the schedule. The fused pass sums every element in the same order as passes
// 2 and 3 (the same bits); it trades their finer items for five products instead of seven.
// The inner products (S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K) are the
// instruction set's backward kernels (backward_kernel.hpp, through dispatch.cpp's table): one fma
// chain per element in a fixed order, so the results depend on the instruction set as the
// forward's do, and match Rust bit for bit on the same one. The rest (Drow, dsinks, P and dS per
// element, the softcap's tanh) is portable code over the scalar vector type (simd_scalar.hpp),
// the same on every instruction set and, operation for operation, in Rust.
#include "twinattn/flash_backward.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dispatch.hpp"
#include "flash_kernel.hpp"
#include "simd_scalar.hpp"
#include "thread_pool.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {
namespace {

using V = VecScalar;
// The forward's tanh and mask_block, on the portable vector type.
using ScalarKernel = flash::Kernel<VecScalar>;
constexpr int64_t W = V::kWidth;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// float32 storage grown on demand whose data starts a 64-byte line (so no vector load of a
// panel straddles two), kept for its owner's life.
class AlignedFloats {
public:
    float* ensure(int64_t count) {
        constexpr int64_t kLine = 64 / sizeof(float);
        if (static_cast<int64_t>(buffer_.size()) < count + kLine) buffer_.resize(static_cast<size_t>(count + kLine));
        const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(buffer_.data()) % 64);
        return buffer_.data() + (64 - misaligned) % 64 / static_cast<int64_t>(sizeof(float));
    }

private:
    std::vector<float> buffer_;
};

// Pass 0's packed keys of one call, for (b, kv_head) head = b * Hkv + kv_head and its key block
// kb (kBackwardKeyBlock keys from kb * kBackwardKeyBlock), block = head * key_blocks + kb:
//   keys         (kBackwardKeyBlock, D) at block * kBackwardKeyBlock * D     K rows (dQ += dS K)
//   key_panels   (D, kBackwardKeyBlock) at block * D * kBackwardKeyBlock     K^T (S = Q K^T)
//   value_panels (Dv, kBackwardKeyBlock) at block * Dv * kBackwardKeyBlock   V^T (dP = dO V^T)
// Keys at or past kv_lens[b] are 0 (never read from k or v).
struct PackedKeys {
    float* keys;
    float* key_panels;
    float* value_panels;
    int64_t key_blocks;  // per head: Lk / kBackwardKeyBlock rounded up
};

// Pass 0's packed query side of one call, for (b, kv_head) head = b * Hkv + kv_head and its
// packed row r, row = head * rows_per_group + r:
//   query_rows   (rows, D) at row * D     Q (dK += dS^T Q)
//   query_scaled (rows, D) at row * D     Q times the Q multiplier (S = Q K^T)
//   dout_rows    (rows, Dv) at row * Dv   dO (dP = dO V^T, dV += P^T dO)
struct PackedQueries {
    float* query_rows;
    float* query_scaled;
    float* dout_rows;
};

// What the items of one call share.
struct BackwardPlan {
    const BackwardProblem* problem;
    FlashPlan flash;          // the forward's plan: group, shapes, Q multiplier, variants' flags
    const float* row_delta;   // Drow of every query row, (B, Hq, Lq) contiguous
    BackwardKernels kernels;  // the inner products, of the instruction set in use (backward_kernel.hpp)
    PackedKeys packed;        // pass 0's keys
    PackedQueries queries;    // pass 0's query side
    bool fused;               // passes 2 and 3 run as one, per head (fused_pass)
};

// One key block of the packed keys: its K rows, K^T and V^T.
struct KeyBlock {
    float* keys;
    float* key_panel;
    float* value_panel;
};

// Key block key_block (a multiple of kBackwardKeyBlock) of (b, kv_head) in the packed keys.
KeyBlock key_block_at(const BackwardPlan& plan, int64_t b, int64_t kv_head, int64_t key_block) {
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim, Hkv = plan.problem->forward.k.shape[1];
    const int64_t block = (b * Hkv + kv_head) * plan.packed.key_blocks + key_block / kBackwardKeyBlock;
    return KeyBlock{plan.packed.keys + block * kBackwardKeyBlock * D, plan.packed.key_panels + block * D * kBackwardKeyBlock,
                    plan.packed.value_panels + block * Dv * kBackwardKeyBlock};
}

// The tile's rows in the packed query side: Q, Q times the multiplier, dO (rows of D, D, Dv).
struct QueryRows {
    float* rows;
    float* scaled;
    float* dout;
};

QueryRows query_rows_at(const BackwardPlan& plan, const WorkItem& tile) {
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim, Hkv = plan.problem->forward.k.shape[1];
    const int64_t row = (tile.b * Hkv + tile.kv_head) * plan.flash.rows_per_group + tile.row_begin;
    return QueryRows{plan.queries.query_rows + row * D, plan.queries.query_scaled + row * D,
                     plan.queries.dout_rows + row * Dv};
}

// The calling thread's packed keys and query side (thread_local: concurrent callers never share
// them), reused across calls so that a call does not fault their pages in again.
struct CallerBuffers {
    AlignedFloats keys, key_panels, value_panels, query_rows, query_scaled, dout_rows;
};

CallerBuffers& caller_buffers() {
    thread_local CallerBuffers buffers;
    return buffers;
}

// What one thread's scratch is sized for: D, Dv and the rows of dQ sums (a tile's kQTileRows,
// or a head's rows_per_group in the fused pass).
struct ScratchShape {
    int64_t head_dim, value_dim, query_grad_rows;
};

// One thread's tiles (grown on demand, kept for the thread's life):
//   row_buffer (2 Dv)                 one row of out and of dO (pass 1)
//   row_delta, row_lse (kQTileRows)   Drow and lse * log2(e) of the tile's rows
//   row_key_begin, row_key_end        each row's visible key range
//   scores, capped, grads (kQTileRows, kKeyBlock): S then P; tanh of the softcap; scale * dS
//   key_grad, value_grad (kBackwardKeyBlock, D / Dv), query_grad (query_grad_rows, D): float32
//   sums (query_grad_rows: a tile's kQTileRows, or a head's rows_per_group in the fused pass)
struct BackwardScratch {
    std::vector<float> row_buffer, row_delta, row_lse, scores, capped, grads, key_grad, value_grad, query_grad;
    std::vector<int64_t> row_key_begin, row_key_end;

    void ensure(const ScratchShape& shape) {
        const int64_t D = shape.head_dim, Dv = shape.value_dim;
        const auto grow = [](std::vector<float>& buffer, int64_t count) {
            if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(static_cast<size_t>(count));
        };
        grow(row_buffer, 2 * Dv);
        grow(row_delta, kQTileRows);
        grow(row_lse, kQTileRows);
        grow(scores, kQTileRows * kKeyBlock);
        grow(capped, kQTileRows * kKeyBlock);
        grow(grads, kQTileRows * kKeyBlock);
        grow(key_grad, kBackwardKeyBlock * D);
        grow(value_grad, kBackwardKeyBlock * Dv);
        grow(query_grad, shape.query_grad_rows * D);
        if (static_cast<int64_t>(row_key_end.size()) < kQTileRows) {
            row_key_begin.resize(kQTileRows);
            row_key_end.resize(kQTileRows);
        }
    }
};

BackwardScratch& backward_scratch() {
    thread_local BackwardScratch scratch;
    return scratch;
}

// parallel_for over `items` (thread_pool.hpp), each run as fn(index, scratch) with the calling
// thread's scratch, sized for `shape`.
template <typename Fn>
void for_each_item(int64_t items, int num_threads, const ScratchShape& shape, const Fn& fn) {
    parallel_for(items, num_threads, [&](int64_t index, int) {
        BackwardScratch& s = backward_scratch();
        s.ensure(shape);
        fn(index, s);
    });
}

// sum_d a[d] b[d] over n floats: kScalarWidth partial sums (lane d % width, V::fma), folded as
// V::reduce_sum folds them.
float dot(const float* a, const float* b, int64_t n) {
    V::Reg acc = V::zero();
    int64_t d = 0;
    for (; d + W <= n; d += W) acc = V::fma(V::load(a + d), V::load(b + d), acc);
    if (d < n) acc = V::fma(V::load_tail(a + d, n - d), V::load_tail(b + d, n - d), acc);
    return V::reduce_sum(acc);
}

// Row i of head h of sequence b of a (B, H, L, n) view, as T.
template <typename T, typename View>
T* view_row(const View& view, int64_t b, int64_t h, int64_t i) {
    return static_cast<T*>(const_cast<void*>(static_cast<const void*>(view.data))) + b * view.stride[0] +
           h * view.stride[1] + i * view.stride[2];
}

// Rounds n float32 sums from src into row i of head h of sequence b of a gradient.
template <typename T>
void store_row(const MutTensorView4& gradient, int64_t b, int64_t h, int64_t i, const float* src, int64_t n) {
    T* dst = view_row<T>(gradient, b, h, i);
    for (int64_t d = 0; d < n; ++d) from_f32(src[d], &dst[d]);
}

// lse[b, h, i] of the problem.
float lse_at(const BackwardProblem& bp, int64_t b, int64_t h, int64_t i) {
    const LseView& lse = bp.forward.lse;
    return lse.data[b * lse.stride[0] + h * lse.stride[1] + i * lse.stride[2]];
}

// Pass 1: Drow of the Lq rows of (b, h) into delta; row_buffer holds 2 Dv floats.
template <typename T>
void row_deltas(const BackwardProblem& bp, int64_t b, int64_t h, float* delta, float* row_buffer) {
    const AttentionProblem& p = bp.forward;
    const int64_t Lq = p.q.shape[2], Dv = p.v.shape[3];
    float* out_row = row_buffer;
    float* dout_row = row_buffer + Dv;
    for (int64_t i = 0; i < Lq; ++i) {
        const T* out = view_row<T>(p.out, b, h, i);
        const T* dout = view_row<T>(bp.dout, b, h, i);
        for (int64_t c = 0; c < Dv; ++c) {
            out_row[c] = to_f32(out[c]);
            dout_row[c] = to_f32(dout[c]);
        }
        delta[i] = dot(dout_row, out_row, Dv);
    }
}

// Pass 1: dsinks[h] = -sum over b, i (in that order) of 2^(sink log2 e - lse log2 e) Drow.
void sink_gradients(const BackwardProblem& bp, const float* delta) {
    const AttentionProblem& p = bp.forward;
    const int64_t B = p.q.shape[0], Hq = p.q.shape[1], Lq = p.q.shape[2];
    for (int64_t h = 0; h < Hq; ++h) {
        const float sink = p.sinks.data[h * p.sinks.stride[0]] * kLog2E;
        float sum = 0.0f;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < Lq; ++i) {
                sum = sum + V::exp2_lane(sink - lse_at(bp, b, h, i) * kLog2E) * delta[(b * Hq + h) * Lq + i];
            }
        bp.dsinks.data[h * bp.dsinks.stride[0]] = 0.0f - sum;
    }
}

// The tile's rows (packed rows tile.row_begin + r, r < rows): Drow, lse * log2(e) and the
// visible key range (Q and dO are pass 0's packed query side).
void load_tile(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, BackwardScratch& s) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t G = plan.flash.group;
    const int64_t Hq = p.q.shape[1], Lq = p.q.shape[2], b = tile.b;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t packed = tile.row_begin + r;
        const int64_t h = tile.kv_head * G + packed % G, i = packed / G;
        s.row_delta[r] = plan.row_delta[(b * Hq + h) * Lq + i];
        s.row_lse[r] = lse_at(bp, b, h, i) * kLog2E;
        flash_row_key_range(p, b, G, packed, &s.row_key_begin[r], &s.row_key_end[r]);
    }
}

// Pass 0: the keys of (b, kv_head) into the packed keys (PackedKeys): keys below kv_lens[b]
// converted to float32, the rest of the head's blocks 0.
template <typename T>
void pack_keys(const BackwardPlan& plan, int64_t b, int64_t kv_head) {
    const AttentionProblem& p = plan.problem->forward;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    for (int64_t key_block = 0; key_block < plan.packed.key_blocks * kBackwardKeyBlock; key_block += kBackwardKeyBlock) {
        const KeyBlock block = key_block_at(plan, b, kv_head, key_block);
        const int64_t n = std::clamp<int64_t>(p.kv_lens[b] - key_block, 0, kBackwardKeyBlock);
        for (int64_t j = 0; j < n; ++j) {
            const T* k = view_row<T>(p.k, b, kv_head, key_block + j);
            for (int64_t d = 0; d < D; ++d) {
                const float x = to_f32(k[d]);
                block.keys[j * D + d] = x;
                block.key_panel[d * kBackwardKeyBlock + j] = x;
            }
            const T* v = view_row<T>(p.v, b, kv_head, key_block + j);
            for (int64_t c = 0; c < Dv; ++c) block.value_panel[c * kBackwardKeyBlock + j] = to_f32(v[c]);
        }
        std::fill(block.keys + n * D, block.keys + kBackwardKeyBlock * D, 0.0f);
        for (int64_t d = 0; d < D; ++d)
            std::fill(block.key_panel + d * kBackwardKeyBlock + n, block.key_panel + (d + 1) * kBackwardKeyBlock, 0.0f);
        for (int64_t c = 0; c < Dv; ++c)
            std::fill(block.value_panel + c * kBackwardKeyBlock + n, block.value_panel + (c + 1) * kBackwardKeyBlock,
                      0.0f);
    }
}

// The work item of all rows_per_group packed rows of (b, kv_head).
WorkItem head_item(int64_t b, int64_t kv_head, int64_t rows_per_group) {
    return WorkItem{b, kv_head, 0, rows_per_group, 0, 0, -1};
}

// Pass 0: the query side of (b, kv_head) into the packed query side (PackedQueries): Q, Q times
// the Q multiplier and dO of every packed row, converted to float32.
template <typename T>
void pack_queries(const BackwardPlan& plan, int64_t b, int64_t kv_head) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t G = plan.flash.group, D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const QueryRows rows = query_rows_at(plan, head_item(b, kv_head, plan.flash.rows_per_group));
    for (int64_t packed = 0; packed < plan.flash.rows_per_group; ++packed) {
        const int64_t h = kv_head * G + packed % G, i = packed / G;
        const T* q = view_row<T>(p.q, b, h, i);
        for (int64_t d = 0; d < D; ++d) {
            const float x = to_f32(q[d]);
            rows.rows[packed * D + d] = x;
            rows.scaled[packed * D + d] = x * plan.flash.q_multiplier;
        }
        const T* dout = view_row<T>(bp.dout, b, h, i);
        for (int64_t c = 0; c < Dv; ++c) rows.dout[packed * Dv + c] = to_f32(dout[c]);
    }
}

// P and scale * dS of the tile's rows against the n keys of the packed block from key_block:
// s.scores (P) and s.grads, rows of stride kKeyBlock (as the forward's mask_block reads them), S
// and dP by the kernels' panel products over n rounded up to kKeyPanel keys. A hidden key has
// P = 0 and dS = 0, and its dP is never used (no 0 * NaN from it); a row with no legal key
// (lse = -inf) is all zeros. Returns the gate of the accumulations: null when no P of the rows x
// n is 0 (every term then counts: the kernels' ungated blocks), else s.scores.
const float* tile_gradients(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, int64_t key_block,
                            int64_t n, BackwardScratch& s) {
    const FlashPlan& fp = plan.flash;
    const int64_t D = fp.head_dim, Dv = fp.value_dim;
    const int64_t n_padded = ceil_div(n, kKeyPanel) * kKeyPanel;
    const KeyBlock block = key_block_at(plan, tile.b, tile.kv_head, key_block);
    const QueryRows queries = query_rows_at(plan, tile);
    // (a) S = (Q times the multiplier) K^T, in base 2; softcap: t = tanh(S) kept, S = t softcap log2 e.
    // dP = dO V^T into s.grads.
    const auto product = [&](const float* a, int64_t depth, const float* panel, float* out) {
        plan.kernels.panel_product(PanelProduct{a, rows, depth, panel, kBackwardKeyBlock, n_padded, out, kKeyBlock});
    };
    product(queries.scaled, D, block.key_panel, s.scores.data());
    product(queries.dout, Dv, block.value_panel, s.grads.data());
    for (int64_t r = 0; r < rows; ++r) {
        float* row = s.scores.data() + r * kKeyBlock;
        for (int64_t j = n; j < n_padded; ++j) row[j] = 0.0f;
        if (!fp.has_softcap) continue;
        float* capped = s.capped.data() + r * kKeyBlock;
        for (int64_t j = 0; j < n_padded; j += W) {
            const V::Reg t = ScalarKernel::tanh(V::load(row + j));
            V::store(capped + j, t);
            V::store(row + j, V::mul(t, V::broadcast(fp.softcap_multiplier)));
        }
    }
    // (b) Visibility, ALiBi and the mask: the forward's own code.
    ThreadScratch view{};
    view.scores = s.scores.data();
    view.row_key_begin = s.row_key_begin.data();
    view.row_key_end = s.row_key_end.data();
    ScalarKernel::mask_block(fp, tile, view, rows, key_block, n);
    // The padding keys [n, n_padded): S = -inf, so P = 0 there too (row_gradients runs over them).
    for (int64_t r = 0; r < rows; ++r)
        std::fill(s.scores.begin() + r * kKeyBlock + n, s.scores.begin() + r * kKeyBlock + n_padded, kNegInf);
    // (c) P = 2^(S - lse log2 e); dS = P (dP - Drow), softcap: times 1 - t^2; times scale (the
    // kernels' row_gradients, over the n_padded keys).
    const float scale = plan.problem->forward.scale;
    int64_t zeros = 0;  // P of the rows x n that are 0 (counted, not tested: the loop vectorises)
    for (int64_t r = 0; r < rows; ++r) {
        float* probs = s.scores.data() + r * kKeyBlock;
        float* grads = s.grads.data() + r * kKeyBlock;
        if (s.row_lse[r] == kNegInf) {  // no legal key: P = 0 and dS = 0
            std::fill(probs, probs + n_padded, 0.0f);
            std::fill(grads, grads + n_padded, 0.0f);
            zeros += n;
            continue;
        }
        const float* capped = fp.has_softcap ? s.capped.data() + r * kKeyBlock : nullptr;
        plan.kernels.row_gradients(RowGradients{probs, grads, capped, n_padded, s.row_lse[r], s.row_delta[r], scale});
        for (int64_t j = 0; j < n; ++j) zeros += probs[j] == 0.0f ? 1 : 0;
    }
    return zeros == 0 ? nullptr : s.scores.data();
}

// Row r of the tile: query_grads[r] += dS[r, .] K, over the n keys of the block from key_block in
// order (dS in s.grads, gated as tile_gradients returned).
void accumulate_query_rows(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, int64_t key_block, int64_t n,
                           const float* gate, const BackwardScratch& s, float* query_grads) {
    const int64_t D = plan.flash.head_dim;
    const float* keys = key_block_at(plan, tile.b, tile.kv_head, key_block).keys;
    plan.kernels.accumulate(Accumulation{query_grads, D, rows, D, s.grads.data(), gate, 1, kKeyBlock, keys, D, n});
}

// Rounds the float32 dQ sums of the tile's rows (rows of D from query_grads) into dq.
template <typename T>
void store_query_rows(const BackwardPlan& plan, const WorkItem& tile, const float* query_grads) {
    const int64_t G = plan.flash.group, D = plan.flash.head_dim;
    for (int64_t packed = tile.row_begin; packed < tile.row_end; ++packed) {
        store_row<T>(plan.problem->dq, tile.b, tile.kv_head * G + packed % G, packed / G,
                     query_grads + (packed - tile.row_begin) * D, D);
    }
}

// Pass 2: dK and dV of keys [key_block, key_block + kBackwardKeyBlock) of (b, kv_head), every query
// tile that sees them summed in row order; keys past kv_lens[b] get 0. With query_grads (the
// fused pass: the head's dQ sums, packed rows of D), also dQ += dS K of every such tile's rows,
// over the block's keys in order.
template <typename T>
void key_block_gradients(const BackwardPlan& plan, int64_t b, int64_t kv_head, int64_t key_block,
                         BackwardScratch& s, float* query_grads) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t G = plan.flash.group, D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const int64_t n = std::min(kBackwardKeyBlock, p.k.shape[2] - key_block);
    const int64_t visible = std::max<int64_t>(0, std::min(n, p.kv_lens[b] - key_block));
    std::fill(s.key_grad.begin(), s.key_grad.begin() + n * D, 0.0f);
    std::fill(s.value_grad.begin(), s.value_grad.begin() + n * Dv, 0.0f);
    for (int64_t row_begin = 0; visible > 0 && row_begin < plan.flash.rows_per_group; row_begin += kQTileRows) {
        const int64_t row_end = std::min(row_begin + kQTileRows, plan.flash.rows_per_group);
        // Rows are ordered by position, and so are their visible ranges: a tile whose first row
        // starts past the block or whose last row ends before it sees none of its keys.
        int64_t first_key, last_key, unused;
        flash_row_key_range(p, b, G, row_begin, &first_key, &unused);
        flash_row_key_range(p, b, G, row_end - 1, &unused, &last_key);
        if (first_key >= key_block + visible || last_key <= key_block) continue;
        const WorkItem tile{b, kv_head, row_begin, row_end, key_block, key_block + visible, -1};
        const int64_t rows = row_end - row_begin;
        load_tile(plan, tile, rows, s);
        const float* gate = tile_gradients(plan, tile, rows, key_block, visible, s);
        // Key j's rows: dV += P[., j]^T dO, dK += dS[., j]^T Q, over the tile's rows in order.
        const auto key_rows = [&](std::vector<float>& y, int64_t width, const std::vector<float>& coef,
                                  const float* x) {
            return Accumulation{y.data(), width, visible, width, coef.data(), gate, kKeyBlock, 1, x, width, rows};
        };
        const QueryRows queries = query_rows_at(plan, tile);
        plan.kernels.accumulate(key_rows(s.value_grad, Dv, s.scores, queries.dout));
        plan.kernels.accumulate(key_rows(s.key_grad, D, s.grads, queries.rows));
        if (query_grads != nullptr)
            accumulate_query_rows(plan, tile, rows, key_block, visible, gate, s, query_grads + row_begin * D);
    }
    for (int64_t j = 0; j < n; ++j) {
        store_row<T>(bp.dk, b, kv_head, key_block + j, s.key_grad.data() + j * D, D);
        store_row<T>(bp.dv, b, kv_head, key_block + j, s.value_grad.data() + j * Dv, Dv);
    }
}

// Pass 3: dQ of the tile's rows, key blocks in order from the first row's window start to the last
// row's visible end; rows that see no key get 0.
template <typename T>
void query_tile_gradients(const BackwardPlan& plan, const WorkItem& tile, BackwardScratch& s) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t G = plan.flash.group, D = plan.flash.head_dim;
    const int64_t rows = tile.row_end - tile.row_begin;
    load_tile(plan, tile, rows, s);
    std::fill(s.query_grad.begin(), s.query_grad.begin() + rows * D, 0.0f);
    int64_t first_key, last_key, unused;
    flash_row_key_range(p, tile.b, G, tile.row_begin, &first_key, &unused);
    flash_row_key_range(p, tile.b, G, tile.row_end - 1, &unused, &last_key);
    for (int64_t key_block = first_key / kBackwardKeyBlock * kBackwardKeyBlock; key_block < last_key;
         key_block += kBackwardKeyBlock) {
        const int64_t n = std::min(kBackwardKeyBlock, last_key - key_block);
        const float* gate = tile_gradients(plan, tile, rows, key_block, n, s);
        accumulate_query_rows(plan, tile, rows, key_block, n, gate, s, s.query_grad.data());
    }
    store_query_rows<T>(plan, tile, s.query_grad.data());
}

// The fused pass (2 and 3 in one item): dK and dV of every key block of (b, kv_head), blocks in
// order, each tile's dQ summed into the head's dQ sums (s.query_grad) as it goes. Every
// element is the same fma chain as in passes 2 and 3 (keys ascending for dQ: blocks in order,
// each block's keys in order), so the results are the same bits; S and dP are computed once
// instead of twice.
template <typename T>
void head_gradients(const BackwardPlan& plan, int64_t b, int64_t kv_head, BackwardScratch& s) {
    const int64_t D = plan.flash.head_dim;
    float* query_grads = s.query_grad.data();
    std::fill(query_grads, query_grads + plan.flash.rows_per_group * D, 0.0f);
    for (int64_t key_block = 0; key_block < plan.packed.key_blocks * kBackwardKeyBlock; key_block += kBackwardKeyBlock)
        key_block_gradients<T>(plan, b, kv_head, key_block, s, query_grads);
    store_query_rows<T>(plan, head_item(b, kv_head, plan.flash.rows_per_group), query_grads);
}

// Whether the fused pass runs: its items are the B * Hkv heads, of five (Lq Lk D)-sized products
// per head where passes 2 and 3 run seven, over finer items. It runs unless its busiest thread
// (ceil(heads / threads) heads) would do more than the two passes' share (heads / threads x 7/5).
bool fused_pass(int64_t heads, int num_threads) {
    return 5 * ceil_div(heads, num_threads) * num_threads <= 7 * heads;
}

// Passes 2 and 3, after passes 0 and 1.
template <typename T>
void gradient_passes(const BackwardPlan& plan, int num_threads) {
    const AttentionProblem& p = plan.problem->forward;
    const int64_t B = p.q.shape[0], D = p.q.shape[3], Hkv = p.k.shape[1], Dv = p.v.shape[3];
    const int64_t key_blocks = plan.packed.key_blocks, rows_per_group = plan.flash.rows_per_group;
    const ScratchShape tiles{D, Dv, kQTileRows};
    if (plan.fused) {  // 2 and 3 in one, per head
        for_each_item(B * Hkv, num_threads, ScratchShape{D, Dv, rows_per_group},
                      [&](int64_t head, BackwardScratch& s) { head_gradients<T>(plan, head / Hkv, head % Hkv, s); });
        return;
    }
    // 2. dK, dV.
    for_each_item(B * Hkv * key_blocks, num_threads, tiles, [&](int64_t index, BackwardScratch& s) {
        const int64_t head = index / key_blocks;
        key_block_gradients<T>(plan, head / Hkv, head % Hkv, index % key_blocks * kBackwardKeyBlock, s, nullptr);
    });
    // 3. dQ.
    const int64_t query_tiles = ceil_div(rows_per_group, kQTileRows);
    for_each_item(B * Hkv * query_tiles, num_threads, tiles, [&](int64_t index, BackwardScratch& s) {
        const int64_t head = index / query_tiles, row_begin = index % query_tiles * kQTileRows;
        const WorkItem tile{head / Hkv, head % Hkv, row_begin, std::min(row_begin + kQTileRows, rows_per_group),
                            0, 0, -1};
        query_tile_gradients<T>(plan, tile, s);
    });
}

// Passes 0-3 with q, k, v, out, dout and the gradients of storage type T.
template <typename T>
void backward_passes(const BackwardProblem& bp, int num_threads) {
    const AttentionProblem& p = bp.forward;
    const BackwardKernels kernels = current_kernels().backward;
    const int64_t B = p.q.shape[0], Hq = p.q.shape[1], Lq = p.q.shape[2];
    const int64_t Hkv = p.k.shape[1], Lk = p.k.shape[2];

    const int64_t D = p.q.shape[3], Dv = p.v.shape[3];

    // 1. Drow, then dsinks.
    std::vector<float> delta(static_cast<size_t>(B * Hq * Lq));
    const ScratchShape tiles{D, Dv, kQTileRows};
    for_each_item(B * Hq, num_threads, tiles, [&](int64_t head, BackwardScratch& s) {
        row_deltas<T>(bp, head / Hq, head % Hq, delta.data() + head * Lq, s.row_buffer.data());
    });
    if (bp.dsinks.data != nullptr) sink_gradients(bp, delta.data());
    if (Hkv == 0) return;  // then Hq = 0 too (check_problem): no gradient left to write

    // 0. The packed keys and query side.
    const int64_t key_blocks = ceil_div(Lk, kBackwardKeyBlock);
    const int64_t packed_keys = B * Hkv * key_blocks * kBackwardKeyBlock;
    CallerBuffers& buffers = caller_buffers();
    const PackedKeys packed{buffers.keys.ensure(packed_keys * D), buffers.key_panels.ensure(packed_keys * D),
                            buffers.value_panels.ensure(packed_keys * Dv), key_blocks};
    const int64_t packed_rows = B * Hq * Lq;  // B * Hkv heads of rows_per_group packed rows
    const PackedQueries queries{buffers.query_rows.ensure(packed_rows * D),
                                buffers.query_scaled.ensure(packed_rows * D), buffers.dout_rows.ensure(packed_rows * Dv)};
    const bool fused = fused_pass(B * Hkv, num_threads);
    const BackwardPlan plan{&bp, flash_plan(p), delta.data(), kernels, packed, queries, fused};
    for_each_item(B * Hkv, num_threads, tiles, [&](int64_t head, BackwardScratch&) {
        pack_keys<T>(plan, head / Hkv, head % Hkv);
        pack_queries<T>(plan, head / Hkv, head % Hkv);
    });
    gradient_passes<T>(plan, num_threads);
}

}  // namespace

void attention_backward(const BackwardProblem& bp, int num_threads) {
    check_backward(bp);
    check_num_threads(num_threads);
    const AttentionProblem& p = bp.forward;
    // A call below kSerialWork multiply-adds runs on the calling thread, as the forward's (the
    // results do not depend on it).
    if (problem_work(p) < static_cast<double>(kSerialWork)) num_threads = 1;
    switch (p.dtype) {
        case ElementType::Float32: backward_passes<float>(bp, num_threads); break;
        case ElementType::Float16: backward_passes<Float16>(bp, num_threads); break;
        case ElementType::BFloat16: backward_passes<BFloat16>(bp, num_threads); break;
    }
}

}  // namespace twinattn
