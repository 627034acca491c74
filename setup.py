"""Builds etweedie._C (DESIGN §5).

CPU kernels always (OpenMP when torch was built with it).  CUDA bindings only when a CUDA
toolkit is found (CUDA_HOME) *and* torch is a CUDA build (torch.version.cuda) — never on
whether a GPU is visible.  FORCE_CUDA=1 builds CUDA regardless of torch.version.cuda;
FORCE_ONLY_CPU=1 skips CUDA.  ETWEEDIE_NATIVE=0 drops -march=native (portable binary).

The extension is compiled against the torch that runs this file, so build with the torch you
will use: ``pip install --no-build-isolation .`` (pyproject's build requirements leave torch out
on purpose: an isolated build would fetch an unpinned, multi-GB torch and compile against it).

Without a working compiler:
  ETWEEDIE_ALLOW_NO_EXT=1  try the build; if compiling fails, warn and install without etweedie._C
                           (the ops then run on the reference and Triton backends; importing
                           etweedie warns once, and `python -m etweedie info` says why);
  ETWEEDIE_NO_EXT=1        do not compile at all (a pure-Python install; torch not needed to build).
By default a failed compile fails the install, so a broken toolchain is never silent.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


NO_EXT = _flag("ETWEEDIE_NO_EXT")
ALLOW_NO_EXT = _flag("ETWEEDIE_ALLOW_NO_EXT")

if not NO_EXT:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        sys.exit(
            f"etweedie: cannot import torch in the build environment ({exc}). The C++ extension is compiled "
            "against the torch you run: install torch first, then `pip install --no-build-isolation .` "
            "(set ETWEEDIE_NO_EXT=1 for a pure-Python install without the compiled kernels)."
        )


def extensions():
    sources = [os.path.join("csrc", "etweedie.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "front", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "autograd", "*.cpp")))
    # -fno-trapping-math lets GCC if-convert the branch-free fastmath selects, i.e. vectorize
    # the weight loops; the kernels never rely on floating-point exceptions.
    cxx = ["-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math"]
    if os.environ.get("ETWEEDIE_NATIVE", "1") != "0":
        cxx.append("-march=native")
    extra_link = []
    if torch.backends.openmp.is_available():
        # at::parallel_for uses torch's thread pool; -fopenmp also enables `#pragma omp simd`.
        cxx.append("-fopenmp")
        extra_link.append("-fopenmp")
    else:
        cxx.append("-fopenmp-simd")
    with_cuda = (CUDA_HOME is not None and torch.version.cuda is not None) or _flag("FORCE_CUDA")
    if _flag("FORCE_ONLY_CPU"):
        with_cuda = False
    define_macros = []
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*_bindings.cpp")))
        define_macros.append(("WITH_CUDA", None))
        nvcc = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
        return [
            CUDAExtension(
                "etweedie._C",
                sources,
                include_dirs=[os.path.join(here, "csrc")],
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                extra_link_args=extra_link,
            )
        ]
    return [
        CppExtension(
            "etweedie._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx},
            extra_link_args=extra_link,
        )
    ]


def _build_ext_class():
    class OptionalBuildExtension(BuildExtension):
        """torch's BuildExtension; with ETWEEDIE_ALLOW_NO_EXT=1 a failed compile warns instead of failing."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # no compiler, a compile error, a missing header: all one fate
                if not ALLOW_NO_EXT:
                    raise
                print(
                    "WARNING: etweedie: building the C++ extension etweedie._C failed "
                    f"({exc.__class__.__name__}: {exc}); installing without it (ETWEEDIE_ALLOW_NO_EXT=1). "
                    "The ops will run on the reference/Triton backends. Install a C++17 compiler (g++ or clang++) "
                    "and reinstall with `pip install --no-build-isolation .` to build it.",
                    file=sys.stderr,
                )

    return OptionalBuildExtension.with_options(use_ninja=True)


setup(
    packages=find_packages(include=["etweedie", "etweedie.*"]) + ["etweedie.kernels"],
    package_dir={"etweedie.kernels": "kernels"},
    ext_modules=[] if NO_EXT else extensions(),
    cmdclass={} if NO_EXT else {"build_ext": _build_ext_class()},
)
