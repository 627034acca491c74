"""The documents name only what exists: README.md, docs/*.md and every RESULTS.md.

Nothing here runs a command.  In each document:

* relative Markdown links resolve from the document's folder, and their ``#anchors`` are headings
  of the target (GitHub's rule: lower case; letters, digits, ``-`` and ``_`` kept, spaces to
  ``-``, other characters dropped; a repeated heading gets ``-1``, ``-2``, ...);
* every repository path written in it (``configs/x.toml``; ``tests/test_<op>.py``, ``$VAR`` and
  ``*`` as wildcards, ``{a,b}`` expanded) exists, except a wildcard path given as a flag's value
  (an output a command will write); ``runs/`` and ``build/`` are outputs and are not looked up;
  paths under a sub-folder of the document's own folder (``results/...``) are looked up there;
* every ``python -m MODULE`` / ``torchrun ... -m MODULE`` of a repository package, and every
  module named in backticks (``experiments.mnist.demo``), is a module file here; every
  ``python -m etweedie SUBCOMMAND`` is a subcommand of ``etweedie/cli.py``;
* every ``make TARGET`` is a Makefile target;
* every ``--flag`` is an option string some entry point of the repository spells (or
  tests/conftest.py), or one of ``_EXTERNAL_FLAGS`` (pip, torchrun, setup.py, pytest plugins);
* every test named (``tests/x.py::test_y``, ```test_y```) is defined in tests/;
* every dotted ``etweedie.*`` name imports, every ``ETWEEDIE_*`` variable is read by a source;
* no diary phrasing or issue numbers: results carry their command, machine and date, and git
  keeps their history.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/**/RESULTS.md"),
               *ROOT.glob("experiments/**/RESULTS.md")})
# Top-level folders whose paths the documents name (runs/ and build/ hold outputs).
REPO_DIRS = ("benchmarks", "configs", "csrc", "data", "docs", "etweedie", "examples", "experiments",
             "kernels", "pretrained", "scripts", "tests")
PACKAGES = ("etweedie", "experiments", "benchmarks", "scripts", "tests", "examples")
_EXTERNAL_FLAGS = {"--no-build-isolation", "--no-deps", "--nproc_per_node", "--inplace", "--timeout"}
_FENCED = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[ \t]*$", re.S | re.M)


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def _prose(doc: Path) -> str:
    """The document without its fenced code blocks (line count kept)."""
    return _FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), _text(doc))


def _spans(doc: Path):
    return re.findall(r"`([^`\n]+)`", _prose(doc))


@functools.lru_cache(maxsize=None)
def _sources() -> str:
    files = [ROOT / "Makefile", ROOT / "setup.py"]
    for d in ("etweedie", "csrc", "kernels", "experiments", "benchmarks", "scripts", "tests"):
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".h", ".cpp", ".cu", ".cuh", ".sh")]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file())


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(doc: Path) -> frozenset:
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _prose(doc), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return frozenset(out)


def _expand_braces(path: str):
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [q for option in m.group(1).split(",") for q in _expand_braces(path[: m.start()] + option + path[m.end():])]


def test_the_documents_are_found():
    names = {_rel(d) for d in DOCS}
    assert {"README.md", "docs/guarantees.md", "benchmarks/RESULTS.md", "experiments/RESULTS.md"} <= names, names
    assert all((ROOT / d).is_dir() for d in REPO_DIRS), [d for d in REPO_DIRS if not (ROOT / d).is_dir()]


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_and_anchors_resolve(doc):
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(doc)):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no {path}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not problems, f"{_rel(doc)} has broken links: {problems}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_repository_paths_exist(doc):
    text = _text(doc)
    local = [] if doc.parent == ROOT else [
        d.name for d in doc.parent.iterdir() if d.is_dir() and d.name not in REPO_DIRS and not d.name.startswith((".", "_"))]
    missing = []
    for base, names in ((ROOT, REPO_DIRS), (doc.parent, local)):
        if not names:
            continue
        pattern = re.compile(rf"(?<![\w/.$<>~-])((?:{'|'.join(map(re.escape, names))})/[\w./*<>{{}},$+-]*)")
        for m in pattern.finditer(text):
            written = m.group(1).rstrip(".,;:")
            if re.fullmatch(r"\w+/s", written) or written.endswith(".so"):
                continue  # a rate (examples/s); a build output
            is_value = re.search(r"--[\w-]+[ =]$", text[: m.start()]) is not None
            for path in _expand_braces(written):
                wild = re.sub(r"<[^>]*>|\$\{?\w+\}?", "*", path)
                if wild != path and is_value:
                    continue  # an output a command will write: --json benchmarks/train_<card>.json
                if not glob.glob(str(base / wild)):
                    missing.append(path if base == ROOT else f"{path} (in {_rel(doc.parent)}/)")
    assert not missing, f"{_rel(doc)} names paths that do not exist: {sorted(set(missing))}"


def _module_file(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


@functools.lru_cache(maxsize=None)
def _subcommands() -> frozenset:
    cli = (ROOT / "etweedie" / "cli.py").read_text(encoding="utf-8")
    return frozenset(re.findall(r"add_parser\(\s*\"([\w-]+)\"", cli) + re.findall(r"\"([\w-]+)\": \"etweedie\.commands\.", cli))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_modules_and_subcommands_exist(doc):
    problems = []
    for module, rest in re.findall(r"(?:\bpython3?|\btorchrun\b[^\n`]*?)\s+-m\s+([\w.*]+)([^\n`]*)", _text(doc)):
        if module.split(".")[0] not in PACKAGES or "*" in module:
            continue  # pip, pytest, venv, ...; benchmarks.* for all of them
        if not _module_file(module):
            problems.append(f"python -m {module}: no module file")
        elif module == "etweedie":
            sub = rest.split()[0] if rest.split() else ""
            if re.fullmatch(r"[a-z][\w-]*", sub) and sub not in _subcommands():
                problems.append(f"python -m etweedie {sub}: no such subcommand (has {sorted(_subcommands())})")
    for span in _spans(doc):
        if re.fullmatch(r"(?:experiments|benchmarks|scripts)(?:\.\w+)+", span) and not _module_file(span):
            problems.append(f"`{span}`: no module file")
    assert not problems, f"{_rel(doc)}: " + "; ".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_make_targets_exist(doc):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", _text(doc)))
    assert named <= targets, f"{_rel(doc)} names make targets the Makefile lacks: {sorted(named - targets)}"


@functools.lru_cache(maxsize=None)
def _entry_point_sources() -> str:
    """The command-line parsers' sources (tests/ only through its conftest: tests spell bad flags)."""
    files = [ROOT / "tests" / "conftest.py", *(p for d in ("etweedie", "experiments", "benchmarks", "scripts")
                                                 for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in files if p.is_file())


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_flags_are_defined_somewhere(doc):
    source = _entry_point_sources()
    unknown = sorted(flag for flag in set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", _text(doc))) - _EXTERNAL_FLAGS
                     if f'"{flag}"' not in source and f"'{flag}'" not in source)
    assert not unknown, f"{_rel(doc)} mentions flags that no entry point here defines: {unknown}"


@functools.lru_cache(maxsize=None)
def _tests() -> dict:
    return {p.relative_to(ROOT).as_posix(): re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(encoding="utf-8"), re.M)
            for p in (ROOT / "tests").rglob("test_*.py")}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_tests_exist(doc):
    tests = _tests()
    every = [t for names in tests.values() for t in names]
    modules = [Path(p).stem for p in tests]
    problems = [f"{path}::{name}" for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w[\w*]*)", _text(doc))
                if path in tests and not fnmatch.filter(tests[path], name)]
    for span in _spans(doc):
        m = re.fullmatch(r"::(\w[\w*]*)|(test_[\w*]+)(?:\(\))?", span)
        if m and not fnmatch.filter(every, m.group(1) or m.group(2)) and not fnmatch.filter(modules, m.group(2) or ""):
            problems.append(span)
    assert not problems, f"{_rel(doc)} names tests that tests/ does not define: {sorted(set(problems))}"


def _resolve(dotted: str):
    """Import the longest module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("etweedie"):
                raise LookupError(exc.name) from exc  # an optional package this machine lacks
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_dotted_etweedie_names_resolve(doc):
    problems = []
    for name in sorted(set(re.findall(r"(?<![\w.])etweedie(?:\.[A-Za-z_]\w*)+", _text(doc)))):
        if name.rsplit(".", 1)[-1] in ("py", "md", "h", "cpp", "toml", "json", "onnx", "git"):
            continue
        try:
            _resolve(name)
        except LookupError:
            continue
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name}: {exc!r}")
    assert not problems, f"{_rel(doc)} names etweedie names that do not exist: {problems}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_environment_variables_exist(doc):
    names = {n.rstrip("_,") for word in re.findall(r"ETWEEDIE_[\w{},]+", _text(doc)) for n in _expand_braces(word)}
    unknown = sorted(n for n in names if not re.search(rf"\b{n}\b", _sources()))
    assert not unknown, f"{_rel(doc)} names environment variables no source reads: {unknown}"


_DIARY = re.compile(
    r"\bsessions?\b|\btoday\b|\byesterday\b|\btonight\b|\bthis morning\b|\blast night\b"
    r"|\bissues?[ \t]*#?\d+|\bPR[ \t]*#?\d+|(?<![\w&#/])#\d+\b",
    re.I,
)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_diary_and_no_issue_numbers(doc):
    hits = [f"{_rel(doc)}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}"
            for i, line in enumerate(_text(doc).splitlines(), 1) for m in _DIARY.finditer(line)]
    assert not hits, "diary phrasing or issue numbers (keep facts, dates and commits):\n" + "\n".join(hits)


def test_no_issue_numbers_in_result_file_names():
    bad = [p.relative_to(ROOT).as_posix() for d in ("experiments", "benchmarks", "docs") for p in (ROOT / d).rglob("*")
           if re.search(r"(?i)issue[_-]?\d+", p.name) and "__pycache__" not in p.parts]
    assert not bad, f"result files named after issues: {bad}"
