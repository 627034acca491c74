"""Annealed Langevin along noise-parameter paths: ground truth from the known posterior, wiring, CLI.

The end-to-end check samples the eight-Gaussians ring along the Gaussian path (β = 2, λ = 1,
isotropic), where the posterior is an exact Gaussian mixture, and asks the signed energy
distance to clean data to lie within the clean-draw noise floor.  The floor is measured, not
assumed: ``null_energy_distance`` gives the signed ED between independent clean draws of the
same sizes (n generated points vs the same m-point reference size), repeated R times; the floor
is its mean + 3 standard deviations.  A negative control (no annealing: one level at the
terminal noise, so the chains never leave their broad Gaussian start) must land far above it.

The edges are held to hand-written float64 formulas (a path's coordinates, a Langevin update
along a non-Gaussian, non-diagonal path, the estimator's profiled λ and objective) and, for bad
input, to a ValueError/TypeError naming the argument (never a deep torch error, a silently
ignored argument or a silent broadcast).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from etweedie.data import EightGaussians
from etweedie.estimate import (
    EstimatorSettings,
    estimate_noise,
    level_sampler,
    level_variance,
    profile_lambda,
    profiled_objective,
    shape_from_cholesky,
    zeta_from_beta,
)
from etweedie.posteriors import KnownPosterior
from etweedie.evaluation import mode_weight_tv, null_energy_distance, signed_energy_distance
from etweedie.noise import NoiseParams
from etweedie.sample import GeometricRMS, NoisePath, get_path, level_times
from etweedie.sample import ThroughputTimer, chunk_generators, initial_states, sample_langevin, step_sizes
from experiments.eight_gaussians import diffusion as diffusion_eval
from experiments.eight_gaussians.diffusion import main as cli_main

RING = EightGaussians()
F64 = torch.float64


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _y0(n, seed):
    return math.sqrt(2.04 + 0.83**2) * torch.randn(n, 2, generator=gen(seed))


def _c2(beta: float, d: int) -> float:
    """c²_{β,d} = β^{2/β} Γ((d+2)/β) / (d Γ(d/β)) (DESIGN §2)."""
    return math.exp((2 / beta) * math.log(beta) + math.lgamma((d + 2) / beta) - math.log(d) - math.lgamma(d / beta))


def _joint(s: float):
    """(β, λ, u, v, r) of the eight-Gaussians 'joint' path at time s (Eq. full5_paths)."""
    theta = math.pi / 2 + 2 * math.pi * s
    return (1.4 + 0.5 * math.sin(math.pi * s) ** 2, 1.8 + 0.4 * math.sin(2 * math.pi * s),
            0.6 * math.cos(theta), 0.6 * math.sin(theta), 0.83 * (0.0083 / 0.83) ** s)


# ---------------------------------------------------------------------------- the known posterior
def test_exact_posterior_matches_the_ring_sampler():
    y = 1.5 * torch.randn(500, 2, generator=gen(1), dtype=torch.float64)
    s = 0.3
    eta = NoiseParams(2.0, 1.0, s).eta()
    ours = KnownPosterior(method="exact").sample(y, eta, 128, generator=gen(2))
    ref = RING.posterior_sample(y, s, 128, gen(3))
    var = ref.var(1).sum(-1)  # per-query posterior variance
    err = (ours.mean(1) - ref.mean(1)).pow(2).sum(-1)
    assert err.mean().item() == pytest.approx((2 * var / 128).mean().item(), rel=0.25)
    assert ours.var(1).sum(-1).mean().item() == pytest.approx(var.mean().item(), rel=0.05)


def test_importance_posterior_agrees_with_the_exact_one_under_nondiagonal_gaussian_noise():
    y = torch.tensor([[1.0, 0.5], [-0.3, -1.9]], dtype=torch.float64).repeat_interleave(64, 0)
    eta = NoiseParams(2.0, 1.0, 0.3, 0.0, 0.6).eta()
    exact = KnownPosterior(method="exact").sample(y, eta, 256, generator=gen(4))
    imp = KnownPosterior(method="importance", n_proposals=512).sample(y, eta, 256, generator=gen(5))
    for q in range(2):
        e, i = exact[64 * q : 64 * (q + 1)].reshape(-1, 2), imp[64 * q : 64 * (q + 1)].reshape(-1, 2)
        assert torch.allclose(e.mean(0), i.mean(0), atol=0.03)
        assert torch.allclose(e.T.cov(), i.T.cov(), atol=0.01)


def test_known_posterior_shapes_mixed_rows_and_errors():
    post = KnownPosterior(n_proposals=16)
    eta = torch.stack([NoiseParams(2.0, 1.0, 0.3).eta(), NoiseParams(1.4, 1.8, 0.3, 0.0, 0.6).eta()])
    out = post.sample(torch.zeros(2, 2), eta, 5, generator=gen())
    assert out.shape == (2, 5, 2) and out.dtype == torch.float32
    assert post.sample(torch.zeros(3, 4, 2, dtype=torch.float64), eta[1], 2, generator=gen()).shape == (3, 4, 2, 2)
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., 2\)"):
        post.sample(torch.zeros(3, 3), eta[0], 2, generator=gen())
    with pytest.raises(ValueError, match="does not broadcast"):
        post.sample(torch.zeros(3, 2), eta, 2, generator=gen())
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        post.sample(torch.zeros(3, 2), eta[0], 2, generator=None)
    with pytest.raises(ValueError, match="method='exact' needs β = 2"):
        KnownPosterior(method="exact").sample(torch.zeros(2, 2), eta, 2, generator=gen())
    with pytest.raises(ValueError, match="method must be one of"):
        KnownPosterior(method="magic")
    with pytest.raises(TypeError, match="generator \\(needed to draw the bank\\) must be a torch.Generator"):
        KnownPosterior(method="sir")
    with pytest.raises(ValueError, match="bank must have shape"):
        KnownPosterior(method="sir", bank=torch.zeros(5, 3))
    bank, _ = RING.sample(2000, gen(6))
    assert KnownPosterior(method="sir", bank=bank).sample(torch.zeros(4, 2), eta[1], 3, generator=gen()).shape == (4, 3, 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        pytest.param(dict(bank=torch.zeros(10, 2, dtype=F64)), ValueError, "bank is used only by method='sir'",
                     id="bank-without-sir"),
        pytest.param(dict(method="sir", bank=torch.zeros(10, 2, dtype=torch.int64)), TypeError,
                     "bank must be a floating-point tensor .* got a torch.int64 tensor", id="integer-bank"),
    ],
)
def test_a_bank_outside_sir_is_refused_not_ignored(kwargs, error, match):
    with pytest.raises(error, match=match):
        KnownPosterior(**kwargs)


# ---------------------------------------------------------------------------- ground truth end to end
def _floor(n, m, repeats=20):
    null = null_energy_distance(lambda k, g: RING.sample(k, g)[0], n, m, repeats=repeats, generator=gen(100))
    return (null.mean() + 3 * null.std()).item()


def test_langevin_with_the_exact_posterior_reaches_the_clean_noise_floor():
    n = 1024
    floor = _floor(n, n)
    reference, _ = RING.sample(n, gen(200))
    path = get_path("gaussian", rms=GeometricRMS(0.83, 0.0083))
    x = sample_langevin(
        KnownPosterior(), _y0(n, 7), path, level_times(21),
        steps_per_level=5, n_posterior=32, step_scale=1e-4, generator=gen(8), disable=True,
    )
    ed = signed_energy_distance(x, reference)
    assert ed < floor, f"signed ED {ed:.5f} above the clean-draw floor {floor:.5f}"
    assert mode_weight_tv(x, RING.means()) < 0.06

    # negative control: no annealing (one level at the terminal noise) leaves the broad start
    control = sample_langevin(
        KnownPosterior(), _y0(n, 7), path, level_times(1),
        steps_per_level=5, n_posterior=32, step_scale=1e-4, generator=gen(8), disable=True,
    )
    assert signed_energy_distance(control, reference) > 3 * floor


def test_a_run_is_reproducible_from_its_seed():
    kwargs = dict(steps_per_level=2, n_posterior=8, step_scale=1e-4, disable=True)
    path, times = get_path("joint"), level_times(4)
    post = KnownPosterior(n_proposals=16)
    a = sample_langevin(post, _y0(64, 1), path, times, generator=gen(5), **kwargs)
    b = sample_langevin(post, _y0(64, 1), path, times, generator=gen(5), **kwargs)
    c = sample_langevin(post, _y0(64, 1), path, times, generator=gen(6), **kwargs)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------------- wiring
class _Recording:
    """A posterior returning x = 0 for every draw, recording its calls."""

    def __init__(self):
        self.calls = []

    def sample(self, y, eta, n, *, generator):
        self.calls.append((tuple(y.shape), eta.clone(), n))
        return y.new_zeros(*y.shape[:-1], n, y.shape[-1])


def test_each_update_is_the_fused_langevin_step_with_the_level_step_size():
    post = _Recording()
    path = get_path("gaussian")
    times = torch.tensor([0.0, 1.0], dtype=torch.float64)
    y0 = torch.tensor([[1.0, -2.0], [0.5, 0.25]], dtype=torch.float64)
    eps = 1e-4
    out = sample_langevin(post, y0, path, times, steps_per_level=1, n_posterior=3, step_scale=eps,
                          final_draw=False, generator=gen(9), disable=True)
    # x = 0 and β = 2: ŝ(y) = −λ Σ⁻¹ y with Σ = σ² I, λ = 1 → ŝ = −y / r²
    g = gen(9)
    y = y0.clone()
    r = path(times).realized_rms()
    for k in range(2):
        alpha = eps * float(r[k] / r[-1]) ** 2
        xi = torch.randn(y.shape, generator=g, dtype=y.dtype)
        y = y + alpha * (-y / float(r[k]) ** 2) + math.sqrt(2 * alpha) * xi
    assert torch.allclose(out, y, rtol=1e-10, atol=1e-12)
    assert [c[0] for c in post.calls] == [(2, 2), (2, 2)] and [c[2] for c in post.calls] == [3, 3]
    assert torch.allclose(post.calls[1][1][0], path(times[1]).eta())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_langevin_updates_along_a_nondiagonal_generalized_path_match_the_formula(dtype):
    """y ← y + α ŝ(y) + sqrt(2α) ξ, ŝ = −λ P (1/N) Σ ‖y − x‖_P^{β−2} (y − x), Σ = (σ/c)² I⊗S(u,v), in float64."""
    d, C, N, eps = 4, 5, 6, 1e-3
    X = torch.randn(C, N, d, generator=gen(2), dtype=F64)
    y0 = torch.randn(C, d, generator=gen(3), dtype=F64).T.contiguous().T  # non-contiguous start

    class Fixed:
        def sample(self, y, eta, n, *, generator):
            return X[:, :n].to(y.dtype)

    times = torch.tensor([0.3, 0.7], dtype=F64)
    out = sample_langevin(Fixed(), y0.to(dtype), get_path("joint"), times, steps_per_level=2, n_posterior=N,
                          step_scale=eps, final_draw=False, generator=gen(4), disable=True)
    g, y = gen(4), y0.clone()
    r_last = _joint(1.0 * times[-1].item())[-1]
    for s in times.tolist():
        beta, lam, u, v, r = _joint(s)
        S = torch.tensor([[1 + u, v], [v, 1 - u]], dtype=F64)
        P = torch.linalg.inv((r * lam ** (1 / beta)) ** 2 / _c2(beta, d) * torch.block_diag(S, S))
        alpha = eps * (r / r_last) ** 2
        for _ in range(2):
            U = y[:, None, :] - X
            q = torch.einsum("cni,ij,cnj->cn", U, P, U)
            score = -lam * (q ** ((beta - 2) / 2))[..., None].mul(U).mean(1) @ P
            xi = torch.randn(y.shape, generator=g, dtype=dtype).to(F64)
            y = y + alpha * score + math.sqrt(2 * alpha) * xi
    tol = 1e-12 if dtype == F64 else 1e-5
    assert out.dtype == dtype and torch.allclose(out.to(F64), y, rtol=tol, atol=tol)


def test_callback_timer_first_level_steps_and_final_draw():
    post = _Recording()
    path, times = get_path("rotating"), level_times(4)
    seen = []
    timer = ThroughputTimer()
    out = sample_langevin(post, torch.zeros(5, 3, 2), path, times, steps_per_level=2, n_posterior=4, step_scale=1e-5,
                          first_level_steps=6, generator=gen(), callback=seen.append, disable=True, timer=timer)
    assert out.shape == (5, 3, 2)
    assert [info["level"] for info in seen] == [0, 1, 2, 3]
    assert {"level", "t", "r", "step", "params", "eta", "state", "denoised"} <= set(seen[0])
    assert seen[2]["state"].shape == (5, 3, 2)
    assert [info["r"] for info in seen] == pytest.approx(path(times).realized_rms().tolist())
    assert [info["step"] for info in seen] == pytest.approx(step_sizes(path, times, 1e-5).tolist())
    # 6 updates at the first level, 2 at each other, then one final draw with n = 1
    assert len(post.calls) == 6 + 3 * 2 + 1 and post.calls[-1][2] == 1 and post.calls[0][0] == (15, 2)
    t = timer.as_dict()
    assert t["chain_steps"] == 15 * 12 and t["posterior_calls"] == 13 and t["levels"] == 4
    assert 0 <= t["posterior_share"] <= 1 and t["chain_steps_per_s"] > 0


def test_final_average_is_the_mean_of_k_draws_in_batches_of_n(seed):
    """final_average=K: the final state is the mean of K posterior draws, drawn n_posterior at a
    time from the same generator; K = 1 is bit for bit the single final draw."""
    path, times = get_path("gaussian"), level_times(3)
    y0 = torch.randn(6, 2, generator=gen(seed), dtype=torch.float64)
    kw = dict(steps_per_level=2, n_posterior=4, step_scale=1e-4, disable=True)
    plain = sample_langevin(KnownPosterior(), y0, path, times, generator=gen(seed + 1), **kw)
    one = sample_langevin(KnownPosterior(), y0, path, times, generator=gen(seed + 1), final_average=1, **kw)
    assert torch.equal(plain, one)

    # replay: the chains without the final step, then the K = 10 draws as 4 + 4 + 2 from the same stream
    g = gen(seed + 1)
    chains = sample_langevin(KnownPosterior(), y0, path, times, generator=g, final_draw=False, **kw)
    eta = path(times[-1:]).eta().expand(6, 5)
    want = sum(KnownPosterior().sample(chains, eta, n, generator=g).sum(1) for n in (4, 4, 2)) / 10
    post = _Recording()
    got = sample_langevin(KnownPosterior(), y0, path, times, generator=gen(seed + 1), final_average=10, **kw)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"seed={seed}"
    timer = ThroughputTimer()
    sample_langevin(post, y0, path, times, generator=gen(seed + 1), final_average=10, timer=timer, **kw)
    assert [c[2] for c in post.calls[-3:]] == [4, 4, 2] and timer.as_dict()["posterior_calls"] == 6 + 3
    with pytest.raises(ValueError, match="final_average must be >= 1"):
        sample_langevin(post, y0, path, times, generator=gen(), final_average=0, **kw)


def test_bad_inputs_raise_named_errors():
    path, times = get_path("isotropic"), level_times(3)
    ok = dict(steps_per_level=1, n_posterior=2, step_scale=1e-5, generator=gen(), disable=True)
    y0 = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="posterior must have a sample"):
        sample_langevin(object(), y0, path, times, **ok)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sample_langevin(_Recording(), y0, path, times, **{**ok, "generator": None})
    with pytest.raises(ValueError, match=r"schedule times must lie in \[0, 1\]"):
        sample_langevin(_Recording(), y0, path, torch.tensor([0.0, 2.0]), **ok)
    with pytest.raises(TypeError, match="schedule must be a 1-D floating-point tensor"):
        sample_langevin(_Recording(), y0, path, [0.0, 1.0], **ok)
    with pytest.raises(ValueError, match="steps_per_level must be >= 1"):
        sample_langevin(_Recording(), y0, path, times, **{**ok, "steps_per_level": 0})
    with pytest.raises(ValueError, match="step_scale must be a float > 0"):
        sample_langevin(_Recording(), y0, path, times, **{**ok, "step_scale": -1.0})
    with pytest.raises(ValueError, match="y0 must be finite"):
        sample_langevin(_Recording(), torch.full((2, 2), float("nan")), path, times, **ok)
    with pytest.raises(TypeError, match="path must be a callable"):
        sample_langevin(_Recording(), y0, "joint", times, **ok)
    with pytest.raises(ValueError, match="generator must be on y0's device"):
        sample_langevin(_Recording(), y0.to("meta"), path, times, **ok)

    class Wrong(_Recording):
        def sample(self, y, eta, n, *, generator):
            return y.new_zeros(y.shape[0], n + 1, 2)

    with pytest.raises(ValueError, match="posterior.sample returned shape"):
        sample_langevin(Wrong(), y0, path, times, **ok)
    scalar_path = NoisePath("bad", beta=1.4, lam=1.8, rms=lambda t: torch.tensor(0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="vectorized over t"):
        sample_langevin(_Recording(), y0, lambda t: NoiseParams(1.4, 1.8, 0.5), times, **ok)
    assert scalar_path(times).batch_shape == (3,)  # a scalar-valued rms broadcasts over t


_KW = dict(steps_per_level=1, n_posterior=2, step_scale=1e-4, disable=True)


class _ReturnsNone:
    def sample(self, y, eta, n, *, generator):
        return None


class _OneTooWide:
    def sample(self, y, eta, n, *, generator):
        return y.new_zeros(y.shape[0], n, y.shape[-1] + 1)


@pytest.mark.parametrize(
    "posterior, levels, kwargs, error, match",
    [
        pytest.param(_ReturnsNone, 2, {}, TypeError, "posterior.sample must return a real-valued tensor",
                     id="posterior-returning-no-tensor"),
        # named even without updates (first_level_steps=0 on one level: only the final draw)
        pytest.param(_OneTooWide, 1, dict(first_level_steps=0), ValueError,
                     r"posterior.sample returned shape \(3, 1, 3\), expected \(3, 1, 2\)",
                     id="wrong-final-draw-shape-without-updates"),
        pytest.param(KnownPosterior, 2, dict(final_draw="no"), TypeError, "final_draw must be a bool",
                     id="final_draw-not-a-bool"),
        # an error, not a silent overrun
        pytest.param(KnownPosterior, 2, dict(max_draw_elements=3), ValueError,
                     r"max_draw_elements=3 is below the draws of a single chain, N·d = 2·2 = 4",
                     id="max_draw_elements-below-one-chain"),
    ],
)
def test_sample_langevin_names_bad_arguments(posterior, levels, kwargs, error, match):
    with pytest.raises(error, match=match):
        sample_langevin(posterior(), torch.zeros(3, 2), get_path("gaussian"), level_times(levels), generator=gen(),
                        **_KW, **kwargs)


def test_zero_chains_start_and_sample():
    y0 = initial_states(get_path("joint"), level_times(3), 0, 4, generator=gen())
    assert y0.shape == (0, 4) and y0.dtype == torch.float32
    assert initial_states(get_path("joint"), level_times(3), 0, 4, generator=chunk_generators(0, 1),
                          chunk_chains=2).shape == (0, 4)
    out = sample_langevin(KnownPosterior(), y0[:, :2], get_path("joint"), level_times(3), generator=gen(), **_KW)
    assert out.shape == (0, 2)


# ---------------------------------------------------------------------------- paths
def test_joint_and_mnist_paths_match_their_formulas_at_fresh_times():
    t = torch.cat([torch.tensor([0.0, 0.5, 1.0], dtype=F64), torch.rand(5, generator=gen(1), dtype=F64)])
    mnist = lambda s: (2 - 0.6 * s, 1 + 0.8 * s, 0.3 * math.sin(math.pi * s), 0.6 * s, 2.63 * (0.197 / 2.63) ** s)
    for name, formula in (("joint", _joint), ("mnist_joint", mnist)):
        p = get_path(name)(t)
        for i, s in enumerate(t.tolist()):
            beta, lam, u, v, r = formula(s)
            want = [beta, lam, r * lam ** (1 / beta), u, v]  # σ_t = r_t λ_t^{1/β_t}
            got = [float(f[i]) for f in (p.beta, p.lam, p.sigma, p.u, p.v)]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (name, s)


def test_level_times_names_a_bad_device():
    with pytest.raises(ValueError, match="device must be a device string"):
        level_times(3, device="bogus")


def test_a_complex_coordinate_is_refused_not_cast_to_its_real_part():
    path = NoisePath("c", beta=1.5, lam=lambda t: torch.ones_like(t, dtype=torch.complex128) * (1 + 1j),
                     rms=GeometricRMS(1.0, 0.1))
    with pytest.raises(TypeError, match=r"lam\(t\) must return a real-valued tensor, got torch.complex128"):
        path(level_times(3))


# ---------------------------------------------------------------------------- estimator building blocks
@pytest.mark.parametrize("level_scale,split_half", [("rms", False), ("plain", True)])
def test_estimate_profiled_lambda_and_objective_match_the_formula(level_scale, split_half):
    """λ̂ = Σ⟨ŝ, G⟩ / Σ‖G‖² and J = (1/n) Σ ‖ŝ‖² − 2λ̂⟨ŝ, G⟩ + λ̂² ‖G‖² at (β̂, Σ̂), G by hand in float64."""
    d, sigmas = 4, [0.3, 0.7]
    ys = [torch.randn(10, d, generator=gen(10 + i), dtype=F64) for i in range(2)]
    xs = [torch.randn(10, 6, d, generator=gen(20 + i), dtype=F64) for i in range(2)]
    ss = [torch.randn(10, d, generator=gen(30 + i), dtype=F64) for i in range(2)]
    settings = EstimatorSettings(steps=4, batch_size=7, lam_min=1e-6, lam_max=1e6, level_scale=level_scale,
                                 split_half=split_half)
    est = estimate_noise(ys, sigma=sigmas, posterior_samples=xs, scores=ss, settings=settings, generator=gen(),
                         progress=False)
    b, S = est.beta, est.shape
    terms = []
    for y, x, s, sg in zip(ys, xs, ss, sigmas):
        P = torch.linalg.inv(sg**2 / (_c2(b, d) if level_scale == "rms" else 1.0) * torch.block_diag(S, S))

        def G(draws):
            U = draws - y[:, None]
            q = torch.einsum("cni,ij,cnj->cn", U, P, U)
            return (q ** ((b - 2) / 2))[..., None].mul(U).mean(1) @ P

        power = (G(x[:, :3]) * G(x[:, 3:])).sum(-1) if split_half else G(x).pow(2).sum(-1)
        terms.append((s, G(x), power))
    lam = sum(float((s * g).sum()) for s, g, _ in terms) / sum(float(p.sum()) for _, _, p in terms)
    J = sum(float((s.pow(2).sum(-1) - 2 * lam * (s * g).sum(-1) + lam**2 * p).sum()) for s, g, p in terms) / 20
    assert est.lam == pytest.approx(lam, rel=1e-10) and est.objective == pytest.approx(J, rel=1e-10)


_S = torch.randn(6, 2, generator=gen(), dtype=F64)


@pytest.mark.parametrize(
    "call, error, match",
    [
        pytest.param(lambda: zeta_from_beta(2.0, 0.5), ValueError, "beta must be < 2, got 2.0", id="zeta-beta-2"),
        pytest.param(lambda: zeta_from_beta(0.5, 0.5), ValueError, "beta must be > 0.5", id="zeta-beta-at-min"),
        pytest.param(lambda: zeta_from_beta(1.0, 2.0), ValueError, "beta_min must be < 2", id="zeta-beta_min-2"),
        *(pytest.param(lambda phi=phi: shape_from_cholesky(phi), ValueError, r"phi must have shape \(\.\.\., k, k\)",
                       id=f"cholesky-phi-{name}")
          for name, phi in (("vector", torch.zeros(2)), ("non-square", torch.zeros(2, 3)))),
        pytest.param(lambda: profile_lambda(_S, _S, 2.0, 1.0), ValueError, "lam_min must be <= lam_max",
                     id="profile-lam_min-above-lam_max"),
        pytest.param(lambda: profile_lambda(_S, torch.full_like(_S, float("nan"))), ValueError,
                     "scores and field must be finite", id="profile-nan-field"),
        # (1, d) and (n, 1) would broadcast silently
        *(pytest.param(lambda field=field: profiled_objective(_S, field, 0.5), ValueError,
                       "scores and field must have the same shape", id=f"objective-field-{name}")
          for name, field in (("one-row", _S[:1]), ("one-column", _S[:, :1]))),
        pytest.param(lambda: level_variance(0.5, torch.tensor(1.4), 2, "rsm"), ValueError, "level_scale must be one of",
                     id="level_variance-level_scale"),
    ],
)
def test_building_blocks_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_level_sampler_on_an_empty_batch_returns_empty_draws():
    sampler = level_sampler(KnownPosterior(), lambda s: NoiseParams(2.0, 1.0, s))
    assert sampler(torch.zeros(0, 2, dtype=F64), 0.5, 3, gen()).shape == (0, 3, 2)


_Y, _X, _SC = (torch.randn(*shape, generator=gen(seed), dtype=F64) for seed, shape in ((1, (6, 2)), (2, (6, 4, 2)),
                                                                                      (3, (6, 2))))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        pytest.param(dict(posterior_samples=_X.to("meta")), ValueError,
                     "posterior_samples must be on the observations' device cpu, got meta", id="draws-on-meta"),
        pytest.param(dict(scores=_SC.to("meta")), ValueError, "scores must be on the observations' device cpu, got meta",
                     id="scores-on-meta"),
        pytest.param(dict(heldout_observations=_Y.to("meta"), heldout_reference=_SC, heldout_posterior_samples=_X),
                     ValueError, "heldout_observations must be on the observations' device", id="heldout-on-meta"),
        pytest.param(dict(scores=_SC.to(torch.complex128)), TypeError,
                     "scores must be a real floating-point tensor, got torch.complex128", id="complex-scores"),
        pytest.param(dict(family=["gaussian"]), ValueError, "family must be one of", id="family-list"),
        pytest.param(dict(progress="no"), TypeError, "progress must be a bool", id="progress-not-a-bool"),
    ],
)
def test_estimate_names_arguments_on_another_device_or_of_complex_dtype(kwargs, error, match):
    kw = {**dict(posterior_samples=_X, scores=_SC, settings=EstimatorSettings(steps=1), progress=False), **kwargs}
    with pytest.raises(error, match=match):
        estimate_noise(_Y, **kw)


# ---------------------------------------------------------------------------- command line
def test_cli_single_path_run(tmp_path):
    out = tmp_path / "run"
    status = cli_main([
        "--posterior", "known", "--path", "gaussian", "rotating", "--seeds", "2", "--chains", "48",
        "--levels", "4", "--steps-per-level", "2", "--n-posterior", "8", "--n-proposals", "16",
        "--out", str(out), "--no-progress", "--no-figures",
    ])
    assert status == 0
    results = json.loads((out / "diffusion_results.json").read_text())
    table = results["tables"]["paths"]
    assert set(table["rows"]) == {"gaussian", "rotating"}
    metrics = table["rows"]["rotating"]["per_model"]["known"]
    assert metrics["n_samples"] == 96 and len(metrics["per_seed"]) == 2 and len(metrics["tracking"]) == 4
    assert table["timing"]["chain_steps"] == 2 * 2 * 48 * 4 * 2
    assert (out / "samples" / "paths_known_rotating_seed1.pt").is_file()
    assert torch.load(out / "samples" / "paths_known_gaussian_seed0.pt").shape == (48, 2)


@pytest.mark.parametrize("argv, message", [
    (["--posterior", "checkpoint"], "needs posterior.checkpoints"),
    (["--posterior", "known", "--device", "cuda"], "CUDA is not available" if not torch.cuda.is_available()
     else "the known posterior runs on the CPU"),
    (["--posterior", "known", "--device", "meta:x"], "must be a torch device"),
    (["--posterior", "known", "--quick"], "--quick shrinks a --config run"),
    (["--posterior", "known", "--first-level-steps", "-5"], "--first-level-steps must be >= 0, got -5"),
    (["--posterior", "known", "--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_cli_usage_errors_are_one_line(argv, message, tmp_path, capsys):
    """`--posterior checkpoint` without `--checkpoint` no longer falls back to the known posterior, and a
    device that would not be used (or does not exist) is refused instead of recorded in the JSON."""
    status = cli_main(argv + ["--path", "gaussian", "--chains", "8", "--levels", "2", "--out", str(tmp_path / "r"),
                              "--no-progress", "--no-figures"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r" / "diffusion_results.json").exists()


def test_cli_config_run_with_figures(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cfg"
    status = cli_main(["--config", "configs/diffusion_quick_test.toml", "--posterior", "known",
                       "--out", str(out), "--no-progress"])
    assert status == 0
    results = json.loads((out / "diffusion_results.json").read_text())
    assert set(results["tables"]) == {"paths", "isolation"}
    summary = results["tables"]["isolation"]["rows"]["fixed_ref"]["summary"]
    assert {"signed_ed", "mode_weight_tv", "min_mode_mass", "tracking_max_after_burn_in"} <= set(summary)
    assert "signed_ed" in results["tables"]["paths"]["clean"]["summary"]
    for table in ("paths", "isolation"):
        for stem in ("parameter_paths", "endpoint_samples", "progress", "trajectories", "marginal_tracking"):
            assert (out / f"{table}_{stem}.png").stat().st_size > 1000


def test_cli_from_samples_rescores_a_run_exactly(tmp_path):
    """--from-samples reads the saved final samples back and scores them as the sampling run did."""
    first, again = tmp_path / "sampled", tmp_path / "rescored"
    args = ["--config", "configs/diffusion_quick_test.toml", "--posterior", "known", "--no-progress", "--no-figures"]
    assert cli_main(args + ["--out", str(first)]) == 0
    assert cli_main(args + ["--out", str(again), "--from-samples", str(first)]) == 0
    a = json.loads((first / "diffusion_results.json").read_text())["tables"]
    b = json.loads((again / "diffusion_results.json").read_text())["tables"]
    assert set(a) == set(b) == {"paths", "isolation"}
    for table in a:
        assert b[table]["timing"] is None and b[table]["rescored_from"] == [str(first)]
        for name in list(a[table]["rows"]) + ["clean"]:
            row_a = a[table]["clean"] if name == "clean" else a[table]["rows"][name]
            row_b = b[table]["clean"] if name == "clean" else b[table]["rows"][name]
            ma, mb = row_a["per_model"]["known"], row_b["per_model"]["known"]
            for key in ("signed_ed", "mode_weight_tv", "min_mode_mass", "mean_radial_error", "bootstrap"):
                assert ma[key] == mb[key], (table, name, key)
            if name != "clean":  # the per-run tracking records saved beside the samples rebuild the curves
                assert ma["tracking"] == mb["tracking"] and ma["tracking_max_after_burn_in"] == mb["tracking_max_after_burn_in"]
    assert not (again / "samples").exists()  # nothing sampled, nothing saved
    # samples without their tracking records (a run stopped before it wrote them): metrics, no curves
    for path in (first / "samples").glob("*.tracking.json"):
        path.unlink()
    third = tmp_path / "no_tracking"
    assert cli_main(args + ["--out", str(third), "--from-samples", str(first)]) == 0
    c = json.loads((third / "diffusion_results.json").read_text())["tables"]
    row = c["paths"]["rows"]["rotating"]["per_model"]["known"]
    assert "tracking" not in row and row["signed_ed"] == a["paths"]["rows"]["rotating"]["per_model"]["known"]["signed_ed"]


def test_from_samples_brings_back_the_figure_states(tmp_path):
    """Rescoring saved samples rebuilds the progress and trajectory figures from each model's saved
    first-run states (a GPU job samples, this machine scores and draws)."""
    config = diffusion_eval.load_config("configs/diffusion_quick_test.toml")
    config["posterior"]["kind"] = "known"
    sampled = diffusion_eval.run_diffusion_eval(config, out_dir=tmp_path / "sampled", progress=False, figures=False)
    rescored = diffusion_eval.run_diffusion_eval(config, out_dir=tmp_path / "rescored", progress=False, figures=False,
                                                 saved=[tmp_path / "sampled"])
    for table in ("paths", "isolation"):
        fig_a, fig_b = sampled["tables"][table]["_figure"], rescored["tables"][table]["_figure"]
        assert set(fig_b["progress"]) == set(fig_a["progress"]) == set(config[table]["names"])
        for name in fig_a["progress"]:
            assert torch.equal(fig_a["progress"][name]["states"], fig_b["progress"][name]["states"])
            assert fig_a["progress"][name]["r"] == fig_b["progress"][name]["r"]
            for key in ("states", "final"):
                assert torch.equal(fig_a["trajectories"][name][key], fig_b["trajectories"][name][key])
    # runs saved without states (older runs, or sampled with figures off): scored, no progress figure
    for path in (tmp_path / "sampled" / "samples").glob("*.states.pt"):
        path.unlink()
    bare = diffusion_eval.run_diffusion_eval(config, out_dir=tmp_path / "bare", progress=False, figures=False,
                                             saved=[tmp_path / "sampled"])
    assert bare["tables"]["paths"]["_figure"]["progress"] == {}
    assert bare["tables"]["paths"]["rows"]["rotating"]["per_model"]["known"]["signed_ed"] == \
        sampled["tables"]["paths"]["rows"]["rotating"]["per_model"]["known"]["signed_ed"]
    # a damaged states file is an error naming it, not a silent blank figure
    stem = next((tmp_path / "sampled" / "samples").glob("paths_known_gaussian_seed0.pt"))
    torch.save(torch.zeros(3), str(stem).replace(".pt", ".states.pt"))
    with pytest.raises(ValueError, match=r"states\.pt: expected dict"):
        diffusion_eval.run_diffusion_eval(config, out_dir=tmp_path / "bad", progress=False, figures=False,
                                          saved=[tmp_path / "sampled"])


def test_tracking_figure_uses_one_panel_per_path_beyond_four(tmp_path):
    """Eleven overlapping bands cannot be read: past four paths the tracking figure is a grid of
    panels (rows of at most six, the spare cells hidden), each against the first path in grey."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.eight_gaussians import diffusion_figures

    def curves(shift):
        return [[{"r": 0.8 * 0.5**k, "signed_ed": shift + 1e-4 * k * m} for k in range(6)] for m in (1, 2)]

    ring = EightGaussians()
    for n, panels, visible in ((3, 1, 1), (7, 12, 7)):
        fig_data = {"tracking": {f"arm{i}": curves(1e-3 * i) for i in range(n)}}
        fig = diffusion_figures._tracking(plt, {}, fig_data, ring)
        axes = fig.get_axes()
        assert len(axes) == panels and sum(ax.get_visible() for ax in axes) == visible
        if n > diffusion_figures.SINGLE_PANEL_CURVES:
            second = axes[1]
            labels = [line.get_label() for line in second.get_lines() if not line.get_label().startswith("_")]
            assert labels == ["arm0", "arm1"] and second.get_title() == "arm1"
            assert second.get_lines()[0].get_color() == "0.6"  # the reference in grey
        fig.savefig(tmp_path / f"tracking{n}.png")
        plt.close(fig)
    fig, axes = diffusion_figures._grid(plt, 12, 1.0)
    assert len(axes) == 12 and len(fig.get_axes()) == 12  # two full rows of six
    plt.close(fig)


def test_an_interrupted_table_resumes_at_its_first_unfinished_run(tmp_path, monkeypatch, capsys):
    """A table stopped mid-way restarts where it stopped, and scores exactly as an uninterrupted run."""
    config = diffusion_eval.load_config("configs/diffusion_quick_test.toml")
    config["posterior"]["kind"] = "known"
    whole = diffusion_eval.run_diffusion_eval(config, out_dir=tmp_path / "whole", progress=False, figures=False)
    n_runs = {"paths": 4, "isolation": 1}  # (2 paths × 2 seeds), (1 arm × 1 seed)

    real, calls = diffusion_eval.sample_langevin, []

    def stop_at_third_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # e.g. the session's time limit
        return real(*args, **kwargs)

    out = tmp_path / "interrupted"
    monkeypatch.setattr(diffusion_eval, "sample_langevin", stop_at_third_run)
    with pytest.raises(KeyboardInterrupt):
        diffusion_eval.run_diffusion_eval(config, out_dir=out, progress=False, figures=False)
    monkeypatch.setattr(diffusion_eval, "sample_langevin", real)
    assert len(list((out / "samples").glob("*.run.json"))) == 2
    again = diffusion_eval.run_diffusion_eval(config, out_dir=out, progress=True, figures=False)
    printed = capsys.readouterr().out
    assert printed.count("finished earlier, read from") == 2 and "paths_known_gaussian_seed0.pt" in printed
    assert again["tables"]["paths"]["resumed_runs"] == 2 and again["tables"]["isolation"]["resumed_runs"] == 0
    assert again["tables"]["paths"]["timing"]["chains"] == 2 * 32  # only the runs sampled in this call are timed
    for table in n_runs:
        for name in list(whole["tables"][table]["rows"]) + ["clean"]:
            row_a = whole["tables"][table]["clean" if name == "clean" else "rows"]
            row_b = again["tables"][table]["clean" if name == "clean" else "rows"]
            ma = (row_a if name == "clean" else row_a[name])["per_model"]["known"]
            mb = (row_b if name == "clean" else row_b[name])["per_model"]["known"]
            for key in ("signed_ed", "mode_weight_tv", "min_mode_mass", "bootstrap", "tracking", "per_seed"):
                assert ma.get(key) == mb.get(key), (table, name, key)
        fig_a, fig_b = whole["tables"][table]["_figure"], again["tables"][table]["_figure"]
        for part in ("progress", "trajectories"):  # the first run's figure states come back from disk
            for name in fig_a[part]:
                assert torch.equal(fig_a[part][name]["states"], fig_b[part][name]["states"])

    # a third call reads everything back; a changed setting or --no-resume samples again
    third = diffusion_eval.run_diffusion_eval(config, out_dir=out, progress=False, figures=False)
    assert {t: third["tables"][t]["resumed_runs"] for t in n_runs} == n_runs
    assert third["tables"]["paths"]["timing"] is None
    assert diffusion_eval.format_tables(third).count("read back from an earlier call") == 2
    m3, m1 = (r["tables"]["paths"]["rows"]["rotating"]["per_model"]["known"] for r in (third, whole))
    assert m3["timing"] is None and {k: v for k, v in m3.items() if k != "timing"} == {
        k: v for k, v in m1.items() if k != "timing"}
    changed = diffusion_eval.copy.deepcopy(config)
    changed["sampler"]["step_scale"] = 3e-5
    other = diffusion_eval.run_diffusion_eval(changed, out_dir=out, progress=False, figures=False)
    assert {t: other["tables"][t]["resumed_runs"] for t in n_runs} == {"paths": 0, "isolation": 0}
    marker = json.loads((out / "samples" / "paths_known_rotating_seed1.run.json").read_text())
    assert marker["sampler"]["step_scale"] == 3e-5 and marker["seed"] == 1 and marker["path"] == "rotating"
    status = cli_main(["--config", "configs/diffusion_quick_test.toml", "--posterior", "known", "--no-progress",
                       "--no-figures", "--out", str(out), "--no-resume"])
    assert status == 0
    assert json.loads((out / "diffusion_results.json").read_text())["tables"]["paths"]["resumed_runs"] == 0
    # a run whose files are damaged is sampled again, not read back
    (out / "samples" / "isolation_known_fixed_ref_seed0.states.pt").write_bytes(b"not a tensor")
    last = diffusion_eval.run_diffusion_eval(config, out_dir=out, progress=False, figures=False)
    assert last["tables"]["isolation"]["resumed_runs"] == 0 and last["tables"]["paths"]["resumed_runs"] == 4


def test_cli_from_samples_errors(tmp_path, capsys):
    args = ["--config", "configs/diffusion_quick_test.toml", "--posterior", "known", "--no-progress", "--no-figures"]
    (tmp_path / "partial" / "samples").mkdir(parents=True)
    torch.save(torch.zeros(32, 2), tmp_path / "partial" / "samples" / "paths_known_gaussian_seed0.pt")
    assert cli_main(args + ["--from-samples", str(tmp_path / "partial")]) == 2
    assert "no saved samples paths_known_gaussian_seed1.pt" in capsys.readouterr().err
    torch.save(torch.zeros(31, 2), tmp_path / "partial" / "samples" / "paths_known_gaussian_seed1.pt")
    assert cli_main(args + ["--from-samples", str(tmp_path / "partial")]) == 2
    assert "expected a (32, 2) tensor" in capsys.readouterr().err
    assert cli_main(["--path", "gaussian", "--posterior", "known", "--from-samples", str(tmp_path)]) == 2
    assert "--from-samples needs --config" in capsys.readouterr().err
    assert cli_main(args + ["--from-samples", str(tmp_path / "nowhere")]) == 2
    assert "no samples/ folder there" in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    assert cli_main(["--posterior", "known"]) == 2
    assert "exactly one of --config" in capsys.readouterr().err
    assert cli_main(["--path", "gaussian", "--chains", "8"]) == 2
    assert "--checkpoint PATH" in capsys.readouterr().err
    assert cli_main(["--config", "does/not/exist.toml"]) == 2
    assert cli_main(["--config", "configs/diffusion_quick_test.toml", "--posterior", "known", "--chains", "8"]) == 2
    assert "--chains sets a --path run's table; with --config set it in the TOML" in capsys.readouterr().err


def test_cli_sampler_flags_override_a_config(tmp_path):
    """With --config, the sampler flags given replace the TOML's values (they were ignored before)."""
    out = tmp_path / "flags"
    status = cli_main(["--config", "configs/diffusion_quick_test.toml", "--posterior", "known", "--no-progress",
                       "--no-figures", "--out", str(out), "--step-scale", "3e-5", "--n-posterior", "4",
                       "--steps-per-level", "2", "--first-level-steps", "3", "--init", "marginal", "--no-final-draw",
                       "--known-method", "importance", "--n-proposals", "8"])
    assert status == 0
    config = json.loads((out / "diffusion_results.json").read_text())["config"]
    assert config["sampler"] == dict(config["sampler"], step_scale=3e-5, n_posterior=4, steps_per_level=2,
                                     first_level_steps=3, init="marginal", final_draw=False)
    assert config["posterior"]["method"] == "importance" and config["posterior"]["n_proposals"] == 8
    assert config["paths"]["n_samples"] == 32  # the TOML's table sizes stay
    run = json.loads((out / "samples" / "paths_known_gaussian_seed0.run.json").read_text())
    assert run["sampler"]["step_scale"] == 3e-5 and run["posterior"]["n_proposals"] == 8


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("diffusion_*.toml")))
def test_diffusion_configs_load_and_validate(name):
    """Every shipped diffusion config parses and passes validation (unknown keys, bad values)."""
    from experiments.eight_gaussians.diffusion import load_config

    import argparse

    from experiments.eight_gaussians.diffusion import override_config

    path = Path(__file__).resolve().parents[1] / "configs" / name
    if '"checkpoint"' in path.read_text() and "checkpoints = []" in path.read_text():
        # the models come from --checkpoint on the command line: the config loads, and the
        # command line without them must say so (a config with them validates)
        config = load_config(path)
        with pytest.raises(ValueError, match="--checkpoint"):
            override_config(config, argparse.Namespace(checkpoint=None))
        config = override_config(config, argparse.Namespace(checkpoint=["runs/a", "runs/b"]))
        assert config["posterior"]["checkpoints"] == ["runs/a", "runs/b"]
        return
    config = load_config(path)
    assert config["paths"]["enabled"] or config["isolation"]["enabled"]
    if config["posterior"]["kind"] == "checkpoint":
        assert all(isinstance(c, str) and c for c in config["posterior"]["checkpoints"])


def test_antithetic_draws_reach_every_score_evaluation_and_need_support():
    """antithetic=True asks the posterior for mirrored draws at every update (not for the final
    single draw), a learned model takes them (a finite run, different from the independent
    draws'), and a posterior without the keyword — or the config's known posterior — is refused
    up front."""
    from experiments.eight_gaussians.diffusion import DEFAULT_CONFIG, _validate
    from etweedie.posteriors import EngressionPosterior

    class Flagged(_Recording):
        def sample(self, y, eta, n, *, generator, antithetic=False):
            self.calls.append((n, antithetic))
            return y.new_zeros(*y.shape[:-1], n, y.shape[-1])

    post = Flagged()
    times = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    sample_langevin(post, _y0(4, 1), get_path("gaussian"), times, steps_per_level=2, n_posterior=6,
                    step_scale=1e-4, generator=gen(3), disable=True, antithetic=True)
    assert post.calls == [(6, True)] * 6 + [(1, False)]
    model = EngressionPosterior(2, width=16, depth=2, noise_dim=3, cond_width=8, init_seed=1)
    path = get_path("rotating")
    a = sample_langevin(model, _y0(8, 2), path, times, steps_per_level=1, n_posterior=4, step_scale=1e-4,
                        generator=gen(5), disable=True, antithetic=True, final_draw=False)
    b = sample_langevin(model, _y0(8, 2), path, times, steps_per_level=1, n_posterior=4, step_scale=1e-4,
                        generator=gen(5), disable=True, final_draw=False)
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    with pytest.raises(TypeError, match="antithetic"):
        sample_langevin(_Recording(), _y0(4, 1), get_path("gaussian"), times, steps_per_level=1, n_posterior=2,
                        step_scale=1e-4, generator=gen(3), disable=True, antithetic=True)
    with pytest.raises(TypeError, match="antithetic"):
        sample_langevin(post, _y0(4, 1), get_path("gaussian"), times, steps_per_level=1, n_posterior=2,
                        step_scale=1e-4, generator=gen(3), disable=True, antithetic=1)
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in DEFAULT_CONFIG.items()}
    config["sampler"] = dict(config["sampler"], antithetic=True)
    with pytest.raises(ValueError, match="antithetic"):
        _validate(config)


def test_known_posterior_diverged_rows_give_nan_draws_and_small_noise_stays_exact():
    post = KnownPosterior()
    for eta in (NoiseParams(2.0, 1.0, 0.5).eta(), NoiseParams(1.4, 1.8, 0.5).eta()):  # exact, importance
        y = torch.tensor([[float("nan"), 0.0], [1.0, 1.0], [float("inf"), 2.0], [-0.5, 0.3]], dtype=torch.float64)
        out = post.sample(y, eta, 4, generator=torch.Generator().manual_seed(0))
        assert out.shape == (4, 4, 2) and bool(out[[0, 2]].isnan().all())
        alone = post.sample(y[[1, 3]], eta, 4, generator=torch.Generator().manual_seed(0))
        assert torch.equal(out[[1, 3]], alone)
    # a chain that diverges (too large a step) ends as NaN, it does not crash the run
    y0 = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    out = sample_langevin(post, y0, get_path("gaussian"), level_times(11), steps_per_level=10, n_posterior=8,
                          step_scale=1.0, generator=torch.Generator().manual_seed(0), disable=True)
    assert out.shape == (8, 2)
    # the exact posterior at tiny Gaussian noise: τ²A⁻¹C, not the cancelling τ²I − τ⁴A⁻¹
    y = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    for sigma in (1e-7, 1e-9, 1e-12):
        x = post.sample(y, NoiseParams(2.0, 1.0, sigma).eta(), 64, generator=torch.Generator().manual_seed(1))
        assert float((x - y).abs().max()) < 10 * sigma


def test_initial_states_and_chunk_generators_check_their_arguments():
    path, times = get_path("gaussian"), level_times(5)
    start = lambda **kw: initial_states(path, times, 4, 2, generator=torch.Generator().manual_seed(0), **kw)
    per_chain = start(center=torch.arange(8.0).reshape(4, 2))
    assert torch.equal(per_chain, start() + torch.arange(8.0).reshape(4, 2))
    for shape in ((5, 1, 2), (3, 2), (2, 1)):
        with pytest.raises(ValueError, match=r"center must be a tensor of shape \(2,\) or \(4, 2\)"):
            start(center=torch.zeros(shape))
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        start(dtype=torch.int64)
    with pytest.raises(TypeError, match="chunks must be a number of chunks or a list"):
        chunk_generators(0, True)
    with pytest.raises(TypeError, match=r"chunks\[\] must be an int"):
        chunk_generators(0, [1.7])
    with pytest.raises(ValueError, match="device must be a device string"):
        chunk_generators(0, 2, device="bogus")
    assert [g.initial_seed() for g in chunk_generators(3, [2, 0])] == [g.initial_seed() for g in chunk_generators(3, 3)][::2][::-1]


def test_chunk_generators_names_a_device_without_generators():
    with pytest.raises(ValueError, match="device must be one torch.Generator can live on"):
        chunk_generators(0, 2, device="meta")


def test_a_damaged_samples_file_is_sampled_again_not_a_crash(tmp_path):
    fingerprint = {"tracking": None, "figure_chains": None, "seed": 1}
    stem = tmp_path / "run"
    Path(f"{stem}.run.json").write_text(json.dumps(diffusion_eval._jsonable(fingerprint)))
    for junk in (b"junk", b"", b"PK\x03\x04 truncated zip"):
        Path(f"{stem}.pt").write_bytes(junk)
        assert diffusion_eval._finished_run(stem, fingerprint, 4) is None
