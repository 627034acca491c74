// Row kernel of the CPU energy score and energy distance for small d (d ≤ kSmallD) and many rows
// — the Engression training shape in low dimension (e.g. B = 128 examples × M = 64 draws in d = 2)
// and batched low-dimensional energy distances: one task per row, the row's points held in
// structure-of-arrays form so that every loop over pairs is a contiguous vector loop.  Math:
// csrc/common/energy.h; both losses are, per row, with E(u) = (uᵀPu)^{β/2},
//   w_ab Σ_{i,j} E(a_i − b_j) + w_aa Σ_{i<j} E(a_i − a_j) + w_bb Σ_{i<j} E(b_i − b_j)
// (energy score: a = the M draws, b = the target alone; energy distance: the two clouds).
//
// Per row, each cloud's points in SoA form and stored twice over (U[k][j + n] = U[k][j]):
//   within pairs of a cloud of n points: by offset o = 1 … ⌊n/2⌋, the pairs (j, j + o mod n) for
//     all j form one run W[k][j] = U[k][j] − U[k][j + o] of n pairs (n/2 at o = n/2 for even n,
//     whose pairs would otherwise come twice), and the gradient goes to both points by two vector
//     updates, GA[k][j] += w s_j W[k][j] and GB[k][j + o] −= w s_j W[k][j], folded at the end as
//     G[k][j] = GA[k][j] + GB[k][j] + GB[k][j + n];
//   cross pairs: for each point b_j, the run of all a_i − b_j (its gradient a reduction for b_j).
// Every unordered pair once, from its direct difference, one power per pair for the energy and
// the slope (tile_energies_and_slopes), one weight per run; ∂/∂z_j = g·P G_j.  Before the runs by
// offset, draw i's run held the M − 1 − i pairs after it: at M = 64 those short runs spent more
// time in loop set-up and remainders than in the pairs' powers (4.3 against 1.2 ns a pair, one
// thread, β = 1.5).  (One run over the union of both clouds measured slower for the energy
// score: its runs of M + 1 pairs leave a remainder in every vector loop, and a weight per pair
// costs a load in each.)  The general engine (energy_cpu.h) scatters strided gradients and is
// about twice as slow again.
// Memory: O((n + m)·d) scratch per thread; nothing of size n·m.  β and metric gradients are not
// produced here (the training loss needs only the points'); those calls use the general engine.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "energy_tile_cpu.h"
#include "et_score_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kRowsMaxM = 4096;  // points per row (n + m); scratch per thread: ~6·(n + m)·d values

// Whether the row kernel serves a call on clouds of n and m points (B rows, dimension d).
inline bool energy_rows_applicable(int64_t B, int64_t n, int64_t m, int64_t d, bool need_beta, bool need_prec) {
  return !need_beta && !need_prec && d >= 1 && d <= kSmallD && n >= 1 && m >= 1 && n + m <= kRowsMaxM &&
         B >= 2 * static_cast<int64_t>(at::get_num_threads());
}

inline bool energy_score_rows_applicable(const at::Tensor& samples, bool need_beta, bool need_prec) {
  return samples.size(1) >= 2 &&
         energy_rows_applicable(samples.size(0), samples.size(1), 1, samples.size(2), need_beta, need_prec);
}

// One task per row; Prec is the row's precision view (metric_cpu.h).  a (B, n, d) and b (B, m, d)
// with strides (sa0, sa1) and (sb0, sb1); value (B,), ga (B, n, d), gb (B, m, d) contiguous, each
// optional; gp the upstream gradient (B,) or null (1).
template <typename T, typename Prec>
void energy_rows_impl(const T* ap, int64_t sa0, int64_t sa1, int64_t n, const T* bp_, int64_t sb0, int64_t sb1,
                      int64_t m, const T* betap, int64_t sbeta, const T* pp, int64_t sp, const T* gp, int64_t gstride,
                      int64_t B, int64_t d, PairWeights w, T* vp, T* gap, T* gbp) {
  const int64_t np = (n + 15) / 16 * 16, mp = (m + 15) / 16 * 16, rp = std::max(np, mp);
  const bool need_grad = gap != nullptr || gbp != nullptr;
  const T w_aa = static_cast<T>(w.within_a), w_bb = static_cast<T>(w.within_b), w_ab = static_cast<T>(w.cross);
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    // per cloud: its points twice over (U), the gradient sums GA and GB (GB's second half folds back)
    std::vector<T> Ua(2 * d * np), Ub(2 * d * mp), W(d * rp), q(rp), e(rp), s(rp);
    std::vector<T> GAa(need_grad ? d * np : 0), GBa(need_grad ? 2 * d * np : 0), GAb(need_grad ? d * mp : 0),
        GBb(need_grad ? 2 * d * mp : 0);
    T* const Wd = W.data();  // raw pointers for the vector loops (no vector accessors through captures)
    T* const qd = q.data();
    T* const ed = e.data();
    T* const sd = s.data();
    T tmp[kSmallD];
    for (int64_t r = r0; r < r1; ++r) {
      const Prec P{pp + r * sp};
      const T be = betap[r * sbeta];
      const T* ar = ap + r * sa0;
      const T* br = bp_ + r * sb0;
      for (int64_t k = 0; k < d; ++k) {  // cloud k-rows from U + 2k·np, each copied right after itself
        T* Uak = Ua.data() + 2 * k * np;
        for (int64_t j = 0; j < n; ++j) Uak[j] = Uak[n + j] = ar[j * sa1 + k];
        T* Ubk = Ub.data() + 2 * k * mp;
        for (int64_t j = 0; j < m; ++j) Ubk[j] = Ubk[m + j] = br[j * sb1 + k];
      }
      if (need_grad) {
        std::fill(GAa.begin(), GAa.end(), T(0));
        std::fill(GBa.begin(), GBa.end(), T(0));
        std::fill(GAb.begin(), GAb.end(), T(0));
        std::fill(GBb.begin(), GBb.end(), T(0));
      }
      double val = 0;
      // q, E (and slopes) of the len pairs in W, weighted by wt: returns wt Σ E
      auto energies = [&](int64_t len, T wt) -> double {
        P.quad_soa(Wd, rp, len, d, qd);
        if (!need_grad) return wt * tile_energy_sum(qd, len, be);
        return wt * tile_energies_and_slopes(qd, len, be, ed, sd);
      };
      // within pairs of one cloud (cnt points, U and its stride), by offset
      auto within = [&](const T* U, int64_t cnt, int64_t stride, T wt, T* GA, T* GB) {
        if (wt == T(0) || cnt < 2) return;
        for (int64_t o = 1; 2 * o <= cnt; ++o) {
          const int64_t len = 2 * o == cnt ? cnt / 2 : cnt;
          for (int64_t k = 0; k < d; ++k) {
            const T* Uk = U + 2 * k * stride;
            T* Wk = Wd + k * rp;
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) Wk[j] = Uk[j] - Uk[j + o];
          }
          val += energies(len, wt);
          if (!need_grad) continue;
          for (int64_t k = 0; k < d; ++k) {
            const T* Wk = Wd + k * rp;
            T* GAk = GA + k * stride;
            T* GBk = GB + 2 * k * stride + o;
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) {
              const T f = wt * sd[j] * Wk[j];
              GAk[j] += f;
              GBk[j] -= f;
            }
          }
        }
      };
      within(Ua.data(), n, np, w_aa, GAa.data(), GBa.data());
      within(Ub.data(), m, mp, w_bb, GAb.data(), GBb.data());
      // cross pairs: for each b_j, the run of all a_i − b_j
      for (int64_t jb = 0; jb < m && w_ab != T(0); ++jb) {
        for (int64_t k = 0; k < d; ++k) {
          const T* Uak = Ua.data() + 2 * k * np;
          const T bk = Ub[2 * k * mp + jb];
          T* Wk = Wd + k * rp;
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) Wk[i] = Uak[i] - bk;
        }
        val += energies(n, w_ab);
        if (!need_grad) continue;
        for (int64_t k = 0; k < d; ++k) {
          const T* Wk = Wd + k * rp;
          T* GAk = GAa.data() + k * np;
          T acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < n; ++i) {
            const T f = w_ab * sd[i] * Wk[i];
            GAk[i] += f;
            acc += f;
          }
          GAb[k * mp + jb] -= acc;
        }
      }
      if (vp) vp[r] = static_cast<T>(val);
      if (!need_grad) continue;
      const T g = gp ? gp[r * gstride] : T(1);
      // ∂/∂ of point j of a cloud (cnt points): g·P (GA_j + GB_j + GB_{j+cnt})
      auto point_grads = [&](const T* GA, const T* GB, int64_t cnt, int64_t stride, T* out) {
        for (int64_t j = 0; j < cnt; ++j) {
          for (int64_t k = 0; k < d; ++k) {
            const T* GBk = GB + 2 * k * stride;
            tmp[k] = GA[k * stride + j] + (GBk[j] + GBk[j + cnt]);
          }
          P.apply(tmp, g, out + (r * cnt + j) * d, d);
        }
      };
      if (gap) point_grads(GAa.data(), GBa.data(), n, np, gap);
      if (gbp) point_grads(GAb.data(), GBb.data(), m, mp, gbp);
    }
  });
}

// value (B,) if given; ga (B, n, d) / gb (B, m, d) contiguous, scaled by grad[r] when grad is given
// (else 1).  a (B, n, d) and b (B, m, d) with unit stride over d.
inline void energy_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta, const at::Tensor& prec,
                        int64_t kind, PairWeights w, const at::Tensor* grad, at::Tensor* value, at::Tensor* ga,
                        at::Tensor* gb) {
  const int64_t B = a.size(0), n = a.size(1), m = b.size(1), d = a.size(2);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "energy_rows", [&] {
    using T = scalar_t;
    const int64_t K = kind == kBlock ? prec.size(1) : 0;
    ET_DISPATCH_METRIC(kind, K, T, [&] {
      energy_rows_impl<T, Prec>(a.data_ptr<T>(), a.stride(0), a.stride(1), n, b.data_ptr<T>(), b.stride(0),
                                b.stride(1), m, beta.data_ptr<T>(), beta.stride(0), prec.data_ptr<T>(),
                                prec.stride(0), grad ? grad->data_ptr<T>() : nullptr, grad ? grad->stride(0) : 0, B,
                                d, w, value ? value->data_ptr<T>() : nullptr, ga ? ga->data_ptr<T>() : nullptr,
                                gb ? gb->data_ptr<T>() : nullptr);
    });
  });
}

// The energy score's call: the draws x (B, M, d) as a, the target y (B, d) as a one-point b.
inline void energy_score_rows(const at::Tensor& x, const at::Tensor& y, const at::Tensor& beta,
                              const at::Tensor& prec, int64_t kind, PairWeights w, const at::Tensor* grad,
                              at::Tensor* value, at::Tensor* gx, at::Tensor* gy) {
  energy_rows(x, y.unsqueeze(1), beta, prec, kind, w, grad, value, gx, gy);
}

}  // namespace cpu
}  // namespace etweedie
