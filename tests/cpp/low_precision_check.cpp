// Driver for tests/test_low_precision.py: runs the conversions of csrc/common/low_precision.h on
// raw binary input (stdin) and writes raw binary output (stdout); the test compares them with
// torch's conversions and with exact rounding computed in Python.
//
//   low_precision_check widen        -> 65536 bf16->float32 bit patterns, then 65536 fp16->float32,
//                                       then the fp16 ones again through widen_row (whole rows)
//   low_precision_check narrow32 n   <- n float32   -> n bf16 bit patterns, then n fp16 bit patterns,
//                                       then the fp16 ones again through narrow_row, then the
//                                       bf16 ones again through narrow16_bf16 (the ∂L/∂x store's
//                                       16-value blocks; AVX2 builds) and the scalar tail, then
//                                       through narrow16_bf16_unpacked (blocks in the lanes'
//                                       order of bfloat16 draws), then through
//                                       narrow16_bf16_exact, each with the scalar tail
//   low_precision_check narrow64 n   <- n float64   -> the same, rounded from float64 (narrow<X>(double))
// The loops carry `#pragma omp simd`, as the kernels' loops do, so the vectorized code is what runs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "low_precision.h"

using etweedie::bf16;
using etweedie::fp16;

template <typename T>
static bool read_all(std::vector<T>& v) {
  return std::fread(v.data(), sizeof(T), v.size(), stdin) == v.size();
}

template <typename T>
static void write_all(const std::vector<T>& v) {
  std::fwrite(v.data(), sizeof(T), v.size(), stdout);
}

template <typename F>
static void narrow_all(const std::vector<F>& in) {
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> b(n), h(n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) b[i] = etweedie::narrow<bf16>(in[i]).bits;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = etweedie::narrow<fp16>(in[i]).bits;
  write_all(b);
  write_all(h);
}

// in rounded to bfloat16 by block(pointer to 16 values) -> __m256i, the tail value by value, written
template <typename Block>
static void bf16_blocks(const std::vector<float>& in, const Block& block) {
  const size_t n = in.size();
  std::vector<uint16_t> out(n);
  size_t i = 0;
#if defined(__AVX2__)
  if constexpr (!std::is_same_v<Block, std::nullptr_t>) {
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + i), block(in.data() + i));
  }
#else
  (void)block;
#endif
  for (; i < n; ++i) out[i] = etweedie::narrow<bf16>(in[i]).bits;
  write_all(out);
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  if (std::strcmp(argv[1], "widen") == 0) {
    std::vector<uint32_t> b(65536), h(65536);
#pragma omp simd
    for (int i = 0; i < 65536; ++i) b[i] = etweedie::float_bits(etweedie::widen<float>(bf16{static_cast<uint16_t>(i)}));
#pragma omp simd
    for (int i = 0; i < 65536; ++i) h[i] = etweedie::float_bits(etweedie::widen<float>(fp16{static_cast<uint16_t>(i)}));
    // widen_row over rows of 1,000 values: the hardware path in blocks of 8 and the tail of each row
    std::vector<float> hr(65536);
    std::vector<fp16> all(65536);
    for (int i = 0; i < 65536; ++i) all[i] = fp16{static_cast<uint16_t>(i)};
    for (int i = 0; i < 65536; i += 1000) etweedie::widen_row(all.data() + i, std::min(1000, 65536 - i), hr.data() + i);
    write_all(b);
    write_all(h);
    write_all(hr);
    return 0;
  }
  if (argc < 3) return 2;
  const size_t n = std::strtoull(argv[2], nullptr, 10);
  if (std::strcmp(argv[1], "narrow32") == 0) {
    std::vector<float> in(n);
    if (!read_all(in)) return 3;
    narrow_all(in);
    std::vector<fp16> hr(n);
    for (size_t i = 0; i < n; i += 1000) etweedie::narrow_row(in.data() + i, std::min<size_t>(1000, n - i), hr.data() + i);
    write_all(hr);
#if defined(__AVX2__)
    // the ∂L/∂x store's 16-value blocks: narrow16_bf16; narrow16_bf16_unpacked, each block handed
    // over in the order that widening bfloat16 by unpacks leaves (lo: 0-3 and 8-11, hi: 4-7 and
    // 12-15; csrc/cpu/lanes16_cpu.h); narrow16_bf16_exact alone (the integer rounding, which the
    // others fall back to)
    bf16_blocks(in, [](const float* v) { return etweedie::narrow16_bf16(v); });
    bf16_blocks(in, [](const float* v) {
      return etweedie::narrow16_bf16_unpacked(_mm256_setr_ps(v[0], v[1], v[2], v[3], v[8], v[9], v[10], v[11]),
                                              _mm256_setr_ps(v[4], v[5], v[6], v[7], v[12], v[13], v[14], v[15]));
    });
    bf16_blocks(in, [](const float* v) { return etweedie::narrow16_bf16_exact(v); });
#else
    for (int k = 0; k < 3; ++k) bf16_blocks(in, nullptr);  // no blocks: value by value
#endif
    return 0;
  }
  if (std::strcmp(argv[1], "narrow64") == 0) {
    std::vector<double> in(n);
    if (!read_all(in)) return 3;
    narrow_all(in);
    return 0;
  }
  return 2;
}
