// etweedie_simt::configure(sms, seed): the device the SIMT emulator pretends to be (its number of
// multiprocessors, which sets the grid shapes the launchers choose) and the seed of the thread
// order between barriers (tests/simt/simt.h).  etweedie_simt::launched(): the launches since the
// last call (kernel with its template arguments, grid, block, dynamic shared memory), so that
// tests check which kernel a shape gets.
#include <torch/library.h>

#include <string>
#include <vector>

#include "simt.h"

namespace {
void configure(int64_t sms, int64_t seed) {
  TORCH_CHECK(sms >= 1, "configure: sms must be >= 1, got ", sms);
  simt::config().sms = static_cast<int>(sms);
  simt::config().seed = static_cast<uint64_t>(seed);
}

std::vector<std::string> launched() {
  std::vector<std::string> out;
  out.swap(simt::launch_state().log);
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(etweedie_simt, m) {
  m.def("configure(int sms, int seed) -> ()", &configure);
  m.def("launched() -> str[]", &launched);
}
