"""Any sampler sharded over processes: ``torchrun --nproc_per_node=K`` splits the chains.

The chains of a run are cut into chunks of ``chunk_chains`` chains; chunk c draws its start and
every posterior draw and Langevin noise from its own generator, seeded
:func:`etweedie.sample.chunk_seed` (seed, c).  A chunk's chains therefore depend on the seed,
the chunk index and the chunk size only — not on the process that runs it — so K processes
each running a contiguous block of chunks and gathering them reproduce the single-process run
with the same seed and ``chunk_chains`` (bit for bit on the same kind of device and thread count).

    # one process (no process group): all chunks here
    x = sample_sharded(posterior, path, schedule, n_chains=256, dim=784, seed=2718, chunk_chains=32,
                       sampler=sample_transport, warmup=8, final_average=16)
    # torchrun --nproc_per_node=4 script.py: the same call after
    # torch.distributed.init_process_group(); each rank samples 2 of the 8 chunks; every rank
    # gets the gathered (256, 784) result.

Ranks exchange only the final chains (``all_gather``, padded to equal sizes), so the
sampling itself never waits for another process.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .._checks import check_device
from ..noise import NoiseParams
from .langevin import sample_langevin
from .plan import chain_chunks, chunk_generators, initial_states

__all__ = ["rank_chunks", "sample_sharded"]


def _world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_chunks(n_chunks: int, rank: int, world: int) -> List[int]:
    """The chunk indices rank ``rank`` of ``world`` runs: a contiguous block, sizes differing by ≤ 1.

    Example::

        >>> [rank_chunks(5, r, 2) for r in range(2)]
        [[0, 1, 2], [3, 4]]
    """
    for name, value, low in (("n_chunks", n_chunks, 0), ("world", world, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if rank >= world:
        raise ValueError(f"rank must be < world ({world}), got {rank}")
    base, extra = divmod(n_chunks, world)
    first = rank * base + min(rank, extra)
    return list(range(first, first + base + (rank < extra)))


def sample_sharded(
    posterior,
    path: Callable[[torch.Tensor], NoiseParams],
    schedule: Optional[torch.Tensor],
    *,
    n_chains: int,
    dim: int,
    seed: int,
    chunk_chains: int,
    center: Optional[torch.Tensor] = None,
    device="cpu",
    callback: Optional[Callable[[Dict], None]] = None,
    sampler: Callable[..., torch.Tensor] = sample_langevin,
    **sampler_kwargs,
) -> torch.Tensor:
    """Sample ``n_chains`` chains from :func:`etweedie.sample.initial_states` starts, this rank's share here.

    Args:
        posterior, path, schedule: as in the sampler.
        n_chains: chains of the whole run (all ranks), ≥ 1.
        dim: data dimension d (even).
        seed: the run's seed; chunk c uses :func:`etweedie.sample.chunk_seed` (seed, c).
        chunk_chains: chains per chunk (the unit of sharding and of reproducibility: the same
            seed and chunk_chains give the same chains on any number of processes).
        center: the chain starts' center (e.g. the data mean), ``(dim,)``; None: 0.
        device: where this rank samples (the posterior's device; e.g. ``cuda:<local rank>``).
        callback: as in the sampler, called with this rank's chains only; its dict gets
            ``"first_chain"``, the run-wide index of the rank's first chain.
        sampler: any sampler of :mod:`etweedie.sample` (``sampler(posterior, y0, path, schedule,
            *, generator, chunk_chains, callback, ...)``; default :func:`sample_langevin`).
        **sampler_kwargs: the sampler's other keywords (for sample_langevin: steps_per_level,
            n_posterior, step_scale, ...; for sample_transport: warmup, final_average, ...).

    Returns:
        all chains ``(n_chains, dim)`` in chain order, on every rank (gathered with
        ``torch.distributed.all_gather`` when a process group is initialized).
    """
    for banned in ("generator", "chunk_chains", "y0"):
        if banned in sampler_kwargs:
            raise TypeError(f"sample_sharded: {banned} is derived from seed and chunk_chains; do not pass it")
    chunks = chain_chunks(n_chains, chunk_chains)
    rank, world = _world()
    mine = rank_chunks(len(chunks), rank, world)
    dev = check_device(device, "device")
    if mine:
        first, stop = chunks[mine[0]].start, chunks[mine[-1]].stop
        generators = chunk_generators(seed, mine, device=dev)
        y0 = initial_states(path, schedule, stop - first, dim, generator=generators, center=center,
                            chunk_chains=chunk_chains)
        rank_callback = None
        if callback is not None:
            def rank_callback(info, _first=first):
                callback({**info, "first_chain": _first})
        y = sampler(posterior, y0, path, schedule, generator=generators, chunk_chains=chunk_chains,
                    callback=rank_callback, **sampler_kwargs)
    else:
        y = torch.zeros(0, dim, dtype=torch.float32, device=dev)
    if world == 1:
        return y
    import torch.distributed as dist

    # all_gather needs equal sizes: pad every rank's block to the largest one
    longest = max(sum(chunks[c].stop - chunks[c].start for c in rank_chunks(len(chunks), r, world)) for r in range(world))
    padded = torch.zeros(longest, dim, dtype=y.dtype, device=y.device)
    padded[: y.shape[0]] = y
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    parts = []
    for r in range(world):
        count = sum(chunks[c].stop - chunks[c].start for c in rank_chunks(len(chunks), r, world))
        parts.append(gathered[r][:count])
    return torch.cat(parts)
