"""Triton kernels of the Mahalanobis energy score (DESIGN §1) and their torch ops.

    ES(x_{1..M}, y) = (1/M) Σ_i ‖x_i − y‖_P^β − c_M Σ_{i<j} ‖x_i − x_j‖_P^β,
    c_M = 1/(M(M−1)) (fair, the unbiased pair term) or 1/M² (biased; the i = j terms are 0).

Computes exactly what the C++ ops ``etweedie::energy_score_fwd / _bwd / _fwd_grad`` compute
(csrc/cpu/energy_score_cpu.cpp) on the same canonical inputs (etweedie/ops/energy_score.py):
samples (B, M, d) and target (B, d) with unit stride over d (any stride over rows and samples),
beta (B,), prec (B, *param) of metric kind 0 isotropic, 1 diagonal, 2 block (k ≤ 4).

The pair engine is kernels/_energy.py with cloud a = the M samples and cloud c = the target as
a one-point cloud: one program per (row, tile of ≤ 32 samples) forms the sample–target and the
sample–sample pairs from direct differences (coincident points give exactly 0), a second
launch with one program per row gives the target's gradient.  ``energy_score_fwd_grad`` is the
training path: value and unit gradients in one pass over the pairs; backward only scales them.
Typical training shapes (M ≤ 32) need one program per row; memory is O(B·M·d).
"""

from __future__ import annotations

import torch

from ._energy import energy_grads, energy_value
from .et_score import define_op, interpreting

__all__ = ["energy_score_forward", "energy_score_backward", "energy_score_fwd_grad", "energy_score_fwd_op",
           "energy_score_bwd_op", "energy_score_fwd_grad_op", "energy_score_weights"]

_OP = "energy_score"


def energy_score_weights(M: int, fair: bool):
    """(w_cross, w_within, 0) of the pair sums (csrc/cpu/energy_score_cpu.cpp)."""
    within = 0.0 if M < 2 else (1.0 / (M * (M - 1.0)) if fair else 1.0 / (M * M))
    return (1.0 / M if M > 0 else 0.0, -within, 0.0)


def _check(samples, target, fair: bool):
    if samples.dim() != 3:
        raise ValueError(f"{_OP}: samples must be (B, M, d), got shape {tuple(samples.shape)}")
    B, M, d = samples.shape
    if target.shape != (B, d):
        raise ValueError(f"{_OP}: target must be ({B}, {d}), got shape {tuple(target.shape)}")
    if B > 0 and M < (2 if fair else 1):
        raise ValueError(f"{_OP}: {'the fair estimator needs M >= 2' if fair else 'need M >= 1'} samples, got M = {M}")


def energy_score_forward(samples, target, beta, prec, kind: int, fair: bool):
    """(B,) energy score of every row (float32/float64, CUDA tensors or CPU under TRITON_INTERPRET=1)."""
    _check(samples, target, fair)
    w = energy_score_weights(samples.shape[1], fair)
    return energy_value(_OP, samples, target.unsqueeze(1), beta, prec, kind, w)


def energy_score_backward(grad, samples, target, beta, prec, kind: int, fair: bool,
                          need_samples=True, need_target=True, need_beta=True, need_prec=True, want_value=False):
    """(value or None, ∂/∂samples (B, M, d), ∂/∂target (B, d), ∂/∂β (B,), ∂/∂prec (B, *param)) of
    Σ_r grad[r]·ES_r; an unrequested gradient is an empty tensor."""
    _check(samples, target, fair)
    w = energy_score_weights(samples.shape[1], fair)
    value, gs, gt, gb, gp = energy_grads(_OP, grad, samples, target.unsqueeze(1), beta, prec, kind, w,
                                         need_samples, need_target, need_beta, need_prec, want_value=want_value)
    if need_target:
        gt = gt.reshape(target.shape)
    return value, gs, gt, gb, gp


def energy_score_fwd_grad(samples, target, beta, prec, kind: int, fair: bool,
                          need_samples=True, need_target=True, need_beta=True, need_prec=True):
    """(value (B,), unit gradients): the fused training pass (grad = 1 for every row)."""
    ones = samples.new_ones(()).expand(samples.shape[0])
    value, gs, gt, gb, gp = energy_score_backward(ones, samples, target, beta, prec, kind, fair, need_samples,
                                                  need_target, need_beta, need_prec, want_value=True)
    return value, gs, gt, gb, gp


# ----------------------------------------------------------------------------- torch ops

def _fresh(outs):
    # custom ops may not return views of their inputs, nor outputs aliasing each other
    return tuple(o.clone() if o._base is not None else o for o in outs)


def _fwd_impl(samples: torch.Tensor, target: torch.Tensor, beta: torch.Tensor, prec: torch.Tensor, kind: int,
              fair: bool) -> torch.Tensor:
    return energy_score_forward(samples, target, beta, prec, kind, fair)


def _bwd_impl(grad: torch.Tensor, samples: torch.Tensor, target: torch.Tensor, beta: torch.Tensor,
              prec: torch.Tensor, kind: int, fair: bool, need_samples: bool, need_target: bool, need_beta: bool,
              need_prec: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = energy_score_backward(grad, samples, target, beta, prec, kind, fair, need_samples, need_target,
                                 need_beta, need_prec)
    return _fresh(outs[1:])


def _fwd_grad_impl(samples: torch.Tensor, target: torch.Tensor, beta: torch.Tensor, prec: torch.Tensor, kind: int,
                   fair: bool, need_samples: bool, need_target: bool, need_beta: bool, need_prec: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fresh(energy_score_fwd_grad(samples, target, beta, prec, kind, fair, need_samples, need_target,
                                        need_beta, need_prec))


energy_score_fwd_op = define_op("etweedie_triton::energy_score_fwd", _fwd_impl)
energy_score_bwd_op = define_op("etweedie_triton::energy_score_bwd", _bwd_impl)
energy_score_fwd_grad_op = define_op("etweedie_triton::energy_score_fwd_grad", _fwd_grad_impl)


def _register() -> None:
    # Same fake and autograd rules as the C++ ops (etweedie/rules/pairwise.py, energy_score.py).
    from etweedie.rules import pairwise
    from etweedie.rules.energy_score import fake_fwd_grad, fwd_grad_autograd_rules

    if interpreting():
        energy_score_fwd_op.register_fake(pairwise.fake_fwd)
        energy_score_bwd_op.register_fake(pairwise.fake_bwd)
        energy_score_fwd_grad_op.register_fake(fake_fwd_grad)
    setup_context, backward = pairwise.autograd_rules(energy_score_bwd_op)
    energy_score_fwd_op.register_autograd(backward, setup_context=setup_context)
    setup_context, backward = fwd_grad_autograd_rules()
    energy_score_fwd_grad_op.register_autograd(backward, setup_context=setup_context)


_register()
