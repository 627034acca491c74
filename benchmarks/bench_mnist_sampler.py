"""MNIST-scale annealed Langevin: etweedie's sampler against a plain PyTorch float32 eager one.

Both implementations sample the same chains (d = 784, the block metric I_392 ⊗ S(u, v) of each
level) along an MNIST path with the same posterior, chains, N, levels and updates, in one run:

* ``etweedie``: :func:`etweedie.sample.sample_langevin` — the posterior forward under bf16
  autocast on CUDA (float32 on CPU, where bf16 matmuls are slower), the fused
  ``etweedie.langevin_step`` kernel, and on CUDA each chunk's update captured as a CUDA graph;
* ``eager``: what a user would write instead (:func:`sample_langevin_eager` below): the forward in
  float32, the score from torch ops that materialize the B×N×d residuals, no fusion, no capture.

Reported per implementation: images·steps/s (chains × Langevin updates per second), posterior
draws/s, the posterior forward's achieved TFLOP/s (its matmul FLOPs counted by
``torch.utils.flop_counter`` on one call, over the time of the forward alone) against the card's
dense bf16 peak (on a CPU there is no such peak: reported as none), and the score/step share of
the time (the kernel or the torch ops, timed alone on the same inputs, times the updates,
over the sampling time).  Correctness first: a few updates of both, from the same start and
generator state, agree to float32 round-off (the eager one is the float64-checked math written
out with torch ops).

    python -m benchmarks.bench_mnist_sampler --posterior untrained --width 512 --chains 32 --n-posterior 16
    python -m benchmarks.bench_mnist_sampler --posterior mnist --device cuda --chains 256 --n-posterior 256 --json out.json
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
import time
from typing import Callable, Dict, Optional

import torch

import etweedie
from etweedie.commandline import OneLineParser
from etweedie.posteriors import EngressionPosterior
from etweedie.sample import get_path, level_times
from etweedie.sample import initial_states, sample_langevin, step_sizes

from etweedie._checks import check_device

from .common import MAX_THREADS, check_flags, check_threads, flag_error

D = 784

#: Dense (no sparsity) bf16 tensor-core peak in TFLOP/s, from the vendors' data sheets.
BF16_PEAK_TFLOPS = {
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # "NVIDIA H100 80GB HBM3" is the SXM part
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def bf16_peak_tflops(device: torch.device) -> Optional[float]:
    """The card's dense bf16 peak, or None (a CPU, or a card not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return BF16_PEAK_TFLOPS[key]
    return None


# ---------------------------------------------------------------------------- the eager baseline
def eager_score(y: torch.Tensor, x: torch.Tensor, beta: float, lam: float, S: torch.Tensor) -> torch.Tensor:
    """s(y) = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i) for Σ = I_{d/2} ⊗ S, with plain torch ops.

    ``y`` (B, d), ``x`` (B, N, d), ``S`` (2, 2).  Materializes u = y − x and P u (B×N×d each).
    """
    B, N, d = x.shape
    P = torch.linalg.inv(S)
    u = y[:, None, :] - x
    Pu = (u.reshape(B, N, d // 2, 2) @ P).reshape(B, N, d)  # P symmetric: row form u Pᵀ = u P
    q = (u * Pu).sum(-1)
    w = torch.where(q > 0, q.clamp_min(torch.finfo(q.dtype).tiny) ** ((beta - 2) / 2), torch.zeros_like(q))
    return -lam * (w[..., None] * Pu).mean(1)


@torch.no_grad()
def sample_langevin_eager(posterior, y0, path, schedule, *, steps_per_level, n_posterior, step_scale,
                          first_level_steps=None, generator, final_draw=True, timer: Optional[Dict] = None):
    """The sampler a user would write: float32 forward, :func:`eager_score`, the update, per chain batch.

    Draws come from ``generator`` in the order of :func:`etweedie.sample.sample_langevin` with a
    shared generator and one chunk (posterior draws, then the Langevin noise), so both samplers
    take the same path from the same seed up to round-off.  ``timer`` (a dict) collects
    ``posterior_s`` and ``score_step_s``.
    """
    y = y0.clone()
    params = path(schedule)
    alphas = step_sizes(path, schedule, step_scale)
    fields = torch.broadcast_tensors(*params._tensors())
    eta = None
    for k in range(schedule.numel()):
        level = etweedie.NoiseParams(*(f[k] for f in fields))
        eta = level.eta().to(y).expand(y.shape[0], 5)
        S = level.metric(y.shape[-1]).param.to(y)
        beta, lam, alpha = float(level.beta), float(level.lam), float(alphas[k])
        n_steps = first_level_steps if (k == 0 and first_level_steps is not None) else steps_per_level
        clock = _now if timer is not None else (lambda t: 0.0)  # no device syncs unless timed
        for _ in range(n_steps):
            t0 = clock(y)
            x = posterior.sample(y, eta, n_posterior, generator=generator).to(y.dtype)
            xi = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
            t1 = clock(y)
            y = y + alpha * eager_score(y, x, beta, lam, S) + math.sqrt(2 * alpha) * xi
            t2 = clock(y)
            if timer is not None:
                timer["posterior_s"] = timer.get("posterior_s", 0.0) + t1 - t0
                timer["score_step_s"] = timer.get("score_step_s", 0.0) + t2 - t1
    if final_draw:
        y = posterior.sample(y, eta, 1, generator=generator)[:, 0, :].to(y.dtype)
    return y


def _now(t: torch.Tensor) -> float:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return time.perf_counter()


# ---------------------------------------------------------------------------- measurement
def posterior_flops(posterior, chains: int, n: int, device) -> int:
    """Matmul FLOPs of one ``posterior.sample`` call for ``chains`` queries × ``n`` draws (flop_counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    y = torch.zeros(chains, D, device=device)
    eta = etweedie.NoiseParams(2.0, 1.0, 1.0, 0.0, 0.0).eta().to(device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        posterior.sample(y, eta, n, generator=g)
    return int(counter.get_total_flops())


def _time(fn: Callable[[], object], device, repeats: int) -> float:
    fn()
    start = _now(torch.empty(0, device=device))
    for _ in range(repeats):
        fn()
    return (_now(torch.empty(0, device=device)) - start) / repeats


def load_posterior(spec: str, device, width: int, depth: int):
    """``untrained`` (an EngressionPosterior of the given width and depth, the MNIST η box) or a
    name/path :func:`etweedie.training.load_posterior` accepts."""
    if spec == "untrained":
        model = EngressionPosterior(dim=D, width=width, depth=depth, noise_dim=32,
                                    eta_low=(1.3, 0.0, math.log(0.025), -0.7, -0.7),
                                    eta_high=(2.0, math.log(2.5), math.log(6.0), 0.7, 0.7))
        return model.to(device).eval().requires_grad_(False)
    from etweedie.training import load_posterior as load

    return load(spec, device=device)


def run(args) -> Dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    posterior = load_posterior(args.posterior, device, args.width, args.depth)
    path = get_path(args.path)
    schedule = level_times(args.levels)
    gen = lambda: torch.Generator(device=device).manual_seed(args.seed)  # noqa: E731
    y0 = initial_states(path, schedule, args.chains, D, generator=gen()).to(device)
    kw = dict(steps_per_level=args.steps, first_level_steps=args.first_level_steps, n_posterior=args.n_posterior,
              step_scale=args.step_scale)
    cuda = device.type == "cuda"
    fused_kw = dict(precision="bfloat16" if cuda else "float32", capture="cuda_graph" if cuda else None,
                    chunk_chains=args.chunk_chains)

    # correctness: two levels of a few updates, float32 forward in both, same generator stream
    check_kw = dict(kw, first_level_steps=2, steps_per_level=2)
    a = sample_langevin(posterior, y0, path, schedule[:2], generator=gen(), disable=True, final_draw=False, **check_kw)
    b = sample_langevin_eager(posterior, y0, path, schedule[:2], generator=gen(), final_draw=False, **check_kw)
    check_err = float((a - b).abs().max() / b.abs().max())
    if not check_err < 1e-4:
        raise SystemExit(f"bench_mnist_sampler: the fused and eager samplers disagree (max rel. error {check_err:.3g})")

    updates = (args.first_level_steps if args.first_level_steps is not None else args.steps) + (args.levels - 1) * args.steps
    flops_call = posterior_flops(posterior, args.chains, args.n_posterior, device)
    peak = bf16_peak_tflops(device)
    results = {}
    walls = {"etweedie": [], "eager": []}
    # interleaved rounds, the fastest of each kept: load from other processes that comes and goes
    # then slows one round of both, not one implementation
    for _ in range(args.rounds):
        for name in walls:
            t0 = _now(y0)
            if name == "etweedie":
                sample_langevin(posterior, y0, path, schedule, generator=gen(), disable=True, **kw, **fused_kw)
            else:
                sample_langevin_eager(posterior, y0, path, schedule, generator=gen(), **kw)
            walls[name].append(_now(y0) - t0)
    for name in walls:
        wall = min(walls[name])
        # the parts, timed alone on the same shapes
        eta = path(schedule[:1]).eta()[0].to(device).expand(args.chains, 5)
        g = gen()
        autocast = cuda and name == "etweedie"

        def forward():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                return posterior.sample(y0, eta, args.n_posterior, generator=g)

        x = forward().float()
        level = etweedie.NoiseParams(*(f[0] for f in torch.broadcast_tensors(*path(schedule[:1])._tensors())))
        metric = level.metric(D).to(device=device, dtype=torch.float32)
        xi = torch.randn(y0.shape, generator=g, device=device)
        beta, lam = float(level.beta), float(level.lam)
        if name == "etweedie":
            step = lambda: etweedie.langevin_step(y0, x, xi, 1e-3, beta, lam, metric)  # noqa: E731
        else:
            step = lambda: y0 + 1e-3 * eager_score(y0, x, beta, lam, metric.param) + math.sqrt(2e-3) * xi  # noqa: E731
        forward_s = min(_time(forward, device, args.repeats) for _ in range(args.rounds))
        step_s = min(_time(step, device, args.repeats) for _ in range(args.rounds))
        results[name] = dict(
            wall_s=wall,
            wall_s_rounds=walls[name],
            images_steps_per_s=args.chains * updates / wall,
            posterior_draws_per_s=args.chains * args.n_posterior * updates / wall,
            forward_ms=1e3 * forward_s,
            forward_tflops=flops_call / forward_s / 1e12,
            forward_share_of_peak=None if peak is None else flops_call / forward_s / 1e12 / peak,
            score_step_ms=1e3 * step_s,
            score_step_share=min(1.0, updates * step_s / wall),
            forward_precision="bfloat16" if autocast else "float32",
        )
    return dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()}), "
                                                                f"{torch.get_num_threads()} threads",
        bf16_peak_tflops=peak,
        torch=torch.__version__,
        etweedie=etweedie.__version__,
        posterior=args.posterior,
        posterior_config={k: v for k, v in posterior.config.items() if k not in ("eta_low", "eta_high")},
        path=args.path,
        chains=args.chains,
        n_posterior=args.n_posterior,
        levels=args.levels,
        updates_per_chain=updates,
        forward_gflop_per_call=flops_call / 1e9,
        check_max_rel_error=check_err,
        results=results,
        speedup=results["eager"]["wall_s"] / results["etweedie"]["wall_s"],
    )


def format_table(report: Dict) -> str:
    peak = report["bf16_peak_tflops"]
    lines = [
        f"device: {report['device']}; bf16 peak: {'none (CPU)' if peak is None else f'{peak:g} TFLOP/s'}; "
        f"{report['chains']} chains × {report['updates_per_chain']} updates, N = {report['n_posterior']}, "
        f"{report['forward_gflop_per_call']:.2f} GFLOP per forward call",
        "| sampler | images·steps/s | posterior draws/s | forward TFLOP/s | of bf16 peak | score/step share | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        share = "—" if r["forward_share_of_peak"] is None else f"{100 * r['forward_share_of_peak']:.1f}%"
        lines.append(
            f"| {name} ({r['forward_precision']} forward) | {r['images_steps_per_s']:.1f} | {r['posterior_draws_per_s']:.3g} | "
            f"{r['forward_tflops']:.3g} | {share} | {100 * r['score_step_share']:.1f}% | {r['wall_s']:.1f} |"
        )
    lines.append(f"speed-up of etweedie over eager: {report['speedup']:.2f}×")
    return "\n".join(lines)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default="untrained", help="'untrained', 'mnist' or a posterior file/run directory")
    p.add_argument("--width", type=int, default=512, help="untrained posterior: hidden width")
    p.add_argument("--depth", type=int, default=3, help="untrained posterior: hidden layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--path", default="mnist_generalized_nondiagonal")
    p.add_argument("--chains", type=int, default=32)
    p.add_argument("--chunk-chains", type=int, default=None)
    p.add_argument("--n-posterior", type=int, default=16)
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="updates per level after the first")
    p.add_argument("--first-level-steps", type=int, default=None)
    p.add_argument("--step-scale", type=float, default=2e-5)
    p.add_argument("--repeats", type=int, default=5, help="repeats of the forward and the step timed alone")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both samplers; the fastest counts")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch intra-op threads, 1 to {MAX_THREADS} (on a shared CPU, 1: two threads spin-wait on each other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = "python -m benchmarks.bench_mnist_sampler"
    flags = [("--width", args.width), ("--depth", args.depth), ("--chains", args.chains), ("--n-posterior", args.n_posterior),
             ("--levels", args.levels), ("--steps", args.steps), ("--repeats", args.repeats), ("--rounds", args.rounds),
             ("--chunk-chains", args.chunk_chains), ("--first-level-steps", args.first_level_steps)]
    try:  # one line and exit status 2 for a value the run cannot use, before any timing
        check_flags([*((flag, value, 1) for flag, value in flags), check_threads(args.threads),
                     ("--seed", args.seed, 0, 2**63 - 1)], args.json)
        check_device(args.device, "--device")
        if not args.posterior.strip():
            raise ValueError("--posterior must be 'untrained', 'mnist' or a posterior file/run directory, got an empty string")
        try:
            get_path(args.path)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--path {args.path!r} is not a noise path: {exc}") from None
        if not (math.isfinite(args.step_scale) and args.step_scale > 0):
            raise ValueError(f"--step-scale must be a finite number > 0, got {args.step_scale}")
        report = run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return flag_error(prog, exc)
    print(format_table(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as exc:  # checked at the start; the file system may have changed since
            return flag_error(prog, ValueError(f"--json {args.json!r}: could not write the report ({exc})"))
    return 0


def test_bench_mnist_sampler_quick():
    """pytest benchmarks/: a small run, fused and eager agreeing (checked inside ``run``)."""
    report = run(parse_args(["--width", "64", "--chains", "4", "--n-posterior", "4", "--levels", "2", "--steps", "2"]))
    assert report["check_max_rel_error"] < 1e-4 and report["results"]["etweedie"]["wall_s"] > 0


if __name__ == "__main__":
    sys.exit(main())
