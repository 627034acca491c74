"""Tests of etweedie.training.scorematching: exact Hyvärinen SM, SSM-VR, conditional score network, trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from etweedie.training.scorematching import (
    ConditionalScoreNet,
    LearnedScore,
    ScoreNet,
    fit_score,
    hyvarinen_loss,
    jacobian_trace,
    sliced_score_matching_vr_loss,
    train_score_net,
)



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread for this module (restored after): these small problems are
    overhead-bound, and on a shared 2-core machine a second OpenMP thread that gets descheduled
    makes every parallel region wait for it (100× slower steps were measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

class AffineScore(nn.Module):
    """s(y) = A y + b: the score family of Gaussians (exact minimizer −Σ⁻¹(y − μ))."""

    def __init__(self, d: int):
        super().__init__()
        self.A = nn.Parameter(torch.zeros(d, d, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, y, cond=None):
        return y @ self.A.T + self.b


def _gaussian(d, n, g):
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    Sigma = A @ A.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    mu = torch.randn(d, generator=g, dtype=torch.float64)
    y = mu + torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(Sigma).T
    return y, mu, Sigma


def test_jacobian_trace_matches_autograd():
    g = torch.Generator().manual_seed(0)
    net = ScoreNet(3, hidden=16, depth=2, n_cond=1).double()
    y = torch.randn(7, 3, generator=g, dtype=torch.float64)
    c = torch.randn(7, 1, generator=g, dtype=torch.float64)
    s, tr = jacobian_trace(net, y, c)
    jac = torch.stack([torch.autograd.functional.jacobian(lambda q: net(q[None], c[i : i + 1])[0], y[i]) for i in range(7)])
    torch.testing.assert_close(s, net(y, c))
    torch.testing.assert_close(tr, jac.diagonal(dim1=-2, dim2=-1).sum(-1))


def test_hyvarinen_recovers_gaussian_score():
    """Exact SM with an affine model: the empirical minimizer is −Σ̂⁻¹(y − μ̂) (closed form)."""
    g = torch.Generator().manual_seed(1)
    y, mu, Sigma = _gaussian(3, 20_000, g)
    model = AffineScore(3)
    train_score_net(model, y, method="exact", steps=700, batch_size=1024, lr=0.05, generator=g, progress=False)
    P = torch.linalg.inv(Sigma)
    torch.testing.assert_close(model.A.detach(), -P, atol=0.08, rtol=0.0)
    torch.testing.assert_close(model.b.detach(), P @ mu, atol=0.08, rtol=0.0)


def test_hyvarinen_mlp_recovers_gaussian_score():
    g = torch.Generator().manual_seed(2)
    y, mu, Sigma = _gaussian(2, 8192, g)
    learned = fit_score(y.float(), steps=500, hidden=64, depth=2, lr=3e-3, generator=g, progress=False)
    q = mu + torch.randn(500, 2, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(Sigma).T
    true = -(q - mu) @ torch.linalg.inv(Sigma).T
    nmse = float(((learned(q) - true) ** 2).sum() / (true**2).sum())
    assert nmse < 0.02, nmse
    assert learned.train_result.method == "exact" and learned(q).dtype == torch.float64


def test_ssm_vr_agrees_with_exact_on_small_d():
    """E_v[SSM-VR] = exact Hyvärinen loss (E[vᵀJv] = tr J), for a fixed network, both v laws."""
    g = torch.Generator().manual_seed(3)
    net = ScoreNet(4, hidden=32, depth=2).double()
    y = torch.randn(256, 4, generator=g, dtype=torch.float64)
    exact = hyvarinen_loss(net, y).item()
    for dist in ("gaussian", "rademacher"):
        sliced = sliced_score_matching_vr_loss(net, y, n_projections=400, generator=g, distribution=dist).item()
        assert sliced == pytest.approx(exact, abs=0.02 * (1 + abs(exact))), (dist, sliced, exact)
    # ... and gradients agree in expectation
    net.zero_grad()
    hyvarinen_loss(net, y).backward()
    g_exact = torch.cat([p.grad.flatten() for p in net.parameters()])
    net.zero_grad()
    sliced_score_matching_vr_loss(net, y, n_projections=400, generator=g).backward()
    g_sliced = torch.cat([p.grad.flatten() for p in net.parameters()])
    cos = torch.nn.functional.cosine_similarity(g_exact, g_sliced, dim=0)
    assert float(cos) > 0.98


def test_ssm_vr_training_matches_exact_training():
    """Affine model: SSM-VR training lands on the same Gaussian score as exact SM."""
    g = torch.Generator().manual_seed(4)
    y, mu, Sigma = _gaussian(2, 20_000, g)
    fits = {}
    for method in ("exact", "ssm_vr"):
        model = AffineScore(2)
        train_score_net(model, y, method=method, steps=700, batch_size=1024, lr=0.05, n_projections=4,
                        generator=torch.Generator().manual_seed(5), progress=False)
        fits[method] = model.A.detach()
    torch.testing.assert_close(fits["ssm_vr"], fits["exact"], atol=0.08, rtol=0.0)


def test_conditional_net_serves_several_levels():
    """One ConditionalScoreNet learns N(0, (τ²+σ²)I) scores at three known levels σ."""
    g = torch.Generator().manual_seed(6)
    sigmas = [0.2, 0.4, 0.8]
    groups = [torch.randn(4096, 2, generator=g) * (0.3**2 + s**2) ** 0.5 for s in sigmas]
    learned = fit_score(groups, sigmas, steps=400, hidden=64, depth=2, lr=3e-3, generator=g, progress=False)
    assert learned.conditional
    for s in sigmas:
        q = torch.randn(500, 2, generator=g) * (0.3**2 + s**2) ** 0.5
        true = -q / (0.3**2 + s**2)
        nmse = float(((learned(q, s) - true) ** 2).sum() / (true**2).sum())
        assert nmse < 0.05, (s, nmse)
    with pytest.raises(ValueError, match="sigma"):
        learned(torch.zeros(2, 2))


def test_trainer_is_seeded():
    y = torch.randn(512, 2, generator=torch.Generator().manual_seed(7))
    a = fit_score(y, steps=15, hidden=8, depth=1, generator=torch.Generator().manual_seed(8), progress=False)
    b = fit_score(y, steps=15, hidden=8, depth=1, generator=torch.Generator().manual_seed(8), progress=False)
    assert a.train_result.losses == b.train_result.losses
    torch.testing.assert_close(a(y[:5]), b(y[:5]), rtol=0, atol=0)


def test_bad_inputs_raise_named_errors():
    net = ScoreNet(2, hidden=8, depth=1)
    y = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="generator"):
        train_score_net(net, y, generator=0)
    with pytest.raises(ValueError, match="method"):
        train_score_net(net, y, method="denoising", generator=torch.Generator())
    with pytest.raises(ValueError, match="steps"):
        train_score_net(net, y, steps=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="y"):
        hyvarinen_loss(net, torch.zeros(4))
    with pytest.raises(ValueError, match="sigmas"):
        fit_score([y, y], [0.1], generator=torch.Generator())
    with pytest.raises(ValueError, match="empty"):
        fit_score([y, y[:0]], [0.1, 0.2], generator=torch.Generator())
    with pytest.raises(ValueError, match="conditional"):
        ScoreNet(2, n_cond=1)(y)
    with pytest.raises(ValueError, match="sigma"):
        ConditionalScoreNet(2, hidden=4, depth=1)(y, -1.0)
    with pytest.raises(ValueError, match="distribution"):
        sliced_score_matching_vr_loss(net, y, generator=torch.Generator(), distribution="uniform")


def test_networks_check_y_and_cond_shapes():
    """A wrong data width or conditioning shape names the network and the shape it wants, instead
    of a matmul or cat error from inside the MLP (also through LearnedScore and the trainer)."""
    y = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., 2\) for this ScoreNet"):
        ScoreNet(2, hidden=8, depth=1)(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., 2\) for this ConditionalScoreNet"):
        LearnedScore(ConditionalScoreNet(2, hidden=4, depth=1))(torch.zeros(4, 5), 0.5)
    with pytest.raises(TypeError, match="floating-point"):
        ScoreNet(2, hidden=8, depth=1)(torch.zeros(4, 2, dtype=torch.int64))
    conditional = ScoreNet(2, hidden=8, depth=1, n_cond=2)
    with pytest.raises(ValueError, match=r"cond must have shape \(4, 2\)"):
        conditional(y, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"cond must have shape \(4, 2\)"):
        conditional(y, torch.zeros(2))
    with pytest.raises(TypeError, match="cond must be a tensor"):
        conditional(y, [[0.0, 0.0]] * 4)
    with pytest.raises(ValueError, match=r"cond must have shape \(\d+, 2\)"):
        train_score_net(conditional, y, torch.zeros(4, 1), steps=1, generator=torch.Generator(), progress=False)
    assert conditional(y, torch.zeros(4, 2, dtype=torch.float64)).shape == (4, 2)
    assert ScoreNet(2, hidden=8, depth=1)(torch.zeros(0, 2)).shape == (0, 2)


# ---------------------------------------------------------------------------- options (second session)
def test_default_options_reproduce_plain_trainer():
    """New options at their defaults change nothing: same losses as an explicit default call."""
    y = torch.randn(512, 2, generator=torch.Generator().manual_seed(9))
    a = fit_score(y, steps=12, hidden=8, depth=1, generator=torch.Generator().manual_seed(3), progress=False)
    b = fit_score(y, steps=12, hidden=8, depth=1, generator=torch.Generator().manual_seed(3), progress=False,
                  arch="mlp", ema=0.0, lr_final_fraction=0.05, warmup=0, val_fraction=0.0)
    assert a.train_result.losses == b.train_result.losses
    assert a.train_result.best_step == 12 and a.train_result.val_losses == []


def test_ema_weights_are_the_ones_evaluated():
    """After one step with ema = α the model holds α₁θ₀ + (1 − α₁)θ₁, α₁ = min(α, 1/10)."""
    y = torch.randn(256, 2, generator=torch.Generator().manual_seed(10))

    def make():
        torch.manual_seed(0)
        return ScoreNet(2, hidden=8, depth=1)

    init = [p.detach().clone() for p in make().parameters()]
    raw, avg = make(), make()
    train_score_net(raw, y, steps=1, batch_size=64, lr=0.1, generator=torch.Generator().manual_seed(1), progress=False)
    res = train_score_net(avg, y, steps=1, batch_size=64, lr=0.1, ema=0.99, generator=torch.Generator().manual_seed(1), progress=False)
    assert res.ema == 0.99
    for p0, p1, pa in zip(init, raw.parameters(), avg.parameters()):
        torch.testing.assert_close(pa.detach(), 0.1 * p0 + 0.9 * p1.detach())
    # ... and the scores a LearnedScore returns come from those averaged weights
    learned = fit_score(y, steps=30, hidden=8, depth=1, ema=0.9, generator=torch.Generator().manual_seed(2), progress=False)
    plain = fit_score(y, steps=30, hidden=8, depth=1, generator=torch.Generator().manual_seed(2), progress=False)
    assert learned.train_result.losses == plain.train_result.losses  # averaging never feeds back into training
    assert not torch.allclose(learned(y[:4]), plain(y[:4]))


def test_validation_selection_uses_heldout_rows():
    """val_fraction holds rows out, records the held-out Hyvärinen loss, keeps the best weights."""
    g = torch.Generator().manual_seed(11)
    y = torch.randn(2000, 2, generator=g) * 0.5
    res_net = ScoreNet(2, hidden=16, depth=1)
    res = train_score_net(res_net, y, steps=60, batch_size=128, lr=5e-3, val_fraction=0.2, eval_every=20,
                          generator=torch.Generator().manual_seed(4), progress=False)
    assert res.val_steps == [20, 40, 60] and len(res.val_losses) == 3
    assert res.best_step == res.val_steps[min(range(3), key=res.val_losses.__getitem__)]
    # the kept weights reproduce the best held-out loss on the same held-out rows
    perm = torch.randperm(2000, generator=torch.Generator().manual_seed(4))
    held = y[perm[:400]]
    assert hyvarinen_loss(res_net, held).item() == pytest.approx(min(res.val_losses), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("parametrization", ["direct", "residual", "energy"])
@pytest.mark.parametrize("arch", ["mlp", "resmlp"])
def test_conditional_net_options_shapes_and_trace(parametrization, arch):
    g = torch.Generator().manual_seed(12)
    net = ConditionalScoreNet(2, hidden=8, depth=2, arch=arch, parametrization=parametrization, n_fourier=3).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    sig = torch.full((6,), 0.4, dtype=torch.float64)
    assert net.inputs(y, sig).shape == (6, 2 * (1 + 2 * 3) + 1)
    s, tr = jacobian_trace(net, y, sig)
    assert s.shape == (6, 2)
    jac = torch.stack([torch.autograd.functional.jacobian(lambda q: net(q[None], sig[i : i + 1])[0], y[i]) for i in range(6)])
    torch.testing.assert_close(tr, jac.diagonal(dim1=-2, dim2=-1).sum(-1))
    if parametrization == "energy":  # a gradient field: symmetric Jacobian
        torch.testing.assert_close(jac, jac.transpose(-1, -2))


def test_new_options_bad_inputs_name_the_argument():
    net = ScoreNet(2, hidden=8, depth=1)
    y = torch.zeros(8, 2)
    g = torch.Generator()
    with pytest.raises(ValueError, match="ema"):
        train_score_net(net, y, ema=1.0, generator=g)
    with pytest.raises(TypeError, match="ema"):
        train_score_net(net, y, ema="0.9", generator=g)
    with pytest.raises(ValueError, match="val_fraction"):
        train_score_net(net, y, val_fraction=0.7, generator=g)
    with pytest.raises(ValueError, match="lr_final_fraction"):
        train_score_net(net, y, lr_final_fraction=0.0, generator=g)
    with pytest.raises(ValueError, match="warmup"):
        train_score_net(net, y, warmup=-1, generator=g)
    with pytest.raises(ValueError, match="arch"):
        ScoreNet(2, arch="transformer")
    with pytest.raises(ValueError, match="parametrization"):
        ConditionalScoreNet(2, parametrization="potential")
    with pytest.raises(ValueError, match="n_fourier"):
        ConditionalScoreNet(2, n_fourier=-1)
    with pytest.raises(ValueError, match="fourier_period"):
        ConditionalScoreNet(2, fourier_period=0.0)
    with pytest.raises(ValueError, match="parametrization"):
        fit_score(y, parametrization="energy", generator=g)


def test_weight_decay_shrinks_weights_not_biases():
    """AdamW decay acts on the weight matrices: with lr·wd = 0.05 per step the decayed run's
    weights end up clearly smaller than the same run without decay."""
    y = torch.randn(256, 2, generator=torch.Generator().manual_seed(13))

    def run(wd):
        torch.manual_seed(0)
        net = ScoreNet(2, hidden=8, depth=1)
        train_score_net(net, y, steps=40, batch_size=64, lr=1e-2, weight_decay=wd, generator=torch.Generator().manual_seed(5), progress=False)
        return net

    plain, decayed = run(0.0), run(5.0)
    w = lambda net: sum(float(p.norm()) for p in net.parameters() if p.dim() >= 2)
    assert w(decayed) < 0.9 * w(plain)
    with pytest.raises(ValueError, match="weight_decay"):
        train_score_net(plain, y, weight_decay=-1.0, generator=torch.Generator())


def test_fit_score_leaves_the_global_rng_alone_and_checks_its_arguments():
    y = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    before = torch.get_rng_state()
    fit_score(y, steps=2, hidden=8, depth=1, generator=torch.Generator().manual_seed(1), progress=False)
    fit_score([y, y], [0.3, 0.6], steps=2, hidden=8, depth=1, generator=torch.Generator().manual_seed(1), progress=False)
    assert torch.equal(before, torch.get_rng_state())
    with pytest.raises(ValueError, match="at least one row"):
        fit_score(y[:0], steps=2, generator=torch.Generator().manual_seed(1), progress=False)
    for key in ("lr", "weight_decay"):
        with pytest.raises(ValueError, match=f"{key} must be a finite float"):
            fit_score(y, steps=2, generator=torch.Generator().manual_seed(1), progress=False, **{key: float("inf")})


def test_learned_score_checks_its_inputs():
    """An integer or non-tensor y is a TypeError (an int y came back truncated to int64), a sigma
    for an unconditional score a ValueError (it was ignored), and σ = inf is refused (it made the
    whole network NaN during fit_score)."""
    score = LearnedScore(ScoreNet(2, hidden=8, depth=1))
    with pytest.raises(TypeError, match="floating-point"):
        score(torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        score([[0.0, 0.0]])
    with pytest.raises(ValueError, match="unconditional"):
        score(torch.zeros(1, 2), 0.5)
    with pytest.raises(ValueError, match="sigma must be > 0 and finite, got inf"):
        ConditionalScoreNet(2, hidden=4, depth=1)(torch.zeros(3, 2), float("inf"))
    with pytest.raises(ValueError, match=r"sigmas\[1\] must be a finite float > 0"):
        fit_score([torch.zeros(8, 2), torch.zeros(8, 2)], [0.5, float("inf")], steps=1, generator=torch.Generator(),
                  progress=False)


def test_fit_score_names_a_bad_dtype_or_level():
    g = torch.Generator()
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        fit_score(torch.zeros(8, 2), dtype="float32", steps=1, generator=g, progress=False)
    with pytest.raises(ValueError, match=r"sigmas\[1\] must be a finite float > 0"):
        fit_score([torch.zeros(8, 2), torch.zeros(8, 2)], [0.5, "x"], steps=1, generator=g, progress=False)
    state = g.get_state()
    with pytest.raises(ValueError, match="weight_decay"):
        train_score_net(ScoreNet(2, hidden=4, depth=1), torch.zeros(8, 2), steps=1, generator=g, progress=False,
                        val_fraction=0.25, weight_decay=-1.0)
    assert torch.equal(g.get_state(), state)  # refused before the validation split drew from it
