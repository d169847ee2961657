// The tile kernel (flash_kernel.hpp) compiled for the scalar vector type (simd_scalar.hpp).
// Compile flags of this translation unit: none (the baseline of the target) (cpp/CMakeLists.txt).
#include "simd_scalar.hpp"

#include "flash_kernel.hpp"

namespace twinattn {
namespace {

void attend_rows_scalar(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& scratch) {
    flash::Kernel<VecScalar>::attend_rows(plan, item, scratch);
}

void pack_keys_scalar(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                    int64_t key_begin, int64_t key_end, float* dst) {
    flash::Kernel<VecScalar>::pack_keys(problem, b, kv_head, key_begin, key_end, dst);
}

void tanh_values_scalar(float* values, int64_t n) { flash::Kernel<VecScalar>::tanh_values(values, n); }

}  // namespace

FlashKernels flash_kernels_scalar() {
    return FlashKernels{"scalar", attend_rows_scalar, pack_keys_scalar, tanh_values_scalar, VecScalar::kWidth};
}

}  // namespace twinattn
