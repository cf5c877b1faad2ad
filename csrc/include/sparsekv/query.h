// query: the query elements of the kernels that score cache rows against a query (dsv4_attention,
// dsv4_indexer): float32, or bf16 read as its 16 raw bits, loaded as float on both backends.
#pragma once

#include <cstdint>

#include "sparsekv/fp8.h"
#include "sparsekv/portability.h"

namespace sparsekv {

// A bf16 query element (the Query template argument for bf16 queries).
struct Bf16 {
  uint16_t bits;
};

SPARSEKV_HOST_DEVICE float load_q(const float* p) { return *p; }
SPARSEKV_HOST_DEVICE float load_q(const Bf16* p) { return fp8::bf16_to_float(p->bits); }

}  // namespace sparsekv
