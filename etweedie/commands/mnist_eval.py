"""``etweedie mnist-eval``: the MNIST table of the paper (Table mnist_quantitative) for sample files.

    etweedie mnist-eval SAMPLES [SAMPLES ...] [--json OUT.json] [--data-dir DIR] [--figures DIR]
    etweedie mnist-eval --real N [...]

Each SAMPLES file is a ``.npy`` or ``.pt`` array of shape (n, 28, 28) or (n, 784), float in
[0, 1] or uint8 in 0..255 (a ``.pt`` may also hold a dict with an ``images`` tensor).  One table
row per file: classifier-feature energy distance to the 2,048-image t10k bank with its bootstrap
interval, the real-vs-real null at the same n (mean and 95th percentile), mean confidence,
class TV, classes present, and nearest-train RMSE beside the held-out value.  ``--real N``
scores N held-out t10k images disjoint from the bank (the table's first row) and prints the
paper's row under it.  The metrics are :mod:`etweedie.evaluation.image_metrics`; the figures
:mod:`etweedie.evaluation.image_figures`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

if TYPE_CHECKING:  # annotations only: the command imports torch when it runs
    import torch

CLI_HELP = "score MNIST samples (paper Table mnist_quantitative): classifier-feature ED and its null, confidence, class TV, nearest-train RMSE"

# The paper's real-vs-real row (App. diffusion_mnist): n = 768 pooled held-out images.
PAPER_REAL_ROW = dict(
    n=768, feature_ed=0.015, null_p95=0.017, mean_confidence=0.993, mean_confidence_ci=[0.989, 0.996],
    class_tv=0.074, class_tv_ci=[0.058, 0.117], classes_present=10, heldout_nearest_train_rmse=0.147,
)
JSON_KEYS = (
    "n", "groups", "feature_ed", "feature_ed_ci", "null_mean", "null_p95", "mean_confidence", "mean_confidence_ci",
    "class_tv", "class_tv_ci", "classes_present", "nearest_train_rmse", "nearest_train_rmse_ci",
    "heldout_nearest_train_rmse",
)


def add_cli_arguments(parser) -> None:
    parser.add_argument("samples", nargs="*", metavar="SAMPLES", help=".npy or .pt image arrays (n, 28, 28) or (n, 784); float in [0, 1] or uint8")
    parser.add_argument("--real", type=int, metavar="N", help="also score N held-out t10k images disjoint from the bank (the real-vs-real row)")
    parser.add_argument("--json", metavar="OUT.json", help="write the rows and settings as JSON")
    parser.add_argument("--data-dir", metavar="DIR", help="folder with the four MNIST IDX files (default: $ETWEEDIE_MNIST_DIR or the repository's data/mnist)")
    parser.add_argument("--figures", metavar="DIR", help="write an image grid and a nearest-training-image figure per row to DIR")
    parser.add_argument("--groups", type=int, default=1, metavar="K", help="each file holds K consecutive equal seed groups; the bootstrap resamples within them (paper: 3 x 256; default 1)")
    parser.add_argument("--n-boot", type=int, default=1000, metavar="B", help="bootstrap replicates per interval (default 1000)")
    parser.add_argument("--null-draws", type=int, default=200, metavar="D", help="real-vs-real draws for the null at each n (default 200; 0: none)")
    parser.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and the null draws (default 0)")
    parser.add_argument("--threads", type=int, metavar="T", help="CPU threads for torch and onnxruntime (default: torch's)")


def load_samples(path) -> "torch.Tensor":
    """The image array in a ``.npy`` or ``.pt`` file (no pickled code is executed)."""
    import numpy as np
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".pt"):
        raise ValueError(f"{path}: SAMPLES must be a .npy or .pt file, got suffix {path.suffix!r}")
    try:
        if suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            if not array.dtype.isnative:  # a big-endian file (torch.from_numpy refuses the byte order)
                array = array.astype(array.dtype.newbyteorder("="))
            return torch.from_numpy(array)
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, or pickled objects (never unpickled): one named error
        raise ValueError(f"{path}: cannot read the array ({type(exc).__name__}: {exc})") from exc
    if isinstance(obj, dict) and isinstance(obj.get("images"), torch.Tensor):
        obj = obj["images"]
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{path}: a .pt file must hold a tensor or a dict with an 'images' tensor, got {type(obj).__name__}")
    return obj


def _fmt_ci(value, ci, digits: int = 3) -> str:
    if value is None:
        return "—"
    text = f"{value:.{digits}f}"
    if ci:
        text += f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return text


def _print_rows(rows: List[Dict], level: float) -> None:
    pct = f"{100 * level:g}%"
    head = ("source", "n", f"feature ED [{pct}]", "null mean / p95", f"confidence [{pct}]", f"class TV [{pct}]", "classes", "NN-train RMSE (held-out)")
    table = [head]
    for row in rows:
        mean = "—" if row.get("null_mean") is None else f"{row['null_mean']:.4f}"
        null = "—" if row.get("null_p95") is None else f"{mean} / {row['null_p95']:.3f}"
        nn = "—" if row.get("nearest_train_rmse") is None else f"{row['nearest_train_rmse']:.3f}"
        table.append((
            row["source"], str(row["n"]),
            _fmt_ci(row["feature_ed"], row.get("feature_ed_ci")),
            null,
            _fmt_ci(row["mean_confidence"], row.get("mean_confidence_ci")),
            _fmt_ci(row["class_tv"], row.get("class_tv_ci")),
            str(row["classes_present"]),
            f"{nn} ({row['heldout_nearest_train_rmse']:.3f})",
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for k, r in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _usage_error(args) -> str | None:
    """The first problem with the arguments alone (files unread, nothing set up), or None."""
    if not args.samples and args.real is None:
        return "give one or more SAMPLES files, or --real N"
    for name in ("n_boot", "null_draws", "groups"):
        minimum = {"n_boot": 2, "null_draws": 0, "groups": 1}[name]
        if getattr(args, name) < minimum:
            return f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(args, name)}"
    if not 0 < args.level < 1:
        return f"--level must lie in (0, 1), got {args.level}"
    from .._checks import MAX_THREADS, check_output_dir, check_output_file

    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        return f"--threads must be in [1, {MAX_THREADS}], got {args.threads}"

    if args.data_dir is not None and not args.data_dir.strip():
        return f"--data-dir must be a folder holding the MNIST files, got {args.data_dir!r}"
    if args.json is not None and args.json.strip():
        target = Path(args.json).expanduser().resolve()
        clash = next((p for p in args.samples if Path(p).expanduser().resolve() == target), None)
        if clash is not None:  # the results would overwrite the samples they score
            return f"--json {args.json!r} is the SAMPLES file {clash!r}; give another path"
    try:  # the outputs' paths are tried now, not after minutes of evaluation
        if args.json is not None:
            check_output_file(args.json, "--json", parents=True)
        if args.figures is not None:
            check_output_dir(args.figures, "--figures")
    except ValueError as exc:
        return str(exc)
    from ..evaluation.image_metrics import BANK_SIZE, MAX_SEED  # onnx is imported only when the classifier loads

    if not 0 <= args.seed <= MAX_SEED:
        return f"--seed must be in [0, {MAX_SEED}], got {args.seed}"
    if args.real is not None and not 2 <= args.real <= 10000 - BANK_SIZE:
        return f"--real must lie in [2, {10000 - BANK_SIZE}] (held-out t10k images outside the {BANK_SIZE}-image bank), got {args.real}"
    return None


def _read_samples(args) -> list:
    """(path, unit images) of every SAMPLES file, each read and checked against ``--groups``
    (and ``--real`` too) before the (seconds-long) set-up."""
    from ..evaluation.image_metrics import as_unit_images

    samples = []
    for path in args.samples:
        try:
            samples.append((path, as_unit_images(load_samples(path), name=str(path))))
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            raise ValueError(msg if str(path) in msg else f"{path}: {msg}") from exc
        n = samples[-1][1].shape[0]
        if n % args.groups or n // args.groups < 2:
            raise ValueError(f"{path}: --groups {args.groups} must split its {n} images into equal groups "
                             f"of at least 2")
    if args.real is not None and (args.real % args.groups or args.real // args.groups < 2):
        raise ValueError(f"--groups {args.groups} must split the --real {args.real} images into equal groups "
                         f"of at least 2")
    return samples


def _write_figures(args, jobs, evaluator) -> List[str]:
    """An image grid and a nearest-training-image figure per row in ``--figures``; their paths."""
    from ..evaluation.image_figures import image_grid, nearest_train_figure

    figures = []
    out = Path(args.figures)
    stems = set()
    for k, (source, images) in enumerate(jobs):
        stem = "real" if (args.real is not None and k == 0) else Path(source).stem
        stem = stem if stem not in stems else f"{stem}_{k}"  # two files with one name in different folders
        stems.add(stem)
        figures.append(str(image_grid(images, out / f"{stem}_grid.png", title=source)))
        figures.append(str(nearest_train_figure(images, evaluator.train_images, out / f"{stem}_nearest_train.png", title=source)))
    print(f"figures written to {out}")
    return figures


def _write_json(args, rows: List[Dict], evaluator, elapsed: float, figures: List[str]) -> None:
    """The rows, the paper's real-vs-real row and the settings as JSON in ``--json``."""
    import torch

    payload = dict(
        rows=rows,
        paper_real_vs_real=PAPER_REAL_ROW,
        test_accuracy=evaluator.test_accuracy,
        settings=dict(
            bank_size=int(evaluator.bank.shape[0]), groups=args.groups, n_boot=args.n_boot, null_draws=args.null_draws,
            level=args.level, seed=args.seed, threads=torch.get_num_threads(), seconds=elapsed,
        ),
        figures=figures,
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.json}")


def _evaluate(args) -> None:
    """Score every file (and the held-out real row), print the table, write the figures and the JSON."""
    import torch

    from ..evaluation.image_metrics import MnistClassifier, MnistEvaluator

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    samples = _read_samples(args)
    start = time.perf_counter()
    evaluator = MnistEvaluator(args.data_dir, classifier=MnistClassifier(threads=torch.get_num_threads()))
    jobs = [(str(p), x) for p, x in samples]
    if args.real is not None:
        jobs.insert(0, (f"real (held-out t10k, n={args.real})", evaluator.real_images(args.real)))
    rows = []
    for source, images in jobs:
        row = evaluator.evaluate(
            images, groups=args.groups, n_boot=args.n_boot, null_draws=args.null_draws, level=args.level, seed=args.seed
        )
        rows.append(dict(source=source, **{k: row[k] for k in JSON_KEYS}))
    elapsed = time.perf_counter() - start
    printed = list(rows)
    if args.real is not None:
        printed.insert(1, dict(source="paper: real vs real", null_mean=None, **PAPER_REAL_ROW))
    _print_rows(printed, args.level)
    print(f"t10k accuracy {evaluator.test_accuracy:.4f}; bank {evaluator.bank.shape[0]} t10k images; {elapsed:.1f} s")
    figures = _write_figures(args, jobs, evaluator) if args.figures else []
    if args.json:
        _write_json(args, rows, evaluator, elapsed, figures)


def cli_main(args) -> int:
    problem = _usage_error(args)
    if problem is None:
        from ..backends import BackendUnavailable

        try:
            _evaluate(args)
        except (ValueError, TypeError, FileNotFoundError, ImportError, OSError, BackendUnavailable) as exc:
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if problem is None:
        return 0
    print(f"etweedie mnist-eval: error: {problem}", file=sys.stderr)
    return 2
