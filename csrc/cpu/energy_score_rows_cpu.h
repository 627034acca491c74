// Row kernel of the CPU energy score for small d (d ≤ kSmallD) and many rows — the Engression
// training shape in low dimension (e.g. B = 128 examples × M = 64 draws in d = 2): one task
// per row, the row's draws held in structure-of-arrays form so that every loop over draws is a
// contiguous vector loop.  Math: csrc/common/energy.h; the loss (energy_score_cpu.cpp):
//   ES = w_c Σ_j E(x_j − y) + w_w Σ_{i<j} E(x_i − x_j),   E(u) = (uᵀPu)^{β/2}.
//
// Per row:  U[k][j] = x_j[k] − y[k] (centred on the target: no precision loss far from the
// origin, and the cross residuals come for free), stored twice over (U[k][j + M] = U[k][j]);
// cross: q_j = U_jᵀ P U_j over all j at once;
// within: by offset o = 1 … ⌊M/2⌋, the pairs (j, j + o mod M) for all j as one run
// W[k][j] = U[k][j] − U[k][j + o] of M pairs (M/2 at o = M/2 for even M, whose pairs would
// otherwise come twice), one power per pair for the energy and the slope
// (tile_energies_and_slopes), then
//   GA[k][j] += w s_j W[k][j],   GB[k][j + o] −= w s_j W[k][j]   (two vector updates)
// and G[k][j] = GA[k][j] + GB[k][j] + GB[k][j + M] at the end.  Each unordered pair is formed
// once, in runs of M instead of the M − 1 − i pairs after draw i: at M = 64 those short runs
// spent more time in loop set-up and remainders than in the pairs' powers (4.3 against 1.6 ns a
// pair at M = 256, one thread, β = 1.5).  The general engine (energy_cpu.h) scatters strided
// gradients and is about twice as slow again.
// Finally ∂/∂x_j = g·P G_j and ∂/∂y = −g·P Σ_j (cross terms of G_j).
// Memory: O(M·d) scratch per thread; nothing of size M².  β and metric gradients are not
// produced here (the training loss needs only the draws'); those calls use the general engine.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "energy_tile_cpu.h"
#include "et_score_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kRowsMaxM = 4096;  // scratch per thread: ~5·M·d values

inline bool energy_score_rows_applicable(const at::Tensor& samples, bool need_beta, bool need_prec) {
  const int64_t B = samples.size(0), M = samples.size(1), d = samples.size(2);
  return !need_beta && !need_prec && d >= 1 && d <= kSmallD && M >= 2 && M <= kRowsMaxM &&
         B >= 2 * static_cast<int64_t>(at::get_num_threads());
}

// One task per row; Prec is the row's precision view (metric_cpu.h).
template <typename T, typename Prec>
void energy_score_rows_impl(const T* xp, int64_t sx0, int64_t sx1, const T* yp, int64_t sy0, const T* bp, int64_t sb,
                            const T* pp, int64_t sp, const T* gp, int64_t gstride, int64_t B, int64_t M, int64_t d,
                            T wc, T ww, T* vp, T* gxp, T* gyp) {
  const int64_t Mp = (M + 15) / 16 * 16;  // the stride of U's and GB's halves
  const bool need_grad = gxp != nullptr || gyp != nullptr;
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    std::vector<T> U(2 * d * Mp), W(d * Mp), GA(need_grad ? d * Mp : 0), GB(need_grad ? 2 * d * Mp : 0), q(Mp),
        e(Mp), s(Mp);
    T tmp[kSmallD], out[kSmallD];
    for (int64_t r = r0; r < r1; ++r) {
      const Prec P{pp + r * sp};
      const T be = bp[r * sb];
      const T* xr = xp + r * sx0;
      const T* yr = yp + r * sy0;
      for (int64_t k = 0; k < d; ++k) {  // U[k] from U + 2k·Mp, its copy right after it (U[k][M + j])
        T* Uk = U.data() + 2 * k * Mp;
        const T yk = yr[k];
        for (int64_t j = 0; j < M; ++j) Uk[j] = Uk[M + j] = xr[j * sx1 + k] - yk;
      }
      if (need_grad) {
        std::fill(GA.begin(), GA.end(), T(0));
        std::fill(GB.begin(), GB.end(), T(0));
      }
      double val = 0;
      T cross_sum[kSmallD] = {};  // Σ_j of the cross terms of G (∂/∂y up to −P)
      // cross pairs (x_j, y)
      P.quad_soa(U.data(), 2 * Mp, M, d, q.data());
      if (need_grad) {
        val += wc * tile_energies_and_slopes(q.data(), M, be, e.data(), s.data());
        for (int64_t k = 0; k < d; ++k) {
          const T* Uk = U.data() + 2 * k * Mp;
          T* Gk = GA.data() + k * Mp;
          T acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < M; ++j) {
            const T f = wc * s[j] * Uk[j];
            Gk[j] += f;
            acc += f;
          }
          cross_sum[k] = acc;
        }
      } else {
        val += wc * tile_energy_sum(q.data(), M, be);
      }
      // within pairs (x_j, x_{j+o mod M}), by offset
      if (ww != T(0)) {
        for (int64_t o = 1; 2 * o <= M; ++o) {
          const int64_t n = 2 * o == M ? M / 2 : M;
          for (int64_t k = 0; k < d; ++k) {
            const T* Uk = U.data() + 2 * k * Mp;
            T* Wk = W.data() + k * Mp;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) Wk[j] = Uk[j] - Uk[j + o];
          }
          P.quad_soa(W.data(), Mp, n, d, q.data());
          if (!need_grad) {
            val += ww * tile_energy_sum(q.data(), n, be);
            continue;
          }
          val += ww * tile_energies_and_slopes(q.data(), n, be, e.data(), s.data());
          for (int64_t k = 0; k < d; ++k) {
            const T* Wk = W.data() + k * Mp;
            T* GAk = GA.data() + k * Mp;
            T* GBk = GB.data() + 2 * k * Mp + o;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
              const T f = ww * s[j] * Wk[j];
              GAk[j] += f;
              GBk[j] -= f;
            }
          }
        }
      }
      if (vp) vp[r] = static_cast<T>(val);
      if (!need_grad) continue;
      const T g = gp ? gp[r * gstride] : T(1);
      if (gxp) {
        for (int64_t j = 0; j < M; ++j) {
          for (int64_t k = 0; k < d; ++k) {
            const T* GBk = GB.data() + 2 * k * Mp;
            tmp[k] = GA[k * Mp + j] + (GBk[j] + GBk[j + M]);
          }
          P.apply(tmp, g, gxp + (r * M + j) * d, d);
        }
      }
      if (gyp) {
        P.apply(cross_sum, -g, out, d);
        std::copy(out, out + d, gyp + r * d);
      }
    }
  });
}

// value (B,) if given; gx (B, M, d) / gy (B, d) scaled by grad[r] when grad is given (else 1).
inline void energy_score_rows(const at::Tensor& x, const at::Tensor& y, const at::Tensor& beta,
                              const at::Tensor& prec, int64_t kind, PairWeights w, const at::Tensor* grad,
                              at::Tensor* value, at::Tensor* gx, at::Tensor* gy) {
  const int64_t B = x.size(0), M = x.size(1), d = x.size(2);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_score_rows", [&] {
    using T = scalar_t;
    const int64_t K = kind == kBlock ? prec.size(1) : 0;
    ET_DISPATCH_METRIC(kind, K, T, [&] {
      energy_score_rows_impl<T, Prec>(x.data_ptr<T>(), x.stride(0), x.stride(1), y.data_ptr<T>(), y.stride(0),
                                      beta.data_ptr<T>(), beta.stride(0), prec.data_ptr<T>(), prec.stride(0),
                                      grad ? grad->data_ptr<T>() : nullptr, grad ? grad->stride(0) : 0, B, M, d,
                                      static_cast<T>(w.cross), static_cast<T>(w.within_a),
                                      value ? value->data_ptr<T>() : nullptr, gx ? gx->data_ptr<T>() : nullptr,
                                      gy ? gy->data_ptr<T>() : nullptr);
    });
  });
}

}  // namespace cpu
}  // namespace etweedie
