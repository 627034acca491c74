"""The one call path of the public ops.

Every public op is a docstring over ``call(SPEC, ...)``; its module gives the spec — how to
check the arguments, how to run a checked call on a backend, and how the op scales — and this
module owns what every op shares:

1. the plain fast path (``spec.plain``: the CPU call a sampler or training loop makes, handed
   to a C++ front op with no Python checks; it returns None to take the general path);
2. the argument checks (``spec.check``: one validated call object, or a named error);
3. the backend choice (:func:`etweedie.backends.resolve`) and the autodiff-mode routing
   (:func:`kernel_or_reference`, below: forward-mode tangents and torch.func transforms take the
   reference, or raise for a named kernel backend);
4. the range rescue: ``spec.run`` returns None when the data leave the safe range of their dtype
   (:func:`~etweedie.ops._range.scan`, or the CPU kernels' own flags); then a float32 call runs
   again in float64 and rounds its result, and a float64 call beyond float64's range runs on the
   data scaled by a power of two t, exact, and scales the result back by t^-degree — for the ops
   homogeneous in their data (``spec.degree``) — or is refused with ValueError.

A validated call object (the ``check`` result) has the attributes ``device``, ``dtype`` (the
compute dtype), ``metric`` (the validated :class:`~etweedie.Metric`), ``data`` (the tensors a
rescale scales, for the rescale's magnitude) and ``inputs`` (every tensor or metric the call reads,
for the autodiff-mode routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD

from .. import backends
from ..geometry import Metric, _functorch_wrapped
from ._debug import _is_compiling
from ._range import _extremes, _largest, _whitened_largest


@dataclass(frozen=True)
class OpSpec:
    """One public op, as the call path needs it.

    Args:
        name: the op's name (in every error it raises).
        params: the public function's parameter names in order (a rerun passes them by name).
        check: ``(*args, **kwargs) -> call``, the validated call object (or a named error).
        run: ``(backend name, call) -> output``, or None when the data leave their dtype's range.
        data: the parameters a float64 rescale multiplies by t (they are homogeneous data).
        degree: ``call -> d`` with ``op(t·data) = t^d · op(data)``, d broadcasting to the output;
            None: the op is not homogeneous, and float64 data beyond float64's range are refused.
        beyond_float64: ``(arguments by name, call) -> output``: the op's own answer beyond
            float64's range, instead of the rescale (an op built from a homogeneous one).
        plain: ``(*args, **kwargs) -> output or None``, the fast path tried first.
        supported: the backends implementing the op; None: no backends (pure PyTorch).
        forward_mode: whether the reference supports forward-mode autodiff.
    """

    name: str
    params: Tuple[str, ...]
    check: Callable[..., Any]
    run: Callable[[Optional[str], Any], Any]
    data: Tuple[str, ...] = ()
    degree: Optional[Callable[[Any], torch.Tensor]] = None
    beyond_float64: Optional[Callable[[dict, Any], torch.Tensor]] = None
    plain: Optional[Callable[..., Optional[torch.Tensor]]] = None
    supported: Optional[Tuple[str, ...]] = backends.BACKENDS
    forward_mode: bool = True


def call(spec: OpSpec, op: Callable, *args, **kwargs):
    """Run the public op ``op`` (described by ``spec``) on its arguments: fast path, checks,
    backend, run, and the range rescue (rerunning ``op`` itself) where the run asks for it."""
    if spec.plain is not None:
        out = spec.plain(*args, **kwargs)
        if out is not None:
            return out
    c = spec.check(*args, **kwargs)
    name = None
    if spec.supported is not None:
        backend = kwargs.get("backend")
        name = backends.resolve(spec.name, c.device, backend, supported=spec.supported)
        name = kernel_or_reference(spec.name, name, backend, *c.inputs, reference_forward_mode=spec.forward_mode)
    out = spec.run(name, c)
    if out is not None:
        return out
    given = dict(zip(spec.params, args), **kwargs)
    if c.dtype == torch.float32:  # squared norms that would over/underflow float32: float64, then round
        out = op(**{k: widen(v) for k, v in given.items()})
        return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
    if spec.beyond_float64 is not None:
        return spec.beyond_float64(given, c)
    if spec.degree is None:
        raise float64_range_error(spec.name)
    t = rescale(c.metric, *c.data)
    scaled = {k: v.to(c.dtype) * t if k in spec.data else v for k, v in given.items()}
    return op(**scaled) * t ** -spec.degree(c)


def widen(v):
    """A float32 tensor as float64 (differentiable: gradients flow back in float32), a metric with
    its parameter widened; anything else (16-bit draws, which the float64 kernels read directly,
    numbers, flags) as it is."""
    if isinstance(v, torch.Tensor):
        return v.double() if v.dtype == torch.float32 else v
    if isinstance(v, Metric):
        return Metric.trusted(v.kind, widen(v.param))
    return v


def rescale(metric: Optional[Metric], *data: torch.Tensor) -> float:
    """The power of two t that brings the data's largest whitened magnitude to about 1, for a
    homogeneous op whose float64 data leave float64's range: the op runs on t·data, exactly
    (a power of two), and scales its result back.  One more min/max pass, on this rare path only."""
    extremes = [(t, e) for t, e in zip(data, map(_extremes, data)) if e is not None]
    z_hi = _whitened_largest(metric, _largest(extremes))
    return 2.0 ** -round(math.log2(z_hi))


def float64_range_error(op: str) -> ValueError:
    """The error of an op that cannot rescale float64 data beyond its range."""
    return ValueError(
        f"{op}: float64 data whose largest whitened magnitude lies outside [2^-200, 2^200] "
        f"(about 6e-61 to 1.6e60) are outside the op's range: its squared norms would lose "
        f"precision or overflow; rescale the data (and the law's scale with them)"
    )


# ---------------------------------------------------------------------------- autodiff orders
#
# The compiled ops (C++ and Triton) have fused first-order backward kernels only.  Two ways of
# asking for more would otherwise return zeros silently: forward mode (torch.func.jvp,
# torch.autograd.forward_ad), which the op's autograd kernel never sees, and a second backward
# through the backward kernels.  Forward mode is detected at the op's entry (an automatic
# backend choice then takes the reference, which supports it; an explicit kernel backend
# raises); a second backward raises from the op's graph node (etweedie/rules/common.py).


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
