"""Smoke runs, at tiny sizes, of the reproduction studies under experiments/ that have no test file of
their own (the eight-Gaussians score, diffusion, estimation and demo entry points are tested in
test_score_eval.py, test_sample.py, test_estimate.py and test_demo.py)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from etweedie.training import load_config, train

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# A tiny estimation problem (the full-SPD experiment's truth and levels, small banks and draws).
TINY_ESTIMATE = (
    "replicates = 1\n[data]\nn_estimation = 24\nn_heldout = 16\nbank_size = 2000\n"
    "[sources]\nscore = [\"oracle\"]\nposterior = [\"oracle\"]\n"
    "[estimator]\nn_posterior = 16\nsteps = 5\n"
    "[score_net]\ntrain_per_level = 64\nsteps = 5\nbatch_size = 32\n"
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A posterior trained for 60 steps (configs/eight_gaussians_tiny.toml): a run directory."""
    out = tmp_path_factory.mktemp("tiny_posterior")
    train(load_config(CONFIGS / "eight_gaussians_tiny.toml"), out, progress=False)
    return out


def _run(module: str, argv, monkeypatch, capsys) -> str:
    """``python -m experiments.<module> ARGV`` in this process (the studies parse sys.argv)."""
    mod = importlib.import_module(f"experiments.{module}")
    monkeypatch.setattr(sys, "argv", [module, *map(str, argv)])
    status = mod.main()
    assert status in (None, 0)
    return capsys.readouterr().out


def test_bootstrap_interval_studies(monkeypatch, capsys):
    out = _run("bootstrap_intervals.energy_distance_shift",
               ["--sizes", 30, "--reference", 60, "--datasets", 1, "--n-boot", 8], monkeypatch, capsys)
    assert "tie" in out.lower() or "plain" in out.lower()
    out = _run("bootstrap_intervals.coverage", ["--sizes", 30, "--datasets", 2, "--n-boot", 8], monkeypatch, capsys)
    assert "mode_weight_tv" in out and "min_mode_mass" in out


def test_sampler_throughput(tiny_run, monkeypatch, capsys):
    out = _run("eight_gaussians.sampler_throughput", ["--checkpoint", tiny_run, "--chains", 32, "--levels", 1],
               monkeypatch, capsys)
    assert "chain" in out


def test_posterior_quality_studies(tiny_run, tmp_path, monkeypatch, capsys):
    row = json.loads(_run("posterior_quality.quality", [tiny_run], monkeypatch, capsys).strip().splitlines()[-1])
    assert row["held_out_es"] > 0 and row["gauss_score_nmse"] > 0
    out = _run("posterior_quality.architecture_ablation",
               ["--config", CONFIGS / "eight_gaussians_tiny.toml", "--variant", "film:scaled_residual",
                "--steps", 5, "--out", tmp_path / "ablation"], monkeypatch, capsys)
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 5
    assert (tmp_path / "ablation" / "ablation.jsonl").is_file()


def test_estimation_diagnostics(tiny_run, tmp_path, monkeypatch, capsys):
    config = tmp_path / "tiny_estimate.toml"
    config.write_text(TINY_ESTIMATE)
    out = _run("estimation_diagnostics.per_level_beta",
               ["--config", config, "--posterior-checkpoint", tiny_run, "--split-half", "--json", tmp_path / "levels.json"],
               monkeypatch, capsys)
    rows = json.loads((tmp_path / "levels.json").read_text())
    assert {r["posterior"] for r in rows} == {"oracle", "learned0"} and "rep 0" in out
    _run("estimation_diagnostics.posterior_tails",
         ["--posterior-checkpoint", tiny_run, "--sigmas", 0.25, "--queries", 16, "--draws", 8,
          "--json", tmp_path / "tails.json"], monkeypatch, capsys)
    assert (tmp_path / "tails.json").is_file()
    _run("estimation_diagnostics.score_net_accuracy", ["--config", config, "--json", tmp_path / "net.jsonl"],
         monkeypatch, capsys)
    assert (tmp_path / "net.jsonl").is_file()


@pytest.mark.parametrize("module", ["eight_gaussians.gpu_diffusion_tables", "eight_gaussians.gpu_estimation_posteriors"])
def test_gpu_job_drivers_parse_their_arguments(module, monkeypatch, capsys):
    """The GPU drivers' real runs need a GPU and minutes (`--dry-run` runs them on a CPU: slow test below)."""
    mod = importlib.import_module(f"experiments.{module}")
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 0 and "--pack-dir" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_estimation_driver_dry_run_on_cpu(tmp_path, monkeypatch):
    """`--dry-run`: 20 steps of each training on the CPU under the driver's deadline logic."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "experiments.eight_gaussians.gpu_estimation_posteriors", "--dry-run",
         "--pack-dir", str(tmp_path / "pack"), "--deadline", "240"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # a finished training is recognised by its posterior/ folder: the posteriors share one archive
    packed = sorted(p.name for p in (tmp_path / "pack").iterdir())
    assert any(name.endswith("_posteriors.tar.gz") for name in packed), packed
    assert not any(name.endswith("_unfinished.tar.gz") for name in packed), packed


def test_gpu_drivers_recognise_a_finished_training(tmp_path):
    """A run folder is finished when it holds its posterior (posterior/ with config.json, or a
    legacy posterior.pt), not when it holds only its checkpoint."""
    from experiments.eight_gaussians.gpu_diffusion_tables import finished

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    assert not finished(run)
    (run / "posterior").mkdir()
    (run / "posterior" / "config.json").write_text("{}")
    assert finished(run)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "posterior.pt").write_bytes(b"")
    assert finished(legacy)


@pytest.mark.parametrize("module, args", [
    ("eight_gaussians.demo", ["--quick", "--no-progress"]),
    ("eight_gaussians.score_eval", ["--oracle", "--config", "configs/score_eval_tiny.toml", "--no-progress"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--no-progress", "--no-figures"]),
])
def test_an_out_under_a_file_is_one_line_before_any_work(module, args, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    mod = importlib.import_module(f"experiments.{module}")
    assert mod.main(args + ["--out", str(afile / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be created" in err[0] and "is a file" in err[0], err


def test_an_unavailable_backend_request_is_one_line(tmp_path, monkeypatch, capsys):
    """ETWEEDIE_BACKEND naming a backend this machine lacks: one line and exit 2 from the CLIs."""
    from etweedie import backends
    from etweedie.cli import main as cli

    if backends.available()["cuda"][0]:
        pytest.skip("CUDA is available here: the request can run")
    monkeypatch.setenv("ETWEEDIE_BACKEND", "cuda")
    demo = importlib.import_module("experiments.eight_gaussians.demo")
    assert demo.main(["--quick", "--no-progress"]) == 2
    assert cli(["train", "--config", str(ROOT / "configs" / "eight_gaussians_tiny.toml"), "--out", str(tmp_path / "r"),
                "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("backend 'cuda' is unavailable" in line for line in err), err


@pytest.mark.parametrize("module, argv", [
    ("posterior_quality.quality", ["/nonexist"]),
    ("mnist.posterior_figure", ["--posterior", "/nonexist"]),
    ("mnist.posterior_figure", ["--chains", "0"]),
    ("estimation_diagnostics.posterior_tails", ["--posterior-checkpoint", "/nonexist"]),
    ("estimation_diagnostics.per_level_beta", ["--posterior-checkpoint", "/nonexist"]),
])
def test_study_scripts_report_user_errors_in_one_line(module, argv, monkeypatch, capsys):
    from experiments import _cli

    mod = importlib.import_module(f"experiments.{module}")
    monkeypatch.setattr(sys, "argv", [module] + argv)
    assert _cli.guarded(f"python -m experiments.{module}", mod.main) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m experiments.{module}: error: "), err


def test_export_pretrained_never_deletes_a_folder_that_is_not_an_export(tmp_path, capsys):
    from etweedie.cli import main as cli
    from experiments.mnist import export_pretrained

    run = tmp_path / "run"
    assert cli(["train", "--config", str(ROOT / "configs" / "eight_gaussians_tiny.toml"), "--out", str(run),
                "--steps", "2", "--no-progress"]) == 0
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep")
    capsys.readouterr()
    assert export_pretrained.main(["--run", str(run), "--dest", str(dest), "--command", "x"]) == 2
    assert (dest / "notes.txt").read_text() == "keep"
    assert "is not an exported posterior" in capsys.readouterr().err
