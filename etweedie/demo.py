"""Score demo on the eight-Gaussians ring (paper §5.1): Energy-Tweedie scores against references.

Two parts, each scoring noisy queries y = x + u (x from the ring, u from the noise law):

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

    >>> from etweedie.demo import run_score_demo, format_score_table
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
from typing import Dict, List, Optional, TextIO, Union

import torch
from tqdm.auto import tqdm

from . import __version__, backends
from .data import EightGaussians, posterior_sample_sir
from .noise import NoiseParams
from .ops import et_score, is_score

__all__ = [
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
# Small sizes for `etweedie demo --quick` and the tests (a few seconds).
QUICK_SIZES = dict(n_queries=128, n_draws=128, bank_size=20_000)
RESULTS_FILE = "score_demo.json"


# ---------------------------------------------------------------------------- metrics
def score_nmse(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """E‖ŝ − s‖² / E‖s‖² over the leading dims of ``(..., d)`` tensors."""
    return float((estimate - reference).pow(2).sum(-1).mean() / reference.pow(2).sum(-1).mean())


def mean_cosine(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean per-query cosine similarity of ``(..., d)`` score fields."""
    return float(torch.nn.functional.cosine_similarity(estimate, reference, dim=-1, eps=1e-30).mean())


# ---------------------------------------------------------------------------- helpers
def _stream(seed: int, index: int) -> torch.Generator:
    """An independent generator per demo stage, so resizing one stage leaves the others' draws unchanged."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 63))


def _check_size(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
    seed = _check_size(seed, "seed", 0)
    n_queries = _check_size(n_queries, "n_queries", 1)
    n_draws = _check_size(n_draws, "n_draws", 1)
    bank_size = _check_size(bank_size, "bank_size", 2)
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
