"""is_score: the importance-sampling oracle vs the float64 reference, quadrature and closed forms."""

import math

import numpy as np
import pytest
import scipy.integrate
import torch

import etweedie
from conftest import BACKEND_DEVICE, BACKEND_IDS, assert_close_to_ref, gen, random_metric


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["none", "isotropic", "diagonal", "block2", "dense"])
@pytest.mark.parametrize("beta", [0.3, 1.0, 1.4, 2.0])
@pytest.mark.parametrize("offset", [0.0, 1e3], ids=["origin", "1e3"])
def test_matches_float64_reference(backend, device, kind, beta, offset, seed):
    """Score, posterior mean and ESS; a bank 1e3 from the origin too (a dense metric whitens
    y − c and the bank − c, c its first point, and shifts the mean back)."""
    g = gen(seed)
    Q, M, d = 37, 1000, 4  # M not a multiple of the kernel's tile
    bank = (torch.randn(M, d, generator=g, dtype=torch.float64) + offset).float().double()
    y = (bank[:Q] + 0.6 * torch.randn(Q, d, generator=g, dtype=torch.float64)).float().double()
    y[0] = bank[5]  # a query exactly on a bank point
    metric = random_metric(kind, 1, d, g, per_row=False)
    outs = {}
    for tag, dtype, be in [("k", torch.float32, backend), ("r32", torch.float32, "reference"), ("r64", torch.float64, "reference")]:
        dev = device if tag == "k" else "cpu"
        m = None if metric is None else etweedie.Metric(metric.kind, metric.param.to(dev, dtype))
        law = etweedie.GeneralizedGaussian(beta, 1.7, m, dim=d)
        outs[tag] = etweedie.is_score(y.to(dev, dtype), bank.to(dev, dtype), law, backend=be, chunk=16)
    for i, name in enumerate(["score", "mean", "ess"]):
        assert_close_to_ref(outs["k"][i], outs["r32"][i], outs["r64"][i], name=f"{name}[{kind}, beta={beta}]", seed=seed, atol_scale=2e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE + [("reference", "cpu")], ids=BACKEND_IDS + ["reference"])
def test_far_queries_do_not_underflow(backend, device):
    """All weights underflow in float32 without the running max: the log-sum-exp keeps them."""
    bank = torch.tensor([[0.0, 0.0], [1.0, 0.0]], device=device)
    y = torch.tensor([[60.0, 0.0]], device=device)
    s, mean, ess = etweedie.is_score(y, bank, etweedie.GeneralizedGaussian(2.0, 1.0), backend=backend)
    # weights ∝ exp(−(60−x)²/2): ratio e^{59.5} — effectively all mass on x = 1
    torch.testing.assert_close(mean, torch.tensor([[1.0, 0.0]], device=device))
    torch.testing.assert_close(s, torch.tensor([[-59.0, 0.0]], device=device))
    assert abs(float(ess) - 1.0) < 1e-6


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_gaussian_noise_matches_closed_form(backend, device):
    """Gaussian bank N(0, τ²I) and Gaussian noise σ²: score −y/(τ²+σ²), mean τ²y/(τ²+σ²)."""
    g = gen(1234)
    d, M, tau, sig = 2, 200_000, 1.0, 0.5
    bank = tau * torch.randn(M, d, generator=g, dtype=torch.float64)
    y = torch.tensor([[0.3, -0.4], [1.0, 0.5], [-0.8, 0.0]], dtype=torch.float64)
    law = etweedie.GeneralizedGaussian(2.0, 1.0, etweedie.Metric.isotropic(sig**2))
    s, mean, ess = etweedie.is_score(y.to(device), bank.to(device), law, backend=backend)
    exact = -y / (tau**2 + sig**2)
    # MC error of a self-normalized IS estimate ~ posterior std / sqrt(ESS) / σ²
    post_std = tau * sig / math.sqrt(tau**2 + sig**2)
    tol = 6 * post_std / sig**2 / ess.min().sqrt()
    assert (s.cpu() - exact).abs().max() < tol
    assert (mean.cpu() - tau**2 * y / (tau**2 + sig**2)).abs().max() < 6 * post_std / ess.min().sqrt()
    assert float(ess.min()) > 1000


@pytest.mark.parametrize("beta", [1.0, 1.4])
def test_non_gaussian_noise_matches_quadrature_1d(beta):
    """1-D: a two-component Gaussian-mixture prior, generalized-Gaussian noise with β ≠ 2.
    The noisy score p_Y'/p_Y by numerical quadrature vs is_score on a large bank."""
    lam = 1.8
    w, mus, sds = np.array([0.3, 0.7]), np.array([-1.0, 1.5]), np.array([0.4, 0.6])
    prior = lambda x: sum(wk * np.exp(-0.5 * ((x - m) / s) ** 2) / (s * np.sqrt(2 * np.pi)) for wk, m, s in zip(w, mus, sds))  # noqa: E731
    q = lambda u: np.exp(-(lam / beta) * np.abs(u) ** beta)  # noqa: E731  (unnormalized is fine)
    dq = lambda u: -lam * np.abs(u) ** (beta - 1) * np.sign(u) * q(u)  # noqa: E731

    g = gen(99)
    M = 400_000
    comp = torch.multinomial(torch.tensor(w), M, replacement=True, generator=g)
    bank = torch.tensor(mus)[comp] + torch.tensor(sds)[comp] * torch.randn(M, generator=g, dtype=torch.float64)
    ys = np.array([-1.7, -0.4, 0.2, 1.1, 2.6])
    law = etweedie.GeneralizedGaussian(beta, lam, dim=1)
    s, _, ess = etweedie.is_score(torch.tensor(ys).unsqueeze(-1), bank.unsqueeze(-1), law)
    for i, yv in enumerate(ys):
        pts = [yv, *mus]
        num = scipy.integrate.quad(lambda x: prior(x) * dq(yv - x), -10, 10, points=pts, limit=200)[0]
        den = scipy.integrate.quad(lambda x: prior(x) * q(yv - x), -10, 10, points=pts, limit=200)[0]
        exact = num / den
        # IS error ≲ (spread of the score terms)/sqrt(ESS); the terms are bounded by λ·(range)^{β−1}
        tol = 6 * lam * 3.0 ** (beta - 1) / math.sqrt(float(ess[i]))
        assert abs(float(s[i, 0]) - exact) < tol, f"y={yv}: is_score {float(s[i, 0]):.4f} vs quadrature {exact:.4f} (tol {tol:.4f})"


def test_bad_input():
    y, bank = torch.zeros(3, 2), torch.zeros(10, 2)
    law = etweedie.GeneralizedGaussian(1.4, 1.0)
    with pytest.raises(ValueError, match=r"bank must have shape \(M, d=2\)"):
        etweedie.is_score(y, torch.zeros(10, 3), law)
    with pytest.raises(ValueError, match="at least one clean point"):
        etweedie.is_score(y, torch.zeros(0, 2), law)
    with pytest.raises(TypeError, match="noise_law must be a GeneralizedGaussian"):
        etweedie.is_score(y, bank, 1.4)
    with pytest.raises(TypeError, match="bank must have y's dtype torch.float32, got torch.float64"):
        etweedie.is_score(y, bank.double(), law)
    with pytest.raises(ValueError, match=r"the dimension d must be >= 1, got y of shape \(3, 0\)"):
        etweedie.is_score(torch.zeros(3, 0), torch.zeros(10, 0), law)
    with pytest.raises(ValueError, match="chunk must be a positive int, got True"):
        etweedie.is_score(y, bank, law, chunk=True)
    with pytest.raises(ValueError, match="scalar beta and lam"):
        etweedie.is_score(y, bank, etweedie.GeneralizedGaussian(torch.tensor([1.0, 1.5]), 1.0))
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        etweedie.is_score(y, bank, law, chunk=0)
