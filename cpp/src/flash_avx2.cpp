// The tile kernel (flash_kernel.hpp) compiled for the avx2 vector type (simd_avx2.hpp),
// once per storage type (float, Float16, BFloat16: the convert path for the 16-bit ones).
// Compile flags of this translation unit: -mavx2 -mfma -mf16c (cpp/CMakeLists.txt).
#include "simd_avx2.hpp"

#include "flash_kernel.hpp"

namespace twinattn {

FlashKernels flash_kernels_avx2() { return flash::make_kernels<VecAvx2>(); }

// measure_peak (flash_kernel.hpp): 12 independent accumulators (16 registers: 12 + b + c), each acc = acc * b + c with
// b just below 1 and c small, so the values stay normal and bounded however long it runs.
int64_t peak_fma32_avx2(int64_t instructions) {
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
    for (int64_t done = 0; done < instructions; done += 12)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
    __m256 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm256_add_ps(sum, acc[i]);
    volatile float sink = _mm256_cvtss_f32(sum);  // the loop's result is used
    (void)sink;
    return (instructions + 11) / 12 * 12 * 16;
}

}  // namespace twinattn
