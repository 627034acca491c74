"""Compile the Triton kernels ahead of time for a GPU target — no GPU needed.

The test suite runs the kernels under TRITON_INTERPRET=1, which does not exercise Triton's
compiler (type specialization, layouts, libdevice calls).  This lowers every kernel variant
(metric kind, one/several coordinate chunks, Langevin on/off) through Triton's compiler to a
cubin for the given architecture, with the ptxas that ships with triton.

    python scripts/check_triton.py [--arch 80] [--dtypes fp32,fp64] [--draws bf16,fp16]     (make check-triton)

``--draws`` adds the score kernels (et_score, langevin_step, student_t_score) with 16-bit
draws: x and ∂L/∂x in bf16/fp16, everything else in the --dtypes type.

Must run *without* TRITON_INTERPRET=1.  fp64 variants take several minutes on a small machine.
"""

from __future__ import annotations

import itertools
import os
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES, DRAWS = ("fp32", "fp64"), ("bf16", "fp16")


def main(argv=None) -> int:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from scripts._commandline import load  # torch-free: usage errors are one line, status 2

    commandline = load()
    OneLineParser, parse = commandline.OneLineParser, commandline.parse

    p = OneLineParser(prog="check_triton", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=80, help="CUDA compute capability ×10 (80 = A100, 90 = H100)")
    p.add_argument("--dtypes", default="fp32", help="comma-separated: fp32,fp64")
    p.add_argument("--draws", default="", help="comma-separated 16-bit draw types for the score kernels: bf16,fp16")
    args, status = parse(p, argv)
    if args is None:
        return status
    for flag, value, known in (("--dtypes", args.dtypes, DTYPES), ("--draws", args.draws, DRAWS)):
        items = [v for v in value.split(",") if v] if value else []
        if (flag == "--dtypes" and not items) or any(v not in known for v in items):
            print(f"check_triton: error: {flag} must be a comma-separated list of {', '.join(known)}, got {value!r}",
                  file=sys.stderr)
            return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("check_triton: unset TRITON_INTERPRET (this checks the compiler, not the interpreter)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from etweedie.kernels import _energy as P
    from etweedie.kernels import et_score as E
    from etweedie.kernels import is_score as I

    target = GPUTarget("cuda", args.arch, 32)

    def build(fn, ptr, ints, consts, draws=None):
        sig = {n: ("constexpr" if n in consts else (ptr if n.endswith("_ptr") else "i32")) for n in fn.arg_names}
        if draws:  # x and its gradient stored in 16 bits
            sig.update({n: "*" + draws for n in ("x_ptr", "gx_ptr") if n in sig})
        assert all(n in consts or n.endswith("_ptr") or n in ints for n in fn.arg_names), fn.arg_names
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
        return kernel

    t0 = time.time()
    count = 0
    for dt in args.dtypes.split(","):
        ptr = "*" + dt
        for kind, K, KP in [(0, 1, 1), (1, 1, 1), (2, 2, 2), (2, 3, 4), (2, 4, 4)]:
            for one in (True, False):
                BN, BD = (8, 256) if one else (8, 64)
                fwd_ints = ["N", "d", "sxb", "sxn", "sb", "sl", "sp", "sa", "n_per", "nsplit"]
                # a power-of-two block: applied in registers (default) and through shifted loads
                for in_reg in sorted({False, kind == 2 and K == KP}):
                    for lang in (False, True):
                        for split in (False, True):
                            build(E._et_score_forward_kernel, ptr, fwd_ints,
                                  dict(KIND=kind, K=K, KP=KP, BLOCK_N=BN // KP, BLOCK_D=BD, ONE_CHUNK=one,
                                       LANGEVIN=lang, SPLIT=split, IN_REGISTERS=in_reg, LAW=0))
                            count += 1
                if one and kind in (0, 2) and K == KP:  # gpu_check's triton:tile8k/16k (ETWEEDIE_TRITON_TILE)
                    for tile in (8192, 16384):
                        build(E._et_score_forward_kernel, ptr, fwd_ints,
                              dict(KIND=kind, K=K, KP=KP, BLOCK_N=tile // (1024 * KP), BLOCK_D=1024, ONE_CHUNK=True,
                                   LANGEVIN=False, SPLIT=False, IN_REGISTERS=kind == 2, LAW=0))
                        count += 1
                # the Student-t score: the same kernels with LAW = 1
                build(E._et_score_forward_kernel, ptr, fwd_ints,
                      dict(KIND=kind, K=K, KP=KP, BLOCK_N=BN // KP, BLOCK_D=BD, ONE_CHUNK=one,
                           LANGEVIN=False, SPLIT=False, IN_REGISTERS=kind == 2 and K == KP, LAW=1))
                for law in (0, 1):
                    build(E._et_score_backward_kernel, ptr, ["N", "d", "sxb", "sxn", "sb", "sl", "sp", "nchunks"],
                          dict(KIND=kind, K=K, KP=KP, BLOCK_N=BN // KP, BLOCK_D=BD, ONE_CHUNK=one,
                               NEED_X=True, NEED_BETA=law == 0, NEED_LAM=True, NEED_PREC=True, LAW=law))
                build(I._is_score_forward_kernel, ptr, ["Q", "M", "d"],
                      dict(KIND=kind, K=K, BLOCK_Q=16, BLOCK_M=16, BLOCK_D=BD // 4, ONE_CHUNK=one))
                count += 4
        # pair engine of energy_score / energy_distance: small-d (registers) and chunked paths,
        # value-only (circulant) and gradient (ordered) variants, each metric kind in the kernel
        for (small, D, BD, BI, BJ), (mkind, mk) in itertools.product(
                [(True, 2, 2, 64, 64), (False, 1, 4, 32, 32), (False, 1, 128, 1, 32)], [(0, 1), (1, 1), (2, 2)]):
            for grad in (False, True):
                consts = dict(CROSS=1, WITHIN_ALL=grad, NEED_G=grad, NEED_VALUE=True, NEED_BETA=grad, CROSS_BETA=grad,
                              SMALL=small, D=D, DP=D, BD=BD, BI=BI, BJ=BJ, KIND=mkind, K=mk)
                fn = P._energy_pairs_kernel
                sig = {n: "constexpr" if n in consts else ("*fp64" if n in ("val_ptr", "gb_ptr") else ptr)
                       if n in consts or n.endswith("_ptr") else ("fp32" if n.startswith("w_") else "i32")
                       for n in fn.arg_names}
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
                count += 1
        # the split kernels of small clouds at large d (energy_score's training shape: 33 points)
        for mkind, mk in [(0, 1), (1, 1), (2, 2), (2, 3), (2, 4)]:
            for fn, ints, consts in [
                (P._split_rows_kernel, ["n", "m", "d", "sab", "san", "scb", "scn", "sb", "sp", "sg", "NI"],
                 dict(NPP=64, W=32, R=4, KIND=mkind, K=mk, NEED_COEF=True, NEED_SUMS=True, NEED_BETA=True)),
                (P._split_grad_kernel, ["n", "m", "d", "sab", "san", "scb", "scn", "sp", "CG"],
                 dict(NPP=64, W=32, KIND=mkind, K=mk, NEED_A=True, NEED_C=True)),
            ]:
                sig = {n: "constexpr" if n in consts else ("*fp64" if n == "part_ptr" else ptr)
                       if n in consts or n.endswith("_ptr") else "i32" for n in fn.arg_names}
                assert all(n in consts or n.endswith("_ptr") or n in ints for n in fn.arg_names), fn.arg_names
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
                count += 1
        for draws in filter(None, args.draws.split(",")):
            for kind, K, KP in [(0, 1, 1), (1, 1, 1), (2, 2, 2), (2, 3, 4)]:
                for one in (True, False):
                    BN, BD = (8, 256) if one else (8, 64)
                    # et_score, langevin_step and (LAW = 1) the Student-t score
                    for lang, law in ((False, 0), (True, 0), (False, 1)):
                        build(E._et_score_forward_kernel, ptr, ["N", "d", "sxb", "sxn", "sb", "sl", "sp", "sa", "n_per", "nsplit"],
                              dict(KIND=kind, K=K, KP=KP, BLOCK_N=BN // KP, BLOCK_D=BD, ONE_CHUNK=one, LANGEVIN=lang,
                                   SPLIT=False, IN_REGISTERS=kind == 2 and K == KP, LAW=law), draws)
                    for law in (0, 1):
                        build(E._et_score_backward_kernel, ptr, ["N", "d", "sxb", "sxn", "sb", "sl", "sp", "nchunks"],
                              dict(KIND=kind, K=K, KP=KP, BLOCK_N=BN // KP, BLOCK_D=BD, ONE_CHUNK=one,
                                   NEED_X=True, NEED_BETA=law == 0, NEED_LAM=True, NEED_PREC=True, LAW=law), draws)
                    count += 5
        print(f"check_triton: {dt} variants compiled ({time.time() - t0:.0f} s)", flush=True)
    print(f"check_triton: {count} kernel variants compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
