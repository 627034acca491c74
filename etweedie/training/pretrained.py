"""Pretrained posteriors shipped with the repository, by name.

A registered name resolves to a weights directory (safetensors shards plus ``config.json``,
:mod:`etweedie.training.checkpoint`) under the repository's ``pretrained/`` folder, so

    >>> from etweedie.training import load_posterior
    >>> posterior = load_posterior("mnist")                     # doctest: +SKIP

loads the CPU-scale MNIST posterior (``pretrained/mnist_cpu``; its ``MODEL_CARD.md`` says how it
was trained).  The folder is looked up in ``$ETWEEDIE_PRETRAINED_DIR`` first, then beside the
package (a source checkout); an installed wheel does not carry the weights, so there pass the
folder's path instead.

Names (:data:`PRETRAINED`):

* ``"mnist"`` / ``"mnist_cpu"``: the image Engression posterior trained with
  ``configs/mnist_cpu.toml`` (d = 784, pixels in [0, 1], σ ∈ [0.025, 6], β ∈ [1.3, 2],
  λ ∈ [1, 2.5], ‖(u, v)‖ ≤ 0.7).
* ``"mnist_full"``: the same posterior law at the paper's width 2,560 (18.3 M parameters),
  trained on one GPU with ``configs/mnist_full.toml``; stored as per-row int8 matrices
  (dequantized to float32 on load).  Slower on a CPU than ``"mnist"`` by its width.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

__all__ = ["PRETRAINED", "pretrained_dir", "resolve_pretrained"]

#: registered name -> folder name under the pretrained root
PRETRAINED: Dict[str, str] = {"mnist": "mnist_cpu", "mnist_cpu": "mnist_cpu", "mnist_full": "mnist_full"}
ENV_VAR = "ETWEEDIE_PRETRAINED_DIR"


def pretrained_dir() -> Path:
    """The folder holding the pretrained weights: ``$ETWEEDIE_PRETRAINED_DIR`` or ``<repository>/pretrained``."""
    env = os.environ.get(ENV_VAR)
    # expanduser as for $ETWEEDIE_MNIST_DIR: a quoted "~/weights" reaches us unexpanded
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "pretrained"


def resolve_pretrained(name: str) -> Path:
    """The weights directory of a registered name (:data:`PRETRAINED`).

    Raises ValueError for an unknown name (listing the known ones) or when the registered
    folder is missing (e.g. an installed package without the repository's ``pretrained/``).

    Example::

        >>> resolve_pretrained("mnist").name
        'mnist_cpu'
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (a registered pretrained name), got {type(name).__name__}")
    if name not in PRETRAINED:
        raise ValueError(f"name must be a registered pretrained posterior ({', '.join(sorted(PRETRAINED))}), got {name!r}")
    folder = pretrained_dir() / PRETRAINED[name]
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"pretrained posterior {name!r}: no weights at {str(folder)!r} (the weights ship with the source "
            f"repository's pretrained/ folder; set ${ENV_VAR} to that folder or pass the weights directory's path)"
        )
    return folder
