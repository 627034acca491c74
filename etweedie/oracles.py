"""Oracle posteriors for the eight-Gaussians ring: the posterior-model protocol without training.

A posterior model in etweedie is anything with

    posterior.dim                                        the data dimension d
    posterior.sample(y (..., d), eta (..., 5), n, *, generator) -> (..., n, d)

where ``eta = NoiseParams(β, λ, σ, u, v).eta() = (β, log λ, log σ, u, v)`` is each query's own
noise tuple (DESIGN §2).  :class:`OraclePosterior` implements that protocol with the *true*
posterior X | Y = y of the eight-Gaussians ring (paper §5.1), so score estimation and its
evaluation can be tested and timed without a trained model:

* Gaussian isotropic rows (β = 2, u = v = 0): Σ = σ² I and the noise is N(0, (σ²/λ) I), whose
  posterior is an exact Gaussian mixture (:meth:`EightGaussians.posterior_sample`, realized
  RMS s = σ λ^{−1/2});
* every other row: sampling-importance-resampling from a clean bank
  (:func:`etweedie.data.posterior_sample_sir`) with that row's generalized-Gaussian law; its
  draws are bank points, exact as the bank grows.

Rows are grouped by equal η so that each distinct noise law is handled in one call.

Example::

    >>> import torch
    >>> from etweedie.noise import NoiseParams
    >>> oracle = OraclePosterior(bank_size=20_000, generator=torch.Generator().manual_seed(0))
    >>> eta = NoiseParams(1.4, 1.8, 0.57, 0.0, 0.6).eta().double()
    >>> oracle.sample(torch.zeros(3, 2, dtype=torch.float64), eta, 16, generator=torch.Generator().manual_seed(1)).shape
    torch.Size([3, 16, 2])
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import check_generator, check_int
from .data import EightGaussians, posterior_sample_sir
from .noise import NoiseParams

__all__ = ["OraclePosterior", "group_rows"]


def group_rows(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows of ``keys (R, k)`` and, for each input row, the index of its distinct row.

    Returns ``(unique (G, k), inverse (R,))``; the work of an oracle is one call per group.
    """
    if keys.shape[0] == 0:
        return keys, torch.zeros(0, dtype=torch.long, device=keys.device)
    return torch.unique(keys, dim=0, return_inverse=True)


class OraclePosterior:
    """The true denoising posterior of the eight-Gaussians ring, behind the posterior-model protocol.

    Args:
        ring: the clean law (default :class:`EightGaussians` ()).
        bank: clean points ``(M, 2)`` for SIR; drawn from ``ring`` when None.
        bank_size: M when the bank is drawn here (default 160,000, the paper's bank).
        generator: the ``torch.Generator`` the bank is drawn from (required when ``bank`` is None).
        dtype: dtype of the drawn bank (float64 default).

    ``sample(y, eta, n, generator=g)`` returns ``(..., n, 2)`` in y's dtype.
    """

    dim = 2

    def __init__(
        self,
        ring: Optional[EightGaussians] = None,
        bank: Optional[torch.Tensor] = None,
        *,
        bank_size: int = 160_000,
        generator: Optional[torch.Generator] = None,
        dtype: torch.dtype = torch.float64,
    ):
        self.ring = EightGaussians() if ring is None else ring
        if not isinstance(self.ring, EightGaussians):
            raise TypeError(f"ring must be an EightGaussians, got {type(self.ring).__name__}")
        if bank is None:
            bank_size = check_int(bank_size, "bank_size", minimum=1)
            generator = check_generator(generator, "generator (needed to draw the bank)")
            bank, _ = self.ring.sample(bank_size, generator, dtype=dtype)
        if not isinstance(bank, torch.Tensor) or not bank.is_floating_point():
            raise TypeError(f"bank must be a floating-point tensor (M, 2), got {type(bank).__name__}")
        if bank.dim() != 2 or bank.shape[-1] != 2 or bank.shape[0] == 0:
            raise ValueError(f"bank must have shape (M, 2) with M >= 1, got {tuple(bank.shape)}")
        self.bank = bank

    def __repr__(self) -> str:
        return f"OraclePosterior(ring={self.ring!r}, bank={self.bank.shape[0]} points)"

    @torch.no_grad()
    def sample(self, y: torch.Tensor, eta: torch.Tensor, n: int, *, generator: torch.Generator) -> torch.Tensor:
        """Draws from X | Y = y under each row's noise tuple.

        Args:
            y: noisy queries ``(..., 2)``.
            eta: ``(..., 5)`` conditioning vectors ``(β, log λ, log σ, u, v)``, broadcasting with y.
            n: draws per query (≥ 1).
            generator: the ``torch.Generator`` every random number comes from.

        Returns:
            ``(..., n, 2)`` in y's dtype.
        """
        generator = check_generator(generator)
        if not isinstance(y, torch.Tensor) or not y.is_floating_point():
            raise TypeError(f"y must be a floating-point tensor (..., 2), got {type(y).__name__}")
        if y.dim() < 1 or y.shape[-1] != 2:
            raise ValueError(f"y must have shape (..., 2), got {tuple(y.shape)}")
        n = check_int(n, "n", minimum=1)
        NoiseParams.from_eta(eta)  # validates the shape and the parameter ranges
        try:
            batch = torch.broadcast_shapes(y.shape[:-1], eta.shape[:-1])
        except RuntimeError:
            raise ValueError(f"eta {tuple(eta.shape)} must broadcast with y {tuple(y.shape)} over the batch dims") from None
        rows_y = y.expand(*batch, 2).reshape(-1, 2)
        rows_eta = eta.to(torch.float64).expand(*batch, 5).reshape(-1, 5)
        out = y.new_empty(rows_y.shape[0], n, 2)
        unique, inverse = group_rows(rows_eta)
        bank = self.bank.to(dtype=y.dtype, device=y.device)
        for g in range(unique.shape[0]):
            index = (inverse == g).nonzero().squeeze(-1)
            beta, log_lam, log_sigma, u, v = (float(t) for t in unique[g])
            lam, sigma = float(torch.tensor(log_lam).exp()), float(torch.tensor(log_sigma).exp())
            params = NoiseParams(beta, lam, sigma, u, v)
            queries = rows_y[index]
            if beta == 2.0 and u == 0.0 and v == 0.0:
                s = float(params.realized_rms())  # c_{2,d} = 1: Σ = σ² I, noise N(0, Σ/λ)
                out[index] = self.ring.posterior_sample(queries, s, n, generator)
            else:
                law = NoiseParams(torch.tensor(beta, dtype=y.dtype), lam, sigma, u, v).noise(2)
                out[index] = posterior_sample_sir(queries, bank, law, n, generator)
        return out.reshape(*batch, n, 2)
