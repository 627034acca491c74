"""Each script in examples/ runs as a user would run it (``python examples/X.py ...``), at small sizes.

The scripts are executed with ``runpy`` as ``__main__`` (same code path as the command line, without
a new interpreter per script) and their printed results are checked for sense, not just exit.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(monkeypatch, capsys, script: str, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return capsys.readouterr().out


def _floats(pattern: str, text: str):
    match = re.search(pattern, text)
    assert match, f"no match for {pattern!r} in:\n{text}"
    return [float(v) for v in match.groups()]


def test_score_from_your_sampler(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "score_from_your_sampler.py", "--queries", "6", "--draws", "128", "--bank", "4000")
    nmse, cosine = _floats(r"NMSE ([-\d.e]+), mean cosine ([-\d.e]+)", out)
    assert nmse < 0.05 and cosine > 0.97, out


def test_diffusers_loop(monkeypatch, capsys):
    pytest.importorskip("diffusers", reason="diffusers not installed (pip install diffusers; in the test extra)")
    out = _run(monkeypatch, capsys, "diffusers_loop.py", "--chains", "256", "--levels", "6", "--steps", "2", "--draws", "8")
    ed, floor = _floats(r"samples ([-\d.e]+), a fresh clean draw ([-\d.e]+)", out)
    assert "12 Langevin updates over 6 levels" in out
    assert abs(ed) < 0.1 and abs(floor) < 0.1, out


def test_k_diffusion_sampler(monkeypatch, capsys):
    from etweedie.interop import load_k_diffusion_sampling

    try:
        load_k_diffusion_sampling()
    except ImportError as exc:
        pytest.skip(f"k-diffusion samplers unavailable: {exc}")
    out = _run(monkeypatch, capsys, "k_diffusion_sampler.py", "--chains", "256", "--steps", "8", "--draws", "8")
    for name in ("sample_euler", "sample_heun", "sample_dpmpp_2m"):
        (ed,) = _floats(rf"{name}\s+([-\d.e]+)", out)
        assert abs(ed) < 0.1, out


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_usage_line_matches_the_defaults(script):
    """The docstring's ``python examples/X.py [--flag default] ...`` line names the script's flags and defaults."""
    import ast

    source = (EXAMPLES / script).read_text(encoding="utf-8")
    tree = ast.parse(source)
    usage = re.search(rf"^\s*python examples/{re.escape(script)}(.*)$", ast.get_docstring(tree) or "", re.M)
    assert usage, f"{script}: no `python examples/{script} ...` usage line in its docstring"
    documented = dict(re.findall(r"\[(--[\w-]+) ([^\]]+)\]", usage.group(1)))
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flag = node.args[0].value
            default = next((kw.value for kw in node.keywords if kw.arg == "default"), None)
            defaults[flag] = None if default is None else ast.literal_eval(default)
    assert set(documented) == set(defaults), f"{script}: usage names {sorted(documented)}, the parser has {sorted(defaults)}"
    for flag, text in documented.items():
        assert str(defaults[flag]) == text.replace(",", "").replace("_", ""), (
            f"{script}: usage says {flag} {text}, the default is {defaults[flag]!r}"
        )
