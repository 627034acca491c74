"""student_t_score: every backend and every gradient against the float64 reference.

Covers isotropic/diagonal/block/dense metrics (per row and shared), small and large d, N = 1
and N over several tiles, coincident draws, broadcast (stride-0) and non-contiguous clouds,
zero-size batches, float64 gradcheck, torch.library.opcheck, bad input (public and raw op),
NaN propagation, the former import path, and the CUDA sources' layering.  The Triton kernels
run here under TRITON_INTERPRET=1 (the driver test reruns this file's Triton cases in a
subprocess with it set).
"""

import os
import re

import pytest
import torch

import etweedie
from conftest import (
    BACKEND_DEVICE,
    BACKEND_IDS,
    LOW_PRECISION,
    LOW_PRECISION_IDS,
    TRITON_INTERPRETING,
    assert_close_to_ref,
    assert_low_precision_close,
    gen,
    metric_to,
    random_metric,
)

KINDS = ["none", "isotropic", "diagonal", "block2", "block3", "dense"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(seed, B, N, d, kind, per_row=True):
    g = gen(seed)
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    x = y.unsqueeze(1) + 0.4 * torch.randn(B, N, d, generator=g, dtype=torch.float64)
    c = d / 2 + 0.5 + 2 * torch.rand(B, generator=g, dtype=torch.float64)
    metric = random_metric(kind, B, d, g, per_row=per_row)
    return y, x, c, metric


def _run(backend, device, dtype, y, x, c, metric, x_dtype=None, metric_grad=True):
    """Score and its gradients wrt y, x, c and (metric_grad) the metric parameter at dtype (x at
    x_dtype when given)."""
    leaves = [t.detach().to(device=device, dtype=dtype if i != 1 or x_dtype is None else x_dtype).clone().requires_grad_()
              for i, t in enumerate((y, x, c))]
    m, p = metric_to(metric, dtype, device, requires_grad=metric_grad)
    s = etweedie.student_t_score(*leaves, metric=m, backend=backend)
    up = torch.linspace(-1, 1, s.numel(), dtype=dtype, device=device).reshape(s.shape)
    inputs = leaves + ([p] if p is not None and metric_grad else [])
    grads = list(torch.autograd.grad((s * up).sum(), inputs))
    if m is not None and m.kind == "dense":
        grads[-1] = (grads[-1] + grads[-1].transpose(-1, -2)) / 2  # only the symmetric part is defined
    return s, grads


def _check(backend, device, args, tag, seed, metric_grad=True):
    out, gout = _run(backend, device, torch.float32, *args, metric_grad=metric_grad)
    r32, g32 = _run("reference", "cpu", torch.float32, *args, metric_grad=metric_grad)
    r64, g64 = _run("reference", "cpu", torch.float64, *args, metric_grad=metric_grad)
    assert_close_to_ref(out, r32, r64, name=f"score{tag}", seed=seed)
    for name, a, b, c in zip(["y", "x", "c", "metric"], gout, g32, g64):
        assert_close_to_ref(a, b, c, name=f"grad {name}{tag}", seed=seed, atol_scale=3e-5)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(4, 9, 6), (3, 70, 42), (2, 1, 96)], ids=["small", "tiles", "one-draw-large-d"])
def test_matches_float64_reference(backend, device, kind, shape, seed):
    B, N, d = shape
    _check(backend, device, _inputs(seed, B, N, d, kind), f"[{backend} {kind} {shape}]", seed)


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "block4"])
@pytest.mark.parametrize("shape", [(3, 70, 48), (2, 9, 784)], ids=["d48", "d784"])
def test_backward_in_register_lanes(kind, shape, seed):
    """d a multiple of 16 and no metric gradient: the CPU backward's register sweeps (et_score's,
    lanes16_cpu.h), single draws after the four-draw groups and one draw on its query."""
    B, N, d = shape
    y, x, c, metric = _inputs(seed, B, N, d, kind)
    x[:, 4] = y
    _check("cpu", "cpu", (y, x, c, metric), f"[bwd lanes {kind} {shape}]", seed, metric_grad=False)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["block2", "dense"])
def test_far_from_origin(backend, device, kind, seed):
    """Queries and draws 1e3 from the origin (a dense metric whitens y − c and x − c, c the query)."""
    y, x, c, metric = _inputs(seed, 3, 33, 48, kind)
    y, x = (y + 1e3).float().double(), (x + 1e3).float().double()
    _check(backend, device, (y, x, c, metric), f"[{kind} 1e3]", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("kind", ["isotropic", "block2"])
def test_shared_metric_and_coincident_draws(backend, device, kind, seed):
    """A metric shared by all rows (stride 0 over B) and draws equal to the query (w = 1, u = 0)."""
    y, x, c, metric = _inputs(seed, 5, 12, 8, kind, per_row=False)
    x[:, 3] = y
    x[2, :] = y[2]
    _check(backend, device, (y, x, c, metric), f"[{backend} shared {kind}]", seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_broadcast_and_noncontiguous(backend, device, seed):
    """One cloud for many queries (a stride-0 batch, never copied) and a non-contiguous y."""
    g = gen(seed)
    x = torch.randn(1, 16, 10, generator=g).to(device)
    y = torch.randn(10, 6, generator=g).t().to(device)  # (6, 10), non-contiguous
    c = torch.tensor(6.0)
    out = etweedie.student_t_score(y, x.expand(6, 16, 10), c, backend=backend)
    ref = etweedie.student_t_score(y.double().cpu(), x.double().cpu().expand(6, 16, 10), c.double(), backend="reference")
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
def test_zero_size_batch(backend, device):
    y = torch.zeros(0, 3, device=device, requires_grad=True)
    x = torch.zeros(0, 4, 3, device=device, requires_grad=True)
    s = etweedie.student_t_score(y, x, 2.0, backend=backend)
    assert s.shape == (0, 3)
    gy, gx = torch.autograd.grad(s.sum(), (y, x))
    assert gy.shape == (0, 3) and gx.shape == (0, 4, 3)


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2", "dense"])
def test_gradcheck_float64(kind, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    y, x, c, metric = _inputs(seed, 2, 5, 4, kind)
    m, p = metric_to(metric, torch.float64, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (y, x, c)]

    def f(y_, x_, c_, p_):
        # symmetrize so finite differences stay inside the SPD cone
        param = p_ if m.kind in ("isotropic", "diagonal") else (p_ + p_.transpose(-1, -2)) / 2
        return etweedie.student_t_score(y_, x_, c_, etweedie.Metric(m.kind, param), backend="cpu")

    assert torch.autograd.gradcheck(f, (*leaves, p)), f"gradcheck failed (seed {seed})"


@pytest.mark.parametrize("kind", ["isotropic", "diagonal", "block2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(kind, dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, c, metric = _inputs(seed, 3, 6, 4, kind)
    m, _ = metric_to(metric, dtype)
    cn = canonicalize("student_t_score", y.to(dtype), x.to(dtype), 2.0, 1.0, m)
    args = [t.clone().requires_grad_() for t in (cn.y, cn.x, c.to(dtype), cn.prec.contiguous())] + [cn.kind]
    torch.library.opcheck(torch.ops.etweedie.student_t_score_fwd.default, args)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
@pytest.mark.parametrize("kind", ["none", "block2", "dense"])
def test_low_precision_draws_match_float64_reference(backend, device, x_dtype, kind, seed):
    """16-bit draws with float32 queries (the dtype rule of etweedie/ops/_args.py): float32 sums
    and score, ∂L/∂x in the draws' dtype; held to the float64 reference on the draws' exact values."""
    y, x, c, metric = _inputs(seed, 3, 70, 42, kind)
    x16 = x.to(x_dtype)
    x16[:, 7] = y.to(x_dtype)  # a coincident draw
    out, gout = _run(backend, device, torch.float32, y, x16, c, metric, x_dtype=x_dtype)
    r32, g32 = _run("reference", "cpu", torch.float32, y, x16, c, metric, x_dtype=x_dtype)
    r64, g64 = _run("reference", "cpu", torch.float64, y, x16.double(), c, metric)
    assert_low_precision_close(out, gout, (r32, g32), (r64, g64), ["y", "x", "c", "metric"],
                               what=f"score[{x_dtype} {kind}]", x_dtype=x_dtype, seed=seed)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICE, ids=BACKEND_IDS)
@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_low_precision_draws_broadcast_and_zero_size(backend, device, x_dtype, seed):
    g = gen(seed)
    x = torch.randn(1, 16, 10, generator=g).to(device, x_dtype).expand(6, 16, 10)  # stride 0 over B
    y = torch.randn(10, 6, generator=g).t().to(device)  # non-contiguous
    torch.testing.assert_close(etweedie.student_t_score(y, x, 6.0, backend=backend),
                               etweedie.student_t_score(y, x.float(), 6.0, backend=backend), msg=f"seed {seed}")
    z = torch.zeros(0, 3, device=device, requires_grad=True)
    xz = torch.zeros(0, 4, 3, device=device, dtype=x_dtype, requires_grad=True)
    s = etweedie.student_t_score(z, xz, 2.0, backend=backend)
    gz, gx = torch.autograd.grad(s.sum(), (z, xz))
    assert s.shape == (0, 3) and gx.shape == (0, 4, 3) and gx.dtype == x_dtype


@pytest.mark.parametrize("x_dtype", LOW_PRECISION, ids=LOW_PRECISION_IDS)
def test_opcheck_low_precision_draws(x_dtype, seed):
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    from etweedie.ops._rows import canonicalize

    y, x, c, metric = _inputs(seed, 3, 6, 4, "block2")
    m, _ = metric_to(metric, torch.float32)
    cn = canonicalize("student_t_score", y.float(), x.to(x_dtype), 2.0, 1.0, m)
    args = [t.clone().requires_grad_() for t in (cn.y, cn.x, c.float(), cn.prec.contiguous())] + [cn.kind]
    torch.library.opcheck(torch.ops.etweedie.student_t_score_fwd.default, args)


def test_nan_propagates():
    """A NaN draw makes its row's score NaN (never a silent finite value); other rows stay finite."""
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    y, x, c, metric = _inputs(0, 3, 8, 40, "block2")
    x[1, 4, 7] = float("nan")
    m, _ = metric_to(metric, torch.float32)
    from etweedie.ops import _args

    prec, kind = _args.metric_param(m, torch.Size([3]), 40)
    s, _m = torch.ops.etweedie.student_t_score_fwd(y.float(), x.float(), c.float(), prec, kind)
    assert torch.isnan(s[1]).all() and torch.isfinite(s[[0, 2]]).all()


def test_bad_input():
    y, x = torch.zeros(2, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="c must be > d/2"):
        etweedie.student_t_score(y, x, 1.5)
    with pytest.raises(ValueError, match="c"):
        etweedie.student_t_score(y, x, -1.0)
    with pytest.raises(ValueError, match="x must have shape"):
        etweedie.student_t_score(y, torch.zeros(2, 3, 5), 3.0)
    with pytest.raises(TypeError, match="x must have y's dtype torch.float32 or be bfloat16 or float16"):
        etweedie.student_t_score(y, x.double(), 3.0)
    with pytest.raises(TypeError, match="y must be float32 or float64, got torch.bfloat16"):
        etweedie.student_t_score(y.bfloat16(), x.bfloat16(), 3.0)
    with pytest.raises(ValueError, match="broadcast|enlarge"):
        etweedie.student_t_score(y, x, torch.full((3,), 3.0))


@pytest.mark.parametrize("backend", ["reference", None])
def test_unbatched_query_keeps_the_metric_batch(backend):
    """A 1-D query with a 2-D cloud and a metric with a batch: the metric's batch is the output's,
    as for et_score (one score per metric), not just its first row."""
    g = gen(5)
    y, x = torch.randn(4, generator=g), torch.randn(5, 4, generator=g)
    for m in (etweedie.Metric.isotropic(torch.tensor([0.5, 1.0, 2.0])), etweedie.Metric.diagonal(torch.rand(3, 4, generator=g) + 0.5)):
        s = etweedie.student_t_score(y, x, 3.0, m, backend=backend)
        assert s.shape == (3, 4)
        for r in range(3):
            row = etweedie.Metric(m.kind, m.param[r])
            torch.testing.assert_close(s[r], etweedie.student_t_score(y, x, 3.0, row, backend="reference"))


def test_c_is_checked_as_rounded_on_every_call():
    """c just above d/2 that rounds to d/2 in float32 is refused on every call: the plain CPU call
    checks the rounded c as the general path does, not the Python float."""
    y, x = torch.zeros(3, 4), torch.ones(3, 5, 4)
    for _ in range(3):
        with pytest.raises(ValueError, match=r"c must be > d/2 = 2 .*got 2.0000001, which is 2.0 in torch.float32"):
            etweedie.student_t_score(y, x, 2.0000001)
    etweedie.student_t_score(torch.zeros(3, 2), torch.ones(3, 5, 2), 1.50000001)  # passes for d = 2 (c > 1) ...
    with pytest.raises(ValueError, match="c must be > d/2 = 1.5"):
        etweedie.student_t_score(torch.zeros(3, 3), torch.ones(3, 5, 3), 1.50000001)  # ... and not for d = 3


def test_raw_op_checks_every_argument():
    """The registered entry raises a named error (never reads out of bounds) for bad arguments."""
    if "cpu" not in [b for b, _ in BACKEND_DEVICE]:
        pytest.skip("compiled extension not available")
    op = torch.ops.etweedie.student_t_score_fwd
    y, x, c, p = torch.zeros(2, 4), torch.zeros(2, 3, 4), torch.ones(2), torch.ones(2)
    bad = [
        ((y, x, c, p, 5), "unknown metric kind"),
        ((y, x, c, torch.ones(2, 3, 3), 2), "block size k must be in \\[1, 4\\] and divide d = 4"),
        ((y, x, c, torch.ones(2, 2, 3), 2), "a block precision must have shape"),
        ((y, x, c, torch.ones(2, 5), 1), "a diagonal precision must have shape"),
        ((y, x, torch.ones(3), p, 0), r"c must have shape \(B,\) = \(2\)"),
        ((y, x, c, torch.ones(3), 0), r"an isotropic precision must have shape \(B,\) = \(2\)"),
        ((y, torch.zeros(2, 3, 5), c, p, 0), r"x must have shape \(B, N, d\)"),
        ((y, x.double(), c, p, 0), "x must have y's dtype Float or be bfloat16 or float16, got Double"),
        ((y, x, c.double(), p, 0), "c must have y's dtype"),
        ((y.t(), x, c, p, 0), "y must be contiguous"),
        ((y, torch.zeros(2, 4, 3).transpose(1, 2), c, p, 0), "unit stride"),
        ((y, torch.zeros(2, 0, 4), c, p, 0), "x must hold at least one posterior draw"),
        ((y.int(), x, c, p, 0), "y must be float32 or float64"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            op(*args)
    bwd = torch.ops.etweedie.student_t_score_bwd
    with pytest.raises(RuntimeError, match=r"student_t_score: grad must have shape \[2, 4\]"):
        bwd(torch.zeros(3, 4), y, y, x, c, p, 0, y, True, True, True, True)
    with pytest.raises(RuntimeError, match="student_t_score: grad_m must have y's dtype"):
        bwd(y, y.double(), y, x, c, p, 0, y, True, True, True, True)


def test_former_import_path():
    """student_t_score moved to its own stem; kernel_score's import and the public name still work."""
    from etweedie.ops.kernel_score import student_t_score as old
    from etweedie.ops.student_t_score import student_t_score as new

    assert old is new is etweedie.student_t_score
    out = etweedie.student_t_score(torch.zeros(1, 1), torch.ones(1, 1, 1), c=1.0)
    torch.testing.assert_close(out, torch.tensor([[1.0]]))


def test_cuda_sources_layering():
    """The CUDA source compiles with plain nvcc (no torch headers); its launchers are defined
    and instantiated for float and double, each with draws of its own dtype, bfloat16 or float16;
    the binding registers both ops under CUDA."""
    cu = open(os.path.join(ROOT, "csrc", "cuda", "student_t_score_cuda.cu")).read()
    launch = open(os.path.join(ROOT, "csrc", "cuda", "launchers.cuh")).read()
    bind = open(os.path.join(ROOT, "csrc", "cuda", "student_t_score_bindings.cpp")).read()
    for src in (cu, launch):
        includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', src, re.M)
        assert not [h for h in includes if h.split("/")[0] in ("torch", "ATen", "c10")]
    from test_cuda_sources import instantiations

    want = {(t, x) for t in ("float", "double") for x in (t, "bf16", "fp16")}  # 16-bit draws of either
    for name in ("student_t_score_fwd_launch", "student_t_score_bwd_launch"):
        assert re.search(rf"cudaError_t\s+{name}\s*\(", launch)
        assert instantiations(cu, name) == want, name
    assert set(re.findall(r'm\.impl\("(\w+)"', bind)) == {"student_t_score_fwd", "student_t_score_bwd"}


def test_triton_under_the_interpreter():
    """Rerun this file's Triton cases with TRITON_INTERPRET=1 set from process start (the metric
    kinds isotropic and block3 are left to the CPU and CUDA runs: the interpreter is slow, and
    the Triton code paths they take are those of the none and block2 cases)."""
    import subprocess
    import sys

    if TRITON_INTERPRETING:
        pytest.skip("already running under TRITON_INTERPRET=1")
    ok, why = etweedie.backends.available()["triton"]
    if not ok and "not installed" in why:
        pytest.skip(why)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.basename(__file__), "-k",
         "triton-cpu and not block3 and not isotropic-"],
        cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\b\d+ passed", proc.stdout) and " failed" not in proc.stdout, tail
