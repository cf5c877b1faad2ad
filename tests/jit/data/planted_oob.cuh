// A deliberately broken kernel for the sanitizer test (never registered, never shipped): each entry
// writes one element past the end of its buffer, or overflows a signed int. `make test-sanitize`
// must report both.
#pragma once

#include <tvm/ffi/container/tensor.h>

#include <cstdint>

namespace sparsekv::planted {

// Fills `t` (int32, any length) with ones and, through an off-by-one loop bound, the int after it.
template <typename T>
void write_past_end(tvm::ffi::TensorView t) {
  T* data = static_cast<T*>(t.data_ptr());
  const int64_t n = t.numel();
  for (int64_t i = 0; i <= n; ++i) data[i] = T(1);  // the planted bug: `<=`
}

// Returns `x + 1` in int32: undefined behaviour for x = INT32_MAX.
template <typename T>
int64_t add_one(int64_t x) {
  volatile T y = static_cast<T>(x);
  return static_cast<int64_t>(static_cast<T>(y + T(1)));
}

}  // namespace sparsekv::planted
