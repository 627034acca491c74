"""Data: the eight-Gaussians ring, its analytic noisy scores and exact/SIR posterior samplers.

The first stage of the data path (data → noise → posterior → score).  The ring is the
mixture of the paper's §5.1 (DESIGN §6):

    p(x) = (1/K) Σ_k N(x; μ_k, τ² I₂),   μ_k = r (cos 2πk/K, sin 2πk/K),   r = 2, τ = 0.2, K = 8.

Under isotropic Gaussian noise Y = X + s·ξ everything is closed form, which is what makes it
the ground truth the Energy-Tweedie estimates are checked against:

* the noisy marginal is the same mixture with variance τ² + s²  (:meth:`EightGaussians.noisy_score`);
* the posterior X | Y = y is a Gaussian mixture with weights w_k ∝ N(y; μ_k, (τ²+s²) I),
  means m_k = (s² μ_k + τ² y)/(τ² + s²) and variance τ² s²/(τ² + s²)
  (:meth:`EightGaussians.posterior_sample`, :meth:`EightGaussians.posterior_mean`).

For any other noise law the posterior is not closed form; :func:`posterior_sample_sir` draws
approximate posterior samples by sampling-importance-resampling from a clean bank.

Example::

    >>> import torch
    >>> from etweedie.data import EightGaussians
    >>> ring = EightGaussians()
    >>> x, labels = ring.sample(4, generator=torch.Generator().manual_seed(0))
    >>> x.shape, labels.tolist()
    (torch.Size([4, 2]), [4, 7, 5, 0])
    >>> ring.noisy_score(torch.tensor([[2.0, 0.0]]), 0.5)      # at a mode: the ring pulls inward
    tensor([[-0.0687,  0.0000]])
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .._checks import check_float, check_generator, check_int
from ..noise import GeneralizedGaussian

__all__ = ["EightGaussians", "posterior_sample_sir"]

Scalar = Union[float, torch.Tensor]

# Elements of the (queries × bank) log-weight block held at once by posterior_sample_sir:
# 2^22 doubles is 32 MiB per (C, M) temporary (the generic log_prob path also holds the
# (C, M, d) differences), small next to a 160k bank's working set yet large enough that the
# per-chunk overhead (softmax, multinomial set-up) is amortized; much smaller blocks were
# several times slower in the demo.
_SIR_BLOCK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------- validation
def _check_points(t, name: str, d: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (..., d), got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
    if t.dim() < 1 or (d is not None and t.shape[-1] != d):
        want = "d" if d is None else str(d)
        raise ValueError(f"{name} must have shape (..., {want}), got {tuple(t.shape)}")
    return t


def _check_noise_scale(sigma_noise, y: torch.Tensor) -> torch.Tensor:
    """The noise std s as a tensor broadcastable to y.shape[:-1] (float: one s for all queries)."""
    if isinstance(sigma_noise, torch.Tensor):
        if not sigma_noise.is_floating_point():
            raise TypeError(f"sigma_noise must be a float or a floating-point tensor, got dtype {sigma_noise.dtype}")
        if sigma_noise.device != y.device:
            raise ValueError(f"sigma_noise is on {sigma_noise.device} but y is on {y.device}")
        try:
            torch.broadcast_shapes(sigma_noise.shape, y.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"sigma_noise must broadcast with y's batch shape {tuple(y.shape[:-1])}, got {tuple(sigma_noise.shape)}"
            ) from None
        if sigma_noise.numel() and not bool(((sigma_noise >= 0) & torch.isfinite(sigma_noise)).all()):
            raise ValueError(f"sigma_noise must be >= 0 and finite, got min {sigma_noise.min().item():.4g}")
        return sigma_noise.to(y.dtype)
    s = check_float(sigma_noise, "sigma_noise", minimum=0)
    return torch.tensor(s, dtype=y.dtype, device=y.device)


# ---------------------------------------------------------------------------- the ring
class EightGaussians:
    """Equal-weight Gaussian mixture on a circle: K modes of std ``std`` at radius ``radius``.

    Args:
        radius: radius r > 0 of the circle the means lie on (2.0).
        std: per-coordinate std τ > 0 of every component (0.2).
        n_modes: number of components K ≥ 1 (8); mode k sits at angle 2πk/K.

    All methods take points ``(..., 2)`` of dtype float32/float64 and compute in that dtype.
    """

    dim = 2

    def __init__(self, radius: float = 2.0, std: float = 0.2, n_modes: int = 8):
        self.radius = check_float(radius, "radius", minimum=0, strict=True)
        self.std = check_float(std, "std", minimum=0, strict=True)
        self.n_modes = check_int(n_modes, "n_modes", minimum=1)

    def __repr__(self) -> str:
        return f"EightGaussians(radius={self.radius:g}, std={self.std:g}, n_modes={self.n_modes})"

    def means(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Component means μ_k, ``(K, 2)``."""
        angle = torch.arange(self.n_modes, dtype=torch.float64) * (2 * math.pi / self.n_modes)
        mu = self.radius * torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)
        return mu.to(dtype=dtype, device=device)

    # -------------------------------------------------------------- sampling
    def sample(
        self, n: int, generator: torch.Generator, *, dtype: torch.dtype = torch.float32, device=None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Draw n points and their mode labels.

        Args:
            n: number of points (≥ 0).
            generator: the ``torch.Generator`` every random number comes from.
            dtype, device: of the returned points.

        Returns:
            ``(x (n, 2), labels (n,) int64 in [0, K))``.
        """
        n = check_int(n, "n", minimum=0)
        generator = check_generator(generator)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        labels = torch.randint(self.n_modes, (n,), generator=generator, device=device)
        eps = torch.randn(n, 2, generator=generator, dtype=dtype, device=device)
        return self.means(dtype, device)[labels] + self.std * eps, labels

    # -------------------------------------------------------------- densities and scores
    def _log_joint(self, x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """log π_k + log N(x; μ_k, var·I₂) for every k: ``(..., K)``. ``var`` broadcasts to x.shape[:-1]."""
        mu = self.means(x.dtype, x.device)
        var = var[..., None]
        sq = (x[..., None, :] - mu).pow(2).sum(-1)  # (..., K)
        return -0.5 * sq / var - torch.log(2 * math.pi * var) - math.log(self.n_modes)

    def _responsibilities(self, x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """softmax_k of _log_joint, ``(..., K)``, from the terms that depend on k only,
        a_k = x·μ_k − ½‖μ_k‖², over var (‖x − μ_k‖² overflows for a far x — 1e20 in float32 — and
        the softmax of −inf everywhere is NaN).  Near the dtype's largest value x·μ_k itself
        overflows (3e38 in float32), so each point is scaled by a power of two t ≥ its largest
        |coordinate| / 2 (exact), the scaled a_k are shifted by their maximum (the softmax depends on
        differences only) and multiplied back by t/var; a difference of 0 stays 0 where t/var is
        inf."""
        mu = self.means(x.dtype, x.device)
        t = torch.exp2(torch.floor(torch.log2(x.abs().amax(-1).clamp_min(1.0))))  # (...,), a power of two
        a = (x / t[..., None]) @ mu.T - (0.5 * (mu * mu).sum(-1)) / t[..., None]
        a = a - a.amax(-1, keepdim=True)  # ≤ 0, the largest exactly 0
        logits = torch.where(a == 0, torch.zeros_like(a), a * (t / var)[..., None])
        return torch.softmax(logits, dim=-1)

    def _mixture_log_prob(self, x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self._log_joint(x, var), dim=-1)

    def _mixture_score(self, x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        # ∇ log Σ_k π_k N(x; μ_k, v) = Σ_k r_k(x) (μ_k − x)/v, r = responsibilities.
        resp = self._responsibilities(x, var)
        mean_of_means = resp @ self.means(x.dtype, x.device)
        return (mean_of_means - x) / var[..., None]

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x), ``(..., 2)`` → ``(...)``."""
        x = _check_points(x, "x", 2)
        return self._mixture_log_prob(x, x.new_tensor(self.std**2))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Clean score ∇ log p(x), ``(..., 2)`` → ``(..., 2)``."""
        x = _check_points(x, "x", 2)
        return self._mixture_score(x, x.new_tensor(self.std**2))

    def noisy_log_prob(self, y: torch.Tensor, sigma_noise: Scalar) -> torch.Tensor:
        """log p_Y(y) for Y = X + N(0, s² I): the mixture with variance τ² + s². ``(..., 2)`` → ``(...)``.

        ``sigma_noise``: s ≥ 0, a float or a tensor broadcasting to y's batch shape.
        """
        y = _check_points(y, "y", 2)
        s = _check_noise_scale(sigma_noise, y)
        return self._mixture_log_prob(y, self.std**2 + s**2)

    def noisy_score(self, y: torch.Tensor, sigma_noise: Scalar) -> torch.Tensor:
        """Analytic noisy score ∇ log p_Y(y) under N(0, s² I) noise, ``(..., 2)`` → ``(..., 2)``.

        ``sigma_noise``: s ≥ 0 (s = 0 gives the clean :meth:`score`), a float or a tensor
        broadcasting to y's batch shape.

        Example::

            >>> EightGaussians(n_modes=1, radius=1.0, std=0.6).noisy_score(torch.zeros(1, 2), 0.8)
            tensor([[1., 0.]])
        """
        y = _check_points(y, "y", 2)
        s = _check_noise_scale(sigma_noise, y)
        return self._mixture_score(y, self.std**2 + s**2)

    # -------------------------------------------------------------- the Gaussian-noise posterior
    def _posterior_parts(self, y: torch.Tensor, s: torch.Tensor):
        """Component weights (..., K), means (..., K, 2) and the shared variance (...)."""
        tau2, s2 = self.std**2, s**2
        total = tau2 + s2
        weights = self._responsibilities(y, total)
        mu = self.means(y.dtype, y.device)
        shrink = (s2 / total)[..., None, None]  # weight on μ_k; the rest goes to y
        comp_means = shrink * mu + (1 - shrink) * y[..., None, :]
        comp_var = tau2 * s2 / total
        return weights, comp_means, comp_var

    def posterior_mean(self, y: torch.Tensor, sigma_noise: Scalar) -> torch.Tensor:
        """E[X | Y = y] under N(0, s² I) noise, ``(..., 2)`` → ``(..., 2)``.

        Equals Tweedie's ``y + s² ∇ log p_Y(y)``.
        """
        y = _check_points(y, "y", 2)
        s = _check_noise_scale(sigma_noise, y)
        weights, comp_means, _ = self._posterior_parts(y, s)
        return (weights[..., None] * comp_means).sum(-2)

    def posterior_sample(self, y: torch.Tensor, sigma_noise: Scalar, n: int, generator: torch.Generator) -> torch.Tensor:
        """Exact draws from X | Y = y under Gaussian noise Y = X + N(0, s² I).

        The posterior is the Gaussian mixture with weights ∝ N(y; μ_k, (τ²+s²) I), means
        (s² μ_k + τ² y)/(τ² + s²) and variance τ² s²/(τ² + s²); a component index is drawn per
        sample, then a Gaussian around that component's mean.

        Args:
            y: noisy queries ``(*batch, 2)``.
            sigma_noise: s ≥ 0, a float or a tensor broadcasting to ``batch``.
            n: draws per query (≥ 1).
            generator: the ``torch.Generator`` every random number comes from.

        Returns:
            ``(*batch, n, 2)`` in y's dtype.

        Example::

            >>> ring = EightGaussians()
            >>> x = ring.posterior_sample(torch.zeros(3, 2), 0.5, 16, torch.Generator().manual_seed(0))
            >>> x.shape
            torch.Size([3, 16, 2])
        """
        y = _check_points(y, "y", 2)
        s = _check_noise_scale(sigma_noise, y)
        n = check_int(n, "n", minimum=1)
        generator = check_generator(generator)
        weights, comp_means, comp_var = self._posterior_parts(y, s)
        batch = torch.broadcast_shapes(y.shape[:-1], s.shape)
        weights = weights.expand(*batch, self.n_modes).reshape(-1, self.n_modes)
        comp_means = comp_means.expand(*batch, self.n_modes, 2).reshape(-1, self.n_modes, 2)
        comp_std = torch.sqrt(comp_var).expand(batch).reshape(-1, 1, 1)
        rows = weights.shape[0]
        if rows == 0:
            return y.new_empty(*batch, n, 2)
        # a NaN or inf query has no posterior: its draws are NaN (the other rows are drawn as usual)
        bad = ~torch.isfinite(weights).all(-1)
        weights = torch.where(bad[:, None], torch.ones_like(weights), weights)
        index = torch.multinomial(weights, n, replacement=True, generator=generator)  # (rows, n)
        centre = torch.gather(comp_means, 1, index[..., None].expand(rows, n, 2))
        eps = torch.randn(rows, n, 2, generator=generator, dtype=y.dtype, device=y.device)
        out = centre + comp_std * eps
        out = torch.where(bad[:, None, None], torch.full_like(out, float("nan")), out)
        return out.reshape(*batch, n, 2)


# ---------------------------------------------------------------------------- SIR posterior
def posterior_sample_sir(
    y: torch.Tensor,
    bank: torch.Tensor,
    noise_law,
    n: int,
    generator: torch.Generator,
    *,
    max_block_elements: int = _SIR_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """Approximate draws from X | Y = y for any additive noise law, by sampling-importance-resampling.

    With a clean bank x_1..x_M ~ p, the self-normalized weights w_j ∝ q(y − x_j) define a
    discrete approximation of the posterior; n indices are drawn from it with replacement.
    Draws are bank points (so they repeat); their law converges to the posterior as M grows.
    Queries are processed in chunks so that at most ``max_block_elements`` log-weights
    (queries × bank) exist at once.  A query farther than :data:`FAR_QUERY` bank radii from the
    bank gets its generalized-Gaussian weights in float64 relative to its own distance (the
    distances themselves round at that size), so a float32 query at 1e10 or 1e19 still resamples
    the right bank points.

    Args:
        y: noisy queries ``(*batch, d)``.
        bank: clean samples ``(M, d)``, M ≥ 1, y's dtype and device.
        noise_law: a noise law with ``log_prob(u)`` over ``(..., d)`` and an empty batch shape
            (e.g. :class:`etweedie.GeneralizedGaussian`, :class:`etweedie.StudentT`).
        n: draws per query (≥ 1).
        generator: the ``torch.Generator`` the resampling indices come from.
        max_block_elements: bound on the chunk size × M.

    Returns:
        ``(*batch, n, d)``.

    Example::

        >>> import etweedie
        >>> g = torch.Generator().manual_seed(0)
        >>> bank, _ = EightGaussians().sample(10_000, g)
        >>> law = etweedie.GeneralizedGaussian(1.0, 2.0, dim=2)
        >>> posterior_sample_sir(torch.zeros(5, 2), bank, law, 32, g).shape
        torch.Size([5, 32, 2])
    """
    y = _check_points(y, "y")
    bank = _check_points(bank, "bank", y.shape[-1])
    if bank.dim() != 2:
        raise ValueError(f"bank must have shape (M, d={y.shape[-1]}), got {tuple(bank.shape)}")
    if bank.shape[0] == 0:
        raise ValueError("bank must hold at least one clean point, got M = 0")
    if bank.dtype != y.dtype:
        raise TypeError(f"bank must have y's dtype {y.dtype}, got {bank.dtype}")
    if bank.device != y.device:
        raise ValueError(f"bank is on {bank.device} but y is on {y.device}")
    if not callable(getattr(noise_law, "log_prob", None)):
        raise TypeError(f"noise_law must have a log_prob(u) method, got {type(noise_law).__name__}")
    batch_shape = getattr(noise_law, "batch_shape", torch.Size())
    if len(batch_shape):
        raise ValueError(f"noise_law must have an empty batch shape (one law for every query), got {tuple(batch_shape)}")
    n = check_int(n, "n", minimum=1)
    generator = check_generator(generator)
    max_block_elements = check_int(max_block_elements, "max_block_elements", minimum=1)

    if not bool(torch.isfinite(y).all()):
        raise ValueError("y must be finite (it holds NaN or inf)")
    if not bool(torch.isfinite(bank).all()):
        raise ValueError("bank must be finite (it holds NaN or inf)")

    d, m = y.shape[-1], bank.shape[0]
    queries = y.reshape(-1, d)
    chunk = max(1, max_block_elements // m)
    out = y.new_empty(queries.shape[0], n, d)
    with torch.no_grad():
        log_weights = _sir_log_weights(noise_law, bank)
        for start in range(0, queries.shape[0], chunk):
            block = queries[start : start + chunk]
            # softmax in each query's own scale: far queries' weights would underflow otherwise.
            probs = torch.softmax(log_weights(block), dim=-1)
            try:
                index = torch.multinomial(probs, n, replacement=True, generator=generator)
            except RuntimeError as exc:  # NaN/inf weights: the law's log_prob failed somewhere
                raise ValueError(f"noise_law: its log_prob gave invalid SIR weights ({exc})") from None
            out[start : start + block.shape[0]] = bank[index]
    return out.reshape(*y.shape[:-1], n, d)


#: A query block farther than this many bank radii from the bank's centre (whitened) gets its SIR
#: log-weights from direct float64 differences instead of the GEMM distance form.
FAR_QUERY = 64.0


def _whiten64(u: torch.Tensor, centre: torch.Tensor, metric) -> torch.Tensor:
    u = u.double() - centre.double()
    return u if metric is None else metric.to(torch.float64).whiten(u)


def _sir_log_weights(noise_law, bank: torch.Tensor):
    """A function block (C, d) -> log q(y − x_j) up to a per-row constant, (C, M).

    Generic laws go through ``noise_law.log_prob`` on the (C, M, d) differences.  For a
    generalized-Gaussian law with an unbatched metric the same weights, −(λ/β)‖z_y − z_j‖^β in
    whitened coordinates z = Lᵀu, come from one distance GEMM per block (torch.cdist) on a
    bank whitened once: a few passes over the (C, M) block instead of a dozen elementwise
    passes over (C, M, d) — this is most of the demo's run time.  The normalizer is dropped:
    it cancels in the softmax.
    """
    if isinstance(noise_law, GeneralizedGaussian) and (noise_law.metric is None or not len(noise_law.metric.batch_shape)):
        metric = noise_law.metric
        if noise_law.dim is not None and noise_law.dim != bank.shape[-1]:
            raise ValueError(f"noise_law has dimension {noise_law.dim} but y and bank have d = {bank.shape[-1]}")
        beta = float(noise_law.beta)
        rate = float(noise_law.lam) / beta

        # the GEMM form ‖a‖² + ‖b‖² − 2a·b rounds at the size of ‖a‖², so both sides are centred on
        # the bank's mean first (the distances are unchanged): far from the origin the float32
        # weights would otherwise lose every digit (translation-equivariance)
        centre = bank.mean(0)

        def whiten(u: torch.Tensor) -> torch.Tensor:
            u = u - centre
            return u if metric is None else metric.to(u.dtype).whiten(u)

        z_bank = whiten(bank)
        radius = float(z_bank.norm(dim=-1).max())  # the whitened bank's extent about its centre
        z_bank64 = None

        def gg_log_weights(block: torch.Tensor) -> torch.Tensor:
            nonlocal z_bank64
            z = whiten(block)
            if float(z.norm(dim=-1).max()) <= FAR_QUERY * max(radius, torch.finfo(z.dtype).tiny):
                dist = torch.cdist(z, z_bank, compute_mode="use_mm_for_euclid_dist")
                return dist.pow_(beta).mul_(-rate)
            # Queries far beyond the bank: ‖z − z_j‖ itself rounds at the size of ‖z‖, which swamps
            # the bank's spread (float32 weights were noise at 1e10 and inf at 2e19; float64
            # distances lose it too by 1e17).  Such rows take, in float64, the offset from the
            # row's own constant ‖z‖^β (dropped by the softmax):
            #   ‖z − z_j‖^β − ‖z‖^β = ‖z‖^β expm1((β/2) log1p(t_j)),  t_j = (‖z_j‖² − 2 z·z_j) / ‖z‖²,
            # with |t_j| ≤ 3/FAR_QUERY there; the other rows of the block, direct float64 distances.
            if z_bank64 is None:
                z_bank64 = z_bank if bank.dtype == torch.float64 else _whiten64(bank, centre, metric)
            z64 = z if block.dtype == torch.float64 else _whiten64(block, centre, metric)
            norm = z64.norm(dim=-1, keepdim=True)  # (C, 1)
            far = norm > FAR_QUERY * radius
            safe = torch.where(far, norm, torch.ones_like(norm))
            t = (z_bank64.pow(2).sum(-1) / safe - 2 * (z64 / safe) @ z_bank64.T) / safe
            offset = safe.pow(beta) * torch.expm1((0.5 * beta) * torch.log1p(t))
            near = torch.cdist(torch.where(far, torch.zeros_like(z64), z64), z_bank64,
                               compute_mode="donot_use_mm_for_euclid_dist").pow_(beta)
            return torch.where(far, offset, near).mul_(-rate)

        return gg_log_weights

    def generic_log_weights(block: torch.Tensor) -> torch.Tensor:
        return noise_law.log_prob(block[:, None, :] - bank).to(bank.dtype)

    return generic_log_weights
