"""A diffusers scheduler running annealed Langevin along an etweedie noise path (paper §5.3).

:class:`EnergyTweedieLangevinScheduler` is a ``SchedulerMixin``/``ConfigMixin`` subclass: it saves and
loads with ``save_pretrained``/``from_pretrained`` and drives the usual diffusers loop.  Its
``timesteps`` are the path times of every Langevin update (level k's time t_k repeated
``steps_per_level`` times), and ``step`` takes as ``model_output`` either

* **posterior draws** ``(B, N, *event)`` at the current sample, x_i ~ P(X | Y = sample, η_t):
  the update is the fused :func:`etweedie.langevin_step`
  ``y ← y + α_k ŝ(y) + sqrt(2 α_k) ξ`` with the Energy-Tweedie score of the level's noise
  law (any β, λ, σ, u, v), or
* **a score** ``(B, *event)`` at the current sample: ``y ← y + α_k s + sqrt(2 α_k) ξ``,

with α_k = ε (r_k / r_{L−1})² (:func:`etweedie.sample.step_sizes`) and ξ ~ N(0, I) drawn from the
``generator`` passed to ``step``.  A model conditioned on the noise tuple gets it from
``scheduler.eta(t, batch)`` (η = (β, log λ, log σ, u, v)) or ``scheduler.noise_params(t)``.

The loop below draws the same random numbers in the same order as
:func:`etweedie.sample.sample_langevin` and returns the same samples::

    scheduler = EnergyTweedieLangevinScheduler(path="gaussian", steps_per_level=10, step_scale=2e-5)
    scheduler.set_timesteps(51)
    sample = scheduler.init_noise_sigma * torch.randn(B, 2, generator=g, dtype=torch.float64)
    for t in scheduler.timesteps:
        draws = posterior.sample(sample, scheduler.eta(t, B), 64, generator=g)   # (B, 64, 2)
        sample = scheduler.step(draws, t, sample, generator=g).prev_sample
    sample = posterior.sample(sample, scheduler.eta(scheduler.timesteps[-1], B), 1, generator=g)[:, 0]

Needs the ``diffusers`` package (``pip install diffusers``, or etweedie's ``interop`` extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

try:
    from diffusers import ConfigMixin, SchedulerMixin
    from diffusers.configuration_utils import register_to_config
    from diffusers.utils import BaseOutput
except ImportError as exc:  # pragma: no cover - exercised only without diffusers
    raise ImportError(
        "etweedie.interop.diffusers_scheduler needs the diffusers package: pip install diffusers "
        "(or pip install 'etweedie[interop]')"
    ) from exc

from .._checks import check_device, check_int
from ..noise import NoiseParams
from ..ops import langevin_step
from ..sample.paths import DEFAULT_LEVELS, PATHS, GeometricRMS, NoisePath, get_path, level_times
from ..sample import step_sizes

__all__ = ["EnergyTweedieLangevinScheduler", "EnergyTweedieSchedulerOutput"]


@dataclass
class EnergyTweedieSchedulerOutput(BaseOutput):
    """Output of :meth:`EnergyTweedieLangevinScheduler.step`.

    Args:
        prev_sample: the sample after the Langevin update, the input of the next step, ``sample``'s shape.
        pred_original_sample: the posterior-mean estimate (1/N) Σ_i x_i when ``model_output`` held
            posterior draws (the denoised estimate at the current sample); None for a score.
    """

    prev_sample: torch.Tensor
    pred_original_sample: Optional[torch.Tensor] = None


class EnergyTweedieLangevinScheduler(SchedulerMixin, ConfigMixin):
    """Annealed Langevin along an etweedie noise path, with the fused Energy-Tweedie Langevin step.

    Args (all saved in ``scheduler_config.json``):
        path: a built-in path name (:func:`etweedie.sample.paths.path_names`: "gaussian", "isotropic",
            "nondiagonal", "rotating", "joint", the MNIST paths, ...).
        num_levels: default number of levels L for :meth:`set_timesteps` (None: the paper's
            count for the path, e.g. 51 for the eight-Gaussians paths).
        r_max, r_min: override the path's realized-RMS range (both or neither; None: the path's own).
        steps_per_level: Langevin updates per level (≥ 1).
        first_level_steps: updates at the first level instead (≥ 1; None: ``steps_per_level``).
        step_scale: ε > 0, the step at the terminal level; α_k = ε (r_k / r_{L−1})².
        data_std: per-coordinate standard deviation of the data; ``init_noise_sigma`` is
            sqrt(r_0² + data_std²), the scale of the standard-normal start that matches the
            noisy marginal's second moment at the first level.
    """

    config_name = "scheduler_config.json"
    order = 1

    @register_to_config
    def __init__(
        self,
        path: str = "gaussian",
        num_levels: Optional[int] = None,
        r_max: Optional[float] = None,
        r_min: Optional[float] = None,
        steps_per_level: int = 10,
        first_level_steps: Optional[int] = None,
        step_scale: float = 2e-5,
        data_std: float = 0.0,
    ):
        if not isinstance(path, str) or path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}; got {path!r}")
        if (r_max is None) != (r_min is None):
            raise ValueError(f"r_max and r_min must be given together, got r_max={r_max!r}, r_min={r_min!r}")
        self._path: NoisePath = get_path(path, None if r_max is None else GeometricRMS(r_max, r_min))
        for name, value, minimum in (("steps_per_level", steps_per_level, 1), ("first_level_steps", first_level_steps, 1),
                                     ("num_levels", num_levels, 1)):
            if value is None and name != "steps_per_level":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if isinstance(step_scale, bool) or not isinstance(step_scale, (int, float)) or not (step_scale > 0 and math.isfinite(step_scale)):
            raise ValueError(f"step_scale must be a float > 0, got {step_scale!r}")
        if isinstance(data_std, bool) or not isinstance(data_std, (int, float)) or not (data_std >= 0 and math.isfinite(data_std)):
            raise ValueError(f"data_std must be a float >= 0, got {data_std!r}")
        self.timesteps: Optional[torch.Tensor] = None
        self.num_inference_steps: Optional[int] = None
        self.set_timesteps(num_levels if num_levels is not None else DEFAULT_LEVELS[path])

    # ------------------------------------------------------------------ schedule
    @property
    def noise_path(self) -> NoisePath:
        """The :class:`~etweedie.sample.paths.NoisePath` this scheduler follows."""
        return self._path

    def set_timesteps(self, num_inference_steps: Optional[int] = None, device: Union[str, torch.device, None] = None) -> None:
        """Use ``num_inference_steps`` = L levels (None: the config's): ``timesteps`` lists the path
        time of every Langevin update, level by level, noisiest (t = 0) first."""
        if num_inference_steps is None:
            num_inference_steps = self.config.num_levels or DEFAULT_LEVELS[self.config.path]
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps (levels) must be an int >= 1, got {num_inference_steps!r}")
        device = check_device(device, "device")
        # every value first, then one assignment: a failing call leaves the scheduler as it was
        times = level_times(num_inference_steps)
        params = self._path(times)
        level_rms = params.realized_rms().to(torch.float64)
        level_steps = step_sizes(self._path, times, float(self.config.step_scale))
        first = self.config.first_level_steps or self.config.steps_per_level
        repeats = torch.full((num_inference_steps,), self.config.steps_per_level, dtype=torch.long)
        repeats[0] = first
        timesteps = torch.repeat_interleave(times, repeats).to(device)
        self.level_times, self.level_rms, self.level_steps = times, level_rms, level_steps
        self.timesteps = timesteps
        self.num_inference_steps = num_inference_steps
        self.init_noise_sigma = math.sqrt(float(self.level_rms[0]) ** 2 + float(self.config.data_std) ** 2)

    def _level(self, timestep) -> int:
        if self.timesteps is None:
            raise RuntimeError("call set_timesteps before step")
        if isinstance(timestep, torch.Tensor):
            if timestep.numel() != 1 or timestep.dtype == torch.bool or timestep.is_complex():
                raise TypeError(
                    f"timestep must be one entry of scheduler.timesteps (a number or a one-element real tensor), "
                    f"got a {timestep.dtype} tensor of shape {tuple(timestep.shape)}"
                )
            t = float(timestep.item())
        elif isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
            t = float(timestep)
        else:
            raise TypeError(
                "timestep must be one entry of scheduler.timesteps (a number or a one-element real tensor), "
                f"got {type(timestep).__name__} {timestep!r}"
            )
        # the nearest level time, within a quarter of the smallest spacing: a copy of a timestep
        # cast to float32 or float16 (a pipeline's cast, a device without float64) still names its level
        gap = torch.diff(self.level_times).min().item() if self.level_times.numel() > 1 else 1.0
        distance = (self.level_times - t).abs()
        level = int(torch.argmin(distance)) if math.isfinite(t) else -1
        if level < 0 or float(distance[level]) > 0.25 * gap:
            raise ValueError(f"timestep {t!r} is not one of this schedule's level times (use scheduler.timesteps)")
        return level

    def noise_params(self, timestep) -> NoiseParams:
        """The path's tuple (β, λ, σ, u, v) at this timestep (scalar fields, float64)."""
        t = self.level_times[self._level(timestep)]
        return self._path(t)

    def eta(self, timestep, batch: Optional[int] = None, *, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """η = (β, log λ, log σ, u, v) at this timestep: ``(5,)``, or ``(batch, 5)`` to condition a model."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype (η holds log λ, log σ), got {dtype!r}")
        device = check_device(device, "device")
        if batch is not None:
            batch = check_int(batch, "batch", minimum=0)
        eta = self.noise_params(timestep).eta().to(dtype=dtype, device=device)
        return eta if batch is None else eta.expand(batch, 5)

    def step_size(self, timestep) -> float:
        """α_k of the level this timestep belongs to."""
        return float(self.level_steps[self._level(timestep)])

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        """The model sees the noisy sample as it is (no input scaling in this variance-exploding path)."""
        return sample

    # ------------------------------------------------------------------ the update
    def step(
        self,
        model_output: torch.Tensor,
        timestep,
        sample: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        return_dict: bool = True,
    ) -> Union[EnergyTweedieSchedulerOutput, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """One Langevin update at ``timestep``.

        Args:
            model_output: posterior draws ``(B, N, *event)`` at ``sample`` or the score ``(B, *event)``.
            timestep: an entry of ``timesteps``.
            sample: the current samples ``(B, *event)``, float32/float64.
            generator: the ``torch.Generator`` for ξ (required: randomness is always explicit).
            return_dict: return :class:`EnergyTweedieSchedulerOutput` (else a tuple).
        """
        if not isinstance(sample, torch.Tensor) or sample.dtype not in (torch.float32, torch.float64):
            got = sample.dtype if isinstance(sample, torch.Tensor) else type(sample).__name__
            raise TypeError(f"sample must be a float32/float64 tensor of shape (batch, *event), got {got}")
        if sample.dim() < 2:
            raise ValueError(f"sample must have shape (batch, *event), got {tuple(sample.shape)}")
        if not isinstance(model_output, torch.Tensor) or not model_output.is_floating_point():
            got = model_output.dtype if isinstance(model_output, torch.Tensor) else type(model_output).__name__
            # an integer, bool or complex tensor would be cast silently (a complex one losing its imaginary part)
            raise TypeError(f"model_output must be a floating-point tensor of posterior draws or a score, got {got}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator (the Langevin noise is drawn from it), got {type(generator).__name__}"
            )
        k = self._level(timestep)
        alpha = float(self.level_steps[k])
        B, event = sample.shape[0], sample.shape[1:]
        d = math.prod(event)
        y = sample.reshape(B, d)  # (not -1: a zero-size batch)
        xi = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
        if model_output.dim() == sample.dim() + 1 and model_output.shape[0] == B and model_output.shape[2:] == event:
            draws = model_output.reshape(B, model_output.shape[1], d).to(y.dtype)
            level = self._path(self.level_times[k])
            metric = level.metric(d).to(device=y.device, dtype=y.dtype)
            y_next = langevin_step(y, draws, xi, alpha, float(level.beta), float(level.lam), metric)
            mean = draws.mean(1).reshape(sample.shape)
        elif model_output.shape == sample.shape:
            s = model_output.reshape(B, d).to(y.dtype)
            y_next = y + alpha * s + math.sqrt(2 * alpha) * xi
            mean = None
        else:
            raise ValueError(
                f"model_output must be posterior draws (B, N, *event) = ({B}, N, {', '.join(map(str, event))}) or a score "
                f"of sample's shape {tuple(sample.shape)}, got {tuple(model_output.shape)}"
            )
        prev = y_next.reshape(sample.shape)
        if not return_dict:
            return prev, mean
        return EnergyTweedieSchedulerOutput(prev_sample=prev, pred_original_sample=mean)
