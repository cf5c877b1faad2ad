// hisparse: the HiSparse swap-in (SwapIn) and the replay of its recorded miss plan (CopyPlanned).
//
// SwapIn, its contract and its checks are csrc/include/sparsekv/swap_in.h (the indexed swap-in,
// hisparse_index, builds on them too); here are its entry and the replay.
//
// CopyPlanned replays a plan into another layer's buffers: for b < num_real_reqs[0] and
// m < miss_count[b], device_buffer[miss_dst[b, m]] = host_cache[miss_src[b, m]], one warp per entry.
// Out-of-range entries are skipped (the swap-in records -1 for a copy it skipped); the index-check
// mode rejects them. device_buffer must not share memory with any other argument; destinations
// named twice with different sources are rejected for host-readable plans (the caller's duty on
// the device).
//
// Each entry takes an `index_check` (ffi.h IndexCheck): 0 run, 1 validate every index then run
// (host-readable tables); the swap-in's, then `speculative`. Optional tensors are
// tvm::ffi::Optional (Python None).
#pragma once

#include <cstdint>

#include "sparsekv/indices.h"
#include "sparsekv/portability.h"
#include "sparsekv/swap_in.h"

namespace sparsekv::hisparse {

template <class Layout>
struct CopyPlanned {
  struct Params : TokenCaches {
    const int64_t* miss_src;
    const void* miss_dst;
    bool miss_dst_is64;
    const int32_t* miss_count;
    int64_t miss_src_stride;
    int64_t miss_dst_stride;
    int64_t batch;
    int64_t width;  // plan columns
    const int32_t* num_real_reqs;
  };

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.batch * p.width; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t b = i / p.width;
    const int64_t m = i % p.width;
    if (b >= static_cast<int64_t>(*p.num_real_reqs) || m >= p.miss_count[b]) return;
    const int64_t src = p.miss_src[b * p.miss_src_stride + m];
    const int64_t dst = load_index(p.miss_dst, p.miss_dst_is64, b * p.miss_dst_stride + m);
    p.template copy_token<Layout>(src, dst, lanes);
  }
};

}  // namespace sparsekv::hisparse

#ifdef SPARSEKV_HOST_ENTRY
#include <algorithm>
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::hisparse {

// The entry. speculative = false: every real row names its own request; true (MTP draft tokens,
// speculative decoding): several real rows may name one request, whose rows are served in batch
// order by one block, as if run one call after another.
template <int K, int H, int BlockSize, class Layout, int ProtectRecent = 0, int ProtectNear = 0>
void load_cache_to_device_buffer(TensorView top_k_tokens, TensorView device_buffer_tokens, TensorView host_cache_locs,
                                 TensorView device_buffer_locs, TensorView host_cache, TensorView device_buffer,
                                 TensorView top_k_device_locs, TensorView req_pool_indices, TensorView seq_lens,
                                 TensorView lru_slots, int64_t item_size_bytes, OptionalTensor num_real_reqs,
                                 OptionalTensor miss_src, OptionalTensor miss_dst, OptionalTensor miss_count,
                                 OptionalTensor counters, int64_t index_check, bool speculative) {
  // 1-2. Validate and derive the parameters.
  const IndexCheck mode = index_check_mode(index_check);
  auto p = swap_in_params<K, H, BlockSize, Layout>(
      top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
      top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
      optional_arg(num_real_reqs, "num_real_reqs"), optional_arg(miss_src, "miss_src"),
      optional_arg(miss_dst, "miss_dst"), optional_arg(miss_count, "miss_count"), optional_arg(counters, "counters"));
  p.speculative = speculative;
  const bool on_device = top_k_tokens.device().device_type == kDLCUDA;
  // 3. The index-check pass, when asked for (host-readable tables only).
  if (mode != IndexCheck::kOff) {
    if (on_device) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `index_check` needs host-readable tables (pass host copies)";
    }
    validate_swap_in<decltype(p), K, H>(p);
  } else if (!on_device && !speculative) {
    check_distinct_requests(p);
  }
  if (p.batch == 0) return;
  // 4. Launch on the caller's stream.
  launch<SwapIn<K, H, BlockSize, Layout, ProtectRecent, ProtectNear>>(p, top_k_tokens.device());
}

// The destination rule and, with `strict` (the index-check mode), every entry of a recorded plan:
// rows below num_real_reqs, counts within the plan's width, slots in range.
template <class P>
void validate_plan(const P& p, bool strict) {
  const int64_t num_real = *p.num_real_reqs;
  check_range(num_real, 0, p.batch, "num_real_reqs");
  std::vector<int64_t> src, dst;
  for (int64_t b = 0; b < num_real; ++b) {
    const int64_t count = p.miss_count[b];
    if (strict && (count < 0 || count > p.width)) index_error("miss_count", b, 0, count, p.width + 1, "a plan row");
    for (int64_t m = 0; m < std::min<int64_t>(count, p.width); ++m) {
      const int64_t s = p.miss_src[b * p.miss_src_stride + m];
      const int64_t d = load_index(p.miss_dst, p.miss_dst_is64, b * p.miss_dst_stride + m);
      if (strict && (s < 0 || s >= p.host_slots)) index_error("miss_src", b, m, s, p.host_slots, "a planned copy");
      if (strict && (d < 0 || d >= p.device_slots)) index_error("miss_dst", b, m, d, p.device_slots, "a planned copy");
      if (s >= 0 && s < p.host_slots && d >= 0 && d < p.device_slots) {
        src.push_back(s);
        dst.push_back(d);
      }
    }
  }
  check_no_conflicting_destinations(dst.data(), src.data(), static_cast<int64_t>(dst.size()), "miss_dst", "miss_src");
}

template <class Layout>
void copy_cache_planned(TensorView miss_src, TensorView miss_dst, TensorView miss_count, TensorView num_real_reqs,
                        TensorView host_cache, TensorView device_buffer, int64_t item_size_bytes, int64_t index_check) {
  // 1. Validate.
  const IndexCheck mode = index_check_mode(index_check);
  check(miss_src, "miss_src").dtype<int64_t>().ndim(2).rows_dense().on_backend_device();
  const int64_t bs = miss_src.size(0);
  check(miss_dst, "miss_dst").ndim(2).rows_dense().size(0, bs, "rows of miss_src").same_device(miss_src, "miss_src");
  const bool dst_is64 = check(miss_dst, "miss_dst").int32_or_int64();
  check(miss_dst, "miss_dst").size(1, miss_src.size(1), "columns of miss_src");
  check(miss_count, "miss_count").dtype<int32_t>().ndim(1).contiguous().size(0, bs, "rows of miss_src");
  check(miss_count, "miss_count").same_device(miss_src, "miss_src");
  check(num_real_reqs, "num_real_reqs").dtype<int32_t>().ndim(1).size(0, 1).same_device(miss_src, "miss_src");
  typename CopyPlanned<Layout>::Params p{};
  static_cast<TokenCaches&>(p) =
      token_caches<Layout>(host_cache, device_buffer, item_size_bytes, miss_src, "miss_src");
  check_disjoint({read(miss_src, "miss_src"), read(miss_dst, "miss_dst"), read(miss_count, "miss_count"),
                  read(num_real_reqs, "num_real_reqs"), read(host_cache, "host_cache"),
                  written(device_buffer, "device_buffer")});

  // 2. Derive the parameters.
  p.miss_src = static_cast<const int64_t*>(miss_src.data_ptr());
  p.miss_dst = miss_dst.data_ptr();
  p.miss_dst_is64 = dst_is64;
  p.miss_count = static_cast<const int32_t*>(miss_count.data_ptr());
  p.miss_src_stride = miss_src.stride(0);
  p.miss_dst_stride = miss_dst.stride(0);
  p.batch = bs;
  p.width = miss_src.size(1);
  p.num_real_reqs = static_cast<const int32_t*>(num_real_reqs.data_ptr());

  // 3. Host-readable plans: no destination twice with different sources (always), every entry in
  //    range (index-check mode). On the device, distinct destinations are the caller's duty.
  if (miss_src.device().device_type != kDLCUDA) {
    validate_plan(p, mode != IndexCheck::kOff);
  } else if (mode != IndexCheck::kOff) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `index_check` needs a host-readable plan (pass host copies)";
  }
  if (p.batch * p.width == 0) return;

  // 4. Launch.
  launch<CopyPlanned<Layout>>(p, miss_src.device());
}

}  // namespace sparsekv::hisparse
#endif
