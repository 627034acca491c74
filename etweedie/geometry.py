"""Noise geometry: the covariance Σ (and precision P = Σ⁻¹) every op takes.

Four structures, one small type (DESIGN §3):

=============  ==========================  ====================  ==========================
kind           Σ                           stored tensor          kernel parameter (P)
=============  ==========================  ====================  ==========================
isotropic      var · I                     ``var``  (*batch)      ``1/var``      (*batch)
diagonal       diag(var)                   ``var``  (*batch, d)   ``1/var``      (*batch, d)
block          I_{d/k} ⊗ S  (k ≤ 4)        ``S``    (*batch,k,k)  ``S⁻¹``        (*batch,k,k)
dense          Σ                           ``Σ``    (*batch,d,d)  whitened on the host (GEMM)
=============  ==========================  ====================  ==========================

``*batch`` is empty for one metric shared by all rows, or a leading batch shape that
broadcasts against the ops' batch shape (one metric per row: training draws a fresh noise
tuple per example).  Everything here is differentiable, so gradients of the fused ops with
respect to the kernel parameter P flow back to ``var``/``S``/``Σ`` and further to
``(σ, u, v, β)`` through :meth:`Metric.from_params`.

A metric remembers its precision (an inversion for block and dense Σ) across calls and
recomputes it when its tensor changes in place, which torch's version counter records.  Writes
that bypass the counter (``param.data.mul_(…)``, a numpy array sharing the memory) are not
seen: after one, build a new Metric (cheap: nothing is computed until an op needs it).

Example::

    >>> import torch, etweedie
    >>> m = etweedie.Metric.block(torch.tensor([[1.2, 0.3], [0.3, 0.8]]))
    >>> m.apply_precision(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    tensor([[ 0.9195, -0.3448, -0.3448,  1.3793]])
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD

__all__ = ["Metric", "scale_constant", "shape_matrix"]

_KINDS = ("isotropic", "diagonal", "block", "dense")
MAX_BLOCK = 4


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


try:
    from torch._C._functorch import is_functorch_wrapped_tensor as _functorch_wrapped
except ImportError:  # pragma: no cover - older torch
    def _functorch_wrapped(t) -> bool:
        return False

try:
    from torch._C._functorch import TransformType as _TransformType, get_interpreter_stack as _interpreters
except ImportError:  # pragma: no cover - older torch
    def _in_vmap() -> bool:
        return False
else:
    def _in_vmap() -> bool:
        """Whether a torch.func.vmap is active: its tensors have no single value to read, so a
        check that reads values (``.item()``, ``bool(t.all())``) cannot run under it."""
        stack = _interpreters()
        return bool(stack) and any(i.key() == _TransformType.Vmap for i in stack)


def _cacheable(p: torch.Tensor) -> bool:
    """Whether a value derived from ``p`` may be reused by later calls: a plain eager tensor with
    no autograd of any kind (no grad, no forward-mode tangent, no functorch transform) and
    outside inference mode (an inference tensor cannot enter a later autograd graph) and CUDA
    graph capture."""
    if p.requires_grad or _is_compiling() or torch.is_inference_mode_enabled() or p.is_inference():
        return False
    if p.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # computed inside a CUDA graph capture: its value exists only once the graph runs
    if _functorch_wrapped(p):
        return False
    return fwAD._current_level < 0 or fwAD.unpack_dual(p).tangent is None  # no tangent outside a dual level


def _as_float_tensor(value, name: str, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point()):
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's scalars are Real too
        raise TypeError(f"{name} must be a float or a floating-point tensor, got {type(value).__name__}")
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    return torch.tensor(float(value), dtype=dtype, device=device)


def _promoted(param: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block/dense metric parameter and data in their common dtype, as the elementwise
    isotropic and diagonal forms promote (a matmul or triangular solve would refuse, or cast)."""
    dt = torch.promote_types(param.dtype, u.dtype)
    return param.to(dt), u.to(dt)


class Metric:
    """Covariance Σ of the noise, with its precision P = Σ⁻¹ and whitening factor L (P = L Lᵀ).

    Build with :meth:`isotropic`, :meth:`diagonal`, :meth:`block`, :meth:`dense` or
    :meth:`from_params`; ``None`` wherever an op takes a metric means Σ = I.
    """

    __slots__ = ("kind", "param", "_cache")

    def __init__(self, kind: str, param: torch.Tensor):
        """Σ of the given kind from its stored tensor (see the table above), validated exactly
        as the named constructors validate it: ``Metric("dense", -I)`` raises like
        ``Metric.dense(-I)``."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        name = {"isotropic": "var", "diagonal": "var", "block": "S", "dense": "Sigma"}[kind]
        param = _as_float_tensor(param, name)
        if kind == "diagonal" and (param.dim() < 1 or param.shape[-1] == 0):
            raise ValueError(f"var must have shape (*batch, d) with d >= 1 for a diagonal metric, "
                             f"got shape {tuple(param.shape)}")
        if kind == "dense" and param.dim() >= 2 and param.shape[-1] == param.shape[-2] == 0:
            raise ValueError(f"Sigma must have shape (*batch, d, d) with d >= 1, got {tuple(param.shape)}")
        if kind in ("block", "dense"):
            if param.dim() < 2 or param.shape[-1] != param.shape[-2]:
                k = "k, k" if kind == "block" else "d, d"
                raise ValueError(f"{name} must have shape (*batch, {k}), got {tuple(param.shape)}")
            if kind == "block" and not 1 <= param.shape[-1] <= MAX_BLOCK:
                raise ValueError(
                    f"S must be a k×k block with k in [1, {MAX_BLOCK}], got k={param.shape[-1]}; use Metric.dense for larger blocks"
                )
            _check_spd(param, name)
        else:
            _check_positive(param, name, kind)
        self.kind = kind
        self.param = param
        self._cache = None

    @classmethod
    def trusted(cls, kind: str, param: torch.Tensor) -> "Metric":
        """A metric built without validation, for parameters valid by construction (a validated
        metric's inverse, cast or rescaling; a Σ assembled from a Cholesky parameter): no extra
        pass, no device sync.  The caller guarantees finite, positive / SPD values — anything
        else gives wrong results; use the validating constructors for input from users."""
        m = object.__new__(cls)
        m.kind = kind
        m.param = param
        m._cache = None
        return m

    # ------------------------------------------------------------------ constructors
    @classmethod
    def isotropic(cls, var) -> "Metric":
        """Σ = var·I. ``var``: float or tensor of shape ``(*batch,)``; must be > 0."""
        return cls("isotropic", _as_float_tensor(var, "var"))

    @classmethod
    def diagonal(cls, var: torch.Tensor) -> "Metric":
        """Σ = diag(var). ``var``: tensor ``(*batch, d)``; every entry > 0."""
        return cls("diagonal", _as_float_tensor(var, "var"))

    @classmethod
    def block(cls, S: torch.Tensor) -> "Metric":
        """Σ = I_{d/k} ⊗ S: the k×k block S repeats along the diagonal (k ≤ 4, k divides d).

        ``S``: ``(k, k)`` or ``(*batch, k, k)``, symmetric positive definite.  For images with
        k = 2, S couples horizontally adjacent pixel pairs (DESIGN §2).
        """
        return cls("block", _as_float_tensor(S, "S"))

    @classmethod
    def dense(cls, Sigma: torch.Tensor) -> "Metric":
        """Full covariance Σ: ``(d, d)`` or ``(*batch, d, d)``, symmetric positive definite."""
        return cls("dense", _as_float_tensor(Sigma, "Sigma"))

    @classmethod
    def from_params(cls, sigma, u, v, beta, d: int) -> "Metric":
        """Five-parameter geometry: Σ = (σ / c_{β,d})² · (I_{d/2} ⊗ S(u, v)) (DESIGN §2).

        ``sigma, u, v, beta``: floats or tensors of one common batch shape; differentiable in all
        four.  ``d`` must be even.  With this scaling the noise of ``(β, λ, σ, u, v)`` has
        per-coordinate RMS ``σ λ^{-1/β}``.
        """
        if not isinstance(d, int) or d < 2 or d % 2:
            raise ValueError(f"d must be an even integer >= 2 for the (sigma, u, v) geometry, got {d!r}")
        sigma = _as_float_tensor(sigma, "sigma")
        u = _as_float_tensor(u, "u", like=sigma)
        v = _as_float_tensor(v, "v", like=sigma)
        beta = _as_float_tensor(beta, "beta", like=sigma)
        try:
            torch.broadcast_shapes(sigma.shape, u.shape, v.shape, beta.shape)
        except RuntimeError:
            raise ValueError(f"sigma, u, v and beta must broadcast to one batch shape, got {tuple(sigma.shape)}, "
                             f"{tuple(u.shape)}, {tuple(v.shape)} and {tuple(beta.shape)}") from None
        if _is_compiling():
            ok = (torch.isfinite(sigma) & (sigma > 0)).all() & ((beta > 0) & (beta <= 2)).all() & (u * u + v * v < 1).all()
            torch._assert_async(ok, "from_params: need finite sigma > 0, beta in (0, 2] and u²+v² < 1")
        else:
            if sigma.numel() and not bool((torch.isfinite(sigma) & (sigma > 0)).all()):
                raise ValueError(f"sigma must be > 0 and finite, got values in [{sigma.min().item():.4g}, {sigma.max().item():.4g}]")
            if beta.numel() and not bool(((beta > 0) & (beta <= 2)).all()):
                raise ValueError(f"beta must lie in (0, 2], got values in [{beta.min().item():.4g}, {beta.max().item():.4g}]")
            r2 = u * u + v * v
            if r2.numel() and not bool((r2 < 1).all()):
                raise ValueError(f"(u, v) must lie in the open unit disk (u²+v²<1), got max u²+v² = {r2.max().item():.4g}")
        scale = (sigma / scale_constant(beta, d)) ** 2
        if not _is_compiling() and scale.numel():
            # S, its determinant (~scale²) and its inverse stay normal and finite
            tiny, big = torch.finfo(scale.dtype).tiny ** 0.5, torch.finfo(scale.dtype).max ** 0.5
            fits = (scale >= tiny) & (scale <= big)
            if not bool(fits.all()):
                bad = sigma.detach().expand_as(scale)[~fits].flatten()[0].item()
                raise ValueError(f"sigma = {bad:.4g} gives a covariance scale (sigma/c)^2 outside the normal "
                                 f"{scale.dtype} range [{tiny:.3g}, {big:.3g}]; pass sigma in float64")
        S = shape_matrix(u, v) * scale[..., None, None]
        return cls.trusted("block", S)  # SPD by construction from the checked (σ, u, v, β)

    # ------------------------------------------------------------------ structure
    @property
    def block_size(self) -> int:
        if self.kind != "block":
            raise ValueError(f"block_size is defined for block metrics, this one is {self.kind}")
        return self.param.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        core = {"isotropic": 0, "diagonal": 1, "block": 2, "dense": 2}[self.kind]
        return self.param.shape[: self.param.dim() - core]

    @property
    def dim(self) -> Optional[int]:
        """The dimension d fixed by the metric, or None (isotropic and block fit any valid d)."""
        if self.kind in ("diagonal", "dense"):
            return self.param.shape[-1]
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def device(self) -> torch.device:
        return self.param.device

    def to(self, *args, **kwargs) -> "Metric":
        """The metric with its parameter moved or cast (``Tensor.to``'s arguments).

        A cast to a narrower floating dtype is checked like a new metric: a float64 variance of
        1e-300 rounds to 0 in float32 (P = inf) and a float32 1e5 to inf in float16, so a value
        the new dtype cannot hold raises a ValueError instead of giving an infinite precision.
        The check reads values, so it runs for a parameter that ends on the CPU; a GPU one is not
        read back (no device sync in a sampler's step), and the ops refuse its infinite P only
        under ``etweedie.set_debug(True)``."""
        param = self.param.to(*args, **kwargs)
        if not param.is_floating_point():
            raise TypeError(f"Metric.to: a metric's dtype must be floating point, got {param.dtype}")
        old, new = torch.finfo(self.param.dtype), torch.finfo(param.dtype)
        narrower = param.dtype != self.param.dtype and (new.max < old.max or new.tiny > old.tiny)
        if narrower and param.device.type == "cpu" and not _in_vmap():
            name = {"isotropic": "var", "diagonal": "var", "block": "S", "dense": "Sigma"}[self.kind]
            # the range only (one value check): a rounding that costs a matrix its definiteness
            # is a conditioning question the ops answer (they refuse a non-finite P)
            variances = param if self.kind in ("isotropic", "diagonal") else param.diagonal(dim1=-2, dim2=-1)
            fits = (torch.isfinite(variances) & (variances >= new.tiny)).all() & torch.isfinite(param).all()
            msg = (f"Metric.to({param.dtype}): this {self.param.dtype} metric's {name} does not fit {param.dtype} "
                   f"(its variances must be finite and at least {new.tiny:.4g}, the smallest normal {param.dtype}, "
                   f"so that P is finite)")
            if _is_compiling():
                torch._assert_async(fits, msg)
            elif param.numel() and not bool(fits):
                given = self.param.detach() if variances is param else self.param.detach().diagonal(dim1=-2, dim2=-1)
                raise ValueError(f"{msg}; got variances in [{given.min().item():.4g}, {given.max().item():.4g}]")
        return Metric.trusted(self.kind, param)

    def check_dim(self, d: int, name: str = "metric") -> None:
        """Raise ValueError unless this metric can act on vectors of dimension ``d``."""
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"d must be an int >= 1, got {d!r}")
        if self.kind in ("diagonal", "dense") and self.param.shape[-1] != d:
            raise ValueError(f"{name} is {self.kind} of dimension {self.param.shape[-1]}, but the data has d={d}")
        if self.kind == "block" and d % self.block_size:
            raise ValueError(f"{name} has block size k={self.block_size}, which must divide d={d}")

    def __repr__(self) -> str:
        return f"Metric.{self.kind}(param shape={tuple(self.param.shape)}, dtype={self.param.dtype})"

    # ------------------------------------------------------------------ linear algebra
    def precision_param(self) -> torch.Tensor:
        """The kernel parameter of P: 1/var (isotropic, diagonal), S⁻¹ (block), Σ⁻¹ (dense).

        A metric reused across op calls computes it once (cached while the parameter is not
        changed in place and needs no gradient); treat the result as read-only."""
        return self._cached("precision", self._precision_param)

    def whitening_factor(self) -> torch.Tensor:
        """L with P = L Lᵀ: sqrt(1/var) for isotropic/diagonal, lower Cholesky of S⁻¹ or Σ⁻¹
        (cached like :meth:`precision_param`)."""
        return self._cached("whitening", self._whitening_factor)

    def _precision_param(self) -> torch.Tensor:
        if self.kind in ("isotropic", "diagonal"):
            return 1.0 / self.param
        # inv_ex: SPD was checked when the metric was built; plain inv would read the solver's
        # status back to the host, a device sync per op call on GPU.
        return torch.linalg.inv_ex(self._sym())[0]

    def _whitening_factor(self) -> torch.Tensor:
        if self.kind in ("isotropic", "diagonal"):
            return self.param.rsqrt()
        return torch.linalg.cholesky_ex(torch.linalg.inv_ex(self._sym())[0])[0]

    def _cached(self, name: str, compute) -> torch.Tensor:
        """``compute()``, remembered per metric: the ops call it on every call, and for a block or
        dense Σ it is an inversion (several kernel launches on a GPU) that a metric shared by many
        calls (a sampler's level, a training step's geometry) needs once.  Recomputed when the
        parameter was changed in place (its version counter; writes through ``.data`` or a numpy
        view bypass it, see the module docstring), and never cached for a parameter
        that needs a gradient, under torch.compile, or for inference-mode tensors."""
        p = self.param
        if not _cacheable(p):
            return compute()
        key = (name, p._version, p.data_ptr(), p.dtype, p.device)
        cache = self._cache
        if cache is not None and key in cache:
            return cache[key]
        value = compute()
        if cache is None or len(cache) >= 4:
            cache = self._cache = {}
        cache[key] = value
        return value

    def _sym(self) -> torch.Tensor:
        """(S + Sᵀ)/2 of a block or dense parameter.  Equal to S in value (S is symmetric), but
        it makes the gradient with respect to S symmetric on every path: the reference inverts
        S while the kernels take a Cholesky factor, which reads one triangle only, so without
        it the backends would disagree on the (meaningless) antisymmetric part."""
        return 0.5 * self.param + 0.5 * self.param.transpose(-1, -2)  # (no overflow near the dtype's largest value)

    def covariance(self, d: int) -> torch.Tensor:
        """Dense Σ, shape ``(*batch, d, d)``."""
        self.check_dim(d)
        eye = torch.eye(d, dtype=self.dtype, device=self.device)
        if self.kind == "isotropic":
            return self.param[..., None, None] * eye
        if self.kind == "diagonal":
            return torch.diag_embed(self.param)
        if self.kind == "block":
            k = self.block_size
            blocks = torch.eye(d // k, dtype=self.dtype, device=self.device)
            # not torch.kron: it fails on non-contiguous params (e.g. the output of linalg.inv).
            return _batched_kron(blocks, self.param)
        return self.param

    def precision(self, d: int) -> torch.Tensor:
        """Dense P = Σ⁻¹, shape ``(*batch, d, d)``."""
        return self.inverse().covariance(d)

    def inverse(self) -> "Metric":
        """The metric whose covariance is P (swaps Σ and P)."""
        return Metric.trusted(self.kind, self.precision_param())

    def _blocks(self, u: torch.Tensor) -> torch.Tensor:
        k = self.block_size
        return u.reshape(*u.shape[:-1], u.shape[-1] // k, k)

    def _param_for(self, u: torch.Tensor, core: int, sample_dims: int) -> torch.Tensor:
        """Metric parameter shaped to broadcast against u = (*batch, *sample, d).

        The metric's batch shape is right-aligned with u's batch dims (ordinary torch
        broadcasting); the ``sample_dims`` dims just before d (e.g. posterior draws) get size 1.
        """
        p = self.param
        if len(self.batch_shape) and sample_dims:
            p = p.reshape(*self.batch_shape, *([1] * sample_dims), *p.shape[p.dim() - core :])
        return p

    def _check_vectors(self, u, sample_dims, name: str = "u") -> None:
        """``u`` a floating tensor ``(*batch, *sample, d)`` whose batch dims broadcast with the
        metric's, ``sample_dims`` an int >= 0: a TypeError/ValueError naming what is wrong."""
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (*batch, *sample, d), got {type(u).__name__}")
        if not u.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {u.dtype}")
        if isinstance(sample_dims, bool) or not isinstance(sample_dims, int) or sample_dims < 0:
            raise ValueError(f"sample_dims must be an int >= 0, got {sample_dims!r}")
        if u.dim() < 1 + sample_dims:
            raise ValueError(f"{name} must have shape (*batch, *sample, d) with {sample_dims} sample dim(s), "
                             f"got shape {tuple(u.shape)}")
        self.check_dim(u.shape[-1], "metric")
        batch = u.shape[: u.dim() - 1 - sample_dims]
        try:
            torch.broadcast_shapes(batch, self.batch_shape)
        except RuntimeError:
            raise ValueError(f"{name}'s batch shape {tuple(batch)} does not broadcast with the metric's batch shape "
                             f"{tuple(self.batch_shape)}") from None

    def apply_precision(self, u: torch.Tensor, sample_dims: int = 0) -> torch.Tensor:
        """P u for u of shape ``(*batch, *sample, d)`` (``sample_dims`` = len(sample))."""
        self._check_vectors(u, sample_dims)
        return self.inverse()._apply_covariance(u, sample_dims)

    def apply_covariance(self, u: torch.Tensor, sample_dims: int = 0) -> torch.Tensor:
        """Σ u for u of shape ``(*batch, *sample, d)`` (``sample_dims`` = len(sample))."""
        self._check_vectors(u, sample_dims)
        return self._apply_covariance(u, sample_dims)

    def _apply_covariance(self, u: torch.Tensor, sample_dims: int) -> torch.Tensor:
        """:meth:`apply_covariance` on vectors already checked."""
        if self.kind == "isotropic":
            return self._param_for(u, 0, sample_dims)[..., None] * u
        if self.kind == "diagonal":
            return self._param_for(u, 1, sample_dims) * u
        if self.kind == "block":
            # blocks (..., d/k, k) @ (..., k, k): the block index is already the matrix row
            # dim, so S needs no extra broadcast dim (one would pair every row of u with every
            # per-row metric).
            S, u = _promoted(self._param_for(u, 2, sample_dims), u)
            ub = self._blocks(u)
            return (ub @ S.transpose(-1, -2)).reshape(u.shape)
        Sigma, u = _promoted(self._param_for(u, 2, sample_dims), u)
        return (u.unsqueeze(-2) @ Sigma.transpose(-1, -2)).squeeze(-2)

    def whiten(self, u: torch.Tensor, sample_dims: int = 0) -> torch.Tensor:
        """z = Lᵀ u, so that ‖u‖²_P = ‖z‖². u: ``(*batch, *sample, d)``."""
        self._check_vectors(u, sample_dims)
        L = Metric.trusted(self.kind, self.whitening_factor())
        if self.kind == "isotropic":
            return L._param_for(u, 0, sample_dims)[..., None] * u
        if self.kind == "diagonal":
            return L._param_for(u, 1, sample_dims) * u
        if self.kind == "block":
            Lk, u = _promoted(L._param_for(u, 2, sample_dims), u)
            return (self._blocks(u) @ Lk).reshape(u.shape)
        Ld, u = _promoted(L._param_for(u, 2, sample_dims), u)
        return (u.unsqueeze(-2) @ Ld).squeeze(-2)

    def unwhiten(self, z: torch.Tensor, sample_dims: int = 0) -> torch.Tensor:
        """u with Lᵀ u = z, the inverse of :meth:`whiten`. z: ``(*batch, *sample, d)``.

        L⁻ᵀ is a square root of Σ (L⁻ᵀ L⁻¹ = Σ), so z ~ N(0, I) gives u ~ N(0, Σ).  Uses
        triangular solves, no explicit inverse of L.

        Example::

            >>> Metric.diagonal(torch.tensor([4.0, 9.0])).unwhiten(torch.tensor([1.0, 1.0]))
            tensor([2., 3.])
        """
        self._check_vectors(z, sample_dims, "z")
        if self.kind == "isotropic":
            return self._param_for(z, 0, sample_dims).sqrt()[..., None] * z
        if self.kind == "diagonal":
            return self._param_for(z, 1, sample_dims).sqrt() * z
        L = Metric.trusted(self.kind, self.whitening_factor())
        if self.kind == "block":
            Lk, z = _promoted(L._param_for(z, 2, sample_dims), z)
            # row form of Lᵀ u = z is uᵀ L = zᵀ: solve X L = Z for the rows X.
            ub = torch.linalg.solve_triangular(Lk, self._blocks(z), upper=False, left=False)
            return ub.reshape(z.shape)
        Ld, z = _promoted(L._param_for(z, 2, sample_dims), z)
        return torch.linalg.solve_triangular(Ld, z.unsqueeze(-2), upper=False, left=False).squeeze(-2)

    def sq_norm(self, u: torch.Tensor, sample_dims: int = 0) -> torch.Tensor:
        """‖u‖²_P = uᵀ P u, shape ``u.shape[:-1]``."""
        self._check_vectors(u, sample_dims)
        return (u * self.inverse()._apply_covariance(u, sample_dims)).sum(-1)

    def logdet(self, d: Optional[int] = None) -> torch.Tensor:
        """log det Σ (of the full d×d covariance; ``d`` needed for isotropic and block)."""
        if self.kind in ("isotropic", "block") and d is None:
            raise ValueError(f"logdet of a {self.kind} metric needs the dimension d")
        if d is not None:
            self.check_dim(d)
        if self.kind == "isotropic":
            return d * torch.log(self.param)
        if self.kind == "diagonal":
            return torch.log(self.param).sum(-1)
        return (d // self.block_size if self.kind == "block" else 1) * torch.linalg.slogdet(self.param)[1]

    def trace(self, d: Optional[int] = None) -> torch.Tensor:
        """tr Σ (``d`` needed for isotropic and block)."""
        if self.kind in ("isotropic", "block") and d is None:
            raise ValueError(f"trace of a {self.kind} metric needs the dimension d")
        if d is not None:
            self.check_dim(d)
        if self.kind == "isotropic":
            return d * self.param
        if self.kind == "diagonal":
            return self.param.sum(-1)
        if self.kind == "block":
            return (d // self.block_size) * torch.diagonal(self.param, dim1=-2, dim2=-1).sum(-1)
        return torch.diagonal(self.param, dim1=-2, dim2=-1).sum(-1)

    def trace_normalized(self) -> "Metric":
        """Σ rescaled so that tr Σ = d (mean per-coordinate variance 1)."""
        if self.kind == "isotropic":
            return Metric.trusted("isotropic", torch.ones_like(self.param))
        if self.kind == "diagonal":
            return Metric.trusted("diagonal", self.param / self.param.mean(-1, keepdim=True))
        k = self.param.shape[-1]
        mean_var = torch.diagonal(self.param, dim1=-2, dim2=-1).sum(-1) / k
        return Metric.trusted(self.kind, self.param / mean_var[..., None, None])


def _check_positive(v: torch.Tensor, name: str, kind: str) -> None:
    """Every variance finite and > 0.  Under torch.compile the check runs inside the graph
    (``torch._assert_async``: a RuntimeError with the same message, no graph break)."""
    if v.numel() == 0:
        return
    tiny = torch.finfo(v.dtype).tiny  # a subnormal variance has no finite precision 1/var
    ok = (torch.isfinite(v) & (v >= tiny)).all()
    msg = (f"{name} must be > 0 and finite for a{'n' if kind[0] in 'aeiou' else ''} {kind} metric "
           f"(at least {tiny:.4g}, the smallest normal {v.dtype}, so that 1/{name} is finite)")
    if _is_compiling():
        torch._assert_async(ok, msg)
        return
    if not bool(ok):
        bad = v.detach()[~(torch.isfinite(v.detach()) & (v.detach() >= tiny))].flatten()[0].item()
        raise ValueError(f"{msg}, got {bad:.4g}")


def _check_spd(M: torch.Tensor, name: str) -> None:
    """Finite, symmetric and positive definite (Cholesky succeeds), for every matrix of the batch."""
    if M.numel() == 0:
        return
    M = M.detach()
    if _is_compiling():
        finite = torch.isfinite(M).all()
        tol = 1e-5 * M.abs().amax((-2, -1), keepdim=True) + 1e-30
        sym = ((M - M.transpose(-1, -2)).abs() <= tol).all()
        pd = (torch.linalg.cholesky_ex(M).info == 0).all()
        torch._assert_async(finite & sym & pd, f"{name} must be finite, symmetric and positive definite")
        return
    if not bool(torch.isfinite(M).all()):
        raise ValueError(f"{name} must be symmetric positive definite, got a matrix with NaN or infinite entries")
    tiny = torch.finfo(M.dtype).tiny  # a subnormal variance has no finite precision (as _check_positive)
    if bool((M.diagonal(dim1=-2, dim2=-1) < tiny).any()):
        raise ValueError(f"{name} must be symmetric positive definite with diagonal entries of at least {tiny:.4g} "
                         f"(the smallest normal {M.dtype}, so that its inverse is finite), got a smaller diagonal entry")
    if not torch.allclose(M, M.transpose(-1, -2), rtol=1e-5, atol=1e-6 * float(M.abs().max())):
        raise ValueError(f"{name} must be symmetric positive definite, got a non-symmetric matrix")
    info = torch.linalg.cholesky_ex(M).info
    if bool((info != 0).any()):
        raise ValueError(f"{name} must be symmetric positive definite, got a matrix that is not positive definite")


def _stirling_tail(x: torch.Tensor) -> torch.Tensor:
    """lgamma(x) − [(x − ½) log x − x + ½ log 2π] for x ≥ 100: the next term, 1/(1680 x⁷), is below 1e-17."""
    inv = 1.0 / x
    inv2 = inv * inv
    return inv * (1.0 / 12 - inv2 * (1.0 / 360 - inv2 / 1260))


def _lgamma_drop(z: torch.Tensor, a) -> torch.Tensor:
    """lgamma(z − a) − lgamma(z) for z > a ≥ 0, accurate for every z (call it in float64).

    The direct difference of two lgamma values cancels: its error is eps·lgamma(z) ≈ eps·z log z,
    which is 2e-4 in float32 at z = 560 (d = 784, β = 1.4) and all of the answer at z = 1e20 in
    float64 (z − a rounds to z and the difference reads 0 instead of ≈ −a log z).  From z − a ≥ 100
    on it is Stirling's series rearranged so that no large terms cancel:
    −a log z + (z − a − ½) log1p(−a/z) + a + tail(z − a) − tail(z).
    """
    big = (z - a) >= 100
    zb = torch.where(big, z, a + 100.0)  # both branches finite (no NaN gradient from the unused one)
    stirling = -a * torch.log(zb) + (zb - a - 0.5) * torch.log1p(-a / zb) + a + _stirling_tail(zb - a) - _stirling_tail(zb)
    zd = torch.where(big, a + 1.0, z)
    return torch.where(big, stirling, torch.lgamma(zd - a) - torch.lgamma(zd))


def _batched_kron(eye: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    n, k = eye.shape[0], S.shape[-1]
    out = eye[:, None, :, None] * S[..., None, :, None, :]
    return out.reshape(*S.shape[:-2], n * k, n * k)


def shape_matrix(u, v) -> torch.Tensor:
    """S(u, v) = [[1+u, v], [v, 1−u]]: trace 2, SPD for u²+v² < 1. Shape ``(*batch, 2, 2)``."""
    u = _as_float_tensor(u, "u")
    v = _as_float_tensor(v, "v", like=u)
    u, v = torch.broadcast_tensors(u, v)
    return torch.stack([torch.stack([1 + u, v], -1), torch.stack([v, 1 - u], -1)], -2)


def scale_constant(beta, d: int) -> torch.Tensor:
    """c_{β,d} = sqrt(β^{2/β} Γ((d+2)/β) / (d Γ(d/β))) (DESIGN §2), differentiable in β.

    With Σ = (σ/c)² S and tr S = d, generalized-Gaussian noise of parameter (β, λ) has
    per-coordinate RMS σ λ^{-1/β}.  For β = 2, c = 1 in every dimension.
    """
    beta = _as_float_tensor(beta, "beta")
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"d must be an int >= 1, got {type(d).__name__} {d!r}")
    if d < 1:
        raise ValueError(f"d must be an int >= 1, got {d}")
    d = int(d)
    if not _is_compiling() and not _in_vmap() and beta.numel() and not bool(((beta > 0) & (beta <= 2)).all()):
        raise ValueError(f"beta must lie in (0, 2], got values in [{beta.min().item():.4g}, {beta.max().item():.4g}]")
    # in float64 and without cancellation: lgamma((d+2)/β) − lgamma(d/β) evaluated directly is off by
    # ~2e-4 in float32 at d = 784, and by 2e-11 in float64 at β = 0.05 (see _lgamma_drop)
    b = beta.to(torch.float64)
    log_c2 = (2.0 / b) * torch.log(b) - _lgamma_drop((d + 2) / b, 2 / b) - math.log(d)
    return torch.exp(0.5 * log_c2).to(beta.dtype)
