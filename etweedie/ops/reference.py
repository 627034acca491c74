"""Pure-PyTorch reference of every op: the executable specification (DESIGN §1).

Written for clarity, not speed: each function materializes the (B, N, d) residuals the
fused kernels avoid.  It runs in float64 for the tests' ground truth, differentiates with
plain autograd, and traces under torch.compile (the benchmarks' ``compile`` baseline).

Arguments are in the canonical per-row form of :mod:`etweedie.ops._prep`
(y (B, d), x (B, N, d), beta/lam (B,), prec (B, *param), kind 0–3), so a reference
result and a kernel result are compared on exactly the same inputs.  Conventions shared
with the kernels: a draw with x_i == y contributes 0 to the score (w = 0), except for β = 2
where w ≡ 1 keeps the Gaussian score linear; gradients there are finite.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ._prep import BLOCK, DENSE, DIAGONAL, ISOTROPIC

__all__ = ["apply_precision", "et_score", "et_score_with_mean", "langevin_step", "is_score"]


def apply_precision(prec: torch.Tensor, kind: int, v: torch.Tensor) -> torch.Tensor:
    """P v per row for v of shape (B, ..., d) and prec (B, *param); (P v)_a = Σ_b P_ab v_b."""
    B = prec.shape[0]
    extra = v.dim() - 2  # dims between the row and d
    if kind == ISOTROPIC:
        return prec.reshape(B, *([1] * (extra + 1))) * v
    if kind == DIAGONAL:
        return prec.reshape(B, *([1] * extra), prec.shape[-1]) * v
    if kind == BLOCK:
        k = prec.shape[-1]
        vb = v.reshape(*v.shape[:-1], v.shape[-1] // k, k)
        Pt = prec.transpose(-1, -2).reshape(B, *([1] * (extra + 1)), k, k)
        return (vb.unsqueeze(-2) @ Pt).squeeze(-2).reshape(v.shape)
    if kind == DENSE:
        Pt = prec.transpose(-1, -2).reshape(B, *([1] * extra), *prec.shape[-2:])
        return (v.unsqueeze(-2) @ Pt).squeeze(-2)
    raise ValueError(f"kind must be 0..3, got {kind}")


def _residual_weight(q: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """q^{(β−2)/2} with the kernels' value at q = 0 (0, or 1 when β = 2); NaN-free gradients."""
    pos = q > 0
    q_safe = torch.where(pos, q, torch.ones_like(q))
    b = beta.reshape(-1, *([1] * (q.dim() - 1)))
    at_zero = (b == 2).to(q.dtype).expand_as(q)
    return torch.where(pos, q_safe ** ((b - 2) / 2), at_zero)


def et_score_with_mean(y, x, beta, lam, prec, kind) -> Tuple[torch.Tensor, torch.Tensor]:
    """(s, m): s(y) = −λ P m, m = (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i)."""
    u = y.unsqueeze(1) - x  # (B, N, d): the buffer the fused kernel never writes
    q = (u * apply_precision(prec, kind, u)).sum(-1)
    w = _residual_weight(q, beta)
    m = (w.unsqueeze(-1) * u).mean(1)
    s = -lam.unsqueeze(-1) * apply_precision(prec, kind, m)
    return s, m


def et_score(y, x, beta, lam, prec, kind) -> torch.Tensor:
    """Energy-Tweedie score −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2}(y − x_i), shape (B, d)."""
    return et_score_with_mean(y, x, beta, lam, prec, kind)[0]


def langevin_step(y, x, noise, step, beta, lam, prec, kind) -> torch.Tensor:
    """y + α s(y) + sqrt(2α) ξ with α = step (B,) and ξ = noise (B, d)."""
    s = et_score(y, x, beta, lam, prec, kind)
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
