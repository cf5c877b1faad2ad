// hisparse_index: the HiSparse swap-in with a resident-token index (IndexedSwapIn), whose work per
// step follows the top-k width K and the misses, not the hot-buffer size H.
//
// Same contract as SwapIn (csrc/include/sparsekv/swap_in.h): same outputs, same device_buffer_tokens, same bytes,
// same miss plan and counters, and the same policy (LRU, or the protected LRU of the template
// arguments ProtectRecent = W, ProtectNear = S), for the same inputs. What differs is where
// the residency and the LRU order live. Per request row rid, three tables (the "resident index"):
//   * slot_of[rid, pos] (int16, [max_reqs, max_len], the columns of host_cache_locs): the hot slot
//     holding C4 position pos, -1 when none. The inverse of device_buffer_tokens[rid, :H].
//   * queue[rid, 0..2H) (int16) and queue_pos[rid, 0..H+2) (int32): the LRU order as a queue with
//     lazy deletion. queue_pos[rid, s] (s < H) is where slot s's live entry sits; queue_pos[rid, H]
//     and [H + 1] are head and tail. An entry j in [head, tail) is live iff queue_pos[queue[j]] == j,
//     and the live entries, front to back, are the LRU order (least recently used first): exactly
//     the lru_slots row SwapIn would hold. The LRU order of SwapIn's lru_slots is not read or written.
// Bytes per request and layer: 2 * max_len + 4 * H + 4 * (H + 2).
//
// One slow-path step (n > H): hash the step's distinct tokens (O(K)); hits are slot_of lookups that
// device_buffer_tokens confirms (O(K)); the misses take the first live non-hit entries from the queue's
// head (the head moves past every entry it looks at: each was stale, a hit that is appended again,
// or a slot given to a miss); misses are appended in miss order, then hits in their old queue order
// (a block-wide sort of at most K keys). When fewer than K free entries remain at the tail, the live
// entries are first compacted to the front (O(H), at most once per H / K steps at no misses: O(K)
// amortized). Stale entries are dropped by the head or by compaction, so no step reads more than
// O(K) entries amortized. The fast path (n <= H) is SwapIn's and touches no table.
//
// Protected LRU: the walk from the head takes the unprotected non-hits (SwapIn's rule:
// is_protected<W, S>) and passes over the protected ones, which stay in the LRU order where they
// are; when too few unprotected ones remain, a second walk takes the protected ones in LRU order.
// The protected slots passed over are the least recently used live entries, so after the appends
// they move (order kept) to just before the walk's end and the head starts at them: the stale
// entries of the walked range are dropped, and the next step's walk reads each protected slot at
// the front once more but no stale entry again. Per step the walk reads the hits, the misses' slots,
// the protected slots ahead of the last one taken (at most W + 2 S K, whatever H is; SwapIn's
// rule costs each up to 3 bucket lookups) and stale entries dropped for good.
//
// Safe by construction: a slot, queue position or token outside its table is never followed; a
// miss that finds no evictable entry gets no slot (-1), as in SwapIn. A corrupted index gives wrong
// hits, never an out-of-bounds access. The index-check mode (SPARSEKV_CHECK_INDICES=1) runs SwapIn's
// checks and also checks that the index agrees with device_buffer_tokens.
#pragma once

#include <cstdint>

#include "sparsekv/indices.h"
#include "sparsekv/portability.h"
#include "sparsekv/swap_in.h"
#include "sparsekv/team.h"

namespace sparsekv::hisparse {

template <int K, int H, int BlockSize, class Layout, int ProtectRecent = 0, int ProtectNear = 0>
struct IndexedSwapIn {
  // The scanning kernel's LRU instance: its hash table, row serving, fast path and finish (the
  // protected policy's rule is its is_protected<W, S>; its protected scratch grows with H, not used here).
  using Base = SwapIn<K, H, BlockSize, Layout>;
  static_assert(2 * H < 65536, "hisparse_index: queue positions are 16-bit in the sort keys");
  static_assert(ProtectRecent >= 0 && ProtectNear >= 0 && ProtectNear < 4096,
                "hisparse_index: protect_recent must be >= 0 and protect_near in [0, 4096)");
  static constexpr bool kProtect = ProtectRecent > 0 || ProtectNear > 0;
  static constexpr int kBlockSize = BlockSize;
  static constexpr int kHashBits = Base::kHashBits;
  static constexpr int kHashSize = Base::kHashSize;
  static constexpr int kQueue = 2 * H;
  static constexpr int kSortSize = 1 << log2_ceil(K);  // the hit sort runs on a power of two
  static constexpr int32_t kEmpty = -1;
  static constexpr int32_t kSortPad = 0x7fffffff;

  struct Params {
    typename Base::Params base;
    int16_t* slot_of;
    int64_t slot_of_stride;
    int16_t* queue;
    int64_t queue_stride;
    int32_t* queue_pos;
    int64_t queue_pos_stride;
  };

  // Per-request scratch. Unlike SwapIn's, it has no H-sized array.
  struct Shared : NearBuckets<kHashSize, ProtectNear> {
    int32_t hash_key[kHashSize];    // token, kEmpty
    int32_t hash_first[kHashSize];  // first top-k index of the token; -1 once it was a miss
    int16_t hash_slot[kHashSize];   // hot slot the token resolved to, -1 none
    int32_t hit_key[kSortSize];     // (old queue position << 15) | slot of each hit, sorted
    int16_t miss_index[K];          // top-k index of the m-th miss
    int16_t evict_slot[K];          // slot the m-th miss takes, -1 none
    int32_t warp_counts[BlockSize / kWarpSize];
    int32_t copies;
    int32_t walked_end;  // the queue position after the last entry the misses' walk consumed
  };
  static_assert(sizeof(Shared) <= 227 * 1024, "hisparse_index: the per-request scratch exceeds 227 KiB of shared "
                                              "memory; lower num_top_k");

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.base.batch; }

  SPARSEKV_HOST_DEVICE static int lookup(const Shared& s, int32_t token) { return Base::lookup(s, token); }

  SPARSEKV_HOST_DEVICE static bool is_slot(int32_t slot) { return slot >= 0 && slot < H; }

  // What the misses' walk finds at queue position j (slot: the entry's slot when live).
  enum Entry : int { kPassed = 0, kEvictable = 1, kProtected = 2 };
  SPARSEKV_HOST_DEVICE static Entry classify(const Shared& s, const int16_t* queue, const int32_t* pos,
                                             const int32_t* tokens, int j, int tail, int64_t newest, int16_t* slot) {
    *slot = j < tail ? queue[j] : int16_t(-1);
    if (!is_slot(*slot) || pos[*slot] != j) return kPassed;  // stale: the slot's live entry is later
    const int32_t held = tokens[*slot];
    const int cell = held >= 0 ? lookup(s, held) : -1;
    if (cell >= 0 && s.hash_slot[cell] == *slot) return kPassed;  // a hit: appended again in step 6
    if constexpr (kProtect) {
      if (Base::template is_protected<ProtectRecent, ProtectNear>(s, held, newest)) return kProtected;
    } else {
      (void)newest;
    }
    return kEvictable;
  }

  // SwapIn's: padding, bad rows, rows of one request refused or served in batch order.
  SPARSEKV_HOST_DEVICE static void serve(const Params& p, int64_t b, const Team& t, Shared& s) {
    Base::template serve_rows<IndexedSwapIn>(p, p.base, b, t, s);
  }

  // Batch row b alone; called by every thread of the team.
  SPARSEKV_HOST_DEVICE static void run(const Params& p, int64_t b, const Team& t, Shared& s) {
    const typename Base::Params& q = p.base;
    int32_t* out = q.top_k_device_locs + b * q.out_stride;
    const int64_t num_real = q.num_real_reqs ? static_cast<int64_t>(*q.num_real_reqs) : q.batch;
    const int64_t rid = load_index(q.req_pool_indices, q.req_is64, b);
    if (b >= num_real || rid < 0 || rid >= q.max_reqs) {
      Base::refuse(q, b, t);
      return;
    }
    const int64_t seq_len = load_index(q.seq_lens, q.seq_is64, b);
    if (seq_len <= H) {
      Base::fast_path(q, b, t, s.warp_counts, out, q.top_k_tokens + b * q.top_k_stride,
                      q.device_buffer_locs + rid * q.buffer_stride, seq_len);
    } else {
      slow_path(p, b, rid, t, s);
    }
  }

  // Moves the live entries of [head, tail) to [0, live), keeping their order; returns live. In place:
  // an entry is written at or before where it was read, after the whole chunk was read.
  SPARSEKV_HOST_DEVICE static int compact(int16_t* queue, int32_t* pos, int head, int tail, const Team& t,
                                          Shared& s) {
    int live = 0;
    for (int base = head; base < tail; base += t.size) {
      const int j = base + t.tid;
      const int16_t slot = j < tail ? queue[j] : int16_t(-1);
      const bool keep = is_slot(slot) && pos[slot] == j;
      int n = 0;
      const int r = t.rank(keep, &n, s.warp_counts);
      if (keep && live + r < kQueue) {
        queue[live + r] = slot;
        pos[slot] = live + r;
      }
      live += n;
    }
    t.sync();
    return live < kQueue ? live : kQueue;
  }

  // Moves the live entries of [from, end) to the end of that range, keeping their order; returns where
  // the first one lands. In place, from the back: an entry is written at or after where it was read,
  // after its whole chunk was read (the rank's barrier).
  SPARSEKV_HOST_DEVICE static int compact_to_end(int16_t* queue, int32_t* pos, int from, int end, const Team& t,
                                                 Shared& s) {
    int kept = 0;
    for (int top = end; top > from; top -= t.size) {
      const int j = top - 1 - t.tid;  // thread order runs from the back
      const int16_t slot = j >= from ? queue[j] : int16_t(-1);
      const bool keep = is_slot(slot) && pos[slot] == j;
      int n = 0;
      const int r = t.rank(keep, &n, s.warp_counts);
      if (keep) {
        queue[end - 1 - (kept + r)] = slot;
        pos[slot] = end - 1 - (kept + r);
      }
      kept += n;
    }
    t.sync();
    return end - kept;
  }

  // Ascending sort of s.hit_key[0, kSortSize) (padded with kSortPad): bitonic on the GPU.
  SPARSEKV_HOST_DEVICE static void sort_hits(Shared& s, int num_hits, const Team& t) {
#ifdef __CUDA_ARCH__
    for (int i = num_hits + t.tid; i < kSortSize; i += t.size) s.hit_key[i] = kSortPad;
    t.sync();
    for (int k = 2; k <= kSortSize; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = t.tid; i < kSortSize; i += t.size) {
          const int partner = i ^ j;
          if (partner > i) {
            const int32_t a = s.hit_key[i], c = s.hit_key[partner];
            if ((a > c) == ((i & k) == 0)) {
              s.hit_key[i] = c;
              s.hit_key[partner] = a;
            }
          }
        }
        t.sync();
      }
    }
#else
    (void)t;
    std::sort(s.hit_key, s.hit_key + num_hits);
#endif
  }

  SPARSEKV_HOST_DEVICE static void slow_path(const Params& p, int64_t b, int64_t rid, const Team& t, Shared& s) {
    const typename Base::Params& q = p.base;
    int32_t* out = q.top_k_device_locs + b * q.out_stride;
    const int32_t* top_k = q.top_k_tokens + b * q.top_k_stride;
    const int32_t* locs = q.device_buffer_locs + rid * q.buffer_stride;
    const int64_t seq_len = load_index(q.seq_lens, q.seq_is64, b);
    const int64_t newest = seq_len - 1;
    int32_t* tokens = q.device_buffer_tokens + rid * q.buffer_stride;
    int16_t* slot_of = p.slot_of + rid * p.slot_of_stride;
    int16_t* queue = p.queue + rid * p.queue_stride;
    int32_t* pos = p.queue_pos + rid * p.queue_pos_stride;
    const int32_t old_head = pos[H], old_tail = pos[H + 1];
    int head = old_head >= 0 && old_head <= kQueue ? old_head : 0;
    int tail = old_tail >= head && old_tail <= kQueue ? old_tail : head;

    // 0. Room for K appends at the tail, else compact the live entries to the front.
    if (tail + K > kQueue) {
      tail = compact(queue, pos, head, tail, t, s);
      head = 0;
    }

    // 1. Hash the step's distinct tokens (SwapIn's step 1).
    if (t.tid == 0) s.walked_end = head;
    Base::hash_step(s, t, top_k, seq_len);

    // 2. Hits: the index names a slot and the slot's token confirms it. Collected with their queue
    //    position for the re-append in old LRU order.
    int num_hits = 0;
    for (int base = 0; base < kHashSize; base += t.size) {
      const int j = base + t.tid;
      const int32_t tok = j < kHashSize ? s.hash_key[j] : kEmpty;
      const int16_t slot = tok >= 0 && tok < q.max_len ? slot_of[tok] : int16_t(-1);
      const bool hit = is_slot(slot) && tokens[slot] == tok;
      int n = 0;
      const int r = t.rank(hit, &n, s.warp_counts);
      if (hit) {
        s.hash_slot[j] = slot;
        const int32_t at = pos[slot];
        s.hit_key[num_hits + r] = ((at >= 0 && at < kQueue ? at : kQueue - 1) << 15) | slot;
      }
      num_hits += n;
    }
    t.sync();

    // 3. Misses in top-k order (first occurrence of each token).
    const int num_misses = Base::for_each_miss(s, t, top_k, seq_len, [&](int m, int i, int) {
      s.miss_index[m] = static_cast<int16_t>(i);
      s.evict_slot[m] = -1;
    });

    // 4. The misses take the first live non-hit entries from the head, in queue (LRU) order; under a
    //    protected policy the unprotected ones first, then, when too few, the protected ones. The
    //    walk ends after the last entry taken (at the tail when too few): every entry it passed is
    //    stale, a hit (appended again), a taken slot (appended as a miss) or a protected slot passed
    //    over, which step 6 moves to just before the walk's end, where the new head starts.
    int taken = 0;
    for (int base = head; taken < num_misses && base < tail; base += t.size) {
      const int j = base + t.tid;
      int16_t slot;
      const Entry entry = classify(s, queue, pos, tokens, j, tail, newest, &slot);
      int n = 0;
      const int r = t.rank(entry == kEvictable, &n, s.warp_counts);
      if (entry == kEvictable && taken + r < num_misses) {
        s.evict_slot[taken + r] = slot;
        if (taken + r == num_misses - 1) s.walked_end = j + 1;
      }
      taken += n;
    }
    t.sync();
    if (num_misses > 0 && taken < num_misses && t.tid == 0) s.walked_end = tail;  // too few: all looked at
    if constexpr (kProtect) {
      if (taken < num_misses) {  // every unprotected slot is taken: the protected ones, in LRU order
        int found = 0;
        for (int base = head; taken + found < num_misses && base < tail; base += t.size) {
          const int j = base + t.tid;
          int16_t slot;
          const bool prot = classify(s, queue, pos, tokens, j, tail, newest, &slot) == kProtected;
          int n = 0;
          const int r = t.rank(prot, &n, s.warp_counts);
          if (prot && taken + found + r < num_misses) s.evict_slot[taken + found + r] = slot;
          found += n;
        }
        taken += found;
      }
    }
    t.sync();
    const int assigned = taken < num_misses ? taken : num_misses;

    // 5. Each miss evicts its slot's token from the index and takes the slot. The evicted tokens are
    //    not wanted this step and the loaded ones are, so no two threads write one index entry.
    for (int m = t.tid; m < num_misses; m += t.size) {
      const int16_t slot = s.evict_slot[m];
      const int32_t tok = top_k[s.miss_index[m]];
      const int cell = lookup(s, tok);
      s.hash_first[cell] = -1;  // loaded this step (for the hit counter)
      if (!is_slot(slot)) continue;
      const int32_t old = tokens[slot];
      if (old >= 0 && old < q.max_len && slot_of[old] == slot) slot_of[old] = -1;
      tokens[slot] = tok;
      if (tok < q.max_len) slot_of[tok] = slot;
      s.hash_slot[cell] = slot;
    }

    // 6. Append the miss slots in miss order, then the hits in their old LRU order; then the slots a
    //    protected policy passed over move up to the walk's end (the rest of the walked range is stale
    //    now), so the next step's walk does not pass the stale entries again.
    sort_hits(s, num_hits, t);
    t.sync();
    const int walked_end = s.walked_end;
    for (int m = t.tid; m < assigned; m += t.size) {
      const int16_t slot = s.evict_slot[m];
      queue[tail + m] = slot;
      pos[slot] = tail + m;
    }
    for (int h = t.tid; h < num_hits; h += t.size) {
      const int16_t slot = static_cast<int16_t>(s.hit_key[h] & 0x7fff);
      queue[tail + assigned + h] = slot;
      pos[slot] = tail + assigned + h;
    }
    t.sync();
    int new_head = walked_end;
    if constexpr (kProtect) new_head = compact_to_end(queue, pos, head, walked_end, t, s);
    if (t.tid == 0) {
      pos[H] = new_head;
      pos[H + 1] = tail + assigned + num_hits;
    }

    // 7-8. Outputs, copies, plan and counters (SwapIn's); the m-th miss took evict_slot[m].
    Base::finish_slow_path(q, b, rid, t, s, out, top_k, locs, seq_len, num_misses, s.evict_slot, 1, num_misses);
  }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t b, Lanes) {
    Shared s;
    serve(p, b, Team::current(), s);
  }

#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
template <int K, int H, int BlockSize, class Layout, int ProtectRecent, int ProtectNear>
int IndexedSwapIn<K, H, BlockSize, Layout, ProtectRecent, ProtectNear>::run_on_cuda(const Params& p, void* stream) {
  Params deferred = p;
  return launch_swap_in<IndexedSwapIn, Layout>(deferred, deferred.base, K, stream);
}
#endif

}  // namespace sparsekv::hisparse

#ifdef SPARSEKV_HOST_ENTRY
namespace sparsekv::hisparse {

// The index-check pass of the indexed path: SwapIn's, then the index against device_buffer_tokens
// (slot_of is its inverse on the rows the step reads; the queue's live entries name every slot once).
template <class P, int K, int H>
void validate_resident_index(const P& p) {
  const auto& q = p.base;
  const int64_t num_real = q.num_real_reqs ? *q.num_real_reqs : q.batch;
  for (int64_t b = 0; b < num_real; ++b) {
    const int64_t rid = load_index(q.req_pool_indices, q.req_is64, b);
    if (load_index(q.seq_lens, q.seq_is64, b) <= H) continue;
    const int32_t* tokens = q.device_buffer_tokens + rid * q.buffer_stride;
    const int16_t* slot_of = p.slot_of + rid * p.slot_of_stride;
    int64_t indexed = 0;
    for (int64_t tok = 0; tok < q.max_len; ++tok) {
      const int16_t slot = slot_of[tok];
      if (slot == -1) continue;
      ++indexed;
      if (slot < 0 || slot >= H || tokens[slot] != tok) {
        TVM_FFI_THROW(ValueError) << "sparsekv: argument `slot_of`[" << rid << ", " << tok << "] = " << slot
                                  << " disagrees with `device_buffer_tokens` (rebuild the resident index)";
      }
    }
    int64_t held = 0;
    for (int s = 0; s < H; ++s) held += tokens[s] >= 0 && tokens[s] < q.max_len;
    if (held != indexed) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `slot_of`[" << rid << "] indexes " << indexed
                                << " tokens but `device_buffer_tokens` holds " << held
                                << " (rebuild the resident index)";
    }
    const int16_t* queue = p.queue + rid * p.queue_stride;
    const int32_t* pos = p.queue_pos + rid * p.queue_pos_stride;
    const int32_t head = pos[H], tail = pos[H + 1];
    if (head < 0 || head > tail || tail > 2 * H) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `queue_pos`[" << rid << "] has head " << head << " and tail "
                                << tail << ", outside 0 <= head <= tail <= " << 2 * H;
    }
    for (int s = 0; s < H; ++s) {
      if (pos[s] < head || pos[s] >= tail || queue[pos[s]] != s) {
        TVM_FFI_THROW(ValueError) << "sparsekv: argument `queue_pos`[" << rid << ", " << s << "] = " << pos[s]
                                  << " is not a live queue entry of slot " << s;
      }
    }
  }
}

// The entry, as SwapIn's: plain (speculative = false: every real row its own request) or speculative
// (rows of one request served in batch order). The index tables follow lru_slots.
template <int K, int H, int BlockSize, class Layout, int ProtectRecent = 0, int ProtectNear = 0>
void load_cache_to_device_buffer_indexed(
    TensorView top_k_tokens, TensorView device_buffer_tokens, TensorView host_cache_locs,
    TensorView device_buffer_locs, TensorView host_cache, TensorView device_buffer, TensorView top_k_device_locs,
    TensorView req_pool_indices, TensorView seq_lens, TensorView lru_slots, TensorView slot_of, TensorView queue,
    TensorView queue_pos, int64_t item_size_bytes, OptionalTensor num_real_reqs, OptionalTensor miss_src,
    OptionalTensor miss_dst, OptionalTensor miss_count, OptionalTensor counters, int64_t index_check,
    bool speculative) {
  // 1-2. Validate and derive the parameters: SwapIn's (lru_slots is checked there, never read or
  //      written here), then the index tables.
  const IndexCheck mode = index_check_mode(index_check);
  const TensorView& dev = top_k_tokens;
  const int64_t max_reqs = device_buffer_tokens.size(0);
  check(slot_of, "slot_of").dtype<int16_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(slot_of, "slot_of").size(0, max_reqs, "rows of device_buffer_tokens");
  check(slot_of, "slot_of").size(1, host_cache_locs.size(1), "columns of host_cache_locs");
  check(queue, "queue").dtype<int16_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(queue, "queue").size(0, max_reqs, "rows of device_buffer_tokens").size(1, 2 * H, "2 * hot_buffer_size");
  check(queue_pos, "queue_pos").dtype<int32_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(queue_pos, "queue_pos").size(0, max_reqs, "rows of device_buffer_tokens");
  check(queue_pos, "queue_pos").size(1, H + 2, "hot_buffer_size + 2 (positions, head, tail)");
  const auto base = swap_in_params<K, H, BlockSize, Layout>(
      top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
      top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
      optional_arg(num_real_reqs, "num_real_reqs"), optional_arg(miss_src, "miss_src"),
      optional_arg(miss_dst, "miss_dst"), optional_arg(miss_count, "miss_count"), optional_arg(counters, "counters"));
  check_disjoint({read(top_k_tokens, "top_k_tokens"), written(device_buffer_tokens, "device_buffer_tokens"),
                  read(host_cache_locs, "host_cache_locs"), read(device_buffer_locs, "device_buffer_locs"),
                  read(host_cache, "host_cache"),
                  written(device_buffer, "device_buffer"),
                  written(top_k_device_locs, "top_k_device_locs"), read(req_pool_indices, "req_pool_indices"),
                  read(seq_lens, "seq_lens"), read(lru_slots, "lru_slots"), written(slot_of, "slot_of"),
                  written(queue, "queue"), written(queue_pos, "queue_pos")});
  using Base = SwapIn<K, H, BlockSize, Layout>;
  using Kernel = IndexedSwapIn<K, H, BlockSize, Layout, ProtectRecent, ProtectNear>;
  typename Kernel::Params p{};
  p.base = base;
  p.base.speculative = speculative;
  p.slot_of = static_cast<int16_t*>(slot_of.data_ptr());
  p.slot_of_stride = slot_of.stride(0);
  p.queue = static_cast<int16_t*>(queue.data_ptr());
  p.queue_stride = queue.stride(0);
  p.queue_pos = static_cast<int32_t*>(queue_pos.data_ptr());
  p.queue_pos_stride = queue_pos.stride(0);
  // 3. The index-check pass (host-readable tables only); SwapIn's refusal of rows of one request.
  const bool on_device = top_k_tokens.device().device_type == kDLCUDA;
  if (mode != IndexCheck::kOff) {
    if (on_device) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `index_check` needs host-readable tables (pass host copies)";
    }
    validate_swap_in<typename Base::Params, K, H>(p.base);
    validate_resident_index<typename Kernel::Params, K, H>(p);
  } else if (!on_device && !speculative) {
    check_distinct_requests(p.base);
  }
  if (p.base.batch == 0) return;
  // 4. Launch on the caller's stream.
  launch<Kernel>(p, top_k_tokens.device());
}

}  // namespace sparsekv::hisparse
#endif
