"""Rules of the pairwise energy ops (energy_score, energy_distance), which share the schema

    <op>_fwd(X, Y, beta, prec, kind, flag) -> (B,)
    <op>_bwd(grad, X, Y, beta, prec, kind, flag, need_X, need_Y, need_beta, need_prec) -> 4 grads

(an unrequested gradient is an empty tensor), for the C++ ops and the Triton ops alike.
"""

from __future__ import annotations

import torch

from .common import first_order_only, op_name

__all__ = ["fake_fwd", "fake_bwd", "autograd_rules"]


def fake_fwd(X, Y, beta, prec, kind, flag):
    """Fake (meta) forward of a pairwise energy op."""
    return X.new_empty(X.shape[:1])


def fake_bwd(grad, X, Y, beta, prec, kind, flag, need_x, need_y, need_beta, need_prec):
    """Fake (meta) backward of a pairwise energy op."""
    empty = beta.new_empty(0)
    return (
        X.new_empty(X.shape) if need_x else empty,
        Y.new_empty(Y.shape) if need_y else empty,
        beta.new_empty(beta.shape) if need_beta else empty,
        prec.new_empty(prec.shape) if need_prec else empty,
    )


def autograd_rules(bwd_op):
    """(setup_context, backward) of a pairwise energy ``<op>_fwd`` whose fused backward is ``bwd_op``."""

    def setup_context(ctx, inputs, output):
        X, Y, beta, prec, kind, flag = inputs
        ctx.kind, ctx.flag = kind, flag
        ctx.save_for_backward(X, Y, beta, prec)

    def backward(ctx, grad):
        need = ctx.needs_input_grad[:4]
        saved = ctx.saved_tensors
        with torch.no_grad():
            grads = bwd_op(grad, *saved, ctx.kind, ctx.flag, *need)
        grads = first_order_only(op_name(bwd_op), tuple(g if n else None for g, n in zip(grads, need)), (grad, *saved))
        return (*grads, None, None)

    return setup_context, backward
