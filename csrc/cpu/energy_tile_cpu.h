// Per-tile math of the CPU pair engine (energy_cpu.h, energy_gram_cpu.h): pair energies and
// slopes over a run of squared distances, with the β branch hoisted out of the vectorized
// loops, and the weights of the three pair sums.  Math: csrc/common/energy.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/energy.h"

namespace etweedie {
namespace cpu {

// Weights of the three pair sums of a row: w_cross Σ_{i,j} E(a_i − b_j) + w_a Σ_{i<j} E(a_i − a_j)
// + w_b Σ_{i<j} E(b_i − b_j).
struct PairWeights {
  double cross, within_a, within_b;
};

// ------------------------------------------------------------------------- tile math (small d)

// Σ_t E(q_t); the β branch is hoisted out of the vectorized loops.
template <typename T>
inline T tile_energy_sum(const T* q, int64_t n, T beta) {
  T s = 0;
  if (beta == T(1)) {
#pragma omp simd reduction(+ : s)
    for (int64_t t = 0; t < n; ++t) s += q[t] > T(0) ? std::sqrt(q[t]) : T(0);
  } else if (beta == T(2)) {
#pragma omp simd reduction(+ : s)
    for (int64_t t = 0; t < n; ++t) s += q[t] > T(0) ? q[t] : T(0);
  } else {
    const T h = T(0.5) * beta;
#pragma omp simd reduction(+ : s)
    for (int64_t t = 0; t < n; ++t) s += pow_pos(q[t], h);
  }
  return s;
}

template <typename T>
inline void tile_slopes(const T* q, int64_t n, T beta, T* s) {
  if (beta == T(1)) {
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = q[t] > T(0) ? T(1) / std::sqrt(q[t] > T(0) ? q[t] : T(1)) : T(0);
  } else if (beta == T(2)) {
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = q[t] > T(0) ? T(2) : T(0);
  } else {
    const T h = T(0.5) * (beta - T(2));
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = beta * pow_pos(q[t], h);
  }
}

// Energies e_t = q_t^{β/2} and slopes s_t = β q_t^{(β−2)/2} = β e_t / q_t (0 at q = 0) with one
// power per pair instead of two; returns Σ_t e_t.
template <typename T>
inline T tile_energies_and_slopes(const T* q, int64_t n, T beta, T* e, T* s) {
  if (beta == T(1) || beta == T(2)) {
    tile_slopes(q, n, beta, s);
    T total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
      e[t] = beta == T(1) ? (q[t] > T(0) ? std::sqrt(q[t]) : T(0)) : (q[t] > T(0) ? q[t] : T(0));
      total += e[t];
    }
    return total;
  }
  const T h = T(0.5) * beta;
  T total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    const bool pos = q[t] > T(0);
    const T qs = pos ? q[t] : T(1);
    const T et = pos ? pow_pos(qs, h) : T(0);
    e[t] = et;
    s[t] = pos ? beta * et / qs : T(0);
    total += et;
  }
  return total;
}

}  // namespace cpu
}  // namespace etweedie
