//! The tile kernel (flash_kernel.rs) compiled for the neon vector type (simd_neon.rs), once per
//! storage type (f32, Float16, BFloat16: the convert path for the 16-bit ones). Target features
//! of its entry functions: neon (part of the AArch64 baseline); built only for AArch64. Twin of
//! `cpp/src/flash_neon.cpp`.

crate::flash_kernel::make_kernels!(
    flash_kernels_neon,
    crate::simd_neon::VecNeon,
    "neon",
    "neon"
);
