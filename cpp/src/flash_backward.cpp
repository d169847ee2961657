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
//   1. Drow = rowsum(dO * O) - dlse of every query row (float32, into a (B, Hq, Lq) buffer; O in
//      float32 when the caller passes the forward's out32, dlse when given); dsinks.
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
// The bfloat16 tile path (amxbf16, bfloat16, D a multiple of 32: tile_path): always the fused
// pass, query tiles of kBackwardTileRows rows, the five products on tiles of bfloat16 pairs with
// float32 sums (BackwardTiles, flash_amx.cpp): S = Q K^T and dP = dO V^T from the inputs' own
// bits (then S times the Q multiplier, as the forward's tiles), dQ += dS K, and per group of
// tiles dV^T += dO^T P and dK^T += Q^T dS, with P and scale dS rounded to bfloat16. Pass 0 packs
// bfloat16 pairs instead of float32 (PackedPairs, Dv padded to a multiple of 32 with zeros), in
// each head's item as the fused float32 pass does; the per-score float32 work is the same code as
// above.
// A tile and key block where a hidden key (P = 0) meets a non-finite Q, dO or K row run the
// three accumulations in float32 on the kernels' gated accumulate instead (exact_accumulations),
// so a value that is never visible is never read.
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
#include <new>
#include <cstdint>
#include <limits>
#include <type_traits>
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

// Storage whose data starts a 64-byte line, for every buffer of the backward that the kernels
// read a vector or a tile row at a time: no vector load of a panel straddles two lines, and on
// the tile path, where the operands and float32 sums are read and written a tile row (64 bytes)
// at a time, a row that straddles two lines costs a tile load about 3.5 times as much
// (std::vector's own storage is 16-byte aligned).
template <typename T>
struct LineAllocator {
    using value_type = T;
    LineAllocator() = default;
    template <typename U>
    LineAllocator(const LineAllocator<U>&) noexcept {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
    void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
    template <typename U>
    bool operator==(const LineAllocator<U>&) const noexcept { return true; }
    template <typename U>
    bool operator!=(const LineAllocator<U>&) const noexcept { return false; }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// Pass 0's packed keys of one call, for (b, kv_head) head = b * Hkv + kv_head and its key block
// kb (kBackwardKeyBlock keys from kb * kBackwardKeyBlock), block = head * key_blocks + kb:
//   keys         (kBackwardKeyBlock, D) at block * kBackwardKeyBlock * D     K rows (dQ += dS K)
//   key_panels   (D, kBackwardKeyBlock) at block * D * kBackwardKeyBlock     K^T (S = Q K^T)
//   value_panels (Dv, kBackwardKeyBlock) at block * Dv * kBackwardKeyBlock   V^T (dP = dO V^T)
// Keys at or past kv_lens[b] are 0 (never read from k or v). The fused float32 pass packs one
// head at a time into its thread's scratch: there head counts from first_head (0 for the call's).
struct PackedKeys {
    float* keys;
    float* key_panels;
    float* value_panels;
    int64_t key_blocks;  // per head: Lk / kBackwardKeyBlock rounded up
    int64_t first_head = 0;
};

// Pass 0's packed query side of one call, for (b, kv_head) head = b * Hkv + kv_head and its
// packed row r, row = head * rows_per_group + r:
//   query_rows   (rows, D) at row * D     Q (dK += dS^T Q)
//   query_scaled (rows, D) at row * D     Q times the Q multiplier (S = Q K^T)
//   dout_rows    (rows, Dv) at row * Dv   dO (dP = dO V^T, dV += P^T dO)
// The fused float32 pass packs a chunk of a head's rows at a time into its thread's scratch: there
// row counts from first_row (0 for the call's).
struct PackedQueries {
    float* query_rows;
    float* query_scaled;
    float* dout_rows;
    int64_t first_row = 0;
};

// Pass 0's bfloat16 pairs on the tile path, as 16-bit elements (a pair: two consecutive ones),
// packed by each head's item into its thread's scratch (head_tiles): the head's keys as the item
// starts, the rows of each chunk (kBackwardTileGroup query tiles from packed row first_row) as
// the chunk starts. Per key block kb of the head:
//   key_panels   at kb * kBackwardKeyBlock * D: kBackwardKeyBlock / kKeyPanel panels of
//                (D / 2, kKeyPanel) pairs (d, key)       S = Q K^T, B
//   value_panels at kb * kBackwardKeyBlock * Dv: the same of V   dP = dO V^T, B
//   key_rows     at kb * kBackwardKeyBlock * D: (kBackwardKeyBlock / 2, D) pairs (key, d)
//                                                        dQ += dS K, B
//   key_finite   at kb * kBackwardKeyBlock: 1 where the key's K row is finite
// Per packed row r of the chunk, row = r - first_row (up to the chunk's end rounded up to 32; the
// pad rows, past rows_per_group, are 0):
//   query_pairs at row * D, dout_pairs at row * Dv: the rows themselves (pairs (d))   S, dP: A
//   row_finite at row: 1 where the row's Q and dO are finite
// The chunk's rows transposed, kBackwardTileGroup * kBackwardTileRows columns (0 past
// rows_per_group), each of row_stride elements (that plus 32: no two rows 4096 bytes apart, where
// the L1 cache would put a tile load's rows in one set):
//   query_t: Q^T, (D, row_stride), so pairs (d, rows 2 i and 2 i + 1)   dK^T += Q^T dS: A
//   dout_t: dO^T, (Dv, row_stride), the same             dV^T += dO^T P: A
// Keys at or past kv_lens[b] are 0 (never read from k or v), finite. Every width Dv above is
// value_width (Dv rounded up to 32; the columns past Dv are 0).
struct PackedPairs {
    uint16_t* key_panels;
    uint16_t* value_panels;
    uint16_t* key_rows;
    unsigned char* key_finite;
    uint16_t* query_pairs;
    uint16_t* dout_pairs;
    unsigned char* row_finite;
    uint16_t* query_t;
    uint16_t* dout_t;
    int64_t value_width;  // Dv rounded up to 32: the V and dO pairs' width (0 past Dv)
    int64_t first_row;    // the chunk's first packed row
};

// Packed query rows per chunk of the tile path, and the row stride of its transposes.
constexpr int64_t kPairChunkRows = kBackwardTileGroup * kBackwardTileRows;
constexpr int64_t kPairRowStride = kPairChunkRows + 32;

// No packed keys (the tile path, and the fused float32 pass, whose items pack their own), of
// key_blocks blocks per head.
PackedKeys no_keys(int64_t key_blocks) { return PackedKeys{nullptr, nullptr, nullptr, key_blocks}; }

// No packed query side (the tile path, and the fused float32 pass).
PackedQueries no_queries() { return PackedQueries{nullptr, nullptr, nullptr}; }

// No pairs (the float32 path; on the tile path each head's item packs its own, of value_width).
PackedPairs no_pairs(int64_t value_width = 0) {
    PackedPairs pairs{};
    pairs.value_width = value_width;
    return pairs;
}

// What the items of one call share.
struct BackwardPlan {
    const BackwardProblem* problem;
    FlashPlan flash;          // the forward's plan: group, shapes, Q multiplier, variants' flags
    const float* row_delta;   // Drow of every query row, (B, Hq, Lq) contiguous
    BackwardKernels kernels;  // the inner products, of the instruction set in use (backward_kernel.hpp)
    PackedKeys packed;        // pass 0's keys
    PackedQueries queries;    // pass 0's query side
    bool fused;               // passes 2 and 3 run as one, per head (fused_pass)
    bool tiled;               // the bfloat16 tile path (tile_path); then pairs, not packed and queries
    PackedPairs pairs;        // pass 0's pairs (the tile path)
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
    const int64_t block =
        (b * Hkv + kv_head - plan.packed.first_head) * plan.packed.key_blocks + key_block / kBackwardKeyBlock;
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
    const int64_t row = (tile.b * Hkv + tile.kv_head) * plan.flash.rows_per_group + tile.row_begin - plan.queries.first_row;
    return QueryRows{plan.queries.query_rows + row * D, plan.queries.query_scaled + row * D,
                     plan.queries.dout_rows + row * Dv};
}

// The calling thread's packed keys and query side (thread_local: concurrent callers never share
// them), reused across calls so that a call does not fault their pages in again.
struct CallerBuffers {
    LineVector<float> keys, key_panels, value_panels, query_rows, query_scaled, dout_rows;
};

// buffer grown to at least count elements, its data.
template <typename E, typename A>
E* grown(std::vector<E, A>& buffer, int64_t count) {
    if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(static_cast<size_t>(count));
    return buffer.data();
}

CallerBuffers& caller_buffers() {
    thread_local CallerBuffers buffers;
    return buffers;
}

// What one thread's scratch is sized for: D, Dv, the rows of dQ sums (a tile's kQTileRows; in
// the fused pass a chunk's kBackwardChunkTiles kQTileRows, or on the tile path kPairChunkRows),
// and whether the tile path runs (its rows per tile are kBackwardTileRows; Dv is then the pairs'
// value_width).
struct ScratchShape {
    int64_t head_dim, value_dim, query_grad_rows;
    bool tiled = false;
    int64_t key_blocks = 1;  // the fused pass: a head's key blocks (key_grad, value_grad hold each's sums)
    bool packs = false;      // the fused pass: the thread packs its head's keys and a chunk's rows
};

// One thread's tiles (grown on demand, kept for the thread's life):
//   row_buffer (2 Dv)                 one row of out and of dO (pass 1)
//   row_delta, row_lse (kQTileRows)   Drow and lse * log2(e) of the tile's rows
//   row_key_begin, row_key_end        each row's visible key range
//   scores, capped, grads (kQTileRows, kKeyBlock): S then P; tanh of the softcap; scale * dS
//   key_grad, value_grad (kBackwardKeyBlock, D / Dv) per key block (one, or in the fused pass
//   each of the head's), query_grad (query_grad_rows, D): float32 sums (ScratchShape)
// and in the fused float32 pass (packs), pass 0's copies of one head's keys and one chunk's rows
// (PackedKeys, PackedQueries, from first_head and first_row):
//   head_keys, head_key_panels, head_value_panels   the head's K rows, K^T, V^T
//   chunk_rows, chunk_scaled, chunk_dout            the chunk's Q, Q times the multiplier, dO
// and on the tile path (tiles of kBackwardTileRows rows, so the rows above are that many; key_grad
// and value_grad hold dK^T and dV^T of each of the head's key blocks, (D / Dv, kBackwardKeyBlock)
// per block), pass 0's pairs of one head's keys and one chunk's rows (PackedPairs):
//   pair_key_panels, pair_value_panels, pair_key_rows, key_finite     the head's keys
//   pair_query_pairs, pair_dout_pairs, row_finite, pair_query_t, pair_dout_t   the chunk's rows
//   probs_pairs, grads_pairs (kBackwardTileGroup kBackwardTileRows / 2, kBackwardKeyBlock) pairs
//   of rows: P and scale dS of a group of tiles rounded to bfloat16 (B of dV^T and dK^T);
//   grads_rows (kBackwardTileRows, kBackwardKeyBlock) bfloat16: scale dS of a tile (A of dQ);
//   key_sums (kBackwardKeyBlock, max(D, Dv)): dK or dV sums key by key (stores, exact_accumulations);
//   exact_queries, exact_dout (kBackwardTileRows, D / Dv), exact_keys (kBackwardKeyBlock, D):
//   float32 operands of exact_accumulations
struct BackwardScratch {
    LineVector<float> row_buffer, row_delta, row_lse, scores, capped, grads, key_grad, value_grad, query_grad;
    std::vector<int64_t> row_key_begin, row_key_end;
    LineVector<uint32_t> probs_pairs, grads_pairs;
    LineVector<uint16_t> grads_rows;
    LineVector<float> key_sums, exact_queries, exact_dout, exact_keys;
    LineVector<float> head_keys, head_key_panels, head_value_panels, chunk_rows, chunk_scaled, chunk_dout;
    LineVector<uint16_t> pair_key_panels, pair_value_panels, pair_key_rows, pair_query_pairs, pair_dout_pairs,
        pair_query_t, pair_dout_t;
    std::vector<unsigned char> key_finite, row_finite;

    void ensure(const ScratchShape& shape) {
        const int64_t D = shape.head_dim, Dv = shape.value_dim;
        const int64_t tile_rows = shape.tiled ? kBackwardTileRows : kQTileRows;
        const auto grow = [](auto& buffer, int64_t count) { grown(buffer, count); };
        grow(row_buffer, 2 * Dv);
        grow(row_delta, tile_rows);
        grow(row_lse, tile_rows);
        grow(scores, tile_rows * kKeyBlock);
        grow(capped, tile_rows * kKeyBlock);
        grow(grads, tile_rows * kKeyBlock);
        grow(key_grad, shape.key_blocks * kBackwardKeyBlock * D);
        grow(value_grad, shape.key_blocks * kBackwardKeyBlock * Dv);
        grow(query_grad, shape.query_grad_rows * D);
        grow(row_key_begin, tile_rows);
        grow(row_key_end, tile_rows);
        if (shape.packs && !shape.tiled) {
            grow(head_keys, shape.key_blocks * kBackwardKeyBlock * D);
            grow(head_key_panels, shape.key_blocks * kBackwardKeyBlock * D);
            grow(head_value_panels, shape.key_blocks * kBackwardKeyBlock * Dv);
            grow(chunk_rows, shape.query_grad_rows * D);
            grow(chunk_scaled, shape.query_grad_rows * D);
            grow(chunk_dout, shape.query_grad_rows * Dv);
        }
        if (!shape.tiled) return;
        grow(probs_pairs, kBackwardTileGroup * kBackwardTileRows / 2 * kBackwardKeyBlock);
        grow(grads_pairs, kBackwardTileGroup * kBackwardTileRows / 2 * kBackwardKeyBlock);
        grow(grads_rows, kBackwardTileRows * kBackwardKeyBlock);
        grow(key_sums, kBackwardKeyBlock * std::max(D, Dv));
        grow(exact_queries, kBackwardTileRows * D);
        grow(exact_dout, kBackwardTileRows * Dv);
        grow(exact_keys, kBackwardKeyBlock * D);
        if (!shape.packs) return;
        const int64_t keys = shape.key_blocks * kBackwardKeyBlock;
        grow(pair_key_panels, keys * D);
        grow(pair_value_panels, keys * Dv);
        grow(pair_key_rows, keys * D);
        grow(key_finite, keys);
        grow(pair_query_pairs, kPairChunkRows * D);
        grow(pair_dout_pairs, kPairChunkRows * Dv);
        grow(row_finite, kPairChunkRows);
        grow(pair_query_t, D * kPairRowStride);
        grow(pair_dout_t, Dv * kPairRowStride);
    }

    // Pass 0's pairs in this scratch (the tile path), of value_width, for the chunk from first_row.
    PackedPairs pairs(int64_t value_width, int64_t first_row) {
        return PackedPairs{pair_key_panels.data(), pair_value_panels.data(), pair_key_rows.data(),
                           key_finite.data(),      pair_query_pairs.data(),  pair_dout_pairs.data(),
                           row_finite.data(),      pair_query_t.data(),      pair_dout_t.data(),
                           value_width,            first_row};
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

// Pass 1: Drow of the Lq rows of (b, h) into delta, from out of storage type O (T, or float32
// when bp.out_float32), minus dlse when given; row_buffer holds 2 Dv floats.
template <typename T, typename O>
void row_deltas(const BackwardProblem& bp, int64_t b, int64_t h, float* delta, float* row_buffer) {
    const AttentionProblem& p = bp.forward;
    const int64_t Lq = p.q.shape[2], Dv = p.v.shape[3];
    const ParamView3& dlse = bp.dlse;
    float* out_row = row_buffer;
    float* dout_row = row_buffer + Dv;
    for (int64_t i = 0; i < Lq; ++i) {
        const O* out = view_row<O>(p.out, b, h, i);
        const T* dout = view_row<T>(bp.dout, b, h, i);
        for (int64_t c = 0; c < Dv; ++c) {
            out_row[c] = to_f32(out[c]);
            dout_row[c] = to_f32(dout[c]);
        }
        delta[i] = dot(dout_row, out_row, Dv);
        if (dlse.data != nullptr) delta[i] = delta[i] - dlse.data[b * dlse.stride[0] + h * dlse.stride[1] + i * dlse.stride[2]];
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

// The work item of packed rows [row_begin, row_end) of (b, kv_head).
WorkItem rows_item(int64_t b, int64_t kv_head, int64_t row_begin, int64_t row_end) {
    return WorkItem{b, kv_head, row_begin, row_end, 0, 0, -1};
}

// Pass 0: the query side of packed rows [row_begin, row_end) of (b, kv_head) into the packed
// query side (PackedQueries): Q, Q times the Q multiplier and dO of each, converted to float32.
template <typename T>
void pack_queries(const BackwardPlan& plan, int64_t b, int64_t kv_head, int64_t row_begin, int64_t row_end) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t G = plan.flash.group, D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const QueryRows rows = query_rows_at(plan, rows_item(b, kv_head, row_begin, row_end));
    for (int64_t packed = row_begin; packed < row_end; ++packed) {
        const int64_t h = kv_head * G + packed % G, i = packed / G, r = packed - row_begin;
        const T* q = view_row<T>(p.q, b, h, i);
        for (int64_t d = 0; d < D; ++d) {
            const float x = to_f32(q[d]);
            rows.rows[r * D + d] = x;
            rows.scaled[r * D + d] = x * plan.flash.q_multiplier;
        }
        const T* dout = view_row<T>(bp.dout, b, h, i);
        for (int64_t c = 0; c < Dv; ++c) rows.dout[r * Dv + c] = to_f32(dout[c]);
    }
}

// ---- The bfloat16 tile path (amxbf16) ---------------------------------------------------------

// Whether the call takes the tile path: the instruction set has the backward's tile products
// (amxbf16), the dtype is bfloat16, and D fills whole tiles (a multiple of 32; Dv is padded to
// one with zeros: the Python layer's backward adds a column to V).
bool tile_path(const BackwardKernels& kernels, const AttentionProblem& p) {
    const int64_t D = p.q.shape[3], Dv = p.v.shape[3];
    return kernels.tiles.product != nullptr && p.dtype == ElementType::BFloat16 && D > 0 && D % 32 == 0 && Dv > 0;
}

// A bfloat16's bits are finite unless its exponent is all ones.
bool finite_bits(uint16_t bits) { return (bits & 0x7f80u) != 0x7f80u; }

// Row i of head h of sequence b of a bfloat16 (B, H, L, n) view, as its bits.
template <typename View>
const uint16_t* bf16_row(const View& view, int64_t b, int64_t h, int64_t i) {
    return &view_row<const BFloat16>(view, b, h, i)->bits;
}

// n bfloat16 bits from src (0 when src is null) to dst; returns how many are not finite (counted,
// not tested: the loops vectorise).
int64_t copy_row(const uint16_t* src, int64_t n, uint16_t* dst) {
    if (src == nullptr) {
        std::fill(dst, dst + n, uint16_t{0});
        return 0;
    }
    int64_t non_finite = 0;
    for (int64_t i = 0; i < n; ++i) non_finite += finite_bits(src[i]) ? 0 : 1;
    std::copy(src, src + n, dst);
    return non_finite;
}

// Pass 0 (tile path): the keys of (b, kv_head) into the pairs (PackedPairs).
void pack_key_pairs(const BackwardPlan& plan, int64_t b, int64_t kv_head) {
    const AttentionProblem& p = plan.problem->forward;
    const PackedPairs& pairs = plan.pairs;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const int64_t value_width = pairs.value_width;
    for (int64_t kb = 0; kb < plan.packed.key_blocks; ++kb) {
        const int64_t block = kb, key_block = kb * kBackwardKeyBlock;
        const int64_t n = std::max<int64_t>(0, std::min(kBackwardKeyBlock, p.kv_lens[b] - key_block));
        uint16_t* key_panels = pairs.key_panels + block * kBackwardKeyBlock * D;
        uint16_t* value_panels = pairs.value_panels + block * kBackwardKeyBlock * value_width;
        uint16_t* key_rows = pairs.key_rows + block * kBackwardKeyBlock * D;
        unsigned char* key_finite = pairs.key_finite + block * kBackwardKeyBlock;
        for (int64_t j = 0; j < kBackwardKeyBlock; ++j) {
            const uint16_t* k = j < n ? bf16_row(p.k, b, kv_head, key_block + j) : nullptr;
            const uint16_t* v = j < n ? bf16_row(p.v, b, kv_head, key_block + j) : nullptr;
            // pair (d / 2, j) of panel j / kKeyPanel, element d % 2; pair (j / 2, d), element j % 2
            const int64_t panel = j / kKeyPanel, column = j % kKeyPanel;
            bool finite = true;
            for (int64_t d = 0; d < D; ++d) {
                const uint16_t bits = k != nullptr ? k[d] : 0;
                finite = finite && finite_bits(bits);
                key_panels[((panel * D / 2 + d / 2) * kKeyPanel + column) * 2 + d % 2] = bits;
                key_rows[(j / 2 * D + d) * 2 + j % 2] = bits;
            }
            for (int64_t c = 0; c < value_width; ++c)
                value_panels[((panel * value_width / 2 + c / 2) * kKeyPanel + column) * 2 + c % 2] =
                    v != nullptr && c < Dv ? v[c] : 0;
            key_finite[j] = finite ? 1 : 0;
        }
    }
}

// Pass 0 (tile path): the query side of (b, kv_head) into the pairs (PackedPairs), the chunk of
// packed rows from pairs.first_row to chunk_end: row by row, then transposed a tile of rows at a
// time (their rows stay in L1 while every column is written).
void pack_query_pairs(const BackwardPlan& plan, int64_t b, int64_t kv_head, int64_t chunk_end) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const PackedPairs& pairs = plan.pairs;
    const int64_t G = plan.flash.group, D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const int64_t rows_per_group = plan.flash.rows_per_group, head_rows = ceil_div(rows_per_group, 32) * 32;
    const uint16_t* q_rows[kBackwardTileRows];
    const uint16_t* dout_rows[kBackwardTileRows];
    const std::vector<uint16_t> zeros(std::max(D, Dv), uint16_t{0});
    for (int64_t tile_begin = pairs.first_row; tile_begin < chunk_end; tile_begin += kBackwardTileRows) {
        for (int64_t local = 0; local < kBackwardTileRows; ++local) {
            const int64_t packed = tile_begin + local, row = packed - pairs.first_row;
            const int64_t h = kv_head * G + packed % G, i = packed / G;
            q_rows[local] = packed < rows_per_group ? bf16_row(p.q, b, h, i) : nullptr;
            dout_rows[local] = packed < rows_per_group ? bf16_row(bp.dout, b, h, i) : nullptr;
            if (packed >= head_rows) continue;
            uint16_t* dout = pairs.dout_pairs + row * pairs.value_width;
            const int64_t non_finite =
                copy_row(q_rows[local], D, pairs.query_pairs + row * D) + copy_row(dout_rows[local], Dv, dout);
            std::fill(dout + Dv, dout + pairs.value_width, uint16_t{0});
            pairs.row_finite[row] = non_finite == 0 ? 1 : 0;
        }
        // (width rows of the transpose, the first `real` from the rows, the rest 0; a missing row
        // read as `zeros`, so the inner loop has no test)
        const auto transpose_tile = [&](const uint16_t* const* rows, int64_t real, int64_t width, uint16_t* dst) {
            const uint16_t* sources[kBackwardTileRows];
            for (int64_t local = 0; local < kBackwardTileRows; ++local)
                sources[local] = rows[local] != nullptr ? rows[local] : zeros.data();
            for (int64_t d = 0; d < width; ++d) {
                uint16_t* column = dst + d * kPairRowStride + tile_begin - pairs.first_row;
                if (d >= real) {
                    std::fill(column, column + kBackwardTileRows, uint16_t{0});
                    continue;
                }
                for (int64_t local = 0; local < kBackwardTileRows; ++local) column[local] = sources[local][d];
            }
        };
        transpose_tile(q_rows, D, D, pairs.query_t);
        transpose_tile(dout_rows, Dv, pairs.value_width, pairs.dout_t);
    }
}

// The tile's first row in the chunk's pairs (even: tiles start at multiples of kBackwardTileRows).
int64_t pair_row_at(const BackwardPlan& plan, const WorkItem& tile) { return tile.row_begin - plan.pairs.first_row; }

// The key block's index in the head's pairs.
int64_t pair_block_at(int64_t key_block) { return key_block / kBackwardKeyBlock; }

// The tile path's products (on the tile path only, between the tiles' begin and end).
void tile_product(const BackwardPlan& plan, const TileProduct& product) { plan.kernels.tiles.product(product); }

// (a) of tile_gradients on tiles: S into s.scores and dP into s.grads, over n_padded keys (whole
// panels) and the tile's rows rounded up to 16 (the pad rows' pairs are 0; their scores are
// scratch). S times the Q multiplier (as the forward's tiles) when `scaled`; else row_gradients
// multiplies (the same product, after mask_block's -inf, which it keeps).
void tile_scores(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, int64_t key_block, int64_t n_padded,
                 bool scaled, BackwardScratch& s) {
    const PackedPairs& pairs = plan.pairs;
    const int64_t D = plan.flash.head_dim, Dv = pairs.value_width;
    const int64_t row = pair_row_at(plan, tile), block = pair_block_at(key_block);
    const auto product = [&](const uint16_t* a, int64_t depth, const uint16_t* panels, float* out) {
        for (int64_t panel = 0; panel < n_padded / kKeyPanel; ++panel)
            tile_product(plan, TileProduct{a + row * depth, depth * 2, rows,
                                           panels + block * kBackwardKeyBlock * depth + panel * depth * kKeyPanel,
                                           kKeyPanel * 4, kKeyPanel / 16, depth / 32, out + panel * kKeyPanel,
                                           kKeyBlock * 4, false});
    };
    product(pairs.query_pairs, D, pairs.key_panels, s.scores.data());
    product(pairs.dout_pairs, Dv, pairs.value_panels, s.grads.data());
    if (!scaled) return;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n_padded; ++j) s.scores[r * kKeyBlock + j] *= plan.flash.q_multiplier;
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
    // (a) S = (Q times the multiplier) K^T, in base 2; softcap: t = tanh(S) kept, S = t softcap log2 e.
    // dP = dO V^T into s.grads. (The tile path: tile_scores, which leaves the multiplier to
    // row_gradients unless the softcap, ALiBi or a mask needs S scaled before P.)
    const bool scaled = !plan.tiled || fp.has_softcap || fp.has_alibi || fp.has_mask;
    if (plan.tiled) {
        tile_scores(plan, tile, rows, key_block, n_padded, scaled, s);
    } else {
        const KeyBlock block = key_block_at(plan, tile.b, tile.kv_head, key_block);
        const QueryRows queries = query_rows_at(plan, tile);
        const auto product = [&](const float* a, int64_t depth, const float* panel, float* out) {
            plan.kernels.panel_product(
                PanelProduct{a, rows, depth, panel, kBackwardKeyBlock, n_padded, out, kKeyBlock});
        };
        product(queries.scaled, D, block.key_panel, s.scores.data());
        product(queries.dout, Dv, block.value_panel, s.grads.data());
    }
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
    const float scale = plan.problem->forward.scale, multiplier = scaled ? 1.0f : fp.q_multiplier;
    int64_t zeros = 0;  // P of the rows x n that are 0 (counted by row_gradients, not tested)
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
        zeros += plan.kernels.row_gradients(
            RowGradients{probs, grads, capped, n_padded, s.row_lse[r], s.row_delta[r], scale, multiplier, n});
    }
    return zeros == 0 ? nullptr : s.scores.data();
}

// The query tile of packed rows [row_begin, row_begin + tile_rows) (up to rows_per_group) of
// `keys`' (b, kv_head) against its keys [key_begin, key_end) into *tile; false when none of its
// rows sees one of them (rows are ordered by position, and so are their visible ranges: a tile
// whose first row starts past the keys or whose last row ends before them sees none).
bool block_tile(const BackwardPlan& plan, const WorkItem& keys, int64_t row_begin, int64_t tile_rows, WorkItem* tile) {
    const int64_t row_end = std::min(row_begin + tile_rows, plan.flash.rows_per_group);
    int64_t first_key, last_key, unused;
    flash_row_key_range(plan.problem->forward, keys.b, plan.flash.group, row_begin, &first_key, &unused);
    flash_row_key_range(plan.problem->forward, keys.b, plan.flash.group, row_end - 1, &unused, &last_key);
    *tile = keys;
    tile->row_begin = row_begin;
    tile->row_end = row_end;
    return first_key < keys.key_end && last_key > keys.key_begin;
}

// query_grads[r] += dS[r, .] K for the tile's rows r, over n K rows of D floats from keys in order
// (dS in s.grads, gated as tile_gradients returned).
void accumulate_query_keys(const BackwardPlan& plan, int64_t rows, int64_t n, const float* gate,
                           const BackwardScratch& s, const float* keys, float* query_grads) {
    const int64_t D = plan.flash.head_dim;
    plan.kernels.accumulate(Accumulation{query_grads, D, rows, D, s.grads.data(), gate, 1, kKeyBlock, keys, D, n});
}

// Row r of the tile: query_grads[r] += dS[r, .] K, over the n keys of the block from key_block in
// order (dS in s.grads, gated as tile_gradients returned).
void accumulate_query_rows(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, int64_t key_block, int64_t n,
                           const float* gate, const BackwardScratch& s, float* query_grads) {
    const float* keys = key_block_at(plan, tile.b, tile.kv_head, key_block).keys;
    accumulate_query_keys(plan, rows, n, gate, s, keys, query_grads);
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

// Whether a hidden key can meet a non-finite value in the tile's accumulations: some P of the
// tile's rows x its keys [key_begin, key_end) is 0 (gate not null) and a Q or dO row of the tile
// or a K row of those keys is not finite (a tile product would multiply it by 0).
bool tile_needs_exact(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, const float* gate) {
    if (gate == nullptr) return false;
    const int64_t n = tile.key_end - tile.key_begin;
    const unsigned char* row_finite = plan.pairs.row_finite + pair_row_at(plan, tile);
    const unsigned char* key_finite =
        plan.pairs.key_finite + pair_block_at(tile.key_begin) * kBackwardKeyBlock;
    for (int64_t r = 0; r < rows; ++r)
        if (row_finite[r] == 0) return true;
    for (int64_t j = 0; j < n; ++j)
        if (key_finite[j] == 0) return true;
    return false;
}

// to[c * rows + r] = from[r * columns + c] for r < rows, c < columns.
void transpose(const float* from, int64_t rows, int64_t columns, float* to) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < columns; ++c) to[c * rows + r] = from[r * columns + c];
}

// A key block's dK^T and dV^T sums on the tile path: (D, kBackwardKeyBlock) and (value_width,
// kBackwardKeyBlock) floats.
struct KeyBlockSums {
    float* key_grad_t;
    float* value_grad_t;
};

// The tile path's three accumulations in float32 with the kernels' gated accumulate (as the
// float32 path's, from P and scale dS unrounded), for a tile where tile_needs_exact: Q and dO of
// the tile's rows and K of its n keys from key_begin widened from the pairs; dK and dV summed key
// by key (their sums transposed there and back).
void exact_accumulations(const BackwardPlan& plan, const WorkItem& tile, int64_t rows, const float* gate,
                         const KeyBlockSums& sums, BackwardScratch& s, float* query_grads) {
    const int64_t key_block = tile.key_begin, n = tile.key_end - tile.key_begin;
    const PackedPairs& pairs = plan.pairs;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const int64_t row = pair_row_at(plan, tile), block = pair_block_at(key_block);
    const auto widen = [](uint16_t bits) { return to_f32(BFloat16{bits}); };
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) s.exact_queries[r * D + d] = widen(pairs.query_pairs[(row + r) * D + d]);
        for (int64_t c = 0; c < Dv; ++c)
            s.exact_dout[r * Dv + c] = widen(pairs.dout_pairs[(row + r) * pairs.value_width + c]);
    }
    const uint16_t* key_rows = pairs.key_rows + block * kBackwardKeyBlock * D;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) s.exact_keys[j * D + d] = widen(key_rows[(j / 2 * D + d) * 2 + j % 2]);
    // dV and dK key by key (s.key_sums, rows of `rows_t` floats, the first `width` summed), from
    // and back to dV^T and dK^T.
    const auto sum_key_rows = [&](float* y_t, int64_t rows_t, int64_t width, const LineVector<float>& coef,
                                  const LineVector<float>& x) {
        transpose(y_t, rows_t, kBackwardKeyBlock, s.key_sums.data());
        plan.kernels.accumulate(
            Accumulation{s.key_sums.data(), rows_t, n, width, coef.data(), gate, kKeyBlock, 1, x.data(), width, rows});
        transpose(s.key_sums.data(), kBackwardKeyBlock, rows_t, y_t);
    };
    sum_key_rows(sums.value_grad_t, pairs.value_width, Dv, s.scores, s.exact_dout);
    sum_key_rows(sums.key_grad_t, D, D, s.grads, s.exact_queries);
    accumulate_query_keys(plan, rows, n, gate, s, s.exact_keys.data(), query_grads);
}

// The tile path's accumulations of one tile on tiles: P and scale dS of the tile's rows against
// the block's n_padded keys rounded to bfloat16 (rows rounded up to 32 with zeros; TileRounding)
// into the group's pairs from row pair group_pairs, and dQ += dS K into query_grads (the tile's
// rows rounded up to 16; the pad rows are scratch). dV and dK wait for the group (group_sums).
void tile_accumulations(const BackwardPlan& plan, int64_t rows, int64_t key_block, int64_t n_padded,
                        int64_t group_pairs, BackwardScratch& s, float* query_grads) {
    const BackwardTiles& tiles = plan.kernels.tiles;
    const int64_t D = plan.flash.head_dim;
    const int64_t rows_padded = ceil_div(rows, 32) * 32;
    const int64_t block = pair_block_at(key_block);
    uint32_t* probs = s.probs_pairs.data() + group_pairs * kBackwardKeyBlock;
    uint32_t* grads = s.grads_pairs.data() + group_pairs * kBackwardKeyBlock;
    tiles.round(TileRounding{s.scores.data(), kKeyBlock, rows, rows_padded, n_padded, probs, nullptr, kBackwardKeyBlock});
    tiles.round(TileRounding{s.grads.data(), kKeyBlock, rows, rows_padded, n_padded, grads, s.grads_rows.data(),
                             kBackwardKeyBlock});
    tile_product(plan, TileProduct{s.grads_rows.data(), kBackwardKeyBlock * 2, rows,
                                   plan.pairs.key_rows + block * kBackwardKeyBlock * D, D * 4, D / 16, n_padded / 32,
                                   query_grads, D * 4, true});
}

// A group's dV^T += dO^T P and dK^T += Q^T dS on tiles: the packed rows [row_begin, row_begin +
// 2 pairs) of the chunk in the pairs (pairs: the group's row pairs, a multiple of 16) against n_padded keys, into
// the block's sums.
void group_sums(const BackwardPlan& plan, int64_t row_begin, int64_t pairs, int64_t n_padded, const KeyBlockSums& sums,
                const BackwardScratch& s) {
    const PackedPairs& packed = plan.pairs;
    const auto transposed_sums = [&](float* y, int64_t width, const uint16_t* x_t, const LineVector<uint32_t>& coef) {
        return TileProduct{x_t + row_begin - packed.first_row, kPairRowStride * 2, width,
                           coef.data(), kBackwardKeyBlock * 4, n_padded / 16, pairs / 16, y,
                           kBackwardKeyBlock * 4, true};
    };
    tile_product(plan, transposed_sums(sums.value_grad_t, packed.value_width, packed.dout_t, s.probs_pairs));
    tile_product(plan, transposed_sums(sums.key_grad_t, plan.flash.head_dim, packed.query_t, s.grads_pairs));
}

// Pass 2 fused with 3 on the tile path, for the query rows [rows_begin, rows_end) of a head (a
// chunk: rows_begin is the pairs' first_row) against a key block (keys.key_begin of
// (keys.b, keys.kv_head), those below keys.key_end visible): query tiles of kBackwardTileRows
// rows, the products on tiles (tile_scores, tile_accumulations, and group_sums over up to
// kBackwardTileGroup consecutive tiles) unless tile_needs_exact; dK^T and dV^T summed into the
// block's sums, dQ into query_grads (the chunk's, rows of D from rows_begin).
void key_block_tiles(const BackwardPlan& plan, const WorkItem& keys, int64_t rows_begin, int64_t rows_end,
                     const KeyBlockSums& sums, BackwardScratch& s, float* query_grads) {
    const int64_t key_block = keys.key_begin, visible = keys.key_end - key_block;
    const int64_t D = plan.flash.head_dim;
    const int64_t visible_padded = ceil_div(visible, kKeyPanel) * kKeyPanel;
    // The group: tiles in order from group_begin, their P and dS pairs from row pair 0 on, summed
    // into dV^T and dK^T when it is full, before an exact tile, and at the end.
    int64_t group_begin = 0, group_pairs = 0;
    const auto flush = [&]() {
        if (group_pairs > 0) group_sums(plan, group_begin, group_pairs, visible_padded, sums, s);
        group_pairs = 0;
    };
    for (int64_t row_begin = rows_begin; visible > 0 && row_begin < rows_end; row_begin += kBackwardTileRows) {
        WorkItem tile;
        if (!block_tile(plan, keys, row_begin, kBackwardTileRows, &tile)) {
            flush();
            continue;
        }
        const int64_t rows = tile.row_end - row_begin;
        load_tile(plan, tile, rows, s);
        const float* gate = tile_gradients(plan, tile, rows, key_block, visible, s);
        if (tile_needs_exact(plan, tile, rows, gate)) {
            flush();
            exact_accumulations(plan, tile, rows, gate, sums, s, query_grads + (row_begin - plan.pairs.first_row) * D);
            continue;
        }
        if (group_pairs == 0) group_begin = row_begin;
        tile_accumulations(plan, rows, key_block, visible_padded, group_pairs, s,
                           query_grads + (row_begin - plan.pairs.first_row) * D);
        group_pairs += ceil_div(rows, 32) * 16;
        if (group_pairs == kBackwardTileGroup * kBackwardTileRows / 2) flush();
    }
    flush();
}

// The key block from key_block of (b, kv_head) as a work item (its keys below kv_lens[b]: key_end;
// the query rows to come), and in *n its keys (kBackwardKeyBlock, fewer at the end).
WorkItem block_keys(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_block, int64_t* n) {
    *n = std::min(kBackwardKeyBlock, p.k.shape[2] - key_block);
    const int64_t visible = std::max<int64_t>(0, std::min(*n, p.kv_lens[b] - key_block));
    return WorkItem{b, kv_head, 0, 0, key_block, key_block + visible, -1};
}

// The fused pass on the tile path (head_gradients): the head's rows a chunk of
// kBackwardTileGroup query tiles at a time, each chunk against every key block in order, so that
// the chunk's query side (Q, dO, their transposes, its dQ sums) stays in the L2 cache while the
// key blocks stream past, instead of the whole head's rows streaming past each key block. dK^T
// and dV^T are summed per key block across the chunks (s.key_grad, s.value_grad: every block's),
// then stored key by key; keys past kv_lens[b] get 0. Each element's sum runs in the same order as
// key block by key block (a block's tiles in row order, a tile's blocks in key order), so the
// bits are the same.
// Pass 0 runs here, into the thread's scratch (as head_blocks'): the head's key pairs once, each
// chunk's row pairs and transposes as the chunk starts, whose dQ is whole, and stored, once the
// chunk has met every key block. So the path keeps, per thread, one head's keys and dK, dV sums
// and one chunk's rows, not the call's every K, V, Q and dO in pairs (at N = 8192, 32 query heads
// on 8 KV heads, D = 128: about 14 MB a thread against 350 MB a call).
template <typename T>
void head_tiles(const BackwardPlan& plan, int64_t b, int64_t kv_head, BackwardScratch& s) {
    const BackwardProblem& bp = *plan.problem;
    const AttentionProblem& p = bp.forward;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim, width = plan.pairs.value_width;
    const int64_t blocks = plan.packed.key_blocks, rows_per_group = plan.flash.rows_per_group;
    BackwardPlan own = plan;  // this head's pairs: the thread's scratch
    own.pairs = s.pairs(width, 0);
    pack_key_pairs(own, b, kv_head);
    std::fill(s.key_grad.begin(), s.key_grad.begin() + blocks * kBackwardKeyBlock * D, 0.0f);
    std::fill(s.value_grad.begin(), s.value_grad.begin() + blocks * kBackwardKeyBlock * width, 0.0f);
    const auto sums_of = [&](int64_t kb) {
        return KeyBlockSums{s.key_grad.data() + kb * kBackwardKeyBlock * D,
                            s.value_grad.data() + kb * kBackwardKeyBlock * width};
    };
    float* query_grads = s.query_grad.data();  // the chunk's dQ sums
    for (int64_t chunk = 0; chunk < rows_per_group; chunk += kPairChunkRows) {
        const int64_t chunk_end = std::min(chunk + kPairChunkRows, rows_per_group);
        own.pairs.first_row = chunk;
        pack_query_pairs(own, b, kv_head, chunk_end);
        std::fill(query_grads, query_grads + kPairChunkRows * D, 0.0f);
        for (int64_t kb = 0; kb < blocks; ++kb) {
            int64_t n;
            const WorkItem keys = block_keys(p, b, kv_head, kb * kBackwardKeyBlock, &n);
            key_block_tiles(own, keys, chunk, chunk_end, sums_of(kb), s, query_grads);
        }
        store_query_rows<T>(own, rows_item(b, kv_head, chunk, chunk_end), query_grads);
    }
    // Key by key; keys past visible: 0 (the tile products' columns there are scratch: 0 times a Q
    // or dO row). (sums_t: rows_t rows, the first `width` stored)
    for (int64_t kb = 0; kb < blocks; ++kb) {
        int64_t n;
        const WorkItem keys = block_keys(p, b, kv_head, kb * kBackwardKeyBlock, &n);
        const int64_t visible = keys.key_end - keys.key_begin;
        const auto store_keys = [&](const float* sums_t, int64_t rows_t, int64_t columns,
                                    const MutTensorView4& gradient) {
            transpose(sums_t, rows_t, kBackwardKeyBlock, s.key_sums.data());
            std::fill(s.key_sums.begin() + visible * rows_t, s.key_sums.begin() + n * rows_t, 0.0f);
            for (int64_t j = 0; j < n; ++j)
                store_row<T>(gradient, b, kv_head, keys.key_begin + j, s.key_sums.data() + j * rows_t, columns);
        };
        const KeyBlockSums sums = sums_of(kb);
        store_keys(sums.key_grad_t, D, D, bp.dk);
        store_keys(sums.value_grad_t, width, Dv, bp.dv);
    }
}

// dV += P^T dO and dK += scale dS^T Q of the key block `keys` (block_keys, from key_block: its
// visible keys) over the query tiles of packed rows [rows_begin, rows_end) that see them
// (rows_begin a multiple of kQTileRows: the tiles are those of the whole head's rows), in row
// order, into the block's float32 sums key_grad (rows of D) and value_grad (rows of Dv). With
// query_grads (the fused pass: the dQ sums of packed rows from rows_base, rows of D), also
// dQ += dS K of every such tile's rows, over the block's keys in order. Not on the tile path
// (key_block_tiles).
void key_block_rows(const BackwardPlan& plan, const WorkItem& keys, int64_t key_block, int64_t rows_begin,
                    int64_t rows_end, float* key_grad, float* value_grad, BackwardScratch& s, float* query_grads,
                    int64_t rows_base) {
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    const int64_t visible = keys.key_end - keys.key_begin;
    for (int64_t row_begin = rows_begin; visible > 0 && row_begin < rows_end; row_begin += kQTileRows) {
        WorkItem tile;
        if (!block_tile(plan, keys, row_begin, kQTileRows, &tile)) continue;
        const int64_t rows = tile.row_end - row_begin;
        load_tile(plan, tile, rows, s);
        const float* gate = tile_gradients(plan, tile, rows, key_block, visible, s);
        // Key j's rows: dV += P[., j]^T dO, dK += dS[., j]^T Q, over the tile's rows in order.
        const auto key_rows = [&](float* y, int64_t width, const LineVector<float>& coef, const float* x) {
            return Accumulation{y, width, visible, width, coef.data(), gate, kKeyBlock, 1, x, width, rows};
        };
        const QueryRows queries = query_rows_at(plan, tile);
        plan.kernels.accumulate(key_rows(value_grad, Dv, s.scores, queries.dout));
        plan.kernels.accumulate(key_rows(key_grad, D, s.grads, queries.rows));
        if (query_grads != nullptr)
            accumulate_query_rows(plan, tile, rows, key_block, visible, gate, s,
                                  query_grads + (row_begin - rows_base) * D);
    }
}

// Rounds the dK and dV sums of the n keys of the block `keys` (block_keys; rows of D and Dv from
// key_grad and value_grad, 0 past its visible keys) into dk and dv.
template <typename T>
void store_key_block(const BackwardPlan& plan, const WorkItem& keys, int64_t n, const float* key_grad,
                     const float* value_grad) {
    const BackwardProblem& bp = *plan.problem;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    for (int64_t j = 0; j < n; ++j) {
        store_row<T>(bp.dk, keys.b, keys.kv_head, keys.key_begin + j, key_grad + j * D, D);
        store_row<T>(bp.dv, keys.b, keys.kv_head, keys.key_begin + j, value_grad + j * Dv, Dv);
    }
}

// Pass 2: dK and dV of keys [key_block, key_block + kBackwardKeyBlock) of (b, kv_head), every query
// tile that sees them summed in row order; keys past kv_lens[b] get 0. Not on the tile path.
template <typename T>
void key_block_gradients(const BackwardPlan& plan, int64_t b, int64_t kv_head, int64_t key_block,
                         BackwardScratch& s) {
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim;
    int64_t n;
    const WorkItem keys = block_keys(plan.problem->forward, b, kv_head, key_block, &n);
    std::fill(s.key_grad.begin(), s.key_grad.begin() + n * D, 0.0f);
    std::fill(s.value_grad.begin(), s.value_grad.begin() + n * Dv, 0.0f);
    key_block_rows(plan, keys, key_block, 0, plan.flash.rows_per_group, s.key_grad.data(), s.value_grad.data(), s,
                   nullptr, 0);
    store_key_block<T>(plan, keys, n, s.key_grad.data(), s.value_grad.data());
}

// The fused pass off the tile path (head_gradients), as head_tiles: the head's rows a chunk of
// kBackwardChunkTiles query tiles at a time, each chunk against every key block in order, so
// that the chunk's query side (Q, Q times the multiplier, dO and their dQ sums: 2 KB per packed
// row at D = Dv = 128) stays in the L2 cache while the key blocks stream past, instead of the
// whole head's rows streaming past each key block (at N = 2048, 8192 packed rows: 16 MB per head,
// from the L3 cache or memory for every key block). dK and dV are summed per key block across
// the chunks (s.key_grad, s.value_grad: every block's), then stored. Each element's sum runs in
// the same order as key block by key block (a block's tiles in row order, a tile's blocks in key
// order), so the bits are the same.
// Pass 0 runs here, into the thread's scratch: the head's keys once, and each chunk's query side
// as the chunk starts, whose dQ is whole once the chunk has met every key block (stored then). So
// the pass keeps, per thread, one head's keys and dK, dV sums and one chunk's rows, not float32
// copies of the call's every K, V, Q and dO (at N = 8192, 32 query heads on 8 KV heads, D = 128:
// about 20 MB a thread against 480 MB a call).
template <typename T>
void head_blocks(const BackwardPlan& plan, int64_t b, int64_t kv_head, BackwardScratch& s) {
    const AttentionProblem& p = plan.problem->forward;
    const int64_t D = plan.flash.head_dim, Dv = plan.flash.value_dim, Hkv = p.k.shape[1];
    const int64_t blocks = plan.packed.key_blocks, rows_per_group = plan.flash.rows_per_group;
    const int64_t head = b * Hkv + kv_head;
    BackwardPlan own = plan;  // this head's packed keys and chunk: the thread's scratch
    own.packed = PackedKeys{s.head_keys.data(), s.head_key_panels.data(), s.head_value_panels.data(), blocks, head};
    pack_keys<T>(own, b, kv_head);
    std::fill(s.key_grad.begin(), s.key_grad.begin() + blocks * kBackwardKeyBlock * D, 0.0f);
    std::fill(s.value_grad.begin(), s.value_grad.begin() + blocks * kBackwardKeyBlock * Dv, 0.0f);
    float* query_grads = s.query_grad.data();
    constexpr int64_t chunk_rows = kBackwardChunkTiles * kQTileRows;
    for (int64_t chunk = 0; chunk < rows_per_group; chunk += chunk_rows) {
        const int64_t chunk_end = std::min(chunk + chunk_rows, rows_per_group);
        own.queries = PackedQueries{s.chunk_rows.data(), s.chunk_scaled.data(), s.chunk_dout.data(),
                                    head * rows_per_group + chunk};
        pack_queries<T>(own, b, kv_head, chunk, chunk_end);
        std::fill(query_grads, query_grads + (chunk_end - chunk) * D, 0.0f);
        for (int64_t kb = 0; kb < blocks; ++kb) {
            int64_t n;
            const WorkItem keys = block_keys(p, b, kv_head, kb * kBackwardKeyBlock, &n);
            key_block_rows(own, keys, kb * kBackwardKeyBlock, chunk, chunk_end,
                           s.key_grad.data() + kb * kBackwardKeyBlock * D,
                           s.value_grad.data() + kb * kBackwardKeyBlock * Dv, s, query_grads, chunk);
        }
        store_query_rows<T>(own, rows_item(b, kv_head, chunk, chunk_end), query_grads);
    }
    for (int64_t kb = 0; kb < blocks; ++kb) {
        int64_t n;
        const WorkItem keys = block_keys(p, b, kv_head, kb * kBackwardKeyBlock, &n);
        store_key_block<T>(own, keys, n, s.key_grad.data() + kb * kBackwardKeyBlock * D,
                           s.value_grad.data() + kb * kBackwardKeyBlock * Dv);
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
// order (head_blocks, head_tiles: by chunks of rows), each tile's dQ summed into float32 dQ sums
// (s.query_grad) as it goes. Every
// element is the same fma chain as in passes 2 and 3 (keys ascending for dQ: blocks in order,
// each block's keys in order), so the results are the same bits; S and dP are computed once
// instead of twice.
// On the tile path, between the tile configuration's begin and end.
template <typename T>
void head_gradients(const BackwardPlan& plan, int64_t b, int64_t kv_head, BackwardScratch& s) {
    if (!plan.tiled) {
        head_blocks<T>(plan, b, kv_head, s);
        return;
    }
    plan.kernels.tiles.begin();
    head_tiles<T>(plan, b, kv_head, s);
    plan.kernels.tiles.end();
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
    if (plan.fused) {  // 2 and 3 in one, per head (the tile path: its rows rounded up to 32)
        const ScratchShape heads = plan.tiled
                                       ? ScratchShape{D, plan.pairs.value_width, kPairChunkRows, true, key_blocks, true}
                                       : ScratchShape{D, Dv, kBackwardChunkTiles * kQTileRows, false, key_blocks, true};
        for_each_item(B * Hkv, num_threads, heads,
                      [&](int64_t head, BackwardScratch& s) { head_gradients<T>(plan, head / Hkv, head % Hkv, s); });
        return;
    }
    // 2. dK, dV.
    for_each_item(B * Hkv * key_blocks, num_threads, tiles, [&](int64_t index, BackwardScratch& s) {
        const int64_t head = index / key_blocks;
        key_block_gradients<T>(plan, head / Hkv, head % Hkv, index % key_blocks * kBackwardKeyBlock, s);
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
        if (bp.out_float32)
            row_deltas<T, float>(bp, head / Hq, head % Hq, delta.data() + head * Lq, s.row_buffer.data());
        else
            row_deltas<T, T>(bp, head / Hq, head % Hq, delta.data() + head * Lq, s.row_buffer.data());
    });
    if (bp.dsinks.data != nullptr) sink_gradients(bp, delta.data());
    if (Hkv == 0) return;  // then Hq = 0 too (check_problem): no gradient left to write

    // 0. The packed keys and query side (the tile path: their pairs), in each head's item when the
    // pass is fused.
    const int64_t key_blocks = ceil_div(Lk, kBackwardKeyBlock);
    if (std::is_same_v<T, BFloat16> && tile_path(kernels, p)) {  // pass 0 inside each head's item (head_tiles)
        const BackwardPlan plan{&bp,  flash_plan(p), delta.data(), kernels, no_keys(key_blocks), no_queries(), true,
                                true, no_pairs(ceil_div(Dv, 32) * 32)};
        gradient_passes<T>(plan, num_threads);
        return;
    }
    if (fused_pass(B * Hkv, num_threads)) {  // pass 0 inside each head's item (head_blocks)
        const BackwardPlan plan{&bp, flash_plan(p), delta.data(), kernels, no_keys(key_blocks), no_queries(), true, false,
                                no_pairs()};
        gradient_passes<T>(plan, num_threads);
        return;
    }
    const int64_t packed_keys = B * Hkv * key_blocks * kBackwardKeyBlock;
    CallerBuffers& buffers = caller_buffers();
    const PackedKeys packed{grown(buffers.keys, packed_keys * D), grown(buffers.key_panels, packed_keys * D),
                            grown(buffers.value_panels, packed_keys * Dv), key_blocks};
    const int64_t packed_rows = B * Hq * Lq;  // B * Hkv heads of rows_per_group packed rows
    const PackedQueries queries{grown(buffers.query_rows, packed_rows * D), grown(buffers.query_scaled, packed_rows * D),
                                grown(buffers.dout_rows, packed_rows * Dv)};
    const BackwardPlan plan{&bp, flash_plan(p), delta.data(), kernels, packed, queries, false, false, no_pairs()};
    const int64_t rows_per_group = Hq / Hkv * Lq;
    for_each_item(B * Hkv, num_threads, tiles, [&](int64_t head, BackwardScratch&) {
        pack_keys<T>(plan, head / Hkv, head % Hkv);
        pack_queries<T>(plan, head / Hkv, head % Hkv, 0, rows_per_group);
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
