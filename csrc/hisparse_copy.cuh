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
// Input contract (ffi.h rules 3-5): the per-item code skips ids outside [0, num_slots) (num_slots =
// INT64_MAX when the caller does not know it) and layers whose base address is null, so a bad id or
// table can never move a byte out of bounds, also on the GPU without the opt-in torch check.
// Before any byte moves, the host entries reject null base addresses, negative, out-of-range and
// conflicting (same destination, different source) ids, and, when the two tables share a buffer,
// ids that are both a source and another pair's destination; for host-readable tables in C++, for
// device-resident ones with torch in the Python wrapper.
//
// GPU: one warp per item (a token across all layers, or one page of one layer), via the default
// warp-per-item driver; copy_bytes moves 16 bytes per lane (every offset here is a multiple of 16
// for V4 pages: 576, 36,864, 37,440). CPU: the same item() over contiguous chunks of items on up
// to num_threads threads (launch_threaded); value records and page rows are written with
// non-temporal stores (copy_record in sparsekv/paged_copy.h).
#pragma once

#include "sparsekv/kv_layout.h"
#include "sparsekv/paged_copy.h"
#include "sparsekv/portability.h"

namespace sparsekv::hisparse_copy {

inline constexpr int64_t kUnknownCount = INT64_MAX;

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
#ifdef SPARSEKV_STREAMING_STORES
    const int64_t ahead = i + (p.num_layers < kPrefetchTokenLayers ? kPrefetchTokenLayers / p.num_layers : 1);
    const bool prefetch = ahead < p.num_ids;
#endif
    for (int64_t l = 0; l < p.num_layers; ++l) {
      if (p.src_ptrs[l] == 0 || p.dst_ptrs[l] == 0) continue;  // a null layer is skipped, never dereferenced
#ifdef SPARSEKV_STREAMING_STORES
      if (prefetch) {
        prefetch_token<Paged>(reinterpret_cast<const uint8_t*>(p.src_ptrs[l]), p.src_ids[ahead], p.src_page_stride,
                              reinterpret_cast<const uint8_t*>(p.dst_ptrs[l]), p.dst_ids[ahead], p.dst_page_stride);
      }
#endif
      copy_paged_token<Paged>(reinterpret_cast<uint8_t*>(p.dst_ptrs[l]), d, p.dst_page_stride,
                              reinterpret_cast<const uint8_t*>(p.src_ptrs[l]), s, p.src_page_stride, lanes,
                              p.streaming);
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
    if (p.src_ptrs[l] == 0 || p.dst_ptrs[l] == 0) return;  // a null layer is skipped, never dereferenced
    copy_record(reinterpret_cast<uint8_t*>(p.dst_ptrs[l]) + d * p.dst_page_stride,
               reinterpret_cast<const uint8_t*>(p.src_ptrs[l]) + s * p.src_page_stride, Paged::kPageBytes, lanes,
                p.streaming);
  }
};

}  // namespace sparsekv::hisparse_copy

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::hisparse_copy {

// Python passes -1 for "not given".
inline int64_t bound_or_unknown(int64_t count) { return count < 0 ? kUnknownCount : count; }

// From this many bytes on, host copies stream (about an L2: smaller copies stay in cache).
inline constexpr int64_t kMinStreamingBytes = int64_t{1} << 20;

inline void check_tables(const TensorView& src_ptrs, const TensorView& dst_ptrs, int64_t page_bytes,
                         int64_t src_page_stride, int64_t dst_page_stride) {
  check(src_ptrs, "src_ptrs").dtype<uint64_t>().ndim(1).contiguous().on_backend_device();
  check(dst_ptrs, "dst_ptrs").dtype<uint64_t>().ndim(1).contiguous().same_device(src_ptrs, "src_ptrs");
  check(dst_ptrs, "dst_ptrs").size(0, src_ptrs.size(0), "one base pointer per layer, as src_ptrs");
  check_range(src_page_stride, page_bytes, kUnknownCount - 1, "src_page_stride");
  check_range(dst_page_stride, page_bytes, kUnknownCount - 1, "dst_page_stride");
}

inline void check_ids(const TensorView& src_ids, const char* src_name, int64_t src_count, const char* src_count_name,
                      const TensorView& dst_ids, const char* dst_name, int64_t dst_count, const char* dst_count_name,
                      const TensorView& device_of) {
  check(src_ids, src_name).dtype<int64_t>().ndim(1).contiguous().same_device(device_of, "src_ptrs");
  check(dst_ids, dst_name).dtype<int64_t>().ndim(1).contiguous().same_device(device_of, "src_ptrs");
  check(dst_ids, dst_name).size(0, src_ids.size(0), src_name);
  check_range(src_count, -1, kUnknownCount - 1, src_count_name);
  check_range(dst_count, -1, kUnknownCount - 1, dst_count_name);
}

// Argument names of one id kind, for error messages.
struct IdNames {
  const char* src;
  const char* src_count;
  const char* dst;
  const char* dst_count;
};

// Full validation of host-readable tables and ids, before any byte moves (contract rules 3-5 of
// ffi.h): non-null base addresses, every id in range, no destination named twice with different
// sources, and no chained ids when the two tables share a buffer. The Python wrapper does the same
// with torch for device-resident tables.
inline void check_host_tables_and_ids(const IdPairCopy& p, const IdNames& names) {
  check_pointer_table(p.src_ptrs, p.num_layers, "src_ptrs");
  check_pointer_table(p.dst_ptrs, p.num_layers, "dst_ptrs");
  check_indices_in_range(p.src_ids, p.num_ids, p.src_bound, names.src);
  check_indices_in_range(p.dst_ids, p.num_ids, p.dst_bound, names.dst);
  check_no_conflicting_destinations(p.dst_ids, p.src_ids, p.num_ids, names.dst, names.src);
  if (tables_share_a_buffer(p.src_ptrs, p.dst_ptrs, p.num_layers)) {
    check_no_chained_ids(p.src_ids, p.dst_ids, p.num_ids, names.src, names.dst);
  }
}

// The host entry of both kernels: each id names `id_bytes` bytes per layer; a kernel item moves
// `item_bytes` (which sizes the host threads).
template <class K>
void copy_id_pairs(TensorView src_ptrs, TensorView dst_ptrs, TensorView src_ids, TensorView dst_ids, int64_t src_count,
                   int64_t dst_count, int64_t src_page_stride, int64_t dst_page_stride, int64_t num_threads,
                   IdNames names, int64_t id_bytes, int64_t item_bytes) {
  // 1. Validate the arguments (the kernel writes only through the tables, so no tensor is written).
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

  // 3. Validate every table entry and id before any byte moves (host-readable tables only).
  if (src_ptrs.device().device_type != kDLCUDA) check_host_tables_and_ids(params, names);

  // 4. Launch; every host thread fences its own streaming stores before it ends.
  launch_threaded<K>(params, src_ptrs.device(), num_threads, item_bytes, [] { streaming_fence(); });
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
