"""Data generators against hand-written float64 laws (independent of etweedie.noise's own formulas).

Fixed seeds: the statistical checks cannot flake; tolerances are 5 standard errors.
"""

import math

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
