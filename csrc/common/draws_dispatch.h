// Host side of the low-precision draws (csrc/common/low_precision.h): the storage type X of a
// draws tensor, chosen at run time, and its data pointer as X.  Shared by the CPU kernels
// (csrc/cpu/) and the CUDA bindings (csrc/cuda/*_bindings.cpp); host-only (ATen).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "low_precision.h"

namespace etweedie {

template <typename X>
struct DrawType {
  using type = X;
};

// f(DrawType<X>{}) with X the storage type of the draws x for compute type T: bf16, fp16, or T
// itself (checks::draws has admitted nothing else).
template <typename T, typename F>
decltype(auto) dispatch_draws(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      return f(DrawType<bf16>{});
    case at::kHalf:
      return f(DrawType<fp16>{});
    default:
      return f(DrawType<T>{});
  }
}

// t's data as X (torch checks that t's dtype is X's).
template <typename X>
X* draws_data(const at::Tensor& t) {
  if constexpr (std::is_same_v<X, bf16>) {
    return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>());
  } else if constexpr (std::is_same_v<X, fp16>) {
    return reinterpret_cast<fp16*>(t.data_ptr<c10::Half>());
  } else {
    return t.data_ptr<X>();
  }
}

static_assert(sizeof(bf16) == sizeof(c10::BFloat16) && sizeof(fp16) == sizeof(c10::Half),
              "bf16/fp16 must have torch's 16-bit storage layout");

}  // namespace etweedie
