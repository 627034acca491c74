"""Bad command lines of the reproduction scripts under experiments/: one line ``PROG: error: ...`` on
stderr naming the flag as typed, exit status 2, and nothing done first (no output, no files, no
sampling) -- never a traceback, a crash or a silent run."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest

from experiments import _cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SCORE_TINY = str(CONFIGS / "score_eval_tiny.toml")
TRAIN_TINY = str(CONFIGS / "eight_gaussians_tiny.toml")
TINY_ESTIMATE = (
    "replicates = 1\n[data]\nn_estimation = 24\nn_heldout = 16\nbank_size = 2000\n"
    "[sources]\nscore = [\"oracle\"]\nposterior = [\"oracle\"]\n"
    "[estimator]\nn_posterior = 16\nsteps = 5\n"
    "[score_net]\ntrain_per_level = 64\nsteps = 5\nbatch_size = 32\n"
)
# a folder nobody can create, root included (os.access says yes to root everywhere)
UNWRITABLE = "/proc/etweedie-no-such-folder/out"
needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc for an uncreatable folder")


@pytest.fixture
def files(tmp_path):
    """Config files: a tiny estimation config, one not UTF-8, one not TOML."""
    (tmp_path / "tiny_estimate.toml").write_text(TINY_ESTIMATE)
    (tmp_path / "not_utf8.toml").write_bytes(b"steps = \xff\n")
    (tmp_path / "not_toml.toml").write_text("steps = [\n")
    return tmp_path


def _fill(argv, files):
    return [str(a).replace("{tmp}", str(files)) for a in argv]


def _one_line(capsys, prog, *words):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert "Traceback" not in captured.err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert captured.out == "", captured.out  # nothing printed: no table header, no progress, no results
    return lines[0]


def _files_under(folder: Path):
    return sorted(p.relative_to(folder) for p in folder.rglob("*"))


# (module, argv, words of the one line); {tmp} is the test's folder of config files
RUN_STYLE = [  # main(argv) returns the status
    ("eight_gaussians.score_eval", ["--config", SCORE_TINY, "--oracle", "--out", UNWRITABLE],
     ["--out", UNWRITABLE, "cannot be created"]),
    ("eight_gaussians.score_eval", ["--config", SCORE_TINY, "--oracle", "--out", ""], ["--out", "empty string"]),
    ("eight_gaussians.score_eval", ["--config", SCORE_TINY, "--checkpoint", "/nonexistent"],
     ["--checkpoint /nonexistent", "no posterior"]),
    ("eight_gaussians.score_eval", ["--config", "{tmp}/not_utf8.toml", "--oracle"], ["--config", "not_utf8.toml", "not UTF-8"]),
    ("eight_gaussians.score_eval", ["--config", SCORE_TINY, "--oracle", "--seed", "-1"], ["--seed", ">= 0", "-1"]),
    ("eight_gaussians.estimation", ["--config", "{tmp}/tiny_estimate.toml", "--out", UNWRITABLE], ["--out", "cannot be created"]),
    ("eight_gaussians.estimation", ["--config", "{tmp}/tiny_estimate.toml", "--threads", "100000"],
     ["--threads", "1024", "100000"]),
    ("eight_gaussians.estimation", ["--config", "{tmp}/tiny_estimate.toml", "--replicates", "0"], ["--replicates", ">= 1"]),
    ("eight_gaussians.estimation", ["--config", "/nonexistent.toml"], ["--config /nonexistent.toml", "no such file"]),
    ("eight_gaussians.estimation", ["--config", "{tmp}/not_toml.toml"], ["--config", "not_toml.toml", "not valid TOML"]),
    ("eight_gaussians.estimation", ["--config", "{tmp}/not_utf8.toml"], ["--config", "not_utf8.toml", "not UTF-8"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--device", ""], ["--device", "empty string"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "isotropic", "--chains", "8", "--levels", "3",
                                   "--r-max", "1e200"], ["--r-max must be <= 1000000.0, got 1e+200"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--r-max", "nan"], ["--r-max", "finite", "nan"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--r-max", "0.001"], ["--r-min must be below --r-max"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--step-scale", "nan"], ["--step-scale", "finite", "nan"]),
    ("eight_gaussians.diffusion", ["--posterior", "known", "--path", "rotating", "--chains", "64", "--levels", "3",
                                   "--out", UNWRITABLE], ["--out", "cannot be created"]),
    ("eight_gaussians.diffusion", ["--config", "{tmp}/not_toml.toml", "--posterior", "known"],
     ["--config", "not_toml.toml", "not valid TOML"]),
    ("eight_gaussians.diffusion", ["--config", "{tmp}/not_utf8.toml", "--posterior", "known"],
     ["--config", "not_utf8.toml", "not UTF-8"]),
    ("eight_gaussians.demo", ["--quick", "--no-progress", "--out", UNWRITABLE], ["--out", "cannot be created"]),
    ("eight_gaussians.demo", ["--quick", "--no-progress", "--out", ""], ["--out", "empty string"]),
    ("mnist.cpu_protocol", ["--posterior", "untrained:16", "--protocol", "tiny", "--out", "{tmp}/o", "--threads", "2000"],
     ["--threads", "1024", "2000"]),
    ("mnist.cpu_protocol", ["--posterior", "untrained:16", "--protocol", "tiny", "--out", "{tmp}/o", "--n-posterior", "0"],
     ["--n-posterior", ">= 1"]),
    ("mnist.sampling_table", [""], ["DIRECTORY", "empty string"]),
    ("mnist.gpu_sample", ["--dry-run", "--no-bench", "--work", "{tmp}/w", "--pack-dir", UNWRITABLE], ["--pack-dir", "cannot be created"]),
    ("eight_gaussians.gpu_diffusion_tables", ["--dry-run", "--pack-dir", UNWRITABLE], ["--pack-dir", "cannot be created"]),
    ("eight_gaussians.gpu_diffusion_tables", ["--dry-run", "--threads", "0"], ["--threads", "0"]),
    ("eight_gaussians.gpu_estimation_posteriors", ["--dry-run", "--pack-dir", UNWRITABLE], ["--pack-dir", "cannot be created"]),
    ("eight_gaussians.gpu_estimation_posteriors", ["--dry-run", "--config", "{tmp}/not_utf8.toml"], ["--config", "not UTF-8"]),
]

GUARDED = [  # main(argv) raises; `python -m` runs it under _cli.guarded
    ("mnist.final_step_check", ["--n-boot", "0"], ["--n-boot", ">= 2", "0"]),
    ("mnist.final_step_check", ["--threads", "0"], ["--threads", "1024", "0"]),
    ("mnist.final_step_check", ["--json", ""], ["--json", "empty string"]),
    ("bootstrap_intervals.coverage", ["--n-boot", "0"], ["--n-boot", ">= 2"]),
    ("bootstrap_intervals.coverage", ["--datasets", "0"], ["--datasets", ">= 1"]),
    ("bootstrap_intervals.energy_distance_shift", ["--n-boot", "-1"], ["--n-boot", ">= 2", "-1"]),
    ("eight_gaussians.sampler_throughput", ["--chains", "0"], ["--chains", ">= 1", "0"]),
    ("eight_gaussians.sampler_throughput", ["--levels", "99"], ["--levels", "<= 51", "99"]),
    ("posterior_quality.quality", [""], ["PATH", "empty string"]),
    ("posterior_quality.architecture_ablation", ["--config", TRAIN_TINY, "--variant", "film", "--out", "{tmp}/abl"],
     ["--variant", "conditioning:output"]),
    ("posterior_quality.architecture_ablation", ["--config", TRAIN_TINY, "--variant", "film:scaled_residual:x",
                                                 "--out", "{tmp}/abl"], ["--variant", "width"]),
    ("posterior_quality.architecture_ablation", ["--config", TRAIN_TINY, "--variant", "film:scaled_residual",
                                                 "--out", UNWRITABLE], ["--out", "cannot be created"]),
    ("posterior_quality.architecture_ablation", ["--config", "{tmp}/not_utf8.toml", "--variant", "film:scaled_residual",
                                                 "--out", "{tmp}/abl"], ["--config", "not_utf8.toml"]),
    ("mnist.posterior_figure", ["--threads", "5000"], ["--threads", "1024", "5000"]),
    ("mnist.posterior_figure", ["--out", ""], ["--out", "empty string"]),
    ("mnist.posterior_figure", ["--step-ratio", "nan"], ["--step-ratio", "finite"]),
    ("mnist.bank_posterior_check", ["--out", UNWRITABLE], ["--out", "cannot be created"]),
    ("mnist.bank_posterior_check", ["--out", "{tmp}/bank", "--chains", "0"], ["--chains", ">= 1"]),
    ("mnist.posterior_ablation", ["--arms", "bogus", "--out", "{tmp}/pa"], ["--arms", "bogus"]),
    ("mnist.posterior_ablation", ["--threads", "0", "--out", "{tmp}/pa"], ["--threads", "0"]),
    ("mnist.export_pretrained", ["--run", "{tmp}", "--dest", "{tmp}/d", "--command", "x", "--threads", "0"], ["--threads"]),
    ("mnist.export_pretrained", ["--run", "{tmp}", "--dest", "{tmp}/d", "--command", "x"], ["--run", "posterior/config.json"]),
    ("mnist.pixel_scale", ["--data-dir", ""], ["--data-dir", "empty string"]),
    ("estimation_diagnostics.posterior_tails", ["--sigmas", "0.1", "nan"], ["--sigmas", "finite", "nan"]),
    ("estimation_diagnostics.posterior_tails", ["--json", UNWRITABLE + ".json"], ["--json", "cannot be created"]),
    ("estimation_diagnostics.per_level_beta", ["--config", "{tmp}/not_toml.toml", "--posterior-checkpoint", "/nonexistent"],
     ["--config", "not valid TOML"]),
    ("estimation_diagnostics.per_level_beta", ["--config", "{tmp}/tiny_estimate.toml", "--posterior-checkpoint", "/nonexistent"],
     ["--posterior-checkpoint /nonexistent"]),
    ("estimation_diagnostics.score_net_accuracy", ["--config", "{tmp}/tiny_estimate.toml", "--set", "nosuchkey=1"],
     ["--set", "nosuchkey"]),
    ("estimation_diagnostics.score_net_accuracy", ["--config", "{tmp}/not_utf8.toml"], ["--config", "not UTF-8"]),
]


def _skip_without_proc(argv):
    if any(UNWRITABLE in a for a in argv) and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc for an uncreatable folder")


@pytest.mark.parametrize("module, argv, words", RUN_STYLE, ids=[f"{m}:{' '.join(a[-2:])}" for m, a, _ in RUN_STYLE])
def test_run_style_scripts_refuse_bad_flags_at_once(module, argv, words, files, capsys, monkeypatch):
    _skip_without_proc(argv)
    monkeypatch.chdir(files)  # a default output folder, if one were made, lands here
    mod = importlib.import_module(f"experiments.{module}")
    before = _files_under(files)
    capsys.readouterr()
    start = time.perf_counter()
    assert mod.main(_fill(argv, files)) == 2
    assert time.perf_counter() - start < 10
    prog = "cpu_protocol" if module == "mnist.cpu_protocol" else "sampling_table" if module == "mnist.sampling_table" \
        else "gpu_sample" if module == "mnist.gpu_sample" else f"python -m experiments.{module}"
    _one_line(capsys, prog, *[w.replace("{tmp}", str(files)) for w in words])
    after = [p for p in _files_under(files) if p not in before]
    assert not [p for p in after if p.parts[0] not in ("o", "w")], after  # only a checked --out/--work folder, empty
    assert not [p for p in after if len(p.parts) > 1], after


@pytest.mark.parametrize("module, argv, words", GUARDED, ids=[f"{m}:{' '.join(a[-2:])}" for m, a, _ in GUARDED])
def test_study_scripts_refuse_bad_flags_at_once(module, argv, words, files, capsys, monkeypatch):
    _skip_without_proc(argv)
    monkeypatch.chdir(files)
    mod = importlib.import_module(f"experiments.{module}")
    before = _files_under(files)
    capsys.readouterr()
    prog = f"python -m experiments.{module}"
    start = time.perf_counter()
    assert _cli.guarded(prog, lambda: mod.main(_fill(argv, files))) == 2
    assert time.perf_counter() - start < 10
    _one_line(capsys, prog, *words)
    assert _files_under(files) == before  # nothing written (the checks come before any folder is made)


# ---------------------------------------------------------------------------- the helpers themselves
@needs_proc
def test_out_dir_is_really_tried_not_os_access(tmp_path):
    """root passes every os.access check; the folder is created and a probe written instead."""
    with pytest.raises(_cli.UsageError, match=r"^--out /proc/x cannot be created"):
        _cli.out_dir("--out", "/proc/x")
    with pytest.raises(_cli.UsageError, match=r"^--out /proc cannot be created or written"):
        _cli.out_dir("--out", "/proc")  # exists, but nothing can be written there
    _cli.out_dir("--out", str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # the probe is gone


def test_empty_and_file_outputs_are_refused(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    for check, flag in ((_cli.out_dir, "--out"), (_cli.out_file, "--json")):
        with pytest.raises(_cli.UsageError, match=f"^{flag} must be .*got an empty string"):
            check(flag, "")
    with pytest.raises(_cli.UsageError, match="is a file"):
        _cli.out_dir("--out", str(afile))
    with pytest.raises(_cli.UsageError, match="cannot be created: .* is a file"):
        _cli.out_dir("--out", str(afile / "sub"))
    with pytest.raises(_cli.UsageError, match="is a folder"):
        _cli.out_file("--json", str(tmp_path))
    _cli.out_file("--json", str(tmp_path / "new" / "r.json"))
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "r.json").exists()


def test_thread_counts_are_bounded():
    for bad in (0, -1, 1025, 100000):
        with pytest.raises(_cli.UsageError, match=r"^--threads must be an integer from 1 to 1024"):
            _cli.threads("--threads", bad)
    _cli.threads("--threads", 0, zero_ok=True)
    _cli.threads("--threads", 1024)
    _cli.threads("--threads", None)


def test_config_read_errors_name_the_flag_and_file(files):
    import tomllib

    def loader(path):
        with open(path, "rb") as fh:
            return tomllib.load(fh)

    for name, words in (("not_utf8.toml", "not UTF-8 text"), ("not_toml.toml", "not valid TOML"),
                        ("missing.toml", "no such file"), ("", "must be a TOML file")):
        path = str(files / name) if name else ""
        with pytest.raises(_cli.UsageError) as exc:
            _cli.read_config("--config", path, loader)
        assert str(exc.value).startswith(f"--config {path}".strip()) and words in str(exc.value), str(exc.value)
    with pytest.raises(_cli.UsageError, match="is a folder"):
        _cli.read_config("--config", str(files), loader)


def test_a_refused_run_leaves_no_empty_out_folder(tmp_path, capsys):
    """--out is created before the run (a path that cannot hold it fails at once); a run refused
    after that (here a config with an unknown key) removes the folder it made, if still empty."""
    from experiments.eight_gaussians import score_eval

    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n")
    out = tmp_path / "new"
    assert score_eval.main(["--config", str(bad), "--oracle", "--out", str(out)]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert score_eval.main(["--config", str(bad), "--oracle", "--out", str(kept)]) == 2
    assert kept.is_dir()  # a folder that was there before stays


def test_sizes_beyond_memory_are_one_line(capsys, monkeypatch):
    """``--chains 1000000000`` asked the allocator for 37 GiB in one tensor: a traceback
    (RuntimeError from torch's CPU allocator); now one line naming the size, status 2.  Other
    RuntimeErrors still propagate (they are bugs, not a user's sizes)."""
    import torch

    assert _cli.guarded("prog", lambda: torch.empty(10**9, 40, dtype=torch.float64)) == 2  # 298 GiB
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prog: error: out of memory (one tensor of 298.0 GiB)"), err

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 80 GiB")

    def fresh(args):
        raise MemoryError()

    assert _cli.guarded("prog", oom) == 2
    assert capsys.readouterr().err.strip() == "prog: error: out of memory (one tensor of 20.00 GiB): the sizes asked for (chains, samples, batch) do not fit this machine; lower them"
    assert _cli.run("prog", "d", lambda p: None, fresh, []) == 2
    assert "prog: error: out of memory: the sizes" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="a bug"):
        _cli.guarded("prog", lambda: (_ for _ in ()).throw(RuntimeError("a bug")))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("module, argv, prog, words", [
    ("mnist.gpu_sample", ["--work", "{tmp}/w", "--pack-dir", "{tmp}/p"], "gpu_sample",
     "no CUDA device (use --dry-run on a CPU, or --pack-only"),
    ("eight_gaussians.gpu_diffusion_tables", ["--pack-dir", "{tmp}/p"], "python -m experiments.eight_gaussians.gpu_diffusion_tables",
     "no CUDA device: the tables run on a GPU"),
])
def test_gpu_drivers_without_a_gpu_stop_before_making_folders(module, argv, prog, words, tmp_path, capsys, monkeypatch):
    """The GPU drivers on a CPU-only machine: one line and status 2 before any folder is made
    (gpu_sample had created --work and --pack-dir first; gpu_diffusion_tables logged a traceback
    from its trainings, went on and exited 0)."""
    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module(f"experiments.{module}")
    capsys.readouterr()
    assert mod.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and words in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_of_every_script_ends_a_size_beyond_memory_in_one_line(tmp_path):
    """``python -m experiments.mnist.cpu_protocol --n-posterior 100000000000`` was a traceback from
    the allocator; the scripts whose ``main`` is not ``_cli.run`` are entered through
    ``_cli.guarded``, so it is one line and status 2."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "experiments.mnist.cpu_protocol", "--n-posterior", "100000000000",
                           "--paths", "mnist_joint", "--out", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1].startswith("cpu_protocol: error: out of memory"), done.stderr
    for script in ROOT.glob("experiments/**/*.py"):
        text = script.read_text()
        if 'if __name__ == "__main__":' in text and "_cli.run(" not in text and "sys.exit(main())" in text:
            assert "gpu" in script.name, f"{script} is entered without _cli.guarded"
