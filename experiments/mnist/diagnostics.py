"""Per-level diagnostics: does the sampler or the posterior limit an MNIST result?

Two tables, for one posterior and the five paths (feature ED as in ``etweedie mnist-eval``, to
the 2,048-image t10k bank, on images held out from it):

* **floor** — truly noisy images: held-out t10k images plus a draw of each level's noise law,
  denoised by one posterior draw and by the mean of K.  This is the best a sampler can do at
  that level with this posterior: a sampler whose chains matched the level's marginal exactly
  would see these numbers.
* **chains** — a sampler's own chains (the transport protocol of
  :mod:`experiments.mnist.sampling`) at the same levels beside truly noisy images there: pixel
  mean of the states, the denoised draws' ink (share of pixels above 0.5) and feature ED, and
  the whitened residual ‖y − x‖_{Σ⁻¹} over its expected value under the level's noise (1 when
  y − x looks like that noise).  Where the chains' numbers match the truly noisy ones, the
  sampler tracks the marginals and the posterior limits; where they drift apart, the sampler does.

    python -m experiments.mnist.diagnostics --posterior mnist_full --out experiments/mnist/results/diagnostics
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from experiments import _cli

from . import sampling

FLOOR_RMS = (0.197, 0.35, 0.71, 1.42, 2.63)


def _nearest_levels(plan, rms) -> List[int]:
    return [int((plan.rms.log() - math.log(r)).abs().argmin()) for r in rms]


def _images(ev, n: int) -> torch.Tensor:
    return torch.as_tensor(ev.real_images(n)).reshape(n, sampling.D).float() / 255


def _radius_ratio(law, residual: torch.Tensor) -> float:
    """Mean whitened residual norm over its expectation under ``law`` (sampled)."""
    metric = law.metric
    expected = metric.sq_norm(law.sample((4096,), generator=torch.Generator().manual_seed(0))).sqrt().mean()
    return float(metric.sq_norm(residual.double()).sqrt().mean() / expected)


def _ed(ev, x: torch.Tensor) -> float:
    return float(ev.evaluate(sampling.to_uint8(x), n_boot=2, null_draws=0)["feature_ed"])


def floor_table(posterior, ev, paths, n: int, k: int, seed: int) -> Dict:
    clean = _images(ev, n)
    rows = {}
    for name in paths:
        plan = sampling.TRANSPORT.plan(name)
        g = torch.Generator().manual_seed(seed)
        rows[name] = {}
        for level in _nearest_levels(plan, FLOOR_RMS):
            law = plan.noise(level, sampling.D)
            y = clean + law.sample((n,), generator=g).float()
            eta = plan.eta(level, y).expand(n, 5)
            draws = posterior.sample(y, eta, k, generator=g)
            rows[name][f"{float(plan.rms[level]):.3f}"] = dict(one_draw=_ed(ev, draws[:, 0]), mean=_ed(ev, draws.mean(1)))
    return rows


def chain_table(posterior, ev, paths, n: int, seed: int, center: torch.Tensor) -> Dict:
    from etweedie.sample import initial_states, sample_transport

    protocol = sampling.TRANSPORT
    rows = {}
    for name in paths:
        plan = protocol.plan(name)
        tracked = _nearest_levels(plan, FLOOR_RMS)
        seen: Dict[int, Dict] = {}

        def look(info):
            if info["level"] in tracked:
                seen[info["level"]] = dict(state=info["state"].clone(), denoised=info["denoised"].clone())

        g = torch.Generator().manual_seed(seed)
        y0 = initial_states(plan, None, n, sampling.D, generator=g, center=center)
        sample_transport(posterior, y0, plan, None, generator=g, final_average=protocol.final_average,
                         callback=look, disable=True)
        clean = _images(ev, n)
        rows[name] = {}
        for level in tracked:
            law = plan.noise(level, sampling.D)
            y = clean + law.sample((n,), generator=g).float()
            x = posterior.sample(y, plan.eta(level, y).expand(n, 5), 1, generator=g)[:, 0]
            chain = seen[level]
            row = {}
            for who, (state, draw) in (("chains", (chain["state"], chain["denoised"])), ("truly_noisy", (y, x))):
                row[who] = dict(pixel_mean=float(state.mean()), ink=float((draw > 0.5).float().mean()),
                                residual_ratio=_radius_ratio(law, state - draw), feature_ed=_ed(ev, draw))
            rows[name][f"{float(plan.rms[level]):.3f}"] = row
    return rows


def format_tables(result: Dict) -> str:
    from .sampling_table import LABELS

    floor, chains = result["floor"], result["chains"]
    levels = list(next(iter(floor.values())))
    lines = ["Floor: feature ED of one draw / the mean of K draws from truly noisy held-out images", "",
             "| path | " + " | ".join(f"r = {r}" for r in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, row in floor.items():
        lines.append(f"| {LABELS[name]} | " + " | ".join(f"{row[r]['one_draw']:.3f} / {row[r]['mean']:.3f}"
                                                          for r in levels) + " |")
    lines += ["", "Chains against truly noisy images (chains / truly noisy)", "",
              "| path | r | pixel mean | ink of one draw | residual ratio | feature ED of one draw |",
              "|---|---|---|---|---|---|"]
    for name, per in chains.items():
        for r, row in per.items():
            c, t = row["chains"], row["truly_noisy"]
            lines.append(f"| {LABELS[name]} | {r} | {c['pixel_mean']:.3f} / {t['pixel_mean']:.3f} | "
                         f"{c['ink']:.3f} / {t['ink']:.3f} | {c['residual_ratio']:.3f} / {t['residual_ratio']:.3f} | "
                         f"{c['feature_ed']:.3f} / {t['feature_ed']:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default="mnist_full", help="posterior name or path, or untrained:WIDTH")
    p.add_argument("--out", required=True, help="folder for diagnostics.json and diagnostics.md")
    p.add_argument("--paths", nargs="+", choices=sampling.PATHS, default=list(sampling.PATHS))
    p.add_argument("--images", type=int, default=256, help="images per path and level (default 256)")
    p.add_argument("--mean-of", type=int, default=16, help="K, draws averaged in the floor table (default 16)")
    p.add_argument("--seed", type=int, default=3141)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    def check():
        _cli.threads("--threads", args.threads)
        _cli.at_least("--images", args.images, 2)
        _cli.at_most("--images", args.images, 7952)  # the held-out t10k images outside the bank
        _cli.at_least("--mean-of", args.mean_of, 1)
        _cli.at_least("--seed", args.seed, 0)
        _cli.out_dir("--out", args.out)

    status = _cli.report("diagnostics", check)
    if status:
        return status
    try:
        posterior = _cli.load("--posterior", args.posterior, sampling.load_posterior, "a posterior name or path")
    except _cli.UsageError as exc:
        return _cli.fail("diagnostics", exc)
    if args.threads:
        torch.set_num_threads(args.threads)
    from etweedie.evaluation import MnistEvaluator

    ev = MnistEvaluator()
    start = time.time()
    with torch.no_grad():
        result = dict(floor=floor_table(posterior, ev, args.paths, args.images, args.mean_of, args.seed),
                      chains=chain_table(posterior, ev, args.paths, args.images, args.seed, sampling.data_mean()))
    result.update(posterior=args.posterior, images=args.images, mean_of=args.mean_of, seed=args.seed,
                  wall_s=time.time() - start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps(result, indent=1))
    table = format_tables(result)
    (out / "diagnostics.md").write_text(table + "\n")
    print(table)
    print(f"{time.time() - start:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.diagnostics", main))
