// c10's current CUDA stream as the host SIMT emulator needs it: launches run synchronously.
#pragma once
#include "../../../simt.h"

namespace c10 {
namespace cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(int = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
