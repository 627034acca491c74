// CUDA kernels of etweedie::energy_score_fwd / _bwd / _fwd_grad (schemas in csrc/etweedie.cpp;
// bindings in csrc/cuda/bindings.cpp).
//
//   ES(x_{1..M}, y) = (1/M) Σ_i ‖x_i − y‖_P^β − c_M Σ_{i<j} ‖x_i − x_j‖_P^β,
//   c_M = 1/(M(M−1)) (fair, the unbiased pair term) or 1/M² (biased; the i = j terms are 0).
//
// The pair engine (energy_cuda.cuh) runs with cloud a = the M samples and cloud c = the target
// as a one-point cloud (weights 1/M, −c_M, 0): one block per (row, tile of samples) for the
// value and the samples' gradients, and — when the target's gradient is wanted — one block per
// row for Σ_i over the samples.  The training shape (M ≤ 63 samples at d > 4, e.g. 32 × 784)
// takes the engine's coordinate-split kernels instead: the M + 1 points of a row form one
// small cloud whose coordinates are split over blocks (energy_cuda.cuh).
#include "energy_cuda.cuh"

namespace etweedie {
namespace cuda {

template <typename T>
cudaError_t energy_score_launch(const EnergyArgs<T>& a, bool fair, T* value, T* ga, T* gc, T* gbeta,
                                double* workspace, cudaStream_t stream) {
  const double M = static_cast<double>(a.n);
  if (a.B > 0 && (a.n < 1 || (fair && a.n < 2) || a.m != 1)) return cudaErrorInvalidValue;
  const double within = a.n < 2 ? 0.0 : (fair ? 1.0 / (M * (M - 1.0)) : 1.0 / (M * M));
  return energy_pairs_run<T>(a, 1.0 / M, -within, 0.0, value, ga, gc, gbeta, workspace, stream);
}

#define ET_INSTANTIATE(T)                                                                                        \
  template cudaError_t energy_score_launch<T>(const EnergyArgs<T>&, bool, T*, T*, T*, T*, double*, cudaStream_t);
ET_INSTANTIATE(float)
ET_INSTANTIATE(double)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
