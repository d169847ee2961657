// The backward pass of attention (docs/kernels.md, "Backward"): FlashAttention-2's, P
// recomputed from the forward's lse, no (Lq, Lk) buffer. Twin of rust/src/flash_backward.rs.
#pragma once

#include "twinattn/problem.hpp"

namespace twinattn {

// Writes dq, dk and dv (every element: 0 for keys past kv_lens, keys no row sees and rows that
// see no key) and dsinks when requested, for the whole problem. Calls check_backward first and
// throws std::invalid_argument on a bad problem or num_threads < 1; std::bad_alloc when its
// buffers cannot be allocated; std::invalid_argument naming the instruction sets when TWINATTN_ISA
// names one this CPU cannot run (as attention_forward). float32 arithmetic on the instruction set
// in use (dispatch.hpp); the results do not depend on num_threads (each gradient element is summed
// by one thread in a fixed order). On amxbf16, bfloat16 with D a multiple of 32 multiplies on
// AMX tiles, P and dS rounded to bfloat16 (flash_backward.cpp). Safe to call concurrently from
// several threads.
void attention_backward(const BackwardProblem& problem, int num_threads);

}  // namespace twinattn
