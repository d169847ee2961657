// The tile kernel (flash_kernel.hpp) compiled for the scalar vector type (simd_scalar.hpp),
// once per storage type (float, Float16, BFloat16: the convert path for the 16-bit ones).
// Compile flags of this translation unit: none (the baseline of the target) (cpp/CMakeLists.txt).
#include "simd_scalar.hpp"

#include "flash_kernel.hpp"

namespace twinattn {

FlashKernels flash_kernels_scalar() { return flash::make_kernels<VecScalar>(); }

}  // namespace twinattn
