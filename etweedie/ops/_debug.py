"""When the ops read values: the debug switch and the value-check rule.

Debug checks (NaN/inf in the data, :func:`set_debug` or ETWEEDIE_DEBUG=1) are off by default.
:func:`value_checks` is the one rule for every check, scan and flag that reads a tensor's values
on the host: CPU tensors always, GPU tensors only with debug checks on (a read stalls the host
until the GPU catches up), never under torch.compile or torch.func.vmap.
"""

from __future__ import annotations

import os

import torch

from ..geometry import _functorch_wrapped, _in_vmap


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


# Debug checks (NaN/inf in the data) cost a full pass over x, so they are off by default.
_DEBUG = {"on": os.environ.get("ETWEEDIE_DEBUG", "0") not in ("", "0")}


def set_debug(enabled: bool) -> None:
    """Turn the ops' finiteness checks on or off (also: environment ETWEEDIE_DEBUG=1).

    With checks on, a NaN or infinity in y, x, a bank or a parameter raises ValueError naming
    the argument instead of propagating into the result.

    Range checks of β, λ and step given as plain numbers always run.  Given as tensors, their
    values are checked on CPU always, but on a GPU only with debug checks on: reading a GPU
    tensor's values stalls the host until the GPU catches up, which would cost every call a
    device synchronization (measured: ~0.45 ms a call on an H200, more than the kernels).
    """
    _DEBUG["on"] = bool(enabled)


def value_checks(t: torch.Tensor) -> bool:
    """Whether value checks on ``t`` run now (CPU tensors, or any tensor with debug checks on),
    never under torch.compile (there they are graph asserts) or torch.func.vmap (no value to
    read: a vmapped call trusts its values, as a GPU call without debug checks does)."""
    return not _is_compiling() and (t.device.type == "cpu" or _DEBUG["on"]) and not (_functorch_wrapped(t) and _in_vmap())


def check_finite(op: str, **tensors) -> None:
    """ValueError naming the first non-finite argument (only when debug checks are on)."""
    if not _DEBUG["on"] or _is_compiling():
        return
    for name, t in tensors.items():
        if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{op}: {name} contains NaN or infinite values (debug checks are on)")


def near_mode(y: torch.Tensor) -> str:
    """The reference's near-pair mode for a call on y (``reference.NEAR_PAIR_MODES``): "index"
    where values are read (:func:`value_checks`), else the select that reads none."""
    return "index" if value_checks(y) else "where"
