"""scripts/gpu_check.py helpers that run without a GPU (the GPU steps themselves need one)."""

import importlib.util
import os
import shutil
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


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_gpu_session_dry_run_packs_at_most_eight_files(tmp_path):
    """scripts/gpu_session.sh's dry run (CPU): the tiny sampling protocol into OUTDIR, the kernel
    table's step reached (it stops at its preflight without a GPU) and its logs packed."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernel table would run for real")
    root = Path(__file__).resolve().parents[1]
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, WORK=str(work), GPU_SESSION_DRY="1")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_session.sh"), str(out), "120"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_session.tar.gz", "sampling_log.json", "parts.tar.gz", "mnist_joint.npy"} <= set(files)
    assert "sampling exit 0" in proc.stdout and "kernel table exit 2" in proc.stdout
    assert "cannot run here" in proc.stdout
