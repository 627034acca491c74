"""Energy-Tweedie diffusion: annealed Langevin along a noise-parameter path (paper §5.3, Eq. ES_diffusion_sample).

At level k of a schedule t_0 < … < t_{L−1} the path gives the noise tuple θ_k = (β, λ, σ, u, v)
with realized RMS r_k.  Each Langevin update draws N posterior samples at the current states
and moves every chain with the Monte-Carlo Energy-Tweedie score:

    X^{(i)} ~ P(X | Y = y, η_k),  i = 1..N
    ŝ(y) = −λ_k Σ_k⁻¹ (1/N) Σ_i ‖y − X^{(i)}‖_{Σ_k⁻¹}^{β_k−2} (y − X^{(i)})
    y ← y + α_k ŝ(y) + sqrt(2 α_k) ξ,        α_k = ε (r_k / r_{L−1})²,  ξ ~ N(0, I)

— the step size scales with the noise variance of the level as in NCSN (ε is ``step_scale``,
the step at the terminal level).  The score and the update are one fused kernel
(:func:`etweedie.langevin_step`).  After the last level one posterior draw at the terminal
level denoises each chain (``final_draw``).

The posterior is any object with ``sample(y (..., d), eta (..., 5), n, *, generator) -> (..., n, d)``
(η = ``NoiseParams.eta()``): the learned Engression model (``etweedie.train.load_posterior``) or
:class:`etweedie.known_posterior.KnownPosterior`.

Example (model-free, with the known posterior of the eight-Gaussians ring)::

    >>> import torch
    >>> from etweedie.known_posterior import KnownPosterior
    >>> from etweedie.paths import get_path, level_times
    >>> g = torch.Generator().manual_seed(0)
    >>> y0 = 1.65 * torch.randn(256, 2, generator=g)
    >>> x = sample_langevin(KnownPosterior(), y0, get_path("gaussian"), level_times(11),
    ...                     steps_per_level=3, n_posterior=16, step_scale=2e-5, generator=g, disable=True)
    >>> x.shape
    torch.Size([256, 2])

The paper's eight-Gaussians diffusion tables run this sampler from the repository:
``python -m experiments.eight_gaussians.diffusion --config configs/diffusion_cpu.toml --out DIR``.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional

import torch
from tqdm.auto import tqdm

from .noise import NoiseParams
from .ops import langevin_step
from .score import antithetic_options

__all__ = ["ThroughputTimer", "sample_langevin", "step_sizes"]


# ---------------------------------------------------------------------------- instrumentation
class ThroughputTimer:
    """Where sampling time goes: posterior forward, fused score/step kernel, callbacks, the rest.

    Callback time (e.g. marginal tracking) is reported apart and left out of the throughput.

    Pass one as ``sample_langevin(..., timer=t)``; it accumulates over calls.  On CUDA the
    device is synchronized around each timed region (only when a timer is given).

    Example::

        >>> t = ThroughputTimer(); t.as_dict()["chain_steps"], "posterior_share" in t.as_dict()
        (0, True)
    """

    def __init__(self):
        self.posterior_s = 0.0
        self.step_s = 0.0
        self.callback_s = 0.0
        self.total_s = 0.0
        self.chain_steps = 0  # chains × Langevin updates
        self.posterior_calls = 0
        self.chains = 0
        self.levels = 0

    def as_dict(self) -> Dict[str, float]:
        """Totals, chains·steps per second and the share of each part of the wall time."""
        total = max(self.total_s - self.callback_s, 1e-12)
        rest = max(total - self.posterior_s - self.step_s, 0.0)
        return dict(
            chains=self.chains,
            levels=self.levels,
            chain_steps=self.chain_steps,
            posterior_calls=self.posterior_calls,
            total_s=self.total_s,
            callback_s=self.callback_s,
            sampling_s=total,
            posterior_s=self.posterior_s,
            score_step_s=self.step_s,
            rest_s=rest,
            chain_steps_per_s=self.chain_steps / total,
            posterior_share=self.posterior_s / total,
            score_step_share=self.step_s / total,
            rest_share=rest / total,
        )


class _Clock:
    def __init__(self, device: torch.device, enabled: bool):
        self.sync = enabled and device.type == "cuda"

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


# ---------------------------------------------------------------------------- validation
def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_schedule(schedule) -> torch.Tensor:
    if not isinstance(schedule, torch.Tensor) or not schedule.is_floating_point():
        got = schedule.dtype if isinstance(schedule, torch.Tensor) else type(schedule).__name__
        raise TypeError(f"schedule must be a 1-D floating-point tensor of path times (etweedie.paths.level_times), got {got}")
    if schedule.dim() != 1 or schedule.numel() < 1:
        raise ValueError(f"schedule must be a non-empty 1-D tensor of path times, got shape {tuple(schedule.shape)}")
    if not bool(((schedule >= 0) & (schedule <= 1)).all()):
        raise ValueError(f"schedule times must lie in [0, 1], got [{schedule.min().item():.4g}, {schedule.max().item():.4g}]")
    return schedule


def _level_params(path, schedule: torch.Tensor) -> NoiseParams:
    if not callable(path):
        raise TypeError(f"path must be a callable t -> NoiseParams (etweedie.paths.NoisePath), got {type(path).__name__}")
    params = path(schedule)
    if not isinstance(params, NoiseParams):
        raise TypeError(f"path(t) must return an etweedie.NoiseParams, got {type(params).__name__}")
    if tuple(params.batch_shape) != tuple(schedule.shape):
        raise ValueError(
            f"path(t) must be vectorized over t: fields of shape {tuple(schedule.shape)}, got {tuple(params.batch_shape)}"
        )
    return params


def _level(params: NoiseParams, k: int) -> NoiseParams:
    fields = torch.broadcast_tensors(*params._tensors())
    return NoiseParams(*(f[k] for f in fields))


def step_sizes(path, schedule: torch.Tensor, step_scale: float) -> torch.Tensor:
    """Langevin step per level, ``α_k = ε (r_k / r_{L−1})²`` (r_k the realized RMS at t_k), ``(L,)`` float64.

    Example::

        >>> from etweedie.paths import get_path, level_times
        >>> [f"{a:.0e}" for a in step_sizes(get_path("isotropic"), level_times(3), 1e-5).tolist()]
        ['1e-01', '1e-03', '1e-05']
    """
    if isinstance(step_scale, bool) or not isinstance(step_scale, (int, float)) or not (step_scale > 0 and math.isfinite(step_scale)):
        raise ValueError(f"step_scale must be a float > 0, got {step_scale!r}")
    schedule = _check_schedule(schedule)
    r = _level_params(path, schedule).realized_rms().to(torch.float64)
    return float(step_scale) * (r / r[-1]) ** 2


# ---------------------------------------------------------------------------- the sampler
@torch.no_grad()
def sample_langevin(
    posterior,
    y0: torch.Tensor,
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: torch.Tensor,
    *,
    steps_per_level: int,
    n_posterior: int,
    step_scale: float,
    first_level_steps: Optional[int] = None,
    final_draw: bool = True,
    generator: Optional[torch.Generator] = None,
    callback: Optional[Callable[[Dict], None]] = None,
    disable: Optional[bool] = None,
    timer: Optional[ThroughputTimer] = None,
    antithetic: bool = False,
) -> torch.Tensor:
    """Annealed Langevin with the Energy-Tweedie score along a noise-parameter path.

    Args:
        posterior: object with ``sample(y (C, d), eta (C, 5), n, *, generator) -> (C, n, d)``.
        y0: initial states ``(..., d)`` (all leading dims are independent chains), float32/64.
        path: ``t -> NoiseParams``, vectorized over t (:class:`etweedie.paths.NoisePath`).
        schedule: path times of the levels, ``(L,)`` in [0, 1], visited in order
            (:func:`etweedie.paths.level_times`).
        steps_per_level: Langevin updates per level (≥ 1).
        n_posterior: N, posterior draws per score evaluation (≥ 1).
        step_scale: ε > 0, the step at the terminal level; α_k = ε (r_k / r_{L−1})².
        first_level_steps: updates at the first level instead of ``steps_per_level`` (≥ 0;
            None: ``steps_per_level``) — a longer burn-in at the noisiest level.
        final_draw: replace each chain by one posterior draw at the terminal level.
        generator: the ``torch.Generator`` every posterior draw and Langevin noise comes from
            (required; a run is reproducible from its seed).
        callback: called after each level with ``{"level", "t", "r", "step", "params"
            (NoiseParams of the level), "eta" (5,), "state" (y0's shape), "denoised" (one
            posterior draw per chain from the level's last score evaluation, y0's shape)}``.
        disable: True hides the tqdm bar over levels (None: tqdm's default).
        timer: a :class:`ThroughputTimer` to accumulate the time split into.
        antithetic: the N draws of each score evaluation in antithetic noise pairs
            (``posterior.sample(..., antithetic=True)``, :class:`etweedie.models.EngressionPosterior`):
            the score stays unbiased with less Monte Carlo noise.  A posterior without the keyword
            is a TypeError.

    Returns:
        final samples, y0's shape and dtype.

    Memory per update is O(chains · N · d) (the posterior draws), nothing accumulates over levels.
    """
    if not callable(getattr(posterior, "sample", None)):
        raise TypeError(f"posterior must have a sample(y, eta, n, *, generator) method, got {type(posterior).__name__}")
    if not isinstance(y0, torch.Tensor) or y0.dtype not in (torch.float32, torch.float64):
        got = y0.dtype if isinstance(y0, torch.Tensor) else type(y0).__name__
        raise TypeError(f"y0 must be a float32/float64 tensor of shape (..., d), got {got}")
    if y0.dim() < 1 or y0.shape[-1] < 1:
        raise ValueError(f"y0 must have shape (..., d) with d >= 1, got {tuple(y0.shape)}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (randomness is always explicit), got {type(generator).__name__}"
        )
    if generator.device.type != y0.device.type:
        raise ValueError(
            f"generator must be on y0's device ({y0.device.type}), got a {generator.device.type} generator; "
            f"use torch.Generator(device={str(y0.device)!r}).manual_seed(seed)"
        )
    if not bool(torch.isfinite(y0).all()):
        raise ValueError("y0 must be finite (it holds NaN or inf)")
    schedule = _check_schedule(schedule)
    steps_per_level = _check_int(steps_per_level, "steps_per_level", 1)
    n_posterior = _check_int(n_posterior, "n_posterior", 1)
    if first_level_steps is not None:
        first_level_steps = _check_int(first_level_steps, "first_level_steps", 0)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    options = antithetic_options(posterior, antithetic)
    if timer is not None and not isinstance(timer, ThroughputTimer):
        raise TypeError(f"timer must be an etweedie.sample.ThroughputTimer or None, got {type(timer).__name__}")

    clock = _Clock(y0.device, timer is not None)
    start = clock.now()
    shape, d = y0.shape, y0.shape[-1]
    y = y0.reshape(-1, d).clone()
    chains = y.shape[0]
    params = _level_params(path, schedule)
    alphas = step_sizes(path, schedule, step_scale)
    r_levels = params.realized_rms().to(torch.float64)
    posterior_s = step_s = callback_s = 0.0
    n_updates = 0
    eta = None
    for k in tqdm(range(schedule.numel()), desc="langevin", unit="level", disable=disable):
        level = _level(params, k)
        eta = level.eta().to(device=y.device, dtype=y.dtype).expand(chains, 5)
        metric = level.metric(d).to(device=y.device, dtype=y.dtype)
        beta, lam, alpha = float(level.beta), float(level.lam), float(alphas[k])
        n_steps = first_level_steps if (k == 0 and first_level_steps is not None) else steps_per_level
        x = None
        for _ in range(n_steps):
            t0 = clock.now()
            x = posterior.sample(y, eta, n_posterior, generator=generator, **options)
            t1 = clock.now()
            if x.shape != (chains, n_posterior, d):
                raise ValueError(
                    f"posterior.sample returned shape {tuple(x.shape)}, expected {(chains, n_posterior, d)}"
                )
            xi = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
            t2 = clock.now()
            y = langevin_step(y, x.to(y.dtype), xi, alpha, beta, lam, metric)
            t3 = clock.now()
            posterior_s += t1 - t0
            step_s += t3 - t2
            n_updates += 1
        if callback is not None:
            t0 = clock.now()
            callback(
                dict(
                    level=k,
                    t=float(schedule[k]),
                    r=float(r_levels[k]),
                    step=alpha,
                    params=level,
                    eta=eta[0].clone(),
                    state=y.reshape(shape).clone(),
                    denoised=None if x is None else x[:, 0, :].reshape(shape).to(y.dtype),
                )
            )
            callback_s += clock.now() - t0
    if final_draw:
        t0 = clock.now()
        y = posterior.sample(y, eta, 1, generator=generator)[:, 0, :].to(y.dtype)
        posterior_s += clock.now() - t0
    if timer is not None:
        timer.posterior_s += posterior_s
        timer.step_s += step_s
        timer.callback_s += callback_s
        timer.total_s += clock.now() - start
        timer.chain_steps += chains * n_updates
        timer.posterior_calls += n_updates + int(final_draw)
        timer.chains += chains
        timer.levels += schedule.numel()
    return y.reshape(shape)
