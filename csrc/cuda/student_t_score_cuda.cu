// CUDA kernels of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp; math in csrc/common/student_t_score.h).
//
//   s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)
//
// Forward and backward are the Energy-Tweedie score's kernels (et_score_cuda.cuh) with the
// Student-t law (LAW = kLawStudentT): the weight w = 1/(1 + q) and its slope, −2c in place of
// −λ, ∂L/∂c in place of ∂L/∂λ, no ∂L/∂β.
#include <cuda_runtime.h>

#include "../common/student_t_score.h"
#include "et_score_cuda.cuh"
#include "metric_cuda.cuh"
#include "student_t_score_launch.cuh"

namespace etweedie {
namespace cuda {

// Student-t arguments as the Energy-Tweedie kernels take them: c in λ's place (law_scale gives
// −2c), β unused by the Student-t weight.
template <typename T, typename X>
EtScoreArgs<T, X> as_et_score_args(const StudentTArgs<T, X>& a) {
  EtScoreArgs<T, X> e{};
  e.y = a.y;
  e.x = a.x;
  e.beta = a.c;
  e.lam = a.c;
  e.prec = a.prec;
  e.B = a.B;
  e.N = a.N;
  e.d = a.d;
  e.sxb = a.sxb;
  e.sxn = a.sxn;
  e.sb = a.sc;
  e.sl = a.sc;
  e.sp = a.sp;
  e.kind = a.kind;
  e.kblock = a.kblock;
  return e;
}

template <typename T, typename X>
cudaError_t student_t_score_fwd_launch(const StudentTArgs<T, X>& a, T* s, T* m, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0 || a.B > 2147483647) return cudaErrorInvalidValue;
  return et_score_fwd_dispatch<T, X, false, kLawStudentT>(as_et_score_args(a), s, m, stream);
}

// ∂L/∂c arrives where et_score's backward writes ∂L/∂λ.
template <typename T, typename X>
cudaError_t student_t_score_bwd_launch(const StudentTArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy,
                                       X* gx, T* gc, T* gp, cudaStream_t stream) {
  return et_score_bwd_dispatch<T, X, kLawStudentT>(as_et_score_args(a), grad, grad_m, m, gy, gx, nullptr, gc, gp,
                                                   stream);
}

// X: the draws' storage (T itself, or 16-bit draws widened to T where loaded).
#define ET_INSTANTIATE(T, X)                                                                                      \
  template cudaError_t student_t_score_fwd_launch<T, X>(const StudentTArgs<T, X>&, T*, T*, cudaStream_t);        \
  template cudaError_t student_t_score_bwd_launch<T, X>(const StudentTArgs<T, X>&, const T*, const T*, const T*, \
                                                        T*, X*, T*, T*, cudaStream_t);
ET_INSTANTIATE(float, float)
ET_INSTANTIATE(float, bf16)
ET_INSTANTIATE(float, fp16)
ET_INSTANTIATE(double, double)
ET_INSTANTIATE(double, bf16)
ET_INSTANTIATE(double, fp16)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
