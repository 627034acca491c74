// CUDA bindings of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp): the Energy-Tweedie score's launchers with the Student-t law, c passed as
// lam (and beta, unread) in their arguments (launchers.cuh).
#include "bindings.h"

namespace etweedie {
namespace cuda {
namespace {

constexpr const char* kOp = "student_t_score";

std::tuple<at::Tensor, at::Tensor> student_t_score_fwd_cuda(const at::Tensor& y, const at::Tensor& x,
                                                            const at::Tensor& c, const at::Tensor& prec, int64_t kind) {
  checks::student_t_args(kOp, y, x, c, prec, kind);
  check_cuda(kOp, y);
  auto s = at::empty_like(y);
  auto m = at::empty_like(y);
  launch_score(kOp, y, x, [&](auto t, auto draw_type, cudaStream_t stream) {
    using T = typename decltype(t)::type;
    using X = typename decltype(draw_type)::type;  // T, or 16-bit draws widened where loaded
    return student_t_score_fwd_launch<T, X>(row_args<T, X>(y, x, c, c, prec, kind), s.data_ptr<T>(), m.data_ptr<T>(),
                                            stream);
  });
  return {s, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> student_t_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& c,
    const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x, bool need_c, bool need_prec) {
  checks::student_t_args(kOp, y, x, c, prec, kind);
  checks::score_grads(kOp, y, grad, grad_m, m);
  check_cuda(kOp, y);
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto gy = grad_output(need_y, y, {B, d}, y.options());
  auto gx = grad_output(need_x, y, {B, N, d}, x.options());  // x's dtype
  auto gc = grad_output(need_c, y, {B}, y.options());
  auto gp = grad_output(need_prec, y, prec.sizes(), y.options());
  launch_score(kOp, y, x, [&](auto t, auto draw_type, cudaStream_t stream) {
    using T = typename decltype(t)::type;
    using X = typename decltype(draw_type)::type;
    return student_t_score_bwd_launch<T, X>(row_args<T, X>(y, x, c, c, prec, kind), g.data_ptr<T>(), gm.data_ptr<T>(),
                                            mc.data_ptr<T>(), need_y ? gy.data_ptr<T>() : nullptr,
                                            need_x ? draws_data<X>(gx) : nullptr, need_c ? gc.data_ptr<T>() : nullptr,
                                            need_prec ? gp.data_ptr<T>() : nullptr, stream);
  });
  return {gy, gx, gc, gp};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("student_t_score_fwd", &etweedie::cuda::student_t_score_fwd_cuda);
  m.impl("student_t_score_bwd", &etweedie::cuda::student_t_score_bwd_cuda);
}
