"""scripts/gpu_session.sh, the one-call GPU session, on a CPU: its dry run (GPU_SESSION_DRY=1) and
its failure handling (GPU_SESSION_SIMULATE replaces steps by failing, hanging or flooding stand-ins).
Whatever fails, the session must end before its budget, leave no process behind, and leave at most
8 files of at most 16 MB in OUTDIR, the logs among them.  The three sessions run side by side."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES, MAX_BYTES = 8, 16 * 2**20

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or any(shutil.which(t) is None for t in ("bash", "tar", "timeout", "base64", "truncate")),
    reason="needs Linux with bash and GNU coreutils",
)

SCENARIOS = {
    # the dry run: every step for real, on the CPU
    "ok": (120, {"ONLY": "et_score_iso_2"}),
    # every step hangs or fails: each is cut at its share, the session still ends in time
    "hang": (24, {"SAMPLE_SHARE": "0.3",
                  "GPU_SESSION_SIMULATE": "install=hang,check=fail,build=hang,sample=hang,pack=fail,table=hang"}),
    # a 32 MB install log, a build and a sampling that fail, a table that aborts after 3 rows
    "crash": (60, {"ONLY": "et_score_iso_2", "LOG_CAP": "100000", "GPU_CHECK_CRASH_AFTER_ROWS": "3",
                   "GPU_SESSION_SIMULATE": "install=spew,check=fail,build=fail,sample=fail"}),
}


def _leftovers(token: str):
    """Processes whose environment holds ``token`` (the session's, and its children's)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if token.encode() in env.read_bytes():
                found.append(env.parent.name)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu_session")
    runs = {}
    for name, (budget, extra) in SCENARIOS.items():
        token = uuid.uuid4().hex
        env = dict(os.environ, PYTHON=sys.executable, WORK=str(base / f"{name}_work"), GPU_SESSION_DRY="1",
                   GPU_SESSION_TEST_TOKEN=token, **extra)
        out = base / name
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_session.sh"), str(out), str(budget)], cwd=base,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs[name] = (proc, time.time(), budget, out, token)
    ended = {}

    def wait(name):  # one thread a session, so that each one's end is timed
        proc, t0, budget = runs[name][:3]
        stdout, _ = proc.communicate(timeout=budget + 60)
        ended[name] = (stdout, time.time() - t0)

    threads = [threading.Thread(target=wait, args=(name,)) for name in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)
    results = {}
    for name, (proc, t0, budget, out, token) in runs.items():
        stdout, wall = ended[name]
        logs = {}
        tarball = out / "gpu_session.tar.gz"
        if tarball.is_file():
            with tarfile.open(tarball) as tar:
                logs = {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        results[name] = dict(rc=proc.returncode, stdout=stdout, wall=wall, budget=budget, out=out, logs=logs,
                             files={p.name: p for p in out.iterdir()}, leftovers=_leftovers(token))
    return results


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_session_ends_in_time_with_at_most_eight_small_files(sessions, name):
    s = sessions[name]
    assert s["rc"] == 0, s["stdout"]
    assert s["wall"] < s["budget"], s["stdout"]
    assert not s["leftovers"], f"processes left running: {s['leftovers']}"
    assert 1 <= len(s["files"]) <= MAX_FILES and all(p.is_file() for p in s["files"].values())
    assert all(p.stat().st_size <= MAX_BYTES for p in s["files"].values())
    session_log = s["logs"]["session.log"].decode()
    assert "done at" in session_log and "card:" in session_log
    assert "python:" in s["logs"]["env.log"].decode()


def test_dry_run_samples_installs_checks_and_tables(sessions):
    s = sessions["ok"]
    assert {"gpu_session.tar.gz", "sampling_log.json", "parts.tar.gz", "mnist_joint.npy", "progress.npz"} <= set(s["files"])
    assert "sampling: exit 0" in s["stdout"] and "kernel table: exit 0" in s["stdout"], s["stdout"]
    assert "install (pip --dry-run): exit 0" in s["stdout"]
    env_log = s["logs"]["env.log"].decode()
    assert "torch" in env_log and "card: " in env_log and "pip" in env_log
    results = json.loads(s["logs"]["gpu_check/results.json"])
    timed = {r["backend"] for r in results["gpu_benchmarks"] if "median_ms" in r}
    assert timed == {"reference", "cpu"} and results["env"]["device"] == "CPU (dry run)"
    assert not results["failed"]
    assert "| et_score_iso_2 | cpu |" in s["stdout"]  # the table is printed where the call's output tail shows it


def test_hanging_steps_are_cut_at_their_share(sessions):
    s = sessions["hang"]
    session_log = s["logs"]["session.log"].decode()
    for step in ("install (pip --dry-run)", "sampling", "extension build", "kernel table"):
        assert f"{step}: cut at its" in session_log, session_log
    assert "no pack from gpu_sample" in session_log


def test_failures_leave_the_logs_a_bounded_install_log_and_the_partial_table(sessions):
    s = sessions["crash"]
    session_log = s["logs"]["session.log"].decode()
    assert "sampling: exit 3" in session_log and "extension build: exit 3" in session_log
    assert "kernel table: exit 134" in session_log  # (SIGABRT)
    # the sampling crashed before packing: --pack-only packed the (empty) work folder
    log = json.loads((s["out"] / "sampling_log.json").read_text())
    assert len(log["missing"]) == 3 and log["device"].startswith("not read")
    # the 32 MB install log: its head and tail
    install = s["logs"]["install.log"]
    assert len(install) <= 100_000 + 200 and b"bytes cut here" in install
    assert install.rstrip().endswith(b"the last line of the install step")
    # the table's rows up to the abort
    results = json.loads(s["logs"]["gpu_check/results.json"])
    assert len(results["gpu_benchmarks"]) == 3 and results["env"]["device"] == "CPU (dry run)"
    assert "aborting" in s["logs"]["gpu_check/gpu_check.log"].decode()


# ----------------------------------------------------------------------------- the sampling pack

def test_pack_keeps_to_its_file_count_and_pack_only_needs_no_posterior(tmp_path):
    """Five finished paths and --max-files 7 (the session keeps one place for its logs): four
    pooled files beside progress.npz, sampling_log.json and parts.tar.gz, the fifth inside the
    tarball; --pack-only packs the same folder without a posterior or CUDA."""
    from experiments.mnist import gpu_sample, sampling

    protocol = dataclasses.replace(sampling.TINY, paths=sampling.PATHS)
    work, pack_dir = tmp_path / "work", tmp_path / "pack"
    parts = work / sampling.PARTS_DIR
    parts.mkdir(parents=True)
    for path in protocol.paths:
        np.save(work / f"{path}.npy", np.zeros((6, 28, 28), np.uint8))
        for seed in protocol.seeds:
            stem = sampling.part_stem(path, seed)
            (parts / f"{stem}.json").write_text(json.dumps({"path": path, "seed": seed}))
            np.save(parts / f"{stem}_progress.npy", np.zeros((3, 9, 4), np.float32))
    log = gpu_sample.Log(work / "driver.log", False)
    written = gpu_sample.pack(work, pack_dir, protocol, None, log, max_files=7, device="test")
    names = sorted(p.name for p in written)
    assert len(names) == 7 and sorted(p.name for p in pack_dir.iterdir()) == names
    summary = json.loads((pack_dir / "sampling_log.json").read_text())
    (inside,) = summary["pooled_in_parts_tar"]
    assert inside not in names and summary["missing"] == []
    with tarfile.open(pack_dir / "parts.tar.gz") as tar:
        members = tar.getnames()
    assert inside in members and f"{sampling.PARTS_DIR}/{sampling.part_stem(protocol.paths[0], protocol.seeds[0])}.json" in members

    again = tmp_path / "again"
    rc = gpu_sample.main(["--dry-run", "--pack-only", "--work", str(work), "--pack-dir", str(again), "--max-files", "7",
                          "--paths", *protocol.paths])
    assert rc == 0 and sorted(p.name for p in again.iterdir()) == names
    assert json.loads((again / "sampling_log.json").read_text())["device"].startswith("not read")
    assert gpu_sample.main(["--dry-run", "--pack-only", "--work", str(work), "--pack-dir", str(again),
                            "--max-files", "2"]) == 2
