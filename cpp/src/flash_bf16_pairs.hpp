// bfloat16 prefill by products of bfloat16 pairs accumulated in float32 (docs/kernels.md,
// "Reduced precision"): the layouts, the packing and the work item that the avx512bf16 dot path
// (flash_avx512bf16.cpp: VDPBF16PS) and the amxbf16 tile path (flash_amx.cpp: TDPBF16PS) share.
// The full rule opens flash_avx512bf16.cpp; a path supplies its two products as `Products`:
//   kKeyGranule: P.V reads the keys [key_block, key_block + n rounded up to it) (2 for the dot
//     path, whose pairs end at n + n % 2; 32 for the tiles, whose P.V steps 16 key pairs), so the
//     packing zero-fills V pairs up to it (finite pad keys), and a block checks those keys' flags;
//   kRowGranule: Q pair rows up to `rows` rounded up to it are written (zero past rows);
//   block_scores(q_pairs, D2, rows, panels, n, scores, q_multiplier): S of whole K panels;
//   block_values(probs_pairs, rows, pairs, v_pairs, value_stride, out_acc, rescale):
//     O = alpha O + P V over `pairs` key pairs;
//   begin_item() / end_item(): around a work item's key blocks (the tiles' configuration).
// With out32 requested, P.V runs twice: P's bfloat16 pairs into out_acc (out's bits unchanged),
// then the pairs of P's remainder, P - bfloat16(P) rounded, into out_acc_lo, which out32 adds
// (P rounded once costs out32 up to 2^-9 of each term, which the backward's D would carry into
// the few-key rows' dq and dk; the remainder's pairs leave about 2^-17).
// Included by those two units only, each with its own target flags: hence internal linkage here,
// and each unit's own vector type V for the convert path's kernel (ODR note, flash_kernel.hpp).
#pragma once

#include <cstring>

#include "simd_avx512.hpp"

#include "flash_kernel.hpp"

namespace twinattn {
namespace {

constexpr int64_t kPairsPerBlock = kKeyBlock / 2;

template <class V, class Products>
struct PairKernel : flash::Kernel<V, BFloat16> {
    using Convert = flash::Kernel<V, BFloat16>;
    using Convert::block_probabilities;
    using Convert::finish_row;
    using Convert::round_up;
    using Convert::start_row;

    // ---- Packing (once per (b, kv_head)) ------------------------------------------------------
    static void pack_pairs(const AttentionProblem& p, int64_t b, int64_t kv_head, int64_t key_begin,
                           int64_t key_end, uint32_t* key_dst, uint32_t* value_dst,
                           unsigned char* finite_dst, int64_t value_stride) {
        const int64_t D = p.k.shape[3], D2 = (D + 1) / 2, Dv = p.v.shape[3];
        // K pair panels: pair (d2, key) from K rows read in place (flash_key_rows, a panel at a
        // time; V rows two keys at a time).
        const void* rows[kKeyPanel];
        for (int64_t panel_begin = key_begin; panel_begin < key_end; panel_begin += kKeyPanel) {
            const int64_t keys = key_end - panel_begin < kKeyPanel ? key_end - panel_begin : kKeyPanel;
            flash_key_rows(p, b, kv_head, panel_begin, keys, rows, nullptr, nullptr, nullptr);
            for (int64_t j = 0; j < kKeyPanel; ++j) {
                const uint16_t* k_row = j < keys ? static_cast<const uint16_t*>(rows[j]) : nullptr;
                for (int64_t d2 = 0; d2 < D2; ++d2) {
                    uint32_t pair = 0;
                    if (j < keys) {
                        const uint32_t low = k_row[2 * d2];
                        const uint32_t high = 2 * d2 + 1 < D ? k_row[2 * d2 + 1] : 0u;
                        pair = low | (high << 16);
                    }
                    key_dst[d2 * kKeyPanel + j] = pair;
                }
            }
            key_dst += D2 * kKeyPanel;
        }
        // V pair rows and the finite flags (a bfloat16 is finite unless its exponent is all ones).
        // Keys from key_end to padded_end (key_begin + a multiple of Products::kKeyGranule) are
        // zero pad keys, finite.
        const int64_t padded_end = key_begin + round_up(key_end - key_begin, Products::kKeyGranule);
        for (int64_t key = key_begin; key < padded_end; key += 2) {
            if (key >= key_end) {
                uint32_t* dst = value_dst + (key - key_begin) / 2 * value_stride;
                for (int64_t c = 0; c < value_stride; ++c) dst[c] = 0;
                finite_dst[key - key_begin] = finite_dst[key + 1 - key_begin] = 1;
                continue;
            }
            flash_key_rows(p, b, kv_head, key, key + 1 < key_end ? 2 : 1, nullptr, rows, nullptr, nullptr);
            const uint16_t* even = static_cast<const uint16_t*>(rows[0]);
            const uint16_t* odd = key + 1 < key_end ? static_cast<const uint16_t*>(rows[1]) : nullptr;
            uint32_t* dst = value_dst + (key - key_begin) / 2 * value_stride;
            bool even_finite = true, odd_finite = true;
            for (int64_t c = 0; c < Dv; ++c) {
                const uint32_t high = odd != nullptr ? odd[c] : 0u;
                dst[c] = static_cast<uint32_t>(even[c]) | (high << 16);
                even_finite &= (even[c] & 0x7f80u) != 0x7f80u;
                odd_finite &= (high & 0x7f80u) != 0x7f80u;
            }
            for (int64_t c = Dv; c < value_stride; ++c) dst[c] = 0;
            finite_dst[key - key_begin] = even_finite;
            finite_dst[key + 1 - key_begin] = odd_finite;  // the zero pad key too: finite
        }
    }

    // P of each row (n_padded floats, 0 past n) rounded to bfloat16 pairs, 32 keys at a time.
    // With kRemainder, P - bfloat16(P) instead, bfloat16(P) read from the pairs that `pairs` holds
    // (P's own, rounded before): out32's remainder pairs.
    template <bool kRemainder>
    static void round_probs(const float* scores, int64_t rows, int64_t n_padded, uint32_t* pairs) {
        for (int64_t r = 0; r < rows; ++r) {
            const float* row = scores + r * kKeyBlock;
            uint32_t* dst = pairs + r * kPairsPerBlock;
            for (int64_t j = 0; j < n_padded; j += 32) {
                __m512 low = _mm512_loadu_ps(row + j);
                __m512 high = j + 16 < n_padded ? _mm512_loadu_ps(row + j + 16) : _mm512_setzero_ps();
                if (kRemainder) {
                    const __m512i rounded = _mm512_loadu_si512(dst + j / 2);
                    low = _mm512_sub_ps(low, widen_bf16(_mm512_castsi512_si256(rounded)));
                    high = _mm512_sub_ps(high, widen_bf16(_mm512_extracti64x4_epi64(rounded, 1)));
                }
                const __m512bh rounded = _mm512_cvtne2ps_pbh(high, low);  // keys j .. j + 31 in order
                _mm512_storeu_si512(dst + j / 2, reinterpret_cast<__m512i>(rounded));
            }
        }
    }

    // 16 bfloat16 values as float32, exactly (their bits in a float's high half).
    static __m512 widen_bf16(__m256i half) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }

    // out32 += out_acc_lo / l for row r (after finish_row: out32 holds out_acc / l).
    static void add_remainders(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s, int64_t r) {
        const AttentionProblem& p = *plan.problem;
        const float l = s.row_sum[r];
        if (l == 0.0f) return;  // no legal key: out32 stays 0
        const int64_t packed = item.row_begin + r;
        const int64_t h = item.kv_head * plan.group + packed % plan.group, i = packed / plan.group;
        float* dst = static_cast<float*>(p.out32.data) + item.b * p.out32.stride[0] + h * p.out32.stride[1] +
                     i * p.out32.stride[2];
        const float inverse = 1.0f / l;
        const float* lo = s.out_acc_lo + r * plan.value_stride;
        for (int64_t c = 0; c < plan.value_dim; ++c) dst[c] = dst[c] + lo[c] * inverse;
    }

    // ---- The work item (steps 2-4 of flash_kernel.hpp's attend_rows, with the pair layouts) --
    static void attend_rows(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& s) {
        if (plan.packed_values == nullptr) return Convert::attend_rows(plan, item, s);  // split-key
        const AttentionProblem& p = *plan.problem;
        const int64_t G = plan.group, D = plan.head_dim, D2 = (D + 1) / 2, Dv = plan.value_dim;
        const int64_t value_stride = plan.value_stride;
        const int64_t rows = item.row_end - item.row_begin;
        const int64_t b = item.b;

        // 2. The Q tile as raw bfloat16 pairs; each row's visible end; m, l, O as the float32 kernel.
        uint32_t* q_pairs = reinterpret_cast<uint32_t*>(s.q_tile);
        Convert::prefetch_q_tile(plan, item);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t packed = item.row_begin + r;
            const int64_t h = item.kv_head * G + packed % G, i = packed / G;
            const uint16_t* q_src = reinterpret_cast<const uint16_t*>(p.q.data) + b * p.q.stride[0] +
                                    h * p.q.stride[1] + i * p.q.stride[2];
            // pair d2 = (q[2 d2], q[2 d2 + 1]), the low half the even d: q's row as it lies in
            // memory (x86 is little-endian), the last pair's high half 0 for an odd D
            std::memcpy(q_pairs + r * D2, q_src, static_cast<size_t>(D) * sizeof(uint16_t));
            if (D % 2 != 0) q_pairs[r * D2 + D2 - 1] = q_src[D - 1];
            start_row(plan, item, s, r);
        }
        float* const lo = s.out_acc_lo;  // out32's remainders (header), when requested
        for (int64_t c = 0; lo != nullptr && c < rows * value_stride; ++c) lo[c] = 0.0f;
        // (pad rows up to a multiple of Products::kRowGranule: zero, read by whole-tile products)
        for (int64_t r = rows; r < round_up(rows, Products::kRowGranule); ++r)
            for (int64_t d2 = 0; d2 < D2; ++d2) q_pairs[r * D2 + d2] = 0;
        Products::begin_item();

        // 3. Key blocks, as the float32 kernel.
        const int64_t key_stop =
            s.row_key_end[rows - 1] < item.key_end ? s.row_key_end[rows - 1] : item.key_end;
        const int64_t head = b * p.k.shape[1] + item.kv_head - plan.first_packed_head;  // in the wave
        const int64_t keys_per_head = plan.panels_per_head * kKeyPanel;
        const uint32_t* k_head_panels =
            reinterpret_cast<const uint32_t*>(plan.packed_keys) + head * plan.panels_per_head * D2 * kKeyPanel;
        const uint32_t* v_head_pairs = plan.packed_values + head * keys_per_head / 2 * value_stride;
        const unsigned char* v_head_finite = plan.value_finite + head * keys_per_head;
        for (int64_t key_block = item.key_begin; key_block < key_stop; key_block += kKeyBlock) {
            const int64_t n = key_stop - key_block < kKeyBlock ? key_stop - key_block : kKeyBlock;
            const int64_t n_padded = round_up(n, 16);
            // (a) S = Q K^T (key_block is a multiple of kKeyPanel: item.key_begin is).
            Products::block_scores(q_pairs, D2, rows, k_head_panels + (key_block / kKeyPanel) * D2 * kKeyPanel, n,
                         s.scores, plan.q_multiplier);
            // (a') - (c) as the float32 kernel.
            const bool masked = block_probabilities(plan, item, s, rows, key_block, n, n_padded);
            // (d) O = alpha O + P V: by pairs, unless P's zeros meet a non-finite V (header).
            bool values_finite = true;
            const int64_t n_read = round_up(n, Products::kKeyGranule);  // the keys P.V reads
            if (masked || n != n_read)
                for (int64_t j = 0; j < n_read; ++j) values_finite &= v_head_finite[key_block + j] != 0;
            if (!values_finite) {
                flash_key_rows(p, b, item.kv_head, key_block, n, nullptr, s.value_rows, nullptr, nullptr);
                const typename Convert::ValueRows values{s.value_rows, 0};
                Convert::template block_values<true>(s.scores, rows, n, values, s.out_acc, value_stride, Dv, s.rescale);
                for (int64_t r = 0; lo != nullptr && r < rows; ++r)  // P exact here: the remainders only rescale
                    for (int64_t c = 0; c < value_stride; ++c) lo[r * value_stride + c] *= s.rescale[r];
                continue;
            }
            // P's pairs into out_acc; with out32, the remainder's into lo (header)
            const uint32_t* v_block = v_head_pairs + key_block / 2 * value_stride;
            float* const accumulators[2] = {s.out_acc, lo};
            for (int pass = 0; pass < 2 && accumulators[pass] != nullptr; ++pass) {
                if (pass == 0)
                    round_probs<false>(s.scores, rows, n_padded, s.probs_pairs);
                else
                    round_probs<true>(s.scores, rows, n_padded, s.probs_pairs);
                Products::block_values(s.probs_pairs, rows, n_read / 2, v_block, value_stride, accumulators[pass],
                                       s.rescale);
            }
        }

        Products::end_item();
        // 4. Finish: out = O / l rounded to bfloat16, and lse (prefill items never write partials).
        for (int64_t r = 0; r < rows; ++r) finish_row(plan, item, s, r);
        for (int64_t r = 0; lo != nullptr && r < rows; ++r) add_remainders(plan, item, s, r);
    }
};

// The dot path's products: VDPBF16PS on AVX-512 registers.
struct DotProducts {
    static constexpr int64_t kKeyGranule = 2;
    static constexpr int64_t kRowGranule = 1;
    static void begin_item() {}
    static void end_item() {}

    static __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }
    static __m512i broadcast_pair(uint32_t pair) { return _mm512_set1_epi32(static_cast<int>(pair)); }

    // ---- 3a. S = Q K^T by bfloat16 pair dot products: R rows x SV vectors of 16 keys ----------
    // SV / 2 consecutive panels of 32 keys (D2 * kKeyPanel pairs apart), two vectors each: with
    // SV = 4, 6 rows hold 24 accumulators, and each pair step reads 4 key vectors and 6 Q pairs
    // for 24 dot products (one panel: 2 and 6 for 12, in 12 accumulators, which VDPBF16PS's
    // latency on two pipes leaves no slack: 5% of a bfloat16 prefill).
    template <int R, int SV>
    static void score_micro(const uint32_t* q, int64_t D2, const uint32_t* panel, float* scores,
                            __m512 multiplier) {
        static_assert(kKeyPanel == 32 && (SV == 2 || SV == 4), "a panel is two vectors of 16 keys");
        __m512 acc[R][SV];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v) acc[r][v] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < D2; ++d2) {
            __m512i keys[SV];
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v)
                keys[v] = _mm512_loadu_si512(panel + v / 2 * D2 * kKeyPanel + d2 * kKeyPanel + v % 2 * 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512bh q_pair = as_pairs(broadcast_pair(q[r * D2 + d2]));
#pragma GCC unroll 4
                for (int v = 0; v < SV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], q_pair, as_pairs(keys[v]));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < SV; ++v) _mm512_storeu_ps(scores + r * kKeyBlock + v * 16, _mm512_mul_ps(acc[r][v], multiplier));
    }

    // S for one strip of R rows against every panel holding the block's n keys: two panels at a
    // time, the last one alone where their count is odd.
    template <int R>
    static void strip_scores(const uint32_t* q, int64_t D2, const uint32_t* panels, int64_t n,
                             float* scores, __m512 multiplier) {
        const int64_t panel_count = (n + kKeyPanel - 1) / kKeyPanel;
        int64_t panel = 0;
        for (; panel + 2 <= panel_count; panel += 2)
            score_micro<R, 4>(q, D2, panels + panel * D2 * kKeyPanel, scores + panel * kKeyPanel, multiplier);
        if (panel < panel_count)
            score_micro<R, 2>(q, D2, panels + panel * D2 * kKeyPanel, scores + panel * kKeyPanel, multiplier);
    }

    static void block_scores(const uint32_t* q_pairs, int64_t D2, int64_t rows, const uint32_t* panels,
                             int64_t n, float* scores, float q_multiplier) {
        static_assert(kMicroRows == 6, "the switch below lists the strip heights 1..kMicroRows");
        const __m512 multiplier = _mm512_set1_ps(q_multiplier);
        for (int64_t r = 0; r < rows; r += kMicroRows) {
            const uint32_t* q = q_pairs + r * D2;
            float* s = scores + r * kKeyBlock;
            switch (rows - r < kMicroRows ? rows - r : kMicroRows) {
                case 1: strip_scores<1>(q, D2, panels, n, s, multiplier); break;
                case 2: strip_scores<2>(q, D2, panels, n, s, multiplier); break;
                case 3: strip_scores<3>(q, D2, panels, n, s, multiplier); break;
                case 4: strip_scores<4>(q, D2, panels, n, s, multiplier); break;
                case 5: strip_scores<5>(q, D2, panels, n, s, multiplier); break;
                default: strip_scores<6>(q, D2, panels, n, s, multiplier); break;
            }
        }
    }

    // R rows x NV vectors of value columns from column c: acc = O (times alpha), then the pairs.
    template <int R, int NV>
    static void value_micro(const uint32_t* probs, int64_t pairs, const uint32_t* v_pairs, int64_t value_stride,
                            float* out, int64_t out_stride, const float* rescale, bool do_rescale) {
        __m512 acc[R][NV];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512 alpha = _mm512_set1_ps(rescale[r]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                acc[r][v] = _mm512_loadu_ps(out + r * out_stride + v * 16);
                if (do_rescale) acc[r][v] = _mm512_mul_ps(acc[r][v], alpha);
            }
        }
        for (int64_t kp = 0; kp < pairs; ++kp) {
            __m512i values[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) values[v] = _mm512_loadu_si512(v_pairs + kp * value_stride + v * 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512bh p_pair = as_pairs(broadcast_pair(probs[r * kPairsPerBlock + kp]));
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], p_pair, as_pairs(values[v]));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * out_stride + v * 16, acc[r][v]);
    }

    template <int R>
    static void strip_values(const uint32_t* probs, int64_t pairs, const uint32_t* v_pairs, int64_t value_stride,
                             float* out, int64_t out_stride, const float* rescale) {
        constexpr int NV = kAvx512ValueVectors;
        bool do_rescale = false;
        for (int s = 0; s < R; ++s) do_rescale |= rescale[s] != 1.0f;
        int64_t c = 0;
        for (; c + NV * 16 <= value_stride; c += NV * 16)
            value_micro<R, NV>(probs, pairs, v_pairs + c, value_stride, out + c, out_stride, rescale, do_rescale);
        for (; c < value_stride; c += 16)
            value_micro<R, 1>(probs, pairs, v_pairs + c, value_stride, out + c, out_stride, rescale, do_rescale);
    }

    static void block_values(const uint32_t* probs_pairs, int64_t rows, int64_t pairs, const uint32_t* v_pairs,
                             int64_t value_stride, float* out_acc, const float* rescale) {
        for (int64_t r = 0; r < rows; r += kMicroRows) {
            const uint32_t* probs = probs_pairs + r * kPairsPerBlock;
            float* out = out_acc + r * value_stride;
            const float* alpha = rescale + r;
            switch (rows - r < kMicroRows ? rows - r : kMicroRows) {
                case 1: strip_values<1>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
                case 2: strip_values<2>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
                case 3: strip_values<3>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
                case 4: strip_values<4>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
                case 5: strip_values<5>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
                default: strip_values<6>(probs, pairs, v_pairs, value_stride, out, value_stride, alpha); break;
            }
        }
    }

};

}  // namespace
}  // namespace twinattn
