// paged_copy: moving one token of a block-split paged layout (kv_layout.h), the copy that the
// HiSparse swap-in (swap_in.h) and the token transfer (hisparse_copy.cuh) both do.
//
// A token is two byte ranges of its page (all value records first, then all scale records), so
// copy_paged_token moves the value record and the scale record separately. The value record goes
// through copy_record, which on the host may use non-temporal stores (`streaming`) for large
// scattered copies; the GPU path is copy_bytes, one warp per token.
#pragma once

#include <cstdint>

#include "sparsekv/kv_layout.h"
#include "sparsekv/portability.h"

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <immintrin.h>
#define SPARSEKV_STREAMING_STORES 1
#endif

namespace sparsekv {

#ifdef SPARSEKV_STREAMING_STORES
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
#ifdef SPARSEKV_STREAMING_STORES
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

// Orders the streaming stores of a host thread before anything it does next (ending the thread).
inline void streaming_fence() {
#ifdef SPARSEKV_STREAMING_STORES
  _mm_sfence();
#endif
}

// Copies token slot s of the paged buffer at src_base (page stride src_stride bytes) to slot d of
// the one at dst_base: the value record, then the scale record. Nothing else of either page moves.
template <class Paged>
SPARSEKV_HOST_DEVICE void copy_paged_token(uint8_t* dst_base, int64_t d, int64_t dst_stride, const uint8_t* src_base,
                                           int64_t s, int64_t src_stride, Lanes lanes, bool streaming = false) {
  const auto to = Paged::token(dst_base, d, dst_stride);
  const auto from = Paged::token(src_base, s, src_stride);
  copy_record(to.value, from.value, Paged::LayoutT::kValueBytes, lanes, streaming);
  copy_bytes(to.scale, from.scale, Paged::LayoutT::kScaleBytes, lanes);
}

#ifdef SPARSEKV_STREAMING_STORES
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

}  // namespace sparsekv
