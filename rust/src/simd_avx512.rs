//! The AVX-512F vector type: 16 floats. Twin of `cpp/src/simd_avx512.hpp`. Only code compiled
//! inside `#[target_feature(enable = "avx512f,avx2,fma,f16c")]` functions uses it
//! (flash_kernel.rs), and values exist only after AVX-512F (and F16C) was detected (see simd.rs),
//! which is what makes the intrinsic calls below sound.

use std::arch::x86_64::*;

use crate::constants::{
    AVX512_DIRECT_STRIP_ROWS, AVX512_SCORE_VECTORS, AVX512_VALUE_VECTORS, EXP2_COEFFICIENTS,
    EXP2_DEGREE, EXP2_MIN,
};
use crate::simd::Vector;
use crate::simd_x86::{one_intrinsic_ops, reduce_max_256, reduce_sum_256};

#[derive(Clone, Copy, Debug)]
pub struct VecAvx512(__m512);

#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

impl Vector for VecAvx512 {
    const WIDTH: usize = 16;
    const SCORE_VECTORS: usize = AVX512_SCORE_VECTORS;
    const VALUE_VECTORS: usize = AVX512_VALUE_VECTORS;
    const DIRECT_STRIP_ROWS: usize = AVX512_DIRECT_STRIP_ROWS;
    const NAME: &'static str = "avx512";

    one_intrinsic_ops!(
        VecAvx512,
        zero: _mm512_setzero_ps,
        broadcast: _mm512_set1_ps,
        load: _mm512_loadu_ps,
        store: _mm512_storeu_ps,
        fma: _mm512_fmadd_ps,
        mul: _mm512_mul_ps,
        add: _mm512_add_ps,
        sub: _mm512_sub_ps,
        max: _mm512_max_ps,
        div: _mm512_div_ps
    );
    #[inline(always)]
    unsafe fn load_tail(p: *const f32, n: usize) -> Self {
        // SAFETY: AVX-512F and n readable floats at p; masked-off lanes are never accessed.
        VecAvx512(unsafe { _mm512_maskz_loadu_ps(tail_mask(n), p) })
    }
    #[inline(always)]
    unsafe fn store_tail(self, p: *mut f32, n: usize) {
        // SAFETY: n writeable floats at p; masked-off lanes are never accessed.
        unsafe { _mm512_mask_storeu_ps(p, tail_mask(n), self.0) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees AVX-512F and 16 readable halves.
        VecAvx512(unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) })
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        // SAFETY: the caller guarantees AVX-512F and 16 readable halves.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            VecAvx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide)))
        }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        // SAFETY: the caller guarantees AVX-512F and 16 readable bytes (vpmovsxbd, vcvtdq2ps).
        unsafe {
            VecAvx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                p.cast(),
            ))))
        }
    }
    #[inline(always)]
    unsafe fn store_f16(self, p: *mut u16) {
        // SAFETY: 16 writeable halves at p; self proves AVX-512F.
        unsafe {
            let halves =
                _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0);
            _mm256_storeu_si256(p.cast(), halves)
        }
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut u16) {
        // SAFETY: 16 writeable halves at p; self proves AVX-512F.
        unsafe {
            let bits = _mm512_castps_si512(self.0);
            let high = _mm512_srli_epi32::<16>(bits);
            let odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                _mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                odd,
            ));
            let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0);
            let halves = _mm512_mask_blend_epi32(nan, rounded, quiet);
            _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(halves))
        }
    }
    #[inline(always)]
    fn select_less(a: Self, b: Self, x: Self, y: Self) -> Self {
        // SAFETY: as in fma.
        VecAvx512(unsafe {
            _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(a.0, b.0), y.0, x.0)
        })
    }
    #[inline(always)]
    fn exp2(x: Self) -> Self {
        // SAFETY: as in fma.
        unsafe {
            // EXP2_MIN first: maxps returns its second operand, x, when either is NaN
            let x = _mm512_max_ps(_mm512_set1_ps(EXP2_MIN), x.0);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
            let f = _mm512_sub_ps(x, n);
            let mut p = _mm512_set1_ps(EXP2_COEFFICIENTS[EXP2_DEGREE]);
            for c in (0..EXP2_DEGREE).rev() {
                p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_COEFFICIENTS[c]));
            }
            let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            VecAvx512(_mm512_mul_ps(p, _mm512_castsi512_ps(bits)))
        }
    }
    #[inline(always)]
    fn reduce_max(x: Self) -> f32 {
        // SAFETY: as in fma (AVX-512F implies AVX and SSE).
        unsafe {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x.0)));
            reduce_max_256(_mm256_max_ps(_mm512_castps512_ps256(x.0), high))
        }
    }
    #[inline(always)]
    fn reduce_sum(x: Self) -> f32 {
        // SAFETY: as in fma.
        unsafe {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x.0)));
            reduce_sum_256(_mm256_add_ps(_mm512_castps512_ps256(x.0), high))
        }
    }
    #[inline(always)]
    fn reduce4(a0: Self, a1: Self, a2: Self, a3: Self) -> Self {
        // SAFETY: as in fma.
        unsafe {
            let t01 = _mm512_add_ps(
                _mm512_unpacklo_ps(a0.0, a1.0),
                _mm512_unpackhi_ps(a0.0, a1.0),
            );
            let t23 = _mm512_add_ps(
                _mm512_unpacklo_ps(a2.0, a3.0),
                _mm512_unpackhi_ps(a2.0, a3.0),
            );
            let lo = _mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
            let hi = _mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23));
            VecAvx512(_mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)))
        }
    }
    #[inline(always)]
    fn fold_groups(y: &[Self; 4]) -> Self {
        // SAFETY: as in fma.
        unsafe {
            let z01 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(y[0].0, y[1].0),
                _mm512_shuffle_f32x4::<0xee>(y[0].0, y[1].0),
            );
            let z23 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(y[2].0, y[3].0),
                _mm512_shuffle_f32x4::<0xee>(y[2].0, y[3].0),
            );
            VecAvx512(_mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(z01, z23),
                _mm512_shuffle_f32x4::<0xdd>(z01, z23),
            ))
        }
    }
    #[inline(always)]
    fn transpose(rows: &mut [Self]) {
        debug_assert_eq!(rows.len(), 16);
        // SAFETY: as in fma.
        unsafe {
            let mut u = [_mm512_setzero_ps(); 16];
            for g in 0..4 {
                // 4 x 4 transposes inside every 128-bit lane
                let r = &rows[4 * g..4 * g + 4];
                let t0 = _mm512_castps_pd(_mm512_unpacklo_ps(r[0].0, r[1].0));
                let t1 = _mm512_castps_pd(_mm512_unpackhi_ps(r[0].0, r[1].0));
                let t2 = _mm512_castps_pd(_mm512_unpacklo_ps(r[2].0, r[3].0));
                let t3 = _mm512_castps_pd(_mm512_unpackhi_ps(r[2].0, r[3].0));
                u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
                u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
                u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
                u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
            }
            // u[4g + c] lane L = rows 4g..4g+3 of column 4L + c; gather the four g per column.
            for c in 0..4 {
                let even01 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
                let odd01 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
                let even23 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
                let odd23 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
                rows[c] = VecAvx512(_mm512_shuffle_f32x4::<0x88>(even01, even23));
                rows[4 + c] = VecAvx512(_mm512_shuffle_f32x4::<0x88>(odd01, odd23));
                rows[8 + c] = VecAvx512(_mm512_shuffle_f32x4::<0xdd>(even01, even23));
                rows[12 + c] = VecAvx512(_mm512_shuffle_f32x4::<0xdd>(odd01, odd23));
            }
        }
    }
}
