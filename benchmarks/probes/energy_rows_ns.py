"""The CPU energy ops on many small low-dimensional rows (the row kernel of
csrc/cpu/energy_rows_cpu.h), one thread, ns per pair, median of 20 calls after 3 warm-up
calls, isotropic metric, d = 2, per-row β at 1.5 and 1.0 (a power against a square root per pair):

    energy_distance  B rows of n = m points, forward and fwd+bwd (∂/∂a and ∂/∂b);
                     pairs per row n² + n(n − 1) (cross and both clouds' within pairs)
    energy_score     forward without gradients, B rows of M draws (B·M² ≈ 2¹⁹ pairs per call);
                     pairs per row M(M − 1)/2

    PYTHONPATH=<checkout> python benchmarks/probes/energy_rows_ns.py

(run it from outside the checkout, or with ``python -m`` from inside the one it measures: ``python
-m`` puts the working directory first on ``sys.path``, before PYTHONPATH).
"""

import time

import torch

import etweedie


def _median_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    for B, n in ((512, 16), (128, 64), (8, 256)):
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(B, n, 2, generator=g), torch.randn(B, n, 2, generator=g)
        pairs = B * (n * n + n * (n - 1))
        for beta in (1.5, 1.0):
            ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
            fwd = _median_ms(lambda: etweedie.energy_distance(a, b, beta, backend="cpu"))
            both = _median_ms(lambda: torch.autograd.grad(
                etweedie.energy_distance(ac, bc, beta, backend="cpu").sum(), (ac, bc)))
            print(f"energy_distance B={B} n=m={n} beta={beta}: fwd {fwd * 1e6 / pairs:.2f}, "
                  f"fwd+bwd {both * 1e6 / pairs:.2f} ns per pair")
    for M in (16, 64, 256):
        B = max(2, 128 * 64 * 64 // (M * M))
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(B, M, 2, generator=g), torch.randn(B, 2, generator=g)
        for beta in (1.5, 1.0):
            bt = torch.full((B,), beta)
            ms = _median_ms(lambda: etweedie.energy_score(x, y, bt, backend="cpu"))
            print(f"energy_score B={B} M={M} beta={beta}: fwd {ms * 1e6 / (B * M * (M - 1) / 2):.2f} ns per pair")


if __name__ == "__main__":
    main()
