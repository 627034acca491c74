"""Sample metrics on synthetic inputs with known answers; stratified subsets and bootstrap; tracking;
and the argument checks of the image metrics that need no MNIST files or ONNX model."""

import math

import numpy as np
import pytest
import torch

from etweedie.data import EightGaussians
from etweedie.evaluation.image_metrics import (
    MnistEvaluator,
    as_unit_images,
    bootstrap_feature_energy_distance,
    feature_energy_distance,
    nearest_train,
)
from etweedie.evaluation.metrics import (
    METRIC_SUITES,
    MarginalTracker,
    eight_gaussians_metrics,
    forward_noised,
    mean_radial_error,
    min_mode_mass,
    mode_assignment,
    mode_weight_tv,
    mode_weights,
    modes_present,
    null_energy_distance,
    signed_energy_distance,
    stratified_bootstrap,
    stratified_bootstrap_energy_distance,
    stratified_subset,
)
from etweedie.evaluation import bootstrap_ed_replicates
from etweedie.noise import NoiseParams

from conftest import DEVICES

RING = EightGaussians()
F64 = torch.float64


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _ed_bruteforce(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dab = np.linalg.norm(a[:, None] - b[None], axis=-1).mean()
    daa = np.linalg.norm(a[:, None] - a[None], axis=-1)
    dbb = np.linalg.norm(b[:, None] - b[None], axis=-1)
    n, m = len(a), len(b)
    return 2 * dab - daa.sum() / (n * (n - 1)) - dbb.sum() / (m * (m - 1))


def test_signed_energy_distance_matches_the_u_statistic():
    g = gen(1)
    a, b = torch.randn(37, 2, generator=g), torch.randn(23, 2, generator=g) + 0.3
    assert signed_energy_distance(a, b) == pytest.approx(_ed_bruteforce(a, b), rel=1e-6)


def test_signed_energy_distance_is_unbiased_under_the_null_and_detects_shifts():
    draw = lambda k, g: RING.sample(k, g)[0]  # noqa: E731
    null = null_energy_distance(draw, 300, 300, repeats=40, generator=gen(2))
    se = null.std() / math.sqrt(null.numel())
    assert abs(null.mean().item()) < 4 * se.item()  # mean 0: the estimator is unbiased
    assert (null < 0).any()  # signed: it goes below zero
    shifted = signed_energy_distance(draw(300, gen(3)) + torch.tensor([0.6, 0.0]), draw(300, gen(4)))
    assert shifted > null.mean() + 6 * null.std()


def _short_draw(k, g):
    return torch.randn(k - 1, 2, generator=g)


@pytest.mark.parametrize(
    "draw, error, match",
    [
        pytest.param(3, TypeError, "draw must be a callable", id="not-callable"),
        pytest.param(_short_draw, ValueError, "k = 5", id="wrong-sample-size"),  # an ED of the wrong sample size before
    ],
)
def test_null_energy_distance_checks_the_sampler(draw, error, match):
    with pytest.raises(error, match=match):
        null_energy_distance(draw, 5, 6, repeats=1, generator=gen())


def test_mode_metrics_on_constructed_points():
    means = RING.means(torch.float64)
    # 3 points at mode 0, 1 at each of modes 1..5, none at modes 6 and 7 (n = 8)
    labels = torch.tensor([0, 0, 0, 1, 2, 3, 4, 5])
    x = means[labels] + 0.01
    assert mode_assignment(x, means).tolist() == labels.tolist()
    w = mode_weights(x, means)
    assert w.tolist() == pytest.approx([3 / 8, 1 / 8, 1 / 8, 1 / 8, 1 / 8, 1 / 8, 0, 0])
    # TV = ½ (|3/8 − 1/8| + 2·1/8) = 1/4
    assert mode_weight_tv(x, means) == pytest.approx(0.25)
    assert min_mode_mass(x, means) == 0.0
    assert modes_present(x, means) == 6
    balanced = means.repeat(5, 1)
    assert mode_weight_tv(balanced, means) == pytest.approx(0.0)
    assert min_mode_mass(balanced, means) == pytest.approx(1 / 8)


def test_mean_radial_error_of_clean_ring_data():
    x, _ = RING.sample(200_000, gen(5), dtype=torch.float64)
    # |‖x‖ − R| ≈ |radial Gaussian offset| = τ sqrt(2/π) (plus O(τ²/R) curvature terms)
    assert mean_radial_error(x, RING.radius) == pytest.approx(0.2 * math.sqrt(2 / math.pi), rel=0.02)
    assert mean_radial_error(torch.tensor([[3.0, 0.0], [0.0, 1.0]]), 2.0) == pytest.approx(1.0)


def test_eight_gaussians_suite_on_clean_draws():
    a, _ = RING.sample(4096, gen(6))
    b, _ = RING.sample(4096, gen(7))
    m = eight_gaussians_metrics(a, b, RING)
    assert abs(m["signed_ed"]) < 0.01
    assert m["modes_present"] == 8 and m["min_mode_mass"] > 0.11 and m["mode_weight_tv"] < 0.03
    assert sum(m["mode_weights"]) == pytest.approx(1.0)
    assert eight_gaussians_metrics(a, None, RING)["signed_ed"] is None
    assert METRIC_SUITES["eight_gaussians"] is eight_gaussians_metrics


@pytest.mark.parametrize(
    "call, match",
    [
        # every point went to mode 0
        pytest.param(lambda x: mode_weights(x, torch.tensor([[1.0, 0.0], [math.nan, 0.0]])), "means must be finite",
                     id="mode_weights-nan-mean"),
        pytest.param(lambda x: mean_radial_error(x, math.inf), "radius", id="mean_radial_error-inf-radius"),  # returned inf
        pytest.param(lambda x: signed_energy_distance(x.to("meta"), x), "meta", id="signed_energy_distance-meta"),
    ],
)
def test_mode_and_radial_metrics_reject_non_finite_parameters(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(10, 2, generator=gen()))


def test_eight_gaussians_metrics_names_ed_samples():
    x, _ = RING.sample(20, gen())
    with pytest.raises(ValueError, match="ed_samples must have shape"):  # blamed the reference
        eight_gaussians_metrics(x, x, RING, ed_samples=torch.zeros(5, 3))


def test_stratified_subset_takes_evenly_from_each_seed():
    groups = [torch.full((10, 1), float(i)) for i in range(3)]
    sub = stratified_subset(groups, 8)
    assert sub.flatten().tolist() == [0.0] * 3 + [1.0] * 3 + [2.0] * 2
    with pytest.raises(ValueError, match=r"groups\[0\] has 10 points"):
        stratified_subset(groups, 40)


def test_stratified_bootstrap_resamples_within_seeds():
    # groups of constants: a stratified resample keeps each group's share, so the pooled mean
    # never moves and the interval collapses to the estimate (an unstratified one would not)
    groups = [torch.zeros(30, 1), torch.ones(10, 1)]
    est, lo, hi = stratified_bootstrap(lambda x: float(x.mean()), groups, n_boot=50, generator=gen(8))
    assert est == lo == hi == pytest.approx(0.25)
    g = gen(9)
    noisy = [torch.randn(400, 1, generator=g) for _ in range(3)]
    est, lo, hi = stratified_bootstrap(lambda x: float(x.mean()), noisy, n_boot=300, generator=gen(10))
    assert lo < est < hi
    assert hi - lo == pytest.approx(2 * 1.96 / math.sqrt(1200), rel=0.25)
    again = stratified_bootstrap(lambda x: float(x.mean()), noisy, n_boot=300, generator=gen(10))
    assert again == (est, lo, hi)  # reproducible from the generator


def test_basic_bootstrap_reflects_the_percentile_interval_and_clips_to_bounds():
    g = gen()
    groups = [torch.randn(300, 1, generator=g).exp() for _ in range(3)]  # skewed: the two differ
    stat = lambda x: float(x.var())  # noqa: E731
    est, lo, hi = stratified_bootstrap(stat, groups, n_boot=120, generator=gen(3))
    est_b, lo_b, hi_b = stratified_bootstrap(stat, groups, n_boot=120, generator=gen(3), method="basic")
    assert est_b == est and lo_b == pytest.approx(2 * est - hi) and hi_b == pytest.approx(2 * est - lo)
    assert (lo_b, hi_b) != pytest.approx((lo, hi), abs=1e-3)
    _, lo_c, hi_c = stratified_bootstrap(
        stat, groups, n_boot=120, generator=gen(3), method="basic", bounds=(est, est + (hi_b - est) / 2)
    )
    assert lo_c == est and hi_c == pytest.approx(est + (hi_b - est) / 2)


def test_basic_bootstrap_covers_biased_mode_statistics():
    """Uniform mode labels (true TV 0, true minimum mass 1/8): the plug-in TV is biased up and the
    minimum down, and the percentile interval, built from replicates biased the same way again,
    misses the truth almost always; the basic interval reflects the bias back (59–80 % coverage
    at this size, experiments/bootstrap_intervals/coverage.py)."""
    k, n_data = 8, 30
    weights = lambda x: torch.bincount(x.flatten().long(), minlength=k).double() / x.shape[0]  # noqa: E731
    stats = {
        "tv": (lambda x: float((weights(x) - 1 / k).abs().sum() / 2), 0.0, (0.0, 1 - 1 / k)),
        "min": (lambda x: float(weights(x).min()), 1 / k, (0.0, 1 / k)),
    }
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,))))  # fresh data each run
    covered = {(name, m): 0 for name in stats for m in ("percentile", "basic")}
    for _ in range(n_data):
        groups = [torch.randint(k, (512, 1), generator=g).double() for _ in range(3)]
        for name, (fn, truth, bounds) in stats.items():
            for m in ("percentile", "basic"):
                _, lo, hi = stratified_bootstrap(fn, groups, n_boot=80, generator=gen(5), method=m, bounds=bounds)
                covered[name, m] += lo <= truth <= hi
    for name in stats:
        assert covered[name, "percentile"] <= 3, covered
        assert covered[name, "basic"] >= 9, covered


def _mixed_width_groups():
    g = gen(3)
    return [torch.randn(4, 1, generator=g), torch.randn(4, 2, generator=g)]


def _one_group():
    return [torch.randn(6, 2, generator=gen(3))]


@pytest.mark.parametrize(
    "call, error, match",
    [
        # torch.cat's RuntimeError before
        pytest.param(lambda: stratified_bootstrap(lambda x: float(x.mean()), _mixed_width_groups(), n_boot=4,
                                                  generator=gen()),
                     ValueError, r"groups\[1\]", id="bootstrap-mixed-widths"),
        pytest.param(lambda: stratified_subset(_mixed_width_groups(), 4), ValueError, r"groups\[1\]",
                     id="subset-mixed-widths"),
        pytest.param(lambda: stratified_bootstrap(lambda x: float(x.mean()), _one_group(), n_boot=4, generator=gen(),
                                                  bounds=("a", 1.0)),
                     ValueError, "bounds", id="bootstrap-bounds-str"),
        pytest.param(lambda: stratified_bootstrap(lambda x: x.mean(0), _one_group(), n_boot=4, generator=gen()),
                     TypeError, "statistic must return a real number", id="bootstrap-statistic-vector"),
    ],
)
def test_bootstraps_and_subsets_check_their_groups_and_statistic(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bootstrap_statistic_may_return_a_numpy_scalar():
    est, lo, hi = stratified_bootstrap(lambda x: np.float32(x.mean()), _one_group(), n_boot=8, generator=gen())
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


@pytest.mark.parametrize("beta", [1.0, 1.5, 2.0])
def testbootstrap_ed_replicates_drop_tied_pairs(beta):
    """Each replicate equals the brute-force signed ED of the resample with the pairs of a point
    and its own copy left out of the within-cloud mean (same index draws as the function's)."""
    g = gen(20)
    groups = [torch.randn(7, 3, generator=g), torch.randn(9, 3, generator=g) + 0.5]
    ref = torch.randn(11, 3, generator=g).double()
    got = bootstrap_ed_replicates(groups, ref, 5, gen(21), beta, 2)
    draw, want = gen(21), []
    for b in (2, 2, 1):
        idx = [torch.randint(x.shape[0], (b, x.shape[0]), generator=draw) for x in groups]
        for r in range(b):
            x = torch.cat([grp[i[r]] for grp, i in zip(groups, idx)]).double().numpy()
            origin = np.concatenate([i[r].numpy() + 100 * k for k, i in enumerate(idx)])
            dxx = np.linalg.norm(x[:, None] - x[None], axis=-1) ** beta
            distinct = origin[:, None] != origin[None]
            dxy = np.linalg.norm(x[:, None] - ref.numpy()[None], axis=-1) ** beta
            dyy = np.linalg.norm(ref.numpy()[:, None] - ref.numpy()[None], axis=-1) ** beta
            m = ref.shape[0]
            want.append(2 * dxy.mean() - dxx[distinct].mean() - dyy.sum() / (m * (m - 1)))
    assert got.tolist() == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_bootstrap_ed_is_centred_where_the_plain_one_is_shifted():
    """Resampled points come with copies; the plain replicate counts the zero distance between a
    point and its copy and so sits ≈ E‖a−a'‖/n above the estimate (0.013 here).  The tie-free
    replicate does not."""
    g = gen(22)
    ref = RING.sample(512, g)[0]
    plain_shift, tie_free_shift = [], []
    for _ in range(6):
        groups = [RING.sample(64, g)[0] for _ in range(3)]
        est = signed_energy_distance(torch.cat(groups), ref)
        reps = bootstrap_ed_replicates(groups, ref.double(), 200, gen(23), 1.0, 50)
        tie_free_shift.append(float(reps.mean()) - est)
        draw = gen(23)
        plain = [signed_energy_distance(torch.cat([x[torch.randint(64, (64,), generator=draw)] for x in groups]), ref)
                 for _ in range(200)]
        plain_shift.append(float(np.mean(plain)) - est)
    assert np.mean(plain_shift) > 0.008
    assert abs(np.mean(tie_free_shift)) < 0.15 * np.mean(plain_shift)
    est, lo, hi = stratified_bootstrap_energy_distance(groups, ref, n_boot=200, generator=gen(24))
    assert est == pytest.approx(signed_energy_distance(torch.cat(groups), ref))
    assert lo < est < hi
    again = stratified_bootstrap_energy_distance(groups, ref, n_boot=200, generator=gen(24))
    assert again == (est, lo, hi)  # reproducible from the generator


def test_marginal_tracker_and_forward_noise():
    params = NoiseParams(1.4, 1.8, NoiseParams.sigma_for_rms(0.3, 1.8, 1.4), 0.0, 0.6)
    noisy = forward_noised(torch.zeros(100_000, 2), params, gen(11))
    assert noisy.pow(2).mean().sqrt().item() == pytest.approx(0.3, rel=0.01)

    draw = lambda k, g: RING.sample(k, g)[0]  # noqa: E731
    tracker = MarginalTracker(draw, 1024, gen(12), max_chains=1024)
    exact = forward_noised(draw(1024, gen(13)), params, gen(14))
    tracker(dict(level=0, t=0.0, state=exact, params=params))
    tracker(dict(level=1, t=0.5, state=exact * 1.5, params=params))
    assert [r["level"] for r in tracker.records] == [0, 1]
    assert tracker.records[0]["r"] == pytest.approx(0.3)
    assert abs(tracker.records[0]["signed_ed"]) < 0.02
    assert tracker.records[1]["signed_ed"] > 0.2
    assert tracker.max_after(1) == tracker.records[1]["signed_ed"]
    with pytest.raises(ValueError, match="burn_in_levels=5 leaves no recorded level"):
        tracker.max_after(5)


@pytest.mark.parametrize("device", DEVICES, ids=[d.type for d in DEVICES])
def test_marginal_tracker_runs_on_the_chains_device(device, seed):
    """The reference clouds come from the CPU generator whatever the device, the energy distance runs
    where the chains are: a GPU chain's records match the same chain's on the CPU."""
    params = NoiseParams(1.6, 1.5, NoiseParams.sigma_for_rms(0.2, 1.5, 1.6), 0.3, -0.2)
    draw = lambda k, g: RING.sample(k, g)[0]  # noqa: E731
    state = forward_noised(draw(300, gen(seed)), params, gen(seed + 1)) * 1.1
    records = []
    for where in (torch.device("cpu"), device):
        tracker = MarginalTracker(draw, 256, gen(seed + 2), max_chains=200)
        tracker(dict(level=3, t=0.25, state=state.to(where), params=params))
        records.append(tracker.records[0])
    assert records[1]["signed_ed"] == pytest.approx(records[0]["signed_ed"], rel=1e-6, abs=1e-9)
    assert {k: v for k, v in records[1].items() if k != "signed_ed"} == {k: v for k, v in records[0].items() if k != "signed_ed"}


def _tracker_info():
    params = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6)
    return dict(level=0, t=0.5, params=params, state=torch.randn(30, 2, generator=gen(1)))


@pytest.mark.parametrize(
    "draw_clean, info, error, match",
    [
        # compared against 23 points silently
        pytest.param(lambda k, g: torch.randn(k + 3, 2, generator=g), _tracker_info, ValueError, "draw_clean",
                     id="draw_clean-wrong-count"),
        # (points, labels): forgot [0]
        pytest.param(lambda k, g: RING.sample(k, g), _tracker_info, TypeError, "draw_clean", id="draw_clean-pair"),
        pytest.param(lambda k, g: RING.sample(k, g)[0], lambda: dict(state=_tracker_info()["state"]), ValueError,
                     "info must be the sampler's callback dict", id="info-state-only"),
    ],
)
def test_marginal_tracker_checks_its_sampler_and_the_callback_info(draw_clean, info, error, match):
    tracker = MarginalTracker(draw_clean, 20, gen())
    with pytest.raises(error, match=match):
        tracker(info())


def test_marginal_tracker_records_a_good_callback_info():
    tracker = MarginalTracker(lambda k, g: RING.sample(k, g)[0], 20, gen())
    tracker(_tracker_info())
    assert len(tracker.records) == 1 and math.isfinite(tracker.records[0]["signed_ed"])


def test_bad_inputs_raise_named_errors():
    x = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="samples must be a torch.Tensor"):
        signed_energy_distance([[0.0, 0.0]], x)
    with pytest.raises(ValueError, match=r"reference must have shape \(n, 2\)"):
        signed_energy_distance(x, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="samples must hold at least 2 points"):
        signed_energy_distance(torch.zeros(1, 2), x)
    with pytest.raises(ValueError, match="must be finite"):
        signed_energy_distance(torch.full((3, 2), float("nan")), x)
    with pytest.raises(TypeError, match="samples must be float32 or float64"):
        signed_energy_distance(torch.zeros(4, 2, dtype=torch.int64), x)
    with pytest.raises(ValueError, match=r"means must have shape \(K >= 1, 2\)"):
        mode_weights(x, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="radius must be a float > 0"):
        mean_radial_error(x, -1.0)
    with pytest.raises(ValueError, match="threshold must be a float"):
        modes_present(x, RING.means(), threshold=2.0)
    with pytest.raises(TypeError, match="data must be an etweedie.data.EightGaussians"):
        eight_gaussians_metrics(x, None, "ring")
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        stratified_bootstrap(lambda x: 0.0, [x], n_boot=5, generator=None)
    with pytest.raises(ValueError, match="level must be a float in"):
        stratified_bootstrap(lambda x: 0.0, [x], n_boot=5, generator=gen(), level=95)
    with pytest.raises(ValueError, match="method must be 'percentile' or 'basic', got 'bca'"):
        stratified_bootstrap(lambda x: 0.0, [x], n_boot=5, generator=gen(), method="bca")
    with pytest.raises(ValueError, match=r"bounds must be a pair \(low, high\) with low <= high, got \(1.0, 0.0\)"):
        stratified_bootstrap(lambda x: 0.0, [x], n_boot=5, generator=gen(), bounds=(1.0, 0.0))
    with pytest.raises(ValueError, match=r"groups\[1\] must have d = 2 columns"):
        stratified_bootstrap_energy_distance([x, torch.zeros(4, 3)], x, n_boot=5, generator=gen())
    with pytest.raises(ValueError, match=r"reference must have shape \(n, 2\)"):
        stratified_bootstrap_energy_distance([x], torch.zeros(4, 3), n_boot=5, generator=gen())
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        stratified_bootstrap_energy_distance([x], x, n_boot=5, generator=1)
    with pytest.raises(ValueError, match="level must be a float in"):
        stratified_bootstrap_energy_distance([x], x, n_boot=5, generator=gen(), level=1.5)
    with pytest.raises(TypeError, match="groups must be a non-empty list"):
        stratified_bootstrap_energy_distance(x, x, n_boot=5, generator=gen())
    with pytest.raises(ValueError, match="params must hold one tuple"):
        forward_noised(x, NoiseParams(torch.tensor([1.4, 1.5]), 1.8, 0.5), gen())


# ---------------------------------------------------------------------------- image metrics (no data or model)
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


@pytest.mark.parametrize(
    "call, error, match",
    [
        # blamed the op's `a`
        pytest.param(lambda a, b: feature_energy_distance(a.half(), b.half()), TypeError,
                     "features must be float32 or float64", id="ed-half"),
        pytest.param(lambda a, b: feature_energy_distance(a.to("meta"), b.to("meta")), ValueError, "meta", id="ed-meta"),
        # a (nan, nan) interval before
        *(pytest.param(lambda a, b, bad=bad: bootstrap_feature_energy_distance([a], b, n_boot=4, generator=gen(),
                                                                              bank_within_mean=bad),
                       ValueError, "bank_within_mean", id=f"bootstrap-bank_within_mean-{name}")
          for name, bad in (("nan", math.nan), ("str", "x"))),
    ],
)
def test_feature_metrics_name_bad_precision_and_bank_mean(call, error, match):
    a, b = torch.rand(6, 4, generator=gen()), torch.rand(7, 4, generator=gen(1))
    with pytest.raises(error, match=match):
        call(a, b)


def _bare_evaluator():
    """An MnistEvaluator without data or model (the argument checks come first), one null entry cached."""
    ev = MnistEvaluator.__new__(MnistEvaluator)
    ev.pool, ev._null = torch.zeros(20, 4), {(10, 5, 0): torch.zeros(5, dtype=F64)}
    return ev


# The seed was int()-ed: 1.5 silently ran as 1, a str or 2**62 failed inside torch; a float n
# found the cache entry of the int n without validation.
_BAD_SEEDS = (("float", 1.5, TypeError), ("str", "a", TypeError), ("none", None, TypeError),
              ("2pow62", 2**62, ValueError), ("negative", -1, ValueError))


@pytest.mark.parametrize(
    "call, error, match",
    [
        *(pytest.param(lambda ev, seed=seed: ev.evaluate(torch.zeros(4, 784), seed=seed), error, "seed",
                       id=f"evaluate-seed-{name}")
          for name, seed, error in _BAD_SEEDS),
        *(pytest.param(lambda ev, seed=seed: ev.null(10, 5, seed), error, "seed", id=f"null-seed-{name}")
          for name, seed, error in _BAD_SEEDS),
        pytest.param(lambda ev: ev.null(10.0, 5), ValueError, "n must be an int", id="null-n-float"),
        pytest.param(lambda ev: ev.heldout_nearest_train_rmse("a"), TypeError, "n must be an int",
                     id="heldout_nearest_train_rmse-n-str"),
    ],
)
def test_evaluator_checks_seed_and_sizes_before_any_work(call, error, match):
    with pytest.raises(error, match=match):
        call(_bare_evaluator())


def test_evaluator_serves_a_cached_null_entry():
    assert _bare_evaluator().null(10, 5).shape == (5,)
