"""Public ops: one module per op (validation, backend choice, autograd registration)."""

from .energy_distance import energy_distance
from .energy_score import energy_score
from .et_score import et_score
from .is_score import is_score
from .kernel_score import kernel_score
from .langevin_step import langevin_step
from .student_t_score import student_t_score

__all__ = [
    "energy_distance",
    "energy_score",
    "et_score",
    "is_score",
    "kernel_score",
    "langevin_step",
    "student_t_score",
]
