"""Chains sharded over processes (gloo, two CPU processes) equal the single-process run."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from etweedie.posteriors import EngressionPosterior
from etweedie.sample import get_path, level_times
from etweedie.sample import rank_chunks, sample_sharded

DIM = 16
KW = dict(n_chains=11, dim=DIM, seed=2718, chunk_chains=3, steps_per_level=2, first_level_steps=3, n_posterior=5,
          step_scale=1e-3, disable=True)


def _model():
    return EngressionPosterior(dim=DIM, width=32, depth=2, eta_low=(1.3, 0.0, -3.7, -0.7, -0.7),
                               eta_high=(2.0, 0.92, 1.8, 0.7, 0.7)).eval()


def _run():
    return sample_sharded(_model(), get_path("mnist_joint"), level_times(4), **KW)


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        firsts = []
        x = sample_sharded(_model(), get_path("mnist_joint"), level_times(4),
                                    callback=lambda info: firsts.append(info["first_chain"]), **KW)
        if rank == 0:
            torch.save(x, out)
        else:
            assert set(firsts) == {6}  # rank 1 runs chunks 2, 3 (chains 6..10)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_chunks_cover_every_chunk_once():
    for n, world in ((5, 2), (8, 3), (2, 4), (0, 2)):
        got = [c for r in range(world) for c in rank_chunks(n, r, world)]
        assert got == list(range(n))
    with pytest.raises(ValueError, match="rank must be < world"):
        rank_chunks(4, 2, 2)


def test_two_gloo_processes_gather_the_single_process_chains(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run one thread each: same GEMM reduction order
    try:
        single = _run()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "gathered.pt"
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    gathered = torch.load(out)
    assert gathered.shape == (11, DIM)
    assert torch.equal(gathered, single)
    # a different seed gives other chains (the comparison can fail)
    other = sample_sharded(_model(), get_path("mnist_joint"), level_times(4), **{**KW, "seed": 3141})
    assert not torch.allclose(other, single)


def test_sharded_rejects_a_generator():
    with pytest.raises(TypeError, match="generator is derived from seed"):
        sample_sharded(_model(), get_path("mnist_joint"), level_times(2), generator=torch.Generator(), **KW)


def test_a_device_this_machine_cannot_use_is_a_named_error():
    kwargs = dict(n_chains=4, dim=2, seed=0, chunk_chains=2)
    with pytest.raises(ValueError, match="device must be a device string"):
        sample_sharded(None, get_path("gaussian"), level_times(3), device="gpu", **kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            sample_sharded(None, get_path("gaussian"), level_times(3), device="cuda", **kwargs)
