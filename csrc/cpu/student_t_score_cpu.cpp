// CPU kernels of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp; math in csrc/common/student_t_score.h).
//
//   s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)
//
// The forward is et_score's row sum with the Student-t weight (weighted_residual_sum,
// et_score_cpu.h: each draw read once; large d: q then the accumulation while the draw sits in
// L1, four draws per sweep; small d: tiles of 64 draws in structure-of-arrays form), parallel
// over query rows with at::parallel_for.
// Extra memory O(d) per thread.  The backward is et_score's as well (weighted_residual_sum_bwd,
// with the Student-t weight and slope −2w²): it reads every draw once more (four per L1 pass
// for isotropic and diagonal metrics) and writes ∂L/∂x only when asked, into a buffer from the
// reuse pool of fresh_output_cpu.h (no fresh pages).
//
// Canonical inputs (etweedie/ops/student_t_score.py): y (B, d) contiguous; x (B, N, d) with any
// strides over B and N (0 = a broadcast cloud) and unit stride over d, in y's dtype or bfloat16 /
// float16 (widened where loaded, ∂L/∂x rounded to x's dtype where stored, as in et_score_cpu.cpp);
// c (B,) any stride; prec (B, *param) of metric kind 0/1/2 (block rows contiguous), any stride over B.  Every
// argument is checked with the shared checks of csrc/common/checks.h (sizes, strides, dtypes,
// devices; the same as the CUDA binding's): the raw op never reads out of bounds whatever it is given.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "../common/nonfinite_report.h"
#include "../common/student_t_score.h"
#include "et_score_cpu.h"
#include "fresh_output_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

constexpr const char* kOp = "student_t_score";

int64_t block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

// The Student-t weight w(q) = 1/(1 + q) as the functor of weighted_residual_sum and
// weighted_residual_sum_bwd (et_score_cpu.h); it has no parameter of its own (c scales the score).
template <typename T>
struct StudentTWeight {
  static constexpr int kLaw = 1;  // 1/(1 + q) needs no lower bound on q in float64 (q_in_range)
  T operator()(T q) const { return student_t_weight(q); }
  T slope(T /*q*/, T w) const { return student_t_weight_slope(w); }
  // w² (h·u): summed over the draws, the isotropic metric's gradient without cancellation (below)
  T shape_term(T /*q*/, T w, T hu) const { return w * w * hu; }
};

std::tuple<at::Tensor, at::Tensor> student_t_score_fwd_cpu(const at::Tensor& y, const at::Tensor& x,
                                                           const at::Tensor& c, const at::Tensor& prec, int64_t kind) {
  checks::student_t_args(kOp, y, x, c, prec, kind);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto s = at::empty({B, d}, y.options());
  auto m = at::empty({B, d}, y.options());
  if (B == 0 || d == 0) return {s, m};
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "student_t_score_fwd_cpu", [&] {
    using T = scalar_t;
    dispatch_draws<T>(x, [&](auto draw_type) {
      using X = typename decltype(draw_type)::type;  // T, or bf16/fp16 widened to T as loaded
      const T* yp = y.data_ptr<T>();
      const X* xp = draws_data<X>(x);
      const T* cp = c.data_ptr<T>();
      const T* pp = prec.data_ptr<T>();
      T* sp = s.data_ptr<T>();
      T* mp = m.data_ptr<T>();
      const int64_t sxb = x.stride(0), sxn = x.stride(1), sc = c.stride(0), sp0 = prec.stride(0);
      const T inv_n = T(1) / static_cast<T>(N);
      NonFiniteReport* report = NonFiniteReport::active();  // the front op's, if it called us
      ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> pattern;
          for (int64_t b = b0; b < b1; ++b) {
            Prec P{pp + b * sp0};
            prepare_row(P, pattern, d);
            T* mb = mp + b * d;
            std::fill(mb, mb + d, T(0));
            if (!weighted_residual_sum<T, Prec, X>(P, yp + b * d, xp + b * sxb, sxn, N, d, StudentTWeight<T>{}, mb)) {
              // a draw out of range (q_in_range, csrc/common/et_score.h): a NaN row, which the op
              // reruns in float64 (etweedie/ops/student_t_score.py)
              std::fill(mb, mb + d, std::numeric_limits<T>::quiet_NaN());
              std::fill(sp + b * d, sp + (b + 1) * d, std::numeric_limits<T>::quiet_NaN());
              if (report != nullptr) report->raise();
              continue;
            }
            for (int64_t j = 0; j < d; ++j) mb[j] *= inv_n;
            P.apply(mb, T(-2) * cp[b * sc], sp + b * d, d);
            NonFiniteReport::check_row(report, sp + b * d, d);
          }
        });
      });
    });
  });
  return {s, m};
}

// -> (grad_y, grad_x, grad_c, grad_prec); an unrequested gradient is an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> student_t_score_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& grad_m, const at::Tensor& y, const at::Tensor& x, const at::Tensor& c,
    const at::Tensor& prec, int64_t kind, const at::Tensor& m, bool need_y, bool need_x, bool need_c, bool need_prec) {
  checks::student_t_args(kOp, y, x, c, prec, kind);
  checks::score_grads(kOp, y, grad, grad_m, m);
  const int64_t B = y.size(0), N = x.size(1), d = y.size(1);
  auto g = grad.contiguous();
  auto gm = grad_m.contiguous();
  auto mc = m.contiguous();
  auto empty = [&] { return at::empty({0}, y.options()); };
  auto gy = at::zeros({B, d}, y.options());  // always accumulated (Σ of the per-draw gradients)
  auto gx = need_x ? reusable_empty({B, N, d}, x.options()) : empty();  // x's dtype; no fresh pages (fresh_output_cpu.h)
  auto gc = need_c ? at::zeros({B}, y.options()) : empty();
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gp = need_prec ? at::zeros(psize, y.options()) : empty();
  if (B > 0 && d > 0) {  // N >= 1 where B >= 1 (checks::query_cloud)
    AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "student_t_score_bwd_cpu", [&] {
      using T = scalar_t;
      dispatch_draws<T>(x, [&](auto draw_type) {
        using X = typename decltype(draw_type)::type;
        const T* yp = y.data_ptr<T>();
        const X* xp = draws_data<X>(x);
        const T* cp = c.data_ptr<T>();
        const T* pp = prec.data_ptr<T>();
        const T* gp_in = g.data_ptr<T>();
        const T* gm_in = gm.data_ptr<T>();
        const T* mp = mc.data_ptr<T>();
        T* gyp = gy.data_ptr<T>();
        X* gxp = need_x ? draws_data<X>(gx) : nullptr;
        T* gcp = need_c ? gc.data_ptr<T>() : nullptr;
        T* gpp = need_prec ? gp.data_ptr<T>() : nullptr;
        const int64_t sxb = x.stride(0), sxn = x.stride(1), sc = c.stride(0), sp0 = prec.stride(0);
        const int64_t pstride = need_prec ? gp.numel() / B : 0;
        ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
          at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
            std::vector<T> h(d), pm(d), pattern, gxrow(gxp ? 4 * d : 0);
            DrawRows<X> rows;  // float16 draws staged as float rows (draw_rows_cpu.h)
            for (int64_t b = b0; b < b1; ++b) {
              Prec P{pp + b * sp0};
              prepare_row(P, pattern, d);
              const T two_c = T(2) * cp[b * sc];
              const T* yb = yp + b * d;
              const T* gb_in = gp_in + b * d;
              const T* gmb = gm_in + b * d;
              const T* mb = mp + b * d;
              T* gyb = gyp + b * d;
              T* gpb = gpp ? gpp + b * pstride : nullptr;
              P.apply(gb_in, -two_c, h.data(), d);  // h = −2c P g + g_m
              for (int64_t j = 0; j < d; ++j) h[j] += gmb[j];
              // An isotropic P = p I: the generic ∂L/∂p = −2c g·m − (1/N) Σ_i w_i² (h·u_i) ‖u_i‖² is a
              // difference of two terms that agree to a factor 1 − w_i q_i = w_i (with h = −2c p g + g_m),
              // so float32 loses a factor 1 + q of accuracy (q ≈ d for draws at the noise scale).
              // Substituting −2c p g = h − g_m gives the same value without the cancellation:
              //   ∂L/∂p = ( (1/N) Σ_i w_i² (h·u_i) − g_m·m ) / p
              constexpr bool kIso = std::is_same_v<Prec, RowPrec<T, kIsotropic, 0>>;
              const T sum_w2hu = weighted_residual_sum_bwd<T, Prec, X>(
                  P, StudentTWeight<T>{}, yb, xp + b * sxb, sxn, N, d, h.data(), gyb, gxp ? gxp + b * N * d : nullptr,
                  kIso ? nullptr : gpb, kIso && gpb != nullptr, rows, gxrow.data());
              if (gxp) stream_fence();
              if (kIso && gpb) {
                T gm_m = 0;
                for (int64_t j = 0; j < d; ++j) gm_m += gmb[j] * mb[j];
                gpb[0] += (sum_w2hu - gm_m) / P.p[0];
              }
              if (gcp || (gpb && !kIso)) {
                P.apply(mb, T(1), pm.data(), d);  // P m
                if (gcp) {
                  T acc = 0;
                  for (int64_t j = 0; j < d; ++j) acc += gb_in[j] * pm[j];
                  gcp[b] = T(-2) * acc;  // ∂L/∂c = g·s/c = −2 g·Pm
                }
                if (gpb && !kIso) P.accum_outer2(gb_in, mb, -two_c, gpb, d);  // −2c g mᵀ
              }
            }
          });
        });
      });
    });
  }
  if (!need_y) gy = empty();
  return {gy, gx, gc, gp};
}

}  // namespace
}  // namespace cpu
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CPU, m) {
  m.impl("student_t_score_fwd", &etweedie::cpu::student_t_score_fwd_cpu);
  m.impl("student_t_score_bwd", &etweedie::cpu::student_t_score_bwd_cpu);
}
