//! What the two x86 vector types (simd_avx2.rs, simd_avx512.rs) share: the operations that are one
//! intrinsic each, the same for both widths but for the intrinsics' names (written once, as a
//! macro that each type's `impl Vector` expands with its own names), and the horizontal
//! reductions' last 256 bits (AVX-512 folds its halves into one 256-bit vector first). Twin of
//! the same operations in `cpp/src/simd_avx2.hpp` and `cpp/src/simd_avx512.hpp`.

use std::arch::x86_64::*;

/// The one-intrinsic operations of `impl Vector for $vector` (a tuple struct around the
/// register): constructors and loads as `unsafe fn`s (the caller guarantees the instruction
/// set), stores on `self`, and the arithmetic, which a value of the type makes sound.
macro_rules! one_intrinsic_ops {
    (@binary $vector:ident, $($name:ident: $intrinsic:ident),+) => {
        $(
            #[inline(always)]
            fn $name(a: Self, b: Self) -> Self {
                // SAFETY: as in fma.
                $vector(unsafe { $intrinsic(a.0, b.0) })
            }
        )+
    };
    ($vector:ident,zero: $zero:ident,broadcast: $broadcast:ident,load: $load:ident,
     store: $store:ident,fma: $fma:ident,mul: $mul:ident,add: $add:ident,sub: $sub:ident,
     max: $max:ident,div: $div:ident) => {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the caller guarantees the instruction set.
            $vector(unsafe { $zero() })
        }
        #[inline(always)]
        unsafe fn broadcast(x: f32) -> Self {
            // SAFETY: the caller guarantees the instruction set.
            $vector(unsafe { $broadcast(x) })
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller guarantees the instruction set and WIDTH readable floats at p.
            $vector(unsafe { $load(p) })
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller guarantees WIDTH writeable floats at p; self proves the
            // instruction set.
            unsafe { $store(p, self.0) }
        }
        #[inline(always)]
        fn fma(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: a value of this type proves its instruction set (and FMA; see simd.rs).
            $vector(unsafe { $fma(a.0, b.0, c.0) })
        }
        one_intrinsic_ops!(@binary $vector, mul: $mul, add: $add, sub: $sub, max: $max, div: $div);
    };
}
pub(super) use one_intrinsic_ops;

/// The 8 lanes of x folded in halves by `op`: 128, 64, then 32 bits (`op_low`, the lowest lane).
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn fold_halves_256(
    x: __m256,
    op: impl Fn(__m128, __m128) -> __m128,
    op_low: impl Fn(__m128, __m128) -> __m128,
) -> f32 {
    // SAFETY: the caller guarantees AVX.
    unsafe {
        let mut q = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        q = op(q, _mm_movehl_ps(q, q));
        q = op_low(q, _mm_shuffle_ps::<1>(q, q));
        _mm_cvtss_f32(q)
    }
}

/// The largest of 8 lanes, halves folded.
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
pub(super) unsafe fn reduce_max_256(x: __m256) -> f32 {
    // SAFETY: the caller guarantees AVX (SSE with it).
    unsafe { fold_halves_256(x, |a, b| _mm_max_ps(a, b), |a, b| _mm_max_ss(a, b)) }
}

/// The sum of 8 lanes, halves folded like [`reduce_max_256`].
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
pub(super) unsafe fn reduce_sum_256(x: __m256) -> f32 {
    // SAFETY: the caller guarantees AVX (SSE with it).
    unsafe { fold_halves_256(x, |a, b| _mm_add_ps(a, b), |a, b| _mm_add_ss(a, b)) }
}
