// CUDA bindings of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp).
#include "bindings.h"

namespace etweedie {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> et_score_fwd_cuda(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                                     const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
  check_cuda("et_score", y);
  const c10::cuda::CUDAGuard guard(y.device());
  auto s = at::empty_like(y);
  auto m = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_fwd_cuda", [&] {
    using T = scalar_t;
    dispatch_draws<T>(x, [&](auto draw_type) {
      using X = typename decltype(draw_type)::type;  // T, or 16-bit draws widened where loaded
      const auto a = row_args<T, X>(y, x, beta, lam, prec, kind);
      check_launch(et_score_fwd_launch<T, X>(a, s.data_ptr<T>(), m.data_ptr<T>(), c10::cuda::getCurrentCUDAStream()),
                   "et_score");
    });
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
  const c10::cuda::CUDAGuard guard(y.device());
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto empty = [&] { return at::empty({0}, y.options()); };
  // Every requested output is fully written by the kernel; zero-size problems are zero-filled.
  const bool trivial = B == 0 || d == 0;  // N >= 1 where B >= 1 (checks::query_cloud)
  auto alloc = [&](at::IntArrayRef size) { return trivial ? at::zeros(size, y.options()) : at::empty(size, y.options()); };
  auto gy = need_y ? alloc({B, d}) : empty();
  auto gx = need_x ? (trivial ? at::zeros({B, N, d}, x.options()) : at::empty({B, N, d}, x.options())) : empty();  // x's dtype
  auto gb = need_beta ? alloc({B}) : empty();
  auto gl = need_lam ? alloc({B}) : empty();
  auto gp = need_prec ? alloc(prec.sizes()) : empty();
  if (!trivial) {
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_bwd_cuda", [&] {
      using T = scalar_t;
      dispatch_draws<T>(x, [&](auto draw_type) {
        using X = typename decltype(draw_type)::type;
        const auto a = row_args<T, X>(y, x, beta, lam, prec, kind);
        check_launch(et_score_bwd_launch<T, X>(a, g.data_ptr<T>(), gm.data_ptr<T>(), mc.data_ptr<T>(),
                                               need_y ? gy.data_ptr<T>() : nullptr, need_x ? draws_data<X>(gx) : nullptr,
                                               need_beta ? gb.data_ptr<T>() : nullptr,
                                               need_lam ? gl.data_ptr<T>() : nullptr,
                                               need_prec ? gp.data_ptr<T>() : nullptr, c10::cuda::getCurrentCUDAStream()),
                     "et_score_bwd");
      });
    });
  }
  return {gy, gx, gb, gl, gp};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("et_score_fwd", &etweedie::cuda::et_score_fwd_cuda);
  m.impl("et_score_bwd", &etweedie::cuda::et_score_bwd_cuda);
}
