"""Argument checks, written once for every module.

They raise ``TypeError`` for the wrong kind of value and ``ValueError`` for a value
out of range, naming the argument, what was expected and what was received; each returns the
checked value (an ``int`` or ``float``), so a check reads ``n = check_int(n, "n", minimum=1)``.
``bool`` is never accepted as a number.

    >>> check_int(3, "n", minimum=1)
    3
    >>> check_float(0, "lam", minimum=0, strict=True)
    Traceback (most recent call last):
    ...
    ValueError: lam must be > 0, got 0.0

Seeded sub-streams, atomic writes and summary statistics are in :mod:`etweedie.utils`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["MAX_THREADS", "check_bool", "check_device", "check_float", "check_generator", "check_int",
           "check_output_dir", "check_output_file", "require"]

#: The most intra-op threads a config or flag accepts: ``torch.set_num_threads`` of far more
#: crashes the process (100000 segfaults) instead of raising.
MAX_THREADS = 1024


# ---------------------------------------------------------------------------- argument checks
def require(ok: bool, name: str, expected: str, got) -> None:
    """Raise ``ValueError("<name> must be <expected>, got <got!r>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {got!r}")


def check_int(value, name: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_float(
    value,
    name: str,
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    *,
    strict: bool = False,
) -> float:
    """``value`` (an int or float) as a finite ``float`` within the bounds.

    ``strict=True`` excludes the bounds themselves (``minimum < value < maximum``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and (value >= maximum if strict else value > maximum):
        raise ValueError(f"{name} must be {'<' if strict else '<='} {maximum:g}, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    """``value`` if it is a ``bool`` (not merely truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_generator(generator, name: str = "generator") -> torch.Generator:
    """``generator`` if it is a ``torch.Generator``: every random draw takes one explicitly."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name} must be a torch.Generator (randomness is always explicit), got {type(generator).__name__}"
        )
    return generator


def check_device(device, name: str = "device") -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (None stays None) that this process can use: a string
    torch cannot parse, or a CUDA device where CUDA is missing or has fewer devices, is a
    ValueError naming the argument (not torch's internal error at the first allocation)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise TypeError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                        f"got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} must be a device string such as 'cpu' or 'cuda:0', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device!r} was requested but CUDA is not available "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device!r} was requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_output_file(path, name: str, parents: bool = False) -> str:
    """``path`` (str or PathLike) as a file an output can be written to, tried now rather than after
    the work: not empty, not a folder, its folder existing (``parents``: created), and the file
    creatable or appendable (created and removed again when it did not exist: ``os.access`` says
    yes to root even on /proc).  A ValueError names ``name`` (the flag or argument) otherwise."""
    import os

    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"{name} must be a file path, got {path!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a folder; give a file path")
    existed = os.path.exists(path)
    try:
        if parents:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a" if existed else "x"):
            pass
    except OSError as exc:
        raise ValueError(f"{name} {path!r} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)
    return path


def check_output_dir(path, name: str) -> str:
    """``path`` as a folder outputs can be written into, created now (with its parents) so that
    a path that cannot hold one fails before the work: a ValueError naming ``name``."""
    import os

    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"{name} must be a folder path, got {path!r}")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a file; give a folder (it is created when missing)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-probe-{os.getpid()}")
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{name} {path!r} cannot be created or written: {exc.strerror or exc}") from None
    return path
