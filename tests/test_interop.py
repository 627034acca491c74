"""etweedie.interop: score from any posterior sampler, the Gaussian denoiser, the diffusers
scheduler (with the real diffusers package) and the k-diffusion denoiser (with the real
k_diffusion.sampling samplers).

The sampling tests run on eight Gaussians with the exact posterior
(:class:`etweedie.posteriors.known.KnownPosterior`) and accept a sampler when the signed energy
distance of its samples to a clean reference set is within the spread of the same distance
for fresh clean draws of the same size (the "clean-draw floor"): ED(samples, clean) ≤
mean + 3·sd of ED(clean'_r, clean) over 30 independent clean'_r.  The clean draws are exact,
so that floor is pure sampling noise at this n.
"""

from __future__ import annotations

import doctest
import math
from typing import Callable, Tuple

import pytest
import torch

import etweedie
from etweedie import GeneralizedGaussian, Metric, NoiseParams, StudentT
from etweedie.data import EightGaussians
from etweedie.interop import (
    GaussianDenoiser,
    KDiffusionDenoiser,
    load_k_diffusion_sampling,
    score_from_sampler,
    score_with_law,
)
from etweedie.posteriors import KnownPosterior
from etweedie.sample import GeometricRMS, NoisePath, get_path, level_times
from etweedie.sample import sample_langevin

from conftest import gen

F64 = torch.float64
DATA_STD = math.sqrt(2.0**2 / 2 + 0.2**2)  # per-coordinate std of the eight-Gaussians ring


def _gaussian_cloud_sampler(y, n, generator):
    """Draws around y (any law will do for the contract tests)."""
    z = torch.randn(*y.shape[:-1], n, y.shape[-1], generator=generator, dtype=y.dtype)
    return y.unsqueeze(-2) * 0.5 + 0.3 * z


# ---------------------------------------------------------------------------- score_from_sampler
@pytest.mark.parametrize(
    "law",
    [
        0.7,
        "tensor_sigma",
        NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6),
        GeneralizedGaussian(1.3, 2.0, Metric.diagonal(torch.tensor([0.5, 2.0], dtype=F64))),
        StudentT(2.5, Metric.isotropic(0.8)),
    ],
    ids=["sigma", "tensor_sigma", "noise_params", "generalized_gaussian", "student_t"],
)
def test_sampler_score_is_the_op_on_the_sampler_draws(seed, law):
    y = torch.randn(5, 2, generator=gen(seed), dtype=F64)
    if law == "tensor_sigma":
        law = torch.linspace(0.2, 1.5, 5, dtype=F64)
    score = score_from_sampler(_gaussian_cloud_sampler, n_draws=9)
    draws = score.draws(y, law, generator=gen(seed + 1))
    s = score(y, law, generator=gen(seed + 1))
    if isinstance(law, NoiseParams):
        fields = (torch.tensor(v, dtype=F64) for v in (1.4, 1.8, 0.57, 0.0, 0.6))  # the tuple in float64
        expected = etweedie.et_score(y, draws, 1.4, 1.8, NoiseParams(*fields).metric(2))
    elif isinstance(law, GeneralizedGaussian):
        expected = etweedie.et_score(y, draws, 1.3, 2.0, law.metric)
    elif isinstance(law, StudentT):
        expected = etweedie.student_t_score(y, draws, 2.5, law.metric)
    else:
        var = torch.as_tensor(law, dtype=F64).expand(5) ** 2
        expected = -(y - draws.mean(-2)) / var[:, None]  # Gaussian N(0, σ²I): −(y − x̄)/σ²
    assert torch.allclose(s, expected, rtol=1e-12, atol=1e-12), f"seed={seed}"
    # the same generator state gives the same draws: reproducible from a seed
    assert torch.equal(score(y, law, generator=gen(seed + 1)), s)


def test_sampler_taking_noise_and_posterior_model_get_the_noise(seed):
    seen = []

    def sampler(y, n, generator, noise):
        seen.append(noise)
        return _gaussian_cloud_sampler(y, n, generator)

    y = torch.randn(4, 2, generator=gen(seed), dtype=F64)
    score_from_sampler(sampler, n_draws=3)(y, 0.4)
    assert seen == [0.4]

    # a posterior model is called with η of the call's tuple
    post = KnownPosterior()
    params = NoiseParams(2.0, 1.0, 0.3, 0.0, 0.0)
    via = score_from_sampler(post, n_draws=7).draws(y, params, generator=gen(seed + 1))
    direct = post.sample(y, params.eta().expand(4, 5), 7, generator=gen(seed + 1))
    assert torch.equal(via, direct)
    # a float σ means the tuple (2, 1, σ, 0, 0) for a posterior model
    # (the tuple built from a float is float32, from σ in y's dtype float64: equal up to rounding)
    assert torch.allclose(score_from_sampler(post, n_draws=7).draws(y, 0.3, generator=gen(seed + 1)), direct, rtol=1e-6)


def test_noise_params_in_odd_dimension_isotropic_only(seed):
    y = torch.randn(3, 3, generator=gen(seed), dtype=F64)
    x = torch.randn(3, 6, 3, generator=gen(seed + 1), dtype=F64)
    s = score_with_law(y, x, NoiseParams(1.5, 1.2, 0.8, 0.0, 0.0))
    var = (0.8 / etweedie.geometry.scale_constant(torch.tensor(1.5, dtype=F64), 3)) ** 2  # float64 (a float would be stored as float32)
    assert torch.allclose(s, etweedie.et_score(y, x, 1.5, 1.2, Metric.isotropic(var.expand(3))), rtol=1e-12)
    with pytest.raises(ValueError, match="even dimension"):
        score_with_law(y, x, NoiseParams(1.5, 1.2, 0.8, 0.0, 0.3))


def test_score_from_sampler_errors():
    y = torch.zeros(2, 2, dtype=F64)
    with pytest.raises(TypeError, match="sampler must be"):
        score_from_sampler(3, n_draws=2)
    with pytest.raises(ValueError, match="n_draws must be >= 1"):
        score_from_sampler(_gaussian_cloud_sampler, n_draws=0)
    with pytest.raises(TypeError, match="generator must be"):
        score_from_sampler(_gaussian_cloud_sampler, n_draws=2, generator=0)
    score = score_from_sampler(_gaussian_cloud_sampler, n_draws=2)
    with pytest.raises(TypeError, match="noise must be"):
        score(y, "gaussian")
    with pytest.raises(ValueError, match="σ must be > 0"):
        score(y, -1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        score(y, torch.ones(3, dtype=F64))
    with pytest.raises(TypeError, match="y must be"):
        score(torch.zeros(2, 2, dtype=torch.int64), 1.0)
    bad = score_from_sampler(lambda y, n, g: torch.zeros(y.shape[0], n + 1, 2, dtype=y.dtype), n_draws=2)
    with pytest.raises(ValueError, match=r"draws of shape \(\*batch, n, d\) = \(2, 2, 2\)"):
        bad(y, 1.0)
    with pytest.raises(TypeError, match="pass the noise as NoiseParams"):
        score_from_sampler(KnownPosterior(), n_draws=2)(y, GeneralizedGaussian(1.4, 1.0))


@pytest.mark.parametrize(
    "sigma, error, match",
    [
        pytest.param(float("inf"), ValueError, "noise σ must be > 0 and finite", id="inf"),
        pytest.param(torch.ones(2, dtype=torch.complex128), TypeError, "noise σ must be a real", id="complex"),
        pytest.param(torch.ones(2, dtype=torch.bool), TypeError, "noise σ must be a real", id="bool"),
    ],
)
def test_sampler_score_refuses_infinite_complex_and_bool_sigma(sigma, error, match):
    score = score_from_sampler(_gaussian_cloud_sampler, n_draws=3)
    with pytest.raises(error, match=match):
        score(torch.zeros(2, 2, dtype=F64), sigma)


def test_gaussian_denoiser_shapes_and_errors(seed):
    denoiser = GaussianDenoiser(lambda x, sigma: -x / (1 + sigma[:, None] ** 2))  # prior N(0, I)
    x = torch.randn(4, 1, 2, generator=gen(seed), dtype=F64)
    sigma = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=F64)
    out = denoiser(x, sigma)
    expected = x / (1 + sigma.view(4, 1, 1) ** 2)  # E[X | x] = x/(1 + σ²)
    assert out.shape == x.shape and torch.allclose(out, expected, rtol=1e-14)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        denoiser(x, -1.0)
    with pytest.raises(ValueError, match=r"\(batch,\) tensor"):
        denoiser(x, torch.ones(3))
    with pytest.raises(TypeError, match="sigma must be a number"):
        denoiser(x, "a")
    with pytest.raises(TypeError, match="score must be callable"):
        GaussianDenoiser(None)
    # a zero-size batch gives an empty result (GaussianDenoiser and KDiffusionDenoiser)
    assert denoiser(x[:0], 0.5).shape == (0, 1, 2)
    assert KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=2)(torch.zeros(0, 2), 0.5).shape == (0, 2)


def _standard_normal_prior_score(x, sigma):
    """The noisy score of an N(0, I) prior: finite for any σ."""
    return -x / (1 + sigma[:, None] ** 2)


_SCORE_SHAPE = r"score\(x, sigma\) must return a tensor of x's shape \(3, 2\)"


@pytest.mark.parametrize(
    "score, sigma, error, match",
    [
        # an infinite σ was x + ∞²·(−0) = NaN
        pytest.param(_standard_normal_prior_score, float("inf"), ValueError, "sigma must be >= 0 and finite",
                     id="sigma-inf"),
        pytest.param(_standard_normal_prior_score, torch.tensor([0.5, float("inf"), 0.5], dtype=F64), ValueError,
                     "sigma must be >= 0 and finite", id="sigma-row-inf"),
        # a complex σ was cast to 0.5, dropping the imaginary part
        pytest.param(_standard_normal_prior_score, torch.full((3,), 0.5 + 0.5j), TypeError, "sigma must be a real",
                     id="sigma-complex"),
        # a score of shape (rows, 1) or (d,) broadcast over every row silently
        pytest.param(lambda x, sigma: -x[:, :1], 1.0, ValueError, _SCORE_SHAPE, id="score-one-column"),
        pytest.param(lambda x, sigma: -x[0], 1.0, ValueError, _SCORE_SHAPE, id="score-one-row"),
        pytest.param(lambda x, sigma: None, 1.0, ValueError, _SCORE_SHAPE, id="score-none"),
    ],
)
def test_gaussian_denoiser_refuses_infinite_sigma_and_a_score_of_the_wrong_shape(score, sigma, error, match):
    x = torch.randn(3, 2, generator=gen(0), dtype=F64)
    with pytest.raises(error, match=match):
        GaussianDenoiser(score)(x, sigma)


@pytest.mark.parametrize("module", ["etweedie.interop.score", "etweedie.interop.kdiffusion"])
def test_docstring_examples(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


# ---------------------------------------------------------------------------- clean-draw floor
def _clean_draw_p_value(samples: torch.Tensor, seed: int, permutations: int = 999) -> Tuple[float, float]:
    """(ED, p): the signed energy distance (β = 1, U-statistic) between the samples and a fresh
    clean set of the same size, and its permutation p-value — the share of the 999 random
    relabellings of the pooled points whose ED is at least as large (counting the observed one).

    If the samples are draws of the data law, the two sets are exchangeable and p is uniform, so
    ``p > 1e-3`` fails an exact sampler one run in a thousand whatever the data.  (A tolerance of
    null mean + 3 sd over fresh clean sets has no such rate: the null ED is skewed — about a
    weighted χ² of the eight mode counts — so its tail beyond mean + 3 sd holds one to two percent, and
    an unlucky draw of the mode counts failed CI.)  All relabellings come from one 2n × 2n
    distance matrix: the within sums are zᵀDz, so a batch of them is one matrix product.
    """
    n = samples.shape[0]
    g = gen(seed)
    clean = EightGaussians().sample(n, g, dtype=F64)[0]
    pool = torch.cat([samples.to(F64), clean])
    D = torch.cdist(pool, pool)
    total = D.sum()

    def ed(z: torch.Tensor) -> torch.Tensor:  # z (2n, k) in {0, 1}: column j marks set A of labelling j
        Dz = D @ z
        within_a = (z * Dz).sum(0)
        cross = Dz.sum(0) - within_a  # A to B
        within_b = total - within_a - 2 * cross
        return 2 * cross / (n * n) - (within_a + within_b) / (n * (n - 1))

    observed = ed(torch.cat([torch.ones(n, 1, dtype=F64), torch.zeros(n, 1, dtype=F64)]))[0]
    labels = torch.stack([torch.randperm(2 * n, generator=g) < n for _ in range(permutations)], 1).to(F64)
    null = ed(labels)
    return float(observed), (1 + int((null >= observed).sum())) / (1 + permutations)


def _like_clean_draws(run: Callable[[int], torch.Tensor], seed: int, what: str) -> None:
    """Assert that ``run(seed)`` gives draws like clean ones: p > 1e-3 by :func:`_clean_draw_p_value`,
    or, where that fails, p > 1e-3 again on a second, independent run (seed + 7919).

    The permutation p of an exact sampler is uniform on {1/1000, ..., 1}, so one check fails one
    fresh seed in a thousand by design, and the suite holds several: the second run brings that
    to one in a million, while a sampler that is really off fails both (its p sits at the floor).
    """
    results = []
    for s in (seed, seed + 7919):
        ed, p = _clean_draw_p_value(run(s), s)
        results.append(f"seed={s}: ED {ed:.5f}, permutation p = {p:.4f}")
        if p > 1e-3:
            return
    raise AssertionError(f"{what} not like clean draws in two independent runs: " + "; ".join(results))


def test_clean_draw_check_has_power_and_passes_clean_draws(seed):
    """The check above rejects a ring 20% too wide (p at its floor 1/1000) and passes clean draws."""
    data = EightGaussians()
    wide = 1.2 * data.sample(1024, gen(seed + 1), dtype=F64)[0]
    ed, p = _clean_draw_p_value(wide, seed)
    assert p <= 1e-3 and ed > 0, f"seed={seed}: a ring 1.2× too wide gave ED {ed:.5f}, p = {p:.4f}"
    _like_clean_draws(lambda s: data.sample(1024, gen(s + 1), dtype=F64)[0], seed, "clean draws")


# ---------------------------------------------------------------------------- diffusers
def _scheduler_module():
    pytest.importorskip("diffusers", reason="diffusers not installed (pip install diffusers; in the test/interop extras)")
    from etweedie.interop import diffusers_scheduler

    return diffusers_scheduler


def _diffusers_loop(scheduler, posterior, n, n_draws, levels, generator, dtype=F64):
    scheduler.set_timesteps(levels)
    sample = scheduler.init_noise_sigma * torch.randn(n, 2, generator=generator, dtype=dtype)
    for t in scheduler.timesteps:
        draws = posterior.sample(sample, scheduler.eta(t, n, dtype=dtype), n_draws, generator=generator)
        sample = scheduler.step(draws, t, sample, generator=generator).prev_sample
    eta = scheduler.eta(scheduler.timesteps[-1], n, dtype=dtype)
    return posterior.sample(sample, eta, 1, generator=generator)[:, 0]


@pytest.mark.parametrize("path", ["gaussian", "joint"])
def test_scheduler_loop_is_sample_langevin(seed, path):
    """The diffusers loop draws the same numbers in the same order as sample_langevin: identical samples."""
    mod = _scheduler_module()
    post, n, levels, K, N = KnownPosterior(n_proposals=32), 32, 5, 2, 4
    scheduler = mod.EnergyTweedieLangevinScheduler(path=path, steps_per_level=K, first_level_steps=3, step_scale=1e-4)
    ours = _diffusers_loop(scheduler, post, n, N, levels, gen(seed))
    g = gen(seed)
    y0 = scheduler.init_noise_sigma * torch.randn(n, 2, generator=g, dtype=F64)
    ref = sample_langevin(post, y0, get_path(path), level_times(levels), steps_per_level=K, first_level_steps=3,
                          n_posterior=N, step_scale=1e-4, generator=g, disable=True)
    assert torch.equal(ours, ref), f"seed={seed}: max diff {(ours - ref).abs().max():.3g}"


def test_scheduler_reaches_the_clean_draw_floor_on_eight_gaussians(seed):
    mod = _scheduler_module()
    n = 1024
    scheduler = mod.EnergyTweedieLangevinScheduler(path="gaussian", steps_per_level=5, step_scale=2e-5, data_std=DATA_STD)
    _like_clean_draws(lambda s: _diffusers_loop(scheduler, KnownPosterior(), n, 16, 21, gen(s + 1)), seed,
                      "the scheduler's samples are")


def test_scheduler_score_input_and_save_load_round_trip(seed, tmp_path):
    mod = _scheduler_module()
    scheduler = mod.EnergyTweedieLangevinScheduler(path="rotating", num_levels=7, r_max=0.9, r_min=0.02,
                                                   steps_per_level=3, step_scale=3e-5, data_std=1.4)
    scheduler.save_pretrained(tmp_path)
    loaded = mod.EnergyTweedieLangevinScheduler.from_pretrained(tmp_path)
    for key in ("path", "num_levels", "r_max", "r_min", "steps_per_level", "first_level_steps", "step_scale", "data_std"):
        assert loaded.config[key] == scheduler.config[key], key
    assert torch.equal(loaded.timesteps, scheduler.timesteps) and len(loaded.timesteps) == 21
    assert loaded.init_noise_sigma == scheduler.init_noise_sigma
    assert math.isclose(float(loaded.noise_params(loaded.timesteps[0]).realized_rms()), 0.9, rel_tol=1e-12)

    # a score as model_output: y + α s + sqrt(2α) ξ, ξ from the generator
    t = loaded.timesteps[4]
    sample = torch.randn(6, 2, generator=gen(seed), dtype=F64)
    s = torch.randn(6, 2, generator=gen(seed + 1), dtype=F64)
    out = loaded.step(s, t, sample, generator=gen(seed + 2))
    alpha = loaded.step_size(t)
    xi = torch.randn(6, 2, generator=gen(seed + 2), dtype=F64)
    assert torch.allclose(out.prev_sample, sample + alpha * s + math.sqrt(2 * alpha) * xi, rtol=1e-14)
    assert out.pred_original_sample is None
    # draws as model_output: the fused step with the level's law; pred_original_sample is the draw mean
    draws = torch.randn(6, 5, 2, generator=gen(seed + 3), dtype=F64)
    prev, mean = loaded.step(draws, t, sample, generator=gen(seed + 2), return_dict=False)
    level = loaded.noise_params(t)
    expected = etweedie.langevin_step(sample, draws, xi, alpha, float(level.beta), float(level.lam), level.metric(2))
    assert torch.allclose(prev, expected, rtol=1e-14) and torch.allclose(mean, draws.mean(1))


def test_scheduler_errors():
    mod = _scheduler_module()
    with pytest.raises(ValueError, match="path must be one of"):
        mod.EnergyTweedieLangevinScheduler(path="nope")
    with pytest.raises(ValueError, match="given together"):
        mod.EnergyTweedieLangevinScheduler(r_max=1.0)
    with pytest.raises(ValueError, match="steps_per_level must be an int >= 1"):
        mod.EnergyTweedieLangevinScheduler(steps_per_level=0)
    with pytest.raises(ValueError, match="step_scale must be a float > 0"):
        mod.EnergyTweedieLangevinScheduler(step_scale=-1.0)
    scheduler = mod.EnergyTweedieLangevinScheduler(num_levels=4, steps_per_level=1)
    sample = torch.zeros(3, 2, dtype=F64)
    t = scheduler.timesteps[0]
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        scheduler.step(torch.zeros(3, 2, dtype=F64), t, sample)
    with pytest.raises(ValueError, match="model_output must be posterior draws"):
        scheduler.step(torch.zeros(3, 4, 3, dtype=F64), t, sample, generator=gen(0))
    with pytest.raises(ValueError, match="not one of this schedule's level times"):
        scheduler.step(torch.zeros(3, 2, dtype=F64), 0.123, sample, generator=gen(0))
    # a failed set_timesteps (a device this machine lacks) leaves the schedule as it was
    if not torch.cuda.is_available():
        before = (scheduler.level_times.clone(), scheduler.timesteps.clone(), scheduler.num_inference_steps)
        with pytest.raises(ValueError, match="CUDA is not available"):
            scheduler.set_timesteps(7, device="cuda")
        assert torch.equal(scheduler.level_times, before[0]) and torch.equal(scheduler.timesteps, before[1])
        assert scheduler.num_inference_steps == before[2]
    with pytest.raises(ValueError, match="device must be a device string"):
        scheduler.set_timesteps(7, device="gpu")


def test_scheduler_takes_its_timesteps_in_any_float_dtype():
    scheduler = _scheduler_module().EnergyTweedieLangevinScheduler(num_levels=51, steps_per_level=1)
    exact = [scheduler._level(t) for t in scheduler.timesteps]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert [scheduler._level(t) for t in scheduler.timesteps.to(dtype)] == exact
    assert exact == list(range(51))


@pytest.mark.parametrize("path", ["gaussian", "joint", "rotating"])
def test_scheduler_step_is_the_langevin_formula_in_float64(seed, path):
    """y + α_k ŝ(y) + sqrt(2 α_k) ξ with ŝ = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i),
    P = Σ⁻¹, Σ = (σ/c_{β,d})² S(u, v), α_k = ε (r_k / r_{L−1})², written out here in float64."""
    scheduler = _scheduler_module().EnergyTweedieLangevinScheduler(path=path, num_levels=6, steps_per_level=2,
                                                                   step_scale=1e-3)
    k = int(torch.randint(0, 6, (), generator=gen(seed)))
    t = scheduler.timesteps[2 * k]  # level k's time, repeated steps_per_level times
    y = torch.randn(4, 2, generator=gen(seed + 1), dtype=F64)
    x = y.unsqueeze(1) + torch.randn(4, 7, 2, generator=gen(seed + 2), dtype=F64)
    prev = scheduler.step(x, t, y, generator=gen(seed + 3)).prev_sample

    levels = [scheduler.noise_path(tk) for tk in scheduler.level_times]
    rms = [float(p.sigma) * float(p.lam) ** (-1 / float(p.beta)) for p in levels]
    alpha = 1e-3 * (rms[k] / rms[-1]) ** 2
    p = levels[k]
    beta, lam, sigma, u, v = (torch.as_tensor(getattr(p, n), dtype=F64) for n in ("beta", "lam", "sigma", "u", "v"))
    S = torch.stack([torch.stack([1 + u, v]), torch.stack([v, 1 - u])])
    P = torch.linalg.inv((sigma / etweedie.geometry.scale_constant(beta, 2)) ** 2 * S)
    diff = y.unsqueeze(1) - x
    q = torch.einsum("bni,ij,bnj->bn", diff, P, diff)
    score = -lam * (q.unsqueeze(-1) ** ((beta - 2) / 2) * diff @ P).mean(1)
    xi = torch.randn(4, 2, generator=gen(seed + 3), dtype=F64)
    expected = y + alpha * score + math.sqrt(2 * alpha) * xi
    assert math.isclose(scheduler.step_size(t), alpha, rel_tol=1e-12)
    assert torch.allclose(prev, expected, rtol=1e-10, atol=1e-12), f"seed={seed}: {(prev - expected).abs().max():.3g}"
    # float32 in, float32 out, within float32 rounding of the float64 value
    prev32 = scheduler.step(x.float(), t, y.float(), generator=gen(seed + 3)).prev_sample
    assert prev32.dtype == torch.float32 and torch.allclose(prev32.double(), expected, rtol=1e-4, atol=1e-4)
    # the same seed gives the same sample
    assert torch.equal(scheduler.step(x, t, y, generator=gen(seed + 3)).prev_sample, prev)


def test_scheduler_non_contiguous_and_broadcast_inputs(seed):
    scheduler = _scheduler_module().EnergyTweedieLangevinScheduler(path="rotating", num_levels=4, steps_per_level=1)
    t = scheduler.timesteps[1]
    y = torch.randn(2, 5, generator=gen(seed), dtype=F64).t()  # (5, 2), transposed
    x = torch.randn(6, 5, 2, generator=gen(seed + 1), dtype=F64).permute(1, 0, 2)  # (5, 6, 2)
    out = scheduler.step(x, t, y, generator=gen(seed + 2)).prev_sample
    assert torch.equal(out, scheduler.step(x.contiguous(), t, y.contiguous(), generator=gen(seed + 2)).prev_sample)
    y1 = y[:1].expand(5, 2)  # one state broadcast over the batch
    x1 = x[:1].expand(5, 6, 2)
    out = scheduler.step(x1, t, y1, generator=gen(seed + 2)).prev_sample
    assert torch.equal(out, scheduler.step(x1.contiguous(), t, y1.contiguous(), generator=gen(seed + 2)).prev_sample)


def test_scheduler_zero_size_batch():
    scheduler = _scheduler_module().EnergyTweedieLangevinScheduler(num_levels=4, steps_per_level=1)
    t = scheduler.timesteps[0]
    for event in ((2,), (1, 2)):
        sample = torch.zeros(0, *event, dtype=F64)
        out = scheduler.step(torch.zeros(0, *event, dtype=F64), t, sample, generator=gen(0))  # a score
        assert out.prev_sample.shape == sample.shape
        out = scheduler.step(torch.zeros(0, 5, *event, dtype=F64), t, sample, generator=gen(0))  # posterior draws
        assert out.prev_sample.shape == sample.shape and out.pred_original_sample.shape == sample.shape
    assert scheduler.eta(t, 0).shape == (0, 5)


_TIMESTEP = "timestep must be one entry of scheduler.timesteps"
_FLOAT_DTYPE = "dtype must be a floating-point torch.dtype"


@pytest.mark.parametrize(
    "call, error, match",
    [
        pytest.param(lambda sch, x, t: sch.step(x, None, x, generator=gen(0)), TypeError, _TIMESTEP,
                     id="step-timestep-none"),
        pytest.param(lambda sch, x, t: sch.step(x, "0.0", x, generator=gen(0)), TypeError, _TIMESTEP,
                     id="step-timestep-str"),
        pytest.param(lambda sch, x, t: sch.step(x, sch.timesteps[:2], x, generator=gen(0)), TypeError, _TIMESTEP,
                     id="step-timestep-slice"),
        pytest.param(lambda sch, x, t: sch.step(x, False, x, generator=gen(0)), TypeError, _TIMESTEP,
                     id="step-timestep-bool"),
        pytest.param(lambda sch, x, t: sch.step(x, torch.tensor(True), x, generator=gen(0)), TypeError, _TIMESTEP,
                     id="step-timestep-bool-tensor"),
        pytest.param(lambda sch, x, t: sch.eta(None, 3), TypeError, "timestep must be", id="eta-timestep-none"),
        # an integer, bool or complex model output is refused, not cast (complex would lose its imaginary part)
        *(pytest.param(lambda sch, x, t, dtype=dtype: sch.step(torch.zeros(3, 2, dtype=dtype), t, x, generator=gen(0)),
                       TypeError, f"model_output must be a floating-point tensor.*{dtype}",
                       id=f"step-model_output-{str(dtype).removeprefix('torch.')}")
          for dtype in (torch.int64, torch.bool, torch.complex128)),
        pytest.param(lambda sch, x, t: sch.step(torch.zeros(2, dtype=F64), t, torch.zeros(2, dtype=F64),
                                                generator=gen(0)),
                     ValueError, r"sample must have shape \(batch, \*event\), got \(2,\)", id="step-sample-unbatched"),
        pytest.param(lambda sch, x, t: sch.eta(t, -1), ValueError, "batch must be >= 0, got -1", id="eta-batch-negative"),
        pytest.param(lambda sch, x, t: sch.eta(t, 2.5), TypeError, "batch must be an int", id="eta-batch-float"),
        pytest.param(lambda sch, x, t: sch.eta(t, 3, dtype=torch.int64), TypeError, _FLOAT_DTYPE, id="eta-dtype-int64"),
        pytest.param(lambda sch, x, t: sch.eta(t, 3, dtype="float64"), TypeError, _FLOAT_DTYPE, id="eta-dtype-str"),
        pytest.param(lambda sch, x, t: sch.eta(t, 3, device="gpu"), ValueError, "device must be a device string",
                     id="eta-device-gpu"),
    ],
)
def test_scheduler_argument_errors(call, error, match):
    """step and eta: a ValueError/TypeError naming the argument, never torch's own error or a silent cast."""
    scheduler = _scheduler_module().EnergyTweedieLangevinScheduler(num_levels=4, steps_per_level=1)
    with pytest.raises(error, match=match):
        call(scheduler, torch.zeros(3, 2, dtype=F64), scheduler.timesteps[0])


# ---------------------------------------------------------------------------- k-diffusion
def test_kdiffusion_denoiser_refuses_non_gaussian_paths():
    post = KnownPosterior()
    for name in ("isotropic", "joint", "mnist_joint"):  # β < 2 somewhere (mnist_joint: β = 2 only at t = 0)
        with pytest.raises(ValueError, match="probability-flow ODE"):
            KDiffusionDenoiser(post, name, n_draws=2)
    turning = NoisePath("turning", beta=2.0, lam=1.0, u=0.0, v=lambda t: 0.5 * t, rms=GeometricRMS(1.0, 0.01))
    with pytest.raises(ValueError, match="changes v along the path"):
        KDiffusionDenoiser(post, turning, n_draws=2)
    with pytest.raises(TypeError, match="path must be"):
        KDiffusionDenoiser(post, 3, n_draws=2)


@pytest.mark.parametrize("path", ["gaussian", "mnist_gaussian_nondiagonal"])
def test_kdiffusion_denoiser_is_the_posterior_draw_mean(seed, path):
    """At β = 2, D = x + σ² S ŝ equals the mean of the draws (Tweedie is exact on the empirical law)."""
    post = KnownPosterior()
    denoiser = KDiffusionDenoiser(post, path, n_draws=12, generator=gen(seed))
    x = 1.5 * torch.randn(10, 2, generator=gen(seed + 1), dtype=F64)
    sigma = torch.linspace(0.0, 1.2, 10, dtype=F64)
    out = denoiser(x, sigma)
    params = denoiser.noise_params(sigma[1:])
    draws = post.sample(x[1:], params.eta(), 12, generator=gen(seed))
    assert torch.allclose(out[1:], draws.mean(1), rtol=1e-10, atol=1e-12), f"seed={seed}"
    assert torch.equal(out[0], x[0])  # σ = 0: unchanged
    assert math.isclose(float(params.realized_rms()[-1]), 1.2, rel_tol=1e-12)  # k-diffusion's σ is the realized RMS
    sig = denoiser.sigmas(5)
    assert sig.shape == (6,) and sig[-1] == 0 and bool((sig[:-1].diff() < 0).all())


@pytest.mark.parametrize(
    "call, error, match",
    [
        *(pytest.param(lambda d, x, bad=bad: d(x, bad), TypeError, "sigma must be a number or a tensor", id=f"sigma-{name}")
          for name, bad in (("str", "0.5"), ("none", None), ("bool", True), ("complex", 0.5 + 0j),
                            ("list", [0.5, 0.5, 0.5]))),
        *(pytest.param(lambda d, x, dtype=dtype: d(x, torch.ones(3, dtype=dtype)), TypeError, "sigma must be a real",
                       id=f"sigma-{str(dtype).removeprefix('torch.')}-tensor")
          for dtype in (torch.bool, torch.complex128)),
        pytest.param(lambda d, x: d(x, float("nan")), ValueError, "sigma must be >= 0 and finite", id="sigma-nan"),
        pytest.param(lambda d, x: d(x[0], 0.5), ValueError, r"x must have shape \(batch, \*event\), got \(2,\)",
                     id="x-unbatched"),
        pytest.param(lambda d, x: d.sigmas(4, dtype=torch.int64), TypeError, _FLOAT_DTYPE, id="sigmas-dtype-int64"),
        pytest.param(lambda d, x: d.sigmas(4, dtype="float64"), TypeError, _FLOAT_DTYPE, id="sigmas-dtype-str"),
        pytest.param(lambda d, x: d.sigmas(4, device="gpu"), ValueError, "device must be a device string",
                     id="sigmas-device-gpu"),
        pytest.param(lambda d, x: d.sigmas(4, device="cuda"), ValueError, "CUDA is not available",
                     id="sigmas-device-cuda",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
        pytest.param(lambda d, x: KDiffusionDenoiser(KnownPosterior(), "nope", n_draws=2), ValueError,
                     "path must be a NoisePath or one of", id="path-unknown-name"),
    ],
)
def test_kdiffusion_denoiser_argument_errors(call, error, match):
    denoiser = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=2)
    with pytest.raises(error, match=match):
        call(denoiser, torch.zeros(3, 2, dtype=F64))


def test_kdiffusion_denoiser_non_contiguous_float32_and_reproducible(seed):
    x = 1.5 * torch.randn(2, 6, generator=gen(seed), dtype=F64).t()  # (6, 2), transposed
    sigma = torch.linspace(0.1, 1.0, 6, dtype=F64)
    out = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x, sigma)
    again = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x.contiguous(), sigma)
    assert torch.equal(out, again)
    out32 = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x.float(), sigma.float())
    assert out32.dtype == torch.float32 and out32.shape == x.shape and bool(torch.isfinite(out32).all())


@pytest.mark.parametrize("sampler_name", ["sample_euler", "sample_heun", "sample_dpmpp_2m"])
def test_kdiffusion_samplers_reach_the_clean_draw_floor(seed, sampler_name):
    try:
        sampling = load_k_diffusion_sampling()
    except ImportError as exc:
        pytest.skip(f"k-diffusion samplers unavailable ({exc}); `pip install --no-deps k-diffusion torchsde torchdiffeq trampoline scipy`")
    n = 1024
    # k-diffusion starts from x_σmax ≈ σ_max·ε, so σ_max must dwarf the data (radius 2): 20 here.

    def run(s: int) -> torch.Tensor:
        denoiser = KDiffusionDenoiser(KnownPosterior(), get_path("gaussian", GeometricRMS(20.0, 0.01)), n_draws=16,
                                      generator=gen(s + 1))
        sigmas = denoiser.sigmas(21)
        g = gen(s + 2)
        x = EightGaussians().sample(n, g, dtype=F64)[0] + sigmas[0] * torch.randn(n, 2, generator=g, dtype=F64)
        return getattr(sampling, sampler_name)(denoiser, x, sigmas, disable=True)

    _like_clean_draws(run, seed, f"{sampler_name}'s samples are")


def test_k_diffusion_loader_names_the_missing_module(monkeypatch):
    """Without scipy (which k_diffusion/sampling.py imports itself) the loader's message names
    scipy, not the three other packages (it told users to install torchsde/torchdiffeq/trampoline)."""
    import importlib.util
    import sys

    from etweedie.interop import kdiffusion

    if importlib.util.find_spec("k_diffusion") is None:
        pytest.skip("k-diffusion is not installed")
    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.") or m.startswith(kdiffusion._SHIM)
                 or m == "k_diffusion" or m.startswith("k_diffusion.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy` raises ImportError(name="scipy")
    with pytest.raises(ImportError, match=r"needs scipy: `pip install --no-deps scipy`"):
        kdiffusion.load_k_diffusion_sampling()
    assert kdiffusion._SHIM + ".sampling" not in sys.modules


def test_gaussian_and_odd_dimension_laws_with_multi_dim_batches(seed):
    y = torch.randn(3, 4, 3, generator=gen(seed), dtype=F64)
    x = torch.randn(3, 4, 5, 3, generator=gen(seed + 1), dtype=F64)
    sigma = torch.linspace(0.3, 1.4, 12, dtype=F64).reshape(3, 4)
    s = score_with_law(y, x, sigma)
    assert torch.allclose(s, -(y - x.mean(-2)) / sigma[..., None] ** 2, rtol=1e-12)
    s_scalar = score_with_law(y, x, 0.5)
    assert torch.allclose(s_scalar, -(y - x.mean(-2)) / 0.25, rtol=1e-12)
    # NoiseParams with per-row σ in odd d: each row its own isotropic law
    params = NoiseParams(torch.tensor(1.5, dtype=F64), torch.tensor(1.2, dtype=F64), sigma, 0.0, 0.0)
    s_np = score_with_law(y, x, params)
    var = (sigma / etweedie.geometry.scale_constant(torch.tensor(1.5, dtype=F64), 3)) ** 2
    for i in range(3):
        expected = etweedie.et_score(y[i], x[i], 1.5, 1.2, Metric.isotropic(var[i]))  # var: float64 (4,)
        assert torch.allclose(s_np[i], expected, rtol=1e-12)
    # unbatched query
    assert torch.allclose(score_with_law(y[0, 0], x[0, 0], 0.5), s_scalar[0, 0], rtol=1e-12)
    with pytest.raises(ValueError, match="draws must have shape"):
        score_with_law(y, x[:, :2], 0.5)
