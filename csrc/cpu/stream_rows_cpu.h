// Write-once output rows of the CPU kernels (∂L/∂x of et_score, langevin_step and
// student_t_score, the energy ops' gradients) stored with streaming stores.  Plain C++ and
// intrinsics, no ATen: the kernels' headers include it, and so can the standalone checkers of
// tests/cpp (the output buffers themselves come from fresh_output_cpu.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/low_precision.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace etweedie {
namespace cpu {

// dst[0:n] = src[0:n] for a write-once output row, with non-temporal (streaming) stores where
// dst is 32-byte aligned: a plain store first reads each destination line into the cache
// (write-allocate), so a 51 MB output costs 102 MB of traffic; streaming stores write it once
// and do not evict the inputs still being read.  Call stream_fence() before the output is read
// (e.g. at the end of the parallel region that writes it).
inline void stream_row(float* dst, const float* src, int64_t n) {
  int64_t k = 0;
#if defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    for (; k + 8 <= n; k += 8) _mm256_stream_ps(dst + k, _mm256_loadu_ps(src + k));
  }
#endif
  for (; k < n; ++k) dst[k] = src[k];
}

inline void stream_row(double* dst, const double* src, int64_t n) {
  int64_t k = 0;
#if defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    for (; k + 4 <= n; k += 4) _mm256_stream_pd(dst + k, _mm256_loadu_pd(src + k));
  }
#endif
  for (; k < n; ++k) dst[k] = src[k];
}

// The same for an output in the draws' 16-bit format (∂L/∂x of bfloat16/float16 draws): src in
// the compute type T, rounded once to X (csrc/common/low_precision.h), 16 values per 32-byte
// streaming store; float32 values are rounded in registers (narrow16_fp16 / narrow16_bf16, by the
// hardware conversion instructions where the CPU has them).
template <typename X, typename T, typename = std::enable_if_t<is_low_precision_v<X>>>
inline void stream_row(X* dst, const T* src, int64_t n) {
  int64_t k = 0;
#if defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
#if ETWEEDIE_HW_HALF
    if constexpr (std::is_same_v<X, fp16> && std::is_same_v<T, float>) {
      for (; k + 16 <= n; k += 16) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), narrow16_fp16(src + k));
    }
#endif
#if defined(__AVX2__)
    if constexpr (std::is_same_v<X, bf16> && std::is_same_v<T, float>) {
      for (; k + 16 <= n; k += 16) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), narrow16_bf16(src + k));
    }
#endif
    for (; k + 16 <= n; k += 16) {
      alignas(32) X packed[16];
#pragma omp simd
      for (int t = 0; t < 16; ++t) packed[t] = narrow<X>(src[k + t]);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), _mm256_load_si256(reinterpret_cast<const __m256i*>(packed)));
    }
  }
#endif
  for (; k < n; ++k) dst[k] = narrow<X>(src[k]);
}

inline void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

}  // namespace cpu
}  // namespace etweedie
