"""Triton kernels of the Mahalanobis energy distance (DESIGN §1) and their torch ops.

    ED(a, b) = 2/(nm) Σ_{i,j} E(a_i − b_j) − w_n Σ_{i<j} E(a_i − a_j) − w_m Σ_{i<j} E(b_i − b_j),
    E(u) = ‖u‖_P^β,  w_n = 2/(n(n−1)) (unbiased: the signed U-statistic) or 2/n² (V-statistic).

Computes exactly what the C++ ops ``etweedie::energy_distance_fwd / _bwd`` compute
(csrc/cpu/energy_distance_cpu.cpp) on the same canonical inputs: a (B, n, d), b (B, m, d)
with unit stride over d (any stride over rows and points), beta (B,), prec (B, *param) of
metric kind 0 isotropic, 1 diagonal, 2 block (k ≤ 4).

Tiled (kernels/_energy.py): one program per (row, tile of ≤ 64 points for d ≤ 4, ≤ 32 above)
pairs its tile with every tile of the other cloud and, in the forward, with half of its own
cloud's tiles (circulant split: each unordered pair once, equal work per program).  Memory is
O((n + m)·d) plus one float64 pair per program — never n·m — for any n, m.  The backward runs
one launch per cloud with ordered pairs, so every point's gradient is summed by one program.
"""

from __future__ import annotations

import torch

from ._energy import energy_grads, energy_value
from .et_score import define_op, interpreting

__all__ = ["energy_distance_forward", "energy_distance_backward", "energy_distance_fwd_op",
           "energy_distance_bwd_op", "energy_distance_weights"]

_OP = "energy_distance"


def _within(n: int, unbiased: bool) -> float:
    if n < 2:
        return 0.0
    return 2.0 / (n * (n - 1.0)) if unbiased else 2.0 / (float(n) * n)


def energy_distance_weights(n: int, m: int, unbiased: bool):
    """(w_cross, w_a, w_b) of the pair sums (csrc/cpu/energy_distance_cpu.cpp)."""
    cross = 2.0 / (float(n) * m) if n > 0 and m > 0 else 0.0
    return (cross, -_within(n, unbiased), -_within(m, unbiased))


def _check(a, b, unbiased: bool):
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"{_OP}: clouds must be (B, n, d) and (B, m, d), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] == 0:
        return
    n, m = a.shape[1], b.shape[1]
    if n < 1 or m < 1:
        raise ValueError(f"{_OP}: both clouds need at least one point, got n = {n}, m = {m}")
    if unbiased and (n < 2 or m < 2):
        raise ValueError(f"{_OP}: the unbiased estimator needs n >= 2 and m >= 2, got n = {n}, m = {m}")


def energy_distance_forward(a, b, beta, prec, kind: int, unbiased: bool):
    """(B,) energy distance of every row (float32/float64, CUDA tensors or CPU under TRITON_INTERPRET=1)."""
    _check(a, b, unbiased)
    return energy_value(_OP, a, b, beta, prec, kind, energy_distance_weights(a.shape[1], b.shape[1], unbiased))


def energy_distance_backward(grad, a, b, beta, prec, kind: int, unbiased: bool,
                             need_a=True, need_b=True, need_beta=True, need_prec=True):
    """(∂/∂a (B, n, d), ∂/∂b (B, m, d), ∂/∂β (B,), ∂/∂prec (B, *param)) of Σ_r grad[r]·ED_r;
    an unrequested gradient is an empty tensor."""
    _check(a, b, unbiased)
    w = energy_distance_weights(a.shape[1], b.shape[1], unbiased)
    return energy_grads(_OP, grad, a, b, beta, prec, kind, w, need_a, need_b, need_beta, need_prec)[1:]


# ----------------------------------------------------------------------------- torch ops

def _fwd_impl(a: torch.Tensor, b: torch.Tensor, beta: torch.Tensor, prec: torch.Tensor, kind: int,
              unbiased: bool) -> torch.Tensor:
    return energy_distance_forward(a, b, beta, prec, kind, unbiased)


def _bwd_impl(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: torch.Tensor, prec: torch.Tensor,
              kind: int, unbiased: bool, need_a: bool, need_b: bool, need_beta: bool, need_prec: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = energy_distance_backward(grad, a, b, beta, prec, kind, unbiased, need_a, need_b, need_beta, need_prec)
    # custom ops may not return views of their inputs
    return tuple(o.clone() if o._base is not None else o for o in outs)


energy_distance_fwd_op = define_op("etweedie_triton::energy_distance_fwd", _fwd_impl)
energy_distance_bwd_op = define_op("etweedie_triton::energy_distance_bwd", _bwd_impl)


def _register() -> None:
    # Same fake and autograd rules as the C++ ops (etweedie/rules/pairwise.py).
    from etweedie.rules import pairwise

    if interpreting():
        energy_distance_fwd_op.register_fake(pairwise.fake_fwd)
        energy_distance_bwd_op.register_fake(pairwise.fake_bwd)
    setup_context, backward = pairwise.autograd_rules(energy_distance_bwd_op)
    energy_distance_fwd_op.register_autograd(backward, setup_context=setup_context)


_register()
