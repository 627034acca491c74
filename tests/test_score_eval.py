"""Score evaluation (Tables score_full5_accuracy, score_mc_budget; Richardson; figures) and its CLI."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from etweedie.posteriors import KnownPosterior
from experiments.eight_gaussians.score_eval import main
from experiments.eight_gaussians.score_eval import (
    PARAMETERS,
    ScoreEvalConfig,
    config_from_dict,
    format_results,
    load_config,
    run_score_eval,
    sweep_params,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SMALL = ScoreEvalConfig(
    n_queries=48,
    n_draws=16,
    bank_size=3000,
    parts=["sweeps", "mc_budget", "sigma_profile", "richardson"],
    sweeps={"beta": [1.4, 2.0], "sigma": [0.3, 0.6], "v": [0.0, 0.6]},
    mc_n_draws=[1, 4, 16],
    mc_repetitions=2,
    profile_sigmas=[0.3, 0.6],
    richardson_sigmas=[0.1, 0.13, 0.17],
    richardson_n_queries=64,
    richardson_n_draws=16,
)


def oracle(seed, bank_size=3000):
    return KnownPosterior(method="sir", bank_size=bank_size, generator=torch.Generator().manual_seed(seed), bank_dtype=torch.float32)


@pytest.fixture(scope="module")
def two_model_results():
    return run_score_eval([oracle(1), oracle(2)], SMALL, names=["a", "b"], progress=False)


def test_tables_have_every_sweep_and_mean_std_over_models(two_model_results):
    r = two_model_results
    assert r["models"] == ["a", "b"]
    assert list(r["sweeps"]) == ["beta", "sigma", "v"]
    for name, sweep in r["sweeps"].items():
        assert [v["value"] for v in sweep["values"]] == SMALL.sweeps[name]
        for metric in ("nmse", "cosine", "pm_mse"):
            stat = sweep["summary"][metric]
            assert len(stat["per_model"]) == 2 and stat["std"] is not None and stat["std"] >= 0
            assert stat["mean"] == pytest.approx(sum(stat["per_model"]) / 2)
            # a sweep's entry is the mean over its values
            per_value = [v["models"][0][metric] for v in sweep["values"]]
            assert stat["per_model"][0] == pytest.approx(sum(per_value) / len(per_value))
        s = sweep["summary"]
        assert 0 < s["nmse"]["mean"] < 1 and 0.5 < s["cosine"]["mean"] <= 1
        assert s["reference_disagreement"] > 0
    # SIR oracles on their own (3k) banks: NMSE ≥ the reference disagreement floor in most rows
    table = format_results(r)
    for token in ("score_full5_accuracy", "score_mc_budget", "Richardson", "paper", "±"):
        assert token in table


def test_mc_budget_table_and_fit(two_model_results):
    mc = two_model_results["mc_budget"]
    assert mc["n_draws"] == [1, 4, 16] and mc["sweep"] == "beta"
    nmse = torch.tensor(mc["nmse"])  # (models, budgets, repetitions)
    assert nmse.shape == (2, 3, 2)
    means = nmse.mean(dim=(0, 2))
    assert bool((means[:-1] > means[1:]).all())  # more draws, lower NMSE
    # the N = 1 NMSE is dominated by b: b ≈ (NMSE_1 − NMSE_16)·16/15
    b_rough = float((means[0] - means[2]) * 16 / 15)
    assert mc["fit"]["b"] == pytest.approx(b_rough, rel=0.2)
    assert len(mc["fit_per_model"]) == 2
    # N = 16 in the budget table equals nothing else than a fresh draw set on the same queries
    assert [row["n_draws"] for row in mc["rows"]] == [1, 4, 16]


def test_sigma_profile_uses_the_analytic_gaussian_reference(two_model_results):
    prof = two_model_results["sigma_profile"]
    assert [row["reference"] for row in prof["gaussian"]] == ["analytic", "analytic"]
    # generalized rows share the σ sweep's queries and reference: same disagreement
    sweep = {v["value"]: v["reference_disagreement"] for v in two_model_results["sweeps"]["sigma"]["values"]}
    for row in prof["generalized"]:
        assert row["reference_disagreement"] == sweep[row["sigma"]]


def test_richardson_rows(two_model_results):
    re = two_model_results["richardson"]
    gauss = re["families"]["gaussian"]
    assert len(gauss["pairs"]) == 2
    for pair in gauss["pairs"]:
        # exact analytic noisy scores: extrapolation removes the O(σ²) bias
        assert pair["exact"]["mse_re"] < min(pair["exact"]["mse_sigma1"], pair["exact"]["mse_sigma2"])
        assert pair["model"]["mse_re"]["mean"] > 0


def test_reproducible_from_the_seed():
    cfg = dataclasses.replace(SMALL, parts=["sweeps"], sweeps={"lam": [1.0, 2.5]})
    a = run_score_eval([oracle(3)], cfg, progress=False)
    b = run_score_eval([oracle(3)], cfg, progress=False)
    c = run_score_eval([oracle(3)], dataclasses.replace(cfg, seed=1), progress=False)
    key = lambda r: r["sweeps"]["lam"]["summary"]["nmse"]["mean"]
    assert key(a) == key(b) != key(c)
    assert a["sweeps"]["lam"]["summary"]["nmse"]["std"] is None  # one model: no spread


def test_sweep_params_follow_the_paper():
    p = sweep_params({"beta": 1.4, "lam": 1.8, "sigma": 0.57, "u": 0.0, "v": 0.6}, "u", 0.3)
    assert (float(p.u), float(p.v)) == (0.3, 0.0)  # the u row zeroes v
    p = sweep_params({"beta": 1.4, "lam": 1.8, "sigma": 0.57, "u": 0.2, "v": 0.6}, "v", -0.6)
    assert (float(p.u), float(p.v)) == (0.0, -0.6)
    assert float(sweep_params(dict(beta=1.4, lam=1.8, sigma=0.57, u=0.0, v=0.6), "beta", 2.0).beta) == 2.0


@pytest.mark.parametrize("name", ["score_eval_cpu", "score_eval_full", "score_eval_tiny"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    assert set(cfg.base) == set(PARAMETERS)
    if name != "score_eval_tiny":
        assert cfg.bank_size == 160_000 and cfg.mc_n_draws == [1, 2, 4, 8, 16, 32, 64, 128, 256]
        assert set(cfg.sweeps) == set(PARAMETERS)
        assert min(cfg.sweeps["beta"]) == 1.3 and max(cfg.sweeps["beta"]) == 2.0


@pytest.mark.parametrize(
    "values, error, name",
    [
        ({"n_queries": 0}, ValueError, "n_queries"),
        ({"dtype": "float16"}, ValueError, "dtype"),
        ({"bogus": 1}, ValueError, "bogus"),
        ({"sweeps": {"gamma": [1.0]}}, ValueError, "gamma"),
        ({"sweeps": {"beta": [2.5]}}, ValueError, "beta"),
        ({"sweeps": {"u": [1.0]}, "mc_budget": {"sweep": "u"}}, ValueError, "disk"),
        ({"mc_budget": {"n_draws": [8, 8]}}, ValueError, "n_draws"),
        ({"mc_budget": {"sweep": "lam"}, "sweeps": {"beta": [1.4]}}, ValueError, "mc_budget.sweep"),
        ({"richardson": {"sigmas": [0.1]}}, ValueError, "richardson.sigmas"),
        ({"fields": {"grid": 2}}, ValueError, "field_grid"),
        ({"parts": ["plots"]}, ValueError, "parts"),
        ({"antithetic": "yes"}, TypeError, "antithetic"),
    ],
)
def test_config_rejects_bad_values(values, error, name):
    with pytest.raises(error, match=name):
        config_from_dict(values)


def test_run_rejects_bad_arguments():
    with pytest.raises(ValueError, match="posteriors"):
        run_score_eval([], SMALL, progress=False)
    with pytest.raises(TypeError, match="posteriors\\[0\\]"):
        run_score_eval([object()], SMALL, progress=False)
    with pytest.raises(TypeError, match="config"):
        run_score_eval([oracle(0)], {"n_queries": 3}, progress=False)
    with pytest.raises(ValueError, match="names"):
        run_score_eval([oracle(0)], SMALL, names=["a", "b"], progress=False)


def _assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, path


def test_cli_end_to_end_with_the_oracle_writes_json_and_figures(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["--oracle", "--config", str(CONFIGS / "score_eval_tiny.toml"),
                   "--out", str(out), "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "score_full5_accuracy" in printed and str(out / "score_eval.json") in printed
    results = json.loads((out / "score_eval.json").read_text())
    assert set(results["sweeps"]) == set(PARAMETERS)
    names = {Path(p).name for p in results["figures"]}
    assert names == {"score_fields_beta.png", "score_vs_sigma.png", "mc_budget.png", "richardson_field.png"}
    for path in results["figures"]:
        _assert_png(path)
        assert f"figure: {path}" in printed


def test_cli_with_a_tiny_trained_checkpoint(tmp_path, capsys):
    from etweedie.training import load_config as load_train_config, train

    run = train(load_train_config(CONFIGS / "eight_gaussians_tiny.toml"), tmp_path / "model", progress=False)
    checkpoint = run["posterior"]
    out = tmp_path / "eval"
    status = main(["--checkpoint", checkpoint, "--checkpoint", str(tmp_path / "model"),
                   "--config", str(CONFIGS / "score_eval_tiny.toml"), "--parts", "sweeps",
                   "--no-figures", "--out", str(out), "--no-progress"])
    assert status == 0, capsys.readouterr().err
    results = json.loads((out / "score_eval.json").read_text())
    assert results["models"] == [checkpoint, str(tmp_path / "model")]
    for sweep in results["sweeps"].values():
        nmse = sweep["summary"]["nmse"]
        assert all(math.isfinite(v) and v > 0 for v in nmse["per_model"])
    assert results["figures"] == [] and "mc_budget" not in results
    # the same evaluation with antithetic draws: the flag lands in the config and the tables, and
    # the a + b/N fit skips the odd budgets (N = 1 is one plain draw)
    capsys.readouterr()
    status = main(["--checkpoint", checkpoint, "--config", str(CONFIGS / "score_eval_tiny.toml"),
                   "--parts", "sweeps,mc_budget", "--no-figures", "--out", str(tmp_path / "anti"), "--no-progress",
                   "--antithetic"])
    assert status == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "antithetic draws" in printed and "over N ∈ [4, 16]" in printed
    anti = json.loads((tmp_path / "anti" / "score_eval.json").read_text())
    assert anti["config"]["antithetic"] is True and results["config"]["antithetic"] is False
    assert anti["mc_budget"]["fit"]["n_draws"] == [4, 16]
    for name, sweep in anti["sweeps"].items():
        assert math.isfinite(sweep["summary"]["nmse"]["mean"])


def test_cli_usage_errors(tmp_path, capsys):
    cfg = str(CONFIGS / "score_eval_tiny.toml")
    assert main(["--config", cfg, "--out", str(tmp_path)]) == 2  # neither --checkpoint nor --oracle
    assert main(["--oracle", "--checkpoint", "x.pt", "--config", cfg]) == 2
    assert main(["--checkpoint", str(tmp_path / "missing.pt"), "--config", cfg, "--out", str(tmp_path)]) == 2
    assert main(["--oracle", "--config", str(tmp_path / "none.toml")]) == 2
    assert main(["--oracle", "--config", cfg, "--parts", "sweeps,plots"]) == 2
    assert main(["--oracle", "--antithetic", "--config", cfg, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "parts" in err and "antithetic" in err
