// Posterior draws as the CPU row kernels read them (et_score, langevin_step, student_t_score).
//
// The kernels take a few draw rows at a time (one or four) and read each row twice from L1:
// q = uᵀPu, then the weighted accumulation.  A DrawRows<X> (one per thread and loop; it holds
// the buffer) hands them those rows with stage():
//   - float, double and bfloat16 draws: the rows in place (widen<T> in the kernels' loops is
//     free or one shift);
//   - float16 draws on a CPU with F16C: the rows widened to float by the hardware conversion
//     into a per-thread L1 buffer (widen_row, csrc/common/low_precision.h), so both passes read
//     float.  The portable float16 conversion costs about ten integer operations per value on
//     each pass, which made float16 draws no faster than float32 ones although they are half
//     the bytes.
// The kernels are written once over Row = DrawRows<X>::Row (X, or float for staged float16).
// Memory: n·d floats per DrawRows (n ≤ 4), reused across its stage() calls; nothing of size N·d.
// A stage() result is valid until the next stage() call on the same DrawRows.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/low_precision.h"

namespace etweedie {
namespace cpu {

template <typename X>
struct DrawRows {
  using Row = X;
  // The n rows x + r·sx (r < n, d values each) as Row rows with row stride *stride.
  const X* stage(const X* x, int64_t sx, int64_t /*n*/, int64_t /*d*/, int64_t* stride) const {
    *stride = sx;
    return x;
  }
};

#if ETWEEDIE_HW_HALF
template <>
struct DrawRows<fp16> {
  using Row = float;
  std::vector<float> buf;
  const float* stage(const fp16* x, int64_t sx, int64_t n, int64_t d, int64_t* stride) {
    if (static_cast<int64_t>(buf.size()) < n * d) buf.resize(n * d);
    for (int64_t r = 0; r < n; ++r) widen_row(x + r * sx, d, buf.data() + r * d);
    *stride = d;
    return buf.data();
  }
};
#endif

}  // namespace cpu
}  // namespace etweedie
