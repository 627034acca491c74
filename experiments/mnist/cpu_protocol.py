"""An MNIST sampling protocol on this machine: five paths × three seeds, the table and the figures.

    python -m experiments.mnist.cpu_protocol --protocol transport --posterior mnist_full \
        --out experiments/mnist/results/transport
    python -m experiments.mnist.cpu_protocol --posterior mnist --out experiments/mnist/results/cpu

Samples every (path, seed) part of :data:`experiments.mnist.sampling.CPU` into ``--out/parts``
(resumable: finished parts are skipped), pools each path's images into ``<path>.npy`` (uint8 (n, 28, 28)), scores
Table mnist_quantitative (:mod:`experiments.mnist.sampling_table`) into ``table.md`` /
``table.json``, and draws the figures (:mod:`experiments.mnist.sampling_figures`).  Everything
lands in ``--out``; ``--protocol tiny`` is the smoke size of the test suite.  The variance-reduced
variant (antithetic posterior draws at a quarter of N) goes into its own folder, as does the
variant whose final state is the mean of K posterior draws instead of one:

    python -m experiments.mnist.cpu_protocol --posterior mnist --antithetic --n-posterior 8 \
        --out experiments/mnist/results/cpu_antithetic
    python -m experiments.mnist.cpu_protocol --posterior mnist --final-average 64 \
        --out experiments/mnist/results/cpu_final_mean
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from experiments import _cli

from . import sampling, sampling_figures, sampling_table


def parse_args(argv=None):
    p = _cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--posterior", default="mnist", help="posterior name or path, or untrained:WIDTH (default mnist)")
    p.add_argument("--protocol", choices=tuple(sampling.PROTOCOLS), default="cpu")
    p.add_argument("--out", required=True, help="output folder (parts, pooled samples, table, figures)")
    p.add_argument("--paths", nargs="+", choices=sampling.PATHS, default=None, help="a subset of the five paths")
    p.add_argument("--data-dir", default=None, help="MNIST folder (default: etweedie.data.mnist's search)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--null-draws", type=int, default=200)
    p.add_argument("--no-table", action="store_true")
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--progress", action="store_true", help="tqdm bars over levels")
    p.add_argument("--n-posterior", type=int, default=None, help="override the protocol's N (draws per score)")
    p.add_argument("--antithetic", action="store_true",
                   help="antithetic posterior draws (the variance-reduced variant, e.g. --antithetic --n-posterior 8 "
                        "against the protocol's 32 independent draws)")
    p.add_argument("--final-average", type=int, default=None,
                   help="final state = the mean of K posterior draws at the last level (default 1: one draw, the paper's)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # every flag is checked before the sampling, which takes minutes (the table's flags too)

    def check():
        _cli.threads("--threads", args.threads)
        for flag, low in (("--n-boot", 2), ("--null-draws", 0), ("--n-posterior", 1), ("--final-average", 1)):
            _cli.at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
        _cli.nonempty("--posterior", args.posterior, "a posterior name or path, or untrained:WIDTH")
        _cli.nonempty("--data-dir", args.data_dir, "an MNIST folder")
        _cli.out_dir("--out", args.out)

    status = _cli.report("cpu_protocol", check)
    if status:
        return status
    if args.threads:
        torch.set_num_threads(args.threads)
    protocol = sampling.PROTOCOLS[args.protocol]
    if args.paths:
        protocol = dataclasses.replace(protocol, paths=tuple(args.paths))
    if args.n_posterior is not None:
        protocol = dataclasses.replace(protocol, n_posterior=args.n_posterior)
    if args.antithetic:
        protocol = dataclasses.replace(protocol, antithetic=True)
    if args.final_average is not None:
        protocol = dataclasses.replace(protocol, final_average=args.final_average)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        posterior = sampling.load_posterior(args.posterior)
        fingerprint = sampling.posterior_fingerprint(posterior)
        sampling.check_folder(out, protocol, (args.posterior, fingerprint))
        center = sampling.data_mean(args.data_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(f"cpu_protocol: error: {exc}", file=sys.stderr)
        return 2
    start = time.time()
    print(f"protocol {protocol.name}: {protocol.describe()}; posterior {args.posterior}", flush=True)
    logs = sampling.run_protocol(posterior, protocol, out, center=center, progress=args.progress,
                                 posterior_name=args.posterior, posterior_sha256=fingerprint)
    sampling_s = time.time() - start
    summary = dict(protocol=dataclasses.asdict(protocol), posterior=args.posterior, sampling_s=sampling_s,
                   parts_wall_s=sum(p["wall_s"] for p in logs),  # the parts' own times (also of earlier calls)
                   threads=torch.get_num_threads(), parts=[{k: p.get(k) for k in ("path", "seed", "images", "wall_s",
                                                                                   "images_per_s", "draws_per_image")}
                                                          for p in logs])
    if not args.no_table:
        t0 = time.time()
        result = sampling_table.score(out, protocol.paths, len(protocol.seeds), n_boot=args.n_boot,
                                      null_draws=args.null_draws, data_dir=args.data_dir)
        result["costs"] = sampling_table.costs(out / sampling.PARTS_DIR, protocol.paths, protocol.seeds)
        table = sampling_table.format_table(result)
        (out / "table.md").write_text(table + "\n")
        (out / "table.json").write_text(json.dumps(result, indent=1, default=float))
        summary["scoring_s"] = time.time() - t0
        print(table)
    if not args.no_figures:
        from etweedie.data import load_mnist

        train, _ = load_mnist("train", args.data_dir)
        made = sampling_figures.all_figures(out, out / sampling.PARTS_DIR, protocol.paths, protocol.seeds, train)
        print("figures: " + ", ".join(str(m) for m in made))
    summary["total_s"] = time.time() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"sampling {sampling_s:.0f} s, total {summary['total_s']:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(_cli.guarded("cpu_protocol", main))
