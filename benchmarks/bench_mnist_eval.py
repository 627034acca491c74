"""Speed of the MNIST image evaluation on CPU (etweedie.evaluation.image_metrics, `etweedie mnist-eval`).

Three workloads, each checked before it is timed:

* ``classifier_t10k``  — features + logits of the 10,000 t10k images (MNIST-12, onnxruntime,
  batched); checked: t10k accuracy 0.989 and batch-1 logits equal to the batched ones.
* ``nearest_train_768`` — nearest-training-image RMSE of 768 held-out images against the 60,000
  training images (chunked GEMM ranking + exact re-ranking); checked against brute force on a
  slice.
* ``mnist_eval_768``   — one whole ``python -m etweedie mnist-eval FILE.npy`` of a 768-image
  file with 1,000 bootstrap replicates and a 200-draw null, in a fresh process (start-up, data
  loading and set-up included); checked: exit status 0 and the JSON row.

Targets (2 CPU threads): ≤ 3 s, ≤ 5 s and ≤ 60 s.  Run from the repository root:

    python benchmarks/bench_mnist_eval.py [--threads 2] [--quick]

It prints a table: wall time (median and p20–p80 over the repeats), the CPU seconds of one
run (all threads; for the end-to-end run, the child process's), the target, the CPU and the
1-minute load average before and after.  On a shared machine the wall time rises with the load
while the CPU seconds do not: CPU seconds / threads is the wall time of an uncontended run when
the threads are kept busy.  Not collected by pytest.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import MAX_THREADS, check_flags, check_threads, cpu_name, flag_error, time_call  # noqa: E402
from etweedie.commandline import OneLineParser  # noqa: E402
from etweedie.evaluation import MnistClassifier, MnistEvaluator, nearest_train  # noqa: E402
from etweedie.data import load_mnist  # noqa: E402

TARGETS_S = {"classifier_t10k": 3.0, "nearest_train_768": 5.0, "mnist_eval_768": 60.0}


def _check_classifier(clf: MnistClassifier, images, labels) -> None:
    feats, logits = clf(images)
    accuracy = float((logits.argmax(1) == labels).double().mean())
    if abs(accuracy - 0.989) > 0.001:
        raise SystemExit(f"classifier check failed: t10k accuracy {accuracy:.4f}, expected 0.989")
    for k in (0, 4321, 9999):
        f1, z1 = clf(images[k:k + 1])
        if not torch.allclose(z1[0], logits[k], rtol=1e-5, atol=1e-4) or not torch.allclose(f1[0], feats[k], rtol=1e-5, atol=1e-5):
            raise SystemExit(f"classifier check failed: image {k} differs between batch 1 and batch 10,000")


def _check_nearest(queries, train) -> None:
    sub = train[:5000]
    rmse, index = nearest_train(queries[:64], sub)
    d = torch.cdist(queries[:64].reshape(64, -1).double() / 255, sub.reshape(5000, -1).double() / 255,
                    compute_mode="donot_use_mm_for_euclid_dist")
    best, best_index = d.min(1)
    if not torch.allclose(rmse, best / 28.0, rtol=1e-12, atol=1e-12) or not torch.equal(index, best_index):
        raise SystemExit("nearest_train check failed against brute force")


def cpu_seconds(fn) -> float:
    """CPU seconds (user + system, all threads, this process and waited-for children) of one ``fn()``."""
    def now():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start = now()
    fn()
    return now() - start


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help=f"CPU threads, 1 to {MAX_THREADS} (default 2)")
    parser.add_argument("--quick", action="store_true", help="one repeat of the end-to-end run, fewer of the others")
    parser.add_argument("--data-dir", help="MNIST folder (default: the repository's data/mnist)")
    args = parser.parse_args(argv)
    prog = "python benchmarks/bench_mnist_eval.py"
    try:  # one line and exit status 2 for a flag the run cannot use, before any timing
        check_flags([check_threads(args.threads)])
        if args.data_dir is not None and not args.data_dir.strip():
            raise ValueError("--data-dir must be a folder holding the MNIST files, got an empty string")
        if args.data_dir is not None and not os.path.isdir(args.data_dir):
            raise ValueError(f"--data-dir must be a folder holding the MNIST files, got {args.data_dir!r} "
                             f"({'not a folder' if os.path.exists(args.data_dir) else 'no such folder'})")
    except ValueError as exc:
        return flag_error(prog, exc)
    try:  # missing or corrupt MNIST files (MnistChecksumError is a ValueError), a missing classifier
        test_images, test_labels = load_mnist("test", args.data_dir)
        train_images, _ = load_mnist("train", args.data_dir)
        clf = MnistClassifier(threads=args.threads)
    except (ValueError, OSError, EOFError) as exc:
        where = f"--data-dir {args.data_dir!r}" if args.data_dir is not None else "the default MNIST folder (--data-dir)"
        what = "" if isinstance(exc, (ValueError, FileNotFoundError)) else "cannot read the MNIST files: "
        return flag_error(prog, ValueError(f"{where}: {what}{exc}"))
    torch.set_num_threads(args.threads)  # (after the inputs are read: a refused call leaves the caller's setting)
    load_before = os.getloadavg()[0]
    rows = []
    _check_classifier(clf, test_images, test_labels)
    t = time_call(lambda: clf(test_images), warmup=1, min_repeats=3 if args.quick else 5, budget_s=5.0)
    rows.append(("classifier_t10k", "features + logits, 10,000 t10k images", t, cpu_seconds(lambda: clf(test_images))))

    evaluator = MnistEvaluator(args.data_dir, classifier=clf)
    queries = evaluator.real_images(768)
    _check_nearest(queries, train_images)
    t = time_call(lambda: nearest_train(queries, train_images), warmup=1, min_repeats=3, budget_s=5.0)
    rows.append(("nearest_train_768", "nearest-train RMSE, 768 vs 60,000", t, cpu_seconds(lambda: nearest_train(queries, train_images))))

    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "real768.npy"
        np.save(sample, queries.numpy())
        out = Path(tmp) / "row.json"
        command = [sys.executable, "-m", "etweedie", "mnist-eval", str(sample), "--n-boot", "1000", "--null-draws", "200",
                   "--threads", str(args.threads), "--json", str(out)]
        if args.data_dir:
            command += ["--data-dir", args.data_dir]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

        def run():
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"mnist-eval failed ({done.returncode}): {done.stderr.strip()}")
            row = json.loads(out.read_text())["rows"][0]
            if row["n"] != 768 or row["null_p95"] is None:
                raise SystemExit(f"mnist-eval wrote an unexpected row: {row}")

        t = time_call(run, warmup=0, min_repeats=1 if args.quick else 3, max_repeats=1 if args.quick else 3, budget_s=0.0)
        rows.append(("mnist_eval_768", "`etweedie mnist-eval` 768 images, 1,000 boot, 200-draw null", t, cpu_seconds(run)))

    load_after = os.getloadavg()[0]
    print(f"CPU: {cpu_name()}; threads {args.threads}; load average (1 min) {load_before:.1f} before, {load_after:.1f} after")
    print("| workload | what | wall s, median (p20–p80) | repeats | CPU s (one run) | CPU s / threads | target wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, what, timing, cpu in rows:
        print(f"| {name} | {what} | {timing.median_ms / 1e3:.2f} ({timing.p20_ms / 1e3:.2f}–{timing.p80_ms / 1e3:.2f}) | "
              f"{timing.repeats} | {cpu:.2f} | {cpu / args.threads:.2f} | {TARGETS_S[name]:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
