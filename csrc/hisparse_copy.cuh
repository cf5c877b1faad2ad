// hisparse_copy: token and page copies between paged KV buffers (DSV4 "fp8_ds_mla" and friends),
// for every layer in one call, in any direction (device, pinned host or plain host memory).
//
// Buffers: each side is a table of L per-layer base addresses (uint64 [L]); page p of layer l
// starts at ptrs[l] + p * page_stride (page_stride = the page's byte size for [pages, page_bytes]
// buffers, layers * page_bytes for a page-first host buffer [pages, layers, page_bytes]).
// Page geometry and token addressing come from sparsekv/kv_layout.h (PagedKV<Layout, PageSlots>).
//
// TransferTokens: for every i < N and every layer, the value record and the scale record of slot
//   src_indices[i] are copied to slot dst_indices[i]. A token is two byte ranges of its page (all
//   values first, then all scales), so each is copied on its own. Nothing else is written: not
//   the other slots, not the page padding.
// CopyPages: for every i < N and every layer, the whole page src_pages[i] (kPageBytes, padding
//   included) is copied to page dst_pages[i].
//
// Safety: the per-item code skips ids outside [0, num_slots) (num_slots = INT64_MAX when the
// caller does not know it), so a bad id can never move a byte out of bounds. The host entries
// reject negative, out-of-range and conflicting (same destination, different source) ids before
// any byte moves when the ids are host-readable; the Python wrapper does the same with torch for
// device-resident ids.
//
// GPU: one warp per item (a token across all layers, or one page of one layer), via the default
// warp-per-item driver; copy_bytes moves 16 bytes per lane (every offset here is a multiple of 16
// for V4 pages: 576, 36,864, 37,440). CPU: the same item() in a loop over contiguous chunks of
// items on up to num_threads threads (see run); value records and page rows are written with
// non-temporal stores (see copy_record).
#pragma once

#include "sparsekv/kv_layout.h"
#include "sparsekv/portability.h"

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <immintrin.h>
#define SPARSEKV_HISPARSE_COPY_STREAMING 1
#endif

namespace sparsekv::hisparse_copy {

inline constexpr int64_t kUnknownCount = INT64_MAX;

#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
// The build targets baseline x86-64 (no -march), so the wider stores of stream_lines are picked at
// run time, once per process.
inline const bool kHostHasAvx512 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
}();

// Streams n bytes (dst and n multiples of 64) with one 64-byte non-temporal store per cache line: a
// full line leaves its write-combining buffer at once instead of after four 16-byte stores, which
// measured ~10-18% more bandwidth on scattered records (64k tokens x 21 layers, 1M x 1).
__attribute__((target("avx512f"))) inline void stream_lines(void* dst, const void* src, int64_t n) {
  auto* d = static_cast<__m512i*>(dst);
  const auto* s = static_cast<const __m512i*>(src);
  for (int64_t k = 0; k < n / 64; ++k) _mm512_stream_si512(d + k, _mm512_loadu_si512(s + k));
}
#endif

// copy_bytes, except that the host compiler copies 16-byte words itself, with non-temporal
// stores when `streaming` (whole 64-byte lines on AVX-512 CPUs, see stream_lines). A large copy
// scatters records that are not read back soon: regular stores would first read every destination
// line from memory (read-for-ownership) and evict useful lines, so streaming makes it ~3x faster
// on random slots. A small copy (its records fit in the L2) is faster with regular stores, which
// keep it in cache; the word loop also beats a 576-byte libc memcpy there. The GPU path and
// unaligned host destinations use copy_bytes. A host thread that streamed ends with
// streaming_fence().
SPARSEKV_HOST_DEVICE void copy_record(void* dst, const void* src, int64_t n, Lanes lanes, bool streaming) {
#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
  const auto alignment = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(n);
  if (streaming && kHostHasAvx512 && (alignment & 63) == 0) {
    stream_lines(dst, src, n);
    return;
  }
  if ((alignment & 15) == 0) {
    auto* d = static_cast<__m128i*>(dst);
    const auto* s = static_cast<const __m128i*>(src);
    if (streaming) {
      for (int64_t k = 0; k < n / 16; ++k) _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
    } else {
      for (int64_t k = 0; k < n / 16; ++k) _mm_storeu_si128(d + k, _mm_loadu_si128(s + k));
    }
    return;
  }
#endif
  (void)streaming;
  copy_bytes(dst, src, n, lanes);
}

#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
// Host only: asks for the source lines and the destination scale line of a token a few items
// ahead (random slots defeat the hardware prefetcher; the destination value needs no read, it is
// streamed). A hint that never faults, even for an id the item itself would skip.
template <class Paged>
inline void prefetch_token(const uint8_t* src_base, int64_t s, int64_t src_stride, const uint8_t* dst_base, int64_t d,
                           int64_t dst_stride) {
  const auto src = Paged::token(src_base, s, src_stride);
  for (int64_t k = 0; k < Paged::LayoutT::kValueBytes; k += 64) __builtin_prefetch(src.value + k, 0);
  __builtin_prefetch(src.scale, 0);
  __builtin_prefetch(Paged::token(dst_base, d, dst_stride).scale, 1);
}
#endif

// Orders the streaming stores of a host thread before anything it does next (ending the thread).
inline void streaming_fence() {
#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
  _mm_sfence();
#endif
}

// Both kernels move what pairs of ids name (token slots or pages) between two per-layer tables.
struct IdPairCopy {
  const uint64_t* src_ptrs;
  const uint64_t* dst_ptrs;
  const int64_t* src_ids;
  const int64_t* dst_ids;
  int64_t num_ids;
  int64_t num_layers;
  int64_t src_page_stride;
  int64_t dst_page_stride;
  int64_t src_bound;  // exclusive bound on src ids, kUnknownCount when unknown
  int64_t dst_bound;
  bool streaming;  // host: non-temporal stores (see copy_record)
};

template <class Layout, int64_t PageSlots>
struct TransferTokens {
  using Paged = kv_layout::PagedKV<Layout, PageSlots>;
  using Params = IdPairCopy;
  // Host: prefetch this many token-layers ahead (at least the next token).
  static constexpr int64_t kPrefetchTokenLayers = 8;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_ids; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t s = p.src_ids[i];
    const int64_t d = p.dst_ids[i];
    if (s < 0 || s >= p.src_bound || d < 0 || d >= p.dst_bound) return;
#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
    const int64_t ahead = i + (p.num_layers < kPrefetchTokenLayers ? kPrefetchTokenLayers / p.num_layers : 1);
    const bool prefetch = ahead < p.num_ids;
#endif
    for (int64_t l = 0; l < p.num_layers; ++l) {
#ifdef SPARSEKV_HISPARSE_COPY_STREAMING
      if (prefetch) {
        prefetch_token<Paged>(reinterpret_cast<const uint8_t*>(p.src_ptrs[l]), p.src_ids[ahead], p.src_page_stride,
                              reinterpret_cast<const uint8_t*>(p.dst_ptrs[l]), p.dst_ids[ahead], p.dst_page_stride);
      }
#endif
      const auto src = Paged::token(reinterpret_cast<const uint8_t*>(p.src_ptrs[l]), s, p.src_page_stride);
      const auto dst = Paged::token(reinterpret_cast<uint8_t*>(p.dst_ptrs[l]), d, p.dst_page_stride);
      copy_record(dst.value, src.value, Layout::kValueBytes, lanes, p.streaming);
      copy_bytes(dst.scale, src.scale, Layout::kScaleBytes, lanes);
    }
  }
};

template <class Layout, int64_t PageSlots>
struct CopyPages {
  using Paged = kv_layout::PagedKV<Layout, PageSlots>;
  using Params = IdPairCopy;

  // One item per (page pair, layer): a page is 37 KB, worth a warp of its own on the GPU.
  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_ids * p.num_layers; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t pair = i / p.num_layers;
    const int64_t l = i - pair * p.num_layers;
    const int64_t s = p.src_ids[pair];
    const int64_t d = p.dst_ids[pair];
    if (s < 0 || s >= p.src_bound || d < 0 || d >= p.dst_bound) return;
    copy_record(reinterpret_cast<uint8_t*>(p.dst_ptrs[l]) + d * p.dst_page_stride,
               reinterpret_cast<const uint8_t*>(p.src_ptrs[l]) + s * p.src_page_stride, Paged::kPageBytes, lanes,
                p.streaming);
  }
};

}  // namespace sparsekv::hisparse_copy

#ifdef SPARSEKV_HOST_ENTRY
#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::hisparse_copy {

// Python passes -1 for "not given".
inline int64_t bound_or_unknown(int64_t count) { return count < 0 ? kUnknownCount : count; }

// Below this many bytes per thread, starting a thread costs more than it saves.
inline constexpr int64_t kMinBytesPerThread = int64_t{4} << 20;
// From this many bytes on, host copies stream (about an L2: smaller copies stay in cache).
inline constexpr int64_t kMinStreamingBytes = int64_t{1} << 20;

// Runs K on the module's backend. The cpu backend splits the items into contiguous chunks over up
// to num_threads threads (the caller's included): a scattered copy is bound by memory latency, and
// each core adds outstanding misses. Every thread fences its own streaming stores before it ends.
template <class K>
void run(const typename K::Params& params, DLDevice device, int64_t num_threads, int64_t bytes_per_item) {
#if SPARSEKV_BACKEND_CUDA
  (void)num_threads, (void)bytes_per_item;
  launch<K>(params, device);
#else
  (void)device;
  const int64_t n = K::num_items(params);
  const int64_t by_work = n * bytes_per_item / kMinBytesPerThread;
  const int64_t chunks = std::max<int64_t>(1, std::min({num_threads, by_work, n}));
  auto chunk = [&params, n, chunks](int64_t c) {
    for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i) K::item(params, i, Lanes{0, 1});
    streaming_fence();
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
#endif
}

inline void check_tables(const TensorView& src_ptrs, const TensorView& dst_ptrs, int64_t page_bytes,
                         int64_t src_page_stride, int64_t dst_page_stride) {
  check(src_ptrs, "src_ptrs").dtype<uint64_t>().ndim(1).contiguous().on_backend_device();
  check(dst_ptrs, "dst_ptrs").dtype<uint64_t>().ndim(1).contiguous().same_device(src_ptrs, "src_ptrs");
  check(dst_ptrs, "dst_ptrs").size(0, src_ptrs.size(0), "one base pointer per layer, as src_ptrs");
  check_range(src_page_stride, page_bytes, kUnknownCount, "src_page_stride");
  check_range(dst_page_stride, page_bytes, kUnknownCount, "dst_page_stride");
}

inline void check_ids(const TensorView& src_ids, const char* src_name, int64_t src_count, const char* src_count_name,
                      const TensorView& dst_ids, const char* dst_name, int64_t dst_count, const char* dst_count_name,
                      const TensorView& device_of) {
  check(src_ids, src_name).dtype<int64_t>().ndim(1).contiguous().same_device(device_of, "src_ptrs");
  check(dst_ids, dst_name).dtype<int64_t>().ndim(1).contiguous().same_device(device_of, "src_ptrs");
  check(dst_ids, dst_name).size(0, src_ids.size(0), src_name);
  check_range(src_count, -1, kUnknownCount, src_count_name);
  check_range(dst_count, -1, kUnknownCount, dst_count_name);
}

// Full validation of host-readable ids, before any byte moves: every id in range, and no
// destination named twice with different sources (the result would depend on the write order).
inline void check_host_ids(const int64_t* src, const char* src_name, int64_t src_bound, const int64_t* dst,
                           const char* dst_name, int64_t dst_bound, int64_t n, const TensorView& device_of) {
  if (device_of.device().device_type == kDLCUDA) return;  // the Python wrapper checked them with torch
  check_indices_in_range(src, n, src_bound, src_name);
  check_indices_in_range(dst, n, dst_bound, dst_name);
  check_no_conflicting_destinations(dst, src, n, dst_name, src_name);
}

// Argument names of one id kind, for error messages.
struct IdNames {
  const char* src;
  const char* src_count;
  const char* dst;
  const char* dst_count;
};

// The host entry of both kernels: each id names `id_bytes` bytes per layer; a kernel item moves
// `item_bytes` (which sizes the host threads).
template <class K>
void copy_id_pairs(TensorView src_ptrs, TensorView dst_ptrs, TensorView src_ids, TensorView dst_ids, int64_t src_count,
                   int64_t dst_count, int64_t src_page_stride, int64_t dst_page_stride, int64_t num_threads,
                   IdNames names, int64_t id_bytes, int64_t item_bytes) {
  // 1. Validate the arguments.
  check_tables(src_ptrs, dst_ptrs, K::Paged::kPageBytes, src_page_stride, dst_page_stride);
  check_ids(src_ids, names.src, src_count, names.src_count, dst_ids, names.dst, dst_count, names.dst_count, src_ptrs);

  // 2. Derive the launch parameters.
  const int64_t payload = src_ids.size(0) * src_ptrs.size(0) * id_bytes;
  const IdPairCopy params{static_cast<const uint64_t*>(src_ptrs.data_ptr()),
                          static_cast<const uint64_t*>(dst_ptrs.data_ptr()),
                          static_cast<const int64_t*>(src_ids.data_ptr()),
                          static_cast<const int64_t*>(dst_ids.data_ptr()),
                          src_ids.size(0),
                          src_ptrs.size(0),
                          src_page_stride,
                          dst_page_stride,
                          bound_or_unknown(src_count),
                          bound_or_unknown(dst_count),
                          payload >= kMinStreamingBytes};
  if (params.num_ids == 0 || params.num_layers == 0) return;

  // 3. Validate every id before any byte moves.
  check_host_ids(params.src_ids, names.src, params.src_bound, params.dst_ids, names.dst, params.dst_bound,
                 params.num_ids, src_ptrs);

  // 4. Launch.
  run<K>(params, src_ptrs.device(), num_threads, item_bytes);
}

template <class Layout, int64_t PageSlots>
void transfer_tokens(TensorView src_ptrs, TensorView dst_ptrs, TensorView src_indices, TensorView dst_indices,
                     int64_t src_num_slots, int64_t dst_num_slots, int64_t src_page_stride, int64_t dst_page_stride,
                     int64_t num_threads) {
  // One item is a token across all layers.
  copy_id_pairs<TransferTokens<Layout, PageSlots>>(
      src_ptrs, dst_ptrs, src_indices, dst_indices, src_num_slots, dst_num_slots, src_page_stride, dst_page_stride,
      num_threads, {"src_indices", "src_num_slots", "dst_indices", "dst_num_slots"}, Layout::kBytesPerToken,
      src_ptrs.size(0) * Layout::kBytesPerToken);
}

template <class Layout, int64_t PageSlots>
void copy_pages(TensorView src_ptrs, TensorView dst_ptrs, TensorView src_pages, TensorView dst_pages,
                int64_t src_num_pages, int64_t dst_num_pages, int64_t src_page_stride, int64_t dst_page_stride,
                int64_t num_threads) {
  // One item is a page of one layer.
  using K = CopyPages<Layout, PageSlots>;
  copy_id_pairs<K>(src_ptrs, dst_ptrs, src_pages, dst_pages, src_num_pages, dst_num_pages, src_page_stride,
                   dst_page_stride, num_threads, {"src_pages", "src_num_pages", "dst_pages", "dst_num_pages"},
                   K::Paged::kPageBytes, K::Paged::kPageBytes);
}

}  // namespace sparsekv::hisparse_copy
#endif
