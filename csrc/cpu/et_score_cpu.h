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
// through an L1 buffer on F16C CPUs: draw_rows_cpu.h).  The float32-query forward with d % 16 ==
// 0 on AVX2 CPUs takes 16 coordinates per step in registers for float32 and 16-bit draws alike,
// with the next four draws prefetched during each accumulation sweep: lanes16_cpu.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../common/et_score.h"
#include "draw_rows_cpu.h"
#include "stream_rows_cpu.h"
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

// Whether a draw with squared norm q is one the kernel computes accurately (q_in_range,
// csrc/common/et_score.h), or the query itself (q = 0 with every coordinate equal).
template <int LAW = 0, typename T, typename R>
inline bool draw_in_range(T q, const T* y, const R* x, int64_t d) {
  if (q_in_range<LAW>(q)) return true;
  if (q != T(0)) return false;
  for (int64_t j = 0; j < d; ++j) {
    if (y[j] != widen<T>(x[j])) return false;  // q underflowed to 0 for a distinct draw
  }
  return true;
}

// Calls f(j0, j1) over [0, d) in pieces of one cache line of the draws' format X, first
// prefetching that piece of each of the four rows next[0..3] (when next is not null) into L1:
// a pass that runs from L1 keeps memory busy fetching the next four draws.
template <typename X, typename F>
inline void with_next_prefetched(int64_t d, const X* const* next, const F& f) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(X));
  for (int64_t j0 = 0; j0 < d; j0 += kLine) {
    if (next != nullptr) {
      for (int t = 0; t < 4; ++t) __builtin_prefetch(next[t] + j0, 0, 3);
    }
    f(j0, std::min(d, j0 + kLine));
  }
}

}  // namespace cpu
}  // namespace etweedie

#include "lanes16_cpu.h"  // after draw_in_range and with_next_prefetched, which its loops call

namespace etweedie {
namespace cpu {

// q_t = u_tᵀ P u_t and (WITH_H) hu_t = h·u_t, u_t = y − x_t, for four draws x_0..3 and a metric
// that acts elementwise (isotropic: p[0]; diagonal: p[j]), in one sweep with independent sums
// (one draw at a time, its sums would be chains of dependent adds, bound by their latency rather
// than by the loads).  The forward's first pass (generic loops) and the backward's.
template <typename T, bool DIAG, bool WITH_H, typename X>
void quad_elementwise4(const T* y, const X* x0, const X* x1, const X* x2, const X* x3, const T* h, const T* p,
                       int64_t d, T* q, T* hu) {
  T q0 = 0, q1 = 0, q2 = 0, q3 = 0, h0 = 0, h1 = 0, h2 = 0, h3 = 0;
#pragma omp simd reduction(+ : q0, q1, q2, q3, h0, h1, h2, h3)
  for (int64_t j = 0; j < d; ++j) {
    const T pj = DIAG ? p[j] : T(1);
    const T yj = y[j];
    const T u0 = yj - widen<T>(x0[j]), u1 = yj - widen<T>(x1[j]);
    const T u2 = yj - widen<T>(x2[j]), u3 = yj - widen<T>(x3[j]);
    q0 += pj * u0 * u0;
    q1 += pj * u1 * u1;
    q2 += pj * u2 * u2;
    q3 += pj * u3 * u3;
    if constexpr (WITH_H) {
      const T hj = h[j];
      h0 += hj * u0;
      h1 += hj * u1;
      h2 += hj * u2;
      h3 += hj * u3;
    }
  }
  const T scale = DIAG ? T(1) : p[0];
  q[0] = scale * q0, q[1] = scale * q1, q[2] = scale * q2, q[3] = scale * q3;
  if constexpr (WITH_H) hu[0] = h0, hu[1] = h1, hu[2] = h2, hu[3] = h3;
}

template <typename Prec>
constexpr bool kElementwiseMetric = false;
template <typename T>
constexpr bool kElementwiseMetric<RowPrec<T, kIsotropic, 0>> = true;
template <typename T>
constexpr bool kElementwiseMetric<RowPrec<T, kDiagonal, 0>> = true;

// acc (length d) must be zeroed by the caller; on return acc = Σ_i w(q_i) u_i, u_i = y − x_i,
// q_i = u_iᵀ P u_i, for a weight w(q) of the score (et_score: residual_weight, q^{β/2−1};
// Student-t: 1/(1 + q)).  A draw of weight exactly 0 outside a four-draw sweep is skipped.
// Returns whether every draw was in range (draw_in_range): false flags the row (see q_in_range).
template <typename T, typename Prec, typename X, typename Weight>
bool weighted_residual_sum(const Prec& prec, const T* y, const X* x, int64_t sxn, int64_t N, int64_t d,
                           const Weight& weight, T* acc) {
#if ETWEEDIE_LANES16
  if constexpr (kLanes16<T, X, Prec>) {
    if (d > kSmallD && d % 16 == 0) return weighted_residual_sum16(prec, y, x, sxn, N, d, weight, acc);
  }
#endif
  bool in_range = true;
  if (d > kSmallD) {
    // Four draws per accumulation sweep: the draws are re-read from L1, and acc is loaded and
    // stored once per four draws instead of once per draw (the second pass is pure L1 traffic);
    // isotropic and diagonal metrics take the four q in one sweep (quad_elementwise4), and the
    // accumulation prefetches the next four draws (with_next_prefetched).
    using R = typename DrawRows<X>::Row;
    DrawRows<X> rows;
    int64_t i = 0, sr = 0;
    for (; i + 4 <= N; i += 4) {
      const R* x0 = rows.stage(x + i * sxn, sxn, 4, d, &sr);
      const R* x1 = x0 + sr;
      const R* x2 = x1 + sr;
      const R* x3 = x2 + sr;
      T qs[4];
      if constexpr (kElementwiseMetric<Prec>) {
        quad_elementwise4<T, std::is_same_v<Prec, RowPrec<T, kDiagonal, 0>>, false, R>(y, x0, x1, x2, x3, nullptr,
                                                                                      prec.p, d, qs, nullptr);
      } else {
        qs[0] = prec.quad(y, x0, d), qs[1] = prec.quad(y, x1, d), qs[2] = prec.quad(y, x2, d), qs[3] = prec.quad(y, x3, d);
      }
      const T q0 = qs[0], q1 = qs[1], q2 = qs[2], q3 = qs[3];
      constexpr int L = Weight::kLaw;
      if (!(q_in_range<L>(q0) && q_in_range<L>(q1) && q_in_range<L>(q2) && q_in_range<L>(q3))) {
        in_range = in_range && draw_in_range<L>(q0, y, x0, d) && draw_in_range<L>(q1, y, x1, d) &&
                   draw_in_range<L>(q2, y, x2, d) && draw_in_range<L>(q3, y, x3, d);
      }
      const T w0 = weight(q0), w1 = weight(q1), w2 = weight(q2), w3 = weight(q3);
      const X* nx[4] = {x + (i + 4) * sxn, x + (i + 5) * sxn, x + (i + 6) * sxn, x + (i + 7) * sxn};
      with_next_prefetched<X>(d, i + 8 <= N ? nx : nullptr, [&](int64_t j0, int64_t j1) {
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) {
          const T yj = y[j];
          acc[j] += w0 * (yj - widen<T>(x0[j])) + w1 * (yj - widen<T>(x1[j])) + w2 * (yj - widen<T>(x2[j])) +
                    w3 * (yj - widen<T>(x3[j]));
        }
      });
    }
    for (; i < N; ++i) {
      const R* xi = rows.stage(x + i * sxn, sxn, 1, d, &sr);
      const T qi = prec.quad(y, xi, d);
      in_range = in_range && draw_in_range<Weight::kLaw>(qi, y, xi, d);
      const T w = weight(qi);
      if (w == T(0)) continue;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[j] += w * (y[j] - widen<T>(xi[j]));
    }
    return in_range;
  }
  // Small d: residuals of a tile transposed to structure-of-arrays so that q, the weights and
  // the accumulation all vectorize across draws.
  T ut[kSmallD * kTile], q[kTile], w[kTile];
  for (int64_t i0 = 0; i0 < N; i0 += kTile) {
    const int64_t n = std::min(kTile, N - i0);
    residual_tile(y, x + i0 * sxn, sxn, n, d, ut);
    prec.quad_soa(ut, kTile, n, d, q);
    int all_in = 1;
#pragma omp simd reduction(& : all_in)
    for (int64_t t = 0; t < n; ++t) all_in &= static_cast<int>(q_in_range<Weight::kLaw>(q[t]));
    for (int64_t t = 0; !all_in && in_range && t < n; ++t) {
      if (q_in_range<Weight::kLaw>(q[t])) continue;
      bool same = q[t] == T(0);  // coincident only if every residual coordinate is exactly 0
      for (int64_t k = 0; same && k < d; ++k) same = ut[k * kTile + t] == T(0);
      in_range = same;
    }
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
  return in_range;
}

// The et_score weight w(q) = q^{β/2−1} (0 at q = 0) as the functor of weighted_residual_sum and
// weighted_residual_sum_bwd (shape_term: this draw's part of ∂/∂β, summed then divided by N).
template <typename T>
struct ResidualWeight {
  static constexpr int kLaw = 0;  // the range check of the Energy-Tweedie weight (q_in_range)
  T beta;
  T operator()(T q) const { return residual_weight(q, beta); }
  T slope(T q, T w) const { return residual_weight_slope(q, w, beta); }
  T shape_term(T q, T w, T hu) const { return hu * w * half_log(q); }
};

// The backward's second pass over four draws x_0..3 (still in L1 from the first), for metrics
// that act elementwise (isotropic: p[0]; diagonal: p[j]):  g_t = a_t h + c_t p ⊙ (y − x_t),
// gy += Σ_t g_t and gx_t = −g_t (gx rows may be null).  gy, y and h are loaded once per four
// draws instead of once per draw (the per-draw grad_u of metric_cpu.h), which is most of the
// backward's arithmetic at large d.  next (four raw draw rows, or null): prefetched into L1
// along the way, a cache line of each per 64 bytes of them, so that memory does not idle while
// this pass runs from L1.
template <typename T, bool DIAG, typename X, typename XN>
void grad_u_elementwise4(const T* y, const X* x0, const X* x1, const X* x2, const X* x3, const T* h, const T* a,
                         const T* c, const T* p, int64_t d, T* gy, T* gx0, T* gx1, T* gx2, T* gx3,
                         const XN* const* next) {
  with_next_prefetched<XN>(d, next, [&](int64_t j0, int64_t j1) {
    if (gx0 != nullptr) {
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) {
        const T pj = DIAG ? p[j] : p[0];
        const T yj = y[j], hj = h[j];
        const T g0 = a[0] * hj + c[0] * pj * (yj - widen<T>(x0[j]));
        const T g1 = a[1] * hj + c[1] * pj * (yj - widen<T>(x1[j]));
        const T g2 = a[2] * hj + c[2] * pj * (yj - widen<T>(x2[j]));
        const T g3 = a[3] * hj + c[3] * pj * (yj - widen<T>(x3[j]));
        gy[j] += (g0 + g1) + (g2 + g3);
        gx0[j] = -g0;
        gx1[j] = -g1;
        gx2[j] = -g2;
        gx3[j] = -g3;
      }
    } else {
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) {
        const T pj = DIAG ? p[j] : p[0];
        const T yj = y[j];
        gy[j] += (a[0] + a[1] + a[2] + a[3]) * h[j] +
                 pj * ((c[0] * (yj - widen<T>(x0[j])) + c[1] * (yj - widen<T>(x1[j]))) +
                       (c[2] * (yj - widen<T>(x2[j])) + c[3] * (yj - widen<T>(x3[j]))));
      }
    }
  });
}

// The draws' part of the backward of one query row, shared by et_score and student_t_score
// (math: csrc/common/et_score.h): for m = (1/N) Σ_i w(q_i) u_i and the upstream gradient h on m
// (h = −scale·P g + g_m, scale = λ or 2c),
//   ∂L/∂u_i = (1/N) [ w_i h + c_i P u_i ],   c_i = slope(q_i, w_i) · (h·u_i),  slope = 2 dw/dq,
// summed into gy, written to gx row i as −∂L/∂u_i (x's format, streamed; gx may be null), with
// the metric's gradient Σ_i ½ c_i u_i u_iᵀ / N added to gp (may be null).  Returns the weight
// parameter's gradient (1/N) Σ_i shape_term(q_i, w_i, h·u_i) (∂L/∂β for et_score) when
// want_shape, else 0.  A draw with w = c = 0 (coincident, or q = ∞) contributes nothing and
// gets a zero gradient row.  Isotropic and diagonal metrics take four draws per L1 pass
// (grad_u_elementwise4).  rows and gxrow (4·d values) are the caller's per-thread scratch.
//   Weight: T operator()(T q) -> w;  T slope(T q, T w);  T shape_term(T q, T w, T hu).
template <typename T, typename Prec, typename X, typename Weight>
T weighted_residual_sum_bwd(const Prec& P, const Weight& weight, const T* y, const X* x, int64_t sxn, int64_t N,
                            int64_t d, const T* h, T* gy, X* gx, T* gp, bool want_shape, DrawRows<X>& rows,
                            T* gxrow) {
#if ETWEEDIE_LANES16
  if constexpr (kLanes16<T, X, Prec>) {
    // both passes in registers, ∂L/∂x rounded and streamed from them (lanes16_cpu.h); a block
    // metric's loops below go draw by draw, slower
    if (d % 16 == 0 && gp == nullptr && (gx == nullptr || (reinterpret_cast<uintptr_t>(gx) & 31) == 0)) {
      return weighted_residual_sum_bwd16<X>(P, weight, y, x, sxn, N, d, h, gy, gx, want_shape);
    }
  }
#endif
  using R = typename DrawRows<X>::Row;  // float16 rows staged as float (draw_rows_cpu.h)
  const T inv_n = T(1) / static_cast<T>(N);
  T gshape = 0;
  int64_t i = 0, sr = 0;
  if constexpr (kElementwiseMetric<Prec>) {
    // four draws at a time: q, h·u from memory, then one L1 pass for their gradients
    constexpr bool kDiag = std::is_same_v<Prec, RowPrec<T, kDiagonal, 0>>;
    for (; i + 4 <= N; i += 4) {
      const R* xs[4];
      T aw[4], cw[4];
      const R* staged = rows.stage(x + i * sxn, sxn, 4, d, &sr);
      for (int t = 0; t < 4; ++t) xs[t] = staged + t * sr;
      T qs[4], hus[4];
      quad_elementwise4<T, kDiag, true, R>(y, xs[0], xs[1], xs[2], xs[3], h, P.p, d, qs, hus);
      for (int t = 0; t < 4; ++t) {
        const T q = qs[t], hu = hus[t];
        const T w = weight(q);
        const T c = weight.slope(q, w) * hu;
        aw[t] = w * inv_n;
        cw[t] = c * inv_n;
        if (want_shape) gshape += weight.shape_term(q, w, hu);
        if (gp) P.accum_outer(y, xs[t], T(0.5) * c * inv_n, gp, d);
      }
      T* r = gx ? gxrow : nullptr;
      const X* nx[4] = {x + (i + 4) * sxn, x + (i + 5) * sxn, x + (i + 6) * sxn, x + (i + 7) * sxn};
      grad_u_elementwise4<T, kDiag, R, X>(y, xs[0], xs[1], xs[2], xs[3], h, aw, cw, P.p, d, gy, r,
                                          r ? r + d : nullptr, r ? r + 2 * d : nullptr, r ? r + 3 * d : nullptr,
                                          i + 8 <= N ? nx : nullptr);
      if (gx) stream_row(gx + i * d, gxrow, 4 * d);
    }
  }
  for (; i < N; ++i) {
    const R* xi = rows.stage(x + i * sxn, sxn, 1, d, &sr);
    T q, hu;
    P.quad_dot(y, xi, h, d, q, hu);
    const T w = weight(q);
    const T c = weight.slope(q, w) * hu;
    if (w == T(0) && c == T(0)) {  // coincident draw (or q = ∞): contributes nothing
      if (gx) std::fill(gx + i * d, gx + (i + 1) * d, narrow<X>(T(0)));
      continue;
    }
    // ∂L/∂x_i goes through an L1 row and out with streaming stores (written once, never re-read here)
    P.grad_u(y, xi, h, w * inv_n, c * inv_n, gy, gx ? gxrow : nullptr, d);
    if (gx) stream_row(gx + i * d, gxrow, d);
    if (want_shape) gshape += weight.shape_term(q, w, hu);
    if (gp) P.accum_outer(y, xi, T(0.5) * c * inv_n, gp, d);
  }
  return gshape * inv_n;
}

// m = acc/N and s = −λ P m for one row; a row with a draw out of range (draw_in_range) is
// flagged with NaN in m and s.
template <typename T, typename Prec, typename X>
void et_score_row(const Prec& prec, const T* y, const X* x, int64_t sxn, int64_t N, int64_t d, T beta, T lam,
                  T* m, T* s) {
  std::fill(m, m + d, T(0));
  if (!weighted_residual_sum<T, Prec, X>(prec, y, x, sxn, N, d, ResidualWeight<T>{beta}, m)) {
    std::fill(m, m + d, std::numeric_limits<T>::quiet_NaN());
    std::fill(s, s + d, std::numeric_limits<T>::quiet_NaN());
    return;
  }
  const T inv_n = T(1) / static_cast<T>(N);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) m[j] *= inv_n;
  prec.apply(m, -lam, s, d);
}

}  // namespace cpu
}  // namespace etweedie
