// Large outputs of the CPU kernels that are written once per call, e.g. et_score's ∂L/∂x
// (B·N·d values: 51 MB at 64 × 256 × 784).  A plain at::empty of that size is memory the
// process has never touched — glibc maps a block this large fresh on every call and unmaps it
// when the tensor dies — so the kernel's first write to each 4 KiB page takes a page fault:
// 12,500 faults for 51 MB, which cost several times the arithmetic of the backward pass.
//
// reusable_empty() removes that cost two ways:
//   reuse — a freed output's block goes back to a small pool (at most kPoolBlocks blocks, each
//           of at least kPoolMinBytes) and the next request of a similar size takes it, already
//           faulted in: the steady state of a training or sampling loop (forward, backward,
//           gradient consumed and freed, repeat) touches no fresh page at all;
//   huge pages — a new block is 2 MiB-aligned and hinted with madvise(MADV_HUGEPAGE), so its
//           first touch takes one fault per 2 MiB instead of one per 4 KiB (where THP is off or
//           the call fails nothing changes: it is a hint).
// The pool holds at most kPoolBlocks blocks after their tensors die (≈ 2 × the largest
// gradient), is shared by all threads (a mutex around a short list), and is never destroyed
// (a tensor may outlive static destructors).  ETWEEDIE_CPU_REUSE=0 turns it off (plain
// at::empty).  Linux gets the huge-page hint; elsewhere the pool alone.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <vector>

#include "../common/low_precision.h"
#include "stream_rows_cpu.h"  // stream_row, stream_fence: the kernels' write-once stores into these outputs

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace etweedie {
namespace cpu {

constexpr int64_t kHugePage = int64_t(2) << 20;
constexpr int64_t kPoolMinBytes = int64_t(4) << 20;
constexpr size_t kPoolBlocks = 2;

struct OutputPool {
  struct Block {
    void* ptr;
    int64_t bytes;
  };
  std::mutex mu;
  std::vector<Block> free_blocks;

  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();  // leaked on purpose: deleters may run at exit
    return *pool;
  }

  // A block of at least `bytes` (rounded up to whole huge pages): a pooled one no larger than
  // twice the request, else a fresh one.
  Block take(int64_t bytes) {
    const int64_t want = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t k = 0; k < free_blocks.size(); ++k) {
        if (free_blocks[k].bytes >= want && free_blocks[k].bytes <= 2 * want) {
          const Block b = free_blocks[k];
          free_blocks.erase(free_blocks.begin() + static_cast<std::ptrdiff_t>(k));
          return b;
        }
      }
    }
    void* p = std::aligned_alloc(static_cast<size_t>(kHugePage), static_cast<size_t>(want));
    TORCH_CHECK(p != nullptr, "etweedie: out of memory allocating ", want, " bytes for a kernel output");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(p, static_cast<size_t>(want), MADV_HUGEPAGE);
#endif
    return {p, want};
  }

  void give_back(Block b) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (free_blocks.size() < kPoolBlocks) {
        free_blocks.push_back(b);
        return;
      }
      // full: keep the larger blocks (they serve more requests)
      size_t smallest = 0;
      for (size_t k = 1; k < free_blocks.size(); ++k)
        if (free_blocks[k].bytes < free_blocks[smallest].bytes) smallest = k;
      if (free_blocks[smallest].bytes < b.bytes) std::swap(free_blocks[smallest], b);
    }
    std::free(b.ptr);
  }
};

inline bool output_reuse_enabled() {
  static const bool on = [] {
    const char* s = std::getenv("ETWEEDIE_CPU_REUSE");
    return !(s != nullptr && s[0] == '0');
  }();
  return on;
}

// at::empty(sizes, options) for a CPU output; large ones come from the reuse pool above.
inline at::Tensor reusable_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (!output_reuse_enabled() || bytes < kPoolMinBytes) return at::empty(sizes, options);
  const OutputPool::Block b = OutputPool::get().take(bytes);
  return at::from_blob(
      b.ptr, sizes, [b](void*) { OutputPool::get().give_back(b); }, options.device(at::kCPU));
}

}  // namespace cpu
}  // namespace etweedie
