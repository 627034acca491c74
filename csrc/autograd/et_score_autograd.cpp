// Autograd kernel of etweedie::et_score_fwd(y, x, beta, lam, prec, kind) -> (s, m) for the CPU and
// CUDA kernels: saves the canonical inputs and m, and runs the fused backward et_score_bwd on
// demand.  The same rule as etweedie/rules/et_score.py (autograd_rules), which the Triton op keeps;
// this one costs a training step no Python call (csrc/autograd/first_order.h).
#include <torch/library.h>

#include "../front/rows_front.h"
#include "first_order.h"

namespace etweedie {
namespace autograd {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Fwd = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using Bwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, int64_t, const at::Tensor&, bool, bool, bool, bool, bool);

c10::TypedOperatorHandle<Fwd> fwd_op() {
  static const auto op = front::kernel<Fwd>("etweedie::et_score_fwd");
  return op;
}

c10::TypedOperatorHandle<Bwd> bwd_op() {
  static const auto op = front::kernel<Bwd>("etweedie::et_score_bwd");
  return op;
}

struct EtScoreFwd : public torch::autograd::Function<EtScoreFwd> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                               const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto out = fwd_op().call(y, x, beta, lam, prec, kind);
    ctx->save_for_backward({y, x, beta, lam, prec, std::get<1>(out)});
    ctx->saved_data["kind"] = kind;
    ctx->set_materialize_grads(false);
    return {std::get<0>(out), std::get<1>(out)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    at::Tensor grad_s = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(y);
    at::Tensor grad_m = grad_outputs[1].defined() ? grad_outputs[1] : at::zeros_like(y);
    bool need[5];
    for (size_t i = 0; i < 5; ++i) need[i] = ctx->needs_input_grad(i);
    variable_list grads(5);
    {
      at::AutoGradMode no_grad(false);
      auto g = bwd_op().call(grad_s, grad_m, y, saved[1], saved[2], saved[3], saved[4], ctx->saved_data["kind"].toInt(),
                             saved[5], need[0], need[1], need[2], need[3], need[4]);
      grads = {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g), std::get<4>(g)};
    }
    for (size_t i = 0; i < 5; ++i) {
      if (!need[i]) grads[i] = at::Tensor();
    }
    grads = first_order_only("et_score", std::move(grads),
                             {grad_s, grad_m, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5]});
    grads.emplace_back();  // kind
    return grads;
  }
};

Pair et_score_fwd_autograd(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta, const at::Tensor& lam,
                           const at::Tensor& prec, int64_t kind) {
  if (!at::GradMode::is_enabled() ||
      !(y.requires_grad() || x.requires_grad() || beta.requires_grad() || lam.requires_grad() || prec.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below;  // nothing to record
    return fwd_op().call(y, x, beta, lam, prec, kind);
  }
  variable_list out = EtScoreFwd::apply(y, x, beta, lam, prec, kind);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace autograd
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, Autograd, m) { m.impl("et_score_fwd", &etweedie::autograd::et_score_fwd_autograd); }
