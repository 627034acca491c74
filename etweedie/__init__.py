"""etweedie: Energy-Tweedie scores from denoising-posterior samples.

The Stein score of a noisy marginal equals the path derivative of a matched energy score at
the denoising posterior; in practice, posterior samples x_i ~ P(X | Y = y) give

    s(y) = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i)

for generalized-Gaussian noise q(u) ∝ exp(−(λ/β)‖u‖_P^β).  The ops are fused kernels
(C++/OpenMP on CPU; CUDA C++ and Triton on GPU) behind autograd-aware torch ops.

    >>> import torch, etweedie
    >>> y, x = torch.zeros(3, 2), torch.randn(3, 64, 2, generator=torch.Generator().manual_seed(0))
    >>> etweedie.et_score(y, x, beta=1.4, lam=1.8).shape
    torch.Size([3, 2])
"""

from . import backends
from .backends import use_backend
from .geometry import Metric
from .noise import GeneralizedGaussian, Laplace, NoiseParams, StudentT
from .ops import energy_distance, energy_score, et_score, is_score, kernel_score, langevin_step, student_t_score
from .ops._debug import set_debug

__version__ = "0.1.0"

__all__ = [
    "GeneralizedGaussian",
    "Laplace",
    "Metric",
    "NoiseParams",
    "StudentT",
    "backends",
    "energy_distance",
    "energy_score",
    "et_score",
    "is_score",
    "kernel_score",
    "langevin_step",
    "student_t_score",
    "set_debug",
    "use_backend",
]
