// CUDA kernels of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp; math in csrc/common/student_t_score.h).
//
//   s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)
//
// Forward and backward are the Energy-Tweedie score's kernels (et_score_cuda.cuh) with the
// Student-t law (LAW = kLawStudentT): the weight w = 1/(1 + q) and its slope, −2c in place of
// −λ, ∂L/∂c in place of ∂L/∂λ, no ∂L/∂β.
#include "et_score_cuda.cuh"

namespace etweedie {
namespace cuda {

// a: the Student-t arguments in et_score's form, c in lam's place (law_scale gives −2c; β unread).
template <typename T, typename X>
cudaError_t student_t_score_fwd_launch(const EtScoreArgs<T, X>& a, T* s, T* m, cudaStream_t stream) {
  return et_score_fwd_dispatch<T, X, false, kLawStudentT>(a, s, m, stream);
}

// ∂L/∂c arrives where et_score's backward writes ∂L/∂λ.
template <typename T, typename X>
cudaError_t student_t_score_bwd_launch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy,
                                       X* gx, T* gc, T* gp, cudaStream_t stream) {
  return et_score_bwd_dispatch<T, X, kLawStudentT>(a, grad, grad_m, m, gy, gx, nullptr, gc, gp, stream);
}

// X: the draws' storage (T itself, or 16-bit draws widened to T where loaded): ET_SCORE_TYPES.
#define ET_INSTANTIATE(T, X)                                                                                      \
  template cudaError_t student_t_score_fwd_launch<T, X>(const EtScoreArgs<T, X>&, T*, T*, cudaStream_t);        \
  template cudaError_t student_t_score_bwd_launch<T, X>(const EtScoreArgs<T, X>&, const T*, const T*, const T*, \
                                                        T*, X*, T*, T*, cudaStream_t);
ET_SCORE_TYPES(ET_INSTANTIATE)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
