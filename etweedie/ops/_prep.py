"""Validation and canonical form shared by the per-row ops (et_score, langevin_step).

Every public op accepts broadcastable inputs — y ``(*, d)``, x ``(*, N, d)``, β and λ as
floats or ``(*)`` tensors, a :class:`~etweedie.metric.Metric` with an optional batch shape —
and reduces them here to the canonical form the kernels take:

    y (B, d) contiguous     x (B, N, d), unit stride over d (broadcast dims keep stride 0)
    beta, lam (B,)          prec (B, *param), kind ∈ {0 isotropic, 1 diagonal, 2 block, 3 dense}

B is the product of the broadcast batch shape.  Broadcast inputs are expanded as views, so a
posterior cloud shared by all queries is never copied.  Kind 3 (dense) is whitened into kind 0
by :func:`whiten_dense` on the kernel path; the reference uses the dense precision directly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..metric import Metric

ISOTROPIC, DIAGONAL, BLOCK, DENSE = 0, 1, 2, 3
_KIND = {"isotropic": ISOTROPIC, "diagonal": DIAGONAL, "block": BLOCK, "dense": DENSE}


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


# Debug checks (NaN/inf in the data) cost a full pass over x, so they are off by default.
_DEBUG = {"on": os.environ.get("ETWEEDIE_DEBUG", "0") not in ("", "0")}


def set_debug(enabled: bool) -> None:
    """Turn the ops' finiteness checks on or off (also: environment ETWEEDIE_DEBUG=1).

    With checks on, a NaN or infinity in y, x, a bank or a parameter raises ValueError naming
    the argument instead of propagating into the result.

    Range checks of β, λ and step given as plain numbers always run.  Given as tensors, their
    values are checked on CPU always, but on a GPU only with debug checks on: reading a GPU
    tensor's values stalls the host until the GPU catches up, which would cost every call a
    device synchronization (measured: ~0.45 ms a call on an H200, more than the kernels).
    """
    _DEBUG["on"] = bool(enabled)


def check_finite(op: str, **tensors) -> None:
    """ValueError naming the first non-finite argument (only when debug checks are on)."""
    if not _DEBUG["on"] or _is_compiling():
        return
    for name, t in tensors.items():
        if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{op}: {name} contains NaN or infinite values (debug checks are on)")


def check_tensor(t, name: str, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: {name} must be float32 or float64, got {t.dtype}")
    return t


# Range checks of plain numbers run always.  Checks that must read a tensor's values run on CPU
# tensors always, but on GPU tensors only with debug checks on (etweedie.set_debug): there each
# would stall the host until the GPU catches up, once per call.
_SCALAR_RULES = {
    "beta": (lambda v: 0 < v <= 2, "lie in (0, 2]"),
    "lam": (lambda v: v > 0, "be > 0"),
    "step": (lambda v: v > 0, "be > 0"),
    "c": (lambda v: v > 0, "be > 0"),
}


def value_checks(t: torch.Tensor) -> bool:
    """Whether value checks on ``t`` run now (CPU tensors, or any tensor with debug checks on)."""
    return not _is_compiling() and (t.device.type == "cpu" or _DEBUG["on"])


def as_param(value, name: str, op: str, like: torch.Tensor) -> torch.Tensor:
    """A per-row scalar parameter (β, λ, step) as a tensor of like's dtype and device.

    A plain number is range-checked here (rules in ``_SCALAR_RULES``) and becomes a 0-d tensor
    filled on the device (no host-to-device copy).
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{op}: {name} must be a float or a floating-point tensor, got dtype {value.dtype}")
        if value.device != like.device:
            raise ValueError(f"{op}: {name} is on {value.device} but y is on {like.device}")
        return value.to(like.dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float or a tensor, got {type(value).__name__}")
    rule = _SCALAR_RULES.get(name)
    if rule is not None and not rule[0](float(value)):
        raise ValueError(f"{op}: {name} must {rule[1]}, got {float(value):.6g}")
    return torch.full((), float(value), dtype=like.dtype, device=like.device)


def check_beta_lam(beta: torch.Tensor, lam: torch.Tensor, op: str) -> None:
    if not value_checks(beta):
        return
    if beta.numel() and not bool(((beta > 0) & (beta <= 2)).all()):
        bad = beta[~((beta > 0) & (beta <= 2))].flatten()[0].item()
        raise ValueError(f"{op}: beta must lie in (0, 2], got {bad:.6g}")
    if lam.numel() and not bool((lam > 0).all()):
        bad = lam[~(lam > 0)].flatten()[0].item()
        raise ValueError(f"{op}: lam must be > 0, got {bad:.6g}")


def check_metric(metric: Optional[Metric], d: int, like: torch.Tensor, op: str) -> Metric:
    if metric is None:
        return Metric("isotropic", torch.ones((), dtype=like.dtype, device=like.device))
    if not isinstance(metric, Metric):
        raise TypeError(f"{op}: metric must be an etweedie.Metric or None, got {type(metric).__name__}")
    if metric.param.device != like.device:
        # like torch's own ops: a CPU 0-d parameter (a metric built from a float) joins any device
        if metric.param.dim() != 0 or metric.param.device.type != "cpu":
            raise ValueError(f"{op}: metric is on {metric.param.device} but y is on {like.device}")
        metric = metric.to(like.device)
    metric.check_dim(d, f"{op}: metric")
    if metric.param.dtype != like.dtype:
        metric = metric.to(like.dtype)
    return metric


def broadcast_batch(op: str, **shapes) -> torch.Size:
    try:
        return torch.broadcast_shapes(*shapes.values())
    except RuntimeError:
        desc = ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"{op}: batch shapes do not broadcast: {desc}") from None


def flat(t: torch.Tensor, batch: torch.Size, core: Tuple[int, ...]) -> torch.Tensor:
    """Expand t to (*batch, *core) and flatten the batch (a view where strides allow)."""
    B = math.prod(batch)
    return t.expand(tuple(batch) + tuple(core)).reshape(B, *core)


def metric_param(metric: Metric, batch: torch.Size, d: int) -> Tuple[torch.Tensor, int]:
    """(prec, kind) with prec (B, *param): the precision parameter per row.

    A shared metric stays a stride-0 view over rows; the kernels need each row's block
    parameter contiguous, which this guarantees for every op.
    """
    kind = _KIND[metric.kind]
    p = metric.precision_param()
    core = tuple(p.shape[len(metric.batch_shape) :])
    prec = flat(p, batch, core)
    if kind == BLOCK and not prec.is_contiguous():
        prec = prec[:1].contiguous().expand_as(prec) if prec.stride(0) == 0 else prec.contiguous()
    return prec, kind


def row_whitening_factor(metric: Metric, batch: torch.Size) -> torch.Tensor:
    """L with P = L Lᵀ for a dense metric: (d, d) when shared, else (B, d, d) per row.

    Dense metrics reach the kernels whitened (z = Lᵀu, one GEMM) as unit isotropic metrics.
    """
    L = metric.whitening_factor()
    return L if len(metric.batch_shape) == 0 else flat(L, batch, tuple(L.shape[-2:]))


@dataclass
class Canonical:
    y: torch.Tensor  # (B, d)
    x: torch.Tensor  # (B, N, d)
    beta: torch.Tensor  # (B,)
    lam: torch.Tensor  # (B,)
    prec: torch.Tensor  # (B, *param)
    kind: int
    batch: torch.Size
    metric: Metric


def canonicalize(op: str, y, x, beta, lam, metric) -> Canonical:
    """Validate the arguments of a per-row op and bring them to the canonical form."""
    y = check_tensor(y, "y", op)
    x = check_tensor(x, "x", op)
    if y.dim() < 1:
        raise ValueError(f"{op}: y must have shape (*batch, d), got a 0-d tensor")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must have shape (*batch, N, d), got shape {tuple(x.shape)}")
    if x.dtype != y.dtype:
        raise TypeError(f"{op}: x must have y's dtype {y.dtype}, got {x.dtype}")
    if x.device != y.device:
        raise ValueError(f"{op}: x is on {x.device} but y is on {y.device}")
    d, N = y.shape[-1], x.shape[-2]
    if x.shape[-1] != d:
        raise ValueError(f"{op}: x must have shape (*batch, N, d={d}) to match y, got {tuple(x.shape)}")
    if d == 0:
        raise ValueError(f"{op}: the dimension d must be >= 1, got y of shape {tuple(y.shape)}")
    if N == 0:
        raise ValueError(f"{op}: x must hold at least one posterior draw (N >= 1), got shape {tuple(x.shape)}")
    beta = as_param(beta, "beta", op, y)
    lam = as_param(lam, "lam", op, y)
    check_finite(op, y=y, x=x)
    check_beta_lam(beta, lam, op)
    metric = check_metric(metric, d, y, op)
    batch = broadcast_batch(
        op, y=y.shape[:-1], x=x.shape[:-2], beta=beta.shape, lam=lam.shape, metric=metric.batch_shape
    )
    B = math.prod(batch)
    yc = y.expand(tuple(batch) + (d,)).reshape(B, d).contiguous()
    xc = x.expand(tuple(batch) + (N, d)).reshape(B, N, d)
    if d > 1 and xc.stride(-1) != 1:
        xc = xc.contiguous()
    prec, kind = metric_param(metric, batch, d)
    return Canonical(yc, xc, flat(beta, batch, ()), flat(lam, batch, ()), prec, kind, batch, metric)


def whiten_dense(c: Canonical) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a dense metric: (z_y, z_x, ones, L) with z = Lᵀu per row, P = L Lᵀ (one GEMM each).

    The kernels then run isotropically with unit precision; map a score back with ``s @ Lᵀ``.
    """
    Lb = row_whitening_factor(c.metric, c.batch)
    if Lb.dim() == 2:
        zy, zx = c.y @ Lb, c.x @ Lb
    else:
        zy = (c.y.unsqueeze(1) @ Lb).squeeze(1)
        zx = c.x @ Lb
    ones = torch.ones((), dtype=c.y.dtype, device=c.y.device).expand(c.y.shape[0])
    return zy.contiguous(), zx, ones, Lb


def unwhiten_score(s_iso: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """s = L s_iso per row (row-vector form s_iso @ Lᵀ)."""
    if L.dim() == 2:
        return s_iso @ L.transpose(-1, -2)
    return (s_iso.unsqueeze(1) @ L.transpose(-1, -2)).squeeze(1)


def pairwise_fake_fwd(X, Y, beta, prec, kind, flag):
    """Fake (meta) forward of a pairwise energy op, shared by every backend (C++ and Triton)."""
    return X.new_empty(X.shape[:1])


def pairwise_fake_bwd(grad, X, Y, beta, prec, kind, flag, need_x, need_y, need_beta, need_prec):
    """Fake (meta) backward of a pairwise energy op, shared by every backend."""
    empty = beta.new_empty(0)
    return (
        X.new_empty(X.shape) if need_x else empty,
        Y.new_empty(Y.shape) if need_y else empty,
        beta.new_empty(beta.shape) if need_beta else empty,
        prec.new_empty(prec.shape) if need_prec else empty,
    )


def pairwise_autograd_rules(bwd_op):
    """(setup_context, backward) of a pairwise energy ``<name>_fwd`` op whose fused backward is
    ``bwd_op`` — the C++ op (etweedie::) and the Triton op (etweedie_triton::) share them."""

    def setup_context(ctx, inputs, output):
        X, Y, beta, prec, kind, flag = inputs
        ctx.kind, ctx.flag = kind, flag
        ctx.save_for_backward(X, Y, beta, prec)

    def backward(ctx, grad):
        need = ctx.needs_input_grad[:4]
        grads = bwd_op(grad, *ctx.saved_tensors, ctx.kind, ctx.flag, *need)
        return (*(g if n else None for g, n in zip(grads, need)), None, None)

    return setup_context, backward


def register_pairwise_op(name: str, bwd_op) -> None:
    """Fake and autograd rules of a pairwise energy op ``etweedie::<name>_fwd``.

    energy_score and energy_distance share the schema shape
    ``fwd(X, Y, beta, prec, kind, flag) -> (B,)`` and
    ``bwd(grad, X, Y, beta, prec, kind, flag, need_X, need_Y, need_beta, need_prec) -> 4 grads``
    (an unrequested gradient is an empty tensor), so one definition serves both.
    """
    lib = f"etweedie::{name}"
    torch.library.register_fake(lib + "_fwd")(pairwise_fake_fwd)
    torch.library.register_fake(lib + "_bwd")(pairwise_fake_bwd)
    setup_context, backward = pairwise_autograd_rules(bwd_op)
    torch.library.register_autograd(lib + "_fwd", backward, setup_context=setup_context)
