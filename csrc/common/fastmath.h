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
// double has its own overloads with the same structure and longer polynomials (exp: Taylor to
// degree 13, |error| < 1e-17 relative on the reduced range; log: odd series to s^21, < 3e-17;
// both polynomials by Estrin's scheme),
// so that float64 loops vectorize too: the float64 importance-sampling reference (is_score, the
// oracle every score table is measured against) ran ~5x slower than float32 with std::exp/log
// in its inner loop.  Accuracy against libm: ≲ 2 ulp (tests/test_fastmath.py).  Two differences
// from libm, both irrelevant for weights and powers: exp flushes results below 2^-1022 (x <
// −708.39) to 0 instead of returning subnormals, and exp(x > 709.78) = +inf as in libm.  On CUDA
// the double overloads call the device exp/log.
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

#if defined(__CUDA_ARCH__)
ET_HD double fast_exp(double x) { return exp(x); }
ET_HD double fast_log(double x) { return log(x); }
#else
inline uint64_t double_bits(double x) {
  uint64_t i;
  std::memcpy(&i, &x, sizeof(i));
  return i;
}

inline double bits_double(uint64_t i) {
  double x;
  std::memcpy(&x, &i, sizeof(x));
  return x;
}

// exp(x) in double.  Rounding by the magic number 1.5·2^52 leaves n in the low bits of t's
// representation, so the scale 2^n is built with 64-bit integer adds and shifts only (AVX2
// has no double→int64 conversion; this keeps the loop vectorizable).
ET_HD double fast_exp(double x) {
  const double kLog2e = 1.4426950408889634;
  const double kLn2Hi = 0.6931471803691238;     // 32 significant bits: n·kLn2Hi exact for |n| < 2^20
  const double kLn2Lo = 1.9082149292705877e-10;
  const double kMagic = 6755399441055744.0;     // 1.5·2^52
  const double xc = x < -708.39 ? -708.39 : (x > 709.0 ? 709.0 : x);
  const double t = xc * kLog2e + kMagic;
  const double n = t - kMagic;
  const double r = (xc - n * kLn2Hi) - n * kLn2Lo;  // |r| ≤ ln2/2
  // Taylor to degree 13 evaluated by Estrin's scheme (depth 4 instead of Horner's 13: the
  // float64 loops are latency-bound, and pow = exp∘log chains two polynomials).
  const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const double a0 = 1.0 + r, a1 = 0.5 + r * (1.0 / 6.0), a2 = 1.0 / 24.0 + r * (1.0 / 120.0),
               a3 = 1.0 / 720.0 + r * (1.0 / 5040.0), a4 = 1.0 / 40320.0 + r * (1.0 / 362880.0),
               a5 = 1.0 / 3628800.0 + r * (1.0 / 39916800.0), a6 = 1.0 / 479001600.0 + r * (1.0 / 6227020800.0);
  const double b0 = a0 + r2 * a1, b1 = a2 + r2 * a3, b2 = a4 + r2 * a5;
  const double p = (b0 + r4 * b1) + r8 * (b2 + r4 * a6);
  const double scale = bits_double((double_bits(t) + 1023) << 52);  // 2^n: low bits of t hold n
  const double y = p * scale;
  return x < -708.39 ? 0.0 : (x > 709.782712893384 ? HUGE_VAL : y);
}

// log(x) for x > 0 (subnormals included); the caller masks x <= 0.  The exponent goes to
// double through the bit pattern of 2^52 + e (exact), again avoiding an int64→double convert.
ET_HD double fast_log(double x) {
  const double kLn2Hi = 0.6931471803691238;
  const double kLn2Lo = 1.9082149292705877e-10;
  const double kTwo52 = 4503599627370496.0;
  const bool tiny = x < 2.2250738585072014e-308;  // subnormal: rescale by 2^54 first
  const double xs = tiny ? x * 18014398509481984.0 : x;
  const uint64_t bits = double_bits(xs);  // unsigned: AVX2 has logical, not arithmetic, 64-bit shifts
  const double eb = bits_double(((bits >> 52) & 0x7ff) | 0x4330000000000000ULL) - kTwo52;  // biased exponent
  double m = bits_double((bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL);       // m in [1, 2)
  const bool big = m > 1.4142135623730951;
  m = big ? 0.5 * m : m;
  const double e = eb - 1023.0 + (big ? 1.0 : 0.0) - (tiny ? 54.0 : 0.0);
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  // 2/3 + 2/5 z + … + 2/21 z^9 (z = s²) by Estrin's scheme, as in fast_exp.
  const double z2 = s2 * s2, z4 = z2 * z2, z8 = z4 * z4;
  const double c0 = 2.0 / 3.0 + s2 * (2.0 / 5.0), c1 = 2.0 / 7.0 + s2 * (2.0 / 9.0), c2 = 2.0 / 11.0 + s2 * (2.0 / 13.0),
               c3 = 2.0 / 15.0 + s2 * (2.0 / 17.0), c4 = 2.0 / 19.0 + s2 * (2.0 / 21.0);
  const double p = (c0 + z2 * c1) + z4 * (c2 + z2 * c3) + z8 * c4;
  // log m = 2s + s^3 (2/3 + ...): the leading 2s is added last and separately for accuracy.
  return e * kLn2Hi + (e * kLn2Lo + (2.0 * s + s * s2 * p));
}
#endif

// q^a for q > 0; 0 for q <= 0 (the coincident-point convention of every op).
template <typename T>
ET_HD T pow_pos(T q, T a) {
  return q > T(0) ? fast_exp(a * fast_log(q > T(0) ? q : T(1))) : T(0);
}

}  // namespace etweedie
