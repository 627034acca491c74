// CUDA kernels of the Energy-Tweedie score, shared by et_score_cuda.cu (score) and
// langevin_step_cuda.cu (score + Langevin update).  Math: csrc/common/et_score.h.
//
// Work split: one block of kThreads threads per query row (forward: per row and chunk of
// coordinates when there are too few rows to fill the GPU — each block then recomputes q over
// all of d and accumulates only its chunk, whose length is a multiple of the metric block k so
// that s = −λ P m stays local to the block).  The row's draws are processed in
// tiles of kTile: (1) one warp per draw computes q_i = u_iᵀPu_i with its lanes striding over
// the coordinates (coalesced reads of x_i) and a shuffle reduction, and stores the draw's
// weight in shared memory; (2) the threads then stride over the coordinates and accumulate
// Σ_t w_t u_t[j] into a shared-memory row accumulator (coalesced again).  Each draw is read
// twice from global memory, the second time mostly from L1/L2; nothing of size N·d is
// written.  Shared memory: d + kTile values.  Forward and backward follow the same pattern.
// Draws stored in 16 bits (X = bf16 / fp16, csrc/common/low_precision.h) are read as stored —
// a warp's lanes load consecutive 2-byte values, 64 contiguous bytes per warp load — and
// widened to T in registers; all sums are in T.
// Indexing is int64 (row · stride products can exceed 2³¹).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

#include "launchers.cuh"
#include "metric_cuda.cuh"

namespace etweedie {
namespace cuda {

constexpr int kTile = 64;        // draws per tile (weights staged in shared memory)
constexpr int64_t kMinChunk = 128;  // fewest coordinates per block when a row is split
constexpr int kMinBlocks = 4;       // resident blocks per SM asked of ptxas (register cap 128)

// __launch_bounds__(kThreads, kMinBlocks): without a minimum-blocks hint ptxas (CUDA 13, sm_80)
// capped these kernels at 40–72 registers and spilled; asking for 4 resident blocks allows up
// to 128 registers, removes the spills (benchmarks/ptxas_report.txt) and still keeps 16 warps
// per SM in flight.
template <typename T, typename X, int KIND, int K, bool LANGEVIN>
__global__ void __launch_bounds__(kThreads, kMinBlocks) et_score_fwd_kernel(EtScoreArgs<T, X> a, int64_t chunk, T* __restrict__ out,
                                                                 T* __restrict__ m_out, int64_t n_per,
                                                                 T* __restrict__ ws) {
  ET_DYNAMIC_SHARED(smem_raw);
  const int64_t row = blockIdx.x, d = a.d, N = a.N;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * chunk;  // this block's coordinates [j0, j1)
  const int64_t j1 = j0 + chunk < d ? j0 + chunk : d;
  T* acc = reinterpret_cast<T*>(smem_raw);  // acc[j − j0] for j in [j0, j1): Σ w u, then m
  T* wt = acc + chunk;                       // kTile weights
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const T* __restrict__ y = a.y + row * d;
  const X* __restrict__ x = a.x + row * a.sxb;  // 16-bit draws: widened to T where loaded
  const RowPrec<T, KIND, K> P{a.prec + row * a.sp};
  const T beta = a.beta[row * a.sb], lam = a.lam[row * a.sl];
  // draws [n_lo, n_hi): all of them, or this block's range when the draws are split (ws != null)
  const int64_t n_lo = static_cast<int64_t>(blockIdx.z) * n_per;
  const int64_t n_hi = n_lo + n_per < N ? n_lo + n_per : N;
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) acc[j - j0] = T(0);
  for (int64_t i0 = n_lo; i0 < n_hi; i0 += kTile) {
    const int n = static_cast<int>(n_hi - i0 < kTile ? n_hi - i0 : kTile);
    __syncthreads();  // the previous tile's weights are consumed
    for (int t = warp; t < n; t += kWarps) {
      const X* __restrict__ xi = x + (i0 + t) * a.sxn;
      T q = 0;
      for (int64_t j = lane; j < d; j += kWarp)
        q += (y[j] - widen<T>(xi[j])) * P.apply_at(j, [y, xi](int64_t c) { return y[c] - widen<T>(xi[c]); });
      q = warp_sum(q);
      if (lane == 0) wt[t] = residual_weight(q, beta);
    }
    __syncthreads();
    for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
      const T yj = y[j];
      T s = 0;
#pragma unroll 4
      for (int t = 0; t < n; ++t) s += wt[t] * (yj - widen<T>(x[(i0 + t) * a.sxn + j]));
      acc[j - j0] += s;
    }
  }
  if (ws != nullptr) {  // split draws: this range's Σ w u for the chunk; the finalize kernel adds
    T* __restrict__ part = ws + (row * gridDim.z + blockIdx.z) * d;
    for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) part[j] = acc[j - j0];
    return;
  }
  const T inv_n = T(1) / static_cast<T>(N);
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    acc[j - j0] *= inv_n;
    m_out[row * d + j] = acc[j - j0];
  }
  __syncthreads();  // s needs m at the other coordinates of j's block
  T alpha = 0, diffusion = 0;
  if (LANGEVIN) {
    alpha = a.step[row * a.sa];
    diffusion = sqrt(T(2) * alpha);
  }
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    const T s = -lam * P.apply_at(j, [acc, j0](int64_t c) { return acc[c - j0]; });  // j's block ⊂ [j0, j1)
    out[row * d + j] = LANGEVIN ? y[j] + alpha * s + diffusion * a.noise[row * d + j] : s;
  }
}

// Finalize of the split-draw forward: m = (1/N) Σ_r ws[row, r], then s = −λ P m (and the
// Langevin update), one block per row.  P m at j needs m on j's metric block, summed from ws
// directly (nsplit·k loads of a small, L2-resident buffer).
template <typename T, typename X, int KIND, int K, bool LANGEVIN>
__global__ void __launch_bounds__(kThreads, kMinBlocks) et_score_fwd_finalize_kernel(EtScoreArgs<T, X> a, int64_t nsplit,
                                                                         const T* __restrict__ ws,
                                                                         T* __restrict__ out, T* __restrict__ m_out) {
  const int64_t row = blockIdx.x, d = a.d;
  const T inv_n = T(1) / static_cast<T>(a.N);
  const T* __restrict__ part = ws + row * nsplit * d;
  const RowPrec<T, KIND, K> P{a.prec + row * a.sp};
  const T lam = a.lam[row * a.sl];
  auto mean = [part, nsplit, d, inv_n](int64_t c) {
    T acc = 0;
    for (int64_t r = 0; r < nsplit; ++r) acc += part[r * d + c];
    return acc * inv_n;
  };
  T alpha = 0, diffusion = 0;
  if (LANGEVIN) {
    alpha = a.step[row * a.sa];
    diffusion = sqrt(T(2) * alpha);
  }
  for (int64_t j = threadIdx.x; j < d; j += kThreads) {
    m_out[row * d + j] = mean(j);
    const T s = -lam * P.apply_at(j, mean);
    out[row * d + j] = LANGEVIN ? a.y[row * d + j] + alpha * s + diffusion * a.noise[row * d + j] : s;
  }
}

// Draw ranges per row so that B·S blocks give every SM one block; 1 = no split.  Measured on an
// H200 (benchmarks/RESULTS.md, 2026-11-26): aiming at kMinBlocks blocks per SM made B = 256,
// d = 784 slower (0.65 vs 0.43 ms), so only rows too few for one block per SM are split.
// ETWEEDIE_CUDA_SPLIT=0 in the environment turns the split off (A/B timing, bisecting).
inline int64_t draw_splits(int64_t B, int64_t N, int sms) {
  const char* flag = std::getenv("ETWEEDIE_CUDA_SPLIT");  // read per launch: A/B timing in one process
  const bool enabled = flag == nullptr || flag[0] != '0';
  constexpr int64_t kMinDraws = 16;  // fewest draws per range
  if (!enabled || B <= 0) return 1;
  const int64_t slots = sms;
  if (B >= slots) return 1;
  const int64_t want = (slots + B - 1) / B, most = (N + kMinDraws - 1) / kMinDraws;
  return want < most ? want : most;
}

template <typename T, typename X, bool LANGEVIN>
cudaError_t et_score_fwd_dispatch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0) return cudaErrorInvalidValue;
  // Coordinate chunks: enough blocks for ~2 per SM when rows are few and d is large.
  int device = 0, sms = 1;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t k = a.kind == kBlock ? a.kblock : 1;
  int64_t nsplit = draw_splits(a.B, a.N, sms), n_per = a.N;
  if (nsplit > 1) {
    n_per = (a.N + nsplit - 1) / nsplit;
    nsplit = (a.N + n_per - 1) / n_per;  // no empty range
  }
  if (nsplit > 65535) return cudaErrorInvalidConfiguration;
  int64_t nch = 1;
  if (nsplit == 1 && a.d > 2 * kMinChunk && a.B < 2 * sms) {
    const int64_t want = (2 * sms + a.B - 1) / a.B, most = a.d / kMinChunk;
    nch = want < most ? want : most;
  }
  int64_t chunk = (a.d + nch - 1) / nch;
  chunk = (chunk + k - 1) / k * k;  // whole metric blocks per chunk
  nch = (a.d + chunk - 1) / chunk;
  if (nch > 65535) return cudaErrorInvalidConfiguration;
  const size_t smem = static_cast<size_t>(chunk + kTile) * sizeof(T);
  return dispatch_metric(a.kind, a.kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    auto kernel = et_score_fwd_kernel<T, X, KIND, K, LANGEVIN>;
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    T* ws = nullptr;  // (B, nsplit, d) partial sums, stream-ordered (no device-wide sync)
    if (nsplit > 1) {
      const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&ws),
                                            static_cast<size_t>(a.B * nsplit * a.d) * sizeof(T), stream);
      if (e != cudaSuccess) return e;
    }
    const dim3 grid(static_cast<unsigned>(a.B), static_cast<unsigned>(nch), static_cast<unsigned>(nsplit));
    cudaError_t e = launch(kernel, grid, kThreads, smem, stream, a, chunk, out, m, n_per, ws);
    if (nsplit > 1) {
      if (e == cudaSuccess) {
        e = launch(et_score_fwd_finalize_kernel<T, X, KIND, K, LANGEVIN>, static_cast<unsigned>(a.B), kThreads, 0,
                   stream, a, nsplit, ws, out, m);
      }
      const cudaError_t f = cudaFreeAsync(ws, stream);
      if (e == cudaSuccess) e = f;
    }
    return e;
  });
}

}  // namespace cuda
}  // namespace etweedie
