// CUDA kernel of etweedie::langevin_step_fwd: the score of et_score_cuda.cuh and the update
//   y' = y + α s(y) + sqrt(2α) ξ
// in the same block, while the row's m is in shared memory (s never goes to global memory).
// Returns (y', m); the backward is et_score_bwd with upstream α·g (etweedie/ops/langevin_step.py).
#include "et_score_cuda.cuh"

namespace etweedie {
namespace cuda {

template <typename T, typename X>
cudaError_t langevin_step_fwd_launch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream) {
  return et_score_fwd_dispatch<T, X, true>(a, out, m, stream);
}

// X: the draws' storage (T itself, or 16-bit draws widened to T where loaded): ET_SCORE_TYPES.
#define ET_INSTANTIATE(T, X) \
  template cudaError_t langevin_step_fwd_launch<T, X>(const EtScoreArgs<T, X>&, T*, T*, cudaStream_t);
ET_SCORE_TYPES(ET_INSTANTIATE)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
