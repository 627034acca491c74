"""The level plan, the noise-transport sampler and the probability-flow ODE samplers.

Checked where the right answer is known: Gamma quantiles against torch's incomplete gamma, the
transported noise against the target law's moments, the ring's exact posterior (ED to the ring),
an exact discrete (bank) posterior under a path whose β, λ and Σ all change (the final draws must
be uniform over the bank), and a Gaussian data law whose probability-flow map is closed-form.
"""

from __future__ import annotations

import math

import pytest
import torch

from etweedie.data import EightGaussians
from etweedie.posteriors import KnownPosterior
from etweedie.evaluation import signed_energy_distance
from etweedie.noise import NoiseParams
from etweedie.sample import GeometricRMS, NoisePath, get_path, level_times
from etweedie.sample import (
    DrawCounter,
    LevelPlan,
    gamma_quantile_map,
    initial_states,
    radius_map,
    sample_ode,
    sample_transport,
    transport_noise,
)

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- the radius map
@pytest.mark.parametrize("a_from,a_to", [(1.0, 1.43), (1.43, 1.0), (2.0, 5.0), (392.0, 560.0), (560.0, 392.0)])
def test_gamma_quantile_map_keeps_each_tail_probability(a_from, a_to):
    a = torch.tensor(a_from, dtype=F64)
    # from deep in the lower tail to deep in the upper tail of Gamma(a_from)
    probs = torch.tensor([1e-12, 1e-6, 0.01, 0.3, 0.5, 0.7, 0.99], dtype=F64)
    grid = torch.linspace(1e-3, 30 * a_from + 60, 200_000, dtype=F64)
    cdf = torch.special.gammainc(a, grid)
    g = grid[torch.searchsorted(cdf, probs).clamp_max(grid.numel() - 1)]
    g = torch.cat([g, a_from + 8 * math.sqrt(a_from) + torch.tensor([0.0, 10.0], dtype=F64)])
    out = gamma_quantile_map(g, a_from, a_to)
    b = torch.tensor(a_to, dtype=F64)
    lower, upper = torch.special.gammainc(a, g), torch.special.gammaincc(a, g)
    got_lower, got_upper = torch.special.gammainc(b, out), torch.special.gammaincc(b, out)
    left = lower < 0.5
    assert torch.allclose(got_lower[left], lower[left], rtol=1e-8, atol=0)
    assert torch.allclose(got_upper[~left], upper[~left], rtol=1e-8, atol=0)


def test_gamma_quantile_map_is_the_identity_for_equal_shapes_and_keeps_zero():
    g = torch.tensor([0.0, 0.3, 7.0, 1e3], dtype=F64)
    assert torch.equal(gamma_quantile_map(g, 3.0, 3.0), g)
    assert float(gamma_quantile_map(torch.zeros(1, dtype=F64), 2.0, 4.0)) == 0.0


def test_radius_map_at_equal_beta_is_the_lambda_rescaling():
    r = torch.tensor([0.1, 1.0, 9.0], dtype=F64)
    src, dst = NoiseParams(1.4, 1.8, 0.5), NoiseParams(1.4, 1.1, 0.2)
    assert torch.allclose(radius_map(r, 784, src, dst), r * (1.8 / 1.1) ** (1 / 1.4), rtol=1e-12)


@pytest.mark.parametrize("d,churn", [(2, 0.0), (64, 0.0), (64, 0.5), (2, 1.0)])
def test_transport_noise_gives_the_target_law(d, churn):
    """Draws of the level-t law, transported (with part of the noise renewed), have the level-s
    law's covariance and radius moment."""
    src, dst = NoiseParams(2.0, 1.0, 0.9, 0.3, 0.0), NoiseParams(1.3, 2.2, 0.4, -0.2, 0.5)
    law_t, law_s = src.noise(d), dst.noise(d)
    e = law_t.sample((200_000,), generator=_gen(0))
    fresh = torch.randn(e.shape, generator=_gen(1), dtype=e.dtype)
    out = transport_noise(e, d, src, dst, src.metric(d), dst.metric(d), churn=churn, fresh=fresh)
    # E (λ/β) ‖u‖_P^β = d/β under GeneralizedGaussian(β, λ, Σ)
    moment = (2.2 / 1.3) * dst.metric(d).sq_norm(out).pow(1.3 / 2).mean()
    assert abs(float(moment) / (d / 1.3) - 1) < 0.01
    cov = out.T @ out / out.shape[0]
    want = law_s.covariance(d)
    assert torch.allclose(cov, want, atol=0.02 * float(want.diagonal().mean()))
    if churn == 1.0:  # all renewed: independent of e
        assert abs(float(torch.corrcoef(torch.stack([e[:, 0], out[:, 0]]))[0, 1])) < 0.01


def test_transport_noise_keeps_zero_rows():
    p = NoiseParams(1.5, 1.2, 0.3)
    out = transport_noise(torch.zeros(3, 4), 4, p, NoiseParams(1.8, 1.0, 0.1), p.metric(4), Metric_of(1.8, 0.1))
    assert torch.equal(out, torch.zeros(3, 4))


def Metric_of(beta, sigma):
    return NoiseParams(beta, 1.0, sigma).metric(4)


# ---------------------------------------------------------------------------- the plan
def test_lead_in_prepends_levels_at_the_first_levels_shape():
    base = LevelPlan.build(get_path("mnist_generalized_nondiagonal"), level_times(64))
    plan = base.lead_in(16, 6.0)
    assert len(plan) == 80
    r_start = 6.0 * 1.8 ** (-1 / 1.4)
    assert math.isclose(float(plan.rms[0]), r_start, rel_tol=1e-12)
    assert torch.equal(plan.rms[16:], base.rms)
    assert bool((plan.rms[1:] < plan.rms[:-1]).all())
    head = plan.params._tensors()
    assert all(bool((f[:16] == f[16]).all()) for i, f in enumerate(head) if i != 2)  # β, λ, u, v of level 0
    assert base.lead_in(0, 6.0) is base
    with pytest.raises(ValueError, match="higher noise"):
        base.lead_in(4, 1.0)
    with pytest.raises(ValueError, match="schedule must be None"):
        LevelPlan.of(plan, level_times(3))


# ---------------------------------------------------------------------------- the transport sampler
RING = EightGaussians()


def _ring_reference(n=4096):
    return RING.sample(n, generator=_gen(99))[0]


@pytest.mark.parametrize("name", ["gaussian", "nondiagonal"])
def test_transport_on_the_ring_lands_on_the_ring(name):
    """Started from a lead-in at σ = 20, where the ring collapsed to 0 is nearly the exact marginal."""
    plan = LevelPlan.build(get_path(name), level_times(21)).lead_in(10, 20.0)
    n = 2048 if name == "gaussian" else 512
    y0 = initial_states(plan, None, n, 2, generator=_gen(1))
    x = sample_transport(KnownPosterior(), y0, plan, None, generator=_gen(2), disable=True)
    ed = signed_energy_distance(x, _ring_reference())
    assert ed < (0.01 if name == "gaussian" else 0.03), ed
    angles = torch.atan2(x[:, 1], x[:, 0])
    modes = torch.bincount(((angles / (2 * math.pi / 8)).round() % 8).long(), minlength=8)
    assert int((modes > 0.08 * n).sum()) == 8, modes.tolist()


class _BankPosterior:
    """The exact posterior of data uniform on a few points, under any generalized-Gaussian level."""

    def __init__(self, bank):
        self.bank = bank

    def sample(self, y, eta, n, *, generator):
        law = NoiseParams.from_eta(eta[0].double()).noise(self.bank.shape[1])
        w = torch.softmax(law.log_prob(y.double()[:, None, :] - self.bank[None]), 1)
        return self.bank[torch.multinomial(w, n, replacement=True, generator=generator)].to(y.dtype)


# β, λ and the covariance all change along the way; the start is far from the data's marginal
_CHANGING = NoisePath("changing", beta=lambda t: 2.0 - 0.8 * t, lam=lambda t: 1.0 + 1.2 * t,
                      u=lambda t: 0.5 * t, v=lambda t: -0.4 * t, rms=GeometricRMS(1.5, 0.05))


def test_transport_with_an_exact_posterior_keeps_the_data_law_on_a_changing_path():
    bank = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.5, 0.0], [0.0, 2.0, 0.0, -1.0]], dtype=F64)
    times = level_times(12)
    n = 6000
    g = _gen(3)
    # exact start: bank points (uniform) plus the first level's noise
    start = bank[torch.randint(0, 3, (n,), generator=g)]
    y0 = start + LevelPlan.build(_CHANGING, times).noise(0, 4).sample((n,), generator=g)
    x = sample_transport(_BankPosterior(bank), y0, _CHANGING, times, generator=g, disable=True)
    picked = torch.cdist(x, bank).argmin(1)
    assert torch.cdist(x, bank).min(1).values.max() == 0  # final draws are bank points
    counts = torch.bincount(picked, minlength=3).double()
    chi2 = float(((counts - n / 3) ** 2 / (n / 3)).sum())
    assert chi2 < 13.8, counts.tolist()  # 99.9 % point of χ²(2)


def test_transport_counts_its_draws_and_reproduces_from_its_seed():
    path, times = get_path("gaussian"), level_times(5)
    y0 = initial_states(path, times, 6, 2, generator=_gen(4))
    counted = DrawCounter(KnownPosterior())
    kw = dict(warmup=2, gibbs_steps=1, gibbs_min_rms=0.1, mean_draws=3, final_average=5, draw_batch=2, disable=True)
    a = sample_transport(counted, y0, path, times, generator=_gen(5), **kw)
    gibbs = int((LevelPlan.build(path, times).rms[1:] >= 0.1).sum())
    assert counted.draws_per_chain(6) == 2 + gibbs + 4 * 3 + 5
    b = sample_transport(KnownPosterior(), y0, path, times, generator=_gen(5), **kw)
    assert torch.equal(a, b)
    levels = []
    sample_transport(KnownPosterior(), y0, path, times, generator=_gen(5), callback=levels.append, disable=True)
    assert [i["level"] for i in levels] == list(range(5)) and levels[0]["state"].shape == (6, 2)


def test_transport_refuses_bad_arguments():
    path, times = get_path("gaussian"), level_times(3)
    y0 = torch.zeros(4, 2)
    post, g = KnownPosterior(), _gen(0)
    with pytest.raises(TypeError, match="sample"):
        sample_transport(object(), y0, path, times, generator=g)
    with pytest.raises(ValueError, match="d even"):
        sample_transport(post, torch.zeros(4, 3), path, times, generator=g)
    with pytest.raises(ValueError, match="finite"):
        sample_transport(post, torch.full((4, 2), float("nan")), path, times, generator=g)
    with pytest.raises(ValueError, match="warmup"):
        sample_transport(post, y0, path, times, generator=g, warmup=-1)
    with pytest.raises(ValueError, match="churn"):
        sample_transport(post, y0, path, times, generator=g, churn=1.5)
    with pytest.raises(TypeError, match="generator"):
        sample_transport(post, y0, path, times, generator=None)
    with pytest.raises(TypeError, match="y0"):
        sample_transport(post, y0.to(torch.int64), path, times, generator=g)


def test_transport_of_an_empty_batch_is_empty():
    path, times = get_path("gaussian"), level_times(3)
    out = sample_transport(KnownPosterior(), torch.zeros(0, 2), path, times, generator=_gen(0), disable=True)
    assert out.shape == (0, 2)


# ---------------------------------------------------------------------------- the ODE samplers
class _GaussianMean:
    """Data N(μ, τ² I) under N(0, r² S) noise: every "draw" is the exact posterior mean."""

    def __init__(self, mu, tau):
        self.mu, self.tau = mu, tau

    def sample(self, y, eta, n, *, generator):
        p = NoiseParams.from_eta(eta[0].double())
        C = p.noise(y.shape[1]).covariance(y.shape[1])
        A = self.tau ** 2 * torch.eye(y.shape[1], dtype=F64) + C
        mean = self.mu + (y.double() - self.mu) @ torch.linalg.solve(A, self.tau ** 2 * torch.eye(y.shape[1], dtype=F64))
        return mean[:, None, :].expand(-1, n, -1).to(y.dtype)


@pytest.mark.parametrize("solver", ["heun", "dpmpp_2m"])
def test_ode_follows_the_closed_form_flow_of_gaussian_data(solver):
    """Isotropic Gaussian noise: y_r = μ + sqrt((τ² + r²)/(τ² + r_0²)) (y_0 − μ), then the mean at r_L."""
    path = NoisePath("g", beta=2.0, lam=1.0, u=0.0, v=0.0, rms=GeometricRMS(2.0, 0.05))
    times = level_times(40)
    mu, tau = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=F64), 0.7
    y0 = torch.randn(64, 4, generator=_gen(6), dtype=F64) * 3
    out = sample_ode(_GaussianMean(mu, tau), y0, path, times, n_posterior=1, solver=solver, generator=_gen(7),
                     disable=True)
    r0, rl = 2.0, 0.05
    y_end = mu + math.sqrt((tau ** 2 + rl ** 2) / (tau ** 2 + r0 ** 2)) * (y0 - mu)
    want = mu + (tau ** 2 / (tau ** 2 + rl ** 2)) * (y_end - mu)
    err = float((out - want).abs().max() / (want - mu).abs().max())
    assert err < (2e-3 if solver == "heun" else 5e-3), err


def test_ode_refuses_non_gaussian_and_shape_changing_paths():
    y0, g = torch.zeros(2, 2), _gen(0)
    with pytest.raises(ValueError, match="Gaussian noise"):
        sample_ode(KnownPosterior(), y0, get_path("isotropic"), level_times(3), n_posterior=2, generator=g)
    shape = NoisePath("s", beta=2.0, lam=1.0, u=lambda t: 0.3 * t, v=0.0, rms=GeometricRMS(1.0, 0.1))
    with pytest.raises(ValueError, match="fixed covariance shape"):
        sample_ode(KnownPosterior(), y0, shape, level_times(3), n_posterior=2, generator=g)
    with pytest.raises(ValueError, match="solver"):
        sample_ode(KnownPosterior(), y0, get_path("gaussian"), level_times(3), n_posterior=2, generator=g, solver="rk4")
