// etweedie::et_score: the canonical form and the et_score_fwd call in one C++ entry
// (csrc/front/rows_front.h; the Python op etweedie/ops/et_score.py calls it in eager mode).
#include <torch/library.h>

#include "rows_front.h"

namespace etweedie {
namespace front {
namespace {

using Fwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, int64_t);

std::tuple<at::Tensor, bool> et_score_rows(const at::Tensor& y, const at::Tensor& x, const at::Tensor& beta,
                                           const at::Tensor& lam, const at::Tensor& prec, int64_t kind,
                                           at::IntArrayRef batch) {
  static const auto fwd = kernel<Fwd>("etweedie::et_score_fwd");
  auto run = [&] {
    Rows r = rows(y, x, batch);
    at::Tensor s = std::get<0>(fwd.call(r.y, r.x, flat(beta, batch, r.B, {}), flat(lam, batch, r.B, {}),
                                        prec_rows(prec, kind, batch, r.B), kind));
    return unflat(s, batch, {r.d});
  };
  return reported({&y, &x, &beta, &lam, &prec}, run);
}

}  // namespace

TORCH_LIBRARY_IMPL(etweedie, CompositeImplicitAutograd, m) { m.impl("et_score", &et_score_rows); }

}  // namespace front
}  // namespace etweedie
