// CUDA kernel of etweedie::langevin_step_fwd: the score of et_score_cuda.cuh and the update
//   y' = y + α s(y) + sqrt(2α) ξ
// in the same block, while the row's m is in shared memory (s never goes to global memory).
// Returns (y', m); the backward is et_score_bwd with upstream α·g (etweedie/ops/langevin_step.py).
#include "et_score_cuda.cuh"

namespace etweedie {
namespace cuda {

template <typename T>
cudaError_t langevin_step_fwd_launch(const EtScoreArgs<T>& a, T* out, T* m, cudaStream_t stream) {
  return et_score_fwd_dispatch<T, true>(a, out, m, stream);
}

template cudaError_t langevin_step_fwd_launch<float>(const EtScoreArgs<float>&, float*, float*, cudaStream_t);
template cudaError_t langevin_step_fwd_launch<double>(const EtScoreArgs<double>&, double*, double*, cudaStream_t);

}  // namespace cuda
}  // namespace etweedie
