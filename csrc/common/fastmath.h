// Branch-free float32 exp/log/pow for the inner loops of the fused kernels.
//
// Why not libm: expf/logf/powf are opaque calls that stop GCC from vectorizing the loops
// over posterior draws (small d) and over the clean bank (is_score).  These inline versions
// are plain arithmetic plus bit manipulation, so `#pragma omp simd` turns them into AVX2
// code; on CUDA they compile to the same arithmetic.  Accuracy: a few ulp over the ranges
// used (checked against float64 in tests/test_et_score.py through the op tolerances).
//
// Math (textbook range reduction, written from the definitions):
//   exp(x) = 2^n · exp(r),  n = round(x / ln2),  r = x − n ln2 ∈ [−ln2/2, ln2/2],
//            exp(r) by its Taylor polynomial to degree 7 (|error| < 3e-9 relative);
//   log(x) = e ln2 + log(m), x = m·2^e with m ∈ [√½, √2),
//            log(m) = 2 atanh(s), s = (m−1)/(m+1), |s| ≤ 0.172, odd series to s^9.
// double has its own overloads that call std:: functions (tests and float64 users want
// full precision; speed targets are float32).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "macros.h"

namespace etweedie {

ET_HD int32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(x);
#else
  int32_t i;
  std::memcpy(&i, &x, sizeof(i));
  return i;
#endif
}

ET_HD float bits_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float x;
  std::memcpy(&x, &i, sizeof(x));
  return x;
#endif
}

// exp(x); returns exactly 0 below −87.3 (underflow: importance weights far from the max).
ET_HD float fast_exp(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693145751953125f;    // ln2 split so n·kLn2Hi is exact
  const float kLn2Lo = 1.428606765330187e-06f;
  // Ternary clamps and magic-number rounding (1.5·2^23) instead of fminf/rintf: they
  // vectorize without -ffast-math.  Valid in round-to-nearest mode, |x·log2e| < 2^22.
  const float xc = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = (xc * kLog2e + 12582912.f) - 12582912.f;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = bits_float((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.f : p * scale;
}

// log(x) for x > 0 (denormals included); the caller masks x <= 0.
ET_HD float fast_log(float x) {
  const float kLn2 = 0.693147180559945309f;
  const bool tiny = x < 1.17549435e-38f;  // denormal: rescale by 2^23 first
  const float xs = tiny ? x * 8388608.f : x;
  const int32_t bits = float_bits(xs);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  float m = bits_float((bits & 0x007fffff) | 0x3f800000);  // m in [1, 2)
  const bool big = m > 1.41421356f;
  m = big ? 0.5f * m : m;
  e = big ? e + 1 : e;
  const float s = (m - 1.f) / (m + 1.f);
  const float s2 = s * s;
  float p = 2.f / 9.f;
  p = p * s2 + 2.f / 7.f;
  p = p * s2 + 2.f / 5.f;
  p = p * s2 + 2.f / 3.f;
  p = p * s2 + 2.f;
  const float ef = static_cast<float>(e) - (tiny ? 23.f : 0.f);
  return ef * kLn2 + p * s;
}

ET_HD double fast_exp(double x) { return std::exp(x); }
ET_HD double fast_log(double x) { return std::log(x); }

// q^a for q > 0; 0 for q <= 0 (the coincident-point convention of every op).
template <typename T>
ET_HD T pow_pos(T q, T a) {
  return q > T(0) ? fast_exp(a * fast_log(q > T(0) ? q : T(1))) : T(0);
}

}  // namespace etweedie
