// Accuracy check of csrc/common/fastmath.h against libm (built and run by tests/test_fastmath.py).
//   usage: fastmath_check SEED N
// Prints the worst relative errors and exits 1 when a bound is broken.  Bounds: float exp/log/pow
// a few float ulp (the documented accuracy of the float32 kernels); double exp/log ≤ 8 double ulp
// and pow ≤ 8 ulp × (1 + |a·log q|) relative (exp(a·log q) amplifies the argument's rounding).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "fastmath.h"

using etweedie::fast_exp;
using etweedie::fast_log;
using etweedie::pow_pos;

namespace {
double rel(double a, double b) { return b == 0 ? std::fabs(a) : std::fabs(a - b) / std::fabs(b); }
int failures = 0;
void check(const char* what, double err, double bound) {
  std::printf("%-28s max rel err %.3e (bound %.1e)\n", what, err, bound);
  if (!(err <= bound)) ++failures;
}
void expect(const char* what, bool ok) {
  if (!ok) {
    std::printf("edge case failed: %s\n", what);
    ++failures;
  }
}
}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0;
  const long n = argc > 2 ? std::atol(argv[2]) : 2000000;
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> ux(-708.0, 709.0), ulog10(-323.0, 308.0), unear(-1e-3, 1e-3),
      ua(-3.0, 3.0), ufx(-87.0, 88.0), uflog10(-44.0, 38.0);
  double e_exp = 0, e_log = 0, e_log1 = 0, e_pow = 0, f_exp = 0, f_log = 0;
  for (long i = 0; i < n; ++i) {
    const double x = ux(g);
    e_exp = std::fmax(e_exp, rel(fast_exp(x), std::exp(x)));
    const double q = std::pow(10.0, ulog10(g));
    if (q > 0) e_log = std::fmax(e_log, rel(fast_log(q), std::log(q)));
    const double w = 1.0 + unear(g);  // log near 1: relative accuracy of a tiny result
    e_log1 = std::fmax(e_log1, rel(fast_log(w), std::log(w)));
    const double qp = std::pow(10.0, ulog10(g) / 8.0), a = ua(g);  // q in ~[1e-40, 1e38]
    const double ref = std::pow(qp, a);
    // exp(a·log q) turns log's absolute error into a relative one times |a·log q| (libm-based
    // exp(a·log q), the previous float64 path, shares it): normalize by 1 + |a·log q|.
    if (ref > 1e-300 && ref < 1e300) e_pow = std::fmax(e_pow, rel(pow_pos(qp, a), ref) / (1.0 + std::fabs(a * std::log(qp))));
    const float xf = static_cast<float>(ufx(g));
    f_exp = std::fmax(f_exp, rel(fast_exp(xf), std::exp(static_cast<double>(xf))));
    const float qf = static_cast<float>(std::pow(10.0, uflog10(g)));
    if (qf > 0) f_log = std::fmax(f_log, std::fabs(fast_log(qf) - std::log(static_cast<double>(qf))) /
                                          std::fmax(1.0, std::fabs(std::log(static_cast<double>(qf)))));
  }
  const double ulp = 2.220446049250313e-16, fulp = 1.1920929e-07;
  check("double exp [-708, 709]", e_exp, 8 * ulp);
  check("double log [1e-323, 1e308]", e_log, 8 * ulp);
  check("double log 1 ± 1e-3", e_log1, 8 * ulp);
  check("double pow_pos / (1+|a log q|)", e_pow, 8 * ulp);
  check("float exp [-87, 88]", f_exp, 8 * fulp);
  check("float log (abs/max(1,|log|))", f_log, 8 * fulp);
  expect("exp(0) == 1", fast_exp(0.0) == 1.0);
  expect("exp(-800) == 0", fast_exp(-800.0) == 0.0);
  expect("exp(710) == inf", std::isinf(fast_exp(710.0)));
  expect("log(1) == 0", fast_log(1.0) == 0.0);
  expect("log(min subnormal)", rel(fast_log(4.9406564584124654e-324), std::log(4.9406564584124654e-324)) < 8 * ulp);
  expect("log(2^-1030)", rel(fast_log(std::ldexp(1.0, -1030)), -1030 * std::log(2.0)) < 8 * ulp);
  expect("pow_pos(0, a) == 0", pow_pos(0.0, 0.7) == 0.0 && pow_pos(-1.0, 0.7) == 0.0);
  expect("pow_pos(q, 1) == q", rel(pow_pos(3.7, 1.0), 3.7) < 8 * ulp);
  std::printf("seed %llu, %ld samples: %s\n", static_cast<unsigned long long>(seed), n, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
