"""kernel_score and student_t_score (pure PyTorch): definitions, metric handling, the generic
potential path, gradients, and the score field as ∇ log of the Student-t density."""

import pytest
import torch

import etweedie
from conftest import gen, random_metric


def _direct_ks(x, y, P, fair=True):
    """The definition with an explicit dense precision, one row at a time."""
    M = x.shape[-2]
    def E(u):
        return torch.log1p((u @ P * u).sum(-1))
    cross = E(x - y).mean()
    within = E(x.unsqueeze(1) - x.unsqueeze(0))
    return cross - within.sum() / (2 * M * (M - 1) if fair else 2 * M * M)


@pytest.mark.parametrize("kind", ["none", "diagonal", "block2", "dense"])
@pytest.mark.parametrize("fair", [True, False])
def test_student_t_kernel_score_matches_definition(kind, fair, seed):
    g = gen(seed)
    B, M, d = 3, 6, 4
    x = torch.randn(B, M, d, generator=g, dtype=torch.float64)
    y = torch.randn(B, d, generator=g, dtype=torch.float64)
    metric = random_metric(kind, B, d, g)
    c = 2.5
    got = etweedie.kernel_score(x, y, metric=metric, c=c, fair=fair)
    eye = torch.eye(d, dtype=torch.float64)
    for b in range(B):
        P = eye if metric is None else etweedie.Metric(metric.kind, metric.param[b]).precision(d)
        torch.testing.assert_close(got[b], c * _direct_ks(x[b], y[b], P, fair))


def test_callable_potential_matches_student_t_and_differentiates(seed):
    g = gen(seed)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, generator=g, dtype=torch.float64)
    metric = random_metric("diagonal", 2, 3, g)
    ks = etweedie.kernel_score(x, y, metric=metric)
    ks_call = etweedie.kernel_score(x, y, lambda z: torch.log1p((z * z).sum(-1)), metric=metric)
    torch.testing.assert_close(ks_call, ks)
    assert torch.autograd.gradcheck(lambda x: etweedie.kernel_score(x, y, metric=metric), (x,))
    # energy-score potential through the generic path equals energy_score (β = 1)
    es = etweedie.kernel_score(x, y, lambda z: z.norm(dim=-1), metric=metric)
    torch.testing.assert_close(es, etweedie.energy_score(x, y, 1.0, metric, backend="reference"))


@pytest.mark.parametrize("kind", ["none", "isotropic", "block2", "dense"])
def test_student_t_score_is_grad_log_density(kind, seed):
    """With one draw, s(y) = ∇_y log q(y − x) for q(u) ∝ (1 + ‖u‖_P²)^{−c}; with N draws,
    the average of those gradients."""
    g = gen(seed)
    B, N, d = 3, 5, 4
    y = torch.randn(B, d, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(B, N, d, generator=g, dtype=torch.float64)
    metric = random_metric(kind, B, d, g)
    c = torch.tensor([2.1, 3.0, 7.5], dtype=torch.float64)
    s = etweedie.student_t_score(y, x, c, metric)
    u = y.unsqueeze(1) - x
    Pu = u if metric is None else metric.apply_precision(u, sample_dims=1)
    logq = -(c.unsqueeze(-1) * torch.log1p((u * Pu).sum(-1))).mean(1)
    (want,) = torch.autograd.grad(logq.sum(), y)
    torch.testing.assert_close(s, want)


def test_bad_input():
    x, y = torch.zeros(2, 4, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"c must be > d/2 = 1.5"):
        etweedie.student_t_score(y, x, 1.0)
    with pytest.raises(ValueError, match="fair=True needs M >= 2"):
        etweedie.kernel_score(x[:, :1], y)
    with pytest.raises(ValueError, match="potential must be 'student_t' or a callable"):
        etweedie.kernel_score(x, y, "gauss")
    with pytest.raises(ValueError, match="c must be > 0"):
        etweedie.kernel_score(x, y, c=-1.0)
    with pytest.raises(TypeError, match="target must have samples' dtype"):
        etweedie.kernel_score(x, y.double())
    for fair in (None, 1, "yes"):  # energy_score and energy_distance refuse a non-bool too
        with pytest.raises(TypeError, match="fair must be a bool"):
            etweedie.kernel_score(x, y, fair=fair)
    with pytest.raises(ValueError, match="the dimension d must be >= 1"):
        etweedie.kernel_score(torch.zeros(2, 4, 0), torch.zeros(2, 0))
