"""Cross-checks of the ops against libraries people already trust, in float64.

* ``scoringrules.es_ensemble`` — energy score, β = 1, Euclidean; its ``nrg`` estimator is the
  V-statistic pair term 1/(2M²) Σ_{i,j} (our ``fair=False``), ``fair`` the U-statistic
  1/(2M(M−1)) Σ_{i≠j} (our default).
* ``dcor.energy_distance`` — 2·mean‖a−b‖^β − mean‖a−a'‖^β − mean‖b−b'‖^β with ``exponent`` = β;
  its default ``estimation_stat="V"`` averages over all pairs including i = j (our
  ``unbiased=False``), ``"U"`` over the pairs i < j of the upper triangle (the same mean as over
  i ≠ j: our ``unbiased=True``).  No scaling differs.
* Engression's ``energy_loss(x_true (B, d), x_est, beta)`` — x_est is a list of m tensors
  (B, d) or one (m·B, d) tensor stacked sample-major (rows j·B … (j+1)·B − 1 hold draw j for
  every point); it returns the batch mean of the fair energy score.  For a non-integer β it
  adds EPS = 1e-5 to every distance before the power (a smoothing of the gradient at 0), so
  there it agrees to O(1e-5) only; for integer β it is exact.
* Tweedie's formula: with a Gaussian prior N(μ₀, Σ₀) and Gaussian noise of covariance C, the
  posterior is N(m(y), V), V = (Σ₀⁻¹ + C⁻¹)⁻¹, m(y) = V(Σ₀⁻¹μ₀ + C⁻¹y), and the marginal score is
  −(Σ₀ + C)⁻¹(y − μ₀) = C⁻¹(m(y) − y).  The Energy-Tweedie score at β = 2 is linear in the
  draws, so draws whose mean is exactly m(y) (antithetic pairs) must give the closed form to
  rounding, and i.i.d. draws within Monte Carlo error.

Each peer is optional here; CI installs them (the ``test`` extra), and a missing one skips
with the reason.
"""

from __future__ import annotations

import math

# dcor and scoringrules compile numba kernels on first import (cached afterwards).  NUMBA_DISABLE_JIT
# is no way round it: scoringrules' gufuncs are compiled even then and fail to type the plain-Python
# helpers they call (hidden wherever a numba cache from an earlier JIT run exists).
import pytest
import torch

import etweedie
from etweedie import Metric
from etweedie.interop import GaussianDenoiser, score_from_sampler

from conftest import gen


def _draws(seed, *shape):
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------- scoringrules
@pytest.mark.parametrize("estimator,fair", [("nrg", False), ("fair", True)])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_energy_score_matches_scoringrules(seed, estimator, fair, backend):
    sr = pytest.importorskip("scoringrules", reason="scoringrules not installed (pip install scoringrules; in the test extra)")
    samples = 1.5 * _draws(seed, 7, 13, 3) + 0.3
    target = _draws(seed + 1, 7, 3)
    ours = etweedie.energy_score(samples, target, beta=1.0, fair=fair, backend=backend)
    theirs = torch.as_tensor(sr.es_ensemble(target.numpy(), samples.numpy(), estimator=estimator, backend="numpy"))
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-13), f"seed={seed}: max diff {(ours - theirs).abs().max():.3g}"


# ---------------------------------------------------------------------------- dcor
@pytest.mark.parametrize("beta", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("stat,unbiased", [("U", True), ("V", False)])
def test_energy_distance_matches_dcor(seed, beta, stat, unbiased):
    dcor = pytest.importorskip("dcor", reason="dcor not installed (pip install dcor; in the test extra)")
    a = _draws(seed, 40, 3)
    b = 0.8 * _draws(seed + 1, 31, 3) + 0.4
    ours = float(etweedie.energy_distance(a, b, beta=beta, unbiased=unbiased))
    theirs = float(dcor.energy_distance(a.numpy(), b.numpy(), exponent=beta, estimation_stat=stat))
    assert math.isclose(ours, theirs, rel_tol=1e-11, abs_tol=1e-13), f"seed={seed}: {ours!r} vs dcor {theirs!r}"


# ---------------------------------------------------------------------------- engression
def _engression_loss():
    module = pytest.importorskip(
        "engression.loss_func", reason="engression not installed (pip install engression; in the test extra)"
    )
    return module.energy_loss


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_energy_score_matches_engression_energy_loss(seed, beta):
    energy_loss = _engression_loss()
    B, m, d = 9, 6, 4
    samples = _draws(seed, B, m, d)
    target = _draws(seed + 1, B, d)
    ours = etweedie.energy_score(samples, target, beta=beta).mean()
    stacked = samples.transpose(0, 1).reshape(m * B, d)  # sample-major: rows j·B … (j+1)·B − 1 = draw j
    as_list = list(samples.unbind(1))
    for x_est in (stacked, as_list):
        theirs = energy_loss(target, x_est, beta=beta, verbose=False)
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-13), f"seed={seed}: {ours.item()!r} vs {theirs.item()!r}"
    loss, s1, s2 = energy_loss(target, stacked, beta=beta, verbose=True)
    assert torch.allclose(loss, s1 - s2 / 2)


def test_energy_score_matches_engression_up_to_its_eps_smoothing(seed):
    # Non-integer β: Engression adds EPS = 1e-5 to every distance before the power.
    energy_loss = _engression_loss()
    samples, target = _draws(seed, 9, 6, 4), _draws(seed + 1, 9, 4)
    ours = etweedie.energy_score(samples, target, beta=1.5).mean()
    theirs = energy_loss(target, list(samples.unbind(1)), beta=1.5, verbose=False)
    assert abs(float(ours - theirs)) < 1e-4, f"seed={seed}: {ours.item()!r} vs {theirs.item()!r}"


# ---------------------------------------------------------------------------- Tweedie, Gaussian prior
def _spd(seed, d, scale):
    A = _draws(seed, d, d)
    return scale * (A @ A.T / d + 0.5 * torch.eye(d, dtype=torch.float64))


def _gaussian_problem(seed, d=3, rows=5):
    mu0 = _draws(seed, d)
    Sigma0 = _spd(seed + 1, d, 1.0)
    lam = 1.7
    Sigma = _spd(seed + 2, d, 0.3)  # the metric's Σ; the noise covariance is C = Σ/λ at β = 2
    C = Sigma / lam
    y = _draws(seed + 3, rows, d) * 1.5 + mu0
    V = torch.linalg.inv(torch.linalg.inv(Sigma0) + torch.linalg.inv(C))
    m = (V @ (torch.linalg.solve(Sigma0, mu0)[:, None] + torch.linalg.solve(C, y.T))).T
    exact_score = -torch.linalg.solve(Sigma0 + C, (y - mu0).T).T
    return dict(mu0=mu0, Sigma0=Sigma0, lam=lam, Sigma=Sigma, C=C, y=y, V=V, m=m, exact_score=exact_score)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_et_score_at_beta_2_is_tweedie_with_the_exact_posterior_mean(seed, backend):
    p = _gaussian_problem(seed)
    half = torch.linalg.cholesky(p["V"]) @ _draws(seed + 4, p["y"].shape[0], 8, 3).unsqueeze(-1)
    draws = torch.cat([p["m"][:, None, :] + half.squeeze(-1), p["m"][:, None, :] - half.squeeze(-1)], dim=1)
    s = etweedie.et_score(p["y"], draws, beta=2.0, lam=p["lam"], metric=Metric.dense(p["Sigma"]), backend=backend)
    assert torch.allclose(s, p["exact_score"], rtol=1e-10, atol=1e-11), f"seed={seed}: max diff {(s - p['exact_score']).abs().max():.3g}"
    # Tweedie's denoiser from the same score: y + C s(y) = m(y).
    assert torch.allclose(p["y"] + s @ p["C"].T, p["m"], rtol=1e-10, atol=1e-11)


def test_score_from_sampler_converges_to_the_gaussian_closed_form(seed):
    p = _gaussian_problem(seed, d=2, rows=4)
    chol_V = torch.linalg.cholesky(p["V"])
    calls = []

    def sampler(y, n, generator):  # the exact posterior N(m(y), V), i.i.d. draws
        calls.append(n)
        m = (p["V"] @ (torch.linalg.solve(p["Sigma0"], p["mu0"])[:, None] + torch.linalg.solve(p["C"], y.T))).T
        z = torch.randn(*y.shape[:-1], n, y.shape[-1], generator=generator, dtype=y.dtype)
        return m.unsqueeze(-2) + z @ chol_V.T

    n = 40_000
    score = score_from_sampler(sampler, n_draws=n, generator=gen(seed))
    law = etweedie.GeneralizedGaussian(2.0, p["lam"], Metric.dense(p["Sigma"]))
    s = score(p["y"], law)
    # Monte Carlo error of C⁻¹(mean − y): std of each coordinate is sqrt(diag(C⁻¹ V C⁻¹)/n).
    Cinv = torch.linalg.inv(p["C"])
    sd = torch.sqrt(torch.diagonal(Cinv @ p["V"] @ Cinv) / n)
    z = (s - p["exact_score"]) / sd
    assert z.abs().max() < 5, f"seed={seed}: z-scores {z}"
    assert calls == [n]


def test_gaussian_denoiser_is_the_posterior_mean_for_isotropic_noise(seed):
    # Prior N(0, τ²I), noise N(0, σ²I): D(y, σ) = τ²/(τ² + σ²) · y exactly, from antithetic draws.
    tau2, d = 1.3, 3

    def sampler(y, n, generator, noise):
        sigma2 = torch.as_tensor(noise, dtype=y.dtype) ** 2
        shrink = (tau2 / (tau2 + sigma2)).unsqueeze(-1)
        sd = torch.sqrt(tau2 * sigma2 / (tau2 + sigma2)).unsqueeze(-1).unsqueeze(-1)
        z = torch.randn(*y.shape[:-1], n // 2, d, generator=generator, dtype=y.dtype)
        return (shrink * y).unsqueeze(-2) + sd * torch.cat([z, -z], dim=-2)

    denoiser = GaussianDenoiser(score_from_sampler(sampler, n_draws=16, generator=gen(seed)))
    y = _draws(seed, 6, d)
    sigma = torch.tensor([0.1, 0.5, 1.0, 2.0, 0.0, 3.0], dtype=torch.float64)
    out = denoiser(y, sigma)
    expected = torch.where(sigma[:, None] > 0, tau2 / (tau2 + sigma[:, None] ** 2) * y, y)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-13), f"seed={seed}: max diff {(out - expected).abs().max():.3g}"
