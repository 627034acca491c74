// Kernels that the SIMT emulator must run correctly or reject (tests/test_cuda_simt.py checks
// the emulator itself with them): etweedie_simt::selftest(name) -> float tensor.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "simt.h"

namespace {

using etweedie::cuda::launch;

__device__ float warp_total(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Σ over the block of (thread index + 1) through shuffles and shared memory.
__global__ void block_sum_kernel(float* out) {
  __shared__ float part[4];
  const float v = warp_total(static_cast<float>(threadIdx.x + 1));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = part[0] + part[1] + part[2] + part[3];
}

// Each thread publishes its index and reads its neighbour's without a barrier between.
__global__ void racy_publish_kernel(float* out) {
  ET_DYNAMIC_SHARED(smem);
  float* slot = reinterpret_cast<float*>(smem);
  slot[threadIdx.x] = static_cast<float>(threadIdx.x);
  // missing __syncthreads(): the neighbour may not have written yet (its slot holds 0xff bytes)
  out[threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

// Half of each warp at a shuffle, the other half at __syncthreads: undefined on a GPU (a hang).
// (Threads that exit before a __syncthreads count as arrived, as on sm_70 and later.)
__global__ void shuffle_beside_barrier_kernel(float* out) {
  if (threadIdx.x % 32 < 16) {
    out[threadIdx.x] = warp_total(1.0f);
  } else {
    __syncthreads();
  }
}

__global__ void exited_lane_shuffle_kernel(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = warp_total(1.0f);
}

__global__ void misaligned_load_kernel(const float* in, float* out) {
  const float* p = in + 1;  // 4-byte aligned, not 16
  simt::check_aligned(p, 16);
  out[threadIdx.x] = p[0];
}

at::Tensor selftest(std::string name) {
  auto out = at::zeros({128}, at::kFloat);
  float* o = out.data_ptr<float>();
  cudaError_t err = cudaSuccess;
  if (name == "block_sum") {
    err = launch(block_sum_kernel, dim3(3), dim3(128), 0, nullptr, o);
  } else if (name == "racy_publish") {
    err = launch(racy_publish_kernel, dim3(1), dim3(128), 128 * sizeof(float), nullptr, o);
  } else if (name == "shuffle_beside_barrier") {
    err = launch(shuffle_beside_barrier_kernel, dim3(1), dim3(128), 0, nullptr, o);
  } else if (name == "exited_lane_shuffle") {
    err = launch(exited_lane_shuffle_kernel, dim3(1), dim3(128), 0, nullptr, o);
  } else if (name == "misaligned_load") {
    auto in = at::zeros({8}, at::kFloat);
    err = launch(misaligned_load_kernel, dim3(1), dim3(32), 0, nullptr, static_cast<const float*>(in.data_ptr<float>()), o);
  } else if (name == "too_much_shared") {
    err = launch(racy_publish_kernel, dim3(1), dim3(128), 64 * 1024, nullptr, o);  // no cudaFuncSetAttribute
  } else if (name == "bad_grid") {
    err = launch(block_sum_kernel, dim3(1), dim3(2048), 0, nullptr, o);
  } else {
    TORCH_CHECK(false, "selftest: unknown case ", name);
  }
  TORCH_CHECK(err == cudaSuccess, "selftest ", name, ": launch error: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(etweedie_simt, m) { m.def("selftest(str name) -> Tensor", &selftest); }
