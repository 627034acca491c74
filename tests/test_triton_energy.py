"""Triton energy_score / energy_distance kernels on CPU tensors under the Triton interpreter.

Forward and every gradient (samples/clouds, target, β, metric parameter) against the float64
reference (|out − ref64| ≤ 2|ref32 − ref64| + atol), on shapes that exercise the masks and
several programs: tile limits lowered (tiles of 4–8 points, coordinate chunks of 4) so that
d = 6 and 13 cut chunks, n ≠ m with odd and even tile counts (the circulant split of the
forward), M = 2, large n; coincident points, β = 1 and 2 (their exact branches) and per-row β,
per-row metrics of every kind, clouds 1e3 from the origin, zero-size batches, the fused
training op, gradcheck and torch.compile.

As in tests/test_triton.py, TRITON_INTERPRET=1 must be set when the process starts, so one
driver test reruns this file in a subprocess with it set.
"""

import pytest
import torch

import etweedie
from conftest import TRITON_INTERPRETING, gen, metric_to, run_file_under_interpreter, skip_unless_interpreting
from test_energy_distance import _check_all as _ed_check_all, _inputs as _ed_inputs
from test_energy_score import _check_all as _es_check_all, _inputs as _es_inputs

INTERPRET = TRITON_INTERPRETING
DEV = torch.device("cpu")

if INTERPRET:
    try:
        from etweedie.kernels import _energy as tk_energy
        from etweedie.kernels import energy_distance as tk_ed
        from etweedie.kernels import energy_score as tk_es
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"triton is not importable: {exc!r}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpreter_only(request):
    skip_unless_interpreting(request)


def test_cases_under_the_interpreter():
    """Run this file in a fresh interpreter-mode process (the real checks are the cases)."""
    run_file_under_interpreter(__file__)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 4 points (d ≤ 4) / 4 points and coordinate chunks of ≤ 4 (larger d)."""
    monkeypatch.setattr(tk_energy, "_MAX_TILE_SMALL", 4)
    monkeypatch.setattr(tk_energy, "_MAX_TILE_LARGE", 4)
    monkeypatch.setattr(tk_energy, "_TILE3", 64)
    monkeypatch.setattr(tk_energy, "_SPLIT_MAX_POINTS", 0)  # the tiled kernel, not the split one


@pytest.fixture
def split_spy(monkeypatch):
    """Counts the rows' trips through the split kernels; (NPP, W) tiles of 256 elements, so that
    d = 13 … 70 cut several chunks (W = 4 for 64 points, a chunk that splits 3×3 blocks)."""
    calls = []
    real = tk_energy._split_pairs
    monkeypatch.setattr(tk_energy, "_split_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(tk_energy, "_SPLIT_TILE", 256)
    return calls


def test_tile_sizes_follow_the_limits(small_tiles):
    assert tk_energy.tile_sizes(13, 1, 6) == (4, 1, 4, False)  # d = 6: chunks of 4 (+ masked 2)
    assert tk_energy.tile_sizes(9, 5, 2) == (4, 4, 2, True)


# ----------------------------------------------------------------------------- energy score

# isotropic (per-row p) and block2 run in the far-from-origin, fused and gradcheck cases below
ES_KINDS = ["none", "diagonal", "block3", "dense"]


@pytest.mark.parametrize("kind, d", [("block1", 5), ("block2", 2), ("block4", 4), ("block4", 12), ("diagonal", 3)])
def test_energy_score_metric_in_kernel(kind, d, small_tiles, seed):
    """The metric is applied in the kernel: k = 4 blocks whole in a chunk of 4 (d = 12) and on
    the small-d path (d = 4), a 1×1 block (run as an isotropic p), a diagonal on the small-d path."""
    _es_check_all("triton", DEV, _es_inputs(seed, 3, 9, d, kind), seed, f"triton {kind} d={d}")


@pytest.mark.parametrize("kind", ES_KINDS)
def test_energy_score_matches_float64_reference(kind, small_tiles, seed):
    # M = 13: 4 tiles of 4 (the last masked), d = 6: coordinate chunks 4 + 2
    _es_check_all("triton", DEV, _es_inputs(seed, 3, 13, 6, kind), seed, f"triton {kind}")


@pytest.mark.parametrize("shape", [(4, 2, 13), (3, 9, 2), (2, 33, 3)], ids=["M2-d13", "small-d", "one-tile-d3"])
def test_energy_score_shapes(shape, seed):
    # default tile limits: M = 2, d not a multiple of anything, small-d register path
    _es_check_all("triton", DEV, _es_inputs(seed, *shape, "diagonal"), seed, f"triton {shape}")


def test_energy_score_biased_and_M1(small_tiles, seed):
    _es_check_all("triton", DEV, _es_inputs(seed, 3, 7, 5, "isotropic"), seed, "triton fair=False", fair=False)
    x, y, b, _ = _es_inputs(seed, 3, 1, 5, "none")
    es = etweedie.energy_score(x, y, b, fair=False, backend="triton")
    torch.testing.assert_close(es, (x[:, 0] - y).norm(dim=-1).pow(b))


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("d", [3, 9])
def test_energy_score_coincident_points(beta, d, small_tiles, seed):
    x, y, b, metric = _es_inputs(seed, 3, 6, d, "block3" if d % 3 == 0 else "diagonal", beta=beta)
    x[:, 1] = x[:, 0]  # two coincident samples
    x[:, 2] = y  # a sample on the target
    _es_check_all("triton", DEV, (x, y, b, metric), seed, f"triton coincident beta={beta}")
    xs = y.float().unsqueeze(1).expand(3, 5, d).contiguous().requires_grad_()
    es = etweedie.energy_score(xs, y.float(), beta, backend="triton")
    (gx,) = torch.autograd.grad(es.sum(), xs)
    assert torch.equal(es, torch.zeros_like(es)) and torch.equal(gx, torch.zeros_like(gx))


def test_energy_score_far_from_origin(seed):
    _es_check_all("triton", DEV, _es_inputs(seed, 3, 9, 5, "isotropic", offset=1e3), seed, "triton offset 1e3")
    _es_check_all("triton", DEV, _es_inputs(seed, 2, 6, 4, "block2", offset=1e3), seed, "triton block offset 1e3")


def test_energy_score_fused_and_unfused_agree(seed):
    """The training op (value + unit gradients in one pass) against the fwd/bwd pair."""
    x, y, b, metric = _es_inputs(seed, 3, 6, 4, "block2")
    m, _ = metric_to(metric, torch.float64)
    from etweedie.ops._args import metric_param

    prec, kind = metric_param(m, torch.Size([3]), 4)
    prec = prec.contiguous()
    val, gs, gt, gb, gp = tk_es.energy_score_fwd_grad_op(x, y, b, prec, kind, True, True, True, True, True)
    torch.testing.assert_close(val, tk_es.energy_score_fwd_op(x, y, b, prec, kind, True))
    ones = torch.ones(3, dtype=torch.float64)
    for got, want in zip((gs, gt, gb, gp), tk_es.energy_score_bwd_op(ones, x, y, b, prec, kind, True, True, True, True, True)):
        torch.testing.assert_close(got, want)
    # only some gradients requested: the others are empty tensors
    out = tk_es.energy_score_fwd_grad_op(x, y, b, prec, kind, True, True, False, False, False)
    assert out[1].shape == x.shape and all(o.numel() == 0 for o in out[2:])


def test_energy_score_gradcheck_float64(seed):
    x, y, b, metric = _es_inputs(seed, 2, 3, 2, "block2")
    p = metric.param.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (x, y, b)]

    def f(x, y, b, p):
        return etweedie.energy_score(x, y, b, etweedie.Metric.block((p + p.transpose(-1, -2)) / 2), backend="triton")

    assert torch.autograd.gradcheck(f, (*leaves, p), fast_mode=True), f"seed {seed}"


def test_energy_score_zero_size():
    x = torch.zeros(0, 4, 3, requires_grad=True)
    y = torch.zeros(0, 3, requires_grad=True)
    es = etweedie.energy_score(x, y, 1.3, etweedie.Metric.diagonal(torch.ones(3)), backend="triton")
    assert es.shape == (0,)
    gx, gy = torch.autograd.grad(es.sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape


def test_energy_score_torch_compile_fullgraph(seed):
    x, y, _, metric = _es_inputs(seed, 3, 5, 4, "block2")
    x, y = x.float().requires_grad_(), y.float()
    m, _ = metric_to(metric, torch.float32)

    def f(x, y):
        return etweedie.energy_score(x, y, 1.4, m, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), f(x, y))
    (g1,) = torch.autograd.grad(compiled(x, y).sum(), x)
    (g2,) = torch.autograd.grad(f(x, y).sum(), x)
    torch.testing.assert_close(g1, g2)


# Rows of at most 64 points (both clouds) at d > 4 take the split kernels (_split_rows_kernel,
# _split_grad_kernel): every metric kind, one and several point tiles, 64 points, chunk edges.
SPLIT_ES = [("isotropic", 3, 13, 70), ("block2", 2, 32, 14), ("block3", 2, 40, 9), ("block4", 2, 5, 12),
            ("diagonal", 3, 63, 6), ("none", 2, 2, 5), ("dense", 2, 6, 5)]


@pytest.mark.parametrize("kind, B, M, d", SPLIT_ES, ids=[f"{k}-M{M}-d{d}" for k, _, M, d in SPLIT_ES])
def test_energy_score_split_kernels(kind, B, M, d, split_spy, seed):
    _es_check_all("triton", DEV, _es_inputs(seed, B, M, d, kind), seed, f"triton split {kind} M={M} d={d}")
    assert split_spy, "the split kernels did not run"


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_energy_score_split_kernels_coincident_points(beta, split_spy, seed):
    x, y, b, metric = _es_inputs(seed, 3, 6, 9, "block3", beta=beta)
    x[:, 1] = x[:, 0]
    x[:, 2] = y
    _es_check_all("triton", DEV, (x, y, b, metric), seed, f"triton split coincident beta={beta}")
    xs = y.float().unsqueeze(1).expand(3, 5, 9).contiguous().requires_grad_()
    es = etweedie.energy_score(xs, y.float(), beta, backend="triton")
    (gx,) = torch.autograd.grad(es.sum(), xs)
    assert torch.equal(es, torch.zeros_like(es)) and torch.equal(gx, torch.zeros_like(gx))
    assert split_spy


def test_energy_score_split_kernels_far_from_origin(split_spy, seed):
    _es_check_all("triton", DEV, _es_inputs(seed, 3, 9, 7, "isotropic", offset=1e3), seed,
                  "triton split offset 1e3")
    _es_check_all("triton", DEV, _es_inputs(seed, 2, 6, 8, "block2", offset=1e3), seed, "triton split block 1e3")
    assert split_spy


@pytest.mark.parametrize("kind, n, m, d", [("block2", 9, 14, 6), ("diagonal", 40, 24, 7), ("isotropic", 2, 3, 5)])
def test_energy_distance_split_kernels(kind, n, m, d, split_spy, seed):
    _ed_check_all("triton", DEV, _ed_inputs(seed, 2, n, m, d, kind), seed, f"triton split {kind} n={n} m={m}")
    _ed_check_all("triton", DEV, _ed_inputs(seed, 2, n, m, d, kind), seed, "triton split V", unbiased=False)
    assert split_spy


def test_split_kernels_can_be_turned_off(split_spy, monkeypatch, seed):
    """ETWEEDIE_TRITON_ENERGY_SPLIT=0 (A/B timing) keeps small clouds on the tiled kernel, same values."""
    x, y, b, metric = _es_inputs(seed, 2, 8, 9, "block3")
    m, _ = metric_to(metric, torch.float64)
    xs = x.clone().requires_grad_()
    on = etweedie.energy_score(xs, y, b, m, backend="triton")
    (g_on,) = torch.autograd.grad(on.sum(), xs)
    ran = len(split_spy)
    assert ran >= 1
    monkeypatch.setenv("ETWEEDIE_TRITON_ENERGY_SPLIT", "0")
    off = etweedie.energy_score(xs, y, b, m, backend="triton")
    (g_off,) = torch.autograd.grad(off.sum(), xs)
    assert len(split_spy) == ran
    torch.testing.assert_close(on, off, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_on, g_off, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- energy distance

# every metric kind once, on the small-d (registers) or the chunked (large-d) path
ED_CASES = {"none": (2, 9, 14, 2), "block2": (2, 9, 14, 2), "isotropic": (2, 6, 5, 6), "diagonal": (2, 6, 5, 6),
            "dense": (2, 6, 5, 6)}


@pytest.mark.parametrize("kind", list(ED_CASES))
def test_energy_distance_matches_float64_reference(kind, small_tiles, seed):
    # tiles of 4: n = 9 → 3 tiles (odd circulant), m = 14 → 4 tiles (even); d = 6 → chunks 4 + 2
    _ed_check_all("triton", DEV, _ed_inputs(seed, *ED_CASES[kind], kind), seed, f"triton {kind}")


def test_energy_distance_v_statistic_and_beta(small_tiles, seed):
    _ed_check_all("triton", DEV, _ed_inputs(seed, 2, 7, 10, 3, "diagonal"), seed, "triton V", unbiased=False)
    for beta in (1.0, 2.0):
        _ed_check_all("triton", DEV, _ed_inputs(seed, 2, 8, 5, 2, "block2", beta=beta), seed, f"triton beta={beta}")


def test_energy_distance_large_n(seed):
    """Default tiles (64 points): n = 300 → 5 tiles, m = 130 → 3 tiles; gradients on n = 150, m = 70."""
    _ed_check_all("triton", DEV, _ed_inputs(seed, 1, 300, 130, 2, "none"), seed, "triton large n", grads=False)
    _ed_check_all("triton", DEV, _ed_inputs(seed, 1, 150, 70, 2, "isotropic"), seed, "triton large n grads")


def test_energy_distance_coincident_and_far(small_tiles, seed):
    a, b, beta, metric = _ed_inputs(seed, 2, 6, 5, 3, "isotropic", beta=1.0)
    a[:, 1] = a[:, 0]
    b[:, 2] = a[:, 3]
    _ed_check_all("triton", DEV, (a, b, beta, metric), seed, "triton coincident")
    _ed_check_all("triton", DEV, _ed_inputs(seed, 2, 6, 9, 2, "diagonal", offset=1e3), seed, "triton offset 1e3")


def test_energy_distance_gradcheck_and_zero_size(seed):
    a, b, beta, metric = _ed_inputs(seed, 2, 3, 4, 2, "diagonal")
    p = metric.param.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (a, b, beta)]

    def f(a, b, beta, p):
        return etweedie.energy_distance(a, b, beta, etweedie.Metric.diagonal(p), backend="triton")

    assert torch.autograd.gradcheck(f, (*leaves, p), fast_mode=True), f"seed {seed}"
    a0 = torch.zeros(0, 4, 3, requires_grad=True)
    b0 = torch.zeros(0, 5, 3, requires_grad=True)
    ed = etweedie.energy_distance(a0, b0, 1.2, backend="triton")
    assert ed.shape == (0,)
    ga, gb = torch.autograd.grad(ed.sum(), (a0, b0))
    assert ga.shape == a0.shape and gb.shape == b0.shape


def test_host_functions_validate_canonical_arguments():
    a, b, one = torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.ones(2)
    with pytest.raises(ValueError, match="block precision"):
        tk_ed.energy_distance_forward(a, b, one, torch.ones(2, 3, 3), 2, True)
    with pytest.raises(ValueError, match="second cloud"):
        tk_ed.energy_distance_forward(a, torch.zeros(2, 5, 3), one, one, 0, True)
    with pytest.raises(ValueError, match="target"):
        tk_es.energy_score_forward(a, torch.zeros(2, 5), one, one, 0, True)
    with pytest.raises(ValueError, match="M >= 2"):
        tk_es.energy_score_forward(torch.zeros(2, 1, 4), torch.zeros(2, 4), one, one, 0, True)
