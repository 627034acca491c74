// etweedie::energy_score: the canonical form, the energy_score_fwd or energy_score_fwd_grad call
// and the NaN rows of non-finite inputs in one C++ entry (the Python op
// etweedie/ops/energy_score.py calls it in eager mode; csrc/front/rows_front.h for the shared
// parts).  Built from the validated arguments in their broadcastable shapes:
//
//   samples (*batch, M, d) -> (B, M, d), unit stride over d     target (*batch, d) -> (B, d) contiguous
//   beta -> (B,)     prec (*metric_batch, *param) -> (B, *param)
//
// fused: the training path (value and unit gradients in one pass, csrc/autograd/
// energy_score_autograd.cpp); nan_rows: set to NaN each row whose samples or target hold a NaN
// or an infinity (the pair kernels count a pair whose squared norm is not > 0 as coincident,
// which would turn a NaN input into a finite score), for kernels that do not flag such rows.
#include <torch/library.h>

#include <limits>

#include "rows_front.h"

namespace etweedie {
namespace front {
namespace {

using Fwd = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool);
using FwdGrad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool, bool, bool, bool, bool);

// (*b,) true where the (*b, *core) tensor t holds only finite values in its core dims.
at::Tensor finite_rows(const at::Tensor& t, int64_t core) { return t.isfinite().flatten(t.dim() - core).all(-1); }

at::Tensor energy_score_rows(const at::Tensor& samples, const at::Tensor& target, const at::Tensor& beta,
                             const at::Tensor& prec, int64_t kind, bool fair, at::IntArrayRef batch, bool fused,
                             bool nan_rows) {
  static const auto fwd = kernel<Fwd>("etweedie::energy_score_fwd");
  static const auto fwd_grad = kernel<FwdGrad>("etweedie::energy_score_fwd_grad");
  TORCH_CHECK(samples.dim() >= 2 && target.dim() >= 1,
              "etweedie front: samples must be (*batch, M, d) and target (*batch, d), got ", samples.sizes(), " and ",
              target.sizes());
  auto run = [&] {
    const int64_t M = samples.size(-2), d = samples.size(-1);
    const int64_t B = c10::multiply_integers(batch);
    at::Tensor xs = flat(samples, batch, B, {M, d});
    if (d > 1 && xs.stride(-1) != 1) xs = xs.contiguous();
    const at::Tensor yt = flat(target, batch, B, {d}).contiguous();
    const at::Tensor betas = flat(beta, batch, B, {});
    const at::Tensor p = prec_rows(prec, kind, batch, B);
    at::Tensor value;
    if (fused) {
      value = std::get<0>(fwd_grad.call(xs, yt, betas, p, kind, fair, samples.requires_grad(), target.requires_grad(),
                                        beta.requires_grad(), prec.requires_grad()));
    } else {
      value = fwd.call(xs, yt, betas, p, kind, fair);
    }
    if (nan_rows) {
      const at::Tensor ok = finite_rows(samples, 2).logical_and(finite_rows(target, 1));
      value = value.masked_fill(ok.expand(batch).reshape({B}).logical_not(), std::numeric_limits<double>::quiet_NaN());
    }
    return value.reshape(batch);
  };
  return with_autograd_if_needed({&samples, &target, &beta, &prec}, run);
}

}  // namespace

TORCH_LIBRARY_IMPL(etweedie, CompositeImplicitAutograd, m) { m.impl("energy_score", &energy_score_rows); }

}  // namespace front
}  // namespace etweedie
