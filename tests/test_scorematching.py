"""Tests of etweedie.scorematching: exact Hyvärinen SM, SSM-VR, conditional score network, trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from etweedie.scorematching import (
    ConditionalScoreNet,
    ScoreNet,
    fit_score,
    hyvarinen_loss,
    jacobian_trace,
    sliced_score_matching_vr_loss,
    train_score_net,
)



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread for this module (restored after): these small problems are
    overhead-bound, and on a shared 2-core machine a second OpenMP thread that gets descheduled
    makes every parallel region wait for it (100× slower steps were measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

class AffineScore(nn.Module):
    """s(y) = A y + b: the score family of Gaussians (exact minimizer −Σ⁻¹(y − μ))."""

    def __init__(self, d: int):
        super().__init__()
        self.A = nn.Parameter(torch.zeros(d, d, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, y, cond=None):
        return y @ self.A.T + self.b


def _gaussian(d, n, g):
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    Sigma = A @ A.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    mu = torch.randn(d, generator=g, dtype=torch.float64)
    y = mu + torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(Sigma).T
    return y, mu, Sigma


def test_jacobian_trace_matches_autograd():
    g = torch.Generator().manual_seed(0)
    net = ScoreNet(3, hidden=16, depth=2, n_cond=1).double()
    y = torch.randn(7, 3, generator=g, dtype=torch.float64)
    c = torch.randn(7, 1, generator=g, dtype=torch.float64)
    s, tr = jacobian_trace(net, y, c)
    jac = torch.stack([torch.autograd.functional.jacobian(lambda q: net(q[None], c[i : i + 1])[0], y[i]) for i in range(7)])
    torch.testing.assert_close(s, net(y, c))
    torch.testing.assert_close(tr, jac.diagonal(dim1=-2, dim2=-1).sum(-1))


def test_hyvarinen_recovers_gaussian_score():
    """Exact SM with an affine model: the empirical minimizer is −Σ̂⁻¹(y − μ̂) (closed form)."""
    g = torch.Generator().manual_seed(1)
    y, mu, Sigma = _gaussian(3, 20_000, g)
    model = AffineScore(3)
    train_score_net(model, y, method="exact", steps=700, batch_size=1024, lr=0.05, generator=g, progress=False)
    P = torch.linalg.inv(Sigma)
    torch.testing.assert_close(model.A.detach(), -P, atol=0.08, rtol=0.0)
    torch.testing.assert_close(model.b.detach(), P @ mu, atol=0.08, rtol=0.0)


def test_hyvarinen_mlp_recovers_gaussian_score():
    g = torch.Generator().manual_seed(2)
    y, mu, Sigma = _gaussian(2, 8192, g)
    learned = fit_score(y.float(), steps=500, hidden=64, depth=2, lr=3e-3, generator=g, progress=False)
    q = mu + torch.randn(500, 2, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(Sigma).T
    true = -(q - mu) @ torch.linalg.inv(Sigma).T
    nmse = float(((learned(q) - true) ** 2).sum() / (true**2).sum())
    assert nmse < 0.02, nmse
    assert learned.train_result.method == "exact" and learned(q).dtype == torch.float64


def test_ssm_vr_agrees_with_exact_on_small_d():
    """E_v[SSM-VR] = exact Hyvärinen loss (E[vᵀJv] = tr J), for a fixed network, both v laws."""
    g = torch.Generator().manual_seed(3)
    net = ScoreNet(4, hidden=32, depth=2).double()
    y = torch.randn(256, 4, generator=g, dtype=torch.float64)
    exact = hyvarinen_loss(net, y).item()
    for dist in ("gaussian", "rademacher"):
        sliced = sliced_score_matching_vr_loss(net, y, n_projections=400, generator=g, distribution=dist).item()
        assert sliced == pytest.approx(exact, abs=0.02 * (1 + abs(exact))), (dist, sliced, exact)
    # ... and gradients agree in expectation
    net.zero_grad()
    hyvarinen_loss(net, y).backward()
    g_exact = torch.cat([p.grad.flatten() for p in net.parameters()])
    net.zero_grad()
    sliced_score_matching_vr_loss(net, y, n_projections=400, generator=g).backward()
    g_sliced = torch.cat([p.grad.flatten() for p in net.parameters()])
    cos = torch.nn.functional.cosine_similarity(g_exact, g_sliced, dim=0)
    assert float(cos) > 0.98


def test_ssm_vr_training_matches_exact_training():
    """Affine model: SSM-VR training lands on the same Gaussian score as exact SM."""
    g = torch.Generator().manual_seed(4)
    y, mu, Sigma = _gaussian(2, 20_000, g)
    fits = {}
    for method in ("exact", "ssm_vr"):
        model = AffineScore(2)
        train_score_net(model, y, method=method, steps=700, batch_size=1024, lr=0.05, n_projections=4,
                        generator=torch.Generator().manual_seed(5), progress=False)
        fits[method] = model.A.detach()
    torch.testing.assert_close(fits["ssm_vr"], fits["exact"], atol=0.08, rtol=0.0)


def test_conditional_net_serves_several_levels():
    """One ConditionalScoreNet learns N(0, (τ²+σ²)I) scores at three known levels σ."""
    g = torch.Generator().manual_seed(6)
    sigmas = [0.2, 0.4, 0.8]
    groups = [torch.randn(4096, 2, generator=g) * (0.3**2 + s**2) ** 0.5 for s in sigmas]
    learned = fit_score(groups, sigmas, steps=400, hidden=64, depth=2, lr=3e-3, generator=g, progress=False)
    assert learned.conditional
    for s in sigmas:
        q = torch.randn(500, 2, generator=g) * (0.3**2 + s**2) ** 0.5
        true = -q / (0.3**2 + s**2)
        nmse = float(((learned(q, s) - true) ** 2).sum() / (true**2).sum())
        assert nmse < 0.05, (s, nmse)
    with pytest.raises(ValueError, match="sigma"):
        learned(torch.zeros(2, 2))


def test_trainer_is_seeded():
    y = torch.randn(512, 2, generator=torch.Generator().manual_seed(7))
    a = fit_score(y, steps=15, hidden=8, depth=1, generator=torch.Generator().manual_seed(8), progress=False)
    b = fit_score(y, steps=15, hidden=8, depth=1, generator=torch.Generator().manual_seed(8), progress=False)
    assert a.train_result.losses == b.train_result.losses
    torch.testing.assert_close(a(y[:5]), b(y[:5]), rtol=0, atol=0)


def test_bad_inputs_raise_named_errors():
    net = ScoreNet(2, hidden=8, depth=1)
    y = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="generator"):
        train_score_net(net, y, generator=0)
    with pytest.raises(ValueError, match="method"):
        train_score_net(net, y, method="denoising", generator=torch.Generator())
    with pytest.raises(ValueError, match="steps"):
        train_score_net(net, y, steps=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="y"):
        hyvarinen_loss(net, torch.zeros(4))
    with pytest.raises(ValueError, match="sigmas"):
        fit_score([y, y], [0.1], generator=torch.Generator())
    with pytest.raises(ValueError, match="empty"):
        fit_score([y, y[:0]], [0.1, 0.2], generator=torch.Generator())
    with pytest.raises(ValueError, match="conditional"):
        ScoreNet(2, n_cond=1)(y)
    with pytest.raises(ValueError, match="sigma"):
        ConditionalScoreNet(2, hidden=4, depth=1)(y, -1.0)
    with pytest.raises(ValueError, match="distribution"):
        sliced_score_matching_vr_loss(net, y, generator=torch.Generator(), distribution="uniform")
