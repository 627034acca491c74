// Gram-form forward and backward of the CPU pair engine for large d (float32; isotropic p
// applied to q, diagonal and block metrics applied while the clouds are packed: GramWhiten).
//
// Math.  For one pair, q = p‖x − y‖² = p (‖x‖² + ‖y‖² − 2 x·y): the O(d) part of every pair
// becomes one dot product, and a block of dot products is a small matrix product, which a
// register-blocked micro-kernel runs at close to the FMA peak (one FMA per coordinate per pair
// instead of the direct form's subtract + FMA, and 4 rows × NR points share each load).  The
// pair energy E = q^{β/2} and the weighted sums (energy_cpu.h) are applied to each 4 × NR block
// of dots while it is still in registers/L1 — the "epilogue" — so no n × m matrix exists.
//
// Cancellation (the reason torch.cdist's Gram mode loses precision away from the origin):
//   1. both clouds are centred on their pooled mean before anything else; the pair distances
//      are translation invariant, so an offset of 1e3 costs nothing;
//   2. a pair whose Gram value is small next to its norms, q < 2⁻⁶ (‖x‖² + ‖y‖²), is recomputed
//      from the exact differences (rare for distinct points; always for coincident ones, which
//      therefore give exactly q = 0 and E = 0 as in the direct form).
//   With the guard, the float32 rounding of q is at most ~64·√d ulp-relative for the pairs kept
//   in Gram form, well inside the ops' float32 tolerance against the float64 reference.
// Range: rows whose packed coordinates leave [2⁻⁵⁰, 2⁵⁰] are rescaled by a power of two and the
// results scaled back in float64 (GramRange), so clouds at 1e±20 neither overflow nor underflow
// in the squared norms; a row with a NaN or inf gives NaN (never a silent 0).
//
// Work decomposition: the first cloud in blocks of NR points, the second packed once per call
// into panels of NR points stored coordinate-major ((d, NR) each, so the micro-kernel loads NR
// consecutive floats per coordinate); NR = kGramNR, 32 on AVX-512 CPUs (a 4 × 32 kernel in zmm)
// and 16 elsewhere (4 × 16 in ymm).  A task is one (block, panel) tile; cross tiles cover all
// panels, within tiles the circulant half (for_circulant_blocks, diagonal tiles keep j > i), so
// the tasks have equal cost and at::parallel_for's static split is balanced.  Partial sums are
// stored per tile (doubles) and reduced in a fixed order: deterministic for any thread count.
// Memory: the centred clouds and their panels, O((n + m)·d) per row; nothing of size n·m.
//
// The backward (gradients of the clouds, no β / metric gradient asked) uses the same form:
// see "backward" below.  ETWEEDIE_CPU_GRAM=0 turns both off (the direct-difference engine runs).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ETWEEDIE_GRAM_AVX2 1
#endif

#include "energy_tile_cpu.h"
#include "metric_cpu.h"

namespace etweedie {
namespace cpu {

constexpr int64_t kGramMinD = 64;    // below this the direct engine is as fast (few flops per pair)
constexpr int64_t kGramMinPoints = 32;
#if defined(ETWEEDIE_GRAM_AVX2) && defined(__AVX512F__)
constexpr int64_t kGramNR = 32;      // points per panel = points per block: two zmm per row of dots
#else
constexpr int64_t kGramNR = 16;      // points per panel = points per block: two ymm per row of dots
#endif
constexpr int64_t kGramMR = 4;       // rows per micro-kernel call
constexpr float kGramGuard = 1.0f / 64.0f;

#ifdef ETWEEDIE_GRAM_AVX2
// One register of floats, for the register-blocked kernels below, written once for both widths:
// GramYmm (AVX2, 8 lanes) and, on AVX-512 CPUs, GramZmm (16 lanes).
struct GramYmm {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V splat(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#if defined(__AVX512F__)
struct GramZmm {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V splat(const float* p) { return _mm512_set1_ps(*p); }  // an embedded broadcast of the FMA
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

// dots[r·2L + j] = x_r · (column j of the panel), r < 4, for a (d, 2L) coordinate-major panel
// (L = W::kLanes): 4 rows × 2 registers, eight independent FMA chains, 6 loads (two panel
// registers, four broadcasts) per 8 FMAs.
template <class W>
inline void gram_dots_4x2w(const float* x0, const float* x1, const float* x2, const float* x3, const float* panel,
                           int64_t d, float* dots) {
  constexpr int64_t L = W::kLanes, NR = 2 * L;
  typename W::V c00 = W::zero(), c01 = W::zero(), c10 = W::zero(), c11 = W::zero(), c20 = W::zero(),
                c21 = W::zero(), c30 = W::zero(), c31 = W::zero();
  for (int64_t k = 0; k < d; ++k) {
    const auto p0 = W::load(panel + k * NR), p1 = W::load(panel + k * NR + L);
    auto v = W::splat(x0 + k);
    c00 = W::fma(v, p0, c00);
    c01 = W::fma(v, p1, c01);
    v = W::splat(x1 + k);
    c10 = W::fma(v, p0, c10);
    c11 = W::fma(v, p1, c11);
    v = W::splat(x2 + k);
    c20 = W::fma(v, p0, c20);
    c21 = W::fma(v, p1, c21);
    v = W::splat(x3 + k);
    c30 = W::fma(v, p0, c30);
    c31 = W::fma(v, p1, c31);
  }
  W::store(dots, c00);
  W::store(dots + L, c01);
  W::store(dots + 2 * L, c10);
  W::store(dots + 3 * L, c11);
  W::store(dots + 4 * L, c20);
  W::store(dots + 5 * L, c21);
  W::store(dots + 6 * L, c30);
  W::store(dots + 7 * L, c31);
}

// gram_cy_4's register-blocked part: 2L coordinates per step (L = W::kLanes) from k0 while they
// last, eight independent FMA chains; returns the first coordinate it did not do.
template <class W>
inline int64_t gram_cy_4_2w(const float* C, int64_t ldc, const float* Y, int64_t ldy, int64_t nj, int64_t d,
                            int64_t k0, float* const* outs) {
  constexpr int64_t L = W::kLanes;
  for (; k0 + 2 * L <= d; k0 += 2 * L) {
    typename W::V a00 = W::zero(), a01 = W::zero(), a10 = W::zero(), a11 = W::zero(), a20 = W::zero(),
                  a21 = W::zero(), a30 = W::zero(), a31 = W::zero();
    for (int64_t j = 0; j < nj; ++j) {
      const float* yj = Y + j * ldy + k0;
      const auto y0 = W::load(yj), y1 = W::load(yj + L);
      auto c = W::splat(C + j);
      a00 = W::fma(c, y0, a00);
      a01 = W::fma(c, y1, a01);
      c = W::splat(C + ldc + j);
      a10 = W::fma(c, y0, a10);
      a11 = W::fma(c, y1, a11);
      c = W::splat(C + 2 * ldc + j);
      a20 = W::fma(c, y0, a20);
      a21 = W::fma(c, y1, a21);
      c = W::splat(C + 3 * ldc + j);
      a30 = W::fma(c, y0, a30);
      a31 = W::fma(c, y1, a31);
    }
    const typename W::V acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int t = 0; t < 4; ++t) {
      float* o = outs[t] + k0;
      W::store(o, W::add(W::load(o), acc[t][0]));
      W::store(o + L, W::add(W::load(o + L), acc[t][1]));
    }
  }
  return k0;
}
#endif

inline bool gram_env_enabled() {
  static const bool on = [] {
    const char* s = std::getenv("ETWEEDIE_CPU_GRAM");
    return !(s != nullptr && s[0] == '0');
  }();
  return on;
}

// dots[r·16 + j] = x_r · (column j of the panel), r < 4; panel is (d, 16) coordinate-major.
inline void gram_dots_4x16(const float* x0, const float* x1, const float* x2, const float* x3, const float* panel,
                           int64_t d, float* dots) {
  constexpr int64_t NR16 = 16;
#if defined(ETWEEDIE_GRAM_AVX2) && defined(__AVX512F__)
  // One zmm holds a row's 16 dots; four rows would be four dependent FMA chains (one FMA per
  // cycle at a 4-cycle latency), so even and odd coordinates go to separate accumulators: eight
  // independent chains, 10 loads per 8 FMAs (vs 6 per 8 half-width FMAs on AVX2), faster than the
  // AVX2 loop on a CPU with two 512-bit FMA ports (benchmarks/probes/gram_microkernel.c).
  // Used for the 16-point panels of the energy_score row kernel; the pair engine takes 4 × 32.
  __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps(), e2 = _mm512_setzero_ps(), e3 = _mm512_setzero_ps();
  __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps(), o2 = _mm512_setzero_ps(), o3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= d; k += 2) {
    const __m512 pe = _mm512_loadu_ps(panel + k * NR16);
    const __m512 po = _mm512_loadu_ps(panel + (k + 1) * NR16);
    e0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), pe, e0);
    e1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k]), pe, e1);
    e2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k]), pe, e2);
    e3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k]), pe, e3);
    o0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]), po, o0);
    o1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k + 1]), po, o1);
    o2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k + 1]), po, o2);
    o3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k + 1]), po, o3);
  }
  if (k < d) {  // odd d: the last coordinate
    const __m512 pe = _mm512_loadu_ps(panel + k * NR16);
    e0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), pe, e0);
    e1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k]), pe, e1);
    e2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k]), pe, e2);
    e3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k]), pe, e3);
  }
  _mm512_storeu_ps(dots + 0, _mm512_add_ps(e0, o0));
  _mm512_storeu_ps(dots + 16, _mm512_add_ps(e1, o1));
  _mm512_storeu_ps(dots + 32, _mm512_add_ps(e2, o2));
  _mm512_storeu_ps(dots + 48, _mm512_add_ps(e3, o3));
#elif defined(ETWEEDIE_GRAM_AVX2)
  gram_dots_4x2w<GramYmm>(x0, x1, x2, x3, panel, d, dots);
#else
  const float* xs[4] = {x0, x1, x2, x3};
  for (int r = 0; r < 4; ++r) {
    float acc[NR16] = {};
    for (int64_t k = 0; k < d; ++k) {
      const float v = xs[r][k];
      const float* pk = panel + k * NR16;
#pragma omp simd
      for (int64_t j = 0; j < NR16; ++j) acc[j] += v * pk[j];
    }
    for (int64_t j = 0; j < NR16; ++j) dots[r * NR16 + j] = acc[j];
  }
#endif
}

// The register-blocked dot kernel for panels of NR points.
template <int64_t NR>
inline void gram_dots_4x(const float* x0, const float* x1, const float* x2, const float* x3, const float* panel,
                         int64_t d, float* dots) {
  if constexpr (NR == 16) {
    gram_dots_4x16(x0, x1, x2, x3, panel, d, dots);
  } else {
#if defined(ETWEEDIE_GRAM_AVX2) && defined(__AVX512F__)
    static_assert(NR == 32, "gram_dots_4x: panels of 16 or 32 points");
    gram_dots_4x2w<GramZmm>(x0, x1, x2, x3, panel, d, dots);  // the pair engine's panels (kGramNR)
#else
    static_assert(NR == 16, "gram_dots_4x: panels of 32 points need AVX-512");
#endif
  }
}

inline bool gram_applicable(const at::Tensor& a, int64_t kind, int64_t n, int64_t m, int64_t d) {
  return gram_env_enabled() && a.scalar_type() == at::kFloat && kind == kIsotropic && d >= kGramMinD &&
         std::max(n, m) >= kGramMinPoints;
}

// The metric applied while packing (diagonal and block metrics, in-kernel instead of whitened
// copies of the clouds): z = (x − c)·L per row, with L the lower Cholesky factor of the row's
// k×k block precision P_k = L Lᵀ (K = k; L (B, K, K) contiguous), or for a diagonal metric the
// scale √p (K = 0; L (B, d) contiguous); then ‖z_i − z_j‖² = (x_i − x_j)ᵀP(x_i − x_j).
// L == nullptr: no transform (isotropic; p is applied to q).
struct GramWhiten {
  const float* L = nullptr;
  int64_t K = 0;
};

// One centred, packed cloud of a row batch: rows (B, n, d) contiguous, norms (B, n_pad) with
// zero padding, panels (B, n_pad / 16, d, 16) with zero padding.  Inputs have unit stride over
// d (check_energy_canonical) and any stride over rows and points.
struct GramCloud {
  at::Tensor rows, norms, panels;
  int64_t n = 0, nblocks = 0;
  // The source points (the input), from which close pairs are recomputed (gram_close_difference),
  // with the metric and, per row, the range control's power of two (GramRange; 1 unless rescaled).
  const float* src = nullptr;
  int64_t s0 = 0, s1 = 0, lstride = 0;
  GramWhiten wh;
  std::vector<double> scale;
};

// z_i − z_j of a close pair of row r (point i of X, point j of Y) from its source points:
// ((x_i − y_j)·s)·L, the source difference rounded once (two floats differ exactly in double
// unless their exponents are 29 apart, and then by a double rounding), s the row's power of two.
// The packed rows cannot give it: each carries the rounding of its own centring and metric,
// up to 2⁻²⁴ of |z| per coordinate, and a difference much smaller than the points magnifies it
// (10⁴× for a pair 10⁻⁴ apart at unit spread: β < 1 makes such a pair's slope the largest).
inline void gram_close_difference(const GramCloud& X, const GramCloud& Y, int64_t r, int64_t i, int64_t j,
                                  int64_t d, float* out) {
  const float* xi = X.src + r * X.s0 + i * X.s1;
  const float* yj = Y.src + r * Y.s0 + j * Y.s1;
  const double s = X.scale[r];
#pragma omp simd
  for (int64_t k = 0; k < d; ++k)
    out[k] = static_cast<float>((static_cast<double>(xi[k]) - static_cast<double>(yj[k])) * s);
  if (X.wh.L != nullptr) whiten_point<float>(out, nullptr, X.wh.L + r * X.lstride, X.wh.K, d, out);
}

// Centre (x − c, c the pooled mean rounded to float: any common centre preserves the
// distances, and the float subtraction is exact or off by half an ulp of the centred value),
// the metric (wh), norms summed in float64, and the coordinate-major panels, in one pass over
// the cloud.
inline GramCloud gram_pack(const at::Tensor& x, const at::Tensor& centre, bool need_panels,
                           const GramWhiten& wh = GramWhiten{}) {
  GramCloud c;
  const int64_t B = x.size(0), d = x.size(2);
  c.n = x.size(1);
  c.nblocks = (c.n + kGramNR - 1) / kGramNR;
  const int64_t npad = c.nblocks * kGramNR;
  c.rows = at::empty({B, c.n, d}, x.options());
  c.norms = at::zeros({B, npad}, x.options());
  if (need_panels) c.panels = at::zeros({B, c.nblocks, d, kGramNR}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = centre.data_ptr<float>();
  float* rp = c.rows.data_ptr<float>();
  float* np_ = c.norms.data_ptr<float>();
  float* pp = need_panels ? c.panels.data_ptr<float>() : nullptr;
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1), n = c.n;
  const int64_t lstride = wh.L == nullptr ? 0 : (wh.K == 0 ? d : wh.K * wh.K);
  c.src = xp;
  c.s0 = sx0;
  c.s1 = sx1;
  c.wh = wh;
  c.lstride = lstride;
  c.scale.assign(B, 1.0);
  at::parallel_for(0, B * n, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / n, i = p % n;
      const float* xi = xp + b * sx0 + i * sx1;
      const float* cb = cp + b * d;
      float* ri = rp + p * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) ri[k] = xi[k] - cb[k];
      if (wh.L != nullptr) whiten_point<float>(ri, nullptr, wh.L + b * lstride, wh.K, d, ri);
      double nrm = 0;
      for (int64_t k = 0; k < d; ++k) nrm += static_cast<double>(ri[k]) * ri[k];
      np_[b * npad + i] = static_cast<float>(nrm);
      if (pp) {
        float* panel = pp + ((b * c.nblocks + i / kGramNR) * d) * kGramNR + i % kGramNR;
        for (int64_t k = 0; k < d; ++k) panel[k * kGramNR] = ri[k];
      }
    }
  });
  return c;
}

// Per-row range control of the Gram form.  Squared norms of whole points leave float32's range
// long before the points do (‖z‖² of d = 256 coordinates at 1e20 is 2.6e42), so a row whose
// largest packed coordinate lies outside [2⁻⁵⁰, 2⁵⁰] is rescaled in place by 2^{−e} (exact: a
// power of two) with max |z'| ∈ [½, 1), and an isotropic p outside [2⁻⁴⁰, 2⁴⁰] by 2^{−ep}; the
// tiles then work on q' = q·2^{−(2e+ep)} and the caller scales back in float64:
//   E = 2^{Kβ/2} E',   ∂E/∂x = 2^{K(β/2−1)+ep+e} (∂E/∂x)',   K = 2e + ep.
// A row with a NaN or inf coordinate, β or p is flagged bad: its value (and gradients) are NaN.
struct GramRange {
  std::vector<int> e, ep;
  std::vector<char> bad;
  double value_scale(int64_t r, double beta) const { return std::exp2((2.0 * e[r] + ep[r]) * 0.5 * beta); }
  double grad_scale(int64_t r, double beta) const {
    return std::exp2((2.0 * e[r] + ep[r]) * (0.5 * beta - 1.0) + ep[r] + e[r]);
  }
  float prec_scale(int64_t r) const { return std::ldexp(1.0f, -ep[r]); }
};

inline void gram_rescale_cloud(GramCloud& X, int64_t r, int e, int64_t d) {
  const float s = std::ldexp(1.0f, -e);
  X.scale[r] = std::ldexp(1.0, -e);
  const int64_t npad = X.norms.size(1);
  float* rows = X.rows.data_ptr<float>() + r * X.n * d;
  float* norms = X.norms.data_ptr<float>() + r * npad;
  float* panels = X.panels.defined() ? X.panels.data_ptr<float>() + r * X.nblocks * d * kGramNR : nullptr;
  for (int64_t k = 0; k < X.n * d; ++k) rows[k] *= s;
  if (panels)
    for (int64_t k = 0; k < X.nblocks * d * kGramNR; ++k) panels[k] *= s;
  for (int64_t i = 0; i < X.n; ++i) {
    double acc = 0;
    for (int64_t k = 0; k < d; ++k) acc += static_cast<double>(rows[i * d + k]) * rows[i * d + k];
    norms[i] = static_cast<float>(acc);
  }
}

inline GramRange gram_range(GramCloud& X, GramCloud& Y, const at::Tensor& beta, const at::Tensor& prec) {
  const int64_t B = X.rows.size(0), d = X.rows.size(2);
  GramRange g;
  g.e.assign(B, 0);
  g.ep.assign(B, 0);
  g.bad.assign(B, 0);
  const float lo = std::ldexp(1.0f, -50), hi = std::ldexp(1.0f, 50);
  const float plo = std::ldexp(1.0f, -40), phi = std::ldexp(1.0f, 40);
  const float* bp = beta.data_ptr<float>();
  const float* pp = prec.data_ptr<float>();
  const int64_t sb = beta.stride(0), sp = prec.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float m = 0.0f;
      bool finite = std::isfinite(bp[r * sb]) && std::isfinite(pp[r * sp]) && pp[r * sp] > 0.0f;
      for (const GramCloud* C : {&X, &Y}) {
        const float* base = C->rows.data_ptr<float>() + r * C->n * d;
        const int64_t count = C->n * d;
        float mm = 0.0f, nan_probe = 0.0f;
#pragma omp simd reduction(max : mm) reduction(+ : nan_probe)
        for (int64_t k = 0; k < count; ++k) {
          mm = std::max(mm, std::fabs(base[k]));
          nan_probe += base[k] * 0.0f;  // NaN or inf anywhere makes this NaN (max() may drop a NaN)
        }
        finite = finite && nan_probe == 0.0f && mm <= std::numeric_limits<float>::max();
        m = std::max(m, mm);
      }
      if (!finite) {
        g.bad[r] = 1;
        continue;
      }
      if (m != 0.0f && (m < lo || m > hi)) {
        std::frexp(m, &g.e[r]);
        gram_rescale_cloud(X, r, g.e[r], d);
        if (&Y != &X) gram_rescale_cloud(Y, r, g.e[r], d);
      }
      const float p = pp[r * sp];
      if (p < plo || p > phi) std::frexp(p, &g.ep[r]);
    }
  });
  return g;
}

// (B, d) float: the pooled mean of both clouds (accumulated in float64), rounded to float.
inline at::Tensor gram_centre(const at::Tensor& a, const at::Tensor& b) {
  const int64_t B = a.size(0), d = a.size(2), n = a.size(1), m = b.size(1);
  auto centre = at::empty({B, d}, a.options());
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* cp = centre.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> acc(d);
    for (int64_t r = r0; r < r1; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < d; ++k) acc[k] += ap[r * a.stride(0) + i * a.stride(1) + k];
      for (int64_t j = 0; j < m; ++j)
        for (int64_t k = 0; k < d; ++k) acc[k] += bp[r * b.stride(0) + j * b.stride(1) + k];
      for (int64_t k = 0; k < d; ++k) cp[r * d + k] = static_cast<float>(acc[k] / static_cast<double>(n + m));
    }
  });
  return centre;
}

// One tile of row r: block I of cloud X (up to 16 points) against panel J of cloud Y.
struct GramTileView {
  const float* xr;     // X's centred rows of row r
  const float* yr;     // Y's centred rows of row r
  const float* nx;     // X's norms
  const float* ny;     // Y's norms from the panel's first point
  const float* panel;  // Y's panel J, (d, 16)
  const GramCloud& X;  // the clouds (close pairs: gram_close_difference)
  const GramCloud& Y;
  int64_t r, i0, i1, j0, nj, d;

  GramTileView(const GramCloud& X_, const GramCloud& Y_, int64_t r_, int64_t I, int64_t J, int64_t d_)
      : xr(X_.rows.data_ptr<float>() + r_ * X_.n * d_),
        yr(Y_.rows.data_ptr<float>() + r_ * Y_.n * d_),
        nx(X_.norms.data_ptr<float>() + r_ * X_.norms.size(1)),
        ny(Y_.norms.data_ptr<float>() + r_ * Y_.norms.size(1) + J * kGramNR),
        panel(Y_.panels.data_ptr<float>() + (r_ * Y_.nblocks + J) * d_ * kGramNR),
        X(X_),
        Y(Y_),
        r(r_),
        i0(I * kGramNR),
        i1(std::min(X_.n, I * kGramNR + kGramNR)),
        j0(J * kGramNR),
        nj(std::min(kGramNR, Y_.n - J * kGramNR)),
        d(d_) {}

  // For each group of 4 rows: the dots with the panel, then row(t, i, dots of row i) for its
  // rows and group(first row, rows in the group).
  template <typename Row, typename Group>
  void for_groups(Row&& row, Group&& group) const {
    float dots[kGramMR * kGramNR];
    for (int64_t ii = i0; ii < i1; ii += kGramMR) {
      const float* rows[kGramMR];
      for (int64_t t = 0; t < kGramMR; ++t) rows[t] = xr + std::min(ii + t, i1 - 1) * d;
      gram_dots_4x<kGramNR>(rows[0], rows[1], rows[2], rows[3], panel, d, dots);
      const int64_t nr = std::min(kGramMR, i1 - ii);
      for (int64_t t = 0; t < nr; ++t) row(t, ii + t, dots + t * kGramNR);
      group(ii, nr);
    }
  }

  // q[j] = p‖x_i − y_j‖² of row i from its dots, 0 where j is not a pair (j < jlo, j ≥ nj or
  // j = skip).  Pairs with q < 2⁻⁶(‖x_i‖² + ‖y_j‖²) are recomputed from their source points
  // (gram_close_difference, into dz: d floats of scratch) and flagged in exact[j] (when given);
  // returns whether any was.
  bool row_q(int64_t i, const float* dt, int64_t jlo, int64_t skip, float p, float* q, bool* exact,
             float* dz) const {
    const float nxi = nx[i];
    int flagged = 0;  // an int | reduction: GCC leaves a bool || reduction as a scalar loop
#pragma omp simd reduction(| : flagged)
    for (int64_t j = 0; j < kGramNR; ++j) {
      const float s = nxi + ny[j];
      const float v = s - 2.0f * dt[j];
      const bool valid = j >= jlo && j < nj && j != skip;
      q[j] = valid ? v : 0.0f;
      flagged |= static_cast<int>(valid & (v < kGramGuard * s));
    }
    const bool guard = flagged != 0;
    if (exact) std::fill(exact, exact + kGramNR, false);
    if (guard) {
      for (int64_t j = std::max<int64_t>(jlo, 0); j < nj; ++j) {
        if (j == skip || q[j] >= kGramGuard * (nxi + ny[j])) continue;
        gram_close_difference(X, Y, r, i, j0 + j, d, dz);
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < d; ++k) acc += dz[k] * dz[k];
        q[j] = acc;
        if (exact) exact[j] = true;
      }
    }
#pragma omp simd
    for (int64_t j = 0; j < kGramNR; ++j) q[j] = q[j] > 0.0f ? p * q[j] : 0.0f;
    return guard;
  }
};

// Σ over the valid pairs of one tile of E(p q).  tri: X = Y and I = J, so only pairs j > i count.
inline double gram_tile(const GramCloud& X, const GramCloud& Y, int64_t r, int64_t I, int64_t J, bool tri, float p,
                        float beta, int64_t d, float* dz) {
  const GramTileView v(X, Y, r, I, J, d);
  float q[kGramNR];
  double total = 0;
  v.for_groups(
      [&](int64_t, int64_t i, const float* dt) {
        v.row_q(i, dt, tri ? i - v.j0 + 1 : 0, -1, p, q, nullptr, dz);
        total += tile_energy_sum(q, kGramNR, beta);
      },
      [](int64_t, int64_t) {});
  return total;
}

// (B,) weighted pair sums (energy_pairs_forward's contract) in Gram form into *result; float32,
// isotropic prec (B,) applied to q, or the metric applied while packing (wh, prec = 1).  Returns
// true (the Gram form handles every input: see GramRange for the range control and NaN).
inline bool energy_gram_forward(const at::Tensor& a, const at::Tensor& b, const at::Tensor& beta,
                                const at::Tensor& prec, PairWeights w, at::Tensor* result,
                                const GramWhiten& wh = GramWhiten{}) {
  const int64_t B = a.size(0), d = a.size(2);
  auto out = at::zeros({B}, a.options());
  if (B == 0) {
    *result = out;
    return true;
  }
  const bool within_a = w.within_a != 0 && a.size(1) > 1, within_b = w.within_b != 0 && b.size(1) > 1;
  const bool cross = w.cross != 0;
  const auto centre = gram_centre(a, b);
  GramCloud A = gram_pack(a, centre, within_a, wh);
  GramCloud Bc = gram_pack(b, centre, cross || within_b, wh);
  const GramRange range = gram_range(A, Bc, beta, prec);
  const int64_t na = A.nblocks, nb = Bc.nblocks;
  // per-row task grid: cross (na × nb), within a (na × (na/2 + 1)), within b (nb × (nb/2 + 1));
  // within slots beyond a block's circulant half are empty tasks
  const int64_t wa = na / 2 + 1, wb = nb / 2 + 1;
  const int64_t t_cross = cross ? na * nb : 0, t_wa = within_a ? na * wa : 0, t_wb = within_b ? nb * wb : 0;
  const int64_t per_row = t_cross + t_wa + t_wb;
  std::vector<double> part(B * per_row, 0.0);
  const float* betap = beta.data_ptr<float>();
  const float* pp = prec.data_ptr<float>();
  const int64_t sbeta = beta.stride(0), sp = prec.stride(0);
  auto circulant_h = [](int64_t I, int64_t nblk) {
    return (nblk % 2) ? (nblk - 1) / 2 : (I < nblk / 2 ? nblk / 2 : nblk / 2 - 1);
  };
  at::parallel_for(0, B * per_row, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> dz(d);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / per_row;
      int64_t k = t % per_row;
      const float be = betap[r * sbeta], p = pp[r * sp] * range.prec_scale(r);
      double v = 0;
      if (range.bad[r]) {
        part[t] = 0;
        continue;
      }
      if (k < t_cross) {
        v = w.cross * gram_tile(A, Bc, r, k / nb, k % nb, false, p, be, d, dz.data());
      } else if ((k -= t_cross) < t_wa) {
        const int64_t I = k / wa, off = k % wa;
        if (off <= circulant_h(I, na)) {
          const int64_t J = (I + off) % na;
          v = w.within_a * gram_tile(A, A, r, I, J, J == I, p, be, d, dz.data());
        }
      } else {
        k -= t_wa;
        const int64_t I = k / wb, off = k % wb;
        if (off <= circulant_h(I, nb)) {
          const int64_t J = (I + off) % nb;
          v = w.within_b * gram_tile(Bc, Bc, r, I, J, J == I, p, be, d, dz.data());
        }
      }
      part[t] = v;
    }
  });
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    double s = 0;
    for (int64_t k = 0; k < per_row; ++k) s += part[r * per_row + k];
    o[r] = range.bad[r] ? std::numeric_limits<float>::quiet_NaN()
                        : static_cast<float>(s * range.value_scale(r, betap[r * sbeta]));
  }
  *result = out;
  return true;
}

// ------------------------------------------------------------------------- backward
//
// ∂/∂x_i of Σ_j w E(x_i − y_j) = w Σ_j s_ij p (x_i − y_j) = (Σ_j c_ij) x_i − Σ_j c_ij y_j with
// c_ij = w p s_ij (s the pair slope, energy.h).  Per tile: the dots (same micro-kernel as the
// forward), q with the cancellation guard, c_ij, then the row sums of c and the product C·Y,
// a second 4 × 16 register-blocked kernel over the rows of Y; the guarded (close) pairs add
// c_ij (x_i − y_j) from the exact difference instead.  A task owns one block of
// points of one cloud and visits every panel its points pair with (cross: the other cloud;
// within: its own cloud, all panels, i ≠ j), so it writes only its own points' gradients —
// no races, no atomics.  Both clouds' tasks visit nba + nbb panels: the static split is
// balanced.  In centred coordinates (translation invariance) the result is exact to rounding.

// out_t[k] += Σ_{j<nj} C[t·ldc + j] · y_j[k], k < d, for the 4 rows t (y_j = Y + j·ldy,
// row-major): the second product of the Gram form (the gradient), shared by the
// energy-distance tiles (ldc = 16, ldy = d) and the energy-score row kernel
// (energy_score_gram_cpu.h: a block of d coordinates of rows ldy apart, so that the block of
// every y_j stays in L1 across the groups of 4 rows).
inline void gram_cy_4(const float* C, int64_t ldc, const float* Y, int64_t ldy, int64_t nj, int64_t d, float* out0,
                      float* out1, float* out2, float* out3) {
  float* outs[4] = {out0, out1, out2, out3};
  int64_t k0 = 0;
#if defined(ETWEEDIE_GRAM_AVX2) && defined(__AVX512F__)
  k0 = gram_cy_4_2w<GramZmm>(C, ldc, Y, ldy, nj, d, k0, outs);  // 32 coordinates per step
#endif
#ifdef ETWEEDIE_GRAM_AVX2
  k0 = gram_cy_4_2w<GramYmm>(C, ldc, Y, ldy, nj, d, k0, outs);  // then 16
#endif
  for (int t = 0; t < 4; ++t) {
    const float* ct = C + t * ldc;
    for (int64_t j = 0; j < nj; ++j) {
      const float c = ct[j];
      const float* yj = Y + j * ldy;
      float* o = outs[t];
#pragma omp simd
      for (int64_t k = k0; k < d; ++k) o[k] += c * yj[k];
    }
  }
}

// One tile's contribution to the gradients of block I of X against panel J of Y:
// cs[i − i0] += Σ_j c_ij, cy rows (i − i0) += Σ_j c_ij y_j.  self: X = Y and I = J (skip j = i).
// dz: d floats of scratch (close pairs).
inline void gram_grad_tile(const GramCloud& X, const GramCloud& Y, int64_t r, int64_t I, int64_t J, bool self,
                           float p, float beta, float w, int64_t d, float* cs, float* cy, float* dz) {
  const GramTileView v(X, Y, r, I, J, d);
  const float wp = w * p;
  float C[kGramMR * kGramNR];
  float q[kGramNR];
  bool exact[kGramNR];
  v.for_groups(
      [&](int64_t t, int64_t i, const float* dt) {
        float* ct = C + t * kGramNR;
        const bool guarded = v.row_q(i, dt, 0, self ? i - v.j0 : -1, p, q, exact, dz);
        tile_slopes(q, kGramNR, beta, ct);
#pragma omp simd
        for (int64_t j = 0; j < kGramNR; ++j) ct[j] *= wp;
        if (guarded) {
          // A close pair's c (z_i − z_j) from its source points: in the split form
          // c z_i − c z_j the difference would cancel, and c is large there (β < 2).
          float* cyi = cy + (i - v.i0) * d;
          for (int64_t j = 0; j < v.nj; ++j) {
            if (!exact[j]) continue;
            const float c = ct[j];
            ct[j] = 0.0f;
            gram_close_difference(X, Y, r, i, v.j0 + j, d, dz);
#pragma omp simd
            for (int64_t k = 0; k < d; ++k) cyi[k] -= c * dz[k];
          }
        }
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < kGramNR; ++j) sum += ct[j];
        cs[i - v.i0] += sum;
      },
      [&](int64_t ii, int64_t nr) {
        std::fill(C + nr * kGramNR, C + kGramMR * kGramNR, 0.0f);  // rows past the block
        float* base = cy + (ii - v.i0) * d;
        gram_cy_4(C, kGramNR, v.yr + v.j0 * d, d, v.nj, d, base, base + (nr > 1 ? d : 0), base + (nr > 2 ? 2 * d : 0),
                  base + (nr > 3 ? 3 * d : 0));
      });
}

// (grad_a, grad_b) of grad[r] · (weighted pair sums of row r) in Gram form into *result; float32,
// isotropic prec (B,), or the metric applied while packing (wh, prec = 1: the gradients are then
// mapped back, ∂/∂x = (∂/∂z)·Lᵀ, as they are written); an unrequested gradient is an empty
// tensor.  Returns true (range control and NaN: GramRange).
inline bool energy_gram_backward(const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& beta, const at::Tensor& prec, PairWeights w, bool need_a,
                                 bool need_b, std::pair<at::Tensor, at::Tensor>* result,
                                 const GramWhiten& wh = GramWhiten{}) {
  const int64_t B = a.size(0), n = a.size(1), m = b.size(1), d = a.size(2);
  auto ga = need_a ? at::zeros({B, n, d}, a.options()) : at::empty({0}, a.options());
  auto gb = need_b ? at::zeros({B, m, d}, a.options()) : at::empty({0}, a.options());
  if (B == 0 || !(need_a || need_b)) {
    *result = {ga, gb};
    return true;
  }
  const auto g = grad.contiguous();
  const auto centre = gram_centre(a, b);
  const bool within_a = w.within_a != 0 && n > 1, within_b = w.within_b != 0 && m > 1, cross = w.cross != 0;
  GramCloud A = gram_pack(a, centre, (need_b && cross) || (need_a && within_a), wh);
  GramCloud Bc = gram_pack(b, centre, (need_a && cross) || (need_b && within_b), wh);
  const GramRange range = gram_range(A, Bc, beta, prec);
  const int64_t lstride = wh.L == nullptr ? 0 : (wh.K == 0 ? d : wh.K * wh.K);
  const int64_t na = A.nblocks, nb = Bc.nblocks;
  const int64_t ta = need_a ? na : 0, tb = need_b ? nb : 0, per_row = ta + tb;
  const float* betap = beta.data_ptr<float>();
  const float* pp = prec.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* gap = need_a ? ga.data_ptr<float>() : nullptr;
  float* gbp = need_b ? gb.data_ptr<float>() : nullptr;
  const int64_t sbeta = beta.stride(0), sp = prec.stride(0);
  at::parallel_for(0, B * per_row, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> cs(kGramNR), cy(kGramNR * d), LT(16), dz(d);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / per_row, k = t % per_row;
      const bool on_a = k < ta;
      const GramCloud& X = on_a ? A : Bc;
      const GramCloud& Other = on_a ? Bc : A;
      const int64_t I = on_a ? k : k - ta;
      const float be = betap[r * sbeta], p = pp[r * sp] * range.prec_scale(r);
      const float w_self = static_cast<float>(on_a ? w.within_a : w.within_b);
      const bool self_pairs = on_a ? within_a : within_b;
      const int64_t i0 = I * kGramNR, i1 = std::min(X.n, i0 + kGramNR);
      if (range.bad[r]) {  // NaN/inf in the row: NaN gradients, never a silent 0
        float* out = (on_a ? gap : gbp) + r * X.n * d;
        std::fill(out + i0 * d, out + i1 * d, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      std::fill(cs.begin(), cs.end(), 0.0f);
      std::fill(cy.begin(), cy.end(), 0.0f);
      if (cross)
        for (int64_t J = 0; J < Other.nblocks; ++J)
          gram_grad_tile(X, Other, r, I, J, false, p, be, static_cast<float>(w.cross), d, cs.data(), cy.data(),
                         dz.data());
      if (self_pairs)
        for (int64_t J = 0; J < X.nblocks; ++J)
          gram_grad_tile(X, X, r, I, J, J == I, p, be, w_self, d, cs.data(), cy.data(), dz.data());
      const float gr = static_cast<float>(gp[r] * range.grad_scale(r, be));
      const float* xr = X.rows.data_ptr<float>() + r * X.n * d;
      float* out = (on_a ? gap : gbp) + r * X.n * d;
      const float* Lr = wh.L != nullptr ? wh.L + r * lstride : nullptr;
      if (Lr != nullptr && wh.K > 0) {  // Lᵀ for the row-vector map ∂/∂x = (∂/∂z)·Lᵀ
        for (int64_t ra = 0; ra < wh.K; ++ra)
          for (int64_t cb = 0; cb < wh.K; ++cb) LT[ra * wh.K + cb] = Lr[cb * wh.K + ra];
      }
      for (int64_t i = i0; i < i1; ++i) {
        const float c = cs[i - i0];
        const float* xi = xr + i * d;
        const float* cyi = cy.data() + (i - i0) * d;
        float* o = out + i * d;
#pragma omp simd
        for (int64_t kk = 0; kk < d; ++kk) o[kk] = gr * (c * xi[kk] - cyi[kk]);
        if (Lr != nullptr) whiten_point<float>(o, nullptr, wh.K == 0 ? Lr : LT.data(), wh.K, d, o);
      }
    }
  });
  *result = {ga, gb};
  return true;
}

}  // namespace cpu
}  // namespace etweedie
