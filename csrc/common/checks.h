// Argument checks of every etweedie::* schema entry (csrc/etweedie.cpp), shared by the CPU
// kernels (csrc/cpu/<op>_cpu.cpp) and the CUDA bindings (csrc/cuda/<op>_bindings.cpp).
//
// The registered ops are public: other code calls torch.ops.etweedie.* directly, without the
// Python layer that builds canonical arguments (etweedie/ops/_rows.py and the op modules).  So each entry checks
// everything its kernel reads before touching a pointer: ranks, sizes against B, N, d, the
// strides the kernels assume, the metric kind and its parameter shape (a block size k ≤ 4
// dividing d), one dtype (the query's; the draws of the score ops may instead be bfloat16 or
// float16) and one device for all tensors, and the scalar parameters.  A
// violation is a c10::Error (RuntimeError in Python) naming the op, the argument, what was
// expected and what was received — never an out-of-bounds read or a wrong result.
//
// Host-only (ATen); the device code in csrc/cuda/*.cu never includes it.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <initializer_list>
#include <utility>

#include "macros.h"

namespace etweedie {
namespace checks {

using Named = std::pair<const char*, const at::Tensor*>;

// float32/float64 tensors, all with ref's dtype and on ref's device.
inline void same_dtype_device(const char* op, const Named& ref, std::initializer_list<Named> others) {
  const at::Tensor& r = *ref.second;
  TORCH_CHECK(r.scalar_type() == at::kFloat || r.scalar_type() == at::kDouble, op, ": ", ref.first,
              " must be float32 or float64, got ", r.scalar_type());
  for (const auto& t : others) {
    TORCH_CHECK(t.second->scalar_type() == r.scalar_type(), op, ": ", t.first, " must have ", ref.first, "'s dtype ",
                r.scalar_type(), ", got ", t.second->scalar_type());
    TORCH_CHECK(t.second->device() == r.device(), op, ": ", t.first, " must be on ", ref.first, "'s device ",
                r.device(), ", got ", t.second->device());
  }
}

// The posterior draws x of a score op: y's dtype, or bfloat16 / float16 (read in 16 bits and
// widened to y's dtype as they are loaded: csrc/common/low_precision.h), on y's device.
inline void draws(const char* op, const at::Tensor& y, const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == y.scalar_type() || t == at::kBFloat16 || t == at::kHalf, op, ": x must have y's dtype ",
              y.scalar_type(), " or be bfloat16 or float16, got ", t);
  TORCH_CHECK(x.device() == y.device(), op, ": x must be on y's device ", y.device(), ", got ", x.device());
}

// A per-row parameter (beta, lam, step): shape (B,), any stride.
inline void rows(const char* op, const char* name, const at::Tensor& t, int64_t B) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, op, ": ", name, " must have shape (B,) = (", B, "), got ", t.sizes());
}

// A tensor of exactly the given shape (upstream gradients, saved residuals).
inline void shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes) {
  TORCH_CHECK(t.sizes() == sizes, op, ": ", name, " must have shape ", sizes, ", got ", t.sizes());
}

// prec (B, *param) for metric kind 0 (isotropic, param ()), 1 (diagonal, (d,)) or 2 (block,
// (k, k), k ≤ 4 dividing d).  Any stride over B; a row's parameter must be dense.
inline void metric(const char* op, const at::Tensor& prec, int64_t kind, int64_t B, int64_t d) {
  TORCH_CHECK(kind >= kIsotropic && kind <= kBlock, op, ": unknown metric kind ", kind,
              " (0 isotropic, 1 diagonal, 2 block; dense metrics are whitened by the caller)");
  if (kind == kIsotropic) {
    TORCH_CHECK(prec.dim() == 1 && prec.size(0) == B, op, ": an isotropic precision must have shape (B,) = (", B,
                "), got ", prec.sizes());
  } else if (kind == kDiagonal) {
    TORCH_CHECK(prec.dim() == 2 && prec.size(0) == B && prec.size(1) == d, op,
                ": a diagonal precision must have shape (B, d) = (", B, ", ", d, "), got ", prec.sizes());
    TORCH_CHECK(d <= 1 || prec.numel() == 0 || prec.stride(1) == 1, op, ": a diagonal precision must have unit stride over d, got strides ",
                prec.strides());
  } else {
    TORCH_CHECK(prec.dim() == 3 && prec.size(0) == B && prec.size(1) == prec.size(2), op,
                ": a block precision must have shape (B, k, k) with B = ", B, ", got ", prec.sizes());
    const int64_t k = prec.size(1);
    TORCH_CHECK(k >= 1 && k <= 4 && d % k == 0, op, ": the block size k must be in [1, 4] and divide d = ", d,
                ", got k = ", k);
    TORCH_CHECK(prec.numel() == 0 || (prec.stride(2) == 1 && prec.stride(1) == k), op,
                ": each row's block precision must be contiguous (strides (*, k, 1)), got strides ", prec.strides());
  }
}

// (Stride rules apply to tensors the kernels read: an empty tensor is never dereferenced, and
// torch calls every empty tensor contiguous whatever its strides.)
//
// The query and its cloud, as every score op takes them: y (B, d) contiguous, x (B, N, d)
// with unit stride over d (any stride over B and N: 0 = a broadcast cloud) and N >= 1 unless
// there is no row (B = 0; d = 0 with B > 0 still needs a draw); x's dtype as draws() allows.
inline void query_cloud(const char* op, const at::Tensor& y, const at::Tensor& x) {
  draws(op, y, x);
  TORCH_CHECK(y.dim() == 2, op, ": y must have shape (B, d), got ", y.sizes());
  TORCH_CHECK(y.is_contiguous(), op, ": y must be contiguous, got strides ", y.strides());
  const int64_t B = y.size(0), d = y.size(1);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == B && x.size(2) == d, op, ": x must have shape (B, N, d) = (", B, ", N, ",
              d, "), got ", x.sizes());
  TORCH_CHECK(d <= 1 || x.numel() == 0 || x.stride(2) == 1, op, ": x must have unit stride over d, got strides ", x.strides());
  TORCH_CHECK(x.size(1) > 0 || B == 0, op, ": x must hold at least one posterior draw (N >= 1)");
}

// Canonical arguments of the score ops (et_score, langevin_step): query_cloud, beta and lam
// (B,), prec as in metric().
inline void score_args(const char* op, const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                       const at::Tensor& lam, const at::Tensor& prec, int64_t kind) {
  same_dtype_device(op, {"y", &y}, {{"beta", &beta}, {"lam", &lam}, {"prec", &prec}});
  query_cloud(op, y, x);
  const int64_t B = y.size(0), d = y.size(1);
  rows(op, "beta", beta, B);
  rows(op, "lam", lam, B);
  metric(op, prec, kind, B, d);
}

// langevin_step_fwd: score_args, then the noise ξ (B, d) contiguous and the step α (B,).
inline void langevin_step_args(const char* op, const at::Tensor& y, const at::Tensor& x, const at::Tensor& noise,
                               const at::Tensor& step, const at::Tensor& beta, const at::Tensor& lam,
                               const at::Tensor& prec, int64_t kind) {
  score_args(op, y, x, beta, lam, prec, kind);
  same_dtype_device(op, {"y", &y}, {{"noise", &noise}, {"step", &step}});
  shape(op, "noise", noise, y.sizes());
  TORCH_CHECK(noise.is_contiguous(), op, ": noise must be contiguous, got strides ", noise.strides());
  rows(op, "step", step, y.size(0));
}

// Canonical arguments of student_t_score: query_cloud, the exponent c (B,), prec as in metric().
inline void student_t_args(const char* op, const at::Tensor& y, const at::Tensor& x, const at::Tensor& c,
                           const at::Tensor& prec, int64_t kind) {
  same_dtype_device(op, {"y", &y}, {{"c", &c}, {"prec", &prec}});
  query_cloud(op, y, x);
  rows(op, "c", c, y.size(0));
  metric(op, prec, kind, y.size(0), y.size(1));
}

// Canonical arguments of the pair ops (energy_score with the target as a one-point cloud,
// energy_distance): a (B, n, d), b (B, m, d), unit stride over d, beta (B,), prec as above.
inline void energy_args(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                        const at::Tensor& prec, int64_t kind) {
  same_dtype_device(op, {"the first cloud", &a}, {{"the second cloud", &b}, {"beta", &beta}, {"prec", &prec}});
  TORCH_CHECK(a.dim() == 3, op, ": the first cloud must have shape (B, n, d), got ", a.sizes());
  const int64_t B = a.size(0), d = a.size(2);
  TORCH_CHECK(b.dim() == 3 && b.size(0) == B && b.size(2) == d, op, ": the second cloud must have shape (B, m, d) = (",
              B, ", m, ", d, "), got ", b.sizes());
  TORCH_CHECK(d <= 1 || ((a.numel() == 0 || a.stride(2) == 1) && (b.numel() == 0 || b.stride(2) == 1)), op, ": clouds must have unit stride over d, got strides ",
              a.strides(), " and ", b.strides());
  rows(op, "beta", beta, B);
  metric(op, prec, kind, B, d);
}

// energy_distance: clouds (B, n, d) and (B, m, d) with n, m >= 1 (>= 2 for the unbiased estimator)
// when B > 0; energy_args checks the rest.
inline void energy_distance_sizes(const at::Tensor& a, const at::Tensor& b, bool unbiased) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "energy_distance: clouds must be (B, n, d) and (B, m, d), got ",
              a.sizes(), " and ", b.sizes());
  if (a.size(0) == 0) return;
  TORCH_CHECK(a.size(1) >= 1 && b.size(1) >= 1, "energy_distance: both clouds need at least one point");
  TORCH_CHECK(!unbiased || (a.size(1) >= 2 && b.size(1) >= 2),
              "energy_distance: the unbiased estimator needs n >= 2 and m >= 2, got n = ", a.size(1), ", m = ",
              b.size(1));
}

// The backward of the per-row score ops (et_score, student_t_score): the incoming grad and
// grad_m and the saved m, each (B, d) like y and in its dtype and device.
inline void score_grads(const char* op, const at::Tensor& y, const at::Tensor& grad, const at::Tensor& grad_m,
                        const at::Tensor& m) {
  same_dtype_device(op, {"y", &y}, {{"grad", &grad}, {"grad_m", &grad_m}, {"m", &m}});
  shape(op, "grad", grad, y.sizes());
  shape(op, "grad_m", grad_m, y.sizes());
  shape(op, "m", m, y.sizes());
}

// is_score: y (Q, d) and bank (M ≥ 1, d) contiguous, one shared metric prec (1, *param)
// contiguous, β ∈ (0, 2] and λ > 0 finite.
inline void is_score_args(const char* op, const at::Tensor& y, const at::Tensor& bank, double beta, double lam,
                          const at::Tensor& prec, int64_t kind) {
  same_dtype_device(op, {"y", &y}, {{"bank", &bank}, {"prec", &prec}});
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), op, ": y must be a contiguous (Q, d) tensor, got shape ", y.sizes(),
              " strides ", y.strides());
  TORCH_CHECK(bank.dim() == 2 && bank.size(1) == y.size(1) && bank.is_contiguous(), op,
              ": bank must be a contiguous (M, d = ", y.size(1), ") tensor, got shape ", bank.sizes(), " strides ",
              bank.strides());
  TORCH_CHECK(bank.size(0) > 0, op, ": bank must hold at least one point");
  TORCH_CHECK(prec.is_contiguous(), op, ": prec must be contiguous (one metric shared by all queries)");
  metric(op, prec, kind, 1, y.size(1));
  TORCH_CHECK(beta > 0 && beta <= 2, op, ": beta must lie in (0, 2], got ", beta);
  TORCH_CHECK(lam > 0 && std::isfinite(lam), op, ": lam must be > 0 and finite, got ", lam);
}

}  // namespace checks
}  // namespace etweedie
