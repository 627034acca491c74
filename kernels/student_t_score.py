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

The kernels are et_score's (kernels/et_score.py) with the Student-t law (LAW = 1: the weight
1/(1 + q) and its slope, −2c in place of −λ, c passed where λ goes, ∂L/∂c where ∂L/∂λ comes
out, no β), so the score gets their work split, the block metric in registers and the draw
split for rows fewer than SMs.  This module keeps the op's own argument contract and torch
ops.  No GPU is queried at import time.
"""

from __future__ import annotations

import torch

from .et_score import (_launch_forward, check_draws_dtype, define_op, dense_metric_rows, interpreting,
                       launch_backward)

__all__ = ["student_t_score_forward", "student_t_score_backward", "student_t_score_op"]


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
    return dense_metric_rows(prec, kind)


def student_t_score_forward(y, x, c, prec, kind: int):
    """(s, m), both (B, d): the score −2c P m and m = (1/N) Σ_i (y − x_i)/(1 + q_i)."""
    prec = check_canonical("student_t_score", y, x, c, prec, kind)
    return _launch_forward(y, x, c, c, prec, kind, law=1, op="student_t_score")


def student_t_score_backward(grad, grad_m, y, x, c, prec, kind: int, m,
                             need_y=True, need_x=True, need_c=True, need_prec=True):
    """(grad_y (B, d), grad_x (B, N, d), grad_c (B,), grad_prec (B, *param)); a gradient not
    requested is an empty tensor (the contract of etweedie::student_t_score_bwd)."""
    prec_c = check_canonical("student_t_score_bwd", y, x, c, prec, kind)
    for name, t in (("grad", grad), ("grad_m", grad_m), ("m", m)):
        if t.shape != y.shape:
            raise ValueError(f"student_t_score_bwd: {name} must be {tuple(y.shape)}, got {tuple(t.shape)}")
    gy, gx, _, gc, gp = launch_backward(grad, grad_m, y, x, c, c, prec_c, prec.shape, kind, m,
                                        need_y, need_x, False, need_c, need_prec, law=1)
    return gy, gx, gc, gp


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
