// The Gram dot kernels of csrc/cpu/energy_gram_cpu.h on L1-resident data (d = 256, one thread):
// 4 × 16 in zmm with even/odd coordinate accumulators, and 4 × 32 in zmm (AVX-512 CPUs).
//   gcc -O3 -march=native gram_microkernel.c -o gram_microkernel && ./gram_microkernel
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) static void k4x16(const float* x0, const float* x1, const float* x2, const float* x3,
                                             const float* p, long d, float* dots) {
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  for (long k = 0; k + 2 <= d; k += 2) {
    const __m512 pe = _mm512_loadu_ps(p + k * 16), po = _mm512_loadu_ps(p + (k + 1) * 16);
    e0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), pe, e0);
    e1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k]), pe, e1);
    e2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k]), pe, e2);
    e3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k]), pe, e3);
    o0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k + 1]), po, o0);
    o1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k + 1]), po, o1);
    o2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k + 1]), po, o2);
    o3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k + 1]), po, o3);
  }
  _mm512_storeu_ps(dots, _mm512_add_ps(e0, o0));
  _mm512_storeu_ps(dots + 16, _mm512_add_ps(e1, o1));
  _mm512_storeu_ps(dots + 32, _mm512_add_ps(e2, o2));
  _mm512_storeu_ps(dots + 48, _mm512_add_ps(e3, o3));
}

__attribute__((noinline)) static void k4x32(const float* x0, const float* x1, const float* x2, const float* x3,
                                             const float* p, long d, float* dots) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (long k = 0; k < d; k++) {
    const __m512 p0 = _mm512_loadu_ps(p + k * 32), p1 = _mm512_loadu_ps(p + k * 32 + 16);
    __m512 v = _mm512_set1_ps(x0[k]);
    a0 = _mm512_fmadd_ps(v, p0, a0); b0 = _mm512_fmadd_ps(v, p1, b0);
    v = _mm512_set1_ps(x1[k]);
    a1 = _mm512_fmadd_ps(v, p0, a1); b1 = _mm512_fmadd_ps(v, p1, b1);
    v = _mm512_set1_ps(x2[k]);
    a2 = _mm512_fmadd_ps(v, p0, a2); b2 = _mm512_fmadd_ps(v, p1, b2);
    v = _mm512_set1_ps(x3[k]);
    a3 = _mm512_fmadd_ps(v, p0, a3); b3 = _mm512_fmadd_ps(v, p1, b3);
  }
  _mm512_storeu_ps(dots, a0); _mm512_storeu_ps(dots + 16, b0);
  _mm512_storeu_ps(dots + 32, a1); _mm512_storeu_ps(dots + 48, b1);
  _mm512_storeu_ps(dots + 64, a2); _mm512_storeu_ps(dots + 80, b2);
  _mm512_storeu_ps(dots + 96, a3); _mm512_storeu_ps(dots + 112, b3);
}

volatile float sink;

int main(void) {
  const long d = 256, R = 2000000;
  float* x = aligned_alloc(64, 16 * d * sizeof(float));
  float* p = aligned_alloc(64, 32 * d * sizeof(float));
  float dots[128];
  for (long i = 0; i < 16 * d; i++) x[i] = (i % 13) * 0.01f;
  for (long i = 0; i < 32 * d; i++) p[i] = (i % 7) * 0.01f;
  double t = now();
  for (long r = 0; r < R; r++) { k4x16(x, x + d, x + 2 * d, x + 3 * d, p, d, dots); sink += dots[r & 63]; }
  t = now() - t;
  printf("4x16 zmm (even/odd): %.1f GFLOP/s\n", R * 4.0 * 16 * d * 2 / t / 1e9);
  t = now();
  for (long r = 0; r < R; r++) { k4x32(x, x + d, x + 2 * d, x + 3 * d, p, d, dots); sink += dots[r & 127]; }
  t = now() - t;
  printf("4x32 zmm: %.1f GFLOP/s\n", R * 4.0 * 32 * d * 2 / t / 1e9);
  free(x);
  free(p);
  return 0;
}
