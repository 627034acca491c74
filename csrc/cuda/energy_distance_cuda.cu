// CUDA kernels of etweedie::energy_distance_fwd / _bwd (schemas in csrc/etweedie.cpp; bindings
// in csrc/cuda/bindings.cpp).
//
//   ED(a, b) = 2/(nm) Σ_{i,j} E(a_i − b_j) − w_n Σ_{i<j} E(a_i − a_j) − w_m Σ_{i<j} E(b_i − b_j),
//   w_n = 2/(n(n−1)) (unbiased: the signed U-statistic) or 2/n² (the V-statistic).
//
// The pair engine (energy_cuda.cuh) tiles both clouds — one block per (row, tile of 128
// points for d ≤ 4, of 32 points above) — so memory stays O((n + m)·d) for any n, m: the
// forward forms every cross pair once (blocks of a) and each within pair once (circulant
// split); the backward runs one launch per cloud with ordered pairs, each point's gradient
// summed by the block that owns it (no atomics).  n = m = 65,536, d = 2: 1,024 blocks of
// 128 threads per launch, each thread streaming 65,536 + 32,768 partner points through
// shared memory.
#include "energy_cuda.cuh"

namespace etweedie {
namespace cuda {

bool energy_split_path(int64_t n, int64_t m, int64_t d) { return energy_split_fits(n, m, d) && energy_split_enabled(); }

int64_t energy_workspace_doubles(int64_t B, int64_t n, int64_t m, int64_t d, int64_t elem_bytes, bool split,
                                 int kblock) {
  if (split) return (split_workspace_bytes(B, split_shape(n, m, d, elem_bytes, kblock), elem_bytes) + 7) / 8 + 1;
  return 4 * B * (energy_tiles(n, d) + energy_tiles(m, d)) + 1;
}

template <typename T>
cudaError_t energy_distance_launch(const EnergyArgs<T>& a, bool unbiased, T* value, T* ga, T* gc, T* gbeta,
                                   double* workspace, cudaStream_t stream) {
  if (a.B > 0 && (a.n < 1 || a.m < 1 || (unbiased && (a.n < 2 || a.m < 2)))) return cudaErrorInvalidValue;
  auto within = [unbiased](int64_t k) {
    const double x = static_cast<double>(k);
    return k < 2 ? 0.0 : (unbiased ? 2.0 / (x * (x - 1.0)) : 2.0 / (x * x));
  };
  const double cross = 2.0 / (static_cast<double>(a.n) * static_cast<double>(a.m));
  return energy_pairs_run<T>(a, cross, -within(a.n), -within(a.m), value, ga, gc, gbeta, workspace, stream);
}

#define ET_INSTANTIATE(T)                                                                                         \
  template cudaError_t energy_distance_launch<T>(const EnergyArgs<T>&, bool, T*, T*, T*, T*, double*, cudaStream_t);
ET_INSTANTIATE(float)
ET_INSTANTIATE(double)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
