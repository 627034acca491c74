"""is_score: the importance-sampling oracle for the noisy score and the posterior mean.

For additive generalized-Gaussian noise q and a clean bank x_1..x_M,

    w_j ∝ q(y − x_j),   s_ref(y) = Σ_j w_j ∇_y log q(y − x_j),   E[X | y] ≈ Σ_j w_j x_j,
    ESS = 1 / Σ_j w_j²,

self-normalized with an online log-sum-exp in one pass over the bank per query (the
``queries × bank`` weight matrix never exists).  It is the reference the learned scores are
scored against (paper §5.1: 160,000 clean points).  Not differentiable (an oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import backends
from ..geometry import Metric
from ..rules.common import DENSE
from . import reference
from ._args import check_beta_lam, check_metric, check_tensor, metric_param, row_whitening_factor
from ._call import OpSpec, call
from ._debug import check_finite
from ._range import scan
from ._ties import row_keys, tie_equal_rows, tie_to_rows

__all__ = ["is_score"]


def is_score(
    y: torch.Tensor, bank: torch.Tensor, noise_law, *, backend: Optional[str] = None, chunk: int = 256
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Self-normalized importance-sampling score, posterior mean and ESS.

    Args:
        y: noisy queries ``(*batch, d)``.
        bank: clean samples ``(M, d)``, M ≥ 1.
        noise_law: an :class:`etweedie.GeneralizedGaussian` (β, λ scalars; metric without batch).
        backend: as in :func:`etweedie.et_score`.
        chunk: queries per block in the reference backend (memory chunk·M·d).

    Returns:
        ``(score (*batch, d), posterior_mean (*batch, d), ess (*batch,))``.

    Example::

        >>> bank = torch.tensor([[-1.0], [1.0]])
        >>> s, mean, ess = etweedie.is_score(torch.zeros(1, 1), bank, etweedie.GeneralizedGaussian(2.0))
        >>> s.abs(), mean.abs(), ess               # symmetric bank: zero score (±0), mean 0, ESS 2
        (tensor([[0.]]), tensor([[0.]]), tensor([2.]))
    """
    return call(_SPEC, is_score, y, bank, noise_law, backend=backend, chunk=chunk)


@dataclass
class _Call:
    """A checked is_score call."""
    y: torch.Tensor  # (*batch, d)
    bank: torch.Tensor  # (M, d)
    beta: float
    lam: float
    metric: Metric  # without a batch
    given_metric: Optional[Metric]
    chunk: int

    device = property(lambda self: self.y.device)
    dtype = property(lambda self: self.y.dtype)
    data = property(lambda self: (self.y, self.bank))
    inputs = ()  # not differentiable (an oracle): no autodiff routing


def _check(y, bank, noise_law, *, backend=None, chunk=256) -> _Call:
    y = check_tensor(y, "y", _OP)
    bank = check_tensor(bank, "bank", _OP)
    if y.dim() < 1:
        raise ValueError(f"{_OP}: y must have shape (*batch, d), got a 0-d tensor")
    if bank.dim() != 2 or bank.shape[-1] != y.shape[-1]:
        raise ValueError(f"{_OP}: bank must have shape (M, d={y.shape[-1]}), got {tuple(bank.shape)}")
    if bank.shape[0] == 0:
        raise ValueError(f"{_OP}: bank must hold at least one clean point, got shape {tuple(bank.shape)}")
    if y.shape[-1] == 0:
        raise ValueError(f"{_OP}: the dimension d must be >= 1, got y of shape {tuple(y.shape)}")
    if bank.dtype != y.dtype:
        raise TypeError(f"{_OP}: bank must have y's dtype {y.dtype}, got {bank.dtype}")
    if bank.device != y.device:
        raise ValueError(f"{_OP}: bank is on {bank.device} but y is on {y.device}")
    check_finite(_OP, y=y, bank=bank)
    for attr in ("beta", "lam", "metric"):
        if not hasattr(noise_law, attr):
            raise TypeError(f"{_OP}: noise_law must be a GeneralizedGaussian (with beta, lam, metric), got {type(noise_law).__name__}")
    beta = torch.as_tensor(noise_law.beta, dtype=torch.float64)
    lam = torch.as_tensor(noise_law.lam, dtype=torch.float64)
    if beta.numel() != 1 or lam.numel() != 1:
        raise ValueError(f"{_OP}: noise_law must have scalar beta and lam (one law for the bank), got shapes {tuple(beta.shape)}, {tuple(lam.shape)}")
    check_beta_lam(beta, lam, _OP)
    metric = check_metric(noise_law.metric, y.shape[-1], y, _OP)
    if len(metric.batch_shape):
        raise ValueError(f"{_OP}: noise_law.metric must not have a batch shape, got {tuple(metric.batch_shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{_OP}: chunk must be a positive int, got {chunk!r}")
    return _Call(y, bank, float(beta), float(lam), metric, noise_law.metric, chunk)


@torch.no_grad()
def _run(name: str, c: _Call):
    """(score, posterior mean, ESS), or None when the data leave their dtype's range."""
    y, bank, b, l = c.y, c.bank, c.beta, c.lam
    if scan(c.given_metric, y, bank, finite=False)[0]:
        return None  # magnitudes that would overflow/underflow the squared norms
    d = y.shape[-1]
    batch = y.shape[:-1]
    yq = y.reshape(-1, d).contiguous()
    prec, kind = metric_param(c.metric, torch.Size([1]), d, y.dtype, _OP)
    if name == "reference":
        score, mean, ess = reference.is_score(yq, bank, b, l, prec, kind, chunk=c.chunk)
    elif kind == DENSE:
        # z = Lᵀ(u − c) with c the bank's mean: whitened coordinates, and their rounding, at
        # the bank's spread rather than its distance from the origin (the weights see
        # y − x_j only; the mean is shifted back by c, which near the origin is ≈ 0)
        L = row_whitening_factor(c.metric, torch.Size([1]), y.dtype, _OP)
        centre = bank.mean(0, keepdim=True)
        ones = torch.ones(1, dtype=y.dtype, device=y.device)
        # equal bank points take one z, and a query equal to a bank point takes that z: a matrix
        # product may round equal rows differently (even within one product; see _ties), and at
        # β < 2 the spurious distance's term ‖u‖^{β−2}u is far above the score
        uq, ub = yq - centre, bank - centre
        kb = row_keys(ub)  # (the bank hashed once: for its own ties and for the queries')
        zb = tie_equal_rows((ub @ L).unsqueeze(0), ub.unsqueeze(0), kb.unsqueeze(0)).squeeze(0)
        zq = tie_to_rows(uq @ L, uq, zb, ub, keys_r=kb)
        zs, zmean, ess = _kernel(name, zq.contiguous(), zb.contiguous(), b, l, ones, 0)
        score = zs @ L.T
        mean = torch.linalg.solve_triangular(L.T, zmean.T, upper=True).T + centre
    else:
        score, mean, ess = _kernel(name, yq, bank.contiguous(), b, l, prec.contiguous(), kind)
    # a NaN/inf query (or bank point) makes every weight of its row undefined: NaN out, not an
    # ESS computed from whatever the log-sum-exp made of it
    bad = ~torch.isfinite(yq).all(-1) | ~torch.isfinite(bank).all()
    nan = torch.full((), float("nan"), dtype=score.dtype, device=score.device)
    score, mean = (torch.where(bad.unsqueeze(-1), nan, t) for t in (score, mean))
    ess = torch.where(bad, nan, ess)
    return score.reshape(*batch, d), mean.reshape(*batch, d), ess.reshape(batch)


def _kernel(name, y, bank, beta: float, lam: float, prec, kind):
    if name == "triton":
        from ..kernels.is_score import is_score_op  # imports triton: only when asked for

        return is_score_op(y, bank, beta, lam, prec, kind)
    return torch.ops.etweedie.is_score_fwd(y, bank, beta, lam, prec, kind)


def _register() -> None:
    @torch.library.register_fake("etweedie::is_score_fwd")
    def _(y, bank, beta, lam, prec, kind):
        return y.new_empty(y.shape), y.new_empty(y.shape), y.new_empty(y.shape[:1])


_OP = "is_score"
# not homogeneous in the data alone (the law's scale would have to move with them): float64
# data beyond float64's range are refused
_SPEC = OpSpec(_OP, ("y", "bank", "noise_law"), _check, _run)

if backends._EXT_OK:
    _register()
