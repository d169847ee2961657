//! The AVX2 + FMA vector type: 8 floats. Twin of `cpp/src/simd_avx2.hpp`. Only code compiled
//! inside `#[target_feature(enable = "avx2,fma,f16c")]` functions uses it (flash_kernel.rs), and
//! values exist only after AVX2, FMA and F16C were detected (see simd.rs), which is what makes the
//! intrinsic calls below sound.

use std::arch::x86_64::*;

use crate::constants::{
    AVX2_DIRECT_STRIP_ROWS, AVX2_SCORE_VECTORS, AVX2_VALUE_VECTORS, EXP2_COEFFICIENTS, EXP2_DEGREE,
    EXP2_MIN,
};
use crate::simd::Vector;
use crate::simd_x86::{one_intrinsic_ops, reduce_max_256, reduce_sum_256};

#[derive(Clone, Copy, Debug)]
pub struct VecAvx2(__m256);

/// Lanes [0, n) set.
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn tail_mask(n: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }
}

impl Vector for VecAvx2 {
    const WIDTH: usize = 8;
    const SCORE_VECTORS: usize = AVX2_SCORE_VECTORS;
    const VALUE_VECTORS: usize = AVX2_VALUE_VECTORS;
    const DIRECT_STRIP_ROWS: usize = AVX2_DIRECT_STRIP_ROWS;
    const NAME: &'static str = "avx2";

    one_intrinsic_ops!(
        VecAvx2,
        zero: _mm256_setzero_ps,
        broadcast: _mm256_set1_ps,
        load: _mm256_loadu_ps,
        store: _mm256_storeu_ps,
        fma: _mm256_fmadd_ps,
        mul: _mm256_mul_ps,
        add: _mm256_add_ps,
        sub: _mm256_sub_ps,
        max: _mm256_max_ps,
        div: _mm256_div_ps
    );
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, n: usize) -> Self {
        // SAFETY: AVX2 and n readable floats at p; masked-off lanes are never accessed.
        VecAvx2(unsafe { _mm256_maskload_ps(p, tail_mask(n)) })
    }
    #[inline(always)]
    unsafe fn store_tail(self, p: *mut f32, n: usize) {
        // SAFETY: n writeable floats at p; masked-off lanes are never accessed.
        unsafe { _mm256_maskstore_ps(p, tail_mask(n), self.0) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees AVX2 (F16C with it: dispatch.rs) and 8 readable halves.
        VecAvx2(unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) })
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees AVX2 and 8 readable halves.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            VecAvx2(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide)))
        }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        // SAFETY: the caller guarantees AVX2 and 8 readable bytes (vpmovsxbd, vcvtdq2ps).
        unsafe {
            VecAvx2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                p.cast(),
            ))))
        }
    }
    #[inline(always)]
    unsafe fn store_f16(self, p: *mut u16) {
        // SAFETY: 8 writeable halves at p; self proves AVX2 (and F16C, dispatch.rs).
        unsafe {
            // round to nearest even (Rust's F16C intrinsic takes the 3-bit rounding field only;
            // C++ passes _MM_FROUND_NO_EXC too, which changes no bit of the result)
            let halves = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
            _mm_storeu_si128(p.cast(), halves)
        }
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut u16) {
        // SAFETY: 8 writeable halves at p; self proves AVX2.
        unsafe {
            let bits = _mm256_castps_si256(self.0);
            let high = _mm256_srli_epi32::<16>(bits);
            let odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
                _mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)),
                odd,
            ));
            let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0));
            let halves = _mm256_blendv_epi8(rounded, quiet, nan);
            // every lane <= 0xffff: the unsigned saturating pack keeps it; it packs within
            // 128-bit lanes, so the permute brings lanes 0-3 and 4-7 together
            let packed = _mm256_permute4x64_epi64::<0x08>(_mm256_packus_epi32(halves, halves));
            _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(packed))
        }
    }
    #[inline(always)]
    fn select_less(a: Self, b: Self, x: Self, y: Self) -> Self {
        // SAFETY: as in fma.
        VecAvx2(unsafe { _mm256_blendv_ps(y.0, x.0, _mm256_cmp_ps::<_CMP_LT_OQ>(a.0, b.0)) })
    }
    #[inline(always)]
    fn exp2(x: Self) -> Self {
        // SAFETY: as in fma.
        unsafe {
            // EXP2_MIN first: maxps returns its second operand, x, when either is NaN
            let x = _mm256_max_ps(_mm256_set1_ps(EXP2_MIN), x.0);
            let n = _mm256_floor_ps(x);
            let f = _mm256_sub_ps(x, n);
            let mut p = _mm256_set1_ps(EXP2_COEFFICIENTS[EXP2_DEGREE]);
            for c in (0..EXP2_DEGREE).rev() {
                p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_COEFFICIENTS[c]));
            }
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            VecAvx2(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)))
        }
    }
    #[inline(always)]
    fn reduce_max(x: Self) -> f32 {
        // SAFETY: as in fma.
        unsafe { reduce_max_256(x.0) }
    }
    #[inline(always)]
    fn reduce_sum(x: Self) -> f32 {
        // SAFETY: as in fma.
        unsafe { reduce_sum_256(x.0) }
    }
    #[inline(always)]
    fn reduce4(a0: Self, a1: Self, a2: Self, a3: Self) -> Self {
        // SAFETY: as in fma.
        unsafe {
            let t01 = _mm256_add_ps(
                _mm256_unpacklo_ps(a0.0, a1.0),
                _mm256_unpackhi_ps(a0.0, a1.0),
            );
            let t23 = _mm256_add_ps(
                _mm256_unpacklo_ps(a2.0, a3.0),
                _mm256_unpackhi_ps(a2.0, a3.0),
            );
            let lo = _mm256_unpacklo_pd(_mm256_castps_pd(t01), _mm256_castps_pd(t23));
            let hi = _mm256_unpackhi_pd(_mm256_castps_pd(t01), _mm256_castps_pd(t23));
            VecAvx2(_mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi)))
        }
    }
    #[inline(always)]
    fn fold_groups(y: &[Self; 4]) -> Self {
        // SAFETY: as in fma.
        unsafe {
            VecAvx2(_mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(y[0].0, y[1].0),
                _mm256_permute2f128_ps::<0x31>(y[0].0, y[1].0),
            ))
        }
    }
    #[inline(always)]
    fn transpose(rows: &mut [Self]) {
        debug_assert_eq!(rows.len(), 8);
        // SAFETY: as in fma.
        unsafe {
            let mut u = [_mm256_setzero_ps(); 8];
            for g in 0..2 {
                // 4 x 4 transposes inside both 128-bit lanes
                let r = &rows[4 * g..4 * g + 4];
                let t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r[0].0, r[1].0));
                let t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r[0].0, r[1].0));
                let t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r[2].0, r[3].0));
                let t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r[2].0, r[3].0));
                u[4 * g] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
                u[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
                u[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
                u[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
            }
            // u[4g + c] lane L = rows 4g..4g+3 of column 4L + c.
            for c in 0..4 {
                rows[c] = VecAvx2(_mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]));
                rows[4 + c] = VecAvx2(_mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]));
            }
        }
    }
}
