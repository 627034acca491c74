"""CUDA sources (csrc/cuda) without a GPU: the layering contract and an nvcc compile.

* the .cu/.cuh files use the CUDA runtime only (no torch, ATen or c10 headers), so plain nvcc
  builds them; only the bindings (<op>_bindings.cpp, bindings.h, energy_bindings.h) see torch;
* every launcher declared in launchers.cuh is defined and instantiated for float and double (the
  score launchers also for bfloat16 and float16 draws of either);
* each <op>_bindings.cpp registers CUDA kernels for its own ops, which csrc/etweedie.cpp defines, covering
  et_score_fwd/bwd, langevin_step_fwd, is_score_fwd and the pairwise energy ops
  (energy_score_fwd/bwd/fwd_grad, energy_distance_fwd/bwd);
* with nvcc on PATH, one source compiles for sm_80 (make check-cuda compiles all of them for
  sm_80 and sm_90 and writes the ptxas report).
"""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "csrc", "cuda")
OPS = ("et_score_fwd", "et_score_bwd", "langevin_step_fwd", "is_score_fwd", "energy_score_fwd", "energy_score_bwd",
       "energy_score_fwd_grad", "energy_distance_fwd", "energy_distance_bwd")
LAUNCHERS = {"et_score_fwd_launch", "et_score_bwd_launch", "langevin_step_fwd_launch", "student_t_score_fwd_launch",
             "student_t_score_bwd_launch", "is_score_fwd_launch", "energy_score_launch", "energy_distance_launch"}


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _cuda_sources():
    return sorted(f for f in os.listdir(CUDA_DIR) if f.endswith((".cu", ".cuh")))


def test_one_cuda_source_per_op():
    names = set(os.listdir(CUDA_DIR))
    for stem in ("et_score", "langevin_step", "is_score", "energy_score", "energy_distance"):
        assert f"{stem}_cuda.cu" in names
        assert f"{stem}_bindings.cpp" in names, f"{stem} has no CUDA bindings file"
    assert "launchers.cuh" in names


@pytest.mark.parametrize("name", _cuda_sources())
def test_cuda_sources_do_not_include_torch(name):
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', _read("csrc", "cuda", name), re.M)
    bad = [h for h in includes if h.split("/")[0] in ("torch", "ATen", "c10", "caffe2", "pybind11")]
    assert not bad, f"{name} includes torch headers {bad}: it must build with plain nvcc"


# The score launchers take the draws' storage type X besides the compute type T (16-bit draws,
# csrc/common/low_precision.h): each must exist for X = T, bf16 and fp16.
SCORE_LAUNCHERS = {"et_score_fwd_launch", "et_score_bwd_launch", "langevin_step_fwd_launch",
                   "student_t_score_fwd_launch", "student_t_score_bwd_launch"}


def score_types() -> set:
    """The (T, X) pairs of launchers.cuh's ET_SCORE_TYPES(INSTANTIATE) list."""
    body = re.search(r"#define ET_SCORE_TYPES\(INSTANTIATE\)((?:[^\n]*\\\n)*[^\n]*)", _read("csrc", "cuda", "launchers.cuh"))
    return set(re.findall(r"INSTANTIATE\((\w+),\s*(\w+)\)", body.group(1)))


def instantiations(src: str, name: str) -> set:
    """(T, X) pairs the launcher ``name`` is instantiated for in one .cu source, explicitly or
    through the source's ET_INSTANTIATE(T) / ET_INSTANTIATE(T, X) lines (X = T when absent) or its
    ET_SCORE_TYPES(ET_INSTANTIATE) line (launchers.cuh's list)."""
    pairs = {(t, x or t) for t, x in re.findall(rf"template\s+cudaError_t\s+{name}<(\w+)(?:,\s*(\w+))?>\(", src)}
    if ("T", "X") in pairs or ("T", "T") in pairs:  # the macro's own body: expanded by its ET_INSTANTIATE lines
        pairs -= {("T", "X"), ("T", "T")}
        pairs |= {(t, x or t) for t, x in re.findall(r"^ET_INSTANTIATE\((\w+)(?:,\s*(\w+))?\)", src, re.M)}
        if re.search(r"^ET_SCORE_TYPES\(ET_INSTANTIATE\)", src, re.M):
            pairs |= score_types()
    return pairs


def test_launchers_defined_and_instantiated():
    header = _read("csrc", "cuda", "launchers.cuh")
    declared = set(re.findall(r"cudaError_t\s+(\w+_launch)\s*\(", header))
    assert declared == LAUNCHERS
    sources = {f: _read("csrc", "cuda", f) for f in _cuda_sources() if f.endswith(".cu")}
    for name in declared:
        assert any(re.search(rf"cudaError_t\s+{name}\s*\(", src) for src in sources.values()), \
            f"{name} is declared but never defined"
        got = set().union(*(instantiations(src, name) for src in sources.values()))
        want = {("float", "float"), ("double", "double")}
        if name in SCORE_LAUNCHERS:
            want |= {(t, x) for t in ("float", "double") for x in ("bf16", "fp16")}
        assert want <= got, f"{name} is not instantiated for {sorted(want - got)}"


def _bindings():
    return sorted(f for f in os.listdir(CUDA_DIR) if f.endswith("_bindings.cpp"))


def test_bindings_register_the_defined_ops():
    header = _read("csrc", "cuda", "bindings.h")
    assert '#include "launchers.cuh"' in header and '#include "../common/checks.h"' in header
    assert "#define ET_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(etweedie, CUDA, m)" in header
    impl = set()
    for name in _bindings():
        src = _read("csrc", "cuda", name)
        assert "ET_CUDA_LIBRARY_IMPL(m)" in src, name  # TORCH_LIBRARY_IMPL(etweedie, CUDA, m) (bindings.h)
        assert '#include "bindings.h"' in src or '#include "energy_bindings.h"' in src, name
        own = set(re.findall(r'm\.impl\("(\w+)"', src))
        stem = name.removesuffix("_bindings.cpp")
        assert own and all(op.startswith(stem) for op in own), f"{name} registers ops of another stem: {own}"
        impl |= own
    defined = set(re.findall(r'm\.def\(\s*"(\w+)\(', _read("csrc", "etweedie.cpp")))
    assert set(OPS) <= impl, f"missing CUDA implementations: {set(OPS) - impl}"
    assert impl <= defined, f"bindings implement ops with no schema: {impl - defined}"


def test_energy_workspace_size_is_defined():
    header = _read("csrc", "cuda", "launchers.cuh")
    assert re.search(r"int64_t\s+energy_workspace_doubles\s*\(", header)
    sources = "\n".join(_read("csrc", "cuda", f) for f in _cuda_sources() if f.endswith(".cu"))
    assert len(re.findall(r"^int64_t\s+energy_workspace_doubles\s*\(", sources, re.M)) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (make check-cuda compiles every source where it is)")
def test_nvcc_compiles_a_source(tmp_path):
    # the lightest source (about 10 s; the score sources take 1–2 min each): make check-cuda, which
    # `make test` runs first where nvcc is found, compiles every source for sm_80 and sm_90
    src = os.path.join(CUDA_DIR, "is_score_cuda.cu")
    cmd = ["nvcc", "-O3", "-std=c++17", "--use_fast_math", "-I", os.path.join(ROOT, "csrc"),
           "-gencode", "arch=compute_80,code=sm_80", "-c", src, "-o", str(tmp_path / "is_score_cuda.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
