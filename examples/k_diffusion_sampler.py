"""k-diffusion's ODE samplers with an etweedie denoiser built from posterior draws.

`KDiffusionDenoiser` is the `model(x, sigma)` k-diffusion's samplers call: D(x, σ) = x + σ² s(x),
with the score s from N posterior draws by the Energy-Tweedie route (Gaussian paths only: the
probability-flow ODE these samplers integrate assumes Gaussian noise).  The posterior here is the
exact one of the eight-Gaussians ring; the script prints the energy distance of each sampler's
output to clean data next to that of a fresh clean draw.

    python examples/k_diffusion_sampler.py [--chains 1024] [--steps 20] [--draws 16] [--seed 0]

Needs `pip install --no-deps k-diffusion torchsde torchdiffeq trampoline scipy` (no torchvision; the
samplers import scipy, which `--no-deps` would not pull in).
"""

import argparse

import torch

import etweedie
from etweedie.data import EightGaussians
from etweedie.interop import KDiffusionDenoiser, load_k_diffusion_sampling
from etweedie.posteriors import KnownPosterior
from etweedie.sample import GeometricRMS, get_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="noise levels (sampler steps)")
    parser.add_argument("--draws", type=int, default=16, help="posterior draws per denoiser call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    sampling = load_k_diffusion_sampling()  # k_diffusion.sampling, without the package's torchvision imports
    g = torch.Generator().manual_seed(args.seed)
    data = EightGaussians()
    # σ_max must dwarf the data (radius 2): k-diffusion starts from x ≈ σ_max·ε.
    path = get_path("gaussian", GeometricRMS(20.0, 0.01))
    denoiser = KDiffusionDenoiser(KnownPosterior(), path, n_draws=args.draws, generator=g)
    sigmas = denoiser.sigmas(args.steps)
    clean = data.sample(args.chains, g, dtype=torch.float64)[0]
    fresh = data.sample(args.chains, g, dtype=torch.float64)[0]
    print(f"energy distance to clean data, {args.chains} samples: a fresh clean draw {float(etweedie.energy_distance(fresh, clean)):.5f}")
    results = {}
    for name in ("sample_euler", "sample_heun", "sample_dpmpp_2m"):
        x = sigmas[0] * torch.randn(args.chains, 2, generator=g, dtype=torch.float64)
        out = getattr(sampling, name)(denoiser, x, sigmas, disable=True)
        results[name] = float(etweedie.energy_distance(out, clean))
        print(f"  {name:<16} {results[name]:.5f}")
    return results


if __name__ == "__main__":
    main()
