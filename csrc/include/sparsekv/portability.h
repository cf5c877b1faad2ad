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

// Whether any of an item's lanes has its flag set; every lane of the item calls it (on the GPU its
// whole warp, one vote; on the host the one lane's own flag).
SPARSEKV_HOST_DEVICE bool any_lane(bool flag, Lanes lanes) {
  (void)lanes;
#ifdef __CUDA_ARCH__
  return __any_sync(0xffffffffu, flag) != 0;
#else
  return flag;
#endif
}

// Keeps a loop rolled under nvcc (the host compilers of the cpu and sim builds do not know the
// pragma). SPARSEKV_UNROLLED unrolls one fully, so register arrays indexed by its counter stay in registers.
#if defined(__CUDACC__) && !defined(SPARSEKV_SIM)
#define SPARSEKV_ROLLED _Pragma("unroll 1")
#define SPARSEKV_UNROLLED _Pragma("unroll")
#else
#define SPARSEKV_ROLLED
#define SPARSEKV_UNROLLED
#endif

#ifdef __CUDACC__

namespace copy_detail {

// Bytes [lo, hi) of the naturally aligned 8-byte word at `word`, in their places (little-endian);
// the word's other bytes are unspecified. The GPU loads the whole word: an aligned word never
// crosses the end of an allocation (device and pinned host allocations come in whole 256-byte
// granules at least), and the bytes outside [lo, hi) are discarded, so a neighbour written
// concurrently changes nothing. The sim build reads only [lo, hi), so the host sanitizers see no
// access outside the copy.
SPARSEKV_HOST_DEVICE uint64_t load_word_bytes(const uint8_t* word, const uint8_t* lo, const uint8_t* hi) {
#ifdef SPARSEKV_SIM
  uint64_t value = 0;
  const uint8_t* from = word < lo ? lo : word;
  const uint8_t* to = word + 8 < hi ? word + 8 : hi;
  if (from < to) std::memcpy(reinterpret_cast<uint8_t*>(&value) + (from - word), from, static_cast<size_t>(to - from));
  return value;
#else
  (void)lo;
  (void)hi;
  return *reinterpret_cast<const uint64_t*>(word);
#endif
}

// The 8 bytes at p, at any alignment, from the one or two aligned 8-byte words they lie in (only
// bytes in [lo, hi) are used: see load_word_bytes).
SPARSEKV_HOST_DEVICE uint64_t load_bytes8(const uint8_t* p, const uint8_t* lo, const uint8_t* hi) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const auto* word = reinterpret_cast<const uint8_t*>(at & ~uintptr_t{7});
  const int shift = static_cast<int>(at & 7) * 8;
  const uint64_t low = load_word_bytes(word, lo, hi);
  return shift == 0 ? low : (low >> shift) | (load_word_bytes(word + 8, lo, hi) << (64 - shift));
}

// One byte without a byte load (LDG.U8): the aligned 8-byte word that holds it.
SPARSEKV_HOST_DEVICE uint8_t load_byte(const uint8_t* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const auto* word = reinterpret_cast<const uint8_t*>(at & ~uintptr_t{7});
  return static_cast<uint8_t>(load_word_bytes(word, p, p + 1) >> (8 * (at & 7)));
}

// The bytes [0, head) and [tail, n) of a copy, one byte per lane (under 32 bytes: one warp
// instruction, its lanes' loads of one or two aligned words served together).
SPARSEKV_HOST_DEVICE void copy_edges(uint8_t* dst, const uint8_t* src, int64_t head, int64_t tail, int64_t n,
                                     Lanes lanes) {
  const int64_t edge = head + (n - tail);
  for (int64_t k = lanes.lane; k < edge; k += lanes.count) {
    const int64_t off = k < head ? k : tail + (k - head);
    dst[off] = load_byte(src + off);
  }
}

// A copy whose pointers sit equally off a Word-byte boundary (Word = 4, 8, 16): Word-byte words over
// the body (LDG.E.128 / .64 / .32), the head up to the common boundary and the tail (under Word
// bytes each) byte by byte.
template <int Word>
SPARSEKV_HOST_DEVICE void copy_aligned(uint8_t* dst, const uint8_t* src, int64_t n, Lanes lanes) {
  using WordT = std::conditional_t<Word == 16, int4, std::conditional_t<Word == 8, uint2, uint32_t>>;
  const auto misalign = static_cast<int64_t>((Word - (reinterpret_cast<uintptr_t>(dst) & (Word - 1))) & (Word - 1));
  const int64_t head = misalign < n ? misalign : n;
  const int64_t body = (n - head) / Word;
  const auto* sw = reinterpret_cast<const WordT*>(src + head) + lanes.lane;
  const auto* end = reinterpret_cast<const WordT*>(src + head) + body;
  SPARSEKV_ROLLED  // a record is a word or two per lane: unrolled copies of the loop only add registers
  for (auto* dw = reinterpret_cast<WordT*>(dst + head) + lanes.lane; sw < end; dw += lanes.count, sw += lanes.count) {
    *dw = *sw;
  }
  copy_edges(dst, src, head, head + body * Word, n, lanes);
}

// A copy whose pointers sit at different offsets from a 4-byte boundary: every 8-byte word of the
// destination is made of the two aligned 8-byte source words it straddles (LDG.E.64, shifted
// together); the destination's unaligned head and tail (under 8 bytes each) byte by byte.
SPARSEKV_HOST_DEVICE void copy_shifted(uint8_t* dst, const uint8_t* src, int64_t n, Lanes lanes) {
  const auto misalign = static_cast<int64_t>((8 - (reinterpret_cast<uintptr_t>(dst) & 7)) & 7);
  const int64_t head = misalign < n ? misalign : n;
  const int64_t body = (n - head) / 8;
  const int64_t tail = head + 8 * body;
  const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(src + head) & 7) * 8;  // never 0 here
  const auto* base = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src + head) & ~uintptr_t{7});
  auto* dw = reinterpret_cast<uint64_t*>(dst + head);
  SPARSEKV_ROLLED
  for (int64_t k = lanes.lane; k < body; k += lanes.count) {
    const uint64_t low = load_word_bytes(base + 8 * k, src, src + n);
    const uint64_t high = load_word_bytes(base + 8 * k + 8, src, src + n);
    dw[k] = (low >> shift) | (high << (64 - shift));
  }
  copy_edges(dst, src, head, tail, n, lanes);
}

}  // namespace copy_detail
#endif

// Copies n bytes, byte-exact for every length and alignment. On the GPU the lanes of the group
// move strided shares of the widest words the pointers' relative offset allows, and no lane issues
// a byte load (LDG.U8), which costs a whole transaction per byte:
// - pointers equally off a 16-byte boundary (the 584-byte V4 token rows: 584 = 36 x 16 + 8, so
//   every other row of a dense array starts 8 bytes off, source and destination alike): 16-byte
//   words over the body, and a head and a tail of under 16 bytes each;
// - equally off an 8-byte or a 4-byte boundary: 8- or 4-byte words, a head and a tail likewise;
// - otherwise: 8-byte destination words, each shifted together from the two aligned source words
//   it straddles, and a head and tail of under 8 bytes each.
// A head or tail goes one byte per lane, in one warp instruction: each lane reads the aligned
// 8-byte word that holds its byte (copy_detail::load_word_bytes says why that is safe) and stores
// the byte. On the host it is one memcpy.
// Design: a copy is bound by its loads in flight (latency x bandwidth); a warp moving a 584-byte
// row issues 37 16-byte or 73 8-byte accesses where a 4-byte path issues 146, so a warp has 2-4x
// the bytes in flight per instruction (budget at 16k rows: gather_rows.cuh).
SPARSEKV_HOST_DEVICE void copy_bytes(void* dst, const void* src, int64_t n, Lanes lanes) {
#ifdef __CUDA_ARCH__
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const auto relative = reinterpret_cast<uintptr_t>(d) - reinterpret_cast<uintptr_t>(s);
  if ((relative & 15) == 0) {
    copy_detail::copy_aligned<16>(d, s, n, lanes);
  } else if ((relative & 7) == 0) {
    copy_detail::copy_aligned<8>(d, s, n, lanes);
  } else if ((relative & 3) == 0) {
    copy_detail::copy_aligned<4>(d, s, n, lanes);
  } else {
    copy_detail::copy_shifted(d, s, n, lanes);
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
SPARSEKV_DEVICE void warp_per_item(const typename K::Params& params) {
  const int64_t n = K::num_items(params);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const Lanes lanes{static_cast<int>(threadIdx.x % kWarpSize), kWarpSize};
  for (int64_t i = first; i < n; i += warps) K::item(params, i, lanes);
}

inline constexpr int kWarpPerItemThreads = 256;

template <class K>
__global__ void warp_per_item_kernel(const typename K::Params params) {
  warp_per_item<K>(params);
}

// The same, for a kernel K that names the CTAs per SM its design needs (K::kCtasPerSm): nvcc then
// holds its registers to what that many CTAs of 256 threads allow, where it would otherwise use more.
template <class K>
__global__ void __launch_bounds__(kWarpPerItemThreads, K::kCtasPerSm) bounded_warp_per_item_kernel(
    const typename K::Params params) {
  warp_per_item<K>(params);
}

// A CTA per item, for a kernel K whose items take a whole CTA: K::cta_item(params, i, stage) run by
// K::kThreads threads that share K::Stage in static shared memory (K::kCtasPerSm CTAs an SM). Every
// thread of the CTA runs every item, so an item may hold __syncthreads.
template <class K>
__global__ void __launch_bounds__(K::kThreads, K::kCtasPerSm) cta_per_item_kernel(const typename K::Params params) {
  __shared__ typename K::Stage stage;
  const int64_t n = K::num_items(params);
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) K::cta_item(params, i, stage);
}

template <class K>
int run_cta_per_item(const typename K::Params& params, void* stream) {
  const int64_t n = K::num_items(params);
  if (n == 0) return 0;
  const unsigned grid = static_cast<unsigned>(n < 65535 * 16 ? n : 65535 * 16);
  return launch_kernel<cta_per_item_kernel<K>>(grid, K::kThreads, 0, stream, params);
}

template <class K, class = void>
struct HasCtasPerSm : std::false_type {};
template <class K>
struct HasCtasPerSm<K, std::void_t<decltype(K::kCtasPerSm)>> : std::true_type {};

template <class K>
int run_on_cuda(const typename K::Params& params, void* stream) {
  if constexpr (HasOwnCudaLaunch<K>::value) {
    return K::run_on_cuda(params, stream);
  } else {
    const int64_t n = K::num_items(params);
    if (n == 0) return 0;
    constexpr int64_t kItemsPerBlock = kWarpPerItemThreads / kWarpSize;
    const int64_t blocks = (n + kItemsPerBlock - 1) / kItemsPerBlock;
    const unsigned grid = static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
    if constexpr (HasCtasPerSm<K>::value) {
      return launch_kernel<bounded_warp_per_item_kernel<K>>(grid, kWarpPerItemThreads, 0, stream, params);
    } else {
      return launch_kernel<warp_per_item_kernel<K>>(grid, kWarpPerItemThreads, 0, stream, params);
    }
  }
}
#endif

}  // namespace sparsekv
