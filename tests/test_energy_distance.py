"""energy_distance: every backend and every gradient against the float64 reference.

Covers the metric kinds, U- and V-statistics, clouds larger than one tile (several blocks,
odd and even block counts), coincident points, clouds 1e3 from the origin, broadcast and
zero-size batches, gradcheck, opcheck, torch.compile(fullgraph=True), bad input, and the
statistics: same law ≈ 0 on average, different laws > 0, β = 2 V-statistic = 2‖Δmean‖²_P.
"""

import pytest
import torch

import etweedie
from conftest import BACKEND_DEVICE, BACKEND_IDS, KERNEL_BACKENDS, assert_close_to_ref, gen, metric_to, random_metric

KINDS = ["none", "isotropic", "diagonal", "block2", "dense"]


def _inputs(seed, B, n, m, d, kind, beta=None, offset=0.0, shift=0.7):
    g = gen(seed)
    a = torch.randn(B, n, d, generator=g, dtype=torch.float64) + offset
    b = 1.3 * torch.randn(B, m, d, generator=g, dtype=torch.float64) + offset + shift
    # exactly representable in float32, so ref64 is the truth for the float32 run's inputs too
    a, b = a.float().double(), b.float().double()
    if beta is None:
        beta = 0.6 + 1.4 * torch.rand(B, generator=g, dtype=torch.float64)
    else:
        beta = torch.full((B,), float(beta), dtype=torch.float64)
    return a, b, beta, random_metric(kind, B, d, g)


def _run(backend, device, dtype, a, b, beta, metric, unbiased=True, grads=True):
    leaves = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_(grads) for t in (a, b, beta)]
    m, p = metric_to(metric, dtype, device, requires_grad=grads)
    out = etweedie.energy_distance(*leaves, metric=m, unbiased=unbiased, backend=backend)
    if not grads:
        return out, []
    up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype, device=device).reshape(out.shape)
    inputs = leaves + ([p] if p is not None else [])
    gs = list(torch.autograd.grad((out * up).sum(), inputs))
    if m is not None and m.kind == "dense":
        gs[-1] = (gs[-1] + gs[-1].transpose(-1, -2)) / 2
    return out, gs


def _term_scale(a, b, beta, metric) -> float:
    """max over rows of 2E‖a−b‖^β + E‖a−a'‖^β + E‖b−b'‖^β (float64): the size of the terms the
    energy distance is the difference of.  Float32 rounding of the result scales with it, which
    matters when the terms nearly cancel (β → 0: every ‖·‖^β ≈ 1)."""
    m, _ = metric_to(metric, torch.float64)

    def mean_pow(x, y):
        diff = x[:, :, None, :] - y[:, None, :, :]
        if m is not None:
            diff = m.whiten(diff, sample_dims=2)
        return (diff.norm(dim=-1) ** beta[:, None, None]).mean(dim=(1, 2))

    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    return float((2 * mean_pow(a, b) + mean_pow(a, a) + mean_pow(b, b)).max())


def _check_all(backend, device, args, seed, label, unbiased=True, grads=True):
    out, gout = _run(backend, device, torch.float32, *args, unbiased=unbiased, grads=grads)
    r32, g32 = _run("reference", "cpu", torch.float32, *args, unbiased=unbiased, grads=grads)
    r64, g64 = _run("reference", "cpu", torch.float64, *args, unbiased=unbiased, grads=grads)
    eps32 = torch.finfo(torch.float32).eps
    assert_close_to_ref(out, r32, r64, name=f"ED[{label}]", seed=seed, atol_floor=2 * eps32 * _term_scale(*args))
    for name, x, y, z in zip(["a", "b", "beta", "metric"], gout, g32, g64):
        assert_close_to_ref(x, y, z, name=f"grad {name}[{label}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(3, 9, 12, 6), (2, 11, 18, 40), (2, 70, 65, 2)], ids=["small", "large-d", "tiles"])
@pytest.mark.parametrize("unbiased", [True, False], ids=["U", "V"])
def test_matches_float64_reference(backend, device, kind, shape, unbiased, seed):
    _check_all(backend, device, _inputs(seed, *shape, kind), seed, f"{kind} U={unbiased}", unbiased)


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 2, 3, 16])
@pytest.mark.parametrize("nm", [(1, 1), (2, 5), (16, 16), (23, 9)], ids=["1x1", "2x5", "16x16", "23x9"])
@pytest.mark.parametrize("unbiased", [True, False], ids=["U", "V"])
def test_cpu_row_kernel(kind, d, nm, unbiased, seed):
    """The CPU row kernel (small d, many rows, gradients of the two clouds only:
    csrc/cpu/energy_rows_cpu.h, each cloud's within pairs in runs by offset, the cross pairs
    in one run per point of b): value and both clouds' gradients against the float64 reference,
    1e3 from the origin, per-row β, a point of a on a point of b and a coincidence within a."""
    n, m = nm
    if kind.startswith("block") and d % int(kind[-1]):
        pytest.skip(f"{kind} needs d divisible by its block size")
    if unbiased and min(n, m) < 2:
        pytest.skip("the unbiased estimator needs two points per cloud")
    B = 16  # B ≥ 2 × threads for any thread count up to 8
    a, b, beta, metric = _inputs(seed, B, n, m, d, kind, offset=1e3)
    a[:, n // 2] = b[:, 0]
    if n > 2:
        a[:, 1] = a[:, 0]

    def run(backend, dtype):
        ac, bc = (t.to(dtype).requires_grad_() for t in (a, b))
        mm, _ = metric_to(metric, dtype, "cpu", requires_grad=False)
        out = etweedie.energy_distance(ac, bc, beta.to(dtype), mm, unbiased=unbiased, backend=backend)
        up = torch.linspace(0.5, 1.5, B, dtype=dtype)
        return [out, *torch.autograd.grad((out * up).sum(), (ac, bc))]

    got, r32, r64 = run("cpu", torch.float32), run("reference", torch.float32), run("reference", torch.float64)
    eps32 = torch.finfo(torch.float32).eps
    scale = _term_scale(a, b, beta, metric)
    for name, x, y, z in zip(["ED", "grad a", "grad b"], got, r32, r64):
        assert_close_to_ref(x, y, z, name=f"{name} [rows {kind} d={d} n={n} m={m}]", seed=seed, atol_scale=3e-5,
                            atol_floor=2 * eps32 * scale if name == "ED" else 0.0)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_metric_gradient_when_cross_and_within_sums_cancel(backend, device):
    """A pinned draw (CI, 2026-11-26) whose metric gradient is ~50× smaller than the cross and
    within sums it is the difference of: the CPU kernel once summed it over every pair in float32
    and missed by 8.3e-5 (bound 6.4e-5); it now adds float32 partial sums into a double every 64 pairs."""
    _check_all(backend, device, _inputs(780792699, 2, 11, 18, 40, "block2"), 780792699, "cancelling metric gradient")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize(
    "shape", [(1, 300, 257, 3), (1, 41, 90, 24), (12, 9, 7, 3), (12, 9, 7, 24)],
    ids=["many-tiles", "many-blocks", "many-rows", "many-rows-large-d"],  # many rows: the per-row backward
)
def test_many_blocks(backend, device, shape, seed):
    """Odd and even block counts of the circulant within-cloud split, and the per-row backward
    used when there are many rows, forward and gradients."""
    _check_all(backend, device, _inputs(seed, *shape, "diagonal"), seed, "blocks")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("d", [8, 40])
def test_dense_metric_far_from_origin(backend, device, d, seed):
    """Clouds 1e3 from the origin under a dense metric, value and every gradient: the host
    whitens x − c, c the first cloud's first point (whitening the points themselves cancelled
    in the metric gradient, Σ_p x_p g_pᵀ with Σ_p g_p = 0: 1–7× the tolerance)."""
    _check_all(backend, device, _inputs(seed, 2, 37, 50, d, "dense", offset=1e3), seed, f"dense d={d} offset 1e3")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("scale", [1.0, 1e-30])
def test_dense_metric_clouds_sharing_points(backend, device, scale, seed):
    """b = the first points of a, under a shared dense metric (float64, β = 0.3): both clouds are
    whitened in one product, so equal points stay exactly equal.  Two products of different
    shapes may round differently (they did for 4 + 2 points in d = 3, about half of all draws),
    and a spurious distance of 1e-16 relative costs (1e-16)^0.3 ≈ 2e-5 of the terms at β = 0.3."""
    g = gen(seed)
    d = 3
    a = scale * torch.randn(4, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    metric = etweedie.Metric.dense(A @ A.T / d + 0.5 * torch.eye(d, dtype=torch.float64))
    got = etweedie.energy_distance(a.to(device), a[:2].to(device), 0.3, metric.to(device), unbiased=False,
                                   backend=backend).cpu()
    # the exact value: every pair from its own difference (no whitened points at all)
    u = lambda x, y: (x[:, None] - y[None]).reshape(-1, d)  # noqa: E731
    e = lambda x, y: metric.sq_norm(u(x, y)).clamp_min(0).pow(0.15).mean()  # noqa: E731
    want = 2 * e(a, a[:2]) - e(a, a) - e(a[:2], a[:2])
    terms = e(a, a)
    assert float((got - want).abs()) <= 1e-12 * float(terms), (
        f"ED = {float(got):.6e}, exact {float(want):.6e}, terms {float(terms):.3e} (seed {seed})")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0, 0.05])
def test_coincident_points_no_nan(backend, device, beta, seed):
    a, b, bt, metric = _inputs(seed, 2, 8, 7, 4, "block2", beta=beta)
    a[:, 1] = a[:, 0]
    b[:, 3] = a[:, 2]
    _check_all(backend, device, (a, b, bt, metric), seed, f"coincident beta={beta}")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("d", [2, 30])
def test_far_from_origin(backend, device, d, seed):
    _check_all(backend, device, _inputs(seed, 2, 20, 25, d, "isotropic", offset=1e3), seed, "offset 1e3")


@pytest.mark.parametrize("kind", ["none", "isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("beta", [1.0, 2.0, 0.7, None], ids=["b1", "b2", "b0.7", "per-row"])
@pytest.mark.parametrize("d", [72, 69])
def test_cpu_gram_path(kind, beta, d, seed):
    """The CPU forward's Gram form (float32, d ≥ 64, ≥ 32 points: csrc/cpu/energy_gram_cpu.h):
    clouds 1e3 from the origin (centring), coincident and nearly coincident points (the
    cancellation guard), partial panels (n, m not multiples of 16), several rows, an odd d (the
    dot kernel's last coordinate outside its coordinate pairs); gradients (direct-difference
    backward) checked alongside."""
    if kind == "block2" and d % 2:
        kind = "block3"  # 69 = 3 · 23: a 3×3 block where a 2×2 one does not fit
    a, b, bt, metric = _inputs(seed, 2, 37, 50, d, kind, beta=beta, offset=1e3)
    a[:, 5] = a[:, 3]
    b[:, 7] = a[:, 1]
    b[:, 9] = (b[:, 8] + 1e-3).float().double()  # representable in float32, like every input
    _check_all("cpu", "cpu", (a, b, bt, metric), seed, f"gram {kind} beta={beta}")
    _check_cloud_grads_only(a, b, bt, metric, seed, f"gram {kind} beta={beta}")


@pytest.mark.parametrize("rows", [2, 12], ids=["per-point", "row-parallel"])
@pytest.mark.parametrize("grads", ["clouds", "all"])
@pytest.mark.parametrize("offset", [0.0, 1e3], ids=["origin", "1e3"])
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
def test_cpu_close_pairs_from_source_points(kind, offset, grads, rows, seed):
    """Pairs 1e-4 apart (within each cloud and across), β = 0.5, d = 72: the close pair's slope
    dominates its points' gradients, so its difference must carry the inputs' precision.  The
    Gram form's centred, whitened rows (gradients of the clouds only) and the whitened copies
    of the pair engine (β and metric gradients too; per point and row-parallel) each round at
    the size of the points: 10⁴× the pair's distance.  Both form close pairs from the inputs."""
    a, b, bt, metric = _inputs(seed, rows, 37, 50, 72, kind, beta=0.5, offset=offset)
    step = 1e-4 * torch.randn(rows, 72, generator=gen(seed + 1), dtype=torch.float64)
    a[:, 4] = (a[:, 2] + step).float().double()
    b[:, 9] = (b[:, 8] + step).float().double()
    b[:, 11] = (a[:, 6] - step).float().double()
    label = f"close pairs {kind} offset={offset:g}"
    if grads == "all":
        _check_all("cpu", "cpu", (a, b, bt, metric), seed, label)
    else:
        _check_cloud_grads_only(a, b, bt, metric, seed, label)


def _check_cloud_grads_only(a, b, bt, metric, seed, label, unbiased=True):
    """Gradients for the clouds only (no β / metric gradient): the CPU backward's Gram form."""

    def run(backend, dtype):
        x, y = (t.to(dtype).requires_grad_() for t in (a, b))
        m, _ = metric_to(metric, dtype, "cpu", requires_grad=False)
        out = etweedie.energy_distance(x, y, bt.to(dtype), metric=m, unbiased=unbiased, backend=backend)
        up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype).reshape(out.shape)
        return torch.autograd.grad((out * up).sum(), (x, y))

    got, r32, r64 = run("cpu", torch.float32), run("reference", torch.float32), run("reference", torch.float64)
    for name, x, y, z in zip(["a", "b"], got, r32, r64):
        assert_close_to_ref(x, y, z, name=f"grad {name} only [{label}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("unbiased", [True, False], ids=["U", "V"])
@pytest.mark.parametrize("shape", [(1, 33, 90, 80), (2, 48, 16, 64), (3, 40, 2, 100)], ids=["odd", "blocks", "tiny-m"])
def test_cpu_gram_backward_shapes(shape, unbiased, seed):
    """Gram backward on partial blocks, whole blocks, a second cloud of 2 points, d not a
    multiple of the 16-wide vector kernel; 1e3 from the origin, a coincident pair."""
    a, b, bt, metric = _inputs(seed, *shape, "isotropic", offset=1e3)
    a[:, 2] = a[:, 1]
    _check_cloud_grads_only(a, b, bt, metric, seed, f"gram bwd {shape}", unbiased)


@pytest.mark.parametrize("kind", ["diagonal", "block3", "block4"])
@pytest.mark.parametrize("beta", [1.0, 2.0], ids=["b1", "b2"])
@pytest.mark.parametrize("offset", [1e3, 1e4], ids=["1e3", "1e4"])
def test_cpu_gram_metric_in_kernel(kind, beta, offset, seed):
    """Diagonal and block metrics applied inside the Gram form (csrc/cpu/energy_gram_cpu.h:
    z = (x − c)·L while packing, ∂/∂x = (∂/∂z)·Lᵀ while writing): value and cloud gradients
    against the float64 reference, clouds 1e3–1e4 from the origin, coincident points."""
    a, b, bt, metric = _inputs(seed, 2, 40, 35, 72, kind, beta=beta, offset=offset)
    a[:, 5] = a[:, 3]
    b[:, 7] = a[:, 1]
    _check_all("cpu", "cpu", (a, b, bt, metric), seed, f"gram metric {kind} beta={beta} offset={offset:g}", grads=False)
    _check_cloud_grads_only(a, b, bt, metric, seed, f"gram metric {kind} beta={beta} offset={offset:g}")


@pytest.mark.parametrize("scale", [1e-20, 1e20])
@pytest.mark.parametrize("kind", ["isotropic", "block2"])
def test_cpu_gram_far_scales(scale, kind, seed):
    """Clouds of magnitude 1e±20 in float32 (squared norms of whole points would leave float32's
    range): the Gram form rescales by a power of two; value and cloud gradients match the float64
    reference at unit scale, scaled analytically (ED ∝ s^β, ∂ED/∂x ∝ s^{β−1})."""
    beta = 1.4
    a, b, bt, metric = _inputs(seed, 2, 40, 33, 64, kind, beta=beta)
    m32, _ = metric_to(metric, torch.float32, "cpu")
    m64, _ = metric_to(metric, torch.float64, "cpu")

    def run(x, y, dtype, m, backend):
        x, y = x.to(dtype).requires_grad_(), y.to(dtype).requires_grad_()
        out = etweedie.energy_distance(x, y, bt.to(dtype), metric=m, backend=backend)
        return [out, *torch.autograd.grad(out.sum(), (x, y))]

    ref = run(a, b, torch.float64, m64, "reference")
    got = run(a * scale, b * scale, torch.float32, m32, "cpu")
    for name, x, y, power in zip(["ED", "grad a", "grad b"], got, ref, [beta, beta - 1, beta - 1]):
        want = y.detach() * scale**power
        err = float(((x.detach().double() - want).abs() / want.abs().max()).max())
        assert err < 2e-5, f"{name} at scale {scale:g}: relative error {err:.2e} (seed {seed})"


def test_cpu_gram_nan_propagates():
    """A NaN point gives a NaN distance and NaN gradients for its row (never 0); other rows finite."""
    a, b, bt, metric = _inputs(0, 3, 40, 33, 64, "block2", beta=1.0)
    a[1, 3, 5] = float("nan")
    m32, _ = metric_to(metric, torch.float32, "cpu")
    x, y = a.float().requires_grad_(), b.float().requires_grad_()
    out = etweedie.energy_distance(x, y, 1.0, metric=m32, backend="cpu")
    ga, gb = torch.autograd.grad(out.sum(), (x, y))
    assert torch.isnan(out[1]) and torch.isnan(ga[1]).all() and torch.isnan(gb[1]).all()
    assert torch.isfinite(out[[0, 2]]).all() and torch.isfinite(ga[[0, 2]]).all()


def test_cpu_gram_path_non_contiguous_and_broadcast(seed):
    a, b, bt, metric = _inputs(seed, 3, 40, 33, 64, "isotropic")
    # a cloud stored transposed (stride over d ≠ 1) and one broadcast over the batch
    a_t = a.transpose(1, 2).contiguous().transpose(1, 2)
    b_bc = b[:1].expand(3, -1, -1)
    _check_all("cpu", "cpu", (a_t, b_bc, bt, metric), seed, "gram strided")
    _check_cloud_grads_only(a_t, b_bc, bt, metric, seed, "gram strided")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
def test_same_law_near_zero_different_laws_positive(backend, device, seed):
    g = gen(seed)
    B, n, d = 400, 40, 2
    a = torch.randn(B, n, d, generator=g, dtype=torch.float64).to(device)
    b = torch.randn(B, n, d, generator=g, dtype=torch.float64).to(device)
    ed = etweedie.energy_distance(a, b, backend=backend)
    z = ed.mean() / (ed.std() / B**0.5)
    assert abs(float(z)) < 5, f"same law: mean ED {float(ed.mean()):.2e} is {float(z):.1f} SE from 0 (seed {seed})"
    assert (ed < 0).any(), "the U-statistic is signed: some replicates should be negative"
    ed_diff = etweedie.energy_distance(a, 0.6 + b, backend=backend)
    assert float(ed_diff.mean()) > 10 * float(ed.std() / B**0.5) and float(ed_diff.mean()) > 0.1


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "grad-tensor"])
def test_beta2_v_statistic_is_mean_difference(backend, device, as_tensor, seed):
    """β = 2 as a number takes the closed form; as a tensor that requires a gradient, the pair
    kernels (which must agree with the closed form's mean difference)."""
    a, b, _, metric = _inputs(seed, 3, 10, 14, 6, "diagonal")
    m, _ = metric_to(metric, torch.float64, device)
    beta = torch.full((3,), 2.0, dtype=torch.float64, device=device, requires_grad=True) if as_tensor else 2.0
    ed = etweedie.energy_distance(a.to(device), b.to(device), beta, m, unbiased=False, backend=backend)
    delta = a.mean(1) - b.mean(1)
    want = 2 * (delta * metric.apply_precision(delta)).sum(-1)
    torch.testing.assert_close(ed.detach().cpu(), want, rtol=1e-10, atol=1e-10)


def _run_beta2_number(backend, device, dtype, a, b, metric, unbiased):
    leaves = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in (a, b)]
    m, p = metric_to(metric, dtype, device, requires_grad=True)
    out = etweedie.energy_distance(*leaves, 2.0, m, unbiased=unbiased, backend=backend)
    up = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype, device=device).reshape(out.shape)
    gs = list(torch.autograd.grad((out * up).sum(), leaves + ([p] if p is not None else [])))
    if m is not None and m.kind == "dense":
        gs[-1] = (gs[-1] + gs[-1].transpose(-1, -2)) / 2
    return out, gs


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("unbiased", [True, False], ids=["U", "V"])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_beta2_closed_form_matches_pair_sums(backend, device, kind, unbiased, offset, seed):
    """β = 2 given as a number: the closed form (means and spreads) against the float64 pair sums
    of the reference, value and the gradients of both clouds and the metric, near and far from
    the origin."""
    a, b, _, metric = _inputs(seed, 3, 9, 12, 8, kind, offset=offset)
    out, gout = _run_beta2_number(backend, device, torch.float32, a, b, metric, unbiased)
    r32, g32 = _run_beta2_number("reference", "cpu", torch.float32, a, b, metric, unbiased)
    r64, g64 = _run_beta2_number("reference", "cpu", torch.float64, a, b, metric, unbiased)
    scale = _term_scale(a, b, torch.full((3,), 2.0, dtype=torch.float64), metric)
    assert_close_to_ref(out, r32, r64, name=f"ED beta=2 [{kind}]", seed=seed,
                        atol_floor=2 * torch.finfo(torch.float32).eps * scale)
    for name, x, y, z in zip(["a", "b", "metric"], gout, g32, g64):
        assert_close_to_ref(x, y, z, name=f"grad {name} beta=2 [{kind}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("magnitude", [1.0, 1e20, 1e30])
def test_beta2_equal_clouds_exactly_zero(backend, device, magnitude, seed):
    """Equal float32 clouds at β = 2, V-statistic: exactly 0 at every magnitude.  At 1e30 the
    call reruns in float64, where the pair sums' rounding (~1e-16 of terms of 1e60) lies beyond
    float32's range: they returned inf (found by the randomized property tests)."""
    a = (magnitude * torch.randn(3, 4, 3, generator=gen(seed), dtype=torch.float64)).float().to(device)
    ed = etweedie.energy_distance(a, a.clone(), 2.0, unbiased=False, backend=backend)
    assert torch.equal(ed.cpu(), torch.zeros(3)), f"{ed} (seed {seed})"


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "dense"])
def test_gradcheck_float64(backend, device, kind, seed):
    a, b, beta, metric = _inputs(seed, 2, 4, 3, 4, kind)
    m, p = metric_to(metric, torch.float64, device, requires_grad=True)

    def f(a, b, beta, p):
        param = p if m.kind in ("isotropic", "diagonal") else (p + p.transpose(-1, -2)) / 2
        return etweedie.energy_distance(a, b, beta, etweedie.Metric(m.kind, param), backend=backend)

    leaves = [t.to(device).requires_grad_() for t in (a, b, beta)]
    assert torch.autograd.gradcheck(f, (*leaves, p)), f"gradcheck failed (seed {seed})"


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_broadcast_and_zero_size(backend, device, seed):
    g = gen(seed)
    a = torch.randn(4, 9, 3, generator=g).to(device)
    b = torch.randn(12, 3, generator=g).to(device)  # one reference cloud for all rows
    got = etweedie.energy_distance(a, b, 1.2, backend=backend)
    want = torch.stack([etweedie.energy_distance(a[i], b, 1.2, backend=backend) for i in range(4)])
    assert got.shape == (4,)
    torch.testing.assert_close(got, want)
    a0 = torch.zeros(0, 5, 3, device=device, requires_grad=True)
    b0 = torch.zeros(0, 6, 3, device=device, requires_grad=True)
    ed = etweedie.energy_distance(a0, b0, backend=backend)
    assert ed.shape == (0,)
    ga, gb = torch.autograd.grad(ed.sum(), (a0, b0))
    assert ga.shape == a0.shape and gb.shape == b0.shape


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(kind, dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._args import metric_param

    a, b, beta, metric = _inputs(seed, 2, 5, 4, 4, kind)
    m, _ = metric_to(metric, dtype)
    prec, k = metric_param(m, torch.Size([2]), 4)
    args = [t.to(dtype).clone().requires_grad_() for t in (a, b, beta, prec.contiguous())] + [k, True]
    torch.library.opcheck(torch.ops.etweedie.energy_distance_fwd.default, args)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_torch_compile_fullgraph(backend, device, seed):
    a, b, _, _ = _inputs(seed, 2, 12, 9, 3, "none")
    a, b = a.float().to(device).requires_grad_(), b.float().to(device)

    def f(a, b):
        return etweedie.energy_distance(a, b, 1.0, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b), f(a, b))
    (g1,) = torch.autograd.grad(compiled(a, b).sum(), a)
    (g2,) = torch.autograd.grad(f(a, b).sum(), a)
    torch.testing.assert_close(g1, g2)


class TestBadInput:
    def test_errors(self):
        a, b = torch.zeros(2, 4, 3), torch.zeros(2, 5, 3)
        with pytest.raises(TypeError, match="a must be a torch.Tensor"):
            etweedie.energy_distance([[0.0]], b)
        with pytest.raises(TypeError, match="b must have a's dtype"):
            etweedie.energy_distance(a, b.double())
        with pytest.raises(ValueError, match=r"b must have shape \(\*batch, m, d=3\)"):
            etweedie.energy_distance(a, torch.zeros(2, 5, 4))
        with pytest.raises(ValueError, match="a must have shape"):
            etweedie.energy_distance(torch.zeros(3), b)
        with pytest.raises(ValueError, match="unbiased=True needs n >= 2 and m >= 2"):
            etweedie.energy_distance(a[:, :1], b)
        assert etweedie.energy_distance(a[:, :1], b, unbiased=False).shape == (2,)
        with pytest.raises(ValueError, match="batch shapes do not broadcast"):
            etweedie.energy_distance(a, torch.zeros(3, 5, 3))
        with pytest.raises(ValueError, match=r"beta must lie in \(0, 2\]"):
            etweedie.energy_distance(a, b, 3.0)
        with pytest.raises(ValueError, match="b is on meta but a is on cpu"):
            etweedie.energy_distance(a, torch.zeros(2, 5, 3, device="meta"))
        with pytest.raises(TypeError, match="unbiased must be a bool"):
            etweedie.energy_distance(a, b, unbiased=1)
