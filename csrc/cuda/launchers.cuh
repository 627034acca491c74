// Host-side entry points of the CUDA kernels (csrc/cuda/<op>_cuda.cu).  Plain C++ over the
// CUDA runtime: raw pointers, sizes, element strides and a stream — no torch types — so that
// the .cu files compile with plain nvcc and only csrc/cuda/bindings.cpp needs a CUDA torch.
//
// Canonical arguments (etweedie/ops/_rows.py, csrc/etweedie.cpp):
//   y (B, d) contiguous; x (B, N, d) with element strides sxb, sxn over B and N (0 = shared)
//   and unit stride over d; beta/lam/step (B,) with strides sb/sl/sa; prec (B, *param) with
//   row stride sp and contiguous parameter dims; kind 0 isotropic, 1 diagonal, 2 block (k ≤ 4).
// Outputs are contiguous.  Every launcher returns the launch's cudaError_t (cudaSuccess when
// there is nothing to do) and never synchronizes.
// The score launchers take the compute type T (float, double: y, the parameters, every output
// but ∂L/∂x) and the draws' storage type X (T, bf16 or fp16: x and ∂L/∂x), instantiated for
// X ∈ {T, bf16, fp16} (ET_SCORE_TYPES); 16-bit draws are widened to T where they are loaded.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/low_precision.h"  // bf16 / fp16: the 16-bit storage of low-precision draws

// The (T, X) pairs every score launcher is instantiated for: INSTANTIATE(T, X) for each, in the
// source that defines the launcher (dispatch_draws, csrc/common/draws_dispatch.h, picks one).
#define ET_SCORE_TYPES(INSTANTIATE)                                                                   \
  INSTANTIATE(float, float) INSTANTIATE(float, bf16) INSTANTIATE(float, fp16) INSTANTIATE(double, double) \
  INSTANTIATE(double, bf16) INSTANTIATE(double, fp16)

namespace etweedie {
namespace cuda {

template <typename T, typename X = T>
struct EtScoreArgs {
  const T* y;
  const X* x;
  const T* beta;
  const T* lam;
  const T* prec;
  const T* noise;  // langevin_step only (B, d) contiguous
  const T* step;   // langevin_step only (B,)
  int64_t B, N, d;
  int64_t sxb, sxn, sb, sl, sp, sa;
  int kind, kblock;
};

// out = s = −λ P m (or, for langevin_step, y + α s + sqrt(2α) ξ) and m = (1/N) Σ w_i u_i, (B, d).
template <typename T, typename X>
cudaError_t et_score_fwd_launch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream);
template <typename T, typename X>
cudaError_t langevin_step_fwd_launch(const EtScoreArgs<T, X>& a, T* out, T* m, cudaStream_t stream);

// Gradients of et_score_fwd.  grad, grad_m, m: (B, d) contiguous.  Outputs (null = not
// requested): gy (B, d), gx (B, N, d) in the draws' type, gb (B,), gl (B,), gp (B, *param), all
// contiguous and fully written (no zero-initialization needed).
template <typename T, typename X>
cudaError_t et_score_bwd_launch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy, X* gx,
                                T* gb, T* gl, T* gp, cudaStream_t stream);

// The Student-t score s = −2c P m, m = (1/N) Σ_i (y − x_i)/(1 + q_i) (csrc/common/student_t_score.h):
// the same arguments with c in lam's place (beta and noise/step unread), and its gradients, ∂L/∂c
// in gc (B,) where et_score's backward writes ∂L/∂λ, no ∂L/∂β.
template <typename T, typename X>
cudaError_t student_t_score_fwd_launch(const EtScoreArgs<T, X>& a, T* s, T* m, cudaStream_t stream);
template <typename T, typename X>
cudaError_t student_t_score_bwd_launch(const EtScoreArgs<T, X>& a, const T* grad, const T* grad_m, const T* m, T* gy,
                                       X* gx, T* gc, T* gp, cudaStream_t stream);

// Importance-sampling oracle: y (Q, d), bank (M, d), prec (1, *param), all contiguous.
// Outputs score (Q, d), mean (Q, d), ess (Q,).
template <typename T>
cudaError_t is_score_fwd_launch(const T* y, const T* bank, const T* prec, int64_t Q, int64_t M, int64_t d, T beta,
                                T lam, int kind, int kblock, T* score, T* mean, T* ess, cudaStream_t stream);

// Pairwise energy ops (csrc/cuda/energy_cuda.cuh): clouds a (B, n, d) and c (B, m, d) with
// element strides over rows and points and unit stride over d (energy_score: a = samples,
// c = the target as a one-point cloud); beta (B,) with stride sb; p the metric parameters
// (B, *param) of kind 0/1/2 and block size kblock (as prec above) with row stride sp, applied in
// the kernels; grad (B,) with stride sg, the upstream gradient (null = 1 for every row).
template <typename T>
struct EnergyArgs {
  const T* a;
  const T* c;
  const T* beta;
  const T* p;
  const T* grad;
  int64_t B, n, m, d;
  int64_t sab, san, scb, scn, sb, sp, sg;
  int kind, kblock;
  bool split;  // the coordinate-split kernels (energy_split_path); false = the tiled pair kernels
};

// Whether rows of clouds with n and m points in d dimensions take the coordinate-split
// kernels (small clouds at large d, energy_cuda.cuh; ETWEEDIE_CUDA_ENERGY_SPLIT=0 in the
// environment says no): the caller decides once and passes the answer as EnergyArgs::split.
bool energy_split_path(int64_t n, int64_t m, int64_t d);

// Doubles of workspace the energy launchers need (per-block partial sums; for the split path
// the chunk shares of q and the pair coefficients, elements of elem_bytes, metric blocks of
// size kblock); the caller allocates it (no zero-fill needed).
int64_t energy_workspace_doubles(int64_t B, int64_t n, int64_t m, int64_t d, int64_t elem_bytes, bool split,
                                 int kblock);

// Outputs (null = not requested): value (B,); ga (B, n, d) and gc (B, m, d) contiguous (gradients
// of Σ_r grad[r]·V_r), ZERO-FILLED by the caller unless EnergyArgs::split (the split kernels
// store every element); gbeta (B,) = Σ_r grad[r]·∂V_r/∂β.
template <typename T>
cudaError_t energy_score_launch(const EnergyArgs<T>& a, bool fair, T* value, T* ga, T* gc, T* gbeta,
                                double* workspace, cudaStream_t stream);
template <typename T>
cudaError_t energy_distance_launch(const EnergyArgs<T>& a, bool unbiased, T* value, T* ga, T* gc, T* gbeta,
                                   double* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace etweedie
