// The "avx512bf16" instruction set (docs/kernels.md, "Reduced precision"): AVX-512F plus
// AVX512_BF16's VDPBF16PS for bfloat16 prefill. Compile flags of this translation unit:
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c (cpp/CMakeLists.txt).
//
// float32 and float16 problems run the avx512 kernels themselves (dispatch.cpp copies their
// table entries), and so do the bfloat16 split-key items: the convert path, here compiled with
// its own vector type (VecAvx512Bf16, ODR note in simd_avx512.hpp), same source, same results.
// bfloat16 prefill (plan.packed_keys != nullptr) computes S = Q K^T and O += P V by dot products
// of bfloat16 pairs, accumulated in float32:
//   K pair panels, per panel of kKeyPanel keys: [D2][kKeyPanel] 32-bit pairs, D2 = ceil(D / 2);
//     pair (d2, key) = (K[key][2 d2], K[key][2 d2 + 1]), low half the even d; an odd D pads the
//     last pair's high half with 0; keys past the end are 0.
//   Q tile: each row's raw bfloat16 q as D2 pairs (padded like K), not scaled.
//   S micro-kernel (6 rows x 2 vectors of 16 keys): acc = 0; for d2 in order:
//     acc = vdpbf16ps(acc, broadcast(q pair (r, d2)), panel vector at d2); S = acc * q_multiplier.
//   softcap, mask, online softmax: the float32 kernel's (P float32; l sums the float32 P).
//   P rounded to bfloat16 pairs (vcvtne2ps2bf16, nearest even) into probs_pairs (rows,
//     kKeyBlock / 2): pair kp = (P[2 kp], P[2 kp + 1]); the pad key of an odd n has P = 0.
//   V pair rows, per key pair kp: value_stride (Dv rounded up to 16) pairs, pair (kp, c) =
//     (V[2 kp][c], V[2 kp + 1][c]); columns past Dv and keys past the end are 0.
//   P.V micro-kernel (6 rows x 4 vectors of 16 columns, then single vectors up to value_stride):
//     acc = O (times alpha when a row rescales); for kp in order:
//     acc = vdpbf16ps(acc, broadcast(P pair (r, kp)), V vector at kp).
//   A dot product adds 0 * NaN for a key that P weights 0, so a block takes the convert path's
//   value_micro<kSafe = true> for its P.V instead (V read in place, converted; float32 P) when
//   (a) it is masked (crosses a row's visible range, or a mask is given: kSafe in the float32
//       kernel) or n is odd (its last pair's second key, key_block + n, is outside the block:
//       not visible, or the zero pad past the packed keys), and
//   (b) a V value of the keys [key_block, key_block + n rounded up to even) is non-finite,
//       decided from value_finite (one flag per key, recorded while packing; the zero pad key of
//       an odd packed range counts as finite).
//   (The Rust twin makes the same decision with the same key range.)
// VDPBF16PS treats bfloat16 subnormal inputs as zero and flushes subnormal results to zero (the
// instruction's fixed behaviour, MXCSR notwithstanding): accepted, and the same in both ports.
#include "simd_avx512.hpp"

#include "flash_kernel.hpp"
#include "measure_peak.hpp"

namespace twinattn {
namespace {

using Convert = flash::Kernel<VecAvx512Bf16, BFloat16>;

struct DotKernel : Convert {
    static constexpr int64_t kPairsPerBlock = kKeyBlock / 2;

    static __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }
    static __m512i broadcast_pair(uint32_t pair) { return _mm512_set1_epi32(static_cast<int>(pair)); }

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
        const int64_t padded_end = key_end + (key_end - key_begin) % 2;
        for (int64_t key = key_begin; key < padded_end; key += 2) {
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

    // ---- 3a. S = Q K^T by bfloat16 pair dot products: R rows x 2 vectors (one panel) ----------
    template <int R>
    static void score_micro(const uint32_t* q, int64_t D2, const uint32_t* panel, float* scores,
                            __m512 multiplier) {
        static_assert(kKeyPanel == 32, "one panel is the micro-kernel's two vectors of 16 keys");
        __m512 acc[R][2];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < D2; ++d2) {
            const __m512i keys0 = _mm512_loadu_si512(panel + d2 * kKeyPanel);
            const __m512i keys1 = _mm512_loadu_si512(panel + d2 * kKeyPanel + 16);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512bh q_pair = as_pairs(broadcast_pair(q[r * D2 + d2]));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q_pair, as_pairs(keys0));
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q_pair, as_pairs(keys1));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            _mm512_storeu_ps(scores + r * kKeyBlock, _mm512_mul_ps(acc[r][0], multiplier));
            _mm512_storeu_ps(scores + r * kKeyBlock + 16, _mm512_mul_ps(acc[r][1], multiplier));
        }
    }

    template <int R>
    static void strip_scores(const uint32_t* q, int64_t D2, const uint32_t* panels, int64_t n,
                             float* scores, __m512 multiplier) {
        for (int64_t panel = 0; panel * kKeyPanel < n; ++panel)
            score_micro<R>(q, D2, panels + panel * D2 * kKeyPanel, scores + panel * kKeyPanel, multiplier);
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

    // ---- 3d. O = alpha O + P V by bfloat16 pair dot products ---------------------------------
    // P of each row (n_padded floats, 0 past n) rounded to bfloat16 pairs, 32 keys at a time.
    static void round_probs(const float* scores, int64_t rows, int64_t n_padded, uint32_t* pairs) {
        for (int64_t r = 0; r < rows; ++r) {
            const float* row = scores + r * kKeyBlock;
            uint32_t* dst = pairs + r * kPairsPerBlock;
            for (int64_t j = 0; j < n_padded; j += 32) {
                const __m512 low = _mm512_loadu_ps(row + j);
                const __m512 high = j + 16 < n_padded ? _mm512_loadu_ps(row + j + 16) : _mm512_setzero_ps();
                const __m512bh rounded = _mm512_cvtne2ps_pbh(high, low);  // keys j .. j + 31 in order
                _mm512_storeu_si512(dst + j / 2, reinterpret_cast<__m512i>(rounded));
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
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t packed = item.row_begin + r;
            const int64_t h = item.kv_head * G + packed % G, i = packed / G;
            const uint16_t* q_src = reinterpret_cast<const uint16_t*>(p.q.data) + b * p.q.stride[0] +
                                    h * p.q.stride[1] + i * p.q.stride[2];
            for (int64_t d2 = 0; d2 < D2; ++d2) {
                const uint32_t high = 2 * d2 + 1 < D ? q_src[2 * d2 + 1] : 0u;
                q_pairs[r * D2 + d2] = static_cast<uint32_t>(q_src[2 * d2]) | (high << 16);
            }
            start_row(plan, item, s, r);
        }

        // 3. Key blocks, as the float32 kernel.
        const int64_t key_stop =
            s.row_key_end[rows - 1] < item.key_end ? s.row_key_end[rows - 1] : item.key_end;
        const int64_t head = b * p.k.shape[1] + item.kv_head;
        const int64_t keys_per_head = plan.panels_per_head * kKeyPanel;
        const uint32_t* k_head_panels =
            reinterpret_cast<const uint32_t*>(plan.packed_keys) + head * plan.panels_per_head * D2 * kKeyPanel;
        const uint32_t* v_head_pairs = plan.packed_values + head * keys_per_head / 2 * value_stride;
        const unsigned char* v_head_finite = plan.value_finite + head * keys_per_head;
        for (int64_t key_block = item.key_begin; key_block < key_stop; key_block += kKeyBlock) {
            const int64_t n = key_stop - key_block < kKeyBlock ? key_stop - key_block : kKeyBlock;
            const int64_t n_padded = round_up(n, 16);
            // (a) S = Q K^T (key_block is a multiple of kKeyPanel: item.key_begin is).
            block_scores(q_pairs, D2, rows, k_head_panels + (key_block / kKeyPanel) * D2 * kKeyPanel, n,
                         s.scores, plan.q_multiplier);
            // (a') - (c) as the float32 kernel.
            const bool masked = block_probabilities(plan, item, s, rows, key_block, n, n_padded);
            // (d) O = alpha O + P V: by pairs, unless P's zeros meet a non-finite V (header).
            bool values_finite = true;
            if (masked || n % 2 != 0)
                for (int64_t j = 0; j < n + n % 2; ++j) values_finite &= v_head_finite[key_block + j] != 0;
            if (!values_finite) {
                flash_key_rows(p, b, item.kv_head, key_block, n, nullptr, s.value_rows, nullptr, nullptr);
                Convert::block_values<true>(s.scores, rows, n, s.value_rows, s.out_acc, value_stride, Dv, s.rescale);
                continue;
            }
            round_probs(s.scores, rows, n_padded, s.probs_pairs);
            block_values(s.probs_pairs, rows, (n + 1) / 2, v_head_pairs + key_block / 2 * value_stride, value_stride,
                         s.out_acc, s.rescale);
        }

        // 4. Finish: out = O / l rounded to bfloat16, and lse (prefill items never write partials).
        for (int64_t r = 0; r < rows; ++r) finish_row(plan, item, s, r);
    }
};

}  // namespace

// float32 and float16 entries are replaced by the avx512 kernels' in dispatch.cpp; the bfloat16
// ones are this unit's (dot products for prefill, the convert path otherwise).
FlashKernels flash_kernels_avx512bf16() {
    FlashKernels kernels = flash::make_kernels<VecAvx512Bf16>();
    kernels.attend_rows[static_cast<int>(ElementType::BFloat16)] = DotKernel::attend_rows;
    kernels.pack_pairs = DotKernel::pack_pairs;
    return kernels;
}

// measure_peak (measure_peak.hpp): 16 independent accumulators, each acc += a . b over pairs of
// small bfloat16 values (2^-10: the sums grow by 2^-19 per instruction, never near overflow).
int64_t peak_bf16dot_avx512bf16(int64_t instructions) {
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3a803a80));  // (2^-10, 2^-10)
    const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3a803a80));
    return 64 * run_peak_loop<16>(
                    instructions, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); },
                    [a, b](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); },
                    [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); },
                    [](__m512 x) { return _mm512_cvtss_f32(x); });
}

}  // namespace twinattn
