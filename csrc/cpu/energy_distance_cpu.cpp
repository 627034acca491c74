// CPU kernels of etweedie::energy_distance_fwd / energy_distance_bwd (schemas in csrc/etweedie.cpp).
//
//   ED(a, b) = 2 E‖a − b‖_P^β − E‖a − a'‖_P^β − E‖b − b'‖_P^β
//            = 2/(nm) Σ_{i,j} E(a_i − b_j) − w_n Σ_{i<j} E(a_i − a_j) − w_m Σ_{i<j} E(b_i − b_j),
//   w_n = 2/(n(n−1)) (unbiased: the signed U-statistic, within means over i ≠ j) or 2/n²
//   (the V-statistic, i = j terms are 0).
//
// The pair engine (csrc/cpu/energy_cpu.h) forms every pair from direct differences, tiled so
// that memory stays O((n + m)·d) for any n, m, and exploits the symmetry of the within sums in
// the forward pass.  Small d with many rows and no β or metric gradient takes the row kernel of
// energy_rows_cpu.h instead (each cloud's within pairs in runs by offset, one cross run per point
// of b).
// Inputs are canonical: a (B, n, d), b (B, m, d), beta (B,), prec (B, *param).
#include <torch/library.h>

#include "../common/checks.h"
#include "energy_cpu.h"
#include "energy_rows_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

double within_weight(int64_t n, bool unbiased) {
  const double k = static_cast<double>(n);
  if (n < 2) return 0.0;
  return unbiased ? 2.0 / (k * (k - 1.0)) : 2.0 / (k * k);
}

PairWeights energy_distance_weights(int64_t n, int64_t m, bool unbiased) {
  const double cross = n > 0 && m > 0 ? 2.0 / (static_cast<double>(n) * static_cast<double>(m)) : 0.0;
  return {cross, -within_weight(n, unbiased), -within_weight(m, unbiased)};
}

at::Tensor energy_distance_fwd_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                   const at::Tensor& prec, int64_t kind, bool unbiased) {
  checks::energy_args("energy_distance", a, b, beta, prec, kind);
  checks::energy_distance_sizes(a, b, unbiased);
  const auto w = energy_distance_weights(a.size(1), b.size(1), unbiased);
  if (energy_rows_applicable(a.size(0), a.size(1), b.size(1), a.size(2), false, false)) {
    auto value = at::empty({a.size(0)}, a.options());
    energy_rows(a, b, beta, prec, kind, w, nullptr, &value, nullptr, nullptr);
    return value;
  }
  return energy_forward("energy_distance", a, b, beta, prec, kind, w);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_distance_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta, const at::Tensor& prec,
    int64_t kind, bool unbiased, bool need_a, bool need_b, bool need_beta, bool need_prec) {
  checks::energy_args("energy_distance_bwd", a, b, beta, prec, kind);
  checks::same_dtype_device("energy_distance_bwd", {"a", &a}, {{"grad", &grad}});
  checks::rows("energy_distance_bwd", "grad", grad, a.size(0));
  checks::energy_distance_sizes(a, b, unbiased);
  const auto w = energy_distance_weights(a.size(1), b.size(1), unbiased);
  if (energy_rows_applicable(a.size(0), a.size(1), b.size(1), a.size(2), need_beta, need_prec)) {
    auto g = grad.contiguous();
    auto empty = [&] { return at::empty({0}, a.options()); };
    auto ga = need_a ? at::empty(a.sizes(), a.options()) : empty();
    auto gb = need_b ? at::empty(b.sizes(), a.options()) : empty();
    energy_rows(a, b, beta, prec, kind, w, &g, nullptr, need_a ? &ga : nullptr, need_b ? &gb : nullptr);
    return {ga, gb, empty(), empty()};
  }
  return energy_backward("energy_distance", grad, a, b, beta, prec, kind, w, need_a, need_b, need_beta, need_prec);
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) {
  m.impl("energy_distance_fwd", &etweedie::cpu::energy_distance_fwd_cpu);
  m.impl("energy_distance_bwd", &etweedie::cpu::energy_distance_bwd_cpu);
}
