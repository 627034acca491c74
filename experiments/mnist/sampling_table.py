"""Table mnist_quantitative from pooled sample files (``<path>.npy``, uint8 (n, 28, 28), seeds in order).

Scores each path with :class:`etweedie.evaluation.image_metrics.MnistEvaluator` (the machinery behind
``etweedie mnist-eval``): feature energy distance to the 2,048-image t10k bank with its
seed-stratified bootstrap interval, the real-vs-real null's 95th percentile at the same n, mean
confidence, class TV, classes present (overall and per seed), nearest-train RMSE against the
held-out images' value; plus the real-vs-real row.  The paper's numbers stand beside.

    python -m experiments.mnist.sampling_table experiments/mnist/results/cpu --seeds 3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments import _cli

from .sampling import PATHS, SEEDS

#: Table mnist_quantitative of the paper: (feature ED, mean confidence, class TV).
PAPER = {
    "real": (0.015, 0.993, 0.074),
    "mnist_gaussian_isotropic": (0.574, 0.922, 0.162),
    "mnist_gaussian_nondiagonal": (0.247, 0.964, 0.111),
    "mnist_generalized_isotropic": (0.637, 0.908, 0.113),
    "mnist_generalized_nondiagonal": (0.218, 0.966, 0.085),
    "mnist_joint": (0.303, 0.960, 0.107),
}
PAPER_NEAREST_TRAIN = "0.139–0.143 (held-out real 0.147)"
LABELS = {
    "real": "Real MNIST vs real reference",
    "mnist_gaussian_isotropic": "Gaussian / isotropic",
    "mnist_gaussian_nondiagonal": "Gaussian / non-diagonal",
    "mnist_generalized_isotropic": "Generalized / isotropic",
    "mnist_generalized_nondiagonal": "Generalized / non-diagonal",
    "mnist_joint": "Joint five-parameter path",
}


def score(directory, paths: Sequence[str] = PATHS, n_seeds: int = len(SEEDS), *, n_boot: int = 1000,
          null_draws: int = 200, data_dir=None) -> Dict:
    """Rows of the table for every path whose pooled ``<path>.npy`` is in ``directory``."""
    from etweedie.evaluation import MnistEvaluator, classes_present

    directory = Path(directory)
    ev = MnistEvaluator(data_dir)
    rows: Dict[str, Dict] = {}
    n = None
    for path in paths:
        f = directory / f"{path}.npy"
        if not f.is_file():
            continue
        images = np.load(f)
        n = images.shape[0]
        row = ev.evaluate(images, groups=n_seeds, n_boot=n_boot, null_draws=null_draws)
        _, logits = ev.classifier(images)
        per_seed = np.array_split(logits.argmax(1).numpy(), n_seeds)
        row["classes_present_per_seed"] = [int(classes_present(torch_labels(s))) for s in per_seed]
        rows[path] = row
    if n is not None:
        rows["real"] = ev.evaluate(ev.real_images(n), groups=n_seeds, n_boot=n_boot, null_draws=null_draws)
    return dict(rows=rows, test_accuracy=ev.test_accuracy)


def torch_labels(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).long()


def _ci(row: Dict, key: str) -> str:
    lo_hi = row.get(f"{key}_ci")
    return f"{row[key]:.3f} [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else f"{row[key]:.3f}"


def costs(parts_dir, paths: Sequence[str], seeds: Sequence[int]) -> Dict[str, Dict]:
    """Per path, from the part logs: posterior draws per image, images per second of one process, wall s."""
    out = {}
    for path in paths:
        logs = []
        for seed in seeds:
            f = Path(parts_dir) / f"{path}_seed{seed}.json"
            if f.is_file():
                logs.append(json.loads(f.read_text()))
        if logs and all("draws_per_image" in log for log in logs):
            wall = sum(log["wall_s"] for log in logs)
            out[path] = dict(draws_per_image=logs[0]["draws_per_image"], wall_s=wall,
                             images_per_s=sum(log["images"] for log in logs) / wall)
    return out


def format_table(result: Dict) -> str:
    rows, cost = result["rows"], result.get("costs", {})
    lines = [
        "| path | n | feature ED [95% CI] (paper) | null p95 | mean confidence [CI] (paper) | class TV [CI] (paper) "
        "| classes present (per seed) | nearest-train RMSE (held-out real) | draws / image | images/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ["real", *[p for p in PATHS if p in rows]]:
        if key not in rows:
            continue
        r, paper = rows[key], PAPER[key]
        ed = f"{r['feature_ed']:.3f}" if key == "real" else _ci(r, "feature_ed")
        seeds = ", ".join(map(str, r.get("classes_present_per_seed", []))) or "—"
        null = r.get("null_p95")
        lines.append(
            f"| {LABELS[key]} | {r['n']} | {ed} ({paper[0]}) | {'—' if null is None else f'{null:.3f}'} "
            f"| {_ci(r, 'mean_confidence')} ({paper[1]}) | {_ci(r, 'class_tv')} ({paper[2]}) "
            f"| {r['classes_present']} ({seeds}) | {r['nearest_train_rmse']:.3f} ({r['heldout_nearest_train_rmse']:.3f}) "
            + (f"| {cost[key]['draws_per_image']:,} | {cost[key]['images_per_s']:.1f} | {cost[key]['wall_s']:.0f} |"
               if key in cost else "| — | — | — |")
        )
    lines.append(f"\nPaper nearest-train RMSE: {PAPER_NEAREST_TRAIN}.  Classifier t10k accuracy here: "
                 f"{result['test_accuracy']:.4f} (paper 0.989).")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = _cli.OneLineParser(description="Table mnist_quantitative from pooled <path>.npy sample files")
    p.add_argument("directory")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="seed groups per pooled file (default 3)")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--null-draws", type=int, default=200)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    def check():
        for flag, low in (("--seeds", 1), ("--n-boot", 2), ("--null-draws", 0)):
            _cli.at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
        _cli.nonempty("DIRECTORY", args.directory, "a folder of <path>.npy files")
        if not Path(args.directory).is_dir():
            raise _cli.UsageError(f"DIRECTORY {args.directory}: no such folder; expected a folder of <path>.npy files")
        _cli.nonempty("--data-dir", args.data_dir, "an MNIST folder")
        _cli.out_file("--json", args.json)

    status = _cli.report("sampling_table", check)
    if status:
        return status
    try:
        result = score(args.directory, n_seeds=args.seeds, n_boot=args.n_boot, null_draws=args.null_draws,
                       data_dir=args.data_dir)
        result["costs"] = costs(Path(args.directory) / "parts", PATHS, SEEDS[: args.seeds])
    except (OSError, ValueError, TypeError) as exc:  # unreadable or malformed sample files, a missing --data-dir
        print(f"sampling_table: error: {exc}", file=sys.stderr)
        return 2
    if not result["rows"]:
        print(f"sampling_table: error: no <path>.npy files in {args.directory}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(_cli.guarded("sampling_table", main))
