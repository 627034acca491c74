"""Sampler throughput at the full config's shapes and where the time goes.

4,096 chains, N = 64 posterior draws, d = 2, 10 Langevin steps on each of the first LEVELS
levels of the joint path's 51-level schedule; prints the ThroughputTimer split (posterior
forward vs fused score/step kernel vs rest) per posterior.

    OMP_NUM_THREADS=1 python -m experiments.eight_gaussians.sampler_throughput [--checkpoint RUN_DIR] [--levels 2] [--no-blocking]
"""

import json

import torch

from etweedie.posteriors import KnownPosterior
from etweedie.sample import get_path, level_times
from etweedie.sample import ThroughputTimer, sample_langevin
from experiments import _cli

LEVELS = 51  # the joint path's schedule


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", default=[], help="learned posterior(s) to time as well")
    parser.add_argument("--chains", type=int, default=4096)
    parser.add_argument("--levels", type=int, default=2, help=f"levels timed, from the first (1 to {LEVELS})")
    parser.add_argument("--no-blocking", action="store_true",
                        help="one forward per posterior call (EngressionPosterior.CPU_INFERENCE_ROWS = None): the old behaviour")
    args = parser.parse_args(argv)
    _cli.at_least("--chains", args.chains, 1)
    _cli.at_least("--levels", args.levels, 1)
    _cli.at_most("--levels", args.levels, LEVELS)
    _cli.nonempty("--checkpoint", args.checkpoint, "a run directory or checkpoint")
    if args.no_blocking:
        from etweedie.posteriors import EngressionPosterior

        EngressionPosterior.CPU_INFERENCE_ROWS = None
    posteriors = [("known", KnownPosterior())]
    if args.checkpoint:
        from etweedie.training import load_posterior

        posteriors += [(f"learned {path}", _cli.load("--checkpoint", path, load_posterior)) for path in args.checkpoint]
    for name, posterior in posteriors:
        g = torch.Generator().manual_seed(0)
        timer = ThroughputTimer()
        y0 = 1.65 * torch.randn(args.chains, 2, generator=g)
        sample_langevin(
            posterior, y0, get_path("joint"), level_times(LEVELS)[: args.levels], steps_per_level=10, n_posterior=64,
            step_scale=2e-5, generator=g, disable=True, timer=timer, final_draw=False,
        )
        print(name, json.dumps({k: round(v, 3) for k, v in timer.as_dict().items()}), flush=True)


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.eight_gaussians.sampler_throughput", main))
