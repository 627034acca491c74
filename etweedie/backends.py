"""Backend discovery and dispatch (DESIGN §5).

Backends: ``"reference"`` (pure PyTorch, float64-capable, the spec), ``"cpu"`` (the C++
extension), ``"cuda"`` (the CUDA C++ extension) and ``"triton"``.

Choice per call, from the tensors' device and what loaded:

* CPU tensors  → ``cpu`` if the extension loaded, else ``reference``;
* CUDA tensors → ``cuda`` → ``triton`` → ``reference``.

An explicit request — the ``backend=`` argument of an op, the :func:`use_backend` context,
or the ``ETWEEDIE_BACKEND`` environment variable, in that order of precedence — is honoured
or fails with the reason the backend is unavailable; it never silently falls back.

    >>> import etweedie
    >>> etweedie.backends.available()["reference"]
    (True, 'pure PyTorch')
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import os
import warnings
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ["BACKENDS", "available", "use_backend", "resolve", "BackendUnavailable", "ExtensionNotLoadedWarning"]

BACKENDS = ("reference", "cpu", "cuda", "triton")

_requested: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("etweedie_backend", default=None)


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here (the message says why)."""


class ExtensionNotLoadedWarning(UserWarning):
    """The compiled extension etweedie._C is missing or failed to load; the ops use other backends."""


_REBUILD = (
    "with a C++17 compiler (g++ or clang++) and torch installed, reinstall from the source with "
    "`pip install --no-build-isolation .` (in a checkout: `pip install --no-build-isolation -e .`)"
)


def _load_extension() -> Tuple[bool, str]:
    try:
        importlib.import_module("etweedie._C")
    except ModuleNotFoundError as exc:
        if exc.name != "etweedie._C":
            return False, f"etweedie._C failed to load: {exc!r}; rebuild it: {_REBUILD}"
        return False, f"the C++ extension etweedie._C is not built (installed without a compiler?); to build it: {_REBUILD}"
    except Exception as exc:  # ImportError (e.g. built against another torch), or an OSError from a broken build
        return False, f"etweedie._C failed to load: {exc!r} (built against another torch?); rebuild it: {_REBUILD}"
    return True, "C++ extension etweedie._C"


_EXT_OK, _EXT_WHY = _load_extension()
if not _EXT_OK:
    # Once per process (module import): the package still works on the reference/Triton backends.
    warnings.warn(
        f"etweedie: CPU ops run on the pure-PyTorch reference backend (slower): {_EXT_WHY}",
        ExtensionNotLoadedWarning,
        stacklevel=2,
    )


def _has_op(name: str, dispatch_key: str) -> bool:
    if not _EXT_OK:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"etweedie::{name}", dispatch_key)
    except RuntimeError:
        return False


def _triton_status() -> Tuple[bool, str]:
    try:
        importlib.import_module("triton")
    except Exception as exc:
        return False, f"triton is not installed ({exc.__class__.__name__})"
    try:
        # find_spec of a submodule would import the package; locate its file instead
        spec = importlib.util.find_spec("etweedie.kernels")
        have = spec is not None and any(
            os.path.exists(os.path.join(loc, "et_score.py")) for loc in (spec.submodule_search_locations or ())
        )
    except Exception as exc:
        return False, f"etweedie.kernels failed to import: {exc!r}"
    if not have:
        return False, "the Triton kernels (etweedie.kernels) are not part of this install"
    # etweedie.kernels is located, not imported: triton fixes compiled-vs-interpreted when a
    # kernel is defined, so importing here could lock in the wrong mode before a caller sets
    # TRITON_INTERPRET.  Only the torch build is consulted, never a GPU.
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "triton (interpreter mode, TRITON_INTERPRET=1; runs on CPU tensors)"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False, "torch is a CPU-only build: compiled Triton needs CUDA tensors (set TRITON_INTERPRET=1 to interpret on CPU)"
    return True, "triton (compiled; needs CUDA tensors)"


def available() -> Dict[str, Tuple[bool, str]]:
    """Map every backend name to ``(usable, reason)``. Queries no GPU (at import or here)."""
    return dict(_available_cached(os.environ.get("TRITON_INTERPRET")))


def _cpu_available() -> bool:
    return _EXT_OK and _has_op("et_score_fwd", "CPU")


@functools.lru_cache(maxsize=None)
def _available_cached(_triton_interpret: Optional[str]) -> Tuple[Tuple[str, Tuple[bool, str]], ...]:
    cuda_ok = _has_op("et_score_fwd", "CUDA")
    if cuda_ok:
        cuda_why = "CUDA kernels in etweedie._C"
    elif not _EXT_OK:
        cuda_why = _EXT_WHY
    elif torch.version.cuda is None:
        cuda_why = "torch is a CPU-only build (torch.version.cuda is None); CUDA kernels were not built"
    else:
        cuda_why = "etweedie._C was built without CUDA (no CUDA_HOME at build time, or FORCE_ONLY_CPU=1)"
    return (
        ("reference", (True, "pure PyTorch")),
        ("cpu", (_cpu_available(), _EXT_WHY)),
        ("cuda", (cuda_ok, cuda_why)),
        ("triton", _triton_status()),
    )


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Run every eager op call in this context on backend ``name``.

    ``None`` drops an enclosing context's request (an op's ``backend=`` argument and the
    ``ETWEEDIE_BACKEND`` variable still apply).  Under ``torch.compile`` only an op's ``backend=``
    argument counts: the context and the variable are not read while tracing.

    >>> import torch, etweedie
    >>> y, x = torch.zeros(2, 3), torch.ones(2, 4, 3)
    >>> with etweedie.use_backend("reference"):
    ...     s = etweedie.et_score(y, x, beta=1.4)
    >>> s.shape
    torch.Size([2, 3])
    """
    if name is not None:
        _check_name(name, "use_backend: backend")
    token = _requested.set(name)
    try:
        yield
    finally:
        _requested.reset(token)


def _check_name(name, what: str) -> None:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{what} must be one of {BACKENDS} or None, got {name!r}")


def requested(backend: Optional[str] = None, op: Optional[str] = None) -> Optional[str]:
    """The explicitly requested backend, if any (argument > context > ETWEEDIE_BACKEND); ``op``
    names the caller in the error for a bad name."""
    if backend is not None:
        _check_name(backend, f"{op}: backend" if op else "backend")
        return backend
    ctx = _requested.get()
    if ctx is not None:
        return ctx
    env = os.environ.get("ETWEEDIE_BACKEND") or None
    if env is not None:
        _check_name(env, "ETWEEDIE_BACKEND")
    return env


def resolve(op: str, device: torch.device, backend: Optional[str] = None, *, supported=BACKENDS) -> str:
    """Pick the backend that runs ``op`` on ``device``.

    ``supported`` lists the backends that implement ``op``.  An explicit request that cannot
    run raises :class:`BackendUnavailable` naming the reason.
    """
    if torch.compiler.is_compiling():
        # Under torch.compile only the argument counts (contexts and the environment are read
        # when tracing would have to guard on them); automatic choice as below.
        if backend is not None:
            _check_name(backend, f"{op}: backend")
            if backend not in supported:
                raise BackendUnavailable(f"{op}: backend {backend!r} does not implement this op (has {supported})")
            _check_device_rule(op, backend, device, os.environ.get("TRITON_INTERPRET") == "1")
            return backend
        if device.type == "cpu" and _EXT_OK and "cpu" in supported:
            return "cpu"
        return "reference" if device.type == "cpu" else _auto_gpu(supported)
    want = requested(backend, op)
    if want is None:
        kind = device.type  # a CPU tensor never runs Triton: TRITON_INTERPRET is read for GPU tensors only
        return _automatic(kind, supported, None if kind == "cpu" else os.environ.get("TRITON_INTERPRET"))
    status = available()
    if want is not None:
        ok, why = status[want]
        if want not in supported:
            raise BackendUnavailable(f"{op}: backend {want!r} does not implement this op (has {supported})")
        if not ok:
            raise BackendUnavailable(f"{op}: backend {want!r} is unavailable: {why}")
        _check_device_rule(op, want, device, os.environ.get("TRITON_INTERPRET") == "1")
        return want


def _check_device_rule(op: str, want: str, device: torch.device, interpret: bool) -> None:
    """The device an explicitly requested backend needs (eager calls and torch.compile's trace alike)."""
    if want == "cpu" and device.type != "cpu":
        raise BackendUnavailable(f"{op}: backend 'cpu' needs CPU tensors, got device {device}")
    if want == "cuda" and device.type != "cuda":
        raise BackendUnavailable(f"{op}: backend 'cuda' needs CUDA tensors, got device {device}")
    if want == "triton" and device.type != "cuda" and not interpret:
        raise BackendUnavailable(f"{op}: backend 'triton' needs CUDA tensors or TRITON_INTERPRET=1, got device {device}")


@functools.lru_cache(maxsize=None)
def _automatic(device_type: str, supported: Tuple[str, ...], triton_interpret: Optional[str]) -> str:
    """The automatic choice for a device type (fixed for the process, given TRITON_INTERPRET):
    computed once, as every op call asks for it."""
    if device_type == "cpu":  # triton_interpret is None here (resolve reads it for GPU tensors only)
        return "cpu" if "cpu" in supported and _cpu_available() else "reference"
    status = dict(_available_cached(triton_interpret))
    order = ("cuda", "triton")
    for name in order:
        if name in supported and status[name][0]:
            return name
    return "reference"


def _auto_gpu(supported) -> str:
    status = available()
    for name in ("cuda", "triton"):
        if name in supported and status[name][0]:
            return name
    return "reference"
