"""The image-scale sampler against an exact posterior: the empirical MNIST law of a bank of training images.

For data uniform on a bank {x_j} of M clean images and noise e ~ q_η (any path's law), the
posterior is exact and discrete, P(x_j | y) ∝ q_η(y − x_j) — no model involved.  Annealed
Langevin along a path with this posterior must then bring every chain to one bank image plus
the terminal level's noise: before the final draw, the RMSE from a chain state to its nearest
bank image is about the level's realized RMS (r = 0.197, a little more from the Langevin
discretization), and the exact posterior at the terminal level puts nearly all its mass on one
bank image (reported: the largest weight per chain).  This checks the
sampler, the schedule, the step-size curve and the chain starts of the MNIST protocol
independently of a trained posterior's quality.

    python -m experiments.mnist.bank_posterior_check --out experiments/mnist/results/cpu
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from etweedie.data import load_mnist
from etweedie.noise import NoiseParams
from etweedie.sample import get_path, level_times
from etweedie.sample import initial_states, sample_langevin

from experiments import _cli

from . import sampling, sampling_figures


class BankPosterior:
    """Exact posterior of the empirical law of ``bank`` (M, d) in [0, 1] under the noise of η."""

    def __init__(self, bank: torch.Tensor):
        self.bank = bank.double()

    def weights(self, y, eta) -> torch.Tensor:
        """P(x_j | y) for every bank image: ``(C, M)``."""
        law = NoiseParams.from_eta(eta.reshape(-1, 5)[0].double()).noise(self.bank.shape[1])
        return torch.softmax(law.log_prob(y.double()[:, None, :] - self.bank[None]), 1)

    def sample(self, y, eta, n, *, generator):
        pick = torch.multinomial(self.weights(y, eta).float(), n, replacement=True, generator=generator)
        return self.bank[pick].to(y.dtype)


def main(argv=None) -> int:
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--bank", type=int, default=1000, help="bank size M (the first M training images)")
    p.add_argument("--chains", type=int, default=9)
    p.add_argument("--paths", nargs="+", default=["mnist_gaussian_isotropic", "mnist_generalized_nondiagonal"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    _cli.at_least("--bank", args.bank, 1)
    _cli.at_most("--bank", args.bank, 60000)  # the MNIST training images
    _cli.at_least("--chains", args.chains, 1)
    for name in args.paths:
        if name not in sampling_figures.TITLES:
            raise _cli.UsageError(f"--paths must name MNIST paths ({', '.join(sampling_figures.TITLES)}), got {name!r}")
    _cli.out_dir("--out", args.out)
    protocol = sampling.CPU
    images, _ = load_mnist("train")
    bank = images[: args.bank].reshape(-1, sampling.D).double() / 255
    posterior = BankPosterior(bank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report, states = {}, {}
    for name in args.paths:
        path, schedule = get_path(name), level_times(protocol.levels)
        g = torch.Generator().manual_seed(args.seed)
        y0 = initial_states(path, schedule, args.chains, sampling.D, generator=g, center=bank.mean(0).float())
        t0 = time.time()
        x = sample_langevin(posterior, y0, path, schedule, steps_per_level=protocol.steps_per_level,
                            first_level_steps=protocol.first_level_steps, n_posterior=protocol.n_posterior,
                            step_scale=protocol.step_scale, generator=g, disable=True, final_draw=False)
        rmse = (torch.cdist(x.double(), bank).min(1).values / sampling.D ** 0.5).tolist()
        top = posterior.weights(x, path(schedule[-1:]).eta()).max(1).values.tolist()
        report[name] = dict(nearest_bank_rmse=rmse, top_posterior_weight=top, wall_s=time.time() - t0)
        states[name] = np.clip(x.numpy(), 0, 1).reshape(-1, 28, 28)
        print(f"{name}: nearest-bank RMSE of the chain states before the final draw "
              f"{np.mean(rmse):.3f} (min {min(rmse):.3f}, max {max(rmse):.3f}); largest posterior weight of one "
              f"bank image at the terminal level: min {min(top):.4f} over the chains", flush=True)
    plt = sampling_figures._plt()
    fig, axes = plt.subplots(1, len(states), figsize=(2.4 * len(states), 2.8), squeeze=False)
    for ax, (name, s) in zip(axes[0], states.items()):
        sampling_figures._show(ax, sampling_figures.tile(s, 3), sampling_figures.TITLES[name].replace(" / ", "\n"))
    fig.suptitle(f"Exact bank posterior (M = {args.bank}): chain states at r = 0.197, before the final draw", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "mnist_bank_posterior_check.png", dpi=150)
    plt.close(fig)
    report["protocol"] = dataclasses.asdict(protocol)
    report["bank"] = args.bank
    (out / "bank_posterior_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.bank_posterior_check", main))
