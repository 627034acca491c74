"""The level plan every sampler shares, and the chains' chunks, generators and starts.

A sampling run visits the levels t_0 < … < t_{L−1} of a noise-parameter path.  :class:`LevelPlan`
is built once from ``(path, schedule)``: each level's noise tuple θ_k = (β, λ, σ, u, v), its
realized RMS r_k, η_k, metric Σ_k and noise law.  Every sampler (:func:`sample_langevin`,
:func:`sample_transport`, :func:`sample_ode`) and :func:`initial_states` read their levels from
one, so a level means the same thing everywhere.

Chains are cut into chunks of ``chunk_chains`` chains (:func:`chain_chunks`); a run is
reproducible from one shared ``torch.Generator`` or from one per chunk
(:func:`chunk_generators`, seeded by :func:`chunk_seed`), which is what lets
:func:`etweedie.sample.sample_sharded` split a run over processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .._checks import check_device, check_int
from ..geometry import Metric
from ..noise import GeneralizedGaussian, NoiseParams

__all__ = ["LevelPlan", "chain_chunks", "chunk_generators", "chunk_seed", "initial_states", "step_sizes"]


def _check_schedule(schedule) -> torch.Tensor:
    if not isinstance(schedule, torch.Tensor) or not schedule.is_floating_point():
        got = schedule.dtype if isinstance(schedule, torch.Tensor) else type(schedule).__name__
        raise TypeError(f"schedule must be a 1-D floating-point tensor of path times (etweedie.sample.paths.level_times), got {got}")
    if schedule.dim() != 1 or schedule.numel() < 1:
        raise ValueError(f"schedule must be a non-empty 1-D tensor of path times, got shape {tuple(schedule.shape)}")
    if not bool(((schedule >= 0) & (schedule <= 1)).all()):
        raise ValueError(f"schedule times must lie in [0, 1], got [{schedule.min().item():.4g}, {schedule.max().item():.4g}]")
    return schedule


def _level(params: NoiseParams, k: int) -> NoiseParams:
    fields = torch.broadcast_tensors(*params._tensors())
    return NoiseParams(*(f[k] for f in fields))


@dataclass(frozen=True)
class LevelPlan:
    """The levels of one sampling run: ``LevelPlan.build(path, schedule)``.

    Attributes:
        times: the path times ``(L,)``, in the order the levels are visited.
        params: the noise tuples, a :class:`NoiseParams` with ``(L,)`` fields.
        rms: realized per-coordinate RMS r_k = σ_k λ_k^{−1/β_k}, ``(L,)`` float64.

    Example::

        >>> from etweedie.sample.paths import get_path, level_times
        >>> plan = LevelPlan.build(get_path("mnist_joint"), level_times(64))
        >>> len(plan), round(float(plan.rms[0]), 2), round(float(plan.rms[-1]), 3), float(plan.level(-1).beta)
        (64, 2.63, 0.197, 1.4)
    """

    times: torch.Tensor
    params: NoiseParams
    rms: torch.Tensor

    @classmethod
    def build(cls, path: Callable[[torch.Tensor], NoiseParams], schedule: torch.Tensor) -> "LevelPlan":
        """Evaluate ``path`` (vectorized over t) at every time of ``schedule`` (1-D, in [0, 1])."""
        schedule = _check_schedule(schedule)
        if not callable(path):
            raise TypeError(f"path must be a callable t -> NoiseParams (etweedie.sample.paths.NoisePath), got {type(path).__name__}")
        params = path(schedule)
        if not isinstance(params, NoiseParams):
            raise TypeError(f"path(t) must return an etweedie.NoiseParams, got {type(params).__name__}")
        if tuple(params.batch_shape) != tuple(schedule.shape):
            raise ValueError(
                f"path(t) must be vectorized over t: fields of shape {tuple(schedule.shape)}, got {tuple(params.batch_shape)}"
            )
        params = NoiseParams(*torch.broadcast_tensors(*params._tensors()))
        return cls(schedule, params, params.realized_rms().to(torch.float64))

    @classmethod
    def of(cls, path, schedule) -> "LevelPlan":
        """The plan samplers run: ``path`` itself when it is a LevelPlan (``schedule`` None), else
        :meth:`build` (path, schedule)."""
        if isinstance(path, LevelPlan):
            if schedule is not None:
                raise ValueError("schedule must be None when path is already a LevelPlan (it holds its levels)")
            return path
        return cls.build(path, schedule)

    def lead_in(self, levels: int, sigma_start: float) -> "LevelPlan":
        """This plan after ``levels`` extra levels at higher noise, with the first level's β, λ, u, v.

        Their realized RMS falls geometrically from that of σ = ``sigma_start`` to r_0 (r_0 itself
        not repeated).  Chains started there, where the noise swamps the data, begin on a
        marginal that a start with the data collapsed to their mean matches almost exactly; the
        lead-in carries them down to the path's own first level (pick ``sigma_start`` inside the
        posterior's training range).  The lead-in levels take the first level's path time.

        Example::

            >>> from etweedie.sample.paths import get_path, level_times
            >>> plan = LevelPlan.build(get_path("mnist_gaussian_isotropic"), level_times(64)).lead_in(16, 6.0)
            >>> len(plan), [round(float(r), 2) for r in plan.rms[[0, 15, 16]]]
            (80, [6.0, 2.76, 2.63])
        """
        levels = check_int(levels, "levels", 0)
        if isinstance(sigma_start, bool) or not isinstance(sigma_start, (int, float)) or not math.isfinite(sigma_start):
            raise ValueError(f"sigma_start must be a finite number, got {sigma_start!r}")
        first = self.level(0)
        r0 = float(self.rms[0])
        r_start = float(NoiseParams(first.beta, first.lam, float(sigma_start)).realized_rms())
        if levels and not r_start > r0:
            raise ValueError(f"sigma_start = {sigma_start!r} gives realized RMS {r_start:.4g}, not above the first "
                             f"level's {r0:.4g}: a lead-in must start at higher noise")
        if levels == 0:
            return self
        rms = r_start * (r0 / r_start) ** (torch.arange(levels, dtype=torch.float64) / levels)
        beta, lam, _, u, v = (f.to(torch.float64) for f in first._tensors())
        sigma = rms * torch.exp(torch.log(lam) / beta)  # σ = r λ^{1/β}
        head = [beta.expand(levels), lam.expand(levels), sigma, u.expand(levels), v.expand(levels)]
        fields = [torch.cat([h.to(f.dtype), f]) for h, f in zip(head, self.params._tensors())]
        times = torch.cat([self.times[:1].expand(levels), self.times])
        params = NoiseParams(*fields)
        return LevelPlan(times, params, params.realized_rms().to(torch.float64))

    def __len__(self) -> int:
        return self.times.numel()

    def level(self, k: int) -> NoiseParams:
        """Level k's tuple (0-d fields)."""
        return _level(self.params, k)

    def eta(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """η_k = (β, log λ, log σ, u, v), ``(5,)`` on ``like``'s device and dtype."""
        return self.level(k).eta().to(device=like.device, dtype=like.dtype)

    def metric(self, k: int, d: int, like: torch.Tensor) -> Metric:
        """Σ_k in dimension d (even), on ``like``'s device and dtype."""
        return self.level(k).metric(d).to(device=like.device, dtype=like.dtype)

    def noise(self, k: int, d: int, device=None) -> GeneralizedGaussian:
        """Level k's noise law in dimension d, float64 parameters on ``device``."""
        level = self.level(k)
        return NoiseParams(*(f.to(device=device, dtype=torch.float64) for f in level._tensors())).noise(d)

    def step_sizes(self, step_scale: float) -> torch.Tensor:
        """Langevin steps α_k = ε (r_k / r_{L−1})², ``(L,)`` float64 (ε = ``step_scale`` > 0)."""
        if isinstance(step_scale, bool) or not isinstance(step_scale, (int, float)) or not (step_scale > 0 and math.isfinite(step_scale)):
            raise ValueError(f"step_scale must be a float > 0, got {step_scale!r}")
        return float(step_scale) * (self.rms / self.rms[-1]) ** 2


def step_sizes(path, schedule: torch.Tensor, step_scale: float) -> torch.Tensor:
    """Langevin step per level, ``α_k = ε (r_k / r_{L−1})²`` (r_k the realized RMS at t_k), ``(L,)`` float64.

    Example::

        >>> from etweedie.sample.paths import get_path, level_times
        >>> [f"{a:.0e}" for a in step_sizes(get_path("isotropic"), level_times(3), 1e-5).tolist()]
        ['1e-01', '1e-03', '1e-05']
    """
    return LevelPlan.build(path, schedule).step_sizes(step_scale)


# ---------------------------------------------------------------------------- chunks and generators

def chain_chunks(n_chains: int, chunk_chains: Optional[int]) -> List[slice]:
    """Contiguous chain slices of at most ``chunk_chains`` chains (None: one slice of all).

    Example::

        >>> chain_chunks(5, 2)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    n_chains = check_int(n_chains, "n_chains", 0)
    if chunk_chains is None or n_chains == 0:
        return [slice(0, n_chains)]
    chunk_chains = check_int(chunk_chains, "chunk_chains", 1)
    return [slice(i, min(i + chunk_chains, n_chains)) for i in range(0, n_chains, chunk_chains)]


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a run seeded ``seed``: 63 bits of SHA-256("seed:chunk").

    Hashing (not ``seed + chunk``) keeps the streams of neighbouring seeds apart: run 2718's
    chunk 1 never reuses run 2719's chunk 0.

    Example::

        >>> chunk_seed(2718, 0) == chunk_seed(2718, 0) != chunk_seed(2718, 1)
        True
    """
    import hashlib

    seed = check_int(seed, "seed", 0)
    chunk = check_int(chunk, "chunk", 0)
    digest = hashlib.sha256(f"etweedie-chunk:{seed}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def chunk_generators(seed: int, chunks, device="cpu") -> List[torch.Generator]:
    """One ``torch.Generator`` per chain chunk, seeded :func:`chunk_seed` (seed, c).

    ``chunks``: the number of chunks, or the chunk indices wanted (a rank of a sharded run asks
    for its own).  Chunk c's stream does not depend on which process draws it, so a run sharded
    over processes reproduces the single-process run chunk by chunk
    (:func:`etweedie.sample.sample_sharded`).

    Example::

        >>> [g.initial_seed() == chunk_seed(7, c) for c, g in zip(range(2), chunk_generators(7, 2))]
        [True, True]
    """
    if isinstance(chunks, int) and not isinstance(chunks, bool):
        indices = range(check_int(chunks, "chunks", 0))
    elif isinstance(chunks, (list, tuple, range)):
        indices = [check_int(c, "chunks[]", 0) for c in chunks]
    else:
        raise TypeError(f"chunks must be a number of chunks or a list of chunk indices, got {type(chunks).__name__} {chunks!r}")
    device = check_device(device, "device") or torch.device("cpu")
    try:
        torch.Generator(device=device)
    except RuntimeError:
        raise ValueError(f"device must be one torch.Generator can live on (cpu or an accelerator such as cuda), "
                         f"got {str(device)!r}") from None
    return [torch.Generator(device=device).manual_seed(chunk_seed(seed, int(c))) for c in indices]


def generators_for(generator, n_chunks: int, device: Optional[torch.device] = None) -> List[torch.Generator]:
    """The generator of each chunk: one shared stream (a Generator) or one per chunk (a sequence);
    with ``device``, each must live there (the chains' device)."""
    if isinstance(generator, torch.Generator):
        generators = [generator] * n_chunks
    elif isinstance(generator, (list, tuple)) and generator and all(isinstance(g, torch.Generator) for g in generator):
        if len(generator) != n_chunks:
            raise ValueError(
                f"generator: one torch.Generator per chain chunk expected ({n_chunks} chunks of chunk_chains chains), "
                f"got {len(generator)}"
            )
        generators = list(generator)
    else:
        raise TypeError(
            "generator must be a torch.Generator (randomness is always explicit) or a list of them, one per chain chunk; "
            f"got {type(generator).__name__}"
        )
    for g in generators if device is not None else ():
        if g.device.type != device.type:
            raise ValueError(
                f"generator must be on y0's device ({device.type}), got a {g.device.type} generator; "
                f"use torch.Generator(device={str(device)!r}).manual_seed(seed)"
            )
    return generators


def check_states(y0, *, even: bool = False) -> None:
    """The chain states every sampler takes: a float32/float64 tensor ``(..., d)`` (d even with
    ``even``: the block metric).  Their values are checked by :func:`check_finite`, after the
    generators (which must be on their device)."""
    if not isinstance(y0, torch.Tensor) or y0.dtype not in (torch.float32, torch.float64):
        got = y0.dtype if isinstance(y0, torch.Tensor) else type(y0).__name__
        raise TypeError(f"y0 must be a float32/float64 tensor of shape (..., d), got {got}")
    if y0.dim() < 1 or y0.shape[-1] < 1 or (even and y0.shape[-1] % 2):
        need = "d even (the block metric)" if even else "d >= 1"
        raise ValueError(f"y0 must have shape (..., d) with {need}, got {tuple(y0.shape)}")


def check_finite(y0: torch.Tensor) -> None:
    if not bool(torch.isfinite(y0).all()):
        raise ValueError("y0 must be finite (it holds NaN or inf)")


def initial_states(
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: Optional[torch.Tensor],
    n_chains: int,
    dim: int,
    *,
    generator,
    center: Optional[torch.Tensor] = None,
    chunk_chains: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Chain starts ``center + e``, e a draw of the first level's noise law (β_0, λ_0, Σ_0): ``(n_chains, dim)``.

    ``path, schedule``: a path and its times, or a :class:`LevelPlan` and None.

    This is the first noisy marginal p_0 = p_data ∗ q_0 with the data collapsed to ``center`` (e.g.
    the training mean image; None: 0).  When the first level's noise dominates the data spread
    (MNIST: r_0 = 2.63 per pixel against a pixel std of about 0.3, so the data hold about 1% of
    p_0's variance) this start has p_0's mean, tails and covariance shape up to that 1%, and the
    first level's burn-in only has to add the data's own spread.  ``dim`` must be even (the
    block metric I_{d/2} ⊗ S(u, v)).

    ``generator``: a ``torch.Generator``, or one per chunk of ``chunk_chains`` chains (chunk c's
    starts come from generator c, first — see :func:`chunk_generators`).  The draws are made on
    the generator's device.

    Example::

        >>> from etweedie.sample.paths import get_path, level_times
        >>> y0 = initial_states(get_path("mnist_joint"), level_times(64), 512, 784,
        ...                     generator=torch.Generator().manual_seed(0))
        >>> y0.shape, round(float(y0.pow(2).mean().sqrt()), 1)
        (torch.Size([512, 784]), 2.6)

    ``n_chains = 0`` gives an empty ``(0, dim)`` batch (with one generator, or a list of one).
    """
    plan = LevelPlan.of(path, schedule)
    n_chains = check_int(n_chains, "n_chains", 0)
    dim = check_int(dim, "dim", 2)
    if dim % 2:
        raise ValueError(f"dim must be even (the block metric I_(d/2) ⊗ S(u, v)), got {dim}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if center is not None and (not isinstance(center, torch.Tensor) or tuple(center.shape) not in ((dim,), (n_chains, dim))):
        got = tuple(center.shape) if isinstance(center, torch.Tensor) else type(center).__name__
        raise ValueError(f"center must be a tensor of shape ({dim},) or ({n_chains}, {dim}), got {got}")
    chunks = chain_chunks(n_chains, chunk_chains)
    generators = generators_for(generator, len(chunks))
    device = generators[0].device
    law = plan.noise(0, dim, device)
    parts = [law.sample((sl.stop - sl.start,), generator=g).to(dtype) for sl, g in zip(chunks, generators)]
    y0 = torch.cat(parts)
    if center is not None:
        y0 = y0 + center.to(device=device, dtype=dtype)
    return y0


# ---------------------------------------------------------------------------- posterior draws
# Draw dtypes langevin_step reads as they are (the score ops' dtype rule, etweedie/ops/_args.py).
LOW_PRECISION_DRAWS = (torch.bfloat16, torch.float16)


def check_posterior(posterior) -> None:
    if not callable(getattr(posterior, "sample", None)):
        raise TypeError(f"posterior must have a sample(y, eta, n, *, generator) method, got {type(posterior).__name__}")


def posterior_draws(posterior, y, eta, n, generator, options, autocast_dtype, for_score: bool = True) -> torch.Tensor:
    """``posterior.sample`` (under bf16 autocast when asked).

    Under autocast the draws that feed the score stay 16-bit: a posterior whose ``sample`` takes
    ``dtype=`` gets it through ``options`` (:func:`_score_options`) and writes them in bf16
    directly, and 16-bit draws from any posterior go to ``langevin_step`` as they are — its
    kernels read bf16 draws and accumulate in y's dtype, so there is no cast pass between the
    posterior and the score.  Other dtypes (and the draws of ``for_score=False`` calls: the final
    sample, asked for without ``dtype``) come back in y's dtype.
    """
    if autocast_dtype is None:
        x = posterior.sample(y, eta, n, generator=generator, **options)
    else:
        # Matmuls in bf16 with float32 accumulation.
        with torch.autocast(device_type=y.device.type, dtype=autocast_dtype):
            x = posterior.sample(y, eta, n, generator=generator, **options)
    if not isinstance(x, torch.Tensor) or x.is_complex() or x.dtype == torch.bool:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"posterior.sample must return a real-valued tensor of shape "
                        f"{(y.shape[0], n, y.shape[-1])}, got {got}")
    if x.shape != (y.shape[0], n, y.shape[-1]):
        raise ValueError(f"posterior.sample returned shape {tuple(x.shape)}, expected {(y.shape[0], n, y.shape[-1])}")
    if autocast_dtype is not None and for_score and x.dtype in LOW_PRECISION_DRAWS:
        return x
    return x.to(y.dtype)


class DrawCounter:
    """A posterior that counts what a sampler asks of it: ``DrawCounter(posterior)``.

    ``draws`` is the total of posterior draws (chains × n over every call), ``calls`` the
    number of calls; ``draws_per_chain(n_chains)`` the cost per sample.  Tracking stays outside
    the samplers' loops.

    Example::

        >>> import torch
        >>> from etweedie.posteriors.known import KnownPosterior
        >>> counted = DrawCounter(KnownPosterior())
        >>> eta = torch.tensor([2.0, 0.0, -1.0, 0.0, 0.0]).expand(3, 5)
        >>> _ = counted.sample(torch.zeros(3, 2), eta, 4, generator=torch.Generator().manual_seed(0))
        >>> counted.draws, counted.draws_per_chain(3)
        (12, 4.0)
    """

    def __init__(self, posterior):
        check_posterior(posterior)
        self.posterior, self.draws, self.calls = posterior, 0, 0

    def sample(self, y, eta, n, *, generator, **options):
        self.draws += int(y.shape[0]) * int(n)
        self.calls += 1
        return self.posterior.sample(y, eta, n, generator=generator, **options)

    def draws_per_chain(self, n_chains: int) -> float:
        return self.draws / max(int(n_chains), 1)
