"""What every op's rules share: the canonical metric kinds, P·v on the canonical precision
parameter, and the guard that makes a second derivative through a fused backward raise.

The canonical per-row form (see :mod:`etweedie.ops._rows`) describes the metric by a kind and a
precision parameter ``prec`` of shape ``(B, *param)``:

    kind 0 isotropic  prec (B,)          kind 2 block  prec (B, k, k)   (P = I_{d/k} ⊗ prec)
    kind 1 diagonal   prec (B, d)        kind 3 dense  prec (B, d, d)
"""

from __future__ import annotations

import torch

ISOTROPIC, DIAGONAL, BLOCK, DENSE = 0, 1, 2, 3

__all__ = ["ISOTROPIC", "DIAGONAL", "BLOCK", "DENSE", "apply_precision", "first_order_only", "op_name"]


def apply_precision(prec: torch.Tensor, kind: int, v: torch.Tensor) -> torch.Tensor:
    """P v per row for v of shape (B, ..., d) and prec (B, *param); (P v)_a = Σ_b P_ab v_b."""
    B = prec.shape[0]
    extra = v.dim() - 2  # dims between the row and d
    if kind == ISOTROPIC:
        return prec.reshape(B, *([1] * (extra + 1))) * v
    if kind == DIAGONAL:
        return prec.reshape(B, *([1] * extra), prec.shape[-1]) * v
    if kind == BLOCK:
        k = prec.shape[-1]
        vb = v.reshape(*v.shape[:-1], v.shape[-1] // k, k)
        Pt = prec.transpose(-1, -2).reshape(B, *([1] * (extra + 1)), k, k)
        return (vb.unsqueeze(-2) @ Pt).squeeze(-2).reshape(v.shape)
    if kind == DENSE:
        Pt = prec.transpose(-1, -2).reshape(B, *([1] * extra), *prec.shape[-2:])
        return (v.unsqueeze(-2) @ Pt).squeeze(-2)
    raise ValueError(f"kind must be 0..3, got {kind}")


# ---------------------------------------------------------------------------- autodiff orders
#
# The compiled ops (C++ and Triton) have fused first-order backward kernels only.  A second
# backward through them would silently return zeros; the node below makes it raise instead.
# (Forward mode is refused at the op's entry: etweedie.ops._call.kernel_or_reference.)


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on the gradients a fused backward kernel returned, tied to the op's inputs so
    that differentiating those gradients again (Hessian-vector products, gradient penalties)
    raises instead of silently returning zeros."""

    @staticmethod
    def forward(ctx, op: str, n: int, *tensors):
        ctx.op = op
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.op}: second-order derivatives are not supported by the compiled backends (their "
            f"backward is a fused first-order kernel); use backend='reference' for double backward"
        )


def first_order_only(op: str, grads, inputs):
    """``grads`` unchanged, unless a graph of the backward is being built (create_graph=True):
    then each gradient comes out of a node whose own backward raises (see _FirstOrderOnly)."""
    if not torch.is_grad_enabled():
        return grads
    live = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    idx = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not live or not idx:
        return grads
    wrapped = _FirstOrderOnly.apply(op, len(idx), *[grads[i] for i in idx], *live)
    out = list(grads)
    for i, w in zip(idx, wrapped):
        out[i] = w
    return tuple(out)


def op_name(op) -> str:
    """'energy_score' for torch.ops.etweedie.energy_score_bwd (or a Triton op of that stem)."""
    name = getattr(op, "__name__", None) or str(op)
    return name.split("::")[-1].split(".")[0].removesuffix("_bwd").removesuffix("_op")
