"""Eight-Gaussians Energy-Tweedie diffusion experiments (paper App. diffusion_full5).

Reproduces, from a TOML config (``configs/diffusion_cpu.toml``, ``configs/diffusion_full.toml``):

* Table full5_diffusion_paths — the four paths (isotropic, nondiagonal, rotating, joint) on one
  realized-RMS schedule (51 levels, r 0.83 → 0.0083), 10 Langevin steps per level, N = 64
  posterior draws, ``n_samples`` final samples per seed; signed ED on a fixed seed-stratified
  subset against an independent clean reference, mode metrics and radial error on all pooled
  samples; plus the independent-clean-draws row (the metrics' own null scale).
* The fixed-parameter isolation table — constant (β, λ, u, v) arms on the 49-level schedule
  r 0.8329 → 0.0100, with the post-burn-in maximum of the marginal-tracking ED.
* Figures: parameter paths, endpoint samples beside clean data, reverse-chain states across
  levels, trajectory ribbons colored by final mode, marginal tracking per level.

Every (table, model, path, seed) run is reproducible from its seed: the chain's generator is
``torch.Generator().manual_seed(seed)`` (common random numbers across paths, so path
differences are paired), and the clean references and tracking clouds come from separate
streams keyed by name.

Posteriors: ``kind = "known"`` (:class:`~etweedie.posteriors.known.KnownPosterior`, no model) or
``kind = "checkpoint"`` with one checkpoint per trained model (``etweedie.training.load_posterior``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import pickle
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

from experiments import _cli
from etweedie.data import EightGaussians
from etweedie.utils import atomic_write, mean_std, substream
from etweedie.posteriors import KnownPosterior
from etweedie.evaluation.metrics import (
    MarginalTracker,
    eight_gaussians_metrics,
    forward_noised,
    min_mode_mass,
    mode_weight_tv,
    mean_radial_error,
    stratified_bootstrap,
    stratified_bootstrap_energy_distance,
    stratified_subset,
)
from etweedie.sample import DEFAULT_LEVELS, ISOLATION_ARMS, MAX_RMS, GeometricRMS, get_path, level_times
from etweedie.sample import ThroughputTimer, sample_langevin
from etweedie.score import posterior_dtype_device

__all__ = [
    "DEFAULT_CONFIG",
    "RESULTS_FILE",
    "format_tables",
    "load_config",
    "override_config",
    "run_diffusion_eval",
    "run_paths_cli",
    "run_table",
]

RESULTS_FILE = "diffusion_results.json"
PROG = "python -m experiments.eight_gaussians.diffusion"
CLI_HELP = "annealed-Langevin sampling of eight Gaussians along noise-parameter paths (paper §5.3): tables, samples, figures"
SCALAR_METRICS = ("signed_ed", "mode_weight_tv", "min_mode_mass", "mean_radial_error")
# interval method per metric (etweedie.evaluation.metrics.stratified_bootstrap; the signed ED's replicates
# are tie-free, stratified_bootstrap_energy_distance); written into each table's JSON
BOOTSTRAP_METHODS = {
    "signed_ed": "percentile",
    "mode_weight_tv": "basic",
    "min_mode_mass": "basic",
    "mean_radial_error": "percentile",
}

DEFAULT_CONFIG: Dict = {
    "data": {"radius": 2.0, "std": 0.2, "n_modes": 8},
    "posterior": {"kind": "known", "checkpoints": [], "method": "auto", "n_proposals": 128, "device": "cpu"},
    "sampler": {
        "steps_per_level": 10,
        "n_posterior": 64,
        "step_scale": 2e-5,
        "first_level_steps": -1,  # -1: same as steps_per_level
        "final_draw": True,
        "init": "gaussian",
        "antithetic": False,  # antithetic posterior draws per score (learned posteriors only)
    },
    "paths": {
        "enabled": True,
        "names": ["isotropic", "nondiagonal", "rotating", "joint"],
        "r_max": 0.83,
        "r_min": 0.0083,
        "n_levels": 51,
        "n_samples": 4096,
        "seeds": [0, 1, 2],
        "ed_subset": 4096,
        "n_reference": 4096,
    },
    "isolation": {
        "enabled": True,
        "names": list(ISOLATION_ARMS),
        "r_max": 0.8329,
        "r_min": 0.0100,
        "n_levels": 49,
        "n_samples": 4096,
        "seeds": [0, 1, 2],
        "ed_subset": 4096,
        "n_reference": 4096,
    },
    "tracking": {"enabled": True, "n_reference": 2048, "max_chains": 2048, "burn_in_levels": 5},
    "bootstrap": {"n_boot": 200, "level": 0.95},
    "figures": {"trajectory_chains": 64, "progress_chains": 1024, "progress_columns": 6},
}

_QUICK = {
    "paths": {"n_samples": 128, "seeds": [0, 1], "ed_subset": 128, "n_reference": 128, "n_levels": 8},
    "isolation": {"names": ["fixed_ref", "fixed_uv0,0"], "n_samples": 128, "seeds": [0, 1], "ed_subset": 128,
                  "n_reference": 128, "n_levels": 8},
    "sampler": {"steps_per_level": 2, "n_posterior": 8, "step_scale": 2e-5},
    "posterior": {"n_proposals": 32},
    "tracking": {"n_reference": 128, "max_chains": 128, "burn_in_levels": 2},
    "bootstrap": {"n_boot": 10},
    "figures": {"trajectory_chains": 16, "progress_chains": 128},
}


# ---------------------------------------------------------------------------- config
def _merge(base: Dict, update: Dict, where: str = "") -> Dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if key not in base:
            raise ValueError(f"config: unknown key {where}{key!r} (known: {', '.join(base)})")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"config: {where}{key} must be a table, got {type(value).__name__}")
            out[key] = _merge(base[key], value, f"{where}{key}.")
        else:
            out[key] = value
    return out


def load_config(path) -> Dict:
    """Read a TOML config and fill in :data:`DEFAULT_CONFIG`; unknown keys raise ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config: no file at {str(path)!r}")
    raw = _cli.read_toml(path)
    config = _merge(DEFAULT_CONFIG, raw)
    config["source"] = str(path)
    _validate(config, need_checkpoints=False)  # --checkpoint may supply them (override_config checks again)
    return config


def _validate(config: Dict, need_checkpoints: bool = True) -> None:
    kind = config["posterior"]["kind"]
    if kind not in ("known", "checkpoint"):
        raise ValueError(f"config: posterior.kind must be 'known' or 'checkpoint', got {kind!r}")
    if need_checkpoints and kind == "checkpoint" and not config["posterior"]["checkpoints"]:
        raise ValueError("config: posterior.kind = 'checkpoint' needs posterior.checkpoints (or --checkpoint PATH)")
    try:
        device = torch.device(config["posterior"]["device"])
    except (RuntimeError, TypeError):
        raise ValueError(f"config: posterior.device must be a torch device such as 'cpu' or 'cuda', "
                         f"got {config['posterior']['device']!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested, but CUDA is not available here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'no'})")
    if kind == "known" and device.type != "cpu":
        # the known posterior's draws, and so the chains, live on the CPU: a recorded GPU device would be false
        raise ValueError(f"device {device} applies to trained posteriors (--checkpoint); the known posterior runs on the CPU")
    if config["sampler"]["init"] not in ("gaussian", "marginal"):
        raise ValueError(f"config: sampler.init must be 'gaussian' or 'marginal', got {config['sampler']['init']!r}")
    if not isinstance(config["sampler"]["antithetic"], bool):
        raise TypeError(f"config: sampler.antithetic must be true or false, got {config['sampler']['antithetic']!r}")
    if config["sampler"]["antithetic"] and kind == "known":
        raise ValueError("config: sampler.antithetic needs a learned posterior (posterior.kind = 'checkpoint'); "
                         "the known posterior's draws have no noise to mirror")
    for table in ("paths", "isolation"):
        t = config[table]
        for name in t["names"]:
            get_path(name)
        if not t["seeds"]:
            raise ValueError(f"config: {table}.seeds must be a non-empty list")
        if t["ed_subset"] > t["n_samples"] * len(t["seeds"]):
            raise ValueError(f"config: {table}.ed_subset must be <= n_samples × seeds, got {t['ed_subset']}")


def override_config(config: Dict, args) -> Dict:
    """Apply the command-line flags (--checkpoint, --posterior, --device, --quick, and the sampler flags
    given: --steps-per-level, --first-level-steps, --n-posterior, --step-scale, --init, --no-final-draw,
    --known-method, --n-proposals) to a config."""
    config = copy.deepcopy(config)
    if getattr(args, "checkpoint", None):
        config["posterior"]["kind"] = "checkpoint"
        config["posterior"]["checkpoints"] = list(args.checkpoint)
    if getattr(args, "posterior", None) in ("known", "checkpoint"):
        config["posterior"]["kind"] = args.posterior  # "checkpoint" without checkpoints is refused below
    if getattr(args, "device", None):
        config["posterior"]["device"] = args.device
    if getattr(args, "antithetic", False):
        config["sampler"]["antithetic"] = True
    if getattr(args, "quick", False):
        for section, values in _QUICK.items():
            config[section].update(values)
    for flag, section, key in (
        ("steps_per_level", "sampler", "steps_per_level"), ("first_level_steps", "sampler", "first_level_steps"),
        ("n_posterior", "sampler", "n_posterior"), ("step_scale", "sampler", "step_scale"), ("init", "sampler", "init"),
        ("known_method", "posterior", "method"), ("n_proposals", "posterior", "n_proposals"),
    ):
        if getattr(args, flag, None) is not None:
            config[section][key] = getattr(args, flag)
    if getattr(args, "no_final_draw", False):
        config["sampler"]["final_draw"] = False
    _validate(config)
    return config


# ---------------------------------------------------------------------------- helpers
def _stream(*keys) -> torch.Generator:
    """A generator seeded from a name (reference clouds, tracking): independent of the chains' seeds."""
    return substream(0, keys)


def _ring(config: Dict) -> EightGaussians:
    d = config["data"]
    return EightGaussians(radius=float(d["radius"]), std=float(d["std"]), n_modes=int(d["n_modes"]))


def build_posteriors(config: Dict) -> Dict[str, object]:
    """Name -> posterior: ``{"known": KnownPosterior}`` or one loaded model per checkpoint."""
    p = config["posterior"]
    if p["kind"] == "known":
        return {"known": KnownPosterior(_ring(config), method=p["method"], n_proposals=int(p["n_proposals"]))}
    from etweedie.training import load_posterior  # the learned model (needs the training module only here)

    return {name: load_posterior(path, device=p["device"]) for name, path in zip(posterior_names(config), p["checkpoints"])}


def posterior_names(config: Dict) -> List[str]:
    """The table's model names (``"known"``, or ``model<i>:<last two parts of the checkpoint path>``)."""
    p = config["posterior"]
    if p["kind"] == "known":
        return ["known"]
    return [f"model{i}:{'/'.join(Path(path).parts[-2:])}" for i, path in enumerate(p["checkpoints"])]


def initial_state(ring: EightGaussians, params0, n: int, init: str, generator: torch.Generator) -> torch.Tensor:
    """Chain starts ``(n, 2)``: ``"gaussian"`` N(0, s² I) with s² = E‖x‖²/2 + r_0² (the first marginal's
    per-coordinate second moment), or ``"marginal"`` forward-noised clean draws (the exact first marginal)."""
    if init == "gaussian":
        r0 = float(params0.realized_rms())
        s = math.sqrt(ring.radius**2 / 2 + ring.std**2 + r0**2)
        return s * torch.randn(n, 2, generator=generator)
    clean, _ = ring.sample(n, generator)
    return forward_noised(clean, params0, generator)


def posterior_device(posterior) -> torch.device:
    """Where a posterior's draws live: a model's parameter device, else the CPU (e.g. the known posterior)."""
    _, device = posterior_dtype_device(posterior)
    return torch.device("cpu") if device is None else device


class _Recorder:
    """Callback keeping the states of the first chains at every level (progress and ribbon figures)."""

    def __init__(self, n_chains: int):
        self.n = n_chains
        self.states: List[torch.Tensor] = []
        self.r: List[float] = []

    def __call__(self, info: Dict) -> None:
        self.states.append(info["state"][: self.n].cpu())  # .cpu() copies a device tensor; the sampler's is a copy already
        self.r.append(info["r"])


# ---------------------------------------------------------------------------- one table
def run_table(
    table: str,
    names: Sequence[str],
    posteriors: Dict[str, object],
    config: Dict,
    *,
    progress: bool = True,
    sample_dir: Optional[Path] = None,
    saved: Optional[Sequence[Path]] = None,
    resume: bool = True,
) -> Dict:
    """Sample every (model, path, seed) of one table and compute its metrics.

    Returns a dict with ``rows`` (per path: per-model metrics, mean/sd across models,
    bootstrap intervals, tracking curves), ``clean`` (the independent-clean-draws row),
    ``timing`` and the figure inputs under ``_figure``.

    With ``saved`` (folders holding the ``samples/*.pt`` of earlier runs of the same config and
    models) nothing is sampled: each run's final samples are read back and scored exactly as
    after sampling (same references, subsets and bootstrap streams), so a run whose sampling
    finished elsewhere (a GPU) is scored here.  The per-run tracking records and each model's
    first-run figure states are read back too where they were saved beside the samples; timings
    exist only for runs sampled in this call.

    With ``sample_dir``, every finished run leaves ``<stem>.pt`` (final samples), its tracking
    records, for the first run of a model its figure states, and last ``<stem>.run.json``: the
    run's fingerprint (table, path, seed, model weights digest, data, sampler, schedule, sizes,
    tracking).  With ``resume`` a run whose files and matching fingerprint are already there is
    read back instead of sampled, so an interrupted table restarts at its first unfinished run
    and scores as if run in one go (the samples depend only on the seed).  A stale fingerprint
    is removed before its run is sampled again.  Timings count the runs sampled in this call.
    """
    ring = _ring(config)
    tc, sc = config[table], config["sampler"]
    rms = GeometricRMS(float(tc["r_max"]), float(tc["r_min"]))
    times = level_times(int(tc["n_levels"]))
    seeds = [int(s) for s in tc["seeds"]]
    n = int(tc["n_samples"])
    track = config["tracking"]
    boot = config["bootstrap"]
    first = None if int(sc["first_level_steps"]) < 0 else int(sc["first_level_steps"])
    draw_clean = lambda k, g: ring.sample(k, g)[0]  # noqa: E731
    rows: Dict[str, Dict] = {name: {"per_model": {}, "description": get_path(name).description} for name in names}
    figure = {"final": {}, "trajectories": {}, "progress": {}, "tracking": {}}
    table_timer = ThroughputTimer()
    t_start = time.perf_counter()
    n_runs, run_index, n_resumed = len(posteriors) * len(names) * len(seeds), 0, 0
    for mi, (model_name, posterior) in enumerate(posteriors.items()):
        digest = _weights_digest(posterior) if saved is None else None
        device = posterior_device(posterior)
        reference = draw_clean(int(tc["n_reference"]), _stream("reference", table, mi))
        for name in names:
            path = get_path(name, rms=rms)
            params0 = path(times[:1])
            params0 = type(params0)(*(f[0] for f in torch.broadcast_tensors(*params0._tensors())))
            groups, per_run, trackers = [], [], []
            timer = ThroughputTimer()
            for si, seed in enumerate(seeds):
                run_index += 1
                if saved is not None:
                    stem = f"{table}_{_slug(model_name)}_{name}_seed{seed}"
                    x = _load_saved(saved, stem, n)
                    records = _load_saved_tracking(saved, stem) if track["enabled"] else None
                    if records is not None:
                        trackers.append(SimpleNamespace(records=records))
                    groups.append(x)
                    per_run.append(eight_gaussians_metrics(x, None, ring))
                    if si == 0 and mi == 0:
                        figure["final"][name] = x
                        states = _load_saved_states(saved, stem)  # the progress and trajectory figures
                        if states is not None:
                            _figure_states(figure, name, states["states"], states["r"], x, config)
                    continue
                stem = None if sample_dir is None else sample_dir / f"{table}_{_slug(model_name)}_{name}_seed{seed}"
                fingerprint = _run_fingerprint(config, table, name, seed, model_name, digest, figures=mi == 0 and si == 0)
                done = _finished_run(stem, fingerprint, n) if resume and stem is not None else None
                if done is not None:
                    x, records, states = done
                    n_resumed += 1
                    if progress:
                        print(f"[{table}] {model_name} / {name} / seed {seed}  ({run_index}/{n_runs}): "
                              f"finished earlier, read from {stem}.pt", flush=True)
                    if records is not None:
                        trackers.append(SimpleNamespace(records=records))
                    groups.append(x)
                    per_run.append(eight_gaussians_metrics(x, None, ring))
                    if states is not None:
                        _figure_states(figure, name, states["states"], states["r"], x, config)
                    continue
                if stem is not None:
                    Path(f"{stem}.run.json").unlink(missing_ok=True)  # the files below no longer match it
                g = torch.Generator().manual_seed(seed)
                y0 = initial_state(ring, params0, n, sc["init"], g)
                if device.type != "cpu":  # same starts; the chain's own stream on the posterior's device
                    y0, g = y0.to(device), torch.Generator(device=device).manual_seed(seed)
                callbacks = []
                if track["enabled"]:
                    tracker = MarginalTracker(
                        draw_clean, int(track["n_reference"]), _stream("tracking", table, mi, name, seed),
                        max_chains=int(track["max_chains"]),
                    )
                    trackers.append(tracker)
                    callbacks.append(tracker)
                recorder = None
                if mi == 0 and si == 0:
                    recorder = _Recorder(int(config["figures"]["progress_chains"]))
                    callbacks.append(recorder)
                if progress:
                    print(f"[{table}] {model_name} / {name} / seed {seed}  ({run_index}/{n_runs})", flush=True)
                x = sample_langevin(
                    posterior, y0, path, times,
                    steps_per_level=int(sc["steps_per_level"]), n_posterior=int(sc["n_posterior"]),
                    step_scale=float(sc["step_scale"]), first_level_steps=first, final_draw=bool(sc["final_draw"]),
                    generator=g, callback=(lambda info: [cb(info) for cb in callbacks]) if callbacks else None,
                    disable=not progress, timer=timer, antithetic=bool(sc["antithetic"]),
                ).float().cpu()
                groups.append(x)
                per_run.append(eight_gaussians_metrics(x, None, ring))
                if stem is not None:
                    _save_samples(stem, x)
                    if track["enabled"]:  # per run, so a scoring pass (--from-samples) can rebuild the curves
                        _write_json({"records": trackers[-1].records}, Path(f"{stem}.tracking.json"))
                    if recorder is not None:
                        torch.save(dict(states=torch.stack(recorder.states), r=list(recorder.r)), f"{stem}.states.pt")
                    _write_json(fingerprint, Path(f"{stem}.run.json"))  # last: marks the run finished
                if recorder is not None:
                    _figure_states(figure, name, torch.stack(recorder.states), recorder.r, x, config)
            table_timer = _add_timer(table_timer, timer)
            pooled = torch.cat(groups)
            ed_subset = stratified_subset(groups, int(tc["ed_subset"]))
            metrics = eight_gaussians_metrics(pooled, reference, ring, ed_samples=ed_subset)
            metrics["modes_present_min_run"] = min(r["modes_present"] for r in per_run)
            metrics["per_seed"] = [{k: r[k] for k in ("mode_weight_tv", "min_mode_mass", "modes_present", "mean_radial_error")} for r in per_run]
            metrics["timing"] = timer.as_dict() if saved is None and timer.chains else None
            if int(boot["n_boot"]) >= 2:
                metrics["bootstrap"] = _bootstrap(
                    groups, int(tc["ed_subset"]), reference, ring, boot, (table, mi, name), device=device
                )
            if trackers and len(trackers) == len(seeds):
                curve = _mean_curve(trackers)
                metrics["tracking"] = curve
                burn = min(int(track["burn_in_levels"]), curve[-1]["level"])  # short schedules: at least the last level
                metrics["tracking_max_after_burn_in"] = max(c["signed_ed"] for c in curve if c["level"] >= burn)
                figure["tracking"].setdefault(name, []).append(curve)
            rows[name]["per_model"][model_name] = metrics
    # independent clean draws of the same sizes: the metrics' null scale
    clean_row = {"per_model": {}, "description": "Independent clean draws"}
    for mi, model_name in enumerate(posteriors):
        reference = draw_clean(int(tc["n_reference"]), _stream("reference", table, mi))
        groups = [draw_clean(n, _stream("clean", table, mi, seed)) for seed in seeds]
        pooled = torch.cat(groups)
        metrics = eight_gaussians_metrics(pooled, reference, ring, ed_samples=stratified_subset(groups, int(tc["ed_subset"])))
        if int(boot["n_boot"]) >= 2:
            metrics["bootstrap"] = _bootstrap(
                groups, int(tc["ed_subset"]), reference, ring, boot, (table, mi, "clean"),
                device=posterior_device(posteriors[model_name]),
            )
        clean_row["per_model"][model_name] = metrics
        figure.setdefault("clean", pooled)
    for row in list(rows.values()) + [clean_row]:
        row["summary"] = _summarize(row["per_model"])
    return dict(
        table=table,
        names=list(names),
        schedule=dict(r_max=rms.r_max, r_min=rms.r_min, n_levels=int(tc["n_levels"])),
        seeds=seeds,
        n_samples=n,
        rows=rows,
        clean=clean_row,
        bootstrap_methods=dict(BOOTSTRAP_METHODS),
        timing=table_timer.as_dict() if saved is None and n_resumed < n_runs else None,
        resumed_runs=n_resumed,
        rescored_from=None if saved is None else [str(p) for p in saved],
        wall_s=time.perf_counter() - t_start,
        _figure=figure,
    )


def _figure_states(figure: Dict, name: str, states: torch.Tensor, r, x: torch.Tensor, config: Dict) -> None:
    """Record the first run's per-level states for the progress and trajectory figures."""
    k = int(config["figures"]["trajectory_chains"])
    figure["progress"][name] = dict(states=states, r=list(r))
    figure["trajectories"][name] = dict(states=states[:, :k], final=x[:k])
    figure["final"][name] = x


def _weights_digest(posterior) -> Optional[str]:
    """SHA-256 of a model posterior's state dict (None for a posterior without one, e.g. the known one)."""
    state_dict = getattr(posterior, "state_dict", None)
    if not callable(state_dict):
        return None
    h = hashlib.sha256()
    for key, value in sorted(state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _run_fingerprint(config: Dict, table: str, name: str, seed: int, model_name: str, digest: Optional[str], *,
                     figures: bool) -> Dict:
    """Everything one run's samples depend on (see :func:`run_table`, ``resume``)."""
    tc, post, track = config[table], config["posterior"], config["tracking"]
    return dict(
        table=table, path=name, seed=int(seed), model=model_name, weights_sha256=digest,
        posterior=dict(kind=post["kind"], **({"method": post["method"], "n_proposals": int(post["n_proposals"])}
                                              if post["kind"] == "known" else {})),
        data={k: config["data"][k] for k in ("radius", "std", "n_modes")},
        sampler=dict(config["sampler"]),
        schedule=dict(r_max=float(tc["r_max"]), r_min=float(tc["r_min"]), n_levels=int(tc["n_levels"])),
        n_samples=int(tc["n_samples"]),
        tracking=({k: int(track[k]) for k in ("n_reference", "max_chains")} if track["enabled"] else None),
        figure_chains=int(config["figures"]["progress_chains"]) if figures else None,
    )


def _finished_run(stem: Path, fingerprint: Dict, n: int):
    """``(samples, tracking records or None, figure states or None)`` of a finished run whose saved
    fingerprint equals ``fingerprint`` and whose files are all there; else None."""
    marker = Path(f"{stem}.run.json")
    if not marker.is_file():
        return None
    try:
        if json.loads(marker.read_text()) != _jsonable(fingerprint):
            return None
        x = _read_samples(Path(f"{stem}.pt"), n)
        records = states = None
        if fingerprint["tracking"] is not None:
            records = json.loads(Path(f"{stem}.tracking.json").read_text())["records"]
        if fingerprint["figure_chains"] is not None:
            states = torch.load(f"{stem}.states.pt", map_location="cpu", weights_only=True)
    except (OSError, EOFError, ValueError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError,
            struct.error):  # missing or damaged (struct.error: a short file torch.load reads as legacy): sample again
        return None
    return x, records, states


def _saved_file(folders: Sequence[Path], name: str) -> Optional[Path]:
    """``samples/<name>`` in the first of ``folders`` that has it, or None."""
    for folder in folders:
        path = Path(folder) / "samples" / name
        if path.is_file():
            return path
    return None


def _load_saved(folders: Sequence[Path], stem: str, n: int) -> torch.Tensor:
    """The ``samples/<stem>.pt`` of an earlier run, from the first folder that has it."""
    path = _saved_file(folders, f"{stem}.pt")
    if path is not None:
        return _read_samples(path, n)
    raise FileNotFoundError(
        f"no saved samples {stem}.pt under {', '.join(str(Path(f) / 'samples') for f in folders)} "
        "(--from-samples needs the same config, checkpoints and seeds as the run that saved them)"
    )


def _read_samples(path: Path, n: int) -> torch.Tensor:
    """One run's saved ``(n, 2)`` final samples (ValueError for anything else)."""
    x = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != (n, 2):
        raise ValueError(f"{path}: expected a ({n}, 2) tensor of final samples, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.float()


def _load_saved_tracking(folders: Sequence[Path], stem: str) -> Optional[List[Dict]]:
    """The per-level tracking records saved beside ``samples/<stem>.pt``, or None (older runs)."""
    path = _saved_file(folders, f"{stem}.tracking.json")
    return None if path is None else json.loads(path.read_text())["records"]


def _load_saved_states(folders: Sequence[Path], stem: str) -> Optional[Dict]:
    """The per-level chain states a model's first run saved for the figures (``<stem>.states.pt``), or
    None (runs sampled without figures, or before these files existed)."""
    path = _saved_file(folders, f"{stem}.states.pt")
    if path is None:
        return None
    states = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(states, dict) and isinstance(states.get("states"), torch.Tensor) and states["states"].dim() == 3
            and len(states.get("r", ())) == states["states"].shape[0]):
        raise ValueError(f"{path}: expected dict(states=(levels, chains, 2) tensor, r=list of levels), got {type(states).__name__}")
    return states


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _save_samples(stem: Path, x: torch.Tensor) -> None:
    import numpy as np

    torch.save(x.clone(), str(stem) + ".pt")
    np.savez_compressed(str(stem) + ".npz", samples=x.numpy())


def _add_timer(total: ThroughputTimer, part: ThroughputTimer) -> ThroughputTimer:
    for key in ("posterior_s", "step_s", "callback_s", "total_s", "chain_steps", "posterior_calls", "chains", "levels"):
        setattr(total, key, getattr(total, key) + getattr(part, key))
    return total


def _mean_curve(trackers: Sequence[MarginalTracker]) -> List[Dict]:
    curve = []
    for k, rec in enumerate(trackers[0].records):
        values = [t.records[k]["signed_ed"] for t in trackers]
        mean, sd = mean_std(values)
        sd = math.nan if sd is None else sd  # one seed: no spread (null in the JSON)
        curve.append(dict(level=rec["level"], t=rec["t"], r=rec["r"], signed_ed=mean, sd_across_seeds=sd))
    return curve


def _bootstrap(groups, ed_subset: int, reference, ring: EightGaussians, boot: Dict, key, device=None) -> Dict:
    """Seed-stratified bootstrap intervals for the four endpoint metrics.

    Signed ED (tie-free replicates) and mean radial error (a mean) get percentile intervals;
    mode-weight TV and minimum mode mass, plug-in statistics biased at these sizes, get basic
    intervals clipped to their ranges (:func:`etweedie.evaluation.metrics.stratified_bootstrap`).  The
    signed-ED resamples (``n_boot`` energy distances of ``ed_subset`` points each) run on
    ``device`` when given (a GPU computes them with the fused ``energy_distance`` kernel); the
    resampling indices and the other metrics stay on the CPU, so the intervals do not depend on it.
    """
    means = ring.means(torch.float64)
    g = _stream("bootstrap", *key)
    n_boot, level = int(boot["n_boot"]), float(boot["level"])
    take = [ed_subset // len(groups) + (1 if i < ed_subset % len(groups) else 0) for i in range(len(groups))]
    out = {}
    ed_device = torch.device("cpu") if device is None else torch.device(device)
    ed_reference = reference.to(ed_device)
    _, lo, hi = stratified_bootstrap_energy_distance(
        [x[:k].to(ed_device) for x, k in zip(groups, take)], ed_reference, n_boot=n_boot, generator=g, level=level,
    )
    out["signed_ed"] = [lo, hi]
    k = ring.n_modes
    for name, fn, bounds in (
        ("mode_weight_tv", lambda x: mode_weight_tv(x.double(), means), (0.0, 1.0 - 1.0 / k)),
        ("min_mode_mass", lambda x: min_mode_mass(x.double(), means), (0.0, 1.0 / k)),
        ("mean_radial_error", lambda x: mean_radial_error(x, ring.radius), None),
    ):
        _, lo, hi = stratified_bootstrap(
            fn, list(groups), n_boot=n_boot, generator=g, level=level, method=BOOTSTRAP_METHODS[name], bounds=bounds
        )
        out[name] = [lo, hi]
    return out


def _summarize(per_model: Dict[str, Dict]) -> Dict:
    summary = {}
    keys = list(SCALAR_METRICS) + ["tracking_max_after_burn_in"]
    for key in keys:
        values = [m[key] for m in per_model.values() if m.get(key) is not None]
        if values:
            mean, sd = mean_std(values)
            sd = math.nan if sd is None else sd  # one model: no spread (null in the JSON)
            summary[key] = dict(mean=mean, sd=sd, n_models=len(values))
    present = [m.get("modes_present_min_run", m["modes_present"]) for m in per_model.values()]
    summary["modes_present_min"] = min(present)
    return summary


# ---------------------------------------------------------------------------- entry points
def run_diffusion_eval(
    config: Dict, *, out_dir=None, progress: bool = True, figures: bool = True, saved: Optional[Sequence] = None,
    resume: bool = True,
) -> Dict:
    """Run the enabled tables of a config; write JSON, samples and figures to ``out_dir`` when given.

    ``saved``: score the final samples saved by earlier runs in these folders instead of
    sampling (see :func:`run_table`); the posteriors are not loaded then.  ``resume``: read back
    the runs an interrupted call of the same config already finished in ``out_dir`` (see
    :func:`run_table`) instead of sampling them again.
    """
    _validate(config)
    out = None if out_dir is None else Path(out_dir)
    sample_dir = None
    if saved is not None:
        saved = [Path(f) for f in saved]
    elif out is not None:
        sample_dir = out / "samples"
        sample_dir.mkdir(parents=True, exist_ok=True)
    posteriors = build_posteriors(config) if saved is None else {name: None for name in posterior_names(config)}
    results = dict(config=config, posteriors=list(posteriors), tables={}, torch_threads=torch.get_num_threads())
    start = time.perf_counter()
    for table in ("paths", "isolation"):
        if saved is not None and config[table]["enabled"] and not any(
            next((Path(f) / "samples").glob(f"{table}_*.pt"), None) is not None for f in saved
        ):
            print(f"note: no saved {table} samples under the --from-samples folders; the {table} table is skipped")
            continue
        if config[table]["enabled"]:
            results["tables"][table] = run_table(
                table, config[table]["names"], posteriors, config, progress=progress, sample_dir=sample_dir, saved=saved,
                resume=resume,
            )
    results["wall_s"] = time.perf_counter() - start
    if out is not None:
        if figures:
            from .diffusion_figures import write_figures

            results["figures"] = write_figures(results, _ring(config), out)
        _write_json(results, out / RESULTS_FILE)
    return results


def run_paths_cli(args) -> Dict:
    """``--path ...``: the given paths as one table (config defaults + flags)."""
    config = copy.deepcopy(DEFAULT_CONFIG)
    config["source"] = "command line"
    names = list(args.path)
    first = get_path(names[0])
    levels = args.levels if args.levels is not None else DEFAULT_LEVELS[names[0]]
    t0, t1 = torch.tensor([0.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    r_max = args.r_max if args.r_max is not None else float(first.rms(t0))
    r_min = args.r_min if args.r_min is not None else float(first.rms(t1))
    n = 4096 if args.chains is None else args.chains
    n_seeds, seed = (1 if args.seeds is None else args.seeds), (0 if args.seed is None else args.seed)
    config["paths"].update(
        names=names, r_max=r_max, r_min=r_min, n_levels=levels, n_samples=n,
        seeds=[seed + i for i in range(n_seeds)], ed_subset=n, n_reference=n,
    )
    if not r_min < r_max:  # GeometricRMS's own message would name its fields, not the flags
        raise _cli.UsageError(f"--r-min must be below --r-max (the RMS falls from --r-max to --r-min), got --r-max {r_max:g}"
                              f"{'' if args.r_max is not None else ' (the path default)'}, --r-min {r_min:g}"
                              f"{'' if args.r_min is not None else ' (the path default)'}")
    config["isolation"]["enabled"] = False
    config["tracking"].update(n_reference=min(n, 2048), max_chains=min(n, 2048))
    if n_seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {n_seeds}")
    if args.posterior is None and not args.checkpoint:
        raise ValueError("give --checkpoint PATH (a trained posterior) or --posterior known")
    config = override_config(config, args)
    return run_diffusion_eval(config, out_dir=args.out, progress=not args.no_progress, figures=not args.no_figures,
                              resume=not getattr(args, "no_resume", False))


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if k != "_figure"}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_json(results: Dict, path: Path) -> None:
    atomic_write(path, json.dumps(_jsonable(results), indent=1))


def _fmt(stat: Optional[Dict], digits: int) -> str:
    if stat is None:
        return "—"
    if stat["n_models"] > 1 and math.isfinite(stat["sd"]):
        return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}"


def format_tables(results: Dict) -> str:
    """Markdown tables: per path, mean ± sd across models (one model: the value) and bootstrap CIs."""
    lines = []
    for table, res in results["tables"].items():
        title = "Table full5_diffusion_paths" if table == "paths" else "Fixed-parameter isolation"
        sched = res["schedule"]
        lines.append(
            f"{title}: {len(res['seeds'])} seeds × {res['n_samples']} samples, {sched['n_levels']} levels "
            f"r {sched['r_max']:g} → {sched['r_min']:g}, models: {', '.join(results['posteriors'])}"
        )
        lines.append("")
        lines.append("| path | signed ED | mode-weight TV | min mode mass | mean radial error | modes present (min run) | max tracking ED |")
        lines.append("|---|---|---|---|---|---|---|")
        for name, row in list(res["rows"].items()) + [("clean", res["clean"])]:
            s = row["summary"]
            lines.append(
                f"| {row['description'] if name != 'clean' else 'Independent clean draws'} | {_fmt(s.get('signed_ed'), 4)} | "
                f"{_fmt(s.get('mode_weight_tv'), 3)} | {_fmt(s.get('min_mode_mass'), 3)} | "
                f"{_fmt(s.get('mean_radial_error'), 3)} | {s['modes_present_min']} | {_fmt(s.get('tracking_max_after_burn_in'), 4)} |"
            )
        first_model = results["posteriors"][0]
        cis = []
        for name, row in list(res["rows"].items()) + [("clean", res["clean"])]:
            b = row["per_model"][first_model].get("bootstrap")
            if b:
                cis.append(
                    f"{name}: ED [{b['signed_ed'][0]:.4f}, {b['signed_ed'][1]:.4f}], TV [{b['mode_weight_tv'][0]:.3f}, "
                    f"{b['mode_weight_tv'][1]:.3f}], min mass [{b['min_mode_mass'][0]:.3f}, {b['min_mode_mass'][1]:.3f}]"
                )
        if cis:
            lines.append("")
            level = float(results["config"]["bootstrap"]["level"])
            methods = res.get("bootstrap_methods") or {}
            how = ", ".join(f"{k} {v}" for k, v in methods.items() if k != "mean_radial_error")
            lines.append(f"seed-stratified bootstrap {100 * level:g}% intervals ({first_model}"
                         + (f"; {how}" if how else "") + "): " + "; ".join(cis))
        t = res["timing"]
        lines.append("")
        resumed = int(res.get("resumed_runs") or 0)
        if t is None:
            source = (f"scored from the saved samples of {', '.join(res['rescored_from'])}" if res.get("rescored_from")
                      else f"all runs ({resumed}) read back from an earlier call (--no-resume samples them again)")
            lines.append(f"{source} (no timings; tracking curves from the saved per-run records where present); "
                         f"wall time {res['wall_s']:.1f} s")
            lines.append("")
            continue
        lines.append(
            f"throughput: {t['chain_steps_per_s']:.0f} chain·steps/s over {t['sampling_s']:.1f} s of sampling "
            f"(posterior {100 * t['posterior_share']:.0f}%, score+step kernel {100 * t['score_step_share']:.0f}%, "
            f"rest {100 * t['rest_share']:.0f}%; tracking callbacks {t['callback_s']:.1f} s apart); "
            f"table wall time {res['wall_s']:.1f} s"
            + (f"; {resumed} runs read back from an earlier call, not timed" if resumed else "")
        )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line
def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line arguments (a single-path run with ``--path``, the paper's tables with ``--config``)."""
    from etweedie.sample import path_names

    src = parser.add_argument_group("posterior (one of)")
    src.add_argument("--checkpoint", action="append", metavar="PATH",
                     help="learned posterior checkpoint (etweedie.training.load_posterior); repeat for several trained models")
    src.add_argument("--posterior", choices=("known", "checkpoint"), default=None,
                     help="'known': the exact/importance posterior of the eight-Gaussians ring (no model)")
    parser.add_argument("--config", metavar="TOML",
                        help="run the paper's diffusion tables from a config (configs/diffusion_cpu.toml, diffusion_full.toml)")
    parser.add_argument("--path", nargs="+", metavar="NAME", choices=path_names(),
                        help=f"path(s) to sample: {', '.join(path_names())}")
    parser.add_argument("--seeds", type=int, default=None, help="number of sampling seeds (seed, seed+1, ...; default 1)")
    parser.add_argument("--seed", type=int, default=None, help="first sampling seed (default 0)")
    parser.add_argument("--chains", type=int, default=None, help="chains (final samples) per seed (default 4096)")
    parser.add_argument("--levels", type=int, help="number of levels (default: the path's, e.g. 51)")
    parser.add_argument("--r-max", type=float, help="first-level realized RMS (default: the path's)")
    parser.add_argument("--r-min", type=float, help="terminal realized RMS (default: the path's)")
    parser.add_argument("--steps-per-level", type=int, default=None,
                        help="Langevin updates per level (default 10; with --config, overrides the TOML's)")
    parser.add_argument("--first-level-steps", type=int, help="updates at the first level (default: steps-per-level)")
    parser.add_argument("--n-posterior", type=int, default=None,
                        help="posterior draws per score evaluation N (default 64; with --config, overrides the TOML's)")
    parser.add_argument("--antithetic", action="store_true",
                        help="learned posterior: antithetic draws for every score (unbiased, less Monte Carlo noise)")
    parser.add_argument("--step-scale", type=float, default=None, help="ε: terminal step; α_k = ε (r_k/r_L)² (default 2e-5)")
    parser.add_argument("--init", choices=("gaussian", "marginal"), default=None,
                        help="initial states: moment-matched Gaussian (default) or the exact first noisy marginal")
    parser.add_argument("--no-final-draw", action="store_true", help="return the chain states, not a final posterior draw")
    parser.add_argument("--known-method", choices=("auto", "exact", "importance"), default=None,
                        help="known posterior: exact for β = 2, importance resampling otherwise (default auto)")
    parser.add_argument("--n-proposals", type=int, default=None, help="known posterior: proposals per query (default 128)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--out", metavar="DIR", help="output directory (metrics JSON, samples .pt/.npz, figures)")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    parser.add_argument("--quick", action="store_true", help="with --config: shrink every size for a smoke run")
    parser.add_argument("--from-samples", action="append", metavar="DIR",
                        help="with --config: score the final samples an earlier run of the same config and "
                             "--checkpoint list saved under DIR/samples (repeatable) instead of sampling")
    parser.add_argument("--no-resume", action="store_true",
                        help="with --out: sample every run again, even those an interrupted call of the same config "
                             "already finished there (default: read those back)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def check_cli_arguments(args: argparse.Namespace) -> None:
    """The flag values, before any work (raises _cli.UsageError naming the flag)."""
    for flag, low in (("seeds", 1), ("seed", 0), ("chains", 1), ("levels", 1), ("steps_per_level", 1),
                      ("first_level_steps", 0), ("n_posterior", 1), ("n_proposals", 1)):
        _cli.at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), low)
    for flag in ("r_max", "r_min", "step_scale"):
        _cli.positive(f"--{flag.replace('_', '-')}", getattr(args, flag, None))
    for flag in ("r_max", "r_min"):
        _cli.at_most(f"--{flag.replace('_', '-')}", getattr(args, flag, None), MAX_RMS)
    _cli.nonempty("--checkpoint", args.checkpoint, "a posterior checkpoint")
    for path in args.checkpoint or ():
        if not Path(path).exists():
            raise _cli.UsageError(f"--checkpoint {path}: no such file or folder; expected a trained posterior "
                                  "(run directory, posterior/ folder or checkpoint)")
    _cli.nonempty("--from-samples", getattr(args, "from_samples", None), "a folder of an earlier run")
    _cli.nonempty("--config", args.config, "a TOML file")
    _cli.device("--device", args.device)


def cli_main(args: argparse.Namespace) -> int:
    """Run the parsed command line: a single-path run (``--path``) or the paper's tables (``--config``)."""
    if (args.config is None) == (args.path is None):
        return _error("give exactly one of --config TOML (the paper's tables) or --path NAME [NAME ...]")
    if args.posterior == "known" and args.checkpoint:
        return _error("--posterior known and --checkpoint exclude each other")
    if getattr(args, "from_samples", None) and args.config is None:
        return _error("--from-samples needs --config (the config the samples were drawn with)")
    if getattr(args, "quick", False) and args.config is None:  # it would override --chains/--levels/--seeds
        return _error("--quick shrinks a --config run; with --path set --chains, --levels and --seeds yourself")
    for folder in getattr(args, "from_samples", None) or ():
        if not (Path(folder) / "samples").is_dir():
            return _error(f"--from-samples {folder}: no samples/ folder there (an earlier run's --out holds one)")
    if args.config is not None:
        for flag in ("seeds", "seed", "chains", "levels", "r_max", "r_min"):
            if getattr(args, flag, None) is not None:
                return _error(f"--{flag.replace('_', '-')} sets a --path run's table; with --config set it in the "
                              "TOML's [paths] / [isolation] sections")
    try:
        if args.config is not None:
            config = _cli.read_config("--config", args.config, load_config)
            config = override_config(config, args)
            results = run_diffusion_eval(
                config, out_dir=args.out, progress=not args.no_progress, figures=not args.no_figures,
                saved=getattr(args, "from_samples", None), resume=not args.no_resume,
            )
            print(format_tables(results))
        else:
            results = run_paths_cli(args)
            print(format_tables(results))
    except _cli.UsageError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return _error(str(exc))
    if args.out:
        print(f"results written to {Path(args.out) / RESULTS_FILE}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m experiments.eight_gaussians.diffusion [ARGS]``; returns the exit status."""
    return _cli.run(PROG, CLI_HELP, add_cli_arguments, cli_main, argv, check=check_cli_arguments)


if __name__ == "__main__":
    sys.exit(main())
