"""Edge cases of etweedie.train: resumption at awkward points (optimizer state included), deadline
stops, the training loss against a float64 O(m²) energy score, and named errors for bad data,
bad arguments and damaged resume state."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from etweedie.checkpoint import CheckpointError
from etweedie.models import EngressionPosterior
from etweedie.sources import DataSource
from etweedie.train import (
    NoisePrior,
    _loss_and_backward,
    build_posterior,
    gaussian_posterior_check,
    held_out_loss,
    load_config,
    noise_law,
    noise_metric,
    save_posterior,
    train,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    """30 steps of 16 examples × 3 draws: checkpoints at 10, 20, 30; log lines every 5."""
    tiny = load_config(ROOT / "configs" / "eight_gaussians_tiny.toml")
    return dataclasses.replace(tiny, steps=30, checkpoint_every=10, log_every=5, batch_size=16, draws=3)


def _differences(a, b, path="") -> list:
    """Paths where two checkpoint objects differ (tensors bitwise; NaN equals NaN)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return [] if same else [f"{path}: {a!r} != {b!r}"]


def _log_rows(path) -> list:
    return [(r["step"], r["loss"], r["lr"]) for r in map(json.loads, Path(path).read_text().splitlines())]


def _assert_same_run(full: dict, other: dict) -> None:
    a = torch.load(full["checkpoint"], weights_only=True)
    b = torch.load(other["checkpoint"], weights_only=True)
    ignored = (".wall_time", ".cpu_time", ".config.max_wall_s")
    diffs = [d for d in _differences(a, b) if not d.startswith(ignored)]
    assert not diffs, diffs  # model, EMA, Adam moments and step counts, generator states, interval sums
    assert _log_rows(full["log"]) == _log_rows(other["log"])


def test_resume_at_awkward_points_equals_the_uninterrupted_run(tmp_path, small):
    """Cut right after a checkpoint, before the first checkpoint, during the last step, at step 0,
    and twice in a row: every resumed run ends bitwise equal to the uninterrupted one, the
    optimizer's moments included."""
    full = train(small, tmp_path / "full", progress=False)
    for stops in ([10], [7], [29], [0], [11, 29]):
        out = tmp_path / ("cut" + "_".join(map(str, stops)))
        for stop in stops:
            cut = train(small, out, progress=False, stop_after=stop)
            assert cut["step"] == stop and cut["posterior"] is None
        resumed = train(small, out, progress=False)
        assert resumed["step"] == small.steps and not resumed["stopped"]
        _assert_same_run(full, resumed)


def test_deadline_stops_resume_to_the_uninterrupted_run(tmp_path, small):
    """A deadline that has always passed stops every invocation at its first log step with a
    checkpoint and a posterior; rerunning until done gives the uninterrupted run's state."""
    full = train(small, tmp_path / "full", progress=False)
    config = dataclasses.replace(small, max_wall_s=1e-9)
    steps = []
    while True:
        summary = train(config, tmp_path / "dl", progress=False)
        steps.append(summary["step"])
        if not summary["stopped"]:
            break
        assert summary["stopped_by"] == "deadline" and Path(summary["posterior"]).is_dir()
    assert steps == [5, 10, 15, 20, 25, 30]
    _assert_same_run(full, summary)


# ---------------------------------------------------------------------------- the loss
def _energy_score_64(samples, x, params, d, geometry, loss_beta) -> float:
    """(1/B) Σ_b [(1/m) Σ_i ‖x̂_i − x‖^β − 1/(2m(m−1)) Σ_{i≠j} ‖x̂_i − x̂_j‖^β] in ‖·‖_{Σ⁻¹}, by hand."""
    beta, _, sigma, u, v = (t.double() for t in params._tensors())
    B, m, _ = samples.shape
    total = 0.0
    for b in range(B):
        be = float(beta[b])
        c2 = math.exp((2 / be) * math.log(be) + math.lgamma((d + 2) / be) - math.log(d) - math.lgamma(d / be))
        if geometry == "block":
            S = torch.tensor([[1 + float(u[b]), float(v[b])], [float(v[b]), 1 - float(u[b])]], dtype=torch.float64)
            sigma_b = torch.kron(torch.eye(d // 2, dtype=torch.float64), S)
        else:
            sigma_b = torch.eye(d, dtype=torch.float64)
        P = torch.linalg.inv(sigma_b * float(sigma[b]) ** 2 / c2)
        p = be if loss_beta == "matched" else loss_beta
        norm = lambda z: float(z @ P @ z) ** (p / 2)  # noqa: E731
        s, xb = samples[b].double(), x[b].double()
        fit = sum(norm(s[i] - xb) for i in range(m)) / m
        spread = sum(norm(s[i] - s[j]) for i in range(m) for j in range(m) if i != j) / (2 * m * (m - 1))
        total += fit - spread
    return total / B


@pytest.mark.parametrize("d,geometry,loss_beta", [(2, "block", "matched"), (4, "block", 1.0), (3, "isotropic", "matched")])
def test_training_loss_is_the_float64_energy_score(d, geometry, loss_beta):
    model = EngressionPosterior(d, width=8, depth=2, noise_dim=3, init_seed=1)
    g = torch.Generator().manual_seed(3)
    B, m = 5, 4
    x = torch.randn(B, d, generator=g)
    params = NoisePrior(geometry=geometry).sample(B, g)
    y = x + noise_law(params, d, geometry).sample(generator=g)
    g_model = torch.Generator().manual_seed(9)
    state = g_model.get_state()
    loss = _loss_and_backward(model, x, y, params, m, g_model, torch.device("cpu"), loss_beta, geometry=geometry)
    g_model.set_state(state)
    with torch.no_grad():
        samples = model.generate(y, params.eta(), model.draw_noise(B, m, g_model, eta=params.eta()))
    expected = _energy_score_64(samples, x, params, d, geometry, loss_beta)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------- bad data and arguments
class _Source(DataSource):
    def __init__(self, dim, draw):
        self.dim, self._draw = dim, draw

    def draw(self, batch_size, generator):
        return self._draw(batch_size, generator)


@pytest.mark.parametrize("data,data_dim,error,words", [
    (torch.randn(10, 2).half(), None, TypeError, "data: the source's draws must be float32 or float64, got torch.float16"),
    (_Source(2, lambda b, g: torch.randn(b, 3, generator=g)), None, ValueError, "must return shape (8, d=2), got (8, 3)"),
    (_Source("2", lambda b, g: torch.randn(b, 2, generator=g)), None, TypeError, "dim must be an int >= 1, got str"),
    (torch.randn(10, 2), 4, ValueError, "data_dim=4 disagrees with the data's dimension d = 2"),
    (lambda b, g: torch.full((b, 2), float("nan")), 2, ValueError, "drew NaN or infinite examples"),
])
def test_bad_data_is_named(tmp_path, small, data, data_dim, error, words):
    config = dataclasses.replace(small, steps=3, batch_size=8, log_every=2)
    with pytest.raises(error) as info:
        train(config, tmp_path / "run", data=data, data_dim=data_dim, progress=False)
    assert words in str(info.value)


def test_train_argument_types(tmp_path, small):
    with pytest.raises(TypeError, match="out_dir must be a folder path"):
        train(small, 5, progress=False)
    with pytest.raises(TypeError, match="resume must be a bool, got str"):  # "no" is truthy: it would resume
        train(small, tmp_path / "r", resume="no", progress=False)


@pytest.mark.parametrize("damage,words", [
    (lambda c: c["optimizer"]["param_groups"][0].__setitem__("betas", "x"), "optimizer betas"),
    (lambda c: c["optimizer"]["state"][0]["exp_avg"].fill_(float("nan")), "optimizer state 'exp_avg' holds NaN"),
])
def test_damaged_optimizer_state_is_a_named_checkpoint_error(tmp_path, small, damage, words):
    config = dataclasses.replace(small, steps=4, checkpoint_every=2, log_every=2, batch_size=8)
    out = tmp_path / "run"
    train(config, out, progress=False, stop_after=2)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    damage(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=words):
        train(config, out, progress=False)


def test_evaluation_helpers_check_their_arguments(small):
    posterior = build_posterior(small)
    for kwargs, error, words in [
        (dict(n_examples=0), ValueError, "n_examples must be >= 1"),
        (dict(draws=1), ValueError, "draws must be >= 2"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(data=torch.randn(10, 4)), ValueError, "held-out data have d = 4 but the posterior draws d = 2"),
    ]:
        with pytest.raises(error, match=words):
            held_out_loss(posterior, small, **{"n_examples": 8, "draws": 2, **kwargs})
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        held_out_loss(posterior, {}, n_examples=8)
    for kwargs, error, words in [
        (dict(sigmas=()), ValueError, "sigmas must hold at least one"),
        (dict(n_queries=0), ValueError, "n_queries must be >= 1"),
        (dict(data="ring"), TypeError, "data must be an etweedie.data.EightGaussians"),
    ]:
        with pytest.raises(error, match=words):
            gaussian_posterior_check(posterior, **{"n_queries": 4, "n_draws": 4, **kwargs})


def test_noise_geometry_is_checked():
    params = NoisePrior().sample(3, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="geometry must be one of"):
        noise_law(params, 2, "diag")  # was silently the block law
    with pytest.raises(TypeError, match="d must be an int"):
        noise_metric(params, "3", "isotropic")


def test_save_posterior_checks_storage_arguments(tmp_path):
    model = EngressionPosterior(2, width=4, depth=1)
    with pytest.raises(ValueError, match="shard_mb must be > 0"):
        save_posterior(model, tmp_path / "p", shard_mb=-1)  # was 1 KiB shards
    with pytest.raises(ValueError, match=r"extra must not set the keys the loader reads, got \['format'\]"):
        save_posterior(model, tmp_path / "p", extra={"format": "mine"})  # was an unloadable posterior
    precious = tmp_path / "notes.txt"
    precious.write_text("keep")
    with pytest.raises(ValueError, match="is an existing file"):
        save_posterior(model, precious)
    assert precious.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_config_helpers_check_their_argument_types():
    from etweedie.train import build_data_source, dry_run_config

    with pytest.raises(TypeError, match="config must be a TrainConfig, got dict"):
        dry_run_config({})  # was dataclasses' "replace() should be called on dataclass instances"
    with pytest.raises(TypeError, match="data must be a DataConfig"):
        build_data_source({})  # was AttributeError: 'dict' object has no attribute 'source'
