// indices: reads and writes of index tables whose dtype (int32 or int64) is chosen at run time, so
// one kernel instance serves both (the host entry records which with Arg::int32_or_int64()).
#pragma once

#include <cstdint>

#include "sparsekv/portability.h"

namespace sparsekv {

SPARSEKV_HOST_DEVICE int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

SPARSEKV_HOST_DEVICE void store_index(void* p, bool is64, int64_t i, int64_t v) {
  if (is64) {
    static_cast<int64_t*>(p)[i] = v;
  } else {
    static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
  }
}

}  // namespace sparsekv
