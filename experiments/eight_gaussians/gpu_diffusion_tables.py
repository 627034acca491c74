"""The eight-Gaussians diffusion tables on one GPU, inside one time-limited call: train the two full-config diffusion posteriors,
then run Table full5_diffusion_paths and the isolation table, and pack the results.

The device tool lends a GPU for minutes, so everything runs under one wall-clock deadline and is
resumable: a finished training (its ``posterior/`` folder) or table job (``diffusion_results.json``) is
skipped on a rerun, an unfinished training resumes from its checkpoint.  Work runs as separate
processes (the two trainings side by side, then up to ``--workers`` table jobs at a time), so one
failure does not take the others down.

    python -m experiments.eight_gaussians.gpu_diffusion_tables --pack-dir "$OUT" --deadline 560

Stages:
1. the two trainings of ``configs/eight_gaussians_diffusion_full.toml`` (seeds 42, 43) start at once
   on the GPU (``etweedie train --device cuda``);
2. meanwhile a smoke run trains a tiny model for a few steps on the GPU and samples the quick
   version of ``configs/diffusion_full.toml`` from it; a training that dies in its first minutes is
   restarted once with ``ETWEEDIE_BACKEND=reference``;
3. when both posteriors exist, one job per path of the paths table (both models, three seeds each,
   exactly the protocol of ``python -m experiments.eight_gaussians.diffusion --config configs/diffusion_full.toml``), then one job
   per isolation arm;
4. at the deadline, whatever still runs is stopped, and the run directories are packed into
   ``--pack-dir`` as tar.gz files (the trainings separately, so each stays small).

Every finished run saves its final samples and tracking records under ``<job>/samples``.  By default
a table job stops there: its bootstrap intervals and figures are left out, because on the lent
machines (no compiled extension; the CPU-side metrics ran the pure-PyTorch reference) the jobs
twice spent minutes in that stage and were stopped before writing it.  ``--score-on-gpu`` keeps
them.  The tables are scored afterwards on any machine, also from jobs stopped at the deadline::

    python -m experiments.eight_gaussians.diffusion --config configs/diffusion_full.toml --checkpoint runs/egd_full --checkpoint runs/egd_full_seed43 \
        --from-samples runs/diffusion_full_gpu/paths_isotropic ... --out runs/diffusion_full_gpu/table

A later call that carries ``runs/egd_full`` and ``runs/egd_full_seed43`` (device ``carry``) skips the
training; ``--tables isolation paths`` runs the isolation arms first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from experiments import _cli

ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIG = "configs/eight_gaussians_diffusion_full.toml"
SAMPLE_CONFIG = "configs/diffusion_full.toml"
MODELS = (("runs/egd_full", 42), ("runs/egd_full_seed43", 43))
JOB_ROOT = Path("runs/diffusion_full_gpu")
T0 = time.time()


def log(message: str) -> None:
    line = f"[{time.time() - T0:7.1f} s] {message}"
    print(line, flush=True)
    with open(JOB_ROOT / "driver.log", "a") as f:
        f.write(line + "\n")


def env(extra=None):
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    e.update(extra or {})
    return e


def spawn(argv, logfile: Path, extra_env=None) -> subprocess.Popen:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    out = open(logfile, "a")
    return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env(extra_env), start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def job_path(table: str, name: str, suffix: str = "") -> Path:
    """A table job's folder (or, with ``suffix``, its log).  Not ``Path.with_suffix``: arm names hold dots
    (``fixed_beta1.3``), so that would map three arms onto one log."""
    return JOB_ROOT / f"{table}_{name.replace(',', '_')}{suffix}"


def finished(run) -> bool:
    """Whether the training run folder ``ROOT/run`` holds its final posterior (``posterior/``, or a
    legacy ``posterior.pt``): a run cut short holds only its checkpoint."""
    from etweedie.training.engression import LEGACY_POSTERIOR_FILE, POSTERIOR_DIR

    return (ROOT / run / POSTERIOR_DIR / "config.json").is_file() or (ROOT / run / LEGACY_POSTERIOR_FILE).is_file()


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def poll_trainings(procs, restarted: set, restart, log) -> bool:
    """One look at training processes ``[(run, proc, started)]``: True while any still runs.  A run
    that failed within its first 4 minutes is restarted once (``restart(run)``; noted in ``restarted``)."""
    running = False
    for run, proc, started in procs:
        rc = proc.poll()
        if rc is None:
            running = True
        elif rc != 0 and run not in restarted and time.time() - started < 240:
            restarted.add(run)
            log(f"{run} failed (rc {rc}):\n{tail(ROOT / f'{run}.out')}")
            restart(run)
            running = True
    return running


def train_progress(run: str) -> str:
    log_path = ROOT / run / "train_log.jsonl"
    try:
        last = json.loads(log_path.read_text().splitlines()[-1])
        return f"{run}: step {last['step']} loss {last['loss']:.4f} wall {last['wall_time']:.0f} s"
    except (OSError, IndexError, ValueError):
        return f"{run}: no log yet"


def rate(run: str):
    """(step, steps per second) from the last two rows of a training log, or None."""
    try:
        rows = [json.loads(line) for line in (ROOT / run / "train_log.jsonl").read_text().splitlines()[-2:]]
    except (OSError, ValueError):
        return None
    if len(rows) < 2 or rows[1]["wall_time"] <= rows[0]["wall_time"]:
        return None
    return rows[1]["step"], (rows[1]["step"] - rows[0]["step"]) / (rows[1]["wall_time"] - rows[0]["wall_time"])


def maybe_shorten(trainings, args, start_training) -> bool:
    """Once the step rate is known: if 40,000 steps would not leave ``--table-seconds`` for the paths
    table before the deadline, restart the trainings (they resume) with fewer steps.  Returns True once
    decided (either way)."""
    rates = {run: rate(run) for run in trainings}
    if any(r is None for r in rates.values()):
        return False
    steps_total = 40000
    now = time.time() - T0
    budget_end = args.deadline - args.table_seconds
    finish = max(now + (steps_total - step) / sps for step, sps in rates.values())
    log(f"step rates: {', '.join(f'{run} {sps:.1f}/s at {step}' for run, (step, sps) in rates.items())}; "
        f"40k steps would end at {finish:.0f} s (tables need to start by {budget_end:.0f} s)")
    if finish <= budget_end:
        return True
    slowest = min(sps for _, sps in rates.values())
    steps = int((min(step for step, _ in rates.values()) + slowest * (budget_end - now - 20)) // 1000 * 1000)
    steps = max(steps, 10000)
    log(f"too slow for 40k steps in this call: restarting the trainings with --steps {steps} (they resume)")
    for run, (proc, seed, _) in list(trainings.items()):
        stop(proc)
        start_training(run, seed, None, steps)
    return True


# ---------------------------------------------------------------------------- one table job (worker)
def worker(args) -> int:
    import torch

    from experiments.eight_gaussians import diffusion as diffusion_eval

    torch.set_num_threads(args.threads)
    config = diffusion_eval.load_config(ROOT / SAMPLE_CONFIG)
    config["posterior"].update(kind="checkpoint", checkpoints=[m for m, _ in MODELS], device=args.device)
    other = "isolation" if args.table == "paths" else "paths"
    config[other]["enabled"] = False
    if args.dry_run:
        for section, values in diffusion_eval._QUICK.items():
            config[section].update(values)
    config[args.table]["names"] = [args.name]
    if not args.score_on_gpu:
        # sampling only: the bootstrap and the figures are left to `experiments.eight_gaussians.diffusion --from-samples`
        config["bootstrap"]["n_boot"] = 0
    diffusion_eval._validate(config)
    results = diffusion_eval.run_diffusion_eval(config, out_dir=args.job_dir, progress=True, figures=args.score_on_gpu)
    print(diffusion_eval.format_tables(results))
    return 0


# ---------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    parser = _cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pack-dir", help="where the tar.gz results go (the device's $OUT)")
    parser.add_argument("--deadline", type=float, default=560.0, help="seconds from start to stop everything and pack")
    parser.add_argument("--workers", type=int, default=4, help="table jobs at a time")
    parser.add_argument("--device", default=None, help="torch device of the trainings and table jobs (default cuda; cpu with --dry-run)")
    parser.add_argument("--no-isolation", action="store_true")
    parser.add_argument("--tables", nargs="+", choices=("paths", "isolation"), default=["paths", "isolation"],
                        help="table jobs to run, in this order (default: paths isolation)")
    parser.add_argument("--arms", nargs="+", metavar="NAME",
                        help="isolation arms to run, in this order (default: all of the config's, in its order); "
                             "put the arms still missing first, so a deadline cuts the ones already done elsewhere")
    parser.add_argument("--skip-smoke", action="store_true",
                        help="no smoke run (≈ 25 s): for a machine already known to run the default backends")
    parser.add_argument("--table-seconds", type=float, default=210.0,
                        help="time kept for the paths table: fewer training steps if 40k would not leave it")
    parser.add_argument("--score-on-gpu", action="store_true",
                        help="also run the bootstrap intervals and figures in each table job (by default the jobs only "
                             "sample and save; score them afterwards with experiments.eight_gaussians.diffusion --from-samples)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the driver on a CPU: 20-step CPU-config models and the quick tables under runs/dry_gpu_diffusion_tables/")
    parser.add_argument("--worker", nargs=2, metavar=("TABLE", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=3, help="CPU threads per table job (default 3)")
    args = parser.parse_args(argv)

    def check():  # before anything starts: a bad --pack-dir would otherwise surface only at the packing, minutes later
        _cli.positive("--deadline", args.deadline)
        _cli.positive("--table-seconds", args.table_seconds, zero_ok=True)
        _cli.at_least("--workers", args.workers, 1)
        _cli.threads("--threads", args.threads)
        # the default device is cuda unless --dry-run: a CPU-only machine is told so here, before
        # any folder is made (the trainings had started, failed, and the driver exited 0)
        if args.device is None and not args.dry_run:
            import torch

            if not torch.cuda.is_available():
                raise _cli.UsageError("no CUDA device: the tables run on a GPU (--device, default cuda); "
                                      "--dry-run checks the driver on a CPU")
        _cli.device("--device", args.device)
        if not args.worker:
            _cli.out_dir("--pack-dir", None if args.pack_dir is None else ROOT / args.pack_dir)  # used after chdir(ROOT)

    status = _cli.report("python -m experiments.eight_gaussians.gpu_diffusion_tables", check)
    if status:
        return status
    global JOB_ROOT, MODELS, TRAIN_CONFIG
    if args.device is None:  # the dry run checks the driver on a CPU, as its help says
        args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        JOB_ROOT = Path("runs/dry_gpu_diffusion_tables")
        MODELS = tuple((str(JOB_ROOT / Path(run).name), seed) for run, seed in MODELS)
        TRAIN_CONFIG = "configs/eight_gaussians_diffusion_cpu.toml"
    if args.worker:
        args.table, args.name = args.worker
        return worker(args)
    # the table jobs: one per path / arm of the config (its isolation arms default to etweedie.sample.paths.ISOLATION_ARMS)
    from experiments.eight_gaussians.diffusion import load_config

    sample_config = load_config(ROOT / SAMPLE_CONFIG)
    if args.arms:  # checked before anything starts: a typo would otherwise surface only after the trainings
        known = sample_config["isolation"]["names"]
        if any(a not in known for a in args.arms) or len(set(args.arms)) < len(args.arms):
            parser.error(f"--arms: expected distinct isolation arms of {SAMPLE_CONFIG} ({', '.join(known)}), got {args.arms}")

    os.chdir(ROOT)
    JOB_ROOT.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    try:
        info = subprocess.run(
            [py, "-c", "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"],
            capture_output=True, text=True, timeout=120, env=env(),
        )
        log(f"torch/triton/device: {info.stdout.strip()} {info.stderr.strip()[-300:]}")
    except Exception as exc:  # the log says what is missing; the stages below fail with their own errors
        log(f"environment probe failed: {exc!r}")

    # 1. trainings
    trainings = {}
    restarted = set()

    def start_training(run, seed, extra_env=None, steps=None):
        if args.dry_run:
            steps = 20
        argv = [py, "-m", "etweedie", "train", "--config", TRAIN_CONFIG, "--seed", str(seed), "--device", args.device,
                "--out", run, "--no-progress"] + ([] if steps is None else ["--steps", str(steps)])
        trainings[run] = (spawn(argv, ROOT / f"{run}.out", extra_env), seed, time.time())
        log(f"training {run} (seed {seed}) started{' with ' + str(extra_env) if extra_env else ''}")

    carried = {run for run, _ in MODELS if finished(run)}
    for run, seed in MODELS:
        if finished(run):
            log(f"{run}: its posterior exists, not training")
        else:
            start_training(run, seed)

    # 2. smoke: a few GPU training steps of a tiny model, then the quick tables from it; on a
    #    failure once more with the pure-PyTorch backend (then the table jobs use it too)
    smoke_dir = JOB_ROOT / "smoke"
    smoke_log = JOB_ROOT / "smoke.log"
    smoke_train = [py, "-m", "etweedie", "train", "--config", "configs/eight_gaussians_diffusion_cpu.toml", "--steps", "30",
                   "--device", args.device, "--out", str(smoke_dir / "model"), "--no-progress", "--no-resume"]
    smoke_sample = [py, "-m", "experiments.eight_gaussians.diffusion", "--config", SAMPLE_CONFIG, "--quick", "--checkpoint",
                    str(smoke_dir / "model"), "--device", args.device, "--out", str(smoke_dir / "sample"), "--no-progress"]
    smoke_ok, job_env = args.skip_smoke, None
    for attempt_env in () if args.skip_smoke else (None, {"ETWEEDIE_BACKEND": "reference"}):
        ok = True
        for argv in (smoke_train, smoke_sample):
            t = time.time()
            with open(smoke_log, "a") as out:
                rc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env(attempt_env)).returncode
            log(f"smoke {argv[3]} ({attempt_env or 'default backends'}): rc {rc} in {time.time() - t:.1f} s")
            if rc != 0:
                ok = False
                log("smoke log tail:\n" + tail(smoke_log, 40))
                break
        if ok:
            smoke_ok, job_env = True, attempt_env
            break

    # wait for the trainings (restart once on an early failure)
    train_deadline = args.deadline - 45
    last_report = 0.0
    shortened = False
    while True:
        if not shortened and not args.dry_run and trainings:
            shortened = maybe_shorten(trainings, args, start_training)
        running = poll_trainings(
            [(run, proc, started) for run, (proc, _, started) in trainings.items()], restarted,
            lambda run: start_training(run, trainings[run][1], {"ETWEEDIE_BACKEND": "reference"}), log)
        if not running:
            break
        if time.time() - T0 > train_deadline:
            log("training deadline: stopping the trainings (their checkpoints resume later)")
            for proc, _, _ in trainings.values():
                stop(proc)
            break
        if time.time() - last_report > 30:
            last_report = time.time()
            log(" | ".join(train_progress(run) for run, _ in MODELS))
        time.sleep(2)
    for run, (proc, _, _) in trainings.items():
        log(f"{run}: rc {proc.poll()}; {train_progress(run)}\n{tail(ROOT / f'{run}.out', 4)}")
    have_models = all(finished(run) for run, _ in MODELS)

    # 3. table jobs
    by_table = {table: [(table, n) for n in sample_config[table]["names"]] for table in ("paths", "isolation")}
    if args.arms:
        by_table["isolation"] = [("isolation", n) for n in args.arms]
    tables = [t for t in args.tables if not (t == "isolation" and args.no_isolation)]
    jobs = [job for table in tables for job in by_table[table]]
    if not (have_models and smoke_ok):
        log(f"no table jobs (models ready: {have_models}, smoke ok: {smoke_ok})")
        jobs = []
    pending, active = list(jobs), {}
    while pending or active:
        while pending and len(active) < args.workers and time.time() - T0 < args.deadline - 20:
            table, name = pending.pop(0)
            job_dir = job_path(table, name)
            if (job_dir / "diffusion_results.json").exists():
                log(f"{table}/{name}: done earlier")
                continue
            argv = [py, "-m", "experiments.eight_gaussians.gpu_diffusion_tables", "--worker", table, name, "--job-dir", str(job_dir),
                    "--device", args.device, "--threads", str(args.threads)] + (["--dry-run"] if args.dry_run else []) \
                + (["--score-on-gpu"] if args.score_on_gpu else [])
            active[(table, name)] = (spawn(argv, job_path(table, name, ".log"), job_env), time.time())
            log(f"{table}/{name}: started")
        for key, (proc, started) in list(active.items()):
            rc = proc.poll()
            if rc is not None:
                del active[key]
                job_log = job_path(*key, ".log")
                log(f"{key[0]}/{key[1]}: rc {rc} in {time.time() - started:.0f} s" + ("" if rc == 0 else "\n" + tail(job_log)))
        if time.time() - T0 > args.deadline:
            log(f"deadline: stopping {len(active)} job(s), {len(pending)} not started: {[k for k in active] + pending}")
            for proc, _ in active.values():
                stop(proc)
            break
        if not active and (not pending or time.time() - T0 > args.deadline - 20):
            break
        time.sleep(1)

    # 4. pack
    if args.pack_dir:
        pack = Path(args.pack_dir)
        pack.mkdir(parents=True, exist_ok=True)

        def add(tar_name, members):
            with tarfile.open(pack / tar_name, "w:gz") as tar:
                for m in members:
                    if (ROOT / m).exists():
                        tar.add(ROOT / m, arcname=m)
            log(f"packed {tar_name}: {(pack / tar_name).stat().st_size / 2**20:.1f} MiB")

        for run, _ in MODELS:
            if run not in carried:  # at most 8 files come back: a carried model is not sent back
                add(Path(run).name + ".tar.gz", [run, f"{run}.out"])
        for table in ("paths", "isolation"):  # an empty table would only take one of the 8 files that come back
            members = [str(p.relative_to(ROOT)) for p in sorted((ROOT / JOB_ROOT).glob(f"{table}_*"))]
            if members:
                add(f"tables_{table}.tar.gz", members)
        add("smoke.tar.gz", [str(JOB_ROOT / "smoke"), str(JOB_ROOT / "smoke.log")])
        (pack / "driver.log").write_text((JOB_ROOT / "driver.log").read_text())
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
