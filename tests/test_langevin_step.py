"""langevin_step: fused score + update against the float64 reference, gradients, opcheck."""

import math

import pytest
import torch

import etweedie
from conftest import (
    BACKEND_DEVICE,
    BACKEND_IDS,
    LOW_PRECISION,
    LOW_PRECISION_IDS,
    assert_close_to_ref,
    assert_low_precision_close,
    gen,
    metric_to,
    random_metric,
)


def _inputs(seed, B, N, d, kind):
    g = gen(seed)
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    x = y.unsqueeze(1) + 0.5 * torch.randn(B, N, d, generator=g, dtype=torch.float64)
    xi = torch.randn(B, d, generator=g, dtype=torch.float64)
    step = 0.01 + 0.1 * torch.rand(B, generator=g, dtype=torch.float64)
    beta = 0.9 + torch.rand(B, generator=g, dtype=torch.float64)
    lam = 0.5 + torch.rand(B, generator=g, dtype=torch.float64)
    return y, x, xi, step, beta, lam, random_metric(kind, B, d, g)


def _run(backend, device, dtype, args, metric, x_dtype=None):
    """Step and gradients at dtype (the draws, args[1], at x_dtype when given: 16-bit draws)."""
    leaves = [t.detach().to(device=device, dtype=dtype if i != 1 or x_dtype is None else x_dtype).clone().requires_grad_()
              for i, t in enumerate(args)]
    m, p = metric_to(metric, dtype, device, requires_grad=True)
    out = etweedie.langevin_step(*leaves, metric=m, backend=backend)
    up = torch.cos(torch.arange(out.numel(), dtype=dtype, device=device)).reshape(out.shape)
    grads = list(torch.autograd.grad((out * up).sum(), leaves + [p]))
    if m.kind == "dense":
        grads[-1] = (grads[-1] + grads[-1].transpose(-1, -2)) / 2
    return out, grads


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "dense"])
def test_matches_float64_reference(backend, device, kind, seed):
    y, x, xi, step, beta, lam, metric = _inputs(seed, 4, 21, 6, kind)
    args = (y, x, xi, step, beta, lam)
    out, gout = _run(backend, device, torch.float32, args, metric)
    r32, g32 = _run("reference", "cpu", torch.float32, args, metric)
    r64, g64 = _run("reference", "cpu", torch.float64, args, metric)
    assert_close_to_ref(out, r32, r64, name=f"langevin[{kind}]", seed=seed)
    for name, a, b, c in zip(["y", "x", "noise", "step", "beta", "lam", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}[{kind}]", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_equals_score_then_update(backend, device, seed):
    y, x, xi, step, beta, lam, metric = _inputs(seed, 5, 13, 4, "block2")
    y, x, xi, step, beta, lam = (t.to(device) for t in (y, x, xi, step, beta, lam))
    metric = etweedie.Metric(metric.kind, metric.param.to(device))
    s = etweedie.et_score(y, x, beta, lam, metric, backend=backend)
    want = y + step[:, None] * s + torch.sqrt(2 * step[:, None]) * xi
    torch.testing.assert_close(etweedie.langevin_step(y, x, xi, step, beta, lam, metric, backend=backend), want)
    # scalar step broadcast
    torch.testing.assert_close(
        etweedie.langevin_step(y, x, xi, 0.05, beta, lam, metric, backend=backend),
        y + 0.05 * s + math.sqrt(0.1) * xi,
    )


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_gradcheck_and_zero_size(backend, device, seed):
    y, x, xi, step, beta, lam, metric = _inputs(seed, 2, 4, 4, "isotropic")
    leaves = [t.to(device).requires_grad_() for t in (y, x, xi, step, beta, lam)]
    m = etweedie.Metric("isotropic", metric.param.to(device).requires_grad_())
    f = lambda *a: etweedie.langevin_step(*a[:6], etweedie.Metric("isotropic", a[6]), backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(f, (*leaves, m.param)), f"seed {seed}"
    z = torch.zeros(0, 3, device=device)
    assert etweedie.langevin_step(z, torch.zeros(0, 2, 3, device=device), z, 0.1, 1.2, backend=backend).shape == (0, 3)


def test_opcheck(seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, xi, step, beta, lam, metric = _inputs(seed, 3, 5, 4, "block2")
    c = canonicalize("langevin_step", y, x, beta, lam, metric)
    args = [t.clone().requires_grad_() for t in (c.y, c.x, xi, step, c.beta, c.lam, c.prec.contiguous())] + [c.kind]
    torch.library.opcheck(torch.ops.etweedie.langevin_step_fwd.default, args)


def test_bad_input():
    y, x = torch.zeros(2, 3), torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="noise must have y's shape"):
        etweedie.langevin_step(y, x, torch.zeros(3), 0.1, 1.0)
    with pytest.raises(ValueError, match="step must be > 0"):
        etweedie.langevin_step(y, x, torch.zeros(2, 3), 0.0, 1.0)
    with pytest.raises(TypeError, match="noise must be float32 or float64"):
        etweedie.langevin_step(y, x, torch.zeros(2, 3, dtype=torch.int64), 0.1, 1.0)
    with pytest.raises(ValueError, match="batch shapes do not broadcast"):
        etweedie.langevin_step(y, x, torch.zeros(2, 3), torch.ones(4), 1.0)
    # nothing may enlarge y's batch: the output would not be y's shape and the noise would repeat
    with pytest.raises(ValueError, match=r"step of shape \(2, 1\) would enlarge the batch"):
        etweedie.langevin_step(y, x, torch.zeros(2, 3), torch.ones(2, 1), 1.0)
    for kw in ({"beta": torch.ones(2, 1)}, {"lam": torch.ones(2, 1)},
               {"metric": etweedie.Metric.isotropic(torch.ones(2, 1))}):
        with pytest.raises(ValueError, match=r"must not enlarge y's batch \(2,\) \(they broadcast to \(2, 2\)\)"):
            etweedie.langevin_step(y, x, torch.zeros(2, 3), 0.1, **{"beta": 1.0, **kw})
    with pytest.raises(ValueError, match="must not enlarge y's batch"):
        etweedie.langevin_step(torch.zeros(3), x, torch.zeros(3), 0.1, 1.0)


# ---------------------------------------------------------------------------- 16-bit draws
# bfloat16/float16 draws with a float32 state (the sampler's bf16 mode): the step accumulates in
# float32, returns float32, and gives ∂L/∂x in the draws' dtype (etweedie/ops/_args.py).


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind,beta", [("isotropic", None), ("block2", 1.0), ("diagonal", 2.0), ("dense", None)])
def test_low_precision_draws_match_float64_reference(backend, device, x_dtype, kind, beta, seed):
    y, x, xi, step, b, lam, metric = _inputs(seed, 4, 21, 6, kind)
    if beta is not None:
        b = torch.full_like(b, beta)
    if kind != "dense":  # (dense: y and x are whitened by separate GEMMs, so a coincident draw is not exact)
        y = y.to(x_dtype).double()  # queries on the 16-bit grid
        x[:, 5] = y  # a draw exactly on its query
    x16 = x.to(x_dtype)
    out, gout = _run(backend, device, torch.float32, (y, x16, xi, step, b, lam), metric, x_dtype=x_dtype)
    r32, g32 = _run("reference", "cpu", torch.float32, (y, x16, xi, step, b, lam), metric, x_dtype=x_dtype)
    r64, g64 = _run("reference", "cpu", torch.float64, (y, x16.double(), xi, step, b, lam), metric)
    assert_low_precision_close(out, gout, (r32, g32), (r64, g64), ["y", "x", "noise", "step", "beta", "lam", "metric"],
                               what=f"langevin[{x_dtype} {kind}]", x_dtype=x_dtype, seed=seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_broadcast_and_zero_size(backend, device, x_dtype, seed):
    g = gen(seed)
    y = torch.randn(5, 6, generator=g).to(device)
    cloud = torch.randn(9, 6, generator=g).to(device, x_dtype)  # shared by every state (stride 0 over B)
    xi = torch.randn(5, 6, generator=g).to(device)
    got = etweedie.langevin_step(y, cloud, xi, 0.05, 1.4, backend=backend)
    want = etweedie.langevin_step(y, cloud.float().expand(5, 9, 6), xi, 0.05, 1.4, backend=backend)
    torch.testing.assert_close(got, want, msg=f"seed {seed}")
    z = torch.zeros(0, 3, device=device)
    out = etweedie.langevin_step(z, torch.zeros(0, 2, 3, device=device, dtype=x_dtype), z, 0.1, 1.2, backend=backend)
    assert out.shape == (0, 3) and out.dtype == torch.float32


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_opcheck_low_precision_draws(x_dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, xi, step, beta, lam, metric = _inputs(seed, 3, 5, 4, "block2")
    m, _ = metric_to(metric, torch.float32)
    c = canonicalize("langevin_step", y.float(), x.to(x_dtype), beta.float(), lam.float(), m)
    args = [t.clone().requires_grad_() for t in (c.y, c.x, xi.float(), step.float(), c.beta, c.lam, c.prec.contiguous())]
    torch.library.opcheck(torch.ops.etweedie.langevin_step_fwd.default, args + [c.kind])
