// CUDA binding of etweedie::langevin_step_fwd (schema in csrc/etweedie.cpp); its backward is
// et_score_bwd (etweedie/ops/langevin_step.py).
#include "bindings.h"

namespace etweedie {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> langevin_step_fwd_cuda(const at::Tensor& y, const at::Tensor& x,
                                                          const at::Tensor& noise, const at::Tensor& step,
                                                          const at::Tensor& beta, const at::Tensor& lam,
                                                          const at::Tensor& prec, int64_t kind) {
  checks::langevin_step_args("langevin_step", y, x, noise, step, beta, lam, prec, kind);
  check_cuda("langevin_step", y);
  auto out = at::empty_like(y);
  auto m = at::empty_like(y);
  launch_score("langevin_step", y, x, [&](auto t, auto draw_type, cudaStream_t stream) {
    using T = typename decltype(t)::type;
    using X = typename decltype(draw_type)::type;  // T, or 16-bit draws widened where loaded
    auto a = row_args<T, X>(y, x, beta, lam, prec, kind);
    a.noise = noise.data_ptr<T>();
    a.step = step.data_ptr<T>();
    a.sa = step.stride(0);
    return langevin_step_fwd_launch<T, X>(a, out.data_ptr<T>(), m.data_ptr<T>(), stream);
  });
  return {out, m};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("langevin_step_fwd", &etweedie::cuda::langevin_step_fwd_cuda);
}
