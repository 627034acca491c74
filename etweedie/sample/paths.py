"""Noise-parameter paths t ↦ (β_t, λ_t, σ_t, u_t, v_t) and realized-RMS schedules (paper §5.3, App. diffusion).

Energy-Tweedie diffusion samples along a *path* through the five-parameter noise space,
chosen freely at sampling time.  Paths are stated, as in the paper, in terms of the realized
per-coordinate RMS ``r_t`` of the noise rather than the raw scale: a path gives the shape
coordinates ``(β_t, λ_t, u_t, v_t)`` and an RMS schedule ``r_t``, and fixes

    σ_t = r_t λ_t^{1/β_t}                       (so that r_t = σ_t λ_t^{−1/β_t}; NoiseParams.sigma_for_rms)

The schedules are geometric in t, ``r_t = r_max (r_min / r_max)^t``, and the sampler visits the
levels ``t_k = k / (L − 1)``, k = 0..L−1 (:func:`level_times`), so the realized RMS decreases
geometrically from ``r_max`` (t = 0, most noise) to ``r_min`` (t = 1).

Built-in paths (:func:`get_path`, :data:`PATHS`):

* the four Eight-Gaussian paths of Eq. (full5_paths), on the 51-level schedule r 0.83 → 0.0083:
  ``isotropic`` (β, λ, u, v) = (1.4, 1.8, 0, 0); ``nondiagonal`` (1.4, 1.8, 0, 0.6);
  ``rotating`` (1.4, 1.8) with (u, v) = 0.6 (cos θ_t, sin θ_t), θ_t = π/2 + 2πt;
  ``joint`` β_t = 1.4 + 0.5 sin²(πt), λ_t = 1.8 + 0.4 sin(2πt), (u, v) as rotating;
* ``gaussian`` (2, 1, 0, 0) on the same schedule (ordinary Gaussian diffusion; the exact
  known posterior makes it the ground-truth test case);
* the constant-parameter isolation arms ``fixed_ref`` (1.4, 1.8, 0, 0.6) and the
  single-coordinate arms ``fixed_beta1.3`` … ``fixed_uv-0.6,0`` (:data:`ISOLATION_ARMS`), on the
  shared 49-level schedule r 0.8329 → 0.0100;
* the five MNIST paths of Eq. (mnist_paths), r_t = 2.63 (0.197/2.63)^t over 64 levels:
  ``mnist_gaussian_isotropic`` (2, 1, 0, 0), ``mnist_gaussian_nondiagonal`` (2, 1, 0, 0.6),
  ``mnist_generalized_isotropic`` (1.4, 1.8, 0, 0), ``mnist_generalized_nondiagonal``
  (1.4, 1.8, 0, 0.6) and ``mnist_joint`` β_t = 2 − 0.6t, λ_t = 1 + 0.8t, u_t = 0.3 sin(πt), v_t = 0.6t.

A user path is a few lines: each coordinate is a float or a function of a tensor t::

    >>> import math, torch
    >>> from etweedie.sample.paths import GeometricRMS, NoisePath, level_times
    >>> path = NoisePath("tilting", beta=1.6, lam=1.5, u=0.0,
    ...                  v=lambda t: 0.5 * torch.sin(math.pi * t), rms=GeometricRMS(0.8, 0.01))
    >>> p = path(level_times(5))                      # NoiseParams with (5,) fields
    >>> [round(x, 4) for x in p.realized_rms().tolist()]
    [0.8, 0.2675, 0.0894, 0.0299, 0.01]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .._checks import check_device, check_float, check_int
from ..noise import NoiseParams

#: The largest realized RMS a schedule accepts: a million times unit-scale data, far beyond any
#: sampler's first level, while r² and the noise energies stay finite in float32.
MAX_RMS = 1e6

__all__ = [
    "MAX_RMS",
    "DEFAULT_LEVELS",
    "EIGHT_GAUSSIAN_PATHS",
    "EIGHT_GAUSSIAN_RMS",
    "ISOLATION_ARMS",
    "ISOLATION_RMS",
    "MNIST_PATHS",
    "MNIST_RMS",
    "PATHS",
    "GeometricRMS",
    "NoisePath",
    "get_path",
    "level_times",
    "path_names",
]

Coordinate = Union[float, Callable[[torch.Tensor], torch.Tensor]]


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class GeometricRMS:
    """Realized-RMS schedule ``r_t = r_max (r_min / r_max)^t``, t ∈ [0, 1] (paper App. diffusion).

    Evaluated on :func:`level_times` (L levels) it gives L geometrically spaced levels from
    ``r_max`` down to ``r_min``; the ratio between neighbours is ``(r_min/r_max)^{1/(L−1)}``.

    Example::

        >>> GeometricRMS(0.83, 0.0083)(torch.tensor([0.0, 0.5, 1.0]))
        tensor([0.8300, 0.0830, 0.0083])
    """

    r_max: float
    r_min: float

    def __post_init__(self):
        for name in ("r_max", "r_min"):
            object.__setattr__(self, name, check_float(getattr(self, name), f"GeometricRMS: {name}", 0, MAX_RMS,
                                                       strict=True))
        if not self.r_min < self.r_max:  # (check_float refused inf and NaN)
            raise ValueError(f"GeometricRMS: need finite r_max > r_min (the RMS falls from r_max to r_min), "
                             f"got r_max = {self.r_max!r}, r_min = {self.r_min!r}")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = _check_times(t)
        return self.r_max * torch.exp(t * math.log(self.r_min / self.r_max))


def level_times(n_levels: int, *, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The sampler's level times ``t_k = k/(L − 1)``, k = 0..L−1 (t = 0: the first, noisiest level).

    Example::

        >>> level_times(3)
        tensor([0.0000, 0.5000, 1.0000], dtype=torch.float64)
    """
    n_levels = check_int(n_levels, "n_levels", minimum=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (level times lie in [0, 1]), got {dtype!r}")
    device = check_device(device, "device")
    if n_levels == 1:
        return torch.ones(1, dtype=dtype, device=device)
    return torch.linspace(0.0, 1.0, n_levels, dtype=dtype, device=device)


def _check_times(t) -> torch.Tensor:
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        t = torch.tensor(float(t), dtype=torch.float64)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"t must be a float or a floating-point tensor of path times, got {got}")
    if t.numel() and not bool(((t >= 0) & (t <= 1)).all()):
        raise ValueError(f"t must lie in [0, 1], got values in [{t.min().item():.4g}, {t.max().item():.4g}]")
    return t


# ---------------------------------------------------------------------------- paths
class NoisePath:
    """A noise-parameter path: ``path(t) -> NoiseParams`` for path times t ∈ [0, 1] (vectorized).

    Args:
        name: a label (figures, JSON).
        beta, lam, u, v: each a float (constant along the path) or a function mapping a tensor of
            times to a tensor of the same shape.
        rms: the realized-RMS schedule ``t ↦ r_t`` (e.g. :class:`GeometricRMS`); σ_t is set to
            ``r_t λ_t^{1/β_t}`` so the noise at t has per-coordinate RMS exactly ``r_t``.
        description: one line for tables.

    Calling the path with a tensor ``t`` of shape ``S`` returns :class:`NoiseParams` whose
    five fields have shape ``S`` (in t's dtype and device); the tuple is validated there
    (β ∈ (0, 2], λ > 0, u² + v² < 1).
    """

    def __init__(
        self,
        name: str,
        *,
        beta: Coordinate,
        lam: Coordinate,
        u: Coordinate = 0.0,
        v: Coordinate = 0.0,
        rms: Callable[[torch.Tensor], torch.Tensor],
        description: str = "",
    ):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        for coord_name, coord in (("beta", beta), ("lam", lam), ("u", u), ("v", v)):
            if not (callable(coord) or (isinstance(coord, (int, float)) and not isinstance(coord, bool))):
                raise TypeError(f"{coord_name} must be a float or a callable of t, got {type(coord).__name__}")
        if not callable(rms):
            raise TypeError(f"rms must be a callable t -> r_t (e.g. GeometricRMS), got {type(rms).__name__}")
        self.name = name
        self.beta, self.lam, self.u, self.v = beta, lam, u, v
        self.rms = rms
        self.description = description

    def __repr__(self) -> str:
        return f"NoisePath({self.name!r}, rms={self.rms!r})"

    def with_rms(self, rms: Callable[[torch.Tensor], torch.Tensor]) -> "NoisePath":
        """The same shape coordinates on another realized-RMS schedule."""
        return NoisePath(self.name, beta=self.beta, lam=self.lam, u=self.u, v=self.v, rms=rms, description=self.description)

    def coordinates(self, t) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(β_t, λ_t, r_t, u_t, v_t)`` as tensors of t's shape (what the parameter-path figure plots)."""
        t = _check_times(t)

        def evaluate(coord, coord_name):
            value = coord(t) if callable(coord) else torch.full_like(t, float(coord))
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"path {self.name!r}: {coord_name}(t) must return a tensor, got {type(value).__name__}")
            if value.is_complex() or value.dtype == torch.bool:
                # a cast to t's dtype would drop the imaginary part (or read True as 1) silently
                raise TypeError(f"path {self.name!r}: {coord_name}(t) must return a real-valued tensor, got {value.dtype}")
            try:
                fits = torch.broadcast_shapes(value.shape, t.shape) == t.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"path {self.name!r}: {coord_name}(t) must return a tensor of t's shape "
                                 f"{tuple(t.shape)} (or one broadcasting to it), got {tuple(value.shape)}")
            return value.to(t.dtype).expand(t.shape)

        r = evaluate(self.rms, "rms")
        return evaluate(self.beta, "beta"), evaluate(self.lam, "lam"), r, evaluate(self.u, "u"), evaluate(self.v, "v")

    def __call__(self, t) -> NoiseParams:
        beta, lam, r, u, v = self.coordinates(t)
        return NoiseParams(beta, lam, NoiseParams.sigma_for_rms(r, lam, beta), u, v)


# ---------------------------------------------------------------------------- built-in paths
EIGHT_GAUSSIAN_RMS = GeometricRMS(0.83, 0.0083)  # 51 levels in the paper
EIGHT_GAUSSIAN_LEVELS = 51
# The isolation study's 49 levels from 0.8329 to 0.0100 (App. diffusion_full5).
ISOLATION_RMS = GeometricRMS(0.8329, 0.0100)
ISOLATION_LEVELS = 49
MNIST_RMS = GeometricRMS(2.63, 0.197)  # 64 levels in the paper
MNIST_LEVELS = 64

_DISK_RADIUS = 0.6


def _rotating_u(t: torch.Tensor) -> torch.Tensor:
    return _DISK_RADIUS * torch.cos(math.pi / 2 + 2 * math.pi * t)


def _rotating_v(t: torch.Tensor) -> torch.Tensor:
    return _DISK_RADIUS * torch.sin(math.pi / 2 + 2 * math.pi * t)


def _joint_beta(t: torch.Tensor) -> torch.Tensor:
    return 1.4 + 0.5 * torch.sin(math.pi * t) ** 2


def _joint_lam(t: torch.Tensor) -> torch.Tensor:
    return 1.8 + 0.4 * torch.sin(2 * math.pi * t)


EIGHT_GAUSSIAN_PATHS: Dict[str, NoisePath] = {
    "isotropic": NoisePath(
        "isotropic", beta=1.4, lam=1.8, u=0.0, v=0.0, rms=EIGHT_GAUSSIAN_RMS, description="Isotropic, fixed tail"
    ),
    "nondiagonal": NoisePath(
        "nondiagonal", beta=1.4, lam=1.8, u=0.0, v=0.6, rms=EIGHT_GAUSSIAN_RMS, description="Fixed non-diagonal, fixed tail"
    ),
    "rotating": NoisePath(
        "rotating", beta=1.4, lam=1.8, u=_rotating_u, v=_rotating_v, rms=EIGHT_GAUSSIAN_RMS,
        description="Rotating covariance, fixed tail",
    ),
    "joint": NoisePath(
        "joint", beta=_joint_beta, lam=_joint_lam, u=_rotating_u, v=_rotating_v, rms=EIGHT_GAUSSIAN_RMS,
        description="Joint five-parameter path",
    ),
}

_GAUSSIAN_PATH = NoisePath(
    "gaussian", beta=2.0, lam=1.0, u=0.0, v=0.0, rms=EIGHT_GAUSSIAN_RMS, description="Gaussian, isotropic (exact posterior)"
)

# name -> (β, λ, u, v), held constant along the path (App. diffusion_full5, fixed-parameter isolation).
ISOLATION_ARMS: Dict[str, Tuple[float, float, float, float]] = {
    "fixed_ref": (1.4, 1.8, 0.0, 0.6),
    "fixed_beta1.3": (1.3, 1.8, 0.0, 0.6),
    "fixed_beta1.6": (1.6, 1.8, 0.0, 0.6),
    "fixed_beta1.8": (1.8, 1.8, 0.0, 0.6),
    "fixed_beta2.0": (2.0, 1.8, 0.0, 0.6),
    "fixed_lam1.0": (1.4, 1.0, 0.0, 0.6),
    "fixed_lam2.5": (1.4, 2.5, 0.0, 0.6),
    "fixed_uv0,0": (1.4, 1.8, 0.0, 0.0),
    "fixed_uv0.6,0": (1.4, 1.8, 0.6, 0.0),
    "fixed_uv0,-0.6": (1.4, 1.8, 0.0, -0.6),
    "fixed_uv-0.6,0": (1.4, 1.8, -0.6, 0.0),
}


def _isolation_path(name: str, values: Tuple[float, float, float, float]) -> NoisePath:
    beta, lam, u, v = values
    return NoisePath(
        name, beta=beta, lam=lam, u=u, v=v, rms=ISOLATION_RMS, description=f"fixed (β, λ, u, v) = ({beta:g}, {lam:g}, {u:g}, {v:g})"
    )


MNIST_PATHS: Dict[str, NoisePath] = {
    "mnist_gaussian_isotropic": NoisePath(
        "mnist_gaussian_isotropic", beta=2.0, lam=1.0, u=0.0, v=0.0, rms=MNIST_RMS, description="Gaussian / isotropic"
    ),
    "mnist_gaussian_nondiagonal": NoisePath(
        "mnist_gaussian_nondiagonal", beta=2.0, lam=1.0, u=0.0, v=0.6, rms=MNIST_RMS, description="Gaussian / non-diagonal"
    ),
    "mnist_generalized_isotropic": NoisePath(
        "mnist_generalized_isotropic", beta=1.4, lam=1.8, u=0.0, v=0.0, rms=MNIST_RMS, description="Generalized / isotropic"
    ),
    "mnist_generalized_nondiagonal": NoisePath(
        "mnist_generalized_nondiagonal", beta=1.4, lam=1.8, u=0.0, v=0.6, rms=MNIST_RMS,
        description="Generalized / non-diagonal",
    ),
    "mnist_joint": NoisePath(
        "mnist_joint",
        beta=lambda t: 2.0 - 0.6 * t,
        lam=lambda t: 1.0 + 0.8 * t,
        u=lambda t: 0.3 * torch.sin(math.pi * t),
        v=lambda t: 0.6 * t,
        rms=MNIST_RMS,
        description="Joint five-parameter path",
    ),
}

PATHS: Dict[str, NoisePath] = {
    **EIGHT_GAUSSIAN_PATHS,
    "gaussian": _GAUSSIAN_PATH,
    **{name: _isolation_path(name, values) for name, values in ISOLATION_ARMS.items()},
    **MNIST_PATHS,
}

# The number of levels each built-in path is sampled with in the paper.
DEFAULT_LEVELS: Dict[str, int] = {
    **{name: EIGHT_GAUSSIAN_LEVELS for name in (*EIGHT_GAUSSIAN_PATHS, "gaussian")},
    **{name: ISOLATION_LEVELS for name in ISOLATION_ARMS},
    **{name: MNIST_LEVELS for name in MNIST_PATHS},
}


def path_names() -> Tuple[str, ...]:
    """Names accepted by :func:`get_path`."""
    return tuple(PATHS)


def get_path(name: str, rms: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> NoisePath:
    """A built-in path by name, optionally on another RMS schedule.

    Example::

        >>> p = get_path("rotating")(torch.tensor([0.0, 1.0]))
        >>> [round(x, 4) for x in p.v.tolist()], [round(x, 4) for x in p.realized_rms().tolist()]
        ([0.6, 0.6], [0.83, 0.0083])
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in PATHS:
        raise ValueError(f"name must be one of {', '.join(PATHS)}; got {name!r}")
    path = PATHS[name]
    return path if rms is None else path.with_rms(rms)
