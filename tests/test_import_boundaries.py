"""Import boundaries: the library never loads a reproduction, and its import graph keeps the
contracts of pyproject.toml's [tool.importlinter] (layers along the data path, no cycles)."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import etweedie

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> str:
    found = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(found).is_file():
        pytest.skip("import-linter is not installed (it is in the `test` extra: pip install -e .[test])")
    return found


def _env() -> dict:
    # the working tree first, so the contracts are checked on these sources
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _package_view(tmp_path: Path) -> Path:
    """A folder whose ``etweedie`` is the source package with ``kernels/`` inside it, as installed.

    The Triton kernels live in the repository's top-level ``kernels/`` and are installed as
    ``etweedie.kernels`` (setup.py's package_dir); an editable install maps them with an import
    hook that import-linter's file scan does not see.  Symlinks give it the installed shape.
    """
    view = tmp_path / "view"
    package = view / "etweedie"
    package.mkdir(parents=True)
    for child in (ROOT / "etweedie").iterdir():
        if child.name not in ("kernels", "__pycache__"):
            (package / child.name).symlink_to(child)
    (package / "kernels").symlink_to(ROOT / "kernels")
    (view / "experiments").symlink_to(ROOT / "experiments")
    (view / "benchmarks").symlink_to(ROOT / "benchmarks")
    return view


def test_import_linter_contracts_are_kept(tmp_path):
    view = _package_view(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(view), os.environ.get("PYTHONPATH", "")]))
    # lint-imports puts its working directory first on the path: run it in the view
    done = subprocess.run([_lint_imports(), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=view,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_import_linter_fails_on_a_cycle(tmp_path):
    """The checker is live: the same kind of contract breaks on a package with a cycle."""
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic import b\n")
    (pkg / "b.py").write_text("from cyclic import a\n")
    (tmp_path / "contracts.ini").write_text(
        "[importlinter]\nroot_package = cyclic\n\n"
        "[importlinter:contract:acyclic]\nname = no cycles\ntype = acyclic_siblings\nancestors = cyclic\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([_lint_imports(), "--no-cache", "--config", "contracts.ini"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout


def _library_modules():
    names = ["etweedie"]
    for info in pkgutil.walk_packages(etweedie.__path__, "etweedie."):
        names.append(info.name)
    return sorted(names)


def test_importing_the_library_loads_no_reproduction():
    """`import etweedie` and every `etweedie.*` module, each in a fresh interpreter: no `experiments` module."""
    modules = _library_modules()
    assert "etweedie.sample" in modules and "etweedie.estimate" in modules
    # One fresh interpreter imports them all (one per module would take minutes of torch imports);
    # any module pulling a reproduction in leaves it in sys.modules.  An optional dependency that is
    # absent here (e.g. triton) skips that module only.
    body = "import importlib, sys\n" + "".join(
        f"try:\n    importlib.import_module({n!r})\nexcept ImportError as exc:\n    print('skipped', {n!r}, exc)\n"
        for n in modules
    ) + (
        "bad = sorted(m for m in sys.modules if m == 'experiments' or m.startswith('experiments.'))\n"
        "print('LOADED', bad)\nsys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "LOADED []" in done.stdout
