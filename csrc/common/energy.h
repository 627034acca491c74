// Per-pair math of the Mahalanobis energy score and the energy distance (DESIGN §1), shared
// by the CPU and CUDA kernels.
//
// For one pair with u = x_i − x_j and q = uᵀPu the pair energy and its derivatives are
//   E      = ‖u‖_P^β = q^{β/2}                            (0 at q = 0)
//   slope  = β q^{(β−2)/2}      so that ∂E/∂u = slope · P u,  ∂E/∂P = ½ slope · u uᵀ
//   ∂E/∂β  = ½ ln q · q^{β/2}                              (0 at q = 0)
// At a coincident pair (q = 0) slope is defined as 0: the true gradient there is 0 for β > 1,
// 0 is a subgradient for β = 1, and for β < 1 (where ‖u‖^β has a cusp and no gradient) 0 is
// the convention every backend and the reference follow — never NaN/inf.
//
// β = 1 (the default of both losses) and β = 2 take exact sqrt / square forms instead of the
// fastmath pow: they are both faster and exact to the last ulp.
#pragma once

#include <cmath>

#include "et_score.h"
#include "fastmath.h"

namespace etweedie {

template <typename T>
ET_HD T pair_energy(T q, T beta) {
  if (beta == T(1)) return q > T(0) ? std::sqrt(q) : T(0);
  if (beta == T(2)) return q > T(0) ? q : T(0);
  return pow_pos(q, beta * T(0.5));
}

template <typename T>
ET_HD T pair_energy_slope(T q, T beta) {
  if (beta == T(1)) return q > T(0) ? T(1) / std::sqrt(q > T(0) ? q : T(1)) : T(0);
  if (beta == T(2)) return q > T(0) ? T(2) : T(0);
  return q > T(0) ? beta * pow_pos(q, (beta - T(2)) * T(0.5)) : T(0);
}

// ∂E/∂β from q and E = pair_energy(q, β).
template <typename T>
ET_HD T pair_energy_dbeta(T q, T energy) {
  return half_log(q) * energy;
}

}  // namespace etweedie
