"""Eight Gaussians: densities, analytic noisy scores, exact and SIR posterior samplers.

The checks form a chain from first principles: the noisy density is the numerical
convolution of the clean one with the noise; the noisy score is its autograd gradient; the
posterior mean is Tweedie's y + s²∇log p_Y(y); the exact sampler's moments match it; and the
Energy-Tweedie score (β = 2) on exact posterior draws and the IS oracle both recover the
analytic score.  Statistical checks use fixed seeds (they cannot flake) and 5-SE tolerances
computed from the samples.
"""

import math

import pytest
import torch

import etweedie
from etweedie.data import EightGaussians, posterior_sample_sir
from etweedie.data.ring import _sir_log_weights
from etweedie.geometry import Metric
from etweedie.noise import GeneralizedGaussian, NoiseParams, StudentT

F64 = dict(dtype=torch.float64)


def fixed(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def ring():
    return EightGaussians()


def queries(ring, n, s, seed):
    """Noisy queries y = x + s ξ from the ring, float64."""
    g = fixed(seed)
    x, _ = ring.sample(n, g, dtype=torch.float64)
    return x + s * torch.randn(n, 2, generator=g, **F64)


def analytic_posterior_moments(ring, y, s):
    """Posterior mean and covariance of X | y, written out independently of the module."""
    tau2, s2 = ring.std**2, s**2
    angle = torch.arange(ring.n_modes, **F64) * 2 * math.pi / ring.n_modes
    mu = ring.radius * torch.stack([angle.cos(), angle.sin()], -1)
    logits = -((y[:, None, :] - mu) ** 2).sum(-1) / (2 * (tau2 + s2))
    w = torch.softmax(logits, -1)  # (B, K)
    m = (s2 * mu + tau2 * y[:, None, :]) / (tau2 + s2)  # (B, K, 2)
    v = tau2 * s2 / (tau2 + s2)
    mean = (w[..., None] * m).sum(1)
    second = v * torch.eye(2, **F64) + (w[..., None, None] * m[..., :, None] * m[..., None, :]).sum(1)
    return mean, second - mean[:, :, None] * mean[:, None, :]


# ------------------------------------------------------------------ the clean ring
def test_sample_shapes_labels_and_reproducibility(ring):
    state = torch.get_rng_state()
    x, labels = ring.sample(4000, fixed(3))
    assert torch.equal(torch.get_rng_state(), state), "sample must not touch the global RNG"
    assert x.shape == (4000, 2) and x.dtype == torch.float32 and labels.shape == (4000,)
    assert int(labels.min()) >= 0 and int(labels.max()) < 8
    x2, labels2 = ring.sample(4000, fixed(3))
    assert torch.equal(x, x2) and torch.equal(labels, labels2)
    mu = ring.means()
    for k in range(8):
        pts = x[labels == k]
        se = ring.std / math.sqrt(len(pts))
        assert (pts.mean(0) - mu[k]).abs().max() < 5 * se
    assert ring.sample(0, fixed(0))[0].shape == (0, 2)


def test_ring_components_have_the_documented_means_std_and_weights():
    ring = EightGaussians(radius=3.0, std=0.3, n_modes=5)
    n = 50_000
    x, labels = ring.sample(n, fixed(1), dtype=torch.float64)
    freq = torch.bincount(labels, minlength=5).double() / n
    assert ((freq - 0.2).abs() <= 5 * math.sqrt(0.2 * 0.8 / n)).all()
    for k in range(5):
        pts = x[labels == k]
        mu = 3.0 * torch.tensor([math.cos(2 * math.pi * k / 5), math.sin(2 * math.pi * k / 5)], **F64)
        assert ((pts.mean(0) - mu).abs() <= 5 * 0.3 / math.sqrt(len(pts))).all()
        # per-coordinate variance τ² (SE of a sample variance: τ² sqrt(2/(m−1)))
        assert ((pts.var(0) - 0.09).abs() <= 5 * 0.09 * math.sqrt(2 / (len(pts) - 1))).all()


def test_log_prob_is_normalized(ring):
    h = 0.01
    grid = torch.arange(-3.5, 3.5, h, **F64)
    pts = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1)
    total = ring.log_prob(pts).exp().sum() * h * h
    assert abs(float(total) - 1.0) < 1e-6


def test_noisy_log_prob_is_the_convolution(ring):
    # p_Y(y) = ∫ p(x) N(y; x, s²I) dx by quadrature on a grid, for a few y.
    s, h = 0.3, 0.01
    grid = torch.arange(-4.0, 4.0, h, **F64)
    x = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    px = ring.log_prob(x).exp()
    y = torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.2, 1.5], [-0.5, 2.4]], **F64)
    kernel = torch.exp(-((y[:, None, :] - x) ** 2).sum(-1) / (2 * s * s)) / (2 * math.pi * s * s)
    conv = (kernel * px).sum(-1) * h * h
    torch.testing.assert_close(ring.noisy_log_prob(y, s), conv.log(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("s", [0.0, 0.1, 0.5, 2.0])
def test_noisy_score_is_autograd_of_noisy_log_prob(ring, s):
    y = (queries(ring, 64, max(s, 0.1), seed=1) * 1.5).requires_grad_(True)  # some far from the ring
    (grad,) = torch.autograd.grad(ring.noisy_log_prob(y, s).sum(), y)
    torch.testing.assert_close(ring.noisy_score(y.detach(), s), grad, rtol=1e-10, atol=1e-10)
    if s == 0.0:
        torch.testing.assert_close(ring.score(y.detach()), grad, rtol=1e-10, atol=1e-10)


def test_noisy_score_per_query_sigma(ring):
    y = queries(ring, 6, 0.3, seed=2)
    s = torch.linspace(0.1, 0.6, 6, **F64)
    rows = torch.stack([ring.noisy_score(y[i], float(s[i])) for i in range(6)])
    torch.testing.assert_close(ring.noisy_score(y, s), rows, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ exact posterior
@pytest.mark.parametrize("s", [0.1, 0.5])
def test_posterior_mean_is_tweedie(ring, s):
    y = queries(ring, 32, s, seed=4)
    tweedie = y + s * s * ring.noisy_score(y, s)
    torch.testing.assert_close(ring.posterior_mean(y, s), tweedie, rtol=1e-12, atol=1e-12)
    mean, _ = analytic_posterior_moments(ring, y, s)
    torch.testing.assert_close(mean, tweedie, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("s", [0.1, 0.5, 1.0])
def test_exact_posterior_moments(ring, s):
    n = 20_000
    y = queries(ring, 16, s, seed=5)
    x = ring.posterior_sample(y, s, n, fixed(6))
    assert x.shape == (16, n, 2) and x.dtype == torch.float64
    mean, cov = analytic_posterior_moments(ring, y, s)
    se_mean = (torch.diagonal(cov, dim1=-2, dim2=-1) / n).sqrt()
    assert ((x.mean(1) - mean).abs() <= 5 * se_mean).all(), (x.mean(1) - mean) / se_mean
    # trace of the covariance: E‖X − m‖², SE from the sample's own spread of ‖X − m‖².
    sq = (x - mean[:, None, :]).pow(2).sum(-1)
    trace = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)
    se_trace = sq.std(1) / math.sqrt(n)
    assert ((sq.mean(1) - trace).abs() <= 5 * se_trace).all(), (sq.mean(1) - trace) / se_trace


def test_posterior_sample_shapes_broadcast_and_reproducibility(ring):
    y = queries(ring, 12, 0.3, seed=7).reshape(3, 4, 2)
    state = torch.get_rng_state()
    a = ring.posterior_sample(y, 0.3, 5, fixed(8))
    assert torch.equal(torch.get_rng_state(), state)
    assert a.shape == (3, 4, 5, 2)
    assert torch.equal(a, ring.posterior_sample(y, 0.3, 5, fixed(8)))
    assert not torch.equal(a, ring.posterior_sample(y, 0.3, 5, fixed(9)))
    s = torch.full((3, 4), 0.3, **F64)
    assert torch.equal(a, ring.posterior_sample(y, s, 5, fixed(8)))
    assert ring.posterior_sample(y.new_empty(0, 2), 0.3, 5, fixed(0)).shape == (0, 5, 2)
    # s = 0: the posterior is the point y.
    torch.testing.assert_close(ring.posterior_sample(y, 0.0, 3, fixed(0)), y[..., None, :].expand(3, 4, 3, 2))
    assert ring.posterior_sample(y.float(), 0.3, 2, fixed(0)).dtype == torch.float32


# ------------------------------------------------------------------ the identity and the oracle
@pytest.mark.parametrize("s", [0.1, 0.25, 0.5])
def test_et_score_on_exact_posterior_matches_noisy_score(ring, s):
    n = 4096
    y = queries(ring, 64, s, seed=10)
    x = ring.posterior_sample(y, s, n, fixed(11))
    metric = Metric.isotropic(torch.tensor(s * s, **F64))
    est = etweedie.et_score(y, x, 2.0, 1.0, metric)
    # β = 2 is Tweedie exactly: s(y) = −(y − mean of draws)/s².
    torch.testing.assert_close(est, -(y - x.mean(1)) / (s * s), rtol=1e-9, atol=1e-9)
    # MC error of that mean: SE_j = sqrt(Cov(X|y)_jj / N) / s².
    _, cov = analytic_posterior_moments(ring, y, s)
    se = (torch.diagonal(cov, dim1=-2, dim2=-1) / n).sqrt() / (s * s)
    z = (est - ring.noisy_score(y, s)) / se
    assert z.abs().max() < 5, z.abs().max()


def test_is_score_gaussian_law_matches_noisy_score(ring):
    s = 0.5
    bank, _ = ring.sample(100_000, fixed(12), dtype=torch.float64)
    y = queries(ring, 64, s, seed=13)
    law = GeneralizedGaussian(torch.tensor(2.0, **F64), 1.0, Metric.isotropic(torch.tensor(s * s, **F64)), dim=2)
    score, mean, ess = etweedie.is_score(y, bank, law)
    truth = ring.noisy_score(y, s)
    nmse = (score - truth).pow(2).sum(-1).mean() / truth.pow(2).sum(-1).mean()
    # with ESS in the thousands the relative error per query is ~ 1/sqrt(ESS) ≈ 2%.
    assert float(ess.min()) > 1000
    assert float(nmse) < 2e-3, float(nmse)
    torch.testing.assert_close(mean, ring.posterior_mean(y, s), rtol=0, atol=0.02)


# ------------------------------------------------------------------ SIR posterior
def five_param_law(beta=1.4):
    return NoiseParams(torch.tensor(beta, **F64), 1.8, 0.57, 0.0, 0.6).noise(2)


def test_sir_reproducible_shapes_and_bank_points(ring):
    bank, _ = ring.sample(5000, fixed(14), dtype=torch.float64)
    law = five_param_law()
    y = queries(ring, 6, 0.4, seed=15).reshape(2, 3, 2)
    state = torch.get_rng_state()
    a = posterior_sample_sir(y, bank, law, 7, fixed(16))
    assert torch.equal(torch.get_rng_state(), state)
    assert a.shape == (2, 3, 7, 2)
    assert torch.equal(a, posterior_sample_sir(y, bank, law, 7, fixed(16)))
    assert not torch.equal(a, posterior_sample_sir(y, bank, law, 7, fixed(17)))
    # every draw is a bank point
    assert (a.reshape(-1, 1, 2) == bank).all(-1).any(-1).all()
    # tiny blocks (one query per chunk) still give valid draws of the right shape
    b = posterior_sample_sir(y, bank, law, 7, fixed(16), max_block_elements=1)
    assert b.shape == a.shape


@pytest.mark.parametrize(
    "law",
    [
        five_param_law(1.4),
        five_param_law(1.0),
        GeneralizedGaussian(torch.tensor(1.2, **F64), 2.0, dim=2),
        GeneralizedGaussian(torch.tensor(2.0, **F64), 1.0, Metric.dense(torch.tensor([[0.3, 0.1], [0.1, 0.2]], **F64))),
    ],
    ids=["block-1.4", "block-1.0", "identity", "dense"],
)
def test_sir_fast_log_weights_equal_log_prob(ring, law):
    bank, _ = ring.sample(3000, fixed(18), dtype=torch.float64)
    y = queries(ring, 9, 0.4, seed=19)
    fast = _sir_log_weights(law, bank)(y)
    slow = law.log_prob(y[:, None, :] - bank)
    diff = fast - slow  # a per-row constant (the normalizer)
    torch.testing.assert_close(diff, diff[:, :1].expand_as(diff), rtol=0, atol=1e-9)


def test_sir_fast_log_weights_are_translation_equivariant_in_float32(ring):
    """The GEMM-form distances of the fast path are taken about the bank's mean: a bank and queries
    1000 away from the origin give the float32 weights of the unshifted ones (uncentred, the
    float32 weights lost every digit there: total variation 0.6–1 from float64)."""
    bank, _ = ring.sample(3000, fixed(23))
    y = queries(ring, 9, 0.05, seed=24).float()
    law = GeneralizedGaussian(2.0, 400.0, dim=2)
    near = torch.softmax(_sir_log_weights(law, bank)(y), -1)
    far = torch.softmax(_sir_log_weights(law, bank + 1000.0)(y + 1000.0), -1)
    exact = torch.softmax(_sir_log_weights(law, bank.double())(y.double()), -1)
    assert 0.5 * (far.double() - exact).abs().sum(-1).max() < 2e-3
    assert 0.5 * (near.double() - exact).abs().sum(-1).max() < 2e-3


def _hand_gg_weights(y, bank, beta, lam, sigma, u, v):
    """w_j ∝ exp(−(λ/β) ‖y − x_j‖_P^β), Σ = (σ/c_{β,2})² S(u, v) (DESIGN §2), in float64, written
    out independently of etweedie.noise's own formulas."""
    c2 = beta ** (2 / beta) * math.gamma(4 / beta) / (2 * math.gamma(2 / beta))
    sigma_mat = sigma**2 / c2 * torch.tensor([[1 + u, v], [v, 1 - u]], **F64)
    diff = y[:, None, :] - bank
    q = torch.einsum("bmi,ij,bmj->bm", diff, torch.linalg.inv(sigma_mat), diff)
    return torch.softmax(-(lam / beta) * q ** (beta / 2), -1)


def test_sir_matches_the_hand_written_generalized_gaussian_posterior(ring):
    beta, lam, sigma, u, v = 1.4, 1.8, 0.57, 0.2, 0.5
    law = NoiseParams(torch.tensor(beta, **F64), lam, sigma, u, v).noise(2)
    bank, _ = ring.sample(4000, fixed(3), dtype=torch.float64)
    y = torch.tensor([[1.0, 0.5], [-2.0, 1.0], [0.0, -1.8]], **F64)
    w = _hand_gg_weights(y, bank, beta, lam, sigma, u, v)
    torch.testing.assert_close(torch.softmax(_sir_log_weights(law, bank)(y), -1), w, rtol=0, atol=1e-12)
    n = 8000
    draws = posterior_sample_sir(y, bank, law, n, fixed(4))
    mean = w @ bank
    sd = ((w[..., None] * (bank - mean[:, None, :]) ** 2).sum(1) / n).sqrt()
    assert ((draws.mean(1) - mean).abs() <= 5 * sd).all()


@pytest.mark.parametrize("far", [1e10, 2e19])
def test_sir_queries_far_beyond_the_bank(ring, far):
    """A float32 query far beyond the bank: the GEMM distance form rounds at ‖y‖², which swamps
    the bank's spread (the draws were noise at 1e10 and 'invalid SIR weights' at 2e19).  Far
    blocks now take direct float64 differences: under Gaussian noise (β = 2, rate 1) the weights
    ∝ exp(2 y·x_j − ‖x_j‖²) put every draw on the bank point maximizing that exponent, computed
    here in float64, and the float32 call equals the float64 one draw for draw."""
    bank = ring.sample(2000, fixed(3), dtype=torch.float64)[0].float()
    y = torch.tensor([[far, 0.3 * far]], dtype=torch.float32)
    law = GeneralizedGaussian(2.0, 2.0, dim=2)
    draws = posterior_sample_sir(y, bank, law, 32, fixed(4))
    exponent = 2 * (bank.double() @ y.double()[0]) - bank.double().pow(2).sum(-1)
    assert torch.equal(draws[0], bank[exponent.argmax()].expand(32, 2))
    law64 = GeneralizedGaussian(torch.tensor(1.3, **F64), torch.tensor(2.0, **F64), dim=2)
    law32 = GeneralizedGaussian(1.3, 2.0, dim=2)
    y2 = torch.tensor([[far, -0.5 * far], [0.3, -0.2]], dtype=torch.float32)  # a far and a near query in one block
    d32 = posterior_sample_sir(y2, bank, law32, 64, fixed(5))
    d64 = posterior_sample_sir(y2.double(), bank.double(), law64, 64, fixed(5))
    assert torch.equal(d32.double(), d64)


@pytest.mark.parametrize("beta", [0.3, 1.0, 1.3, 2.0])
def test_sir_far_rows_match_the_law_where_float64_still_resolves(ring, beta):
    """The far-row form ‖z‖^β expm1((β/2) log1p(t_j)) against the law's own log_prob on direct
    float64 differences, at distances (1e2–2e3, under a block metric) where those are exact
    enough; a near row in the same block keeps direct distances."""
    bank = ring.sample(2000, fixed(3), dtype=torch.float64)[0]
    law = GeneralizedGaussian(torch.tensor(beta, **F64), torch.tensor(2.0, **F64),
                              Metric.block(torch.tensor([[1.0, 0.3], [0.3, 0.5]], **F64)), dim=2)
    y = torch.tensor([[300.0, -200.0], [0.3, 0.1], [1e3, 2e3]], **F64)
    got = torch.softmax(_sir_log_weights(law, bank)(y), -1)
    want = torch.softmax(law.log_prob(y[:, None, :] - bank), -1)
    assert torch.allclose(got, want, rtol=0, atol=1e-10), float((got - want).abs().max())


def test_sir_gaussian_law_recovers_posterior_mean(ring):
    s, n = 0.5, 4000
    bank, _ = ring.sample(100_000, fixed(20), dtype=torch.float64)
    y = queries(ring, 8, s, seed=21)
    law = GeneralizedGaussian(torch.tensor(2.0, **F64), 1.0, Metric.isotropic(torch.tensor(s * s, **F64)), dim=2)
    x = posterior_sample_sir(y, bank, law, n, fixed(22))
    mean, cov = analytic_posterior_moments(ring, y, s)
    # resampling SE plus a small allowance for the finite bank (ESS ≫ n here).
    se = (torch.diagonal(cov, dim1=-2, dim2=-1) / n).sqrt()
    assert ((x.mean(1) - mean).abs() <= 5 * se + 0.01).all()


def test_sir_generic_law_path(ring):
    bank, _ = ring.sample(4000, fixed(23), dtype=torch.float64)
    law = StudentT(torch.tensor(3.0, **F64), Metric.isotropic(torch.tensor(0.1, **F64)), dim=2)
    y = queries(ring, 5, 0.3, seed=24)
    x = posterior_sample_sir(y, bank, law, 16, fixed(25))
    assert x.shape == (5, 16, 2) and torch.isfinite(x).all()


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(radius=-1.0), ValueError, "radius"),
        (dict(std=0.0), ValueError, "std"),
        (dict(std=float("nan")), ValueError, "std"),
        (dict(n_modes=0), ValueError, "n_modes"),
        (dict(n_modes=2.5), TypeError, "n_modes"),
        (dict(radius="2"), TypeError, "radius"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        EightGaussians(**kwargs)


def test_methods_reject_bad_arguments(ring):
    y = torch.zeros(4, 2, **F64)
    g = fixed(0)
    cases = [
        (lambda: ring.sample(-1, g), ValueError, "n"),
        (lambda: ring.sample(3, None), TypeError, "generator"),
        (lambda: ring.sample(3, 0), TypeError, "generator"),
        (lambda: ring.sample(3, g, dtype=torch.int64), TypeError, "dtype"),
        (lambda: ring.log_prob(torch.zeros(4, 3)), ValueError, "x"),
        (lambda: ring.score([0.0, 0.0]), TypeError, "x"),
        (lambda: ring.noisy_score(torch.zeros(4, 2, dtype=torch.int64), 0.1), TypeError, "y"),
        (lambda: ring.noisy_score(y, -0.1), ValueError, "sigma_noise"),
        (lambda: ring.noisy_score(y, torch.full((3,), 0.1, **F64)), ValueError, "sigma_noise"),
        (lambda: ring.noisy_score(y, torch.tensor(1)), TypeError, "sigma_noise"),
        (lambda: ring.posterior_sample(y, 0.1, 0, g), ValueError, "n"),
        (lambda: ring.posterior_sample(y, 0.1, 2.0, g), TypeError, "n"),
        (lambda: ring.posterior_sample(y, 0.1, 2, None), TypeError, "generator"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()


def test_sir_rejects_bad_arguments(ring):
    bank = torch.zeros(10, 2, **F64)
    y = torch.zeros(4, 2, **F64)
    law = five_param_law()
    g = fixed(0)
    batched = GeneralizedGaussian(torch.tensor([1.0, 1.5], **F64), 1.0, dim=2)
    cases = [
        (lambda: posterior_sample_sir(y, torch.zeros(10, 3, **F64), law, 2, g), ValueError, "bank"),
        (lambda: posterior_sample_sir(y, torch.zeros(2, 10, 2, **F64), law, 2, g), ValueError, "bank"),
        (lambda: posterior_sample_sir(y, torch.zeros(0, 2, **F64), law, 2, g), ValueError, "bank"),
        (lambda: posterior_sample_sir(y, bank.float(), law, 2, g), TypeError, "bank"),
        (lambda: posterior_sample_sir(y, bank, object(), 2, g), TypeError, "noise_law"),
        (lambda: posterior_sample_sir(y, bank, batched, 2, g), ValueError, "noise_law"),
        (lambda: posterior_sample_sir(y, bank, GeneralizedGaussian(1.0, dim=3), 2, g), ValueError, "noise_law"),
        (lambda: posterior_sample_sir(y, bank, law, 0, g), ValueError, "n"),
        (lambda: posterior_sample_sir(y, bank, law, 2, None), TypeError, "generator"),
        (lambda: posterior_sample_sir(y, bank, law, 2, g, max_block_elements=0), ValueError, "max_block_elements"),
        (lambda: posterior_sample_sir(torch.full((4, 2), float("nan"), **F64), bank, law, 2, g), ValueError, "y"),
        (lambda: posterior_sample_sir(y, torch.full((10, 2), float("inf"), **F64), law, 2, g), ValueError, "bank"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()


def test_ring_far_queries_and_nan_queries(ring):
    """A finite query far from the ring (1e20 in float32) has the finite score and posterior mean
    of its nearest mode (‖y − μ_k‖² overflowed: NaN); a NaN query gets NaN draws, the others are
    drawn as if alone (it crashed torch.multinomial)."""
    y = torch.tensor([[1e20, 0.0]])
    torch.testing.assert_close(ring.noisy_score(y, 0.5), ring.noisy_score(y.double(), 0.5).float())
    assert torch.isfinite(ring.posterior_mean(y, 0.5)).all()
    # at the end of each dtype's range x·μ_k overflowed too (NaN): the score is then an honest ±inf
    # (its true value does not fit), the posterior mean finite
    for top in (torch.tensor([[3e38, 1e38], [-3.4e38, 3.4e38], [2e38, -3e37]]),
                torch.tensor([[1.7e308, -1e308], [-1.7e308, 1.7e308], [1e300, 0.0]], dtype=torch.float64)):
        for s in (0.0, 0.5):
            score, mean = ring.noisy_score(top, s), ring.posterior_mean(top, s)
            assert not torch.isnan(score).any() and torch.isfinite(mean).all(), (top.dtype, s)
            if top.dtype == torch.float32:  # float64 holds float32's ends: the same result, rounded
                torch.testing.assert_close(score, ring.noisy_score(top.double(), s).float())
                torch.testing.assert_close(mean, ring.posterior_mean(top.double(), s).float())
    mixed = torch.tensor([[float("nan"), 0.0], [0.3, -0.2]])
    x = ring.posterior_sample(mixed, 0.5, 6, fixed(40))
    assert torch.isnan(x[0]).all() and torch.isfinite(x[1]).all()
    alone = ring.posterior_sample(torch.tensor([[0.0, 0.0], [0.3, -0.2]]), 0.5, 6, fixed(40))
    torch.testing.assert_close(x[1], alone[1])
