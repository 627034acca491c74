"""Tests for etweedie.posteriors.engression.EngressionPosterior: shapes, broadcasting, bad input, one batched
forward, reproducibility from the generator, differentiability, rebuild from config."""

from __future__ import annotations

import pytest
import torch

from etweedie.posteriors import ETA_DIM, EngressionPosterior, default_eta_bounds
from etweedie.noise import NoiseParams

from conftest import gen

ETA = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6).eta()


def small(**kw) -> EngressionPosterior:
    args = dict(width=16, depth=3, noise_dim=3, cond_width=8)
    args.update(kw)
    return EngressionPosterior(2, **args)


@pytest.mark.parametrize("conditioning", ["film", "concat"])
@pytest.mark.parametrize("output", ["scaled_residual", "residual", "direct"])
def test_shapes_every_variant(conditioning, output):
    model = small(conditioning=conditioning, output=output)
    out = model.sample(torch.randn(4, 2), ETA, 7, generator=gen(0))
    assert out.shape == (4, 7, 2)
    assert torch.isfinite(out).all()
    # the n draws of one query differ: ε enters every layer
    assert out[:, 1:].sub(out[:, :1]).abs().amax() > 0


@pytest.mark.parametrize("output", ["scaled_residual", "residual", "direct", "preconditioned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sample_writes_16_bit_draws(output, dtype):
    """sample(dtype=bf16/fp16): the same draws, rounded once to 16 bits by the output layer's
    last operation (the form the score ops read without a cast pass)."""
    model = small(output=output).eval()
    y = torch.randn(5, 2, generator=gen(1))
    with torch.no_grad():
        full = model.sample(y, ETA, 6, generator=gen(2))
        low = model.sample(y, ETA, 6, generator=gen(2), dtype=dtype)
    assert low.dtype == dtype and low.shape == full.shape
    info = torch.finfo(dtype)
    # one rounding of (up to float32 rounding) the same value
    assert ((low.float() - full).abs() <= info.eps * full.abs() + 1e-6).all()
    with pytest.raises(TypeError, match="dtype must be None or a floating-point dtype"):
        model.sample(y, ETA, 2, generator=gen(3), dtype=torch.int32)


@pytest.mark.parametrize(
    "y_shape, eta_shape, batch",
    [
        ((4, 2), (5,), (4,)),
        ((4, 2), (4, 5), (4,)),
        ((3, 1, 2), (4, 5), (3, 4)),
        ((2,), (5,), ()),
        ((2,), (6, 5), (6,)),
        ((0, 2), (5,), (0,)),
    ],
)
def test_broadcasting(y_shape, eta_shape, batch):
    model = small()
    y = torch.randn(y_shape, generator=gen(1))
    eta = ETA.expand(*eta_shape[:-1], ETA_DIM)
    out = model.sample(y, eta, 5, generator=gen(2))
    assert out.shape == (*batch, 5, 2)


def test_broadcast_eta_equals_expanded_eta():
    """A shared η vector gives exactly the draws of the same η repeated per query."""
    model = small()
    y = torch.randn(6, 2, generator=gen(3))
    shared = model.sample(y, ETA, 4, generator=gen(4))
    per_row = model.sample(y, ETA.expand(6, ETA_DIM).clone(), 4, generator=gen(4))
    assert torch.equal(shared, per_row)


def test_one_batched_forward():
    """All queries × draws go through the network once: each layer runs exactly one time (CPU
    no-grad calls above 2·CPU_INFERENCE_ROWS rows run in blocks: see the next test)."""
    model = small()
    calls = {"out": 0, "input": 0}
    model.out.register_forward_hook(lambda *a: calls.__setitem__("out", calls["out"] + 1))
    model.input_y.register_forward_hook(lambda *a: calls.__setitem__("input", calls["input"] + 1))
    out = model.sample(torch.randn(5, 3, 2), ETA, 11, generator=gen(5))
    assert out.shape == (5, 3, 11, 2)
    assert calls == {"out": 1, "input": 1}


def test_cpu_inference_blocks_match_one_block(monkeypatch):
    """No-grad CPU calls run in row blocks (cache-sized); the draws equal the one-block call's,
    the generator advances the same, broadcast η included, and autograd calls stay one block."""
    model = small()
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    y = torch.randn(37, 2, generator=gen(seed))
    eta = torch.stack([ETA] * 37) + 0.01 * torch.randn(37, ETA_DIM, generator=gen(seed + 1))
    monkeypatch.setattr(EngressionPosterior, "CPU_INFERENCE_ROWS", 40)  # 10 queries × 4 draws per block
    calls = {"out": 0}
    model.out.register_forward_hook(lambda *a: calls.__setitem__("out", calls["out"] + 1))
    for e in (eta, ETA):
        g1, g2 = gen(seed + 2), gen(seed + 2)
        calls["out"] = 0
        with torch.no_grad():
            blocked = model.sample(y, e, 4, generator=g1)
        assert calls["out"] == 4  # ceil(37 / 10) blocks
        monkeypatch.setattr(EngressionPosterior, "CPU_INFERENCE_ROWS", None)
        with torch.no_grad():
            whole = model.sample(y, e, 4, generator=g2)
        monkeypatch.setattr(EngressionPosterior, "CPU_INFERENCE_ROWS", 40)
        torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
        assert torch.equal(g1.get_state(), g2.get_state())
    calls["out"] = 0
    model.sample(y, ETA, 4, generator=gen(seed)).sum().backward()
    assert calls["out"] == 1


def test_reproducible_from_generator():
    model = small()
    y = torch.randn(8, 2, generator=gen(6))
    a = model.sample(y, ETA, 16, generator=gen(7))
    b = model.sample(y, ETA, 16, generator=gen(7))
    c = model.sample(y, ETA, 16, generator=gen(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # the global RNG plays no part
    torch.manual_seed(0)
    d = model.sample(y, ETA, 16, generator=gen(7))
    torch.manual_seed(1)
    e = model.sample(y, ETA, 16, generator=gen(7))
    assert torch.equal(d, e) and torch.equal(a, d)


def test_init_from_seed_only():
    """Construction draws no global random numbers: same init_seed, same weights, any global state."""
    torch.manual_seed(0)
    a = small(init_seed=3)
    torch.manual_seed(99)
    b = small(init_seed=3)
    c = small(init_seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].dim() == 2)


def test_differentiable_in_params_y_eta():
    model = small()
    y = torch.randn(4, 2, generator=gen(9), requires_grad=True)
    eta = ETA.clone().requires_grad_(True)
    model.sample(y, eta, 3, generator=gen(10)).pow(2).sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all() and y.grad.abs().sum() > 0
    assert eta.grad is not None and eta.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())


def test_scaled_residual_output_is_y_plus_rms_times_network():
    """output='scaled_residual': x = y + r(η)·net, r = σ λ^{−1/β}; doubling y's offset moves x equally."""
    model = small(output="scaled_residual")
    params = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6)
    assert torch.allclose(model.realized_rms(params.eta()), params.realized_rms())
    direct = small(output="direct")
    direct.load_state_dict(model.state_dict())
    y = torch.randn(5, 2, generator=gen(11))
    x = model.sample(y, params.eta(), 4, generator=gen(12))
    net = direct.sample(y, params.eta(), 4, generator=gen(12))
    assert torch.allclose(x, y[:, None, :] + params.realized_rms() * net, atol=1e-6)


def test_config_rebuilds_model():
    model = small(conditioning="concat", output="residual", init_seed=5)
    clone = EngressionPosterior(**model.config)
    clone.load_state_dict(model.state_dict())
    y = torch.randn(3, 2, generator=gen(13))
    assert torch.equal(model.sample(y, ETA, 6, generator=gen(14)), clone.sample(y, ETA, 6, generator=gen(14)))
    assert model.dim == 2 and model.config["dim"] == 2


def test_float64_queries_return_float64():
    model = small()
    out = model.sample(torch.randn(3, 2, dtype=torch.float64), ETA.double(), 2, generator=gen(15))
    assert out.dtype == torch.float64


def test_eta_normalization_maps_box_to_unit_cube():
    low, high = default_eta_bounds()
    model = small()
    corners = model.normalize_eta(torch.tensor([low, high]))
    assert torch.allclose(corners, torch.tensor([[-1.0] * 5, [1.0] * 5]), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(y=torch.randn(4, 3)), ValueError, "y must have shape (..., 2)"),
        (dict(y=torch.zeros(4, 2, dtype=torch.int64)), TypeError, "y must be a floating-point"),
        (dict(eta=torch.zeros(4)), ValueError, "eta must have shape (..., 5)"),
        (dict(eta=torch.zeros(3, 5)), ValueError, "must broadcast"),
        (dict(eta=torch.tensor([0.0, 0.5, -0.5, 0.0, 0.0])), ValueError, "eta must be finite with β"),
        (dict(eta=torch.tensor([1.4, float("nan"), -0.5, 0.0, 0.0])), ValueError, "eta must be finite"),
        (dict(n=0), ValueError, "n must be >= 1"),
        (dict(n=2.0), TypeError, "n must be an int"),
        (dict(generator=None), TypeError, "generator must be a torch.Generator"),
    ],
)
def test_bad_input(kwargs, exc, words):
    model = small()
    args = dict(y=torch.zeros(4, 2), eta=ETA, n=3, generator=gen(0))
    args.update(kwargs)
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        model.sample(args["y"], args["eta"], args["n"], generator=args["generator"])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(width=0), "width must be >= 1"),
        (dict(depth=0), "depth must be >= 1"),
        (dict(conditioning="attention"), "conditioning must be one of"),
        (dict(output="mean"), "output must be one of"),
        (dict(eta_low=[0.0] * 5, eta_high=[0.0] * 5), "eta_low must be < eta_high"),
        (dict(eta_low=[0.0] * 4, eta_high=[1.0] * 4), "5 entries"),
    ],
)
def test_bad_constructor_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        small(**kwargs)


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_antithetic_noise_comes_in_mirrored_pairs(n, seed):
    """Draws 2k and 2k+1 are h_k and −h_k (every even prefix paired; an odd n ends unpaired), the
    fresh normals come from the generator alone, and the marginal law is still N(0, I)."""
    model = small()
    noise = model.draw_noise(5, n, gen(seed), antithetic=True)
    assert noise.shape == (5, n, model.depth * model.noise_dim)
    assert torch.equal(noise[:, 1::2], -noise[:, 0 : 2 * (n // 2) : 2])
    assert torch.equal(noise, model.draw_noise(5, n, gen(seed), antithetic=True))
    # the unpaired halves are standard normals: ⌈n/2⌉ fresh draws per row, nothing else
    half = torch.randn(5, (n + 1) // 2, model.depth * model.noise_dim, generator=gen(seed))
    torch.testing.assert_close(noise[:, 0::2], half, rtol=0, atol=0)
    big = model.draw_noise(4000, 2, gen(seed + 1), antithetic=True)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.var()) - 1.0) < 0.03
    with pytest.raises(TypeError, match="antithetic"):
        model.draw_noise(5, n, gen(seed), antithetic=1)


def test_antithetic_sample_is_the_model_of_mirrored_noise(monkeypatch, seed):
    """sample(antithetic=True) runs g on draw_noise(antithetic=True), blocked or not, via forward too."""
    model = small()
    y = torch.randn(23, 2, generator=gen(seed))
    noise = model.draw_noise(23, 6, gen(seed + 1), antithetic=True)
    with torch.no_grad():
        expected = model.generate(y, ETA.expand(23, ETA_DIM), noise)
        monkeypatch.setattr(EngressionPosterior, "CPU_INFERENCE_ROWS", 12)  # blocks of 2 queries
        blocked = model.sample(y, ETA, 6, generator=gen(seed + 1), antithetic=True)
        monkeypatch.setattr(EngressionPosterior, "CPU_INFERENCE_ROWS", None)
        whole = model(y, ETA, 6, generator=gen(seed + 1), antithetic=True)
    torch.testing.assert_close(blocked, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="antithetic"):
        model.sample(y, ETA, 6, generator=gen(seed), antithetic="yes")


def test_antithetic_draw_means_have_smaller_variance(seed):
    """The mean of N draws is unbiased either way; mirrored pairs cancel g's odd part in ε, so
    across generators its variance is well below the independent draws' (same N).  A fixed
    architecture seed (its ratio is 0.33–0.37 over fresh inputs; other inits go 0.10–0.58)."""
    model = small(init_seed=0)
    y = torch.randn(64, 2, generator=gen(seed))
    eta = NoiseParams(1.6, 1.5, 0.3, 0.1, -0.2).eta()
    reps = 60
    with torch.no_grad():
        iid = torch.stack([model.sample(y, eta, 16, generator=gen(seed + 1 + r)).mean(-2) for r in range(reps)])
        anti = torch.stack([model.sample(y, eta, 16, generator=gen(seed + 1 + r), antithetic=True).mean(-2)
                            for r in range(reps)])
        truth = model.sample(y, eta, 20000, generator=gen(seed + 999)).mean(-2)
    var_iid, var_anti = iid.var(0).mean(), anti.var(0).mean()
    assert var_anti < 0.5 * var_iid, (float(var_anti), float(var_iid))
    # unbiased: the antithetic mean over reps sits within a few standard errors of the long-run mean
    se = (var_anti / reps + iid.var(0).mean() * 16 / 20000).sqrt()
    assert float((anti.mean(0) - truth).abs().mean()) < 1.5 * float(se)  # E|z| ≈ 0.8 when unbiased


# ---------------------------------------------------------------------------- noise-law latent
def _noise_law_params(seed):
    g = gen(seed)
    u = torch.rand(7, generator=g)
    return NoiseParams(1.2 + 0.8 * u, 1.0 + 1.5 * torch.rand(7, generator=g), 0.1 + 0.6 * torch.rand(7, generator=g),
                       0.4 * torch.rand(7, generator=g) - 0.2, 0.4 * torch.rand(7, generator=g) - 0.2)


@pytest.mark.parametrize("antithetic", [False, True])
def test_noise_law_latent_is_the_standardized_noise_draw(seed, antithetic):
    """latent='noise_law': after the depth·noise_dim normals come d columns ẑ = e/r(η), e drawn
    from each row's noise law with the same generator, after the normals (mirrored when antithetic)."""
    model = small(latent="noise_law")
    params = _noise_law_params(seed)
    eta = params.eta()
    n = 5
    noise = model.draw_noise(7, n, gen(seed + 1), antithetic=antithetic, eta=eta)
    assert noise.shape == (7, n, model.latent_width) and model.latent_width == model.depth * model.noise_dim + 2
    fresh = (n + 1) // 2 if antithetic else n
    g = gen(seed + 1)
    normals = torch.randn(7, fresh, model.depth * model.noise_dim, generator=g)
    e = params.noise(2).sample((fresh,), generator=g).transpose(0, 1)
    expected = torch.cat([normals, e / params.realized_rms()[:, None, None]], dim=-1)
    if antithetic:
        expected = torch.stack([expected, -expected], dim=2).reshape(7, 2 * fresh, -1)[:, :n]
    torch.testing.assert_close(noise, expected.float(), rtol=1e-5, atol=1e-6)
    # unit RMS per coordinate, whatever (β, λ, σ, u, v)
    many = model.draw_noise(7, 6000, gen(seed + 2), eta=eta)[..., -2:]
    rms = many.pow(2).mean(dim=(1, 2)).sqrt()
    assert torch.allclose(rms, torch.ones(7), atol=0.05), rms


def test_noise_law_latent_gate_gives_noise_shaped_draws(seed):
    """With the network's output and gate's MLP zeroed but its bias at −1, x = y − r(η)·ẑ = y − e: draws
    carry the noise law exactly (its heavier-than-Gaussian tails included), for every output kind."""
    params = NoiseParams(1.3, 1.8, 0.25, 0.25, 0.35)
    y = torch.randn(3, 2, generator=gen(seed))
    for output in ("scaled_residual", "residual", "direct"):
        model = small(latent="noise_law", output=output)
        with torch.no_grad():
            model.out.weight.zero_(), model.out.bias.zero_()
            model.latent_gate[-1].weight.zero_(), model.latent_gate[-1].bias.fill_(-1.0)
            x = model.sample(y, params.eta(), 4, generator=gen(seed + 1))
            noise = model.draw_noise(3, 4, gen(seed + 1), eta=params.eta().expand(3, 5))
        e = noise[..., -2:] * params.realized_rms()
        base = torch.zeros_like(y) if output == "direct" else y
        torch.testing.assert_close(x, base[:, None] - e, rtol=1e-5, atol=1e-6)


def test_noise_law_latent_model_trains_and_rebuilds(seed):
    """Differentiable in the parameters, y and η; the config rebuilds it; sample = generate(draw_noise)."""
    model = small(latent="noise_law", init_seed=3)
    y = torch.randn(4, 2, generator=gen(seed), requires_grad=True)
    eta = ETA.clone().requires_grad_(True)
    x = model.sample(y, eta, 3, generator=gen(seed + 1))
    x.pow(2).sum().backward()
    assert y.grad is not None and eta.grad is not None
    assert all(p.grad is not None for p in model.parameters())
    clone = EngressionPosterior(**model.config)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        a = model.sample(y, ETA, 6, generator=gen(seed + 2))
        b = clone.generate(y, ETA.expand(4, ETA_DIM), clone.draw_noise(4, 6, gen(seed + 2), eta=ETA.expand(4, ETA_DIM)))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert model.config["latent"] == "noise_law" and "latent='noise_law'" in repr(model)


def test_noise_law_latent_bad_input():
    with pytest.raises(ValueError, match="latent must be one of"):
        small(latent="student")
    with pytest.raises(ValueError, match="even dim"):
        EngressionPosterior(3, width=8, depth=1, latent="noise_law")
    model = small(latent="noise_law")
    with pytest.raises(ValueError, match=r"eta must be a \(4, 5\) tensor"):
        model.draw_noise(4, 2, gen(0))
    with pytest.raises(ValueError, match=r"eta must be a \(4, 5\) tensor"):
        model.draw_noise(4, 2, gen(0), eta=ETA)


def test_gaussian_latent_unchanged_by_the_option(seed):
    """A model built before the option (config without 'latent') rebuilds as latent='gaussian' with the
    same parameters, and its draws ignore eta in draw_noise."""
    model = small(init_seed=2)
    config = dict(model.config)
    del config["latent"]
    old = EngressionPosterior(**config)
    assert old.latent == "gaussian" and set(old.state_dict()) == set(model.state_dict())
    for k, v in old.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert torch.equal(model.draw_noise(3, 4, gen(seed)), model.draw_noise(3, 4, gen(seed), eta=ETA.expand(3, 5)))


def test_draw_noise_takes_an_explicit_generator_only():
    model = EngressionPosterior(dim=2, width=8, depth=1)
    before = torch.get_rng_state()
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        model.draw_noise(4, 3, None)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        model.draw_noise(-1, 3, torch.Generator().manual_seed(0))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(init_seed=2**64), ValueError, "init_seed must be <="),  # was "Overflow when unpacking long long"
        (dict(eta_low="abcde", eta_high=[1.0] * 5), TypeError, "eta_low and eta_high must be sequences"),
    ],
)
def test_constructor_arguments_are_named(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        small(**kwargs)


def test_generate_checks_its_shapes():
    """generate (public, for custom noise) named nothing: torch's 'mat1 and mat2 shapes cannot be multiplied'."""
    model = small()
    y, eta = torch.zeros(3, 2), ETA.expand(3, ETA_DIM)
    noise = model.draw_noise(3, 4, gen(0))
    assert model.generate(y, eta, noise).shape == (3, 4, 2)
    with pytest.raises(ValueError, match=r"noise must have shape \(B, n, latent_width=9\)"):
        model.generate(y, eta, noise[..., :5])
    with pytest.raises(ValueError, match=r"y must have shape \(B, d=2\), got \(3, 3\)"):
        model.generate(torch.zeros(3, 3), eta, noise)
    with pytest.raises(ValueError, match=r"eta must have shape \(B, 5\)"):
        model.generate(y, eta[:, :4], noise)
    with pytest.raises(TypeError, match="noise must be a floating-point tensor"):
        model.generate(y, eta, noise.long())
