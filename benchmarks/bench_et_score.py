"""Benchmarks of etweedie.et_score (forward; backward for y and x), float32 (and 16-bit draws).

Workloads (the foundation issue's targets; ``quick`` shrinks B and N for smoke runs):

    et_score_iso_784     B=64,   N=256, d=784, isotropic metric (extras: 256 MiB copy, x.sum(), raw op)
    et_score_block_784   B=64,   N=256, d=784, block metric I ⊗ S, S 2×2 SPD (extra: raw op)
    et_score_iso_2       B=4096, N=64,  d=2,   isotropic metric
    et_score_bwd_784     B=64,   N=256, d=784, forward + ∂/∂y, ∂/∂x (extra: forward alone)
    et_score_iso_784_bf16, et_score_block_784_bf16, et_score_iso_784_fp16, et_score_block_784_fp16
                         the first two workloads with 16-bit draws (float32 y, float32 sums);
                         extra ``fp32 draws``: the float32 kernel on the same draws widened,
                         timed in the same rounds (the byte floor halves: the time should follow)
    et_score_bwd_784_bf16, et_score_bwd_784_fp16
                         et_score_bwd_784 with 16-bit draws (∂L/∂x written in their dtype)

Draws are the query plus Gaussian scatter, like a denoising posterior around y; β = 1.4,
λ = 1.8 (the paper's base tuple), so the kernel pays for the real power ‖u‖^{β−2}.

    pytest benchmarks/bench_et_score.py

The raw backward op (``etweedie::et_score_bwd`` on canonical tensors, no Python wrapper) by draws
dtype, with and without ∂L/∂x, in interleaved rounds (what the 16-bit draws cost the backward):

    python -m benchmarks.bench_et_score --raw-backward --threads 1
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

import etweedie
from etweedie.commandline import OneLineParser
from etweedie.ops import reference
from etweedie.ops._rows import canonicalize

from .common import (BACKENDS, MAX_THREADS, Case, Timing, check_close, check_flags, check_threads, copy_thunk, flag_error,
                     run_benchmark, set_threads, time_calls)

BETA, LAM = 1.4, 1.8
BLOCK_S = torch.tensor([[0.5, 0.3], [0.3, 0.5]])  # SPD, correlated pixel pairs


def draws(B: int, N: int, d: int, seed: int = 0):
    """y (B, d) and x (B, N, d) = y + 0.5·noise, float32."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, d, generator=g)
    x = y.unsqueeze(1) + 0.5 * torch.randn(B, N, d, generator=g)
    return y, x


def canonical_args(y, x, metric) -> tuple:
    """The reference's arguments (y, x, beta, lam, prec, kind) for the same inputs."""
    c = canonicalize("et_score", y, x, BETA, LAM, metric)
    return c.y, c.x, c.beta, c.lam, c.prec, c.kind


def to64(args) -> tuple:
    return tuple(a.detach().double() if isinstance(a, torch.Tensor) else a for a in args)


def forward_case(id: str, B: int, N: int, d: int, metric, label: str, extras=None, x_dtype=None,
                 raw: bool = False) -> Case:
    """``extras(x)``, if given, returns more thunks to time in the same rounds.  ``x_dtype``
    (bfloat16/float16): the draws are stored in it (y stays float32), the reference runs on the
    same 16-bit draws, and the extra ``fp32 draws`` times the float32 kernel on them widened.
    ``raw``: the extra ``raw op`` times ``torch.ops.etweedie.et_score_fwd`` on the canonical
    tensors (no Python wrapper, no checks): the public op's time minus it is what the wrapper and
    its checks cost at this size."""
    y, x = draws(B, N, d)
    if x_dtype is not None:
        x = x.to(x_dtype)
        x32 = x.float()
        more = extras
        extras = lambda x: {"fp32 draws": lambda: etweedie.et_score(y, x32, BETA, LAM, metric, backend="cpu"),  # noqa: E731
                            **(more(x) if more else {})}
        label = f"{label}, {str(x_dtype).removeprefix('torch.')} draws"
    args = canonical_args(y, x, metric)
    if raw:
        more_raw = extras
        extras = lambda x: {"raw op": lambda: torch.ops.etweedie.et_score_fwd(*args),  # noqa: E731
                            **(more_raw(x) if more_raw else {})}

    def kernel():
        return etweedie.et_score(y, x, BETA, LAM, metric, backend="cpu")

    def check():
        check_close(id, kernel(), reference.et_score(*args), reference.et_score(*to64(args)))

    return Case(
        id=id,
        workload=f"et_score {label} B={B} N={N} d={d}",
        kernel=kernel,
        reference_fn=reference.et_score,
        baseline=lambda fn: (lambda: fn(*args)),
        check=check,
        bytes_x=x.numel() * x.element_size(),
        meta=dict(B=B, N=N, d=d),
        extras=extras(x) if extras else {},
    )


def et_score_iso_784(quick: bool = False) -> Case:
    """Extras timed in the same interleaved rounds, so under the same load as the kernel:
    ``copy`` (a 256 MiB ``dst.copy_(src)``: the memory-bandwidth floor) and ``x.sum()``
    (torch's own streaming read of the same x: what a plain read-only pass achieves)."""
    B, N = (16, 64) if quick else (64, 256)
    copy, copy_bytes = copy_thunk(64 if quick else 256)
    case = forward_case(
        "et_score_iso_784", B, N, 784, etweedie.Metric.isotropic(0.5), "iso",
        extras=lambda x: {"copy": copy, "x.sum()": lambda: x.sum()}, raw=True,
    )
    case.meta["copy_bytes"] = copy_bytes
    return case


def et_score_block_784(quick: bool = False) -> Case:
    B, N = (16, 64) if quick else (64, 256)
    return forward_case("et_score_block_784", B, N, 784, etweedie.Metric.block(BLOCK_S), "block 2×2", raw=True)


def et_score_iso_784_bf16(quick: bool = False) -> Case:
    B, N = (16, 64) if quick else (64, 256)
    return forward_case("et_score_iso_784_bf16", B, N, 784, etweedie.Metric.isotropic(0.5), "iso",
                        x_dtype=torch.bfloat16)


def et_score_block_784_bf16(quick: bool = False) -> Case:
    B, N = (16, 64) if quick else (64, 256)
    return forward_case("et_score_block_784_bf16", B, N, 784, etweedie.Metric.block(BLOCK_S), "block 2×2",
                        x_dtype=torch.bfloat16)


def et_score_iso_784_fp16(quick: bool = False) -> Case:
    B, N = (16, 64) if quick else (64, 256)
    return forward_case("et_score_iso_784_fp16", B, N, 784, etweedie.Metric.isotropic(0.5), "iso",
                        x_dtype=torch.float16)


def et_score_block_784_fp16(quick: bool = False) -> Case:
    B, N = (16, 64) if quick else (64, 256)
    return forward_case("et_score_block_784_fp16", B, N, 784, etweedie.Metric.block(BLOCK_S), "block 2×2",
                        x_dtype=torch.float16)


def et_score_iso_2(quick: bool = False) -> Case:
    B = 512 if quick else 4096
    return forward_case("et_score_iso_2", B, 64, 2, etweedie.Metric.isotropic(0.5), "iso")


def et_score_bwd_784(quick: bool = False, x_dtype=None) -> Case:
    """Forward + backward for y and x; the extra ``fwd`` times the forward alone (grad mode
    on, so it also saves what backward needs) for bwd = (fwd+bwd) − fwd.  ``x_dtype``: 16-bit
    draws (∂L/∂x in their dtype); the extra ``fp32 draws`` times fwd+bwd on them widened."""
    B, N, d = (16, 64, 784) if quick else (64, 256, 784)
    id, metric = "et_score_bwd_784", etweedie.Metric.isotropic(0.5)
    y, x = draws(B, N, d)
    extras = {}
    if x_dtype is not None:
        id = f"{id}_{'bf16' if x_dtype == torch.bfloat16 else 'fp16'}"
        x = x.to(x_dtype)
        x32 = x.float().requires_grad_()
        y32 = y.clone().requires_grad_()
        extras["fp32 draws"] = lambda: torch.autograd.grad(etweedie.et_score(y32, x32, BETA, LAM, metric, backend="cpu"),
                                                           (y32, x32), grad_s)
    y.requires_grad_()
    x.requires_grad_()
    grad_s = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    # The reference differentiates with respect to its own leaves (views of the same data).
    ry, rx, *rest = canonical_args(y.detach(), x.detach(), metric)
    ry, rx = ry.requires_grad_(), rx.requires_grad_()

    def forward():
        return etweedie.et_score(y, x, BETA, LAM, metric, backend="cpu")

    def kernel():
        return torch.autograd.grad(forward(), (y, x), grad_s)

    def baseline(fn):
        return lambda: torch.autograd.grad(fn(ry, rx, *rest), (ry, rx), grad_s)

    def check():
        y64, x64 = ry.detach().double().requires_grad_(), rx.detach().double().requires_grad_()
        ref64 = torch.autograd.grad(reference.et_score(y64, x64, *to64(rest)), (y64, x64), grad_s.double())
        check_close(id, kernel(), baseline(reference.et_score)(), ref64, atol_scale=3e-5)

    draws_note = "" if x_dtype is None else f", {str(x_dtype).removeprefix('torch.')} draws"
    return Case(
        id=id,
        workload=f"et_score fwd+bwd(y,x) iso B={B} N={N} d={d}{draws_note}",
        kernel=kernel,
        reference_fn=reference.et_score,
        baseline=baseline,
        check=check,
        bytes_x=x.numel() * x.element_size(),
        meta=dict(B=B, N=N, d=d),
        extras={"fwd": forward, **extras},
    )


def et_score_bwd_784_bf16(quick: bool = False) -> Case:
    return et_score_bwd_784(quick, x_dtype=torch.bfloat16)


def et_score_bwd_784_fp16(quick: bool = False) -> Case:
    return et_score_bwd_784(quick, x_dtype=torch.float16)


CASES = (et_score_iso_784, et_score_block_784, et_score_iso_2, et_score_bwd_784,
         et_score_iso_784_bf16, et_score_block_784_bf16, et_score_iso_784_fp16, et_score_block_784_fp16,
         et_score_bwd_784_bf16, et_score_bwd_784_fp16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_et_score_iso_784(benchmark, backend, quick):
    run_benchmark(benchmark, et_score_iso_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_et_score_block_784(benchmark, backend, quick):
    run_benchmark(benchmark, et_score_block_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_et_score_iso_2(benchmark, backend, quick):
    run_benchmark(benchmark, et_score_iso_2(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_et_score_bwd_784(benchmark, backend, quick):
    run_benchmark(benchmark, et_score_bwd_784(quick), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factory", [et_score_iso_784_bf16, et_score_block_784_bf16, et_score_iso_784_fp16,
                                     et_score_block_784_fp16, et_score_bwd_784_bf16, et_score_bwd_784_fp16],
                         ids=lambda f: f.__name__)
def test_et_score_16_bit_draws(benchmark, backend, factory, quick):
    run_benchmark(benchmark, factory(quick), backend)


def raw_backward_times(B: int = 64, N: int = 256, d: int = 784, rounds: int = 25) -> Dict[str, Timing]:
    """Median ms of ``torch.ops.etweedie.et_score_bwd`` (isotropic metric, ∂/∂y; ∂/∂y and ∂/∂x)
    for float32, bfloat16 and float16 draws of the same values, timed in interleaved rounds."""
    y, x = draws(B, N, d)
    g = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    gm = torch.zeros(B, d)
    beta, lam, prec = torch.full((B,), BETA), torch.full((B,), LAM), torch.full((B,), 2.0)
    fns = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        xd = x.to(dtype)
        _, m = torch.ops.etweedie.et_score_fwd(y, xd, beta, lam, prec, 0)
        for need_x in (False, True):
            fns[f"{name} {'dy+dx' if need_x else 'dy'}"] = (
                lambda xd=xd, m=m, need_x=need_x: torch.ops.etweedie.et_score_bwd(
                    g, gm, y, xd, beta, lam, prec, 0, m, True, need_x, False, False, False))
    return time_calls(fns, warmup=2, min_repeats=rounds, max_repeats=rounds, budget_s=0.0)


def main(argv=None) -> int:

    p = OneLineParser(prog="python -m benchmarks.bench_et_score", description=__doc__.splitlines()[0])
    p.add_argument("--raw-backward", action="store_true", help="time the raw backward op by draws dtype")
    p.add_argument("--threads", type=int, default=1, help=f"torch threads, 1 to {MAX_THREADS}")
    p.add_argument("--rounds", type=int, default=25, help="interleaved timed rounds (>= 1)")
    args = p.parse_args(argv)
    if not args.raw_backward:
        p.error("nothing to do: pass --raw-backward (the workloads run under benchmarks.table or pytest)")
    try:  # one line and exit status 2 for a flag the run cannot use, before any timing
        check_flags([check_threads(args.threads), ("--rounds", args.rounds, 1)])
    except ValueError as exc:
        return flag_error(p.prog, exc)
    set_threads(args.threads)
    print(f"et_score_bwd 64 × 256 × 784, isotropic, {torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds")
    print("| draws | gradients | median ms (p20–p80) |\n|---|---|---|")
    for key, t in raw_backward_times(rounds=args.rounds).items():
        dtype, grads = key.split()
        print(f"| {dtype} | {grads} | {t} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
