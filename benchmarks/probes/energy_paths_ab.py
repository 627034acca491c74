"""CPU times of the energy-op paths that the close-pair and dense-centring fixes touch, for A/B
runs of two builds (run it once per build, alternating; PYTHONPATH selects the build):

    PYTHONPATH=<checkout> python benchmarks/probes/energy_paths_ab.py   # median ms, 2 threads

  es_rows      energy_score_bwd op (Gram row kernel), 64×32×784, diagonal metric, draws + target
  ed_fwd       energy_distance 768×2048×256 forward (Gram form), isotropic
  ed_fwd_bwd   the same, forward + backward of both clouds
  es_all_diag  energy_score fwd + every gradient (β, metric: the pair engine on whitened copies),
               64×32×784, diagonal metric
"""

import statistics
import time

import torch

import etweedie


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    B, M, d = 64, 32, 784
    x = torch.randn(B, M, d, generator=g)
    y = torch.randn(B, d, generator=g)
    p = 0.5 + torch.rand(B, d, generator=g)
    beta = torch.ones(B)
    m32 = etweedie.Metric.diagonal(p)
    prec, kind = etweedie.ops._args.metric_param(m32, torch.Size([B]), d)
    up = torch.ones(B)
    rows = lambda: torch.ops.etweedie.energy_score_bwd(up, x, y, beta, prec, kind, False, True, True, False, False)  # noqa: E731

    a = torch.randn(1, 768, 256, generator=g)
    b = torch.randn(1, 2048, 256, generator=g)
    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
    ed_fwd = lambda: etweedie.energy_distance(a, b, 1.0, backend="cpu")  # noqa: E731
    ed_fwd_bwd = lambda: etweedie.energy_distance(ag, bg, 1.0, backend="cpu").sum().backward()  # noqa: E731

    def es_all():
        xs, ys, ps = x.clone().requires_grad_(), y.clone().requires_grad_(), p.clone().requires_grad_()
        b1 = torch.ones(B, requires_grad=True)
        etweedie.energy_score(xs, ys, b1, metric=etweedie.Metric.diagonal(ps), backend="cpu").sum().backward()

    for name, fn, calls in [("es_rows", rows, 100), ("ed_fwd", ed_fwd, 30), ("ed_fwd_bwd", ed_fwd_bwd, 8),
                            ("es_all_diag", es_all, 20)]:
        print(f"{name:12s} {median_ms(fn, calls):8.2f} ms")


if __name__ == "__main__":
    main()
