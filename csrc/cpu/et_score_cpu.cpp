// CPU kernels of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp).
//
// Parallel over query rows with at::parallel_for (torch.set_num_threads governs it).
// Inputs are canonical (etweedie/ops/_rows.py): y (B, d) contiguous; x (B, N, d) with any
// strides over B and N (stride 0 = a broadcast cloud, never copied) and unit stride over d;
// beta, lam (B,), prec (B, *param) with any stride over B (0 = shared metric).
// x has y's dtype T or is bfloat16/float16: its values are widened to T where they are loaded
// (csrc/common/low_precision.h), inside the same vectorized loops (the float32-query forward on
// AVX2 CPUs with d % 16 == 0: 16 values per step in registers, lanes16_cpu.h; otherwise
// float16 on F16C CPUs a few rows at a time through an L1 buffer, draw_rows_cpu.h), and ∂L/∂x is rounded to x's dtype
// where it is stored; no converted copy of x is ever made.
// Backward reads every draw once more and writes ∂L/∂x only when it is requested, into a fresh
// buffer from the output pool of fresh_output_cpu.h (reused across calls, huge pages when new:
// the first-touch page faults of a fresh 51 MB buffer cost several times the backward's arithmetic
// at 64 × 256 × 784).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "../common/nonfinite_report.h"
#include "et_score_cpu.h"
#include "fresh_output_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

int64_t block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

std::tuple<at::Tensor, at::Tensor> et_score_fwd_cpu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                                    const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto s = at::empty({B, d}, y.options());
  auto m = at::empty({B, d}, y.options());
  if (B == 0 || d == 0) return {s, m};
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_fwd_cpu", [&] {
    using T = scalar_t;
    dispatch_draws<T>(x, [&](auto draw_type) {
      using X = typename decltype(draw_type)::type;  // T, or bf16/fp16 widened to T as loaded
      const T* yp = y.data_ptr<T>();
      const X* xp = draws_data<X>(x);
      const T* bp = beta.data_ptr<T>();
      const T* lp = lam.data_ptr<T>();
      const T* pp = prec.data_ptr<T>();
      T* sp = s.data_ptr<T>();
      T* mp = m.data_ptr<T>();
      const int64_t sxb = x.stride(0), sxn = x.stride(1), sb = beta.stride(0), sl = lam.stride(0),
                    sp0 = prec.stride(0);
      NonFiniteReport* report = NonFiniteReport::active();  // the front op's, if it called us
      ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> pattern;
          for (int64_t b = b0; b < b1; ++b) {
            Prec P{pp + b * sp0};
            prepare_row(P, pattern, d);
            et_score_row<T, Prec, X>(P, yp + b * d, xp + b * sxb, sxn, N, d, bp[b * sb], lp[b * sl], mp + b * d,
                                     sp + b * d);
            NonFiniteReport::check_row(report, sp + b * d, d);
          }
        });
      });
    });
  });
  return {s, m};
}

// Returns (grad_y, grad_x, grad_beta, grad_lam, grad_prec); a gradient not requested is an
// empty tensor.  grad_prec has prec's shape (B, *param), per row.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> et_score_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta, const at::Tensor& lam,
    const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x, bool need_beta,
    bool need_lam, bool need_prec) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  checks::score_grads("et_score_bwd", y, grad, grad_m, m);
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  // grad_y is always accumulated (it is the sum of the per-draw gradients); drop it if unused.
  auto gy = at::zeros({B, d}, y.options());
  // ∂L/∂x in x's dtype: computed in T, rounded once as it is stored
  auto gx = need_x ? reusable_empty({B, N, d}, x.options()) : at::empty({0}, y.options());  // no fresh pages
  auto gb = need_beta ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  auto gl = need_lam ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gp = need_prec ? at::zeros(psize, y.options()) : at::empty({0}, y.options());
  if (B > 0 && d > 0) {  // N >= 1 where B >= 1 (checks::query_cloud)
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_bwd_cpu", [&] {
      using T = scalar_t;
      dispatch_draws<T>(x, [&](auto draw_type) {
        using X = typename decltype(draw_type)::type;
        const T* yp = y.data_ptr<T>();
        const X* xp = draws_data<X>(x);
        const T* bp = beta.data_ptr<T>();
        const T* lp = lam.data_ptr<T>();
        const T* pp = prec.data_ptr<T>();
        const T* gp_in = g.data_ptr<T>();
        const T* gm_in = gm.data_ptr<T>();
        const T* mp = mc.data_ptr<T>();
        T* gyp = gy.data_ptr<T>();
        X* gxp = need_x ? draws_data<X>(gx) : nullptr;
        T* gbp = need_beta ? gb.data_ptr<T>() : nullptr;
        T* glp = need_lam ? gl.data_ptr<T>() : nullptr;
        T* gpp = need_prec ? gp.data_ptr<T>() : nullptr;
        const int64_t sxb = x.stride(0), sxn = x.stride(1), sb = beta.stride(0), sl = lam.stride(0),
                      sp0 = prec.stride(0);
        const int64_t pstride = need_prec ? gp.numel() / B : 0;
        ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
          at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
            std::vector<T> h(d), pm(d), pattern, gxrow(gxp ? 4 * d : 0);
            DrawRows<X> rows;  // float16 draws staged as float rows (draw_rows_cpu.h)
            for (int64_t b = b0; b < b1; ++b) {
              Prec P{pp + b * sp0};
              prepare_row(P, pattern, d);
              const T be = bp[b * sb], la = lp[b * sl];
              const T* yb = yp + b * d;
              const T* gb_in = gp_in + b * d;
              const T* mb = mp + b * d;
              T* gyb = gyp + b * d;
              T* gpb = gpp ? gpp + b * pstride : nullptr;
              P.apply(gb_in, -la, h.data(), d);  // h = −λ P g + g_m: the upstream gradient on m
              const T* gmb = gm_in + b * d;
              for (int64_t j = 0; j < d; ++j) h[j] += gmb[j];
              const T gbeta = weighted_residual_sum_bwd<T, Prec, X>(
                  P, ResidualWeight<T>{be}, yb, xp + b * sxb, sxn, N, d, h.data(), gyb, gxp ? gxp + b * N * d : nullptr,
                  gpb, gbp != nullptr, rows, gxrow.data());
              if (gbp) gbp[b] = gbeta;
              if (gxp) stream_fence();
              if (glp || gpb) {
                P.apply(mb, T(1), pm.data(), d);  // P m
                if (glp) {
                  T acc = 0;
                  for (int64_t j = 0; j < d; ++j) acc += gb_in[j] * pm[j];
                  glp[b] = -acc;  // ∂L/∂λ = g·s/λ = −g·Pm
                }
                if (gpb) P.accum_outer2(gb_in, mb, -la, gpb, d);  // −λ g mᵀ
              }
            }
          });
        });
      });
    });
  }
  if (!need_y) gy = at::empty({0}, y.options());
  return {gy, gx, gb, gl, gp};
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) {
  m.impl("et_score_fwd", &etweedie::cpu::et_score_fwd_cpu);
  m.impl("et_score_bwd", &etweedie::cpu::et_score_bwd_cpu);
}
