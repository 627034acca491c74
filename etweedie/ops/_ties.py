"""Equal points whiten to equal coordinates.

A dense metric reaches the kernels as whitened points z = (x − c)·L, one matrix product over
many rows.  A BLAS product does not promise that two equal rows give equal results: MKL's GEMM
rounds a row by the micro-kernel its position falls into (a main tile or an edge), so two equal
draws can come out 1e-7 apart in float32 (1e-16 in float64).  The pair ops then see a spurious
distance δ where there is none: at β < 1 its gradient term δ^{β−1} swamps the true gradient by
orders of magnitude, and at β = 1 it adds a random unit vector where the convention gives 0.

:func:`tie_equal_rows` makes equal rows of u = x − c take one z: rows are grouped by a hash of
their exact bits (an integer sum, the same for equal rows whatever their position), the groups
sorted together, each row checked against the first of its group bit for bit (so a hash
collision ties nothing), and a tied row takes its group's z with its own gradient (straight
through: the tied rows are equal, so each row's own gradient is the right one).  Cost: a few
passes over the n×d points and a sort of n keys, beside the product's n·d² work.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..geometry import _functorch_wrapped, _in_vmap

__all__ = ["row_keys", "tie_equal_rows", "tie_to_rows"]

# odd multipliers (steps of the golden-ratio constant) for the row hash; int32 products wrap
# around and their int64 sum is exact, so a row's key is a function of its bits alone, whatever
# path (vector lanes, tail, thread) each element takes
_GOLDEN = -1640531527  # 0x9E3779B9 as a signed int32
_CHUNK = 1 << 16  # elements hashed at once: temporaries of 256 kB, which the allocator reuses (a fresh multi-MB one costs a page fault per 4 kB on first touch, 20× the hash)


def _weights(n: int, device: torch.device) -> torch.Tensor:
    k = torch.arange(1, n + 1, dtype=torch.int64, device=device)
    return ((k * _GOLDEN) % (1 << 32) | 1).to(torch.int64).sub_(1 << 31).to(torch.int32)


def row_keys(u: torch.Tensor) -> torch.Tensor:
    """(..., n) int64 hash of each row of u (..., n, d) float32/float64: equal rows (as values:
    ±0 alike, through |u|'s bits) get equal keys; different rows rarely do (the exact comparison
    after the sort tells).  A caller tying one set twice (within itself, then against another)
    computes them once and passes them to both."""
    d = u.shape[-1]
    flat = u.reshape(-1, d)
    words = d * (2 if u.dtype == torch.float64 else 1)
    w = _weights(words, u.device)
    rows = max(1, _CHUNK // words)
    keys = [(flat[i:i + rows].abs().view(torch.int32) * w).sum(-1, dtype=torch.int64)
            for i in range(0, flat.shape[0], rows)]
    out = torch.cat(keys) if len(keys) != 1 else keys[0]
    return out.reshape(u.shape[:-1])


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of a and b equal as values (NaN never equal)."""
    return (a == b).all(-1)


def _straight_through(z: torch.Tensor, src: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """``src`` (detached values) where ``tied``, else ``z``; each row's gradient stays its own."""
    return torch.where(tied.unsqueeze(-1), src + (z - z.detach()), z)


def _values_read(t: torch.Tensor) -> bool:
    """Whether the fast path may read whether anything was tied: eager CPU tensors (elsewhere a
    read would be a device sync, a graph break or, under vmap, impossible: the ties apply as a
    select, which costs the same either way)."""
    return (not torch.compiler.is_compiling() and t.device.type == "cpu"
            and not (_functorch_wrapped(t) and _in_vmap()))


def tie_equal_rows(z: torch.Tensor, u: torch.Tensor, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``z`` (B, n, d), the whitened rows of ``u`` (B, n, d), with rows equal in ``u`` made equal
    in ``z`` within each leading index (rows of different leading indices never meet in a pair).
    ``keys``: ``row_keys(u)``, when the caller has them."""
    B, n, d = u.shape
    if n < 2 or z.numel() == 0:
        return z
    ks, order = torch.sort(row_keys(u) if keys is None else keys, dim=1, stable=True)
    start = torch.ones_like(ks, dtype=torch.bool)
    start[:, 1:] = ks[:, 1:] != ks[:, :-1]
    pos = torch.arange(n, device=u.device).expand(B, n)
    first = torch.cummax(torch.where(start, pos, 0), dim=1).values  # sorted position of the group's first row
    rep_sorted = order.gather(1, first)
    if _values_read(u):
        # eager CPU: compare the few rows that share a key with an earlier one (usually none)
        cand = (~start).nonzero()
        if cand.shape[0] == 0:
            return z
        bi, si = cand[:, 0], cand[:, 1]
        ok = _same(u[bi, order[bi, si]], u[bi, rep_sorted[bi, si]])
        if not bool(ok.any()):
            return z
        tied_sorted = torch.zeros_like(start)
        tied_sorted[bi[ok], si[ok]] = True
    else:  # no reads (a GPU, compile, vmap): the same as selects over every row
        idx = lambda i: i.unsqueeze(-1).expand(B, n, d)  # noqa: E731
        tied_sorted = ~start & _same(u.gather(1, idx(order)), u.gather(1, idx(rep_sorted)))
    back = torch.argsort(order, dim=1)  # sorted position of each row (a gather: vmap has no rule for scatter_)
    rep = torch.where(tied_sorted, rep_sorted, order).gather(1, back)
    src = z.detach().gather(1, rep.unsqueeze(-1).expand(B, n, z.shape[-1]))
    return _straight_through(z, src, tied_sorted.gather(1, back))


def tie_to_rows(zq: torch.Tensor, uq: torch.Tensor, zr: torch.Tensor, ur: torch.Tensor,
                keys_q: Optional[torch.Tensor] = None, keys_r: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``zq`` (n, d), the whitened rows of ``uq``, with a row equal to a row of the reference set
    ``ur`` (m, d) taking that row's whitened ``zr`` (queries against a bank, a target against a
    shared cloud, a cloud against a shared cloud).  ``keys_q`` / ``keys_r``: ``row_keys`` of
    ``uq`` / ``ur``, when the caller has them."""
    n, m = uq.shape[0], ur.shape[0]
    if n == 0 or m == 0:
        return zq
    kr_sorted, order = torch.sort(row_keys(ur) if keys_r is None else keys_r, stable=True)
    kq = row_keys(uq) if keys_q is None else keys_q
    at = torch.searchsorted(kr_sorted, kq).clamp_(max=m - 1)
    rep = order[at]
    tied = (kr_sorted[at] == kq) & _same(uq, ur[rep])
    if _values_read(uq) and not bool(tied.any()):
        return zq
    return _straight_through(zq, zr.detach()[rep], tied)
