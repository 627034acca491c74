"""energy_score's C++ entry points: the front op ``torch.ops.etweedie.energy_score``
(csrc/front/energy_score_front.cpp: canonical form, kernel call and NaN rows in one C++ call) and
the C++ autograd kernel of the fused training op ``energy_score_fwd_grad``
(csrc/autograd/energy_score_autograd.cpp).

The front must build exactly what the Python form in ``etweedie/ops/energy_score.py`` builds, so
its value equals the kernel's on the Python canonical tensors bit for bit — over broadcast
batches, shared and per-row metrics of every in-kernel kind, non-contiguous inputs and zero-size
batches — and its gradients (the fused op's unit gradients scaled in C++) equal the separate
backward kernel's through the Python rule.  The public op takes the front in eager mode on the
compiled backends, with the GPU's NaN-row rule when value checks are off.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import etweedie
from etweedie.ops import _front
from etweedie.ops._args import _KIND, as_param, broadcast_batch, check_metric, flat, metric_param, precision_of

from conftest import gen, random_metric

pytestmark = pytest.mark.skipif(not _front._FRONT["energy_score"],
                                reason="compiled extension with the energy_score front op not available")

OPS = torch.ops.etweedie
ES = importlib.import_module("etweedie.ops.energy_score")
LAYOUTS = ["plain", "shared_samples", "noncontiguous", "broadcast_batch", "empty"]
KINDS = ["none", "isotropic", "diagonal", "block2"]


def _case(seed: int, layout: str, kind: str, dtype=torch.float32, M: int = 5, d: int = 4):
    """(samples, target, beta, metric) of one broadcast layout."""
    g = gen(seed)
    if layout == "plain":  # (B, M, d), (B, d), per-row β and metric
        x, y, beta, mb = torch.randn(3, M, d, generator=g), torch.randn(3, d, generator=g), 1 + torch.rand(3, generator=g), 3
    elif layout == "shared_samples":  # one (M, d) cloud scored against (2, 3) targets
        x, y, beta, mb = torch.randn(M, d, generator=g), torch.randn(2, 3, d, generator=g), torch.tensor(1.3), 0
    elif layout == "noncontiguous":  # samples transposed in memory (stride over d ≠ 1), strided target
        x = torch.randn(3, d, M, generator=g).transpose(1, 2)
        y, beta, mb = torch.randn(3, 2 * d, generator=g)[:, ::2], 1.7, 3
    elif layout == "broadcast_batch":  # samples (3, M, d) against targets (2, 1, d): batch (2, 3)
        x, y, beta, mb = torch.randn(3, M, d, generator=g), torch.randn(2, 1, d, generator=g), 1 + torch.rand(3, generator=g), 0
    elif layout == "empty":
        x, y, beta, mb = torch.randn(0, M, d, generator=g), torch.randn(0, d, generator=g), 1.5, 0
    else:
        raise ValueError(layout)
    metric = random_metric(kind, mb, d, g, per_row=mb > 0) if kind != "none" else None
    if metric is not None:
        metric = etweedie.Metric(metric.kind, metric.param.to(dtype))
    cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) else t)
    return cast(x), cast(y), cast(beta), metric


def _args(x, y, beta, metric):
    """What energy_score() hands the front op: validated tensors, the metric's precision
    parameter, its kind and the broadcast batch."""
    op = "energy_score"
    beta_t = as_param(beta, "beta", op, x)
    m = check_metric(metric, x.shape[-1], x, op)
    batch = broadcast_batch(op, samples=x.shape[:-2], target=y.shape[:-1], beta=beta_t.shape, metric=m.batch_shape)
    prec = m.param if metric is None else precision_of(m, x.dtype, op)
    return beta_t, m, prec, _KIND[m.kind], batch


def _python_form(x, y, beta_t, m, batch):
    """The canonical tensors of energy_score()'s Python path."""
    M, d = x.shape[-2:]
    B = math.prod(batch)
    xs = x.expand(*batch, M, d).reshape(B, M, d)
    if d > 1 and xs.stride(-1) != 1:
        xs = xs.contiguous()
    yt = y.expand(*batch, d).reshape(B, d).contiguous()
    prec, kind = metric_param(m, batch, d, x.dtype)
    return xs, yt, flat(beta_t, batch, ()), prec, kind


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["fwd", "fused"])
def test_front_equals_python_form(layout, kind, fused, seed):
    x, y, beta, metric = _case(seed, layout, kind)
    beta_t, m, prec, k, batch = _args(x, y, beta, metric)
    got = OPS.energy_score(x, y, beta_t, prec, k, True, batch, fused, False)
    xs, yt, bs, ps, kk = _python_form(x, y, beta_t, m, batch)
    want = (OPS.energy_score_fwd_grad(xs, yt, bs, ps, kk, True, False, False, False, False)[0] if fused
            else OPS.energy_score_fwd(xs, yt, bs, ps, kk, True))
    assert got.shape == batch and got.dtype == x.dtype
    assert torch.equal(got, want.reshape(batch)), f"{layout}/{kind}: front differs from the Python form (seed {seed})"


@pytest.mark.parametrize("layout", ["plain", "shared_samples", "noncontiguous", "broadcast_batch", "empty"])
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
def test_front_gradients_equal_the_backward_kernel(layout, kind, seed):
    """Fused training path (unit gradients from the forward, scaled by the C++ autograd kernel)
    against the plain forward and its separate backward kernel through the Python rule, in
    float64, for every input: samples, target, β and the metric's parameter."""
    x0, y0, beta0, metric0 = _case(seed, layout, kind, dtype=torch.float64)
    grads, values = {}, {}
    for fused in (True, False):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        beta = beta0.clone().requires_grad_() if isinstance(beta0, torch.Tensor) else beta0
        p = metric0.param.clone().requires_grad_()
        beta_t, m, prec, k, batch = _args(x, y, beta, etweedie.Metric(metric0.kind, p))
        if fused:
            v = OPS.energy_score(x, y, beta_t, prec, k, True, batch, True, False)
        else:
            xs, yt, bs, ps, kk = _python_form(x, y, beta_t, m, batch)
            v = OPS.energy_score_fwd(xs, yt, bs, ps, kk, True).reshape(batch)
        assert v.requires_grad == (v.numel() > 0 or v.grad_fn is not None)
        w = torch.randn(v.shape, generator=gen(seed + 1), dtype=v.dtype)
        wrt = [t for t in (x, y, beta, p) if isinstance(t, torch.Tensor)]
        grads[fused] = torch.autograd.grad((v * w).sum(), wrt, allow_unused=True)
        values[fused] = v.detach()
    torch.testing.assert_close(values[True], values[False], rtol=1e-12, atol=1e-12)
    for name, g1, g2 in zip(("samples", "target", "beta", "metric"), grads[True], grads[False]):
        if g2 is None:
            assert g1 is None or not g1.any()
            continue
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12, msg=f"{layout}/{kind}: ∂{name} differs (seed {seed})")


def test_front_nan_rows(seed):
    """nan_rows=True: NaN exactly in the rows whose samples or target hold a NaN or an inf (a
    shared cloud's NaN reaches every row); the other rows are the finite call's."""
    x, y, beta, metric = _case(seed, "plain", "block2")
    beta_t, _, prec, k, batch = _args(x, y, beta, metric)
    clean = OPS.energy_score(x, y, beta_t, prec, k, True, batch, False, True)
    assert torch.isfinite(clean).all()
    x, y = x.clone(), y.clone()
    x[0, 2, 1], y[2, 0] = math.nan, -math.inf
    out = OPS.energy_score(x, y, beta_t, prec, k, True, batch, False, True)
    assert torch.isnan(out[0]) and torch.isnan(out[2]) and torch.equal(out[1], clean[1])
    x, y, beta, metric = _case(seed, "shared_samples", "none")
    x[1, 0] = math.inf
    beta_t, _, prec, k, batch = _args(x, y, beta, metric)
    assert torch.isnan(OPS.energy_score(x, y, beta_t, prec, k, True, batch, False, True)).all()


def test_public_op_nan_rows_without_value_checks(monkeypatch, no_value_reads, seed):
    """The GPU regime (value checks off, nothing read back to the host): the front's NaN rows are
    the Python form's (``_range.nan_rows``), value and gradient."""
    no_value_reads()
    x, y, beta, metric = _case(seed, "plain", "diagonal")
    x[1, 0, 3], y[2, 1] = math.nan, math.inf

    def run(front: bool):
        monkeypatch.setitem(_front._FRONT, "energy_score", front)
        xg = x.clone().requires_grad_()
        v = etweedie.energy_score(xg, y, beta, metric, backend="cpu")
        (gx,) = torch.autograd.grad(v.nansum(), xg)
        return v.detach(), gx

    (v1, g1), (v2, g2) = run(True), run(False)
    assert torch.isnan(v1[1]) and torch.isnan(v1[2]) and torch.isfinite(v1[0])
    torch.testing.assert_close(v1, v2, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0, equal_nan=True)


def test_public_op_takes_the_front_in_eager_mode(monkeypatch, seed):
    """With energy_score()'s Python kernel path disabled the compiled backend's eager calls still
    work, value and gradient; the reference and a dense metric (whitened in Python) do not take it."""
    x, y, beta, metric = _case(seed, "plain", "block2")
    want = etweedie.energy_score(x, y, beta, metric, backend="cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("the Python kernel path ran")

    monkeypatch.setattr(ES, "_kernel", refuse)
    assert torch.equal(etweedie.energy_score(x, y, beta, metric, backend="cpu"), want)
    xg = x.clone().requires_grad_()
    etweedie.energy_score(xg, y, beta, metric, backend="cpu").sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    etweedie.energy_score(x, y, beta, metric, backend="reference")  # no kernel call at all
    dense = random_metric("dense", 0, x.shape[-1], gen(seed), dtype=torch.float32, per_row=False)
    with pytest.raises(AssertionError, match="Python kernel path"):
        etweedie.energy_score(x, y, beta, dense, backend="cpu")


def test_front_records_autograd_only_when_needed(seed):
    x, y, beta, metric = _case(seed, "plain", "diagonal")
    beta_t, _, prec, k, batch = _args(x, y, beta, metric)
    v = OPS.energy_score(x, y, beta_t, prec, k, True, batch, True, True)
    assert v.grad_fn is None and not v.requires_grad
    xg = x.clone().requires_grad_()
    v = OPS.energy_score(xg, y, beta_t, prec, k, True, batch, True, True)
    assert v.requires_grad and v.grad_fn is not None
    with torch.no_grad():
        assert not OPS.energy_score(xg, y, beta_t, prec, k, True, batch, True, True).requires_grad
    with torch.inference_mode():
        assert OPS.energy_score(x, y, beta_t, prec, k, True, batch, True, True).is_inference()


def test_fused_autograd_kernel_checks_its_flags(seed):
    """A gradient asked of an input whose unit gradient the forward was told not to compute is a
    named error, not a shape error or a silent zero."""
    x, y, beta, metric = _case(seed, "plain", "isotropic")
    beta_t, m, _, _, batch = _args(x, y, beta, metric)
    xs, yt, bs, ps, kk = _python_form(x, y, beta_t, m, batch)
    xs = xs.clone().requires_grad_()
    value = OPS.energy_score_fwd_grad(xs, yt, bs, ps, kk, True, False, False, False, False)[0]
    with pytest.raises(RuntimeError, match="need_samples was False"):
        value.sum().backward()
    # the unit-gradient outputs are not differentiable
    out = OPS.energy_score_fwd_grad(xs, yt, bs, ps, kk, True, True, False, False, False)
    assert out[0].requires_grad and not any(t.requires_grad for t in out[1:])


def test_fused_autograd_kernel_refuses_second_order(seed):
    x, y, beta, metric = _case(seed, "plain", "block2", dtype=torch.float64)
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(etweedie.energy_score(xg, y, beta, metric, backend="cpu").sum(), xg, create_graph=True)
    assert g.requires_grad
    with pytest.raises(NotImplementedError, match="energy_score: second-order derivatives are not supported"):
        torch.autograd.grad(g.sum(), xg)
    # without create_graph the gradient is a plain tensor
    (g,) = torch.autograd.grad(etweedie.energy_score(xg, y, beta, metric, backend="cpu").sum(), xg)
    assert not g.requires_grad


def test_front_op_rejects_bad_arguments_by_name():
    x, y, one = torch.randn(2, 3, 4), torch.randn(2, 4), torch.ones(())
    with pytest.raises(RuntimeError, match="metric kind must be 0, 1 or 2"):
        OPS.energy_score(x, y, one, one, 3, True, [2], False, False)
    with pytest.raises(RuntimeError, match="samples must be"):
        OPS.energy_score(torch.randn(4), y, one, one, 0, True, [2], False, False)
    with pytest.raises(RuntimeError):
        OPS.energy_score(x, y, one, one, 0, True, [5], False, False)  # a batch the inputs do not broadcast to


# ----------------------------------------------------------------------------- the plain call

def _plain_case(seed: int, kind: str, M: int = 8, d: int = 64, scale: float = 1.0):
    g = gen(seed)
    x = scale * torch.randn(4, M, d, generator=g)
    y = scale * torch.randn(4, d, generator=g)
    m = random_metric(kind, 0, d, g, dtype=torch.float32, per_row=False) if kind != "none" else None
    return x, y, m


def _value_and_grads(x, y, m, fair, backend, plain: bool, monkeypatch):
    if not plain:
        monkeypatch.setattr(ES, "_plain", lambda *a: None)
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = etweedie.energy_score(xg, yg, 1.3, m, fair=fair, backend=backend)
    gx, gy = torch.autograd.grad(v.sum(), (xg, yg))
    with torch.no_grad():
        v0 = etweedie.energy_score(x, y, 1.3, m, fair=fair, backend=backend)
    monkeypatch.undo()
    return v.detach(), gx, gy, v0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fair,M", [(True, 8), (False, 1), (True, 255)])
@pytest.mark.parametrize("case", ["plain", "far", "nan_row"])
@pytest.mark.parametrize("backend", [None, "cpu"])
def test_plain_call_equals_the_general_path(kind, fair, M, case, backend, monkeypatch, seed):
    """The plain CPU call (``_plain``: the Gram row kernel's domain) gives the general path's
    value and gradients bit for bit — clouds far from the origin and NaN rows included — and it
    is the path taken once β has been checked."""
    x, y, m = _plain_case(seed, kind, M=M, scale=1e20 if case == "far" else 1.0)
    if case == "nan_row":
        x[2, 0, 5] = math.nan
    general = _value_and_grads(x, y, m, fair, backend, False, monkeypatch)
    assert ES._plain(x, y, 1.3, m, fair, backend) is not None
    got = _value_and_grads(x, y, m, fair, backend, True, monkeypatch)
    for a, b in zip(got, general):
        assert torch.equal(a, b) or (a.isnan().any() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
    if case == "nan_row":
        assert got[0][2].isnan() and not got[0][[0, 1, 3]].isnan().any()


def test_plain_call_declines_what_it_does_not_cover(monkeypatch, seed):
    x, y, m = _plain_case(seed, "block2")
    etweedie.energy_score(x, y, 1.3, m)  # β = 1.3 now checked
    plain = lambda x, y, beta=1.3, m=m, fair=True, backend=None: ES._plain(x, y, beta, m, fair, backend)  # noqa: E731
    assert plain(x, y) is not None and plain(x, y, m=None) is not None
    mg = etweedie.Metric.block(m.param.clone().requires_grad_())
    declined = {
        "backend reference": plain(x, y, backend="reference"),
        "float64": plain(x.double(), y.double()),
        "d < 64": plain(x[..., :32], y[..., :32]),
        "M > 255": plain(x[:, :1].expand(4, 256, 64), y),
        "fair with M = 1": plain(x[:, :1], y),
        "fair not a bool": plain(x, y, fair=1),
        "tensor β": plain(x, y, beta=torch.tensor(1.3)),
        "unchecked β": plain(x, y, beta=1.2999),
        "shared samples": plain(x[0], y),
        "metric needing a gradient": plain(x, y, m=mg),
        "metric batch": plain(x, y, m=etweedie.Metric.isotropic(torch.ones(4))),
        "dense metric": plain(x, y, m=etweedie.Metric.dense(torch.eye(64))),
        "float64 metric": plain(x, y, m=etweedie.Metric.block(m.param.double())),
    }
    with etweedie.use_backend("reference"):
        declined["use_backend"] = plain(x, y)
    with torch.autograd.forward_ad.dual_level():
        declined["dual level"] = plain(x, y)
    monkeypatch.setenv("ETWEEDIE_BACKEND", "reference")
    declined["ETWEEDIE_BACKEND"] = plain(x, y)
    monkeypatch.delenv("ETWEEDIE_BACKEND")
    monkeypatch.setattr(ES, "_GRAM_ON", False)
    declined["ETWEEDIE_CPU_GRAM=0"] = plain(x, y)
    monkeypatch.undo()
    seen = []
    torch.func.vjp(lambda t: seen.append(plain(t, y)) or t, x)
    declined["functorch"] = seen[0]
    assert {k: v for k, v in declined.items() if v is not None} == {}
