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

#include <tuple>
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

// ----------------------------------------------------------------------------- energy ops
//
// energy_score / energy_distance: the launchers (energy_*_cuda.cu) take an isotropic per-row
// precision p.  Diagonal and block metrics are whitened here with ATen ops, as the CPU
// kernels do for large d (csrc/cpu/energy_cpu.h): z = (x − x_0)·L, P = L Lᵀ, centred on the
// first cloud's first point so that clouds far from the origin keep their precision.  The
// metric gradient then follows from the point gradients in z (no extra pair loop):
// Σ_p z_p g_pᵀ = 2 ∂V/∂P|_{P=I}, so ∂V/∂P = L⁻ᵀ (½ Σ_p z_p g_pᵀ) L⁻¹ (block) or
// ½ Σ_p z_p ⊙ g_p / p (diagonal); for an isotropic metric ∂V/∂p = β V / (2p).

void check_energy(const char* op, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
                  const at::Tensor& prec, int64_t kind) {
  TORCH_CHECK(a.dim() == 3, op, ": first cloud must be (B, n, d), got ", a.sizes());
  TORCH_CHECK(c.dim() == 3 && c.size(0) == a.size(0) && c.size(2) == a.size(2), op,
              ": second cloud must be (B, m, d) = (", a.size(0), ", m, ", a.size(2), "), got ", c.sizes());
  TORCH_CHECK(a.size(2) <= 1 || (a.stride(2) == 1 && c.stride(2) == 1), op, ": clouds must have unit stride over d");
  TORCH_CHECK(beta.dim() == 1 && beta.size(0) == a.size(0), op, ": beta must be (B,), got ", beta.sizes());
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": unknown metric kind ", kind);
  const int64_t core = kind == 0 ? 1 : (kind == 1 ? 2 : 3);
  TORCH_CHECK(prec.dim() == core && prec.size(0) == a.size(0), op, ": prec has shape ", prec.sizes(),
              ", which does not match metric kind ", kind);
  if (kind == 1) TORCH_CHECK(prec.size(1) == a.size(2), op, ": diagonal precision must be (B, d)");
  if (kind == 2) {
    TORCH_CHECK(prec.size(1) == prec.size(2) && prec.size(1) >= 1 && prec.size(1) <= 4 && a.size(2) % prec.size(1) == 0,
                op, ": block precision must be (B, k, k) with k <= 4 dividing d, got ", prec.sizes());
  }
  for (const at::Tensor* t : {&a, &c, &beta, &prec}) {
    TORCH_CHECK(t->is_cuda() && t->device() == a.device(), op, ": all tensors must be on the clouds' CUDA device ",
                a.device());
    TORCH_CHECK(t->scalar_type() == a.scalar_type(), op, ": all tensors must share the clouds' dtype ", a.scalar_type());
  }
}

// Weighted pair sums (value), point gradients and ∂/∂β for an isotropic per-row p; outputs not
// requested are undefined tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_pairs(
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

at::Tensor energy_forward(bool score, const char* op, const at::Tensor& a, const at::Tensor& c, const at::Tensor& beta,
                          const at::Tensor& prec, int64_t kind, bool flag) {
  check_energy(op, a, c, beta, prec, kind);
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
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_backward(
    bool score, const char* op, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& c,
    const at::Tensor& beta, const at::Tensor& prec, int64_t kind, bool flag, bool need_a, bool need_c, bool need_beta,
    bool need_prec, bool want_value) {
  check_energy(op, a, c, beta, prec, kind);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0);
  auto g = grad.contiguous();
  TORCH_CHECK(g.dim() == 1 && g.size(0) == B && g.device() == a.device() && g.scalar_type() == a.scalar_type(), op,
              ": grad must be (B,) = (", B, ") on the clouds' device and dtype, got ", grad.sizes());
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

void check_score_target(const at::Tensor& samples, const at::Tensor& target, bool fair) {
  TORCH_CHECK(samples.dim() == 3, "energy_score: samples must be (B, M, d), got ", samples.sizes());
  TORCH_CHECK(target.dim() == 2 && target.size(0) == samples.size(0) && target.size(1) == samples.size(2),
              "energy_score: target must be (B, d) = (", samples.size(0), ", ", samples.size(2), "), got ",
              target.sizes());
  TORCH_CHECK(samples.size(0) == 0 || samples.size(1) >= (fair ? 2 : 1), "energy_score: ",
              fair ? "the fair estimator needs M >= 2" : "need M >= 1", " samples, got M = ", samples.size(1));
}

at::Tensor energy_score_fwd_cuda(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                                 const at::Tensor& prec, int64_t kind, bool fair) {
  check_score_target(samples, target, fair);
  return energy_forward(true, "energy_score", samples, target.unsqueeze(1), beta, prec, kind, fair);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
    const at::Tensor& prec, int64_t kind, bool fair, bool need_samples, bool need_target, bool need_beta,
    bool need_prec) {
  check_score_target(samples, target, fair);
  auto out = energy_backward(true, "energy_score_bwd", grad, samples, target.unsqueeze(1), beta, prec, kind, fair,
                             need_samples, need_target, need_beta, need_prec, false);
  auto gt = std::get<2>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {std::get<1>(out), gt, std::get<3>(out), std::get<4>(out)};
}

// Training path: value and unit gradients in one call (backward only scales them by grad[r]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_score_fwd_grad_cuda(
    const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta, const at::Tensor& prec, int64_t kind,
    bool fair, bool need_samples, bool need_target, bool need_beta, bool need_prec) {
  check_score_target(samples, target, fair);
  const auto ones = at::ones({samples.size(0)}, samples.options());
  auto out = energy_backward(true, "energy_score", ones, samples, target.unsqueeze(1), beta, prec, kind, fair,
                             need_samples, need_target, need_beta, need_prec, true);
  auto gt = std::get<2>(out);
  if (need_target) gt = gt.reshape({target.size(0), target.size(1)});
  return {std::get<0>(out), std::get<1>(out), gt, std::get<3>(out), std::get<4>(out)};
}

void check_distance_sizes(const at::Tensor& a, const at::Tensor& b, bool unbiased) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "energy_distance: clouds must be (B, n, d) and (B, m, d), got ",
              a.sizes(), " and ", b.sizes());
  if (a.size(0) == 0) return;
  TORCH_CHECK(a.size(1) >= 1 && b.size(1) >= 1, "energy_distance: both clouds need at least one point");
  TORCH_CHECK(!unbiased || (a.size(1) >= 2 && b.size(1) >= 2),
              "energy_distance: the unbiased estimator needs n >= 2 and m >= 2, got n = ", a.size(1), ", m = ",
              b.size(1));
}

at::Tensor energy_distance_fwd_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                    const at::Tensor& prec, int64_t kind, bool unbiased) {
  check_distance_sizes(a, b, unbiased);
  return energy_forward(false, "energy_distance", a, b, beta, prec, kind, unbiased);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_distance_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta, const at::Tensor& prec,
    int64_t kind, bool unbiased, bool need_a, bool need_b, bool need_beta, bool need_prec) {
  check_distance_sizes(a, b, unbiased);
  auto out = energy_backward(false, "energy_distance_bwd", grad, a, b, beta, prec, kind, unbiased, need_a, need_b,
                             need_beta, need_prec, false);
  return {std::get<1>(out), std::get<2>(out), std::get<3>(out), std::get<4>(out)};
}

}  // namespace
}  // namespace cuda
}  // namespace etweedie

TORCH_LIBRARY_IMPL(etweedie, CUDA, m) {
  m.impl("et_score_fwd", &etweedie::cuda::et_score_fwd_cuda);
  m.impl("et_score_bwd", &etweedie::cuda::et_score_bwd_cuda);
  m.impl("langevin_step_fwd", &etweedie::cuda::langevin_step_fwd_cuda);
  m.impl("is_score_fwd", &etweedie::cuda::is_score_fwd_cuda);
  m.impl("energy_score_fwd", &etweedie::cuda::energy_score_fwd_cuda);
  m.impl("energy_score_bwd", &etweedie::cuda::energy_score_bwd_cuda);
  m.impl("energy_score_fwd_grad", &etweedie::cuda::energy_score_fwd_grad_cuda);
  m.impl("energy_distance_fwd", &etweedie::cuda::energy_distance_fwd_cuda);
  m.impl("energy_distance_bwd", &etweedie::cuda::energy_distance_bwd_cuda);
}
