"""Metric: every kind (shared and per-row batched) against a dense float64 reference."""

import math

import pytest
import torch

from etweedie.geometry import Metric, scale_constant, shape_matrix

KINDS = ["isotropic", "diagonal", "block", "dense"]
BATCHES = [(), (3,)]
D = 6  # divisible by the block sizes used (2 and 3)


@pytest.fixture
def gen():
    """A generator with a fresh seed; tests print the seed in assertion messages."""
    g = torch.Generator()
    seed = g.seed()
    return g, seed


def random_spd(shape, k, g):
    a = torch.randn(*shape, k, k, generator=g, dtype=torch.float64)
    return a @ a.transpose(-1, -2) + 0.5 * torch.eye(k, dtype=torch.float64)


def make_metric(kind, batch, g, d=D, k=2):
    """(metric, dense Σ reference of shape (*batch, d, d)), built independently of Metric."""
    eye = torch.eye(d, dtype=torch.float64)
    if kind == "isotropic":
        var = torch.rand(batch, generator=g, dtype=torch.float64) + 0.3
        return Metric.isotropic(var), var[..., None, None] * eye
    if kind == "diagonal":
        var = torch.rand(*batch, d, generator=g, dtype=torch.float64) + 0.3
        return Metric.diagonal(var), torch.diag_embed(var)
    if kind == "block":
        S = random_spd(batch, k, g)
        flat = S.reshape(-1, k, k)
        dense = torch.stack([torch.block_diag(*([s] * (d // k))) for s in flat])
        return Metric.block(S), dense.reshape(*batch, d, d)
    Sigma = random_spd(batch, d, g)
    return Metric.dense(Sigma), Sigma


def close(a, b, seed, atol=1e-10, rtol=1e-9):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{m}\n(seed {seed})")


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_covariance_and_precision_are_inverse(kind, batch, gen):
    g, seed = gen
    metric, Sigma = make_metric(kind, batch, g)
    close(metric.covariance(D), Sigma, seed)
    eye = torch.eye(D, dtype=torch.float64).expand(*batch, D, D)
    close(metric.precision(D) @ metric.covariance(D), eye, seed)
    close(metric.inverse().covariance(D), torch.linalg.inv(Sigma), seed)


def layouts(batch):
    """(u shape, sample_dims) pairs: batch-first with trailing draws, and draws-first (plain broadcast)."""
    if not batch:
        return [((D,), 0), ((5, D), 0), ((4, 5, D), 0)]
    return [((*batch, D), 0), ((*batch, 5, D), 1), ((*batch, 2, 5, D), 2), ((5, *batch, D), 0)]


def dense_apply(M, u, batch, sample_dims):
    """M u with M: (*batch, d, d) laid out to match u as the metric documents it."""
    if batch and sample_dims:
        M = M.reshape(*batch, *([1] * sample_dims), D, D)
    return (M @ u.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_apply_precision_covariance_whiten(kind, batch, gen):
    g, seed = gen
    metric, Sigma = make_metric(kind, batch, g)
    P = torch.linalg.inv(Sigma)
    for shape, sd in layouts(batch):
        u = torch.randn(shape, generator=g, dtype=torch.float64)
        close(metric.apply_covariance(u, sd), dense_apply(Sigma, u, batch, sd), seed)
        close(metric.apply_precision(u, sd), dense_apply(P, u, batch, sd), seed)
        quad = (u * dense_apply(P, u, batch, sd)).sum(-1)
        z = metric.whiten(u, sd)
        assert z.shape == u.shape
        close(z.pow(2).sum(-1), quad, seed)
        close(metric.sq_norm(u, sd), quad, seed)
        # unwhiten inverts whiten in both directions
        close(metric.unwhiten(z, sd), u, seed)
        close(metric.whiten(metric.unwhiten(u, sd), sd), u, seed)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_unwhiten_is_a_square_root_of_sigma(kind, batch, gen):
    g, seed = gen
    metric, Sigma = make_metric(kind, batch, g)
    # rows of A = unwhiten(e_i) are the columns of L^{-T}; Σ_i a_i a_iᵀ = L^{-T} L^{-1} = Σ.
    e = torch.eye(D, dtype=torch.float64).reshape(D, *([1] * len(batch)), D).expand(D, *batch, D)
    a = metric.unwhiten(e)
    close(torch.einsum("i...j,i...k->...jk", a, a), Sigma, seed)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_logdet_trace_and_trace_normalized(kind, batch, gen):
    g, seed = gen
    metric, Sigma = make_metric(kind, batch, g)
    sign, logabsdet = torch.linalg.slogdet(Sigma)
    assert bool((sign > 0).all())
    close(metric.logdet(D), logabsdet, seed)
    trace = torch.diagonal(Sigma, dim1=-2, dim2=-1).sum(-1)
    close(metric.trace(D), trace, seed)
    normalized = metric.trace_normalized()
    assert normalized.kind == metric.kind
    close(normalized.trace(D), torch.full_like(trace, float(D)), seed)
    # only the scale changes
    close(normalized.covariance(D) * (trace / D)[..., None, None], Sigma, seed)


def test_logdet_and_trace_need_d_for_isotropic_and_block():
    for metric in (Metric.isotropic(2.0), Metric.block(torch.eye(2))):
        with pytest.raises(ValueError, match="needs the dimension d"):
            metric.logdet()
        with pytest.raises(ValueError, match="needs the dimension d"):
            metric.trace()


def test_block_size_three_and_four(gen):
    g, seed = gen
    for k, d in ((3, 6), (4, 8)):
        S = random_spd((2,), k, g)
        metric = Metric.block(S)
        dense = torch.stack([torch.block_diag(*([s] * (d // k))) for s in S])
        u = torch.randn(2, 7, d, generator=g, dtype=torch.float64)
        close(metric.apply_precision(u, 1), (torch.linalg.inv(dense)[:, None] @ u[..., None])[..., 0], seed)
        close(metric.logdet(d), torch.linalg.slogdet(dense)[1], seed)


# ------------------------------------------------------------------ five-parameter geometry
@pytest.mark.parametrize("d", [1, 2, 5, 784])
def test_scale_constant_is_one_for_gaussian(d):
    close(scale_constant(torch.tensor(2.0, dtype=torch.float64), d), torch.tensor(1.0, dtype=torch.float64), None)


def second_moment_factor(beta, lam, d):
    """(β/λ)^{2/β} Γ((d+2)/β) / (d Γ(d/β)): Cov(u) = factor · Σ for generalized-Gaussian noise."""
    return torch.exp(
        (2 / beta) * torch.log(beta / lam) + torch.lgamma((d + 2) / beta) - torch.lgamma(d / beta) - math.log(d)
    )


@pytest.mark.parametrize("d", [2, 8, 784])
def test_from_params_realized_rms(d, gen):
    g, seed = gen
    n = 4
    f64 = dict(dtype=torch.float64)
    beta = 0.4 + 1.6 * torch.rand(n, generator=g, **f64)
    beta[0] = 2.0
    lam = 0.5 + 2 * torch.rand(n, generator=g, **f64)
    sigma = 0.1 + torch.rand(n, generator=g, **f64)
    angle = 2 * math.pi * torch.rand(n, generator=g, **f64)
    radius = 0.95 * torch.rand(n, generator=g, **f64)
    u, v = radius * torch.cos(angle), radius * torch.sin(angle)
    metric = Metric.from_params(sigma, u, v, beta, d)
    assert metric.kind == "block" and metric.batch_shape == (n,)
    c2 = scale_constant(beta, d) ** 2
    close(metric.param, shape_matrix(u, v) * (sigma**2 / c2)[:, None, None], seed)
    rms2 = metric.trace(d) / d * second_moment_factor(beta, lam, d)
    close(rms2, sigma**2 * lam ** (-2 / beta), seed)
    # β = 2: c = 1, so Σ = σ² (I ⊗ S)
    gauss = Metric.from_params(sigma, u, v, torch.full_like(beta, 2.0), d)
    close(gauss.param, shape_matrix(u, v) * (sigma**2)[:, None, None], seed)


def test_from_params_gradcheck(gen):
    g, seed = gen
    f64 = dict(dtype=torch.float64)
    sigma = (0.3 + torch.rand(3, generator=g, **f64)).requires_grad_()
    u = (0.5 * torch.rand(3, generator=g, **f64) - 0.25).requires_grad_()
    v = (0.5 * torch.rand(3, generator=g, **f64) - 0.25).requires_grad_()
    beta = (0.8 + torch.rand(3, generator=g, **f64)).requires_grad_()

    def precision_param(sigma, u, v, beta):
        return Metric.from_params(sigma, u, v, beta, 4).precision_param()

    assert torch.autograd.gradcheck(precision_param, (sigma, u, v, beta)), f"seed {seed}"


# ------------------------------------------------------------------ bad input
def test_bad_inputs_raise_named_errors():
    # a subnormal variance has no finite precision: refused, in float32 and float64 alike
    with pytest.raises(ValueError, match=r"var must be > 0 and finite .*smallest normal torch.float32.*got 1e-40"):
        Metric.isotropic(torch.tensor(1e-40))
    with pytest.raises(ValueError, match=r"var must be > 0 and finite .*smallest normal torch.float64"):
        Metric.diagonal(torch.tensor([1.0, 1e-310], dtype=torch.float64))
    with pytest.raises(ValueError, match="S must be symmetric positive definite"):
        Metric.block(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    with pytest.raises(ValueError, match="Sigma must be symmetric positive definite, got a non-symmetric"):
        Metric.dense(torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="S must be a k×k block with k in"):
        Metric.block(torch.eye(5))
    with pytest.raises(ValueError, match="S must have shape"):
        Metric.block(torch.ones(2, 3))
    with pytest.raises(ValueError, match="Sigma must have shape"):
        Metric.dense(torch.ones(3))
    with pytest.raises(ValueError, match="var must be > 0"):
        Metric.isotropic(0.0)
    with pytest.raises(ValueError, match="var must be > 0"):
        Metric.isotropic(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="var must be > 0"):
        Metric.diagonal(torch.tensor([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="var must have shape"):
        Metric.diagonal(torch.tensor(1.0))
    with pytest.raises(TypeError, match="var must be a float"):
        Metric.isotropic("1.0")
    with pytest.raises(TypeError, match="var must be a floating-point tensor"):
        Metric.diagonal(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(u, v\) must lie in the open unit disk"):
        Metric.from_params(0.5, 0.8, 0.8, 1.4, 2)
    with pytest.raises(ValueError, match="d must be an even integer"):
        Metric.from_params(0.5, 0.0, 0.0, 1.4, 3)
    with pytest.raises(ValueError, match="sigma must be > 0"):
        Metric.from_params(0.0, 0.0, 0.0, 1.4, 2)
    with pytest.raises(ValueError, match="beta must lie in"):
        Metric.from_params(0.5, 0.0, 0.0, 2.5, 2)
    with pytest.raises(ValueError, match="metric is dense of dimension 2"):
        Metric.dense(torch.eye(2)).apply_precision(torch.ones(3))
    with pytest.raises(ValueError, match="block size k=2, which must divide d=3"):
        Metric.block(torch.eye(2)).whiten(torch.ones(3))
    with pytest.raises(ValueError, match="kind must be one of"):
        Metric("full", torch.eye(2))


# ---------------------------------------------------------------------------- cached precision
def test_precision_is_computed_once_and_follows_in_place_changes():
    """A metric reused across op calls inverts its block once; an in-place change of the
    parameter (its version counter) is seen by the next call, and the ops follow it."""
    import etweedie

    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]])
    m = Metric.block(S.clone())
    first = m.precision_param()
    assert m.precision_param() is first and m.whitening_factor() is m.whitening_factor()
    torch.testing.assert_close(first, torch.linalg.inv(S))
    y, x = torch.randn(3, 4), torch.randn(3, 5, 4)
    before = etweedie.et_score(y, x, 1.5, metric=m)
    with torch.no_grad():
        m.param.mul_(2.0)  # Σ doubles: P halves and ‖u‖_P^{β−2} grows by 2^{(2−β)/2}
    assert m.precision_param() is not first
    torch.testing.assert_close(m.precision_param(), torch.linalg.inv(2.0 * S))
    torch.testing.assert_close(etweedie.et_score(y, x, 1.5, metric=m), before * 2.0 ** -0.75)


def test_precision_cache_never_hides_a_gradient_or_an_inference_tensor():
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]], requires_grad=True)
    m = Metric.block(S)
    assert m.precision_param() is not m.precision_param()  # a parameter that needs a gradient: fresh each call
    m.precision_param().sum().backward()
    assert S.grad is not None and torch.isfinite(S.grad).all()
    plain = Metric.block(torch.tensor([[1.2, 0.3], [0.3, 0.8]]))
    with torch.inference_mode():
        inside = plain.precision_param()
    outside = plain.precision_param()  # not the inference tensor: it may enter an autograd graph
    assert inside.is_inference() and not outside.is_inference()
    v = torch.ones(2, requires_grad=True)
    (outside @ v).sum().backward()
    # forward mode: the tangent of Σ reaches P (nothing cached for a dual tensor)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(torch.tensor([[1.2, 0.3], [0.3, 0.8]]), torch.eye(2))
        tangent = fwAD.unpack_dual(Metric.block(dual).precision_param()).tangent
    P = torch.linalg.inv(torch.tensor([[1.2, 0.3], [0.3, 0.8]]))
    torch.testing.assert_close(tangent, -P @ P)


@pytest.mark.parametrize("kind", ["block", "dense"])
def test_block_and_dense_metrics_promote_mixed_dtypes_like_the_diagonal_ones(kind):
    """A float64 Σ applied to float32 data (and the reverse) computes in float64, as the
    elementwise isotropic/diagonal forms do, instead of a matmul dtype error or a silent cast."""
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]], dtype=torch.float64)
    m = Metric.block(S) if kind == "block" else Metric.dense(S)
    u32 = torch.tensor([[0.5, -1.0]])
    for f in (m.apply_covariance, m.apply_precision, m.whiten, m.unwhiten):
        got = f(u32)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, f(u32.double()))
    m32 = Metric.block(S.float()) if kind == "block" else Metric.dense(S.float())
    assert m32.whiten(u32.double()).dtype == torch.float64


@pytest.mark.parametrize("kind", ["block", "dense"])
def test_a_huge_or_subnormal_sigma(kind):
    """Σ near float32's largest value: the symmetrization must not overflow (it made P = 0 and
    every score 0); a subnormal Σ is refused like a subnormal isotropic variance."""
    make = Metric.block if kind == "block" else Metric.dense
    m = make(torch.eye(2) * 2e38)
    torch.testing.assert_close(m.precision_param().diagonal(), torch.full((2,), 5e-39), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="diagonal entries of at least"):
        make(torch.eye(2) * 1e-40)


def test_scale_constant_is_accurate_in_float32_at_image_dimensions():
    """c_{β,d} from a float32 β equals the float64 value rounded (the lgamma difference at
    d = 784 cancels: evaluated in float32 it was off by 2e-4, and so was the noise's RMS)."""
    for beta in (0.3, 1.0, 1.3, 1.9):
        c32 = scale_constant(torch.tensor(beta), 784)
        c64 = scale_constant(torch.tensor(beta).double(), 784)  # the same (float32-rounded) β
        assert c32.dtype == torch.float32
        assert abs(float(c32) / float(c64) - 1) < 3e-7, beta


def test_noise_params_build_the_law_in_one_dtype():
    from etweedie import NoiseParams

    p = NoiseParams(beta=torch.tensor(1.4, dtype=torch.float64), lam=1.8, sigma=0.57, u=0.0, v=0.6)
    law = p.noise(2)
    assert p.metric(2).dtype == torch.float64 and law.metric.dtype == torch.float64
    torch.testing.assert_close(law.realized_rms(), p.realized_rms(), rtol=1e-15, atol=0)


def test_vector_methods_check_their_input():
    """apply_precision / apply_covariance / whiten / unwhiten / sq_norm name what is wrong with
    the vectors they are given (not a torch error from inside, nor a silent cast)."""
    m = Metric.dense(torch.eye(2))
    per_row = Metric.dense(torch.eye(2).expand(2, 2, 2).clone())
    cases = [
        (lambda: m.apply_precision([[1.0, 2.0]]), TypeError, "must be a torch.Tensor"),
        (lambda: m.apply_covariance(torch.tensor(1.0)), ValueError, "got shape \\(\\)"),
        (lambda: per_row.apply_precision(torch.ones(3, 2)), ValueError, "does not broadcast"),
        (lambda: Metric.isotropic(1.0).apply_precision(torch.ones(1, 2, dtype=torch.long)), TypeError, "floating"),
        (lambda: m.whiten(torch.ones(2, 3)), ValueError, "dimension 2"),
        (lambda: m.unwhiten(torch.ones(2), sample_dims=-1), ValueError, "sample_dims"),
        (lambda: m.sq_norm(torch.ones(2), sample_dims=1), ValueError, "1 sample dim"),
        (lambda: Metric.dense(torch.ones(0, 0)), ValueError, "d >= 1"),
        (lambda: Metric.diagonal(torch.ones(0)), ValueError, "d >= 1"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    # a sample dim between the batch and d, and an empty batch of metrics, still work
    out = per_row.apply_precision(torch.ones(2, 5, 2), 1)
    assert out.shape == (2, 5, 2)
    assert Metric.diagonal(torch.ones(0, 3)).apply_covariance(torch.ones(0, 3)).shape == (0, 3)
