"""Dense metrics on the kernel path: the data whitened, z = Lᵀ(u − c) with P = L Lᵀ, so that the
kernels run isotropically with unit precision, and the score mapped back.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._args import row_whitening_factor
from ._debug import value_checks
from ._rows import Canonical, take_rows
from ._ties import tie_equal_rows


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
