"""Energy-score training of a conditional Engression posterior on any clean data (paper §5.1; DESIGN §6).

Every step draws clean examples x ``(B, d)`` from a data source (:mod:`etweedie.data.sources`: a tensor
of examples, a callable ``draw(batch_size, generator)``, eight Gaussians, MNIST), a fresh noise tuple
η_b = (β_b, λ_b, σ_b, u_b, v_b) per example from :class:`NoisePrior`, noisy inputs y_b = x_b + u_b
with u_b from that example's own generalized-Gaussian law in the prior's geometry (``"block"``:
Σ = (σ/c_{β,d})² I_{d/2} ⊗ S(u, v), which is S(u, v) itself for d = 2; ``"isotropic"``: u = v = 0,
any d), m ≥ 2 posterior draws x̂_{b,1..m} = g(y_b, η_b, ε) and minimizes the matched energy score
(paper Eq. es_tweedie)

    L = (1/B) Σ_b ES_{Σ_b⁻¹, β_b}(x̂_{b,1..m}, x_b)
      = (1/B) Σ_b [ (1/m) Σ_i ‖x̂_{b,i} − x_b‖^{β_b}_{Σ_b⁻¹} − 1/(2m(m−1)) Σ_{i≠j} ‖x̂_{b,i} − x̂_{b,j}‖^{β_b}_{Σ_b⁻¹} ]

with the fused :func:`etweedie.energy_score` op (strictly proper for β < 2, so its minimizer
is the true posterior), Adam, a warm-up + cosine learning-rate schedule, optional gradient
clipping and an exponential moving average (EMA) of the weights.

Runs are reproducible and resumable: every random draw comes from four ``torch.Generator``
streams seeded from ``config.seed`` (data, prior, noise, model ε; on the CPU for CPU runs, on the
GPU for GPU runs, so the data never cross the bus); every ``checkpoint_every`` steps the model,
EMA, optimizer, step, all generator states and the config are written atomically to
``out_dir/checkpoint.pt`` (read back with ``weights_only=True``); restarting the same command
resumes from it and ends bit-identical to an uninterrupted run (same machine and thread count).
``out_dir/train_log.jsonl`` holds one JSON line per ``log_every`` steps (step, mean loss over the
interval and over ranks, lr, cumulative training wall time); ``out_dir/posterior/`` is the final
model (EMA weights when enabled) as safetensors + JSON (:mod:`etweedie.training.checkpoint`), loaded with
:func:`load_posterior`.  A lock on the run directory refuses a second run on it.

**Speed** (GPU): ``precision = "bf16"`` runs the network under bf16 autocast with the energy
score in float32; ``tf32 = true`` allows TF32 matmuls; ``fused_adam`` picks the fused Adam kernel
("auto": on CUDA); ``compile = true`` compiles the forward + loss with ``torch.compile``.  The loss
stays on the device and is read back only at log intervals (NaN/inf is detected there, before any
checkpoint is written).  What still reads back from the GPU each step: the value checks of the
noise constructors used to draw the batch (``Metric.from_params``, the noise laws: a few booleans;
the ops themselves skip such checks on GPU tensors unless ``etweedie.set_debug(True)``), and, in
eager mode, the same checks in the loss (compiled away with ``compile = true``).

**Many processes**: under ``torchrun`` (an initialized ``torch.distributed`` process group) the
step runs with ``DistributedDataParallel``.  Every rank keeps the same four streams (derived
from the one seed), draws the global batch's random numbers and computes its own shard of
B / world_size examples; the gradients are averaged by DDP.  So a step is the same step at every
world size (up to float rounding of the gradient average), the checkpoint (written by rank 0)
resumes at any world size, and the logged loss is the mean over all ranks' examples.

    etweedie train --config configs/eight_gaussians_cpu.toml --out runs/eg_cpu
    torchrun --nproc_per_node=2 -m etweedie train --config configs/eight_gaussians_cpu.toml --out runs/eg_ddp

Example::

    >>> from etweedie.training import load_config, train, load_posterior
    >>> cfg = load_config("configs/eight_gaussians_tiny.toml")
    >>> summary = train(cfg, "runs/tiny", progress=False)          # doctest: +SKIP
    >>> posterior = load_posterior(summary["posterior"])           # doctest: +SKIP
    >>> images = torch.rand(1000, 784, generator=torch.Generator().manual_seed(0)) * 2 - 1   # any (n, d) tensor
    >>> summary = train(cfg, "runs/mine", data=images)             # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch
from tqdm.auto import tqdm

from .._checks import check_bool, check_device, check_float, check_int, require
from ..data.ring import EightGaussians
from ..data.sources import DataSource, EightGaussiansSource, MnistSource, as_data_source
from ..noise import NoiseParams
from ..ops import energy_score
from ..posteriors.engression import EngressionPosterior
from .checkpoint import RunLock, RunLockedError, atomic_torch_save, read_training_checkpoint, restore_training
from .config import MAX_SEED, STREAMS, DataConfig, TrainConfig, _check_geometry, config_to_dict, noise_law, noise_metric
from .optim import EMA, optimize, warmup_cosine
from .posterior_files import (CHECKPOINT_FILE, CHECKPOINT_FORMAT, LEGACY_POSTERIOR_FILE, POSTERIOR_DIR, load_posterior,
                              save_posterior)

__all__ = ["build_data_source", "build_posterior", "gaussian_posterior_check", "held_out_loss", "learning_rate", "train"]

LOG_FILE = "train_log.jsonl"
# Settings that may change between a run and its resumption (they do not alter the trajectory
# up to the checkpoint); everything else must match the checkpoint's config.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "log_every", "threads", "checkpoint_every_s", "max_wall_s",
                     "posterior_dtype", "shard_mb", "compile", "fit_to_deadline")
#: Share of the deadline a fitted schedule plans for (the rest: the last interval's overshoot,
#: the final checkpoint and the posterior files).
FIT_MARGIN = 0.95
#: Examples × draws per backward block of a CPU training step.  A step's loss is a mean over
#: examples, so it is accumulated exactly over blocks of examples; the ε of the whole batch is
#: drawn first (one ``draw_noise`` call, as ``sample`` does), so the random streams do not depend
#: on the blocking.  Blocks keep the W-wide activations in cache: the W256×4 full config's
#: 1,024 × 8-draw step took 0.22 s instead of 0.26 s (steady state, one training process;
#: two trainings sharing this 2-core VM ran at ≈ 0.25 s/step either way; experiments/posterior_quality/RESULTS.md).
#: GPU steps and batches of at most 2× this many rows run whole; None disables blocking.
CPU_TRAIN_ROWS: Optional[int] = 2048


# ---------------------------------------------------------------------------- schedule, model, data, state
def learning_rate(config: TrainConfig, step: int, total: Optional[int] = None) -> float:
    """lr at optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``lr_min`` at
    step ``total`` (default ``config.steps``; a deadline-fitted run passes its fitted count)."""
    step = check_int(step, "step", minimum=0)
    total = config.steps if total is None else check_int(total, "total", minimum=1)
    return warmup_cosine(step, total, config.lr, config.lr_min, config.warmup_steps)


def build_posterior(config: TrainConfig, dim: int = 2) -> torch.nn.Module:
    """The model for ``config`` and data dimension ``dim`` before training: initialized from
    ``config.seed``, or holding the weights of ``config.init`` (which must be the same model)."""
    model = _fresh_posterior(config, dim)
    if config.init:
        start = load_posterior(config.init)
        want = {k: v for k, v in model.config.items() if k != "init_seed"}
        got = {k: v for k, v in getattr(start, "config", {}).items() if k != "init_seed"}
        if type(start) is not type(model) or json.loads(json.dumps(got)) != json.loads(json.dumps(want)):
            diff = sorted(k for k in set(want) | set(got) if json.dumps(want.get(k)) != json.dumps(got.get(k)))
            raise ValueError(f"init: {config.init!r} is not this run's model ({type(start).__name__}; differing "
                             f"model config keys {diff}: [model] and the [prior] ranges must match it)")
        model.load_state_dict(start.state_dict())
    return model


def _fresh_posterior(config: TrainConfig, dim: int) -> torch.nn.Module:
    low, high = config.prior.noise_prior.eta_bounds()
    return config.model.network(dim, eta_low=low, eta_high=high, init_seed=config.seed, **config.model.arguments())


def build_data_source(data: DataConfig, *, held_out: bool = False) -> DataSource:
    """The clean-data source a :class:`DataConfig` names (on the CPU; ``.to(device)`` moves it).

    ``held_out=True`` gives the evaluation data: MNIST's other split (``"test"`` for a
    ``"train"`` run); the eight-Gaussians law itself (held-out draws come from another seed).
    """
    if not isinstance(data, DataConfig):
        raise TypeError(f"data must be a DataConfig (a TrainConfig's .data), got {type(data).__name__}")
    if data.ring is not None:
        return EightGaussiansSource(data.ring)
    from ..data.mnist import load_mnist  # the MNIST reader (needs the data files only for this source)

    split = ("test" if data.split == "train" else "train") if held_out else data.split
    loaded = load_mnist(split, data.data_dir or None)
    images = loaded[0] if isinstance(loaded, (tuple, list)) else loaded
    if isinstance(images, torch.Tensor) and images.is_floating_point():  # a reader returning [0, 1] floats
        images = torch.round(images * 255).clamp(0, 255).to(torch.uint8)
    return MnistSource(images, data.pixel_range, data.dequantize)


def _generators(seed: int, device=None, data_device=None) -> Dict[str, torch.Generator]:
    """Independent streams per purpose: resizing one (e.g. more draws) leaves the others unchanged.
    The model's ε stream lives on the model's device, the data, prior and noise streams on
    ``data_device`` (default the CPU)."""
    return {
        name: torch.Generator(device=device if name == "model" else (data_device or "cpu")).manual_seed(
            seed * 1_000_003 + 7919 * (i + 1))
        for i, name in enumerate(STREAMS)
    }


#: keys added after runs were saved without them, with the value those runs used
_ADDED_KEYS = {
    "loss_beta": "matched", "model.latent": "gaussian", "model.architecture": "EngressionPosterior",
    "model.options": {}, "prior.sigma_law": "log_uniform", "prior.geometry": "block",
    "data.source": "eight_gaussians", "data.data_dir": "", "data.split": "train", "data.pixel_range": [-1.0, 1.0],
    "data.dequantize": True, "precision": "float32", "tf32": False, "compile": False, "fused_adam": "auto",
    "posterior_dtype": "float32", "shard_mb": 16.0, "checkpoint_every_s": 0.0, "max_wall_s": 0.0,
    "model.data_center": 0.0, "model.data_std": 1.0, "model.learn_data_scale": False,
    "init": "", "prior.focus_sigma": [0.5, 6.0], "prior.focus_weight": 0.0,
}


def _config_differences(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "") -> list:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _ADDED_KEYS.get(prefix + key)), current.get(key, _ADDED_KEYS.get(prefix + key))
        if isinstance(a, dict) and isinstance(b, dict) and not (prefix + key).endswith("options"):
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
        except (ValueError, KeyError, TypeError):
            break  # a line cut short by the kill: drop it and everything after
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the training step
def _train_block(batch: int, draws: int, device: torch.device) -> int:
    """Examples per backward block of one training step (the whole batch on GPUs and for small steps)."""
    if CPU_TRAIN_ROWS is None or device.type != "cpu" or batch * draws <= 2 * CPU_TRAIN_ROWS:
        return batch
    return max(1, CPU_TRAIN_ROWS // draws)


def _score_beta(config_loss_beta, params: NoiseParams):
    """The training energy score's β: each example's own (``"matched"``) or the config's number."""
    return params.beta if config_loss_beta == "matched" else float(config_loss_beta)


class _Generate(torch.nn.Module):
    """``generate(y, η, noise)`` of a posterior as a module's forward, so DistributedDataParallel
    and ``torch.compile`` see one call (the ε is drawn outside, for the global batch)."""

    def __init__(self, posterior: torch.nn.Module):
        super().__init__()
        self.posterior = posterior

    def forward(self, y: torch.Tensor, eta: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.posterior.generate(y, eta, noise)


def _block_loss(net, x, y, eta, noise, fields, loss_beta, geometry: str, bf16: bool, mean: bool, batch: int):
    """Energy-score loss of a block of examples: the mean (one block) or the sum / batch (a block
    of a larger step).  The network runs under bf16 autocast when asked; the score in float32."""
    dtype = noise.dtype
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        samples = net(y.to(dtype), eta.to(dtype), noise)
    samples = samples.to(y.dtype)
    params = NoiseParams(*fields)
    score = energy_score(samples, x, beta=_score_beta(loss_beta, params), metric=noise_metric(params, x.shape[-1], geometry))
    return score.mean() if mean else score.sum() / batch


def _loss_and_backward(model, x, y, noise_params: NoiseParams, draws: int, generator, device, loss_beta="matched",
                       *, geometry: str = "block", net=None, shard: Optional[slice] = None, bf16: bool = False,
                       loss_fn: Optional[Callable] = None) -> torch.Tensor:
    """Energy-score loss of one step (mean over the step's examples); accumulates its gradient
    into ``.grad`` and returns the loss as a float64 tensor on the device (no host sync).

    ``x, y, noise_params`` hold the global batch; the ε of the whole global batch is drawn from
    ``generator`` (one ``draw_noise`` call, as ``sample`` does) and ``shard`` picks this rank's
    examples (all by default).  ``net`` is the forward module (``_Generate(model)``, possibly
    DDP-wrapped); ``loss_fn`` a compiled :func:`_block_loss`.  On CPU, large steps run in blocks
    of examples (:data:`CPU_TRAIN_ROWS`); the loss and gradient equal the one-block step's up to
    rounding.
    """
    net = _Generate(model) if net is None else net
    loss_fn = _block_loss if loss_fn is None else loss_fn
    dtype = next(model.parameters()).dtype
    batch_global = y.shape[0]
    noise = model.draw_noise(batch_global, draws, generator, eta=noise_params.eta().expand(batch_global, 5).to(dtype))
    fields = noise_params._tensors()
    if shard is not None:
        x, y, noise = x[shard], y[shard], noise[shard]
        fields = tuple(t[shard] if t.dim() else t for t in fields)
    batch = y.shape[0]
    block = _train_block(batch, draws, device)
    starts = list(range(0, batch, block))
    total = torch.zeros((), dtype=torch.float64, device=y.device)
    for k, i in enumerate(starts):
        part = slice(i, i + block)
        sub = tuple(t[part] if t.dim() else t for t in fields)
        eta = NoiseParams(*sub).eta()
        last = k == len(starts) - 1
        sync = contextlib.nullcontext() if last or not hasattr(net, "no_sync") else net.no_sync()
        with sync:
            loss = loss_fn(net, x[part], y[part], eta, noise[part], sub, loss_beta, geometry, bf16, len(starts) == 1, batch)
            loss.backward()
        total = total + loss.detach().to(torch.float64)
    return total


# ---------------------------------------------------------------------------- distributed helpers
class _Ranks:
    """This process's place in a torch.distributed group (world size 1 without one)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1
        self.main = self.rank == 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist is not None:
            self.dist.all_reduce(t)
        return t

    def agree(self, flag: bool, device) -> bool:
        """True when any rank says True (a collective; every rank must call it)."""
        if self.dist is None:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self.dist.all_reduce(t)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()


def _resolve_device(config: TrainConfig, ranks: _Ranks) -> torch.device:
    """The run's device: ``config.device`` checked by :func:`~etweedie._checks.check_device`
    (CUDA present, the index in range); under ``torchrun`` a bare ``"cuda"`` becomes this
    rank's local GPU."""
    device = check_device(config.device, "device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {config.device!r}")
    if device.type == "cuda" and ranks.world > 1 and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", ranks.rank)) % torch.cuda.device_count())
    return device


# ---------------------------------------------------------------------------- training
def train(
    config: TrainConfig,
    out_dir: Union[str, os.PathLike],
    *,
    data: Union[DataSource, torch.Tensor, Callable, None] = None,
    data_dim: Optional[int] = None,
    resume: bool = True,
    progress: bool = True,
    stop_after: Optional[int] = None,
) -> Dict[str, Any]:
    """Train a conditional Engression posterior with the matched energy score.

    Args:
        config: the run's :class:`TrainConfig`.
        out_dir: run directory (created); holds ``checkpoint.pt``, ``train_log.jsonl``, ``posterior/``.
        data: the clean data: a :class:`~etweedie.data.sources.DataSource`, a tensor of examples
            ``(n, d)`` or a callable ``draw(batch_size, generator) -> (batch_size, d)`` (then
            ``data_dim`` = d); default: the source ``config.data`` names (:func:`build_data_source`).
            A run resumed with other data is not detected: pass the same data.
        resume: continue from ``out_dir/checkpoint.pt`` when present (its config must match
            except for :data:`RESUMABLE_CHANGES`); False starts afresh and overwrites the run
            directory's files.
        progress: show a tqdm progress bar (rank 0 only).
        stop_after: stop (without a final checkpoint or posterior) once this step count is
            reached, as if the process were killed there; for testing resumption.

    Under an initialized ``torch.distributed`` group (``torchrun``) the step runs with
    DistributedDataParallel across the ranks (see the module doc); only rank 0 writes files.

    Returns:
        a dict: ``out_dir``, ``step`` (steps done), ``steps``, ``final_loss`` (mean loss over
        the last log interval), ``wall_time_s`` (cumulative training time over all resumptions),
        ``cpu_time_s`` (process CPU seconds, likewise; on a shared machine the better measure of
        cost), ``resumed_from`` (step or None), ``stopped`` (True when ``stop_after`` or the
        deadline cut the run), ``stopped_by`` (None, ``"stop_after"`` or ``"deadline"``),
        ``world_size``, ``examples_per_s``, ``checkpoint``, ``log``, ``posterior`` (paths;
        ``posterior`` is None when ``stop_after`` cut the run).

    Raises:
        ValueError: a bad config, an unusable ``out_dir`` or device, a checkpoint of another config.
        CheckpointError: a corrupted, truncated or unsafe ``checkpoint.pt``.
        RunLockedError: another run holds ``out_dir``.
        FloatingPointError: the loss became NaN or infinite.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise TypeError(f"out_dir must be a folder path (str or os.PathLike), got {type(out_dir).__name__} {out_dir!r}")
    check_bool(resume, "resume")  # a truthy string such as "no" would otherwise resume
    check_bool(progress, "progress")
    if stop_after is not None:
        check_int(stop_after, "stop_after")
        require(stop_after >= 0, "stop_after", ">= 0", stop_after)
    ranks = _Ranks()
    device = _resolve_device(config, ranks)
    if data is None:
        source = build_data_source(config.data)  # of d = config.data.dim, checked against the geometry with the config
    else:
        source = as_data_source(data, data_dim, dim_name="data_dim")
        _check_geometry(config.prior.geometry, source.dim)
    require(config.batch_size % ranks.world == 0, "batch_size", f"a multiple of the world size {ranks.world}",
             config.batch_size)
    out = Path(out_dir)
    out_error = None
    if ranks.main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            if not os.access(out, os.W_OK):
                raise PermissionError("not writable")
        except OSError as exc:
            out_error = ValueError(f"out_dir {str(out)!r} is not a writable directory ({exc.strerror or exc})")
    # only rank 0 writes, so only rank 0 checks; every rank must learn of its failure before the next
    # collective (otherwise the other ranks die inside it with a gloo/NCCL traceback)
    if ranks.agree(out_error is not None, device):
        raise out_error or ValueError(f"out_dir {str(out)!r} is not a writable directory (reported by rank 0)")
    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    previous_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.tf32
    try:
        lock = RunLock(out) if ranks.main else contextlib.nullcontext()
        locked_error = None
        try:
            lock.__enter__()
        except RunLockedError as exc:
            locked_error = exc
        except OSError as exc:
            raise ValueError(f"out_dir {str(out)!r} is not a writable directory ({exc.strerror or exc})") from None
        if ranks.agree(locked_error is not None, device):
            raise locked_error or RunLockedError(f"another training run is using {str(out)!r}")
        try:
            return _train(config, out, source.to(device), device, ranks, resume, progress, stop_after)
        finally:
            lock.__exit__(None, None, None)
    finally:
        torch.set_num_threads(previous_threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous_tf32


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


def _use_fused_adam(config: TrainConfig, device: torch.device) -> bool:
    return device.type == "cuda" if config.fused_adam == "auto" else bool(config.fused_adam)


def _checked_draw(x, batch: int, d: int, device: torch.device) -> torch.Tensor:
    """A source's batch as training reads it: a float32/float64 ``(batch, d)`` tensor on the run's
    device, else a ValueError/TypeError naming the data (Python-level checks: no device sync)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"data: the source's draw({batch}, generator) must return a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"data: the source's draws must be float32 or float64, got {x.dtype} "
                        f"(convert the examples with .float())")
    if tuple(x.shape) != (batch, d):
        raise ValueError(f"data: the source's draw({batch}, generator) must return shape ({batch}, d={d}), "
                         f"got {tuple(x.shape)}")
    if x.device != device and not (x.device.type == device.type and device.index is None):
        raise ValueError(f"data: the source's draws must be on the run's device {device}, got {x.device} "
                         f"(draw on the generator's device)")
    return x


def _train(config: TrainConfig, out: Path, source: DataSource, device: torch.device, ranks: _Ranks, resume: bool,
           progress: bool, stop_after: Optional[int]) -> Dict[str, Any]:
    run = _Run(config, out, source, device, ranks, stop_after)
    if resume and ranks.agree(ranks.main and run.ckpt_path.exists(), device):
        run.restore()
    elif ranks.main:
        run.clear()
    ranks.barrier()
    return run.run(progress)


class _Run:
    """One invocation of a training run: its model, optimizer, generators and counters, the
    optimizer loop's two callbacks (:meth:`loss_and_grad`, :meth:`after_step`) and its files."""

    def __init__(self, config: TrainConfig, out: Path, source: DataSource, device: torch.device, ranks: _Ranks,
                 stop_after: Optional[int]):
        self.config, self.out, self.source, self.device, self.ranks = config, out, source, device, ranks
        self.ckpt_path, self.log_path, self.post_path = out / CHECKPOINT_FILE, out / LOG_FILE, out / POSTERIOR_DIR
        self.prior = config.prior.noise_prior
        self.model = build_posterior(config, source.dim).to(device)
        self.ema = copy.deepcopy(self.model).requires_grad_(False) if config.ema_decay > 0 else None
        adam_kwargs = {"fused": True} if _use_fused_adam(config, device) else {}
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, **adam_kwargs)
        self.gens = _generators(config.seed, device, data_device=device)
        self.config_dict = config_to_dict(config)
        self.step, self.resumed_from, wall0, cpu0 = 0, None, 0.0, 0.0
        self.interval_count, self.last_logged_loss = 0, float("nan")
        # the interval's loss sum stays on the device; it is read back only at log/checkpoint steps
        self.acc = torch.zeros((), dtype=torch.float64, device=device)
        self.total, self.fitted = config.steps, False  # the schedule's length; fitted to the deadline at most once
        self.stop_after = stop_after
        self.clock = _Clock(wall0, cpu0)
        self.log = None

    # -- the run's files
    def restore(self) -> None:
        """Continue from ``checkpoint.pt`` (the config may differ only in :data:`RESUMABLE_CHANGES`)."""
        ckpt = read_training_checkpoint(self.ckpt_path, CHECKPOINT_FORMAT, lambda saved: [
            diff for diff in _config_differences(saved, self.config_dict) if diff.split(" ")[0] not in RESUMABLE_CHANGES])
        counters = restore_training(ckpt, self.ckpt_path, model=self.model, ema=self.ema, optimizer=self.optimizer,
                                    generators={name: self.gens[name] for name in STREAMS})
        self.step = self.resumed_from = counters["step"]
        self.clock = _Clock(counters["wall_time"], counters["cpu_time"])
        self.acc.fill_(counters["interval_sum"])
        self.interval_count, self.last_logged_loss = counters["interval_count"], counters["last_logged_loss"]
        if self.config.fit_to_deadline and counters["fitted_steps"] is not None:
            self.total, self.fitted = min(counters["fitted_steps"], self.config.steps), True
        if self.ranks.main:
            _rewrite_log(self.log_path, self.step)

    def clear(self) -> None:
        """Start afresh: remove an earlier run's checkpoint, log and posterior."""
        for path in (self.ckpt_path, self.log_path, self.out / LEGACY_POSTERIOR_FILE):
            if path.exists():
                path.unlink()
        if self.post_path.exists():
            shutil.rmtree(self.post_path)

    def save_checkpoint(self, interval_value: float) -> None:
        if not self.ranks.main:
            return
        model, ema = self.model, self.ema
        atomic_torch_save(
            {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "wall_time": self.clock.wall,
                "cpu_time": self.clock.cpu,
                "model": model.state_dict(),
                "model_class": type(model).__name__,
                "model_config": model.config,
                "ema": None if ema is None else ema.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generators": {name: self.gens[name].get_state() for name in STREAMS},
                "interval_sum": interval_value,
                "interval_count": self.interval_count,
                "last_logged_loss": self.last_logged_loss,
                "config": self.config_dict,
                "world_size": self.ranks.world,
                "fitted_steps": self.total if self.fitted else None,
            },
            self.ckpt_path,
        )

    def write_log(self, row: Dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()

    # -- the optimizer loop's callbacks
    def loss_and_grad(self, _: int) -> torch.Tensor:
        config, gens, d = self.config, self.gens, self.source.dim
        # the global batch's random numbers, on the data device (every rank draws them all)
        x = _checked_draw(self.source.draw(config.batch_size, gens["data"]), config.batch_size, d, self.device)
        self.data_finite &= torch.isfinite(x).all()
        noise_params = self.prior.sample(config.batch_size, gens["prior"])
        y = x + noise_law(noise_params, d, config.prior.geometry).sample(generator=gens["noise"])
        return _loss_and_backward(self.model, x, y, noise_params, config.draws, gens["model"], self.device,
                                  config.loss_beta, geometry=config.prior.geometry, net=self.net, shard=self.shard,
                                  bf16=config.precision == "bf16", loss_fn=self.loss_fn)

    def after_step(self, done: int, loss: torch.Tensor) -> bool:
        """Logging, checkpoints, the deadline and the deadline fit; True stops the loop."""
        config, ranks = self.config, self.ranks
        self.step = step = done
        self.acc.add_(loss)
        self.interval_count += 1
        log_now = step % config.log_every == 0 or step == self.total
        ckpt_now = step % config.checkpoint_every == 0 or step == self.total
        if not (log_now or ckpt_now):
            return step >= self.target
        self.clock.tick()
        value = self.reduced_interval()
        if log_now:
            # time-based checkpoints and the deadline are decided by rank 0's clock, at log steps
            wall = self.clock.wall
            want_ckpt = config.checkpoint_every_s > 0 and wall - self.last_ckpt_wall >= config.checkpoint_every_s
            want_stop = config.max_wall_s > 0 and wall - self.start_wall >= config.max_wall_s and step < self.total
            ckpt_now = ranks.agree(ranks.main and want_ckpt, self.device) or ckpt_now
            if ranks.agree(ranks.main and want_stop, self.device):
                self.stopped_by, ckpt_now = "deadline", True
            lr = learning_rate(config, step - 1, self.total)
            self.last_logged_loss = value / self.interval_count
            self.write_log({"step": step, "loss": self.last_logged_loss, "lr": lr, "wall_time": round(wall, 3)})
            self.bar.set_postfix(loss=f"{self.last_logged_loss:.4f}", lr=f"{lr:.2e}")
            self.acc.zero_()
            value, self.interval_count = 0.0, 0
            ckpt_now = self.fit_to_deadline() or ckpt_now
        if ckpt_now:
            self.save_checkpoint(value)
            self.last_ckpt_wall = self.clock.wall
        return self.stopped_by == "deadline" or step >= self.target

    def reduced_interval(self) -> float:
        """The mean over ranks of the interval's loss sums (a collective at deterministic steps);
        a non-finite one stops the run, blaming the data when they drew non-finite examples."""
        value = float(self.ranks.sum_(self.acc.clone()) / self.ranks.world)
        if not math.isfinite(value):
            steps = f"the {self.interval_count} steps up to step {self.step}"
            if not self.ranks.agree(not bool(self.data_finite), self.device):
                raise FloatingPointError(f"training loss became {value} in {steps}; lower lr or raise grad_clip")
            raise ValueError(f"data: the data source drew NaN or infinite examples in {steps} (the training loss "
                             f"became {value}); its examples must be finite")
        return value

    def fit_to_deadline(self) -> bool:
        """At the second log step of a deadline-fitted run, shorten the schedule to the steps that
        end inside FIT_MARGIN of the deadline at the measured s/step (rank 0's measurement, the
        same on every rank); True when it did (the fitted schedule is part of the resumable state)."""
        step, wall = self.step, self.clock.wall
        if self.fit_mark is None:
            self.fit_mark = (step, wall)
            return False
        if not self.fit_mark or step >= self.total or self.stopped_by is not None:
            return False
        per_step = (wall - self.fit_mark[1]) / (step - self.fit_mark[0])
        room = FIT_MARGIN * self.config.max_wall_s - (wall - self.start_wall)
        planned = step + max(int(room / per_step), 0) if per_step > 0 else self.config.steps
        planned = int(self.ranks.sum_(torch.tensor(planned if self.ranks.main else 0, dtype=torch.float64,
                                                   device=self.device)))
        self.total, self.fitted, self.fit_mark = max(min(planned, self.config.steps), step), True, False
        self.target = self.total if self.stop_after is None else min(self.total, self.stop_after)
        self.bar.total = self.total
        self.bar.refresh()
        self.write_log({"step": step, "fitted_steps": self.total, "seconds_per_step": per_step,
                        "wall_time": round(wall, 3)})
        return True

    # -- the invocation
    def run(self, progress: bool) -> Dict[str, Any]:
        config, ranks, device, model = self.config, self.ranks, self.device, self.model
        self.net = _Generate(model)
        if ranks.dist is not None:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.net, device_ids=[device.index] if device.type == "cuda" else None)
        self.loss_fn = torch.compile(_block_loss) if config.compile else _block_loss
        local = config.batch_size // ranks.world
        self.shard = slice(ranks.rank * local, (ranks.rank + 1) * local) if ranks.world > 1 else None
        # whether every example drawn in this invocation was finite (read only when the loss is not:
        # a NaN loss from NaN data is the data's fault, not the learning rate's)
        self.data_finite = torch.ones((), dtype=torch.bool, device=device)
        self.target = self.total if self.stop_after is None else min(self.total, self.stop_after)
        self.clock = _Clock(self.clock.wall, self.clock.cpu)  # setup time is not training time
        self.start_step, self.start_wall = self.step, self.clock.wall
        self.last_ckpt_wall = self.start_wall
        self.stopped_by = "stop_after" if self.step < self.total and self.step >= self.target else None
        # a deadline-fitted schedule times this process's steps between two log steps (the first one
        # may include compilation and warm-up)
        self.fit_mark = None if config.fit_to_deadline and config.max_wall_s > 0 and not self.fitted else False
        self.bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step",
                        disable=not (progress and ranks.main), dynamic_ncols=True)
        model.train()
        self.log = open(self.log_path, "a") if ranks.main else None
        try:
            ema = None if self.ema is None else EMA(self.ema.parameters(), model.parameters(), config.ema_decay)
            optimize(self.optimizer, self.loss_and_grad, start=self.step, stop=self.target, grad_clip=config.grad_clip,
                     lr_at=lambda k: learning_rate(config, k, self.total), ema=ema, bar=self.bar,
                     after_step=self.after_step)
            if self.target <= self.step < self.total:
                self.stopped_by = "stop_after"
        finally:
            self.bar.close()
            if self.log is not None:
                self.log.close()
        self.clock.tick()
        if self.stopped_by != "stop_after" and ranks.main:
            if (self.resumed_from is None or self.resumed_from < self.total
                    or not _posterior_is_current(self.post_path, config, self.step)):
                save_posterior(self.ema if self.ema is not None else model, self.post_path,
                               train_config=self.config_dict, step=self.step, dtype=config.posterior_dtype,
                               shard_mb=config.shard_mb)
        ranks.barrier()
        return self.summary()

    def summary(self) -> Dict[str, Any]:
        trained = self.clock.wall - self.start_wall
        return {
            "out_dir": str(self.out),
            "step": self.step,
            "steps": self.total,
            "fitted_steps": self.total if self.fitted else None,
            "final_loss": self.last_logged_loss,
            "wall_time_s": self.clock.wall,
            "cpu_time_s": self.clock.cpu,
            "resumed_from": self.resumed_from,
            "stopped": self.step < self.total,
            "stopped_by": self.stopped_by,
            "world_size": self.ranks.world,
            "examples_per_s": ((self.step - self.start_step) * self.config.batch_size / trained if trained > 0
                               else float("nan")),
            "checkpoint": str(self.ckpt_path),
            "log": str(self.log_path),
            "posterior": None if self.stopped_by == "stop_after" else str(self.post_path),
        }


# ---------------------------------------------------------------------------- posterior files
def _posterior_is_current(post_path: Path, config: TrainConfig, step: int) -> bool:
    """Whether the posterior a finished run already wrote is intact (it loads, every checksum
    holds) and has this step and this config's storage settings (``posterior_dtype``,
    ``shard_mb``: resumable changes a rerun of the run applies); if not, the rerun rewrites it."""
    try:
        load_posterior(post_path)
        meta = json.loads((post_path / "config.json").read_text())
        saved = meta.get("train_config") or {}
        return (meta.get("step") == step and saved.get("posterior_dtype", "float32") == config.posterior_dtype
                and float(saved.get("shard_mb", 16.0)) == float(config.shard_mb))
    except (OSError, ValueError, TypeError, AttributeError):  # (CheckpointError is a ValueError)
        return False


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def held_out_loss(
    posterior: torch.nn.Module,
    config: TrainConfig,
    *,
    data: Union[DataSource, torch.Tensor, Callable, None] = None,
    data_dim: Optional[int] = None,
    n_examples: int = 4096,
    draws: int = 16,
    seed: int = 12345,
) -> float:
    """Mean matched energy score (the training loss) on a fixed held-out set drawn from the
    held-out data (default: :func:`build_data_source` of ``config.data`` with ``held_out=True``,
    i.e. MNIST's test split; eight Gaussians from this ``seed``) and the config's prior, with
    ``seed`` (independent of the training streams).

    Lower is better; comparable across models trained with the same prior and data config.
    """
    if not isinstance(posterior, torch.nn.Module):
        raise TypeError(f"posterior must be a torch.nn.Module (e.g. from load_posterior), got {type(posterior).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_int(n_examples, "n_examples", minimum=1)
    check_int(draws, "draws", minimum=2)  # the fair energy score's pairwise term needs two draws
    check_int(seed, "seed", minimum=0, maximum=MAX_SEED)
    source = build_data_source(config.data, held_out=True) if data is None else as_data_source(data, data_dim, dim_name="data_dim")
    model_dim = getattr(posterior, "dim", source.dim)
    if source.dim != model_dim:
        raise ValueError(f"data: the held-out data have d = {source.dim} but the posterior draws d = {model_dim}")
    prior = config.prior.noise_prior
    device = next(posterior.parameters()).device
    gens = _generators(seed, device)
    x = source.draw(n_examples, gens["data"])
    x = x.cpu() if isinstance(x, torch.Tensor) else x  # drawn on the CPU (a source may hold GPU data)
    x = _checked_draw(x, n_examples, source.dim, torch.device("cpu"))
    params = prior.sample(n_examples, gens["prior"])
    y = x + noise_law(params, source.dim, config.prior.geometry).sample(generator=gens["noise"])
    x, y = x.to(device), y.to(device)
    params = NoiseParams(*(torch.as_tensor(t).to(device) for t in params._tensors()))
    samples = posterior.sample(y, params.eta(), draws, generator=gens["model"])
    metric = noise_metric(params, source.dim, config.prior.geometry)
    return float(energy_score(samples, x, beta=_score_beta(config.loss_beta, params), metric=metric).mean())


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
    from ..ops import et_score

    if not isinstance(posterior, torch.nn.Module):
        raise TypeError(f"posterior must be a torch.nn.Module (e.g. from load_posterior), got {type(posterior).__name__}")
    if getattr(posterior, "dim", 2) != 2:
        raise ValueError(f"posterior must draw 2-D points (the eight-Gaussians ring), got dim = {posterior.dim}")
    if data is not None and not isinstance(data, EightGaussians):
        raise TypeError(f"data must be an etweedie.data.EightGaussians or None, got {type(data).__name__}")
    try:
        sigmas = [check_float(v, "sigmas", minimum=0, strict=True) for v in sigmas]
    except TypeError:
        raise TypeError(f"sigmas must be a sequence of floats > 0, got {sigmas!r}") from None
    if not sigmas:
        raise ValueError("sigmas must hold at least one noise level, got none")
    check_float(lam, "lam", minimum=0, strict=True)
    check_int(n_queries, "n_queries", minimum=1)
    check_int(n_draws, "n_draws", minimum=1)
    check_int(seed, "seed", minimum=0, maximum=(2**63 - 1) // 7919 - len(sigmas))  # seeds seed·7919 + i
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
