"""Builds etweedie._C (DESIGN §5).

CPU kernels always (OpenMP when torch was built with it).  CUDA bindings only when a CUDA
toolkit is found (CUDA_HOME) *and* torch is a CUDA build (torch.version.cuda) — never on
whether a GPU is visible.  FORCE_CUDA=1 builds CUDA regardless of torch.version.cuda;
FORCE_ONLY_CPU=1 skips CUDA.  ETWEEDIE_NATIVE=0 drops -march=native (portable binary).
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def extensions():
    sources = [os.path.join("csrc", "etweedie.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
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
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*bindings.cpp")))  # bindings.cpp + per-op bindings
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


setup(
    packages=find_packages(include=["etweedie", "etweedie.*"]) + ["etweedie.kernels"],
    package_dir={"etweedie.kernels": "kernels"},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
