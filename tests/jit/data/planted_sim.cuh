// Deliberately broken kernels for the sim backend's tests (never registered, never shipped), and
// one correct kernel that pins the emulated warp operations to their CUDA meaning. Each kernel
// struct has only a CUDA path: the host entry runs it on the sim backend.
#pragma once

#include <cstdint>

#include "sparsekv/portability.h"

namespace sparsekv::planted_sim {

struct Params {
  int32_t* out;
  int64_t a;  // a launch dimension or a byte count, per kernel
  int64_t b;
};

#ifdef __CUDACC__
// A shared-memory race: every thread stores its index into one word, thread 0 reads it after the
// barrier; which store lands last is up to the thread order.
__global__ void race_kernel(const Params p) {
  __shared__ int32_t last;
  last = static_cast<int32_t>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) p.out[blockIdx.x] = last;
}

// A race between blocks: thread 0 of each block takes the next slot of out[1..] (out[0] counts) and
// writes its block index there, so out[1..] is the order the blocks ran in.
__global__ void block_order_kernel(const Params p) {
  if (threadIdx.x == 0) p.out[1 + atomicAdd(&p.out[0], 1)] = static_cast<int32_t>(blockIdx.x);
}

// A shuffle reached by half of every warp.
__global__ void partial_shuffle_kernel(const Params p) {
  int32_t v = static_cast<int32_t>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  p.out[threadIdx.x] = v;
}

// A barrier the second warp never reaches.
__global__ void partial_barrier_kernel(const Params p) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  p.out[threadIdx.x] = 1;
}

// Reads of shared memory nobody wrote: half of a static array, all of the dynamic one.
__global__ void uninitialized_kernel(const Params p) {
  __shared__ int32_t scratch[64];
  const int t = static_cast<int>(threadIdx.x);
  if (t < 32) scratch[t] = t;
  __syncthreads();
  p.out[t] = scratch[t];
  p.out[64 + t] = dynamic_shared<int32_t>()[t];
}

// Launched with whatever shape the test asks for; writes one word so a launch that ran is seen.
__global__ void shaped_kernel(const Params p) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) p.out[0] = 1;
}

// Correct code: every warp operation once, results stored per thread in rows of 64.
__global__ void warp_ops_kernel(const Params p) {
  __shared__ unsigned count;
  const int t = static_cast<int>(threadIdx.x), lane = t % 32;
  if (t == 0) count = 0;
  __syncthreads();
  int32_t* row = p.out;
  row[0 * 64 + t] = __shfl_up_sync(0xffffffffu, t, 1);
  row[1 * 64 + t] = __shfl_down_sync(0xffffffffu, t, 2);
  row[2 * 64 + t] = __shfl_sync(0xffffffffu, t, 5, 8);
  row[3 * 64 + t] = __shfl_xor_sync(0xffffffffu, t, 3);
  row[4 * 64 + t] = static_cast<int32_t>(__ballot_sync(0xffffffffu, t % 3 == 0));
  row[5 * 64 + t] = __any_sync(0xffffffffu, t == 40);
  row[6 * 64 + t] = __all_sync(0xffffffffu, t != 7);
  row[7 * 64 + t] = lane < 16 ? static_cast<int32_t>(__ballot_sync(0x0000ffffu, lane & 1)) : -1;
  atomicAdd(&count, 1u);
  __syncwarp();
  __syncthreads();
  row[8 * 64 + t] = static_cast<int32_t>(count);
  atomicMax(&row[9 * 64], t);
}
#endif

// One struct per kernel: run_on_cuda is the launch the host entry's launch<K> reaches.
#ifdef __CUDACC__
#define SPARSEKV_PLANTED_LAUNCH(kernel, grid, block, smem) \
  static int run_on_cuda(const Params& p, void* stream) { return launch_kernel<kernel>(grid, block, smem, stream, p); }
#else
#define SPARSEKV_PLANTED_LAUNCH(kernel, grid, block, smem)
#endif

struct Race {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(race_kernel, 4, 256, 0)
};
struct BlockOrder {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(block_order_kernel, 8, 32, 0)
};
struct PartialShuffle {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(partial_shuffle_kernel, 1, 64, 0)
};
struct PartialBarrier {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(partial_barrier_kernel, 1, 64, 0)
};
struct Uninitialized {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(uninitialized_kernel, 1, 64, 64 * sizeof(int32_t))
};
struct WarpOps {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(warp_ops_kernel, 1, 64, 0)
};
// a = threads per block, b = gridDim.y.
struct BlockShape {
  using Params = planted_sim::Params;
  SPARSEKV_PLANTED_LAUNCH(shaped_kernel, dim3(1, static_cast<unsigned>(p.b)), static_cast<unsigned>(p.a), 0)
};
#undef SPARSEKV_PLANTED_LAUNCH

// a = dynamic shared memory bytes; b = 1: opt in to `a` bytes first.
struct DynamicSmem {
  using Params = planted_sim::Params;
#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream) {
    if (p.b) {
      const cudaError_t e =
          cudaFuncSetAttribute(shaped_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(p.a));
      if (e != cudaSuccess) return static_cast<int>(e);
    }
    return launch_kernel<shaped_kernel>(1, 32, static_cast<size_t>(p.a), stream, p);
  }
#endif
};

}  // namespace sparsekv::planted_sim

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::planted_sim {

template <class K>
void run(TensorView out, int64_t a, int64_t b) {
  check(out, "out").dtype<int32_t>().contiguous().on_backend_device();
  launch<K>(Params{static_cast<int32_t*>(out.data_ptr()), a, b}, out.device());
}

}  // namespace sparsekv::planted_sim
#endif
