"""Benchmarks of etweedie.student_t_score (forward; backward for y and x), float32.

Workloads (``quick`` shrinks B and N for smoke runs):

    student_t_score_784      B=64, N=256, d=784, block metric I ⊗ S (S 2×2 SPD), c = 400
    student_t_score_bwd_784  the same, forward + ∂/∂y, ∂/∂x (extra: the forward alone)

Draws are the query plus Gaussian scatter, like a denoising posterior around y.  The eager
baseline is the reference (etweedie.ops.reference.student_t_score: residuals, the quadratic
form and the weighted mean in torch ops), timed with torch.compile of it in the same run.

    pytest benchmarks/bench_student_t_score.py
"""

from __future__ import annotations

import pytest
import torch

import etweedie
from etweedie.ops import reference
from etweedie.ops._rows import canonicalize

from .common import BACKENDS, Case, check_close, run_benchmark

C = 400.0  # > d/2 = 392
BLOCK_S = torch.tensor([[0.5, 0.3], [0.3, 0.5]])


def draws(B: int, N: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, d, generator=g)
    x = y.unsqueeze(1) + 0.5 * torch.randn(B, N, d, generator=g)
    return y, x


def _canonical(y, x, metric):
    cn = canonicalize("student_t_score", y, x, 2.0, 1.0, metric)
    return cn.y, cn.x, torch.full((cn.y.shape[0],), C), cn.prec, cn.kind


def _to64(args):
    return tuple(a.detach().double() if isinstance(a, torch.Tensor) else a for a in args)


def student_t_score_784(quick: bool = False) -> Case:
    B, N, d = (16, 64, 784) if quick else (64, 256, 784)
    metric = etweedie.Metric.block(BLOCK_S)
    y, x = draws(B, N, d)
    args = _canonical(y, x, metric)

    def kernel():
        return etweedie.student_t_score(y, x, C, metric, backend="cpu")

    def check():
        check_close("student_t_score_784", kernel(), reference.student_t_score(*args),
                    reference.student_t_score(*_to64(args)))

    return Case(
        id="student_t_score_784", workload=f"student_t_score block 2×2 B={B} N={N} d={d}", kernel=kernel,
        reference_fn=reference.student_t_score, baseline=lambda fn: (lambda: fn(*args)), check=check,
        bytes_x=x.numel() * x.element_size(), meta=dict(B=B, N=N, d=d),
    )


def student_t_score_bwd_784(quick: bool = False) -> Case:
    B, N, d = (16, 64, 784) if quick else (64, 256, 784)
    id, metric = "student_t_score_bwd_784", etweedie.Metric.block(BLOCK_S)
    y, x = draws(B, N, d)
    y.requires_grad_()
    x.requires_grad_()
    grad_s = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    ry, rx, *rest = _canonical(y.detach(), x.detach(), metric)
    ry, rx = ry.requires_grad_(), rx.requires_grad_()

    def forward():
        return etweedie.student_t_score(y, x, C, metric, backend="cpu")

    def kernel():
        return torch.autograd.grad(forward(), (y, x), grad_s)

    def baseline(fn):
        return lambda: torch.autograd.grad(fn(ry, rx, *rest), (ry, rx), grad_s)

    def check():
        y64, x64 = ry.detach().double().requires_grad_(), rx.detach().double().requires_grad_()
        ref64 = torch.autograd.grad(reference.student_t_score(y64, x64, *_to64(rest)), (y64, x64), grad_s.double())
        check_close(id, kernel(), baseline(reference.student_t_score)(), ref64, atol_scale=3e-5)

    return Case(
        id=id, workload=f"student_t_score fwd+bwd(y,x) block 2×2 B={B} N={N} d={d}", kernel=kernel,
        reference_fn=reference.student_t_score, baseline=baseline, check=check,
        bytes_x=x.numel() * x.element_size(), meta=dict(B=B, N=N, d=d), extras={"fwd": forward},
    )


CASES = (student_t_score_784, student_t_score_bwd_784)


@pytest.mark.parametrize("backend", BACKENDS)
def test_student_t_score_784(benchmark, backend, quick):
    run_benchmark(benchmark, student_t_score_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_student_t_score_bwd_784(benchmark, backend, quick):
    run_benchmark(benchmark, student_t_score_bwd_784(quick), backend)
