// CUDA implementations of the etweedie ops: TORCH_LIBRARY_IMPL(etweedie, CUDA, m).
//
// The only file of csrc/cuda that sees torch: it checks the canonical arguments (the same
// contract as csrc/cpu/*), allocates the outputs, and calls the launchers of launchers.cuh on
// torch's current stream.  Built only with a CUDA torch (setup.py: CUDA_HOME and
// torch.version.cuda, or FORCE_CUDA=1); the .cu files themselves compile with plain nvcc.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "launchers.cuh"

namespace etweedie {
namespace cuda {
namespace {

#define ET_CHECK_CUDA_TENSOR(t, op) \
  TORCH_CHECK((t).is_cuda(), op ": " #t " must be a CUDA tensor, got device ", (t).device())

void check_canonical(const char* op, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                     const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), op, ": y must be contiguous (B, d), got ", y.sizes());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == y.size(0) && x.size(2) == y.size(1) && (x.size(2) <= 1 || x.stride(2) == 1),
              op, ": x must be (B, N, d) = (", y.size(0), ", N, ", y.size(1), ") with unit stride over d, got ", x.sizes());
  TORCH_CHECK(beta.dim() == 1 && beta.size(0) == y.size(0), op, ": beta must be (B,), got ", beta.sizes());
  TORCH_CHECK(lam.dim() == 1 && lam.size(0) == y.size(0), op, ": lam must be (B,), got ", lam.sizes());
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": unknown metric kind ", kind);
  const int64_t core = kind == 0 ? 1 : (kind == 1 ? 2 : 3);
  TORCH_CHECK(prec.dim() == core && prec.size(0) == y.size(0), op, ": prec has shape ", prec.sizes(),
              ", which does not match metric kind ", kind);
  if (kind == 2) {
    TORCH_CHECK(prec.size(1) == prec.size(2) && prec.size(1) >= 1 && prec.size(1) <= 4 && y.size(1) % prec.size(1) == 0,
                op, ": block precision must be (B, k, k) with k <= 4 dividing d, got ", prec.sizes());
    TORCH_CHECK(prec.stride(2) == 1 && prec.stride(1) == prec.size(2), op, ": block precision rows must be contiguous");
  }
  if (kind == 1) TORCH_CHECK(prec.size(1) == y.size(1) && prec.stride(1) == 1, op, ": diagonal precision must be (B, d)");
  for (const at::Tensor* t : {&y, &x, &beta, &lam, &prec}) {
    TORCH_CHECK(t->is_cuda() && t->device() == y.device(), op, ": all tensors must be on y's CUDA device ", y.device());
    TORCH_CHECK(t->scalar_type() == y.scalar_type(), op, ": all tensors must share y's dtype ", y.scalar_type());
  }
}

template <typename T>
EtScoreArgs<T> row_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta, const at::Tensor& lam,
                        const at::Tensor& prec, int64_t kind) {
  EtScoreArgs<T> a{};
  a.y = y.data_ptr<T>();
  a.x = x.data_ptr<T>();
  a.beta = beta.data_ptr<T>();
  a.lam = lam.data_ptr<T>();
  a.prec = prec.data_ptr<T>();
  a.B = y.size(0);
  a.N = x.size(1);
  a.d = y.size(1);
  a.sxb = x.stride(0);
  a.sxn = x.stride(1);
  a.sb = beta.stride(0);
  a.sl = lam.stride(0);
  a.sp = prec.stride(0);
  a.kind = static_cast<int>(kind);
  a.kblock = kind == 2 ? static_cast<int>(prec.size(1)) : 1;
  return a;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> et_score_fwd_cuda(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                                     const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  check_canonical("et_score", y, x, beta, lam, prec, kind);
  TORCH_CHECK(x.size(1) > 0 || y.size(0) == 0, "et_score: need at least one posterior draw (N >= 1)");
  const c10::cuda::CUDAGuard guard(y.device());
  auto s = at::empty_like(y);
  auto m = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_fwd_cuda", [&] {
    const auto a = row_args<scalar_t>(y, x, beta, lam, prec, kind);
    check_launch(et_score_fwd_launch<scalar_t>(a, s.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                               c10::cuda::getCurrentCUDAStream()),
                 "et_score");
  });
  return {s, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> et_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
    const at::Tensor& lam, const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x,
    bool need_beta, bool need_lam, bool need_prec) {
  check_canonical("et_score_bwd", y, x, beta, lam, prec, kind);
  const c10::cuda::CUDAGuard guard(y.device());
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  TORCH_CHECK(g.sizes() == y.sizes() && gm.sizes() == y.sizes() && mc.sizes() == y.sizes(),
              "et_score_bwd: grad, grad_m and m must be (B, d)");
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto empty = [&] { return at::empty({0}, y.options()); };
  // Every requested output is fully written by the kernel; zero-size problems are zero-filled.
  const bool trivial = B == 0 || d == 0 || N == 0;
  auto alloc = [&](at::IntArrayRef size) { return trivial ? at::zeros(size, y.options()) : at::empty(size, y.options()); };
  auto gy = need_y ? alloc({B, d}) : empty();
  auto gx = need_x ? alloc({B, N, d}) : empty();
  auto gb = need_beta ? alloc({B}) : empty();
  auto gl = need_lam ? alloc({B}) : empty();
  auto gp = need_prec ? alloc(prec.sizes()) : empty();
  if (!trivial) {
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_bwd_cuda", [&] {
      using T = scalar_t;
      const auto a = row_args<T>(y, x, beta, lam, prec, kind);
      check_launch(et_score_bwd_launch<T>(a, g.data_ptr<T>(), gm.data_ptr<T>(), mc.data_ptr<T>(),
                                          need_y ? gy.data_ptr<T>() : nullptr, need_x ? gx.data_ptr<T>() : nullptr,
                                          need_beta ? gb.data_ptr<T>() : nullptr, need_lam ? gl.data_ptr<T>() : nullptr,
                                          need_prec ? gp.data_ptr<T>() : nullptr, c10::cuda::getCurrentCUDAStream()),
                   "et_score_bwd");
    });
  }
  return {gy, gx, gb, gl, gp};
}

std::tuple<at::Tensor, at::Tensor> langevin_step_fwd_cuda(const at::Tensor& y, const at::Tensor& x,
                                                          const at::Tensor& noise, const at::Tensor& step,
                                                          const at::Tensor& beta, const at::Tensor& lam,
                                                          const at::Tensor& prec, int64_t kind) {
  check_canonical("langevin_step", y, x, beta, lam, prec, kind);
  TORCH_CHECK(noise.sizes() == y.sizes() && noise.is_contiguous(), "langevin_step: noise must be contiguous (B, d)");
  TORCH_CHECK(step.dim() == 1 && step.size(0) == y.size(0), "langevin_step: step must be (B,)");
  for (const at::Tensor* t : {&noise, &step}) {
    TORCH_CHECK(t->device() == y.device() && t->scalar_type() == y.scalar_type(),
                "langevin_step: noise and step must match y's device and dtype");
  }
  TORCH_CHECK(x.size(1) > 0 || y.size(0) == 0, "langevin_step: need at least one posterior draw (N >= 1)");
  const c10::cuda::CUDAGuard guard(y.device());
  auto out = at::empty_like(y);
  auto m = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "langevin_step_fwd_cuda", [&] {
    auto a = row_args<scalar_t>(y, x, beta, lam, prec, kind);
    a.noise = noise.data_ptr<scalar_t>();
    a.step = step.data_ptr<scalar_t>();
    a.sa = step.stride(0);
    check_launch(langevin_step_fwd_launch<scalar_t>(a, out.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                                    c10::cuda::getCurrentCUDAStream()),
                 "langevin_step");
  });
  return {out, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> is_score_fwd_cuda(const at::Tensor& y, const at::Tensor& bank,
                                                                 double beta, double lam, const at::Tensor& prec,
                                                                 int64_t kind) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "is_score: y must be contiguous (Q, d)");
  TORCH_CHECK(bank.dim() == 2 && bank.is_contiguous() && bank.size(1) == y.size(1),
              "is_score: bank must be contiguous (M, d) with y's d, got ", bank.sizes());
  TORCH_CHECK(bank.size(0) > 0, "is_score: the bank must hold at least one point");
  TORCH_CHECK(prec.size(0) == 1 && prec.is_contiguous(), "is_score: prec must be one contiguous metric (1, *param)");
  TORCH_CHECK(kind >= 0 && kind <= 2, "is_score: unknown metric kind ", kind);
  if (kind == 2) {
    TORCH_CHECK(prec.dim() == 3 && prec.size(1) == prec.size(2) && prec.size(1) <= 4 && y.size(1) % prec.size(1) == 0,
                "is_score: block precision must be (1, k, k) with k <= 4 dividing d, got ", prec.sizes());
  }
  for (const at::Tensor* t : {&y, &bank, &prec}) {
    TORCH_CHECK(t->is_cuda() && t->device() == y.device() && t->scalar_type() == y.scalar_type(),
                "is_score: y, bank and prec must share one CUDA device and dtype");
  }
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

TORCH_LIBRARY_IMPL(etweedie, CUDA, m) {
  m.impl("et_score_fwd", &etweedie::cuda::et_score_fwd_cuda);
  m.impl("et_score_bwd", &etweedie::cuda::et_score_bwd_cuda);
  m.impl("langevin_step_fwd", &etweedie::cuda::langevin_step_fwd_cuda);
  m.impl("is_score_fwd", &etweedie::cuda::is_score_fwd_cuda);
}
