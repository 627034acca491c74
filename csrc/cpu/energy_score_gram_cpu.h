// Row kernel of the CPU energy score for large d (float32, d ≥ 64, 1 ≤ M ≤ 255 draws per row,
// gradients of the draws and the target only) — the training loss of an image posterior, e.g.
// B = 64 examples × M = 32 draws, or B = 256 × M = 2, in d = 784, with a per-row β and metric.
//
//   ES = w_c Σ_i E(x_i − y) + w_w Σ_{i<j} E(x_i − x_j),   E(u) = (uᵀPu)^{β/2}
//
// One task per row.  The row's M draws and its target form one cloud of n = M + 1 points
// (the target is point M: its pairs carry w_c, the draws' pairs w_w).  Per row:
//   1. shifted centre: c = the mean of the n points (from their differences to the first), u_i = x_i − c — the pair distances are
//      translation invariant, so an offset of 1e4 costs nothing;
//   2. range: u and P are scaled by powers of two so that max|u| and max|P| lie in [½, 1)
//      (exact in float), and the value and gradients are scaled back in float64 at the end —
//      no overflow or underflow in the squared norms for clouds of any magnitude;
//   3. the metric in-kernel: v_i = P u_i per point (isotropic, diagonal or k×k block applied
//      from the row's own parameter; no whitened copies, no Cholesky), norms n_i = u_i·v_i;
//   4. G_ij = u_i·v_j for j > i with the 4 × 16 register-blocked micro-kernel of
//      energy_gram_cpu.h (one FMA per coordinate per pair) over panels of the draws, and the
//      target's column by n dot products; q_ij = n_i + n_j − 2 G_ij;
//   5. cancellation control: a pair with q_ij < 2⁻⁶ (n_i + n_j) is recomputed from the
//      difference of its source points, w = (x_i − x_j)·2^{-e} rounded once, as wᵀPw (coincident
//      points therefore give exactly 0; u_i − u_j would carry the centring's roundings), and its
//      gradient c·Pw is added from that difference, not from the split form below;
//   6. energies and slopes s_ij (one power per pair), c_ij = w_ij s_ij, and the gradient
//        ∂/∂x_i = Σ_j c_ij P (u_i − u_j) = (Σ_j c_ij) v_i − (C V)_i
//      with C·V the second register-blocked product of energy_gram_cpu.h (gram_cy_4).
// Few points (n ≤ 4, e.g. training's m = 2 draws): every pair takes step 5's exact form — a
// 16-point panel would be mostly padding, and 3–6 direct differences cost less than packing.
// Cost: about 1.5 n² d FMAs per row (G is symmetric) against ~4 n² d flops of the direct
// engine (difference, square, and the gradient's second difference); memory O(n·d) scratch per
// thread, nothing of size B·M·d besides the outputs.  Rows are split over the threads
// (at::parallel_for, one row per task).
//
// NaN/inf: a row whose points, β or metric are not finite gets a NaN value and NaN gradients
// (never a silent 0).  With the range control of step 2 this kernel needs neither the
// float64 fallback for float32 data near the ends of its range nor the NaN-row pass of the
// Python op, with two exceptions it hands back (`redo`, which the caller recomputes with the
// pair engine in float64, energy_score_cpu.cpp): a row whose points overflow float when centred
// (coordinates near ±3.4e38 of both signs), and a row with a pair closer than 2⁻⁵⁰ of its
// largest centred coordinate (q' < 2⁻¹⁰⁰: a tight cluster beside a point ~10¹⁵ times farther
// out), where q' and the pair's difference in float would lose digits to the single row scale.
// The Python op (etweedie/ops/energy_score.py skips both when this kernel runs, by the same
// conditions: energy_score_gram_applicable).  β and metric gradients are not produced here:
// those calls take the general engine (energy_cpu.h).  ETWEEDIE_CPU_GRAM=0 turns this path
// off too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "energy_gram_cpu.h"
#include "energy_tile_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kScoreGramMaxPoints = 256;  // n = M + 1; scratch per thread ≈ 4·n·d + n² floats
// Points per panel of the row kernel's Gram matrix: 16 on every CPU (the pair engine's 32-point
// panels on AVX-512 CPUs would be half padding for the usual 8–64 draws: 1.05–1.15× slower at M = 32).
constexpr int64_t kScoreNR = 16;
// Up to this many points every pair is formed from its exact difference (no Gram form).
constexpr int64_t kScoreDirectMaxPoints = 4;
// Coordinates per block of the gradient product C·V (n rows × 128 floats ≤ 32 KiB of L1 at n ≤ 64).
constexpr int64_t kScoreCvBlock = 128;
// A pair with 0 < q' < this (in the row's scaled units, max|u'| and max|P'| in [½, 1)) sends its
// row to the float64 pair engine: q', P'w and the energies stay far from float's subnormals.
constexpr double kScoreTinyQ = 0x1p-100;

// Keep in step with etweedie/ops/energy_score.py (_gram_row_kernel), which skips its float32
// range and NaN-row passes exactly when this holds.
inline bool energy_score_gram_applicable(const at::Tensor& samples, const at::Tensor& target, bool need_beta,
                                         bool need_prec) {
  if (samples.dim() != 3) return false;
  const int64_t M = samples.size(1), d = samples.size(2);
  return gram_env_enabled() && samples.scalar_type() == at::kFloat && target.scalar_type() == at::kFloat &&
         !need_beta && !need_prec && d >= kGramMinD && M >= 1 && M + 1 <= kScoreGramMaxPoints && target.dim() == 2 &&
         target.stride(1) == 1;
}

// panel[k·16 + t] = V[(i0 + t)·d + k] for t < cnt ≤ 16: points i0 … i0 + cnt − 1 of the
// row-major V into their (d, 16) coordinate-major panel; full groups of 8 points go through an
// 8 × 8 register transpose (8 vector stores instead of 64 scalar ones).
inline void gram_store_panel(const float* V, int64_t i0, int64_t cnt, int64_t d, float* panel) {
  int64_t t0 = 0;
#ifdef ETWEEDIE_GRAM_AVX2
  for (; t0 + 8 <= cnt; t0 += 8) {
    const float* src = V + (i0 + t0) * d;
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) {
      __m256 r0 = _mm256_loadu_ps(src + k), r1 = _mm256_loadu_ps(src + d + k), r2 = _mm256_loadu_ps(src + 2 * d + k),
             r3 = _mm256_loadu_ps(src + 3 * d + k), r4 = _mm256_loadu_ps(src + 4 * d + k),
             r5 = _mm256_loadu_ps(src + 5 * d + k), r6 = _mm256_loadu_ps(src + 6 * d + k),
             r7 = _mm256_loadu_ps(src + 7 * d + k);
      const __m256 a0 = _mm256_unpacklo_ps(r0, r1), a1 = _mm256_unpackhi_ps(r0, r1), a2 = _mm256_unpacklo_ps(r2, r3),
                   a3 = _mm256_unpackhi_ps(r2, r3), a4 = _mm256_unpacklo_ps(r4, r5), a5 = _mm256_unpackhi_ps(r4, r5),
                   a6 = _mm256_unpacklo_ps(r6, r7), a7 = _mm256_unpackhi_ps(r6, r7);
      const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE),
                   b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE),
                   b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE),
                   b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
      float* dst = panel + k * kScoreNR + t0;
      _mm256_storeu_ps(dst + 0 * kScoreNR, _mm256_permute2f128_ps(b0, b4, 0x20));
      _mm256_storeu_ps(dst + 1 * kScoreNR, _mm256_permute2f128_ps(b1, b5, 0x20));
      _mm256_storeu_ps(dst + 2 * kScoreNR, _mm256_permute2f128_ps(b2, b6, 0x20));
      _mm256_storeu_ps(dst + 3 * kScoreNR, _mm256_permute2f128_ps(b3, b7, 0x20));
      _mm256_storeu_ps(dst + 4 * kScoreNR, _mm256_permute2f128_ps(b0, b4, 0x31));
      _mm256_storeu_ps(dst + 5 * kScoreNR, _mm256_permute2f128_ps(b1, b5, 0x31));
      _mm256_storeu_ps(dst + 6 * kScoreNR, _mm256_permute2f128_ps(b2, b6, 0x31));
      _mm256_storeu_ps(dst + 7 * kScoreNR, _mm256_permute2f128_ps(b3, b7, 0x31));
    }
    for (; k < d; ++k)
      for (int64_t t = 0; t < 8; ++t) panel[k * kScoreNR + t0 + t] = src[t * d + k];
  }
#endif
  for (int64_t t = t0; t < cnt; ++t) {
    const float* src = V + (i0 + t) * d;
    for (int64_t k = 0; k < d; ++k) panel[k * kScoreNR + t] = src[k];
  }
}

// Σ_k a_k b_k in float (8 lanes × 4 accumulators; the order of the sum is free): one entry
// of G, as accurate as the micro-kernel's.
inline float dot_f32(const float* a, const float* b, int64_t d) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < d; ++k) s += a[k] * b[k];
  return s;
}

// Σ_k a_k b_k in float64 (vectorized: the order of the sum is free).
inline double dot_f64(const float* a, const float* b, int64_t d) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < d; ++k) s += static_cast<double>(a[k]) * static_cast<double>(b[k]);
  return s;
}

// One row's precision, scaled by 2^{-ep} so that its largest entry lies in [½, 1): v = P'u.
struct ScaledRowPrec {
  int64_t kind = kIsotropic, K = 0;
  float p = 1.0f;          // isotropic
  float blk[16] = {};      // block, K × K
  std::vector<float> diag;  // diagonal, d
  int ep = 0;               // P = 2^{ep} P'
  bool finite = true;

  ScaledRowPrec(const float* pr, int64_t kind_, int64_t K_, int64_t d) : kind(kind_), K(K_) {
    const int64_t cnt = kind == kIsotropic ? 1 : (kind == kDiagonal ? d : K * K);
    float pmax = 0.0f;
    for (int64_t e = 0; e < cnt; ++e) {
      const float a = std::fabs(pr[e]);
      if (!(a <= std::numeric_limits<float>::max())) finite = false;
      pmax = std::max(pmax, a);
    }
    if (!finite || pmax == 0.0f) {
      finite = finite && pmax != 0.0f;
      return;
    }
    std::frexp(pmax, &ep);
    const double s = std::ldexp(1.0, -ep);
    if (kind == kIsotropic) {
      p = static_cast<float>(pr[0] * s);
    } else if (kind == kDiagonal) {
      diag.resize(d);
      for (int64_t k = 0; k < d; ++k) diag[k] = static_cast<float>(pr[k] * s);
    } else {
      for (int64_t e = 0; e < K * K; ++e) blk[e] = static_cast<float>(pr[e] * s);
    }
  }

  template <int KK>
  void apply_block(const float* u, float* v, int64_t d) const {
    for (int64_t b = 0; b < d; b += KK) {
#pragma GCC unroll 4
      for (int a = 0; a < KK; ++a) {
        float acc = 0.0f;
#pragma GCC unroll 4
        for (int c = 0; c < KK; ++c) acc += blk[a * KK + c] * u[b + c];
        v[b + a] = acc;
      }
    }
  }

#ifdef ETWEEDIE_GRAM_AVX2
  // K ∈ {2, 4}: v[a] = Σ_s P[a][(a+s) mod K] u[(a+s) mod K] within each block, 8 coordinates at a
  // time: u's blocks rotated in-lane by s (one permute) times a coefficient vector per s.
  template <int KK>
  void apply_block_avx2(const float* u, float* v, int64_t d) const {
    __m256 coef[KK];
    for (int sft = 0; sft < KK; ++sft) {
      alignas(32) float cv[8];
      for (int t = 0; t < 8; ++t) {
        const int a = t % KK, c = (a + sft) % KK;
        cv[t] = blk[a * KK + c];
      }
      coef[sft] = _mm256_load_ps(cv);
    }
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) {
      const __m256 x = _mm256_loadu_ps(u + k);
      __m256 acc = _mm256_mul_ps(coef[0], x);
      if (KK == 2) {
        acc = _mm256_fmadd_ps(coef[1], _mm256_permute_ps(x, 0xB1), acc);  // (1, 0, 3, 2)
      } else {
        acc = _mm256_fmadd_ps(coef[1], _mm256_permute_ps(x, 0x39), acc);  // (1, 2, 3, 0)
        acc = _mm256_fmadd_ps(coef[2], _mm256_permute_ps(x, 0x4E), acc);  // (2, 3, 0, 1)
        acc = _mm256_fmadd_ps(coef[3], _mm256_permute_ps(x, 0x93), acc);  // (3, 0, 1, 2)
      }
      _mm256_storeu_ps(v + k, acc);
    }
    for (; k < d; k += KK) {
      for (int a = 0; a < KK; ++a) {
        float acc = 0.0f;
        for (int c = 0; c < KK; ++c) acc += blk[a * KK + c] * u[k + c];
        v[k + a] = acc;
      }
    }
  }
#endif

  // u *= s (in place), v = P'u and returns uᵀv summed in float64 — in one pass over u for the
  // 2×2 and 4×4 blocks (the training metric), else apply() and a second pass.
  double scale_apply_norm(float* u, float* v, int64_t d, float s) const {
#ifdef ETWEEDIE_GRAM_AVX2
    if (kind == kBlock && (K == 2 || K == 4) && d % 8 == 0) {
      __m256 coef[4];
      for (int sft = 0; sft < K; ++sft) {
        alignas(32) float cv[8];
        for (int t = 0; t < 8; ++t) {
          const int a = t % K, c = (a + sft) % K;
          cv[t] = blk[a * K + c];
        }
        coef[sft] = _mm256_load_ps(cv);
      }
      const __m256 sv = _mm256_set1_ps(s);
      __m256d n0 = _mm256_setzero_pd(), n1 = _mm256_setzero_pd();
      for (int64_t k = 0; k < d; k += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(u + k), sv);
        _mm256_storeu_ps(u + k, x);
        __m256 acc = _mm256_mul_ps(coef[0], x);
        if (K == 2) {
          acc = _mm256_fmadd_ps(coef[1], _mm256_permute_ps(x, 0xB1), acc);
        } else {
          acc = _mm256_fmadd_ps(coef[1], _mm256_permute_ps(x, 0x39), acc);
          acc = _mm256_fmadd_ps(coef[2], _mm256_permute_ps(x, 0x4E), acc);
          acc = _mm256_fmadd_ps(coef[3], _mm256_permute_ps(x, 0x93), acc);
        }
        _mm256_storeu_ps(v + k, acc);
        n0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                             _mm256_cvtps_pd(_mm256_castps256_ps128(acc)), n0);
        n1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)),
                             _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)), n1);
      }
      alignas(32) double part[4];
      _mm256_store_pd(part, _mm256_add_pd(n0, n1));
      return (part[0] + part[1]) + (part[2] + part[3]);
    }
#endif
#pragma omp simd
    for (int64_t k = 0; k < d; ++k) u[k] *= s;
    apply(u, v, d);
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < d; ++k) acc += static_cast<double>(u[k]) * static_cast<double>(v[k]);
    return acc;
  }

  void apply(const float* u, float* v, int64_t d) const {
#ifdef ETWEEDIE_GRAM_AVX2
    if (kind == kBlock && K == 2) return apply_block_avx2<2>(u, v, d);
    if (kind == kBlock && K == 4) return apply_block_avx2<4>(u, v, d);
#endif
    if (kind == kIsotropic) {
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) v[k] = p * u[k];
    } else if (kind == kDiagonal) {
      const float* pd = diag.data();
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) v[k] = pd[k] * u[k];
    } else {
      switch (K) {
        case 1: apply_block<1>(u, v, d); break;
        case 2: apply_block<2>(u, v, d); break;
        case 3: apply_block<3>(u, v, d); break;
        default: apply_block<4>(u, v, d); break;
      }
    }
  }
};

// Value (if vp) and gradients (if gsp / gtp; scaled by gp[r] when gp is given, else by 1) of
// the weighted pair sums w.cross Σ_i E(x_i − y) + w.within_a Σ_{i<j} E(x_i − x_j) per row.
// samples (B, M, d) with unit stride over d; target (B, d) with unit stride over d; beta (B,);
// prec (B, *param) of metric kind `kind` (block: rows contiguous); outputs contiguous.
// redo (B bytes, zeroed by the caller): set for each row this kernel leaves to the float64
// pair engine (see the header; its outputs are then unwritten).  Without it such rows get NaN.
inline void energy_score_gram(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                              const at::Tensor& prec, int64_t kind, PairWeights w, const float* gp, float* vp,
                              float* gsp, float* gtp, uint8_t* redo = nullptr) {
  const int64_t B = samples.size(0), M = samples.size(1), d = samples.size(2);
  // the panels hold the M draws only (the target's column of G is n dot products apart: at
  // M = 32 a third panel would cost as much as a second for one point); G and C are
  // (rows, ld) with ld ≥ n columns and the rows padded to whole groups of 4 (zero rows of C)
  const int64_t n = M + 1, nbl = (M + kScoreNR - 1) / kScoreNR, ld = std::max(nbl * kScoreNR, n);
  const int64_t rows = (n + kGramMR - 1) / kGramMR * kGramMR;
  const bool direct = n <= kScoreDirectMaxPoints;  // every pair from its exact difference
  const int64_t K = kind == kBlock ? prec.size(1) : 0;
  const float* xp = samples.data_ptr<float>();
  const float* yp = target.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const float* pp = prec.data_ptr<float>();
  const int64_t sx0 = samples.stride(0), sx1 = samples.stride(1), sy0 = target.stride(0), sb = beta.stride(0),
                sp = prec.stride(0);
  const bool need_grad = gsp != nullptr || gtp != nullptr;
  const float wc = static_cast<float>(w.cross), ww = static_cast<float>(w.within_a);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    // the panels' padding columns (after the M draws) are zero from here on: only draws are stored
    std::vector<float> U(n * d), V(direct ? 0 : n * d), panels(direct ? 0 : nbl * d * kScoreNR),
        G(direct ? 0 : rows * ld), C(need_grad ? rows * ld : 0), cy(need_grad ? n * d : 0), nrm(n),
        wdiff(d), pw(d), centre(d), Ctail(need_grad ? kGramMR * ld : 0);
    float q[kScoreGramMaxPoints], e[kScoreGramMaxPoints], sl[kScoreGramMaxPoints];
    bool exact[kScoreGramMaxPoints];
    float dots[kGramMR * kScoreNR];
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * sx0;
      const float* yr = yp + r * sy0;
      auto point = [&](int64_t i) { return i < M ? xr + i * sx1 : yr; };
      float* gs_row = gsp ? gsp + r * M * d : nullptr;
      float* gt_row = gtp ? gtp + r * d : nullptr;
      auto fill_row = [&](float value) {
        if (vp) vp[r] = value;
        if (gs_row) std::fill(gs_row, gs_row + M * d, value);
        if (gt_row) std::fill(gt_row, gt_row + d, value);
      };
      const float be = bp[r * sb];
      const ScaledRowPrec P(pp + r * sp, kind, K, d);
      // 1. the shifted centre c = x_0 + Σ_i (x_i − x_0)/n, the differences summed in float: near
      // points subtract exactly, so the sum drifts at the cloud's spread, not at its distance
      // from the origin, and c is off the mean by about half an ulp of the points' magnitude (a
      // float running sum of the points themselves drifts by up to ~n/2 ulps: 0.1 for a cloud
      // at 1e4, a hundred times a 1e-3 spread, whose centred gradient sums then cancel that
      // much more).  Any common centre preserves the distances exactly.  Differences that
      // overflow float (finite points near ±3.4e38) take a sum in double instead.  The direct
      // form forms every pair from its source points and needs u only for the row's scale.
      float* cen = centre.data();
      const float* x0 = point(0);
      std::fill(centre.begin(), centre.end(), 0.0f);
      for (int64_t i = 1; i < n; ++i) {
        const float* xi = point(i);
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) cen[k] += xi[k] - x0[k];
      }
      const float inv_nf = 1.0f / static_cast<float>(n);
      float spill = 0;  // inf or NaN: a non-finite point, or an overflowing difference
#pragma omp simd reduction(+ : spill)
      for (int64_t k = 0; k < d; ++k) {
        cen[k] = x0[k] + cen[k] * inv_nf;
        spill += cen[k] * 0.0f;
      }
      if (spill != 0.0f) {  // Σ x_i/n in double: NaN/inf only for a non-finite point
        std::vector<double> cen_d(d, 0.0);
        for (int64_t i = 0; i < n; ++i) {
          const float* xi = point(i);
          for (int64_t k = 0; k < d; ++k) cen_d[k] += static_cast<double>(xi[k]);
        }
        for (int64_t k = 0; k < d; ++k) cen[k] = static_cast<float>(cen_d[k] / static_cast<double>(n));
      }
      bool finite = P.finite && std::isfinite(be);
      // a NaN or inf coordinate of any point makes its coordinate's sum non-finite (max() may drop a NaN)
      float probe = 0;
#pragma omp simd reduction(+ : probe)
      for (int64_t k = 0; k < d; ++k) probe += cen[k] * 0.0f;
      finite = finite && probe == 0.0f;
      float amax = 0.0f;
      bool wide = false;  // finite points whose centred difference overflows float
      for (int64_t i = 0; i < n && finite && !wide; ++i) {
        const float* xi = point(i);
        float* ui = U.data() + i * d;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t k = 0; k < d; ++k) {
          ui[k] = xi[k] - cen[k];
          m = std::max(m, std::fabs(ui[k]));
        }
        if (!(m <= std::numeric_limits<float>::max())) wide = true;  // an overflowing difference
        amax = std::max(amax, m);
      }
      if (!finite || (wide && redo == nullptr)) {
        fill_row(nan);
        continue;
      }
      if (wide) {
        redo[r] = 1;
        continue;
      }
      if (amax == 0.0f) {  // every point coincides: every pair is 0
        fill_row(0.0f);
        continue;
      }
      // 2. the range: u' = u·2^{-e} with max|u'| ∈ [½, 1)
      int e2 = 0;
      std::frexp(amax, &e2);
      const double su = std::ldexp(1.0, -e2);
      // a power of two that float holds scales in float (the same single rounding as in double)
      const bool su_float = e2 > -120 && e2 < 120;
      const float suf = static_cast<float>(su);
      // 3. v = P'u', the norms and the coordinate-major panels of V (Gram form only)
      for (int64_t i = 0; i < n; ++i) {
        float* ui = U.data() + i * d;
        if (su_float && !direct) {
          nrm[i] = static_cast<float>(P.scale_apply_norm(ui, V.data() + i * d, d, suf));
          continue;
        }
        if (su_float) {
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) ui[k] *= suf;
        } else {
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) ui[k] = static_cast<float>(ui[k] * su);
        }
        if (direct) continue;
        float* vi = V.data() + i * d;
        P.apply(ui, vi, d);
        nrm[i] = static_cast<float>(dot_f64(ui, vi, d));
      }
      if (!direct) {
        for (int64_t J = 0; J < nbl; ++J)
          gram_store_panel(V.data(), J * kScoreNR, std::min(kScoreNR, M - J * kScoreNR), d,
                           panels.data() + J * d * kScoreNR);
        // 4. G_ij = u_i·v_j for the draws' panels at or right of row i's (the upper triangle),
        // then the target's column j = M
        for (int64_t ii = 0; ii < M; ii += kGramMR) {
          const float* urows[kGramMR];
          for (int64_t t = 0; t < kGramMR; ++t) urows[t] = U.data() + std::min(ii + t, M - 1) * d;
          for (int64_t J = ii / kScoreNR; J < nbl; ++J) {
            gram_dots_4x<kScoreNR>(urows[0], urows[1], urows[2], urows[3], panels.data() + J * d * kScoreNR, d, dots);
            for (int64_t t = 0; t < kGramMR && ii + t < M; ++t)
              std::copy(dots + t * kScoreNR, dots + (t + 1) * kScoreNR, G.data() + (ii + t) * ld + J * kScoreNR);
          }
        }
        const float* vt = V.data() + M * d;
        for (int64_t i = 0; i < M; ++i) G[i * ld + M] = dot_f32(U.data() + i * d, vt, d);
      }
      // 5–6. pairs j > i of every row i: q with the guard, energies, slopes, weights
      if (need_grad) {
        std::fill(C.begin(), C.end(), 0.0f);
        std::fill(cy.begin(), cy.end(), 0.0f);
      }
      // a close pair's (or, in the direct form, every pair's) w = u'_i − u'_j and P'w, w from the
      // source points, (x_i − x_j)·2^{-e} with one rounding: the centred u each carry a rounding
      // of up to 2⁻²⁴|u| per coordinate, which a difference much smaller than the points magnifies
      // (10⁴× for draws 10⁻⁴ apart at unit spread, where β < 1 makes the pair's slope the largest)
      auto exact_difference = [&](int64_t i, int64_t j) {
        const float* xi = point(i);
        const float* xj = point(j);
        float* wd = wdiff.data();
#pragma omp simd
        for (int64_t k = 0; k < d; ++k)
          wd[k] = static_cast<float>((static_cast<double>(xi[k]) - static_cast<double>(xj[k])) * su);
        P.apply(wd, pw.data(), d);
      };
      // whether two points are equal (a pair whose scaled difference rounds to 0 otherwise)
      auto same_point = [&](int64_t i, int64_t j) {
        const float* xi = point(i);
        const float* xj = point(j);
        for (int64_t k = 0; k < d; ++k)
          if (xi[k] != xj[k]) return false;
        return true;
      };
      double value = 0;
      bool tiny = false;  // a pair with 0 < q' < kScoreTinyQ: the row goes to the float64 engine
      for (int64_t i = 0; i + 1 < n; ++i) {
        const int64_t len = n - 1 - i;
        const float* nj = nrm.data() + i + 1;
        const float ni = nrm[i];
        bool guard = direct;
        if (!direct) {
          const float* Gi = G.data() + i * ld + i + 1;
          int flagged = 0;  // an int | reduction: GCC leaves a bool || reduction as a scalar loop
#pragma omp simd reduction(| : flagged)
          for (int64_t t = 0; t < len; ++t) {
            const float s = ni + nj[t];
            const float v = s - 2.0f * Gi[t];
            q[t] = v;
            flagged |= static_cast<int>(v < kGramGuard * s);
          }
          guard = flagged != 0;
        }
        std::fill(exact, exact + len, false);
        if (guard) {
          for (int64_t t = 0; t < len; ++t) {
            if (!direct && !(q[t] < kGramGuard * (ni + nj[t]))) continue;
            exact_difference(i, i + 1 + t);
            const double qd = dot_f64(wdiff.data(), pw.data(), d);
            tiny = tiny || (qd > 0 && qd < kScoreTinyQ) || (qd == 0 && !same_point(i, i + 1 + t));
            q[t] = static_cast<float>(qd);
            exact[t] = true;
          }
        }
        int small = 0;
#pragma omp simd reduction(| : small)
        for (int64_t t = 0; t < len; ++t) {
          const float v = q[t] > 0.0f ? q[t] : 0.0f;
          q[t] = v;
          small |= static_cast<int>(v > 0.0f && v < static_cast<float>(kScoreTinyQ));
        }
        tiny = tiny || small != 0;
        tile_energies_and_slopes(q, len, be, e, sl);
        // the last pair of every row is the target (point M): weight w_c, the others w_w
        double row_e = 0;
        for (int64_t t = 0; t + 1 < len; ++t) row_e += e[t];
        value += static_cast<double>(ww) * row_e + static_cast<double>(wc) * e[len - 1];
        if (!need_grad) continue;
        float* Ci = C.data() + i * ld + i + 1;
        for (int64_t t = 0; t < len; ++t) {
          const int64_t j = i + 1 + t;
          const float c = (j == M ? wc : ww) * sl[t];
          if (!exact[t]) {
            Ci[t] = c;
            C[j * ld + i] = c;
            continue;
          }
          // c·P'(u_i − u_j) from the exact difference, into both points
          exact_difference(i, j);
          float* cyi = cy.data() + i * d;
          float* cyj = cy.data() + j * d;
          const float* pwk = pw.data();
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) {
            cyi[k] -= c * pwk[k];
            cyj[k] += c * pwk[k];
          }
        }
      }
      if (tiny && redo != nullptr) {
        redo[r] = 1;
        continue;
      }
      // scale back: q = 2^{Kq} q' with Kq = 2e + ep; E = 2^{Kq β/2} E'; ∂E/∂x = 2^{Kq(β/2−1)+ep+e} (…)'
      const double Kq = 2.0 * e2 + P.ep, hb = 0.5 * static_cast<double>(be);
      if (vp) vp[r] = static_cast<float>(value * std::exp2(Kq * hb));
      if (!need_grad) continue;
      // the gradient: (Σ_j c_ij) v_i − (C V)_i, for the draws and (if asked) the target, in
      // blocks of kScoreCvBlock coordinates: the block of all n rows of V stays in L1 while
      // every group of 4 output rows passes over it
      const int64_t nout = gt_row ? n : M;
      if (!direct) {
        for (int64_t kb = 0; kb < d; kb += kScoreCvBlock) {
          const int64_t len = std::min(kScoreCvBlock, d - kb);
          for (int64_t ii = 0; ii < nout; ii += kGramMR) {
            const int64_t nr = std::min(kGramMR, nout - ii);
            float* base = cy.data() + ii * d + kb;
            // a last group of fewer than 4 rows: its missing rows' outputs alias row ii, so they
            // must add 0 — a copy with zero rows (C's next row may be the target's, not padding)
            const float* Cg = C.data() + ii * ld;
            if (nr < kGramMR) {
              std::fill(Ctail.begin(), Ctail.end(), 0.0f);
              std::copy(Cg, Cg + nr * ld, Ctail.begin());
              Cg = Ctail.data();
            }
            gram_cy_4(Cg, ld, V.data() + kb, d, n, len, base, base + (nr > 1 ? d : 0), base + (nr > 2 ? 2 * d : 0),
                      base + (nr > 3 ? 3 * d : 0));
          }
        }
      }
      const double gscale = (gp ? static_cast<double>(gp[r]) : 1.0) * std::exp2(Kq * (hb - 1.0) + P.ep + e2);
      const bool gscale_float = std::fabs(gscale) >= 1e-30 && std::fabs(gscale) <= 1e30;
      const float gsf = static_cast<float>(gscale);
      for (int64_t i = 0; i < n; ++i) {
        float* out = i < M ? (gs_row ? gs_row + i * d : nullptr) : gt_row;
        if (out == nullptr) continue;
        const float* cyi = cy.data() + i * d;
        if (direct) {  // every pair's gradient is in cy
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) out[k] = static_cast<float>(-gscale * cyi[k]);
          continue;
        }
        const float* Ci = C.data() + i * ld;
        // Σ_j c_ij in double: the weights cancel (at β = 2 the cross weight 1/M against M − 1
        // within weights −1/(M(M−1)) sum to 0), and a float running sum would carry an error of
        // ~2⁻²⁵ against a gradient ~M^{-3/2} of the terms (1e-4 relative at M = 255)
        double rs_d = 0;
        for (int64_t j = 0; j < n; ++j) rs_d += Ci[j];
        const float rs = static_cast<float>(rs_d);
        const float* vi = V.data() + i * d;
        if (gscale_float) {  // the scale-back in float where the factor is a normal float
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) out[k] = gsf * (rs * vi[k] - cyi[k]);
        } else {
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) out[k] = static_cast<float>(gscale * (rs * vi[k] - cyi[k]));
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace etweedie
