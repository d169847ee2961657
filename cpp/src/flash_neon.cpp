// The tile kernel (flash_kernel.hpp) compiled for the neon vector type (simd_neon.hpp),
// once per storage type (float, Float16, BFloat16: the convert path for the 16-bit ones).
// Compile flags of this translation unit: none (NEON is part of the AArch64 baseline); built only
// for AArch64 (cpp/CMakeLists.txt).
#include "simd_neon.hpp"

#include "flash_kernel.hpp"

namespace twinattn {

FlashKernels flash_kernels_neon() { return flash::make_kernels<VecNeon>(); }

}  // namespace twinattn
