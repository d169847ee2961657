// The kernels of the instruction set in use (dispatch.cpp), for flash_attention.cpp.
#pragma once

#include "flash_kernel.hpp"

namespace twinattn {

FlashKernels current_kernels();

}  // namespace twinattn
