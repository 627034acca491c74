"""Shared test helpers: which backends/devices run here, fresh seeds, and the quality-bar check.

Kernel results are accepted when |out − ref64| ≤ 2·|ref32 − ref64| + atol elementwise, where
ref64 is the float64 reference and ref32 the reference at the kernel's precision (the
flash-attention criterion, DESIGN §8).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import etweedie

# Backends under test besides the reference, on this machine.
KERNEL_BACKENDS = [name for name, (ok, _) in etweedie.backends.available().items() if ok and name != "reference"]
# Triton is only exercised on CPU tensors in interpreter mode.
if "triton" in KERNEL_BACKENDS and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    KERNEL_BACKENDS.remove("triton")

# 16-bit posterior draws the score ops accept besides y's dtype (etweedie/ops/_args.py).
LOW_PRECISION = [torch.bfloat16, torch.float16]
LOW_PRECISION_IDS = ["bf16", "fp16"]

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def backend_device_pairs():
    """(backend, device) pairs a kernel can run on here."""
    pairs = []
    for dev in DEVICES:
        for name in KERNEL_BACKENDS:
            if name == "cpu" and dev.type != "cpu":
                continue
            if name == "cuda" and dev.type != "cuda":
                continue
            if name == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                continue  # compiled Triton needs CUDA tensors; CPU tensors only in interpreter mode
            pairs.append((name, dev))
    return pairs


BACKEND_DEVICE = backend_device_pairs()
BACKEND_IDS = [f"{b}-{d.type}" for b, d in BACKEND_DEVICE]


@pytest.fixture
def seed():
    """A fresh seed per test (reported on failure via the test's messages)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


@pytest.fixture
def no_value_reads(monkeypatch):
    """A call that switches value reads off for the rest of the test, as a GPU tensor sees them
    without debug checks: ``value_checks`` (etweedie/ops/_debug.py) answers False in every
    etweedie module that uses it, so nothing is read back to the host."""
    from etweedie.ops._debug import value_checks

    def off():
        for name, mod in list(sys.modules.items()):
            if name.startswith("etweedie") and getattr(mod, "value_checks", None) is value_checks:
                monkeypatch.setattr(mod, "value_checks", lambda t: False)

    return off


def gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def assert_close_to_ref(out, ref32, ref64, *, name: str, seed: int, atol_scale: float = 1e-5, atol_floor: float = 0.0,
                        rounded_to=None):
    """|out − ref64| ≤ 2|ref32 − ref64| + atol, atol = max(atol_scale·max|ref64|, atol_floor) (+tiny).

    ``atol_floor`` is for outputs that are differences of much larger terms (float32 rounding
    scales with the terms, not with the result).  ``rounded_to``: a dtype both out and ref32 are
    rounded to at the end (the gradient of 16-bit draws, computed in float32 and stored in the
    draws' dtype); the bound then allows the 3/2 ulp of that dtype the two final roundings can
    add (half an ulp each, and the factor 2 on ref32's)."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    out64, ref32_64 = out.detach().double().cpu(), ref32.detach().double().cpu()
    ref64 = ref64.detach().cpu()
    assert torch.isfinite(out64).all(), f"{name}: non-finite values (seed {seed})"
    atol = atol_scale * float(ref64.abs().max()) if ref64.numel() else 0.0
    atol = max(atol, atol_floor, 1e-30)
    err = (out64 - ref64).abs()
    bound = 2 * (ref32_64 - ref64).abs() + atol
    if rounded_to is not None:
        info = torch.finfo(rounded_to)
        bound = bound + 1.5 * torch.clamp(info.eps * ref64.abs(), min=info.smallest_normal * info.eps)
    worst = float((err - bound).max()) if err.numel() else -1.0
    assert bool((err <= bound).all()), (
        f"{name}: max |out-ref64| = {float(err.max()):.3e} exceeds 2|ref32-ref64|+atol by {worst:.3e} "
        f"(atol {atol:.2e}, seed {seed})"
    )


def assert_low_precision_close(out, grads, refs32, refs64, grad_names, *, what: str, x_dtype, seed: int,
                               y_dtype=torch.float32):
    """A call with 16-bit draws x against the reference on the same rounded draws: the output is
    in y's dtype and within :func:`assert_close_to_ref` of the float64 reference, every gradient
    is in its input's dtype (x's for ∂L/∂x, rounded once to it) and within the bound as well.
    ``refs32``/``refs64``: (output, gradients) of the reference in y's dtype and in float64;
    ``what``: the output's name with its tag, e.g. ``"score[torch.bfloat16 block2]"``."""
    (out32, grads32), (out64, grads64) = refs32, refs64
    tag = what[what.index("["):] if "[" in what else ""
    assert out.dtype == y_dtype, f"{what}: dtype {out.dtype}, expected {y_dtype}"
    assert_close_to_ref(out, out32, out64, name=what, seed=seed)
    for name, a, b, c in zip(grad_names, grads, grads32, grads64):
        want = x_dtype if name == "x" else y_dtype
        assert a.dtype == want, f"grad {name}{tag}: dtype {a.dtype}, expected {want}"
        assert_close_to_ref(a, b, c, name=f"grad {name}{tag}", seed=seed, atol_scale=3e-5,
                            rounded_to=x_dtype if name == "x" else None)


def random_metric(kind: str, B: int, d: int, g: torch.Generator, dtype=torch.float64, per_row: bool = True):
    """A random SPD metric of the given kind; per-row (batch B) or shared."""
    shape = (B,) if per_row else ()
    if kind == "none":
        return None
    if kind == "isotropic":
        return etweedie.Metric.isotropic(0.5 + torch.rand(shape, generator=g, dtype=dtype))
    if kind == "diagonal":
        return etweedie.Metric.diagonal(0.5 + torch.rand(*shape, d, generator=g, dtype=dtype))
    if kind.startswith("block"):
        k = int(kind[5:])
        A = torch.randn(*shape, k, k, generator=g, dtype=dtype)
        S = A @ A.transpose(-1, -2) / k + 0.5 * torch.eye(k, dtype=dtype)
        return etweedie.Metric.block(S)
    if kind == "dense":
        A = torch.randn(*shape, d, d, generator=g, dtype=dtype)
        return etweedie.Metric.dense(A @ A.transpose(-1, -2) / d + 0.5 * torch.eye(d, dtype=dtype))
    raise ValueError(kind)


def metric_to(metric, dtype, device="cpu", requires_grad=False):
    """Copy a metric's parameter to dtype/device as a fresh leaf (for gradient checks)."""
    if metric is None:
        return None, None
    p = metric.param.detach().to(dtype=dtype, device=device).clone().requires_grad_(requires_grad)
    return etweedie.Metric(metric.kind, p), p


# ----------------------------------------------------------------------------- Triton interpreter
# Triton decides compiled-vs-interpreted when a function is defined (its own library functions
# included, and torch imports triton at start-up), so TRITON_INTERPRET=1 must be set when the
# process starts.  A Triton test file skips its cases in a normal run, and its driver test
# (INTERPRETER_DRIVER) reruns the file in a fresh process with the variable set.
TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_DRIVER = "test_cases_under_the_interpreter"


def skip_unless_interpreting(request) -> None:
    """For an autouse fixture of a Triton test file: skip every case but the driver outside the interpreter."""
    if not TRITON_INTERPRETING and request.node.originalname != INTERPRETER_DRIVER:
        pytest.skip(f"needs TRITON_INTERPRET=1 from process start; run by {INTERPRETER_DRIVER} in a subprocess")


def run_file_under_interpreter(test_file: str) -> None:
    """The driver: rerun ``test_file`` with TRITON_INTERPRET=1 and require that its cases passed."""
    import subprocess
    import sys

    if TRITON_INTERPRETING:
        pytest.skip("already running under TRITON_INTERPRET=1")
    ok, why = etweedie.backends.available()["triton"]
    if not ok and "not installed" in why:
        pytest.skip(why)
    here = os.path.dirname(os.path.abspath(test_file))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.basename(test_file)],
        cwd=here, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"Triton interpreter cases failed (rc {proc.returncode}):\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "error" not in summary, tail  # only the driver itself skips there


# ---------------------------------------------------------------- standalone C++ checkers (tests/cpp)
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
CHECKER_FLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]

# -march levels for the checkers and the /proc/cpuinfo flags each needs: the build's own flags,
# then the paths other CPUs take, where this one can run them: AVX2 only, AVX-512 without
# AVX512-BF16, and no vector ISA at all.
ISA_LEVELS = {
    "build": (),
    "x86-64": (),
    "haswell": ("avx2", "fma", "f16c"),
    "skylake-avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
}


def cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def checker_command(level: str, source: str, exe, *, defines=()) -> list:
    """The g++ command that builds the standalone checker tests/cpp/<source> into ``exe`` at an ISA
    level of :data:`ISA_LEVELS` (with the extension's CPU flags; csrc/common and csrc/cpu on the
    include path), or pytest.skip where :func:`march_flags` says so."""
    root = Path(__file__).resolve().parents[1]
    return [CXX, *march_flags(level), *CHECKER_FLAGS, *defines, "-I", str(root / "csrc" / "common"), "-I",
            str(root / "csrc" / "cpu"), str(root / "tests" / "cpp" / source), "-o", str(exe)]


def march_flags(level: str) -> list:
    """The -march flag of an ISA level (the extension's own for "build"), or pytest.skip where
    there is no compiler or this CPU cannot run that level's code."""
    if CXX is None:
        pytest.skip("no C++ compiler on PATH (the extension build needs one too)")
    if level == "build":
        return ["-march=native"] if os.environ.get("ETWEEDIE_NATIVE", "1") != "0" else []
    if not os.uname().machine.startswith("x86"):
        pytest.skip("the other ISA levels are x86 ones")
    missing = set(ISA_LEVELS[level]) - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run -march={level} code (lacks {sorted(missing)})")
    return [f"-march={level}"]
