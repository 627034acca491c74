// CUDA pair engine of energy_score_cuda.cu and energy_distance_cuda.cu.  Per-pair math:
// csrc/common/energy.h (HOST_DEVICE, shared with the CPU kernels).
//
// Both losses are weighted pair sums per row r,
//   V_r = w_cross Σ_{i,j} E(a_i − c_j) + w_a Σ_{i<j} E(a_i − a_j) + w_c Σ_{i<j} E(c_i − c_j),
// with E(u) = (uᵀPu)^{β/2} for the row's metric P (metric_cuda.cuh: isotropic p·I, diagonal, or
// a k×k block repeated along d, k ≤ 4), applied in the kernels: the differences u are formed
// from the raw coordinates, so coincident points give exactly 0 and clouds far from the origin
// lose no precision (no whitening pass, no centring, no Gram form).  The gradient of a point is
// P Σ_j c_ij (x_i − x_j): P is applied once per point and coordinate block, after the sum.
//
// A launch takes one cloud as the "own" cloud; one block of kThreads threads per (row, own
// tile).  The block pairs its tile with every tile of the other cloud (cross pairs) and with
// its own cloud's tiles (within pairs): all of them, ordered, when gradients are wanted — each
// own point's gradient Σ_j w·slope·p·(x_i − x_j) is then summed by the block that owns it, so
// there are no atomics and no races — or, for the value alone, the circulant half I, I+1, …,
// I+h (mod nb), which forms each unordered pair once with equal work per block.  A second
// launch with the clouds swapped gives the second cloud's gradients (and its within pairs).
//   small d (D = d ≤ 4, compile time): one own point per thread, coordinates and the row's
//     metric in registers; the other cloud is staged through shared memory in tiles of
//     kThreads points (SoA) and read as broadcasts — the n-body pattern; the gradient stays in
//     registers.
//   large d: own and other tiles of kBig = 32 points, coordinates staged through shared
//     memory in chunks of whole metric blocks (kChunk = 32 coordinates, 30 for k = 3; a
//     diagonal metric's chunk of precisions alongside); each thread forms a 2×4 register block
//     of the 32×32 pair distances; the pair coefficients go to shared memory and a second sweep
//     over the chunks adds P Σ_j c_ij (x_i − x_j) over one metric block per thread and step to
//     the own tile's gradient rows in global memory (zero-initialized by the caller; only this
//     block touches them; __syncthreads between).
// Rows whose clouds hold at most 64 points together (energy_score's training shape) take
// coordinate-split kernels instead (the section "small clouds, large d" below).
// Value and ∂/∂β sums are kept per block as (cross, within) float64 partials in a workspace;
// a final kernel applies the weights in float64 (the energy distance is a small difference of
// large sums) and the upstream gradient.  Memory: O((n + m)·d) + O(B · tiles) doubles.
// Indexing is int64.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "../common/energy.h"
#include "launchers.cuh"
#include "metric_cuda.cuh"

namespace etweedie {
namespace cuda {

constexpr int kBig = 32;     // points per tile, large d
constexpr int kChunk = 32;   // coordinates per shared-memory chunk, large d
constexpr int kSmallMaxD = 4;
// __launch_bounds__(kThreads, kEnergyMinBlocks): as for et_score (et_score_cuda.cuh), without a
// minimum-blocks hint ptxas (CUDA 13) capped the float large-d kernel at 64–72 registers and
// spilled; 4 resident blocks of 128 threads allow up to 128 registers.
constexpr int kEnergyMinBlocks = 4;

inline int64_t energy_tile(int64_t d) { return d <= kSmallMaxD ? kThreads : kBig; }
inline int64_t energy_tiles(int64_t n, int64_t d) { return (n + energy_tile(d) - 1) / energy_tile(d); }

// One launch: own cloud `own` (n_own points), other cloud `oth`.
template <typename T>
struct PairLaunch {
  const T* own;
  const T* oth;
  const T* beta;
  const T* p;     // the row's metric parameters (B, *param), row stride sp (metric_cuda.cuh)
  const T* grad;  // (B,) upstream gradient, null = 1
  int64_t B, n_own, n_oth, d, nt;
  int64_t so_b, so_n, st_b, st_n, sb, sp, sg;
  T w_cross, w_within;  // gradient weights (the value's weights are applied in float64 later)
  int cross;            // 0 none, 1 counted in value/β (and gradient), 2 gradient only
  bool within;          // within pairs wanted (w_within != 0 and n_own > 1)
  bool within_all;      // ordered within pairs over every tile (gradients) vs circulant half
  bool need_value, need_beta;
  double* part;  // (B, nt, 4): Σ E cross, Σ E within, Σ ∂E/∂β cross, Σ ∂E/∂β within
  T* gown;       // (B, n_own, d) contiguous, zero-filled; null = no gradient
};

template <typename T>
struct Sums2 {
  T e, b;  // Σ E and Σ ∂E/∂β over one tile of pairs
};

// circulant share of tile I among nb tiles: tiles I..I+h (mod nb)
__device__ __forceinline__ int64_t circulant_h(int64_t I, int64_t nb) {
  return (nb % 2) ? (nb - 1) / 2 : (I < nb / 2 ? nb / 2 : nb / 2 - 1);
}

template <typename T>
__device__ __forceinline__ void store_partials(const PairLaunch<T>& a, int64_t unit, double ce, double we, double cb,
                                               double wb, double* scratch) {
  ce = block_sum(ce, scratch);
  we = block_sum(we, scratch);
  cb = block_sum(cb, scratch);
  wb = block_sum(wb, scratch);
  if (threadIdx.x == 0) {
    double* o = a.part + unit * 4;
    o[0] = ce;
    o[1] = we;
    o[2] = cb;
    o[3] = wb;
  }
}

// The pair schedule both kernels follow for their unit (row r, tile I of `own`, tiles `width`
// points wide): the cross tiles against `oth`, then the within tiles — all of them when the
// backward needs every ordered pair (within_all), else tiles I..I+h (mod nb), the circulant half
// that forms each unordered pair once — with the sums' weights (ordered pairs count ½); then the
// block's partial sums are stored.  tile(src, stride, j0, n, coef, grad, sums) -> Sums2 does one
// tile.
template <typename T, typename Tile>
__device__ __forceinline__ void visit_pair_tiles(const PairLaunch<T>& a, int64_t unit, int64_t I, int64_t width,
                                                 const T* own, const T* oth, T g, double* scratch, Tile&& tile) {
  double ce = 0, we = 0, cb = 0, wb = 0;
  const bool sums = a.need_value || a.need_beta;
  if (a.cross != 0) {
    for (int64_t j0 = 0; j0 < a.n_oth; j0 += width) {
      const Sums2<T> t = tile(oth, a.st_n, j0, a.n_oth, g * a.w_cross, true, sums && a.cross == 1);
      ce += static_cast<double>(t.e);
      cb += static_cast<double>(t.b);
    }
  }
  if (a.within) {
    const int64_t nb = a.nt;
    if (a.within_all) {
      for (int64_t J = 0; J < nb; ++J) {
        const Sums2<T> t = tile(own, a.so_n, J * width, a.n_own, g * a.w_within, true, sums);
        we += 0.5 * static_cast<double>(t.e);  // ordered pairs: each unordered pair twice
        wb += 0.5 * static_cast<double>(t.b);
      }
    } else {
      const int64_t h = circulant_h(I, nb);
      for (int64_t s = 0; s <= h; ++s) {
        const Sums2<T> t = tile(own, a.so_n, (I + s) % nb * width, a.n_own, T(0), false, sums);
        const double fac = s == 0 ? 0.5 : 1.0;  // the diagonal tile holds ordered pairs
        we += fac * static_cast<double>(t.e);
        wb += fac * static_cast<double>(t.b);
      }
    }
  }
  if (sums) store_partials(a, unit, ce, we, cb, wb, scratch);
}

// ----------------------------------------------------------------------------- the row's metric

// Parameters of the row's metric held in registers: p (isotropic), the D precisions of a
// small-d diagonal metric (large d stages its diagonal per chunk), or the K×K block.
template <int KIND, int K, int D>
constexpr int kPairMetricRegs = KIND == kIsotropic ? 1 : KIND == kDiagonal ? D : K * K;

// uᵀ P u over the N coordinates of u (whole metric blocks, in registers): RowPrec applies P.
template <int N, typename T, int KIND, int K>
__device__ __forceinline__ T quad_form(const RowPrec<T, KIND, K>& P, const T* u) {
  T q = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) q += u[j] * P.apply_at(j, [u](int64_t c) { return u[c]; });
  return q;
}

// ----------------------------------------------------------------------------- small d

template <typename T, int D, int KIND, int K, bool GRAD>
__global__ void __launch_bounds__(kThreads, kEnergyMinBlocks) energy_small_kernel(PairLaunch<T> a) {
  static_assert(D % K == 0, "the metric block must divide d");
  __shared__ T sx[D][kThreads];
  __shared__ double scratch[kWarps];
  const int64_t unit = blockIdx.x;
  const int64_t r = unit / a.nt, I = unit % a.nt;
  const T* __restrict__ own = a.own + r * a.so_b;
  const T* __restrict__ oth = a.oth + r * a.st_b;
  const T beta = a.beta[r * a.sb];
  constexpr int kRegs = kPairMetricRegs<KIND, K, D>;
  T pm[kRegs];
#pragma unroll
  for (int e = 0; e < kRegs; ++e) pm[e] = a.p[r * a.sp + e];
  // the isotropic p multiplies q and the slope once per pair, not each coordinate
  const T piso = KIND == kIsotropic ? pm[0] : T(1);
  const RowPrec<T, KIND, K> P{pm};
  const T g = a.grad ? a.grad[r * a.sg] : T(1);
  const int64_t i = I * kThreads + threadIdx.x;
  const bool valid = i < a.n_own;
  T xi[D], acc[D];
#pragma unroll
  for (int k = 0; k < D; ++k) {
    xi[k] = valid ? own[i * a.so_n + k] : T(0);
    acc[k] = T(0);
  }
  // pairs of this thread's point with points [j0, j0 + kThreads) of `src`: (Σ E, Σ ∂E/∂β)
  auto tile = [&](const T* __restrict__ src, int64_t sn, int64_t j0, int64_t n, T coef, bool grad, bool sums) {
    __syncthreads();  // the previous tile is consumed
    const int64_t j = j0 + threadIdx.x;
#pragma unroll
    for (int k = 0; k < D; ++k) sx[k][threadIdx.x] = j < n ? src[j * sn + k] : T(0);
    __syncthreads();
    const int cnt = static_cast<int>(n - j0 < kThreads ? n - j0 : kThreads);
    T es = 0, bs = 0;
    if (!valid) return Sums2<T>{es, bs};
    const T cp = coef * piso;
    for (int t = 0; t < cnt; ++t) {
      T u[D], pu[D], q = 0;
#pragma unroll
      for (int k = 0; k < D; ++k) u[k] = xi[k] - sx[k][t];
#pragma unroll
      for (int k = 0; k < D; ++k) {
        pu[k] = KIND == kIsotropic ? u[k] : P.apply_at(k, [&u](int64_t c) { return u[c]; });
        q += u[k] * pu[k];
      }
      q *= piso;
      if (sums) {
        const T e = pair_energy(q, beta);
        if (a.need_value) es += e;
        if (a.need_beta) bs += pair_energy_dbeta(q, e);
      }
      if (GRAD && grad) {
        const T c = pair_energy_slope(q, beta) * cp;
#pragma unroll
        for (int k = 0; k < D; ++k) acc[k] += c * pu[k];
      }
    }
    return Sums2<T>{es, bs};
  };
  visit_pair_tiles(a, unit, I, kThreads, own, oth, g, scratch, tile);
  if (GRAD && a.gown && valid) {
#pragma unroll
    for (int k = 0; k < D; ++k) a.gown[(r * a.n_own + i) * D + k] = acc[k];
  }
}

// ----------------------------------------------------------------------------- large d

// A double 3×3 or 4×4 block needs more than 128 registers (ptxas spilled at that cap): those
// kernels allow 255 (2 resident blocks per SM).
template <typename T, int KIND, int K>
constexpr int kEnergyLargeMinBlocks = KIND == kBlock && sizeof(T) == 8 && K > 2 ? 2 : kEnergyMinBlocks;

template <typename T, int KIND, int K, bool GRAD>
__global__ void __launch_bounds__(kThreads, (kEnergyLargeMinBlocks<T, KIND, K>)) energy_large_kernel(PairLaunch<T> a) {
  constexpr int kW = kChunk / K * K;  // coordinates per chunk: whole metric blocks
  constexpr int kBlocksPerChunk = kW / K;
  __shared__ T so[kBig][kChunk + 1];
  __shared__ T st[kBig][kChunk + 1];
  __shared__ T cs[kBig][kBig + 1];
  __shared__ T spc[KIND == kDiagonal ? kChunk : 1];  // a diagonal metric's precisions of the chunk
  __shared__ double scratch[kWarps];
  const int64_t unit = blockIdx.x;
  const int64_t r = unit / a.nt, I = unit % a.nt;
  const int64_t d = a.d;
  const T* __restrict__ own = a.own + r * a.so_b;
  const T* __restrict__ oth = a.oth + r * a.st_b;
  const T* __restrict__ prow = a.p + r * a.sp;
  const T beta = a.beta[r * a.sb];
  // the isotropic p or the K×K block in registers (a diagonal is staged per chunk: spc)
  constexpr int kRegs = KIND == kBlock ? K * K : 1;
  T pkr[kRegs];
#pragma unroll
  for (int e = 0; e < kRegs; ++e) pkr[e] = KIND == kDiagonal ? T(1) : prow[e];
  const RowPrec<T, kBlock, K> Pk{pkr};  // used for KIND == kBlock only
  const T piso = KIND == kIsotropic ? pkr[0] : T(1);
  const T g = a.grad ? a.grad[r * a.sg] : T(1);
  const int64_t i0 = I * kBig;
  const int tid = threadIdx.x;
  const int ti = tid / 8, tj = tid % 8;  // rows 2ti, 2ti+1; columns tj + 8m, m < 4

  // stage columns [c0, c0 + kW) of own rows i0.. and src rows j0.. (zeros outside)
  auto stage = [&](const T* __restrict__ src, int64_t sn, int64_t j0, int64_t n, int64_t c0) {
    __syncthreads();
    for (int e = tid; e < kBig * kW; e += kThreads) {
      const int row = e / kW, col = e % kW;
      const int64_t c = c0 + col;
      so[row][col] = (i0 + row < a.n_own && c < d) ? own[(i0 + row) * a.so_n + c] : T(0);
      st[row][col] = (j0 + row < n && c < d) ? src[(j0 + row) * sn + c] : T(0);
    }
    if constexpr (KIND == kDiagonal) {
      if (tid < kW) spc[tid] = c0 + tid < d ? prow[c0 + tid] : T(0);
    }
    __syncthreads();
  };

  auto tile = [&](const T* __restrict__ src, int64_t sn, int64_t j0, int64_t n, T coef, bool grad, bool sums) {
    T q[2][4] = {};
    for (int64_t c0 = 0; c0 < d; c0 += kW) {
      stage(src, sn, j0, n, c0);
      if constexpr (KIND == kBlock && K > 1) {
#pragma unroll 2
        for (int k = 0; k < kW; k += K) {
          T x0[K], x1[K];
#pragma unroll
          for (int l = 0; l < K; ++l) {
            x0[l] = so[2 * ti][k + l];
            x1[l] = so[2 * ti + 1][k + l];
          }
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            T u0[K], u1[K];
#pragma unroll
            for (int l = 0; l < K; ++l) {
              const T y = st[tj + 8 * mm][k + l];
              u0[l] = x0[l] - y;
              u1[l] = x1[l] - y;
            }
            q[0][mm] += quad_form<K>(Pk, u0);
            q[1][mm] += quad_form<K>(Pk, u1);
          }
        }
      } else {
#pragma unroll 4
        for (int k = 0; k < kW; ++k) {
          const T x0 = so[2 * ti][k], x1 = so[2 * ti + 1][k];
          const T w = KIND == kDiagonal ? spc[k] : T(1);
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            const T y = st[tj + 8 * mm][k];
            const T u0 = x0 - y, u1 = x1 - y;
            if constexpr (KIND == kDiagonal) {
              q[0][mm] += w * (u0 * u0);
              q[1][mm] += w * (u1 * u1);
            } else {
              q[0][mm] += u0 * u0;
              q[1][mm] += u1 * u1;
            }
          }
        }
      }
    }
    T es = 0, bs = 0;
    const T cp = coef * piso;
#pragma unroll
    for (int ll = 0; ll < 2; ++ll) {
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int row = 2 * ti + ll, col = tj + 8 * mm;
        const bool ok = i0 + row < a.n_own && j0 + col < n;
        const T qq = q[ll][mm] * piso;
        if (sums && ok) {
          const T e = pair_energy(qq, beta);
          if (a.need_value) es += e;
          if (a.need_beta) bs += pair_energy_dbeta(qq, e);
        }
        if (GRAD && grad) cs[row][col] = ok ? pair_energy_slope(qq, beta) * cp : T(0);
      }
    }
    if constexpr (GRAD) {
      if (grad) {
        // gradient rows of the own tile: P Σ_j c_ij (x_i − x_j) over one metric block (i, b) per
        // thread and step
        for (int64_t c0 = 0; c0 < d; c0 += kW) {
          stage(src, sn, j0, n, c0);  // its leading __syncthreads also publishes cs
          for (int e = tid; e < kBig * kBlocksPerChunk; e += kThreads) {
            const int row = e / kBlocksPerChunk, col = e % kBlocksPerChunk * K;
            const int64_t i = i0 + row, c = c0 + col;
            if (i >= a.n_own || c >= d) continue;
            T s[K];
#pragma unroll
            for (int l = 0; l < K; ++l) {
              const T xv = so[row][col + l];
              T acc = 0;
#pragma unroll 8
              for (int jj = 0; jj < kBig; ++jj) acc += cs[row][jj] * (xv - st[jj][col + l]);
              s[l] = acc;
            }
            T* __restrict__ go = a.gown + (r * a.n_own + i) * d + c;
            if constexpr (KIND == kBlock && K > 1) {
#pragma unroll
              for (int l = 0; l < K; ++l) go[l] += Pk.apply_at(l, [&s](int64_t c) { return s[c]; });
            } else if constexpr (KIND == kDiagonal) {
              go[0] += spc[col] * s[0];
            } else {
              go[0] += s[0];
            }
          }
        }
      }
    }
    return Sums2<T>{es, bs};
  };

  visit_pair_tiles(a, unit, I, kBig, own, oth, g, scratch, tile);
}

// ----------------------------------------------------------------------------- small clouds, large d

// Rows whose two clouds hold at most kSplitMaxPoints points together (energy_score's training
// shape, M ≤ 63 samples and the target; small energy distances) at d > kSmallMaxD.  The tiled
// kernel above runs one block per (row, tile): at 256 × 32 × 784 that is 256 blocks, about two
// per SM of an H100, each stepping through 100 staged coordinate chunks (the pair kernel took
// 447 µs there, about 50× the time its samples take to load).  Here the coordinates are split
// over blocks instead, in three launches:
//   1. partial squared distances (grid B × chunks of kSplitQChunk coordinates): a block stages
//      its chunk of the row's n + m points and forms the chunk's share of q for every unordered
//      pair, in 4×4 register blocks over the upper triangle of the point × point matrix;
//      threads beyond the pair blocks take a share of the chunk's metric blocks, summed through
//      shared memory in a fixed order; the shares go to the workspace.
//   2. pair coefficients (grid B): q = Σ_chunks share (in double, in chunk order), the pair's
//      energy, ∂E/∂β and slope; the value and ∂/∂β sums in double per pair type (cross, within
//      a, within c) with the weights applied at the end (as energy_finish_kernel does); the
//      symmetric matrix C_pq = g·w·slope (·p, isotropic) to the workspace.
//   3. gradients (grid B × chunks of kSplitGChunk coordinates): g_p = P Σ_q C_pq (x_p − x_q),
//      one metric block of one point per thread, from direct differences (no Gram form:
//      clouds far from the origin keep their precision), stored, not added: every coordinate
//      of every wanted point is written once, so these gradients need no zero-fill.
// Every launch reads the points once; no atomics, so results are bitwise reproducible.
// ETWEEDIE_CUDA_ENERGY_SPLIT=0 in the environment keeps such rows on the tiled kernel (A/B
// timing in `make gpu-check`, bisecting).
constexpr int kSplitMaxPoints = 64;
template <typename T>
constexpr int kSplitQChunk = sizeof(T) == 4 ? 128 : 64;  // ≤ 33 KB of staged points either way
constexpr int kSplitGChunk = 64;

inline bool energy_split_enabled() {
  const char* flag = std::getenv("ETWEEDIE_CUDA_ENERGY_SPLIT");  // read per call: A/B timing in one process
  return flag == nullptr || flag[0] != '0';
}

inline bool energy_split_fits(int64_t n, int64_t m, int64_t d) {
  return d > kSmallMaxD && n >= 1 && m >= 1 && n + m <= kSplitMaxPoints;
}

// Chunks of `width` coordinates rounded down to whole metric blocks of size k.
inline int64_t split_chunks(int64_t d, int width, int k) {
  const int64_t w = width / k * k;
  return (d + w - 1) / w;
}

struct SplitShape {
  int64_t np, tiles, nblk, cq, cg;  // points, 4-point tiles, 4×4 pair blocks, chunks (q, gradient)
};

inline SplitShape split_shape(int64_t n, int64_t m, int64_t d, int64_t elem_bytes, int k) {
  SplitShape s{};
  s.np = n + m;
  s.tiles = (s.np + 3) / 4;
  s.nblk = s.tiles * (s.tiles + 1) / 2;
  s.cq = split_chunks(d, elem_bytes == 4 ? kSplitQChunk<float> : kSplitQChunk<double>, k);
  s.cg = split_chunks(d, kSplitGChunk, k);
  return s;
}

// Workspace of the split path in bytes: the chunk shares of q (B, cq, nblk, 16) and the
// coefficient matrices (B, np, np), elements of elem_bytes.
inline int64_t split_workspace_bytes(int64_t B, const SplitShape& s, int64_t elem_bytes) {
  return (B * s.cq * s.nblk * 16 + B * s.np * s.np) * elem_bytes;
}

template <typename T>
struct SplitLaunch {
  EnergyArgs<T> e;  // the clouds, β, the metric, the upstream gradient
  SplitShape sh;
  double w_cross, w_a, w_c;
  T* qpart;  // (B, cq, nblk, 16)
  T* coef;   // (B, np, np), null = no gradient wanted
  T* value;  // (B,), null = not wanted
  T* gbeta;  // (B,), null = not wanted
  T* ga;     // (B, n, d), null = not wanted
  T* gc;     // (B, m, d), null = not wanted
};

template <typename T>
__device__ __forceinline__ const T* split_point(const SplitLaunch<T>& s, int64_t r, int64_t p) {
  return p < s.e.n ? s.e.a + r * s.e.sab + p * s.e.san : s.e.c + r * s.e.scb + (p - s.e.n) * s.e.scn;
}

// Pair block `blk` of the upper triangle of a tiles × tiles grid, row-major: (bi, bj), bi ≤ bj.
__device__ __forceinline__ void split_pair_block(int64_t blk, int64_t tiles, int64_t& bi, int64_t& bj) {
  bi = 0;
  while (blk >= tiles - bi) {
    blk -= tiles - bi;
    ++bi;
  }
  bj = bi + blk;
}

// Stage coordinates [c0, c0 + w) of points [0, rows) into xs (row stride w + 1; zeros past d
// and for points ≥ np) and, for a diagonal metric, the chunk's precisions into spc.
template <typename T, int KIND>
__device__ __forceinline__ void split_stage(const SplitLaunch<T>& s, int64_t r, int64_t c0, int w, int64_t rows, T* xs,
                                            T* spc) {
  for (int64_t e = threadIdx.x; e < rows * w; e += kThreads) {
    const int64_t p = e / w, col = e % w, c = c0 + col;
    xs[p * (w + 1) + col] = (p < s.sh.np && c < s.e.d) ? split_point(s, r, p)[c] : T(0);
  }
  if constexpr (KIND == kDiagonal) {
    const T* prow = s.e.p + r * s.e.sp;
    for (int j = threadIdx.x; j < w; j += kThreads) spc[j] = c0 + j < s.e.d ? prow[c0 + j] : T(0);
  }
}

template <typename T, int KIND, int K>
__global__ void __launch_bounds__(kThreads) energy_split_q_kernel(SplitLaunch<T> s) {
  constexpr int W = kSplitQChunk<T> / K * K;
  constexpr int kRegs = KIND == kBlock ? K * K : 1;
  ET_DYNAMIC_SHARED(smem_raw);
  T* xs = reinterpret_cast<T*>(smem_raw);  // 4·tiles × (W + 1) staged points, then the slices' shares
  __shared__ T spc[KIND == kDiagonal ? W : 1];
  const int64_t r = blockIdx.x / s.sh.cq, ch = blockIdx.x % s.sh.cq;
  const int64_t nblk = s.sh.nblk, tiles = s.sh.tiles;
  T pkr[kRegs];
#pragma unroll
  for (int e = 0; e < kRegs; ++e) pkr[e] = KIND == kBlock ? s.e.p[r * s.e.sp + e] : T(1);
  const RowPrec<T, kBlock, K> Pk{pkr};  // KIND == kBlock only
  split_stage<T, KIND>(s, r, ch * W, W, 4 * tiles, xs, spc);
  __syncthreads();
  // the chunk's share of q for the 4×4 pairs of block blk, over metric blocks slice, slice +
  // slices, … of the chunk
  auto pairs = [&](int64_t blk, int slice, int slices, T (&q)[4][4]) {
    int64_t bi, bj;
    split_pair_block(blk, tiles, bi, bj);
    const T* xi = xs + 4 * bi * (W + 1);
    const T* xj = xs + 4 * bj * (W + 1);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) q[l][mm] = T(0);
    }
    for (int k = slice * K; k < W; k += slices * K) {
      if constexpr (KIND == kBlock && K > 1) {
        T xr[4][K], xc[4][K];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
#pragma unroll
          for (int b = 0; b < K; ++b) {
            xr[l][b] = xi[l * (W + 1) + k + b];
            xc[l][b] = xj[l * (W + 1) + k + b];
          }
        }
#pragma unroll
        for (int l = 0; l < 4; ++l) {
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            T u[K];
#pragma unroll
            for (int b = 0; b < K; ++b) u[b] = xr[l][b] - xc[mm][b];
            q[l][mm] += quad_form<K>(Pk, u);
          }
        }
      } else {
        T xr[4], xc[4];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
          xr[l] = xi[l * (W + 1) + k];
          xc[l] = xj[l * (W + 1) + k];
        }
        const T w = KIND == kDiagonal ? spc[k] : T(1);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            const T u = xr[l] - xc[mm];
            q[l][mm] += KIND == kDiagonal ? w * (u * u) : u * u;
          }
        }
      }
    }
  };
  T* out = s.qpart + (r * s.sh.cq + ch) * nblk * 16;
  const int slices = 2 * nblk <= kThreads ? static_cast<int>(kThreads / nblk) : 1;  // uniform over the block
  if (slices == 1) {
    for (int64_t blk = threadIdx.x; blk < nblk; blk += kThreads) {
      T q[4][4];
      pairs(blk, 0, 1, q);
#pragma unroll
      for (int e = 0; e < 16; ++e) out[blk * 16 + e] = q[e / 4][e % 4];
    }
    return;
  }
  const int64_t tid = threadIdx.x;
  const bool active = tid < nblk * slices;
  T q[4][4];
  if (active) pairs(tid % nblk, static_cast<int>(tid / nblk), slices, q);
  __syncthreads();  // every thread is done with the staged points: xs now holds the shares
  if (active) {
#pragma unroll
    for (int e = 0; e < 16; ++e) xs[tid * 16 + e] = q[e / 4][e % 4];  // (slice, blk, 16)
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < nblk * 16; e += kThreads) {
    T v = 0;
    for (int sl = 0; sl < slices; ++sl) v += xs[sl * nblk * 16 + e];
    out[e] = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) energy_split_coef_kernel(SplitLaunch<T> s, bool iso) {
  __shared__ double scratch[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t np = s.sh.np, nblk = s.sh.nblk, cq = s.sh.cq;
  const T beta = s.e.beta[r * s.e.sb];
  const T piso = iso ? s.e.p[r * s.e.sp] : T(1);
  const T g = s.e.grad ? s.e.grad[r * s.e.sg] : T(1);
  const bool need_e = s.value != nullptr, need_b = s.gbeta != nullptr;
  const T* part = s.qpart + r * cq * nblk * 16;
  T* cf = s.coef ? s.coef + r * np * np : nullptr;
  double se[3] = {0, 0, 0}, sb[3] = {0, 0, 0};  // Σ E, Σ ∂E/∂β: cross, within a, within c
  const double wt[3] = {s.w_cross, s.w_a, s.w_c};
  for (int64_t e = threadIdx.x; e < nblk * 16; e += kThreads) {
    int64_t bi, bj;
    split_pair_block(e / 16, s.sh.tiles, bi, bj);
    const int64_t p = 4 * bi + (e % 16) / 4, q = 4 * bj + e % 4;
    if (p > q || q >= np) continue;  // the lower half of a diagonal block, padding
    if (p == q) {
      if (cf) cf[p * np + p] = T(0);
      continue;
    }
    const int type = (p < s.e.n) == (q < s.e.n) ? (p < s.e.n ? 1 : 2) : 0;
    T c = 0;
    if (wt[type] != 0.0) {
      double qs = 0;
      for (int64_t ch = 0; ch < cq; ++ch) qs += static_cast<double>(part[ch * nblk * 16 + e]);
      const T qq = static_cast<T>(qs) * piso;
      if (need_e || need_b) {
        const T en = pair_energy(qq, beta);
        se[type] += static_cast<double>(en);
        if (need_b) sb[type] += static_cast<double>(pair_energy_dbeta(qq, en));
      }
      if (cf) c = pair_energy_slope(qq, beta) * (static_cast<T>(wt[type]) * g) * piso;
    }
    if (cf) {
      cf[p * np + q] = c;
      cf[q * np + p] = c;
    }
  }
  if (need_e || need_b) {
    double v = 0, b = 0;
    for (int t = 0; t < 3; ++t) {
      const double et = block_sum(se[t], scratch), bt = block_sum(sb[t], scratch);
      v += wt[t] * et;
      b += wt[t] * bt;
    }
    if (threadIdx.x == 0) {
      if (s.value) s.value[r] = static_cast<T>(v);
      if (s.gbeta) s.gbeta[r] = static_cast<T>(b * static_cast<double>(g));
    }
  }
}

template <typename T, int KIND, int K>
__global__ void __launch_bounds__(kThreads) energy_split_grad_kernel(SplitLaunch<T> s) {
  constexpr int W = kSplitGChunk / K * K, NKB = W / K;
  constexpr int kRegs = KIND == kBlock ? K * K : 1;
  ET_DYNAMIC_SHARED(smem_raw);
  T* xs = reinterpret_cast<T*>(smem_raw);  // np × (W + 1)
  __shared__ T spc[KIND == kDiagonal ? W : 1];
  const int64_t r = blockIdx.x / s.sh.cg, ch = blockIdx.x % s.sh.cg;
  const int64_t np = s.sh.np, c0 = ch * W;
  T pkr[kRegs];
#pragma unroll
  for (int e = 0; e < kRegs; ++e) pkr[e] = KIND == kBlock ? s.e.p[r * s.e.sp + e] : T(1);
  const RowPrec<T, kBlock, K> Pk{pkr};
  split_stage<T, KIND>(s, r, c0, W, np, xs, spc);
  __syncthreads();
  const T* __restrict__ cf = s.coef + r * np * np;
  const int64_t p_lo = s.ga ? 0 : s.e.n, p_hi = s.gc ? np : s.e.n;
  for (int64_t e = threadIdx.x; e < (p_hi - p_lo) * NKB; e += kThreads) {
    const int64_t p = p_lo + e / NKB;
    const int col = static_cast<int>(e % NKB) * K;
    const int64_t c = c0 + col;
    if (c >= s.e.d) continue;
    T xp[K], acc[K];
#pragma unroll
    for (int b = 0; b < K; ++b) {
      xp[b] = xs[p * (W + 1) + col + b];
      acc[b] = T(0);
    }
    const T* cp = cf + p * np;
    for (int64_t q = 0; q < np; ++q) {
      const T w = cp[q];
#pragma unroll
      for (int b = 0; b < K; ++b) acc[b] += w * (xp[b] - xs[q * (W + 1) + col + b]);
    }
    T* __restrict__ go = p < s.e.n ? s.ga + (r * s.e.n + p) * s.e.d + c : s.gc + (r * s.e.m + (p - s.e.n)) * s.e.d + c;
    if constexpr (KIND == kBlock && K > 1) {
#pragma unroll
      for (int b = 0; b < K; ++b) go[b] = Pk.apply_at(b, [&acc](int64_t j) { return acc[j]; });
    } else if constexpr (KIND == kDiagonal) {
      go[0] = spc[col] * acc[0];
    } else {
      go[0] = acc[0];
    }
  }
}

// The three launches for weights (w_cross, w_a, w_c); gradients stored, not added.
template <typename T>
cudaError_t energy_split_run(const EnergyArgs<T>& e, double w_cross, double w_a, double w_c, T* value, T* ga, T* gc,
                             T* gbeta, double* workspace, cudaStream_t stream) {
  if (!energy_split_fits(e.n, e.m, e.d)) return cudaErrorInvalidValue;
  SplitLaunch<T> s{};
  s.e = e;
  const int kb = e.kind == kBlock ? e.kblock : 1;
  s.sh = split_shape(e.n, e.m, e.d, static_cast<int64_t>(sizeof(T)), kb);
  s.w_cross = w_cross;
  s.w_a = e.n > 1 ? w_a : 0.0;
  s.w_c = e.m > 1 ? w_c : 0.0;
  const bool grads = ga != nullptr || gc != nullptr;
  s.qpart = reinterpret_cast<T*>(workspace);
  s.coef = grads ? s.qpart + e.B * s.sh.cq * s.sh.nblk * 16 : nullptr;
  s.value = value;
  s.gbeta = gbeta;
  s.ga = ga;
  s.gc = gc;
  if (e.B * s.sh.cq > 0x7fffffffLL || e.B * s.sh.cg > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const bool iso = e.kind == kIsotropic || (e.kind == kBlock && e.kblock == 1);
  return dispatch_metric(e.kind, e.kblock, [&](auto kind_c, auto k_c) -> cudaError_t {
    constexpr int K = decltype(k_c)::value;
    constexpr int KIND = decltype(kind_c)::value == kBlock && K == 1 ? kIsotropic : decltype(kind_c)::value;
    constexpr int WQ = kSplitQChunk<T> / K * K, WG = kSplitGChunk / K * K;
    const int64_t rows_q = 4 * s.sh.tiles;
    const size_t smem_q = static_cast<size_t>(
        (rows_q * (WQ + 1) > kThreads * 16 ? rows_q * (WQ + 1) : kThreads * 16) * static_cast<int64_t>(sizeof(T)));
    cudaError_t err = launch(energy_split_q_kernel<T, KIND, K>, static_cast<unsigned>(e.B * s.sh.cq), kThreads, smem_q,
                             stream, s);
    if (err != cudaSuccess) return err;
    if (value || gbeta || grads) {
      err = launch(energy_split_coef_kernel<T>, static_cast<unsigned>(e.B), kThreads, 0, stream, s, iso);
      if (err != cudaSuccess) return err;
    }
    if (!grads) return cudaSuccess;
    const size_t smem_g = static_cast<size_t>(s.sh.np * (WG + 1) * static_cast<int64_t>(sizeof(T)));
    return launch(energy_split_grad_kernel<T, KIND, K>, static_cast<unsigned>(e.B * s.sh.cg), kThreads, smem_g, stream,
                  s);
  });
}

// ----------------------------------------------------------------------------- finish

// value[r] = Σ_t w_cross·cross + w_a·within (own = a) + w_c·within (own = c);
// gbeta[r] = grad[r] · the same sums of ∂E/∂β.  One thread per row.
template <typename T>
__global__ void energy_finish_kernel(const double* __restrict__ part_a, int64_t nt_a, const double* __restrict__ part_c,
                                     int64_t nt_c, int64_t B, double w_cross, double w_a, double w_c,
                                     const T* __restrict__ grad, int64_t sg, T* __restrict__ value,
                                     T* __restrict__ gbeta) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= B) return;
  double v = 0, b = 0;
  for (int64_t t = 0; t < nt_a; ++t) {
    const double* o = part_a + (r * nt_a + t) * 4;
    v += w_cross * o[0] + w_a * o[1];
    b += w_cross * o[2] + w_a * o[3];
  }
  if (part_c) {
    for (int64_t t = 0; t < nt_c; ++t) {
      const double* o = part_c + (r * nt_c + t) * 4;
      v += w_c * o[1];
      b += w_c * o[3];
    }
  }
  if (value) value[r] = static_cast<T>(v);
  if (gbeta) gbeta[r] = static_cast<T>(b * static_cast<double>(grad ? grad[r * sg] : T(1)));
}

template <typename T, int D, int KIND, int K, bool GRAD>
cudaError_t launch_small(const PairLaunch<T>& a, unsigned grid, cudaStream_t stream) {
  if constexpr (D % K != 0) {
    return cudaErrorInvalidValue;  // the host checks k | d
  } else {
    return launch(energy_small_kernel<T, D, KIND, K, GRAD>, grid, kThreads, 0, stream, a);
  }
}

// The pair kernel for the row metric (kind, kblock) and d.
template <typename T, bool GRAD>
cudaError_t launch_pairs(const PairLaunch<T>& a, int kind, int kblock, cudaStream_t stream) {
  if (a.B == 0 || a.nt == 0) return cudaSuccess;
  const int64_t blocks = a.B * a.nt;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const unsigned grid = static_cast<unsigned>(blocks);
  return dispatch_metric(kind, kblock, [&](auto kind_c, auto k_c) -> cudaError_t {
    // a 1×1 block is an isotropic p (the same one parameter per row)
    constexpr int K = decltype(k_c)::value;
    constexpr int KIND = decltype(kind_c)::value == kBlock && K == 1 ? kIsotropic : decltype(kind_c)::value;
    switch (a.d <= kSmallMaxD ? a.d : 0) {
      case 1: return launch_small<T, 1, KIND, K, GRAD>(a, grid, stream);
      case 2: return launch_small<T, 2, KIND, K, GRAD>(a, grid, stream);
      case 3: return launch_small<T, 3, KIND, K, GRAD>(a, grid, stream);
      case 4: return launch_small<T, 4, KIND, K, GRAD>(a, grid, stream);
      default: return launch(energy_large_kernel<T, KIND, K, GRAD>, grid, kThreads, 0, stream, a);
    }
  });
}

// Both launches and the final reduction for weights (w_cross, w_a, w_c); see launchers.cuh.
template <typename T>
cudaError_t energy_pairs_run(const EnergyArgs<T>& e, double w_cross, double w_a, double w_c, T* value, T* ga, T* gc,
                             T* gbeta, double* workspace, cudaStream_t stream) {
  if (e.B == 0 || e.d == 0) return cudaSuccess;
  if (e.n <= 0 || e.m <= 0) return cudaErrorInvalidValue;
  if (e.split) return energy_split_run<T>(e, w_cross, w_a, w_c, value, ga, gc, gbeta, workspace, stream);
  const bool sums = value != nullptr || gbeta != nullptr;
  const int64_t nt_a = energy_tiles(e.n, e.d), nt_c = energy_tiles(e.m, e.d);
  double* part_a = workspace;
  double* part_c = workspace + e.B * nt_a * 4;
  auto make = [&](bool own_a) {
    PairLaunch<T> l{};
    l.own = own_a ? e.a : e.c;
    l.oth = own_a ? e.c : e.a;
    l.beta = e.beta;
    l.p = e.p;
    l.grad = e.grad;
    l.B = e.B;
    l.n_own = own_a ? e.n : e.m;
    l.n_oth = own_a ? e.m : e.n;
    l.d = e.d;
    l.nt = own_a ? nt_a : nt_c;
    l.so_b = own_a ? e.sab : e.scb;
    l.so_n = own_a ? e.san : e.scn;
    l.st_b = own_a ? e.scb : e.sab;
    l.st_n = own_a ? e.scn : e.san;
    l.sb = e.sb;
    l.sp = e.sp;
    l.sg = e.sg;
    l.w_cross = static_cast<T>(w_cross);
    l.w_within = static_cast<T>(own_a ? w_a : w_c);
    l.within = (own_a ? w_a : w_c) != 0.0 && l.n_own > 1;
    l.need_value = value != nullptr;
    l.need_beta = gbeta != nullptr;
    l.part = own_a ? part_a : part_c;
    return l;
  };
  cudaError_t err = cudaSuccess;
  // own = a: cross pairs (counted once, here) and a's within pairs
  if (sums || ga) {
    PairLaunch<T> l = make(true);
    l.cross = 1;
    l.within_all = ga != nullptr;
    l.gown = ga;
    err = ga ? launch_pairs<T, true>(l, e.kind, e.kblock, stream) : launch_pairs<T, false>(l, e.kind, e.kblock, stream);
    if (err != cudaSuccess) return err;
  }
  // own = c: c's gradients (cross pairs again, not counted) and c's within pairs
  const bool c_within = w_c != 0.0 && e.m > 1;
  const bool run_c = gc != nullptr || (sums && c_within);
  if (run_c) {
    PairLaunch<T> l = make(false);
    l.cross = gc ? 2 : 0;
    l.within_all = gc != nullptr;
    l.gown = gc;
    err = gc ? launch_pairs<T, true>(l, e.kind, e.kblock, stream) : launch_pairs<T, false>(l, e.kind, e.kblock, stream);
    if (err != cudaSuccess) return err;
  }
  if (sums) {
    const int threads = 128;
    const unsigned blocks = static_cast<unsigned>((e.B + threads - 1) / threads);
    err = launch(energy_finish_kernel<T>, blocks, threads, 0, stream, part_a, nt_a, run_c ? part_c : nullptr, nt_c, e.B,
                 w_cross, w_a, w_c, e.grad, e.sg, value, gbeta);
  }
  return err;
}

}  // namespace cuda
}  // namespace etweedie
