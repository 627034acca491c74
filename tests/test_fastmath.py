"""csrc/common/fastmath.h (the vectorizable exp/log/pow of the CPU kernels) against libm.

The header is plain C++, so the check is a small program compiled with the extension's CPU
flags and run here on fresh random inputs; the float64 versions carry the float64 IS reference
(is_score) and every float64 kernel, so they must stay within a few ulp of libm.
"""

import os
import subprocess

import pytest
from conftest import checker_command


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    exe = tmp_path_factory.mktemp("fastmath") / "fastmath_check"
    # the flags of setup.py's CPU build (-march=native vectorizes the loops this header targets)
    subprocess.run(checker_command("build", "fastmath_check.cpp", exe), check=True, capture_output=True, text=True)
    return exe


def test_fastmath_matches_libm(checker):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; printed on failure
    proc = subprocess.run([str(checker), str(seed), "1000000"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"seed {seed}:\n{proc.stdout}{proc.stderr}"
    assert "ok" in proc.stdout.splitlines()[-1]
