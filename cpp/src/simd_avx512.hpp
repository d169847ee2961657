// The AVX-512F vector type of the fast kernels: 16 floats. Included only by flash_avx512.cpp
// (-mavx512f -mfma -mf16c: nothing here may run on a CPU without AVX-512F), flash_avx512bf16.cpp
// (AVX512_BF16 flags too) and flash_amx.cpp (and AMX's). Each unit instantiates its own kUnit, so
// they never share a symbol (ODR note, flash_kernel.hpp): the avx512 kernels cannot pick up code
// compiled for AVX512_BF16, nor the avx512bf16 ones code compiled for AMX.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include "element.hpp"
#include "simd_storage.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {

template <int kUnit>
struct VecAvx512Unit : StorageOps<VecAvx512Unit<kUnit>> {
    using Reg = __m512;
    static constexpr int kWidth = 16;
    static constexpr int kScoreVectors = kAvx512ScoreVectors;
    static constexpr int kValueVectors = kAvx512ValueVectors;
    static constexpr int kDirectStripRows = kAvx512DirectStripRows;
    static constexpr const char* kName = kUnit == 0 ? "avx512" : "avx512bf16";

    static Reg zero() { return _mm512_setzero_ps(); }
    static Reg broadcast(float x) { return _mm512_set1_ps(x); }
    static Reg load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
    static __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
    // The first n (< kWidth) lanes; the others are 0 and their memory is never touched.
    static Reg load_tail(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
    static void store_tail(float* p, Reg x, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), x); }
    static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
    static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
    static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
    static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
    static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
    static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
    // Per lane a < b ? x : y (y when a or b is NaN).
    static Reg select_less(Reg a, Reg b, Reg x, Reg y) {
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
    }

    // 2^x for x <= 0 (constants.hpp, "exp2"); -inf gives exactly 0, NaN gives NaN (maxps returns
    // its second operand, x, when either is NaN: a NaN score reaches the row sum).
    static Reg exp2(Reg x) {
        x = _mm512_max_ps(_mm512_set1_ps(kExp2Min), x);
        const Reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const Reg f = _mm512_sub_ps(x, n);
        Reg p = _mm512_set1_ps(kExp2Coefficients[kExp2Degree]);
        for (int c = kExp2Degree - 1; c >= 0; --c)
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Coefficients[c]));
        const __m512i bits = _mm512_slli_epi32(
            _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
        return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    }

    // Horizontal reductions in a fixed order: halves folded 256, 128, 64, 32 bits.
    static float reduce_max(Reg x) {
        __m256 h = _mm256_max_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_max_ps(q, _mm_movehl_ps(q, q));
        q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
        return _mm_cvtss_f32(q);
    }
    static float reduce_sum(Reg x) {
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
        return _mm_cvtss_f32(q);
    }

    // Direct scores (flash_kernel.hpp, direct_batch): the accumulators a0..a3 of four keys ->
    // one vector whose lane 4g + k is key k's sum over lanes 4g..4g+3 of a_k, in the order
    // (a_k[4g] + a_k[4g+2]) + (a_k[4g+1] + a_k[4g+3]) (g = 128-bit group).
    static Reg reduce4(Reg a0, Reg a1, Reg a2, Reg a3) {
        const Reg t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
        const Reg t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
        return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    // y[0..3] (four batches of four keys, as reduce4 leaves them) -> 16 scores: lane 4b + k is
    // batch b's lane k summed over the four groups, halves folded: (g0 + g2) + (g1 + g3).
    static Reg fold_groups(const Reg y[kWidth / 4]) {
        const Reg z01 = _mm512_add_ps(shuffle_groups<0x44>(y[0], y[1]), shuffle_groups<0xee>(y[0], y[1]));
        const Reg z23 = _mm512_add_ps(shuffle_groups<0x44>(y[2], y[3]), shuffle_groups<0xee>(y[2], y[3]));
        return _mm512_add_ps(shuffle_groups<0x88>(z01, z23), shuffle_groups<0xdd>(z01, z23));
    }
    // _mm512_shuffle_f32x4 (the masked form with every lane selected: GCC 12 warns about the
    // unmasked form's undefined pass-through when inlined here).
    template <int kImm>
    static Reg shuffle_groups(Reg a, Reg b) { return _mm512_mask_shuffle_f32x4(a, 0xffff, a, b, kImm); }

    // rows[i] = row i of a 16 x 16 block -> rows[d] = column d (for packing K^T panels).
    static void transpose(Reg rows[kWidth]) {
        Reg u[16];
        for (int g = 0; g < 4; ++g) {  // 4 x 4 transposes inside every 128-bit lane
            const Reg* r = rows + 4 * g;
            const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(r[0], r[1]));
            const __m512d t1 = _mm512_castps_pd(_mm512_unpackhi_ps(r[0], r[1]));
            const __m512d t2 = _mm512_castps_pd(_mm512_unpacklo_ps(r[2], r[3]));
            const __m512d t3 = _mm512_castps_pd(_mm512_unpackhi_ps(r[2], r[3]));
            u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
            u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
            u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
            u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
        }
        // u[4g + c] lane L = rows 4g..4g+3 of column 4L + c; gather the four g per column.
        for (int c = 0; c < 4; ++c) {
            const Reg even01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
            const Reg odd01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
            const Reg even23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
            const Reg odd23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
            rows[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
            rows[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
            rows[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xdd);
            rows[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xdd);
        }
    }

    // ---- Storage types (element.hpp): loads convert to float32 exactly, stores round ------
    // float32, and the tails of every type: simd_storage.hpp
    using StorageOps<VecAvx512Unit>::load_as_f32;
    using StorageOps<VecAvx512Unit>::store_from_f32;
    static Reg load_as_f32(const Float16* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static Reg load_as_f32(const BFloat16* p) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    // int8 K / V: sign-extend to int32 (vpmovsxbd), convert (vcvtdq2ps): exact.
    static Reg load_as_f32(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static void store_from_f32(Float16* p, Reg x) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // The software rule of element.hpp, 16 lanes at once (not vcvtneps2bf16: it flushes
    // subnormals).
    static void store_from_f32(BFloat16* p, Reg x) {
        const __m512i bits = _mm512_castps_si512(x);
        const __m512i high = _mm512_srli_epi32(bits, 16);
        const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
        const __m512i nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        const __m512i result = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, nan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(result));
    }

};

using VecAvx512 = VecAvx512Unit<0>;     // flash_avx512.cpp
using VecAvx512Bf16 = VecAvx512Unit<1>;  // flash_avx512bf16.cpp
using VecAvx512Amx = VecAvx512Unit<2>;   // flash_amx.cpp

}  // namespace twinattn
