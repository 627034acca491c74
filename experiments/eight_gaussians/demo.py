"""The etweedie demo (``make demo``, ``python -m experiments.eight_gaussians.demo``) on the eight-Gaussians ring (paper §5.1).

**Full demo** (:func:`run_demo`, ``python -m experiments.eight_gaussians.demo``): train a small conditional Engression
posterior on CPU (``configs/eight_gaussians_demo.toml`` through :func:`etweedie.training.train`; a few
minutes, resumable: a rerun reuses the trained model), then evaluate its Energy-Tweedie score
over the β sweep of Table score_full5_accuracy and the posterior-draw budget of Table
score_mc_budget (:mod:`experiments.eight_gaussians.score_eval`), print the tables, and write the JSON and the
figures (β-sweep score fields, NMSE vs N with the a + b/N fit) into the run directory.

**Quick oracle demo** (:func:`run_score_demo`, ``... demo --quick``): no training; scores
noisy queries y = x + u with exact or SIR posterior draws instead of a model, in two parts:

(a) Gaussian noise (β = 2, λ = 1, Σ = σ² I, σ ∈ {0.1, 0.25, 0.5}).  The noisy score is
    analytic and the posterior X | y is an exact Gaussian mixture, so ``et_score`` on exact
    posterior draws isolates the Monte-Carlo error of the identity (NMSE ≈ τ²/(N σ²) at small
    σ) and ``is_score`` on a 160,000-point clean bank shows the oracle's own accuracy.
(b) Generalized-Gaussian noise with the five-parameter geometry (β ∈ {1.0, 1.4}, λ = 1.8,
    σ ∈ {0.57, 0.25}, u = 0, v = 0.6).  No closed form exists, so the reference is
    ``is_score`` on one half of the bank; ``et_score`` runs on SIR posterior draws from the
    other half (independent of the reference), and ``is_score`` on that other half against
    the reference gives the disagreement of two independent references: the noise floor
    below which no NMSE in that row is meaningful.

NMSE = E‖ŝ − s‖² / E‖s‖² over queries; cosine is the mean per-query cosine of ŝ and s.

    >>> from experiments.eight_gaussians.demo import run_score_demo, format_score_table
    >>> results = run_score_demo(seed=0, n_queries=64, n_draws=64, bank_size=8_000, progress=False)
    >>> len(results["rows"])
    14
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, TextIO, Union

import torch
from tqdm.auto import tqdm

from experiments import _cli
from etweedie import __version__, backends
from etweedie.data import EightGaussians, posterior_sample_sir
from etweedie.noise import NoiseParams
from etweedie.ops import et_score, is_score
from etweedie.score import mean_cosine, score_nmse
from etweedie.utils import check_int, substream

__all__ = [
    "DEMO_OUT",
    "DEMO_TRAIN_CONFIG",
    "demo_eval_config",
    "print_demo",
    "run_demo",
    "GAUSSIAN_SIGMAS",
    "GENERAL_BETAS",
    "GENERAL_SIGMAS",
    "QUICK_SIZES",
    "format_score_table",
    "mean_cosine",
    "print_score_demo",
    "run_score_demo",
    "score_nmse",
    "write_results",
]

GAUSSIAN_SIGMAS = (0.1, 0.25, 0.5)
GENERAL_BETAS = (1.0, 1.4)
GENERAL_SIGMAS = (0.57, 0.25)
GENERAL_LAM, GENERAL_U, GENERAL_V = 1.8, 0.0, 0.6
# Small sizes for `demo --quick` and the tests (a few seconds).
QUICK_SIZES = dict(n_queries=128, n_draws=128, bank_size=20_000)
RESULTS_FILE = "score_demo.json"


# ---------------------------------------------------------------------------- helpers
def _stream(seed: int, index: int) -> torch.Generator:
    """An independent generator per demo stage, so resizing one stage leaves the others' draws unchanged."""
    return substream(seed, index)


def _params(beta: float, lam: float, sigma: float, u: float, v: float, dtype: torch.dtype) -> NoiseParams:
    return NoiseParams(torch.tensor(beta, dtype=dtype), lam, sigma, u, v)


def _row(noise, params, sigma, method, reference, estimate, target, n_draws, **extra) -> Dict:
    row = dict(
        noise=noise,
        sigma=sigma,
        beta=float(params.beta),
        lam=float(params.lam),
        u=float(params.u),
        v=float(params.v),
        realized_rms=float(params.realized_rms()),
        method=method,
        reference=reference,
        nmse=score_nmse(estimate, target),
        cosine=mean_cosine(estimate, target),
        n_draws=n_draws,
    )
    row.update(extra)
    return row


# ---------------------------------------------------------------------------- the demo
@torch.no_grad()
def run_score_demo(
    seed: int = 0,
    n_queries: int = 512,
    n_draws: int = 256,
    bank_size: int = 160_000,
    progress: bool = True,
    *,
    dtype: torch.dtype = torch.float64,
    out_dir: Optional[Union[str, os.PathLike]] = None,
) -> Dict:
    """Run the score demo and return its results.

    Args:
        seed: all randomness derives from it (one ``torch.Generator`` per stage).
        n_queries: noisy queries per noise setting.
        n_draws: posterior draws per query for ``et_score``.
        bank_size: clean bank for ``is_score`` (the paper's 160,000); halves for part (b).
        progress: show a tqdm bar on stderr.
        dtype: float64 (default) or float32.
        out_dir: if given, the results are also written there as ``score_demo.json``.

    Returns:
        ``{"config": {...}, "rows": [row, ...], "seconds": float}``; every row holds ``noise``,
        ``sigma``, ``beta``, ``lam``, ``u``, ``v``, ``realized_rms``, ``method``,
        ``reference``, ``nmse``, ``cosine``, ``n_draws`` (and ``mean_ess`` for IS rows).
    """
    seed = check_int(seed, "seed", 0)
    n_queries = check_int(n_queries, "n_queries", 1)
    n_draws = check_int(n_draws, "n_draws", 1)
    bank_size = check_int(bank_size, "bank_size", 2)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")

    start = time.perf_counter()
    ring = EightGaussians()
    bank, _ = ring.sample(bank_size, _stream(seed, 0), dtype=dtype)
    half = bank_size // 2
    bank_a, bank_b = bank[:half], bank[half:]
    rows: List[Dict] = []
    n_stages = len(GAUSSIAN_SIGMAS) + len(GENERAL_BETAS) * len(GENERAL_SIGMAS)
    bar = tqdm(total=n_stages, desc="score demo", disable=not progress, leave=False)
    stage = 0

    # (a) Gaussian noise: analytic score, exact posterior.
    for sigma in GAUSSIAN_SIGMAS:
        stage += 1
        bar.set_postfix_str(f"gaussian σ={sigma}")
        params = _params(2.0, 1.0, sigma, 0.0, 0.0, dtype)
        law = params.noise(2)
        s = float(params.realized_rms())  # = σ: c_{2,2} = 1, so Σ = σ² I
        g = _stream(seed, stage)
        x, _ = ring.sample(n_queries, g, dtype=dtype)
        y = x + law.sample((n_queries,), generator=g)
        target = ring.noisy_score(y, s)
        draws = ring.posterior_sample(y, s, n_draws, g)
        s_et = et_score(y, draws, law.beta, law.lam, law.metric)
        s_is, _, ess = is_score(y, bank, law)
        rows.append(_row("gaussian", params, sigma, "ET exact posterior", "analytic", s_et, target, n_draws))
        rows.append(
            _row("gaussian", params, sigma, "IS bank", "analytic", s_is, target, bank_size, mean_ess=float(ess.mean()))
        )
        bar.update()

    # (b) Generalized-Gaussian noise, five-parameter geometry: reference = IS on half B.
    for beta in GENERAL_BETAS:
        for sigma in GENERAL_SIGMAS:
            stage += 1
            bar.set_postfix_str(f"β={beta} σ={sigma}")
            params = _params(beta, GENERAL_LAM, sigma, GENERAL_U, GENERAL_V, dtype)
            law = params.noise(2)
            g = _stream(seed, stage)
            x, _ = ring.sample(n_queries, g, dtype=dtype)
            y = x + law.sample((n_queries,), generator=g)
            reference, _, ess_b = is_score(y, bank_b, law)
            s_is_a, _, ess_a = is_score(y, bank_a, law)
            draws = posterior_sample_sir(y, bank_a, law, n_draws, g)
            s_et = et_score(y, draws, law.beta, law.lam, law.metric)
            ref_name = "IS bank half B"
            rows.append(
                _row("gen-gauss", params, sigma, "ET SIR half A", ref_name, s_et, reference, n_draws,
                     mean_ess=float(ess_a.mean()))
            )
            rows.append(
                _row("gen-gauss", params, sigma, "IS half A (floor)", ref_name, s_is_a, reference, half,
                     mean_ess=float(ess_a.mean()), mean_ess_reference=float(ess_b.mean()))
            )
            bar.update()
    bar.close()

    results = dict(
        config=dict(
            seed=seed,
            n_queries=n_queries,
            n_draws=n_draws,
            bank_size=bank_size,
            dtype=str(dtype).replace("torch.", ""),
            data=repr(ring),
            etweedie=__version__,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            backend=backends.resolve("et_score", torch.device("cpu"), None),
        ),
        rows=rows,
        seconds=time.perf_counter() - start,
    )
    if out_dir is not None:
        results["json_path"] = str(write_results(results, out_dir))
    return results


def write_results(results: Dict, out_dir: Union[str, os.PathLike]) -> Path:
    """Write ``results`` as indented JSON to ``out_dir/score_demo.json`` (the folder is created)."""
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a path, got {type(out_dir).__name__}")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESULTS_FILE
    payload = {k: v for k, v in results.items() if k != "json_path"}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------- printing
_COLUMNS = (  # header, width, format of the value
    ("noise", 10, "{:<10}"),
    ("σ", 5, "{:>5.2f}"),
    ("β", 4, "{:>4.1f}"),
    ("λ", 4, "{:>4.1f}"),
    ("method", 18, "{:<18}"),
    ("NMSE", 8, "{:>8.4f}"),
    ("cosine", 7, "{:>7.4f}"),
    ("#draws", 7, "{:>7d}"),
)


def format_score_table(results: Dict) -> str:
    """The demo's results as a fixed-width text table with a short legend."""
    header = "  ".join(f"{name:<{w}}" if i in (0, 4) else f"{name:>{w}}" for i, (name, w, _) in enumerate(_COLUMNS))
    lines = [header, "-" * len(header)]
    previous = None
    for row in results["rows"]:
        key = (row["noise"], row["sigma"], row["beta"])
        if previous is not None and key[0] != previous[0]:
            lines.append("")
        previous = key
        values = (row["noise"], row["sigma"], row["beta"], row["lam"], row["method"], row["nmse"], row["cosine"], row["n_draws"])
        lines.append("  ".join(fmt.format(v) for (_, _, fmt), v in zip(_COLUMNS, values)))
    cfg = results["config"]
    lines += [
        "",
        "gaussian:  Σ = σ² I; reference = analytic noisy score; ET on exact posterior draws.",
        f"gen-gauss: NoiseParams(β, λ, σ, u={GENERAL_U:g}, v={GENERAL_V:g}); reference = is_score on bank half B;",
        "           ET on SIR draws from half A; 'IS half A (floor)' = disagreement of two independent references.",
        f"{cfg['n_queries']} queries, bank {cfg['bank_size']:,}, {cfg['dtype']}, backend {cfg['backend']}, "
        f"{cfg['threads']} threads, seed {cfg['seed']}: {results['seconds']:.1f} s",
    ]
    return "\n".join(lines)


def print_score_demo(results: Dict, file: Optional[TextIO] = None) -> None:
    """Print :func:`format_score_table` of ``results`` (to stdout by default)."""
    print(format_score_table(results), file=sys.stdout if file is None else file)


# ---------------------------------------------------------------------------- the full demo: train, then evaluate
DEMO_TRAIN_CONFIG = "eight_gaussians_demo.toml"
DEMO_OUT = Path("runs") / "demo"


def _configs_dir() -> Path:
    """The repository's configs/ (two folders above this file), else ./configs."""
    beside = Path(__file__).resolve().parents[2] / "configs"
    return beside if beside.is_dir() else Path.cwd() / "configs"


def demo_eval_config(seed: int = 0):
    """The demo's evaluation: the β sweep (1.3–2) and the N = 1…256 budget on its queries, paper bank size.

    512 queries per β value, N = 64 for the table; the budget on the first 256 of them, three
    draw sets; β-sweep score fields for the figure.  A minute or two on a 2-core CPU.
    """
    from .score_eval import BASE, ScoreEvalConfig

    return ScoreEvalConfig(
        seed=seed,
        dtype="float32",
        n_queries=512,
        n_draws=64,
        bank_size=160_000,
        parts=["sweeps", "mc_budget", "fields"],
        base=dict(BASE),
        sweeps={"beta": [1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]},
        mc_n_draws=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        mc_repetitions=3,
        mc_sweep="beta",
        mc_n_queries=256,
        field_grid=40,
        field_n_draws=64,
        field_values={"beta": [1.3, 1.5, 1.75, 2.0]},
    ).validate()


def run_demo(
    out_dir: Union[str, os.PathLike] = DEMO_OUT,
    *,
    seed: int = 0,
    progress: bool = True,
    train_config=None,
    eval_config=None,
    sampling_settings: Optional[Dict] = None,
    log: Optional[TextIO] = None,
) -> Dict:
    """Train the demo posterior on CPU and evaluate its score; everything lands in ``out_dir``.

    Args:
        out_dir: the run directory: ``model/`` (checkpoint, log, ``posterior/``) and
            ``score_eval.json`` with the figures.  An interrupted or finished training in
            ``out_dir/model`` with the same config is resumed/reused.
        seed: seed of the training run and of the evaluation's queries and draws.
        progress: tqdm bars for training and evaluation.
        train_config: a :class:`etweedie.training.TrainConfig` (default
            ``configs/eight_gaussians_demo.toml`` with ``seed``).
        eval_config: a :class:`experiments.eight_gaussians.score_eval.ScoreEvalConfig` (default :func:`demo_eval_config`).
        sampling_settings: the sampling stage's settings (default ``DEMO_SAMPLING``; keys as there).
        log: where the stage messages go (default stderr, so stdout holds the tables).

    Returns:
        ``{"train": <train summary>, "eval": <score_eval results>, "sampling": <run_demo_sampling
        result>, "out_dir": str, "seconds": float}``.
    """
    from etweedie import training
    from .score_eval import run_score_eval

    seed = check_int(seed, "seed", 0)
    log = sys.stderr if log is None else log
    out = Path(out_dir)
    start = time.perf_counter()
    if train_config is None:
        path = _configs_dir() / DEMO_TRAIN_CONFIG
        if not path.is_file():
            raise ValueError(f"train_config: the demo config {DEMO_TRAIN_CONFIG} is not at {path}; run from the repository root")
        import dataclasses

        train_config = dataclasses.replace(training.load_config(path), seed=seed)
    eval_config = demo_eval_config(seed) if eval_config is None else eval_config

    print(f"[1/3] training the demo posterior ({train_config.steps} steps) in {out / 'model'}", file=log, flush=True)
    summary = training.train(train_config, out / "model", resume=True, progress=progress)
    if summary.get("resumed_from") is not None:
        print(f"      resumed from step {summary['resumed_from']}", file=log, flush=True)
    print(f"      {summary['step']} steps, {summary['wall_time_s']:.0f} s of training, final loss "
          f"{summary['final_loss']:.4f}", file=log, flush=True)
    posterior = training.load_posterior(summary["posterior"])
    print("[2/3] evaluating the score: β sweep and posterior-draw budget", file=log, flush=True)
    results = run_score_eval([posterior], eval_config, out, names=[summary["posterior"]], progress=progress)
    print("[3/3] sampling along the rotating-covariance path (annealed Langevin)", file=log, flush=True)
    sampling = run_demo_sampling(posterior, out, seed=seed, progress=progress, settings=sampling_settings)
    return {"train": summary, "eval": results, "sampling": sampling, "out_dir": str(out),
            "seconds": time.perf_counter() - start}


# The demo's sampling run: the paper's rotating-covariance path (β 1.4, λ 1.8, (u, v) turning once
# at radius 0.6), on a shorter realized-RMS schedule that stays inside the demo posterior's
# training range (σ ∈ [0.1, 0.75] ⇒ r = σ λ^{−1/β} ∈ [0.066, 0.49] at λ 1.8, β 1.4), then one
# posterior draw at the last level.  Small enough for a CPU demo (~a minute).
DEMO_SAMPLING = dict(path="rotating", r_max=0.45, r_min=0.07, levels=15, steps_per_level=4, first_level_steps=10,
                     n_posterior=16, chains=512, step_scale=2e-4, n_reference=4096)


def run_demo_sampling(posterior, out_dir: Union[str, os.PathLike], *, seed: int = 0, progress: bool = True,
                      settings: Optional[Dict] = None) -> Dict:
    """Sample eight Gaussians along the rotating path with ``posterior``; metrics and samples to ``out_dir``.

    Returns the settings, the endpoint metrics (signed energy distance to independent clean draws,
    mode-weight TV, minimum mode mass, modes present, mean radial error), the same metrics for
    independent clean draws (the noise floor of this sample size), and the samples' path.
    """
    from etweedie.evaluation import eight_gaussians_metrics, forward_noised
    from etweedie.sample import GeometricRMS, get_path, level_times
    from etweedie.sample import sample_langevin

    cfg = dict(DEMO_SAMPLING if settings is None else settings)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ring = EightGaussians()
    path = get_path(cfg["path"], rms=GeometricRMS(cfg["r_max"], cfg["r_min"]))
    schedule = level_times(cfg["levels"])
    gen = _stream(seed, 100)
    clean0, _ = ring.sample(cfg["chains"], gen)
    first = path(schedule[:1])  # the noisiest level; chains start from its exact marginal
    params0 = NoiseParams(*(float(t.reshape(-1)[0]) for t in (first.beta, first.lam, first.sigma, first.u, first.v)))
    y0 = forward_noised(clean0, params0, gen).float()
    t0 = time.perf_counter()
    samples = sample_langevin(
        posterior, y0, path, schedule, steps_per_level=cfg["steps_per_level"], n_posterior=cfg["n_posterior"],
        step_scale=cfg["step_scale"], first_level_steps=cfg["first_level_steps"], final_draw=True,
        generator=gen, disable=not progress,
    )
    seconds = time.perf_counter() - t0
    reference, _ = ring.sample(cfg["n_reference"], _stream(seed, 101))
    independent, _ = ring.sample(cfg["chains"], _stream(seed, 102))
    metrics = eight_gaussians_metrics(samples.double(), reference.double(), ring)
    floor = eight_gaussians_metrics(independent.double(), reference.double(), ring)
    samples_path = out / "demo_samples.pt"
    torch.save({"samples": samples, "settings": cfg, "seed": seed}, samples_path)
    result = {"settings": cfg, "metrics": metrics, "clean_draws": floor, "seconds": seconds,
              "samples_path": str(samples_path)}
    with open(out / "demo_sampling.json", "w") as f:
        json.dump(result, f, indent=2)
    return result


def format_sampling_table(sampling: Dict) -> str:
    """The demo's sampling metrics beside the same metrics of independent clean draws."""
    cfg = sampling["settings"]
    head = (f"Sampling along the {cfg['path']} path: {cfg['chains']} chains, {cfg['levels']} levels "
            f"r {cfg['r_max']}→{cfg['r_min']}, {cfg['steps_per_level']} steps/level, N = {cfg['n_posterior']} "
            f"({sampling['seconds']:.0f} s)")
    rows = [("annealed Langevin", sampling["metrics"]), ("independent clean draws", sampling["clean_draws"])]
    lines = [head, "", "| samples | signed ED | mode-weight TV | min mode mass | modes | mean radial error |",
             "|---|---|---|---|---|---|"]
    for name, m in rows:
        lines.append(f"| {name} | {m['signed_ed']:.4f} | {m['mode_weight_tv']:.3f} | {m['min_mode_mass']:.3f} | "
                     f"{m['modes_present']}/8 | {m['mean_radial_error']:.3f} |")
    return "\n".join(lines)


def print_demo(demo: Dict, file: Optional[TextIO] = None) -> None:
    """Print the demo's tables and where its files are."""
    from .score_eval import format_mc_budget_table, format_sweep_table

    file = sys.stdout if file is None else file
    results = demo["eval"]
    print("Energy-Tweedie score of a CPU-trained posterior on eight Gaussians (paper Tables score_full5_accuracy, "
          "score_mc_budget)\n", file=file)
    print(format_sweep_table(results), file=file)
    print("", file=file)
    print(format_mc_budget_table(results), file=file)
    if "sampling" in demo:
        print("", file=file)
        print(format_sampling_table(demo["sampling"]), file=file)
    train = demo["train"]
    print(f"\ntraining: {train['step']} steps, {train['wall_time_s']:.0f} s; evaluation {results['seconds']:.0f} s; "
          f"total {demo['seconds']:.0f} s", file=file)
    print(f"run directory: {demo['out_dir']}", file=file)
    print(f"  model:   {train['posterior']}", file=file)
    print(f"  results: {results['json_path']}", file=file)
    for path in results["figures"]:
        print(f"  figure:  {path}", file=file)
    if "sampling" in demo:
        print(f"  samples: {demo['sampling']['samples_path']}", file=file)


# ---------------------------------------------------------------------------- command line
PROG = "python -m experiments.eight_gaussians.demo"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m experiments.eight_gaussians.demo [--seed N] [--out DIR] [--quick] [--no-progress]``."""
    parser = _cli.OneLineParser(
        prog=PROG, description="train a small posterior on CPU and evaluate its score (paper §5.1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/demo; with --quick: also write DIR/score_demo.json)")
    parser.add_argument("--quick", action="store_true", help="no training: the oracle-posterior score table, small sizes (a few seconds)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, status = _cli.parse(parser, argv)
    if args is None:
        return status
    # the run directory (the default too, without --quick) is created and written here, before the work
    status = _cli.usage_error(PROG, [("--seed", args.seed, 0)], out=DEMO_OUT if args.out is None and not args.quick else args.out)
    if status:
        return status
    from etweedie.backends import BackendUnavailable

    try:
        if not args.quick:  # train + evaluate
            demo = run_demo(args.out or DEMO_OUT, seed=args.seed, progress=not args.no_progress)
            print_demo(demo)
            return 0
        results = run_score_demo(seed=args.seed, progress=not args.no_progress, out_dir=args.out, **QUICK_SIZES)
    except (ValueError, BackendUnavailable, OSError) as exc:  # e.g. a run directory holding another config's checkpoint
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print_score_demo(results)
    if "json_path" in results:
        print(f"results written to {results['json_path']}")
    return 0


if __name__ == "__main__":
    sys.exit(_cli.guarded(PROG, main))
