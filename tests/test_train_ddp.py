"""``torchrun --nproc_per_node=2 -m etweedie train`` on the CPU (gloo): DistributedDataParallel
training whose steps equal the one-process steps at the same global batch, whose loss falls, and
which resumes after a SIGKILL of the whole process group."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from etweedie.training import load_config, load_posterior, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "eight_gaussians_tiny.toml"

pytestmark = pytest.mark.skipif(
    not Path("/proc").is_dir() or not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs Linux /proc (to kill the workers) and torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(config: Path, out: Path) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", "-m", "etweedie", "train", "--config", str(config), "--out", str(out),
            "--no-progress"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _process_tree(pid: int) -> list:
    """pid and all its descendants (Linux /proc): torchrun starts its workers in their own sessions,
    so killing the launcher's process group would leave them running."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def _log(out: Path) -> list:
    path = out / "train_log.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def test_two_process_training_matches_one_process_and_resumes_after_kill(tmp_path):
    text = TINY.read_text().replace("steps = 60", "steps = 3000").replace("log_every = 10", "log_every = 1")
    text = text.replace("checkpoint_every = 20", "checkpoint_every = 1")
    cfg_path = tmp_path / "ddp.toml"
    cfg_path.write_text(text)
    config = load_config(cfg_path)
    out = tmp_path / "ddp"

    # 1. two processes, killed (SIGKILL to the launcher and both workers) after a few steps
    proc = subprocess.Popen(_torchrun(cfg_path, out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while len(_log(out)) < 5 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    for pid in reversed(_process_tree(proc.pid)):  # workers first, then the launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output = proc.communicate()[0].decode(errors="replace")
    killed_at = torch.load(out / "checkpoint.pt", weights_only=True)
    cross = tmp_path / "cross"  # the two-process checkpoint, to be resumed by one process
    cross.mkdir()
    (cross / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    k = killed_at["step"]
    assert 1 <= k < config.steps, output
    finish = k + 40  # the resumed runs end here (steps is a resumable change)
    assert killed_at["world_size"] == 2

    # 2. the same steps in one process: after k steps (and after step 1) the weights agree
    one = tmp_path / "one"
    single_k = train(config, one, progress=False, stop_after=k)
    assert single_k["step"] == k
    ref = torch.load(one / "checkpoint.pt", weights_only=True)
    for name, value in ref["model"].items():
        torch.testing.assert_close(killed_at["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(torch.equal(ref["generators"][s], killed_at["generators"][s]) for s in ref["generators"])
    log1, log2 = _log(one), _log(out)
    assert log2[0]["step"] == 1 and abs(log2[0]["loss"] - log1[0]["loss"]) < 1e-6  # step 1: same loss

    # 3. the same command resumes from the rank-0 checkpoint and finishes; loss falls
    done = subprocess.run(_torchrun(cfg_path, out) + ["--steps", str(finish)], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from step {k}" in done.stdout and "on 2 processes" in done.stdout
    rows = _log(out)
    assert [r["step"] for r in rows] == list(range(1, finish + 1))
    # step 1 ≈ 1.66; the tiny model settles near 1.1–1.2 within a few dozen steps (batch noise ± 0.1)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-20:]) / 20
    assert last < 0.85 * first, (first, last)

    # 4. any world size resumes it: one process continues the two-process checkpoint to the end
    #    and lands on the two-process weights up to float rounding
    single = train(dataclasses.replace(config, steps=finish), cross, progress=False)
    assert single["resumed_from"] == k
    a, b = load_posterior(single["posterior"]).state_dict(), load_posterior(out).state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_an_out_that_is_a_file_is_one_line_on_every_rank(tmp_path):
    """Only rank 0 checks --out; the other ranks learn of its failure and exit 2 with it, rather than
    dying inside the next collective with a gloo traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    done = subprocess.run(_torchrun(TINY, afile), env=_env(), capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode != 0
    # rank 0's line; rank 1 exits 2 with its own line unless torchrun's SIGTERM (sent once rank 0
    # has exited) is first — never a crash inside a collective (exit 1 with a gloo error)
    assert "etweedie train: error: out_dir" in text and "is not a writable directory" in text, text
    assert "exitcode  : 1" not in text, text
    assert "gloo" not in text.lower() and "Connection" not in text, text
