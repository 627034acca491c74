"""Benchmarks of etweedie.energy_score, forward + backward (∂/∂samples), float32.

Workloads (the targets of benchmarks/RESULTS.md; ``quick`` shrinks B for smoke runs), each with a per-row β drawn
in [1.2, 2) and a per-row 2×2 block metric I ⊗ S_b — the training setting, where every
example carries its own noise tuple — and the fair pair term:

    energy_score_784     B=64,  M=32, d=784    ≥ 4× faster than the eager reference and than cdist_mm
    energy_score_784_m2  B=256, M=2,  d=784    ≥ 2× (both)
    energy_score_2       B=128, M=64, d=2      ≥ 5× faster than the eager reference

The reference (etweedie.ops.reference.energy_score) whitens per row and forms the pair
distances with torch.cdist in its exact direct-difference mode.  The extra ``cdist_mm`` times
what a user would write in plain eager PyTorch: whiten with the Cholesky factor of each row's
block, ``torch.cdist`` in its default Gram (GEMM) mode, autograd for the gradient; the
d = 784 workloads also have targets against that (≥ 4× at M = 32, ≥ 2× at M = 2).

    pytest benchmarks/bench_energy_score.py
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

import etweedie
from etweedie.ops import reference
from etweedie.ops._args import metric_param

from .common import BACKENDS, Case, Target, check_close, run_benchmark, speedup_target


def problem(B: int, M: int, d: int, seed: int = 0):
    """samples (B, M, d) around target (B, d), β (B,), per-row block metric."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, d, generator=g)
    samples = target.unsqueeze(1) + 0.5 * torch.randn(B, M, d, generator=g)
    beta = 1.2 + 0.8 * torch.rand(B, generator=g)
    u = 0.6 * torch.rand(B, generator=g) - 0.3
    v = 0.6 * torch.rand(B, generator=g) - 0.3
    S = torch.stack([torch.stack([1 + u, v], -1), torch.stack([v, 1 - u], -1)], -2) * (0.5 + torch.rand(B, 1, 1, generator=g))
    return samples, target, beta, etweedie.Metric.block(S)


def cdist_mm_energy_score(x, y, beta, prec):
    """Fair energy score with a per-row k×k block metric, via whitening and torch.cdist's
    default Gram mode (autograd-differentiable; coincident-pair diagonal masked out)."""
    B, M, d = x.shape
    k = prec.shape[-1]
    L = torch.linalg.cholesky(prec).unsqueeze(1)  # P = L Lᵀ, so ‖u L‖² = uᵀPu
    z = (x.reshape(B, M, d // k, k) @ L).reshape(B, M, d)
    zt = (y.reshape(B, 1, d // k, k) @ L).reshape(B, 1, d)
    cross = torch.cdist(z, zt).squeeze(-1).pow(beta[:, None]).mean(1)
    off_diag = 1 - torch.eye(M, dtype=x.dtype)
    within = (torch.cdist(z, z).pow(beta[:, None, None]) * off_diag).sum((1, 2)) / (M * (M - 1))
    return cross - 0.5 * within


def fwd_bwd_case(id: str, B: int, M: int, d: int) -> Case:
    samples, target, beta, metric = problem(B, M, d)
    samples.requires_grad_()
    prec, kind = metric_param(metric, torch.Size([B]), d)
    rs = samples.detach().clone().requires_grad_()

    def forward():
        return etweedie.energy_score(samples, target, beta, metric, backend="cpu")

    def kernel():
        return torch.autograd.grad(forward().sum(), samples)

    def baseline(fn):
        return lambda: torch.autograd.grad(fn(rs, target, beta, prec, kind).sum(), rs)

    def cdist_mm():
        return torch.autograd.grad(cdist_mm_energy_score(rs, target, beta, prec).sum(), rs)

    def check():
        x64 = rs.detach().double().requires_grad_()
        args64 = (target.double(), beta.double(), prec.double(), kind)
        (g64,) = torch.autograd.grad(reference.energy_score(x64, *args64).sum(), x64)
        check_close(id + " value", forward(), reference.energy_score(rs, target, beta, prec, kind),
                    reference.energy_score(x64, *args64))
        check_close(id, kernel(), baseline(reference.energy_score)(), (g64,), atol_scale=3e-5)

    return Case(
        id=id,
        workload=f"energy_score fwd+bwd(samples) block2 per-row β B={B} M={M} d={d}",
        kernel=kernel,
        reference_fn=reference.energy_score,
        baseline=baseline,
        check=check,
        bytes_x=samples.numel() * samples.element_size(),
        meta=dict(B=B, M=M, d=d),
        extras={"fwd": forward, "cdist_mm": cdist_mm},
    )


def energy_score_784(quick: bool = False) -> Case:
    return fwd_bwd_case("energy_score_784", 16 if quick else 64, 32, 784)


def energy_score_784_m2(quick: bool = False) -> Case:
    return fwd_bwd_case("energy_score_784_m2", 32 if quick else 256, 2, 784)


def energy_score_2(quick: bool = False) -> Case:
    return fwd_bwd_case("energy_score_2", 32 if quick else 128, 64, 2)


CASES = (energy_score_784, energy_score_784_m2, energy_score_2)

_NEED = {"energy_score_784": 4.0, "energy_score_784_m2": 2.0, "energy_score_2": 5.0}
# against what a user would write: torch.cdist in its Gram (GEMM) mode + autograd
_NEED_CDIST_MM = {"energy_score_784": 4.0, "energy_score_784_m2": 2.0}


def targets(res: Dict[str, object]) -> List[object]:
    """Issue 3 targets of these workloads (speed-up over the eager reference)."""
    out = [speedup_target(res, id, res[id].case.workload, "reference", need) for id, need in _NEED.items() if id in res]
    for id, need in _NEED_CDIST_MM.items():
        if id not in res or "cpu" not in res[id].timings:
            continue
        r = res[id]
        ours, mm = r.timings["cpu"].median_ms, r.extras["cdist_mm"].median_ms
        out.append(Target(r.case.workload, f"≥{need:g}× faster than eager cdist (Gram mode) + autograd",
                          f"{mm / ours:.2f}× ({ours:.2f} vs {mm:.2f} ms)", mm / ours >= need))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_energy_score_784(benchmark, backend, quick):
    run_benchmark(benchmark, energy_score_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_energy_score_784_m2(benchmark, backend, quick):
    run_benchmark(benchmark, energy_score_784_m2(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_energy_score_2(benchmark, backend, quick):
    run_benchmark(benchmark, energy_score_2(quick), backend)
