"""energy_score: the Mahalanobis energy score, the posterior's training loss (DESIGN §1).

    ES_{P,β}(x_{1..M}, y) = (1/M) Σ_i ‖x_i − y‖_P^β − 1/(2M(M−1)) Σ_{i≠j} ‖x_i − x_j‖_P^β

(``fair=True``: the unbiased pair term; ``fair=False``: 1/(2M²) Σ_{i,j}).  This module
validates arguments, picks the backend and registers the fake (meta) and autograd
implementations of the compiled op ``etweedie::energy_score_fwd``, so that it runs under
``torch.compile(fullgraph=True)`` and differentiates with respect to the samples, the target,
β and the metric (through its precision parameter) with the fused backward kernel.

Coincident points: a pair with x_i == x_j (or x_i == y) contributes 0 and a zero gradient.
For β ≥ 1 that is the true gradient (β > 1) or a subgradient (β = 1); for β < 1 the
function has a cusp there and 0 is this package's convention (never NaN).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .. import backends
from ..geometry import Metric, _functorch_wrapped
from ..rules.common import DENSE
from ..rules.energy_score import fake_fwd_grad, fwd_grad_autograd_rules
from . import reference
from ._args import (
    _KIND,
    as_param,
    broadcast_batch,
    check_beta,
    check_metric,
    check_tensor,
    checked_cpu_param,
    flat,
    metric_param,
    precision_of,
    row_whitening_factor,
)
from ._call import OpSpec, call
from ._debug import check_finite, value_checks
from ._front import front_applies, plain_backend, plain_call, plain_metric
from ._pairwise import register_pairwise_op
from ._range import nan_rows, scan
from ._ties import tie_to_rows
from ._whiten import centred_rows_matmul, dense_centre

__all__ = ["energy_score"]

_OP = "energy_score"


def energy_score(
    samples: torch.Tensor,
    target: torch.Tensor,
    beta=1.0,
    metric: Optional[Metric] = None,
    *,
    fair: bool = True,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Mahalanobis energy score of the draws ``samples`` against the observation ``target``.

    Args:
        samples: draws of the predictive law, ``(*batch, M, d)``, float32 or float64.
        target: the observed value, ``(*batch, d)``; batch dims broadcast with the samples'.
        beta: exponent β ∈ (0, 2], float or tensor broadcasting to ``batch`` (one per row).
        metric: :class:`~etweedie.Metric` giving P = Σ⁻¹ (None: P = I); may carry a batch.
        fair: unbiased pair term 1/(2M(M−1)) Σ_{i≠j} (needs M ≥ 2); False: 1/(2M²) Σ_{i,j}.
        backend: ``None`` (automatic), ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns:
        the score per row, ``(*batch,)``; lower is better (strictly proper for β ∈ (0, 2)).

    Example::

        >>> x = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]]); y = torch.tensor([[1.0, 0.0]])
        >>> etweedie.energy_score(x, y)              # (1 + 1)/2 − 2·2/(2·2·1)
        tensor([0.])
    """
    return call(_SPEC, energy_score, samples, target, beta, metric, fair=fair, backend=backend)


@dataclass
class _Call:
    """A checked energy_score call (nothing expanded yet)."""
    samples: torch.Tensor  # (*, M, d)
    target: torch.Tensor  # (*, d)
    beta: torch.Tensor  # broadcasts to batch
    metric: Metric
    given_metric: Optional[Metric]  # as given (None: P = I, the default metric's parameter passed as is)
    fair: bool
    batch: torch.Size

    device = property(lambda self: self.samples.device)
    dtype = property(lambda self: self.samples.dtype)
    data = property(lambda self: (self.samples, self.target))
    inputs = property(lambda self: (self.samples, self.target, self.beta, self.metric))


def _check(samples, target, beta=1.0, metric=None, *, fair=True, backend=None) -> _Call:
    samples = check_tensor(samples, "samples", _OP)
    target = check_tensor(target, "target", _OP)
    if samples.dim() < 2:
        raise ValueError(f"{_OP}: samples must have shape (*batch, M, d), got shape {tuple(samples.shape)}")
    if target.dim() < 1:
        raise ValueError(f"{_OP}: target must have shape (*batch, d), got a 0-d tensor")
    if target.dtype != samples.dtype:
        raise TypeError(f"{_OP}: target must have samples' dtype {samples.dtype}, got {target.dtype}")
    if target.device != samples.device:
        raise ValueError(f"{_OP}: target is on {target.device} but samples are on {samples.device}")
    M, d = samples.shape[-2], samples.shape[-1]
    if target.shape[-1] != d:
        raise ValueError(f"{_OP}: target must have shape (*batch, d={d}) to match samples, got {tuple(target.shape)}")
    if d == 0:
        raise ValueError(f"{_OP}: the dimension d must be >= 1, got samples of shape {tuple(samples.shape)}")
    if M == 0:
        raise ValueError(f"{_OP}: samples must hold at least one draw (M >= 1), got shape {tuple(samples.shape)}")
    if not isinstance(fair, bool):
        raise TypeError(f"{_OP}: fair must be a bool, got {type(fair).__name__}")
    if fair and M < 2:
        raise ValueError(f"{_OP}: fair=True needs M >= 2 samples per target, got M = {M} (use fair=False)")
    beta_t = as_param(beta, "beta", _OP, samples)  # a plain number is range-checked here
    if isinstance(beta, torch.Tensor):
        check_beta(beta_t, _OP)
    check_finite(_OP, samples=samples, target=target)
    checked = check_metric(metric, d, samples, _OP)
    batch = broadcast_batch(
        _OP, samples=samples.shape[:-2], target=target.shape[:-1], beta=beta_t.shape, metric=checked.batch_shape
    )
    return _Call(samples, target, beta_t, checked, metric, fair, batch)


def _run(name: str, c: _Call) -> Optional[torch.Tensor]:
    samples, target, beta_t, metric, batch = c.samples, c.target, c.beta, c.metric, c.batch
    in_kernel = name == "cpu" and _gram_row_kernel(samples, beta_t, metric, samples.shape[-1])
    out_of_range, finite = (False, True) if in_kernel else scan(c.given_metric, samples, target)
    if out_of_range:
        return None
    # the row kernel gives NaN rows for non-finite inputs itself; or the inputs were checked finite
    check_nan = not (in_kernel or (finite and value_checks(samples)))
    if front_applies(_OP, name, _KIND[metric.kind], samples, target, beta_t, metric.param):
        # eager CPU/CUDA: canonical form, kernel call and NaN rows in one C++ call (csrc/front/)
        prec = metric.param if c.given_metric is None else precision_of(metric, samples.dtype, _OP)
        fused = _training(samples, target, beta_t, prec) and _fused_available(samples.device)
        return torch.ops.etweedie.energy_score(samples, target, beta_t, prec, _KIND[metric.kind], c.fair, batch,
                                               fused, check_nan)
    out = _python_form(name, c)
    if not check_nan:
        return out.reshape(batch)
    return nan_rows(out, batch, (samples, 2), (target, 1)).reshape(batch)


def _python_form(name: str, c: _Call) -> torch.Tensor:
    """The score per flat row, (B,), from the canonical form: the reference, the whitened
    isotropic kernel of a dense metric, or the kernel."""
    M, d = c.samples.shape[-2:]
    B = math.prod(c.batch)
    xs = c.samples.expand(*c.batch, M, d).reshape(B, M, d)
    if d > 1 and xs.stride(-1) != 1:
        xs = xs.contiguous()
    yt = c.target.expand(*c.batch, d).reshape(B, d).contiguous()
    betas = flat(c.beta, c.batch, ())
    prec, kind = metric_param(c.metric, c.batch, d, xs.dtype, _OP)
    if name == "reference":
        return reference.energy_score(xs, yt, betas, prec, kind, c.fair)
    if kind != DENSE:
        return _kernel(name, xs, yt, betas, prec, kind, c.fair)
    # P = L Lᵀ: the isotropic kernel on z = Lᵀ(x − c), c the target (or a shared cloud's first
    # draw), a constant: whitened coordinates, and their rounding, at the draws' spread (see whiten_dense)
    Lb = row_whitening_factor(c.metric, c.batch, xs.dtype, _OP)
    centre = dense_centre(xs, yt.unsqueeze(1), Lb)
    zs = centred_rows_matmul(xs, centre, Lb, tie=True)  # equal draws, equal z
    ut = yt.unsqueeze(1) - centre  # (0 when the centre is the target: an exact coincidence with a draw there)
    zt = (ut @ Lb).squeeze(1).contiguous()
    if centre.shape[0] == 1 and B > 1:  # a shared cloud's centre: a target equal to one of its draws takes its z
        zt = tie_to_rows(zt, ut.squeeze(1), zs[0], xs[0].to(centre.dtype) - centre[0])
    ones = torch.ones((), dtype=xs.dtype, device=xs.device).expand(B)
    return _kernel(name, zs, zt, betas, ones, 0, c.fair)


def _plain_call(samples, target, beta=1.0, metric=None, *, fair=True, backend=None) -> Optional[torch.Tensor]:
    """The plain CPU call (:func:`_plain`) straight to the C++ front op, or None."""
    plain = _plain(samples, target, beta, metric, fair, backend)
    if plain is None:
        return None
    beta_t, prec, kind = plain
    fused = _FUSED and _training(samples, target, beta_t, prec)
    return torch.ops.etweedie.energy_score(samples, target, beta_t, prec, kind, fair, samples.shape[:1], fused, False)


def _plain(samples, target, beta, metric, fair, backend):
    """``(beta, prec, kind)`` when the call is the plain CPU training or scoring call that the
    general path below would hand to the C++ front op with the Gram-form row kernel
    (:func:`_gram_row_kernel`, which needs no range check and writes its own NaN rows), or None:
    then the general path runs and raises whatever is wrong.  The guards of
    :func:`~etweedie.ops._front.plain_rows` (see there, and tests/test_energy_score_front.py),
    plus: samples (B, M, d) and target (B, d) plain float32 CPU tensors with 1 ≤ M ≤ 255
    (M ≥ 2 if ``fair``) and d ≥ 64, β a checked float, a metric parameter needing no gradient."""
    if not (_GRAM_ON and plain_call(_OP, backend)) or type(samples) is not torch.Tensor or type(target) is not torch.Tensor:
        return None
    if samples.dtype is not torch.float32 or target.dtype is not torch.float32 or not (samples.is_cpu and target.is_cpu):
        return None
    xs, ts = samples.shape, target.shape
    if len(xs) != 3 or len(ts) != 2 or xs[0] != ts[0] or xs[2] != ts[1] or ts[1] < 64 or not 1 <= xs[1] <= 255:
        return None
    if type(fair) is not bool or (fair and xs[1] < 2):
        return None
    beta_t = checked_cpu_param("beta", beta, torch.float32)
    if beta_t is None or _functorch_wrapped(samples) or _functorch_wrapped(target):
        return None
    if metric is not None and (type(metric) is not Metric or metric.param.requires_grad):
        return None
    pk = plain_metric(metric, torch.float32, ts[1], _OP)
    if pk is None or not plain_backend(backend):
        return None
    return beta_t, pk[0], pk[1]


# ETWEEDIE_CPU_GRAM=0 turns the C++ Gram-form kernels off (read once, as the extension does).
_GRAM_ON = not os.environ.get("ETWEEDIE_CPU_GRAM", "").startswith("0")


def _gram_row_kernel(samples: torch.Tensor, beta: torch.Tensor, metric: Metric, d: int) -> bool:
    """Whether the CPU op runs its Gram-form row kernel (csrc/cpu/energy_score_gram_cpu.h; the
    same conditions as its ``energy_score_gram_applicable``): float32, d ≥ 64, 1 ≤ M ≤ 255, no
    gradient of β or of the metric asked, metric applied in-kernel (not dense).  That kernel
    scales each row by powers of two (float32 data of any magnitude; the rare row that one scale
    cannot hold, a pair 10¹⁵ times closer than the row's largest coordinate or points that
    overflow when centred, it recomputes itself in float64 with the pair engine) and
    returns NaN value and gradients for a row with a NaN or inf, so the op skips its own range
    check and NaN-row pass — two full passes over the samples, a large share of a training
    step at these sizes."""
    params_grad = torch.is_grad_enabled() and (beta.requires_grad or metric.param.requires_grad)
    return (
        _GRAM_ON
        and samples.dtype == torch.float32
        and metric.kind != "dense"
        and d >= 64
        and 1 <= samples.shape[-2] <= 255
        and not params_grad
    )


def _kernel(name, samples, target, beta, prec, kind, fair) -> torch.Tensor:
    """Training (some input requires grad): one fused pass computes the value and the unit
    gradients, so backward only scales them; otherwise the forward-only op.  ``name`` is
    "cpu"/"cuda" (the compiled op; the dispatcher picks the device's kernel) or "triton"."""
    training = _training(samples, target, beta, prec)
    if name == "triton":
        from ..kernels import energy_score as tk  # imports triton: only when asked for

        fwd, fused = tk.energy_score_fwd_op, tk.energy_score_fwd_grad_op
    else:
        fwd = torch.ops.etweedie.energy_score_fwd
        fused = torch.ops.etweedie.energy_score_fwd_grad if _fused_available(samples.device) else None
    if training and fused is not None:
        need = [t.requires_grad for t in (samples, target, beta, prec)]
        return fused(samples, target, beta, prec, kind, fair, *need)[0]
    return fwd(samples, target, beta, prec, kind, fair)


def _training(*tensors) -> bool:
    """Whether the call is recorded for a gradient (grad mode on, some input requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _fused_available(device: torch.device) -> bool:
    return _FUSED if device.type == "cpu" else _FUSED_CUDA


# Looked up once at import (the extension registers its kernels when it loads); a lookup inside
# the op would break torch.compile's graph (a dispatcher query returns a bool, not a tensor).
_FUSED = backends._EXT_OK and backends._has_op("energy_score_fwd_grad", "CPU")
_FUSED_CUDA = backends._EXT_OK and backends._has_op("energy_score_fwd_grad", "CUDA")


# ---------------------------------------------------------------------------- registration

def _register() -> None:
    register_pairwise_op("energy_score", torch.ops.etweedie.energy_score_bwd)
    if _FUSED:
        _register_fused()


def _register_fused() -> None:
    name = "etweedie::energy_score_fwd_grad"
    torch.library.register_fake(name)(fake_fwd_grad)
    if backends._has_op("energy_score_fwd_grad", "Autograd"):
        # the extension's C++ autograd kernel (csrc/autograd/energy_score_autograd.cpp): the same
        # rule without a Python call per training step
        return
    setup_context, backward = fwd_grad_autograd_rules()
    torch.library.register_autograd(name, backward, setup_context=setup_context)


_SPEC = OpSpec(_OP, ("samples", "target", "beta", "metric"), _check, _run, data=("samples", "target"),
               degree=lambda c: c.beta, plain=_plain_call, forward_mode=False)

if backends._EXT_OK and backends._has_op("energy_score_fwd", "CPU"):
    _register()
