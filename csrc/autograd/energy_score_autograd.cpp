// Autograd kernel of etweedie::energy_score_fwd_grad, the training path of energy_score (schema
// in csrc/etweedie.cpp): the fused op returns the value and the gradients of value.sum(), so the
// backward only scales row r's share by the upstream grad[r].  The same rule as
// etweedie/rules/energy_score.py (fwd_grad_autograd_rules), which the Triton op keeps; this one
// runs for the CPU and CUDA kernels without a Python call (csrc/autograd/first_order.h).
#include <torch/library.h>

#include "../front/rows_front.h"
#include "first_order.h"

namespace etweedie {
namespace autograd {
namespace {

using Out5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using FwdGrad = Out5(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool, bool,
                     bool, bool, bool);

c10::TypedOperatorHandle<FwdGrad> fwd_grad_op() {
  static const auto op = front::kernel<FwdGrad>("etweedie::energy_score_fwd_grad");
  return op;
}

variable_list as_list(Out5&& out) {
  return {std::move(std::get<0>(out)), std::move(std::get<1>(out)), std::move(std::get<2>(out)),
          std::move(std::get<3>(out)), std::move(std::get<4>(out))};
}

struct EnergyScoreFwdGrad : public torch::autograd::Function<EnergyScoreFwdGrad> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& samples, const at::Tensor& target,
                               const at::Tensor& beta, const at::Tensor& prec, int64_t kind, bool fair, bool need_samples,
                               bool need_target, bool need_beta, bool need_prec) {
    at::AutoDispatchBelowADInplaceOrView below;
    variable_list out = as_list(fwd_grad_op().call(samples, target, beta, prec, kind, fair, need_samples, need_target,
                                                   need_beta, need_prec));
    ctx->save_for_backward({out[1], out[2], out[3], out[4], samples, target, beta, prec});
    ctx->saved_data["need"] = c10::List<bool>({need_samples, need_target, need_beta, need_prec});
    // the unit-gradient outputs are never differentiated: no zero-filled (B, M, d) upstream
    // gradients for them (backward reads the value's gradient only)
    ctx->mark_non_differentiable({out[1], out[2], out[3], out[4]});
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list result(10);  // one per forward argument; the six non-tensors get none
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    const auto need = ctx->saved_data["need"].toBoolList();
    static const char* names[4] = {"samples", "target", "beta", "prec"};
    variable_list grads(4);
    for (size_t i = 0; i < 4; ++i) {
      if (!ctx->needs_input_grad(i)) continue;
      TORCH_CHECK(need.get(i), "energy_score_fwd_grad: a gradient of ", names[i], " is asked for but need_", names[i],
                  " was False in the forward call");
      const at::Tensor& unit = saved[i];
      grads[i] = (i == 2 ? grad : rows_view(grad, unit.dim())).mul(unit);
    }
    // the saved unit gradients are constants of the graph: a second derivative through them
    // would be silently 0, so it raises instead
    grads = first_order_only("energy_score", std::move(grads), {saved[4], saved[5], saved[6], saved[7]});
    for (size_t i = 0; i < 4; ++i) result[i] = std::move(grads[i]);
    return result;
  }
};

Out5 energy_score_fwd_grad_autograd(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                                    const at::Tensor& prec, int64_t kind, bool fair, bool need_samples, bool need_target,
                                    bool need_beta, bool need_prec) {
  if (!at::GradMode::is_enabled() ||
      !(samples.requires_grad() || target.requires_grad() || beta.requires_grad() || prec.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below;  // nothing to record
    return fwd_grad_op().call(samples, target, beta, prec, kind, fair, need_samples, need_target, need_beta,
                              need_prec);
  }
  variable_list out = EnergyScoreFwdGrad::apply(samples, target, beta, prec, kind, fair, need_samples, need_target,
                                                need_beta, need_prec);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace
}  // namespace autograd
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, Autograd, m) {
  m.impl("energy_score_fwd_grad", &etweedie::autograd::energy_score_fwd_grad_autograd);
}
