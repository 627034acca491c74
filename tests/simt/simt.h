// A host SIMT emulator: runs the project's CUDA kernels (csrc/cuda) and their bindings on the
// CPU, so that the kernel logic (indexing, tiling, splits, reductions, shuffles, barriers, 16-bit
// draws, vector loads) is tested on every CI run, not only on a lent GPU.  Test-only: the
// package never builds it (tests/simt_build.py compiles it with g++ on demand).
//
// Only what csrc/cuda uses is provided; a kernel using more fails to compile here first.
//
// Model.  A launch runs its blocks one after another; the threads of a block are cooperative
// fibers (ucontext) on one OS thread, each running the kernel body until it reaches a block
// barrier (__syncthreads) or a warp collective (__shfl_xor_sync), where it yields.  The
// scheduler resumes the waiting threads when the whole block (or the whole warp) has arrived, so
// the CUDA semantics of these points are exact; between them, threads run in a pseudo-random
// order chosen per round from a seed (simt::config().seed), which exposes a missing barrier
// between a write and a read as a wrong or changing result.  Detected and reported as a launch
// failure (std::runtime_error naming the kernel's block and thread): a barrier that not all
// threads reach (divergent __syncthreads, a warp collective with an exited or diverged lane), a
// partial shuffle mask, a misaligned vector load (simt::check_aligned), dynamic shared memory over
// the device limit or over 48 KiB without cudaFuncSetAttribute, an invalid grid.  Dynamic shared
// memory and cudaMallocAsync memory start filled with 0xff bytes (NaN for floats) so that a read
// before a write shows.  Not modelled: data races inside one barrier interval beyond the random
// order, out-of-bounds addresses, performance.
//
// The device it pretends to be has simt::config().sms multiprocessors (default 132, an H100 SXM)
// so that tests choose the grid shapes a real GPU gets (row splits, draw splits).
#pragma once

#ifndef ETWEEDIE_SIMT
#define ETWEEDIE_SIMT 1
#endif

#include <cxxabi.h>
#include <dlfcn.h>
#include <math.h>  // the float overloads of sqrt/exp/… in the global namespace, as in device code
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------------------- CUDA spellings

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one at a time: a static is the block's shared array
#define __align__(n) alignas(n)
#define ET_DYNAMIC_SHARED(name) unsigned char* name = ::simt::dynamic_shared()

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

namespace simt {

struct Config {
  int sms = 132;                         // multiprocessors reported by cudaDeviceGetAttribute
  size_t max_dynamic_smem = 227 * 1024;  // per block, opt-in (H100)
  uint64_t seed = 1;                     // order of the threads between barriers
};
inline Config& config() {
  static Config c;
  return c;
}

enum FiberState { kRunning, kAtBlockBarrier, kAtWarpCollective, kExited };

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  FiberState state = kRunning;
};

struct Launch {
  std::vector<Fiber> fibers;
  std::vector<std::vector<char>> stacks;
  ucontext_t scheduler;
  int current = -1;
  std::function<void()> body;
  std::vector<unsigned char> dynamic_smem;
  std::vector<unsigned char> exchange;  // 16 bytes per thread: shuffle operands
  std::string failure;
  std::string kernel;
  std::map<const void*, int> smem_attr;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
  std::vector<std::string> log;           // "kernel<template args> grid=(x,y,z) block=n smem=bytes" per launch
  cudaError_t last_error = cudaSuccess;
};
inline Launch& launch_state() {
  static Launch s;
  return s;
}

// The kernel's name with its template arguments, e.g. "etweedie::cuda::et_score_fwd_kernel<float, …>".
inline std::string kernel_name(const void* fn) {
  Dl_info info;
  if (dladdr(fn, &info) == 0 || info.dli_sname == nullptr) return "?";
  int status = 0;
  char* full = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 && full ? full : info.dli_sname;
  std::free(full);
  if (name.rfind("void ", 0) == 0) name = name.substr(5);
  const size_t paren = name.find('(');
  return paren == std::string::npos ? name : name.substr(0, paren);
}

inline unsigned char* dynamic_shared() { return launch_state().dynamic_smem.data(); }

inline int linear_tid() { return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

inline std::string where() {
  return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
         ") thread " + std::to_string(linear_tid());
}

// Called from kernel code: ends the launch with msg (the fiber is abandoned, never resumed).
[[noreturn]] inline void fail(const std::string& msg) {
  Launch& s = launch_state();
  if (s.failure.empty()) s.failure = msg + " at " + where();
  Fiber& f = s.fibers[s.current];
  f.state = kExited;
  swapcontext(&f.ctx, &s.scheduler);
  std::abort();  // unreachable: the scheduler never resumes a failed launch
}

inline void wait_at(FiberState st) {
  Launch& s = launch_state();
  Fiber& f = s.fibers[s.current];
  f.state = st;
  swapcontext(&f.ctx, &s.scheduler);
}

// A 16-byte (or 8-byte) vector access must be aligned to its size, as on the GPU.
inline void check_aligned(const void* p, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
    fail("misaligned " + std::to_string(bytes) + "-byte vector access at " +
         std::to_string(reinterpret_cast<uintptr_t>(p)));
}

inline void fiber_entry() {
  Launch& s = launch_state();
  s.body();
  s.fibers[s.current].state = kExited;  // returning resumes the scheduler (uc_link)
}

inline uint64_t next_random(uint64_t& r) {  // splitmix64
  uint64_t z = (r += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Runs one block of n threads to completion; returns false (failure set) when it cannot.
inline bool run_block(int n, uint64_t& rng) {
  constexpr size_t kStack = 256 * 1024;
  Launch& s = launch_state();
  s.fibers.assign(n, Fiber{});
  if (static_cast<int>(s.stacks.size()) < n) s.stacks.resize(n);
  for (int i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    f.tid = dim3(i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y));
    if (s.stacks[i].size() < kStack) s.stacks[i].resize(kStack);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = s.stacks[i].data();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &s.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (;;) {
    for (int i = 0; i < n; ++i) order[i] = i;
    for (int i = n - 1; i > 0; --i) std::swap(order[i], order[next_random(rng) % (i + 1)]);
    for (int i : order) {
      if (s.fibers[i].state != kRunning) continue;
      s.current = i;
      threadIdx = s.fibers[i].tid;
      swapcontext(&s.scheduler, &s.fibers[i].ctx);
      if (!s.failure.empty()) return false;
    }
    int exited = 0, at_block = 0;
    for (const Fiber& f : s.fibers) {
      exited += f.state == kExited;
      at_block += f.state == kAtBlockBarrier;
    }
    if (exited == n) return true;
    bool released = false;
    for (int w0 = 0; w0 < n; w0 += 32) {  // a warp whose 32 lanes all reached a collective goes on
      int waiting = 0;
      for (int i = w0; i < w0 + 32 && i < n; ++i) waiting += s.fibers[i].state == kAtWarpCollective;
      if (waiting == 0) continue;
      if (waiting == 32) {
        for (int i = w0; i < w0 + 32; ++i) s.fibers[i].state = kRunning;
        released = true;
      } else {
        threadIdx = s.fibers[w0].tid;
        s.failure = "warp collective reached by " + std::to_string(waiting) + " of the 32 lanes of warp " +
                    std::to_string(w0 / 32) + " (the others exited, diverged or wait at __syncthreads; or a partial warp)";
        s.current = w0;
        return false;
      }
    }
    if (released) continue;
    if (at_block + exited == n) {
      for (Fiber& f : s.fibers)
        if (f.state == kAtBlockBarrier) f.state = kRunning;
      continue;
    }
    s.failure = "deadlock";
    return false;
  }
}

}  // namespace simt

// ---------------------------------------------------------------------------- intrinsics

inline void __syncthreads() { simt::wait_at(simt::kAtBlockBarrier); }

inline void check_full_mask(unsigned mask) {
  if (mask != 0xffffffffu) simt::fail("warp collective with a partial mask (not emulated)");
}

// Every lane publishes v, the warp meets, each lane reads its source lane's value, the warp meets
// again (so that no lane overwrites a value another has not read yet).
template <typename T, typename Src>
T simt_shuffle(unsigned mask, T v, Src src_of) {
  static_assert(sizeof(T) <= 16, "shuffle operand over 16 bytes");
  check_full_mask(mask);
  simt::Launch& s = simt::launch_state();
  const int tid = simt::linear_tid(), lane = tid % 32;
  std::memcpy(&s.exchange[16 * tid], &v, sizeof(T));
  simt::wait_at(simt::kAtWarpCollective);
  T r;
  std::memcpy(&r, &s.exchange[16 * (tid - lane + src_of(lane))], sizeof(T));
  simt::wait_at(simt::kAtWarpCollective);
  return r;
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return simt_shuffle(mask, v, [=](int lane) {
    const int src = lane ^ lane_mask;
    return src / width == lane / width ? src : lane;
  });
}


// ---------------------------------------------------------------------------- runtime API

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unspecified launch failure";
  }
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = simt::launch_state().last_error;
  simt::launch_state().last_error = cudaSuccess;
  return e;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = simt::config().sms; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(simt::config().max_dynamic_smem); return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

template <typename K>
cudaError_t cudaFuncSetAttribute(K* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > simt::config().max_dynamic_smem)
    return cudaErrorInvalidValue;
  simt::launch_state().smem_attr[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

inline cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) {
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xff, bytes);  // NaN for floats: a read before a write shows
  return cudaSuccess;
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  std::free(p);
  return cudaSuccess;
}

namespace etweedie {
namespace cuda {

// kernel<<<grid, block, smem, stream>>>(args...) run to completion on the host; a kernel failure
// (simt::fail, a deadlock) throws std::runtime_error, a bad configuration returns its error as
// the CUDA launch would.
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch: argument count");
  simt::Launch& s = simt::launch_state();
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535 || grid.x > 0x7fffffffu)
    return cudaErrorInvalidConfiguration;
  if (smem > 48 * 1024) {
    const auto it = s.smem_attr.find(reinterpret_cast<const void*>(kernel));
    if (it == s.smem_attr.end() || static_cast<size_t>(it->second) < smem) return cudaErrorInvalidValue;
  }
  s.log.push_back(simt::kernel_name(reinterpret_cast<const void*>(kernel)) + " grid=(" + std::to_string(grid.x) + "," +
                  std::to_string(grid.y) + "," + std::to_string(grid.z) + ") block=" + std::to_string(threads) +
                  " smem=" + std::to_string(smem));
  s.body = [&] { kernel(static_cast<P>(args)...); };
  s.exchange.assign(16 * threads, 0);
  uint64_t rng = simt::config().seed;
  blockDim = block;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        s.dynamic_smem.assign(smem + 16, 0xff);
        s.failure.clear();
        if (!simt::run_block(static_cast<int>(threads), rng)) {
          const std::string msg = "simt: kernel failed: " + s.failure;
          s.failure.clear();
          throw std::runtime_error(msg);
        }
      }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace etweedie
