"""``etweedie train``: the command-line front end of :func:`etweedie.training.train`.

    etweedie train --config configs/eight_gaussians_cpu.toml --out runs/eg_cpu
    torchrun --nproc_per_node=2 -m etweedie train --config configs/eight_gaussians_cpu.toml --out runs/eg_ddp
    etweedie train --config configs/X.toml --out runs/x --dry-run      # the same code path, 2 steps on the CPU

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the command joins the process group
(NCCL for a CUDA device, gloo for the CPU) and trains with DistributedDataParallel; only rank 0
prints and writes files.  Every failure a user can cause (a bad config, an ``--out`` that is a
file or not writable, ``--device cuda`` without CUDA, a corrupted checkpoint, a second run on
the same ``--out``) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

__all__ = ["CLI_HELP", "add_cli_arguments", "cli_main"]

CLI_HELP = "train the Engression posterior with the energy-score loss (any data source in the config; resumable; torchrun)"


def add_cli_arguments(parser) -> None:
    parser.add_argument("--config", required=True, metavar="PATH", help="TOML config, e.g. configs/eight_gaussians_cpu.toml")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<config name>)")
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--device", help="override the config's device (cpu, cuda, cuda:1)")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="stop after this much training time in this invocation, writing the checkpoint and "
                             "the posterior (the config's max_wall_s); rerun the command to continue with the same budget")
    parser.add_argument("--fit-to-deadline", action="store_true",
                        help="shorten the schedule (warm-up and the whole cosine decay) to what fits in --deadline, "
                             "timed on the first log intervals (the config's fit_to_deadline)")
    parser.add_argument("--dry-run", nargs="?", type=int, const=2, metavar="STEPS",
                        help="run the config's code path on the CPU for STEPS (default 2) steps, logging and "
                             "checkpointing every step (a GPU command checked without a GPU); without --out it writes to "
                             "runs/<config>-dry-run, never to the real run's folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-resume", action="store_true", help="start afresh even if DIR/checkpoint.pt exists")


def _error(message) -> int:
    text = " ".join(str(message).split())
    print(f"etweedie train: error: {text}", file=sys.stderr)
    return 2


def _check_flags(args) -> None:
    """ValueError naming the flag, for values the run cannot use (before the config is read)."""
    for flag, value in (("--config", args.config), ("--out", args.out), ("--device", args.device)):
        if value is not None and not str(value).strip():
            raise ValueError(f"{flag} must not be empty")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.dry_run is not None and args.dry_run < 1:
        raise ValueError(f"--dry-run must be >= 1 steps, got {args.dry_run}")
    if args.deadline is not None and not (math.isfinite(args.deadline) and args.deadline > 0):
        raise ValueError(f"--deadline must be a finite number of seconds > 0, got {args.deadline}")


def _init_distributed(device: str):
    """Join the torchrun process group when launched by torchrun; returns the dist module or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return None
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was requested but CUDA is not available; use --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist


def cli_main(args) -> int:
    from ..backends import BackendUnavailable
    from ..training.checkpoint import RunLockedError
    from ..training import dry_run_config, load_config, train

    try:
        _check_flags(args)
        config = load_config(args.config)
        overrides = {k: getattr(args, k) for k in ("steps", "seed", "device") if getattr(args, k) is not None}
        if args.deadline is not None:
            overrides["max_wall_s"] = args.deadline
        if args.fit_to_deadline:
            if args.deadline is None and not config.max_wall_s > 0:
                raise ValueError("--fit-to-deadline needs --deadline SECONDS (or max_wall_s > 0 in the config)")
            overrides["fit_to_deadline"] = True
        if overrides:
            config = dataclasses.replace(config, **overrides)
        if args.dry_run is not None:
            config = dry_run_config(config, args.dry_run)
    except (ValueError, TypeError) as exc:
        return _error(exc)
    # a dry run without --out gets its own folder: it must never leave a checkpoint that the real
    # run of the same config would then resume from (other schedule, 2 steps)
    out_dir = args.out if args.out is not None else str(
        Path("runs") / (Path(args.config).stem + ("-dry-run" if args.dry_run is not None else "")))
    dist = None
    try:
        dist = _init_distributed(config.device)
        summary = train(config, out_dir, resume=not args.no_resume, progress=not args.no_progress)
    except (ValueError, TypeError, RunLockedError, FloatingPointError, BackendUnavailable) as exc:
        return _error(exc)
    except FileNotFoundError as exc:  # missing input data (e.g. the MNIST folder): its message names what is missing
        return _error(exc)
    except OSError as exc:  # e.g. the disk filled up while writing a checkpoint
        return _error(f"cannot write the run directory {out_dir!r}: {exc}")
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    if summary["world_size"] > 1 and int(os.environ.get("RANK", "0")) != 0:
        return 0
    if summary["resumed_from"] is not None:
        print(f"resumed from step {summary['resumed_from']}")
        if summary["resumed_from"] >= summary["steps"]:
            print(f"nothing left to train: the run in {out_dir} had reached step {summary['resumed_from']} of its "
                  f"{summary['steps']} (more --steps continue it; --no-resume starts afresh)")
    ranks = f" on {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    print(
        f"trained {summary['step']} steps{ranks} in {summary['wall_time_s']:.1f} s "
        f"({summary['cpu_time_s']:.1f} s CPU); "
        f"final loss {summary['final_loss']:.4f}"
    )
    if summary["fitted_steps"] is not None:
        print(f"schedule fitted to the deadline ({config.max_wall_s:g} s): {summary['fitted_steps']} steps "
              f"(the config's upper bound: {config.steps})")
    if summary["stopped_by"] == "deadline":
        print(f"stopped at the deadline ({config.max_wall_s:g} s) at step {summary['step']} of {summary['steps']}; "
              "rerun the command to continue")
    print(f"posterior written to {summary['posterior']}")
    print(f"log: {summary['log']}  checkpoint: {summary['checkpoint']}")
    return 0
