// CPU kernels of etweedie::student_t_score_fwd / student_t_score_bwd (schemas in
// csrc/etweedie.cpp; math in csrc/common/student_t_score.h).
//
//   s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)
//
// Same layout and memory trade-off as et_score (et_score_cpu.h): parallel over query rows with
// at::parallel_for; each draw is read once in the forward (large d: q then the accumulation
// while the draw sits in L1, four draws per sweep of the accumulator; small d: tiles of 64
// draws in structure-of-arrays form so q, the weights and the sums vectorize across draws).
// Extra memory O(d) per thread.  The backward reads every draw once more and writes ∂L/∂x
// only when asked, into a buffer from the reuse pool of fresh_output_cpu.h (no fresh pages).
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
#include <vector>

#include "../common/checks.h"
#include "../common/draws_dispatch.h"
#include "../common/student_t_score.h"
#include "et_score_cpu.h"
#include "fresh_output_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {
namespace {

constexpr const char* kOp = "student_t_score";

void check_canonical(const at::Tensor& y, const at::Tensor& x, const at::Tensor& c, const at::Tensor& prec,
                     int64_t kind) {
  checks::student_t_args(kOp, y, x, c, prec, kind);
}

int64_t block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

// acc (length d, zeroed by the caller) += Σ_i w_i u_i, w_i = 1/(1 + q_i).
template <typename T, typename Prec, typename X>
void student_t_accumulate(const Prec& P, const T* y, const X* x, int64_t sxn, int64_t N, int64_t d, T* acc) {
  if (d > kSmallD) {
    int64_t i = 0;
    for (; i + 4 <= N; i += 4) {
      const X* x0 = x + i * sxn;
      const X* x1 = x0 + sxn;
      const X* x2 = x1 + sxn;
      const X* x3 = x2 + sxn;
      const T w0 = student_t_weight(P.quad(y, x0, d)), w1 = student_t_weight(P.quad(y, x1, d));
      const T w2 = student_t_weight(P.quad(y, x2, d)), w3 = student_t_weight(P.quad(y, x3, d));
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const T yj = y[j];
        acc[j] += w0 * (yj - widen<T>(x0[j])) + w1 * (yj - widen<T>(x1[j])) + w2 * (yj - widen<T>(x2[j])) +
                  w3 * (yj - widen<T>(x3[j]));
      }
    }
    for (; i < N; ++i) {
      const X* xi = x + i * sxn;
      const T w = student_t_weight(P.quad(y, xi, d));
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[j] += w * (y[j] - widen<T>(xi[j]));
    }
    return;
  }
  T ut[kSmallD * kTile], q[kTile], w[kTile];
  for (int64_t i0 = 0; i0 < N; i0 += kTile) {
    const int64_t n = std::min(kTile, N - i0);
    residual_tile(y, x + i0 * sxn, sxn, n, d, ut);
    P.quad_soa(ut, kTile, n, d, q);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) w[t] = student_t_weight(q[t]);
    for (int64_t j = 0; j < d; ++j) {
      const T* uj = ut + j * kTile;
      T a = 0;
#pragma omp simd reduction(+ : a)
      for (int64_t t = 0; t < n; ++t) a += w[t] * uj[t];
      acc[j] += a;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> student_t_score_fwd_cpu(const at::Tensor& y, const at::Tensor& x,
                                                           const at::Tensor& c, const at::Tensor& prec, int64_t kind) {
  check_canonical(y, x, c, prec, kind);
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
      ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
        at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
          std::vector<T> pattern;
          for (int64_t b = b0; b < b1; ++b) {
            Prec P{pp + b * sp0};
            prepare_row(P, pattern, d);
            T* mb = mp + b * d;
            std::fill(mb, mb + d, T(0));
            student_t_accumulate<T, Prec, X>(P, yp + b * d, xp + b * sxb, sxn, N, d, mb);
            for (int64_t j = 0; j < d; ++j) mb[j] *= inv_n;
            P.apply(mb, T(-2) * cp[b * sc], sp + b * d, d);
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
  check_canonical(y, x, c, prec, kind);
  checks::same_dtype_device(kOp, {"y", &y}, {{"grad", &grad}, {"grad_m", &grad_m}, {"m", &m}});
  checks::shape(kOp, "grad", grad, y.sizes());
  checks::shape(kOp, "grad_m", grad_m, y.sizes());
  checks::shape(kOp, "m", m, y.sizes());
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
  if (B > 0 && d > 0 && N > 0) {
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
        const T inv_n = T(1) / static_cast<T>(N);
        ET_DISPATCH_METRIC(kind, block_of(prec, kind), T, [&] {
          at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
            std::vector<T> h(d), pm(d), pattern, gxrow(gxp ? d : 0);
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
              for (int64_t i = 0; i < N; ++i) {
                const X* xi = xp + b * sxb + i * sxn;
                T q, hu;
                P.quad_dot(yb, xi, h.data(), d, q, hu);
                const T w = student_t_weight(q);
                const T cs = student_t_weight_slope(w) * hu;
                // ∂L/∂x_i goes through an L1 row and out with streaming stores (written once, never re-read here)
                P.grad_u(yb, xi, h.data(), w * inv_n, cs * inv_n, gyb, gxp ? gxrow.data() : nullptr, d);
                if (gxp) stream_row(gxp + (b * N + i) * d, gxrow.data(), d);
                if (gpb) P.accum_outer(yb, xi, T(0.5) * cs * inv_n, gpb, d);
              }
              if (gxp) stream_fence();
              if (gcp || gpb) {
                P.apply(mb, T(1), pm.data(), d);  // P m
                if (gcp) {
                  T acc = 0;
                  for (int64_t j = 0; j < d; ++j) acc += gb_in[j] * pm[j];
                  gcp[b] = T(-2) * acc;  // ∂L/∂c = g·s/c = −2 g·Pm
                }
                if (gpb) P.accum_outer2(gb_in, mb, -two_c, gpb, d);  // −2c g mᵀ
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
