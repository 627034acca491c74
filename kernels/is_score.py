"""Triton kernel of the importance-sampling oracle (DESIGN §1) and its torch op.

For queries y (Q, d), a clean bank x_1..x_M (M, d) and generalized-Gaussian noise (β, λ, P):

    w_j ∝ exp(−(λ/β) q_j^{β/2}),  q_j = (y − x_j)ᵀP(y − x_j)    (self-normalized)
    score = −λ Σ_j w_j q_j^{(β−2)/2} P (y − x_j),   mean = y − Σ_j w_j (y − x_j),   ESS = 1/Σ_j w_j²

Same numbers as the C++ op ``etweedie::is_score_fwd`` (csrc/cpu/is_score_cpu.cpp).

Work split: one program per (block of BLOCK_Q queries, chunk of BLOCK_D coordinates); it
streams the bank in tiles of BLOCK_M points with an online log-sum-exp (running maximum
log-weight per query; running sums rescaled when it grows), so the Q×M weight matrix never
exists and every bank tile loaded serves BLOCK_Q queries.  P u is accumulated directly
(Σ e r P u), so the score needs no cross-chunk exchange; with several chunks each program
recomputes q over all of d.  Block metrics (k ≤ 4) form P u from k shifted loads.
Shapes: y (Q, d) contiguous, bank (M, d) contiguous, prec (1, *param) contiguous; β, λ floats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import et_score as _ets
from .et_score import define_op, interpreting, launcher

__all__ = ["is_score_forward", "is_score_op"]

_TILE = 4096  # elements of one (BLOCK_Q, BLOCK_M, BLOCK_D) tile


@triton.jit
def _pair_tile(y_ptr, bank_ptr, prec_ptr, offs_q, mask_q, offs_m, mask_m, cols, d,
               K: tl.constexpr, KIND: tl.constexpr):
    """u = y_q − x_m (BLOCK_Q, BLOCK_M, BLOCK_D) and P u over the given columns; 0 where masked."""
    mask_d = cols < d
    yv = tl.load(y_ptr + offs_q[:, None] * d + cols[None, :], mask=mask_q[:, None] & mask_d[None, :], other=0.0)
    xv = tl.load(bank_ptr + offs_m[:, None] * d + cols[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    ok = mask_q[:, None, None] & mask_m[None, :, None] & mask_d[None, None, :]
    u = tl.where(ok, yv[:, None, :] - xv[None, :, :], 0.0)
    if KIND == 0:
        pu = u * tl.load(prec_ptr)
    elif KIND == 1:
        pu = u * tl.load(prec_ptr + cols, mask=mask_d, other=0.0)[None, None, :]
    else:
        pu = u * 0.0
        base = cols // K * K
        for b in tl.static_range(K):
            sc = base + b
            ys = tl.load(y_ptr + offs_q[:, None] * d + sc[None, :], mask=mask_q[:, None] & mask_d[None, :], other=0.0)
            xs = tl.load(bank_ptr + offs_m[:, None] * d + sc[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            coeff = tl.load(prec_ptr + (cols % K) * K + b, mask=mask_d, other=0.0)
            pu += coeff[None, None, :] * tl.where(ok, ys[:, None, :] - xs[None, :, :], 0.0)
    return u, pu


@triton.jit
def _is_score_forward_kernel(
    y_ptr, bank_ptr, prec_ptr, score_ptr, mean_ptr, ess_ptr,
    Q, M, d, params_ptr,
    KIND: tl.constexpr, K: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr,
):
    pid_q = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    dt = y_ptr.dtype.element_ty
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    mask_q = offs_q < Q
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < d
    beta = tl.load(params_ptr)  # β and λ as tensors of y's dtype: float kernel arguments are float32
    lam = tl.load(params_ptr + 1)
    lam_over_beta = lam / beta
    run_max = tl.full([BLOCK_Q], float("-inf"), dt)
    sum_e = tl.zeros([BLOCK_Q], dt)
    sum_e2 = tl.zeros([BLOCK_Q], dt)
    acc_r = tl.zeros([BLOCK_Q, BLOCK_D], dt)  # Σ e r P u
    acc_u = tl.zeros([BLOCK_Q, BLOCK_D], dt)  # Σ e u
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = offs_m < M
        if ONE_CHUNK:
            u, pu = _pair_tile(y_ptr, bank_ptr, prec_ptr, offs_q, mask_q, offs_m, mask_m, cols, d, K, KIND)
            q = tl.sum(u * pu, axis=2)
        else:
            q = tl.zeros([BLOCK_Q, BLOCK_M], dt)
            for c0 in range(0, d, BLOCK_D):
                cc = c0 + tl.arange(0, BLOCK_D)
                uc, puc = _pair_tile(y_ptr, bank_ptr, prec_ptr, offs_q, mask_q, offs_m, mask_m, cc, d, K, KIND)
                q += tl.sum(uc * puc, axis=2)
            u, pu = _pair_tile(y_ptr, bank_ptr, prec_ptr, offs_q, mask_q, offs_m, mask_m, cols, d, K, KIND)
        pos = q > 0
        q_safe = tl.where(pos, q, 1.0)
        qb = tl.where(pos, tl.exp(0.5 * beta * tl.log(q_safe)), 0.0)  # ‖u‖^β
        r = tl.where(pos, qb / q_safe, tl.where(beta == 2.0, 1.0, 0.0))  # ‖u‖^{β−2}
        logw = tl.where(mask_m[None, :], -lam_over_beta * qb, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logw, axis=1))
        scale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        e = tl.where(mask_m[None, :], tl.exp(logw - new_max[:, None]), 0.0)
        sum_e = sum_e * scale + tl.sum(e, axis=1)
        sum_e2 = sum_e2 * scale * scale + tl.sum(e * e, axis=1)
        acc_r = acc_r * scale[:, None] + tl.sum((e * r)[:, :, None] * pu, axis=1)
        acc_u = acc_u * scale[:, None] + tl.sum(e[:, :, None] * u, axis=1)
        run_max = new_max
    inv = 1.0 / tl.where(mask_q, sum_e, 1.0)
    out = offs_q[:, None] * d + cols[None, :]
    mask = mask_q[:, None] & mask_d[None, :]
    yv = tl.load(y_ptr + out, mask=mask, other=0.0)
    tl.store(score_ptr + out, -lam * acc_r * inv[:, None], mask=mask)
    tl.store(mean_ptr + out, yv - acc_u * inv[:, None], mask=mask)
    if chunk == 0:
        tl.store(ess_ptr + offs_q, sum_e * sum_e / tl.where(mask_q, sum_e2, 1.0), mask=mask_q)


def is_score_forward(y, bank, beta: float, lam: float, prec, kind: int):
    """(score (Q, d), mean (Q, d), ess (Q,)) of the importance-sampling oracle."""
    if y.dim() != 2 or bank.dim() != 2 or bank.shape[1] != y.shape[1]:
        raise ValueError(f"is_score: y must be (Q, d) and bank (M, d), got {tuple(y.shape)} and {tuple(bank.shape)}")
    if bank.shape[0] == 0:
        raise ValueError("is_score: the bank must hold at least one point")
    if kind not in (0, 1, 2) or prec.shape[0] != 1:
        raise ValueError(f"is_score: prec must be one metric (1, *param) of kind 0..2, got {tuple(prec.shape)}, kind {kind}")
    y, bank, prec = y.contiguous(), bank.contiguous(), prec.contiguous()
    Q, d = y.shape
    M = bank.shape[0]
    score, mean, ess = torch.empty_like(y), torch.empty_like(y), y.new_empty(Q)
    if Q == 0 or d == 0:
        return score, mean, ess
    k = prec.shape[-1] if kind == 2 else 1
    BLOCK_D = max(1, min(triton.next_power_of_2(d), _ets._MAX_BLOCK_D))
    BLOCK_Q = max(1, min(16, triton.next_power_of_2(Q)))
    BLOCK_M = max(1, min(triton.next_power_of_2(M), _TILE // (BLOCK_Q * BLOCK_D)))
    nch = triton.cdiv(d, BLOCK_D)
    params = torch.tensor([float(beta), float(lam)], dtype=y.dtype, device=y.device)
    launcher(_is_score_forward_kernel)[(triton.cdiv(Q, BLOCK_Q), nch)](
        y, bank, prec, score, mean, ess, Q, M, d, params,
        KIND=kind, K=k, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, ONE_CHUNK=nch == 1,
    )
    return score, mean, ess


def _fwd_impl(y: torch.Tensor, bank: torch.Tensor, beta: float, lam: float, prec: torch.Tensor,
              kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return is_score_forward(y, bank, beta, lam, prec, kind)


is_score_fwd_op = define_op("etweedie_triton::is_score_fwd", _fwd_impl)


def is_score_op(y, bank, beta: float, lam: float, prec, kind: int):
    """``etweedie_triton::is_score_fwd`` -> (score, mean, ess); not differentiable (an oracle)."""
    return is_score_fwd_op(y, bank, beta, lam, prec, kind)


if interpreting():
    @is_score_fwd_op.register_fake
    def _(y, bank, beta, lam, prec, kind):
        return y.new_empty(y.shape), y.new_empty(y.shape), y.new_empty(y.shape[:1])
