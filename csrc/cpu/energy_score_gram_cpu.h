// Gram-form row kernel of the CPU energy score for large d (float32, d ≥ 64, 16 ≤ M ≤ 255 draws
// per row, enough rows to occupy every thread) — the training loss of an image posterior, e.g.
// B = 64 examples × M = 32 draws in d = 784, with a per-row β and a per-row metric.
//
//   ES = w_c Σ_i E(x_i − y) + w_w Σ_{i<j} E(x_i − x_j),   E(u) = (uᵀPu)^{β/2}
//
// One task per row.  The row's M draws and its target form one cloud of n = M + 1 points
// (the target is point M: its pairs carry w_c, the draws' pairs w_w).  Per row:
//   1. shifted centre: c = the mean of the n points (summed in float64), u_i = x_i − c — the
//      pair distances are translation invariant, so an offset of 1e4 costs nothing;
//   2. range: u and P are scaled by powers of two so that max|u| and max|P| lie in [½, 1)
//      (exact in float), and the value and gradients are scaled back in float64 at the end —
//      no overflow or underflow in the squared norms for clouds of any magnitude;
//   3. the metric in-kernel: v_i = P u_i per point (isotropic, diagonal or k×k block applied
//      from the row's own parameter; no whitened copies, no Cholesky), norms n_i = u_i·v_i;
//   4. G_ij = u_i·v_j for j > i with the 4 × 16 register-blocked micro-kernel of
//      energy_gram_cpu.h (one FMA per coordinate per pair), q_ij = n_i + n_j − 2 G_ij;
//   5. cancellation control: a pair with q_ij < 2⁻⁶ (n_i + n_j) is recomputed from the exact
//      difference w = u_i − u_j as wᵀPw (coincident points therefore give exactly 0), and its
//      gradient c·Pw is added from that difference, not from the split form below;
//   6. energies and slopes s_ij (one power per pair), c_ij = w_ij s_ij, and the gradient
//        ∂/∂x_i = Σ_j c_ij P (u_i − u_j) = (Σ_j c_ij) v_i − (C V)_i
//      with C·V a second register-blocked product (4 rows × 16 coordinates per call).
// Cost: about 1.5 n² d FMAs per row (G is symmetric) against ~4 n² d flops of the direct
// engine (difference, square, and the gradient's second difference); memory O(n·d) scratch per
// thread, nothing of size B·M·d besides the outputs.
//
// NaN/inf: a row whose points, β or metric are not finite gets a NaN value and NaN gradients
// (never a silent 0).  β and metric gradients are not produced here: those calls take the
// general engine (energy_cpu.h).  ETWEEDIE_CPU_GRAM=0 turns this path off too.
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
// Fewer draws leave most of a 16-point panel empty and the per-row packing dominates: the
// direct engine is as fast there (e.g. the B = 256, M = 2 training shape).
constexpr int64_t kScoreGramMinDraws = 16;

inline bool energy_score_gram_applicable(const at::Tensor& samples, const at::Tensor& target, bool need_beta,
                                         bool need_prec) {
  if (samples.dim() != 3) return false;
  const int64_t B = samples.size(0), M = samples.size(1), d = samples.size(2);
  return gram_env_enabled() && samples.scalar_type() == at::kFloat && target.scalar_type() == at::kFloat &&
         !need_beta && !need_prec && d >= kGramMinD && M >= kScoreGramMinDraws && M + 1 <= kScoreGramMaxPoints &&
         B >= static_cast<int64_t>(at::get_num_threads()) && target.dim() == 2 && target.stride(1) == 1;
}

// out_t[k] += Σ_{j<nj} C[t·ldc + j] · V[j·d + k] for the 4 rows t (V row-major (nj, d)).
inline void gram_cv_4(const float* C, int64_t ldc, const float* V, int64_t nj, int64_t d, float* out0, float* out1,
                      float* out2, float* out3) {
  float* outs[4] = {out0, out1, out2, out3};
  int64_t k0 = 0;
#ifdef ETWEEDIE_GRAM_AVX2
  for (; k0 + 16 <= d; k0 += 16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
           a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
           a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    for (int64_t j = 0; j < nj; ++j) {
      const float* vj = V + j * d + k0;
      const __m256 y0 = _mm256_loadu_ps(vj), y1 = _mm256_loadu_ps(vj + 8);
      __m256 c = _mm256_broadcast_ss(C + j);
      a00 = _mm256_fmadd_ps(c, y0, a00);
      a01 = _mm256_fmadd_ps(c, y1, a01);
      c = _mm256_broadcast_ss(C + ldc + j);
      a10 = _mm256_fmadd_ps(c, y0, a10);
      a11 = _mm256_fmadd_ps(c, y1, a11);
      c = _mm256_broadcast_ss(C + 2 * ldc + j);
      a20 = _mm256_fmadd_ps(c, y0, a20);
      a21 = _mm256_fmadd_ps(c, y1, a21);
      c = _mm256_broadcast_ss(C + 3 * ldc + j);
      a30 = _mm256_fmadd_ps(c, y0, a30);
      a31 = _mm256_fmadd_ps(c, y1, a31);
    }
    const __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int t = 0; t < 4; ++t) {
      float* o = outs[t] + k0;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[t][0]));
      _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), acc[t][1]));
    }
  }
#endif
  for (int t = 0; t < 4; ++t) {
    const float* ct = C + t * ldc;
    for (int64_t j = 0; j < nj; ++j) {
      const float c = ct[j];
      const float* vj = V + j * d;
      float* o = outs[t];
#pragma omp simd
      for (int64_t k = k0; k < d; ++k) o[k] += c * vj[k];
    }
  }
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

  void apply(const float* u, float* v, int64_t d) const {
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
inline void energy_score_gram(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                              const at::Tensor& prec, int64_t kind, PairWeights w, const float* gp, float* vp,
                              float* gsp, float* gtp) {
  const int64_t B = samples.size(0), M = samples.size(1), d = samples.size(2);
  const int64_t n = M + 1, npad = (n + kGramNR - 1) / kGramNR * kGramNR, nbl = npad / kGramNR;
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
    std::vector<float> U(npad * d), V(npad * d), panels(nbl * d * kGramNR), G(npad * npad),
        C(need_grad ? npad * npad : 0), cy(need_grad ? npad * d : 0), nrm(npad), wdiff(d), pw(d);
    std::vector<double> acc(d);
    float q[kScoreGramMaxPoints], e[kScoreGramMaxPoints], sl[kScoreGramMaxPoints];
    bool exact[kScoreGramMaxPoints];
    float dots[kGramMR * kGramNR];
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
      // 1. the shifted centre (float64 sum, rounded to float) and the centred points
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < n; ++i) {
        const float* xi = point(i);
        for (int64_t k = 0; k < d; ++k) acc[k] += xi[k];
      }
      float amax = 0.0f;
      bool finite = P.finite && std::isfinite(be);
      for (int64_t k = 0; k < d; ++k) wdiff[k] = static_cast<float>(acc[k] / static_cast<double>(n));
      for (int64_t i = 0; i < n; ++i) {
        const float* xi = point(i);
        float* ui = U.data() + i * d;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t k = 0; k < d; ++k) {
          ui[k] = xi[k] - wdiff[k];
          m = std::max(m, std::fabs(ui[k]));
        }
        if (!(m <= std::numeric_limits<float>::max())) finite = false;  // an overflowing difference
        amax = std::max(amax, m);
      }
      // a NaN or inf coordinate of any point makes its coordinate's sum non-finite (max() may drop a NaN)
      for (int64_t k = 0; k < d && finite; ++k) finite = std::isfinite(acc[k]);
      if (!finite) {
        fill_row(nan);
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
      for (int64_t i = 0; i < n; ++i) {
        float* ui = U.data() + i * d;
        for (int64_t k = 0; k < d; ++k) ui[k] = static_cast<float>(ui[k] * su);
      }
      std::fill(U.begin() + n * d, U.end(), 0.0f);
      // 3. v = P'u', the norms and the coordinate-major panels of V
      for (int64_t i = 0; i < n; ++i) {
        const float* ui = U.data() + i * d;
        float* vi = V.data() + i * d;
        P.apply(ui, vi, d);
        double s = 0;
        for (int64_t k = 0; k < d; ++k) s += static_cast<double>(ui[k]) * vi[k];
        nrm[i] = static_cast<float>(s);
        float* panel = panels.data() + (i / kGramNR) * d * kGramNR + i % kGramNR;
        for (int64_t k = 0; k < d; ++k) panel[k * kGramNR] = vi[k];
      }
      for (int64_t i = n; i < npad; ++i) {
        nrm[i] = 0.0f;
        float* panel = panels.data() + (i / kGramNR) * d * kGramNR + i % kGramNR;
        for (int64_t k = 0; k < d; ++k) panel[k * kGramNR] = 0.0f;
      }
      // 4. G_ij = u_i·v_j for the panels at or right of row i's (the upper triangle)
      for (int64_t ii = 0; ii < n; ii += kGramMR) {
        const float* rows[kGramMR];
        for (int64_t t = 0; t < kGramMR; ++t) rows[t] = U.data() + std::min(ii + t, n - 1) * d;
        for (int64_t J = ii / kGramNR; J < nbl; ++J) {
          gram_dots_4x16(rows[0], rows[1], rows[2], rows[3], panels.data() + J * d * kGramNR, d, dots);
          for (int64_t t = 0; t < kGramMR && ii + t < n; ++t)
            std::copy(dots + t * kGramNR, dots + (t + 1) * kGramNR, G.data() + (ii + t) * npad + J * kGramNR);
        }
      }
      // 5–6. pairs j > i of every row i: q with the guard, energies, slopes, weights
      if (need_grad) {
        std::fill(C.begin(), C.end(), 0.0f);
        std::fill(cy.begin(), cy.end(), 0.0f);
      }
      double value = 0;
      for (int64_t i = 0; i + 1 < n; ++i) {
        const int64_t len = n - 1 - i;
        const float* Gi = G.data() + i * npad + i + 1;
        const float* nj = nrm.data() + i + 1;
        const float ni = nrm[i];
        bool guard = false;
#pragma omp simd reduction(|| : guard)
        for (int64_t t = 0; t < len; ++t) {
          const float s = ni + nj[t];
          const float v = s - 2.0f * Gi[t];
          q[t] = v;
          guard = guard || v < kGramGuard * s;
        }
        std::fill(exact, exact + len, false);
        if (guard) {
          const float* ui = U.data() + i * d;
          for (int64_t t = 0; t < len; ++t) {
            if (!(q[t] < kGramGuard * (ni + nj[t]))) continue;
            const float* uj = U.data() + (i + 1 + t) * d;
            for (int64_t k = 0; k < d; ++k) wdiff[k] = ui[k] - uj[k];
            P.apply(wdiff.data(), pw.data(), d);
            double s = 0;
            for (int64_t k = 0; k < d; ++k) s += static_cast<double>(wdiff[k]) * pw[k];
            q[t] = static_cast<float>(s);
            exact[t] = true;
          }
        }
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) q[t] = q[t] > 0.0f ? q[t] : 0.0f;
        tile_energies_and_slopes(q, len, be, e, sl);
        // the last pair of every row is the target (point M): weight w_c, the others w_w
        double row_e = 0;
        for (int64_t t = 0; t + 1 < len; ++t) row_e += e[t];
        value += static_cast<double>(ww) * row_e + static_cast<double>(wc) * e[len - 1];
        if (!need_grad) continue;
        float* Ci = C.data() + i * npad + i + 1;
        for (int64_t t = 0; t < len; ++t) {
          const int64_t j = i + 1 + t;
          const float c = (j == M ? wc : ww) * sl[t];
          if (!exact[t]) {
            Ci[t] = c;
            C[j * npad + i] = c;
            continue;
          }
          // a close pair: c·P'(u_i − u_j) from the exact difference, into both points
          const float* ui = U.data() + i * d;
          const float* uj = U.data() + j * d;
          for (int64_t k = 0; k < d; ++k) wdiff[k] = ui[k] - uj[k];
          P.apply(wdiff.data(), pw.data(), d);
          float* cyi = cy.data() + i * d;
          float* cyj = cy.data() + j * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) {
            cyi[k] -= c * pw[k];
            cyj[k] += c * pw[k];
          }
        }
      }
      // scale back: q = 2^{Kq} q' with Kq = 2e + ep; E = 2^{Kq β/2} E'; ∂E/∂x = 2^{Kq(β/2−1)+ep+e} (…)'
      const double Kq = 2.0 * e2 + P.ep, hb = 0.5 * static_cast<double>(be);
      if (vp) vp[r] = static_cast<float>(value * std::exp2(Kq * hb));
      if (!need_grad) continue;
      // the gradient: (Σ_j c_ij) v_i − (C V)_i
      for (int64_t ii = 0; ii < n; ii += kGramMR) {
        const int64_t nr = std::min(kGramMR, n - ii);
        float* base = cy.data() + ii * d;
        // rows past n are C's zero padding (ii + 3 < npad): their outputs alias row ii and add 0
        gram_cv_4(C.data() + ii * npad, npad, V.data(), n, d, base, base + (nr > 1 ? d : 0),
                  base + (nr > 2 ? 2 * d : 0), base + (nr > 3 ? 3 * d : 0));
      }
      const double gscale = (gp ? static_cast<double>(gp[r]) : 1.0) * std::exp2(Kq * (hb - 1.0) + P.ep + e2);
      for (int64_t i = 0; i < n; ++i) {
        const float* Ci = C.data() + i * npad;
        float rs = 0;
        for (int64_t j = 0; j < n; ++j) rs += Ci[j];
        const float* vi = V.data() + i * d;
        const float* cyi = cy.data() + i * d;
        float* out = i < M ? (gs_row ? gs_row + i * d : nullptr) : gt_row;
        if (out == nullptr) continue;
        for (int64_t k = 0; k < d; ++k) out[k] = static_cast<float>(gscale * (rs * vi[k] - cyi[k]));
      }
    }
  });
}

}  // namespace cpu
}  // namespace etweedie
