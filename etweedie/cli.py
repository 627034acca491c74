"""The ``etweedie`` command line (also ``python -m etweedie``).

    etweedie info                                                     backends, torch, threads
    etweedie train ...                                                library commands (see --help)

A library command is a module listed in ``PLUGIN_COMMANDS`` (``etweedie/commands/<name>.py``)
defining ``CLI_HELP`` (one line), ``add_cli_arguments(parser)`` and ``cli_main(args) -> int``.
The paper's reproductions are not commands of the installed package: they run from the
repository (``python -m experiments.eight_gaussians.demo`` etc.; ``MOVED_COMMANDS``), and so do the
benchmarks (``python -m benchmarks.table``): the library never imports either.

Every command returns an exit status (0 on success, 2 on a usage error).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys
from typing import Optional, Sequence

from .commandline import OneLineParser, allocation_failure

__all__ = ["main", "MOVED_COMMANDS", "PLUGIN_COMMANDS"]


# command name -> module defining CLI_HELP, add_cli_arguments(parser), cli_main(args)
PLUGIN_COMMANDS = {
    "train": "etweedie.commands.train",
    "mnist-eval": "etweedie.commands.mnist_eval",
}

# Former commands: the paper's reproductions and the benchmarks, which run from the repository root.
MOVED_COMMANDS = {
    "bench": "python -m benchmarks.table",
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
        if argv and argv[0] in MOVED_COMMANDS:
            print(f"etweedie {argv[0]}: error: this runs from the repository root as "
                  f"`{MOVED_COMMANDS[argv[0]]}` (same arguments)", file=sys.stderr)
            return 2
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's --help and usage errors: a status, not an exception
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command in PLUGIN_COMMANDS:
        try:
            return int(_plugin(args.command).cli_main(args) or 0)
        except (RuntimeError, MemoryError) as exc:  # sizes beyond the machine: one line, not a traceback
            message = allocation_failure(exc)
            if message is None:
                raise
            print(f"etweedie {args.command}: error: {message}", file=sys.stderr)
            return 2
    return _info()


# ---------------------------------------------------------------------------- commands
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
