"""Train the three noise-estimation posteriors side by side on one GPU, inside one time-limited call.

The device tool lends a GPU for minutes.  This trains ``--config`` once per seed (default
``configs/eight_gaussians_large.toml``, seeds 42 43 44 into ``runs/eg_large``,
``runs/eg_large_seed43``, ``runs/eg_large_seed44``), one process each on the GPU, under one
wall-clock deadline, and packs the runs into ``--pack-dir`` as tar.gz files (the finished
posteriors in one archive, an unfinished run with its checkpoint in its own)::

    python3 -m experiments.eight_gaussians.gpu_estimation_posteriors --pack-dir "$OUT" --deadline 535 --margin 35   # 469 s on an H200, 3 × 15,000 steps

Its files do not collide with :mod:`experiments.eight_gaussians.gpu_diffusion_tables`'s, so the two can share a call; running
them in two calls on the same machine is faster, since the table jobs' big sampling kernels
would slow the launch-bound trainings.

Once every training has logged two rows, the step rate decides the length: if the config's steps
would not finish ``--margin`` seconds before the deadline, the trainings are restarted (they resume
from their checkpoints) with the most whole thousand steps that will, but never fewer than
``--min-steps``.  The cosine schedule then ends at that step.  A training that dies in its first
minutes is restarted once with ``ETWEEDIE_BACKEND=reference``.  Unfinished trainings keep their
checkpoints (every ``checkpoint_every`` steps), so a later call resumes them.

The estimation itself runs on the CPU afterwards (``python -m experiments.eight_gaussians.estimation``, experiments/eight_gaussians/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments import _cli
from experiments.eight_gaussians.gpu_diffusion_tables import finished, poll_trainings, rate, spawn, stop, tail  # shared process helpers

T0 = time.time()
LOG = ROOT / "runs" / "gpu_estimation_posteriors.log"


def log(message: str) -> None:
    line = f"[{time.time() - T0:7.1f} s] {message}"
    print(line, flush=True)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "a") as f:
        f.write(line + "\n")


def progress(run: str) -> str:
    try:
        last = json.loads((ROOT / run / "train_log.jsonl").read_text().splitlines()[-1])
        return f"{run}: step {last['step']} loss {last['loss']:.4f}"
    except (OSError, IndexError, ValueError):
        return f"{run}: no log yet"


def run_name(prefix: str, seed: int, first_seed: int) -> str:
    return prefix if seed == first_seed else f"{prefix}_seed{seed}"


def main(argv=None) -> int:
    parser = _cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/eight_gaussians_large.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--prefix", default="runs/eg_large", help="run directory of the first seed; the others get _seed<N>")
    parser.add_argument("--pack-dir", help="where the tar.gz results go (the device's $OUT)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds from start to stop and pack")
    parser.add_argument("--margin", type=float, default=40.0, help="seconds before the deadline the trainings should end")
    parser.add_argument("--min-steps", type=int, default=8000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="20 steps of each training on the CPU into runs/dry_gpu_estimation_posteriors (checks the driver)")
    args = parser.parse_args(argv)

    from etweedie.training import load_config

    try:  # before anything starts: a bad --pack-dir would otherwise surface only at the packing, minutes later
        _cli.at_least("--seeds", args.seeds, 0)
        _cli.positive("--deadline", args.deadline)
        _cli.positive("--margin", args.margin, zero_ok=True)
        _cli.at_least("--min-steps", args.min_steps, 1)
        _cli.nonempty("--prefix", args.prefix, "a run directory")
        _cli.nonempty("--config", args.config, "a TOML file")
        if not args.dry_run:  # the dry run trains on the CPU whatever --device says
            _cli.device("--device", args.device)
        _cli.out_dir("--pack-dir", args.pack_dir)
        config_steps = _cli.read_config("--config", ROOT / args.config, load_config).steps
    except _cli.UsageError as exc:
        return _cli.fail("python -m experiments.eight_gaussians.gpu_estimation_posteriors", exc)
    if args.dry_run:
        args.device, args.prefix = "cpu", "runs/dry_gpu_estimation_posteriors/" + Path(args.prefix).name
    py = sys.executable
    runs = {run_name(args.prefix, s, args.seeds[0]): s for s in args.seeds}
    procs, restarted = {}, set()

    def start(run: str, extra_env=None, steps=None):
        argv = [py, "-m", "etweedie", "train", "--config", args.config, "--seed", str(runs[run]), "--device", args.device,
                "--out", run, "--no-progress"] + ([] if steps is None else ["--steps", str(steps)])
        procs[run] = (spawn(argv, ROOT / f"{run}.out", extra_env), time.time())
        log(f"training {run} (seed {runs[run]}) started{' with --steps ' + str(steps) if steps else ''}"
            f"{' with ' + str(extra_env) if extra_env else ''}")

    for run in runs:
        if finished(run):
            log(f"{run}: its posterior exists, not training")
        else:
            start(run, steps=20 if args.dry_run else None)

    decided = args.dry_run
    last_report = 0.0
    while True:
        now = time.time() - T0
        if not decided and procs:
            rates = {run: rate(run) for run in procs}
            if all(r is not None for r in rates.values()):
                decided = True
                finish = max(now + (config_steps - step) / sps for step, sps in rates.values())
                log(f"step rates: {', '.join(f'{r} {sps:.1f}/s at {step}' for r, (step, sps) in rates.items())}; "
                    f"{config_steps} steps would end at {finish:.0f} s (deadline {args.deadline:.0f} s)")
                if finish > args.deadline - args.margin:
                    slowest = min(sps for _, sps in rates.values())
                    step_now = min(step for step, _ in rates.values())
                    steps = int((step_now + slowest * (args.deadline - args.margin - now - 25)) // 1000 * 1000)
                    steps = max(steps, args.min_steps)
                    log(f"restarting the trainings with --steps {steps} (they resume from their checkpoints)")
                    for run, (proc, _) in list(procs.items()):
                        stop(proc)
                        start(run, steps=steps)
        running = poll_trainings([(run, proc, started) for run, (proc, started) in procs.items()], restarted,
                                 lambda run: start(run, {"ETWEEDIE_BACKEND": "reference"}), log)
        if not running:
            break
        if now > args.deadline:
            log("deadline: stopping the trainings (their checkpoints resume later)")
            for proc, _ in procs.values():
                stop(proc)
            break
        if time.time() - last_report > 30:
            last_report = time.time()
            log(" | ".join(progress(run) for run in runs))
        time.sleep(2)
    for run in runs:
        rc = procs[run][0].poll() if run in procs else "-"
        log(f"{run}: rc {rc}; {progress(run)}; posterior {'yes' if finished(run) else 'no'}\n"
            f"{tail(ROOT / f'{run}.out', 3)}")

    if args.pack_dir:
        pack = Path(args.pack_dir)
        pack.mkdir(parents=True, exist_ok=True)
        # at most 8 files of 16 MiB come back from a device call: the finished posteriors share one
        # archive (no optimizer checkpoint); an unfinished run gets its own, with its checkpoint
        done = [run for run in runs if finished(run)]

        def add(name, members, exclude=()):
            with tarfile.open(pack / name, "w:gz") as tar:
                for member in members:
                    if (ROOT / member).exists():
                        tar.add(ROOT / member, arcname=member, filter=lambda t: None if Path(t.name).name in exclude else t)
            log(f"packed {name}: {(pack / name).stat().st_size / 2**20:.1f} MiB")

        if done:
            add(Path(args.prefix).name + "_posteriors.tar.gz", [m for run in done for m in (run, f"{run}.out")],
                exclude=("checkpoint.pt",))
        for run in runs:
            if run not in done:
                add(Path(run).name + "_unfinished.tar.gz", [run, f"{run}.out"])
        (pack / "gpu_estimation_posteriors.log").write_text(LOG.read_text())
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
