"""csrc/common/fastmath.h (the vectorizable exp/log/pow of the CPU kernels) against libm.

The header is plain C++, so the check is a small program compiled with the extension's CPU
flags and run here on fresh random inputs; the float64 versions carry the float64 IS reference
(is_score) and every float64 kernel, so they must stay within a few ulp of libm.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler on PATH (the extension build needs one too)")
    exe = tmp_path_factory.mktemp("fastmath") / "fastmath_check"
    # The flags of setup.py's CPU build (-march=native vectorizes the loops this header targets).
    cmd = [CXX, "-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
           "-I", str(ROOT / "csrc" / "common"), str(ROOT / "tests" / "cpp" / "fastmath_check.cpp"), "-o", str(exe)]
    if os.environ.get("ETWEEDIE_NATIVE", "1") != "0":
        cmd.insert(1, "-march=native")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def test_fastmath_matches_libm(checker):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; printed on failure
    proc = subprocess.run([str(checker), str(seed), "1000000"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"seed {seed}:\n{proc.stdout}{proc.stderr}"
    assert "ok" in proc.stdout.splitlines()[-1]
