// Per-pair math of the Energy-Tweedie score (DESIGN §1), shared by CPU and CUDA kernels.
//
// For one query y and one posterior draw x_i with u = y − x_i and q = uᵀPu:
//   w      = q^{(β−2)/2}                 residual weight      (0 at q = 0: coincident draw)
//   slope  = (β−2) q^{(β−4)/2} = (β−2) w/q   d w / d q · 2       (0 at q = 0)
//   s(y)   = −λ P (1/N) Σ_i w_i u_i
// Backward with upstream g and h = −λ P g:
//   ∂L/∂u_i = (1/N) [ w_i h + slope_i (h·u_i) P u_i ]
//   ∂L/∂β   = (1/N) Σ_i (h·u_i) w_i · ½ ln q_i
//   ∂L/∂P   = −λ g mᵀ + (1/N) Σ_i ½ slope_i (h·u_i) u_i u_iᵀ      (m = (1/N) Σ w_i u_i)
// The importance-sampling oracle uses the generalized-Gaussian log-kernel
//   log q(u) = −(λ/β) q^{β/2} + const  and its score −λ q^{(β−2)/2} P u.
#pragma once

#include "fastmath.h"

namespace etweedie {

// At q = 0 the weight is 0 (the draw contributes nothing, never NaN), except for β = 2 where
// w ≡ 1 so that the Gaussian score stays linear (and its gradient continuous) through x_i = y.
template <typename T>
ET_HD T residual_weight(T q, T beta) {
  return q > T(0) ? pow_pos(q, (beta - T(2)) * T(0.5)) : (beta == T(2) ? T(1) : T(0));
}

template <typename T>
ET_HD T residual_weight_slope(T q, T w, T beta) {
  return q > T(0) ? (beta - T(2)) * w / (q > T(0) ? q : T(1)) : T(0);
}

template <typename T>
ET_HD T half_log(T q) {
  return q > T(0) ? T(0.5) * fast_log(q > T(0) ? q : T(1)) : T(0);
}

// The squared norms a kernel computes accurately, forward and backward.  The backward's slope
// (β−2) q^{(β−4)/2} (of size q^{-2} as β → 0) and the Student-t law's −2w² = −2(1 + q)^{-2} must
// stay normal numbers: a subnormal slope keeps a few bits or none, and the draw's second-order
// term slope·(h·u)·Pu, of the size of its weight, is lost — a gradient wrong by tens of percent
// with a right forward.  float32: q in [2^-62, 2^62] — at q = 2^62 the slope is ≥ 2^-124 for
// every β in (0, 2], and at q = 2^-62 it is ≤ 2^125 (at 2^-64 it exceeded float32's range for
// β < 1/32, an inf gradient).  float64: q in [2^-500, 2^510] (the slope between 2^-1020 and
// 2^1001 for every β > 0; a smaller q — a distinct draw closer to y than about 1e-150 — made the
// backward inf·0 = NaN, or q underflowed to 0 and the draw lost its weight).  q = 0 is in range
// only for a draw equal to y (coincident); a NaN or inf in the inputs gives a q out of range.
// The kernels flag a row with a draw out of range by writing NaN into it; on the CPU the op
// reruns such a float32 call in float64, a float64 one beyond the upper bound on data scaled by
// a power of two (its data are then beyond the op's [2^-200, 2^200] range), and a float64 one
// below the lower bound on the reference's exact near-pair form (etweedie/ops/reference.py,
// NEAR_PAIR_MODES); on a GPU the NaN row is returned (a rerun would need a device sync).  Keep in
// step with etweedie/ops/reference.py's NEAR_Q and kernels/et_score.py's _near_q / _far_q.  LAW 1
// (the Student-t weight 1/(1 + q)) needs no lower bound in float64: any q ≥ 0 is computed
// exactly there.
template <int LAW = 0>
ET_HD bool q_in_range(float q) { return q >= 0x1p-62f && q <= 0x1p62f; }
template <int LAW = 0>
ET_HD bool q_in_range(double q) { return q >= (LAW == 1 ? 0.0 : 0x1p-500) && q <= 0x1p510; }

// The value a kernel writes into a flagged row (host and device; no numeric_limits, which is not
// callable from device code).
template <typename T>
ET_HD T flagged_value() {
  return static_cast<T>(bits_float(0x7fc00000));  // quiet NaN
}

// −(λ/β)‖u‖_P^β from q = ‖u‖²_P: the log of the unnormalized generalized-Gaussian density.
template <typename T>
ET_HD T gg_log_kernel(T q, T beta, T lam) {
  return -(lam / beta) * pow_pos(q, beta * T(0.5));
}

}  // namespace etweedie
