// CUDA bindings of etweedie::energy_score_fwd / _bwd / _fwd_grad (schemas in csrc/etweedie.cpp).
#include "energy_bindings.h"

namespace etweedie {
namespace cuda {
namespace {

void check_score_target(const at::Tensor& samples, const at::Tensor& target, bool fair) {
  TORCH_CHECK(samples.dim() == 3, "energy_score: samples must be (B, M, d), got ", samples.sizes());
  TORCH_CHECK(target.dim() == 2 && target.size(0) == samples.size(0) && target.size(1) == samples.size(2),
              "energy_score: target must be (B, d) = (", samples.size(0), ", ", samples.size(2), "), got ",
              target.sizes());
  TORCH_CHECK(samples.size(0) == 0 || samples.size(1) >= (fair ? 2 : 1), "energy_score: ",
              fair ? "the fair estimator needs M >= 2" : "need M >= 1", " samples, got M = ", samples.size(1));
}

at::Tensor energy_score_fwd_cuda(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                                 const at::Tensor& prec, int64_t kind, bool fair) {
  check_score_target(samples, target, fair);
  return energy_forward(true, "energy_score", samples, target.unsqueeze(1), beta, prec, kind, fair);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
    const at::Tensor& prec, int64_t kind, bool fair, bool need_samples, bool need_target, bool need_beta,
    bool need_prec) {
  check_score_target(samples, target, fair);
  auto out = energy_backward(true, "energy_score_bwd", grad, samples, target.unsqueeze(1), beta, prec, kind, fair,
                             need_samples, need_target, need_beta, need_prec, false);
  auto gt = std::get<2>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {std::get<1>(out), gt, std::get<3>(out), std::get<4>(out)};
}

// Training path: value and unit gradients in one call (backward only scales them by grad[r]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_fwd_grad_cuda(
    const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta, const at::Tensor& prec, int64_t kind,
    bool fair, bool need_samples, bool need_target, bool need_beta, bool need_prec) {
  check_score_target(samples, target, fair);
  const auto ones = at::ones({samples.size(0)}, samples.options());
  auto out = energy_backward(true, "energy_score", ones, samples, target.unsqueeze(1), beta, prec, kind, fair,
                             need_samples, need_target, need_beta, need_prec, true);
  auto gt = std::get<2>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {std::get<0>(out), std::get<1>(out), gt, std::get<3>(out), std::get<4>(out)};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("energy_score_fwd", &etweedie::cuda::energy_score_fwd_cuda);
  m.impl("energy_score_bwd", &etweedie::cuda::energy_score_bwd_cuda);
  m.impl("energy_score_fwd_grad", &etweedie::cuda::energy_score_fwd_grad_cuda);
}
