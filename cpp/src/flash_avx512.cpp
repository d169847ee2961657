// The tile kernel (flash_kernel.hpp) compiled for the avx512 vector type (simd_avx512.hpp).
// Compile flags of this translation unit: -mavx512f -mavx2 -mfma (cpp/CMakeLists.txt).
#include "simd_avx512.hpp"

#include "flash_kernel.hpp"

namespace twinattn {
namespace {

void attend_rows_avx512(const FlashPlan& plan, const WorkItem& item, const ThreadScratch& scratch) {
    flash::Kernel<VecAvx512>::attend_rows(plan, item, scratch);
}

void pack_keys_avx512(const AttentionProblem& problem, int64_t b, int64_t kv_head,
                    int64_t key_begin, int64_t key_end, float* dst) {
    flash::Kernel<VecAvx512>::pack_keys(problem, b, kv_head, key_begin, key_end, dst);
}

void tanh_values_avx512(float* values, int64_t n) { flash::Kernel<VecAvx512>::tanh_values(values, n); }

}  // namespace

FlashKernels flash_kernels_avx512() {
    return FlashKernels{"avx512", attend_rows_avx512, pack_keys_avx512, tanh_values_avx512, VecAvx512::kWidth};
}

}  // namespace twinattn
