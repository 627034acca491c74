"""One command for a machine with an NVIDIA GPU and a CUDA build of torch (``make gpu-check``).

Steps (each logged in full to ``<out>/gpu_check.log``; results in ``<out>/results.json``):

1. preflight — a CUDA torch that sees a GPU, and nvcc / CUDA_HOME; stops with a clear message
   otherwise (``--preflight`` runs only this step, before anything is built);
2. build — ``pip install --no-build-isolation -e .``, which compiles csrc/cuda (setup.py builds
   CUDA when CUDA_HOME exists and torch.version.cuda is set), then checks that the "cuda" and
   "triton" backends report available;
3. check-cuda — scripts/check_cuda.sh (plain-nvcc compile of every .cu, ptxas report);
4. tests — the whole suite; tests/conftest.py adds CUDA tensors and the cuda and triton
   backends when a GPU is present;
5. GPU benchmarks — each workload on CUDA tensors with the reference, cuda and triton
   backends: correctness against the float64 reference first, then CUDA-event timings
   (median, p20, p80 over repeats), peak memory; one table printed at the end;
6. CPU table — ``python -m benchmarks.table --json`` (the package's benchmark table, CPU).

``results.json`` is rewritten after every step and every table row, so a run cut short keeps what
it measured; its "env" names the card, the driver, torch, CUDA and Triton.  A row past
``--deadline`` is not started; a workload whose check fails, or a table that stops on an
exception, leaves the rows before it.  ``--dry-run`` runs the table on the CPU at tiny sizes
(the reference and cpu backends; the other rows say they were not run), so that a CPU machine
exercises the code a lease will run.

    python scripts/gpu_check.py [--out gpu_check] [--quick] [--skip-tests] [--skip-build] [--dry-run]
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T_START = time.time()


class Log:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.f = open(path, "w")

    def __call__(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.f.write(msg + "\n")
        self.f.flush()

    def run(self, title: str, cmd: List[str], env=None, timeout: int = 7200) -> subprocess.CompletedProcess:
        self(f"\n=== {title}: {' '.join(cmd)}")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # reported like a failed step, not a traceback
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            proc = subprocess.CompletedProcess(cmd, 124, text(exc.stdout), text(exc.stderr) + f"\ntimed out after {timeout} s")
        self.f.write(proc.stdout + proc.stderr)
        self.f.flush()
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        self(f"--- {title}: exit {proc.returncode} in {time.time() - t0:.0f} s; " + " | ".join(tail))
        return proc


def preflight(need_toolkit: bool = True) -> Optional[str]:
    """None when this machine can run the GPU check, else the reason it cannot (``need_toolkit``:
    nvcc is needed too, to build; the table and tests of an extension built already need none)."""
    try:
        import torch
    except ImportError:
        return None  # `make gpu-check` installs torch next; the full run checks again
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None): install a CUDA "
                "build of torch (e.g. `pip install torch --index-url https://download.pytorch.org/whl/cu128`)")
    if not torch.cuda.is_available():
        return f"no usable GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    from torch.utils.cpp_extension import CUDA_HOME

    if need_toolkit and CUDA_HOME is None and shutil.which("nvcc") is None:
        return "no CUDA toolkit: set CUDA_HOME (or put nvcc on PATH) so that setup.py builds csrc/cuda"
    return None


def env_facts(device: str = "cuda") -> Dict[str, object]:
    """Python, torch, CUDA, Triton, nvcc and the card (name, memory, driver): what a table's numbers
    belong to.  Never raises; a fact that cannot be read says why."""
    facts: Dict[str, object] = {"python": sys.version.split()[0], "executable": sys.executable,
                                "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        if device == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            facts.update(device=props.name, capability=f"{props.major}.{props.minor}",
                         multiprocessors=props.multi_processor_count, memory_mib=props.total_memory >> 20)
        else:
            facts["device"] = "CPU" + (" (dry run)" if device == "cpu" else ": torch sees no CUDA device")
    except Exception as exc:
        facts["torch"] = f"not importable: {type(exc).__name__}: {exc}"[:300]
    try:
        from importlib.metadata import version

        facts["triton"] = version("triton")
    except Exception as exc:
        facts["triton"] = f"not installed ({type(exc).__name__})"
    for name, cmd in (("driver", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
                      ("nvcc", [os.environ.get("NVCC", "nvcc"), "--version"])):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            lines = (out.stdout or out.stderr).strip().splitlines()
            facts[name] = lines[-1] if lines else f"exit {out.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            facts[name] = f"not read: {type(exc).__name__}"
    return facts


# ----------------------------------------------------------------------------- benchmarks

def _workloads(quick: bool, tiny: bool = False):
    """(id, op, B, N, d, metric factory, backward?, draws dtype) — the H100 target shapes (``--quick``:
    smaller; ``tiny``: at most 4 queries and 64 draws, the CPU dry run).  The draws dtype (None: the
    query's float32) is bfloat16/float16 for the 16-bit-draw rows, each the float32 row of the same
    id without its suffix read in half the bytes."""
    import torch

    import etweedie

    if tiny:
        return [(w, op, min(B, 4), min(N, 64), d, m, bwd, dt)
                for w, op, B, N, d, m, bwd, dt in _workloads(quick=True)]
    s = 4 if quick else 1
    blockS = torch.tensor([[0.5, 0.3], [0.3, 0.5]])
    block = lambda dev: etweedie.Metric.block(blockS.to(dev))  # noqa: E731
    iso = lambda dev: etweedie.Metric.isotropic(0.5)  # noqa: E731
    bf16, fp16 = torch.bfloat16, torch.float16
    return [
        ("et_score_block_784", "et_score", 256 // s, 256, 784, block, False, None),
        ("et_score_iso_784", "et_score", 256 // s, 256, 784, iso, False, None),
        ("et_score_iso_2", "et_score", 16384 // s, 64, 2, lambda dev: None, False, None),
        ("et_score_bwd_block_784", "et_score", 256 // s, 256, 784, block, True, None),
        ("langevin_step_block_784", "langevin_step", 256 // s, 256, 784, block, False, None),
        # energy_score fwd+bwd (training shape of the paper's MNIST model): target ≥ 5× eager
        ("energy_score_bwd_block_784", "energy_score", 256 // s, 32, 784, block, True, None),
        # 16-bit posterior draws (float32 query and sums): the bytes halve, the time should follow
        ("et_score_iso_784_bf16", "et_score", 256 // s, 256, 784, iso, False, bf16),
        ("et_score_block_784_bf16", "et_score", 256 // s, 256, 784, block, False, bf16),
        ("et_score_iso_784_fp16", "et_score", 256 // s, 256, 784, iso, False, fp16),
        ("langevin_step_block_784_bf16", "langevin_step", 256 // s, 256, 784, block, False, bf16),
        # the fused Student-t score (c > d/2), forward and fwd+bwd
        ("student_t_score_block_784", "student_t_score", 256 // s, 256, 784, block, False, None),
        ("student_t_score_bwd_block_784", "student_t_score", 256 // s, 256, 784, block, True, None),
        ("is_score_65k_x_160k", "is_score", 65536 // (4 * s), 160_000, 2, block, False, None),
        # energy_distance n = m = 65,536 in 2-d: target ≥ 10× a chunked eager reference, O(n·d) memory
        ("energy_distance_65k_2", "energy_distance", 1, 65536 // s, 2, lambda dev: None, False, None),
    ]


# backends timed per op; "compile" is torch.compile of the eager reference; "<b>:nosplit" is
# backend b with the split-draw forward turned off (ETWEEDIE_CUDA_SPLIT / ETWEEDIE_TRITON_SPLIT=0);
# "cuda:tiled" is the CUDA forward without its single-pass packet kernels (ETWEEDIE_CUDA_PACKET=0),
# the A/B of the 16-byte-load kernel against the tiled one it replaces; "triton:shifted" the
# Triton forward with a block metric applied through shifted loads instead of in registers
# (ETWEEDIE_TRITON_BLOCK_IN_REGISTERS=0; same as "triton" for isotropic rows); "cuda:graph" is the
# CUDA op replayed from a captured CUDA graph and "compile:graph" torch.compile(mode=
# "reduce-overhead") of the reference (compile's own CUDA graphs): the launch-bound shapes
# (16,384 × 64 × 2) compared without host overhead on either side; "cuda:pairtiles" runs small
# clouds at large d (energy_score's training shape) on the tiled pair kernel instead of the
# coordinate-split kernels (ETWEEDIE_CUDA_ENERGY_SPLIT=0), the A/B of the split ("triton:pairtiles":
# the same for Triton's split kernels, ETWEEDIE_TRITON_ENERGY_SPLIT=0)
TIMED_BACKENDS = {
    "et_score": ("reference", "compile", "compile:graph", "cuda", "cuda:graph", "cuda:tiled", "cuda:nosplit",
                 "triton", "triton:shifted", "triton:nosplit", "triton:tile8k", "triton:tile16k"),
    "langevin_step": ("reference", "compile", "compile:graph", "cuda", "cuda:graph", "cuda:tiled", "cuda:nosplit",
                      "triton", "triton:shifted", "triton:nosplit", "triton:tile8k"),
    "student_t_score": ("reference", "compile", "cuda", "triton"),
    "is_score": ("reference", "cuda", "triton"),
    "energy_score": ("reference", "compile", "cuda", "cuda:pairtiles", "triton", "triton:pairtiles"),
    "energy_distance": ("reference", "cuda", "triton"),
}


def chunked_energy_distance(a, b, beta: float = 1.0, chunk: int = 4096):
    """Eager signed U-statistic energy distance (Σ = I), rows in chunks: O(chunk·(n+m)) memory."""
    import torch

    n, m = a.shape[0], b.shape[0]

    def pair_sum(x, y):
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for i in range(0, x.shape[0], chunk):
            dist = torch.cdist(x[i : i + chunk], y, compute_mode="donot_use_mm_for_euclid_dist")
            total += dist.pow(beta).sum(dtype=torch.float64)
        return total

    return (2 * pair_sum(a, b) / (n * m) - pair_sum(a, a) / (n * (n - 1)) - pair_sum(b, b) / (m * (m - 1))).to(a.dtype)
# the environment switch that turns a backend variant's feature off
# backend variants: (environment variable, value) set while the row runs
_VARIANT_ENV = {"cuda:nosplit": ("ETWEEDIE_CUDA_SPLIT", "0"), "triton:nosplit": ("ETWEEDIE_TRITON_SPLIT", "0"),
                "cuda:tiled": ("ETWEEDIE_CUDA_PACKET", "0"), "cuda:pairtiles": ("ETWEEDIE_CUDA_ENERGY_SPLIT", "0"),
                "triton:pairtiles": ("ETWEEDIE_TRITON_ENERGY_SPLIT", "0"),
                "triton:shifted": ("ETWEEDIE_TRITON_BLOCK_IN_REGISTERS", "0"),
                "triton:tile8k": ("ETWEEDIE_TRITON_TILE", "8192"), "triton:tile16k": ("ETWEEDIE_TRITON_TILE", "16384")}


def _thunk(op: str, backend: str, dev, dtype, B: int, N: int, d: int, metric_fn, backward: bool,
           draws_dtype=None, seed: int = 0):
    """(callable, bytes that must move) for one workload on one backend ("compile" wraps the reference).

    ``draws_dtype``: the posterior draws stored in bfloat16/float16 (et_score, langevin_step,
    student_t_score), the query in ``dtype``; the float64 check then reads the same rounded draws."""
    import torch

    import etweedie

    compiled = backend.split(":")[0] == "compile"
    graph = backend.endswith(":graph")
    be = "reference" if compiled else backend.split(":")[0]
    g = torch.Generator().manual_seed(seed)
    metric = metric_fn("cpu")
    if metric is not None:
        metric = etweedie.Metric(metric.kind, metric.param.to(dev, dtype))
    if op == "is_score":
        bank = torch.randn(N, d, generator=g).to(dev, dtype)
        y = (bank[torch.randint(0, N, (B,), generator=g)].cpu() + 0.5 * torch.randn(B, d, generator=g)).to(dev, dtype)
        law = etweedie.GeneralizedGaussian(1.4, 1.8, metric, dim=d)
        # the reference is chunked over queries (4096 × bank per block) so it fits on the card
        fn = lambda: etweedie.is_score(y, bank, law, backend=be, chunk=4096)[0]  # noqa: E731
        return fn, (B * d + N * d) * y.element_size()
    if op == "energy_score":
        t = torch.randn(B, d, generator=g)
        xs = (t.unsqueeze(1) + 0.5 * torch.randn(B, N, d, generator=g)).to(dev, dtype).requires_grad_(backward)
        t = t.to(dev, dtype)
        beta = (1.2 + 0.8 * torch.rand(B, generator=g)).to(dev, dtype)

        def fn():
            es = etweedie.energy_score(xs, t, beta, metric, backend=be)
            return torch.autograd.grad(es.sum(), xs)[0] if backward else es

        # samples read by the forward and again by the backward, ∂samples written
        return (torch.compile(fn, dynamic=False) if compiled else fn), 3 * xs.numel() * xs.element_size()
    if op == "energy_distance":
        a = torch.randn(N, d, generator=g).to(dev, dtype)
        b = (1.1 * torch.randn(N, d, generator=g) + 0.2).to(dev, dtype)
        if be == "reference":
            fn = lambda: chunked_energy_distance(a, b)  # noqa: E731
        else:
            fn = lambda: etweedie.energy_distance(a, b, 1.0, backend=be)  # noqa: E731
        return fn, 2 * a.numel() * a.element_size()
    y = torch.randn(B, d, generator=g)
    x = y.unsqueeze(1) + 0.5 * torch.randn(B, N, d, generator=g)
    x = x.to(dev, draws_dtype) if draws_dtype is not None else x.to(dev, dtype)
    y = y.to(dev, dtype)
    nbytes = x.numel() * x.element_size() + 2 * y.numel() * y.element_size()
    if op == "langevin_step":
        xi = torch.randn(B, d, generator=g).to(dev, dtype)
        fn = lambda: etweedie.langevin_step(y, x, xi, 0.01, 1.4, 1.8, metric, backend=be)  # noqa: E731
        nbytes += xi.numel() * xi.element_size()
    else:
        if op == "student_t_score":
            c = 0.5 * d + 8.0  # the Student-t law needs c > d/2
            score = lambda y, x: etweedie.student_t_score(y, x, c, metric, backend=be)  # noqa: E731
        else:
            score = lambda y, x: etweedie.et_score(y, x, 1.4, 1.8, metric, backend=be)  # noqa: E731
        if backward:
            yr, xr = y.clone().requires_grad_(), x.clone().requires_grad_()
            fn = lambda: torch.autograd.grad(score(yr, xr).sum(), (yr, xr))[1]  # noqa: E731
            nbytes = 3 * nbytes  # forward reads x; backward reads x again and writes ∂x
        else:
            fn = lambda: score(y, x)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, dynamic=False, mode="reduce-overhead" if graph else None)
    elif graph:
        fn = _cuda_graph(fn)
    return fn, nbytes


def _cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph after three warm-up calls on a side stream: each call replays
    the graph (one launch for the whole op, no host work) and returns the captured output."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()

    def replay():
        g.replay()
        return out

    return replay


def _time_cuda(fn: Callable[[], object], repeats: int, warmup: int = 3, budget_s: float = 3.0,
               device: str = "cuda") -> Dict[str, float]:
    """CUDA-event timings per call (median, p20, p80); fewer repeats when one call is slow.

    A sample times ``inner`` back-to-back calls (no synchronization between them), so that for
    short calls the GPU's time is measured rather than the host's launch latency; ``host_ms``
    is one call's wall time with a synchronize after it (what a caller that waits sees).
    ``device="cpu"`` (the dry run) times with the host clock.
    """
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()  # first call: compilation / autotuning / allocator warm-up
    sync()
    t0 = time.time()
    for _ in range(warmup):
        fn()
        sync()
    per_call = max((time.time() - t0) / max(warmup, 1), 1e-6)
    inner = max(1, min(20, int(2e-3 / per_call)))
    repeats = int(max(3, min(repeats, budget_s / (per_call * inner))))
    times = []
    for _ in range(repeats):
        if not cuda:
            t1 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t1) * 1e3 / inner)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": q(0.5), "p20_ms": q(0.2), "p80_ms": q(0.8), "repeats": repeats, "inner": inner,
            "host_ms": per_call * 1e3}


def kernel_breakdown(fn: Callable[[], object], calls: int = 5, top: int = 6, device: str = "cuda") -> List[dict]:
    """Where one call's device time goes: the ``top`` kernels by total time over ``calls`` calls
    (torch.profiler), each as {name, us_per_call, launches_per_call}, plus an "(all kernels)" entry
    — so a row slower than its kernel shows whether the time is in the pair kernel, in the small
    launches around it, or between launches.  ``device="cpu"`` profiles CPU ops (a dry run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    out = [{"name": e.key[:120], "us_per_call": getattr(e, attr) / calls, "launches_per_call": e.count / calls}
           for e in events[:top]]
    out.append({"name": "(all kernels)", "us_per_call": sum(getattr(e, attr) for e in events) / calls,
                "launches_per_call": sum(e.count for e in events) / calls})
    return out


def copy_bandwidth_gbs(device: str = "cuda") -> float:
    """The card's measured device-to-device copy bandwidth (bytes read + written), GB/s
    (``device="cpu"``: a 64 MiB host copy, the dry run)."""
    import torch

    a = torch.empty(2**28 if device == "cuda" else 2**24, dtype=torch.float32, device=device).uniform_()  # 1 GiB
    b = torch.empty_like(a)
    t = _time_cuda(lambda: b.copy_(a), repeats=20, device=device)
    return 2 * a.numel() * 4 / (t["median_ms"] * 1e-3) / 1e9


def gpu_benchmarks(log: Log, quick: bool, only: Optional[List[str]] = None, deadline: Optional[float] = None,
                   on_row: Optional[Callable[[List[dict]], None]] = None, device: str = "cuda") -> List[dict]:
    """The GPU table's rows.  ``deadline`` (a ``time.time()`` value): no row starts after it (a row
    saying so stands for each one left out); ``on_row`` is called with the rows so far after every
    row, so a run cut short keeps what it measured.  A workload whose float64 check cannot be
    computed gets one error row and the next workload runs.  ``device="cpu"``: the dry run (tiny
    sizes on the CPU, the reference and cpu backends only; the other rows say so)."""
    import torch

    import etweedie

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    status = etweedie.backends.available()
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    copy_bw = copy_bandwidth_gbs(device)
    log(f"  measured copy bandwidth: {copy_bw:.0f} GB/s ({name})")
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    for wid, op, B, N, d, metric_fn, backward, draws_dtype in _workloads(quick, tiny=not cuda):
        if only and not any(o in wid for o in only):
            continue
        if deadline is not None and time.time() > deadline:
            add({"workload": wid, "backend": "-", "device": name, "error": "not run: past the --deadline"})
            log(f"  {wid:<24} not run: past the --deadline")
            continue
        # correctness first: float32 kernels against the float64 reference (on a small slice)
        small = (min(B, 8), min(N, 512), d)
        try:
            ref_fn, _ = _thunk(op, "reference", "cpu", torch.float64, *small, metric_fn, backward, draws_dtype)
            ref = ref_fn().double().cpu()
        except Exception as exc:  # this workload's rows are lost, not the table's
            add({"workload": wid, "backend": "reference", "device": name,
                 "error": f"float64 check failed: {type(exc).__name__}: {exc}"[:300]})
            log(f"  {wid:<24} float64 check failed: {type(exc).__name__}: {exc}"[:400])
            continue
        base = comp = None
        backends_here = TIMED_BACKENDS[op] if cuda else ("reference", "cpu") + TIMED_BACKENDS[op][1:]
        for backend in backends_here:
            row = {"workload": wid, "backend": backend, "B": B, "N": N, "d": d, "device": name,
                   "copy_GBps": copy_bw}
            base_be = backend.split(":")[0]
            if deadline is not None and time.time() > deadline:
                row["error"] = "not run: past the --deadline"
                add(row)
                continue
            if not cuda and base_be not in ("reference", "cpu"):
                row["error"] = "not run: a dry run times the reference and cpu backends only"
                add(row)
                continue
            if base_be not in ("reference", "compile") and not status[base_be][0]:
                row["error"] = f"unavailable: {status[base_be][1]}"
                add(row)
                continue
            env_name, env_value = _VARIANT_ENV.get(backend, (None, None))
            if env_name:
                os.environ[env_name] = env_value
            try:
                if backend != "compile":
                    chk_fn, _ = _thunk(op, backend, dev, torch.float32, *small, metric_fn, backward, draws_dtype)
                    out = chk_fn().double().cpu()
                    err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    row["max_rel_err"] = err
                    row["correct"] = err < 1e-3
                fn, nbytes = _thunk(op, backend, dev, torch.float32, B, N, d, metric_fn, backward, draws_dtype)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() if cuda else 0
                row.update(_time_cuda(fn, repeats=5 if quick or not cuda else 30, device=device))
                row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else 0.0
                row["GB/s"] = nbytes / (row["median_ms"] * 1e-3) / 1e9
                row["frac_copy_bw"] = row["GB/s"] / copy_bw
                if backend == "reference":
                    base = row["median_ms"]
                if backend == "compile":
                    comp = row["median_ms"]
                row["speedup_vs_reference"] = base / row["median_ms"] if base else None
                row["speedup_vs_compile"] = comp / row["median_ms"] if comp else None
                if backend not in ("reference", "compile"):
                    try:
                        row["kernels"] = kernel_breakdown(fn, device=device)
                    except Exception as exc:  # a profiler that cannot start costs the breakdown only
                        row["kernels_error"] = f"{type(exc).__name__}: {exc}"[:200]
                del fn
            except Exception as exc:  # a failing backend is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                if env_name:
                    os.environ.pop(env_name, None)
            if cuda:
                torch.cuda.empty_cache()
            add(row)
            log(f"  {wid:<24} {backend:<9} " + (row.get("error") or f"{row['median_ms']:.3f} ms, "
                f"{row['GB/s']:.0f} GB/s, rel err {row.get('max_rel_err', float('nan')):.1e}"))
            for k in row.get("kernels", []):
                log(f"      {k['us_per_call']:9.1f} µs/call  {k['launches_per_call']:5.1f}×  {k['name']}")
    return rows


def low_precision_ratios(rows: List[dict]) -> List[str]:
    """For each 16-bit-draw row, its time against the float32 row of the same workload and
    backend (target ≤ 0.6×: the bytes halve, the time should follow)."""
    ms = {(r["workload"], r["backend"]): r["median_ms"] for r in rows if "median_ms" in r}
    out = []
    for (wid, backend), t in ms.items():
        for suffix in ("_bf16", "_fp16"):
            base = ms.get((wid[: -len(suffix)], backend)) if wid.endswith(suffix) else None
            if base:
                out.append(f"{wid} {backend}: {t:.3f} ms vs float32 draws {base:.3f} ms = {t / base:.2f}×"
                           f" ({'met' if t / base <= 0.6 else 'missed'}: ≤ 0.6×)")
    return out


def format_table(rows: List[dict]) -> str:
    head = ("| workload | backend | median ms (p20–p80) | host ms | GB/s | % copy BW | × eager | × compile "
            "| peak extra MiB | max rel err | device |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['backend']} | {r['error']} | | | | | | | | {r['device']} |")
            continue
        sp, sc = r.get("speedup_vs_reference"), r.get("speedup_vs_compile")
        err = "" if "max_rel_err" not in r else f"{r['max_rel_err']:.1e}{'' if r['correct'] else ' WRONG'}"
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['median_ms']:.3f} ({r['p20_ms']:.3f}–{r['p80_ms']:.3f}) | "
            f"{r['host_ms']:.3f} | {r['GB/s']:.0f} | {100 * r['frac_copy_bw']:.0f}% | {'' if sp is None else f'{sp:.1f}×'} | "
            f"{'' if sc is None else f'{sc:.1f}×'} | {r['peak_extra_mib']:.1f} | {err} | {r['device']} |"
        )
    return "\n".join(lines)


def run_tests(cmd: List[str], test_log: str, timeout: Optional[float] = None, max_failures: int = 200) -> Dict[str, object]:
    """The test step: ``cmd`` streamed into ``test_log`` (a run cut short still shows how far it
    got); at ``timeout`` seconds the whole process group (xdist workers too) is killed and the
    exit status is "timeout".  Returns {"rc", "summary" (the last line), "failures" (the
    FAILED/ERROR lines, at most ``max_failures``)}, reading the log line by line (it may be huge)."""
    with open(test_log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: object = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            rc = "timeout"
    summary, fails = "", []
    with open(test_log, errors="replace") as f:
        for line in f:
            if line.strip():
                summary = line.strip()[:400]
            if line.startswith(("FAILED", "ERROR")) and len(fails) < max_failures:
                fails.append(line.rstrip()[:400])
    if rc == "timeout":
        summary = f"stopped at the {timeout:.0f} s --tests-timeout; last line: {summary}"
    return {"rc": rc, "summary": summary, "failures": fails}


def main(argv=None) -> int:
    if ROOT not in sys.path:  # the checkout's etweedie, benchmarks and experiments
        sys.path.insert(0, ROOT)
    from scripts._commandline import load  # torch-free: usage errors are one line, status 2

    commandline = load()
    OneLineParser, parse = commandline.OneLineParser, commandline.parse

    p = OneLineParser(prog="gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "gpu_check"), help="log and JSON directory")
    p.add_argument("--preflight", action="store_true", help="only check that this machine can run the GPU check")
    p.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    p.add_argument("--skip-build", action="store_true")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-check-cuda", action="store_true",
                   help="skip the plain-nvcc compile report (make check-cuda; the same on any machine with nvcc)")
    p.add_argument("--skip-cpu-table", action="store_true", help="skip the CPU benchmark table (minutes)")
    p.add_argument("--only", default="", help="comma-separated substrings of the GPU workloads to run")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-n 8 -k 'cuda or triton'\"")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from start after which no further benchmark workload starts (a leased GPU's limit)")
    p.add_argument("--tests-timeout", type=float, default=None, help="stop the test step after this many seconds")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: the table on the CPU at tiny sizes (reference and cpu backends)")
    args, status = parse(p, argv)
    if args is None:
        return status
    for flag, value in (("--deadline", args.deadline), ("--tests-timeout", args.tests_timeout)):
        if value is not None and not (value > 0 and value < float("inf")):
            print(f"gpu-check: error: {flag} must be a finite number of seconds > 0, got {value}", file=sys.stderr)
            return 2

    why = None if args.dry_run else preflight(need_toolkit=not args.skip_build)
    if why is not None:
        print(f"gpu-check: cannot run here — {why}", file=sys.stderr)
        return 2
    if args.preflight:
        return 0

    device = "cpu" if args.dry_run else "cuda"
    log = Log(os.path.join(args.out, "gpu_check.log"))
    results: Dict[str, object] = {"steps": {}, "failed": [], "env": env_facts(device)}
    failed = results["failed"]
    log("environment: " + json.dumps(results["env"]))

    def save() -> None:  # after every step, so a run cut short still leaves its results
        path = os.path.join(args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=2, default=str)
        os.replace(path + ".tmp", path)  # a process killed while writing leaves the last whole file

    if not args.skip_build:
        env = dict(os.environ, FORCE_CUDA="1")
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
        proc = log.run("build", cmd, env=env)
        results["steps"]["build"] = proc.returncode
        if proc.returncode:
            failed.append("build")
    probe_cmd = "import etweedie, json; print(json.dumps(etweedie.backends.available()))"
    try:
        if args.skip_build:  # nothing was built in this process's lifetime: ask here (a second import costs seconds)
            import etweedie  # (from ROOT: main put it on sys.path)

            probe = subprocess.CompletedProcess([], 0, json.dumps(etweedie.backends.available()), "")
        else:  # a fresh process sees what the build installed
            probe = subprocess.run([sys.executable, "-c", probe_cmd], cwd=ROOT, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        probe = subprocess.CompletedProcess([], 124, "", "importing etweedie took over 180 s")
    except Exception as exc:  # an import that fails is reported like the subprocess's would be
        probe = subprocess.CompletedProcess([], 1, "", f"import etweedie: {type(exc).__name__}: {exc}")
    log(f"backends: {probe.stdout.strip() or probe.stderr.strip()[-2000:]}")
    try:
        backends = json.loads(probe.stdout)
        results["backends"] = backends
        for name in ("cuda", "triton"):
            if not backends[name][0] and not args.dry_run:  # (a dry run has neither)
                failed.append(f"backend {name} unavailable")
    except (ValueError, KeyError):
        failed.append("import etweedie")
    save()

    if not args.skip_check_cuda and shutil.which(os.environ.get("NVCC", "nvcc")):
        proc = log.run("check-cuda", ["bash", "scripts/check_cuda.sh"])
        results["steps"]["check_cuda"] = proc.returncode
        if proc.returncode:
            failed.append("check-cuda")

    log(f"\n=== GPU benchmarks ({'CPU tensors, tiny sizes: a dry run' if args.dry_run else 'CUDA tensors'}, float32)")
    so_far: List[dict] = []

    crash_after = int(os.environ.get("GPU_CHECK_CRASH_AFTER_ROWS", "0") or 0)  # a test hook: abort mid-table

    def save_rows(rows: List[dict]) -> None:
        so_far[:] = rows
        results["gpu_benchmarks"] = rows
        save()
        if 0 < crash_after <= len(rows):
            log(f"GPU_CHECK_CRASH_AFTER_ROWS={crash_after}: aborting (a simulated crash)")
            os.abort()

    deadline = None if args.deadline is None else T_START + args.deadline
    try:
        rows = gpu_benchmarks(log, args.quick, [o for o in args.only.split(",") if o], deadline, save_rows, device)
    except Exception as exc:  # the rows measured so far are kept and printed; the later steps still run
        log("table stopped:\n" + traceback.format_exc()[-4000:])
        rows = list(so_far) + [{"workload": "(table)", "backend": "-", "device": results["env"].get("device", ""),
                                "error": f"table stopped: {type(exc).__name__}: {exc}"[:300]}]
    results["gpu_benchmarks"] = rows
    if any("error" in r and not r["error"].startswith(("unavailable", "not run")) for r in rows) or any(r.get("correct") is False for r in rows):
        failed.append("gpu benchmarks")
    table = format_table(rows)
    log("\n" + table)
    results["low_precision_ratios"] = low_precision_ratios(rows)
    for line in results["low_precision_ratios"]:
        log("  " + line)
    save()

    if not args.skip_tests:
        # streamed to a file, so a run cut short by a time limit still shows how far it got
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + shlex.split(args.pytest_args)
        test_log = os.path.join(args.out, "tests.log")
        log(f"\n=== tests: {' '.join(cmd)} (output in {test_log})")
        t0 = time.time()
        tests = run_tests(cmd, test_log, args.tests_timeout)
        rc = tests["rc"]
        results["steps"]["tests"] = rc
        results["tests_summary"] = tests["summary"]
        fails = tests["failures"]
        results["test_failures"] = fails
        log(f"--- tests: exit {rc} in {time.time() - t0:.0f} s; {results['tests_summary']}")
        for ln in fails[:60]:
            log("  " + ln[:400])
        if rc != 0:
            failed.append("tests")
        save()

    if not args.skip_cpu_table:
        cpu_json = os.path.join(args.out, "cpu_table.json")
        cmd = [sys.executable, "-m", "benchmarks.table", "--json", cpu_json] + (["--quick"] if args.quick else [])
        proc = log.run("CPU benchmark table", cmd)
        results["steps"]["cpu_table"] = proc.returncode
        if proc.returncode == 0 and os.path.exists(cpu_json):
            results["cpu_table"] = json.load(open(cpu_json))

    log("\n" + table)
    save()
    log(f"\ngpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}")
    log(f"gpu-check: log {os.path.join(args.out, 'gpu_check.log')}, results {os.path.join(args.out, 'results.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
