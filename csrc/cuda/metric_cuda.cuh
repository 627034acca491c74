// Device-side helpers shared by the CUDA kernels: the row's precision P (never materialized
// as d×d) and warp/block reductions.  The per-pair math (weights, slopes, logs) is the
// HOST_DEVICE code of csrc/common/et_score.h, shared with the CPU kernels.
//
//   isotropic: P = p·I        diagonal: P = diag(p)        block: P = I_{d/K} ⊗ Pk (K ≤ 4)
// (P v)_j = Σ_b Pk[j%K][b] · v[j − j%K + b] for a block metric: a coordinate needs only the
// K entries of its own block, read through a functor so that v may live in registers,
// shared memory or global memory (a residual y − x_i computed on the fly).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/et_score.h"

namespace etweedie {
namespace cuda {

// kernel<<<grid, block, smem, stream>>>(args...) and the launch's error: the one spelling of a launch
// in csrc/cuda, so that the host SIMT emulator of the tests (tests/simt/simt.h, which defines its
// own launch and ET_DYNAMIC_SHARED) compiles and runs these same sources with g++.
#if !defined(ETWEEDIE_SIMT)
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A... args) {
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}
// A kernel's dynamic shared memory, 16-byte aligned.
#define ET_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

constexpr int kWarp = 32;
constexpr int kThreads = 128;  // threads per block of the row kernels (4 warps)
constexpr int kWarps = kThreads / kWarp;

template <typename T, int KIND, int K>
struct RowPrec {
  const T* p;
  // (P v)_j with v read as v(c) for the columns c of j's block.
  template <typename V>
  __device__ __forceinline__ T apply_at(int64_t j, V&& v) const {
    if (KIND == kIsotropic) return p[0] * v(j);
    if (KIND == kDiagonal) return p[j] * v(j);
    const int a = static_cast<int>(j % K);
    const int64_t base = j - a;
    T acc = 0;
#pragma unroll
    for (int b = 0; b < K; ++b) acc += p[a * K + b] * v(base + b);
    return acc;
  }
  static constexpr int param_size() { return KIND == kBlock ? K * K : 1; }
};

// E consecutive values of X, loaded together (load_packet).
template <typename X, int E>
struct Packet {
  X v[E];
};

template <int BYTES>
struct VecWord {};
template <>
struct VecWord<16> {
  using type = uint4;
};
template <>
struct VecWord<8> {
  using type = uint2;
};
template <>
struct VecWord<4> {
  using type = unsigned;
};
template <>
struct VecWord<2> {
  using type = unsigned short;
};

// Whether load_packet<X, E> is one vector load (E·sizeof(X) = 2, 4, 8 or 16 bytes, the address
// aligned to it) rather than E scalar loads.
template <typename X, int E>
constexpr bool kPacketIsVector = E * sizeof(X) == 2 || E * sizeof(X) == 4 || E * sizeof(X) == 8 || E * sizeof(X) == 16;

// The E values of X at p: one 16-byte (or 8/4/2-byte) load where kPacketIsVector — p aligned to
// the packet's size, which the launchers check before choosing a kernel that loads packets.
template <typename X, int E>
__device__ __forceinline__ Packet<X, E> load_packet(const X* __restrict__ p) {
  Packet<X, E> r;
  if constexpr (kPacketIsVector<X, E>) {
    constexpr int kBytes = E * static_cast<int>(sizeof(X));
#if defined(ETWEEDIE_SIMT)
    simt::check_aligned(p, kBytes);
#endif
    using W = typename VecWord<kBytes>::type;
    const W w = *reinterpret_cast<const W*>(p);
    memcpy(&r, &w, kBytes);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) r.v[e] = p[e];
  }
  return r;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// Sum over the block (kThreads threads); every thread gets the result.  scratch: kWarps Ts.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

template <typename T>
__device__ __forceinline__ T block_max(T v, T* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = scratch[w] > total ? scratch[w] : total;
  return total;
}

// Host side: f(kind_c, k_c) with std::integral_constant arguments for the metric kind and block
// size given at run time, so that f instantiates the kernel template for them.
template <typename F>
cudaError_t dispatch_metric(int kind, int kblock, F&& f) {
  using std::integral_constant;
  switch (kind) {
    case kIsotropic:
      return f(integral_constant<int, kIsotropic>{}, integral_constant<int, 1>{});
    case kDiagonal:
      return f(integral_constant<int, kDiagonal>{}, integral_constant<int, 1>{});
    default:
      switch (kblock) {
        case 1:
          return f(integral_constant<int, kBlock>{}, integral_constant<int, 1>{});
        case 2:
          return f(integral_constant<int, kBlock>{}, integral_constant<int, 2>{});
        case 3:
          return f(integral_constant<int, kBlock>{}, integral_constant<int, 3>{});
        default:
          return f(integral_constant<int, kBlock>{}, integral_constant<int, 4>{});
      }
  }
}

}  // namespace cuda
}  // namespace etweedie
