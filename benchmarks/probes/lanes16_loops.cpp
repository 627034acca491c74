// The forward loops of the 16-lane CPU score kernels (csrc/cpu/lanes16_cpu.h) on one row of 256
// draws at d = 784 that stays in L2, one thread: ns per 16 coordinates of one draw for float32,
// bfloat16 and float16 draws, isotropic metric, best of seven timed loops.
//   two passes   quad16<4> then accumulate16<4> per group of four draws (the loops before the
//                one-sweep kernels)
//   one sweep    a group's accumulation and the next group's q in accumulate_quad16 (the kernels)
//   q sweep      quad16<4> alone (the first pass's share)
// Build and run from the repository root:
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -fno-trapping-math -fopenmp-simd \
//     benchmarks/probes/lanes16_loops.cpp -o /tmp/lanes16_loops && /tmp/lanes16_loops
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "../../csrc/cpu/et_score_cpu.h"

using namespace etweedie;
using namespace etweedie::cpu;

struct Isotropic {  // P u for the unit isotropic metric, as MetricLanes16 applies it
  template <typename V>
  V operator()(V u, int64_t) const { return u; }
};

enum Mode { kTwoPasses, kOneSweep, kQSweep };

template <typename X>
double ns_per_step(Mode mode, int64_t N, int64_t d, int reps) {
  using W = typename Form16<X>::type;  // the form the kernels take for this draw format
  std::mt19937 g(0);
  std::normal_distribution<float> normal;
  std::vector<float> y(d), acc(d);
  for (auto& v : y) v = normal(g);
  std::vector<X> x(static_cast<size_t>(N * d));
  for (size_t i = 0; i < x.size(); ++i) x[i] = narrow<X>(y[i % d] + normal(g));
  const ResidualWeight<float> weight{1.4f};
  const Isotropic pu;
  auto group = [&](int64_t i, const X** out) {
    for (int t = 0; t < 4; ++t) out[t] = x.data() + (i + t) * d;
  };
  double best = 1e30;
  float sink = 0;
  for (int round = 0; round < 7; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      float q[4], w[4];
      if (mode == kOneSweep) {
        const X* xs[4];
        group(0, xs);
        quad16<W, 4>(y.data(), xs, d, pu, q);
      }
      for (int64_t i = 0; i + 4 <= N; i += 4) {
        const X *xs[4], *nx[4], *nnx[4];
        group(i, xs);
        if (mode != kOneSweep) quad16<W, 4>(y.data(), xs, d, pu, q);
        if (mode == kQSweep) {
          sink += q[0] + q[1] + q[2] + q[3];  // all four, or the compiler drops three sums
          continue;
        }
        for (int t = 0; t < 4; ++t) w[t] = weight(q[t]);
        sink += w[0];
        if (i + 8 > N) {
          accumulate16<W, 4>(y.data(), xs, w, d, acc.data());
          continue;
        }
        group(i + 4, nx);
        if (i + 12 <= N) group(i + 8, nnx);
        if (mode == kOneSweep) {
          accumulate_quad16<W, X>(y.data(), xs, w, nx, d, pu, acc.data(), q, i + 12 <= N ? nnx : nullptr);
        } else {
          accumulate16<W, 4>(y.data(), xs, w, d, acc.data(), nx);
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / reps / (static_cast<double>(N) * d / 16) * 1e9);
  }
  if (sink == 12345.0f) std::printf(" ");
  return best;
}

int main() {
  const int64_t N = 256, d = 784;
  const char* names[] = {"two passes", "one sweep", "q sweep"};
  for (Mode mode : {kTwoPasses, kOneSweep, kQSweep}) {
    std::printf("%-11s float32 %.3f  bfloat16 %.3f  float16 %.3f  ns per 16 coordinates of a draw\n", names[mode],
                ns_per_step<float>(mode, N, d, 800), ns_per_step<bf16>(mode, N, d, 800),
                ns_per_step<fp16>(mode, N, d, 800));
  }
}
