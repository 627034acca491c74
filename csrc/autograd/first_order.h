// Autograd kernels of the compiled ops written in C++ (csrc/autograd/<op>_autograd.cpp), shared
// parts.  The Python rules (etweedie/rules/) register the same backward through
// torch.library.register_autograd; a C++ kernel on the Autograd key does the same work without
// the Python autograd wrapper, which costs a training step ~250 µs of host time per op call
// (benchmarks/RESULTS.md, "CPU: host cost per call") — more than the GPU kernels themselves at
// the MNIST training shape.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>

namespace etweedie {
namespace autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on the gradients a fused first-order backward returned, tied to the op's inputs:
// differentiating those gradients again (create_graph=True, then a second backward) raises
// NotImplementedError instead of silently returning zeros.  The C++ twin of
// etweedie/rules/common.py: first_order_only (same message).
struct FirstOrderOnly : public torch::autograd::Function<FirstOrderOnly> {
  static variable_list forward(AutogradContext* ctx, const std::string& op, at::TensorList grads,
                               at::TensorList inputs) {
    (void)inputs;  // only connect the outputs to the graph
    ctx->saved_data["op"] = op;
    variable_list out;
    out.reserve(grads.size());
    for (const auto& g : grads) out.push_back(g.clone());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, ctx->saved_data["op"].toStringRef(),
                                ": second-order derivatives are not supported by the compiled backends (their "
                                "backward is a fused first-order kernel); use backend='reference' for double backward");
    return {};
  }
};

// grads unchanged unless a graph of the backward is being built (grad mode on inside backward)
// and some input requires grad: then the defined gradients come out of a FirstOrderOnly node.
inline variable_list first_order_only(const std::string& op, variable_list grads, const variable_list& inputs) {
  if (!at::GradMode::is_enabled()) return grads;
  variable_list live, defined;
  for (const auto& t : inputs) {
    if (t.defined() && t.requires_grad()) live.push_back(t);
  }
  std::vector<size_t> idx;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) {
      idx.push_back(i);
      defined.push_back(grads[i]);
    }
  }
  if (live.empty() || idx.empty()) return grads;
  // as TensorLists: Function::apply tracks TensorList arguments, not std::vector ones
  variable_list wrapped = FirstOrderOnly::apply(op, at::TensorList(defined), at::TensorList(live));
  for (size_t j = 0; j < idx.size(); ++j) grads[idx[j]] = std::move(wrapped[j]);
  return grads;
}

// upstream (B,) viewed to broadcast against a (B, ...) tensor of rank `rank`.
inline at::Tensor rows_view(const at::Tensor& grad, int64_t rank) {
  std::vector<int64_t> shape(static_cast<size_t>(rank > 0 ? rank : 1), 1);
  shape[0] = -1;
  return grad.view(shape);
}

}  // namespace autograd
}  // namespace etweedie
