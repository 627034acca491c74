"""scripts/gpu_check.py helpers that run without a GPU (the GPU steps themselves need one)."""

import importlib.util
import os

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
