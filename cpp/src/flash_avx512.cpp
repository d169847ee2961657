// The tile kernel (flash_kernel.hpp) compiled for the avx512 vector type (simd_avx512.hpp),
// once per storage type (float, Float16, BFloat16: the convert path for the 16-bit ones).
// Compile flags of this translation unit: -mavx512f -mavx2 -mfma -mf16c (cpp/CMakeLists.txt).
#include "simd_avx512.hpp"

#include "flash_kernel.hpp"
#include "measure_peak.hpp"

namespace twinattn {

FlashKernels flash_kernels_avx512() { return flash::make_kernels<VecAvx512>(); }

// measure_peak (measure_peak.hpp): 16 independent accumulators, each acc = acc * b + c with
// b just below 1 and c small, so the values stay normal and bounded however long it runs.
int64_t peak_fma32_avx512(int64_t instructions) {
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
    return 32 * run_peak_loop<16>(
                    instructions, [](int i) { return _mm512_set1_ps(static_cast<float>(i)); },
                    [b, c](__m512 acc) { return _mm512_fmadd_ps(acc, b, c); },
                    [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); },
                    [](__m512 x) { return _mm512_cvtss_f32(x); });
}

}  // namespace twinattn
