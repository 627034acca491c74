"""The stand-alone benchmark scripts run end to end on tiny settings (their numbers are not
checked here, only that each script still runs against the current ops and prints its table)."""

import os
import subprocess
import sys

import pytest
import torch

from etweedie.ops import _front

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not _front._FRONT["et_score"], reason="compiled extension with the front ops not available")
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


ERRORS = [
    ("table", ["--only", "nomatch"], "--only 'nomatch' matches no workload"),
    ("table", ["--threads", "0"], "--threads must be >= 1"),
    ("table", ["--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("table", ["--quick", "--only", "et_score_iso_2", "--no-compile", "--threads", "100000"], "--threads must be <= 1024"),
    ("table", ["--json", "/nonexistent_dir/x.json"], "cannot be written"),
    ("table", ["--json", "/proc/x.json"], "--json '/proc/x.json' cannot be written"),
    ("table", ["--json", ""], "--json must be a file path, got ''"),
    ("table", ["--json", "{tmp}"], "is a folder; give a file path"),
    ("bench_mnist_sampler", ["--posterior", "/nonexistent"], "no posterior or checkpoint"),
    ("bench_mnist_sampler", ["--posterior", ""], "--posterior must be"),
    ("bench_mnist_sampler", ["--chains", "0"], "--chains must be >= 1"),
    ("bench_mnist_sampler", ["--levels", "0"], "--levels must be >= 1"),
    ("bench_mnist_sampler", ["--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("bench_mnist_sampler", ["--threads", "-2"], "--threads must be >= 1, got -2"),
    ("bench_mnist_sampler", ["--device", "cuda:99"], "--device 'cuda:99' was requested"),
    ("bench_mnist_sampler", ["--device", "foo"], "--device must be a device string"),
    ("bench_mnist_sampler", ["--json", "/proc/x.json"], "--json '/proc/x.json' cannot be written"),
    ("bench_mnist_sampler", ["--path", "nope"], "--path 'nope' is not a noise path"),
    ("bench_mnist_sampler", ["--step-scale", "nan"], "--step-scale must be a finite number > 0, got nan"),
    ("bench_mnist_sampler", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("bench_train", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("bench_train", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ("bench_train", ["--dim", "0"], "--dim must be >= 1, got 0"),
    ("bench_train", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("bench_train", ["--draws", "1"], "--draws must be >= 2, got 1"),
    ("bench_train", ["--width", "0"], "--width must be >= 1, got 0"),
    ("bench_train", ["--threads", "-1"], "--threads must be >= 0, got -1"),
    ("bench_train", ["--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("bench_train", ["--device", "cuda:99"], "--device 'cuda:99' was requested"),
    ("bench_train", ["--device", "foo"], "--device must be a device string"),
    ("bench_train", ["--config", "/nonexistent.toml"], "--config must be an existing TOML file, got '/nonexistent.toml'"),
    ("bench_train", ["--config", "{tmp}/unknown.toml"], "unknown key(s) bogus_key"),
    ("bench_train", ["--config", "{tmp}/broken.toml"], "is not valid TOML"),
    ("bench_train", ["--json", "/proc/x.json"], "--json '/proc/x.json' cannot be written"),
    ("bench_host_overhead", ["--threads", "0"], "--threads must be >= 1, got 0"),
    ("bench_host_overhead", ["--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("bench_host_overhead", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("bench_host_overhead", ["--repeats", "-5"], "--repeats must be >= 1, got -5"),
    ("bench_host_overhead", ["--json", "/proc/x.json"], "--json '/proc/x.json' cannot be written"),
    ("bench_et_score", ["--raw-backward", "--threads", "0"], "--threads must be >= 1, got 0"),
    ("bench_et_score", ["--raw-backward", "--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("bench_et_score", ["--raw-backward", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("bench_et_score", ["--raw-backward", "--rounds", "-1"], "--rounds must be >= 1, got -1"),
    ("bench_mnist_eval", ["--threads", "0"], "--threads must be >= 1, got 0"),
    ("bench_mnist_eval", ["--threads", "100000"], "--threads must be <= 1024, got 100000"),
    ("bench_mnist_eval", ["--data-dir", "/nonexistent"], "--data-dir must be a folder holding the MNIST files"),
    ("bench_mnist_eval", ["--data-dir", ""], "--data-dir must be a folder holding the MNIST files, got an empty"),
    ("bench_mnist_eval", ["--data-dir", "{tmp}"], "MNIST files not found"),
    ("bench_mnist_eval", ["--data-dir", "{tmp}/corrupt"], "/corrupt': "),  # corrupt .gz files
    ("metric_grad_accuracy", ["accuracy", "--seeds", "5", "2"], "--seeds FIRST END must satisfy 0 <= FIRST < END"),
    ("metric_grad_accuracy", ["accuracy", "--seeds", "3", "3"], "got 3 3"),
    ("metric_grad_accuracy", ["accuracy", "--seeds", "-1", "3"], "got -1 3"),
    ("probes.score_backward_ab", ["0"], "threads must be an int in [1, 1024], got 0"),
    ("probes.score_backward_ab", ["100000"], "threads must be an int in [1, 1024], got 100000"),
    ("probes.score_backward_ab", ["2", "foo"], "the metric must be 'iso' or 'block2'"),
]


@pytest.mark.parametrize("module, args, words", ERRORS, ids=[f"{m}:{' '.join(a)}" for m, a, _ in ERRORS])
def test_bench_flag_errors_are_one_line(module, args, words, capsys, tmp_path):
    """A flag a script cannot use is one line ``PROG: error: ...`` naming it and exit status 2,
    before any timing: not a traceback, a segfault (``--threads 100000``), a crash at the end
    (``--json`` in a folder nobody can write, even root) or a run that prints nonsense."""
    import importlib
    import time

    (tmp_path / "unknown.toml").write_text("bogus_key = 3\n")
    (tmp_path / "broken.toml").write_text("steps = [\n")
    (tmp_path / "corrupt").mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / "corrupt" / f"{name}.gz").write_bytes(b"\x1f\x8b\x08\x00 not a whole gzip stream")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    main = importlib.import_module(f"benchmarks.{module}").main
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    assert main(args) == 2
    assert time.perf_counter() - t0 < 10, "the flag was refused only after long work"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and ": error: " in err[0], err
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("value, words", [("abc", "got 'abc'"), ("0", "got 0"), ("5000", "got 5000"), ("2.5", "got '2.5'")])
def test_bench_threads_variable_is_named(value, words, monkeypatch, capsys):
    """A bad ``ETWEEDIE_BENCH_THREADS`` is one line naming the variable (it was a traceback at
    import for a non-integer and an error naming ``--threads`` otherwise); ``--threads`` wins
    over it; unset or empty means 2."""
    from benchmarks.common import env_threads
    from benchmarks.table import main

    monkeypatch.setenv("ETWEEDIE_BENCH_THREADS", value)
    assert main(["--only", "nothing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ETWEEDIE_BENCH_THREADS must be an integer in [1, 1024]" in err[0] and words in err[0], err
    assert main(["--only", "nothing", "--threads", "1"]) == 2  # the flag given: the variable is not read
    assert "--only 'nothing' matches no workload" in capsys.readouterr().err
    for unset in ("", " "):
        monkeypatch.setenv("ETWEEDIE_BENCH_THREADS", unset)
        assert env_threads() == 2
    monkeypatch.setenv("ETWEEDIE_BENCH_THREADS", " 3 ")
    assert env_threads() == 3


def test_check_flags_tries_the_json_file(tmp_path):
    """--json is checked by opening the file (``os.access`` answers True for root everywhere):
    a missing file is created and removed again, an existing one is not truncated."""
    from benchmarks.common import check_flags

    new = tmp_path / "new.json"
    check_flags([], str(new))
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("keep")
    check_flags([], str(old))
    assert old.read_text() == "keep"
    for bad in ("/proc/x.json", "/nonexistent_dir/x.json", str(tmp_path), ""):
        with pytest.raises(ValueError, match="--json"):
            check_flags([], bad)
    check_flags([("--n", None, 1), ("--n", 3, 1), ("--n", 3, 1, 3), ("--n", 0, 0, None)])  # no bound broken
    with pytest.raises(ValueError, match="--n must be <= 3, got 4"):
        check_flags([("--n", 4, 1, 3)])


def test_bench_train_without_warmup(tmp_path, capsys):
    """``--warmup 0``: no untimed steps (it raised KeyError: no log line at step 0)."""
    from benchmarks.bench_train import main

    out = tmp_path / "train.json"
    assert main(["--device", "cpu", "--dim", "4", "--width", "8", "--depth", "1", "--batch", "8", "--draws", "2",
                 "--warmup", "0", "--steps", "2", "--threads", "1", "--json", str(out)]) == 0
    assert "eager fp32" in capsys.readouterr().out and out.exists()
