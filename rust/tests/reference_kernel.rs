//! The reference kernel against the seeds' checks, a naive float64 computation and the contract
//! (the checks themselves are in contract.rs, shared with the fast kernel's tests).

use crate::common;

contract_tests!(common::Kernel::Reference);
