"""The command-line entry shared by the reproductions' ``main(argv) -> int`` functions.

argparse ends ``--help`` and usage errors with SystemExit; an entry point that returns its exit
status (as every ``main`` here does, so that tests call it in-process) turns that into a status.

A user's mistake is one line ``PROG: error: ...`` on stderr and exit status 2, reported before
any long work starts.  The checks below (:func:`at_least`, :func:`threads`, :func:`positive`,
:func:`nonempty`, :func:`device`, :func:`out_dir`, :func:`out_file`, :func:`read_config`) raise
:class:`UsageError` naming the flag as typed, what was expected and what was received;
:func:`run`, :func:`guarded` and :func:`report` turn it into that line (:func:`run` and
:func:`guarded` do the same for a failed memory allocation: sizes beyond the machine).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Tuple

from etweedie.commandline import OneLineParser, allocation_failure, fail, parse  # torch-free

#: the most torch intra-op threads a ``--threads`` flag accepts (torch.set_num_threads of far more crashes)
MAX_THREADS = 1024


class UsageError(ValueError):
    """A flag's value a user gave cannot work: its message is the one line after ``PROG: error: ``."""


def _fail_allocation(prog: str, exc: BaseException) -> int:
    """2 after one line for a failed allocation (:func:`allocation_failure`); any other error re-raised."""
    message = allocation_failure(exc)
    if message is None:
        raise exc
    return fail(prog, message)


def report(prog: str, check: Callable[[], Any]) -> int:
    """Run ``check`` (a function of the checks below); 0, or 2 after one line for its UsageError."""
    try:
        check()
    except UsageError as exc:
        return fail(prog, exc)
    return 0


# ---------------------------------------------------------------------------- checks of flag values
def at_least(flag: str, value: Optional[Any], low: float) -> None:
    """``value`` (None: not given; a list: each item) must be >= ``low``."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if v is not None and not v >= low:  # `not >=` refuses nan too
            raise UsageError(f"{flag} must be >= {low}, got {v}")


def at_most(flag: str, value: Optional[Any], high: float) -> None:
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if v is not None and not v <= high:
            raise UsageError(f"{flag} must be <= {high}, got {v}")


def threads(flag: str, value: Optional[int], *, zero_ok: bool = False) -> None:
    """A thread count in [1, MAX_THREADS] ([0, ...] where the script documents 0 as torch's default)."""
    low = 0 if zero_ok else 1
    if value is not None and not low <= value <= MAX_THREADS:
        raise UsageError(f"{flag} must be an integer from {low} to {MAX_THREADS}"
                         f"{' (0: torch default)' if zero_ok else ''}, got {value}")


def positive(flag: str, value: Optional[float], *, zero_ok: bool = False) -> None:
    """A finite number > 0 (>= 0 with ``zero_ok``); None is not given; a list: each item."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if v is not None and not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
            raise UsageError(f"{flag} must be a finite number {'>=' if zero_ok else '>'} 0, got {v}")


def finite(flag: str, value: Optional[float]) -> None:
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if v is not None and not math.isfinite(v):
            raise UsageError(f"{flag} must be a finite number, got {v}")


def nonempty(flag: str, value: Optional[Any], what: str = "a value") -> None:
    """A string (or each string of a list) that is not empty or blank: an empty one is not "not given"."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(v, str) and not v.strip():
            raise UsageError(f"{flag} must be {what}, got an empty string")


def device(flag: str, value: Optional[str]) -> None:
    """A torch device string (cpu, cuda, cuda:1, ...); CUDA ones only where CUDA is available."""
    if value is None:
        return
    nonempty(flag, value, "a torch device such as cpu or cuda")
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{flag} must be a torch device such as cpu or cuda, got {value!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{flag} {value}: CUDA is not available here (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu")


def _writable_folder(flag: str, value: str, folder: Path) -> None:
    """Create ``folder`` (with its parents) and create-and-remove a probe file in it: the real test
    (``os.access`` says yes to root everywhere, /proc included)."""
    base = folder.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UsageError(f"{flag} {value} cannot be created: {base} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {value} cannot be created or written "
                         f"({exc.strerror or type(exc).__name__})") from None


def out_dir(flag: str, value: Optional[Any]) -> None:
    """An output folder: not empty, not a file, created here (parents too) and writable."""
    if value is None:
        return
    nonempty(flag, str(value), "a folder (it is created when missing)")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value} is a file; give a folder (it is created when missing)")
    _writable_folder(flag, str(value), path)


def out_file(flag: str, value: Optional[Any]) -> None:
    """An output file: not empty, not a folder; its folder is created here and writable."""
    if value is None:
        return
    nonempty(flag, str(value), "a file name")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {value} is a folder; give a file name")
    _writable_folder(flag, str(value), path.parent)
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise UsageError(f"{flag} {value} cannot be written ({exc.strerror or type(exc).__name__})") from None


def read_toml(path: Any) -> dict:
    """The TOML file at ``path`` as a dict; a file that is not UTF-8 text or not TOML is a
    ValueError naming it (the loaders of the studies' configs share this)."""
    import tomllib

    with open(path, "rb") as fh:
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                             "expected a TOML file") from None


def read_config(flag: str, path: Any, loader: Callable[[Any], Any]) -> Any:
    """``loader(path)``, with a file that cannot be read or parsed (missing, a folder, not UTF-8, not
    TOML, a bad key) reported as one UsageError naming ``flag`` and the file."""
    import tomllib

    nonempty(flag, path if isinstance(path, str) else None, "a TOML file")
    where = f"{flag} {path}"
    if path is not None and not Path(path).exists():
        raise UsageError(f"{where}: no such file; expected a TOML file")
    if path is not None and Path(path).is_dir():
        raise UsageError(f"{where}: is a folder; expected a TOML file")
    try:
        return loader(path)
    except OSError as exc:
        raise UsageError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:  # a ValueError: before the next clause
        raise UsageError(f"{where}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                         "expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where}: not valid TOML ({exc})") from None
    except (ValueError, TypeError) as exc:
        message = " ".join(str(exc).split())
        message = message.removeprefix("config: ").removeprefix("config ")
        for name in (repr(str(path)), str(path)):  # the file is named in front already
            if message.startswith(name):
                message = message[len(name):].lstrip(": ")
        if isinstance(exc, UsageError) or message.startswith(flag):
            raise
        raise UsageError(f"{where}: {message}") from None


def load(flag: str, value: Any, loader: Callable[[Any], Any], what: str = "a run directory, posterior or checkpoint") -> Any:
    """``loader(value)`` (e.g. etweedie.training.load_posterior) for the value of ``flag``; an empty
    value, or one the loader refuses (missing, damaged), is one UsageError naming the flag."""
    nonempty(flag, value, what)
    try:
        return loader(value)
    except (OSError, ValueError) as exc:
        message = " ".join(str(exc).split()).removeprefix("path: ")
        raise UsageError(f"{flag} {value}: {message or type(exc).__name__}") from None


# ---------------------------------------------------------------------------- entry points
def run(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
        cli_main: Callable[[argparse.Namespace], int], argv: Optional[Sequence[str]],
        check: Optional[Callable[[argparse.Namespace], None]] = None) -> int:
    """Build the parser with ``add_arguments``, parse ``argv``, run ``check(args)`` (the flag checks
    that raise UsageError), check ``--out`` (created here) and hand the arguments to ``cli_main``;
    a UsageError raised there too is one line and status 2."""
    parser = OneLineParser(prog=prog, description=description)
    add_arguments(parser)
    args, status = parse(parser, argv)
    if args is None:
        return status
    from etweedie.backends import BackendUnavailable

    out = getattr(args, "out", None)
    fresh = isinstance(out, (str, os.PathLike)) and str(out).strip() != "" and not Path(out).exists()
    status = 2
    try:
        if check is not None:
            check(args)
        out_dir("--out", out)
        status = cli_main(args)
        return status
    except (UsageError, BackendUnavailable) as exc:  # e.g. ETWEEDIE_BACKEND=cuda on a machine without it
        return fail(prog, exc)
    except (RuntimeError, MemoryError) as exc:  # sizes beyond the machine's memory: one line
        return _fail_allocation(prog, exc)
    finally:
        if fresh and status != 0 and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()  # a run refused after --out was created leaves no empty folder behind


def usage_error(prog: str, minimums: Sequence[Tuple[str, Optional[int], int]] = (), out=None, out_flag: str = "--out") -> int:
    """2 after printing one ``PROG: error: ...`` line for the first flag below its minimum
    (``(flag, value, minimum)``; a None value is not given) or an ``--out`` (``out_flag``) that is
    empty, names a file or cannot be created and written (it is created here); else 0.  For checks
    a script runs before its long work starts."""

    def check():
        for flag, value, low in minimums:
            at_least(flag, value, low)
            if flag == "--threads":
                threads(flag, value, zero_ok=low == 0)
        out_dir(out_flag, out)

    return report(prog, check)


def guarded(prog: str, main: Callable[[], Optional[int]]) -> int:
    """Run a study script's ``main()``: its exit status (0 for None), or 2 after one
    ``PROG: error: ...`` line for what a user's input causes (a bad flag value, a missing or damaged
    checkpoint, an unwritable path, an unavailable backend) instead of a traceback."""
    from etweedie.backends import BackendUnavailable

    try:
        return main() or 0
    except (ValueError, TypeError, OSError, BackendUnavailable) as exc:
        return fail(prog, exc)
    except (RuntimeError, MemoryError) as exc:  # sizes beyond the machine's memory: one line
        return _fail_allocation(prog, exc)
