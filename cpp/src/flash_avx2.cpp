// The tile kernel (flash_kernel.hpp) compiled for the avx2 vector type (simd_avx2.hpp).
// Compile flags of this translation unit: -mavx2 -mfma (cpp/CMakeLists.txt).
#include "simd_avx2.hpp"

#include "flash_kernel.hpp"

namespace twinattn {
namespace {

void attend_rows_avx2(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& scratch) {
    flash::Kernel<VecAvx2>::attend_rows(plan, item, scratch);
}

void pack_keys_avx2(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                    int64_t key_begin, int64_t key_end, float* dst) {
    flash::Kernel<VecAvx2>::pack_keys(problem, b, kv_head, key_begin, key_end, dst);
}

void tanh_values_avx2(float* values, int64_t n) { flash::Kernel<VecAvx2>::tanh_values(values, n); }

}  // namespace

FlashKernels flash_kernels_avx2() {
    return FlashKernels{"avx2", attend_rows_avx2, pack_keys_avx2, tanh_values_avx2, VecAvx2::kWidth};
}

}  // namespace twinattn
