// Operator schemas of the etweedie library (registered once, here).  Backends register
// kernels with TORCH_LIBRARY_IMPL(etweedie, CPU|CUDA, m) in csrc/cpu/<op>_cpu.cpp and
// csrc/cuda/<op>_bindings.cpp (each entry checks its arguments with csrc/common/checks.h); autograd and fake (meta) implementations are registered from
// Python (etweedie/ops/<op>.py) so that torch.compile traces the ops without graph breaks.
//
// Canonical arguments (built by etweedie/ops/_rows.py, or in C++ by the front ops below):
//   y (B, d), x (B, N, d), beta/lam/step (B,), prec (B, *param) with kind
//   0 = isotropic (param ()), 1 = diagonal (param (d,)), 2 = block (param (k, k)).
//   Dense metrics are whitened on the host and reach the kernels as isotropic.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(etweedie, m) {
  // -> (s, m): the score s = −λ P m and the weighted mean residual m (saved for backward).
  // CPU and CUDA kernels (and langevin_step_fwd's): a row with a draw whose q = ‖y − x_i‖²_P is out
  // of the range they compute accurately (q_in_range, csrc/common/et_score.h: NaN/inf inputs,
  // float32 over/underflow) comes back as NaN in both outputs; on CPU tensors the Python op then
  // reruns in float64.
  m.def("et_score_fwd(Tensor y, Tensor x, Tensor beta, Tensor lam, Tensor prec, int kind) -> (Tensor, Tensor)");
  // Upstream gradients of both outputs -> (grad_y, grad_x, grad_beta, grad_lam, grad_prec);
  // an unrequested gradient is an empty tensor.
  m.def(
      "et_score_bwd(Tensor grad, Tensor grad_m, Tensor y, Tensor x, Tensor beta, Tensor lam, Tensor prec, int kind, Tensor m, "
      "bool need_y, bool need_x, bool need_beta, bool need_lam, bool need_prec) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // -> (y_next, m): y_next = y + step·s(y) + sqrt(2·step)·noise.
  m.def(
      "langevin_step_fwd(Tensor y, Tensor x, Tensor noise, Tensor step, Tensor beta, Tensor lam, Tensor prec, "
      "int kind) -> (Tensor, Tensor)");
  // -> (score, posterior_mean, ess) of the importance-sampling oracle over a clean bank.
  m.def("is_score_fwd(Tensor y, Tensor bank, float beta, float lam, Tensor prec, int kind) -> (Tensor, Tensor, Tensor)");
  // -> (s, m): the Student-t score s = −2c P m, m = (1/N) Σ_i (y − x_i)/(1 + ‖y − x_i‖²_P) (saved for backward).
  // CPU kernel: rows with a draw out of range are NaN, as for et_score_fwd.
  m.def("student_t_score_fwd(Tensor y, Tensor x, Tensor c, Tensor prec, int kind) -> (Tensor, Tensor)");
  // Upstream gradients of both outputs -> (grad_y, grad_x, grad_c, grad_prec); empty if not requested.
  m.def(
      "student_t_score_bwd(Tensor grad, Tensor grad_m, Tensor y, Tensor x, Tensor c, Tensor prec, int kind, Tensor m, "
      "bool need_y, bool need_x, bool need_c, bool need_prec) -> (Tensor, Tensor, Tensor, Tensor)");
  // -> (B,) energy score of samples (B, M, d) against target (B, d); fair = unbiased pair term.
  m.def("energy_score_fwd(Tensor samples, Tensor target, Tensor beta, Tensor prec, int kind, bool fair) -> Tensor");
  // Upstream gradient (B,) -> (grad_samples, grad_target, grad_beta, grad_prec); empty if not requested.
  m.def(
      "energy_score_bwd(Tensor grad, Tensor samples, Tensor target, Tensor beta, Tensor prec, int kind, bool fair, "
      "bool need_samples, bool need_target, bool need_beta, bool need_prec) -> (Tensor, Tensor, Tensor, Tensor)");
  // Fused training path -> (value (B,), and the gradients of value.sum(): samples, target, beta, prec).
  m.def(
      "energy_score_fwd_grad(Tensor samples, Tensor target, Tensor beta, Tensor prec, int kind, bool fair, "
      "bool need_samples, bool need_target, bool need_beta, bool need_prec) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // -> (B,) energy distance between clouds a (B, n, d) and b (B, m, d); unbiased = U-statistic.
  m.def("energy_distance_fwd(Tensor a, Tensor b, Tensor beta, Tensor prec, int kind, bool unbiased) -> Tensor");
  m.def(
      "energy_distance_bwd(Tensor grad, Tensor a, Tensor b, Tensor beta, Tensor prec, int kind, bool unbiased, "
      "bool need_a, bool need_b, bool need_beta, bool need_prec) -> (Tensor, Tensor, Tensor, Tensor)");
  // Front ops of the per-row ops (csrc/front/<op>_front.cpp, CompositeImplicitAutograd): arguments
  // validated by etweedie/ops/_rows.py (rows_args) in their broadcastable shapes, the broadcast batch
  // resolved; they build the canonical form above in one C++ call, run <op>_fwd and return its first
  // output shaped (*batch, d) with whether the CPU kernel wrote a NaN or inf (nonfinite_report.h; false
  // on other devices).  prec is the metric's precision parameter (*metric_batch, *param).
  m.def("et_score(Tensor y, Tensor x, Tensor beta, Tensor lam, Tensor prec, int kind, int[] batch) -> (Tensor, bool)");
  m.def(
      "langevin_step(Tensor y, Tensor x, Tensor noise, Tensor step, Tensor beta, Tensor lam, Tensor prec, int kind, "
      "int[] batch) -> (Tensor, bool)");
  m.def("student_t_score(Tensor y, Tensor x, Tensor c, Tensor prec, int kind, int[] batch) -> (Tensor, bool)");
  // Front op of energy_score (csrc/front/energy_score_front.cpp): validated samples (*batch, M, d), target
  // (*batch, d), beta and the metric's prec (*metric_batch, *param) of kind 0-2; fused: the training path
  // (energy_score_fwd_grad); nan_rows: NaN for rows whose inputs hold NaN or inf.  -> (*batch,)
  m.def(
      "energy_score(Tensor samples, Tensor target, Tensor beta, Tensor prec, int kind, bool fair, int[] batch, "
      "bool fused, bool nan_rows) -> Tensor");
}

// `import etweedie._C` loads this shared object, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "etweedie compiled kernels", -1, nullptr};
  return PyModule_Create(&module);
}
