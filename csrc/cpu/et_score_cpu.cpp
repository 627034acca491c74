// CPU kernels of etweedie::et_score_fwd / et_score_bwd (schemas in csrc/etweedie.cpp).
//
// Parallel over query rows with at::parallel_for (torch.set_num_threads governs it).
// Inputs are canonical (etweedie/ops/_prep.py): y (B, d) contiguous; x (B, N, d) with any
// strides over B and N (stride 0 = a broadcast cloud, never copied) and unit stride over d;
// beta, lam (B,), prec (B, *param) with any stride over B (0 = shared metric).
// x has y's dtype T or is bfloat16/float16: its values are widened to T where they are loaded
// (csrc/common/low_precision.h), inside the same vectorized loops (float16 on F16C CPUs: a few
// rows at a time through an L1 buffer, draw_rows_cpu.h), and ∂L/∂x is rounded to x's dtype
// where it is stored; no converted copy of x is ever made.
// Backward reads every draw once more and writes ∂L/∂x only when it is requested, into a fresh
// buffer from the output pool of fresh_output_cpu.h (reused across calls, huge pages when new:
// the first-touch page faults of a fresh 51 MB buffer cost several times the backward's arithmetic
// at 64 × 256 × 784).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "et_score_cpu.h"
#include "fresh_output_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

void check_canonical(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta, const at::Tensor& lam,
                     const at::Tensor& prec, int64_t kind) {
  checks::score_args("et_score", y, x, beta, lam, prec, kind);
}

int64_t block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

// The backward's second pass over four draws x_0..3 (still in L1 from the first), for metrics
// that act elementwise (isotropic: p[0]; diagonal: p[j]):  g_t = a_t h + c_t p ⊙ (y − x_t),
// gy += Σ_t g_t and gx_t = −g_t (gx rows may be null).  gy, y and h are loaded once per four
// draws instead of once per draw (the per-draw grad_u of metric_cpu.h), which is most of the
// backward's arithmetic at large d.
template <typename T, bool DIAG, typename X>
void grad_u_elementwise4(const T* y, const X* x0, const X* x1, const X* x2, const X* x3, const T* h, const T* a,
                         const T* c, const T* p, int64_t d, T* gy, T* gx0, T* gx1, T* gx2, T* gx3) {
  if (gx0 != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      const T pj = DIAG ? p[j] : p[0];
      const T yj = y[j], hj = h[j];
      const T g0 = a[0] * hj + c[0] * pj * (yj - widen<T>(x0[j]));
      const T g1 = a[1] * hj + c[1] * pj * (yj - widen<T>(x1[j]));
      const T g2 = a[2] * hj + c[2] * pj * (yj - widen<T>(x2[j]));
      const T g3 = a[3] * hj + c[3] * pj * (yj - widen<T>(x3[j]));
      gy[j] += (g0 + g1) + (g2 + g3);
      gx0[j] = -g0;
      gx1[j] = -g1;
      gx2[j] = -g2;
      gx3[j] = -g3;
    }
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) {
    const T pj = DIAG ? p[j] : p[0];
    const T yj = y[j];
    gy[j] += (a[0] + a[1] + a[2] + a[3]) * h[j] +
             pj * ((c[0] * (yj - widen<T>(x0[j])) + c[1] * (yj - widen<T>(x1[j]))) +
                   (c[2] * (yj - widen<T>(x2[j])) + c[3] * (yj - widen<T>(x3[j]))));
  }
}

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
      ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> pattern;
          for (int64_t b = b0; b < b1; ++b) {
            Prec P{pp + b * sp0};
            prepare_row(P, pattern, d);
            et_score_row<T, Prec, X>(P, yp + b * d, xp + b * sxb, sxn, N, d, bp[b * sb], lp[b * sl], mp + b * d,
                                     sp + b * d);
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
  // ∂L/∂x in x's dtype: computed in T, rounded once as it is stored
  auto gx = need_x ? reusable_empty({B, N, d}, x.options()) : at::empty({0}, y.options());  // no fresh pages
  auto gb = need_beta ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  auto gl = need_lam ? at::zeros({B}, y.options()) : at::empty({0}, y.options());
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gp = need_prec ? at::zeros(psize, y.options()) : at::empty({0}, y.options());
  if (B > 0 && d > 0 && N > 0) {
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
        const T inv_n = T(1) / static_cast<T>(N);
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
              T gbeta = 0;
              int64_t i = 0;
              using R = typename DrawRows<X>::Row;  // float16 rows staged as float (draw_rows_cpu.h)
              constexpr bool kElementwise = std::is_same_v<Prec, RowPrec<T, kIsotropic, 0>> ||
                                            std::is_same_v<Prec, RowPrec<T, kDiagonal, 0>>;
              if constexpr (kElementwise) {
                // four draws at a time: q, h·u from memory, then one L1 pass for their gradients
                constexpr bool kDiag = std::is_same_v<Prec, RowPrec<T, kDiagonal, 0>>;
                for (; i + 4 <= N; i += 4) {
                  const R* xs[4];
                  T aw[4], cw[4];
                  int64_t sr;
                  const R* staged = rows.stage(xp + b * sxb + i * sxn, sxn, 4, d, &sr);
                  for (int t = 0; t < 4; ++t) {
                    xs[t] = staged + t * sr;
                    T q, hu;
                    P.quad_dot(yb, xs[t], h.data(), d, q, hu);
                    const T w = residual_weight(q, be);
                    const T c = residual_weight_slope(q, w, be) * hu;
                    aw[t] = w * inv_n;
                    cw[t] = c * inv_n;
                    if (gbp) gbeta += hu * w * half_log(q);
                    if (gpb) P.accum_outer(yb, xs[t], T(0.5) * c * inv_n, gpb, d);
                  }
                  T* r = gxp ? gxrow.data() : nullptr;
                  grad_u_elementwise4<T, kDiag, R>(yb, xs[0], xs[1], xs[2], xs[3], h.data(), aw, cw, P.p, d, gyb, r,
                                                   r ? r + d : nullptr, r ? r + 2 * d : nullptr,
                                                   r ? r + 3 * d : nullptr);
                  if (gxp) stream_row(gxp + (b * N + i) * d, gxrow.data(), 4 * d);
                }
              }
              for (; i < N; ++i) {
                int64_t sr;
                const R* xi = rows.stage(xp + b * sxb + i * sxn, sxn, 1, d, &sr);
                T q, hu;
                P.quad_dot(yb, xi, h.data(), d, q, hu);
                const T w = residual_weight(q, be);
                const T c = residual_weight_slope(q, w, be) * hu;
                if (w == T(0) && c == T(0)) {  // coincident draw: contributes nothing
                  if (gxp) std::fill(gxp + (b * N + i) * d, gxp + (b * N + i + 1) * d, narrow<X>(T(0)));
                  continue;
                }
                // ∂L/∂x_i goes through an L1 row and out with streaming stores (written once, never re-read here)
                P.grad_u(yb, xi, h.data(), w * inv_n, c * inv_n, gyb, gxp ? gxrow.data() : nullptr, d);
                if (gxp) stream_row(gxp + (b * N + i) * d, gxrow.data(), d);
                if (gbp) gbeta += hu * w * half_log(q);
                if (gpb) P.accum_outer(yb, xi, T(0.5) * c * inv_n, gpb, d);
              }
              if (gbp) gbp[b] = gbeta * inv_n;
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
