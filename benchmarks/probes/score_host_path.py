"""Where the public per-row op's time goes beyond its kernel (et_score, 64 × 256 × 784, float32).

    python benchmarks/probes/score_host_path.py [--threads 2] [--evict]

Prints (1) medians of 200 alternating calls of the public op ``etweedie.et_score(y, x, 1.5)``, of
the C++ front op ``torch.ops.etweedie.et_score`` it ends in and of the raw kernel op
``torch.ops.etweedie.et_score_fwd`` on the canonical tensors, and (2) the mean wall time of 1,000
back-to-back calls each of the front op and of the raw op (no alternation).  ``--evict`` runs an
untimed 256 MiB ``dst.copy_(src)`` before every timed call of (1): each call then starts with the
caches holding none of its code or data (the slot after the table's copy or eager reference),
where the host path costs several times its warm time.
"""

import statistics
import time

import torch

import etweedie
from etweedie.commandline import OneLineParser


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--evict", action="store_true", help="a 256 MiB copy before every timed call")
    args = p.parse_args()
    if not 1 <= args.threads <= 1024:
        p.exit(2, f"{p.prog}: error: --threads must be in [1, 1024], got {args.threads}\n")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, N, d = 64, 256, 784
    y, x = torch.randn(B, d, generator=g), torch.randn(B, N, d, generator=g)
    beta, lam, prec = torch.tensor(1.5), torch.tensor(1.0), torch.ones(())
    flat = [t.expand(B) for t in (beta, lam, prec)]
    calls = {
        "public": lambda: etweedie.et_score(y, x, 1.5),
        "raw": lambda: torch.ops.etweedie.et_score_fwd(y, x, *flat, 0),
        "front": lambda: torch.ops.etweedie.et_score(y, x, beta, lam, prec, 0, [B]),
    }
    for f in calls.values():
        f()
    src = torch.randn(64 << 20) if args.evict else None
    dst = torch.empty_like(src) if args.evict else None
    times = {"public": [], "front": [], "raw": []}
    for _ in range(100 if args.evict else 200):
        for name in times:
            if args.evict:
                dst.copy_(src)
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    pub, fr, raw = (statistics.median(times[n]) * 1e6 for n in ("public", "front", "raw"))
    print(f"alternating{' after a 256 MiB copy' if args.evict else ''}: public {pub:.0f} µs, front {fr:.0f} µs, "
          f"raw {raw:.0f} µs, public − raw {pub - raw:.0f} µs ({pub / raw:.2f}×), front − raw {fr - raw:.0f} µs")
    for name in ("front", "raw"):
        t0 = time.perf_counter()
        for _ in range(1000):
            calls[name]()
        print(f"back to back: {name} {(time.perf_counter() - t0) * 1e3:.0f} µs per call")


if __name__ == "__main__":
    main()
