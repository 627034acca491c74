"""Do the learned posteriors draw the noise's tails?  Residual tails per noise level.

For the estimation truth (β, λ, u, v) = (1.4, 1.8, 0.25, 0.35) and each σ, draws clean points x,
y = x + e, and posterior draws x' from the oracle (SIR on a clean bank) and from each learned
posterior.  It reports moments of the Mahalanobis residual t = ‖y − x'‖ in the noise's own metric
(Cov(e)^{-1/2}), beside those of the noise itself (t = ‖e‖): as σ → 0 the posterior tends to
y − e, so the residual law tends to the noise law, whose tails exp(−λ t^β) are heavier than a
Gaussian's for β < 2.  kurt = E t⁴ / (E t²)², q99/q50 = the 99 % over the 50 % quantile.

    OMP_NUM_THREADS=2 python -m experiments.estimation_diagnostics.posterior_tails --posterior-checkpoint runs/eg_full \
        --posterior-checkpoint runs/eg_nl_full [--sigmas 0.1 0.25 0.45 0.75] [--json PATH]
"""

from __future__ import annotations

import json

import torch

from etweedie.data import EightGaussians
from etweedie.noise import NoiseParams
from etweedie.posteriors import KnownPosterior
from etweedie.training import load_posterior
from experiments import _cli


def residual_stats(t: torch.Tensor, beta: float) -> dict:
    t = t.flatten().double()
    m2, m4 = t.pow(2).mean(), t.pow(4).mean()
    return {"mean": float(t.mean()), "m2": float(m2), "kurt": float(m4 / m2**2),
            "q99_q50": float(t.quantile(0.99) / t.quantile(0.5)), "m_beta": float(t.pow(beta).mean())}


def main(argv=None) -> None:
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posterior-checkpoint", action="append", default=[], metavar="PATH")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.1, 0.25, 0.45, 0.75])
    parser.add_argument("--queries", type=int, default=1500)
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    _cli.positive("--sigmas", args.sigmas)
    _cli.at_least("--queries", args.queries, 2)  # the quantiles and moments of the residuals
    _cli.at_least("--draws", args.draws, 1)
    _cli.at_least("--seed", args.seed, 0)
    _cli.out_file("--json", args.json)
    beta, lam, u, v = 1.4, 1.8, 0.25, 0.35
    ring = EightGaussians()
    oracle = KnownPosterior(method="sir", generator=torch.Generator().manual_seed(args.seed + 1))
    models = {path: _cli.load("--posterior-checkpoint", path, load_posterior) for path in args.posterior_checkpoint}
    g = torch.Generator().manual_seed(args.seed)
    rows = {}
    for sigma in args.sigmas:
        params = NoiseParams(beta, lam, sigma, u, v)
        law = params.noise(2)
        x, _ = ring.sample(args.queries, g, dtype=torch.float64)
        e = law.sample((args.queries,), generator=g).double()
        y = x + e
        whiten = torch.linalg.cholesky(torch.linalg.inv(law.covariance(2).double()))  # ‖r‖ = |Lᵀ r|

        def norm(r):
            return (r.double() @ whiten).norm(dim=-1)

        eta = params.eta().double().expand(args.queries, 5)
        sets = {"noise e": norm(e), "oracle posterior": norm(y[:, None] - oracle.sample(
            y, eta, args.draws, generator=torch.Generator().manual_seed(args.seed + 2)))}
        for path, model in models.items():
            with torch.no_grad():
                draws = model.sample(y.float(), eta.float(), args.draws, generator=torch.Generator().manual_seed(args.seed + 3))
            sets[path] = norm(y[:, None] - draws.double())
        rows[sigma] = {name: residual_stats(t, beta) for name, t in sets.items()}
        print(f"σ = {sigma}")
        for name, r in rows[sigma].items():
            print(f"  {name:40s} E t {r['mean']:.4f}  E t² {r['m2']:.4f}  kurt {r['kurt']:.4f}  "
                  f"q99/q50 {r['q99_q50']:.3f}  E t^β {r['m_beta']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"truth": {"beta": beta, "lam": lam, "u": u, "v": v}, "queries": args.queries, "draws": args.draws,
                       "seed": args.seed, "rows": {str(k): val for k, val in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.estimation_diagnostics.posterior_tails", main))
