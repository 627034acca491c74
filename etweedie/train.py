"""Energy-score training of the conditional Engression posterior (paper §5.1; DESIGN §6).

Every step draws clean points x from the eight-Gaussians ring, a fresh noise tuple
η_b = (β_b, λ_b, σ_b, u_b, v_b) per example from :class:`NoisePrior`, noisy inputs
y_b = x_b + u_b with u_b from that example's own generalized-Gaussian law, m ≥ 2 posterior
draws x̂_{b,1..m} = g(y_b, η_b, ε) and minimizes the matched energy score (paper Eq. es_tweedie)

    L = (1/B) Σ_b ES_{Σ_b⁻¹, β_b}(x̂_{b,1..m}, x_b)
      = (1/B) Σ_b [ (1/m) Σ_i ‖x̂_{b,i} − x_b‖^{β_b}_{Σ_b⁻¹} − 1/(2m(m−1)) Σ_{i≠j} ‖x̂_{b,i} − x̂_{b,j}‖^{β_b}_{Σ_b⁻¹} ]

with the fused :func:`etweedie.energy_score` op (strictly proper for β < 2, so its minimizer
is the true posterior), Adam, a warm-up + cosine learning-rate schedule, optional gradient
clipping and an exponential moving average (EMA) of the weights.

Runs are reproducible and resumable: every random draw comes from four ``torch.Generator``
streams seeded from ``config.seed`` (data, prior, noise, model ε); every ``checkpoint_every``
steps the model, EMA, optimizer, step, all generator states and the config are written
atomically to ``out_dir/checkpoint.pt``; restarting the same command resumes from it, losing at
most ``checkpoint_every`` steps, and ends bit-identical to an uninterrupted run (same machine
and thread count).  ``out_dir/train_log.jsonl`` holds one JSON line per ``log_every`` steps
(step, mean loss over the interval, lr, cumulative training wall time); ``out_dir/posterior.pt``
is the final model (EMA weights when enabled), loaded with :func:`load_posterior`.

    etweedie train --config configs/eight_gaussians_cpu.toml --out runs/eg_cpu

Example::

    >>> from etweedie.train import load_config, train, load_posterior
    >>> cfg = load_config("configs/eight_gaussians_tiny.toml")
    >>> summary = train(cfg, "runs/tiny", progress=False)          # doctest: +SKIP
    >>> posterior = load_posterior(summary["posterior"])           # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
from tqdm.auto import tqdm

from .data import EightGaussians
from .models import CONDITIONINGS, LATENTS, OUTPUTS, EngressionPosterior, default_eta_bounds
from .noise import NoiseParams
from .ops import energy_score

__all__ = [
    "CLI_HELP",
    "DataConfig",
    "ModelConfig",
    "NoisePrior",
    "PriorConfig",
    "TrainConfig",
    "add_cli_arguments",
    "build_posterior",
    "cli_main",
    "config_from_dict",
    "config_to_dict",
    "gaussian_posterior_check",
    "held_out_loss",
    "learning_rate",
    "load_config",
    "load_posterior",
    "train",
]

CHECKPOINT_FILE = "checkpoint.pt"
POSTERIOR_FILE = "posterior.pt"
LOG_FILE = "train_log.jsonl"
POSTERIOR_FORMAT = "etweedie.posterior/1"
CHECKPOINT_FORMAT = "etweedie.checkpoint/1"
STREAMS = ("data", "prior", "noise", "model")
# Settings that may change between a run and its resumption (they do not alter the trajectory
# up to the checkpoint); everything else must match the checkpoint's config.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "log_every", "threads")
#: Examples × draws per backward block of a CPU training step.  A step's loss is a mean over
#: examples, so it is accumulated exactly over blocks of examples; the ε of the whole batch is
#: drawn first (one ``draw_noise`` call, as ``sample`` does), so the random streams do not depend
#: on the blocking.  Blocks keep the W-wide activations in cache: the W256×4 full config's
#: 1,024 × 8-draw step took 0.22 s instead of 0.26 s (steady state, one training process;
#: two trainings sharing this 2-core VM ran at ≈ 0.25 s/step either way; experiments/RESULTS.md).
#: GPU steps and batches of at most 2× this many rows run whole; None disables blocking.
CPU_TRAIN_ROWS: Optional[int] = 2048


# ---------------------------------------------------------------------------- configuration
@dataclass
class ModelConfig:
    """Architecture of :class:`~etweedie.models.EngressionPosterior` (the η box comes from the prior)."""

    width: int = 128
    depth: int = 3
    noise_dim: int = 8
    conditioning: str = "film"
    output: str = "scaled_residual"
    cond_width: int = 64
    latent: str = "gaussian"


@dataclass
class PriorConfig:
    """Noise-parameter prior ranges: β, λ uniform; σ log-uniform; (u, v) uniform on a disk."""

    beta: Tuple[float, float] = (1.3, 2.0)
    lam: Tuple[float, float] = (1.0, 2.5)
    sigma: Tuple[float, float] = (0.1, 0.75)
    disk_radius: float = 0.7


@dataclass
class DataConfig:
    """Eight-Gaussians ring (DESIGN §6 defaults)."""

    radius: float = 2.0
    std: float = 0.2
    n_modes: int = 8


@dataclass
class TrainConfig:
    """Everything a training run depends on.  TOML layout: these keys at the top level and
    ``[model]``, ``[prior]``, ``[data]`` tables (:func:`load_config`).

    Fields:
        seed: seeds every generator (data, prior, noise, model ε, initialization).
        steps: optimizer steps.  batch_size: examples per step.  draws: m ≥ 2 posterior draws per example.
        lr, lr_min, warmup_steps: linear warm-up to ``lr``, then cosine decay to ``lr_min``.
        grad_clip: max gradient 2-norm (0 disables).  ema_decay: EMA decay in [0, 1) (0 disables).
        checkpoint_every: steps between checkpoints.  log_every: steps between log lines.
        threads: ``torch.set_num_threads`` for the run (0 leaves torch's setting).
        device: where the model trains (``"cpu"``, ``"cuda"``, ``"cuda:1"``; data are drawn on the CPU).
        loss_beta: exponent of the training energy score in the noise metric: ``"matched"`` (each
            example's own noise β, paper Eq. es_tweedie) or a number in (0, 2) for all examples.
            Every β < 2 gives a strictly proper score with the same minimizer, the true posterior;
            the matched score degenerates as β → 2 (only the mean is identified there).
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
    threads: int = 0
    device: str = "cpu"
    loss_beta: Union[str, float] = "matched"
    model: ModelConfig = field(default_factory=ModelConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "TrainConfig":
        """Check every field; raises ValueError/TypeError naming the field."""
        for name in ("seed", "steps", "batch_size", "draws", "warmup_steps", "checkpoint_every", "log_every", "threads"):
            _check_int(getattr(self, name), name)
        _require(self.seed >= 0, "seed", ">= 0", self.seed)
        _require(self.steps >= 0, "steps", ">= 0", self.steps)
        _require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        _require(self.draws >= 2, "draws", ">= 2 (the fair energy score needs two draws)", self.draws)
        _require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        _require(self.checkpoint_every >= 1, "checkpoint_every", ">= 1", self.checkpoint_every)
        _require(self.log_every >= 1, "log_every", ">= 1", self.log_every)
        _require(self.threads >= 0, "threads", ">= 0", self.threads)
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {type(self.device).__name__}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', got {self.device!r}") from None
        if isinstance(self.loss_beta, str):
            _require(self.loss_beta == "matched", "loss_beta", "'matched' or a number in (0, 2)", self.loss_beta)
        else:
            _check_float(self.loss_beta, "loss_beta")
            _require(0 < self.loss_beta < 2, "loss_beta", "'matched' or a number in (0, 2)", self.loss_beta)
        for name in ("lr", "lr_min", "grad_clip", "ema_decay"):
            _check_float(getattr(self, name), name)
        _require(self.lr > 0, "lr", "> 0", self.lr)
        _require(0 <= self.lr_min <= self.lr, "lr_min", "in [0, lr]", self.lr_min)
        _require(self.grad_clip >= 0, "grad_clip", ">= 0", self.grad_clip)
        _require(0 <= self.ema_decay < 1, "ema_decay", "in [0, 1)", self.ema_decay)
        for section, cls in (("model", ModelConfig), ("prior", PriorConfig), ("data", DataConfig)):
            if not isinstance(getattr(self, section), cls):
                raise TypeError(f"{section} must be a {cls.__name__}, got {type(getattr(self, section)).__name__}")
        m = self.model
        for name in ("width", "depth", "noise_dim", "cond_width"):
            _check_int(getattr(m, name), f"model.{name}")
            _require(getattr(m, name) >= 1, f"model.{name}", ">= 1", getattr(m, name))
        NoisePrior.from_config(self.prior)  # validates the ranges
        _check_float(self.data.radius, "data.radius")
        _check_float(self.data.std, "data.std")
        _check_int(self.data.n_modes, "data.n_modes")
        EightGaussians(self.data.radius, self.data.std, self.data.n_modes)
        _require(m.conditioning in CONDITIONINGS, "model.conditioning", f"one of {CONDITIONINGS}", m.conditioning)
        _require(m.output in OUTPUTS, "model.output", f"one of {OUTPUTS}", m.output)
        _require(m.latent in LATENTS, "model.latent", f"one of {LATENTS}", m.latent)
        return self


def _check_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _check_float(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {type(value).__name__} {value!r}")


def _require(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {got!r}")


def config_to_dict(config: TrainConfig) -> Dict[str, Any]:
    """The config as plain nested dicts/lists (what checkpoints store and TOML files hold)."""
    out = dataclasses.asdict(config)
    out["prior"] = {k: list(v) if isinstance(v, tuple) else v for k, v in out["prior"].items()}
    return out


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
            if cls is PriorConfig:
                for name in ("beta", "lam", "sigma"):
                    if name in sub:
                        sub[name] = _pair(sub[name], f"prior.{name}")
            kwargs[key] = cls(**sub)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def _pair(value, name: str) -> Tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name} must be a [low, high] pair, got {value!r}")
    for v in value:
        _check_float(v, name)
    return (float(value[0]), float(value[1]))


def load_config(path: Union[str, os.PathLike]) -> TrainConfig:
    """Read a TOML training config (top-level keys plus ``[model]``, ``[prior]``, ``[data]``).

    Unknown keys raise ValueError naming them; missing keys take the :class:`TrainConfig` defaults.
    """
    import tomllib

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: no such file {str(path)!r}")
    with path.open("rb") as fh:
        try:
            values = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config {str(path)!r} is not valid TOML: {exc}") from None
    return config_from_dict(values, source=f"config {str(path)!r}")


# ---------------------------------------------------------------------------- the prior
class NoisePrior:
    """Per-example noise tuples: β ~ U[β₀, β₁], λ ~ U[λ₀, λ₁], log σ ~ U[log σ₀, log σ₁],
    (u, v) uniform on the disk of radius ρ (ρ < 1 keeps S(u, v) positive definite).

    Example::

        >>> prior = NoisePrior()
        >>> p = prior.sample(4, generator=torch.Generator().manual_seed(0))
        >>> p.eta().shape
        torch.Size([4, 5])
    """

    def __init__(self, beta=(1.3, 2.0), lam=(1.0, 2.5), sigma=(0.1, 0.75), disk_radius: float = 0.7):
        self.beta = _range(beta, "beta", 0.0, 2.0, closed_high=True)
        self.lam = _range(lam, "lam", 0.0, math.inf)
        self.sigma = _range(sigma, "sigma", 0.0, math.inf)
        _check_float(disk_radius, "disk_radius")
        if not 0 <= disk_radius < 1:
            raise ValueError(f"disk_radius must be in [0, 1) (u² + v² < 1), got {disk_radius!r}")
        self.disk_radius = float(disk_radius)

    @classmethod
    def from_config(cls, config: PriorConfig) -> "NoisePrior":
        return cls(config.beta, config.lam, config.sigma, config.disk_radius)

    def __repr__(self) -> str:
        return f"NoisePrior(beta={self.beta}, lam={self.lam}, sigma={self.sigma}, disk_radius={self.disk_radius})"

    def eta_bounds(self) -> tuple:
        """(eta_low, eta_high): the box of η = (β, log λ, log σ, u, v) this prior covers.

        A degenerate coordinate (a fixed β, λ or σ, or ``disk_radius = 0``) gets a unit half-width
        around its value, so the model's normalization stays finite."""
        low, high = default_eta_bounds(self.beta, self.lam, self.sigma, self.disk_radius)
        fixed = [a == b for a, b in zip(low, high)]
        low = tuple(a - 1.0 if f else a for a, f in zip(low, fixed))
        high = tuple(b + 1.0 if f else b for b, f in zip(high, fixed))
        return low, high

    def sample(self, n: int, generator: torch.Generator, *, dtype=torch.float32, device=None) -> NoiseParams:
        """n independent tuples: a :class:`NoiseParams` whose fields are ``(n,)`` tensors."""
        _check_int(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        unif = torch.rand(5, n, generator=generator, dtype=torch.float64, device=device)
        beta = self.beta[0] + (self.beta[1] - self.beta[0]) * unif[0]
        lam = self.lam[0] + (self.lam[1] - self.lam[0]) * unif[1]
        log_lo, log_hi = math.log(self.sigma[0]), math.log(self.sigma[1])
        sigma = torch.exp(log_lo + (log_hi - log_lo) * unif[2])
        radius = self.disk_radius * unif[3].sqrt()  # uniform on the disk: P(ρ ≤ r) = r²/R²
        angle = 2 * math.pi * unif[4]
        u, v = radius * torch.cos(angle), radius * torch.sin(angle)
        return NoiseParams(*(t.to(dtype) for t in (beta, lam, sigma, u, v)))


def _range(value, name: str, lo: float, hi: float, closed_high: bool = False) -> Tuple[float, float]:
    a, b = _pair(value, name)
    ok_hi = b <= hi if closed_high else b < hi
    if not (lo < a <= b and ok_hi):
        bound = f"({lo:g}, {hi:g}{']' if closed_high else ')'}"
        raise ValueError(f"{name} must be a range [low, high] with low <= high inside {bound}, got {value!r}")
    return a, b


# ---------------------------------------------------------------------------- schedule and state
def learning_rate(config: TrainConfig, step: int) -> float:
    """lr at optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``lr_min``."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
    return config.lr_min + 0.5 * (config.lr - config.lr_min) * (1 + math.cos(math.pi * progress))


def build_posterior(config: TrainConfig, dim: int = 2) -> EngressionPosterior:
    """The untrained model for ``config`` (initialized from ``config.seed``)."""
    low, high = NoisePrior.from_config(config.prior).eta_bounds()
    m = config.model
    return EngressionPosterior(
        dim,
        width=m.width,
        depth=m.depth,
        noise_dim=m.noise_dim,
        conditioning=m.conditioning,
        output=m.output,
        cond_width=m.cond_width,
        latent=m.latent,
        eta_low=low,
        eta_high=high,
        init_seed=config.seed,
    )


def _generators(seed: int, device=None) -> Dict[str, torch.Generator]:
    """Independent streams per purpose: resizing one (e.g. more draws) leaves the others unchanged.
    Data, prior and noise streams live on the CPU; the model's ε stream on the model's device."""
    return {
        name: torch.Generator(device=device if name == "model" else "cpu").manual_seed(seed * 1_000_003 + 7919 * (i + 1))
        for i, name in enumerate(STREAMS)
    }


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


#: keys added after runs were saved without them, with the value those runs used
_ADDED_KEYS = {"loss_beta": "matched", "model.latent": "gaussian"}


def _config_differences(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "") -> list:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _ADDED_KEYS.get(prefix + key)), current.get(key, _ADDED_KEYS.get(prefix + key))
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key} ({a!r} -> {b!r})")
    return diffs


def _rewrite_log(path: Path, upto_step: int) -> None:
    """Keep the log lines of steps ≤ upto_step (lines a killed run wrote after its checkpoint go)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto_step:
                kept.append(line)
        except (ValueError, KeyError):
            break  # a line cut short by the kill: drop it and everything after
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- training
def _train_block(batch: int, draws: int, device: torch.device) -> int:
    """Examples per backward block of one training step (the whole batch on GPUs and for small steps)."""
    if CPU_TRAIN_ROWS is None or device.type != "cpu" or batch * draws <= 2 * CPU_TRAIN_ROWS:
        return batch
    return max(1, CPU_TRAIN_ROWS // draws)


def _score_beta(config_loss_beta, params: NoiseParams):
    """The training energy score's β: each example's own (``"matched"``) or the config's number."""
    return params.beta if config_loss_beta == "matched" else float(config_loss_beta)


def _loss_and_backward(model, x, y, noise_params: NoiseParams, draws: int, generator, device, loss_beta="matched") -> float:
    """Energy-score loss of one step (mean over examples); accumulates its gradient into ``.grad``.

    On CPU, large steps run in blocks of examples (:data:`CPU_TRAIN_ROWS`) with the ε of the
    whole batch drawn once; the loss and gradient equal the one-block step's up to rounding.
    """
    batch = y.shape[0]
    block = _train_block(batch, draws, device)
    if block >= batch:
        samples = model.sample(y, noise_params.eta(), draws, generator=generator)
        loss = energy_score(samples, x, beta=_score_beta(loss_beta, noise_params), metric=noise_params.metric(x.shape[-1])).mean()
        loss.backward()
        return float(loss.detach())
    dtype = model.out.weight.dtype
    noise = model.draw_noise(batch, draws, generator, eta=noise_params.eta().expand(batch, 5).to(dtype))
    fields = noise_params._tensors()
    total = 0.0
    for i in range(0, batch, block):
        part = slice(i, i + block)
        params = NoiseParams(*(t[part] if t.dim() else t for t in fields))
        samples = model.generate(y[part].to(dtype), params.eta().to(dtype), noise[part]).to(y.dtype)
        loss = energy_score(samples, x[part], beta=_score_beta(loss_beta, params), metric=params.metric(x.shape[-1])).sum() / batch
        loss.backward()
        total += float(loss.detach())
    return total


def train(
    config: TrainConfig,
    out_dir: Union[str, os.PathLike],
    *,
    resume: bool = True,
    progress: bool = True,
    stop_after: Optional[int] = None,
) -> Dict[str, Any]:
    """Train the Engression posterior on eight Gaussians with the matched energy score.

    Args:
        config: the run's :class:`TrainConfig`.
        out_dir: run directory (created); holds ``checkpoint.pt``, ``train_log.jsonl``, ``posterior.pt``.
        resume: continue from ``out_dir/checkpoint.pt`` when present (its config must match
            except for ``steps``, ``checkpoint_every``, ``log_every``, ``threads``); False
            starts afresh and overwrites the run directory's files.
        progress: show a tqdm progress bar.
        stop_after: stop (without a final checkpoint or posterior) once this step count is
            reached, as if the process were killed there; for testing resumption.

    Returns:
        a dict: ``out_dir``, ``step`` (steps done), ``steps``, ``final_loss`` (mean loss over
        the last log interval), ``wall_time_s`` (cumulative training time over all resumptions),
        ``cpu_time_s`` (process CPU seconds, likewise; on a shared machine the better measure of
        cost), ``resumed_from`` (step or None), ``stopped`` (True when ``stop_after`` cut the run),
        ``checkpoint``, ``log``, ``posterior`` (paths; ``posterior`` is None when stopped).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    config.validate()
    if stop_after is not None:
        _check_int(stop_after, "stop_after")
        _require(stop_after >= 0, "stop_after", ">= 0", stop_after)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _train(config, out, resume, progress, stop_after)
    finally:
        torch.set_num_threads(previous_threads)


class _Clock:
    """Cumulative wall and process-CPU seconds over a run and its resumptions."""

    def __init__(self, wall: float = 0.0, cpu: float = 0.0):
        self.wall, self.cpu = wall, cpu
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def tick(self) -> "_Clock":
        wall, cpu = time.perf_counter(), time.process_time()
        self.wall += wall - self._wall0
        self.cpu += cpu - self._cpu0
        self._wall0, self._cpu0 = wall, cpu
        return self


def _train(config: TrainConfig, out: Path, resume: bool, progress: bool, stop_after: Optional[int]) -> Dict[str, Any]:
    ckpt_path, log_path, post_path = out / CHECKPOINT_FILE, out / LOG_FILE, out / POSTERIOR_FILE
    device = torch.device(config.device)
    data = EightGaussians(config.data.radius, config.data.std, config.data.n_modes)
    prior = NoisePrior.from_config(config.prior)
    d = data.dim
    model = build_posterior(config, d).to(device)
    ema = copy.deepcopy(model).requires_grad_(False) if config.ema_decay > 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    gens = _generators(config.seed, device)
    step, resumed_from, wall0, cpu0 = 0, None, 0.0, 0.0
    interval_sum, interval_count, last_logged_loss = 0.0, 0, float("nan")
    config_dict = config_to_dict(config)

    if resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ckpt.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{ckpt_path} is not an etweedie training checkpoint (format {ckpt.get('format')!r})")
        diffs = [
            diff
            for diff in _config_differences(ckpt["config"], config_dict)
            if diff.split(" ")[0] not in RESUMABLE_CHANGES
        ]
        if diffs:
            raise ValueError(
                f"config differs from the checkpoint in {ckpt_path}: {'; '.join(diffs)}. "
                "Use the same config to resume, or resume=False (--no-resume) / another --out to start afresh"
            )
        model.load_state_dict(ckpt["model"])
        if ema is not None:
            ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        for name in STREAMS:
            gens[name].set_state(ckpt["generators"][name])
        step, wall0, cpu0 = ckpt["step"], ckpt["wall_time"], ckpt["cpu_time"]
        interval_sum, interval_count = ckpt["interval_sum"], ckpt["interval_count"]
        last_logged_loss = ckpt["last_logged_loss"]
        resumed_from = step
        _rewrite_log(log_path, step)
    else:
        for path in (ckpt_path, log_path, post_path):
            if path.exists():
                path.unlink()

    def save_checkpoint() -> None:
        _atomic_save(
            {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "wall_time": clock.wall,
                "cpu_time": clock.cpu,
                "model": model.state_dict(),
                "model_config": model.config,
                "ema": None if ema is None else ema.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generators": {name: gens[name].get_state() for name in STREAMS},
                "interval_sum": interval_sum,
                "interval_count": interval_count,
                "last_logged_loss": last_logged_loss,
                "config": config_dict,
            },
            ckpt_path,
        )

    target = config.steps if stop_after is None else min(config.steps, stop_after)
    params = list(model.parameters())
    ema_params = None if ema is None else list(ema.parameters())
    bar = tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    model.train()
    clock = _Clock(wall0, cpu0)
    with open(log_path, "a") as log:
        while step < target:
            lr = learning_rate(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # data, tuples and noise are drawn on the CPU (cheap, and the same on every device)
            x, _ = data.sample(config.batch_size, gens["data"])
            noise_params = prior.sample(config.batch_size, gens["prior"])
            y = x + noise_params.noise(d).sample(generator=gens["noise"])
            if device.type != "cpu":
                x, y = x.to(device), y.to(device)
                noise_params = NoiseParams(*(torch.as_tensor(t).to(device) for t in noise_params._tensors()))
            optimizer.zero_grad(set_to_none=True)
            loss_value = _loss_and_backward(model, x, y, noise_params, config.draws, gens["model"], device, config.loss_beta)
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            if ema is not None:
                with torch.no_grad():
                    torch._foreach_lerp_(ema_params, params, 1 - config.ema_decay)
            step += 1
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"training loss became {loss_value} at step {step}; lower lr or raise grad_clip")
            interval_sum += loss_value
            interval_count += 1
            bar.update(1)
            if step % config.log_every == 0 or step == config.steps:
                clock.tick()
                last_logged_loss = interval_sum / interval_count
                row = {"step": step, "loss": last_logged_loss, "lr": lr, "wall_time": round(clock.wall, 3)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                interval_sum, interval_count = 0.0, 0
                bar.set_postfix(loss=f"{last_logged_loss:.4f}", lr=f"{lr:.2e}")
            if step % config.checkpoint_every == 0 or step == config.steps:
                clock.tick()
                save_checkpoint()
    bar.close()
    clock.tick()
    stopped = step < config.steps
    if not stopped:
        if resumed_from is None or resumed_from < config.steps or not post_path.exists():
            _save_posterior(ema if ema is not None else model, post_path, config_dict, step)
    return {
        "out_dir": str(out),
        "step": step,
        "steps": config.steps,
        "final_loss": last_logged_loss,
        "wall_time_s": clock.wall,
        "cpu_time_s": clock.cpu,
        "resumed_from": resumed_from,
        "stopped": stopped,
        "checkpoint": str(ckpt_path),
        "log": str(log_path),
        "posterior": None if stopped else str(post_path),
    }


def _save_posterior(model: EngressionPosterior, path: Path, config_dict: Dict[str, Any], step: int) -> None:
    _atomic_save(
        {
            "format": POSTERIOR_FORMAT,
            "model_config": model.config,
            "state_dict": model.state_dict(),
            "step": step,
            "train_config": config_dict,
        },
        path,
    )


def load_posterior(path: Union[str, os.PathLike], device="cpu") -> EngressionPosterior:
    """Load a trained posterior from ``posterior.pt`` or a training ``checkpoint.pt``
    (a checkpoint's EMA weights when it has them), in eval mode on ``device``.
    A run directory is accepted too (its ``posterior.pt``, else its ``checkpoint.pt``)."""
    path = Path(path)
    if path.is_dir():
        path = path / POSTERIOR_FILE if (path / POSTERIOR_FILE).exists() else path / CHECKPOINT_FILE
    if not path.is_file():
        raise ValueError(f"path: no posterior or checkpoint file at {str(path)!r}")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(blob, dict) or blob.get("format") not in (POSTERIOR_FORMAT, CHECKPOINT_FORMAT):
        raise ValueError(f"{str(path)!r} is neither an etweedie posterior nor a training checkpoint")
    model = EngressionPosterior(**blob["model_config"])
    if blob["format"] == POSTERIOR_FORMAT:
        state = blob["state_dict"]
    else:
        state = blob["ema"] if blob.get("ema") is not None else blob["model"]
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def held_out_loss(
    posterior: EngressionPosterior,
    config: TrainConfig,
    *,
    n_examples: int = 4096,
    draws: int = 16,
    seed: int = 12345,
) -> float:
    """Mean matched energy score (the training loss) on a fixed held-out set drawn from the
    config's data and prior with ``seed`` (independent of the training streams).

    Lower is better; comparable across models trained with the same prior and data config.
    """
    data = EightGaussians(config.data.radius, config.data.std, config.data.n_modes)
    prior = NoisePrior.from_config(config.prior)
    device = next(posterior.parameters()).device
    gens = _generators(seed, device)
    x, _ = data.sample(n_examples, gens["data"])
    params = prior.sample(n_examples, gens["prior"])
    y = x + params.noise(data.dim).sample(generator=gens["noise"])
    x, y = x.to(device), y.to(device)
    params = NoiseParams(*(torch.as_tensor(t).to(device) for t in params._tensors()))
    samples = posterior.sample(y, params.eta(), draws, generator=gens["model"])
    return float(energy_score(samples, x, beta=_score_beta(config.loss_beta, params), metric=params.metric(data.dim)).mean())


@torch.no_grad()
def gaussian_posterior_check(
    posterior: EngressionPosterior,
    *,
    sigmas=(0.1, 0.25, 0.5, 0.75),
    lam: float = 1.0,
    n_queries: int = 1024,
    n_draws: int = 256,
    seed: int = 0,
    data: Optional[EightGaussians] = None,
) -> Dict[str, Any]:
    """Quality of the learned posterior where the truth is closed form: β = 2, u = v = 0.

    There the noise is N(0, s² I) with s = σ/√λ (c_{2,d} = 1), the posterior X | y is the exact
    Gaussian mixture of :meth:`EightGaussians.posterior_mean`, and the noisy score is analytic.
    For queries y = x + s ξ (x from the ring) and N = ``n_draws`` model draws per query:

    * ``pm_mse``: E‖x̄_N(y) − E[X | y]‖² (sum over coordinates, mean over queries), x̄_N the
      mean of the draws (includes the Monte-Carlo error tr Cov(X | y)/N);
    * ``pm_rel``: pm_mse / E‖y − E[X | y]‖² (1 = no better than returning y);
    * ``score_nmse``: E‖ŝ − s‖²/E‖s‖² for the Energy-Tweedie score ŝ = et_score(y, draws, β=2, λ, Σ)
      against the analytic noisy score s (paper Eq. sm_finite_sample);
    * ``exact_score_nmse``: the same with N exact posterior draws
      (:meth:`EightGaussians.posterior_sample`): the Monte-Carlo floor at this N.

    Returns ``{"per_sigma": {σ: {...}}, "pm_mse", "pm_rel", "score_nmse", "exact_score_nmse"}``
    (the last four averaged over σ).
    """
    from .ops import et_score

    data = data or EightGaussians()
    rows = {}
    for i, sigma in enumerate(sigmas):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        params = NoiseParams(2.0, float(lam), float(sigma), 0.0, 0.0)
        s = float(sigma) / math.sqrt(float(lam))
        x, _ = data.sample(n_queries, g)
        y = x + s * torch.randn(x.shape, generator=g)
        device = next(posterior.parameters()).device
        if device.type == "cpu":
            draws = posterior.sample(y, params.eta(), n_draws, generator=g)
        else:
            g_model = torch.Generator(device=device).manual_seed(seed * 7919 + i)
            draws = posterior.sample(y.to(device), params.eta().to(device), n_draws, generator=g_model).cpu()
        exact_mean = data.posterior_mean(y, s)
        err = (draws.mean(-2) - exact_mean).pow(2).sum(-1).mean()
        base = (y - exact_mean).pow(2).sum(-1).mean()
        score = et_score(y, draws, beta=2.0, lam=float(lam), metric=params.metric(data.dim))
        true_score = data.noisy_score(y, s)
        norm = true_score.pow(2).sum(-1).mean()
        nmse = (score - true_score).pow(2).sum(-1).mean() / norm
        exact_draws = data.posterior_sample(y, s, n_draws, g)
        exact_score = et_score(y, exact_draws, beta=2.0, lam=float(lam), metric=params.metric(data.dim))
        floor = (exact_score - true_score).pow(2).sum(-1).mean() / norm
        rows[float(sigma)] = {
            "pm_mse": float(err),
            "pm_rel": float(err / base),
            "score_nmse": float(nmse),
            "exact_score_nmse": float(floor),
        }
    keys = ("pm_mse", "pm_rel", "score_nmse", "exact_score_nmse")
    avg = {k: sum(r[k] for r in rows.values()) / len(rows) for k in keys}
    return {"per_sigma": rows, **avg}


# ---------------------------------------------------------------------------- CLI plugin
CLI_HELP = "train the Engression posterior on eight Gaussians (energy-score loss; resumable)"


def add_cli_arguments(parser) -> None:
    parser.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/eight_gaussians_cpu.toml")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<config name>)")
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--device", help="override the config's device (cpu, cuda, cuda:1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-resume", action="store_true", help="start afresh even if DIR/checkpoint.pt exists")


def cli_main(args) -> int:
    try:
        config = load_config(args.config)
        overrides = {k: getattr(args, k) for k in ("steps", "seed", "device") if getattr(args, k) is not None}
        if overrides:
            config = dataclasses.replace(config, **overrides)
    except (ValueError, TypeError) as exc:
        print(f"etweedie train: error: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out or str(Path("runs") / Path(args.config).stem)
    try:
        summary = train(config, out_dir, resume=not args.no_resume, progress=not args.no_progress)
    except ValueError as exc:
        print(f"etweedie train: error: {exc}", file=sys.stderr)
        return 2
    if summary["resumed_from"] is not None:
        print(f"resumed from step {summary['resumed_from']}")
    print(
        f"trained {summary['step']} steps in {summary['wall_time_s']:.1f} s "
        f"({summary['cpu_time_s']:.1f} s CPU); "
        f"final loss {summary['final_loss']:.4f}"
    )
    print(f"posterior written to {summary['posterior']}")
    print(f"log: {summary['log']}  checkpoint: {summary['checkpoint']}")
    return 0
