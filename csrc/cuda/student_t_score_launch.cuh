// Host-side entry points of the Student-t score's CUDA kernels (csrc/cuda/student_t_score_cuda.cu).
// Plain C++ over the CUDA runtime (raw pointers, sizes, element strides, a stream), so the .cu
// compiles with plain nvcc and only csrc/cuda/student_t_score_bindings.cpp needs a CUDA torch.
//
// Canonical arguments (etweedie/ops/student_t_score.py): y (B, d) contiguous; x (B, N, d) with
// element strides sxb, sxn over B and N (0 = shared) and unit stride over d; c (B,) with stride
// sc; prec (B, *param) with row stride sp and contiguous parameter dims; kind 0 isotropic,
// 1 diagonal, 2 block (kblock ≤ 4).  x (and gx) are stored as X ∈ {T, bf16, fp16}: 16-bit draws
// are widened to T where loaded, and gx is rounded once to X where stored.  Outputs are contiguous and fully written.  Every launcher
// returns the launch's cudaError_t (cudaSuccess when there is nothing to do), never synchronizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/low_precision.h"  // bf16 / fp16 draws

namespace etweedie {
namespace cuda {

template <typename T, typename X = T>
struct StudentTArgs {
  const T* y;
  const X* x;
  const T* c;
  const T* prec;
  int64_t B, N, d;
  int64_t sxb, sxn, sc, sp;
  int kind, kblock;
};

// s = −2c P m and m = (1/N) Σ_i (y − x_i)/(1 + q_i), both (B, d).
template <typename T, typename X>
cudaError_t student_t_score_fwd_launch(const StudentTArgs<T, X>& a, T* s, T* m, cudaStream_t stream);

// Gradients: grad, grad_m, m (B, d) contiguous; outputs (null = not requested) gy (B, d),
// gx (B, N, d), gc (B,), gp (B, *param).
template <typename T, typename X>
cudaError_t student_t_score_bwd_launch(const StudentTArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy,
                                       X* gx, T* gc, T* gp, cudaStream_t stream);

}  // namespace cuda
}  // namespace etweedie
