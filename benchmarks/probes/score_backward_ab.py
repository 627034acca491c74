"""CPU times of the et_score backward by draws dtype, for A/B runs of two builds (run it once
per build, alternating; PYTHONPATH selects the build):

    PYTHONPATH=<checkout> python benchmarks/probes/score_backward_ab.py [threads] [iso|block2]

(run it from outside the checkout's directory, or with ``python -m`` from inside the one it
measures: ``python -m`` puts the working directory first on ``sys.path``, before PYTHONPATH).

An isotropic metric (default) or one 2×2 block metric per row (the precision of
Σ = [[1, 0.3], [0.3, 0.8]]), 64 × 256 × 784 standard normal draws about their queries, β = 1.4:

  raw dy / raw dy+dx   the raw backward op (``etweedie::et_score_bwd`` on canonical tensors),
                       ∂/∂y alone and with ∂/∂x (written in the draws' dtype)
  fwd+bwd              the public op's training step: ``etweedie.et_score`` forward, ``.sum()``,
                       ``torch.autograd.grad`` for (y, x), as the benchmark table times it

Median ms over 30 calls per case, the dtypes interleaved call by call (so that the VM's drift
falls on every dtype alike), and each 16-bit time over the float32 time of the same rounds.
"""

import statistics
import sys
import time

import torch

import etweedie

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv) -> tuple:
    """(threads, block) from ``[threads] [iso|block2]``; ValueError naming the bad argument."""
    if len(argv) > 2:
        raise ValueError(f"expected at most 2 arguments [threads] [iso|block2], got {len(argv)}: {' '.join(argv)}")
    try:
        threads = int(argv[0]) if argv else 1
    except ValueError:
        raise ValueError(f"threads must be an int in [1, 1024], got {argv[0]!r}") from None
    if not 1 <= threads <= 1024:
        raise ValueError(f"threads must be an int in [1, 1024], got {threads}")
    if len(argv) > 1 and argv[1] not in ("iso", "block2"):
        raise ValueError(f"the metric must be 'iso' or 'block2', got {argv[1]!r}")
    return threads, len(argv) > 1 and argv[1] == "block2"


def main(argv=None) -> int:
    try:
        threads, block = parse(sys.argv[1:] if argv is None else list(argv))
    except ValueError as exc:
        print(f"python benchmarks/probes/score_backward_ab.py: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    B, N, d = 64, 256, 784
    y = torch.randn(B, d, generator=g)
    x = y.unsqueeze(1) + torch.randn(B, N, d, generator=g)
    gup = torch.randn(B, d, generator=g)
    gm = torch.zeros(B, d)
    beta, lam = torch.full((B,), 1.4), torch.ones(B)
    sigma = torch.tensor([[1.0, 0.3], [0.3, 0.8]])
    metric = etweedie.Metric.block(sigma.expand(B, 2, 2)) if block else None
    prec, kind = (torch.linalg.inv(sigma).expand(B, 2, 2).contiguous(), 2) if block else (torch.ones(B), 0)
    cases = {}
    for name, dt in DTYPES.items():
        xd = x.to(dt)
        _, m = torch.ops.etweedie.et_score_fwd(y, xd, beta, lam, prec, kind)
        for need_x in (False, True):
            cases[("raw dy+dx" if need_x else "raw dy", name)] = (
                lambda xd=xd, m=m, need_x=need_x: torch.ops.etweedie.et_score_bwd(
                    gup, gm, y, xd, beta, lam, prec, kind, m, True, need_x, False, False, False))

        yl, xl = y.clone().requires_grad_(), xd.clone().requires_grad_()  # made once: a fresh 51 MB
        # clone costs more than the step (first touch of its pages)

        def step(yl=yl, xl=xl):
            torch.autograd.grad(etweedie.et_score(yl, xl, 1.4, metric=metric).sum(), (yl, xl))

        cases[("fwd+bwd", name)] = step
    times = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(30):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    for what in ("raw dy", "raw dy+dx", "fwd+bwd"):
        base = statistics.median(times[(what, "float32")])
        row = [f"{what:10s}"]
        for name in DTYPES:
            t = statistics.median(times[(what, name)])
            row.append(f"{name} {1e3 * t:6.2f} ms" + ("" if name == "float32" else f" ({t / base:.2f}×)"))
        print("  ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
