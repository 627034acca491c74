"""Files a training run writes and reads, safely: weights as safetensors (optionally sharded),
resume state as torch files read without unpickling code, atomic writes, and a run lock.

**Weights users exchange** are a directory (no pickle anywhere)::

    posterior/
        config.json                          format, model class + constructor config, dtype, step,
                                             training config, sha256 of every weight file
        model.safetensors                    one file when the weights fit in one shard, else
        model-00001-of-0000N.safetensors     N shards of at most ``max_shard_bytes`` each and
        model.safetensors.index.json         {"weight_map": {stored key: file}, "parts": {name: [keys]}}

A tensor larger than a shard is split along its first dimension into parts (``name::part0``, …)
that :func:`load_weights` joins, so the shard bound holds for any model.  The layout follows the
sharded-safetensors convention (file names, an index with a weight map) so other tools can read
the unsplit tensors directly.

**int8 weights** (``dtype=torch.int8``): every floating-point matrix (2-D or more, at least
``INT8_MIN_NUMEL`` values) is stored as symmetric per-row int8, q = round(w / s) with
s = max|w_row| / 127 (``name`` int8, ``name::scale`` float32 per row); the other tensors (biases,
small ones) as float16.  :func:`load_weights` returns the dequantized float32 q·s.  A quarter of
float32's bytes (half of float16's) at an error of at most half a step, s / 2, per weight.

**Resume state** (optimizer moments, generator states) stays a torch file, always loaded with
``torch.load(..., weights_only=True)``: tensors, numbers, strings, lists and dicts only, so a
crafted pickle is refused (:class:`CheckpointError`) before any of its code runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..utils import atomic_write

__all__ = [
    "CheckpointError",
    "RunLock",
    "RunLockedError",
    "atomic_torch_save",
    "atomic_write_text",
    "load_weights",
    "safe_torch_load",
    "save_weights",
    "WEIGHTS_CONFIG",
    "MAX_SHARD_BYTES",
]

WEIGHTS_CONFIG = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: Largest shard written by default (16 MiB): small enough for any git host's file limits.
MAX_SHARD_BYTES = 16 * 1024 * 1024
_PART = "::part"
_SCALE = "::scale"
#: The smallest matrix stored as int8 by ``save_weights(..., dtype=torch.int8)`` (smaller: float16).
INT8_MIN_NUMEL = 4096
#: int8 rows hold weights within float16's range, like the float16 tensors stored beside them:
#: a row's scale is at most this (a larger one in a file is damage, not a trained weight).
INT8_MAX_SCALE = 65504.0 / 127.0
#: The largest JSON file of a weights directory (``config.json``, the index) that is read.
MAX_JSON_BYTES = 8 * 1024 * 1024
#: The most bytes of weight files :func:`load_weights` reads by default (64 GiB).
MAX_WEIGHTS_BYTES = 64 * 1024**3


def _quantize_rows(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q int8, s float32 per row): t ≈ q · s row by row, s = max|row| / 127 (1 for an all-zero row)."""
    rows = t.detach().to(torch.float32).reshape(t.shape[0], -1)
    amax = rows.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("int8 weights need finite values (a tensor holds NaN or inf)")
    if bool((amax > INT8_MAX_SCALE * 127).any()):
        raise ValueError(f"int8 weights hold values within float16's range (|w| <= {INT8_MAX_SCALE * 127:g}), got "
                         f"{float(amax.max()):.4g}; save this tensor in float32")
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(t.shape), s


PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be read safely: corrupted, truncated, empty, of
    another format, or holding pickled objects other than tensors and plain data."""


class RunLockedError(RuntimeError):
    """Another process holds the run directory's lock (two trainings on one ``--out``)."""


# ---------------------------------------------------------------------------- atomic writes
def atomic_torch_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename (a kill leaves the old file).

    torch writes through a Python file object here, so a full disk is the ``OSError`` (ENOSPC) it
    is, not the opaque RuntimeError torch's writer turns it into."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            sink = _WriteErrors(fh)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise

    atomic_write(path, write)


class _WriteErrors:
    """A binary file for ``torch.save`` that remembers the OSError a write raised."""

    def __init__(self, fh):
        self._fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    atomic_write(path, text)


# ---------------------------------------------------------------------------- torch files
def safe_torch_load(path: PathLike, *, what: str = "checkpoint") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; any failure is a :class:`CheckpointError`
    naming the file (a pickle asking for a class or function other than tensors is refused
    without running it)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: no such file {str(path)!r}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what} {str(path)!r} is empty")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (zip), EOFError, ...: all mean "unreadable"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{what} {str(path)!r} cannot be loaded safely (corrupted, truncated, or holds objects other "
            f"than tensors and plain data): {first}"
        ) from None


# ---------------------------------------------------------------------------- safetensors weights
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _split(name: str, t: torch.Tensor, limit: int) -> List[Tuple[str, torch.Tensor]]:
    nbytes = t.numel() * t.element_size()
    if nbytes <= limit or t.dim() == 0 or t.shape[0] < 2:
        return [(name, t)]
    row = nbytes // t.shape[0]
    rows = max(1, limit // max(row, 1))
    if row > limit:
        raise ValueError(f"max_shard_bytes={limit} is smaller than one row of {name!r} ({row} bytes)")
    return [(f"{name}{_PART}{k}", piece) for k, piece in enumerate(t.split(rows, dim=0))]


def _check_save(state, directory, config, dtype, max_shard_bytes) -> Path:
    """The target folder of :func:`save_weights`, its arguments checked (the first bad one raises)
    before any file is written."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        # (the swap would move the file aside and fail, leaving the user's file renamed)
        raise ValueError(f"directory {str(directory)!r} is an existing file; weights are written as a folder "
                         f"(give another path)")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1024):
        raise ValueError(f"max_shard_bytes must be an int >= 1024 or None, got {max_shard_bytes!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
    if dtype is not None and not (dtype.is_floating_point or dtype == torch.int8):
        raise ValueError(f"dtype must be a floating-point dtype, torch.int8 or None, got {dtype}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of name -> tensor, got {type(state).__name__}")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    try:
        json.dumps(config)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"config must be JSON-serializable: {exc}") from None
    return directory


def _stored(state: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> List[Tuple[str, torch.Tensor]]:
    """(key, tensor) as stored, on the CPU: each tensor checked, then cast to ``dtype`` (with int8,
    the large matrices as per-row int8 plus their ``::scale``, the rest float16)."""
    int8 = dtype == torch.int8
    items = []
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state must map names (str) to tensors, got {name!r}: {type(t).__name__}")
        if _PART in name or _SCALE in name:
            raise ValueError(f"tensor name {name!r} must not contain {_PART!r} or {_SCALE!r}")
        t = t.detach().to("cpu")
        if int8 and t.is_floating_point() and t.dim() >= 2 and t.numel() >= INT8_MIN_NUMEL:
            q, scale = _quantize_rows(t)
            items += [(name, q), (name + _SCALE, scale)]
            continue
        if dtype is not None and t.is_floating_point():
            narrow = torch.float16 if int8 else dtype
            cast = t.to(narrow)
            if bool(torch.isfinite(t).all()) and not bool(torch.isfinite(cast).all()):
                raise ValueError(f"tensor {name!r} does not fit {narrow} (largest magnitude {float(t.abs().max()):.4g}, "
                                 f"{narrow} holds up to {torch.finfo(narrow).max:.4g}); save it in a wider dtype")
            t = cast
        items.append((name, t))
    return items


def _pieces(items: List[Tuple[str, torch.Tensor]], max_shard_bytes: Optional[int]):
    """(every stored (key, contiguous copy), {name: its part keys} of the tensors split to fit a shard)."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    parts: Dict[str, List[str]] = {}
    for name, t in items:
        pieces = _split(name, t, max_shard_bytes) if max_shard_bytes else [(name, t)]
        if len(pieces) > 1:
            parts[name] = [key for key, _ in pieces]
        tensors += [(key, piece.contiguous().clone()) for key, piece in pieces]
    return tensors, parts


def _shards(tensors: List[Tuple[str, torch.Tensor]], max_shard_bytes: Optional[int]) -> List[Dict[str, torch.Tensor]]:
    """The tensors in order, a new shard begun wherever the next one would pass ``max_shard_bytes``."""
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def _write_shards(tmp: Path, shards: List[Dict[str, torch.Tensor]], tensors, parts: Dict[str, List[str]]) -> List[str]:
    """The shard files (and, for several, the index) in ``tmp``; returns the shard file names."""
    from safetensors.torch import save_file

    names = [WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    for name, shard in zip(names, shards):
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for _, t in tensors)},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
            "parts": parts,
        }
        (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return names


def _write_config(tmp: Path, config: Dict[str, Any], names: List[str], dtype: Optional[torch.dtype]) -> None:
    """``config.json``: the user's config plus the stored dtype and the sha256 of every weight file."""
    meta = dict(config)
    meta["weights"] = {"files": {name: _sha256(tmp / name) for name in names},
                       "dtype": str(dtype).replace("torch.", "") if dtype is not None else "as saved"}
    if len(names) > 1:
        meta["weights"]["index"] = _sha256(tmp / WEIGHTS_INDEX)
    if dtype == torch.int8:
        meta["weights"]["int8"] = (f"matrices of >= {INT8_MIN_NUMEL} values: symmetric per-row int8 with a float32 "
                                   f"scale per row ('<name>{_SCALE}'); other tensors float16")
    (tmp / WEIGHTS_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")


def _swap_in(tmp: Path, directory: Path) -> None:
    """``tmp`` renamed to ``directory``, the folder there before (if any) moved aside first and then deleted."""
    old = directory.with_name(f"{directory.name}.old")
    _remove(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    _remove(old)


def save_weights(
    state: Dict[str, torch.Tensor],
    directory: PathLike,
    config: Dict[str, Any],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: Optional[int] = MAX_SHARD_BYTES,
) -> Path:
    """Write ``state`` (name → tensor) and the JSON-able ``config`` as a weights directory.

    Floating-point tensors are cast to ``dtype`` when given (e.g. ``torch.float16`` halves the
    files; ``torch.int8`` stores matrices as per-row int8, see the module's docstring); with
    ``max_shard_bytes`` (default 16 MiB, None: one file) every file stays within the bound.  The directory is replaced atomically (written beside it, then renamed).  Returns it.
    """
    directory = _check_save(state, directory, config, dtype, max_shard_bytes)
    tensors, parts = _pieces(_stored(state, dtype), max_shard_bytes)
    shards = _shards(tensors, max_shard_bytes)
    tmp = directory.with_name(f"{directory.name}.tmp")
    _remove(tmp)
    tmp.mkdir(parents=True)
    names = _write_shards(tmp, shards, tensors, parts)
    _write_config(tmp, config, names, dtype)
    for name in os.listdir(tmp):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    _swap_in(tmp, directory)
    return directory


def _remove(path: Path) -> None:
    """Delete ``path`` (a folder a killed write left behind, or a stray file of that name)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _member(directory: Path, name: Any, limit: int, what: str) -> Path:
    """``directory / name`` when it is a regular file of at most ``limit`` bytes inside the folder
    (a plain file name; not a symlink, device or folder), else a :class:`CheckpointError`."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"{str(directory)!r}: {what} {name!r} is not a file name inside the folder")
    path = directory / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {str(path)!r} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{what} {str(path)!r} is a symbolic link; a weights folder holds its own regular files")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{what} {str(path)!r} is not a regular file")
    if info.st_size > limit:
        raise CheckpointError(f"{what} {str(path)!r} has {info.st_size:,} bytes, more than the {limit:,} read")
    return path


def _read_json(path: Path, what: str) -> Any:
    """The JSON document in ``path`` (already checked by :func:`_member`), read without following a
    link; unreadable, not UTF-8, not JSON or nested beyond the parser are CheckpointErrors."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} {str(path)!r} is larger than {MAX_JSON_BYTES:,} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{what} {str(path)!r} is nested too deeply to be a weights config") from None


def _joined_parts(index: Any, state: Dict[str, torch.Tensor], where: str) -> None:
    """Join the split tensors the index lists, in ``state``: each name's parts must be exactly
    ``name::part0, name::part1, …`` in that order (a reordered or foreign list is refused)."""
    parts = index.get("parts", {}) if isinstance(index, dict) else None
    if not isinstance(parts, dict):
        raise CheckpointError(f"{where}: 'parts' must map tensor names to their part keys")
    for name, keys in parts.items():
        expected = [f"{name}{_PART}{k}" for k in range(len(keys))] if isinstance(keys, list) else None
        if not isinstance(name, str) or expected is None or len(keys) < 2 or keys != expected:
            raise CheckpointError(f"{where}: the parts of {name!r} must be the list {name!r}::part0, ::part1, … in "
                                  f"order, got {keys!r}"[:400])
        if name in state:
            raise CheckpointError(f"{where}: {name!r} is stored whole and in parts")
        missing = [k for k in keys if k not in state]
        if missing:
            raise CheckpointError(f"weights of {name!r} are incomplete: missing {missing}")
        try:
            state[name] = torch.cat([state.pop(k) for k in keys], dim=0)
        except RuntimeError as exc:
            raise CheckpointError(f"{where}: the parts of {name!r} do not join: {str(exc).splitlines()[0]}") from None


def _dequantized(state: Dict[str, torch.Tensor]) -> None:
    """Replace every int8 matrix and its ``::scale`` by the float32 q·s, in ``state``; a scale that
    is not a finite positive float32 vector of one value per row, at most :data:`INT8_MAX_SCALE`,
    is a CheckpointError."""
    for key in [k for k in state if k.endswith(_SCALE)]:
        name, scale = key[: -len(_SCALE)], state.pop(key)
        q = state.get(name)
        if q is None or q.dtype != torch.int8 or q.dim() < 1 or scale.dim() != 1 or scale.shape[0] != q.shape[0]:
            raise CheckpointError(f"int8 weights of {name!r} do not match their scale {key!r}")
        if scale.dtype != torch.float32 or not bool(((scale > 0) & (scale <= INT8_MAX_SCALE)).all()):
            raise CheckpointError(f"the int8 scale {key!r} must be float32 in (0, {INT8_MAX_SCALE:.4g}] (a damaged "
                                  f"or foreign file), got dtype {str(scale.dtype).replace('torch.', '')}, "
                                  f"largest {float(scale.float().abs().max()) if scale.numel() else 0:.4g}")
        state[name] = q.to(torch.float32) * scale.reshape(-1, *([1] * (q.dim() - 1)))


def load_weights(directory: PathLike, *, verify: bool = True,
                 max_bytes: int = MAX_WEIGHTS_BYTES) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Read a weights directory written by :func:`save_weights`: ``(state, config)``.

    Only regular files inside the folder are read (no symbolic links), JSON files up to
    :data:`MAX_JSON_BYTES` and weight files up to ``max_bytes`` in all.  With ``verify`` every
    weight file's sha256, and the index's, is checked against ``config.json``.  Shards are
    joined, split tensors re-assembled in their canonical order and int8 matrices dequantized.
    Any problem is a :class:`CheckpointError` naming the file and the field.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{str(directory)!r} is a file, not a weights directory (give the folder that holds "
                              f"{WEIGHTS_CONFIG})")
    if not directory.is_dir():
        raise CheckpointError(f"weights directory {str(directory)!r} does not exist")
    if not os.path.lexists(directory / WEIGHTS_CONFIG):
        raise CheckpointError(f"weights directory {str(directory)!r} has no {WEIGHTS_CONFIG}")
    cfg_path = _member(directory, WEIGHTS_CONFIG, MAX_JSON_BYTES, "weights config")
    config = _read_json(cfg_path, "weights config")
    weights = config.get("weights") if isinstance(config, dict) else None
    files = weights.get("files") if isinstance(weights, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{str(cfg_path)!r} lists no weight files (not an etweedie weights directory)")
    paths = {name: _member(directory, name, max_bytes, f"weights file listed in {WEIGHTS_CONFIG}") for name in files}
    total = sum(p.stat().st_size for p in paths.values())
    if total > max_bytes:
        raise CheckpointError(f"{str(directory)!r}: the weight files hold {total:,} bytes, more than max_bytes = {max_bytes:,}")
    state: Dict[str, torch.Tensor] = {}
    for name, path in paths.items():
        if verify and _sha256(path) != files[name]:
            raise CheckpointError(f"weights file {str(path)!r} is corrupted or truncated (sha256 differs from {WEIGHTS_CONFIG})")
        try:
            shard = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"weights file {str(path)!r} is not a readable safetensors file: {exc}") from None
        clash = sorted(set(shard) & set(state))
        if clash:
            raise CheckpointError(f"weights file {str(path)!r} repeats tensor {clash[0]!r} of another shard")
        state.update(shard)
    index_digest = weights.get("index")
    if len(files) > 1 or index_digest is not None or os.path.lexists(directory / WEIGHTS_INDEX):
        index_path = _member(directory, WEIGHTS_INDEX, MAX_JSON_BYTES, "weights index")
        if verify and index_digest is not None and _sha256(index_path) != index_digest:
            raise CheckpointError(f"weights index {str(index_path)!r} differs from the sha256 in {WEIGHTS_CONFIG}")
        _joined_parts(_read_json(index_path, "weights index"), state, str(index_path))
    _dequantized(state)
    return state, config


# ---------------------------------------------------------------------------- run lock
def check_finite_weights(state: Dict[str, torch.Tensor], where: str) -> None:
    """A NaN or infinite weight is damage (training stops on a non-finite loss before it writes one):
    a CheckpointError naming the tensor, rather than a posterior that silently draws NaN."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{where}: weight {name!r} holds NaN or infinite values (a damaged file)")


#: What a training checkpoint holds besides the optional ``ema`` and ``fitted_steps``.
TRAINING_FIELDS = ("config", "model", "optimizer", "generators", "step", "wall_time", "cpu_time", "interval_sum",
                   "interval_count", "last_logged_loss")

#: Adam settings a checkpoint's optimizer must share with the run (it sets only the lr per step).
_ADAM_HYPERPARAMETERS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


def read_training_checkpoint(path: PathLike, fmt: str, differences: Callable[[Dict[str, Any]], List[str]]) -> Dict[str, Any]:
    """A training checkpoint's contents, read without unpickling code: its ``format`` is ``fmt``,
    every one of :data:`TRAINING_FIELDS` is there, and ``differences(checkpoint_config)`` (the
    run's config changes that may not be resumed) is empty; else CheckpointError / ValueError."""
    path = Path(path)
    ckpt = safe_torch_load(path, what="training checkpoint")
    if not isinstance(ckpt, dict) or ckpt.get("format") != fmt:
        got = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{str(path)!r} is not an etweedie training checkpoint (format {got!r})")
    missing = [k for k in TRAINING_FIELDS if k not in ckpt]
    if missing:
        raise CheckpointError(f"training checkpoint {str(path)!r} is incomplete: missing {missing}")
    for key in ("config", "model", "optimizer", "generators"):
        if not isinstance(ckpt[key], dict):
            raise CheckpointError(f"training checkpoint {str(path)!r}: {key!r} must be a dict, "
                                  f"got {type(ckpt[key]).__name__}")
    diffs = differences(ckpt["config"])
    if diffs:
        raise ValueError(
            f"config differs from the checkpoint in {path}: {'; '.join(diffs)}. "
            "Use the same config to resume, or resume=False (--no-resume) / another --out to start afresh"
        )
    return ckpt


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` plus what it does not check: the hyperparameters (the run sets
    only lr) and the moments' shapes and values (damage there would fail or turn NaN steps later)."""
    fresh_groups = [{k: g[k] for k in _ADAM_HYPERPARAMETERS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for fresh, group in zip(fresh_groups, optimizer.param_groups):
        for key, want in fresh.items():
            if group.get(key) != want:
                raise ValueError(f"optimizer {key} is {group.get(key)!r}, this run's Adam uses {want!r}")
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state {key!r} must be a tensor, got {type(value).__name__}")
                if value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)} for a "
                                     f"parameter of shape {tuple(p.shape)}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"optimizer state {key!r} holds NaN or infinite values")


def _counters(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    step, wall, cpu = ckpt["step"], float(ckpt["wall_time"]), float(ckpt["cpu_time"])
    if not (_is_int(step) and step >= 0):
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not (math.isfinite(wall) and math.isfinite(cpu) and wall >= 0 and cpu >= 0):
        raise ValueError(f"wall_time and cpu_time must be finite and >= 0, got {wall!r}, {cpu!r}")
    interval_sum, interval_count = ckpt["interval_sum"], ckpt["interval_count"]
    last_logged_loss, fitted_steps = ckpt["last_logged_loss"], ckpt.get("fitted_steps")
    if not (_is_real(interval_sum) and math.isfinite(interval_sum)):
        raise ValueError(f"interval_sum must be a finite number, got {interval_sum!r}")
    if not (_is_int(interval_count) and 0 <= interval_count <= step):
        raise ValueError(f"interval_count must be an int in [0, step={step}], got {interval_count!r}")
    if not _is_real(last_logged_loss):  # NaN before the first log line
        raise ValueError(f"last_logged_loss must be a number, got {last_logged_loss!r}")
    if fitted_steps is not None and not (_is_int(fitted_steps) and fitted_steps >= 0):
        raise ValueError(f"fitted_steps must be None or an int >= 0, got {fitted_steps!r}")
    return {"step": step, "wall_time": wall, "cpu_time": cpu, "interval_sum": float(interval_sum),
            "interval_count": interval_count, "last_logged_loss": float(last_logged_loss), "fitted_steps": fitted_steps}


def restore_training(ckpt: Dict[str, Any], path: PathLike, *, model: torch.nn.Module, ema: Optional[torch.nn.Module],
                     optimizer: torch.optim.Optimizer, generators: Dict[str, torch.Generator]) -> Dict[str, Any]:
    """Load a checkpoint read by :func:`read_training_checkpoint` into the run's model, EMA model,
    optimizer and generators (every generator named in ``generators``), checking what the loaders
    do not; returns its counters (``step``, ``wall_time``, ``cpu_time``, ``interval_sum``,
    ``interval_count``, ``last_logged_loss``, ``fitted_steps``).  Anything that does not fit is a
    CheckpointError naming the file."""
    try:
        model.load_state_dict(ckpt["model"])
        if ema is not None:
            ema.load_state_dict(ckpt["ema"])
        _restore_optimizer(optimizer, ckpt["optimizer"])
        for name, generator in generators.items():
            generator.set_state(ckpt["generators"][name])
        counters = _counters(ckpt)
        check_finite_weights(model.state_dict(), "the model")
        if ema is not None:
            check_finite_weights(ema.state_dict(), "the EMA model")
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"training checkpoint {str(path)!r} does not fit this run "
                              f"(written on another device type or model?): {str(exc).splitlines()[0]}") from None
    return counters


class RunLock:
    """An exclusive, non-blocking lock on ``directory/train.lock`` held for a training run.

    A second run on the same directory raises :class:`RunLockedError` instead of sharing (and
    corrupting) its checkpoint and log.  The OS releases the lock when the process dies, so a
    killed run never leaves a stale lock.  (POSIX ``flock``; elsewhere the lock is a no-op.)
    """

    FILE = "train.lock"

    def __init__(self, directory: PathLike):
        self.path = Path(directory) / self.FILE
        self._fh = None

    def __enter__(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX
            return self
        self._fh = open(self.path, "a+")
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.close()
            self._fh = None
            raise RunLockedError(
                f"another training run is using {str(self.path.parent)!r} (it holds {self.FILE}); "
                "wait for it to finish or choose another --out"
            ) from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"{os.getpid()}\n")
        self._fh.flush()
        return self

    def __exit__(self, *exc) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the descriptor releases the flock
            self._fh = None
