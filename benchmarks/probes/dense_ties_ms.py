"""What the equal-point ties of a dense metric (etweedie/ops/_ties.py) cost beside the calls that
run them, two threads: ms per call (median of 10 after one warm-up) of a dense-metric
energy_score fwd+bwd and energy_distance forward, and of ``tie_equal_rows`` alone on clouds of the
same size with no equal rows (the common case: keys, one sort, nothing tied)::

    python benchmarks/probes/dense_ties_ms.py
"""

import time

import torch

import etweedie
from etweedie import Metric
from etweedie.ops import _ties


def _median_ms(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[n // 2]


def _dense(d: int, g: torch.Generator) -> Metric:
    A = torch.randn(d, d, generator=g)
    return Metric.dense(A @ A.T / d + torch.eye(d))


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for B, M, d in [(64, 32, 784), (256, 8, 64), (128, 64, 2)]:
        m = _dense(d, g)
        x = torch.randn(B, M, d, generator=g, requires_grad=True)
        y = torch.randn(B, d, generator=g)
        u = torch.randn(B, M, d, generator=g)
        call = _median_ms(lambda: torch.autograd.grad(etweedie.energy_score(x, y, 1.0, m).sum(), x))
        tie = _median_ms(lambda: _ties.tie_equal_rows(u, u))
        print(f"energy_score fwd+bwd dense B={B} M={M} d={d}: call {call:.2f} ms, ties {tie:.2f} ms")
    n, k, d = 768, 2048, 256
    m = _dense(d, g)
    a, b = torch.randn(n, d, generator=g), torch.randn(k, d, generator=g)
    u = torch.randn(1, n + k, d, generator=g)
    call = _median_ms(lambda: etweedie.energy_distance(a, b, 1.0, m), 5)
    tie = _median_ms(lambda: _ties.tie_equal_rows(u, u), 5)
    print(f"energy_distance fwd dense n={n} m={k} d={d}: call {call:.2f} ms, ties {tie:.2f} ms")


if __name__ == "__main__":
    main()
