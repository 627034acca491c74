"""A score function from any posterior sampler (the Energy-Tweedie route), and its Gaussian denoiser.

Given draws x_i ~ P(X | Y = y) from *any* sampler — a trained network, an MCMC chain, an exact
posterior — the score of the noisy marginal is (paper Eq. ``sm_finite_sample``; DESIGN §1)

    generalized Gaussian q(u) ∝ exp(−(λ/β)‖u‖_P^β):  s(y) = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i)
    Student-t        q(u) ∝ (1 + ‖u‖_P²)^{−c}:        s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²)

computed by the fused ops :func:`etweedie.et_score` / :func:`etweedie.student_t_score`.  The
caller picks the noise law per call.  For Gaussian noise of covariance C (β = 2) the score
gives Tweedie's denoiser D(y) = E[X | y] = y + C s(y); with C = σ² I that is the
``D(x, σ) = x + σ² s(x)`` that k-diffusion's samplers and the EDM papers call the denoiser.

Example::

    >>> import torch
    >>> from etweedie.interop import score_from_sampler
    >>> def sampler(y, n, generator):          # P(X | y) = N(y/2, ½ I): X ~ N(0, I), noise σ = 1
    ...     z = torch.randn(*y.shape[:-1], n, y.shape[-1], generator=generator, dtype=y.dtype)
    ...     return y.unsqueeze(-2) / 2 + z * 0.5 ** 0.5
    >>> score = score_from_sampler(sampler, n_draws=20_000, generator=torch.Generator().manual_seed(0))
    >>> y = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    >>> score(y, 1.0)                          # exact: −y/2
    tensor([[-0.5020,  0.9920]], dtype=torch.float64)
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Union

import torch

from ..geometry import Metric, scale_constant
from ..noise import GeneralizedGaussian, NoiseParams, StudentT
from ..ops import et_score, student_t_score
from ..score import score_from_draws

__all__ = ["GaussianDenoiser", "NoiseLaw", "SamplerScore", "score_from_sampler"]

# What a caller may pass as the noise law of one call.
NoiseLaw = Union[float, torch.Tensor, NoiseParams, GeneralizedGaussian, StudentT]


def _accepts_noise_keyword(function) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "noise" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _check_queries(y) -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or y.dtype not in (torch.float32, torch.float64):
        got = y.dtype if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"y must be a float32/float64 tensor of shape (..., d), got {got}")
    if y.dim() < 1 or y.shape[-1] < 1:
        raise ValueError(f"y must have shape (..., d) with d >= 1, got {tuple(y.shape)}")
    return y


def _check_real_sigma(sigma, name: str) -> None:
    """A σ is a real number or a real tensor: a bool, or a complex tensor (whose imaginary part
    a cast would silently drop), is refused."""
    if isinstance(sigma, torch.Tensor):
        if sigma.dtype == torch.bool or sigma.is_complex():
            raise TypeError(f"{name} must be a real (integer or floating-point) tensor, got dtype {sigma.dtype}")
    elif isinstance(sigma, bool) or not isinstance(sigma, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(sigma).__name__} {sigma!r}")


def _row_sigma(sigma, x: torch.Tensor, batch: int) -> torch.Tensor:
    """A denoiser's σ (a number or a ``(batch,)``/``(1,)`` tensor, finite and >= 0) as a ``(batch,)``
    tensor in x's dtype and device; σ = 0 marks a row returned unchanged."""
    _check_real_sigma(sigma, "sigma")
    sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    if sigma.dim() > 1 or (sigma.dim() == 1 and sigma.shape[0] not in (1, batch)):
        raise ValueError(f"sigma must be a number or a (batch,) tensor with batch = {batch}, got shape {tuple(sigma.shape)}")
    sigma = sigma.expand(batch)
    if sigma.numel() and not bool((torch.isfinite(sigma) & (sigma >= 0)).all()):
        raise ValueError(f"sigma must be >= 0 and finite, got values in [{sigma.min().item():.4g}, {sigma.max().item():.4g}]")
    return sigma


def _gaussian_sigma(noise, y: torch.Tensor) -> torch.Tensor:
    """σ given as a number or a tensor broadcasting to y's batch, as a (*batch,) tensor (finite, > 0)."""
    batch = y.shape[:-1]
    _check_real_sigma(noise, "noise σ")
    sigma = torch.as_tensor(noise, dtype=y.dtype, device=y.device)
    if not sigma.is_floating_point():
        sigma = sigma.to(y.dtype)
    try:
        sigma = sigma.expand(batch) if sigma.dim() <= len(batch) else None
    except RuntimeError:
        sigma = None
    if sigma is None:
        raise ValueError(f"noise σ of shape {tuple(torch.as_tensor(noise).shape)} does not broadcast to y's batch {tuple(batch)}")
    if sigma.numel() and not bool((torch.isfinite(sigma) & (sigma > 0)).all()):
        raise ValueError(f"noise σ must be > 0 and finite, got values in [{sigma.min().item():.4g}, {sigma.max().item():.4g}]")
    return sigma


def _check_noise(noise) -> None:
    if isinstance(noise, (NoiseParams, GeneralizedGaussian, StudentT, torch.Tensor)):
        return
    if isinstance(noise, (int, float)) and not isinstance(noise, bool):
        return
    raise TypeError(
        "noise must be a float σ or tensor of σ (Gaussian N(0, σ²I)), an etweedie NoiseParams, "
        f"GeneralizedGaussian or StudentT, got {type(noise).__name__}"
    )


def _noise_params_of(noise, y: torch.Tensor) -> NoiseParams:
    """The five-parameter tuple a posterior model is conditioned on (η = NoiseParams.eta())."""
    if isinstance(noise, NoiseParams):
        return noise
    if isinstance(noise, (GeneralizedGaussian, StudentT)):
        raise TypeError(
            "a posterior model with sample(y, eta, n, *, generator) is conditioned on η = (β, log λ, log σ, u, v): "
            f"pass the noise as NoiseParams (or a float σ for N(0, σ²I)), got {type(noise).__name__}"
        )
    # Gaussian N(0, σ²I) is the tuple (2, 1, σ, 0, 0): c_{2,d} = 1, so Σ = σ² I.
    return NoiseParams(2.0, 1.0, _gaussian_sigma(noise, y), 0.0, 0.0)


def score_with_law(y: torch.Tensor, draws: torch.Tensor, noise: NoiseLaw) -> torch.Tensor:
    """The Energy-Tweedie score at y from given posterior draws under the noise law ``noise``.

    Args:
        y: queries ``(*batch, d)``.
        draws: posterior draws ``(*batch, N, d)``.
        noise: float σ or ``(*batch,)`` tensor of σ (Gaussian N(0, σ²I)); :class:`NoiseParams`
            (the five-parameter tuple, per row); :class:`GeneralizedGaussian` (β, λ, metric);
            :class:`StudentT` (c, metric).

    Returns:
        ``(*batch, d)``.
    """
    y = _check_queries(y)
    _check_noise(noise)
    d = y.shape[-1]
    if isinstance(noise, NoiseParams):
        if d % 2 == 0:
            return score_from_draws(y, noise, draws)
        # Odd d: the (u, v) block geometry needs pairs of coordinates, the isotropic case does not.
        fields = [torch.as_tensor(getattr(noise, n), dtype=y.dtype, device=y.device) for n in ("beta", "lam", "sigma", "u", "v")]
        try:
            beta, lam, sigma, u, v = (f.expand(y.shape[:-1]) for f in torch.broadcast_tensors(*fields))
        except RuntimeError:
            raise ValueError(f"noise parameters do not broadcast to y's batch {tuple(y.shape[:-1])}") from None
        if bool((u != 0).any()) or bool((v != 0).any()):
            raise ValueError(f"NoiseParams with (u, v) != 0 needs an even dimension d (pairs of coordinates), got d = {d}")
        return _per_row_isotropic(y, draws, beta, lam, (sigma / scale_constant(beta, d)) ** 2)
    if isinstance(noise, GeneralizedGaussian):
        return et_score(y, draws, noise.beta.to(y.dtype), noise.lam.to(y.dtype), _metric_like(noise.metric, y))
    if isinstance(noise, StudentT):
        return student_t_score(y, draws, noise.c.to(y.dtype), _metric_like(noise.metric, y))
    sigma = _gaussian_sigma(noise, y)
    return _per_row_isotropic(y, draws, torch.full_like(sigma, 2.0), torch.ones_like(sigma), sigma**2)


def _per_row_isotropic(y, draws, beta, lam, var) -> torch.Tensor:
    """et_score with Σ = var·I per row; β, λ, var of y's batch shape (rows flattened for the metric's 1-D batch)."""
    d = y.shape[-1]
    if not isinstance(draws, torch.Tensor) or draws.dim() != y.dim() + 1 or draws.shape[:-2] != y.shape[:-1] or draws.shape[-1] != d:
        got = tuple(draws.shape) if isinstance(draws, torch.Tensor) else type(draws).__name__
        raise ValueError(f"draws must have shape (*batch, N, d) = {(*y.shape[:-1], 'N', d)}, got {got}")
    rows = y.reshape(-1, d)  # an unbatched y (d,) is one row
    s = et_score(rows, draws.reshape(rows.shape[0], draws.shape[-2], d), beta.reshape(-1), lam.reshape(-1),
                 Metric.isotropic(var.reshape(-1)))
    return s.reshape(y.shape)


def _metric_like(metric: Optional[Metric], y: torch.Tensor) -> Optional[Metric]:
    return None if metric is None else metric.to(dtype=y.dtype, device=y.device)


class SamplerScore:
    """``score(y, noise)``: the Energy-Tweedie score of the noisy marginal from a posterior sampler.

    Built by :func:`score_from_sampler`; see there for the sampler contracts.  Calling it draws N
    posterior samples per query (without autograd) and reduces them with the fused op under the
    noise law of the call; gradients reach y and the noise parameters with the draws held fixed.
    """

    def __init__(self, sampler, n_draws: int, generator: Optional[torch.Generator] = None):
        if callable(getattr(sampler, "sample", None)):
            self._kind = "posterior"
        elif callable(sampler):
            self._kind = "callable"
        else:
            raise TypeError(
                "sampler must be a callable sampler(y, n, generator) -> (..., n, d) or a posterior model with "
                f"sample(y, eta, n, *, generator), got {type(sampler).__name__}"
            )
        if isinstance(n_draws, bool) or not isinstance(n_draws, int):
            raise TypeError(f"n_draws must be an int, got {type(n_draws).__name__}")
        if n_draws < 1:
            raise ValueError(f"n_draws must be >= 1, got {n_draws}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.sampler = sampler
        self.n_draws = n_draws
        self.generator = torch.Generator().manual_seed(0) if generator is None else generator
        self._pass_noise = self._kind == "callable" and _accepts_noise_keyword(sampler)

    def __repr__(self) -> str:
        return f"SamplerScore({type(self.sampler).__name__}, n_draws={self.n_draws})"

    def draws(self, y: torch.Tensor, noise: NoiseLaw, *, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Posterior draws at every query: ``(*batch, N, d)`` in y's dtype and device."""
        y = _check_queries(y)
        _check_noise(noise)
        generator = self.generator if generator is None else generator
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        n = self.n_draws
        with torch.no_grad():
            if self._kind == "posterior":
                params = _noise_params_of(noise, y)
                eta = params.eta().to(dtype=y.dtype, device=y.device)
                try:
                    eta = eta.expand(*y.shape[:-1], 5)
                except RuntimeError:
                    raise ValueError(
                        f"noise parameters of batch shape {tuple(eta.shape[:-1])} do not broadcast to y's batch {tuple(y.shape[:-1])}"
                    ) from None
                x = self.sampler.sample(y.detach(), eta, n, generator=generator)
            elif self._pass_noise:
                x = self.sampler(y.detach(), n, generator, noise=noise)
            else:
                x = self.sampler(y.detach(), n, generator)
        expected = (*y.shape[:-1], n, y.shape[-1])
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"the sampler must return draws of shape (*batch, n, d) = {expected}, got {got}")
        return x.to(dtype=y.dtype, device=y.device)

    def score_and_mean(self, y: torch.Tensor, noise: NoiseLaw, *, generator: Optional[torch.Generator] = None):
        """``(score (*batch, d), posterior mean estimate (*batch, d))`` from the same N draws."""
        x = self.draws(y, noise, generator=generator)
        return score_with_law(y, x, noise), x.mean(-2)

    def __call__(self, y: torch.Tensor, noise: NoiseLaw, *, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """ŝ(y) under the noise law ``noise`` (see :func:`score_with_law`): ``(*batch, d)``."""
        return score_with_law(y, self.draws(y, noise, generator=generator), noise)


def score_from_sampler(sampler, *, n_draws: int, generator: Optional[torch.Generator] = None) -> SamplerScore:
    """Turn a posterior sampler into a score function ``score(y, noise) -> (..., d)``.

    Args:
        sampler: one of
            * a callable ``sampler(y (*batch, d), n, generator) -> (*batch, n, d)`` drawing
              x ~ P(X | Y = y); if it takes a ``noise=`` keyword it also receives the call's
              noise law (a sampler that depends on the noise level);
            * a posterior model with ``sample(y, eta, n, *, generator)`` (the etweedie contract:
              :mod:`etweedie.posteriors.engression`, :class:`etweedie.posteriors.known.KnownPosterior`), given
              η = ``NoiseParams.eta()`` of the call's noise.
        n_draws: N ≥ 1 draws per query.
        generator: the ``torch.Generator`` every draw comes from (None: a fresh one seeded with
            0); a ``generator=`` given to a call wins.

    Returns:
        a :class:`SamplerScore`; ``score(y, noise)`` takes the noise law per call:
        a float σ or a ``(*batch,)`` tensor of σ (Gaussian N(0, σ²I)), :class:`NoiseParams`,
        :class:`GeneralizedGaussian` (β, λ, metric) or :class:`StudentT` (c, metric).

    The estimate is unbiased in the draws' empirical measure; its Monte Carlo error falls as
    1/N (paper Eq. ``score_mc_error_decomposition``).
    """
    return SamplerScore(sampler, n_draws, generator)


class GaussianDenoiser:
    """Tweedie's denoiser ``D(x, σ) = x + σ² s(x; σ)`` from a score under Gaussian noise N(0, σ²I).

    Args:
        score: ``score(x (*batch, d), sigma (*batch,)) -> (*batch, d)`` — a :class:`SamplerScore`
            or any callable taking σ as the noise law.

    ``D(x, sigma)`` takes σ (finite, >= 0) as a number or a tensor broadcasting to x's batch
    (k-diffusion passes one σ per row); rows with σ = 0 return x unchanged.  x may be ``(B, *event)``: it is
    flattened to ``(B, d)`` for the score and reshaped back.
    """

    def __init__(self, score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        if not callable(score):
            raise TypeError(f"score must be callable score(x, sigma), got {type(score).__name__}")
        self.score = score

    def __repr__(self) -> str:
        return f"GaussianDenoiser({self.score!r})"

    def __call__(self, x: torch.Tensor, sigma) -> torch.Tensor:
        x = _check_queries(x)
        if x.dim() < 2:
            raise ValueError(f"x must have shape (batch, *event), got {tuple(x.shape)}")
        flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # (not -1: a zero-size batch)
        sigma = _row_sigma(sigma, x, flat.shape[0])
        out = flat.clone()
        live = sigma > 0
        if bool(live.any()):
            y = flat[live]
            s = self.score(y, sigma[live])
            # checked, not broadcast: a (rows, 1) or (d,) score would silently spread over the row
            if not isinstance(s, torch.Tensor) or s.shape != y.shape:
                got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"score(x, sigma) must return a tensor of x's shape {tuple(y.shape)}, got {got}")
            out[live] = y + sigma[live].unsqueeze(-1) ** 2 * s.to(y.dtype)
        return out.reshape(x.shape)
