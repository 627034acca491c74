"""csrc/common/low_precision.h: the 16-bit draw formats the score kernels read and write.

Widening (bfloat16/float16 -> float32) is checked on all 65,536 bit patterns against torch;
narrowing (the ∂L/∂x store, round to nearest even) on fresh random float32 bit patterns against
torch — value by value and through the whole-row conversions (float16: widen_row, narrow_row, the
hardware F16C instructions where the build targets them; bfloat16: narrow16_bf16, the ∂L/∂x
store's blocks), and on float64 values — ties placed where rounding through float32 first would go
wrong — against exact rounding computed here with fractions.  The header is plain C++, so the
check is a small program built with the extension's CPU flags (as tests/test_fastmath.py does),
and again for the ISA levels of other CPUs this one can run (AVX2 only, AVX-512 without
AVX512-BF16, plain x86-64), whose conversion paths the extension build here never compiles.
"""

import math
import os
import subprocess
from fractions import Fraction

import pytest
import torch
from conftest import ISA_LEVELS, checker_command


# (mantissa bits with the implicit one, smallest normal exponent, largest finite value)
FORMATS = {
    torch.bfloat16: (8, -126, (2 - 2.0**-7) * 2.0**127),
    torch.float16: (11, -14, 65504.0),
}


# The build's own flags, then the paths other CPUs take (conftest.ISA_LEVELS): AVX2 only (integer
# bfloat16 rounding in both lane orders), AVX-512 without AVX512-BF16 (the 512-bit integer path
# of narrow16_fp16 and no hardware bfloat16 conversion), and no vector ISA at all.
@pytest.fixture(scope="module", params=list(ISA_LEVELS))
def checker(request, tmp_path_factory):
    level = request.param
    exe = tmp_path_factory.mktemp("low_precision") / f"low_precision_check_{level}"
    subprocess.run(checker_command(level, "low_precision_check.cpp", exe), check=True, capture_output=True, text=True)
    return exe


def _run(exe, args, data: bytes = b"") -> bytes:
    proc = subprocess.run([str(exe), *args], input=data, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout


def _same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: identical bit patterns, or NaN in both (NaN payloads may differ)."""
    int_t = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return (got.view(int_t) == want.view(int_t)) | (torch.isnan(got.float()) & torch.isnan(want.float()))


def test_widen_every_bit_pattern(checker):
    out = torch.frombuffer(bytearray(_run(checker, ["widen"])), dtype=torch.float32)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # wraps to the 16-bit patterns
    # bf16 and fp16 value by value, then fp16 through widen_row (F16C where the build has it)
    for k, dtype in enumerate((torch.bfloat16, torch.float16, torch.float16)):
        got = out[k * 65536 : (k + 1) * 65536]
        want = bits.view(dtype).float()
        bad = ~_same_bits_or_both_nan(got, want)
        assert not bad.any(), f"{dtype}: first bad pattern {int(bits[bad][0]) & 0xffff:#06x}"


def _narrow(checker, values: torch.Tensor):
    mode = {torch.float32: "narrow32", torch.float64: "narrow64"}[values.dtype]
    raw = _run(checker, [mode, str(values.numel())], values.numpy().tobytes())
    out = torch.frombuffer(bytearray(raw), dtype=torch.int16)
    n = values.numel()
    rows = ((out[2 * n : 3 * n].view(torch.float16), *(out[k * n : (k + 1) * n].view(torch.bfloat16) for k in (3, 4, 5)))
            if values.dtype == torch.float32 else ())
    return (out[:n].view(torch.bfloat16), out[n : 2 * n].view(torch.float16), *rows)


def test_narrow_float32_matches_torch(checker):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    random_bits = torch.randint(-(2**31), 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 65536.0,
                            3.3895314e38, 3.4e38, 2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26,
                            1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1e-40, -1e-45])
    values = torch.cat([random_bits.view(torch.float32), special, -special])
    # the rows: float16 through narrow_row (F16C where built with it), bfloat16 through the 16-value
    # blocks of the ∂L/∂x store, in coordinate order and in the lanes' order of the register
    # backward (AVX2 integer rounding; vcvtneps2bf16 / vcvtne2ps2bf16 on AVX512-BF16 builds for
    # blocks without a subnormal, which those instructions flush: ~6% of these random blocks hold one)
    # (and through the integer rounding alone, which those fall back to)
    got_b, got_h, got_h_rows, got_b_rows, got_b_unpacked, got_b_exact = _narrow(checker, values)
    assert got_b_rows.numel() == got_b_unpacked.numel() == got_b_exact.numel() == values.numel()
    for got, dtype in ((got_b, torch.bfloat16), (got_h, torch.float16), (got_h_rows, torch.float16),
                       (got_b_rows, torch.bfloat16), (got_b_unpacked, torch.bfloat16), (got_b_exact, torch.bfloat16)):
        want = values.to(dtype)
        bad = ~_same_bits_or_both_nan(got, want)
        assert not bad.any(), f"{dtype}: {values[bad][:5].tolist()} -> {got[bad][:5].tolist()}, torch {want[bad][:5].tolist()}"


def _round_exact(v: float, dtype) -> float:
    """v rounded to nearest even in the format, computed exactly (overflow to ±inf)."""
    if math.isnan(v) or math.isinf(v) or v == 0:
        return v
    p, emin, largest = FORMATS[dtype]
    e = max(math.frexp(abs(v))[1] - 1, emin)  # exponent of the leading bit (subnormals: emin)
    quantum = Fraction(2) ** (e - (p - 1))
    r = round(Fraction(abs(v)) / quantum) * quantum  # round() on a Fraction: half to even
    return math.copysign(math.inf if r > Fraction(largest) else float(r), v)


def test_narrow_float64_rounds_once(checker):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    mags = torch.exp(torch.empty(4000, dtype=torch.float64).uniform_(-80, 80, generator=g))
    signs = torch.where(torch.rand(4000, generator=g) < 0.5, -1.0, 1.0).double()
    values = [float(v) for v in mags * signs]
    # float64 values a hair above a tie of the 16-bit format: rounding to float32 first lands
    # exactly on the tie, which then goes to even (down) instead of up.
    for dtype, (p, _, _) in FORMATS.items():
        for base in (1.0, 1.5, 3.25, 1000.0, 2.0**-10):
            ulp = 2.0 ** (math.frexp(base)[1] - 1 - (p - 1))
            tie = base + ulp / 2
            values += [tie + tie * 2.0**-40, -(tie + tie * 2.0**-40), tie, tie - tie * 2.0**-40]
    values += [0.0, -0.0, 1e300, -1e300, 65519.999, 70000.0, 2.0**-24 * 0.5000001, 1e-320]
    x = torch.tensor(values, dtype=torch.float64)
    got_b, got_h = _narrow(checker, x)
    for got, dtype in ((got_b, torch.bfloat16), (got_h, torch.float16)):
        want = torch.tensor([_round_exact(v, dtype) for v in values], dtype=torch.float64).to(dtype)  # exact values
        bad = ~_same_bits_or_both_nan(got, want)
        assert not bad.any(), f"{dtype}: {x[bad][:5].tolist()} -> {got[bad][:5].tolist()}, exact {want[bad][:5].tolist()}"
