"""Validation and canonical form shared by the per-row ops (et_score, langevin_step).

Every public op accepts broadcastable inputs — y ``(*, d)``, x ``(*, N, d)``, β and λ as
floats or ``(*)`` tensors, a :class:`~etweedie.geometry.Metric` with an optional batch shape —
and reduces them here to the canonical form the kernels take:

    y (B, d) contiguous     x (B, N, d), unit stride over d (broadcast dims keep stride 0)
    beta, lam (B,)          prec (B, *param), kind ∈ {0 isotropic, 1 diagonal, 2 block, 3 dense}

B is the product of the broadcast batch shape.  Broadcast inputs are expanded as views, so a
posterior cloud shared by all queries is never copied.  Kind 3 (dense) is whitened into kind 0
by :func:`whiten_dense` on the kernel path; the reference uses the dense precision directly.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD

from .. import backends
from ..geometry import Metric, _functorch_wrapped, _in_vmap
from ..rules import pairwise
from ..rules.common import BLOCK, DENSE, DIAGONAL, ISOTROPIC  # noqa: F401 (the canonical kinds, re-exported)
from ._ties import row_keys, tie_equal_rows, tie_to_rows  # noqa: F401 (row_keys, tie_to_rows: for the ops)
_KIND = {"isotropic": ISOTROPIC, "diagonal": DIAGONAL, "block": BLOCK, "dense": DENSE}


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


# Debug checks (NaN/inf in the data) cost a full pass over x, so they are off by default.
_DEBUG = {"on": os.environ.get("ETWEEDIE_DEBUG", "0") not in ("", "0")}


def set_debug(enabled: bool) -> None:
    """Turn the ops' finiteness checks on or off (also: environment ETWEEDIE_DEBUG=1).

    With checks on, a NaN or infinity in y, x, a bank or a parameter raises ValueError naming
    the argument instead of propagating into the result.

    Range checks of β, λ and step given as plain numbers always run.  Given as tensors, their
    values are checked on CPU always, but on a GPU only with debug checks on: reading a GPU
    tensor's values stalls the host until the GPU catches up, which would cost every call a
    device synchronization (measured: ~0.45 ms a call on an H200, more than the kernels).
    """
    _DEBUG["on"] = bool(enabled)


def check_finite(op: str, **tensors) -> None:
    """ValueError naming the first non-finite argument (only when debug checks are on)."""
    if not _DEBUG["on"] or _is_compiling():
        return
    for name, t in tensors.items():
        if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{op}: {name} contains NaN or infinite values (debug checks are on)")


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


def near_mode(y: torch.Tensor) -> str:
    """The reference's near-pair mode for a call on y (``reference.NEAR_PAIR_MODES``): "index"
    where values are read (:func:`value_checks`), else the select that reads none."""
    return "index" if value_checks(y) else "where"


def value_checks(t: torch.Tensor) -> bool:
    """Whether value checks on ``t`` run now (CPU tensors, or any tensor with debug checks on),
    never under torch.compile (there they are graph asserts) or torch.func.vmap (no value to
    read: a vmapped call trusts its values, as a GPU call without debug checks does)."""
    return not _is_compiling() and (t.device.type == "cpu" or _DEBUG["on"]) and not (_functorch_wrapped(t) and _in_vmap())


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


# float32 range in which the kernels' squared norms ‖u‖²_P neither overflow nor underflow:
# whitened coordinates z = Lᵀu up to 2^40 keep q = ‖z‖² below 2^88·d, and data whose largest
# whitened magnitude is at least 2^-40 keeps the differences that float32 can represent at that
# magnitude (≥ 2^-64) above the smallest normal q once squared (2^-128, subnormal at worst).
_F32_LO, _F32_HI = 2.0 ** -40, 2.0 ** 40


def _dtype_of(data) -> Optional[torch.dtype]:
    return data[0].dtype if data and isinstance(data[0], torch.Tensor) else None


# float64's range for the same squared norms: whitened magnitudes in [2^-200, 2^200] keep
# q ≤ 2^400·d and the slopes of the backward, q^{(β−4)/2} at worst q^{-2}, inside float64 for
# differences down to 2^-250 of the largest magnitude
_F64_LO, _F64_HI = 2.0 ** -200, 2.0 ** 200


def scan(metric: Optional[Metric], *data: torch.Tensor, finite: bool = True) -> Tuple[bool, bool]:
    """(whether the data leave their dtype's safe range, and whether every input is free of NaN/inf)
    from one min/max pass over each tensor: the per-row ops need both, and two separate passes
    would cost a second reduction and host read per tensor on every CPU call.  ``finite=False``:
    only the range question (the second answer is then True).

    The range: float32 data (with the metric's scale) whose largest whitened magnitude leaves
    [2^-40, 2^40] could overflow or underflow the kernels' squared norms, and float64 data beyond
    [2^-200, 2^200]; the call path (etweedie/ops/_call.py) then reruns a float32 call in float64
    and rescales or refuses a float64 one.  Judged per call from the largest magnitude, so a call
    that mixes rows more than 2^40 apart in magnitude can still underflow in its smallest rows.
    Read where value checks run (CPU tensors, or with debug checks on); a GPU call without debug
    checks trusts the range (no host sync)."""
    if not _is_compiling() and _in_vmap() and any(_functorch_wrapped(t) for t in data if isinstance(t, torch.Tensor)):
        # torch.func.vmap: no values to read, so assume the worst where checks would run: float32
        # data computed in float64 (right at any magnitude), NaN/inf rows masked (no read needed)
        t0 = data[0]
        checked = t0.device.type == "cpu" or _DEBUG["on"]
        return checked and t0.dtype == torch.float32, not checked
    dtype = _dtype_of(data)
    ranged = dtype in (torch.float32, torch.float64) and value_checks(data[0])
    # 16-bit draws of a float32 or float64 query are computed in its dtype (bfloat16 spans float32's range)
    admitted = (dtype, *LOW_PRECISION_DRAWS)
    if ranged and any(not isinstance(t, torch.Tensor) or t.dtype not in admitted or t.device != data[0].device for t in data):
        ranged = False  # mismatched arguments: the op's own checks name them
    if not (ranged or finite):
        return False, True
    extremes = [(t, e) for t, e in zip(data, map(_extremes, data)) if e is not None]
    all_fin = all(math.isfinite(lo) and math.isfinite(hi) for _, (lo, hi) in extremes)
    if not ranged:
        return False, all_fin
    return _out_of_range(metric, _largest(extremes), dtype), all_fin


def _largest(extremes) -> float:
    """The largest finite magnitude of the data: a NaN or inf in one row must not hide the range
    of the others (those rows still need the wider computation; the NaN/inf rows become NaN
    either way)."""
    return max((max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else _finite_abs_max(t)
                for t, (lo, hi) in extremes), default=0.0)


def _finite_abs_max(t: torch.Tensor) -> float:
    """max |t| over t's finite values (0 if none): a second pass, only for data holding NaN/inf."""
    return float(t.detach().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())


def _extremes(t) -> Optional[Tuple[float, float]]:
    """(min, max) of a tensor where value checks run and it has values; None otherwise."""
    if not isinstance(t, torch.Tensor) or not t.numel() or not value_checks(t):
        return None
    lo, hi = torch.aminmax(t.detach())
    return float(lo), float(hi)


def _whitened_largest(metric: Optional[Metric], hi: float) -> float:
    """An upper bound of the largest whitened magnitude ‖Lᵀu‖∞-scale of data whose largest
    magnitude is ``hi`` (hi over the square root of the metric's smallest variance); NaN where
    the metric gives no bound."""
    v_lo = 1.0
    if isinstance(metric, Metric) and metric.param.numel():
        v_lo = metric._cached("smallest variance", lambda: _smallest_variance(metric))
        if not (v_lo > 0 and math.isfinite(v_lo)):
            return math.nan
    return hi / math.sqrt(v_lo)


def _out_of_range(metric: Optional[Metric], hi: float, dtype: torch.dtype = torch.float32) -> bool:
    """Whether data of ``dtype`` whose largest magnitude is ``hi`` leave the kernels' safe range."""
    if hi == 0.0 or not math.isfinite(hi):
        return False  # all zero, or inf/NaN that propagate anyway
    z_hi = _whitened_largest(metric, hi)
    lo_, hi_ = (_F64_LO, _F64_HI) if dtype == torch.float64 else (_F32_LO, _F32_HI)
    return z_hi > hi_ or z_hi < lo_  # (False for NaN: no bound)


def _smallest_variance(metric: Metric) -> float:
    p = metric.param.detach()
    var = torch.diagonal(p, dim1=-2, dim2=-1) if metric.kind in ("block", "dense") else p
    return float(var.amin())


def nan_rows(out: torch.Tensor, batch: torch.Size, *args: Tuple[torch.Tensor, int]) -> torch.Tensor:
    """out (B, ...) with NaN in every row whose inputs hold a NaN or an infinity.

    ``args``: (tensor, core) pairs — a cloud ``(*batch, n, d)`` has core 2, a target
    ``(*batch, d)`` core 1; each is tested before broadcasting, so a shared cloud is scanned
    once.  The pair kernels treat a pair whose squared norm is not > 0 as coincident
    (contributing 0), which would otherwise turn a NaN input into a finite score.  One pass over
    the points, small next to the O(n²) pairs; no host sync.
    """
    bad = torch.zeros((), dtype=torch.bool, device=out.device)
    for t, core in args:
        bad = bad | ~torch.isfinite(t).flatten(t.dim() - core).all(-1)
    bad = bad.expand(batch).reshape(-1, *([1] * (out.dim() - 1)))
    return torch.where(bad, torch.full((), math.nan, dtype=out.dtype, device=out.device), out)


# ---------------------------------------------------------------------------- autodiff orders
#
# The compiled ops (C++ and Triton) have fused first-order backward kernels only.  Two ways of
# asking for more would otherwise return zeros silently: forward mode (torch.func.jvp,
# torch.autograd.forward_ad), which the op's autograd kernel never sees, and a second backward
# through the backward kernels.  Forward mode is detected at the op's entry (an automatic
# backend choice then takes the reference, which supports it; an explicit kernel backend
# raises); a second backward raises from the graph node below.


def _any_tensor(test, args) -> bool:
    """Whether ``test`` holds for any tensor argument (a Metric stands for its parameter); never
    while torch.compile traces (its fake tensors carry neither tangents nor transforms)."""
    if _is_compiling():
        return False
    for t in args:
        if isinstance(t, torch.Tensor):
            if test(t):
                return True
        elif isinstance(t, Metric) and test(t.param):
            return True
    return False


def _tangent(t: torch.Tensor) -> bool:
    return fwAD.unpack_dual(t).tangent is not None


def has_forward_tangent(*tensors) -> bool:
    """Whether any argument carries a forward-mode tangent (torch.func.jvp or forward_ad).  Only
    inside a dual level (``forward_ad``'s own rule: ``unpack_dual`` finds no tangent outside one,
    and torch.func.jvp enters one), so a plain call reads one module global, not every tensor."""
    return fwAD._current_level >= 0 and _any_tensor(_tangent, tensors)


def functorch_transformed(*tensors) -> bool:
    """Whether any argument is wrapped by a torch.func transform (grad, vjp, jacrev, vmap)."""
    return _any_tensor(_functorch_wrapped, tensors)


def kernel_or_reference(op: str, name: str, backend, *tensors, reference_forward_mode: bool = True) -> str:
    """The backend to run: ``name`` unless an input carries a forward-mode tangent, which the
    kernels cannot propagate — then the reference (automatic choice, where the reference
    supports forward mode) or NotImplementedError — or is wrapped by a torch.func transform,
    which the kernels' autograd kernels do not support: then the reference (automatic choice)
    or NotImplementedError."""
    if name == "reference":
        return name
    if not has_forward_tangent(*tensors):
        if not functorch_transformed(*tensors):
            return name
        # torch.func.grad / vjp / jacrev: the kernels' autograd kernels are not functorch-aware
        if backends.requested(backend) is not None:
            raise NotImplementedError(
                f"{op}: torch.func transforms (grad, vjp, jacrev, vmap) are not supported by backend {name!r}; "
                f"use backend='reference' (or None, which picks it under a transform), or torch.autograd.grad"
            )
        return "reference"
    if not reference_forward_mode:
        raise NotImplementedError(
            f"{op}: forward-mode autodiff (torch.func.jvp / forward_ad) is not supported by any backend "
            f"(the kernels and torch.cdist in the reference are reverse-mode only); use torch.autograd.grad"
        )
    if backends.requested(backend) is not None:
        raise NotImplementedError(
            f"{op}: forward-mode autodiff (torch.func.jvp / forward_ad) is not supported by backend "
            f"{name!r}; use backend='reference', or reverse mode (torch.autograd.grad)"
        )
    return "reference"


@dataclass
class RowArgs:
    """The validated arguments of a per-row op in their broadcastable shapes (nothing expanded):
    what both the Python canonical form (:func:`shape_rows`) and the C++ front ops
    (``torch.ops.etweedie.<op>``, :func:`front`) start from."""
    y: torch.Tensor  # (*, d)
    x: torch.Tensor  # (*, N, d)
    beta: torch.Tensor  # broadcasts to batch
    lam: torch.Tensor  # broadcasts to batch
    prec: torch.Tensor  # (*metric_batch, *param) in y's dtype: the metric's precision parameter
    kind: int
    batch: torch.Size
    metric: Metric
    given_metric: Optional[Metric] = None  # as given (the range scan reads its cached smallest variance)

    # the validated call's interface to the call path (etweedie/ops/_call.py)
    device = property(lambda self: self.y.device)
    dtype = property(lambda self: self.y.dtype)
    data = property(lambda self: (self.y, self.x))
    inputs = property(lambda self: (self.y, self.x, self.beta, self.lam, self.metric))


@dataclass
class Canonical:
    y: torch.Tensor  # (B, d)
    x: torch.Tensor  # (B, N, d)
    beta: torch.Tensor  # (B,)
    lam: torch.Tensor  # (B,)
    prec: torch.Tensor  # (B, *param)
    kind: int
    batch: torch.Size
    metric: Metric


def rows_args(op: str, y, x, beta, lam, metric) -> RowArgs:
    """Validate the arguments of a per-row op and resolve its broadcast batch.

    Every sampler step and training step pays this on the host, so the common case (one batch
    shape for y and x, parameters as numbers or 0-d tensors, a shared metric) reads each shape
    once and skips the general broadcast."""
    y = check_tensor(y, "y", op)
    x = check_draws(x, y, op)
    ys, xs = y.shape, x.shape
    if not ys:
        raise ValueError(f"{op}: y must have shape (*batch, d), got a 0-d tensor")
    if len(xs) < 2:
        raise ValueError(f"{op}: x must have shape (*batch, N, d), got shape {tuple(xs)}")
    if x.device != y.device:
        raise ValueError(f"{op}: x is on {x.device} but y is on {y.device}")
    d, N = ys[-1], xs[-2]
    if xs[-1] != d:
        raise ValueError(f"{op}: x must have shape (*batch, N, d={d}) to match y, got {tuple(xs)}")
    if d == 0:
        raise ValueError(f"{op}: the dimension d must be >= 1, got y of shape {tuple(ys)}")
    if N == 0:
        raise ValueError(f"{op}: x must hold at least one posterior draw (N >= 1), got shape {tuple(xs)}")
    beta_t = as_param(beta, "beta", op, y)
    lam_t = as_param(lam, "lam", op, y)
    if _DEBUG["on"]:
        check_finite(op, y=y, x=x)
    # a parameter given as a number was range-checked by as_param; a tensor's values are checked here
    if isinstance(beta, torch.Tensor):
        check_beta(beta_t, op)
    if isinstance(lam, torch.Tensor):
        check_positive(lam_t, "lam", op)
    given, metric = metric, check_metric(metric, d, y, op)
    yb, xb, mb = ys[:-1], xs[:-2], metric.batch_shape
    if yb == xb and not mb and not beta_t.dim() and not lam_t.dim():
        batch = yb  # nothing to broadcast
    else:
        batch = broadcast_batch(op, y=yb, x=xb, beta=beta_t.shape, lam=lam_t.shape, metric=mb)
    prec = metric.param if given is None else precision_of(metric, y.dtype, op)  # Σ = I: P = I, the same 1
    return RowArgs(y, x, beta_t, lam_t, prec, _KIND[metric.kind], batch, metric, given)


_CPU = torch.device("cpu")


def checked_cpu_param(name: str, value, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The CPU 0-d tensor of a float parameter that passed its rule in ``dtype`` before
    (:func:`as_param` remembered it), or None."""
    return _CHECKED.get((name, value, dtype, _CPU)) if type(value) is float else None


def plain_rows(op: str, y, x, beta, lam, metric, backend) -> Optional[tuple]:
    """``(beta, lam, prec, kind, batch)`` for the C++ front op of a per-row op when the call is the
    plain one a sampler or training loop makes on the CPU, or None: then the general path
    (:func:`rows_args`, the backend choice, :func:`kernel_or_reference`, :func:`range_guarded`)
    runs, and raises whatever is wrong with the arguments.

    Plain (:func:`plain_call` and :func:`plain_metric`): ``backend="cpu"`` or the automatic choice
    resolving to it, no debug checks, dual level, compile trace or functorch transform; y (B, d)
    and x (B, N, d) plain CPU tensors with N, d ≥ 1 in the dtype rule; β and λ floats that
    passed their rules before (:func:`as_param` remembered them); no metric, or an isotropic,
    diagonal or block metric without a batch, in y's dtype, that fits d.  Every such call gets
    exactly the front op arguments the general path would build (tests/test_rows_front.py), with
    a fraction of its Python: after a pass that evicts the caches (the 256 MiB copy of the
    benchmark table), each object the general path touches is a miss to memory, and its
    120–150 µs were 10% of a 64 × 256 × 784 call (benchmarks/RESULTS.md, run N)."""
    if not plain_call(op, backend) or type(y) is not torch.Tensor or type(x) is not torch.Tensor \
            or not (y.is_cpu and x.is_cpu):
        return None
    dt = y.dtype
    if (dt is not torch.float32 and dt is not torch.float64) or (x.dtype is not dt and x.dtype not in LOW_PRECISION_DRAWS):
        return None
    ys, xs = y.shape, x.shape
    if len(ys) != 2 or len(xs) != 3 or xs[0] != ys[0] or xs[2] != ys[1] or not xs[1] or not ys[1]:
        return None
    beta_t, lam_t = checked_cpu_param("beta", beta, dt), checked_cpu_param("lam", lam, dt)
    if beta_t is None or lam_t is None or _functorch_wrapped(y) or _functorch_wrapped(x):
        return None
    pk = plain_metric(metric, dt, ys[1], op)
    if pk is None or not plain_backend(backend):
        return None
    return beta_t, lam_t, pk[0], pk[1], ys[:-1]


def plain_call(op: str, backend) -> bool:
    """The call-wide conditions of a plain CPU call (:func:`plain_rows`): the op has a C++ front
    op, ``backend`` is None or "cpu", and no debug checks, forward-mode dual level or compile trace."""
    if _is_compiling() or not _FRONT.get(op, False) or _DEBUG["on"] or fwAD._current_level >= 0:
        return False
    return backend is None or backend == "cpu"


def plain_metric(metric, dtype: torch.dtype, d: int, op: str) -> Optional[Tuple[torch.Tensor, int]]:
    """(prec, kind) of a plain call's metric — None (P = I), or an isotropic, diagonal or block
    metric without a batch, a CPU parameter in ``dtype`` that fits d — else None."""
    if metric is None:
        prec = _CONSTANTS.get((1.0, dtype, _CPU))
        return None if prec is None else (prec, ISOTROPIC)
    if type(metric) is not Metric:
        return None
    p, kind = metric.param, _KIND.get(metric.kind)
    if kind is None or kind == DENSE or p.dim() != kind or p.dtype is not dtype or not p.is_cpu or _functorch_wrapped(p):
        return None  # dense (whitened in Python), a metric batch, another dtype or device
    if (kind == DIAGONAL and p.shape[0] != d) or (kind == BLOCK and d % p.shape[0]):
        return None
    return precision_of(metric, dtype, op), kind


def plain_backend(backend) -> bool:
    """Whether a plain call's backend is "cpu": given as the argument (which outranks the context
    and the environment), or the automatic choice with no context or ETWEEDIE_BACKEND."""
    if backend is None and (backends._requested.get() is not None or os.environ.get("ETWEEDIE_BACKEND")):
        return False
    return backends._automatic("cpu", backends.BACKENDS, None) == "cpu"


def shape_rows(a: RowArgs) -> Canonical:
    """The canonical form of validated arguments (what the C++ front ops build in one call)."""
    batch, d, N = a.batch, a.y.shape[-1], a.x.shape[-2]
    B = math.prod(batch)
    yc = a.y.expand(tuple(batch) + (d,)).reshape(B, d).contiguous()
    xc = a.x.expand(tuple(batch) + (N, d)).reshape(B, N, d)
    if d > 1 and xc.stride(-1) != 1:
        xc = xc.contiguous()
    prec = prec_rows(a.prec, len(a.metric.batch_shape), a.kind, batch)
    return Canonical(yc, xc, flat(a.beta, batch, ()), flat(a.lam, batch, ()), prec, a.kind, batch, a.metric)


def canonicalize(op: str, y, x, beta, lam, metric) -> Canonical:
    """Validate the arguments of a per-row op and bring them to the canonical form."""
    return shape_rows(rows_args(op, y, x, beta, lam, metric))


# The C++ front ops (csrc/front/) this extension has (none in one built before they existed).
_FRONT = {op: backends._EXT_OK and backends._has_op(op, "CompositeImplicitAutograd")
          for op in ("et_score", "langevin_step", "student_t_score", "energy_score")}


def _probe_cpu_range_flags(op: str) -> bool:
    """Whether the CPU kernel of ``op`` (et_score_fwd, student_t_score_fwd) flags a row whose
    squared norms leave its accurate range with NaN (csrc/common/et_score.h, q_in_range): one
    call on a float32 draw whose q overflows (an extension built before the flags returns a
    finite value there)."""
    if not (backends._EXT_OK and backends._has_op(op, "CPU")):
        return False
    y, x, one = torch.zeros(1, 1), torch.full((1, 1, 1), 1e30), torch.ones(1)
    args = (y, x, one, one, one, 0) if op == "et_score_fwd" else (y, x, one, one, 0)
    try:
        return bool(torch.isnan(getattr(torch.ops.etweedie, op)(*args)[0]).all())
    except Exception:  # pragma: no cover - a broken extension: the host checks then run as before
        return False


# The ops whose CPU kernels flag out-of-range rows (langevin_step_fwd shares et_score's row kernel).
_CPU_RANGE_FLAGS = {op: _probe_cpu_range_flags(f"{fwd}_fwd")
                    for op, fwd in (("et_score", "et_score"), ("langevin_step", "et_score"),
                                    ("student_t_score", "student_t_score"))}


def kernel_checks_range(name: str, op: str = "et_score", dtype: Optional[torch.dtype] = None) -> bool:
    """Whether backend ``name``'s kernel of ``op`` checks the range itself, so that the op skips
    its min/max pass over the inputs: the CPU kernels of et_score, langevin_step and
    student_t_score flag every row with a draw out of their accurate range — a NaN or inf, a
    float32 squared norm that over- or underflows — with NaN (q_in_range,
    csrc/common/et_score.h), and the op reruns a flagged float32 call in float64 (told by the
    front op's non-finite report, or by :func:`flagged` on the Python form).  The other backends
    rely on :func:`scan`, and so does a float64 student_t_score (``dtype``): its kernel checks no
    lower bound on q (1/(1 + q) needs none), so the data range that op refuses beyond
    [2^-200, 2^200] is read by the scan."""
    if op == "student_t_score" and dtype == torch.float64:
        return False
    return name == "cpu" and _CPU_RANGE_FLAGS.get(op, False)


def range_guarded(op: str, name: str, metric, y: torch.Tensor, x: torch.Tensor, batch: torch.Size, run, near=None):
    """The per-row op's output, (*batch, d), under the range and NaN rules, or None when the call
    must be rerun: a float32 call in float64 (and rounded), a float64 call beyond float64's
    range rescaled or refused (etweedie/ops/_call.py).

    ``run()`` returns ``(out, nonfinite)``: a C++ front op's pair — whether the CPU kernel wrote a
    NaN or inf into ``out`` (csrc/common/nonfinite_report.h: each worker checks the rows it has
    just written) — or ``(out, None)`` from the Python form, whose output :func:`flagged` reads.
    Where the kernel checks the range itself (:func:`kernel_checks_range`) nothing reads the
    inputs first: a flagged output reruns a float32 call, and a float64 one gets NaN rows for its
    non-finite inputs.  Elsewhere one min/max pass (:func:`scan`) decides both before the run.
    Rows whose inputs hold NaN or inf come back NaN (:func:`nan_rows`: the et_score weight treats
    a NaN distance like a coincident draw).  A float64 call the kernel flagged although its data
    are in range has a draw closer to y than its accurate range (q below 2^-500): ``near(rows)``
    returns the whole output again, with those rows (flat row indices, ``(n,)``) on the reference's
    exact near-pair form (``reference.NEAR_PAIR_MODES``: its residuals take n×N×d memory, not
    B×N×d) and the others from the kernel, rerun on them alone (:func:`join_rows`)."""
    in_kernel = kernel_checks_range(name, op, y.dtype)
    finite = True
    if not in_kernel:
        out_of_range, finite = scan(metric, y, x)
        if out_of_range:
            return None
    out, nonfinite = run()
    if name in ("triton", "cuda") and flagged(out):
        # the GPU kernels flag a row with a draw outside their q range (q_in_range): a near draw,
        # or a far one whose backward slope would be subnormal — data within the scanned range
        # can still hold one (whitened magnitudes up to 2^40 give q up to 2^82·d, over 2^62)
        rows = _near_rows(out, batch, y, x, finite)
        if rows.numel():
            if y.dtype == torch.float32:
                return None  # rerun in float64, where the pair is in range or recomputed exactly
            if near is not None:
                out = near(rows)
    elif in_kernel and (flagged(out) if nonfinite is None else nonfinite):
        if y.dtype == torch.float32:
            return None  # rows the kernel could not compute accurately in float32 (or non-finite inputs)
        out_of_range, finite = scan(metric, y, x)
        if out_of_range:
            return None  # float64 data beyond float64's range
        if near is not None:
            rows = _near_rows(out, batch, y, x, finite)
            if rows.numel():  # a draw nearer to y than the kernel's range: exact, rows with NaN/inf masked below
                out = near(rows)
    if not finite:
        out = nan_rows(out.reshape(-1, y.shape[-1]), batch, (y, 1), (x, 2)).reshape(out.shape)
    return out


def _near_rows(out: torch.Tensor, batch: torch.Size, y: torch.Tensor, x: torch.Tensor, finite: bool) -> torch.Tensor:
    """The flat indices of the non-finite rows of ``out`` whose inputs are finite — rows flagged
    for a draw nearer to y than the kernel's range, which need the exact recomputation; rows with a
    NaN or inf input come back NaN anyway (:func:`nan_rows`) and need none.  ``finite``: the inputs
    are known finite (no pass over them).  Reads values (CPU, or debug checks)."""
    d = y.shape[-1]
    bad = ~torch.isfinite(out.detach().reshape(-1, d)).all(-1)
    if not finite:
        bad_in = ~torch.isfinite(y.detach()).all(-1) | ~torch.isfinite(x.detach()).flatten(x.dim() - 2).all(-1)
        bad &= ~bad_in.expand(batch).reshape(-1)
    return bad.nonzero().squeeze(1)


def join_rows(batch: torch.Size, rows: torch.Tensor, exact, rest) -> torch.Tensor:
    """The (*batch, d) output whose flat rows ``rows`` are ``exact(rows)`` and whose other rows are
    ``rest(others)``, both (n, d) for the flat indices given.  Each part runs its own autograd
    graph: a flagged row never enters the kernel's backward (its saved NaN mean would turn the
    zero gradient of a replaced row into NaN)."""
    B = math.prod(batch)
    keep = torch.ones(B, dtype=torch.bool)
    keep[rows.cpu()] = False
    others = keep.nonzero().squeeze(1)
    e = exact(rows)
    out = e.new_zeros(B, e.shape[-1]).index_put((rows.to(e.device),), e)
    if others.numel():
        out = out.index_put((others.to(e.device),), rest(others))
    return out.reshape(*batch, e.shape[-1])


def take_rows(t: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows ``rows`` of a canonical (B, …) tensor (None: all, ``t`` itself); one broadcast over B
    (stride 0: a shared cloud, a scalar parameter) stays a broadcast instead of being copied once
    per row."""
    if rows is None:
        return t
    if t.shape[0] > 0 and t.stride(0) == 0:
        return t[:1].expand(rows.numel(), *t.shape[1:])
    return t[rows.to(t.device)]


def canonical_rows(c: Canonical, rows: torch.Tensor) -> Canonical:
    """The canonical form of the flat rows ``rows`` of ``c``; its ``metric`` stays the whole
    call's (a dense metric's whitening reads it: whiten the whole call, then take rows)."""
    return Canonical(take_rows(c.y, rows), take_rows(c.x, rows), take_rows(c.beta, rows), take_rows(c.lam, rows),
                     take_rows(c.prec, rows), c.kind, torch.Size([rows.numel()]), c.metric)


def flagged(out: torch.Tensor) -> bool:
    """Whether a CPU kernel flagged rows of ``out`` (NaN rows), or ``out`` holds another non-finite
    value (an overflowing result also reruns in float64); read where value checks run (no GPU
    sync).  One sum: NaN and inf propagate through it (a sum that overflows from finite values
    also reads as flagged, and the float64 rerun is then merely unneeded), and unlike
    ``isfinite(out).all()`` it allocates no mask.  Only the Python form needs it (dense metrics,
    torch.compile, functorch): the C++ front ops return the kernel's own report."""
    return value_checks(out) and out.numel() > 0 and not math.isfinite(float(out.detach().sum()))


def front(op: str, name: str, a: RowArgs, *tensors) -> bool:
    """Whether the per-row op ``op`` runs through its C++ front op (``torch.ops.etweedie.<op>``:
    the canonical form and the kernel call in one C++ call) rather than :func:`shape_rows`.

    Eager calls of the compiled backends ("cpu", "cuda") with a diagonal, block or isotropic metric.
    torch.compile traces the Python form (the front ops are opaque to it), and functorch-wrapped
    arguments take it too; dense metrics are whitened in Python either way.
    """
    return front_applies(op, name, a.kind, a.y, a.x, a.beta, a.lam, a.prec, *tensors)


def front_applies(op: str, name: str, kind: int, *tensors) -> bool:
    """:func:`front` for any op with a C++ front op (``energy_score`` too), given its metric kind
    and every tensor the call reads."""
    if not _FRONT.get(op, False) or name not in ("cpu", "cuda") or kind == DENSE or _is_compiling():
        return False
    return not functorch_transformed(*tensors)


def whiten_dense(c: Canonical) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a dense metric: (z_y, z_x, ones, L) with z = Lᵀ(u − c) per row, P = L Lᵀ (one GEMM each).

    The kernels then run isotropically with unit precision; map a score back with ``s @ Lᵀ``.
    The centre c (:func:`dense_centre`: the query itself, or the first draw of a cloud shared by
    every row) is a constant the scores do not depend on (they see y − x_i only); it keeps the
    whitened coordinates, and so their rounding, at the size of y − x_i rather than of the
    points: whitening points 1e3 from the origin put errors 80–140× the float32 tolerance into
    the score.  The whitened draws are in y's dtype: 16-bit draws enter the GEMM widened (the
    GEMM writes a new cloud in y's dtype anyway, so dense metrics do not keep the 16-bit byte count).
    """
    Lb = row_whitening_factor(c.metric, c.batch, c.y.dtype)
    return (*_whiten_about(c.y, c.x, dense_centre(c.x, c.y.unsqueeze(1), Lb), Lb), Lb)


def _whiten_about(y: torch.Tensor, x: torch.Tensor, centre: torch.Tensor, L: torch.Tensor):
    """(z_y, z_x, ones): queries y (B, d) and draws x (B, N, d) whitened about ``centre`` (detached,
    (B, 1, d) or (1, 1, d)) by L, and the unit precision the isotropic kernel then takes."""
    zy = ((y.unsqueeze(1) - centre) @ L).squeeze(1)
    ones = torch.ones((), dtype=y.dtype, device=y.device).expand(y.shape[0])
    return zy.contiguous(), centred_rows_matmul(x, centre, L), ones


#: A draw nearer to the query than this fraction of their squared whitened norms (about the
#: shared centre) is recomputed about the query (:func:`dense_score`); the Gram form's guard
#: (csrc/cpu/energy_gram_cpu.h) uses the same 2⁻⁶.
_NEAR_SHARED = 2.0**-6


def dense_score(c: Canonical, kernel, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The score of a per-row op under a dense metric, (n, d) for the flat rows ``rows`` (None:
    all B): ``kernel(zy, zx, ones, rows)`` gives the isotropic score of whitened queries and draws
    (it takes its own parameters' rows), mapped back with L.

    A cloud shared by every row is whitened once about its first draw (:func:`dense_centre`), so
    z_y and z_x each carry a rounding of about ε‖z‖, and the kernel's u = z_y − z_x of a draw much
    nearer to y than that is mostly rounding: its term u‖u‖^{β−2} then points the wrong way, up
    to 20% of the score at β = 1 (a draw 1e-5 from y at unit spread, float32).  Rows with a draw
    within 2⁻³ of the norms (one Gram product, B×N numbers) are recomputed whitened about their own
    query (z_y = 0 exactly, z_x = (x − y)L: their differences, and a coincidence, exact), at n×N×d
    memory for n such rows.  Where values are not read (a GPU without debug checks, compile) every
    row is whitened about its own query."""
    zy, zx, ones, L = whiten_dense(c)
    shared = zx.dim() == 3 and zx.shape[0] > 1 and zx.stride(0) == 0
    if shared and not value_checks(zy):
        return _dense_own_rows(c, kernel, L, rows)
    zy, zx, ones = (take_rows(t, rows) for t in (zy, zx, ones))
    L = take_rows(L, rows) if L.dim() == 3 else L
    s = unwhiten_score(kernel(zy, zx, ones, rows), L)
    if not shared or zy.shape[0] == 0:
        return s
    zc = zx[0].detach()  # (N, d): the one whitened cloud
    ny, nx = zy.detach().square().sum(-1, keepdim=True), zc.square().sum(-1)
    near = ((ny + nx - 2 * zy.detach() @ zc.T) < _NEAR_SHARED * (ny + nx)).any(-1).nonzero().squeeze(1)
    if near.numel() == 0:
        return s
    g = near if rows is None else rows.to(near.device)[near]
    return s.index_put((near,), _dense_own_rows(c, kernel, L, g))


def _dense_own_rows(c: Canonical, kernel, L: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """dense_score of the rows ``rows`` (None: all), each whitened about its own query (L is the
    shared factor: only a cloud shared under a shared metric gets here)."""
    y, x = take_rows(c.y, rows), take_rows(c.x, rows)
    zy, zx, ones = _whiten_about(y, x, y.detach().unsqueeze(1).to(L.dtype), L)  # z_y = 0, with y's gradient
    return unwhiten_score(kernel(zy, zx, ones, rows), L)


def dense_centre(x: torch.Tensor, own: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """The centre of a dense metric's whitening, detached (a constant: the ops are translation
    invariant): ``own`` (B, 1, d), a point of each row's own (the query, the target, a first
    point), or, for a cloud x (B, N, d) shared by every row (stride 0 over B) under a shared L,
    its first point (1, 1, d), which keeps the whitened cloud a broadcast (:func:`centred_rows_matmul`)."""
    if L.dim() == 2 and x.shape[0] > 1 and x.stride(0) == 0:
        return x[:1, :1].detach().to(L.dtype)
    return own.detach().to(L.dtype)


def centred_rows_matmul(x: torch.Tensor, centre: torch.Tensor, L: torch.Tensor, tie: bool = False) -> torch.Tensor:
    """(x − centre) @ L for x (B, N, d), centre (B, 1, d) or (1, 1, d), L (d, d) shared or
    (B, d, d) per row; a broadcast cloud (stride 0 over B) with a common centre and a shared L
    stays a broadcast: the product of its one distinct row is expanded, not materialized B times.
    ``tie``: equal points of a row whiten to equal z (:func:`~etweedie.ops._ties.tie_equal_rows`;
    a matrix product may round them differently), for the pair ops."""
    if L.dim() == 2 and x.shape[0] > 1 and x.stride(0) == 0 and centre.shape[0] == 1:
        return centred_rows_matmul(x[:1], centre, L, tie).expand(x.shape[0], *x.shape[1:])
    u = x.to(L.dtype) - centre
    z = u @ L
    return tie_equal_rows(z, u) if tie else z


def unwhiten_score(s_iso: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """s = L s_iso per row (row-vector form s_iso @ Lᵀ)."""
    if L.dim() == 2:
        return s_iso @ L.transpose(-1, -2)
    return (s_iso.unsqueeze(1) @ L.transpose(-1, -2)).squeeze(1)


def register_pairwise_op(name: str, bwd_op) -> None:
    """Fake and autograd rules of a pairwise energy op ``etweedie::<name>_fwd``.

    energy_score and energy_distance share the schema shape
    ``fwd(X, Y, beta, prec, kind, flag) -> (B,)`` and
    ``bwd(grad, X, Y, beta, prec, kind, flag, need_X, need_Y, need_beta, need_prec) -> 4 grads``
    (an unrequested gradient is an empty tensor), so one definition serves both.
    """
    lib = f"etweedie::{name}"
    torch.library.register_fake(lib + "_fwd")(pairwise.fake_fwd)
    torch.library.register_fake(lib + "_bwd")(pairwise.fake_bwd)
    setup_context, backward = pairwise.autograd_rules(bwd_op)
    torch.library.register_autograd(lib + "_fwd", backward, setup_context=setup_context)
