// CUDA kernels of etweedie::is_score_fwd: the self-normalized importance-sampling oracle
//   w_j ∝ exp(−(λ/β) q_j^{β/2}),  q_j = (y − x_j)ᵀP(y − x_j),
//   score = −λ Σ_j w_j q_j^{(β−2)/2} P(y − x_j),  mean = y − Σ_j w_j (y − x_j),  ESS = 1/Σ_j w_j²
// over a clean bank x_1..x_M for every query y, in one pass over the bank with an online
// log-sum-exp (running maximum log-weight; running sums rescaled when it grows).  The Q×M
// weight matrix never exists.  Math: csrc/common/et_score.h (gg_log_kernel, pow_pos).
//
// Two work splits:
//  * small d (≤ kSmallD, the 2-D experiments with a 160k-point bank): one thread per query,
//    the block's threads share bank tiles staged in shared memory (n-body style); all of a
//    query's state (y, two d-vectors, max, two sums) lives in registers.
//  * any d: one block per query; per bank tile one warp per point computes q (lanes over
//    coordinates, coalesced), the tile's maximum updates the running one, then the threads
//    stride over coordinates and accumulate Σ e r P u and Σ e u in shared memory.
#include "launchers.cuh"
#include "metric_cuda.cuh"

#include <cuda_runtime.h>

namespace etweedie {
namespace cuda {

constexpr int kSmallD = 8;
constexpr int kBankTile = 128;  // bank points per shared-memory tile (small-d kernel)
constexpr int kPointTile = 64;  // bank points per tile (general kernel; ≤ kThreads)

// ‖u‖^β (log-weight numerator) and ‖u‖^{β−2} (score weight) from q = ‖u‖²_P.
template <typename T>
__device__ __forceinline__ void gg_weights(T q, T beta, T& qb, T& r) {
  qb = pow_pos(q, T(0.5) * beta);
  r = q > T(0) ? qb / q : (beta == T(2) ? T(1) : T(0));
}

template <typename T, int KIND, int K>
__global__ void __launch_bounds__(kThreads) is_score_small_d_kernel(const T* __restrict__ y, const T* __restrict__ bank,
                                                                     const T* __restrict__ prec, int64_t Q, int64_t M,
                                                                     int d, T beta, T lam, T* __restrict__ score,
                                                                     T* __restrict__ mean, T* __restrict__ ess) {
  __shared__ T tile[kBankTile * kSmallD];
  const int64_t qi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = qi < Q;
  const RowPrec<T, KIND, K> P{prec};
  T yq[kSmallD], acc_r[kSmallD], acc_u[kSmallD], u[kSmallD];
#pragma unroll
  for (int j = 0; j < kSmallD; ++j) {
    yq[j] = (active && j < d) ? y[qi * d + j] : T(0);
    acc_r[j] = T(0);
    acc_u[j] = T(0);
  }
  T run_max = -INFINITY, sum_e = 0, sum_e2 = 0;
  const T lam_over_beta = lam / beta;
  for (int64_t m0 = 0; m0 < M; m0 += kBankTile) {
    const int n = static_cast<int>(M - m0 < kBankTile ? M - m0 : kBankTile);
    __syncthreads();
    for (int e = threadIdx.x; e < n * d; e += kThreads) tile[e] = bank[m0 * d + e];
    __syncthreads();
    if (!active) continue;
    for (int t = 0; t < n; ++t) {
      const T* xt = tile + t * d;
#pragma unroll
      for (int j = 0; j < kSmallD; ++j) u[j] = j < d ? yq[j] - xt[j] : T(0);
      T q = 0;
#pragma unroll
      for (int j = 0; j < kSmallD; ++j)
        if (j < d) q += u[j] * P.apply_at(j, [&u](int64_t c) { return u[c]; });
      T qb, r;
      gg_weights(q, beta, qb, r);
      const T logw = -lam_over_beta * qb;
      if (logw > run_max) {  // rebase the running sums on the new maximum
        const T scale = run_max == -INFINITY ? T(0) : fast_exp(run_max - logw);
        sum_e *= scale;
        sum_e2 *= scale * scale;
#pragma unroll
        for (int j = 0; j < kSmallD; ++j) {
          acc_r[j] *= scale;
          acc_u[j] *= scale;
        }
        run_max = logw;
      }
      const T e = fast_exp(logw - run_max);
      sum_e += e;
      sum_e2 += e * e;
      const T er = e * r;
#pragma unroll
      for (int j = 0; j < kSmallD; ++j) {
        if (j < d) acc_r[j] += er * P.apply_at(j, [&u](int64_t c) { return u[c]; });
        acc_u[j] += e * u[j];
      }
    }
  }
  if (!active) return;
  const T inv = T(1) / sum_e;
#pragma unroll
  for (int j = 0; j < kSmallD; ++j)
    if (j < d) {
      score[qi * d + j] = -lam * acc_r[j] * inv;
      mean[qi * d + j] = yq[j] - acc_u[j] * inv;
    }
  ess[qi] = sum_e * sum_e / sum_e2;
}

template <typename T, int KIND, int K>
__global__ void __launch_bounds__(kThreads) is_score_kernel(const T* __restrict__ y, const T* __restrict__ bank,
                                                             const T* __restrict__ prec, int64_t M, int64_t d, T beta,
                                                             T lam, T* __restrict__ score, T* __restrict__ mean,
                                                             T* __restrict__ ess) {
  ET_DYNAMIC_SHARED(smem_raw);
  T* acc_r = reinterpret_cast<T*>(smem_raw);  // d: Σ e r P u
  T* acc_u = acc_r + d;                        // d: Σ e u
  T* logw = acc_u + d;                         // kPointTile
  T* rt = logw + kPointTile;                   // kPointTile
  const int64_t qi = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const T* __restrict__ yq = y + qi * d;
  const RowPrec<T, KIND, K> P{prec};
  const T lam_over_beta = lam / beta;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) acc_r[j] = acc_u[j] = T(0);
  // Every thread keeps the same copy of the running max and sums (computed from shared values).
  T run_max = -INFINITY, sum_e = 0, sum_e2 = 0;
  for (int64_t m0 = 0; m0 < M; m0 += kPointTile) {
    const int n = static_cast<int>(M - m0 < kPointTile ? M - m0 : kPointTile);
    __syncthreads();
    for (int t = warp; t < n; t += kWarps) {
      const T* __restrict__ xt = bank + (m0 + t) * d;
      T q = 0;
      for (int64_t j = lane; j < d; j += kWarp)
        q += (yq[j] - xt[j]) * P.apply_at(j, [yq, xt](int64_t c) { return yq[c] - xt[c]; });
      q = warp_sum(q);
      if (lane == 0) {
        T qb, r;
        gg_weights(q, beta, qb, r);
        logw[t] = -lam_over_beta * qb;
        rt[t] = r;
      }
    }
    __syncthreads();
    T tile_max = -INFINITY;
    for (int t = 0; t < n; ++t) tile_max = logw[t] > tile_max ? logw[t] : tile_max;
    const T new_max = tile_max > run_max ? tile_max : run_max;
    const T scale = run_max == -INFINITY ? T(0) : fast_exp(run_max - new_max);
    run_max = new_max;
    __syncthreads();  // everyone has read the tile's log-weights
    T* et = logw;     // ... which become the rebased weights e_t = exp(logw_t − max)
    if (threadIdx.x < n) et[threadIdx.x] = fast_exp(logw[threadIdx.x] - run_max);
    __syncthreads();
    sum_e *= scale;
    sum_e2 *= scale * scale;
    for (int t = 0; t < n; ++t) {
      sum_e += et[t];
      sum_e2 += et[t] * et[t];
    }
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      T ar = acc_r[j] * scale, au = acc_u[j] * scale;
      for (int t = 0; t < n; ++t) {
        const T* __restrict__ xt = bank + (m0 + t) * d;
        ar += et[t] * rt[t] * P.apply_at(j, [yq, xt](int64_t c) { return yq[c] - xt[c]; });
        au += et[t] * (yq[j] - xt[j]);
      }
      acc_r[j] = ar;
      acc_u[j] = au;
    }
  }
  const T inv = T(1) / sum_e;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) {
    score[qi * d + j] = -lam * acc_r[j] * inv;
    mean[qi * d + j] = yq[j] - acc_u[j] * inv;
  }
  if (threadIdx.x == 0) ess[qi] = sum_e * sum_e / sum_e2;
}

template <typename T>
cudaError_t is_score_fwd_launch(const T* y, const T* bank, const T* prec, int64_t Q, int64_t M, int64_t d, T beta,
                                T lam, int kind, int kblock, T* score, T* mean, T* ess, cudaStream_t stream) {
  if (Q == 0 || d == 0) return cudaSuccess;
  if (M <= 0) return cudaErrorInvalidValue;
  return dispatch_metric(kind, kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    if (d <= kSmallD) {
      const unsigned blocks = static_cast<unsigned>((Q + kThreads - 1) / kThreads);
      return launch(is_score_small_d_kernel<T, KIND, K>, blocks, kThreads, 0, stream, y, bank, prec, Q, M,
                    static_cast<int>(d), beta, lam, score, mean, ess);
    }
    const size_t smem = static_cast<size_t>(2 * d + 2 * kPointTile) * sizeof(T);
    auto kernel = is_score_kernel<T, KIND, K>;
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    return launch(kernel, static_cast<unsigned>(Q), kThreads, smem, stream, y, bank, prec, M, d, beta, lam, score, mean,
                  ess);
  });
}

template cudaError_t is_score_fwd_launch<float>(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                                float, float, int, int, float*, float*, float*, cudaStream_t);
template cudaError_t is_score_fwd_launch<double>(const double*, const double*, const double*, int64_t, int64_t,
                                                 int64_t, double, double, int, int, double*, double*, double*,
                                                 cudaStream_t);

}  // namespace cuda
}  // namespace etweedie
