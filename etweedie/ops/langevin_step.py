"""langevin_step: one unadjusted Langevin update driven by the Energy-Tweedie score.

    y' = y + α s(y) + sqrt(2α) ξ,      s = et_score(y, x, β, λ, metric),  ξ supplied

The compiled op ``etweedie::langevin_step_fwd`` computes the score and the update in one pass
over the draws.  Its backward reuses the fused et_score backward kernel with upstream α·g
(the update is linear in s), plus the direct terms for y, ξ and α.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..geometry import Metric, _functorch_wrapped
from ..rules.langevin_step import autograd_rules, fake_fwd
from . import reference
from ._prep import (
    DENSE,
    as_param,
    broadcast_batch,
    canonical_rows,
    dense_score,
    check_finite,
    check_positive,
    checked_cpu_param,
    check_tensor,
    flat,
    front,
    join_rows,
    kernel_or_reference,
    near_mode,
    plain_rows,
    range_guarded,
    rows_args,
    shape_rows,
    take_rows,
    widen,
    widen_metric,
)
from .et_score import _kernel as _score_kernel
from .et_score import et_score

__all__ = ["langevin_step"]


def langevin_step(
    y: torch.Tensor,
    x: torch.Tensor,
    noise: torch.Tensor,
    step,
    beta,
    lam=1.0,
    metric: Optional[Metric] = None,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """One Langevin step ``y + step·s(y) + sqrt(2·step)·noise`` with the fused score.

    Args:
        y: current states ``(*batch, d)``, float32 or float64 (the compute dtype).  The other
            arguments broadcast to y's batch but may not enlarge it (each state has its own noise).
        x: posterior draws at y, ``(*batch, N, d)``: y's dtype, or bfloat16 / float16 (read as
            stored, accumulated in y's dtype; see :func:`etweedie.et_score`).
        noise: standard normal ξ, shape and dtype of y (draw it with your own ``torch.Generator``).
        step: α > 0, float or tensor broadcasting to ``batch``.
        beta, lam, metric, backend: as in :func:`etweedie.et_score`.

    Returns:
        the next states, ``(*batch, d)``, in y's dtype.

    Example::

        >>> y = torch.zeros(1, 2); x = torch.ones(1, 4, 2); xi = torch.zeros(1, 2)
        >>> etweedie.langevin_step(y, x, xi, step=0.5, beta=2.0)   # y + α(mean x − y)
        tensor([[0.5000, 0.5000]])
    """
    op = "langevin_step"
    plain = plain_rows(op, y, x, beta, lam, metric, backend)
    if plain is not None and type(noise) is torch.Tensor and noise.shape == y.shape and noise.dtype is y.dtype \
            and noise.is_cpu and not _functorch_wrapped(noise):
        step_t = checked_cpu_param("step", step, y.dtype)  # a step that passed its rule before
        if step_t is not None:
            out, nonfinite = torch.ops.etweedie.langevin_step(y, x, noise, step_t, *plain)
            if not nonfinite:
                return out  # a flagged row: the general path below reruns the call (in float64 where needed)
    a = rows_args(op, y, x, beta, lam, metric)
    if a.batch != y.shape[:-1]:
        raise ValueError(f"{op}: x, beta, lam and metric must not enlarge y's batch {tuple(y.shape[:-1])} "
                         f"(they broadcast to {tuple(a.batch)}): the step updates y, and each state needs its own noise")
    noise = check_tensor(noise, "noise", op)
    if noise.shape != y.shape:
        raise ValueError(f"{op}: noise must have y's shape {tuple(y.shape)}, got {tuple(noise.shape)}")
    if noise.dtype != y.dtype or noise.device != y.device:
        raise TypeError(f"{op}: noise must match y's dtype/device ({y.dtype}, {y.device}), got ({noise.dtype}, {noise.device})")
    step_t = as_param(step, "step", op, y)
    if isinstance(step, torch.Tensor):  # a number was range-checked by as_param
        check_positive(step_t, "step", op)
    check_finite(op, noise=noise)
    batch = broadcast_batch(op, batch=a.batch, step=step_t.shape)
    if batch != a.batch:
        raise ValueError(f"{op}: step of shape {tuple(step_t.shape)} would enlarge the batch {tuple(a.batch)}")
    d = y.shape[-1]
    name = backends.resolve(op, y.device, backend)
    name = kernel_or_reference(op, name, backend, y, x, noise, step, beta, lam, metric)

    def run():  # (step, whether the CPU kernel wrote NaN/inf: known from the front op only)
        if front(op, name, a, noise, step_t):
            return torch.ops.etweedie.langevin_step(a.y, a.x, noise, step_t, a.beta, a.lam, a.prec, a.kind, a.batch)
        return python_form().reshape(*a.batch, d), None  # the front op returns (*batch, d) too

    def python_form(rows=None):  # rows: flat row indices, or None for all
        c = shape_rows(a)
        xi = flat(noise, c.batch, (d,)).contiguous()
        alpha = flat(step_t, c.batch, ())
        if name == "reference":
            return reference.langevin_step(c.y, c.x, xi, alpha, c.beta, c.lam, c.prec, c.kind, near_mode(c.y))
        if rows is not None:
            xi, alpha = take_rows(xi, rows), take_rows(alpha, rows)
        if c.kind == DENSE:  # the update lives in the original space: whitened score kernel, then the update
            s = dense_score(c, lambda zy, zx, ones, r: _score_kernel(name, zy, zx, take_rows(c.beta, r),
                                                                     take_rows(c.lam, r), ones, 0), rows)
            al = alpha.unsqueeze(-1)
            return take_rows(c.y, rows) + al * s + torch.sqrt(2 * al) * xi
        if rows is not None:
            c = canonical_rows(c, rows)
        return _kernel(name, c.y, c.x, xi, alpha, c.beta, c.lam, c.prec, c.kind)

    def near(rows):  # float64 rows with a draw nearer to y than the kernel's range: the exact reference form
        def exact(rows):
            c = canonical_rows(shape_rows(a), rows)
            xi, alpha = (take_rows(flat(t, a.batch, s), rows) for t, s in ((noise, (d,)), (step_t, ())))
            return reference.langevin_step(c.y, c.x, xi, alpha, c.beta, c.lam, c.prec, c.kind, "index")
        return join_rows(a.batch, rows, exact, python_form)

    out = range_guarded(op, name, metric, a.y, a.x, a.batch, run, near)
    if out is None:
        if y.dtype == torch.float64:  # beyond float64's range: the score on rescaled data, then the step
            s = et_score(y, x, beta, lam, metric, backend=backend)
            alpha = step_t.unsqueeze(-1)
            return y + alpha * s + torch.sqrt(2 * alpha) * noise
        return _widened(y, x, noise, step, beta, lam, metric, backend)
    return out


def _widened(y, x, noise, step, beta, lam, metric, backend) -> torch.Tensor:
    """The step in float64, rounded to float32."""
    return langevin_step(widen(y), widen(x), widen(noise), widen(step), widen(beta), widen(lam),
                         widen_metric(metric), backend=backend).float()


def _kernel(name, y, x, noise, step, beta, lam, prec, kind) -> torch.Tensor:
    if name == "triton":
        from ..kernels.langevin_step import langevin_step_op  # imports triton: only when asked for

        return langevin_step_op(y, x, noise, step, beta, lam, prec, kind)[0]
    return torch.ops.etweedie.langevin_step_fwd(y, x, noise, step, beta, lam, prec, kind)[0]


def _register() -> None:
    name = "etweedie::langevin_step_fwd"
    torch.library.register_fake(name)(fake_fwd)
    setup_context, backward = autograd_rules(torch.ops.etweedie.et_score_bwd)
    torch.library.register_autograd(name, backward, setup_context=setup_context)


if backends._EXT_OK:
    _register()
