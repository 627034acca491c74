// The forward's weighted residual sum (et_score, langevin_step, student_t_score), and its
// backward (the end of this file), with 16 coordinates per step held in registers, for float32,
// bfloat16 and float16 draws, isotropic, diagonal and k×k block metrics with k = 1, 2 or 4, d a
// multiple of 16, on CPUs with AVX2 + FMA.  The loops are written once over a form W of the 16
// lanes: Avx2 (two ymm) or Avx512 (one zmm, on CPUs with AVX-512 F/BW/DQ).  16-bit draws take the
// 512-bit form where the CPU has it, float32 draws the AVX2 form everywhere (Form16): on a Zen 5
// VM the 512-bit form ran the 16-bit forward 1.3–1.45× and fwd+bwd 1.1–1.4× faster, but the
// float32 forward from memory ~10% slower (benchmarks/RESULTS.md, CPU: 16-bit posterior draws).
//
// Widening the draws in registers, with no staging buffer:
//   float32: plain loads.
//   bfloat16 (a bfloat16 is the high half of its float32): Avx512: one zero-masked word permute
//     (vpermw) of the 16 values into the high halves of the 32-bit lanes, in coordinate order
//     (11% faster than a zero-extending load and a shift: benchmarks/probes/lanes16_loops.cpp).  Avx2: one load and two unpacks against zero,
//     which leave the values in a fixed lane order — within each group of 16 coordinates the low
//     vector holds 0–3 and 8–11, the high one 4–7 and 12–15 — so the query, the diagonal
//     precisions and the accumulator are kept in that same order in a per-thread buffer (permuted
//     once per row: the order is its own inverse) and nothing is shuffled inside the loops.
//   float16 (F16C): vcvtph2ps from memory, in coordinate order.  (The generic path converts a
//     few rows at a time into an L1 buffer, draw_rows_cpu.h: GCC does not vectorize _Float16
//     conversions.)
// Sums over coordinates do not depend on the order.  Groups of 4 coordinates stay whole and
// aligned in a 128-bit lane in both orders, so a block of 1, 2 or 4 coordinates is applied by
// in-lane permutes (P u = Σ_r c_r ⊙ u rotated by r within its block).
//
// Time: the draws are read from memory once, in the q sweep of a group of four (the second
// pass rereads them from L1).  Three things keep the sweeps off latencies: the four draws' q
// share one sweep (one draw alone would be bound by the FMA latency), the forward runs a group's
// second pass and the next group's q sweep as one sweep (accumulate_quad16), and the second pass
// prefetches the group after into L1 (memory would otherwise idle while it runs).  What remains is
// arithmetic: a subtraction and an FMA per coordinate on each pass, plus the widening — which
// the 512-bit form halves.  Every form, with every ISA level's helpers this CPU can run, is
// checked against the generic loops of et_score_cpu.h by tests/test_lanes16.py (a standalone
// build of these headers; -DETWEEDIE_LANES16_AVX2 forces the AVX2 form for all formats).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/et_score.h"
#include "../common/low_precision.h"
#include "metric_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ETWEEDIE_LANES16 1
#else
#define ETWEEDIE_LANES16 0
#endif
// The 512-bit form (for 16-bit draws) where the CPU has AVX-512 F/BW/DQ, unless
// ETWEEDIE_LANES16_AVX2 (a test build's switch) asks for the AVX2 form everywhere.
#if ETWEEDIE_LANES16 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    !defined(ETWEEDIE_LANES16_AVX2)
#define ETWEEDIE_LANES512 1
#else
#define ETWEEDIE_LANES512 0
#endif

namespace etweedie {
namespace cpu {

// The block size of a k×k block metric that keeps its blocks within the 128-bit lanes (1, 2,
// 4), 0 for the elementwise metrics, −1 for the rest.
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
constexpr bool kLanes16 = ETWEEDIE_LANES16 && std::is_same_v<T, float> &&
                          (std::is_same_v<X, float> || std::is_same_v<X, bf16> ||
                           (ETWEEDIE_HW_HALF && std::is_same_v<X, fp16>)) &&
                          Block16<Prec>::value >= 0;

#if ETWEEDIE_LANES16
// The two forms of 16 floats in registers and the few operations the loops need: Avx2 holds them
// in two ymm, Avx512 in one zmm.  W::Q is the backward's first-pass accumulator (one per sum and
// draw: a ymm that takes both halves of a V by two FMAs, or a zmm).
struct Avx2 {
  struct V {
    __m256 lo, hi;
  };
  using Q = __m256;
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
  }
  static V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static float hsum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
  template <int IMM>
  static V permute(V a) {
    return {_mm256_permute_ps(a.lo, IMM), _mm256_permute_ps(a.hi, IMM)};
  }
  static Q qzero() { return _mm256_setzero_ps(); }
  static Q qfma(V a, V b, Q c) { return _mm256_fmadd_ps(a.hi, b.hi, _mm256_fmadd_ps(a.lo, b.lo, c)); }
  static float qsum(Q a) { return hsum8(a); }
  static float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
};

#if ETWEEDIE_LANES512
struct Avx512 {
  struct V {
    __m512 v;
  };
  using Q = __m512;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V set1(float a) { return {_mm512_set1_ps(a)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
  static V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
  static V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static float hsum(V a) { return _mm512_reduce_add_ps(a.v); }
  template <int IMM>
  static V permute(V a) {
    return {_mm512_permute_ps(a.v, IMM)};
  }
  static Q qzero() { return _mm512_setzero_ps(); }
  static Q qfma(V a, V b, Q c) { return _mm512_fmadd_ps(a.v, b.v, c); }
  static float qsum(Q a) { return _mm512_reduce_add_ps(a); }
};
#endif

// The form a draw format's loops take: the 512-bit one for 16-bit draws where the CPU has it,
// the AVX2 one for float32 draws everywhere (its 512-bit form measured slower from memory).
template <typename X>
struct Form16 {
  using type = Avx2;
};
#if ETWEEDIE_LANES512
template <>
struct Form16<bf16> {
  using type = Avx512;
};
#if ETWEEDIE_HW_HALF
template <>
struct Form16<fp16> {
  using type = Avx512;
};
#endif
#endif

template <typename W>
using V16 = typename W::V;

// 16 draw values widened to float (load16), and coordinate j's lane in that order (lane_of).
template <typename W, typename X>
struct Lanes16;

template <>
struct Lanes16<Avx2, float> {
  static V16<Avx2> load16(const float* x) { return Avx2::load(x); }
  static int64_t lane_of(int64_t j) { return j; }
};

template <>
struct Lanes16<Avx2, bf16> {
  static V16<Avx2> load16(const bf16* x) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i z = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v))};
  }
  // an involution: 4–7 and 8–11 of each 16 swap
  static int64_t lane_of(int64_t j) {
    const int64_t t = j & 15;
    return (j & ~int64_t(15)) + (t >= 4 && t < 8 ? t + 4 : (t >= 8 && t < 12 ? t - 4 : t));
  }
};

#if ETWEEDIE_HW_HALF
template <>
struct Lanes16<Avx2, fp16> {
  static V16<Avx2> load16(const fp16* x) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)))};
  }
  static int64_t lane_of(int64_t j) { return j; }
};
#endif

#if ETWEEDIE_LANES512
template <>
struct Lanes16<Avx512, bf16> {  // value j to the high half of 32-bit lane j, zeros below: one vpermw, coordinate order
  static V16<Avx512> load16(const bf16* x) {
    const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3,
                                         0, 2, 0, 1, 0, 0, 0);
    return {_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, v))};
  }
  static int64_t lane_of(int64_t j) { return j; }
};

#if ETWEEDIE_HW_HALF
template <>
struct Lanes16<Avx512, fp16> {
  static V16<Avx512> load16(const fp16* x) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)))};
  }
  static int64_t lane_of(int64_t j) { return j; }
};
#endif
#endif

// q_t = u_tᵀ P u_t for u_t = y − x_t, t < R (R = 1 or 4), yp in the lanes' order; pu(u, j) is
// P u for the 16 lanes from j.  The R draws share one sweep, with an accumulator chain per draw
// (two under Avx2, the halves of its V): one draw at a time would be bound by the FMA latency.
// One 16-lane step of it: a[t] += u_t ⊙ P u_t over the lanes from j (yv: y's lanes there).
template <typename W, int R, typename X, typename PU>
inline void quad_step16(V16<W> yv, const X* const* xs, int64_t j, const PU& pu, V16<W>* a) {
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const V16<W> u = W::sub(yv, Lanes16<W, X>::load16(xs[t] + j));
    a[t] = W::fma(u, pu(u, j), a[t]);
  }
}

template <typename W, int R, typename X, typename PU>
inline void quad16(const float* yp, const X* const* xs, int64_t d, const PU& pu, float* q) {
  V16<W> a[R];
  for (int t = 0; t < R; ++t) a[t] = W::zero();
  for (int64_t j = 0; j < d; j += 16) quad_step16<W, R>(W::load(yp + j), xs, j, pu, a);
  for (int t = 0; t < R; ++t) q[t] = W::hsum(a[t]);
}

// u ↦ its lanes rotated by r within each group of K (K | 4; the groups are aligned to 4 lanes, so
// within one 128-bit lane): lane l receives lane (l − l mod K) + (l mod K + r) mod K.
template <typename W, int K, int r>
inline V16<W> rotate16(V16<W> u) {
  if constexpr (r == 0) {
    return u;
  } else if constexpr (K == 2) {
    return W::template permute<0xB1>(u);  // (1, 0, 3, 2)
  } else if constexpr (r == 1) {
    return W::template permute<0x39>(u);  // (1, 2, 3, 0)
  } else if constexpr (r == 2) {
    return W::template permute<0x4E>(u);  // (2, 3, 0, 1)
  } else {
    return W::template permute<0x93>(u);  // (3, 0, 1, 2)
  }
}

// (P u) for a k×k block metric, K | 4: Σ_r c_r ⊙ rotate_r(u), c_r[l] = P[a][(a + r) mod K], a = l mod K
template <typename W, int K>
inline V16<W> block_apply16(const V16<W>* c, V16<W> u) {
  V16<W> pu = W::mul(c[0], u);
  if constexpr (K > 1) pu = W::fma(c[1], rotate16<W, K, 1>(u), pu);
  if constexpr (K > 2) {
    pu = W::fma(c[2], rotate16<W, K, 2>(u), pu);
    pu = W::fma(c[3], rotate16<W, K, 3>(u), pu);
  }
  return pu;
}

// acc += Σ_t w_t (y − x_t) over R draws (R = 1 or 4), all in the lanes' order.  With next
// (R draws), their rows are prefetched into L1 along the way: this pass reads its draws from L1,
// so memory would otherwise idle while it runs and the next q sweep wait on every line.
// One 16-lane step of it: acc[j, j + 16) += Σ_t w_t (y − x_t) (wv: the weights broadcast).
template <typename W, int R, typename X>
inline void accumulate_step16(V16<W> yv, const X* const* xs, const V16<W>* wv, int64_t j, float* acc) {
  V16<W> s = W::zero();
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) s = W::fma(wv[t], W::sub(yv, Lanes16<W, X>::load16(xs[t] + j)), s);
  W::store(acc + j, W::add(W::load(acc + j), s));
}

template <typename W, int R, typename X>
inline void accumulate16(const float* yp, const X* const* xs, const float* w, int64_t d, float* acc,
                         const X* const* next = nullptr) {
  V16<W> wv[R];
  for (int t = 0; t < R; ++t) wv[t] = W::set1(w[t]);
  // a cache line holds 16 or 32 draw values, a whole number of 16-value steps
  with_next_prefetched<X>(d, next, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += 16) accumulate_step16<W, R>(W::load(yp + j), xs, wv, j, acc);
  });
}

// One sweep for two groups of four draws: acc += Σ_t w_t (y − x_t) over the current group xc
// (read from L1, where the previous sweep left it; the same sums, in the same order, as
// accumulate16<4>) and q_t = u_tᵀ P u_t of the next group xn (read from memory, as quad16<4>
// would, with the same sums in the same order as the two passes in turn).  One sweep holds both
// passes' independent work, and memory serves the next group while the current
// one accumulates: 1.08–1.20× faster forwards (benchmarks/RESULTS.md, CPU: et_score and
// langevin_step).  next: the group after xn (or null), prefetched into L1 along the way.
template <typename W, typename X, typename PU>
inline void accumulate_quad16(const float* yp, const X* const* xc, const float* w, const X* const* xn, int64_t d,
                              const PU& pu, float* acc, float* qn, const X* const* next) {
  V16<W> wv[4], a[4];
  for (int t = 0; t < 4; ++t) wv[t] = W::set1(w[t]), a[t] = W::zero();
  with_next_prefetched<X>(d, next, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += 16) {
      const V16<W> yv = W::load(yp + j);
      quad_step16<W, 4>(yv, xn, j, pu, a);
      accumulate_step16<W, 4>(yv, xc, wv, j, acc);
    }
  });
  for (int t = 0; t < 4; ++t) qn[t] = W::hsum(a[t]);
}

// P u for the 16 lanes from j under an isotropic, diagonal or k×k block (k = 1, 2, 4) metric,
// the form the sweeps take as their pu: an isotropic metric returns u (its p is `scale`, which
// the caller applies to q and to the gradient's coefficient; 1 for the other kinds), a diagonal
// one multiplies by its precisions in the lanes' order (pw), a block one applies block_apply16.
template <typename W, typename Prec>
struct MetricLanes16 {
  static constexpr int K = Block16<Prec>::value;  // 0: isotropic or diagonal
  static constexpr bool kDiag = std::is_same_v<Prec, RowPrec<float, kDiagonal, 0>>;
  V16<W> c[4];      // a block metric's coefficient vectors
  const float* pw;  // a diagonal metric's precisions in the lanes' order
  float scale;
  MetricLanes16(const Prec& P, const float* pw_lanes) : pw(pw_lanes), scale(K == 0 && !kDiag ? P.p[0] : 1.0f) {
    if constexpr (K > 0) {
      float lanes[16];
      for (int r = 0; r < K; ++r) {
        for (int l = 0; l < 16; ++l) lanes[l] = P.p[(l % K) * K + (l % K + r) % K];
        c[r] = W::load(lanes);
      }
    }
  }
  V16<W> operator()(V16<W> u, int64_t j) const {
    if constexpr (K > 0) {
      return block_apply16<W, K>(c, u);
    } else if constexpr (kDiag) {
      return W::mul(W::load(pw + j), u);
    } else {
      return u;
    }
  }
};

// weighted_residual_sum (et_score_cpu.h) for an isotropic, diagonal or k×k block (k = 1, 2, 4)
// metric, d % 16 == 0: the same contract (acc += Σ_i w(q_i) u_i, false when a draw is out of
// range), the same four-draw groups (a group's accumulation and the next group's q in one sweep,
// accumulate_quad16) and skipped zero-weight single draws.
template <typename W, typename X, typename Prec, typename Weight>
bool weighted_residual_sum16_form(const Prec& prec, const float* y, const X* x, int64_t sxn, int64_t N, int64_t d,
                                  const Weight& weight, float* acc) {
  using ML = MetricLanes16<W, Prec>;
  constexpr bool kDiag = ML::kDiag;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 3 * d) buf.resize(3 * d);
  float* yp = buf.data();
  float* pw = kDiag ? buf.data() + d : nullptr;
  float* ap = buf.data() + 2 * d;
  for (int64_t j = 0; j < d; ++j) {
    const int64_t l = Lanes16<W, X>::lane_of(j);
    yp[l] = y[j];
    if (kDiag) pw[l] = prec.p[j];
    ap[j] = 0.0f;
  }
  const ML pu(prec, pw);
  auto scaled = [&](int R, float* q) {  // an isotropic metric's p, which the sweeps leave out
    if constexpr (ML::K == 0 && !kDiag) {
      for (int t = 0; t < R; ++t) q[t] *= pu.scale;
    }
  };
  // q of R draws at once (quad16)
  auto quad = [&](auto r, const X* const* xr, float* q) {
    constexpr int R = decltype(r)::value;
    quad16<W, R>(yp, xr, d, pu, q);
    scaled(R, q);
  };
  bool in_range = true;
  int64_t i = 0;
  float q[4];  // the q of the group from i, computed by the sweep before
  if (N >= 4) {
    const X* x0[4] = {x, x + sxn, x + 2 * sxn, x + 3 * sxn};
    quad(std::integral_constant<int, 4>{}, x0, q);
  }
  for (; i + 4 <= N; i += 4) {
    const X* xs[4] = {x + i * sxn, x + (i + 1) * sxn, x + (i + 2) * sxn, x + (i + 3) * sxn};
    float w[4];
    constexpr int L = Weight::kLaw;
    if (!(q_in_range<L>(q[0]) && q_in_range<L>(q[1]) && q_in_range<L>(q[2]) && q_in_range<L>(q[3]))) {
      for (int t = 0; t < 4; ++t) in_range = in_range && draw_in_range<L>(q[t], y, xs[t], d);
    }
    for (int t = 0; t < 4; ++t) w[t] = weight(q[t]);
    if (i + 8 <= N) {  // this group's accumulation and the next group's q in one sweep
      const X* nx[4] = {xs[0] + 4 * sxn, xs[1] + 4 * sxn, xs[2] + 4 * sxn, xs[3] + 4 * sxn};
      const X* nnx[4] = {xs[0] + 8 * sxn, xs[1] + 8 * sxn, xs[2] + 8 * sxn, xs[3] + 8 * sxn};
      accumulate_quad16<W, X>(yp, xs, w, nx, d, pu, ap, q, i + 12 <= N ? nnx : nullptr);
      scaled(4, q);
    } else {
      accumulate16<W, 4>(yp, xs, w, d, ap);
    }
  }
  for (; i < N; ++i) {
    const X* xi = x + i * sxn;
    float qi;
    quad(std::integral_constant<int, 1>{}, &xi, &qi);
    in_range = in_range && draw_in_range<Weight::kLaw>(qi, y, xi, d);
    const float w = weight(qi);
    if (w == 0.0f) continue;
    accumulate16<W, 1>(yp, &xi, &w, d, ap);
  }
  for (int64_t j = 0; j < d; ++j) acc[j] += ap[Lanes16<W, X>::lane_of(j)];
  return in_range;
}

template <typename X, typename Prec, typename Weight>
bool weighted_residual_sum16(const Prec& prec, const float* y, const X* x, int64_t sxn, int64_t N, int64_t d,
                             const Weight& weight, float* acc) {
  return weighted_residual_sum16_form<typename Form16<X>::type>(prec, y, x, sxn, N, d, weight, acc);
}

// ---------------------------------------------------------------------------- backward

// 16 gradient values in the lanes' order of X, rounded to X in coordinate order and written with
// a streaming store to dst (32-byte aligned): ∂L/∂x goes from registers to memory, with no L1 row
// to round and copy afterwards (bfloat16 in the unpacked order: narrow16_bf16_unpacked,
// csrc/common/low_precision.h).
template <typename W, typename X>
struct Stream16;

template <>
struct Stream16<Avx2, float> {
  static void store(float* dst, V16<Avx2> g) {
    _mm256_stream_ps(dst, g.lo);
    _mm256_stream_ps(dst + 8, g.hi);
  }
};

template <>
struct Stream16<Avx2, bf16> {
  static void store(bf16* dst, V16<Avx2> g) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), narrow16_bf16_unpacked(g.lo, g.hi));
  }
};

#if ETWEEDIE_HW_HALF
template <>
struct Stream16<Avx2, fp16> {
  static void store(fp16* dst, V16<Avx2> g) {
    const __m128i lo = _mm256_cvtps_ph(g.lo, _MM_FROUND_TO_NEAREST_INT);
    const __m128i hi = _mm256_cvtps_ph(g.hi, _MM_FROUND_TO_NEAREST_INT);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_set_m128i(hi, lo));
  }
};
#endif

#if ETWEEDIE_LANES512
// 512-bit bfloat16: one vcvtneps2bf16 where the CPU has AVX512-BF16 and the block holds no
// subnormal (which it would flush), else the exact integer rounding (low_precision.h).
template <>
struct Stream16<Avx512, bf16> {
  static void store(bf16* dst, V16<Avx512> g) {
#if defined(__AVX512BF16__)
    if (bf16_hw_rounds(g.v)) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(g.v)));
      return;
    }
#endif
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, g.v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), narrow16_bf16_exact(tmp));
  }
};

#if ETWEEDIE_HW_HALF
template <>
struct Stream16<Avx512, fp16> {
  static void store(fp16* dst, V16<Avx512> g) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(g.v, _MM_FROUND_TO_NEAREST_INT));
  }
};
#endif
#endif

// The backward's first pass for R draws (R = 1 or 4): q_t = u_tᵀ P u_t, hu_t = h·u_t,
// u_t = y − x_t; pu(u, j) is P u for the 16 lanes from j (an isotropic metric: u, its scale applied
// by the caller).  One accumulator per sum (W::Q: a ymm that takes 16 coordinates by two FMAs, or
// a zmm): the 2R sums are the independent chains, and they leave registers for y, h and u.
// One 16-lane step of it (yv, hv: y's and h's lanes from j), and the sums at the end.
template <typename W, int R, typename X, typename PU>
inline void quad_dot_step16(V16<W> yv, V16<W> hv, const X* const* xs, int64_t j, const PU& pu, typename W::Q* aq,
                            typename W::Q* ah) {
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const V16<W> u = W::sub(yv, Lanes16<W, X>::load16(xs[t] + j));
    const V16<W> pv = pu(u, j);
    aq[t] = W::qfma(u, pv, aq[t]);
    ah[t] = W::qfma(hv, u, ah[t]);
  }
}

template <typename W, int R>
inline void quad_dot_sums16(const typename W::Q* aq, const typename W::Q* ah, float* q, float* hu) {
  for (int t = 0; t < R; ++t) {
    q[t] = W::qsum(aq[t]);
    hu[t] = W::qsum(ah[t]);
  }
}

template <typename W, int R, typename X, typename PU>
inline void quad_dot16(const float* yp, const float* hp, const X* const* xs, int64_t d, const PU& pu, float* q,
                       float* hu) {
  typename W::Q aq[R], ah[R];
  for (int t = 0; t < R; ++t) aq[t] = ah[t] = W::qzero();
  for (int64_t j = 0; j < d; j += 16) quad_dot_step16<W, R>(W::load(yp + j), W::load(hp + j), xs, j, pu, aq, ah);
  quad_dot_sums16<W, R>(aq, ah, q, hu);
}

// The backward's second pass for R draws (still in L1): g_t = a_t h + c_t P u_t, gyp += Σ_t g_t
// (lanes' order), and −g_t streamed to gx[t] (x's format; gx null: ∂L/∂x not wanted); pu as in
// quad_dot16 (c holds c_t·p for an isotropic metric).  next (R rows, or null) is prefetched into
// L1 along the way, as in accumulate16.
// One 16-lane step of it (na, nc: −a_t and −c_t broadcast).
template <typename W, int R, typename X, typename PU>
inline void grad_step16(V16<W> yv, V16<W> hv, const X* const* xs, const V16<W>* na, const V16<W>* nc, int64_t j, const PU& pu,
                        float* gyp, X* const* gx) {
  V16<W> sum = W::load(gyp + j);
#pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const V16<W> u = pu(W::sub(yv, Lanes16<W, X>::load16(xs[t] + j)), j);
    const V16<W> ng = W::fma(nc[t], u, W::mul(na[t], hv));  // −g_t, rounded as g_t
    sum = W::sub(sum, ng);
    if (gx != nullptr) Stream16<W, X>::store(gx[t] + j, ng);
  }
  W::store(gyp + j, sum);
}

template <typename W, int R, typename X, typename PU>
inline void grad16(const float* yp, const float* hp, const X* const* xs, const float* a, const float* c, int64_t d,
                   const PU& pu, float* gyp, X* const* gx, const X* const* next) {
  V16<W> na[R], nc[R];
  for (int t = 0; t < R; ++t) na[t] = W::set1(-a[t]), nc[t] = W::set1(-c[t]);
  with_next_prefetched<X>(d, next, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += 16) grad_step16<W, R>(W::load(yp + j), W::load(hp + j), xs, na, nc, j, pu, gyp, gx);
  });
}

// grad16<4> over the current group xc and quad_dot16<4> over the next group xn in one sweep, as
// accumulate_quad16 does for the forward (the same sums in the same order as the two passes in
// turn).  next: the group after xn (or null), prefetched into L1.
template <typename W, typename X, typename PU>
inline void grad_quad_dot16(const float* yp, const float* hp, const X* const* xc, const float* a, const float* c,
                            int64_t d, const PU& pu, float* gyp, X* const* gx, const X* const* xn, float* qn,
                            float* hun, const X* const* next) {
  V16<W> na[4], nc[4];
  typename W::Q aq[4], ah[4];
  for (int t = 0; t < 4; ++t) na[t] = W::set1(-a[t]), nc[t] = W::set1(-c[t]), aq[t] = ah[t] = W::qzero();
  with_next_prefetched<X>(d, next, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += 16) {
      const V16<W> yv = W::load(yp + j), hv = W::load(hp + j);
      quad_dot_step16<W, 4>(yv, hv, xn, j, pu, aq, ah);
      grad_step16<W, 4>(yv, hv, xc, na, nc, j, pu, gyp, gx);
    }
  });
  quad_dot_sums16<W, 4>(aq, ah, qn, hun);
}

// weighted_residual_sum_bwd (et_score_cpu.h) for an isotropic, diagonal or k×k block (k = 1, 2,
// 4) metric, d % 16 == 0, no metric gradient, and gx (N rows of d values, or null) 32-byte
// aligned: the same contract and the same four-draw groups, with both passes in registers
// (quad_dot16, grad16, a group's gradients and the next group's q in one sweep by grad_quad_dot16;
// a block applied by in-lane permutes, block_apply16).  Returns
// the weight parameter's gradient (1/N) Σ_i shape_term when want_shape, else 0.
template <typename W, typename X, typename Prec, typename Weight>
float weighted_residual_sum_bwd16_form(const Prec& P, const Weight& weight, const float* y, const X* x, int64_t sxn,
                                       int64_t N, int64_t d, const float* h, float* gy, X* gx, bool want_shape) {
  using ML = MetricLanes16<W, Prec>;
  constexpr bool kDiag = ML::kDiag;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 4 * d) buf.resize(4 * d);
  float* yp = buf.data();
  float* hp = buf.data() + d;
  float* gyp = buf.data() + 2 * d;
  float* pw = buf.data() + 3 * d;  // diagonal precisions
  for (int64_t j = 0; j < d; ++j) {
    const int64_t l = Lanes16<W, X>::lane_of(j);
    yp[l] = y[j];
    hp[l] = h[j];
    if (kDiag) pw[l] = P.p[j];
    gyp[j] = 0.0f;
  }
  const ML pu(P, pw);
  const float scale = pu.scale;  // an isotropic metric's p, applied to q and c
  const float inv_n = 1.0f / static_cast<float>(N);
  float gshape = 0.0f;
  // a, c of R draws from their q, h·u (c scaled by an isotropic p for grad16)
  auto coefficients = [&](int R, float* q, const float* hu, float* a, float* c) {
    for (int t = 0; t < R; ++t) {
      q[t] *= scale;
      const float w = weight(q[t]);
      const float ct = weight.slope(q[t], w) * hu[t];
      a[t] = w * inv_n;
      c[t] = ct * inv_n * scale;
      if (want_shape) gshape += weight.shape_term(q[t], w, hu[t]);
    }
  };
  int64_t i = 0;
  float q[4], hu[4];  // q and h·u of the group from i, computed by the sweep before
  if (N >= 4) {
    const X* x0[4] = {x, x + sxn, x + 2 * sxn, x + 3 * sxn};
    quad_dot16<W, 4, X>(yp, hp, x0, d, pu, q, hu);
  }
  for (; i + 4 <= N; i += 4) {
    const X* xs[4] = {x + i * sxn, x + (i + 1) * sxn, x + (i + 2) * sxn, x + (i + 3) * sxn};
    X* gr[4] = {};
    if (gx != nullptr) {
      for (int t = 0; t < 4; ++t) gr[t] = gx + (i + t) * d;
    }
    float a[4], c[4];
    coefficients(4, q, hu, a, c);
    if (i + 8 <= N) {  // this group's gradients and the next group's q, h·u in one sweep
      const X* nx[4] = {xs[0] + 4 * sxn, xs[1] + 4 * sxn, xs[2] + 4 * sxn, xs[3] + 4 * sxn};
      const X* nnx[4] = {xs[0] + 8 * sxn, xs[1] + 8 * sxn, xs[2] + 8 * sxn, xs[3] + 8 * sxn};
      grad_quad_dot16<W, X>(yp, hp, xs, a, c, d, pu, gyp, gx != nullptr ? gr : nullptr, nx, q, hu,
                         i + 12 <= N ? nnx : nullptr);
    } else {
      grad16<W, 4, X>(yp, hp, xs, a, c, d, pu, gyp, gx != nullptr ? gr : nullptr, nullptr);
    }
  }
  for (; i < N; ++i) {
    const X* xi = x + i * sxn;
    X* gr = gx != nullptr ? gx + i * d : nullptr;
    float q, hu, a, c;
    quad_dot16<W, 1, X>(yp, hp, &xi, d, pu, &q, &hu);
    coefficients(1, &q, &hu, &a, &c);
    if (a == 0.0f && c == 0.0f) {  // coincident draw (or q = ∞): contributes nothing
      if (gr != nullptr) std::fill(gr, gr + d, narrow<X>(0.0f));
      continue;
    }
    grad16<W, 1, X>(yp, hp, &xi, &a, &c, d, pu, gyp, gx != nullptr ? &gr : nullptr, nullptr);
  }
  for (int64_t j = 0; j < d; ++j) gy[j] += gyp[Lanes16<W, X>::lane_of(j)];
  return gshape * inv_n;
}

template <typename X, typename Prec, typename Weight>
float weighted_residual_sum_bwd16(const Prec& P, const Weight& weight, const float* y, const X* x, int64_t sxn,
                                  int64_t N, int64_t d, const float* h, float* gy, X* gx, bool want_shape) {
  return weighted_residual_sum_bwd16_form<typename Form16<X>::type>(P, weight, y, x, sxn, N, d, h, gy, gx,
                                                                    want_shape);
}
#endif

}  // namespace cpu
}  // namespace etweedie
