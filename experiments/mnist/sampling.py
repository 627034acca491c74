"""Sampling MNIST images along the five noise paths (paper App. "Energy-Tweedie Diffusion on MNIST").

The protocol of Table mnist_quantitative: one posterior, the five paths of
``etweedie.sample.paths.MNIST_PATHS`` on the shared realized-RMS schedule r_t = 2.63 (0.197/2.63)^t,
annealed Langevin with a long first level, N posterior draws per score, a final posterior draw
at the terminal level, seeds 2718/3141/5772, every image kept.  :data:`FULL` is the paper's
sizes; :data:`CPU` the CPU-scale protocol (fewer levels, updates and draws, 22 images per seed);
:data:`TINY` a smoke size for tests and ``--dry-run``.

The unit of work is one (path, seed) *part*: its images are written at once as uint8
``<path>_seed<seed>.npy`` (n, 28, 28) with ``<path>_seed<seed>.json`` (its protocol, timing,
throughput) and ``<path>_seed<seed>_progress.npy`` (the reverse-chain states of the first nine
chains at the tracked levels, float16, for the progress figure).  The JSON is written last, so
a part with a JSON is complete, and a rerun skips it (resumable per path and seed).

Chain starts: the training-mean image plus a draw of the first level's noise law (β_0, λ_0,
Σ_0 at r_0 = 2.63), :func:`etweedie.sample.initial_states` — the first noisy marginal with the
data collapsed to their mean.  At r_0 = 2.63 the noise carries about 99% of that marginal's
variance (MNIST pixels have a standard deviation of about 0.31 in [0, 1]), so the start
matches the marginal's mean, covariance shape and tails up to the data's own spread, which the
first level's long burn-in supplies.  Pure noise around 0 would start every chain 0.13 per
pixel (the mean ink) off the marginal's mean; that is small against 2.63, but costs nothing
to avoid.  The paper does not say which start it used.

Step sizes: α_k = ε (r_k / r_{L−1})² (:func:`etweedie.sample.step_sizes`) with ε = δ r_{L−1}², so
δ = α_k / r_k² is the same fraction of every level's noise variance (``step_fraction``; one
shared step-size curve for all paths, as in the paper).  For a Gaussian level, Langevin with
step α = δ r² contracts toward the level's posterior mean by (1 − δ) per update and its
stationary variance is r² / (1 − δ/2), so δ sets both the mixing per update and a small
over-dispersion that the final posterior draw removes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from etweedie.sample.paths import MNIST_LEVELS, MNIST_PATHS, MNIST_RMS, get_path, level_times
from etweedie.sample import LevelPlan, ThroughputTimer, sample_langevin, sample_ode, sample_sharded, sample_transport

D = 784
PATHS: Tuple[str, ...] = tuple(MNIST_PATHS)
SEEDS: Tuple[int, ...] = (2718, 3141, 5772)
PROGRESS_CHAINS = 9  # the progress grid's 3×3 chains per cell
PARTS_DIR = "parts"


def is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a plain process: the one that writes files."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def agree(value):
    """Rank 0's ``value`` on every rank (decisions that read the clock must be the same everywhere)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


SAMPLERS = ("langevin", "transport", "ode")


@dataclass(frozen=True)
class Protocol:
    """Sizes and settings of one sampling protocol (every field goes into each part's JSON).

    ``sampler``: ``"langevin"`` (the paper's annealed Langevin: ``first_level_steps``,
    ``steps_per_level``, ``n_posterior``, ``step_fraction``, ``precision``, ``capture``,
    ``antithetic``), ``"transport"`` (:func:`etweedie.sample.sample_transport`: ``warmup``,
    ``gibbs_steps`` at levels with r ≥ ``gibbs_min_rms``, ``mean_draws``) or ``"ode"``
    (:func:`etweedie.sample.sample_ode` with ``solver`` and ``n_posterior``, Gaussian paths
    only).  ``final_average`` is the last level's K draws for every sampler.  ``lead_in``: levels
    prepended at higher noise, from σ = ``lead_in_sigma`` (the top of the posterior's training
    range) down to the path's first level (:meth:`etweedie.sample.LevelPlan.lead_in`); the chains
    start there.
    """

    name: str
    sampler: str = "langevin"
    images_per_seed: int = 256
    levels: int = MNIST_LEVELS
    first_level_steps: int = 1000
    steps_per_level: int = 100
    n_posterior: int = 256
    step_fraction: float = 0.05
    chunk_chains: int = 64
    precision: str = "float32"
    capture: Optional[str] = None
    progress_rows: int = 7
    antithetic: bool = False
    final_average: int = 1
    warmup: int = 0
    gibbs_steps: int = 0
    gibbs_min_rms: float = 0.0
    mean_draws: int = 1
    lead_in: int = 0
    lead_in_sigma: float = 6.0
    solver: str = "dpmpp_2m"
    paths: Tuple[str, ...] = PATHS
    seeds: Tuple[int, ...] = SEEDS

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")

    @property
    def step_scale(self) -> float:
        """ε = δ r_min²: the step at the terminal level."""
        return self.step_fraction * MNIST_RMS.r_min ** 2

    @property
    def updates_per_chain(self) -> int:
        """Langevin updates (langevin) or levels stepped (transport, ode) per chain."""
        if self.sampler == "langevin":
            return self.first_level_steps + (self.levels - 1) * self.steps_per_level
        return self.levels

    @property
    def draws_per_image(self) -> int:
        """Posterior draws one image costs (the final draws included)."""
        if self.sampler == "langevin":
            return self.updates_per_chain * self.n_posterior + self.final_average
        if self.sampler == "ode":
            calls = self.levels - 1 if self.solver == "dpmpp_2m" else 2 * (self.levels - 1) - 1
            return calls * self.n_posterior + self.final_average
        rms = MNIST_RMS(level_times(self.levels))
        gibbs = int((rms[1:] >= self.gibbs_min_rms).sum()) * self.gibbs_steps
        return self.warmup + gibbs + (self.lead_in + self.levels - 1) * self.mean_draws + self.final_average

    def plan(self, path: str) -> LevelPlan:
        """The levels one part samples: the path on ``levels`` levels, after its lead-in."""
        return LevelPlan.build(get_path(path), level_times(self.levels)).lead_in(self.lead_in, self.lead_in_sigma)

    def sampler_kwargs(self, device) -> Dict:
        """The keywords of this protocol's sampler (:func:`etweedie.sample.sample_sharded` passes them on)."""
        if self.sampler == "transport":
            return dict(sampler=sample_transport, warmup=self.warmup, gibbs_steps=self.gibbs_steps,
                        gibbs_min_rms=self.gibbs_min_rms, mean_draws=self.mean_draws, final_average=self.final_average)
        if self.sampler == "ode":
            return dict(sampler=sample_ode, solver=self.solver, n_posterior=self.n_posterior,
                        final_average=self.final_average)
        return dict(sampler=sample_langevin, steps_per_level=self.steps_per_level,
                    first_level_steps=self.first_level_steps, n_posterior=self.n_posterior,
                    step_scale=self.step_scale, precision=self.precision, antithetic=self.antithetic,
                    final_average=self.final_average,
                    capture=self.capture if torch.device(device).type == "cuda" else None)

    def progress_levels(self) -> List[int]:
        """The tracked levels: ``progress_rows`` evenly spaced from the first to the last (matched RMS:
        every path shares the schedule, so a level index is one realized RMS on every path)."""
        rows = min(self.progress_rows, self.levels)
        return sorted({round(i * (self.levels - 1) / max(rows - 1, 1)) for i in range(rows)})

    def describe(self) -> str:
        final = f"final {'draw' if self.final_average == 1 else f'mean of {self.final_average} draws'}"
        seeds = f"{len(self.seeds)} seeds × {self.images_per_seed} images, {self.draws_per_image} posterior draws per image"
        if self.sampler == "transport":
            gibbs = f", {self.gibbs_steps} Gibbs sweeps/level at r ≥ {self.gibbs_min_rms:g}" if self.gibbs_steps else ""
            mean = f", mean of {self.mean_draws} draws per step" if self.mean_draws > 1 else ""
            lead = f"{self.lead_in}-level lead-in from σ = {self.lead_in_sigma:g}, " if self.lead_in else ""
            return (f"noise transport, {lead}{self.levels} levels r 2.63→0.197, {self.warmup} warm-up Gibbs sweeps{gibbs}"
                    f"{mean}, {final}, {seeds}")
        if self.sampler == "ode":
            return f"probability-flow ODE ({self.solver}), {self.levels} levels, N = {self.n_posterior}, {final}, {seeds}"
        return (f"{self.levels} levels r 2.63→0.197, {self.first_level_steps} + {self.steps_per_level} updates/level "
                f"({self.updates_per_chain} per chain), N = {self.n_posterior}"
                f"{' antithetic' if self.antithetic else ''}, δ = {self.step_fraction:g}, "
                f"final {'draw' if self.final_average == 1 else f'mean of {self.final_average} draws'}, "
                f"{len(self.seeds)} seeds × {self.images_per_seed} images")


#: The paper's protocol (GPU): 768 images per path.
FULL = Protocol("full", precision="bfloat16", capture="cuda_graph")
#: CPU scale (2 cores, ≤ 15 minutes with the CPU-scale posterior): 66 images per path.
CPU = Protocol("cpu", images_per_seed=22, levels=16, first_level_steps=40, steps_per_level=10, n_posterior=32,
               step_fraction=0.1, chunk_chains=22, progress_rows=6)
#: The noise-transport protocol (the MNIST default): the paper's 64 levels after a 16-level lead-in
#: from σ = 6, one posterior draw per step, the mean of 16 draws at the last level; 768 images per
#: path at 95 posterior draws per image.
TRANSPORT = Protocol("transport", sampler="transport", lead_in=16, final_average=16)
#: Smoke size (tests, ``--dry-run``).
TINY = Protocol("tiny", images_per_seed=2, levels=3, first_level_steps=2, steps_per_level=1, n_posterior=2,
                step_fraction=0.1, chunk_chains=2, progress_rows=3)
TINY_TRANSPORT = Protocol("tiny_transport", sampler="transport", images_per_seed=2, levels=3, lead_in=2, warmup=1,
                          final_average=2, chunk_chains=2, progress_rows=3)
PROTOCOLS: Dict[str, Protocol] = {p.name: p for p in (FULL, CPU, TINY, TRANSPORT, TINY_TRANSPORT)}


# ---------------------------------------------------------------------------- images
def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Images in [0, 1] (any real values; clipped) → uint8 ``(n, 28, 28)`` (round to nearest)."""
    return (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).reshape(-1, 28, 28).cpu().numpy()


def data_mean(data_dir=None) -> torch.Tensor:
    """The mean training image in [0, 1], ``(784,)`` float32."""
    from etweedie.data import load_mnist

    images, _ = load_mnist("train", data_dir)
    return images.reshape(-1, D).double().mean(0).div(255).float()


def load_posterior(spec: str, device="cpu"):
    """A posterior by name or path (``etweedie.training.load_posterior``), or ``"untrained:WIDTH"`` —
    an untrained 784-d Engression network of that width (dry runs, tests)."""
    if spec.startswith("untrained"):
        from etweedie.posteriors import EngressionPosterior

        width = int(spec.split(":", 1)[1]) if ":" in spec else 64
        model = EngressionPosterior(dim=D, width=width, depth=2, noise_dim=8,
                                    eta_low=(1.3, 0.0, math.log(0.025), -0.7, -0.7),
                                    eta_high=(2.0, math.log(2.5), math.log(6.0), 0.7, 0.7))
        return model.to(device).eval().requires_grad_(False)
    from etweedie.training import load_posterior as load

    return load(spec, device=device)


# ---------------------------------------------------------------------------- one part
def part_stem(path: str, seed: int) -> str:
    return f"{path}_seed{seed}"


def part_done(out_dir: Path, path: str, seed: int) -> bool:
    stem = part_stem(path, seed)
    return (out_dir / f"{stem}.json").is_file() and (out_dir / f"{stem}.npy").is_file()


def _comparable(protocol: Dict) -> Dict:
    return {k: v for k, v in json.loads(json.dumps(protocol)).items() if k not in ("paths", "seeds", "name")}


def posterior_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (first 16 hex digits) of a posterior's weights as loaded (names and float32 values):
    the identity a part records, so that a folder never pools images of two posteriors."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _finished_part(out_dir: Path, stem: str, protocol: Protocol, posterior: Optional[Tuple[str, str]] = None) -> Dict:
    """A finished part's log; ValueError when it was sampled under other settings (a folder holds one
    protocol) or, with ``posterior`` = (name, fingerprint), by another posterior: other weights
    (both fingerprints recorded), or another name where the part predates fingerprints."""
    file = out_dir / f"{stem}.json"
    try:
        log = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a readable part log ({exc}); delete it to sample that part again") from None
    if not isinstance(log, dict) or not isinstance(log.get("protocol"), dict):
        raise ValueError(f"{file} is not a part log (no protocol record); delete it to sample that part again")
    if posterior is not None:
        name, fp = posterior
        saved_name, saved_fp = log.get("posterior", ""), log.get("posterior_sha256", "")
        if (saved_fp and fp and saved_fp != fp) or (not saved_fp and saved_name != name):
            raise ValueError(f"{out_dir / stem}.json was sampled by another posterior ({saved_name!r}, weights "
                             f"{saved_fp or 'unrecorded'}; requested {name!r}, weights {fp}); use another output folder")
    # a setting added after the part was sampled has its default there (e.g. final_average = 1)
    saved = {**{f.name: f.default for f in fields(Protocol) if f.default is not MISSING}, **log["protocol"]}
    if _comparable(saved) != _comparable(asdict(protocol)):
        diff = {k: (v, _comparable(asdict(protocol)).get(k)) for k, v in _comparable(saved).items()
                if _comparable(asdict(protocol)).get(k) != v}
        raise ValueError(f"{out_dir / stem}.json was sampled with other settings (saved, requested): {diff}; "
                         "use another output folder")
    return log


def check_folder(out_dir, protocol: Protocol, posterior: Optional[Tuple[str, str]] = None) -> None:
    """ValueError when a finished part in ``out_dir/parts`` was sampled under other settings, or by
    another posterior than ``posterior`` = (name, :func:`posterior_fingerprint`) when given."""
    parts = Path(out_dir) / PARTS_DIR
    for path in protocol.paths:
        for seed in protocol.seeds:
            if part_done(parts, path, seed):
                _finished_part(parts, part_stem(path, seed), protocol, posterior)


def _save_npy(target: Path, array: np.ndarray) -> None:
    tmp = target.with_name(target.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, target)


def run_part(
    posterior,
    protocol: Protocol,
    path: str,
    seed: int,
    out_dir,
    *,
    center: torch.Tensor,
    device="cpu",
    progress: bool = False,
    posterior_name: str = "",
    posterior_sha256: str = "",
) -> Dict:
    """Sample one (path, seed) part and write its three files; a finished part is read back, not redone.

    Returns the part's log (the JSON's content).  ``posterior_sha256``: the posterior's
    :func:`posterior_fingerprint`, recorded with its name.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = part_stem(path, seed)
    if part_done(out_dir, path, seed):
        return _finished_part(out_dir, stem, protocol, (posterior_name, posterior_sha256) if posterior_sha256 else None)
    plan = protocol.plan(path)
    tracked = [k + protocol.lead_in for k in protocol.progress_levels()]
    rows: Dict[int, torch.Tensor] = {}

    def track(info):
        if info["first_chain"] == 0 and info["level"] in tracked:
            rows[info["level"]] = info["state"][:PROGRESS_CHAINS].float().cpu()

    timer = ThroughputTimer()
    timed = protocol.sampler == "langevin" and torch.device(device).type == "cpu"
    start = time.time()
    x = sample_sharded(
        posterior, plan, None, n_chains=protocol.images_per_seed, dim=D, seed=seed,
        chunk_chains=protocol.chunk_chains, center=center.to(device), device=device, callback=track,
        disable=not progress, **protocol.sampler_kwargs(device), **(dict(timer=timer) if timed else {}),
    )
    wall = time.time() - start
    images = to_uint8(x)
    if not is_main_process():  # the other ranks sampled their share; rank 0 holds the gathered chains
        return dict(path=path, seed=seed, images=int(images.shape[0]), wall_s=wall,
                    images_steps_per_s=protocol.images_per_seed * protocol.updates_per_chain / wall)
    if rows:
        # the same chains as the tracked rows (rank 0's first ones, ≤ 9)
        final = x[: next(iter(rows.values())).shape[0]].float().cpu()
        grid = torch.stack([rows[k] for k in sorted(rows)] + [final])
        _save_npy(out_dir / f"{stem}_progress.npy", grid.to(torch.float16).numpy())
    _save_npy(out_dir / f"{stem}.npy", images)
    chain_updates = protocol.images_per_seed * protocol.updates_per_chain
    log = dict(
        path=path,
        seed=seed,
        images=int(images.shape[0]),
        protocol=asdict(protocol),
        step_scale=protocol.step_scale,
        progress_levels=tracked,
        progress_rms=[float(plan.rms[k]) for k in tracked],
        posterior=posterior_name,
        posterior_sha256=posterior_sha256,
        device=str(device) if torch.device(device).type == "cpu" else torch.cuda.get_device_name(device),
        wall_s=wall,
        images_per_s=protocol.images_per_seed / wall,
        draws_per_image=protocol.draws_per_image,
        images_steps_per_s=chain_updates / wall,
        posterior_draws_per_s=protocol.images_per_seed * protocol.draws_per_image / wall,
        timer=timer.as_dict() if timer.chains else None,
        finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    tmp = out_dir / f"{stem}.json.tmp"
    tmp.write_text(json.dumps(log, indent=1))
    os.replace(tmp, out_dir / f"{stem}.json")
    return log


def pool_path(out_dir, path: str, seeds: Sequence[int]) -> np.ndarray:
    """The pooled images of one path, seeds in the given order: uint8 ``(Σ n_seed, 28, 28)``."""
    out_dir = Path(out_dir)
    return np.concatenate([np.load(out_dir / f"{part_stem(path, s)}.npy") for s in seeds])


def run_protocol(
    posterior,
    protocol: Protocol,
    out_dir,
    *,
    center: torch.Tensor,
    device="cpu",
    progress: bool = False,
    posterior_name: str = "",
    posterior_sha256: str = "",
    deadline: Optional[float] = None,
    log=print,
) -> List[Dict]:
    """Every (path, seed) part in order (paths outer) into ``out_dir/parts``, skipping finished parts;
    then the pooled ``out_dir/<path>.npy`` of every path whose parts are all there.

    ``deadline``: a ``time.time()`` after which no new part starts when the last part's duration
    says it would not finish in time (the parts done stay saved; a rerun continues).
    """
    out_dir = Path(out_dir)
    parts = out_dir / PARTS_DIR
    logs, last_wall = [], None
    for path in protocol.paths:
        for seed in protocol.seeds:
            if part_done(parts, path, seed):
                logs.append(_finished_part(parts, part_stem(path, seed), protocol,
                                           (posterior_name, posterior_sha256) if posterior_sha256 else None))
                log(f"{path} seed {seed}: done earlier, skipped")
                continue
            late = deadline is not None and last_wall is not None and time.time() + 1.1 * last_wall > deadline
            if agree(late):
                log(f"{path} seed {seed}: not started (the deadline is {deadline - time.time():.0f} s away, "
                    f"a part took {last_wall:.0f} s)")
                continue
            part = run_part(posterior, protocol, path, seed, parts, center=center, device=device, progress=progress,
                            posterior_name=posterior_name, posterior_sha256=posterior_sha256)
            last_wall = part["wall_s"]
            logs.append(part)
            log(f"{path} seed {seed}: {part['images']} images in {part['wall_s']:.1f} s "
                f"({part['images_steps_per_s']:.1f} images·steps/s)")
        if all(part_done(parts, path, s) for s in protocol.seeds) and is_main_process():
            _save_npy(out_dir / f"{path}.npy", pool_path(parts, path, protocol.seeds))
    return logs
