// c10's CUDA device guard as the host SIMT emulator needs it: the emulated device is the CPU.
#pragma once
#include <c10/core/Device.h>

#include "../../../simt.h"

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace cuda
}  // namespace c10
