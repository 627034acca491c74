// CPU kernels of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp).
//
// Parallel over query rows with at::parallel_for (torch.set_num_threads governs it).
// Inputs are canonical (etweedie/ops/_prep.py): y (B, d) contiguous; x (B, N, d) with any
// strides over B and N (stride 0 = a broadcast cloud, never copied) and unit stride over d;
// beta, lam (B,), prec (B, *param) with any stride over B (0 = shared metric).
// Backward reads every draw once more and writes ∂L/∂x only when it is requested.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"
#include "et_score_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

void check_canonical(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta, const at::Tensor& lam,
                     const at::Tensor& prec, int64_t kind) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
}

int64_t block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

std::tuple<at::Tensor, at::Tensor> et_score_fwd_cpu(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                                    const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  check_canonical(y, x, beta, lam, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  TORCH_CHECK(N > 0 || B == 0, "et_score: need at least one posterior draw (N >= 1)");
  auto s = at::empty({B, d}, y.options());
  auto m = at::empty({B, d}, y.options());
  if (B == 0 || d == 0) return {s, m};
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_fwd_cpu", [&] {
    using T = scalar_t;
    const T* yp = y.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const T* bp = beta.data_ptr<T>();
    const T* lp = lam.data_ptr<T>();
    const T* pp = prec.data_ptr<T>();
    T* sp = s.data_ptr<T>();
    T* mp = m.data_ptr<T>();
    const int64_t sxb = x.stride(0), sxn = x.stride(1), sb = beta.stride(0), sl = lam.stride(0), sp0 = prec.stride(0);
    ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        std::vector<T> pattern;
        for (int64_t b = b0; b < b1; ++b) {
          Prec P{pp + b * sp0};
          prepare_row(P, pattern, d);
          et_score_row<T, Prec>(P, yp + b * d, xp + b * sxb, sxn, N, d, bp[b * sb], lp[b * sl], mp + b * d, sp + b * d);
        }
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
  check_canonical(y, x, beta, lam, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  checks::same_dtype_device("et_score_bwd", {"y", &y}, {{"grad", &grad}, {"grad_m", &grad_m}, {"m", &m}});
  checks::shape("et_score_bwd", "grad", grad, y.sizes());
  checks::shape("et_score_bwd", "grad_m", grad_m, y.sizes());
  checks::shape("et_score_bwd", "m", m, y.sizes());
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  // grad_y is always accumulated (it is the sum of the per-draw gradients); drop it if unused.
  auto gy = at::zeros({B, d}, y.options());
  auto gx = need_x ? at::empty({B, N, d}, y.options()) : at::empty({0}, y.options());
  auto gb = need_beta ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  auto gl = need_lam ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gp = need_prec ? at::zeros(psize, y.options()) : at::empty({0}, y.options());
  if (B > 0 && d > 0 && N > 0) {
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "et_score_bwd_cpu", [&] {
      using T = scalar_t;
      const T* yp = y.data_ptr<T>();
      const T* xp = x.data_ptr<T>();
      const T* bp = beta.data_ptr<T>();
      const T* lp = lam.data_ptr<T>();
      const T* pp = prec.data_ptr<T>();
      const T* gp_in = g.data_ptr<T>();
      const T* gm_in = gm.data_ptr<T>();
      const T* mp = mc.data_ptr<T>();
      T* gyp = gy.data_ptr<T>();
      T* gxp = need_x ? gx.data_ptr<T>() : nullptr;
      T* gbp = need_beta ? gb.data_ptr<T>() : nullptr;
      T* glp = need_lam ? gl.data_ptr<T>() : nullptr;
      T* gpp = need_prec ? gp.data_ptr<T>() : nullptr;
      const int64_t sxb = x.stride(0), sxn = x.stride(1), sb = beta.stride(0), sl = lam.stride(0), sp0 = prec.stride(0);
      const int64_t pstride = need_prec ? gp.numel() / B : 0;
      const T inv_n = T(1) / static_cast<T>(N);
      ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> h(d), pm(d), pattern;
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
            T gbeta = 0;
            for (int64_t i = 0; i < N; ++i) {
              const T* xi = xp + b * sxb + i * sxn;
              T q, hu;
              P.quad_dot(yb, xi, h.data(), d, q, hu);
              const T w = residual_weight(q, be);
              const T c = residual_weight_slope(q, w, be) * hu;
              if (w == T(0) && c == T(0)) {  // coincident draw: contributes nothing
                if (gxp) std::fill(gxp + (b * N + i) * d, gxp + (b * N + i + 1) * d, T(0));
                continue;
              }
              P.grad_u(yb, xi, h.data(), w * inv_n, c * inv_n, gyb, gxp ? gxp + (b * N + i) * d : nullptr, d);
              if (gbp) gbeta += hu * w * half_log(q);
              if (gpb) P.accum_outer(yb, xi, T(0.5) * c * inv_n, gpb, d);
            }
            if (gbp) gbp[b] = gbeta * inv_n;
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
