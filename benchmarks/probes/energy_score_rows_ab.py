"""One-thread CPU time of energy_score fwd + ∂/∂samples at B = 64, M = 32, d = 784 (per-row β,
2×2 block metric): the workload of the Gram row kernel, for A/B runs of its panel width.

    python benchmarks/probes/energy_score_rows_ab.py   # median ms of 100 calls, process CPU time
"""

import statistics
import time

import torch

import etweedie


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    B, M, d = 64, 32, 784
    y = torch.randn(B, d, generator=g)
    x0 = y.unsqueeze(1) + 0.5 * torch.randn(B, M, d, generator=g)
    beta = 1.2 + 0.7 * torch.rand(B, generator=g)
    metric = etweedie.Metric.block(torch.tensor([[0.5, 0.3], [0.3, 0.5]]))

    def call():
        x = x0.clone().requires_grad_()
        e = etweedie.energy_score(x, y, beta, metric=metric, backend="cpu")
        torch.autograd.grad(e.sum(), x)

    for _ in range(5):
        call()
    ts = []
    for _ in range(100):
        t0 = time.process_time()
        call()
        ts.append(time.process_time() - t0)
    print(f"energy_score fwd+bwd B={B} M={M} d={d}: {statistics.median(ts) * 1e3:.3f} ms CPU time")


if __name__ == "__main__":
    main()
