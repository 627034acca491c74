"""Noise transport: a predictor that needs no Langevin mixing, for any noise path.

At level t a chain holds y_t.  One posterior draw x ~ P(X | Y = y_t, η_t) splits it into a clean
image and the noise that would have produced it, e = y_t − x; the step carries that noise onto
the next level's law and puts it back:

    y_s = x + T_{t→s}(y_t − x)

T whitens by Σ_t (z = L_tᵀ e, ‖z‖ = ‖e‖_{Σ_t⁻¹}), maps the whitened radius R = ‖z‖ by its
quantile — under generalized-Gaussian noise G = (λ/β) R^β ~ Gamma(d/β, 1) independently of the
direction z/R, so G_s = F_s⁻¹(F_t(G_t)) with F the Gamma(d/β) CDF (the identity when β does not
change, and then R_s = R_t (λ_t/λ_s)^{1/β}) — and re-colours by Σ_s (e_s = L_s⁻ᵀ (R_s/R_t) z).
With exact posterior draws, (x, y_t − x) is a draw of (data, level-t noise) with the two
independent, so T maps the noise to an exact level-s noise draw still independent of x: y_s has
exactly the level-s marginal, for any family, covariance and tail along the path, and each step
costs one posterior draw.  With the mean of many draws in place of the draw and Gaussian noise
it is DDIM (Song, Meng and Ermon 2021, "Denoising Diffusion Implicit Models", η = 0).

Because it never runs a chain at one level, the step does not drift into the learned score's own
equilibrium, which long Langevin runs at low noise do (experiments/mnist/RESULTS.md).  A Gibbs
sweep, x ~ P(X | y), y ← x + e with e a fresh level-t noise draw, is the matching corrector: with
exact draws it leaves the level-t marginal invariant too, with no score and no step size.

Example (the eight-Gaussians ring, whose posterior is known)::

    >>> import torch
    >>> from etweedie.posteriors.known import KnownPosterior
    >>> from etweedie.sample.paths import get_path, level_times
    >>> from etweedie.sample import initial_states
    >>> g = torch.Generator().manual_seed(0)
    >>> path, times = get_path("gaussian"), level_times(11)
    >>> y0 = initial_states(path, times, 512, 2, generator=g)
    >>> x = sample_transport(KnownPosterior(), y0, path, times, warmup=4, generator=g, disable=True)
    >>> x.shape, round(float(x.norm(dim=1).mean()), 1)
    (torch.Size([512, 2]), 2.0)
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
from tqdm.auto import tqdm

from .._checks import check_int
from ..geometry import Metric
from ..noise import NoiseParams
from .plan import LevelPlan, chain_chunks, check_finite, check_posterior, check_states, generators_for, posterior_draws

__all__ = ["gamma_quantile_map", "radius_map", "sample_transport", "transport_noise"]

_NEWTON_STEPS = 60


def gamma_quantile_map(g: torch.Tensor, a_from, a_to) -> torch.Tensor:
    """G_s = F_{a_to}⁻¹(F_{a_from}(g)): Gamma(a_from, 1) values mapped to Gamma(a_to, 1) quantiles.

    float64, elementwise; ``a_from``/``a_to`` floats or tensors broadcast against ``g``.  Each
    value is solved on its own tail (the lower CDF below the median, the upper one above it), by
    Newton steps on log G from the Wilson–Hilferty guess, so tail quantiles keep their precision.

    Example::

        >>> g = torch.tensor([0.5, 3.0, 40.0], dtype=torch.float64)
        >>> torch.allclose(gamma_quantile_map(g, 2.0, 2.0), g)
        True
        >>> p = torch.special.gammainc(torch.tensor(2.0, dtype=torch.float64), g)
        >>> torch.allclose(torch.special.gammainc(torch.tensor(5.0, dtype=torch.float64), gamma_quantile_map(g, 2.0, 5.0)), p)
        True
    """
    g = g.to(torch.float64)
    a_from = torch.as_tensor(a_from, dtype=torch.float64, device=g.device).expand_as(g)
    a_to = torch.as_tensor(a_to, dtype=torch.float64, device=g.device).expand_as(g)
    lower = torch.special.gammainc(a_from, g)
    upper = torch.special.gammaincc(a_from, g)
    left = lower < 0.5
    target = torch.where(left, lower, upper)
    # Wilson–Hilferty: (G/a)^{1/3} ≈ N(1 − 1/(9a), 1/(9a)); the normal quantile of the same tail
    z = torch.where(left, torch.special.ndtri(lower.clamp_min(1e-300)), -torch.special.ndtri(upper.clamp_min(1e-300)))
    c = 1.0 / (9.0 * a_to)
    base = (1.0 - c + z * c.sqrt()).clamp_min(1e-3)
    w = torch.log(a_to * base ** 3)
    log_norm = torch.lgamma(a_to)
    for _ in range(_NEWTON_STEPS):
        x = w.exp()
        value = torch.where(left, torch.special.gammainc(a_to, x), -torch.special.gammaincc(a_to, x))
        goal = torch.where(left, target, -target)
        slope = torch.exp(a_to * w - x - log_norm)  # d F(e^w) / dw = f(x) x
        step = ((value - goal) / slope.clamp_min(1e-300)).clamp(-1.0, 1.0)
        w = w - step
    out = w.exp()
    same = a_from == a_to
    return torch.where(same, g, torch.where(g > 0, out, torch.zeros_like(g)))


def radius_map(radius: torch.Tensor, d: int, source: NoiseParams, target: NoiseParams) -> torch.Tensor:
    """The whitened noise radius R = ‖e‖_{Σ⁻¹} of ``source``'s law carried to ``target``'s by its quantile.

    Under GeneralizedGaussian(β, λ, Σ) in dimension d, (λ/β) R^β ~ Gamma(d/β, 1); the map is
    monotone and takes the source law of R exactly onto the target's.  float64.
    """
    bt, lt = float(source.beta), float(source.lam)
    bs, ls = float(target.beta), float(target.lam)
    r = radius.to(torch.float64)
    g = (lt / bt) * r.pow(bt)
    if bt != bs:
        g = gamma_quantile_map(g, d / bt, d / bs)
    return (bs / ls * g).pow(1.0 / bs)


_GAUSSIAN = NoiseParams(2.0, 1.0, 1.0)  # whitened radius law of N(0, I): R²/2 ~ Gamma(d/2)


def _rescaled(z: torch.Tensor, d: int, source: NoiseParams, target: NoiseParams) -> torch.Tensor:
    r = z.to(torch.float64).norm(dim=-1, keepdim=True)
    scale = torch.where(r > 0, radius_map(r, d, source, target) / r.clamp_min(1e-300), torch.zeros_like(r))
    return z * scale.to(z.dtype)


def transport_noise(e: torch.Tensor, d: int, source: NoiseParams, target: NoiseParams,
                    metric_from: Metric, metric_to: Metric, *, churn: float = 0.0,
                    fresh: Optional[torch.Tensor] = None) -> torch.Tensor:
    """T(e): a noise vector of ``source``'s law (rows of ``e``, ``(C, d)``) carried onto ``target``'s.

    Whiten by Σ_source, rescale the radius by :func:`radius_map`, re-colour by Σ_target.  Rows of
    zero norm stay zero.

    ``churn`` c ∈ [0, 1] with ``fresh`` (standard normal rows, e's shape) renews part of the
    noise on the way, for any generalized-Gaussian law: the whitened noise is mapped by its radius
    quantile onto N(0, I), mixed as sqrt(1 − c²) w + c ξ (still N(0, I)), and mapped onto the
    target law.  c = 0 is the plain transport; c = 1 a fresh target-law draw, independent of e.
    """
    z = metric_from.whiten(e)
    if churn:
        w = _rescaled(z, d, source, _GAUSSIAN)
        w = math.sqrt(1.0 - churn ** 2) * w + churn * fresh.to(w.dtype)
        return metric_to.unwhiten(_rescaled(w, d, _GAUSSIAN, target))
    return metric_to.unwhiten(_rescaled(z, d, source, target))


def _mean_draw(posterior, y, eta, n: int, generator, batch: int) -> torch.Tensor:
    """One draw (n = 1) or the mean of n draws, taken in batches of at most ``batch``."""
    total = None
    for start in range(0, n, batch):
        x = posterior_draws(posterior, y, eta, min(batch, n - start), generator, {}, None, for_score=False).sum(1)
        total = x if total is None else total + x
    return total / n


@torch.no_grad()
def sample_transport(
    posterior,
    y0: torch.Tensor,
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: Optional[torch.Tensor],
    *,
    generator,
    warmup: int = 0,
    gibbs_steps: int = 0,
    gibbs_min_rms: float = 0.0,
    mean_draws: int = 1,
    churn: float = 0.0,
    final_average: int = 1,
    draw_batch: int = 64,
    chunk_chains: Optional[int] = None,
    callback: Optional[Callable[[Dict], None]] = None,
    disable: Optional[bool] = None,
) -> torch.Tensor:
    """Noise-transport sampling along a path: y_{k+1} = x + T_{k→k+1}(y_k − x), x ~ P(X | y_k).

    Args:
        posterior: ``sample(y (C, d), eta (C, 5), n, *, generator) -> (C, n, d)``.
        y0: chain starts at the first level ``(..., d)``, float32/64, d even
            (:func:`etweedie.sample.initial_states`).
        path, schedule: the levels: a path and its times, or a :class:`etweedie.sample.LevelPlan`
            and None (e.g. with a :meth:`~etweedie.sample.LevelPlan.lead_in`).
        generator: a ``torch.Generator``, or one per chunk of ``chunk_chains`` chains.
        warmup: Gibbs sweeps at the first level before the first step (≥ 0): they bring a start
            that is only roughly the first noisy marginal (the data collapsed to its mean) onto it.
        gibbs_steps: Gibbs sweeps at every later level whose realized RMS is at least
            ``gibbs_min_rms`` (≥ 0; the corrector, chosen by measurement).
        mean_draws: m ≥ 1 posterior draws averaged into the x of each step (1: the exact-marginal
            step; many, on a Gaussian path: DDIM).
        churn: c ∈ [0, 1], the share of each step's noise renewed (:func:`transport_noise`; 0: the
            deterministic transport of the drawn noise, 1: ancestral, fresh noise every step).
        final_average: K ≥ 1 draws averaged into the output at the last level (1: one draw; K > 1:
            a Monte Carlo posterior mean, the noise-free last step).
        draw_batch: most draws per chain asked of the posterior in one call.
        chunk_chains: chains per chunk (None: all at once).
        callback: called after each level with ``{"level", "t", "r", "params", "eta", "state"
            (the chains at the level, y0's shape), "denoised" (the level's x, y0's shape)}``.
        disable: True hides the tqdm bar over levels.

    Returns:
        ``(..., d)`` samples in y0's dtype.  Posterior draws per chain:
        ``warmup + gibbs sweeps + (L − 1)·mean_draws + final_average``.
    """
    check_posterior(posterior)
    check_states(y0, even=True)
    plan = LevelPlan.of(path, schedule)
    warmup = check_int(warmup, "warmup", 0)
    gibbs_steps = check_int(gibbs_steps, "gibbs_steps", 0)
    mean_draws = check_int(mean_draws, "mean_draws", 1)
    final_average = check_int(final_average, "final_average", 1)
    draw_batch = check_int(draw_batch, "draw_batch", 1)
    if isinstance(gibbs_min_rms, bool) or not isinstance(gibbs_min_rms, (int, float)) or math.isnan(gibbs_min_rms):
        raise ValueError(f"gibbs_min_rms must be a number, got {gibbs_min_rms!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    if isinstance(churn, bool) or not isinstance(churn, (int, float)) or not 0 <= churn <= 1:
        raise ValueError(f"churn must be a number in [0, 1], got {churn!r}")

    shape, d = y0.shape, y0.shape[-1]
    y = y0.reshape(-1, d).clone()
    chunks = chain_chunks(y.shape[0], chunk_chains)
    generators = generators_for(generator, len(chunks), y.device)
    check_finite(y0)
    x = torch.empty_like(y)
    for k in tqdm(range(len(plan)), desc="transport", unit="level", disable=disable):
        level, eta_row, metric = plan.level(k), plan.eta(k, y), plan.metric(k, d, y)
        sweeps = warmup if k == 0 else (gibbs_steps if float(plan.rms[k]) >= gibbs_min_rms else 0)
        last = k == len(plan) - 1
        nxt = None if last else (plan.level(k + 1), plan.metric(k + 1, d, y))
        law = plan.noise(k, d, y.device) if sweeps else None
        for sl, g in zip(chunks, generators):
            eta = eta_row.expand(sl.stop - sl.start, 5)
            for _ in range(sweeps):  # Gibbs: x ~ P(X | y), y ← x + fresh level-k noise
                xs = _mean_draw(posterior, y[sl], eta, 1, g, draw_batch)
                y[sl] = xs + law.sample((xs.shape[0],), generator=g).to(y.dtype)
            x[sl] = _mean_draw(posterior, y[sl], eta, mean_draws if not last else final_average, g, draw_batch)
        if callback is not None:
            callback(dict(level=k, t=float(plan.times[k]), r=float(plan.rms[k]), params=level, eta=eta_row.clone(),
                          state=y.reshape(shape).clone(), denoised=x.reshape(shape).clone()))
        if not last:
            fresh = None
            if churn:
                fresh = torch.cat([torch.randn(sl.stop - sl.start, d, generator=g, dtype=y.dtype, device=y.device)
                                   for sl, g in zip(chunks, generators)])
            y = x + transport_noise(y - x, d, level, nxt[0], metric, nxt[1], churn=churn, fresh=fresh)
    return x.reshape(shape)
