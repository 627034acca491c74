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
from conftest import BACKEND_DEVICE, BACKEND_IDS, assert_close_to_ref, gen, metric_to, random_metric

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


def _run(backend, device, dtype, y, x, beta, lam, metric, grads=True):
    """Forward (and gradients wrt every input) at dtype on device with backend."""
    leaves = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_(grads) for t in (y, x, beta, lam)]
    m, p = metric_to(metric, dtype, device, requires_grad=grads)
    s = etweedie.et_score(*leaves, metric=m, backend=backend)
    if not grads:
        return s, []
    up = torch.linspace(-1, 1, s.numel(), dtype=dtype, device=device).reshape(s.shape)
    inputs = leaves + ([p] if p is not None else [])
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
    for name, a, b, c in zip(["y", "x", "beta", "lam", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}{tag}", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(5, 33, 6), (3, 130, 48), (1, 1, 6)], ids=["small", "large-d", "N1"])
def test_matches_float64_reference(backend, device, kind, shape, seed):
    B, N, d = shape
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_against_reference(backend, device, (y, x, beta, lam), metric, f"[{kind}]", seed)


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
    from etweedie.ops._prep import canonicalize

    y, x, beta, lam, metric = _inputs(seed, 3, 6, 4, kind)
    m, _ = metric_to(metric, dtype)
    c = canonicalize("et_score", y.to(dtype), x.to(dtype), beta.to(dtype), lam.to(dtype), m)
    args = [t.clone().requires_grad_() for t in (c.y, c.x, c.beta, c.lam, c.prec.contiguous())] + [c.kind]
    torch.library.opcheck(torch.ops.etweedie.et_score_fwd.default, args)


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
        with pytest.raises(TypeError, match="x must be float32 or float64"):
            etweedie.et_score(y, x.int(), 1.0)
        with pytest.raises(TypeError, match="x must have y's dtype"):
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
        with pytest.raises(ValueError, match="backend must be one of"):
            etweedie.et_score(y, x, 1.0, backend="gpu")
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
