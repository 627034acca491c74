"""Does the final step carry the CPU-scale gap?  The CPU protocol's chains on one path, then the
paper's final posterior draw against the mean of K draws at r = 0.197, scored alike.

    PYTHONPATH=$PWD python experiments/mnist/final_step_check.py --path mnist_generalized_nondiagonal

Prints one row per variant (the chain states before the final step, one draw, the mean of 4, 16
and 64 draws): feature ED, mean confidence, class TV, classes present, nearest-train RMSE.
"""

from __future__ import annotations

import json
import time

import torch

from etweedie.evaluation import MnistEvaluator
from etweedie.data import load_mnist
from etweedie.sample import get_path, level_times
from etweedie.sample import sample_sharded
from etweedie.training import load_posterior
from experiments import _cli
from experiments.mnist import sampling


def main(argv=None) -> int:
    ap = _cli.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="mnist_generalized_nondiagonal", choices=sampling.PATHS)
    ap.add_argument("--posterior", default="mnist")
    ap.add_argument("--n-boot", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # checked before the sampling (minutes): the scoring's flags too
    _cli.at_least("--n-boot", args.n_boot, 2)
    _cli.threads("--threads", args.threads)
    _cli.out_file("--json", args.json)
    torch.set_num_threads(args.threads)
    protocol = sampling.CPU
    post = _cli.load("--posterior", args.posterior, load_posterior, "a registered posterior name or weights folder")
    center = load_mnist("train")[0].flatten(1).float().mean(0) / 255
    path = get_path(args.path)
    states = []
    for seed in protocol.seeds:
        t0 = time.time()
        states.append(sample_sharded(
            post, path, level_times(protocol.levels), n_chains=protocol.images_per_seed, dim=784, seed=seed,
            chunk_chains=protocol.chunk_chains, center=center, steps_per_level=protocol.steps_per_level,
            first_level_steps=protocol.first_level_steps, n_posterior=protocol.n_posterior,
            step_scale=protocol.step_scale, final_draw=False, disable=True))
        print(f"seed {seed}: {time.time() - t0:.1f} s", flush=True)
    y = torch.cat(states)
    eta = path(torch.tensor([1.0], dtype=torch.float64)).eta().float().expand(y.shape[0], 5)
    with torch.no_grad():
        draws = post.sample(y, eta, 64, generator=torch.Generator().manual_seed(0))
    variants = {"state": y, "one draw": draws[:, 0], "mean of 4": draws[:, :4].mean(1),
                "mean of 16": draws[:, :16].mean(1), "mean of 64": draws.mean(1)}
    evaluator, out = MnistEvaluator(), {}
    for name, v in variants.items():
        images = torch.from_numpy(sampling.to_uint8(v)).float() / 255
        row = evaluator.evaluate(images, groups=len(protocol.seeds), n_boot=args.n_boot, null_draws=0)
        out[name] = {k: row[k] for k in ("feature_ed", "mean_confidence", "class_tv", "classes_present",
                                         "nearest_train_rmse")}
        print(name, out[name], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.final_step_check", main))
