"""Auxiliary score estimators trained on noisy observations only (paper §5.2, Eq. param_optim_general).

The noise-parameter criterion needs a score ŝ_m of the noisy marginal m that does *not* know the
noise parameters.  This module learns one from noisy observations y ~ m alone:

* exact Hyvärinen score matching (Hyvärinen 2005) for small d,

      J_H(s) = E_m[ ½‖s(y)‖² + tr ∇_y s(y) ],

  with the Jacobian trace from ``torch.func`` (forward-mode columns of the Jacobian, vmapped over
  the d basis directions — one batched evaluation, no Python loop over dimensions);
* sliced score matching with variance reduction, SSM-VR (Song et al. 2019), for large d,

      J_SSM-VR(s) = E_m E_v[ ½‖s(y)‖² + vᵀ ∇_y s(y) v ],   v ~ N(0, I) (or Rademacher),

  whose expectation over v equals J_H (E[vᵀAv] = tr A); the analytic ½‖s‖² replaces the
  sliced ½(vᵀs)², which is the variance reduction;
* a score network (:class:`ScoreNet`, an MLP) and its conditional form
  (:class:`ConditionalScoreNet`) that takes a known noise level σ, so that one model serves the
  three σ levels of the estimation experiment;
* :func:`train_score_net`, a small minibatch Adam trainer (tqdm, generator-seeded), and
  :func:`fit_score`, which builds, trains and wraps a (conditional) score network.

Both losses equal E‖s − ∇log m‖² up to a constant independent of s (integration by parts),
so their minimizer over a rich enough class is the noisy score.

Example::

    >>> import torch
    >>> from etweedie.training.scorematching import ScoreNet, hyvarinen_loss
    >>> net = ScoreNet(2, hidden=16, depth=2)
    >>> hyvarinen_loss(net, torch.zeros(4, 2)).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from .._checks import check_bool, check_generator, check_int
from .optim import EMA, optimize, warmup_cosine

__all__ = [
    "ConditionalScoreNet",
    "LearnedScore",
    "ResidualMLP",
    "ScoreNet",
    "ScoreTrainResult",
    "fit_score",
    "hyvarinen_loss",
    "jacobian_trace",
    "sliced_score_matching_vr_loss",
    "train_score_net",
]

# Dimension up to which "auto" picks exact score matching: the exact trace costs d Jacobian
# columns per point, SSM-VR a fixed number of projections, so they cross over near d ≈ 16.
EXACT_MAX_DIM = 16
METHODS = ("auto", "exact", "ssm_vr")
ARCHS = ("mlp", "resmlp")
# How ConditionalScoreNet turns the output into a score (see its docstring).
PARAMETRIZATIONS = ("direct", "residual", "energy")


# ---------------------------------------------------------------------------- validation
def _check_points(y, name: str = "y", *, nonempty: bool = False, finite: bool = False) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (n, d), got {type(y).__name__}")
    if y.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64, got {y.dtype}")
    if y.dim() != 2 or y.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (n, d) with d >= 1, got {tuple(y.shape)}")
    if nonempty and y.shape[0] == 0:
        # a mean over no rows is NaN, not a loss
        raise ValueError(f"{name} must have at least one row, got shape {tuple(y.shape)}")
    if finite and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name} must be finite (it holds NaN or inf): training on it would make every weight NaN")
    return y


def _as_cond(cond, y: torch.Tensor) -> torch.Tensor:
    """Per-row conditioning as a tensor in y's dtype and device (a named TypeError otherwise)."""
    try:
        return torch.as_tensor(cond, dtype=y.dtype, device=y.device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"cond must be a real tensor (or a number or sequence of numbers), got {type(cond).__name__} "
                        f"{cond!r:.80}") from None


def _check_input(y, dim: int, what: str, module: Optional[nn.Module] = None) -> None:
    """y of a score network: a floating tensor ``(..., dim)`` (a shape error names the network),
    in the dtype and on the device of ``module``'s parameters when one is given."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor of shape (..., {dim}), got {type(y).__name__}")
    if not y.is_floating_point():
        raise TypeError(f"y must be a floating-point tensor, got {y.dtype}")
    if y.dim() < 1 or y.shape[-1] != dim:
        raise ValueError(f"y must have shape (..., {dim}) for this {what} (dim={dim}), got {tuple(y.shape)}")
    if module is not None:
        _check_like_parameters(y, module, "y", what)


def _first_parameter(module) -> Optional[torch.Tensor]:
    parameters = getattr(module, "parameters", None)
    if not callable(parameters):
        return None
    return next((p for p in parameters() if p.is_floating_point()), None)


def _check_like_parameters(y: torch.Tensor, module, name: str, what: str) -> None:
    """y in the dtype and on the device of the module's parameters (torch's own error is a GEMM's)."""
    p = _first_parameter(module)
    if p is None:
        return
    if y.dtype != p.dtype:
        raise TypeError(f"{name} must have the {what}'s parameter dtype {p.dtype}, got {y.dtype} "
                        f"(convert one of them, e.g. model.to({y.dtype}) or {name}.to({p.dtype}))")
    if y.device != p.device:
        raise ValueError(f"{name} must be on the {what}'s device {p.device}, got {y.device}")


def _check_cond(cond, y: torch.Tensor, n_cond: int) -> torch.Tensor:
    """cond of a conditional ScoreNet: a real tensor ``(..., n_cond)`` with y's batch shape."""
    if not isinstance(cond, torch.Tensor):
        raise TypeError(f"cond must be a tensor of shape (..., {n_cond}), got {type(cond).__name__}")
    if cond.is_complex() or cond.dtype == torch.bool:
        raise TypeError(f"cond must be a real tensor, got {cond.dtype}")
    if cond.shape[:-1] != y.shape[:-1] or cond.dim() < 1 or cond.shape[-1] != n_cond:
        raise ValueError(f"cond must have shape {tuple(y.shape[:-1]) + (n_cond,)} (y's batch shape, n_cond={n_cond}), "
                         f"got {tuple(cond.shape)}")
    return cond.to(y.dtype)


# ---------------------------------------------------------------------------- networks
class ResidualMLP(nn.Module):
    """h₀ = W_in x;  h_{k+1} = h_k + W₂ₖ SiLU(W₁ₖ SiLU(h_k));  out = W_out SiLU(h_K).

    A pre-activation residual MLP with ``depth`` blocks of width ``hidden`` (smooth, row-wise).
    The second linear map of every block starts at zero, so at initialization the body is the
    identity and the blocks are switched on by training.
    """

    def __init__(self, n_in: int, hidden: int, depth: int, n_out: int):
        super().__init__()
        self.inp = nn.Linear(n_in, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden)) for _ in range(depth)
        )
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, n_out))
        self.zero_block_outputs()

    def zero_block_outputs(self) -> None:
        with torch.no_grad():
            for block in self.blocks:
                block[-1].weight.zero_()
                block[-1].bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class ScoreNet(nn.Module):
    """MLP score model s(y[, c]) : R^d (× R^{n_cond}) → R^d.

    Args:
        dim: data dimension d.
        hidden: width of the hidden layers.
        depth: number of hidden layers (≥ 1; residual blocks for ``arch="resmlp"``).
        n_cond: width of the conditioning input c (0: unconditional).
        arch: ``"mlp"`` (plain SiLU MLP) or ``"resmlp"`` (:class:`ResidualMLP`).
        n_in: input width of the network body (default d + n_cond; subclasses that
            build their own input features pass it).
        n_out: output width of the body (default d; 1 for an energy network).

    SiLU activations (smooth, so ∇_y s exists everywhere, which score matching needs).

    Example::

        >>> ScoreNet(2, hidden=8, depth=1)(torch.zeros(3, 2)).shape
        torch.Size([3, 2])
    """

    def __init__(
        self, dim: int, hidden: int = 128, depth: int = 3, n_cond: int = 0, arch: str = "mlp",
        n_in: Optional[int] = None, n_out: Optional[int] = None,
    ):
        super().__init__()
        self.dim = check_int(dim, "dim", 1)
        self.n_cond = check_int(n_cond, "n_cond", 0)
        hidden = check_int(hidden, "hidden", 1)
        depth = check_int(depth, "depth", 1)
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        self.arch = arch
        n_in = dim + n_cond if n_in is None else check_int(n_in, "n_in", 1)
        n_out = dim if n_out is None else check_int(n_out, "n_out", 1)
        if arch == "resmlp":
            self.net: nn.Module = ResidualMLP(n_in, hidden, depth, n_out)
        else:
            layers: List[nn.Module] = [nn.Linear(n_in, hidden), nn.SiLU()]
            for _ in range(depth - 1):
                layers += [nn.Linear(hidden, hidden), nn.SiLU()]
            layers.append(nn.Linear(hidden, n_out))
            self.net = nn.Sequential(*layers)

    def forward(self, y: torch.Tensor, cond: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Score at y ``(..., d)``; ``cond`` ``(..., n_cond)`` when conditional. Returns ``(..., d)``."""
        _check_input(y, self.dim, type(self).__name__, self)
        if self.n_cond:
            if cond is None:
                raise ValueError(f"this ScoreNet is conditional (n_cond={self.n_cond}); pass cond of shape (..., {self.n_cond})")
            y = torch.cat([y, _check_cond(cond, y, self.n_cond)], dim=-1)
        elif cond is not None:
            raise ValueError("cond was given but this ScoreNet is unconditional (n_cond = 0)")
        return self.net(y)


class ConditionalScoreNet(ScoreNet):
    """Score network conditioned on a known noise level σ: s(y; σ) (one model for all levels).

    The level enters as c = log σ.  The output is divided by ``σ² + floor²`` (``floor`` is a
    data-scale constant): the noisy score scales like 1/(τ² + r²) with r ∝ σ, so this
    preconditioning keeps the network's raw output O(1) across levels.

    Options (defaults reproduce the original network):

    * ``parametrization="direct"``: s = f(y, c) / (σ² + floor²);
      ``"residual"``: s = (f(y, c) − y) / (σ² + floor²) — f plays the role of a denoised
      point (Tweedie form: for Gaussian noise s = (E[X|y] − y)/σ²), so the network's output is
      the slowly varying part of the field instead of a linear ramp per mode.
      ``"energy"``: s = ∇_y E(y, c) / (σ² + floor²) with a scalar network E — a conservative
      field by construction, as the true score ∇ log m is (the Hyvärinen trace is then the
      Laplacian of E, by forward-over-reverse ``torch.func``).
    * ``n_fourier = K > 0``: appends the positional features sin(2ᵏπ y_j / P), cos(2ᵏπ y_j / P),
      k = 0..K−1, j = 1..d (period P = ``fourier_period``; deterministic, no random frequencies).
    * ``arch``: ``"mlp"`` or ``"resmlp"`` (see :class:`ScoreNet`).

    Example::

        >>> net = ConditionalScoreNet(2, hidden=8, depth=1)
        >>> net(torch.zeros(3, 2), 0.5).shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        dim: int,
        hidden: int = 128,
        depth: int = 3,
        floor: float = 0.2,
        *,
        arch: str = "mlp",
        parametrization: str = "direct",
        n_fourier: int = 0,
        fourier_period: float = 8.0,
    ):
        n_fourier = check_int(n_fourier, "n_fourier", 0)
        if parametrization not in PARAMETRIZATIONS:
            raise ValueError(f"parametrization must be one of {PARAMETRIZATIONS}, got {parametrization!r}")
        super().__init__(
            dim, hidden, depth, n_cond=1, arch=arch, n_in=check_int(dim, "dim", 1) * (1 + 2 * n_fourier) + 1,
            n_out=1 if parametrization == "energy" else dim,
        )
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < math.inf:
            raise ValueError(f"floor must be a float > 0 and finite, got {floor!r}")
        if isinstance(fourier_period, bool) or not isinstance(fourier_period, (int, float)) or not 0 < fourier_period < math.inf:
            raise ValueError(f"fourier_period must be a float > 0 and finite, got {fourier_period!r}")
        self.floor = float(floor)
        self.parametrization = parametrization
        self.n_fourier = n_fourier
        self.fourier_period = float(fourier_period)
        self.register_buffer(
            "frequencies", (2.0 ** torch.arange(n_fourier, dtype=torch.float32)) * (2 * math.pi / self.fourier_period), persistent=False
        )

    def features(self, sigma, like: torch.Tensor) -> torch.Tensor:
        """σ (float or tensor broadcasting to ``like.shape[:-1]``) → σ expanded to that shape."""
        bad = isinstance(sigma, (bool, str, bytes)) or (
            isinstance(sigma, torch.Tensor) and (sigma.is_complex() or sigma.dtype == torch.bool))
        try:
            value = None if bad else torch.as_tensor(sigma, dtype=like.dtype, device=like.device)
        except (TypeError, ValueError, RuntimeError):
            value = None
        if value is None:
            raise TypeError(f"sigma must be a real number or a real tensor broadcasting to y's batch shape "
                            f"{tuple(like.shape[:-1])}, got {type(sigma).__name__} {sigma!r:.80}")
        sigma = value
        if sigma.numel() and not bool(((sigma > 0) & torch.isfinite(sigma)).all()):
            bad = sigma[~((sigma > 0) & torch.isfinite(sigma))].flatten()[0]
            raise ValueError(f"sigma must be > 0 and finite, got {float(bad):.4g}")
        try:
            sigma = sigma.expand(like.shape[:-1])
        except RuntimeError:
            raise ValueError(f"sigma must broadcast to y's batch shape {tuple(like.shape[:-1])}, got {tuple(sigma.shape)}") from None
        return sigma

    def inputs(self, y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Network input ``(..., d(1 + 2K) + 1)``: y, its K-octave sin/cos features, log σ."""
        parts = [y]
        if self.n_fourier:
            phase = (y[..., :, None] * self.frequencies.to(y.dtype)).flatten(-2)  # (..., d·K)
            parts += [torch.sin(phase), torch.cos(phase)]
        parts.append(torch.log(sigma)[..., None])
        return torch.cat(parts, dim=-1)

    def forward(self, y: torch.Tensor, sigma) -> torch.Tensor:  # type: ignore[override]
        """Score at y ``(..., d)`` for known level(s) σ (float or ``(...)`` tensor)."""
        _check_input(y, self.dim, type(self).__name__, self)
        sigma = self.features(sigma, y)
        if self.parametrization == "energy":
            # rows are independent, so ∇_y of the summed energy is the per-row gradient
            raw = torch.func.grad(lambda q: self.net(self.inputs(q, sigma)).sum())(y)
            return raw / (sigma * sigma + self.floor**2)[..., None]
        raw = self.net(self.inputs(y, sigma))
        if self.parametrization == "residual":
            raw = raw - y
        return raw / (sigma * sigma + self.floor**2)[..., None]


# ---------------------------------------------------------------------------- losses
def _as_function(model, cond) -> Callable[[torch.Tensor], torch.Tensor]:
    """y ↦ s(y) with the conditioning fixed (rows of cond pair with rows of y)."""
    if cond is None:
        return lambda q: model(q)
    return lambda q: model(q, cond)


def jacobian_trace(model, y: torch.Tensor, cond=None):
    """(s(y), tr ∇_y s(y)) for every row of y ``(n, d)``, through ``torch.func``.

    The Jacobian columns J e_j come from one forward-mode ``jvp`` per basis vector e_j,
    vectorized over j with ``vmap`` (a single batched evaluation of d·n rows); the diagonal
    entries e_jᵀ J e_j sum to the trace.  Differentiable with respect to the model's
    parameters.  Rows are treated as independent (the model must act row-wise).

    Args:
        model: callable ``model(y)`` or ``model(y, cond)`` → ``(n, d)``.
        y: points ``(n, d)``.
        cond: per-row conditioning passed through to the model (tensor or None).

    Returns:
        ``(s (n, d), trace (n,))``.
    """
    if not callable(model):
        raise TypeError(f"model must be a callable model(y[, cond]) -> (n, d), got {type(model).__name__}")
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        raise TypeError(f"y must be a floating-point tensor (n, d), got {getattr(y, 'dtype', type(y).__name__)}")
    f = _as_function(model, cond)
    d = y.shape[-1]
    basis = torch.eye(d, dtype=y.dtype, device=y.device)

    def column(e: torch.Tensor):
        s, jv = torch.func.jvp(f, (y,), (e.expand_as(y),))
        return s, jv @ e  # (n, d), (n,) = e_jᵀ J e_j per row

    s, diag = torch.func.vmap(column)(basis)  # (d, n, d), (d, n)
    return s[0], diag.sum(0)


def hyvarinen_loss(model, y: torch.Tensor, cond=None) -> torch.Tensor:
    """Exact Hyvärinen score-matching loss mean_i [ ½‖s(y_i)‖² + tr ∇_y s(y_i) ] (Hyvärinen 2005).

    Args:
        model: row-wise callable ``model(y[, cond])`` → ``(n, d)`` (e.g. :class:`ScoreNet`).
        y: noisy observations ``(n, d)``.
        cond: per-row conditioning (``(n, n_cond)`` for a ScoreNet, σ ``(n,)`` for a
            :class:`ConditionalScoreNet`), or None.

    Returns:
        scalar loss; its minimizer is ∇ log m, and E‖s − ∇log m‖² = 2·loss + const.
    """
    y = _check_points(y, nonempty=True)
    s, trace = jacobian_trace(model, y, cond)
    return (0.5 * s.pow(2).sum(-1) + trace).mean()


def sliced_score_matching_vr_loss(
    model,
    y: torch.Tensor,
    cond=None,
    *,
    n_projections: int = 1,
    generator: torch.Generator,
    distribution: str = "gaussian",
) -> torch.Tensor:
    """Sliced score matching with variance reduction (SSM-VR, Song et al. 2019).

    mean over rows and M projections v of ½‖s(y)‖² + vᵀ ∇_y s(y) v, v ~ N(0, I) (or
    Rademacher).  vᵀJv comes from one forward-mode ``torch.func.jvp`` of the batch (cost ≈ a
    few forward passes, independent of d), so this is the large-d estimator; its expectation
    over v is :func:`hyvarinen_loss`.

    Args:
        model, y, cond: as in :func:`hyvarinen_loss`.
        n_projections: M ≥ 1 random directions per point.
        generator: source of the projections.
        distribution: ``"gaussian"`` or ``"rademacher"``.

    Returns:
        scalar loss.
    """
    y = _check_points(y, nonempty=True)
    m = check_int(n_projections, "n_projections", 1)
    generator = check_generator(generator)
    if distribution not in ("gaussian", "rademacher"):
        raise ValueError(f"distribution must be 'gaussian' or 'rademacher', got {distribution!r}")
    n, d = y.shape
    v = torch.randn(m, n, d, generator=generator, dtype=y.dtype, device=generator.device).to(y.device)
    if distribution == "rademacher":
        v = torch.sign(v)
    y_rep = y.expand(m, n, d).reshape(m * n, d)
    cond_rep = None
    if cond is not None:
        cond_t = _as_cond(cond, y)
        if cond_t.dim() == 0:
            cond_rep = cond_t
        else:
            if cond_t.shape[0] != n:
                raise ValueError(f"cond must be one value for all rows or have leading dimension n = {n} (y's rows), "
                                 f"got shape {tuple(cond_t.shape)}")
            cond_rep = cond_t.expand(m, *cond_t.shape).reshape(m * n, *cond_t.shape[1:])
    f = _as_function(model, cond_rep)
    v = v.reshape(m * n, d)
    s, jv = torch.func.jvp(f, (y_rep,), (v,))
    return (0.5 * s.pow(2).sum(-1) + (v * jv).sum(-1)).mean()


# ---------------------------------------------------------------------------- training
@dataclass
class ScoreTrainResult:
    """Loss per step and wall time of :func:`train_score_net`.

    With a validation split, ``val_steps``/``val_losses`` hold the held-out score-matching loss
    (of the weights actually returned: the EMA weights when ``ema > 0``) every ``eval_every``
    steps, and ``best_step`` the step whose weights were kept (the last step without one).
    """

    losses: List[float] = field(default_factory=list)
    method: str = "exact"
    seconds: float = 0.0
    ema: float = 0.0
    val_steps: List[int] = field(default_factory=list)
    val_losses: List[float] = field(default_factory=list)
    best_step: Optional[int] = None


def _resolve_method(method: str, d: int) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "exact" if d <= EXACT_MAX_DIM else "ssm_vr"
    return method


def _check_fraction(value, name: str, low: float, high: float, *, closed_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    ok = (low <= value if closed_low else low < value) and value < high
    if not ok:
        raise ValueError(f"{name} must be in {'[' if closed_low else '('}{low}, {high}), got {value!r}")
    return float(value)


def _loss(model, yb, cb, method, n_projections, generator):
    if method == "exact":
        return hyvarinen_loss(model, yb, cb)
    return sliced_score_matching_vr_loss(model, yb, cb, n_projections=n_projections, generator=generator)


def _split_off(y: torch.Tensor, cond, fraction: float, generator: torch.Generator):
    """((y, cond) kept for training, (y, cond) held out): a random ``fraction`` of the rows."""
    n_val = int(round(fraction * y.shape[0]))
    if n_val < 1 or n_val >= y.shape[0]:
        raise ValueError(f"val_fraction={fraction} leaves no validation or no training rows for n={y.shape[0]}")
    perm = torch.randperm(y.shape[0], generator=generator, device=generator.device).to(y.device)
    held, kept = perm[:n_val], perm[n_val:]
    if cond is None:
        return (y[kept], None), (y[held], None)
    return (y[kept], cond[kept]), (y[held], cond[held])


@torch.no_grad()
def _copy(params: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    for p, q in zip(params, values):
        p.copy_(q)


@torch.no_grad()
def _swap(params: List[torch.Tensor], averaged: Optional[List[torch.Tensor]]) -> None:
    """Exchange the raw and the averaged weights (an involution; nothing without averaging)."""
    if averaged is None:
        return
    for p, q in zip(params, averaged):
        tmp = p.detach().clone()
        p.copy_(q)
        q.copy_(tmp)


class _Selection:
    """Held-out model selection: the score-matching loss of the weights that would be returned
    (the averaged ones when averaging) on held-out noisy rows, and the best weights so far."""

    def __init__(self, model, params, averaged, y_val, c_val, method, n_projections, val_batch, generator, result):
        self.model, self.params, self.averaged = model, params, averaged
        self.y_val, self.c_val, self.method, self.n_projections, self.val_batch = y_val, c_val, method, n_projections, val_batch
        self.result, self.best_loss, self.best_state = result, math.inf, None
        # fixed projections: every evaluation sees the same SSM-VR directions
        self.seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        self.device = generator.device

    def loss(self) -> float:
        total, y_val, c_val, step = 0.0, self.y_val, self.c_val, self.val_batch
        for s in range(0, y_val.shape[0], step):
            yb, cb = y_val[s : s + step], None if c_val is None else c_val[s : s + step]
            g = None if self.method == "exact" else torch.Generator(device=self.device).manual_seed(self.seed)
            with torch.no_grad():
                total += float(_loss(self.model, yb, cb, self.method, self.n_projections, g)) * yb.shape[0]
        return total / y_val.shape[0]

    def evaluate(self, step: int) -> None:
        _swap(self.params, self.averaged)
        self.model.eval()
        loss = self.loss()
        self.result.val_steps.append(step)
        self.result.val_losses.append(loss)
        if loss < self.best_loss:
            self.best_loss, self.result.best_step = loss, step
            self.best_state = [p.detach().clone() for p in self.params]
        _swap(self.params, self.averaged)
        self.model.train()


@dataclass(frozen=True)
class _Training:
    """The checked settings of one :func:`train_score_net` call."""

    method: str  # resolved: "exact" or "ssm_vr"
    steps: int
    batch_size: int
    lr: float
    n_projections: int
    progress: bool
    ema: float
    lr_final_fraction: float
    warmup: int
    val_fraction: float
    eval_every: int
    val_batch: int
    weight_decay: float


def _check_training(model, y, cond, generator, *, method, steps, batch_size, lr, n_projections, progress, ema,
                    lr_final_fraction, warmup, val_fraction, eval_every, val_batch, weight_decay):
    """(y, cond, generator, :class:`_Training`): every argument of :func:`train_score_net`
    checked (the first bad one raises) before anything draws from the generator."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (its parameters are trained), got {type(model).__name__}")
    y = _check_points(y, nonempty=True, finite=True)
    generator = check_generator(generator)
    steps = check_int(steps, "steps", 1)
    batch_size = check_int(batch_size, "batch_size", 1)
    n_projections = check_int(n_projections, "n_projections", 1)
    check_bool(progress, "progress")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model must have trainable parameters, {type(model).__name__} has none")
    _check_like_parameters(y, model, "y", "model")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    ema = _check_fraction(ema, "ema", 0.0, 1.0)
    lr_final_fraction = _check_fraction(lr_final_fraction, "lr_final_fraction", 0.0, 1.0 + 1e-12, closed_low=False)
    warmup = check_int(warmup, "warmup", 0)
    val_fraction = _check_fraction(val_fraction, "val_fraction", 0.0, 0.5)
    eval_every = check_int(eval_every, "eval_every", 1)
    val_batch = check_int(val_batch, "val_batch", 1)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not 0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite float >= 0, got {weight_decay!r}")
    if cond is not None:
        cond = _as_cond(cond, y)
        if cond.dim() == 0 or cond.shape[0] != y.shape[0]:
            raise ValueError(f"cond must have leading dimension n={y.shape[0]} to match y, got shape {tuple(cond.shape)}")
        if not bool(torch.isfinite(cond).all()):
            raise ValueError("cond must be finite (it holds NaN or inf)")
    method = _resolve_method(method, y.shape[-1])
    run = _Training(method, steps, batch_size, lr, n_projections, progress, ema, lr_final_fraction, warmup,
                    val_fraction, eval_every, val_batch, weight_decay)
    return y, cond, generator, run


def _optimizer(params: List[torch.Tensor], run: _Training) -> torch.optim.Optimizer:
    """Adam, or AdamW decaying the weight matrices only (not the biases) when ``run.weight_decay > 0``."""
    if run.weight_decay > 0:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": float(run.weight_decay)},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=run.lr)
    return torch.optim.Adam(params, lr=run.lr)


def _descend(model, y, cond, opt, params, ema_params, selection: Optional[_Selection], result: ScoreTrainResult,
             run: _Training, generator: torch.Generator) -> None:
    """``run.steps`` optimizer steps on minibatches of (y, cond) under the warmup-cosine schedule,
    averaging into ``ema_params``; the losses go to ``result``, every ``eval_every`` steps and the
    last one to the held-out ``selection``."""
    n = y.shape[0]
    batch_size = min(run.batch_size, n)
    schedule = dict(total=run.steps, lr=run.lr, lr_min=run.lr * run.lr_final_fraction, warmup=run.warmup)

    def loss_and_grad(_: int) -> torch.Tensor:
        idx = torch.randint(n, (batch_size,), generator=generator, device=generator.device).to(y.device)
        loss = _loss(model, y[idx], None if cond is None else cond[idx], run.method, run.n_projections, generator)
        loss.backward()
        return loss.detach()

    def after_step(done: int, loss: torch.Tensor) -> bool:
        result.losses.append(loss.item())
        if done % 50 == 0:
            bar.set_postfix(loss=f"{sum(result.losses[-50:]) / 50:.4g}")
        if selection is not None and (done % run.eval_every == 0 or done == run.steps):
            selection.evaluate(done)
        return False

    with tqdm(total=run.steps, desc=f"score matching ({run.method})", disable=not run.progress, leave=False) as bar:
        optimize(opt, loss_and_grad, start=0, stop=run.steps, lr_at=lambda step: warmup_cosine(step, **schedule),
                 ema=None if ema_params is None else EMA(ema_params, params, run.ema, warmup=True), bar=bar,
                 after_step=after_step)


def _hold_returned_weights(params, ema_params, selection: Optional[_Selection], result: ScoreTrainResult,
                           steps: int) -> None:
    """Leave the model holding the weights it is evaluated with: the held-out best when there is
    one, else the averaged weights (the raw ones without averaging) of the last step."""
    if selection is not None and selection.best_state is not None:
        _copy(params, selection.best_state)
    else:
        _swap(params, ema_params)
        result.best_step = steps


def train_score_net(
    model: nn.Module,
    y: torch.Tensor,
    cond=None,
    *,
    method: str = "auto",
    steps: int = 2000,
    batch_size: int = 512,
    lr: float = 2e-3,
    n_projections: int = 1,
    generator: torch.Generator,
    progress: bool = True,
    ema: float = 0.0,
    lr_final_fraction: float = 0.05,
    warmup: int = 0,
    val_fraction: float = 0.0,
    eval_every: int = 250,
    val_batch: int = 4096,
    weight_decay: float = 0.0,
) -> ScoreTrainResult:
    """Train ``model`` by score matching on noisy observations ``y`` ``(n, d)``.

    Minibatches of ``batch_size`` rows are drawn with ``generator``; Adam with a linear warmup
    over ``warmup`` steps and a cosine learning-rate decay to ``lr · lr_final_fraction``.
    ``cond`` (per-row, e.g. the known σ of each observation for a :class:`ConditionalScoreNet`)
    is sliced with the same rows.

    Polyak/EMA averaging (``ema = α > 0``): θ̄ ← α_t θ̄ + (1 − α_t) θ after optimizer step
    t = 1, 2, …, with the warm-up decay α_t = min(α, t/(t + 9)) (so the random initial weights
    are forgotten at once instead of keeping weight α^steps); the model is left holding θ̄ (the
    weights evaluated and returned).

    Held-out model selection (``val_fraction = f > 0``): a random fraction f of the rows of y
    (noisy observations only — no clean data, no noise parameters, no oracle score) is kept out
    of training; every ``eval_every`` steps and at the end the score-matching loss of the
    returned weights on those rows is computed (exact Hyvärinen loss for ``method="exact"``,
    otherwise SSM-VR with fixed projections), and the weights with the lowest held-out loss are
    kept.  Since E‖s − ∇log m‖² = 2·J_H(s) + const, this selects the best-scoring checkpoint
    without ever seeing the true score.

    Args:
        model: a row-wise score model (trained in place).
        y: noisy observations ``(n, d)`` only — never the noise parameters.
        cond: per-row conditioning (tensor with leading dim n) or None.
        method: ``"exact"`` (Hyvärinen, small d), ``"ssm_vr"``, or ``"auto"`` (exact for d ≤ 16).
        steps, batch_size, lr: optimizer settings.
        n_projections: SSM-VR projections per point.
        generator: the ``torch.Generator`` of minibatches, projections and the validation split.
        progress: show a tqdm bar.
        ema: EMA decay α in [0, 1) (0: no averaging; the raw weights are returned).
        lr_final_fraction: final learning rate of the cosine schedule as a fraction of ``lr``.
        warmup: linear-warmup steps (0: none).
        val_fraction: held-out fraction in [0, 0.5) for model selection (0: none).
        eval_every: steps between held-out evaluations.
        val_batch: held-out rows evaluated per chunk.
        weight_decay: decoupled (AdamW) weight decay of the weight matrices (0: plain Adam);
            biases are not decayed.

    Returns:
        :class:`ScoreTrainResult` with the loss per step (and the held-out trace).
    """
    import time

    y, cond, generator, run = _check_training(
        model, y, cond, generator, method=method, steps=steps, batch_size=batch_size, lr=lr,
        n_projections=n_projections, progress=progress, ema=ema, lr_final_fraction=lr_final_fraction, warmup=warmup,
        val_fraction=val_fraction, eval_every=eval_every, val_batch=val_batch, weight_decay=weight_decay,
    )
    y_val = c_val = None
    if run.val_fraction > 0:
        (y, cond), (y_val, c_val) = _split_off(y, cond, run.val_fraction, generator)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, run)
    ema_params = [p.detach().clone() for p in params] if run.ema > 0 else None
    result = ScoreTrainResult(method=run.method, ema=run.ema)
    selection = None if y_val is None else _Selection(model, params, ema_params, y_val, c_val, run.method,
                                                      run.n_projections, run.val_batch, generator, result)
    start = time.perf_counter()
    model.train()
    _descend(model, y, cond, opt, params, ema_params, selection, result, run, generator)
    _hold_returned_weights(params, ema_params, selection, result, run.steps)
    model.eval()
    result.seconds = time.perf_counter() - start
    return result


class LearnedScore:
    """A trained score network as a score function ``score(y, sigma=None) -> (..., d)``.

    For a conditional network ``sigma`` is the known level (float or tensor broadcasting to
    y's batch shape); evaluation runs without gradients, in the network's dtype, and returns
    y's dtype.
    """

    def __init__(self, net: ScoreNet, train_result: Optional[ScoreTrainResult] = None):
        self.net = net
        self.train_result = train_result

    @property
    def conditional(self) -> bool:
        return isinstance(self.net, ConditionalScoreNet)

    def __call__(self, y: torch.Tensor, sigma=None) -> torch.Tensor:
        _check_input(y, self.net.dim, type(self.net).__name__)
        dtype = next(self.net.parameters()).dtype
        with torch.no_grad():
            if self.conditional:
                if sigma is None:
                    raise ValueError("this score is conditional: pass the known noise level sigma")
                out = self.net(y.to(dtype), sigma)
            else:
                if sigma is not None:
                    raise ValueError("this score is unconditional (trained at one noise level): call it without sigma")
                out = self.net(y.to(dtype))
        return out.to(y.dtype)


def _check_observations(observations, sigmas, dtype, parametrization, n_fourier):
    """(y, cond) of :func:`fit_score`: the observations in ``dtype``, pooled over the groups with
    each row's known level in ``cond`` (None for a single tensor), checked."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    if not isinstance(observations, (torch.Tensor, list, tuple)):
        raise TypeError(f"observations must be a tensor (n, d) or a list of (n_l, d) tensors (one per level), "
                        f"got {type(observations).__name__}")
    if isinstance(observations, torch.Tensor):
        return _single_level(observations, sigmas, dtype, parametrization, n_fourier), None
    return _known_levels(list(observations), sigmas, dtype)


def _single_level(observations: torch.Tensor, sigmas, dtype, parametrization, n_fourier) -> torch.Tensor:
    """The rows of one tensor of observations (an unconditional network: no levels, no conditional options)."""
    if sigmas is not None:
        raise ValueError("sigmas is only used with a sequence of per-level observation groups")
    y = _check_points(observations, "observations", finite=True).to(dtype)
    if parametrization != "direct" or n_fourier != 0:
        raise ValueError(
            f"parametrization and n_fourier apply to the conditional network (per-level groups); got "
            f"parametrization={parametrization!r}, n_fourier={n_fourier!r} with a single tensor"
        )
    if y.shape[0] < 1:
        raise ValueError(f"observations must have at least one row, got shape {tuple(y.shape)}")
    return y


def _known_levels(groups: List, sigmas, dtype):
    """(y, cond) of per-level groups: the rows of every group, and the known level of each row."""
    if not groups:
        raise ValueError("observations must hold at least one group, got an empty sequence")
    if sigmas is not None and not isinstance(sigmas, (list, tuple, torch.Tensor)):
        raise TypeError(f"sigmas must be a list of known noise levels (one per group), got {type(sigmas).__name__}")
    if sigmas is None or len(sigmas) != len(groups):
        raise ValueError(
            f"sigmas must give one known level per observation group ({len(groups)} groups), got {sigmas!r}"
        )
    for i, level in enumerate(sigmas):
        try:
            value = float(level) if not isinstance(level, (bool, str, bytes)) else math.nan
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
        if not 0 < value < math.inf:
            raise ValueError(f"sigmas[{i}] must be a finite float > 0 (a known noise level), got {level!r}")
    for i, g in enumerate(groups):
        _check_points(g, f"observations[{i}]", finite=True)
        if g.shape[0] == 0:
            raise ValueError(f"observations[{i}] (sigma={sigmas[i]}) is empty; every level needs observations")
        if g.shape[-1] != groups[0].shape[-1]:
            raise ValueError(f"observations[{i}] has d={g.shape[-1]}, observations[0] has d={groups[0].shape[-1]}")
    y = torch.cat(groups).to(dtype)
    cond = torch.cat([torch.full((g.shape[0],), float(s), dtype=dtype) for g, s in zip(groups, sigmas)])
    return y, cond


def _score_net(d: int, conditional: bool, hidden: int, depth: int, *, arch, parametrization, n_fourier, fourier_period,
               floor) -> ScoreNet:
    """The network :func:`fit_score` trains, built without touching the global RNG (nn.Linear's
    default init draws from it; :func:`_seeded_init` replaces those draws)."""
    with torch.random.fork_rng(devices=[]):
        if not conditional:
            return ScoreNet(d, hidden, depth, arch=arch)
        return ConditionalScoreNet(d, hidden, depth, floor, arch=arch, parametrization=parametrization,
                                   n_fourier=n_fourier, fourier_period=fourier_period)


@torch.no_grad()
def _seeded_init(net: ScoreNet, generator: torch.Generator) -> None:
    """Initialization from the explicit generator: every Linear reset with seeded draws."""
    for layer in net.modules():
        if isinstance(layer, nn.Linear):
            bound = 1.0 / math.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):  # drawn where the generator lives, then copied in
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=generator.device).uniform_(-bound, bound, generator=generator))
    if isinstance(net.net, ResidualMLP):
        net.net.zero_block_outputs()


def fit_score(
    observations: Union[torch.Tensor, Sequence[torch.Tensor]],
    sigmas: Optional[Sequence[float]] = None,
    *,
    method: str = "auto",
    hidden: int = 128,
    depth: int = 3,
    steps: int = 2000,
    batch_size: int = 512,
    lr: float = 2e-3,
    n_projections: int = 1,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator,
    progress: bool = True,
    arch: str = "mlp",
    parametrization: str = "direct",
    n_fourier: int = 0,
    fourier_period: float = 8.0,
    floor: float = 0.2,
    ema: float = 0.0,
    lr_final_fraction: float = 0.05,
    warmup: int = 0,
    val_fraction: float = 0.0,
    eval_every: int = 250,
    weight_decay: float = 0.0,
) -> LearnedScore:
    """Build and train a score network on noisy observations (one model for all levels).

    Args:
        observations: ``(n, d)`` (one noise level, unconditional network) or a sequence of
            ``(n_l, d)`` tensors, one per known level in ``sigmas`` (conditional network).
        sigmas: the known noise level of each group (required with a sequence).
        method, steps, batch_size, lr, n_projections: see :func:`train_score_net`.
        hidden, depth: network size.
        dtype: training dtype (float32 is several times faster on CPU).
        generator: seeds the initialization, minibatches and projections.
        progress: tqdm bar.
        arch: ``"mlp"`` or ``"resmlp"`` (see :class:`ScoreNet`).
        parametrization, n_fourier, fourier_period, floor: conditional-network options (see
            :class:`ConditionalScoreNet`; only with per-level groups).
        ema, lr_final_fraction, warmup, val_fraction, eval_every, weight_decay: see :func:`train_score_net`
            (EMA weight averaging, schedule, held-out model selection on noisy observations).

    Returns:
        :class:`LearnedScore`; call it as ``score(y)`` or ``score(y, sigma)``.

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> y = torch.randn(256, 2, generator=g)
        >>> s = fit_score(y, steps=20, hidden=16, depth=1, generator=g, progress=False)
        >>> s(torch.zeros(1, 2)).shape
        torch.Size([1, 2])
    """
    generator = check_generator(generator)
    y, cond = _check_observations(observations, sigmas, dtype, parametrization, n_fourier)
    net = _score_net(y.shape[-1], cond is not None, hidden, depth, arch=arch, parametrization=parametrization,
                     n_fourier=n_fourier, fourier_period=fourier_period, floor=floor)
    _seeded_init(net, generator)
    net = net.to(device=y.device, dtype=dtype)  # the observations' device (CUDA too)
    result = train_score_net(
        net, y, cond, method=method, steps=steps, batch_size=batch_size, lr=lr,
        n_projections=n_projections, generator=generator, progress=progress, ema=ema,
        lr_final_fraction=lr_final_fraction, warmup=warmup, val_fraction=val_fraction, eval_every=eval_every,
        weight_decay=weight_decay,
    )
    return LearnedScore(net, result)
