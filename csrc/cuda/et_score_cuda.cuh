// Forward kernels of the Energy-Tweedie score, shared by et_score_cuda.cu (score),
// langevin_step_cuda.cu (score + Langevin update) and student_t_score_cuda.cu (the Student-t
// score: the same sums with another weight, LAW below).  Math: csrc/common/et_score.h.
//
// Two forward kernels; et_score_fwd_dispatch picks one per call:
//   - the packet kernel (et_score_fwd_packet_kernel, below): one pass over the draws in 16-byte
//     loads, each draw held in registers for both of its uses.  Used wherever a row fits it (d a
//     multiple of the packet and at most 256 packets, or short rows of at most 32 metric blocks).
//   - the tiled kernel (et_score_fwd_kernel), for the other rows (long rows that are not a
//     multiple of the packet, d over 1024 float32 values):
// Work split of the tiled kernel: one block of kThreads threads per query row (forward: per row and chunk of
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

#include "../common/student_t_score.h"
#include "launchers.cuh"
#include "metric_cuda.cuh"

namespace etweedie {
namespace cuda {

// The score the forward kernels compute (LAW): the Energy-Tweedie score s = −λ P (1/N) Σ w u with
// w = q^{(β−2)/2} (et_score, langevin_step), or the Student-t score s = −2c P (1/N) Σ w u with
// w = 1/(1 + q) (student_t_score: c passed as λ, β unused; csrc/common/student_t_score.h).
enum : int { kLawEnergyTweedie = 0, kLawStudentT = 1 };

template <int LAW, typename T>
__device__ __forceinline__ T law_weight(T q, T beta) {
  if constexpr (LAW == kLawStudentT) {
    return student_t_weight(q);
  } else {
    return residual_weight(q, beta);
  }
}

// The factor in front of P m: −λ, or −2c.
template <int LAW, typename T>
__device__ __forceinline__ T law_scale(T lam) {
  return LAW == kLawStudentT ? T(-2) * lam : -lam;
}

// d w / d q · (1/w) as the backward uses it: residual_weight_slope, or student_t_weight_slope.
template <int LAW, typename T>
__device__ __forceinline__ T law_weight_slope(T q, T w, T beta) {
  if constexpr (LAW == kLawStudentT) {
    return student_t_weight_slope(w);
  } else {
    return residual_weight_slope(q, w, beta);
  }
}

// d law_scale / d λ: −1, or −2.
template <int LAW, typename T>
__device__ __forceinline__ constexpr T law_dscale() {
  return LAW == kLawStudentT ? T(-2) : T(-1);
}

constexpr int kTile = 64;        // draws per tile (weights staged in shared memory)
constexpr int64_t kMinChunk = 128;  // fewest coordinates per block when a row is split
constexpr int kMinBlocks = 4;       // resident blocks per SM asked of ptxas (register cap 128)

// __launch_bounds__(kThreads, kMinBlocks): without a minimum-blocks hint ptxas (CUDA 13, sm_80)
// capped these kernels at 40–72 registers and spilled; asking for 4 resident blocks allows up
// to 128 registers, removes the spills (benchmarks/ptxas_report.txt) and still keeps 16 warps
// per SM in flight.
template <typename T, typename X, int KIND, int K, bool LANGEVIN, int LAW>
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
  __shared__ int row_flag;  // a draw of the row is out of range (q_in_range, not y itself): NaN outputs
  if (threadIdx.x == 0) row_flag = 0;
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
      if (!q_in_range<LAW>(q)) {  // out of range unless the draw is y itself (each lane checks its coordinates)
        bool differs = q != T(0);
        for (int64_t j = lane; !differs && j < d; j += kWarp) differs = y[j] != widen<T>(xi[j]);
        if (differs) row_flag = 1;
      }
      if (lane == 0) wt[t] = law_weight<LAW>(q, beta);
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
  // every write of row_flag precedes the __syncthreads after its tile's q phase
  const bool flagged = row_flag != 0;
  if (ws != nullptr) {  // split draws: this range's Σ w u for the chunk; the finalize kernel adds
    T* __restrict__ part = ws + (row * gridDim.z + blockIdx.z) * d;
    for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) part[j] = flagged ? flagged_value<T>() : acc[j - j0];
    return;
  }
  const T inv_n = T(1) / static_cast<T>(N);
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    acc[j - j0] = flagged ? flagged_value<T>() : acc[j - j0] * inv_n;
    m_out[row * d + j] = acc[j - j0];
  }
  __syncthreads();  // s needs m at the other coordinates of j's block
  T alpha = 0, diffusion = 0;
  if (LANGEVIN) {
    alpha = a.step[row * a.sa];
    diffusion = sqrt(T(2) * alpha);
  }
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    const T s = law_scale<LAW>(lam) * P.apply_at(j, [acc, j0](int64_t c) { return acc[c - j0]; });  // j's block ⊂ [j0, j1)
    out[row * d + j] = LANGEVIN ? y[j] + alpha * s + diffusion * a.noise[row * d + j] : s;
  }
}

// ---------------------------------------------------------------------------- single-pass forward
//
// The "packet" forward: each draw is read from global memory exactly once, in packets of E
// consecutive values (16-byte vector loads for the wide kernel: 4 floats, 2 doubles or 8 16-bit
// values), and kept in registers for both of its uses — q = uᵀPu and the weighted sum Σ w u.
//   - A warp's lanes form groups of L lanes (L a power of two, 32 for rows of 32 packets or
//     more); a group holds one draw, lane l of the group owning the packets l, l + L, …
//     (nv ≤ VMAX of them), so a warp works on 32/L draws at once and the loads of a draw are
//     contiguous across the group's lanes.  q is summed over the group's lanes by shuffles.
//   - The metric block (K ≤ 4, K | E) lies inside one packet, so P u is applied in registers from
//     the K×K entries held by every thread: no gathers, no shared memory in the draw loop.
//   - Each lane accumulates Σ w u for its packets in registers; at the end the groups of a warp
//     are summed by shuffles and the warps of the block through shared memory (warps × d
//     values), in a fixed order (deterministic), then m = Σ/N and s = −λ P m.
//   - One block per row (and per draw range when rows are fewer than SMs, the split of
//     draw_splits with the same finalize kernel); the block's warps (1–8) are chosen by shape:
//     enough warps in all to fill the GPU, no more warps than a row's draws keep busy.
// WIDE: E = 16 bytes of X and VMAX = 8 (rows up to 256 packets: d ≤ 1024 float32 / 2048 16-bit
// / 512 float64 values), or E = the metric block (1 for isotropic and diagonal metrics) and
// VMAX = 1 (rows of at most 32 packets, d not a multiple of the 16-byte packet: the tiny-d case).
// The launcher checks the alignment a vector packet needs (x, and its strides, multiples of the
// packet's bytes) and otherwise uses et_score_fwd_kernel above.
// VMAX: as many packets per lane as keep the sums and the draw's raw packets within 64 (float32
// query) or 48 (float64) of the 128 registers a thread gets at two 256-thread blocks per SM (y is
// read from shared memory; ptxas reports no spills, benchmarks/ptxas_report.txt): 8 for float32
// draws (d up to 1024), 4 for 16-bit draws of a float32 query (d ≤ 1024; two draws' raw packets,
// PREFETCH below), 6 for float64 draws (d ≤ 384), 2 for 16-bit draws of a float64 query (d ≤ 512).
// PREFETCH (the wide kernel with 16-bit draws): the next draw's packets are loaded before the
// current draw's reductions, so that a warp keeps two draws' bytes in flight.  At d = 784 a warp
// holds one draw per iteration (32 lanes: 98 packets of 8 values), so a 16-bit draw alone puts
// 1,568 bytes in flight per warp against a float32 draw's 3,136: measured on an H100, the 16-bit
// kernel took 126 µs against float32's 87 µs at 256 × 256 × 784 (half the bytes, latency-bound).
// The second set of raw packets counts in the register budget (VMAX 4 instead of 5).
template <typename T, typename X, int KIND, int K, bool WIDE>
struct PacketShape {
  static constexpr int E = WIDE ? 16 / static_cast<int>(sizeof(X)) : (KIND == kBlock ? K : 1);
  static constexpr bool PREFETCH = WIDE && sizeof(X) == 2;
  static constexpr int kRegsPerPacket = E * static_cast<int>(sizeof(T) + (PREFETCH ? 2 : 1) * sizeof(X)) / 4;
  static constexpr int kRegs = sizeof(T) == 4 ? 64 : 48;
  static constexpr int VMAX = WIDE ? (kRegs / kRegsPerPacket > 1 ? kRegs / kRegsPerPacket : 1) : 1;
  // the wide packet must hold whole metric blocks
  static constexpr bool kFits = !WIDE || KIND != kBlock || E % K == 0;
};

constexpr int kPacketMaxWarps = 8;

// uᵀPu over one packet (coordinates j0 … j0 + E − 1); the isotropic p is applied by the caller.
template <typename T, int KIND, int K, int E>
__device__ __forceinline__ T packet_quad(const T (&u)[E], const T* __restrict__ pdiag, const T (&pk)[K * K], int64_t j0) {
  T q = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (KIND == kIsotropic) {
      q += u[e] * u[e];
    } else if (KIND == kDiagonal) {
      q += pdiag[j0 + e] * u[e] * u[e];
    } else {
      const int ai = e % K, base = e - ai;
      T pu = 0;
#pragma unroll
      for (int b = 0; b < K; ++b) pu += pk[ai * K + b] * u[base + b];
      q += u[e] * pu;
    }
  }
  return q;
}

template <typename T, typename X, int KIND, int K, bool LANGEVIN, int LAW, bool WIDE>
__global__ void __launch_bounds__(kPacketMaxWarps * kWarp, WIDE || sizeof(T) == 8 ? 2 : 4)
    et_score_fwd_packet_kernel(EtScoreArgs<T, X> a, int lanes, int nv, T* __restrict__ out, T* __restrict__ m_out,
                               int64_t n_per, T* __restrict__ ws) {
  constexpr int E = PacketShape<T, X, KIND, K, WIDE>::E, VMAX = PacketShape<T, X, KIND, K, WIDE>::VMAX;
  constexpr bool PREFETCH = PacketShape<T, X, KIND, K, WIDE>::PREFETCH;
  constexpr int KK = KIND == kBlock ? K : 1;
  ET_DYNAMIC_SHARED(smem_raw);
  T* part = reinterpret_cast<T*>(smem_raw);  // [warps][d]: each warp's Σ w u
  T* ys = part + static_cast<int64_t>(blockDim.x / kWarp) * a.d;  // [d]: the query row
  const int64_t row = blockIdx.x, d = a.d, N = a.N, packets = d / E;
  const int warps = static_cast<int>(blockDim.x) / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int L = lanes, l = lane % L;
  const int group = warp * (kWarp / L) + lane / L, groups = warps * (kWarp / L);
  const T* __restrict__ y = a.y + row * d;
  const X* __restrict__ x = a.x + row * a.sxb;
  const T* __restrict__ prec = a.prec + row * a.sp;
  T pk[KK * KK];
#pragma unroll
  for (int e = 0; e < KK * KK; ++e) pk[e] = KIND == kBlock ? prec[e] : T(0);
  const T piso = KIND == kIsotropic ? prec[0] : T(1);
  const T beta = a.beta[row * a.sb], lam = a.lam[row * a.sl];
  __shared__ int row_flag;  // a draw of the row is out of range: NaN outputs
  if (threadIdx.x == 0) row_flag = 0;
  bool out_of_range = false;  // this lane's share of the check
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ys[j] = y[j];
  T acc[VMAX][E];
#pragma unroll
  for (int v = 0; v < VMAX; ++v)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[v][e] = T(0);
  __syncthreads();  // ys is written
  // f(v, p, y's packet p) for the lane's packets on the row (v: a compile-time index after unrolling)
  auto on_packets = [&](auto&& f) {
#pragma unroll
    for (int v = 0; v < VMAX; ++v) {
      const int64_t p = l + static_cast<int64_t>(L) * v;
      if (v < nv && p < packets) f(v, p, load_packet<T, E>(ys + p * E));
    }
  };
  // draws [n_lo, n_hi): all of them, or this block's range when the draws are split (ws != null);
  // every lane runs the same number of iterations (the shuffles need the whole warp)
  const int64_t n_lo = static_cast<int64_t>(blockIdx.z) * n_per;
  const int64_t n_hi = n_lo + n_per < N ? n_lo + n_per : N;
  // the group's draw of iteration i0's packets, as stored (16-bit draws take half the registers)
  auto load_draw = [&](Packet<X, E>(&dst)[VMAX], int64_t i0_) {
    const int64_t i = i0_ + group;
    const bool ok = i < n_hi;
    const X* __restrict__ xi = x + (ok ? i : n_lo) * a.sxn;
#pragma unroll
    for (int v = 0; v < VMAX; ++v) {
      const int64_t p = l + static_cast<int64_t>(L) * v;
      dst[v] = ok && v < nv && p < packets ? load_packet<X, E>(xi + p * E) : Packet<X, E>{};
    }
  };
  Packet<X, E> xr[VMAX];
  Packet<X, E> xn[PREFETCH ? VMAX : 1];  // the next draw's packets (PREFETCH)
  if constexpr (PREFETCH) load_draw(xr, n_lo);
  for (int64_t i0 = n_lo; i0 < n_hi; i0 += groups) {
    const bool valid = i0 + group < n_hi;
    if constexpr (PREFETCH) {
      load_draw(xn, i0 + groups);  // in flight during this draw's reductions
    } else {
      load_draw(xr, i0);  // all loads first
    }
    T q = 0;
    on_packets([&](int v, int64_t p, const Packet<T, E>& yp) {
      T u[E];
#pragma unroll
      for (int e = 0; e < E; ++e) u[e] = valid ? yp.v[e] - widen<T>(xr[v].v[e]) : T(0);
      q += packet_quad<T, KIND, KK, E>(u, prec, pk, p * E);
    });
    for (int o = L / 2; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (valid && !q_in_range<LAW>(piso * q)) {  // out of range unless the draw is y itself (each lane
      bool differs = piso * q != T(0);     // checks its own packets)
      on_packets([&](int v, int64_t, const Packet<T, E>& yp) {
#pragma unroll
        for (int e = 0; e < E; ++e) differs = differs || yp.v[e] != widen<T>(xr[v].v[e]);
      });
      out_of_range = out_of_range || differs;
    }
    if (valid) {
      const T w = law_weight<LAW>(piso * q, beta);
      on_packets([&](int v, int64_t, const Packet<T, E>& yp) {
#pragma unroll
        for (int e = 0; e < E; ++e) acc[v][e] += w * (yp.v[e] - widen<T>(xr[v].v[e]));
      });
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int v = 0; v < VMAX; ++v) xr[v] = xn[v];
    }
  }
  // the warp's groups, then the block's warps
#pragma unroll
  for (int v = 0; v < VMAX; ++v)
#pragma unroll
    for (int e = 0; e < E; ++e)
      for (int o = kWarp / 2; o >= L; o >>= 1) acc[v][e] += __shfl_xor_sync(0xffffffffu, acc[v][e], o);
  if (lane < L) {
#pragma unroll
    for (int v = 0; v < VMAX; ++v) {
      const int64_t p = l + static_cast<int64_t>(L) * v;
      if (v < nv && p < packets)
#pragma unroll
        for (int e = 0; e < E; ++e) part[warp * d + p * E + e] = acc[v][e];
    }
  }
  if (out_of_range) row_flag = 1;
  __syncthreads();
  const bool flagged = row_flag != 0;
  if (ws != nullptr) {  // split draws: this range's Σ w u; the finalize kernel adds the ranges
    T* __restrict__ dst = ws + (row * gridDim.z + blockIdx.z) * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      T sum = 0;
      for (int w = 0; w < warps; ++w) sum += part[w * d + j];
      dst[j] = flagged ? flagged_value<T>() : sum;
    }
    return;
  }
  const T inv_n = T(1) / static_cast<T>(N);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {  // column j is read and written by thread j only
    T sum = 0;
    for (int w = 0; w < warps; ++w) sum += part[w * d + j];
    part[j] = flagged ? flagged_value<T>() : sum * inv_n;
    m_out[row * d + j] = part[j];
  }
  __syncthreads();  // s needs m at the other coordinates of j's block
  T alpha = 0, diffusion = 0;
  if (LANGEVIN) {
    alpha = a.step[row * a.sa];
    diffusion = sqrt(T(2) * alpha);
  }
  const RowPrec<T, KIND, K> P{prec};
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const T s = law_scale<LAW>(lam) * P.apply_at(j, [part](int64_t c) { return part[c]; });
    out[row * d + j] = LANGEVIN ? y[j] + alpha * s + diffusion * a.noise[row * d + j] : s;
  }
}

// Finalize of the split-draw forward: m = (1/N) Σ_r ws[row, r], then s = −λ P m (and the
// Langevin update), one block per row.  P m at j needs m on j's metric block, summed from ws
// directly (nsplit·k loads of a small, L2-resident buffer).
template <typename T, typename X, int KIND, int K, bool LANGEVIN, int LAW>
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
    const T s = law_scale<LAW>(lam) * P.apply_at(j, mean);
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

// ETWEEDIE_CUDA_PACKET=0 in the environment turns the packet kernels off (A/B timing, bisecting).
inline bool packet_kernels_enabled() {
  const char* flag = std::getenv("ETWEEDIE_CUDA_PACKET");  // read per launch: A/B timing in one process
  return flag == nullptr || flag[0] != '0';
}

// Whether x's draw rows can be read in packets of E values of X: d a multiple of E and, for a
// vector packet, x and both of its strides aligned to the packet's bytes.
template <typename T, typename X, int E>
bool packets_fit(const EtScoreArgs<T, X>& a) {
  if (a.d % E != 0) return false;
  if (!kPacketIsVector<X, E>) return true;
  constexpr int64_t bytes = E * static_cast<int64_t>(sizeof(X));
  return reinterpret_cast<uintptr_t>(a.x) % bytes == 0 && (a.sxn * static_cast<int64_t>(sizeof(X))) % bytes == 0 &&
         (a.sxb * static_cast<int64_t>(sizeof(X))) % bytes == 0;
}

// The packet kernel's launch shape for a row of `packets` packets: lanes per draw, packets per
// lane, warps per block.  warps: doubled while the blocks in all hold fewer than 16 warps per SM
// (the resident warps of a 128-register kernel) and the block's draw groups are fewer than its
// draws; then halved while the shared buffers ([warps][d] sums and the query row) exceed 48 KiB.
struct PacketPlan {
  int lanes, nv, warps;
};
template <typename T>
PacketPlan packet_plan(int64_t packets, int64_t blocks, int64_t n_per, int64_t d, int sms) {
  PacketPlan p{1, 1, 1};
  if (packets >= kWarp) {
    p.lanes = kWarp;
    p.nv = static_cast<int>((packets + kWarp - 1) / kWarp);
  } else {
    while (p.lanes < packets) p.lanes *= 2;
  }
  const int64_t groups_per_warp = kWarp / p.lanes;
  while (p.warps < kPacketMaxWarps && blocks * p.warps < static_cast<int64_t>(sms) * 16 &&
         p.warps * groups_per_warp < n_per)
    p.warps *= 2;
  while (p.warps > 1 && (p.warps + 1) * d * static_cast<int64_t>(sizeof(T)) > 48 * 1024) p.warps /= 2;
  return p;
}

// Forward of et_score and langevin_step: the packet kernel (wide, else narrow) where the row fits
// it, else the tiled kernel (coordinate chunks for few long rows); rows fewer than SMs are split
// over draw ranges (draw_splits) and finished by the finalize kernel.
template <typename T, typename X, bool LANGEVIN, int LAW = kLawEnergyTweedie>
cudaError_t et_score_fwd_dispatch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0 || a.B > 2147483647) return cudaErrorInvalidValue;  // rows are grid.x
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
  const bool packets_on = packet_kernels_enabled();
  return dispatch_metric(a.kind, a.kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    constexpr int EW = PacketShape<T, X, KIND, K, true>::E, EN = PacketShape<T, X, KIND, K, false>::E;
    constexpr bool kWideFits = PacketShape<T, X, KIND, K, true>::kFits;
    const bool wide = kWideFits && packets_on && packets_fit<T, X, EW>(a) &&
                      a.d / EW <= kWarp * PacketShape<T, X, KIND, K, true>::VMAX;
    const bool narrow = !wide && packets_on && packets_fit<T, X, EN>(a) && a.d / EN <= kWarp;
    T* ws = nullptr;  // (B, nsplit, d) partial sums, stream-ordered (no device-wide sync)
    if (nsplit > 1) {
      const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&ws),
                                            static_cast<size_t>(a.B * nsplit * a.d) * sizeof(T), stream);
      if (e != cudaSuccess) return e;
    }
    const dim3 rows(static_cast<unsigned>(a.B), 1, static_cast<unsigned>(nsplit));
    cudaError_t e = cudaSuccess;
    if (wide || narrow) {
      const PacketPlan p = packet_plan<T>(a.d / (wide ? EW : EN), a.B * nsplit, n_per, a.d, sms);
      const size_t smem = static_cast<size_t>(p.warps + 1) * a.d * sizeof(T);
      const dim3 block(static_cast<unsigned>(p.warps * kWarp));
      if constexpr (kWideFits) {
        if (wide)
          e = launch(et_score_fwd_packet_kernel<T, X, KIND, K, LANGEVIN, LAW, true>, rows, block, smem, stream, a, p.lanes,
                     p.nv, out, m, n_per, ws);
      }
      if (!wide)
        e = launch(et_score_fwd_packet_kernel<T, X, KIND, K, LANGEVIN, LAW, false>, rows, block, smem, stream, a, p.lanes,
                   p.nv, out, m, n_per, ws);
    } else {
      // Coordinate chunks: enough blocks for ~2 per SM when rows are few and d is large.
      int64_t nch = 1;
      if (nsplit == 1 && a.d > 2 * kMinChunk && a.B < 2 * sms) {
        const int64_t want = (2 * sms + a.B - 1) / a.B, most = a.d / kMinChunk;
        nch = want < most ? want : most;
      }
      int64_t chunk = (a.d + nch - 1) / nch;
      chunk = (chunk + k - 1) / k * k;  // whole metric blocks per chunk
      nch = (a.d + chunk - 1) / chunk;
      const size_t smem = static_cast<size_t>(chunk + kTile) * sizeof(T);
      auto kernel = et_score_fwd_kernel<T, X, KIND, K, LANGEVIN, LAW>;
      if (nch > 65535) e = cudaErrorInvalidConfiguration;
      if (e == cudaSuccess && smem > 48 * 1024)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e == cudaSuccess) {
        const dim3 grid(static_cast<unsigned>(a.B), static_cast<unsigned>(nch), static_cast<unsigned>(nsplit));
        e = launch(kernel, grid, kThreads, smem, stream, a, chunk, out, m, n_per, ws);
      }
    }
    if (nsplit > 1) {
      if (e == cudaSuccess)
        e = launch(et_score_fwd_finalize_kernel<T, X, KIND, K, LANGEVIN, LAW>, static_cast<unsigned>(a.B), kThreads, 0,
                   stream, a, nsplit, ws, out, m);
      const cudaError_t f = cudaFreeAsync(ws, stream);
      if (e == cudaSuccess) e = f;
    }
    return e;
  });
}

// ----------------------------------------------------------------------------- backward

// acc[a·K + b] += s · v(j − a + b) for b < K, a = j % K: coordinate j's share of a K×K block's
// outer-product sum.  Compile-time indices keep acc in registers (a runtime index would put it
// in local memory).
template <typename T, int K, typename V>
__device__ __forceinline__ void add_block_row(T* acc, int64_t j, T s, V&& v) {
  const int ai = static_cast<int>(j % K);
  const int64_t base = j - ai;
#pragma unroll
  for (int aa = 0; aa < K; ++aa)
    if (aa == ai) {
#pragma unroll
      for (int b = 0; b < K; ++b) acc[aa * K + b] += s * v(base + b);
    }
}

// Backward, one block per row (same tiling as the forward):
//   h = −λ P g + g_m                                    (shared memory, d values)
//   per tile, one warp per draw: q_i, h·u_i (and, for the metric gradient, Σ u u over the
//   parameter's pattern) → w_i, c_i = slope_i (h·u_i) staged in shared memory;
//   then the threads stride over coordinates: ∂L/∂u_i[j] = (w_i h_j + c_i (P u_i)_j)/N,
//   summed into ∂L/∂y[j] (shared memory) and written negated to ∂L/∂x_i[j] when requested.
//   ∂L/∂β = (1/N) Σ (h·u_i) w_i ½ ln q_i and the metric gradient's per-draw part are kept in
//   lane 0 of each warp and reduced over the block at the end, with the −λ g mᵀ term and
//   ∂L/∂λ = −g·Pm (Student-t: −2c in place of −λ, ∂L/∂c = −2 g·Pm, no ∂L/∂β).  Every output element is written exactly once: no atomics, no memset.
// Shared memory: 2d (+ d for a diagonal metric's gradient) + 2·kTile values.

template <typename T, typename X, int KIND, int K, int LAW>
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
  const T scale = law_scale<LAW>(lam);  // −λ, or −2c
  const T inv_n = T(1) / static_cast<T>(N);
  const bool need_prec = gp != nullptr;
  // Student-t with an isotropic P = p I: ∂L/∂p = ((1/N) Σ_i w_i² (h·u_i) − g_m·m) / p, the generic
  // sum without its cancellation (csrc/cpu/student_t_score_cpu.cpp states why)
  constexpr bool kStudentIso = LAW == kLawStudentT && KIND == kIsotropic;
  for (int64_t j = threadIdx.x; j < d; j += kThreads) {
    h[j] = scale * P.apply_at(j, [g](int64_t c) { return g[c]; }) + grad_m[row * d + j];
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
        if (need_prec && KIND == kIsotropic && !kStudentIso) uu[0] += u * u;
        if constexpr (KIND == kBlock) {
          if (need_prec) add_block_row<T, K>(uu, j, u, [y, xi](int64_t c) { return y[c] - widen<T>(xi[c]); });
        }
      }
      q = warp_sum(q);
      hu = warp_sum(hu);
      const T w = law_weight<LAW>(q, beta);
      const T c = law_weight_slope<LAW>(q, w, beta) * hu;
      if (need_prec && KIND != kDiagonal && !kStudentIso) {
#pragma unroll
        for (int e = 0; e < PS; ++e) uu[e] = warp_sum(uu[e]);
      }
      if (lane == 0) {
        wt[t] = w;
        ct[t] = c;
        if (LAW == kLawEnergyTweedie && gb) gbeta += hu * w * half_log(q);
        if (need_prec && kStudentIso) {
          gpw[0] += w * w * hu * inv_n;
        } else if (need_prec && KIND != kDiagonal) {
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
  if (LAW == kLawEnergyTweedie && gb) {
    const T total = block_sum(lane == 0 ? gbeta : T(0), scratch);
    if (threadIdx.x == 0) gb[row] = total * inv_n;
  }
  if (gl) {
    T part = 0;  // ∂L/∂λ = g·s/λ = −g·Pm (∂L/∂c = −2 g·Pm)
    for (int64_t j = threadIdx.x; j < d; j += kThreads) part += g[j] * P.apply_at(j, [mr](int64_t c) { return mr[c]; });
    const T total = block_sum(part, scratch);
    if (threadIdx.x == 0) gl[row] = law_dscale<LAW, T>() * total;
  }
  if (need_prec) {
    // + scale·g mᵀ reduced to the parameter's shape
    if (KIND == kDiagonal) {
      for (int64_t j = threadIdx.x; j < d; j += kThreads) gp[row * d + j] = gdiag[j] + scale * g[j] * mr[j];
    } else {
      T part[PS] = {};
      for (int64_t j = threadIdx.x; j < d; j += kThreads) {
        if (kStudentIso) {
          part[0] += grad_m[row * d + j] * mr[j];
        } else if (KIND == kIsotropic) {
          part[0] += g[j] * mr[j];
        } else {
          add_block_row<T, K>(part, j, g[j], [mr](int64_t c) { return mr[c]; });
        }
      }
#pragma unroll
      for (int e = 0; e < PS; ++e) {
        if constexpr (kStudentIso) {
          const T total = block_sum((lane == 0 ? gpw[e] : T(0)) - part[e], scratch);
          if (threadIdx.x == 0) gp[row] = total / P.p[0];
        } else {
          const T total = block_sum((lane == 0 ? gpw[e] : T(0)) + scale * part[e], scratch);
          if (threadIdx.x == 0) gp[row * PS + e] = total;
        }
      }
    }
  }
}

// The backward of the forward kernels above for LAW (et_score's gb is null for the Student-t law,
// gl then receives ∂L/∂c): one block per row.
template <typename T, typename X, int LAW = kLawEnergyTweedie>
cudaError_t et_score_bwd_dispatch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy, X* gx,
                                  T* gb, T* gl, T* gp, cudaStream_t stream) {
  if (a.B == 0 || a.d == 0) return cudaSuccess;
  if (a.N <= 0 || a.B > 2147483647) return cudaErrorInvalidValue;
  const int64_t diag = (a.kind == kDiagonal && gp) ? a.d : 0;
  const size_t smem = static_cast<size_t>(2 * a.d + diag + 2 * kTile) * sizeof(T);
  return dispatch_metric(a.kind, a.kblock, [&](auto kind_c, auto k_c) {
    constexpr int KIND = decltype(kind_c)::value, K = decltype(k_c)::value;
    auto kernel = et_score_bwd_kernel<T, X, KIND, K, LAW>;
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    return launch(kernel, static_cast<unsigned>(a.B), kThreads, smem, stream, a, grad, grad_m, m, gy, gx, gb, gl, gp);
  });
}

}  // namespace cuda
}  // namespace etweedie
