"""Coverage of the seed-stratified bootstrap intervals for mode-weight TV and minimum
mode mass, percentile against basic (etweedie.evaluation.metrics.stratified_bootstrap, ``method=``).

Both statistics are plug-in functions of the eight mode weights and are biased at the diffusion
tables' sizes: TV upward (most of all when the true TV is near 0), the minimum downward (most of
all when several modes tie for it).  Each data set is three seeds of ``n`` mode labels drawn from
known weights (a point's label is its nearest mode; on the ring the modes are 7.7 std apart, so
labels stand in for points); the script counts how often each 95 % interval covers the true value
and reports the mean interval width.  Weight scenarios: half the modes at 1/8 + TV/4 and half at
1/8 − TV/4 (four tied minima), and one mode low at 0.105 with the rest equal (a single minimum).

    OMP_NUM_THREADS=1 python -m experiments.bootstrap_intervals.coverage --datasets 200 --n-boot 200
"""

from __future__ import annotations


import torch
from tqdm import tqdm

from etweedie.evaluation import stratified_bootstrap
from experiments import _cli

K = 8


def _weights(x: torch.Tensor) -> torch.Tensor:
    return torch.bincount(x.flatten().long(), minlength=K).double() / x.shape[0]


def _tv(w: torch.Tensor) -> float:
    return float((w - 1 / K).abs().sum() / 2)


STATISTICS = {
    "mode_weight_tv": (lambda x: _tv(_weights(x)), _tv, (0.0, 1 - 1 / K)),
    "min_mode_mass": (lambda x: float(_weights(x).min()), lambda w: float(w.min()), (0.0, 1 / K)),
}


def scenarios():
    for tv in (0.0, 0.01, 0.02, 0.04):
        w = torch.full((K,), 1 / K, dtype=torch.float64)
        w[: K // 2] += tv / 4
        w[K // 2:] -= tv / 4
        yield f"TV {tv:.2f}, 4 tied minima", w
    w = torch.full((K,), (1 - 0.105) / (K - 1), dtype=torch.float64)
    w[0] = 0.105
    yield "one mode at 0.105", w


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 4096], help="points per seed (3 seeds)")
    parser.add_argument("--datasets", type=int, default=200, help="independent data sets per scenario and size")
    parser.add_argument("--n-boot", type=int, default=200, help="bootstrap replicates (the tables use 200)")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    _cli.at_least("--sizes", args.sizes, 1)  # before the table's header
    _cli.at_least("--datasets", args.datasets, 1)
    _cli.at_least("--n-boot", args.n_boot, 2)
    g = torch.Generator().manual_seed(args.seed)
    print("| points per seed | true weights | statistic | truth | mean estimate | "
          "percentile: coverage, width | basic: coverage, width |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        for label, w in scenarios():
            tally = {(s, m): [0, 0.0] for s in STATISTICS for m in ("percentile", "basic")}
            est_sum = dict.fromkeys(STATISTICS, 0.0)
            for _ in tqdm(range(args.datasets), desc=f"n = {n}, {label}", leave=False):
                groups = [torch.multinomial(w, n, replacement=True, generator=g).double()[:, None] for _ in range(3)]
                seed = int(torch.randint(2**62, (1,), generator=g))
                for name, (fn, truth_fn, bounds) in STATISTICS.items():
                    truth = truth_fn(w)
                    for method in ("percentile", "basic"):  # same replicates for both: same generator seed
                        est, lo, hi = stratified_bootstrap(
                            fn, groups, n_boot=args.n_boot, generator=torch.Generator().manual_seed(seed),
                            method=method, bounds=bounds,
                        )
                        tally[name, method][0] += lo <= truth <= hi
                        tally[name, method][1] += hi - lo
                    est_sum[name] += est
            for name, (_, truth_fn, _) in STATISTICS.items():
                cells = [f"{tally[name, m][0] / args.datasets:.2f}, {tally[name, m][1] / args.datasets:.4f}"
                         for m in ("percentile", "basic")]
                print(f"| {n} | {label} | {name} | {truth_fn(w):.4f} | {est_sum[name] / args.datasets:.4f} | "
                      f"{cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.bootstrap_intervals.coverage", main))
