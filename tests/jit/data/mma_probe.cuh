// Probes of sparsekv/mma.h for tests/jit/test_mma.py (never registered, never shipped): one warp
// runs one mma_bf16 on registers the test lays out itself (so the test's statement of the PTX
// fragment layout checks the header's), one warp runs ldmatrix_x4 on a tile, and threads convert
// e4m3 pairs with e4m3x2_to_bf16x2.
#pragma once

#include <cstdint>

#include "sparsekv/mma.h"
#include "sparsekv/portability.h"

namespace sparsekv::mma_probe {

struct Params {
  const uint32_t* a;  // [32 lanes][4] registers of A
  const uint32_t* b;  // [32][2] of B
  float* d;           // [32][4]: C in, D = C + A B out
  const uint16_t* pairs;  // [count] e4m3 pairs, first byte low
  const float* scales;    // [count]
  uint32_t* converted;    // [count] bf16x2
  int64_t count;
  const uint16_t* tile;  // [16][16] for the ldmatrix probe
  uint32_t* loaded;      // [2][32 lanes][4]: ldmatrix_x4, then its .trans
};

#ifdef __CUDACC__
__global__ void product_kernel(const Params p) {
  const int lane = static_cast<int>(threadIdx.x);
  mma::FragA a;
  mma::FragB b;
  mma::FragC d;
  for (int r = 0; r < 4; ++r) a.x[r] = p.a[lane * 4 + r];
  for (int r = 0; r < 2; ++r) b.x[r] = p.b[lane * 2 + r];
  for (int i = 0; i < 4; ++i) d.x[i] = p.d[lane * 4 + i];
  mma::mma_bf16(d, a, b);
  for (int i = 0; i < 4; ++i) p.d[lane * 4 + i] = d.x[i];
}

// One warp loads the 16 x 16 tile into shared memory, each lane names row l % 8 + 8 ((l / 8) % 2)
// at column 8 (l / 16) (the rows an A fragment needs), and keeps what ldmatrix_x4 (plain, then
// transposed) gives it.
__global__ void ldmatrix_kernel(const Params p) {
  __shared__ __align__(16) uint16_t tile[16][24];
  const int lane = static_cast<int>(threadIdx.x);
  for (int k = lane; k < 256; k += 32) tile[k / 16][k % 16] = p.tile[k];
  __syncwarp();
  const uint16_t* row = &tile[lane % 8 + 8 * ((lane / 8) % 2)][8 * (lane / 16)];
  uint32_t plain[4], trans[4];
  mma::ldmatrix_x4(plain, row);
  mma::ldmatrix_x4<true>(trans, row);
  for (int i = 0; i < 4; ++i) {
    p.loaded[lane * 4 + i] = plain[i];
    p.loaded[128 + lane * 4 + i] = trans[i];
  }
}
#endif

struct Ldmatrix {
  using Params = mma_probe::Params;
#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream) { return launch_kernel<ldmatrix_kernel>(1, 32, 0, stream, p); }
#endif
};

struct Product {
  using Params = mma_probe::Params;
#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream) { return launch_kernel<product_kernel>(1, 32, 0, stream, p); }
#endif
};

// One pair per item (cpu: the software decode; sim: the CUDA path with the same decode; cuda: the
// hardware convert).
struct Convert {
  using Params = mma_probe::Params;
  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.count; }
  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    if (lanes.lane == 0) p.converted[i] = mma::e4m3x2_to_bf16x2(p.pairs[i], p.scales[i]);
  }
};

}  // namespace sparsekv::mma_probe

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::mma_probe {

inline void product(TensorView a, TensorView b, TensorView d) {
  check(a, "a").dtype<int32_t>().contiguous().on_backend_device();
  check(a, "a").ndim(2).size(0, 32, "lanes").size(1, 4, "registers");
  check(b, "b").dtype<int32_t>().contiguous().same_device(a, "a").ndim(2).size(0, 32, "lanes").size(1, 2, "registers");
  check(d, "d").dtype<float>().contiguous().same_device(a, "a").ndim(2).size(0, 32, "lanes").size(1, 4, "registers");
  launch<Product>(Params{static_cast<const uint32_t*>(a.data_ptr()), static_cast<const uint32_t*>(b.data_ptr()),
                         static_cast<float*>(d.data_ptr()), nullptr, nullptr, nullptr, 0, nullptr, nullptr},
                  a.device());
}

inline void convert(TensorView pairs, TensorView scales, TensorView converted) {
  check(pairs, "pairs").dtype<int16_t>().contiguous().on_backend_device().ndim(1);
  check(scales, "scales").dtype<float>().contiguous().same_device(pairs, "pairs").size(0, pairs.size(0), "pairs");
  check(converted, "converted").dtype<int32_t>().contiguous().same_device(pairs, "pairs");
  check(converted, "converted").size(0, pairs.size(0), "pairs");
  launch<Convert>(Params{nullptr, nullptr, nullptr, static_cast<const uint16_t*>(pairs.data_ptr()),
                         static_cast<const float*>(scales.data_ptr()), static_cast<uint32_t*>(converted.data_ptr()),
                         pairs.size(0), nullptr, nullptr},
                  pairs.device());
}

inline void ldmatrix(TensorView tile, TensorView loaded) {
  check(tile, "tile").dtype<int16_t>().contiguous().on_backend_device().ndim(2).size(0, 16, "rows").size(1, 16, "cols");
  check(loaded, "loaded").dtype<int32_t>().contiguous().same_device(tile, "tile").ndim(3).size(0, 2, "kinds");
  check(loaded, "loaded").size(1, 32, "lanes").size(2, 4, "registers");
  launch<Ldmatrix>(Params{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                          static_cast<const uint16_t*>(tile.data_ptr()), static_cast<uint32_t*>(loaded.data_ptr())},
                   tile.device());
}

}  // namespace sparsekv::mma_probe
#endif
