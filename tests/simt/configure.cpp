// etweedie_simt::configure(sms, seed): the device the SIMT emulator pretends to be (its number of
// multiprocessors, which sets the grid shapes the launchers choose) and the seed of the thread
// order between barriers (tests/simt/simt.h).
#include <torch/library.h>

#include "simt.h"

namespace {
void configure(int64_t sms, int64_t seed) {
  TORCH_CHECK(sms >= 1, "configure: sms must be >= 1, got ", sms);
  simt::config().sms = static_cast<int>(sms);
  simt::config().seed = static_cast<uint64_t>(seed);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(etweedie_simt, m) { m.def("configure(int sms, int seed) -> ()", &configure); }
