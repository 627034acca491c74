"""scripts/gpu_check.py helpers that run without a GPU (the GPU steps themselves need one)."""

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_breakdown_ranks_the_ops_of_a_call():
    """The per-row breakdown (device="cpu" profiles CPU ops, the dry run of the CUDA one): the
    heaviest op first, launches counted per call, and an "(all kernels)" total that bounds each."""
    gc = _gpu_check()
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def fn():
        return (a @ b).add_(1.0).sum()

    rows = gc.kernel_breakdown(fn, calls=3, top=3, device="cpu")
    *top, total = rows
    assert total["name"] == "(all kernels)" and 1 <= len(top) <= 3
    assert [r["us_per_call"] for r in top] == sorted((r["us_per_call"] for r in top), reverse=True)
    assert any("mm" in r["name"] for r in top)
    assert all(0 < r["us_per_call"] <= total["us_per_call"] + 1e-6 for r in top)
    assert total["launches_per_call"] >= 3  # matmul, add_, sum


def test_low_precision_ratio_lines():
    gc = _gpu_check()
    rows = [{"workload": "et_score_iso_784", "backend": "cuda", "median_ms": 0.2},
            {"workload": "et_score_iso_784_bf16", "backend": "cuda", "median_ms": 0.11}]
    (line,) = gc.low_precision_ratios(rows)
    assert "0.55×" in line and "met" in line


def _dry_rows(gc, **kw):
    logged = []
    rows = gc.gpu_benchmarks(logged.append, quick=True, device="cpu", **kw)
    return rows, logged


def test_dry_table_runs_on_the_cpu_and_keeps_going_past_a_failing_workload(monkeypatch):
    """--dry-run's table (tiny sizes, CPU): timed reference and cpu rows; a workload whose float64
    check raises gets one error row and the next workload still runs; every row reaches on_row."""
    gc = _gpu_check()
    real = gc._thunk

    def thunk(op, backend, *args, **kw):
        if op == "langevin_step":
            raise RuntimeError("simulated failure")
        return real(op, backend, *args, **kw)

    monkeypatch.setattr(gc, "_thunk", thunk)
    seen = []
    rows, _ = _dry_rows(gc, only=["langevin_step_block_784", "et_score_iso_2"], on_row=lambda r: seen.append(len(r)))
    timed = {(r["workload"], r["backend"]) for r in rows if "median_ms" in r}
    assert timed == {("et_score_iso_2", "reference"), ("et_score_iso_2", "cpu")}
    (bad,) = [r for r in rows if r["workload"] == "langevin_step_block_784"]
    assert "float64 check failed" in bad["error"] and "simulated failure" in bad["error"]
    assert seen == list(range(1, len(rows) + 1))
    assert all(r.get("correct", True) for r in rows)
    assert "et_score_iso_2" in gc.format_table(rows)


def test_past_the_deadline_no_row_starts():
    gc = _gpu_check()
    rows, _ = _dry_rows(gc, only=["et_score_iso_2"], deadline=time.time() - 1)
    assert rows and all(r["error"] == "not run: past the --deadline" for r in rows)


def test_a_table_that_stops_keeps_its_rows_and_names_the_device(tmp_path, monkeypatch):
    """main(): an exception mid-table leaves the rows before it in results.json (with the
    environment facts) and exits 1; the log says where it stopped."""
    gc = _gpu_check()

    def stops(log, quick, only, deadline, on_row, device):
        row = {"workload": "w", "backend": "reference", "device": "CPU (dry run)", "median_ms": 1.0, "p20_ms": 1.0,
               "p80_ms": 1.0, "host_ms": 1.0, "GB/s": 1.0, "frac_copy_bw": 0.1, "peak_extra_mib": 0.0}
        on_row([row])
        raise RuntimeError("simulated crash in the table")

    monkeypatch.setattr(gc, "gpu_benchmarks", stops)
    out = tmp_path / "gc"
    rc = gc.main(["--dry-run", "--skip-build", "--skip-tests", "--skip-cpu-table", "--skip-check-cuda", "--out", str(out)])
    assert rc == 1
    results = json.loads((out / "results.json").read_text())
    assert [r["workload"] for r in results["gpu_benchmarks"]] == ["w", "(table)"]
    assert "simulated crash" in results["gpu_benchmarks"][1]["error"] and "gpu benchmarks" in results["failed"]
    assert results["env"]["device"] == "CPU (dry run)" and results["env"]["python"] and results["env"]["torch"]
    assert "table stopped" in (out / "gpu_check.log").read_text()


def test_run_tests_cuts_a_hanging_suite_with_its_children(tmp_path):
    """The test step's --tests-timeout kills the whole process group (xdist workers too) and keeps
    the FAILED lines printed before it."""
    gc = _gpu_check()
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; echo 'FAILED tests/x.py::t - boom'; wait"]
    t0 = time.time()
    res = gc.run_tests(cmd, str(tmp_path / "tests.log"), timeout=1.0)
    assert time.time() - t0 < 10
    assert res["rc"] == "timeout" and "1 s --tests-timeout" in res["summary"]
    assert res["failures"] == ["FAILED tests/x.py::t - boom"]
    child = int(pid_file.read_text())
    for _ in range(50):  # the orphaned sleep is gone (or a zombie awaiting its reaper)
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except (FileNotFoundError, IndexError):
            break
        if state in "ZX":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the test step's child {child} outlived the timeout")


@pytest.mark.parametrize("script, argv, words", [
    ("gpu_check.py", ["--bogus"], "gpu-check: error: unrecognized arguments: --bogus"),
    ("gpu_check.py", ["--deadline", "-1"], "gpu-check: error: --deadline must be a finite number of seconds > 0, got -1.0"),
    ("gpu_check.py", ["--tests-timeout", "nan"], "gpu-check: error: --tests-timeout must be a finite number"),
    ("check_triton.py", ["--bogus"], "check_triton: error: unrecognized arguments: --bogus"),
    ("check_triton.py", ["--dtypes", "fp16"], "check_triton: error: --dtypes must be a comma-separated list of fp32, fp64"),
    ("check_triton.py", ["--draws", "bf16,xx"], "check_triton: error: --draws must be a comma-separated list of bf16, fp16"),
])
def test_script_usage_errors_are_one_line(script, argv, words):
    """The two GPU-side scripts report a flag they cannot use in one line with status 2, like every
    other command line of the project (argparse printed its usage block first; a negative
    --deadline and unknown dtypes went on)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(words), (proc.returncode, proc.stderr)
