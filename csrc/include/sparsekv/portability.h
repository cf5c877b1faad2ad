// Single-source portability layer: the same kernel header compiles under nvcc (cuda backend) and
// the host C++ compiler (cpu backend).
//
// A kernel is a struct K with
//   using Params = ...;                                   // plain data: pointers and sizes
//   SPARSEKV_HOST_DEVICE static int64_t num_items(const Params&);
//   SPARSEKV_HOST_DEVICE static void item(const Params&, int64_t i, Lanes lanes);
// and optionally, under __CUDACC__, `static int run_on_cuda(const Params&, void* stream)` for a
// launch shape of its own. The drivers below run item() for every i: a loop on the host, one warp
// per item on the GPU. Nothing here includes tvm-ffi, so a .cu that includes a kernel header stays
// cheap to compile.
//
// The CUDA path is also built by the host compiler for the sim backend (csrc/sim/sim.h, which
// defines SPARSEKV_SIM, __CUDACC__ and __CUDA_ARCH__ first). So a kernel launches through
// launch_kernel (never `<<<...>>>`, which only nvcc parses) and takes dynamic shared memory from
// dynamic_shared<T>() (never a block-scope `extern __shared__`, which the host compiler cannot give
// one copy per block).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__CUDACC__) && !defined(SPARSEKV_SIM)
#include <cuda_runtime.h>
#endif
#ifdef __CUDACC__
#define SPARSEKV_HOST_DEVICE __host__ __device__ __forceinline__
#define SPARSEKV_DEVICE __device__ __forceinline__
#else
#define SPARSEKV_HOST_DEVICE inline
#endif

namespace sparsekv {

// The threads that cooperate on one item: a warp on the GPU, a single lane on the host.
struct Lanes {
  int lane;
  int count;
};

inline constexpr int kWarpSize = 32;

// Copies n bytes. On the GPU every lane of the group moves a strided share of the widest words
// both pointers and n allow: 16 bytes; or, for 8-byte-aligned copies such as the 584-byte V4
// token rows (584 = 36 x 16 + 8, so every other row of a dense array starts 8 bytes off a
// 16-byte boundary), 16 bytes over the body when source and destination sit equally off that
// boundary (an 8-byte head and tail, by the first and last lanes) and 8 bytes otherwise; then 4
// bytes, then single bytes. On the host it is one memcpy.
// Design: a copy is bound by its loads in flight (latency x bandwidth); a warp moving a 584-byte
// row issues 37 16-byte or 73 8-byte accesses where the old 4-byte path issued 146, so a warp has
// 2-4x the bytes in flight per instruction (budget at 16k rows: gather_rows.cuh).
SPARSEKV_HOST_DEVICE void copy_bytes(void* dst, const void* src, int64_t n, Lanes lanes) {
#ifdef __CUDA_ARCH__
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  const auto all = d | s | static_cast<uintptr_t>(n);
  if ((all & 15) == 0) {
    auto* d16 = static_cast<int4*>(dst);
    const auto* s16 = static_cast<const int4*>(src);
    for (int64_t k = lanes.lane; k < n / 16; k += lanes.count) d16[k] = s16[k];
  } else if ((all & 7) == 0 && ((d ^ s) & 15) == 0) {
    const int64_t head = ((d & 15) != 0 && n > 0) ? 8 : 0;  // 8 bytes up to the common 16-byte boundary
    const int64_t body = (n - head) / 16;
    auto* d8 = static_cast<uint2*>(dst);
    const auto* s8 = static_cast<const uint2*>(src);
    if (head != 0 && lanes.lane == 0) d8[0] = s8[0];
    auto* d16 = reinterpret_cast<int4*>(static_cast<uint8_t*>(dst) + head);
    const auto* s16 = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(src) + head);
    for (int64_t k = lanes.lane; k < body; k += lanes.count) d16[k] = s16[k];
    if (head + 16 * body < n && lanes.lane == lanes.count - 1) d8[(n - 8) / 8] = s8[(n - 8) / 8];  // 8-byte tail
  } else if ((all & 7) == 0) {
    auto* d8 = static_cast<uint2*>(dst);
    const auto* s8 = static_cast<const uint2*>(src);
    for (int64_t k = lanes.lane; k < n / 8; k += lanes.count) d8[k] = s8[k];
  } else if ((all & 3) == 0) {
    auto* d4 = static_cast<uint32_t*>(dst);
    const auto* s4 = static_cast<const uint32_t*>(src);
    for (int64_t k = lanes.lane; k < n / 4; k += lanes.count) d4[k] = s4[k];
  } else {
    auto* d1 = static_cast<uint8_t*>(dst);
    const auto* s1 = static_cast<const uint8_t*>(src);
    for (int64_t k = lanes.lane; k < n; k += lanes.count) d1[k] = s1[k];
  }
#else
  (void)lanes;
  std::memcpy(dst, src, static_cast<size_t>(n));
#endif
}

// Host driver: the cpu backend.
template <class K>
void run_on_host(const typename K::Params& params) {
  const int64_t n = K::num_items(params);
  for (int64_t i = 0; i < n; ++i) K::item(params, i, Lanes{0, 1});
}

// Threaded host driver: the items in contiguous chunks over up to num_threads threads (the caller's
// included), one chunk per kMinBytesPerThread of work at most. For copies bound by memory latency
// (scattered records), each core adds outstanding misses. on_chunk_end() runs on each thread after
// its chunk (e.g. a fence for non-temporal stores).
inline constexpr int64_t kMinBytesPerThread = int64_t{4} << 20;

template <class K, class OnChunkEnd>
void run_on_host_threads(const typename K::Params& params, int64_t num_threads, int64_t bytes_per_item,
                         OnChunkEnd on_chunk_end) {
  const int64_t n = K::num_items(params);
  const int64_t by_work = n * bytes_per_item / kMinBytesPerThread;
  const int64_t chunks = std::max<int64_t>(1, std::min({num_threads, by_work, n}));
  auto chunk = [&params, &on_chunk_end, n, chunks](int64_t c) {
    for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i) K::item(params, i, Lanes{0, 1});
    on_chunk_end();
  };
  std::vector<std::thread> workers;
  // Reserved up front, so emplace_back never reallocates: a bad_alloc thrown while the vector
  // holds joinable threads would destroy them unjoined, which calls std::terminate.
  workers.reserve(static_cast<size_t>(chunks));
  int64_t spawned = 1;
  for (; spawned < chunks; ++spawned) {
    try {
      workers.emplace_back(chunk, spawned);
    } catch (const std::system_error&) {
      break;  // no more threads: the caller runs the remaining chunks
    }
  }
  chunk(0);
  for (int64_t c = spawned; c < chunks; ++c) chunk(c);
  for (auto& w : workers) w.join();
}

// CUDA driver: declared for the host side, defined (and explicitly instantiated by the loader's
// generated .cu) under nvcc. Returns a cudaError_t as int, 0 on success.
template <class K>
int run_on_cuda(const typename K::Params& params, void* stream);

#ifdef __CUDACC__
// Launches Kernel(args...) on `stream` (the cuda build) or runs it in the simulator (the sim
// build); returns a cudaError_t as int, 0 on success.
template <auto Kernel, class... Args>
int launch_kernel(dim3 grid, dim3 block, size_t dynamic_smem, void* stream, const Args&... args) {
#ifdef SPARSEKV_SIM
  (void)stream;
  return static_cast<int>(cuda_sim::launch<Kernel>(grid, block, dynamic_smem, args...));
#else
  Kernel<<<grid, block, dynamic_smem, static_cast<cudaStream_t>(stream)>>>(args...);
  return static_cast<int>(cudaGetLastError());
#endif
}

// The block's dynamic shared memory (the launch's dynamic_smem bytes, 16-byte aligned).
template <class T>
SPARSEKV_DEVICE T* dynamic_shared() {
#ifdef SPARSEKV_SIM
  return reinterpret_cast<T*>(cuda_sim::g.dynamic_smem);
#else
  extern __shared__ __align__(16) unsigned char sparsekv_dynamic_smem[];
  return reinterpret_cast<T*>(sparsekv_dynamic_smem);
#endif
}

template <class K, class = void>
struct HasOwnCudaLaunch : std::false_type {};
template <class K>
struct HasOwnCudaLaunch<K, std::void_t<decltype(&K::run_on_cuda)>> : std::true_type {};

template <class K>
__global__ void warp_per_item_kernel(const typename K::Params params) {
  const int64_t n = K::num_items(params);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const Lanes lanes{static_cast<int>(threadIdx.x % kWarpSize), kWarpSize};
  for (int64_t i = first; i < n; i += warps) K::item(params, i, lanes);
}

template <class K>
int run_on_cuda(const typename K::Params& params, void* stream) {
  if constexpr (HasOwnCudaLaunch<K>::value) {
    return K::run_on_cuda(params, stream);
  } else {
    const int64_t n = K::num_items(params);
    if (n == 0) return 0;
    constexpr int kThreads = 256;
    constexpr int64_t kItemsPerBlock = kThreads / kWarpSize;
    const int64_t blocks = (n + kItemsPerBlock - 1) / kItemsPerBlock;
    const unsigned grid = static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
    return launch_kernel<warp_per_item_kernel<K>>(grid, kThreads, 0, stream, params);
  }
}
#endif

}  // namespace sparsekv
