"""Which known level carries the learned posterior's β̂ offset.

Fits the generalized family (Algorithm 1, oracle IS score) on ONE known level at a time (and
then on all levels, as the experiment does), with the oracle SIR posterior and with each
learned posterior, on the replicates of
configs/estimate_spd.toml (same observations, draws and seeds as `python -m experiments.eight_gaussians.estimation`).  A level
where the learned rows leave the oracle row is where the posterior model is off.

    OMP_NUM_THREADS=1 python -m experiments.estimation_diagnostics.per_level_beta \
        --posterior-checkpoint runs/eg_full --posterior-checkpoint runs/eg_full_seed43 \
        --replicates 0 3 [--antithetic] [--oracle-draws 1024] [--split-half]
"""

import dataclasses
import json

import torch

from experiments import _cli
from experiments.eight_gaussians import estimation as ee
from etweedie.data import posterior_sample_sir
from etweedie.estimate import EstimatorSettings, estimate_noise


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/estimate_spd.toml")
    parser.add_argument("--posterior-checkpoint", action="append", required=True, metavar="PATH")
    parser.add_argument("--replicates", type=int, nargs="+", default=[0])
    parser.add_argument("--antithetic", action="store_true", help="antithetic draws from the learned posteriors")
    parser.add_argument("--oracle-draws", type=int, metavar="K",
                        help="redraw the oracle (SIR) posterior with K draws per observation instead of the config's")
    parser.add_argument("--split-half", action="store_true", help="the split-half debiased objective (EstimatorSettings.split_half)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    _cli.at_least("--replicates", args.replicates, 0)
    _cli.at_least("--oracle-draws", args.oracle_draws, 1)
    _cli.out_file("--json", args.json)
    torch.set_num_threads(1)

    config = ee.validate_config(_cli.read_config("--config", args.config, ee.load_config))
    truth = config["truth"]
    if args.split_half:
        config["estimator"]["split_half"] = True
    settings = EstimatorSettings(**config["estimator"], level_scale=truth["level_scale"])
    models = [_cli.load("--posterior-checkpoint", path, lambda p: ee._load_posteriors([p])[0])
              for path in args.posterior_checkpoint]
    rows = []
    print(f"truth β {truth['beta']} λ {truth['lam']} u {truth['u']} v {truth['v']}; generalized family, oracle score")
    for rep in args.replicates:
        levels = ee.make_replicate(config, rep, progress=False)["levels"]
        if args.oracle_draws:
            bank = ee.replicate_observations(config, rep)["posterior_bank"]
            for i, lv in enumerate(levels):
                lv["x_est"] = posterior_sample_sir(lv["y_est"], bank, lv["law"], args.oracle_draws,
                                                   ee._stream(config["seed"], rep, 99 + i))
        learned = []
        for j, model in enumerate(models):
            # the experiment's own sampler and stream, so the draws equal `python -m experiments.eight_gaussians.estimation`'s
            sampler = ee.learned_posterior_sampler(model, truth, config["learned_posterior"]["chunk"], args.antithetic)
            g = ee._stream(config["seed"], rep, 50 + j)
            learned.append([sampler(lv["y_est"], lv["sigma"], settings.n_posterior, g) for lv in levels])
        # each level alone, then all levels together (the experiment's fit)
        for sel in [[i] for i in range(len(levels))] + [list(range(len(levels)))]:
            sources = [("oracle", [levels[i]["x_est"] for i in sel])]
            sources += [(f"learned{j}", [x[i] for i in sel]) for j, x in enumerate(learned)]
            cells = []
            for name, draws in sources:
                est = estimate_noise([levels[i]["y_est"] for i in sel], sigma=[levels[i]["sigma"] for i in sel],
                                     posterior_samples=draws, scores=[levels[i]["s_est"] for i in sel],
                                     family="generalized",
                                     settings=dataclasses.replace(settings, n_posterior=draws[0].shape[1]),
                                     generator=ee._stream(config["seed"], rep, 60), progress=False)
                label = "all" if len(sel) > 1 else levels[sel[0]]["sigma"]
                rows.append(dict(replicate=rep, sigma=label, posterior=name, beta=est.beta, lam=est.lam,
                                 u=est.u, v=est.v))
                cells.append(f"{name} β {est.beta:.3f} λ {est.lam:.3f} u {est.u:.3f} v {est.v:.3f}")
            level = "all " if len(sel) > 1 else f"{levels[sel[0]]['sigma']:.2f}"
            print(f"rep {rep} σ {level} | " + " | ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.estimation_diagnostics.per_level_beta", main))
