"""Edge cases of the score, score-matching and sample-quality metrics found in an audit.

Each test pins a defect that the old code had: a wrong number at float32's extremes, a silent
NaN, a deep torch error instead of a named one, or an argument accepted when it made no sense.
All run on small tensors (no MNIST files, no ONNX model needed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from etweedie.data import EightGaussians
from etweedie.image_metrics import (
    MnistEvaluator,
    as_unit_images,
    bootstrap_feature_energy_distance,
    feature_energy_distance,
    nearest_train,
)
from etweedie.metrics import (
    MarginalTracker,
    eight_gaussians_metrics,
    mean_radial_error,
    mode_weights,
    null_energy_distance,
    signed_energy_distance,
    stratified_bootstrap,
    stratified_subset,
)
from etweedie.noise import NoiseParams
from etweedie.score import ISOracle, mean_cosine, posterior_mean_mse, richardson, richardson_score, score_nmse
from etweedie.scorematching import (
    ConditionalScoreNet,
    ScoreNet,
    fit_score,
    hyvarinen_loss,
    sliced_score_matching_vr_loss,
    train_score_net,
)

F64 = torch.float64
RING = EightGaussians()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- score metrics
def _cosine64(a, b):
    a, b = a.double(), b.double()
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).mean())


def test_score_metrics_match_float64_formulas_at_every_float32_scale():
    """float32 fields at 1e±30: cosine was 0.0 at 1e30 and 2.0 (> 1) at 1e-30, NMSE 0/0 = NaN,
    the posterior-mean MSE inf; float64 fields at 1e-200 had cosine 0."""
    g = gen(1)
    est, ref = torch.randn(7, 3, generator=g, dtype=F64), torch.randn(7, 3, generator=g, dtype=F64)
    cos = _cosine64(est, ref)
    nmse = float((est - ref).pow(2).sum(-1).mean() / ref.pow(2).sum(-1).mean())
    for scale, dtype in ((1e30, torch.float32), (1e-30, torch.float32), (1.0, torch.float32), (1e-200, F64), (1e200, F64)):
        e, r = (est * scale).to(dtype), (ref * scale).to(dtype)
        assert mean_cosine(e, r) == pytest.approx(cos, rel=1e-5), scale
        assert score_nmse(e, r) == pytest.approx(nmse, rel=1e-5), scale
    e32, r32 = (est * 1e30).float(), (ref * 1e30).float()
    assert posterior_mean_mse(e32, r32) == pytest.approx(float((e32.double() - r32.double()).pow(2).mean()), rel=1e-12)
    # identical rows give exactly cosine 1 (never above), a zero row counts as 0
    ones = torch.full((2, 3), 1e-30)
    assert mean_cosine(ones, ones) == pytest.approx(1.0) and mean_cosine(ones, ones) <= 1.0
    assert mean_cosine(torch.zeros(1, 3), torch.ones(1, 3)) == 0.0


def test_score_metrics_reject_scalars_and_mixed_devices():
    with pytest.raises(ValueError, match="0-d"):
        score_nmse(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(ValueError, match="s_eps1 must have shape"):
        richardson(torch.tensor(1.0), torch.tensor(2.0), 0.1, 0.2)  # came back with shape (1,)
    with pytest.raises(ValueError, match="device"):
        mean_cosine(torch.ones(2, 2), torch.ones(2, 2, device="meta"))


def test_richardson_depends_only_on_the_eps_ratio_and_keeps_zero_size_batches():
    """ε² overflowed (ε = 1e20) or underflowed (ε = 1e-30) in float32: the result was all NaN."""
    g = gen(2)
    s1, s2 = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    e1 = torch.rand(5, generator=g, dtype=F64) + 0.1
    e2 = e1 + torch.rand(5, generator=g, dtype=F64) + 0.05
    hand = (e2[:, None] ** 2 * s1.double() - e1[:, None] ** 2 * s2.double()) / (e2[:, None] ** 2 - e1[:, None] ** 2)
    torch.testing.assert_close(richardson(s1.double(), s2.double(), e1, e2), hand, rtol=1e-12, atol=1e-12)
    base = richardson(s1, s2, 1.0, 2.0)
    for scale in (1e20, 1e-30):
        torch.testing.assert_close(richardson(s1, s2, scale, 2 * scale), base)
    assert richardson(torch.zeros(0, 2), torch.zeros(0, 2), 0.1, 0.2).shape == (0, 2)


def test_richardson_score_and_oracle_halves_name_bad_arguments():
    with pytest.raises(TypeError, match="score_fn must be a callable"):
        richardson_score(3, torch.zeros(2, 2), NoiseParams(2.0, 1.0, 0.5), 0.1, 0.2)
    with pytest.raises(ValueError, match="M >= 4"):  # said the bank had shape (1, 2)
        ISOracle(torch.randn(3, 2, generator=gen())).halves()
    with pytest.raises(ValueError, match="d >= 1"):
        ISOracle(torch.zeros(4, 0))


# ---------------------------------------------------------------------------- sample metrics
def test_mode_and_radial_metrics_reject_non_finite_parameters():
    x = torch.randn(10, 2, generator=gen())
    with pytest.raises(ValueError, match="means must be finite"):  # every point went to mode 0
        mode_weights(x, torch.tensor([[1.0, 0.0], [math.nan, 0.0]]))
    with pytest.raises(ValueError, match="radius"):  # returned inf
        mean_radial_error(x, math.inf)
    with pytest.raises(ValueError, match="meta"):
        signed_energy_distance(x.to("meta"), x)


def test_eight_gaussians_metrics_names_ed_samples():
    x, _ = RING.sample(20, gen())
    with pytest.raises(ValueError, match="ed_samples must have shape"):  # blamed the reference
        eight_gaussians_metrics(x, x, RING, ed_samples=torch.zeros(5, 3))


def test_bootstraps_and_subsets_check_their_groups_and_statistic():
    g = gen(3)
    mixed = [torch.randn(4, 1, generator=g), torch.randn(4, 2, generator=g)]
    with pytest.raises(ValueError, match=r"groups\[1\]"):  # torch.cat's RuntimeError before
        stratified_bootstrap(lambda x: float(x.mean()), mixed, n_boot=4, generator=gen())
    with pytest.raises(ValueError, match=r"groups\[1\]"):
        stratified_subset(mixed, 4)
    groups = [torch.randn(6, 2, generator=g)]
    with pytest.raises(ValueError, match="bounds"):
        stratified_bootstrap(lambda x: float(x.mean()), groups, n_boot=4, generator=gen(), bounds=("a", 1.0))
    with pytest.raises(TypeError, match="statistic must return a real number"):
        stratified_bootstrap(lambda x: x.mean(0), groups, n_boot=4, generator=gen())
    # numpy scalars and one-element tensors are fine
    est, lo, hi = stratified_bootstrap(lambda x: np.float32(x.mean()), groups, n_boot=8, generator=gen())
    assert lo <= hi


def test_stratified_bootstrap_intervals_match_a_hand_written_resampler():
    """Regression check against numpy: within-group resampling, percentile and basic intervals."""
    g = gen(4)
    groups = [torch.randn(k, 1, generator=g, dtype=F64) + 1 for k in (9, 12)]
    stat = lambda x: float(x.mean())  # noqa: E731
    draws = gen(5)
    reps = []
    for _ in range(64):
        parts = [x[torch.randint(x.shape[0], (x.shape[0],), generator=draws)] for x in groups]
        reps.append(stat(torch.cat(parts)))
    est = stat(torch.cat(groups))
    lo, hi = np.quantile(np.array(reps), [0.05, 0.95])
    for method, want in (("percentile", (lo, hi)), ("basic", (2 * est - hi, 2 * est - lo))):
        got = stratified_bootstrap(stat, groups, n_boot=64, generator=gen(5), level=0.9, method=method)
        assert got == pytest.approx((est, *want), rel=1e-12, abs=1e-12), method


def test_null_energy_distance_checks_the_sampler():
    with pytest.raises(TypeError, match="draw must be a callable"):
        null_energy_distance(3, 5, 5, repeats=1, generator=gen())
    short = lambda k, g: torch.randn(k - 1, 2, generator=g)  # noqa: E731
    with pytest.raises(ValueError, match="k = 5"):  # an ED of the wrong sample size before
        null_energy_distance(short, 5, 6, repeats=1, generator=gen())


def test_marginal_tracker_checks_its_sampler_and_the_callback_info():
    params = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6)
    info = dict(level=0, t=0.5, params=params, state=torch.randn(30, 2, generator=gen(1)))
    wrong_count = MarginalTracker(lambda k, g: torch.randn(k + 3, 2, generator=g), 20, gen())
    with pytest.raises(ValueError, match="draw_clean"):  # compared against 23 points silently
        wrong_count(info)
    pair = MarginalTracker(lambda k, g: RING.sample(k, g), 20, gen())  # (points, labels): forgot [0]
    with pytest.raises(TypeError, match="draw_clean"):
        pair(info)
    tracker = MarginalTracker(lambda k, g: RING.sample(k, g)[0], 20, gen())
    with pytest.raises(ValueError, match="info must be the sampler's callback dict"):
        tracker(dict(state=info["state"]))
    tracker(info)
    assert len(tracker.records) == 1 and math.isfinite(tracker.records[0]["signed_ed"])


# ---------------------------------------------------------------------------- score matching
def test_score_matching_losses_refuse_empty_batches_and_mismatched_dtypes():
    net = ScoreNet(2, hidden=8, depth=1)
    with pytest.raises(ValueError, match="at least one row"):  # NaN loss before
        hyvarinen_loss(net, torch.zeros(0, 2))
    with pytest.raises(ValueError, match="at least one row"):
        sliced_score_matching_vr_loss(net, torch.zeros(0, 2), generator=gen())
    with pytest.raises(TypeError, match="parameter dtype torch.float32"):  # a matmul RuntimeError before
        hyvarinen_loss(net, torch.zeros(3, 2, dtype=F64))
    with pytest.raises(TypeError, match="parameter dtype"):
        train_score_net(net, torch.zeros(8, 2, dtype=F64), steps=1, generator=gen(), progress=False)
    cnet = ConditionalScoreNet(2, hidden=8, depth=1)
    with pytest.raises(ValueError, match="cond must be one value for all rows or have leading dimension n = 5"):
        sliced_score_matching_vr_loss(cnet, torch.zeros(5, 2), torch.ones(3), generator=gen())
    assert sliced_score_matching_vr_loss(cnet, torch.zeros(5, 2), [0.5] * 5, generator=gen()).shape == ()


def test_conditional_score_net_names_bad_sigma_and_options():
    cnet = ConditionalScoreNet(2, hidden=8, depth=1)
    with pytest.raises(TypeError, match="sigma must be a real number"):
        cnet(torch.zeros(3, 2), "0.5")
    with pytest.raises(ValueError, match="floor"):  # floor = inf made every score 0
        ConditionalScoreNet(2, hidden=8, depth=1, floor=math.inf)
    with pytest.raises(ValueError, match="fourier_period"):
        ConditionalScoreNet(2, hidden=8, depth=1, fourier_period=math.inf)


def test_training_refuses_non_finite_observations_and_bad_arguments():
    y = torch.randn(16, 2, generator=gen())
    bad = y.clone()
    bad[3, 1] = math.nan
    kw = dict(steps=2, hidden=8, depth=1, progress=False)
    with pytest.raises(ValueError, match="observations must be finite"):  # trained to NaN weights
        fit_score(bad, generator=gen(), **kw)
    with pytest.raises(ValueError, match=r"observations\[1\] must be finite"):
        fit_score([y, bad], [0.2, 0.4], generator=gen(), **kw)
    net = ScoreNet(2, hidden=8, depth=1)
    with pytest.raises(ValueError, match="y must be finite"):
        train_score_net(net, bad, steps=1, generator=gen(), progress=False)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        train_score_net(lambda q: q, y, steps=1, generator=gen(), progress=False)
    with pytest.raises(ValueError, match="trainable parameters"):
        train_score_net(torch.nn.Identity(), y, steps=1, generator=gen(), progress=False)
    with pytest.raises(TypeError, match="cond must be a real tensor"):
        train_score_net(ConditionalScoreNet(2, hidden=8, depth=1), y, "abc", steps=1, generator=gen(), progress=False)
    with pytest.raises(TypeError, match="n_projections"):
        train_score_net(net, y, method="exact", n_projections=1.5, steps=1, generator=gen(), progress=False)
    with pytest.raises(TypeError, match="observations must be a tensor"):  # blamed sigmas before
        fit_score(np.zeros((4, 2)), generator=gen(), **kw)
    with pytest.raises(TypeError, match="sigmas must be a list"):
        fit_score([y, y], (s for s in (0.2, 0.4)), generator=gen(), **kw)


# ---------------------------------------------------------------------------- image metrics
def test_image_inputs_carrying_a_graph_are_detached():
    """A generator's output with requires_grad reached onnxruntime's .numpy() and failed."""
    x = torch.rand(2, 28, 28, generator=gen()).requires_grad_()
    assert not as_unit_images(x).requires_grad
    train = torch.rand(5, 784, generator=gen(1))
    index = nearest_train(x.detach(), train)[1]
    # (N, 1, 28, 28) training images are accepted like the queries' layout
    torch.testing.assert_close(nearest_train(x.detach(), train.reshape(5, 1, 28, 28))[1], index)
    with pytest.raises(TypeError, match="train must be a torch.Tensor"):
        nearest_train(x.detach(), train.tolist())


def test_feature_metrics_name_bad_precision_and_bank_mean():
    a, b = torch.rand(6, 4, generator=gen()), torch.rand(7, 4, generator=gen(1))
    with pytest.raises(TypeError, match="features must be float32 or float64"):  # blamed the op's `a`
        feature_energy_distance(a.half(), b.half())
    with pytest.raises(ValueError, match="meta"):
        feature_energy_distance(a.to("meta"), b.to("meta"))
    for bad in (math.nan, "x"):
        with pytest.raises(ValueError, match="bank_within_mean"):  # (nan, nan) interval before
            bootstrap_feature_energy_distance([a], b, n_boot=4, generator=gen(), bank_within_mean=bad)


def test_evaluator_checks_seed_and_sizes_before_any_work():
    """The seed was int()-ed: 1.5 silently ran as 1, a str or 2**62 failed inside torch; a float n
    found the cache entry of the int n without validation."""
    ev = MnistEvaluator.__new__(MnistEvaluator)  # no data or model: the checks come first
    ev.pool, ev._null = torch.zeros(20, 4), {(10, 5, 0): torch.zeros(5, dtype=F64)}
    for seed, error in ((1.5, TypeError), ("a", TypeError), (None, TypeError), (2**62, ValueError), (-1, ValueError)):
        with pytest.raises(error, match="seed"):
            ev.evaluate(torch.zeros(4, 784), seed=seed)
        with pytest.raises(error, match="seed"):
            ev.null(10, 5, seed)
    with pytest.raises(ValueError, match="n must be an int"):
        ev.null(10.0, 5)
    assert ev.null(10, 5).shape == (5,)  # the cached entry itself is served
    with pytest.raises(TypeError, match="n must be an int"):
        ev.heldout_nearest_train_rmse("a")
