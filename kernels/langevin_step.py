"""Triton kernel of the fused Langevin step (DESIGN §1) and its torch op.

    y' = y + α s(y) + sqrt(2α) ξ,     s = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i)

Same program layout as kernels/et_score.py (one program per query row and chunk of
coordinates, draws in tiles of BLOCK_N): the score of the chunk is finished in registers and
the update written directly, so s never goes to memory.  Canonical inputs as et_score plus
noise ξ (B, d) contiguous and step α (B,) (any stride).  Returns (y', m) like the C++ op
``etweedie::langevin_step_fwd``; the backward is the Triton et_score backward with upstream
α·g plus the direct terms for y, ξ and α (the update is linear in s).
"""

from __future__ import annotations

import torch

from . import et_score as _ets
from .et_score import _et_score_forward_kernel, check_canonical, define_op, interpreting

__all__ = ["langevin_step_forward", "langevin_step_backward", "langevin_step_op"]

# The forward kernel is _et_score_forward_kernel with LANGEVIN=True: one kernel body, so the
# score math cannot drift between the two ops.
_langevin_step_forward_kernel = _et_score_forward_kernel


def langevin_step_forward(y, x, noise, step, beta, lam, prec, kind: int):
    """(y_next (B, d), m (B, d)) for canonical inputs (see kernels/et_score.py)."""
    prec = check_canonical("langevin_step", y, x, beta, lam, prec, kind)
    if noise.shape != y.shape or not noise.is_contiguous():
        raise ValueError(f"langevin_step: noise must be contiguous {tuple(y.shape)}, got {tuple(noise.shape)}")
    if step.shape != beta.shape:
        raise ValueError(f"langevin_step: step must be {tuple(beta.shape)}, got {tuple(step.shape)}")
    return _ets._launch_forward(y, x, beta, lam, prec, kind, noise=noise, step=step)


def langevin_step_backward(grad, grad_m, y, x, noise, step, beta, lam, prec, kind: int, m, need):
    """Gradients (y, x, noise, step, beta, lam, prec) for the flags in ``need`` (None if not): the
    shared chain rule of etweedie/rules/langevin_step.py over the Triton et_score backward."""
    from etweedie.rules.langevin_step import backward_terms

    return backward_terms(_ets.et_score_bwd_op, grad, grad_m, y, x, noise, step, beta, lam, prec, kind, m, need)


def _fwd_impl(y: torch.Tensor, x: torch.Tensor, noise: torch.Tensor, step: torch.Tensor, beta: torch.Tensor,
              lam: torch.Tensor, prec: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    return langevin_step_forward(y, x, noise, step, beta, lam, prec, kind)


langevin_step_fwd_op = define_op("etweedie_triton::langevin_step_fwd", _fwd_impl)


def langevin_step_op(y, x, noise, step, beta, lam, prec, kind: int):
    """The differentiable op ``etweedie_triton::langevin_step_fwd`` -> (y_next, m)."""
    return langevin_step_fwd_op(y, x, noise, step, beta, lam, prec, kind)


def _register() -> None:
    # Same fake and autograd rules as the C++ op (etweedie/rules/langevin_step.py), with the Triton
    # et_score backward.
    from etweedie.rules.langevin_step import autograd_rules, fake_fwd

    if interpreting():
        langevin_step_fwd_op.register_fake(fake_fwd)
    setup_context, backward = autograd_rules(_ets.et_score_bwd_op)
    langevin_step_fwd_op.register_autograd(backward, setup_context=setup_context)


_register()
