// CUDA bindings of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp).
#include "bindings.h"

namespace etweedie {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> et_score_fwd_cuda(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                                     const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
  check_cuda("et_score", y);
  auto s = at::empty_like(y);
  auto m = at::empty_like(y);
  launch_score("et_score", y, x, [&](auto t, auto draw_type, cudaStream_t stream) {
    using T = typename decltype(t)::type;
    using X = typename decltype(draw_type)::type;  // T, or 16-bit draws widened where loaded
    return et_score_fwd_launch<T, X>(row_args<T, X>(y, x, beta, lam, prec, kind), s.data_ptr<T>(), m.data_ptr<T>(),
                                     stream);
  });
  return {s, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> et_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
    const at::Tensor& lam, const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x,
    bool need_beta, bool need_lam, bool need_prec) {
  checks::score_args("et_score_bwd", y, x, beta, lam, prec, kind);
  checks::score_grads("et_score_bwd", y, grad, grad_m, m);
  check_cuda("et_score_bwd", y);
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto gy = grad_output(need_y, y, {B, d}, y.options());
  auto gx = grad_output(need_x, y, {B, N, d}, x.options());  // x's dtype
  auto gb = grad_output(need_beta, y, {B}, y.options());
  auto gl = grad_output(need_lam, y, {B}, y.options());
  auto gp = grad_output(need_prec, y, prec.sizes(), y.options());
  launch_score("et_score_bwd", y, x, [&](auto t, auto draw_type, cudaStream_t stream) {
    using T = typename decltype(t)::type;
    using X = typename decltype(draw_type)::type;
    return et_score_bwd_launch<T, X>(row_args<T, X>(y, x, beta, lam, prec, kind), g.data_ptr<T>(), gm.data_ptr<T>(),
                                     mc.data_ptr<T>(), need_y ? gy.data_ptr<T>() : nullptr,
                                     need_x ? draws_data<X>(gx) : nullptr, need_beta ? gb.data_ptr<T>() : nullptr,
                                     need_lam ? gl.data_ptr<T>() : nullptr, need_prec ? gp.data_ptr<T>() : nullptr,
                                     stream);
  });
  return {gy, gx, gb, gl, gp};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("et_score_fwd", &etweedie::cuda::et_score_fwd_cuda);
  m.impl("et_score_bwd", &etweedie::cuda::et_score_bwd_cuda);
}
