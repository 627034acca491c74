"""README.md cannot go stale silently: its Python blocks run and print what it shows.

Rule for the Python code blocks.  Every ```python block in README.md carries a marker, an HTML
comment on the line right above it (invisible when rendered); a block without one fails the test:

* ``<!-- readme-test: run -->`` — self-contained, CPU-only, seconds: run as written;
* ``<!-- readme-test: continue -->`` — a fragment continuing the previous executed block: run in
  the same script, after it, with the placeholder names its comments describe defined by this test
  (``PLACEHOLDERS``: ``my_sampler``, a toy posterior sampler of the documented signature);
* ``<!-- readme-test: shrink {"old": "new", ...} -->`` — runs as written except for these literal
  replacements of its sizes (each must occur in the block), for blocks that take minutes at full size;
* ``<!-- readme-test: skip: REASON -->`` — not run (needs a GPU, large data or long training).

Each executed block runs the way a user runs it: a fresh ``python`` from the repository root (one
subprocess per run block and its continuations, ``OMP_NUM_THREADS=1`` to stay fast on a shared
2-core machine; the printed values do not depend on the thread count).  When a block of a ``run``
group is followed directly by an untagged ``` block, that block is its documented output: the
printed text must match, words exactly (whitespace-normalized) and numbers within
``rel 1e-3, abs 1e-4`` (room for another CPU's float rounding, none for a stale number).

Besides, the ops table's signatures match the functions'.  Links, paths, modules, make targets,
flags and dotted names of every document are checked by tests/test_docs.py.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")

PLACEHOLDERS = '''
def my_sampler(y, n, generator):  # README placeholder: any sampler(y, n, generator) -> (..., n, d)
    return y[..., None, :] + 0.3 * torch.randn(*y.shape[:-1], n, y.shape[-1], generator=generator, dtype=y.dtype)
'''

_FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*readme-test:\s*(run|continue|shrink|skip)\b:?\s*(.*?)\s*-->\s*\Z", re.S)
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_SENTINEL = "----readme-test-block-{}----"


def _blocks():
    """(language, code, marker kind, marker argument, expected output or None) for each fenced block."""
    fences = list(_FENCE.finditer(README))
    out = []
    for i, m in enumerate(fences):
        lang, code = m.group(1), m.group(2)
        before = README[: m.start()].rstrip("\n")
        marker = _MARKER.search(before.splitlines()[-1] if before else "")
        kind, arg = (marker.group(1), marker.group(2)) if marker else (None, None)
        expected = None
        if lang == "python" and i + 1 < len(fences):
            nxt = fences[i + 1]
            if nxt.group(1) == "" and README[m.end() : nxt.start()].strip() == "":
                expected = nxt.group(2)
        out.append((lang, code, kind, arg, expected))
    return out


def _python_blocks():
    return [b for b in _blocks() if b[0] == "python"]


def _groups():
    """Scripts to run: a run/shrink block followed by its continue blocks."""
    groups = []
    for _, code, kind, arg, expected in _python_blocks():
        if kind in ("run", "shrink"):
            if kind == "shrink":
                for old, new in json.loads(arg).items():
                    assert old in code, f"shrink replacement {old!r} does not occur in the block:\n{code}"
                    code = code.replace(old, new)
                expected = None  # smaller sizes print other numbers
            groups.append([(code, expected, kind)])
        elif kind == "continue":
            assert groups, "a `continue` block needs an executed block before it"
            groups[-1].append((PLACEHOLDERS + code, expected, kind))
    return groups


def test_every_python_block_is_marked():
    blocks = _python_blocks()
    assert blocks, "no ```python blocks found in README.md"
    unmarked = [code.splitlines()[0] for _, code, kind, _, _ in blocks if kind is None]
    assert not unmarked, f"```python blocks without a <!-- readme-test: ... --> marker (see this file's docstring): {unmarked}"
    for _, code, kind, arg, _ in blocks:
        if kind == "skip":
            assert arg, f"a skip marker needs its reason: {code.splitlines()[0]!r}"


def _compare(expected: str, got: str, where: str):
    exp_words, got_words = _NUMBER.sub("#", expected).split(), _NUMBER.sub("#", got).split()
    assert exp_words == got_words, f"{where}: README says\n{expected}\nbut the block prints\n{got}"
    for a, b in zip(_NUMBER.findall(expected), _NUMBER.findall(got)):
        assert math.isclose(float(a), float(b), rel_tol=1e-3, abs_tol=1e-4), (
            f"{where}: README says {a}, the block prints {b}\nREADME:\n{expected}\nprinted:\n{got}"
        )


def _group_id(group):
    first = group[0][0].strip().splitlines()
    return next((line for line in first if "import" in line), first[0])[:60]


@pytest.mark.parametrize("group", _groups(), ids=_group_id)
def test_readme_python_blocks_run(group, tmp_path):
    script = []
    for i, (code, _, _) in enumerate(group):
        script.append(f"print({_SENTINEL.format(i)!r}, flush=True)\n{code}")
    path = tmp_path / "readme_block.py"
    path.write_text("\n".join(script), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README block failed:\n{path.read_text()}\n--- stderr ---\n{proc.stderr[-4000:]}"
    outputs = re.split(r"^----readme-test-block-\d+----\n", proc.stdout, flags=re.M)[1:]
    assert len(outputs) == len(group), proc.stdout
    for i, ((_, expected, _), got) in enumerate(zip(group, outputs)):
        if expected is not None:
            _compare(expected, got, f"block {i} of group {_group_id(group)!r}")


def test_ops_table_signatures_match():
    import etweedie

    rows = re.findall(r"^\|\s*`(\w+)\(([^`]*)\)`\s*\|", README, re.M)
    assert len(rows) >= 6, rows
    for name, args in rows:
        params = inspect.signature(getattr(etweedie, name)).parameters
        names = list(params)
        position, keyword_only = -1, False
        for arg in (a.strip() for a in args.split(",")):
            if arg == "*":
                keyword_only = True
                continue
            pname, eq, default = arg.partition("=")
            assert pname in params, f"README's {name}({args}): no parameter {pname!r} (has {names})"
            assert names.index(pname) > position, f"README's {name}({args}): {pname!r} out of order ({names})"
            position = names.index(pname)
            if eq:
                assert params[pname].default == ast.literal_eval(default), (
                    f"README's {name}: {pname}={default}, the function's default is {params[pname].default!r}"
                )
            if keyword_only:
                assert params[pname].kind is inspect.Parameter.KEYWORD_ONLY, f"README's {name}: {pname} is not keyword-only"
