"""MNIST digits from the shipped posterior along a noise path: the main use, in about a minute on two cores.

    python -m experiments.mnist.demo                 # what `make demo` runs
    python -m experiments.mnist.demo --path mnist_joint --images 512 --out runs/demo_joint

Samples ``--images`` digits with the noise-transport sampler (the protocol
:data:`experiments.mnist.sampling.TRANSPORT`: a 16-level lead-in from σ = 6, the paper's 64
levels, the mean of 16 draws at the last) along one of the five paper paths, with the shipped
``mnist_full`` posterior; writes ``samples.npy`` (uint8 (n, 28, 28)), ``samples.png`` (the grid)
and ``eval.json`` (the ``etweedie mnist-eval`` row: feature ED with its interval, confidence,
class TV, classes, nearest-train RMSE), and prints the row and where the files are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from experiments import _cli

from . import sampling


def main(argv: Optional[List[str]] = None) -> int:
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default="mnist_full", help="posterior name or path (default mnist_full)")
    p.add_argument("--path", choices=sampling.PATHS, default="mnist_generalized_nondiagonal")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--seed", type=int, default=3141)
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    def check():
        _cli.at_least("--images", args.images, 2)
        _cli.at_most("--images", args.images, 7952)  # held-out t10k images for the eval's null and real row
        _cli.at_least("--seed", args.seed, 0)
        _cli.threads("--threads", args.threads)
        _cli.out_dir("--out", args.out)

    status = _cli.report("demo", check)
    if status:
        return status
    try:
        posterior = _cli.load("--posterior", args.posterior, sampling.load_posterior, "a posterior name or path")
    except _cli.UsageError as exc:
        return _cli.fail("demo", exc)
    if args.threads:
        torch.set_num_threads(args.threads)
    from etweedie.evaluation import image_grid
    from etweedie.evaluation import MnistEvaluator
    from etweedie.sample import initial_states, sample_transport

    protocol = sampling.TRANSPORT
    plan = protocol.plan(args.path)
    g = torch.Generator().manual_seed(args.seed)
    y0 = initial_states(plan, None, args.images, sampling.D, generator=g, center=sampling.data_mean())
    print(f"sampling {args.images} digits along {args.path}: {protocol.describe().split(', 3 seeds')[0]}", flush=True)
    start = time.time()
    x = sample_transport(posterior, y0, plan, None, generator=g, chunk_chains=protocol.chunk_chains,
                         final_average=protocol.final_average)
    wall = time.time() - start
    images = sampling.to_uint8(x)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "samples.npy", images)
    grid = image_grid(images, out / "samples.png", title=f"{args.path}, {args.posterior}, seed {args.seed}")
    row = MnistEvaluator().evaluate(images, n_boot=200, null_draws=50)
    row.update(path=args.path, posterior=args.posterior, seed=args.seed, sampling_s=wall,
               images_per_s=args.images / wall, draws_per_image=protocol.draws_per_image)
    (out / "eval.json").write_text(json.dumps(row, indent=1, default=float))
    lo, hi = row["feature_ed_ci"]
    print(f"{args.images} digits in {wall:.1f} s ({args.images / wall:.1f} images/s, {protocol.draws_per_image} "
          f"posterior draws each)")
    print(f"feature ED {row['feature_ed']:.3f} [{lo:.3f}, {hi:.3f}] (real-vs-real null 95th pct {row['null_p95']:.3f}), "
          f"confidence {row['mean_confidence']:.3f}, class TV {row['class_tv']:.3f}, {row['classes_present']} classes, "
          f"nearest-train RMSE {row['nearest_train_rmse']:.3f}")
    print(f"images: {out / 'samples.npy'}  grid: {grid}  row: {out / 'eval.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.demo", main))
