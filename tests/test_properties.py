"""Property-based tests over every public op and every backend available here (hypothesis).

Random shapes (batch dims, N, d, zero-size batches), strides (transposed and sliced inputs),
broadcasts (a cloud shared by every query), dtypes, magnitudes from 1e-30 to 1e30, metrics of
every kind (shared or per row) and NaN/inf injection.  The property, for every draw:

    the op equals the float64 reference within |out − ref64| ≤ 2·|ref32 − ref64| + atol,
    with non-finite values exactly where the reference has them — or it raises the same
    named error (ValueError / TypeError) as the reference; never a silent wrong value.

Raw registered ops (torch.ops.etweedie.*) are fuzzed with inconsistent arguments in a child
process, so that a crash (segfault) fails the test instead of killing the run.

Examples per test: ETWEEDIE_PROPERTY_EXAMPLES (default 25; e.g. 500 for a long run).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import etweedie  # noqa: E402
from etweedie import Metric  # noqa: E402
from conftest import KERNEL_BACKENDS  # noqa: E402

EXAMPLES = int(os.environ.get("ETWEEDIE_PROPERTY_EXAMPLES", "25"))
PROFILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("ETWEEDIE_PROPERTY_RANDOM", "0") in ("", "0"),  # reproducible by default
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# CPU tensors only here: the CUDA backend is exercised by the op tests on a GPU machine.
BACKENDS = ["reference"] + [b for b in KERNEL_BACKENDS if b != "cuda"]
NAMED = (ValueError, TypeError)


# ---------------------------------------------------------------------------- input strategies


@st.composite
def layouts(draw, t: torch.Tensor) -> torch.Tensor:
    """The same values as t in a random memory layout: contiguous, reversed-dims copy
    transposed back (non-contiguous), or a slice of a wider buffer (strided)."""
    how = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "sliced" and t.numel():
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


@st.composite
def metrics(draw, d: int, batch: tuple, dtype) -> Metric | None:
    kinds = ["none", "isotropic", "diagonal", "dense"] + (["block"] if any(d % k == 0 for k in (2, 3, 4)) else [])
    kind = draw(st.sampled_from(kinds))
    shape = draw(st.sampled_from([(), batch[-1:] if batch else ()]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.sampled_from([-4, 0, 4]))  # variance scale
    if kind == "none":
        return None
    if kind == "isotropic":
        return Metric.isotropic(scale * (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype))
    if kind == "diagonal":
        var = scale * (0.5 + torch.rand(*shape, d, generator=g, dtype=torch.float64))
        return Metric.diagonal(draw(layouts(var.to(dtype))))
    k = d if kind == "dense" else draw(st.sampled_from([k for k in (2, 3, 4) if d % k == 0]))
    A = torch.randn(*shape, k, k, generator=g, dtype=torch.float64)
    S = scale * (A @ A.transpose(-1, -2) / k + 0.5 * torch.eye(k, dtype=torch.float64))
    S = draw(layouts(S.to(dtype)))
    return Metric.dense(S) if kind == "dense" else Metric.block(S)


@st.composite
def clouds(draw, dtype, magnitude, batch, n, d, shared_ok=True):
    """(*batch, n, d) values at 10^magnitude (or one shared (n, d) cloud), random layout.
    ``magnitude`` (e, t): spread 10^e about the point t·10^e in every coordinate (t = 1e3: a
    cloud far from the origin next to its spread, where whitening or centring the points
    themselves, rather than their differences, loses precision)."""
    e, t0 = magnitude
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    shared = shared_ok and draw(st.booleans())
    shape = (n, d) if shared else (*batch, n, d)
    t = ((torch.randn(shape, generator=g, dtype=torch.float64) + t0) * 10.0**e).to(dtype)
    return draw(layouts(t))


def inject(draw, t: torch.Tensor) -> torch.Tensor:
    """With some probability, one NaN or ±inf at a random position."""
    if t.numel() == 0 or not draw(st.integers(0, 5)) == 0:
        return t
    t = t.contiguous().clone()
    i = draw(st.integers(0, t.numel() - 1))
    t.view(-1)[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return t


@st.composite
def problems(draw):
    """Common draw: dtype, magnitude, batch shape, sizes, metric, β."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    magnitude = (draw(st.sampled_from([-30, -20, -8, 0, 0, 0, 8, 20, 30])), draw(st.sampled_from([0.0, 0.0, 1e3])))
    batch = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2)))
    d = draw(st.integers(1, 6))
    n = draw(st.integers(1, 5))
    metric = draw(metrics(d, batch, dtype))
    beta = draw(st.sampled_from([0.3, 1.0, 1.4, 2.0]))
    return dtype, magnitude, batch, n, d, metric, beta


# ---------------------------------------------------------------------------- the property


def _as64(v):
    if isinstance(v, torch.Tensor):
        return v.double()
    if isinstance(v, Metric):
        return Metric.trusted(v.kind, v.param.double())
    if isinstance(v, tuple):
        return tuple(_as64(a) for a in v)
    return v


def _call(fn, args, kwargs):
    try:
        return fn(*args, **kwargs), None
    except NAMED as e:
        return None, e


def _check(name, out, ref32, ref64, dtype, scale):
    """The tolerance rule, with non-finite values where the reference has them."""
    outs = out if isinstance(out, tuple) else (out,)
    r32s = ref32 if isinstance(ref32, tuple) else (ref32,)
    r64s = ref64 if isinstance(ref64, tuple) else (ref64,)
    for i, (o, r32, r64) in enumerate(zip(outs, r32s, r64s)):
        assert o.shape == r64.shape and o.dtype == dtype, f"{name}[{i}]: {o.shape}/{o.dtype} vs {r64.shape}"
        o, r32 = o.detach().double(), r32.detach().double()
        bad_ref = ~torch.isfinite(r64)
        # the reference rounded to the output dtype may overflow (an honest inf)
        rounded_bad = ~torch.isfinite(r64.to(dtype).double())
        bad_out = ~torch.isfinite(o)
        assert bool((bad_out == (bad_ref | rounded_bad)).all() or (bad_out == bad_ref).all()), (
            f"{name}[{i}]: non-finite values where the float64 reference has {int(bad_ref.sum())} "
            f"(out has {int(bad_out.sum())})"
        )
        ok = ~(bad_out | bad_ref)
        if not bool(ok.any()):
            continue
        eps = 1e-5 if dtype == torch.float32 else 1e-11
        atol = eps * max(float(r64[ok].abs().max()), scale)
        err = (o - r64)[ok].abs()
        bound = 2 * (r32 - r64)[ok].abs().nan_to_num(0.0, 0.0, 0.0) + atol
        assert bool((err <= bound).all()), (
            f"{name}[{i}]: max |out-ref64| {float(err.max()):.3e} > bound (atol {atol:.2e}); "
            f"max|ref64| {float(r64[ok].abs().max()):.3e}"
        )


def _compare(name, fn, args, kwargs, backend, dtype, scale=0.0):
    out, err = _call(fn, args, {**kwargs, "backend": backend} if backend else kwargs)
    ref64, err64 = _call(fn, _as64(args), {**kwargs, "backend": "reference"} if backend else kwargs)
    if err is not None or err64 is not None:
        # validation is shared, so both refuse (the same named error) or neither does
        assert type(err) is type(err64), f"{name}: {backend} raised {err!r}, float64 reference raised {err64!r}"
        return
    ref32, _ = _call(fn, args, {**kwargs, "backend": "reference"} if backend else kwargs)
    if ref32 is None:
        ref32 = ref64
    _check(f"{name}/{backend}", out, ref32, ref64, dtype, scale)


def _pair_scale(a, b, metric, beta) -> float:
    """Size of the pair terms ‖a_i − b_j‖_P^β that the energy ops sum (their rounding error
    scales with the terms, not with the result, which can cancel to ~0).  Pairs with a NaN or
    an infinity are left out: their rows are NaN, and the other rows keep their own scale."""
    a, b = a.double(), b.double()
    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    u = a.unsqueeze(-2) - b.unsqueeze(-3)
    if u.numel() == 0 or (metric is not None and metric.param.numel() == 0):
        return 0.0
    if metric is None:
        q = (u * u).sum(-1)
    else:
        m = Metric.trusted(metric.kind, metric.param.double())
        q = m.sq_norm(u, sample_dims=2) if not m.batch_shape else (u * u).sum(-1) * float(
            1.0 / m.param.abs().amin().clamp_min(1e-300))
    q = q[(q > 0) & torch.isfinite(q)]
    return float(q.pow(beta / 2).max()) if q.numel() else 0.0


def _log_weight_size(y, bank, metric, beta) -> float:
    """1 + the largest log-weight (1/β)‖y − x_j‖_P^β (λ = 1) among the weights that matter: each
    is rounded to ~ε of itself, which moves a self-normalized weight by that much relative, so
    the weighted sums' rounding scales with it.  A weight matters within ~17 of its query's
    smallest log-weight (e^{−17} ≈ float32's ε)."""
    y, bank = y.double(), bank.double()
    if y.numel() == 0 or bank.numel() == 0:
        return 1.0
    u = y.unsqueeze(-2) - bank
    if metric is None:
        q = (u * u).sum(-1)
    else:
        q = Metric.trusted(metric.kind, metric.param.double()).sq_norm(u, sample_dims=1)
    logw = q.clamp_min(0).pow(beta / 2) / beta
    logw = torch.where(torch.isfinite(logw), logw, torch.full_like(logw, math.inf))
    smallest = logw.amin(-1, keepdim=True)
    matter = logw[torch.isfinite(logw) & (logw <= smallest + 17.0)]
    return 1.0 + (float(matter.max()) if matter.numel() else 0.0)


def _prec_max(metric) -> float:
    """Largest precision entry, roughly (1 / smallest variance)."""
    if metric is None or metric.param.numel() == 0:
        return 1.0
    p = metric.param.detach().double()
    var = torch.diagonal(p, dim1=-2, dim2=-1) if metric.kind in ("block", "dense") else p
    return float(1.0 / var.amin())


# ---------------------------------------------------------------------------- per op


@PROFILE
@given(data=st.data(), backend=st.sampled_from(BACKENDS))
def test_et_score_and_langevin_step(data, backend):
    dtype, mag, batch, n, d, metric, beta = data.draw(problems())
    y = data.draw(clouds(dtype, mag, batch, 1, d, shared_ok=False))[..., 0, :]
    x = inject(data.draw, data.draw(clouds(dtype, mag, batch, n, d)))
    lam = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
    # the score sums terms λ P ‖u‖^{β−2} u of size ~ λ √P ‖u‖_P^{β−1}, which can cancel to ~0
    scale = lam * math.sqrt(_prec_max(metric)) * _pair_scale(y.unsqueeze(-2), x, metric, beta - 1)
    _compare("et_score", etweedie.et_score, (y, x, beta, lam, metric), {}, backend, dtype, scale)
    noise = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    step = min(max(10.0 ** (2 * mag[0]) * 1e-2, 1e-30), 1e30)
    if True:
        lscale = step * scale + (float(y.double().abs().max()) if y.numel() else 0.0)
        _compare("langevin_step", etweedie.langevin_step, (y, x, noise, step, beta, lam, metric), {}, backend, dtype,
                 lscale if math.isfinite(lscale) else 0.0)


@PROFILE
@given(data=st.data(), backend=st.sampled_from(BACKENDS), fair=st.booleans())
def test_energy_score(data, backend, fair):
    dtype, mag, batch, n, d, metric, beta = data.draw(problems())
    m = n + 1
    samples = inject(data.draw, data.draw(clouds(dtype, mag, batch, m, d)))
    target = data.draw(clouds(dtype, mag, batch, 1, d, shared_ok=False))[..., 0, :]
    scale = _pair_scale(samples, samples, metric, beta) + _pair_scale(samples, target.unsqueeze(-2), metric, beta)
    _compare("energy_score", etweedie.energy_score, (samples, target, beta, metric), {"fair": fair}, backend, dtype,
             scale)


@PROFILE
@given(data=st.data(), backend=st.sampled_from(BACKENDS), unbiased=st.booleans())
def test_energy_distance(data, backend, unbiased):
    dtype, mag, batch, n, d, metric, beta = data.draw(problems())
    a = inject(data.draw, data.draw(clouds(dtype, mag, batch, n + 1, d)))
    b = data.draw(clouds(dtype, mag, batch, data.draw(st.integers(2, 5)), d))
    scale = max(_pair_scale(a, b, metric, beta), _pair_scale(a, a, metric, beta), _pair_scale(b, b, metric, beta))
    _compare("energy_distance", etweedie.energy_distance, (a, b, beta, metric), {"unbiased": unbiased}, backend, dtype,
             4 * scale)


@PROFILE
@given(data=st.data(), backend=st.sampled_from(BACKENDS))
def test_is_score(data, backend):
    dtype, mag, batch, n, d, metric, beta = data.draw(problems())
    if metric is not None and len(metric.batch_shape):
        metric = None  # one law for the whole bank
    bank = data.draw(clouds(dtype, mag, (), 3 * n, d, shared_ok=True)).reshape(-1, d)
    y = inject(data.draw, data.draw(clouds(dtype, mag, batch, 1, d, shared_ok=False))[..., 0, :])
    # the noise scale follows the data's magnitude so that the posterior is not one-hot
    law = etweedie.GeneralizedGaussian(beta, 1.0, metric)
    out, err = _call(etweedie.is_score, (y, bank, law), {"backend": backend})
    ref64, err64 = _call(etweedie.is_score, (y.double(), bank.double(), law), {"backend": "reference"})
    if err is not None or err64 is not None:
        assert type(err) is type(err64), f"is_score: {err!r} vs {err64!r}"
        return
    ref32, _ = _call(etweedie.is_score, (y, bank, law), {"backend": "reference"})
    # score and mean against the rule, each judged by the size of what it sums, since either can
    # cancel to ~0: the score's terms λ P ‖u‖^{β−2} u (as et_score's), the mean's bank points;
    # ESS (a count) where the float32 weights agree
    yq = y.reshape(-1, y.shape[-1])
    terms = math.sqrt(_prec_max(metric)) * _pair_scale(yq, bank, metric, beta - 1)
    sens = _log_weight_size(yq, bank, metric, beta)
    _check(f"is_score/{backend}", out[0], ref32[0], ref64[0], dtype, terms * sens if math.isfinite(terms) else 0.0)
    finite_bank = bank[torch.isfinite(bank)]
    _check(f"is_score/{backend} mean", out[1], ref32[1], ref64[1], dtype,
           float(finite_bank.abs().max()) * sens if finite_bank.numel() else 0.0)
    ess_ok = torch.isfinite(ref64[2])
    assert bool((torch.isfinite(out[2]) == ess_ok).all())


@PROFILE
@given(data=st.data(), fair=st.booleans())
def test_kernel_score_and_student_t_score(data, fair):
    dtype, mag, batch, n, d, metric, _ = data.draw(problems())
    samples = inject(data.draw, data.draw(clouds(dtype, mag, batch, n + 1, d)))
    target = data.draw(clouds(dtype, mag, batch, 1, d, shared_ok=False))[..., 0, :]
    c = d / 2 + data.draw(st.sampled_from([0.5, 1.0, 3.0]))
    out, err = _call(etweedie.kernel_score, (samples, target), {"metric": metric, "c": c, "fair": fair})
    ref, err64 = _call(etweedie.kernel_score, _as64((samples, target)), {"metric": _as64(metric), "c": c, "fair": fair})
    assert type(err) is type(err64)
    if err is None:
        _check("kernel_score", out, out, ref, dtype, 1.0)
    out, err = _call(etweedie.student_t_score, (target, samples, c, metric), {})
    ref, err64 = _call(etweedie.student_t_score, _as64((target, samples, c, metric)), {})
    assert type(err) is type(err64)
    if err is None:
        _check("student_t_score", out, out, ref, dtype, 0.0)


# ---------------------------------------------------------------------------- raw ops, in a child

_FUZZ = r"""
import random, sys, torch, etweedie
ops = torch.ops.etweedie
rng = random.Random(int(sys.argv[1]))
count = int(sys.argv[2])
def t(*shape, dtype=torch.float32):
    x = torch.randn(tuple(max(s, 0) for s in shape), dtype=dtype)
    r = rng.random()
    if r < 0.15 and x.dim() >= 1 and x.shape[-1] > 1:
        return x[..., ::2]                      # strided
    if r < 0.3 and x.dim() >= 2:
        return x.transpose(-1, -2)              # non-contiguous
    if r < 0.4 and x.dim() >= 1 and x.numel():
        return x[:1].expand(*x.shape)           # stride-0 rows
    return x
def dim():
    return rng.choice([0, 1, 2, 3, 4, 5, 7, 64])
refused = ran = 0
for i in range(count):
    B, N, d = dim(), dim(), dim()
    kind = rng.choice([-1, 0, 1, 2, 3, 9])
    k = rng.choice([1, 2, 3, 4, 5])
    pshape = rng.choice([(B,), (B, d), (B, k, k), (1,), (1, d), (1, k, k), (B, d + 1), ()])
    dt = rng.choice([torch.float32, torch.float32, torch.float64])
    args = dict(y=t(B, d), x=t(B, N, d), b=t(rng.choice([B, 1, B + 1])).abs() + 0.5, l=t(B).abs() + 0.5,
                p=t(*pshape, dtype=dt).abs() + 0.5)
    calls = [
        lambda a: ops.et_score_fwd(a["y"], a["x"], a["b"], a["l"], a["p"], kind),
        lambda a: ops.langevin_step_fwd(a["y"], a["x"], t(B, d), a["b"], a["b"], a["l"], a["p"], kind),
        lambda a: ops.is_score_fwd(a["y"], a["x"].reshape(-1, a["x"].shape[-1]) if a["x"].numel() else t(0, d),
                                   rng.choice([0.5, 1.5, 3.0]), 1.0, a["p"], kind),
        lambda a: ops.energy_score_fwd(a["x"], a["y"], a["b"], a["p"], kind, rng.random() < 0.5),
        lambda a: ops.energy_score_fwd_grad(a["x"], a["y"], a["b"], a["p"], kind, True, True, True, True, True),
        lambda a: ops.energy_distance_fwd(a["x"], t(B, N + 1, d), a["b"], a["p"], kind, rng.random() < 0.5),
        lambda a: ops.et_score_bwd(t(B, d), t(B, d), a["y"], a["x"], a["b"], a["l"], a["p"], kind, t(B, d),
                                   True, True, True, True, True),
        lambda a: ops.energy_score_bwd(t(rng.choice([B, 1])), a["x"], a["y"], a["b"], a["p"], kind, False,
                                       True, True, True, True),
        lambda a: ops.energy_distance_bwd(t(rng.choice([B, 1])), a["x"], t(B, N + 1, d), a["b"], a["p"], kind, False,
                                          True, True, True, True),
    ]
    try:
        rng.choice(calls)(args)
        ran += 1
    except RuntimeError:
        refused += 1
print("done", ran, refused)
"""


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the C++ extension is not built")
def test_raw_ops_never_crash():
    """Random (mostly inconsistent) arguments to every registered op: each call returns or
    raises RuntimeError; a crash of the child process fails the test."""
    count = max(200, 8 * EXAMPLES)
    res = subprocess.run([sys.executable, "-c", _FUZZ, "12345", str(count)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, f"raw-op fuzz child died with status {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.startswith("done"), res.stdout + res.stderr[-2000:]
