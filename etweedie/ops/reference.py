"""Pure-PyTorch reference of every op: the executable specification (DESIGN §1).

Written for clarity, not speed: each function materializes the (B, N, d) residuals the
fused kernels avoid.  It runs in float64 for the tests' ground truth, differentiates with
plain autograd, and traces under torch.compile (the benchmarks' ``compile`` baseline).

Arguments are in the canonical per-row form of :mod:`etweedie.ops._rows`
(y (B, d), x (B, N, d), beta/lam (B,), prec (B, *param), kind 0–3), so a reference
result and a kernel result are compared on exactly the same inputs.  Conventions shared
with the kernels: a draw with x_i == y contributes 0 to the score (w = 0), except for β = 2
where w ≡ 1 keeps the Gaussian score linear; gradients there are finite.  16-bit draws
(bfloat16/float16, the score ops' dtype rule in :mod:`etweedie.ops._args`) are upcast to y's
dtype first (exact), so the reference is the kernels' math on the draws' exact values; autograd
returns their gradient in the draws' dtype.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..rules.common import BLOCK, DENSE, DIAGONAL, ISOTROPIC, apply_precision
from ._ties import tie_equal_rows

__all__ = ["apply_precision", "et_score", "et_score_with_mean", "langevin_step", "is_score"]


def _residual_weight(q: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """q^{(β−2)/2} with the kernels' value at q = 0 (0, or 1 when β = 2); NaN-free gradients."""
    pos = q > 0
    q_safe = torch.where(pos, q, torch.ones_like(q))
    b = beta.reshape(-1, *([1] * (q.dim() - 1)))
    at_zero = (b == 2).to(q.dtype).expand_as(q)
    return torch.where(pos, q_safe ** ((b - 2) / 2), at_zero)


#: How a reference call treats near pairs (a distinct draw with q = ‖y − x_i‖²_P below NEAR_Q, e.g.
#: |y − x_i| < 1e-150 in float64, 5e-10 in float32, where q^{(β−2)/2} or its slope over- or
#: underflows, or comes near it): None, the plain formula (what a user would write; the benchmarks'
#: baseline), whose weight is 0 and whose gradient NaN once q underflows; "index", recompute those
#: pairs exactly (reads the values: eager CPU calls); "where", the same without reading values (a
#: select over every pair: GPU calls, torch.compile).
NEAR_PAIR_MODES = (None, "index", "where")
#: The smallest q computed by the plain formula per dtype: the kernels' q_in_range (csrc/common/et_score.h).
NEAR_Q = {torch.float32: 2.0**-62, torch.float64: 2.0**-500}


def _scaled(u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """u · 2^{−e} per pair (e: (...,) int), exact: in two halves, since 2^{−e} alone overflows for a
    subnormal u (e below −1022 in float64, −126 in float32)."""
    h = torch.div(e, 2, rounding_mode="floor").unsqueeze(-1).to(u.dtype)
    return torch.ldexp(torch.ldexp(u, -h), -(e.unsqueeze(-1).to(u.dtype) - h))


def _scaled_terms(u, e, beta, prec, kind) -> torch.Tensor:
    """w u from ũ = 2^{−e} u: q̃^{(β−2)/2} ũ · 2^{e(β−1)}, for residuals u (B, ..., d) with their
    exponents e (B, ...) and one β and metric row per leading index."""
    ut = _scaled(u, e)
    qt = (ut * apply_precision(prec, kind, ut)).sum(-1)
    b = beta.reshape(-1, *([1] * (qt.dim() - 1)))
    return (_residual_weight(qt, beta) * torch.exp2(e.to(u.dtype) * (b - 1))).unsqueeze(-1) * ut


def _weighted_residuals(u, q, beta, prec, kind, near_pairs) -> torch.Tensor:
    """w_i u_i = q_i^{(β−2)/2} u_i for every pair (B, N, d).

    A near pair is recomputed on its residual scaled by an exact power of two, ũ = 2^{−e} u with
    2^{e−1} ≤ max_j |u_j| < 2^e: q̃ = ũᵀPũ is then of order 1, and w u = q̃^{(β−2)/2} ũ · 2^{e(β−1)}
    (the term is homogeneous of degree β − 1 in u).  Pairs that are not near keep e = 0, so the
    recomputation equals the plain one there and its gradient stays finite."""
    if near_pairs is None:
        return _residual_weight(q, beta).unsqueeze(-1) * u
    near = (q < NEAR_Q.get(q.dtype, torch.finfo(q.dtype).tiny)) & (u != 0).any(-1)  # (B, N)
    # the plain term's q kept away from the near pairs: their slope there is inf, and inf times the
    # zero gradient the replaced entries receive would be NaN
    wu = _residual_weight(torch.where(near, torch.ones_like(q), q), beta).unsqueeze(-1) * u
    if near_pairs == "index":
        if not bool(near.any()):
            return wu
        rows, cols = near.nonzero(as_tuple=True)
        un = u[rows, cols]  # (K, d)
        return wu.index_put((rows, cols), _scaled_terms(un, torch.frexp(un.abs().amax(-1))[1], beta[rows], prec[rows], kind))
    e = torch.where(near, torch.frexp(u.abs().amax(-1))[1], torch.zeros_like(q, dtype=torch.int32))
    fixed = _scaled_terms(u, e, beta, prec, kind)
    return torch.where(near.unsqueeze(-1), fixed, wu)


def et_score_with_mean(y, x, beta, lam, prec, kind, near_pairs=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(s, m): s(y) = −λ P m, m = (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i); ``near_pairs``: one of
    :data:`NEAR_PAIR_MODES` (the op passes "index" or "where"; None is the plain formula)."""
    u = y.unsqueeze(1) - x.to(y.dtype)  # (B, N, d): the buffer the fused kernel never writes
    q = (u * apply_precision(prec, kind, u)).sum(-1)
    m = _weighted_residuals(u, q, beta, prec, kind, near_pairs).mean(1)
    s = -lam.unsqueeze(-1) * apply_precision(prec, kind, m)
    return s, m


def et_score(y, x, beta, lam, prec, kind, near_pairs=None) -> torch.Tensor:
    """Energy-Tweedie score −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2}(y − x_i), shape (B, d)."""
    return et_score_with_mean(y, x, beta, lam, prec, kind, near_pairs)[0]


def langevin_step(y, x, noise, step, beta, lam, prec, kind, near_pairs=None) -> torch.Tensor:
    """y + α s(y) + sqrt(2α) ξ with α = step (B,) and ξ = noise (B, d)."""
    s = et_score(y, x, beta, lam, prec, kind, near_pairs)
    a = step.unsqueeze(-1)
    return y + a * s + torch.sqrt(2 * a) * noise


def is_score(y, bank, beta: float, lam: float, prec, kind, chunk: int = 1024):
    """Importance-sampling oracle (score, posterior mean, ESS) over a clean bank.

    y (Q, d), bank (M, d), prec (1, *param).  Weights w_j ∝ exp(−(λ/β)‖y − x_j‖_P^β),
    self-normalized by a log-sum-exp; queries are processed ``chunk`` at a time so the
    reference holds chunk × M × d numbers at once (the fused kernel holds O(d)).
    """
    scores, means, esss = [], [], []
    for start in range(0, y.shape[0], chunk):
        yq = y[start : start + chunk]
        u = yq.unsqueeze(1) - bank.unsqueeze(0)  # (C, M, d)
        pr = prec.expand(yq.shape[0], *prec.shape[1:])
        q = (u * apply_precision(pr, kind, u)).sum(-1)
        pos = q > 0
        q_safe = torch.where(pos, q, torch.ones_like(q))
        qb = torch.where(pos, q_safe ** (beta / 2), torch.zeros_like(q))
        r = torch.where(pos, q_safe ** ((beta - 2) / 2), torch.full_like(q, 1.0 if beta == 2 else 0.0))
        logw = -(lam / beta) * qb
        w = torch.softmax(logw, dim=1)
        resid = (w * r).unsqueeze(-1).mul(u).sum(1)
        scores.append(-lam * apply_precision(pr, kind, resid))
        means.append(w @ bank)
        esss.append(1.0 / (w * w).sum(1))
    if not scores:
        d = y.shape[-1]
        return y.new_empty(0, d), y.new_empty(0, d), y.new_empty(0)
    return torch.cat(scores), torch.cat(means), torch.cat(esss)


# ---------------------------------------------------------------------------- energy losses
# Pair terms use torch.cdist in its direct-difference mode on whitened points (z = Lᵀx,
# P = L Lᵀ, so ‖z_i − z_j‖ = ‖x_i − x_j‖_P): exact for clouds far from the origin, unlike the
# Gram (matrix-multiply) mode, and O(n·m) memory rather than O(n·m·d).  A coincident pair
# contributes 0 and, for every β ∈ (0, 2], a zero (never NaN) gradient — the kernels' convention.


def whiten_rows(x: torch.Tensor, prec: torch.Tensor, kind: int) -> torch.Tensor:
    """z (B, n, d) with ‖z_i − z_j‖² = (x_i − x_j)ᵀ P (x_i − x_j) for x (B, n, d), prec (B, *param)."""
    B = prec.shape[0]
    if kind == ISOTROPIC:
        return x * prec.sqrt().reshape(B, 1, 1)
    if kind == DIAGONAL:
        return x * prec.sqrt().reshape(B, 1, prec.shape[-1])
    L = torch.linalg.cholesky(prec)  # P = L Lᵀ; z = Lᵀu is the row vector u @ L
    if kind == BLOCK:
        k = prec.shape[-1]
        xb = x.reshape(*x.shape[:-1], x.shape[-1] // k, k)
        return (xb @ L.reshape(B, 1, k, k)).reshape(x.shape)
    if kind == DENSE:
        return x @ L
    raise ValueError(f"kind must be 0..3, got {kind}")


def whiten_centred(a: torch.Tensor, b: torch.Tensor, centre: torch.Tensor, prec: torch.Tensor, kind: int):
    """whiten_rows of a − c and b − c, c = centre (B, 1, d) detached: the pair losses see
    differences only, and a centre inside the clouds keeps the whitened coordinates, and their
    rounding, at the clouds' spread rather than their distance from the origin (a point equal to
    the centre whitens to exactly 0, so a draw on the target is an exact coincidence)."""
    c = centre.detach()
    u = torch.cat([a, b], dim=1) - c
    z = whiten_rows(u, prec, kind)
    if kind in (BLOCK, DENSE):  # a matrix product may round equal rows differently (see _ties)
        z = tie_equal_rows(z, u)
    return z.split([a.shape[1], b.shape[1]], dim=1)


def pair_energy(za: torch.Tensor, zb: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """‖za_i − zb_j‖^β, shape (B, n, m); 0 with a zero gradient where the points coincide."""
    r = torch.cdist(za, zb, compute_mode="donot_use_mm_for_euclid_dist")
    pos = r > 0
    r_safe = torch.where(pos, r, torch.ones_like(r))
    return torch.where(pos, r_safe ** beta.reshape(-1, 1, 1), torch.zeros_like(r))


def energy_score(samples, target, beta, prec, kind, fair: bool = True) -> torch.Tensor:
    """ES = (1/M) Σ_i ‖x_i − y‖_P^β − 1/(2M(M−1)) Σ_{i≠j} ‖x_i − x_j‖_P^β, shape (B,).

    samples (B, M, d), target (B, d); ``fair=False`` uses 1/(2M²) Σ_{i,j} (biased).
    """
    M = samples.shape[1]
    zx, zy = whiten_centred(samples, target.unsqueeze(1), target.unsqueeze(1), prec, kind)
    cross = pair_energy(zx, zy, beta).sum((1, 2)) / M
    within = pair_energy(zx, zx, beta).sum((1, 2))
    return cross - within / (2 * M * (M - 1) if fair else 2 * M * M)


def energy_distance(a, b, beta, prec, kind, unbiased: bool = True) -> torch.Tensor:
    """2E‖a − b‖_P^β − E‖a − a'‖_P^β − E‖b − b'‖_P^β per row, shape (B,).

    a (B, n, d), b (B, m, d).  ``unbiased``: within-cloud means over i ≠ j (the signed
    U-statistic); otherwise over all (i, j) (the V-statistic, ≥ 0 for β ∈ (0, 2)).
    """
    n, m = a.shape[1], b.shape[1]
    za, zb = whiten_centred(a, b, a[:, :1], prec, kind)
    cross = pair_energy(za, zb, beta).sum((1, 2)) / (n * m)
    within_a = pair_energy(za, za, beta).sum((1, 2)) / (n * (n - 1) if unbiased else n * n)
    within_b = pair_energy(zb, zb, beta).sum((1, 2)) / (m * (m - 1) if unbiased else m * m)
    return 2 * cross - within_a - within_b


def student_t_kernel_score(samples, target, prec, kind, fair: bool = True) -> torch.Tensor:
    """Kernel score with the Student-t matched potential E(u) = log(1 + ‖u‖_P²), shape (B,)."""
    M = samples.shape[1]
    zx, zy = whiten_centred(samples, target.unsqueeze(1), target.unsqueeze(1), prec, kind)
    cross = torch.log1p(((zx - zy) ** 2).sum(-1)).sum(1) / M
    within = torch.log1p(((zx.unsqueeze(2) - zx.unsqueeze(1)) ** 2).sum(-1)).sum((1, 2))
    return cross - within / (2 * M * (M - 1) if fair else 2 * M * M)


def student_t_score(y, x, c, prec, kind) -> torch.Tensor:
    """−2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²), shape (B, d); c (B,)."""
    u = y.unsqueeze(1) - x.to(y.dtype)
    q = (u * apply_precision(prec, kind, u)).sum(-1)
    m = (u / (1 + q).unsqueeze(-1)).mean(1)
    return -2 * c.unsqueeze(-1) * apply_precision(prec, kind, m)
