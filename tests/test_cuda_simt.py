"""The CUDA kernels and bindings (csrc/cuda), run on the CPU by the host SIMT emulator
(tests/simt/simt.h, built by tests/simt_build.py), against the CPU kernels of the same ops.

The emulator runs each block's threads as fibers with exact barrier and warp-shuffle semantics,
a seeded thread order between barriers, NaN-filled fresh shared memory and workspaces, and
checks on divergent barriers and misaligned vector loads; it pretends to have ``sms``
multiprocessors, so the grid shapes a real H100 would get (rows split by coordinates, draws
split across blocks) are exercised by choosing it.  What it cannot show is speed, and memory
ordering beyond barriers; that is left to ``make gpu-check``.

Each case draws fresh random inputs (seeded per run by conftest's seed) and compares every output
of ``torch.ops.etweedie_simt.<op>`` (the CUDA code) with ``torch.ops.etweedie.<op>`` (the CPU
code): the two backends share the math (csrc/common) but not the loops, tiling or summation order.
"""

from __future__ import annotations

import math
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import simt_build  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def simt():
    simt_build.load()
    yield torch.ops.etweedie_simt
    simt_build.configure()


@pytest.fixture
def gen(seed):
    """Fresh inputs per run (conftest's seed fixture); the seed is printed for a failing case."""
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- the emulator itself

def test_emulator_runs_a_correct_kernel(simt):
    out = simt.selftest("block_sum")
    assert out[:3].tolist() == [128 * 129 / 2] * 3


@pytest.mark.parametrize("case, message", [
    ("shuffle_beside_barrier", "warp collective reached by 16 of the 32 lanes"),
    ("exited_lane_shuffle", "warp collective reached by 16 of the 32 lanes"),
    ("misaligned_load", "misaligned 16-byte vector access"),
    ("too_much_shared", "invalid argument"),
    ("bad_grid", "invalid configuration"),
])
def test_emulator_rejects_what_a_gpu_would_not_run(simt, case, message):
    with pytest.raises(RuntimeError, match=message):
        simt.selftest(case)


def test_emulator_exposes_a_missing_barrier(simt):
    """Reading a neighbour's shared slot without __syncthreads: some thread order reads the
    0xff fill (NaN) before the neighbour's write, and the seeds give different results."""
    results = []
    for seed in range(4):
        simt_build.configure(seed=seed)
        results.append(simt.selftest("racy_publish"))
    simt_build.configure()
    assert any(r.isnan().any() for r in results)
    assert any(not torch.equal(results[0], r) for r in results[1:])


# ---------------------------------------------------------------------------- score ops

# (compute dtype, draws dtype)
DTYPES = [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.float32, torch.float16), (torch.float64, torch.bfloat16)]
# (kind, k): isotropic, diagonal, block k×k
METRICS = [(0, 0), (1, 0), (2, 1), (2, 2), (2, 3), (2, 4)]


def _precision(kind, k, B, d, dtype, gen, shared=False):
    rows = 1 if shared else B
    if kind == 0:
        p = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    elif kind == 1:
        p = torch.rand(rows, d, generator=gen, dtype=torch.float64) + 0.5
    else:
        a = torch.randn(rows, k, k, generator=gen, dtype=torch.float64)
        p = a @ a.transpose(1, 2) + k * torch.eye(k, dtype=torch.float64)
    p = p.to(dtype)
    return p.expand(B, *p.shape[1:]) if shared else p


def _rows(B, N, d, kind, k, dtype, xdtype, gen, *, shared_x=False, shared_params=False, coincident=False,
          scale=1.0, beta=None):
    y = (torch.randn(B, d, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if shared_x:
        x = (torch.randn(1, N, d, generator=gen, dtype=torch.float64) * scale).to(xdtype).expand(B, N, d)
    else:
        x = (torch.randn(B, N, d, generator=gen, dtype=torch.float64) * scale).to(xdtype)
    if coincident and N > 0 and B > 0 and not shared_x:
        x[:, 0] = y.to(xdtype)
        y = x[:, 0].to(dtype).contiguous()  # exactly equal after the draws' rounding
    rows = 1 if shared_params else B
    b = torch.rand(rows, generator=gen, dtype=torch.float64) * 1.6 + 0.2 if beta is None else torch.full((rows,), beta)
    lam = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    b, lam = b.to(dtype).expand(B), lam.to(dtype).expand(B)
    prec = _precision(kind, k, B, d, dtype, gen, shared=shared_params)
    return y, x, b, lam, prec


def _close(got, want, what, rtol, atol):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    if got.numel():
        scale = want.double().abs().max().item()
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


def _tol(dtype, xdtype):
    if xdtype in (torch.bfloat16, torch.float16):  # ∂L/∂x rounded to 16 bits may round the other way
        return 2e-5 if dtype == torch.float32 else 1e-11, 1e-2 if xdtype == torch.bfloat16 else 2e-3
    return (2e-5, 2e-5) if dtype == torch.float32 else (1e-11, 1e-11)


SHAPES = [  # (B, N, d, sms): plain rows, draws split over blocks, coordinates split over blocks, MNIST rows
    (5, 70, 12, 2),
    (3, 70, 12, 132),
    (2, 5, 300, 132),
    (2, 40, 784, 2),
]


def _metric_ok(kind, k, d):
    return kind != 2 or d % k == 0


@pytest.mark.parametrize("dtype, xdtype", DTYPES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("kind, k", METRICS)
@pytest.mark.parametrize("B, N, d, sms", SHAPES)
def test_et_score_and_langevin_match_cpu(simt, gen, dtype, xdtype, kind, k, B, N, d, sms):
    if not _metric_ok(kind, k, d):
        pytest.skip("d not a multiple of k")
    simt_build.configure(sms=sms, seed=gen.initial_seed())
    y, x, beta, lam, prec = _rows(B, N, d, kind, k, dtype, xdtype, gen)
    rtol, gtol = _tol(dtype, xdtype)
    s_sim, m_sim = simt.et_score_fwd(y, x, beta, lam, prec, kind)
    s_cpu, m_cpu = torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, kind)
    _close(s_sim, s_cpu, "s", rtol, rtol)
    _close(m_sim, m_cpu, "m", rtol, rtol)
    noise = torch.randn(B, d, generator=gen, dtype=torch.float64).to(dtype)
    step = (torch.rand(B, generator=gen, dtype=torch.float64) * 0.1).to(dtype)
    out_sim = simt.langevin_step_fwd(y, x, noise, step, beta, lam, prec, kind)
    out_cpu = torch.ops.etweedie.langevin_step_fwd(y, x, noise, step, beta, lam, prec, kind)
    for a, b, name in zip(out_sim, out_cpu, ("y_next", "m")):
        _close(a, b, name, rtol, rtol)
    grad = torch.randn(B, d, generator=gen, dtype=torch.float64).to(dtype)
    grad_m = torch.randn(B, d, generator=gen, dtype=torch.float64).to(dtype)
    g_sim = simt.et_score_bwd(grad, grad_m, y, x, beta, lam, prec, kind, m_cpu, True, True, True, True, True)
    g_cpu = torch.ops.etweedie.et_score_bwd(grad, grad_m, y, x, beta, lam, prec, kind, m_cpu, True, True, True, True, True)
    for a, b, name in zip(g_sim, g_cpu, ("grad_y", "grad_x", "grad_beta", "grad_lam", "grad_prec")):
        _close(a, b, name, rtol * 10, gtol if name == "grad_x" else rtol * 10)


# Which forward kernel a shape gets (csrc/cuda/et_score_cuda.cuh, et_score_fwd_dispatch): the
# wide packet kernel (16-byte loads) where d is a multiple of the 16-byte packet, the narrow one
# (scalar or one-metric-block loads) for short rows, the tiled kernel otherwise; a finalize kernel
# after a draw split (rows fewer than SMs).
KERNEL_CHOICE = [
    # B, N, d, draws, kind, k, sms, kernels launched
    (3, 64, 784, torch.float32, 0, 0, 2, ["packet_kernel<float, float, 0, 1, false, 0, true>"]),
    (3, 64, 784, torch.bfloat16, 2, 2, 2, ["packet_kernel<float, etweedie::bf16, 2, 2, false, 0, true>"]),
    (3, 64, 384, torch.float64, 1, 0, 2, ["packet_kernel<double, double, 1, 1, false, 0, true>"]),
    (3, 64, 784, torch.float64, 1, 0, 2, ["et_score_fwd_kernel<double, double, 1, 1, false, 0>"]),  # over 384 doubles
    (3, 64, 1024, torch.bfloat16, 0, 0, 2, ["packet_kernel<float, etweedie::bf16, 0, 1, false, 0, true>"]),
    # 16-bit draws prefetch the next draw's packets, so their wide rows end at 1,024 values, not 1,280
    (3, 64, 1280, torch.bfloat16, 0, 0, 2, ["et_score_fwd_kernel<float, etweedie::bf16, 0, 1, false, 0>"]),
    # the prefetch across split draw ranges whose lengths do not divide by the groups in flight
    (3, 37, 784, torch.bfloat16, 2, 2, 132, ["packet_kernel<float, etweedie::bf16, 2, 2, false, 0, true>",
                                             "finalize_kernel"]),
    (3, 64, 1296, torch.float16, 0, 0, 2, ["et_score_fwd_kernel<float, etweedie::fp16, 0, 1, false, 0>"]),
    (3, 64, 2, torch.float32, 0, 0, 2, ["packet_kernel<float, float, 0, 1, false, 0, false>"]),
    (3, 64, 6, torch.float16, 2, 3, 2, ["packet_kernel<float, etweedie::fp16, 2, 3, false, 0, false>"]),
    (3, 64, 6, torch.float32, 2, 3, 132, ["packet_kernel<float, float, 2, 3, false, 0, false>", "finalize_kernel"]),
    (2, 8, 1030, torch.float32, 0, 0, 132, ["et_score_fwd_kernel<float, float, 0, 1, false, 0>"]),  # d % 4 != 0, long
    (2, 8, 2052, torch.float32, 0, 0, 132, ["et_score_fwd_kernel<float, float, 0, 1, false, 0>"]),  # over 1024 floats
]


@pytest.mark.parametrize("B, N, d, xdtype, kind, k, sms, kernels", KERNEL_CHOICE)
def test_forward_kernel_choice(simt, gen, B, N, d, xdtype, kind, k, sms, kernels):
    simt_build.configure(sms=sms, seed=gen.initial_seed())
    dtype = torch.float64 if xdtype == torch.float64 else torch.float32
    y, x, beta, lam, prec = _rows(B, N, d, kind, k, dtype, xdtype, gen)
    simt.launched()
    got = simt.et_score_fwd(y, x, beta, lam, prec, kind)
    log = simt.launched()
    assert len(log) == len(kernels) and all(want in line for want, line in zip(kernels, log)), log
    rtol = _tol(dtype, xdtype)[0]
    for a, b in zip(got, torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, kind)):
        _close(a, b, "et_score_fwd", rtol, rtol)


def test_student_t_forward_is_the_packet_kernel_with_its_weight(simt, gen):
    """student_t_score's CUDA forward is et_score's (LAW = 1: w = 1/(1 + q), scale −2c)."""
    simt_build.configure(sms=2, seed=gen.initial_seed())
    y, x, _, _, prec = _rows(3, 40, 784, 2, 2, torch.float32, torch.bfloat16, gen)
    c = torch.full((3,), 400.0)
    simt.launched()
    got = simt.student_t_score_fwd(y, x, c, prec, 2)
    assert simt.launched() == ["etweedie::cuda::et_score_fwd_packet_kernel<float, etweedie::bf16, 2, 2, false, 1, true>"
                               " grid=(3,1,1) block=256 smem=28224"]
    for a, b in zip(got, torch.ops.etweedie.student_t_score_fwd(y, x, c, prec, 2)):
        _close(a, b, "student_t_score_fwd", 2e-5, 2e-5)


@pytest.mark.parametrize("offset, kernel", [(1, "false, 0, false>"), (2, "false, 0, false>"), (4, "false, 0, true>")])
def test_packets_need_aligned_draws(simt, gen, offset, kernel):
    """Draws that start off a 16-byte boundary (a view into a larger buffer) do not get the wide
    kernel's vector loads (which would fault on a GPU; the emulator checks every vector load)."""
    simt_build.configure(sms=2, seed=gen.initial_seed())
    B, N, d = 3, 20, 16
    y, _, beta, lam, prec = _rows(B, N, d, 0, 0, torch.float32, torch.float32, gen)
    x = torch.randn(B * N * d + offset, generator=gen)[offset:].view(B, N, d)
    simt.launched()
    got = simt.et_score_fwd(y, x, beta, lam, prec, 0)
    assert kernel in simt.launched()[0]
    for a, b in zip(got, torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, 0)):
        _close(a, b, "et_score_fwd", 2e-5, 2e-5)


def test_packet_kernels_can_be_turned_off(simt, gen, monkeypatch):
    """ETWEEDIE_CUDA_PACKET=0 (A/B timing in benchmarks) gives the tiled kernel, same results."""
    simt_build.configure(sms=2, seed=gen.initial_seed())
    y, x, beta, lam, prec = _rows(3, 20, 16, 2, 2, torch.float32, torch.float32, gen)
    on = simt.et_score_fwd(y, x, beta, lam, prec, 2)
    monkeypatch.setenv("ETWEEDIE_CUDA_PACKET", "0")
    simt.launched()
    off = simt.et_score_fwd(y, x, beta, lam, prec, 2)
    assert "et_score_fwd_kernel<" in simt.launched()[0]
    for a, b in zip(on, off):
        _close(a, b, "packet vs tiled", 2e-5, 2e-5)


@pytest.mark.parametrize("d, packet", [(16, "1"), (16, "0"), (6, "1"), (300, "0")])
@pytest.mark.parametrize("sms", [2, 4, 132])  # rows as they are, split by coordinates (tiled), split by draws
def test_out_of_range_rows_are_flagged_like_cpu(simt, gen, monkeypatch, d, packet, sms):
    """A row with a draw whose float32 q is out of range (an inf draw, a distinct draw 1e-21 away,
    a row at 1e26) comes back NaN from the CUDA kernels as from the CPU kernel (et_score,
    langevin_step, student_t_score); an exactly coincident draw and ordinary rows do not."""
    monkeypatch.setenv("ETWEEDIE_CUDA_PACKET", packet)
    simt_build.configure(sms=sms, seed=gen.initial_seed())
    B, N = 6, 40
    y, x, beta, lam, prec = _rows(B, N, d, 2, 2, torch.float32, torch.float32, gen)
    x[1, 7, 3] = float("inf")
    y[2, 0] = 0.0
    x[2, 11] = y[2]
    x[2, 11, 0] = 1e-21  # distinct from y, q ≈ 1e-42: below float32's range
    x[3, 5] = y[3]       # exact coincidence: in range
    y[4] *= 1e26
    x[4] *= 1e26         # q ≈ 1e52 > 2^100
    bad = torch.tensor([False, True, True, False, True, False])
    want = torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, 2)
    got = simt.et_score_fwd(y, x, beta, lam, prec, 2)
    noise = torch.randn(B, d, generator=gen)
    step = torch.full((B,), 0.01)
    got_l = simt.langevin_step_fwd(y, x, noise, step, beta, lam, prec, 2)
    c = torch.full((B,), 0.5 * d + 3.0)
    got_t = simt.student_t_score_fwd(y, x, c, prec, 2)
    want_t = torch.ops.etweedie.student_t_score_fwd(y, x, c, prec, 2)
    for out in (*want, *got, *got_l, *got_t, *want_t):
        assert torch.equal(out.isnan().all(1), bad) and not out[~bad].isnan().any()
    for a, b in zip(got, want):
        _close(a[~bad], b[~bad], "in-range rows", 2e-5, 2e-5)


@pytest.mark.parametrize("case", ["shared_x", "shared_params", "coincident_beta1", "coincident_beta2", "one_draw",
                                  "far_from_origin", "empty_rows"])
@pytest.mark.parametrize("sms", [2, 132])
def test_et_score_edge_cases_match_cpu(simt, gen, case, sms):
    simt_build.configure(sms=sms, seed=gen.initial_seed())
    B, N, d, kind, k = 4, 33, 8, 2, 2
    kw = {}
    if case == "shared_x":
        kw["shared_x"] = True
    elif case == "shared_params":
        kw["shared_params"] = True
    elif case.startswith("coincident"):
        kw.update(coincident=True, beta=1.0 if case.endswith("1") else 2.0)
    elif case == "one_draw":
        N = 1
    elif case == "far_from_origin":
        kw["scale"] = 1e6
    elif case == "empty_rows":
        B = 0
    y, x, beta, lam, prec = _rows(B, N, d, kind, k, torch.float64, torch.float64, gen, **kw)
    for a, b in zip(simt.et_score_fwd(y, x, beta, lam, prec, kind), torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, kind)):
        _close(a, b, case, 1e-10, 1e-10)
    _, m = torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, kind)
    grad = torch.randn(B, d, generator=gen, dtype=torch.float64)
    args = (grad, grad * 0.5, y, x, beta, lam, prec, kind, m, True, True, True, True, True)
    for a, b in zip(simt.et_score_bwd(*args), torch.ops.etweedie.et_score_bwd(*args)):
        _close(a, b, case + " backward", 1e-9, 1e-9)


@pytest.mark.parametrize("dtype, xdtype", DTYPES[:4], ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("kind, k", [(0, 0), (1, 0), (2, 2), (2, 3)])
@pytest.mark.parametrize("B, N, d, sms", SHAPES)
def test_student_t_score_matches_cpu(simt, gen, dtype, xdtype, kind, k, B, N, d, sms):
    if not _metric_ok(kind, k, d):
        pytest.skip("d not a multiple of k")
    simt_build.configure(sms=sms, seed=gen.initial_seed())
    y, x, _, _, prec = _rows(B, N, d, kind, k, dtype, xdtype, gen)
    c = (torch.rand(B, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    rtol, gtol = _tol(dtype, xdtype)
    fwd_sim = simt.student_t_score_fwd(y, x, c, prec, kind)
    fwd_cpu = torch.ops.etweedie.student_t_score_fwd(y, x, c, prec, kind)
    for a, b, name in zip(fwd_sim, fwd_cpu, ("s", "m")):
        _close(a, b, name, rtol, rtol)
    grad = torch.randn(B, d, generator=gen, dtype=torch.float64).to(dtype)
    args = (grad, -grad, y, x, c, prec, kind, fwd_cpu[1], True, True, True, True)
    for a, b, name in zip(simt.student_t_score_bwd(*args), torch.ops.etweedie.student_t_score_bwd(*args),
                          ("grad_y", "grad_x", "grad_c", "grad_prec")):
        _close(a, b, name, rtol * 10, gtol if name == "grad_x" else rtol * 10)


# ---------------------------------------------------------------------------- importance-sampling oracle

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("kind, k", [(0, 0), (1, 0), (2, 2)])
@pytest.mark.parametrize("Q, M, d", [(5, 150, 2), (3, 70, 40)])
def test_is_score_matches_cpu(simt, gen, dtype, kind, k, Q, M, d):
    simt_build.configure(seed=gen.initial_seed())
    y = torch.randn(Q, d, generator=gen, dtype=torch.float64).to(dtype) * 0.5
    bank = torch.randn(M, d, generator=gen, dtype=torch.float64).to(dtype)
    prec = _precision(kind, k, 1, d, dtype, gen)
    args = (y, bank, 1.5, 0.8, prec, kind)
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    for a, b, name in zip(simt.is_score_fwd(*args), torch.ops.etweedie.is_score_fwd(*args), ("score", "mean", "ess")):
        _close(a, b, name, rtol, rtol)


# ---------------------------------------------------------------------------- pairwise energy ops

# d per metric and size: small d (≤ 4, coordinates in registers) and large d, whose chunks hold
# whole metric blocks (32 coordinates, 30 for k = 3: 72 = 30 + 30 + 12; 68 = 32 + 32 + 4)
_ENERGY_D = {(0, 0): (2, 70), (1, 0): (3, 70), (2, 1): (1, 33), (2, 2): (2, 70), (2, 3): (3, 72), (2, 4): (4, 68)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("kind, k", list(_ENERGY_D))
@pytest.mark.parametrize("size, B, n, m", [("small", 3, 9, 7), ("large", 2, 40, 33)])
@pytest.mark.parametrize("flag", [False, True])
def test_energy_ops_match_cpu(simt, gen, dtype, kind, k, size, B, n, m, flag):
    """Every metric kind is applied in the pair kernels (no whitening pass); the metric gradient
    comes from the point gradients."""
    simt_build.configure(seed=gen.initial_seed())
    d = _ENERGY_D[kind, k][size == "large"]
    a = torch.randn(B, n, d, generator=gen, dtype=torch.float64).to(dtype)
    b = (torch.randn(B, m, d, generator=gen, dtype=torch.float64) + 0.3).to(dtype)
    target = torch.randn(B, d, generator=gen, dtype=torch.float64).to(dtype)
    beta = (torch.rand(B, generator=gen, dtype=torch.float64) * 1.5 + 0.3).to(dtype)
    prec = _precision(kind, k, B, d, dtype, gen, shared=flag)  # a broadcast metric (row stride 0) too
    grad = torch.randn(B, generator=gen, dtype=torch.float64).to(dtype)
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    _energy_cases_match(simt, a, b, target, beta, prec, kind, flag, grad, rtol)


def _energy_cases_match(simt, a, b, target, beta, prec, kind, flag, grad, rtol):
    cases = {
        "energy_score_fwd": (a, target, beta, prec, kind, flag),
        "energy_score_bwd": (grad, a, target, beta, prec, kind, flag, True, True, True, True),
        "energy_score_fwd_grad": (a, target, beta, prec, kind, flag, True, True, True, True),
        "energy_distance_fwd": (a, b, beta, prec, kind, flag),
        "energy_distance_bwd": (grad, a, b, beta, prec, kind, flag, True, True, True, True),
    }
    for name, args in cases.items():
        got, want = getattr(simt, name)(*args), getattr(torch.ops.etweedie, name)(*args)
        got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
        for i, (u, v) in enumerate(zip(got, want)):
            _close(u, v, f"{name}[{i}]", rtol, rtol)


# Rows with n + m ≤ 64 points at d > 4 take the coordinate-split kernels (energy_cuda.cuh: q shares
# per chunk, pair coefficients, gradients per chunk); the rest the tiled pair kernels.  Shapes:
# the training shape (M = 32 samples and the target: 33 points, 45 pair blocks, two coordinate
# slices per block) over several chunks of both kernels (float32: 128 and 64 coordinates,
# 126 and 63 for k = 3), 64 points (136 pair blocks: more than the block's threads), and the
# smallest clouds (2 + 3 points: one tile, 32 slices).
_SPLIT_CASES = [("score", 2, 32, 1, 300), ("distance", 2, 40, 24, 130), ("distance", 3, 2, 3, 12)]


def _split_args(case, dtype, kind, k, gen, scale=1.0):
    op, B, n, m, d = case
    d = d - d % k if kind == 2 else d
    a = (torch.randn(B, n, d, generator=gen, dtype=torch.float64) * scale).to(dtype)
    c = (torch.randn(B, m, d, generator=gen, dtype=torch.float64) * scale + 0.3).to(dtype)
    beta = (torch.rand(B, generator=gen, dtype=torch.float64) * 1.5 + 0.3).to(dtype)
    prec = _precision(kind, k, B, d, dtype, gen)
    grad = torch.randn(B, generator=gen, dtype=torch.float64).to(dtype)
    flag = True
    if op == "score":
        t = c[:, 0].contiguous()
        return {"energy_score_fwd": (a, t, beta, prec, kind, flag),
                "energy_score_fwd_grad": (a, t, beta, prec, kind, flag, True, True, True, True),
                # the target's gradient alone: the gradient kernel runs the second cloud's points only
                "energy_score_bwd": (grad, a, t, beta, prec, kind, flag, False, True, True, False)}
    return {"energy_distance_fwd": (a, c, beta, prec, kind, flag),
            "energy_distance_bwd": (grad, a, c, beta, prec, kind, flag, True, True, True, True)}


def _outputs(r):
    return (r,) if isinstance(r, torch.Tensor) else tuple(r)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("kind, k", [(0, 0), (1, 0), (2, 2), (2, 3), (2, 4)])
@pytest.mark.parametrize("case", _SPLIT_CASES, ids=lambda c: f"{c[0]}-{c[2]}+{c[3]}-d{c[4]}")
def test_energy_split_kernels_match_cpu_and_tiled(simt, gen, monkeypatch, dtype, kind, k, case):
    simt_build.configure(seed=gen.initial_seed())
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    for name, args in _split_args(case, dtype, kind, k, gen).items():
        simt.launched()
        got = _outputs(getattr(simt, name)(*args))
        assert all("energy_split_" in kern for kern in simt.launched()), name
        want = _outputs(getattr(torch.ops.etweedie, name)(*args))
        monkeypatch.setenv("ETWEEDIE_CUDA_ENERGY_SPLIT", "0")
        tiled = _outputs(getattr(simt, name)(*args))
        assert not any("energy_split_" in kern for kern in simt.launched()), name
        monkeypatch.delenv("ETWEEDIE_CUDA_ENERGY_SPLIT")
        for i, (u, v, w) in enumerate(zip(got, want, tiled)):
            _close(u, v, f"{name}[{i}] split vs cpu", rtol, rtol)
            _close(w, v, f"{name}[{i}] tiled vs cpu", rtol, rtol)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_energy_split_kernels_coincident_points_and_reproducible(simt, gen, beta):
    """Repeated samples and a sample equal to the target (q = 0 exactly: energy and slope 0, never
    NaN), any thread order giving the same bits (no atomics; shares summed in a fixed order)."""
    B, M, d = 2, 32, 200
    a = torch.randn(B, M, d, generator=gen)
    a[:, 5] = a[:, 3]
    t = a[:, 7].clone()
    b = torch.full((B,), beta)
    prec = _precision(2, 2, B, d, torch.float32, gen)
    args = (a, t, b, prec, 2, True, True, True, True, True)
    runs = []
    for seed in (gen.initial_seed(), gen.initial_seed() + 1):
        simt_build.configure(seed=seed)
        runs.append(simt.energy_score_fwd_grad(*args))
    simt_build.configure()
    want = torch.ops.etweedie.energy_score_fwd_grad(*args)
    for i, (u, v, w) in enumerate(zip(*runs, want)):
        assert torch.equal(u, v), f"output {i} depends on the thread order"
        assert u.isfinite().all()
        _close(u, w, f"output {i}", 1e-4, 1e-4)


@pytest.mark.parametrize("kind, k", [(1, 0), (2, 2), (2, 3)])
def test_energy_ops_far_from_origin(simt, gen, kind, k):
    """Clouds at 1e4 with unit spread: the differences are formed from the raw coordinates, so the
    float32 value and gradients (metric gradient included: its point sum is centred) keep the
    float64 CPU kernel's accuracy."""
    simt_build.configure(seed=gen.initial_seed())
    B, n, m, d = 2, 12, 5, 66
    off = 1e4
    a = torch.randn(B, n, d, generator=gen, dtype=torch.float64) + off
    b = torch.randn(B, m, d, generator=gen, dtype=torch.float64) + off + 0.3
    target = torch.randn(B, d, generator=gen, dtype=torch.float64) + off
    beta = torch.full((B,), 1.4, dtype=torch.float64)
    prec = _precision(kind, k, B, d, torch.float64, gen)
    grad = torch.randn(B, generator=gen, dtype=torch.float64)
    f32 = [t.float() for t in (a, b, target, beta, prec, grad)]
    for name, args, args64 in [
        ("energy_distance_bwd", (f32[5], f32[0], f32[1], f32[3], f32[4], kind, True, True, True, True, True),
         (grad, a, b, beta, prec, kind, True, True, True, True, True)),
        ("energy_score_fwd_grad", (f32[0], f32[2], f32[3], f32[4], kind, True, True, True, True, True),
         (a, target, beta, prec, kind, True, True, True, True, True)),
    ]:
        got, want = getattr(simt, name)(*args), getattr(torch.ops.etweedie, name)(*args64)
        for i, (u, v) in enumerate(zip(got, want)):
            # float32 rounds the inputs at 1e4 (ulp 1e-3 against a unit spread): that, not the
            # kernel, sets the tolerance
            _close(u, v.float(), f"{name}[{i}]", 2e-2, 2e-2)


def test_every_cuda_op_is_covered(simt):
    """A new CUDA binding gets a case here (the emulator registers whatever the bindings do)."""
    covered = {"et_score_fwd", "et_score_bwd", "langevin_step_fwd", "student_t_score_fwd", "student_t_score_bwd",
               "is_score_fwd", "energy_score_fwd", "energy_score_bwd", "energy_score_fwd_grad", "energy_distance_fwd",
               "energy_distance_bwd"}
    assert set(simt_build.load()) == covered
    assert math.isfinite(float(simt.selftest("block_sum")[0]))
