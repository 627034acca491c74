"""Training configs and the noise prior: what a posterior training run is, checked once where it is built.

A :class:`TrainConfig` holds a :class:`ModelConfig` (the posterior network), a :class:`PriorConfig`
(the box of per-example noise tuples η = (β, λ, σ, u, v)), a :class:`DataConfig` (the clean data)
and the optimization, precision and checkpoint settings.  Every config is frozen and checks its
own fields in ``__post_init__``, so a config object is a valid one and what consumes it uses it
as it is; ``dataclasses.replace`` builds a changed copy, checked the same way.
:func:`load_config` reads one from TOML (bounded in size), :func:`config_to_dict` /
:func:`config_from_dict` convert to and from the plain dicts a checkpoint stores.

:class:`NoisePrior` draws the tuples; :func:`noise_metric` and :func:`noise_law` give each tuple's
metric Σ and generalized-Gaussian law in the prior's geometry.

Example::

    >>> cfg = load_config("configs/eight_gaussians_tiny.toml")
    >>> cfg.data.dim, cfg.prior.geometry
    (2, 'block')
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .._checks import MAX_THREADS, check_float, check_int, require
from ..data.ring import EightGaussians
from ..geometry import Metric, scale_constant
from ..noise import GeneralizedGaussian, NoiseParams
from ..posteriors.engression import CONDITIONINGS, LATENTS, OUTPUTS, EngressionPosterior, default_eta_bounds
from .posterior_files import POSTERIOR_DTYPES, _posterior_class

__all__ = ["DataConfig", "ModelConfig", "NoisePrior", "PriorConfig", "TrainConfig", "config_from_dict", "config_to_dict",
           "dry_run_config", "load_config", "noise_law", "noise_metric"]

#: The largest learning rate a config accepts (Adam steps each weight by about lr; far above any
#: that trains, low enough that the optimizer's float32 arithmetic stays finite).
MAX_LR = 10.0
#: The largest training-config file read (a TOML config is a few hundred bytes).
MAX_CONFIG_BYTES = 1024 * 1024
#: The run's random streams, one generator each (:func:`etweedie.training.engression.train`).
STREAMS = ("data", "prior", "noise", "model")
#: The largest seed whose per-stream seeds fit a signed 64-bit torch seed.
MAX_SEED = (2**63 - 1 - 7919 * len(STREAMS)) // 1_000_003
DATA_SOURCES = ("eight_gaussians", "mnist")
SIGMA_LAWS = ("log_uniform", "uniform")
GEOMETRIES = ("block", "isotropic")
PRECISIONS = ("float32", "bf16")


# ---------------------------------------------------------------------------- configuration
# Every config is frozen and checks its own fields when it is built (``__post_init__``): a config
# object is a valid one, and what consumes it (the builders, ``train``) uses it as it is.
# ``dataclasses.replace`` builds a changed copy, checked the same way.
def _fields_of(config, exclude: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """A config's fields as keyword arguments (the configs name their fields as the classes they build)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in exclude}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the posterior network (the η box comes from the prior).

    ``architecture`` names a class of :mod:`etweedie.posteriors.engression` (default
    :class:`~etweedie.posteriors.engression.EngressionPosterior`, built from the fields below).  Another class is
    built as ``cls(dim, eta_low=..., eta_high=..., init_seed=seed, **options)``; it must have a
    ``config`` dict (``cls(**config)`` rebuilds it), ``draw_noise(rows, n, generator, eta=)`` and
    ``generate(y, eta, noise)`` as :class:`~etweedie.posteriors.engression.EngressionPosterior` does.
    ``options`` are extra constructor arguments (a TOML table ``[model.options]``).
    ``network`` is the class, ``arguments()`` its keywords besides ``dim``, the η box and the seed.
    """

    width: int = 128
    depth: int = 3
    noise_dim: int = 8
    conditioning: str = "film"
    output: str = "scaled_residual"
    cond_width: int = 64
    latent: str = "gaussian"
    data_center: float = 0.0
    data_std: float = 1.0
    learn_data_scale: bool = False
    architecture: str = "EngressionPosterior"
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("width", "depth", "noise_dim", "cond_width"):
            check_int(getattr(self, name), f"model.{name}")
            require(getattr(self, name) >= 1, f"model.{name}", ">= 1", getattr(self, name))
        for name in ("data_center", "data_std"):
            check_float(getattr(self, name), f"model.{name}")
        require(self.data_std > 0, "model.data_std", "> 0", self.data_std)
        if not isinstance(self.learn_data_scale, bool):
            raise TypeError(f"model.learn_data_scale must be true or false, got {self.learn_data_scale!r}")
        require(self.conditioning in CONDITIONINGS, "model.conditioning", f"one of {CONDITIONINGS}", self.conditioning)
        require(self.output in OUTPUTS, "model.output", f"one of {OUTPUTS}", self.output)
        require(self.latent in LATENTS, "model.latent", f"one of {LATENTS}", self.latent)
        network = _posterior_class(self.architecture, "model.architecture")
        if not isinstance(self.options, dict):
            raise TypeError(f"model.options must be a table, got {type(self.options).__name__}")
        if self.options and network is EngressionPosterior:
            raise ValueError(f"model.options are for other architectures; EngressionPosterior takes the [model] "
                             f"keys, got options {sorted(self.options)}")
        object.__setattr__(self, "_network", network)

    @property
    def network(self) -> type:
        """The posterior class ``architecture`` names."""
        return self._network

    def arguments(self) -> Dict[str, Any]:
        """The network's constructor keywords besides ``dim``, the η box and ``init_seed``: the
        ``[model]`` keys (named as :class:`~etweedie.posteriors.engression.EngressionPosterior`'s parameters), or
        ``options`` for another architecture."""
        if self.network is EngressionPosterior:
            return _fields_of(self, exclude=("architecture", "options"))
        return dict(self.options)


@dataclass(frozen=True)
class PriorConfig:
    """Noise-parameter prior: β, λ uniform on their ranges; σ log-uniform (``sigma_law =
    "log_uniform"``) or uniform (``"uniform"``); (u, v) uniform on the disk of radius
    ``disk_radius``.  ``focus_weight`` w ∈ [0, 1): a share w of the examples takes σ log-uniform
    on the window ``focus_sigma`` (inside ``sigma``) instead — training weighted toward the noise
    levels a sampler spends its steps at, over the same η box.  ``geometry``: ``"block"`` (Σ = (σ/c_{β,d})² I_{d/2} ⊗ S(u, v), d even; for
    d = 2 this is S(u, v)) or ``"isotropic"`` (u = v = 0, Σ = (σ/c_{β,d})² I, any d).
    ``noise_prior`` is the :class:`NoisePrior` these fields make (its constructor owns their rules)."""

    beta: Tuple[float, float] = (1.3, 2.0)
    lam: Tuple[float, float] = (1.0, 2.5)
    sigma: Tuple[float, float] = (0.1, 0.75)
    disk_radius: float = 0.7
    sigma_law: str = "log_uniform"
    geometry: str = "block"
    focus_sigma: Tuple[float, float] = (0.5, 6.0)
    focus_weight: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "_noise_prior", NoisePrior.from_config(self))  # checks the ranges, law and geometry

    @property
    def noise_prior(self) -> "NoisePrior":
        return self._noise_prior


@dataclass(frozen=True)
class DataConfig:
    """The clean-data source (:func:`build_data_source`).

    ``source = "eight_gaussians"`` (d = 2): ``radius``, ``std``, ``n_modes`` (DESIGN §6 defaults).
    ``source = "mnist"`` (d = 784): read with :func:`etweedie.data.mnist.load_mnist` (``split``,
    ``data_dir``; an empty ``data_dir`` is the reader's default), pixels p ∈ {0..255} scaled to
    ``pixel_range`` = [low, high] (default [−1, 1]) as low + (high − low)·q with q = p/255, or with
    ``dequantize = true`` q = (p + U)/256, U ~ U[0, 1) drawn afresh each step.
    Keys of the other source are ignored.  ``dim`` is the source's d; ``ring`` the eight-Gaussians
    law (None for MNIST).
    """

    source: str = "eight_gaussians"
    radius: float = 2.0
    std: float = 0.2
    n_modes: int = 8
    data_dir: str = ""
    split: str = "train"
    pixel_range: Tuple[float, float] = (-1.0, 1.0)
    dequantize: bool = True

    def __post_init__(self):
        require(self.source in DATA_SOURCES, "data.source", f"one of {DATA_SOURCES}", self.source)
        check_float(self.radius, "data.radius")
        check_float(self.std, "data.std")
        check_int(self.n_modes, "data.n_modes")
        ring = EightGaussians(self.radius, self.std, self.n_modes) if self.source == "eight_gaussians" else None
        for name in ("data_dir", "split"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"data.{name} must be a string, got {type(getattr(self, name)).__name__}")
        require(self.split in ("train", "test"), "data.split", "'train' or 'test'", self.split)
        low, high = _pair(self.pixel_range, "data.pixel_range")
        require(low < high, "data.pixel_range", "[low, high] with low < high", list(self.pixel_range))
        if not isinstance(self.dequantize, bool):
            raise TypeError(f"data.dequantize must be true or false, got {self.dequantize!r}")
        object.__setattr__(self, "pixel_range", (low, high))
        object.__setattr__(self, "_ring", ring)

    @property
    def dim(self) -> int:
        """d of the source's examples (2 for the ring, 784 for MNIST's flat 28 × 28 images)."""
        return _SOURCE_DIMS[self.source]

    @property
    def ring(self) -> Optional[EightGaussians]:
        return self._ring


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on.  TOML layout: these keys at the top level and
    ``[model]``, ``[prior]``, ``[data]`` tables (:func:`load_config`).

    Fields:
        seed: seeds every generator (data, prior, noise, model ε, initialization).
        steps: optimizer steps.  batch_size: examples per step (the global batch: under torchrun
            each of the K ranks computes batch_size / K of them).  draws: m ≥ 2 posterior draws per example.
        lr, lr_min, warmup_steps: linear warm-up to ``lr``, then cosine decay to ``lr_min``.
        grad_clip: max gradient 2-norm (0 disables).  ema_decay: EMA decay in [0, 1) (0 disables).
        checkpoint_every: steps between checkpoints.  log_every: steps between log lines.
        checkpoint_every_s: also checkpoint (at a log step) once this many seconds passed since
            the last checkpoint (0: off).  max_wall_s: stop at the first log step after this much
            training time in this invocation, writing the checkpoint and the posterior (0: no
            deadline); a rerun resumes and gets the same budget again (a lease-sized deadline).
        fit_to_deadline: with ``max_wall_s`` set, time the steps between the first two log steps
            (after any compilation) and shorten ``steps`` so that the whole schedule — warm-up,
            the full cosine decay and the EMA's last window — ends before the deadline instead of
            being cut mid-decay.  The fitted count is logged and kept in the checkpoint, so a
            resumed run follows the same schedule; ``steps`` stays the upper bound.  A run
            resumed with ``fit_to_deadline`` off drops the fitted count and runs the schedule of
            ``steps`` from the resumed step on (its learning rate there is that schedule's, higher
            than the fitted one's); keep it on, with a deadline, to finish the fitted schedule.
        threads: ``torch.set_num_threads`` for the run (0 leaves torch's setting).
        device: where the model trains (``"cpu"``, ``"cuda"``, ``"cuda:1"``); data and random
            streams live there too.
        loss_beta: exponent of the training energy score in the noise metric: ``"matched"`` (each
            example's own noise β, paper Eq. es_tweedie) or a number in (0, 2) for all examples.
            Every β < 2 gives a strictly proper score with the same minimizer, the true posterior;
            the matched score degenerates as β → 2 (only the mean is identified there).
        precision: ``"float32"`` or ``"bf16"`` (network under bf16 autocast; loss in float32).
        tf32: allow TF32 matmuls on CUDA.  compile: ``torch.compile`` the forward + loss.
        fused_adam: ``"auto"`` (fused Adam on CUDA), ``true`` or ``false``.
        posterior_dtype: dtype of the saved posterior weights (``"float32"``, ``"float16"``,
            ``"bfloat16"``, ``"int8"``: per-row int8 matrices, :mod:`etweedie.training.checkpoint`).  shard_mb: largest safetensors shard of the saved posterior (MiB).
        init: a posterior to start from (a folder or a shipped name such as ``"mnist_full"``,
            :func:`load_posterior`; empty: a fresh initialization from ``seed``): fine-tuning.  Its
            architecture and model config must be this run's; the EMA starts from it too.
    """

    seed: int = 0
    steps: int = 2000
    batch_size: int = 256
    draws: int = 8
    lr: float = 1e-3
    lr_min: float = 1e-5
    warmup_steps: int = 100
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    checkpoint_every: int = 500
    log_every: int = 50
    checkpoint_every_s: float = 0.0
    max_wall_s: float = 0.0
    fit_to_deadline: bool = False
    threads: int = 0
    device: str = "cpu"
    loss_beta: Union[str, float] = "matched"
    precision: str = "float32"
    tf32: bool = False
    compile: bool = False
    fused_adam: Union[str, bool] = "auto"
    posterior_dtype: str = "float32"
    shard_mb: float = 16.0
    init: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "TrainConfig":
        """Check the run's own fields and that the prior's geometry fits the data (the sections
        checked themselves when they were built); raises ValueError/TypeError naming the field."""
        for name in ("seed", "steps", "batch_size", "draws", "warmup_steps", "checkpoint_every", "log_every", "threads"):
            check_int(getattr(self, name), name)
        require(0 <= self.seed <= MAX_SEED, "seed", f"in [0, {MAX_SEED}] (its streams are seeded seed·1000003 + k)",
                 self.seed)
        require(self.steps >= 0, "steps", ">= 0", self.steps)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        require(self.draws >= 2, "draws", ">= 2 (the fair energy score needs two draws)", self.draws)
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(self.checkpoint_every >= 1, "checkpoint_every", ">= 1", self.checkpoint_every)
        require(self.log_every >= 1, "log_every", ">= 1", self.log_every)
        require(0 <= self.threads <= MAX_THREADS, "threads", f"in [0, {MAX_THREADS}] (0: torch's default)", self.threads)
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {type(self.device).__name__}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', got {self.device!r}") from None
        if isinstance(self.loss_beta, str):
            require(self.loss_beta == "matched", "loss_beta", "'matched' or a number in (0, 2)", self.loss_beta)
        else:
            check_float(self.loss_beta, "loss_beta")
            require(0 < self.loss_beta < 2, "loss_beta", "'matched' or a number in (0, 2)", self.loss_beta)
        for name in ("lr", "lr_min", "grad_clip", "ema_decay", "checkpoint_every_s", "max_wall_s", "shard_mb"):
            check_float(getattr(self, name), name)
        require(0 < self.lr <= MAX_LR, "lr", f"in (0, {MAX_LR:g}] (Adam moves each weight by about lr per step)",
                 self.lr)
        require(0 <= self.lr_min <= self.lr, "lr_min", "in [0, lr]", self.lr_min)
        require(self.grad_clip >= 0, "grad_clip", ">= 0", self.grad_clip)
        require(0 <= self.ema_decay < 1, "ema_decay", "in [0, 1)", self.ema_decay)
        require(self.checkpoint_every_s >= 0, "checkpoint_every_s", ">= 0 (0: off)", self.checkpoint_every_s)
        require(self.max_wall_s >= 0, "max_wall_s", ">= 0 (0: no deadline)", self.max_wall_s)
        require(self.shard_mb >= 0.01, "shard_mb", ">= 0.01 (MiB)", self.shard_mb)
        if not isinstance(self.init, str):
            raise TypeError(f"init must be a posterior folder or shipped name (a string, '' for none), "
                            f"got {type(self.init).__name__}")
        require(self.precision in PRECISIONS, "precision", f"one of {PRECISIONS}", self.precision)
        require(self.posterior_dtype in POSTERIOR_DTYPES, "posterior_dtype", f"one of {tuple(POSTERIOR_DTYPES)}",
                 self.posterior_dtype)
        for name in ("tf32", "compile", "fit_to_deadline"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        require(not self.fit_to_deadline or self.max_wall_s > 0, "fit_to_deadline",
                 "false unless max_wall_s > 0 (a deadline to fit the schedule to)", self.fit_to_deadline)
        require(self.fused_adam == "auto" or isinstance(self.fused_adam, bool), "fused_adam", "'auto', true or false",
                 self.fused_adam)
        for section, cls in (("model", ModelConfig), ("prior", PriorConfig), ("data", DataConfig)):
            if not isinstance(getattr(self, section), cls):
                raise TypeError(f"{section} must be a {cls.__name__}, got {type(getattr(self, section)).__name__}")
        _check_geometry(self.prior.geometry, self.data.dim)
        return self


_SOURCE_DIMS = {"eight_gaussians": 2, "mnist": 784}


def _check_geometry(geometry: str, dim: int) -> None:
    if geometry == "block" and dim % 2:
        raise ValueError(
            f"prior.geometry = 'block' (I_(d/2) ⊗ S(u, v) on pairs of coordinates) needs an even data "
            f"dimension d, got d = {dim}; use geometry = 'isotropic' for odd d"
        )


def config_to_dict(config: TrainConfig) -> Dict[str, Any]:
    """The config as plain nested dicts/lists (what checkpoints store and TOML files hold)."""
    out = dataclasses.asdict(config)
    for section in ("prior", "data"):
        out[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in out[section].items()}
    return out


# TOML arrays read as the prior's (low, high) tuples (a DataConfig reads its pixel_range itself)
_PAIRS = {"prior": ("beta", "lam", "sigma", "focus_sigma")}


def config_from_dict(values: Dict[str, Any], *, source: str = "config") -> TrainConfig:
    """Build a :class:`TrainConfig` from nested dicts; unknown keys raise ValueError naming them."""
    if not isinstance(values, dict):
        raise TypeError(f"{source} must be a table/dict, got {type(values).__name__}")
    sections = {"model": ModelConfig, "prior": PriorConfig, "data": DataConfig}
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - top)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; known top-level keys: {', '.join(sorted(top))}")
    kwargs = {}
    for key, value in values.items():
        if key in sections:
            cls = sections[key]
            if not isinstance(value, dict):
                raise TypeError(f"{source}: [{key}] must be a table, got {type(value).__name__}")
            known = {f.name for f in dataclasses.fields(cls)}
            bad = sorted(set(value) - known)
            if bad:
                raise ValueError(
                    f"{source}: unknown key(s) in [{key}]: {', '.join(bad)}; known: {', '.join(sorted(known))}"
                )
            sub = dict(value)
            for name in _PAIRS.get(key, ()):
                if name in sub:
                    sub[name] = _pair(sub[name], f"{key}.{name}")
            if "options" in sub:
                sub["options"] = dict(sub["options"]) if isinstance(sub["options"], dict) else sub["options"]
            kwargs[key] = cls(**sub)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def _pair(value, name: str) -> Tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name} must be a [low, high] pair, got {value!r}")
    for v in value:
        check_float(v, name)
    return (float(value[0]), float(value[1]))


def load_config(path: Union[str, os.PathLike]) -> TrainConfig:
    """Read a TOML training config (top-level keys plus ``[model]``, ``[prior]``, ``[data]``).

    Unknown keys raise ValueError naming them; missing keys take the :class:`TrainConfig` defaults.
    """
    import tomllib

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: no such file {str(path)!r}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"config {str(path)!r} has {path.stat().st_size:,} bytes; a training config is at most "
                         f"{MAX_CONFIG_BYTES:,}")
    with path.open("rb") as fh:
        try:
            values = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config {str(path)!r} is not valid TOML: {exc}") from None
        except RecursionError:
            raise ValueError(f"config {str(path)!r} is nested too deeply to be a training config") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"config {str(path)!r} is not UTF-8 text (TOML): byte {exc.start} is "
                             f"{exc.object[exc.start:exc.start + 1]!r}") from None
    return config_from_dict(values, source=f"config {str(path)!r}")


def dry_run_config(config: TrainConfig, steps: int = 2) -> TrainConfig:
    """The same run on the CPU for ``steps`` steps, logging and checkpointing every step, with
    the same model, batch, precision, compile and optimizer settings: a GPU command's code path
    exercised without a GPU."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_int(steps, "steps")
    require(steps >= 1, "steps", ">= 1", steps)
    return dataclasses.replace(config, device="cpu", steps=steps, warmup_steps=min(config.warmup_steps, steps),
                               log_every=1, checkpoint_every=1, checkpoint_every_s=0.0, max_wall_s=0.0,
                               fit_to_deadline=False)


# ---------------------------------------------------------------------------- the prior and the geometry
class NoisePrior:
    """Per-example noise tuples: β ~ U[β₀, β₁], λ ~ U[λ₀, λ₁], σ log-uniform (log σ ~ U[log σ₀, log σ₁])
    or uniform on [σ₀, σ₁] (``sigma_law``), (u, v) uniform on the disk of radius ρ (ρ < 1 keeps
    S(u, v) positive definite); ``geometry = "isotropic"`` fixes u = v = 0 (the uniforms are still
    drawn, so the other fields do not depend on the geometry).

    Example::

        >>> prior = NoisePrior()
        >>> p = prior.sample(4, generator=torch.Generator().manual_seed(0))
        >>> p.eta().shape
        torch.Size([4, 5])
    """

    def __init__(self, beta=(1.3, 2.0), lam=(1.0, 2.5), sigma=(0.1, 0.75), disk_radius: float = 0.7,
                 sigma_law: str = "log_uniform", geometry: str = "block", focus_sigma=(0.5, 6.0),
                 focus_weight: float = 0.0):
        self.beta = _range(beta, "beta", 0.0, 2.0, closed_high=True)
        self.lam = _range(lam, "lam", 0.0, math.inf)
        self.sigma = _range(sigma, "sigma", 0.0, math.inf)
        check_float(focus_weight, "focus_weight")
        if not 0 <= focus_weight < 1:
            raise ValueError(f"focus_weight must be in [0, 1) (the share of examples in focus_sigma), got {focus_weight!r}")
        self.focus_weight = float(focus_weight)
        self.focus_sigma = _range(focus_sigma, "focus_sigma", 0.0, math.inf)
        if self.focus_weight > 0 and not (self.sigma[0] <= self.focus_sigma[0] and self.focus_sigma[1] <= self.sigma[1]):
            raise ValueError(f"focus_sigma must lie inside sigma = {list(self.sigma)} (the model's η box), "
                             f"got {list(self.focus_sigma)}")
        check_float(disk_radius, "disk_radius")
        if not 0 <= disk_radius < 1:
            raise ValueError(f"disk_radius must be in [0, 1) (u² + v² < 1), got {disk_radius!r}")
        self.disk_radius = float(disk_radius)
        require(sigma_law in SIGMA_LAWS, "sigma_law", f"one of {SIGMA_LAWS}", sigma_law)
        require(geometry in GEOMETRIES, "geometry", f"one of {GEOMETRIES}", geometry)
        self.sigma_law, self.geometry = sigma_law, geometry

    @classmethod
    def from_config(cls, config: PriorConfig) -> "NoisePrior":
        return cls(**_fields_of(config))

    def __repr__(self) -> str:
        focus = f", focus_sigma={self.focus_sigma}, focus_weight={self.focus_weight}" if self.focus_weight else ""
        return (f"NoisePrior(beta={self.beta}, lam={self.lam}, sigma={self.sigma}, disk_radius={self.disk_radius}, "
                f"sigma_law={self.sigma_law!r}, geometry={self.geometry!r}{focus})")

    def eta_bounds(self) -> tuple:
        """(eta_low, eta_high): the box of η = (β, log λ, log σ, u, v) this prior covers.

        A degenerate coordinate (a fixed β, λ or σ, ``disk_radius = 0`` or the isotropic
        geometry's u = v = 0) gets a unit half-width around its value, so the model's
        normalization stays finite."""
        radius = self.disk_radius if self.geometry == "block" else 0.0
        low, high = default_eta_bounds(self.beta, self.lam, self.sigma, radius)
        fixed = [a == b for a, b in zip(low, high)]
        low = tuple(a - 1.0 if f else a for a, f in zip(low, fixed))
        high = tuple(b + 1.0 if f else b for b, f in zip(high, fixed))
        return low, high

    def sample(self, n: int, generator: torch.Generator, *, dtype=torch.float32, device=None) -> NoiseParams:
        """n independent tuples: a :class:`NoiseParams` whose fields are ``(n,)`` tensors
        (on ``device``, default the generator's)."""
        check_int(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        device = generator.device if device is None else device
        unif = torch.rand(5, n, generator=generator, dtype=torch.float64, device=device)
        beta = self.beta[0] + (self.beta[1] - self.beta[0]) * unif[0]
        lam = self.lam[0] + (self.lam[1] - self.lam[0]) * unif[1]
        if self.sigma_law == "log_uniform":
            log_lo, log_hi = math.log(self.sigma[0]), math.log(self.sigma[1])
            sigma = torch.exp(log_lo + (log_hi - log_lo) * unif[2])
        else:
            sigma = self.sigma[0] + (self.sigma[1] - self.sigma[0]) * unif[2]
        if self.focus_weight > 0:  # drawn only then: a prior without a focus keeps its streams
            pick, where = torch.rand(2, n, generator=generator, dtype=torch.float64, device=device)
            lo, hi = math.log(self.focus_sigma[0]), math.log(self.focus_sigma[1])
            sigma = torch.where(pick < self.focus_weight, torch.exp(lo + (hi - lo) * where), sigma)
        radius = self.disk_radius * unif[3].sqrt()  # uniform on the disk: P(ρ ≤ r) = r²/R²
        angle = 2 * math.pi * unif[4]
        u, v = radius * torch.cos(angle), radius * torch.sin(angle)
        if self.geometry == "isotropic":
            u, v = torch.zeros_like(u), torch.zeros_like(v)
        return NoiseParams(*(t.to(dtype) for t in (beta, lam, sigma, u, v)))


def _range(value, name: str, lo: float, hi: float, closed_high: bool = False) -> Tuple[float, float]:
    a, b = _pair(value, name)
    ok_hi = b <= hi if closed_high else b < hi
    if not (lo < a <= b and ok_hi):
        bound = f"({lo:g}, {hi:g}{']' if closed_high else ')'}"
        raise ValueError(f"{name} must be a range [low, high] with low <= high inside {bound}, got {value!r}")
    return a, b


def _check_noise_args(params, d, geometry) -> None:
    if not isinstance(params, NoiseParams):
        raise TypeError(f"params must be a NoiseParams, got {type(params).__name__}")
    check_int(d, "d", minimum=1)
    require(geometry in GEOMETRIES, "geometry", f"one of {GEOMETRIES}", geometry)


def noise_metric(params: NoiseParams, d: int, geometry: str = "block") -> Metric:
    """The noise metric Σ of per-example tuples in dimension d.

    ``"block"``: ``params.metric(d)`` = (σ/c_{β,d})² I_{d/2} ⊗ S(u, v) (d even; S(u, v) for d = 2).
    ``"isotropic"``: (σ/c_{β,d})² I (the tuples' u = v = 0); for even d the same matrix as the block
    rule at u = v = 0, built the same way, so both rules give identical numbers there.
    """
    _check_noise_args(params, d, geometry)
    if geometry == "block" or d % 2 == 0:
        _check_geometry("block", d)
        return params.metric(d)
    beta, _, sigma, _, _ = params._tensors()
    return Metric.isotropic((sigma / scale_constant(beta, d)) ** 2)


def noise_law(params: NoiseParams, d: int, geometry: str = "block") -> GeneralizedGaussian:
    """The generalized-Gaussian noise of each tuple in dimension d and ``geometry`` (:func:`noise_metric`)."""
    _check_noise_args(params, d, geometry)
    if geometry == "block" or d % 2 == 0:
        _check_geometry("block", d)
        return params.noise(d)
    beta, lam, _, _, _ = params._tensors()
    return GeneralizedGaussian(beta, lam, noise_metric(params, d, geometry), dim=d)
