"""``etweedie train`` failures a user can cause: one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from etweedie.training import RunLock
from etweedie.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "eight_gaussians_tiny.toml"


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etweedie train: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _train(*args):
    return cli(["train", "--config", str(TINY), "--no-progress", *map(str, args)])


def test_out_is_a_file(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert _train("--out", target, "--steps", "2") == 2
    _one_line_error(capsys, "is not a writable directory")
    assert target.read_text() == "x"


def test_out_under_a_file_is_unwritable(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    assert _train("--out", tmp_path / "file.txt" / "run", "--steps", "2") == 2
    _one_line_error(capsys, "is not a writable directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_device_cuda_without_cuda(tmp_path, capsys):
    assert _train("--out", tmp_path / "run", "--device", "cuda", "--steps", "2") == 2
    _one_line_error(capsys, "CUDA is not available")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_checkpoint(tmp_path, capsys, damage):
    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "20") == 0
    ckpt = out / "checkpoint.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes({"empty": b"", "truncated": data[: len(data) // 3], "garbage": b"\x80\x02garbage" * 100}[damage])
    capsys.readouterr()
    assert _train("--out", out, "--steps", "25") == 2
    _one_line_error(capsys, "checkpoint.pt")
    # starting afresh is the way out
    assert _train("--out", out, "--steps", "3", "--no-resume") == 0


def test_second_run_on_the_same_out_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with RunLock(out):  # a first run holding the directory
        assert _train("--out", out, "--steps", "2") == 2
        _one_line_error(capsys, "another training run is using")
    assert not (out / "checkpoint.pt").exists()


def test_dry_run_runs_the_config_on_the_cpu(tmp_path, capsys):
    """--dry-run: the config's path (here the bf16 + fused-Adam settings) on the CPU, every step
    logged and checkpointed, the posterior written."""
    config = TINY.read_text().replace('threads = 1', 'threads = 1\nprecision = "bf16"\nfused_adam = true\ndevice = "cuda"')
    path = tmp_path / "gpu.toml"
    path.write_text(config)
    out = tmp_path / "dry"
    assert cli(["train", "--config", str(path), "--out", str(out), "--dry-run", "3", "--no-progress"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["config"]
    assert saved["device"] == "cpu" and saved["precision"] == "bf16"
    assert (out / "posterior" / "config.json").is_file()


def test_deadline_stops_with_checkpoint_and_posterior(tmp_path, capsys):
    out = tmp_path / "late"
    assert _train("--out", out, "--deadline", "1e-9") == 0
    text = capsys.readouterr().out
    assert "stopped at the deadline" in text
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 10  # the first log step (log_every = 10)
    assert (out / "posterior" / "config.json").is_file()
    assert _train("--out", out) == 0  # no deadline: resumes and finishes
    assert "resumed from step 10" in capsys.readouterr().out


def test_dry_run_without_out_keeps_out_of_the_real_runs_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.read_text())
    assert cli(["train", "--config", str(config), "--dry-run", "2", "--no-progress"]) == 0
    assert (tmp_path / "runs" / "tiny-dry-run" / "checkpoint.pt").is_file()
    assert not (tmp_path / "runs" / "tiny").exists()


def test_load_posterior_names_a_device_it_cannot_use_and_a_bad_weights_entry(tmp_path):
    from etweedie.training import CheckpointError, load_weights
    from etweedie.training import load_posterior

    with pytest.raises(ValueError, match="device must be a device string"):
        load_posterior(tmp_path, device="tpu")
    (tmp_path / "config.json").write_text(json.dumps({"weights": "model.safetensors"}))
    with pytest.raises(CheckpointError, match="lists no weight files"):
        load_weights(tmp_path)


def test_a_missing_data_folder_is_named_as_such(tmp_path, capsys):
    config = tmp_path / "m.toml"
    config.write_text('steps = 1\nbatch_size = 2\ndraws = 2\nthreads = 1\n[data]\nsource = "mnist"\n'
                      f'data_dir = "{tmp_path / "nowhere"}"\n')
    assert cli(["train", "--config", str(config), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MNIST" in err[0] and "cannot write" not in err[0]


@pytest.mark.parametrize("damage, words", [
    (lambda ck: ck["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(7)), "optimizer state 'exp_avg'"),
    (lambda ck: ck.__setitem__("step", -5), "step must be an int >= 0"),
    (lambda ck: ck.__setitem__("wall_time", float("nan")), "wall_time and cpu_time must be finite"),
    (lambda ck: ck.__setitem__("config", ["steps", 3]), "'config' must be a dict"),
    (lambda ck: ck.__setitem__("interval_sum", "1.5"), "interval_sum must be a finite number"),
    (lambda ck: ck.__setitem__("interval_count", 99), "interval_count must be an int in [0, step=3]"),
    (lambda ck: ck.__setitem__("last_logged_loss", None), "last_logged_loss must be a number"),
    (lambda ck: ck.__setitem__("fitted_steps", "all"), "fitted_steps must be None or an int"),
    (lambda ck: next(iter(ck["model"].values())).view(-1)[0].fill_(float("nan")), "holds NaN or infinite values"),
])
def test_a_checkpoint_that_does_not_fit_is_one_line(tmp_path, capsys, damage, words):
    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "3") == 0
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    damage(ck)
    torch.save(ck, out / "checkpoint.pt")
    capsys.readouterr()
    assert _train("--out", out, "--steps", "6") == 2
    _one_line_error(capsys, "checkpoint.pt", words)


def test_a_posterior_with_nan_weights_is_a_named_error(tmp_path):
    from etweedie.training import CheckpointError
    from etweedie.training import load_posterior, save_posterior

    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "2") == 0
    model = load_posterior(out)
    name, weight = next(iter(model.state_dict().items()))
    weight.view(-1)[-1] = float("inf")
    save_posterior(model, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=f"weight '{name}' holds NaN or infinite"):
        load_posterior(tmp_path / "bad")


def test_rerunning_a_finished_run_applies_new_posterior_storage_settings(tmp_path, capsys):
    """posterior_dtype and shard_mb are resumable changes: a rerun of a finished run rewrites its
    posterior with them (and leaves it alone when nothing changed)."""
    from safetensors import safe_open

    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "3") == 0
    meta_path = out / "posterior" / "config.json"
    assert json.loads(meta_path.read_text())["train_config"]["posterior_dtype"] == "float32"
    written = meta_path.stat().st_mtime_ns
    assert _train("--out", out, "--steps", "3") == 0
    assert meta_path.stat().st_mtime_ns == written  # nothing changed: not rewritten
    half = tmp_path / "half.toml"
    half.write_text('posterior_dtype = "float16"\n' + TINY.read_text())
    assert cli(["train", "--config", str(half), "--out", str(out), "--steps", "3", "--no-progress"]) == 0
    assert json.loads(meta_path.read_text())["train_config"]["posterior_dtype"] == "float16"
    with safe_open(str(out / "posterior" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}


def test_the_deadline_is_per_invocation(tmp_path, capsys):
    """A rerun gets the whole --deadline again: a run that already trained for a long time (its
    checkpoint's cumulative wall_time) still continues to the end under a 1000 s deadline."""
    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "20") == 0
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    ck["wall_time"] = 1e6
    torch.save(ck, out / "checkpoint.pt")
    capsys.readouterr()
    assert _train("--out", out, "--deadline", "1000") == 0
    text = capsys.readouterr().out
    assert "resumed from step 20" in text and "stopped at the deadline" not in text
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 60


def test_a_config_asking_for_a_huge_network_is_refused_before_allocating(tmp_path):
    """config.json's model_config is compared with the weights' shapes on the meta device first: a
    file from elsewhere asking for width 60,000 (within the architecture's limits) is a
    CheckpointError, not a multi-GB allocation."""
    from etweedie.training import CheckpointError
    from etweedie.training import load_posterior

    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "2") == 0
    meta_path = out / "posterior" / "config.json"
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["width"] = 60_000
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="names or shapes differ from the config's network"):
        load_posterior(out / "posterior")


@pytest.mark.parametrize("flags,words", [
    (["--out", ""], ["--out must not be empty"]),
    (["--device", ""], ["--device must not be empty"]),
    (["--steps", "0"], ["--steps must be >= 1, got 0"]),
    (["--dry-run", "0"], ["--dry-run must be >= 1"]),
    (["--deadline", "nan"], ["--deadline must be a finite number of seconds"]),
    (["--fit-to-deadline"], ["--fit-to-deadline needs --deadline"]),
])
def test_flag_values_are_named(tmp_path, capsys, monkeypatch, flags, words):
    """Values the run cannot use name the flag typed (not the config key behind it) and stop
    before any work: an empty --out no longer trains into runs/<config>, --steps 0 no longer
    reports a run whose checkpoint it never wrote."""
    monkeypatch.chdir(tmp_path)
    assert _train(*flags) == 2
    _one_line_error(capsys, *words)
    assert not (tmp_path / "runs").exists()


def test_a_config_that_is_not_text(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfesteps = 3\n")
    assert cli(["train", "--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    _one_line_error(capsys, "is not UTF-8 text", "bad.toml")


def test_a_finished_run_says_there_is_nothing_left(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "3") == 0
    capsys.readouterr()
    assert _train("--out", out, "--steps", "2") == 0
    assert "nothing left to train" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["train", "--config", str(TINY), "--steps", "abc"], ["argument --steps: invalid int value: 'abc'"]),
    (["train"], ["required: --config"]),
    (["train", "--config", str(TINY), "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
])
def test_argparse_errors_are_one_line(capsys, argv, words):
    """argparse's own errors (a bad type, a missing or unknown flag) are one line too, not the
    usage block before it (etweedie.commandline.OneLineParser)."""
    assert cli(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("etweedie") and ": error: " in lines[0], err
    assert all(w in lines[0] for w in words) and lines[0].endswith("--help lists the arguments)"), lines[0]


def test_an_allocation_failure_is_one_line(capsys, monkeypatch):
    """A command whose sizes exceed the machine's memory reports it in one line, status 2 (it was
    the allocator's RuntimeError and a traceback); another RuntimeError still propagates."""
    from etweedie.commands import train

    def alloc(args):
        torch.empty(2**62, dtype=torch.uint8)

    monkeypatch.setattr(train, "cli_main", alloc)
    assert cli(["train", "--config", "eight_gaussians_cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("etweedie train: error: out of memory (one tensor of 4,294,967,296.0 GiB)"), err

    def bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(train, "cli_main", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli(["train", "--config", "eight_gaussians_cpu"])


@pytest.mark.parametrize("text,words", [
    ("lr = 1e300\n", ["lr must be in (0, 10]"]),
    ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", ["nested too deeply"]),
], ids=["lr-1e300", "nested-toml"])
def test_configs_a_user_could_write_are_one_line(tmp_path, capsys, text, words):
    bad = tmp_path / "bad.toml"
    body = "\n".join(line for line in TINY.read_text().splitlines() if not line.startswith("lr ="))
    bad.write_text(text + body if text.startswith("lr") else text)
    assert cli(["train", "--config", str(bad), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    _one_line_error(capsys, *words)


def test_a_full_disk_while_training_is_one_line(tmp_path):
    """The disk filling up while a checkpoint is written: one line, status 2 (it was torch's
    RuntimeError and a traceback); simulated by a file-size limit in a child process."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 14, 1 << 14))\n"
        "from etweedie.cli import main\n"
        f"sys.exit(main(['train', '--config', {str(TINY)!r}, '--out', {str(tmp_path / 'run')!r}, '--steps', '2', "
        "'--no-progress']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("etweedie train: error: cannot write the run directory"), lines[0]


def test_a_truncated_posterior_of_a_finished_run_is_rewritten(tmp_path, capsys):
    """Rerunning a finished run whose posterior file was damaged writes it again from the
    checkpoint (it printed "posterior written" and kept the damaged file)."""
    from etweedie.training import load_posterior

    out = tmp_path / "run"
    assert _train("--out", out, "--steps", "3") == 0
    weights = out / "posterior" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])
    assert _train("--out", out, "--steps", "3") == 0
    assert weights.read_bytes() == intact
    load_posterior(out / "posterior")
