"""pytest setup for ``pytest benchmarks/``: collect bench_*.py, fix the threads, quick mode.

The default suite (pyproject ``testpaths = tests``) never collects these files.
Quick (small) shapes: ``pytest benchmarks/ --bench-quick`` or ``ETWEEDIE_BENCH_QUICK=1``.
"""

import os

import pytest

from .common import set_threads


def pytest_addoption(parser):
    parser.addoption("--bench-quick", action="store_true", help="etweedie benchmarks: small shapes (smoke run)")


def pytest_collect_file(file_path, parent):
    # bench_<op>.py do not match pytest's default test_*.py pattern; a file named on the
    # command line is collected by pytest itself.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    set_threads()  # ETWEEDIE_BENCH_THREADS, else 2


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return bool(request.config.getoption("--bench-quick")) or os.environ.get("ETWEEDIE_BENCH_QUICK") == "1"
