// The AVX2 + FMA vector type of the fast kernels: 8 floats. Included only by flash_avx2.cpp,
// which is compiled with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include "element.hpp"
#include "simd_storage.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {

struct VecAvx2 : StorageOps<VecAvx2> {
    using Reg = __m256;
    static constexpr int kWidth = 8;
    static constexpr int kScoreVectors = kAvx2ScoreVectors;
    static constexpr int kValueVectors = kAvx2ValueVectors;
    static constexpr int kDirectStripRows = kAvx2DirectStripRows;
    static constexpr const char* kName = "avx2";

    static Reg zero() { return _mm256_setzero_ps(); }
    static Reg broadcast(float x) { return _mm256_set1_ps(x); }
    static Reg load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
    static __m256i tail_mask(int64_t n) {
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    // The first n (< kWidth) lanes; the others are 0 and their memory is never touched.
    static Reg load_tail(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
    static void store_tail(float* p, Reg x, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), x); }
    static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
    static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
    static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
    static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
    static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
    static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
    // Per lane a < b ? x : y (y when a or b is NaN).
    static Reg select_less(Reg a, Reg b, Reg x, Reg y) {
        return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
    }

    // 2^x for x <= 0 (constants.hpp, "exp2"); -inf gives exactly 0, NaN gives NaN (maxps returns
    // its second operand, x, when either is NaN: a NaN score reaches the row sum).
    static Reg exp2(Reg x) {
        x = _mm256_max_ps(_mm256_set1_ps(kExp2Min), x);
        const Reg n = _mm256_floor_ps(x);
        const Reg f = _mm256_sub_ps(x, n);
        Reg p = _mm256_set1_ps(kExp2Coefficients[kExp2Degree]);
        for (int c = kExp2Degree - 1; c >= 0; --c)
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Coefficients[c]));
        const __m256i bits = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    }

    // Horizontal reductions in a fixed order: halves folded 128, 64, 32 bits.
    static float reduce_max(Reg x) {
        __m128 q = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        q = _mm_max_ps(q, _mm_movehl_ps(q, q));
        q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
        return _mm_cvtss_f32(q);
    }
    static float reduce_sum(Reg x) {
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
        return _mm_cvtss_f32(q);
    }

    // Direct scores (flash_kernel.hpp, direct_batch): the accumulators a0..a3 of four keys ->
    // one vector whose lane 4g + k is key k's sum over lanes 4g..4g+3 of a_k, in the order
    // (a_k[4g] + a_k[4g+2]) + (a_k[4g+1] + a_k[4g+3]) (g = 128-bit group).
    static Reg reduce4(Reg a0, Reg a1, Reg a2, Reg a3) {
        const Reg t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
        const Reg t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
        const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(t01), _mm256_castps_pd(t23));
        const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(t01), _mm256_castps_pd(t23));
        return _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
    }
    // y[0..1] (two batches of four keys, as reduce4 leaves them) -> 8 scores: lane 4b + k is
    // batch b's lane k summed over the two groups: g0 + g1.
    static Reg fold_groups(const Reg y[kWidth / 4]) {
        return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                             _mm256_permute2f128_ps(y[0], y[1], 0x31));
    }

    // rows[i] = row i of an 8 x 8 block -> rows[d] = column d (for packing K^T panels).
    static void transpose(Reg rows[kWidth]) {
        Reg u[8];
        for (int g = 0; g < 2; ++g) {  // 4 x 4 transposes inside both 128-bit lanes
            const Reg* r = rows + 4 * g;
            const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r[0], r[1]));
            const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r[0], r[1]));
            const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r[2], r[3]));
            const __m256d t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r[2], r[3]));
            u[4 * g + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
            u[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
            u[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
            u[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
        }
        // u[4g + c] lane L = rows 4g..4g+3 of column 4L + c.
        for (int c = 0; c < 4; ++c) {
            rows[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
            rows[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
        }
    }

    // ---- Storage types (element.hpp): loads convert to float32 exactly, stores round ------
    // float32, and the tails of every type: simd_storage.hpp
    using StorageOps::load_as_f32;
    using StorageOps::store_from_f32;
    static Reg load_as_f32(const Float16* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static Reg load_as_f32(const BFloat16* p) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    // int8 K / V: sign-extend 8 bytes to int32 (vpmovsxbd), convert (vcvtdq2ps): exact.
    static Reg load_as_f32(const int8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static void store_from_f32(Float16* p, Reg x) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // The software rule of element.hpp, 8 lanes at once.
    static void store_from_f32(BFloat16* p, Reg x) {
        const __m256i bits = _mm256_castps_si256(x);
        const __m256i high = _mm256_srli_epi32(bits, 16);
        const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
        const __m256i nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
        const __m256i result = _mm256_blendv_epi8(
            rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        // every lane <= 0xffff: the unsigned saturating pack keeps it
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1)));
    }

};

}  // namespace twinattn
