"""Probability-flow ODE samplers over the Energy-Tweedie posterior mean, for Gaussian paths.

On a path with Gaussian noise of a fixed shape, Cov_t = r_t² S (β = 2, u and v constant; λ only
rescales σ), the noisy marginals p_t = p_data ∗ N(0, r_t² S) are transported by the
probability-flow ODE (Song et al. 2021, "Score-Based Generative Modeling through SDEs")

    dy/dr = −r S ∇ log p_r(y) = (y − D(y, r)) / r,        D(y, r) = E[X | Y_r = y]

(Tweedie: ∇ log p_r(y) = −(r² S)⁻¹ (y − D)), the same equation as isotropic VE diffusion
whatever S is.  D is the mean of N posterior draws.  Solvers, written from the formulas of
Karras et al. 2022 ("Elucidating the Design Space of Diffusion-Based Generative Models", Alg. 1,
Heun's second-order method) and Lu et al. 2022 ("DPM-Solver++", the second-order multistep
data-prediction update in log r):

* ``"heun"``: y' = y + (r_{k+1} − r_k) (d_k + d'_{k+1}) / 2, two denoiser calls per step;
* ``"dpmpp_2m"``: h_k = log(r_k / r_{k+1}), y_{k+1} = (r_{k+1}/r_k) y_k + (1 − e^{−h_k}) D̂_k with
  D̂_k = (1 + 1/(2ρ)) D_k − D_{k−1}/(2ρ), ρ = h_{k−1}/h_k (first step: D̂ = D), one call per step.

The output is the posterior mean at the last level (``final_average`` draws).  Non-Gaussian or
shape-changing paths have no such ODE in terms of D: sample them with
:func:`etweedie.sample.sample_transport`.

Example::

    >>> import torch
    >>> from etweedie.posteriors.known import KnownPosterior
    >>> from etweedie.sample.paths import get_path, level_times
    >>> from etweedie.sample import initial_states
    >>> g = torch.Generator().manual_seed(0)
    >>> path, times = get_path("gaussian"), level_times(11)
    >>> y0 = initial_states(path, times, 256, 2, generator=g)
    >>> sample_ode(KnownPosterior(), y0, path, times, n_posterior=16, generator=g, disable=True).shape
    torch.Size([256, 2])
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
from tqdm.auto import tqdm

from .._checks import check_int
from ..noise import NoiseParams
from .plan import LevelPlan, chain_chunks, check_finite, check_posterior, check_states, generators_for, posterior_draws

__all__ = ["SOLVERS", "sample_ode"]

SOLVERS = ("heun", "dpmpp_2m")


def _check_gaussian_path(plan: LevelPlan) -> None:
    beta, _, _, u, v = plan.params._tensors()
    if not bool((beta == 2).all()):
        raise ValueError(f"path: the probability-flow ODE over the posterior mean needs Gaussian noise (β = 2 at every "
                         f"level), got β in [{float(beta.min()):.3g}, {float(beta.max()):.3g}]; use sample_transport")
    if not (bool((u == u[0]).all()) and bool((v == v[0]).all())):
        raise ValueError("path: the probability-flow ODE needs a fixed covariance shape (u, v constant along the path); "
                         "use sample_transport")


@torch.no_grad()
def sample_ode(
    posterior,
    y0: torch.Tensor,
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: Optional[torch.Tensor],
    *,
    generator,
    n_posterior: int,
    solver: str = "dpmpp_2m",
    final_average: Optional[int] = None,
    chunk_chains: Optional[int] = None,
    callback: Optional[Callable[[Dict], None]] = None,
    disable: Optional[bool] = None,
) -> torch.Tensor:
    """Integrate the probability-flow ODE from the first level to the last, then denoise.

    Args:
        posterior, y0, path, schedule, generator, chunk_chains, disable: as in
            :func:`etweedie.sample.sample_transport` (the path must be Gaussian with a fixed shape).
        n_posterior: N ≥ 1, draws averaged into each denoiser value D(y, r).
        solver: ``"heun"`` or ``"dpmpp_2m"``.
        final_average: draws averaged into the output (default N).
        callback: after each level, ``{"level", "t", "r", "state", "denoised"}``.

    Returns:
        ``(..., d)`` samples in y0's dtype.  Posterior draws per chain: N per denoiser call —
        (L − 1) calls for dpmpp_2m, 2(L − 1) − 1 for heun — plus ``final_average``.
    """
    check_posterior(posterior)
    check_states(y0)
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))}, got {solver!r}")
    plan = LevelPlan.of(path, schedule)
    _check_gaussian_path(plan)
    n_posterior = check_int(n_posterior, "n_posterior", 1)
    final_average = n_posterior if final_average is None else check_int(final_average, "final_average", 1)
    shape, d = y0.shape, y0.shape[-1]
    y = y0.reshape(-1, d).clone()
    chunks = chain_chunks(y.shape[0], chunk_chains)
    generators = generators_for(generator, len(chunks), y.device)
    check_finite(y0)
    r = plan.rms

    def denoise(state: torch.Tensor, k: int, n: int) -> torch.Tensor:
        eta_row, out = plan.eta(k, state), torch.empty_like(state)
        for sl, g in zip(chunks, generators):
            eta = eta_row.expand(sl.stop - sl.start, 5)
            out[sl] = posterior_draws(posterior, state[sl], eta, n, g, {}, None, for_score=False).mean(1)
        return out

    previous = None  # (D_{k−1}, h_{k−1}) for the multistep solver
    for k in tqdm(range(len(plan) - 1), desc=solver, unit="level", disable=disable):
        rk, rn = float(r[k]), float(r[k + 1])
        D = denoise(y, k, n_posterior)
        if solver == "heun":
            dk = (y - D) / rk
            y_euler = y + (rn - rk) * dk
            if k + 1 < len(plan) - 1:  # the last step stays Euler: its end is denoised anyway
                dn = (y_euler - denoise(y_euler, k + 1, n_posterior)) / rn
                y = y + (rn - rk) * (dk + dn) / 2
            else:
                y = y_euler
        else:
            h = math.log(rk / rn)
            Dh = D if previous is None else (1 + 1 / (2 * previous[1] / h)) * D - previous[0] / (2 * previous[1] / h)
            y = (rn / rk) * y - math.expm1(-h) * Dh
            previous = (D, h)
        if callback is not None:
            callback(dict(level=k, t=float(plan.times[k]), r=rk, state=y.reshape(shape).clone(),
                          denoised=D.reshape(shape).clone()))
    return denoise(y, len(plan) - 1, final_average).reshape(shape)
