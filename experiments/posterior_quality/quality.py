"""Quality numbers of trained posteriors (run directories or posterior.pt files).

    .venv/bin/python -m experiments.posterior_quality.quality runs/eg_demo runs/eg_cpu

Per model: the held-out matched energy score over the training prior (its own config's prior
and data; 4096 examples, 16 draws, fixed seed) and the exact-posterior check at β = 2, u = v = 0,
λ = 1 (etweedie.training.gaussian_posterior_check: 1024 queries per σ ∈ {0.1, 0.25, 0.5, 0.75},
N = 256 draws): Energy-Tweedie score NMSE against the analytic noisy score (and the same with
N exact posterior draws: the Monte-Carlo floor) and the
posterior-mean error ‖x̄_N − E[X|y]‖².  One JSON line per model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from etweedie.training import config_from_dict, gaussian_posterior_check, held_out_loss, load_posterior
from experiments import _cli


def _run_metadata(path: Path) -> dict:
    """The training config and step saved with a posterior: ``config.json`` of a posterior directory
    (a run's ``posterior/``), or the dict of a legacy single-file ``posterior.pt`` (read with
    ``weights_only=True``: no code is unpickled)."""
    for candidate in (path / "posterior" / "config.json", path / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    legacy = path if path.suffix == ".pt" else path / "posterior.pt"
    return torch.load(legacy, map_location="cpu", weights_only=True)


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories or posterior.pt files")
    args = parser.parse_args(argv)
    _cli.nonempty("PATH", args.paths, "a run directory or posterior.pt file")
    torch.set_num_threads(1)
    for path in args.paths:
        posterior = _cli.load("PATH", path, load_posterior, "a run directory or posterior.pt file")
        meta = _run_metadata(Path(path))
        config = config_from_dict(meta["train_config"])
        check = gaussian_posterior_check(posterior)
        row = {
            "model": str(path),
            "step": meta["step"],
            "held_out_es": round(held_out_loss(posterior, config), 4),
            "gauss_score_nmse": round(check["score_nmse"], 4),
            "gauss_exact_draws_score_nmse": round(check["exact_score_nmse"], 4),
            "gauss_pm_mse": round(check["pm_mse"], 5),
            "per_sigma_score_nmse": {k: round(v["score_nmse"], 4) for k, v in check["per_sigma"].items()},
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.posterior_quality.quality", main))
