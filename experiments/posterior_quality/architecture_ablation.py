"""Compare posterior architectures (conditioning, output form) at one training budget.

    nice -n 5 .venv/bin/python -m experiments.posterior_quality.architecture_ablation --config configs/eight_gaussians_demo.toml \
        --variant film:scaled_residual --variant concat:scaled_residual --out runs/ablation

Each variant is trained with the config (model.conditioning/output/width replaced) and scored on
the held-out matched energy score and the exact-posterior check at β = 2, u = v = 0
(etweedie.training.gaussian_posterior_check); one JSON line per variant is printed and appended to
OUT/ablation.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from etweedie.training import gaussian_posterior_check, held_out_loss, load_config, load_posterior, train
from experiments import _cli


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--variant", action="append", required=True, help="conditioning:output[:width], e.g. film:scaled_residual or concat:residual:200")
    parser.add_argument("--out", default="runs/ablation")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--batch-size", type=int, dest="batch_size", help="override the config's batch_size")
    parser.add_argument("--draws", type=int, help="override the config's draws m")
    args = parser.parse_args(argv)
    # every flag and variant is checked before the first training starts
    for flag, low in (("--steps", 1), ("--seed", 0), ("--batch-size", 1), ("--draws", 2)):
        _cli.at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
    base = _cli.read_config("--config", args.config, load_config)
    over = {k: getattr(args, k) for k in ("steps", "seed", "batch_size", "draws") if getattr(args, k) is not None}
    if over:
        base = dataclasses.replace(base, **over)
    configs = [(variant, _variant_config(base, variant)) for variant in args.variant]
    _cli.out_dir("--out", args.out)
    out = Path(args.out)
    for variant, config in configs:
        conditioning, output, width = config.model.conditioning, config.model.output, config.model.width
        run_dir = out / f"{conditioning}_{output}_w{width}_B{config.batch_size}_m{config.draws}_s{config.seed}"
        start = time.perf_counter()
        summary = train(config, run_dir, progress=False)
        wall = time.perf_counter() - start
        torch.set_num_threads(1)
        posterior = load_posterior(summary["posterior"])
        check = gaussian_posterior_check(posterior)
        row = {
            "variant": variant,
            "config": args.config,
            "steps": config.steps,
            "seed": config.seed,
            "batch_size": config.batch_size,
            "draws": config.draws,
            "params": sum(p.numel() for p in posterior.parameters()),
            "train_wall_s": round(wall, 1),
            "final_train_loss": summary["final_loss"],
            "held_out_es": held_out_loss(posterior, config),
            "gauss_pm_mse": check["pm_mse"],
            "gauss_score_nmse": check["score_nmse"],
            "per_sigma_score_nmse": {k: round(v["score_nmse"], 4) for k, v in check["per_sigma"].items()},
        }
        print(json.dumps(row), flush=True)
        with open(out / "ablation.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def _variant_config(base, variant: str):
    """The config of one ``--variant conditioning:output[:width]`` (a UsageError naming it when malformed)."""
    parts = variant.split(":")
    if len(parts) not in (2, 3) or not all(p.strip() for p in parts):
        raise _cli.UsageError(f"--variant must be conditioning:output[:width], e.g. film:scaled_residual, got {variant!r}")
    conditioning, output, *width = parts
    if width and not width[0].strip().isdigit():
        raise _cli.UsageError(f"--variant {variant}: the width must be a whole number, got {width[0]!r}")
    try:
        width = int(width[0]) if width else base.model.width
        model = dataclasses.replace(base.model, conditioning=conditioning, output=output, width=width)
        return dataclasses.replace(base, model=model)
    except (ValueError, TypeError) as exc:
        raise _cli.UsageError(f"--variant {variant}: {' '.join(str(exc).split())}") from None


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.posterior_quality.architecture_ablation", main))
