"""Denoising posteriors P(X | Y = y, η): what every score, sampler and estimator draws from.

The third stage of the data path (data → noise → **posterior** → score → sampler → metrics).

* :mod:`etweedie.posteriors.engression` — the learned conditional Engression generator
  ``x = g(y, η, ε)``, trained by :mod:`etweedie.training`;
* :mod:`etweedie.posteriors.known` — the known posterior of the eight-Gaussians ring (exact or SIR).
"""

from .engression import (
    default_eta_bounds, EngressionPosterior, ETA_DIM,
)
from .known import (
    group_rows, KnownPosterior,
)

__all__ = [
    "default_eta_bounds", "EngressionPosterior", "ETA_DIM", "group_rows", "KnownPosterior"
]
