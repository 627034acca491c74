// The CPU score kernels' per-row loops (csrc/cpu/et_score_cpu.h: weighted_residual_sum and
// weighted_residual_sum_bwd) on fixed pseudo-random inputs, every output printed as hex floats,
// so that tests/test_lanes16.py can compare builds of the same header at several ISA levels: the
// 16-lane loops (lanes16_cpu.h) in their 512-bit and AVX2 forms, with the helpers of each level,
// against the generic loops of a plain x86-64 build (-DETWEEDIE_LANES16_AVX2 selects the AVX2 form
// for every draw format on an AVX-512 CPU).
//
// Cases: float32, bfloat16 and float16 draws; isotropic, diagonal and k×k block metrics (k = 1,
// 2, 4; the 16-lane loops' metrics) and k = 3 (generic loops at every level); N = 1, 3, 4, 7, 8,
// 13 (groups of four, the one-sweep pairs of groups, single draws after them); d = 16, 48, 784; one
// exact coincidence (x = y: weight 0) in some cases.  Output per case: a header line, then the
// forward's sum and flag, the backward's ∂/∂y, the β-gradient term, and ∂/∂x widened to float.
//
//   g++ -O3 -std=c++17 -fopenmp-simd -march=native -I csrc/cpu -I csrc/common \
//       $(python -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))") \
//       tests/cpp/lanes16_check.cpp -o /tmp/lanes16_check && /tmp/lanes16_check
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "et_score_cpu.h"

using namespace etweedie;
using namespace etweedie::cpu;

namespace {

// xorshift64* and a sum of uniforms: reproducible across builds (no <random> distribution,
// whose algorithms the standard leaves to the library).
struct Rng {
  uint64_t s;
  double uniform() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<double>((s * 2685821657736338717ULL) >> 11) * 0x1.0p-53;
  }
  float normal() {
    double a = 0;
    for (int i = 0; i < 4; ++i) a += uniform();
    return static_cast<float>((a - 2.0) * 1.7320508075688772);
  }
};

template <typename X>
const char* name_of();
template <>
const char* name_of<float>() { return "float32"; }
template <>
const char* name_of<bf16>() { return "bfloat16"; }
template <>
const char* name_of<fp16>() { return "float16"; }

void print_row(const char* label, const float* v, int64_t n) {
  std::printf("%s", label);
  for (int64_t i = 0; i < n; ++i) std::printf(" %a", static_cast<double>(v[i]));
  std::printf("\n");
}

// The metric's parameter: isotropic p, diagonal p_j, or a symmetric positive definite k×k block.
std::vector<float> metric_param(int kind, int k, int64_t d, Rng& rng) {
  if (kind == kIsotropic) return {1.3f};
  if (kind == kDiagonal) {
    std::vector<float> p(d);
    for (auto& v : p) v = 0.5f + static_cast<float>(rng.uniform());
    return p;
  }
  std::vector<float> a(k * k), p(k * k);
  for (auto& v : a) v = 0.4f * rng.normal();
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) {
      float s = i == j ? 1.0f : 0.0f;
      for (int t = 0; t < k; ++t) s += a[i * k + t] * a[j * k + t];
      p[i * k + j] = s;
    }
  return p;
}

template <typename X, typename Prec>
void run_case(int kind, int k, int64_t N, int64_t d, bool coincident, Rng& rng) {
  std::vector<float> y(d), h(d), acc(d, 0.0f), gy(d, 0.0f), gxrow(4 * d), gxf(N * d);
  std::vector<X> x(N * d);
  for (auto& v : y) v = rng.normal();
  for (auto& v : h) v = rng.normal();
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < d; ++j) x[i * d + j] = narrow<X>(y[j] + rng.normal());
  if (coincident) {
    for (int64_t j = 0; j < d; ++j) y[j] = widen<float>(x[(N / 2) * d + j]);  // draw N/2 on the query
  }
  const float beta = 0.6f + static_cast<float>(rng.uniform());
  std::vector<float> param = metric_param(kind, k, d, rng), pattern;
  Prec P{param.data()};
  prepare_row(P, pattern, d);
  // gx 64-byte aligned, as torch's CPU allocator gives it (the streaming stores need 32 or 64)
  X* gx = static_cast<X*>(std::aligned_alloc(64, (N * d * sizeof(X) + 63) / 64 * 64));
  DrawRows<X> rows;
  const bool in_range = weighted_residual_sum<float, Prec, X>(P, y.data(), x.data(), d, N, d,
                                                              ResidualWeight<float>{beta}, acc.data());
  const float gshape = weighted_residual_sum_bwd<float, Prec, X>(P, ResidualWeight<float>{beta}, y.data(), x.data(),
                                                                 d, N, d, h.data(), gy.data(), gx, nullptr, true,
                                                                 rows, gxrow.data());
  for (int64_t i = 0; i < N * d; ++i) gxf[i] = widen<float>(gx[i]);
  std::free(gx);
  std::printf("case %s kind=%d k=%d N=%lld d=%lld coincident=%d\n", name_of<X>(), kind, k,
              static_cast<long long>(N), static_cast<long long>(d), coincident ? 1 : 0);
  print_row("acc", acc.data(), d);
  std::printf("in_range %d\n", in_range ? 1 : 0);
  print_row("gy", gy.data(), d);
  print_row("gshape", &gshape, 1);
  print_row("gx", gxf.data(), N * d);
}

template <typename X>
void run_format(Rng& rng) {
  for (int64_t d : {16, 48, 784}) {
    for (int64_t N : {1, 3, 4, 7, 8, 13}) {
      const bool coincident = N == 7 || N == 13;
      run_case<X, RowPrec<float, kIsotropic, 0>>(kIsotropic, 0, N, d, coincident, rng);
      run_case<X, RowPrec<float, kDiagonal, 0>>(kDiagonal, 0, N, d, coincident, rng);
      run_case<X, RowPrec<float, kBlock, 1>>(kBlock, 1, N, d, coincident, rng);
      run_case<X, RowPrec<float, kBlock, 2>>(kBlock, 2, N, d, coincident, rng);
      run_case<X, RowPrec<float, kBlock, 4>>(kBlock, 4, N, d, coincident, rng);
      if (d % 3 == 0) run_case<X, RowPrec<float, kBlock, 3>>(kBlock, 3, N, d, coincident, rng);
    }
  }
}

}  // namespace

int main() {
  Rng rng{0x9E3779B97F4A7C15ULL};
  std::printf("lanes512 %d lanes16 %d\n", ETWEEDIE_LANES512, ETWEEDIE_LANES16);
  run_format<float>(rng);
  run_format<bf16>(rng);
  run_format<fp16>(rng);
  return 0;
}
