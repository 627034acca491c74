"""Rules of energy_score's fused value-and-gradient op
``energy_score_fwd_grad(samples, target, beta, prec, kind, fair, need_samples, need_target,
need_beta, need_prec) -> (value, 4 unit grads)``, for the C++ op and the Triton op.  The plain
forward/backward pair follows the pairwise schema (:mod:`etweedie.rules.pairwise`)."""

from __future__ import annotations

from .common import first_order_only

__all__ = ["fake_fwd_grad", "fwd_grad_autograd_rules"]


def fake_fwd_grad(samples, target, beta, prec, kind, fair, need_samples, need_target, need_beta, need_prec):
    """Fake (meta) implementation of the fused value-and-gradient op."""
    return (
        samples.new_empty(samples.shape[:1]),
        samples.new_empty(samples.shape) if need_samples else beta.new_empty(0),
        target.new_empty(target.shape) if need_target else beta.new_empty(0),
        beta.new_empty(beta.shape) if need_beta else beta.new_empty(0),
        prec.new_empty(prec.shape) if need_prec else beta.new_empty(0),
    )


def fwd_grad_autograd_rules():
    """(setup_context, backward) of the fused op: it returned ∂(value.sum())/∂input, and row
    r's share scales with the upstream grad[r]."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output[1:], *inputs[:4])
        # the unit-gradient outputs are never differentiated: no zero-filled (B, M, d) upstream
        # gradients for them (backward reads the value's gradient only)
        ctx.set_materialize_grads(False)

    def backward(ctx, grad, *_unused):
        if grad is None:
            return (None,) * 10
        gs, gt, gb, gp, *inputs = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = (
            grad.view(-1, 1, 1) * gs if need[0] else None,
            grad.view(-1, 1) * gt if need[1] else None,
            grad * gb if need[2] else None,
            grad.view(-1, *([1] * (gp.dim() - 1))) * gp if need[3] else None,
        )
        # the saved unit gradients are constants of the graph: a second derivative through them
        # would be silently 0, so it raises instead
        return (*first_order_only("energy_score", grads, inputs), *([None] * 6))

    return setup_context, backward
