"""Noise laws: sampling, normalization, moments, scores, and the five-parameter tuple.

Statistical checks use fixed seeds (they cannot flake) and tolerances of 5 standard errors
computed from the samples; exact identities use fresh seeds reported on failure.  At the
edges (extreme magnitudes, β near 0, d = 784) the references are hand-written: float64 formulas
evaluated on the float32-rounded inputs, and mpmath (50 digits) for the lgamma-based constants.
"""

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch

from etweedie.geometry import Metric, scale_constant, shape_matrix
from etweedie.noise import GeneralizedGaussian, Laplace, NoiseParams, StudentT

try:  # 50-digit references for the lgamma-based constants and the extreme-magnitude checks
    import mpmath
except ImportError:
    mpmath = None
else:
    mpmath.mp.dps = 50
needs_mpmath = pytest.mark.skipif(mpmath is None, reason="needs mpmath for the 50-digit references")

F64 = dict(dtype=torch.float64)
N_MC = 200_000
S32 = torch.tensor([[1.3, 0.4], [0.4, 0.7]])  # a float32 block


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


def mp(x):
    """A float (or 0-d tensor) as an exact mpmath number."""
    return mpmath.mpf(float(x))


def assert_rel(got, want, rtol, what):
    got, want = float(got), float(want)
    assert math.isfinite(got) and abs(got - want) <= rtol * abs(want), f"{what}: got {got!r}, want {want!r}"


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


def test_draws_reproducible_in_both_dtypes_and_empty_batches():
    for dtype in (torch.float32, torch.float64):
        for law in (GeneralizedGaussian(torch.tensor([0.7, 1.9], dtype=dtype), 1.2, Metric.block(S32.to(dtype)), dim=6),
                    StudentT(torch.tensor([3.6, 9.0], dtype=dtype), Metric.block(S32.to(dtype)), dim=6)):
            a = law.sample((5,), generator=fixed(11))
            assert a.dtype == dtype and a.shape == (5, 2, 6)
            assert torch.equal(a, law.sample((5,), generator=fixed(11)))
    empty = GeneralizedGaussian(torch.ones(0), 1.0, Metric.isotropic(torch.ones(0)), dim=3)
    assert empty.sample((4,), generator=fixed(0)).shape == (4, 0, 3)
    assert empty.score(torch.zeros(2, 0, 3)).shape == (2, 0, 3)
    assert empty.log_prob(torch.zeros(0, 3)).shape == (0,) and empty.realized_rms().shape == (0,)
    t = StudentT(torch.full((0,), 3.0), dim=3)
    assert t.sample((2,), generator=fixed(0)).shape == (2, 0, 3) and t.log_normalizer(3).shape == (0,)


def test_non_contiguous_inputs_and_parameters():
    g = fixed(12)
    S = torch.randn(3, 2, 2, generator=g, **F64)
    S = S @ S.mT + torch.eye(2, **F64)
    S_nc = S.mT  # symmetric values, transposed strides
    assert not S_nc.is_contiguous()
    beta = torch.tensor([[0.6, 0.0], [1.4, 0.0], [2.0, 0.0]], **F64)[:, 0]
    assert not beta.is_contiguous()
    u = torch.randn(5, 3, 8, generator=g, **F64)[..., ::2]
    pairs = ((GeneralizedGaussian(beta, 1.3, Metric.block(S_nc)), GeneralizedGaussian(beta.contiguous(), 1.3, Metric.block(S))),
             (StudentT(beta + 3, Metric.block(S_nc)), StudentT(beta.contiguous() + 3, Metric.block(S))))
    for law, ref in pairs:
        for f in ("log_prob", "score", "potential"):
            torch.testing.assert_close(getattr(law, f)(u), getattr(ref, f)(u.contiguous()), rtol=1e-13, atol=0)
        assert torch.equal(law.sample((3,), generator=fixed(1), dim=4), ref.sample((3,), generator=fixed(1), dim=4))


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


def ks_radial(law, x, P_diag, d):
    """KS p-value of (λ/β)‖x‖_P^β against Gamma(d/β) (isotropic or diagonal Σ), in float64."""
    beta, lam = float(law.beta), float(law.lam)
    log_norm = 0.5 * torch.log((x.double() ** 2 * P_diag).sum(-1))
    t = torch.exp(math.log(lam / beta) + beta * log_norm)
    return scipy.stats.kstest(t.numpy(), "gamma", args=(d / beta,)).pvalue


def test_sample_finite_where_the_radius_overflows_float32():
    """R = ((β/λ)G)^{1/β} ≈ 1e40 overflows float32 while u = R Σ^{1/2} U ≈ 1e30 does not."""
    law = GeneralizedGaussian(0.5, 1e-20, Metric.isotropic(1e-20), dim=2)
    x = law.sample((4000,), generator=fixed(7))
    assert torch.isfinite(x).all()
    p = ks_radial(law, x, 1 / float(torch.tensor(1e-20)), 2)
    assert p > 1e-3, f"KS p-value {p:.2e}"


@pytest.mark.parametrize("beta,lam,d,dtype", [
    (0.05, 1.0, 2, torch.float64), (0.05, 1.0, 2, torch.float32), (0.05, 1.0, 784, torch.float64),
    (1.0, 1e-30, 784, torch.float32), (2.0, 1e30, 784, torch.float32), (1.4, 1.8, 784, torch.float32),
])
def test_radial_law_at_extreme_parameters(beta, lam, d, dtype):
    var = torch.tensor(0.7, dtype=dtype)
    law = GeneralizedGaussian(torch.tensor(beta, dtype=dtype), lam, Metric.isotropic(var), dim=d)
    x = law.sample((3000,), generator=fixed(8))
    assert x.dtype == dtype and torch.isfinite(x).all()
    p = ks_radial(law, x, 1 / float(var), d)
    assert p > 1e-3, f"KS p-value {p:.2e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_realized_rms_at_image_dimension(dtype):
    """Samples of the five-parameter law at d = 784 have per-coordinate RMS σ λ^{−1/β}."""
    p = NoiseParams(torch.tensor(0.3, dtype=dtype), 2.5, 0.7, 0.5, -0.3)
    x = p.noise(784).sample((3000,), generator=fixed(9)).double()
    per_draw = x.pow(2).mean(-1)
    ms, se = per_draw.mean(), per_draw.std() / math.sqrt(per_draw.shape[0])
    target = float(p.realized_rms()) ** 2
    assert abs(float(ms) - target) < 5 * float(se), f"mean square {float(ms)} vs {target} (5 SE = {5 * float(se)})"
    assert_rel(p.noise(784).realized_rms(), p.realized_rms(), 1e-6 if dtype != torch.float64 else 1e-13, "law vs tuple RMS")


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


def radial_mass(law, d, var, t_mode, width, right_decay=math.inf):
    """∫ q over R^d for a law with Σ = var·I: ∫ q(e^t e₁) |S^{d−1}| e^{d t} dt, by composite
    Gauss–Legendre quadrature (160 panels × 20 nodes, one log_prob call).

    The integrand falls like e^{d t} to the left of its peak, like e^{−right_decay·t} to the
    right (ν for the Student-t) and like exp(−e^{βt}/…) for the generalized Gaussian."""
    left, right = max(40 * width, 40 / d), max(40 * width, 40 / right_decay)
    edges = np.linspace(t_mode - left, t_mode + right, 161)
    nodes, weights = np.polynomial.legendre.leggauss(20)
    half = 0.5 * np.diff(edges)[:, None]
    t = torch.from_numpy((0.5 * (edges[:-1] + edges[1:])[:, None] + half * nodes).ravel())
    w = torch.from_numpy((half * weights).ravel())
    u = torch.zeros(t.shape[0], d, **F64)
    u[:, 0] = torch.exp(t)
    log_area = math.log(2) + 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d)
    return float((w * torch.exp(law.log_prob(u) + log_area + d * t)).sum())


@pytest.mark.parametrize("d", [1, 2, 784])
@pytest.mark.parametrize("beta,lam", [(0.05, 1.0), (1.0, 1e-30), (1.0, 1e30), (2.0, 1e30), (2.0, 1e-30)])
def test_gg_density_integrates_to_one_in_any_dimension(beta, lam, d):
    var = 0.7
    law = GeneralizedGaussian(torch.tensor(beta, **F64), lam, Metric.isotropic(torch.tensor(var, **F64)))
    # (λ/β) r^β var^{−β/2} ~ Gamma(d/β): the integrand peaks near r^β = d var^{β/2}/λ
    t_mode = (math.log(d / lam) + 0.5 * beta * math.log(var)) / beta
    width = 0.5 / (beta * math.sqrt(d / beta))
    total = radial_mass(law, d, var, t_mode, width)
    assert abs(total - 1) < 1e-8, f"∫q = {total}"


@pytest.mark.parametrize("d", [1, 2, 784])
@pytest.mark.parametrize("excess", [0.5, 3.0, 1e8, 1e20])
def test_student_t_density_integrates_to_one(d, excess):
    c = d / 2 + excess
    var = 0.7
    law = StudentT(torch.tensor(c, **F64), Metric.isotropic(torch.tensor(var, **F64)))
    t_mode = 0.5 * math.log(var * d / (2 * c - d)) if excess > 1 else 0.5 * math.log(var * d)
    width = 0.5 / math.sqrt(min(d, 2 * excess)) if excess > 1 else 2.0
    total = radial_mass(law, d, var, t_mode, width, right_decay=2 * c - d)
    assert abs(total - 1) < 1e-7, f"∫q = {total}, c = {c}"


# ------------------------------------------------------------------ exact constants (mpmath)

def mp_log_normalizer_gg(beta, lam, d, half_logdet):
    beta, lam = mp(beta), mp(lam)
    return (mp(half_logdet) + mpmath.log(2) + mpmath.mpf(d) / 2 * mpmath.log(mpmath.pi) - mpmath.loggamma(mpmath.mpf(d) / 2)
            + mpmath.loggamma(d / beta) - mpmath.log(beta) - (d / beta) * mpmath.log(lam / beta))


def mp_moment_factor(beta, lam, d):
    beta, lam = mp(beta), mp(lam)
    return (beta / lam) ** (2 / beta) * mpmath.gamma((d + 2) / beta) / (d * mpmath.gamma(d / beta))


@needs_mpmath
@pytest.mark.parametrize("d", [2, 784])
@pytest.mark.parametrize("beta", [0.05, 0.3, 1.0, 1.4, 2.0])
def test_gg_constants_against_mpmath(beta, d):
    """log Z, Cov and the realized RMS: float64 to 1e-12, float32 rounded from the exact value
    (the float32 lgamma difference was off by 5e-4 at d = 784, β = 0.3)."""
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 3e-7)):
        for lam in (1e-30, 1.8, 1e30):
            var = Metric.isotropic(torch.tensor(0.5, dtype=dtype))
            law = GeneralizedGaussian(torch.tensor(beta, dtype=dtype), lam, var, dim=d)
            b, l, var = float(law.beta), float(law.lam), float(law.metric.param)
            what = f"{dtype}, beta={beta}, lam={lam:g}, d={d}"
            want = mp_log_normalizer_gg(b, l, d, 0.5 * d * math.log(var))
            assert_rel(law.log_normalizer(d), want, rtol if dtype == torch.float64 else 1e-6, f"log Z, {what}")
            factor = mp_moment_factor(b, l, d)
            rms = mpmath.sqrt(factor * mp(var))
            hi = 3e38 if dtype != torch.float64 else 1e300
            if 1 / hi < rms < hi:
                assert_rel(law.realized_rms(), rms, rtol, f"realized RMS, {what}")
            if d == 2 and 1 / hi < factor * mp(var) < hi:
                assert_rel(law.covariance()[0, 0], factor * mp(var), rtol, f"Cov, {what}")


@needs_mpmath
def test_gg_moments_finite_where_the_factor_overflows_float32():
    """(β/λ)^{2/β}·… = 3e40 overflows float32 but the RMS (1.7e20·√var) and Cov do not."""
    law = GeneralizedGaussian(1.0, 1e-20, Metric.isotropic(1e-20), dim=2)
    var = float(torch.tensor(1e-20))
    factor = mp_moment_factor(1.0, float(torch.tensor(1e-20)), 2)
    assert_rel(law.realized_rms(), mpmath.sqrt(factor * var), 3e-7, "realized RMS")
    assert_rel(law.covariance()[0, 0], factor * var, 3e-7, "Cov")
    assert_rel(GeneralizedGaussian(1.0, 1e-20, dim=2).realized_rms(), mpmath.sqrt(factor), 3e-7, "realized RMS, Σ = I")


@needs_mpmath
@pytest.mark.parametrize("d", [2, 784])
def test_student_t_log_normalizer_for_large_c(d):
    """lgamma(c − d/2) − lgamma(c) read 0 for c = 1e8 in float32 and c = 1e20 in float64."""
    for c in (d / 2 + 0.25, d / 2 + 150.0, 1e4, 1e8, 1e20, 1e30):
        for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
            law = StudentT(torch.tensor(c, dtype=dtype), dim=d)
            cc = mp(law.c)
            want = mpmath.mpf(d) / 2 * mpmath.log(mpmath.pi) + mpmath.loggamma(cc - mpmath.mpf(d) / 2) - mpmath.loggamma(cc)
            assert_rel(law.log_normalizer(d), want, rtol, f"{dtype}, c={c:g}, d={d}")


@needs_mpmath
def test_scale_constant_and_shape_matrix_against_closed_forms():
    g = fixed(3)
    for beta in (0.05, 0.3, 1.0, 1.4, 2.0):
        for d in (1, 2, 784):
            c2 = mp(beta) ** (2 / mp(beta)) * mpmath.gamma((d + 2) / mp(beta)) / (d * mpmath.gamma(d / mp(beta)))
            assert_rel(scale_constant(torch.tensor(beta, **F64), d), mpmath.sqrt(c2), 1e-12, f"c, beta={beta}, d={d}")
    angle = 2 * math.pi * torch.rand(50, generator=g, **F64)
    radius = torch.rand(50, generator=g, **F64).clamp_max(0.999999)
    u, v = radius * torch.cos(angle), radius * torch.sin(angle)
    S = shape_matrix(u, v)
    eig = torch.linalg.eigvalsh(S)
    torch.testing.assert_close(torch.diagonal(S, dim1=-2, dim2=-1).sum(-1), torch.full((50,), 2.0, **F64))
    torch.testing.assert_close(torch.linalg.det(S), 1 - u * u - v * v)
    torch.testing.assert_close(eig, torch.stack([1 - radius, 1 + radius], -1))
    assert bool((eig > 0).all())


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


def hand_gg(u, beta, lam, P):
    """(potential, score) of the generalized Gaussian in float64, by the formula of DESIGN §1."""
    u = u.double()
    pu = u @ P.T
    norm = (u * pu).sum(-1).sqrt()
    return (lam / beta) * norm**beta, -lam * norm[..., None] ** (beta - 2) * pu


def float32_metrics():
    yield None, torch.eye(4, **F64)
    yield Metric.isotropic(0.5), torch.eye(4, **F64) / float(torch.tensor(0.5))
    yield Metric.block(S32), torch.linalg.inv(torch.block_diag(S32, S32).double())


@pytest.mark.parametrize("beta", [0.5, 1.0, 1.4, 2.0])
def test_gg_score_and_potential_at_extreme_magnitudes_float32(beta):
    """‖u‖²_P overflowed float32 from |u| ≈ 2e19 on (potential inf, score 0 where both are
    finite) and underflowed below 1e-19 (score 0 at u ≠ 0: for β = 1 its size is λ)."""
    lam = 1.7
    direction = torch.tensor([0.6, -0.3, 0.5, 0.2])
    b, l = float(torch.tensor(beta)), float(torch.tensor(lam))  # the float32-rounded parameters
    big = torch.finfo(torch.float32).max
    for metric, P in float32_metrics():
        law = GeneralizedGaussian(beta, lam, metric, dim=4)
        for mag in (1e-30, 1e-20, 1e-5, 1.0, 1e20, 1e30):
            u = (mag * direction).float()
            want_pot, want_score = hand_gg(u, b, l, P)
            pot, score = law.potential(u), law.score(u)
            what = f"beta={beta}, |u|={mag:g}, metric={metric}"
            if want_score.abs().max() < big:
                torch.testing.assert_close(score.double(), want_score, rtol=2e-5, atol=2e-5 * float(want_score.abs().max()),
                                           msg=lambda m: f"score, {what}: {m}")
            if 1e-37 < want_pot < big:
                assert_rel(pot, want_pot, 2e-5, f"potential, {what}")
            elif want_pot >= big:
                assert pot == math.inf, what


@needs_mpmath
def test_student_t_at_extreme_magnitudes_float32():
    """log(1 + ‖u‖²_P) read inf from |u| ≈ 2e19 on (the potential is ≈ 2c log ‖u‖, finite)."""
    direction = torch.tensor([0.6, -0.3, 0.5, 0.2])
    c = 3.5
    for metric, P in float32_metrics():
        law = StudentT(c, metric, dim=4)
        for mag in (1e-30, 1e-5, 1.0, 1e20, 1e30):
            u = (mag * direction).float()
            ud = u.double()
            pu = ud @ P.T
            q = mpmath.mpf(0)
            for a, b in zip(ud.tolist(), pu.tolist()):
                q += mp(a) * mp(b)
            want_pot = float(c * mpmath.log1p(q))
            want_score = -2 * c * pu / (1 + float(q))
            what = f"|u|={mag:g}, metric={metric}"
            if want_pot > 1e-37:
                assert_rel(law.potential(u), want_pot, 2e-6, f"potential, {what}")
            torch.testing.assert_close(law.score(u).double(), want_score, rtol=2e-5, atol=2e-5 * float(want_score.abs().max()),
                                       msg=lambda m: f"score, {what}: {m}")


@pytest.mark.parametrize("make", [lambda: GeneralizedGaussian(0.7, 1.3, Metric.block(S32), dim=4),
                                  lambda: StudentT(3.5, Metric.block(S32), dim=4)])
def test_nan_in_nan_out_inf_in_inf_out(make):
    """Documented: a NaN coordinate gives NaN potential, log_prob and score (it is not the
    mode); an infinite one an infinite potential; u = 0 gives a finite log_prob and score 0."""
    law = make()
    u = torch.tensor([[float("nan"), 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0, 0.0]])
    pot, lp, score = law.potential(u), law.log_prob(u), law.score(u)
    assert torch.isnan(pot[0]) and torch.isnan(lp[0]) and torch.isnan(score[0]).all()
    assert pot[1] == 0 and torch.isfinite(lp[1]) and torch.equal(score[1], torch.zeros(4))
    assert pot[2] == math.inf and lp[2] == -math.inf


def test_score_is_gradient_at_extreme_magnitudes_float64():
    g = fixed(5)
    for beta in (0.3, 1.0, 1.7):
        law = GeneralizedGaussian(torch.tensor(beta, **F64), 0.8, Metric.block(S32.double()), dim=4)
        for mag in (1e-150, 1e-3, 1e150):
            u = (mag * torch.randn(3, 4, generator=g, **F64)).requires_grad_()
            (auto,) = torch.autograd.grad(law.log_prob(u).sum(), u)
            torch.testing.assert_close(law.score(u), auto, rtol=1e-10, atol=0)


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


@needs_mpmath
def test_noise_params_rms_and_sigma_for_rms_where_a_power_overflows():
    """λ^{−1/β} = 1e60 overflows float32 where σ λ^{−1/β} = 1e30 does not."""
    p = NoiseParams(0.5, 1e-30, 1e-30)
    want = float(mp(torch.tensor(1e-30)) * mp(torch.tensor(1e-30)) ** -2)
    assert_rel(p.realized_rms(), want, 3e-7, "realized RMS")
    r, lam = torch.tensor(1e-30), torch.tensor(1e30)
    assert_rel(NoiseParams.sigma_for_rms(r, lam, torch.tensor(0.5)), mp(r) * mp(lam) ** 2, 3e-7, "sigma_for_rms")
    # floats: λ^{1/β} = 1e600 is beyond a float, σ = 1e300 is not; 1e-30·1e600 is a named error
    assert NoiseParams.sigma_for_rms(1e-300, 1e30, 0.05) == pytest.approx(1e300, rel=1e-12)
    with pytest.raises(ValueError, match="sigma = r·lam\\^\\(1/beta\\) .* overflows a float"):
        NoiseParams.sigma_for_rms(1e-30, 1e30, 0.05)
    assert NoiseParams.sigma_for_rms(0.5, 4.0, 2.0) == 1.0


def test_eta_round_trip_at_extreme_parameters():
    beta = torch.tensor([0.05, 1.0, 2.0, 1.3], **F64)
    lam = torch.tensor([1e-30, 1e30, 1.0, 2.5], **F64)
    sigma = torch.tensor([1e30, 1e-30, 0.3, 1.0], **F64)
    u = torch.tensor([0.0, 0.7, -0.99, 0.3], **F64)
    v = torch.tensor([0.0, -0.7, 0.1, 0.4], **F64)
    p = NoiseParams(beta, lam, sigma, u, v)
    q = NoiseParams.from_eta(p.eta())
    for name in ("beta", "lam", "sigma", "u", "v"):
        torch.testing.assert_close(getattr(q, name), getattr(p, name), rtol=1e-14, atol=0)
    torch.testing.assert_close(q.eta(), p.eta(), rtol=0, atol=0)


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


def test_student_t_needs_c_above_half_d_at_image_dimension():
    with pytest.raises(ValueError, match=r"c must be > d/2 = 392"):
        StudentT(392.0, dim=784)
    StudentT(392.5, dim=784)



@pytest.mark.parametrize(
    "metric, dtype, error, match",
    [
        pytest.param(lambda: Metric.isotropic(torch.tensor(1e-300, **F64)), torch.float32, ValueError,
                     r"Metric.to\(torch.float32\).*var does not fit.*got variances in \[1e-300", id="isotropic-to-zero"),
        pytest.param(lambda: Metric.block(torch.tensor([[1e-300, 0.0], [0.0, 1.0]], **F64)), torch.float32, ValueError,
                     r"S does not fit torch.float32", id="block-to-zero"),
        pytest.param(lambda: Metric.diagonal(torch.tensor([1e5, 1.0])), torch.float16, ValueError,
                     r"var does not fit torch.float16", id="diagonal-to-inf"),
        pytest.param(lambda: Metric.dense(torch.eye(2)), torch.int32, TypeError,
                     "dtype must be floating point, got torch.int32", id="dense-to-int"),
    ],
)
def test_metric_cast_to_a_narrower_dtype_checks_the_range(metric, dtype, error, match):
    """A cast that rounds a variance to 0 or inf gave P = inf (and NaN) silently."""
    with pytest.raises(error, match=match):
        metric().to(dtype)


def test_metric_cast_that_fits_keeps_the_values():
    m = Metric.block(S32.double()).to(dtype=torch.float32, device="cpu")
    assert m.dtype == torch.float32 and torch.equal(m.param, S32)
    assert Metric.isotropic(2.0).to(torch.float64).dtype == torch.float64


@pytest.mark.parametrize(
    "beta, d, error, match",
    [
        # β = 0 gave NaN and β = 2.5 a number silently
        *(pytest.param(beta, 2, ValueError, r"beta must lie in \(0, 2\]", id=f"beta-{name}")
          for name, beta in (("0", 0.0), ("2.5", 2.5), ("nan", float("nan")), ("tensor-3", torch.tensor([1.0, 3.0])))),
        # d = 0 gave 'math domain error', d = 2.5 a number
        pytest.param(1.0, 0, ValueError, "d must be an int >= 1, got 0", id="d-0"),
        *(pytest.param(1.0, d, TypeError, "d must be an int >= 1", id=f"d-{name}")
          for name, d in (("2.5", 2.5), ("bool", True), ("str", "2"))),
    ],
)
def test_scale_constant_names_bad_arguments(beta, d, error, match):
    with pytest.raises(error, match=match):
        scale_constant(beta, d)


def test_scale_constant_takes_a_numpy_int_d():
    assert float(scale_constant(1.0, np.int64(2))) == pytest.approx(math.sqrt(3))
