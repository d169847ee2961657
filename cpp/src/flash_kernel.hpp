// The tile kernel of the fast path (docs/kernels.md, steps 2-6), written once over a vector type
// V (simd_scalar.hpp, simd_avx2.hpp, simd_avx512.hpp) and compiled once per instruction set by
// flash_scalar.cpp, flash_avx2.cpp and flash_avx512.cpp, each with its own -m flags.
//
// One work item = a set of packed rows of one (sequence b, KV head) against a key range:
//   packed row r is query position i = r / G of query head h = kv_head * G + r % G, at absolute
//   position q_offset[b] + i (G = Hq / Hkv). Rows [row_begin, row_end), at most kQTileRows.
//   Keys [key_begin, key_end), visited in key blocks of kKeyBlock keys.
// Shapes of the per-thread scratch (ThreadScratch), rows <= kQTileRows (strips of kMicroRows
// rows, the last strip as many as remain: no padding rows):
//   q_tile   (rows, D)            Q rows times scale * log2(e) (scale / softcap with softcap)
//   scores   (rows, kKeyBlock)    S, then P, of one key block
//   out_acc  (rows, value_stride) unnormalised O
//   row_max, row_sum, rescale (rows)   m (base 2), l, and alpha of the current block
//   row_key_begin, row_key_end (rows)  each row's visible key range (length, causal, window)
//   key_panels (kKeyBlock / kKeyPanel panels of (D, kKeyPanel))   split-key path only
//
// ODR note: these templates are instantiated with a different vector type in every translation
// unit, and the code below uses no inline non-template function and no standard container, so
// no AVX-512 code can be picked by the linker for the portable path.
#pragma once

#include <math.h>  // exp2f, log2f: plain C functions, nothing inline (ODR note)

#include <cstdint>
#include <limits>
#include <type_traits>

#include "backward_kernel.hpp"
#include "element.hpp"
#include "twinattn/constants.hpp"
#include "twinattn/problem.hpp"

namespace twinattn {

// What every work item of one call shares (built by flash_attention.cpp).
struct FlashPlan {
    const AttentionProblem* problem;
    int64_t group;           // G = Hq / Hkv
    int64_t rows_per_group;  // Lq * G packed rows per (b, kv_head)
    int64_t head_dim;        // D
    int64_t value_dim;       // Dv
    int64_t value_stride;    // row stride of out_acc: Dv rounded up to a multiple of 16
    float q_multiplier;      // scale * log2(e); scale / softcap when softcap > 0
    bool has_mask;
    // softcap > 0: S (= scale q.k / softcap) becomes tanh(S) * softcap_multiplier (softcap *
    // log2(e)), in base 2 like every score of the kernel.
    bool has_softcap;
    float softcap_multiplier;
    bool has_alibi;  // -slope[b, h] * log2(e) * |p - j| added by index arithmetic
    bool has_sinks;  // the sink enters m and l once per row (docs/kernels.md, "Sinks")
    // Prefill: the K^T panels of the heads of one wave (flash_attention.cpp, step 2), head
    // (b, kv_head) at index head = b * Hkv + kv_head - first_packed_head of the packed buffers
    // below, panels_per_head panels each, panel p at packed_keys + (head * panels_per_head + p) *
    // D * kKeyPanel. nullptr on the split-key path (each item packs its own blocks).
    const float* packed_keys;
    int64_t panels_per_head;
    int64_t first_packed_head;
    // Prefill, except the pair path: the V panels of the wave's heads, float32 (converted
    // exactly; int8 unscaled: v_scale multiplies P), ceil(Dv / kValuePanel) panels of
    // panels_per_head * kKeyPanel keys x kValuePanel columns each, key j, column c of head
    // at value_panels + head * value_head_floats + (c / kValuePanel) *
    // panels_per_head * kKeyPanel * kValuePanel + j * kValuePanel + c % kValuePanel. nullptr
    // elsewhere (P.V reads V rows in place).
    const float* value_panels;
    int64_t value_head_floats;
    // The bfloat16 dot-product path (avx512bf16, prefill; docs/kernels.md, "Reduced precision"),
    // else nullptr: packed_keys then holds K pair panels, head at
    // (head * panels_per_head) * ceil(D / 2) * kKeyPanel pairs; packed_values the V
    // pair panels, key pair kp of head at (head * panels_per_head *
    // kKeyPanel / 2 + kp) * value_stride pairs; value_finite one byte per key of each head
    // (panels_per_head * kKeyPanel), 1 when every value of that key's V row is finite.
    const uint32_t* packed_values;
    const unsigned char* value_finite;
    // Split-key partials, slot s holding rows_per_group rows: out (Dv floats each), m, l.
    float* partial_out;
    float* partial_max;
    float* partial_sum;
};

struct WorkItem {
    int64_t b, kv_head;
    int64_t row_begin, row_end;  // packed rows
    int64_t key_begin, key_end;  // key range; each row also stops at its own visible end
    int64_t partial_slot;        // < 0: write out and lse; else the partials slot to write
};

struct ThreadScratch {
    float* q_tile;
    float* scores;
    float* out_acc;
    float* row_max;
    float* row_sum;
    float* rescale;
    int64_t* row_key_begin;
    int64_t* row_key_end;
    float* key_panels;
    uint32_t* probs_pairs;  // (rows, kKeyBlock / 2) bfloat16 pairs of P: the dot-product path
    // (rows, value_stride): the pair paths' P.V of P's low bfloat16 parts, only when out32 is
    // requested (flash_bf16_pairs.hpp); else nullptr
    float* out_acc_lo;
    // int8 K/V: the current block's k_scale and v_scale (kKeyBlock each; 0 past the block's keys).
    float* key_scales;
    float* value_scales;
    // The current block's K and V rows (kKeyBlock each, flash_key_rows): dense or paged alike;
    // key_rows has room for kKeyBlock more, the next block's first rows (the direct path's
    // prefetch, step 6).
    const void** key_rows;
    const void** value_rows;
};

using AttendRowsFn = void (*)(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& scratch);
// Packs keys [key_begin, key_end) of one (b, kv_head) into K^T panels at dst (the first panel
// holds keys key_begin ...); the last panel's columns past key_end are zero.
using PackKeysFn = void (*)(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                            int64_t key_begin, int64_t key_end, float* dst);
// values[0, n) = tanh(values[0, n)) with the vectorised tanh (constants.hpp, "tanh"); n a
// multiple of the vector width (tests call it on whole vectors).
using TanhFn = void (*)(float* values, int64_t n);
// The bfloat16 dot-product path: packs keys [key_begin, key_end) of one (b, kv_head) (key_begin a
// multiple of kKeyPanel) into K pair panels at key_dst (the panel of key_begin), V pair rows at
// value_dst (the pair of key_begin) and the per-key finite flags at finite_dst (key_begin's).
using PackPairsFn = void (*)(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                             int64_t key_begin, int64_t key_end, uint32_t* key_dst,
                             uint32_t* value_dst, unsigned char* finite_dst, int64_t value_stride);

// Packs V of keys [key_begin, key_end) of one (b, kv_head) into V panels at dst (the row of
// key_begin in the first panel), panel_floats apart (FlashPlan::value_panels).
using PackValuesFn = void (*)(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                              int64_t key_begin, int64_t key_end, float* dst, int64_t panel_floats);

// Indexed by ElementType: [Float32], [Float16], [BFloat16].
constexpr int kElementTypes = 3;

struct FlashKernels {
    const char* isa;
    AttendRowsFn attend_rows[kElementTypes];
    PackKeysFn pack_keys[kElementTypes];
    TanhFn tanh_values;
    int64_t width;  // floats per vector
    // bfloat16 prefill by dot products (avx512bf16 only; nullptr elsewhere): packs the pair
    // panels that attend_rows[BFloat16] then reads.
    PackPairsFn pack_pairs;
    // int8 K/V, indexed by q's ElementType; the K^T panels hold float32(k) * k_scale whatever q is.
    AttendRowsFn attend_rows_int8[kElementTypes];
    PackKeysFn pack_keys_int8;
    // The backward pass's inner products (backward_kernel.hpp).
    BackwardKernels backward;
    // The prefill's V panels, indexed by ElementType; int8 K/V.
    PackValuesFn pack_values[kElementTypes];
    PackValuesFn pack_values_int8;
};

// Defined in flash_{scalar,avx2,avx512}.cpp (the last two only when built for x86-64), each
// with flash::make_kernels below.
FlashKernels flash_kernels_scalar();
FlashKernels flash_kernels_avx2();
FlashKernels flash_kernels_avx512();
FlashKernels flash_kernels_avx512bf16();  // flash_avx512bf16.cpp
FlashKernels flash_kernels_amxbf16();     // flash_amx.cpp
BackwardTiles backward_tiles_amxbf16();  // flash_amx.cpp: the backward's tile products
BackwardTiles backward_tiles_avx512bf16();  // flash_avx512bf16.cpp: the same products on VDPBF16PS
void backward_round_pairs(const TileRounding& t);  // flash_avx512bf16.cpp: P and dS to bfloat16 pairs
// Whether the CPU has AMX-TILE and AMX-BF16 and the OS grants the tile data (flash_amx.cpp).
bool amx_bf16_usable();
FlashKernels flash_kernels_neon();  // flash_neon.cpp, only when built for AArch64

// The keys packed row r of (b, *) may see by length, causality and window: [*begin, *end),
// both in [0, kv_len]; empty when *end <= *begin (defined in flash_attention.cpp; deliberately
// not inline, see the ODR note above).
void flash_row_key_range(const AttentionProblem& p, int64_t b, int64_t group, int64_t r,
                         int64_t* begin, int64_t* end);
// Key rows (docs/kernels.md, "Key rows"): for keys [key_begin, key_begin + n) of (b, kv_head),
// the address of each key's K row in key_rows[j] and V row in value_rows[j], and its int8 scales
// in key_scales[j], value_scales[j]; each output may be nullptr (not wanted). Dense problems give
// base + j * stride; paged ones (problem.hpp, KeyPages) walk the block table page by page, with
// no division per key. The kernel reads K and V only through these rows.
void flash_key_rows(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_begin, int64_t n,
                    const void** key_rows, const void** value_rows, float* key_scales, float* value_scales);
// The absolute position q_offset[b] + r / group of packed row r, clamped to +-2^62 so that
// position - j cannot overflow (ALiBi; beyond 2^24 a float distance is inexact anyway).
int64_t flash_row_position(const AttentionProblem& p, int64_t b, int64_t group, int64_t r);
// lse = ln 2 (m + log2 l) of a row with max m (base 2) and sum l: -inf for a row that saw no key
// (l = 0), +inf for a row whose largest score is +inf (l is NaN there, inf - inf), NaN for a row
// that saw a NaN score (flash_attention.cpp, not inline either).
float flash_row_lse(float m, float l);

// Step 1's plan of a checked problem with Hkv > 0: the shapes, the Q multiplier and the
// variants' flags; no buffers (flash_attention.cpp, not inline either). The backward pass
// (flash_backward.cpp) scores with the same plan.
FlashPlan flash_plan(const AttentionProblem& p);

// The multiply-adds of a problem (B Hq Lq Lk (D + Dv)), in double: the forward's and the
// backward's measure of a call against kSerialWork.
double problem_work(const AttentionProblem& p);

namespace flash {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// T: the storage type of q and out, KV that of k and v: T, or int8_t (docs/kernels.md, "int8
// K/V": K and V converted exactly per vector load, the per-token scales applied to each score
// (direct) or to the packed K^T panel (prefill), and to P before P.V). The
// 16-bit instantiations are the convert path (docs/kernels.md, "Reduced precision"): every load
// of q, k or v converts to float32 exactly (V::load_as_f32), everything else is the float32
// kernel operation for operation, and out is rounded as it is stored (V::store_from_f32), so
// their results equal the float32 kernel's on the converted inputs, rounded. Kernel<V, float>
// is today's float32 kernel (load_as_f32 of a float is V::load).
template <class V, class T = float, class KV = T>
struct Kernel {
    using Reg = typename V::Reg;
    static constexpr int64_t W = V::kWidth;
    static constexpr bool kInt8 = std::is_same<KV, int8_t>::value;

    static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
    // a > b ? a : b, and NaN when either is NaN (the row max keeps a NaN score).
    static float max_nan(float a, float b) { return a != a || a > b ? a : b; }

    // ---- tanh (softcap; constants.hpp, "tanh") ------------------------------------------------
    // a = |x| (max(x, -x) keeps a NaN), both branches computed, the polynomial chosen unless
    // kTanhSmall < a (so a NaN takes it and stays NaN), then the sign of x.
    static Reg tanh(Reg x) {
        const Reg zero = V::zero(), one = V::broadcast(1.0f);
        const Reg a = V::max(x, V::sub(zero, x));
        const Reg u = V::mul(a, a);
        Reg poly = V::broadcast(kTanhCoefficients[kTanhDegree]);
        for (int c = kTanhDegree - 1; c >= 0; --c)
            poly = V::fma(poly, u, V::broadcast(kTanhCoefficients[c]));
        const Reg small = V::fma(V::mul(a, u), poly, a);
        const Reg e = V::exp2(V::mul(a, V::broadcast(-2.0f * kLog2E)));
        const Reg large = V::div(V::sub(one, e), V::add(one, e));
        const Reg t = V::select_less(V::broadcast(kTanhSmall), a, large, small);
        return V::select_less(x, zero, V::sub(zero, t), t);
    }

    static void tanh_values(float* values, int64_t n) {
        for (int64_t j = 0; j < n; j += W) V::store(values + j, tanh(V::load(values + j)));
    }

    // 3a''. Softcap: S (= scale q.k / softcap) -> tanh(S) * softcap * log2(e), whole vectors
    // (the padding columns too; they are overwritten with -inf afterwards).
    static void softcap_block(const FlashPlan& plan, const ThreadScratch& s, int64_t rows,
                              int64_t n_padded) {
        const Reg multiplier = V::broadcast(plan.softcap_multiplier);
        for (int64_t r = 0; r < rows; ++r) {
            float* row = s.scores + r * kKeyBlock;
            for (int64_t j = 0; j < n_padded; j += W)
                V::store(row + j, V::mul(tanh(V::load(row + j)), multiplier));
        }
    }

    // ---- 2. Packing ---------------------------------------------------------------------------
    // The rows of keys [first, first + keys) of (b, kv_head), keys <= kKeyPanel (flash_key_rows):
    // their K rows, or their V rows when `values`, and the int8 scales of the same (k_scale or
    // v_scale) at scales unless it is nullptr.
    static void panel_rows(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t first, int64_t keys,
                           bool values, const void** rows, float* scales) {
        flash_key_rows(p, b, kv_head, first, keys, values ? nullptr : rows, values ? rows : nullptr,
                       values ? nullptr : scales, values ? scales : nullptr);
    }

    static void pack_keys(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_begin,
                          int64_t key_end, float* dst) {
        const int64_t D = p.k.shape[3];
        // The panel's K rows and (int8) k_scale: column j holds float32(k_j) * k_scale[j] (one
        // rounding), so the micro-kernels below are the float32 ones.
        const void* k_rows[kKeyPanel];
        float k_scale[kKeyPanel];
        for (int64_t panel_begin = key_begin; panel_begin < key_end; panel_begin += kKeyPanel) {
            const int64_t keys = key_end - panel_begin < kKeyPanel ? key_end - panel_begin : kKeyPanel;
            panel_rows(p, b, kv_head, panel_begin, keys, false, k_rows, kInt8 ? k_scale : nullptr);
            int64_t d_done = 0;
            if (keys == kKeyPanel) {  // whole panel: W x W blocks transposed in registers
                for (; d_done + W <= D; d_done += W)
                    for (int64_t j = 0; j < kKeyPanel; j += W) {
                        Reg block[W];
                        for (int64_t t = 0; t < W; ++t)
                            block[t] = V::load_as_f32(static_cast<const KV*>(k_rows[j + t]) + d_done);
                        if (kInt8)
                            for (int64_t t = 0; t < W; ++t) block[t] = V::mul(block[t], V::broadcast(k_scale[j + t]));
                        V::transpose(block);
                        for (int64_t t = 0; t < W; ++t) V::store(dst + (d_done + t) * kKeyPanel + j, block[t]);
                    }
            }
            for (int64_t j = 0; j < keys; ++j) {  // the rest, element by element
                const KV* k_row = static_cast<const KV*>(k_rows[j]);
                if (kInt8) {
                    const float scale = k_scale[j];
                    for (int64_t d = d_done; d < D; ++d) dst[d * kKeyPanel + j] = to_f32(k_row[d]) * scale;
                } else {
                    for (int64_t d = d_done; d < D; ++d) dst[d * kKeyPanel + j] = to_f32(k_row[d]);
                }
            }
            for (int64_t j = keys; j < kKeyPanel; ++j)
                for (int64_t d = 0; d < D; ++d) dst[d * kKeyPanel + j] = 0.0f;
            dst += D * kKeyPanel;
        }
    }

    // V rows converted to float32 (int8: unscaled), kValuePanel columns per panel, the last
    // panel's columns past Dv zero (FlashPlan::value_panels).
    static void pack_values(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_begin,
                            int64_t key_end, float* dst, int64_t panel_floats) {
        const int64_t Dv = p.v.shape[3];
        const void* v_rows[kKeyPanel];
        for (int64_t first = key_begin; first < key_end; first += kKeyPanel) {
            const int64_t keys = key_end - first < kKeyPanel ? key_end - first : kKeyPanel;
            panel_rows(p, b, kv_head, first, keys, true, v_rows, nullptr);
            for (int64_t j = 0; j < keys; ++j) {
                const KV* v_row = static_cast<const KV*>(v_rows[j]);
                for (int64_t column = 0; column < Dv; column += kValuePanel) {
                    float* panel_row = dst + column / kValuePanel * panel_floats + j * kValuePanel;
                    const int64_t width = Dv - column < kValuePanel ? Dv - column : kValuePanel;
                    int64_t c = 0;
                    for (; c + W <= width; c += W) V::store(panel_row + c, V::load_as_f32(v_row + column + c));
                    if (c < width) V::store_tail(panel_row + c, V::load_tail_as_f32(v_row + column + c, width - c), width - c);
                    for (c = width; c < kValuePanel; ++c) panel_row[c] = 0.0f;
                }
            }
            dst += kKeyPanel * kValuePanel;
        }
    }

    // ---- 3a. S = Q K^T: R (<= kMicroRows) rows x SV vectors of keys ---------------------------
    // q: R rows of D; panel: (D, kKeyPanel) already offset to the first key column; vector v
    // reads panel v / kPanelVectors after it (D * kKeyPanel floats apart: the micro-kernel may
    // span panels); scores: R rows of stride kKeyBlock. While it reads panel row d it prefetches
    // the same columns kScorePrefetchBytes further on in each panel it reads (a strip reads the
    // panels as one stream, panel after panel; past the last panel the hint reads nothing the
    // program sees).
    template <int R, int SV>
    static void score_micro(const float* q, int64_t D, const float* panel, float* scores) {
        constexpr int kPanelVectors = kKeyPanel / W < SV ? kKeyPanel / W : SV;  // vectors per panel read
        constexpr int kPanels = SV / kPanelVectors;
        constexpr int64_t kMicroLines = (kPanelVectors * W * static_cast<int64_t>(sizeof(float)) + 63) / 64;
        static_assert(SV % kPanelVectors == 0, "a micro-kernel reads whole panel rows, or part of one");
        Reg acc[R][SV];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v) acc[r][v] = V::zero();
        for (int64_t d = 0; d < D; ++d) {
#pragma GCC unroll 4
            for (int pp = 0; pp < kPanels; ++pp) {
                // an address, not a pointer into the panels: it may lie past them (a prefetch never faults)
                const uintptr_t ahead =
                    reinterpret_cast<uintptr_t>(panel + pp * D * kKeyPanel + d * kKeyPanel) + kScorePrefetchBytes;
#pragma GCC unroll 2
                for (int64_t line = 0; line < kMicroLines; ++line)
                    prefetch_line(reinterpret_cast<const char*>(ahead + line * 64));
            }
            Reg keys[SV];
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v)
                keys[v] = V::load(panel + v / kPanelVectors * D * kKeyPanel + d * kKeyPanel + v % kPanelVectors * W);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const Reg q_rd = V::broadcast(q[r * D + d]);
#pragma GCC unroll 4
                for (int v = 0; v < SV; ++v) acc[r][v] = V::fma(q_rd, keys[v], acc[r][v]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v) V::store(scores + r * kKeyBlock + v * W, acc[r][v]);
    }

    // S for one strip of R rows against every panel of the block (n keys): micro-kernels of
    // kScoreVectors vectors from key 0 on; where fewer keys than that remain in the block's panels
    // (kScoreVectors * W > kKeyPanel: the last panel), one panel's width, so no panel past the
    // block's is read.
    template <int R>
    static void strip_scores(const float* q, int64_t D, const float* panels, int64_t n, float* scores) {
        constexpr int SV = V::kScoreVectors;
        constexpr int64_t keys_per_micro = SV * W;
        constexpr int kPanelVectors = kKeyPanel / W < SV ? kKeyPanel / W : SV;
        const int64_t panel_keys = round_up(n, kKeyPanel);
        for (int64_t j = 0; j < n;) {
            const float* panel = panels + j / kKeyPanel * D * kKeyPanel + j % kKeyPanel;
            if (j + keys_per_micro <= panel_keys) {
                score_micro<R, SV>(q, D, panel, scores + j);
                j += keys_per_micro;
            } else {
                score_micro<R, kPanelVectors>(q, D, panel, scores + j);
                j += kPanelVectors * W;
            }
        }
    }

    // S for all rows: strips of kMicroRows rows, the last strip as many rows as remain (no
    // padding rows are computed). A strip streams the block's panels from L2 (prefetched in
    // score_micro) while its Q rows stay in L1.
    static void block_scores(const float* q_tile, int64_t D, int64_t rows, const float* panels,
                             int64_t n, float* scores) {
        static_assert(kMicroRows == 6, "the switch below lists the strip heights 1..kMicroRows");
        for (int64_t r = 0; r < rows; r += kMicroRows) {
            const float* q = q_tile + r * D;
            float* s = scores + r * kKeyBlock;
            switch (rows - r < kMicroRows ? rows - r : kMicroRows) {
                case 1: strip_scores<1>(q, D, panels, n, s); break;
                case 2: strip_scores<2>(q, D, panels, n, s); break;
                case 3: strip_scores<3>(q, D, panels, n, s); break;
                case 4: strip_scores<4>(q, D, panels, n, s); break;
                case 5: strip_scores<5>(q, D, panels, n, s); break;
                default: strip_scores<6>(q, D, panels, n, s); break;
            }
        }
    }

    // ---- Prefetch (the direct split-key path, docs/kernels.md step 6) ------------------------
    // An item reads, per key block, its n K rows (scores), then its n V rows (P.V), then the next
    // block's K rows: one read order. Reading position m of it, the kernel prefetches position
    // m + far (kDecodePrefetchBytes of K rows ahead) into L2 and position m + near
    // (kDecodeNearPrefetchBytes) from there into L1, so that memory streams while the FMAs run:
    // the hardware prefetcher alone left the two taking turns.
    struct ReadAhead {
        const void* const* key_rows;    // the block's n K rows, then the next block's, up to key_rows_end
        const void* const* value_rows;  // the block's n V rows
        int64_t n, key_rows_end, near, far, key_bytes, value_bytes;
    };

    // One cache line into L1, or into L2 when kL2 (the read-ahead's far hint). An asm statement:
    // GCC deletes a __builtin_prefetch (or _mm_prefetch) in a loop that it inlines into these
    // kernels as an effect-free loop.
    template <bool kL2>
    static void prefetch_line_into(const char* line) {
#if defined(__x86_64__) || defined(__i386__)
        if (kL2)
            asm volatile("prefetcht2 (%0)" : : "r"(line));
        else
            asm volatile("prefetcht0 (%0)" : : "r"(line));
#elif defined(__aarch64__)
        if (kL2)
            asm volatile("prfm pldl2keep, [%0]" : : "r"(line));
        else
            asm volatile("prfm pldl1keep, [%0]" : : "r"(line));
#else
        (void)line;
#endif
    }

    static void prefetch_line(const char* line) { prefetch_line_into<false>(line); }

    template <bool kL2>
    static void prefetch_row(const void* row, int64_t bytes) {
        const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63});
        const char* const end = static_cast<const char*>(row) + bytes;
        for (; line < end; line += 64) prefetch_line_into<kL2>(line);
    }

    // Every line of the item's Q rows into L1, before step 2 copies them: the rows lie in G heads'
    // runs of positions, and read one after another their lines came from memory a few at a time
    // (the copy took 20% of a float32 prefill tile's own time, 2% of the whole).
    static void prefetch_q_tile(const FlashPlan& plan, const WorkItem& item) {
        const AttentionProblem& p = *plan.problem;
        for (int64_t packed = item.row_begin; packed < item.row_end; ++packed) {
            const int64_t h = item.kv_head * plan.group + packed % plan.group, i = packed / plan.group;
            prefetch_row<false>(static_cast<const T*>(p.q.data) + item.b * p.q.stride[0] + h * p.q.stride[1] +
                                    i * p.q.stride[2],
                                plan.head_dim * static_cast<int64_t>(sizeof(T)));
        }
    }

    // Prefetches position m of the read order (nothing past the item's keys).
    template <bool kL2>
    static void prefetch_position(const ReadAhead& ahead, int64_t m) {
        if (m < ahead.n)
            prefetch_row<kL2>(ahead.key_rows[m], ahead.key_bytes);
        else if (m < 2 * ahead.n)
            prefetch_row<kL2>(ahead.value_rows[m - ahead.n], ahead.value_bytes);
        else if (m - ahead.n < ahead.key_rows_end)
            prefetch_row<kL2>(ahead.key_rows[m - ahead.n], ahead.key_bytes);
    }

    // The read-ahead's distance of `bytes` bytes of K rows (key_bytes each) in rows: 1 to kKeyBlock.
    static int64_t rows_ahead(int64_t bytes, int64_t key_bytes) {
        const int64_t rows = key_bytes == 0 ? 1 : (bytes + key_bytes - 1) / key_bytes;
        return rows < kKeyBlock ? rows : kKeyBlock;
    }

    // Reading position m of the read order: position m + near into L1, then m + far into L2.
    // Inlined always (as Rust's #[inline(always)]): GCC kept it out of line, and a call from
    // direct_strip spills the strip's score vectors around it (every vector register is
    // caller-saved).
    __attribute__((always_inline)) static void read_ahead(const ReadAhead& ahead, int64_t m) {
        prefetch_position<false>(ahead, m + ahead.near);
        prefetch_position<true>(ahead, m + ahead.far);
    }

    // ---- 3a'. Direct S (split-key groups of at most kDirectScoreRows rows, docs step 6) ------
    // K is read in place (its rows are contiguous): no K^T panel. One batch of four keys k[0..3]
    // against R rows of q: one accumulator per (row, key), then each row's four accumulators
    // reduced to one vector by V::reduce4, into y[r * y_stride]. D is walked W floats at a time
    // (the last chunk a masked tail load of q and k: lanes past D are 0 and never read), chunk d
    // of the four keys together, so each q chunk is loaded once for four keys; every
    // accumulator still sums over D in order. (With no software prefetch this interleaving
    // stalled on memory, 22 ms against 13.5-14 ms for whole rows one key after another at 32k
    // keys on one thread; with the read-ahead above it is the faster order.)
    template <int R>
    static void direct_batch(const float* q, int64_t D, const KV* const k[4], Reg* y,
                             int64_t y_stride) {
        Reg acc[R][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) acc[r][t] = V::zero();
        int64_t d = 0;
        for (; d + W <= D; d += W) {
            Reg key_d[4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) key_d[t] = V::load_as_f32(k[t] + d);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const Reg q_rd = V::load(q + r * D + d);
#pragma GCC unroll 4
                for (int t = 0; t < 4; ++t) acc[r][t] = V::fma(q_rd, key_d[t], acc[r][t]);
            }
        }
        if (d < D) {
            const int64_t tail = D - d;
            Reg key_d[4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) key_d[t] = V::load_tail_as_f32(k[t] + d, tail);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const Reg q_rd = V::load_tail(q + r * D + d, tail);
#pragma GCC unroll 4
                for (int t = 0; t < 4; ++t) acc[r][t] = V::fma(q_rd, key_d[t], acc[r][t]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) y[r * y_stride] = V::reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }

    // S of R rows for keys [j0, j0 + W) of the block: W / 4 batches of four keys, then per row
    // V::fold_groups into W scores. A key at or past n (past the block's end) is never read: a
    // batch wholly past n is 0, a key past n inside a batch reuses key n - 1; both scores are
    // overwritten with -inf before the softmax. int8: each score is then acc * k_scale (one
    // multiply per (row, key); key_scales is the block's, 0 past n). ahead (the first strip
    // only, else nullptr): each batch reads ahead of its four positions (read_ahead).
    template <int R>
    static void direct_strip(const float* q, int64_t D, const void* const* k_rows, int64_t j0, int64_t n,
                             const float* key_scales, float* scores, const ReadAhead* ahead) {
        constexpr int64_t kBatches = W / 4;
        Reg y[R][kBatches];
        for (int64_t b = 0; b < kBatches; ++b) {
            const int64_t first = j0 + 4 * b;
            if (first >= n) {
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) y[r][b] = V::zero();
                continue;
            }
            const KV* k[4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) k[t] = static_cast<const KV*>(k_rows[first + t < n ? first + t : n - 1]);
            if (ahead != nullptr)
                for (int64_t t = 0; t < 4; ++t) read_ahead(*ahead, first + t);
            direct_batch<R>(q, D, k, &y[0][b], kBatches);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            if (kInt8)
                V::store(scores + r * kKeyBlock + j0, V::mul(V::fold_groups(y[r]), V::load(key_scales + j0)));
            else
                V::store(scores + r * kKeyBlock + j0, V::fold_groups(y[r]));
        }
    }

    // S for all rows (<= kDirectScoreRows) against the block's n keys read in place: groups of
    // W keys, each in strips of V::kDirectStripRows rows (the last strip as many as remain).
    static void direct_block_scores(const float* q_tile, int64_t D, int64_t rows, const void* const* k_rows,
                                    int64_t n, const float* key_scales, float* scores, const ReadAhead& ahead) {
        constexpr int64_t SR = V::kDirectStripRows;
        static_assert(SR >= 1 && SR <= 6, "the switch below lists the strip heights 1..6");
        for (int64_t j0 = 0; j0 < n; j0 += W) {
            for (int64_t r = 0; r < rows; r += SR) {
                const float* q = q_tile + r * D;
                float* s = scores + r * kKeyBlock;
                const ReadAhead* first_strip = r == 0 ? &ahead : nullptr;
                switch (rows - r < SR ? rows - r : SR) {
                    case 1: direct_strip<1>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                    case 2: direct_strip<2>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                    case 3: direct_strip<(SR >= 3 ? 3 : 1)>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                    case 4: direct_strip<(SR >= 4 ? 4 : 1)>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                    case 5: direct_strip<(SR >= 5 ? 5 : 1)>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                    default: direct_strip<(SR >= 6 ? 6 : 1)>(q, D, k_rows, j0, n, key_scales, s, first_strip); break;
                }
            }
        }
    }

    // ---- 3d. O = alpha O + P V: R (<= kMicroRows) rows x NV vectors of value columns -----------------
    // Where P.V reads V: row(key) is the key's value at the current column, for keys counted from
    // the current chunk's first key. keys_from(j) moves that first key on by j, columns_from(c) the
    // column by c (within one V panel: a column block never straddles two).
    // ValueRows: the rows in place, one pointer per key (split-key items, the pair path).
    struct ValueRows {
        const void* const* rows;
        int64_t column;
        const KV* row(int64_t key) const { return static_cast<const KV*>(rows[key]) + column; }
        ValueRows keys_from(int64_t key) const { return ValueRows{rows + key, column}; }
        ValueRows columns_from(int64_t c) const { return ValueRows{rows, column + c}; }
    };
    // ValuePanels: the prefill's packed V panels (FlashPlan::value_panels), float32, one
    // kValuePanel-float row per key; panel_floats from one panel to the next.
    struct ValuePanels {
        const float* first;
        int64_t panel_floats;
        const float* row(int64_t key) const { return first + key * kValuePanel; }
        ValuePanels keys_from(int64_t key) const { return ValuePanels{first + key * kValuePanel, panel_floats}; }
        ValuePanels columns_from(int64_t c) const {
            return ValuePanels{first + c / kValuePanel * panel_floats + c % kValuePanel, panel_floats};
        }
    };

    // kTail: the last vector holds only `tail` columns. kSafe: a row whose p is 0 (a hidden key)
    // skips the key, so a NaN in a hidden value never enters (0 * NaN = NaN). ahead (the direct
    // path's first strip and column block, else nullptr): key j reads ahead of position n + j of
    // the read order (read_ahead).
    template <int R, int NV, bool kTail, bool kSafe, class Values>
    static void value_micro(const float* probs, int64_t n, const Values& values, float* out,
                            int64_t out_stride, const float* rescale, bool do_rescale, int64_t tail,
                            const ReadAhead* ahead) {
        Reg acc[R][NV] = {};  // (= {}: silences a false -Wuninitialized)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const Reg alpha = V::broadcast(rescale[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                acc[r][v] = V::load(out + r * out_stride + v * W);
                if (do_rescale) acc[r][v] = V::mul(acc[r][v], alpha);
            }
        }
        for (int64_t key = 0; key < n; ++key) {
            if (ahead != nullptr) read_ahead(*ahead, ahead->n + key);
            const auto* v_row = values.row(key);
            Reg value[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                value[v] = (kTail && v == NV - 1) ? V::load_tail_as_f32(v_row + v * W, tail)
                                                   : V::load_as_f32(v_row + v * W);
            if (kSafe) {
                bool all_visible = true;
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) all_visible &= probs[r * kKeyBlock + key] != 0.0f;
                if (!all_visible) {
                    for (int r = 0; r < R; ++r) {
                        const float p = probs[r * kKeyBlock + key];
                        if (p == 0.0f) continue;
                        const Reg p_r = V::broadcast(p);
#pragma GCC unroll 4
                        for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(p_r, value[v], acc[r][v]);
                    }
                    continue;
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const Reg p_r = V::broadcast(probs[r * kKeyBlock + key]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(p_r, value[v], acc[r][v]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) V::store(out + r * out_stride + v * W, acc[r][v]);
    }

    // O for one strip of R rows: column blocks of kValueVectors vectors, then single vectors,
    // then the masked tail.
    template <int R, bool kSafe, class Values>
    static void strip_values(const float* probs, int64_t n, const Values& values, float* out,
                             int64_t out_stride, int64_t Dv, const float* rescale, const ReadAhead* ahead) {
        constexpr int NV = V::kValueVectors;
        bool do_rescale = false;
        for (int s = 0; s < R; ++s) do_rescale |= rescale[s] != 1.0f;
        int64_t c = 0;
        for (; c + NV * W <= Dv; c += NV * W)
            value_micro<R, NV, false, kSafe>(probs, n, values.columns_from(c), out + c, out_stride,
                                             rescale, do_rescale, 0, c == 0 ? ahead : nullptr);
        for (; c + W <= Dv; c += W)
            value_micro<R, 1, false, kSafe>(probs, n, values.columns_from(c), out + c, out_stride,
                                            rescale, do_rescale, 0, c == 0 ? ahead : nullptr);
        if (c < Dv)
            value_micro<R, 1, true, kSafe>(probs, n, values.columns_from(c), out + c, out_stride,
                                           rescale, do_rescale, Dv - c, c == 0 ? ahead : nullptr);
    }

    // O for all rows: key chunks of kValueKeyChunk keys, each through every strip of kMicroRows
    // rows (the last strip as many rows as remain), so that the chunk's V rows stay in L1 while
    // every strip reads them; alpha is applied with the first chunk. Each O element still sums
    // its keys in key order, so the chunks change no bit. ahead: the direct path's read order
    // (nullptr elsewhere), prefetched by the first strip; that path reads the block in one chunk.
    template <bool kSafe, class Values>
    static void block_values(const float* scores, int64_t rows, int64_t n, const Values& values,
                             float* out_acc, int64_t out_stride, int64_t Dv, const float* rescale,
                             const ReadAhead* ahead = nullptr) {
        static_assert(kMicroRows == 6, "kNoRescale and the switch below list kMicroRows strips");
        static constexpr float kNoRescale[kMicroRows] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
        const int64_t chunk = ahead == nullptr ? kValueKeyChunk : n;
        int64_t chunk_begin = 0;
        do {  // at least once: n = 0 still rescales O
            const int64_t keys = n - chunk_begin < chunk ? n - chunk_begin : chunk;
            const Values chunk_values = values.keys_from(chunk_begin);
            for (int64_t r = 0; r < rows; r += kMicroRows) {
                const float* probs = scores + r * kKeyBlock + chunk_begin;
                float* out = out_acc + r * out_stride;
                const float* alpha = chunk_begin == 0 ? rescale + r : kNoRescale;
                const ReadAhead* first_strip = r == 0 ? ahead : nullptr;
                switch (rows - r < kMicroRows ? rows - r : kMicroRows) {
                    case 1: strip_values<1, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                    case 2: strip_values<2, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                    case 3: strip_values<3, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                    case 4: strip_values<4, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                    case 5: strip_values<5, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                    default: strip_values<6, kSafe>(probs, keys, chunk_values, out, out_stride, Dv, alpha, first_strip); break;
                }
            }
            chunk_begin += chunk;
        } while (chunk_begin < n);
    }

    // ---- The work item: steps 1-4 of docs/kernels.md for rows x keys --------------------------
    static void attend_rows(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s) {
        const AttentionProblem& p = *plan.problem;
        const int64_t G = plan.group, D = plan.head_dim, Dv = plan.value_dim;
        const int64_t out_stride = plan.value_stride;
        const int64_t rows = item.row_end - item.row_begin;
        const int64_t b = item.b;

        // 2. The Q tile, times scale * log2(e); each row's visible end; m = -inf, l = 0, O = 0.
        prefetch_q_tile(plan, item);
        const Reg multiplier = V::broadcast(plan.q_multiplier);
        for (int64_t r = 0; r < rows; ++r) {
            float* q_dst = s.q_tile + r * D;
            const int64_t packed = item.row_begin + r;
            const int64_t h = item.kv_head * G + packed % G, i = packed / G;
            const T* q_src = static_cast<const T*>(p.q.data) + b * p.q.stride[0] + h * p.q.stride[1] +
                             i * p.q.stride[2];
            int64_t d = 0;
            for (; d + W <= D; d += W) V::store(q_dst + d, V::mul(V::load_as_f32(q_src + d), multiplier));
            if (d < D)
                V::store_tail(q_dst + d, V::mul(V::load_tail_as_f32(q_src + d, D - d), multiplier), D - d);
            start_row(plan, item, s, r);
        }

        // 3. Key blocks from item.key_begin (at or before the first row's window start) up to the
        // last key any row sees (rows are ordered by position, so are their ranges' ends).
        const int64_t key_stop =
            s.row_key_end[rows - 1] < item.key_end ? s.row_key_end[rows - 1] : item.key_end;
        const float* k_head_panels =
            plan.packed_keys == nullptr
                ? nullptr
                : plan.packed_keys +
                      (b * p.k.shape[1] + item.kv_head - plan.first_packed_head) * plan.panels_per_head * D * kKeyPanel;
        // Split-key groups of few rows read K in place (3a'); the others pack K^T panels.
        const bool direct = plan.packed_keys == nullptr && rows <= kDirectScoreRows;
        // The direct path's read-ahead: kDecodeNearPrefetchBytes and kDecodePrefetchBytes of K rows.
        const int64_t key_bytes = D * static_cast<int64_t>(sizeof(KV));
        const int64_t near = rows_ahead(kDecodeNearPrefetchBytes, key_bytes);
        const int64_t far = rows_ahead(kDecodePrefetchBytes, key_bytes);
        for (int64_t key_block = item.key_begin; key_block < key_stop; key_block += kKeyBlock) {
            const int64_t n = key_stop - key_block < kKeyBlock ? key_stop - key_block : kKeyBlock;
            const int64_t n_padded = round_up(n, W);
            const float* panels = nullptr;
            if (k_head_panels != nullptr) {
                panels = k_head_panels + (key_block / kKeyPanel) * D * kKeyPanel;
            } else if (!direct) {
                pack_keys(p, b, item.kv_head, key_block, key_block + n, s.key_panels);
                panels = s.key_panels;
            }
            // The block's K rows (read in place by the direct path only), V rows (not with V
            // panels) and int8 scales, 0 past n (those scores become -inf below); the direct path
            // also takes the next block's first K rows, for its read-ahead (never past the item's
            // last key).
            flash_key_rows(p, b, item.kv_head, key_block, n, direct ? s.key_rows : nullptr,
                           plan.value_panels == nullptr ? s.value_rows : nullptr,
                           kInt8 ? s.key_scales : nullptr, kInt8 ? s.value_scales : nullptr);
            const int64_t ahead_end = key_stop - key_block < n + far ? key_stop - key_block : n + far;
            if (direct && ahead_end > n)
                flash_key_rows(p, b, item.kv_head, key_block + n, ahead_end - n, s.key_rows + n, nullptr, nullptr,
                               nullptr);
            const ReadAhead ahead{s.key_rows, s.value_rows, n, ahead_end, near, far, key_bytes,
                                  Dv * static_cast<int64_t>(sizeof(KV))};
            if (kInt8)
                for (int64_t j = n; j < n_padded; ++j) s.key_scales[j] = s.value_scales[j] = 0.0f;
            // (a) S = Q K^T (int8: direct scores times k_scale here, panels already scaled).
            if (direct)
                direct_block_scores(s.q_tile, D, rows, s.key_rows, n, s.key_scales, s.scores, ahead);
            else
                block_scores(s.q_tile, D, rows, panels, n, s.scores);
            // (a') - (c) Softcap, mask, online softmax.
            const bool masked = block_probabilities(plan, item, s, rows, key_block, n, n_padded);
            // (c') int8: P times v_scale after l has summed the unscaled P; a P of 0 (a hidden
            // key) stays 0, so a hidden key's NaN scale never enters. The product is formed
            // for every key and then chosen: no branch and no conditional load, so GCC
            // vectorizes the loop (with the branch it stayed scalar).
            if (kInt8)
                for (int64_t r = 0; r < rows; ++r) {
                    float* __restrict probs = s.scores + r * kKeyBlock;
                    const float* __restrict value_scales = s.value_scales;
                    for (int64_t j = 0; j < n; ++j) {
                        const float scaled = probs[j] * value_scales[j];
                        probs[j] = probs[j] == 0.0f ? 0.0f : scaled;
                    }
                }
            // (d) O = alpha O + P V: from the V panels one panel of columns at a time (prefill), else
            // from the V rows in place; kSafe when the block was masked.
            const auto value_block = [&](const auto& values, float* out, int64_t width, const ReadAhead* value_ahead) {
                if (masked)
                    block_values<true>(s.scores, rows, n, values, out, out_stride, width, s.rescale, value_ahead);
                else
                    block_values<false>(s.scores, rows, n, values, out, out_stride, width, s.rescale, value_ahead);
            };
            if (plan.value_panels != nullptr) {
                const ValuePanels values{plan.value_panels + (b * p.k.shape[1] + item.kv_head - plan.first_packed_head) * plan.value_head_floats +
                                             key_block * kValuePanel,
                                         plan.panels_per_head * kKeyPanel * kValuePanel};
                for (int64_t column = 0; column < Dv; column += kValuePanel)
                    value_block(values.columns_from(column), s.out_acc + column,
                                Dv - column < kValuePanel ? Dv - column : kValuePanel, nullptr);
            } else {
                value_block(ValueRows{s.value_rows, 0}, s.out_acc, Dv, direct ? &ahead : nullptr);
            }
        }

        // 4. Finish: out = O / l and lse, or the partial (m, l, O) of this key range.
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t packed = item.row_begin + r;
            const float* o = s.out_acc + r * out_stride;
            if (item.partial_slot >= 0) {
                const int64_t slot_row = item.partial_slot * plan.rows_per_group + packed;
                float* dst = plan.partial_out + slot_row * Dv;
                for (int64_t c = 0; c < Dv; ++c) dst[c] = o[c];
                plan.partial_max[slot_row] = s.row_max[r];
                plan.partial_sum[slot_row] = s.row_sum[r];
                continue;
            }
            finish_row(plan, item, s, r);
        }
    }

    // 2, per row: row r's visible key range, m and l (the sink's when this item writes out, else
    // -inf and 0: the sink enters once per row, here or in the merge), and O = 0.
    static void start_row(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s, int64_t r) {
        const AttentionProblem& p = *plan.problem;
        const int64_t packed = item.row_begin + r;
        const int64_t h = item.kv_head * plan.group + packed % plan.group;
        flash_row_key_range(p, item.b, plan.group, packed, &s.row_key_begin[r], &s.row_key_end[r]);
        if (plan.has_sinks && item.partial_slot < 0) {
            s.row_max[r] = p.sinks.data[h * p.sinks.stride[0]] * kLog2E;
            s.row_sum[r] = 1.0f;
        } else {
            s.row_max[r] = kNegInf;
            s.row_sum[r] = 0.0f;
        }
        for (int64_t c = 0; c < plan.value_stride; ++c) s.out_acc[r * plan.value_stride + c] = 0.0f;
    }

    // 3 (a') - (c) on the block's scores S (rows x n, padded to n_padded): softcap; the mask,
    // applied only to blocks that cross a row's visible range (its window start or its visible
    // end) or when a mask is given, ALiBi's term on every block; -inf on the padding; the online
    // softmax (S becomes P, m and l updated, rescale set). Returns whether the block was masked.
    static bool block_probabilities(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s,
                                    int64_t rows, int64_t key_block, int64_t n, int64_t n_padded) {
        if (plan.has_softcap) softcap_block(plan, s, rows, n_padded);
        const bool masked = plan.has_mask || s.row_key_end[0] < key_block + n ||
                            s.row_key_begin[rows - 1] > key_block;
        if (masked || plan.has_alibi) mask_block(plan, item, s, rows, key_block, n);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = n; j < n_padded; ++j) s.scores[r * kKeyBlock + j] = kNegInf;
        for (int64_t r = 0; r < rows; ++r) softmax_row(s.scores + r * kKeyBlock, n_padded, s, r);
        return masked;
    }

    // 4, per row of an item that writes out: out = O / l, rounded to T as it is stored, and lse.
    static void finish_row(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s, int64_t r) {
        const AttentionProblem& p = *plan.problem;
        const int64_t G = plan.group, Dv = plan.value_dim, b = item.b;
        const int64_t packed = item.row_begin + r;
        const int64_t h = item.kv_head * G + packed % G, i = packed / G;
        float* o = s.out_acc + r * plan.value_stride;
        T* dst = static_cast<T*>(p.out.data) + b * p.out.stride[0] + h * p.out.stride[1] + i * p.out.stride[2];
        const float l = s.row_sum[r];
        // l = 0: no legal key. O is 0 then, unless a visible key that scored -inf (inf in q or k)
        // brought 0 * NaN from its value in an unmasked block: the row is zeros, as in the reference.
        if (l == 0.0f)
            for (int64_t c = 0; c < Dv; ++c) o[c] = 0.0f;
        const Reg inverse = V::broadcast(l == 0.0f ? 0.0f : 1.0f / l);
        int64_t c = 0;
        for (; c + W <= Dv; c += W) V::store_from_f32(dst + c, V::mul(V::load(o + c), inverse));
        if (c < Dv) V::store_tail_from_f32(dst + c, V::mul(V::load(o + c), inverse), Dv - c);
        if (!std::is_same<T, float>::value && p.out32.data != nullptr) store_out32(p, b, h, i, o, inverse, Dv);
        if (p.lse.data != nullptr) {
            float* lse = p.lse.data + b * p.lse.stride[0] + h * p.lse.stride[1] + i * p.lse.stride[2];
            *lse = flash_row_lse(s.row_max[r], l);
        }
    }

    // 4, out32 (float16 / bfloat16, when given): the same O / l as out, stored before rounding.
    static void store_out32(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, const float* o, Reg inverse,
                            int64_t Dv) {
        float* dst = static_cast<float*>(p.out32.data) + b * p.out32.stride[0] + h * p.out32.stride[1] +
                     i * p.out32.stride[2];
        int64_t c = 0;
        for (; c + W <= Dv; c += W) V::store_from_f32(dst + c, V::mul(V::load(o + c), inverse));
        if (c < Dv) V::store_tail_from_f32(dst + c, V::mul(V::load(o + c), inverse), Dv - c);
    }

    // 3b. -inf outside each row's visible range [begin, end) (index arithmetic: window start,
    // visible end); on the keys inside it, ALiBi's -slope * log2(e) * |p - j|, then the bool /
    // float mask, read through its strides.
    static void mask_block(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s,
                           int64_t rows, int64_t key_block, int64_t n) {
        const AttentionProblem& p = *plan.problem;
        for (int64_t r = 0; r < rows; ++r) {
            float* row = s.scores + r * kKeyBlock;
            // keys [begin, end) of the block may be seen
            const int64_t window_begin = s.row_key_begin[r] - key_block;
            const int64_t visible = s.row_key_end[r] - key_block;
            const int64_t begin = window_begin < 0 ? 0 : window_begin < n ? window_begin : n;
            const int64_t end = visible < begin ? begin : visible < n ? visible : n;
            for (int64_t j = 0; j < begin; ++j) row[j] = kNegInf;
            for (int64_t j = end; j < n; ++j) row[j] = kNegInf;
            if (!plan.has_mask && !plan.has_alibi) continue;
            const int64_t packed = item.row_begin + r;
            const int64_t h = item.kv_head * plan.group + packed % plan.group, i = packed / plan.group;
            if (plan.has_alibi) {
                const float slope = -p.alibi_slopes.data[item.b * p.alibi_slopes.stride[0] +
                                                         h * p.alibi_slopes.stride[1]] * kLog2E;
                const int64_t distance0 = flash_row_position(p, item.b, plan.group, packed) - key_block;
                for (int64_t j = begin; j < end; ++j) {
                    const int64_t distance = distance0 - j;  // p - (key_block + j)
                    row[j] = row[j] + slope * static_cast<float>(distance < 0 ? -distance : distance);
                }
            }
            if (!plan.has_mask) continue;
            const int64_t mask_row = item.b * p.mask.stride[0] + h * p.mask.stride[1] + i * p.mask.stride[2];
            if (p.mask.kind == MaskKind::Bool) {
                const unsigned char* mask = static_cast<const unsigned char*>(p.mask.data) + mask_row;
                for (int64_t j = begin; j < end; ++j)
                    if (mask[(key_block + j) * p.mask.stride[3]] == 0) row[j] = kNegInf;
            } else {
                const float* bias = static_cast<const float*>(p.mask.data) + mask_row;
                for (int64_t j = begin; j < end; ++j) {
                    const float bias_j = bias[(key_block + j) * p.mask.stride[3]];
                    row[j] = bias_j == kNegInf ? kNegInf : row[j] + bias_j * kLog2E;
                }
            }
        }
    }

    // Whether any of the n floats at row is NaN: softmax_row's rare path, kept out of line.
    __attribute__((cold, noinline)) static bool any_nan(const float* row, int64_t n) {
        for (int64_t j = 0; j < n; ++j)
            if (row[j] != row[j]) return true;
        return false;
    }

    // 3c. m_new = max(m, rowmax S), alpha = 2^(m - m_new), P = 2^(S - m_new), l = l alpha + sum P.
    // Non-finite scores (scores of hidden keys are -inf by now, whatever K, V or the mask held
    // there), checked once per row and block, never per score: a row that sees a NaN score gets
    // m = NaN, a row whose largest score is +inf m = +inf (NaN wins). Both leave the softmax
    // undefined (NaN - NaN, inf - inf), as in the reference: alpha = NaN makes O and l NaN, and
    // they stay NaN through every later block (m = NaN sticks: max_nan). The vector max (maxps)
    // may drop a NaN score, but exp2 passes NaN on, so P and the block's sum carry it: a NaN sum
    // under a finite m can only come from a NaN score. Where the max alone decides (m = -inf:
    // "nothing visible yet", or m = +inf) the block is scanned for NaN; those rows are rare.
    static void softmax_row(float* row, int64_t n_padded, const ThreadScratch& s, int64_t r) {
        Reg running = V::broadcast(kNegInf);
        for (int64_t j = 0; j < n_padded; j += W) running = V::max(running, V::load(row + j));
        const float block_max = V::reduce_max(running);
        const float m_old = s.row_max[r];
        float m_new = max_nan(m_old, block_max);
        if ((m_new == kNegInf || m_new == kInf) && any_nan(row, n_padded)) m_new = kNaN;
        if (m_new == kNegInf) {  // nothing visible yet: P = 0, nothing to rescale
            for (int64_t j = 0; j < n_padded; j += W) V::store(row + j, V::zero());
            s.rescale[r] = 1.0f;
            return;
        }
        const float alpha = m_new != m_new || m_new == kInf ? kNaN
                            : m_old == m_new                  ? 1.0f
                                                              : exp2f(m_old - m_new);  // m_old = -inf: 0
        const Reg shift = V::broadcast(m_new);
        Reg sum = V::zero();
        for (int64_t j = 0; j < n_padded; j += W) {
            const Reg prob = V::exp2(V::sub(V::load(row + j), shift));
            V::store(row + j, prob);
            sum = V::add(sum, prob);
        }
        const float l_new = s.row_sum[r] * alpha + V::reduce_sum(sum);
        if (l_new != l_new && m_new != kInf) m_new = kNaN;  // a NaN score the max missed
        s.rescale[r] = alpha;
        s.row_sum[r] = l_new;
        s.row_max[r] = m_new;
    }
};

// The table of one instruction set: the kernel for each storage type.
template <class V>
FlashKernels make_kernels() {
    return FlashKernels{V::kName,
                        {Kernel<V, float>::attend_rows, Kernel<V, Float16>::attend_rows,
                         Kernel<V, BFloat16>::attend_rows},
                        {Kernel<V, float>::pack_keys, Kernel<V, Float16>::pack_keys,
                         Kernel<V, BFloat16>::pack_keys},
                        Kernel<V, float>::tanh_values,
                        V::kWidth,
                        nullptr,
                        {Kernel<V, float, int8_t>::attend_rows, Kernel<V, Float16, int8_t>::attend_rows,
                         Kernel<V, BFloat16, int8_t>::attend_rows},
                        Kernel<V, float, int8_t>::pack_keys,
                        backward::make_backward_kernels<V>(),
                        {Kernel<V, float>::pack_values, Kernel<V, Float16>::pack_values,
                         Kernel<V, BFloat16>::pack_values},
                        Kernel<V, float, int8_t>::pack_values};
}

}  // namespace flash
}  // namespace twinattn
