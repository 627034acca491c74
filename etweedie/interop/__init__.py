"""Use etweedie from other diffusion codebases.

* :func:`score_from_sampler` — any posterior sampler ``sampler(y, n, generator) -> (..., n, d)``
  (or an etweedie posterior model) becomes a score function ``score(y, noise)`` by the
  Energy-Tweedie route, the noise law chosen per call (Gaussian σ, :class:`~etweedie.NoiseParams`,
  :class:`~etweedie.GeneralizedGaussian`, :class:`~etweedie.StudentT`);
* :class:`GaussianDenoiser` — its Gaussian special case, Tweedie's ``D(x, σ) = x + σ² s(x)``;
* :class:`KDiffusionDenoiser` — a ``model(x, sigma)`` for k-diffusion's samplers on Gaussian
  paths (:func:`load_k_diffusion_sampling` loads the samplers without k-diffusion's heavy imports);
* :mod:`etweedie.interop.diffusers_scheduler` — a diffusers scheduler running annealed Langevin
  along an etweedie noise path (imported on its own: it needs the ``diffusers`` package).

Nothing in the library imports this package.
"""

from .kdiffusion import KDiffusionDenoiser, load_k_diffusion_sampling
from .score import GaussianDenoiser, NoiseLaw, SamplerScore, score_from_sampler, score_with_law

__all__ = [
    "GaussianDenoiser",
    "KDiffusionDenoiser",
    "NoiseLaw",
    "SamplerScore",
    "load_k_diffusion_sampling",
    "score_from_sampler",
    "score_with_law",
]
