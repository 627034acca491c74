"""Pair engine of the Triton energy_score and energy_distance kernels (DESIGN §1).

Both losses are weighted pair sums per row r (csrc/cpu/energy_cpu.h computes the same):

    V_r = w_cross Σ_{i,j} E(a_i − c_j) + w_a Σ_{i<j} E(a_i − a_j) + w_c Σ_{i<j} E(c_i − c_j)

with E(u) = ‖u‖_P^β = q^{β/2}, q = uᵀPu (energy score: a = the M samples, c = the target as a
one-point cloud, w_c = 0; energy distance: the two clouds).  Per pair (csrc/common/energy.h):
slope = β q^{(β−2)/2} with ∂E/∂u = slope · P u, ∂E/∂β = ½ ln q · E; a coincident pair (q = 0)
contributes 0 to everything (never NaN).

Metric: the kernel forms q = uᵀPu from direct differences of the raw coordinates, so clouds
far from the origin lose nothing and coincident points give exactly 0, with the row's metric
applied in the kernel (no whitening pass): a per-row scalar p (isotropic, kind 0), the chunk's
precisions (diagonal, kind 1), or a k×k block repeated along d (kind 2), whose other
coordinates each column reads at shifted columns (cached: the chunk's own loads brought them
in).  A point's gradient is Σ_j c_ij P u_ij.  The metric gradient needs no pair loop: with
g_p = ∂V/∂x_p = 2 Σ_j w·E'·P u_pj, the centred sum S = Σ_p (x_p − x_0) g_pᵀ over both clouds
(per k×k coordinate block; Σ_p g_p = 0, and the centre x_0 keeps it at the clouds' spread) is
2 Σ_pairs w·E'·u uᵀ P, so ∂V/∂P = ¼ (S P⁻¹ + P⁻¹ Sᵀ) (block) or ½ S_cc / p_c (diagonal).  For
kind 0, ∂V/∂p = β V / (2p) (E is homogeneous of degree β/2 in p).

Work split: one program per (row, tile of BI "own" points).  A launch takes one cloud as the
own cloud: its programs pair their tile with every tile of the other cloud (cross pairs) and
with the tiles of their own cloud (within pairs).  Value only (forward): the within pairs
follow a circulant split — tile I pairs with tiles I, I+1, …, I+h (mod nb) — so each unordered
pair is formed once and every program gets the same share; the second cloud's launch adds its
within pairs only.  Gradients: a program visits every tile (ordered within pairs), so each
point's gradient Σ_j w·slope·u_ij is summed by the program that owns it — no atomics, no races;
a second launch with the clouds swapped gives the other cloud's gradients.
Small d (≤ 4): q is built from per-coordinate (BI, BJ) tiles and the own tile's gradient stays
in registers.  Large d: (BI, BJ, BD) difference tiles over coordinate chunks; the gradient of
the own tile's chunk is read-modify-written in the (zero-initialized) output, which only this
program touches.  Value and β sums are accumulated per program in float64 (the energy distance
is a small difference of large sums) and reduced on the host; memory is O((n + m)·d) plus
O(B · tiles) partials — nothing of size n·m.  Indexing is int64 (rows × strides, points × d).
Small clouds at large d (n + m ≤ 64, d > 4: energy_score's training shape) take two split
kernels instead (section "small clouds, large d" below).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .et_score import dense_metric_rows, launcher

__all__ = ["energy_pairs", "energy_value", "energy_grads", "check_energy_canonical", "tile_sizes"]

# Tile limits (tests lower them to exercise several tiles and coordinate chunks).
_MAX_TILE_SMALL = 64   # points per tile, d ≤ _SMALL_D
_MAX_TILE_LARGE = 32   # points per tile, larger d
_TILE3 = 4096          # element budget of one (BI, BJ, BD) difference tile
_SMALL_D = 4


def tile_sizes(n_own: int, n_other: int, d: int):
    """(BI, BJ, BD, small) for a launch whose own cloud has n_own points."""
    small = d <= _SMALL_D
    cap = _MAX_TILE_SMALL if small else _MAX_TILE_LARGE
    BI = max(1, min(triton.next_power_of_2(max(n_own, 1)), cap))
    BJ = max(1, min(triton.next_power_of_2(max(n_other, 1)), cap))
    if small:
        BD = triton.next_power_of_2(d)
    else:
        BD = max(1, min(triton.next_power_of_2(d), _TILE3 // (BI * max(BI, BJ))))
    return BI, BJ, BD, small


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _pair_terms(q, beta):
    """(E, slope) of q = ‖u‖²_P: E = q^{β/2}, slope = β q^{(β−2)/2}; both 0 at q = 0.
    β = 1 and β = 2 (per-row runtime branch) take exact sqrt / square forms."""
    pos = q > 0
    qs = tl.where(pos, q, 1.0)
    if beta == 1.0:
        r = tl.rsqrt(qs)
        e = qs * r
        sl = r
    elif beta == 2.0:
        e = qs
        sl = qs * 0.0 + 2.0
    else:
        e = tl.exp(0.5 * beta * tl.log(qs))
        sl = beta * e / qs
    return tl.where(pos, e, 0.0), tl.where(pos, sl, 0.0)


@triton.jit
def _small_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, p_row, k: tl.constexpr,
              KIND: tl.constexpr, K: tl.constexpr):
    """(u_k, (P u)_k) of coordinate k for the (BI, BJ) pairs (small d; the isotropic p is applied
    by the caller): a block row reads the K coordinates of k's block."""
    xi = tl.load(own_row + offs_i * s_own + k, mask=mask_i, other=0.0)
    xj = tl.load(oth_row + offs_j * s_oth + k, mask=mask_j, other=0.0)
    u = xi[:, None] - xj[None, :]
    if KIND == 1:
        pu = tl.load(p_row + k) * u
    elif KIND == 2:
        a: tl.constexpr = k % K
        pu = tl.load(p_row + a * K + a) * u
        for b in tl.static_range(K):
            if b != a:
                cb: tl.constexpr = k - a + b
                yi = tl.load(own_row + offs_i * s_own + cb, mask=mask_i, other=0.0)
                yj = tl.load(oth_row + offs_j * s_oth + cb, mask=mask_j, other=0.0)
                pu += tl.load(p_row + a * K + b) * (yi[:, None] - yj[None, :])
    else:
        pu = u
    return u, pu


@triton.jit
def _chunk_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, cols, mc, p_row,
              KIND: tl.constexpr, K: tl.constexpr):
    """(u, P u) over the coordinate chunk ``cols`` for the (BI, BJ, BD) pairs (large d; the
    isotropic p is applied by the caller).  A block metric reads the other coordinates of each
    column's block at shifted columns (from cache: the chunk's own loads brought them in), so a
    block may straddle chunks and K need not divide the chunk."""
    m_i = mask_i[:, None] & mc[None, :]
    m_j = mask_j[:, None] & mc[None, :]
    xi = tl.load(own_row + offs_i[:, None] * s_own + cols[None, :], mask=m_i, other=0.0)
    xj = tl.load(oth_row + offs_j[:, None] * s_oth + cols[None, :], mask=m_j, other=0.0)
    u = xi[:, None, :] - xj[None, :, :]
    if KIND == 1:
        pc = tl.load(p_row + cols, mask=mc, other=0.0)
        pu = u * pc[None, None, :]
    elif KIND == 2:
        a = cols % K
        base = cols - a
        pu = u * tl.load(p_row + a * K + a, mask=mc, other=0.0)[None, None, :]
        for b in tl.static_range(K):
            cb = base + b
            off = (cb != cols) & mc
            yi = tl.load(own_row + offs_i[:, None] * s_own + cb[None, :], mask=mask_i[:, None] & off[None, :], other=0.0)
            yj = tl.load(oth_row + offs_j[:, None] * s_oth + cb[None, :], mask=mask_j[:, None] & off[None, :], other=0.0)
            pab = tl.load(p_row + a * K + b, mask=off, other=0.0)
            pu += (yi[:, None, :] - yj[None, :, :]) * pab[None, None, :]
    else:
        pu = u
    return u, pu


@triton.jit
def _sq_dist(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, d, p_row,
             SMALL: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
             KIND: tl.constexpr, K: tl.constexpr):
    """(BI, BJ) squared norms uᵀ P u of own_i − other_j from direct differences (the isotropic
    p is applied by the caller)."""
    q = tl.zeros([BI, BJ], dtype=own_row.dtype.element_ty)
    if SMALL:
        for k in tl.static_range(D):
            u, pu = _small_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, p_row, k, KIND, K)
            q += u * pu
    else:
        for c0 in range(0, d, BD):
            cols = c0 + tl.arange(0, BD)
            mc = cols < d
            u, pu = _chunk_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, cols, mc, p_row,
                              KIND, K)
            q += tl.sum(u * pu, axis=2)
    return q


@triton.jit
def _add_grad(acc, c, own_row, oth_row, g_rows, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, d, p_row,
              SMALL: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BD: tl.constexpr,
              KIND: tl.constexpr, K: tl.constexpr):
    """Own points' gradient += Σ_j c_ij P (own_i − other_j) (the isotropic p is in c).  Small d:
    returned in acc (BI, DP); large d: added in place to the output rows g_rows (BI points × d,
    only this program's)."""
    if SMALL:
        kcols = tl.arange(0, DP)
        for k in tl.static_range(D):
            u, pu = _small_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, p_row, k, KIND, K)
            gk = tl.sum(c * pu, axis=1)
            acc += tl.where(kcols[None, :] == k, gk[:, None], 0.0)
    else:
        for c0 in range(0, d, BD):
            cols = c0 + tl.arange(0, BD)
            mc = cols < d
            m_own = mask_i[:, None] & mc[None, :]
            u, pu = _chunk_pu(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, cols, mc, p_row,
                              KIND, K)
            gch = tl.sum(c[:, :, None] * pu, axis=1)
            ptrs = g_rows + offs_i[:, None] * d + cols[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=m_own, other=0.0) + gch, mask=m_own)
            # the next read-modify-write of these elements may come from other threads
            tl.debug_barrier()
    return acc


@triton.jit
def _tile_pair(acc, own_row, oth_row, g_rows, offs_i, mask_i, j0, n_oth, s_own, s_oth, d, beta, p, p_row, coef,
               NEED_G: tl.constexpr, NEED_BETA: tl.constexpr,
               SMALL: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BD: tl.constexpr,
               BI: tl.constexpr, BJ: tl.constexpr, KIND: tl.constexpr, K: tl.constexpr):
    """One (own tile, other tile) block of pairs: returns (acc, Σ E, Σ ∂E/∂β) and, with
    NEED_G, adds coef · slope · P u to the own points' gradient (p: the isotropic factor, 1 for
    the other kinds, whose parameters are read at p_row)."""
    offs_j = j0 + tl.arange(0, BJ).to(tl.int64)
    mask_j = offs_j < n_oth
    q = p * _sq_dist(own_row, oth_row, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, d, p_row,
                     SMALL, D, BD, BI, BJ, KIND, K)
    e, sl = _pair_terms(q, beta)
    valid = mask_i[:, None] & mask_j[None, :]
    e = tl.where(valid, e, 0.0)
    e_sum = tl.sum(tl.sum(e, axis=1), axis=0)
    b_sum = e_sum * 0.0
    if NEED_BETA:
        b_sum = tl.sum(tl.sum(0.5 * tl.log(tl.where(q > 0, q, 1.0)) * e, axis=1), axis=0)
    if NEED_G:
        c = tl.where(valid, sl, 0.0) * (coef * p)
        acc = _add_grad(acc, c, own_row, oth_row, g_rows, offs_i, mask_i, offs_j, mask_j, s_own, s_oth, d, p_row,
                        SMALL, D, DP, BD, KIND, K)
    return acc, e_sum, b_sum


# ----------------------------------------------------------------------------- kernel

# n_own / n_other are runtime values (tile counts, circulant split): keep 1 from specializing.
@triton.jit(do_not_specialize=["n_own", "n_oth"])
def _energy_pairs_kernel(
    own_ptr, oth_ptr, beta_ptr, p_ptr, g_ptr, val_ptr, gb_ptr, gown_ptr,
    n_own, n_oth, d, so_b, so_n, st_b, st_n, sb, sp, sg, nt,
    w_cross, w_within,
    CROSS: tl.constexpr, WITHIN_ALL: tl.constexpr, NEED_G: tl.constexpr, NEED_VALUE: tl.constexpr,
    NEED_BETA: tl.constexpr, CROSS_BETA: tl.constexpr, SMALL: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BD: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, KIND: tl.constexpr, K: tl.constexpr,
):
    """Program (row r, own tile I): value/β partials of its pairs and its points' gradients.

    CROSS: 0 no cross pairs, 1 cross pairs counted in value/β (and gradient), 2 gradient only.
    WITHIN_ALL: ordered within pairs over every tile (gradients) instead of the circulant half.
    """
    pid = tl.program_id(0).to(tl.int64)
    r = pid // nt
    I = pid % nt
    dt = own_ptr.dtype.element_ty
    own_row = own_ptr + r * so_b
    oth_row = oth_ptr + r * st_b
    g_rows = gown_ptr + r * n_own * d
    beta = tl.load(beta_ptr + r * sb)
    p_row = p_ptr + r * sp
    if KIND == 0:
        p = tl.load(p_row)
    else:
        p = 1.0
    g = tl.load(g_ptr + r * sg)
    offs_i = I * BI + tl.arange(0, BI).to(tl.int64)
    mask_i = offs_i < n_own
    acc = tl.zeros([BI, DP], dtype=dt)
    cross_e = tl.zeros([1], dtype=tl.float64)
    cross_b = tl.zeros([1], dtype=tl.float64)
    within_e = tl.zeros([1], dtype=tl.float64)
    within_b = tl.zeros([1], dtype=tl.float64)
    if CROSS != 0:
        for j0 in range(0, n_oth, BJ):
            acc, es, bs = _tile_pair(acc, own_row, oth_row, g_rows, offs_i, mask_i, j0, n_oth, so_n, st_n, d,
                                     beta, p, p_row, g * w_cross, NEED_G, CROSS_BETA,
                                     SMALL, D, DP, BD, BI, BJ, KIND, K)
            if CROSS == 1:
                cross_e += es.to(tl.float64)
                cross_b += bs.to(tl.float64)
    if w_within != 0.0:
        nb = tl.cdiv(n_own, BI)
        if WITHIN_ALL:
            for J in range(0, nb):
                acc, es, bs = _tile_pair(acc, own_row, own_row, g_rows, offs_i, mask_i, J * BI, n_own, so_n, so_n, d,
                                         beta, p, p_row, g * w_within, NEED_G, NEED_BETA, SMALL, D, DP, BD, BI, BI,
                                         KIND, K)
                within_e += 0.5 * es.to(tl.float64)  # ordered pairs: each unordered pair twice
                within_b += 0.5 * bs.to(tl.float64)
        else:
            half = nb // 2
            h = tl.where(nb % 2 == 1, (nb - 1) // 2, tl.where(I < half, half, half - 1))
            for t in range(0, h + 1):
                J = (I + t) % nb
                acc, es, bs = _tile_pair(acc, own_row, own_row, g_rows, offs_i, mask_i, J * BI, n_own, so_n, so_n, d,
                                         beta, p, p_row, g * w_within, False, NEED_BETA, SMALL, D, DP, BD, BI, BI,
                                         KIND, K)
                fac = tl.where(t == 0, 0.5, 1.0).to(tl.float64)  # the diagonal tile holds ordered pairs
                within_e += fac * es.to(tl.float64)
                within_b += fac * bs.to(tl.float64)
    # unweighted sums (cross, within) per program; the host applies the weights in float64
    one = tl.arange(0, 1)
    if NEED_VALUE:
        tl.store(val_ptr + 2 * pid + one, cross_e)
        tl.store(val_ptr + 2 * pid + 1 + one, within_e)
    if NEED_BETA:
        tl.store(gb_ptr + 2 * pid + one, cross_b)
        tl.store(gb_ptr + 2 * pid + 1 + one, within_b)
    if NEED_G and SMALL:
        kcols = tl.arange(0, DP)
        ptrs = g_rows + offs_i[:, None] * d + kcols[None, :]
        tl.store(ptrs, acc, mask=mask_i[:, None] & (kcols < D)[None, :])


# ----------------------------------------------------------------------------- small clouds, large d

# Rows whose two clouds hold at most _SPLIT_MAX_POINTS points together (energy_score's training
# shape: M ≤ 63 samples and the target; small energy distances) at d > _SMALL_D.  The tiled
# kernel above gives such a row one program that steps through every coordinate chunk with
# tiles of a few coordinates (BI·BJ·BD ≤ _TILE3: 4 coordinates per step at 32 × 32 pairs), 196
# steps per sweep at d = 784.  Instead, two kernels:
#   _split_rows_kernel, one program per (row, R own points): the squared distances of its R
#     points to all n + m points of the row over the whole of d (chunks of W coordinates, the
#     row's points loaded once per chunk, (NPP, W) tiles), then each pair's energy, ∂E/∂β and
#     slope: the value and ∂/∂β sums (pairs p < q only, float64, per pair type; the host applies
#     the weights) and its R rows of the coefficient matrix C_pq = g·w·slope (·p, isotropic);
#   _split_grad_kernel, one program per (row, chunk of W coordinates): g_p = P Σ_q C_pq (x_p − x_q)
#     for every wanted point from direct differences, stored (no zero-fill, no read-modify-write).
# Memory: the (B, NPP, NPP) coefficients and (B, programs, 6) partial sums.
# ETWEEDIE_TRITON_ENERGY_SPLIT=0 keeps such rows on the tiled kernel (A/B timing, bisecting).
_SPLIT_MAX_POINTS = 64
_SPLIT_TILE = 2048  # elements of one (NPP, W) point tile
_SPLIT_ROWS = 4     # own points per program of _split_rows_kernel


def split_applies(n: int, m: int, d: int) -> bool:
    """Whether rows of n + m points in d dimensions take the split kernels."""
    if os.environ.get("ETWEEDIE_TRITON_ENERGY_SPLIT", "1") == "0":
        return False
    return d > _SMALL_D and n >= 1 and m >= 1 and n + m <= _SPLIT_MAX_POINTS


@triton.jit
def _split_points(a_row, c_row, san, scn, pts, n, np_, cols, mc):
    """(NPP, W) coordinates ``cols`` of the row's points: a's for pts < n, then c's; 0 outside."""
    in_a = pts < n
    in_c = (pts >= n) & (pts < np_)
    xa = tl.load(a_row + pts[:, None] * san + cols[None, :], mask=in_a[:, None] & mc[None, :], other=0.0)
    xc = tl.load(c_row + tl.where(in_c, pts - n, 0)[:, None] * scn + cols[None, :], mask=in_c[:, None] & mc[None, :],
                 other=0.0)
    return xa + xc


@triton.jit
def _split_point(a_row, c_row, san, scn, i, n, np_, cols, mc):
    """(W,) coordinates ``cols`` of point i (a's if i < n, else c's; 0 if i ≥ n + m)."""
    iv = cols * 0 + i  # i as a vector: a scalar comparison is no mask
    xa = tl.load(a_row + iv * san + cols, mask=mc & (iv < n), other=0.0)
    xc = tl.load(c_row + tl.where(iv >= n, iv - n, 0) * scn + cols, mask=mc & (iv >= n) & (iv < np_), other=0.0)
    return xa + xc


@triton.jit
def _split_pu(X, a_row, c_row, san, scn, pts, i, n, np_, cols, mc, p_row, d, KIND: tl.constexpr, K: tl.constexpr):
    """(u, P u) for u = x_p − x_i over the chunk ``cols`` for every point p (tile X); a block
    metric reads each column's block partners at shifted columns (cached: the chunk's own loads
    brought them in), so blocks may straddle chunks."""
    xi = _split_point(a_row, c_row, san, scn, i, n, np_, cols, mc)
    u = X - xi[None, :]
    if KIND == 1:
        pu = u * tl.load(p_row + cols, mask=mc, other=0.0)[None, :]
    elif KIND == 2:
        a = cols % K
        base = cols - a
        pu = u * tl.load(p_row + a * K + a, mask=mc, other=0.0)[None, :]
        for b in tl.static_range(K):
            cb = base + b
            off = (cb != cols) & mc
            Xb = _split_points(a_row, c_row, san, scn, pts, n, np_, cb, off)
            xib = _split_point(a_row, c_row, san, scn, i, n, np_, cb, off)
            pu += (Xb - xib[None, :]) * tl.load(p_row + a * K + b, mask=off, other=0.0)[None, :]
    else:
        pu = u
    return u, pu


@triton.jit
def _store_type_sums(out, t, cross, within_a):
    """out[0:3] = the sums of the (R, NPP) float64 tile t over cross, within-a and within-c pairs."""
    one = tl.arange(0, 1)
    zero = tl.zeros([1], tl.float64)
    tl.store(out + one, tl.sum(tl.sum(tl.where(cross, t, 0.0), axis=1), axis=0) + zero)
    tl.store(out + 1 + one, tl.sum(tl.sum(tl.where(within_a, t, 0.0), axis=1), axis=0) + zero)
    tl.store(out + 2 + one, tl.sum(tl.sum(tl.where(~cross & ~within_a, t, 0.0), axis=1), axis=0) + zero)


@triton.jit(do_not_specialize=["n", "m"])
def _split_rows_kernel(
    a_ptr, c_ptr, beta_ptr, p_ptr, g_ptr, w_ptr, coef_ptr, part_ptr,
    n, m, d, sab, san, scb, scn, sb, sp, sg, NI,
    NPP: tl.constexpr, W: tl.constexpr, R: tl.constexpr, KIND: tl.constexpr, K: tl.constexpr,
    NEED_COEF: tl.constexpr, NEED_SUMS: tl.constexpr, NEED_BETA: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid // NI
    i0 = (pid % NI) * R
    np_ = n + m
    dt = a_ptr.dtype.element_ty
    a_row = a_ptr + r * sab
    c_row = c_ptr + r * scb
    p_row = p_ptr + r * sp
    pts = tl.arange(0, NPP).to(tl.int64)
    rows = tl.arange(0, R)
    Q = tl.zeros([R, NPP], dtype=dt)
    for c0 in range(0, d, W):
        cols = c0 + tl.arange(0, W).to(tl.int64)
        mc = cols < d
        X = _split_points(a_row, c_row, san, scn, pts, n, np_, cols, mc)
        for rr in tl.static_range(R):
            u, pu = _split_pu(X, a_row, c_row, san, scn, pts, i0 + rr, n, np_, cols, mc, p_row, d, KIND, K)
            Q += tl.where(rows[:, None] == rr, tl.sum(u * pu, axis=1)[None, :], 0.0)
    if KIND == 0:
        piso = tl.load(p_row)
    else:
        piso = tl.full([1], 1.0, dt)
    q = Q * piso
    beta = tl.load(beta_ptr + r * sb)
    g = tl.load(g_ptr + r * sg)
    w_cross = tl.load(w_ptr)
    w_a = tl.load(w_ptr + 1)
    w_c = tl.load(w_ptr + 2)
    pi = i0 + rows.to(tl.int64)
    ia = pi < n
    ja = pts < n
    valid = (pi < np_)[:, None] & (pts < np_)[None, :] & (pi[:, None] != pts[None, :])
    cross = ia[:, None] != ja[None, :]
    within_a = ia[:, None] & ja[None, :]
    w = tl.where(cross, w_cross, tl.where(within_a, w_a, w_c))
    used = valid & (w != 0.0)
    e, sl = _pair_terms(q, beta)
    if NEED_SUMS:
        upper = used & (pts[None, :] > pi[:, None])  # each unordered pair once
        e = tl.where(upper, e, 0.0).to(tl.float64)
        base = part_ptr + pid * 6
        _store_type_sums(base, e, cross, within_a)
        if NEED_BETA:
            eb = tl.where(upper, 0.5 * tl.log(tl.where(q > 0, q, 1.0)), 0.0).to(tl.float64) * e
            _store_type_sums(base + 3, eb, cross, within_a)
    if NEED_COEF:
        c = tl.where(used, sl * w * (g * piso), 0.0)
        tl.store(coef_ptr + r * NPP * NPP + pi[:, None] * NPP + pts[None, :], c, mask=(pi < NPP)[:, None])


@triton.jit(do_not_specialize=["n", "m"])
def _split_grad_kernel(
    a_ptr, c_ptr, p_ptr, coef_ptr, ga_ptr, gc_ptr,
    n, m, d, sab, san, scb, scn, sp, CG,
    NPP: tl.constexpr, W: tl.constexpr, KIND: tl.constexpr, K: tl.constexpr,
    NEED_A: tl.constexpr, NEED_C: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid // CG
    c0 = (pid % CG) * W
    np_ = n + m
    a_row = a_ptr + r * sab
    c_row = c_ptr + r * scb
    p_row = p_ptr + r * sp
    pts = tl.arange(0, NPP).to(tl.int64)
    cols = c0 + tl.arange(0, W).to(tl.int64)
    mc = cols < d
    X = _split_points(a_row, c_row, san, scn, pts, n, np_, cols, mc)
    acc = tl.zeros([NPP, W], dtype=X.dtype)
    crow = coef_ptr + r * NPP * NPP
    for qi in range(0, np_):
        cq = tl.load(crow + pts * NPP + qi, mask=pts < np_, other=0.0)  # C_pq from point p's own row
        u, pu = _split_pu(X, a_row, c_row, san, scn, pts, qi, n, np_, cols, mc, p_row, d, KIND, K)
        acc += cq[:, None] * pu
    if NEED_A:
        tl.store(ga_ptr + (r * n + pts)[:, None] * d + cols[None, :], acc, mask=(pts < n)[:, None] & mc[None, :])
    if NEED_C:
        in_c = (pts >= n) & (pts < np_)
        tl.store(gc_ptr + (r * m + tl.where(in_c, pts - n, 0))[:, None] * d + cols[None, :], acc,
                 mask=in_c[:, None] & mc[None, :])


def _split_pairs(a, c, beta, p, kind, g, weights, need_value, need_a, need_c, need_beta):
    """energy_pairs for rows that split_applies to (same arguments and results)."""
    B, n, d = a.shape
    m = c.shape[1]
    NPP = max(triton.next_power_of_2(n + m), 2)
    W = max(1, min(triton.next_power_of_2(d), _SPLIT_TILE // NPP))
    R = _SPLIT_ROWS
    NI = triton.cdiv(n + m, R)
    K = p.shape[-1] if kind == 2 else 1
    w_cross, w_a, w_c = weights
    wts = torch.tensor([w_cross, w_a if n > 1 else 0.0, w_c if m > 1 else 0.0], dtype=a.dtype, device=a.device)
    need_grads = need_a or need_c
    need_sums = need_value or need_beta
    f64 = dict(dtype=torch.float64, device=a.device)
    part = torch.empty((B, NI, 6), **f64) if need_sums else torch.empty(1, **f64)
    coef = a.new_empty((B, NPP, NPP)) if need_grads else a.new_empty(1)
    ga = a.new_empty((B, n, d)) if need_a else None
    gc = c.new_empty((B, m, d)) if need_c else None
    if B > 0:
        launcher(_split_rows_kernel)[(B * NI,)](
            a, c, beta, p, g, wts, coef, part,
            n, m, d, a.stride(0), a.stride(1), c.stride(0), c.stride(1), beta.stride(0), p.stride(0), g.stride(0), NI,
            NPP=NPP, W=W, R=R, KIND=kind, K=K, NEED_COEF=need_grads, NEED_SUMS=need_sums, NEED_BETA=need_beta,
        )
        if need_grads:
            CG = triton.cdiv(d, W)
            launcher(_split_grad_kernel)[(B * CG,)](
                a, c, p, coef, ga if need_a else a, gc if need_c else c,
                n, m, d, a.stride(0), a.stride(1), c.stride(0), c.stride(1), p.stride(0), CG,
                NPP=NPP, W=W, KIND=kind, K=K, NEED_A=need_a, NEED_C=need_c,
            )
    value = gbeta = None
    if need_sums:
        w = torch.tensor([w_cross, w_a if n > 1 else 0.0, w_c if m > 1 else 0.0], **f64)
        sums = part.sum(1)  # (B, 6), float64: the weights applied here
        if need_value:
            value = (sums[:, :3] * w).sum(-1).to(a.dtype)
        if need_beta:
            gbeta = (sums[:, 3:] * w).sum(-1).to(a.dtype) * g
    return value, ga, gc, gbeta


# ----------------------------------------------------------------------------- host functions

def _launch(own, oth, beta, p, kind, g, w_cross, w_within, *, cross, within_all, need_g, need_value, need_beta, gown):
    """One launch with ``own`` as the own cloud and the row metric (p, kind).  Returns (value, Σ ∂/∂β), each (B,) float64
    with the weights applied here (or None when not requested); gradients go to ``gown``."""
    B, n_own, d = own.shape
    n_oth = oth.shape[1]
    BI, BJ, BD, small = tile_sizes(n_own, n_oth, d)
    nt = triton.cdiv(n_own, BI)
    f64 = dict(dtype=torch.float64, device=own.device)
    val = torch.zeros((B, nt, 2), **f64) if need_value else torch.zeros(1, **f64)
    gb = torch.zeros((B, nt, 2), **f64) if need_beta else torch.zeros(1, **f64)
    if B > 0 and nt > 0:
        launcher(_energy_pairs_kernel)[(B * nt,)](
            own, oth, beta, p, g, val, gb, gown if need_g else own,
            n_own, n_oth, d, own.stride(0), own.stride(1), oth.stride(0), oth.stride(1), beta.stride(0),
            p.stride(0), g.stride(0), nt, float(w_cross), float(w_within),
            CROSS=cross, WITHIN_ALL=within_all, NEED_G=need_g, NEED_VALUE=need_value, NEED_BETA=need_beta,
            CROSS_BETA=need_beta and cross == 1, SMALL=small, D=d if small else 1,
            DP=triton.next_power_of_2(d) if small else 1, BD=BD, BI=BI, BJ=BJ,
            KIND=kind, K=p.shape[-1] if kind == 2 else 1,
        )
    # weights in float64: the energy distance is a small difference of large sums
    w = torch.tensor([w_cross if cross == 1 else 0.0, w_within], **f64)

    def weighted(t):
        return (t.sum(1) * w).sum(-1) if t.dim() == 3 else None

    return weighted(val), weighted(gb)


def energy_pairs(a, c, beta, p, weights, grad=None, *, kind=0, need_value=True, need_a=False, need_c=False,
                 need_beta=False):
    """Weighted pair sums of every row and their gradients, row metric p of ``kind`` (isotropic
    (B,), diagonal (B, d) or block (B, k, k); each row's parameters dense).

    a (B, n, d), c (B, m, d) with unit stride over d; beta, grad (B,) any stride;
    weights = (w_cross, w_a, w_c).  Returns (value (B,), ∂/∂a (B, n, d), ∂/∂c (B, m, d),
    ∂/∂β (B,)), each None when not requested; gradients are those of Σ_r grad[r]·V_r
    (grad = ones when None).
    """
    if kind == 2 and p.shape[-1] == 1:
        kind, p = 0, p[:, 0, 0]  # a 1×1 block is an isotropic p
    w_cross, w_a, w_c = (float(w) for w in weights)
    B, n, d = a.shape
    m = c.shape[1]
    g = grad if grad is not None else a.new_ones(()).expand(B)
    if split_applies(n, m, d):
        return _split_pairs(a, c, beta, p, kind, g, (w_cross, w_a, w_c), need_value, need_a, need_c, need_beta)
    ga = a.new_zeros((B, n, d)) if need_a else None
    gc = c.new_zeros((B, m, d)) if need_c else None
    vals, betas = [], []
    if need_value or need_beta or need_a:
        v, bs = _launch(a, c, beta, p, kind, g, w_cross, w_a if n > 1 else 0.0, cross=1, within_all=need_a,
                        need_g=need_a, need_value=need_value, need_beta=need_beta, gown=ga)
        vals.append(v)
        betas.append(bs)
    within_c = w_c if m > 1 else 0.0
    if need_c or (within_c != 0.0 and (need_value or need_beta)):
        v, bs = _launch(c, a, beta, p, kind, g, w_cross if need_c else 0.0, within_c, cross=2 if need_c else 0,
                        within_all=need_c, need_g=need_c, need_value=need_value, need_beta=need_beta, gown=gc)
        vals.append(v)
        betas.append(bs)
    value = sum(vals).to(a.dtype) if need_value else None
    gbeta = sum(betas).to(a.dtype) * g if need_beta else None
    return value, ga, gc, gbeta


def check_energy_canonical(op: str, a, c, beta, prec, kind: int):
    """The C++ kernels' argument contract (csrc/cpu/energy_cpu.h) as ValueErrors."""
    if a.dim() != 3:
        raise ValueError(f"{op}: first cloud must be (B, n, d), got shape {tuple(a.shape)}")
    B, _, d = a.shape
    if c.dim() != 3 or c.shape[0] != B or c.shape[2] != d:
        raise ValueError(f"{op}: second cloud must be (B={B}, m, d={d}), got shape {tuple(c.shape)}")
    if d > 1 and ((a.numel() and a.stride(2) != 1) or (c.numel() and c.stride(2) != 1)):
        raise ValueError(f"{op}: clouds must have unit stride over d")
    if beta.shape != (B,):
        raise ValueError(f"{op}: beta must be ({B},), got {tuple(beta.shape)}")
    if kind not in (0, 1, 2):
        raise ValueError(f"{op}: unknown metric kind {kind} (0 isotropic, 1 diagonal, 2 block)")
    if kind == 0 and prec.shape != (B,):
        raise ValueError(f"{op}: isotropic prec must be ({B},), got {tuple(prec.shape)}")
    if kind == 1 and prec.shape != (B, d):
        raise ValueError(f"{op}: diagonal prec must be ({B}, {d}), got {tuple(prec.shape)}")
    if kind == 2:
        k = prec.shape[-1] if prec.dim() == 3 else -1
        if prec.dim() != 3 or prec.shape[0] != B or prec.shape[1] != k or not 1 <= k <= 4 or d % k:
            raise ValueError(f"{op}: block precision must be ({B}, k, k) with k <= 4 dividing d={d}, got {tuple(prec.shape)}")
    for name, t in (("second cloud", c), ("beta", beta), ("prec", prec)):
        if t.dtype != a.dtype or t.device != a.device:
            raise ValueError(f"{op}: {name} must match the first cloud's dtype/device ({a.dtype}, {a.device}), "
                             f"got ({t.dtype}, {t.device})")


def _metric_grad(a, c, ga, gc, prec, kind):
    """∂V/∂prec of a diagonal or block metric from the point gradients (see the module docstring)."""
    centre = a[:, :1] if a.shape[1] > 0 else c[:, :1]
    za, zc = a - centre, c - centre
    if kind == 1:
        return 0.5 * ((za * ga).sum(1) + (zc * gc).sum(1)) / prec
    B, k = prec.shape[0], prec.shape[-1]

    def outer(z, gz):  # Σ over points and coordinate blocks of z gᵀ
        return z.reshape(B, -1, k).transpose(1, 2) @ gz.reshape(B, -1, k)

    S = outer(za, ga) + outer(zc, gc)
    X = torch.linalg.solve_ex(prec, S.transpose(-1, -2)).result  # P⁻¹ Sᵀ, no host sync
    return 0.25 * (X + X.transpose(-1, -2))


def energy_value(op: str, a, c, beta, prec, kind: int, weights):
    """(B,) weighted pair sums of every row (the op's forward)."""
    check_energy_canonical(op, a, c, beta, prec, kind)
    if a.shape[0] == 0:
        return a.new_zeros(0)
    return energy_pairs(a, c, beta, dense_metric_rows(prec, kind), weights, kind=kind)[0]


def energy_grads(op: str, grad, a, c, beta, prec, kind: int, weights, need_a, need_c, need_beta, need_prec,
                 want_value=False):
    """(value or None, ∂/∂a, ∂/∂c, ∂/∂β, ∂/∂prec) of Σ_r grad[r]·V_r; a gradient not requested
    is an empty tensor (the contract of etweedie::<op>_bwd)."""
    check_energy_canonical(op, a, c, beta, prec, kind)
    B = a.shape[0]
    g = grad.contiguous()
    if g.shape != (B,):
        raise ValueError(f"{op}: grad must be ({B},), got {tuple(grad.shape)}")

    def empty():  # a fresh one per output: outputs of a custom op must not alias
        return a.new_empty(0)

    if B == 0:
        value = a.new_zeros(0) if want_value else None
        return (value, a.new_zeros(a.shape) if need_a else empty(), c.new_zeros(c.shape) if need_c else empty(),
                a.new_zeros(B) if need_beta else empty(), prec.new_zeros(prec.shape) if need_prec else empty())
    if kind == 0:
        value, ga, gc, gb = energy_pairs(a, c, beta, prec, weights, g, need_value=want_value or need_prec,
                                         need_a=need_a, need_c=need_c, need_beta=need_beta)
        gp = g * beta * value / (2 * prec) if need_prec else None
    else:
        value, ga, gc, gb = energy_pairs(a, c, beta, dense_metric_rows(prec, kind), weights, g, kind=kind,
                                         need_value=want_value,
                                         need_a=need_a or need_prec, need_c=need_c or need_prec, need_beta=need_beta)
        gp = _metric_grad(a, c, ga, gc, prec, kind) if need_prec else None
    return (
        value if want_value else None,
        ga if need_a else empty(),
        gc if need_c else empty(),
        gb if need_beta else empty(),
        gp.contiguous() if need_prec else empty(),
    )

