"""The guarantees of the README's "Guarantees" section, one regression test per promise.

Every public op, on every backend available here: NaN/inf in → NaN (or a named error) out;
per-row metric tensors of any stride; float32 right from 1e-30 to 1e30 (or an honest inf);
autodiff orders the compiled backends lack raise instead of returning zeros; parameters that are
not finite are refused; validation also runs under torch.compile and in the Metric constructor;
and every registered ``torch.ops.etweedie.*`` entry checks what it reads.
"""

from __future__ import annotations

import math

import pytest
import torch

import etweedie
from etweedie import Metric
from conftest import BACKEND_DEVICE, BACKEND_IDS, KERNEL_BACKENDS

ALL = [("reference", torch.device("cpu"))] + BACKEND_DEVICE
ALL_IDS = ["reference-cpu"] + BACKEND_IDS
HAS_CPU = "cpu" in KERNEL_BACKENDS
needs_cpu = pytest.mark.skipif(not HAS_CPU, reason="the C++ extension is not built")
NAN = float("nan")


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- NaN / inf in → NaN out


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_non_finite_points_give_nan_energy(backend, device, bad):
    x = torch.randn(4, 8, 2, generator=_g(), device="cpu").to(device)
    y = torch.zeros(4, 2, device=device)
    x[1, 3, 0] = bad  # one bad sample in row 1
    es = etweedie.energy_score(x, y, 1.5, backend=backend)
    assert torch.isnan(es[1]) and torch.isfinite(es[[0, 2, 3]]).all()
    allnan = etweedie.energy_score(torch.full((4, 8, 2), NAN, device=device), y, 1.5, backend=backend)
    assert torch.isnan(allnan).all()
    b = torch.randn(4, 5, 2, generator=_g(1)).to(device)
    ed = etweedie.energy_distance(x, b, 1.5, backend=backend)
    assert torch.isnan(ed[1]) and torch.isfinite(ed[[0, 2, 3]]).all()
    tgt = y.clone()
    tgt[2, 1] = bad
    assert torch.isnan(etweedie.energy_score(x, tgt, 1.0, backend=backend)[2])


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
def test_nan_query_gives_nan_is_score(backend, device):
    bank = torch.randn(50, 2, generator=_g()).to(device)
    y = torch.zeros(3, 2, device=device)
    y[1, 0] = NAN
    s, mean, ess = etweedie.is_score(y, bank, etweedie.GeneralizedGaussian(1.5), backend=backend)
    assert torch.isnan(ess[1]) and torch.isnan(s[1]).all() and torch.isnan(mean[1]).all()
    assert torch.isfinite(ess[[0, 2]]).all()


# ---------------------------------------------------------------------------- per-row metric strides


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
def test_non_contiguous_per_row_metric(backend, device):
    g = _g(3)
    var = (torch.rand(4, 3, generator=g) + 0.5).T.to(device)  # (3, 4), column-major
    S = torch.randn(3, 2, 2, generator=g)
    S = (S @ S.transpose(-1, -2) + torch.eye(2)).transpose(-1, -2).to(device)  # transposed blocks
    x = torch.randn(3, 16, 4, generator=g).to(device)
    y = torch.randn(3, 4, generator=g).to(device)
    noise = torch.randn(3, 4, generator=g).to(device)
    for m, mc in ((Metric.diagonal(var), Metric.diagonal(var.contiguous())),
                  (Metric.block(S), Metric.block(S.contiguous()))):
        pairs = [
            (etweedie.energy_score(x, y, 1.5, metric=m, backend=backend),
             etweedie.energy_score(x, y, 1.5, metric=mc, backend=backend)),
            (etweedie.energy_distance(x, x.flip(1) + 1, 1.5, metric=m, backend=backend),
             etweedie.energy_distance(x, x.flip(1) + 1, 1.5, metric=mc, backend=backend)),
            (etweedie.et_score(y, x, 1.5, metric=m, backend=backend),
             etweedie.et_score(y, x, 1.5, metric=mc, backend=backend)),
            (etweedie.langevin_step(y, x, noise, 0.1, 1.5, metric=m, backend=backend),
             etweedie.langevin_step(y, x, noise, 0.1, 1.5, metric=mc, backend=backend)),
        ]
        for out, ref in pairs:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- float32 range


def _f64(t):
    return t.double()


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
def test_float32_extreme_magnitudes(backend, device):
    # the reproduction: the true score is about (0.3, 0.9)
    x = torch.tensor([[[3e30, 4e30], [0.0, 1e30]]], device=device)
    s = etweedie.et_score(torch.zeros(1, 2, device=device), x, 1.0, backend=backend)
    torch.testing.assert_close(s.cpu().double(), torch.tensor([[0.3, 0.9]], dtype=torch.float64), rtol=1e-5, atol=0)
    g = _g(5)
    for scale in (1e-30, 1e-25, 1e20, 1e30):
        y = (torch.randn(3, 2, generator=g) * scale).to(device)
        xs = (torch.randn(3, 6, 2, generator=g) * scale).to(device)
        for beta in (0.7, 1.0, 1.6):
            ref = etweedie.et_score(_f64(y), _f64(xs), beta, backend="reference")
            out = etweedie.et_score(y, xs, beta, backend=backend)
            torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-4, atol=0, msg=f"et_score {scale} {beta}")
            ref = etweedie.energy_score(_f64(xs), _f64(y), beta, backend="reference")
            out = etweedie.energy_score(xs, y, beta, backend=backend)
            torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-4, atol=0, msg=f"energy_score {scale}")
            ref = etweedie.energy_distance(_f64(xs), _f64(xs.flip(0)), beta, backend="reference")
            out = etweedie.energy_distance(xs, xs.flip(0), beta, backend=backend)
            torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-3, atol=1e-6 * float(ref.abs().max()),
                                       msg=f"energy_distance {scale}")


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("scale", [1e160, 1e-160, 1e300], ids=["1e160", "1e-160", "1e300"])
def test_float64_beyond_its_range(backend, device, scale):
    """float64 data beyond 2^±200 (whitened): the ops homogeneous in the data run on a
    power-of-two rescaling and match the unit-scale call scaled analytically (et_score and its
    gradients ∝ t^{β−1}, the energies ∝ t^β), where squared norms would overflow (NaN rows) or
    go subnormal (digits lost) without it; the others raise a named error."""
    g = _g(21)
    y, x = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(3, 4, generator=g, dtype=torch.float64)
    m = Metric.block(torch.tensor([[1.2, 0.3], [0.3, 0.8]], dtype=torch.float64))
    beta = torch.tensor([0.5, 1.0, 1.3], dtype=torch.float64)
    dev = lambda t: t.to(device)  # noqa: E731
    p = dev(beta.clone().requires_grad_())
    ys = dev(y * scale).requires_grad_()
    s = etweedie.et_score(ys, dev(x * scale), p, 0.8, m, backend=backend)
    gy, gb = torch.autograd.grad((s * dev(noise)).sum(), (ys, p))
    p0, y0 = beta.clone().requires_grad_(), y.clone().requires_grad_()
    s0 = etweedie.et_score(y0, x, p0, 0.8, m, backend="reference")
    gy0, gb0 = torch.autograd.grad((s0 * noise * scale ** (p0 - 1).unsqueeze(-1)).sum(), (y0, p0))
    tight = dict(rtol=1e-12, atol=0)
    torch.testing.assert_close(s.cpu(), s0 * scale ** (beta - 1).unsqueeze(-1), **tight)
    torch.testing.assert_close(gy.cpu(), gy0 / scale, **tight)
    # ∂/∂β of t^{β−1} s₀(β): the unit call's gradient plus ln t · Σ t^{β−1} s₀ · w
    torch.testing.assert_close(gb.cpu(), gb0, rtol=1e-10, atol=0)
    step = etweedie.langevin_step(dev(y * scale), dev(x * scale), dev(noise * scale), 0.1, 1.3, 0.8, m, backend=backend)
    want = (y + 0.1 * etweedie.et_score(y, x, 1.3, 0.8, m, backend="reference") * scale ** -0.7 + 0.2 ** 0.5 * noise) * scale
    torch.testing.assert_close(step.cpu(), want, **tight)
    b = 1.3 if scale > 1e200 else beta  # (at 1e300 and β = 1.3 the energies are ~1e390: inf, honestly)
    bp = torch.as_tensor(b, dtype=torch.float64)
    for name, got, unit in [
        ("energy_score", etweedie.energy_score(dev(x * scale), dev(y * scale), dev(bp), m, backend=backend),
         etweedie.energy_score(x, y, bp, m, backend="reference")),
        ("energy_distance", etweedie.energy_distance(dev(x * scale), dev(x.flip(0) * scale), dev(bp), m, backend=backend),
         etweedie.energy_distance(x, x.flip(0), bp, m, backend="reference")),
    ]:
        want = unit * scale ** bp
        if scale > 1e200:
            assert torch.isinf(got).all() and (got.cpu().sign() == want.sign()).all(), name
            continue
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0, msg=lambda msg: f"{name}: {msg}")
    for f in (lambda: etweedie.student_t_score(dev(y * scale), dev(x * scale), 3.0, backend=backend),
              lambda: etweedie.kernel_score(dev(x * scale), dev(y * scale)),
              lambda: etweedie.is_score(dev(y * scale), dev(x[0] * scale), etweedie.GeneralizedGaussian(1.0), backend=backend)):
        with pytest.raises(ValueError, match=r"float64 data whose largest whitened magnitude lies outside \[2\^-200, 2\^200\]"):
            f()


@needs_cpu
@pytest.mark.parametrize("d", [2, 40], ids=["small-d", "large-d"])
def test_cpu_kernel_flags_rows_out_of_range(d):
    """The CPU score kernels (et_score, langevin_step, student_t_score) check every draw's squared
    norm (q_in_range, csrc/common/et_score.h):
    a float32 q that overflows or underflows, or a NaN, flags its row with NaN in the raw op —
    and only that row; an exact coincidence is not flagged."""
    from etweedie.ops import _range

    if not _range._CPU_RANGE_FLAGS["et_score"]:
        pytest.skip("extension built without the in-kernel range flags")
    g = _g(11)
    B, N = 6, 9  # N not a multiple of 4: the four-draw sweep and the single-draw tail both run
    y = torch.randn(B, d, generator=g)
    x = y.unsqueeze(1) + torch.randn(B, N, d, generator=g)
    x[1, 2] = 1e30  # q overflows
    y[2:4] = 0.0  # (a small offset from a query of order 1 would round away in float32)
    x[2, 8] = 1e-30  # q underflows to 0 for a distinct draw
    x[3, 0] = 1e-19  # q = 1e-38·d: normal, but below 2^-62
    x[4, 5] = NAN
    x[5, 3] = y[5]  # an exact coincidence: in range
    one = torch.ones(B)
    ops = ["et_score", "langevin"] + (["student_t"] if _range._CPU_RANGE_FLAGS["student_t_score"] else [])
    for op in ops:
        if op == "et_score":
            s, m = torch.ops.etweedie.et_score_fwd(y, x, 1.3 * one, one, one[:1].expand(B), 0)
        elif op == "langevin":
            s, m = torch.ops.etweedie.langevin_step_fwd(y, x, torch.zeros_like(y), 0.1 * one, 1.3 * one, one,
                                                        one[:1].expand(B), 0)
        else:
            s, m = torch.ops.etweedie.student_t_score_fwd(y, x, (d + 1.0) * one, one[:1].expand(B), 0)
        flagged = torch.isnan(s).all(1)
        assert flagged.tolist() == [False, True, True, True, True, False], op
        assert torch.isfinite(s[~flagged]).all() and torch.isnan(m[flagged]).all()


@needs_cpu
@pytest.mark.parametrize("d", [2, 40], ids=["small-d", "large-d"])
def test_float32_call_mixing_magnitudes_is_right_on_cpu(d):
    """One call with rows at 1e-25, 1 and 1e25: rows 10^50 apart, beyond the host check's reach,
    right on the CPU kernels' path (the flagged call reruns in float64)."""
    g = _g(12)
    scale = torch.tensor([1e-25, 1.0, 1e25]).repeat_interleave(2).reshape(6, 1)
    y = torch.randn(6, d, generator=g) * scale
    x = y.unsqueeze(1) + torch.randn(6, 7, d, generator=g) * scale.unsqueeze(1)
    for beta in (0.7, 2.0):
        ref = etweedie.et_score(y.double(), x.double(), beta, backend="reference")
        out = etweedie.et_score(y, x, beta, backend="cpu")
        torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-4, atol=0, msg=f"et_score beta {beta}")
        xi = torch.randn(y.shape, generator=g) * scale
        ref = etweedie.langevin_step(y.double(), x.double(), xi.double(), 0.01, beta, backend="reference")
        out = etweedie.langevin_step(y, x, xi, 0.01, beta, backend="cpu")
        torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-4, atol=0, msg=f"langevin beta {beta}")
    ref = etweedie.student_t_score(y.double(), x.double(), d + 1.0, backend="reference")
    out = etweedie.student_t_score(y, x, d + 1.0, backend="cpu")
    torch.testing.assert_close(out.double(), ref.float().double(), rtol=1e-4, atol=0, msg="student_t_score")


@needs_cpu
def test_cpu_score_ops_make_no_host_range_pass(monkeypatch):
    """et_score, langevin_step and student_t_score on the CPU backend leave the range to the
    kernel: no min/max pass over the draws (it cost as much as the kernel); the reference still
    makes it."""
    from etweedie.ops import _range

    if not _range._CPU_RANGE_FLAGS["et_score"]:
        pytest.skip("extension built without the in-kernel range flags")
    y, x = torch.randn(3, 5, generator=_g(13)), torch.randn(3, 4, 5, generator=_g(14))

    def no_pass(t):
        raise AssertionError("a min/max pass over the inputs ran")

    monkeypatch.setattr(_range, "_extremes", no_pass)
    etweedie.et_score(y, x, 1.2, backend="cpu")
    etweedie.langevin_step(y, x, torch.zeros_like(y), 0.1, 1.2, backend="cpu")
    yg = y.clone().requires_grad_()
    etweedie.et_score(yg, x, 1.2, backend="cpu").sum().backward()
    if _range._CPU_RANGE_FLAGS["student_t_score"]:
        etweedie.student_t_score(y, x, 4.0, backend="cpu")
    with pytest.raises(AssertionError, match="min/max pass"):
        etweedie.et_score(y, x, 1.2, backend="reference")


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
def test_float32_is_score_far_query(backend, device):
    law = etweedie.GeneralizedGaussian(1.5)
    g = _g(7)
    bank = torch.randn(50, 2, generator=g) * 1e20
    y = torch.randn(3, 2, generator=g) * 1e20
    s, mean, ess = etweedie.is_score(y.to(device), bank.to(device), law, backend=backend)
    s64, mean64, ess64 = etweedie.is_score(y.double(), bank.double(), law, backend="reference")
    torch.testing.assert_close(s.cpu().double(), s64, rtol=1e-4, atol=0)
    torch.testing.assert_close(ess.cpu().double(), ess64, rtol=1e-4, atol=1e-6)


def test_float32_overflowing_result_is_inf_not_garbage():
    # ‖u‖^β = 1e40 does not fit float32: an honest inf, never a finite wrong value
    x = torch.tensor([[[1e20, 0.0]], [[1e15, 0.0]]])
    out = etweedie.energy_score(x, torch.zeros(2, 2), 2.0, fair=False)
    assert torch.isinf(out[0]) and abs(out[1].item() / 1e30 - 1) < 1e-6


def test_float64_metric_is_inverted_in_float64():
    # a near-singular float64 Σ with float32 data: inverting in float32 would give NaN
    eps = 1e-9
    Sigma = torch.tensor([[1.0, 1.0 - eps], [1.0 - eps, 1.0]], dtype=torch.float64)
    m = Metric.dense(Sigma)
    y = torch.zeros(2, 2)
    x = torch.tensor([[[1.0, 1.0], [0.5, 0.25]]]).expand(2, 2, 2)
    ref = etweedie.et_score(y.double(), x.double(), 2.0, metric=m, backend="reference")
    for backend in ["reference"] + [b for b in KERNEL_BACKENDS if b != "cuda"]:
        s = etweedie.et_score(y, x, 2.0, metric=m, backend=backend)
        torch.testing.assert_close(s.double(), ref, rtol=1e-4, atol=0)


def test_float64_metric_too_singular_for_float32_raises():
    # a precision 1e45 has no float32 value: a named error, not inf reaching the kernels
    m = Metric.diagonal(torch.tensor([1e-45, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="not finite in torch.float32"):
        etweedie.et_score(torch.zeros(1, 2), torch.zeros(1, 3, 2), 1.5, metric=m)


# ---------------------------------------------------------------------------- autodiff orders


def _score_ops():
    """(name, f(y-like input), inputs) for a second derivative / jvp along the first input."""
    g = _g(11)
    y = torch.randn(3, 2, generator=g, dtype=torch.float64)
    x = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    xi = torch.randn(3, 2, generator=g, dtype=torch.float64)
    return {
        "et_score": (lambda b: lambda yy: etweedie.et_score(yy, x, 1.5, backend=b), y),
        "langevin_step": (lambda b: lambda yy: etweedie.langevin_step(yy, x, xi, 0.1, 1.5, backend=b), y),
        "student_t_score": (lambda b: lambda yy: etweedie.student_t_score(yy, x, 3.0, backend=b), y),
        "energy_score": (lambda b: lambda xx: etweedie.energy_score(xx, y, 1.5, backend=b), x),
        "energy_distance": (lambda b: lambda xx: etweedie.energy_distance(xx, x.flip(0) + 0.5, 1.5, backend=b), x),
    }


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score", "energy_score", "energy_distance"])
def test_second_order_raises_on_kernel_backends(backend, device, op):
    make, inp = _score_ops()[op]
    inp = inp.to(device).clone().requires_grad_(True)
    out = make(backend)(inp)
    (g,) = torch.autograd.grad(out.sum() if out.dim() < 2 else (out ** 2).sum(), inp, create_graph=True)
    with pytest.raises(NotImplementedError, match="second-order derivatives are not supported"):
        torch.autograd.grad(g.sum(), inp)
    if op.startswith("energy"):
        return  # the reference (torch.cdist) is first-order only too: torch raises there
    # the reference backend supports it and agrees with finite differences
    make_ref = make("reference")
    inp64 = inp.detach().cpu().double().requires_grad_(True)

    def first(z):
        out = make_ref(z)
        return torch.autograd.grad(out.sum() if out.dim() < 2 else (out ** 2).sum(), z, create_graph=True)[0].sum()

    (h,) = torch.autograd.grad(first(inp64), inp64)
    v = torch.randn(inp64.shape, generator=_g(2), dtype=torch.float64)
    eps = 1e-6
    fd = (first((inp64 + eps * v).detach().requires_grad_(True)) - first((inp64 - eps * v).detach().requires_grad_(True))) / (2 * eps)
    assert abs(float((h * v).sum()) - float(fd)) < 1e-4 * (1 + abs(float(fd)))


@pytest.mark.parametrize("op", ["energy_score", "energy_distance"])
def test_forward_mode_energy_raises(op):
    make, inp = _score_ops()[op]
    for backend in [None] + [b for b in KERNEL_BACKENDS if b != "cuda"]:
        with pytest.raises(NotImplementedError, match="forward-mode autodiff"):
            torch.func.jvp(make(backend), (inp,), (torch.ones_like(inp),))


@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
def test_forward_mode(op):
    make, inp = _score_ops()[op]
    v = torch.randn(inp.shape, generator=_g(4), dtype=torch.float64)
    ref_out, ref_t = torch.func.jvp(make("reference"), (inp,), (v,))
    assert ref_t.abs().sum() > 0
    # automatic backend choice: runs the reference (the kernels cannot carry tangents)
    out, t = torch.func.jvp(make(None), (inp,), (v,))
    torch.testing.assert_close(t, ref_t)
    eps = 1e-6
    fd = (make("reference")(inp + eps * v) - make("reference")(inp - eps * v)) / (2 * eps)
    torch.testing.assert_close(t, fd, rtol=1e-5, atol=1e-7)
    for backend in KERNEL_BACKENDS:
        if backend == "cuda":
            continue
        with pytest.raises(NotImplementedError, match="forward-mode autodiff"):
            torch.func.jvp(make(backend), (inp,), (v,))


@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score", "energy_score", "energy_distance"])
def test_torch_func_transforms(op):
    """torch.func.grad / vjp: the automatic backend choice runs the reference (the compiled ops'
    autograd kernels are not functorch-aware) and agrees with torch.autograd.grad through the
    kernel backends; an explicit kernel backend is a named error, not torch's internal one."""
    make, inp = _score_ops()[op]
    w = torch.randn(make("reference")(inp).shape, generator=_g(5), dtype=torch.float64)

    def loss(backend):
        return lambda z: (make(backend)(z) * w).sum()

    got = torch.func.grad(loss(None))(inp)
    _, vjp = torch.func.vjp(make(None), inp)
    torch.testing.assert_close(vjp(w)[0], got)
    for backend in KERNEL_BACKENDS:
        if backend == "cuda":
            continue
        z = inp.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(loss(backend)(z), z)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        with pytest.raises(NotImplementedError, match="torch.func transforms"):
            torch.func.grad(loss(backend))(inp)


@pytest.mark.parametrize("scale,nan", [(1.0, False), (1e30, False), (1e-30, False), (1.0, True)],
                         ids=["unit", "1e30", "1e-30", "nan-draw"])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_vmap_matches_a_loop(backend, scale, nan):
    """torch.func.vmap over rows: the automatic choice (and the reference) run with no value read
    (a vmapped tensor has none), so a float32 call is computed in float64 and NaN/inf rows are
    masked without a check: right at 1e±30 and with a NaN draw, as a loop of plain calls is."""
    g = _g(11)
    x, y = scale * torch.randn(5, 7, 3, generator=g), scale * torch.randn(5, 3, generator=g)
    if nan:
        x[2, 3, 1] = NAN
    m = Metric.diagonal(torch.rand(3, generator=g) + 0.5)
    ops = {
        "et_score": lambda y, x: etweedie.et_score(y, x, 1.3, 0.8, m, backend=backend),
        "langevin_step": lambda y, x: etweedie.langevin_step(y, x, torch.zeros_like(y), 0.1, 1.3, 0.8, m, backend=backend),
        "student_t_score": lambda y, x: etweedie.student_t_score(y, x, 3.0, m, backend=backend),
        "energy_score": lambda y, x: etweedie.energy_score(x, y, 1.3, m, backend=backend),
        "energy_distance": lambda y, x: etweedie.energy_distance(x, x + scale, 1.3, m, backend=backend),
        "is_score": lambda y, x: etweedie.is_score(y, x[0], etweedie.GeneralizedGaussian(1.3), backend=backend)[0],
    }
    for name, f in ops.items():
        got = torch.func.vmap(lambda a, b: f(a[None], b[None])[0])(y, x)
        want = torch.stack([f(y[i:i + 1].double(), x[i:i + 1].double())[0] for i in range(5)]).float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.nan_to_num().abs().max()),
                                   equal_nan=True, msg=lambda m: f"{name}: {m}")
    if HAS_CPU:
        with pytest.raises(NotImplementedError, match="torch.func transforms"):
            torch.func.vmap(lambda a: etweedie.et_score(a, x[0], 1.3, backend="cpu"))(y)


@pytest.mark.parametrize("d", [8, 80])  # 80: energy_score's plain call (the Gram row kernel)
def test_inference_mode_call_leaves_later_training_calls_working(monkeypatch, d):
    """A call under torch.inference_mode (an evaluation pass) must not leave an inference tensor
    in the ops' caches of β, λ, step and the default metric: every later call that needs a
    gradient would fail with "Inference tensors cannot be saved for backward"."""
    from etweedie.ops import _args

    monkeypatch.setattr(_args, "_CONSTANTS", {})  # the caches start empty, so inference mode fills them
    monkeypatch.setattr(_args, "_CHECKED", {})
    g = _g(3)
    y, x = torch.randn(2, d, generator=g), torch.randn(2, 3, d, generator=g)
    noise = torch.randn(2, d, generator=g)
    calls = {
        "et_score": lambda y, x: etweedie.et_score(y, x, 1.5, 0.7),
        "langevin_step": lambda y, x: etweedie.langevin_step(y, x, noise, 0.1, 1.5, 0.7),
        "student_t_score": lambda y, x: etweedie.student_t_score(y, x, d + 1.5),
        "energy_score": lambda y, x: etweedie.energy_score(x, y, 1.5),
        "energy_distance": lambda y, x: etweedie.energy_distance(x, x.detach() + 1.0, 1.5),
        "kernel_score": lambda y, x: etweedie.kernel_score(x, y, c=1.5),
    }
    with torch.inference_mode():
        for f in calls.values():
            f(y, x)
    for name, f in calls.items():
        xg = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f(y, xg).sum(), xg)
        assert torch.isfinite(grad).all(), name


# ---------------------------------------------------------------------------- parameter checks


def test_non_finite_parameters_refused():
    y, x = torch.zeros(2, 2), torch.ones(2, 3, 2)
    with pytest.raises(ValueError, match="lam must be > 0 and finite"):
        etweedie.et_score(y, x, 1.0, lam=math.inf)
    with pytest.raises(ValueError, match="lam must be > 0 and finite"):
        etweedie.et_score(y, x, 1.0, lam=torch.tensor([1.0, math.inf]))
    with pytest.raises(ValueError, match="step must be > 0 and finite"):
        etweedie.langevin_step(y, x, torch.zeros(2, 2), math.inf, 1.0)
    with pytest.raises(ValueError, match="step must be > 0 and finite"):
        etweedie.langevin_step(y, x, torch.zeros(2, 2), torch.tensor([0.1, math.nan]), 1.0)
    with pytest.raises(ValueError, match="var must be > 0 and finite"):
        Metric.isotropic(math.inf)
    with pytest.raises(ValueError, match="var must be > 0 and finite"):
        Metric.diagonal(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="NaN or infinite entries"):
        Metric.dense(torch.tensor([[NAN, 0.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="c must be > 0 and finite"):
        etweedie.kernel_score(x, y, c=math.inf)


def test_numpy_scalars_are_numbers():
    """numpy's float32 and int64 scalars are accepted wherever a float is (numpy registers them
    as numbers.Real; np.float64 already is a float), and a numpy bool is refused like a bool."""
    np = pytest.importorskip("numpy")
    g = _g(2)
    y, x = torch.randn(2, 3, generator=g), torch.randn(2, 4, 3, generator=g)
    for v in (np.float32(1.5), np.int64(1), np.float64(1.5)):
        torch.testing.assert_close(etweedie.et_score(y, x, v, v), etweedie.et_score(y, x, float(v), float(v)))
        torch.testing.assert_close(etweedie.energy_score(x, y, v), etweedie.energy_score(x, y, float(v)))
        torch.testing.assert_close(Metric.isotropic(v).param, Metric.isotropic(float(v)).param)
    with pytest.raises(TypeError, match="beta must be a float or a tensor, got bool"):
        etweedie.et_score(y, x, np.bool_(True))


def test_debug_mode_checks_langevin_noise():
    y, x = torch.zeros(2, 2), torch.ones(2, 3, 2)
    noise = torch.tensor([[0.0, NAN], [0.0, 0.0]])
    etweedie.set_debug(True)
    try:
        with pytest.raises(ValueError, match="noise contains NaN"):
            etweedie.langevin_step(y, x, noise, 0.1, 1.0)
    finally:
        etweedie.set_debug(False)


def test_metric_constructor_validates():
    with pytest.raises(ValueError, match="Sigma must be symmetric positive definite"):
        Metric("dense", -torch.eye(2))
    with pytest.raises(ValueError, match="var must be > 0"):
        Metric("isotropic", torch.tensor(-1.0))
    with pytest.raises(ValueError, match="S must be a k×k block"):
        Metric("block", torch.eye(6))
    with pytest.raises(ValueError, match="kind must be one of"):
        Metric("sparse", torch.eye(2))


def test_validation_under_torch_compile():
    torch._dynamo.reset()
    y, x = torch.zeros(2, 2), torch.ones(2, 3, 2)

    @torch.compile(backend="eager", fullgraph=True)
    def score(beta):
        return etweedie.et_score(y, x, beta)

    score(torch.tensor(1.5))
    with pytest.raises(RuntimeError, match=r"beta must lie in \(0, 2\]"):
        score(torch.tensor(3.0))

    @torch.compile(backend="eager", fullgraph=True)
    def dense(S):
        return etweedie.et_score(y, x, 1.5, metric=Metric.dense(S))

    dense(torch.eye(2))
    with pytest.raises(RuntimeError, match="Sigma must be finite, symmetric and positive definite"):
        dense(-torch.eye(2))
    torch._dynamo.reset()


def test_dense_metric_gradient_agrees_across_backends():
    g = _g(9)
    A = torch.randn(3, 3, generator=g, dtype=torch.float64)
    Sigma = A @ A.T + torch.eye(3, dtype=torch.float64)
    y = torch.randn(2, 3, generator=g, dtype=torch.float64)
    x = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    grads = {}
    for backend in ["reference"] + [b for b in KERNEL_BACKENDS if b != "cuda"]:
        S = Sigma.clone().requires_grad_(True)
        s = etweedie.et_score(y, x, 1.5, metric=Metric.dense(S), backend=backend)
        (grads[backend],) = torch.autograd.grad((s * torch.arange(6.0, dtype=s.dtype).view(2, 3)).sum(), S)
    for backend, gS in grads.items():
        torch.testing.assert_close(gS, gS.T, msg=f"{backend}: gradient not symmetric")
        torch.testing.assert_close(gS, grads["reference"], rtol=1e-8, atol=1e-10)


def test_two_dimensional_x_is_one_shared_cloud():
    # x (N, d) without a batch axis broadcasts as one cloud for every query (documented)
    g = _g(12)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    x = torch.randn(4, 2, generator=g, dtype=torch.float64)
    shared = etweedie.et_score(y, x, 1.5)
    torch.testing.assert_close(shared, etweedie.et_score(y, x.expand(4, 4, 2), 1.5))
    one_each = etweedie.et_score(y, x.unsqueeze(-2), 1.5)
    assert not torch.allclose(shared, one_each)


def test_dense_metric_keeps_a_shared_cloud_a_broadcast():
    from etweedie.ops._whiten import centred_rows_matmul, dense_centre

    x = torch.randn(1, 5, 3).expand(1000, 5, 3)
    L = torch.eye(3) * 2
    c = dense_centre(x, torch.randn(1000, 1, 3), L)  # a shared cloud's centre: its first point
    assert c.shape == (1, 1, 3) and torch.equal(c[0, 0], x[0, 0])
    z = centred_rows_matmul(x, c, L)
    assert z.stride(0) == 0 and torch.equal(z[7], (x[0] - x[0, 0]) @ L)
    own = torch.randn(1000, 1, 3)  # a cloud of each row's own is centred on the row's point
    assert torch.equal(dense_centre(x.contiguous(), own, L), own)
    g = _g(13)
    A = torch.randn(3, 3, generator=g, dtype=torch.float64)
    m = Metric.dense(A @ A.T + torch.eye(3, dtype=torch.float64))
    y = torch.randn(6, 3, generator=g, dtype=torch.float64)
    cloud = torch.randn(7, 3, generator=g, dtype=torch.float64)
    for backend in ["reference"] + [b for b in KERNEL_BACKENDS if b != "cuda"]:
        torch.testing.assert_close(etweedie.et_score(y, cloud, 1.3, metric=m, backend=backend),
                                   etweedie.et_score(y, cloud.expand(6, 7, 3).contiguous(), 1.3, metric=m,
                                                     backend="reference"))


# ---------------------------------------------------------------------------- raw registered ops


def _canonical(B=4, N=3, d=4, dtype=torch.float32):
    g = _g(21)
    y = torch.randn(B, d, generator=g).to(dtype)
    x = torch.randn(B, N, d, generator=g).to(dtype)
    ones = torch.ones(B, dtype=dtype)
    return y, x, ones, ones.clone()


RAW_CASES = {
    "beta too short": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x, b[:1], l, torch.ones(4), 0),
    "prec wrong shape": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x, b, l, torch.ones(4, 3), 1),
    "unknown kind": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x, b, l, torch.ones(4), 3),
    "block not dividing d": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x, b, l, torch.eye(3).expand(4, 3, 3), 2),
    "diagonal strided": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x, b, l, torch.ones(4, 8)[:, ::2], 1),
    "dtype mismatch": lambda y, x, b, l: torch.ops.etweedie.et_score_fwd(y, x.double(), b, l, torch.ones(4), 0),
    "bwd grad wrong shape": lambda y, x, b, l: torch.ops.etweedie.et_score_bwd(
        torch.ones(4, 5), torch.ones(4, 4), y, x, b, l, torch.ones(4), 0, torch.ones(4, 4), True, True, True, True, True),
    "langevin prec wrong shape": lambda y, x, b, l: torch.ops.etweedie.langevin_step_fwd(
        y, x, torch.zeros_like(y), b, b, l, torch.ones(1, 4), 1),
    "langevin step too short": lambda y, x, b, l: torch.ops.etweedie.langevin_step_fwd(
        y, x, torch.zeros_like(y), b[:1], b, l, torch.ones(4), 0),
    "is_score prec wrong shape": lambda y, x, b, l: torch.ops.etweedie.is_score_fwd(y, x[0], 1.5, 1.0, torch.ones(1, 3), 1),
    "is_score block not dividing d": lambda y, x, b, l: torch.ops.etweedie.is_score_fwd(
        y, x[0], 1.5, 1.0, torch.eye(3).unsqueeze(0), 2),
    "is_score beta out of range": lambda y, x, b, l: torch.ops.etweedie.is_score_fwd(y, x[0], 3.0, 1.0, torch.ones(1), 0),
    "energy_score beta too short": lambda y, x, b, l: torch.ops.etweedie.energy_score_fwd(
        x.expand(64, 3, 4).contiguous()[..., :2].contiguous(), y[:1, :2].expand(64, 2).contiguous(), b[:1], torch.ones(64), 0, True),
    "energy_score unknown kind": lambda y, x, b, l: torch.ops.etweedie.energy_score_fwd(x, y, b, torch.ones(4), 7, True),
    "energy_score prec wrong shape": lambda y, x, b, l: torch.ops.etweedie.energy_score_fwd(x, y, b, torch.ones(4, 2), 1, True),
    "energy_score block not dividing d": lambda y, x, b, l: torch.ops.etweedie.energy_score_fwd(
        x, y, b, torch.eye(3).expand(4, 3, 3), 2, True),
    "energy_score_fwd_grad beta too short": lambda y, x, b, l: torch.ops.etweedie.energy_score_fwd_grad(
        x, y, b[:2], torch.ones(4), 0, True, True, True, False, False),
    "energy_score_bwd grad too short": lambda y, x, b, l: torch.ops.etweedie.energy_score_bwd(
        b[:1], x, y, b, torch.ones(4), 0, True, True, True, False, False),
    "energy_distance prec wrong shape": lambda y, x, b, l: torch.ops.etweedie.energy_distance_fwd(
        x, x, b, torch.ones(4, 3), 1, True),
    "energy_distance bwd grad too short": lambda y, x, b, l: torch.ops.etweedie.energy_distance_bwd(
        b[:1], x, x, b, torch.ones(4), 0, True, True, True, True, True),
}


@needs_cpu
@pytest.mark.parametrize("case", list(RAW_CASES))
def test_raw_ops_check_their_arguments(case):
    with pytest.raises(RuntimeError):
        RAW_CASES[case](*_canonical())


@needs_cpu
def test_raw_op_large_batch_short_beta_does_not_crash():
    # the reproduction (a length-1 beta with B = 4,000,000 segfaulted); in a subprocess
    # so that a regression kills a child, not the test run
    import subprocess
    import sys

    code = (
        "import torch, etweedie\n"
        "B = 4_000_000\n"
        "x = torch.zeros(1, 2, 2).expand(B, 2, 2); y = torch.zeros(1, 2).expand(B, 2).contiguous()\n"
        "try:\n"
        "    torch.ops.etweedie.energy_score_fwd(x, y, torch.ones(1), torch.ones(1).expand(B), 0, True)\n"
        "except RuntimeError as e:\n"
        "    print('raised', 'beta must have shape (B,)' in str(e))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"child died with {res.returncode}: {res.stderr[-500:]}"
    assert "raised True" in res.stdout, res.stdout + res.stderr[-500:]


def _near_pair_truth(op, y, x, near, beta, lam, m):
    """The op with the near draws' terms computed on residuals scaled by an exact power of two t
    (y and the draw both scaled: their difference is then of order 1) and scaled back by the term's
    homogeneity t^{1−β}; the other draws by the plain reference.  Differentiable in y and beta."""
    N = x.shape[-2]
    parts = []
    for i in range(N):
        xi = x[:, i : i + 1]
        t = 2.0 ** near[i]
        if op == "student_t_score":
            parts.append(etweedie.student_t_score(y, xi, lam + 2.5, m, backend="reference"))
        elif near[i]:
            parts.append(etweedie.et_score(y * t, xi * t, beta, lam, m, backend="reference") * t ** (1 - beta).unsqueeze(-1))
        else:
            parts.append(etweedie.et_score(y, xi, beta, lam, m, backend="reference"))
    return torch.stack(parts).mean(0)


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype,delta", [(torch.float64, 1e-170), (torch.float64, 1e-100), (torch.float32, 1e-30)],
                         ids=["f64-1e-170", "f64-1e-100", "f32-1e-30"])
@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
def test_a_draw_very_near_the_query_keeps_its_exact_term(backend, device, dtype, delta, op):
    """A distinct draw closer to y than the squared norm can resolve (q underflows, or its
    backward slope overflows: |y − x_i| ≲ 1e-150 in float64, 5e-10 in float32) still contributes
    its exact term ‖u‖^{β−2}_P P u — of size δ^{β−1}, 1e85 at β = 0.5 — with finite gradients,
    instead of a weight of 0, NaN gradients or a NaN row.  GPU kernels may flag such a row NaN
    (no rerun without a device sync); never a finite wrong value."""
    g = _g(31)
    B, N, d = 3, 4, 4
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    y[:, 0] = 0.0
    x = y.unsqueeze(1) + torch.randn(B, N, d, generator=g, dtype=torch.float64)
    x[:, 1] = y  # the near draw: y with its first coordinate moved by delta
    x[:, 1, 0] = delta * torch.tensor([1.0, -0.75, 0.5], dtype=torch.float64)
    x[2, 3] = y[2]  # and an exact coincidence (weight 0)
    near = [0, round(-math.log2(delta)), 0, 0]
    beta = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)
    lam = torch.tensor([0.8, 1.2, 3.0], dtype=torch.float64)
    m = Metric.block(torch.tensor([[1.2, 0.3], [0.3, 0.8]], dtype=torch.float64))
    noise = torch.randn(B, d, generator=g, dtype=torch.float64)
    w = torch.randn(B, d, generator=g, dtype=torch.float64)

    def call(y_, beta_, dt, dev, be):
        c = lambda t: t.to(dev, dt)  # noqa: E731
        mm = Metric.block(c(m.param))
        if op == "et_score":
            return etweedie.et_score(y_, c(x), beta_, c(lam), mm, backend=be)
        if op == "langevin_step":
            return etweedie.langevin_step(y_, c(x), c(noise), 0.01, beta_, c(lam), mm, backend=be)
        return etweedie.student_t_score(y_, c(x), c(lam + 2.5), mm, backend=be)

    y0, b0 = y.clone().requires_grad_(), beta.clone().requires_grad_()
    want = _near_pair_truth(op, y0, x, near, b0, lam, m)
    if op == "langevin_step":
        want = y0 + 0.01 * want + 0.02 ** 0.5 * noise
    want_g = torch.autograd.grad((want * w).sum(), (y0, b0) if op != "student_t_score" else (y0,), allow_unused=True)
    assert torch.isfinite(want).all() and all(torch.isfinite(t).all() for t in want_g)

    yd = y.to(device, dtype).requires_grad_()
    bd = beta.to(device, dtype).requires_grad_()
    got = call(yd, bd, dtype, device, backend)
    ins = (yd, bd) if op != "student_t_score" else (yd,)
    got_g = torch.autograd.grad((got * w.to(device, dtype)).sum(), ins, allow_unused=True)
    tol = dict(rtol=1e-10, atol=0) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    flagged = torch.isnan(got.detach().cpu()).all(-1)
    if device.type != "cpu":  # a GPU kernel may return the near rows NaN, never wrong
        rows = ~flagged
        torch.testing.assert_close(got.detach().cpu()[rows], want.detach().to(dtype)[rows], **tol)
        return
    assert not flagged.any(), got
    torch.testing.assert_close(got.detach().cpu(), want.detach().to(dtype), **tol)
    for a, b in zip(got_g, want_g):  # (cancellations of terms of size δ^{β−2}: an absolute error to that scale)
        scale = float(b.abs().max())
        torch.testing.assert_close(a.cpu(), b.to(dtype), rtol=tol["rtol"], atol=tol["rtol"] * scale)


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype,delta", [(torch.float64, 1e-310), (torch.float32, 1e-40)], ids=["f64-subnormal", "f32-subnormal"])
def test_a_subnormal_residual_keeps_its_unit_term(backend, device, dtype, delta):
    """β = 1: each draw contributes its unit vector u/‖u‖ however close it is — a subnormal
    residual too (its power-of-two scaling is applied in two halves: 2^{−e} alone overflows)."""
    y = torch.zeros(1, 2, dtype=dtype, device=device, requires_grad=True)
    x = torch.tensor([[[delta, 0.0], [1.0, 1.0]]], dtype=dtype, device=device)
    s = etweedie.et_score(y, x, 1.0, 0.8, backend=backend)
    if device.type != "cpu" and torch.isnan(s).all():
        return  # a GPU kernel flags the row (no rerun without a device sync)
    want = 0.8 * (torch.tensor([1.0, 0.0]) + torch.tensor([1.0, 1.0]) / 2**0.5) / 2
    torch.testing.assert_close(s.detach().cpu()[0], want.to(dtype), rtol=1e-6, atol=0)
    g, = torch.autograd.grad(s[0, 0], y)  # (∂s₁/∂y₁ ∝ 1/δ overflows honestly; along u the term's is 0)
    assert torch.isfinite(g).all(), g


# (dtype, data scale, β, near): far draws whose backward slope q^{(β−4)/2} (or the Student-t
# law's −2(1 + q)^{-2}) would be subnormal — q ≈ 2^73 to 2^93 in float32 (1e11: inside the
# range of 2^±40 per coordinate that backends without in-kernel range checks scan), 2^666 in float64 (data beyond 2^200, scaled by a power of two)
# — and a draw just above the old float32 lower bound with β = 0.001, where the slope
# (2 − β)·2^{128 − 32β} overflowed float32
_SLOPE_RANGE_CASES = {
    "f32-1e11-beta0.3": (torch.float32, 1e11, 0.3, False),
    "f32-1e12-beta0.3": (torch.float32, 1e12, 0.3, False),
    "f32-1e14-beta1": (torch.float32, 1e14, 1.0, False),
    "f64-1e100-beta0.3": (torch.float64, 1e100, 0.3, False),
    "f32-q2^-63.9-beta0.001": (torch.float32, 1.0, 0.001, True),
}


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("case", list(_SLOPE_RANGE_CASES))
@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
def test_gradients_stay_right_where_the_backward_slope_leaves_its_range(backend, device, case, op):
    """The forward of a draw far from y (or, at small β, very near it) was right while the
    backward's slope, of size q^{(β−4)/2}, went subnormal (gradients 5–700% off) or overflowed
    (inf/NaN gradients): every backend's q range now keeps the slope a normal number, a CPU call
    outside it runs in float64 (or scaled), and a GPU kernel may return the row NaN — never a
    finite wrong gradient."""
    dtype, scale, beta, near = _SLOPE_RANGE_CASES[case]
    if near and op == "student_t_score":
        pytest.skip("1/(1 + q) has no slope singularity at q = 0")
    g = _g(41)
    B, N, d = 2, 4, 3
    if near:
        y64 = torch.zeros(B, d, dtype=torch.float64)
        x64 = torch.rand(B, N, d, generator=g, dtype=torch.float64) + 0.5
        x64[:, 0] = 0.0
        x64[:, 0, 0] = 2.0 ** (-63.9 / 2)  # q = 2^-63.9
    else:
        y64 = torch.randn(B, d, generator=g, dtype=torch.float64) * scale
        x64 = torch.randn(B, N, d, generator=g, dtype=torch.float64) * scale
    w = torch.randn(B, d, generator=g, dtype=torch.float64)
    noise = torch.randn(B, d, generator=g, dtype=torch.float64)

    def call(y, x, be):
        if op == "et_score":
            return etweedie.et_score(y, x, beta, 0.7, backend=be)
        if op == "langevin_step":
            return etweedie.langevin_step(y, x, noise.to(y), 0.01, beta, 0.7, backend=be)
        return etweedie.student_t_score(y, x, 4.0, backend=be)

    def value_and_grads(y, x, be):
        y, x = y.clone().requires_grad_(), x.clone().requires_grad_()
        out = call(y, x, be)
        return (out.detach(),) + torch.autograd.grad((out * w.to(out)).sum(), (y, x))

    if op == "student_t_score" and scale > 2.0**200:  # not homogeneous: refused, not rescaled
        with pytest.raises(ValueError, match="outside the op's range"):
            value_and_grads(y64.to(device, dtype), x64.to(device, dtype), backend)
        return
    # the float64 reference on the same (rounded) values
    want = value_and_grads(y64.to(dtype).double(), x64.to(dtype).double(), "reference")
    got = [t.cpu().double() for t in value_and_grads(y64.to(device, dtype), x64.to(device, dtype), backend)]
    flagged = torch.isnan(got[0]).all(-1)
    if device.type != "cpu":  # a GPU kernel may return such a row NaN (no rerun without a sync), never wrong
        assert not (torch.isnan(got[0]) & ~flagged.unsqueeze(-1)).any()
        keep = ~flagged
        got, want = [t[keep] for t in got], [t[keep] for t in want]
    else:
        assert not flagged.any(), got[0]
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    # the kernel backends compute such rows in float64 (or scaled): within rtol of the float64
    # reference; the float32 reference's own plain formula is the accuracy criterion's baseline
    # (its slope is subnormal at 1e11), so it is held to nothing tighter than itself
    for name, a, b in zip(("value", "grad y", "grad x"), got, want):
        assert torch.isfinite(a).all(), (name, a)
        err = float((a - b).abs().max() / b.abs().max())
        assert err < rtol or (backend == "reference" and dtype == torch.float32), (name, err, a, b)


def _dense_sigma(d, g, dtype):
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    return (A @ A.T / d + 0.5 * torch.eye(d, dtype=torch.float64)).to(dtype)


def _pair_energies(a, b, beta, P):
    """‖a_i − b_j‖_P^β from the direct differences, float64, (B, n, m); 0 with a zero gradient at
    a coincidence (the ops' convention)."""
    u = a.unsqueeze(2) - b.unsqueeze(1)
    q = torch.einsum("bijk,kl,bijl->bij", u, P, u)
    pos = q > 0
    return torch.where(pos, torch.where(pos, q, 1.0) ** (beta / 2), 0.0)


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["own", "shared"])
@pytest.mark.parametrize("op", ["energy_score", "energy_distance"])
def test_equal_points_under_a_dense_metric_are_exact_coincidences(backend, device, dtype, layout, op):
    """A dense metric whitens the points with a matrix product, which may round two equal rows
    differently (MKL: by the tile a row falls into, 1e-7 apart in float32): equal draws, a draw
    equal to the target, and a point shared by both clouds must still meet as exact coincidences
    (0 and a zero gradient), not as a spurious distance whose gradient at β = 0.5 is 10⁴–10⁸× the
    true one.  Truth: the float64 pair sums on the direct differences."""
    g = _g(17)
    d, beta = 17, 0.5
    S = _dense_sigma(d, g, torch.float64)
    P = torch.linalg.inv(S)
    if op == "energy_score":
        B, M = (1, 5) if layout == "own" else (3, 5)
        x = torch.randn(1 if layout == "shared" else B, M, d, generator=g, dtype=torch.float64)
        x[:, 1] = x[:, 0]
        x[:, 4] = x[:, 2]
        y = torch.randn(B, d, generator=g, dtype=torch.float64)
        y[-1] = x[0, 3]  # a target on a draw (of the shared cloud: its own centre is another point)
        x, y = x.to(dtype), y.to(dtype)
        xs = x.expand(B, M, d)

        def truth(xv, yv):
            cross = _pair_energies(xv, yv.unsqueeze(1), beta, P).sum((1, 2)) / M
            within = _pair_energies(xv, xv, beta, P).sum((1, 2)) / (M * (M - 1))
            return cross - within / 2

        args = (x, y)
        call = lambda xv, yv, be: etweedie.energy_score(xv, yv, beta, Metric.dense(S.to(xv.dtype)).to(device), backend=be)  # noqa: E731
        want_in = (xs.double(), y.double())
    else:
        B, n, m = 2, 4, 5
        a = torch.randn(1 if layout == "shared" else B, n, d, generator=g, dtype=torch.float64)
        b = torch.randn(B, m, d, generator=g, dtype=torch.float64)
        a[:, 2] = a[:, 1]
        b[:, 3] = a[0, 3]  # a point in both clouds
        b[:, 4] = b[:, 0]
        a, b = a.to(dtype), b.to(dtype)

        def truth(av, bv):
            cross = _pair_energies(av, bv, beta, P).mean((1, 2))
            wa = _pair_energies(av, av, beta, P).sum((1, 2)) / (n * (n - 1))
            wb = _pair_energies(bv, bv, beta, P).sum((1, 2)) / (m * (m - 1))
            return 2 * cross - wa - wb

        args = (a, b)
        call = lambda av, bv, be: etweedie.energy_distance(av, bv, beta, Metric.dense(S.to(av.dtype)).to(device), backend=be)  # noqa: E731
        want_in = (a.expand(B, n, d).double(), b.double())
    first = want_in[0].clone().requires_grad_()
    want = truth(first, want_in[1])
    want_g, = torch.autograd.grad(want.sum(), first)
    inp = args[0].to(device).requires_grad_()
    got = call(inp, args[1].to(device), backend)
    got_g, = torch.autograd.grad(got.sum(), inp)
    if layout == "shared":
        want_g = want_g.sum(0, keepdim=True)  # the shared cloud's gradient: the sum over its rows
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got.detach().cpu().double(), want.detach(), rtol=rtol, atol=rtol)
    err = float((got_g.cpu().double() - want_g).abs().max() / want_g.abs().max())
    assert err < rtol * 10, (err, got_g, want_g)


@needs_cpu
@pytest.mark.parametrize("layout", ["own", "shared"])
@pytest.mark.parametrize("op", ["energy_score", "energy_distance"])
def test_equal_points_tie_without_value_reads(monkeypatch, op, layout):
    """The ties' select form, which a GPU, torch.compile and vmap take (no value is read to skip
    it), ties the same rows as the eager CPU path."""
    from etweedie.ops import _ties

    monkeypatch.setattr(_ties, "_values_read", lambda t: False)
    test_equal_points_under_a_dense_metric_are_exact_coincidences("cpu", torch.device("cpu"), torch.float32, layout, op)


@pytest.mark.parametrize("backend,device", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("dtype,d,Q", [(torch.float32, 6, 1), (torch.float64, 64, 4), (torch.float32, 5, 2),
                                       (torch.float64, 17, 2)])
def test_a_query_on_a_bank_point_under_a_dense_metric(backend, device, dtype, d, Q):
    """is_score with a dense metric and a query equal to a bank point (a point the bank holds
    twice, too): every copy is an exact coincidence (weight term 0), not a spurious distance
    whose ‖u‖^{β−2}u term at β = 0.3 made the score 10⁸× too large."""
    g = _g(3)
    bank = torch.randn(40, d, generator=g, dtype=torch.float64)
    bank[37] = bank[0]
    bank[38] = bank[0]
    bank[39] = bank[Q - 1]
    y = bank[:Q].clone() if Q > 1 else bank[:1].clone()
    y[Q - 1] += 0.0
    S = _dense_sigma(d, g, torch.float64)
    law = lambda dt: etweedie.GeneralizedGaussian(0.3, 1.0, Metric.dense(S.to(dt)).to(device))  # noqa: E731
    s, mean, ess = etweedie.is_score(y.to(device, dtype), bank.to(device, dtype), law(dtype), backend=backend)
    r, rmean, ress = etweedie.is_score(y.to(dtype).double(), bank.to(dtype).double(), law(torch.float64), backend="reference")
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(s.cpu().double(), r, rtol=rtol, atol=rtol * float(r.abs().max()))
    torch.testing.assert_close(ess.cpu().double(), ress, rtol=rtol, atol=0)


@needs_cpu
def test_a_nan_input_is_masked_without_the_exact_recomputation(monkeypatch):
    """A row flagged only because its input holds a NaN comes back NaN after one cheap pass: the
    exact near-draw recomputation (the reference over all B×N×d residuals) runs only for a
    flagged row whose inputs are finite."""
    from etweedie.ops import reference

    def refuse(*args, **kwargs):
        raise AssertionError("the exact recomputation ran for a NaN input")

    g = _g(5)
    for dtype in (torch.float64, torch.float32):
        y = torch.randn(4, 3, generator=g).to(dtype)
        x = torch.randn(4, 6, 3, generator=g).to(dtype)
        x[2, 1, 0] = NAN
        with monkeypatch.context() as m:
            m.setattr(reference, "et_score", refuse)
            m.setattr(reference, "langevin_step", refuse)
            s = etweedie.et_score(y, x, 1.3, backend="cpu")
            step = etweedie.langevin_step(y, x, torch.zeros_like(y), 0.1, 1.3, backend="cpu")
        for out in (s, step):
            assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()


@needs_cpu
@pytest.mark.parametrize("shared", [False, True], ids=["own-draws", "shared-cloud"])
@pytest.mark.parametrize("metric", [None, "dense"])
@pytest.mark.parametrize("op", ["et_score", "langevin_step"])
def test_the_exact_near_draw_recomputation_runs_on_the_flagged_rows_only(monkeypatch, op, metric, shared):
    """A float64 call with a draw nearer to y than the kernel's range in one row of five reruns
    that row alone on the reference's exact form (its residuals: 1×N×d, not B×N×d); the kernel's
    rows and the recomputed row together give the whole-call exact reference, in value and in the
    gradients of y, x, beta and lam, fresh inputs each run — under a dense metric (whitened
    before the rows are taken) and for one cloud shared by every row too."""
    from etweedie.ops import reference

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, N, d = 5, 7, 6
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    x = y.unsqueeze(1) + torch.randn(B, N, d, generator=g, dtype=torch.float64)
    y[3, 0] = 0.0
    x[3, 2] = y[3]
    x[3, 2, 0] = 1e-170  # row 3's draw 2: q = 1e-340 underflows
    if shared:
        x = x[3]  # (N, d): every row's cloud; only row 3 has a draw that near
    if metric == "dense":
        a = torch.randn(d, d, generator=g, dtype=torch.float64)
        metric = Metric.dense(a @ a.T + d * torch.eye(d, dtype=torch.float64))
    beta = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    lam = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    noise = torch.randn(B, d, generator=g, dtype=torch.float64)
    w = torch.randn(B, d, generator=g, dtype=torch.float64)
    seen = []
    plain = getattr(reference, op)

    def spy(*args, **kwargs):
        seen.append(args[1].shape[0])
        return plain(*args, **kwargs)

    def call(be, *ins):
        yy, xx, bb, ll = ins
        if op == "et_score":
            return etweedie.et_score(yy, xx, bb, ll, metric, backend=be)
        return etweedie.langevin_step(yy, xx, noise, 0.01, bb, ll, metric, backend=be)

    ins = [t.clone().requires_grad_() for t in (y, x, beta, lam)]
    with monkeypatch.context() as m:
        m.setattr(reference, op, spy)
        got = call("cpu", *ins)
    assert seen == [1], seen
    got_g = torch.autograd.grad((got * w).sum(), ins)
    ref_ins = [t.clone().requires_grad_() for t in (y, x, beta, lam)]
    want = call("reference", *ref_ins)
    want_g = torch.autograd.grad((want * w).sum(), ref_ins)
    assert torch.isfinite(want).all() and all(torch.isfinite(t).all() for t in want_g)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * float(b.abs().max()))


@needs_cpu
@pytest.mark.parametrize("reads_values", [True, False], ids=["values-read", "no-value-reads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["et_score", "langevin_step"])
def test_a_shared_cloud_under_a_dense_metric_keeps_a_near_draws_term(no_value_reads, op, dtype, reads_values):
    """A cloud shared by every row is whitened once, about its first draw; a draw much nearer to
    a query than the rounding of those coordinates (1e-5 and 1e-12 at unit spread) had its term
    u‖u‖^{β−2} from rounding noise — up to 20% of the score off at β = 1.  Such rows are
    recomputed about their own query (where no values are read, as on a GPU without debug checks,
    every row is); against the float64 reference on the same inputs, β at 1 and 0.6."""
    if not reads_values:
        no_value_reads()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, N, d = 6, 9, 5
    y = torch.randn(B, d, generator=g, dtype=torch.float64).to(dtype)
    x = torch.randn(N, d, generator=g, dtype=torch.float64).to(dtype)
    for row, draw, delta in ((1, 2, 1e-5), (4, 7, 1e-12)):
        y[row] = x[draw]
        y[row, 0] = 0.0
        x[draw, 0] = delta  # exact in both dtypes: the pair is delta apart
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    metric = Metric.dense((a @ a.T + d * torch.eye(d, dtype=torch.float64)).to(dtype))
    beta = torch.tensor([1.0, 0.6, 1.0, 1.0, 0.6, 1.0], dtype=dtype)
    noise = torch.randn(B, d, generator=g, dtype=torch.float64).to(dtype)

    def call(yy, xx, m, be):
        if op == "et_score":
            return etweedie.et_score(yy, xx, beta.to(yy.dtype), 1.3, m, backend=be)
        return etweedie.langevin_step(yy, xx, noise.to(yy.dtype), 0.01, beta.to(yy.dtype), 1.3, m, backend=be)

    want = call(y.double(), x.double(), Metric.dense(metric.param.double()), "reference")
    got = call(y, x, metric, "cpu")
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    rows = torch.ones(B, dtype=torch.bool)
    if not reads_values:  # no rerun without reading values: a pair below the kernel's range is a NaN row
        rows = ~torch.isnan(got).all(-1)
        assert rows.tolist() == [True] * 4 + [dtype == torch.float64, True], rows  # float32: q = 1e-24 < 2^-64
    torch.testing.assert_close(got.double()[rows], want[rows], rtol=tol, atol=tol * float(want.abs().max()))


@needs_cpu
def test_student_t_kernel_does_not_flag_near_draws_in_float64():
    """1/(1 + q) is exact for any q ≥ 0: a float64 draw 1e-100 from y is not flagged."""
    y = torch.zeros(1, 2, dtype=torch.float64)
    x = torch.tensor([[[1e-100, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    s, _ = torch.ops.etweedie.student_t_score_fwd(y, x, 3.0 * one, one, 0)
    assert torch.isfinite(s).all(), s
