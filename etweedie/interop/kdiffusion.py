"""A k-diffusion denoiser from a posterior sampler, for Gaussian noise paths.

k-diffusion's samplers (``sample_euler``, ``sample_heun``, ``sample_dpmpp_2m``, ...) integrate
the probability-flow ODE of the variance-exploding Gaussian diffusion x_σ = x_0 + σ C^{1/2} ε
(ε ~ N(0, I), C a fixed covariance shape, tr C = d):

    dx/dσ = −σ C ∇ log p_σ(x) = (x − D(x, σ)) / σ,        D(x, σ) = E[x_0 | x_σ] = x + σ² C s(x)

by calling ``model(x, sigma)`` for the denoised estimate D.  That identity — Tweedie's formula
— and the ODE both rest on the noise being Gaussian with a covariance shape that does not change
with σ.  Under generalized-Gaussian noise (β < 2) the marginals do not follow this ODE and E[x_0 | x]
is not x + σ² C s(x), so :class:`KDiffusionDenoiser` refuses paths with β ≠ 2 anywhere, or whose
(λ, u, v) change along the path; sample those with :func:`etweedie.sample.sample_langevin` or
the diffusers scheduler (:mod:`etweedie.interop.diffusers_scheduler`), which need only the score.

On a Gaussian path (β = 2) the five-parameter noise at realized RMS σ has covariance
Cov(u) = σ² S(u, v) (c_{2,d} = 1, so Σ/λ = σ² S), and the denoiser is computed by the
Energy-Tweedie route: ŝ from N posterior draws with the fused op, then D = x + σ² S ŝ (which
equals the mean of the draws, up to rounding).

Example::

    >>> import torch
    >>> from etweedie.posteriors.known import KnownPosterior
    >>> from etweedie.interop import KDiffusionDenoiser
    >>> denoiser = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=32,
    ...                               generator=torch.Generator().manual_seed(0))
    >>> sigmas = denoiser.sigmas(20)               # the path's RMS levels, then 0 (k-diffusion's convention)
    >>> x = sigmas[0] * torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    >>> denoiser(x, sigmas[0].expand(8)).shape     # what k_diffusion.sampling.sample_euler calls
    torch.Size([8, 2])
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types
from typing import Optional, Union

import torch

from .._checks import check_device
from ..noise import NoiseParams
from ..sample.paths import PATHS, NoisePath, get_path, level_times
from .score import SamplerScore, _row_sigma

__all__ = ["KDiffusionDenoiser", "load_k_diffusion_sampling"]

# Path times at which a path is checked to be Gaussian with constant (λ, u, v).
_CHECK_TIMES = 1025


class KDiffusionDenoiser:
    """``model(x, sigma) -> D(x, σ)`` for k-diffusion samplers, from posterior draws on a Gaussian path.

    Args:
        sampler: a posterior model with ``sample(y, eta, n, *, generator)`` (η from the path's
            tuple at σ) or a callable ``sampler(y, n, generator[, noise=NoiseParams])``; see
            :func:`etweedie.interop.score_from_sampler`.
        path: a built-in path name or a :class:`~etweedie.sample.paths.NoisePath`; it must have β = 2
            everywhere and constant (λ, u, v).  Only its shape and its RMS range are used: k-diffusion's
            σ is the realized per-coordinate RMS of the noise.
        n_draws: N posterior draws per call.
        generator: the ``torch.Generator`` of the draws (None: a fresh one seeded with 0).

    ``denoiser(x, sigma)``: x ``(B, *event)`` (flattened to ``(B, d)`` for the sampler and back),
    sigma a number or a ``(B,)`` tensor, finite and >= 0; rows with σ = 0 come back unchanged.
    """

    def __init__(
        self,
        sampler,
        path: Union[str, NoisePath] = "gaussian",
        *,
        n_draws: int,
        generator: Optional[torch.Generator] = None,
    ):
        if isinstance(path, str):
            if path not in PATHS:
                raise ValueError(f"path must be a NoisePath or one of {', '.join(PATHS)}; got {path!r}")
            path = get_path(path)
        if not isinstance(path, NoisePath):
            raise TypeError(f"path must be a built-in path name or an etweedie.sample.paths.NoisePath, got {type(path).__name__}")
        beta, lam, _, u, v = path.coordinates(level_times(_CHECK_TIMES))
        if not bool((beta == 2).all()):
            raise ValueError(
                f"path {path.name!r} has β in [{beta.min().item():.4g}, {beta.max().item():.4g}], but k-diffusion samplers need "
                "Gaussian noise (β = 2 everywhere): they integrate the probability-flow ODE dx/dσ = (x − D(x, σ))/σ, which "
                "holds only when x_σ = x_0 + σ·Gaussian, and D(x, σ) = x + σ²·score is Tweedie's formula for Gaussian noise. "
                "Sample non-Gaussian paths with etweedie.sample.sample_langevin or etweedie.interop.diffusers_scheduler"
            )
        for name, coord in (("lam", lam), ("u", u), ("v", v)):
            if not bool((coord == coord[0]).all()):
                raise ValueError(
                    f"path {path.name!r} changes {name} along the path (from {coord.min().item():.4g} to {coord.max().item():.4g}); "
                    "k-diffusion's ODE dx/dσ = (x − D)/σ assumes a fixed noise covariance shape, so (λ, u, v) must be constant"
                )
        self.path = path
        self.lam, self.u, self.v = float(lam[0]), float(u[0]), float(v[0])
        self.score = SamplerScore(sampler, n_draws, generator)

    def __repr__(self) -> str:
        return f"KDiffusionDenoiser(path={self.path.name!r}, n_draws={self.score.n_draws})"

    def sigmas(self, n_levels: int, *, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """The path's realized-RMS levels r_{t_k} at ``level_times(n_levels)``, then 0: ``(n_levels + 1,)``, decreasing."""
        _check_float_dtype(dtype)
        device = check_device(device, "device")
        r = self.path.rms(level_times(n_levels, dtype=torch.float64)).to(dtype=dtype, device=device)
        return torch.cat([r, r.new_zeros(1)])

    def noise_params(self, sigma: torch.Tensor) -> NoiseParams:
        """The path's tuple at realized RMS σ: (2, λ, σ √λ, u, v) (σ > 0), fields of sigma's shape."""
        return NoiseParams(2.0, self.lam, sigma * self.lam**0.5, self.u, self.v)

    def __call__(self, x: torch.Tensor, sigma) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float64):
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x must be a float32/float64 tensor of shape (batch, *event), got {got}")
        if x.dim() < 2:
            raise ValueError(f"x must have shape (batch, *event), got {tuple(x.shape)}")
        flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # (not -1: a zero-size batch)
        sigma = _row_sigma(sigma, x, flat.shape[0])
        out = flat.clone()
        live = sigma > 0
        if bool(live.any()):
            y, s_live = flat[live], sigma[live]
            params = self.noise_params(s_live)
            s = self.score(y, params)
            if self.u == 0.0 and self.v == 0.0:
                cov_s = s_live.unsqueeze(-1) ** 2 * s
            else:  # Cov = Σ/λ = σ² (I ⊗ S(u, v))
                cov_s = params.metric(y.shape[-1]).to(dtype=y.dtype, device=y.device).apply_covariance(s) / self.lam
            out[live] = y + cov_s
        return out.reshape(x.shape)


def _check_float_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def _append_dims(x: torch.Tensor, target_dims: int) -> torch.Tensor:
    """x with trailing singleton dims up to ``target_dims`` (the one helper k_diffusion.sampling takes from its utils)."""
    missing = target_dims - x.dim()
    if missing < 0:
        raise ValueError(f"input has {x.dim()} dims but target_dims is {target_dims}, which is less")
    return x.reshape(*x.shape, *([1] * missing))


_SHIM = "_etweedie_k_diffusion"


def load_k_diffusion_sampling() -> types.ModuleType:
    """The module ``k_diffusion.sampling`` (its samplers: ``sample_euler``, ``sample_heun``, ``sample_dpmpp_2m``, ...).

    ``import k_diffusion.sampling`` runs the package's ``__init__``, which imports every
    submodule and with them torchvision, scikit-image, clip, kornia, wandb, ...; the samplers
    themselves need only torch, scipy, torchsde and torchdiffeq, and one helper
    (``utils.append_dims``) from ``k_diffusion/utils.py`` (which imports torchvision).  So when
    the plain import fails, this loads the installed ``sampling.py`` file itself as
    ``_etweedie_k_diffusion.sampling``, with a stand-in ``utils`` holding ``append_dims``.  The
    sampler code run is the installed package's, unchanged.

    Install for that: ``pip install --no-deps k-diffusion torchsde torchdiffeq trampoline scipy``
    (``--no-deps``: k-diffusion's declared dependencies include torchvision, which would pull a
    second torch).
    """
    try:
        return importlib.import_module("k_diffusion.sampling")
    except Exception as exc:  # ImportError of a heavy dependency, or any failure inside the package's __init__
        first_error = exc
    if _SHIM + ".sampling" in sys.modules:
        return sys.modules[_SHIM + ".sampling"]
    spec = importlib.util.find_spec("k_diffusion")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    files = [os.path.join(loc, "sampling.py") for loc in locations if os.path.exists(os.path.join(loc, "sampling.py"))]
    if not files:
        raise ImportError(
            "k-diffusion is not installed; install its samplers with "
            "`pip install --no-deps k-diffusion torchsde torchdiffeq trampoline scipy`"
        ) from first_error
    package = types.ModuleType(_SHIM)
    package.__path__ = []  # a namespace for the stand-in only: nothing else resolves inside it
    utils = types.ModuleType(_SHIM + ".utils")
    utils.append_dims = _append_dims
    package.utils = utils
    sampling_spec = importlib.util.spec_from_file_location(_SHIM + ".sampling", files[0])
    module = importlib.util.module_from_spec(sampling_spec)
    sys.modules[_SHIM] = package
    sys.modules[_SHIM + ".utils"] = utils
    sys.modules[_SHIM + ".sampling"] = module
    try:
        sampling_spec.loader.exec_module(module)
    except ImportError as exc:
        for name in (_SHIM + ".sampling", _SHIM + ".utils", _SHIM):
            sys.modules.pop(name, None)
        missing = (exc.name or "").split(".")[0] or "torchsde torchdiffeq trampoline scipy"
        raise ImportError(
            f"k_diffusion/sampling.py needs {exc.name or exc}: `pip install --no-deps {missing}` "
            f"(the plain import failed first with: {first_error})"
        ) from exc
    return module
