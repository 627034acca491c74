"""An MNIST sampling protocol on a GPU (noise transport by default, or the paper's --protocol full), under a deadline, resumable, packed.

    python -m experiments.mnist.gpu_sample --posterior mnist --work runs/mnist_gpu --pack-dir "$OUT" --deadline 540
    torchrun --nproc_per_node=K -m experiments.mnist.gpu_sample --posterior mnist ...   # chains over K GPUs
    python -m experiments.mnist.gpu_sample --dry-run --work /tmp/mnist_dry --pack-dir /tmp/mnist_pack    # CPU

Steps:
1. (rank 0, one process only, unless ``--no-bench``) the throughput comparison of
   ``benchmarks/bench_mnist_sampler.py`` on this card: etweedie's sampler (bf16 forward, fused
   step, CUDA graphs) against the plain float32 eager one, in one run;
2. the paths in order, three seeds each (``--protocol transport``:
   :data:`experiments.mnist.sampling.TRANSPORT`, 95 posterior draws per image; ``--protocol full``:
   :data:`experiments.mnist.sampling.FULL`, the paper's 64 levels, 1,000 + 100 updates, N = 256;
   256 images per seed): each finished (path, seed) part is saved at
   once under ``--work/parts`` (uint8 images, its JSON log, the progress states) and skipped on a
   rerun; a part is not started when the last one's duration says it would end after the deadline;
3. the pack in ``--pack-dir``, at most ``--max-files`` (8) files of at most 16 MB, all worth
   committing: ``<path>.npy`` (the 768 pooled images of every finished path, about 0.6 MB each),
   ``progress.npz`` (the progress-figure states), ``sampling_log.json`` (protocol, every part's log,
   the benchmark, the driver's log, what is left) and ``parts.tar.gz`` (the part files, so a later
   call can carry them back into ``--work`` and continue).  Pooled files beyond the count go into
   ``parts.tar.gz`` at its top level (unpacked into ``--work`` they are back beside the parts).

``--pack-only`` writes the pack of what ``--work`` holds and nothing else (no posterior, no CUDA):
what ``scripts/gpu_session.sh`` runs when the sampling process was killed or crashed before packing.

Afterwards, on any machine: ``python -m experiments.mnist.sampling_table PACK_DIR`` scores the table,
and ``experiments.mnist.sampling_figures.all_figures`` draws the figures from the unpacked parts.

``--dry-run`` runs the same code on the CPU at the tiny size with an untrained posterior (or
``--posterior``), the benchmark at a tiny size too.  Under torchrun every rank samples its share
of each part's chains (``etweedie.sample.sample_sharded``) and rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from experiments import _cli

from . import sampling

T0 = time.time()
MAX_PACK_FILES = 8
MAX_FILE_BYTES = 16 * 2**20


def parse_args(argv=None):
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default=None, help="posterior name or path (default: mnist; dry run: untrained:32)")
    p.add_argument("--work", default="runs/mnist_gpu", help="work folder (parts, logs); rerun to continue")
    p.add_argument("--pack-dir", required=True, help="where the ≤ 8 files worth committing go")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds from start until the pack must be written")
    p.add_argument("--pack-reserve", type=float, default=20.0, help="seconds kept for the pack")
    p.add_argument("--max-files", type=int, default=MAX_PACK_FILES,
                   help="files the pack may hold (at least 3; pooled <path>.npy beyond it go into parts.tar.gz)")
    p.add_argument("--pack-only", action="store_true",
                   help="only pack what --work holds (no sampling, no posterior, CUDA untouched)")
    p.add_argument("--protocol", choices=("transport", "full"), default="transport",
                   help="transport: the noise-transport protocol (default); full: the paper's annealed Langevin")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny protocol, untrained posterior unless given")
    p.add_argument("--paths", nargs="+", choices=sampling.PATHS, default=None)
    p.add_argument("--no-bench", action="store_true", help="skip the throughput comparison")
    p.add_argument("--bench-args", default="--chains 256 --n-posterior 256 --levels 2 --steps 10 --first-level-steps 10 "
                                           "--repeats 10 --rounds 1",
                   help="arguments of benchmarks/bench_mnist_sampler.py (posterior and device are added)")
    for name, kind in (("images-per-seed", int), ("levels", int), ("first-level-steps", int), ("steps-per-level", int),
                       ("n-posterior", int), ("chunk-chains", int), ("step-fraction", float), ("final-average", int)):
        p.add_argument(f"--{name}", type=kind, default=None, help="override the protocol's value")
    p.add_argument("--precision", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--capture", choices=("none", "cuda_graph", "compile"), default=None)
    p.add_argument("--antithetic", action="store_true",
                   help="antithetic posterior draws (the variance-reduced variant: e.g. --antithetic --n-posterior 64)")
    p.add_argument("--progress", action="store_true")
    return p.parse_args(argv)


class Log:
    def __init__(self, path: Path, main: bool):
        self.path, self.main, self.lines = path, main, []

    def __call__(self, message: str) -> None:
        line = f"[{time.time() - T0:7.1f} s] {message}"
        self.lines.append(line)
        if self.main:
            print(line, flush=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


def _protocol(args) -> sampling.Protocol:
    if args.protocol == "transport":
        protocol = sampling.TINY_TRANSPORT if args.dry_run else sampling.TRANSPORT
    else:
        protocol = sampling.TINY if args.dry_run else sampling.FULL
    changes = {}
    for field in ("images_per_seed", "levels", "first_level_steps", "steps_per_level", "n_posterior", "chunk_chains",
                  "step_fraction", "final_average", "precision"):
        value = getattr(args, field)
        if value is not None:
            changes[field] = value
    if args.capture is not None:
        changes["capture"] = None if args.capture == "none" else args.capture
    if args.paths:
        changes["paths"] = tuple(args.paths)
    if args.antithetic:
        changes["antithetic"] = True
    if args.dry_run:
        changes.setdefault("precision", "float32")
    return dataclasses.replace(protocol, **changes)


def _init_distributed(dry_run: bool):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return "cpu" if dry_run else "cuda"
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dry_run:
        dist.init_process_group("gloo")
        return "cpu"
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return f"cuda:{local}"


def _bench(args, posterior_spec: str, device: str, log: Log) -> Optional[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import bench_mnist_sampler as bench

    extra = args.bench_args.split()
    if args.dry_run:
        extra = ["--chains", "4", "--n-posterior", "4", "--levels", "2", "--steps", "2", "--rounds", "1",
                 "--repeats", "1", "--width", "32"]
    spec = posterior_spec if not posterior_spec.startswith("untrained") else "untrained"
    try:
        report = bench.run(bench.parse_args(["--posterior", spec, "--device", device, *extra]))
    except (Exception, SystemExit) as exc:  # the benchmark must not cost the sampling
        log(f"benchmark failed: {type(exc).__name__}: {exc}")
        return dict(error=f"{type(exc).__name__}: {exc}")
    log("benchmark:\n" + bench.format_table(report))
    return report


MAX_LOG_LINES = 2000  # the driver's log in sampling_log.json: its last lines, each cut to MAX_LINE_CHARS
MAX_LINE_CHARS = 1000


def pack(work: Path, pack_dir: Path, protocol: sampling.Protocol, bench: Optional[dict], log: Log,
         max_files: int = MAX_PACK_FILES, device: Optional[str] = None) -> List[Path]:
    """Write the pack (at most ``max_files`` files, at least 3); returns them.

    ``progress.npz``, ``sampling_log.json`` and ``parts.tar.gz`` always have a place; the pooled
    ``<path>.npy`` take the places left, the others are stored in ``parts.tar.gz`` at its top level.
    ``device``: the card's name for the log (None: asked of torch, which initializes CUDA)."""
    pack_dir.mkdir(parents=True, exist_ok=True)
    parts = work / sampling.PARTS_DIR
    written = []
    pooled = [work / f"{path}.npy" for path in protocol.paths if (work / f"{path}.npy").is_file()]
    slots = max(0, max_files - 3)
    separate, in_tar = pooled[:slots], pooled[slots:]
    for f in separate:
        target = pack_dir / f.name
        target.write_bytes(f.read_bytes())
        written.append(target)
    progress = {}
    for path in protocol.paths:
        f = parts / f"{sampling.part_stem(path, protocol.seeds[0])}_progress.npy"
        if f.is_file():
            progress[path] = np.load(f)
    if progress:
        np.savez_compressed(pack_dir / "progress.npz", **progress)
        written.append(pack_dir / "progress.npz")
    logs, unreadable = [], []
    for f in sorted(parts.glob("*.json")) if parts.is_dir() else []:
        try:  # (a damaged part log costs that part's entry, not the pack)
            part = json.loads(f.read_text())
        except (OSError, ValueError):
            part = None
        if isinstance(part, dict) and {"path", "seed"} <= part.keys():
            logs.append(part)
        else:
            unreadable.append(f.name)
    if unreadable:
        log(f"pack: unreadable part logs (not counted as done): {', '.join(unreadable)}")
    done = {(p["path"], p["seed"]) for p in logs}
    missing = [f"{p} seed {s}" for p in protocol.paths for s in protocol.seeds if (p, s) not in done]
    if in_tar:
        log(f"pack: {len(pooled)} pooled files, {slots} places: {', '.join(f.name for f in in_tar)} in parts.tar.gz")
    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    summary = dict(protocol=dataclasses.asdict(protocol), step_scale=protocol.step_scale, parts=logs,
                   missing=missing, pooled_in_parts_tar=[f.name for f in in_tar], benchmark=bench,
                   driver_log=[line[:MAX_LINE_CHARS] for line in log.lines[-MAX_LOG_LINES:]],
                   device=device, torch=torch.__version__, elapsed_s=time.time() - T0)
    (pack_dir / "sampling_log.json").write_text(json.dumps(summary, indent=1, default=str))
    written.append(pack_dir / "sampling_log.json")
    if parts.is_dir() or in_tar:
        tmp = pack_dir / "parts.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(parts.iterdir()) if parts.is_dir() else []:
                if not f.name.endswith((".tmp.npy", ".tmp")):  # (files a killed write left)
                    tar.add(f, arcname=f"{sampling.PARTS_DIR}/{f.name}")
            for f in in_tar:
                tar.add(f, arcname=f.name)
        os.replace(tmp, pack_dir / "parts.tar.gz")  # a process killed while writing leaves no half tarball
        written.append(pack_dir / "parts.tar.gz")
    too_big = [f.name for f in written if f.stat().st_size > MAX_FILE_BYTES]
    if len(written) > max_files or too_big:
        log(f"pack: {len(written)} files, over {MAX_FILE_BYTES >> 20} MB: {too_big}")
    log(f"pack: {', '.join(f'{f.name} ({f.stat().st_size / 2**20:.2f} MB)' for f in written)}; "
        f"missing parts: {', '.join(missing) or 'none'}")
    return written


def pack_only(args, protocol: sampling.Protocol) -> int:
    """``--pack-only``: the pack of what ``--work`` holds, without a posterior or CUDA."""
    work = Path(args.work)
    log = Log(work / "driver.log", True)
    if (work / "driver.log").is_file():  # the sampling run's own lines, for sampling_log.json
        log.lines = (work / "driver.log").read_text(errors="replace").splitlines()[-MAX_LOG_LINES:]
    bench_file = work / "benchmark.json"
    bench = json.loads(bench_file.read_text()) if bench_file.is_file() else None
    log("pack only (--pack-only): packing what the work folder holds")
    pack(work, Path(args.pack_dir), protocol, bench, log, max_files=args.max_files,
         device="not read (--pack-only leaves CUDA alone)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    protocol = _protocol(args)
    bad = _bad_setting(protocol)
    if not bad and not (math.isfinite(args.deadline) and args.deadline >= 0):
        bad = f"--deadline must be a finite number of seconds >= 0, got {args.deadline}"
    if not bad and args.max_files < 3:
        bad = f"--max-files must be >= 3 (progress.npz, sampling_log.json, parts.tar.gz), got {args.max_files}"
    if bad:
        print(f"gpu_sample: error: {bad}", file=sys.stderr)
        return 2

    def check():
        if not (args.dry_run or args.pack_only or torch.cuda.is_available()):  # before --work/--pack-dir are made
            raise _cli.UsageError("no CUDA device (use --dry-run on a CPU, or --pack-only to pack a work folder)")
        _cli.positive("--pack-reserve", args.pack_reserve, zero_ok=True)
        _cli.nonempty("--posterior", args.posterior, "a posterior name or path")
        _cli.out_dir("--pack-dir", args.pack_dir)  # a file, or under one: not a folder to pack into
        _cli.out_dir("--work", args.work)

    status = _cli.report("gpu_sample", check)
    if status:
        return status
    if args.pack_only:
        return pack_only(args, protocol)
    device = _init_distributed(args.dry_run)
    main_rank = sampling.is_main_process()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "driver.log", main_rank)
    spec = args.posterior or ("untrained:32" if args.dry_run else "mnist")
    try:
        posterior = sampling.load_posterior(spec, device)
        fingerprint = sampling.posterior_fingerprint(posterior)
        sampling.check_folder(work, protocol, (spec, fingerprint))
        center = sampling.data_mean()
    except (ValueError, FileNotFoundError) as exc:
        print(f"gpu_sample: error: {exc}", file=sys.stderr)
        return 2
    log(f"protocol {protocol.name}: {protocol.describe()}; posterior {spec} (weights {fingerprint}); device {device}; "
        f"precision {protocol.precision}, capture {protocol.capture}")
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    bench, bench_file = None, work / "benchmark.json"
    if not args.no_bench and not distributed:
        bench = _bench(args, spec, device, log)
        if main_rank and "error" not in bench:
            bench_file.write_text(json.dumps(bench, indent=1, default=str))
    elif bench_file.is_file():  # a rerun without the benchmark packs the one measured earlier
        bench = json.loads(bench_file.read_text())
        log(f"benchmark: the one measured earlier ({bench_file})")
    deadline = T0 + args.deadline - args.pack_reserve
    failed = None
    try:
        sampling.run_protocol(posterior, protocol, work, center=center, device=device, progress=args.progress,
                              posterior_name=spec, posterior_sha256=fingerprint, deadline=deadline, log=log)
    except Exception as exc:  # what is done is saved: pack it, then report the failure
        failed = f"{type(exc).__name__}: {exc}"
        log(f"sampling stopped: {failed}")
    if main_rank:
        pack(work, Path(args.pack_dir), protocol, bench, log, max_files=args.max_files)
    if distributed:
        dist.destroy_process_group()
    if failed:
        print(f"gpu_sample: error: sampling stopped ({failed}); the finished parts are packed", file=sys.stderr)
        return 1
    return 0


def _bad_setting(protocol: sampling.Protocol) -> Optional[str]:
    """Why the protocol's sizes cannot run (checked before any sampling), or None."""
    for field, low in (("images_per_seed", 1), ("levels", 1), ("first_level_steps", 0), ("steps_per_level", 1),
                       ("n_posterior", 1), ("chunk_chains", 1), ("final_average", 1)):
        value = getattr(protocol, field)
        if isinstance(value, int) and value < low:
            return f"--{field.replace('_', '-')} must be >= {low}, got {value}"
    if not (math.isfinite(protocol.step_fraction) and protocol.step_fraction > 0):
        return f"--step-fraction must be finite and > 0, got {protocol.step_fraction}"
    return None


if __name__ == "__main__":
    sys.exit(main())
