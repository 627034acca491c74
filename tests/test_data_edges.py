"""Data generators against hand-written float64 laws (independent of etweedie.noise's own formulas).

Fixed seeds: the statistical checks cannot flake; tolerances are 5 standard errors.
"""

import math

import pytest
import torch

from etweedie.data import EightGaussians, _sir_log_weights, posterior_sample_sir
from etweedie.noise import NoiseParams

F64 = dict(dtype=torch.float64)


def test_ring_components_have_the_documented_means_std_and_weights():
    ring = EightGaussians(radius=3.0, std=0.3, n_modes=5)
    n = 50_000
    x, labels = ring.sample(n, torch.Generator().manual_seed(1), dtype=torch.float64)
    freq = torch.bincount(labels, minlength=5).double() / n
    assert ((freq - 0.2).abs() <= 5 * math.sqrt(0.2 * 0.8 / n)).all()
    for k in range(5):
        pts = x[labels == k]
        mu = 3.0 * torch.tensor([math.cos(2 * math.pi * k / 5), math.sin(2 * math.pi * k / 5)], **F64)
        assert ((pts.mean(0) - mu).abs() <= 5 * 0.3 / math.sqrt(len(pts))).all()
        # per-coordinate variance τ² (SE of a sample variance: τ² sqrt(2/(m−1)))
        assert ((pts.var(0) - 0.09).abs() <= 5 * 0.09 * math.sqrt(2 / (len(pts) - 1))).all()


def _hand_gg_weights(y, bank, beta, lam, sigma, u, v):
    """w_j ∝ exp(−(λ/β) ‖y − x_j‖_P^β), Σ = (σ/c_{β,2})² S(u, v) (DESIGN §2), in float64."""
    c2 = beta ** (2 / beta) * math.gamma(4 / beta) / (2 * math.gamma(2 / beta))
    sigma_mat = sigma**2 / c2 * torch.tensor([[1 + u, v], [v, 1 - u]], **F64)
    diff = y[:, None, :] - bank
    q = torch.einsum("bmi,ij,bmj->bm", diff, torch.linalg.inv(sigma_mat), diff)
    return torch.softmax(-(lam / beta) * q ** (beta / 2), -1)


def test_sir_matches_the_hand_written_generalized_gaussian_posterior():
    beta, lam, sigma, u, v = 1.4, 1.8, 0.57, 0.2, 0.5
    law = NoiseParams(torch.tensor(beta, **F64), lam, sigma, u, v).noise(2)
    bank, _ = EightGaussians().sample(4000, torch.Generator().manual_seed(3), dtype=torch.float64)
    y = torch.tensor([[1.0, 0.5], [-2.0, 1.0], [0.0, -1.8]], **F64)
    w = _hand_gg_weights(y, bank, beta, lam, sigma, u, v)
    torch.testing.assert_close(torch.softmax(_sir_log_weights(law, bank)(y), -1), w, rtol=0, atol=1e-12)
    n = 8000
    draws = posterior_sample_sir(y, bank, law, n, torch.Generator().manual_seed(4))
    mean = w @ bank
    sd = ((w[..., None] * (bank - mean[:, None, :]) ** 2).sum(1) / n).sqrt()
    assert ((draws.mean(1) - mean).abs() <= 5 * sd).all()


@pytest.mark.parametrize("far", [1e10, 2e19])
def test_sir_queries_far_beyond_the_bank(far):
    """A float32 query far beyond the bank: the GEMM distance form rounds at ‖y‖², which swamps
    the bank's spread (the draws were noise at 1e10 and 'invalid SIR weights' at 2e19).  Far
    blocks now take direct float64 differences: under Gaussian noise (β = 2, rate 1) the weights
    ∝ exp(2 y·x_j − ‖x_j‖²) put every draw on the bank point maximizing that exponent, computed
    here in float64, and the float32 call equals the float64 one draw for draw."""
    import etweedie
    from etweedie.data import EightGaussians, posterior_sample_sir

    bank = EightGaussians().sample(2000, torch.Generator().manual_seed(3), dtype=torch.float64)[0].float()
    y = torch.tensor([[far, 0.3 * far]], dtype=torch.float32)
    law = etweedie.GeneralizedGaussian(2.0, 2.0, dim=2)
    draws = posterior_sample_sir(y, bank, law, 32, torch.Generator().manual_seed(4))
    exponent = 2 * (bank.double() @ y.double()[0]) - bank.double().pow(2).sum(-1)
    assert torch.equal(draws[0], bank[exponent.argmax()].expand(32, 2))
    law64 = etweedie.GeneralizedGaussian(torch.tensor(1.3, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64), dim=2)
    law32 = etweedie.GeneralizedGaussian(1.3, 2.0, dim=2)
    y2 = torch.tensor([[far, -0.5 * far], [0.3, -0.2]], dtype=torch.float32)  # a far and a near query in one block
    d32 = posterior_sample_sir(y2, bank, law32, 64, torch.Generator().manual_seed(5))
    d64 = posterior_sample_sir(y2.double(), bank.double(), law64, 64, torch.Generator().manual_seed(5))
    assert torch.equal(d32.double(), d64)


@pytest.mark.parametrize("beta", [0.3, 1.0, 1.3, 2.0])
def test_sir_far_rows_match_the_law_where_float64_still_resolves(beta):
    """The far-row form ‖z‖^β expm1((β/2) log1p(t_j)) against the law's own log_prob on direct
    float64 differences, at distances (1e2–2e3, under a block metric) where those are exact
    enough; a near row in the same block keeps direct distances."""
    import etweedie
    from etweedie.geometry import Metric

    f64 = torch.float64
    bank = EightGaussians().sample(2000, torch.Generator().manual_seed(3), dtype=f64)[0]
    law = etweedie.GeneralizedGaussian(torch.tensor(beta, dtype=f64), torch.tensor(2.0, dtype=f64),
                                       Metric.block(torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=f64)), dim=2)
    y = torch.tensor([[300.0, -200.0], [0.3, 0.1], [1e3, 2e3]], dtype=f64)
    got = torch.softmax(_sir_log_weights(law, bank)(y), -1)
    want = torch.softmax(law.log_prob(y[:, None, :] - bank), -1)
    assert torch.allclose(got, want, rtol=0, atol=1e-10), float((got - want).abs().max())
