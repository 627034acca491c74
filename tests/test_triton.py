"""Triton kernels (etweedie.kernels) on CPU tensors under the Triton interpreter.

Every kernel — et_score forward/backward, the fused Langevin step, the importance-sampling
oracle — against the float64 reference (the score kernels also with bfloat16/float16 draws,
against the float64 reference on the draws' exact values) (|out − ref64| ≤ 2|ref32 − ref64| + atol, outputs and
every gradient) on shapes that exercise the masks and several program blocks: d not a power
of two, several coordinate chunks (block size lowered so that chunk edges cut through k×k
metric blocks), N = 1, N spanning several draw tiles, stride-0 clouds and metrics.

TRITON_INTERPRET=1 has to be in the environment before triton is imported, so in a normal
run one test reruns this file in a subprocess with it set (about a minute).  On a machine
with a GPU the rest of the suite also runs the Triton backend on CUDA tensors
(tests/conftest.py adds "triton" there).
"""

import pytest
import torch

import etweedie
from conftest import (
    LOW_PRECISION,
    LOW_PRECISION_IDS,
    TRITON_INTERPRETING,
    assert_close_to_ref,
    assert_low_precision_close,
    gen,
    random_metric,
    run_file_under_interpreter,
    skip_unless_interpreting,
)
from test_et_score import _check_against_reference, _check_compile_fullgraph_low_precision, _check_low_precision, _inputs
from test_langevin_step import _inputs as _langevin_inputs, _run as _langevin_run

# TRITON_INTERPRET=1 must be set at process start (tests/conftest.py): without it the cases
# below are skipped here and test_cases_under_the_interpreter reruns this file with it set.
INTERPRET = TRITON_INTERPRETING
DEV = torch.device("cpu")

if INTERPRET:
    try:
        import etweedie.kernels as tk
        from etweedie.kernels import et_score as tk_et_score
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"triton is not importable: {exc!r}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpreter_only(request):
    skip_unless_interpreting(request)


def test_cases_under_the_interpreter():
    """Run this file in a fresh interpreter-mode process (the real checks are the cases)."""
    run_file_under_interpreter(__file__)


@pytest.fixture
def small_chunks(monkeypatch):
    """Coordinate chunks of 8: d = 12 runs as two programs per row (8 + 4, masked)."""
    monkeypatch.setattr(tk_et_score, "_MAX_BLOCK_D", 8)


def test_backend_reported_available():
    ok, why = etweedie.backends.available()["triton"]
    assert ok, why
    assert "interpret" in why


KINDS = ["none", "isotropic", "diagonal", "block2", "block3", "block4", "dense"]
SHAPES = {"d12": (3, 37, 12), "N1": (2, 1, 12), "manyN": (2, 300, 4)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_et_score_matches_float64_reference(kind, shape, seed):
    B, N, d = SHAPES[shape]
    if kind == "block3" and d % 3:
        d = 6
    y, x, beta, lam, metric = _inputs(seed, B, N, d, kind)
    _check_against_reference("triton", DEV, (y, x, beta, lam), metric, f"[{kind}, {shape}]", seed)


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block3", "block4"])
def test_et_score_several_chunks(kind, small_chunks, seed):
    y, x, beta, lam, metric = _inputs(seed, 3, 19, 12, kind)
    _check_against_reference("triton", DEV, (y, x, beta, lam), metric, f"[{kind}, chunks of 8]", seed)


def test_tile_budget_switch(seed, monkeypatch):
    """ETWEEDIE_TRITON_TILE (gpu_check's triton:tile8k rows) doubles the draws per tile; a value
    that is not a power of two in [1024, 32768] is refused by name; results stay right."""
    assert tk_et_score.block_sizes(256, 784, 0, 1)[0] == 4
    monkeypatch.setenv("ETWEEDIE_TRITON_TILE", "8192")
    assert tk_et_score.block_sizes(256, 784, 0, 1)[0] == 8
    y, x, beta, lam, metric = _inputs(seed, 3, 37, 20, "block2")
    _check_against_reference("triton", DEV, (y, x, beta, lam), metric, "[tile 8192]", seed)
    for bad in ("3000", "512", "big"):
        monkeypatch.setenv("ETWEEDIE_TRITON_TILE", bad)
        with pytest.raises(ValueError, match="ETWEEDIE_TRITON_TILE"):
            tk_et_score.block_sizes(256, 784, 0, 1)


@pytest.mark.parametrize("kind, k", [("block2", 2), ("block4", 4)])
@pytest.mark.parametrize("in_registers", ["1", "0"])
def test_et_score_block_metric_in_registers_and_shifted(kind, k, in_registers, seed, monkeypatch):
    """The forward's two ways of applying a k×k block (k a power of two): contracting the draw
    tile viewed as (BLOCK_N, BLOCK_D/k, k) in registers (default), or shifted loads
    (ETWEEDIE_TRITON_BLOCK_IN_REGISTERS=0, the A/B switch of gpu_check); both against the
    float64 reference, the fused Langevin step included."""
    monkeypatch.setenv("ETWEEDIE_TRITON_BLOCK_IN_REGISTERS", in_registers)
    assert tk_et_score._block_in_registers(2, k, k, 16) == (in_registers == "1")
    assert not tk_et_score._block_in_registers(2, 4, 3, 16)  # k = 3: shifted loads
    assert not tk_et_score._block_in_registers(2, 4, 4, 2)  # chunks cutting through blocks
    y, x, beta, lam, metric = _inputs(seed, 3, 37, 20, kind)
    _check_against_reference("triton", DEV, (y, x, beta, lam), metric, f"[{kind}, in registers={in_registers}]", seed)
    args = _langevin_inputs(seed, 2, 9, 12, kind)
    out, _ = _langevin_run("triton", DEV, torch.float32, args[:6], args[6])
    r32, _ = _langevin_run("reference", "cpu", torch.float32, args[:6], args[6])
    r64, _ = _langevin_run("reference", "cpu", torch.float64, args[:6], args[6])
    assert_close_to_ref(out, r32, r64, name=f"langevin[{kind}]", seed=seed)


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.05, 1.4])
def test_et_score_beta_and_coincident_draws(beta, seed):
    y, x, b, lam, metric = _inputs(seed, 3, 9, 6, "block2", beta=beta)
    x[:, ::3] = y.unsqueeze(1)
    _check_against_reference("triton", DEV, (y, x, b, lam), metric, f" beta={beta} coincident", seed)


def test_et_score_shared_cloud_and_metric(seed):
    g = gen(seed)
    B, N, d = 5, 11, 6
    cloud = torch.randn(N, d, generator=g)  # stride 0 over rows on the kernel path
    y = torch.randn(B, 2 * d, generator=g)[:, ::2]
    S = torch.tensor([[1.2, 0.3], [0.3, 0.8]])
    lam = torch.rand(B, generator=g) + 0.5
    got = etweedie.et_score(y, cloud, 1.3, lam, etweedie.Metric.block(S), backend="triton")
    want = etweedie.et_score(y, cloud, 1.3, lam, etweedie.Metric.block(S), backend="reference")
    torch.testing.assert_close(got, want)
    xt = torch.randn(B, d, N, generator=g).transpose(1, 2)  # non-unit stride over d
    torch.testing.assert_close(
        etweedie.et_score(y, xt, 1.7, backend="triton"), etweedie.et_score(y, xt, 1.7, backend="reference")
    )


def test_et_score_gradcheck_float64(seed):
    y, x, beta, lam, metric = _inputs(seed, 2, 3, 4, "block2")
    p = metric.param.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (y, x, beta, lam)]

    def f(y, x, beta, lam, p):
        return etweedie.et_score(y, x, beta, lam, etweedie.Metric.block((p + p.transpose(-1, -2)) / 2), backend="triton")

    assert torch.autograd.gradcheck(f, (*leaves, p)), f"seed {seed}"


def test_zero_size_and_float64():
    y = torch.zeros(0, 5, requires_grad=True)
    x = torch.zeros(0, 7, 5, requires_grad=True)
    s = etweedie.et_score(y, x, 1.4, 2.0, etweedie.Metric.diagonal(torch.ones(5)), backend="triton")
    assert s.shape == (0, 5)
    gy, gx = torch.autograd.grad(s.sum(), (y, x))
    assert gy.shape == y.shape and gx.shape == x.shape
    y64, x64 = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    torch.testing.assert_close(
        etweedie.et_score(y64, x64, 1.2, backend="triton"), etweedie.et_score(y64, x64, 1.2, backend="reference"),
        rtol=1e-12, atol=1e-12,
    )


def test_torch_compile_fullgraph(seed):
    y, x, beta, lam, metric = _inputs(seed, 4, 16, 6, "block2")
    y, x = y.float().requires_grad_(), x.float()
    m = etweedie.Metric(metric.kind, metric.param.float())

    def f(y, x):
        return etweedie.et_score(y, x, 1.4, 1.8, m, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(y, x), f(y, x))
    (g1,) = torch.autograd.grad(compiled(y, x).sum(), y)
    (g2,) = torch.autograd.grad(f(y, x).sum(), y)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "block3", "dense"])
def test_langevin_step_matches_float64_reference(kind, seed):
    y, x, xi, step, beta, lam, metric = _langevin_inputs(seed, 3, 21, 6, kind)
    args = (y, x, xi, step, beta, lam)
    out, gout = _langevin_run("triton", DEV, torch.float32, args, metric)
    r32, g32 = _langevin_run("reference", "cpu", torch.float32, args, metric)
    r64, g64 = _langevin_run("reference", "cpu", torch.float64, args, metric)
    assert_close_to_ref(out, r32, r64, name=f"langevin[{kind}]", seed=seed)
    for name, a, b, c in zip(["y", "x", "noise", "step", "beta", "lam", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}[{kind}]", seed=seed, atol_scale=3e-5)


def test_langevin_step_several_chunks(small_chunks, seed):
    y, x, xi, step, beta, lam, metric = _langevin_inputs(seed, 2, 5, 12, "block3")
    args = (y, x, xi, step, beta, lam)
    out, _ = _langevin_run("triton", DEV, torch.float64, args, metric)
    ref, _ = _langevin_run("reference", "cpu", torch.float64, args, metric)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def _is_case(seed, Q, M, d, kind, beta, backend, dtype):
    g = gen(seed)
    bank = torch.randn(M, d, generator=g, dtype=torch.float64)
    y = bank[:Q] + 0.6 * torch.randn(Q, d, generator=g, dtype=torch.float64)
    y[0] = bank[5]  # a query exactly on a bank point
    metric = random_metric(kind, 1, d, g, per_row=False)
    m = None if metric is None else etweedie.Metric(metric.kind, metric.param.to(dtype))
    law = etweedie.GeneralizedGaussian(beta, 1.7, m, dim=d)
    return etweedie.is_score(y.to(dtype), bank.to(dtype), law, backend=backend, chunk=16)


@pytest.mark.parametrize("kind", ["none", "diagonal", "block2", "block3", "dense"])
@pytest.mark.parametrize("beta", [1.0, 1.4, 2.0])
def test_is_score_matches_float64_reference(kind, beta, seed):
    # Q and M not multiples of the tiles, d not a power of two.  Dense: d = 4, because with the
    # exactly coincident query y[0] the whitened copies z = yL and x_5 L can differ in the last
    # bit for other d (BLAS blocking), and ‖z_y − z_5‖^{β−2} then blows up — for every backend.
    Q, M, d = 37, 300, 4 if kind == "dense" else 6
    out = _is_case(seed, Q, M, d, kind, beta, "triton", torch.float32)
    r32 = _is_case(seed, Q, M, d, kind, beta, "reference", torch.float32)
    r64 = _is_case(seed, Q, M, d, kind, beta, "reference", torch.float64)
    for i, name in enumerate(["score", "mean", "ess"]):
        assert_close_to_ref(out[i], r32[i], r64[i], name=f"{name}[{kind}, beta={beta}]", seed=seed, atol_scale=2e-5)


@pytest.mark.parametrize("kind", ["diagonal", "block3"])
def test_is_score_several_chunks(kind, small_chunks, seed):
    out = _is_case(seed, 9, 70, 12, kind, 1.4, "triton", torch.float64)
    ref = _is_case(seed, 9, 70, 12, kind, 1.4, "reference", torch.float64)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_is_score_far_queries_do_not_underflow():
    bank = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    s, mean, ess = etweedie.is_score(torch.tensor([[60.0, 0.0]]), bank, etweedie.GeneralizedGaussian(2.0, 1.0), backend="triton")
    torch.testing.assert_close(mean, torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(s, torch.tensor([[-59.0, 0.0]]))
    assert abs(float(ess) - 1.0) < 1e-6


@pytest.mark.parametrize("case", ["f32-1e11-beta0.3", "f32-q2^-63.9-beta0.001"])
@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
def test_gradients_where_the_backward_slope_leaves_its_range(op, case):
    """A far draw (or, at β = 0.001, a very near one) flags its row in the Triton kernels too
    (q_in_range's bounds: _near_q, _far_q), so the CPU call reruns in float64 instead of
    returning gradients whose slope went subnormal or overflowed."""
    from test_guarantees import test_gradients_stay_right_where_the_backward_slope_leaves_its_range as check

    check("triton", DEV, case, op)


def test_host_functions_validate_canonical_arguments():
    y, x = torch.zeros(2, 4), torch.zeros(2, 3, 4)
    one = torch.ones(2)
    with pytest.raises(ValueError, match="block precision"):
        tk.et_score_forward(y, x, one, one, torch.ones(2, 3, 3), 2)
    with pytest.raises(ValueError, match="x must be"):
        tk.et_score_forward(y, torch.zeros(2, 3, 5), one, one, one, 0)
    with pytest.raises(ValueError, match="x must have y's dtype torch.float32 or be bfloat16 or float16"):
        tk.et_score_forward(y, x.double(), one, one, one, 0)


# ---------------------------------------------------------------------------- 16-bit draws


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["none", "diagonal", "block3", "dense"])
def test_et_score_low_precision_draws(x_dtype, kind, seed):
    y, x, beta, lam, metric = _inputs(seed, 3, 37, 12, kind)
    _check_low_precision("triton", DEV, (y, x, beta, lam), metric, f"[{x_dtype} {kind}]", seed, x_dtype)


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "block3"])
def test_et_score_low_precision_draws_several_chunks(x_dtype, kind, small_chunks, seed):
    y, x, beta, lam, metric = _inputs(seed, 3, 19, 12, kind)
    _check_low_precision("triton", DEV, (y, x, beta, lam), metric, f"[{x_dtype} {kind}, chunks of 8]", seed, x_dtype)


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_et_score_low_precision_beta_and_coincident(x_dtype, beta, seed):
    y, x, b, lam, metric = _inputs(seed, 3, 9, 6, "block2", beta=beta)
    y = y.to(x_dtype).double()
    x[:, ::3] = y.unsqueeze(1)
    _check_low_precision("triton", DEV, (y, x, b, lam), metric, f" beta={beta} coincident", seed, x_dtype)


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_shared_cloud_zero_size_and_float64(x_dtype, seed):
    g = gen(seed)
    cloud = torch.randn(11, 6, generator=g).to(x_dtype)  # stride 0 over rows on the kernel path
    y = torch.randn(5, 12, generator=g)[:, ::2]
    torch.testing.assert_close(etweedie.et_score(y, cloud, 1.3, backend="triton"),
                               etweedie.et_score(y, cloud, 1.3, backend="reference"))
    z = torch.zeros(0, 5, requires_grad=True)
    xz = torch.zeros(0, 7, 5, dtype=x_dtype, requires_grad=True)
    gz, gx = torch.autograd.grad(etweedie.et_score(z, xz, 1.4, backend="triton").sum(), (z, xz))
    assert gx.shape == xz.shape and gx.dtype == x_dtype
    # float64 queries: float64 sums on the widened draws
    y64, x16 = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 4, 3).to(x_dtype)
    torch.testing.assert_close(etweedie.et_score(y64, x16, 1.2, backend="triton"),
                               etweedie.et_score(y64, x16.double(), 1.2, backend="reference"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["block2", "dense"])
def test_langevin_step_low_precision_draws(x_dtype, kind, seed):
    y, x, xi, step, beta, lam, metric = _langevin_inputs(seed, 3, 21, 6, kind)
    x16 = x.to(x_dtype)
    args = (y, x16, xi, step, beta, lam)
    out, gout = _langevin_run("triton", DEV, torch.float32, args, metric, x_dtype=x_dtype)
    r32, g32 = _langevin_run("reference", "cpu", torch.float32, args, metric, x_dtype=x_dtype)
    r64, g64 = _langevin_run("reference", "cpu", torch.float64, (y, x16.double(), xi, step, beta, lam), metric)
    assert_low_precision_close(out, gout, (r32, g32), (r64, g64), ["y", "x", "noise", "step", "beta", "lam", "metric"],
                               what=f"langevin[{x_dtype} {kind}]", x_dtype=x_dtype, seed=seed)


def test_torch_compile_fullgraph_low_precision_draws(seed):
    _check_compile_fullgraph_low_precision("triton", DEV, seed)
