"""Backend discovery and dispatch (DESIGN §5)."""

import os

import pytest
import torch

import etweedie
from etweedie import backends


def test_available_reports_every_backend_with_a_reason():
    status = backends.available()
    assert set(status) == set(backends.BACKENDS)
    for name, (ok, why) in status.items():
        assert isinstance(ok, bool) and isinstance(why, str) and why, name
    assert status["reference"][0]


def test_automatic_choice_on_cpu():
    want = "cpu" if backends.available()["cpu"][0] else "reference"
    assert backends.resolve("et_score", torch.device("cpu")) == want


def test_explicit_requests_precedence(monkeypatch):
    y, x = torch.randn(2, 3), torch.randn(2, 4, 3)
    monkeypatch.setenv("ETWEEDIE_BACKEND", "reference")
    assert backends.resolve("et_score", y.device) == "reference"
    if backends.available()["cpu"][0]:
        with etweedie.use_backend("cpu"):  # context beats the environment
            assert backends.resolve("et_score", y.device) == "cpu"
            assert backends.resolve("et_score", y.device, "reference") == "reference"  # argument beats both
    monkeypatch.setenv("ETWEEDIE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ETWEEDIE_BACKEND"):
        etweedie.et_score(y, x, 1.0)


def test_unavailable_backend_raises_with_reason(monkeypatch):
    y, x = torch.randn(2, 3), torch.randn(2, 4, 3)
    for name in ("cuda", "triton"):
        ok, why = backends.available()[name]
        if ok:
            continue
        with pytest.raises(backends.BackendUnavailable, match="unavailable"):
            etweedie.et_score(y, x, 1.0, backend=name)
        with etweedie.use_backend(name), pytest.raises(backends.BackendUnavailable):
            etweedie.et_score(y, x, 1.0)
    with pytest.raises(ValueError, match="use_backend"):
        with etweedie.use_backend("fast"):
            pass


def test_backends_agree():
    g = torch.Generator().manual_seed(0)
    y, x = torch.randn(3, 5, generator=g), torch.randn(3, 9, 5, generator=g)
    ref = etweedie.et_score(y, x, 1.3, backend="reference")
    for name, (ok, _) in backends.available().items():
        if ok and name == "cpu":
            torch.testing.assert_close(etweedie.et_score(y, x, 1.3, backend=name), ref)


def test_an_explicit_request_under_torch_compile_is_checked_like_an_eager_one():
    y, x = torch.zeros(3, 2), torch.randn(3, 8, 2, generator=torch.Generator().manual_seed(0))
    for name in ("cuda", "triton"):
        if backends.available()[name][0] and torch.cuda.is_available():
            continue  # the request can run: nothing to refuse
        if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1" and backends.available()[name][0]:
            continue  # the interpreter runs Triton on CPU tensors: nothing to refuse
        f = torch.compile(lambda y, x, name=name: etweedie.et_score(y, x, beta=1.4, backend=name), backend="eager")
        with pytest.raises(backends.BackendUnavailable):
            f(y, x)


def test_use_backend_nests_restores_and_stays_in_its_thread(monkeypatch):
    import threading

    monkeypatch.delenv("ETWEEDIE_BACKEND", raising=False)
    cpu = torch.device("cpu")
    auto = backends.resolve("et_score", cpu)
    with etweedie.use_backend("reference"):
        seen = []
        worker = threading.Thread(target=lambda: seen.append(backends.resolve("et_score", cpu)))
        worker.start()
        worker.join()
        assert seen == [auto]  # a context is per thread (contextvars), never process-wide
        with etweedie.use_backend(None):  # drops the enclosing request
            assert backends.resolve("et_score", cpu) == auto
        with pytest.raises(KeyError), etweedie.use_backend("reference"):
            raise KeyError  # an exception inside still restores
        assert backends.resolve("et_score", cpu) == "reference"
    assert backends.resolve("et_score", cpu) == auto
