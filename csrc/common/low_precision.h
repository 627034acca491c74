// Low-precision posterior draws: the 16-bit storage formats the score kernels read x in
// (bfloat16, IEEE float16) and their conversions, shared by the CPU and CUDA kernels.
//
// Dtype rule of the score ops (et_score, langevin_step, student_t_score): the query y is
// float32 or float64 and fixes the compute type T; the draws x are T, bfloat16 or float16.
// Every draw value is widened to T as it is loaded (exact: both formats are subsets of
// float32) and all arithmetic and accumulation is in T; the outputs are T, and ∂L/∂x is
// computed in T and rounded once to x's format (round to nearest even) when it is stored.
// Reading x in 16 bits halves the bytes of the pass over the draws, which is what bounds the
// score at MNIST sizes.
//
// Layout: the raw 16 bits, as torch stores c10::BFloat16 / c10::Half and CUDA stores
// __nv_bfloat16 / __half, so a tensor's data pointer is reinterpreted, never converted.
// The conversions are plain integer/float arithmetic with selects instead of branches, so
// `#pragma omp simd` loops over them vectorize on the CPU (written from the IEEE 754 formats;
// float16 subnormals handled without denormal arithmetic, so flush-to-zero modes do not
// change them).  On CUDA, float16 uses the hardware conversion instructions.
//
// Whole rows (CPU): widen_row / narrow_row convert n values at once.  For float16 on an x86 CPU
// compiled with F16C (any x86-64 since 2012; the extension builds with -march=native) they use
// the hardware conversions, eight values per instruction (vcvtph2ps / vcvtps2ph with
// round-to-nearest-even; the same values as the portable code, NaN payloads aside, under the
// default MXCSR); elsewhere they loop over the portable conversion.  The CPU kernels widen a few
// float16 draw rows at a time into an L1 buffer with it (csrc/cpu/draw_rows_cpu.h): the portable
// float16 conversion costs about ten integer operations per value, which cancelled the halved
// memory traffic (bfloat16's is one shift).
#pragma once

#include <cstdint>
#include <type_traits>

#if !defined(__CUDACC__) && defined(__F16C__)
#include <immintrin.h>
#define ETWEEDIE_HW_HALF 1
#else
#define ETWEEDIE_HW_HALF 0
#endif
#if !defined(__CUDACC__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fastmath.h"  // float_bits / bits_float
#include "macros.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace etweedie {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

template <typename X>
constexpr bool is_low_precision_v = std::is_same_v<X, bf16> || std::is_same_v<X, fp16>;

// ---------------------------------------------------------------------------- 16 bits -> float

ET_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<int32_t>(static_cast<uint32_t>(h) << 16)); }

ET_HD float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t w = h;
  const uint32_t sign = (w & 0x8000u) << 16;
  const uint32_t em = (w & 0x7fffu) << 13;  // exponent and mantissa in float's positions
  const uint32_t e = w & 0x7c00u;
  // normal: rebias the exponent (15 -> 127); inf/NaN: exponent 31 -> 255, payload kept
  const uint32_t rebiased = em + (112u << 23) + (e == 0x7c00u ? (112u << 23) : 0u);
  // subnormal (and zero): m·2^-24 = (2^-14 + m·2^-24) − 2^-14, both normal floats, exact
  const float sub = bits_float(static_cast<int32_t>(em + (113u << 23))) - 6.103515625e-05f;
  const uint32_t mag = e == 0u ? static_cast<uint32_t>(float_bits(sub)) : rebiased;
  return bits_float(static_cast<int32_t>(mag | sign));
#endif
}

// ---------------------------------------------------------------------------- float -> 16 bits

// Round to nearest even; NaN stays NaN (quiet, sign kept); overflow rounds to ±inf.
ET_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t b = static_cast<uint32_t>(float_bits(f));
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? ((b >> 16) | 0x40u) : rounded);
#endif
}

// Round to nearest even; NaN -> quiet NaN, |f| beyond the largest float16 (after rounding) -> ±inf,
// tiny values -> subnormals or ±0.
ET_HD uint16_t float_to_fp16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t b = static_cast<uint32_t>(float_bits(f));
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;  // |f|
  // normal range: rebias (127 -> 15), add the rounding bias with the tie broken to even
  const uint32_t normal = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // below 2^-14: adding 0.5 aligns the float16 subnormal quantum (2^-24) with float's last
  // mantissa bit, so the float addition rounds to nearest even for us
  const float shifted = bits_float(static_cast<int32_t>(a)) + 0.5f;
  const uint32_t subnormal = static_cast<uint32_t>(float_bits(shifted)) - 0x3f000000u;
  uint32_t mag = a < 0x38800000u ? subnormal : normal;
  mag = a >= 0x47800000u ? 0x7c00u : mag;  // ≥ 2^16: inf (values in [65520, 2^16) round up to it above)
  mag = a > 0x7f800000u ? 0x7e00u : mag;   // NaN
  return static_cast<uint16_t>(mag | sign);
#endif
}

// ---------------------------------------------------------------------------- typed access

// A draw value as the compute type T (exact).
template <typename T>
ET_HD T widen(T v) {
  return v;
}
template <typename T>
ET_HD T widen(bf16 v) {
  return static_cast<T>(bf16_to_float(v.bits));
}
template <typename T>
ET_HD T widen(fp16 v) {
  return static_cast<T>(fp16_to_float(v.bits));
}

// v rounded to float "to odd" (toward zero, then the last bit set when inexact): rounding that
// float to any format at least two bits narrower gives the correctly rounded result of v, so a
// float64 value reaches 16 bits rounded once, not twice.
ET_HD float round_to_odd_float(double v) {
  float f = static_cast<float>(v);
  const double back = static_cast<double>(f);
  if (back == v || v != v) return f;
  if ((back < 0 ? -back : back) > (v < 0 ? -v : v)) f = bits_float(float_bits(f) - 1);  // one ulp toward zero
  return bits_float(float_bits(f) | 1);
}

ET_HD float narrowing_float(float v) { return v; }
ET_HD float narrowing_float(double v) { return round_to_odd_float(v); }

// A value of the compute type stored in the draws' format X (rounded once, to nearest even).
template <typename X, typename T>
ET_HD X narrow(T v) {
  if constexpr (std::is_same_v<X, bf16>) {
    return bf16{float_to_bf16(narrowing_float(v))};
  } else if constexpr (std::is_same_v<X, fp16>) {
    return fp16{float_to_fp16(narrowing_float(v))};
  } else {
    return static_cast<X>(v);
  }
}

// ---------------------------------------------------------------------------- whole rows (CPU)

#if !defined(__CUDACC__)
// dst[0:n] = src[0:n] widened to float (exact).
inline void widen_row(const fp16* src, int64_t n, float* dst) {
  int64_t j = 0;
#if ETWEEDIE_HW_HALF
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
  for (; j < n; ++j) dst[j] = fp16_to_float(src[j].bits);
}

#if ETWEEDIE_HW_HALF
// src[0:16] rounded to float16 in one 256-bit register: one 512-bit vcvtps2ph on AVX-512 CPUs,
// else two joined in registers (a stack buffer would cost a store-forwarding stall on its 32-byte
// reload).
inline __m256i narrow16_fp16(const float* src) {
#if defined(__AVX512F__)
  return _mm512_cvtps_ph(_mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT);  // one vcvtps2ph for all 16
#else
  const __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT);
  const __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps(src + 8), _MM_FROUND_TO_NEAREST_INT);
  return _mm256_set_m128i(hi, lo);
#endif
}
#endif

#if defined(__AVX2__)
// src[0:16] rounded to bfloat16 in one 256-bit register (the ∂L/∂x store of bfloat16 draws).
// narrow16_bf16_exact: float_to_bf16's integer arithmetic on eight lanes at a time (round to
// nearest even, NaN quieted with its sign kept: the same bits as the scalar function), the two
// halves packed in registers.  narrow16_bf16: one vcvtneps2bf16 on AVX512-BF16 CPUs (the integer
// rounding took ~40% of the backward's gradient pass: benchmarks/RESULTS.md, 16-bit draws), the
// exact path for a block holding a subnormal and on other CPUs.
inline __m256i narrow8_bf16_lanes(__m256 v) {  // the bfloat16 bits in the low half of each 32-bit lane
  const __m256i b = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(b, 16);
  const __m256i tie = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), tie), 16);
  const __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
inline __m256i narrow16_bf16_exact(const float* src) {
  const __m256i lo = narrow8_bf16_lanes(_mm256_loadu_ps(src));
  const __m256i hi = narrow8_bf16_lanes(_mm256_loadu_ps(src + 8));
  // packus works per 128-bit lane (lo0-3 hi0-3 | lo4-7 hi4-7); the permute puts lo before hi
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
#if defined(__AVX512BF16__) && defined(__AVX512F__)
// vcvtneps2bf16 rounds the same way (nearest even, NaN -> (bits >> 16) | 0x40) but treats
// subnormal inputs as zero: a block holding one takes the integer path.  The test is one
// vfpclassps (class 0x20: denormal) where the CPU has AVX512-DQ.
inline bool bf16_hw_rounds(__m512 v) {
#if defined(__AVX512DQ__)
  return _mm512_fpclass_ps_mask(v, 0x20) == 0;
#else
  const __m512i mag = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
  return _mm512_mask_cmplt_epu32_mask(_mm512_test_epi32_mask(mag, mag), mag, _mm512_set1_epi32(0x00800000)) == 0;
#endif
}
#endif
inline __m256i narrow16_bf16(const float* src) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m512 v = _mm512_loadu_ps(src);
  if (bf16_hw_rounds(v)) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  return narrow16_bf16_exact(src);
}
#endif

#if defined(__AVX2__)
// 16 floats held in the order that widening bfloat16 by unpacks leaves (lo: coordinates 0–3 and
// 8–11, hi: 4–7 and 12–15; csrc/cpu/lanes16_cpu.h) rounded to bfloat16 in coordinate order:
// packus per 128-bit lane is the unpacks' inverse, so the exact path needs no permute; on
// AVX512-BF16 one vcvtne2ps2bf16 of the two halves (lo's eight values, then hi's: the quads come
// out as 0, 2, 1, 3, so one permute), with the exact path for a block holding a subnormal, as in
// narrow16_bf16, found by two vfpclassps where the CPU has AVX512-VL and -DQ (no 512-bit
// insert and no integer range test: benchmarks/RESULTS.md, CPU: 16-bit posterior draws).
inline __m256i narrow16_bf16_unpacked(__m256 lo, __m256 hi) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  if ((_mm256_fpclass_ps_mask(lo, 0x20) | _mm256_fpclass_ps_mask(hi, 0x20)) == 0)
    return _mm256_permute4x64_epi64(reinterpret_cast<__m256i>(_mm256_cvtne2ps_pbh(hi, lo)), 0xD8);
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m512 v = _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
  if (bf16_hw_rounds(v)) return _mm256_permute4x64_epi64(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)), 0xD8);
#endif
  return _mm256_packus_epi32(narrow8_bf16_lanes(lo), narrow8_bf16_lanes(hi));
}
#endif

// dst[0:n] = src[0:n] rounded to float16 (to nearest even, overflow to ±inf).
inline void narrow_row(const float* src, int64_t n, fp16* dst) {
  int64_t j = 0;
#if ETWEEDIE_HW_HALF
  for (; j + 16 <= n; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), narrow16_fp16(src + j));
#endif
  for (; j < n; ++j) dst[j] = fp16{float_to_fp16(src[j])};
}
#endif

}  // namespace etweedie
