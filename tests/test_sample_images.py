"""The image-scale sampler: chunks and their generators, the draw-memory bound, bf16 autocast,
the static (capturable) update, chain starts from the first level's noise law."""

import math

import pytest
import torch

from etweedie.posteriors import EngressionPosterior
from etweedie.sample import get_path, level_times
from etweedie.sample import (
    chain_chunks,
    chunk_generators,
    chunk_seed,
    initial_states,
    sample_langevin,
)
from etweedie.sample.langevin import _StaticUpdate

DIM = 8
PATH = get_path("mnist_generalized_nondiagonal")


def _model():
    return EngressionPosterior(dim=DIM, width=16, depth=2, eta_low=(1.3, 0.0, -3.7, -0.7, -0.7),
                               eta_high=(2.0, 0.92, 1.8, 0.7, 0.7)).eval()


class _Counting:
    """Wraps a posterior; records the number of chains of every call."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def sample(self, y, eta, n, *, generator):
        self.rows.append(y.shape[0])
        return self.inner.sample(y, eta, n, generator=generator)


KW = dict(steps_per_level=2, first_level_steps=3, n_posterior=4, step_scale=1e-3, disable=True)


def test_chunks_with_their_own_generators_equal_chunks_run_alone():
    times = level_times(3)
    y0 = torch.randn(7, DIM, generator=torch.Generator().manual_seed(0))
    together = sample_langevin(_model(), y0, PATH, times, generator=chunk_generators(5, 3), chunk_chains=3, **KW)
    alone = [sample_langevin(_model(), y0[sl], PATH, times, generator=g, **KW)
             for sl, g in zip(chain_chunks(7, 3), chunk_generators(5, 3))]
    assert torch.equal(together, torch.cat(alone))


def test_max_draw_elements_bounds_every_posterior_call():
    post = _Counting(_model())
    y0 = torch.randn(10, DIM, generator=torch.Generator().manual_seed(1))
    out = sample_langevin(post, y0, PATH, level_times(2), generator=torch.Generator().manual_seed(2),
                          max_draw_elements=4 * 4 * DIM, **KW)
    assert out.shape == (10, DIM) and torch.isfinite(out).all()
    # chunks of 4 + 4 + 2 chains, each through 3 + 2 updates and the final draw
    assert set(post.rows) == {4, 2} and sum(post.rows) == 10 * (3 + 2 + 1)
    with pytest.raises(ValueError, match="lower chunk_chains"):
        sample_langevin(post, y0, PATH, level_times(2), generator=chunk_generators(0, 2), chunk_chains=5,
                        max_draw_elements=4 * 4 * DIM, **KW)
    with pytest.raises(ValueError, match="one torch.Generator per chain chunk"):
        sample_langevin(post, y0, PATH, level_times(2), generator=chunk_generators(0, 3), chunk_chains=5, **KW)


def test_callback_sees_all_chunks():
    seen = []
    y0 = torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))
    sample_langevin(_model(), y0, PATH, level_times(3), generator=torch.Generator().manual_seed(4), chunk_chains=2,
                    callback=seen.append, **KW)
    assert [s["level"] for s in seen] == [0, 1, 2]
    assert all(s["state"].shape == (5, DIM) and s["denoised"].shape == (5, DIM) for s in seen)


def test_bfloat16_forward_stays_close_to_float32_and_returns_float32():
    y0 = torch.randn(6, DIM, generator=torch.Generator().manual_seed(5))
    kw = dict(KW, final_draw=False)
    a = sample_langevin(_model(), y0, PATH, level_times(2), generator=torch.Generator().manual_seed(6), **kw)
    b = sample_langevin(_model(), y0, PATH, level_times(2), generator=torch.Generator().manual_seed(6),
                        precision="bfloat16", **kw)
    assert b.dtype == torch.float32
    # bf16 keeps ~3 significant digits of each draw; the chains move by O(r) per update
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()
    with pytest.raises(ValueError, match="precision must be one of"):
        sample_langevin(_model(), y0, PATH, level_times(2), generator=torch.Generator(), precision="fp8", **kw)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sample_langevin(_model(), y0, PATH, level_times(2), generator=torch.Generator(), capture="cuda_graph", **kw)


def test_bfloat16_mode_hands_bf16_draws_to_the_step_without_a_cast(monkeypatch):
    """precision="bfloat16": the posterior writes its draws in bf16 and langevin_step receives
    exactly those tensors (no float32 copy in between); the chains and the result stay float32."""
    import etweedie.sample.langevin as sampler

    returned, stepped = [], []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def sample(self, y, eta, n, *, generator, dtype=None):
            x = self.inner.sample(y, eta, n, generator=generator, dtype=dtype)
            returned.append((x.dtype, x.data_ptr()))
            return x

    real_step = sampler.langevin_step

    def spy(y, x, *args, **kwargs):
        stepped.append((x.dtype, x.data_ptr()))
        out = real_step(y, x, *args, **kwargs)
        assert y.dtype == out.dtype == torch.float32
        return out

    monkeypatch.setattr(sampler, "langevin_step", spy)
    y0 = torch.randn(6, DIM, generator=torch.Generator().manual_seed(5))
    out = sample_langevin(Recording(_model()), y0, PATH, level_times(2), generator=torch.Generator().manual_seed(6),
                          precision="bfloat16", **KW)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert len(stepped) == 3 + 2 and all(dt == torch.bfloat16 for dt, _ in stepped)
    assert stepped == returned[: len(stepped)]  # the posterior's own bf16 tensors, not copies
    assert returned[-1][0] == torch.float32  # the final draw is asked for in y0's dtype


def test_static_update_on_buffers_equals_the_eager_update():
    """The body a CUDA graph captures, run eagerly on CPU, takes the sampler's eager steps."""
    times = level_times(2)
    y0 = torch.randn(4, DIM, generator=torch.Generator().manual_seed(7))
    eager = sample_langevin(_model(), y0, PATH, times, generator=torch.Generator().manual_seed(8), final_draw=False,
                            steps_per_level=3, n_posterior=4, step_scale=1e-3, disable=True)
    params = PATH(times)
    from etweedie.sample.plan import _level, step_sizes

    alphas = step_sizes(PATH, times, 1e-3)
    g = torch.Generator().manual_seed(8)
    metric0 = _level(params, 0).metric(DIM).to(torch.float32)
    runner = _StaticUpdate(_model(), y0, 4, g, {}, None, metric0.kind, tuple(metric0.param.shape), None)
    for k in range(2):
        level = _level(params, k)
        runner.set_level(level.eta().float(), float(alphas[k]), float(level.beta), float(level.lam),
                         level.metric(DIM).to(torch.float32))
        runner.run(3)
    assert torch.allclose(runner.y, eager, rtol=1e-5, atol=1e-6)


def test_initial_states_follow_the_first_level_noise_law():
    times = level_times(64)
    center = torch.full((784,), 0.13)
    y0 = initial_states(get_path("mnist_generalized_nondiagonal"), times, 512, 784, center=center,
                        generator=torch.Generator().manual_seed(9))
    e = y0 - center
    assert y0.shape == (512, 784) and y0.dtype == torch.float32
    assert e.pow(2).mean().sqrt().item() == pytest.approx(2.63, rel=0.02)
    pairs = e.reshape(512, 392, 2)
    corr = (pairs[..., 0] * pairs[..., 1]).mean() / pairs.pow(2).mean()  # v = 0.6 couples pixel pairs
    assert corr.item() == pytest.approx(0.6, abs=0.03)
    # per chunk generators: chunk c's starts depend only on chunk c's generator
    a = initial_states(get_path("mnist_joint"), times, 5, 784, generator=chunk_generators(1, 3), chunk_chains=2)
    b = initial_states(get_path("mnist_joint"), times, 2, 784, generator=chunk_generators(1, [1]))
    assert torch.equal(a[2:4], b)
    with pytest.raises(ValueError, match="dim must be even"):
        initial_states(get_path("mnist_joint"), times, 2, 783, generator=torch.Generator())


def test_chunk_seed_streams_differ():
    seeds = {chunk_seed(s, c) for s in (2718, 2719) for c in range(4)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert math.isclose(chunk_generators(3, 1)[0].initial_seed(), chunk_seed(3, 0))
