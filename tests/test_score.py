"""Score estimation: Energy-Tweedie scores from posterior draws, the IS oracle, Richardson, the a + b/N fit,
the score metrics at float32's extremes, and the score-matching losses and trainers' argument checks."""

import math

import numpy as np
import pytest
import torch

import etweedie
from etweedie.data import EightGaussians
from etweedie.noise import NoiseParams
from etweedie.posteriors import KnownPosterior
from etweedie.score import (
    EnergyTweedieScore,
    ISOracle,
    fit_mc_budget,
    mean_cosine,
    posterior_mean_mse,
    richardson,
    richardson_score,
    score_from_draws,
    score_nmse,
)
from etweedie.training.scorematching import (
    ConditionalScoreNet,
    ScoreNet,
    fit_score,
    hyvarinen_loss,
    sliced_score_matching_vr_loss,
    train_score_net,
)

from conftest import gen

RING = EightGaussians()
F64 = torch.float64


def gaussian(sigma, lam=1.0, dtype=F64):
    """Isotropic Gaussian noise in the tuple: Σ = σ² I (c_{2,2} = 1), noise N(0, σ²/λ I)."""
    return NoiseParams(torch.tensor(2.0, dtype=dtype), lam, sigma, 0.0, 0.0)


def noisy_queries(params, n, generator, dtype=F64):
    x, _ = RING.sample(n, generator, dtype=dtype)
    return x + params.noise(2).sample((n,), generator=generator).to(dtype)


@pytest.fixture(scope="module")
def oracle_bank():
    """The paper's 160,000-point clean bank (float32 keeps the IS passes short; is_score sums in double)."""
    return ISOracle.eight_gaussians(160_000, generator=torch.Generator().manual_seed(11), dtype=torch.float32)


# ---------------------------------------------------------------------------- the IS oracle
@pytest.mark.parametrize("sigma, tol", [(0.1, 0.01), (0.25, 1e-3), (0.5, 1e-3)])
def test_is_oracle_matches_the_analytic_gaussian_noise_score(oracle_bank, sigma, tol):
    # Self-normalized IS over M bank points has NMSE ≈ (NMSE of one posterior draw)/ESS; the
    # ESS at 160k points is ≈ 4k at σ = 0.1 and > 10k above, measured NMSE ≈ 2e-3, 1e-4, 4e-5.
    # The tolerances leave ≥ 5× margin.
    g = torch.Generator().manual_seed(5)
    params = gaussian(sigma, dtype=torch.float32)
    y = noisy_queries(params, 256, g, torch.float32)
    ref = oracle_bank(y, params)
    exact = RING.noisy_score(y.double(), sigma)
    assert ref.score.shape == y.shape and ref.ess.shape == (256,)
    assert score_nmse(ref.score.double(), exact) < tol
    assert mean_cosine(ref.score.double(), exact) > 0.98
    # the posterior mean, against the exact Gaussian-mixture posterior mean (≈ 4e-6 measured)
    assert posterior_mean_mse(ref.posterior_mean.double(), RING.posterior_mean(y.double(), sigma)) < 1e-4
    assert float(ref.ess.median()) > 1000 and float(ref.ess.min()) > 1  # far-out queries have few effective points


def test_is_oracle_groups_rows_by_tuple():
    # One call with a different tuple per row equals separate calls per tuple (deterministic).
    bank, _ = RING.sample(3000, torch.Generator().manual_seed(0), dtype=F64)
    oracle = ISOracle(bank)
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, 2, generator=g, dtype=F64) * 2
    beta = torch.tensor([1.4, 2.0, 1.4, 1.0, 2.0, 1.4], dtype=F64)
    sigma = torch.tensor([0.57, 0.3, 0.57, 0.5, 0.3, 0.2], dtype=F64)
    params = NoiseParams(beta, 1.8, sigma, 0.0, 0.6)
    joint = oracle(y, params)
    for i in range(6):
        single = oracle(y[i : i + 1], NoiseParams(beta[i : i + 1], 1.8, sigma[i : i + 1], 0.0, 0.6))
        torch.testing.assert_close(joint.score[i : i + 1], single.score)
        torch.testing.assert_close(joint.posterior_mean[i : i + 1], single.posterior_mean)
    # and it is the fused op under the row's law
    law = NoiseParams(torch.tensor(1.0, dtype=F64), 1.8, 0.5, 0.0, 0.6).noise(2)
    s, m, _ = etweedie.is_score(y[3:4], bank, law)
    torch.testing.assert_close(joint.score[3:4], s)


def test_reference_disagreement_shrinks_with_the_bank():
    g = torch.Generator().manual_seed(2)
    params = NoiseParams(torch.tensor(1.4, dtype=F64), 1.8, 0.57, 0.0, 0.6)
    y = noisy_queries(params, 128, g)
    small = ISOracle.eight_gaussians(2_000, generator=torch.Generator().manual_seed(3)).disagreement(y, params)
    large = ISOracle.eight_gaussians(40_000, generator=torch.Generator().manual_seed(4)).disagreement(y, params)
    # the disagreement of two independent halves scales like 1/M: 20× the bank, ≈ 20× smaller
    assert 0 < large < small / 5


# ---------------------------------------------------------------------------- Energy-Tweedie score
def _posterior_trace(y, s):
    """tr Cov(X | y) of the exact Gaussian-mixture posterior: 2v + Σ_k w_k‖m_k‖² − ‖Σ_k w_k m_k‖²."""
    weights, comp_means, comp_var = RING._posterior_parts(y, torch.tensor(s, dtype=y.dtype))
    mean = (weights[..., None] * comp_means).sum(-2)
    return 2 * comp_var + (weights * comp_means.pow(2).sum(-1)).sum(-1) - mean.pow(2).sum(-1)


@pytest.mark.parametrize("sigma, lam", [(0.25, 1.0), (0.5, 2.0)])
def test_energy_tweedie_on_the_exact_posterior_matches_the_mc_prediction(sigma, lam):
    g = torch.Generator().manual_seed(7)
    params = gaussian(sigma, lam)
    s = sigma / math.sqrt(lam)  # noise N(0, σ²/λ I)
    y = noisy_queries(params, 2048, g)
    analytic = RING.noisy_score(y, s)
    oracle = KnownPosterior(method="sir", bank=torch.zeros(1, 2, dtype=F64))  # Gaussian rows never touch the bank
    n_draws = 32
    score = EnergyTweedieScore(oracle, n_draws, generator=torch.Generator().manual_seed(8))
    estimate, post_mean = score.score_and_mean(y, params)
    # Paper Eq. score_mc_error_decomposition with an exact posterior (no bias term): h = −(y − X)/s²,
    # so E‖ŝ_N − s‖² = tr Cov(X | y) / (N s⁴).
    trace = _posterior_trace(y, s)
    predicted = float(trace.mean() / (n_draws * s**4) / analytic.pow(2).sum(-1).mean())
    measured = score_nmse(estimate, analytic)
    # 2048 queries: the measured NMSE (a mean of ≈ χ²₂/2 terms with uneven weights) lies within
    # ±25% of its expectation (its relative spread is a few percent).
    assert 0.75 * predicted < measured < 1.25 * predicted, (measured, predicted)
    assert mean_cosine(estimate, analytic) > 0.9
    # the posterior mean from the same draws: unbiased, per-coordinate MSE tr Cov(X|y) / (2N)
    expected_pm = float(trace.mean() / (2 * n_draws))
    measured_pm = posterior_mean_mse(post_mean, RING.posterior_mean(y, s))
    assert 0.75 * expected_pm < measured_pm < 1.25 * expected_pm, (measured_pm, expected_pm)


class _DeterministicPosterior:
    """Draws that depend only on (y, η): x_i = y − (1 + i) · (σ, v·σ) · c_i, for exact comparisons."""

    dim = 2

    def sample(self, y, eta, n, *, generator):
        params = NoiseParams.from_eta(eta)
        offsets = torch.linspace(0.3, 1.7, n, dtype=y.dtype)
        direction = torch.stack([params.sigma, params.sigma * (1 + params.v)], dim=-1).to(y.dtype)
        angle = torch.linspace(0, 3.0, n, dtype=y.dtype)
        rot = torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)
        return y[..., None, :] - offsets[:, None] * (direction[..., None, :] + 0.3 * rot)


def test_each_row_uses_its_own_beta_lambda_and_metric():
    g = torch.Generator().manual_seed(3)
    y = torch.randn(5, 2, generator=g, dtype=F64)
    beta = torch.tensor([1.3, 1.6, 2.0, 1.0, 1.8], dtype=F64)
    lam = torch.tensor([1.0, 2.5, 1.2, 1.8, 2.0], dtype=F64)
    sigma = torch.tensor([0.1, 0.3, 0.75, 0.5, 0.2], dtype=F64)
    u = torch.tensor([0.0, 0.5, -0.3, 0.2, 0.0], dtype=F64)
    v = torch.tensor([0.6, 0.0, 0.3, -0.5, 0.0], dtype=F64)
    params = NoiseParams(beta, lam, sigma, u, v)
    post = _DeterministicPosterior()
    got = EnergyTweedieScore(post, 7, chunk=2)(y, params)
    for i in range(5):
        row = NoiseParams(beta[i], lam[i], sigma[i], u[i], v[i])
        x = post.sample(y[i], row.eta(), 7, generator=None)
        want = row.noise(2).score(y[i] - x).mean(-2)  # −λ P ‖y−x‖^{β−2}(y−x), averaged
        torch.testing.assert_close(got[i], want)


def test_batched_queries_and_gradients_through_the_tuple():
    post = _DeterministicPosterior()
    y = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    beta = torch.tensor(1.5, dtype=F64, requires_grad=True)
    lam = torch.tensor(1.8, dtype=F64, requires_grad=True)
    score = EnergyTweedieScore(post, 5)
    s = score(y, NoiseParams(beta, lam, 0.5, 0.0, 0.6))
    assert s.shape == (3, 4, 2)
    s.pow(2).sum().backward()
    assert beta.grad is not None and torch.isfinite(beta.grad) and lam.grad is not None
    assert score.draws(y, NoiseParams(1.5, 1.8, 0.5)).shape == (3, 4, 5, 2)


def test_score_from_draws_reuses_draws_for_smaller_budgets():
    post = KnownPosterior(method="sir", bank_size=2_000, generator=torch.Generator().manual_seed(0))
    params = NoiseParams(torch.tensor([1.4, 1.8, 2.0], dtype=F64), 1.8, 0.57, 0.0, 0.6)
    y = torch.randn(3, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    draws = EnergyTweedieScore(post, 16).draws(y, params)
    # same generator state: the score of all 16 draws equals the scorer's own
    torch.testing.assert_close(score_from_draws(y, params, draws), EnergyTweedieScore(post, 16)(y, params))
    first4 = score_from_draws(y, params, draws[:, :4])
    for i in range(3):
        row = NoiseParams(params.beta[i], 1.8, 0.57, 0.0, 0.6)
        torch.testing.assert_close(first4[i], row.noise(2).score(y[i] - draws[i, :4]).mean(0), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="draws"):
        score_from_draws(y, params, draws[0])


def test_default_generator_is_reproducible_and_call_generator_wins():
    post = KnownPosterior(method="sir", bank_size=2_000, generator=torch.Generator().manual_seed(0))
    params = NoiseParams(torch.tensor(1.4, dtype=F64), 1.8, 0.57, 0.0, 0.6)
    y = torch.randn(8, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    a = EnergyTweedieScore(post, 16)(y, params)
    b = EnergyTweedieScore(post, 16)(y, params)
    c = EnergyTweedieScore(post, 16)(y, params, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)


def test_module_posterior_runs_in_its_own_dtype():
    class Float32Module(torch.nn.Module):
        dim = 2

        def __init__(self):
            super().__init__()
            self.shift = torch.nn.Parameter(torch.tensor([0.1, -0.2]))

        def sample(self, y, eta, n, *, generator):
            assert y.dtype == torch.float32 and eta.dtype == torch.float32
            return y[..., None, :] + self.shift + 0.1 * torch.randn(*y.shape[:-1], n, 2, generator=generator)

    y = torch.randn(4, 2, dtype=F64)
    s, m = EnergyTweedieScore(Float32Module(), 8).score_and_mean(y, NoiseParams(2.0, 1.0, 0.5))
    assert s.dtype == F64 and m.dtype == F64


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(n_draws=0), ValueError, "n_draws"),
        (dict(n_draws=2.0), TypeError, "n_draws"),
        (dict(chunk=0), ValueError, "chunk"),
        (dict(generator=0), TypeError, "generator"),
    ],
)
def test_energy_tweedie_score_rejects_bad_arguments(kwargs, error, name):
    args = dict(n_draws=4)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        EnergyTweedieScore(_DeterministicPosterior(), **args)


def test_energy_tweedie_score_rejects_bad_calls():
    score = EnergyTweedieScore(_DeterministicPosterior(), 4)
    with pytest.raises(TypeError, match="noise_params"):
        score(torch.zeros(2, 2), (1.4, 1.8, 0.5, 0.0, 0.0))
    with pytest.raises(ValueError, match="noise_params"):
        score(torch.zeros(2, 2), NoiseParams(torch.tensor([1.4, 1.5, 1.6]), 1.8, 0.5))
    with pytest.raises(ValueError, match="d = 2"):
        score(torch.zeros(2, 4), NoiseParams(1.4, 1.8, 0.5))
    with pytest.raises(TypeError, match="posterior"):
        EnergyTweedieScore(object(), 4)


# ---------------------------------------------------------------------------- Richardson
def test_richardson_of_exact_noisy_scores_has_fourth_order_error():
    # s_ε = ∇log(p * N(0, ε²I)); ŝ_RE − ∇log p = O(ε₁²ε₂²): halving both ε shrinks it ≈ 16×,
    # while a single level's O(ε²) error shrinks ≈ 4×.
    x, _ = RING.sample(512, torch.Generator().manual_seed(4), dtype=F64)
    clean = RING.score(x)
    mse = lambda s: float((s - clean).pow(2).sum(-1).mean())
    errors = []
    for eps in (0.04, 0.02):
        e1, e2 = eps, 1.5 * eps
        re = richardson(RING.noisy_score(x, e1), RING.noisy_score(x, e2), e1, e2)
        errors.append((mse(RING.noisy_score(x, e1)), mse(re)))
    (single_big, re_big), (single_small, re_small) = errors
    assert re_big < single_big / 10
    assert 8 < math.sqrt(re_big / re_small) < 24  # RMS error ratio ≈ 16
    assert 3 < math.sqrt(single_big / single_small) < 5  # ≈ 4


def test_richardson_beats_each_single_level_with_exact_posteriors():
    # Gaussian noise, exact posterior draws: at (σ₁, σ₂) = (0.1, 0.14) the single levels carry a
    # bias of relative size ≈ σ²/τ² (0.2 and 0.33 of ∇log p, τ = 0.2) that RE removes to
    # O(σ₁²σ₂²/τ⁴) ≈ 0.07, at the price of ≈ 3× the Monte-Carlo variance; N = 2048 keeps that
    # below the single levels' bias.
    x, _ = RING.sample(256, torch.Generator().manual_seed(5), dtype=F64)
    clean = RING.score(x)
    oracle = KnownPosterior(method="sir", bank=torch.zeros(1, 2, dtype=F64))
    score = EnergyTweedieScore(oracle, 2048, generator=torch.Generator().manual_seed(6))
    re, s1, s2 = richardson_score(score, x, gaussian(0.1), 0.1, 0.14)
    mse = lambda s: float((s - clean).pow(2).sum(-1).mean())
    assert mse(re) < 0.5 * mse(s1) and mse(re) < 0.5 * mse(s2), (mse(re), mse(s1), mse(s2))


def test_richardson_validates():
    s = torch.ones(3, 2)
    with pytest.raises(ValueError, match="differ"):
        richardson(s, s, 0.1, 0.1)
    with pytest.raises(ValueError, match="> 0"):
        richardson(s, s, -0.1, 0.2)
    with pytest.raises(ValueError, match="shape"):
        richardson(s, torch.ones(2, 2), 0.1, 0.2)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="finite and > 0"):
            richardson(s, s, 0.1, bad)
    with pytest.raises(ValueError, match="eps1 must be a number or broadcast to the batch"):
        richardson(s, s, torch.tensor([0.1, 0.2]), 0.3)
    with pytest.raises(ValueError, match="eps2 must be a number or broadcast to the batch"):
        richardson(s, s, 0.1, torch.full((2, 3), 0.3))  # would enlarge the batch
    with pytest.raises(TypeError, match="eps1 must be a real number"):
        richardson(s, s, "a", 0.2)
    # tensors of ε per row broadcast over the coordinates
    out = richardson(torch.ones(2, 2), torch.zeros(2, 2), torch.tensor([0.1, 0.2]), torch.tensor([0.2, 0.4]))
    torch.testing.assert_close(out, torch.full((2, 2), 4 / 3))


def test_richardson_depends_only_on_the_eps_ratio_and_keeps_zero_size_batches():
    """ε² overflowed (ε = 1e20) or underflowed (ε = 1e-30) in float32: the result was all NaN."""
    g = gen(2)
    s1, s2 = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    e1 = torch.rand(5, generator=g, dtype=F64) + 0.1
    e2 = e1 + torch.rand(5, generator=g, dtype=F64) + 0.05
    hand = (e2[:, None] ** 2 * s1.double() - e1[:, None] ** 2 * s2.double()) / (e2[:, None] ** 2 - e1[:, None] ** 2)
    torch.testing.assert_close(richardson(s1.double(), s2.double(), e1, e2), hand, rtol=1e-12, atol=1e-12)
    base = richardson(s1, s2, 1.0, 2.0)
    for scale in (1e20, 1e-30):
        torch.testing.assert_close(richardson(s1, s2, scale, 2 * scale), base)
    assert richardson(torch.zeros(0, 2), torch.zeros(0, 2), 0.1, 0.2).shape == (0, 2)


@pytest.mark.parametrize(
    "call, error, match",
    [
        pytest.param(lambda: richardson_score(3, torch.zeros(2, 2), NoiseParams(2.0, 1.0, 0.5), 0.1, 0.2), TypeError,
                     "score_fn must be a callable", id="richardson_score-score_fn"),
        # said the bank had shape (1, 2)
        pytest.param(lambda: ISOracle(torch.randn(3, 2, generator=gen(0))).halves(), ValueError, "M >= 4",
                     id="oracle-halves-small-bank"),
        pytest.param(lambda: ISOracle(torch.zeros(4, 0)), ValueError, "d >= 1", id="oracle-zero-width-bank"),
    ],
)
def test_richardson_score_and_oracle_halves_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------- the a + b/N fit
def test_fit_mc_budget_recovers_known_floor_and_slope():
    budgets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    a, b = fit_mc_budget(budgets, [0.023 + 1.41 / n for n in budgets])
    assert a == pytest.approx(0.023, abs=1e-12) and b == pytest.approx(1.41, abs=1e-12)
    # with multiplicative noise of 5% and ten repetitions per budget (as measured NMSEs scatter)
    g = torch.Generator().manual_seed(0)
    n = torch.tensor(budgets, dtype=F64).repeat_interleave(10)
    nmse = (0.03 + 1.2 / n) * (1 + 0.05 * torch.randn(n.shape, generator=g, dtype=F64))
    a, b = fit_mc_budget(n.tolist(), nmse.tolist())
    assert a == pytest.approx(0.03, abs=0.006) and b == pytest.approx(1.2, rel=0.05)


def test_fit_mc_budget_validates():
    with pytest.raises(ValueError, match="two distinct"):
        fit_mc_budget([4, 4], [0.1, 0.2])
    with pytest.raises(ValueError, match="length"):
        fit_mc_budget([1, 2], [0.1])
    with pytest.raises(ValueError, match=">= 1"):
        fit_mc_budget([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="nmse must be finite"):
        fit_mc_budget([1, 2, 4], [0.5, float("nan"), 0.1])
    with pytest.raises(ValueError, match="n_draws must all be finite"):
        fit_mc_budget([1, float("inf")], [0.5, 0.1])


def test_metrics():
    ref = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    est = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    assert score_nmse(est, ref) == pytest.approx(2 / 5)
    assert mean_cosine(est, ref) == pytest.approx((1 / math.sqrt(2) + 1) / 2)
    assert posterior_mean_mse(est, ref) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="shape"):
        score_nmse(est, ref[:1])


def _cosine64(a, b):
    a, b = a.double(), b.double()
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).mean())


def test_score_metrics_match_float64_formulas_at_every_float32_scale():
    """float32 fields at 1e±30: cosine was 0.0 at 1e30 and 2.0 (> 1) at 1e-30, NMSE 0/0 = NaN,
    the posterior-mean MSE inf; float64 fields at 1e-200 had cosine 0."""
    g = gen(1)
    est, ref = torch.randn(7, 3, generator=g, dtype=F64), torch.randn(7, 3, generator=g, dtype=F64)
    cos = _cosine64(est, ref)
    nmse = float((est - ref).pow(2).sum(-1).mean() / ref.pow(2).sum(-1).mean())
    for scale, dtype in ((1e30, torch.float32), (1e-30, torch.float32), (1.0, torch.float32), (1e-200, F64), (1e200, F64)):
        e, r = (est * scale).to(dtype), (ref * scale).to(dtype)
        assert mean_cosine(e, r) == pytest.approx(cos, rel=1e-5), scale
        assert score_nmse(e, r) == pytest.approx(nmse, rel=1e-5), scale
    e32, r32 = (est * 1e30).float(), (ref * 1e30).float()
    assert posterior_mean_mse(e32, r32) == pytest.approx(float((e32.double() - r32.double()).pow(2).mean()), rel=1e-12)
    # identical rows give exactly cosine 1 (never above), a zero row counts as 0
    ones = torch.full((2, 3), 1e-30)
    assert mean_cosine(ones, ones) == pytest.approx(1.0) and mean_cosine(ones, ones) <= 1.0
    assert mean_cosine(torch.zeros(1, 3), torch.ones(1, 3)) == 0.0


@pytest.mark.parametrize(
    "call, match",
    [
        pytest.param(lambda: score_nmse(torch.tensor(1.0), torch.tensor(2.0)), "0-d", id="score_nmse-0d"),
        # came back with shape (1,)
        pytest.param(lambda: richardson(torch.tensor(1.0), torch.tensor(2.0), 0.1, 0.2), "s_eps1 must have shape",
                     id="richardson-0d"),
        pytest.param(lambda: mean_cosine(torch.ones(2, 2), torch.ones(2, 2, device="meta")), "device",
                     id="mean_cosine-mixed-devices"),
    ],
)
def test_score_metrics_reject_scalars_and_mixed_devices(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------- the oracle posterior
def test_oracle_posterior_matches_the_exact_mixture_and_sir():
    g = torch.Generator().manual_seed(0)
    oracle = KnownPosterior(method="sir", bank_size=50_000, generator=g)
    y = torch.tensor([[2.0, 0.3], [0.0, 0.0]], dtype=F64)
    eta = torch.stack([gaussian(0.5).eta(), NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6).eta().double()])
    draws = oracle.sample(y, eta, 20_000, generator=torch.Generator().manual_seed(1))
    assert draws.shape == (2, 20_000, 2)
    # row 0 is exact (Gaussian): its mean is the analytic posterior mean
    torch.testing.assert_close(draws[0].mean(0), RING.posterior_mean(y[:1], 0.5)[0], atol=0.01, rtol=0)
    # row 1 is SIR on the bank: its draws are bank points
    assert bool((draws[1, :50, None, :] == oracle.bank).all(-1).any(-1).all())
    with pytest.raises(ValueError, match="eta"):
        oracle.sample(y, torch.zeros(2, 4), 3, generator=g)
    with pytest.raises(TypeError, match="generator"):
        oracle.sample(y, eta, 3, generator=None)
    with pytest.raises(ValueError, match="broadcast"):
        oracle.sample(y, eta[:1].expand(3, 5), 3, generator=g)


def test_antithetic_energy_tweedie_score_is_unbiased_and_needs_support(seed):
    """antithetic=True reaches the posterior's sample; the score (a mean over draws) keeps its
    expectation; a posterior without the keyword (the SIR oracle) is a TypeError up front."""
    from etweedie.posteriors import EngressionPosterior

    model = EngressionPosterior(2, width=16, depth=2, noise_dim=3, cond_width=8, init_seed=3)
    params = NoiseParams(1.5, 1.7, 0.3, 0.2, 0.1)
    y = torch.randn(32, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    scorer = EnergyTweedieScore(model, 8, antithetic=True)
    assert "antithetic=True" in repr(scorer)
    draws = scorer.draws(y, params, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        direct = model.sample(y.float(), params.eta().float(), 8, generator=torch.Generator().manual_seed(seed + 1),
                              antithetic=True).double()
    torch.testing.assert_close(draws, direct)
    reps = 200
    anti = torch.stack([scorer(y, params, generator=torch.Generator().manual_seed(seed + 2 + r)) for r in range(reps)])
    long_run = EnergyTweedieScore(model, 20000)(y, params, generator=torch.Generator().manual_seed(seed + 9999))
    se = (anti.var(0).mean() / reps).sqrt()
    assert float((anti.mean(0) - long_run).abs().mean()) < 1.5 * float(se) + 1e-3  # E|z| ≈ 0.8 when unbiased
    iid = torch.stack([EnergyTweedieScore(model, 8)(y, params, generator=torch.Generator().manual_seed(seed + 2 + r))
                       for r in range(reps)])
    assert float(anti.var(0).mean()) < 0.7 * float(iid.var(0).mean())  # measured 0.38–0.41
    oracle = KnownPosterior(method="sir", bank_size=64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="antithetic"):
        EnergyTweedieScore(oracle, 8, antithetic=True)
    with pytest.raises(TypeError, match="antithetic"):
        EnergyTweedieScore(model, 8, antithetic="no")


def test_fit_mc_budget_names_bad_input():
    with pytest.raises(TypeError, match="sequences of numbers"):
        fit_mc_budget(["a"], [1.0])


# ---------------------------------------------------------------------------- score matching
@pytest.mark.parametrize(
    "call, error, match",
    [
        # NaN loss before
        pytest.param(lambda: hyvarinen_loss(ScoreNet(2, hidden=8, depth=1), torch.zeros(0, 2)), ValueError,
                     "at least one row", id="hyvarinen-empty"),
        pytest.param(lambda: sliced_score_matching_vr_loss(ScoreNet(2, hidden=8, depth=1), torch.zeros(0, 2),
                                                           generator=gen(0)),
                     ValueError, "at least one row", id="ssm_vr-empty"),
        # a matmul RuntimeError before
        pytest.param(lambda: hyvarinen_loss(ScoreNet(2, hidden=8, depth=1), torch.zeros(3, 2, dtype=F64)), TypeError,
                     "parameter dtype torch.float32", id="hyvarinen-float64-batch"),
        pytest.param(lambda: train_score_net(ScoreNet(2, hidden=8, depth=1), torch.zeros(8, 2, dtype=F64), steps=1,
                                             generator=gen(0), progress=False),
                     TypeError, "parameter dtype", id="train-float64-batch"),
        pytest.param(lambda: sliced_score_matching_vr_loss(ConditionalScoreNet(2, hidden=8, depth=1), torch.zeros(5, 2),
                                                           torch.ones(3), generator=gen(0)),
                     ValueError, "cond must be one value for all rows or have leading dimension n = 5",
                     id="ssm_vr-cond-rows"),
    ],
)
def test_score_matching_losses_refuse_empty_batches_and_mismatched_dtypes(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_score_matching_loss_takes_one_cond_value_per_row_as_a_list():
    cnet = ConditionalScoreNet(2, hidden=8, depth=1)
    assert sliced_score_matching_vr_loss(cnet, torch.zeros(5, 2), [0.5] * 5, generator=gen(0)).shape == ()


@pytest.mark.parametrize(
    "call, error, match",
    [
        pytest.param(lambda: ConditionalScoreNet(2, hidden=8, depth=1)(torch.zeros(3, 2), "0.5"), TypeError,
                     "sigma must be a real number", id="sigma-str"),
        # floor = inf made every score 0
        pytest.param(lambda: ConditionalScoreNet(2, hidden=8, depth=1, floor=math.inf), ValueError, "floor",
                     id="floor-inf"),
        pytest.param(lambda: ConditionalScoreNet(2, hidden=8, depth=1, fourier_period=math.inf), ValueError,
                     "fourier_period", id="fourier_period-inf"),
    ],
)
def test_conditional_score_net_names_bad_sigma_and_options(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _observations():
    """16 finite observations and a copy with one NaN coordinate."""
    y = torch.randn(16, 2, generator=gen(0))
    bad = y.clone()
    bad[3, 1] = math.nan
    return y, bad


_FIT = dict(steps=2, hidden=8, depth=1, progress=False)
_TRAIN = dict(steps=1, progress=False)


@pytest.mark.parametrize(
    "call, error, match",
    [
        # trained to NaN weights
        pytest.param(lambda y, bad: fit_score(bad, generator=gen(0), **_FIT), ValueError, "observations must be finite",
                     id="fit-nan-observations"),
        pytest.param(lambda y, bad: fit_score([y, bad], [0.2, 0.4], generator=gen(0), **_FIT), ValueError,
                     r"observations\[1\] must be finite", id="fit-nan-level"),
        pytest.param(lambda y, bad: train_score_net(ScoreNet(2, hidden=8, depth=1), bad, generator=gen(0), **_TRAIN),
                     ValueError, "y must be finite", id="train-nan-y"),
        pytest.param(lambda y, bad: train_score_net(lambda q: q, y, generator=gen(0), **_TRAIN), TypeError,
                     "model must be a torch.nn.Module", id="train-model-callable"),
        pytest.param(lambda y, bad: train_score_net(torch.nn.Identity(), y, generator=gen(0), **_TRAIN), ValueError,
                     "trainable parameters", id="train-model-without-parameters"),
        pytest.param(lambda y, bad: train_score_net(ConditionalScoreNet(2, hidden=8, depth=1), y, "abc", generator=gen(0),
                                                    **_TRAIN),
                     TypeError, "cond must be a real tensor", id="train-cond-str"),
        pytest.param(lambda y, bad: train_score_net(ScoreNet(2, hidden=8, depth=1), y, method="exact", n_projections=1.5,
                                                    generator=gen(0), **_TRAIN),
                     TypeError, "n_projections", id="train-n_projections-float"),
        # blamed sigmas before
        pytest.param(lambda y, bad: fit_score(np.zeros((4, 2)), generator=gen(0), **_FIT), TypeError,
                     "observations must be a tensor", id="fit-numpy-observations"),
        pytest.param(lambda y, bad: fit_score([y, y], (s for s in (0.2, 0.4)), generator=gen(0), **_FIT), TypeError,
                     "sigmas must be a list", id="fit-sigmas-generator"),
    ],
)
def test_training_refuses_non_finite_observations_and_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call(*_observations())
