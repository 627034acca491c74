// CUDA kernels of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp): the
// forward and backward kernels live in et_score_cuda.cuh, shared with langevin_step_cuda.cu (the
// forward) and student_t_score_cuda.cu (both, with the Student-t law).
#include "et_score_cuda.cuh"

namespace etweedie {
namespace cuda {

template <typename T, typename X>
cudaError_t et_score_fwd_launch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream) {
  return et_score_fwd_dispatch<T, X, false>(a, out, m, stream);
}

template <typename T, typename X>
cudaError_t et_score_bwd_launch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy, X* gx,
                                T* gb, T* gl, T* gp, cudaStream_t stream) {
  return et_score_bwd_dispatch<T, X>(a, grad, grad_m, m, gy, gx, gb, gl, gp, stream);
}

// X: the draws' storage (T itself, or 16-bit draws widened to T where loaded): ET_SCORE_TYPES.
#define ET_INSTANTIATE(T, X)                                                                                    \
  template cudaError_t et_score_fwd_launch<T, X>(const EtScoreArgs<T, X>&, T*, T*, cudaStream_t);              \
  template cudaError_t et_score_bwd_launch<T, X>(const EtScoreArgs<T, X>&, const T*, const T*, const T*, T*, X*, \
                                                 T*, T*, T*, cudaStream_t);
ET_SCORE_TYPES(ET_INSTANTIATE)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
