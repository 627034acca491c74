"""Host cost of one op call: the Python wrapper (validation, canonical form, backend choice)
against the compiled op it ends in, on inputs so small that the kernel's own time is negligible.

    python benchmarks/bench_host_overhead.py [--repeats 2000] [--threads 1] [--json OUT.json]

Two regimes, timed in one process:

* ``cpu``: CPU tensors, where the package reads values it must check (β range, finite data, the
  float32 range test: a few small reductions per call);
* ``gpu-like``: the same CPU tensors with value checks switched off exactly as a GPU tensor sees
  them without ``etweedie.set_debug(True)`` (``value_checks`` answers False in every etweedie
  module that uses it) and without the plain CPU calls (``_front.plain_rows``, energy_score's
  ``_plain``: CPU tensors only): the part of the host path a GPU call pays, measurable here without a GPU.
  For the energy ops that includes the NaN-row pass a GPU call runs instead of reading its
  inputs back to the host.

Each row is the median µs per call over ``--repeats`` calls (p20–p80 over 7 rounds), beside the
raw ``torch.ops.etweedie.*_fwd`` call with the canonical tensors prepared in advance (the
difference is the wrapper's cost) and, for the per-row ops, the C++ front op the wrapper ends in
(``torch.ops.etweedie.<op>``: canonical form and kernel call in one C++ call, csrc/front/).  A
metric is built once and reused, as a sampler reuses a level's metric.  The ``fwd+bwd`` rows time
a training step's use of the op: value, ``.sum()`` and ``torch.autograd.grad`` of the samples
(energy_score; the raw column: the fused value-and-gradient op on canonical tensors, through its
autograd kernel) or of the query (et_score: ``et_score_fwd`` and its backward kernel).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import etweedie  # noqa: E402
from etweedie.commandline import OneLineParser  # noqa: E402
from benchmarks.common import MAX_THREADS, check_flags, check_threads, flag_error  # noqa: E402
from etweedie.ops import _debug  # noqa: E402


def _per_call_us(fn, repeats: int, rounds: int = 7):
    for _ in range(max(repeats // 10, 10)):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - t0) / repeats * 1e6)
    times.sort()
    return statistics.median(times), times[1], times[-2]


_PLAIN = ("plain_rows", "_plain")  # the per-row ops' plain CPU call, energy_score's


def _plain_calls() -> dict:
    """{(module, attribute): function} of every plain CPU call in the loaded etweedie modules."""
    return {(mod, attr): getattr(mod, attr) for name, mod in list(sys.modules.items()) if name.startswith("etweedie")
            for attr in _PLAIN if callable(getattr(mod, attr, None))}


def _set_plain_calls(saved: dict, off: bool) -> None:
    """The plain CPU calls off (they answer None) or restored: a GPU call never takes them."""
    for (mod, attr), fn in saved.items():
        setattr(mod, attr, (lambda *a: None) if off else fn)


def _set_value_checks(fn) -> None:
    """``value_checks`` replaced by ``fn`` in _debug, which owns it, and in every etweedie module that imported it."""
    current = _debug.value_checks
    for name, mod in list(sys.modules.items()):
        if name.startswith("etweedie") and getattr(mod, "value_checks", None) is current:
            mod.value_checks = fn


def cases():
    g = torch.Generator().manual_seed(0)
    y, x = torch.randn(1, 4, generator=g), torch.randn(1, 4, 4, generator=g)
    noise, step = torch.randn(1, 4, generator=g), 0.01
    block = etweedie.Metric.block(torch.tensor([[1.0, 0.3], [0.3, 1.0]]))
    one, beta = torch.ones(1), torch.full((1,), 1.5)
    prec_b = torch.linalg.inv(block.param).contiguous().expand(1, 2, 2)
    ops = torch.ops.etweedie
    b0, one0, step0, p_b = torch.tensor(1.5), torch.tensor(1.0), torch.tensor(step), prec_b[0].contiguous()
    has_front = hasattr(ops, "et_score") and hasattr(ops, "langevin_step")  # each returns (out, nonfinite)
    rows = [
        ("et_score iso", lambda: etweedie.et_score(y, x, 1.5), lambda: ops.et_score_fwd(y, x, beta, one, one, 0),
         (lambda: ops.et_score(y, x, b0, one0, one0, 0, [1])[0]) if has_front else None),
        ("et_score block", lambda: etweedie.et_score(y, x, 1.5, 1.0, block),
         lambda: ops.et_score_fwd(y, x, beta, one, prec_b, 2),
         (lambda: ops.et_score(y, x, b0, one0, p_b, 2, [1])[0]) if has_front else None),
        ("langevin_step block", lambda: etweedie.langevin_step(y, x, noise, step, 1.5, 1.0, block),
         lambda: ops.langevin_step_fwd(y, x, noise, torch.full((1,), step), beta, one, prec_b, 2),
         (lambda: ops.langevin_step(y, x, noise, step0, b0, one0, p_b, 2, [1])[0]) if has_front else None),
    ]
    has_es_front = hasattr(ops, "energy_score")

    def energy_rows(label, samples, target, nan_rows):
        """energy_score's forward and fwd+bwd rows; ``nan_rows``: whether the public op asks its
        front op for the NaN-row pass (not in the Gram row kernel's domain, which writes its own)."""
        sg = samples.clone().requires_grad_()

        def grad_of(value):
            return torch.autograd.grad(value.sum(), sg)[0]

        return [
            (label, lambda: etweedie.energy_score(samples, target, 1.5, block),
             lambda: ops.energy_score_fwd(samples, target, beta, prec_b, 2, True),
             (lambda: ops.energy_score(samples, target, b0, p_b, 2, True, [1], False, nan_rows)) if has_es_front else None),
            (f"{label} fwd+bwd", lambda: grad_of(etweedie.energy_score(sg, target, 1.5, block)),
             lambda: grad_of(ops.energy_score_fwd_grad(sg, target, beta, prec_b, 2, True, True, False, False, False)[0]),
             (lambda: grad_of(ops.energy_score(sg, target, b0, p_b, 2, True, [1], True, nan_rows))) if has_es_front else None),
        ]

    yg = y.clone().requires_grad_()

    def grad_y(score):
        return torch.autograd.grad(score.sum(), yg)[0]

    x64, y64 = torch.randn(1, 4, 64, generator=g), torch.randn(1, 64, generator=g)
    return [
        *rows,
        ("et_score block fwd+bwd", lambda: grad_y(etweedie.et_score(yg, x, 1.5, 1.0, block)),
         lambda: grad_y(ops.et_score_fwd(yg, x, beta, one, prec_b, 2)[0]),
         (lambda: grad_y(ops.et_score(yg, x, b0, one0, p_b, 2, [1])[0])) if has_front else None),
        *energy_rows("energy_score block", x, y, True),
        # d = 64: the Gram-form row kernel's domain (d ≥ 64), which energy_score's plain CPU call covers
        *energy_rows("energy_score block d=64", x64, y64, False),
    ]


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000, help="calls per timed round (>= 1)")
    ap.add_argument("--threads", type=int, default=1, help=f"torch threads, 1 to {MAX_THREADS}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:  # one line and exit status 2 for a flag the run cannot use, before any timing
        check_flags([("--repeats", args.repeats, 1), check_threads(args.threads)], args.json)
    except ValueError as exc:
        return flag_error("python benchmarks/bench_host_overhead.py", exc)
    torch.set_num_threads(args.threads)
    rows = []
    real_checks, real_plain = _debug.value_checks, _plain_calls()
    try:
        for regime in ("cpu", "gpu-like"):
            _set_value_checks(real_checks if regime == "cpu" else (lambda t: False))
            _set_plain_calls(real_plain, off=regime != "cpu")
            for name, wrapped, raw, front in cases():
                torch.testing.assert_close(wrapped().reshape(-1), raw()[0].reshape(-1) if isinstance(raw(), tuple)
                                           else raw().reshape(-1))
                if front is not None:
                    torch.testing.assert_close(wrapped().reshape(-1), front().reshape(-1))
                w = _per_call_us(wrapped, args.repeats)
                r = _per_call_us(raw, args.repeats)
                f = _per_call_us(front, args.repeats)[0] if front is not None else None
                rows.append(dict(op=name, regime=regime, wrapper_us=w[0], wrapper_p20=w[1], wrapper_p80=w[2],
                                 raw_us=r[0], front_us=f, overhead_us=w[0] - r[0]))
    finally:
        _set_value_checks(real_checks)
        _set_plain_calls(real_plain, off=False)
    print(f"host cost per call, {torch.get_num_threads()} thread(s), torch {torch.__version__}, etweedie {etweedie.__version__}")
    print("| op | regime | wrapper µs (p20–p80) | raw op µs | front op µs | wrapper overhead µs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        front = "—" if r["front_us"] is None else f"{r['front_us']:.0f}"
        print(f"| {r['op']} | {r['regime']} | {r['wrapper_us']:.0f} ({r['wrapper_p20']:.0f}–{r['wrapper_p80']:.0f}) "
              f"| {r['raw_us']:.0f} | {front} | {r['overhead_us']:.0f} |")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        except OSError as exc:  # checked at the start; the file system may have changed since
            return flag_error("python benchmarks/bench_host_overhead.py",
                              ValueError(f"--json {args.json!r}: could not write the rows ({exc})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
