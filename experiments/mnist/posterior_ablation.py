"""MNIST posterior design ablation at CPU scale (experiments/mnist/RESULTS.md, "Posterior: design ablation").

Each arm trains the image Engression posterior for a fixed number of steps with the library's
training step (:func:`etweedie.training.engression._loss_and_backward`: matched energy score, per-example β and
the block metric I₃₉₂ ⊗ S(u, v), m draws) over the paper's prior (σ ∈ [0.025, 6], β ∈ [1.3, 2],
λ ∈ [1, 2.5], ‖(u, v)‖ ≤ 0.7), and is scored on held-out test images at the sampler's realized-RMS
levels r ∈ {0.197, 0.5, 1.3, 2.63} with the generalized/non-diagonal tuple (β, λ, u, v) = (1.4, 1.8, 0, 0.6):

* ``es``: the matched energy score (the training loss; lower is better, comparable across arms);
* ``es_pix``: the Euclidean energy score with β = 1 in pixel units (strictly proper, comparable
  across levels);
* ``mse``: per-pixel MSE of the mean of the draws against the clean image.

It also writes a grid of posterior draws per arm (``draws_<arm>.png``: clean, noisy, 3 draws at
r = 0.197 and at r = 1.3).

    PYTHONPATH=$PWD python experiments/mnist/posterior_ablation.py --steps 1500 --out experiments/mnist/results/ablation
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from etweedie.posteriors import EngressionPosterior
from etweedie.noise import NoiseParams
from etweedie.ops import energy_score
from etweedie.training import NoisePrior
from etweedie.training.engression import _loss_and_backward
from experiments import _cli

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
LEVELS = (0.197, 0.5, 1.3, 2.63)
EVAL_TUPLE = dict(beta=1.4, lam=1.8, u=0.0, v=0.6)


def read_idx_images(path: Path) -> torch.Tensor:
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    n, rows, cols = (int.from_bytes(raw[i : i + 4], "big") for i in (4, 8, 12))
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows * cols).copy())


class SamplerWeightedPrior(NoisePrior):
    """With probability ``p``: realized RMS r log-uniform on [r_lo, r_hi] (the sampler's range with a
    margin) and σ = r λ^{1/β} clipped to the σ range; otherwise the paper's log-uniform σ."""

    def __init__(self, *args, p=0.8, r_range=(0.15, 3.0), **kw):
        super().__init__(*args, **kw)
        self.p, self.r_range = p, r_range

    def sample(self, n, generator, *, dtype=torch.float32, device=None):
        base = super().sample(n, generator, dtype=torch.float64)
        beta, lam, sigma, u, v = base._tensors()
        unif = torch.rand(2, n, generator=generator, dtype=torch.float64)
        lo, hi = math.log(self.r_range[0]), math.log(self.r_range[1])
        r = torch.exp(lo + (hi - lo) * unif[0])
        sigma_r = (r * lam ** (1 / beta)).clamp(self.sigma[0], self.sigma[1])
        sigma = torch.where(unif[1] < self.p, sigma_r, sigma)
        return NoiseParams(*(t.to(dtype) for t in (beta, lam, sigma, u, v)))


ARMS = {
    # name: (model kwargs, options); listed in the order they run
    "precond": (dict(output="preconditioned"), {}),
    "scaled_residual": (dict(output="scaled_residual"), {}),
    "direct": (dict(output="direct"), {}),
    "precond_sampler_prior": (dict(output="preconditioned"), {"prior": "sampler"}),
    "precond_nd64": (dict(output="preconditioned", noise_dim=64), {}),
    "precond_d4": (dict(output="preconditioned", depth=4), {}),
    "precond_w512": (dict(output="preconditioned", width=512), {}),
    "precond_m4": (dict(output="preconditioned"), {"draws": 4}),
    "precond_dequant": (dict(output="preconditioned"), {"dequantize": True}),
    "precond_film": (dict(output="preconditioned", conditioning="film"), {}),
    "precond_pixel_scale_gain1": (dict(output="preconditioned", learn_data_scale=True), {"pixel_gain": 1.0}),
    "precond_pixel_scale": (dict(output="preconditioned", learn_data_scale=True), {}),
    "pixel_scale_film": (dict(output="preconditioned", learn_data_scale=True, conditioning="film"), {}),
    "pixel_scale_sampler_prior": (dict(output="preconditioned", learn_data_scale=True), {"prior": "sampler"}),
    "pixel_scale_m4": (dict(output="preconditioned", learn_data_scale=True), {"draws": 4}),
    "pixel_scale_w512": (dict(output="preconditioned", learn_data_scale=True, width=512), {}),
}
BASE_MODEL = dict(width=256, depth=3, noise_dim=16, conditioning="concat", cond_width=64)


def pixels(images: torch.Tensor, generator, dequantize: bool) -> torch.Tensor:
    x = images.to(torch.float32)
    if dequantize:
        return (x + torch.rand(x.shape, generator=generator)) / 256.0
    return x / 255.0


@torch.no_grad()
def evaluate(model, x_test: torch.Tensor, draws: int = 16, seed: int = 2024):
    rows = {}
    for r in LEVELS:
        g = torch.Generator().manual_seed(seed)
        sigma = NoiseParams.sigma_for_rms(r, EVAL_TUPLE["lam"], EVAL_TUPLE["beta"])
        params = NoiseParams(EVAL_TUPLE["beta"], EVAL_TUPLE["lam"], sigma, EVAL_TUPLE["u"], EVAL_TUPLE["v"])
        y = x_test + params.noise(784).sample((x_test.shape[0],), generator=g)
        samples = model.sample(y, params.eta(), draws, generator=g)
        es = energy_score(samples, x_test, beta=1.4, metric=params.metric(784)).mean()
        es_pix = energy_score(samples, x_test, beta=1.0).mean()
        mse = (samples.mean(-2) - x_test).pow(2).mean()
        rows[r] = dict(es=float(es), es_pix=float(es_pix), mse=float(mse))
    return rows


@torch.no_grad()
def draw_grid(model, x_test, path: Path, seed: int = 7):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = torch.Generator().manual_seed(seed)
    x = x_test[:6]
    cols = []
    for r in (0.197, 1.3):
        sigma = NoiseParams.sigma_for_rms(r, EVAL_TUPLE["lam"], EVAL_TUPLE["beta"])
        params = NoiseParams(EVAL_TUPLE["beta"], EVAL_TUPLE["lam"], sigma, EVAL_TUPLE["u"], EVAL_TUPLE["v"])
        y = x + params.noise(784).sample((x.shape[0],), generator=g)
        s = model.sample(y, params.eta(), 3, generator=g)
        cols += [y] + [s[:, k] for k in range(3)]
    panels = [x] + cols
    fig, axes = plt.subplots(6, len(panels), figsize=(len(panels) * 0.9, 6 * 0.9))
    for i in range(6):
        for j, p in enumerate(panels):
            axes[i, j].imshow(p[i].reshape(28, 28).clamp(0, 1).numpy(), cmap="gray", vmin=0, vmax=1)
            axes[i, j].axis("off")
    fig.suptitle("clean | y, 3 draws at r=0.197 | y, 3 draws at r=1.3", fontsize=7)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_arm(name, model_kw, opts, train_images, x_test, steps, batch, seed, out: Path):
    kw = dict(BASE_MODEL)
    kw.update(model_kw)
    prior_args = dict(beta=(1.3, 2.0), lam=(1.0, 2.5), sigma=(0.025, 6.0), disk_radius=0.7)
    prior = SamplerWeightedPrior(**prior_args) if opts.get("prior") == "sampler" else NoisePrior(**prior_args)
    low, high = NoisePrior(**prior_args).eta_bounds()
    model = EngressionPosterior(784, eta_low=low, eta_high=high, data_center=MNIST_MEAN, data_std=MNIST_STD,
                                init_seed=seed, **kw)
    if "pixel_gain" in opts:
        model.PIXEL_SCALE_GAIN = opts["pixel_gain"]  # instance attribute: this arm's gain only
    ema = copy.deepcopy(model).requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    gens = {k: torch.Generator().manual_seed(seed * 1000 + i) for i, k in enumerate(("data", "prior", "noise", "model"))}
    draws = opts.get("draws", 2)
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        lr = 1e-3 * min(1.0, (step + 1) / 100) * (0.5 * (1 + math.cos(math.pi * step / steps)) * 0.97 + 0.03)
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, train_images.shape[0], (batch,), generator=gens["data"])
        x = pixels(train_images[idx], gens["data"], opts.get("dequantize", False))
        p = prior.sample(batch, gens["prior"])
        y = x + p.noise(784).sample(generator=gens["noise"])
        opt.zero_grad(set_to_none=True)
        losses.append(_loss_and_backward(model, x, y, p, draws, gens["model"], torch.device("cpu")))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - 0.995)
        if (step + 1) % 50 == 0:
            print(f"  {name} step {step + 1}: loss {np.mean(losses[-50:]):.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    model.eval()
    result = dict(arm=name, model=kw, options=opts, steps=steps, batch=batch, draws=draws, wall_s=round(wall, 1),
                  steps_per_s=round(steps / wall, 2), params=sum(t.numel() for t in params),
                  final_train_loss=float(np.mean(losses[-100:])),
                  raw=evaluate(model, x_test), ema=evaluate(ema, x_test))
    draw_grid(ema, x_test, out / f"draws_{name}.png")
    return result


def main(argv=None):
    ap = _cli.OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="/work/shared/data/mnist")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--n-test", type=int, default=512)
    ap.add_argument("--out", default="experiments/mnist/results/ablation")
    args = ap.parse_args(argv)
    # every flag and arm is checked before the data are read and the first arm trains
    for flag, low in (("--steps", 1), ("--batch", 1), ("--seed", 0), ("--n-test", 1)):
        _cli.at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
    _cli.threads("--threads", args.threads)
    if not args.arms:
        raise _cli.UsageError(f"--arms must name at least one arm of {', '.join(ARMS)}; got none")
    for name in args.arms:
        if name not in ARMS:
            raise _cli.UsageError(f"--arms must name arms of {', '.join(ARMS)}, got {name!r}")
    _cli.nonempty("--data-dir", args.data_dir, "an MNIST folder")
    _cli.out_dir("--out", args.out)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    data = Path(args.data_dir)
    train_images = read_idx_images(data / "train-images-idx3-ubyte.gz")
    test = read_idx_images(data / "t10k-images-idx3-ubyte.gz")[: args.n_test].to(torch.float32) / 255.0
    for name in args.arms:
        res = run_arm(name, *ARMS[name], train_images, test, args.steps, args.batch, args.seed, out)
        with open(out / "ablation.jsonl", "a") as fh:
            fh.write(json.dumps(res) + "\n")
        print(json.dumps({k: res[k] for k in ("arm", "wall_s", "steps_per_s", "final_train_loss")}),
              {r: round(v["es"], 3) for r, v in res["ema"].items()}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli.guarded("python -m experiments.mnist.posterior_ablation", main))
