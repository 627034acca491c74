"""Posterior models: the conditional Engression generator ``x = g(y, η, ε)`` (DESIGN §6).

An Engression posterior (Shen & Meinshausen's StoNet; paper §5.1) is a neural sampler for
the denoising posterior P(X | Y = y) under the noise law with parameters η: fresh Gaussian
noise ε_l is concatenated into the input of *every* hidden layer, so one forward pass of a
deterministic network turns (y, η, ε) into one posterior draw.  It is trained with the
matched energy score ES_{Σ⁻¹,β} (paper Eq. es_tweedie; :mod:`etweedie.training`), and its draws
feed the Energy-Tweedie score

    s(y) = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i),     x_i = g(y, η, ε_i)

(paper Eq. sm_finite_sample).  The conditioning vector is η = (β, log λ, log σ, u, v)
(:meth:`etweedie.NoiseParams.eta`); it is affinely normalized to [−1, 1] over the training
range given at construction (``eta_low``/``eta_high``).

Architecture (L = ``depth`` hidden layers of width W, activation SiLU)::

    h_1     = act(M_0(η̃) ∘ A_0 [y, ε_0])
    h_{l+1} = h_l + act(M_l(η̃) ∘ A_l [h_l, ε_l])          l = 1 … L−1   (residual)
    x       = y + r(η) · A_out h_L                       (output="scaled_residual")

with the conditioning map M_l either

* ``conditioning="concat"``: η̃ concatenated to the layer input, M_l(η̃) ∘ z = z + C_l η̃;
* ``conditioning="film"``: feature-wise affine modulation (1 + γ_l(η̃)) ⊙ z + b_l(η̃), where
  (γ_l, b_l) come from a small MLP embedding of η̃ shared by all layers.

The output is ``"direct"`` (x = A_out h_L), ``"residual"`` (x = y + A_out h_L),
``"scaled_residual"`` (x = y + r(η) A_out h_L with the realized noise RMS r = σ λ^{−1/β},
so the network predicts the denoising displacement in noise units) or ``"preconditioned"``.

``"preconditioned"`` is the input/skip/output scaling of Karras et al. (2022, "Elucidating the
design space of diffusion-based generative models", §5 and Table 1), written in the realized RMS r
and the data's centre μ and per-coordinate scale s_d (``data_center``, ``data_std``)::

    c_in = 1/sqrt(s_d² + r²)   c_skip = s_d²/(s_d² + r²)   c_out = r s_d/sqrt(s_d² + r²)
    h_1 uses c_in (y − μ) in place of y;       x = μ + c_skip (y − μ) + c_out A_out h_L

With ``learn_data_scale=True`` μ and s_d are per-coordinate parameters (initialized at the two
scalars, learned with the rest), so every coordinate gets its own skip c_skip,p = s_p²/(s_p² + r²):
a coordinate the data never use (an MNIST border pixel, s_p → 0) learns to drop y and its noise
outright instead of passing c_skip·noise through.  A width-W MLP with W < d cannot cancel that
noise itself (its residual path has rank ≤ W), so without this the draws at small r keep
≈ c_skip of the input noise (measured: 0.71 of it at r = 0.197 for W = 512, d = 784).

The network's input then has unit scale at every noise level, and its output is weighted so that
at large r (r ≫ s_d: y is mostly noise) the draw comes from the network around μ instead of
from y plus an r-sized correction that must cancel the noise exactly, and at small r it is the
residual form.  For images whose noise RMS spans 0.2–6 (the MNIST training range, σ ∈ [0.025, 6])
this is what keeps the draws on the data manifold (experiments/mnist/RESULTS.md, posterior ablation).

``latent="noise_law"`` adds one more latent: a draw ẑ of the conditioned noise law itself,
standardized to unit RMS (ẑ = e / r(η), e ~ GG(β, λ, Σ)).  It enters the first layer (A_z ẑ)
and, through a learned η-dependent gate a(η̃), the output directly:

    x = y + r(η) · (A_out h_L + a(η̃) ẑ)                 (scaled_residual; r ẑ for the others)

Why: a SiLU network is asymptotically linear in ε, so from Gaussian ε alone its draws have at
most Gaussian tails.  As σ → 0 the posterior of y = x + e tends to y − e, whose tails are the
noise's (exp(−λ t^β), heavier than Gaussian for β < 2).  The Gaussian-latent full-config models
draw residuals with a kurtosis of ≈ 2.33 where the exact posterior has ≈ 2.47 at σ = 0.1–0.25
(experiments/estimation_diagnostics/RESULTS.md, "Residual tails of the learned posteriors"), which biases
β̂ upward at small σ; the noise-law latent gives the generator the right tail directly.

Per-query parts (y's and η's projections, the FiLM coefficients) are computed once per query
and broadcast over its n draws; only the ε-dependent parts run per draw.

Example::

    >>> import torch
    >>> from etweedie.posteriors.engression import EngressionPosterior
    >>> from etweedie.noise import NoiseParams
    >>> model = EngressionPosterior(dim=2, width=32, depth=2)
    >>> y = torch.zeros(4, 2); eta = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6).eta()
    >>> model.sample(y, eta, 16, generator=torch.Generator().manual_seed(0)).shape
    torch.Size([4, 16, 2])
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_generator, check_int
from ..noise import NoiseParams


def _written_as(dtype: torch.dtype, base: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """base + scale·out (scale None: base + out), computed in the inputs' promoted dtype and
    written in ``dtype`` by the same elementwise pass (``out=``; outside autograd and autocast),
    so 16-bit draws cost one rounding and no float32 copy.  Under autograd: the sum, then a cast."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (base, scale, out)):
        return (base + out if scale is None else base + scale * out).to(dtype)
    shape = torch.broadcast_shapes(base.shape, out.shape) if scale is None else \
        torch.broadcast_shapes(base.shape, scale.shape, out.shape)
    result = torch.empty(shape, dtype=dtype, device=out.device)
    with torch.autocast(out.device.type, enabled=False):
        if scale is None:
            return torch.add(base, out, out=result)
        return torch.addcmul(base, scale, out, out=result)

__all__ = ["EngressionPosterior", "ETA_DIM", "default_eta_bounds"]

ETA_DIM = 5  # η = (β, log λ, log σ, u, v)
#: Size limits of the architecture (far above any trained model's, so that a config read from a
#: file describes a network that can be laid out, on the meta device, in bounded time).
MAX_DIM, MAX_WIDTH, MAX_DEPTH = 1 << 24, 1 << 16, 1024
CONDITIONINGS = ("film", "concat")
OUTPUTS = ("scaled_residual", "residual", "direct", "preconditioned")
LATENTS = ("gaussian", "noise_law")


def default_eta_bounds(
    beta=(1.3, 2.0), lam=(1.0, 2.5), sigma=(0.1, 0.75), disk_radius: float = 0.7
) -> tuple:
    """(eta_low, eta_high) of the training prior: the box η is normalized over.

    Example::

        >>> low, high = default_eta_bounds()
        >>> [round(v, 4) for v in low]
        [1.3, 0.0, -2.3026, -0.7, -0.7]
    """
    low = (float(beta[0]), math.log(lam[0]), math.log(sigma[0]), -float(disk_radius), -float(disk_radius))
    high = (float(beta[1]), math.log(lam[1]), math.log(sigma[1]), float(disk_radius), float(disk_radius))
    return low, high


# ---------------------------------------------------------------------------- validation
def _check_choice(value, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _check_bounds(low, high) -> tuple:
    try:
        low = tuple(float(v) for v in low)
        high = tuple(float(v) for v in high)
    except (TypeError, ValueError):  # not iterable, or an entry that is not a number ("abcde")
        raise TypeError(f"eta_low and eta_high must be sequences of {ETA_DIM} floats, got {low!r} and {high!r}") from None
    if len(low) != ETA_DIM or len(high) != ETA_DIM:
        raise ValueError(f"eta_low and eta_high must have {ETA_DIM} entries, got {len(low)} and {len(high)}")
    if not all(math.isfinite(a) and math.isfinite(b) and b > a for a, b in zip(low, high)):
        raise ValueError(f"eta_low must be < eta_high entrywise (finite), got {low} and {high}")
    return low, high


# ---------------------------------------------------------------------------- layers
class _Affine(nn.Module):
    """z = x Wᵀ (+ b) with PyTorch's default U(±1/sqrt(fan_in)) init drawn from an explicit generator."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, generator: torch.Generator, gain: float = 1.0):
        super().__init__()
        bound = gain / math.sqrt(max(in_features, 1))
        self.weight = nn.Parameter((torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound)
        self.bias = nn.Parameter((torch.rand(out_features, generator=generator) * 2 - 1) * bound) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class EngressionPosterior(nn.Module):
    """Conditional Engression posterior x = g(y, η, ε) for d-dimensional data (see the module doc).

    Args:
        dim: data dimension d (≥ 1).
        width: hidden width W (≥ 1).
        depth: number of hidden layers L (≥ 1); each receives fresh noise ε_l.
        noise_dim: size of each ε_l (≥ 1).
        conditioning: ``"film"`` or ``"concat"``.
        output: ``"scaled_residual"``, ``"residual"`` or ``"direct"``.
        cond_width: width of the FiLM embedding MLP of η̃ (unused for ``"concat"``) and of the
            noise-law gate's MLP.
        latent: ``"gaussian"`` (ε only) or ``"noise_law"`` (ε plus a standardized draw of the
            conditioned noise law; needs an even ``dim``, the block metric's requirement).
        eta_low, eta_high: the box [low, high] of η over which it is normalized to [−1, 1]
            (default: the 2-D training prior, :func:`default_eta_bounds`).
        data_center, data_std: the data's centre μ and per-coordinate scale s_d (> 0) used by
            ``output="preconditioned"`` (ignored by the other outputs); e.g. 0.1307 and 0.3081
            for MNIST pixels in [0, 1].
        learn_data_scale: make μ and s_d per-coordinate learned parameters (``"preconditioned"``
            only), initialized at ``data_center`` and ``data_std``.
        init_seed: seed of the parameter initialization (a private ``torch.Generator``).

    Attributes:
        dim: d.  config: the dict of constructor arguments (``EngressionPosterior(**config)``
        rebuilds the architecture).
    """

    def __init__(
        self,
        dim: int = 2,
        *,
        width: int = 128,
        depth: int = 3,
        noise_dim: int = 8,
        conditioning: str = "film",
        output: str = "scaled_residual",
        cond_width: int = 64,
        latent: str = "gaussian",
        eta_low: Optional[Sequence[float]] = None,
        eta_high: Optional[Sequence[float]] = None,
        data_center: float = 0.0,
        data_std: float = 1.0,
        learn_data_scale: bool = False,
        init_seed: int = 0,
    ):
        super().__init__()
        self.dim = check_int(dim, "dim", 1, MAX_DIM)
        width = check_int(width, "width", 1, MAX_WIDTH)
        depth = check_int(depth, "depth", 1, MAX_DEPTH)
        noise_dim = check_int(noise_dim, "noise_dim", 1, MAX_WIDTH)
        cond_width = check_int(cond_width, "cond_width", 1, MAX_WIDTH)
        init_seed = check_int(init_seed, "init_seed", 0, 2**64 - 1)  # torch.Generator.manual_seed's range
        conditioning = _check_choice(conditioning, "conditioning", CONDITIONINGS)
        output = _check_choice(output, "output", OUTPUTS)
        latent = _check_choice(latent, "latent", LATENTS)
        if latent == "noise_law" and self.dim % 2:
            raise ValueError(f"latent='noise_law' needs an even dim (the (u, v) block metric), got dim={self.dim}")
        if (eta_low is None) != (eta_high is None):
            raise ValueError("eta_low and eta_high must be given together")
        if eta_low is None:
            eta_low, eta_high = default_eta_bounds()
        eta_low, eta_high = _check_bounds(eta_low, eta_high)
        for name, value in (("data_center", data_center), ("data_std", data_std)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite float, got {type(value).__name__} {value!r}")
        if data_std <= 0:
            raise ValueError(f"data_std must be > 0, got {data_std!r}")
        self.data_center, self.data_std = float(data_center), float(data_std)
        if not isinstance(learn_data_scale, bool):
            raise TypeError(f"learn_data_scale must be a bool, got {type(learn_data_scale).__name__}")
        if learn_data_scale and output != "preconditioned":
            raise ValueError(f"learn_data_scale=True needs output='preconditioned', got output={output!r}")
        self.learn_data_scale = learn_data_scale
        self.width, self.depth, self.noise_dim = width, depth, noise_dim
        self.conditioning, self.output, self.latent = conditioning, output, latent
        self.config: Dict[str, Any] = dict(
            dim=self.dim,
            width=width,
            depth=depth,
            noise_dim=noise_dim,
            conditioning=conditioning,
            output=output,
            cond_width=cond_width,
            latent=latent,
            eta_low=list(eta_low),
            eta_high=list(eta_high),
            data_center=self.data_center,
            data_std=self.data_std,
            learn_data_scale=learn_data_scale,
            init_seed=init_seed,
        )
        low = torch.tensor(eta_low, dtype=torch.float32)
        high = torch.tensor(eta_high, dtype=torch.float32)
        self.register_buffer("eta_center", (high + low) / 2)
        self.register_buffer("eta_halfwidth", (high - low) / 2)

        g = torch.Generator().manual_seed(init_seed)
        d = self.dim
        # Layer l's pre-activation is A_l [h_l, ε_l] (+ conditioning).  The h/y part and the ε
        # part are separate maps so the per-query part is computed once for all n draws.
        self.input_y = _Affine(d, width, generator=g)
        self.noise_maps = nn.ModuleList(_Affine(noise_dim, width, bias=False, generator=g) for _ in range(depth))
        self.hidden = nn.ModuleList(_Affine(width, width, generator=g) for _ in range(depth - 1))
        if conditioning == "concat":
            self.cond_maps = nn.ModuleList(_Affine(ETA_DIM, width, bias=False, generator=g) for _ in range(depth))
            self.cond_out = _Affine(ETA_DIM, d, bias=False, generator=g)
        else:
            self.film_embed = nn.Sequential(
                _Affine(ETA_DIM, cond_width, generator=g), nn.SiLU(), _Affine(cond_width, cond_width, generator=g), nn.SiLU()
            )
            # γ_l, b_l for every layer; small init so training starts near the unmodulated net.
            self.film_out = _Affine(cond_width, 2 * width * depth, generator=g, gain=0.1)
        self.out = _Affine(width, d, generator=g)
        if learn_data_scale:
            # deterministic init (no draws from g), so the other parameters' init is unchanged
            # μ_p = data_center + G θ_p, log s_p = log data_std + G φ_p with θ = φ = 0 at init: the
            # gain G = PIXEL_SCALE_GAIN lets Adam (steps ≈ lr in θ, φ) move them G× faster than the
            # weights, so the per-pixel skips settle within a CPU-scale run.
            self.pixel_center = nn.Parameter(torch.zeros(d))
            self.pixel_log_std = nn.Parameter(torch.zeros(d))
        if latent == "noise_law":
            # drawn after every other parameter, so a Gaussian-latent model's init is unchanged
            self.latent_map = _Affine(d, width, bias=False, generator=g)
            self.latent_gate = nn.Sequential(
                _Affine(ETA_DIM, cond_width, generator=g), nn.SiLU(), _Affine(cond_width, 1, generator=g, gain=0.1)
            )

    # ------------------------------------------------------------------ pieces
    def normalize_eta(self, eta: torch.Tensor) -> torch.Tensor:
        """η̃ = (η − center)/halfwidth: the training box mapped to [−1, 1]⁵."""
        return (eta - self.eta_center.to(eta.dtype)) / self.eta_halfwidth.to(eta.dtype)

    @staticmethod
    def realized_rms(eta: torch.Tensor) -> torch.Tensor:
        """r = σ λ^{−1/β} = exp(log σ − log λ / β) from η = (β, log λ, log σ, u, v): ``(..., 5)`` → ``(...)``."""
        return torch.exp(eta[..., 2] - eta[..., 1] / eta[..., 0])

    @property
    def latent_width(self) -> int:
        """Columns of the latent tensor :meth:`generate` consumes: depth·noise_dim (+ d for ``"noise_law"``)."""
        return self.depth * self.noise_dim + (self.dim if self.latent == "noise_law" else 0)

    def generate(self, y: torch.Tensor, eta: torch.Tensor, noise: torch.Tensor,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The deterministic map g: draws ``(B, n, d)`` from y ``(B, d)``, η ``(B, 5)`` and noise ``(B, n, latent_width)``.

        ``sample`` draws the noise (:meth:`draw_noise`) and calls this; it is exposed for tests
        and custom noise.  For ``latent="noise_law"`` the last d columns are ẑ.  ``out_dtype``
        (e.g. ``torch.bfloat16``): the draws are written in that dtype by the output's last
        elementwise operation (one pass, rounded once), not cast afterwards.
        """
        self._check_generate_args(y, eta, noise)
        eta_n = self.normalize_eta(eta)
        eps = noise[..., : self.depth * self.noise_dim].split(self.noise_dim, dim=-1)
        z_hat = noise[..., self.depth * self.noise_dim :] if self.latent == "noise_law" else None
        if self.conditioning == "film":
            film = self.film_out(self.film_embed(eta_n)).unsqueeze(-2)  # (B, 1, 2·W·L)
            gammas = film[..., : self.width * self.depth].split(self.width, dim=-1)
            shifts = film[..., self.width * self.depth :].split(self.width, dim=-1)

        def condition(z: torch.Tensor, layer: int) -> torch.Tensor:
            if self.conditioning == "film":
                return (1 + gammas[layer]) * z + shifts[layer]
            return z + self.cond_maps[layer](eta_n).unsqueeze(-2)

        if self.output == "preconditioned":
            r = self.realized_rms(eta).unsqueeze(-1)  # (B, 1)
            if self.learn_data_scale:
                gain = self.PIXEL_SCALE_GAIN
                s_d = self.data_std * torch.exp(gain * self.pixel_log_std)  # (d,)
                center = self.data_center + gain * self.pixel_center
            else:
                s_d, center = self.data_std, self.data_center
            norm = torch.rsqrt(s_d * s_d + r * r)
            centered = y - center
            y_in = centered * norm
        else:
            y_in = y
        first = self.input_y(y_in).unsqueeze(-2) + self.noise_maps[0](eps[0])
        if z_hat is not None:
            first = first + self.latent_map(z_hat)
        h = F.silu(condition(first, 0))
        for layer, hidden in enumerate(self.hidden, start=1):
            h = h + F.silu(condition(hidden(h) + self.noise_maps[layer](eps[layer]), layer))
        out = self.out(h)
        if self.conditioning == "concat":
            out = out + self.cond_out(eta_n).unsqueeze(-2)
        if z_hat is not None:
            gate = self.latent_gate(eta_n).unsqueeze(-2)  # (B, 1, 1)
            unit = self.realized_rms(eta)[..., None, None] if self.output in ("residual", "direct") else 1.0
            out = out + gate * unit * z_hat
        if self.output == "preconditioned":
            # c_skip = s_d² norm², c_out = r s_d norm (norm = c_in); the noise-law latent (if any)
            # enters in units of the output's scale.
            skip = (s_d * s_d) * norm * norm
            if out_dtype is not None:
                return _written_as(out_dtype, center + (skip * centered).unsqueeze(-2), (r * s_d * norm).unsqueeze(-2), out)
            return center + (skip * centered).unsqueeze(-2) + (r * s_d * norm).unsqueeze(-2) * out
        if self.output == "direct":
            return out if out_dtype is None else out.to(out_dtype)
        if self.output == "residual":
            return y.unsqueeze(-2) + out if out_dtype is None else _written_as(out_dtype, y.unsqueeze(-2), None, out)
        if out_dtype is not None:
            return _written_as(out_dtype, y.unsqueeze(-2), self.realized_rms(eta)[..., None, None], out)
        return y.unsqueeze(-2) + self.realized_rms(eta)[..., None, None] * out

    def _check_generate_args(self, y, eta, noise) -> None:
        """Shapes and dtypes :meth:`generate` needs (Python-level checks only: no device sync, and
        ``torch.compile`` turns them into shape guards)."""
        for name, t in (("y", y), ("eta", eta), ("noise", noise)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a floating-point tensor, got {got}")
        if y.dim() < 1 or y.shape[-1] != self.dim:
            raise ValueError(f"y must have shape (B, d={self.dim}), got {tuple(y.shape)}")
        if eta.dim() < 1 or eta.shape[-1] != ETA_DIM:
            raise ValueError(f"eta must have shape (B, {ETA_DIM}), got {tuple(eta.shape)}")
        if noise.dim() != y.dim() + 1 or noise.shape[-1] != self.latent_width:
            raise ValueError(f"noise must have shape (B, n, latent_width={self.latent_width}) for y of shape "
                             f"{tuple(y.shape)}, got {tuple(noise.shape)}")

    # ------------------------------------------------------------------ public
    def sample(
        self, y: torch.Tensor, eta: torch.Tensor, n: int, *, generator: torch.Generator, antithetic: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """n posterior draws per query, in one batched forward pass.

        Args:
            y: noisy queries ``(*batch_y, d)``, floating point.
            eta: conditioning ``(*batch_eta, 5)`` = (β, log λ, log σ, u, v)
                (:meth:`etweedie.NoiseParams.eta`); ``batch_eta`` broadcasts with ``batch_y``
                (e.g. one ``(5,)`` vector for all queries, or one per query).
            n: draws per query (≥ 1).
            generator: the ``torch.Generator`` ε comes from (on y's device).
            antithetic: draw ε in antithetic pairs (ε, −ε) (:meth:`draw_noise`).  Each draw is
                still an exact draw of the model, so a Monte Carlo mean over the n draws (the
                Energy-Tweedie score) stays unbiased with a much smaller variance; but the draws
                are not independent, so the energy score's pairwise term (training) must not use it.
            dtype: the draws' dtype; None: y's.  ``torch.bfloat16`` / ``torch.float16`` write them
                in 16 bits from the network's last operation (rounded once, no float32 copy): the
                form :func:`etweedie.et_score` and :func:`etweedie.langevin_step` read directly,
                which halves the bytes between the posterior and the score (the sampler's bf16
                mode asks for it).

        Returns:
            draws ``(*batch, n, d)`` with ``batch = broadcast(batch_y, batch_eta)``, in y's
            dtype (or ``dtype``); differentiable in the parameters, y and η.

        Example::

            >>> m = EngressionPosterior(width=16, depth=1)
            >>> m.sample(torch.zeros(3, 2), torch.tensor([2.0, 0.0, -1.0, 0.0, 0.0]), 5,
            ...          generator=torch.Generator().manual_seed(0)).shape
            torch.Size([3, 5, 2])
        """
        for name, t, last in (("y", y, self.dim), ("eta", eta, ETA_DIM)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a floating-point tensor of shape (..., {last}), got {got}")
            if t.dim() < 1 or t.shape[-1] != last:
                raise ValueError(f"{name} must have shape (..., {last}), got {tuple(t.shape)}")
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (randomness is always explicit), got {type(generator).__name__}")
        draws_dtype = y.dtype if dtype is None else dtype
        if draws_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"dtype must be None or a floating-point dtype (bfloat16, float16, float32, float64), got {dtype}")
        param = self.out.weight
        if y.device != param.device or eta.device != param.device:
            raise ValueError(f"y and eta must be on the model's device {param.device}, got {y.device} and {eta.device}")
        try:
            batch = torch.broadcast_shapes(y.shape[:-1], eta.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"eta's batch shape {tuple(eta.shape[:-1])} must broadcast with y's {tuple(y.shape[:-1])}"
            ) from None
        if eta.device.type == "cpu" and eta.numel():  # values read where that is free (no device sync)
            beta = eta[..., 0]
            if not bool(torch.isfinite(eta).all() & ((beta > 0) & (beta <= 2)).all()):
                bad = eta.reshape(-1, ETA_DIM)[~(torch.isfinite(eta).all(-1) & (beta > 0) & (beta <= 2)).reshape(-1)][0]
                raise ValueError(f"eta must be finite with β = eta[..., 0] in (0, 2] (η = (β, log λ, log σ, u, v)), "
                                 f"got {[round(float(v), 6) for v in bad]}")
        rows = math.prod(batch)
        dtype = param.dtype
        y_rows = y.to(dtype).expand(*batch, self.dim).reshape(rows, self.dim)
        eta_rows = eta.to(dtype).expand(*batch, ETA_DIM).reshape(rows, ETA_DIM)
        noise = self.draw_noise(rows, n, generator, antithetic=antithetic, eta=eta_rows)
        block = self._inference_block(rows, n, param.device)
        out_dtype = None if draws_dtype == y.dtype else draws_dtype
        if block is None:
            x = self.generate(y_rows, eta_rows, noise, out_dtype)
        else:
            # The noise is drawn above for all rows, so the draws do not depend on the blocking.
            x = torch.cat([self.generate(y_rows[i : i + block], eta_rows[i : i + block], noise[i : i + block], out_dtype)
                           for i in range(0, rows, block)])
        return x.reshape(*batch, n, self.dim).to(draws_dtype)

    def draw_noise(
        self, rows: int, n: int, generator: torch.Generator, *, antithetic: bool = False, eta: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The latent of :meth:`sample` for ``rows`` queries × ``n`` draws: ``(rows, n, latent_width)``
        in the model's dtype and device (``generate(y, eta, noise)`` consumes it).

        The first depth·noise_dim columns are standard normals ε from ``generator``.  For
        ``latent="noise_law"`` the last d columns are ẑ = e / r(η), e drawn from each row's noise
        law (:meth:`etweedie.NoiseParams.noise`, after the normals, from the same generator);
        ``eta`` ``(rows, 5)`` is then required.

        With ``antithetic=True`` the draws come in mirrored pairs (h₁, −h₁, h₂, −h₂, …) of fresh
        latents h_k (ε and ẑ alike: both laws are symmetric), so every even-length prefix is
        paired too (an odd n leaves the last draw unpaired).  Every latent keeps its law, so means
        over the draws stay unbiased; when g is close to affine in the latent (a concentrated
        posterior) the mirrored pairs cancel most of the Monte Carlo error (antithetic variates,
        e.g. Owen, *Monte Carlo theory, methods and examples*, §8.2).
        """
        if not isinstance(antithetic, bool):
            raise TypeError(f"antithetic must be a bool, got {type(antithetic).__name__}")
        generator = check_generator(generator)
        rows, n = check_int(rows, "rows", 0), check_int(n, "n", 0)
        param = self.out.weight
        fresh = (n + 1) // 2 if antithetic else n
        latent = torch.randn(rows, fresh, self.depth * self.noise_dim, generator=generator, dtype=param.dtype,
                             device=param.device)
        if self.latent == "noise_law":
            if not isinstance(eta, torch.Tensor) or eta.shape != (rows, ETA_DIM):
                got = tuple(eta.shape) if isinstance(eta, torch.Tensor) else type(eta).__name__
                raise ValueError(f"eta must be a ({rows}, {ETA_DIM}) tensor for latent='noise_law', got {got}")
            eta = eta.to(device=param.device, dtype=param.dtype)
            law = NoiseParams.from_eta(eta).noise(self.dim)
            e = law.sample((fresh,), generator=generator).transpose(0, 1)  # (rows, fresh, d)
            z_hat = e / self.realized_rms(eta)[:, None, None]
            latent = torch.cat([latent, z_hat.to(param.dtype)], dim=-1)
        if not antithetic:
            return latent
        return torch.stack([latent, -latent], dim=2).reshape(rows, 2 * fresh, latent.shape[-1])[:, :n]

    #: Gain of the per-coordinate centre and log-scale parameters (``learn_data_scale``).
    PIXEL_SCALE_GAIN: float = 10.0

    def forward_flops(self) -> Dict[str, int]:
        """Multiply-add FLOPs (2 per MAC) of one :meth:`generate` call, split into the part paid
        once per query (y's and η's projections, the FiLM/gate embeddings) and the part paid per
        posterior draw (the ε maps, the hidden and output layers); elementwise work is not counted.

        A sampler drawing N draws for each of Q queries costs ``Q·per_query + Q·N·per_draw``.

        Example::

            >>> EngressionPosterior(784, width=2560, depth=3, noise_dim=16, conditioning="concat").forward_flops()["per_draw"]
            30474240
        """
        d, w, L, k = self.dim, self.width, self.depth, self.noise_dim
        per_draw = L * k * w + (L - 1) * w * w + w * d
        per_query = d * w
        if self.conditioning == "concat":
            per_query += L * ETA_DIM * w + ETA_DIM * d
        else:
            c = self.config["cond_width"]
            per_query += ETA_DIM * c + c * c + c * 2 * w * L
        if self.latent == "noise_law":
            per_draw += d * w
            c = self.config["cond_width"]
            per_query += ETA_DIM * c + c
        return {"per_query": 2 * per_query, "per_draw": 2 * per_draw}

    #: Sample rows (queries × draws) per block of a CPU inference call: the W-wide activations of
    #: a block stay in cache between layers.  At W = 256, 1,024–4,096 rows ran 2.7–2.9× faster than one
    #: 131,072-row block (experiments/eight_gaussians/RESULTS.md, "Sampler throughput"); None disables blocking.
    CPU_INFERENCE_ROWS: Optional[int] = 2048

    def _inference_block(self, rows: int, n: int, device: torch.device) -> Optional[int]:
        """Queries per block for a no-grad CPU call, or None (one block: GPU, autograd, small calls)."""
        target = self.CPU_INFERENCE_ROWS
        if target is None or device.type != "cpu" or torch.is_grad_enabled() or rows * n <= 2 * target:
            return None
        return max(1, target // n)

    def forward(
        self, y: torch.Tensor, eta: torch.Tensor, n: int, *, generator: torch.Generator, antithetic: bool = False
    ) -> torch.Tensor:
        """Same as :meth:`sample` (so hooks and ``torch.compile`` see one module call)."""
        return self.sample(y, eta, n, generator=generator, antithetic=antithetic)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"dim={c['dim']}, width={c['width']}, depth={c['depth']}, noise_dim={c['noise_dim']}, "
            f"conditioning={c['conditioning']!r}, output={c['output']!r}, latent={c.get('latent', 'gaussian')!r}"
        )
