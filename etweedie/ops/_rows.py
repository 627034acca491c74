"""The canonical per-row form of the per-row ops (et_score, langevin_step, student_t_score).

Every public op accepts broadcastable inputs — y ``(*, d)``, x ``(*, N, d)``, β and λ as
floats or ``(*)`` tensors, a :class:`~etweedie.geometry.Metric` with an optional batch shape —
and a per-row op reduces them here to the canonical form the kernels take:

    y (B, d) contiguous     x (B, N, d), unit stride over d (broadcast dims keep stride 0)
    beta, lam (B,)          prec (B, *param), kind ∈ {0 isotropic, 1 diagonal, 2 block, 3 dense}

B is the product of the broadcast batch shape.  Broadcast inputs are expanded as views, so a
posterior cloud shared by all queries is never copied.  Kind 3 (dense) is whitened into kind 0
by :func:`~etweedie.ops._whiten.whiten_dense` on the kernel path; the reference uses the dense
precision directly.  The C++ front ops build the same form in one call
(:mod:`etweedie.ops._front`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..geometry import Metric
from ._args import (
    _KIND,
    as_param,
    broadcast_batch,
    check_beta,
    check_draws,
    check_finite,
    check_metric,
    check_positive,
    check_tensor,
    flat,
    prec_rows,
    precision_of,
)
from ._debug import _DEBUG


@dataclass
class RowArgs:
    """The validated arguments of a per-row op in their broadcastable shapes (nothing expanded):
    what both the Python canonical form (:func:`shape_rows`) and the C++ front ops
    (``torch.ops.etweedie.<op>``, :func:`~etweedie.ops._front.front`) start from."""
    y: torch.Tensor  # (*, d)
    x: torch.Tensor  # (*, N, d)
    beta: torch.Tensor  # broadcasts to batch
    lam: torch.Tensor  # broadcasts to batch
    prec: torch.Tensor  # (*metric_batch, *param) in y's dtype: the metric's precision parameter
    kind: int
    batch: torch.Size
    metric: Metric
    given_metric: Optional[Metric] = None  # as given (the range scan reads its cached smallest variance)

    # the validated call's interface to the call path (etweedie/ops/_call.py)
    device = property(lambda self: self.y.device)
    dtype = property(lambda self: self.y.dtype)
    data = property(lambda self: (self.y, self.x))
    inputs = property(lambda self: (self.y, self.x, self.beta, self.lam, self.metric))


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


def rows_args(op: str, y, x, beta, lam, metric) -> RowArgs:
    """Validate the arguments of a per-row op and resolve its broadcast batch.

    Every sampler step and training step pays this on the host, so the common case (one batch
    shape for y and x, parameters as numbers or 0-d tensors, a shared metric) reads each shape
    once and skips the general broadcast."""
    y = check_tensor(y, "y", op)
    x = check_draws(x, y, op)
    ys, xs = y.shape, x.shape
    if not ys:
        raise ValueError(f"{op}: y must have shape (*batch, d), got a 0-d tensor")
    if len(xs) < 2:
        raise ValueError(f"{op}: x must have shape (*batch, N, d), got shape {tuple(xs)}")
    if x.device != y.device:
        raise ValueError(f"{op}: x is on {x.device} but y is on {y.device}")
    d, N = ys[-1], xs[-2]
    if xs[-1] != d:
        raise ValueError(f"{op}: x must have shape (*batch, N, d={d}) to match y, got {tuple(xs)}")
    if d == 0:
        raise ValueError(f"{op}: the dimension d must be >= 1, got y of shape {tuple(ys)}")
    if N == 0:
        raise ValueError(f"{op}: x must hold at least one posterior draw (N >= 1), got shape {tuple(xs)}")
    beta_t = as_param(beta, "beta", op, y)
    lam_t = as_param(lam, "lam", op, y)
    if _DEBUG["on"]:
        check_finite(op, y=y, x=x)
    # a parameter given as a number was range-checked by as_param; a tensor's values are checked here
    if isinstance(beta, torch.Tensor):
        check_beta(beta_t, op)
    if isinstance(lam, torch.Tensor):
        check_positive(lam_t, "lam", op)
    given, metric = metric, check_metric(metric, d, y, op)
    yb, xb, mb = ys[:-1], xs[:-2], metric.batch_shape
    if yb == xb and not mb and not beta_t.dim() and not lam_t.dim():
        batch = yb  # nothing to broadcast
    else:
        batch = broadcast_batch(op, y=yb, x=xb, beta=beta_t.shape, lam=lam_t.shape, metric=mb)
    prec = metric.param if given is None else precision_of(metric, y.dtype, op)  # Σ = I: P = I, the same 1
    return RowArgs(y, x, beta_t, lam_t, prec, _KIND[metric.kind], batch, metric, given)


def shape_rows(a: RowArgs) -> Canonical:
    """The canonical form of validated arguments (what the C++ front ops build in one call)."""
    batch, d, N = a.batch, a.y.shape[-1], a.x.shape[-2]
    B = math.prod(batch)
    yc = a.y.expand(tuple(batch) + (d,)).reshape(B, d).contiguous()
    xc = a.x.expand(tuple(batch) + (N, d)).reshape(B, N, d)
    if d > 1 and xc.stride(-1) != 1:
        xc = xc.contiguous()
    prec = prec_rows(a.prec, len(a.metric.batch_shape), a.kind, batch)
    return Canonical(yc, xc, flat(a.beta, batch, ()), flat(a.lam, batch, ()), prec, a.kind, batch, a.metric)


def canonicalize(op: str, y, x, beta, lam, metric) -> Canonical:
    """Validate the arguments of a per-row op and bring them to the canonical form."""
    return shape_rows(rows_args(op, y, x, beta, lam, metric))


def take_rows(t: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows ``rows`` of a canonical (B, …) tensor (None: all, ``t`` itself); one broadcast over B
    (stride 0: a shared cloud, a scalar parameter) stays a broadcast instead of being copied once
    per row."""
    if rows is None:
        return t
    if t.shape[0] > 0 and t.stride(0) == 0:
        return t[:1].expand(rows.numel(), *t.shape[1:])
    return t[rows.to(t.device)]


def canonical_rows(c: Canonical, rows: torch.Tensor) -> Canonical:
    """The canonical form of the flat rows ``rows`` of ``c``; its ``metric`` stays the whole
    call's (a dense metric's whitening reads it: whiten the whole call, then take rows)."""
    return Canonical(take_rows(c.y, rows), take_rows(c.x, rows), take_rows(c.beta, rows), take_rows(c.lam, rows),
                     take_rows(c.prec, rows), c.kind, torch.Size([rows.numel()]), c.metric)


def join_rows(batch: torch.Size, rows: torch.Tensor, exact, rest) -> torch.Tensor:
    """The (*batch, d) output whose flat rows ``rows`` are ``exact(rows)`` and whose other rows are
    ``rest(others)``, both (n, d) for the flat indices given.  Each part runs its own autograd
    graph: a flagged row never enters the kernel's backward (its saved NaN mean would turn the
    zero gradient of a replaced row into NaN)."""
    B = math.prod(batch)
    keep = torch.ones(B, dtype=torch.bool)
    keep[rows.cpu()] = False
    others = keep.nonzero().squeeze(1)
    e = exact(rows)
    out = e.new_zeros(B, e.shape[-1]).index_put((rows.to(e.device),), e)
    if others.numel():
        out = out.index_put((others.to(e.device),), rest(others))
    return out.reshape(*batch, e.shape[-1])
