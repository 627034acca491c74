// etweedie::langevin_step: the canonical form and the langevin_step_fwd call in one C++ entry
// (csrc/front/rows_front.h; the Python op etweedie/ops/langevin_step.py calls it in eager mode).
#include <torch/library.h>

#include "rows_front.h"

namespace etweedie {
namespace front {
namespace {

using Fwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t);

std::tuple<at::Tensor, bool> langevin_step_rows(const at::Tensor& y, const at::Tensor& x, const at::Tensor& noise,
                                                const at::Tensor& step, const at::Tensor& beta, const at::Tensor& lam,
                                                const at::Tensor& prec, int64_t kind, at::IntArrayRef batch) {
  static const auto fwd = kernel<Fwd>("etweedie::langevin_step_fwd");
  auto run = [&] {
    Rows r = rows(y, x, batch);
    at::Tensor out = std::get<0>(fwd.call(r.y, r.x, flat(noise, batch, r.B, {r.d}).contiguous(),
                                          flat(step, batch, r.B, {}), flat(beta, batch, r.B, {}),
                                          flat(lam, batch, r.B, {}), prec_rows(prec, kind, batch, r.B), kind));
    return unflat(out, batch, {r.d});
  };
  return reported({&y, &x, &noise, &step, &beta, &lam, &prec}, run);
}

}  // namespace

TORCH_LIBRARY_IMPL(etweedie, CompositeImplicitAutograd, m) { m.impl("langevin_step", &langevin_step_rows); }

}  // namespace front
}  // namespace etweedie
