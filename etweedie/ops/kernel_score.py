"""kernel_score: the Student-t matched kernel score (the score field is student_t_score.py).

For Student-t noise q(u) ∝ (1 + ‖u‖_P²)^{−c} (paper Cor. student_t; c ∈ (d/2, ∞), ν = 2c − d)
the matched potential is E(u) = log(1 + ‖u‖_P²) and

    KS(x_{1..M}, y) = c · [ (1/M) Σ_i E(x_i − y) − 1/(2M(M−1)) Σ_{i≠j} E(x_i − x_j) ]

Pure PyTorch (the pair work is O(M²·d) per row, small next to the model that draws the
samples); it also takes any potential callable, differentiated by autograd — a generic, slow
path (it materializes all M² pair differences).  The matched score field
s(y) = −2c P (1/N) Σ_i (y − x_i)/(1 + ‖y − x_i‖_P²) is the fused op
:func:`etweedie.student_t_score` (etweedie/ops/student_t_score.py), re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch

from ..geometry import Metric
from . import reference
from ._args import as_param, broadcast_batch, check_metric, check_positive, check_tensor, flat, metric_param
from ._call import OpSpec, call
from ._debug import check_finite
from ._range import scan

from .student_t_score import student_t_score  # noqa: F401  (its former home; kept importable)

__all__ = ["kernel_score", "student_t_score"]


def kernel_score(
    samples: torch.Tensor,
    target: torch.Tensor,
    potential: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "student_t",
    metric: Optional[Metric] = None,
    *,
    c=1.0,
    fair: bool = True,
) -> torch.Tensor:
    """Kernel score c·[(1/M) Σ E(x_i − y) − 1/(2M(M−1)) Σ_{i≠j} E(x_i − x_j)] per row.

    Args:
        samples: ``(*batch, M, d)`` draws; target: ``(*batch, d)``.
        potential: ``"student_t"`` for E(u) = log(1 + ‖u‖_P²), or a callable taking whitened
            differences z ``(..., d)`` (‖z‖ = ‖u‖_P; z = u when metric is None) and returning
            E ``(...)`` — evaluated on all M² pairs and differentiated by autograd (slow).
        metric: :class:`~etweedie.Metric` (None: P = I).
        c: positive scale (float or tensor broadcasting to ``batch``); for the Student-t law
            the matched score carries c, the law's exponent.
        fair: unbiased pair term (M ≥ 2) or 1/(2M²) Σ_{i,j}.

    Returns:
        ``(*batch,)``.

    Example::

        >>> x = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]]); y = torch.tensor([[1.0, 0.0]])
        >>> etweedie.kernel_score(x, y)              # log 2 − 2 log 5 / 4
        tensor([-0.1116])
    """
    return call(_SPEC, kernel_score, samples, target, potential, metric, c=c, fair=fair)


@dataclass
class _Call:
    """A checked kernel_score call in its canonical rows."""
    data: Tuple[torch.Tensor, torch.Tensor]  # (samples, target) as given (the range scan reads them)
    xs: torch.Tensor  # (B, M, d)
    yt: torch.Tensor  # (B, d)
    potential: Union[str, Callable]
    c: torch.Tensor  # (B,)
    prec: torch.Tensor  # (B, *param)
    kind: int
    fair: bool
    out_shape: torch.Size
    given_metric: Optional[Metric]
    metric: Metric

    device = property(lambda self: self.xs.device)
    dtype = property(lambda self: self.xs.dtype)
    inputs = property(lambda self: (self.xs, self.yt, self.c, self.metric))


def _check(samples, target, potential="student_t", metric=None, *, c=1.0, fair=True) -> _Call:
    samples = check_tensor(samples, "samples", _OP)
    target = check_tensor(target, "target", _OP)
    if samples.dim() < 2 or target.dim() < 1 or target.shape[-1] != samples.shape[-1]:
        raise ValueError(
            f"{_OP}: samples must be (*batch, M, d) and target (*batch, d) with the same d, "
            f"got {tuple(samples.shape)} and {tuple(target.shape)}"
        )
    if target.dtype != samples.dtype:
        raise TypeError(f"{_OP}: target must have samples' dtype {samples.dtype}, got {target.dtype}")
    if target.device != samples.device:
        raise ValueError(f"{_OP}: target is on {target.device} but samples are on {samples.device}")
    M, d = samples.shape[-2], samples.shape[-1]
    if d == 0:
        raise ValueError(f"{_OP}: the dimension d must be >= 1, got samples of shape {tuple(samples.shape)}")
    if not isinstance(fair, bool):
        raise TypeError(f"{_OP}: fair must be a bool, got {type(fair).__name__}")
    if M < (2 if fair else 1):
        raise ValueError(f"{_OP}: {'fair=True needs M >= 2' if fair else 'need M >= 1'} samples, got M = {M}")
    if potential != "student_t" and not callable(potential):
        raise ValueError(f"{_OP}: potential must be 'student_t' or a callable, got {potential!r}")
    c = as_param(c, "c", _OP, samples)
    check_positive(c, "c", _OP)
    check_finite(_OP, samples=samples, target=target)
    given, checked = metric, check_metric(metric, d, samples, _OP)
    batch = broadcast_batch(_OP, samples=samples.shape[:-2], target=target.shape[:-1], c=c.shape,
                            metric=checked.batch_shape)
    out_shape = batch
    batch = batch if len(batch) else torch.Size([1])  # unbatched: one row (flat() needs a batch dim)
    B = math.prod(batch)
    xs = samples.expand(*batch, M, d).reshape(B, M, d)
    yt = target.expand(*batch, d).reshape(B, d)
    prec, kind = metric_param(checked, batch, d, samples.dtype, _OP)
    return _Call((samples, target), xs, yt, potential, flat(c, batch, ()), prec, kind, fair, out_shape, given, checked)


def _run(name: None, c: _Call) -> Optional[torch.Tensor]:
    if scan(c.given_metric, *c.data, finite=False)[0]:
        return None  # magnitudes that would overflow/underflow the squared norms
    xs, yt, M = c.xs, c.yt, c.xs.shape[1]
    if c.potential == "student_t":
        ks = reference.student_t_kernel_score(xs, yt, c.prec, c.kind, c.fair)
    else:
        zx, zy = reference.whiten_centred(xs, yt.unsqueeze(1), yt.unsqueeze(1), c.prec, c.kind)
        cross = c.potential(zx - zy).sum(1) / M
        within = c.potential(zx.unsqueeze(2) - zx.unsqueeze(1))
        within = (within * (1 - torch.eye(M, dtype=within.dtype, device=within.device))).sum((1, 2))
        ks = cross - within / (2 * M * (M - 1) if c.fair else 2 * M * M)
    return (c.c * ks).reshape(c.out_shape)


_OP = "kernel_score"
# pure PyTorch (no backends); not homogeneous (log(1 + ‖u‖²)): float64 data beyond its range are refused
_SPEC = OpSpec(_OP, ("samples", "target", "potential", "metric"), _check, _run, supported=None)
