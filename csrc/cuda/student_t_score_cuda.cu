// CUDA kernels of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp; math in csrc/common/student_t_score.h).
//
//   s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)
//
// Forward: the Energy-Tweedie score's forward kernels (et_score_cuda.cuh) with the Student-t
// weight (LAW = kLawStudentT).  Backward, the same work split as et_score's backward: one block of
// kThreads threads per query row; the row's draws in tiles of kStTile: (1) one warp per draw
// computes q_i and h·u_i with lanes striding over coordinates (coalesced reads) and a shuffle
// reduction, and stages the draw's coefficients in shared memory; (2) the threads stride over
// coordinates and accumulate ∂L/∂u_t, summed into ∂L/∂y and written negated to ∂L/∂x.  Nothing
// of size N·d is written except ∂L/∂x.  Shared memory: 2d (+ d for a diagonal metric's gradient)
// + 2·kStTile.  Every output element is written exactly once: no atomics, no memset.
// Indexing is int64.
#include <cuda_runtime.h>

#include "../common/student_t_score.h"
#include "et_score_cuda.cuh"
#include "metric_cuda.cuh"
#include "student_t_score_launch.cuh"

namespace etweedie {
namespace cuda {

constexpr int kStTile = 64;
constexpr int kStMinBlocks = 4;

template <typename T, typename X, int KIND, int K>
__global__ void __launch_bounds__(kThreads, kStMinBlocks)
    student_t_bwd_kernel(StudentTArgs<T, X> a, const T* __restrict__ grad, const T* __restrict__ grad_m,
                         const T* __restrict__ m, T* __restrict__ gy, X* __restrict__ gx, T* __restrict__ gc,
                         T* __restrict__ gp) {
  constexpr int PS = KIND == kBlock ? K * K : 1;
  ET_DYNAMIC_SHARED(smem_raw);
  const int64_t row = blockIdx.x, d = a.d, N = a.N;
  T* h = reinterpret_cast<T*>(smem_raw);  // d
  T* gacc = h + d;                         // d: ∂L/∂y
  T* gdiag = gacc + d;                     // d (diagonal metric gradient) or 0
  T* wt = gdiag + (KIND == kDiagonal && gp ? d : 0);
  T* ct = wt + kStTile;
  __shared__ T scratch[kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const T* __restrict__ y = a.y + row * d;
  const X* __restrict__ x = a.x + row * a.sxb;
  const T* __restrict__ g = grad + row * d;
  const T* __restrict__ mr = m + row * d;
  const RowPrec<T, KIND, K> P{a.prec + row * a.sp};
  const T two_c = T(2) * a.c[row * a.sc];
  const T inv_n = T(1) / static_cast<T>(N);
  const bool need_prec = gp != nullptr;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) {
    h[j] = -two_c * P.apply_at(j, [g](int64_t c) { return g[c]; }) + grad_m[row * d + j];
    gacc[j] = T(0);
    if (KIND == kDiagonal && need_prec) gdiag[j] = T(0);
  }
  T gpw[PS] = {};  // lane 0 of each warp: Σ ½ c_i/N · (u uᵀ reduced to the parameter)
  for (int64_t i0 = 0; i0 < N; i0 += kStTile) {
    const int n = static_cast<int>(N - i0 < kStTile ? N - i0 : kStTile);
    __syncthreads();
    for (int t = warp; t < n; t += kWarps) {
      const X* __restrict__ xi = x + (i0 + t) * a.sxn;
      T q = 0, hu = 0;
      T uu[PS] = {};
      for (int64_t j = lane; j < d; j += kWarp) {
        const T u = y[j] - widen<T>(xi[j]);
        q += u * P.apply_at(j, [y, xi](int64_t c) { return y[c] - widen<T>(xi[c]); });
        hu += h[j] * u;
        if (need_prec && KIND == kIsotropic) uu[0] += u * u;
        if (need_prec && KIND == kBlock) {
          const int ai = static_cast<int>(j % K);
          const int64_t base = j - ai;
#pragma unroll
          for (int aa = 0; aa < K; ++aa)
            if (aa == ai) {
#pragma unroll
              for (int b = 0; b < K; ++b) uu[aa * K + b] += u * (y[base + b] - widen<T>(xi[base + b]));
            }
        }
      }
      q = warp_sum(q);
      hu = warp_sum(hu);
      const T w = student_t_weight(q);
      const T c = student_t_weight_slope(w) * hu;
      if (need_prec && KIND != kDiagonal) {
#pragma unroll
        for (int e = 0; e < PS; ++e) uu[e] = warp_sum(uu[e]);
      }
      if (lane == 0) {
        wt[t] = w;
        ct[t] = c;
        if (need_prec && KIND != kDiagonal) {
#pragma unroll
          for (int e = 0; e < PS; ++e) gpw[e] += T(0.5) * c * inv_n * uu[e];
        }
      }
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      const T hj = h[j];
      T sum = 0, sdiag = 0;
#pragma unroll 2
      for (int t = 0; t < n; ++t) {
        const X* __restrict__ xt = x + (i0 + t) * a.sxn;
        const T pu = P.apply_at(j, [y, xt](int64_t c) { return y[c] - widen<T>(xt[c]); });
        const T gu = (wt[t] * hj + ct[t] * pu) * inv_n;
        sum += gu;
        if (gx) gx[(row * N + i0 + t) * d + j] = narrow<X>(-gu);  // x's type: rounded once
        if (KIND == kDiagonal && need_prec) {
          const T u = y[j] - widen<T>(xt[j]);
          sdiag += T(0.5) * ct[t] * inv_n * u * u;
        }
      }
      gacc[j] += sum;
      if (KIND == kDiagonal && need_prec) gdiag[j] += sdiag;
    }
  }
  __syncthreads();
  if (gy)
    for (int64_t j = threadIdx.x; j < d; j += kThreads) gy[row * d + j] = gacc[j];
  if (gc) {
    T part = 0;  // ∂L/∂c = g·s/c = −2 g·Pm
    for (int64_t j = threadIdx.x; j < d; j += kThreads) part += g[j] * P.apply_at(j, [mr](int64_t c) { return mr[c]; });
    const T total = block_sum(part, scratch);
    if (threadIdx.x == 0) gc[row] = T(-2) * total;
  }
  if (need_prec) {
    if (KIND == kDiagonal) {
      for (int64_t j = threadIdx.x; j < d; j += kThreads) gp[row * d + j] = gdiag[j] - two_c * g[j] * mr[j];
    } else {
      T part[PS] = {};
      for (int64_t j = threadIdx.x; j < d; j += kThreads) {
        if (KIND == kIsotropic) {
          part[0] += g[j] * mr[j];
        } else {
          const int ai = static_cast<int>(j % K);
          const int64_t base = j - ai;
#pragma unroll
          for (int aa = 0; aa < K; ++aa)
            if (aa == ai) {
#pragma unroll
              for (int b = 0; b < K; ++b) part[aa * K + b] += g[j] * mr[base + b];
            }
        }
      }
#pragma unroll
      for (int e = 0; e < PS; ++e) {
        const T total = block_sum((lane == 0 ? gpw[e] : T(0)) - two_c * part[e], scratch);
        if (threadIdx.x == 0) gp[row * PS + e] = total;
      }
    }
  }
}

template <typename Kernel>
cudaError_t student_t_allow_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

// The forward is the Energy-Tweedie score's (et_score_cuda.cuh: packet or tiled kernel, draw
// split for few rows, out-of-range rows flagged) with the Student-t weight and −2c in place of −λ.
template <typename T, typename X>
cudaError_t student_t_score_fwd_launch(const StudentTArgs<T, X>& a, T* s, T* m, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0 || a.B > 2147483647) return cudaErrorInvalidValue;
  EtScoreArgs<T, X> e{};
  e.y = a.y;
  e.x = a.x;
  e.beta = a.c;  // unused by the Student-t weight
  e.lam = a.c;   // the scale −2c (law_scale)
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
  return et_score_fwd_dispatch<T, X, false, kLawStudentT>(e, s, m, stream);
}

template <typename T, typename X>
cudaError_t student_t_score_bwd_launch(const StudentTArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy,
                                       X* gx, T* gc, T* gp, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0 || a.B > 2147483647) return cudaErrorInvalidValue;
  const int64_t diag = (a.kind == kDiagonal && gp) ? a.d : 0;
  const size_t smem = static_cast<size_t>(2 * a.d + diag + 2 * kStTile) * sizeof(T);
  return dispatch_metric(a.kind, a.kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    auto kernel = student_t_bwd_kernel<T, X, KIND, K>;
    const cudaError_t e = student_t_allow_smem(kernel, smem);
    if (e != cudaSuccess) return e;
    return launch(kernel, static_cast<unsigned>(a.B), kThreads, smem, stream, a, grad, grad_m, m, gy, gx, gc, gp);
  });
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
