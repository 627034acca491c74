"""``etweedie/commandline.py`` loaded on its own, without the package (whose import loads torch):
the one-line usage errors for the scripts that run before torch is installed (the GPU preflight)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
    """The module ``etweedie.commandline`` from this checkout's file (it imports nothing from the package)."""
    spec = importlib.util.spec_from_file_location("_etweedie_commandline", os.path.join(ROOT, "etweedie", "commandline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
