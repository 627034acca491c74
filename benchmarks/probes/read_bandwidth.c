// The read floor of the CPU score benchmarks: one streaming pass of AVX2 adds over a float32 array
// the size of the 64 × 256 × 784 draw cloud (51 MB), split over N OpenMP threads; best of 200.
//   gcc -O3 -march=native -fopenmp read_bandwidth.c -o read_bandwidth && ./read_bandwidth 2
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t n = (size_t)64 * 256 * 784;
  const int nt = argc > 1 ? atoi(argv[1]) : 1;
  float* x = aligned_alloc(64, n * sizeof(float));
  for (size_t i = 0; i < n; i++) x[i] = (float)(i % 7);
  double best = 1e9;
  float total = 0;
  for (int r = 0; r < 200; r++) {
    const double t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : total)
    {
      const int id = omp_get_thread_num();
      const size_t a = n * id / nt, b = n * (id + 1) / nt;
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (size_t i = a; i < b; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(x + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(x + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(x + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(x + i + 24));
      }
      float o[8];
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      for (int k = 0; k < 8; k++) total += o[k];
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  printf("threads %d: best %.3f ms, %.1f GB/s (checksum %g)\n", nt, best * 1e3, n * 4 / best / 1e9, total);
  free(x);
  return 0;
}
