// 16-bit draws in the forward's weighted residual sum (et_score, langevin_step, student_t_score)
// for isotropic, diagonal and k×k block metrics with k = 1, 2 or 4, on AVX2 + FMA CPUs, d a
// multiple of 16: 16 draw values per 32-byte load, widened in registers on both passes over a
// draw (q, then the weighted accumulation), with no staging buffer.
//   bfloat16: one load and two unpacks against zero (a bfloat16 is the high half of its
//     float32).  The unpacks leave the values in a fixed lane order — within each group of 16
//     coordinates the low vector holds 0–3 and 8–11, the high one 4–7 and 12–15 — so the query,
//     the diagonal precisions and the accumulator are kept in that same order in a per-thread
//     buffer (permuted once per row: the order is its own inverse) and nothing is shuffled back
//     inside the loops; the accumulator returns to coordinate order once per row.  The generic
//     loops widened 8 values with a zero-extending load and a shift, on each pass.
//   float16 (F16C): two vcvtph2ps conversions from memory, in coordinate order.  The generic
//     path converts a few rows at a time into an L1 buffer first (draw_rows_cpu.h), a store and
//     a reload per value, because GCC does not vectorize _Float16 conversions.
// Sums over coordinates do not depend on the order.  Groups of 4 coordinates stay whole and
// aligned in a 128-bit half in both orders, so a block of 1, 2 or 4 coordinates is applied by
// in-lane permutes (P u = Σ_r c_r ⊙ u rotated by r within its block).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/et_score.h"
#include "../common/low_precision.h"
#include "metric_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ETWEEDIE_DRAWS16 1
#else
#define ETWEEDIE_DRAWS16 0
#endif

namespace etweedie {
namespace cpu {


// The block size of a k×k block metric that keeps its blocks within the unpacked lanes (1, 2, 4),
// 0 for the elementwise metrics, −1 for the rest.
template <typename Prec>
struct Block16 {
  static constexpr int value = -1;
};
template <>
struct Block16<RowPrec<float, kIsotropic, 0>> {
  static constexpr int value = 0;
};
template <>
struct Block16<RowPrec<float, kDiagonal, 0>> {
  static constexpr int value = 0;
};
template <int K>
struct Block16<RowPrec<float, kBlock, K>> {
  static constexpr int value = (K == 1 || K == 2 || K == 4) ? K : -1;
};

template <typename T, typename X, typename Prec>
constexpr bool kDraws16 = ETWEEDIE_DRAWS16 && std::is_same_v<T, float> &&
                          (std::is_same_v<X, bf16> || (ETWEEDIE_HW_HALF && std::is_same_v<X, fp16>)) &&
                          Block16<Prec>::value >= 0;

#if ETWEEDIE_DRAWS16
// 16 draw values as two float vectors (load16) and coordinate j's lane in that order (lane_of).
template <typename X>
struct Lanes16;

template <>
struct Lanes16<bf16> {
  static void load16(const bf16* x, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i z = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
  // an involution: 4–7 and 8–11 of each 16 swap
  static int64_t lane_of(int64_t j) {
    const int64_t t = j & 15;
    return (j & ~int64_t(15)) + (t >= 4 && t < 8 ? t + 4 : (t >= 8 && t < 12 ? t - 4 : t));
  }
};

#if ETWEEDIE_HW_HALF
template <>
struct Lanes16<fp16> {
  static void load16(const fp16* x, __m256& lo, __m256& hi) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)));
  }
  static int64_t lane_of(int64_t j) { return j; }
};
#endif

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// uᵀ P u for u = y − x, yp in the lanes' order; pu(u, j) is P u for the 8 lanes from j.
template <typename X, typename PU>
inline float quad16(const float* yp, const X* x, int64_t d, const PU& pu) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    __m256 lo, hi;
    Lanes16<X>::load16(x + j, lo, hi);
    const __m256 u0 = _mm256_sub_ps(_mm256_loadu_ps(yp + j), lo);
    const __m256 u1 = _mm256_sub_ps(_mm256_loadu_ps(yp + j + 8), hi);
    a0 = _mm256_fmadd_ps(u0, pu(u0, j), a0);
    a1 = _mm256_fmadd_ps(u1, pu(u1, j + 8), a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// u ↦ its lanes rotated by r within each group of K (K | 4; the groups are aligned to 4 lanes, so
// within one 128-bit half): lane l receives lane (l − l mod K) + (l mod K + r) mod K.
template <int K, int r>
inline __m256 rotate16(__m256 u) {
  if constexpr (r == 0) {
    return u;
  } else if constexpr (K == 2) {
    return _mm256_permute_ps(u, 0xB1);  // (1, 0, 3, 2)
  } else if constexpr (r == 1) {
    return _mm256_permute_ps(u, 0x39);  // (1, 2, 3, 0)
  } else if constexpr (r == 2) {
    return _mm256_permute_ps(u, 0x4E);  // (2, 3, 0, 1)
  } else {
    return _mm256_permute_ps(u, 0x93);  // (3, 0, 1, 2)
  }
}

// (P u) for a k×k block metric, K | 4: Σ_r c_r ⊙ rotate_r(u), c_r[l] = P[a][(a + r) mod K], a = l mod K
template <int K>
inline __m256 block_apply16(const __m256* c, __m256 u) {
  __m256 pu = _mm256_mul_ps(c[0], u);
  if constexpr (K > 1) pu = _mm256_fmadd_ps(c[1], rotate16<K, 1>(u), pu);
  if constexpr (K > 2) {
    pu = _mm256_fmadd_ps(c[2], rotate16<K, 2>(u), pu);
    pu = _mm256_fmadd_ps(c[3], rotate16<K, 3>(u), pu);
  }
  return pu;
}

// acc += Σ_t w_t (y − x_t) over R draws (R = 1 or 4), all in the lanes' order.
template <int R, typename X>
inline void accumulate16(const float* yp, const X* const* xs, const float* w, int64_t d, float* acc) {
  __m256 wv[R];
  for (int t = 0; t < R; ++t) wv[t] = _mm256_set1_ps(w[t]);
  for (int64_t j = 0; j < d; j += 16) {
    const __m256 ylo = _mm256_loadu_ps(yp + j), yhi = _mm256_loadu_ps(yp + j + 8);
    __m256 slo = _mm256_setzero_ps(), shi = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      __m256 lo, hi;
      Lanes16<X>::load16(xs[t] + j, lo, hi);
      slo = _mm256_fmadd_ps(wv[t], _mm256_sub_ps(ylo, lo), slo);
      shi = _mm256_fmadd_ps(wv[t], _mm256_sub_ps(yhi, hi), shi);
    }
    _mm256_storeu_ps(acc + j, _mm256_add_ps(_mm256_loadu_ps(acc + j), slo));
    _mm256_storeu_ps(acc + j + 8, _mm256_add_ps(_mm256_loadu_ps(acc + j + 8), shi));
  }
}

// weighted_residual_sum (et_score_cpu.h) for 16-bit draws and an isotropic, diagonal or k×k
// block (k = 1, 2, 4) metric, d % 16 == 0: the same contract (acc += Σ_i w(q_i) u_i, false when a draw is out of
// range), the same four-draw sweeps and skipped zero-weight single draws.
template <typename X, typename Prec, typename Weight>
bool weighted_residual_sum16(const Prec& prec, const float* y, const X* x, int64_t sxn, int64_t N, int64_t d,
                             const Weight& weight, float* acc) {
  constexpr bool kDiag = std::is_same_v<Prec, RowPrec<float, kDiagonal, 0>>;
  constexpr int K = Block16<Prec>::value;  // 0: isotropic or diagonal
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 3 * d) buf.resize(3 * d);
  float* yp = buf.data();
  float* pw = kDiag ? buf.data() + d : nullptr;
  float* ap = buf.data() + 2 * d;
  for (int64_t j = 0; j < d; ++j) {
    const int64_t l = Lanes16<X>::lane_of(j);
    yp[l] = y[j];
    if (kDiag) pw[l] = prec.p[j];
    ap[j] = 0.0f;
  }
  __m256 c[4];  // a block metric's coefficient vectors (block_apply16)
  if constexpr (K > 0) {
    alignas(32) float lanes[8];
    for (int r = 0; r < K; ++r) {
      for (int l = 0; l < 8; ++l) lanes[l] = prec.p[(l % K) * K + (l % K + r) % K];
      c[r] = _mm256_load_ps(lanes);
    }
  }
  const float scale = K == 0 && !kDiag ? prec.p[0] : 1.0f;
  auto quad = [&](const X* xr) {
    if constexpr (K > 0) {
      return quad16(yp, xr, d, [&c](__m256 u, int64_t) { return block_apply16<Block16<Prec>::value>(c, u); });
    } else if constexpr (kDiag) {
      return quad16(yp, xr, d, [pw](__m256 u, int64_t j) { return _mm256_mul_ps(_mm256_loadu_ps(pw + j), u); });
    } else {
      return scale * quad16(yp, xr, d, [](__m256 u, int64_t) { return u; });
    }
  };
  bool in_range = true;
  int64_t i = 0;
  for (; i + 4 <= N; i += 4) {
    const X* xs[4] = {x + i * sxn, x + (i + 1) * sxn, x + (i + 2) * sxn, x + (i + 3) * sxn};
    float q[4], w[4];
    for (int t = 0; t < 4; ++t) q[t] = quad(xs[t]);
    if (!(q_in_range(q[0]) && q_in_range(q[1]) && q_in_range(q[2]) && q_in_range(q[3]))) {
      for (int t = 0; t < 4; ++t) in_range = in_range && draw_in_range(q[t], y, xs[t], d);
    }
    for (int t = 0; t < 4; ++t) w[t] = weight(q[t]);
    accumulate16<4>(yp, xs, w, d, ap);
  }
  for (; i < N; ++i) {
    const X* xi = x + i * sxn;
    const float qi = quad(xi);
    in_range = in_range && draw_in_range(qi, y, xi, d);
    const float w = weight(qi);
    if (w == 0.0f) continue;
    accumulate16<1>(yp, &xi, &w, d, ap);
  }
  for (int64_t j = 0; j < d; ++j) acc[j] += ap[Lanes16<X>::lane_of(j)];
  return in_range;
}
#endif

}  // namespace cpu
}  // namespace etweedie
