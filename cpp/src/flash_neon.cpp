// The tile kernel (flash_kernel.hpp) compiled for the neon vector type (simd_neon.hpp).
// Compile flags of this translation unit: none (NEON is part of the AArch64 baseline); built only
// for AArch64 (cpp/CMakeLists.txt).
#include "simd_neon.hpp"

#include "flash_kernel.hpp"

namespace twinattn {
namespace {

void attend_rows_neon(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& scratch) {
    flash::Kernel<VecNeon>::attend_rows(plan, item, scratch);
}

void pack_keys_neon(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                    int64_t key_begin, int64_t key_end, float* dst) {
    flash::Kernel<VecNeon>::pack_keys(problem, b, kv_head, key_begin, key_end, dst);
}

void tanh_values_neon(float* values, int64_t n) { flash::Kernel<VecNeon>::tanh_values(values, n); }

}  // namespace

FlashKernels flash_kernels_neon() {
    return FlashKernels{"neon", attend_rows_neon, pack_keys_neon, tanh_values_neon, VecNeon::kWidth};
}

}  // namespace twinattn
