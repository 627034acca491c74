// Shared by the CPU (C++) and CUDA kernels: one spelling for host/device inline functions.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ET_HD __host__ __device__ __forceinline__
#else
#define ET_HD inline __attribute__((always_inline))
#endif

namespace etweedie {

// Metric kinds as passed to the kernels (etweedie/ops/_args.py uses the same numbers).
enum MetricKind : int { kIsotropic = 0, kDiagonal = 1, kBlock = 2 };

}  // namespace etweedie
