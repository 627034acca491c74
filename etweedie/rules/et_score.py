"""Rules of ``et_score_fwd(y, x, beta, lam, prec, kind) -> (s, m)`` and its fused backward
``et_score_bwd(grad, grad_m, y, x, beta, lam, prec, kind, m, need_y, need_x, need_beta, need_lam,
need_prec) -> 5 grads``, shared by the C++ op (etweedie::) and the Triton op (etweedie_triton::)."""

from __future__ import annotations

import torch

from .common import first_order_only

__all__ = ["fake_fwd", "fake_bwd", "autograd_rules"]


def fake_fwd(y, x, beta, lam, prec, kind):
    """Fake (meta) forward: the score s and the weighted mean residual m, both shaped like y."""
    return y.new_empty(y.shape), y.new_empty(y.shape)


def fake_bwd(grad, grad_m, y, x, beta, lam, prec, kind, m, need_y, need_x, need_beta, need_lam, need_prec):
    """Fake (meta) backward: each gradient shaped (and typed) like its input, empty if not needed."""
    empty = y.new_empty(0)
    return (
        y.new_empty(y.shape) if need_y else empty,
        x.new_empty(x.shape) if need_x else empty,
        beta.new_empty(beta.shape) if need_beta else empty,
        lam.new_empty(lam.shape) if need_lam else empty,
        prec.new_empty(prec.shape) if need_prec else empty,
    )


def autograd_rules(bwd_op):
    """(setup_context, backward) for an et_score_fwd op whose fused backward is ``bwd_op``: both
    backends save the canonical inputs and m, and run their own backward kernel on demand."""

    def setup_context(ctx, inputs, output):
        y, x, beta, lam, prec, kind = inputs
        ctx.kind = kind
        ctx.save_for_backward(y, x, beta, lam, prec, output[1])

    def backward(ctx, grad_s, grad_m):
        saved = ctx.saved_tensors
        y, x, beta, lam, prec, m = saved
        need = ctx.needs_input_grad
        grad_s = torch.zeros_like(y) if grad_s is None else grad_s
        grad_m = torch.zeros_like(y) if grad_m is None else grad_m
        with torch.no_grad():
            grads = bwd_op(grad_s, grad_m, y, x, beta, lam, prec, ctx.kind, m, *need[:5])
        grads = tuple(g if n else None for g, n in zip(grads, need[:5]))
        return (*first_order_only("et_score", grads, (grad_s, grad_m, *saved)), None)

    return setup_context, backward
