// Host side of the CUDA energy ops, shared by energy_score_bindings.cpp and
// energy_distance_bindings.cpp.
#pragma once

#include "bindings.h"

namespace etweedie {
namespace cuda {

// energy_score / energy_distance: the launchers (energy_*_cuda.cu) take the row's metric as it
// comes (isotropic p, diagonal, or a k×k block) and apply it in the pair kernels.  The metric
// gradient of a diagonal or block metric follows from the point gradients (no extra pair loop):
// with g_p = ∂V/∂x_p = 2 Σ_j w·E'·P u_pj, the centred sum S = Σ_p (x_p − x_0) g_pᵀ (over both
// clouds, per k×k block of coordinates; Σ_p g_p = 0 makes it translation invariant, and the
// centre x_0 — the first cloud's first point — keeps it at the clouds' spread) equals
// 2 Σ_pairs w·E'·u uᵀ P, so ∂V/∂P = ¼ (S P⁻¹ + P⁻¹ Sᵀ) (block) or ½ S_cc / p_c (diagonal); for
// an isotropic metric ∂V/∂p = β V / (2p).

// Weighted pair sums (value), point gradients and ∂/∂β for the row metric (p, kind); outputs not
// requested are undefined tensors.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_pairs(
    bool score, bool flag, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
    const at::Tensor& p, int64_t kind, bool need_value, bool need_a, bool need_c, bool need_beta) {
  const int64_t B = a.size(0), n = a.size(1), m = c.size(1), d = a.size(2);
  at::Tensor value, ga, gc, gb;
  // the tiled pair kernels add into the gradients; the split kernels store every element
  const bool split = energy_split_path(n, m, d);
  const auto fresh = [split](at::IntArrayRef size, const at::TensorOptions& o) {
    return split ? at::empty(size, o) : at::zeros(size, o);
  };
  if (need_value) value = at::empty({B}, a.options());
  if (need_a) ga = fresh({B, n, d}, a.options());
  if (need_c) gc = fresh({B, m, d}, a.options());
  if (need_beta) gb = at::empty({B}, a.options());
  if (B == 0 || d == 0) {
    if (need_value) value.zero_();
    if (need_beta) gb.zero_();
    return {value, ga, gc, gb};
  }
  const int kblock = kind == kBlock ? static_cast<int>(p.size(1)) : 1;
  auto ws = at::empty({energy_workspace_doubles(B, n, m, d, a.element_size(), split, kblock)},
                      a.options().dtype(at::kDouble));
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
    e.kind = static_cast<int>(kind);
    e.kblock = kblock;
    e.split = split;
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

// ∂V/∂P of a diagonal (B, d) or block (B, k, k) metric from the point gradients ga (B, n, d) and
// gc (B, m, d) of the clouds a and c (see the top of this file).
inline at::Tensor energy_metric_grad(const at::Tensor& a, const at::Tensor& c, const at::Tensor& ga,
                                     const at::Tensor& gc, const at::Tensor& prec, int64_t kind) {
  const auto centre = a.narrow(1, 0, 1);
  const auto za = a - centre, zc = c - centre;
  if (kind == kDiagonal) return (za * ga).sum(1).add((zc * gc).sum(1)).mul(0.5).div(prec);
  const int64_t B = prec.size(0), k = prec.size(1);
  auto outer = [&](const at::Tensor& z, const at::Tensor& gz) {  // Σ over points and blocks of z gᵀ
    return z.reshape({B, -1, k}).transpose(1, 2).matmul(gz.reshape({B, -1, k}));
  };
  const auto S = outer(za, ga) + outer(zc, gc);
  const auto X = std::get<0>(at::linalg_solve_ex(prec, S.transpose(-1, -2)));  // P⁻¹ Sᵀ, no host sync
  return (X + X.transpose(-1, -2)).mul(0.25).contiguous();
}

inline at::Tensor energy_forward(bool score, const char* op, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
                          const at::Tensor& prec, int64_t kind, bool flag) {
  checks::energy_args(op, a, c, beta, prec, kind);
  check_cuda(op, a);
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor none;
  if (a.size(0) == 0) return at::zeros({0}, a.options());
  return std::get<0>(energy_pairs(score, flag, none, a, c, beta, prec, kind, true, false, false, false));
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
  if (kind == kIsotropic) {
    std::tie(value, ga, gc, gb) = energy_pairs(score, flag, g, a, c, beta, prec, kind, want_value || need_prec, need_a,
                                               need_c, need_beta);
    if (need_prec) gp = g * beta * value / (2 * prec);
  } else {
    std::tie(value, ga, gc, gb) = energy_pairs(score, flag, g, a, c, beta, prec, kind, want_value, need_a || need_prec,
                                               need_c || need_prec, need_beta);
    if (need_prec) gp = energy_metric_grad(a, c, ga, gc, prec, kind);
  }
  return {want_value ? value : at::Tensor(), need_a ? ga : empty(), need_c ? gc : empty(), need_beta ? gb : empty(),
          need_prec ? gp : empty()};
}

}  // namespace cuda
}  // namespace etweedie
