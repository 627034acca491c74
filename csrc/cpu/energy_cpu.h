// Pair engine of the CPU energy_score and energy_distance kernels.  Math: csrc/common/energy.h.
//
// Both losses are weighted sums of three pair sums per row r:
//   w_cross Σ_{i,j} E(a_i − b_j)  +  w_a Σ_{i<j} E(a_i − a_j)  +  w_b Σ_{i<j} E(b_i − b_j)
// (energy score: a = the M samples, b = the target, w_b = 0; energy distance: the two clouds).
//
// Work decomposition: each cloud is cut into blocks of R points (R = kTile for small d, where
// one point against a 64-point tile vectorizes across points in SoA form; R = 8 for large d,
// where two blocks of 8 points stay in L1 while all their pairs are formed, so a cloud is read
// from memory ~m/8 times instead of m times).  A parallel unit is (row, block I):
//   forward  — cross pairs of I with every block of the other cloud, and within pairs of I with
//              the blocks I, I+1, …, I+h (mod nb): the circulant split gives every unit the
//              same number of within pairs, so at::parallel_for's static split is balanced, and
//              each unordered pair is formed once (symmetry halves the within work);
//   backward — the per-point gradient Σ_j slope·(a_i − c_j) needs every pair of a_i, so a unit
//              visits all blocks (within pairs twice: no write races, no atomics).
//   With many rows (B ≥ 4·threads) the backward instead runs one row per task and forms each
//   pair once, adding its gradient to both points (the forward's pair count).
// Pairs are formed from direct differences u = a_i − c_j, so clouds far from the origin lose
// no precision — except the float32 forward with large d and many points, which takes the
// Gram form with centring and a cancellation guard (energy_gram_cpu.h).  Diagonal and block metrics with
// large d are whitened once per call and run isotropically (energy_forward / energy_backward
// at the end of this file); the backward forms their close pairs from the source points
// (CloseSource), as the Gram form does.  Memory: O(R·d) scratch per thread, O(#units) partial sums
// (doubles) for a deterministic reduction, O((n + m)·d) per row for the symmetric backward's
// accumulators and the whitened clouds; nothing of size n·m.
//
// Shapes: a (B, n, d), b (B, m, d) with unit stride over d and any stride over B and points
// (stride 0 = a broadcast cloud); beta (B,); prec (B, *param) of metric kind 0/1/2.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/energy.h"
#include "energy_gram_cpu.h"
#include "energy_tile_cpu.h"
#include "et_score_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kLargeDBlock = 8;
constexpr int64_t kFlushPairs = 64;  // metric-gradient pairs summed in T before they join the double sum

inline int64_t energy_block(int64_t d) { return d > kSmallD ? kLargeDBlock : kTile; }

// gP += Σ_t c_t (u_t u_tᵀ reduced to the parameter's shape), u in SoA form ut[k·ld + t].
template <typename T>
inline void accum_outer_soa(const RowPrec<T, kIsotropic, 0>&, const T* ut, int64_t ld, int64_t n, int64_t d,
                            const T* c, T* gp) {
  T acc = 0;
  for (int64_t k = 0; k < d; ++k) {
    const T* uk = ut + k * ld;
#pragma omp simd reduction(+ : acc)
    for (int64_t t = 0; t < n; ++t) acc += c[t] * uk[t] * uk[t];
  }
  gp[0] += acc;
}

template <typename T>
inline void accum_outer_soa(const RowPrec<T, kDiagonal, 0>&, const T* ut, int64_t ld, int64_t n, int64_t d,
                            const T* c, T* gp) {
  for (int64_t k = 0; k < d; ++k) {
    const T* uk = ut + k * ld;
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t t = 0; t < n; ++t) acc += c[t] * uk[t] * uk[t];
    gp[k] += acc;
  }
}

template <typename T, int K>
inline void accum_outer_soa(const RowPrec<T, kBlock, K>&, const T* ut, int64_t ld, int64_t n, int64_t d,
                            const T* c, T* gp) {
  for (int64_t blk = 0; blk < d / K; ++blk)
    for (int a = 0; a < K; ++a)
      for (int b = 0; b < K; ++b) {
        const T* ua = ut + (blk * K + a) * ld;
        const T* ub = ut + (blk * K + b) * ld;
        T acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t t = 0; t < n; ++t) acc += c[t] * ua[t] * ub[t];
        gp[a * K + b] += acc;
      }
}

// ------------------------------------------------------------------------- whitening

template <typename T>
inline T squared_norm(const T* z, int64_t d) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < d; ++k) acc += z[k] * z[k];
  return acc;
}

// Close pairs of whitened clouds.  With a diagonal or block metric at large d the pair loops
// run on z = (x − x₀)·L (energy_backward below); each z carries the rounding of its own
// centring and metric, up to ~2⁻²⁴|z| per coordinate (float), and a difference much smaller than
// the points magnifies it — 10⁴× for a pair 10⁻⁴ apart at unit spread, where β < 1 makes that
// pair's slope the largest term of its points' gradients.  A pair with ‖z_i − z_j‖² <
// 2⁻⁶(‖z_i‖² + ‖z_j‖²) (the Gram form's guard, energy_gram_cpu.h) is therefore formed from its
// source points instead: u = (x_i − x_j)·L, the source difference rounded once.
template <typename T>
struct CloseSource {
  const T* xs;       // the source point of x
  const T* cs;       // the source points of the run: cs + t·scs
  int64_t scs;
  T nx;              // ‖z_x‖²
  const T* nc;       // ‖z_t‖² of the run's points
  const T* L;        // the row's whitening factor (K = 0: diagonal scale)
  int64_t K;
  T* u;              // scratch, d values: the close pair's u
  const T* zero;     // d zeros (u − 0 is the pair's difference in the metric's own loops)

  // whether pair t with whitened ‖z_x − z_t‖² = q is close; if so u = its source difference
  bool recompute(int64_t t, T q, int64_t d) const {
    if (!(q < T(kGramGuard) * (nx + nc[t]))) return false;
    whiten_point(xs, cs + t * scs, L, K, d, u);
    return true;
  }
};

// ------------------------------------------------------------------------- one point vs a run

// Σ_t E(x − c_t) over the n points c_t = c + t·sc.
template <typename T, typename Prec>
inline T run_energy(const Prec& P, const T* x, const T* c, int64_t sc, int64_t n, int64_t d, T beta) {
  if (n <= 0) return T(0);
  if (d > kSmallD) {
    T total = 0;
    for (int64_t t = 0; t < n; ++t) total += pair_energy(P.quad(x, c + t * sc, d), beta);
    return total;
  }
  T ut[kSmallD * kTile], q[kTile];
  T total = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t nt = std::min(kTile, n - j0);
    residual_tile(x, c + j0 * sc, sc, nt, d, ut);
    P.quad_soa(ut, kTile, nt, d, q);
    total += tile_energy_sum(q, nt, beta);
  }
  return total;
}

// acc += cu Σ_t slope_t (x − c_t);  gbeta += cp Σ_t ∂E_t/∂β;  gp += cp Σ_t ½ slope_t u_t u_tᵀ;
// and, when acc_c is given (the symmetric backward), acc_c[t·d + k] −= cu slope_t (x − c_t)_k;
// value (if given) += cu Σ_t E_t (the forward value, for the fused value-and-gradient pass).
// gbeta / gp may be null (not requested, or pairs already counted by another unit).
// close: the source points of whitened x and c (large d only: whitening is for d > kSmallD).
template <typename T, typename Prec>
inline void run_grad(const Prec& P, const T* x, const T* c, int64_t sc, int64_t n, int64_t d, T beta, T cu, T cp,
                     T* acc, double* gbeta, T* gp, T* acc_c = nullptr, double* value = nullptr,
                     const CloseSource<T>* close = nullptr) {
  if (n <= 0) return;
  if (d > kSmallD) {
    double gb = 0, val = 0;
    for (int64_t t = 0; t < n; ++t) {
      const T* ct = c + t * sc;
      const T* xt = x;  // the pair's difference is xt − ct (a close pair's: u − 0)
      T q = P.quad(xt, ct, d);
      if (close != nullptr && close->recompute(t, q, d)) {
        xt = close->u;
        ct = close->zero;
        q = P.quad(xt, ct, d);
      }
      const T sl = pair_energy_slope(q, beta);
      if (gbeta || value) {
        const T e = pair_energy(q, beta);
        if (gbeta) gb += pair_energy_dbeta(q, e);
        val += e;
      }
      if (sl == T(0)) continue;
      const T f = cu * sl;
      if (acc_c) {
        T* at = acc_c + t * d;
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) {
          const T g = f * (xt[k] - ct[k]);
          acc[k] += g;
          at[k] -= g;
        }
      } else {
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) acc[k] += f * (xt[k] - ct[k]);
      }
      if (gp) P.accum_outer(xt, ct, T(0.5) * cp * sl, gp, d);
    }
    if (gbeta) *gbeta += cp * gb;
    if (value) *value += cu * val;
    return;
  }
  T ut[kSmallD * kTile], q[kTile], s[kTile], e[kTile];
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t nt = std::min(kTile, n - j0);
    residual_tile(x, c + j0 * sc, sc, nt, d, ut);
    P.quad_soa(ut, kTile, nt, d, q);
    const bool need_e = value != nullptr || gbeta != nullptr;
    if (need_e) {
      const T total = tile_energies_and_slopes(q, nt, beta, e, s);
      if (value) *value += cu * total;
    } else {
      tile_slopes(q, nt, beta, s);
    }
    for (int64_t k = 0; k < d; ++k) {
      const T* uk = ut + k * kTile;
      T a = 0;
#pragma omp simd reduction(+ : a)
      for (int64_t t = 0; t < nt; ++t) a += s[t] * uk[t];
      acc[k] += cu * a;
    }
    if (acc_c) {
      for (int64_t t = 0; t < nt; ++t) {
        const T f = cu * s[t];
        T* at = acc_c + (j0 + t) * d;
        for (int64_t k = 0; k < d; ++k) at[k] -= f * ut[k * kTile + t];
      }
    }
    if (gbeta) {
      T gb = 0;
      for (int64_t t = 0; t < nt; ++t) gb += pair_energy_dbeta(q[t], e[t]);
      *gbeta += cp * gb;
    }
    if (gp) {
      const T half = T(0.5) * cp;
#pragma omp simd
      for (int64_t t = 0; t < nt; ++t) s[t] *= half;
      accum_outer_soa(P, ut, kTile, nt, d, s, gp);
    }
  }
}

// Blocks J paired with block I for the within sum (J = I counts its pairs i < j only).
template <typename F>
inline void for_circulant_blocks(int64_t I, int64_t nb, F&& f) {
  const int64_t h = (nb % 2) ? (nb - 1) / 2 : (I < nb / 2 ? nb / 2 : nb / 2 - 1);
  for (int64_t t = 0; t <= h; ++t) f((I + t) % nb);
}

// ------------------------------------------------------------------------- host functions

// The full check lives in csrc/common/checks.h (shared with the CUDA bindings).
inline void check_energy_canonical(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                   const at::Tensor& prec, int64_t kind) {
  checks::energy_args(op, a, b, beta, prec, kind);
}

inline int64_t energy_block_of(const at::Tensor& prec, int64_t kind) { return kind == kBlock ? prec.size(1) : 0; }

// (B,) weighted pair sums of each row.
inline at::Tensor energy_pairs_forward(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                       const at::Tensor& prec, int64_t kind, PairWeights w) {
  check_energy_canonical(op, a, b, beta, prec, kind);
  const int64_t B = a.size(0), n = a.size(1), m = b.size(1), d = a.size(2);
  auto out = at::zeros({B}, a.options());
  if (B == 0 || d == 0) return out;
  if (gram_applicable(a, kind, n, m, d)) {
    at::Tensor gram_out;
    if (energy_gram_forward(a, b, beta, prec, w, &gram_out)) return gram_out;  // else out of its range
  }
  const int64_t R = energy_block(d);
  const int64_t nba = (n + R - 1) / R, nbb = (m + R - 1) / R;
  std::vector<double> part(B * (nba + nbb), 0.0);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "energy_pairs_forward", [&] {
    using T = scalar_t;
    const T* ap = a.data_ptr<T>();
    const T* bp = b.data_ptr<T>();
    const T* betap = beta.data_ptr<T>();
    const T* pp = prec.data_ptr<T>();
    const int64_t sab = a.stride(0), san = a.stride(1), sbb = b.stride(0), sbn = b.stride(1);
    const int64_t sbeta = beta.stride(0), sp0 = prec.stride(0);
    ET_DISPATCH_METRIC(kind, energy_block_of(prec, kind), T, [&] {
      // Within pairs of block I of cloud x (np points), circulant half; cross pairs with cloud c.
      auto unit = [&](const Prec& P, T be, const T* x, int64_t sx, int64_t np, int64_t nb, int64_t I, const T* c,
                      int64_t sc, int64_t nc, double w_cross, double w_within) {
        const int64_t i0 = I * R, i1 = std::min(np, i0 + R);
        double cross = 0, within = 0;
        if (w_cross != 0) {
          for (int64_t j0 = 0; j0 < nc; j0 += R) {
            const int64_t len = std::min(R, nc - j0);
            for (int64_t i = i0; i < i1; ++i) cross += run_energy(P, x + i * sx, c + j0 * sc, sc, len, d, be);
          }
        }
        if (w_within != 0) {
          for_circulant_blocks(I, nb, [&](int64_t J) {
            const int64_t j0 = J * R, j1 = std::min(np, j0 + R);
            for (int64_t i = i0; i < i1; ++i) {
              const int64_t from = J == I ? i + 1 : j0;
              within += run_energy(P, x + i * sx, x + from * sx, sx, j1 - from, d, be);
            }
          });
        }
        return w_cross * cross + w_within * within;
      };
      at::parallel_for(0, B * nba, 1, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t r = u / nba, I = u % nba;
          const Prec P{pp + r * sp0};
          part[r * (nba + nbb) + I] =
              unit(P, betap[r * sbeta], ap + r * sab, san, n, nba, I, bp + r * sbb, sbn, m, w.cross, w.within_a);
        }
      });
      if (w.within_b != 0 && m > 1) {
        at::parallel_for(0, B * nbb, 1, [&](int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t r = u / nbb, J = u % nbb;
            const Prec P{pp + r * sp0};
            part[r * (nba + nbb) + nba + J] =
                unit(P, betap[r * sbeta], bp + r * sbb, sbn, m, nbb, J, nullptr, 0, 0, 0.0, w.within_b);
          }
        });
      }
    });
    T* op_ = out.data_ptr<T>();
    for (int64_t r = 0; r < B; ++r) {
      double s = 0;
      for (int64_t k = 0; k < nba + nbb; ++k) s += part[r * (nba + nbb) + k];
      op_[r] = static_cast<T>(s);
    }
  });
  return out;
}

// The source clouds of whitened ones (energy_backward), from which their close pairs are formed
// (CloseSource).
struct WhitenedSource {
  at::Tensor a, b;    // the source clouds (B, n, d), (B, m, d), unit stride over d
  at::Tensor na, nb;  // squared norms of the whitened clouds, (B, n) and (B, m) contiguous
  at::Tensor L;       // the whitening factor: (B, d) diagonal scale (K = 0) or (B, K, K), contiguous
  int64_t K = 0;
};

// Gradients of grad[r] · (weighted pair sums of row r) -> (grad_a, grad_b, grad_beta, grad_prec);
// an unrequested gradient is an empty tensor.  src: a and b are whitened clouds of src's.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_pairs_backward(
    const char* op, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
    const at::Tensor& prec, int64_t kind, PairWeights w, bool need_a, bool need_b, bool need_beta, bool need_prec,
    at::Tensor* value = nullptr, const WhitenedSource* src = nullptr) {
  check_energy_canonical(op, a, b, beta, prec, kind);
  const int64_t B = a.size(0), n = a.size(1), m = b.size(1), d = a.size(2);
  auto g = grad.contiguous();
  TORCH_CHECK(g.dim() == 1 && g.size(0) == B, op, ": grad must be (B,) = (", B, "), got ", grad.sizes());
  // an unrequested gradient is a fresh empty tensor (outputs must not alias each other)
  auto empty = [&] { return at::empty({0}, a.options()); };
  auto ga = need_a ? at::zeros({B, n, d}, a.options()) : empty();
  auto gb = need_b ? at::zeros({B, m, d}, a.options()) : empty();
  auto gbeta = need_beta ? at::zeros({B}, a.options()) : empty();
  std::vector<int64_t> psize(prec.sizes().begin(), prec.sizes().end());
  auto gprec = need_prec ? at::zeros(psize, a.options()) : empty();
  if (src == nullptr && value == nullptr && !need_beta && !need_prec && d > 0 && gram_applicable(a, kind, n, m, d)) {
    std::pair<at::Tensor, at::Tensor> gram_grads;
    if (energy_gram_backward(g, a, b, beta, prec, w, need_a, need_b, &gram_grads))
      return {gram_grads.first, gram_grads.second, gbeta, gprec};
  }
  // Many rows: parallel over rows with the symmetric pair loop (half the pairs of the
  // per-point split below, which is used when a few large rows must share the threads).
  const bool row_parallel = B >= 4 * static_cast<int64_t>(at::get_num_threads());
  if (value) {
    // value = the forward's weighted pair sums: accumulated in the symmetric pass, else apart
    *value = row_parallel ? at::zeros({B}, a.options()) : energy_pairs_forward(op, a, b, beta, prec, kind, w);
  }
  if (B == 0 || d == 0 || !(need_a || need_b || need_beta || need_prec || value)) return {ga, gb, gbeta, gprec};
  const bool need_param = need_beta || need_prec;
  const int64_t R = energy_block(d);
  const int64_t nba = (n + R - 1) / R, nbb = (m + R - 1) / R, nu = nba + nbb;
  const int64_t ps = B > 0 ? prec.numel() / B : 0;
  std::vector<double> part_beta(need_beta ? B * nu : 0, 0.0);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "energy_pairs_backward", [&] {
    using T = scalar_t;
    const T* ap = a.data_ptr<T>();
    const T* bp = b.data_ptr<T>();
    const T* betap = beta.data_ptr<T>();
    const T* pp = prec.data_ptr<T>();
    const T* gp_in = g.data_ptr<T>();
    T* gap = need_a ? ga.data_ptr<T>() : nullptr;
    T* gbp = need_b ? gb.data_ptr<T>() : nullptr;
    // The metric gradient is summed in T within a run_grad call and over calls until kFlushPairs
    // pairs, in double beyond (a call holds ≤ 64 pairs here, one point's pairs in the row-parallel
    // path below): the ED's cross and within sums cancel (the difference is often 50× smaller than either), so a T
    // running sum over every pair of a row lost up to ~1e-4 relative accuracy
    // (tests/test_energy_distance.py, block2, d = 40, seed 780792699).
    std::vector<double> part_prec(need_prec ? B * nu * ps : 0, 0.0);
    const int64_t sab = a.stride(0), san = a.stride(1), sbb = b.stride(0), sbn = b.stride(1);
    const int64_t sbeta = beta.stride(0), sp0 = prec.stride(0);
    // one row of a cloud: points z + i·s; a whitened cloud's also carry their source points
    // (src + i·ss) and squared norms (nrm), for the close pairs (CloseSource)
    struct Cloud {
      const T* z;
      int64_t s;
      const T* src = nullptr;
      int64_t ss = 0;
      const T* nrm = nullptr;
    };
    const T* Lp = src ? src->L.data_ptr<T>() : nullptr;
    const int64_t K_src = src ? src->K : 0, lstride = src ? (K_src == 0 ? d : K_src * K_src) : 0;
    auto cloud_a = [&](int64_t r) {
      return src ? Cloud{ap + r * sab, san, src->a.data_ptr<T>() + r * src->a.stride(0), src->a.stride(1),
                         src->na.data_ptr<T>() + r * n}
                 : Cloud{ap + r * sab, san};
    };
    auto cloud_b = [&](int64_t r) {
      return src ? Cloud{bp + r * sbb, sbn, src->b.data_ptr<T>() + r * src->b.stride(0), src->b.stride(1),
                         src->nb.data_ptr<T>() + r * m}
                 : Cloud{bp + r * sbb, sbn};
    };
    ET_DISPATCH_METRIC(kind, energy_block_of(prec, kind), T, [&] {
      // Block I of cloud x: gradients of its points from the cross pairs with cloud c (weight
      // w_cross; counted for β/P when cross_param) and from all within pairs (weight w_within,
      // each pair seen twice, so β/P take w_within / 2).
      // scratch (ps values of T, `pending` pairs in it) added to the double accumulator gpd, then cleared
      auto flush = [&](double* gpd, T* scratch, int64_t& pending) {
        for (int64_t e = 0; e < ps; ++e) {
          gpd[e] += static_cast<double>(scratch[e]);
          scratch[e] = T(0);
        }
        pending = 0;
      };
      // run_grad of point i of X with points j0 … j0 + nc − 1 of C (row r), its metric gradient
      // summed into scratch, flushed to gpd every kFlushPairs pairs (not every call: at large d a
      // call holds 8 pairs and the flush of a diagonal metric d values); closebuf: 2d values of
      // scratch, the last d zero (whitened clouds' close pairs)
      auto grad_pairs = [&](const Prec& P, int64_t r, const Cloud& X, int64_t i, const Cloud& C, int64_t j0, int64_t nc,
                            T be, T cu, T cp, T* acc, double* gbe, double* gpd, T* scratch, int64_t& pending,
                            T* closebuf, T* acc_c = nullptr, double* val = nullptr) {
        CloseSource<T> close{};
        if (X.src != nullptr)
          close = CloseSource<T>{X.src + i * X.ss, C.src + j0 * C.ss, C.ss, X.nrm[i], C.nrm + j0, Lp + r * lstride,
                                 K_src, closebuf, closebuf + d};
        run_grad(P, X.z + i * X.s, C.z + j0 * C.s, C.s, nc, d, be, cu, cp, acc, gbe, gpd ? scratch : nullptr, acc_c, val,
                 X.src != nullptr ? &close : nullptr);
        if (gpd && (pending += nc) >= kFlushPairs) flush(gpd, scratch, pending);
      };
      auto unit = [&](int64_t r, int64_t slot, const Cloud& X, int64_t np, int64_t I, const Cloud* C, int64_t nc,
                      double w_cross, bool cross_param, double w_within, T* gout, std::vector<T>& acc,
                      std::vector<T>& scratch, std::vector<T>& closebuf) {
        const Prec P{pp + r * sp0};
        const T be = betap[r * sbeta];
        const int64_t i0 = I * R, i1 = std::min(np, i0 + R);
        std::fill(acc.begin(), acc.end(), T(0));
        double* gbe = need_beta ? &part_beta[r * nu + slot] : nullptr;
        double* gpd = need_prec ? part_prec.data() + (r * nu + slot) * ps : nullptr;
        std::fill(scratch.begin(), scratch.end(), T(0));
        int64_t pending = 0;
        const T wc = static_cast<T>(w_cross), ww = static_cast<T>(w_within);
        if (w_cross != 0 && C != nullptr) {
          for (int64_t j0 = 0; j0 < nc; j0 += R) {
            const int64_t len = std::min(R, nc - j0);
            for (int64_t i = i0; i < i1; ++i)
              grad_pairs(P, r, X, i, *C, j0, len, be, wc, wc, acc.data() + (i - i0) * d, cross_param ? gbe : nullptr,
                         cross_param ? gpd : nullptr, scratch.data(), pending, closebuf.data());
          }
        }
        if (w_within != 0 && np > 1) {
          for (int64_t j0 = 0; j0 < np; j0 += R) {
            const int64_t len = std::min(R, np - j0);
            for (int64_t i = i0; i < i1; ++i)
              grad_pairs(P, r, X, i, X, j0, len, be, ww, T(0.5) * ww, acc.data() + (i - i0) * d, gbe, gpd,
                         scratch.data(), pending, closebuf.data());
          }
        }
        if (gpd) flush(gpd, scratch.data(), pending);
        if (gout) {
          const T gr = gp_in[r];
          for (int64_t i = i0; i < i1; ++i) P.apply(acc.data() + (i - i0) * d, gr, gout + i * d, d);
        }
      };
      if (row_parallel) {
        // Enough rows to occupy every thread: one row per task, every pair formed once and its
        // gradient added to both points (the forward's pair count; no races across rows).
        at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
          std::vector<T> acc((n + m) * d), scratch(ps), closebuf(src ? 2 * d : 0, T(0));
          std::vector<double> gp_row(need_prec ? ps : 0);
          for (int64_t r = r0; r < r1; ++r) {
            const Prec P{pp + r * sp0};
            const T be = betap[r * sbeta];
            const Cloud A = cloud_a(r), Bc = cloud_b(r);
            T* cb = closebuf.data();
            T* acc_a = acc.data();
            T* acc_b = acc.data() + n * d;
            std::fill(acc.begin(), acc.end(), T(0));
            std::fill(gp_row.begin(), gp_row.end(), 0.0);
            double gbe = 0, val = 0;
            double* gbep = need_beta ? &gbe : nullptr;
            double* valp = value ? &val : nullptr;
            double* gpd = need_prec ? gp_row.data() : nullptr;
            T* sp = scratch.data();
            std::fill(scratch.begin(), scratch.end(), T(0));
            int64_t pending = 0;
            const T wc = static_cast<T>(w.cross), wa = static_cast<T>(w.within_a), wb = static_cast<T>(w.within_b);
            if (w.cross != 0)
              for (int64_t i = 0; i < n; ++i)
                grad_pairs(P, r, A, i, Bc, 0, m, be, wc, wc, acc_a + i * d, gbep, gpd, sp, pending, cb, acc_b, valp);
            if (w.within_a != 0)
              for (int64_t i = 0; i + 1 < n; ++i)
                grad_pairs(P, r, A, i, A, i + 1, n - i - 1, be, wa, wa, acc_a + i * d, gbep, gpd, sp, pending, cb,
                           acc_a + (i + 1) * d, valp);
            if (w.within_b != 0)
              for (int64_t j = 0; j + 1 < m; ++j)
                grad_pairs(P, r, Bc, j, Bc, j + 1, m - j - 1, be, wb, wb, acc_b + j * d, gbep, gpd, sp, pending, cb,
                           acc_b + (j + 1) * d, valp);
            if (gpd) flush(gpd, sp, pending);
            const T gr = gp_in[r];
            if (gap)
              for (int64_t i = 0; i < n; ++i) P.apply(acc_a + i * d, gr, gap + (r * n + i) * d, d);
            if (gbp)
              for (int64_t j = 0; j < m; ++j) P.apply(acc_b + j * d, gr, gbp + (r * m + j) * d, d);
            if (need_beta) part_beta[r * nu] = gbe;
            if (value) value->data_ptr<T>()[r] = static_cast<T>(val);
            if (need_prec) std::copy(gp_row.begin(), gp_row.end(), part_prec.begin() + r * nu * ps);
          }
        });
        return;
      }
      if (need_a || need_param) {
        at::parallel_for(0, B * nba, 1, [&](int64_t u0, int64_t u1) {
          std::vector<T> acc(R * d), scratch(ps), closebuf(src ? 2 * d : 0, T(0));
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t r = u / nba, I = u % nba;
            const Cloud A = cloud_a(r), Bc = cloud_b(r);
            unit(r, I, A, n, I, &Bc, m, w.cross, true, w.within_a, gap ? gap + r * n * d : nullptr, acc, scratch,
                 closebuf);
          }
        });
      }
      if (need_b || (need_param && w.within_b != 0)) {
        at::parallel_for(0, B * nbb, 1, [&](int64_t u0, int64_t u1) {
          std::vector<T> acc(R * d), scratch(ps), closebuf(src ? 2 * d : 0, T(0));
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t r = u / nbb, J = u % nbb;
            const Cloud A = cloud_a(r), Bc = cloud_b(r);
            unit(r, nba + J, Bc, m, J, need_b ? &A : nullptr, n, w.cross, false, w.within_b,
                 gbp ? gbp + r * m * d : nullptr, acc, scratch, closebuf);
          }
        });
      }
    });
    if (need_beta) {
      T* o = gbeta.data_ptr<T>();
      for (int64_t r = 0; r < B; ++r) {
        double s = 0;
        for (int64_t k = 0; k < nu; ++k) s += part_beta[r * nu + k];
        o[r] = static_cast<T>(s * static_cast<double>(gp_in[r]));
      }
    }
    if (need_prec) {
      T* o = gprec.data_ptr<T>();
      for (int64_t r = 0; r < B; ++r)
        for (int64_t e = 0; e < ps; ++e) {
          double s = 0;
          for (int64_t k = 0; k < nu; ++k) s += part_prec[(r * nu + k) * ps + e];
          o[r * ps + e] = static_cast<T>(s * static_cast<double>(gp_in[r]));
        }
    }
  });
  return {ga, gb, gbeta, gprec};
}

}  // namespace cpu
}  // namespace etweedie

namespace etweedie {
namespace cpu {

// Diagonal and block metrics with large d: the weighted quadratic forms cost 2–3× the
// isotropic one in the pair loops (more loads per coordinate, interleaved blocks).  In the Gram
// form (float32, d ≥ 64) the metric is applied while the clouds are packed (energy_gram_cpu.h:
// z = (x − c)·L in the pass that centres them, ∂/∂x = (∂/∂z)·Lᵀ as the gradients are written),
// so no whitened copy exists; otherwise the clouds are whitened once per call — z = (x − c)·L per row, with L = diag(√p) or the
// Cholesky factor of P_k = L Lᵀ (O((n + m)·d·k) work, one pass) — and the pair loops run
// isotropically on z.  The common centre c = a_0 keeps the whitened coordinates O(spread), so
// clouds far from the origin lose no precision, and the backward forms close pairs, whose
// difference z's own roundings would dominate, from the source points (CloseSource); the
// losses are translation invariant, so c carries no gradient.  Backward maps back: ∂/∂x = (∂/∂z)·Lᵀ, and ∂/∂P = L⁻ᵀ G_z L⁻¹ (block) or
// G_z / p (diagonal), where G_z = Σ ½ slope z_u z_uᵀ is the metric gradient at P = I — the only
// case that still runs the weighted pair loops.
inline bool whiten_metric(int64_t kind, int64_t d) { return kind != kIsotropic && d > kSmallD; }

// out (B, n, d) contiguous: per row b and point i, blockwise out = (x − c)·L_b (transpose = false)
// or out = x·L_bᵀ (transpose = true, no centre); L (B, K, K) contiguous, or for K = 0 the
// diagonal scale (B, d) contiguous.  norms (if given): (B, n) squared norms of the outputs.
inline at::Tensor metric_transform(const at::Tensor& x, const at::Tensor& centre, const at::Tensor& L, int64_t K,
                                   bool transpose, at::Tensor* norms = nullptr) {
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2);
  auto out = at::empty({B, n, d}, x.options());
  if (norms) *norms = at::empty({B, n}, x.options());
  if (B == 0 || n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "metric_transform", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* cp = centre.defined() ? centre.data_ptr<T>() : nullptr;
    const T* lp = L.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* np_ = norms ? norms->data_ptr<T>() : nullptr;
    const int64_t sx0 = x.stride(0), sx1 = x.stride(1), sc0 = cp ? centre.stride(0) : 0;
    const int64_t lstride = K == 0 ? d : K * K;
    at::parallel_for(0, B * n, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / n, i = p % n;
        const T* Lb = lp + b * lstride;
        T Mb[16];  // out_block = u_block · Mb, Mb = L or Lᵀ
        if (K > 0)
          for (int64_t a = 0; a < K; ++a)
            for (int64_t c = 0; c < K; ++c) Mb[a * K + c] = transpose ? Lb[c * K + a] : Lb[a * K + c];
        T* o = op + p * d;
        whiten_point(xp + b * sx0 + i * sx1, cp ? cp + b * sc0 : nullptr, K == 0 ? Lb : Mb, K, d, o);
        if (np_) np_[p] = squared_norm(o, d);
      }
    });
  });
  return out;
}

// (L, K): the whitening factor of prec for metric_transform (K = 0: diagonal scale √p).
inline std::pair<at::Tensor, int64_t> whitening_factor(const at::Tensor& prec, int64_t kind) {
  if (kind == kDiagonal) return {prec.sqrt().contiguous(), 0};
  return {at::linalg_cholesky(prec).contiguous(), prec.size(1)};
}

inline at::Tensor energy_forward(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                 const at::Tensor& prec, int64_t kind, PairWeights w) {
  check_energy_canonical(op, a, b, beta, prec, kind);
  if (!whiten_metric(kind, a.size(2)) || a.size(0) == 0 || a.size(1) == 0) {
    return energy_pairs_forward(op, a, b, beta, prec, kind, w);
  }
  const auto [L, K] = whitening_factor(prec, kind);
  const auto ones = at::ones({a.size(0)}, a.options());
  if (gram_applicable(a, kIsotropic, a.size(1), b.size(1), a.size(2))) {
    // the metric applied while the Gram form packs the clouds (no whitened copies)
    at::Tensor gram_out;
    if (energy_gram_forward(a, b, beta, ones, w, &gram_out, GramWhiten{L.data_ptr<float>(), K})) return gram_out;
  }
  const auto centre = a.select(1, 0);
  return energy_pairs_forward(op, metric_transform(a, centre, L, K, false), metric_transform(b, centre, L, K, false),
                              beta, ones, kIsotropic, w);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> energy_backward(
    const char* op, const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
    const at::Tensor& prec, int64_t kind, PairWeights w, bool need_a, bool need_b, bool need_beta, bool need_prec,
    at::Tensor* value = nullptr) {
  check_energy_canonical(op, a, b, beta, prec, kind);
  const int64_t B = a.size(0), n = a.size(1), d = a.size(2);
  if (!whiten_metric(kind, d) || B == 0 || n == 0) {
    return energy_pairs_backward(op, grad, a, b, beta, prec, kind, w, need_a, need_b, need_beta, need_prec, value);
  }
  const auto [L, K] = whitening_factor(prec, kind);
  if (!need_prec && !need_beta && value == nullptr && gram_applicable(a, kIsotropic, n, b.size(1), d)) {
    TORCH_CHECK(grad.dim() == 1 && grad.size(0) == B && grad.scalar_type() == a.scalar_type(), op,
                ": grad must be (B,) = (", B, ") of the clouds' dtype, got ", grad.sizes());
    // the metric applied while the Gram form packs the clouds, and Lᵀ as it writes the gradients
    std::pair<at::Tensor, at::Tensor> gram_grads;
    if (energy_gram_backward(grad, a, b, beta, at::ones({B}, a.options()), w, need_a, need_b, &gram_grads,
                             GramWhiten{L.data_ptr<float>(), K})) {
      return {gram_grads.first, gram_grads.second, at::empty({0}, a.options()), at::empty({0}, a.options())};
    }
  }
  const auto centre = a.select(1, 0);
  WhitenedSource src{a, b, at::Tensor(), at::Tensor(), L, K};
  const auto za = metric_transform(a, centre, L, K, false, &src.na), zb = metric_transform(b, centre, L, K, false, &src.nb);
  at::Tensor gza, gzb, gbeta, gz;
  if (need_prec) {
    // the metric gradient at P = I in whitened coordinates
    const auto unit = kind == kDiagonal ? at::ones({B, d}, a.options()) : at::eye(K, a.options()).expand({B, K, K}).contiguous();
    std::tie(gza, gzb, gbeta, gz) =
        energy_pairs_backward(op, grad, za, zb, beta, unit, kind, w, need_a, need_b, need_beta, true, value, &src);
  } else {
    const auto ones = at::ones({B}, a.options());
    std::tie(gza, gzb, gbeta, gz) =
        energy_pairs_backward(op, grad, za, zb, beta, ones, kIsotropic, w, need_a, need_b, need_beta, false, value, &src);
  }
  const at::Tensor none;
  auto ga = need_a ? metric_transform(gza, none, L, K, true) : gza;
  auto gb = need_b ? metric_transform(gzb, none, L, K, true) : gzb;
  at::Tensor gprec = gz;
  if (need_prec) {
    if (kind == kDiagonal) {
      gprec = gz / prec;
    } else {
      const auto Linv = at::linalg_inv(L);
      gprec = at::matmul(at::matmul(Linv.transpose(-1, -2), gz), Linv);
    }
  }
  return {ga, gb, gbeta, gprec};
}

}  // namespace cpu
}  // namespace etweedie
