//! The NEON vector type: 8 floats as two 128-bit registers (lanes 0-3 and 4-7). Twin of
//! `cpp/src/simd_neon.hpp`. Width 8 rather than NEON's native 4 so that everything that depends
//! on the width (panels, tails, fold_groups' two batches, the order of every sum) is exactly
//! VecAvx2's, and the operations below mirror simd_avx2.rs step for step.
//!
//! NEON is part of the AArch64 baseline: every AArch64 CPU has it and the target enables it, so
//! the intrinsics (still `unsafe` to call: they are `#[target_feature(enable = "neon")]`
//! functions) are sound wherever this code runs, and the constructors' requirement (the CPU
//! supports this type's instruction set, simd.rs) always holds.

use std::arch::aarch64::*;

use crate::constants::{
    EXP2_COEFFICIENTS, EXP2_DEGREE, EXP2_MIN, NEON_DIRECT_STRIP_ROWS, NEON_SCORE_VECTORS,
    NEON_VALUE_VECTORS,
};
use crate::simd::Vector;

#[derive(Clone, Copy, Debug)]
pub struct VecNeon(float32x4_t, float32x4_t);

/// Per lane `a > b ? a : b`, x86's maxps (`b` when either is NaN), which the kernel's masking
/// assumes; NEON's own vmaxq_f32 would return NaN instead.
#[inline(always)]
fn max4(a: float32x4_t, b: float32x4_t) -> float32x4_t {
    // SAFETY: NEON is part of the AArch64 baseline (see the module comment).
    unsafe { vbslq_f32(vcgtq_f32(a, b), a, b) }
}

impl Vector for VecNeon {
    const WIDTH: usize = 8;
    const SCORE_VECTORS: usize = NEON_SCORE_VECTORS;
    const VALUE_VECTORS: usize = NEON_VALUE_VECTORS;
    const DIRECT_STRIP_ROWS: usize = NEON_DIRECT_STRIP_ROWS;
    const NAME: &'static str = "neon";

    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: NEON is part of the AArch64 baseline (see the module comment).
        unsafe { VecNeon(vdupq_n_f32(0.0), vdupq_n_f32(0.0)) }
    }
    #[inline(always)]
    unsafe fn broadcast(x: f32) -> Self {
        // SAFETY: as in zero.
        unsafe { VecNeon(vdupq_n_f32(x), vdupq_n_f32(x)) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: NEON as in zero; the caller guarantees 8 readable floats at p.
        unsafe { VecNeon(vld1q_f32(p), vld1q_f32(p.add(4))) }
    }
    /// NEON has no masked load: the n floats go through a zeroed buffer, so lanes past n are 0
    /// and their memory is never read.
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, n: usize) -> Self {
        let mut lanes = [0.0f32; 8];
        // SAFETY: the caller guarantees n (< 8) readable floats at p; lanes holds 8.
        unsafe {
            std::ptr::copy_nonoverlapping(p, lanes.as_mut_ptr(), n);
            Self::load(lanes.as_ptr())
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: NEON as in zero; the caller guarantees 8 writeable floats at p.
        unsafe {
            vst1q_f32(p, self.0);
            vst1q_f32(p.add(4), self.1);
        }
    }
    /// int8: widen to int16 (vmovl), then to int32 in two halves, convert (vcvtq): exact.
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        // SAFETY: NEON as in zero; the caller guarantees 8 readable bytes at p.
        unsafe {
            let wide = vmovl_s8(vld1_s8(p));
            VecNeon(
                vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))),
                vcvtq_f32_s32(vmovl_s16(vget_high_s16(wide))),
            )
        }
    }
    /// NEON has no masked store: the lanes go to a buffer and only the first n are copied out.
    #[inline(always)]
    unsafe fn store_tail(self, p: *mut f32, n: usize) {
        let mut lanes = [0.0f32; 8];
        // SAFETY: lanes holds 8 floats; the caller guarantees n (< 8) writeable floats at p.
        unsafe {
            self.store(lanes.as_mut_ptr());
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), p, n);
        }
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: as in zero. vfmaq_f32(c, a, b) = c + a * b, fused.
        unsafe { VecNeon(vfmaq_f32(c.0, a.0, b.0), vfmaq_f32(c.1, a.1, b.1)) }
    }
    #[inline(always)]
    fn mul(a: Self, b: Self) -> Self {
        // SAFETY: as in zero.
        unsafe { VecNeon(vmulq_f32(a.0, b.0), vmulq_f32(a.1, b.1)) }
    }
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        // SAFETY: as in zero.
        unsafe { VecNeon(vaddq_f32(a.0, b.0), vaddq_f32(a.1, b.1)) }
    }
    #[inline(always)]
    fn sub(a: Self, b: Self) -> Self {
        // SAFETY: as in zero.
        unsafe { VecNeon(vsubq_f32(a.0, b.0), vsubq_f32(a.1, b.1)) }
    }
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        VecNeon(max4(a.0, b.0), max4(a.1, b.1))
    }
    #[inline(always)]
    fn div(a: Self, b: Self) -> Self {
        // SAFETY: NEON is part of the AArch64 baseline (see the module comment).
        unsafe { VecNeon(vdivq_f32(a.0, b.0), vdivq_f32(a.1, b.1)) }
    }
    #[inline(always)]
    fn select_less(a: Self, b: Self, x: Self, y: Self) -> Self {
        // SAFETY: as in div.
        unsafe {
            VecNeon(
                vbslq_f32(vcltq_f32(a.0, b.0), x.0, y.0),
                vbslq_f32(vcltq_f32(a.1, b.1), x.1, y.1),
            )
        }
    }
    #[inline(always)]
    fn exp2(x: Self) -> Self {
        /// One half: avx2.rs's exp2 on four lanes.
        #[inline(always)]
        fn exp2_4(x: float32x4_t) -> float32x4_t {
            // SAFETY: as in zero.
            unsafe {
                let x = max4(vdupq_n_f32(EXP2_MIN), x); // NaN stays NaN, as on AVX2
                let n = vrndmq_f32(x);
                let f = vsubq_f32(x, n);
                let mut p = vdupq_n_f32(EXP2_COEFFICIENTS[EXP2_DEGREE]);
                for c in (0..EXP2_DEGREE).rev() {
                    p = vfmaq_f32(vdupq_n_f32(EXP2_COEFFICIENTS[c]), p, f);
                }
                // n is whole, so the conversion (toward zero) is exact
                let bits = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
                vmulq_f32(p, vreinterpretq_f32_s32(bits))
            }
        }
        VecNeon(exp2_4(x.0), exp2_4(x.1))
    }
    #[inline(always)]
    fn reduce_max(x: Self) -> f32 {
        // SAFETY: as in zero.
        unsafe {
            let q = max4(x.0, x.1);
            let (lo, hi) = (vget_low_f32(q), vget_high_f32(q));
            let d = vbsl_f32(vcgt_f32(lo, hi), lo, hi);
            let (a, b) = (vget_lane_f32::<0>(d), vget_lane_f32::<1>(d));
            if a > b {
                a
            } else {
                b
            }
        }
    }
    #[inline(always)]
    fn reduce_sum(x: Self) -> f32 {
        // SAFETY: as in zero.
        unsafe {
            let q = vaddq_f32(x.0, x.1);
            let d = vadd_f32(vget_low_f32(q), vget_high_f32(q));
            vget_lane_f32::<0>(d) + vget_lane_f32::<1>(d)
        }
    }
    #[inline(always)]
    fn reduce4(a0: Self, a1: Self, a2: Self, a3: Self) -> Self {
        /// One 128-bit group: lane k = (a_k[0] + a_k[2]) + (a_k[1] + a_k[3]), as avx2.rs's
        /// unpacks (zip1/zip2 are unpacklo/unpackhi; the 64-bit halves its unpack_pd).
        #[inline(always)]
        fn group(
            a0: float32x4_t,
            a1: float32x4_t,
            a2: float32x4_t,
            a3: float32x4_t,
        ) -> float32x4_t {
            // SAFETY: as in zero.
            unsafe {
                let t01 = vaddq_f32(vzip1q_f32(a0, a1), vzip2q_f32(a0, a1));
                let t23 = vaddq_f32(vzip1q_f32(a2, a3), vzip2q_f32(a2, a3));
                let lo = vcombine_f32(vget_low_f32(t01), vget_low_f32(t23));
                let hi = vcombine_f32(vget_high_f32(t01), vget_high_f32(t23));
                vaddq_f32(lo, hi)
            }
        }
        VecNeon(group(a0.0, a1.0, a2.0, a3.0), group(a0.1, a1.1, a2.1, a3.1))
    }
    #[inline(always)]
    fn fold_groups(y: &[Self; 4]) -> Self {
        // SAFETY: as in zero.
        unsafe { VecNeon(vaddq_f32(y[0].0, y[0].1), vaddq_f32(y[1].0, y[1].1)) }
    }
    /// The four 4 x 4 quadrants transposed, the two off the diagonal swapped.
    #[inline(always)]
    fn transpose(rows: &mut [Self]) {
        debug_assert_eq!(rows.len(), 8);
        let mut lo: [float32x4_t; 8] = std::array::from_fn(|i| rows[i].0);
        let mut hi: [float32x4_t; 8] = std::array::from_fn(|i| rows[i].1);
        let (lo_top, lo_bottom) = lo.split_at_mut(4);
        let (hi_top, hi_bottom) = hi.split_at_mut(4);
        transpose4(lo_top); // rows 0-3 of columns 0-3
        transpose4(hi_bottom); // rows 4-7 of columns 4-7
        transpose4(hi_top); // rows 0-3 of columns 4-7
        transpose4(lo_bottom); // rows 4-7 of columns 0-3
        for c in 0..4 {
            rows[c] = VecNeon(lo[c], lo[4 + c]);
            rows[4 + c] = VecNeon(hi[c], hi[4 + c]);
        }
    }
}

/// `r[i]` = row i of a 4 x 4 block -> `r[c]` = column c.
#[inline(always)]
fn transpose4(r: &mut [float32x4_t]) {
    // SAFETY: NEON is part of the AArch64 baseline (as in zero).
    unsafe {
        let t0 = vreinterpretq_f64_f32(vtrn1q_f32(r[0], r[1])); // r0[0] r1[0] r0[2] r1[2]
        let t1 = vreinterpretq_f64_f32(vtrn2q_f32(r[0], r[1])); // r0[1] r1[1] r0[3] r1[3]
        let t2 = vreinterpretq_f64_f32(vtrn1q_f32(r[2], r[3]));
        let t3 = vreinterpretq_f64_f32(vtrn2q_f32(r[2], r[3]));
        r[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
        r[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
        r[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
        r[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
    }
}

#[cfg(test)]
mod tests {
    //! The NEON type against the scalar type, which spells every lane order and summation order
    //! out in plain loops: a NEON type that summed in another order would still pass the kernel
    //! tests (their tolerances cover rounding), so these compare bits.

    use super::*;
    use crate::simd_scalar::{exp2_lane, VecScalar};

    fn lanes<V: Vector>(v: V) -> [f32; 8] {
        let mut out = [0.0; 8];
        // SAFETY: out holds 8 floats; both types are 8 wide.
        unsafe { v.store(out.as_mut_ptr()) };
        out
    }

    fn both(x: &[f32; 8]) -> (VecNeon, VecScalar) {
        // SAFETY: x holds 8 floats; NEON is part of the AArch64 baseline.
        unsafe { (VecNeon::load(x.as_ptr()), VecScalar::load(x.as_ptr())) }
    }

    /// Uniform in [0, 1).
    fn unit(seed: &mut u32) -> f32 {
        *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (*seed >> 8) as f32 / (1u32 << 24) as f32
    }

    /// Floats of mixed signs and magnitudes (up to 1e-3 .. 1e3), so that the order of a sum
    /// shows in its bits.
    fn random_lanes(seed: &mut u32) -> [f32; 8] {
        std::array::from_fn(|i| (unit(seed) - 0.5) * 10f32.powi((i as i32 * 5) % 7 - 3))
    }

    fn bits(x: [f32; 8]) -> [u32; 8] {
        x.map(f32::to_bits)
    }

    #[test]
    fn reductions_match_the_scalar_type_bit_for_bit() {
        let mut seed = 7;
        for _ in 0..200 {
            let x: [[f32; 8]; 4] = std::array::from_fn(|_| random_lanes(&mut seed));
            let (n, s): (Vec<VecNeon>, Vec<VecScalar>) = x.iter().map(both).unzip();
            assert_eq!(
                VecNeon::reduce_sum(n[0]).to_bits(),
                VecScalar::reduce_sum(s[0]).to_bits()
            );
            assert_eq!(VecNeon::reduce_max(n[1]), VecScalar::reduce_max(s[1]));
            let yn = VecNeon::reduce4(n[0], n[1], n[2], n[3]);
            let ys = VecScalar::reduce4(s[0], s[1], s[2], s[3]);
            assert_eq!(bits(lanes(yn)), bits(lanes(ys)));
            let yn2 = VecNeon::reduce4(n[3], n[2], n[1], n[0]);
            let ys2 = VecScalar::reduce4(s[3], s[2], s[1], s[0]);
            assert_eq!(
                bits(lanes(VecNeon::fold_groups(&[yn, yn2, n[0], n[1]]))),
                bits(lanes(VecScalar::fold_groups(&[ys, ys2, s[0], s[1]])))
            );
            let fused: [f32; 8] = std::array::from_fn(|i| x[0][i].mul_add(x[1][i], x[2][i]));
            assert_eq!(bits(lanes(VecNeon::fma(n[0], n[1], n[2]))), bits(fused));
        }
    }

    #[test]
    fn max_takes_the_second_operand_when_either_is_nan() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let a = [nan, 1.0, nan, -2.0, 3.0, -inf, 0.0, -0.0];
        let b = [1.0, nan, nan, -3.0, 4.0, -1.0, -0.0, 0.0];
        let ((na, sa), (nb, sb)) = (both(&a), both(&b));
        assert_eq!(
            bits(lanes(VecNeon::max(na, nb))),
            bits(lanes(VecScalar::max(sa, sb)))
        );
        for x in [a, b] {
            let (n, s) = both(&x);
            assert_eq!(
                VecNeon::reduce_max(n).to_bits(),
                VecScalar::reduce_max(s).to_bits()
            );
        }
    }

    #[test]
    fn exp2_is_the_shared_polynomial() {
        // whole x (f = 0, Horner gives c0 = 1 exactly) and x below -126 (2^n = 0) are exact
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let special = [-inf, -1.5, -127.0, -126.5, -0.0, 0.0, -1.0, -126.0];
        let got = lanes(VecNeon::exp2(both(&special).0));
        assert_eq!(bits(got), bits(special.map(exp2_lane)));
        assert_eq!(got[0], 0.0); // exp2(-inf) is exactly 0
        let got = lanes(VecNeon::exp2(both(&[nan; 8]).0));
        assert!(got.iter().all(|x| x.is_nan()) && exp2_lane(nan).is_nan());
        let mut seed = 11;
        for _ in 0..1000 {
            let x: [f32; 8] = std::array::from_fn(|_| -126.0 * unit(&mut seed));
            let got = lanes(VecNeon::exp2(both(&x).0));
            for (&g, &x) in got.iter().zip(&x) {
                // the scalar type rounds Horner's products, NEON fuses them: a few ulp apart
                let want = exp2_lane(x);
                let ok = (g - want).abs() <= 4.0 * f32::EPSILON * want;
                assert!(ok, "{x}: {g} vs {want}");
            }
        }
    }

    #[test]
    fn tails_zero_the_lanes_past_n_and_keep_the_memory_past_n() {
        let x: [f32; 8] = std::array::from_fn(|i| i as f32 + 1.0);
        for n in 0..8 {
            // SAFETY: x holds 8 >= n floats.
            let v = unsafe { VecNeon::load_tail(x.as_ptr(), n) };
            let want: [f32; 8] = std::array::from_fn(|i| if i < n { x[i] } else { 0.0 });
            assert_eq!(lanes(v), want);
            let mut out = [-1.0f32; 9];
            // SAFETY: out holds 9 >= n floats.
            unsafe { both(&x).0.store_tail(out.as_mut_ptr(), n) };
            let want: [f32; 9] = std::array::from_fn(|i| if i < n { x[i] } else { -1.0 });
            assert_eq!(out, want);
        }
    }
}
