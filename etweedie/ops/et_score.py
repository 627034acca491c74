"""et_score: the Energy-Tweedie score from denoising-posterior samples (DESIGN §1).

    s(y) = −λ P (1/N) Σ_i ‖y − x_i‖_P^{β−2} (y − x_i),     x_i ~ P(X | Y = y)

This module validates arguments, picks the backend and registers the fake (meta) and
autograd implementations of the compiled op ``etweedie::et_score_fwd`` so that it runs under
``torch.compile(fullgraph=True)`` and differentiates with respect to y, x, β, λ and the
metric (through its precision parameter) with the fused backward kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from ..geometry import Metric
from ..rules.common import DENSE
from ..rules.et_score import autograd_rules, fake_bwd, fake_fwd
from . import reference
from ._call import OpSpec, call
from ._debug import near_mode
from ._front import front, plain_rows
from ._range import range_guarded
from ._rows import RowArgs, canonical_rows, join_rows, rows_args, shape_rows, take_rows
from ._whiten import dense_score

__all__ = ["et_score"]


def et_score(
    y: torch.Tensor,
    x: torch.Tensor,
    beta,
    lam=1.0,
    metric: Optional[Metric] = None,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Energy-Tweedie score of the noisy marginal at y from posterior draws x.

    Args:
        y: queries, ``(*batch, d)``, float32 or float64: the compute dtype.
        x: posterior draws, ``(*batch, N, d)`` (N ≥ 1); batch dims broadcast with y's, so one
            cloud can serve many queries without a copy.  y's dtype, or bfloat16 / float16: 16-bit
            draws (e.g. a bf16 posterior's output) are read as stored and widened to y's dtype
            inside the kernels, with float32 (float64) accumulation and no cast pass; their
            gradient comes back in x's dtype.
        beta: tail exponent β ∈ (0, 2], float or tensor broadcasting to ``batch``.
        lam: rate λ > 0, float or tensor broadcasting to ``batch``.
        metric: noise geometry :class:`~etweedie.Metric` (None: Σ = I); may carry a batch.
        backend: ``None`` (automatic), ``"reference"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.

    Returns:
        the score, ``(*batch, d)``, in y's dtype.  A draw equal to y contributes 0 (never NaN).  A 2-D ``x``
        of shape ``(N, d)`` is one cloud shared by every query (ordinary broadcasting of the
        batch dims); for one draw per query write ``x.unsqueeze(-2)`` (shape ``(B, 1, d)``).
        float32 inputs whose magnitudes would overflow or underflow the squared norms run in
        float64 (see the README's Guarantees).

    Example::

        >>> y = torch.zeros(1, 2); x = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
        >>> etweedie.et_score(y, x, beta=2.0)        # Gaussian: −(y − mean x)
        tensor([[0.5000, 1.0000]])
    """
    return call(_SPEC, et_score, y, x, beta, lam, metric, backend=backend)


def _plain(y, x, beta, lam=1.0, metric=None, *, backend=None) -> Optional[torch.Tensor]:
    """The plain CPU call (:func:`~etweedie.ops._front.plain_rows`) straight to the C++ front op, or
    None; also None for a flagged row: the general path reruns the call (in float64 where needed)."""
    plain = plain_rows(_OP, y, x, beta, lam, metric, backend)
    if plain is None:
        return None
    s, nonfinite = torch.ops.etweedie.et_score(y, x, *plain)
    return None if nonfinite else s


def _check(y, x, beta, lam=1.0, metric=None, *, backend=None) -> RowArgs:
    return rows_args(_OP, y, x, beta, lam, metric)


def _run(name: str, a: RowArgs) -> Optional[torch.Tensor]:
    """The score under the range and NaN rules (:func:`~etweedie.ops._range.range_guarded`), or None."""
    def run():  # (score, whether the CPU kernel wrote NaN/inf: known from the front op only)
        if front(_OP, name, a):
            return torch.ops.etweedie.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)
        return _python_form(name, a).reshape(*a.batch, a.y.shape[-1]), None  # the front op returns (*batch, d) too

    # an infinite draw has no finite limit in the sum (‖u‖^{β−1} grows without bound): NaN rows
    return range_guarded(_OP, name, a.given_metric, a.y, a.x, a.batch, run, lambda rows: _near(name, a, rows))


def _python_form(name: str, a: RowArgs, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The score of the flat rows ``rows`` (None: all) from the canonical form."""
    c = shape_rows(a)
    if name == "reference":
        return reference.et_score(c.y, c.x, c.beta, c.lam, c.prec, c.kind, near_mode(c.y))
    if c.kind == DENSE:
        return dense_score(c, lambda zy, zx, ones, r: _kernel(name, zy, zx, take_rows(c.beta, r),
                                                               take_rows(c.lam, r), ones, 0), rows)
    if rows is not None:
        c = canonical_rows(c, rows)
    return _kernel(name, c.y, c.x, c.beta, c.lam, c.prec, c.kind)


def _near(name: str, a: RowArgs, rows: torch.Tensor) -> torch.Tensor:
    """float64 rows with a draw nearer to y than the kernel's range on the reference's exact form."""
    def exact(rows):
        c = canonical_rows(shape_rows(a), rows)
        return reference.et_score(c.y, c.x, c.beta, c.lam, c.prec, c.kind, "index")
    return join_rows(a.batch, rows, exact, lambda others: _python_form(name, a, others))


def _kernel(name, y, x, beta, lam, prec, kind) -> torch.Tensor:
    if name == "triton":
        from ..kernels.et_score import et_score_op  # imports triton: only when asked for

        return et_score_op(y, x, beta, lam, prec, kind)[0]
    # "cpu" and "cuda" are the same compiled op; the dispatcher picks the device's kernel.
    return torch.ops.etweedie.et_score_fwd(y, x, beta, lam, prec, kind)[0]


# ---------------------------------------------------------------------------- registration

def _register() -> None:
    lib = "etweedie::"
    torch.library.register_fake(lib + "et_score_fwd")(fake_fwd)
    torch.library.register_fake(lib + "et_score_bwd")(fake_bwd)
    if backends._has_op("et_score_fwd", "Autograd"):
        # the extension's C++ autograd kernel (csrc/autograd/et_score_autograd.cpp): the same rule
        # without a Python call per backward
        return
    setup_context, backward = autograd_rules(torch.ops.etweedie.et_score_bwd)
    torch.library.register_autograd(lib + "et_score_fwd", backward, setup_context=setup_context)


_OP = "et_score"
# the score is homogeneous of degree β − 1 in the data: s(ty, tx) = t^{β−1} s(y, x)
_SPEC = OpSpec(_OP, ("y", "x", "beta", "lam", "metric"), _check, _run, data=("y", "x"),
               degree=lambda a: (a.beta - 1).unsqueeze(-1), plain=_plain)

if backends._EXT_OK:
    _register()
