"""Noise laws: generalized-Gaussian, Laplace and Student-t, and the five-parameter tuple.

The additive noise ``u = y − x`` of the paper (DESIGN §2), all with geometry ``P = Σ⁻¹`` from an
:class:`etweedie.geometry.Metric` (``metric=None`` means Σ = I):

==========================  ======================================  ===========================
law                         density q(u) ∝                          parameters
==========================  ======================================  ===========================
``GeneralizedGaussian``     exp(−(λ/β) ‖u‖_P^β)                     β ∈ (0, 2], λ > 0
``Laplace``                 exp(−λ ‖u‖_P)                           β = 1
``StudentT``                (1 + ‖u‖²_P)^{−c}                       c > d/2, ν = 2c − d
==========================  ======================================  ===========================

Every law has a batch shape (parameters given as tensors, one value per row, broadcast with
the metric's batch shape; DESIGN §2) and follows the ``torch.distributions`` layout: ``sample``
returns ``(*sample_shape, *batch, d)`` and ``log_prob``/``potential``/``score`` take
``u: (..., d)`` whose leading dims end with (a shape broadcastable to) the batch shape.
Randomness comes only from the ``generator=`` argument.  Everything is differentiable in
``u`` and in the parameters; ``score`` and ``potential`` are finite at ``u = 0``.  Norms are
taken on ``u`` scaled by its largest entry, so float32 stays right for ``|u|`` from 1e-30 to
1e30; a NaN coordinate gives NaN, an infinite one an infinite potential.  The lgamma-based
constants (log Z, Cov, the RMS) are evaluated in float64 and rounded once.

:class:`NoiseParams` is the tuple ``(β, λ, σ, u, v)`` with ``Σ = (σ/c_{β,d})² (I_{d/2} ⊗ S(u,v))``
(per-coordinate RMS ``σ λ^{−1/β}``) and the conditioning vector ``η = (β, log λ, log σ, u, v)``.

Example::

    >>> import torch
    >>> from etweedie.noise import NoiseParams
    >>> p = NoiseParams(beta=1.4, lam=1.8, sigma=0.57, u=0.0, v=0.6)
    >>> noise = p.noise(2)
    >>> x = noise.sample((100000,), generator=torch.Generator().manual_seed(0))
    >>> x.shape, round(float(p.realized_rms()), 4), round(float(x.pow(2).mean().sqrt()), 4)
    (torch.Size([100000, 2]), 0.3746, 0.3732)
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ._checks import check_generator
from .geometry import Metric, _as_float_tensor, _lgamma_drop

__all__ = ["GeneralizedGaussian", "Laplace", "StudentT", "NoiseParams"]

Scalar = Union[float, torch.Tensor]


# ---------------------------------------------------------------------------- helpers
def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_metric(metric) -> Optional[Metric]:
    if metric is not None and not isinstance(metric, Metric):
        raise TypeError(f"metric must be an etweedie.geometry.Metric or None, got {type(metric).__name__}")
    return metric


def _check_dim_arg(dim, name: str = "dim") -> Optional[int]:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be a positive int or None, got {type(dim).__name__}")
    if dim < 1:
        raise ValueError(f"{name} must be a positive int, got {dim}")
    return dim


def _sample_shape(sample_shape) -> torch.Size:
    if isinstance(sample_shape, int) and not isinstance(sample_shape, bool):
        sample_shape = (sample_shape,)
    try:
        shape = torch.Size(sample_shape)
    except TypeError:
        raise TypeError(f"sample_shape must be a tuple of ints, got {sample_shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"sample_shape must have non-negative sizes, got {tuple(shape)}")
    return shape


def _reference(metric: Optional[Metric], *values) -> Optional[torch.Tensor]:
    """The tensor whose dtype/device floats are converted to: the metric's, else the first tensor."""
    if metric is not None:
        return metric.param
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    return None


def _check_devices(named: dict) -> None:
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all parameters must be on one device, got {listing}")


def _broadcast_batch(named_shapes: dict) -> torch.Size:
    try:
        return torch.broadcast_shapes(*named_shapes.values())
    except RuntimeError:
        listing = ", ".join(f"{n} {tuple(s)}" for n, s in named_shapes.items())
        raise ValueError(f"parameter batch shapes must broadcast together, got {listing}") from None


def _check_beta(beta: torch.Tensor) -> None:
    if not _is_compiling() and beta.numel() and not bool(((beta > 0) & (beta <= 2)).all()):
        raise ValueError(
            f"beta must lie in (0, 2], got values in [{beta.min().item():.4g}, {beta.max().item():.4g}]"
        )


def _check_law_dtype(named: dict) -> None:
    """float32 or float64 parameters: sampling draws gamma variates, which torch has no 16-bit form of."""
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64 for a noise law, got {t.dtype}")


def _check_positive(value: torch.Tensor, name: str) -> None:
    if not _is_compiling() and value.numel():
        ok = (value > 0) & torch.isfinite(value)
        if not bool(ok.all()):
            raise ValueError(f"{name} must be > 0 and finite, got {value.detach()[~ok].flatten()[0].item():.4g}")


def _norm_power(x: torch.Tensor, power) -> torch.Tensor:
    """x^power for a norm x ≥ 0, 0 at x = 0 (or a rounding below it) with finite gradients (no
    0·inf = NaN); a NaN x stays NaN (a NaN input is not the mode)."""
    at_zero = x <= 0  # False for NaN
    x_safe = torch.where(at_zero, torch.ones_like(x), x)
    return torch.where(at_zero, torch.zeros_like(x_safe), x_safe**power)


class _MetricNoise:
    """Shared geometry plumbing: the metric (None = identity), the dimension, the batch shape."""

    metric: Optional[Metric]
    dim: Optional[int]

    def _init_geometry(self, metric, dim) -> None:
        self.metric = _check_metric(metric)
        dim = _check_dim_arg(dim)
        fixed = metric.dim if metric is not None else None
        if fixed is not None and dim is not None and fixed != dim:
            raise ValueError(f"dim must match the metric's dimension {fixed}, got dim={dim}")
        if metric is not None and dim is not None:
            metric.check_dim(dim, "metric")
        self.dim = fixed if fixed is not None else dim

    def _resolve_dim(self, dim=None) -> int:
        """d for sample/covariance: the argument, else the one fixed at construction."""
        dim = _check_dim_arg(dim)
        if dim is None:
            if self.dim is None:
                raise ValueError(
                    "dim is needed: the metric does not fix the dimension d, so pass dim= here or at construction"
                )
            return self.dim
        if self.dim is not None and dim != self.dim:
            raise ValueError(f"dim must match this noise's dimension {self.dim}, got dim={dim}")
        if self.metric is not None:
            self.metric.check_dim(dim, "metric")
        return dim

    def _check_input(self, u) -> int:
        if not isinstance(u, torch.Tensor) or not u.is_floating_point():
            got = u.dtype if isinstance(u, torch.Tensor) else type(u).__name__
            raise TypeError(f"u must be a floating-point tensor of shape (..., d), got {got}")
        if u.dim() < 1:
            raise ValueError("u must have shape (..., d), got a 0-d tensor")
        d = u.shape[-1]
        if self.dim is not None and d != self.dim:
            raise ValueError(f"u must have last dimension d={self.dim}, got shape {tuple(u.shape)}")
        if self.metric is not None:
            self.metric.check_dim(d, "metric")
        try:
            torch.broadcast_shapes(u.shape[:-1], self.batch_shape)
        except RuntimeError:
            raise ValueError(f"u's leading dims {tuple(u.shape[:-1])} must broadcast with the law's batch shape "
                             f"{tuple(self.batch_shape)}") from None
        return d

    # Geometry in the distribution layout (*sample, *batch, d): the metric's batch shape is
    # right-aligned with u's leading dims, which is plain broadcasting (sample_dims=0).
    def _precision_apply(self, u: torch.Tensor) -> torch.Tensor:
        return u if self.metric is None else self.metric.apply_precision(u)

    def _sqrt_covariance_apply(self, z: torch.Tensor) -> torch.Tensor:
        return z if self.metric is None else self.metric.unwhiten(z)

    def _half_logdet(self, d: int) -> torch.Tensor:
        if self.metric is None:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return 0.5 * self.metric.logdet(d)

    def _dense_covariance(self, d: int) -> torch.Tensor:
        if self.metric is None:
            return torch.eye(d, dtype=self.dtype, device=self.device)
        return self.metric.covariance(d)

    def _trace(self, d: int) -> torch.Tensor:
        if self.metric is None:
            return torch.tensor(float(d), dtype=self.dtype, device=self.device)
        return self.metric.trace(d)

    def _norm_and_direction(self, u: torch.Tensor, direction: bool = True):
        """(‖u‖_P, P u / ‖u‖_P) with no overflow or underflow of ‖u‖²_P (the direction
        None when ``direction`` is False: the potential needs the norm only).

        u is divided by its largest |entry| s first and ‖u‖_P = s ‖u/s‖_P: squaring u itself
        overflows float32 from |u| ≈ 2e19 on (the potential read inf and the score 0 where
        both are finite) and underflows below 1e-19 (the score read 0 at u ≠ 0, where for β ≤ 1
        it has size λ or more).  s is a constant of the computation (the formula is the same for
        every s > 0), so it carries no gradient and every derivative in u stays exact.  At u = 0
        the norm and the direction are 0; a NaN coordinate gives a NaN norm, an infinite one
        (and no NaN) an infinite norm with the direction of its infinite coordinates.
        """
        s = u.detach().abs().amax(-1, keepdim=True)  # NaN when a coordinate is NaN
        infinite = torch.isinf(s)
        scale = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        w = torch.where(infinite, torch.where(torch.isinf(u), torch.sign(u), torch.zeros_like(u)), u / scale)
        pw = self._precision_apply(w)
        qw = (w * pw).sum(-1)
        at_zero = qw <= 0  # u = 0 (or a rounding below it); False for NaN
        root = torch.where(at_zero, torch.ones_like(qw), qw).sqrt()
        norm = torch.where(at_zero, torch.zeros_like(root), torch.where(infinite, s, scale)[..., 0] * root)
        return norm, (pw / root[..., None] if direction else None)


# ---------------------------------------------------------------------------- laws
class GeneralizedGaussian(_MetricNoise):
    r"""Generalized-Gaussian noise q(u) ∝ exp(−(λ/β) ‖u‖_P^β), P = Σ⁻¹ (DESIGN §2).

    β = 2, λ = 1 is N(0, Σ); β = 1 is the multivariate Laplace law.

    Args:
        beta: float or tensor ``(*batch,)`` in (0, 2].
        lam: float or tensor ``(*batch,)``, > 0.
        metric: :class:`~etweedie.geometry.Metric` for Σ (its batch shape broadcasts with
            ``beta``/``lam``), or None for Σ = I.
        dim: the dimension d, needed to ``sample`` (or call ``covariance``) when the metric
            does not fix it (isotropic, block, None).

    Attributes: ``beta``, ``lam`` (tensors), ``metric``, ``dim``, ``batch_shape``.

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> noise = GeneralizedGaussian(1.4, 1.8, Metric.isotropic(0.5), dim=2)
        >>> u = noise.sample((3,), generator=g)      # (3, 2)
        >>> noise.log_prob(torch.zeros(2))
        tensor(-0.3283)
    """

    def __init__(self, beta: Scalar, lam: Scalar = 1.0, metric: Optional[Metric] = None, *, dim: Optional[int] = None):
        self._init_geometry(metric, dim)
        ref = _reference(self.metric, beta, lam)
        beta = _as_float_tensor(beta, "beta", like=ref)
        lam = _as_float_tensor(lam, "lam", like=ref)
        _check_devices({"beta": beta, "lam": lam, "metric": None if metric is None else metric.param})
        _check_law_dtype({"beta": beta, "lam": lam, "metric": None if metric is None else metric.param})
        _check_beta(beta)
        _check_positive(lam, "lam")
        shapes = {"beta": beta.shape, "lam": lam.shape}
        if self.metric is not None:
            shapes["metric"] = self.metric.batch_shape
        self.batch_shape = _broadcast_batch(shapes)
        self.beta = beta
        self.lam = lam
        self.dtype = torch.promote_types(beta.dtype, lam.dtype)
        if self.metric is not None:
            self.dtype = torch.promote_types(self.dtype, self.metric.dtype)
        self.device = beta.device

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(beta={_short(self.beta)}, lam={_short(self.lam)}, "
            f"metric={self.metric!r}, dim={self.dim})"
        )

    # -------------------------------------------------------------- sampling
    def sample(self, sample_shape: Sequence[int] = (), *, generator: torch.Generator, dim: Optional[int] = None) -> torch.Tensor:
        """Draw ``u = Σ^{1/2} R U`` with ``U = Z/‖Z‖``, ``R = ((β/λ) G)^{1/β}``, ``G ~ Gamma(d/β, 1)``.

        ``Σ^{1/2}`` is ``L⁻ᵀ`` (``Metric.unwhiten``), so ‖u‖_P = R exactly.

        Args:
            sample_shape: leading shape of independent draws.
            generator: the ``torch.Generator`` every random number comes from.
            dim: d, when the metric does not fix it and none was given at construction.

        Returns:
            tensor ``(*sample_shape, *batch_shape, d)`` of the noise dtype.

        Example::

            >>> GeneralizedGaussian(1.0, dim=3).sample((2,), generator=torch.Generator().manual_seed(0)).shape
            torch.Size([2, 3])
        """
        generator = check_generator(generator)
        d = self._resolve_dim(dim)
        shape = _sample_shape(sample_shape) + self.batch_shape
        z = torch.randn(shape + (d,), generator=generator, dtype=self.dtype, device=self.device)
        direction = z / z.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(self.dtype).tiny)
        beta = self.beta.to(self.dtype)
        lam = self.lam.to(self.dtype)
        concentration = (d / beta).expand(shape).contiguous()
        gamma = torch._standard_gamma(concentration, generator=generator)
        # R = ((β/λ) G)^{1/β} in log space: large d/β with small β overflows the direct power.
        # R enters as √R · Σ^{1/2}(√R U): R alone can overflow where u = R Σ^{1/2} U is finite
        # (float32, β = 0.5, λ = var = 1e-20: R ≈ 1e40, u ≈ 1e30).
        half_radius = torch.exp(0.5 * (torch.log(beta) - torch.log(lam) + torch.log(gamma)) / beta)[..., None]
        return half_radius * self._sqrt_covariance_apply(half_radius * direction)

    # -------------------------------------------------------------- density
    def potential(self, u: torch.Tensor) -> torch.Tensor:
        """E(u) = (λ/β) ‖u‖_P^β = −log q(u) − log Z. ``u``: ``(..., d)`` → ``(...)`` (broadcast with batch).

        Example::

            >>> GeneralizedGaussian(1.0, 2.0).potential(torch.tensor([3.0, 4.0]))
            tensor(10.)
        """
        self._check_input(u)
        norm, _ = self._norm_and_direction(u, direction=False)
        return (self.lam / self.beta) * _norm_power(norm, self.beta)

    def log_normalizer(self, d: int) -> torch.Tensor:
        """log Z = ½ logdet Σ + log 2 + (d/2) log π − lgamma(d/2) + lgamma(d/β) − log β − (d/β) log(λ/β).

        Shape ``batch_shape``.
        """
        d = self._resolve_dim(d)
        # in float64, rounded once: lgamma(d/β) and (d/β) log(λ/β) are large (≈ 3000 at d = 784)
        # and a float32 β or λ evaluated them in float32 even for a float64 law
        beta, lam = self.beta.to(torch.float64), self.lam.to(torch.float64)
        const = math.log(2.0) + 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d)
        shape_terms = const + torch.lgamma(d / beta) - torch.log(beta) - (d / beta) * (torch.log(lam) - torch.log(beta))
        return self._half_logdet(d) + shape_terms.to(self.dtype)

    def log_prob(self, u: torch.Tensor) -> torch.Tensor:
        """Normalized log density log q(u) = −(λ/β) ‖u‖_P^β − log Z.

        ``u``: ``(..., d)`` whose leading dims broadcast with ``batch_shape``; returns ``(...)``.

        Example::

            >>> GeneralizedGaussian(2.0, 1.0).log_prob(torch.zeros(2))   # N(0, I_2) at 0: −log 2π
            tensor(-1.8379)
        """
        d = self._check_input(u)
        return -self.potential(u) - self.log_normalizer(d)

    def score(self, u: torch.Tensor) -> torch.Tensor:
        """∇_u log q(u) = −λ ‖u‖_P^{β−2} P u, exactly 0 at u = 0 (never NaN).

        ``u``: ``(..., d)``; returns the broadcast shape ``(..., d)``.

        Example::

            >>> GeneralizedGaussian(1.0, 2.0).score(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
            tensor([[-1.2000, -1.6000],
                    [-0.0000, -0.0000]])
        """
        self._check_input(u)
        # −λ ‖u‖^{β−1} (P u / ‖u‖): no ‖u‖² to overflow or underflow (see _norm_and_direction)
        norm, direction = self._norm_and_direction(u)
        return -(self.lam * _norm_power(norm, self.beta - 1))[..., None] * direction

    # -------------------------------------------------------------- moments
    def _log_second_moment_factor(self, d: int) -> torch.Tensor:
        """log of (β/λ)^{2/β} Γ((d+2)/β) / (d Γ(d/β)) (Cov(u) = factor · Σ), in float64.

        In logs: the factor itself overflows where the RMS and the covariance do not (float32,
        β = 1, λ = 1e-20: factor 3e40, RMS 1.7e20); in float64: the lgamma difference cancels
        (a float32 evaluation was off by 5e-4 at d = 784, β = 0.3)."""
        beta, lam = self.beta.to(torch.float64), self.lam.to(torch.float64)
        return (2 / beta) * (torch.log(beta) - torch.log(lam)) - _lgamma_drop((d + 2) / beta, 2 / beta) - math.log(d)

    def covariance(self, d: Optional[int] = None) -> torch.Tensor:
        """Cov(u) = Σ (β/λ)^{2/β} Γ((d+2)/β) / (d Γ(d/β)), dense ``(*batch_shape, d, d)``.

        Example::

            >>> GeneralizedGaussian(2.0, 1.0, dim=2).covariance()
            tensor([[1., 0.],
                    [0., 1.]])
        """
        d = self._resolve_dim(d)
        # √factor · Σ · √factor: finite wherever the covariance is, though the factor may not be
        root = torch.exp(0.5 * self._log_second_moment_factor(d)).to(self.dtype)[..., None, None]
        return root * self._dense_covariance(d) * root

    def realized_rms(self, d: Optional[int] = None) -> torch.Tensor:
        """Per-coordinate RMS sqrt(tr Cov(u) / d), shape ``batch_shape``."""
        d = self._resolve_dim(d)
        log_mean_var = torch.log(self._trace(d).to(torch.float64)) - math.log(d)
        return torch.exp(0.5 * (self._log_second_moment_factor(d) + log_mean_var)).to(self.dtype)


class Laplace(GeneralizedGaussian):
    """Multivariate Laplace noise q(u) ∝ exp(−λ ‖u‖_P): :class:`GeneralizedGaussian` with β = 1.

    Example::

        >>> Laplace(2.0).potential(torch.tensor([3.0, 4.0]))
        tensor(10.)
    """

    def __init__(self, lam: Scalar = 1.0, metric: Optional[Metric] = None, *, dim: Optional[int] = None):
        ref = _reference(_check_metric(metric), lam)
        super().__init__(_as_float_tensor(1.0, "beta", like=ref), lam, metric, dim=dim)

    def __repr__(self) -> str:
        return f"Laplace(lam={_short(self.lam)}, metric={self.metric!r}, dim={self.dim})"


class StudentT(_MetricNoise):
    r"""Multivariate Student-t noise q(u) ∝ (1 + ‖u‖²_P)^{−c}, c > d/2, ν = 2c − d (DESIGN §2).

    ``u = Σ^{1/2} Z / sqrt(W)``, ``Z ~ N(0, I_d)``, ``W ~ χ²_ν``: a standard t_ν vector scaled by
    ν^{−1/2}, so Cov(u) = Σ / (ν − 2) for ν > 2.

    Args:
        c: float or tensor ``(*batch,)``, > 0; c > d/2 is checked once d is known (``sample``,
            ``log_prob``, or at construction when ``dim``/the metric fixes d).
        metric, dim: as for :class:`GeneralizedGaussian`.

    Example::

        >>> t = StudentT(2.5, dim=2)
        >>> t.nu(2), t.potential(torch.tensor([1.0, 0.0]))
        (tensor(3.), tensor(1.7329))
    """

    def __init__(self, c: Scalar, metric: Optional[Metric] = None, *, dim: Optional[int] = None):
        self._init_geometry(metric, dim)
        c = _as_float_tensor(c, "c", like=_reference(self.metric, c))
        _check_devices({"c": c, "metric": None if metric is None else metric.param})
        _check_law_dtype({"c": c, "metric": None if metric is None else metric.param})
        _check_positive(c, "c")
        shapes = {"c": c.shape}
        if self.metric is not None:
            shapes["metric"] = self.metric.batch_shape
        self.batch_shape = _broadcast_batch(shapes)
        self.c = c
        self.dtype = c.dtype if self.metric is None else torch.promote_types(c.dtype, self.metric.dtype)
        self.device = c.device
        if self.dim is not None:
            self._check_c(self.dim)

    def __repr__(self) -> str:
        return f"StudentT(c={_short(self.c)}, metric={self.metric!r}, dim={self.dim})"

    def _check_c(self, d: int) -> None:
        if not _is_compiling() and self.c.numel() and not bool((self.c > d / 2).all()):
            raise ValueError(f"c must be > d/2 = {d / 2:g} (ν = 2c − d > 0), got min c = {self.c.min().item():.4g}")

    def nu(self, d: Optional[int] = None) -> torch.Tensor:
        """Degrees of freedom ν = 2c − d, shape ``batch_shape`` of c."""
        d = self._resolve_dim(d)
        return 2 * self.c - d

    def sample(self, sample_shape: Sequence[int] = (), *, generator: torch.Generator, dim: Optional[int] = None) -> torch.Tensor:
        """Draw ``u = Σ^{1/2} Z / sqrt(W)``, ``W = 2 Gamma(ν/2, 1) ~ χ²_ν``.

        Returns ``(*sample_shape, *batch_shape, d)``.

        Example::

            >>> StudentT(3.0, dim=2).sample((4,), generator=torch.Generator().manual_seed(0)).shape
            torch.Size([4, 2])
        """
        generator = check_generator(generator)
        d = self._resolve_dim(dim)
        self._check_c(d)
        shape = _sample_shape(sample_shape) + self.batch_shape
        z = torch.randn(shape + (d,), generator=generator, dtype=self.dtype, device=self.device)
        half_nu = ((2 * self.c.to(self.dtype) - d) / 2).expand(shape).contiguous()
        chi2 = 2 * torch._standard_gamma(half_nu, generator=generator)
        chi2 = chi2.clamp_min(torch.finfo(self.dtype).tiny)
        return self._sqrt_covariance_apply(z * chi2.rsqrt()[..., None])

    def potential(self, u: torch.Tensor) -> torch.Tensor:
        """E(u) = c log(1 + ‖u‖²_P). ``u``: ``(..., d)`` → ``(...)``."""
        self._check_input(u)
        norm, _ = self._norm_and_direction(u, direction=False)
        # log(1 + ‖u‖²) without squaring a norm beyond 1: 2 log ‖u‖ + log1p(‖u‖⁻²) there (the
        # square overflows float32 from ‖u‖ ≈ 2e19 on, where the potential is ≈ 2c log ‖u‖)
        big = norm > 1
        nb = torch.where(big, norm, torch.full_like(norm, 2.0))
        ns = torch.where(big, torch.zeros_like(norm), norm)
        return self.c * torch.where(big, 2 * torch.log(nb) + torch.log1p(nb.pow(-2)), torch.log1p(ns * ns))

    def log_normalizer(self, d: int) -> torch.Tensor:
        """log Z = ½ logdet Σ + (d/2) log π + lgamma(c − d/2) − lgamma(c), shape ``batch_shape``."""
        d = self._resolve_dim(d)
        self._check_c(d)
        # lgamma(c − d/2) − lgamma(c) without cancellation (it read 0 for c = 1e8 in float32 and
        # c = 1e20 in float64, instead of ≈ −(d/2) log c)
        shape_terms = 0.5 * d * math.log(math.pi) + _lgamma_drop(self.c.to(torch.float64), d / 2)
        return self._half_logdet(d) + shape_terms.to(self.dtype)

    def log_prob(self, u: torch.Tensor) -> torch.Tensor:
        """Normalized log density −c log(1 + ‖u‖²_P) − log Z. ``u``: ``(..., d)`` → ``(...)``.

        Example::

            >>> StudentT(1.0, dim=1).log_prob(torch.zeros(1))     # Cauchy at 0: −log π
            tensor(-1.1447)
        """
        d = self._check_input(u)
        self._check_c(d)
        return -self.potential(u) - self.log_normalizer(d)

    def score(self, u: torch.Tensor) -> torch.Tensor:
        """∇_u log q(u) = −2c P u / (1 + ‖u‖²_P). ``u``: ``(..., d)`` → ``(..., d)``."""
        self._check_input(u)
        # −2c (‖u‖ / (1 + ‖u‖²)) (P u / ‖u‖), the ratio written without squaring a norm beyond 1
        norm, direction = self._norm_and_direction(u)
        big = norm > 1
        nb = torch.where(big, norm, torch.full_like(norm, 2.0))
        ns = torch.where(big, torch.zeros_like(norm), norm)
        ratio = torch.where(big, 1 / (nb + 1 / nb), ns / (1 + ns * ns))
        return -(2 * self.c * ratio)[..., None] * direction

    def covariance(self, d: Optional[int] = None) -> torch.Tensor:
        """Cov(u) = Σ / (ν − 2), dense ``(*batch_shape, d, d)``; needs ν > 2."""
        d = self._resolve_dim(d)
        nu = 2 * self.c - d
        if not _is_compiling() and nu.numel() and not bool((nu > 2).all()):
            raise ValueError(f"c must be > d/2 + 1 = {d / 2 + 1:g} for a finite covariance (ν > 2), got min c = {self.c.min().item():.4g}")
        return (1 / (nu - 2))[..., None, None] * self._dense_covariance(d)


# ---------------------------------------------------------------------------- parameters
@dataclass(frozen=True, eq=False)
class NoiseParams:
    """The five-parameter noise tuple ``(β, λ, σ, u, v)`` (DESIGN §2).

    ``Σ = (σ/c_{β,d})² (I_{d/2} ⊗ S(u, v))`` with ``S(u,v) = [[1+u, v], [v, 1−u]]``, so the
    generalized-Gaussian noise has per-coordinate RMS ``σ λ^{−1/β}`` in every even d.

    Fields are floats or tensors ``(*batch,)`` (one tuple per row), broadcastable together:
    β ∈ (0, 2], λ > 0, σ > 0, u² + v² < 1.

    Example::

        >>> p = NoiseParams(beta=1.4, lam=1.8, sigma=0.57, u=0.0, v=0.6)
        >>> p.eta()
        tensor([ 1.4000,  0.5878, -0.5621,  0.0000,  0.6000])
        >>> p.realized_rms()
        tensor(0.3746)
    """

    beta: Scalar
    lam: Scalar
    sigma: Scalar
    u: Scalar = 0.0
    v: Scalar = 0.0

    def __post_init__(self):
        named = {n: getattr(self, n) for n in ("beta", "lam", "sigma", "u", "v")}
        ref = _reference(None, *named.values())
        tensors = {n: _as_float_tensor(x, n, like=ref) for n, x in named.items()}
        _check_devices(named)
        _broadcast_batch({n: t.shape for n, t in tensors.items()})
        _check_beta(tensors["beta"])
        _check_positive(tensors["lam"], "lam")
        _check_positive(tensors["sigma"], "sigma")
        if not _is_compiling():
            r2 = tensors["u"] ** 2 + tensors["v"] ** 2
            if r2.numel() and not bool((r2 < 1).all()):
                raise ValueError(f"(u, v) must lie in the open unit disk (u²+v²<1), got max u²+v² = {r2.max().item():.4g}")

    def _tensors(self):
        ref = _reference(None, self.beta, self.lam, self.sigma, self.u, self.v)
        return tuple(_as_float_tensor(getattr(self, n), n, like=ref) for n in ("beta", "lam", "sigma", "u", "v"))

    @property
    def batch_shape(self) -> torch.Size:
        return torch.broadcast_shapes(*(t.shape for t in self._tensors()))

    def metric(self, d: int) -> Metric:
        """The block metric ``Metric.from_params(sigma, u, v, beta, d)``; d even."""
        beta, _, sigma, u, v = self._tensors()  # one dtype for all fields (a Python float would round to float32)
        return Metric.from_params(sigma, u, v, beta, d)

    def noise(self, d: int) -> GeneralizedGaussian:
        """``GeneralizedGaussian(beta, lam, self.metric(d), dim=d)``: the noise law in dimension d."""
        beta, lam = self._tensors()[:2]
        return GeneralizedGaussian(beta, lam, self.metric(d), dim=d)

    def realized_rms(self) -> torch.Tensor:
        """Per-coordinate RMS of the noise, ``σ λ^{−1/β}``, shape ``batch_shape``."""
        beta, lam, sigma, _, _ = self._tensors()
        dtype = torch.promote_types(torch.promote_types(beta.dtype, lam.dtype), sigma.dtype)
        # exp(log σ − log λ / β) in float64: λ^{−1/β} alone overflows where the RMS is finite
        # (σ = λ = 1e-30, β = 0.5: RMS 1e30, λ^{−2} = 1e60 is inf in float32)
        f64 = torch.float64
        return torch.exp(torch.log(sigma.to(f64)) - torch.log(lam.to(f64)) / beta.to(f64)).to(dtype)

    def eta(self) -> torch.Tensor:
        """Conditioning vector ``η = (β, log λ, log σ, u, v)``, shape ``(*batch_shape, 5)``."""
        beta, lam, sigma, u, v = torch.broadcast_tensors(*self._tensors())
        return torch.stack([beta, torch.log(lam), torch.log(sigma), u, v], dim=-1)

    @classmethod
    def from_eta(cls, eta: torch.Tensor) -> "NoiseParams":
        """Invert :meth:`eta`: η = (β, log λ, log σ, u, v), ``(..., 5)`` → fields of shape ``(...)``.

        Example::

            >>> q = NoiseParams.from_eta(NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6).eta())
            >>> round(float(q.lam), 4), round(float(q.sigma), 4)
            (1.8, 0.57)
        """
        if not isinstance(eta, torch.Tensor) or not eta.is_floating_point():
            got = eta.dtype if isinstance(eta, torch.Tensor) else type(eta).__name__
            raise TypeError(f"eta must be a floating-point tensor of shape (..., 5), got {got}")
        if eta.dim() < 1 or eta.shape[-1] != 5:
            raise ValueError(f"eta must have shape (..., 5) = (β, log λ, log σ, u, v), got {tuple(eta.shape)}")
        beta, log_lam, log_sigma, u, v = eta.unbind(-1)
        return cls(beta, torch.exp(log_lam), torch.exp(log_sigma), u, v)

    @staticmethod
    def sigma_for_rms(r: Scalar, lam: Scalar, beta: Scalar) -> Scalar:
        """σ = r λ^{1/β}: the σ giving per-coordinate RMS r at (λ, β) (a path fixes σ_t this way).

        Floats in give a float out; any tensor gives a tensor.

        Example::

            >>> NoiseParams.sigma_for_rms(0.5, 4.0, 2.0)
            1.0
        """
        ref = _reference(None, r, lam, beta)
        # floats are checked as the float64 numbers they are (float32 would read r = 1e-300 as 0)
        like = ref if ref is not None else torch.zeros((), dtype=torch.float64)
        r_t, lam_t, beta_t = (_as_float_tensor(x, n, like=like) for x, n in ((r, "r"), (lam, "lam"), (beta, "beta")))
        _check_positive(r_t, "r")
        _check_positive(lam_t, "lam")
        _check_beta(beta_t)
        if ref is None:
            try:
                return float(r) * float(lam) ** (1 / float(beta))
            except OverflowError:  # λ^{1/β} alone beyond a float: the product may still fit
                log_sigma = math.log(float(r)) + math.log(float(lam)) / float(beta)
                if log_sigma > math.log(sys.float_info.max):
                    raise ValueError(f"sigma = r·lam^(1/beta) = exp({log_sigma:.6g}) overflows a float "
                                     f"(r={r!r}, lam={lam!r}, beta={beta!r})") from None
                return math.exp(log_sigma)
        # exp(log r + log λ / β) in float64 (λ^{1/β} alone overflows where σ is finite), rounded once
        dtype = torch.promote_types(torch.promote_types(r_t.dtype, lam_t.dtype), beta_t.dtype)
        f64 = torch.float64
        return torch.exp(torch.log(r_t.to(f64)) + torch.log(lam_t.to(f64)) / beta_t.to(f64)).to(dtype)


def _short(t: torch.Tensor) -> str:
    return f"{t.item():.4g}" if t.numel() == 1 else f"tensor{tuple(t.shape)}"
