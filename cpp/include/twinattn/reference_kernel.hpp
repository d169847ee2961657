// The scalar reference kernel: exact attention, one query row at a time, accumulated in double.
// Slow and obvious on purpose; every faster kernel is tested against it.
#pragma once

#include "twinattn/problem.hpp"

namespace twinattn {

// Computes out (and lse when requested) for the whole problem. Calls check_problem first and
// throws std::invalid_argument on a bad problem or num_threads < 1. The B * Hq (sequence,
// query head) pairs are split into num_threads contiguous chunks, one std::thread each;
// num_threads == 1 runs inline. Results do not depend on num_threads.
void attention_reference(const AttentionProblem& problem, int num_threads);

}  // namespace twinattn
