"""Posterior folders: :func:`save_posterior` and :func:`load_posterior`.

A trained posterior is a folder of safetensors weights (optionally sharded, in float32, float16,
bfloat16 or per-row int8) and a ``config.json`` naming a public class of
:mod:`etweedie.posteriors.engression` and its model config (:mod:`etweedie.training.checkpoint`
reads and checks the files).  :func:`load_posterior` also reads a run folder, a legacy single-file
``posterior.pt`` and a training ``checkpoint.pt``, all without unpickling code, and checks the
config's network against the weights' names, shapes and kinds before building anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from .._checks import check_device, check_float, require
from ..posteriors import engression as _models
from .checkpoint import CheckpointError, check_finite_weights, load_weights, safe_torch_load, save_weights

__all__ = ["load_posterior", "save_posterior"]

CHECKPOINT_FILE = "checkpoint.pt"
POSTERIOR_DIR = "posterior"
#: the single-file posterior of earlier versions (still loaded, never written)
LEGACY_POSTERIOR_FILE = "posterior.pt"
POSTERIOR_FORMAT = "etweedie.posterior/2"
LEGACY_POSTERIOR_FORMAT = "etweedie.posterior/1"
CHECKPOINT_FORMAT = "etweedie.checkpoint/1"
#: The stored precisions of a posterior folder's weights (loading casts back to float32).
POSTERIOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _posterior_class(name, what: str = "architecture"):
    """The posterior class ``name`` of :mod:`etweedie.posteriors.engression` (only its public nn.Module classes:
    a saved config can never name arbitrary code)."""
    cls = getattr(_models, name, None) if isinstance(name, str) else None
    public = getattr(_models, "__all__", ())
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and name in public):
        choices = [n for n in public if isinstance(getattr(_models, n, None), type)
                   and issubclass(getattr(_models, n), torch.nn.Module)]
        raise ValueError(f"{what} must name a posterior class of etweedie.posteriors.engression (one of {choices}), got {name!r}")
    return cls


def save_posterior(
    model: torch.nn.Module,
    path: Union[str, os.PathLike],
    *,
    train_config: Optional[Dict[str, Any]] = None,
    step: Optional[int] = None,
    dtype: str = "float32",
    shard_mb: Optional[float] = 16.0,
    extra: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write a posterior as safetensors + ``config.json`` in the directory ``path`` (replaced atomically).

    ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"``: per-row int8 matrices and
    float16 vectors, :mod:`etweedie.training.checkpoint`) is the stored precision (loading casts back to
    the model's float32); ``shard_mb`` bounds every file (None: one file);
    ``extra`` (JSON-able) is stored in ``config.json`` (e.g. a model card).  The model's class must
    be a public class of :mod:`etweedie.posteriors.engression` with a ``config`` dict.
    """
    _posterior_class(type(model).__name__, "the model's class")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"path {str(path)!r} is an existing file; a posterior is written as a folder")
    require(dtype in POSTERIOR_DTYPES, "dtype", f"one of {tuple(POSTERIOR_DTYPES)}", dtype)
    if shard_mb is not None:
        check_float(shard_mb, "shard_mb", minimum=0, strict=True)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    reserved = sorted(set(extra or {}) & {"format", "class", "model_config", "step", "train_config", "weights"})
    if reserved:
        raise ValueError(f"extra must not set the keys the loader reads, got {reserved}")
    meta = {
        "format": POSTERIOR_FORMAT,
        "class": type(model).__name__,
        "model_config": model.config,
        "step": step,
        "train_config": train_config,
        **(extra or {}),
    }
    limit = None if shard_mb is None else max(1024, int(shard_mb * 1024 * 1024))
    return save_weights(model.state_dict(), path, meta, dtype=POSTERIOR_DTYPES[dtype], max_shard_bytes=limit)


def _build_from(class_name: str, model_config: Dict[str, Any], state: Dict[str, torch.Tensor], where: str):
    cls = _posterior_class(class_name, f"the model class in {where}")
    if not isinstance(model_config, dict):
        raise CheckpointError(f"{where}: model_config must be a dict, got {type(model_config).__name__}")
    try:
        # the shapes the config implies, checked against the weights before anything is allocated:
        # a config.json from elsewhere could otherwise ask for a network of any size
        # (the architecture's size limits bound this layout's time)
        with torch.device("meta"):
            expected = cls(**model_config).state_dict()
        shapes = {k: tuple(v.shape) for k, v in expected.items()}
        given = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        if shapes != given:
            wrong = sorted(set(shapes) ^ set(given)) or sorted(k for k in shapes if shapes[k] != given[k])
            raise ValueError(f"the weights' names or shapes differ from the config's network (first: {wrong[0]!r})")
        kinds = [k for k, v in expected.items() if v.is_floating_point() != state[k].is_floating_point()]
        if kinds:
            raise ValueError(f"weight {kinds[0]!r} is {str(state[kinds[0]].dtype).replace('torch.', '')}, where the "
                             f"network holds {str(expected[kinds[0]].dtype).replace('torch.', '')}")
        model = cls(**model_config)
        model.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{where}: the weights do not fit the saved model config: {str(exc).splitlines()[0]}") from None
    check_finite_weights(model.state_dict(), where)
    return model


def load_posterior(path: Union[str, os.PathLike], device="cpu") -> torch.nn.Module:
    """Load a trained posterior, in eval mode on ``device``, without unpickling any code.

    ``path`` may be a posterior directory (``config.json`` + safetensors, sharded or not), a run
    directory (its ``posterior/``, else its legacy ``posterior.pt``, else its ``checkpoint.pt``),
    a legacy single-file ``posterior.pt`` or a training ``checkpoint.pt`` (the EMA weights when it
    has them); the torch files are read with ``weights_only=True``.  Convert a legacy file with
    ``save_posterior(load_posterior("posterior.pt"), "posterior")``.

    ``path`` may also be the name of a posterior shipped with the repository
    (:data:`etweedie.training.pretrained.PRETRAINED`, e.g. ``load_posterior("mnist")``) when no file or
    folder of that name exists.

    Raises:
        ValueError: nothing loadable at ``path``.
        CheckpointError: a corrupted, truncated or unsafe file (a subclass of ValueError).
    """
    from .pretrained import PRETRAINED, resolve_pretrained

    device = check_device(device, "device")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")

    if isinstance(path, str) and path in PRETRAINED and not Path(path).exists():
        path = resolve_pretrained(path)
    path = Path(path)
    if path.is_dir() and not (path / "config.json").exists():
        for candidate in (path / POSTERIOR_DIR, path / LEGACY_POSTERIOR_FILE, path / CHECKPOINT_FILE):
            if candidate.exists():
                path = candidate
                break
    if path.is_dir():
        state, meta = load_weights(path)
        if meta.get("format") != POSTERIOR_FORMAT:
            raise CheckpointError(f"{str(path)!r} is not an etweedie posterior (format {meta.get('format')!r})")
        model = _build_from(meta.get("class"), meta.get("model_config"), state, str(path))
        return model.to(device).eval().requires_grad_(False)
    if not path.is_file():
        raise ValueError(f"path: no posterior or checkpoint at {str(path)!r}")
    blob = safe_torch_load(path, what="posterior")
    if not isinstance(blob, dict) or blob.get("format") not in (LEGACY_POSTERIOR_FORMAT, CHECKPOINT_FORMAT):
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise CheckpointError(f"{str(path)!r} is neither an etweedie posterior nor a training checkpoint (format {got!r})")
    if blob["format"] == LEGACY_POSTERIOR_FORMAT:
        state = blob.get("state_dict")
    else:
        state = blob.get("ema") if blob.get("ema") is not None else blob.get("model")
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(path)!r} holds no weights")
    model = _build_from(blob.get("model_class", "EngressionPosterior"), blob.get("model_config"), state, str(path))
    return model.to(device).eval().requires_grad_(False)
