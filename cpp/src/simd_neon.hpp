// The NEON vector type of the fast kernels: 8 floats as two 128-bit registers (lo = lanes 0-3,
// hi = lanes 4-7). Width 8 keeps everything that depends on the width (panels, tails, the two
// direct-score batches of fold_groups) exactly as on AVX2, and every operation below follows
// simd_avx2.hpp lane for lane and in the same summation order. Included only by flash_neon.cpp,
// which is built only for AArch64, where NEON is mandatory (no extra compile flags).
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include "element.hpp"
#include "simd_storage.hpp"
#include "twinattn/constants.hpp"

namespace twinattn {

struct VecNeon : StorageOps<VecNeon> {
    struct Reg {
        float32x4_t lo, hi;
    };
    static constexpr int kWidth = 8;
    static constexpr int kScoreVectors = kNeonScoreVectors;
    static constexpr int kValueVectors = kNeonValueVectors;
    static constexpr int kDirectStripRows = kNeonDirectStripRows;
    static constexpr const char* kName = "neon";

    static Reg zero() { return broadcast(0.0f); }
    static Reg broadcast(float x) { return Reg{vdupq_n_f32(x), vdupq_n_f32(x)}; }
    static Reg load(const float* p) { return Reg{vld1q_f32(p), vld1q_f32(p + 4)}; }
    static void store(float* p, Reg x) {
        vst1q_f32(p, x.lo);
        vst1q_f32(p + 4, x.hi);
    }
    // The first n (< kWidth) lanes; the others are 0 and their memory is never touched. NEON has
    // no masked load or store, so the n floats go through a zeroed stack buffer.
    static Reg load_tail(const float* p, int64_t n) {
        float buffer[kWidth] = {};
        std::memcpy(buffer, p, static_cast<size_t>(n) * sizeof(float));
        return load(buffer);
    }
    static void store_tail(float* p, Reg x, int64_t n) {
        float buffer[kWidth];
        store(buffer, x);
        std::memcpy(p, buffer, static_cast<size_t>(n) * sizeof(float));
    }
    // a * b + c, rounded once (as _mm256_fmadd_ps).
    static Reg fma(Reg a, Reg b, Reg c) { return Reg{vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
    static Reg mul(Reg a, Reg b) { return Reg{vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
    static Reg add(Reg a, Reg b) { return Reg{vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
    static Reg sub(Reg a, Reg b) { return Reg{vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
    // a > b ? a : b, so b when either is NaN (x86's maxps; the row max relies on it only for
    // speed, exp2's clamp for passing NaN on); vmaxq_f32 would differ in the NaN and -0 cases.
    static float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
    static Reg max(Reg a, Reg b) { return Reg{max4(a.lo, b.lo), max4(a.hi, b.hi)}; }
    static Reg div(Reg a, Reg b) { return Reg{vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
    // Per lane a < b ? x : y (y when a or b is NaN).
    static Reg select_less(Reg a, Reg b, Reg x, Reg y) {
        return Reg{vbslq_f32(vcltq_f32(a.lo, b.lo), x.lo, y.lo),
                   vbslq_f32(vcltq_f32(a.hi, b.hi), x.hi, y.hi)};
    }

    // 2^x for x <= 0 (constants.hpp, "exp2"); -inf gives exactly 0, NaN gives NaN (as AVX2).
    static float32x4_t exp2_4(float32x4_t x) {
        x = max4(vdupq_n_f32(kExp2Min), x);
        const float32x4_t n = vrndmq_f32(x);
        const float32x4_t f = vsubq_f32(x, n);
        float32x4_t p = vdupq_n_f32(kExp2Coefficients[kExp2Degree]);
        for (int c = kExp2Degree - 1; c >= 0; --c) p = vfmaq_f32(vdupq_n_f32(kExp2Coefficients[c]), p, f);
        // n is whole, so the truncating conversion is exact
        const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
        return vmulq_f32(p, vreinterpretq_f32_s32(bits));
    }
    static Reg exp2(Reg x) { return Reg{exp2_4(x.lo), exp2_4(x.hi)}; }

    // Horizontal reductions in AVX2's order: lo with hi, then lanes (0, 2) with (1, 3), then 0
    // with 1.
    static float reduce_max(Reg x) {
        const float32x4_t q = max4(x.lo, x.hi);
        const float32x2_t a = vget_low_f32(q), b = vget_high_f32(q);
        const float32x2_t h = vbsl_f32(vcgt_f32(a, b), a, b);
        const float h0 = vget_lane_f32(h, 0), h1 = vget_lane_f32(h, 1);
        return h0 > h1 ? h0 : h1;
    }
    static float reduce_sum(Reg x) {
        const float32x4_t q = vaddq_f32(x.lo, x.hi);
        const float32x2_t h = vadd_f32(vget_low_f32(q), vget_high_f32(q));
        return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
    }

    // Direct scores (flash_kernel.hpp, direct_batch): the accumulators a0..a3 of four keys ->
    // one vector whose lane 4g + k is key k's sum over lanes 4g..4g+3 of a_k, in the order
    // (a_k[4g] + a_k[4g+2]) + (a_k[4g+1] + a_k[4g+3]) (g = lo, hi), as simd_avx2.hpp.
    static float32x4_t reduce4_group(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
        // t01 = (a0[0] + a0[2], a1[0] + a1[2], a0[1] + a0[3], a1[1] + a1[3]), t23 likewise
        const float32x4_t t01 = vaddq_f32(vzip1q_f32(a0, a1), vzip2q_f32(a0, a1));
        const float32x4_t t23 = vaddq_f32(vzip1q_f32(a2, a3), vzip2q_f32(a2, a3));
        return vaddq_f32(vcombine_f32(vget_low_f32(t01), vget_low_f32(t23)),
                         vcombine_f32(vget_high_f32(t01), vget_high_f32(t23)));
    }
    static Reg reduce4(Reg a0, Reg a1, Reg a2, Reg a3) {
        return Reg{reduce4_group(a0.lo, a1.lo, a2.lo, a3.lo), reduce4_group(a0.hi, a1.hi, a2.hi, a3.hi)};
    }
    // y[0..1] (two batches of four keys, as reduce4 leaves them) -> 8 scores: lane 4b + k is
    // batch b's lane k summed over the two groups: g0 + g1.
    static Reg fold_groups(const Reg y[kWidth / 4]) {
        return Reg{vaddq_f32(y[0].lo, y[0].hi), vaddq_f32(y[1].lo, y[1].hi)};
    }

    // r[i] = row i of a 4 x 4 block -> r[c] = column c.
    static void transpose4(float32x4_t& r0, float32x4_t& r1, float32x4_t& r2, float32x4_t& r3) {
        const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1));  // r0[0] r1[0] r0[2] r1[2]
        const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));  // r0[1] r1[1] r0[3] r1[3]
        const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3));
        const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
        r0 = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
        r1 = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
        r2 = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
        r3 = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
    }
    // rows[i] = row i of an 8 x 8 block -> rows[d] = column d (for packing K^T panels): the four
    // 4 x 4 quadrants transposed, the two off the diagonal swapped.
    static void transpose(Reg rows[kWidth]) {
        transpose4(rows[0].lo, rows[1].lo, rows[2].lo, rows[3].lo);
        transpose4(rows[4].hi, rows[5].hi, rows[6].hi, rows[7].hi);
        transpose4(rows[0].hi, rows[1].hi, rows[2].hi, rows[3].hi);  // rows 0-3 of columns 4-7
        transpose4(rows[4].lo, rows[5].lo, rows[6].lo, rows[7].lo);  // rows 4-7 of columns 0-3
        for (int c = 0; c < 4; ++c) {
            const float32x4_t upper = rows[c].hi;
            rows[c].hi = rows[4 + c].lo;
            rows[4 + c].lo = upper;
        }
    }

    // ---- Storage types (element.hpp): loads convert to float32 exactly, stores round ------
    // float32, and the tails of every type: simd_storage.hpp
    using StorageOps::load_as_f32;
    using StorageOps::store_from_f32;
    static float32x4_t load4(const Float16* p) {
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(&p->bits)));
    }
    static float32x4_t load4(const BFloat16* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(&p->bits), 16)); }
    static Reg load_as_f32(const Float16* p) { return Reg{load4(p), load4(p + 4)}; }
    static Reg load_as_f32(const BFloat16* p) { return Reg{load4(p), load4(p + 4)}; }
    // int8 K / V: widen (vmovl) to int16, then int32, convert (vcvtq): exact.
    static Reg load_as_f32(const int8_t* p) {
        const int16x8_t wide = vmovl_s8(vld1_s8(p));
        return Reg{vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(wide)))};
    }
    // vcvt_f16_f32 rounds to nearest even (the default FPCR mode) and keeps subnormals.
    static void store4(Float16* p, float32x4_t x) { vst1_u16(&p->bits, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
    // The software rule of element.hpp, 4 lanes at once.
    static void store4(BFloat16* p, float32x4_t x) {
        const uint32x4_t bits = vreinterpretq_u32_f32(x);
        const uint32x4_t high = vshrq_n_u32(bits, 16);
        const uint32x4_t odd = vandq_u32(high, vdupq_n_u32(1));
        const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), odd)), 16);
        const uint32x4_t nan = vorrq_u32(high, vdupq_n_u32(0x40));
        const uint32x4_t result = vbslq_u32(vceqq_f32(x, x), rounded, nan);
        vst1_u16(&p->bits, vmovn_u32(result));
    }
    static void store_from_f32(Float16* p, Reg x) {
        store4(p, x.lo);
        store4(p + 4, x.hi);
    }
    static void store_from_f32(BFloat16* p, Reg x) {
        store4(p, x.lo);
        store4(p + 4, x.hi);
    }

};

}  // namespace twinattn
