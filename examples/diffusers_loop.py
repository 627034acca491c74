"""A diffusers sampling loop with etweedie's Energy-Tweedie Langevin scheduler.

`EnergyTweedieLangevinScheduler` is a diffusers scheduler (save_pretrained / from_pretrained,
`set_timesteps`, `step(model_output, t, sample, generator=...)`).  Its model output is a set of
posterior draws at the current sample; here they come from the exact posterior of the
eight-Gaussians ring (`KnownPosterior`), so the samples should be as close to the data as a fresh
clean draw of the same size: the script prints both energy distances.

    python examples/diffusers_loop.py [--path gaussian] [--chains 1024] [--levels 21] [--steps 5] [--draws 16] [--seed 0]

Any built-in path works (`--path rotating` follows a non-Gaussian, rotating-covariance noise path).
"""

import argparse
import math
import tempfile

import torch

import etweedie
from etweedie.data import EightGaussians
from etweedie.interop.diffusers_scheduler import EnergyTweedieLangevinScheduler
from etweedie.posteriors import KnownPosterior


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="gaussian")
    parser.add_argument("--chains", type=int, default=1024)
    parser.add_argument("--levels", type=int, default=21)
    parser.add_argument("--steps", type=int, default=5, help="Langevin updates per level")
    parser.add_argument("--draws", type=int, default=16, help="posterior draws per update")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data, posterior = EightGaussians(), KnownPosterior()
    scheduler = EnergyTweedieLangevinScheduler(
        path=args.path, steps_per_level=args.steps, step_scale=2e-5, data_std=math.sqrt(data.radius**2 / 2 + data.std**2)
    )
    with tempfile.TemporaryDirectory() as folder:  # a scheduler config travels as JSON, like any diffusers scheduler
        scheduler.save_pretrained(folder)
        scheduler = EnergyTweedieLangevinScheduler.from_pretrained(folder)

    g = torch.Generator().manual_seed(args.seed)
    n = args.chains
    scheduler.set_timesteps(args.levels)
    sample = scheduler.init_noise_sigma * torch.randn(n, 2, generator=g, dtype=torch.float64)
    for t in scheduler.timesteps:
        draws = posterior.sample(sample, scheduler.eta(t, n), args.draws, generator=g)  # the "model output"
        sample = scheduler.step(draws, t, sample, generator=g).prev_sample
    # denoise: one posterior draw at the terminal level
    sample = posterior.sample(sample, scheduler.eta(scheduler.timesteps[-1], n), 1, generator=g)[:, 0]

    clean = data.sample(n, g, dtype=torch.float64)[0]
    fresh = data.sample(n, g, dtype=torch.float64)[0]
    ed = float(etweedie.energy_distance(sample, clean))
    floor = float(etweedie.energy_distance(fresh, clean))
    print(f"path {args.path}: {len(scheduler.timesteps)} Langevin updates over {args.levels} levels, {n} chains")
    print(f"energy distance to clean data: samples {ed:.5f}, a fresh clean draw {floor:.5f}")
    return ed, floor


if __name__ == "__main__":
    main()
