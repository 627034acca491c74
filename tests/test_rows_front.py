"""The C++ front ops of the per-row ops (csrc/front/, ``torch.ops.etweedie.{et_score,
langevin_step, student_t_score}``): the canonical form built in one C++ call.

They must build exactly what the Python canonical form (``_rows.shape_rows``) builds, so a call
through the front equals the kernel on the Python canonical tensors bit for bit — over broadcast
batches, shared and per-row metrics of every kernel kind, non-contiguous and transposed inputs,
16-bit draws, zero-size batches — and its gradients equal theirs.  Without a gradient to record
they call the kernel below autograd; with one they record the same graph.  The public ops take
the front in eager mode on the compiled backends, and the Python form under torch.compile.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import etweedie
from etweedie.ops import _args, _front, _range, _rows

from conftest import gen, random_metric

pytestmark = pytest.mark.skipif(not _front._FRONT["et_score"], reason="compiled extension with the front ops not available")

OPS = torch.ops.etweedie
# the op modules (etweedie.ops.<op> is the function itself)
MODULES = {name: importlib.import_module(f"etweedie.ops.{name}") for name in ("et_score", "langevin_step", "student_t_score")}
STUDENT_T_FRONT = _front._FRONT["student_t_score"]


def _case(seed: int, layout: str, kind: str, x_dtype=torch.float32, dtype=torch.float32):
    """(y, x, beta, lam, metric) of one broadcast layout."""
    g = gen(seed)
    d, N = 4, 5
    if layout == "plain":  # (B, d), (B, N, d), per-row β and λ
        y, x = torch.randn(3, d, generator=g), torch.randn(3, N, d, generator=g)
        beta, lam, mb = 0.5 + 1.5 * torch.rand(3, generator=g), 0.5 + torch.rand(3, generator=g), 3
    elif layout == "shared_cloud":  # one (N, d) cloud for (2, 3) queries, scalar β and λ tensors
        y, x = torch.randn(2, 3, d, generator=g), torch.randn(N, d, generator=g)
        beta, lam, mb = torch.tensor(1.3), torch.tensor(0.7), 0
    elif layout == "noncontiguous":  # strided queries, draws transposed in memory (stride over d ≠ 1)
        y = torch.randn(3, 2 * d, generator=g)[:, ::2]
        x = torch.randn(3, d, N, generator=g).transpose(1, 2)
        beta, lam, mb = 1.7, 0.9, 3
    elif layout == "broadcast_batch":  # y (2, 1, d) against x (3, N, d): batch (2, 3), β per column
        y, x = torch.randn(2, 1, d, generator=g), torch.randn(3, N, d, generator=g)
        beta, lam, mb = 0.5 + 1.5 * torch.rand(3, generator=g), 1.0, 0
    elif layout == "leading_one":  # batch (1, 3): a per-row β already (B,), the output unflattened
        y, x = torch.randn(1, 3, d, generator=g), torch.randn(3, N, d, generator=g)
        beta, lam, mb = 0.5 + 1.5 * torch.rand(3, generator=g), torch.tensor(0.8), 0
    elif layout == "empty":
        y, x = torch.randn(0, d, generator=g), torch.randn(0, N, d, generator=g)
        beta, lam, mb = 1.5, 1.0, 0
    else:
        raise ValueError(layout)
    metric = random_metric(kind, mb, d, g, per_row=mb > 0) if kind != "none" else None
    cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) else t)
    if metric is not None:
        metric = etweedie.Metric(metric.kind, metric.param.to(dtype))
    return cast(y), x.to(x_dtype if x_dtype != torch.float32 else dtype), cast(beta), cast(lam), metric


LAYOUTS = ["plain", "shared_cloud", "noncontiguous", "broadcast_batch", "leading_one", "empty"]
KINDS = ["none", "isotropic", "diagonal", "block2"]


def _python_form(y, x, beta, lam, metric):
    """The Python canonical form and the validated arguments the front op starts from."""
    a = _rows.rows_args("et_score", y, x, beta, lam, metric)
    return a, _rows.shape_rows(a)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_et_score_front_equals_python_form(layout, kind, x_dtype, seed):
    y, x, beta, lam, metric = _case(seed, layout, kind, x_dtype)
    a, c = _python_form(y, x, beta, lam, metric)
    got = OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
    want = OPS.et_score_fwd(c.y, c.x, c.beta, c.lam, c.prec, c.kind)[0].reshape(*a.batch, y.shape[-1])
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got, want), f"{layout}/{kind}: front differs from the Python form (seed {seed})"


@pytest.mark.parametrize("layout", ["plain", "shared_cloud", "noncontiguous", "broadcast_batch"])
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
def test_et_score_front_gradients_equal_python_form(layout, kind, seed):
    y0, x0, beta0, lam0, metric0 = _case(seed, layout, kind, dtype=torch.float64)
    leaves = {}

    def run(through_front: bool):
        y = y0.clone().requires_grad_()
        x = x0.clone().requires_grad_()
        beta = beta0.clone().requires_grad_() if isinstance(beta0, torch.Tensor) else beta0
        lam = lam0.clone().requires_grad_() if isinstance(lam0, torch.Tensor) else lam0
        p = metric0.param.clone().requires_grad_()
        metric = etweedie.Metric(metric0.kind, p)
        a, c = _python_form(y, x, beta, lam, metric)
        if through_front:
            s = OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
        else:
            s = OPS.et_score_fwd(c.y, c.x, c.beta, c.lam, c.prec, c.kind)[0].reshape(*a.batch, y.shape[-1])
        assert s.grad_fn is not None
        w = torch.randn(s.shape, generator=gen(seed + 1), dtype=s.dtype)
        wrt = [t for t in (y, x, beta, lam, p) if isinstance(t, torch.Tensor)]
        leaves[through_front] = torch.autograd.grad((s * w).sum(), wrt)
        return s

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)
    for g1, g2 in zip(leaves[True], leaves[False]):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0, msg=f"{layout}/{kind}: gradients differ (seed {seed})")


@pytest.mark.parametrize("layout", ["plain", "shared_cloud", "noncontiguous", "broadcast_batch", "empty"])
@pytest.mark.parametrize("kind", ["none", "diagonal", "block2"])
def test_langevin_step_front_equals_python_form(layout, kind, seed):
    y, x, beta, lam, metric = _case(seed, layout, kind)
    noise = torch.randn(y.shape, generator=gen(seed + 2))
    step = 0.5 + torch.rand(y.shape[:-1], generator=gen(seed + 3)) if layout == "plain" else 0.05
    a = _rows.rows_args("langevin_step", y, x, beta, lam, metric)
    step_t = _args.as_param(step, "step", "langevin_step", y)
    got = OPS.langevin_step(a.y, a.x, noise, step_t, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
    c = _rows.shape_rows(a)
    d = y.shape[-1]
    want = OPS.langevin_step_fwd(c.y, c.x, _args.flat(noise, c.batch, (d,)).contiguous(), _args.flat(step_t, c.batch, ()),
                                 c.beta, c.lam, c.prec, c.kind)[0].reshape(*a.batch, d)
    assert torch.equal(got, want), f"{layout}/{kind}: front differs from the Python form (seed {seed})"


@pytest.mark.parametrize("layout", ["plain", "shared_cloud", "broadcast_batch"])
@pytest.mark.parametrize("kind", ["none", "diagonal", "block2"])
def test_student_t_score_front_equals_python_form(layout, kind, seed):
    if not STUDENT_T_FRONT:
        pytest.skip("extension without the student_t_score front op")
    y, x, _, _, metric = _case(seed, layout, kind)
    a = _rows.rows_args("student_t_score", y, x, 2.0, 1.0, metric)
    c_param = torch.full(y.shape[:-1], 3.5) if layout == "plain" else torch.tensor(4.0)
    got = OPS.student_t_score(a.y, a.x, c_param, a.prec, a.kind, a.batch)[0]
    cn = _rows.shape_rows(a)
    want = OPS.student_t_score_fwd(cn.y, cn.x, _args.flat(c_param, cn.batch, ()), cn.prec, cn.kind)[0]
    assert torch.equal(got, want.reshape(*a.batch, y.shape[-1]))


def test_front_skips_autograd_only_when_nothing_needs_a_gradient(seed):
    y, x, beta, lam, metric = _case(seed, "plain", "block2")
    a = _rows.rows_args("et_score", y, x, beta, lam, metric)
    s = OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
    assert s.grad_fn is None and not s.requires_grad
    yg = y.clone().requires_grad_()
    a = _rows.rows_args("et_score", yg, x, beta, lam, metric)
    s = OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
    assert s.requires_grad and s.grad_fn is not None
    with torch.no_grad():
        s = OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)[0]
    assert not s.requires_grad
    with torch.inference_mode():
        s = OPS.et_score(y, x, a.beta.detach(), a.lam, a.prec, a.kind, a.batch)[0]
    assert s.is_inference()


def test_public_ops_take_the_front_in_eager_mode(monkeypatch, seed):
    """The fast path is what runs: with the Python canonical form disabled the compiled backend's
    eager calls still work (and the reference, which needs it, does not)."""
    y, x, beta, lam, metric = _case(seed, "plain", "block2")
    want = etweedie.et_score(y, x, beta, lam, metric, backend="cpu")
    want_step = etweedie.langevin_step(y, x, torch.zeros_like(y), 0.1, beta, lam, metric, backend="cpu")

    def refuse(a):
        raise AssertionError("the Python canonical form ran")

    monkeypatch.setattr(_rows, "shape_rows", refuse)
    for mod in MODULES.values():
        monkeypatch.setattr(mod, "shape_rows", refuse)
    assert torch.equal(etweedie.et_score(y, x, beta, lam, metric, backend="cpu"), want)
    step = etweedie.langevin_step(y, x, torch.zeros_like(y), 0.1, beta, lam, metric, backend="cpu")
    assert torch.equal(step, want_step)
    yg = y.clone().requires_grad_()
    etweedie.et_score(yg, x, beta, lam, metric, backend="cpu").sum().backward()
    assert yg.grad is not None and torch.isfinite(yg.grad).all()
    if STUDENT_T_FRONT:
        etweedie.student_t_score(y, x, 3.0, metric, backend="cpu")
    with pytest.raises(AssertionError, match="Python canonical form"):
        etweedie.et_score(y, x, beta, lam, metric, backend="reference")
    dense = random_metric("dense", 0, y.shape[-1], gen(seed), dtype=torch.float32, per_row=False)
    with pytest.raises(AssertionError, match="Python canonical form"):
        etweedie.et_score(y, x, beta, lam, dense, backend="cpu")  # dense metrics are whitened in Python


def test_front_is_not_used_under_compile_or_functorch(seed):
    y, x, beta, lam, metric = _case(seed, "plain", "diagonal")
    a = _rows.rows_args("et_score", y, x, beta, lam, metric)
    assert _front.front("et_score", "cpu", a) and not _front.front("et_score", "reference", a) and not _front.front("et_score", "triton", a)
    seen = []

    def probe(y):
        seen.append(_front.front("et_score", "cpu", _rows.rows_args("et_score", y, x, beta, lam, metric)))
        return y * 2

    torch.func.vjp(probe, y)
    torch.compile(probe, fullgraph=True, backend="eager")(y)
    assert seen == [False, False]


def test_front_op_rejects_a_bad_kind_by_name():
    y, x = torch.randn(2, 4), torch.randn(2, 3, 4)
    one = torch.ones(())
    with pytest.raises(RuntimeError, match="metric kind must be 0, 1 or 2"):
        OPS.et_score(y, x, one, one, one, 3, [2])[0]
    with pytest.raises(RuntimeError):
        OPS.et_score(y, x, one, one, one, 0, [5])[0]  # a batch the inputs do not broadcast to


def test_float_parameters_are_made_once(seed):
    """Numbers given for β, λ and step become one cached 0-d tensor each (no fill per call)."""
    y, x, _, _, _ = _case(seed, "plain", "none")
    a1 = _rows.rows_args("et_score", y, x, 1.25, 0.75, None)
    a2 = _rows.rows_args("et_score", y, x, 1.25, 0.75, None)
    assert a1.beta is a2.beta and a1.lam is a2.lam and a1.prec is a2.prec
    assert float(a1.beta) == 1.25 and float(a1.lam) == 0.75 and float(a1.prec) == 1.0
    assert a1.beta.shape == () and not a1.beta.requires_grad
    # a number that passed one parameter's rule, or one dtype's range, is not taken as checked for another
    _rows.rows_args("et_score", y, x, 1.25, 2.5, None)
    with pytest.raises(ValueError, match="beta must lie in"):
        _rows.rows_args("et_score", y, x, 2.5, 1.0, None)
    _rows.rows_args("et_score", y.double(), x.double(), 1.25, 1e-300, None)
    with pytest.raises(ValueError, match="not representable in torch.float32"):
        _rows.rows_args("et_score", y, x, 1.25, 1e-300, None)
    with pytest.raises(ValueError, match="beta must lie in"):
        _rows.rows_args("et_score", y, x, torch.tensor([1.0, 2.5, 1.0]), 1.0, None)
    with pytest.raises(ValueError, match="lam must be > 0"):
        _rows.rows_args("et_score", y, x, 1.0, torch.tensor(-1.0), None)


def _front_pair(op: str, y, x, scale: float, metric, seed: int):
    """(out, nonfinite) of op's front with λ (et_score, langevin_step) or c (student_t_score) = scale."""
    if op == "student_t_score":
        a = _rows.rows_args(op, y, x, 2.0, 1.0, metric)
        return OPS.student_t_score(a.y, a.x, torch.tensor(scale, dtype=y.dtype), a.prec, a.kind, a.batch)
    a = _rows.rows_args(op, y, x, 1.5, scale, metric)
    if op == "et_score":
        return OPS.et_score(a.y, a.x, a.beta, a.lam, a.prec, a.kind, a.batch)
    noise = torch.randn(y.shape, generator=gen(seed + 5), dtype=y.dtype)
    step = torch.tensor(1.0 if scale > 1 else 0.05, dtype=y.dtype)
    return OPS.langevin_step(a.y, a.x, noise, step, a.beta, a.lam, a.prec, a.kind, a.batch)


# (op, case): the Student-t score is bounded by c‖P‖ (|u|/(1 + |u|²) ≤ 1/2), so finite inputs
# overflow it only when c‖P‖ itself nears float32's maximum: it has no overflow case here
_REPORT_CASES = [(op, case) for op in ("et_score", "langevin_step", "student_t_score")
                 for case in ("finite", "draw_out_of_range", "nan_draw", "inf_query", "output_overflows", "float64_nan")
                 if not (op == "student_t_score" and case == "output_overflows")]


@pytest.mark.parametrize("op,case", _REPORT_CASES)
@pytest.mark.parametrize("kind", ["none", "diagonal", "block2"])
@pytest.mark.parametrize("d", [4, 32])
def test_front_reports_exactly_the_nonfinite_outputs(op, kind, case, d, seed):
    """The front's flag (csrc/common/nonfinite_report.h, raised by the CPU kernel's workers on the
    rows they write) is true exactly when the output holds a NaN or inf — flagged rows, non-finite
    inputs and finite inputs whose result overflows alike — which is what the op used to learn by
    summing the output (_range.flagged)."""
    if op == "student_t_score" and not STUDENT_T_FRONT:
        pytest.skip("extension without the student_t_score front op")
    g = gen(seed)
    dtype = torch.float64 if case == "float64_nan" else torch.float32
    B, N = 5, 7
    y = torch.randn(B, d, generator=g, dtype=dtype)
    x = torch.randn(B, N, d, generator=g, dtype=dtype)
    row = int(torch.randint(B, (), generator=g))
    scale = 1.0
    if case == "draw_out_of_range":
        x[row, 3, 1] = 1e30  # its float32 squared norm overflows: the kernel flags the row
    elif case in ("nan_draw", "float64_nan"):
        x[row, 2, 0] = float("nan")
    elif case == "inf_query":
        y[row, 1] = float("inf")
    elif case == "output_overflows":
        y += 1e3  # finite inputs: |m| ~ |u|^{β−1} ~ 30 per coordinate, times λ = 3e38 overflows float32
        scale = 3e38
    metric = random_metric(kind, 0, d, g, per_row=False) if kind != "none" else None
    if metric is not None:
        metric = etweedie.Metric(metric.kind, metric.param.to(dtype))
    out, nonfinite = _front_pair(op, y, x, scale, metric, seed)
    assert isinstance(nonfinite, bool)
    assert nonfinite == (not bool(torch.isfinite(out).all())), f"{op}/{kind}/{case}: flag {nonfinite} (seed {seed})"
    assert nonfinite == (case != "finite"), f"{op}/{kind}/{case}: flag {nonfinite} (seed {seed})"
    raw_y = y[:0]  # a zero-size batch through the front: no rows, nothing raised
    assert _front_pair(op, raw_y, x[:0], scale, metric, seed)[1] is False


@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
def test_public_ops_read_the_report_not_the_output(op, monkeypatch, seed):
    """On the front path the op decides its float64 rerun from the kernel's report: _range.flagged
    (the sum over the output) never runs, and a float32 call with a draw out of range still comes
    back as the float64 result rounded, with NaN rows only where the inputs hold NaN."""
    if op == "student_t_score" and not STUDENT_T_FRONT:
        pytest.skip("extension without the student_t_score front op")
    fn = getattr(etweedie, op)
    g = gen(seed)
    y, x = torch.randn(4, 16, generator=g), torch.randn(4, 6, 16, generator=g)
    x[1, 2, 3] = 1e30
    x[2, 0, 0] = float("nan")
    noise = torch.randn(y.shape, generator=gen(seed + 1))

    def call(yy, xx, nn):
        if op == "student_t_score":
            return fn(yy, xx, 9.0, backend="cpu")
        if op == "langevin_step":
            return fn(yy, xx, nn, 0.05, 1.5, 1.0, backend="cpu")
        return fn(yy, xx, 1.5, 1.0, backend="cpu")

    want = call(y.double(), x.double(), noise.double()).float()

    def refuse(out):
        raise AssertionError("the output was summed")

    monkeypatch.setattr(_range, "flagged", refuse)
    got = call(y, x, noise)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.isnan(got[2]).all() and torch.isfinite(got[[0, 1, 3]]).all()


# ----------------------------------------------------------------------------- the plain call

def _plain_case(seed: int, kind: str, dtype, x_dtype):
    """(y, x, metric) for the plain call: y (B, d), x (B, N, d), a shared metric in y's dtype."""
    g = gen(seed)
    B, N, d = 3, 6, 8
    y = torch.randn(B, d, generator=g, dtype=dtype)
    x = (y.unsqueeze(1) + torch.randn(B, N, d, generator=g, dtype=dtype)).to(x_dtype)
    m = random_metric(kind, 0, d, g, dtype=dtype, per_row=False) if kind != "none" else None
    return y, x, m


def _call(op: str, y, x, metric, *, plain: bool, monkeypatch, backend=None):
    """op's output and ∂/∂y with the plain path on or off (its module's plain_rows patched to None)."""
    mod = MODULES[op]
    if not plain:
        monkeypatch.setattr(mod, "plain_rows", lambda *a: None)
    yg = y.clone().requires_grad_()
    if op == "et_score":
        out = etweedie.et_score(yg, x, 1.3, 0.7, metric, backend=backend)
    elif op == "langevin_step":
        out = etweedie.langevin_step(yg, x, torch.ones_like(y), 0.05, 1.3, 0.7, metric, backend=backend)
    else:
        out = etweedie.student_t_score(yg, x, 6.0, metric, backend=backend)
    grad = torch.autograd.grad(out.sum(), yg)[0]
    monkeypatch.undo()
    return out.detach(), grad


@pytest.mark.parametrize("op", ["et_score", "langevin_step", "student_t_score"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,x_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.float64, torch.float64)], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("backend", [None, "cpu"])
def test_plain_call_equals_the_general_path(op, kind, dtype, x_dtype, backend, monkeypatch, seed):
    """The plain call (plain_rows) hands the front op what the general path builds: equal values
    and gradients bit for bit, and it is the path taken (after one call has checked the floats)."""
    if op == "student_t_score" and not STUDENT_T_FRONT:
        pytest.skip("no student_t_score front op")
    y, x, metric = _plain_case(seed, kind, dtype, x_dtype)
    general = _call(op, y, x, metric, plain=False, monkeypatch=monkeypatch, backend=backend)
    taken = []
    real = MODULES[op].plain_rows
    monkeypatch.setattr(MODULES[op], "plain_rows", lambda *a: taken.append(real(*a)) or taken[-1])
    got = _call(op, y, x, metric, plain=True, monkeypatch=monkeypatch, backend=backend)
    assert taken and taken[-1] is not None, "the plain call did not take the plain path"
    assert torch.equal(got[0], general[0]) and torch.equal(got[1], general[1])


def test_plain_call_declines_what_it_does_not_cover(monkeypatch, seed):
    """plain_rows answers None (the general path decides, and raises) outside the plain call."""
    y, x, metric = _plain_case(seed, "block2", torch.float32, torch.float32)
    etweedie.et_score(y, x, 1.3, 0.7, metric)  # β = 1.3 and λ = 0.7 now checked for float32
    plain = lambda *args, backend=None: _front.plain_rows("et_score", *args, backend)  # noqa: E731
    assert plain(y, x, 1.3, 0.7, metric) is not None
    assert plain(y, x, 1.3, 0.7, None) is not None
    declined = {
        "backend reference": plain(y, x, 1.3, 0.7, metric, backend="reference"),
        "backend triton": plain(y, x, 1.3, 0.7, metric, backend="triton"),
        "tensor beta": plain(y, x, torch.tensor(1.3), 0.7, metric),
        "unchecked float": plain(y, x, 1.2999, 0.7, metric),
        "an int": plain(y, x, 1, 0.7, metric),
        "shared cloud": plain(y, x[0], 1.3, 0.7, metric),
        "batch of two dims": plain(y.unsqueeze(0), x.unsqueeze(0), 1.3, 0.7, metric),
        "no draws": plain(y, x[:, :0], 1.3, 0.7, metric),
        "float64 metric, float32 data": plain(y, x, 1.3, 0.7, etweedie.Metric.block(metric.param.double())),
        "metric batch": plain(y, x, 1.3, 0.7, etweedie.Metric.isotropic(torch.ones(3))),
        "block not dividing d": plain(y[:, :7], x[:, :, :7], 1.3, 0.7, metric),
        "diagonal of another d": plain(y, x, 1.3, 0.7, etweedie.Metric.diagonal(torch.ones(5))),
        "dense metric": plain(y, x, 1.3, 0.7, etweedie.Metric.dense(torch.eye(8))),
        "a Parameter": plain(torch.nn.Parameter(y), x, 1.3, 0.7, metric),
        "int draws": plain(y, x.to(torch.int32), 1.3, 0.7, metric),
    }
    with etweedie.use_backend("reference"):
        declined["use_backend"] = plain(y, x, 1.3, 0.7, metric)
        assert plain(y, x, 1.3, 0.7, metric, backend="cpu") is not None  # the argument outranks the context
    with torch.autograd.forward_ad.dual_level():
        declined["dual level"] = plain(y, x, 1.3, 0.7, metric)
    monkeypatch.setenv("ETWEEDIE_BACKEND", "cpu")
    declined["ETWEEDIE_BACKEND"] = plain(y, x, 1.3, 0.7, metric)
    assert plain(y, x, 1.3, 0.7, metric, backend="cpu") is not None
    monkeypatch.delenv("ETWEEDIE_BACKEND")
    etweedie.set_debug(True)
    try:
        declined["debug checks"] = plain(y, x, 1.3, 0.7, metric)
    finally:
        etweedie.set_debug(False)
    seen = []
    torch.func.vjp(lambda t: seen.append(plain(t, x, 1.3, 0.7, metric)) or t, y)
    declined["functorch"] = seen[0]
    assert {k: v for k, v in declined.items() if v is not None} == {}


def test_plain_call_reruns_flagged_rows_on_the_general_path(monkeypatch, seed):
    """A row the kernel flags (a draw out of float32's accurate range) sends the plain call to the
    general path, which reruns it in float64: the result is the general path's."""
    y, x, metric = _plain_case(seed, "diagonal", torch.float32, torch.float32)
    x[1, 2] = 1e30
    etweedie.et_score(y, x, 1.3, 0.7, metric)
    assert _front.plain_rows("et_score", y, x, 1.3, 0.7, metric, None) is not None
    general = _call("et_score", y, x, metric, plain=False, monkeypatch=monkeypatch)
    got = _call("et_score", y, x, metric, plain=True, monkeypatch=monkeypatch)
    assert torch.isfinite(got[0]).all()
    assert torch.equal(got[0], general[0]) and torch.equal(got[1], general[1])
