"""The results documents cannot go stale silently: the commands, flags, paths, modules, tests,
links and anchors they name exist.

Documents: every ``RESULTS.md`` (and ``DESIGN*.md``) under ``benchmarks/`` and ``experiments/``.
Nothing here runs an experiment or a benchmark or starts a process: flags are read from the entry
points' sources (``ast``), dotted ``etweedie.*`` names are imported as tests/test_readme.py does.

Commands.  A command is a line of a code block (fenced or indented; ``\\`` continuations and
multi-line quotes joined, ``#`` comments dropped) or an inline code span, split at ``;``, ``&&``,
``||``, ``|`` and ``&``.  After leading ``VAR=value`` assignments, ``env [-u NAME]``, ``nice``,
``time`` and ``do``, its program is one of:

* ``python``/``python3``/``.../python`` (or ``torchrun [its --flags]``) ``-m MODULE``: a MODULE of a
  repository folder must be a module file here (``-m etweedie`` and ``-m pytest`` as below; other
  packages, e.g. ``pip``, are not checked);
* ``python path/to/script.py``, a ``*.py``/``*.sh`` path, or a bare name that is exactly one
  module of experiments/, benchmarks/ or scripts/ (``gpu_sample.py --final-average 64``,
  ``score_eval --antithetic``): the file must exist;
* ``etweedie SUBCOMMAND``: a subcommand of ``etweedie/cli.py`` (``bench`` forwards its flags to
  ``benchmarks/table.py``; a subcommand moved to ``experiments/`` is stale);
* ``make TARGET... [VAR="..."]``: each target is a Makefile target; a variable the Makefile hands
  to a script (``GPU_CHECK_ARGS`` to ``scripts/gpu_check.py``) has its flags checked against it;
* ``pytest``/``python -m pytest``: its files and ``file::test`` nodes exist, its long flags are a
  conftest's ``addoption`` or one of ``_EXTERNAL_FLAGS``.

Every ``--flag``/``--flag=value`` of a command must be an option string its entry point's parser
defines (an ``add_argument``/``addoption`` literal in that file, or an f-string of a ``for`` loop
over a literal), spelled out in full: argparse accepts a unique prefix, a document should not
rely on it.  Words after ``echo`` in a command substitution (``$(for p in ...; do echo
--from-samples ...; done)``) belong to the enclosing command; a quoted argument that is itself a
command (``--command "etweedie train ..."``) is checked as one.  Other programs (``git``, ``tar``,
``python -c``, ``python - N``) are not checked.  Every ``--flag`` anywhere else in the documents
must be defined by some entry point of the repository or be one of ``_EXTERNAL_FLAGS`` (pip,
torchrun, setup.py, pytest plugins).

Placeholders.  Only programs, flag names, paths and names are checked, never flag values.  A
module, script or subcommand written ``...``/``…``, in capitals (``MODULE``) or holding ``<`` or
``$`` is a placeholder.  A path is looked up only when it starts with a top-level folder of the
repository that ``.gitignore`` does not ignore (``benchmarks/``, ``configs/``, ``experiments/``,
``pretrained/``, ``tests/``, ...; not ``runs/`` or ``build/``: outputs a command regenerates) or
with a sub-folder of the document's own folder (``results/...`` in
experiments/eight_gaussians/RESULTS.md).  So ``OUT.json``, ``runN.json``, ``run.json``,
``/tmp/...``, ``$OUT``, ``"$OUT/anti"``, ``PACK``, ``PATH``, ``<checkout>``, ``<build>`` and
``real768.json`` are never looked up, nor are bare file names (``mnist_samples.png``) and rates
(``examples/s``).  Within a checked path ``<name>``, ``$var`` and ``*`` are wildcards and
``{a,b}`` expands; a path with a wildcard must match at least one file unless it is a flag's
value (an output a command will write: ``--json benchmarks/train_<card>.json``).

Names.  ``experiments.x.y`` (and ``.z`` after it on the same line: a sibling) outside a command is a
module file; a dotted ``etweedie.*`` name imports; tests named ``tests/x.py::test_name``,
``::test_name`` or ``test_name`` (``*`` a wildcard) are functions of tests/ (a bare ``test_name``
may also be a test module); an ``ETWEEDIE_*`` environment variable is spelled in the sources.

Links.  Relative Markdown links resolve from the document's folder (``/x`` from the repository
root); their ``#anchors`` are headings of the target, by GitHub's rule: lower case; letters,
digits, marks, ``-`` and ``_`` kept, other characters dropped; spaces to ``-``; a repeated heading
gets ``-1``, ``-2``, ...

The project's rule for these documents (per experiment: the current table, the exact command, the
machine and the date) also rules out a diary and issue numbers: no "session", "today",
"yesterday", "issue 24" or "#24" in their text, no issue numbers in the names of their files.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import glob
import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    {p for pattern in ("benchmarks/**/RESULTS.md", "experiments/**/RESULTS.md", "benchmarks/**/DESIGN*.md",
                       "experiments/**/DESIGN*.md") for p in ROOT.glob(pattern)}
)

# Flags of other tools that the documents quote: flag -> the tool.
_EXTERNAL_FLAGS = {
    "--no-build-isolation": "pip install",
    "--no-deps": "pip install",
    "--nproc_per_node": "torchrun",
    "--inplace": "setup.py build_ext",
    "--timeout": "pytest-timeout",
}
# Scripts whose flags belong to another tool.
_EXTERNAL_SCRIPTS = {"setup.py"}
# Folders whose .py files are entry points a bare name may refer to.
_ENTRY_DIRS = ("experiments", "benchmarks", "scripts")
_FLAG = re.compile(r"^--[A-Za-z][\w-]*(?:=.*)?$", re.S)
_FLAG_IN_TEXT = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------------
# Markdown: prose, code blocks, inline code spans, headings


class Parsed(NamedTuple):
    prose: str  # the document with every code block's lines blanked (line numbers kept)
    blocks: List[Tuple[int, str]]  # (first line number, text) of each code block
    spans: List[Tuple[int, str]]  # (line number, text) of each inline code span of the prose


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


@functools.lru_cache(maxsize=None)
def _parse(doc: Path) -> Parsed:
    lines = doc.read_text(encoding="utf-8").splitlines()
    prose: List[str] = []
    blocks: List[Tuple[int, List[str]]] = []
    fence: Optional[str] = None
    indented = False  # inside an indented code block
    prev_blank = True
    for number, line in enumerate(lines, 1):
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            else:
                blocks[-1][1].append(line)
            prose.append("")
            continue
        match = _FENCE.match(line)
        if match:
            fence, indented = match.group(1), False
            blocks.append((number + 1, []))
            prose.append("")
            continue
        if not line.strip():
            if indented:
                blocks[-1][1].append("")
            prose.append("")
            prev_blank = True
            continue
        if line.startswith(("    ", "\t")) and (prev_blank or indented):
            if not indented:
                blocks.append((number, []))
                indented = True
            blocks[-1][1].append(line.strip())
            prose.append("")
        else:
            indented = False
            prose.append(line)
        prev_blank = False
    spans = []
    for first, paragraph in _paragraphs(prose):  # a code span never crosses a paragraph
        for match in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", paragraph, re.S):
            spans.append((first + paragraph.count("\n", 0, match.start()), " ".join(match.group(2).split())))
    return Parsed("\n".join(prose), [(start, "\n".join(body)) for start, body in blocks], spans)


def _paragraphs(lines: List[str]) -> Iterator[Tuple[int, str]]:
    """(first line number, text) of each run of non-blank lines."""
    start = None
    for number, line in enumerate([*lines, ""], 1):
        if line.strip() and start is None:
            start = number
        elif not line.strip() and start is not None:
            yield start, "\n".join(lines[start - 1 : number - 1])
            start = None


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = "".join(c for c in text.strip().lower() if c.isalnum() or c in "-_ " or unicodedata.category(c)[0] == "M")
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(doc: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    anchors = set()
    for match in re.finditer(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", _parse(doc).prose, re.M):
        slug = _slug(match.group(1))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


# ---------------------------------------------------------------------------------------------
# The repository: entry points, their flags, the Makefile, tests


def _option_strings(call: ast.Call, names: Dict[str, object]) -> Iterator[str]:
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield arg.value
        elif isinstance(arg, ast.JoinedStr):  # f"--{name}" inside `for name in (...)`
            try:
                yield "".join(str(v.value) if isinstance(v, ast.Constant) else str(names[v.value.id]) for v in arg.values)
            except (KeyError, AttributeError):
                pass


def _loop_bindings(loop: ast.For) -> List[Dict[str, object]]:
    """One name -> value binding per item of a ``for`` loop over a literal tuple or list (the
    literal parts of each item: ``for name, kind in (("levels", int), ...)`` binds ``name``)."""
    if not isinstance(loop.iter, (ast.Tuple, ast.List)):
        return []
    targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
    if not all(isinstance(t, ast.Name) for t in targets):
        return []
    bindings = []
    for item in loop.iter.elts:
        parts = item.elts if len(targets) > 1 and isinstance(item, (ast.Tuple, ast.List)) else [item]
        if len(parts) != len(targets):
            continue
        names = {}
        for target, part in zip(targets, parts):
            try:
                names[target.id] = ast.literal_eval(part)
            except ValueError:
                pass
        bindings.append(names)
    return bindings


@functools.lru_cache(maxsize=None)
def _defined_flags(path: Path) -> frozenset:
    """The option strings ``path``'s parsers define: string literals passed to ``add_argument`` or
    ``addoption`` (pytest), f-strings of a ``for`` loop over a literal, and ``-h``/``--help``."""
    flags = {"-h", "--help"}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scopes = [(tree, [{}])] + [(loop, _loop_bindings(loop)) for loop in ast.walk(tree) if isinstance(loop, ast.For)]
    for scope, bindings in scopes:
        for node in ast.walk(scope):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("add_argument", "addoption")):
                for names in bindings:
                    flags.update(s for s in _option_strings(node, names) if s.startswith("-"))
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def _pytest_options() -> frozenset:
    """The options the repository's conftest files add to pytest."""
    return frozenset().union(*(_defined_flags(p) for d in _repo_dirs() for p in (ROOT / d).rglob("conftest.py")))


@functools.lru_cache(maxsize=None)
def _all_defined_flags() -> frozenset:
    files = [p for d in ("etweedie", *_ENTRY_DIRS) for p in (ROOT / d).rglob("*.py")]
    return frozenset().union(_pytest_options(), *(_defined_flags(p) for p in files))


def _assigned_literal(path: Path, name: str):
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"{path} assigns no {name}")


@functools.lru_cache(maxsize=None)
def _etweedie_commands() -> Tuple[Dict[str, Optional[Path]], Dict[str, str]]:
    """(subcommand -> the file defining its flags, moved subcommand -> where it went) of etweedie/cli.py."""
    cli = ROOT / "etweedie" / "cli.py"
    subparsers = re.findall(r"add_parser\(\s*\"([\w-]+)\"", cli.read_text(encoding="utf-8"))
    commands: Dict[str, Optional[Path]] = {name: None for name in subparsers}
    commands["bench"] = ROOT / "benchmarks" / "table.py"
    for name, module in _assigned_literal(cli, "PLUGIN_COMMANDS").items():
        commands[name] = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    return commands, _assigned_literal(cli, "MOVED_COMMANDS")


@functools.lru_cache(maxsize=None)
def _makefile() -> Tuple[frozenset, Dict[str, Path]]:
    """(the Makefile's targets, variable -> the script the Makefile hands it to)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set()
    for match in re.finditer(r"^([\w. -]+?)[ \t]*:(?!=)", text, re.M):
        targets.update(match.group(1).split())
    scripts = {var: ROOT / script for script, var in re.findall(r"(\S+\.py)\b[^\n]*\$\((\w+)\)", text)}
    return frozenset(targets), scripts


@functools.lru_cache(maxsize=None)
def _entry_by_name() -> Dict[str, List[Path]]:
    names: Dict[str, List[Path]] = {}
    for d in _ENTRY_DIRS:
        for p in (ROOT / d).rglob("*.py"):
            if p.stem not in ("__init__", "conftest") and "__pycache__" not in p.parts:
                names.setdefault(p.stem, []).append(p)
    return names


@functools.lru_cache(maxsize=None)
def _test_functions() -> Dict[str, Set[str]]:
    """test file (relative path) -> the test functions it defines."""
    out = {}
    for p in (ROOT / "tests").rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        out[p.relative_to(ROOT).as_posix()] = set(re.findall(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test_\w+)", text, re.M))
    return out


@functools.lru_cache(maxsize=None)
def _repo_dirs() -> Tuple[str, ...]:
    """Top-level folders of the repository that .gitignore does not ignore (runs/, build/ are outputs)."""
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip().endswith("/") and "/" not in line.strip().rstrip("/").lstrip("/")
    ] if (ROOT / ".gitignore").exists() else []
    return tuple(sorted(
        d.name for d in ROOT.iterdir()
        if d.is_dir() and not d.name.startswith((".", "__")) and not any(fnmatch.fnmatch(d.name, pat) for pat in ignored)
    ))


# ---------------------------------------------------------------------------------------------
# Commands


class Command(NamedTuple):
    kind: str  # "module", "script", "etweedie", "make", "pytest"
    entry: Optional[str]  # module name, script path or etweedie subcommand
    args: Tuple[str, ...]
    text: str  # the command as the document writes it (for messages)


def _tokens(text: str) -> List[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _logical_lines(block: str) -> Iterator[str]:
    """A code block's command lines: ``\\`` continuations and quotes spanning lines joined."""
    buffer = ""
    for line in block.split("\n"):
        buffer = f"{buffer}\n{line}" if buffer else line
        if buffer.endswith("\\"):
            buffer = buffer[:-1] + " "
            continue
        try:
            _tokens(buffer)
        except ValueError:  # a quote still open: the string goes on
            continue
        yield buffer
        buffer = ""


def _is_placeholder(word: str) -> bool:
    return word in ("...", "…") or "<" in word or "$" in word or re.fullmatch(r"[A-Z][A-Z0-9_]*(\.\w+)?", word) is not None


_SEPARATORS = {";", ";;", "&&", "||", "|", "&", "(", ")"}
_PREFIXES = {"do", "then", "else", "time", "nice", "exec", "!"}


def _simple_commands(tokens: List[str]) -> Iterator[List[str]]:
    """Split tokens into simple commands; a ``$( ... )`` substitution's echoed words join the
    enclosing command, its other commands are yielded on their own."""
    current: List[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.endswith("$") and i + 1 < len(tokens) and tokens[i + 1] == "(":
            j, depth = i + 2, 1
            while j < len(tokens) and depth:
                depth += {"(": 1, ")": -1}.get(tokens[j], 0)
                j += 1
            for inner in _simple_commands(tokens[i + 2 : j - 1]):
                while inner and inner[0] in _PREFIXES:
                    inner = inner[1:]
                if inner and inner[0] == "echo":
                    current.extend(inner[1:])
                else:
                    yield inner
            if token[:-1]:
                current.append(token[:-1] + "$(...)")
            i = j
            continue
        if token in _SEPARATORS:
            if current:
                yield current
            current = []
        else:
            current.append(token)
        i += 1
    if current:
        yield current


def _command(words: List[str], text: str) -> Optional[Command]:
    words = list(words)
    while words:
        if re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in _PREFIXES:
            words.pop(0)
        elif words[0] == "env":
            words.pop(0)
            while words and words[0].startswith("-"):
                if words.pop(0) == "-u" and words:
                    words.pop(0)
        else:
            break
    if not words:
        return None
    program, rest = words[0], words[1:]
    name = program.rsplit("/", 1)[-1]
    if name == "torchrun":
        while rest and rest[0].startswith("--"):
            rest.pop(0)
        program, name = "python", "python"
    if re.fullmatch(r"python[\d.]*", name):
        while rest and rest[0] in ("-u", "-q", "-O", "-B", "-E", "-s", "-I"):
            rest.pop(0)
        if len(rest) >= 2 and rest[0] == "-m":
            module, args = rest[1], tuple(rest[2:])
            if module == "pytest":
                return Command("pytest", None, args, text)
            if module == "etweedie":
                return Command("etweedie", args[0] if args else None, args[1:], text)
            return Command("module", module, args, text)
        if rest and rest[0].endswith(".py"):
            return Command("script", rest[0], tuple(rest[1:]), text)
        return None  # python -c CODE, python - N (a script on stdin), a bare interpreter
    if name == "etweedie":
        return Command("etweedie", rest[0] if rest else None, tuple(rest[1:]), text)
    if name == "make":
        return Command("make", None, tuple(rest), text)
    if name == "pytest":
        return Command("pytest", None, tuple(rest), text)
    if program.endswith((".py", ".sh")) and "/" in program or program in _EXTERNAL_SCRIPTS:
        return Command("script", program, tuple(rest), text)
    stem = program[:-3] if program.endswith(".py") else program
    if re.fullmatch(r"\w+", stem) and len(_entry_by_name().get(stem, [])) == 1:
        return Command("script", _entry_by_name()[stem][0].relative_to(ROOT).as_posix(), tuple(rest), text)
    return None


def _commands_in(text: str) -> Iterator[Command]:
    try:
        tokens = _tokens(text)
    except ValueError:
        return
    for words in _simple_commands(tokens):
        command = _command(words, " ".join(text.split()))
        if command is None:
            continue
        yield command
        for arg in command.args:  # a quoted argument that is itself a command line
            if " " in arg:
                yield from (c for c in _commands_in(arg))


def _doc_commands(doc: Path) -> Iterator[Tuple[int, Command]]:
    parsed = _parse(doc)
    for start, block in parsed.blocks:
        offset = 0
        for line in _logical_lines(block):
            for command in _commands_in(line):
                yield start + offset, command
            offset += line.count("\n") + 1
    for line, span in parsed.spans:
        for command in _commands_in(span):
            yield line, command


def _entry_file(command: Command) -> Tuple[Optional[Path], Optional[str]]:
    """(the file whose parser defines the command's flags, None) or (None, what is wrong); (None,
    None) for a command this test does not look into."""
    if command.kind == "module":
        module = command.entry
        if _is_placeholder(module):
            return None, None
        parts = module.split(".")
        if parts[0] not in _repo_dirs():
            return None, None  # another package's module (pip, venv, ...)
        base = ROOT.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__main__.py"):
            if candidate.is_file():
                return candidate, None
        return None, f"no module {module}"
    if command.kind == "script":
        script = command.entry
        if _is_placeholder(script):
            return None, None
        path = ROOT / script
        if not path.is_file():
            return None, f"no script {script}"
        if script in _EXTERNAL_SCRIPTS or not script.endswith(".py"):
            return None, None
        return path, None
    if command.kind == "etweedie":
        sub = command.entry
        subcommands, moved = _etweedie_commands()
        if sub is None or sub.startswith("-"):
            return ROOT / "etweedie" / "cli.py", None
        if _is_placeholder(sub):
            return None, None
        if sub in moved:
            return None, f"`etweedie {sub}` moved: it is `{moved[sub]}` now"
        if sub not in subcommands:
            return None, f"no `etweedie {sub}` subcommand (has {sorted(subcommands)})"
        return subcommands[sub], None
    return None, None


def _flags(args) -> List[str]:
    return [a.split("=", 1)[0] for a in args if _FLAG.match(a)]


def _command_problems(command: Command) -> List[str]:
    problems = []
    if command.kind == "make":
        targets, variables = _makefile()
        for arg in command.args:
            if "=" in arg:
                var, value = arg.split("=", 1)
                if var in variables:
                    defined = _defined_flags(variables[var])
                    problems += [f"{var} goes to {variables[var].relative_to(ROOT)}, which defines no {f}"
                                 for f in _flags(shlex.split(value)) if f not in defined]
            elif not arg.startswith("-") and arg not in targets:
                problems.append(f"no make target {arg}")
        return problems
    if command.kind == "pytest":
        problems += [f"pytest: no conftest defines {f}" for f in _flags(command.args)
                     if f not in _pytest_options() and f not in _EXTERNAL_FLAGS]
        tests = _test_functions()
        for arg in command.args:
            path, _, node = arg.partition("::")
            if "/" in path or path.endswith(".py"):
                if not (ROOT / path).exists():
                    problems.append(f"pytest: no {path}")
                elif node and not fnmatch.filter(tests.get(path, ()), node.split("[")[0]):
                    problems.append(f"pytest: {path} defines no {node}")
        return problems
    entry, problem = _entry_file(command)
    if problem:
        return [problem]
    if entry is None:
        return []
    defined = _defined_flags(entry)
    where = entry.relative_to(ROOT).as_posix()
    return [f"{where} defines no {flag}" for flag in _flags(command.args) if flag not in defined]


# ---------------------------------------------------------------------------------------------
# the tests


def test_the_documents_are_found():
    names = {_rel(d) for d in DOCS}
    assert "benchmarks/RESULTS.md" in names and "experiments/RESULTS.md" in names, names
    for doc in DOCS:
        assert _parse(doc).prose.strip(), doc


def test_the_parser_reads_commands_as_the_shell_does():
    """The command reader on the document forms it must handle (a self-check of this file)."""
    line, = _logical_lines(
        "python -m experiments.eight_gaussians.diffusion --config c.toml \\\n"
        "    $(for p in a b; do echo --from-samples runs/x_$p; done) --out r & python -m benchmarks.table --quick"
    )
    got = list(_commands_in(line))
    assert [(c.kind, c.entry) for c in got] == [
        ("module", "experiments.eight_gaussians.diffusion"), ("module", "benchmarks.table")]
    assert _flags(got[0].args) == ["--config", "--from-samples", "--out"]
    got = list(_commands_in('OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m experiments.mnist.gpu_sample --pack-dir "$O"'))
    assert [(c.kind, c.entry, _flags(c.args)) for c in got] == [("module", "experiments.mnist.gpu_sample", ["--pack-dir"])]
    got = list(_commands_in('python x.py --command "etweedie train --config a.toml --out b"'))
    assert [(c.kind, c.entry) for c in got] == [("script", "x.py"), ("etweedie", "train")]
    assert list(_logical_lines('a "b\nc" d\ne \\\nf')) == ['a "b\nc" d', "e  \nf"]
    assert _slug("CPU: et_score and `langevin_step` (2026-11-29)") == "cpu-et_score-and-langevin_step-2026-11-29"
    assert all(_is_placeholder(w) for w in ("OUT.json", "PATH", "<checkout>", "$OUT", "...", "MODULE"))
    assert not any(_is_placeholder(w) for w in ("runN.json", "experiments.mnist.gpu_sample", "train"))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_commands_name_entry_points_and_flags_that_exist(doc):
    problems = []
    found = 0
    for line, command in _doc_commands(doc):
        found += 1
        problems += [f"{_rel(doc)}:{line}: {p}\n    in: {command.text[:200]}" for p in _command_problems(command)]
    assert not problems, "stale commands:\n" + "\n".join(problems)
    if doc.name == "RESULTS.md" and _rel(doc) != "experiments/RESULTS.md":  # the index names modules, not commands
        assert found, f"{_rel(doc)}: no command found (the rule asks for the exact command of each table)"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_flag_mentioned_is_defined_somewhere(doc):
    defined = _all_defined_flags()
    mentioned = set(_FLAG_IN_TEXT.findall(doc.read_text(encoding="utf-8")))
    unknown = sorted(f for f in mentioned if f not in defined and f not in _EXTERNAL_FLAGS)
    assert not unknown, f"{_rel(doc)} mentions flags that no entry point here defines: {unknown}"


def _expand_braces(path: str) -> List[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end():]
    return [q for option in match.group(1).split(",") for q in _expand_braces(head + option + tail)]


def _named_paths(doc: Path) -> Iterator[Tuple[str, Path, bool]]:
    """(path as written, base folder, is a flag's value) for each checked path the document names."""
    text = doc.read_text(encoding="utf-8")
    local = [d.name for d in doc.parent.iterdir()
             if d.is_dir() and not d.name.startswith((".", "__")) and d.name not in _repo_dirs()]
    for base, names in ((ROOT, _repo_dirs()), (doc.parent, local)):
        if not names:
            continue
        pattern = re.compile(rf"(?<![\w/.$<>~-])((?:{'|'.join(map(re.escape, names))})/[\w./*<>{{}},$+-]*)")
        for match in pattern.finditer(text):
            path = match.group(1).rstrip(".,;:")
            if re.fullmatch(r"\w+/s", path):
                continue  # a rate (examples/s), not a path
            yield path, base, re.search(r"--[\w-]+[ =]$", text[: match.start()]) is not None


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_repository_paths_exist(doc):
    missing = []
    for written, base, is_value in _named_paths(doc):
        for path in _expand_braces(written):
            pattern = re.sub(r"<[^>]*>|\$\{?\w+\}?", "*", path)
            if pattern != path and is_value:
                continue  # an output a command will write, e.g. --json benchmarks/train_<card>.json
            matches = glob.glob(str(base / pattern)) if "*" in pattern else ([path] if (base / path).exists() else [])
            if not matches:
                missing.append(path if base == ROOT else f"{path} (from {base.name}/)")
    assert not missing, f"{_rel(doc)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_tests_exist(doc):
    tests = _test_functions()
    every = set().union(*tests.values())
    text = doc.read_text(encoding="utf-8")
    problems = []
    for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w[\w*]*)", text):
        if path in tests and not fnmatch.filter(tests[path], name):
            problems.append(f"{path}::{name}")
    for _, span in _parse(doc).spans:
        match = re.fullmatch(r"(?:tests/[\w/]+\.py)?::(\w[\w*]*)|(test_[\w*]+)(?:\(\))?", span)
        if match and not fnmatch.filter(every, match.group(1) or match.group(2)):
            if not (match.group(2) and fnmatch.filter([Path(t).stem for t in tests], match.group(2))):  # a test module
                problems.append(span)
    assert not problems, f"{_rel(doc)} names tests that tests/ does not define: {sorted(set(problems))}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_and_anchors_resolve(doc):
    prose = _parse(doc).prose
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose) + re.findall(r"(?:href|src)=\"([^\"]+)\"", prose)
    problems = []
    for target in targets:
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = ((ROOT / path.lstrip("/")) if path.startswith("/") else (doc.parent / path).resolve()) if path else doc
        if not file.exists():
            problems.append(f"{target}: no {path}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not problems, f"{_rel(doc)} has broken links: {problems}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_modules_exist(doc):
    """Modules named outside a command (``experiments.mnist.gpu_sample``; ``.score_eval`` after one
    of them on the same line is a sibling) are module files."""
    problems = []
    package = None
    last_line = None
    for line, span in _parse(doc).spans:
        if line != last_line:
            package, last_line = None, line
        if re.fullmatch(rf"(?:{'|'.join(_ENTRY_DIRS)})(?:\.\w+)+", span):
            module, package = span, span.rsplit(".", 1)[0]
        elif re.fullmatch(r"\.\w+", span) and package:
            module = package + span
        else:
            continue
        if not ROOT.joinpath(*module.split(".")).with_suffix(".py").is_file():
            problems.append(f"line {line}: no module {module}")
    assert not problems, f"{_rel(doc)} names modules that do not exist: {problems}"


def _readme_resolver():
    """tests/test_readme.py's resolver of dotted names (imports the longest module prefix, then
    getattr; skips for a missing optional package)."""
    try:
        from test_readme import _resolve
    except ImportError:  # not on sys.path (e.g. pytest --import-mode=importlib)
        spec = importlib.util.spec_from_file_location("_test_readme_helpers", Path(__file__).with_name("test_readme.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _resolve = module._resolve
    return _resolve


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_dotted_etweedie_names_resolve(doc):
    resolve = _readme_resolver()
    problems = []
    for name in sorted(set(re.findall(r"(?<![\w.])etweedie(?:\.[A-Za-z_]\w*)+", doc.read_text(encoding="utf-8")))):
        if name.rsplit(".", 1)[-1] in ("py", "md", "h", "cpp", "toml", "json", "onnx"):
            continue
        try:
            resolve(name)
        except pytest.skip.Exception:  # needs an optional package this machine lacks
            continue
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name}: {exc!r}")
    assert not problems, f"{_rel(doc)} names etweedie names that do not exist: {problems}"


@functools.lru_cache(maxsize=None)
def _source_text() -> str:
    files = [ROOT / "Makefile", ROOT / "setup.py"]
    for d in ("etweedie", "csrc", "kernels", *_ENTRY_DIRS, "tests"):
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".h", ".cpp", ".cu", ".cuh", ".sh")]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file())


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_environment_variables_exist(doc):
    names = set()
    for word in re.findall(r"ETWEEDIE_[\w{},]+", doc.read_text(encoding="utf-8")):
        names.update(n.rstrip("_,") for n in _expand_braces(word))
    source = _source_text()
    unknown = sorted(n for n in names if not re.search(rf"\b{n}\b", source))
    assert not unknown, f"{_rel(doc)} names environment variables no source reads: {unknown}"


_DIARY = re.compile(
    r"\bsessions?\b|\btoday\b|\byesterday\b|\btonight\b|\bthis morning\b|\blast night\b"
    r"|\bissues?[ \t]*#?\d+|\bPR[ \t]*#?\d+|(?<![\w&#/])#\d+\b",
    re.I,
)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_diary_and_no_issue_numbers(doc):
    lines = doc.read_text(encoding="utf-8").splitlines()
    hits = [f"{_rel(doc)}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}"
            for i, line in enumerate(lines, 1) for m in _DIARY.finditer(line)]
    hits += [f"{_rel(doc)}: names the file {path}"
             for path, _, _ in _named_paths(doc) if re.search(r"(?i)issue[_-]?\d+|#\d+", path)]
    assert not hits, ("diary phrasing or issue numbers (keep facts, dates and commits; see this file's docstring):\n"
                      + "\n".join(hits))


def test_no_issue_numbers_in_result_file_names():
    bad = [p.relative_to(ROOT).as_posix() for d in ("experiments", "benchmarks") for p in (ROOT / d).rglob("*")
           if re.search(r"(?i)issue[_-]?\d+", p.name) and "__pycache__" not in p.parts]
    assert not bad, f"result files named after issues: {bad}"
