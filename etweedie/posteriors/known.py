"""A known denoising posterior P(X | Y = y, η) for the eight-Gaussians ring under the five-parameter noise.

The sampler (:func:`etweedie.sample.sample_langevin`) needs only
``posterior.sample(y (..., d), eta (..., 5), n, *, generator) -> (..., n, d)``, the contract of
the learned Engression posterior.  :class:`KnownPosterior` meets it without training, which
makes the sampler testable against ground truth and gives a model-free demo:

* ``"exact"`` — β = 2 (Gaussian noise with any covariance C = Cov(u), including the
  non-diagonal (u, v) geometry).  With x ~ Σ_k (1/K) N(μ_k, τ² I) the posterior is the
  Gaussian mixture with weights ∝ N(y; μ_k, A), A = τ² I + C, means μ_k + τ² A⁻¹ (y − μ_k)
  and covariance τ² I − τ⁴ A⁻¹ (the isotropic case is ``EightGaussians.posterior_sample``).
* ``"importance"`` — any β: defensive sampling-importance-resampling with fresh proposals at
  every call.  Half the K proposals come from the prior p (the ring), half from ``y − u``, u ~ q_η;
  with the mixture proposal g = ½ p(x) + ½ q(y − x) the weights ``p(x) q(y − x) / g(x)`` are
  bounded by 2·max(p, q) and the scheme is accurate both at large noise (the prior half
  covers the posterior) and at small noise (the noise half does).  n draws are resampled
  from the K weighted proposals.  Both densities are analytic, so no clean bank is needed.
* ``"sir"`` — the score oracle of the paper's score tables (§5.1): rows with isotropic Gaussian
  noise (β = 2, u = v = 0) exactly (:meth:`EightGaussians.posterior_sample`), every other row by
  :func:`etweedie.data.posterior_sample_sir` over a fixed clean bank (160,000 points in the
  paper; drawn here from ``generator`` when no ``bank`` is given), in y's dtype.  Its draws are
  bank points, exact as the bank grows; at small noise they stick to individual bank points.
* ``"auto"`` (default) — exact on rows with β = 2, importance on the others.

Rows are grouped by equal η, so that each distinct noise law is handled in one call.

Example::

    >>> import torch
    >>> from etweedie.noise import NoiseParams
    >>> post = KnownPosterior()
    >>> eta = NoiseParams(1.4, 1.8, 0.3, 0.0, 0.6).eta().expand(4, 5)
    >>> post.sample(torch.zeros(4, 2), eta, 16, generator=torch.Generator().manual_seed(0)).shape
    torch.Size([4, 16, 2])
    >>> oracle = KnownPosterior(method="sir", bank_size=20_000, generator=torch.Generator().manual_seed(1))
    >>> oracle.sample(torch.zeros(3, 2, dtype=torch.float64), eta[0].double(), 8, generator=torch.Generator().manual_seed(2)).shape
    torch.Size([3, 8, 2])
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..data.ring import EightGaussians, posterior_sample_sir
from .._checks import check_generator, check_int
from ..noise import NoiseParams

__all__ = ["KnownPosterior", "group_rows"]

_METHODS = ("auto", "exact", "importance", "sir")


class KnownPosterior:
    """Posterior sampler for :class:`~etweedie.data.EightGaussians` data under NoiseParams(η) noise.

    Args:
        data: the ring (default ``EightGaussians()``: radius 2, std 0.2, 8 modes).
        method: ``"auto"``, ``"exact"`` (β = 2 rows only), ``"importance"`` or ``"sir"``.
        n_proposals: K, proposals per query for ``"importance"`` (≥ 2).
        bank: clean points ``(M, 2)`` for ``"sir"``; drawn from ``data`` when None.
        bank_size: M when the bank is drawn here (default 160,000, the paper's bank).
        generator: the ``torch.Generator`` the bank is drawn from (``"sir"`` without a bank).
        bank_dtype: dtype of a drawn bank (float64 default).

    ``sample(y, eta, n, generator=g)`` returns ``(..., n, 2)`` in y's dtype.
    """

    dim = 2

    def __init__(
        self,
        data: Optional[EightGaussians] = None,
        *,
        method: str = "auto",
        n_proposals: int = 256,
        bank: Optional[torch.Tensor] = None,
        bank_size: int = 160_000,
        generator: Optional[torch.Generator] = None,
        bank_dtype: torch.dtype = torch.float64,
    ):
        data = EightGaussians() if data is None else data
        if not isinstance(data, EightGaussians):
            raise TypeError(f"data must be an etweedie.data.EightGaussians, got {type(data).__name__}")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(_METHODS)}; got {method!r}")
        n_proposals = check_int(n_proposals, "n_proposals", minimum=2)
        if bank is not None and method != "sir":
            # ignoring it would leave the caller believing the draws come from their bank
            raise ValueError(f"bank is used only by method='sir' (the other methods need no clean points), "
                             f"got a bank with method={method!r}")
        if method == "sir":
            if bank is None:
                bank_size = check_int(bank_size, "bank_size", minimum=1)
                generator = check_generator(generator, "generator (needed to draw the bank)")
                bank, _ = data.sample(bank_size, generator, dtype=bank_dtype)
            if not isinstance(bank, torch.Tensor) or not bank.is_floating_point():
                got = f"a {bank.dtype} tensor" if isinstance(bank, torch.Tensor) else type(bank).__name__
                raise TypeError(f"bank must be a floating-point tensor (M, {data.dim}), got {got}")
            if bank.dim() != 2 or bank.shape[1] != data.dim or bank.shape[0] == 0:
                raise ValueError(f"bank must have shape (M, {data.dim}) with M >= 1 for method='sir', "
                                 f"got {tuple(bank.shape)}")
        self.data = data
        self.method = method
        self.n_proposals = n_proposals
        self.bank = bank

    def __repr__(self) -> str:
        if self.method == "sir":
            return f"KnownPosterior({self.data!r}, method='sir', bank={self.bank.shape[0]} points)"
        return f"KnownPosterior({self.data!r}, method={self.method!r}, n_proposals={self.n_proposals})"

    # ------------------------------------------------------------------ the contract
    @torch.no_grad()
    def sample(self, y: torch.Tensor, eta: torch.Tensor, n: int, *, generator: torch.Generator) -> torch.Tensor:
        """Draw n posterior samples per query.

        Args:
            y: noisy queries ``(..., 2)``, float32 or float64.
            eta: conditioning ``(β, log λ, log σ, u, v)``, ``(..., 5)`` broadcasting to y's batch.
            n: draws per query (≥ 1).
            generator: the ``torch.Generator`` every random number comes from.

        Returns:
            ``(..., n, 2)`` in y's dtype.
        """
        if not isinstance(y, torch.Tensor) or y.dtype not in (torch.float32, torch.float64):
            got = y.dtype if isinstance(y, torch.Tensor) else type(y).__name__
            raise TypeError(f"y must be a float32/float64 tensor of shape (..., 2), got {got}")
        d = self.data.dim
        if y.dim() < 1 or y.shape[-1] != d:
            raise ValueError(f"y must have shape (..., {d}), got {tuple(y.shape)}")
        if not isinstance(eta, torch.Tensor) or not eta.is_floating_point():
            got = eta.dtype if isinstance(eta, torch.Tensor) else type(eta).__name__
            raise TypeError(f"eta must be a floating-point tensor of shape (..., 5), got {got}")
        if eta.dim() < 1 or eta.shape[-1] != 5:
            raise ValueError(f"eta must have shape (..., 5), got {tuple(eta.shape)}")
        try:
            batch = torch.broadcast_shapes(y.shape[:-1], eta.shape[:-1])
        except RuntimeError:
            raise ValueError(f"eta of shape {tuple(eta.shape)} does not broadcast with y's batch {tuple(y.shape[:-1])}") from None
        eta = eta.to(torch.float64).expand(*batch, 5)
        y = y.expand(*batch, d)
        n = check_int(n, "n", minimum=1)
        generator = check_generator(generator)
        finite = torch.isfinite(y).all(-1)
        if not bool(finite.all()):
            # a diverged chain (NaN/inf state) has no posterior: its draws are NaN, the other rows
            # are drawn as a call with the finite rows alone would draw them
            out = y.new_full((*batch, n, d), math.nan)
            if bool(finite.any()):
                out[finite] = self.sample(y[finite], eta[finite], n, generator=generator)
            return out
        if self.method == "sir":
            NoiseParams.from_eta(eta)  # validates the parameter ranges
            return self._sir(y.reshape(-1, d), eta.reshape(-1, 5), n, generator).reshape(*batch, n, d)

        rows = y.reshape(-1, d).to(torch.float64)
        eta_rows = eta.reshape(-1, 5)
        if rows.shape[0] == 0:
            return y.new_empty(*batch, n, d)
        gaussian = eta_rows[:, 0] == 2.0
        if self.method == "exact" and not bool(gaussian.all()):
            raise ValueError("method='exact' needs β = 2 in every row of eta (Gaussian noise); use 'auto' or 'importance'")
        use_exact = gaussian if self.method in ("auto", "exact") else torch.zeros_like(gaussian)
        if bool(use_exact.all()):
            out = self._exact(rows, eta_rows, n, generator)
        elif not bool(use_exact.any()):
            out = self._importance(rows, eta_rows, n, generator)
        else:
            out = torch.empty(rows.shape[0], n, d, dtype=torch.float64, device=y.device)
            out[use_exact] = self._exact(rows[use_exact], eta_rows[use_exact], n, generator)
            out[~use_exact] = self._importance(rows[~use_exact], eta_rows[~use_exact], n, generator)
        return out.reshape(*batch, n, d).to(y.dtype)

    # ------------------------------------------------------------------ methods
    def _exact(self, y: torch.Tensor, eta: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        unique, inverse = torch.unique(eta, dim=0, return_inverse=True)
        out = torch.empty(y.shape[0], n, y.shape[1], dtype=y.dtype, device=y.device)
        if unique.shape[0] == 1:  # the sampler's case: one η for every chain
            return self._exact_one_law(y, unique[0], n, generator)
        for i in range(unique.shape[0]):
            mask = inverse == i
            out[mask] = self._exact_one_law(y[mask], unique[i], n, generator)
        return out

    def _exact_one_law(self, y: torch.Tensor, eta: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        rows, d = y.shape
        cov = NoiseParams.from_eta(eta).noise(d).covariance(d).to(y)  # (d, d)
        tau2 = self.data.std**2
        eye = torch.eye(d, dtype=y.dtype, device=y.device)
        A_inv = torch.linalg.inv(tau2 * eye + cov)
        mu = self.data.means(y.dtype, y.device)  # (K, d)
        diff = y[:, None, :] - mu  # (R, K, d)
        a_diff = diff @ A_inv  # A⁻¹ is symmetric
        weights = torch.softmax(-0.5 * (diff * a_diff).sum(-1), dim=-1)  # N(y; μ_k, A) up to a row constant
        comp_means = mu + tau2 * a_diff  # (R, K, d)
        # τ²I − τ⁴A⁻¹ = τ² A⁻¹ C (A = τ²I + C): the product form, because the difference cancels
        # catastrophically once C is far below τ² (σ ≲ 1e-9 left it indefinite)
        comp_cov = tau2 * (A_inv @ cov)
        chol = torch.linalg.cholesky(0.5 * (comp_cov + comp_cov.T))
        index = torch.multinomial(weights, n, replacement=True, generator=generator)  # (R, n)
        centre = torch.gather(comp_means, 1, index[..., None].expand(-1, n, d))
        eps = torch.randn(rows, n, d, generator=generator, dtype=y.dtype, device=y.device)
        return centre + eps @ chol.T

    def _importance(self, y: torch.Tensor, eta: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        unique, inverse = torch.unique(eta, dim=0, return_inverse=True)
        out = torch.empty(y.shape[0], n, y.shape[1], dtype=y.dtype, device=y.device)
        if unique.shape[0] == 1:  # the sampler's case: one η for every chain
            return self._importance_one_law(y, unique[0], n, generator)
        for i in range(unique.shape[0]):
            mask = inverse == i
            out[mask] = self._importance_one_law(y[mask], unique[i], n, generator)
        return out

    def _importance_one_law(self, y: torch.Tensor, eta: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """Defensive SIR for rows sharing one noise law.

        The K proposals of a row are drawn (with replacement) from two pools shared by the
        rows of this call: prior points x ~ p and noise vectors u ~ q (proposal y − u).  Pools
        of at least 4K points make the overlap between rows small while the costly gamma draws
        of the noise sampler stay O(pool) instead of O(rows·K).
        """
        rows, d = y.shape
        k = self.n_proposals
        k_prior = k // 2
        k_noise = k - k_prior
        pool = max(4 * k, min(rows * k_noise, 16_384))
        noise = NoiseParams.from_eta(eta).noise(d)
        metric = noise.metric
        beta, lam = float(noise.beta), float(noise.lam)
        log_norm = float(noise.log_normalizer(d))

        def log_q(u: torch.Tensor) -> torch.Tensor:  # −(λ/β)‖L^T u‖^β − log Z
            return -(lam / beta) * metric.whiten(u).norm(dim=-1).pow(beta) - log_norm

        prior_pool, _ = self.data.sample(pool, generator, dtype=y.dtype, device=y.device)
        noise_pool = noise.sample((pool,), generator=generator).to(y.dtype)
        pick_prior = torch.randint(pool, (rows, k_prior), generator=generator, device=y.device)
        pick_noise = torch.randint(pool, (rows, k_noise), generator=generator, device=y.device)
        x = torch.cat([prior_pool[pick_prior], y[:, None, :] - noise_pool[pick_noise]], dim=1)  # (R, K, d)
        lp = self._ring_log_prob(x)
        lq = log_q(y[:, None, :] - x)
        log_g = torch.logaddexp(math.log(k_prior / k) + lp, math.log(k_noise / k) + lq)
        probs = torch.softmax(lp + lq - log_g, dim=1)
        index = torch.multinomial(probs, n, replacement=True, generator=generator)  # (R, n)
        return torch.gather(x, 1, index[..., None].expand(-1, n, d))

    def _ring_log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x) of the ring mixture, ``(..., d) -> (...)``, via one matmul for the squared distances."""
        mu = self.data.means(x.dtype, x.device)
        tau2 = self.data.std**2
        sq = (x * x).sum(-1, keepdim=True) - 2 * x @ mu.T + (mu * mu).sum(-1)
        const = -0.5 * x.shape[-1] * math.log(2 * math.pi * tau2) - math.log(mu.shape[0])
        return torch.logsumexp(sq.mul_(-0.5 / tau2), dim=-1) + const

    def _sir(self, y: torch.Tensor, eta: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """The score oracle, in y's dtype: exact on isotropic Gaussian rows, SIR over the bank on the others."""
        out = y.new_empty(y.shape[0], n, y.shape[1])
        unique, inverse = group_rows(eta)
        bank = self.bank.to(dtype=y.dtype, device=y.device)
        for g in range(unique.shape[0]):
            index = (inverse == g).nonzero().squeeze(-1)
            beta, log_lam, log_sigma, u, v = (float(t) for t in unique[g])
            # λ and σ through float32 exp, as the score tables were recorded with (a relative
            # rounding of ~1e-7; keeping it keeps the recorded SIR draws bit for bit)
            lam, sigma = float(torch.tensor(log_lam).exp()), float(torch.tensor(log_sigma).exp())
            params = NoiseParams(beta, lam, sigma, u, v)
            queries = y[index]
            if beta == 2.0 and u == 0.0 and v == 0.0:
                s = float(params.realized_rms())  # c_{2,d} = 1: Σ = σ² I, noise N(0, Σ/λ)
                out[index] = self.data.posterior_sample(queries, s, n, generator)
            else:
                law = NoiseParams(torch.tensor(beta, dtype=y.dtype), lam, sigma, u, v).noise(y.shape[1])
                out[index] = posterior_sample_sir(queries, bank, law, n, generator)
        return out


def group_rows(keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows of ``keys (R, k)`` and, for each input row, the index of its distinct row.

    Returns ``(unique (G, k), inverse (R,))``; the work of a posterior is one call per group.
    """
    if keys.shape[0] == 0:
        return keys, torch.zeros(0, dtype=torch.long, device=keys.device)
    return torch.unique(keys, dim=0, return_inverse=True)
