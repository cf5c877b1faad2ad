// team: the threads that serve one work unit together (a whole block on the GPU, one thread on the
// host), with the block-wide primitives a per-request kernel needs: barriers, an exclusive rank of
// a per-thread flag in thread order (ballot + popc scans), shared-memory atomics and a device
// counter add. On the host every primitive degenerates to its single-thread meaning, so one
// kernel body runs on both backends and both agree bit for bit.
//
// Rule: every member is called by all threads of the team (block-uniform control flow), so the
// barriers inside line up.
#pragma once

#include <cstdint>

#include "sparsekv/portability.h"

namespace sparsekv {

struct Team {
  int tid;
  int size;
  int warp;
  int num_warps;
  int lane;

  SPARSEKV_HOST_DEVICE static Team current() {
#ifdef __CUDA_ARCH__
    const int t = static_cast<int>(threadIdx.x);
    const int n = static_cast<int>(blockDim.x);
    return Team{t, n, t / kWarpSize, n / kWarpSize, t % kWarpSize};
#else
    return Team{0, 1, 0, 1, 0};
#endif
  }

  SPARSEKV_HOST_DEVICE void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }

  // Exclusive rank of this thread's flag among the team's flags in thread order; *total gets the
  // number of set flags. warp_counts holds one int per warp (shared memory on the GPU).
  SPARSEKV_HOST_DEVICE int rank(bool flag, int* total, int32_t* warp_counts) const {
#ifdef __CUDA_ARCH__
    const unsigned mask = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(mask & ((1u << lane) - 1u));
    if (lane == 0) warp_counts[warp] = __popc(mask);
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int c = warp_counts[w];
      before += w < warp ? c : 0;
      all += c;
    }
    __syncthreads();  // warp_counts is reused by the next call
    *total = all;
    return before + in_warp;
#else
    (void)warp_counts;
    *total = flag ? 1 : 0;
    return 0;
#endif
  }

  SPARSEKV_HOST_DEVICE static int32_t compare_and_swap(int32_t* addr, int32_t expected, int32_t desired) {
#ifdef __CUDA_ARCH__
    return atomicCAS(addr, expected, desired);
#else
    const int32_t old = *addr;
    if (old == expected) *addr = desired;
    return old;
#endif
  }

  SPARSEKV_HOST_DEVICE static void fetch_min(int32_t* addr, int32_t v) {
#ifdef __CUDA_ARCH__
    atomicMin(addr, v);
#else
    if (v < *addr) *addr = v;
#endif
  }

  SPARSEKV_HOST_DEVICE static void fetch_add(int32_t* addr, int32_t v) {
#ifdef __CUDA_ARCH__
    atomicAdd(addr, v);
#else
    *addr += v;
#endif
  }

  // The lanes of this thread's warp, for a warp-cooperative copy_bytes.
  SPARSEKV_HOST_DEVICE Lanes warp_lanes() const {
#ifdef __CUDA_ARCH__
    return Lanes{lane, kWarpSize};
#else
    return Lanes{0, 1};
#endif
  }
};

// Adds v to a device-global 64-bit counter (atomically on the GPU), without a host sync.
SPARSEKV_HOST_DEVICE void add_counter(int64_t* counter, int64_t v) {
#ifdef __CUDA_ARCH__
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(v));
#else
  *counter += v;
#endif
}

constexpr int log2_ceil(int n) {
  int bits = 0;
  while ((1 << bits) < n) ++bits;
  return bits;
}

}  // namespace sparsekv
