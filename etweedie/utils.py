"""Run helpers written once: seeded sub-streams, atomic file writes, summary statistics.

Every stage of a run that draws random numbers takes its own generator from
:func:`substream` ``(seed, *keys)``, so stages are independent and resizing one leaves the
others' draws unchanged; files that must never be half-written go through
:func:`atomic_write`; means and standard deviations over seeds, models or replicates come from
:func:`mean_std`.  The argument checks of :mod:`etweedie._checks` are re-exported here.

    >>> derive_seed(0, 100)
    100
    >>> mean_std([1.0, 2.0, 3.0])
    (2.0, 1.0)
"""

from __future__ import annotations

import os
import secrets
import zlib
from pathlib import Path
from typing import Callable, Iterable, Optional, Tuple, Union

import torch

from ._checks import check_bool, check_float, check_generator, check_int

# The argument checks (defined in etweedie._checks) are re-exported for code built on the library.
__all__ = [
    "atomic_write",
    "check_bool",
    "check_float",
    "check_generator",
    "check_int",
    "derive_seed",
    "mean_std",
    "substream",
]


# ---------------------------------------------------------------------------- seeded sub-streams
_MULTIPLIER = 1_000_003
_MODULUS = 1 << 63


def _tag(key) -> int:
    """A non-negative int is its own tag; any other key (a string, a tuple) hashes its ``repr`` (CRC-32)."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    return zlib.crc32(repr(key).encode())


def derive_seed(seed: int, *keys) -> int:
    """The seed of the sub-stream ``keys`` of ``seed``: ``h ← (h·1,000,003 + tag(key)) mod 2⁶³`` over the keys.

    One derivation for every stage of every run: stages with different keys draw independent
    numbers, and resizing one stage leaves the others' draws unchanged.

        >>> derive_seed(1, 2)
        1000005
        >>> derive_seed(0, ("queries", "beta", 0)) == zlib.crc32(repr(("queries", "beta", 0)).encode())
        True
    """
    h = check_int(seed, "seed", minimum=0) % _MODULUS  # a seed of 2⁶⁴ fits torch's 64-bit seed after it too
    for key in keys:
        h = (h * _MULTIPLIER + _tag(key)) % _MODULUS
    return h


def substream(seed: int, *keys) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` seeded with :func:`derive_seed` ``(seed, *keys)``."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))


# ---------------------------------------------------------------------------- files
def atomic_write(path: Union[str, os.PathLike], write: Union[str, bytes, Callable[[Path], None]]) -> Path:
    """Write ``path`` all at once: the file is either complete or absent (never half-written).

    ``write`` is the text, the bytes, or a function that writes a given temporary path (e.g.
    ``lambda p: torch.save(obj, p)``); the temporary file is renamed onto ``path`` (``os.replace``,
    atomic on POSIX and Windows). Parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this writer's own: two writers of one path (or a user's own <name>.tmp) never share it
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        if isinstance(write, str):
            tmp.write_text(write)
        elif isinstance(write, (bytes, bytearray)):
            tmp.write_bytes(write)
        elif callable(write):
            write(tmp)
        else:
            raise TypeError(f"write must be str, bytes or a callable, got {type(write).__name__}")
        with open(tmp, "rb") as fh:  # on disk before the rename: a crash leaves the old file or the new one
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ---------------------------------------------------------------------------- summary statistics
def mean_std(values: Iterable[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (n − 1) of the values that are not ``None``.

    ``(None, None)`` without values; the std is ``None`` for a single value (undefined, not 0).

        >>> mean_std([1.0, 2.0, 3.0])
        (2.0, 1.0)
        >>> mean_std([4.0, None])
        (4.0, None)
    """
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return None, None
    t = torch.tensor(kept, dtype=torch.float64)
    return float(t.mean()), (float(t.std(unbiased=True)) if len(kept) > 1 else None)
