// FMA throughput of one core in 256-bit and 512-bit registers: 12 independent chains each.
//   gcc -O3 -march=native -funroll-loops fma_peak.c -o fma_peak && ./fma_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long n = 200000000;
  {
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i * 0.001f);
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.0001f);
    const double t0 = now();
    for (long k = 0; k < n; k++)
      for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    const double t = now() - t0;
    float s = 0, o[8];
    for (int i = 0; i < 12; i++) { _mm256_storeu_ps(o, a[i]); s += o[0]; }
    printf("ymm: %.1f GFLOP/s (checksum %g)\n", n * 12 * 16 / t / 1e9, s);
  }
#if defined(__AVX512F__)
  {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(i * 0.001f);
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.0001f);
    const double t0 = now();
    for (long k = 0; k < n; k++)
      for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
    const double t = now() - t0;
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
    printf("zmm: %.1f GFLOP/s (checksum %g)\n", n * 12 * 32 / t / 1e9, s);
  }
#endif
  return 0;
}
