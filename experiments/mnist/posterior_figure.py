"""Samples from the pretrained CPU-scale MNIST posterior: a short annealed-Langevin run per path.

Chains start from N(0, r_0² I) around the mid-grey image and follow each MNIST path of the paper
(:data:`etweedie.sample.paths.MNIST_PATHS`) on a shortened schedule (``--levels`` geometric levels of the
realized RMS 2.63 → 0.197, ``--steps`` Langevin updates per level, N posterior draws per score),
then take the final posterior draw at r = 0.197 (:func:`etweedie.sample.sample_langevin`).  The
figure has one block of chains per path; nothing is selected.

    PYTHONPATH=$PWD python experiments/mnist/posterior_figure.py \\
        --out experiments/mnist/figures/posterior_samples_cpu.png
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from etweedie.sample import get_path, level_times
from etweedie.sample import sample_langevin
from etweedie.training import load_posterior
from experiments import _cli

PATHS = ("mnist_gaussian_isotropic", "mnist_generalized_nondiagonal", "mnist_joint")


def main(argv=None) -> int:
    ap = _cli.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--posterior", default="mnist", help="registered name or weights directory (default: mnist)")
    ap.add_argument("--paths", nargs="*", default=list(PATHS))
    ap.add_argument("--chains", type=int, default=32)
    ap.add_argument("--levels", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="Langevin updates per level")
    ap.add_argument("--first-steps", type=int, default=50, help="updates at the first level")
    ap.add_argument("--n-posterior", type=int, default=16)
    ap.add_argument("--step-ratio", type=float, default=0.5, help="ε / r_L²: the terminal step in units of the terminal variance")
    ap.add_argument("--seed", type=int, default=2718)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="experiments/mnist/figures/posterior_samples_cpu.png")
    args = ap.parse_args(argv)
    for flag in ("chains", "levels", "steps", "first_steps", "n_posterior"):
        _cli.at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    _cli.threads("--threads", args.threads)
    _cli.positive("--step-ratio", args.step_ratio)
    if not args.paths:
        raise _cli.UsageError(f"--paths must name at least one path, e.g. {PATHS[0]}; got none")
    for name in args.paths:
        try:
            get_path(name)
        except (KeyError, ValueError) as exc:
            raise _cli.UsageError(f"--paths {name}: {' '.join(str(exc).split())}") from None
    _cli.out_file("--out", args.out)
    torch.set_num_threads(args.threads)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    posterior = _cli.load("--posterior", args.posterior, load_posterior, "a registered posterior name or weights folder")
    posterior = posterior.float()
    blocks, stats = [], {}
    for name in args.paths:
        path = get_path(name)
        schedule = level_times(args.levels)
        r0 = float(path(schedule[:1]).realized_rms()[0])
        r_last = float(path(schedule[-1:]).realized_rms()[0])
        g = torch.Generator().manual_seed(args.seed)
        y0 = 0.5 + r0 * torch.randn(args.chains, 784, generator=g)
        t0 = time.perf_counter()
        x = sample_langevin(posterior, y0, path, schedule, steps_per_level=args.steps, n_posterior=args.n_posterior,
                            step_scale=args.step_ratio * r_last**2, first_level_steps=args.first_steps,
                            generator=g, disable=True)
        stats[name] = dict(seconds=round(time.perf_counter() - t0, 1), pixel_min=float(x.min()), pixel_max=float(x.max()))
        blocks.append((path.description or name, x.clamp(0, 1).reshape(-1, 28, 28)))
    cols = 8
    rows_per = (args.chains + cols - 1) // cols
    fig, axes = plt.subplots(len(blocks) * rows_per, cols, figsize=(cols * 0.8, len(blocks) * rows_per * 0.8 + 0.4 * len(blocks)),
                             squeeze=False)
    for b, (title, imgs) in enumerate(blocks):
        for i in range(rows_per * cols):
            ax = axes[b * rows_per + i // cols, i % cols]
            ax.axis("off")
            if i < imgs.shape[0]:
                ax.imshow(imgs[i].numpy(), cmap="gray", vmin=0, vmax=1)
        axes[b * rows_per, 0].set_title(title, fontsize=8, loc="left")
    fig.tight_layout(pad=0.2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(json.dumps(dict(vars(args), stats=stats), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.posterior_figure", main))
