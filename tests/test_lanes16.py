"""csrc/cpu/lanes16_cpu.h: the 16-lane loops of the CPU score kernels, in both of their forms.

The extension is built for this CPU only, so it runs one form of the loops per draw format: on
CPUs with AVX-512 the 512-bit form for bfloat16 and float16 draws and the AVX2 form for float32,
elsewhere the AVX2 form for all three — each with this CPU's conversion helpers alone.  The
per-row loops of et_score_cpu.h (forward sum and backward: ∂/∂y, the β term, ∂/∂x in the draws'
format) are plain C++, so a small program (tests/cpp/lanes16_check.cpp) runs them on fixed inputs
— float32, bfloat16 and float16 draws; isotropic, diagonal and k×k block metrics; N from 1 to 13;
d = 16, 48, 784; an exact coincidence — built at every ISA level this CPU can run: the build's
flags, the same with the AVX2 form forced (-DETWEEDIE_LANES16_AVX2), AVX2 only (haswell), AVX-512
without AVX512-BF16 (skylake-avx512: the 512-bit bfloat16 store's integer rounding), and plain
x86-64, which has no 16-lane loops and is the reference: every other level must agree with its
generic loops to the rounding of the sums' order (and of the ∂/∂x rows to the draws' format, one
unit in the last place).
"""

from __future__ import annotations

import subprocess

import pytest
from conftest import checker_command

# level -> (ISA level of conftest.ISA_LEVELS, extra defines)
LEVELS = {
    "build": ("build", []),
    "build-avx2-form": ("build", ["-DETWEEDIE_LANES16_AVX2"]),
    "haswell": ("haswell", []),
    "skylake-avx512": ("skylake-avx512", []),
}
# one unit in the last place of each draw format, relative (∂/∂x is rounded to it)
ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def _parse(text: str) -> dict:
    cases, cur = {}, None
    for line in text.splitlines():
        parts = line.split()
        if parts[0] == "case":
            cur = " ".join(parts[1:])
            cases[cur] = {}
        elif parts[0] == "in_range":
            cases[cur]["in_range"] = int(parts[1])
        elif parts[0] in ("acc", "gy", "gshape", "gx"):
            cases[cur][parts[0]] = [float.fromhex(v) for v in parts[1:]]
    return cases


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every runnable level's output (and its header line), the checkers built in parallel."""
    out_dir = tmp_path_factory.mktemp("lanes16")
    jobs = {}
    for level, (isa, defines) in {"x86-64": ("x86-64", []), **LEVELS}.items():
        exe = out_dir / f"lanes16_check_{level}"
        try:
            cmd = checker_command(isa, "lanes16_check.cpp", exe, defines=defines)
        except pytest.skip.Exception as skip:
            jobs[level] = str(skip)
            continue
        jobs[level] = (exe, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for level, job in jobs.items():
        if isinstance(job, str):
            results[level] = job
            continue
        exe, proc = job
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{level}: {err[-2000:]}"
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        header, _, body = run.stdout.partition("\n")
        results[level] = (header, _parse(body))
    return results


def test_the_reference_build_has_no_16_lane_loops(outputs):
    ref = outputs["x86-64"]
    if isinstance(ref, str):
        pytest.skip(ref)
    assert ref[0] == "lanes512 0 lanes16 0", ref[0]
    assert len(ref[1]) == 3 * 3 * 6 * 5 + 3 * 1 * 6, len(ref[1])  # + the k = 3 cases at d = 48


@pytest.mark.parametrize("level", list(LEVELS))
def test_every_form_matches_the_generic_loops(outputs, level):
    ref, got = outputs["x86-64"], outputs[level]
    for r in (ref, got):
        if isinstance(r, str):
            pytest.skip(r)
    header, cases = got
    if level == "build-avx2-form" and header == outputs["build"][0]:
        pytest.skip("the build's flags select the AVX2 form already (no AVX-512 F/BW/DQ)")
    assert header.endswith("lanes16 1") or level == "build", f"{level} did not build the 16-lane loops: {header}"
    if level == "skylake-avx512":
        assert header == "lanes512 1 lanes16 1", header
    if level in ("haswell", "build-avx2-form"):
        assert header == "lanes512 0 lanes16 1", header
    assert cases.keys() == ref[1].keys()
    for name, want in ref[1].items():
        have, fmt = cases[name], name.split()[0]
        assert have["in_range"] == want["in_range"], name
        for key in ("acc", "gy", "gx"):
            a, b = have[key], want[key]
            scale = max(abs(v) for v in b)
            # sums in another order: a few float ulps of the largest value; ∂/∂x rounded to the
            # draws' format from such sums: one unit in its last place on top
            ulp = ULP[fmt] if key == "gx" else 0.0
            bad = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 4e-6 * scale + 1.01 * ulp * abs(y)]
            assert not bad, f"{level} {name} {key}: {len(bad)} values off, first {bad[:3]} (scale {scale:g})"
        (a,), (b,) = have["gshape"], want["gshape"]
        assert abs(a - b) <= 2e-4 * abs(b) + 1e-6, f"{level} {name} gshape {a!r} vs {b!r}"
