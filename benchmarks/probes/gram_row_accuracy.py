"""Accuracy of energy_score's CPU Gram row kernel (float32, d = 64, gradients of draws and target)
on the clouds that test its single power-of-two row scale and its cancelling sums:

    python benchmarks/probes/gram_row_accuracy.py [--seeds 6]

(1) A fine cloud far out: M = 200 and 255 draws with a 1e-3 spread at 1e4 from the origin,
β = 2 (the gradient is ~M^{-1/2} of the terms it is summed from).  Prints the worst ratio of the
error to the suite's bound |out − ref64| ≤ 2|ref32 − ref64| + 3e-5·max|ref64| (≤ 1 passes) and the
worst error relative to max|ref64|.
(2) Wide rows, each against the float64 reference: a 1e-11 cluster with one draw 1e12 away
(β = 1), points at ±3e38 (β = 0.5), two draws 1e-44 apart beside a unit draw (β = 0.5).  Prints
the gradient's error relative to its largest entry and the value's error relative to the cross
term (1/M) Σ ‖x_i − y‖^β (the value is a difference of terms ~1e12 or ~1e19 there).
"""


import torch

import etweedie
from etweedie.commandline import OneLineParser


def grads(samples, target, beta, backend, dtype):
    s = samples.to(dtype).clone().requires_grad_()
    t = target.to(dtype).clone().requires_grad_()
    v = etweedie.energy_score(s, t, beta, backend=backend)
    up = torch.linspace(0.5, 1.5, v.numel(), dtype=dtype)
    return [v.detach().double()] + [g.double() for g in torch.autograd.grad((v * up).sum(), (s, t))]


def fine_cloud(seeds: int) -> None:
    worst_ratio, worst_rel = 0.0, 0.0
    for seed in range(seeds):
        for M in (200, 255):
            g = torch.Generator().manual_seed(seed)
            B, d = 3, 64
            y = (1e4 + 1e-3 * torch.randn(B, d, generator=g, dtype=torch.float64)).float().double()
            x = (y.unsqueeze(1) + 1e-3 * torch.randn(B, M, d, generator=g, dtype=torch.float64)).float().double()
            runs = [grads(x, y, 2.0, be, dt) for be, dt in
                    (("cpu", torch.float32), ("reference", torch.float32), ("reference", torch.float64))]
            for got, r32, r64 in list(zip(*runs))[1:]:
                bound = 2 * (r32 - r64).abs() + 3e-5 * r64.abs().max()
                worst_ratio = max(worst_ratio, float(((got - r64).abs() / bound).max()))
                worst_rel = max(worst_rel, float((got - r64).abs().max() / r64.abs().max()))
    print(f"fine cloud far out (M = 200, 255; {seeds} seeds): worst error / bound {worst_ratio:.3f}, "
          f"worst relative gradient error {worst_rel:.1e}")


def wide_rows() -> None:
    g = torch.Generator().manual_seed(0)
    M, d = 20, 64
    cases = {}
    x, y = 1e-11 * torch.randn(M, d, generator=g, dtype=torch.float64), 1e-11 * torch.randn(d, generator=g, dtype=torch.float64)
    x[-1] = 0.0
    x[-1, 0] = 1e12
    cases["1e-11 cluster, a draw at 1e12, beta 1"] = (x, y, 1.0)
    x, y = torch.zeros(M, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    x[0, 0], x[1:, 0], y[0] = 3e38, -3e38, -3e38
    x[1:, 1] = torch.randn(M - 1, generator=g, dtype=torch.float64)
    cases["points at +-3e38, beta 0.5"] = (x, y, 0.5)
    x, y = torch.zeros(M, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    x[0] = torch.randn(d, generator=g, dtype=torch.float64)
    x[2, 1] = 1e-44
    cases["two draws 1e-44 apart, beta 0.5"] = (x, y, 0.5)
    for name, (x, y, beta) in cases.items():
        x, y = x.float().double()[None], y.float().double()[None]
        got, r64 = grads(x, y, beta, "cpu", torch.float32), grads(x, y, beta, "reference", torch.float64)
        terms = float(((x - y.unsqueeze(1)).norm(dim=-1) ** beta).mean())
        ev = float((got[0] - r64[0]).abs().max()) / terms
        eg = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[1:], r64[1:]))
        print(f"{name}: gradient error {eg:.1e} of its largest entry, value error {ev:.1e} of the cross term")


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=6)
    args = p.parse_args()
    if args.seeds < 1:
        p.exit(2, f"{p.prog}: error: --seeds must be >= 1, got {args.seeds}\n")
    torch.set_num_threads(2)
    fine_cloud(args.seeds)
    wide_rows()


if __name__ == "__main__":
    main()
