"""etweedie.interop at its edges: a Langevin step against a float64 formula written out by hand,
zero-size batches, non-contiguous and broadcast inputs, and the errors bad arguments raise
(a ValueError/TypeError naming the argument, never torch's own error or a silent cast).
"""

from __future__ import annotations

import math

import pytest
import torch

from etweedie.geometry import scale_constant
from etweedie.interop import GaussianDenoiser, KDiffusionDenoiser, score_from_sampler
from etweedie.known_posterior import KnownPosterior

from conftest import gen

F64 = torch.float64


def _scheduler(**kwargs):
    pytest.importorskip("diffusers", reason="diffusers not installed (pip install diffusers; in the test/interop extras)")
    from etweedie.interop.diffusers_scheduler import EnergyTweedieLangevinScheduler

    return EnergyTweedieLangevinScheduler(**kwargs)


def _cloud_sampler(y, n, generator):
    z = torch.randn(*y.shape[:-1], n, y.shape[-1], generator=generator, dtype=y.dtype)
    return y.unsqueeze(-2) * 0.5 + 0.3 * z


# ---------------------------------------------------------------------------- diffusers scheduler
@pytest.mark.parametrize("path", ["gaussian", "joint", "rotating"])
def test_scheduler_step_is_the_langevin_formula_in_float64(seed, path):
    """y + α_k ŝ(y) + sqrt(2 α_k) ξ with ŝ = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i),
    P = Σ⁻¹, Σ = (σ/c_{β,d})² S(u, v), α_k = ε (r_k / r_{L−1})², written out here in float64."""
    scheduler = _scheduler(path=path, num_levels=6, steps_per_level=2, step_scale=1e-3)
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
    P = torch.linalg.inv((sigma / scale_constant(beta, 2)) ** 2 * S)
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
    scheduler = _scheduler(path="rotating", num_levels=4, steps_per_level=1)
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
    scheduler = _scheduler(num_levels=4, steps_per_level=1)
    t = scheduler.timesteps[0]
    for event in ((2,), (1, 2)):
        sample = torch.zeros(0, *event, dtype=F64)
        out = scheduler.step(torch.zeros(0, *event, dtype=F64), t, sample, generator=gen(0))  # a score
        assert out.prev_sample.shape == sample.shape
        out = scheduler.step(torch.zeros(0, 5, *event, dtype=F64), t, sample, generator=gen(0))  # posterior draws
        assert out.prev_sample.shape == sample.shape and out.pred_original_sample.shape == sample.shape


def test_scheduler_argument_errors():
    scheduler = _scheduler(num_levels=4, steps_per_level=1)
    sample = torch.zeros(3, 2, dtype=F64)
    t = scheduler.timesteps[0]
    for bad in (None, "0.0", scheduler.timesteps[:2], False, torch.tensor(True)):
        with pytest.raises(TypeError, match="timestep must be one entry of scheduler.timesteps"):
            scheduler.step(sample, bad, sample, generator=gen(0))
    with pytest.raises(TypeError, match="timestep must be"):
        scheduler.eta(None, 3)
    # an integer, bool or complex model output is refused, not cast (complex would lose its imaginary part)
    for dtype in (torch.int64, torch.bool, torch.complex128):
        with pytest.raises(TypeError, match=f"model_output must be a floating-point tensor.*{dtype}"):
            scheduler.step(torch.zeros(3, 2, dtype=dtype), t, sample, generator=gen(0))
    with pytest.raises(ValueError, match=r"sample must have shape \(batch, \*event\), got \(2,\)"):
        scheduler.step(torch.zeros(2, dtype=F64), t, torch.zeros(2, dtype=F64), generator=gen(0))
    with pytest.raises(ValueError, match="batch must be >= 0, got -1"):
        scheduler.eta(t, -1)
    with pytest.raises(TypeError, match="batch must be an int"):
        scheduler.eta(t, 2.5)
    for dtype in (torch.int64, "float64"):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            scheduler.eta(t, 3, dtype=dtype)
    with pytest.raises(ValueError, match="device must be a device string"):
        scheduler.eta(t, 3, device="gpu")
    assert scheduler.eta(t, 0).shape == (0, 5)


# ---------------------------------------------------------------------------- k-diffusion denoiser
def test_kdiffusion_denoiser_argument_errors():
    denoiser = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=2)
    x = torch.zeros(3, 2, dtype=F64)
    for bad in ("0.5", None, True, 0.5 + 0j, [0.5, 0.5, 0.5]):
        with pytest.raises(TypeError, match="sigma must be a number or a tensor"):
            denoiser(x, bad)
    for dtype in (torch.bool, torch.complex128):
        with pytest.raises(TypeError, match="sigma must be a real"):
            denoiser(x, torch.ones(3, dtype=dtype))
    with pytest.raises(ValueError, match="sigma must be >= 0 and finite"):
        denoiser(x, float("nan"))
    with pytest.raises(ValueError, match=r"x must have shape \(batch, \*event\), got \(2,\)"):
        denoiser(x[0], 0.5)
    for dtype in (torch.int64, "float64"):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            denoiser.sigmas(4, dtype=dtype)
    with pytest.raises(ValueError, match="device must be a device string"):
        denoiser.sigmas(4, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            denoiser.sigmas(4, device="cuda")
    with pytest.raises(ValueError, match="path must be a NoisePath or one of"):
        KDiffusionDenoiser(KnownPosterior(), "nope", n_draws=2)


def test_kdiffusion_denoiser_non_contiguous_float32_and_reproducible(seed):
    x = 1.5 * torch.randn(2, 6, generator=gen(seed), dtype=F64).t()  # (6, 2), transposed
    sigma = torch.linspace(0.1, 1.0, 6, dtype=F64)
    out = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x, sigma)
    again = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x.contiguous(), sigma)
    assert torch.equal(out, again)
    out32 = KDiffusionDenoiser(KnownPosterior(), "gaussian", n_draws=8, generator=gen(seed + 1))(x.float(), sigma.float())
    assert out32.dtype == torch.float32 and out32.shape == x.shape and bool(torch.isfinite(out32).all())


# ---------------------------------------------------------------------------- score and Gaussian denoiser
def test_gaussian_denoiser_refuses_infinite_sigma_and_a_score_of_the_wrong_shape():
    x = torch.randn(3, 2, generator=gen(0), dtype=F64)
    prior = GaussianDenoiser(lambda x, sigma: -x / (1 + sigma[:, None] ** 2))  # N(0, I) prior: finite for any σ
    for sigma in (float("inf"), torch.tensor([0.5, float("inf"), 0.5], dtype=F64)):
        with pytest.raises(ValueError, match="sigma must be >= 0 and finite"):
            prior(x, sigma)  # was x + ∞²·(−0) = NaN
    with pytest.raises(TypeError, match="sigma must be a real"):
        prior(x, torch.full((3,), 0.5 + 0.5j))  # was cast to 0.5, dropping the imaginary part
    # a score of shape (rows, 1) or (d,) broadcast over every row silently
    for bad in (lambda x, sigma: -x[:, :1], lambda x, sigma: -x[0], lambda x, sigma: None):
        with pytest.raises(ValueError, match=r"score\(x, sigma\) must return a tensor of x's shape \(3, 2\)"):
            GaussianDenoiser(bad)(x, 1.0)


def test_sampler_score_refuses_infinite_complex_and_bool_sigma():
    score = score_from_sampler(_cloud_sampler, n_draws=3)
    y = torch.zeros(2, 2, dtype=F64)
    with pytest.raises(ValueError, match="noise σ must be > 0 and finite"):
        score(y, float("inf"))
    for dtype in (torch.complex128, torch.bool):
        with pytest.raises(TypeError, match="noise σ must be a real"):
            score(y, torch.ones(2, dtype=dtype))


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
