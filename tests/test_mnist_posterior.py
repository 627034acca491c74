"""The image posterior (784-d Engression model with the preconditioned output), a tiny MNIST
training run, and the pretrained weights shipped in the repository (``load_posterior("mnist")``).

Tests that need the MNIST files skip when they are absent (CI has them at ../shared/data/mnist)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from etweedie.models import EngressionPosterior
from etweedie.noise import NoiseParams

from conftest import gen

D = 784
PRIOR_LOW = (1.3, 0.0, math.log(0.025), -0.7, -0.7)
PRIOR_HIGH = (2.0, math.log(2.5), math.log(6.0), 0.7, 0.7)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def image_posterior(**kw) -> EngressionPosterior:
    args = dict(width=32, depth=2, noise_dim=4, conditioning="concat", output="preconditioned",
                eta_low=PRIOR_LOW, eta_high=PRIOR_HIGH, data_center=MNIST_MEAN, data_std=MNIST_STD)
    args.update(kw)
    return EngressionPosterior(D, **args)


def eta_at(r: float, beta=1.4, lam=1.8, u=0.0, v=0.6) -> torch.Tensor:
    return NoiseParams(beta, lam, NoiseParams.sigma_for_rms(r, lam, beta), u, v).eta()


# ---------------------------------------------------------------------------- the model
@pytest.mark.parametrize("conditioning", ["concat", "film"])
def test_shapes_and_finite(conditioning):
    model = image_posterior(conditioning=conditioning)
    y = torch.rand(5, D, generator=gen(0))
    out = model.sample(y, eta_at(0.5), 3, generator=gen(1))
    assert out.shape == (5, 3, D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    per_row = model.sample(y, eta_at(0.5).expand(5, 5).clone(), 3, generator=gen(1))
    assert torch.equal(out, per_row)


def test_output_changes_with_every_eta_coordinate():
    model = image_posterior()
    y = torch.rand(4, D, generator=gen(2))
    base = eta_at(0.5)
    ref = model.sample(y, base, 2, generator=gen(3))
    for k, delta in enumerate((0.2, 0.3, 0.5, 0.2, -0.3)):
        eta = base.clone()
        eta[k] += delta
        moved = model.sample(y, eta, 2, generator=gen(3))
        assert (moved - ref).abs().amax() > 1e-4, f"η coordinate {k} has no effect"


def test_deterministic_from_seed_and_init_seed():
    y = torch.rand(3, D, generator=gen(4))
    a = image_posterior(init_seed=7).sample(y, eta_at(1.0), 4, generator=gen(5))
    b = image_posterior(init_seed=7).sample(y, eta_at(1.0), 4, generator=gen(5))
    c = image_posterior(init_seed=7).sample(y, eta_at(1.0), 4, generator=gen(6))
    d = image_posterior(init_seed=8).sample(y, eta_at(1.0), 4, generator=gen(5))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_preconditioning_limits():
    """c_skip → 1 and c_out → 0 as r → 0 (the draw is y); as r ≫ s_d the draw ignores y's scale:
    x = μ + c_skip(y − μ) + c_out F with c_skip ≈ s_d²/r² and c_out ≈ s_d."""
    model = image_posterior()
    y = torch.rand(2, D, generator=gen(7))
    tiny = NoiseParams(2.0, 1.0, 1e-6, 0.0, 0.0).eta()
    out = model.sample(y, tiny, 3, generator=gen(8))
    assert (out - y[:, None]).abs().amax() < 1e-4
    # with the network's last layer zeroed the draw is exactly μ + c_skip (y − μ)
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.zero_()
        model.cond_out.weight.zero_()
    r = 3.0
    out = model.sample(y, eta_at(r, beta=2.0, lam=1.0, v=0.0), 2, generator=gen(9))
    skip = MNIST_STD**2 / (MNIST_STD**2 + r**2)
    torch.testing.assert_close(out, (MNIST_MEAN + skip * (y - MNIST_MEAN))[:, None].expand_as(out))


def test_preconditioned_config_roundtrip_and_bad_values():
    model = image_posterior()
    clone = EngressionPosterior(**model.config)
    clone.load_state_dict(model.state_dict())
    y = torch.rand(2, D, generator=gen(10))
    assert torch.equal(model.sample(y, eta_at(0.3), 2, generator=gen(11)), clone.sample(y, eta_at(0.3), 2, generator=gen(11)))
    with pytest.raises(ValueError, match="data_std"):
        image_posterior(data_std=0.0)
    with pytest.raises(TypeError, match="data_center"):
        image_posterior(data_center="half")
    with pytest.raises(ValueError, match="output"):
        image_posterior(output="sigmoid")
