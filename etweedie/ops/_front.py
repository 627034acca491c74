"""Which calls run through the C++ front ops (``torch.ops.etweedie.<op>``, csrc/front/: the
canonical form and the kernel call in one C++ call).

The plain CPU call a sampler or training loop makes goes there with no Python checks
(:func:`plain_rows`, an op spec's ``plain`` in etweedie/ops/_call.py); on the general path, after
the checks, :func:`front` chooses between the front op and the Python form
(:func:`~etweedie.ops._rows.shape_rows`).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD

from .. import backends
from ..geometry import Metric, _functorch_wrapped
from ..rules.common import BLOCK, DENSE, DIAGONAL, ISOTROPIC
from ._args import _KIND, LOW_PRECISION_DRAWS, checked_cpu_param, cpu_constant, precision_of
from ._call import functorch_transformed
from ._debug import _DEBUG, _is_compiling
from ._rows import RowArgs

# The C++ front ops (csrc/front/) this extension has (none in one built before they existed).
_FRONT = {op: backends._EXT_OK and backends._has_op(op, "CompositeImplicitAutograd")
          for op in ("et_score", "langevin_step", "student_t_score", "energy_score")}


def plain_rows(op: str, y, x, beta, lam, metric, backend) -> Optional[tuple]:
    """``(beta, lam, prec, kind, batch)`` for the C++ front op of a per-row op when the call is the
    plain one a sampler or training loop makes on the CPU, or None: then the general path
    (:func:`~etweedie.ops._rows.rows_args`, the backend choice,
    :func:`~etweedie.ops._call.kernel_or_reference`, :func:`~etweedie.ops._range.range_guarded`)
    runs, and raises whatever is wrong with the arguments.

    Plain (:func:`plain_call` and :func:`plain_metric`): ``backend="cpu"`` or the automatic choice
    resolving to it, no debug checks, dual level, compile trace or functorch transform; y (B, d)
    and x (B, N, d) plain CPU tensors with N, d ≥ 1 in the dtype rule; β and λ floats that
    passed their rules before (:func:`~etweedie.ops._args.as_param` remembered them); no metric, or an isotropic,
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
        prec = cpu_constant(1.0, dtype)
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


def front(op: str, name: str, a: RowArgs, *tensors) -> bool:
    """Whether the per-row op ``op`` runs through its C++ front op (``torch.ops.etweedie.<op>``:
    the canonical form and the kernel call in one C++ call) rather than :func:`~etweedie.ops._rows.shape_rows`.

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
