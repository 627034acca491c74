"""Benchmark of etweedie.langevin_step, float32: B=64, N=256, d=784, isotropic metric.

The fused step should cost little more than the score it contains: the extra
``et_score`` times ``etweedie.et_score`` alone on the same inputs in the same run, for the
target langevin_step ≤ 1.2 × et_score.  ``langevin_step_784_bf16`` (``_fp16``): the same step on 16-bit
draws (a 16-bit posterior's output, float32 state); the extra ``fp32 draws`` times the float32
step on the same draws widened, in the same rounds.

    pytest benchmarks/bench_langevin_step.py
"""

from __future__ import annotations

import pytest
import torch

import etweedie
from etweedie.ops import reference

from .bench_et_score import BETA, LAM, canonical_args, draws, to64
from .common import BACKENDS, Case, check_close, run_benchmark

STEP = 0.01


def langevin_step_784(quick: bool = False, x_dtype=None) -> Case:
    B, N, d = (16, 64, 784) if quick else (64, 256, 784)
    id, metric = "langevin_step_784", etweedie.Metric.isotropic(0.5)
    y, x = draws(B, N, d)
    extras, note = {}, ""
    if x_dtype is not None:
        id = f"{id}_{'bf16' if x_dtype == torch.bfloat16 else 'fp16'}"
        note = f", {str(x_dtype).removeprefix('torch.')} draws"
        x = x.to(x_dtype)
        x32 = x.float()
        extras["fp32 draws"] = lambda: etweedie.langevin_step(y, x32, noise, STEP, BETA, LAM, metric, backend="cpu")
    noise = torch.randn(B, d, generator=torch.Generator().manual_seed(2))
    cy, cx, beta, lam, prec, kind = canonical_args(y, x, metric)
    step = torch.full((B,), STEP)
    args = (cy, cx, noise, step, beta, lam, prec, kind)

    def kernel():
        return etweedie.langevin_step(y, x, noise, STEP, BETA, LAM, metric, backend="cpu")

    def check():
        check_close(id, kernel(), reference.langevin_step(*args), reference.langevin_step(*to64(args)))

    return Case(
        id=id,
        workload=f"langevin_step iso B={B} N={N} d={d}{note}",
        kernel=kernel,
        reference_fn=reference.langevin_step,
        baseline=lambda fn: (lambda: fn(*args)),
        check=check,
        bytes_x=x.numel() * x.element_size(),
        meta=dict(B=B, N=N, d=d),
        extras={"et_score": lambda: etweedie.et_score(y, x, BETA, LAM, metric, backend="cpu"), **extras},
    )


def langevin_step_784_bf16(quick: bool = False) -> Case:
    return langevin_step_784(quick, x_dtype=torch.bfloat16)


def langevin_step_784_fp16(quick: bool = False) -> Case:
    return langevin_step_784(quick, x_dtype=torch.float16)


CASES = (langevin_step_784, langevin_step_784_bf16, langevin_step_784_fp16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_langevin_step_784(benchmark, backend, quick):
    run_benchmark(benchmark, langevin_step_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_langevin_step_784_bf16(benchmark, backend, quick):
    run_benchmark(benchmark, langevin_step_784_bf16(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_langevin_step_784_fp16(benchmark, backend, quick):
    run_benchmark(benchmark, langevin_step_784_fp16(quick), backend)
