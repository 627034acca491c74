"""Build a wheel and install it into a fresh virtual environment that has only torch.

The fresh environment is ``python -m venv --without-pip``; a ``.pth`` file in its site-packages
points at a folder of symlinks to exactly the distributions needed — torch and its requirements,
plus etweedie's declared runtime requirements (numpy, tqdm, matplotlib) and theirs — resolved
from this interpreter's installed metadata (offline, no copy, seconds).  Nothing else of the
developer's environment is visible there: not the source tree, not the test or interop peers.
The wheel is installed with pip (``pip --python VENV install --no-deps --no-index``), then a
smoke script runs in the fresh interpreter from a neutral working directory.

* default suite: the wheel built **without a compiler** (CC/CXX point nowhere) and
  ``ETWEEDIE_ALLOW_NO_EXT=1``: the build degrades instead of failing, the package imports with
  exactly one warning naming the missing extension and how to build it, the ops run on the
  reference backend, ``python -m etweedie info`` says the same, and the first example runs;
  without ``ETWEEDIE_ALLOW_NO_EXT`` the same build fails.
* slow (``pytest -m slow tests/test_wheel.py``; the C++ compile takes minutes on 2 cores): the
  full wheel with ``etweedie._C``; the CPU kernels load and agree with the reference, and all
  three examples run (the diffusers and k-diffusion ones when those packages are installed here,
  exposed to the fresh environment the same way).
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("setup.py", "pyproject.toml", "README.md", "etweedie", "kernels", "csrc")
RUNTIME_REQUIREMENTS = ("torch", "numpy", "tqdm", "matplotlib")


def _copy_sources(dest: Path) -> Path:
    """The files a build reads (tracked files when this is a git checkout), without build outputs."""
    src = dest / "src"
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *BUILD_INPUTS], check=True,
                                capture_output=True).stdout.decode().split("\0")
        files = [f for f in listed if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if files:
        for rel in files:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    else:
        junk = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "build", "*.egg-info", "kernels")
        for name in BUILD_INPUTS:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=junk if name == "etweedie" else shutil.ignore_patterns("__pycache__", "build"))
            else:
                shutil.copy2(path, src / name)
    return src


def _build_wheel(src: Path, out: Path, env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", str(out), str(src)],
        capture_output=True, text=True, env=env, cwd=str(out.parent),
    )


def _requirement_names(dist: md.Distribution):
    for line in dist.requires or ():
        if "extra ==" in line:
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if match:
            yield match.group(1)


def _closure(names):
    """Installed distributions reachable from ``names`` through their (non-extra) requirements."""
    seen, todo, dists = set(), list(names), []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform-only requirement not installed here
        dists.append(dist)
        todo.extend(_requirement_names(dist))
    return dists


def _fresh_venv(tmp: Path, requirements) -> Path:
    """A venv without pip whose only visible packages are the closure of ``requirements``."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    exposed = tmp / "exposed"
    exposed.mkdir()
    for dist in _closure(requirements):
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            target = base / top
            if target.exists() and not (exposed / top).exists() and top != "__pycache__":
                (exposed / top).symlink_to(target)
    (site / "_exposed_for_test.pth").write_text(str(exposed) + "\n")
    return python


def _install(python: Path, wheel: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True)


def _run(python: Path, cwd: Path, *args, timeout=600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ETWEEDIE_BACKEND")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=str(cwd), env=env, timeout=timeout)


SMOKE = textwrap.dedent(
    """
    import sys, warnings, torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import etweedie
    assert etweedie.__file__.startswith(sys.prefix), (etweedie.__file__, sys.prefix)
    mine = [w for w in caught if "etweedie" in str(w.message)]
    status = etweedie.backends.available()
    y = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 16, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = etweedie.et_score(y, x, 1.4, 1.8, backend="reference")
    auto = etweedie.et_score(y, x, 1.4, 1.8)
    u = y[:, None, :] - x
    manual = -1.8 * (u.norm(dim=-1, keepdim=True) ** (1.4 - 2) * u).mean(1)
    assert torch.allclose(ref, manual, rtol=1e-12) and torch.allclose(auto, ref, rtol=1e-10)
    import etweedie.interop
    print("WARNINGS", len(mine))
    for w in mine:
        print("WARNING", w.category.__name__, str(w.message))
    print("CPU", status["cpu"][0], status["cpu"][1])
    print("AUTO", etweedie.backends.resolve("et_score", torch.device("cpu")))
    """
)


def _smoke(python: Path, cwd: Path) -> str:
    result = _run(python, cwd, "-c", SMOKE)
    assert result.returncode == 0, f"smoke test failed in the fresh venv:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def no_compiler_wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel_nocc")
    src = _copy_sources(tmp)
    out = tmp / "dist"
    nowhere = {"CC": str(tmp / "no-such-cc"), "CXX": str(tmp / "no-such-c++"), "MAX_JOBS": "2"}
    failed = _build_wheel(src, tmp / "dist_strict", nowhere)
    built = _build_wheel(src, out, {**nowhere, "ETWEEDIE_ALLOW_NO_EXT": "1"})
    return tmp, failed, built, out


def test_build_without_a_compiler_fails_unless_allowed(no_compiler_wheel):
    _, failed, built, out = no_compiler_wheel
    assert failed.returncode != 0, "a failed compile must fail the build by default"
    assert built.returncode == 0, built.stdout + built.stderr
    wheels = glob.glob(str(out / "etweedie-*.whl"))
    assert len(wheels) == 1
    import zipfile

    names = zipfile.ZipFile(wheels[0]).namelist()
    assert not [n for n in names if n.endswith(".so")], "no extension expected without a compiler"
    assert "etweedie/kernels/et_score.py" in names and "etweedie/interop/score.py" in names


def test_no_compiler_wheel_in_a_fresh_torch_only_venv(no_compiler_wheel):
    tmp, _, built, out = no_compiler_wheel
    assert built.returncode == 0, built.stdout + built.stderr
    python = _fresh_venv(tmp, RUNTIME_REQUIREMENTS)
    assert _run(python, tmp, "-c", "import diffusers").returncode != 0, "the fresh venv must not see the dev environment"
    _install(python, Path(glob.glob(str(out / "etweedie-*.whl"))[0]))
    out_text = _smoke(python, tmp)
    assert "WARNINGS 1" in out_text, out_text  # exactly one warning, naming the piece and the fix
    assert "ExtensionNotLoadedWarning" in out_text and "etweedie._C is not built" in out_text
    assert "pip install --no-build-isolation ." in out_text and "compiler" in out_text
    assert "CPU False" in out_text and "AUTO reference" in out_text
    info = _run(python, tmp, "-m", "etweedie", "info")
    assert info.returncode == 0, info.stderr
    assert re.search(r"cpu\s+no\s+the C\+\+ extension etweedie\._C is not built", info.stdout), info.stdout
    example = _run(python, tmp, str(ROOT / "examples" / "score_from_your_sampler.py"), "--queries", "4", "--draws", "64", "--bank", "2000")
    assert example.returncode == 0 and "mean cosine" in example.stdout, example.stderr


def test_isolated_build_without_torch_stops_with_the_advice(tmp_path):
    """What pip's isolated build sees: only the [build-system] requires (setuptools, wheel), no torch."""
    src = _copy_sources(tmp_path)
    python = _fresh_venv(tmp_path, ("setuptools", "wheel"))
    probe = "import setuptools.build_meta as b; print(b.get_requires_for_build_wheel())"
    result = _run(python, src, "-c", probe)
    assert result.returncode != 0
    assert "cannot import torch in the build environment" in result.stderr, result.stderr
    assert "pip install --no-build-isolation ." in result.stderr and "ETWEEDIE_NO_EXT=1" in result.stderr
    pure = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=str(src),
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "ETWEEDIE_NO_EXT": "1"})
    assert pure.returncode == 0, pure.stderr  # a pure-Python build needs no torch


@pytest.mark.slow
def test_full_wheel_in_a_fresh_torch_only_venv(tmp_path):
    src = _copy_sources(tmp_path)
    out = tmp_path / "dist"
    built = _build_wheel(src, out, {"MAX_JOBS": os.environ.get("MAX_JOBS", "2")})
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    extras = [name for name in ("diffusers", "k-diffusion", "torchsde", "torchdiffeq", "trampoline", "scipy")
              if _closure([name])]
    python = _fresh_venv(tmp_path, RUNTIME_REQUIREMENTS + tuple(extras))
    _install(python, Path(glob.glob(str(out / "etweedie-*.whl"))[0]))
    text = _smoke(python, tmp_path)
    assert "WARNINGS 0" in text and "CPU True" in text and "AUTO cpu" in text, text
    runs = [("score_from_your_sampler.py", "--queries", "4", "--draws", "64", "--bank", "2000")]
    if "diffusers" in extras:
        runs.append(("diffusers_loop.py", "--chains", "128", "--levels", "4", "--steps", "2", "--draws", "4"))
    if "k-diffusion" in extras:
        runs.append(("k_diffusion_sampler.py", "--chains", "128", "--steps", "6", "--draws", "4"))
    for script, *args in runs:
        result = _run(python, tmp_path, str(ROOT / "examples" / script), *args)
        assert result.returncode == 0, f"{script}:\n{result.stdout}\n{result.stderr}"
