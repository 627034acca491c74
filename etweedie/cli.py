"""The ``etweedie`` command line (also ``python -m etweedie``).

    etweedie bench [ARGS...]                                          benchmarks.table (from the repo root)
    etweedie info                                                     backends, torch, threads
    etweedie train ...                                                library commands (see --help)

A library command is a module listed in ``PLUGIN_COMMANDS`` (``etweedie/commands/<name>.py``)
defining ``CLI_HELP`` (one line), ``add_cli_arguments(parser)`` and ``cli_main(args) -> int``.
The paper's reproductions are not commands of the installed package: they run from the
repository (``python -m experiments.eight_gaussians.demo`` etc.; ``MOVED_COMMANDS``).

Every command returns an exit status (0 on success, 2 on a usage error).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys
from pathlib import Path
from typing import List, Optional, Sequence

__all__ = ["main", "MOVED_COMMANDS", "OneLineParser", "PLUGIN_COMMANDS"]


class OneLineParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose usage errors (an unknown flag, ``--steps abc``, a
    missing argument) are one line, ``PROG: error: MESSAGE (PROG --help lists the arguments)``,
    and exit status 2 — like every other error of this package's command lines, instead of
    argparse's usage block before the line.  Subcommand parsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the arguments)\n")

# command name -> module defining CLI_HELP, add_cli_arguments(parser), cli_main(args)
PLUGIN_COMMANDS = {
    "train": "etweedie.commands.train",
    "mnist-eval": "etweedie.commands.mnist_eval",
}

# Former commands that ran the paper's tables; they are reproductions now, run from the repository root.
MOVED_COMMANDS = {
    "demo": "python -m experiments.eight_gaussians.demo",
    "score-eval": "python -m experiments.eight_gaussians.score_eval",
    "sample": "python -m experiments.eight_gaussians.diffusion",
    "estimate": "python -m experiments.eight_gaussians.estimation",
}


def _plugin(name: str):
    """The module behind a plugin command (imported on first use; heavy imports stay lazy)."""
    return importlib.import_module(PLUGIN_COMMANDS[name])


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="etweedie", description="Energy-Tweedie scores from denoising-posterior samples.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    commands.add_parser(
        "bench",
        help="run the benchmark table (benchmarks.table; run from the repository root)",
        description="Forwards every further argument to benchmarks.table, e.g. `etweedie bench --quick`.",
        add_help=False,
    )
    commands.add_parser("info", help="show which backends loaded, the torch build and threads")
    for name, module_name in PLUGIN_COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = _plugin(name)
        sub = commands.add_parser(name, help=module.CLI_HELP, description=module.CLI_HELP)
        module.add_cli_arguments(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # `bench` forwards everything after it untouched (its flags belong to benchmarks.table).
        if argv and argv[0] == "bench":
            return _bench(argv[1:])
        if argv and argv[0] in MOVED_COMMANDS:
            print(f"etweedie {argv[0]}: error: this paper reproduction runs from the repository root as "
                  f"`{MOVED_COMMANDS[argv[0]]}` (same arguments)", file=sys.stderr)
            return 2
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's --help and usage errors: a status, not an exception
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command in PLUGIN_COMMANDS:
        try:
            return int(_plugin(args.command).cli_main(args) or 0)
        except (RuntimeError, MemoryError) as exc:  # sizes beyond the machine: one line, not a traceback
            from ._checks import allocation_failure

            message = allocation_failure(exc)
            if message is None:
                raise
            print(f"etweedie {args.command}: error: {message}", file=sys.stderr)
            return 2
    return _info()


# ---------------------------------------------------------------------------- commands
def _bench(forwarded: List[str]) -> int:
    root = Path.cwd()
    if not (root / "benchmarks" / "table.py").is_file():
        print(
            "etweedie bench: error: benchmarks/table.py is not in the current directory; the benchmarks "
            "ship with the source tree, not the installed package, so run `etweedie bench` from the "
            "etweedie repository root",
            file=sys.stderr,
        )
        return 2
    # The console script's sys.path starts at its own bin/ folder, not the working directory.
    if str(root) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(root))
    try:
        table = importlib.import_module("benchmarks.table")
    except ImportError as exc:
        print(f"etweedie bench: error: cannot import benchmarks.table from {root}: {exc}", file=sys.stderr)
        return 2
    status = table.main(forwarded)
    return 0 if status is None else int(status)


def _info() -> int:
    import torch

    from . import __version__, backends

    status = backends.available()
    width = max(len(name) for name in status)
    print(f"etweedie {__version__}")
    print(f"python   {platform.python_version()} ({sys.executable})")
    print(f"torch    {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(f"threads  {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op")
    print("backends")
    for name, (ok, why) in status.items():
        print(f"  {name:<{width}}  {'yes' if ok else 'no ':<3}  {why}")
    print(f"automatic choice for CPU tensors: {backends._automatic('cpu', backends.BACKENDS, None)}")
    try:
        want = backends.requested()
    except ValueError as exc:
        print(f"etweedie info: error: {exc}", file=sys.stderr)
        return 2
    if want is not None:
        print(f"requested by ETWEEDIE_BACKEND: {want}")
    return 0
