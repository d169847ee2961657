//! twinattn's Rust port: exact scaled-dot-product attention for CPUs.
//!
//! The kernels know nothing of Python: `problem` describes one call as strided views and checks
//! it, `reference_kernel` computes it. `python` (feature "python") is the thin PyO3 binding that
//! Python imports as `twinattn._rust`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod problem;
pub mod reference_kernel;

#[cfg(feature = "python")]
mod python;
