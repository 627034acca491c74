"""Noise-parameter estimation: profiled M-estimation of (β, λ, Σ) (paper §5.2, Alg. noise_param).

The Energy-Tweedie identity says the noisy score equals λ times the residual field of the
posterior (Eq. G(y)),

    G(y; β, Σ) = Σ⁻¹ E_{X ~ P(·|Y=y)}[ ‖X − y‖_{Σ⁻¹}^{β−2} (X − y) ],      s_m(y) = λ G(y; β, Σ),

so with a score estimator ŝ_m that does not know the noise (score matching on noisy data, or
an oracle) and posterior draws, the noise parameters minimize (Eq. param_optim_pop)

    J(β, λ, Σ) = (1/n) Σ_i ‖ŝ_m(Y_i) − λ Ĝ_K(Y_i; β, Σ)‖².

Algorithm 1 of the paper, implemented by :func:`estimate_noise`:

* β = β_min + (2 − β_min)·sigmoid(ζ);
* Σ trace-normalized from a Cholesky parameter: S = k·L Lᵀ / tr(L Lᵀ) (k×k, L lower
  triangular with positive diagonal), Σ = I_{d/k} ⊗ S — or, with a known noise level σ per
  observation group (the five-parameter geometry of DESIGN §2), Σ = (σ/c_{β,d})² (I_{d/2} ⊗ S),
  S = S(u, v) = [[1+u, v], [v, 1−u]] with (u, v) in the open unit disk (every trace-2 SPD 2×2
  matrix is one S(u, v), so the Cholesky parameter covers exactly the disk);
* λ profiled in closed form on each minibatch (Cor. lambda_profile),
  λ_t = Π_Λ[Σ⟨ŝ, Ĝ⟩ / Σ‖Ĝ‖²], projected onto Λ = [λ_min, λ_max];
* Adam (or SGD) steps on the profiled objective; its gradient with respect to (ζ, L) flows
  through the fused backward of :func:`etweedie.et_score` (Ĝ = et_score with λ = 1).  By the
  envelope theorem the profiled λ_t needs no gradient: ∂J/∂λ = 0 at the interior optimum, and
  a projected λ_t is locally constant;
* the final λ is recomputed on all estimation samples;
* the K posterior draws per observation are drawn once and reused at every step.

Family controls (App. param, Tab. param_full_spd_family_controls): ``"gaussian"`` forces β ≡ 2,
``"isotropic"`` forces S = I (u = v = 0), ``"isotropic_gaussian"`` both.

Scale orbit (Thm. identifiability): (β, c^{β/2}λ, cΣ) give the same λG for every c > 0, so only
a trace-normalized Σ (or a known σ) makes λ identifiable; :func:`residual_field` and
:func:`profiled_objective` let one check this numerically.

Example (Gaussian noise s·N(0, I) on the ring, exact posterior and analytic score; Σ is
trace-normalized, so λ̂ ≈ 1/s² = 6.25; β → 2 from below, as β = 2 is the sigmoid's limit)::

    >>> import torch
    >>> from etweedie.data import EightGaussians
    >>> from etweedie.estimate import EstimatorSettings, estimate_noise
    >>> ring, g = EightGaussians(), torch.Generator().manual_seed(0)
    >>> y = ring.sample(256, g, dtype=torch.float64)[0] + 0.4 * torch.randn(256, 2, generator=g, dtype=torch.float64)
    >>> est = estimate_noise(y, posterior=lambda q, sigma, K, gen: ring.posterior_sample(q, 0.4, K, gen),
    ...                      score=lambda q, sigma: ring.noisy_score(q, 0.4),
    ...                      settings=EstimatorSettings(n_posterior=64, steps=100), generator=g, progress=False)
    >>> est.beta > 1.85, round(est.lam), est.shape.diagonal().round(decimals=1).tolist()
    (True, 6, [1.0, 1.0])

The paper's full-SPD experiment runs from the repository:
``python -m experiments.eight_gaussians.estimation --config configs/estimate_spd.toml --out DIR``.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from tqdm.auto import tqdm

from ._checks import check_bool, check_float, check_int
from .geometry import Metric, scale_constant
from .noise import NoiseParams
from .training.optim import optimize, warmup_cosine
from .ops import et_score
from .score import antithetic_options, posterior_dtype_device

__all__ = [
    "EstimatorSettings",
    "FAMILIES",
    "NoiseEstimate",
    "beta_from_zeta",
    "estimate_noise",
    "level_sampler",
    "level_variance",
    "profile_lambda",
    "profiled_objective",
    "residual_field",
    "shape_from_cholesky",
    "zeta_from_beta",
]

# family name -> (β estimated, shape estimated)
FAMILIES: Dict[str, Tuple[bool, bool]] = {
    "generalized": (True, True),
    "gaussian": (False, True),
    "isotropic": (True, False),
    "isotropic_gaussian": (False, False),
}
FAMILY_LABELS = {
    "generalized": "generalized",
    "gaussian": "forced Gaussian",
    "isotropic": "forced isotropic",
    "isotropic_gaussian": "forced isotropic Gaussian",
}

LEVEL_SCALES = ("rms", "plain")

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
# posterior(y (m, d), sigma (float or None), K, generator) -> (m, K, d)
PosteriorSampler = Callable[[torch.Tensor, Optional[float], int, torch.Generator], torch.Tensor]
# score(y (m, d), sigma (float or None)) -> (m, d)
ScoreFunction = Callable[[torch.Tensor, Optional[float]], torch.Tensor]


# ---------------------------------------------------------------------------- posterior adapter
def level_sampler(
    posterior,
    params_at: Callable[[float], NoiseParams],
    *,
    chunk: int = 128,
    antithetic: bool = False,
) -> PosteriorSampler:
    """A posterior of the library protocol as the ``posterior(y, sigma, K, generator)`` sampler here.

    The score, the sampler and the oracles take posteriors with
    ``posterior.sample(y (..., d), eta (..., 5), n, *, generator) -> (..., n, d)``; the estimator
    draws per group at a known level σ.  This adapter conditions every query of the group on
    ``params_at(sigma).eta()`` (the noise tuple the posterior should see at that level), runs
    ``chunk`` queries at a time in the posterior's dtype (a torch module's parameter dtype, else
    y's) and returns the draws in y's dtype.  ``antithetic=True`` asks for mirrored-noise draws
    (a posterior whose ``sample`` takes no ``antithetic`` keyword is a TypeError up front).

        >>> from etweedie.posteriors.known import KnownPosterior
        >>> sampler = level_sampler(KnownPosterior(), lambda s: NoiseParams(2.0, 1.0, s, 0.0, 0.0))
        >>> sampler(torch.zeros(3, 2, dtype=torch.float64), 0.5, 4, torch.Generator().manual_seed(0)).shape
        torch.Size([3, 4, 2])
    """
    if not callable(getattr(posterior, "sample", None)):
        raise TypeError(f"posterior must have a sample(y, eta, n, *, generator) method, got {type(posterior).__name__}")
    if not callable(params_at):
        raise TypeError(f"params_at must be callable as params_at(sigma) -> NoiseParams, got {type(params_at).__name__}")
    chunk = check_int(chunk, "chunk", minimum=1)
    options = antithetic_options(posterior, antithetic)
    model_dtype, _ = posterior_dtype_device(posterior)

    def sample(y: torch.Tensor, sigma: Optional[float], K: int, generator: torch.Generator) -> torch.Tensor:
        if sigma is None:
            raise ValueError("this posterior needs the known level sigma of every group")
        dtype = y.dtype if model_dtype is None else model_dtype
        params = params_at(float(sigma))
        if not isinstance(params, NoiseParams):
            raise TypeError(f"params_at(sigma) must return NoiseParams, got {type(params).__name__}")
        eta = params.eta().to(dtype)
        if y.shape[0] == 0:  # an empty batch: no posterior call, the (0, K, d) draws
            return y.new_empty(0, check_int(K, "K", minimum=1), y.shape[-1])
        out = []
        with torch.no_grad():
            for start in range(0, y.shape[0], chunk):
                yb = y[start : start + chunk].to(dtype)
                out.append(posterior.sample(yb, eta.expand(yb.shape[0], 5), K, generator=generator, **options))
        return torch.cat(out).to(y.dtype)

    return sample


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class EstimatorSettings:
    """Settings of Algorithm 1.

    Attributes:
        beta_min: lower tail bound β_min ∈ (0, 2); β = β_min + (2 − β_min)·sigmoid(ζ).
        lam_min, lam_max: the valid scale interval Λ (0 < λ_min < λ_max).
        n_posterior: K, posterior draws per observation (when a sampler is given).
        steps: gradient steps.
        batch_size: observations per minibatch (≥ n: full batch).
        lr: initial learning rate; cosine decay to ``lr * lr_final_fraction``.
        lr_final_fraction: final/initial learning rate.
        optimizer: ``"adam"`` or ``"sgd"`` (momentum 0.9).
        beta_init: initial β ∈ (β_min, 2) for families that estimate β.
        block_size: k of the shape matrix S (Σ = I_{d/k} ⊗ S); None: 2 with known σ levels
            (the five-parameter geometry), d otherwise (dense, as in Algorithm 1).
        level_scale: how a known level σ scales Σ: ``"rms"`` (DESIGN §2, ``NoiseParams``):
            Σ = (σ/c_{β,d})² (I ⊗ S), so the noise RMS is σλ^{−1/β} whatever β; ``"plain"``
            (the wording of the paper's §5.1): Σ = σ² (I ⊗ S).
        split_half: debias the objective's ‖G‖² term over the K draws.  The plain objective
            uses ‖Ĝ_K‖², whose mean is ‖G‖² + tr Var(Ĝ_K) — a term of order 1/K that depends on
            (β, Σ) and so pulls the minimizer; with ``split_half`` it is replaced by ⟨Ĝ_A, Ĝ_B⟩
            from two disjoint halves of the draws, whose mean is exactly ‖G‖² (a U-statistic),
            in both the profiled λ and the objective.  Same cost (each half is one fused call).
    """

    beta_min: float = 0.5
    lam_min: float = 1e-3
    lam_max: float = 1e3
    n_posterior: int = 256
    steps: int = 400
    batch_size: int = 256
    lr: float = 0.05
    lr_final_fraction: float = 0.02
    optimizer: str = "adam"
    beta_init: float = 1.7
    block_size: Optional[int] = None
    level_scale: str = "rms"
    split_half: bool = False

    def __post_init__(self):
        check_bool(self.split_half, "split_half")
        for name in ("beta_min", "lam_min", "lam_max", "lr", "lr_final_fraction", "beta_init"):
            check_float(getattr(self, name), name)
        if not 0 < self.beta_min < 2:
            raise ValueError(f"beta_min must lie in the open interval (0, 2), got {self.beta_min}")
        if not 0 < self.lam_min < self.lam_max:
            raise ValueError(f"lam_min and lam_max must satisfy 0 < lam_min < lam_max, got [{self.lam_min}, {self.lam_max}]")
        if not self.beta_min < self.beta_init < 2:
            raise ValueError(f"beta_init must lie in (beta_min, 2) = ({self.beta_min}, 2), got {self.beta_init}")
        if not self.lr > 0 or not 0 < self.lr_final_fraction <= 1:
            raise ValueError(f"lr must be > 0 and lr_final_fraction in (0, 1], got {self.lr}, {self.lr_final_fraction}")
        for name, minimum in (("n_posterior", 1), ("steps", 0), ("batch_size", 1)):
            check_int(getattr(self, name), name, minimum=minimum)
        if self.level_scale not in LEVEL_SCALES:
            raise ValueError(f"level_scale must be one of {LEVEL_SCALES}, got {self.level_scale!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.block_size is not None:
            check_int(self.block_size, "block_size (or None)", minimum=1)


# ---------------------------------------------------------------------------- building blocks
def _check_beta_min(beta_min) -> float:
    return check_float(beta_min, "beta_min", 0.0, 2.0, strict=True)


def beta_from_zeta(zeta: torch.Tensor, beta_min: float) -> torch.Tensor:
    """β = β_min + (2 − β_min)·sigmoid(ζ) ∈ (β_min, 2) (Alg. noise_param, line 1).

    ``zeta``: a floating-point tensor (any shape); ``beta_min`` ∈ (0, 2).
    """
    if not isinstance(zeta, torch.Tensor) or not zeta.is_floating_point():
        got = zeta.dtype if isinstance(zeta, torch.Tensor) else type(zeta).__name__
        raise TypeError(f"zeta must be a floating-point tensor, got {got}")
    beta_min = _check_beta_min(beta_min)
    return beta_min + (2.0 - beta_min) * torch.sigmoid(zeta)


def zeta_from_beta(beta: float, beta_min: float) -> float:
    """Inverse of :func:`beta_from_zeta` for β ∈ (β_min, 2) (the open interval: the bounds are ζ = ∓∞)."""
    beta_min = _check_beta_min(beta_min)
    beta = check_float(beta, "beta", beta_min, 2.0, strict=True)
    p = (beta - beta_min) / (2.0 - beta_min)
    return math.log(p / (1.0 - p))


def shape_from_cholesky(phi: torch.Tensor) -> torch.Tensor:
    """Trace-normalized shape S = k·L Lᵀ / tr(L Lᵀ) from an unconstrained k×k parameter φ.

    L = strictly-lower(φ) + diag(exp(diag φ)) is lower triangular with positive diagonal, so S
    is SPD with tr S = k (Alg. noise_param, line 1).  φ = 0 gives S = I.

    ``phi``: a floating-point ``(..., k, k)`` tensor, k ≥ 1; returns S of the same shape.
    """
    if not isinstance(phi, torch.Tensor) or not phi.is_floating_point():
        got = phi.dtype if isinstance(phi, torch.Tensor) else type(phi).__name__
        raise TypeError(f"phi must be a floating-point tensor of shape (..., k, k), got {got}")
    if phi.dim() < 2 or phi.shape[-1] != phi.shape[-2] or phi.shape[-1] < 1:
        raise ValueError(f"phi must have shape (..., k, k) with k >= 1, got {tuple(phi.shape)}")
    L = torch.tril(phi, -1) + torch.diag_embed(torch.exp(torch.diagonal(phi, dim1=-2, dim2=-1)))
    A = L @ L.transpose(-1, -2)
    k = phi.shape[-1]
    return k * A / torch.diagonal(A, dim1=-2, dim2=-1).sum(-1)[..., None, None]


def residual_field(y: torch.Tensor, x: torch.Tensor, beta, metric: Optional[Metric] = None) -> torch.Tensor:
    """Monte-Carlo residual field Ĝ_K(y; β, Σ) = Σ⁻¹ (1/K) Σ_k ‖x_k − y‖_{Σ⁻¹}^{β−2} (x_k − y) (Eq. G(y)).

    This is :func:`etweedie.et_score` with λ = 1 (the score is λG), so it runs on the fused
    kernels and differentiates with respect to β and the metric with their fused backward.

    Args:
        y: observations ``(*batch, d)``.
        x: posterior draws ``(*batch, K, d)``.
        beta: float or tensor broadcasting to ``batch``.
        metric: Σ (None: identity), optionally one per row.

    Returns:
        ``(*batch, d)``.
    """
    return et_score(y, x, beta, 1.0, metric)


def profile_lambda(
    scores: torch.Tensor,
    field: torch.Tensor,
    lam_min: Optional[float] = None,
    lam_max: Optional[float] = None,
    *,
    field_power: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Closed-form profiled scale (Cor. lambda_profile), projected onto [λ_min, λ_max].

    λ* = Σ_i ⟨ŝ(Y_i), G(Y_i)⟩ / Σ_i ‖G(Y_i)‖²,   λ̂ = Π_Λ[λ*] = min(λ_max, max(λ_min, λ*)).

    Args:
        scores: ŝ_m at the observations ``(n, d)``.
        field: G at the same observations ``(n, d)``.
        lam_min, lam_max: the projection interval (None: no bound on that side).
        field_power: per-row estimates ``(n,)`` of ‖G(Y_i)‖² to use instead of ``field``'s own
            (the split-half ⟨Ĝ_A, Ĝ_B⟩ of :class:`EstimatorSettings`).

    Returns:
        ``(λ̂, λ*)`` as 0-d tensors (projected, unconstrained).
    """
    _check_field_args(scores, field, field_power)
    lo = -math.inf if lam_min is None else check_float(lam_min, "lam_min")
    hi = math.inf if lam_max is None else check_float(lam_max, "lam_max")
    if not lo <= hi:
        raise ValueError(f"lam_min must be <= lam_max (the projection interval), got [{lo}, {hi}]")
    den = field.pow(2).sum() if field_power is None else field_power.sum()
    num = (scores * field).sum()
    if not bool(torch.isfinite(num) & torch.isfinite(den)):
        raise ValueError(f"scores and field must be finite: Σ⟨ŝ, G⟩ = {float(num):.4g}, Σ‖G‖² = {float(den):.4g}")
    if field_power is not None and not bool(den > 0):
        raise ValueError(f"field_power sums to {float(den):.3g} <= 0: the split-half estimate of Σ‖G‖² carries no "
                         "signal on these observations (more observations or draws per observation)")
    if not bool(den > 0):
        raise ValueError("the residual field G is identically zero on these observations; λ is not identifiable (Cor. lambda_profile needs E‖G‖² > 0)")
    raw = num / den
    return raw.clamp(lo, hi), raw


def _check_field_args(scores, field, field_power) -> None:
    """Shapes of (ŝ, G, per-row ‖G‖²): (n, d), (n, d), (n,) — no silent broadcasting."""
    for name, t in (("scores", scores), ("field", field)) + ((("field_power", field_power),) if field_power is not None else ()):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if scores.shape != field.shape:
        raise ValueError(f"scores and field must have the same shape, got {tuple(scores.shape)} and {tuple(field.shape)}")
    if field_power is not None and field_power.shape != field.shape[:-1]:
        raise ValueError(f"field_power must have shape {tuple(field.shape[:-1])}, got {tuple(field_power.shape)}")


def profiled_objective(
    scores: torch.Tensor, field: torch.Tensor, lam, *, field_power: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """J = (1/n) Σ_i ‖ŝ(Y_i) − λ G(Y_i)‖² (Eq. param_optim_pop, sample form).

    With ``field_power`` (per-row estimates of ‖G(Y_i)‖², e.g. the split-half ⟨Ĝ_A, Ĝ_B⟩) the
    square is expanded and ‖G‖² replaced: (1/n) Σ_i ‖ŝ‖² − 2λ⟨ŝ, G⟩ + λ² field_power_i.

    ``scores`` and ``field`` must have the same shape ``(n, d)`` (``field_power``: ``(n,)``).
    """
    _check_field_args(scores, field, field_power)
    if field_power is None:
        return (scores - lam * field).pow(2).sum(-1).mean()
    return (scores.pow(2).sum(-1) - 2 * lam * (scores * field).sum(-1) + lam**2 * field_power).mean()


def _kron_identity(S: torch.Tensor, d: int) -> torch.Tensor:
    """I_{d/k} ⊗ S for S ``(..., k, k)`` → ``(..., d, d)``."""
    k = S.shape[-1]
    eye = torch.eye(d // k, dtype=S.dtype, device=S.device)
    out = eye[:, None, :, None] * S[..., None, :, None, :]
    return out.reshape(*S.shape[:-2], d, d)


def level_variance(sigma, beta, d: int, level_scale: str = "rms"):
    """The factor multiplying I ⊗ S at known level σ: (σ/c_{β,d})² ("rms") or σ² ("plain")."""
    if level_scale not in LEVEL_SCALES:
        raise ValueError(f"level_scale must be one of {LEVEL_SCALES}, got {level_scale!r}")
    if level_scale == "plain":
        return sigma**2
    return (sigma / scale_constant(beta, d)) ** 2


def _geometry(S: torch.Tensor, d: int, beta: torch.Tensor, sigma_rows: Optional[torch.Tensor], level_scale: str = "rms") -> Metric:
    """Σ = (σ_i / c_{β,d})² (I_{d/k} ⊗ S) per row (known σ) or I_{d/k} ⊗ S (trace-normalized).

    Built with Metric.trusted (no validation): S is SPD by construction, and the validating
    constructors' SPD check would read the (differentiable) parameter back to the host.
    """
    block = S
    if sigma_rows is not None:
        block = level_variance(sigma_rows, beta, d, level_scale)[:, None, None] * S
    k = S.shape[-1]
    if k <= 4:
        return Metric.trusted("block", block)
    return Metric.trusted("dense", _kron_identity(block, d) if k < d else block)


# ---------------------------------------------------------------------------- result
@dataclass
class NoiseEstimate:
    """Result of :func:`estimate_noise`.

    Attributes:
        family: fitted family (a key of :data:`FAMILIES`).
        beta: β̂.
        lam: λ̂ (projected), recomputed on all estimation samples.
        lam_unprojected: the unconstrained closed form λ* at (β̂, Σ̂).
        shape: Ŝ ``(k, k)``, trace-normalized (tr Ŝ = k); Σ̂ = (σ/c_{β̂,d})² (I ⊗ Ŝ) for a known
            level σ, Σ̂ = I ⊗ Ŝ (tr = d) otherwise.
        sigmas: the known levels of the observation groups (None: trace-normalized Σ).
        dim: d.
        objective: the profiled objective on all estimation samples at the estimate.
        objective_trace, beta_trace, lam_trace: per step (minibatch objective, β, λ_t).
        heldout_mse: mean over held-out observations of ‖λ̂Ĝ − s_ref‖² (None without held-out data).
        heldout_nmse: Σ‖λ̂Ĝ − s_ref‖² / Σ‖s_ref‖² pooled over all levels.
        heldout_nmse_per_level: the same per group.
        level_scale: the known-level convention used (see :class:`EstimatorSettings`).
        timings: seconds: ``posterior`` (sampling, estimation + held-out), ``score``,
            ``fused_forward``/``fused_backward`` (et_score calls in the fit), ``fit``, ``total``.
    """

    family: str
    beta: float
    lam: float
    lam_unprojected: float
    shape: torch.Tensor
    sigmas: Optional[Tuple[float, ...]]
    dim: int
    objective: float
    objective_trace: List[float] = field(default_factory=list)
    beta_trace: List[float] = field(default_factory=list)
    lam_trace: List[float] = field(default_factory=list)
    heldout_mse: Optional[float] = None
    heldout_nmse: Optional[float] = None
    heldout_nmse_per_level: Optional[List[float]] = None
    level_scale: str = "rms"
    timings: Dict[str, float] = field(default_factory=dict)

    @property
    def u(self) -> Optional[float]:
        """û = Ŝ₁₁ − 1 when k = 2 (S = S(u, v)), else None."""
        return float(self.shape[0, 0] - 1) if self.shape.shape[-1] == 2 else None

    @property
    def v(self) -> Optional[float]:
        """v̂ = Ŝ₁₂ when k = 2, else None."""
        return float(self.shape[0, 1]) if self.shape.shape[-1] == 2 else None

    def covariance(self, sigma: Optional[float] = None) -> torch.Tensor:
        """Σ̂ as a dense ``(d, d)`` matrix at known level ``sigma`` (None: the trace-normalized Σ̂)."""
        S = self.shape
        if sigma is not None:
            S = S * float(level_variance(torch.tensor(sigma, dtype=S.dtype), torch.tensor(self.beta, dtype=S.dtype), self.dim, self.level_scale))
        return _kron_identity(S, self.dim)

    def shape_error(self, shape_true: torch.Tensor) -> float:
        """‖Ŝ − S*‖_F."""
        return float(torch.linalg.matrix_norm(self.shape - shape_true.to(self.shape.dtype)))

    def to_dict(self) -> dict:
        """JSON-ready summary (traces included)."""
        return {
            "family": self.family,
            "beta": self.beta,
            "lam": self.lam,
            "lam_unprojected": self.lam_unprojected,
            "u": self.u,
            "v": self.v,
            "shape": self.shape.tolist(),
            "sigmas": None if self.sigmas is None else list(self.sigmas),
            "dim": self.dim,
            "objective": self.objective,
            "heldout_mse": self.heldout_mse,
            "heldout_nmse": self.heldout_nmse,
            "heldout_nmse_per_level": self.heldout_nmse_per_level,
            "level_scale": self.level_scale,
            "timings": self.timings,
            "objective_trace": self.objective_trace,
            "beta_trace": self.beta_trace,
            "lam_trace": self.lam_trace,
        }


# ---------------------------------------------------------------------------- input handling
def _groups(value, name: str) -> List[torch.Tensor]:
    """A tensor (one group) or a list/tuple of tensors (one per known level) as a list."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        if not all(isinstance(t, torch.Tensor) for t in value):
            raise TypeError(f"{name} must be a tensor or a sequence of tensors, got {[type(t).__name__ for t in value]}")
        return list(value)
    raise TypeError(f"{name} must be a tensor or a sequence of tensors (one per level), got {type(value).__name__}")


def _check_group_count(groups: List[torch.Tensor], name: str, n_groups: int) -> None:
    if len(groups) != n_groups:
        raise ValueError(f"{name} must have one entry per observation group ({n_groups}), got {len(groups)}")


def _levels(sigma, n_groups: int) -> Optional[List[float]]:
    if sigma is None:
        return None
    values = [sigma] if isinstance(sigma, (int, float)) and not isinstance(sigma, bool) else sigma
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"sigma must be None, a float or a sequence of floats (one per group), got {type(sigma).__name__}")
    if len(values) != n_groups:
        raise ValueError(f"sigma must give one known level per observation group ({n_groups} groups), got {len(values)}")
    out = []
    for s in values:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (s > 0 and math.isfinite(s)):
            raise ValueError(f"every known level sigma must be a finite float > 0, got {s!r}")
        out.append(float(s))
    return out


def _check_observations(groups: List[torch.Tensor], name: str, d: Optional[int] = None, device=None) -> int:
    if not groups:
        raise ValueError(f"{name} must hold at least one group, got an empty sequence")
    for i, y in enumerate(groups):
        label = name if len(groups) == 1 else f"{name}[{i}]"
        if y.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{label} must be float32 or float64, got {y.dtype}")
        if y.dim() != 2:
            raise ValueError(f"{label} must have shape (n, d), got {tuple(y.shape)}")
        if y.shape[0] == 0:
            raise ValueError(f"{label} is an empty level group (shape {tuple(y.shape)}); every level needs observations")
        if d is None:
            d = y.shape[1]
        if y.shape[1] != d:
            raise ValueError(f"{label} must have d={d} columns like the other groups, got {tuple(y.shape)}")
        if device is not None and y.device != device:
            raise ValueError(f"{label} must be on the observations' device {device}, got {y.device}")
        _check_finite(y, label)
    return d


def _check_finite(t: torch.Tensor, label: str) -> None:
    """A NaN or inf in the data would reach the fit as a NaN objective (and read as 'λ not
    identifiable' or a NaN λ): refuse it by name instead."""
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{label} must be finite, got {t.detach()[where].item()} at index {where}")


def _check_values_like(t: torch.Tensor, y: torch.Tensor, label: str) -> None:
    """Draws or scores for observations y: real values (a cast to y's dtype would drop an imaginary
    part silently), on y's device, finite."""
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{label} must be a real floating-point tensor, got {t.dtype}")
    if t.device != y.device:
        raise ValueError(f"{label} must be on the observations' device {y.device}, got {t.device}")
    _check_finite(t, label)


def _draws(
    groups_y: List[torch.Tensor], levels, posterior, posterior_samples, K: int, generator, name: str
) -> List[torch.Tensor]:
    if (posterior is None) == (posterior_samples is None):
        raise ValueError(f"give exactly one of posterior (a sampler) and {name} (pre-drawn samples)")
    if posterior_samples is not None:
        xs = _groups(posterior_samples, name)
        _check_group_count(xs, name, len(groups_y))
    else:
        if not callable(posterior):
            raise TypeError(f"posterior must be callable as posterior(y, sigma, K, generator), got {type(posterior).__name__}")
        if generator is None:
            raise ValueError("generator is required to draw posterior samples (randomness is always explicit)")
        xs = [posterior(y, None if levels is None else levels[i], K, generator) for i, y in enumerate(groups_y)]
    for i, (y, x) in enumerate(zip(groups_y, xs)):
        label = name if len(xs) == 1 else f"{name}[{i}]"
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[1] or x.shape[1] < 1:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{label} must have shape (n={y.shape[0]}, K, d={y.shape[1]}) with K >= 1, got {got}")
        _check_values_like(x, y, label)
    return [x.to(y.dtype) for y, x in zip(groups_y, xs)]


def _scores(groups_y: List[torch.Tensor], levels, score, scores, name: str, score_name: str) -> List[torch.Tensor]:
    if (score is None) == (scores is None):
        raise ValueError(f"give exactly one of {score_name} (a score function) and {name} (pre-computed scores)")
    if scores is not None:
        ss = _groups(scores, name)
        _check_group_count(ss, name, len(groups_y))
    else:
        if not callable(score):
            raise TypeError(f"{score_name} must be callable as score(y, sigma), got {type(score).__name__}")
        ss = [score(y, None if levels is None else levels[i]) for i, y in enumerate(groups_y)]
    for i, (y, s) in enumerate(zip(groups_y, ss)):
        label = name if len(ss) == 1 else f"{name}[{i}]"
        if not isinstance(s, torch.Tensor) or s.shape != y.shape:
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{label} must have the shape of its observations {tuple(y.shape)}, got {got}")
        _check_values_like(s, y, label)
    return [s.to(y.dtype) for y, s in zip(groups_y, ss)]


def _heldout(observations, reference, samples, posterior, groups_y, levels, n_posterior, generator):
    """(observations, draws, reference scores) of the held-out set, grouped like the fit's, or None."""
    if observations is None and reference is None:
        return None
    if observations is None or reference is None:
        raise ValueError("heldout_observations and heldout_reference must be given together")
    y0 = groups_y[0]
    hy = _groups(observations, "heldout_observations")
    _check_group_count(hy, "heldout_observations", len(groups_y))
    _check_observations(hy, "heldout_observations", y0.shape[-1], y0.device)
    hy = [h.to(y0.dtype) for h in hy]
    if samples is None and posterior is None:
        raise ValueError("heldout_posterior_samples are needed when no posterior sampler is given")
    hx = _draws(hy, levels, posterior if samples is None else None, samples, n_posterior, generator,
                "heldout_posterior_samples")
    hs = _scores(hy, levels, None, reference, "heldout_reference", "heldout score")
    return hy, hx, hs


@torch.no_grad()
def _heldout_errors(held, levels, lam, beta, S, level_scale) -> Tuple[float, float, List[float]]:
    """(MSE per observation, NMSE, NMSE per level) of the fitted score λ̂ G against the reference."""
    err, power, count, per_level = 0.0, 0.0, 0, []
    for i, (yh, xh, sh) in enumerate(zip(*held)):
        sg = None if levels is None else torch.full((yh.shape[0],), levels[i], dtype=yh.dtype, device=yh.device)
        pred = lam * residual_field(yh, xh, beta, _geometry(S, yh.shape[-1], beta, sg, level_scale))
        e, p = float((pred - sh).pow(2).sum()), float(sh.pow(2).sum())
        per_level.append(e / p if p > 0 else math.nan)
        err, power, count = err + e, power + p, count + yh.shape[0]
    return err / count, err / power if power > 0 else math.nan, per_level


# ---------------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class _Call:
    """The checked options of one :func:`estimate_noise` call."""

    family: str
    settings: EstimatorSettings
    generator: Optional[torch.Generator]
    progress: bool

    @property
    def free_beta(self) -> bool:
        return FAMILIES[self.family][0]

    @property
    def free_shape(self) -> bool:
        return FAMILIES[self.family][1]


def _check_call(family, settings, generator, progress) -> _Call:
    check_bool(progress, "progress")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    settings = EstimatorSettings() if settings is None else settings
    if not isinstance(settings, EstimatorSettings):
        raise TypeError(f"settings must be an EstimatorSettings, got {type(settings).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return _Call(family, settings, generator, progress)


def _observation_groups(observations, sigma, settings: EstimatorSettings) -> Tuple[List[torch.Tensor], Optional[List[float]], int]:
    """(the observation groups, their known levels or None, the block size k of S), checked."""
    groups_y = _groups(observations, "observations")
    d = _check_observations(groups_y, "observations")
    levels = _levels(sigma, len(groups_y))
    dtype, device = groups_y[0].dtype, groups_y[0].device
    for i, y in enumerate(groups_y):
        if y.dtype != dtype or y.device != device:
            raise TypeError(f"observations[{i}] must share dtype/device {dtype}/{device}, got {y.dtype}/{y.device}")
    k = settings.block_size if settings.block_size is not None else (2 if levels is not None and d % 2 == 0 else d)
    if d % k:
        raise ValueError(f"settings.block_size k={k} must divide d={d}")
    if levels is not None and k != 2 and settings.block_size is None:
        raise ValueError(f"known levels sigma need an even d (the (σ, u, v) geometry), got d={d}")
    return groups_y, levels, k


@contextmanager
def _timed(timings: Dict[str, float], key: str):
    t0 = time.perf_counter()
    yield
    timings[key] += time.perf_counter() - t0


@dataclass(frozen=True)
class _Pooled:
    """The groups pooled into one ``(n, K, d)`` problem; each row keeps its known level."""

    y: torch.Tensor  # (n, d)
    x: torch.Tensor  # (n, K, d)
    s: torch.Tensor  # (n, d)
    sigma: Optional[torch.Tensor]  # (n,), None without known levels
    split_half: bool
    level_scale: str

    @classmethod
    def of(cls, groups_y, xs, ss, levels, settings: EstimatorSettings) -> "_Pooled":
        Ks = {x.shape[1] for x in xs}
        if len(Ks) != 1:
            raise ValueError(f"every group must have the same number of posterior draws K, got {sorted(Ks)}")
        y = groups_y[0]
        sigma = None
        if levels is not None:
            sigma = torch.cat([torch.full((g.shape[0],), lv, dtype=y.dtype, device=y.device) for g, lv in zip(groups_y, levels)])
        pooled = cls(torch.cat(groups_y), torch.cat(xs), torch.cat(ss), sigma, settings.split_half, settings.level_scale)
        if pooled.split_half and pooled.x.shape[1] < 2:
            raise ValueError(f"split_half needs K >= 2 posterior draws per observation, got K = {pooled.x.shape[1]}")
        return pooled

    @property
    def n(self) -> int:
        return self.y.shape[0]

    def field(self, idx: torch.Tensor, beta: torch.Tensor, S: torch.Tensor):
        """(G, per-row ‖G‖² estimate or None) at rows ``idx``: G over all K draws; with split_half ⟨Ĝ_A, Ĝ_B⟩ too."""
        yy, xx = self.y[idx], self.x[idx]
        metric = _geometry(S, yy.shape[-1], beta, None if self.sigma is None else self.sigma[idx], self.level_scale)
        if not self.split_half:
            return residual_field(yy, xx, beta, metric), None
        half = xx.shape[1] // 2
        g_a = residual_field(yy, xx[:, :half], beta, metric)
        g_b = residual_field(yy, xx[:, half : 2 * half], beta, metric)
        G = (g_a + g_b) / 2
        if xx.shape[1] % 2:  # odd K: the last draw joins G (weight 1/K), not the power estimate
            G = (G * (2 * half) + residual_field(yy, xx[:, -1:], beta, metric)) / xx.shape[1]
        return G, (g_a * g_b).sum(-1)


@dataclass(frozen=True)
class _Parameters:
    """The optimized parameters — ζ of β and the Cholesky parameter φ of S, None where the family
    fixes them (β ≡ 2, S = I) — and (β, S) read from them."""

    zeta: Optional[torch.Tensor]
    phi: Optional[torch.Tensor]
    eye: torch.Tensor  # S of a fixed shape, (k, k)
    beta_min: float

    @classmethod
    def start(cls, call: _Call, k: int, like: torch.Tensor) -> "_Parameters":
        settings, dtype, device = call.settings, like.dtype, like.device
        zeta = phi = None
        if call.free_beta:
            zeta = torch.tensor(zeta_from_beta(settings.beta_init, settings.beta_min), dtype=dtype, device=device,
                                requires_grad=True)
        if call.free_shape:
            phi = torch.zeros(k, k, dtype=dtype, device=device, requires_grad=True)
        return cls(zeta, phi, torch.eye(k, dtype=dtype, device=device), settings.beta_min)

    @property
    def trainable(self) -> List[torch.Tensor]:
        return [p for p in (self.zeta, self.phi) if p is not None]

    def current(self) -> Tuple[torch.Tensor, torch.Tensor]:
        eye = self.eye
        beta = beta_from_zeta(self.zeta, self.beta_min) if self.zeta is not None else torch.tensor(2.0, dtype=eye.dtype, device=eye.device)
        return beta, shape_from_cholesky(self.phi) if self.phi is not None else eye


def _fit(params: _Parameters, pooled: _Pooled, call: _Call, timings: Dict[str, float]):
    """The gradient steps on the profiled objective (none when the family fixes β and S, or with
    ``steps = 0``); returns the per-step (objective, β, λ_t) traces."""
    settings, generator, n = call.settings, call.generator, pooled.n
    objective_trace: List[float] = []
    beta_trace: List[float] = []
    lam_trace: List[float] = []
    if not params.trainable or settings.steps == 0:
        return objective_trace, beta_trace, lam_trace
    if settings.optimizer == "adam":
        opt = torch.optim.Adam(params.trainable, lr=settings.lr)
    else:
        opt = torch.optim.SGD(params.trainable, lr=settings.lr, momentum=0.9)
    batch = min(settings.batch_size, n)
    if batch < n and generator is None:
        raise ValueError("generator is required for minibatch steps (batch_size < n); randomness is always explicit")
    device = pooled.y.device

    def loss_and_grad(step: int) -> torch.Tensor:
        if batch < n:
            idx = torch.randperm(n, generator=generator, device=generator.device)[:batch].to(device)
        else:
            idx = torch.arange(n, device=device)
        beta, S = params.current()
        with _timed(timings, "fused_forward"):
            G, power = pooled.field(idx, beta, S)
        s_b = pooled.s[idx]
        with torch.no_grad():
            lam_t, _ = profile_lambda(s_b, G, settings.lam_min, settings.lam_max,
                                      field_power=None if power is None else power.detach())
        # λ_t enters as a constant: the envelope theorem makes ∂J/∂λ vanish at the profile.
        loss = profiled_objective(s_b, G, lam_t, field_power=power)
        with _timed(timings, "fused_backward"):
            loss.backward()
        objective_trace.append(loss.item())
        beta_trace.append(beta.item())
        lam_trace.append(lam_t.item())
        return loss.detach()

    def after_step(done: int, _: torch.Tensor) -> bool:
        if done % 25 == 0:
            bar.set_postfix(J=f"{objective_trace[-1]:.4g}", beta=f"{beta_trace[-1]:.4f}", lam=f"{lam_trace[-1]:.4f}")
        return False

    with tqdm(total=settings.steps, desc=f"estimate ({call.family})", disable=not call.progress, leave=False) as bar:
        optimize(opt, loss_and_grad, start=0, stop=settings.steps, bar=bar, after_step=after_step,
                 lr_at=lambda step: warmup_cosine(step, settings.steps, settings.lr,
                                                  settings.lr * settings.lr_final_fraction))
    return objective_trace, beta_trace, lam_trace


@torch.no_grad()
def _final_fit(params: _Parameters, pooled: _Pooled, settings: EstimatorSettings):
    """(β̂, Ŝ, λ̂, λ*, objective) with λ recomputed on all estimation samples."""
    beta, S = params.current()
    G, power = pooled.field(torch.arange(pooled.n, device=pooled.y.device), beta, S)
    lam_hat, lam_raw = profile_lambda(pooled.s, G, settings.lam_min, settings.lam_max, field_power=power)
    return beta, S, lam_hat, lam_raw, float(profiled_objective(pooled.s, G, lam_hat, field_power=power))


# ---------------------------------------------------------------------------- Algorithm 1
def estimate_noise(
    observations: Tensors,
    *,
    sigma=None,
    posterior: Optional[PosteriorSampler] = None,
    posterior_samples: Optional[Tensors] = None,
    score: Optional[ScoreFunction] = None,
    scores: Optional[Tensors] = None,
    family: str = "generalized",
    settings: Optional[EstimatorSettings] = None,
    heldout_observations: Optional[Tensors] = None,
    heldout_reference: Optional[Tensors] = None,
    heldout_posterior_samples: Optional[Tensors] = None,
    generator: Optional[torch.Generator] = None,
    progress: bool = True,
) -> NoiseEstimate:
    """Profiled noise-parameter estimation, Algorithm 1 of the paper.

    Args:
        observations: noisy observations ``(n, d)``, or a sequence of ``(n_l, d)`` groups, one
            per known noise level.
        sigma: None (Σ trace-normalized, tr Σ = d; λ carries the scale), a float (one known
            level) or a sequence of floats, one per group (Σ = (σ/c_{β,d})² (I ⊗ S)).
        posterior: sampler ``posterior(y (m, d), sigma, K, generator) -> (m, K, d)``; called
            once per group (K = ``settings.n_posterior``) and the draws reused at every step.
        posterior_samples: pre-drawn ``(n, K, d)`` (or per group), instead of ``posterior``.
        score: score estimator ``score(y (m, d), sigma) -> (m, d)`` (must not use the noise
            parameters), or
        scores: pre-computed scores at the observations ``(n, d)`` (or per group).
        family: ``"generalized"``, ``"gaussian"`` (β ≡ 2), ``"isotropic"`` (S = I) or
            ``"isotropic_gaussian"``.
        settings: :class:`EstimatorSettings` (defaults if None).
        heldout_observations: optional held-out observations, grouped like ``observations``.
        heldout_reference: reference (oracle) scores at the held-out observations.
        heldout_posterior_samples: draws at the held-out observations (default: drawn with
            ``posterior``).
        generator: the ``torch.Generator`` of minibatches and posterior draws.
        progress: tqdm bar over the gradient steps.

    Returns:
        :class:`NoiseEstimate` with (β̂, λ̂, Ŝ, û, v̂), the objective trace and held-out errors.

    Raises:
        ValueError / TypeError naming the argument for: an unknown family, β_min ∉ (0, 2)
        (in ``settings``), empty level groups, mismatched shapes or group counts, a missing or
        doubly-given posterior/score source.
    """
    t_start = time.perf_counter()
    call = _check_call(family, settings, generator, progress)
    settings = call.settings
    groups_y, levels, k = _observation_groups(observations, sigma, settings)

    timings = {"posterior": 0.0, "score": 0.0, "fused_forward": 0.0, "fused_backward": 0.0, "fit": 0.0}
    with _timed(timings, "posterior"):
        xs = _draws(groups_y, levels, posterior, posterior_samples, settings.n_posterior, generator, "posterior_samples")
    with _timed(timings, "score"):
        ss = _scores(groups_y, levels, score, scores, "scores", "score")
    with _timed(timings, "posterior"):
        held = _heldout(heldout_observations, heldout_reference, heldout_posterior_samples, posterior, groups_y, levels,
                        settings.n_posterior, generator)
    pooled = _Pooled.of(groups_y, xs, ss, levels, settings)
    params = _Parameters.start(call, k, pooled.y)

    with _timed(timings, "fit"):
        objective_trace, beta_trace, lam_trace = _fit(params, pooled, call, timings)
        beta, S, lam_hat, lam_raw, objective = _final_fit(params, pooled, settings)

    result = NoiseEstimate(
        family=family,
        beta=float(beta),
        lam=float(lam_hat),
        lam_unprojected=float(lam_raw),
        shape=S.detach().clone(),
        sigmas=None if levels is None else tuple(levels),
        dim=pooled.y.shape[-1],
        objective=objective,
        objective_trace=objective_trace,
        beta_trace=beta_trace,
        lam_trace=lam_trace,
        level_scale=settings.level_scale,
        timings=timings,
    )
    if held is not None:
        errors = _heldout_errors(held, levels, lam_hat, beta, S, settings.level_scale)
        result.heldout_mse, result.heldout_nmse, result.heldout_nmse_per_level = errors
    timings["total"] = time.perf_counter() - t_start
    return result
