"""Noise laws and geometry at the edges: extreme magnitudes, β near 0, d = 784, exact constants.

References are hand-written: float64 formulas evaluated on the float32-rounded inputs, and
mpmath (50 digits) for the lgamma-based constants.  Statistical checks use fixed seeds.
"""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from etweedie.geometry import Metric, scale_constant, shape_matrix
from etweedie.noise import GeneralizedGaussian, NoiseParams, StudentT

mpmath = pytest.importorskip("mpmath")
mpmath.mp.dps = 50

F64 = torch.float64
S32 = torch.tensor([[1.3, 0.4], [0.4, 0.7]])  # a float32 block


def fixed(seed):
    return torch.Generator().manual_seed(seed)


def mp(x):
    """A float (or 0-d tensor) as an exact mpmath number."""
    return mpmath.mpf(float(x))


def assert_rel(got, want, rtol, what):
    got, want = float(got), float(want)
    assert math.isfinite(got) and abs(got - want) <= rtol * abs(want), f"{what}: got {got!r}, want {want!r}"


# ------------------------------------------------------------------ extreme |u| in float32
def hand_gg(u, beta, lam, P):
    """(potential, score) of the generalized Gaussian in float64, by the formula of DESIGN §1."""
    u = u.double()
    pu = u @ P.T
    norm = (u * pu).sum(-1).sqrt()
    return (lam / beta) * norm**beta, -lam * norm[..., None] ** (beta - 2) * pu


def float32_metrics():
    yield None, torch.eye(4, dtype=F64)
    yield Metric.isotropic(0.5), torch.eye(4, dtype=F64) / float(torch.tensor(0.5))
    yield Metric.block(S32), torch.linalg.inv(torch.block_diag(S32, S32).double())


@pytest.mark.parametrize("beta", [0.5, 1.0, 1.4, 2.0])
def test_gg_score_and_potential_at_extreme_magnitudes_float32(beta):
    """‖u‖²_P overflowed float32 from |u| ≈ 2e19 on (potential inf, score 0 where both are
    finite) and underflowed below 1e-19 (score 0 at u ≠ 0: for β = 1 its size is λ)."""
    lam = 1.7
    direction = torch.tensor([0.6, -0.3, 0.5, 0.2])
    b, l = float(torch.tensor(beta)), float(torch.tensor(lam))  # the float32-rounded parameters
    big = torch.finfo(torch.float32).max
    for metric, P in float32_metrics():
        law = GeneralizedGaussian(beta, lam, metric, dim=4)
        for mag in (1e-30, 1e-20, 1e-5, 1.0, 1e20, 1e30):
            u = (mag * direction).float()
            want_pot, want_score = hand_gg(u, b, l, P)
            pot, score = law.potential(u), law.score(u)
            what = f"beta={beta}, |u|={mag:g}, metric={metric}"
            if want_score.abs().max() < big:
                torch.testing.assert_close(score.double(), want_score, rtol=2e-5, atol=2e-5 * float(want_score.abs().max()),
                                           msg=lambda m: f"score, {what}: {m}")
            if 1e-37 < want_pot < big:
                assert_rel(pot, want_pot, 2e-5, f"potential, {what}")
            elif want_pot >= big:
                assert pot == math.inf, what


def test_student_t_at_extreme_magnitudes_float32():
    """log(1 + ‖u‖²_P) read inf from |u| ≈ 2e19 on (the potential is ≈ 2c log ‖u‖, finite)."""
    direction = torch.tensor([0.6, -0.3, 0.5, 0.2])
    c = 3.5
    for metric, P in float32_metrics():
        law = StudentT(c, metric, dim=4)
        for mag in (1e-30, 1e-5, 1.0, 1e20, 1e30):
            u = (mag * direction).float()
            ud = u.double()
            pu = ud @ P.T
            q = mpmath.mpf(0)
            for a, b in zip(ud.tolist(), pu.tolist()):
                q += mp(a) * mp(b)
            want_pot = float(c * mpmath.log1p(q))
            want_score = -2 * c * pu / (1 + float(q))
            what = f"|u|={mag:g}, metric={metric}"
            if want_pot > 1e-37:
                assert_rel(law.potential(u), want_pot, 2e-6, f"potential, {what}")
            torch.testing.assert_close(law.score(u).double(), want_score, rtol=2e-5, atol=2e-5 * float(want_score.abs().max()),
                                       msg=lambda m: f"score, {what}: {m}")


@pytest.mark.parametrize("make", [lambda: GeneralizedGaussian(0.7, 1.3, Metric.block(S32), dim=4),
                                  lambda: StudentT(3.5, Metric.block(S32), dim=4)])
def test_nan_in_nan_out_inf_in_inf_out(make):
    """Documented: a NaN coordinate gives NaN potential, log_prob and score (it is not the
    mode); an infinite one an infinite potential; u = 0 gives a finite log_prob and score 0."""
    law = make()
    u = torch.tensor([[float("nan"), 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0, 0.0]])
    pot, lp, score = law.potential(u), law.log_prob(u), law.score(u)
    assert torch.isnan(pot[0]) and torch.isnan(lp[0]) and torch.isnan(score[0]).all()
    assert pot[1] == 0 and torch.isfinite(lp[1]) and torch.equal(score[1], torch.zeros(4))
    assert pot[2] == math.inf and lp[2] == -math.inf


def test_score_is_gradient_at_extreme_magnitudes_float64():
    g = fixed(5)
    for beta in (0.3, 1.0, 1.7):
        law = GeneralizedGaussian(torch.tensor(beta, dtype=F64), 0.8, Metric.block(S32.double()), dim=4)
        for mag in (1e-150, 1e-3, 1e150):
            u = (mag * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_()
            (auto,) = torch.autograd.grad(law.log_prob(u).sum(), u)
            torch.testing.assert_close(law.score(u), auto, rtol=1e-10, atol=0)


# ------------------------------------------------------------------ exact constants
def mp_log_normalizer_gg(beta, lam, d, half_logdet):
    beta, lam = mp(beta), mp(lam)
    return (mp(half_logdet) + mpmath.log(2) + mpmath.mpf(d) / 2 * mpmath.log(mpmath.pi) - mpmath.loggamma(mpmath.mpf(d) / 2)
            + mpmath.loggamma(d / beta) - mpmath.log(beta) - (d / beta) * mpmath.log(lam / beta))


def mp_moment_factor(beta, lam, d):
    beta, lam = mp(beta), mp(lam)
    return (beta / lam) ** (2 / beta) * mpmath.gamma((d + 2) / beta) / (d * mpmath.gamma(d / beta))


@pytest.mark.parametrize("d", [2, 784])
@pytest.mark.parametrize("beta", [0.05, 0.3, 1.0, 1.4, 2.0])
def test_gg_constants_against_mpmath(beta, d):
    """log Z, Cov and the realized RMS: float64 to 1e-12, float32 rounded from the exact value
    (the float32 lgamma difference was off by 5e-4 at d = 784, β = 0.3)."""
    for dtype, rtol in ((F64, 1e-12), (torch.float32, 3e-7)):
        for lam in (1e-30, 1.8, 1e30):
            var = Metric.isotropic(torch.tensor(0.5, dtype=dtype))
            law = GeneralizedGaussian(torch.tensor(beta, dtype=dtype), lam, var, dim=d)
            b, l, var = float(law.beta), float(law.lam), float(law.metric.param)
            what = f"{dtype}, beta={beta}, lam={lam:g}, d={d}"
            want = mp_log_normalizer_gg(b, l, d, 0.5 * d * math.log(var))
            assert_rel(law.log_normalizer(d), want, rtol if dtype == F64 else 1e-6, f"log Z, {what}")
            factor = mp_moment_factor(b, l, d)
            rms = mpmath.sqrt(factor * mp(var))
            hi = 3e38 if dtype != F64 else 1e300
            if 1 / hi < rms < hi:
                assert_rel(law.realized_rms(), rms, rtol, f"realized RMS, {what}")
            if d == 2 and 1 / hi < factor * mp(var) < hi:
                assert_rel(law.covariance()[0, 0], factor * mp(var), rtol, f"Cov, {what}")


def test_gg_moments_finite_where_the_factor_overflows_float32():
    """(β/λ)^{2/β}·… = 3e40 overflows float32 but the RMS (1.7e20·√var) and Cov do not."""
    law = GeneralizedGaussian(1.0, 1e-20, Metric.isotropic(1e-20), dim=2)
    var = float(torch.tensor(1e-20))
    factor = mp_moment_factor(1.0, float(torch.tensor(1e-20)), 2)
    assert_rel(law.realized_rms(), mpmath.sqrt(factor * var), 3e-7, "realized RMS")
    assert_rel(law.covariance()[0, 0], factor * var, 3e-7, "Cov")
    assert_rel(GeneralizedGaussian(1.0, 1e-20, dim=2).realized_rms(), mpmath.sqrt(factor), 3e-7, "realized RMS, Σ = I")


@pytest.mark.parametrize("d", [2, 784])
def test_student_t_log_normalizer_for_large_c(d):
    """lgamma(c − d/2) − lgamma(c) read 0 for c = 1e8 in float32 and c = 1e20 in float64."""
    for c in (d / 2 + 0.25, d / 2 + 150.0, 1e4, 1e8, 1e20, 1e30):
        for dtype, rtol in ((F64, 1e-12), (torch.float32, 1e-6)):
            law = StudentT(torch.tensor(c, dtype=dtype), dim=d)
            cc = mp(law.c)
            want = mpmath.mpf(d) / 2 * mpmath.log(mpmath.pi) + mpmath.loggamma(cc - mpmath.mpf(d) / 2) - mpmath.loggamma(cc)
            assert_rel(law.log_normalizer(d), want, rtol, f"{dtype}, c={c:g}, d={d}")


def radial_mass(law, d, var, t_mode, width, right_decay=math.inf):
    """∫ q over R^d for a law with Σ = var·I: ∫ q(e^t e₁) |S^{d−1}| e^{d t} dt, by composite
    Gauss–Legendre quadrature (160 panels × 20 nodes, one log_prob call).

    The integrand falls like e^{d t} to the left of its peak, like e^{−right_decay·t} to the
    right (ν for the Student-t) and like exp(−e^{βt}/…) for the generalized Gaussian."""
    left, right = max(40 * width, 40 / d), max(40 * width, 40 / right_decay)
    edges = np.linspace(t_mode - left, t_mode + right, 161)
    nodes, weights = np.polynomial.legendre.leggauss(20)
    half = 0.5 * np.diff(edges)[:, None]
    t = torch.from_numpy((0.5 * (edges[:-1] + edges[1:])[:, None] + half * nodes).ravel())
    w = torch.from_numpy((half * weights).ravel())
    u = torch.zeros(t.shape[0], d, dtype=F64)
    u[:, 0] = torch.exp(t)
    log_area = math.log(2) + 0.5 * d * math.log(math.pi) - math.lgamma(0.5 * d)
    return float((w * torch.exp(law.log_prob(u) + log_area + d * t)).sum())


@pytest.mark.parametrize("d", [1, 2, 784])
@pytest.mark.parametrize("beta,lam", [(0.05, 1.0), (1.0, 1e-30), (1.0, 1e30), (2.0, 1e30), (2.0, 1e-30)])
def test_gg_density_integrates_to_one_in_any_dimension(beta, lam, d):
    var = 0.7
    law = GeneralizedGaussian(torch.tensor(beta, dtype=F64), lam, Metric.isotropic(torch.tensor(var, dtype=F64)))
    # (λ/β) r^β var^{−β/2} ~ Gamma(d/β): the integrand peaks near r^β = d var^{β/2}/λ
    t_mode = (math.log(d / lam) + 0.5 * beta * math.log(var)) / beta
    width = 0.5 / (beta * math.sqrt(d / beta))
    total = radial_mass(law, d, var, t_mode, width)
    assert abs(total - 1) < 1e-8, f"∫q = {total}"


@pytest.mark.parametrize("d", [1, 2, 784])
@pytest.mark.parametrize("excess", [0.5, 3.0, 1e8, 1e20])
def test_student_t_density_integrates_to_one(d, excess):
    c = d / 2 + excess
    var = 0.7
    law = StudentT(torch.tensor(c, dtype=F64), Metric.isotropic(torch.tensor(var, dtype=F64)))
    t_mode = 0.5 * math.log(var * d / (2 * c - d)) if excess > 1 else 0.5 * math.log(var * d)
    width = 0.5 / math.sqrt(min(d, 2 * excess)) if excess > 1 else 2.0
    total = radial_mass(law, d, var, t_mode, width, right_decay=2 * c - d)
    assert abs(total - 1) < 1e-7, f"∫q = {total}, c = {c}"


def test_scale_constant_and_shape_matrix_against_closed_forms():
    g = fixed(3)
    for beta in (0.05, 0.3, 1.0, 1.4, 2.0):
        for d in (1, 2, 784):
            c2 = mp(beta) ** (2 / mp(beta)) * mpmath.gamma((d + 2) / mp(beta)) / (d * mpmath.gamma(d / mp(beta)))
            assert_rel(scale_constant(torch.tensor(beta, dtype=F64), d), mpmath.sqrt(c2), 1e-12, f"c, beta={beta}, d={d}")
    angle = 2 * math.pi * torch.rand(50, generator=g, dtype=F64)
    radius = torch.rand(50, generator=g, dtype=F64).clamp_max(0.999999)
    u, v = radius * torch.cos(angle), radius * torch.sin(angle)
    S = shape_matrix(u, v)
    eig = torch.linalg.eigvalsh(S)
    torch.testing.assert_close(torch.diagonal(S, dim1=-2, dim2=-1).sum(-1), torch.full((50,), 2.0, dtype=F64))
    torch.testing.assert_close(torch.linalg.det(S), 1 - u * u - v * v)
    torch.testing.assert_close(eig, torch.stack([1 - radius, 1 + radius], -1))
    assert bool((eig > 0).all())


# ------------------------------------------------------------------ the tuple at extremes
def test_noise_params_rms_and_sigma_for_rms_where_a_power_overflows():
    """λ^{−1/β} = 1e60 overflows float32 where σ λ^{−1/β} = 1e30 does not."""
    p = NoiseParams(0.5, 1e-30, 1e-30)
    want = float(mp(torch.tensor(1e-30)) * mp(torch.tensor(1e-30)) ** -2)
    assert_rel(p.realized_rms(), want, 3e-7, "realized RMS")
    r, lam = torch.tensor(1e-30), torch.tensor(1e30)
    assert_rel(NoiseParams.sigma_for_rms(r, lam, torch.tensor(0.5)), mp(r) * mp(lam) ** 2, 3e-7, "sigma_for_rms")
    # floats: λ^{1/β} = 1e600 is beyond a float, σ = 1e300 is not; 1e-30·1e600 is a named error
    assert NoiseParams.sigma_for_rms(1e-300, 1e30, 0.05) == pytest.approx(1e300, rel=1e-12)
    with pytest.raises(ValueError, match="sigma = r·lam\\^\\(1/beta\\) .* overflows a float"):
        NoiseParams.sigma_for_rms(1e-30, 1e30, 0.05)
    assert NoiseParams.sigma_for_rms(0.5, 4.0, 2.0) == 1.0


def test_eta_round_trip_at_extreme_parameters():
    beta = torch.tensor([0.05, 1.0, 2.0, 1.3], dtype=F64)
    lam = torch.tensor([1e-30, 1e30, 1.0, 2.5], dtype=F64)
    sigma = torch.tensor([1e30, 1e-30, 0.3, 1.0], dtype=F64)
    u = torch.tensor([0.0, 0.7, -0.99, 0.3], dtype=F64)
    v = torch.tensor([0.0, -0.7, 0.1, 0.4], dtype=F64)
    p = NoiseParams(beta, lam, sigma, u, v)
    q = NoiseParams.from_eta(p.eta())
    for name in ("beta", "lam", "sigma", "u", "v"):
        torch.testing.assert_close(getattr(q, name), getattr(p, name), rtol=1e-14, atol=0)
    torch.testing.assert_close(q.eta(), p.eta(), rtol=0, atol=0)


# ------------------------------------------------------------------ sampling at extremes
def ks_radial(law, x, P_diag, d):
    """KS p-value of (λ/β)‖x‖_P^β against Gamma(d/β) (isotropic or diagonal Σ), in float64."""
    beta, lam = float(law.beta), float(law.lam)
    log_norm = 0.5 * torch.log((x.double() ** 2 * P_diag).sum(-1))
    t = torch.exp(math.log(lam / beta) + beta * log_norm)
    return scipy.stats.kstest(t.numpy(), "gamma", args=(d / beta,)).pvalue


def test_sample_finite_where_the_radius_overflows_float32():
    """R = ((β/λ)G)^{1/β} ≈ 1e40 overflows float32 while u = R Σ^{1/2} U ≈ 1e30 does not."""
    law = GeneralizedGaussian(0.5, 1e-20, Metric.isotropic(1e-20), dim=2)
    x = law.sample((4000,), generator=fixed(7))
    assert torch.isfinite(x).all()
    p = ks_radial(law, x, 1 / float(torch.tensor(1e-20)), 2)
    assert p > 1e-3, f"KS p-value {p:.2e}"


@pytest.mark.parametrize("beta,lam,d,dtype", [
    (0.05, 1.0, 2, F64), (0.05, 1.0, 2, torch.float32), (0.05, 1.0, 784, F64),
    (1.0, 1e-30, 784, torch.float32), (2.0, 1e30, 784, torch.float32), (1.4, 1.8, 784, torch.float32),
])
def test_radial_law_at_extreme_parameters(beta, lam, d, dtype):
    var = torch.tensor(0.7, dtype=dtype)
    law = GeneralizedGaussian(torch.tensor(beta, dtype=dtype), lam, Metric.isotropic(var), dim=d)
    x = law.sample((3000,), generator=fixed(8))
    assert x.dtype == dtype and torch.isfinite(x).all()
    p = ks_radial(law, x, 1 / float(var), d)
    assert p > 1e-3, f"KS p-value {p:.2e}"


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_realized_rms_at_image_dimension(dtype):
    """Samples of the five-parameter law at d = 784 have per-coordinate RMS σ λ^{−1/β}."""
    p = NoiseParams(torch.tensor(0.3, dtype=dtype), 2.5, 0.7, 0.5, -0.3)
    x = p.noise(784).sample((3000,), generator=fixed(9)).double()
    per_draw = x.pow(2).mean(-1)
    ms, se = per_draw.mean(), per_draw.std() / math.sqrt(per_draw.shape[0])
    target = float(p.realized_rms()) ** 2
    assert abs(float(ms) - target) < 5 * float(se), f"mean square {float(ms)} vs {target} (5 SE = {5 * float(se)})"
    assert_rel(p.noise(784).realized_rms(), p.realized_rms(), 1e-6 if dtype != F64 else 1e-13, "law vs tuple RMS")


def test_draws_reproducible_in_both_dtypes_and_empty_batches():
    for dtype in (torch.float32, F64):
        for law in (GeneralizedGaussian(torch.tensor([0.7, 1.9], dtype=dtype), 1.2, Metric.block(S32.to(dtype)), dim=6),
                    StudentT(torch.tensor([3.6, 9.0], dtype=dtype), Metric.block(S32.to(dtype)), dim=6)):
            a = law.sample((5,), generator=fixed(11))
            assert a.dtype == dtype and a.shape == (5, 2, 6)
            assert torch.equal(a, law.sample((5,), generator=fixed(11)))
    empty = GeneralizedGaussian(torch.ones(0), 1.0, Metric.isotropic(torch.ones(0)), dim=3)
    assert empty.sample((4,), generator=fixed(0)).shape == (4, 0, 3)
    assert empty.score(torch.zeros(2, 0, 3)).shape == (2, 0, 3)
    assert empty.log_prob(torch.zeros(0, 3)).shape == (0,) and empty.realized_rms().shape == (0,)
    t = StudentT(torch.full((0,), 3.0), dim=3)
    assert t.sample((2,), generator=fixed(0)).shape == (2, 0, 3) and t.log_normalizer(3).shape == (0,)


def test_non_contiguous_inputs_and_parameters():
    g = fixed(12)
    S = torch.randn(3, 2, 2, generator=g, dtype=F64)
    S = S @ S.mT + torch.eye(2, dtype=F64)
    S_nc = S.mT  # symmetric values, transposed strides
    assert not S_nc.is_contiguous()
    beta = torch.tensor([[0.6, 0.0], [1.4, 0.0], [2.0, 0.0]], dtype=F64)[:, 0]
    assert not beta.is_contiguous()
    u = torch.randn(5, 3, 8, generator=g, dtype=F64)[..., ::2]
    pairs = ((GeneralizedGaussian(beta, 1.3, Metric.block(S_nc)), GeneralizedGaussian(beta.contiguous(), 1.3, Metric.block(S))),
             (StudentT(beta + 3, Metric.block(S_nc)), StudentT(beta.contiguous() + 3, Metric.block(S))))
    for law, ref in pairs:
        for f in ("log_prob", "score", "potential"):
            torch.testing.assert_close(getattr(law, f)(u), getattr(ref, f)(u.contiguous()), rtol=1e-13, atol=0)
        assert torch.equal(law.sample((3,), generator=fixed(1), dim=4), ref.sample((3,), generator=fixed(1), dim=4))


# ------------------------------------------------------------------ bad input
def test_student_t_needs_c_above_half_d_at_image_dimension():
    with pytest.raises(ValueError, match=r"c must be > d/2 = 392"):
        StudentT(392.0, dim=784)
    StudentT(392.5, dim=784)


def test_metric_cast_to_a_narrower_dtype_checks_the_range():
    """A cast that rounds a variance to 0 or inf gave P = inf (and NaN) silently."""
    with pytest.raises(ValueError, match=r"Metric.to\(torch.float32\).*var does not fit.*got variances in \[1e-300"):
        Metric.isotropic(torch.tensor(1e-300, dtype=F64)).to(torch.float32)
    with pytest.raises(ValueError, match=r"S does not fit torch.float32"):
        Metric.block(torch.tensor([[1e-300, 0.0], [0.0, 1.0]], dtype=F64)).to(torch.float32)
    with pytest.raises(ValueError, match=r"var does not fit torch.float16"):
        Metric.diagonal(torch.tensor([1e5, 1.0])).to(torch.float16)
    with pytest.raises(TypeError, match="dtype must be floating point, got torch.int32"):
        Metric.dense(torch.eye(2)).to(torch.int32)
    m = Metric.block(S32.double()).to(dtype=torch.float32, device="cpu")
    assert m.dtype == torch.float32 and torch.equal(m.param, S32)
    assert Metric.isotropic(2.0).to(F64).dtype == F64


def test_scale_constant_names_bad_arguments():
    """β = 0 gave NaN and β = 2.5 a number silently; d = 0 'math domain error'; d = 2.5 a number."""
    for beta in (0.0, 2.5, float("nan"), torch.tensor([1.0, 3.0])):
        with pytest.raises(ValueError, match=r"beta must lie in \(0, 2\]"):
            scale_constant(beta, 2)
    with pytest.raises(ValueError, match="d must be an int >= 1, got 0"):
        scale_constant(1.0, 0)
    for d in (2.5, True, "2"):
        with pytest.raises(TypeError, match="d must be an int >= 1"):
            scale_constant(1.0, d)
    assert float(scale_constant(1.0, np.int64(2))) == pytest.approx(math.sqrt(3))
