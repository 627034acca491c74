"""Run every benchmark workload and print one markdown table plus the foundation targets.

    python -m benchmarks.table [--quick] [--json out.json] [--only et_score,is_score]
                               [--threads 2] [--no-compile] [--cpu-time]

``--quick`` uses small shapes (a smoke run: ~35 s for the et_score, langevin_step and is_score
workloads, most of it torch.compile); targets are still evaluated but do not apply to those
shapes.  ``--only`` keeps the workloads whose id starts with one of the comma-separated names
(the ids are the case factories' names, e.g. et_score_iso_784, langevin_step_784,
is_score_160k).  ``--cpu-time`` times process CPU time instead of wall time: with
``--threads 1`` the ratios do not move when a shared machine deschedules the thread (wall time
does: a parallel region waits for its slowest thread).  Progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from etweedie.commandline import OneLineParser

from . import (
    bench_energy_distance,
    bench_energy_score,
    bench_et_score,
    bench_is_score,
    bench_langevin_step,
    bench_student_t_score,
)
from .common import (
    MAX_THREADS,
    THREADS_ENV,
    Result,
    Target,
    check_flags,
    check_threads,
    copy_bandwidth,
    env_threads,
    environment,
    flag_error,
    format_bytes,
    format_table,
    measure,
    rows,
    set_threads,
    speedup_target,
)

CASES = (
    *bench_et_score.CASES,
    *bench_langevin_step.CASES,
    *bench_is_score.CASES,
    *bench_energy_score.CASES,
    *bench_energy_distance.CASES,
    *bench_student_t_score.CASES,
)
COPY_MIB = 256


def targets(res: Dict[str, Result], copy_gbps: float) -> List[Target]:
    """The foundation issue's targets, from the results of this run (missing ones skipped)."""
    out = []
    if "et_score_iso_784" in res:
        r = res["et_score_iso_784"]
        label = r.case.workload
        out.append(speedup_target(res, r.case.id, label, "compile", 4))
        out.append(speedup_target(res, r.case.id, label, "reference", 20))
        # Floor convention: the bytes of x, read once, at the measured copy bandwidth (which
        # counts read + write): the time a pure stream over x would take.  The copy timed in
        # the case's own interleaved rounds is preferred: same load as the kernel.
        if "copy" in r.extras:
            copy_gbps = r.case.meta["copy_bytes"] / (r.extras["copy"].median_ms * 1e-3) / 1e9
        floor_ms = r.case.bytes_x / (copy_gbps * 1e9) * 1e3
        k = r.timings["cpu"].median_ms / floor_ms
        if "x.sum()" in r.extras:
            xs = r.extras["x.sum()"].median_ms
            k_sum = f"; torch x.sum() {xs:.2f} ms = {xs / floor_ms:.2f}× the floor"
        else:
            k_sum = ""
        out.append(
            Target(label, "within 1.5× of the memory-bandwidth floor",
                   f"{k:.2f}× the floor ({r.timings['cpu'].median_ms:.2f} ms vs {floor_ms:.2f} ms = x at {copy_gbps:.1f} GB/s{k_sum})",
                   k <= 1.5)
        )
        # O(B·d): at most a few (B, d) float32 buffers (the kernel returns s and m), nothing in N.
        B, N, d = (r.case.meta[k] for k in ("B", "N", "d"))
        peak, row_bytes = r.peaks["cpu"], B * d * 4
        if peak is None:
            out.append(Target(label, "extra memory O(B·d)", "n/a", None))
        else:
            out.append(
                Target(label, "extra memory O(B·d) (criterion: ≤ 4·B·d floats)",
                       f"{format_bytes(peak)} = {peak / row_bytes:.2f}·B·d floats (x is {N}·B·d)", peak <= 4 * row_bytes)
            )
    if "et_score_block_784" in res:
        r = res["et_score_block_784"]
        out.append(speedup_target(res, r.case.id, r.case.workload, "compile", 20))
    for id in ("et_score_iso_784", "et_score_block_784"):
        # what the public op adds to its kernel at this size: validation, canonical form, checks
        if id in res and "raw op" in res[id].extras:
            r = res[id]
            pub, raw = r.timings["cpu"].median_ms, r.extras["raw op"].median_ms
            out.append(Target(r.case.workload, "public op ≤ 1.1× the raw kernel op (wrapper and range checks)",
                              f"{pub / raw:.2f}× ({pub:.2f} ms vs raw `et_score_fwd` {raw:.2f} ms)", pub <= 1.1 * raw))
    if "et_score_iso_2" in res:
        r = res["et_score_iso_2"]
        out.append(speedup_target(res, r.case.id, r.case.workload, "compile", 5))
    if "et_score_bwd_784" in res:
        r = res["et_score_bwd_784"]
        fb, f = r.timings["cpu"].median_ms, r.extras["fwd"].median_ms
        k = (fb - f) / f
        out.append(
            Target(r.case.workload, "backward ≤ 3× forward",
                   f"fwd {f:.2f} ms, fwd+bwd {fb:.2f} ms → bwd {fb - f:.2f} ms = {k:.2f}× fwd", k <= 3)
        )
    if "langevin_step_784" in res:
        r = res["langevin_step_784"]
        lv, s = r.timings["cpu"].median_ms, r.extras["et_score"].median_ms
        out.append(
            Target(r.case.workload, "≤ 1.2× the time of et_score alone",
                   f"{lv:.2f} ms vs et_score {s:.2f} ms = {lv / s:.2f}×", lv / s <= 1.2)
        )
    if "is_score_160k" in res:
        r = res["is_score_160k"]
        Q, d = r.case.meta["Q"], r.case.meta["d"]
        out.append(speedup_target(res, r.case.id, r.case.workload, "reference", 5))
        peak, eager_peak = r.peaks["cpu"], r.peaks["reference"]
        if peak is not None:
            # Bounded: the outputs and O(1) per query, nothing that grows with the bank M.
            out.append(
                Target(r.case.workload, "bounded memory (criterion: ≤ 8·Q·d floats, no term in M)",
                       f"{format_bytes(peak)} (eager reference, chunk {bench_is_score.CHUNK}: {format_bytes(eager_peak)})",
                       peak <= 8 * Q * d * 4)
            )
    if "student_t_score_bwd_784" in res:
        r = res["student_t_score_bwd_784"]
        fb, f = r.timings["cpu"].median_ms, r.extras["fwd"].median_ms
        out.append(Target(r.case.workload, "reported (no target): backward vs forward",
                          f"fwd {f:.2f} ms, fwd+bwd {fb:.2f} ms → bwd {fb - f:.2f} ms = {(fb - f) / f:.2f}× fwd", None))
    out += low_precision_targets(res, copy_gbps)
    out += bench_energy_score.targets(res) + bench_energy_distance.targets(res)
    return out


LOW_PRECISION_CASES = ("et_score_iso_784_bf16", "et_score_block_784_bf16", "et_score_iso_784_fp16",
                       "et_score_block_784_fp16", "et_score_bwd_784_bf16", "et_score_bwd_784_fp16",
                       "langevin_step_784_bf16", "langevin_step_784_fp16")


def low_precision_targets(res: Dict[str, Result], copy_gbps: float) -> List[Target]:
    """16-bit draws: their bytes are half the float32 draws', so the time should follow —
    against the float32 kernel on the same draws in the same rounds, and against the byte floor."""
    out = []
    for id in LOW_PRECISION_CASES:
        if id not in res or "fp32 draws" not in res[id].extras:
            continue
        r = res[id]
        lo, hi = r.timings["cpu"].median_ms, r.extras["fp32 draws"].median_ms
        out.append(Target(r.case.workload, "time follows the halved bytes: ≤ 0.6× the float32-draws time",
                          f"{lo:.2f} ms vs {hi:.2f} ms with float32 draws = {lo / hi:.2f}×", lo / hi <= 0.6))
        if id.startswith("et_score_iso_784"):
            floor_ms = r.case.bytes_x / (copy_gbps * 1e9) * 1e3
            k = lo / floor_ms
            out.append(Target(r.case.workload, "within 1.5× of the memory-bandwidth floor (16-bit bytes)",
                              f"{k:.2f}× the floor ({lo:.2f} ms vs {floor_ms:.2f} ms = x at {copy_gbps:.1f} GB/s)",
                              k <= 1.5))
    return out


def format_targets(ts: Sequence[Target]) -> str:
    mark = {True: "met", False: "**missed**", None: "n/a"}
    lines = ["| workload | target | measured | |", "|---|---|---|---|"]
    lines += [f"| {t.workload} | {t.requirement} | {t.measured} | {mark[t.met]} |" for t in ts]
    return "\n".join(lines)


def select(only: Optional[str]):
    """The case factories (named by their ids) whose id starts with one of ``only``'s names (a
    ValueError when none matches)."""
    if not only:
        return list(CASES)
    names = [s.strip() for s in only.split(",") if s.strip()]
    chosen = [f for f in CASES if any(f.__name__.startswith(n) for n in names)]
    if not chosen:
        raise ValueError(f"--only {only!r} matches no workload; ids: {', '.join(f.__name__ for f in CASES)}")
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = OneLineParser(prog="python -m benchmarks.table", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (smoke run, < 60 s)")
    p.add_argument("--json", metavar="PATH", help="also write rows, targets and environment as JSON")
    p.add_argument("--only", metavar="IDS", help="comma-separated workload id prefixes")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch threads, 1 to {MAX_THREADS} (default ${THREADS_ENV}, else 2)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--cpu-time", action="store_true",
                   help="time process CPU time (time.process_time) instead of wall time; use with --threads 1")
    args = p.parse_args(argv)
    try:  # flag values checked before minutes of timing: one line and exit status 2
        check_flags([check_threads(args.threads)], args.json)
        if args.threads is None:
            args.threads = env_threads()
        chosen = select(args.only)
    except ValueError as exc:
        return flag_error(p.prog, exc)
    set_threads(args.threads)
    env = environment()
    copy_mib = 64 if args.quick else COPY_MIB
    copy_gbps = copy_bandwidth(copy_mib)

    results: Dict[str, Result] = {}
    bar = tqdm(chosen, file=sys.stderr, desc="benchmarks", unit="workload")
    for factory in bar:
        case = factory(args.quick)
        r = measure(
            case,
            compile=not args.no_compile,
            budget_s=0.3 if args.quick else 2.0,
            stage=lambda s, c=case: bar.set_postfix_str(f"{c.id}: {s}"),
            clock=time.process_time if args.cpu_time else time.perf_counter,
        )
        results[case.id] = r
    bar.close()

    all_rows = [row for r in results.values() for row in rows(r)]
    ts = targets(results, copy_gbps)
    load_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    cmd = "python -m benchmarks.table" + ("" if argv is None and len(sys.argv) <= 1 else " " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"# etweedie benchmarks{' (quick shapes)' if args.quick else ''}\n")
    print(f"- command: `{cmd}`")
    print(f"- CPU: {env['cpu']}, {env['threads']} threads; torch {env['torch']}; etweedie {env['etweedie']}; {env['date']}")
    print(f"- extension: {env['extension']}")
    print(f"- copy bandwidth: {copy_gbps:.1f} GB/s (`dst.copy_(src)`, {copy_mib} MiB float32, read + write counted)")
    print(f"- load average (1, 5, 15 min) at start {_load(env['loadavg'])}, at end {_load(load_end)}")
    print(f"- clock: {'process CPU time (all threads summed)' if args.cpu_time else 'wall time'}")
    print("- float32; speed-up = reference ms / row ms (higher is faster); GB/s = bytes of x read once / time;")
    print("  peak extra mem = most bytes held at once by torch's CPU allocator during one call, outputs included;")
    print("  backends timed in interleaved rounds; compile time includes the first run and may hit inductor's disk cache\n")
    print(format_table(all_rows))
    print("\n## Targets" + (" (quick shapes: the targets are stated for the full shapes)" if args.quick else "") + "\n")
    print(format_targets(ts))

    if args.json:
        payload = {
            "environment": {**env, "loadavg_end": load_end, "quick": args.quick, "clock": "process" if args.cpu_time else "wall"},
            "copy_gbps": copy_gbps,
            "rows": [dataclasses.asdict(r) for r in all_rows],
            "extras": {k: {n: dataclasses.asdict(t) for n, t in r.extras.items()} for k, r in results.items()},
            "targets": [dataclasses.asdict(t) for t in ts],
        }
        try:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
        except OSError as exc:  # checked at the start; the file system may have changed since
            return flag_error(p.prog, ValueError(f"--json {args.json!r}: could not write the results ({exc})"))
    return 0


def _load(la) -> str:
    return "n/a" if la is None else ", ".join(f"{x:.2f}" for x in la)


if __name__ == "__main__":
    sys.exit(main())
