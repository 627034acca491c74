"""energy_score: every backend and every gradient against the float64 reference.

Covers isotropic/diagonal/block/dense metrics (per row), β ∈ {1, 2, 1.4, 0.5} and near 0,
fair and biased pair terms, coincident points (sample = sample, sample = target), clouds
1e3 away from the origin, broadcast and non-contiguous inputs, zero-size batches, float64
gradcheck, torch.library.opcheck, torch.compile(fullgraph=True), bad input, and propriety
(the true law minimizes the expected score).
"""

import pytest
import torch

import etweedie
from conftest import BACKEND_DEVICE, BACKEND_IDS, assert_close_to_ref, gen, metric_to, random_metric

KINDS = ["none", "isotropic", "diagonal", "block2", "block3", "dense"]


def _inputs(seed, B, M, d, kind, beta=None, offset=0.0):
    g = gen(seed)
    target = torch.randn(B, d, generator=g, dtype=torch.float64) + offset
    samples = target.unsqueeze(1) + 0.3 + torch.randn(B, M, d, generator=g, dtype=torch.float64)
    # exactly representable in float32, so ref64 is the truth for the float32 run's inputs too
    target, samples = target.float().double(), samples.float().double()
    if beta is None:
        beta = 0.6 + 1.4 * torch.rand(B, generator=g, dtype=torch.float64)
    else:
        beta = torch.full((B,), float(beta), dtype=torch.float64)
    return samples, target, beta, random_metric(kind, B, d, g)


def _run(backend, device, dtype, samples, target, beta, metric, fair=True):
    """Score and gradients wrt samples, target, β and the metric parameter."""
    leaves = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in (samples, target, beta)]
    m, p = metric_to(metric, dtype, device, requires_grad=True)
    out = etweedie.energy_score(*leaves, metric=m, fair=fair, backend=backend)
    up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype, device=device).reshape(out.shape)
    inputs = leaves + ([p] if p is not None else [])
    grads = list(torch.autograd.grad((out * up).sum(), inputs))
    if m is not None and m.kind == "dense":
        grads[-1] = (grads[-1] + grads[-1].transpose(-1, -2)) / 2  # only the symmetric part is defined
    return out, grads


def _check_all(backend, device, args, seed, label, fair=True):
    out, gout = _run(backend, device, torch.float32, *args, fair=fair)
    r32, g32 = _run("reference", "cpu", torch.float32, *args, fair=fair)
    r64, g64 = _run("reference", "cpu", torch.float64, *args, fair=fair)
    assert_close_to_ref(out, r32, r64, name=f"ES[{label}]", seed=seed)
    for name, a, b, c in zip(["samples", "target", "beta", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}[{label}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape", [(5, 9, 6), (3, 13, 42), (3, 70, 6), (12, 7, 6), (12, 7, 42)],
    ids=["small", "large-d", "tiles", "many-rows", "many-rows-large-d"],  # many rows: the per-row backward
)
def test_matches_float64_reference(backend, device, kind, shape, seed):
    _check_all(backend, device, _inputs(seed, *shape, kind), seed, kind)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("shape", [(4, 7, 3), (2, 9, 24)], ids=["small-d", "large-d"])
def test_biased_pair_term(backend, device, shape, seed):
    _check_all(backend, device, _inputs(seed, *shape, "diagonal"), seed, "fair=False", fair=False)
    # M = 1 is allowed with the biased term: the score is then the plain distance
    x, y, b, _ = _inputs(seed, 3, 1, shape[2], "none")
    es = etweedie.energy_score(x.float().to(device), y.float().to(device), b.float().to(device), fair=False, backend=backend)
    torch.testing.assert_close(es.cpu(), (x[:, 0] - y).norm(dim=-1).pow(b).float())


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("beta", [1.0, 2.0, 1.4, 0.5, 0.02])
def test_beta_values(backend, device, beta, seed):
    _check_all(backend, device, _inputs(seed, 4, 11, 6, "block3", beta=beta), seed, f"beta={beta}")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("beta", [0.5, 1.0, 1.4, 2.0])
@pytest.mark.parametrize("d", [3, 20])
def test_coincident_points_no_nan(backend, device, beta, d, seed):
    x, y, b, metric = _inputs(seed, 4, 6, d, "diagonal", beta=beta)
    x[:, 1] = x[:, 0]  # two coincident samples
    x[:, 2] = y  # a sample on the target
    _check_all(backend, device, (x, y, b, metric), seed, f"coincident beta={beta}")
    # every sample on the target: the score and all its gradients are exactly 0
    xs = y.float().to(device).unsqueeze(1).expand(4, 5, d).contiguous().requires_grad_()
    es = etweedie.energy_score(xs, y.float().to(device), beta, backend=backend)
    (gx,) = torch.autograd.grad(es.sum(), xs)
    assert torch.equal(es, torch.zeros_like(es)) and torch.equal(gx, torch.zeros_like(gx))


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("d", [2, 30])
def test_far_from_origin(backend, device, d, seed):
    """Direct differences: clouds 1e3 from the origin lose no precision."""
    for B in (3, 12):  # per-point and per-row backward
        _check_all(backend, device, _inputs(seed, B, 17, d, "isotropic", offset=1e3), seed, "offset 1e3")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["diagonal", "block2", "dense"])
def test_metric_far_from_origin(backend, device, kind, seed):
    """Draws and target 1e3 from the origin under a diagonal, block or dense metric, value and
    every gradient (a dense metric is whitened on the host as z = (x − c)·L, c the target)."""
    for B in (3, 12):  # per-point and per-row backward
        _check_all(backend, device, _inputs(seed, B, 17, 40, kind, offset=1e3), seed, f"{kind} offset 1e3")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 2, 3, 16])
@pytest.mark.parametrize("fair", [True, False], ids=["fair", "biased"])
@pytest.mark.parametrize("M", [2, 3, 23, 24])
def test_cpu_row_kernel(kind, d, fair, M, seed):
    """The CPU row kernel (small d, many rows, gradients for the draws and the target only:
    csrc/cpu/energy_rows_cpu.h): value and both gradients against the float64
    reference, 1e3 from the origin, coincident draws and a draw on the target, per-row β; the
    forward-only op and the separate backward op agree with the fused value-and-gradient op.
    Odd and even M: the within pairs run by offset, and an even M's last offset, M/2, holds
    M/2 pairs, not M (M = 2: that one pair alone)."""
    if kind.startswith("block") and d % int(kind[-1]):
        pytest.skip(f"{kind} needs d divisible by its block size")
    B = 16  # B ≥ 2 × threads for any thread count up to 8
    samples, target, bt, metric = _inputs(seed, B, M, d, kind, offset=1e3)
    samples[:, min(4, M - 1)] = samples[:, M // 2 - 1]
    samples[:, min(6, M - 1) if M > 2 else 0] = target

    def run(backend, dtype):
        s = samples.to(dtype).requires_grad_()
        t = target.to(dtype).requires_grad_()
        m, _ = metric_to(metric, dtype, "cpu", requires_grad=False)
        out = etweedie.energy_score(s, t, bt.to(dtype), metric=m, fair=fair, backend=backend)
        up = torch.linspace(0.5, 1.5, B, dtype=dtype)
        return [out, *torch.autograd.grad((out * up).sum(), (s, t))]

    got, r32, r64 = run("cpu", torch.float32), run("reference", torch.float32), run("reference", torch.float64)
    for name, x, y, z in zip(["ES", "grad samples", "grad target"], got, r32, r64):
        assert_close_to_ref(x, y, z, name=f"{name} [rows {kind} d={d}]", seed=seed, atol_scale=3e-5)
    # the forward-only op and the backward op (used outside the fused training path)
    if kind in ("none", "dense"):
        return
    prec, k = etweedie.ops._args.metric_param(metric_to(metric, torch.float32, "cpu", requires_grad=False)[0],
                                              torch.Size([B]), d)
    x32, y32, b32 = samples.float(), target.float(), bt.float()
    fwd = torch.ops.etweedie.energy_score_fwd(x32, y32, b32, prec, k, fair)
    torch.testing.assert_close(fwd, got[0].detach(), rtol=1e-5, atol=1e-5)
    up = torch.linspace(0.5, 1.5, B)
    gs, gt, _, _ = torch.ops.etweedie.energy_score_bwd(up, x32, y32, b32, prec, k, fair, True, True, False, False)
    torch.testing.assert_close(gs, got[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gt, got[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["none", "diagonal", "block2"])
@pytest.mark.parametrize("beta", [1.0, 2.0, 0.7, None], ids=["b1", "b2", "b0.7", "per-row"])
@pytest.mark.parametrize("d", [72, 69])
def test_cpu_gram_path(kind, beta, d, seed):
    """Many draws in large d take the CPU forward's Gram form (float32, d ≥ 64, ≥ 32 draws:
    csrc/cpu/energy_gram_cpu.h): 1e3 from the origin, coincident draws, a draw on the target; an
    odd d (the dot kernel's last coordinate outside its coordinate pairs)."""
    if kind == "block2" and d % 2:
        kind = "block3"  # 69 = 3 · 23: a 3×3 block where a 2×2 one does not fit
    samples, target, bt, metric = _inputs(seed, 2, 37, d, kind, beta=beta, offset=1e3)
    samples[:, 4] = samples[:, 2]
    samples[:, 6] = target
    _check_all("cpu", "cpu", (samples, target, bt, metric), seed, f"gram {kind} beta={beta}")
    with torch.no_grad():  # the forward-only call
        args = [t.float() for t in (samples, target, bt)]
        m, _ = metric_to(metric, torch.float32, "cpu", requires_grad=False)
        out = etweedie.energy_score(*args, metric=m, backend="cpu")
        r32 = etweedie.energy_score(*args, metric=m, backend="reference")
        m64, _ = metric_to(metric, torch.float64, "cpu", requires_grad=False)
        r64 = etweedie.energy_score(samples, target, bt, metric=m64, backend="reference")
    assert_close_to_ref(out, r32, r64, name=f"ES no-grad [gram {kind}]", seed=seed)


def _gram_rows_run(backend, dtype, samples, target, bt, metric, fair=True):
    """Value and the gradients of the draws and the target (the Gram row kernel's outputs)."""
    s = samples.to(dtype).requires_grad_()
    t = target.to(dtype).requires_grad_()
    m, _ = metric_to(metric, dtype, "cpu", requires_grad=False)
    out = etweedie.energy_score(s, t, bt.to(dtype), metric=m, fair=fair, backend=backend)
    up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype)
    return [out, *torch.autograd.grad((out * up).sum(), (s, t))]


@pytest.mark.parametrize("kind", ["none", "diagonal", "block2", "block4"])
@pytest.mark.parametrize("beta", [1.0, 2.0, None], ids=["b1", "b2", "per-row"])
@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4], ids=["origin", "1e3", "1e4"])
@pytest.mark.parametrize("M", [21, 3], ids=["gram", "direct"])
def test_cpu_score_gram_kernel(kind, beta, offset, M, seed):
    """The CPU Gram-form row kernel (float32, d ≥ 64, gradients of the draws and the target
    only: csrc/cpu/energy_score_gram_cpu.h) against the float64 reference, with clouds offset
    from the origin, coincident draws, a draw on the target, a close pair, per-row β and metric;
    M = 21 (n = M + 1 = 22 spans two panels) and M = 3 (every pair in its exact form); the
    forward-only op and the separate backward op agree with the fused value-and-gradient op."""
    B, d = 9, 96
    samples, target, bt, metric = _inputs(seed, B, M, d, kind, beta=beta, offset=offset)
    if M > 3:
        samples[:, 4] = samples[:, 2]
        samples[:, 6] = target
        samples[:, 9] = (samples[:, 8] + 1e-3).float().double()  # a close pair (float32-representable, like every input)
    else:
        samples[:5, 1] = samples[:5, 0]
        samples[3:, 2] = target[3:]
        samples[6:, 0] = (samples[6:, 1] + 1e-3).float().double()
    for fair in (True, False):
        got = _gram_rows_run("cpu", torch.float32, samples, target, bt, metric, fair)
        r32 = _gram_rows_run("reference", torch.float32, samples, target, bt, metric, fair)
        r64 = _gram_rows_run("reference", torch.float64, samples, target, bt, metric, fair)
        for name, x, y, z in zip(["ES", "grad samples", "grad target"], got, r32, r64):
            assert_close_to_ref(x, y, z, name=f"{name} [gram rows {kind} fair={fair}]", seed=seed, atol_scale=3e-5)
    if kind == "none":
        return
    m32, _ = metric_to(metric, torch.float32, "cpu", requires_grad=False)
    prec, k = etweedie.ops._args.metric_param(m32, torch.Size([B]), d)
    x32, y32, b32 = samples.float(), target.float(), bt.float()
    fwd = torch.ops.etweedie.energy_score_fwd(x32, y32, b32, prec, k, False)
    torch.testing.assert_close(fwd, got[0].detach(), rtol=1e-5, atol=1e-5)
    up = torch.linspace(0.5, 1.5, B)
    gs, gt, _, _ = torch.ops.etweedie.energy_score_bwd(up, x32, y32, b32, prec, k, False, True, True, False, False)
    torch.testing.assert_close(gs, got[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gt, got[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grads", ["draws", "all"])
@pytest.mark.parametrize("offset", [0.0, 1e3], ids=["origin", "1e3"])
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("B,M", [(3, 32), (3, 3), (12, 9)], ids=["gram", "direct", "many-rows"])
def test_cpu_close_pairs_from_source_points(B, M, kind, offset, grads, seed):
    """Two draws 1e-4 apart and a draw 1e-4 from the target, β = 0.5, d = 72: the close pairs'
    slopes dominate their points' gradients, so their differences must carry the inputs'
    precision.  The Gram row kernel's centred points (gradients of draws and target only) and
    the pair engine's whitened copies (β and metric gradients too) each round at the size of
    the points, 10⁴× the pairs' distance: both form close pairs from the inputs."""
    samples, target, bt, metric = _inputs(seed, B, M, 72, kind, beta=0.5, offset=offset)
    step = 1e-4 * torch.randn(B, 72, generator=gen(seed + 1), dtype=torch.float64)
    samples[:, M - 1] = (samples[:, 0] + step).float().double()
    samples[:, 1] = (target - step).float().double()
    label = f"close pairs {kind} offset={offset:g}"
    if grads == "all":
        _check_all("cpu", "cpu", (samples, target, bt, metric), seed, label)
        return
    got = _gram_rows_run("cpu", torch.float32, samples, target, bt, metric, True)
    r32 = _gram_rows_run("reference", torch.float32, samples, target, bt, metric, True)
    r64 = _gram_rows_run("reference", torch.float64, samples, target, bt, metric, True)
    for name, x, y, z in zip(["ES", "grad samples", "grad target"], got, r32, r64):
        assert_close_to_ref(x, y, z, name=f"{name} [{label}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("scale", [1e-20, 1e20])
@pytest.mark.parametrize("B,M", [(4, 17), (1, 255), (3, 2), (2, 1)], ids=["gram", "max-draws", "m2", "m1"])
def test_cpu_score_gram_kernel_scale(scale, B, M, seed):
    """Clouds of magnitude 1e±20 in float32 (squared norms would leave float32's range
    without the kernel's power-of-two rescaling; the op runs no float64 fallback on this path):
    value and gradients match the float64 reference computed on the unit-scale cloud and scaled
    analytically (ES ∝ s^β, ∂ES/∂x ∝ s^{β−1}).  The shapes are the corners of the kernel's
    domain (1 and 255 draws, one row, the direct form at M = 1, 2), where the op's Python-side
    choice to skip its range check must agree with the C++ kernel's applicability."""
    d, beta, fair = 64, 1.4, M > 1
    samples, target, bt, metric = _inputs(seed, B, M, d, "block2", beta=beta)
    if M > 3:
        samples[:, 3] = samples[:, 1]
    r64 = _gram_rows_run("reference", torch.float64, samples, target, bt, metric, fair)
    got = _gram_rows_run("cpu", torch.float32, samples * scale, target * scale, bt, metric, fair)
    for name, x, y, power in zip(["ES", "grad samples", "grad target"], got, r64, [beta, beta - 1, beta - 1]):
        want = y.detach() * scale**power
        err = float(((x.detach().double() - want).abs() / want.abs().max()).max())
        assert err < 1e-5, f"{name} at scale {scale:g}, B={B} M={M}: relative error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("M", [255, 200])
def test_cpu_score_gram_kernel_fine_cloud_far_out(M, seed):
    """Many draws (M = 200, 255) with a 1e-3 spread at 1e4 from the origin, β = 2: the gradient
    (1/M)(mean of the other draws − target) is ~M^{-1/2} of the terms it is summed from, so the
    row kernel's centre (summed in double: a float running sum drifts by ~n/2 ulps of 1e4, a
    hundred times the spread) and its weight sums Σ_j c_ij (which cancel to 0 at β = 2) must not
    add rounding at the points' magnitude.  Held to the suite's float64-reference criterion."""
    B, d = 3, 64
    g = gen(seed)
    target = (1e4 + 1e-3 * torch.randn(B, d, generator=g, dtype=torch.float64)).float().double()
    samples = (target.unsqueeze(1) + 1e-3 * torch.randn(B, M, d, generator=g, dtype=torch.float64)).float().double()
    bt = torch.full((B,), 2.0, dtype=torch.float64)
    got = _gram_rows_run("cpu", torch.float32, samples, target, bt, None)
    r32 = _gram_rows_run("reference", torch.float32, samples, target, bt, None)
    r64 = _gram_rows_run("reference", torch.float64, samples, target, bt, None)
    for name, x, y, z in zip(["ES", "grad samples", "grad target"], got, r32, r64):
        assert_close_to_ref(x, y, z, name=f"{name} [M={M}, 1e-3 spread at 1e4]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("kind", ["none", "block2"])
@pytest.mark.parametrize("M", [20, 3], ids=["gram", "direct"])
def test_cpu_score_gram_kernel_wide_rows(M, kind, seed):
    """Rows the Gram row kernel's single power-of-two row scale cannot hold, beside ordinary rows:
    a tight cluster (1e-11) with one draw 1e12 away, points at ±3e38 whose centred differences
    overflow float32, and two draws 1e-44 apart (a float32 subnormal) next to a unit draw.  The
    kernel hands such rows to the pair engine in float64 (csrc/cpu/energy_score_cpu.cpp:
    redo_gram_rows); value and gradients must match the float64 reference row by row, through
    the plain call, the fused training op and the separate forward and backward ops."""
    B, d = 5, 64
    samples, target, _, metric = _inputs(seed, B, M, d, kind)
    g = gen(seed + 7)
    bt = torch.tensor([1.4, 1.0, 0.5, 0.5, 1.0], dtype=torch.float64)
    samples[1], target[1] = 1e-11 * torch.randn(M, d, generator=g), 1e-11 * torch.randn(d, generator=g)
    samples[1, -1] = 0.0
    samples[1, -1, 0] = 1e12
    samples[2], target[2] = 0.0, 0.0
    samples[2, 0, 0], samples[2, 1:, 0], target[2, 0] = 3e38, -3e38, -3e38
    samples[2, 1:, 1] = torch.randn(M - 1, generator=g)  # the -3e38 draws apart in another coordinate
    samples[3], target[3] = 0.0, 0.0
    samples[3, 0] = torch.randn(d, generator=g)
    samples[3, 2, 1] = 1e-44  # draws 1 and 2 are 1e-44 apart
    samples[4] = samples[4, :1] + 1e-5 * torch.randn(M, d, generator=g)  # a tight cloud far from its target
    samples, target = samples.float().double(), target.float().double()
    r64 = _gram_rows_run("reference", torch.float64, samples, target, bt, metric)
    got = _gram_rows_run("cpu", torch.float32, samples, target, bt, metric)
    m32, _ = metric_to(metric, torch.float32, "cpu", requires_grad=False)
    with torch.no_grad():  # the plain call (forward op only)
        plain = etweedie.energy_score(samples.float(), target.float(), bt.float(), metric=m32)
    # the value of a wide row is a difference of terms ~1e12 or ~1e19 (exact in neither
    # precision): its error is measured against the cross term (1/M) Σ ‖x_i − y‖^β
    terms = ((samples - target.unsqueeze(1)).norm(dim=-1) ** bt.unsqueeze(1)).mean(1)
    for name, x, want in zip(["ES", "grad samples", "grad target"], got, r64):
        x = x.detach().double()
        for r in range(B):
            scale = terms[r] if name == "ES" else want[r].detach().abs().max()
            err = float((x[r] - want[r].detach()).abs().max() / scale)
            assert err < 3e-5, f"{name} row {r} ({kind}, M={M}): relative error {err:.2e} (seed {seed})"
    torch.testing.assert_close(plain, got[0].detach(), rtol=1e-6, atol=0)
    prec, k = etweedie.ops._args.metric_param(m32, torch.Size([B]), d) if m32 is not None else (torch.ones(B), 0)
    x32, y32, b32 = samples.float(), target.float(), bt.float()
    torch.testing.assert_close(torch.ops.etweedie.energy_score_fwd(x32, y32, b32, prec, k, True), got[0].detach(),
                               rtol=1e-6, atol=0)
    up = torch.linspace(0.5, 1.5, B)
    gs, gt, _, _ = torch.ops.etweedie.energy_score_bwd(up, x32, y32, b32, prec, k, True, True, True, False, False)
    torch.testing.assert_close(gs, got[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(gt, got[2], rtol=1e-6, atol=0)


@pytest.mark.parametrize("M", [20, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cpu_score_gram_kernel_nan(M, bad):
    """A NaN or inf draw or target gives a NaN score and NaN gradients for its row only, never
    0 or a finite value (the kernel's own NaN rows: the op runs no NaN-row pass here)."""
    samples, target, bt, metric = _inputs(0, 4, M, 64, "block2", beta=1.0)
    samples[1, M // 2, 7] = bad
    target[2, 3] = bad
    out, gs, gt = _gram_rows_run("cpu", torch.float32, samples, target, bt, metric)
    for r in (1, 2):
        assert torch.isnan(out[r]) and torch.isnan(gs[r]).all() and torch.isnan(gt[r]).all()
    keep = torch.tensor([0, 3])
    assert torch.isfinite(out[keep]).all() and torch.isfinite(gs[keep]).all() and torch.isfinite(gt[keep]).all()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "dense"])
def test_gradcheck_float64(backend, device, kind, seed):
    x, y, b, metric = _inputs(seed, 2, 4, 4, kind)
    m, p = metric_to(metric, torch.float64, device, requires_grad=True)

    def f(x, y, b, p):
        param = p if m.kind in ("isotropic", "diagonal") else (p + p.transpose(-1, -2)) / 2
        return etweedie.energy_score(x, y, b, etweedie.Metric(m.kind, param), backend=backend)

    leaves = [t.to(device).requires_grad_() for t in (x, y, b)]
    assert torch.autograd.gradcheck(f, (*leaves, p)), f"gradcheck failed (seed {seed})"


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_broadcast_and_noncontiguous(backend, device, seed):
    g = gen(seed)
    B, M, d = 5, 7, 6
    x_big = torch.randn(B, M, 2 * d, generator=g).to(device)
    x = x_big[..., ::2]  # non-unit stride over d
    y = torch.randn(d, generator=g).to(device)  # one target for every row
    beta = torch.rand(B, generator=g).to(device) + 0.5
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]], device=device)
    got = etweedie.energy_score(x, y, beta, etweedie.Metric.block(S), backend=backend)
    want = etweedie.energy_score(
        x.contiguous(), y.expand(B, d).contiguous(), beta, etweedie.Metric.block(S.expand(B, 2, 2).contiguous()),
        backend=backend,
    )
    torch.testing.assert_close(got, want, msg=f"seed {seed}")
    # extra batch dims: (2, 3) targets scored against (3, M, d) sample sets
    y2 = torch.randn(2, 3, d, generator=g).to(device)
    x2 = torch.randn(3, M, d, generator=g).to(device)
    got = etweedie.energy_score(x2, y2, 1.5, backend=backend)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, torch.stack([etweedie.energy_score(x2, y2[i], 1.5, backend=backend) for i in range(2)]))


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
def test_zero_size_batch(backend, device):
    x = torch.zeros(0, 4, 3, device=device, requires_grad=True)
    y = torch.zeros(0, 3, device=device, requires_grad=True)
    es = etweedie.energy_score(x, y, 1.3, etweedie.Metric.diagonal(torch.ones(3, device=device)), backend=backend)
    assert es.shape == (0,)
    gx, gy = torch.autograd.grad(es.sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(kind, dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._args import metric_param

    x, y, b, metric = _inputs(seed, 3, 5, 4, kind)
    m, _ = metric_to(metric, dtype)
    prec, k = metric_param(m, torch.Size([3]), 4)
    args = [t.to(dtype).clone().requires_grad_() for t in (x, y, b, prec.contiguous())] + [k, True]
    torch.library.opcheck(torch.ops.etweedie.energy_score_fwd.default, args)
    # the fused training op (value and unit gradients in one pass)
    torch.library.opcheck(torch.ops.etweedie.energy_score_fwd_grad.default, args + [True, True, True, True])


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_torch_compile_fullgraph(backend, device, seed):
    x, y, _, metric = _inputs(seed, 4, 8, 6, "block2")
    x, y = x.float().to(device).requires_grad_(), y.float().to(device)
    m, _ = metric_to(metric, torch.float32, device)

    def f(x, y):
        return etweedie.energy_score(x, y, 1.4, m, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), f(x, y))
    (g1,) = torch.autograd.grad(compiled(x, y).sum(), x)
    (g2,) = torch.autograd.grad(f(x, y).sum(), x)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("beta", [1.0, 1.5])
def test_proper_true_law_minimizes_expected_score(beta, seed):
    """Targets y ~ N(0, I₂); predictive laws N(μ, s²I): the expected fair score is smallest
    for the true law (μ = 0, s = 1); paired differences over 20000 targets, z > 6."""
    g = gen(seed)
    B, M, d = 20000, 8, 2
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    z = torch.randn(B, M, d, generator=g, dtype=torch.float64)
    true = etweedie.energy_score(z, y, beta)
    for mu, s in [(0.0, 0.6), (0.0, 1.6), (0.4, 1.0)]:
        other = etweedie.energy_score(mu + s * z, y, beta)
        diff = other - true
        zscore = diff.mean() / (diff.std() / B**0.5)
        assert zscore > 6, f"law N({mu}, {s}²) scores {float(diff.mean()):.4f} vs the true law (z {float(zscore):.1f}, seed {seed})"


class TestBadInput:
    def test_types(self):
        x, y = torch.zeros(2, 4, 3), torch.zeros(2, 3)
        with pytest.raises(TypeError, match="samples must be a torch.Tensor"):
            etweedie.energy_score([[0.0]], y)
        with pytest.raises(TypeError, match="target must be float32 or float64"):
            etweedie.energy_score(x, y.int())
        with pytest.raises(TypeError, match="target must have samples' dtype"):
            etweedie.energy_score(x, y.double())
        with pytest.raises(TypeError, match="beta must be a float or a tensor"):
            etweedie.energy_score(x, y, "1")
        with pytest.raises(TypeError, match="metric must be an etweedie.Metric"):
            etweedie.energy_score(x, y, metric=torch.eye(3))

    def test_shapes_and_values(self):
        x, y = torch.zeros(2, 4, 3), torch.zeros(2, 3)
        with pytest.raises(ValueError, match=r"fair=True needs M >= 2"):
            etweedie.energy_score(torch.zeros(2, 1, 3), y)
        with pytest.raises(ValueError, match=r"target must have shape \(\*batch, d=3\)"):
            etweedie.energy_score(x, torch.zeros(2, 4))
        with pytest.raises(ValueError, match="samples must have shape"):
            etweedie.energy_score(torch.zeros(3), y)
        with pytest.raises(ValueError, match="batch shapes do not broadcast"):
            etweedie.energy_score(x, torch.zeros(3, 3))
        with pytest.raises(ValueError, match="at least one draw"):
            etweedie.energy_score(torch.zeros(2, 0, 3), y, fair=False)
        for bad in (0.0, 2.5, float("nan")):
            with pytest.raises(ValueError, match=r"beta must lie in \(0, 2\]"):
                etweedie.energy_score(x, y, bad)
        with pytest.raises(ValueError, match="dimension 4, but the data has d=3"):
            etweedie.energy_score(x, y, metric=etweedie.Metric.diagonal(torch.ones(4)))
        with pytest.raises(ValueError, match="target is on meta but samples are on cpu"):
            etweedie.energy_score(x, torch.zeros(2, 3, device="meta"))
        with pytest.raises(ValueError, match="backend must be one of"):
            etweedie.energy_score(x, y, backend="gpu")
