"""langevin_step: one unadjusted Langevin update driven by the Energy-Tweedie score.

    y' = y + α s(y) + sqrt(2α) ξ,      s = et_score(y, x, β, λ, metric),  ξ supplied

The compiled op ``etweedie::langevin_step_fwd`` computes the score and the update in one pass
over the draws.  Its backward reuses the fused et_score backward kernel with upstream α·g
(the update is linear in s), plus the direct terms for y, ξ and α.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import backends
from ..geometry import Metric, _functorch_wrapped
from ..rules.common import DENSE
from ..rules.langevin_step import autograd_rules, fake_fwd
from . import reference
from ._args import as_param, broadcast_batch, check_positive, check_tensor, checked_cpu_param, flat
from ._call import OpSpec, call
from ._debug import check_finite, near_mode
from ._front import front, plain_rows
from ._range import range_guarded
from ._rows import RowArgs, canonical_rows, join_rows, rows_args, shape_rows, take_rows
from ._whiten import dense_score
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
    return call(_SPEC, langevin_step, y, x, noise, step, beta, lam, metric, backend=backend)


def _plain(y, x, noise, step, beta, lam=1.0, metric=None, *, backend=None) -> Optional[torch.Tensor]:
    """The plain CPU call (:func:`~etweedie.ops._front.plain_rows`, plain noise, a step that passed
    its rule before) straight to the C++ front op, or None; also None for a flagged row: the
    general path reruns the call (in float64 where needed)."""
    plain = plain_rows(_OP, y, x, beta, lam, metric, backend)
    if plain is None or type(noise) is not torch.Tensor or noise.shape != y.shape or noise.dtype is not y.dtype \
            or not noise.is_cpu or _functorch_wrapped(noise):
        return None
    step_t = checked_cpu_param("step", step, y.dtype)
    if step_t is None:
        return None
    out, nonfinite = torch.ops.etweedie.langevin_step(y, x, noise, step_t, *plain)
    return None if nonfinite else out


@dataclass
class _Call:
    """A checked langevin_step call: the score's arguments, the noise and the step."""
    a: RowArgs
    noise: torch.Tensor  # y's shape
    step: torch.Tensor  # broadcasts to batch

    device = property(lambda self: self.a.device)
    dtype = property(lambda self: self.a.dtype)
    metric = property(lambda self: self.a.metric)
    data = property(lambda self: self.a.data)
    inputs = property(lambda self: (*self.a.inputs, self.noise, self.step))


def _check(y, x, noise, step, beta, lam=1.0, metric=None, *, backend=None) -> _Call:
    a = rows_args(_OP, y, x, beta, lam, metric)
    if a.batch != y.shape[:-1]:
        raise ValueError(f"{_OP}: x, beta, lam and metric must not enlarge y's batch {tuple(y.shape[:-1])} "
                         f"(they broadcast to {tuple(a.batch)}): the step updates y, and each state needs its own noise")
    noise = check_tensor(noise, "noise", _OP)
    if noise.shape != y.shape:
        raise ValueError(f"{_OP}: noise must have y's shape {tuple(y.shape)}, got {tuple(noise.shape)}")
    if noise.dtype != y.dtype or noise.device != y.device:
        raise TypeError(f"{_OP}: noise must match y's dtype/device ({y.dtype}, {y.device}), got ({noise.dtype}, {noise.device})")
    step_t = as_param(step, "step", _OP, y)
    if isinstance(step, torch.Tensor):  # a number was range-checked by as_param
        check_positive(step_t, "step", _OP)
    check_finite(_OP, noise=noise)
    batch = broadcast_batch(_OP, batch=a.batch, step=step_t.shape)
    if batch != a.batch:
        raise ValueError(f"{_OP}: step of shape {tuple(step_t.shape)} would enlarge the batch {tuple(a.batch)}")
    return _Call(a, noise, step_t)


def _run(name: str, c: _Call) -> Optional[torch.Tensor]:
    """The step under the range and NaN rules (:func:`~etweedie.ops._range.range_guarded`), or None."""
    a = c.a

    def run():  # (step, whether the CPU kernel wrote NaN/inf: known from the front op only)
        if front(_OP, name, a, c.noise, c.step):
            return torch.ops.etweedie.langevin_step(a.y, a.x, c.noise, c.step, a.beta, a.lam, a.prec, a.kind, a.batch)
        return _python_form(name, c).reshape(*a.batch, a.y.shape[-1]), None  # the front op returns (*batch, d) too

    return range_guarded(_OP, name, a.given_metric, a.y, a.x, a.batch, run, lambda rows: _near(name, c, rows))


def _python_form(name: str, c: _Call, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next states of the flat rows ``rows`` (None: all) from the canonical form."""
    cn = shape_rows(c.a)
    d = cn.y.shape[-1]
    xi = flat(c.noise, cn.batch, (d,)).contiguous()
    alpha = flat(c.step, cn.batch, ())
    if name == "reference":
        return reference.langevin_step(cn.y, cn.x, xi, alpha, cn.beta, cn.lam, cn.prec, cn.kind, near_mode(cn.y))
    if rows is not None:
        xi, alpha = take_rows(xi, rows), take_rows(alpha, rows)
    if cn.kind == DENSE:  # the update lives in the original space: whitened score kernel, then the update
        s = dense_score(cn, lambda zy, zx, ones, r: _score_kernel(name, zy, zx, take_rows(cn.beta, r),
                                                                  take_rows(cn.lam, r), ones, 0), rows)
        al = alpha.unsqueeze(-1)
        return take_rows(cn.y, rows) + al * s + torch.sqrt(2 * al) * xi
    if rows is not None:
        cn = canonical_rows(cn, rows)
    return _kernel(name, cn.y, cn.x, xi, alpha, cn.beta, cn.lam, cn.prec, cn.kind)


def _near(name: str, c: _Call, rows: torch.Tensor) -> torch.Tensor:
    """float64 rows with a draw nearer to y than the kernel's range on the reference's exact form."""
    def exact(rows):
        cn = canonical_rows(shape_rows(c.a), rows)
        xi, alpha = (take_rows(flat(t, c.a.batch, s), rows) for t, s in ((c.noise, (cn.y.shape[-1],)), (c.step, ())))
        return reference.langevin_step(cn.y, cn.x, xi, alpha, cn.beta, cn.lam, cn.prec, cn.kind, "index")
    return join_rows(c.a.batch, rows, exact, lambda others: _python_form(name, c, others))


def _beyond_float64(given: dict, c: _Call) -> torch.Tensor:
    """Beyond float64's range the step is not homogeneous, but its score is: the score on
    rescaled data (:func:`et_score`), then the update."""
    s = et_score(given["y"], given["x"], given["beta"], given.get("lam", 1.0), given.get("metric"),
                 backend=given.get("backend"))
    alpha = c.step.unsqueeze(-1)
    return given["y"] + alpha * s + torch.sqrt(2 * alpha) * c.noise


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


_OP = "langevin_step"
_SPEC = OpSpec(_OP, ("y", "x", "noise", "step", "beta", "lam", "metric"), _check, _run,
               beyond_float64=_beyond_float64, plain=_plain)

if backends._EXT_OK:
    _register()
