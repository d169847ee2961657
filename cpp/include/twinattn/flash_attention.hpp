// The fast kernel: FlashAttention-2-style exact forward pass (docs/kernels.md), with run-time
// instruction-set dispatch. Same contract and results (within float32 rounding) as
// attention_reference (reference_kernel.hpp), which every path is tested against.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "twinattn/problem.hpp"

namespace twinattn {

// Computes out (and lse when requested) for the whole problem with the current instruction
// set. Calls check_problem first and throws std::invalid_argument on a bad problem or
// num_threads < 1. Uses the calling thread plus up to num_threads - 1 workers of a persistent
// pool; a call that finds the pool busy runs on its own thread. Results do not depend on
// num_threads. Safe to call concurrently from several threads.
void attention_forward(const AttentionProblem& problem, int num_threads);

// Packed (varlen) and paged batches (problem.hpp): the checks of varlen_sequences /
// paged_sequences, then every sequence as a dense problem through the same kernel, all their
// work items in one parallel pass (docs/kernels.md, "Packed and paged batches"). Throw like
// attention_forward.
void attention_varlen(const VarlenProblem& problem, int num_threads);
void attention_paged(const PagedProblem& problem, int num_threads);

// The vectorised tanh of softcap (docs/kernels.md, "Variants") with the current instruction set,
// y[i] = tanh(x[i]) for n floats (x read with a stride in elements, y contiguous): the kernel's
// own code, exposed so that tests can check it alone. Throws like attention_forward when
// TWINATTN_ISA named an instruction set that cannot run; std::bad_alloc when its buffer cannot
// be allocated.
void softcap_tanh(const float* x, int64_t x_stride, float* y, int64_t n);

// GFLOP/s of register-resident multiply-add loops on num_threads threads of the pool for about
// `seconds` (measure_peak.cpp): kind "fma32" (AVX-512 FMA, 32 flop per instruction; AVX2 FMA, 16,
// without AVX-512F) or "bf16dot" (VDPBF16PS, 64 flop per instruction). Throws
// std::invalid_argument for another kind, a kind this CPU cannot run, num_threads < 1, or seconds
// outside (0, 1e6].
double measure_peak(const std::string& kind, int64_t num_threads, double seconds);

// ---- Instruction-set dispatch (dispatch.cpp) ---------------------------------------------------
// "avx512bf16" (AVX-512F + AVX512_BF16: bfloat16 prefill by VDPBF16PS), "avx512" (AVX-512F),
// "avx2" (AVX2 + FMA + F16C), "scalar" (portable): the names this build and this
// CPU can run, fastest first.
std::vector<std::string> available_isas();
// The instruction set attention_forward uses now: TWINATTN_ISA when it is set (read once, at
// first use), else the fastest available one.
std::string current_isa();
// Switches the instruction set; throws std::invalid_argument naming the available ones.
void set_isa(const std::string& name);
// Throws std::invalid_argument with a clear message when TWINATTN_ISA names an instruction set
// that this build or CPU cannot run (attention_forward throws the same until set_isa is
// called). The Python module calls it at import, so a bad value fails the import loudly.
void init_isa_from_environment();

}  // namespace twinattn
