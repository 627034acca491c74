// Per-draw math of the Student-t score (paper Cor. student_t; DESIGN §1), shared by the CPU
// and CUDA kernels.  Noise q(u) ∝ (1 + ‖u‖_P²)^{−c}, c > d/2.  For one query y and one
// posterior draw x_i with u = y − x_i and q = uᵀPu:
//   w      = 1 / (1 + q)                      residual weight (1 at a coincident draw)
//   slope  = 2 dw/dq = −2 w²
//   s(y)   = −2c P (1/N) Σ_i w_i u_i = −2c P m
// Backward with upstream g (on s) and g_m (on m), h = −2c P g + g_m:
//   ∂L/∂u_i = (1/N) [ w_i h + slope_i (h·u_i) P u_i ]      ∂L/∂y = Σ_i ∂L/∂u_i,  ∂L/∂x_i = −∂L/∂u_i
//   ∂L/∂c   = −2 g·Pm
//   ∂L/∂P   = −2c g mᵀ + (1/N) Σ_i ½ slope_i (h·u_i) u_i u_iᵀ
// This is the Energy-Tweedie score's structure (et_score.h) with λ → 2c and the weight
// q^{(β−2)/2} → 1/(1 + q); no β, and the weight is smooth everywhere (no special case at q = 0).
// q = inf (a draw beyond float range) gives w = 0; NaN propagates.
#pragma once

#include "macros.h"

namespace etweedie {

template <typename T>
ET_HD T student_t_weight(T q) {
  return T(1) / (T(1) + q);
}

template <typename T>
ET_HD T student_t_weight_slope(T w) {
  return T(-2) * w * w;
}

}  // namespace etweedie
