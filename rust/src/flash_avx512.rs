//! The tile kernel (flash_kernel.rs) compiled for the avx512 vector type (simd_avx512.rs), once
//! per storage type (f32, Float16, BFloat16: the convert path for the 16-bit ones). Target
//! features of its entry functions: avx512f, avx2, fma, f16c. Twin of `cpp/src/flash_avx512.cpp`.

use std::arch::x86_64::*;

use crate::measure_peak::run_peak_loop;

crate::flash_kernel::make_kernels!(
    flash_kernels_avx512,
    crate::simd_avx512::VecAvx512,
    "avx512",
    "avx512f,avx2,fma,f16c"
);

/// measure_peak (measure_peak.rs): 16 independent accumulators, each acc = acc * b + c with b
/// just below 1 and c small, so the values stay normal and bounded however long it runs.
/// Returns the flop done (32 per instruction).
///
/// # Safety
/// AVX-512F available.
#[target_feature(enable = "avx512f")]
pub unsafe fn peak_fma32_avx512(instructions: u64) -> u64 {
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-6));
    let fma = |acc| _mm512_fmadd_ps(acc, b, c);
    32 * run_peak_loop!(
        instructions,
        16,
        _mm512_set1_ps,
        fma,
        _mm512_add_ps,
        _mm512_cvtss_f32
    )
}
