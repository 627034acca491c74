"""Rules of ``langevin_step_fwd(y, x, noise, step, beta, lam, prec, kind) -> (y_next, m)``,
y_next = y + α s(y) + sqrt(2α) ξ, for the C++ op and the Triton op; the score's part of the
backward is the backend's own ``et_score_bwd``."""

from __future__ import annotations

import torch

from .common import apply_precision, first_order_only

__all__ = ["fake_fwd", "backward_terms", "autograd_rules"]


def fake_fwd(y, x, noise, step, beta, lam, prec, kind):
    """Fake (meta) forward -> (y_next, m), both shaped like y."""
    return y.new_empty(y.shape), y.new_empty(y.shape)


def backward_terms(score_bwd, grad, grad_m, y, x, noise, step, beta, lam, prec, kind: int, m, need):
    """Gradients (y, x, noise, step, beta, lam, prec) of y' = y + α s + sqrt(2α) ξ (None where not
    in ``need``): the score's part is ``score_bwd`` (an ``et_score_bwd`` op) with upstream α·g; the
    update is linear in s, so y, ξ and α get direct terms."""
    a = step.unsqueeze(-1)
    gy_s, gx, gb, gl, gp = score_bwd(a * grad, grad_m, y, x, beta, lam, prec, kind, m, need[0], need[1], need[4],
                                     need[5], need[6])
    grad_y = grad + gy_s if need[0] else None
    grad_noise = torch.sqrt(2 * a) * grad if need[2] else None
    grad_step = None
    if need[3]:
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


def autograd_rules(score_bwd):
    """(setup_context, backward) of a ``langevin_step_fwd`` op whose score backward is ``score_bwd``
    (the C++ ``etweedie::et_score_bwd`` or the Triton one)."""

    def setup_context(ctx, inputs, output):
        y, x, noise, step, beta, lam, prec, kind = inputs
        ctx.kind = kind
        ctx.save_for_backward(y, x, noise, step, beta, lam, prec, output[1])

    def backward(ctx, grad_out, grad_m):
        saved = ctx.saved_tensors
        y, x, noise, step, beta, lam, prec, m = saved
        g = torch.zeros_like(y) if grad_out is None else grad_out
        gm = torch.zeros_like(y) if grad_m is None else grad_m
        with torch.no_grad():
            grads = backward_terms(score_bwd, g, gm, y, x, noise, step, beta, lam, prec, ctx.kind, m,
                                   ctx.needs_input_grad)
        return (*first_order_only("langevin_step", grads, (g, gm, *saved)), None)

    return setup_context, backward
