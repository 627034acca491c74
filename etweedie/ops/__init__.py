"""Public ops: one module per op (validation, backend choice, autograd registration)."""

from .et_score import et_score
from .is_score import is_score
from .langevin_step import langevin_step

__all__ = ["et_score", "is_score", "langevin_step"]
