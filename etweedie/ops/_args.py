"""The ops' argument checks and the tensors they make of their arguments.

Tensors and the score ops' dtype rule (:func:`check_tensor`, :func:`check_draws`), the scalar
parameters β, λ, step and c (:func:`as_param`: a number is range-checked and becomes a cached
0-d tensor; a tensor's values are checked by :func:`check_beta` and :func:`check_positive`), the
metric and its parameters in the data's dtype (:func:`check_metric`, :func:`metric_param`,
:func:`precision_of`, :func:`row_whitening_factor`), and the broadcast batch (:func:`broadcast_batch`,
:func:`flat`).  The metric kinds as the kernels number them are ``_KIND``
(:mod:`etweedie.rules.common`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from ..geometry import Metric
from ..rules.common import BLOCK, DENSE, DIAGONAL, ISOTROPIC
from ._debug import _DEBUG, _is_compiling, check_finite, value_checks

_KIND = {"isotropic": ISOTROPIC, "diagonal": DIAGONAL, "block": BLOCK, "dense": DENSE}


def check_tensor(t, name: str, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: {name} must be float32 or float64, got {t.dtype}")
    return t


# The dtype rule of the score ops (et_score, langevin_step, student_t_score): the query y is
# float32 or float64 and fixes the compute dtype; the posterior draws x have y's dtype or are
# bfloat16 / float16.  16-bit draws are read as stored and widened to y's dtype inside the
# kernels (no cast pass over the cloud); sums accumulate in y's dtype; the score and the
# gradients of y, the noise and the parameters are in y's dtype, and the gradient of x is
# computed in y's dtype and rounded once to x's dtype.
LOW_PRECISION_DRAWS = (torch.bfloat16, torch.float16)


def check_draws(x, y: torch.Tensor, op: str) -> torch.Tensor:
    """The posterior draws x of a score op, by the dtype rule above (TypeError naming x otherwise)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != y.dtype and x.dtype not in LOW_PRECISION_DRAWS:
        raise TypeError(
            f"{op}: x must have y's dtype {y.dtype} or be bfloat16 or float16 (16-bit posterior draws), got {x.dtype}"
        )
    return x


# Range checks of plain numbers run always.  Checks that must read a tensor's values run on CPU
# tensors always, but on GPU tensors only with debug checks on (etweedie.set_debug): there each
# would stall the host until the GPU catches up, once per call.
_SCALAR_RULES = {
    "beta": (lambda v: 0 < v <= 2, "lie in (0, 2]"),
    "lam": (lambda v: 0 < v < math.inf, "be > 0 and finite"),
    "step": (lambda v: 0 < v < math.inf, "be > 0 and finite"),
    "c": (lambda v: 0 < v < math.inf, "be > 0 and finite"),
}


_CONSTANTS: dict = {}


def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor holding ``value``, made once per (value, dtype, device) and reused: the ops
    turn their float parameters (β, λ, step, the default metric's 1) into tensors on every call,
    which on a GPU is a fill kernel per parameter.  The tensors never leave the ops (they enter
    the kernels as stride-0 views), so sharing them is safe.  Made outside inference mode, so a
    call under ``torch.inference_mode`` leaves no inference tensor for later autograd calls.  Not
    cached while a CUDA stream is being captured: a tensor filled inside a capture holds its
    value only once the graph runs.
    """
    if _is_compiling():
        return torch.full((), value, dtype=dtype, device=device)  # a graph constant, not a cached tensor
    key = (value, dtype, device)
    t = _CONSTANTS.get(key)
    if t is not None:
        return t
    if torch.is_inference_mode_enabled():
        # made outside inference mode: an inference tensor in the cache would poison every later
        # call that needs a gradient ("Inference tensors cannot be saved for backward")
        with torch.inference_mode(False):
            t = torch.full((), value, dtype=dtype, device=device)
    else:
        t = torch.full((), value, dtype=dtype, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return t
    if len(_CONSTANTS) >= 256:
        _CONSTANTS.clear()
    _CONSTANTS[key] = t
    return t


def as_param(value, name: str, op: str, like: torch.Tensor) -> torch.Tensor:
    """A per-row scalar parameter (β, λ, step) as a tensor of like's dtype and device.

    A plain number is range-checked here (rules in ``_SCALAR_RULES``) and becomes a 0-d tensor
    on the device (:func:`constant`: no host-to-device copy, made once per value).
    """
    if type(value) is float and not _is_compiling():
        t = _CHECKED.get((name, value, like.dtype, like.device))  # this float passed its rule before
        if t is not None:
            return t
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{op}: {name} must be a float or a floating-point tensor, got dtype {value.dtype}")
        if value.device != like.device:
            raise ValueError(f"{op}: {name} is on {value.device} but y is on {like.device}")
        return value.to(like.dtype)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's scalars are Real too
        raise TypeError(f"{op}: {name} must be a float or a tensor, got {type(value).__name__}")
    rule = _SCALAR_RULES.get(name)
    if rule is not None and not rule[0](float(value)):
        raise ValueError(f"{op}: {name} must {rule[1]}, got {float(value)!r}")
    if rule is not None and not rule[0](_rounded(float(value), like.dtype)):
        raise ValueError(f"{op}: {name} = {float(value)!r} is not representable in {like.dtype} (it rounds to 0 or inf)")
    t = constant(float(value), like.dtype, like.device)
    if type(value) is float and _CONSTANTS.get((value, like.dtype, like.device)) is t:  # cached, so reusable
        if len(_CHECKED) >= 256:
            _CHECKED.clear()
        _CHECKED[(name, value, like.dtype, like.device)] = t
    return t


# (parameter name, value, dtype, device) -> constant(value) for plain floats that passed the
# parameter's rule: a sampler or training loop passes the same β, λ, step on every call.
_CHECKED: dict = {}


_CPU = torch.device("cpu")


def checked_cpu_param(name: str, value, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The CPU 0-d tensor of a float parameter that passed its rule in ``dtype`` before
    (:func:`as_param` remembered it), or None."""
    return _CHECKED.get((name, value, dtype, _CPU)) if type(value) is float else None


def cpu_constant(value: float, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The CPU :func:`constant` of ``value`` in ``dtype`` if one was made before, or None (none is made)."""
    return _CONSTANTS.get((value, dtype, _CPU))


def check_positive(t: torch.Tensor, name: str, op: str) -> None:
    """Every value of the tensor parameter ``name`` (λ, step, c) finite and > 0."""
    _check_values(t, _positive_finite, f"{op}: {name} must be > 0 and finite")


def _positive_finite(t: torch.Tensor) -> torch.Tensor:
    return (t > 0) & torch.isfinite(t)


def _valid_beta(t: torch.Tensor) -> torch.Tensor:
    return (t > 0) & (t <= 2)


def _check_values(t: torch.Tensor, rule, msg: str) -> None:
    """Raise ValueError (eager) unless ``rule(t)`` (a boolean mask) holds everywhere.  Under
    torch.compile the check stays in the graph as ``torch._assert_async`` (a RuntimeError with
    the same message), on CPU tensors always and on GPU tensors with debug checks on: a failed
    device-side assert would poison the CUDA context, so a GPU graph only asserts when the user
    asked for it.  The mask is built only where the check runs (no kernel launches per call on
    a GPU without debug checks)."""
    if t.numel() == 0:
        return
    if _is_compiling():
        if t.device.type == "cpu" or _DEBUG["on"]:
            torch._assert_async(rule(t).all(), msg)
        return
    if not value_checks(t):
        return
    ok = rule(t)
    if not bool(ok.all()):
        bad = t.detach()[~ok].flatten()[0].item()
        raise ValueError(f"{msg}, got {bad:.6g}")


def _rounded(v: float, dtype: torch.dtype) -> float:
    """v as the nearest float32 would hold it, as far as 0 and inf go (pure Python: no tensor, so
    that torch.compile sees a constant)."""
    if dtype != torch.float32 or not math.isfinite(v):
        return v
    if abs(v) >= 3.4028235677973366e38:  # past float32's largest value by half an ulp
        return math.copysign(math.inf, v)
    if abs(v) <= 7.006492321624085e-46:  # half the smallest float32 subnormal
        return math.copysign(0.0, v)
    return v


def check_beta(beta: torch.Tensor, op: str) -> None:
    """Every value of the tensor β in (0, 2]."""
    _check_values(beta, _valid_beta, f"{op}: beta must lie in (0, 2]")


def check_beta_lam(beta: torch.Tensor, lam: torch.Tensor, op: str) -> None:
    check_beta(beta, op)
    check_positive(lam, "lam", op)


def check_metric(metric: Optional[Metric], d: int, like: torch.Tensor, op: str) -> Metric:
    """The metric on like's device, validated for dimension d.

    Its dtype is kept when it is wider than the data's (a float64 metric with float32 data):
    :func:`metric_param` and :func:`row_whitening_factor` then invert or factor it in float64
    and round only the result, so that a near-singular Σ is not inverted in float32.
    """
    if metric is None:
        return Metric.trusted("isotropic", constant(1.0, like.dtype, like.device))
    if not isinstance(metric, Metric):
        raise TypeError(f"{op}: metric must be an etweedie.Metric or None, got {type(metric).__name__}")
    if metric.param.device != like.device:
        # like torch's own ops: a CPU 0-d parameter (a metric built from a float) joins any device
        if metric.param.dim() != 0 or metric.param.device.type != "cpu":
            raise ValueError(f"{op}: metric is on {metric.param.device} but y is on {like.device}")
        metric = metric.to(like.device)
    metric.check_dim(d, f"{op}: metric")
    if metric.param.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: metric must be float32 or float64, got {metric.param.dtype}")
    if metric.param.dtype == torch.float32 and like.dtype == torch.float64:
        metric = metric.to(like.dtype)
    check_finite(op, metric=metric.param)
    return metric


def _finite_param(p: torch.Tensor, dtype: torch.dtype, op: str, what: str) -> torch.Tensor:
    """p rounded to dtype; a value that does not fit (a near-singular float64 Σ whose inverse
    overflows float32) raises instead of reaching the kernels as inf/NaN."""
    q = p.to(dtype)
    if value_checks(q) and q.numel() and not bool(torch.isfinite(q).all()):
        raise ValueError(
            f"{op}: the metric's {what} is not finite in {dtype} (Σ is singular or too ill-conditioned "
            f"for this precision); pass float64 data or a better-conditioned metric"
        )
    return q


def broadcast_batch(op: str, **shapes) -> torch.Size:
    sizes = [tuple(v) for v in shapes.values()]
    longest = max(sizes, key=len)
    if all(v == longest[len(longest) - len(v):] for v in sizes):
        return torch.Size(longest)  # every shape a suffix of the longest: no broadcasting to resolve
    try:
        return torch.broadcast_shapes(*shapes.values())
    except RuntimeError:
        desc = ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"{op}: batch shapes do not broadcast: {desc}") from None


def flat(t: torch.Tensor, batch: torch.Size, core: Tuple[int, ...]) -> torch.Tensor:
    """Expand t to (*batch, *core) and flatten the batch (a view where strides allow)."""
    B = math.prod(batch)
    return t.expand(tuple(batch) + tuple(core)).reshape(B, *core)


def metric_param(metric: Metric, batch: torch.Size, d: int, dtype: Optional[torch.dtype] = None,
                 op: str = "metric") -> Tuple[torch.Tensor, int]:
    """(prec, kind) with prec (B, *param) in ``dtype``: the precision parameter per row.

    Each row's parameter is contiguous (the kernels index a diagonal or block row densely, so a
    transposed per-row ``var`` is copied, O(B·param)); a shared metric stays a stride-0 view
    over rows.
    """
    kind = _KIND[metric.kind]
    return prec_rows(precision_of(metric, dtype or metric.dtype, op), len(metric.batch_shape), kind, batch), kind


def prec_rows(p: torch.Tensor, metric_batch_dims: int, kind: int, batch: torch.Size) -> torch.Tensor:
    """A precision parameter (*metric_batch, *param) as (B, *param), a diagonal or block row
    contiguous (see :func:`metric_param`)."""
    prec = flat(p.contiguous(), batch, tuple(p.shape[metric_batch_dims:]))
    if kind in (DIAGONAL, BLOCK) and not prec[:1].is_contiguous():
        prec = prec.contiguous()
    return prec


def precision_of(metric: Metric, dtype: torch.dtype, op: str = "metric") -> torch.Tensor:
    """The metric's precision parameter (*metric_batch, *param) in ``dtype``, checked finite
    (:func:`_finite_param`); remembered by the metric with the parameter itself
    (``Metric._cached``), so a metric reused across calls is rounded and checked once."""
    key = ("precision", dtype, _DEBUG["on"])
    return metric._cached(key, lambda: _finite_param(metric.precision_param(), dtype, op, "precision").contiguous())


def row_whitening_factor(metric: Metric, batch: torch.Size, dtype: Optional[torch.dtype] = None,
                         op: str = "metric") -> torch.Tensor:
    """L with P = L Lᵀ for a dense metric: (d, d) when shared, else (B, d, d) per row.

    Dense metrics reach the kernels whitened (z = Lᵀu, one GEMM) as unit isotropic metrics.
    """
    L = _finite_param(metric.whitening_factor(), dtype or metric.dtype, op, "whitening factor")
    return L if len(metric.batch_shape) == 0 else flat(L, batch, tuple(L.shape[-2:]))
