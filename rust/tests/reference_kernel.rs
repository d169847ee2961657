//! The reference kernel against the seeds' checks, a naive float64 computation and the contract
//! (the checks themselves are in contract.rs, shared with the fast kernel's tests).

// The library is named `_rust` after the Python module it builds; the tests call it by the
// package's name.
extern crate _rust as twinattn;

mod common;
#[macro_use]
mod contract;

contract_tests!(common::Kernel::Reference);
