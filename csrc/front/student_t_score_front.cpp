// etweedie::student_t_score: the canonical form and the student_t_score_fwd call in one C++ entry
// (csrc/front/rows_front.h; the Python op etweedie/ops/student_t_score.py calls it in eager mode).
#include <torch/library.h>

#include "rows_front.h"

namespace etweedie {
namespace front {
namespace {

using Fwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t);

std::tuple<at::Tensor, bool> student_t_score_rows(const at::Tensor& y, const at::Tensor& x, const at::Tensor& c,
                                                  const at::Tensor& prec, int64_t kind, at::IntArrayRef batch) {
  static const auto fwd = kernel<Fwd>("etweedie::student_t_score_fwd");
  auto run = [&] {
    Rows r = rows(y, x, batch);
    at::Tensor s = std::get<0>(
        fwd.call(r.y, r.x, flat(c, batch, r.B, {}), prec_rows(prec, kind, batch, r.B), kind));
    return unflat(s, batch, {r.d});
  };
  return reported({&y, &x, &c, &prec}, run);
}

}  // namespace

TORCH_LIBRARY_IMPL(etweedie, CompositeImplicitAutograd, m) { m.impl("student_t_score", &student_t_score_rows); }

}  // namespace front
}  // namespace etweedie
