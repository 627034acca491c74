"""Score-accuracy evaluation of trained posteriors on eight Gaussians (paper §5.1 and App. score).

Reproduces, for one or more posterior models (two independently trained ones in the paper):

* **Table score_full5_accuracy** — five one-parameter sweeps of the noise tuple
  (β, λ, σ, u, v) around the base (1.4, 1.8, 0.57, 0, 0.6); the u row sets v = 0 and the v row
  u = 0 (paper App. diffusion_full5).  At each sweep value, ``n_queries`` noisy queries
  y = x + u are drawn (x from the ring, u from that value's generalized-Gaussian law) and,
  against the importance-sampling reference on a 160,000-point clean bank,

      score NMSE        E‖ŝ − s_ref‖² / E‖s_ref‖²            (ŝ: Energy-Tweedie, N draws)
      score cosine      mean over queries of cos(ŝ, s_ref)
      posterior-mean MSE  mean over queries and coordinates of (x̄ − E_ref[X|y])²  (x̄: the same N draws)
      ref. disagreement NMSE between the references of the two independent bank halves.

  A sweep's entry is the mean of these over its values; the table gives mean ± std (sample
  std, ddof = 1) over the models.
* **Table score_mc_budget** — NMSE and cosine on the queries of one sweep (``mc_budget.sweep``,
  the β sweep by default: its N = 64 row then estimates the β row of the table) for
  N ∈ {1, 2, 4, …, 256} (budget N: the first N of one set of 256 draws), ``repetitions`` fresh
  draw sets per model, and the least-squares fit
  NMSE ≈ a + b/N (paper Eq. score_mc_error_decomposition) pooled over models and repetitions
  and per model.
* **Score across σ** — NMSE and cosine over a σ grid for Gaussian noise (β = 2, λ = 1,
  u = v = 0; reference = the analytic noisy score) and the generalized base tuple (reference =
  IS), with the reference disagreement (gray where it exceeds 0.01).
* **Richardson clean score** — at clean points x of the ring, ŝ_RE from every adjacent pair
  of a σ grid (paper Eq. richardson_extrapolation) against the analytic clean score ∇log p,
  as MSE of ŝ_RE and of each single level; the same for the exact noisy scores (analytic for
  Gaussian noise, IS otherwise) to separate the O(ε₁²ε₂²) bias from the model's error.
* **Figures** (matplotlib, Agg): score-field streamplots for the sweeps (direction of ŝ, color
  = log₁₀‖ŝ‖), cosine/NMSE across σ, NMSE vs N with the fit, Richardson vs analytic clean field.

Everything goes to a run directory: ``score_eval.json`` and the PNGs.

    python -m experiments.eight_gaussians.score_eval --checkpoint runs/a --checkpoint runs/b \\
        --config configs/score_eval_cpu.toml --out runs/score_eval_cpu
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from tqdm.auto import tqdm

from experiments import _cli
from etweedie import __version__, backends
from etweedie.data import EightGaussians
from etweedie.noise import NoiseParams
from etweedie.score import (
    EnergyTweedieScore,
    ISOracle,
    fit_mc_budget,
    mean_cosine,
    posterior_mean_mse,
    richardson,
    richardson_score,
    score_from_draws,
    score_nmse,
)
from etweedie.utils import atomic_write, mean_std, substream

__all__ = [
    "BASE",
    "GAUSSIAN",
    "PARAMETERS",
    "PARTS",
    "ScoreEvalConfig",
    "format_mc_budget_table",
    "format_richardson_table",
    "format_sweep_table",
    "load_config",
    "run_score_eval",
    "sweep_params",
    "write_figures",
]

PARAMETERS = ("beta", "lam", "sigma", "u", "v")
SYMBOLS = {"beta": "β", "lam": "λ", "sigma": "σ", "u": "u", "v": "v"}
# Base tuple of the paper's sweeps and Gaussian isotropic noise (λ = 1 lies in the training prior).
BASE = {"beta": 1.4, "lam": 1.8, "sigma": 0.57, "u": 0.0, "v": 0.6}
GAUSSIAN = {"beta": 2.0, "lam": 1.0, "u": 0.0, "v": 0.0}
PARTS = ("sweeps", "mc_budget", "sigma_profile", "richardson", "fields")
RESULTS_FILE = "score_eval.json"
# The paper's Table score_full5_accuracy (NMSE, cosine) and Table score_mc_budget fit.
PAPER = {
    "nmse": {"beta": 0.050, "lam": 0.039, "sigma": 0.077, "u": 0.037, "v": 0.029},
    "cosine": {"beta": 0.971, "lam": 0.975, "sigma": 0.951, "u": 0.977, "v": 0.982},
    "mc_floor_a": 0.023,
    "mc_slope_b": 1.41,
}
REFERENCE_FLOOR = 0.01  # reference disagreement above this marks an inaccurate reference (paper Fig. score_alignment)


# ---------------------------------------------------------------------------- configuration
def _default_sweeps() -> Dict[str, List[float]]:
    return {
        "beta": [1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0],
        "lam": [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.25, 2.5],
        "sigma": [0.1, 0.13, 0.17, 0.23, 0.3, 0.4, 0.57, 0.75],
        "u": [-0.6, -0.4, -0.2, 0.0, 0.2, 0.4, 0.6],
        "v": [-0.6, -0.4, -0.2, 0.0, 0.2, 0.4, 0.6],
    }


def _default_field_values() -> Dict[str, List[float]]:
    return {
        "beta": [1.3, 1.5, 1.75, 2.0],
        "lam": [1.0, 1.4, 1.8, 2.5],
        "sigma": [0.13, 0.32, 0.57, 0.75],
        "u": [-0.6, -0.2, 0.2, 0.6],
        "v": [-0.6, -0.2, 0.2, 0.6],
    }


@dataclass
class ScoreEvalConfig:
    """Sizes and grids of a score evaluation (TOML: top-level keys plus the sections below).

    Top level: ``seed``, ``dtype`` ("float32"/"float64"), ``n_queries`` (per sweep value),
    ``n_draws`` (N for the tables), ``bank_size`` (IS bank, 160,000 in the paper), ``chunk``
    (queries per posterior call; 0 = all), ``parts`` (subset of ``PARTS``), ``antithetic``
    (antithetic posterior draws for every learned score, :class:`etweedie.score.EnergyTweedieScore`;
    the paper's protocol is independent draws, the default).
    ``[base]``: the base tuple.  ``[sweeps]``: parameter → values (any subset of β, λ, σ, u, v).
    ``[mc_budget]``: ``n_draws`` (list), ``repetitions``, ``sweep``, ``n_queries`` (the first
    that many of each sweep value's queries; 0 = all).
    ``[sigma_profile]``: ``sigmas``.  ``[richardson]``: ``sigmas`` (adjacent pairs are tried),
    ``n_queries``, ``n_draws``.  ``[fields]``: ``grid`` (points per side), ``extent`` (half
    width), ``n_draws``, ``density`` (streamline density), ``values`` (parameter → list, one
    panel each).
    """

    seed: int = 0
    dtype: str = "float32"
    n_queries: int = 512
    n_draws: int = 64
    bank_size: int = 160_000
    chunk: int = 0
    antithetic: bool = False
    parts: List[str] = field(default_factory=lambda: list(PARTS))
    base: Dict[str, float] = field(default_factory=lambda: dict(BASE))
    sweeps: Dict[str, List[float]] = field(default_factory=_default_sweeps)
    mc_n_draws: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    mc_repetitions: int = 5
    mc_n_queries: int = 0
    mc_sweep: str = "beta"
    profile_sigmas: List[float] = field(default_factory=lambda: [0.1, 0.13, 0.17, 0.23, 0.3, 0.4, 0.57, 0.75])
    richardson_sigmas: List[float] = field(default_factory=lambda: [0.1, 0.13, 0.17, 0.23])
    richardson_n_queries: int = 1024
    richardson_n_draws: int = 256
    field_grid: int = 40
    field_extent: float = 3.2
    field_n_draws: int = 64
    field_density: float = 0.8
    field_values: Dict[str, List[float]] = field(default_factory=_default_field_values)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "float64": torch.float64}[self.dtype]

    def validate(self) -> "ScoreEvalConfig":
        """Raise ValueError/TypeError naming the first bad field; returns self."""
        for name in ("seed", "n_queries", "n_draws", "bank_size", "chunk", "mc_repetitions", "mc_n_queries",
                     "richardson_n_queries", "richardson_n_draws", "field_grid", "field_n_draws"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            minimum = {"seed": 0, "chunk": 0, "mc_n_queries": 0, "bank_size": 4, "field_grid": 4}.get(name, 1)
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if not isinstance(self.antithetic, bool):
            raise TypeError(f"antithetic must be a bool, got {type(self.antithetic).__name__} {self.antithetic!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown:
            raise ValueError(f"parts must be a subset of {list(PARTS)}, got unknown {unknown}")
        if set(self.base) != set(PARAMETERS):
            raise ValueError(f"base must give exactly {list(PARAMETERS)}, got {sorted(self.base)}")
        NoiseParams(*(float(self.base[p]) for p in PARAMETERS))  # range checks
        for section, grids in (("sweeps", self.sweeps), ("fields.values", self.field_values)):
            for name, values in grids.items():
                if name not in PARAMETERS:
                    raise ValueError(f"{section} keys must be among {list(PARAMETERS)}, got {name!r}")
                _check_floats(values, f"{section}.{name}")
                for value in values:
                    sweep_params(self.base, name, value)  # each value must give a valid tuple
        if "mc_budget" in self.parts and self.mc_sweep not in self.sweeps:
            raise ValueError(f"mc_budget.sweep must name one of the sweeps {sorted(self.sweeps)}, got {self.mc_sweep!r}")
        if self.mc_n_draws:
            for n in self.mc_n_draws:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"mc_budget.n_draws must be positive ints, got {self.mc_n_draws!r}")
            if len(set(self.mc_n_draws)) < 2:
                raise ValueError(f"mc_budget.n_draws needs at least two budgets for the a + b/N fit, got {self.mc_n_draws!r}")
        _check_floats(self.profile_sigmas, "sigma_profile.sigmas", positive=True)
        _check_floats(self.richardson_sigmas, "richardson.sigmas", positive=True)
        if "richardson" in self.parts and len(set(self.richardson_sigmas)) < 2:
            raise ValueError(f"richardson.sigmas needs at least two distinct values, got {self.richardson_sigmas!r}")
        for name in ("field_extent", "field_density"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name.replace('field_', 'fields.')} must be a positive number, got {value!r}")
        return self


def _check_floats(values, name: str, positive: bool = False) -> None:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must hold finite numbers, got {value!r}")
        if positive and value <= 0:
            raise ValueError(f"{name} must hold numbers > 0, got {value!r}")


_SECTIONS = {
    "base": {k: k for k in PARAMETERS},
    "mc_budget": {"n_draws": "mc_n_draws", "repetitions": "mc_repetitions", "sweep": "mc_sweep",
                  "n_queries": "mc_n_queries"},
    "sigma_profile": {"sigmas": "profile_sigmas"},
    "richardson": {"sigmas": "richardson_sigmas", "n_queries": "richardson_n_queries", "n_draws": "richardson_n_draws"},
    "fields": {"grid": "field_grid", "extent": "field_extent", "n_draws": "field_n_draws", "values": "field_values",
               "density": "field_density"},
}
_TOP = ("seed", "dtype", "n_queries", "n_draws", "bank_size", "chunk", "antithetic", "parts")


def config_from_dict(values: Dict[str, Any], *, source: str = "config") -> ScoreEvalConfig:
    """A :class:`ScoreEvalConfig` from the TOML layout (unknown keys are errors)."""
    kwargs: Dict[str, Any] = {}
    for key, value in values.items():
        if key in _TOP:
            kwargs[key] = value
        elif key == "sweeps":
            if not isinstance(value, dict):
                raise TypeError(f"{source}: [sweeps] must be a table, got {type(value).__name__}")
            kwargs["sweeps"] = {k: list(v) for k, v in value.items()}
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                raise TypeError(f"{source}: [{key}] must be a table, got {type(value).__name__}")
            for sub, sub_value in value.items():
                if sub not in _SECTIONS[key]:
                    raise ValueError(f"{source}: unknown key {key}.{sub}; expected one of {sorted(_SECTIONS[key])}")
                target = _SECTIONS[key][sub]
                if key == "base":
                    kwargs.setdefault("base", dict(BASE))[sub] = float(sub_value)
                elif target == "field_values":
                    kwargs[target] = {k: list(v) for k, v in sub_value.items()}
                else:
                    kwargs[target] = sub_value
        else:
            raise ValueError(f"{source}: unknown key {key!r}; expected one of {sorted(_TOP + tuple(_SECTIONS) + ('sweeps',))}")
    try:
        return ScoreEvalConfig(**kwargs).validate()
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{source}: {exc}") from None


def load_config(path: Union[str, os.PathLike]) -> ScoreEvalConfig:
    """Read a score-evaluation TOML file (e.g. ``configs/score_eval_cpu.toml``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: no such file {str(path)!r}")
    values = _cli.read_toml(path)
    return config_from_dict(values, source=str(path))


def config_to_dict(config: ScoreEvalConfig) -> Dict[str, Any]:
    return dataclasses.asdict(config)


# ---------------------------------------------------------------------------- helpers
def sweep_params(base: Dict[str, float], name: str, value: float, dtype: torch.dtype = torch.float64) -> NoiseParams:
    """The tuple of a one-parameter sweep: ``base`` with ``name = value``.

    The u row sets v = 0 and the v row sets u = 0 (paper App. diffusion_full5), so the disk
    coordinate swept is the only anisotropy.
    """
    if name not in PARAMETERS:
        raise ValueError(f"name must be one of {list(PARAMETERS)}, got {name!r}")
    values = dict(base)
    values[name] = float(value)
    if name == "u":
        values["v"] = 0.0
    elif name == "v":
        values["u"] = 0.0
    return NoiseParams(torch.tensor(values["beta"], dtype=dtype), values["lam"], values["sigma"], values["u"], values["v"])


def _stream(seed: int, *keys) -> torch.Generator:
    """An independent generator per (stage, index): resizing one stage leaves the others' draws unchanged."""
    return substream(seed, keys)


def _queries(ring: EightGaussians, params: NoiseParams, n: int, generator: torch.Generator, dtype) -> torch.Tensor:
    """n noisy queries y = x + u, x from the ring, u from the tuple's law."""
    x, _ = ring.sample(n, generator, dtype=dtype)
    return x + params.noise(2).sample((n,), generator=generator).to(dtype)


def _mean_std(values: Sequence[float]) -> Dict[str, Any]:
    mean, std = mean_std(values)
    return {"mean": mean, "std": std, "per_model": [float(v) for v in values]}


def _environment(config: ScoreEvalConfig) -> Dict[str, Any]:
    return {
        "etweedie": __version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "backend": backends.resolve("et_score", torch.device("cpu")),
        "dtype": config.dtype,
    }


# ---------------------------------------------------------------------------- the evaluation
class _Stages:
    """The tqdm bar over every stage of the run."""

    def __init__(self, total: int, progress: bool):
        self.bar = tqdm(total=total, desc="score eval", disable=not progress, leave=False, dynamic_ncols=True)

    def step(self, label: str, n: int = 1) -> None:
        self.bar.set_postfix_str(label)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


@torch.no_grad()
def run_score_eval(
    posteriors: Sequence[Any],
    config: ScoreEvalConfig,
    out_dir: Optional[Union[str, os.PathLike]] = None,
    *,
    names: Optional[Sequence[str]] = None,
    progress: bool = True,
    figures: bool = True,
) -> Dict[str, Any]:
    """Evaluate the score accuracy of posterior models; optionally write JSON and figures.

    Args:
        posteriors: one or more posterior models (``dim``, ``sample(y, eta, n, *, generator)``);
            mean ± std in the tables is over them.
        config: the :class:`ScoreEvalConfig` (validated here).
        out_dir: run directory for ``score_eval.json`` and the PNGs (created); None writes nothing.
        names: a label per posterior (checkpoint paths, say); default ``model0``, ``model1``, ….
        progress: show a tqdm bar.
        figures: also write the figures (when ``out_dir`` is given).

    Returns:
        a JSON-ready dict with ``config``, ``models``, ``environment`` and, per enabled part,
        ``sweeps``, ``mc_budget``, ``sigma_profile``, ``richardson``; plus ``figures`` (paths),
        ``json_path``, ``seconds``.
    """
    if not isinstance(config, ScoreEvalConfig):
        raise TypeError(f"config must be a ScoreEvalConfig, got {type(config).__name__}")
    config.validate()
    posteriors = list(posteriors)
    if not posteriors:
        raise ValueError("posteriors must hold at least one posterior model, got none")
    for i, p in enumerate(posteriors):
        if not callable(getattr(p, "sample", None)):
            raise TypeError(f"posteriors[{i}] must have a sample(y, eta, n, *, generator) method, got {type(p).__name__}")
    names = [f"model{i}" for i in range(len(posteriors))] if names is None else [str(n) for n in names]
    if len(names) != len(posteriors):
        raise ValueError(f"names must give one label per posterior ({len(posteriors)}), got {len(names)}")

    start = time.perf_counter()
    dtype = config.torch_dtype
    ring = EightGaussians()
    oracle = ISOracle.eight_gaussians(config.bank_size, generator=_stream(config.seed, "bank"), dtype=dtype)
    half_a, half_b = oracle.halves()
    chunk = config.chunk or None
    parts = set(config.parts)
    n_models = len(posteriors)

    n_sweep_values = sum(len(v) for v in config.sweeps.values())
    total = 0
    if "sweeps" in parts or "mc_budget" in parts:
        total += n_sweep_values if "sweeps" in parts else len(config.sweeps[config.mc_sweep])
    if "mc_budget" in parts:
        total += n_models * config.mc_repetitions
    if "sigma_profile" in parts:
        total += len(config.profile_sigmas)
    if "richardson" in parts:
        total += 2
    if "fields" in parts and out_dir is not None and figures:
        total += sum(len(v) for v in config.field_values.values())
    stages = _Stages(total, progress)

    results: Dict[str, Any] = {
        "config": config_to_dict(config),
        "models": names,
        "environment": _environment(config),
        "paper": PAPER,
    }
    cache: Dict[Tuple[str, float], Dict[str, Any]] = {}

    def reference(params: NoiseParams, queries_key) -> Dict[str, Any]:
        """Queries of one setting with the IS reference and the disagreement of the halves (cached)."""
        if queries_key in cache:
            return cache[queries_key]
        y = _queries(ring, params, config.n_queries, _stream(config.seed, "queries", *queries_key), dtype)
        ref = oracle(y, params)
        first, second = half_a(y, params).score, half_b(y, params).score
        entry = {
            "y": y,
            "params": params,
            "score": ref.score,
            "mean": ref.posterior_mean,
            "ess": float(ref.ess.mean()),
            "disagreement": score_nmse(first, second),
        }
        cache[queries_key] = entry
        return entry

    def evaluate(model_index: int, entry, n_draws: int, *keys) -> Dict[str, float]:
        scorer = EnergyTweedieScore(
            posteriors[model_index], n_draws, generator=_stream(config.seed, "draws", model_index, *keys), chunk=chunk,
            antithetic=config.antithetic,
        )
        s, m = scorer.score_and_mean(entry["y"], entry["params"])
        return {
            "nmse": score_nmse(s, entry["score"]),
            "cosine": mean_cosine(s, entry["score"]),
            "pm_mse": posterior_mean_mse(m, entry["mean"]),
        }

    # ------------------------------------------------ Table score_full5_accuracy
    sweep_names = list(config.sweeps) if "sweeps" in parts else ([config.mc_sweep] if "mc_budget" in parts else [])
    sweeps: Dict[str, Any] = {}
    for name in sweep_names:
        values = config.sweeps[name]
        per_value = []
        for value in values:
            params = sweep_params(config.base, name, value, dtype)
            entry = reference(params, (name, float(value)))
            models = [evaluate(i, entry, config.n_draws, "sweep", name, float(value)) for i in range(n_models)]
            per_value.append(
                {
                    "value": float(value),
                    "realized_rms": float(params.realized_rms()),
                    "mean_ess": entry["ess"],
                    "reference_disagreement": entry["disagreement"],
                    "models": models,
                }
            )
            stages.step(f"{SYMBOLS[name]}={value:g}")
        summary = {
            metric: _mean_std([sum(v["models"][i][metric] for v in per_value) / len(per_value) for i in range(n_models)])
            for metric in ("nmse", "cosine", "pm_mse")
        }
        summary["reference_disagreement"] = sum(v["reference_disagreement"] for v in per_value) / len(per_value)
        sweeps[name] = {"values": per_value, "summary": summary}
    if "sweeps" in parts:
        results["sweeps"] = sweeps

    # ------------------------------------------------ Table score_mc_budget
    if "mc_budget" in parts:
        name = config.mc_sweep
        entries = [reference(sweep_params(config.base, name, v, dtype), (name, float(v))) for v in config.sweeps[name]]
        budgets = list(config.mc_n_draws)
        # nmse[model][budget][repetition]: the mean over the sweep's values, as in the sweep table.
        nmse = [[[0.0] * config.mc_repetitions for _ in budgets] for _ in range(n_models)]
        cosine = [[[0.0] * config.mc_repetitions for _ in budgets] for _ in range(n_models)]
        m = config.mc_n_queries or config.n_queries
        for i in range(n_models):
            for rep in range(config.mc_repetitions):
                per_nmse = [[] for _ in budgets]
                per_cos = [[] for _ in budgets]
                for k, e in enumerate(entries):
                    y, ref = e["y"][:m], e["score"][:m]
                    # One set of max(N) draws; budget N uses its first N (each estimator has its exact
                    # law; budgets within one repetition are correlated, repetitions are independent).
                    scorer = EnergyTweedieScore(posteriors[i], max(budgets), chunk=chunk, antithetic=config.antithetic,
                                                generator=_stream(config.seed, "mc", i, rep, k))
                    draws = scorer.draws(y, e["params"])
                    for b, n in enumerate(budgets):
                        s = score_from_draws(y, e["params"], draws[..., :n, :])
                        per_nmse[b].append(score_nmse(s, ref))
                        per_cos[b].append(mean_cosine(s, ref))
                for b in range(len(budgets)):
                    nmse[i][b][rep] = sum(per_nmse[b]) / len(per_nmse[b])
                    cosine[i][b][rep] = sum(per_cos[b]) / len(per_cos[b])
                stages.step(f"N-budget model {i} rep {rep}")
        rows = []
        for b, n in enumerate(budgets):
            units_n = [nmse[i][b][r] for i in range(n_models) for r in range(config.mc_repetitions)]
            units_c = [cosine[i][b][r] for i in range(n_models) for r in range(config.mc_repetitions)]
            rows.append({"n_draws": n, "nmse": _mean_std(units_n), "cosine": _mean_std(units_c)})
        # Antithetic draws: an odd N holds one unpaired draw (N = 1 is a plain draw), so the a + b/N
        # law is fitted over the even budgets only (their variance is that of N/2 mirrored pairs).
        fit_idx = [b for b, n in enumerate(budgets) if not (config.antithetic and n % 2)]
        if len({budgets[b] for b in fit_idx}) < 2:
            fit_idx = list(range(len(budgets)))
        reps = range(config.mc_repetitions)
        pooled_n = [budgets[b] for i in range(n_models) for b in fit_idx for _ in reps]
        pooled_e = [nmse[i][b][r] for i in range(n_models) for b in fit_idx for r in reps]
        a, b_fit = fit_mc_budget(pooled_n, pooled_e)
        per_model_fit = []
        for i in range(n_models):
            ai, bi = fit_mc_budget([budgets[b] for b in fit_idx for _ in reps], [nmse[i][b][r] for b in fit_idx for r in reps])
            per_model_fit.append({"a": ai, "b": bi})
        results["mc_budget"] = {
            "sweep": name,
            "n_draws": budgets,
            "repetitions": config.mc_repetitions,
            "nmse": nmse,
            "cosine": cosine,
            "rows": rows,
            "fit": {"a": a, "b": b_fit, "n_draws": [budgets[b] for b in fit_idx]},
            "fit_per_model": per_model_fit,
        }

    # ------------------------------------------------ score across σ (Gaussian: analytic reference)
    if "sigma_profile" in parts:
        profile: Dict[str, Any] = {"sigmas": list(config.profile_sigmas), "gaussian": [], "generalized": []}
        for sigma in config.profile_sigmas:
            for family, fixed in (("gaussian", GAUSSIAN), ("generalized", config.base)):
                params = sweep_params({**fixed, "sigma": float(sigma)}, "sigma", sigma, dtype)
                # The generalized family is the σ sweep's tuple: share its queries and reference.
                key = ("sigma", float(sigma)) if family == "generalized" else ("profile-gaussian", float(sigma))
                entry = reference(params, key)
                if family == "gaussian":  # exact reference: the analytic noisy score, Σ = σ² I, noise N(0, σ²/λ I)
                    exact = ring.noisy_score(entry["y"], float(params.realized_rms()))
                    entry = {**entry, "score": exact, "mean": ring.posterior_mean(entry["y"], float(params.realized_rms()))}
                models = [evaluate(i, entry, config.n_draws, "profile", family, float(sigma)) for i in range(n_models)]
                profile[family].append(
                    {
                        "sigma": float(sigma),
                        "reference": "analytic" if family == "gaussian" else "IS",
                        "reference_disagreement": entry["disagreement"],
                        "nmse": _mean_std([m["nmse"] for m in models]),
                        "cosine": _mean_std([m["cosine"] for m in models]),
                    }
                )
            stages.step(f"profile σ={sigma:g}")
        results["sigma_profile"] = profile

    # ------------------------------------------------ Richardson clean score
    fields_re = None
    if "richardson" in parts:
        results["richardson"], fields_re = _richardson(posteriors, config, ring, oracle, stages, chunk)

    json_path = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        results["figures"] = []
        if figures:
            results["figures"] = write_figures(
                results, out, posterior=posteriors[0], config=config, stages=stages if "fields" in parts else None,
                richardson_fields=fields_re if "fields" in parts else None,
            )
        results["seconds"] = time.perf_counter() - start
        json_path = out / RESULTS_FILE
        atomic_write(json_path, json.dumps(results, indent=1, allow_nan=False))
        results["json_path"] = str(json_path)
    else:
        results["seconds"] = time.perf_counter() - start
    stages.close()
    return results


def _richardson(posteriors, config: ScoreEvalConfig, ring: EightGaussians, oracle: ISOracle, stages, chunk):
    """Clean score at clean ring points from adjacent σ pairs: model and exact noisy scores vs ∇log p."""
    dtype = config.torch_dtype
    sigmas = sorted(set(float(s) for s in config.richardson_sigmas))
    x, _ = ring.sample(config.richardson_n_queries, _stream(config.seed, "richardson-points"), dtype=dtype)
    clean = ring.score(x)
    power = float(clean.pow(2).sum(-1).mean())
    out: Dict[str, Any] = {"sigmas": sigmas, "n_queries": config.richardson_n_queries,
                           "n_draws": config.richardson_n_draws, "clean_score_power": power, "families": {}}
    best_pairs = {}
    for family, fixed in (("gaussian", GAUSSIAN), ("generalized", config.base)):
        levels = {s: sweep_params({**fixed, "sigma": s}, "sigma", s, dtype) for s in sigmas}
        if family == "gaussian":
            exact = {s: ring.noisy_score(x, float(p.realized_rms())) for s, p in levels.items()}
            exact_name = "analytic"
        else:
            exact = {s: oracle(x, p).score for s, p in levels.items()}
            exact_name = "IS"
        model_scores = [
            {s: EnergyTweedieScore(post, config.richardson_n_draws, generator=_stream(config.seed, "re", i, family, s),
                                   chunk=chunk, antithetic=config.antithetic)(x, p) for s, p in levels.items()}
            for i, post in enumerate(posteriors)
        ]
        mse = lambda s: float((s - clean).pow(2).sum(-1).mean())
        pairs = []
        for s1, s2 in zip(sigmas[:-1], sigmas[1:]):
            row = {"sigma1": s1, "sigma2": s2}
            row["exact"] = {"reference": exact_name, "mse_sigma1": mse(exact[s1]), "mse_sigma2": mse(exact[s2]),
                            "mse_re": mse(richardson(exact[s1], exact[s2], s1, s2))}
            per = [
                {"mse_sigma1": mse(m[s1]), "mse_sigma2": mse(m[s2]), "mse_re": mse(richardson(m[s1], m[s2], s1, s2))}
                for m in model_scores
            ]
            row["model"] = {key: _mean_std([p[key] for p in per]) for key in ("mse_sigma1", "mse_sigma2", "mse_re")}
            pairs.append(row)
        best = min(range(len(pairs)), key=lambda k: pairs[k]["model"]["mse_re"]["mean"])
        out["families"][family] = {"pairs": pairs, "best_pair": best}
        s1, s2 = pairs[best]["sigma1"], pairs[best]["sigma2"]
        best_pairs[family] = (levels[s1], s1, s2)
        stages.step(f"Richardson {family}")
    return out, best_pairs


# ---------------------------------------------------------------------------- tables
def _pm(stat: Dict[str, Any], fmt: str = "{:.3f}") -> str:
    mean = fmt.format(stat["mean"])
    return mean if stat["std"] is None else f"{mean} ± {fmt.format(stat['std'])}"


def format_sweep_table(results: Dict[str, Any]) -> str:
    """Table score_full5_accuracy as text (paper values in the last columns)."""
    sweeps = results.get("sweeps") or {}
    head = f"{'parameter (range)':<20}{'score NMSE':>18}{'score cosine':>18}{'posterior-mean MSE':>22}{'ref. disagr.':>14}{'paper NMSE / cos':>20}"
    lines = [head, "-" * len(head)]
    for name, sweep in sweeps.items():
        values = [v["value"] for v in sweep["values"]]
        label = f"{SYMBOLS[name]} ({min(values):g}–{max(values):g})"
        s = sweep["summary"]
        paper = f"{PAPER['nmse'][name]:.3f} / {PAPER['cosine'][name]:.3f}"
        lines.append(
            f"{label:<20}{_pm(s['nmse']):>18}{_pm(s['cosine']):>18}{_pm(s['pm_mse'], '{:.4f}'):>22}"
            f"{s['reference_disagreement']:>14.4f}{paper:>20}"
        )
    n = len(results.get("models", []))
    draws = "antithetic" if results["config"].get("antithetic") else "independent"
    lines.append(f"mean ± std over {n} model(s); N = {results['config']['n_draws']} {draws} draws, "
                 f"{results['config']['n_queries']} queries per value, IS bank {results['config']['bank_size']:,}")
    return "\n".join(lines)


def format_mc_budget_table(results: Dict[str, Any]) -> str:
    """Table score_mc_budget as text, with the a + b/N fit."""
    mc = results["mc_budget"]
    head = f"{'N':>5}{'score NMSE':>20}{'score cosine':>20}{'a + b/N':>10}"
    lines = [head, "-" * len(head)]
    a, b = mc["fit"]["a"], mc["fit"]["b"]
    fitted = set(mc["fit"].get("n_draws", mc["n_draws"]))
    for row in mc["rows"]:
        n = row["n_draws"]
        fit = f"{a + b / n:>10.3f}" if n in fitted else f"{'—':>10}"
        lines.append(f"{n:>5}{_pm(row['nmse']):>20}{_pm(row['cosine']):>20}{fit}")
    per = ", ".join(f"({f['a']:.3f}, {f['b']:.3f})" for f in mc["fit_per_model"])
    over = "" if fitted == set(mc["n_draws"]) else f" over N ∈ {sorted(fitted)}"
    lines.append(f"fit NMSE ≈ a + b/N{over}: a = {a:.4f}, b = {b:.3f} (paper a = {PAPER['mc_floor_a']}, "
                 f"b = {PAPER['mc_slope_b']}); per model (a, b): {per}")
    draws = "antithetic draws" if results["config"].get("antithetic") else "independent draws"
    lines.append(f"queries: the {SYMBOLS[mc['sweep']]} sweep; {mc['repetitions']} repetitions per model; {draws}")
    return "\n".join(lines)


def format_richardson_table(results: Dict[str, Any]) -> str:
    """Clean-score MSE of ŝ_RE and of each single level, per family and σ pair."""
    re = results["richardson"]
    lines = [f"clean-score MSE at {re['n_queries']} clean points (E‖∇log p‖² = {re['clean_score_power']:.2f}); "
             f"model: N = {re['n_draws']}"]
    head = f"{'family':<12}{'σ1':>6}{'σ2':>6}{'exact σ1':>11}{'exact σ2':>11}{'exact RE':>11}{'model σ1':>18}{'model σ2':>18}{'model RE':>18}"
    lines += [head, "-" * len(head)]
    for family, block in re["families"].items():
        for k, row in enumerate(block["pairs"]):
            e, m = row["exact"], row["model"]
            mark = " *" if k == block["best_pair"] else ""
            lines.append(
                f"{family:<12}{row['sigma1']:>6g}{row['sigma2']:>6g}{e['mse_sigma1']:>11.4f}{e['mse_sigma2']:>11.4f}"
                f"{e['mse_re']:>11.4f}{_pm(m['mse_sigma1']):>18}{_pm(m['mse_sigma2']):>18}{_pm(m['mse_re']):>18}{mark}"
            )
    lines.append("exact = analytic noisy score (gaussian) or IS on the bank (generalized); * = pair with the lowest model RE MSE")
    return "\n".join(lines)


def format_results(results: Dict[str, Any]) -> str:
    """Every table present in ``results``."""
    blocks = []
    if "sweeps" in results:
        blocks.append("Table score_full5_accuracy\n" + format_sweep_table(results))
    if "mc_budget" in results:
        blocks.append("Table score_mc_budget\n" + format_mc_budget_table(results))
    if "sigma_profile" in results:
        prof = results["sigma_profile"]
        lines = [f"{'σ':>6}{'gauss NMSE':>18}{'gauss cos':>18}{'gen NMSE':>18}{'gen cos':>18}{'gen ref dis.':>14}"]
        for g, h in zip(prof["gaussian"], prof["generalized"]):
            lines.append(f"{g['sigma']:>6g}{_pm(g['nmse']):>18}{_pm(g['cosine']):>18}{_pm(h['nmse']):>18}"
                         f"{_pm(h['cosine']):>18}{h['reference_disagreement']:>14.4f}")
        blocks.append("Score across σ (gaussian: analytic reference; generalized: IS)\n" + "\n".join(lines))
    if "richardson" in results:
        blocks.append("Richardson clean score\n" + format_richardson_table(results))
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------- figures
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _grid(config: ScoreEvalConfig, dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ticks = torch.linspace(-config.field_extent, config.field_extent, config.field_grid, dtype=dtype)
    gy, gx = torch.meshgrid(ticks, ticks, indexing="ij")
    return ticks, gx, torch.stack([gx, gy], dim=-1)  # points (G, G, 2): [row = y, col = x]


def _log_magnitude(field: torch.Tensor) -> torch.Tensor:
    return torch.log10(field.double().norm(dim=-1).clamp_min(1e-6))


def _streamplot(ax, ticks: torch.Tensor, field: torch.Tensor, means: torch.Tensor, title: str, *, norm, density: float):
    """Streamlines of the field's direction (unit vectors, so line density is even); color = log10 ‖field‖."""
    f = field.double()
    unit = f / f.norm(dim=-1).clamp_min(1e-12)[..., None]
    t = ticks.double().numpy()
    stream = ax.streamplot(t, t, unit[..., 0].numpy(), unit[..., 1].numpy(), color=_log_magnitude(f).numpy(),
                           cmap="viridis", norm=norm, density=density, linewidth=0.8, arrowsize=0.7)
    ax.scatter(means[:, 0], means[:, 1], s=8, c="red", zorder=3)
    ax.set_title(title, fontsize=9)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    return stream


def write_figures(
    results: Dict[str, Any],
    out_dir: Union[str, os.PathLike],
    *,
    posterior=None,
    config: Optional[ScoreEvalConfig] = None,
    stages: Optional[_Stages] = None,
    richardson_fields=None,
) -> List[str]:
    """Write the PNGs for the parts present in ``results``; returns their paths.

    ``score_fields_<param>.png`` (needs ``posterior``, ``config`` and ``stages``/fields enabled),
    ``score_vs_sigma.png``, ``mc_budget.png``, ``richardson_field.png`` (needs ``posterior``).
    """
    plt = _pyplot()
    from matplotlib.colors import Normalize

    def shared_norm(fields) -> Normalize:
        logs = torch.stack([_log_magnitude(f) for f in fields])
        return Normalize(float(logs.min()), float(logs.max()))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: List[str] = []
    ring = EightGaussians()
    means = ring.means(torch.float64)

    def save(fig, name: str) -> None:
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(str(path))

    # Score-field streamplots of the one-parameter sweeps.
    if posterior is not None and config is not None and stages is not None:
        dtype = config.torch_dtype
        ticks, _, points = _grid(config, dtype)
        for name, values in config.field_values.items():
            fields = []
            for value in values:
                params = sweep_params(config.base, name, value, dtype)
                scorer = EnergyTweedieScore(posterior, config.field_n_draws,
                                            generator=_stream(config.seed, "field", name, float(value)),
                                            chunk=config.chunk or None, antithetic=config.antithetic)
                fields.append(scorer(points.reshape(-1, 2), params).reshape(points.shape))
            norm = shared_norm(fields)
            fig, axes = plt.subplots(1, len(values), figsize=(3.0 * len(values), 3.2), squeeze=False)
            for k, (value, field_) in enumerate(zip(values, fields)):
                stream = _streamplot(axes[0, k], ticks, field_, means, f"{SYMBOLS[name]} = {value:g}",
                                     norm=norm, density=config.field_density)
                stages.step(f"field {SYMBOLS[name]}={value:g}")
            fig.colorbar(stream.lines, ax=axes[0, :].tolist(), shrink=0.8, label="log₁₀ ‖ŝ‖")
            b = config.base
            fig.suptitle(f"Energy-Tweedie score field, {SYMBOLS[name]} sweep (base β={b['beta']:g}, λ={b['lam']:g}, "
                         f"σ={b['sigma']:g}, u={b['u']:g}, v={b['v']:g})", fontsize=10)
            save(fig, f"score_fields_{name}.png")

    # Cosine and NMSE across σ.
    if "sigma_profile" in results:
        prof = results["sigma_profile"]
        sig = prof["sigmas"]
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
        for col, (metric, family) in enumerate(
            (("cosine", "gaussian"), ("cosine", "generalized"), ("nmse", "gaussian"), ("nmse", "generalized"))
        ):
            ax = axes[col]
            rows = prof[family]
            mean = [r[metric]["mean"] for r in rows]
            std = [r[metric]["std"] or 0.0 for r in rows]
            ax.errorbar(sig, mean, yerr=std, marker="o", capsize=3, label="Energy-Tweedie (model)")
            dis = [r["reference_disagreement"] for r in rows]
            if metric == "nmse":
                ax.plot(sig, dis, ls=":", c="gray", label="reference disagreement")
                ax.set_yscale("log")
            for s, d in zip(sig, dis):
                if d > REFERENCE_FLOOR and family == "generalized":
                    ax.axvspan(s / 1.08, s * 1.08, color="0.85", zorder=0)
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(sig, [f"{x:g}" for x in sig], rotation=45, fontsize=7)
            ax.set_xlabel("σ")
            ax.set_title(f"{metric} — {family}", fontsize=10)
            ax.legend(fontsize=7)
        save(fig, "score_vs_sigma.png")

    # NMSE vs N with the a + b/N fit.
    if "mc_budget" in results:
        mc = results["mc_budget"]
        budgets = mc["n_draws"]
        fig, ax = plt.subplots(figsize=(5, 3.8))
        for i, per in enumerate(mc["nmse"]):
            t = torch.tensor(per, dtype=torch.float64)
            std = t.std(dim=1, unbiased=True) if t.shape[1] > 1 else torch.zeros(t.shape[0])
            ax.errorbar(budgets, t.mean(1).tolist(), yerr=std.tolist(), marker="o", capsize=3,
                        label=f"{results['models'][i]} (a={mc['fit_per_model'][i]['a']:.3f})")
        dense = torch.logspace(0, math.log10(max(budgets)), 100, dtype=torch.float64)
        a, b = mc["fit"]["a"], mc["fit"]["b"]
        fit = a + b / dense
        keep = fit > 0  # a slightly negative floor (noise) would leave the log axis
        ax.plot(dense[keep].tolist(), fit[keep].tolist(), ls="--", c="k", label=f"fit a + b/N: a={a:.3f}, b={b:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("posterior draws N")
        ax.set_ylabel("score NMSE")
        ax.legend(fontsize=7)
        save(fig, "mc_budget.png")

    # Richardson clean field vs the analytic clean score.
    if richardson_fields and posterior is not None and config is not None:
        dtype = config.torch_dtype
        ticks, _, points = _grid(config, dtype)
        flat = points.reshape(-1, 2)
        clean = ring.score(flat).reshape(points.shape)
        fig, axes = plt.subplots(len(richardson_fields), 3, figsize=(10, 3.3 * len(richardson_fields)), squeeze=False)
        for row, (family, (params, s1, s2)) in enumerate(richardson_fields.items()):
            scorer = EnergyTweedieScore(posterior, config.richardson_n_draws,
                                        generator=_stream(config.seed, "re-field", family), chunk=config.chunk or None,
                                        antithetic=config.antithetic)
            s_re, _, _ = richardson_score(scorer, flat, params, s1, s2)
            s_re = s_re.reshape(points.shape)
            norm = shared_norm([clean, s_re])
            _streamplot(axes[row, 0], ticks, clean, means, f"{family}: analytic clean score", norm=norm,
                        density=config.field_density)
            _streamplot(axes[row, 1], ticks, s_re, means, f"{family}: Richardson σ=({s1:g}, {s2:g})", norm=norm,
                        density=config.field_density)
            resid = torch.log1p((s_re - clean).double().norm(dim=-1))
            im = axes[row, 2].imshow(resid.numpy(), origin="lower", cmap="magma",
                                     extent=[float(ticks[0]), float(ticks[-1])] * 2)
            axes[row, 2].set_title("log(1 + ‖ŝ_RE − ∇log p‖)", fontsize=9)
            fig.colorbar(im, ax=axes[row, 2], shrink=0.8)
        save(fig, "richardson_field.png")
    return paths


# ---------------------------------------------------------------------------- command line
PROG = "python -m experiments.eight_gaussians.score_eval"
CLI_HELP = "score accuracy of trained posteriors on eight Gaussians (paper Tables score_full5_accuracy, score_mc_budget)"


def add_cli_arguments(parser) -> None:
    parser.add_argument("--checkpoint", action="append", metavar="PATH",
                        help="run directory, posterior/ folder, checkpoint.pt or legacy posterior.pt; repeat for several models (mean ± std)")
    parser.add_argument("--oracle", action="store_true",
                        help="evaluate the exact/SIR oracle posterior instead of checkpoints (a reference run)")
    parser.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/score_eval_cpu.toml")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/score_eval_<config name>)")
    parser.add_argument("--parts", metavar="LIST", help=f"comma-separated subset of {','.join(PARTS)} (default: the config's)")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--antithetic", action="store_true",
                        help="antithetic posterior draws (mirrored noise pairs; unbiased, lower Monte Carlo error)")
    parser.add_argument("--no-figures", action="store_true", help="write the JSON only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_cli_arguments(args) -> None:
    """The flag values, before any work (raises _cli.UsageError naming the flag)."""
    _cli.at_least("--seed", args.seed, 0)
    _cli.nonempty("--checkpoint", args.checkpoint, "a run directory or checkpoint")
    if args.parts is not None and not [p for p in args.parts.split(",") if p.strip()]:
        raise _cli.UsageError(f"--parts must be a comma-separated subset of {','.join(PARTS)}, got {args.parts!r}")


def cli_main(args) -> int:
    prog = PROG
    config = _cli.read_config("--config", args.config, load_config)
    try:
        if args.parts:
            config = dataclasses.replace(config, parts=[p.strip() for p in args.parts.split(",") if p.strip()])
        if args.seed is not None:
            config = dataclasses.replace(config, seed=args.seed)
        if args.antithetic:
            config = dataclasses.replace(config, antithetic=True)
        config.validate()
    except (ValueError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if bool(args.checkpoint) == bool(args.oracle):
        print(f"{prog}: error: give --checkpoint PATH (one or more) or --oracle, not both/neither", file=sys.stderr)
        return 2
    if args.oracle and config.antithetic:
        print(f"{prog}: error: antithetic draws need a learned posterior (the oracle's SIR draws have no noise "
              "to mirror); drop --antithetic or the config's antithetic = true", file=sys.stderr)
        return 2
    if args.oracle:
        from etweedie.posteriors import KnownPosterior

        posteriors = [KnownPosterior(method="sir", bank_size=config.bank_size,
                                     generator=_stream(config.seed, "oracle-bank"), bank_dtype=config.torch_dtype)]
        names = ["oracle"]
    else:
        from etweedie.training import load_posterior

        posteriors = [_cli.load("--checkpoint", path, load_posterior) for path in args.checkpoint]
        names = list(args.checkpoint)
    out_dir = args.out or str(Path("runs") / f"score_eval_{Path(args.config).stem}")
    _cli.out_dir("--out", out_dir)  # the default too: created and written here, before the evaluation
    results = run_score_eval(posteriors, config, out_dir, names=names, progress=not args.no_progress,
                             figures=not args.no_figures)
    print(format_results(results))
    print(f"\n{results['seconds']:.1f} s; results written to {results['json_path']}")
    for path in results["figures"]:
        print(f"figure: {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m experiments.eight_gaussians.score_eval [ARGS]``; returns the exit status."""
    return _cli.run(PROG, CLI_HELP, add_cli_arguments, cli_main, argv, check=check_cli_arguments)


if __name__ == "__main__":
    sys.exit(main())
