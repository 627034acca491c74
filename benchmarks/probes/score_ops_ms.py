"""The public et_score at 64 × 256 × 784 (isotropic, β = 1.4), two threads, by draw format: ms per
call of the forward and of forward + ``torch.autograd.grad`` for y and x, median of nine loops of
10 calls after 5 warm-up calls. Alternate checkouts to compare builds in the same minutes:

    PYTHONPATH=<checkout> python benchmarks/probes/score_ops_ms.py

(run it from outside the checkout, or with ``python -m`` from inside the one it measures: ``python
-m`` puts the working directory first on ``sys.path``, before PYTHONPATH).
"""

import statistics
import time

import torch

import etweedie


def _median_ms(fn) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        times.append((time.perf_counter() - t0) / 10 * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    B, N, d = 64, 256, 784
    y = torch.randn(B, d, generator=g)
    x0 = y.unsqueeze(1) + torch.randn(B, N, d, generator=g)
    w = torch.randn(B, d, generator=g)
    row = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = x0.to(dtype)
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()

        def both():
            s = etweedie.et_score(yr, xr, 1.4)
            torch.autograd.grad((s * w).sum(), (yr, xr))

        fwd = _median_ms(lambda: etweedie.et_score(y, x, 1.4))
        row.append(f"{str(dtype).removeprefix('torch.'):9s} fwd {fwd:.3f} fwd+bwd {_median_ms(both):.3f}")
    print(" | ".join(row) + "  (ms)")


if __name__ == "__main__":
    main()
