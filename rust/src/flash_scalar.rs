//! The tile kernel (flash_kernel.rs) compiled for the scalar vector type (simd_scalar.rs), once
//! per storage type (f32, Float16, BFloat16: the convert path for the 16-bit ones). Target
//! features of its entry functions: none (the baseline of the target). Twin of
//! `cpp/src/flash_scalar.cpp`.

crate::flash_kernel::make_kernels!(
    flash_kernels_scalar,
    crate::simd_scalar::VecScalar,
    "scalar",
);
