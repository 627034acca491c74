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
// Types: T (float or double) computes and accumulates; the draws are stored as X = T, bf16 or
// fp16 and widened to T in the loops that read them (widen<T>, csrc/common/low_precision.h), so a
// 16-bit cloud is read in 16 bits once, with no converted copy of the cloud (float16 rows pass
// through an L1 buffer on F16C CPUs: draw_rows_cpu.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../common/et_score.h"
#include "draw_rows_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kSmallD = 16;
constexpr int64_t kTile = 64;

// ut[k * kTile + t] = y[k] − x_t[k] for the n points x_t = x + t·sx of a tile (d ≤ kSmallD).
// Contiguous points with d ≤ 4 take an unrolled fixed-stride path (GCC turns it into shuffles);
// the generic path loops k outside so the inner loop still runs over points.
template <typename T, int D, typename X>
inline void residual_tile_fixed(const T* y, const X* x, int64_t n, T* ut) {
#pragma GCC unroll 4
  for (int k = 0; k < D; ++k) {
    const T yk = y[k];
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) ut[k * kTile + t] = yk - widen<T>(x[t * D + k]);
  }
}

template <typename T, typename X>
inline void residual_tile(const T* y, const X* x, int64_t sx, int64_t n, int64_t d, T* ut) {
  if (sx == d) {
    switch (d) {
      case 1: return residual_tile_fixed<T, 1, X>(y, x, n, ut);
      case 2: return residual_tile_fixed<T, 2, X>(y, x, n, ut);
      case 3: return residual_tile_fixed<T, 3, X>(y, x, n, ut);
      case 4: return residual_tile_fixed<T, 4, X>(y, x, n, ut);
      default: break;
    }
  }
  for (int64_t k = 0; k < d; ++k) {
    const T yk = y[k];
    for (int64_t t = 0; t < n; ++t) ut[k * kTile + t] = yk - widen<T>(x[t * sx + k]);
  }
}

// acc (length d) must be zeroed by the caller; on return acc = Σ_i w(q_i) u_i, u_i = y − x_i,
// q_i = u_iᵀ P u_i, for a weight w(q) of the score (et_score: residual_weight, q^{β/2−1};
// Student-t: 1/(1 + q)).  A draw of weight exactly 0 outside a four-draw sweep is skipped.
template <typename T, typename Prec, typename X, typename Weight>
void weighted_residual_sum(const Prec& prec, const T* y, const X* x, int64_t sxn, int64_t N, int64_t d,
                           const Weight& weight, T* acc) {
  if (d > kSmallD) {
    // Four draws per accumulation sweep: the draws are re-read from L1, and acc is loaded and
    // stored once per four draws instead of once per draw (the second pass is pure L1 traffic).
    using R = typename DrawRows<X>::Row;
    DrawRows<X> rows;
    int64_t i = 0, sr = 0;
    for (; i + 4 <= N; i += 4) {
      const R* x0 = rows.stage(x + i * sxn, sxn, 4, d, &sr);
      const R* x1 = x0 + sr;
      const R* x2 = x1 + sr;
      const R* x3 = x2 + sr;
      const T w0 = weight(prec.quad(y, x0, d));
      const T w1 = weight(prec.quad(y, x1, d));
      const T w2 = weight(prec.quad(y, x2, d));
      const T w3 = weight(prec.quad(y, x3, d));
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const T yj = y[j];
        acc[j] += w0 * (yj - widen<T>(x0[j])) + w1 * (yj - widen<T>(x1[j])) + w2 * (yj - widen<T>(x2[j])) + w3 * (yj - widen<T>(x3[j]));
      }
    }
    for (; i < N; ++i) {
      const R* xi = rows.stage(x + i * sxn, sxn, 1, d, &sr);
      const T w = weight(prec.quad(y, xi, d));
      if (w == T(0)) continue;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[j] += w * (y[j] - widen<T>(xi[j]));
    }
    return;
  }
  // Small d: residuals of a tile transposed to structure-of-arrays so that q, the weights and
  // the accumulation all vectorize across draws.
  T ut[kSmallD * kTile], q[kTile], w[kTile];
  for (int64_t i0 = 0; i0 < N; i0 += kTile) {
    const int64_t n = std::min(kTile, N - i0);
    residual_tile(y, x + i0 * sxn, sxn, n, d, ut);
    prec.quad_soa(ut, kTile, n, d, q);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) w[t] = weight(q[t]);
    for (int64_t j = 0; j < d; ++j) {
      const T* uj = ut + j * kTile;
      T a = 0;
#pragma omp simd reduction(+ : a)
      for (int64_t t = 0; t < n; ++t) a += w[t] * uj[t];
      acc[j] += a;
    }
  }
}

// The et_score weight w(q) = q^{β/2−1} (0 at q = 0) as weighted_residual_sum's functor.
template <typename T>
struct ResidualWeight {
  T beta;
  T operator()(T q) const { return residual_weight(q, beta); }
};

// m = acc/N and s = −λ P m for one row.
template <typename T, typename Prec, typename X>
void et_score_row(const Prec& prec, const T* y, const X* x, int64_t sxn, int64_t N, int64_t d, T beta, T lam,
                  T* m, T* s) {
  std::fill(m, m + d, T(0));
  weighted_residual_sum<T, Prec, X>(prec, y, x, sxn, N, d, ResidualWeight<T>{beta}, m);
  const T inv_n = T(1) / static_cast<T>(N);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) m[j] *= inv_n;
  prec.apply(m, -lam, s, d);
}

}  // namespace cpu
}  // namespace etweedie
