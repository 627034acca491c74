// CPU kernel of etweedie::is_score_fwd: the self-normalized importance-sampling oracle
//   w_j ∝ q(y − x_j) = exp(−(λ/β)‖y − x_j‖_P^β),
//   score(y) = Σ_j w_j (−λ ‖u_j‖_P^{β−2} P u_j),  mean(y) = Σ_j w_j x_j,  ESS = 1/Σ_j w_j²,
// over a clean bank x_1..x_M, for every query y.
//
// One pass over the bank per query with an online log-sum-exp: a running maximum log-weight
// and running sums that are rescaled when the maximum grows.  The bank is processed in tiles
// of kTile points: log-weights and residual weights of a tile in one vectorized loop
// (fastmath.h), then O(d) accumulation per point; for small d the tile's residuals are
// transposed (structure of arrays) so that every loop vectorizes across bank points.  Memory: O(d) per thread; the Q×M weight
// matrix never exists.  Parallel over queries.
//
// Shapes: y (Q, d) contiguous, bank (M, d) contiguous, prec (1, *param) (one shared metric),
// beta and lam scalars.  Returns (score (Q, d), mean (Q, d), ess (Q,)).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/checks.h"
#include "et_score_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

// Running state of the online log-sum-exp for one query.  The running sums are double even for
// float32 data: per-tile partial sums are float (64 points), but adding 2,500 of them (a
// 160,000-point bank) into one float loses ~1e-4 relative accuracy; double costs nothing here.
template <typename T>
struct LseState {
  T run_max = -std::numeric_limits<T>::infinity();
  double sum_e = 0, sum_e2 = 0;
  // Rescale the running sums (and the two d-vectors) when a tile raises the maximum log-weight.
  void rebase(T tile_max, double* a, double* b, int64_t d) {
    if (!(tile_max > run_max)) return;
    const double scale = run_max == -std::numeric_limits<T>::infinity() ? 0.0 : std::exp(double(run_max) - tile_max);
    sum_e *= scale;
    sum_e2 *= scale * scale;
    for (int64_t k = 0; k < d; ++k) {
      a[k] *= scale;
      b[k] *= scale;
    }
    run_max = tile_max;
  }
};

// On return: score = −λ P Σ w r u, mean = y − Σ w u (u = y − x_j; the second form keeps the
// mean accurate in the SoA path, where only residuals are stored), ess = 1/Σ w².
template <typename T, typename Prec>
void is_score_row(const Prec& P, const T* y, const T* bank, int64_t M, int64_t d, T beta, T lam, T* score, T* mean,
                  T* ess, double* acc_r, double* acc_u, T* scratch) {
  T ut[kSmallD * kTile], q[kTile], logw[kTile], r[kTile], e[kTile];
  LseState<T> st;
  std::fill(acc_r, acc_r + d, 0.0);
  std::fill(acc_u, acc_u + d, 0.0);
  const T half_beta = T(0.5) * beta, lam_over_beta = lam / beta;
  const bool small = d <= kSmallD;
  for (int64_t j0 = 0; j0 < M; j0 += kTile) {
    const int64_t n = std::min(kTile, M - j0);
    if (small) {
      residual_tile(y, bank + j0 * d, d, n, d, ut);
      P.quad_soa(ut, kTile, n, d, q);
    } else {
      for (int64_t t = 0; t < n; ++t) q[t] = P.quad(y, bank + (j0 + t) * d, d);
    }
    T tile_max = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : tile_max)
    for (int64_t t = 0; t < n; ++t) {
      const T qb = pow_pos(q[t], half_beta);  // ‖u‖^β
      logw[t] = -lam_over_beta * qb;
      r[t] = q[t] > T(0) ? qb / (q[t] > T(0) ? q[t] : T(1)) : (beta == T(2) ? T(1) : T(0));  // ‖u‖^{β−2}
      tile_max = tile_max > logw[t] ? tile_max : logw[t];
    }
    st.rebase(tile_max, acc_r, acc_u, d);
    T se = 0, se2 = 0;
    const T mx = st.run_max;
#pragma omp simd reduction(+ : se, se2)
    for (int64_t t = 0; t < n; ++t) {
      e[t] = fast_exp(logw[t] - mx);
      se += e[t];
      se2 += e[t] * e[t];
    }
    st.sum_e += se;
    st.sum_e2 += se2;
    if (small) {
      for (int64_t k = 0; k < d; ++k) {
        const T* uk = ut + k * kTile;
        T a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
        for (int64_t t = 0; t < n; ++t) {
          a += e[t] * r[t] * uk[t];
          b += e[t] * uk[t];
        }
        acc_r[k] += a;
        acc_u[k] += b;
      }
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const T* xt = bank + (j0 + t) * d;
        const T et = e[t], er = e[t] * r[t];
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) {
          const T u = y[k] - xt[k];
          acc_r[k] += er * u;
          acc_u[k] += et * u;
        }
      }
    }
  }
  const double inv = 1.0 / st.sum_e;
  for (int64_t k = 0; k < d; ++k) {
    scratch[k] = static_cast<T>(acc_r[k] * inv);
    mean[k] = static_cast<T>(y[k] - acc_u[k] * inv);
  }
  P.apply(scratch, -lam, score, d);
  *ess = static_cast<T>(st.sum_e * st.sum_e / st.sum_e2);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> is_score_fwd_cpu(const at::Tensor& y, const at::Tensor& bank,
                                                                double beta, double lam, const at::Tensor& prec,
                                                                int64_t kind) {
  checks::is_score_args("is_score", y, bank, beta, lam, prec, kind);
  const int64_t Q = y.size(0), M = bank.size(0), d = y.size(1);
  auto score = at::empty({Q, d}, y.options());
  auto mean = at::empty({Q, d}, y.options());
  auto ess = at::empty({Q}, y.options());
  if (Q == 0 || d == 0) return {score, mean, ess};
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "is_score_fwd_cpu", [&] {
    using T = scalar_t;
    const T* yp = y.data_ptr<T>();
    const T* xp = bank.data_ptr<T>();
    T* sp = score.data_ptr<T>();
    T* mp = mean.data_ptr<T>();
    T* ep = ess.data_ptr<T>();
    const int64_t kblock = kind == kBlock ? prec.size(1) : 0;
    ET_DISPATCH_METRIC(kind, kblock, T, [&] {
      const Prec P{prec.data_ptr<T>()};
      at::parallel_for(0, Q, 4, [&](int64_t q0, int64_t q1) {
        std::vector<double> acc_r(d), acc_u(d);
        std::vector<T> scratch(d);
        for (int64_t i = q0; i < q1; ++i)
          is_score_row<T, Prec>(P, yp + i * d, xp, M, d, static_cast<T>(beta), static_cast<T>(lam), sp + i * d,
                                mp + i * d, ep + i, acc_r.data(), acc_u.data(), scratch.data());
      });
    });
  });
  return {score, mean, ess};
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) { m.impl("is_score_fwd", &etweedie::cpu::is_score_fwd_cpu); }
