// The tile kernel (flash_kernel.hpp) compiled for the avx2 vector type (simd_avx2.hpp),
// once per storage type (float, Float16, BFloat16: the convert path for the 16-bit ones).
// Compile flags of this translation unit: -mavx2 -mfma -mf16c (cpp/CMakeLists.txt).
#include "simd_avx2.hpp"

#include "flash_kernel.hpp"
#include "measure_peak.hpp"

namespace twinattn {

FlashKernels flash_kernels_avx2() { return flash::make_kernels<VecAvx2>(); }

// measure_peak (measure_peak.hpp): 12 independent accumulators (16 registers: 12 + b + c), each acc = acc * b + c with
// b just below 1 and c small, so the values stay normal and bounded however long it runs.
int64_t peak_fma32_avx2(int64_t instructions) {
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
    return 16 * run_peak_loop<12>(
                    instructions, [](int i) { return _mm256_set1_ps(static_cast<float>(i)); },
                    [b, c](__m256 acc) { return _mm256_fmadd_ps(acc, b, c); },
                    [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); },
                    [](__m256 x) { return _mm256_cvtss_f32(x); });
}

}  // namespace twinattn
