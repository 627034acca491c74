"""The full-SPD noise-parameter experiment (paper §5.2, Tabs. param_estimation_SPD and
param_full_spd_family_controls, Fig. full_spd_family_controls).

Eight-Gaussians clean data; generalized-Gaussian noise with truth (β*, λ*, u*, v*) =
(1.4, 1.8, 0.25, 0.35) at three known levels σ ∈ {0.25, 0.45, 0.75}; per level n_est
estimation and n_heldout held-out observations; K posterior draws per observation.  For each
data replicate:

* oracle score: :func:`etweedie.is_score` on a clean *reference* bank with the true noise law
  (also the held-out reference every error is measured against);
* oracle posterior: :func:`etweedie.data.posterior_sample_sir` on an independent clean
  *posterior* bank with the true noise law (independent, so the held-out error is not
  flattered by sharing the reference's bank);
* learned score: a :class:`~etweedie.training.scorematching.ConditionalScoreNet` trained by Hyvärinen
  score matching on fresh noisy observations of the replicate (conditioned on the known σ,
  never on the noise parameters);
* learned posterior: each checkpoint of ``sources.posterior_checkpoints``
  (``etweedie.training.load_posterior``) sampled with η = NoiseParams(β*, λ*, σ, u*, v*).eta(),
  the correctly specified posterior of Prop. plugin_consistency.

Draws and scores are made once per replicate and reused by every family.  Every family ×
score × posterior combination is fitted with :func:`etweedie.estimate.estimate_noise`; the
table reports mean ± std over replicates (× posterior models) of β̂, λ̂, û, v̂, ‖Ŝ − S*‖_F, the
held-out MSE (mean over observations of ‖ŝ − s_ref‖²) and NMSE (pooled over the levels).

Checkpoint and resume (with ``out_dir``): each finished replicate is written to
``out_dir/checkpoints/replicate_<r>.json`` and each trained score's outputs to
``out_dir/checkpoints/learned_score_<r>.pt``, each under a fingerprint of everything it depends
on (config, package version, posterior checkpoint contents).  A rerun into the same directory
reuses every matching piece — an interrupted full run loses at most the replicate in flight, and
a run that only adds sources (the learned-posterior rows, say) skips the score training.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from experiments import _cli
from etweedie import __version__
from etweedie.training import CheckpointError
from etweedie.data import EightGaussians, posterior_sample_sir
from etweedie.estimate import (
    FAMILIES,
    FAMILY_LABELS,
    LEVEL_SCALES,
    EstimatorSettings,
    estimate_noise,
    level_sampler,
    level_variance,
)
from etweedie.geometry import Metric, scale_constant, shape_matrix
from etweedie.noise import GeneralizedGaussian, NoiseParams
from etweedie.ops import is_score
from etweedie.utils import atomic_write, mean_std, substream
from etweedie.score import mean_cosine, score_nmse
from etweedie.training import fit_score

__all__ = [
    "DEFAULT_CONFIG",
    "format_table",
    "load_config",
    "plot_heldout_errors",
    "run_experiment",
    "summarize",
    "validate_config",
]

RESULTS_FILE = "estimate_results.json"
TABLE_FILE = "estimate_table.md"
FIGURE_FILE = "heldout_error.png"

DEFAULT_CONFIG: Dict = {
    "seed": 0,
    "replicates": 5,
    "dtype": "float64",
    "truth": {"beta": 1.4, "lam": 1.8, "u": 0.25, "v": 0.35, "sigmas": [0.25, 0.45, 0.75], "level_scale": "rms"},
    "data": {"n_estimation": 384, "n_heldout": 384, "bank_size": 160_000, "radius": 2.0, "std": 0.2},
    "sources": {
        "score": ["oracle", "learned"],
        "posterior": ["oracle", "learned"],
        "families": list(FAMILIES),
        "posterior_checkpoints": [],
    },
    "estimator": {
        "n_posterior": 256,
        "beta_min": 0.5,
        "lam_min": 1e-3,
        "lam_max": 1e3,
        "steps": 400,
        "batch_size": 256,
        "lr": 0.05,
        "lr_final_fraction": 0.02,
        "optimizer": "adam",
        "beta_init": 1.7,
        "split_half": False,  # EstimatorSettings.split_half: the debiased ‖G‖² term
    },
    "score_net": {
        "method": "exact",
        "train_per_level": 16384,
        "hidden": 128,
        "depth": 3,
        "steps": 3000,
        "batch_size": 512,
        "lr": 2e-3,
        # options of etweedie.training.scorematching.fit_score (these defaults = the original network/trainer)
        "arch": "mlp",
        "parametrization": "direct",
        "n_fourier": 0,
        "fourier_period": 8.0,
        "floor": 0.2,
        "ema": 0.0,
        "lr_final_fraction": 0.05,
        "warmup": 0,
        "val_fraction": 0.0,
        "eval_every": 250,
        "weight_decay": 0.0,
    },
    "learned_posterior": {"chunk": 128},
}


# ---------------------------------------------------------------------------- config
def load_config(path: Optional[str]) -> Dict:
    """DEFAULT_CONFIG updated by the TOML file at ``path`` (tables merge key by key)."""
    config = copy.deepcopy(DEFAULT_CONFIG)
    if path is None:
        return config
    loaded = _cli.read_toml(path)
    for key, value in loaded.items():
        if key not in config:
            raise ValueError(f"{path}: unknown config key {key!r}; expected one of {sorted(config)}")
        if isinstance(config[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"{path}: [{key}] must be a table, got {type(value).__name__}")
            unknown = set(value) - set(config[key])
            if unknown:
                raise ValueError(f"{path}: unknown keys in [{key}]: {sorted(unknown)}; expected {sorted(config[key])}")
            config[key].update(value)
        else:
            config[key] = value
    return config


def validate_config(config: Dict) -> Dict:
    """Check the config's values (raises ValueError naming the key); returns it."""
    def positive_int(value, name, minimum=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    positive_int(config["seed"], "seed", 0)
    positive_int(config["replicates"], "replicates")
    if config["dtype"] not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {config['dtype']!r}")
    truth = config["truth"]
    NoiseParams(truth["beta"], truth["lam"], 1.0, truth["u"], truth["v"])  # validates the tuple
    if not truth["sigmas"] or any(not isinstance(s, (int, float)) or s <= 0 for s in truth["sigmas"]):
        raise ValueError(f"truth.sigmas must be a non-empty list of levels > 0, got {truth['sigmas']!r}")
    for key in ("n_estimation", "n_heldout", "bank_size"):
        positive_int(config["data"][key], f"data.{key}")
    sources = config["sources"]
    for key, allowed in (("score", ("oracle", "learned")), ("posterior", ("oracle", "learned")), ("families", tuple(FAMILIES))):
        if not sources[key] or any(v not in allowed for v in sources[key]):
            raise ValueError(f"sources.{key} must be a non-empty list drawn from {allowed}, got {sources[key]!r}")
    for path in sources["posterior_checkpoints"]:
        if not os.path.exists(path):
            raise ValueError(f"posterior checkpoint {path!r} does not exist")
    EstimatorSettings(**config["estimator"], level_scale=truth["level_scale"])  # validates
    net = config["score_net"]
    if net["method"] not in ("exact", "ssm_vr", "auto"):
        raise ValueError(f"score_net.method must be 'exact', 'ssm_vr' or 'auto', got {net['method']!r}")
    for key in ("train_per_level", "hidden", "depth", "steps", "batch_size"):
        positive_int(net[key], f"score_net.{key}")
    positive_int(config["learned_posterior"]["chunk"], "learned_posterior.chunk")
    return config


# ---------------------------------------------------------------------------- helpers
def _stream(seed: int, *index: int) -> torch.Generator:
    """An independent generator per (replicate, stage): changing one stage leaves the others alone.

    ``etweedie.utils.substream`` over the keys ``index + 1`` (so replicate 0 and stage 0 still
    move the seed; the streams of every recorded run are unchanged)."""
    return substream(seed, *(i + 1 for i in index))


def truth_law(truth: Dict, sigma: float, dtype: torch.dtype) -> GeneralizedGaussian:
    """The true noise law at level σ (d = 2), Σ = level_variance(σ, β*) · S(u*, v*)."""
    beta = torch.tensor(truth["beta"], dtype=dtype)
    scale = level_variance(torch.tensor(float(sigma), dtype=dtype), beta, 2, truth["level_scale"])
    S = shape_matrix(torch.tensor(truth["u"], dtype=dtype), torch.tensor(truth["v"], dtype=dtype))
    return GeneralizedGaussian(beta, torch.tensor(truth["lam"], dtype=dtype), Metric.block(scale * S), dim=2)


def learned_posterior_sampler(model, truth: Dict, chunk: int = 128, antithetic: bool = False):
    """posterior(y, sigma, K, generator) for a learned conditional posterior ``model`` (:func:`etweedie.estimate.level_sampler`).

    ``model.sample(y (..., d), eta (..., 5), n, generator=...) -> (..., n, d)`` with
    η = NoiseParams(β*, λ*, σ, u*, v*).eta(); queries run ``chunk`` at a time in the model's
    dtype, and the draws come back in y's dtype.  ``antithetic=True`` asks the model for
    mirrored-noise draws (:meth:`etweedie.posteriors.engression.EngressionPosterior.sample`).
    """
    def params_at(sigma: float) -> NoiseParams:
        # The posterior is conditioned on the five-parameter tuple of NoiseParams (Σ = (σ/c)² S);
        # under the "plain" convention (Σ = σ² S) the same law has σ_NoiseParams = σ·c_{β,2}.
        level = sigma
        if truth["level_scale"] == "plain":
            level *= float(scale_constant(torch.tensor(float(truth["beta"]), dtype=torch.float64), 2))
        return NoiseParams(truth["beta"], truth["lam"], level, truth["u"], truth["v"])

    return level_sampler(model, params_at, chunk=chunk, antithetic=antithetic)


def _load_posteriors(paths: List[str]):
    if not paths:
        return []
    try:
        from etweedie.training import load_posterior
    except ImportError as exc:  # the learned posterior lives in etweedie.training
        raise RuntimeError(f"learned posterior rows need etweedie.training.load_posterior: {exc}") from exc
    models = []
    for path in paths:
        model = load_posterior(path)
        if hasattr(model, "eval"):
            model.eval()
        models.append(model)
    return models


# ---------------------------------------------------------------------------- one replicate
def replicate_observations(config: Dict, rep: int) -> Dict:
    """The clean banks and noisy observations of one replicate, from its fixed streams:
    ``{"ring", "reference_bank", "posterior_bank", "levels": [{sigma, law, y_est, y_hold}]}``."""
    dtype = getattr(torch, config["dtype"])
    seed, truth, data = config["seed"], config["truth"], config["data"]
    ring = EightGaussians(radius=data["radius"], std=data["std"])
    n_est, n_hold = data["n_estimation"], data["n_heldout"]
    reference_bank, _ = ring.sample(data["bank_size"], _stream(seed, rep, 0), dtype=dtype)
    posterior_bank, _ = ring.sample(data["bank_size"], _stream(seed, rep, 1), dtype=dtype)
    levels = []
    for li, sigma in enumerate(truth["sigmas"]):
        law = truth_law(truth, sigma, dtype)
        g = _stream(seed, rep, 10 + li)
        x, _ = ring.sample(n_est + n_hold, g, dtype=dtype)
        y = x + law.sample((n_est + n_hold,), generator=g)
        levels.append(dict(sigma=float(sigma), law=law, y_est=y[:n_est].contiguous(), y_hold=y[n_est:].contiguous()))
    return {"ring": ring, "reference_bank": reference_bank, "posterior_bank": posterior_bank, "levels": levels}


def make_replicate(config: Dict, rep: int, progress: bool = True) -> Dict:
    """Data, oracle scores and oracle posterior draws of one replicate (all levels)."""
    seed = config["seed"]
    K = config["estimator"]["n_posterior"]
    obs = replicate_observations(config, rep)
    reference_bank, posterior_bank = obs["reference_bank"], obs["posterior_bank"]
    timings = {"oracle_score_estimation": 0.0, "oracle_score_heldout": 0.0, "sir_estimation": 0.0, "sir_heldout": 0.0}
    levels = []
    for li, level in enumerate(obs["levels"]):
        law, y_est, y_hold = level["law"], level["y_est"], level["y_hold"]
        t = time.perf_counter()
        s_est = is_score(y_est, reference_bank, law)[0]
        timings["oracle_score_estimation"] += time.perf_counter() - t
        t = time.perf_counter()
        s_hold = is_score(y_hold, reference_bank, law)[0]
        timings["oracle_score_heldout"] += time.perf_counter() - t
        g = _stream(seed, rep, 20 + li)
        t = time.perf_counter()
        x_est = posterior_sample_sir(y_est, posterior_bank, law, K, g)
        timings["sir_estimation"] += time.perf_counter() - t
        t = time.perf_counter()
        x_hold = posterior_sample_sir(y_hold, posterior_bank, law, K, g)
        timings["sir_heldout"] += time.perf_counter() - t
        levels.append(dict(level, s_est=s_est, s_hold=s_hold, x_est=x_est, x_hold=x_hold))
    return {"levels": levels, "timings": timings, "ring": obs["ring"]}


SCORE_NET_OPTIONS = ("arch", "parametrization", "n_fourier", "fourier_period", "floor", "ema", "lr_final_fraction", "warmup", "val_fraction", "eval_every", "weight_decay")


def learned_score_for(config: Dict, replicate: Dict, rep: int, progress: bool = True, return_model: bool = False):
    """Train the conditional Hyvärinen score of one replicate; returns (scores per level, diagnostics).

    With ``return_model`` the diagnostics also hold the trained score under ``"model"``."""
    dtype = getattr(torch, config["dtype"])
    seed, net_cfg = config["seed"], config["score_net"]
    ring = replicate["ring"]
    train = []
    for li, level in enumerate(replicate["levels"]):
        g = _stream(seed, rep, 30 + li)
        x, _ = ring.sample(net_cfg["train_per_level"], g, dtype=dtype)
        train.append(x + level["law"].sample((net_cfg["train_per_level"],), generator=g))
    sigmas = [lv["sigma"] for lv in replicate["levels"]]
    t = time.perf_counter()
    learned = fit_score(
        train, sigmas, method=net_cfg["method"], hidden=net_cfg["hidden"], depth=net_cfg["depth"],
        steps=net_cfg["steps"], batch_size=net_cfg["batch_size"], lr=net_cfg["lr"],
        generator=_stream(seed, rep, 40), progress=progress,
        **{key: net_cfg[key] for key in SCORE_NET_OPTIONS},
    )
    seconds = time.perf_counter() - t
    scores = [learned(lv["y_est"], lv["sigma"]) for lv in replicate["levels"]]
    s_hold = [learned(lv["y_hold"], lv["sigma"]) for lv in replicate["levels"]]
    ref_est = torch.cat([lv["s_est"] for lv in replicate["levels"]])
    ref_hold = torch.cat([lv["s_hold"] for lv in replicate["levels"]])
    diag = {
        "train_seconds": seconds,
        "nmse_estimation": score_nmse(torch.cat(scores), ref_est),
        "cosine_estimation": mean_cosine(torch.cat(scores), ref_est),
        "nmse_heldout": score_nmse(torch.cat(s_hold), ref_hold),
        "cosine_heldout": mean_cosine(torch.cat(s_hold), ref_hold),
        "final_loss": sum(learned.train_result.losses[-100:]) / min(100, len(learned.train_result.losses)),
        "best_step": learned.train_result.best_step,
    }
    if learned.train_result.val_losses:
        diag["val_loss"] = min(learned.train_result.val_losses)
    if return_model:
        diag["model"] = learned
    return scores, diag


# ---------------------------------------------------------------------------- checkpoints
CHECKPOINT_DIR = "checkpoints"


def _fingerprint(*parts) -> str:
    """sha256 of JSON-serializable parts (sorted keys): the key a checkpoint must match to be reused."""
    return hashlib.sha256(json.dumps([__version__, *parts], sort_keys=True, default=str).encode()).hexdigest()


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _score_fingerprint(config: Dict, rep: int) -> str:
    """Everything one replicate's learned score depends on (not the sources, estimator or posteriors)."""
    keys = ("seed", "dtype", "truth", "data", "score_net")
    return _fingerprint("learned_score", rep, {k: config[k] for k in keys})


def _read_checkpoint(path: Path, key: str, loader):
    """The payload of checkpoint ``path`` if it exists and was written under ``key``; else None."""
    if not path.exists():
        return None
    try:
        payload = loader(path)
    except Exception:  # a torn write from an interrupted run: recompute
        return None
    return payload if isinstance(payload, dict) and payload.get("key") == key else None


def _cached_learned_score(config: Dict, replicate: Dict, rep: int, progress: bool, ckpt_dir: Optional[Path],
                          reuse: bool = True):
    """learned_score_for, checkpointed to ``ckpt_dir/learned_score_<rep>.pt`` and reused (with
    ``reuse``) when its fingerprint matches."""
    if ckpt_dir is None:
        return learned_score_for(config, replicate, rep, progress)
    path, key = ckpt_dir / f"learned_score_{rep}.pt", _score_fingerprint(config, rep)
    cached = _read_checkpoint(path, key, lambda p: torch.load(p, map_location="cpu", weights_only=True)) if reuse else None
    if cached is not None:
        return cached["scores"], {**cached["diag"], "reused_from_checkpoint": True}
    scores, diag = learned_score_for(config, replicate, rep, progress)
    atomic_write(path, lambda p: torch.save({"key": key, "scores": scores, "diag": diag}, p))
    return scores, diag


# ---------------------------------------------------------------------------- the experiment
def run_experiment(
    config: Dict, *, progress: bool = True, out_dir: Optional[str] = None, resume: bool = True
) -> Dict:
    """Run every replicate × source × family fit of ``config``; optionally write outputs to ``out_dir``.

    With ``out_dir`` every finished replicate and every trained score is checkpointed there
    (see the module docstring); ``resume=False`` ignores (and overwrites) existing checkpoints.
    """
    config = validate_config(copy.deepcopy(config))
    truth, sources = config["truth"], config["sources"]
    settings = EstimatorSettings(**config["estimator"], level_scale=truth["level_scale"])
    S_true = shape_matrix(torch.tensor(truth["u"], dtype=torch.float64), torch.tensor(truth["v"], dtype=torch.float64))
    posteriors = _load_posteriors(sources["posterior_checkpoints"]) if "learned" in sources["posterior"] else []
    notes = []
    if "learned" in sources["posterior"] and not posteriors:
        notes.append("learned-posterior rows skipped: no posterior checkpoints given (sources.posterior_checkpoints / --posterior-checkpoint)")
    ckpt_dir = Path(out_dir) / CHECKPOINT_DIR if out_dir is not None else None
    posterior_digests = [_file_digest(p) for p in sources["posterior_checkpoints"]] if posteriors else []
    rows: List[Dict] = []
    replicate_info: List[Dict] = []
    start = time.perf_counter()
    for rep in tqdm(range(config["replicates"]), desc="replicates", disable=not progress):
        rep_key = _fingerprint("replicate", rep, config, posterior_digests)
        rep_path = ckpt_dir / f"replicate_{rep}.json" if ckpt_dir is not None else None
        done = _read_checkpoint(rep_path, rep_key, lambda p: json.loads(p.read_text())) if rep_path is not None and resume else None
        if done is not None:
            rows.extend(done["rows"])
            replicate_info.append({**done["info"], "reused_from_checkpoint": True})
            continue
        n_rows = len(rows)
        t = time.perf_counter()
        replicate = make_replicate(config, rep, progress)
        info = {"replicate": rep, "timings": dict(replicate["timings"]), "data_seconds": time.perf_counter() - t}
        levels = replicate["levels"]
        sigmas = [lv["sigma"] for lv in levels]
        score_sets = {}
        if "oracle" in sources["score"]:
            score_sets["oracle"] = [lv["s_est"] for lv in levels]
        if "learned" in sources["score"]:
            score_sets["learned"], info["learned_score"] = _cached_learned_score(
                config, replicate, rep, progress, ckpt_dir, reuse=resume
            )
        posterior_sets = []
        if "oracle" in sources["posterior"]:
            posterior_sets.append(("oracle", None, [lv["x_est"] for lv in levels], [lv["x_hold"] for lv in levels]))
        for j, model in enumerate(posteriors):
            sampler = learned_posterior_sampler(model, truth, config["learned_posterior"]["chunk"])
            g = _stream(config["seed"], rep, 50 + j)
            t = time.perf_counter()
            x_est = [sampler(lv["y_est"], lv["sigma"], settings.n_posterior, g) for lv in levels]
            info.setdefault("learned_posterior_sampling_seconds", []).append(time.perf_counter() - t)
            x_hold = [sampler(lv["y_hold"], lv["sigma"], settings.n_posterior, g) for lv in levels]
            posterior_sets.append(("learned", j, x_est, x_hold))
        for score_name, scores in score_sets.items():
            for post_name, post_index, x_est, x_hold in posterior_sets:
                for family in sources["families"]:
                    est = estimate_noise(
                        [lv["y_est"] for lv in levels], sigma=sigmas, posterior_samples=x_est, scores=scores,
                        family=family, settings=settings, heldout_observations=[lv["y_hold"] for lv in levels],
                        heldout_reference=[lv["s_hold"] for lv in levels], heldout_posterior_samples=x_hold,
                        generator=_stream(config["seed"], rep, 60), progress=False,
                    )
                    rows.append({
                        "replicate": rep, "family": family, "score": score_name, "posterior": post_name,
                        "posterior_model": post_index, "beta": est.beta, "lam": est.lam,
                        "lam_unprojected": est.lam_unprojected, "u": est.u, "v": est.v,
                        "shape_error": est.shape_error(S_true), "heldout_mse": est.heldout_mse,
                        "heldout_nmse": est.heldout_nmse, "heldout_nmse_per_level": est.heldout_nmse_per_level,
                        "objective": est.objective, "timings": est.timings,
                        "objective_trace_every_10": est.objective_trace[::10],
                    })
        replicate_info.append(info)
        if rep_path is not None:
            payload = {"key": rep_key, "rows": rows[n_rows:], "info": info}
            atomic_write(rep_path, lambda p: p.write_text(json.dumps(payload, default=float)))
    results = {
        "version": __version__,
        "config": config,
        "rows": rows,
        "summary": summarize(rows),
        "replicates": replicate_info,
        "notes": notes,
        "seconds": time.perf_counter() - start,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform()},
    }
    if out_dir is not None:
        write_outputs(results, out_dir)
    return results


def summarize(rows: List[Dict]) -> List[Dict]:
    """Mean and std per (family, score, posterior) over replicates (× posterior models)."""
    keys = []
    for r in rows:
        key = (r["family"], r["score"], r["posterior"])
        if key not in keys:
            keys.append(key)
    family_order = list(FAMILIES)
    keys.sort(key=lambda k: (family_order.index(k[0]), k[2] != "oracle", k[1] != "oracle"))
    out = []
    for family, score, post in keys:
        sel = [r for r in rows if (r["family"], r["score"], r["posterior"]) == (family, score, post)]
        entry = {"family": family, "score": score, "posterior": post, "fits": len(sel)}
        for metric in ("beta", "lam", "u", "v", "shape_error", "heldout_mse", "heldout_nmse"):
            entry[metric], entry[metric + "_std"] = mean_std([r[metric] for r in sel])
        entry["fit_seconds"], _ = mean_std([r["timings"]["fit"] for r in sel])
        out.append(entry)
    return out


def format_table(results: Dict) -> str:
    """The summary as a markdown table (Tab. param_full_spd_family_controls layout)."""
    free = {f: FAMILIES[f] for f in FAMILIES}

    def cell(entry, metric, digits=4, fixed=None):
        if fixed is not None:
            return fixed
        m, s = entry[metric], entry[metric + "_std"]
        if m is None:
            return "—"
        return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"

    lines = [
        "| family | score/posterior | fits | β̂ | λ̂ | û | v̂ | ‖Ŝ−S*‖_F | held-out MSE | NMSE |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results["summary"]:
        fb, fs = free[e["family"]]
        lines.append(
            f"| {FAMILY_LABELS[e['family']]} | {e['score']}/{e['posterior']} | {e['fits']} | "
            f"{cell(e, 'beta', fixed=None if fb else '≡ 2')} | {cell(e, 'lam')} | "
            f"{cell(e, 'u', fixed=None if fs else '≡ 0')} | {cell(e, 'v', fixed=None if fs else '≡ 0')} | "
            f"{cell(e, 'shape_error')} | {cell(e, 'heldout_mse')} | {cell(e, 'heldout_nmse')} |"
        )
    for note in results.get("notes", []):
        lines.append(f"\nnote: {note}")
    return "\n".join(lines)


def plot_heldout_errors(results: Dict, path: str) -> Optional[str]:
    """Held-out MSE (left) and NMSE (right) bars per family and source, log scale; PNG at ``path``.

    Returns the path, or None when matplotlib is not installed (the JSON and table still hold
    every number).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    summary = results["summary"]
    families = [f for f in FAMILIES if any(e["family"] == f for e in summary)]
    combos = []
    for e in summary:
        c = (e["score"], e["posterior"])
        if c not in combos:
            combos.append(c)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(combos))
    for ax, metric, title in ((axes[0], "heldout_mse", "held-out score MSE"), (axes[1], "heldout_nmse", "held-out score NMSE")):
        for ci, combo in enumerate(combos):
            xs, means, stds = [], [], []
            for fi, fam in enumerate(families):
                match = [e for e in summary if e["family"] == fam and (e["score"], e["posterior"]) == combo]
                if match:
                    xs.append(fi + (ci - (len(combos) - 1) / 2) * width)
                    means.append(match[0][metric])
                    std = match[0][metric + "_std"]
                    stds.append(0.0 if std is None else std)  # one fit: no error bar
            ax.bar(xs, means, width, yerr=stds, capsize=2, label=f"{combo[0]} score / {combo[1]} posterior")
        ax.set_yscale("log")
        ax.set_xticks(range(len(families)))
        ax.set_xticklabels([FAMILY_LABELS[f].replace("forced ", "forced\n") for f in families], fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_outputs(results: Dict, out_dir: str) -> None:
    """estimate_results.json, estimate_table.md and heldout_error.png in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figure = plot_heldout_errors(results, str(out / FIGURE_FILE))
    results["figure"] = figure
    with open(out / RESULTS_FILE, "w") as fh:
        json.dump(results, fh, indent=1, default=float)
    with open(out / TABLE_FILE, "w") as fh:
        fh.write(format_table(results) + "\n")


# ---------------------------------------------------------------------------- command line
PROG = "python -m experiments.eight_gaussians.estimation"
CLI_HELP = "noise-parameter estimation on the eight-Gaussians ring (paper §5.2, full-SPD tables)"


def add_cli_arguments(parser) -> None:
    """The command-line arguments."""
    parser.add_argument("--config", metavar="TOML", help="experiment config (configs/estimate_spd.toml, configs/estimate_cpu.toml)")
    parser.add_argument("--out", metavar="DIR", help="write estimate_results.json, estimate_table.md and heldout_error.png here")
    parser.add_argument(
        "--posterior-checkpoint", metavar="PATH", action="append", default=None,
        help="learned posterior checkpoint (etweedie.training.load_posterior); repeat for several trained posteriors",
    )
    parser.add_argument(
        "--score-source", choices=("oracle", "learned"), action="append", default=None,
        help="override sources.score (repeatable), e.g. --score-source oracle",
    )
    parser.add_argument(
        "--posterior-source", choices=("oracle", "learned"), action="append", default=None,
        help="override sources.posterior (repeatable), e.g. --posterior-source learned",
    )
    parser.add_argument(
        "--family", choices=tuple(FAMILIES), action="append", default=None,
        help="override sources.families (repeatable)",
    )
    parser.add_argument(
        "--level-scale", choices=LEVEL_SCALES, default=None,
        help="override truth.level_scale: rms (Σ = (σ/c_{β,d})² S, DESIGN §2) or plain (Σ = σ² S, paper §5.1 text)",
    )
    parser.add_argument("--replicates", type=int, help="override the number of data replicates")
    parser.add_argument("--seed", type=int, help="override the seed")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--no-resume", action="store_true",
        help="recompute every replicate and learned score even where --out holds matching checkpoints",
    )
    parser.add_argument(
        "--split-half", action="store_true",
        help="debias the objective's ‖G‖² term with two halves of the K draws (estimator.split_half = true)",
    )


def check_cli_arguments(args) -> None:
    """The flag values, before any work (raises _cli.UsageError naming the flag)."""
    _cli.at_least("--replicates", args.replicates, 1)
    _cli.at_least("--seed", args.seed, 0)
    _cli.threads("--threads", args.threads)
    _cli.nonempty("--posterior-checkpoint", args.posterior_checkpoint, "a posterior checkpoint")
    for path in args.posterior_checkpoint or ():
        if not os.path.exists(path):
            raise _cli.UsageError(f"--posterior-checkpoint {path}: no such file or folder; expected a posterior checkpoint")


def cli_main(args) -> int:
    """Run the experiment of ``--config`` and write its outputs to ``--out``."""
    config = _cli.read_config("--config", args.config, load_config)
    try:
        if args.replicates is not None:
            config["replicates"] = args.replicates
        if args.seed is not None:
            config["seed"] = args.seed
        if args.posterior_checkpoint:
            config["sources"]["posterior_checkpoints"] = list(args.posterior_checkpoint)
        if args.score_source:
            config["sources"]["score"] = list(dict.fromkeys(args.score_source))
        if args.posterior_source:
            config["sources"]["posterior"] = list(dict.fromkeys(args.posterior_source))
        if args.family:
            config["sources"]["families"] = list(dict.fromkeys(args.family))
        if args.level_scale:
            config["truth"]["level_scale"] = args.level_scale
        if args.split_half:
            config["estimator"]["split_half"] = True
        config = validate_config(config)
    except (OSError, ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        results = run_experiment(
            config, progress=not args.no_progress, out_dir=args.out, resume=not args.no_resume
        )
    except CheckpointError as exc:  # an unreadable or unsafe --posterior-checkpoint
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m experiments.eight_gaussians.estimation [ARGS]``; returns the exit status."""
    return _cli.run(PROG, CLI_HELP, add_cli_arguments, cli_main, argv, check=check_cli_arguments)


if __name__ == "__main__":
    sys.exit(main())
