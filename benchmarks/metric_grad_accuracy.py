"""Accuracy and speed of the CPU energy_distance metric gradient (benchmarks/RESULTS.md, "CPU energy
backward: metric gradient summed in double across pair blocks").

    python benchmarks/metric_grad_accuracy.py accuracy --seeds 0 400   # error / bound over fresh draws
    python benchmarks/metric_grad_accuracy.py speed                    # fwd + bwd, every gradient, ms

The accuracy ratio is the test suite's criterion (tests/test_energy_distance.py):
|cpu − ref64| / (2|ref32 − ref64| + 3e-5·max|ref64|) for the metric gradient, B = 2, n = 11, m = 18,
d = 40, block-2 metric; above 1 the test fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import etweedie
from etweedie.commandline import OneLineParser

ROOT = Path(__file__).resolve().parents[1]


def accuracy(first: int, last: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_energy_distance as T  # the suite's input draw and gradient runner

    ratios = []
    for seed in range(first, last):
        args = T._inputs(seed, 2, 11, 18, 40, "block2")
        grads = [T._run(backend, "cpu", dtype, *args)[1][3] for backend, dtype in
                 (("cpu", torch.float32), ("reference", torch.float32), ("reference", torch.float64))]
        out, ref32, ref64 = (g.double() for g in grads)
        bound = 2 * (ref32 - ref64).abs() + 3e-5 * float(ref64.abs().max())
        ratios.append(float(((out - ref64).abs() / bound).max()))
    ratios.sort()
    q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]  # noqa: E731
    print(f"seeds {first}..{last - 1}: fails {sum(r > 1 for r in ratios)}; median {q(0.5):.3f} p90 {q(0.9):.3f} "
          f"p99 {q(0.99):.3f} max {ratios[-1]:.3f}")


def speed() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for kind, B, n, d in [("isotropic", 1, 4096, 2), ("block2", 4, 1024, 40), ("diagonal", 4, 1024, 64),
                          ("dense", 4, 1024, 8), ("block2", 16, 256, 8)]:
        a, b = torch.randn(B, n, d, generator=g), torch.randn(B, n, d, generator=g) + 0.5
        beta = torch.full((B,), 1.3)
        if kind == "isotropic":
            p, make = 0.5 + torch.rand(B, generator=g), etweedie.Metric.isotropic
        elif kind == "diagonal":
            p, make = 0.5 + torch.rand(B, d, generator=g), etweedie.Metric.diagonal
        else:
            k = 2 if kind == "block2" else d
            A = torch.randn(B, k, k, generator=g)
            p = A @ A.transpose(-1, -2) / k + 0.5 * torch.eye(k)
            make = etweedie.Metric.block if kind == "block2" else etweedie.Metric.dense
        leaves = [t.clone().requires_grad_(True) for t in (a, b, beta, p)]

        def run():
            out = etweedie.energy_distance(*leaves[:3], metric=make(leaves[3]), backend="cpu")
            torch.autograd.grad(out.sum(), leaves)

        run()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        print(f"{kind:9s} B={B:2d} n=m={n:4d} d={d:2d}: {sorted(times)[3] * 1e3:8.2f} ms (median of 7)")


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("accuracy", "speed"))
    parser.add_argument("--seeds", nargs=2, type=int, default=(0, 400), metavar=("FIRST", "END"),
                        help="accuracy: the seeds FIRST, ..., END - 1 (0 <= FIRST < END)")
    args = parser.parse_args(argv)
    first, end = args.seeds
    if first < 0 or end <= first:  # an empty range would print statistics of no draws
        print(f"python benchmarks/metric_grad_accuracy.py: error: --seeds FIRST END must satisfy 0 <= FIRST < END "
              f"(the seeds FIRST..END-1), got {first} {end}", file=sys.stderr)
        return 2
    accuracy(first, end) if args.what == "accuracy" else speed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
