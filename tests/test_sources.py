"""Data-agnostic training: data sources, the prior's σ law and geometry, config errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from etweedie.noise import NoiseParams
from etweedie.data import CallableSource, EightGaussiansSource, MnistSource, TensorSource, as_data_source
from etweedie.training import (
    DataConfig,
    ModelConfig,
    NoisePrior,
    PriorConfig,
    TrainConfig,
    build_data_source,
    config_from_dict,
    held_out_loss,
    load_posterior,
    noise_law,
    noise_metric,
    train,
)

from conftest import gen

SMALL = dict(steps=40, batch_size=64, draws=4, lr=3e-3, lr_min=1e-4, warmup_steps=4, ema_decay=0.0,
             checkpoint_every=20, log_every=10, threads=1,
             model=ModelConfig(width=32, depth=2, noise_dim=4, cond_width=16))


# ---------------------------------------------------------------------------- sources
def test_tensor_source_draws_rows_with_replacement_from_the_generator():
    examples = torch.arange(30.0).reshape(10, 3)
    src = as_data_source(examples)
    assert isinstance(src, TensorSource) and src.dim == 3 and len(src) == 10
    a, b = src.draw(7, gen(1)), src.draw(7, gen(1))
    assert torch.equal(a, b) and a.shape == (7, 3)
    rows = {tuple(r.tolist()) for r in examples}
    assert all(tuple(r.tolist()) in rows for r in a)
    with pytest.raises(ValueError, match=r"examples must have shape \(n, d\)"):
        TensorSource(torch.zeros(5))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        src.draw(2, None)


def test_callable_source_checks_what_it_returns():
    src = as_data_source(lambda b, g: torch.randn(b, 5, generator=g), dim=5)
    assert isinstance(src, CallableSource) and src.draw(4, gen(0)).shape == (4, 5)
    with pytest.raises(ValueError, match="needs its dimension"):
        as_data_source(lambda b, g: torch.randn(b, 5, generator=g))
    bad = as_data_source(lambda b, g: torch.randn(b, 4, generator=g), dim=5)
    with pytest.raises(ValueError, match=r"must return a floating-point \(3, 5\) tensor, got torch.float32 \(3, 4\)"):
        bad.draw(3, gen(0))
    with pytest.raises(TypeError, match="data must be a DataSource"):
        as_data_source("eight_gaussians")


def test_eight_gaussians_source_is_the_ring_sampler():
    src = build_data_source(DataConfig())
    assert isinstance(src, EightGaussiansSource) and src.dim == 2
    assert torch.equal(src.draw(9, gen(3)), src.ring.sample(9, gen(3))[0])


def test_mnist_source_scaling_and_dequantization():
    pixels = torch.tensor([[0, 255, 128, 1]], dtype=torch.uint8).repeat(6, 1)
    plain = MnistSource(pixels, pixel_range=(-1.0, 1.0), dequantize=False)
    x = plain.draw(3, gen(0))
    torch.testing.assert_close(x[0], torch.tensor([-1.0, 1.0, -1 + 2 * 128 / 255, -1 + 2 / 255]), rtol=0, atol=1e-6)
    deq = MnistSource(pixels, pixel_range=(0.0, 1.0), dequantize=True)
    x = deq.draw(500, gen(1))
    p = pixels[0].float()
    assert bool(((x >= p / 256) & (x < (p + 1) / 256)).all())  # q = (p + U)/256, U ∈ [0, 1)
    assert x[:, 0].std() > 0  # fresh noise per draw
    assert torch.equal(deq.draw(4, gen(2)), deq.draw(4, gen(2)))
    with pytest.raises(ValueError, match="pixel_range"):
        MnistSource(pixels, pixel_range=(1.0, 0.0))
    with pytest.raises(TypeError, match="uint8"):
        MnistSource(pixels.float())


# ---------------------------------------------------------------------------- prior and geometry
def test_sigma_law_and_isotropic_geometry():
    n = 20000
    logu = NoisePrior(sigma=(0.1, 10.0)).sample(n, gen(0))
    unif = NoisePrior(sigma=(0.1, 10.0), sigma_law="uniform").sample(n, gen(0))
    assert abs(float(torch.log(logu.sigma).median()) - 0.0) < 0.05  # log-uniform median = geometric mean 1
    assert abs(float(unif.sigma.median()) - 5.05) < 0.15
    # the other fields do not depend on the σ law or the geometry (same uniforms drawn)
    iso = NoisePrior(geometry="isotropic").sample(50, gen(4))
    blk = NoisePrior().sample(50, gen(4))
    assert torch.equal(iso.beta, blk.beta) and torch.equal(iso.sigma, blk.sigma)
    assert bool((iso.u == 0).all() and (iso.v == 0).all()) and bool((blk.v != 0).any())
    with pytest.raises(ValueError, match="sigma_law must be one of"):
        NoisePrior(sigma_law="normal")


@pytest.mark.parametrize("d", [2, 6])
def test_block_geometry_is_noise_params_metric(d):
    params = NoisePrior().sample(5, gen(0))
    m, ref = noise_metric(params, d, "block"), params.metric(d)
    assert m.kind == ref.kind and torch.equal(m.param, ref.param)


def test_isotropic_geometry_in_odd_dimension_has_the_right_rms():
    params = NoiseParams(torch.tensor([1.5, 2.0]), torch.tensor([1.7, 1.0]), torch.tensor([0.8, 0.3]), 0.0, 0.0)
    z = noise_law(params, 3, "isotropic").sample((40000,), generator=gen(0))  # (n, 2, 3)
    rms = z.pow(2).mean(dim=(0, 2)).sqrt()
    torch.testing.assert_close(rms, params.realized_rms(), rtol=0.03, atol=0)
    with pytest.raises(ValueError, match="even data dimension"):
        noise_metric(params, 3, "block")


# ---------------------------------------------------------------------------- configs
@pytest.mark.parametrize("text, error, words", [
    ({"prior": {"sigma": [0.0, 1.0]}}, ValueError, "sigma must be a range"),
    ({"prior": {"sigma": [-1.0, 1.0]}}, ValueError, "sigma must be a range"),
    ({"prior": {"sigma_law": "exp"}}, ValueError, "sigma_law must be one of"),
    ({"prior": {"geometry": "dense"}}, ValueError, "geometry must be one of"),
    ({"data": {"source": "cifar"}}, ValueError, "data.source must be one of"),
    ({"data": {"pixel_range": [1.0, -1.0]}}, ValueError, "data.pixel_range must be"),
    ({"data": {"colour": 1}}, ValueError, r"unknown key\(s\) in \[data\]: colour"),
    ({"precision": "fp8"}, ValueError, "precision must be one of"),
    ({"fused_adam": "yes"}, ValueError, "fused_adam must be"),
    ({"compile": 1}, TypeError, "compile must be true or false"),
    ({"model": {"architecture": "os.system"}}, ValueError, "model.architecture must name a posterior class"),
    ({"model": {"options": {"x": 1}}}, ValueError, "model.options are for other architectures"),
])
def test_bad_configs_raise_named_errors(text, error, words):
    with pytest.raises(error, match=words):
        config_from_dict(text)


def test_block_geometry_refuses_odd_dimension(tmp_path):
    config = TrainConfig(**SMALL)
    with pytest.raises(ValueError, match="even data dimension d, got d = 3"):
        train(config, tmp_path / "odd", data=torch.randn(100, 3), progress=False)
    assert not (tmp_path / "odd" / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------- training on other data
@pytest.mark.parametrize("d, geometry", [(3, "isotropic"), (6, "block")])
def test_training_on_a_tensor_source_of_any_dimension(tmp_path, d, geometry):
    """A correlated Gaussian cloud in d dimensions: the loss falls on held-out draws, the saved
    posterior reloads with the right dimension, and resuming with the same data is bit-identical."""
    g = gen(7)
    mix = torch.randn(d, d, generator=g) / math.sqrt(d)
    examples = torch.randn(2000, d, generator=g) @ mix + 1.0
    config = TrainConfig(**SMALL, prior=PriorConfig(sigma=(0.2, 1.0), geometry=geometry))
    from etweedie.training import build_posterior

    before = held_out_loss(build_posterior(config, d).eval(), config, data=examples, n_examples=1024, draws=8)
    full = train(config, tmp_path / "full", data=examples, progress=False)
    post = load_posterior(full["posterior"])
    assert post.dim == d
    after = held_out_loss(post, config, data=examples, n_examples=1024, draws=8)
    assert after < 0.9 * before, (before, after)
    train(config, tmp_path / "cut", data=examples, progress=False, stop_after=27)
    resumed = train(config, tmp_path / "cut", data=examples, progress=False)
    assert resumed["resumed_from"] == 20
    a, b = post.state_dict(), load_posterior(resumed["posterior"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_callable_source_trains(tmp_path):
    draw = lambda b, g: torch.randn(b, 4, generator=g, device=g.device) * 0.5 + 2.0  # noqa: E731
    config = dataclasses.replace(TrainConfig(**SMALL), steps=5, checkpoint_every=5, log_every=5)
    summary = train(config, tmp_path / "c", data=draw, data_dim=4, progress=False)
    assert summary["step"] == 5 and math.isfinite(summary["final_loss"]) and load_posterior(tmp_path / "c").dim == 4


def _mnist_available() -> bool:
    try:
        from etweedie.data import find_mnist_files

        find_mnist_files("train", None)
        find_mnist_files("test", None)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _mnist_available(), reason="the MNIST files are not present (data/mnist or the reader's default folders)")
def test_mnist_config_source_trains_and_lowers_the_held_out_score(tmp_path):
    """``[data] source = "mnist"``: 784-dimensional pixels in [−1, 1], the block geometry on pixel
    pairs; 30 steps of a small model lower the held-out (test split) energy score."""
    config = TrainConfig(**dict(SMALL, steps=30, batch_size=32, draws=2, checkpoint_every=30, lr=2e-3),
                         prior=PriorConfig(sigma=(0.1, 2.0)), data=DataConfig(source="mnist"))
    held = build_data_source(config.data, held_out=True)
    assert held.dim == 784 and len(held) == 10000
    x = held.draw(64, gen(0))
    assert float(x.min()) >= -1 and float(x.max()) <= 1 and float((x > 0).float().mean()) > 0.05
    from etweedie.training import build_posterior

    before = held_out_loss(build_posterior(config, 784).eval(), config, data=held, n_examples=256, draws=4)
    summary = train(config, tmp_path / "mnist", progress=False)
    after = held_out_loss(load_posterior(summary["posterior"]), config, data=held, n_examples=256, draws=4)
    assert after < 0.97 * before, (before, after)


@pytest.mark.parametrize("kwargs, words", [
    (dict(images=torch.zeros(0, 28, 28, dtype=torch.uint8)), "at least one image"),
    (dict(pixel_range=(0, 1, 2)), "pixel_range must be two numbers"),
    (dict(pixel_range=(0.0, float("inf"))), "pixel_range must be (low, high), finite"),
])
def test_mnist_source_refuses_what_it_cannot_scale(kwargs, words):
    args = {"images": torch.zeros(2, 784, dtype=torch.uint8), **kwargs}
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        MnistSource(**args)


def test_derive_seed_accepts_any_nonnegative_int_seed():
    from etweedie.utils import derive_seed, substream

    assert derive_seed(2**64) == derive_seed(2**64 % 2**63) and substream(2**64).initial_seed() == 0


def test_atomic_write_uses_a_temporary_name_of_its_own(tmp_path):
    """A file the user keeps as <name>.tmp survives (it was overwritten, then deleted), and nothing
    is left beside the written file."""
    from etweedie.utils import atomic_write

    (tmp_path / "a.txt.tmp").write_text("mine")
    atomic_write(tmp_path / "a.txt", "new")
    assert (tmp_path / "a.txt").read_text() == "new" and (tmp_path / "a.txt.tmp").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "a.txt.tmp"]


def test_train_names_data_dim_for_a_callable_without_one(tmp_path):
    from etweedie.training import load_config, train

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "eight_gaussians_tiny.toml")
    with pytest.raises(ValueError, match="pass data_dim="):
        train(config, tmp_path / "r", data=lambda b, g: torch.zeros(b, 2), progress=False)


def test_tensor_source_refuses_non_finite_examples():
    """A NaN in the data is named when the source is built, not as a NaN loss steps later."""
    data = torch.randn(100, 2, generator=gen(1))
    data[3, 0] = float("nan")
    data[7, 1] = float("inf")
    with pytest.raises(ValueError, match="2 of 100 rows \\(the first: row 3\\)"):
        TensorSource(data)


def test_source_arguments_that_were_ignored_or_crashed_are_named():
    # a dim that disagrees with the examples was silently ignored
    with pytest.raises(ValueError, match="dim=4 disagrees with the data's dimension d = 2"):
        as_data_source(torch.randn(6, 2), 4)
    assert as_data_source(torch.randn(6, 2), 2).dim == 2
    # a source's dim that is not an int failed later with "not all arguments converted during string formatting"
    odd = EightGaussiansSource()
    odd.dim = "2"
    with pytest.raises(TypeError, match="dim must be an int >= 1, got str"):
        as_data_source(odd)
    with pytest.raises(ValueError, match="meta device"):  # was torch's "Tensor.item() cannot be called on meta tensors"
        TensorSource(torch.empty(4, 2, device="meta"))
    with pytest.raises(TypeError, match="ring must be an etweedie.data.EightGaussians"):
        EightGaussiansSource("ring")
