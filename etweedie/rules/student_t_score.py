"""Rules of ``student_t_score_fwd(y, x, c, prec, kind) -> (s, m)`` and its fused backward
``student_t_score_bwd(grad, grad_m, y, x, c, prec, kind, m, need_y, need_x, need_c, need_prec)``,
shared by the C++ op and the Triton op."""

from __future__ import annotations

import torch

from .common import first_order_only

__all__ = ["fake_fwd", "fake_bwd", "autograd_rules"]


def fake_fwd(y, x, c, prec, kind):
    """Fake (meta) forward -> (s, m), both shaped like y."""
    return y.new_empty(y.shape), y.new_empty(y.shape)


def fake_bwd(grad, grad_m, y, x, c, prec, kind, m, need_y, need_x, need_c, need_prec):
    """Fake (meta) backward: each gradient shaped like its input, empty if not needed."""
    empty = y.new_empty(0)
    return (
        y.new_empty(y.shape) if need_y else empty,
        x.new_empty(x.shape) if need_x else empty,
        c.new_empty(c.shape) if need_c else empty,
        prec.new_empty(prec.shape) if need_prec else empty,
    )


def autograd_rules(bwd_op):
    """(setup_context, backward) for a student_t_score_fwd op whose fused backward is ``bwd_op``.
    Second-order gradients are not implemented: a second backward through the fused backward
    raises (first_order_only) instead of silently dropping the terms that pass through it."""

    def setup_context(ctx, inputs, output):
        y, x, c, prec, kind = inputs
        ctx.kind = kind
        ctx.save_for_backward(y, x, c, prec, output[1])

    def backward(ctx, grad_s, grad_m):
        y, x, c, prec, m = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_s = torch.zeros_like(y) if grad_s is None else grad_s
        grad_m = torch.zeros_like(y) if grad_m is None else grad_m
        with torch.no_grad():
            grads = bwd_op(grad_s, grad_m, y, x, c, prec, ctx.kind, m, *need[:4])
        grads = tuple(g if n else None for g, n in zip(grads, need[:4]))
        return (*first_order_only("student_t_score", grads, (grad_s, grad_m, *ctx.saved_tensors)), None)

    return setup_context, backward
