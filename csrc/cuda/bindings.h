// Host helpers shared by the CUDA bindings csrc/cuda/<op>_bindings.cpp — the only files of
// csrc/cuda that see torch.  Each binding checks its arguments with csrc/common/checks.h (the
// same checks as the CPU kernels), allocates the outputs and calls the launchers of
// launchers.cuh on torch's current stream.  Built only with a CUDA torch (setup.py: CUDA_HOME
// and torch.version.cuda, or FORCE_CUDA=1); the .cu files themselves compile with plain nvcc.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "launchers.cuh"

namespace etweedie {
namespace cuda {

// The host SIMT emulator of the tests (tests/simt) builds these same bindings with g++ over CPU
// tensors and registers them in its own namespace, etweedie_simt.
#if !defined(ETWEEDIE_SIMT)
#define ET_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(etweedie, CUDA, m)
constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CUDA;
#else
#define ET_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(etweedie_simt, CPU, m)
constexpr c10::DeviceType kKernelDevice = c10::DeviceType::CPU;
#endif

// The CUDA kernels read every tensor through raw device pointers: all of them on one GPU
// (checks::same_dtype_device already tied them to the first tensor's device).
inline void check_cuda(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kKernelDevice, op, ": the CUDA kernel needs CUDA tensors, got device ", t.device());
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// The launch of a score kernel, on y's device and its current stream, for y's compute type T and
// the draws' storage type X (T, bf16 or fp16: dispatch_draws, from x's dtype):
// launch(DrawType<T>{}, DrawType<X>{}, stream) returns the launcher's cudaError_t.
template <typename F>
void launch_score(const char* op, const at::Tensor& y, const at::Tensor& x, F&& launch) {
  const c10::cuda::CUDAGuard guard(y.device());
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "launch_score", [&] {  // y float32 or float64 (checks)
    dispatch_draws<scalar_t>(x, [&](auto draw_type) {
      check_launch(launch(DrawType<scalar_t>{}, draw_type, c10::cuda::getCurrentCUDAStream()), op);
    });
  });
}

// A gradient output of a score backward: an empty tensor (y's options) when not requested; else
// of the given size and options, left for the kernel to write in full, or zero-filled where the
// launchers have nothing to do (B = 0 or d = 0).
inline at::Tensor grad_output(bool need, const at::Tensor& y, at::IntArrayRef size, const at::TensorOptions& options) {
  if (!need) return at::empty({0}, y.options());
  return y.size(0) == 0 || y.size(1) == 0 ? at::zeros(size, options) : at::empty(size, options);
}

// The launchers' arguments (launchers.cuh) for the score ops: the Student-t score passes c as
// both beta and lam.
template <typename T, typename X>
inline EtScoreArgs<T, X> row_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                  const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  EtScoreArgs<T, X> a{};
  a.y = y.data_ptr<T>();
  a.x = draws_data<X>(x);
  a.beta = beta.data_ptr<T>();
  a.lam = lam.data_ptr<T>();
  a.prec = prec.data_ptr<T>();
  a.B = y.size(0);
  a.N = x.size(1);
  a.d = y.size(1);
  a.sxb = x.stride(0);
  a.sxn = x.stride(1);
  a.sb = beta.stride(0);
  a.sl = lam.stride(0);
  a.sp = prec.stride(0);
  a.kind = static_cast<int>(kind);
  a.kblock = kind == 2 ? static_cast<int>(prec.size(1)) : 1;
  return a;
}

}  // namespace cuda
}  // namespace etweedie
