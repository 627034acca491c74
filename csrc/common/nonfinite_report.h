// Whether a CPU row kernel wrote a non-finite value, reported to the C++ front op that called it
// (csrc/front/rows_front.h) so that the Python op learns it without reading the output again.
//
// The per-row ops' CPU kernels (et_score, langevin_step, student_t_score) write NaN into every row
// with a draw out of their accurate range (q_in_range, et_score.h); the Python op reruns such a
// float32 call in float64 (etweedie/ops/_range.py, range_guarded).  Finding those rows by summing the
// output afterwards is a second pass over (B, d) values on one thread, most of them in the other
// workers' caches: 40–60 µs per call at B = 64, d = 784, about 4% of the call.  Instead each worker
// checks the row it has just written (d compares on hot data) and raises the report.
//
// The channel is call-scoped and per calling thread: the front op opens a NonFiniteReport on its
// stack, calls the kernel through the dispatcher (synchronously, on the same thread), and reads
// raised() after it.  The kernel looks the report up once, on the calling thread, before its
// parallel loop; the workers raise it through an atomic, joined before the kernel returns.  A kernel
// called without a front op (the raw op, the Python canonical form) finds no report and checks
// nothing.  Reports nest (a front op inside another's kernel would restore the outer one).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

namespace etweedie {

class NonFiniteReport {
 public:
  NonFiniteReport() : outer_(slot()) { slot() = this; }
  ~NonFiniteReport() { slot() = outer_; }
  NonFiniteReport(const NonFiniteReport&) = delete;
  NonFiniteReport& operator=(const NonFiniteReport&) = delete;

  // The report open on this thread, or nullptr.  Call on the kernel's calling thread, not a worker.
  static NonFiniteReport* active() { return slot(); }

  void raise() { raised_.store(true, std::memory_order_relaxed); }
  bool raised() const { return raised_.load(std::memory_order_relaxed); }

  // Raise the report if row[0, d) holds a NaN or an infinity (a no-op without a report).
  template <typename T>
  static void check_row(NonFiniteReport* report, const T* row, int64_t d) {
    if (report == nullptr) return;
    int finite = 1;
    const T big = std::numeric_limits<T>::max();
#pragma omp simd reduction(& : finite)
    for (int64_t j = 0; j < d; ++j) finite &= static_cast<int>(std::abs(row[j]) <= big);  // NaN compares false
    if (!finite) report->raise();
  }

 private:
  static NonFiniteReport*& slot() {
    thread_local NonFiniteReport* open = nullptr;
    return open;
  }
  std::atomic<bool> raised_{false};
  NonFiniteReport* outer_;
};

}  // namespace etweedie
