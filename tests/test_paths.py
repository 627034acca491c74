"""Noise-parameter paths: endpoints and definitions of the paper's paths, σ_t realizing r_t, errors."""

import math

import pytest
import torch

from etweedie.noise import NoiseParams
from etweedie.sample.paths import (
    DEFAULT_LEVELS,
    EIGHT_GAUSSIAN_PATHS,
    ISOLATION_ARMS,
    MNIST_PATHS,
    GeometricRMS,
    NoisePath,
    get_path,
    level_times,
    path_names,
)

T = torch.tensor


def _at(name, t):
    beta, lam, r, u, v = get_path(name).coordinates(T([t], dtype=torch.float64))
    return [float(beta), float(lam), float(r), float(u), float(v)]


@pytest.mark.parametrize("name", list(EIGHT_GAUSSIAN_PATHS) + ["gaussian"])
def test_eight_gaussian_paths_hit_the_rms_endpoints(name):
    p = get_path(name)(level_times(DEFAULT_LEVELS[name]))
    r = p.realized_rms()
    assert r.shape == (51,)
    assert r[0].item() == pytest.approx(0.83, rel=1e-12)
    assert r[-1].item() == pytest.approx(0.0083, rel=1e-12)
    # geometric: constant ratio between neighbouring levels, 0.01^(1/50)
    ratio = r[1:] / r[:-1]
    assert torch.allclose(ratio, torch.full_like(ratio, 0.01 ** (1 / 50)), rtol=1e-10)


def test_eight_gaussian_path_definitions():
    # Eq. (full5_paths): (β, λ, r, u, v) at t = 0, 1/4, 1/2, 1
    assert _at("isotropic", 0.5)[:2] + _at("isotropic", 0.5)[3:] == [1.4, 1.8, 0.0, 0.0]
    assert _at("nondiagonal", 0.3)[3:] == [0.0, 0.6]
    for t, (u, v) in ((0.0, (0.0, 0.6)), (0.25, (-0.6, 0.0)), (0.5, (0.0, -0.6)), (0.75, (0.6, 0.0)), (1.0, (0.0, 0.6))):
        got = _at("rotating", t)
        assert got[:2] == [1.4, 1.8]
        assert got[3] == pytest.approx(u, abs=1e-12) and got[4] == pytest.approx(v, abs=1e-12)
        assert _at("joint", t)[3:] == pytest.approx(got[3:], abs=1e-12)
    # joint: β_t = 1.4 + 0.5 sin²(πt), λ_t = 1.8 + 0.4 sin(2πt); endpoints pinned to rotating
    assert _at("joint", 0.0)[:2] == pytest.approx([1.4, 1.8])
    assert _at("joint", 1.0)[:2] == pytest.approx([1.4, 1.8])
    assert _at("joint", 0.5)[:2] == pytest.approx([1.9, 1.8])
    assert _at("joint", 0.25)[:2] == pytest.approx([1.65, 2.2])
    assert _at("joint", 0.75)[:2] == pytest.approx([1.65, 1.4])


def test_isolation_arms_are_constant_on_the_49_level_schedule():
    times = level_times(49)
    assert len(ISOLATION_ARMS) == 11
    for name, (beta, lam, u, v) in ISOLATION_ARMS.items():
        assert DEFAULT_LEVELS[name] == 49
        b, l, r, uu, vv = get_path(name).coordinates(times)
        for values, want in ((b, beta), (l, lam), (uu, u), (vv, v)):
            assert torch.all(values == want)
        assert r[0].item() == pytest.approx(0.8329) and r[-1].item() == pytest.approx(0.0100)
    # the reference arm is the fixed non-diagonal path's tuple
    assert ISOLATION_ARMS["fixed_ref"] == (1.4, 1.8, 0.0, 0.6)


def test_mnist_paths():
    assert set(MNIST_PATHS) == {
        "mnist_gaussian_isotropic", "mnist_gaussian_nondiagonal", "mnist_generalized_isotropic",
        "mnist_generalized_nondiagonal", "mnist_joint",
    }
    # joint: starts at the Gaussian/isotropic start, ends at the generalized/non-diagonal end
    assert _at("mnist_joint", 0.0) == pytest.approx(_at("mnist_gaussian_isotropic", 0.0))
    assert _at("mnist_joint", 1.0) == pytest.approx(_at("mnist_generalized_nondiagonal", 1.0))
    assert _at("mnist_joint", 0.5) == pytest.approx([1.7, 1.4, 2.63 * math.sqrt(0.197 / 2.63), 0.3, 0.3])
    r = get_path("mnist_gaussian_nondiagonal")(level_times(64)).realized_rms()
    assert r[0].item() == pytest.approx(2.63) and r[-1].item() == pytest.approx(0.197)
    # the 784-pixel geometry builds (block metric I_392 ⊗ S)
    assert get_path("mnist_joint")(T(0.5, dtype=torch.float64)).metric(784).kind == "block"


@pytest.mark.parametrize("name", ["joint", "fixed_lam2.5", "mnist_joint"])
def test_sigma_realizes_the_rms_schedule(name):
    """σ_t = r_t λ_t^{1/β_t}: the noise's realized per-coordinate RMS is r_t, also empirically."""
    path = get_path(name)
    t = T([0.0, 0.3, 0.8, 1.0], dtype=torch.float64)
    p = path(t)
    assert torch.allclose(p.realized_rms(), path.rms(t), rtol=1e-12)
    level = NoiseParams(*(f[1] for f in torch.broadcast_tensors(*p._tensors())))
    u = level.noise(2).sample((200_000,), generator=torch.Generator().manual_seed(0))
    assert u.pow(2).mean().sqrt().item() == pytest.approx(float(path.rms(t[1:2])), rel=0.01)


def test_paths_are_vectorized_over_t():
    t = torch.rand(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = get_path("joint")(t)
    assert p.batch_shape == (3, 4)
    assert p.eta().shape == (3, 4, 5)
    one = get_path("joint")(t[1, 2])
    assert torch.allclose(one.eta(), p.eta()[1, 2])


def test_eta_round_trip():
    p = get_path("joint")(level_times(7))
    q = NoiseParams.from_eta(p.eta())
    assert torch.allclose(q.eta(), p.eta(), atol=1e-12)
    assert torch.allclose(q.realized_rms(), p.realized_rms(), rtol=1e-12)


def test_user_path_in_a_few_lines():
    path = NoisePath("tilting", beta=1.6, lam=1.5, v=lambda t: 0.5 * torch.sin(math.pi * t), rms=GeometricRMS(0.8, 0.01))
    p = path(level_times(5))
    assert p.realized_rms()[0].item() == pytest.approx(0.8) and p.realized_rms()[-1].item() == pytest.approx(0.01)
    assert p.v[2].item() == pytest.approx(0.5)
    again = path.with_rms(GeometricRMS(1.0, 0.1))(level_times(2))
    assert again.realized_rms().tolist() == pytest.approx([1.0, 0.1])


def test_user_coordinates_and_level_times_are_checked():
    bad = NoisePath("bad", beta=lambda t: torch.ones(2, dtype=t.dtype), lam=1.0, rms=GeometricRMS(0.8, 0.01))
    with pytest.raises(ValueError, match=r"beta\(t\) must return a tensor of t's shape \(3,\)"):
        bad(level_times(3))
    scalar = NoisePath("scalar", beta=lambda t: torch.tensor(1.5, dtype=t.dtype), lam=1.0, rms=GeometricRMS(0.8, 0.01))
    assert scalar(level_times(3)).beta.tolist() == [1.5, 1.5, 1.5]  # a 0-d value broadcasts
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        level_times(3, dtype=torch.int64)


def test_registry_names():
    names = path_names()
    assert {"isotropic", "nondiagonal", "rotating", "joint", "gaussian"} <= set(names)
    assert all(name in DEFAULT_LEVELS for name in names)


def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="name must be one of"):
        get_path("spiral")
    with pytest.raises(TypeError, match="name must be a str"):
        get_path(3)
    with pytest.raises(ValueError, match=r"t must lie in \[0, 1\]"):
        get_path("joint")(T([1.5]))
    with pytest.raises(TypeError, match="t must be"):
        get_path("joint")(T([1]))
    with pytest.raises(ValueError, match="r_min must be > 0"):
        GeometricRMS(0.8, -1.0)
    with pytest.raises(TypeError, match="r_max must be a float"):
        GeometricRMS("big", 0.1)
    for r_max, r_min in ((0.1, 1.0), (0.5, 0.5)):
        with pytest.raises(ValueError, match="need finite r_max > r_min"):
            GeometricRMS(r_max, r_min)
    with pytest.raises(TypeError, match="beta must be a float or a callable"):
        NoisePath("p", beta="1.4", lam=1.0, rms=GeometricRMS(1.0, 0.1))
    with pytest.raises(TypeError, match="rms must be a callable"):
        NoisePath("p", beta=1.4, lam=1.0, rms=0.5)
    with pytest.raises(ValueError, match="n_levels must be >= 1"):
        level_times(0)
    with pytest.raises(ValueError, match="beta must lie in"):  # validated by NoiseParams
        NoisePath("p", beta=2.5, lam=1.0, rms=GeometricRMS(1.0, 0.1))(T([0.5]))
    with pytest.raises(ValueError, match="unit disk"):
        NoisePath("p", beta=1.4, lam=1.0, u=0.8, v=0.8, rms=GeometricRMS(1.0, 0.1))(T([0.5]))
    with pytest.raises(ValueError, match=r"eta must have shape \(\.\.\., 5\)"):
        NoiseParams.from_eta(torch.zeros(3, 4))


@pytest.mark.parametrize("config", ["eight_gaussians_diffusion_cpu.toml", "eight_gaussians_diffusion_full.toml"])
def test_diffusion_training_prior_covers_every_eight_gaussian_path(config):
    """The diffusion posteriors' training prior contains every (β, λ, σ, u, v) the paper's
    eight-Gaussian paths and isolation arms visit on their schedules (a model queried outside
    its training box extrapolates, and the score amplifies that error by 1/r at small r)."""
    from pathlib import Path

    from etweedie.sample import EIGHT_GAUSSIAN_PATHS, ISOLATION_ARMS
    from etweedie.training import load_config

    prior = load_config(Path(__file__).resolve().parents[1] / "configs" / config).prior
    for name in (*EIGHT_GAUSSIAN_PATHS, *ISOLATION_ARMS):
        p = get_path(name)(level_times(DEFAULT_LEVELS[name]))
        for field, (lo, hi) in (("beta", prior.beta), ("lam", prior.lam), ("sigma", prior.sigma)):
            values = getattr(p, field)
            assert float(values.min()) >= lo - 1e-9 and float(values.max()) <= hi + 1e-9, (
                f"{config}: path {name} visits {field} in [{float(values.min()):.4g}, {float(values.max()):.4g}], "
                f"outside the training prior [{lo}, {hi}]"
            )
        assert float((p.u**2 + p.v**2).max()) <= prior.disk_radius**2 + 1e-9, f"{config}: path {name} leaves the (u, v) disk"
