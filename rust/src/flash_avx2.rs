//! The tile kernel (flash_kernel.rs) compiled for the avx2 vector type (simd_avx2.rs), once per
//! storage type (f32, Float16, BFloat16: the convert path for the 16-bit ones). Target features
//! of its entry functions: avx2, fma, f16c. Twin of `cpp/src/flash_avx2.cpp`.

use std::arch::x86_64::*;

use crate::measure_peak::run_peak_loop;

crate::flash_kernel::make_kernels!(
    flash_kernels_avx2,
    crate::simd_avx2::VecAvx2,
    "avx2",
    "avx2,fma,f16c"
);

/// measure_peak (measure_peak.rs): 12 independent accumulators (16 registers: 12 + b + c), each
/// acc = acc * b + c with b just below 1 and c small, so the values stay normal and bounded
/// however long it runs. Returns the flop done (16 per instruction).
///
/// # Safety
/// AVX2 and FMA available.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn peak_fma32_avx2(instructions: u64) -> u64 {
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-6));
    let fma = |acc| _mm256_fmadd_ps(acc, b, c);
    16 * run_peak_loop!(
        instructions,
        12,
        _mm256_set1_ps,
        fma,
        _mm256_add_ps,
        _mm256_cvtss_f32
    )
}
