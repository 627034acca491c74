"""Score estimation from a posterior model: Energy-Tweedie scores, the IS oracle, Richardson extrapolation.

The fourth stage of the data path (data → noise → posterior → **score** → sampler → metrics).

* :class:`EnergyTweedieScore` turns a posterior model into the noisy score (paper Eq.
  ``sm_finite_sample``, DESIGN §1)::

      ŝ(y) = −λ Σ⁻¹ (1/N) Σ_i ‖y − X⁽ⁱ⁾‖_{Σ⁻¹}^{β−2} (y − X⁽ⁱ⁾),   X⁽ⁱ⁾ ~ P_θ(X | Y = y, η)

  with each query's own tuple (β, λ, σ, u, v), η = (β, log λ, log σ, u, v) and
  Σ = (σ/c_{β,d})² (I_{d/2} ⊗ S(u, v)).  The same draws give the posterior-mean estimate
  (1/N) Σ_i X⁽ⁱ⁾.  Its error splits into the model's bias plus a Monte-Carlo term
  tr Cov(h)/N (paper Eq. ``score_mc_error_decomposition``), hence NMSE ≈ a + b/N
  (:func:`fit_mc_budget`).
* :class:`ISOracle` is the reference: self-normalized importance sampling over a clean bank
  (160,000 points in the paper, :func:`etweedie.is_score`), s_ref(y) = Σ_j w_j ∇ log q(y − x_j),
  w_j ∝ q(y − x_j); the disagreement of the references built on two independent halves of the
  bank is the floor below which no NMSE against the reference is meaningful.
* :func:`richardson` extrapolates the clean score from two noise levels Σ = ε² Σ₀ (paper Eq.
  ``richardson_extrapolation``)::

      ŝ_RE(y) = (ε₂² ŝ_{ε₁}(y) − ε₁² ŝ_{ε₂}(y)) / (ε₂² − ε₁²) = ∇ log p(y) + O(ε₁² ε₂²) + estimation error.

  With the five-parameter tuple, Σ ∝ σ² at fixed (β, u, v), so ε is σ (only ε₁/ε₂ matters).

Example::

    >>> import torch
    >>> from etweedie.noise import NoiseParams
    >>> from etweedie.posteriors.known import KnownPosterior
    >>> g = torch.Generator().manual_seed(0)
    >>> score = EnergyTweedieScore(KnownPosterior(method="sir", bank_size=20_000, generator=g), 64, generator=g)
    >>> y = torch.tensor([[2.3, 0.1], [0.0, 1.0]], dtype=torch.float64)
    >>> score(y, NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6)).shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ._checks import check_generator, check_int
from .noise import NoiseParams
from .ops import et_score, is_score

__all__ = [
    "EnergyTweedieScore",
    "ISOracle",
    "ISResult",
    "fit_mc_budget",
    "mean_cosine",
    "posterior_dtype_device",
    "posterior_mean_mse",
    "richardson",
    "richardson_score",
    "score_from_draws",
    "score_nmse",
]

Scalar = Union[float, torch.Tensor]


# ---------------------------------------------------------------------------- metrics
def score_nmse(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """NMSE = E‖ŝ − s‖² / E‖s‖², both expectations over the queries (leading dims of ``(..., d)``).

    Computed in float64 after dividing both fields by their largest magnitude (the ratio is
    scale-free), so float32 fields from 1e-30 to 1e30 give the right number instead of 0/0.

    Example::

        >>> score_nmse(torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]))
        0.25
    """
    _check_pair(estimate, reference, "score_nmse")
    e, r = _jointly_scaled(estimate, reference)
    return float((e - r).pow(2).sum(-1).mean() / r.pow(2).sum(-1).mean())


def mean_cosine(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over queries of the cosine similarity of ŝ(y) and s(y), ``(..., d)`` fields.

    Each row is divided by its own largest magnitude and the cosine taken in float64, so it is
    right at any scale a float32 or float64 field can hold; a row where either field is zero
    counts as cosine 0 (``F.cosine_similarity``'s convention).
    """
    _check_pair(estimate, reference, "mean_cosine")
    a, b = (_row_normalized(t.detach().double()) for t in (estimate, reference))
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    cos = torch.where(norms > 0, (a * b).sum(-1) / torch.where(norms > 0, norms, torch.ones_like(norms)),
                      torch.zeros_like(norms))
    return float(cos.clamp(-1.0, 1.0).mean())


def posterior_mean_mse(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """Posterior-mean MSE: the mean over queries *and coordinates* of (m̂ − m)² (``F.mse_loss``), in float64."""
    _check_pair(estimate, reference, "posterior_mean_mse")
    return float((estimate.detach().double() - reference.detach().double()).pow(2).mean())


def _row_normalized(t: torch.Tensor) -> torch.Tensor:
    """Every row divided by its largest magnitude (zero rows stay zero; NaN/inf propagate)."""
    peak = t.abs().amax(dim=-1, keepdim=True)
    return t / torch.where(peak > 0, peak, torch.ones_like(peak))


def _jointly_scaled(estimate: torch.Tensor, reference: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both fields in float64, divided by one common largest finite magnitude (when it is > 0)."""
    e, r = estimate.detach().double(), reference.detach().double()
    both = torch.cat([e.reshape(-1), r.reshape(-1)]).abs()
    both = both[torch.isfinite(both)]
    peak = float(both.max()) if both.numel() else 0.0
    if peak > 0:
        e, r = e / peak, r / peak
    return e, r


def _check_pair(
    estimate, reference, name: str, args: Tuple[str, str] = ("estimate", "reference"), *, allow_empty: bool = False
) -> None:
    for arg, t in zip(args, (estimate, reference)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: {arg} must be a floating-point tensor (..., d), got {got}")
        if t.dim() < 1:
            raise ValueError(f"{name}: {arg} must have shape (..., d), got a 0-d tensor")
        if t.is_meta:
            raise ValueError(f"{name}: {arg} must hold data, got a tensor on the meta device")
    if estimate.shape != reference.shape:
        raise ValueError(f"{name}: {args[0]} and {args[1]} must have one shape, got {tuple(estimate.shape)} and {tuple(reference.shape)}")
    if estimate.device != reference.device:
        raise ValueError(f"{name}: {args[0]} and {args[1]} must be on one device, got {estimate.device} and {reference.device}")
    if estimate.numel() == 0 and not allow_empty:
        raise ValueError(f"{name}: need at least one query, got shape {tuple(estimate.shape)}")


def fit_mc_budget(n_draws: Sequence[float], nmse: Sequence[float]) -> Tuple[float, float]:
    """Least-squares fit NMSE ≈ a + b/N (paper Eq. ``score_mc_error_decomposition``).

    ``a`` is the model's bias floor (the N-independent term), ``b`` the posterior Monte-Carlo
    variance tr Cov(h) / E‖s‖².  Several measurements per N (models, repetitions) are pooled.

    Args:
        n_draws: budgets N ≥ 1 (at least two distinct values).
        nmse: the NMSE measured at each budget, same length.

    Returns:
        ``(a, b)``.

    Example::

        >>> a, b = fit_mc_budget([1, 2, 4, 8], [0.02 + 1.4 / n for n in (1, 2, 4, 8)])
        >>> round(a, 6), round(b, 6)
        (0.02, 1.4)
    """
    try:
        n = torch.as_tensor(n_draws, dtype=torch.float64).flatten()
        e = torch.as_tensor(nmse, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"n_draws and nmse must be sequences of numbers, got {n_draws!r} and {nmse!r}") from None
    if n.numel() != e.numel():
        raise ValueError(f"n_draws and nmse must have one length, got {n.numel()} and {e.numel()}")
    if n.numel() and not bool((n >= 1).all() & torch.isfinite(n).all()):
        raise ValueError(f"n_draws must all be finite and >= 1, got {n.tolist()}")
    if not bool(torch.isfinite(e).all()):
        raise ValueError(f"nmse must be finite, got {e.tolist()}")
    if torch.unique(n).numel() < 2:
        raise ValueError(f"n_draws must hold at least two distinct budgets to fit a + b/N, got {n.tolist()}")
    design = torch.stack([torch.ones_like(n), 1.0 / n], dim=-1)
    solution = torch.linalg.lstsq(design, e[:, None]).solution.squeeze(-1)
    return float(solution[0]), float(solution[1])


# ---------------------------------------------------------------------------- parameters per row
def _check_params(noise_params) -> NoiseParams:
    if not isinstance(noise_params, NoiseParams):
        raise TypeError(f"noise_params must be an etweedie.NoiseParams, got {type(noise_params).__name__}")
    return noise_params


def _check_queries(y, name: str = "y") -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        got = y.dtype if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"{name} must be a floating-point tensor (..., d), got {got}")
    if y.dim() < 1:
        raise ValueError(f"{name} must have shape (..., d), got a 0-d tensor")
    return y


def _rows(noise_params: NoiseParams, y: torch.Tensor) -> Tuple[torch.Size, torch.Tensor]:
    """Broadcast the tuple against y's batch: ``(batch, fields (R, 5))`` with R = prod(batch).

    ``fields`` holds (β, λ, σ, u, v) per row in y's dtype and device.
    """
    values = [getattr(noise_params, n) for n in ("beta", "lam", "sigma", "u", "v")]
    tensors = [torch.as_tensor(x, dtype=y.dtype, device=y.device) for x in values]
    try:
        batch = torch.broadcast_shapes(y.shape[:-1], *(t.shape for t in tensors))
    except RuntimeError:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(("beta", "lam", "sigma", "u", "v"), tensors))
        raise ValueError(f"noise_params ({shapes}) must broadcast with y's batch shape {tuple(y.shape[:-1])}") from None
    if batch != y.shape[:-1]:
        raise ValueError(
            f"noise_params must broadcast to y's batch shape {tuple(y.shape[:-1])} (one tuple per query), "
            f"got a broadcast shape {tuple(batch)}"
        )
    fields = torch.stack([t.expand(batch).reshape(-1) for t in tensors], dim=-1)
    return batch, fields


def _params_of(fields: torch.Tensor) -> NoiseParams:
    beta, lam, sigma, u, v = fields.unbind(-1)
    return NoiseParams(beta, lam, sigma, u, v)


def posterior_dtype_device(posterior) -> Tuple[Optional[torch.dtype], Optional[torch.device]]:
    """The float dtype and device of a torch module's parameters (None for other posteriors)."""
    parameters = getattr(posterior, "parameters", None)
    if not callable(parameters):
        return None, None
    for p in parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return None, None


def _accepts_keyword(function, name: str) -> bool:
    """Whether ``function`` takes the keyword argument ``name`` (or ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) or p.kind == p.VAR_KEYWORD
               for p in parameters)


def antithetic_options(posterior, antithetic) -> dict:
    """The extra ``posterior.sample`` keywords for an ``antithetic`` request: ``{}`` or
    ``{"antithetic": True}``; TypeError for a non-bool or a posterior whose ``sample`` lacks it."""
    if not isinstance(antithetic, bool):
        raise TypeError(f"antithetic must be a bool, got {type(antithetic).__name__}")
    if antithetic and not _accepts_keyword(posterior.sample, "antithetic"):
        raise TypeError(
            f"antithetic=True needs a posterior whose sample() takes antithetic=, got {type(posterior).__name__}"
        )
    return {"antithetic": True} if antithetic else {}


# ---------------------------------------------------------------------------- Energy-Tweedie score
class EnergyTweedieScore:
    """A score function s(y; η) from a posterior model and N draws per query (paper Eq. ``sm_finite_sample``).

    Args:
        posterior: any object with ``dim`` and ``sample(y (..., d), eta (..., 5), n, *, generator)
            -> (..., n, d)`` — a trained :mod:`etweedie.posteriors.engression` posterior or an
            :class:`etweedie.posteriors.known.KnownPosterior` (``method="sir"``).  A torch module is called in its own
            parameter dtype and device; results come back in y's.
        n_draws: N ≥ 1 posterior draws per query.
        generator: the ``torch.Generator`` the draws come from; None uses a fresh one seeded
            with 0 (every call stays reproducible).  A ``generator=`` given to a call wins.
        chunk: queries per posterior call (bounds memory at chunk·N·d); None = all at once.
        antithetic: ask the posterior for antithetic draws (``sample(..., antithetic=True)``, e.g.
            :meth:`etweedie.posteriors.engression.EngressionPosterior.sample`): the N draws come in mirrored
            noise pairs, so the estimate stays unbiased and its Monte Carlo error drops — on the
            full eight-Gaussians models, score NMSE at N = 64 fell 2.7–4.6×
            (experiments/eight_gaussians/RESULTS.md).  A posterior whose ``sample`` takes no ``antithetic`` keyword is a TypeError.

    Calling ``score(y, noise_params)`` returns ``(..., d)``: the score at every query y under its
    own tuple ``noise_params`` (a :class:`NoiseParams` whose fields broadcast to y's batch shape),
    with the metric ``noise_params.metric(d)`` and each row's own β and λ.  Sampling runs without
    autograd; ``et_score`` does not, so gradients reach y, β, λ, σ, u and v with the draws held
    fixed.
    """

    def __init__(
        self,
        posterior,
        n_draws: int,
        *,
        generator: Optional[torch.Generator] = None,
        chunk: Optional[int] = None,
        antithetic: bool = False,
    ):
        if not callable(getattr(posterior, "sample", None)):
            raise TypeError(f"posterior must have a sample(y, eta, n, *, generator) method, got {type(posterior).__name__}")
        n_draws = check_int(n_draws, "n_draws", minimum=1)
        if generator is not None:
            check_generator(generator, "generator (or None)")
        if chunk is not None:
            chunk = check_int(chunk, "chunk (or None)", minimum=1)
        self._options = antithetic_options(posterior, antithetic)
        self.posterior = posterior
        self.antithetic = antithetic
        self.n_draws = n_draws
        self.generator = torch.Generator().manual_seed(0) if generator is None else generator
        self.chunk = chunk

    def __repr__(self) -> str:
        extra = ", antithetic=True" if self.antithetic else ""
        return f"EnergyTweedieScore({type(self.posterior).__name__}, n_draws={self.n_draws}, chunk={self.chunk}{extra})"

    def draws(
        self, y: torch.Tensor, noise_params: NoiseParams, *, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """Posterior draws X⁽ⁱ⁾ ~ P_θ(X | y, η) for every query: ``(..., N, d)`` in y's dtype."""
        y = _check_queries(y)
        batch, fields = _rows(_check_params(noise_params), y)
        return self._draws(y.reshape(-1, y.shape[-1]), fields, generator).reshape(*batch, self.n_draws, y.shape[-1])

    def _draws(self, rows_y: torch.Tensor, fields: torch.Tensor, generator) -> torch.Tensor:
        generator = self.generator if generator is None else generator
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        dim = getattr(self.posterior, "dim", None)
        if dim is not None and dim != rows_y.shape[-1]:
            raise ValueError(f"y must have last dimension d = {dim} (the posterior's), got {rows_y.shape[-1]}")
        dtype, device = posterior_dtype_device(self.posterior)
        dtype = rows_y.dtype if dtype is None else dtype
        device = rows_y.device if device is None else device
        out = rows_y.new_empty(rows_y.shape[0], self.n_draws, rows_y.shape[-1])
        chunk = self.chunk or max(rows_y.shape[0], 1)
        with torch.no_grad():
            for start in range(0, rows_y.shape[0], chunk):
                stop = start + chunk
                eta = _params_of(fields[start:stop].detach()).eta()
                x = self.posterior.sample(
                    rows_y[start:stop].detach().to(dtype=dtype, device=device),
                    eta.to(dtype=dtype, device=device),
                    self.n_draws,
                    generator=generator,
                    **self._options,
                )
                expected = (min(stop, rows_y.shape[0]) - start, self.n_draws, rows_y.shape[-1])
                if tuple(x.shape) != expected:
                    raise ValueError(f"posterior.sample must return (rows, n, d) = {expected}, got {tuple(x.shape)}")
                out[start:stop] = x.to(dtype=rows_y.dtype, device=rows_y.device)
        return out

    def score_and_mean(
        self, y: torch.Tensor, noise_params: NoiseParams, *, generator: Optional[torch.Generator] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The Energy-Tweedie score and the posterior-mean estimate (1/N) Σ_i X⁽ⁱ⁾ from the same draws.

        Returns ``(score (..., d), posterior_mean (..., d))``.
        """
        y = _check_queries(y)
        noise_params = _check_params(noise_params)
        batch, fields = _rows(noise_params, y)
        x = self._draws(y.reshape(-1, y.shape[-1]), fields, generator)
        x = x.reshape(*batch, self.n_draws, y.shape[-1])
        return score_from_draws(y, noise_params, x), x.mean(-2)

    def __call__(
        self, y: torch.Tensor, noise_params: NoiseParams, *, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        """ŝ(y) under each query's tuple: ``y (..., d)`` → ``(..., d)``."""
        return self.score_and_mean(y, noise_params, generator=generator)[0]


def score_from_draws(y: torch.Tensor, noise_params: NoiseParams, draws: torch.Tensor) -> torch.Tensor:
    """ŝ(y) = −λ Σ⁻¹ (1/N) Σ_i ‖y − X⁽ⁱ⁾‖^{β−2}_{Σ⁻¹} (y − X⁽ⁱ⁾) from given draws, each row with its own tuple.

    Args:
        y: queries ``(..., d)``.
        noise_params: a :class:`NoiseParams` broadcasting to y's batch shape (differentiable).
        draws: posterior draws ``(..., N, d)`` (e.g. :meth:`EnergyTweedieScore.draws`, or its
            first N' draws to study the budget N' without drawing again).

    Returns:
        ``(..., d)``.
    """
    y = _check_queries(y)
    noise_params = _check_params(noise_params)
    d = y.shape[-1]
    if not isinstance(draws, torch.Tensor) or draws.dim() != y.dim() + 1 or draws.shape[:-2] != y.shape[:-1] \
            or draws.shape[-1] != d or draws.shape[-2] < 1:
        got = tuple(draws.shape) if isinstance(draws, torch.Tensor) else type(draws).__name__
        raise ValueError(f"draws must have shape (*batch, N >= 1, d) = {(*y.shape[:-1], 'N', d)}, got {got}")
    batch, _ = _rows(noise_params, y)
    # β, λ and the metric from the caller's (possibly differentiable) tensors, one per row.
    beta, lam, sigma, u, v = (
        torch.as_tensor(getattr(noise_params, n), dtype=y.dtype, device=y.device).expand(batch).reshape(-1)
        for n in ("beta", "lam", "sigma", "u", "v")
    )
    metric = NoiseParams(beta, lam, sigma, u, v).metric(d)
    s = et_score(y.reshape(-1, d), draws.reshape(-1, draws.shape[-2], d), beta, lam, metric)
    return s.reshape(*batch, d)


# ---------------------------------------------------------------------------- IS oracle
class ISResult(NamedTuple):
    """What :class:`ISOracle` returns: score ``(..., d)``, posterior mean ``(..., d)``, ESS ``(...)``."""

    score: torch.Tensor
    posterior_mean: torch.Tensor
    ess: torch.Tensor


class ISOracle:
    """Importance-sampling reference score and posterior mean from a clean bank (paper §5.1).

    ``w_j ∝ q(y − x_j)``, ``s_ref(y) = Σ_j w_j ∇_y log q(y − x_j)``, ``E[X | y] ≈ Σ_j w_j x_j``,
    computed by the fused :func:`etweedie.is_score` (one online log-sum-exp pass over the bank
    per query).  Queries may carry different tuples: rows with equal (β, λ, σ, u, v) share one
    call.

    Args:
        bank: clean samples ``(M, d)``, M ≥ 2 (the paper: 160,000 eight-Gaussians points).
        backend: forwarded to :func:`etweedie.is_score`.

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> oracle = ISOracle.eight_gaussians(20_000, generator=g)
        >>> y = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
        >>> oracle(y, NoiseParams(2.0, 1.0, 0.5)).score      # analytic: [[-0.0687, 0]]
        tensor([[-0.06..., ...]], dtype=torch.float64)
    """

    def __init__(self, bank: torch.Tensor, *, backend: Optional[str] = None):
        if not isinstance(bank, torch.Tensor) or not bank.is_floating_point():
            raise TypeError(f"bank must be a floating-point tensor (M, d), got {type(bank).__name__}")
        if bank.dim() != 2 or bank.shape[0] < 2 or bank.shape[1] < 1:
            raise ValueError(f"bank must have shape (M, d) with M >= 2 and d >= 1, got {tuple(bank.shape)}")
        self.bank = bank
        self.backend = backend
        self._cast = {}

    @classmethod
    def eight_gaussians(
        cls,
        size: int = 160_000,
        *,
        generator: torch.Generator,
        ring=None,
        dtype: torch.dtype = torch.float64,
        backend: Optional[str] = None,
    ) -> "ISOracle":
        """An oracle on ``size`` fresh points of the eight-Gaussians ring (default the paper's 160,000)."""
        from .data.ring import EightGaussians

        ring = EightGaussians() if ring is None else ring
        bank, _ = ring.sample(size, generator, dtype=dtype)
        return cls(bank, backend=backend)

    def __repr__(self) -> str:
        return f"ISOracle(bank={self.bank.shape[0]} points, d={self.bank.shape[1]})"

    def halves(self) -> Tuple["ISOracle", "ISOracle"]:
        """Two oracles on the independent halves [0, M/2) and [M/2, M) of the bank (M >= 4)."""
        if self.bank.shape[0] < 4:
            raise ValueError(f"halves (and disagreement) need a bank of M >= 4 points (two per half), "
                             f"got M = {self.bank.shape[0]}")
        half = self.bank.shape[0] // 2
        return ISOracle(self.bank[:half], backend=self.backend), ISOracle(self.bank[half:], backend=self.backend)

    def _bank_like(self, y: torch.Tensor) -> torch.Tensor:
        key = (y.dtype, y.device)
        if key not in self._cast:
            self._cast[key] = self.bank.to(dtype=y.dtype, device=y.device).contiguous()
        return self._cast[key]

    @torch.no_grad()
    def __call__(self, y: torch.Tensor, noise_params: NoiseParams) -> ISResult:
        """Reference score, posterior mean and ESS at every query under its own tuple."""
        y = _check_queries(y)
        d = y.shape[-1]
        if d != self.bank.shape[1]:
            raise ValueError(f"y must have last dimension d = {self.bank.shape[1]} (the bank's), got {d}")
        batch, fields = _rows(_check_params(noise_params), y)
        rows_y = y.reshape(-1, d)
        score, mean = torch.empty_like(rows_y), torch.empty_like(rows_y)
        ess = rows_y.new_empty(rows_y.shape[0])
        bank = self._bank_like(y)
        unique, inverse = torch.unique(fields.detach(), dim=0, return_inverse=True)
        for g in range(unique.shape[0]):
            index = (inverse == g).nonzero().squeeze(-1)
            beta, lam, sigma, u, v = (float(t) for t in unique[g])
            law = NoiseParams(torch.tensor(beta, dtype=y.dtype, device=y.device), lam, sigma, u, v).noise(d)
            s, m, e = is_score(rows_y[index], bank, law, backend=self.backend)
            score[index], mean[index], ess[index] = s, m, e
        return ISResult(score.reshape(*batch, d), mean.reshape(*batch, d), ess.reshape(batch))

    def disagreement(self, y: torch.Tensor, noise_params: NoiseParams) -> float:
        """Reference disagreement: NMSE between the references of the two bank halves, E‖s_A − s_B‖²/E‖s_B‖².

        Each half has twice the variance of the full bank, so this is about four times the
        full-bank reference's own NMSE: a conservative floor for NMSEs measured against it.
        """
        first, second = self.halves()
        return score_nmse(first(y, noise_params).score, second(y, noise_params).score)


# ---------------------------------------------------------------------------- Richardson
def _check_eps(eps, name: str, like: torch.Tensor) -> torch.Tensor:
    """A noise scale of :func:`richardson`: a real number, or a tensor broadcasting to the batch."""
    if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, torch.Tensor)) or (
            isinstance(eps, torch.Tensor) and (eps.is_complex() or eps.dtype == torch.bool)):
        raise TypeError(f"{name} must be a real number or a real tensor, got {type(eps).__name__} {eps!r}")
    e = torch.as_tensor(eps, dtype=like.dtype, device=like.device)
    try:
        ok = torch.broadcast_shapes(e.shape, like.shape[:-1]) == like.shape[:-1]
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a number or broadcast to the batch {tuple(like.shape[:-1])}, "
                         f"got shape {tuple(e.shape)}")
    return e


def richardson(s_eps1: torch.Tensor, s_eps2: torch.Tensor, eps1: Scalar, eps2: Scalar) -> torch.Tensor:
    """ŝ_RE = (ε₂² ŝ_{ε₁} − ε₁² ŝ_{ε₂}) / (ε₂² − ε₁²) (paper Eq. ``richardson_extrapolation``).

    With s_ε = ∇log p + ε² B₂ + ε⁴ B₄ + O(ε⁶) the ε² terms cancel, leaving
    ∇log p − ε₁²ε₂² B₄ + O(ε⁶).

    Args:
        s_eps1, s_eps2: score fields ``(..., d)`` at noise scales Σ = ε₁² Σ₀ and ε₂² Σ₀.
        eps1, eps2: the scales (floats, or tensors broadcasting to the batch ``(...)``); ε₁ ≠ ε₂.

    Example::

        >>> richardson(torch.tensor([0.8]), torch.tensor([0.2]), 0.1, 0.2)    # s_ε = 1 − 20 ε²
        tensor([1.])
    """
    # elementwise, so a zero-size batch gives a zero-size field
    _check_pair(s_eps1, s_eps2, "richardson", ("s_eps1", "s_eps2"), allow_empty=True)
    e1, e2 = (_check_eps(e, name, s_eps1) for e, name in ((eps1, "eps1"), (eps2, "eps2")))
    if bool((e1 <= 0).any()) or bool((e2 <= 0).any()) or not bool(torch.isfinite(e1).all() & torch.isfinite(e2).all()):
        raise ValueError(f"eps1 and eps2 must be finite and > 0, got {eps1!r} and {eps2!r}")
    if bool((e1 == e2).any()):
        raise ValueError(f"eps1 and eps2 must differ, got {eps1!r} and {eps2!r}")
    # Divided through by ε₂²: only the ratio ρ = (ε₁/ε₂)² enters, so ε² cannot overflow or
    # underflow (float32 ε = 1e20 or 1e-30 squared would give inf/inf or 0/0).
    rho = (e1 / e2).pow(2)[..., None]
    return (s_eps1 - rho * s_eps2) / (1 - rho)


def richardson_score(
    score_fn: Callable[[torch.Tensor, NoiseParams], torch.Tensor],
    y: torch.Tensor,
    noise_params: NoiseParams,
    sigma1: float,
    sigma2: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clean score at y by Richardson extrapolation over two noise magnitudes σ₁, σ₂.

    ``noise_params`` fixes (β, λ, u, v) (its σ is replaced); Σ = (σ/c_{β,d})² S(u,v) is ε²Σ₀
    with ε ∝ σ, so σ₁, σ₂ are the ε pair of :func:`richardson`.

    Args:
        score_fn: ``score_fn(y, noise_params) -> (..., d)``, e.g. an :class:`EnergyTweedieScore`,
            or an :class:`ISOracle`'s ``lambda y, p: oracle(y, p).score``.
        y: query points ``(..., d)``.
        noise_params: the tuple; only its β, λ, u, v are used.
        sigma1, sigma2: the two noise magnitudes (> 0, distinct).

    Returns:
        ``(s_RE, s_sigma1, s_sigma2)``, each ``(..., d)``.
    """
    if not callable(score_fn):
        raise TypeError(f"score_fn must be a callable score_fn(y, noise_params) -> (..., d), got {type(score_fn).__name__}")
    noise_params = _check_params(noise_params)
    s1 = score_fn(y, dataclasses.replace(noise_params, sigma=sigma1))
    s2 = score_fn(y, dataclasses.replace(noise_params, sigma=sigma2))
    return richardson(s1, s2, sigma1, sigma2), s1, s2
