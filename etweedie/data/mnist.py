"""MNIST from the four standard IDX files: a checksum-verified reader that never downloads.

A data source of the data path (data → noise → posterior → score → sampler → metrics),
beside :mod:`etweedie.data`.  The files are the originals of LeCun, Cortes and Burges
(http://yann.lecun.com/exdb/mnist/, CC BY-SA 3.0):

    train-images-idx3-ubyte  train-labels-idx1-ubyte  t10k-images-idx3-ubyte  t10k-labels-idx1-ubyte

each either gzipped (``.gz``, as distributed) or raw.  A folder may hold them directly or in
torchvision's layout (``<root>/MNIST/raw/``).  Every file's uncompressed bytes are checked
against the canonical MD5 sums, so a re-gzipped copy is accepted and a truncated or altered one
is refused (:class:`MnistChecksumError`).

Where the files are looked for (:func:`default_data_dir`): an explicit ``data_dir`` argument,
else the environment variable ``ETWEEDIE_MNIST_DIR``, else the repository's ``data/mnist/``
folder (a source checkout carries the four .gz files there).  Nothing is ever downloaded;
when no folder holds the files the error names every folder tried and the four file names.

IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header — magic ``0x00000803``
(unsigned bytes, 3 dimensions) then n, 28, 28 for images; ``0x00000801`` then n for labels —
followed by the values in C order.

Example::

    >>> from etweedie.data.mnist import load_mnist
    >>> images, labels = load_mnist("test")          # doctest: +SKIP
    >>> images.shape, images.dtype, labels[:5].tolist()  # doctest: +SKIP
    (torch.Size([10000, 28, 28]), torch.uint8, [7, 2, 1, 0, 4])
"""

from __future__ import annotations

import gzip
import hashlib
import os
import threading
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch

__all__ = [
    "ENV_VAR",
    "MNIST_FILES",
    "MnistChecksumError",
    "default_data_dir",
    "find_mnist_files",
    "load_mnist",
]

ENV_VAR = "ETWEEDIE_MNIST_DIR"

# split -> (images file, labels file), names without ".gz"
MNIST_FILES: Dict[str, Tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# MD5 of the uncompressed IDX bytes (the commonly published sums; the canonical .gz files,
# MD5 f68b3c2d…, d53e105e…, 9fb629c4…, ec29112d…, decompress to exactly these).
_RAW_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
_COUNTS = {"train": 60000, "test": 10000}
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801

PathLike = Union[str, os.PathLike]


class MnistChecksumError(ValueError):
    """An MNIST file whose bytes differ from the canonical file (truncated, altered or another data set)."""


def _all_file_names() -> List[str]:
    return [name for pair in MNIST_FILES.values() for name in pair]


def _repo_data_dir() -> Path:
    """``<repository>/data/mnist`` for a source checkout (the package's parent folder)."""
    return Path(__file__).resolve().parents[2] / "data" / "mnist"


def _candidates(folder: Path) -> List[Path]:
    """The folders inside ``folder`` that may hold the files: itself, torchvision's MNIST/raw, raw/."""
    return [folder, folder / "MNIST" / "raw", folder / "raw"]


def _holds_mnist(folder: Path) -> bool:
    return all((folder / name).is_file() or (folder / f"{name}.gz").is_file() for name in _all_file_names())


def default_data_dir(data_dir: Optional[PathLike] = None) -> Path:
    """The folder holding the four MNIST files.

    Resolution order: ``data_dir`` if given, else ``$ETWEEDIE_MNIST_DIR``, else the repository's
    ``data/mnist/``.  Within a folder the files may sit directly or under ``MNIST/raw/``
    (torchvision) or ``raw/``.  An explicit ``data_dir`` (or the environment variable) that does
    not hold the files is an error, not a fall-through to the next place.

    Raises:
        FileNotFoundError: naming every folder tried and the four expected file names.
        ValueError: an empty ``data_dir`` (``Path("")`` would be the working directory).
    """
    if data_dir is not None:
        if not isinstance(data_dir, (str, os.PathLike)):
            raise TypeError(f"data_dir must be a str or os.PathLike, got {type(data_dir).__name__}")
        if not os.fspath(data_dir).strip():
            # Path("") is the working directory: an empty setting must not quietly read whatever is there
            raise ValueError(f"data_dir must be a folder path, got {os.fspath(data_dir)!r} (None: the default folder)")
        roots = [(Path(data_dir).expanduser(), "data_dir")]
    elif os.environ.get(ENV_VAR):
        roots = [(Path(os.environ[ENV_VAR]).expanduser(), f"${ENV_VAR}")]
    else:
        roots = [(_repo_data_dir(), "the repository's data/mnist")]
    tried = []
    for root, _source in roots:
        for folder in _candidates(root):
            if _holds_mnist(folder):
                return folder
            tried.append(str(folder))
    source = roots[0][1]
    raise FileNotFoundError(
        f"MNIST files not found (from {source}); looked in {', '.join(tried)} for "
        f"{', '.join(_all_file_names())} (each raw or .gz); pass --data-dir / data_dir or set "
        f"${ENV_VAR} (nothing is downloaded)"
    )


def find_mnist_files(split: str = "train", data_dir: Optional[PathLike] = None) -> Tuple[Path, Path]:
    """Paths of the (images, labels) files of ``split`` ("train" or "test"), raw preferred over .gz."""
    split = _check_split(split)
    folder = default_data_dir(data_dir)
    paths = []
    for name in MNIST_FILES[split]:
        raw, gz = folder / name, folder / f"{name}.gz"
        paths.append(raw if raw.is_file() else gz)
    return paths[0], paths[1]


def _check_split(split) -> str:
    if not isinstance(split, str) or split not in MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split


def _read_bytes(path: Path) -> bytes:
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as handle:
                return handle.read()
        except (OSError, EOFError, zlib.error) as exc:  # not a gzip stream, truncated, or a corrupt body
            raise MnistChecksumError(f"{path} is not a readable gzip file ({exc})") from exc
    return path.read_bytes()


def _verified(path: Path, name: str, verify: bool) -> bytes:
    data = _read_bytes(path)
    if verify:
        digest = hashlib.md5(data, usedforsecurity=False).hexdigest()  # a checksum, not security: FIPS builds allow it
        if digest != _RAW_MD5[name]:
            raise MnistChecksumError(
                f"{path}: MD5 of the uncompressed bytes is {digest}, expected {_RAW_MD5[name]} "
                f"(the canonical {name}); the file is truncated, altered or not MNIST"
            )
    return data


def _parse_idx(data: bytes, path: Path, magic: int, count: int, item_shape: Tuple[int, ...]) -> np.ndarray:
    ndim = 1 + len(item_shape)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: {len(data)} bytes is shorter than the {header}-byte IDX header")
    fields = np.frombuffer(data, dtype=">u4", count=1 + ndim)
    if int(fields[0]) != magic:
        raise ValueError(f"{path}: IDX magic number is 0x{int(fields[0]):08x}, expected 0x{magic:08x}")
    shape = tuple(int(v) for v in fields[1:])
    if shape != (count,) + item_shape:
        raise ValueError(f"{path}: IDX dimensions are {shape}, expected {(count,) + item_shape}")
    body = np.frombuffer(data, dtype=np.uint8, offset=header)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} data bytes, expected {int(np.prod(shape))}")
    return body.reshape(shape)


# (resolved path, size, mtime_ns, verify) -> tensor; the 60k training set takes ~0.5 s to
# decompress and hash, and evaluation code loads it repeatedly.  Callers get clones.
_CACHE: Dict[Tuple, torch.Tensor] = {}
_CACHE_LOCK = threading.Lock()


def _load_file(path: Path, name: str, magic: int, count: int, item_shape, verify: bool) -> torch.Tensor:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, verify)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is None:
        array = _parse_idx(_verified(path, name, verify), path, magic, count, item_shape)
        cached = torch.from_numpy(array.copy())
        with _CACHE_LOCK:
            _CACHE[key] = cached
    return cached.clone()


def load_mnist(
    split: str = "train", data_dir: Optional[PathLike] = None, *, verify: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of one MNIST split.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (the 10,000 t10k images).
        data_dir: folder holding the four files (raw or .gz; directly or under ``MNIST/raw``);
            default :func:`default_data_dir`.
        verify: check the MD5 of every file's uncompressed bytes (default True).

    Returns:
        ``(images, labels)``: ``(n, 28, 28)`` uint8 (0 = background, 255 = ink) and ``(n,)``
        int64 in 0..9.  Fresh tensors (safe to modify).

    Raises:
        ValueError: unknown ``split``; an empty ``data_dir``; a malformed IDX file.
        TypeError: ``verify`` not a bool; ``data_dir`` not a path.
        MnistChecksumError: a file whose bytes are not the canonical ones.
        FileNotFoundError: no folder holds the four files (the message names where it looked).
    """
    split = _check_split(split)
    if not isinstance(verify, bool):  # verify=None must not switch the checksums off
        raise TypeError(f"verify must be True or False, got {verify!r}")
    images_path, labels_path = find_mnist_files(split, data_dir)
    images_name, labels_name = MNIST_FILES[split]
    count = _COUNTS[split]
    images = _load_file(images_path, images_name, _IMAGES_MAGIC, count, (28, 28), verify)
    labels = _load_file(labels_path, labels_name, _LABELS_MAGIC, count, (), verify).long()
    if int(labels.max()) > 9:
        raise ValueError(f"{labels_path}: labels must lie in 0..9, found {int(labels.max())}")
    return images, labels
