"""README.md cannot go stale silently: its Python blocks run, its paths, modules, flags and names exist.

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

Besides: relative Markdown links and every repository path the README names (``configs/x.toml``,
``tests/test_<op>.py`` as a glob) exist; every ``python -m MODULE`` is a module file here and each
flag on its command line is one its parser defines; every ``--flag`` in the prose is defined by
some command here (or is one of the listed pip/torchrun/setup.py flags); the make targets exist;
the dotted ``etweedie.*`` names import; the ops table's signatures match the functions'.
"""

from __future__ import annotations

import ast
import glob
import importlib
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


# ---------------------------------------------------------------------------------------------
# links, paths, modules, flags, names


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    anchors = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", README, re.M)}
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", README) + re.findall(r"(?:href|src)=\"([^\"]+)\"", README)
    for target in targets:
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README links to {path}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"README links to #{anchor}, which is no heading here"


_REPO_DIRS = "csrc|etweedie|kernels|configs|experiments|tests|benchmarks|scripts|examples|pretrained|data"
_PATH = re.compile(rf"(?<![\w/.<>-])((?:{_REPO_DIRS})/[\w./*<>-]*)")


def test_named_repository_paths_exist():
    missing = []
    for raw in sorted(set(_PATH.findall(README))):
        path = raw.rstrip(".,;:")
        pattern = re.sub(r"<[^>]+>", "*", path)  # tests/test_<op>.py -> tests/test_*.py
        if not glob.glob(str(ROOT / pattern)):
            missing.append(path)
    assert not missing, f"README names paths that do not exist: {missing}"


def _command_lines():
    """The README's command lines (indented or fenced), `torchrun ... -m` normalized to `python -m`."""
    lines = []
    for line in README.splitlines():
        s = line.strip()
        s = re.sub(r"^torchrun\s+(?:--\S+\s+)*-m\s+", "python -m ", s)
        if s.startswith("python -m "):
            lines.append(s)
    return lines


def _module_sources(module: str, sub: str | None):
    """Source files whose parser defines a command's flags (with the shared CLI helpers)."""
    if module == "etweedie":
        if sub == "bench":
            return [ROOT / "benchmarks" / "table.py", ROOT / "benchmarks" / "common.py"]
        if sub == "info":
            return [ROOT / "etweedie" / "cli.py"]
        return [ROOT / "etweedie" / "commands" / f"{sub.replace('-', '_')}.py", ROOT / "etweedie" / "cli.py"]
    parts = module.split(".")
    file = ROOT.joinpath(*parts).with_suffix(".py")
    helpers = {"experiments": ["_cli.py"], "benchmarks": ["common.py"]}.get(parts[0], [])
    return [file] + [ROOT / parts[0] / h for h in helpers]


def test_commands_modules_and_flags_exist():
    lines = _command_lines()
    assert lines, "no `python -m` command lines found"
    subcommands = set(re.findall(r"add_parser\(\s*\"([\w-]+)\"", (ROOT / "etweedie" / "cli.py").read_text()))
    subcommands |= {p.stem.replace("_", "-") for p in (ROOT / "etweedie" / "commands").glob("*.py") if p.stem != "__init__"}
    problems = []
    for line in lines:
        words = line.split()
        module = words[2]
        sub = words[3] if module == "etweedie" and len(words) > 3 else None
        if module == "etweedie":
            if sub not in subcommands:
                problems.append(f"{line!r}: no `etweedie {sub}` command")
                continue
        else:
            parts = module.split(".")
            if not (ROOT.joinpath(*parts).with_suffix(".py").exists() or (ROOT.joinpath(*parts) / "__main__.py").exists()):
                problems.append(f"{line!r}: no module {module}")
                continue
        source = "\n".join(p.read_text(encoding="utf-8") for p in _module_sources(module, sub) if p.exists())
        for flag in re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", line):
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                problems.append(f"{line!r}: {module} {sub or ''} defines no {flag}")
    assert not problems, "\n".join(problems)


# flags of other tools the README quotes (pip, torchrun, setup.py build_ext)
_EXTERNAL_FLAGS = {"--no-build-isolation", "--no-deps", "--nproc_per_node", "--inplace"}


def test_every_flag_in_the_prose_is_defined_somewhere():
    sources = "\n".join(
        p.read_text(encoding="utf-8")
        for d in ("etweedie", "experiments", "benchmarks", "scripts")
        for p in (ROOT / d).rglob("*.py")
    )
    unknown = sorted(
        flag
        for flag in set(re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", README)) - _EXTERNAL_FLAGS
        if f'"{flag}"' not in sources and f"'{flag}'" not in sources
    )
    assert not unknown, f"README mentions flags no command here defines: {unknown}"


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("etweedie"):
                pytest.skip(f"{dotted} needs the optional package {exc.name}")
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_dotted_names_resolve():
    names = set(re.findall(r"\betweedie(?:\.[A-Za-z_]\w*)+", README))
    names = {n for n in names if n.rsplit(".", 1)[-1] not in {"cpp", "git", "py", "md", "toml"}}
    bad = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{name}: {exc!r}")
    assert not bad, "README names that do not resolve:\n" + "\n".join(bad)


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
