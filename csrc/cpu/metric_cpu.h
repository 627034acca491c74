// CPU view of one row's precision P, specialized per metric kind so the inner loops over
// the d coordinates compile to straight SIMD code.  P is never materialized as d×d:
//   isotropic: P = p·I (1 number), diagonal: P = diag(p) (d numbers),
//   block:     P = I_{d/K} ⊗ Pk (K×K numbers, K ≤ 4, compile-time K).
// Every routine takes the residual implicitly as u = y − x (two pointers) so that no
// u buffer of size N·d is ever written.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/low_precision.h"
#include "../common/macros.h"

namespace etweedie {
namespace cpu {

template <typename T, int KIND, int K>
struct RowPrec;

template <typename T>
struct RowPrec<T, kIsotropic, 0> {
  const T* p;
  // uᵀPu
  template <typename X>
  T quad(const T* y, const X* x, int64_t d) const {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      acc += u * u;
    }
    return p[0] * acc;
  }
  // uᵀPu and h·u in one pass
  template <typename X>
  void quad_dot(const T* y, const X* x, const T* h, int64_t d, T& q, T& hu) const {
    T acc = 0, dot = 0;
#pragma omp simd reduction(+ : acc, dot)
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      acc += u * u;
      dot += h[j] * u;
    }
    q = p[0] * acc;
    hu = dot;
  }
  // out = scale · P v
  void apply(const T* v, T scale, T* out, int64_t d) const {
    const T c = scale * p[0];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) out[j] = c * v[j];
  }
  // gy += a·h + c·P u ;  gx = −(a·h + c·P u)  (gx may be null)
  template <typename X>
  void grad_u(const T* y, const X* x, const T* h, T a, T c, T* gy, T* gx, int64_t d) const {
    const T cp = c * p[0];
    if (gx) {
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const T g = a * h[j] + cp * (y[j] - widen<T>(x[j]));
        gy[j] += g;
        gx[j] = -g;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) gy[j] += a * h[j] + cp * (y[j] - widen<T>(x[j]));
    }
  }
  // gP += c · (u uᵀ reduced to the parameter's shape)
  template <typename X>
  void accum_outer(const T* y, const X* x, T c, T* gp, int64_t d) const {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      acc += u * u;
    }
    gp[0] += c * acc;
  }
  // gP += c · (a bᵀ reduced to the parameter's shape)
  void accum_outer2(const T* a, const T* b, T c, T* gp, int64_t d) const {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < d; ++j) acc += a[j] * b[j];
    gp[0] += c * acc;
  }
  // Small-d tiles in structure-of-arrays form: ut[j * ld + t] = u_t[j] for n residuals;
  // q[t] = u_tᵀ P u_t, vectorized across t.
  void quad_soa(const T* ut, int64_t ld, int64_t n, int64_t d, T* q) const {
    for (int64_t t = 0; t < n; ++t) q[t] = 0;
    for (int64_t j = 0; j < d; ++j) {
      const T* uj = ut + j * ld;
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) q[t] += uj[t] * uj[t];
    }
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) q[t] *= p[0];
  }
  static constexpr int64_t param_size(int64_t) { return 1; }
};

template <typename T>
struct RowPrec<T, kDiagonal, 0> {
  const T* p;
  template <typename X>
  T quad(const T* y, const X* x, int64_t d) const {
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      acc += p[j] * u * u;
    }
    return acc;
  }
  template <typename X>
  void quad_dot(const T* y, const X* x, const T* h, int64_t d, T& q, T& hu) const {
    T acc = 0, dot = 0;
#pragma omp simd reduction(+ : acc, dot)
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      acc += p[j] * u * u;
      dot += h[j] * u;
    }
    q = acc;
    hu = dot;
  }
  void apply(const T* v, T scale, T* out, int64_t d) const {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) out[j] = scale * p[j] * v[j];
  }
  template <typename X>
  void grad_u(const T* y, const X* x, const T* h, T a, T c, T* gy, T* gx, int64_t d) const {
    if (gx) {
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const T g = a * h[j] + c * p[j] * (y[j] - widen<T>(x[j]));
        gy[j] += g;
        gx[j] = -g;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) gy[j] += a * h[j] + c * p[j] * (y[j] - widen<T>(x[j]));
    }
  }
  template <typename X>
  void accum_outer(const T* y, const X* x, T c, T* gp, int64_t d) const {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      const T u = y[j] - widen<T>(x[j]);
      gp[j] += c * u * u;
    }
  }
  void accum_outer2(const T* a, const T* b, T c, T* gp, int64_t d) const {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) gp[j] += c * a[j] * b[j];
  }
  void quad_soa(const T* ut, int64_t ld, int64_t n, int64_t d, T* q) const {
    for (int64_t t = 0; t < n; ++t) q[t] = 0;
    for (int64_t j = 0; j < d; ++j) {
      const T* uj = ut + j * ld;
      const T pj = p[j];
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) q[t] += pj * uj[t] * uj[t];
    }
  }
  static constexpr int64_t param_size(int64_t d) { return d; }
};

template <typename T, int K>
struct RowPrec<T, kBlock, K> {
  const T* p;  // row-major K×K
  // Optional coefficient rows (prepare_row): pat[j] = P_aa and, for o = 1..K−1,
  // pat[o·d + j] = P_{a,a+o} + P_{a+o,a} (a = j mod K; 0 where a+o leaves the block), so that
  // uᵀPu = Σ_j u_j (pat[j] u_j + Σ_o pat[o·d+j] u_{j+o}) runs over contiguous, shifted loads
  // and vectorizes; the per-block form below gathers with stride K and does not.
  const T* pat = nullptr;
  static void build_pattern(const T* p, int64_t d, T* pat) {
    for (int64_t j = 0; j < d; ++j) {
      const int a = static_cast<int>(j % K);
      pat[j] = p[a * K + a];
      for (int o = 1; o < K; ++o) pat[o * d + j] = a + o < K ? p[a * K + a + o] + p[(a + o) * K + a] : T(0);
    }
  }
  template <typename X>
  T quad_pattern(const T* y, const X* x, const T* h, int64_t d, T* hu_out) const {
    T acc = 0, dot = 0;
    const int64_t jmax = d - (K - 1);  // j + o < d for every offset o < K
#pragma omp simd reduction(+ : acc, dot)
    for (int64_t j = 0; j < jmax; ++j) {
      const T uj = y[j] - widen<T>(x[j]);
      T sj = pat[j] * uj;
#pragma GCC unroll 4
      for (int o = 1; o < K; ++o) sj += pat[o * d + j] * (y[j + o] - widen<T>(x[j + o]));
      acc += uj * sj;
      if (h) dot += h[j] * uj;
    }
    for (int64_t j = jmax < 0 ? 0 : jmax; j < d; ++j) {  // tail: out-of-row offsets have coefficient 0
      const T uj = y[j] - widen<T>(x[j]);
      T sj = pat[j] * uj;
      for (int o = 1; j + o < d; ++o) sj += pat[o * d + j] * (y[j + o] - widen<T>(x[j + o]));
      acc += uj * sj;
      if (h) dot += h[j] * uj;
    }
    if (hu_out) *hu_out = dot;
    return acc;
  }
  template <typename X>
  T quad(const T* y, const X* x, int64_t d) const {
    if (pat) return quad_pattern(y, x, nullptr, d, nullptr);
    T acc = 0;
    const int64_t nb = d / K;
#pragma omp simd reduction(+ : acc)
    for (int64_t t = 0; t < nb; ++t) {
      T u[K];
      for (int a = 0; a < K; ++a) u[a] = y[t * K + a] - widen<T>(x[t * K + a]);
      for (int a = 0; a < K; ++a)
        for (int b = 0; b < K; ++b) acc += u[a] * p[a * K + b] * u[b];
    }
    return acc;
  }
  template <typename X>
  void quad_dot(const T* y, const X* x, const T* h, int64_t d, T& q, T& hu) const {
    if (pat) {
      q = quad_pattern(y, x, h, d, &hu);
      return;
    }
    T acc = 0, dot = 0;
    const int64_t nb = d / K;
#pragma omp simd reduction(+ : acc, dot)
    for (int64_t t = 0; t < nb; ++t) {
      T u[K];
      for (int a = 0; a < K; ++a) u[a] = y[t * K + a] - widen<T>(x[t * K + a]);
      for (int a = 0; a < K; ++a) {
        dot += h[t * K + a] * u[a];
        for (int b = 0; b < K; ++b) acc += u[a] * p[a * K + b] * u[b];
      }
    }
    q = acc;
    hu = dot;
  }
  void apply(const T* v, T scale, T* out, int64_t d) const {
    const int64_t nb = d / K;
    for (int64_t t = 0; t < nb; ++t)
      for (int a = 0; a < K; ++a) {
        T acc = 0;
        for (int b = 0; b < K; ++b) acc += p[a * K + b] * v[t * K + b];
        out[t * K + a] = scale * acc;
      }
  }
  template <typename X>
  void grad_u(const T* y, const X* x, const T* h, T a_, T c, T* gy, T* gx, int64_t d) const {
    if (gx)
      grad_u_impl<true, X>(y, x, h, a_, c, gy, gx, d);
    else
      grad_u_impl<false, X>(y, x, h, a_, c, gy, gx, d);
  }
  template <bool WITH_X, typename X>
  void grad_u_impl(const T* y, const X* x, const T* h, T a_, T c, T* gy, T* gx, int64_t d) const {
    const int64_t nb = d / K;
    T pk[K * K];
    for (int e = 0; e < K * K; ++e) pk[e] = c * p[e];
#pragma omp simd
    for (int64_t t = 0; t < nb; ++t) {
      T u[K];
#pragma GCC unroll 4
      for (int a = 0; a < K; ++a) u[a] = y[t * K + a] - widen<T>(x[t * K + a]);
#pragma GCC unroll 4
      for (int a = 0; a < K; ++a) {
        T g = a_ * h[t * K + a];
#pragma GCC unroll 4
        for (int b = 0; b < K; ++b) g += pk[a * K + b] * u[b];
        gy[t * K + a] += g;
        if (WITH_X) gx[t * K + a] = -g;
      }
    }
  }
  template <typename X>
  void accum_outer(const T* y, const X* x, T c, T* gp, int64_t d) const {
    T acc[K * K] = {};
    const int64_t nb = d / K;
    for (int64_t t = 0; t < nb; ++t) {
      T u[K];
      for (int a = 0; a < K; ++a) u[a] = y[t * K + a] - widen<T>(x[t * K + a]);
      for (int a = 0; a < K; ++a)
        for (int b = 0; b < K; ++b) acc[a * K + b] += u[a] * u[b];
    }
    for (int e = 0; e < K * K; ++e) gp[e] += c * acc[e];
  }
  void accum_outer2(const T* va, const T* vb, T c, T* gp, int64_t d) const {
    const int64_t nb = d / K;
    for (int64_t t = 0; t < nb; ++t)
      for (int a = 0; a < K; ++a)
        for (int b = 0; b < K; ++b) gp[a * K + b] += c * va[t * K + a] * vb[t * K + b];
  }
  void quad_soa(const T* ut, int64_t ld, int64_t n, int64_t d, T* q) const {
    for (int64_t t = 0; t < n; ++t) q[t] = 0;
    for (int64_t blk = 0; blk < d / K; ++blk)
      for (int a = 0; a < K; ++a)
        for (int b = 0; b < K; ++b) {
          const T* ua = ut + (blk * K + a) * ld;
          const T* ub = ut + (blk * K + b) * ld;
          const T pab = p[a * K + b];
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) q[t] += pab * ua[t] * ub[t];
        }
  }
  static constexpr int64_t param_size(int64_t) { return K * K; }
};

// Per-row set-up before the draw loop: block metrics with large d get their coefficient rows
// (K·d numbers in buf); isotropic and diagonal metrics need none.
template <typename T, int KIND, int K>
inline void prepare_row(RowPrec<T, KIND, K>&, std::vector<T>&, int64_t) {}

template <typename T, int K>
inline void prepare_row(RowPrec<T, kBlock, K>& P, std::vector<T>& buf, int64_t d) {
  if (K == 1 || d < 8 * K) return;  // small d: the per-block loop (or the SoA tile path) is fine
  buf.resize(static_cast<size_t>(K) * d);
  RowPrec<T, kBlock, K>::build_pattern(P.p, d, buf.data());
  P.pat = buf.data();
}

// Calls f(RowPrec-typed tag) for the kind/block size given at run time.
#define ET_DISPATCH_METRIC(KIND_, KBLOCK_, T_, ...)                                   \
  [&] {                                                                               \
    switch (KIND_) {                                                                  \
      case ::etweedie::kIsotropic: {                                                  \
        using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kIsotropic, 0>;         \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      case ::etweedie::kDiagonal: {                                                   \
        using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kDiagonal, 0>;          \
        return __VA_ARGS__();                                                         \
      }                                                                               \
      default:                                                                        \
        switch (KBLOCK_) {                                                            \
          case 1: {                                                                   \
            using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kBlock, 1>;         \
            return __VA_ARGS__();                                                     \
          }                                                                           \
          case 2: {                                                                   \
            using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kBlock, 2>;         \
            return __VA_ARGS__();                                                     \
          }                                                                           \
          case 3: {                                                                   \
            using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kBlock, 3>;         \
            return __VA_ARGS__();                                                     \
          }                                                                           \
          default: {                                                                  \
            using Prec = ::etweedie::cpu::RowPrec<T_, ::etweedie::kBlock, 4>;         \
            return __VA_ARGS__();                                                     \
          }                                                                           \
        }                                                                             \
    }                                                                                 \
  }()

// ------------------------------------------------------------------------- whitening

// o = (x − c)·M blockwise for one point (c may be null), compile-time block size K.
template <typename T, int K>
inline void block_apply(const T* x, const T* c, const T* M, T* o, int64_t d) {
  for (int64_t blk = 0; blk < d / K; ++blk) {
    T u[K];
#pragma GCC unroll 4
    for (int a = 0; a < K; ++a) u[a] = x[blk * K + a] - (c ? c[blk * K + a] : T(0));
#pragma GCC unroll 4
    for (int j = 0; j < K; ++j) {
      T acc = 0;
#pragma GCC unroll 4
      for (int a = 0; a < K; ++a) acc += u[a] * M[a * K + j];
      o[blk * K + j] = acc;
    }
  }
}

// o = (x − c)·M for one point: M the diagonal scale (K = 0, d values) or a K×K block applied
// blockwise (row-major, K ≤ 4); c may be null; o may be x (in place: each block is read before
// it is written).  The whitening of the energy ops (energy_cpu.h, energy_gram_cpu.h).
template <typename T>
inline void whiten_point(const T* x, const T* c, const T* M, int64_t K, int64_t d, T* o) {
  switch (K) {
    case 0:
      if (c) {
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) o[k] = (x[k] - c[k]) * M[k];
      } else {
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) o[k] = x[k] * M[k];
      }
      break;
    case 1: block_apply<T, 1>(x, c, M, o, d); break;
    case 2: block_apply<T, 2>(x, c, M, o, d); break;
    case 3: block_apply<T, 3>(x, c, M, o, d); break;
    default: block_apply<T, 4>(x, c, M, o, d); break;
  }
}

}  // namespace cpu
}  // namespace etweedie
