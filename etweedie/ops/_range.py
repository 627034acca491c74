"""The ops' range and NaN rules.

:func:`scan` reads, in one min/max pass per tensor, whether the data leave the safe range of
their dtype (the call path, etweedie/ops/_call.py, then reruns or rescales the call) and whether
they hold NaN/inf (:func:`nan_rows` then gives those rows NaN).  The CPU kernels of the per-row
ops check the range themselves (:func:`kernel_checks_range`), and :func:`range_guarded` applies
both rules to a per-row op's output.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import backends
from ..geometry import Metric, _functorch_wrapped, _in_vmap
from ._args import LOW_PRECISION_DRAWS
from ._debug import _DEBUG, _is_compiling, value_checks


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
    B×N×d) and the others from the kernel, rerun on them alone (:func:`~etweedie.ops._rows.join_rows`)."""
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


def flagged(out: torch.Tensor) -> bool:
    """Whether a CPU kernel flagged rows of ``out`` (NaN rows), or ``out`` holds another non-finite
    value (an overflowing result also reruns in float64); read where value checks run (no GPU
    sync).  One sum: NaN and inf propagate through it (a sum that overflows from finite values
    also reads as flagged, and the float64 rerun is then merely unneeded), and unlike
    ``isfinite(out).all()`` it allocates no mask.  Only the Python form needs it (dense metrics,
    torch.compile, functorch): the C++ front ops return the kernel's own report."""
    return value_checks(out) and out.numel() > 0 and not math.isfinite(float(out.detach().sum()))
