"""Triton kernels of the Energy-Tweedie score (DESIGN §1) and their torch ops.

Computes exactly what the C++ op ``etweedie::et_score_fwd/bwd`` computes (csrc/cpu/
et_score_cpu.cpp), on the same canonical inputs (etweedie/ops/_rows.py):

    y (B, d) contiguous, x (B, N, d) unit stride over d (any stride over B and N, 0 = a
    broadcast cloud), beta/lam (B,) any stride, prec (B, *param) any stride over B,
    kind 0 isotropic (param ()), 1 diagonal (param (d,)), 2 block (param (k, k), k ≤ 4).
    x has y's dtype or is bfloat16/float16: draw tiles are loaded as stored and converted to y's
    dtype in registers (``tl.load(...).to(...)``), so a 16-bit cloud is read in 16 bits; sums are
    in y's dtype, and ∂L/∂x is stored in x's dtype.

Forward:  u_i = y − x_i, q_i = u_iᵀPu_i, w_i = q_i^{(β−2)/2},
          m = (1/N) Σ w_i u_i and s = −λ P m = −λ (1/N) Σ w_i P u_i.
Backward: csrc/common/et_score.h (h = −λ P g + g_m; ∂L/∂u_i = (w_i h + slope_i (h·u_i) P u_i)/N).

Work split: one program per (query row, chunk of BLOCK_D coordinates); it loops over the
draws in tiles of BLOCK_N.  q_i needs every coordinate, so with several chunks each program
recomputes the tile's q over all of d (cheap next to reading the draws) and then accumulates
only its own coordinates; with one chunk (d ≤ BLOCK_D, the common case) it reads each draw once.
P u is formed in registers: in the forward, for a block metric with k a power of two, from the
draw tile itself viewed as (BLOCK_N, BLOCK_D/k, k) and contracted with the k×k block (the draws
are loaded once); otherwise (k = 3, and the backward) from "shifted" loads: the coordinate j needs
u at j − j%k + b for b < k, loaded as a (BLOCK_N, BLOCK_D, KP) tile (KP = next power of two
≥ k; KP = 1 for isotropic and diagonal metrics).  P is never materialized and
s = −λ (1/N) Σ w_i P u_i needs no cross-chunk exchange.  Gradients of the metric (and λ) are
reduced per chunk into small partial buffers that the host sums (no atomics).
Indexing is int64 (row offsets, draw offsets); no GPU is queried at import time.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["et_score_forward", "et_score_backward", "et_score_op", "block_sizes", "define_op"]

# Largest coordinate chunk per program, and the element budget of one (BLOCK_N, BLOCK_D, KP)
# tile (registers on a GPU; tests lower _MAX_BLOCK_D to exercise several chunks).  1024 keeps
# MNIST-sized rows (d = 784) in one chunk, so each draw is read once.
_MAX_BLOCK_D = 1024
_TILE = 4096
# Programs per streaming multiprocessor the forward aims for: with fewer query rows than that,
# the draws are split into S ranges (grid axis 2), each program writing partial sums that the
# host adds.  Measured on an H200 (benchmarks/RESULTS.md, 2026-11-26): at B = 256 rows (about 2
# per SM) splitting to 8 programs per SM made the d = 784 forward slower (0.49 vs 0.37 ms: the
# partial sums and the host-side finish cost more than the extra parallelism gives), so the
# split is kept for rows too few to give every SM one program.  _SM_OVERRIDE (tests) replaces
# the device's SM count; the interpreter pretends to have 16 SMs so that small test batches
# take the split path and large ones do not.
_PROGRAMS_PER_SM = 1
_SM_OVERRIDE = None
_SM_CACHE: dict = {}


def _sm_count(device: torch.device) -> int:
    if _SM_OVERRIDE is not None:
        return _SM_OVERRIDE
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_CACHE:  # queried on first launch, never at import
        _SM_CACHE[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_CACHE[idx]


def draw_splits(B: int, nch: int, N: int, BLOCK_N: int, device: torch.device) -> tuple[int, int]:
    """(S, draws per split): S ranges of whole BLOCK_N tiles, enough for _PROGRAMS_PER_SM per SM."""
    tiles = triton.cdiv(N, BLOCK_N)
    if os.environ.get("ETWEEDIE_TRITON_SPLIT") == "0":  # A/B timing; read per launch
        return 1, N
    want = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(B * nch, 1))
    S = max(1, min(want, tiles))
    per = triton.cdiv(tiles, S) * BLOCK_N
    return triton.cdiv(N, per), per


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def define_op(name: str, fn, mutates_args=()):
    """``torch.library.triton_op`` (torch.compile traces into the Triton kernels) — or, in
    interpreter mode, an opaque ``custom_op`` with a fake: the interpreter runs kernels on
    real CPU memory, so it cannot be traced with fake tensors."""
    if interpreting():
        return torch.library.custom_op(name, fn, mutates_args=mutates_args)
    return torch.library.triton_op(name, fn, mutates_args=mutates_args)


def launcher(kernel):
    """wrap_triton(kernel) for compiled Triton; the kernel itself in interpreter mode."""
    return kernel if interpreting() else torch.library.wrap_triton(kernel)


def tile_budget() -> int:
    """Elements of one (BLOCK_N, BLOCK_D, KP) draw tile: _TILE, or ETWEEDIE_TRITON_TILE (a power of
    two in [1024, 32768]; read per launch, so gpu_check can time a larger tile — more draws in
    flight per program — against the default in one run)."""
    v = os.environ.get("ETWEEDIE_TRITON_TILE")
    if not v:
        return _TILE
    t = int(v) if v.isdigit() else 0
    if not 1024 <= t <= 32768 or t & (t - 1):
        raise ValueError(f"ETWEEDIE_TRITON_TILE must be a power of two in [1024, 32768], got {v!r}")
    return t


def block_sizes(N: int, d: int, kind: int, k: int):
    """(BLOCK_N, BLOCK_D, KP, number of coordinate chunks) for a row of N draws in d dims."""
    KP = triton.next_power_of_2(k) if kind == 2 else 1
    BLOCK_D = max(1, min(triton.next_power_of_2(d), _MAX_BLOCK_D))
    BLOCK_N = max(1, min(triton.next_power_of_2(max(N, 1)), tile_budget() // (BLOCK_D * KP)))
    return BLOCK_N, BLOCK_D, KP, triton.cdiv(d, BLOCK_D)


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _residual_weight(q, beta):
    """q^{(β−2)/2}; 0 at q = 0 (a coincident draw), except 1 for β = 2 (csrc/common/et_score.h)."""
    pos = q > 0
    q_safe = tl.where(pos, q, 1.0)
    w = tl.exp((beta - 2.0) * 0.5 * tl.log(q_safe))
    return tl.where(pos, w, tl.where(beta == 2.0, 1.0, 0.0))


@triton.jit
def _residual_weight_slope(q, w, beta):
    """(β−2) q^{(β−4)/2} = (β−2) w / q; 0 at q = 0."""
    pos = q > 0
    return tl.where(pos, (beta - 2.0) * w / tl.where(pos, q, 1.0), 0.0)


@triton.jit
def _law_weight(q, beta, LAW: tl.constexpr):
    """The draw weight of the score the kernels compute (LAW): q^{(β−2)/2} for the Energy-Tweedie
    score (0), 1/(1 + q) for the Student-t score (1; csrc/common/student_t_score.h)."""
    if LAW == 1:
        return 1.0 / (1.0 + q)
    else:
        return _residual_weight(q, beta)


@triton.jit
def _law_weight_slope(q, w, beta, LAW: tl.constexpr):
    """The backward's per-draw slope: _residual_weight_slope, or −2 w² for the Student-t law."""
    if LAW == 1:
        return -2.0 * w * w
    else:
        return _residual_weight_slope(q, w, beta)


@triton.jit
def _law_scale(lam, LAW: tl.constexpr):
    """The factor in front of P m: −λ, or −2c (c passed as λ)."""
    if LAW == 1:
        return -2.0 * lam
    else:
        return -lam


@triton.jit
def _near_q(dt: tl.constexpr):
    """The smallest squared norm of a distinct draw the kernels compute accurately, forward and
    backward (q_in_range, csrc/common/et_score.h): 2^-500 in float64, 2^-62 in float32.  (A float
    literal would be a float32 constant: 2^-500 is built from exact float64 products.)"""
    if dt == tl.float64:
        t = tl.full([], 2.0**-100, tl.float64)
        return t * t * t * t * t
    else:
        return tl.full([], 2.0**-62, tl.float32)


@triton.jit
def _far_q(dt: tl.constexpr):
    """The largest squared norm the kernels compute accurately, both laws (q_in_range): 2^510 in
    float64, 2^62 in float32 — beyond it the backward's slope, of size q^-2, is subnormal."""
    if dt == tl.float64:
        t = tl.full([], 2.0**102, tl.float64)
        return t * t * t * t * t
    else:
        return tl.full([], 2.0**62, tl.float32)


@triton.jit
def _half_log(q):
    pos = q > 0
    return tl.where(pos, 0.5 * tl.log(tl.where(pos, q, 1.0)), 0.0)


@triton.jit
def _widen(v, dt: tl.constexpr):
    """Draws loaded as stored, in the compute dtype dt; 16-bit ones through float32 (exact), the
    one conversion from bfloat16 every Triton target (and the interpreter) implements."""
    if v.dtype.is_bf16() or v.dtype.is_fp16():
        return v.to(tl.float32).to(dt)
    return v.to(dt)


@triton.jit
def _narrow(v, dt: tl.constexpr):
    """A gradient of the draws in their dtype dt (16-bit: through float32, so a float64 value is
    rounded twice, to float32 and then to 16 bits)."""
    if dt.is_bf16() or dt.is_fp16():
        return v.to(tl.float32).to(dt)
    return v.to(dt)


@triton.jit
def _shift_cols(cols, kk, K: tl.constexpr, KIND: tl.constexpr):
    """(BLOCK_D, KP) column indices j − j%k + b feeding (P v)_j (block); j itself otherwise."""
    if KIND == 2:
        return (cols // K * K)[:, None] + kk[None, :]
    else:
        return cols[:, None] + kk[None, :] * 0


@triton.jit
def _prec_coeffs(p_row, cols, kk, d, K: tl.constexpr, KIND: tl.constexpr):
    """(BLOCK_D, KP) coefficients with (P v)_j = Σ_b coeff[j, b] · v[shift(j, b)]."""
    if KIND == 0:
        return tl.load(p_row + cols[:, None] * 0 + kk[None, :] * 0)
    elif KIND == 1:
        return tl.load(p_row + cols[:, None] + kk[None, :] * 0, mask=(cols < d)[:, None], other=0.0)
    else:
        ok = (cols < d)[:, None] & (kk < K)[None, :]
        return tl.load(p_row + (cols % K * K)[:, None] + kk[None, :], mask=ok, other=0.0)


@triton.jit
def _prec_vec(v_row, p_row, cols, kk, d, K: tl.constexpr, KIND: tl.constexpr):
    """(P v)[cols] for one row vector v in global memory; also returns the shifted v (BLOCK_D, KP)."""
    sc = _shift_cols(cols, kk, K, KIND)
    ok = (cols < d)[:, None] & (kk < K)[None, :] & (sc < d)
    v3 = tl.load(v_row + sc, mask=ok, other=0.0)
    coeff = _prec_coeffs(p_row, cols, kk, d, K, KIND)
    return tl.sum(coeff * v3, axis=1), v3


@triton.jit
def _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K: tl.constexpr, KIND: tl.constexpr):
    """u = y − x_n (BLOCK_N, BLOCK_D), P u, and the shifted u (BLOCK_N, BLOCK_D, KP); 0 where masked."""
    mask_d = cols < d
    mask = mask_n[:, None] & mask_d[None, :]
    yv = tl.load(y_row + cols, mask=mask_d, other=0.0)
    # 16-bit draws are widened to y's dtype as they are loaded (the dtype rule: etweedie/ops/_args.py)
    xv = _widen(tl.load(x_row + offs_n[:, None] * sxn + cols[None, :], mask=mask, other=0.0), yv.dtype)
    u = tl.where(mask, yv[None, :] - xv, 0.0)
    if KIND == 2:
        sc = _shift_cols(cols, kk, K, KIND)
        ok2 = mask_d[:, None] & (kk < K)[None, :]
        ok3 = mask_n[:, None, None] & ok2[None, :, :]
        ys = tl.load(y_row + sc, mask=ok2, other=0.0)
        xs = _widen(tl.load(x_row + offs_n[:, None, None] * sxn + sc[None, :, :], mask=ok3, other=0.0), ys.dtype)
        u3 = tl.where(ok3, ys[None, :, :] - xs, 0.0)
        coeff = _prec_coeffs(p_row, cols, kk, d, K, KIND)
        pu = tl.sum(coeff[None, :, :] * u3, axis=2)
    else:
        u3 = u[:, :, None] + kk[None, None, :] * 0.0
        coeff = _prec_coeffs(p_row, cols, kk, d, K, KIND)
        pu = u * tl.sum(coeff, axis=1)[None, :]
    return u, pu, u3


@triton.jit
def _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K: tl.constexpr, KIND: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """u = y − x_n and P u (BLOCK_N, BLOCK_D), 0 where masked, for the forward.

    IN_REGISTERS (a block metric with k a power of two): P u is formed from u itself, viewed as
    (BLOCK_N, BLOCK_D/k, k) and contracted with the k×k block; the draws are loaded once.  Otherwise
    (k = 3, isotropic, diagonal) through _residual_tile, whose block path loads the draws a second
    time at the shifted columns."""
    if IN_REGISTERS:
        mask_d = cols < d
        mask = mask_n[:, None] & mask_d[None, :]
        yv = tl.load(y_row + cols, mask=mask_d, other=0.0)
        xv = _widen(tl.load(x_row + offs_n[:, None] * sxn + cols[None, :], mask=mask, other=0.0), yv.dtype)
        u = tl.where(mask, yv[None, :] - xv, 0.0)
        a = tl.arange(0, K)
        pk = tl.load(p_row + a[:, None] * K + a[None, :])  # (k, k), row-major
        u3 = tl.reshape(u, (BLOCK_N, BLOCK_D // K, K))
        pu3 = tl.sum(u3[:, :, None, :] * pk[None, None, :, :], axis=3)
        return u, tl.reshape(pu3, (BLOCK_N, BLOCK_D))
    else:
        u, pu, _u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND)
        return u, pu


# ----------------------------------------------------------------------------- forward

# N is read as a runtime value; without do_not_specialize, compiled Triton would turn N == 1 into
# a Python constant.  1/N is formed as (0-d zeros + N), which works whether N arrives as a runtime
# int32 or as a plain int (torch.compile's mutation analysis re-parses the kernel with its ints as
# constants: N.to(dtype) failed there and every input was then treated as mutated).
@triton.jit(do_not_specialize=["N"])
def _et_score_forward_kernel(
    y_ptr, x_ptr, beta_ptr, lam_ptr, prec_ptr, noise_ptr, step_ptr, out_ptr, m_ptr, ws_ptr,
    N, d, sxb, sxn, sb, sl, sp, sa, n_per, nsplit,
    KIND: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr, LANGEVIN: tl.constexpr,
    SPLIT: tl.constexpr, IN_REGISTERS: tl.constexpr, LAW: tl.constexpr,
):
    """out = s (or, with LANGEVIN, y + α s + sqrt(2α) ξ) and m for one row's coordinate chunk;
    LAW 1: the Student-t score (c passed as λ, β unused).

    With SPLIT, program (row, chunk, r) covers draws [r·n_per, (r+1)·n_per) only and writes its
    sums Σ w u and Σ w P u to ws[row, r, 0/1, cols]; the host adds the ranges and finishes."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    rng = tl.program_id(2).to(tl.int64)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    kk = tl.arange(0, KP)
    y_row = y_ptr + row * d
    x_row = x_ptr + row * sxb
    p_row = prec_ptr + row * sp
    beta = tl.load(beta_ptr + row * sb)
    lam = tl.load(lam_ptr + row * sl)
    acc_u = tl.zeros([BLOCK_D], dtype=y_ptr.dtype.element_ty)
    acc_pu = tl.zeros([BLOCK_D], dtype=y_ptr.dtype.element_ty)
    # a distinct draw nearer to y than the accurate range of q (Energy-Tweedie law only; 1/(1 + q)
    # needs no care there), or farther than it (both laws: the backward's slope would be
    # subnormal), flags the row NaN, as the C++ kernels do: the op then recomputes it where it
    # reads values (CPU tensors, debug checks) and returns the NaN row on a GPU otherwise
    near = tl.zeros([BLOCK_N], dtype=tl.int32)
    q_min = _near_q(y_ptr.dtype.element_ty)
    q_max = _far_q(y_ptr.dtype.element_ty)
    n_lo = rng * n_per
    n_hi = tl.minimum(n_lo + n_per, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = offs_n < n_hi
        if ONE_CHUNK:
            u, pu = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                 IN_REGISTERS)
            q = tl.sum(u * pu, axis=1)
            if LAW == 0:
                u_max = tl.max(tl.abs(u), axis=1)
        else:
            q = tl.zeros([BLOCK_N], dtype=y_ptr.dtype.element_ty)
            u_max = tl.zeros([BLOCK_N], dtype=y_ptr.dtype.element_ty)
            for c0 in range(0, d, BLOCK_D):
                cc = c0 + tl.arange(0, BLOCK_D)
                uc, puc = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cc, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                       IN_REGISTERS)
                q += tl.sum(uc * puc, axis=1)
                if LAW == 0:
                    u_max = tl.maximum(u_max, tl.max(tl.abs(uc), axis=1))
            u, pu = _residual_pu(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND, BLOCK_N, BLOCK_D,
                                 IN_REGISTERS)
        if LAW == 0:
            near = tl.maximum(near, (mask_n & (((q < q_min) & (u_max > 0)) | (q > q_max))).to(tl.int32))
        else:
            near = tl.maximum(near, (mask_n & (q > q_max)).to(tl.int32))
        w = tl.where(mask_n, _law_weight(q, beta, LAW), 0.0)
        acc_u += tl.sum(w[:, None] * u, axis=0)
        acc_pu += tl.sum(w[:, None] * pu, axis=0)
    flagged = tl.max(near, axis=0) > 0
    nan = tl.full([BLOCK_D], float("nan"), y_ptr.dtype.element_ty)
    acc_u = tl.where(flagged, nan, acc_u)
    acc_pu = tl.where(flagged, nan, acc_pu)
    mask_d = cols < d
    if SPLIT:
        base = ws_ptr + (row * nsplit + rng) * 2 * d
        tl.store(base + cols, acc_u, mask=mask_d)
        tl.store(base + d + cols, acc_pu, mask=mask_d)
        return
    inv_n = 1.0 / (tl.zeros([], y_ptr.dtype.element_ty) + N)
    tl.store(m_ptr + row * d + cols, acc_u * inv_n, mask=mask_d)
    s = _law_scale(lam, LAW) * acc_pu * inv_n
    if LANGEVIN:
        alpha = tl.load(step_ptr + row * sa)
        yv = tl.load(y_row + cols, mask=mask_d, other=0.0)
        xi = tl.load(noise_ptr + row * d + cols, mask=mask_d, other=0.0)
        tl.store(out_ptr + row * d + cols, tl.where(flagged, nan, yv + alpha * s + tl.sqrt(2.0 * alpha) * xi), mask=mask_d)
    else:
        tl.store(out_ptr + row * d + cols, s, mask=mask_d)


def _block_k(prec: torch.Tensor, kind: int) -> int:
    return prec.shape[-1] if kind == 2 else 1


def check_draws_dtype(op: str, y, x) -> None:
    """x in y's dtype or bfloat16/float16 (loaded as stored, widened in the kernel), on y's device."""
    if (x.dtype != y.dtype and x.dtype not in (torch.bfloat16, torch.float16)) or x.device != y.device:
        raise ValueError(f"{op}: x must have y's dtype {y.dtype} or be bfloat16 or float16, on y's device {y.device}; "
                         f"got ({x.dtype}, {x.device})")


def check_canonical(op: str, y, x, beta, lam, prec, kind: int):
    """The C++ kernels' argument contract (csrc/cpu/et_score_cpu.cpp), as ValueErrors; returns
    prec with its parameter dims contiguous (a shared metric keeps stride 0 over rows)."""
    if y.dim() != 2 or not y.is_contiguous():
        raise ValueError(f"{op}: y must be contiguous (B, d), got shape {tuple(y.shape)}")
    B, d = y.shape
    if x.dim() != 3 or x.shape[0] != B or x.shape[2] != d or (d > 1 and x.numel() and x.stride(2) != 1):
        raise ValueError(f"{op}: x must be (B={B}, N, d={d}) with unit stride over d, got {tuple(x.shape)}")
    if beta.shape != (B,) or lam.shape != (B,):
        raise ValueError(f"{op}: beta and lam must be ({B},), got {tuple(beta.shape)} and {tuple(lam.shape)}")
    if kind not in (0, 1, 2):
        raise ValueError(f"{op}: unknown metric kind {kind} (0 isotropic, 1 diagonal, 2 block)")
    core = {0: (), 1: (d,)}.get(kind)
    if kind == 2:
        k = prec.shape[-1] if prec.dim() == 3 else -1
        if prec.dim() != 3 or prec.shape[1] != k or not 1 <= k <= 4 or d % k:
            raise ValueError(f"{op}: block precision must be (B, k, k) with k <= 4 dividing d={d}, got {tuple(prec.shape)}")
        core = (k, k)
    if prec.shape != (B, *core):
        raise ValueError(f"{op}: prec must be {(B, *core)} for metric kind {kind}, got {tuple(prec.shape)}")
    check_draws_dtype(op, y, x)
    for name, t in (("beta", beta), ("lam", lam), ("prec", prec)):
        if t.dtype != y.dtype or t.device != y.device:
            raise ValueError(f"{op}: {name} must match y's dtype/device ({y.dtype}, {y.device}), got ({t.dtype}, {t.device})")
    return dense_metric_rows(prec, kind)


def dense_metric_rows(prec, kind: int):
    """prec with each row's parameters dense, as the kernels index them from the row's start (a
    shared metric keeps stride 0 over rows)."""
    if kind != 0 and prec.shape[0] > 0 and not prec[0].is_contiguous():
        prec = prec[:1].contiguous().expand_as(prec) if prec.stride(0) == 0 else prec.contiguous()
    return prec


def _block_in_registers(kind: int, KP: int, k: int, BLOCK_D: int) -> bool:
    """Whether the forward applies a block metric to the draws' own registers (_residual_pu): k a
    power of two and every coordinate chunk made of whole k×k blocks;
    ETWEEDIE_TRITON_BLOCK_IN_REGISTERS=0 turns it off (A/B timing in gpu_check)."""
    return (kind == 2 and k == KP and BLOCK_D % k == 0
            and os.environ.get("ETWEEDIE_TRITON_BLOCK_IN_REGISTERS", "1") != "0")


def _launch_forward(y, x, beta, lam, prec, kind, noise=None, step=None, law=0, op="et_score"):
    """(out, m) of the forward kernel on checked canonical arguments; law 1: the Student-t score
    (kernels/student_t_score.py, c passed as beta and lam)."""
    B, d = y.shape
    N = x.shape[1]
    out = torch.empty_like(y)
    m = torch.empty_like(y)
    if B == 0 or d == 0:
        return out, m
    if N == 0:
        raise ValueError(f"{op}: need at least one posterior draw (N >= 1)")
    BLOCK_N, BLOCK_D, KP, nch = block_sizes(N, d, kind, _block_k(prec, kind))
    langevin = noise is not None
    S, per = draw_splits(B, nch, N, BLOCK_N, y.device)
    ws = y.new_empty((B, S, 2, d)) if S > 1 else out  # partial sums (B·S·2·d: never B·N·d)
    launcher(_et_score_forward_kernel)[(B, nch, S)](
        y, x, beta, lam, prec, noise if langevin else y, step if langevin else beta, out, m, ws,
        N, d, x.stride(0), x.stride(1), beta.stride(0), lam.stride(0), prec.stride(0),
        step.stride(0) if langevin else 0, per, S,
        KIND=kind, K=_block_k(prec, kind), KP=KP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        ONE_CHUNK=nch == 1, LANGEVIN=langevin, SPLIT=S > 1, IN_REGISTERS=_block_in_registers(kind, KP, _block_k(prec, kind), BLOCK_D),
        LAW=law, num_warps=8 if BLOCK_D * BLOCK_N * KP >= 4096 else 4,
    )
    if S > 1:
        sums = ws.sum(1) / N  # (B, 2, d): m and P m
        m = sums[:, 0].contiguous()
        s = (-2.0 if law == 1 else -1.0) * lam[:, None] * sums[:, 1]
        out = y + step[:, None] * s + torch.sqrt(2 * step[:, None]) * noise if langevin else s
    return out, m


def et_score_forward(y, x, beta, lam, prec, kind: int):
    """(s, m), both (B, d): the score −λ P m and m = (1/N) Σ_i w_i (y − x_i) (saved for backward).

    Canonical tensors as in the module docstring, float32 or float64, on a CUDA device (or CPU
    under TRITON_INTERPRET=1).
    """
    prec = check_canonical("et_score", y, x, beta, lam, prec, kind)
    return _launch_forward(y, x, beta, lam, prec, kind)


# ----------------------------------------------------------------------------- backward

@triton.jit(do_not_specialize=["N"])
def _et_score_backward_kernel(
    g_ptr, gm_ptr, y_ptr, x_ptr, beta_ptr, lam_ptr, prec_ptr, m_ptr,
    gy_ptr, gx_ptr, gb_ptr, gl_ptr, gp_ptr,
    N, d, sxb, sxn, sb, sl, sp, nchunks,
    KIND: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr,
    NEED_X: tl.constexpr, NEED_BETA: tl.constexpr, NEED_LAM: tl.constexpr, NEED_PREC: tl.constexpr,
    LAW: tl.constexpr,
):
    """Gradients for one row's coordinate chunk.  Writes gy[row, chunk], gx[row, :, chunk],
    gb[row] (chunk 0), gl[row, chunk] and the metric gradient's partial for this chunk:
    gp[row, chunk] (isotropic), gp[row, cols] (diagonal), gp[row, chunk, k, k] (block).
    LAW 1: the Student-t score's (c as λ: gl receives ∂L/∂c; no β)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < d
    kk = tl.arange(0, KP)
    y_row = y_ptr + row * d
    x_row = x_ptr + row * sxb
    p_row = prec_ptr + row * sp
    beta = tl.load(beta_ptr + row * sb)
    lam = tl.load(lam_ptr + row * sl)
    dt = y_ptr.dtype.element_ty
    scale = _law_scale(lam, LAW)  # −λ, or −2c
    # h = scale · P g + g_m: the upstream gradient on m
    pg, _g3 = _prec_vec(g_ptr + row * d, p_row, cols, kk, d, K, KIND)
    h = scale * pg + tl.load(gm_ptr + row * d + cols, mask=mask_d, other=0.0)
    inv_n = 1.0 / (tl.zeros([], y_ptr.dtype.element_ty) + N)
    acc_gy = tl.zeros([BLOCK_D], dtype=dt)
    acc_outer = tl.zeros([BLOCK_D, KP], dtype=dt)
    acc_beta = tl.zeros([BLOCK_N], dtype=dt)
    # Student-t with an isotropic P = p I: ∂L/∂p = ((1/N) Σ_i w_i² (h·u_i) − g_m·m) / p, the sum
    # below without its cancellation (csrc/cpu/student_t_score_cpu.cpp states why); Σ w² (h·u) is
    # the row's, added by chunk 0, and each chunk adds its part of g_m·m
    acc_w2hu = tl.zeros([BLOCK_N], dtype=dt)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = offs_n < N
        if ONE_CHUNK:
            u, pu, u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND)
            q = tl.sum(u * pu, axis=1)
            hu = tl.sum(h[None, :] * u, axis=1)
        else:
            q = tl.zeros([BLOCK_N], dtype=dt)
            hu = tl.zeros([BLOCK_N], dtype=dt)
            for c0 in range(0, d, BLOCK_D):
                cc = c0 + tl.arange(0, BLOCK_D)
                uc, puc, _u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cc, kk, d, K, KIND)
                pgc, _gc = _prec_vec(g_ptr + row * d, p_row, cc, kk, d, K, KIND)
                hc = scale * pgc + tl.load(gm_ptr + row * d + cc, mask=cc < d, other=0.0)
                q += tl.sum(uc * puc, axis=1)
                hu += tl.sum(hc[None, :] * uc, axis=1)
            u, pu, u3 = _residual_tile(y_row, x_row, p_row, offs_n, mask_n, sxn, cols, kk, d, K, KIND)
        w = tl.where(mask_n, _law_weight(q, beta, LAW), 0.0)
        c = tl.where(mask_n, _law_weight_slope(q, w, beta, LAW) * hu, 0.0)
        gu = (w[:, None] * h[None, :] + c[:, None] * pu) * inv_n
        acc_gy += tl.sum(gu, axis=0)
        if NEED_X:
            gx_off = (row * N + offs_n)[:, None] * d + cols[None, :]
            # in x's dtype: computed in y's, rounded once here
            tl.store(gx_ptr + gx_off, _narrow(-gu, gx_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
        if NEED_BETA:
            acc_beta += hu * w * _half_log(q)
        if NEED_PREC:
            if LAW == 1 and KIND == 0:
                acc_w2hu += w * w * hu
            else:
                acc_outer += tl.sum((0.5 * inv_n) * c[:, None, None] * u[:, :, None] * u3, axis=0)
    tl.store(gy_ptr + row * d + cols, acc_gy, mask=mask_d)
    if NEED_BETA:
        if chunk == 0:
            tl.store(gb_ptr + row, tl.sum(acc_beta, axis=0) * inv_n)
    if NEED_LAM or NEED_PREC:
        gv = tl.load(g_ptr + row * d + cols, mask=mask_d, other=0.0)
        pm, m3 = _prec_vec(m_ptr + row * d, p_row, cols, kk, d, K, KIND)
        if NEED_LAM:
            # g·s/λ = −g·Pm (Student-t: g·s/c = −2 g·Pm)
            tl.store(gl_ptr + row * nchunks + chunk, (-2.0 if LAW == 1 else -1.0) * tl.sum(gv * pm, axis=0))
        if NEED_PREC and LAW == 1 and KIND == 0:
            gmv = tl.load(gm_ptr + row * d + cols, mask=mask_d, other=0.0)
            mv = tl.load(m_ptr + row * d + cols, mask=mask_d, other=0.0)
            part = -tl.sum(gmv * mv, axis=0)
            if chunk == 0:
                part += tl.sum(acc_w2hu, axis=0) * inv_n
            tl.store(gp_ptr + row * nchunks + chunk, part / tl.load(p_row))
        elif NEED_PREC:
            acc_outer += scale * gv[:, None] * m3  # −λ g mᵀ (−2c g mᵀ)
            if KIND == 0:
                tl.store(gp_ptr + row * nchunks + chunk, tl.sum(tl.sum(acc_outer, axis=1), axis=0))
            elif KIND == 1:
                tl.store(gp_ptr + row * d + cols, tl.sum(acc_outer, axis=1), mask=mask_d)
            else:
                base = gp_ptr + (row * nchunks + chunk) * (K * K)
                for a in tl.static_range(K):
                    sel = ((cols % K) == a) & mask_d
                    entry = tl.sum(tl.where(sel[:, None], acc_outer, 0.0), axis=0)  # (KP,) over b
                    tl.store(base + a * K + kk, entry, mask=kk < K)


def et_score_backward(grad, grad_m, y, x, beta, lam, prec, kind: int, m,
                      need_y=True, need_x=True, need_beta=True, need_lam=True, need_prec=True):
    """(grad_y (B, d), grad_x (B, N, d), grad_beta (B,), grad_lam (B,), grad_prec (B, *param));
    a gradient not requested is an empty tensor (the contract of etweedie::et_score_bwd)."""
    prec_c = check_canonical("et_score_bwd", y, x, beta, lam, prec, kind)
    return launch_backward(grad, grad_m, y, x, beta, lam, prec_c, prec.shape, kind, m,
                           need_y, need_x, need_beta, need_lam, need_prec)


def launch_backward(grad, grad_m, y, x, beta, lam, prec, prec_shape, kind: int, m,
                    need_y, need_x, need_beta, need_lam, need_prec, law=0):
    """The backward kernel on checked canonical arguments (``prec_shape``: the metric gradient's
    shape); law 1: the Student-t score's (kernels/student_t_score.py: c passed as beta and lam,
    its gradient returned as grad_lam, need_beta False)."""
    B, d = y.shape
    N = x.shape[1]
    g, gm, mc = grad.contiguous(), grad_m.contiguous(), m.contiguous()

    def empty():  # a fresh one per output: outputs of a custom op must not alias
        return y.new_empty(0)

    gy = torch.zeros_like(y)
    gx = x.new_empty((B, N, d)) if need_x else empty()  # x's dtype (16-bit draws: rounded once)
    gb = y.new_zeros(B) if need_beta else empty()
    gl, gp = empty(), empty()
    if B == 0 or d == 0 or N == 0:
        gl = y.new_zeros(B) if need_lam else empty()
        gp = y.new_zeros(prec_shape) if need_prec else empty()
        if need_x:
            gx.zero_()
        return (gy if need_y else empty()), gx, gb, gl, gp
    k = _block_k(prec, kind)
    BLOCK_N, BLOCK_D, KP, nch = block_sizes(N, d, kind, k)
    gl_part = y.new_zeros((B, nch)) if need_lam else empty()
    if need_prec:
        gp_part = {0: lambda: y.new_zeros((B, nch)), 1: lambda: y.new_zeros((B, d)),
                   2: lambda: y.new_zeros((B, nch, k, k))}[kind]()
    else:
        gp_part = empty()
    launcher(_et_score_backward_kernel)[(B, nch)](
        g, gm, y, x, beta, lam, prec, mc, gy, gx if need_x else gy, gb if need_beta else gy,
        gl_part if need_lam else gy, gp_part if need_prec else gy,
        N, d, x.stride(0), x.stride(1), beta.stride(0), lam.stride(0), prec.stride(0), nch,
        KIND=kind, K=k, KP=KP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ONE_CHUNK=nch == 1,
        NEED_X=need_x, NEED_BETA=need_beta, NEED_LAM=need_lam, NEED_PREC=need_prec, LAW=law,
        num_warps=8 if BLOCK_D * BLOCK_N * KP >= 4096 else 4,
    )
    if need_lam:
        gl = gl_part.sum(1)
    if need_prec:
        gp = gp_part if kind == 1 else gp_part.sum(1)
    return (gy if need_y else empty()), gx, gb, gl, gp


# ----------------------------------------------------------------------------- torch ops

def _fwd_impl(y: torch.Tensor, x: torch.Tensor, beta: torch.Tensor, lam: torch.Tensor, prec: torch.Tensor,
              kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    return et_score_forward(y, x, beta, lam, prec, kind)


def _bwd_impl(grad: torch.Tensor, grad_m: torch.Tensor, y: torch.Tensor, x: torch.Tensor, beta: torch.Tensor,
              lam: torch.Tensor, prec: torch.Tensor, kind: int, m: torch.Tensor, need_y: bool, need_x: bool,
              need_beta: bool, need_lam: bool, need_prec: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = et_score_backward(grad, grad_m, y, x, beta, lam, prec, kind, m, need_y, need_x, need_beta, need_lam, need_prec)
    # custom ops may not return views of their inputs
    return tuple(o.clone() if o._base is not None else o for o in outs)


et_score_fwd_op = define_op("etweedie_triton::et_score_fwd", _fwd_impl)
et_score_bwd_op = define_op("etweedie_triton::et_score_bwd", _bwd_impl)


def et_score_op(y, x, beta, lam, prec, kind: int):
    """The differentiable op ``etweedie_triton::et_score_fwd`` -> (s, m)."""
    return et_score_fwd_op(y, x, beta, lam, prec, kind)


def _register() -> None:
    # Same fake and autograd rules as the C++ op (etweedie/rules/et_score.py), with the Triton
    # backward kernel.
    from etweedie.rules.et_score import autograd_rules, fake_bwd, fake_fwd

    if interpreting():
        et_score_fwd_op.register_fake(fake_fwd)
        et_score_bwd_op.register_fake(fake_bwd)
    setup_context, backward = autograd_rules(et_score_bwd_op)
    et_score_fwd_op.register_autograd(backward, setup_context=setup_context)


_register()
