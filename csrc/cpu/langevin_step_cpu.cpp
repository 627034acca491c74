// CPU kernel of etweedie::langevin_step_fwd: the Energy-Tweedie score and the Langevin update
//   y' = y + α s(y) + sqrt(2α) ξ
// in one pass per row (the score row routine of et_score_cpu.h, then the O(d) update while the
// row is hot).  Canonical inputs as et_score (x in y's dtype, bfloat16 or float16) plus noise
// ξ (B, d) contiguous and step α (B,) (any stride).  Returns (y', m) with m = (1/N) Σ w_i u_i saved for the backward, which
// reuses et_score_bwd (etweedie/ops/langevin_step.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "../common/nonfinite_report.h"
#include "et_score_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> langevin_step_fwd_cpu(const at::Tensor& y, const at::Tensor& x,
                                                         const at::Tensor& noise, const at::Tensor& step,
                                                         const at::Tensor& beta, const at::Tensor& lam,
                                                         const at::Tensor& prec, int64_t kind) {
  checks::langevin_step_args("langevin_step", y, x, noise, step, beta, lam, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto out = at::empty({B, d}, y.options());
  auto m = at::empty({B, d}, y.options());
  if (B == 0 || d == 0) return {out, m};
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "langevin_step_fwd_cpu", [&] {
    using T = scalar_t;
    dispatch_draws<T>(x, [&](auto draw_type) {
      using X = typename decltype(draw_type)::type;  // T, or bf16/fp16 widened to T as loaded
      const T* yp = y.data_ptr<T>();
      const X* xp = draws_data<X>(x);
      const T* np = noise.data_ptr<T>();
      const T* ap = step.data_ptr<T>();
      const T* bp = beta.data_ptr<T>();
      const T* lp = lam.data_ptr<T>();
      const T* pp = prec.data_ptr<T>();
      T* op = out.data_ptr<T>();
      T* mp = m.data_ptr<T>();
      const int64_t sxb = x.stride(0), sxn = x.stride(1), sa = step.stride(0), sb = beta.stride(0),
                    sl = lam.stride(0), sp0 = prec.stride(0);
      const int64_t kblock = kind == kBlock ? prec.size(1) : 0;
      NonFiniteReport* report = NonFiniteReport::active();  // the front op's, if it called us
      ET_DISPATCH_METRIC(kind, kblock, T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> s(d), pattern;
          for (int64_t b = b0; b < b1; ++b) {
            Prec P{pp + b * sp0};
            prepare_row(P, pattern, d);
            const T* yb = yp + b * d;
            const T* nb = np + b * d;
            T* ob = op + b * d;
            et_score_row<T, Prec, X>(P, yb, xp + b * sxb, sxn, N, d, bp[b * sb], lp[b * sl], mp + b * d, s.data());
            const T alpha = ap[b * sa];
            const T diffusion = std::sqrt(T(2) * alpha);
            _Pragma("omp simd")
            for (int64_t j = 0; j < d; ++j) ob[j] = yb[j] + alpha * s[j] + diffusion * nb[j];
            NonFiniteReport::check_row(report, ob, d);
          }
        });
      });
    });
  });
  return {out, m};
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) { m.impl("langevin_step_fwd", &etweedie::cpu::langevin_step_fwd_cpu); }
