"""Worst gradient error of the CPU energy ops relative to the float32 test bound, for clouds with
close pairs (1e-4 apart, β = 0.5, d = 72), per metric kind, origin or 1e3, clouds-only gradients
(Gram paths) or every gradient (pair engine), and for a dense metric 1e3 from the origin:

    python benchmarks/probes/close_pairs_accuracy.py   # from the repository root

A value ≤ 0 passes: max over entries of (|out − ref64| − 2|ref32 − ref64| − atol) / atol,
atol = 3e-5 · max|ref64| (the bound of tests/conftest.py: assert_close_to_ref).
"""

import itertools
import sys

import torch

sys.path.insert(0, "tests")
import test_energy_distance as ED  # noqa: E402
import test_et_score as ET  # noqa: E402
from conftest import gen, metric_to  # noqa: E402

import etweedie  # noqa: E402


def excess(got, r32, r64, scale=3e-5) -> float:
    got, r32, r64 = got.detach(), r32.detach(), r64.detach()
    atol = scale * float(r64.abs().max())
    return float(((got.double() - r64).abs() - 2 * (r32.double() - r64).abs() - atol).max() / atol)


def energy_distance_close(kind, offset, full, seed=123):
    a, b, bt, metric = ED._inputs(seed, 2, 37, 50, 72, kind, beta=0.5, offset=offset)
    step = 1e-4 * torch.randn(2, 72, generator=gen(seed + 1), dtype=torch.float64)
    a[:, 4] = (a[:, 2] + step).float().double()
    b[:, 9] = (b[:, 8] + step).float().double()
    b[:, 11] = (a[:, 6] - step).float().double()
    if full:
        runs = [ED._run(be, "cpu", dt, a, b, bt, metric)[1][:2]
                for be, dt in [("cpu", torch.float32), ("reference", torch.float32), ("reference", torch.float64)]]
    else:
        def run(backend, dtype):
            x, y = (t.to(dtype).requires_grad_() for t in (a, b))
            m, _ = metric_to(metric, dtype, "cpu")
            out = etweedie.energy_distance(x, y, bt.to(dtype), metric=m, backend=backend)
            up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype)
            return torch.autograd.grad((out * up).sum(), (x, y))
        runs = [run("cpu", torch.float32), run("reference", torch.float32), run("reference", torch.float64)]
    return max(excess(*t) for t in zip(*runs))


def et_score_dense_far(seed=1):
    y, x, beta, lam, metric = ET._inputs(seed, 3, 33, 48, "dense")
    y, x = (y + 1e3).float().double(), (x + 1e3).float().double()
    outs = [ET._run(be, "cpu", dt, y, x, beta, lam, metric)
            for be, dt in [("cpu", torch.float32), ("reference", torch.float32), ("reference", torch.float64)]]
    return excess(outs[0][0], outs[1][0], outs[2][0], 1e-5)


def main() -> None:
    for kind, offset, full in itertools.product(["isotropic", "diagonal", "block2"], [0.0, 1e3], [False, True]):
        grads = "every gradient" if full else "clouds only"
        print(f"energy_distance close pairs  {kind:9s} offset {offset:g}  {grads:14s}  "
              f"{energy_distance_close(kind, offset, full):+8.2f}")
    print(f"et_score dense metric, offset 1e3, score   {et_score_dense_far():+8.2f}")


if __name__ == "__main__":
    main()
