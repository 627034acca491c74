// The canonical form of the per-row ops (et_score, langevin_step, student_t_score) built in C++:
// one call from Python instead of a dozen small tensor calls (expand, reshape, contiguous per
// argument), the host cost that dominates a small or launch-bound call (benchmarks/RESULTS.md,
// "CPU: host cost per call").
//
// The Python layer (etweedie/ops/_rows.py: rows_args) validates the arguments and resolves the
// broadcast batch; the front ops (schemas in csrc/etweedie.cpp, registered CompositeImplicitAutograd
// so that autograd records the views they make) build exactly what _rows.canonicalize builds:
//
//   y (B, d) contiguous     x (B, N, d), unit stride over d (broadcast dims keep stride 0)
//   beta, lam, step, c (B,) prec (B, *param), a diagonal or block row contiguous
//
// call the <op>_fwd kernel through the dispatcher and return its output shaped (*batch, d), with
// whether the CPU kernel wrote a non-finite value (csrc/common/nonfinite_report.h; false on other
// devices, whose Python ops scan their inputs instead).  When
// no input needs a gradient the kernel is called below the autograd key, as torch's own autograd
// kernel would after finding nothing to record: the Python autograd wrapper of the op is skipped.
// Used in eager mode only (torch.compile traces the Python canonical form instead).
#pragma once

// Light headers (not ATen/ATen.h): the front ops use only Tensor methods and the dispatcher, and
// a translation unit with these compiles in less than half the time.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include "../common/nonfinite_report.h"

#include <initializer_list>
#include <tuple>
#include <vector>

namespace etweedie {
namespace front {

inline std::vector<int64_t> joined(at::IntArrayRef head, at::IntArrayRef tail) {
  std::vector<int64_t> out(head.begin(), head.end());
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

// t expanded to (*batch, *core) and its batch flattened to B rows (a view where strides allow).
// Each view is a dispatcher call and a new TensorImpl, which a call with cold caches (the one
// after a 51 MB kernel) pays several times over, so the common shapes take fewer: t already
// (B, *core) is returned as it is, and a one-dimensional batch needs the expand only.
inline at::Tensor flat(const at::Tensor& t, at::IntArrayRef batch, int64_t B, at::IntArrayRef core) {
  const int64_t rows[1] = {B};
  const std::vector<int64_t> target = joined(rows, core);
  if (t.sizes().equals(target)) return t;
  if (batch.size() == 1) return t.expand(target);
  return t.expand(joined(batch, core)).reshape(target);
}

// out (B, *core) with its rows unflattened to (*batch, *core); out itself for a one-dimensional batch.
inline at::Tensor unflat(const at::Tensor& out, at::IntArrayRef batch, at::IntArrayRef core) {
  if (batch.size() == 1) return out;
  return out.reshape(joined(batch, core));
}

struct Rows {
  at::Tensor y, x;  // (B, d) contiguous; (B, N, d) with unit stride over d
  int64_t B, d;
};

inline Rows rows(const at::Tensor& y, const at::Tensor& x, at::IntArrayRef batch) {
  TORCH_CHECK(y.dim() >= 1 && x.dim() >= 2, "etweedie front: y must be (*batch, d) and x (*batch, N, d), got ",
              y.sizes(), " and ", x.sizes());
  const int64_t d = y.size(-1), N = x.size(-2);
  const int64_t B = c10::multiply_integers(batch);
  at::Tensor xc = flat(x, batch, B, {N, d});
  if (d > 1 && xc.stride(-1) != 1) xc = xc.contiguous();
  return {flat(y, batch, B, {d}).contiguous(), xc, B, d};
}

// The precision parameter (*metric_batch, *param) of kind 0 (param ()), 1 ((d,)) or 2 ((k, k))
// as (B, *param): a metric shared by all rows stays a stride-0 view; a per-row diagonal or block
// row is made contiguous (the kernels index it densely).
inline at::Tensor prec_rows(const at::Tensor& p, int64_t kind, at::IntArrayRef batch, int64_t B) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "etweedie front: metric kind must be 0, 1 or 2 (dense metrics are whitened "
              "in Python), got ", kind);
  const int64_t core = kind;  // the parameter's rank: () isotropic, (d,) diagonal, (k, k) block
  TORCH_CHECK(p.dim() >= core, "etweedie front: prec of kind ", kind, " needs rank >= ", core, ", got ", p.sizes());
  at::Tensor prec = flat(p.contiguous(), batch, B, p.sizes().slice(p.dim() - core));
  if (kind > 0 && !prec.slice(0, 0, 1).is_contiguous()) prec = prec.contiguous();
  return prec;
}

// Whether the call must be recorded for autograd (grad mode on and some input requires grad).
inline bool needs_autograd(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs) {
    if (t->requires_grad()) return true;
  }
  return false;
}

// run() — the canonical form and the kernel call — with autograd recording only when it is needed
// (below the autograd key otherwise, as the op's own autograd kernel would run it).
template <typename Run>
at::Tensor with_autograd_if_needed(std::initializer_list<const at::Tensor*> inputs, const Run& run) {
  if (needs_autograd(inputs)) return run();
  at::AutoDispatchBelowAutograd below;
  return run();
}

// with_autograd_if_needed(inputs, run) under a NonFiniteReport: its output and whether the kernel
// it called raised the report.
template <typename Run>
std::tuple<at::Tensor, bool> reported(std::initializer_list<const at::Tensor*> inputs, const Run& run) {
  NonFiniteReport report;
  at::Tensor out = with_autograd_if_needed(inputs, run);
  return {out, report.raised()};
}

// The registered op etweedie::<name>, typed, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace front
}  // namespace etweedie
