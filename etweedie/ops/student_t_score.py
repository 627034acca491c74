"""student_t_score: the Student-t score field from posterior draws (paper Cor. student_t).

For Student-t noise q(u) ∝ (1 + ‖u‖_P²)^{−c} (c > d/2, ν = 2c − d) the score of the noisy
marginal is

    s(y) = −2c P (1/N) Σ_i (y − x_i) / (1 + ‖y − x_i‖_P²),      x_i ~ P(X | Y = y)

— the Energy-Tweedie score's structure with λ → 2c and the weight ‖u‖^{β−2} → 1/(1 + ‖u‖²).
This module validates arguments, picks the backend and registers the fake (meta) and
autograd implementations of the compiled op ``etweedie::student_t_score_fwd`` (CPU C++ and
CUDA; the Triton op ``etweedie_triton::student_t_score_fwd`` shares the rules), so that it runs
under ``torch.compile(fullgraph=True)`` and differentiates with respect to y, x, c and the
metric (through its precision parameter) with a fused backward kernel.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from .. import backends
from ..geometry import Metric
from ..rules.common import DENSE
from ..rules.student_t_score import autograd_rules, fake_bwd, fake_fwd
from . import reference
from ._args import as_param, check_tensor, checked_cpu_param, flat
from ._call import OpSpec, call
from ._debug import value_checks
from ._front import front, plain_rows
from ._range import range_guarded
from ._rows import RowArgs, rows_args, shape_rows
from ._whiten import unwhiten_score, whiten_dense

__all__ = ["student_t_score"]

_OP = "student_t_score"


def student_t_score(y: torch.Tensor, x: torch.Tensor, c, metric: Optional[Metric] = None, *,
                    backend: Optional[str] = None) -> torch.Tensor:
    """Student-t score field −2c P (1/N) Σ_i (y − x_i)/(1 + ‖y − x_i‖_P²) from posterior draws.

    Args:
        y: queries ``(*batch, d)``, float32 or float64.
        x: posterior draws ``(*batch, N, d)`` (N ≥ 1); batch dims broadcast with y's.  y's dtype,
            or bfloat16 / float16 (the dtype rule of :func:`etweedie.et_score`).
        c: exponent of q(u) ∝ (1 + ‖u‖_P²)^{−c}, c > d/2; float or tensor broadcasting to
            ``batch`` (one per row).
        metric: :class:`~etweedie.Metric` (None: P = I); may carry a batch.
        backend: ``None`` (automatic), ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns:
        the score, ``(*batch, d)``, in y's dtype.  A draw equal to y contributes 0.

    Example::

        >>> etweedie.student_t_score(torch.zeros(1, 1), torch.ones(1, 1, 1), c=1.0)
        tensor([[1.]])
    """
    return call(_SPEC, student_t_score, y, x, c, metric, backend=backend)


def _shortcut(y, x, c, metric=None, *, backend=None) -> Optional[torch.Tensor]:
    """The plain float32 CPU call (:func:`~etweedie.ops._front.plain_rows`, a c that passed its rule
    before) straight to the C++ front op, one unbatched query as a batch of one, or None."""
    if type(y) is torch.Tensor and type(x) is torch.Tensor and y.dim() == 1 and x.dim() == 2 \
            and (isinstance(c, numbers.Real) and not isinstance(c, bool) or isinstance(c, torch.Tensor) and c.dim() == 0) \
            and (metric is None or not isinstance(metric, Metric) or len(metric.batch_shape) == 0):
        return student_t_score(y.unsqueeze(0), x.unsqueeze(0), c, metric, backend=backend)[0]
    plain = plain_rows(_OP, y, x, 2.0, 1.0, metric, backend)  # β and λ unused, as below
    # (float64 takes the general path: its data range is read by a scan there, the kernel checks none)
    if plain is None or "cpu" not in _SUPPORTED or y.dtype is not torch.float32:
        return None
    cp = checked_cpu_param("c", c, y.dtype)
    if cp is None or not float(cp) > y.shape[-1] / 2:  # the rounded c, as the general path checks it
        return None
    s, nonfinite = torch.ops.etweedie.student_t_score(y, x, cp, *plain[2:])
    return None if nonfinite else s  # a flagged row: the general path reruns the call (in float64 where needed)


@dataclass
class _Call:
    """A checked student_t_score call: the score's rows and c."""
    a: RowArgs
    c: torch.Tensor  # broadcasts to batch

    device = property(lambda self: self.a.device)
    dtype = property(lambda self: self.a.dtype)
    metric = property(lambda self: self.a.metric)
    data = property(lambda self: self.a.data)
    inputs = property(lambda self: (*self.a.inputs, self.c))


def _check(y, x, c, metric=None, *, backend=None) -> _Call:
    y = check_tensor(y, "y", _OP)
    cv = as_param(c, "c", _OP, y)
    a = rows_args(_OP, y, x, 2.0, 1.0, metric)  # β and λ unused: the shared validation of y, x, metric
    d = y.shape[-1]
    if cv.numel() and value_checks(cv) and not bool(((cv > d / 2) & torch.isfinite(cv)).all()):
        got = cv[~((cv > d / 2) & torch.isfinite(cv))].flatten()[0].item()
        given = f"{c!r}, which is {got!r} in {cv.dtype}" if type(c) is float and c != got else repr(got)
        raise ValueError(f"{_OP}: c must be > d/2 = {d / 2:g} and finite (Student-t integrability), got {given}")
    try:
        batch = torch.broadcast_shapes(a.batch, cv.shape)
    except RuntimeError:
        raise ValueError(f"{_OP}: c of shape {tuple(cv.shape)} does not broadcast to batch {tuple(a.batch)}") from None
    if batch != a.batch:
        raise ValueError(f"{_OP}: c of shape {tuple(cv.shape)} would enlarge the batch {tuple(a.batch)}")
    return _Call(a, cv)


def _run(name: str, c: _Call) -> Optional[torch.Tensor]:
    """The score under the range and NaN rules (:func:`~etweedie.ops._range.range_guarded`; 1/(1 + q)
    needs no near-draw care), or None."""
    a = c.a

    def run():  # (score, whether the CPU kernel wrote NaN/inf: known from the front op only)
        if front(_OP, name, a, c.c):
            return torch.ops.etweedie.student_t_score(a.y, a.x, c.c, a.prec, a.kind, a.batch)
        return _python_form(name, c).reshape(*a.batch, a.y.shape[-1]), None  # the front op returns (*batch, d) too

    return range_guarded(_OP, name, a.given_metric, a.y, a.x, a.batch, run)


def _python_form(name: str, c: _Call) -> torch.Tensor:
    cn = shape_rows(c.a)
    cf = flat(c.c, cn.batch, ())
    if name == "reference":
        return reference.student_t_score(cn.y, cn.x, cf, cn.prec, cn.kind)
    if cn.kind == DENSE:
        zy, zx, ones, L = whiten_dense(cn)  # P = L Lᵀ: the isotropic kernel on z = Lᵀu, then s = L s_z
        return unwhiten_score(_kernel(name, zy, zx, cf, ones, 0), L)
    return _kernel(name, cn.y, cn.x, cf, cn.prec, cn.kind)


def _kernel(name, y, x, c, prec, kind) -> torch.Tensor:
    if name == "triton":
        from ..kernels.student_t_score import student_t_score_op  # imports triton: only when asked for

        return student_t_score_op(y, x, c, prec, kind)[0]
    # "cpu" and "cuda" are the same compiled op; the dispatcher picks the device's kernel.
    return torch.ops.etweedie.student_t_score_fwd(y, x, c, prec, kind)[0]


# ---------------------------------------------------------------------------- registration

def _register() -> None:
    lib = "etweedie::"
    torch.library.register_fake(lib + "student_t_score_fwd")(fake_fwd)
    torch.library.register_fake(lib + "student_t_score_bwd")(fake_bwd)
    setup_context, backward = autograd_rules(torch.ops.etweedie.student_t_score_bwd)
    torch.library.register_autograd(lib + "student_t_score_fwd", backward, setup_context=setup_context)


_HAS_CPU = backends._has_op("student_t_score_fwd", "CPU")
# The backends that implement this op here (an extension built before the op existed lacks it).
_SUPPORTED = tuple(
    b for b in backends.BACKENDS
    if b not in ("cpu", "cuda") or backends._has_op("student_t_score_fwd", "CPU" if b == "cpu" else "CUDA")
)

# not homogeneous (1 + ‖u‖²): float64 data beyond float64's range are refused
_SPEC = OpSpec(_OP, ("y", "x", "c", "metric"), _check, _run, plain=_shortcut, supported=_SUPPORTED)

if _HAS_CPU:
    _register()
