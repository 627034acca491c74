"""Noise laws: sampling, normalization, moments, scores, and the five-parameter tuple.

Statistical checks use fixed seeds (they cannot flake) and tolerances of 5 standard errors
computed from the samples; exact identities use fresh seeds reported on failure.
"""

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch

from etweedie.geometry import Metric
from etweedie.noise import GeneralizedGaussian, Laplace, NoiseParams, StudentT

F64 = dict(dtype=torch.float64)
N_MC = 200_000


@pytest.fixture
def gen():
    """A generator with a fresh seed; tests print the seed in assertion messages."""
    g = torch.Generator()
    seed = g.seed()
    return g, seed


def fixed(seed):
    return torch.Generator().manual_seed(seed)


def block_metric(batch=()):
    S = torch.tensor([[1.3, 0.4], [0.4, 0.7]], **F64)
    if batch:
        S = S * torch.linspace(0.5, 1.5, math.prod(batch), **F64).reshape(*batch, 1, 1)
    return Metric.block(S)


def dense_metric():
    return Metric.dense(torch.tensor([[1.0, 0.3, -0.2], [0.3, 0.8, 0.1], [-0.2, 0.1, 1.5]], **F64))


def close(a, b, seed, atol=1e-10, rtol=1e-9):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{m}\n(seed {seed})")


def within_se(estimate, target, se, what, k=5.0):
    err = (estimate - target).abs()
    bad = err > k * se + 1e-12
    assert not bool(bad.any()), f"{what}: |estimate − target| = {err} exceeds {k} SE = {k * se}"


# ------------------------------------------------------------------ sampling mechanics
def test_sample_reproducible_and_explicit(gen):
    g, seed = gen
    noise = GeneralizedGaussian(1.4, 1.8, block_metric(), dim=4)
    state = torch.get_rng_state()
    a = noise.sample((50,), generator=torch.Generator().manual_seed(seed))
    b = noise.sample((50,), generator=torch.Generator().manual_seed(seed))
    c = noise.sample((50,), generator=torch.Generator().manual_seed(seed + 1))
    assert torch.equal(a, b), f"seed {seed}"
    assert not torch.equal(a, c), f"seed {seed}"
    assert torch.equal(torch.get_rng_state(), state), "sampling must not touch the global RNG"
    t = StudentT(3.0, block_metric(), dim=4)
    assert torch.equal(t.sample((9,), generator=fixed(seed)), t.sample((9,), generator=fixed(seed)))
    assert torch.equal(torch.get_rng_state(), state), "sampling must not touch the global RNG"


@pytest.mark.parametrize("sample_shape", [(), (5,), (2, 3), 4, (0,)])
def test_sample_shapes_and_per_row_batch(sample_shape):
    g = fixed(0)
    lead = (sample_shape,) if isinstance(sample_shape, int) else tuple(sample_shape)
    beta = torch.tensor([1.0, 1.5, 2.0], **F64)
    noise = GeneralizedGaussian(beta, 1.3, block_metric((3,)), dim=4)
    assert noise.batch_shape == (3,)
    x = noise.sample(sample_shape, generator=g)
    assert x.shape == (*lead, 3, 4) and x.dtype == torch.float64
    assert noise.log_prob(x).shape == (*lead, 3)
    assert noise.score(x).shape == (*lead, 3, 4)
    # beta (2, 1) × metric batch (3,) broadcast to (2, 3)
    noise = GeneralizedGaussian(beta[:2, None], torch.tensor(1.0, **F64), block_metric((3,)), dim=4)
    assert noise.sample(sample_shape, generator=g).shape == (*lead, 2, 3, 4)
    # the metric fixes d, or the call passes it
    assert GeneralizedGaussian(1.0, 1.0, dense_metric()).sample(sample_shape, generator=g).shape == (*lead, 3)
    assert GeneralizedGaussian(1.0).sample(sample_shape, generator=g, dim=5).shape == (*lead, 5)
    assert StudentT(torch.tensor([3.0, 4.0]), dim=2).sample(sample_shape, generator=g).shape == (*lead, 2, 2)


def test_sample_matches_metric_geometry():
    """‖u‖_P of a draw is the radius R: the Σ^{1/2} factor is L^{-T} (Metric.unwhiten)."""
    metric = block_metric()
    noise = GeneralizedGaussian(1.4, 1.8, metric, dim=4)
    x = noise.sample((1000,), generator=fixed(1))
    z = metric.whiten(x)
    assert torch.all(z.norm(dim=-1) > 0)


# ------------------------------------------------------------------ moments and laws
@pytest.mark.parametrize("beta", [0.7, 1.4, 2.0])
def test_mean_norm_power_is_d_over_lambda(beta):
    d, lam = 4, 1.8
    metric = block_metric()
    x = GeneralizedGaussian(beta, lam, metric, dim=d).sample((N_MC,), generator=fixed(10))
    t = metric.sq_norm(x) ** (beta / 2)
    se = t.std() / math.sqrt(N_MC)
    within_se(t.mean(), torch.tensor(d / lam, **F64), se, f"E‖u‖_P^β, β={beta}")


def test_mean_norm_power_per_row():
    d = 4
    beta = torch.tensor([0.8, 1.4, 2.0], **F64)
    lam = torch.tensor([0.6, 1.8, 2.5], **F64)
    metric = block_metric((3,))
    x = GeneralizedGaussian(beta, lam, metric, dim=d).sample((N_MC // 2,), generator=fixed(11))
    t = metric.sq_norm(x) ** (beta / 2)  # (n, 3)
    se = t.std(0) / math.sqrt(t.shape[0])
    within_se(t.mean(0), d / lam, se, "E‖u‖_P^β per row")


@pytest.mark.parametrize("beta", [1.0, 1.4, 2.0])
@pytest.mark.parametrize("geometry", ["dense", "block"])
def test_covariance_formula_matches_samples(beta, geometry):
    metric, d = (dense_metric(), 3) if geometry == "dense" else (block_metric(), 4)
    noise = GeneralizedGaussian(beta, 1.7, metric, dim=d)
    x = noise.sample((N_MC,), generator=fixed(20))
    products = x[:, :, None] * x[:, None, :]  # mean is 0 by symmetry
    se = products.std(0) / math.sqrt(N_MC)
    within_se(products.mean(0), noise.covariance(), se, f"Cov(u), {geometry}, β={beta}")
    cov = noise.covariance()
    close(noise.realized_rms(), (torch.diagonal(cov).sum() / d).sqrt(), None)
    # Σ times the scalar factor of DESIGN §2
    factor = (beta / 1.7) ** (2 / beta) * math.gamma((d + 2) / beta) / (d * math.gamma(d / beta))
    close(cov, factor * metric.covariance(d), None)


@pytest.mark.parametrize("beta", [0.6, 1.4, 2.0])
def test_radial_law_ks(beta):
    d, lam = 4, 1.8
    metric = block_metric()
    x = GeneralizedGaussian(beta, lam, metric, dim=d).sample((20_000,), generator=fixed(30))
    t = (lam / beta) * metric.sq_norm(x) ** (beta / 2)
    p = scipy.stats.kstest(t.numpy(), "gamma", args=(d / beta,)).pvalue
    assert p > 1e-3, f"(λ/β)‖u‖_P^β is not Gamma(d/β): KS p-value {p:.2e}"


# ------------------------------------------------------------------ densities
@pytest.mark.parametrize("beta", [1.0, 1.4, 2.0])
def test_log_prob_integrates_to_one_1d(beta):
    noise = GeneralizedGaussian(beta, 1.3, Metric.isotropic(torch.tensor(0.7, **F64)))

    def density(x):
        return math.exp(float(noise.log_prob(torch.tensor([x], **F64))))

    total = sum(scipy.integrate.quad(density, a, b, epsabs=1e-12)[0] for a, b in ((-np.inf, 0), (0, np.inf)))
    assert abs(total - 1) < 1e-7, f"∫q = {total}, β={beta}"


def sinh_grid_2d(half_width=6.0, n=1201):
    """Non-uniform grid x = sinh(t) on [−sinh 6, sinh 6]²: fine near 0, reaching heavy tails."""
    x = torch.sinh(torch.linspace(-half_width, half_width, n, **F64))
    pts = torch.stack(torch.meshgrid(x, x, indexing="ij"), -1)
    return x.numpy(), pts


def integrate_2d(log_density, x, pts):
    values = torch.exp(log_density(pts)).numpy()
    return np.trapezoid(np.trapezoid(values, x, axis=1), x)


@pytest.mark.parametrize("beta", [1.0, 1.4, 2.0])
def test_log_prob_integrates_to_one_2d(beta):
    noise = GeneralizedGaussian(beta, 1.3, block_metric())
    x, pts = sinh_grid_2d()
    total = integrate_2d(noise.log_prob, x, pts)
    assert abs(total - 1) < 2e-4, f"∫q = {total}, β={beta}"


def test_student_t_log_prob_integrates_to_one():
    for c in (1.0, 2.5):
        t = StudentT(torch.tensor(c, **F64), Metric.isotropic(torch.tensor(0.7, **F64)))
        total = scipy.integrate.quad(lambda x: math.exp(float(t.log_prob(torch.tensor([x], **F64)))), -np.inf, np.inf)[0]
        assert abs(total - 1) < 1e-7, f"1-D ∫q = {total}, c={c}"
    # 2-D, ν = 3: the mass beyond the grid (radius ≈ 200) is ~1e-7
    t = StudentT(torch.tensor(2.5, **F64), block_metric())
    x, pts = sinh_grid_2d()
    total = integrate_2d(t.log_prob, x, pts)
    assert abs(total - 1) < 2e-4, f"2-D ∫q = {total}"


def test_gaussian_log_prob_matches_multivariate_normal(gen):
    g, seed = gen
    cases = [(block_metric((3,)), 4), (dense_metric(), 3), (Metric.diagonal(torch.tensor([0.5, 2.0], **F64)), 2), (None, 5)]
    for metric, d in cases:
        noise = GeneralizedGaussian(torch.tensor(2.0, **F64), 1.0, metric, dim=d)
        cov = noise.covariance()
        close(cov, metric.covariance(d) if metric is not None else torch.eye(d, **F64), seed)
        mvn = torch.distributions.MultivariateNormal(torch.zeros(d, **F64), covariance_matrix=cov)
        u = 2 * torch.randn(7, *noise.batch_shape, d, generator=g, **F64)
        close(noise.log_prob(u), mvn.log_prob(u), seed)


def test_student_t_log_prob_matches_torch_distributions(gen):
    g, seed = gen
    u = 3 * torch.randn(50, 1, generator=g, **F64)
    cauchy = torch.distributions.Cauchy(torch.tensor(0.0, **F64), torch.tensor(1.0, **F64))
    close(StudentT(torch.tensor(1.0, **F64), dim=1).log_prob(u), cauchy.log_prob(u[:, 0]), seed)
    # 1-D: u = t_ν · sqrt(var/ν)
    c, var = 3.5, 0.6
    nu = 2 * c - 1
    t = torch.distributions.StudentT(torch.tensor(nu, **F64), scale=torch.tensor(math.sqrt(var / nu), **F64))
    ours = StudentT(torch.tensor(c, **F64), Metric.isotropic(torch.tensor(var, **F64)))
    close(ours.log_prob(u), t.log_prob(u[:, 0]), seed)


def test_student_t_sample_law_ks():
    c, var = 3.5, 0.6
    nu = 2 * c - 1
    ours = StudentT(torch.tensor(c, **F64), Metric.isotropic(torch.tensor(var, **F64)), dim=1)
    x = ours.sample((20_000,), generator=fixed(40))[:, 0]
    p = scipy.stats.kstest((x * math.sqrt(nu / var)).numpy(), "t", args=(nu,)).pvalue
    assert p > 1e-3, f"KS p-value {p:.2e}"


def test_student_t_covariance_matches_samples():
    d, nu = 4, 10.0
    metric = block_metric()
    t = StudentT(torch.tensor((nu + d) / 2, **F64), metric)
    assert float(t.nu(d)) == nu
    x = t.sample((N_MC,), generator=fixed(50), dim=d)
    products = x[:, :, None] * x[:, None, :]
    se = products.std(0) / math.sqrt(N_MC)
    expected = metric.covariance(d) / (nu - 2)
    close(t.covariance(d), expected, None)
    within_se(products.mean(0), expected, se, "Student-t Cov(u) = Σ/(ν−2)")


# ------------------------------------------------------------------ scores
def random_laws(g):
    beta = torch.cat([torch.tensor([1.0, 2.0], **F64), 0.3 + 1.7 * torch.rand(2, generator=g, **F64)])
    lam = 0.5 + 2 * torch.rand(4, generator=g, **F64)
    yield GeneralizedGaussian(beta, lam, block_metric((4,))), 4
    yield GeneralizedGaussian(beta[:, None], lam[:, None], dense_metric()), 3
    yield Laplace(lam, Metric.diagonal(0.5 + torch.rand(4, 2, generator=g, **F64))), 2
    yield GeneralizedGaussian(beta, lam), 3
    yield StudentT(3.0 + torch.rand(4, generator=g, **F64), block_metric((4,))), 4
    yield StudentT(torch.tensor(2.0, **F64)), 2


def test_score_is_gradient_of_log_prob(gen):
    g, seed = gen
    for noise, d in random_laws(g):
        u = torch.randn(6, *noise.batch_shape, d, generator=g, **F64).requires_grad_()
        (auto,) = torch.autograd.grad(noise.log_prob(u).sum(), u)
        close(noise.score(u), auto, seed)
        (from_potential,) = torch.autograd.grad(noise.potential(u).sum(), u)
        close(noise.score(u), -from_potential, seed)


def test_score_and_gradients_are_zero_not_nan_at_origin():
    beta = torch.tensor([0.5, 1.0, 1.4, 2.0], **F64, requires_grad=True)
    lam = torch.tensor([1.0, 2.0, 0.5, 1.0], **F64, requires_grad=True)
    noise = GeneralizedGaussian(beta, lam, block_metric())
    u = torch.zeros(4, 4, **F64, requires_grad=True)
    s = noise.score(u)
    assert torch.equal(s, torch.zeros_like(s))
    assert torch.equal(noise.potential(u), torch.zeros(4, **F64))
    grads = torch.autograd.grad(noise.log_prob(u).sum() + s.sum(), (u, beta, lam))
    assert all(torch.isfinite(gr).all() for gr in grads)
    assert torch.equal(grads[0], torch.zeros_like(u))
    t = StudentT(3.0, block_metric())
    assert torch.equal(t.score(torch.zeros(4, **F64)), torch.zeros(4, **F64))


def test_laplace_is_beta_one():
    metric = block_metric()
    lap, gg = Laplace(1.7, metric, dim=4), GeneralizedGaussian(1.0, 1.7, metric, dim=4)
    assert float(lap.beta) == 1.0
    u = torch.randn(5, 4, generator=fixed(2), **F64)
    close(lap.log_prob(u), gg.log_prob(u), None)
    assert torch.equal(lap.sample((3,), generator=fixed(3)), gg.sample((3,), generator=fixed(3)))


# ------------------------------------------------------------------ five-parameter tuple
@pytest.mark.parametrize("d", [2, 8])
def test_noise_params_realized_rms_matches_samples(d):
    p = NoiseParams(beta=1.4, lam=1.8, sigma=0.57, u=0.0, v=0.6)
    x = p.noise(d).sample((N_MC // 2,), generator=fixed(60 + d)).to(torch.float64)
    per_draw = x.pow(2).mean(-1)
    ms, se_ms = per_draw.mean(), per_draw.std() / math.sqrt(per_draw.shape[0])
    rms = ms.sqrt()
    target = p.realized_rms().to(torch.float64)
    within_se(rms, target, se_ms / (2 * rms), f"realized RMS, d={d}")
    close(p.noise(d).realized_rms().to(torch.float64), target, None, rtol=1e-5, atol=1e-7)


def test_noise_params_per_row(gen):
    g, seed = gen
    beta = 0.5 + 1.5 * torch.rand(3, generator=g, **F64)
    lam = 0.5 + 2 * torch.rand(3, generator=g, **F64)
    sigma = 0.1 + torch.rand(3, generator=g, **F64)
    u = 0.5 * torch.rand(3, generator=g, **F64) - 0.25
    v = 0.5 * torch.rand(3, generator=g, **F64) - 0.25
    p = NoiseParams(beta, lam, sigma, u, v)
    assert p.batch_shape == (3,)
    eta = p.eta()
    assert eta.shape == (3, 5)
    close(eta, torch.stack([beta, lam.log(), sigma.log(), u, v], -1), seed)
    close(p.realized_rms(), sigma * lam ** (-1 / beta), seed)
    noise = p.noise(6)
    close(noise.realized_rms(), p.realized_rms(), seed)
    assert noise.batch_shape == (3,) and noise.dim == 6
    close(p.metric(6).param, Metric.from_params(sigma, u, v, beta, 6).param, seed)
    assert noise.sample((2,), generator=g).shape == (2, 3, 6)
    # σ chosen for a target RMS gives that RMS
    r = 0.05 + torch.rand(3, generator=g, **F64)
    sigma_r = NoiseParams.sigma_for_rms(r, lam, beta)
    close(NoiseParams(beta, lam, sigma_r, u, v).realized_rms(), r, seed)


def test_noise_params_floats():
    p = NoiseParams(2.0, 4.0, 1.0)
    assert p.eta().shape == (5,)
    torch.testing.assert_close(p.eta(), torch.tensor([2.0, math.log(4.0), 0.0, 0.0, 0.0]))
    torch.testing.assert_close(p.realized_rms(), torch.tensor(0.5))
    assert NoiseParams.sigma_for_rms(0.5, 4.0, 2.0) == pytest.approx(1.0)
    # broadcasting: scalar β with per-row σ
    assert NoiseParams(1.4, 1.8, torch.tensor([0.2, 0.4]), 0.1, -0.2).eta().shape == (2, 5)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("beta", [0.0, -1.0, 2.5, float("nan")])
def test_bad_beta(beta):
    with pytest.raises(ValueError, match="beta must lie in"):
        GeneralizedGaussian(beta)
    with pytest.raises(ValueError, match="beta must lie in"):
        GeneralizedGaussian(torch.tensor([1.0, beta]))
    with pytest.raises(ValueError, match="beta must lie in"):
        NoiseParams(beta, 1.0, 1.0)


def test_nan_input_is_not_the_mode():
    """log_prob and potential of a NaN point are NaN (a NaN ‖u‖ is not the 0 of the mode)."""
    n = GeneralizedGaussian(1.4, 1.0, dim=2)
    u = torch.tensor([[float("nan"), 0.0], [0.0, 0.0]])
    assert torch.isnan(n.log_prob(u)[0]) and torch.isnan(n.potential(u)[0])
    assert torch.isfinite(n.log_prob(u)[1]) and n.potential(u)[1] == 0


def test_parameters_outside_the_dtype_range_are_refused():
    """Infinite λ or σ, and a float32 σ whose covariance scale (σ/c)² (or its square, the block's
    determinant) is not a normal float32, raise instead of giving NaN draws and wrong densities."""
    with pytest.raises(ValueError, match="lam must be > 0 and finite, got inf"):
        GeneralizedGaussian(1.0, math.inf)
    with pytest.raises(ValueError, match="sigma must be > 0 and finite, got inf"):
        NoiseParams(1.0, 1.0, math.inf)
    for sigma in (1e-20, 1e20):
        with pytest.raises(ValueError, match=r"sigma = .* outside the normal torch.float32 range.*float64"):
            NoiseParams(2.0, 1.0, sigma).noise(2)
    # float64 holds them: the density at σ is right
    n = NoiseParams(2.0, 1.0, torch.tensor(1e-20, dtype=torch.float64)).noise(2)
    assert math.isfinite(float(n.log_prob(torch.tensor([1e-20, 0.0], dtype=torch.float64))))


def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="lam must be > 0"):
        GeneralizedGaussian(1.0, 0.0)
    with pytest.raises(ValueError, match="lam must be > 0"):
        Laplace(torch.tensor([1.0, -2.0]))
    with pytest.raises(TypeError, match="beta must be a float"):
        GeneralizedGaussian("1.0")
    with pytest.raises(TypeError, match="lam must be a floating-point tensor"):
        GeneralizedGaussian(1.0, torch.tensor(1))
    with pytest.raises(TypeError, match="metric must be an etweedie.geometry.Metric"):
        GeneralizedGaussian(1.0, 1.0, torch.eye(2))
    with pytest.raises(ValueError, match="parameter batch shapes must broadcast"):
        GeneralizedGaussian(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="dim must match the metric's dimension 3"):
        GeneralizedGaussian(1.0, 1.0, dense_metric(), dim=4)
    with pytest.raises(ValueError, match="block size k=2, which must divide d=3"):
        GeneralizedGaussian(1.0, 1.0, block_metric(), dim=3)
    with pytest.raises(TypeError, match="dim must be a positive int"):
        GeneralizedGaussian(1.0, dim=2.0)
    noise = GeneralizedGaussian(1.0, 1.0, block_metric())
    with pytest.raises(ValueError, match="dim is needed"):
        noise.sample((2,), generator=fixed(0))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        noise.sample((2,), generator=None, dim=4)
    with pytest.raises(TypeError, match="sample_shape must be a tuple of ints"):
        noise.sample("ab", generator=fixed(0), dim=4)
    with pytest.raises(ValueError, match="block size k=2, which must divide d=3"):
        noise.log_prob(torch.zeros(3, **F64))
    with pytest.raises(ValueError, match="u must have last dimension d=3"):
        GeneralizedGaussian(1.0, 1.0, dense_metric()).score(torch.zeros(4, **F64))
    with pytest.raises(TypeError, match="u must be a floating-point tensor"):
        noise.potential(torch.zeros(4, dtype=torch.long))
    # Student-t: c > d/2 is checked once d is known
    t = StudentT(1.0, block_metric())
    with pytest.raises(ValueError, match=r"c must be > d/2 = 2"):
        t.log_prob(torch.zeros(4, **F64))
    with pytest.raises(ValueError, match=r"c must be > d/2 = 2"):
        t.sample((2,), generator=fixed(0), dim=4)
    with pytest.raises(ValueError, match=r"c must be > d/2 = 1"):
        StudentT(1.0, dim=2)
    with pytest.raises(ValueError, match="c must be > 0"):
        StudentT(-1.0)
    with pytest.raises(ValueError, match="c must be > d/2 \\+ 1"):
        StudentT(2.5, dim=4).covariance()
    # the tuple
    with pytest.raises(ValueError, match="lam must be > 0"):
        NoiseParams(1.4, 0.0, 0.5)
    with pytest.raises(ValueError, match="sigma must be > 0"):
        NoiseParams(1.4, 1.0, torch.tensor([0.5, -0.1]))
    with pytest.raises(ValueError, match=r"\(u, v\) must lie in the open unit disk"):
        NoiseParams(1.4, 1.0, 0.5, 0.6, 0.8)
    with pytest.raises(TypeError, match="sigma must be a float"):
        NoiseParams(1.4, 1.0, None)
    with pytest.raises(ValueError, match="parameter batch shapes must broadcast"):
        NoiseParams(torch.full((3,), 1.4), 1.0, torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="d must be an even integer"):
        NoiseParams(1.4, 1.0, 0.5).noise(3)
    with pytest.raises(ValueError, match="r must be > 0"):
        NoiseParams.sigma_for_rms(0.0, 1.0, 1.4)


def test_log_normalizer_checks_d():
    from etweedie import GeneralizedGaussian, StudentT

    for law in (GeneralizedGaussian(1.0), StudentT(3.0)):
        for d in (0, 2.5):
            with pytest.raises((ValueError, TypeError), match="dim must be a positive int"):
                law.log_normalizer(d)


def test_shape_and_dtype_mistakes_are_named_errors():
    from etweedie import GeneralizedGaussian, Metric

    law = GeneralizedGaussian(torch.tensor([1.0, 1.5, 2.0]), 1.0, dim=2)
    with pytest.raises(ValueError, match="must broadcast with the law's batch shape"):
        law.log_prob(torch.zeros(4, 2))
    with pytest.raises(TypeError, match="beta must be float32 or float64 for a noise law"):
        GeneralizedGaussian(torch.tensor(1.2, dtype=torch.bfloat16), dim=2)
    with pytest.raises(ValueError, match="must broadcast to one batch shape"):
        Metric.from_params(torch.ones(3), torch.zeros(4), 0.0, 1.4, 2)
    with pytest.raises(ValueError, match="d must be an int >= 1"):
        Metric.isotropic(1.0).covariance(-1)
