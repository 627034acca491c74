"""Benchmark of etweedie.is_score (importance-sampling oracle), float32, and the float64 oracle of the score tables.

4096 queries against a 160,000-point clean bank (the paper's §5.1 oracle), d = 2, noise
GeneralizedGaussian(β=1.4, λ=1.8, Metric.block(S)) with S the base tuple's
(σ/c_{β,2})²·S(u=0, v=0.6).  The bank is the eight-Gaussians mixture (radius 2, std 0.2);
queries are bank points plus noise drawn from the law.

Baseline: ``etweedie.ops.reference.is_score``, which processes ``CHUNK`` queries at a time
and so holds CHUNK × M residuals at once.  CHUNK = 32: chunks of 16…128 queries ran within
noise of each other here, 4–8 pay per-op overhead and 512 ran ~4× slower (its (CHUNK, M)
temporaries leave the cache); its peak memory is in the table.
The torch.compile baseline is skipped: the reference loops over query chunks in Python, so
dynamo would unroll Q / CHUNK = 128 chunk bodies into one graph (compile time grows with Q),
and an unchunked graph would need Q × M × d floats (5 GB for the residuals alone).

GB/s is not reported: the kernel re-reads a 1.3 MB bank from cache once per query and is
bound by arithmetic (one power and one exp per query–bank pair); the note gives pairs/s.

    pytest benchmarks/bench_is_score.py
"""

from __future__ import annotations

import math

import pytest
import torch

import etweedie
from etweedie.ops import reference
from etweedie.ops._args import metric_param

from .common import BACKENDS, Case, check_close, run_benchmark

BETA, LAM = 1.4, 1.8
CHUNK = 32
CHECK_QUERIES = 64  # the float64 check runs on this many queries against the full bank


def eight_gaussians(n: int, generator: torch.Generator) -> torch.Tensor:
    k = torch.randint(0, 8, (n,), generator=generator)
    angle = k * (math.pi / 4)
    centers = 2.0 * torch.stack([angle.cos(), angle.sin()], -1)
    return centers + 0.2 * torch.randn(n, 2, generator=generator)


def is_score_160k(quick: bool = False, dtype: torch.dtype = torch.float32) -> Case:
    Q, M = (128, 5_000) if quick else ((4096 if dtype == torch.float32 else 1024), 160_000)
    f64 = dtype == torch.float64
    g = torch.Generator().manual_seed(0)
    # from_params builds exactly Metric.block((σ/c)² S(u, v)) — the base tuple's geometry.
    metric = etweedie.Metric.from_params(0.57, 0.0, 0.6, BETA, 2)
    law = etweedie.GeneralizedGaussian(BETA, LAM, metric)
    bank = eight_gaussians(M, g).to(dtype)
    y = (eight_gaussians(Q, g) + law.sample((Q,), generator=g, dim=2).float()).to(dtype)
    prec, kind = metric_param(metric, torch.Size([1]), 2)
    prec = prec.to(dtype)

    def kernel():
        return etweedie.is_score(y, bank, law, backend="cpu")

    def check():
        yc = y[:CHECK_QUERIES]
        out = etweedie.is_score(yc, bank, law, backend="cpu")
        ref64 = reference.is_score(yc.double(), bank.double(), BETA, LAM, prec.double(), kind, chunk=CHUNK)
        ref32 = reference.is_score(yc.float(), bank.float(), BETA, LAM, prec.float(), kind, chunk=CHUNK)
        if f64:  # the float64 oracle must match the float64 reference (same law) far below float32 error
            ref = etweedie.is_score(yc, bank, law, backend="reference")
            for name, a, b in zip(("score", "mean", "ess"), out, ref):
                err = float((a - b).abs().max() / b.abs().max())
                if not err < 1e-12:
                    raise AssertionError(f"is_score float64 {name}: max relative error {err:.2e} vs the float64 reference")
            return
        # The kernel's running sums are double (csrc/cpu/is_score_cpu.cpp), so the tests'
        # criterion holds over the full 160,000-point bank.
        check_close("is_score (score, mean, ess)", out, ref32, ref64)

    return Case(
        id="is_score_160k" + ("_f64" if f64 else ""),
        workload=f"is_score Q={Q} M={M} d=2 block" + (" float64" if f64 else ""),
        kernel=kernel,
        reference_fn=reference.is_score,
        baseline=lambda fn: (lambda: fn(y, bank, BETA, LAM, prec, kind, chunk=CHUNK)),
        check=check,
        bytes_x=bank.numel() * bank.element_size(),
        meta=dict(Q=Q, M=M, d=2),
        compile_skip="the reference's Python chunk loop would unroll into the graph (module docstring)",
        gbps=False,
        work=("pairs", Q * M),
        # Seconds per call: the peak-memory call doubles as warm-up, then three timed calls.
        timing=dict(warmup=0, min_repeats=3, max_repeats=3),
        rounds=3,
    )


def is_score_160k_f64(quick: bool = False) -> Case:
    """The float64 oracle of the score tables (score_eval, estimate): 1,024 queries."""
    return is_score_160k(quick, torch.float64)


CASES = (is_score_160k, is_score_160k_f64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_is_score_160k(benchmark, backend, case, quick):
    run_benchmark(benchmark, case(quick), backend)
