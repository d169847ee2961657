//! The Rust unit tests, one test binary: each file below is a module. One binary because the
//! release profile links with whole-program optimisation, which every test binary would repeat
//! over the whole library (about half a minute of one core each).
//!
//! | module | what it tests |
//! |---|---|
//! | reference_kernel | the reference kernel against the contract (contract/) |
//! | flash_kernel | the fast kernel on every instruction set: the contract, tile sweeps, threads |
//! | dtypes | float16 / bfloat16 paths and the software conversions |
//! | int8 | int8 K/V on every instruction set |
//! | backward | the backward pass against a naive float64 backward |
//! | paged | packed and paged batches |
//! | problem | the checks' memory-overlap helpers on hand-made layouts |

// The library is named `_rust` after the Python module it builds; the tests call it by the
// package's name.
extern crate _rust as twinattn;

mod common;
// before the modules that expand its contract_tests! macro
#[macro_use]
mod contract;

mod backward;
mod dtypes;
mod flash_kernel;
mod int8;
mod paged;
mod problem;
mod reference_kernel;
