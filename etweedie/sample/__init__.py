"""Sampling along noise-parameter paths: plain sampler functions over one level plan.

Every sampler takes ``(posterior, y0, path, schedule, *, generator, ..., callback, disable)``
(k-diffusion's shape) and reads its levels from one :class:`LevelPlan`:

* :func:`sample_transport` — the noise-transport predictor y_s = x + T_{t→s}(y_t − x),
  x ~ P(X | y_t): exact level marginals from exact posterior draws, for any path, one draw a
  step; Gibbs sweeps as its corrector.  The MNIST default.
* :func:`sample_ode` — the probability-flow ODE (Heun, DPM-Solver++(2M)) over the posterior
  mean, for Gaussian paths of fixed shape.
* :func:`sample_langevin` — the paper's annealed Langevin with the fused Energy-Tweedie score.

The paths themselves (t ↦ (β, λ, σ, u, v) and their realized-RMS schedules) are in
:mod:`etweedie.sample.paths`.  :func:`initial_states` draws chain starts, :func:`sample_sharded`
splits any sampler's chains over ``torchrun`` processes, :class:`DrawCounter` counts the
posterior draws a run takes.
"""

from .langevin import ThroughputTimer, sample_langevin
from .ode import SOLVERS, sample_ode
from .parallel import rank_chunks, sample_sharded
from .paths import (DEFAULT_LEVELS, EIGHT_GAUSSIAN_PATHS, EIGHT_GAUSSIAN_RMS, ISOLATION_ARMS, ISOLATION_RMS, MAX_RMS,
                    MNIST_PATHS, MNIST_RMS, PATHS, GeometricRMS, NoisePath, get_path, level_times, path_names)
from .plan import (DrawCounter, LevelPlan, chain_chunks, chunk_generators, chunk_seed, initial_states,
                   posterior_draws, step_sizes)
from .transport import gamma_quantile_map, radius_map, sample_transport, transport_noise

__all__ = [
    "DEFAULT_LEVELS", "EIGHT_GAUSSIAN_PATHS", "EIGHT_GAUSSIAN_RMS", "GeometricRMS", "ISOLATION_ARMS", "ISOLATION_RMS",
    "MAX_RMS", "MNIST_PATHS", "MNIST_RMS", "NoisePath", "PATHS", "get_path", "level_times", "path_names",
    "DrawCounter", "LevelPlan", "SOLVERS", "ThroughputTimer", "chain_chunks", "chunk_generators", "chunk_seed",
    "gamma_quantile_map", "initial_states", "posterior_draws", "radius_map", "rank_chunks", "sample_langevin",
    "sample_ode", "sample_sharded", "sample_transport", "step_sizes", "transport_noise",
]
