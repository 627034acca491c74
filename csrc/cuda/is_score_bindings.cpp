// CUDA binding of etweedie::is_score_fwd, the importance-sampling oracle (schema in
// csrc/etweedie.cpp).
#include "bindings.h"

namespace etweedie {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> is_score_fwd_cuda(const at::Tensor& y, const at::Tensor& bank,
                                                                 double beta, double lam, const at::Tensor& prec,
                                                                 int64_t kind) {
  checks::is_score_args("is_score", y, bank, beta, lam, prec, kind);
  check_cuda("is_score", y);
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t Q = y.size(0), M = bank.size(0), d = y.size(1);
  auto score = at::empty_like(y);
  auto mean = at::empty_like(y);
  auto ess = at::empty({Q}, y.options());
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "is_score_fwd_cuda", [&] {
    using T = scalar_t;
    check_launch(is_score_fwd_launch<T>(y.data_ptr<T>(), bank.data_ptr<T>(), prec.data_ptr<T>(), Q, M, d,
                                        static_cast<T>(beta), static_cast<T>(lam), static_cast<int>(kind),
                                        kind == 2 ? static_cast<int>(prec.size(1)) : 1, score.data_ptr<T>(),
                                        mean.data_ptr<T>(), ess.data_ptr<T>(), c10::cuda::getCurrentCUDAStream()),
                 "is_score");
  });
  return {score, mean, ess};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("is_score_fwd", &etweedie::cuda::is_score_fwd_cuda);
}
