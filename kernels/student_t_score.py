"""Triton kernels of the Student-t score (paper Cor. student_t; DESIGN §1) and their torch ops.

Computes exactly what the C++ op ``etweedie::student_t_score_fwd/bwd`` computes (csrc/cpu/
student_t_score_cpu.cpp; math in csrc/common/student_t_score.h), on the canonical inputs

    y (B, d) contiguous, x (B, N, d) unit stride over d (any stride over B and N, 0 = a
    broadcast cloud), c (B,) any stride, prec (B, *param) any stride over B,
    kind 0 isotropic (param ()), 1 diagonal (param (d,)), 2 block (param (k, k), k ≤ 4);
    x in y's dtype or bfloat16/float16 (widened where loaded, as in kernels/et_score.py).

Forward:  u_i = y − x_i, q_i = u_iᵀPu_i, w_i = 1/(1 + q_i), m = (1/N) Σ w_i u_i, s = −2c P m.
Backward: h = −2c P g + g_m; ∂L/∂u_i = (w_i h − 2 w_i² (h·u_i) P u_i)/N; ∂L/∂c = −2 g·Pm;
          ∂L/∂P = −2c g mᵀ − (1/N) Σ w_i² (h·u_i) u_i u_iᵀ.

The same work split and register-level metric as the et_score kernels (kernels/et_score.py,
whose device helpers this module reuses): one program per (query row, chunk of BLOCK_D
coordinates), draws in tiles of BLOCK_N, P u formed from shifted loads.  No draw split (the
Student-t score is not on the sampler's hot path); metric and c gradients are reduced per chunk
into small partial buffers that the host sums.  No GPU is queried at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .et_score import (_block_in_registers, _narrow, _prec_vec, _residual_pu, _residual_tile, block_sizes, check_draws_dtype,
                       define_op, interpreting, launcher)

__all__ = ["student_t_score_forward", "student_t_score_backward", "student_t_score_op"]


@triton.jit
def _student_t_weight(q):
    """1/(1 + q) (csrc/common/student_t_score.h)."""
    return 1.0 / (1.0 + q)


@triton.jit(do_not_specialize=["N"])
def _student_t_forward_kernel(
    y_ptr, x_ptr, c_ptr, prec_ptr, out_ptr, m_ptr,
    N, d, sxb, sxn, sc, sp,
    KIND: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr, IN_REGISTERS: tl.constexpr,
):
    """s and m for one row's coordinate chunk (a power-of-two block metric applied in registers,
    as in et_score's forward: _residual_pu)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    kk = tl.arange(0, KP)
    y_row = y_ptr + row * d
    x_row = x_ptr + row * sxb
    p_row = prec_ptr + row * sp
    two_c = 2.0 * tl.load(c_ptr + row * sc)
    acc_u = tl.zeros([BLOCK_D], dtype=y_ptr.dtype.element_ty)
    acc_pu = tl.zeros([BLOCK_D], dtype=y_ptr.dtype.element_ty)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = offs_n < N
        if ONE_CHUNK:
            u, pu = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                 IN_REGISTERS)
            q = tl.sum(u * pu, axis=1)
        else:
            q = tl.zeros([BLOCK_N], dtype=y_ptr.dtype.element_ty)
            for c0 in range(0, d, BLOCK_D):
                cc = c0 + tl.arange(0, BLOCK_D)
                uc, puc = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cc, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                       IN_REGISTERS)
                q += tl.sum(uc * puc, axis=1)
            u, pu = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                 IN_REGISTERS)
        w = tl.where(mask_n, _student_t_weight(q), 0.0)
        acc_u += tl.sum(w[:, None] * u, axis=0)
        acc_pu += tl.sum(w[:, None] * pu, axis=0)
    mask_d = cols < d
    inv_n = 1.0 / (tl.zeros([], y_ptr.dtype.element_ty) + N)
    tl.store(m_ptr + row * d + cols, acc_u * inv_n, mask=mask_d)
    tl.store(out_ptr + row * d + cols, -two_c * acc_pu * inv_n, mask=mask_d)


def _block_k(prec: torch.Tensor, kind: int) -> int:
    return prec.shape[-1] if kind == 2 else 1


def check_canonical(op: str, y, x, c, prec, kind: int):
    """The C++ kernels' argument contract (csrc/cpu/student_t_score_cpu.cpp), as ValueErrors;
    returns prec with its parameter dims contiguous (a shared metric keeps stride 0 over rows)."""
    if y.dim() != 2 or not y.is_contiguous():
        raise ValueError(f"{op}: y must be contiguous (B, d), got shape {tuple(y.shape)}")
    B, d = y.shape
    if x.dim() != 3 or x.shape[0] != B or x.shape[2] != d or (d > 1 and x.numel() > 0 and x.stride(2) != 1):
        raise ValueError(f"{op}: x must be (B={B}, N, d={d}) with unit stride over d, got {tuple(x.shape)}")
    if c.shape != (B,):
        raise ValueError(f"{op}: c must be ({B},), got {tuple(c.shape)}")
    if kind not in (0, 1, 2):
        raise ValueError(f"{op}: unknown metric kind {kind} (0 isotropic, 1 diagonal, 2 block)")
    core = {0: (), 1: (d,)}.get(kind)
    if kind == 2:
        k = prec.shape[-1] if prec.dim() == 3 else -1
        if prec.dim() != 3 or prec.shape[1] != k or not 1 <= k <= 4 or d % k:
            raise ValueError(f"{op}: block precision must be (B, k, k) with k <= 4 dividing d={d}, got {tuple(prec.shape)}")
        core = (k, k)
    if prec.shape != (B, *core):
        raise ValueError(f"{op}: prec must be {(B, *core)} for metric kind {kind}, got {tuple(prec.shape)}")
    check_draws_dtype(op, y, x)
    for name, t in (("c", c), ("prec", prec)):
        if t.dtype != y.dtype or t.device != y.device:
            raise ValueError(f"{op}: {name} must match y's dtype/device ({y.dtype}, {y.device}), got ({t.dtype}, {t.device})")
    if kind != 0 and B > 0 and not prec[0].is_contiguous():
        prec = prec[:1].contiguous().expand_as(prec) if prec.stride(0) == 0 else prec.contiguous()
    return prec


def student_t_score_forward(y, x, c, prec, kind: int):
    """(s, m), both (B, d): the score −2c P m and m = (1/N) Σ_i (y − x_i)/(1 + q_i)."""
    prec = check_canonical("student_t_score", y, x, c, prec, kind)
    B, d = y.shape
    N = x.shape[1]
    out = torch.empty_like(y)
    m = torch.empty_like(y)
    if B == 0 or d == 0:
        return out, m
    if N == 0:
        raise ValueError("student_t_score: need at least one posterior draw (N >= 1)")
    k = _block_k(prec, kind)
    BLOCK_N, BLOCK_D, KP, nch = block_sizes(N, d, kind, k)
    launcher(_student_t_forward_kernel)[(B, nch)](
        y, x, c, prec, out, m, N, d, x.stride(0), x.stride(1), c.stride(0), prec.stride(0),
        KIND=kind, K=k, KP=KP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ONE_CHUNK=nch == 1,
        IN_REGISTERS=_block_in_registers(kind, KP, k, BLOCK_D), num_warps=8 if BLOCK_D * BLOCK_N * KP >= 4096 else 4,
    )
    return out, m


@triton.jit(do_not_specialize=["N"])
def _student_t_backward_kernel(
    g_ptr, gm_ptr, y_ptr, x_ptr, c_ptr, prec_ptr, m_ptr,
    gy_ptr, gx_ptr, gc_ptr, gp_ptr,
    N, d, sxb, sxn, sc, sp, nchunks,
    KIND: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr,
    NEED_X: tl.constexpr, NEED_C: tl.constexpr, NEED_PREC: tl.constexpr,
):
    """Gradients for one row's coordinate chunk: gy[row, chunk], gx[row, :, chunk],
    gc[row, chunk] and the metric gradient's partial for this chunk: gp[row, chunk]
    (isotropic), gp[row, cols] (diagonal), gp[row, chunk, k, k] (block)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < d
    kk = tl.arange(0, KP)
    y_row = y_ptr + row * d
    x_row = x_ptr + row * sxb
    p_row = prec_ptr + row * sp
    two_c = 2.0 * tl.load(c_ptr + row * sc)
    dt = y_ptr.dtype.element_ty
    pg, _g3 = _prec_vec(g_ptr + row * d, p_row, cols, kk, d, K, KIND)
    h = -two_c * pg + tl.load(gm_ptr + row * d + cols, mask=mask_d, other=0.0)
    inv_n = 1.0 / (tl.zeros([], y_ptr.dtype.element_ty) + N)
    acc_gy = tl.zeros([BLOCK_D], dtype=dt)
    acc_outer = tl.zeros([BLOCK_D, KP], dtype=dt)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = offs_n < N
        if ONE_CHUNK:
            u, pu, u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND)
            q = tl.sum(u * pu, axis=1)
            hu = tl.sum(h[None, :] * u, axis=1)
        else:
            q = tl.zeros([BLOCK_N], dtype=dt)
            hu = tl.zeros([BLOCK_N], dtype=dt)
            for c0 in range(0, d, BLOCK_D):
                cc = c0 + tl.arange(0, BLOCK_D)
                uc, puc, _u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cc, kk, d, K, KIND)
                pgc, _gc = _prec_vec(g_ptr + row * d, p_row, cc, kk, d, K, KIND)
                hc = -two_c * pgc + tl.load(gm_ptr + row * d + cc, mask=cc < d, other=0.0)
                q += tl.sum(uc * puc, axis=1)
                hu += tl.sum(hc[None, :] * uc, axis=1)
            u, pu, u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND)
        w = tl.where(mask_n, _student_t_weight(q), 0.0)
        cs = tl.where(mask_n, -2.0 * w * w * hu, 0.0)
        gu = (w[:, None] * h[None, :] + cs[:, None] * pu) * inv_n
        acc_gy += tl.sum(gu, axis=0)
        if NEED_X:
            gx_off = (row * N + offs_n)[:, None] * d + cols[None, :]
            tl.store(gx_ptr + gx_off, _narrow(-gu, gx_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
        if NEED_PREC:
            acc_outer += tl.sum((0.5 * inv_n) * cs[:, None, None] * u[:, :, None] * u3, axis=0)
    tl.store(gy_ptr + row * d + cols, acc_gy, mask=mask_d)
    if NEED_C or NEED_PREC:
        gv = tl.load(g_ptr + row * d + cols, mask=mask_d, other=0.0)
        pm, m3 = _prec_vec(m_ptr + row * d, p_row, cols, kk, d, K, KIND)
        if NEED_C:
            tl.store(gc_ptr + row * nchunks + chunk, -2.0 * tl.sum(gv * pm, axis=0))  # g·s/c = −2 g·Pm
        if NEED_PREC:
            acc_outer += -two_c * gv[:, None] * m3  # −2c g mᵀ
            if KIND == 0:
                tl.store(gp_ptr + row * nchunks + chunk, tl.sum(tl.sum(acc_outer, axis=1), axis=0))
            elif KIND == 1:
                tl.store(gp_ptr + row * d + cols, tl.sum(acc_outer, axis=1), mask=mask_d)
            else:
                base = gp_ptr + (row * nchunks + chunk) * (K * K)
                for a in tl.static_range(K):
                    sel = ((cols % K) == a) & mask_d
                    entry = tl.sum(tl.where(sel[:, None], acc_outer, 0.0), axis=0)  # (KP,) over b
                    tl.store(base + a * K + kk, entry, mask=kk < K)


def student_t_score_backward(grad, grad_m, y, x, c, prec, kind: int, m,
                             need_y=True, need_x=True, need_c=True, need_prec=True):
    """(grad_y (B, d), grad_x (B, N, d), grad_c (B,), grad_prec (B, *param)); a gradient not
    requested is an empty tensor (the contract of etweedie::student_t_score_bwd)."""
    prec_in = prec
    prec = check_canonical("student_t_score_bwd", y, x, c, prec, kind)
    B, d = y.shape
    N = x.shape[1]
    for name, t in (("grad", grad), ("grad_m", grad_m), ("m", m)):
        if t.shape != y.shape:
            raise ValueError(f"student_t_score_bwd: {name} must be {tuple(y.shape)}, got {tuple(t.shape)}")
    g, gm, mc = grad.contiguous(), grad_m.contiguous(), m.contiguous()

    def empty():  # a fresh one per output: outputs of a custom op must not alias
        return y.new_empty(0)

    gy = torch.zeros_like(y)
    gx = x.new_empty((B, N, d)) if need_x else empty()  # x's dtype
    gc, gp = empty(), empty()
    if B == 0 or d == 0 or N == 0:
        gc = y.new_zeros(B) if need_c else empty()
        gp = y.new_zeros(prec_in.shape) if need_prec else empty()
        if need_x:
            gx.zero_()
        return (gy if need_y else empty()), gx, gc, gp
    k = _block_k(prec, kind)
    BLOCK_N, BLOCK_D, KP, nch = block_sizes(N, d, kind, k)
    gc_part = y.new_zeros((B, nch)) if need_c else empty()
    if need_prec:
        gp_part = {0: lambda: y.new_zeros((B, nch)), 1: lambda: y.new_zeros((B, d)),
                   2: lambda: y.new_zeros((B, nch, k, k))}[kind]()
    else:
        gp_part = empty()
    launcher(_student_t_backward_kernel)[(B, nch)](
        g, gm, y, x, c, prec, mc, gy, gx if need_x else gy, gc_part if need_c else gy,
        gp_part if need_prec else gy,
        N, d, x.stride(0), x.stride(1), c.stride(0), prec.stride(0), nch,
        KIND=kind, K=k, KP=KP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ONE_CHUNK=nch == 1,
        NEED_X=need_x, NEED_C=need_c, NEED_PREC=need_prec,
        num_warps=8 if BLOCK_D * BLOCK_N * KP >= 4096 else 4,
    )
    if need_c:
        gc = gc_part.sum(1)
    if need_prec:
        gp = gp_part if kind == 1 else gp_part.sum(1)
    return (gy if need_y else empty()), gx, gc, gp


# ----------------------------------------------------------------------------- torch ops

def _fwd_impl(y: torch.Tensor, x: torch.Tensor, c: torch.Tensor, prec: torch.Tensor,
              kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    return student_t_score_forward(y, x, c, prec, kind)


def _bwd_impl(grad: torch.Tensor, grad_m: torch.Tensor, y: torch.Tensor, x: torch.Tensor, c: torch.Tensor,
              prec: torch.Tensor, kind: int, m: torch.Tensor, need_y: bool, need_x: bool, need_c: bool,
              need_prec: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = student_t_score_backward(grad, grad_m, y, x, c, prec, kind, m, need_y, need_x, need_c, need_prec)
    return tuple(o.clone() if o._base is not None else o for o in outs)  # no views of inputs


student_t_score_fwd_op = define_op("etweedie_triton::student_t_score_fwd", _fwd_impl)
student_t_score_bwd_op = define_op("etweedie_triton::student_t_score_bwd", _bwd_impl)


def student_t_score_op(y, x, c, prec, kind: int):
    """The differentiable op ``etweedie_triton::student_t_score_fwd`` -> (s, m)."""
    return student_t_score_fwd_op(y, x, c, prec, kind)


def _register() -> None:
    # Same fake and autograd rules as the C++ op (etweedie/rules/student_t_score.py).
    from etweedie.rules.student_t_score import autograd_rules, fake_bwd, fake_fwd

    if interpreting():
        student_t_score_fwd_op.register_fake(fake_fwd)
        student_t_score_bwd_op.register_fake(fake_bwd)
    setup_context, backward = autograd_rules(student_t_score_bwd_op)
    student_t_score_fwd_op.register_autograd(backward, setup_context=setup_context)


_register()
