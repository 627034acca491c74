"""The command-line entry shared by the reproductions' ``main(argv) -> int`` functions.

argparse ends ``--help`` and usage errors with SystemExit; an entry point that returns its exit
status (as every ``main`` here does, so that tests call it in-process) turns that into a status.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple


def parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Tuple[Optional[argparse.Namespace], int]:
    """``(args, 0)``, or ``(None, status)`` when argparse stopped (0 after --help, 2 on a usage error)."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as exc:
        return None, exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def run(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
        cli_main: Callable[[argparse.Namespace], int], argv: Optional[Sequence[str]]) -> int:
    """Build the parser with ``add_arguments``, parse ``argv`` and hand the arguments to ``cli_main``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args, status = parse(parser, argv)
    if args is None:
        return status
    status = usage_error(prog, out=getattr(args, "out", None))
    if status:
        return status
    from etweedie.backends import BackendUnavailable

    try:
        return cli_main(args)
    except BackendUnavailable as exc:  # e.g. ETWEEDIE_BACKEND=cuda on a machine without it
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def usage_error(prog: str, minimums: Sequence[Tuple[str, Optional[int], int]] = (), out=None, out_flag: str = "--out") -> int:
    """2 after printing one ``PROG: error: ...`` line for the first flag below its minimum
    (``(flag, value, minimum)``; a None value is not given) or an ``--out`` (``out_flag``) that names a
    file or cannot be created;
    else 0.  For checks a script runs before its long work starts."""
    for flag, value, low in minimums:
        if value is not None and value < low:
            print(f"{prog}: error: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if isinstance(out, str) and Path(out).exists() and not Path(out).is_dir():
        print(f"{prog}: error: {out_flag} {out} is a file; give a folder (it is created when missing)", file=sys.stderr)
        return 2
    if isinstance(out, str):  # the folder that would be created under: an existing, writable directory
        base = Path(out).absolute()
        while not base.exists() and base != base.parent:
            base = base.parent
        if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
            print(f"{prog}: error: {out_flag} {out} cannot be created: {base} is {'not writable' if base.is_dir() else 'a file'}",
                  file=sys.stderr)
            return 2
    return 0


def guarded(prog: str, main: Callable[[], Optional[int]]) -> int:
    """Run a study script's ``main()``: its exit status (0 for None), or 2 after one
    ``PROG: error: ...`` line for what a user's input causes (a missing or damaged checkpoint, a
    bad value, an unwritable path, an unavailable backend) instead of a traceback."""
    from etweedie.backends import BackendUnavailable

    try:
        return main() or 0
    except (ValueError, TypeError, OSError, BackendUnavailable) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 2
