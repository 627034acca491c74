"""et_score: every backend and every gradient against the float64 reference.

Covers isotropic/diagonal/block/dense metrics (shared and per-row), β ∈ {1, 1.4, 2} and near
0, coincident draws, broadcast and non-contiguous inputs, zero-size batches, float64
gradcheck, torch.library.opcheck, torch.compile(fullgraph=True), bad input, and the identity
itself on an exactly-solvable posterior.
"""

import math

import pytest
import torch

import etweedie
from conftest import (
    BACKEND_DEVICE,
    BACKEND_IDS,
    LOW_PRECISION,
    LOW_PRECISION_IDS,
    assert_close_to_ref,
    assert_low_precision_close,
    gen,
    metric_to,
    random_metric,
)

KINDS = ["none", "isotropic", "diagonal", "block2", "block3", "dense"]


def _inputs(seed, B, N, d, kind, per_row=True, beta=None):
    g = gen(seed)
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    x = y.unsqueeze(1) + 0.7 * torch.randn(B, N, d, generator=g, dtype=torch.float64)
    if beta is None:
        beta = 0.8 + 1.2 * torch.rand(B, generator=g, dtype=torch.float64)
    else:
        beta = torch.full((B,), float(beta), dtype=torch.float64)
    lam = 0.5 + 1.5 * torch.rand(B, generator=g, dtype=torch.float64)
    metric = random_metric(kind, B, d, g, per_row=per_row)
    return y, x, beta, lam, metric


def _run(backend, device, dtype, y, x, beta, lam, metric, grads=True, x_dtype=None, metric_grad=True, upstream=1.0):
    """Forward (and gradients wrt every input, the metric's when metric_grad) at dtype on device
    with backend (the draws at x_dtype when given: 16-bit draws); the upstream gradient is
    ``upstream`` times a ramp over [−1, 1]."""
    leaves = [t.detach().to(device=device, dtype=dtype if i != 1 or x_dtype is None else x_dtype).clone().requires_grad_(grads)
              for i, t in enumerate((y, x, beta, lam))]
    m, p = metric_to(metric, dtype, device, requires_grad=grads and metric_grad)
    s = etweedie.et_score(*leaves, metric=m, backend=backend)
    if not grads:
        return s, []
    up = upstream * torch.linspace(-1, 1, s.numel(), dtype=torch.float64, device=device).reshape(s.shape).to(dtype)
    inputs = leaves + ([p] if p is not None and metric_grad else [])
    grads = list(torch.autograd.grad((s * up).sum(), inputs))
    if m is not None and m.kind == "dense":
        # Σ enters through a Cholesky factor on the kernel path, whose backward returns the
        # symmetric part of the gradient; only that part is defined for a symmetric Σ.
        grads[-1] = (grads[-1] + grads[-1].transpose(-1, -2)) / 2
    return s, grads


def _check_against_reference(backend, device, args, metric, tag, seed):
    """Kernel at float32 vs the reference at float32 and float64: score and every gradient."""
    out, gout = _run(backend, device, torch.float32, *args, metric)
    r32, g32 = _run("reference", "cpu", torch.float32, *args, metric)
    r64, g64 = _run("reference", "cpu", torch.float64, *args, metric)
    assert_close_to_ref(out, r32, r64, name=f"score{tag}", seed=seed)
    floors = _row_gradient_floors(*args, metric)
    for name, a, b, c in zip(["y", "x", "beta", "lam", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}{tag}", seed=seed, atol_scale=3e-5,
                            atol_floor=floors.get(name, 0.0))


def _row_gradient_floors(y, x, beta, lam, metric):
    """Absolute-error floors of the per-row gradients of β and λ, from the size of their terms.

    Each is a sum over draws and coordinates of g_j (P u_i)_j times the draw's weight (and ½ log q_i
    for β), with _run's upstream g; it can cancel to far below its terms (a single row, one draw:
    ∂L/∂β = ½ log q · g·s), and float32 rounding scales with the terms, not with the sum.  The
    floor is 1e-6 × Σ|terms| (≈ 16 float32 ulps of the terms), evaluated in float64."""
    B, d = y.shape
    x = x.expand(B, *x.shape[-2:])  # a shared cloud (1, N, d) serves every row
    g = torch.linspace(-1, 1, B * d, dtype=torch.float64).reshape(B, 1, d)
    m = metric if metric is not None else etweedie.Metric.isotropic(torch.ones((), dtype=torch.float64))
    u = y.unsqueeze(1) - x  # (B, N, d)
    Pu = m.apply_precision(u, sample_dims=1)  # a per-row metric's batch pairs with u's rows
    q = (u * Pu).sum(-1)
    w = torch.where(q > 0, q, torch.ones_like(q)).pow((beta.reshape(B, 1) - 2) / 2) * (q > 0)
    dots = (g.abs() * Pu.abs()).sum(-1)  # (B, N): Σ_j |g_j (P u_i)_j|
    lam_terms = (w * dots).mean(1)
    beta_terms = lam.reshape(B) * (w * dots * 0.5 * torch.where(q > 0, q.log().abs(), torch.zeros_like(q))).mean(1)
    return {"beta": 1e-6 * float(beta_terms.max()), "lam": 1e-6 * float(lam_terms.max())}


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(5, 33, 6), (3, 130, 48), (1, 1, 6)], ids=["small", "large-d", "N1"])
def test_matches_float64_reference(backend, device, kind, shape, seed):
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_against_reference(backend, device, (y, x, beta, lam), metric, f"[{kind}]", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("cloud", ["per-row", "shared"])
@pytest.mark.parametrize("kind", ["diagonal", "block2", "dense"])
def test_far_from_origin(backend, device, kind, cloud, seed):
    """Queries and draws 1e3 from the origin, score and every gradient: the kernels see y − x_i
    only.  A dense metric is whitened on the host, as z = (u − c)·L with c the query (or a shared
    cloud's first draw); whitening the points themselves put errors 80–140× the float32
    tolerance into the score."""
    y, x, beta, lam, metric = _inputs(seed, 3, 33, 48, kind, per_row=cloud == "per-row")
    if cloud == "shared":
        x = x[:1]  # one cloud (1, N, d) for every query: a broadcast through the whitening
    y, x = (y + 1e3).float().double(), (x + 1e3).float().double()
    _check_against_reference(backend, device, (y, x, beta, lam), metric, f"[{kind} {cloud} 1e3]", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("beta", [1.0, 2.0, 0.05, 1e-3, 1.4])
def test_beta_values(backend, device, beta, seed):
    y, x, b, lam, metric = _inputs(seed, 4, 17, 3, "block3", beta=beta)
    _check_against_reference(backend, device, (y, x, b, lam), metric, f" beta={beta}", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "dense"])
def test_gradcheck_float64(backend, device, kind, seed):
    y, x, beta, lam, metric = _inputs(seed, 3, 5, 4, kind)
    m, p = metric_to(metric, torch.float64, device, requires_grad=True)
    leaves = [t.to(device).requires_grad_() for t in (y, x, beta, lam)]

    def f(y, x, beta, lam, p):
        # symmetrize so finite differences stay inside the SPD cone
        param = p if m.kind in ("isotropic", "diagonal") else (p + p.transpose(-1, -2)) / 2
        return etweedie.et_score(y, x, beta, lam, etweedie.Metric(m.kind, param), backend=backend)

    assert torch.autograd.gradcheck(f, (*leaves, p)), f"gradcheck failed (seed {seed})"


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("beta", [0.5, 1.0, 1.4, 2.0])
def test_coincident_draws_are_zero_not_nan(backend, device, beta, seed):
    y, x, b, lam, metric = _inputs(seed, 4, 9, 6, "block2", beta=beta)
    x[:, ::3] = y.unsqueeze(1)  # every third draw sits exactly on its query
    _check_against_reference(backend, device, (y, x, b, lam), metric, " coincident", seed)  # also checks finiteness
    # all draws coincident: the score is exactly zero
    s = etweedie.et_score(y.float().to(device), y.float().to(device).unsqueeze(1).expand(4, 5, 6).contiguous(), beta, backend=backend)
    assert torch.equal(s, torch.zeros_like(s))


@pytest.mark.parametrize("kind", ["block2", "block3", "block4"])
@pytest.mark.parametrize("beta", [1.0, 1.4, 2.0])
def test_block_backward_with_coefficient_rows(kind, beta, seed):
    """Block metrics at d ≥ 8k take the coefficient-row form of uᵀPu (prepare_row) in the CPU
    backward too: N = 13 draws with every third coincident; every gradient, the metric's
    included, against the float64 reference."""
    y, x, b, lam, metric = _inputs(seed, 3, 13, 48, kind, beta=beta)
    x[:, ::3] = y.unsqueeze(1)
    _check_against_reference("cpu", "cpu", (y, x, b, lam), metric, f" [{kind} four-draw backward]", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_broadcast_and_noncontiguous_inputs(backend, device, seed):
    g = gen(seed)
    B, N, d = 6, 11, 8
    cloud = torch.randn(N, d, generator=g).to(device)  # one cloud shared by all queries
    y_big = torch.randn(B, 2 * d, generator=g).to(device)
    y = y_big[:, ::2]  # non-contiguous queries
    beta = torch.tensor(1.3, device=device)  # scalar, broadcast
    lam = torch.rand(B, generator=g).to(device) + 0.5  # per row
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]], device=device)
    got = etweedie.et_score(y, cloud, beta, lam, etweedie.Metric.block(S), backend=backend)
    want = etweedie.et_score(
        y.contiguous(), cloud.expand(B, N, d).contiguous(), beta.expand(B), lam,
        etweedie.Metric.block(S.expand(B, 2, 2).contiguous()), backend=backend,
    )
    torch.testing.assert_close(got, want, msg=f"seed {seed}")
    # x transposed in memory (N and d swapped): a non-unit stride over d
    xt = torch.randn(B, d, N, generator=g).to(device).transpose(1, 2)
    torch.testing.assert_close(
        etweedie.et_score(y, xt, 1.7, backend=backend), etweedie.et_score(y, xt.contiguous(), 1.7, backend=backend)
    )
    # extra batch dims: (2, 3) queries against (3, N, d) clouds
    y2 = torch.randn(2, 3, d, generator=g).to(device)
    x2 = torch.randn(3, N, d, generator=g).to(device)
    got = etweedie.et_score(y2, x2, 1.5, backend=backend)
    want = torch.stack([etweedie.et_score(y2[i], x2, 1.5, backend=backend) for i in range(2)])
    assert got.shape == (2, 3, d)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
def test_zero_size_batch(backend, device):
    y = torch.zeros(0, 5, device=device, requires_grad=True)
    x = torch.zeros(0, 7, 5, device=device, requires_grad=True)
    s = etweedie.et_score(y, x, 1.4, 2.0, etweedie.Metric.diagonal(torch.ones(5, device=device)), backend=backend)
    assert s.shape == (0, 5)
    gy, gx = torch.autograd.grad(s.sum(), (y, x))
    assert gy.shape == y.shape and gx.shape == x.shape
    y2 = torch.zeros(2, 0, 5, device=device)
    assert etweedie.et_score(y2, torch.zeros(2, 0, 4, 5, device=device), 1.0, backend=backend).shape == (2, 0, 5)


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(kind, dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, beta, lam, metric = _inputs(seed, 3, 6, 4, kind)
    m, _ = metric_to(metric, dtype)
    c = canonicalize("et_score", y.to(dtype), x.to(dtype), beta.to(dtype), lam.to(dtype), m)
    args = [t.clone().requires_grad_() for t in (c.y, c.x, c.beta, c.lam, c.prec.contiguous())] + [c.kind]
    torch.library.opcheck(torch.ops.etweedie.et_score_fwd.default, args)


@pytest.mark.parametrize("d", [3, 0])
def test_raw_ops_need_a_draw_per_row(d):
    """Every raw score op refuses B >= 1 rows with no draw (N = 0), whatever d, with one message
    (checks::query_cloud); no row at all (B = 0) is an empty result."""
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    ops = torch.ops.etweedie

    def calls(B, N):
        y, x, b = torch.zeros(B, d), torch.zeros(B, N, d), torch.ones(B)
        return {
            "et_score": lambda: ops.et_score_fwd(y, x, b, b, b, 0),
            "et_score_bwd": lambda: ops.et_score_bwd(y, y, y, x, b, b, b, 0, y, True, True, True, True, True),
            "langevin_step": lambda: ops.langevin_step_fwd(y, x, y, b, b, b, b, 0),
            "student_t_score": lambda: ops.student_t_score_fwd(y, x, b, b, 0),
            "student_t_score_bwd": lambda: ops.student_t_score_bwd(y, y, y, x, b, b, 0, y, True, True, True, True),
        }

    for name, call in calls(2, 0).items():
        op = name.removesuffix("_bwd")
        with pytest.raises(RuntimeError, match=rf"^{op}: x must hold at least one posterior draw \(N >= 1\)"):
            call()
    for call in calls(0, 0).values():
        call()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_torch_compile_fullgraph(backend, device, seed):
    y, x, beta, lam, metric = _inputs(seed, 4, 16, 6, "block2")
    y, x = y.float().to(device).requires_grad_(), x.float().to(device)
    m, _ = metric_to(metric, torch.float32, device)

    def f(y, x):
        return etweedie.et_score(y, x, 1.4, 1.8, m, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(y, x), f(y, x))
    (g1,) = torch.autograd.grad(compiled(y, x).sum(), y)
    (g2,) = torch.autograd.grad(f(y, x).sum(), y)
    torch.testing.assert_close(g1, g2)


def test_identity_on_gaussian_posterior(seed):
    """Gaussian prior N(μ, τ²I), noise N(0, σ²I): the posterior is Gaussian and known, and
    the noisy score is −(y − μ)/(τ² + σ²).  et_score (β = 2) on exact posterior draws must
    match it within Monte Carlo error."""
    g = gen(seed)
    d, B, N = 3, 64, 4096
    mu, tau, sig = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), 0.8, 0.5
    y = mu + math.sqrt(tau**2 + sig**2) * torch.randn(B, d, generator=g, dtype=torch.float64)
    post_mean = (sig**2 * mu + tau**2 * y) / (tau**2 + sig**2)
    post_std = tau * sig / math.sqrt(tau**2 + sig**2)
    x = post_mean.unsqueeze(1) + post_std * torch.randn(B, N, d, generator=g, dtype=torch.float64)
    s = etweedie.et_score(y, x, beta=2.0, lam=1.0, metric=etweedie.Metric.isotropic(sig**2))
    exact = -(y - mu) / (tau**2 + sig**2)
    se = post_std / sig**2 / math.sqrt(N)  # std of each score coordinate's MC estimate
    z = ((s - exact) / se).abs().max()
    assert z < 5.5, f"max |error|/SE = {float(z):.2f} (seed {seed})"


class TestBadInput:
    def test_types(self):
        y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
        with pytest.raises(TypeError, match="y must be a torch.Tensor"):
            etweedie.et_score([[0.0]], x, 1.0)
        with pytest.raises(TypeError, match=r"x must have y's dtype torch.float32 or be bfloat16 or float16 .*got torch.int32"):
            etweedie.et_score(y, x.int(), 1.0)
        with pytest.raises(TypeError, match="x must have y's dtype torch.float32 or be bfloat16 or float16 .*got torch.float64"):
            etweedie.et_score(y, x.double(), 1.0)
        with pytest.raises(TypeError, match="beta must be a float or a tensor"):
            etweedie.et_score(y, x, "1.0")
        with pytest.raises(TypeError, match="metric must be an etweedie.Metric"):
            etweedie.et_score(y, x, 1.0, metric=torch.eye(3))

    def test_shapes(self):
        y = torch.zeros(2, 3)
        with pytest.raises(ValueError, match=r"x must have shape \(\*batch, N, d=3\)"):
            etweedie.et_score(y, torch.zeros(2, 4, 5), 1.0)
        with pytest.raises(ValueError, match="batch shapes do not broadcast"):
            etweedie.et_score(y, torch.zeros(3, 4, 3), 1.0)
        with pytest.raises(ValueError, match="at least one posterior draw"):
            etweedie.et_score(y, torch.zeros(2, 0, 3), 1.0)
        with pytest.raises(ValueError, match="x must have shape"):
            etweedie.et_score(y, torch.zeros(3), 1.0)
        with pytest.raises(ValueError, match="dimension 4, but the data has d=3"):
            etweedie.et_score(y, torch.zeros(2, 4, 3), 1.0, metric=etweedie.Metric.diagonal(torch.ones(4)))
        with pytest.raises(ValueError, match="block size k=2, which must divide d=3"):
            etweedie.et_score(y, torch.zeros(2, 4, 3), 1.0, metric=etweedie.Metric.block(torch.eye(2)))
        with pytest.raises(ValueError, match="batch shapes do not broadcast"):
            etweedie.et_score(y, torch.zeros(2, 4, 3), torch.ones(5))

    def test_values(self):
        y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
        for bad in (0.0, -1.0, 2.5, float("nan")):
            with pytest.raises(ValueError, match=r"beta must lie in \(0, 2\]"):
                etweedie.et_score(y, x, bad)
        with pytest.raises(ValueError, match="lam must be > 0"):
            etweedie.et_score(y, x, 1.0, lam=0.0)
        with pytest.raises(ValueError, match="lam must be > 0"):
            etweedie.et_score(y, x, 1.0, lam=torch.tensor([1.0, -2.0]))
        with pytest.raises(ValueError, match="positive definite"):
            etweedie.Metric.block(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
        with pytest.raises(ValueError, match="symmetric"):
            etweedie.Metric.dense(torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))

    def test_devices(self):
        y = torch.zeros(2, 3)
        with pytest.raises(ValueError, match="x is on meta but y is on cpu"):
            etweedie.et_score(y, torch.zeros(2, 4, 3, device="meta"), 1.0)

    def test_backend_names(self):
        y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
        with pytest.raises(ValueError, match="^et_score: backend must be one of .* got 'gpu'$"):
            etweedie.et_score(y, x, 1.0, backend="gpu")
        with pytest.raises(ValueError, match="^use_backend: backend must be one of"):
            with etweedie.use_backend("gpu"):
                pass
        if not etweedie.backends.available()["cuda"][0]:
            with pytest.raises(etweedie.backends.BackendUnavailable, match="'cuda' is unavailable"):
                etweedie.et_score(y, x, 1.0, backend="cuda")


def test_debug_flag_catches_nan():
    y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
    x[1, 2, 0] = float("nan")
    assert torch.isnan(etweedie.et_score(y, x, 1.0)).any()  # off by default: NaN propagates
    etweedie.set_debug(True)
    try:
        with pytest.raises(ValueError, match="x contains NaN"):
            etweedie.et_score(y, x, 1.0)
        with pytest.raises(ValueError, match="bank contains NaN"):
            etweedie.is_score(y, x[1], etweedie.GeneralizedGaussian(1.4))
    finally:
        etweedie.set_debug(False)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
def test_unbatched_query(backend, device):
    """y (d,) with x (N, d): no batch dims at all."""
    y, x = torch.zeros(3, device=device), torch.ones(4, 3, device=device)
    s = etweedie.et_score(y, x, 2.0, backend=backend)
    assert s.shape == (3,)
    torch.testing.assert_close(s, torch.ones(3, device=device))
    out = etweedie.langevin_step(y, x, torch.zeros(3, device=device), 0.5, 2.0, backend=backend)
    torch.testing.assert_close(out, 0.5 * torch.ones(3, device=device))


# ---------------------------------------------------------------------------- 16-bit draws
# The dtype rule (etweedie/ops/_args.py): x may be bfloat16/float16 with a float32 or float64 y;
# the kernels widen the draws as they load them and accumulate in y's dtype.  Every backend is
# held to the float64 reference on the draws' exact (upcast) values, with the float32 reference
# on the same 16-bit draws as the rounding yardstick; ∂L/∂x comes back in x's dtype.


def _check_low_precision(backend, device, args, metric, tag, seed, x_dtype, y_dtype=torch.float32):
    y, x, beta, lam = args
    x16 = x.to(x_dtype)  # the draws as a 16-bit posterior hands them over
    out, gout = _run(backend, device, y_dtype, y, x16, beta, lam, metric, x_dtype=x_dtype)
    r32, g32 = _run("reference", "cpu", y_dtype, y, x16, beta, lam, metric, x_dtype=x_dtype)
    r64, g64 = _run("reference", "cpu", torch.float64, y, x16.double(), beta, lam, metric)
    assert_low_precision_close(out, gout, (r32, g32), (r64, g64), ["y", "x", "beta", "lam", "metric"],
                               what=f"score{tag}", x_dtype=x_dtype, seed=seed, y_dtype=y_dtype)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["none", "diagonal", "block2", "dense"])
@pytest.mark.parametrize("shape", [(5, 33, 6), (3, 70, 48)], ids=["small", "large-d"])
def test_low_precision_draws_match_float64_reference(backend, device, x_dtype, kind, shape, seed):
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_low_precision(backend, device, (y, x, beta, lam), metric, f"[{x_dtype} {kind}]", seed, x_dtype)


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block1", "block2", "block4", "block3", "none"])
@pytest.mark.parametrize("shape", [(3, 70, 48), (2, 9, 784)], ids=["d48", "d784"])
def test_16bit_draws_in_register_lanes(x_dtype, kind, shape, seed):
    """16-bit draws, d a multiple of 16: the CPU forward widens 16 values per load in registers
    (csrc/cpu/lanes16_cpu.h; bfloat16 in the unpacked lane order) for isotropic, diagonal and
    k = 1, 2, 4 block metrics (k = 3 keeps the generic loops); N = 70 and 9 leave single draws
    after the four-draw sweeps (N = 9: no next group to prefetch after the first)."""
    B, N, d = shape
    if kind.startswith("block") and d % int(kind[5:]):
        pytest.skip("the block size must divide d")
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_low_precision("cpu", "cpu", (y, x, beta, lam), metric, f"[{x_dtype} lanes {kind}]", seed, x_dtype)
    m, _ = metric_to(metric, torch.float32)
    x16 = x.to(x_dtype)
    # the same values as float32 draws (the same sweeps in coordinate order): equal to float32 rounding
    s16 = etweedie.et_score(y.float(), x16, beta.float(), lam.float(), m, backend="cpu")
    s32 = etweedie.et_score(y.float(), x16.float(), beta.float(), lam.float(), m, backend="cpu")
    torch.testing.assert_close(s16, s32, rtol=2e-5, atol=2e-5 * s32.abs().max().item(), msg=f"seed {seed}")


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block1", "block2", "block4"])
@pytest.mark.parametrize("shape", [(3, 70, 48), (2, 9, 784), (2, 13, 800)], ids=["d48", "d784", "d800"])
def test_float32_draws_in_register_lanes(kind, shape, seed):
    """float32 draws take the same 16-lane sweeps (four draws' q in one sweep, the next group
    prefetched during the accumulation): score and gradients against the float64 reference,
    strided draws included (every other draw of a wider cloud)."""
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_against_reference("cpu", "cpu", (y, x, beta, lam), metric, f"[lanes {kind}]", seed)
    wide = torch.stack([x, x + 1.0], dim=2).reshape(B, 2 * N, d)[:, ::2]  # row stride 2·d
    assert not wide.is_contiguous()
    m, _ = metric_to(metric, torch.float32)
    got = etweedie.et_score(y.float(), wide.float(), beta.float(), lam.float(), m, backend="cpu")
    want = etweedie.et_score(y, x, beta, lam, metric, backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=f"seed {seed}")


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "block3"])
@pytest.mark.parametrize("shape", [(3, 13, 42), (2, 9, 786)], ids=["d42", "d786"])
def test_generic_loops_four_draw_sweeps(kind, shape, seed):
    """d > 16 that is not a multiple of 16 (and every float64 call) takes the generic loops: the
    four draws' q in one sweep for isotropic and diagonal metrics, the next four prefetched
    during the accumulation (N = 13: two groups with a next group, one without, one single draw;
    every third draw coincident).  float32 against the float64 reference, score and gradients."""
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    x[:, ::3] = y.unsqueeze(1)
    _check_against_reference("cpu", "cpu", (y, x, beta, lam), metric, f"[generic {kind}]", seed)


@pytest.mark.parametrize("x_dtype", [torch.float32] + LOW_PRECISION, ids=["f32"] + LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "none", "block1", "block2", "block4"])
@pytest.mark.parametrize("shape", [(3, 70, 48), (2, 9, 784)], ids=["d48", "d784"])
def test_backward_in_register_lanes(x_dtype, kind, shape, seed):
    """The CPU backward of an isotropic, diagonal or k = 1, 2, 4 block metric with d a multiple of
    16 and no metric gradient keeps both passes in registers and streams ∂L/∂x from them, rounded
    to x's format (lanes16_cpu.h): gradients of y, x, β and λ against the float64 reference, every third draw
    on its query (coincident draws in the four-draw groups and among the single draws after them:
    N = 70, 9), and against the generic loops, which a metric gradient selects."""
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    y = y.to(x_dtype).double()  # on the draws' grid, so that coincident draws are exact
    x[:, ::3] = y.unsqueeze(1)
    args = (y, x.to(x_dtype).double(), beta, lam)
    names = ["y", "x", "beta", "lam"]
    out, gout = _run("cpu", "cpu", torch.float32, *args, metric, x_dtype=x_dtype, metric_grad=False)
    r32, g32 = _run("reference", "cpu", torch.float32, *args, metric, x_dtype=x_dtype, metric_grad=False)
    r64, g64 = _run("reference", "cpu", torch.float64, *args, metric, metric_grad=False)
    tag = f"[{x_dtype} bwd lanes {kind}]"
    if x_dtype == torch.float32:
        floors = _row_gradient_floors(*args, metric)
        for name, a, b, c in zip(names, gout, g32, g64):
            assert_close_to_ref(a, b, c, name=f"grad {name}{tag}", seed=seed, atol_scale=3e-5,
                                atol_floor=floors.get(name, 0.0))
    else:
        assert_low_precision_close(out, gout, (r32, g32), (r64, g64), names, what=f"score{tag}", x_dtype=x_dtype,
                                   seed=seed)
    assert all(bool((gx == 0).all()) for gx in gout[1][:, ::3].unbind(1)), "coincident draws: zero gradient rows"
    _, generic = _run("cpu", "cpu", torch.float32, *args, metric, x_dtype=x_dtype)  # with the metric gradient
    for name, a, b in zip(names, gout, generic):
        scale = b.abs().max().item()
        rtol = 2e-5 if a.dtype == torch.float32 else torch.finfo(a.dtype).eps
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"grad {name}{tag} vs the generic loops: {m} (seed {seed})")


@pytest.mark.parametrize("x_dtype", [torch.float32] + LOW_PRECISION, ids=["f32"] + LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
def test_backward_in_register_lanes_subnormal_gradients(x_dtype, kind, seed):
    """An upstream gradient that puts ∂L/∂x at most at 8e-39 makes every value a float32
    subnormal: rounded to bfloat16 by the integer path (the hardware conversion flushes subnormals
    to zero; the register lanes' blocks are tested for them),
    to float16 (0 or its smallest values), kept as they are in float32; each within half a
    quantum of its format plus its relative rounding of the float64 reference."""
    y, x, beta, lam, metric = _inputs(seed, 2, 9, 48, kind)
    args = (y.float().double(), x.to(x_dtype).double(), beta, lam)
    _, g1 = _run("reference", "cpu", torch.float64, *args, metric, metric_grad=False)
    up = 8e-39 / float(g1[1].abs().max())
    _, gout = _run("cpu", "cpu", torch.float32, *args, metric, x_dtype=x_dtype, metric_grad=False, upstream=up)
    _, g64 = _run("reference", "cpu", torch.float64, *args, metric, metric_grad=False, upstream=up)
    gx, want = gout[1].double(), g64[1]
    assert gx.dtype == torch.float64 and gout[1].dtype == x_dtype
    assert want.abs().max() < torch.finfo(torch.float32).tiny, "the test wants subnormal gradients"
    fi = torch.finfo(x_dtype)
    quantum = fi.smallest_normal * fi.eps  # the subnormal spacing of x's format
    # float32 arithmetic on subnormal operands: its own quantum (2^-149) per operation
    bound = fi.eps * want.abs() + quantum + 64 * 2.0**-149
    err = (gx - want).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3e} (seed {seed})"
    assert x_dtype == torch.float16 or bool((gx != 0).sum() > gx.numel() // 2), "subnormal gradients flushed to 0"


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_16bit_draws_in_register_lanes_flag_rows(x_dtype):
    """A NaN draw gives a NaN row; a row beyond float32's squared-norm range is rerun in float64
    and matches the float64 reference; the other rows are untouched."""
    g = gen(5)
    y = torch.randn(4, 32, generator=g)
    x = (y.unsqueeze(1) + torch.randn(4, 7, 32, generator=g)).to(x_dtype)
    x[1, 6, 3] = math.nan
    # bfloat16 at 1e25: beyond float32's squared-norm range, rerun in float64; float16 cannot
    # leave it (largest 65504), its row at 1e3 is simply large
    big = 1e25 if x_dtype == torch.bfloat16 else 1e3
    y[2] *= big
    x[2] = (x[2].float() * big).to(x_dtype)
    got = etweedie.et_score(y, x, 1.3, backend="cpu")
    want = etweedie.et_score(y.double(), x.double(), 1.3, backend="reference")
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()
    for rows in ([0, 3], [2]):
        torch.testing.assert_close(got[rows].double(), want[rows], rtol=1e-5, atol=1e-5 * want[rows].abs().max().item())


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_low_precision_draws_beta_and_coincident(backend, device, x_dtype, beta, seed):
    y, x, b, lam, metric = _inputs(seed, 4, 9, 6, "block2", beta=beta)
    y = y.to(x_dtype).double()  # queries on the 16-bit grid, so that coincident draws are exact
    x[:, ::3] = y.unsqueeze(1)  # every third draw sits exactly on its query
    _check_low_precision(backend, device, (y, x, b, lam), metric, f" coincident beta={beta}", seed, x_dtype)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_with_float64_queries(backend, device, x_dtype, seed):
    """float64 y with 16-bit draws: computed and accumulated in float64."""
    y, x, beta, lam, metric = _inputs(seed, 3, 17, 8, "isotropic")
    x16 = x.to(x_dtype)
    out, gout = _run(backend, device, torch.float64, y, x16, beta, lam, metric, x_dtype=x_dtype)
    ref, gref = _run("reference", "cpu", torch.float64, y, x16.double(), beta, lam, metric)
    assert out.dtype == torch.float64 and gout[1].dtype == x_dtype
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")
    for name, a, b in zip(["y", "x", "beta", "lam", "metric"], gout, gref):
        if name == "x":  # float64 gradient rounded once to the draws' dtype: within one of its ulps
            info = torch.finfo(x_dtype)
            torch.testing.assert_close(a.cpu().double(), b, rtol=info.eps, atol=info.smallest_normal * info.eps,
                                       msg=f"grad x (seed {seed})")
        else:
            torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-12, msg=f"grad {name} (seed {seed})")


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_broadcast_and_noncontiguous(backend, device, x_dtype, seed):
    g = gen(seed)
    B, N, d = 6, 11, 8
    cloud = torch.randn(N, d, generator=g).to(device, x_dtype)  # one 16-bit cloud for all queries
    y = torch.randn(B, 2 * d, generator=g).to(device)[:, ::2]  # non-contiguous queries
    lam = torch.rand(B, generator=g).to(device) + 0.5
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]], device=device)
    got = etweedie.et_score(y, cloud, 1.3, lam, etweedie.Metric.block(S), backend=backend)
    want = etweedie.et_score(y.contiguous(), cloud.float().expand(B, N, d), 1.3, lam, etweedie.Metric.block(S),
                             backend=backend)
    torch.testing.assert_close(got, want, msg=f"seed {seed}")
    # a transposed 16-bit cloud (unit stride over N, not d) and a strided slice of a larger one
    xt = torch.randn(B, d, N, generator=g).to(device, x_dtype).transpose(1, 2)
    torch.testing.assert_close(etweedie.et_score(y, xt, 1.7, backend=backend),
                               etweedie.et_score(y, xt.float(), 1.7, backend=backend))
    xs = torch.randn(B, 2 * N, d, generator=g).to(device, x_dtype)[:, ::2]
    torch.testing.assert_close(etweedie.et_score(y, xs, 1.2, backend=backend),
                               etweedie.et_score(y, xs.float(), 1.2, backend=backend))


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_zero_size_batch(backend, device, x_dtype):
    y = torch.zeros(0, 5, device=device, requires_grad=True)
    x = torch.zeros(0, 7, 5, device=device, dtype=x_dtype, requires_grad=True)
    s = etweedie.et_score(y, x, 1.4, 2.0, etweedie.Metric.diagonal(torch.ones(5, device=device)), backend=backend)
    assert s.shape == (0, 5) and s.dtype == torch.float32
    gy, gx = torch.autograd.grad(s.sum(), (y, x))
    assert gy.shape == y.shape and gx.shape == x.shape and gx.dtype == x_dtype


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_nan_inf_and_float32_range(backend, device, x_dtype):
    """NaN/inf in 16-bit draws give NaN rows; magnitudes beyond float32's squared-norm range run
    in float64 (the range fallback keeps the 16-bit draws as they are) and match the float64
    reference on the same draws."""
    g = gen(11)
    y = torch.randn(3, 4, generator=g).to(device)
    x = torch.randn(3, 5, 4, generator=g).to(device, x_dtype)
    for bad in (math.nan, math.inf):
        xb = x.clone()
        xb[1, 2, 0] = bad
        s = etweedie.et_score(y, xb, 1.3, backend=backend)
        assert torch.isnan(s[1]).all() and torch.isfinite(s[[0, 2]]).all(), f"{bad}"
    if x_dtype != torch.bfloat16:
        return  # float16 spans 6e-8..65504: always inside the float32 range of the squared norms
    for scale in (1e-30, 1e25, 1e30):
        ys = (torch.randn(3, 2, generator=g) * scale).to(device)
        xs = (torch.randn(3, 6, 2, generator=g) * scale).to(device, x_dtype)
        for beta in (0.7, 1.6):
            ref = etweedie.et_score(ys.double(), xs.double(), beta, backend="reference")
            out = etweedie.et_score(ys, xs, beta, backend=backend)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.double().cpu(), ref.float().double().cpu(), rtol=1e-4, atol=0,
                                       msg=f"scale {scale} beta {beta}")


class TestLowPrecisionBadInput:
    def test_public_op(self):
        y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
        with pytest.raises(TypeError, match="y must be float32 or float64, got torch.bfloat16"):
            etweedie.et_score(y.bfloat16(), x.bfloat16(), 1.0)
        with pytest.raises(TypeError, match="x must have y's dtype torch.float64 or be bfloat16 or float16 .*got torch.float32"):
            etweedie.et_score(y.double(), x, 1.0)
        with pytest.raises(TypeError, match="x must have y's dtype torch.float32 or be bfloat16 or float16 .*got torch.float8_e4m3fn"):
            etweedie.et_score(y, x.to(torch.float8_e4m3fn), 1.0)
        with pytest.raises(TypeError, match="noise must be float32 or float64, got torch.bfloat16"):
            etweedie.langevin_step(y, x.bfloat16(), y.bfloat16(), 0.1, 1.0)

    def test_raw_op(self):
        if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
            pytest.skip("compiled extension not available")
        op = torch.ops.etweedie.et_score_fwd
        y, x, one = torch.zeros(2, 4), torch.zeros(2, 3, 4), torch.ones(2)
        with pytest.raises(RuntimeError, match="et_score: x must have y's dtype Float or be bfloat16 or float16, got Double"):
            op(y, x.double(), one, one, one, 0)
        with pytest.raises(RuntimeError, match="et_score: x must have y's dtype Float or be bfloat16 or float16, got Int"):
            op(y, x.int(), one, one, one, 0)
        with pytest.raises(RuntimeError, match="et_score: y must be float32 or float64, got BFloat16"):
            op(y.bfloat16(), x.bfloat16(), one, one, one, 0)
        s, m = op(y, x.bfloat16(), one, one, one, 0)
        assert s.dtype == m.dtype == torch.float32
        bwd = torch.ops.etweedie.et_score_bwd
        grads = bwd(y, y, y, x.half(), one, one, one, 0, m, True, True, True, True, True)
        assert grads[1].dtype == torch.float16 and grads[0].dtype == torch.float32


@pytest.mark.parametrize("kind", ["isotropic", "block2"])
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_opcheck_low_precision_draws(kind, x_dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, beta, lam, metric = _inputs(seed, 3, 6, 4, kind)
    m, _ = metric_to(metric, torch.float32)
    c = canonicalize("et_score", y.float(), x.to(x_dtype), beta.float(), lam.float(), m)
    args = [t.clone().requires_grad_() for t in (c.y, c.x, c.beta, c.lam, c.prec.contiguous())] + [c.kind]
    torch.library.opcheck(torch.ops.etweedie.et_score_fwd.default, args)


def _check_compile_fullgraph_low_precision(backend, device, seed):
    """torch.compile(fullgraph) of et_score on bf16 draws: the compiled value and gradients
    equal the eager ones, ∂L/∂x in bf16."""
    y, x, beta, lam, metric = _inputs(seed, 4, 16, 6, "block2")
    y, x = y.float().to(device).requires_grad_(), x.to(device, torch.bfloat16).requires_grad_()
    m, _ = metric_to(metric, torch.float32, device)

    def f(y, x):
        return etweedie.et_score(y, x, 1.4, 1.8, m, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(y, x), f(y, x))
    g1 = torch.autograd.grad(compiled(y, x).sum(), (y, x))
    g2 = torch.autograd.grad(f(y, x).sum(), (y, x))
    assert g1[1].dtype == torch.bfloat16
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_torch_compile_fullgraph_low_precision_draws(backend, device, seed):
    _check_compile_fullgraph_low_precision(backend, device, seed)
