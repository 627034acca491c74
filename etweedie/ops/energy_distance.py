"""energy_distance: the Mahalanobis energy distance between two point clouds (DESIGN §1).

    ED_{P,β}(a, b) = 2 E‖a − b‖_P^β − E‖a − a'‖_P^β − E‖b − b'‖_P^β

``unbiased=True`` (default): the signed U-statistic — within-cloud means over i ≠ j, so the
estimate is unbiased and can be slightly negative when the laws agree; ``unbiased=False``:
the V-statistic (means over all (i, j)), ≥ 0 for β ∈ (0, 2).  The compiled op
``etweedie::energy_distance_fwd`` forms pairs tile by tile (memory O((n + m)·d) for any n, m)
and has a fused backward for both clouds, β and the metric.  Coincident points contribute 0
and a zero gradient (see :mod:`etweedie.ops.energy_score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import backends
from ..geometry import Metric
from ..rules.common import DENSE
from . import reference
from ._args import (
    as_param,
    broadcast_batch,
    check_beta,
    check_metric,
    check_tensor,
    flat,
    metric_param,
    row_whitening_factor,
)
from ._call import OpSpec, call
from ._debug import check_finite, value_checks
from ._pairwise import register_pairwise_op
from ._range import nan_rows, scan
from ._ties import row_keys, tie_equal_rows, tie_to_rows
from ._whiten import centred_rows_matmul, dense_centre

__all__ = ["energy_distance"]

_OP = "energy_distance"


def energy_distance(
    a: torch.Tensor,
    b: torch.Tensor,
    beta=1.0,
    metric: Optional[Metric] = None,
    *,
    unbiased: bool = True,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Energy distance between the clouds ``a`` and ``b`` in the metric ‖·‖_P.

    Args:
        a: first cloud, ``(*batch, n, d)``, float32 or float64.
        b: second cloud, ``(*batch, m, d)``; batch dims broadcast with a's.
        beta: exponent β ∈ (0, 2], float or tensor broadcasting to ``batch``.
        metric: :class:`~etweedie.Metric` giving P = Σ⁻¹ (None: P = I); may carry a batch.
        unbiased: U-statistic (needs n, m ≥ 2) if True, V-statistic if False.
        backend: ``None`` (automatic), ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns:
        the distance per row, ``(*batch,)``.  With β = 2 and ``unbiased=False`` it equals
        2‖mean(a) − mean(b)‖²_P; a β of 2 given as a number (or a CPU tensor without a
        gradient) is computed in that closed form, O((n + m)·d), exact for equal clouds.

    Example::

        >>> a = torch.tensor([[0.0], [2.0]]); b = torch.tensor([[1.0], [3.0]])
        >>> etweedie.energy_distance(a, b)           # 2·(1+3+1+1)/4 − 2 − 2
        tensor(-1.)
    """
    return call(_SPEC, energy_distance, a, b, beta, metric, unbiased=unbiased, backend=backend)


@dataclass
class _Call:
    """A checked energy_distance call: the clouds in their canonical rows."""
    a: torch.Tensor  # as given (the NaN rows read it before broadcasting)
    b: torch.Tensor
    beta_arg: object  # β as given (a number: the β = 2 closed form needs no look at a tensor)
    beta: torch.Tensor  # broadcasts to batch
    metric: Metric
    given_metric: Optional[Metric]  # as given (the range scan reads its cached smallest variance)
    unbiased: bool
    batch: torch.Size
    ac: torch.Tensor  # (B, n, d)
    bc: torch.Tensor  # (B, m, d)
    betas: torch.Tensor  # (B,)

    device = property(lambda self: self.a.device)
    dtype = property(lambda self: self.a.dtype)
    data = property(lambda self: (self.a, self.b))
    inputs = property(lambda self: (self.a, self.b, self.beta, self.metric))


def _check(a, b, beta=1.0, metric=None, *, unbiased=True, backend=None) -> _Call:
    a = check_tensor(a, "a", _OP)
    b = check_tensor(b, "b", _OP)
    for name, t in (("a", a), ("b", b)):
        if t.dim() < 2:
            raise ValueError(f"{_OP}: {name} must have shape (*batch, points, d), got shape {tuple(t.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"{_OP}: b must have a's dtype {a.dtype}, got {b.dtype}")
    if b.device != a.device:
        raise ValueError(f"{_OP}: b is on {b.device} but a is on {a.device}")
    n, m, d = a.shape[-2], b.shape[-2], a.shape[-1]
    if b.shape[-1] != d:
        raise ValueError(f"{_OP}: b must have shape (*batch, m, d={d}) to match a, got {tuple(b.shape)}")
    if d == 0:
        raise ValueError(f"{_OP}: the dimension d must be >= 1, got a of shape {tuple(a.shape)}")
    if not isinstance(unbiased, bool):
        raise TypeError(f"{_OP}: unbiased must be a bool, got {type(unbiased).__name__}")
    need = 2 if unbiased else 1
    if n < need or m < need:
        raise ValueError(
            f"{_OP}: {'unbiased=True needs n >= 2 and m >= 2' if unbiased else 'both clouds need a point'}, "
            f"got n = {n}, m = {m}"
        )
    beta_t = as_param(beta, "beta", _OP, a)  # a plain number is range-checked here
    if isinstance(beta, torch.Tensor):
        check_beta(beta_t, _OP)
    check_finite(_OP, a=a, b=b)
    given_metric, metric = metric, check_metric(metric, d, a, _OP)
    batch = broadcast_batch(_OP, a=a.shape[:-2], b=b.shape[:-2], beta=beta_t.shape, metric=metric.batch_shape)
    B = math.prod(batch)
    ac = a.expand(*batch, n, d).reshape(B, n, d)
    bc = b.expand(*batch, m, d).reshape(B, m, d)
    if d > 1:
        ac = ac if ac.stride(-1) == 1 else ac.contiguous()
        bc = bc if bc.stride(-1) == 1 else bc.contiguous()
    return _Call(a, b, beta, beta_t, metric, given_metric, unbiased, batch, ac, bc, flat(beta_t, batch, ()))


def _run(name: str, c: _Call) -> Optional[torch.Tensor]:
    out_of_range, finite = scan(c.given_metric, c.a, c.b)
    if out_of_range:
        return None
    ac, bc, betas, unbiased = c.ac, c.bc, c.betas, c.unbiased
    prec, kind = metric_param(c.metric, c.batch, ac.shape[-1], ac.dtype, _OP)  # (in range: rounded to the data's dtype)
    if name == "reference":
        out = reference.energy_distance(ac, bc, betas, prec, kind, unbiased)
    elif _beta_is_two(c.beta_arg, c.beta):
        out = _beta2_closed_form(ac, bc, prec, kind, unbiased)
    elif kind == DENSE:
        out = _kernel(name, *_whitened(c), betas, torch.ones((), dtype=ac.dtype, device=ac.device).expand(ac.shape[0]),
                      0, unbiased)
    else:
        out = _kernel(name, ac, bc, betas, prec, kind, unbiased)
    if finite and value_checks(c.a):
        return out.reshape(c.batch)  # checked finite: no NaN rows to restore
    return nan_rows(out, c.batch, (c.a, 2), (c.b, 2)).reshape(c.batch)


def _whitened(c: _Call):
    """(z_a, z_b) for a dense metric: P = L Lᵀ, the isotropic kernel on z = Lᵀ(x − c), c a
    constant point of the row (whitened coordinates, and their rounding, at the clouds' spread:
    see whiten_dense).  Equal points whiten to equal z, within a cloud and across the two (a
    matrix product may round them differently: a spurious distance of 1e-7 relative in float32,
    1e-16 in float64, and at β < 1 a spurious gradient far above the true one; see _ties)."""
    ac, bc = c.ac, c.bc
    (B, n, d), m = ac.shape, bc.shape[1]
    Lb = row_whitening_factor(c.metric, c.batch, ac.dtype, _OP)
    centre = dense_centre(ac, ac[:, :1], Lb)
    if centre.shape[0] == 1 and B > 1 and bc.stride(0) != 0:
        # a shared cloud a (with its first point as the centre) stays a broadcast; b's points
        # equal to one of a's take its z
        za = centred_rows_matmul(ac, centre, Lb, tie=True)
        ub = bc.to(centre.dtype) - centre
        kb = row_keys(ub)  # (hashed once: for b's own ties and for b's ties to a)
        zb = tie_equal_rows(ub @ Lb, ub, kb)
        zb = tie_to_rows(zb.reshape(-1, d), ub.reshape(-1, d), za[0], ac[0].to(centre.dtype) - centre[0],
                         keys_q=kb.reshape(-1)).reshape(B, m, d)
        return za, zb
    if centre.shape[0] == 1 and B > 1:  # both clouds shared: one row's product, expanded
        za, zb = centred_rows_matmul(torch.cat([ac[:1], bc[:1]], dim=1), centre, Lb, tie=True).split([n, m], dim=1)
        return za.expand(B, n, d), zb.expand(B, m, d)
    return centred_rows_matmul(torch.cat([ac, bc], dim=1), centre, Lb, tie=True).split([n, m], dim=1)


def _beta_is_two(arg, beta: torch.Tensor) -> bool:
    """β = 2 in every row, known without a device sync and with no β gradient asked for: a
    plain number, or a CPU tensor (read here) that does not require a gradient."""
    if not isinstance(arg, torch.Tensor):
        return float(arg) == 2.0
    return (not beta.requires_grad and beta.numel() > 0 and value_checks(beta)
            and bool((beta == 2).all()))


def _beta2_closed_form(a, b, prec, kind, unbiased: bool) -> torch.Tensor:
    """ED at β = 2 from the clouds' means and spreads, O((n + m)·d) per row:

        V-statistic   2‖ā − b̄‖²_P
        U-statistic   2‖ā − b̄‖²_P − 2 tr(P S_a)/n − 2 tr(P S_b)/m     (S: unbiased covariances)

    since E‖a − b‖² = ‖ā − b̄‖² + tr(PΣ_a) + tr(PΣ_b) (Σ: the 1/n covariances) and the mean over
    i ≠ j of ‖a_i − a_j‖² is 2 tr(P S_a).  The pair sums cancel their terms (size ‖a − b‖²_P) down
    to the distance; this form does not, so equal clouds give exactly 0 whatever their size (a
    float32 call at 1e30 reruns in float64, where the pair sums' rounding, ~1e-16 of terms of
    1e60, is beyond float32's range).  Coordinates are whitened about a's first point
    (:func:`reference.whiten_centred`), so the means and spreads round at the clouds' spread."""
    n, m = a.shape[1], b.shape[1]
    za, zb = reference.whiten_centred(a, b, a[:, :1], prec, kind)
    ma, mb = za.mean(1, keepdim=True), zb.mean(1, keepdim=True)
    out = 2 * ((ma - mb) ** 2).sum((1, 2))
    if unbiased:
        out = out - 2 * ((za - ma) ** 2).sum((1, 2)) / (n * (n - 1)) - 2 * ((zb - mb) ** 2).sum((1, 2)) / (m * (m - 1))
    return out


def _kernel(name, a, b, beta, prec, kind, unbiased) -> torch.Tensor:
    """The compiled op ("cpu"/"cuda": the dispatcher picks the device's kernel) or the Triton op."""
    if name == "triton":
        from ..kernels.energy_distance import energy_distance_fwd_op  # imports triton: only when asked for

        return energy_distance_fwd_op(a, b, beta, prec, kind, unbiased)
    return torch.ops.etweedie.energy_distance_fwd(a, b, beta, prec, kind, unbiased)


# ---------------------------------------------------------------------------- registration

def _register() -> None:
    register_pairwise_op("energy_distance", torch.ops.etweedie.energy_distance_bwd)


_SPEC = OpSpec(_OP, ("a", "b", "beta", "metric"), _check, _run, data=("a", "b"), degree=lambda c: c.beta,
               forward_mode=False)

if backends._EXT_OK and backends._has_op("energy_distance_fwd", "CPU"):
    _register()
