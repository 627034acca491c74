"""Energy-Tweedie diffusion: annealed Langevin along a noise-parameter path (paper §5.3, Eq. ES_diffusion_sample).

At level k of a schedule t_0 < … < t_{L−1} the path gives the noise tuple θ_k = (β, λ, σ, u, v)
with realized RMS r_k.  Each Langevin update draws N posterior samples at the current states
and moves every chain with the Monte-Carlo Energy-Tweedie score:

    X^{(i)} ~ P(X | Y = y, η_k),  i = 1..N
    ŝ(y) = −λ_k Σ_k⁻¹ (1/N) Σ_i ‖y − X^{(i)}‖_{Σ_k⁻¹}^{β_k−2} (y − X^{(i)})
    y ← y + α_k ŝ(y) + sqrt(2 α_k) ξ,        α_k = ε (r_k / r_{L−1})²,  ξ ~ N(0, I)

— the step size scales with the noise variance of the level as in NCSN (ε is ``step_scale``,
the step at the terminal level).  The score and the update are one fused kernel
(:func:`etweedie.langevin_step`).  After the last level one posterior draw at the terminal
level denoises each chain (``final_draw``).

The posterior is any object with ``sample(y (..., d), eta (..., 5), n, *, generator) -> (..., n, d)``
(η = ``NoiseParams.eta()``): the learned Engression model (``etweedie.training.load_posterior``) or
:class:`etweedie.posteriors.known.KnownPosterior`.

Example (model-free, with the known posterior of the eight-Gaussians ring)::

    >>> import torch
    >>> from etweedie.posteriors.known import KnownPosterior
    >>> from etweedie.sample.paths import get_path, level_times
    >>> g = torch.Generator().manual_seed(0)
    >>> y0 = 1.65 * torch.randn(256, 2, generator=g)
    >>> x = sample_langevin(KnownPosterior(), y0, get_path("gaussian"), level_times(11),
    ...                     steps_per_level=3, n_posterior=16, step_scale=2e-5, generator=g, disable=True)
    >>> x.shape
    torch.Size([256, 2])

The paper's eight-Gaussians diffusion tables run this sampler from the repository:
``python -m experiments.eight_gaussians.diffusion --config configs/diffusion_cpu.toml --out DIR``.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from tqdm.auto import tqdm

from .._checks import check_bool, check_int
from ..geometry import Metric
from ..noise import NoiseParams
from ..ops import langevin_step
from ..score import antithetic_options
from .plan import LevelPlan, chain_chunks, check_finite, check_posterior, check_states, generators_for, posterior_draws as _posterior_draws

__all__ = ["ThroughputTimer", "sample_langevin"]


# ---------------------------------------------------------------------------- instrumentation
class ThroughputTimer:
    """Where sampling time goes: posterior forward, fused score/step kernel, callbacks, the rest.

    Callback time (e.g. marginal tracking) is reported apart and left out of the throughput.

    Pass one as ``sample_langevin(..., timer=t)``; it accumulates over calls.  On CUDA the
    device is synchronized around each timed region (only when a timer is given).

    Example::

        >>> t = ThroughputTimer(); t.as_dict()["chain_steps"], "posterior_share" in t.as_dict()
        (0, True)
    """

    def __init__(self):
        self.posterior_s = 0.0
        self.step_s = 0.0
        self.callback_s = 0.0
        self.total_s = 0.0
        self.chain_steps = 0  # chains × Langevin updates
        self.posterior_calls = 0
        self.chains = 0
        self.levels = 0

    def as_dict(self) -> Dict[str, float]:
        """Totals, chains·steps per second and the share of each part of the wall time."""
        total = max(self.total_s - self.callback_s, 1e-12)
        rest = max(total - self.posterior_s - self.step_s, 0.0)
        return dict(
            chains=self.chains,
            levels=self.levels,
            chain_steps=self.chain_steps,
            posterior_calls=self.posterior_calls,
            total_s=self.total_s,
            callback_s=self.callback_s,
            sampling_s=total,
            posterior_s=self.posterior_s,
            score_step_s=self.step_s,
            rest_s=rest,
            chain_steps_per_s=self.chain_steps / total,
            posterior_share=self.posterior_s / total,
            score_step_share=self.step_s / total,
            rest_share=rest / total,
        )


class _Tally:
    """One run's share of a :class:`ThroughputTimer`: seconds in the posterior, the fused step and
    the callbacks, and the updates per chain, added to ``timer`` (if any) by :meth:`add_to_timer`."""

    def __init__(self, device: torch.device, timer: Optional[ThroughputTimer]):
        self.timer = timer
        self.sync = timer is not None and device.type == "cuda"
        self.posterior_s = self.step_s = self.callback_s = 0.0
        self.updates = 0
        self.start = self.now()

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add_to_timer(self, chains: int, levels: int, n_chunks: int, final_calls: int) -> None:
        """``final_calls``: posterior calls per chunk of the final draw."""
        timer = self.timer
        if timer is None:
            return
        timer.posterior_s += self.posterior_s
        timer.step_s += self.step_s
        timer.callback_s += self.callback_s
        timer.total_s += self.now() - self.start
        timer.chain_steps += chains * self.updates
        timer.posterior_calls += (self.updates + final_calls) * n_chunks
        timer.chains += chains
        timer.levels += levels


# ---------------------------------------------------------------------------- one update
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}
CAPTURES = (None, "cuda_graph", "compile")


def _score_options(posterior, options: dict, autocast_dtype) -> dict:
    """``options`` plus ``dtype=autocast_dtype`` for a posterior whose ``sample`` takes ``dtype=``
    (e.g. EngressionPosterior: draws written in 16 bits), resolved once per sampling run."""
    if autocast_dtype is None:
        return options
    try:
        takes = "dtype" in inspect.signature(posterior.sample).parameters
    except (TypeError, ValueError):
        takes = False
    return {**options, "dtype": autocast_dtype} if takes else options


class _StaticUpdate:
    """One chunk's Langevin update on fixed buffers, replayable as a CUDA graph.

    The level's values (η, α, β, λ and the metric's block) live in device buffers written once
    per level; the update reads nothing from the host, so ``steps`` replays run back to back with
    no host sync.  ``mode``: None (eager on the buffers), ``"cuda_graph"`` (capture one update
    with ``torch.cuda.CUDAGraph``, the chunk's generator registered so each replay draws fresh
    numbers) or ``"compile"`` (``torch.compile(mode="reduce-overhead")``).  A capture that fails
    falls back to eager with a warning (``self.fallback`` holds the reason).
    """

    def __init__(self, posterior, y: torch.Tensor, n_posterior: int, generator: torch.Generator, options: dict,
                 autocast_dtype, metric_kind: str, metric_shape, mode: Optional[str]):
        self.posterior, self.n, self.generator, self.options = posterior, n_posterior, generator, options
        self.autocast_dtype, self.mode, self.metric_kind = autocast_dtype, mode, metric_kind
        dev, dt = y.device, y.dtype
        self.y = y.clone()
        self.eta = torch.zeros(y.shape[0], 5, dtype=dt, device=dev)
        self.alpha = torch.ones((), dtype=dt, device=dev)
        self.beta = torch.full((), 2.0, dtype=dt, device=dev)
        self.lam = torch.ones((), dtype=dt, device=dev)
        self.metric_param = torch.ones(metric_shape, dtype=dt, device=dev)
        self.first_draw = torch.zeros_like(self.y)
        self.graph = None
        self.compiled = None
        self.fallback: Optional[str] = None
        self.eager_updates = 0

    def set_level(self, eta: torch.Tensor, alpha: float, beta: float, lam: float, metric) -> None:
        self.eta.copy_(eta.expand_as(self.eta))
        self.alpha.fill_(alpha)
        self.beta.fill_(beta)
        self.lam.fill_(lam)
        self.metric_param.copy_(metric.param)

    def _body(self) -> None:
        x = _posterior_draws(self.posterior, self.y, self.eta, self.n, self.generator, self.options, self.autocast_dtype)
        xi = torch.randn(self.y.shape, generator=self.generator, dtype=self.y.dtype, device=self.y.device)
        # trusted: the buffer holds a validated metric's parameter (set_level); validating it again
        # would read values back to the host, which a CUDA graph capture does not allow
        metric = Metric.trusted(self.metric_kind, self.metric_param)
        y_next = langevin_step(self.y, x, xi, self.alpha, self.beta, self.lam, metric)
        self.first_draw.copy_(x[:, 0, :])  # in y's dtype (copy_ widens 16-bit draws)
        self.y.copy_(y_next)

    def _capture(self) -> None:
        import warnings

        try:
            if self.mode == "cuda_graph":
                # warm-up updates (real updates of the chain) on a side stream, as CUDA graphs require
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._body()
                        self.eager_updates += 1
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                graph.register_generator_state(self.generator)
                with torch.cuda.graph(graph):
                    self._body()
                self.graph = graph
            else:
                compiled = torch.compile(self._body, mode="reduce-overhead", dynamic=False)
                compiled()  # compiles (errors surface here) and is the chunk's first update
                self.eager_updates += 1
                self.compiled = compiled
        except Exception as exc:  # a capture that cannot happen must not stop a sampling run
            self.fallback = f"{type(exc).__name__}: {exc}"
            self.graph = self.compiled = None
            warnings.warn(f"sample_langevin: capture={self.mode!r} failed, running eagerly ({self.fallback})",
                          RuntimeWarning, stacklevel=3)
            self.mode = None

    def run(self, steps: int) -> None:
        done = 0
        # capture on a level with room for the warm-up updates (they are real updates of the chain)
        if self.mode is not None and self.graph is None and self.compiled is None and steps >= 4:
            before = self.eager_updates
            self._capture()
            done = self.eager_updates - before
        for _ in range(max(steps - done, 0)):
            if self.graph is not None:
                self.graph.replay()
            elif self.compiled is not None:
                self.compiled()
            else:
                self._body()


# ---------------------------------------------------------------------------- checked arguments
@dataclass(frozen=True)
class _Run:
    """The checked arguments of one :func:`sample_langevin` call (chunking aside)."""

    posterior: object
    plan: LevelPlan
    alphas: torch.Tensor  # α_k, (L,) float64
    steps_per_level: int
    first_level_steps: Optional[int]
    n_posterior: int
    final_draw: bool
    final_average: int
    callback: Optional[Callable[[Dict], None]]
    timer: Optional[ThroughputTimer]
    score_options: dict  # posterior.sample keywords of the score draws
    autocast_dtype: Optional[torch.dtype]
    capture: Optional[str]

    def steps_at(self, k: int) -> int:
        return self.first_level_steps if (k == 0 and self.first_level_steps is not None) else self.steps_per_level


def _check_run(posterior, y0, path, schedule, generator, *, steps_per_level, n_posterior, step_scale,
               first_level_steps, final_draw, final_average, callback, timer, antithetic, precision, capture) -> _Run:
    """Every argument of :func:`sample_langevin` but the chunking, checked (the first bad one raises)."""
    check_posterior(posterior)
    check_states(y0)
    if not isinstance(generator, (torch.Generator, list, tuple)):
        raise TypeError(
            f"generator must be a torch.Generator (randomness is always explicit), got {type(generator).__name__}"
        )
    plan = LevelPlan.of(path, schedule)
    alphas = plan.step_sizes(step_scale)
    steps_per_level = check_int(steps_per_level, "steps_per_level", 1)
    n_posterior = check_int(n_posterior, "n_posterior", 1)
    final_average = check_int(final_average, "final_average", 1)
    if first_level_steps is not None:
        first_level_steps = check_int(first_level_steps, "first_level_steps", 0)
    final_draw = check_bool(final_draw, "final_draw")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    options = antithetic_options(posterior, antithetic)
    if timer is not None and not isinstance(timer, ThroughputTimer):
        raise TypeError(f"timer must be an etweedie.sample.ThroughputTimer or None, got {type(timer).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {', '.join(map(repr, CAPTURES))}, got {capture!r}")
    if capture is not None and y0.device.type != "cuda":
        raise ValueError(f"capture={capture!r} needs CUDA tensors (CUDA graphs), got y0 on {y0.device.type}")
    autocast_dtype = PRECISIONS[precision]
    return _Run(posterior, plan, alphas, steps_per_level, first_level_steps, n_posterior, final_draw, final_average,
                callback, timer, _score_options(posterior, options, autocast_dtype), autocast_dtype, capture)


# ---------------------------------------------------------------------------- chunks
def _plan_chunks(y0: torch.Tensor, generator, chunk_chains, max_draw_elements, n_posterior: int):
    """(chain slices, the generator of each) of ``chunk_chains`` chains, shrunk to fit
    ``max_draw_elements`` when the generator is shared."""
    chains = math.prod(y0.shape[:-1])
    chunk = chains if chunk_chains is None else check_int(chunk_chains, "chunk_chains", 1)
    if max_draw_elements is not None:
        chunk = _fit_draw_bound(chunk, chains, max_draw_elements, n_posterior, y0.shape[-1],
                                shared=isinstance(generator, torch.Generator))
    chunks = chain_chunks(chains, chunk)
    return chunks, generators_for(generator, len(chunks), y0.device)


def _fit_draw_bound(chunk: int, chains: int, max_draw_elements, n_posterior: int, d: int, shared: bool) -> int:
    """The chunk size whose draws chunk·N·d fit ``max_draw_elements`` (only a shared generator may shrink it)."""
    max_draw_elements = check_int(max_draw_elements, "max_draw_elements", 1)
    if n_posterior * d > max_draw_elements:
        raise ValueError(
            f"max_draw_elements={max_draw_elements} is below the draws of a single chain, N·d = "
            f"{n_posterior}·{d} = {n_posterior * d}: raise it to at least {n_posterior * d} or lower n_posterior"
        )
    fitting = max_draw_elements // (n_posterior * d)
    if shared:
        return min(chunk, fitting)
    if min(chunk, chains) > fitting:
        raise ValueError(
            f"max_draw_elements={max_draw_elements} holds {fitting} chains of N·d = {n_posterior * d} draws, but "
            f"chunk_chains={chunk}; with one generator per chunk the chunking is fixed: lower chunk_chains"
        )
    return chunk


# ---------------------------------------------------------------------------- one level
@dataclass(frozen=True)
class _Level:
    """Level k's values as one update of every chunk reads them."""

    k: int
    params: NoiseParams
    eta: torch.Tensor  # (5,), the chains' device and dtype
    metric: Metric
    alpha: float
    beta: float
    lam: float
    steps: int

    @classmethod
    def of(cls, run: _Run, k: int, y: torch.Tensor) -> "_Level":
        params = run.plan.level(k)
        return cls(k, params, run.plan.eta(k, y), run.plan.metric(k, y.shape[-1], y), float(run.alphas[k]),
                   float(params.beta), float(params.lam), run.steps_at(k))


def _eager_updates(run: _Run, level: _Level, yc: torch.Tensor, g: torch.Generator, tally: _Tally):
    """``level.steps`` Langevin updates of one chunk: (new states, the last score's first draw or None)."""
    eta = level.eta.expand(yc.shape[0], 5)
    x = None
    for _ in range(level.steps):
        t0 = tally.now()
        x = _posterior_draws(run.posterior, yc, eta, run.n_posterior, g, run.score_options, run.autocast_dtype)
        t1 = tally.now()
        xi = torch.randn(yc.shape, generator=g, dtype=yc.dtype, device=yc.device)
        t2 = tally.now()
        yc = langevin_step(yc, x, xi, level.alpha, level.beta, level.lam, level.metric)
        t3 = tally.now()
        tally.posterior_s += t1 - t0
        tally.step_s += t3 - t2
    return yc, None if x is None else x[:, 0, :].to(yc.dtype)


def _captured_updates(level: _Level, runner: _StaticUpdate, yc: torch.Tensor, tally: _Tally):
    """The same on the chunk's captured update: one timed region (no host sync between updates)."""
    runner.y.copy_(yc)
    runner.set_level(level.eta, level.alpha, level.beta, level.lam, level.metric)
    t0 = tally.now()
    runner.run(level.steps)
    tally.posterior_s += tally.now() - t0  # the split is not observable inside a graph
    return runner.y, runner.first_draw if level.steps else None


def _report(run: _Run, level: _Level, y: torch.Tensor, shape, denoised: List[torch.Tensor], tally: _Tally) -> None:
    """The callback after a level (its time kept apart)."""
    t0 = tally.now()
    run.callback(
        dict(
            level=level.k,
            t=float(run.plan.times[level.k]),
            r=float(run.plan.rms[level.k]),
            step=level.alpha,
            params=level.params,
            eta=level.eta.clone(),
            state=y.reshape(shape).clone(),
            denoised=torch.cat(denoised).reshape(shape) if denoised else None,
        )
    )
    tally.callback_s += tally.now() - t0


# ---------------------------------------------------------------------------- the final state
def _final_calls(run: _Run) -> int:
    """Posterior calls per chunk of the final draw."""
    return math.ceil(run.final_average / run.n_posterior) if run.final_draw else 0


def _final_state(run: _Run, yc: torch.Tensor, eta: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One posterior draw per chain at the terminal level, or the mean of ``final_average`` of them
    drawn ``n_posterior`` at a time."""
    def draws(n):
        return _posterior_draws(run.posterior, yc, eta, n, g, {}, run.autocast_dtype, for_score=False)

    if run.final_average == 1:
        return draws(1)[:, 0, :]
    total = torch.zeros_like(yc)
    for k0 in range(0, run.final_average, run.n_posterior):
        total += draws(min(run.n_posterior, run.final_average - k0)).sum(1)
    return total / run.final_average


def _update_chunks(run: _Run, level: _Level, y: torch.Tensor, chunks: List[slice], generators: List[torch.Generator],
                   runners: List[Optional[_StaticUpdate]], tally: _Tally) -> List[torch.Tensor]:
    """The level's updates of every chunk in turn, in place on ``y`` (chains × d); returns the
    first draw of each chunk's last score evaluation when there is a callback to see them."""
    denoised = []
    for c, (sl, g) in enumerate(zip(chunks, generators)):
        if run.capture is None:
            y[sl], x0 = _eager_updates(run, level, y[sl], g, tally)
        else:
            if runners[c] is None:
                runners[c] = _StaticUpdate(run.posterior, y[sl], run.n_posterior, g, run.score_options,
                                           run.autocast_dtype, level.metric.kind, tuple(level.metric.param.shape),
                                           run.capture)
            y[sl], x0 = _captured_updates(level, runners[c], y[sl], tally)
        if run.callback is not None and x0 is not None:
            denoised.append(x0.clone())
    return denoised


def _final_draw(run: _Run, y: torch.Tensor, chunks: List[slice], generators: List[torch.Generator], tally: _Tally) -> None:
    """Each chunk's chains replaced, in place, by their final state at the terminal level."""
    t0 = tally.now()
    eta = run.plan.eta(-1, y)
    for sl, g in zip(chunks, generators):
        y[sl] = _final_state(run, y[sl], eta.expand(sl.stop - sl.start, 5), g)
    tally.posterior_s += tally.now() - t0


# ---------------------------------------------------------------------------- the sampler
@torch.no_grad()
def sample_langevin(
    posterior,
    y0: torch.Tensor,
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: Optional[torch.Tensor],
    *,
    steps_per_level: int,
    n_posterior: int,
    step_scale: float,
    first_level_steps: Optional[int] = None,
    final_draw: bool = True,
    final_average: int = 1,
    generator=None,
    callback: Optional[Callable[[Dict], None]] = None,
    disable: Optional[bool] = None,
    timer: Optional[ThroughputTimer] = None,
    antithetic: bool = False,
    chunk_chains: Optional[int] = None,
    max_draw_elements: Optional[int] = None,
    precision: str = "float32",
    capture: Optional[str] = None,
) -> torch.Tensor:
    """Annealed Langevin with the Energy-Tweedie score along a noise-parameter path.

    Args:
        posterior: object with ``sample(y (C, d), eta (C, 5), n, *, generator) -> (C, n, d)``.
        y0: initial states ``(..., d)`` (all leading dims are independent chains), float32/64
            (for images e.g. :func:`initial_states`).
        path: ``t -> NoiseParams``, vectorized over t (:class:`etweedie.sample.paths.NoisePath`).
        schedule: path times of the levels, ``(L,)`` in [0, 1], visited in order
            (:func:`etweedie.sample.paths.level_times`); None when ``path`` is a
            :class:`etweedie.sample.LevelPlan`.
        steps_per_level: Langevin updates per level (≥ 1).
        n_posterior: N, posterior draws per score evaluation (≥ 1).
        step_scale: ε > 0, the step at the terminal level; α_k = ε (r_k / r_{L−1})².
        first_level_steps: updates at the first level instead of ``steps_per_level`` (≥ 0;
            None: ``steps_per_level``) — a longer burn-in at the noisiest level.
        final_draw: replace each chain by one posterior draw at the terminal level.
        final_average: K ≥ 1 posterior draws averaged into that final state (with
            ``final_draw``).  1 (default) is one draw, the paper's final step; K > 1 is their mean,
            a Monte Carlo estimate of the posterior mean E[x | y] at the terminal level — the
            noise-free last step of score-based samplers (Tweedie's formula; Song et al. 2021,
            "Score-Based Generative Modeling through SDEs", and Jolicoeur-Martineau et al. 2021,
            "Adversarial score matching and improved sampling"), smoother images for a mean over
            the posterior's spread.  Drawn in batches of at most ``n_posterior`` per chunk, so the
            memory bound of the updates holds.
        generator: where every posterior draw and Langevin noise comes from (required; a run is
            reproducible from its seed): a ``torch.Generator`` shared by all chains, or a list of
            generators, one per chunk of ``chunk_chains`` chains (:func:`chunk_generators`) — then
            each chunk's chains depend only on its own generator, so a run split over processes
            (:func:`etweedie.sample.sample_sharded`) gives the same chains.
        callback: called after each level with ``{"level", "t", "r", "step", "params"
            (NoiseParams of the level), "eta" (5,), "state" (y0's shape), "denoised" (one
            posterior draw per chain from the level's last score evaluation, y0's shape)}``.
        disable: True hides the tqdm bar over levels (None: tqdm's default).
        timer: a :class:`ThroughputTimer` to accumulate the time split into (on CUDA it
            synchronizes around every timed region: leave it out for production runs).
        antithetic: the N draws of each score evaluation in antithetic noise pairs
            (``posterior.sample(..., antithetic=True)``, :class:`etweedie.posteriors.engression.EngressionPosterior`):
            the score stays unbiased with less Monte Carlo noise.  A posterior without the keyword
            is a TypeError.
        chunk_chains: chains per chunk (None: all at once).  Chunks run one after another through
            each level, so the posterior draws in memory are chunk·N·d, not chains·N·d.
        max_draw_elements: bound on chunk·N·d (the draws of one update; None: no bound).  With a
            shared generator it shrinks the chunks as needed; with one generator per chunk the
            chunking is fixed by ``chunk_chains`` and a chunk over the bound is a ValueError.
        precision: ``"float32"`` or ``"bfloat16"``: the posterior forward under bf16 autocast
            (matmuls in bf16, float32 accumulation), and its draws handed to the fused step in
            bf16 (written in bf16 by posteriors whose ``sample`` takes ``dtype=``): the step reads
            them in 16 bits and accumulates in y0's dtype, with no cast pass in between.  The
            final draw is in y0's dtype.
        capture: None (eager), ``"cuda_graph"`` or ``"compile"`` (``torch.compile(mode=
            "reduce-overhead")``): each chunk's update is captured once and replayed; the level's
            values live in device buffers, so no update within a level waits for the host.  CUDA
            only; a capture that fails falls back to eager with a RuntimeWarning.

    Returns:
        final samples, y0's shape and dtype.

    Memory per update is O(chunk · N · d) (the posterior draws); nothing accumulates over levels.
    """
    run = _check_run(posterior, y0, path, schedule, generator, steps_per_level=steps_per_level, n_posterior=n_posterior,
                     step_scale=step_scale, first_level_steps=first_level_steps, final_draw=final_draw,
                     final_average=final_average, callback=callback, timer=timer, antithetic=antithetic,
                     precision=precision, capture=capture)
    chunks, generators = _plan_chunks(y0, generator, chunk_chains, max_draw_elements, run.n_posterior)
    check_finite(y0)

    tally = _Tally(y0.device, run.timer)
    y = y0.reshape(-1, y0.shape[-1]).clone()
    runners: List[Optional[_StaticUpdate]] = [None] * len(chunks)  # the captured update of each chunk
    for k in tqdm(range(len(run.plan)), desc="langevin", unit="level", disable=disable):
        level = _Level.of(run, k, y)
        denoised = _update_chunks(run, level, y, chunks, generators, runners, tally)
        tally.updates += level.steps
        if run.callback is not None:
            _report(run, level, y, y0.shape, denoised, tally)
    if run.final_draw:
        _final_draw(run, y, chunks, generators, tally)
    tally.add_to_timer(math.prod(y0.shape[:-1]), len(run.plan), len(chunks), _final_calls(run))
    return y.reshape(y0.shape)
