// CUDA kernels of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp);
// the forward kernel lives in et_score_cuda.cuh (shared with langevin_step_cuda.cu).
//
// Backward, one block per row (same tiling as the forward):
//   h = −λ P g + g_m                                    (shared memory, d values)
//   per tile, one warp per draw: q_i, h·u_i (and, for the metric gradient, Σ u u over the
//   parameter's pattern) → w_i, c_i = slope_i (h·u_i) staged in shared memory;
//   then the threads stride over coordinates: ∂L/∂u_i[j] = (w_i h_j + c_i (P u_i)_j)/N,
//   summed into ∂L/∂y[j] (shared memory) and written negated to ∂L/∂x_i[j] when requested.
//   ∂L/∂β = (1/N) Σ (h·u_i) w_i ½ ln q_i and the metric gradient's per-draw part are kept in
//   lane 0 of each warp and reduced over the block at the end, with the −λ g mᵀ term and
//   ∂L/∂λ = −g·Pm.  Every output element is written exactly once: no atomics, no memset.
// Shared memory: 2d (+ d for a diagonal metric's gradient) + 2·kTile values.
#include "et_score_cuda.cuh"

namespace etweedie {
namespace cuda {

template <typename T, typename X, int KIND, int K>
__global__ void __launch_bounds__(kThreads, kMinBlocks) et_score_bwd_kernel(EtScoreArgs<T, X> a, const T* __restrict__ grad,
                                                                 const T* __restrict__ grad_m, const T* __restrict__ m,
                                                                 T* __restrict__ gy, X* __restrict__ gx,
                                                                 T* __restrict__ gb, T* __restrict__ gl,
                                                                 T* __restrict__ gp) {
  constexpr int PS = KIND == kBlock ? K * K : 1;  // metric-gradient entries kept per warp
  ET_DYNAMIC_SHARED(smem_raw);
  const int64_t row = blockIdx.x, d = a.d, N = a.N;
  T* h = reinterpret_cast<T*>(smem_raw);  // d
  T* gacc = h + d;                         // d: ∂L/∂y
  T* gdiag = gacc + d;                     // d (diagonal metric gradient) or 0
  T* wt = gdiag + (KIND == kDiagonal && gp ? d : 0);
  T* ct = wt + kTile;
  __shared__ T scratch[kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const T* __restrict__ y = a.y + row * d;
  const X* __restrict__ x = a.x + row * a.sxb;
  const T* __restrict__ g = grad + row * d;
  const T* __restrict__ mr = m + row * d;
  const RowPrec<T, KIND, K> P{a.prec + row * a.sp};
  const T beta = a.beta[row * a.sb], lam = a.lam[row * a.sl];
  const T inv_n = T(1) / static_cast<T>(N);
  const bool need_prec = gp != nullptr;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) {
    h[j] = -lam * P.apply_at(j, [g](int64_t c) { return g[c]; }) + grad_m[row * d + j];
    gacc[j] = T(0);
    if (KIND == kDiagonal && need_prec) gdiag[j] = T(0);
  }
  T gbeta = 0;      // lane 0 of each warp: Σ over its draws
  T gpw[PS] = {};   // lane 0 of each warp: Σ ½ c_i/N · (u uᵀ reduced to the parameter)
  for (int64_t i0 = 0; i0 < N; i0 += kTile) {
    const int n = static_cast<int>(N - i0 < kTile ? N - i0 : kTile);
    __syncthreads();  // h is ready / the previous tile's w, c are consumed
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
          // compile-time indices keep uu in registers (a runtime index would put it in local memory)
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
      const T w = residual_weight(q, beta);
      const T c = residual_weight_slope(q, w, beta) * hu;
      if (need_prec && KIND != kDiagonal) {
#pragma unroll
        for (int e = 0; e < PS; ++e) uu[e] = warp_sum(uu[e]);
      }
      if (lane == 0) {
        wt[t] = w;
        ct[t] = c;
        if (gb) gbeta += hu * w * half_log(q);
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
  if (gb) {
    const T total = block_sum(lane == 0 ? gbeta : T(0), scratch);
    if (threadIdx.x == 0) gb[row] = total * inv_n;
  }
  if (gl) {
    T part = 0;  // ∂L/∂λ = g·s/λ = −g·Pm
    for (int64_t j = threadIdx.x; j < d; j += kThreads) part += g[j] * P.apply_at(j, [mr](int64_t c) { return mr[c]; });
    const T total = block_sum(part, scratch);
    if (threadIdx.x == 0) gl[row] = -total;
  }
  if (need_prec) {
    // + −λ g mᵀ reduced to the parameter's shape
    if (KIND == kDiagonal) {
      for (int64_t j = threadIdx.x; j < d; j += kThreads) gp[row * d + j] = gdiag[j] - lam * g[j] * mr[j];
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
        const T total = block_sum((lane == 0 ? gpw[e] : T(0)) - lam * part[e], scratch);
        if (threadIdx.x == 0) gp[row * PS + e] = total;
      }
    }
  }
}

template <typename T, typename X>
cudaError_t et_score_fwd_launch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream) {
  return et_score_fwd_dispatch<T, X, false>(a, out, m, stream);
}

template <typename T, typename X>
cudaError_t et_score_bwd_launch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy, X* gx,
                                T* gb, T* gl, T* gp, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0) return cudaErrorInvalidValue;
  const int64_t diag = (a.kind == kDiagonal && gp) ? a.d : 0;
  const size_t smem = static_cast<size_t>(2 * a.d + diag + 2 * kTile) * sizeof(T);
  return dispatch_metric(a.kind, a.kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    auto kernel = et_score_bwd_kernel<T, X, KIND, K>;
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    return launch(kernel, static_cast<unsigned>(a.B), kThreads, smem, stream, a, grad, grad_m, m, gy, gx, gb, gl, gp);
  });
}

// X: the draws' storage (T itself, or 16-bit draws widened to T where loaded).
#define ET_INSTANTIATE(T, X)                                                                                    \
  template cudaError_t et_score_fwd_launch<T, X>(const EtScoreArgs<T, X>&, T*, T*, cudaStream_t);              \
  template cudaError_t et_score_bwd_launch<T, X>(const EtScoreArgs<T, X>&, const T*, const T*, const T*, T*, X*, \
                                                 T*, T*, T*, cudaStream_t);
ET_INSTANTIATE(float, float)
ET_INSTANTIATE(float, bf16)
ET_INSTANTIATE(float, fp16)
ET_INSTANTIATE(double, double)
ET_INSTANTIATE(double, bf16)
ET_INSTANTIATE(double, fp16)
#undef ET_INSTANTIATE

}  // namespace cuda
}  // namespace etweedie
