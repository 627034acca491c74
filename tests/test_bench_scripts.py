"""The stand-alone benchmark scripts run end to end on tiny settings (their numbers are not
checked here, only that each script still runs against the current ops and prints its table)."""

import os
import subprocess
import sys

import pytest

from etweedie.ops import _prep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not _prep._FRONT["et_score"], reason="compiled extension with the front ops not available")
def test_host_overhead_script_runs(tmp_path):
    """bench_host_overhead.py checks the public op, the raw op and the front op agree before
    timing them; a front op's changed return type (it returns ``(out, nonfinite)``) broke it."""
    out = tmp_path / "host.json"
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_host_overhead.py"), "--repeats", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| et_score iso | cpu |" in run.stdout and "| energy_score block fwd+bwd | gpu-like |" in run.stdout
    assert out.exists()


@pytest.mark.parametrize("module, args, words", [
    ("table", ["--only", "nomatch"], "--only 'nomatch' matches no workload"),
    ("table", ["--threads", "0"], "--threads must be >= 1"),
    ("table", ["--json", "/nonexistent_dir/x.json"], "is not a writable file path"),
    ("bench_mnist_sampler", ["--posterior", "/nonexistent"], "no posterior or checkpoint"),
    ("bench_mnist_sampler", ["--chains", "0"], "--chains must be >= 1"),
    ("bench_mnist_sampler", ["--levels", "0"], "--levels must be >= 1"),
])
def test_bench_flag_errors_are_one_line(module, args, words, capsys):
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
