// Fused Energy-Tweedie score for one query row on the CPU (used by et_score and
// langevin_step).  Math: csrc/common/et_score.h.
//
// Memory/compute trade-off: each posterior draw x_i is read from memory once.  For large d
// (> kSmallD) the draw stays in L1 between its two passes (q = uᵀPu, then m += w u), and the
// one pow per draw is negligible next to O(d) work.  For small d the pow dominates, so draws
// are processed in tiles of kTile: all q of the tile, then all weights in one vectorized loop
// (fastmath.h), then the accumulation.  Extra memory: O(d) per thread; nothing of size N·d.
//
// Shapes (per row b): y (d), x (N, d) with row stride sxn and unit stride over d,
// P the row's precision parameter.  Output m = (1/N) Σ w_i u_i and s = −λ P m.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../common/et_score.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kSmallD = 16;
constexpr int64_t kTile = 64;

// acc (length d) must be zeroed by the caller; on return acc = Σ_i w_i u_i.
template <typename T, typename Prec>
void et_score_accumulate(const Prec& prec, const T* y, const T* x, int64_t sxn, int64_t N, int64_t d,
                         T beta, T* acc) {
  if (d > kSmallD) {
    for (int64_t i = 0; i < N; ++i) {
      const T* xi = x + i * sxn;
      const T w = residual_weight(prec.quad(y, xi, d), beta);
      if (w == T(0)) continue;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[j] += w * (y[j] - xi[j]);
    }
    return;
  }
  T q[kTile], w[kTile];
  for (int64_t i0 = 0; i0 < N; i0 += kTile) {
    const int64_t n = std::min(kTile, N - i0);
    for (int64_t t = 0; t < n; ++t) q[t] = prec.quad(y, x + (i0 + t) * sxn, d);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) w[t] = residual_weight(q[t], beta);
    for (int64_t t = 0; t < n; ++t) {
      const T* xi = x + (i0 + t) * sxn;
      for (int64_t j = 0; j < d; ++j) acc[j] += w[t] * (y[j] - xi[j]);
    }
  }
}

// m = acc/N and s = −λ P m for one row.
template <typename T, typename Prec>
void et_score_row(const Prec& prec, const T* y, const T* x, int64_t sxn, int64_t N, int64_t d, T beta, T lam,
                  T* m, T* s) {
  std::fill(m, m + d, T(0));
  et_score_accumulate<T, Prec>(prec, y, x, sxn, N, d, beta, m);
  const T inv_n = T(1) / static_cast<T>(N);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) m[j] *= inv_n;
  prec.apply(m, -lam, s, d);
}

}  // namespace cpu
}  // namespace etweedie
