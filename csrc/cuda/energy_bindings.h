// Host side of the CUDA energy ops, shared by energy_score_bindings.cpp and
// energy_distance_bindings.cpp.
#pragma once

#include "bindings.h"

namespace etweedie {
namespace cuda {

// energy_score / energy_distance: the launchers (energy_*_cuda.cu) take an isotropic per-row
// precision p.  Diagonal and block metrics are whitened here with ATen ops, as the CPU
// kernels do for large d (csrc/cpu/energy_cpu.h): z = (x − x_0)·L, P = L Lᵀ, centred on the
// first cloud's first point so that clouds far from the origin keep their precision.  The
// metric gradient then follows from the point gradients in z (no extra pair loop):
// Σ_p z_p g_pᵀ = 2 ∂V/∂P|_{P=I}, so ∂V/∂P = L⁻ᵀ (½ Σ_p z_p g_pᵀ) L⁻¹ (block) or
// ½ Σ_p z_p ⊙ g_p / p (diagonal); for an isotropic metric ∂V/∂p = β V / (2p).

// Weighted pair sums (value), point gradients and ∂/∂β for an isotropic per-row p; outputs not
// requested are undefined tensors.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_pairs(
    bool score, bool flag, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
    const at::Tensor& p, bool need_value, bool need_a, bool need_c, bool need_beta) {
  const int64_t B = a.size(0), n = a.size(1), m = c.size(1), d = a.size(2);
  at::Tensor value, ga, gc, gb;
  if (need_value) value = at::empty({B}, a.options());
  if (need_a) ga = at::zeros({B, n, d}, a.options());  // the launchers add into the gradients
  if (need_c) gc = at::zeros({B, m, d}, a.options());
  if (need_beta) gb = at::empty({B}, a.options());
  if (B == 0 || d == 0) {
    if (need_value) value.zero_();
    if (need_beta) gb.zero_();
    return {value, ga, gc, gb};
  }
  auto ws = at::empty({energy_workspace_doubles(B, n, m, d)}, a.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "energy_pairs_cuda", [&] {
    using T = scalar_t;
    EnergyArgs<T> e{};
    e.a = a.data_ptr<T>();
    e.c = c.data_ptr<T>();
    e.beta = beta.data_ptr<T>();
    e.p = p.data_ptr<T>();
    e.grad = grad.defined() ? grad.data_ptr<T>() : nullptr;
    e.B = B;
    e.n = n;
    e.m = m;
    e.d = d;
    e.sab = a.stride(0);
    e.san = a.stride(1);
    e.scb = c.stride(0);
    e.scn = c.stride(1);
    e.sb = beta.stride(0);
    e.sp = p.stride(0);
    e.sg = grad.defined() ? grad.stride(0) : 0;
    T* out_v = need_value ? value.data_ptr<T>() : nullptr;
    T* out_a = need_a ? ga.data_ptr<T>() : nullptr;
    T* out_c = need_c ? gc.data_ptr<T>() : nullptr;
    T* out_b = need_beta ? gb.data_ptr<T>() : nullptr;
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const char* op = score ? "energy_score" : "energy_distance";
    check_launch(score ? energy_score_launch<T>(e, flag, out_v, out_a, out_c, out_b, ws.data_ptr<double>(), stream)
                       : energy_distance_launch<T>(e, flag, out_v, out_a, out_c, out_b, ws.data_ptr<double>(), stream),
                 op);
  });
  return {value, ga, gc, gb};
}

// Clouds of a diagonal/block metric in whitened, centred coordinates.
struct Whitened {
  int64_t kind = 0, k = 1;
  at::Tensor prec, scale, L, za, zc;

  Whitened(const at::Tensor& a, const at::Tensor& c, const at::Tensor& p, int64_t kind_) : kind(kind_), prec(p) {
    const auto centre = a.narrow(1, 0, 1);
    if (kind == 1) {
      scale = prec.sqrt().unsqueeze(1);  // (B, 1, d)
      za = ((a - centre) * scale).contiguous();
      zc = ((c - centre) * scale).contiguous();
    } else {
      k = prec.size(1);
      L = std::get<0>(at::linalg_cholesky_ex(prec));  // no host sync; P_k = L Lᵀ
      za = apply(a - centre, L);
      zc = apply(c - centre, L);
    }
  }
  at::Tensor apply(const at::Tensor& x, const at::Tensor& M) const {
    const int64_t B = x.size(0), n = x.size(1), d = x.size(2);
    return x.reshape({B, n, d / k, k}).matmul(M.unsqueeze(1)).reshape({B, n, d}).contiguous();
  }
  at::Tensor to_x(const at::Tensor& gz) const { return kind == 1 ? gz * scale : apply(gz, L.transpose(-1, -2)); }
  at::Tensor metric_grad(const at::Tensor& gza, const at::Tensor& gzc) const {
    if (kind == 1) return (za * gza).sum(1).add((zc * gzc).sum(1)).mul(0.5).div(prec);
    const int64_t B = prec.size(0);
    auto outer = [&](const at::Tensor& z, const at::Tensor& g) {
      return z.reshape({B, -1, k}).transpose(1, 2).matmul(g.reshape({B, -1, k}));
    };
    auto G = (outer(za, gza) + outer(zc, gzc)) * 0.25;
    G = G + G.transpose(-1, -2);
    const auto eye = at::eye(k, prec.options()).expand({B, k, k});
    const auto Linv = at::linalg_solve_triangular(L, eye, /*upper=*/false);
    return Linv.transpose(-1, -2).matmul(G).matmul(Linv).contiguous();
  }
};

inline at::Tensor energy_forward(bool score, const char* op, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
                          const at::Tensor& prec, int64_t kind, bool flag) {
  checks::energy_args(op, a, c, beta, prec, kind);
  check_cuda(op, a);
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor none;
  if (a.size(0) == 0) return at::zeros({0}, a.options());
  if (kind == 0) return std::get<0>(energy_pairs(score, flag, none, a, c, beta, prec, true, false, false, false));
  const Whitened w(a, c, prec, kind);
  const auto ones = at::ones({1}, a.options()).expand({a.size(0)});
  return std::get<0>(energy_pairs(score, flag, none, w.za, w.zc, beta, ones, true, false, false, false));
}

// (value or undefined, ∂/∂a, ∂/∂c, ∂/∂β, ∂/∂prec) of Σ_r grad[r]·V_r; unrequested gradients
// are fresh empty tensors (the contract of etweedie::<op>_bwd).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_backward(
    bool score, const char* op, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& c,
    const at::Tensor& beta, const at::Tensor& prec, int64_t kind, bool flag, bool need_a, bool need_c, bool need_beta,
    bool need_prec, bool want_value) {
  checks::energy_args(op, a, c, beta, prec, kind);
  check_cuda(op, a);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0);
  checks::same_dtype_device(op, {"the first cloud", &a}, {{"grad", &grad}});
  checks::rows(op, "grad", grad, B);
  auto g = grad.contiguous();
  auto empty = [&] { return at::empty({0}, a.options()); };
  if (B == 0) {
    return {want_value ? at::zeros({0}, a.options()) : at::Tensor(), need_a ? at::zeros_like(a) : empty(),
            need_c ? at::zeros_like(c) : empty(), need_beta ? at::zeros({0}, a.options()) : empty(),
            need_prec ? at::zeros_like(prec) : empty()};
  }
  at::Tensor value, ga, gc, gb, gp;
  if (kind == 0) {
    std::tie(value, ga, gc, gb) = energy_pairs(score, flag, g, a, c, beta, prec, want_value || need_prec, need_a,
                                               need_c, need_beta);
    if (need_prec) gp = g * beta * value / (2 * prec);
  } else {
    const Whitened w(a, c, prec, kind);
    const auto ones = at::ones({1}, a.options()).expand({B});
    at::Tensor gza, gzc;
    std::tie(value, gza, gzc, gb) = energy_pairs(score, flag, g, w.za, w.zc, beta, ones, want_value,
                                                 need_a || need_prec, need_c || need_prec, need_beta);
    if (need_prec) gp = w.metric_grad(gza, gzc);
    if (need_a) ga = w.to_x(gza);
    if (need_c) gc = w.to_x(gzc);
  }
  return {want_value ? value : at::Tensor(), need_a ? ga : empty(), need_c ? gc : empty(), need_beta ? gb : empty(),
          need_prec ? gp : empty()};
}

}  // namespace cuda
}  // namespace etweedie
