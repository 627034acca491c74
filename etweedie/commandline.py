"""What every command line of the package shares, without importing torch: one-line usage errors.

A user's mistake is one line ``PROG: error: MESSAGE`` on stderr and exit status 2 — argparse's own
errors (:class:`OneLineParser`), a value a command cannot use (:func:`fail`) and sizes beyond the
machine's memory (:func:`allocation_failure`).  ``etweedie``'s commands, the benchmarks, the
reproductions' helpers (``experiments/_cli.py``) and the GPU orchestration scripts all use these.

It imports nothing from the package, so a script that must run before torch is installed (the
GPU preflight) loads this file on its own: :func:`load_standalone` in ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Optional, Sequence, Tuple

__all__ = ["OneLineParser", "allocation_failure", "fail", "parse"]


class OneLineParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose usage errors (an unknown flag, ``--steps abc``, a
    missing argument) are one line, ``PROG: error: MESSAGE (PROG --help lists the arguments)``,
    and exit status 2, instead of argparse's usage block before the line.  Subcommand parsers
    inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the arguments)\n")


def parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Tuple[Optional[argparse.Namespace], int]:
    """``(args, 0)``, or ``(None, status)`` when argparse stopped (0 after --help, 2 on a usage error):
    an entry point that returns its status (so tests call it in-process) never sees SystemExit."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as exc:
        return None, exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def fail(prog: str, message: Any) -> int:
    """Print ``PROG: error: MESSAGE`` as one line on stderr; 2."""
    text = " ".join(str(message).split()) or type(message).__name__
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def allocation_failure(exc: BaseException) -> Optional[str]:
    """The one-line message for ``exc`` when it is a failed memory allocation (a ``MemoryError``,
    torch's ``OutOfMemoryError`` on a GPU, or the CPU allocator's RuntimeError "can't allocate
    memory"), else None.  torch is consulted only if something else imported it."""
    text = " ".join(str(exc).split())
    torch = sys.modules.get("torch")
    oom = torch is not None and isinstance(exc, torch.OutOfMemoryError)
    if not (oom or isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in text)):
        return None
    match = re.search(r"(?:tried|Tried) to allocate (\d+) bytes", text) or re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    asked = ""
    if match is not None:
        size = match.group(1)
        asked = f" (one tensor of {int(size) / 2**30:,.1f} GiB)" if size.isdigit() else f" (one tensor of {size})"
    return f"out of memory{asked}: the sizes asked for (chains, samples, batch) do not fit this machine; lower them"
