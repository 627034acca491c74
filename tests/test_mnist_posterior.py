"""The image posterior (784-d Engression model with the preconditioned output), a tiny MNIST
training run, and the pretrained weights shipped in the repository (``load_posterior("mnist")``).

Tests that need the MNIST files skip when they are absent (CI has them at ../shared/data/mnist)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from etweedie.posteriors import EngressionPosterior
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


def test_learned_pixel_scale_starts_at_the_scalar_model_and_learns():
    """learn_data_scale=True equals the scalar preconditioning at init (same init_seed, same
    draws); its per-pixel centre and scale receive gradients; bad combinations are named errors."""
    y = torch.rand(3, D, generator=gen(18))
    scalar = image_posterior(init_seed=3)
    pixel = image_posterior(init_seed=3, learn_data_scale=True)
    torch.testing.assert_close(pixel.sample(y, eta_at(0.4), 2, generator=gen(19)),
                               scalar.sample(y, eta_at(0.4), 2, generator=gen(19)))
    pixel.sample(y, eta_at(0.4), 2, generator=gen(19)).square().mean().backward()
    assert pixel.pixel_log_std.grad.abs().amax() > 0 and pixel.pixel_center.grad.abs().amax() > 0
    # a pixel whose learned scale → 0 drops y: the draw there is its learned centre
    with torch.no_grad():
        pixel.pixel_log_std[:10] = -3.0  # s_p = data_std · e^{-30}
        pixel.pixel_center[:10] = 0.0
    out = pixel.sample(y, eta_at(0.4), 2, generator=gen(20))
    torch.testing.assert_close(out[..., :10], torch.full_like(out[..., :10], MNIST_MEAN))
    with pytest.raises(ValueError, match="learn_data_scale"):
        image_posterior(output="residual", learn_data_scale=True)
    with pytest.raises(TypeError, match="learn_data_scale"):
        image_posterior(learn_data_scale=1)


# ---------------------------------------------------------------------------- training on MNIST
REPO = Path(__file__).resolve().parent.parent


def _mnist_or_skip(split: str):
    from etweedie.data import load_mnist

    try:
        return load_mnist(split)[0]
    except (OSError, ValueError) as exc:  # no data folder here (CI has ../shared/data/mnist or data/mnist)
        pytest.skip(f"MNIST files not available: {exc}")


def test_tiny_mnist_training_lowers_held_out_energy_score(tmp_path):
    """40 steps of the CPU config's design (narrowed) on 512 training images lower the matched
    energy score on 256 test images, with the same held-out draws before and after."""
    import dataclasses

    from etweedie.data import MnistSource
    from etweedie.training import build_posterior, held_out_loss, load_config, load_posterior, train

    train_images, test_images = _mnist_or_skip("train")[:512], _mnist_or_skip("test")[:256]
    cfg = load_config(REPO / "configs" / "mnist_cpu.toml")
    cfg = dataclasses.replace(cfg, steps=40, batch_size=32, warmup_steps=5, lr=2e-3, ema_decay=0.0, log_every=10,
                              checkpoint_every=40, threads=1,
                              model=dataclasses.replace(cfg.model, width=64, depth=2, noise_dim=4))
    held = MnistSource(test_images, (0.0, 1.0), dequantize=False)
    before = held_out_loss(build_posterior(cfg, 784), cfg, data=held, n_examples=256, draws=4)
    summary = train(cfg, tmp_path / "run", data=MnistSource(train_images, (0.0, 1.0), True), progress=False)
    after = held_out_loss(load_posterior(summary["posterior"]), cfg, data=held, n_examples=256, draws=4)
    assert summary["step"] == 40
    assert after < 0.9 * before, (before, after)


# ---------------------------------------------------------------------------- the shipped weights
PRETRAINED = REPO / "pretrained" / "mnist_cpu"


def test_pretrained_mnist_loads_by_name_and_by_path():
    from etweedie.training import load_posterior

    by_name = load_posterior("mnist")
    by_path = load_posterior(PRETRAINED)
    assert isinstance(by_name, EngressionPosterior) and by_name.dim == D
    assert by_name.config == by_path.config
    y = torch.rand(2, D, generator=gen(12))
    a = by_name.sample(y, eta_at(0.5), 3, generator=gen(13))
    b = by_path.sample(y, eta_at(0.5), 3, generator=gen(13))
    assert a.shape == (2, 3, D) and torch.equal(a, b)


@pytest.mark.parametrize("folder", ["mnist_cpu", "mnist_full"])
def test_pretrained_files_and_card_match(folder):
    """Shards ≤ 16 MiB, total ≤ 50 MB, and the model card's sha256 equal the files'."""
    import hashlib
    import json

    root = REPO / "pretrained" / folder
    card = json.loads((root / "model_card.json").read_text())
    config = json.loads((root / "config.json").read_text())
    files = config["weights"]["files"]
    assert files and set(files) == set(card["weights"]["files"])
    total = 0
    for name, digest in files.items():
        data = (root / name).read_bytes()
        assert len(data) <= 16 * 1024 * 1024
        total += len(data)
        assert hashlib.sha256(data).hexdigest() == digest == card["weights"]["files"][name]["sha256"]
    assert total <= 50_000_000
    assert (root / "MODEL_CARD.md").is_file()


def test_pretrained_mnist_full_loads_int8_by_name():
    """The paper-width posterior: stored int8, loaded by name as a float32 model of width 2,560 whose
    draws at a mid level stay in the pixel range's neighbourhood and depend on the query."""
    from etweedie.training import load_posterior

    model = load_posterior("mnist_full")
    assert isinstance(model, EngressionPosterior) and model.dim == D and model.config["width"] == 2560
    assert all(p.dtype == torch.float32 for p in model.parameters())
    y = torch.rand(2, D, generator=gen(14))
    draws = model.sample(y, eta_at(0.5), 2, generator=gen(15))
    assert draws.shape == (2, 2, D) and bool(torch.isfinite(draws).all())
    assert -1.0 < float(draws.mean()) < 1.5 and not torch.allclose(draws[0], draws[1])


def test_pretrained_safetensors_round_trip(tmp_path):
    """load_weights → save_weights → load_posterior reproduces the shipped model's draws exactly."""
    from etweedie.training import load_weights, save_weights
    from etweedie.training import load_posterior

    state, config = load_weights(PRETRAINED)
    config = {k: v for k, v in config.items() if k != "weights"}
    save_weights(state, tmp_path / "copy", config, max_shard_bytes=1024 * 1024)
    assert len(list((tmp_path / "copy").glob("*.safetensors"))) > 1  # split into shards and joined back
    again, _ = load_weights(tmp_path / "copy")
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    y = torch.rand(2, D, generator=gen(14))
    a = load_posterior(PRETRAINED).sample(y, eta_at(0.3), 2, generator=gen(15))
    b = load_posterior(tmp_path / "copy").sample(y, eta_at(0.3), 2, generator=gen(15))
    assert torch.equal(a, b)


def test_pretrained_denoises_test_images():
    """At the sampler's last level (r = 0.197) the mean of 8 draws is much closer to the clean test
    image than the noisy input is (the input's per-pixel MSE is r² ≈ 0.039)."""
    from etweedie.training import load_posterior

    images = _mnist_or_skip("test")[:64].reshape(64, D).to(torch.float32) / 255.0
    posterior = load_posterior("mnist").float()
    r = 0.197
    eta = eta_at(r)
    y = images + NoiseParams.from_eta(eta).noise(D).sample((64,), generator=gen(16))
    mse_in = (y - images).pow(2).mean()
    mse_out = (posterior.sample(y, eta, 8, generator=gen(17)).mean(-2) - images).pow(2).mean()
    assert mse_in > 0.03
    assert mse_out < 0.5 * mse_in, (float(mse_in), float(mse_out))


def test_full_config_fits_the_sampling_budget():
    """configs/mnist_full.toml builds the paper-width model, and its per-draw cost lets the paper's
    protocol (5 paths × 768 images × 7,300 steps × 256 draws) run in ≤ 10 min at 495 TFLOP/s
    (half an H100's dense bf16 peak)."""
    from etweedie.training import build_posterior, load_config

    cfg = load_config(REPO / "configs" / "mnist_full.toml")
    assert cfg.device == "cuda" and cfg.precision == "bf16" and cfg.model.width == 2560
    model = build_posterior(cfg, D)
    flops = model.forward_flops()
    draws = 5 * 768 * 7300 * 256
    seconds = (draws * flops["per_draw"] + 5 * 768 * 7300 * flops["per_query"]) / 495e12
    assert flops["per_draw"] == 2 * (3 * 16 * 2560 + 2 * 2560 * 2560 + 2560 * 784)
    assert seconds <= 600, seconds


def test_mnist_config_errors_name_the_field():
    from etweedie.training import config_from_dict, config_to_dict, load_config

    values = config_to_dict(load_config(REPO / "configs" / "mnist_cpu.toml"))
    for key, bad, error in (("data_std", 0.0, ValueError), ("data_std", "wide", TypeError),
                            ("learn_data_scale", "yes", TypeError), ("output", "sigmoid", ValueError)):
        broken = {**values, "model": {**values["model"], key: bad}}
        with pytest.raises(error, match=f"model.{key}"):
            config_from_dict(broken)
    with pytest.raises(ValueError, match="pixel_scale"):
        config_from_dict({**values, "model": {**values["model"], "pixel_scale": 1.0}})
