// CUDA implementation of etweedie::student_t_score_fwd / _bwd: TORCH_LIBRARY_IMPL(etweedie, CUDA).
//
// Checks every argument the kernels read (defined, CUDA device, dtype, sizes, strides), allocates
// the outputs and calls the launchers of student_t_score_launch.cuh on torch's current stream.
// Built only with a CUDA torch (setup.py); the .cu itself compiles with plain nvcc.
#include "bindings.h"  // ATen, the CUDA guard and stream, torch/library.h, checks.h, launchers.cuh
#include "student_t_score_launch.cuh"

namespace etweedie {
namespace cuda {
namespace {

constexpr const char* kOp = "student_t_score";

void check_canonical(const at::Tensor& y, const at::Tensor& x, const at::Tensor& c, const at::Tensor& prec,
                     int64_t kind) {
  checks::student_t_args(kOp, y, x, c, prec, kind);  // the CPU kernel's checks (csrc/common/checks.h)
  check_cuda(kOp, y);
}

template <typename T, typename X>
StudentTArgs<T, X> args_of(const at::Tensor& y, const at::Tensor& x, const at::Tensor& c, const at::Tensor& prec,
                           int64_t kind) {
  StudentTArgs<T, X> a{};
  a.y = y.data_ptr<T>();
  a.x = draws_data<X>(x);
  a.c = c.data_ptr<T>();
  a.prec = prec.data_ptr<T>();
  a.B = y.size(0);
  a.N = x.size(1);
  a.d = y.size(1);
  a.sxb = x.stride(0);
  a.sxn = x.stride(1);
  a.sc = c.stride(0);
  a.sp = prec.stride(0);
  a.kind = static_cast<int>(kind);
  a.kblock = kind == 2 ? static_cast<int>(prec.size(1)) : 1;
  return a;
}

std::tuple<at::Tensor, at::Tensor> student_t_score_fwd_cuda(const at::Tensor& y, const at::Tensor& x,
                                                            const at::Tensor& c, const at::Tensor& prec, int64_t kind) {
  check_canonical(y, x, c, prec, kind);
  const c10::cuda::CUDAGuard guard(y.device());
  auto s = at::empty_like(y);
  auto m = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "student_t_score_fwd_cuda", [&] {
    using T = scalar_t;
    dispatch_draws<T>(x, [&](auto draw_type) {
      using X = typename decltype(draw_type)::type;  // T, or 16-bit draws widened where loaded
      check_launch(student_t_score_fwd_launch<T, X>(args_of<T, X>(y, x, c, prec, kind), s.data_ptr<T>(),
                                                    m.data_ptr<T>(), c10::cuda::getCurrentCUDAStream()), kOp);
    });
  });
  return {s, m};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> student_t_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& c,
    const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x, bool need_c, bool need_prec) {
  check_canonical(y, x, c, prec, kind);
  checks::score_grads(kOp, y, grad, grad_m, m);
  const c10::cuda::CUDAGuard guard(y.device());
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto empty = [&] { return at::empty({0}, y.options()); };
  const bool trivial = B == 0 || d == 0;
  auto alloc = [&](at::IntArrayRef size) { return trivial ? at::zeros(size, y.options()) : at::empty(size, y.options()); };
  auto gy = need_y ? alloc({B, d}) : empty();
  auto gx = need_x ? (trivial ? at::zeros({B, N, d}, x.options()) : at::empty({B, N, d}, x.options())) : empty();  // x's dtype
  auto gc = need_c ? alloc({B}) : empty();
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gp = need_prec ? alloc(psize) : empty();
  if (!trivial) {
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "student_t_score_bwd_cuda", [&] {
      using T = scalar_t;
      dispatch_draws<T>(x, [&](auto draw_type) {
        using X = typename decltype(draw_type)::type;
        check_launch(student_t_score_bwd_launch<T, X>(
            args_of<T, X>(y, x, c, prec, kind), g.data_ptr<T>(), gm.data_ptr<T>(), mc.data_ptr<T>(),
            need_y ? gy.data_ptr<T>() : nullptr, need_x ? draws_data<X>(gx) : nullptr,
            need_c ? gc.data_ptr<T>() : nullptr, need_prec ? gp.data_ptr<T>() : nullptr,
            c10::cuda::getCurrentCUDAStream()), kOp);
      });
    });
  }
  return {gy, gx, gc, gp};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

ET_CUDA_LIBRARY_IMPL(m) {
  m.impl("student_t_score_fwd", &etweedie::cuda::student_t_score_fwd_cuda);
  m.impl("student_t_score_bwd", &etweedie::cuda::student_t_score_bwd_cuda);
}
