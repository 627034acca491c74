"""Shared benchmark machinery: timing, copy bandwidth, peak memory, correctness, rows.

A workload is a :class:`Case`: the package op on the compiled CPU backend, the pure-torch
reference computing the same thing on the canonical tensors, and a check of the op against
the float64 reference.  :func:`measure` runs one case on three backends in one process —

    cpu        the package op (``backend="cpu"``, the fused C++ kernel)
    reference  the reference function, eager
    compile    ``torch.compile(reference function)``, warmed up (compile time reported apart)

— and every :class:`Row` carries median ms with p20/p80, GB/s of x, peak extra memory, the
speed-up over the eager and the compiled reference, the CPU model and the package version.

Peak extra memory is measured with ``torch.profiler`` (``profile_memory=True``): every
allocation and free through torch's CPU allocator during one call is replayed in order and
the maximum of the running sum is reported — the most bytes the call held at once on top of
what was live before it, outputs included.  It does not see memory that bypasses torch's
allocator (thread stacks, a kernel's ``std::vector`` scratch); for the fused kernels that is
O(d) per thread.  (``tracemalloc`` does not see torch tensors and ``ru_maxrss`` is a
process-wide high-water mark, so neither measures one call.)
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

import etweedie
from etweedie._checks import MAX_THREADS, check_output_file

BACKENDS = ("cpu", "reference", "compile")
THREADS_ENV = "ETWEEDIE_BENCH_THREADS"


def env_threads(default: int = 2) -> int:
    """The thread count :data:`THREADS_ENV` asks for (``default`` where it is unset or empty);
    ValueError naming the variable where it is not an integer in [1, MAX_THREADS]."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return default
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{THREADS_ENV} must be an integer in [1, {MAX_THREADS}], got {text!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{THREADS_ENV} must be an integer in [1, {MAX_THREADS}], got {n}")
    return n


def set_threads(n: Optional[int] = None) -> int:
    """Intra-op threads for torch and the kernels (at::parallel_for follows torch's setting);
    None reads :func:`env_threads`; ValueError outside [1, MAX_THREADS] (torch itself can crash
    on a huge count)."""
    if n is None:
        n = env_threads()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"threads must be an int in [1, {MAX_THREADS}], got {n!r}")
    torch.set_num_threads(n)
    return torch.get_num_threads()




def check_flags(bounds: Sequence[tuple] = (), json_path: Optional[str] = None) -> None:
    """ValueError naming the first flag a benchmark script cannot use, checked before minutes of
    timing (the script prints it as one line and exits with status 2): ``bounds`` holds
    ``(flag, value, least)`` or ``(flag, value, least, most)`` (a None value was not given, a
    None bound is no bound); ``json_path`` (None: not given) must be a file this process can
    write (:func:`etweedie._checks.check_output_file`: tried by creating it, not by ``os.access``,
    which answers True for root whatever the file system says)."""
    for flag, value, least, *most in bounds:
        most = most[0] if most else None
        if value is None:
            continue
        if least is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
        if most is not None and value > most:
            raise ValueError(f"{flag} must be <= {most}, got {value}")
    if json_path is not None:
        check_output_file(json_path, "--json")


def check_threads(value: Optional[int], flag: str = "--threads", least: int = 1) -> tuple:
    """The ``check_flags`` bound of a threads flag: ``least`` (1, or 0 where 0 means torch's
    default) to :data:`MAX_THREADS`."""
    return (flag, value, least, MAX_THREADS)


def flag_error(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as the one line ``PROG: error: ...`` on stderr; the exit status 2."""
    print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int

    def __str__(self) -> str:
        return f"{_num(self.median_ms)} ({_num(self.p20_ms)}–{_num(self.p80_ms)})"


def time_calls(
    fns: Dict[str, Callable[[], object]],
    *,
    warmup: int = 2,
    min_repeats: int = 5,
    max_repeats: int = 200,
    budget_s: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, Timing]:
    """Median and p20/p80 time in ms of each ``fns[name]()``: wall time (``time.perf_counter``)
    by default; ``clock=time.process_time`` counts the CPU time of all the process's threads
    instead, which a descheduled thread does not inflate (with one thread it is the call's own
    CPU time, the load-independent comparison on a shared machine).

    After ``warmup`` untimed calls, the first timed call of each function sizes its repeat
    count so that it takes about ``budget_s`` (between ``min_repeats`` and ``max_repeats``
    calls): a 5 ms kernel gets hundreds of samples, a 20 s oracle the minimum.  The functions
    are timed in interleaved rounds, so load from other processes that comes and goes hits
    the kernel and its baselines alike and their ratios stay meaningful.  Each round runs the
    functions in a fresh random order (seeded: the same orders every run), so that none of them
    always runs right after the same neighbour: a call that follows a pass which evicts the
    caches (the 256 MiB copy, the eager reference's temporaries) or that leaves the cloud warm
    (another read of it) is slower or faster for it, and a fixed order gave that bias to one
    function in every round.
    """
    order = random.Random(0)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {}
    repeats: Dict[str, int] = {}
    for name, fn in fns.items():
        t0 = clock()
        fn()
        times[name] = [clock() - t0]
        repeats[name] = int(min(max_repeats, max(min_repeats, budget_s / max(times[name][0], 1e-9))))
    names = list(fns)
    for r in range(1, max(repeats.values(), default=0)):
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            if r < repeats[name]:
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
    out = {}
    for name, ts in times.items():
        p20, p50, p80 = np.percentile(np.array(ts) * 1e3, [20, 50, 80])
        out[name] = Timing(float(p50), float(p20), float(p80), len(ts))
    return out


def time_call(fn: Callable[[], object], **kwargs) -> Timing:
    """:func:`time_calls` for one function."""
    return time_calls({"fn": fn}, **kwargs)["fn"]


def copy_thunk(mbytes: int = 256) -> tuple:
    """(thunk, bytes moved per call): ``dst.copy_(src)`` on float32 buffers of ``mbytes`` MiB.

    Bytes moved count read + write (2 × buffer).  256 MiB is far beyond the last-level cache,
    so this measures the DRAM bandwidth the threads in use can drive.
    """
    n = mbytes * 2**20 // 4
    src = torch.ones(n)  # ones/zeros, not empty: touch every page before timing
    dst = torch.zeros(n)
    return (lambda: dst.copy_(src)), 2 * n * 4


def copy_bandwidth(mbytes: int = 256) -> float:
    """Copy bandwidth in GB/s (read + write counted) of :func:`copy_thunk`."""
    thunk, moved = copy_thunk(mbytes)
    t = time_call(thunk, warmup=2, min_repeats=10, max_repeats=30)
    return moved / (t.median_ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- memory

def peak_extra_bytes(fn: Callable[[], object]) -> Optional[int]:
    """Peak bytes held at once by torch's CPU allocator during ``fn()`` beyond what was live
    before it (outputs included); None when the profiler gives no allocation events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except Exception:  # the event tree is the profiler's own (private) API
        return None
    allocs, stack = [], list(roots)
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu":
            allocs.append((ev.start_time_ns, ev.extra_fields.alloc_size))
    # Frees of blocks allocated before profiling are counted too; they can only lower the
    # running sum after the fact, so the peak is still "bytes above the starting level".
    live = peak = 0
    for _, size in sorted(allocs, key=lambda a: a[0]):
        live += size
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------- correctness

class IncorrectResult(AssertionError):
    """The kernel disagrees with the float64 reference: its timings would mean nothing."""


def check_close(name: str, out, ref32, ref64, *, atol_scale: float = 1e-5) -> None:
    """Accept ``out`` if ``|out − ref64| ≤ 2·|ref32 − ref64| + atol`` elementwise.

    The tests' criterion (DESIGN §8): the kernel may err at most twice as much as the
    float32 reference does, plus ``atol = atol_scale·max|ref64|``.
    """
    if isinstance(out, (tuple, list)):
        for i, (o, r32, r64) in enumerate(zip(out, ref32, ref64)):
            check_close(f"{name}[{i}]", o, r32, r64, atol_scale=atol_scale)
        return
    # A 16-bit output (∂L/∂x of 16-bit draws) and its float32 reference are both rounded to it
    # at the end: allow the 3/2 ulp those two roundings can add (as tests/conftest.py does).
    low = out.dtype if out.dtype in (torch.bfloat16, torch.float16) else None
    out, ref32, ref64 = (t.detach().to(torch.float64) for t in (out, ref32, ref64))
    if out.shape != ref64.shape:
        raise IncorrectResult(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    atol = max(atol_scale * float(ref64.abs().max()) if ref64.numel() else 0.0, 1e-30)
    err = (out - ref64).abs()
    bound = 2 * (ref32 - ref64).abs() + atol
    if low is not None:
        bound = bound + 1.5 * torch.finfo(low).eps * ref64.abs()
    excess = err - bound
    if not torch.isfinite(out).all() or float(excess.max()) > 0:
        raise IncorrectResult(
            f"{name}: kernel off the float64 reference: max |out-ref64| = {float(err.max()):.3e}, "
            f"exceeds 2|ref32-ref64|+atol by {float(excess.max()):.3e} (atol {atol:.2e})"
        )


# ----------------------------------------------------------------------------- environment

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def extension_build() -> str:
    """mtime and hash prefix of the loaded etweedie._C: the kernels change between builds."""
    import hashlib
    import importlib

    try:
        path = importlib.import_module("etweedie._C").__file__
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        mtime = datetime.datetime.fromtimestamp(os.path.getmtime(path)).astimezone()
        return f"{os.path.basename(path)} built {mtime.isoformat(timespec='seconds')}, sha256 {digest}"
    except Exception as exc:
        return f"unavailable ({exc.__class__.__name__})"


def environment() -> Dict[str, object]:
    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "etweedie": etweedie.__version__,
        "extension": extension_build(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        # Other processes on the same cores inflate times; the load average says if there were.
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# ----------------------------------------------------------------------------- cases

@dataclass
class Case:
    """One workload, defined by a bench_<op>.py module.

    ``baseline(fn)`` returns the thunk that runs the workload with the reference function
    ``fn`` — the eager ``reference_fn`` itself or ``torch.compile(reference_fn)`` — so both
    baselines do exactly the same calls (for the backward workload: forward and
    ``torch.autograd.grad``).
    """

    id: str  # the pytest test name and the key in table.py's targets
    workload: str
    kernel: Callable[[], object]
    reference_fn: Callable
    baseline: Callable[[Callable], Callable[[], object]]
    check: Callable[[], None]
    bytes_x: int  # bytes of the streamed input (x, or the bank) read once
    meta: Dict[str, int] = field(default_factory=dict)  # shape (B, N, d, ...) for the targets
    extras: Dict[str, Callable[[], object]] = field(default_factory=dict)  # timed in the same run
    compile_skip: Optional[str] = None  # why the torch.compile baseline is not run
    gbps: bool = True  # False where GB/s of x is meaningless (compute-bound is_score)
    work: Optional[tuple] = None  # (unit, count per call), e.g. ("pairs", Q·M): note gives G<unit>/s
    timing: Dict[str, object] = field(default_factory=dict)  # time_call overrides (slow cases)
    rounds: int = 20  # pytest-benchmark rounds


@dataclass
class Result:
    case: Case
    timings: Dict[str, Timing]  # backend -> timing
    peaks: Dict[str, Optional[int]]  # backend -> peak extra bytes
    extras: Dict[str, Timing]
    compile_s: Optional[float]


def compiled_thunk(case: Case) -> tuple:
    """(thunk, compile seconds): torch.compile of the reference, warmed up.

    ``dynamo.reset`` and ``dynamic=False`` give every workload its own static-shape graph, as
    a user compiling for one shape would get (otherwise the second shape seen by the same
    function recompiles with symbolic shapes).  Compile seconds include that first run.
    """
    torch._dynamo.reset()
    thunk = case.baseline(torch.compile(case.reference_fn, dynamic=False))
    t0 = time.perf_counter()
    thunk()
    return thunk, time.perf_counter() - t0


def measure(
    case: Case,
    *,
    compile: bool = True,
    budget_s: float = 2.0,
    stage: Callable[[str], None] = lambda s: None,
    clock: Callable[[], float] = time.perf_counter,
) -> Result:
    """Check the kernel, then time the three backends and the extras in this process
    (``clock``: see :func:`time_calls`)."""
    timing = {"budget_s": budget_s, "clock": clock, **case.timing}
    stage("check")
    case.check()
    thunks: Dict[str, Callable[[], object]] = {"cpu": case.kernel, "reference": case.baseline(case.reference_fn)}
    compile_s = None
    if compile and case.compile_skip is None:
        stage("compile")
        thunks["compile"], compile_s = compiled_thunk(case)
    peaks = {}
    for name, thunk in thunks.items():
        stage(f"{name} memory")
        peaks[name] = peak_extra_bytes(thunk)  # also a warm-up call
    stage("timing " + ", ".join([*thunks, *case.extras]))
    timed = time_calls({**thunks, **case.extras}, **timing)
    timings = {name: timed[name] for name in thunks}
    extras = {name: timed[name] for name in case.extras}
    return Result(case, timings, peaks, extras, compile_s)


# ----------------------------------------------------------------------------- targets

@dataclass
class Target:
    workload: str
    requirement: str
    measured: str
    met: Optional[bool]  # None: not measured in this run


def _ratio(r: Result, num: str, den: str) -> Optional[float]:
    t = r.timings
    return t[num].median_ms / t[den].median_ms if num in t and den in t else None


def speedup_target(res: Dict[str, Result], id: str, label: str, base: str, need: float) -> Target:
    what = "torch.compile(reference)" if base == "compile" else "eager reference"
    x = _ratio(res[id], base, "cpu")
    if x is None:
        return Target(label, f"≥{need:g}× faster than {what}", "not measured", None)
    return Target(label, f"≥{need:g}× faster than {what}", f"{x:.2f}×", x >= need)


# ----------------------------------------------------------------------------- rows

@dataclass
class Row:
    workload: str
    backend: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    gbps: Optional[float]
    peak_bytes: Optional[int]
    vs_eager: Optional[float]  # eager reference ms / this row's ms (higher = faster)
    vs_compile: Optional[float]  # torch.compile(reference) ms / this row's ms
    device: str
    version: str
    note: str = ""


def rows(result: Result) -> List[Row]:
    case, t = result.case, result.timings
    eager = t["reference"].median_ms
    comp = t["compile"].median_ms if "compile" in t else None
    out = []
    for name in BACKENDS:
        if name not in t:
            continue
        ms = t[name].median_ms
        notes = []
        if case.work is not None:
            unit, count = case.work
            notes.append(f"{count / (ms * 1e-3) / 1e9:.3g} G{unit}/s")
        if name == "compile":
            notes.append(f"compile {result.compile_s:.1f} s")
        note = "; ".join(notes)
        out.append(
            Row(
                workload=case.workload,
                backend=name,
                median_ms=ms,
                p20_ms=t[name].p20_ms,
                p80_ms=t[name].p80_ms,
                gbps=case.bytes_x / (ms * 1e-3) / 1e9 if case.gbps else None,
                peak_bytes=result.peaks.get(name),
                vs_eager=eager / ms,
                vs_compile=comp / ms if comp is not None else None,
                device=cpu_name(),
                version=etweedie.__version__,
                note=note,
            )
        )
    if "compile" not in t and case.compile_skip:
        out[-1].note = "; ".join(filter(None, [out[-1].note, f"torch.compile skipped: {case.compile_skip}"]))
    return out


HEADER = (
    "| workload | backend | median ms (p20–p80) | GB/s of x | peak extra mem "
    "| speed-up vs eager ref | speed-up vs compiled ref | device | etweedie | note |"
)


def format_row(r: Row) -> str:
    cells = [
        r.workload,
        r.backend,
        f"{_num(r.median_ms)} ({_num(r.p20_ms)}–{_num(r.p80_ms)})",
        "—" if r.gbps is None else f"{r.gbps:.1f}",
        format_bytes(r.peak_bytes),
        "—" if r.vs_eager is None else f"{r.vs_eager:.2f}×",
        "—" if r.vs_compile is None else f"{r.vs_compile:.2f}×",
        r.device,
        r.version,
        r.note,
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(all_rows: Sequence[Row]) -> str:
    sep = "|" + "|".join("---" for _ in range(HEADER.count("|") - 1)) + "|"
    return "\n".join([HEADER, sep, *(format_row(r) for r in all_rows)])


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _num(x: float) -> str:
    """Three significant digits without scientific notation for the ms range we see."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


# ----------------------------------------------------------------------------- pytest-benchmark

def run_benchmark(benchmark, case: Case, backend: str) -> None:
    """Body of every pytest-benchmark test: check, then time ``backend`` on ``case``."""
    import pytest

    case.check()
    if backend == "cpu":
        thunk = case.kernel
    elif backend == "reference":
        thunk = case.baseline(case.reference_fn)
    elif case.compile_skip is not None:
        pytest.skip(f"torch.compile baseline skipped: {case.compile_skip}")
    else:
        thunk, compile_s = compiled_thunk(case)
        benchmark.extra_info["compile_s"] = compile_s
    benchmark.group = case.workload
    benchmark.extra_info.update(
        device=cpu_name(),
        etweedie=etweedie.__version__,
        threads=torch.get_num_threads(),
        bytes_x=case.bytes_x,
        peak_extra_bytes=peak_extra_bytes(thunk),
    )
    warmup = int(case.timing.get("warmup", 2))
    benchmark.pedantic(thunk, rounds=case.rounds, warmup_rounds=warmup, iterations=1)
