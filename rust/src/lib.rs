//! twinattn's Rust port: exact scaled-dot-product attention for CPUs.
//!
//! The kernels know nothing of Python: `problem` describes one call as strided views and checks
//! it, `reference_kernel` computes it plainly, `flash_attention` fast (tiles planned there,
//! computed by `flash_kernel` (compiled per instruction set in `flash_scalar`, `flash_avx2`, ...)
//! over the vector types of `simd_scalar`, `simd_avx2`, ..., on the threads of `thread_pool`,
//! with the instruction set chosen by `dispatch`; every number in `constants`). `python`
//! (feature "python") is the thin PyO3 binding that Python imports as `twinattn._rust`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backward_kernel;
pub mod constants;
pub mod dispatch;
pub mod element;
#[cfg(target_arch = "x86_64")]
pub mod flash_amx;
pub mod flash_attention;
#[cfg(target_arch = "x86_64")]
pub mod flash_avx2;
#[cfg(target_arch = "x86_64")]
pub mod flash_avx512;
#[cfg(target_arch = "x86_64")]
pub mod flash_avx512bf16;
pub mod flash_backward;
pub mod flash_kernel;
#[cfg(target_arch = "aarch64")]
pub mod flash_neon;
pub mod flash_scalar;
pub mod measure_peak;
pub mod problem;
pub mod reference_kernel;
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub mod simd_avx2;
#[cfg(target_arch = "x86_64")]
pub mod simd_avx512;
#[cfg(target_arch = "aarch64")]
pub mod simd_neon;
pub mod simd_scalar;
#[cfg(target_arch = "x86_64")]
mod simd_x86;
pub mod thread_pool;

#[cfg(feature = "python")]
mod python;
