"""Raw CPU score kernels in ns per 16 coordinates of one draw (the unit of the 16-lane loops,
csrc/cpu/lanes16_cpu.h), one thread, by draw format: the forward ``etweedie::et_score_fwd`` and
the backward ``etweedie::et_score_bwd`` for ∂/∂y alone and for ∂/∂y and ∂/∂x, isotropic metric,
N = 256 standard normal draws about each query, d = 784, β = 1.4. B = 2 keeps the draws in L2,
B = 64 (51 MB of float32 draws) in L3 on the Intel VM. Median of seven timed loops.

    PYTHONPATH=<checkout> python benchmarks/probes/score_kernels_ns.py

(run it from outside the checkout, or with ``python -m`` from inside the one it measures: ``python
-m`` puts the working directory first on ``sys.path``, before PYTHONPATH).
"""

import statistics
import time

import torch

import etweedie  # noqa: F401  (registers torch.ops.etweedie)


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    N, d = 256, 784
    for B in (2, 64):
        y = torch.randn(B, d, generator=g)
        x = y.unsqueeze(1) + torch.randn(B, N, d, generator=g)
        beta, lam, prec = torch.full((B,), 1.4), torch.ones(B), torch.ones(B)
        up, up_m = torch.randn(B, d, generator=g), torch.zeros(B, d)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            _, m = torch.ops.etweedie.et_score_fwd(y, xd, beta, lam, prec, 0)

            def backward(need_x, xd=xd, m=m):
                return torch.ops.etweedie.et_score_bwd(up, up_m, y, xd, beta, lam, prec, 0, m, True, need_x,
                                                       False, False, False)

            calls = {"fwd": lambda xd=xd: torch.ops.etweedie.et_score_fwd(y, xd, beta, lam, prec, 0),
                     "bwd dy": lambda: backward(False), "bwd dy+dx": lambda: backward(True)}
            row = []
            for name, fn in calls.items():
                reps = max(1, 2000 // B)
                fn()
                times = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times.append((time.perf_counter() - t0) / reps)
                row.append(f"{name} {statistics.median(times) / (B * N * d / 16) * 1e9:.2f}")
            print(f"B={B:<3d} {str(dtype).removeprefix('torch.'):9s} " + "  ".join(row) + "  (ns per 16 coordinates)")


if __name__ == "__main__":
    main()
