"""The demo (`python -m experiments.eight_gaussians.demo`) and the command line (`etweedie info`, moved commands, `python -m etweedie`)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import etweedie

from etweedie.cli import main
from experiments.eight_gaussians.demo import QUICK_SIZES, format_score_table, run_score_demo
from experiments.eight_gaussians.demo import main as demo_main

TINY = dict(n_queries=32, n_draws=16, bank_size=2_000)


def test_quick_demo_through_the_cli(tmp_path, capsys):
    assert demo_main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    for column in ("noise", "σ", "β", "λ", "method", "NMSE", "cosine", "#draws"):
        assert column in printed
    assert "IS half A (floor)" in printed and str(tmp_path / "score_demo.json") in printed

    results = json.loads((tmp_path / "score_demo.json").read_text())
    assert results["config"]["n_queries"] == QUICK_SIZES["n_queries"]
    rows = results["rows"]
    assert len(rows) == 3 * 2 + 4 * 2
    for row in rows:
        assert math.isfinite(row["nmse"]) and row["nmse"] >= 0
        assert -1 <= row["cosine"] <= 1

    # ET on N exact posterior draws under Gaussian noise: the error of the mean of N draws
    # gives NMSE ≈ E tr Cov(X|y) / (N s⁴ E‖∇log p_Y‖²) ≈ τ²/(N s²) for small s (within-mode
    # posterior variance τ²s²/(τ²+s²), E‖∇log p_Y‖² ≈ 2/(τ²+s²)): 0.04/(128·0.01) ≈ 0.031 at
    # s = 0.1 with the quick N = 128, less at larger s.  0.1 leaves > 3× margin for the
    # spread of a 128-query average.
    exact = [r for r in rows if r["method"] == "ET exact posterior"]
    assert len(exact) == 3
    for row in exact:
        assert row["nmse"] < 0.1, row
        assert row["cosine"] > 0.9, row
    # ET on SIR draws from half A is IS on half A plus resampling noise, so it cannot beat
    # the two-halves reference floor (fixed seed: deterministic).
    for et, floor in zip(rows[6::2], rows[7::2]):
        assert et["method"] == "ET SIR half A" and floor["method"] == "IS half A (floor)"
        assert (et["beta"], et["sigma"]) == (floor["beta"], floor["sigma"])
        assert et["nmse"] >= floor["nmse"]


def test_demo_reproducible_from_seed_and_json_matches(tmp_path):
    a = run_score_demo(seed=3, progress=False, out_dir=tmp_path, **TINY)
    b = run_score_demo(seed=3, progress=False, **TINY)
    c = run_score_demo(seed=4, progress=False, **TINY)
    nmse = lambda r: [row["nmse"] for row in r["rows"]]
    assert nmse(a) == nmse(b) and nmse(a) != nmse(c)
    written = json.loads((tmp_path / "score_demo.json").read_text())
    assert written["rows"] == a["rows"]
    table = format_score_table(a)
    assert len(table.splitlines()) > len(a["rows"])


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(n_queries=0), ValueError, "n_queries"),
        (dict(n_draws=1.5), TypeError, "n_draws"),
        (dict(bank_size=1), ValueError, "bank_size"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(dtype="float64"), TypeError, "dtype"),
    ],
)
def test_demo_rejects_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        run_score_demo(progress=False, **kwargs)


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "torch" in out and "threads" in out


def test_cli_info_names_a_bad_etweedie_backend_and_keeps_the_automatic_choice(capsys, monkeypatch):
    monkeypatch.setenv("ETWEEDIE_BACKEND", "bogus")
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ETWEEDIE_BACKEND must be one of" in err[0]
    monkeypatch.setenv("ETWEEDIE_BACKEND", "reference")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "requested by ETWEEDIE_BACKEND: reference" in out
    assert f"automatic choice for CPU tensors: {'cpu' if etweedie.backends.available()['cpu'][0] else 'reference'}" in out


def test_cli_usage_errors_return_status(capsys):
    assert main([]) == 2
    assert demo_main(["--bogus"]) == 2
    assert demo_main(["--seed", "-1"]) == 2
    assert main(["--help"]) == 0


@pytest.mark.parametrize("command", ["demo", "score-eval", "sample", "estimate"])
def test_cli_moved_reproductions_name_their_successor(command, capsys):
    """The paper-table commands left the installed package: one line naming the module to run, status 2."""
    assert main([command, "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "python -m experiments.eight_gaussians." in err


def test_cli_bench_names_the_benchmarks_module(capsys):
    """The benchmarks ship with the source tree, not the package: `etweedie bench` names the module
    to run from the repository root (the library no longer imports `benchmarks`)."""
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "python -m benchmarks.table" in err


def test_command_line_helpers_load_without_torch():
    """etweedie.commandline is the one definition of the one-line errors; it and experiments/_cli's
    imports of it stay torch-free where the GPU preflight loads it on its own."""
    code = ("import sys; sys.path.insert(0, 'scripts'); sys.path.insert(0, '.')\n"
            "from scripts._commandline import load\n"
            "m = load(); assert m.OneLineParser and m.fail and m.allocation_failure(MemoryError()).startswith('out of memory')\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_python_dash_m():
    done = subprocess.run([sys.executable, "-m", "etweedie", "info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "backends" in done.stdout


def test_full_demo_trains_evaluates_and_reports_where_files_are(tmp_path, capsys):
    # `make demo` = train on CPU, evaluate the β sweep and the N budget, print tables and paths;
    # here with the tiny training config and a small evaluation so it takes seconds.
    import dataclasses
    from io import StringIO
    from pathlib import Path

    from experiments.eight_gaussians.demo import DEMO_SAMPLING, demo_eval_config, print_demo, run_demo
    from etweedie.training import load_config

    root = Path(__file__).resolve().parents[1]
    train_cfg = load_config(root / "configs" / "eight_gaussians_tiny.toml")
    eval_cfg = dataclasses.replace(
        demo_eval_config(), n_queries=32, bank_size=3000, sweeps={"beta": [1.4, 2.0]}, mc_n_draws=[1, 4, 16],
        mc_repetitions=2, field_grid=10, field_density=0.4, field_values={"beta": [1.4]},
    )
    sampling = dict(DEMO_SAMPLING, levels=3, steps_per_level=1, first_level_steps=1, n_posterior=4, chains=64,
                    n_reference=256)
    log = StringIO()
    demo = run_demo(tmp_path / "demo", progress=False, train_config=train_cfg, eval_config=eval_cfg,
                    sampling_settings=sampling, log=log)
    for stage in ("[1/3] training", "[2/3] evaluating", "[3/3] sampling"):
        assert stage in log.getvalue()
    samp = demo["sampling"]
    assert torch.load(samp["samples_path"])["samples"].shape == (64, 2)
    for key in ("signed_ed", "mode_weight_tv", "min_mode_mass", "modes_present", "mean_radial_error"):
        assert key in samp["metrics"] and key in samp["clean_draws"]
    assert json.loads((tmp_path / "demo" / "demo_sampling.json").read_text())["settings"]["chains"] == 64
    assert demo["train"]["step"] == train_cfg.steps
    results = demo["eval"]
    assert list(results["sweeps"]) == ["beta"] and results["mc_budget"]["n_draws"] == [1, 4, 16]
    print_demo(demo)
    printed = capsys.readouterr().out
    for token in ("score NMSE", "a + b/N", "run directory", results["json_path"], demo["train"]["posterior"],
                  "Sampling along the rotating path", "independent clean draws", samp["samples_path"]):
        assert token in printed
    assert json.loads(Path(results["json_path"]).read_text())["models"] == [demo["train"]["posterior"]]
    assert {Path(p).name for p in results["figures"]} == {"score_fields_beta.png", "mc_budget.png"}
    for path in results["figures"]:
        assert Path(path).stat().st_size > 5_000 and f"figure:  {path}" in printed
    # a second run reuses the trained model (resume of a finished run) instead of training again
    again = run_demo(tmp_path / "demo", progress=False, train_config=train_cfg,
                     eval_config=dataclasses.replace(eval_cfg, parts=["sweeps"]), sampling_settings=sampling,
                     log=StringIO())
    assert again["train"]["resumed_from"] == train_cfg.steps
