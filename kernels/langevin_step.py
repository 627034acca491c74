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
    """Gradients (y, x, noise, step, beta, lam, prec) for the flags in ``need`` (None if not)."""
    a = step.unsqueeze(-1)
    gy_s, gx, gb, gl, gp = _ets.et_score_bwd_op(
        a * grad, grad_m, y, x, beta, lam, prec, kind, m, need[0], need[1], need[4], need[5], need[6]
    )
    grad_y = grad + gy_s if need[0] else None
    grad_noise = torch.sqrt(2 * a) * grad if need[2] else None
    grad_step = None
    if need[3]:
        from etweedie.ops.reference import apply_precision

        s = -lam.unsqueeze(-1) * apply_precision(prec, kind, m)
        grad_step = (grad * (s + noise / torch.sqrt(2 * a))).sum(-1)
    return (
        grad_y,
        gx if need[1] else None,
        grad_noise,
        grad_step,
        gb if need[4] else None,
        gl if need[5] else None,
        gp if need[6] else None,
    )


def _fwd_impl(y: torch.Tensor, x: torch.Tensor, noise: torch.Tensor, step: torch.Tensor, beta: torch.Tensor,
              lam: torch.Tensor, prec: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    return langevin_step_forward(y, x, noise, step, beta, lam, prec, kind)


langevin_step_fwd_op = define_op("etweedie_triton::langevin_step_fwd", _fwd_impl)


def langevin_step_op(y, x, noise, step, beta, lam, prec, kind: int):
    """The differentiable op ``etweedie_triton::langevin_step_fwd`` -> (y_next, m)."""
    return langevin_step_fwd_op(y, x, noise, step, beta, lam, prec, kind)


def _register() -> None:
    if interpreting():
        @langevin_step_fwd_op.register_fake
        def _(y, x, noise, step, beta, lam, prec, kind):
            return y.new_empty(y.shape), y.new_empty(y.shape)

    def setup_context(ctx, inputs, output):
        y, x, noise, step, beta, lam, prec, kind = inputs
        ctx.kind = kind
        ctx.save_for_backward(y, x, noise, step, beta, lam, prec, output[1])

    def backward(ctx, grad_out, grad_m):
        y, x, noise, step, beta, lam, prec, m = ctx.saved_tensors
        g = torch.zeros_like(y) if grad_out is None else grad_out
        gm = torch.zeros_like(y) if grad_m is None else grad_m
        grads = langevin_step_backward(g, gm, y, x, noise, step, beta, lam, prec, ctx.kind, m, ctx.needs_input_grad)
        return (*grads, None)

    langevin_step_fwd_op.register_autograd(backward, setup_context=setup_context)


_register()
