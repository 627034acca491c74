"""Triton kernels of etweedie (installed as ``etweedie.kernels``; DESIGN §4).

One module per op — :mod:`.et_score`, :mod:`.langevin_step`, :mod:`.is_score`,
:mod:`.energy_score`, :mod:`.energy_distance` (pair engine: :mod:`._energy`) — each with
private ``_<op>_forward_kernel`` / ``_<op>_backward_kernel``, host functions
``<op>_forward`` / ``<op>_backward`` on the canonical tensors of etweedie/ops/_rows.py, and
the torch ops ``etweedie_triton::<op>_fwd`` (``torch.library.triton_op`` so torch.compile
traces into the kernels; an opaque custom op under TRITON_INTERPRET=1) with autograd.

Importing needs triton but no GPU (nothing is queried at import time).  Set
``TRITON_INTERPRET=1`` *before* the first import to run the kernels on CPU tensors: triton
decides between compiling and interpreting when a kernel is defined.
"""

import importlib

# Exported names -> defining submodule.  Loaded on first use, so that importing the package
# (or locating it, as etweedie.backends does) neither imports triton nor defines a kernel.
_EXPORTS = {
    "et_score_forward": "et_score",
    "et_score_backward": "et_score",
    "et_score_op": "et_score",
    "langevin_step_forward": "langevin_step",
    "langevin_step_backward": "langevin_step",
    "langevin_step_op": "langevin_step",
    "is_score_forward": "is_score",
    "is_score_op": "is_score",
    "energy_score_forward": "energy_score",
    "energy_score_backward": "energy_score",
    "energy_score_fwd_op": "energy_score",
    "energy_distance_forward": "energy_distance",
    "energy_distance_backward": "energy_distance",
    "energy_distance_fwd_op": "energy_distance",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
