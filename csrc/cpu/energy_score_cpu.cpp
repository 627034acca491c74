// CPU kernels of etweedie::energy_score_fwd / energy_score_bwd (schemas in csrc/etweedie.cpp).
//
//   ES(x_{1..M}, y) = (1/M) Σ_i ‖x_i − y‖_P^β − c_M Σ_{i<j} ‖x_i − x_j‖_P^β,
//   c_M = 1/(M(M−1)) (fair, the unbiased pairwise term) or 1/M² (biased, i = j terms are 0).
//
// The pair engine (csrc/cpu/energy_cpu.h) runs with cloud a = the M samples and cloud b = the
// target as a one-point cloud; parallel over (row, block of samples).  With no β / metric
// gradient asked, small d with many rows takes the row kernel of energy_rows_cpu.h and
// large d (float32, up to 255 draws) the Gram-form row kernel of energy_score_gram_cpu.h
// instead.  Inputs are canonical (etweedie/ops/energy_score.py): samples (B, M, d), target (B, d),
// beta (B,), prec (B, *param).
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "../common/checks.h"
#include "energy_cpu.h"
#include "energy_score_gram_cpu.h"
#include "energy_rows_cpu.h"
#include "fresh_output_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

PairWeights energy_score_weights(int64_t M, bool fair) {
  const double m = static_cast<double>(M);
  const double within = M < 2 ? 0.0 : (fair ? 1.0 / (m * (m - 1.0)) : 1.0 / (m * m));
  return {M > 0 ? 1.0 / m : 0.0, -within, 0.0};
}

void check_target(const at::Tensor& samples, const at::Tensor& target) {
  TORCH_CHECK(samples.dim() == 3, "energy_score: samples must be (B, M, d), got ", samples.sizes());
  TORCH_CHECK(target.dim() == 2 && target.size(0) == samples.size(0) && target.size(1) == samples.size(2),
              "energy_score: target must be (B, d) = (", samples.size(0), ", ", samples.size(2), "), got ",
              target.sizes());
  TORCH_CHECK(samples.size(1) >= 1 || samples.size(0) == 0, "energy_score: need at least one sample (M >= 1)");
}

// Every entry (the small-d row kernel included) checks the full canonical form first.
void check_args(const char* op, const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                const at::Tensor& prec, int64_t kind) {
  check_target(samples, target);
  checks::energy_args(op, samples, target.unsqueeze(1), beta, prec, kind);
}

// The Gram-form row kernel (energy_score_gram_cpu.h), after the canonical checks of the engine.
bool use_score_gram(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                    const at::Tensor& prec, int64_t kind, bool need_beta, bool need_prec) {
  if (!energy_score_gram_applicable(samples, target, need_beta, need_prec)) return false;
  check_energy_canonical("energy_score", samples, target.unsqueeze(1), beta, prec, kind);
  return true;
}

// The rows energy_score_gram handed back (`redo`: points that overflow float when centred, or a
// pair too close for its single row scale) recomputed by the pair engine in float64 from
// direct differences, and written into the float outputs: value (B,), gs (B, M, d), gt (B, d),
// each when defined.  grad: the upstream gradient (B,), or undefined for a unit one.
void redo_gram_rows(const std::vector<uint8_t>& redo, const at::Tensor& samples, const at::Tensor& target,
                    const at::Tensor& beta, const at::Tensor& prec, int64_t kind, PairWeights w, const at::Tensor& grad,
                    at::Tensor value, at::Tensor gs, at::Tensor gt) {
  std::vector<int64_t> rows;
  for (size_t r = 0; r < redo.size(); ++r)
    if (redo[r]) rows.push_back(static_cast<int64_t>(r));
  if (rows.empty()) return;
  const auto idx = at::tensor(rows, samples.options().dtype(at::kLong));
  auto wide = [&](const at::Tensor& t) { return t.index_select(0, idx).to(at::kDouble).contiguous(); };
  const auto s64 = wide(samples), t64 = wide(target).unsqueeze(1), b64 = wide(beta), p64 = wide(prec);
  if (!gs.defined() && !gt.defined()) {
    value.index_copy_(0, idx, energy_forward("energy_score", s64, t64, b64, p64, kind, w).to(at::kFloat));
    return;
  }
  const auto g64 = grad.defined() ? wide(grad) : at::ones({idx.size(0)}, s64.options());
  at::Tensor v64;
  const auto out = energy_backward("energy_score", g64, s64, t64, b64, p64, kind, w, gs.defined(), gt.defined(), false,
                                   false, value.defined() ? &v64 : nullptr);
  if (value.defined()) value.index_copy_(0, idx, v64.to(at::kFloat));
  if (gs.defined()) gs.index_copy_(0, idx, std::get<0>(out).to(at::kFloat));
  if (gt.defined()) gt.index_copy_(0, idx, std::get<1>(out).reshape({idx.size(0), target.size(1)}).to(at::kFloat));
}

at::Tensor energy_score_fwd_cpu(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                                const at::Tensor& prec, int64_t kind, bool fair) {
  check_args("energy_score", samples, target, beta, prec, kind);
  TORCH_CHECK(!fair || samples.size(1) >= 2 || samples.size(0) == 0,
              "energy_score: the fair estimator needs M >= 2 samples, got M = ", samples.size(1));
  if (energy_score_rows_applicable(samples, false, false)) {
    auto value = at::empty({samples.size(0)}, samples.options());
    energy_score_rows(samples, target, beta, prec, kind, energy_score_weights(samples.size(1), fair), nullptr, &value,
                      nullptr, nullptr);
    return value;
  }
  if (use_score_gram(samples, target, beta, prec, kind, false, false)) {
    auto value = at::empty({samples.size(0)}, samples.options());
    const auto w = energy_score_weights(samples.size(1), fair);
    std::vector<uint8_t> redo(samples.size(0), 0);
    energy_score_gram(samples, target, beta, prec, kind, w, nullptr, value.data_ptr<float>(), nullptr, nullptr,
                      redo.data());
    redo_gram_rows(redo, samples, target, beta, prec, kind, w, at::Tensor(), value, at::Tensor(), at::Tensor());
    return value;
  }
  return energy_forward("energy_score", samples, target.unsqueeze(1), beta, prec, kind,
                              energy_score_weights(samples.size(1), fair));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
    const at::Tensor& prec, int64_t kind, bool fair, bool need_samples, bool need_target, bool need_beta,
    bool need_prec) {
  check_args("energy_score_bwd", samples, target, beta, prec, kind);
  checks::same_dtype_device("energy_score_bwd", {"samples", &samples}, {{"grad", &grad}});
  checks::rows("energy_score_bwd", "grad", grad, samples.size(0));
  if (energy_score_rows_applicable(samples, need_beta, need_prec)) {
    auto g = grad.contiguous();
    TORCH_CHECK(g.dim() == 1 && g.size(0) == samples.size(0), "energy_score: grad must be (B,) = (", samples.size(0),
                "), got ", grad.sizes());
    auto empty = [&] { return at::empty({0}, samples.options()); };
    auto gs = need_samples ? at::empty(samples.sizes(), samples.options()) : empty();
    auto gt = need_target ? at::empty(target.sizes(), samples.options()) : empty();
    energy_score_rows(samples, target, beta, prec, kind, energy_score_weights(samples.size(1), fair), &g, nullptr,
                      need_samples ? &gs : nullptr, need_target ? &gt : nullptr);
    return {gs, gt, empty(), empty()};
  }
  if (use_score_gram(samples, target, beta, prec, kind, need_beta, need_prec)) {
    auto g = grad.contiguous();
    TORCH_CHECK(g.dim() == 1 && g.size(0) == samples.size(0) && g.scalar_type() == samples.scalar_type(),
                "energy_score: grad must be (B,) = (", samples.size(0), ") of the samples' dtype, got ", grad.sizes());
    auto empty = [&] { return at::empty({0}, samples.options()); };
    auto gs = need_samples ? reusable_empty(samples.sizes(), samples.options()) : empty();
    auto gt = need_target ? at::empty(target.sizes(), samples.options()) : empty();
    const auto w = energy_score_weights(samples.size(1), fair);
    std::vector<uint8_t> redo(samples.size(0), 0);
    energy_score_gram(samples, target, beta, prec, kind, w, g.data_ptr<float>(), nullptr,
                      need_samples ? gs.data_ptr<float>() : nullptr, need_target ? gt.data_ptr<float>() : nullptr,
                      redo.data());
    redo_gram_rows(redo, samples, target, beta, prec, kind, w, g, at::Tensor(), need_samples ? gs : at::Tensor(),
                   need_target ? gt : at::Tensor());
    return {gs, gt, empty(), empty()};
  }
  auto out = energy_backward("energy_score", grad, samples, target.unsqueeze(1), beta, prec, kind,
                                   energy_score_weights(samples.size(1), fair), need_samples, need_target, need_beta,
                                   need_prec);
  auto gt = std::get<1>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {std::get<0>(out), gt, std::get<2>(out), std::get<3>(out)};
}

// Training path: the value and the gradients for a unit upstream gradient in one pass over
// the pairs (the backward then only scales them by grad[r]); with many rows every pair is
// formed once instead of once in the forward and again in the backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_fwd_grad_cpu(
    const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta, const at::Tensor& prec, int64_t kind,
    bool fair, bool need_samples, bool need_target, bool need_beta, bool need_prec) {
  check_args("energy_score", samples, target, beta, prec, kind);
  TORCH_CHECK(!fair || samples.size(1) >= 2 || samples.size(0) == 0,
              "energy_score: the fair estimator needs M >= 2 samples, got M = ", samples.size(1));
  if (energy_score_rows_applicable(samples, need_beta, need_prec)) {
    auto empty = [&] { return at::empty({0}, samples.options()); };
    auto value = at::empty({samples.size(0)}, samples.options());
    auto gs = need_samples ? at::empty(samples.sizes(), samples.options()) : empty();
    auto gt = need_target ? at::empty(target.sizes(), samples.options()) : empty();
    energy_score_rows(samples, target, beta, prec, kind, energy_score_weights(samples.size(1), fair), nullptr, &value,
                      need_samples ? &gs : nullptr, need_target ? &gt : nullptr);
    return {value, gs, gt, empty(), empty()};
  }
  if (use_score_gram(samples, target, beta, prec, kind, need_beta, need_prec)) {
    auto empty = [&] { return at::empty({0}, samples.options()); };
    auto value = at::empty({samples.size(0)}, samples.options());
    auto gs = need_samples ? reusable_empty(samples.sizes(), samples.options()) : empty();
    auto gt = need_target ? at::empty(target.sizes(), samples.options()) : empty();
    const auto w = energy_score_weights(samples.size(1), fair);
    std::vector<uint8_t> redo(samples.size(0), 0);
    energy_score_gram(samples, target, beta, prec, kind, w, nullptr, value.data_ptr<float>(),
                      need_samples ? gs.data_ptr<float>() : nullptr, need_target ? gt.data_ptr<float>() : nullptr,
                      redo.data());
    redo_gram_rows(redo, samples, target, beta, prec, kind, w, at::Tensor(), value, need_samples ? gs : at::Tensor(),
                   need_target ? gt : at::Tensor());
    return {value, gs, gt, empty(), empty()};
  }
  at::Tensor value;
  auto ones = at::ones({samples.size(0)}, samples.options());
  auto out = energy_backward("energy_score", ones, samples, target.unsqueeze(1), beta, prec, kind,
                             energy_score_weights(samples.size(1), fair), need_samples, need_target, need_beta,
                             need_prec, &value);
  auto gt = std::get<1>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {value, std::get<0>(out), gt, std::get<2>(out), std::get<3>(out)};
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) {
  m.impl("energy_score_fwd", &etweedie::cpu::energy_score_fwd_cpu);
  m.impl("energy_score_bwd", &etweedie::cpu::energy_score_bwd_cpu);
  m.impl("energy_score_fwd_grad", &etweedie::cpu::energy_score_fwd_grad_cpu);
}
