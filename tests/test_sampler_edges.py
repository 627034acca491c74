"""Edges of the sampler, the paths, the known posterior and the estimator, as a demanding user meets them.

Each check states the math or the contract it holds the code to: hand-written float64 formulas
for a path's coordinates, a Langevin update along a non-Gaussian, non-diagonal path and the
estimator's profiled λ and objective; and, for bad input, a ValueError/TypeError naming the
argument (never a deep torch error, a silently ignored argument or a silent broadcast).
"""

from __future__ import annotations

import math

import pytest
import torch

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
from etweedie.known_posterior import KnownPosterior
from etweedie.noise import NoiseParams
from etweedie.paths import NoisePath, GeometricRMS, get_path, level_times
from etweedie.sample import chunk_generators, initial_states, sample_langevin

F64 = torch.float64


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _c2(beta: float, d: int) -> float:
    """c²_{β,d} = β^{2/β} Γ((d+2)/β) / (d Γ(d/β)) (DESIGN §2)."""
    return math.exp((2 / beta) * math.log(beta) + math.lgamma((d + 2) / beta) - math.log(d) - math.lgamma(d / beta))


def _joint(s: float):
    """(β, λ, u, v, r) of the eight-Gaussians 'joint' path at time s (Eq. full5_paths)."""
    theta = math.pi / 2 + 2 * math.pi * s
    return (1.4 + 0.5 * math.sin(math.pi * s) ** 2, 1.8 + 0.4 * math.sin(2 * math.pi * s),
            0.6 * math.cos(theta), 0.6 * math.sin(theta), 0.83 * (0.0083 / 0.83) ** s)


# ---------------------------------------------------------------------------- math
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


# ---------------------------------------------------------------------------- paths
def test_level_times_names_a_bad_device():
    with pytest.raises(ValueError, match="device must be a device string"):
        level_times(3, device="bogus")


def test_a_complex_coordinate_is_refused_not_cast_to_its_real_part():
    path = NoisePath("c", beta=1.5, lam=lambda t: torch.ones_like(t, dtype=torch.complex128) * (1 + 1j),
                     rms=GeometricRMS(1.0, 0.1))
    with pytest.raises(TypeError, match=r"lam\(t\) must return a real-valued tensor, got torch.complex128"):
        path(level_times(3))


# ---------------------------------------------------------------------------- sampler
_KW = dict(steps_per_level=1, n_posterior=2, step_scale=1e-4, disable=True)


def test_a_posterior_returning_no_tensor_is_named():
    class NoneBack:
        def sample(self, y, eta, n, *, generator):
            return None

    with pytest.raises(TypeError, match="posterior.sample must return a real-valued tensor"):
        sample_langevin(NoneBack(), torch.zeros(3, 2), get_path("gaussian"), level_times(2), generator=gen(), **_KW)


def test_a_wrong_final_draw_shape_is_named_even_without_updates():
    class Wide:
        def sample(self, y, eta, n, *, generator):
            return y.new_zeros(y.shape[0], n, y.shape[-1] + 1)

    with pytest.raises(ValueError, match=r"posterior.sample returned shape \(3, 1, 3\), expected \(3, 1, 2\)"):
        sample_langevin(Wide(), torch.zeros(3, 2), get_path("gaussian"), level_times(1), generator=gen(),
                        first_level_steps=0, **_KW)


def test_final_draw_must_be_a_bool():
    with pytest.raises(TypeError, match="final_draw must be a bool"):
        sample_langevin(KnownPosterior(), torch.zeros(3, 2), get_path("gaussian"), level_times(2), generator=gen(),
                        final_draw="no", **_KW)


def test_max_draw_elements_below_one_chain_is_an_error_not_a_silent_overrun():
    with pytest.raises(ValueError, match=r"max_draw_elements=3 is below the draws of a single chain, N·d = 2·2 = 4"):
        sample_langevin(KnownPosterior(), torch.zeros(3, 2), get_path("gaussian"), level_times(2), generator=gen(),
                        max_draw_elements=3, **_KW)


def test_chunk_generators_names_a_device_without_generators():
    with pytest.raises(ValueError, match="device must be one torch.Generator can live on"):
        chunk_generators(0, 2, device="meta")


def test_zero_chains_start_and_sample():
    y0 = initial_states(get_path("joint"), level_times(3), 0, 4, generator=gen())
    assert y0.shape == (0, 4) and y0.dtype == torch.float32
    assert initial_states(get_path("joint"), level_times(3), 0, 4, generator=chunk_generators(0, 1),
                          chunk_chains=2).shape == (0, 4)
    out = sample_langevin(KnownPosterior(), y0[:, :2], get_path("joint"), level_times(3), generator=gen(), **_KW)
    assert out.shape == (0, 2)


# ---------------------------------------------------------------------------- known posterior
def test_a_bank_outside_sir_is_refused_not_ignored():
    with pytest.raises(ValueError, match="bank is used only by method='sir'"):
        KnownPosterior(bank=torch.zeros(10, 2, dtype=F64))
    with pytest.raises(TypeError, match="bank must be a floating-point tensor .* got a torch.int64 tensor"):
        KnownPosterior(method="sir", bank=torch.zeros(10, 2, dtype=torch.int64))


# ---------------------------------------------------------------------------- estimator building blocks
def test_building_blocks_name_bad_arguments():
    with pytest.raises(ValueError, match="beta must be < 2, got 2.0"):
        zeta_from_beta(2.0, 0.5)
    with pytest.raises(ValueError, match="beta must be > 0.5"):
        zeta_from_beta(0.5, 0.5)
    with pytest.raises(ValueError, match="beta_min must be < 2"):
        zeta_from_beta(1.0, 2.0)
    for phi in (torch.zeros(2), torch.zeros(2, 3)):
        with pytest.raises(ValueError, match=r"phi must have shape \(\.\.\., k, k\)"):
            shape_from_cholesky(phi)
    s = torch.randn(6, 2, generator=gen(), dtype=F64)
    with pytest.raises(ValueError, match="lam_min must be <= lam_max"):
        profile_lambda(s, s, 2.0, 1.0)
    with pytest.raises(ValueError, match="scores and field must be finite"):
        profile_lambda(s, torch.full_like(s, float("nan")))
    for field in (s[:1], s[:, :1]):  # (1, d) and (n, 1) would broadcast silently
        with pytest.raises(ValueError, match="scores and field must have the same shape"):
            profiled_objective(s, field, 0.5)
    with pytest.raises(ValueError, match="level_scale must be one of"):
        level_variance(0.5, torch.tensor(1.4), 2, "rsm")


def test_level_sampler_on_an_empty_batch_returns_empty_draws():
    sampler = level_sampler(KnownPosterior(), lambda s: NoiseParams(2.0, 1.0, s))
    assert sampler(torch.zeros(0, 2, dtype=F64), 0.5, 3, gen()).shape == (0, 3, 2)


def test_estimate_names_arguments_on_another_device_or_of_complex_dtype():
    y = torch.randn(6, 2, generator=gen(1), dtype=F64)
    x = torch.randn(6, 4, 2, generator=gen(2), dtype=F64)
    s = torch.randn(6, 2, generator=gen(3), dtype=F64)
    kw = dict(settings=EstimatorSettings(steps=1), progress=False)
    with pytest.raises(ValueError, match="posterior_samples must be on the observations' device cpu, got meta"):
        estimate_noise(y, posterior_samples=x.to("meta"), scores=s, **kw)
    with pytest.raises(ValueError, match="scores must be on the observations' device cpu, got meta"):
        estimate_noise(y, posterior_samples=x, scores=s.to("meta"), **kw)
    with pytest.raises(ValueError, match="heldout_observations must be on the observations' device"):
        estimate_noise(y, posterior_samples=x, scores=s, heldout_observations=y.to("meta"), heldout_reference=s,
                       heldout_posterior_samples=x, **kw)
    with pytest.raises(TypeError, match="scores must be a real floating-point tensor, got torch.complex128"):
        estimate_noise(y, posterior_samples=x, scores=s.to(torch.complex128), **kw)
    with pytest.raises(ValueError, match="family must be one of"):
        estimate_noise(y, posterior_samples=x, scores=s, family=["gaussian"], **kw)
    with pytest.raises(TypeError, match="progress must be a bool"):
        estimate_noise(y, posterior_samples=x, scores=s, settings=EstimatorSettings(steps=1), progress="no")
