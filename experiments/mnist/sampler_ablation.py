"""Sampler ablation on one MNIST path: which settings of the noise-transport sampler measure best.

Each row changes one setting of :data:`experiments.mnist.sampling.TRANSPORT` (16-level lead-in
from σ = 6, the paper's 64 levels, one draw per step, the mean of 16 draws at the end) and
samples the same chains (same seed, 256 images), scored with the ``etweedie mnist-eval``
evaluator; the posterior draws per image stand beside.

    python -m experiments.mnist.sampler_ablation --posterior mnist_full --out experiments/mnist/results/ablation_transport
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from experiments import _cli

from . import sampling

#: name -> (plan changes, sampler keywords)
ROWS: Dict[str, tuple] = {
    "transport (protocol)": ({}, {}),
    "no lead-in (start at r = 2.63)": ({"lead_in": 0}, {}),
    "no lead-in, 8 warm-up Gibbs sweeps": ({"lead_in": 0}, {"warmup": 8}),
    "32-level lead-in": ({"lead_in": 32}, {}),
    "final: one draw": ({}, {"final_average": 1}),
    "final: mean of 64": ({}, {"final_average": 64}),
    "mean of 2 draws per step": ({}, {"mean_draws": 2}),
    "churn 0.3": ({}, {"churn": 0.3}),
    "churn 1 (fresh noise each step)": ({}, {"churn": 1.0}),
    "1 Gibbs sweep per level at r >= 1": ({}, {"gibbs_steps": 1, "gibbs_min_rms": 1.0}),
}


def main(argv: Optional[List[str]] = None) -> int:
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default="mnist_full")
    p.add_argument("--path", choices=sampling.PATHS, default="mnist_gaussian_nondiagonal")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--seed", type=int, default=3141)
    p.add_argument("--out", required=True, help="folder for ablation.json and ablation.md")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    def check():
        _cli.at_least("--images", args.images, 2)
        _cli.at_least("--seed", args.seed, 0)
        _cli.threads("--threads", args.threads)
        _cli.out_dir("--out", args.out)

    status = _cli.report("sampler_ablation", check)
    if status:
        return status
    try:
        posterior = _cli.load("--posterior", args.posterior, sampling.load_posterior, "a posterior name or path")
    except _cli.UsageError as exc:
        return _cli.fail("sampler_ablation", exc)
    if args.threads:
        torch.set_num_threads(args.threads)
    import dataclasses

    from etweedie.evaluation import MnistEvaluator
    from etweedie.sample import DrawCounter, initial_states, sample_transport

    ev, center, rows = MnistEvaluator(), sampling.data_mean(), {}
    for name, (plan_changes, kwargs) in ROWS.items():
        protocol = dataclasses.replace(sampling.TRANSPORT, **plan_changes)
        plan = protocol.plan(args.path)
        g = torch.Generator().manual_seed(args.seed)
        y0 = initial_states(plan, None, args.images, sampling.D, generator=g, center=center)
        counted = DrawCounter(posterior)
        start = time.time()
        x = sample_transport(counted, y0, plan, None, generator=g, chunk_chains=protocol.chunk_chains,
                             **{"final_average": protocol.final_average, **kwargs}, disable=True)
        wall = time.time() - start
        row = ev.evaluate(sampling.to_uint8(x), n_boot=200, null_draws=0)
        rows[name] = dict(feature_ed=row["feature_ed"], feature_ed_ci=row["feature_ed_ci"],
                          mean_confidence=row["mean_confidence"], class_tv=row["class_tv"],
                          nearest_train_rmse=row["nearest_train_rmse"],
                          draws_per_image=counted.draws_per_chain(args.images), wall_s=wall)
        print(f"{name}: feature ED {row['feature_ed']:.3f}, {rows[name]['draws_per_image']:.0f} draws per image",
              flush=True)
    lines = [f"Sampler ablation, {args.path}, seed {args.seed}, {args.images} images, posterior {args.posterior}", "",
             "| sampler | feature ED [95% CI] | mean confidence | class TV | nearest-train RMSE | draws / image |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lo, hi = r["feature_ed_ci"]
        lines.append(f"| {name} | {r['feature_ed']:.3f} [{lo:.3f}, {hi:.3f}] | {r['mean_confidence']:.3f} | "
                     f"{r['class_tv']:.3f} | {r['nearest_train_rmse']:.3f} | {r['draws_per_image']:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    (out / "ablation.json").write_text(json.dumps(dict(path=args.path, seed=args.seed, images=args.images,
                                                       posterior=args.posterior, rows=rows), indent=1, default=float))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.sampler_ablation", main))
