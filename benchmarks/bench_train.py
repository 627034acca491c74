"""Training-step throughput: examples/s and achieved TFLOP/s of the eager float32 step vs the fast step.

    python benchmarks/bench_train.py                       # MNIST-shaped step (d = 784) on the CPU
    python benchmarks/bench_train.py --device cuda --json benchmarks/train_h100.json
    python benchmarks/bench_train.py --config configs/X.toml --device cuda

Both variants run the real training loop (:func:`etweedie.training.train`, a throw-away run
directory) on the same model, batch and data: ``warmup`` steps (compilation, allocator warm-up),
then ``steps`` timed steps between two log lines (the loss is read back only there, as in
training).  The variants:

* ``eager fp32``: float32, no TF32, no compile, the default (for-each) Adam;
* ``fast``: bf16 autocast with the energy score in float32, TF32 matmuls, fused Adam and
  ``torch.compile`` of the forward + loss (the settings of a GPU config).

On a CPU the fast settings are not what a CPU run should use (bf16 autocast and compile gain
nothing there), so both rows run the eager float32 step and the table says so; the numbers then
measure the loop itself.  FLOPs are the model's matmul FLOPs (forward + backward of one step,
counted by ``torch.utils.flop_counter.FlopCounterMode`` on an eager step: every mm/addmm/bmm);
the energy score's pairwise distances are not counted.  On a GPU the TFLOP/s are also given as a
share of the card's dense bf16 tensor-core peak (NVIDIA datasheets; :data:`BF16_PEAK_TFLOPS`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import etweedie  # noqa: E402
from etweedie.commandline import OneLineParser  # noqa: E402
from benchmarks.common import MAX_THREADS, check_flags, check_threads, flag_error  # noqa: E402
from etweedie._checks import check_device  # noqa: E402
from etweedie.training import ModelConfig, NoisePrior, TrainConfig, build_posterior, load_config, noise_law, train
from etweedie.training.engression import _loss_and_backward

#: dense bf16 tensor-core peak, TFLOP/s (no sparsity), by a substring of the device name
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0}


def bf16_peak(name: str) -> Optional[float]:
    for key, peak in BF16_PEAK_TFLOPS.items():  # the more specific names come first
        if key in name:
            return peak
    return None


def default_config(args) -> TrainConfig:
    if args.config:
        config = load_config(args.config)
    else:  # an MNIST-shaped step: d = 784, the block geometry, σ over the paper's range
        config = TrainConfig(batch_size=args.batch, draws=args.draws, model=ModelConfig(width=args.width, depth=args.depth,
                                                                                        noise_dim=32, cond_width=64))
        config = dataclasses.replace(config, prior=dataclasses.replace(config.prior, sigma=(0.025, 6.0)))
    return dataclasses.replace(config, device=args.device, ema_decay=config.ema_decay, threads=args.threads)


def synthetic_data(dim: int, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Stand-in examples in [−1, 1] (the speed does not depend on the values)."""
    return torch.rand(n, dim, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def step_flops(config: TrainConfig, data: torch.Tensor) -> int:
    """Matmul FLOPs of one training step (forward + backward), counted on the CPU in float32."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dataclasses.replace(config, device="cpu")
    model = build_posterior(cfg, data.shape[1])
    g = torch.Generator().manual_seed(0)
    x = data[torch.randint(len(data), (cfg.batch_size,), generator=g)]
    params = NoisePrior.from_config(cfg.prior).sample(cfg.batch_size, g)
    y = x + noise_law(params, x.shape[1], cfg.prior.geometry).sample(generator=g)
    with FlopCounterMode(display=False) as counter:
        _loss_and_backward(model, x, y, params, cfg.draws, g, torch.device("cpu"), cfg.loss_beta,
                           geometry=cfg.prior.geometry)
    return int(counter.get_total_flops())


class TooFewSteps(ValueError):
    """The timed steps were too quick for the training log's clock."""


def run_variant(config: TrainConfig, data: torch.Tensor, warmup: int, steps: int) -> Dict[str, float]:
    """Train ``warmup + steps`` steps; time the last ``steps`` between two log lines."""
    # log lines (the only host syncs) at step `warmup` and `warmup + steps`, and a few between
    cfg = dataclasses.replace(config, steps=warmup + steps, warmup_steps=0, log_every=math.gcd(warmup, warmup + steps),
                              checkpoint_every=10**9)
    with tempfile.TemporaryDirectory() as tmp:
        summary = train(cfg, Path(tmp) / "run", data=data, progress=False)
        rows = [json.loads(line) for line in Path(summary["log"]).read_text().splitlines()]
    # a fresh run's clock starts at 0 just before its first step: with no warm-up the timed
    # steps start there (and include the first step's compilation and allocator warm-up)
    at = {0: 0.0, **{r["step"]: r["wall_time"] for r in rows}}
    seconds = at[warmup + steps] - at[warmup]
    if seconds <= 0:  # the log's wall times are rounded to the millisecond
        raise TooFewSteps(f"--steps {steps}: the timed steps took less than the training log's 1 ms resolution; "
                          f"time more steps")
    return {"seconds": seconds, "examples_per_s": steps * config.batch_size / seconds,
            "step_ms": 1e3 * seconds / steps, "final_loss": summary["final_loss"]}


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="training config (default: an MNIST-shaped synthetic step)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=784, help="data dimension for the synthetic data (default 784)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--threads", type=int, default=0, help=f"torch threads, 0 to {MAX_THREADS} (0: torch's default)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    prog = "python benchmarks/bench_train.py"

    try:  # one line and exit status 2 for a flag or config the run cannot use, before any training
        check_flags([("--dim", args.dim, 1), ("--width", args.width, 1), ("--depth", args.depth, 1),
                     ("--batch", args.batch, 1), ("--draws", args.draws, 2), ("--warmup", args.warmup, 0),
                     ("--steps", args.steps, 1), check_threads(args.threads, least=0)], args.json)
        check_device(args.device, "--device")
        if args.config is not None and not Path(args.config).is_file():
            raise ValueError(f"--config must be an existing TOML file, got {args.config!r}")
        config = default_config(args)
        from etweedie.training import build_data_source

        if args.config:
            source = build_data_source(config.data)
            data = source.draw(8192, torch.Generator().manual_seed(0))
        else:
            data = synthetic_data(args.dim)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return flag_error(prog, exc)
    device = torch.device(config.device)
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or platform.machine()})"
    eager = dataclasses.replace(config, precision="float32", tf32=False, compile=False, fused_adam=False)
    fast = dataclasses.replace(config, precision="bf16", tf32=True, compile=True, fused_adam=True) if gpu else eager
    flops = step_flops(config, data)
    peak = bf16_peak(name) if gpu else None
    results = []
    for label, cfg in (("eager fp32", eager), ("fast" if gpu else "fast (= eager fp32 on CPU)", fast)):
        try:
            r = run_variant(cfg, data, args.warmup, args.steps)
        except TooFewSteps as exc:
            return flag_error(prog, exc)
        r.update(variant=label, tflops=flops * r["examples_per_s"] / cfg.batch_size / 1e12)
        r["peak_share"] = r["tflops"] / peak if peak else None
        results.append(r)
    m = config.model
    print(f"training step: d={data.shape[1]}, batch {config.batch_size} x {config.draws} draws, "
          f"{m.architecture} width {m.width} depth {m.depth}; {flops / 1e9:.2f} GFLOP (matmul, fwd+bwd) per step")
    print(f"device: {name}; torch {torch.__version__}, etweedie {etweedie.__version__}, threads {config.threads or torch.get_num_threads()}")
    if not gpu:
        print("on the CPU both rows run the eager float32 step (bf16/TF32/fused/compile are GPU settings)")
    print(f"{'variant':<28} {'examples/s':>11} {'ms/step':>9} {'TFLOP/s':>9} {'of bf16 peak':>13}")
    for r in results:
        share = f"{100 * r['peak_share']:.1f} %" if r["peak_share"] is not None else "-"
        print(f"{r['variant']:<28} {r['examples_per_s']:>11.0f} {r['step_ms']:>9.2f} {r['tflops']:>9.4f} {share:>13}")
    if gpu:
        print(f"fast / eager: {results[1]['examples_per_s'] / results[0]['examples_per_s']:.2f}x "
              f"(bf16 peak {peak} TFLOP/s)" if peak else "")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({
                "device": name, "torch": torch.__version__, "etweedie": etweedie.__version__,
                "threads": config.threads or torch.get_num_threads(), "dim": int(data.shape[1]),
                "config": dataclasses.asdict(config), "flops_per_step": flops, "bf16_peak_tflops": peak,
                "results": results, "date": time.strftime("%Y-%m-%d"),
            }, indent=1, default=str) + "\n")
        except OSError as exc:  # checked at the start; the file system may have changed since
            return flag_error(prog, ValueError(f"--json {args.json!r}: could not write the results ({exc})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
