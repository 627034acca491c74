// CUDA bindings of etweedie::energy_distance_fwd / _bwd (schemas in csrc/etweedie.cpp).
#include "energy_bindings.h"

namespace etweedie {
namespace cuda {
namespace {

at::Tensor energy_distance_fwd_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                    const at::Tensor& prec, int64_t kind, bool unbiased) {
  checks::energy_distance_sizes(a, b, unbiased);
  return energy_forward(false, "energy_distance", a, b, beta, prec, kind, unbiased);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_distance_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta, const at::Tensor& prec,
    int64_t kind, bool unbiased, bool need_a, bool need_b, bool need_beta, bool need_prec) {
  checks::energy_distance_sizes(a, b, unbiased);
  auto out = energy_backward(false, "energy_distance_bwd", grad, a, b, beta, prec, kind, unbiased, need_a, need_b,
                             need_beta, need_prec, false);
  return {std::get<1>(out), std::get<2>(out), std::get<3>(out), std::get<4>(out)};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("energy_distance_fwd", &etweedie::cuda::energy_distance_fwd_cuda);
  m.impl("energy_distance_bwd", &etweedie::cuda::energy_distance_bwd_cuda);
}
