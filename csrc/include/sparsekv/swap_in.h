// swap_in: the HiSparse swap-in (SwapIn), the building block of both swap-in families: hisparse
// (the scanning LRU entry) and hisparse_index (IndexedSwapIn, the same contract over a resident
// index, whose kernel serves rows with SwapIn's hash table, row serving, fast path and finish). In
// namespace hisparse, the namespace of both families. The host section holds the checks both
// entries run (shapes and memory, the index-check pass, the distinct-requests rule).
//
// Contract of SwapIn (the policy, restated as plain Python, is sparsekv.testing.hisparse_policy).
// K = top-k width, H = hot slots per request. For batch row b with rid = req_pool_indices[b], n = seq_lens[b] and newest = n - 1, the
// request's hot buffer is row rid of three tables: device_buffer_tokens (token held by each slot,
// -1 = empty), device_buffer_locs (physical device token slot of each slot; column H is the reserved
// newest-token slot) and lru_slots (the H slot ids, least recently used first).
//   * Padding (b >= num_real_reqs[0]) and rid outside the tables: out[b, :] = -1, miss_count[b] = 0,
//     nothing else is touched.
//   * Fast path, n <= H (slot = position): out[b, i] = device_buffer_locs[rid, tok] for i < min(n, K)
//     and 0 <= tok < n, else -1. Tables untouched, nothing loaded.
//   * Slow path, n > H. An entry outside [0, n) is "no token" (-1). newest -> column H. A token held
//     by a hot slot is a hit and keeps its slot. The m-th distinct missing token, in top-k order,
//     takes the m-th least-recently-used slot that is not a hit, is written to device_buffer_tokens,
//     and its bytes move host_cache[host_cache_locs[rid, tok]] -> device_buffer[locs[rid, slot]].
//     Repeated entries of one token share its slot. lru_slots[rid] becomes
//     [unused non-hits | miss slots in miss order | hit slots], each group in its previous LRU order.
//   * Protected LRU (template arguments ProtectRecent = W, ProtectNear = S, either > 0; both 0 is
//     the LRU above): a non-hit slot is protected when its token t >= 0 lies in the last W positions
//     (t >= newest - W) or within S positions of a token the step asks for (a hit or a miss). The
//     misses take the unprotected non-hits in LRU order, then the protected ones in LRU order;
//     lru_slots becomes [unused non-hits | miss slots | hit slots] as for LRU (the model:
//     swap_in_step(protect_recent=W, protect_near=S)). The indexed entry serves both.
//   * Optional outputs: the miss plan (miss_src[b, m], miss_dst[b, m] for m < miss_count[b]) and
//     device counters {hits, misses, bytes} added to without a host sync.
// Never written: host_cache, host_cache_locs, device_buffer_locs, column H and beyond of
// device_buffer_tokens, table rows of padding rows, device bytes other than the miss slots.
//
// Rows of one request (MTP draft tokens, speculative decoding), the entry's `speculative` flag.
// Plain (false): each real row is served in its own block, so two real rows naming one request
// would race on its tables and slots; they are refused (host-readable tables: ValueError before
// anything is written; on the device, with no host sync: every such row comes out all -1 with no
// miss, its request's tables untouched). Speculative (true): all real rows of a request are served
// in one block, in batch order, each on the tables the previous row left: the result equals running
// the rows one call after another. A token missing from several of them is loaded once (the first
// row loads it, the next ones hit it), and each row gets the slots of its own top-k, which stay its
// own while the group selects at most H distinct tokens (a later row's misses then evict none of
// them).
//
// Input contract (ffi.h): no written argument (top_k_device_locs, device_buffer_tokens, lru_slots,
// device_buffer, the plan, counters) shares memory with any other argument; the entry rejects it
// (the slow path, for one, reads the top-k row again after writing the output row). The device
// slots a step may write, device_buffer_locs[rid, 0..H] of the real rows, must be distinct: the
// caller's duty, checked by the index-check mode (SPARSEKV_CHECK_INDICES=1) with every index.
//
// Safe by construction: a slot, loc or table index outside its buffer is never dereferenced. A copy
// whose host or device loc is out of range is skipped (and still recorded in the plan, where the
// replay skips it too); an LRU entry outside [0, H) gets no token and yields -1 if a miss lands on it.
// Row offsets are 64-bit.
//
// Launch shape: the host runs the per-request logic sequentially; on the GPU one block of BlockSize
// threads serves one request, with the top-k hash table and the LRU compaction in shared memory and
// block-wide ballot scans keeping every compaction in index order (so both backends agree bit for bit).
// Given a plan, the GPU defers the copies to a second launch over all misses of the batch
// (MissCopies, below); without one, each block copies its own misses, a warp per miss.
//
#pragma once

#include "sparsekv/indices.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/paged_copy.h"
#include "sparsekv/portability.h"
#include "sparsekv/team.h"

namespace sparsekv::hisparse {

// ---------------------------------------------------------------------------------------------
// Token byte layouts of the host and device caches. A layout names how many token slots a buffer
// of `rows` rows holds and how one token moves.

// Generic MLA: slot s is item_bytes contiguous bytes at base + s * row_stride.
struct LinearRows {
  SPARSEKV_HOST_DEVICE static int64_t slots(int64_t rows) { return rows; }
  SPARSEKV_HOST_DEVICE static void copy(uint8_t* dst, int64_t dst_stride, int64_t d, const uint8_t* src,
                                        int64_t src_stride, int64_t s, int64_t item_bytes, Lanes lanes) {
    copy_bytes(dst + d * dst_stride, src + s * src_stride, item_bytes, lanes);
  }
};

// A block-split paged layout (kv_layout.h): one token is a value range and a scale range of its page
// row, on both sides (the host mirrors the device's page rows).
template <class Paged>
struct PagedRows {
  using PagedT = Paged;
  SPARSEKV_HOST_DEVICE static int64_t slots(int64_t rows) { return rows * Paged::kPageSlots; }
  SPARSEKV_HOST_DEVICE static void copy(uint8_t* dst, int64_t dst_stride, int64_t d, const uint8_t* src,
                                        int64_t src_stride, int64_t s, int64_t item_bytes, Lanes lanes) {
    (void)item_bytes;
    copy_paged_token<Paged>(dst, d, dst_stride, src, s, src_stride, lanes);
  }
};

// DSV4 C4: V4 tokens (584 B) in pages of PageSlots slots (32, 64 or 128: full-token pages of 128, 256
// or 512 tokens; 37,440 B for 64 slots).
template <int PageSlots>
struct Dsv4C4 : PagedRows<kv_layout::PagedKV<kv_layout::V4, PageSlots>> {
  static_assert(PageSlots == 32 || PageSlots == 64 || PageSlots == 128, "hisparse: C4 pages hold 32, 64 or 128 slots");
};

template <class Layout>
inline constexpr bool kIsPaged = !std::is_same_v<Layout, LinearRows>;

// The two caches a token moves between, host -> device (SwapIn's misses, CopyPlanned's replay).
struct TokenCaches {
  const uint8_t* host_cache;
  int64_t host_stride;
  int64_t host_slots;
  uint8_t* device_buffer;
  int64_t device_stride;
  int64_t device_slots;
  int64_t item_bytes;

  SPARSEKV_HOST_DEVICE bool in_range(int64_t src, int64_t dst) const {
    return src >= 0 && src < host_slots && dst >= 0 && dst < device_slots;
  }

  // Host slot src -> device slot dst, skipped (false) when either is outside its cache.
  template <class Layout>
  SPARSEKV_HOST_DEVICE bool copy_token(int64_t src, int64_t dst, Lanes lanes) const {
    if (!in_range(src, dst)) return false;
    Layout::copy(device_buffer, device_stride, dst, host_cache, host_stride, src, item_bytes, lanes);
    return true;
  }
};

// SwapIn's launch parameters (the same for every K, H and policy).
struct SwapInParams : TokenCaches {
  const int32_t* top_k_tokens;
  int64_t top_k_stride;
  int32_t* top_k_device_locs;
  int64_t out_stride;
  int32_t* device_buffer_tokens;
  const int32_t* device_buffer_locs;
  int64_t buffer_stride;
  const int64_t* host_cache_locs;
  int64_t max_len;  // columns (and row stride) of host_cache_locs
  int16_t* lru_slots;
  int64_t lru_stride;
  const void* req_pool_indices;
  bool req_is64;
  const void* seq_lens;
  bool seq_is64;
  int64_t batch;
  int64_t max_reqs;
  const int32_t* num_real_reqs;  // nullptr: every row is real
  int64_t* miss_src;  // nullptr: no plan
  void* miss_dst;
  bool miss_dst_is64;
  int32_t* miss_count;
  int64_t miss_src_stride;
  int64_t miss_dst_stride;
  int64_t* counters;  // nullptr: no counters; else {hits, misses, bytes}
  bool speculative;   // rows of one request are served together, in batch order (else refused)
  bool defer_copies = false;  // the GPU with a plan: the misses are recorded here, copied by MissCopies
};

// The protected LRU's per-request scratch (empty for LRU): the victim order (unprotected non-hits,
// then protected ones, each in LRU order), the protected ones while the scan collects them, and
// each non-hit's victim rank (unprotected r >= 0, the p-th protected -1 - p), by LRU position.
template <int H, bool On>
struct ProtectScratch {};
template <int H>
struct ProtectScratch<H, true> {
  int16_t victims[H];
  int16_t protected_slots[H];
  int16_t victim_rank[H];
};

// The step's requested tokens by bucket of Near + 1 positions, for the protected LRU's "within Near
// positions of a requested token" (SwapIn's and IndexedSwapIn's scratch; empty when Near = 0). Two
// tokens of one bucket lie within Near of each other, and the tokens within Near of t lie in t's
// bucket or the two next to it, so three lookups (t's bucket non-empty, the one below holding a
// token >= t - Near, the one above one <= t + Near) replace 2 Near + 1 lookups of the top-k table.
// Open addressing at load <= 1/2 over Cells (>= 2 K) cells, one per bucket: its smallest token and
// minus its largest (both kept by fetch_min).
template <int Cells, int Near>
struct NearBuckets {
  static_assert(Cells > 0 && (Cells & (Cells - 1)) == 0, "hisparse: bucket cells are a power of two");
  static constexpr int kBits = log2_ceil(Cells);
  int32_t bucket_key[Cells];  // bucket index, -1 empty
  int32_t bucket_lo[Cells];
  int32_t bucket_neg_hi[Cells];

  SPARSEKV_HOST_DEVICE static int64_t bucket_of(int64_t token) { return token / (Near + 1); }
  SPARSEKV_HOST_DEVICE static int cell_of(int64_t bucket) {
    return static_cast<int>((static_cast<uint32_t>(bucket) * 2654435761u) >> (32 - kBits)) & (Cells - 1);
  }

  SPARSEKV_HOST_DEVICE void clear(const Team& t) {
    for (int j = t.tid; j < Cells; j += t.size) {
      bucket_key[j] = -1;
      bucket_lo[j] = 0x7fffffff;
      bucket_neg_hi[j] = 0x7fffffff;
    }
  }

  // A requested token (0 <= token < 2^31 - 1), from any thread of the team.
  SPARSEKV_HOST_DEVICE void add(int32_t token) {
    const int32_t bucket = static_cast<int32_t>(bucket_of(token));
    for (int pos = cell_of(bucket);; pos = (pos + 1) & (Cells - 1)) {
      const int32_t prev = Team::compare_and_swap(&bucket_key[pos], -1, bucket);
      if (prev == -1 || prev == bucket) {
        Team::fetch_min(&bucket_lo[pos], token);
        Team::fetch_min(&bucket_neg_hi[pos], -token);
        return;
      }
    }
  }

  // Cell of bucket, or -1 when no requested token lies in it.
  SPARSEKV_HOST_DEVICE int find(int64_t bucket) const {
    if (bucket < 0) return -1;
    for (int pos = cell_of(bucket);; pos = (pos + 1) & (Cells - 1)) {
      const int32_t key = bucket_key[pos];
      if (key == bucket) return pos;
      if (key == -1) return -1;
    }
  }

  // Whether a requested token lies within Near positions of held (>= 0).
  SPARSEKV_HOST_DEVICE bool near(int64_t held) const {
    const int64_t bucket = bucket_of(held);
    if (find(bucket) >= 0) return true;
    const int below = find(bucket - 1);
    if (below >= 0 && -static_cast<int64_t>(bucket_neg_hi[below]) >= held - Near) return true;
    const int above = find(bucket + 1);
    return above >= 0 && bucket_lo[above] <= held + Near;
  }
};
template <int Cells>
struct NearBuckets<Cells, 0> {
  SPARSEKV_HOST_DEVICE void clear(const Team&) {}
  SPARSEKV_HOST_DEVICE void add(int32_t) {}
};

// ---------------------------------------------------------------------------------------------
template <int K, int H, int BlockSize, class Layout, int ProtectRecent = 0, int ProtectNear = 0>
struct SwapIn {
  static_assert(K >= 1 && K < 32768, "hisparse: num_top_k must be in [1, 32768) (int16 slot ids)");
  static_assert(H >= K && H < 32768, "hisparse: hot_buffer_size must be in [num_top_k, 32768) (int16 slot ids)");
  static_assert(BlockSize >= kWarpSize && BlockSize <= 1024 && BlockSize % kWarpSize == 0,
                "hisparse: block_size must be a multiple of 32 in [32, 1024]");

  static_assert(ProtectRecent >= 0 && ProtectNear >= 0 && ProtectNear < 4096,
                "hisparse: protect_recent must be >= 0 and protect_near in [0, 4096)");
  static constexpr bool kProtect = ProtectRecent > 0 || ProtectNear > 0;
  static constexpr int kTopK = K;
  static constexpr int kHot = H;
  static constexpr int kBlockSize = BlockSize;
  // Open addressing at load <= 1/2: every probe sequence reaches an empty cell.
  static constexpr int kHashBits = log2_ceil(2 * K);
  static constexpr int kHashSize = 1 << kHashBits;
  static constexpr int32_t kEmpty = -1;

  using Params = SwapInParams;

  // Per-request scratch: shared memory on the GPU, a stack frame on the host.
  struct Shared : ProtectScratch<H, kProtect>, NearBuckets<kHashSize, ProtectNear> {
    int32_t hash_key[kHashSize];    // token, kEmpty
    int32_t hash_first[kHashSize];  // first top-k index of the token; -1 once it was a miss
    int16_t hash_slot[kHashSize];   // hot slot the token resolved to, -1 none
    int16_t lru_out[H];             // hits from the front, non-hits from the back, both in LRU order
    int16_t miss_index[K];          // top-k index of the m-th miss
    int32_t warp_counts[BlockSize / kWarpSize];
    int32_t copies;
  };
  static_assert(sizeof(Shared) <= 227 * 1024,
                "hisparse: the per-request scratch (top-k hash table and LRU arrays) exceeds the 227 KiB of shared "
                "memory a block can have on sm_90/sm_100; lower num_top_k or hot_buffer_size");

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.batch; }

  SPARSEKV_HOST_DEVICE static int hash_of(int32_t token) {
    return static_cast<int>((static_cast<uint32_t>(token) * 2654435761u) >> (32 - kHashBits)) & (kHashSize - 1);
  }

  // The top-k hash table of a scratch S with hash_key and hash_first cells (SwapIn's, IndexedSwapIn's).
  template <class S>
  SPARSEKV_HOST_DEVICE static void insert(S& s, int32_t token, int32_t index) {
    for (int pos = hash_of(token);; pos = (pos + 1) & (kHashSize - 1)) {
      const int32_t prev = Team::compare_and_swap(&s.hash_key[pos], kEmpty, token);
      if (prev == kEmpty || prev == token) {
        Team::fetch_min(&s.hash_first[pos], index);
        return;
      }
    }
  }

  // Cell of token, or -1 when absent.
  template <class S>
  SPARSEKV_HOST_DEVICE static int lookup(const S& s, int32_t token) {
    for (int pos = hash_of(token);; pos = (pos + 1) & (kHashSize - 1)) {
      const int32_t key = s.hash_key[pos];
      if (key == token) return pos;
      if (key == kEmpty) return -1;
    }
  }

  SPARSEKV_HOST_DEVICE static bool is_token(int32_t token, int64_t seq_len) { return token >= 0 && token < seq_len; }

  // Step 1 of a slow-path row, into a scratch S with the top-k table and NearBuckets (SwapIn's,
  // IndexedSwapIn's): the step's distinct tokens, each with its first top-k index (the newest one has
  // its own slot and is never looked up); the copy counter starts at 0.
  template <class S>
  SPARSEKV_HOST_DEVICE static void hash_step(S& s, const Team& t, const int32_t* top_k, int64_t seq_len) {
    for (int j = t.tid; j < kHashSize; j += t.size) {
      s.hash_key[j] = kEmpty;
      s.hash_first[j] = K;
      s.hash_slot[j] = -1;
    }
    s.clear(t);
    if (t.tid == 0) s.copies = 0;
    t.sync();
    for (int i = t.tid; i < K; i += t.size) {
      const int32_t tok = top_k[i];
      if (is_token(tok, seq_len) && tok != seq_len - 1) {
        insert(s, tok, i);
        s.add(tok);
      }
    }
    t.sync();
  }

  // Step 3 of a slow-path row: on_miss(m, i, cell) for the m-th distinct token no hot slot holds, in
  // top-k order (i: its first top-k index, cell: its hash cell), every m in one team-wide pass per
  // chunk of the top-k; returns the number of misses, after a barrier.
  template <class S, class OnMiss>
  SPARSEKV_HOST_DEVICE static int for_each_miss(S& s, const Team& t, const int32_t* top_k, int64_t seq_len,
                                                OnMiss on_miss) {
    int num_misses = 0;
    for (int base = 0; base < K; base += t.size) {
      const int i = base + t.tid;
      const int32_t tok = i < K ? top_k[i] : -1;
      const int cell = is_token(tok, seq_len) && tok != seq_len - 1 ? lookup(s, tok) : -1;
      const bool miss = cell >= 0 && s.hash_first[cell] == i && s.hash_slot[cell] < 0;
      int n = 0;
      const int r = t.rank(miss, &n, s.warp_counts);
      if (miss) on_miss(num_misses + r, i, cell);
      num_misses += n;
    }
    t.sync();
    return num_misses;
  }

  // The protected LRU's rule (Recent = W, Near = S) for a non-hit slot holding `held`: in the last
  // Recent positions, or within Near positions of a token of the step's hash table (the scratch's
  // NearBuckets<kHashSize, Near>, filled with the same tokens: SwapIn's or IndexedSwapIn's).
  template <int Recent, int Near, class Scratch>
  SPARSEKV_HOST_DEVICE static bool is_protected(const Scratch& s, int32_t held, int64_t newest) {
    if (held < 0) return false;
    if (Recent > 0 && held >= newest - Recent) return true;
    if constexpr (Near > 0) {
      return s.near(held);
    } else {
      return false;
    }
  }

  // Work unit b of a launch; called by every thread of the team. A real row whose request another
  // real row also names: plain, refused (like padding: -1, no miss, tables untouched: two
  // blocks must never work on one request's tables); speculative, the first such row serves
  // them all, in batch order, each with the tables the previous one left (the later rows' units do
  // nothing). Rows of distinct requests are served alone either way.
  SPARSEKV_HOST_DEVICE static void serve(const Params& p, int64_t b, const Team& t, Shared& s) {
    serve_rows<SwapIn>(p, p, b, t, s);
  }

  // serve() for a swap-in Kernel whose parameters kp hold these (p) and whose Kernel::run(kp, row, t, s)
  // serves one row (SwapIn itself, IndexedSwapIn).
  template <class Kernel, class KP, class S>
  SPARSEKV_HOST_DEVICE static void serve_rows(const KP& kp, const Params& p, int64_t b, const Team& t, S& s) {
    const int64_t num_real = p.num_real_reqs ? static_cast<int64_t>(*p.num_real_reqs) : p.batch;
    const int64_t rid = load_index(p.req_pool_indices, p.req_is64, b);
    if (b >= num_real || rid < 0 || rid >= p.max_reqs) {
      Kernel::run(kp, b, t, s);
      return;
    }
    const int64_t last = num_real < p.batch ? num_real : p.batch;
    int before = 0, after = 0;
    for (int64_t base = 0; base < last; base += t.size) {
      const int64_t r = base + t.tid;
      const bool same = r < last && r != b && load_index(p.req_pool_indices, p.req_is64, r) == rid;
      int n_before = 0, n_after = 0;
      t.rank(same && r < b, &n_before, s.warp_counts);
      t.rank(same && r > b, &n_after, s.warp_counts);
      before += n_before;
      after += n_after;
    }
    if (!p.speculative && before + after > 0) {
      refuse(p, b, t);
      return;
    }
    if (before > 0) return;  // served by the request's first row
    Kernel::run(kp, b, t, s);
    for (int64_t r = b + 1; after > 0 && r < last; ++r) {
      if (load_index(p.req_pool_indices, p.req_is64, r) != rid) continue;
      t.sync();  // the previous row's table, LRU and byte writes are seen by every thread
      Kernel::run(kp, r, t, s);
      --after;
    }
  }

  SPARSEKV_HOST_DEVICE static void refuse(const Params& p, int64_t b, const Team& t) {
    for (int i = t.tid; i < K; i += t.size) p.top_k_device_locs[b * p.out_stride + i] = -1;
    if (t.tid == 0 && p.miss_count) p.miss_count[b] = 0;
  }

  // Batch row b alone; called by every thread of the team.
  SPARSEKV_HOST_DEVICE static void run(const Params& p, int64_t b, const Team& t, Shared& s) {
    int32_t* out = p.top_k_device_locs + b * p.out_stride;
    const int32_t* top_k = p.top_k_tokens + b * p.top_k_stride;
    const int64_t num_real = p.num_real_reqs ? static_cast<int64_t>(*p.num_real_reqs) : p.batch;
    const int64_t rid = load_index(p.req_pool_indices, p.req_is64, b);
    if (b >= num_real || rid < 0 || rid >= p.max_reqs) {
      refuse(p, b, t);
      return;
    }
    const int64_t seq_len = load_index(p.seq_lens, p.seq_is64, b);
    const int32_t* locs = p.device_buffer_locs + rid * p.buffer_stride;
    if (seq_len <= H) {
      fast_path(p, b, t, s.warp_counts, out, top_k, locs, seq_len);
    } else {
      slow_path(p, b, rid, t, s, out, top_k, locs, seq_len);
    }
  }

  SPARSEKV_HOST_DEVICE static void fast_path(const Params& p, int64_t b, const Team& t, int32_t* warp_counts,
                                             int32_t* out, const int32_t* top_k, const int32_t* locs,
                                             int64_t seq_len) {
    const int64_t used = seq_len < K ? seq_len : K;
    int hits = 0;
    for (int base = 0; base < K; base += t.size) {
      const int i = base + t.tid;
      const int32_t tok = i < used ? top_k[i] : -1;
      const bool valid = is_token(tok, seq_len);
      if (i < K) out[i] = valid ? locs[tok] : -1;
      int n = 0;
      t.rank(valid, &n, warp_counts);
      hits += n;
    }
    if (t.tid == 0) {
      if (p.miss_count) p.miss_count[b] = 0;
      if (p.counters) add_counter(&p.counters[0], hits);
    }
  }

  SPARSEKV_HOST_DEVICE static void slow_path(const Params& p, int64_t b, int64_t rid, const Team& t, Shared& s,
                                             int32_t* out, const int32_t* top_k, const int32_t* locs,
                                             int64_t seq_len) {
    const int64_t newest = seq_len - 1;
    int32_t* tokens = p.device_buffer_tokens + rid * p.buffer_stride;
    int16_t* lru = p.lru_slots + rid * p.lru_stride;

    // 1. Hash the step's distinct tokens.
    hash_step(s, t, top_k, seq_len);

    // 2. Walk the LRU order: hits compact forward, the rest backward, both keeping LRU order, so
    //    lru_out[H - 1 - e] is the e-th least-recently-used evictable slot.
    int num_hits = 0, num_evictable = 0, num_unprotected = 0, num_protected = 0;
    for (int base = 0; base < H; base += t.size) {
      const int j = base + t.tid;
      const bool in = j < H;
      const int16_t slot = in ? lru[j] : int16_t(-1);
      const bool slot_ok = slot >= 0 && slot < H;
      const int32_t held = slot_ok ? tokens[slot] : kEmpty;
      const int pos = held >= 0 ? lookup(s, held) : -1;
      const bool hit = pos >= 0;
      // The non-hits are the trip's other slots: their rank and count follow from the hits' (the
      // trip's slots are its first threads), one block scan where two ran.
      int n_hit = 0;
      const int r_hit = t.rank(hit, &n_hit, s.warp_counts);
      const int n_in = H - base < t.size ? H - base : t.size;
      const int r_evict = t.tid - r_hit;
      const int n_evict = n_in - n_hit;
      if (hit) {
        s.lru_out[num_hits + r_hit] = slot;
        s.hash_slot[pos] = slot;
      } else if (in) {
        s.lru_out[H - 1 - (num_evictable + r_evict)] = slot;
      }
      if constexpr (kProtect) {
        const bool prot = in && !hit && is_protected<ProtectRecent, ProtectNear>(s, held, newest);
        int n_prot = 0;
        const int r_prot = t.rank(prot, &n_prot, s.warp_counts);
        const int r_unprot = r_evict - r_prot;  // the unprotected are the other non-hits
        const int n_unprot = n_evict - n_prot;
        if (in && !hit) {
          const int e = num_evictable + r_evict;
          if (prot) {
            s.protected_slots[num_protected + r_prot] = slot;
            s.victim_rank[e] = static_cast<int16_t>(-1 - (num_protected + r_prot));
          } else {
            s.victims[num_unprotected + r_unprot] = slot;
            s.victim_rank[e] = static_cast<int16_t>(num_unprotected + r_unprot);
          }
        }
        num_unprotected += n_unprot;
        num_protected += n_prot;
      }
      num_hits += n_hit;
      num_evictable += n_evict;
    }
    t.sync();
    if constexpr (kProtect) {  // the victim order: unprotected, then protected
      for (int q = t.tid; q < num_protected; q += t.size) s.victims[num_unprotected + q] = s.protected_slots[q];
      t.sync();
    }

    // 3. Misses in top-k order (first occurrence of each token) take evictable slots in LRU order.
    const int num_misses = for_each_miss(s, t, top_k, seq_len, [&](int m, int i, int cell) {
      int16_t slot = -1;
      if (m < num_evictable) {
        if constexpr (kProtect) {
          slot = s.victims[m];
        } else {
          slot = s.lru_out[H - 1 - m];
        }
      }
      s.miss_index[m] = static_cast<int16_t>(i);
      s.hash_first[cell] = -1;  // marks the token as loaded this step (for the hit counter)
      if (slot >= 0 && slot < H) {
        s.hash_slot[cell] = slot;
        tokens[slot] = top_k[i];
      }
    });

    // 4. LRU order becomes [unused evictables | miss slots | hits]: a permutation of the old row.
    const int used = num_misses < num_evictable ? num_misses : num_evictable;
    const int unused = num_evictable - used;
    if constexpr (kProtect) {
      // The unused non-hits keep their LRU order (a compaction by victim rank), then the misses'
      // slots in miss order, then the hits.
      int placed = 0;
      for (int base = 0; base < num_evictable; base += t.size) {
        const int e = base + t.tid;
        const int r = e < num_evictable ? s.victim_rank[e] : 0;
        const bool keep = e < num_evictable && (r >= 0 ? r : num_unprotected - 1 - r) >= used;
        int n_keep = 0;
        const int r_keep = t.rank(keep, &n_keep, s.warp_counts);
        if (keep) lru[placed + r_keep] = s.lru_out[H - 1 - e];
        placed += n_keep;
      }
      for (int m = t.tid; m < used; m += t.size) lru[unused + m] = s.victims[m];
      for (int j = t.tid; j < num_hits; j += t.size) lru[num_evictable + j] = s.lru_out[j];
      finish_slow_path(p, b, rid, t, s, out, top_k, locs, seq_len, num_misses, &s.victims[0], 1, num_evictable);
      return;
    }
    for (int k = t.tid; k < H; k += t.size) {
      int16_t slot;
      if (k < unused) {
        slot = s.lru_out[H - 1 - (used + k)];
      } else if (k < num_evictable) {
        slot = s.lru_out[H - 1 - (k - unused)];
      } else {
        slot = s.lru_out[k - num_evictable];
      }
      lru[k] = slot;
    }

    // 5-6. Outputs, copies, plan and counters; the m-th miss took lru_out[H - 1 - m].
    finish_slow_path(p, b, rid, t, s, out, top_k, locs, seq_len, num_misses, &s.lru_out[H - 1], -1, num_evictable);
  }

  // Steps 5-6 of the slow path (IndexedSwapIn's too): the outputs, where repeated tokens read the slot
  // their first occurrence resolved to; then the misses host -> device, one warp per miss, with the
  // plan and the counters. The m-th miss took slot miss_slots[m * step] if m < num_slots, else none.
  template <class S>
  SPARSEKV_HOST_DEVICE static void finish_slow_path(const Params& p, int64_t b, int64_t rid, const Team& t, S& s,
                                                    int32_t* out, const int32_t* top_k, const int32_t* locs,
                                                    int64_t seq_len, int num_misses, const int16_t* miss_slots,
                                                    int step, int num_slots) {
    const int64_t newest = seq_len - 1;
    int hits = 0;
    for (int base = 0; base < K; base += t.size) {
      const int i = base + t.tid;
      const int32_t tok = i < K ? top_k[i] : -1;
      bool hit = false;
      if (i < K) {
        int32_t loc = -1;
        if (tok == newest) {
          loc = locs[H];
          hit = true;
        } else if (is_token(tok, seq_len)) {
          const int pos = lookup(s, tok);
          const int16_t slot = s.hash_slot[pos];
          loc = slot >= 0 ? locs[slot] : -1;
          hit = s.hash_first[pos] >= 0;
        }
        out[i] = loc;
      }
      int n = 0;
      t.rank(hit, &n, s.warp_counts);
      hits += n;
    }

    const int64_t* host_locs = p.host_cache_locs + rid * p.max_len;
    for (int m = t.warp; m < num_misses; m += t.num_warps) {
      const int32_t tok = top_k[s.miss_index[m]];
      const int16_t slot = m < num_slots ? miss_slots[m * step] : int16_t(-1);
      const int64_t src = tok < p.max_len ? host_locs[tok] : -1;
      const int64_t dst = slot >= 0 && slot < H ? static_cast<int64_t>(locs[slot]) : -1;
      if (p.miss_count && t.lane == 0) {
        p.miss_src[b * p.miss_src_stride + m] = src;
        store_index(p.miss_dst, p.miss_dst_is64, b * p.miss_dst_stride + m, dst);
      }
      const bool copied = p.defer_copies ? p.in_range(src, dst) : p.template copy_token<Layout>(src, dst, t.warp_lanes());
      if (copied && t.lane == 0) Team::fetch_add(&s.copies, 1);
    }
    t.sync();
    if (t.tid == 0) {
      if (p.miss_count) p.miss_count[b] = num_misses;
      if (p.counters) {
        add_counter(&p.counters[0], hits);
        add_counter(&p.counters[1], num_misses);
        add_counter(&p.counters[2], static_cast<int64_t>(s.copies) * p.item_bytes);
      }
    }
  }

  // Host driver: one request per item, sequentially.
  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t b, Lanes) {
    Shared s;
    serve(p, b, Team::current(), s);
  }

#ifdef __CUDACC__
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
// One CTA per SM is the design (a CTA serves one request): the bound lets nvcc give each thread up
// to 128 registers (sm_100a otherwise caps it at 64 and spills the miss copies to the stack).
template <class K>
__global__ void __launch_bounds__(K::kBlockSize, 1) swap_in_kernel(const typename K::Params p) {
  K::serve(p, blockIdx.x, Team::current(), *dynamic_shared<typename K::Shared>());
}

// One block of Kernel::kBlockSize threads per request row, its Shared in dynamic shared memory (the
// swap-in kernels: SwapIn, IndexedSwapIn).
template <class Kernel>
int launch_per_request(const typename Kernel::Params& p, int64_t batch, void* stream) {
  if (batch == 0) return 0;
  constexpr size_t bytes = sizeof(typename Kernel::Shared);
  const auto kernel = swap_in_kernel<Kernel>;
  if constexpr (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return launch_kernel<swap_in_kernel<Kernel>>(static_cast<unsigned>(batch), Kernel::kBlockSize, bytes, stream, p);
}

// The copies of a swap-in step given a plan, as a second launch over the whole grid, so every miss of
// the batch is in flight at once (in the per-request launch a block's 16 warps took its misses 16 at
// a time, one PCIe round trip each). A warp takes kEntriesPerWarp plan entries of one row, strided by
// the row's warps: entry m of a row goes to its warp m % warps_per_row, so a row's misses, its first
// entries, go one a warp while it has at most warps_per_row of them (32 at K 512: 6% misses), and
// a warp that finds none (nearly all at 0.1% misses) stops after one load of its row's miss count.
// A warp per entry (32k warps at batch 64, K 512, ~88 instructions each in the sm_90a SASS) spent
// ~2.8 us of issue on those loads alone.
// Bytes equal the sequential model's: the rows of one request (speculative) are served in batch
// order, so a device slot two of its rows load in one step ends with the later row's bytes; here the
// earlier row's copy is dropped when a later row copies into the same slot (every other destination
// is named once: a row's misses take distinct slots and the requests' slots are distinct), so the
// order of the copies does not matter.
// Design: latency-bound. At batch 64, K 512 and 0.1% misses: 4k warps, each one load of its row's
// miss count, ~33 of them also one 584-byte host -> device copy (one PCIe round trip, ~2 us, all
// concurrent) and, speculative only, first a scan of the later rows for a copy of the same request
// into the same slot (superseded): the warp's lanes take the later rows 32 at a time, each loading
// its row's request id and miss count at once and, for a row of the same request, that row's plan
// entries; one vote joins them. For a miss of row 0: 2 trips of a ~77-instruction loop (sm_90a) and
// ~4 rounds of dependent L2 loads, where a scan by one lane took 63 trips, a dependent load each
// (2.7 us of issue alone on one scheduler of an H200).
// Budget (tools/bench/bench_sass_budget.py, docs/sass.md, sm_90a): the swap-in block's passes
// ~1.4 us, 2 launches, the copies' 2k warps (~100 instructions each where they find no miss: 0.2 us;
// a warp per entry, 32k, took ~2.8 us) and one round trip: ~7.6 us plain, ~7.7 us speculative; with
// 2 rows a request (MTP drafts, 128 rows) a CTA runs its passes twice: ~9.4 us (9.5 on sm_100a),
// against the 10 us target.
template <class Layout>
struct MissCopies {
  static constexpr int kEntriesPerWarp = 16;

  struct Params {
    SwapInParams swap;
    int64_t width;  // plan columns (K)
  };

  SPARSEKV_HOST_DEVICE static int64_t warps_per_row(const Params& p) {
    return (p.width + kEntriesPerWarp - 1) / kEntriesPerWarp;
  }

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.swap.batch * warps_per_row(p); }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const SwapInParams& q = p.swap;
    const int64_t warps = warps_per_row(p);
    const int64_t b = i / warps;
    // The row's entries m < count are its misses (count <= width: a row has at most K distinct
    // tokens); this warp's, m = i % warps + j * warps, grow with j (i - b * warps: one division).
    const int64_t count = q.miss_count[b] < p.width ? q.miss_count[b] : p.width;
    for (int64_t m = i - b * warps; m < count; m += warps) {
      const int64_t src = q.miss_src[b * q.miss_src_stride + m];
      const int64_t dst = load_index(q.miss_dst, q.miss_dst_is64, b * q.miss_dst_stride + m);
      // Only the speculative entry serves two rows of one request: the plain one refuses them (such
      // rows record no miss), so its copies skip the scan of the later rows.
      if (q.speculative && superseded(q, b, dst, lanes)) continue;
      q.template copy_token<Layout>(src, dst, lanes);
    }
  }

  // Whether a later row of row b's request copies into dst, so that its bytes are the ones the
  // sequential model leaves there. The lanes take the later rows 32 at a time, each lane its row's
  // misses, and one vote joins them: batch / 32 trips of independent loads, not a dependent load
  // per later row. A later copy the swap-in skipped (outside a cache) writes nothing: it
  // supersedes nothing.
  SPARSEKV_HOST_DEVICE static bool superseded(const SwapInParams& q, int64_t b, int64_t dst, Lanes lanes) {
    const int64_t rid = load_index(q.req_pool_indices, q.req_is64, b);
    bool found = false;
    for (int64_t later = b + 1 + lanes.lane; !found && later < q.batch; later += lanes.count) {
      // The miss count is loaded with the request id (both in flight at once), not after it.
      const int64_t later_rid = load_index(q.req_pool_indices, q.req_is64, later);
      const int32_t later_misses = q.miss_count[later];
      if (later_rid != rid) continue;
      for (int32_t k = 0; !found && k < later_misses; ++k) {
        const int64_t later_dst = load_index(q.miss_dst, q.miss_dst_is64, later * q.miss_dst_stride + k);
        const int64_t later_src = q.miss_src[later * q.miss_src_stride + k];
        found = later_dst == dst && q.in_range(later_src, dst);
      }
    }
    return any_lane(found, lanes);
  }
};

// A per-request swap-in launch (SwapIn, IndexedSwapIn); given a plan, its copies deferred to
// MissCopies.
template <class Kernel, class Layout, class P>
int launch_swap_in(const P& p, SwapInParams& swap, int64_t width, void* stream) {
  if (swap.miss_count == nullptr) return launch_per_request<Kernel>(p, swap.batch, stream);
  swap.defer_copies = true;
  const int err = launch_per_request<Kernel>(p, swap.batch, stream);
  if (err != 0) return err;
  return run_on_cuda<MissCopies<Layout>>(typename MissCopies<Layout>::Params{swap, width}, stream);
}

template <int K, int H, int BlockSize, class Layout, int ProtectRecent, int ProtectNear>
int SwapIn<K, H, BlockSize, Layout, ProtectRecent, ProtectNear>::run_on_cuda(const Params& p, void* stream) {
  Params deferred = p;
  return launch_swap_in<SwapIn, Layout>(deferred, deferred, K, stream);
}
#endif

}  // namespace sparsekv::hisparse

#ifdef SPARSEKV_HOST_ENTRY
#include <algorithm>
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::hisparse {

// Token slots of a host or device cache, after checking its shape against the layout.
template <class Layout>
int64_t cache_slots(const TensorView& cache, const char* name, int64_t item_size_bytes) {
  if constexpr (kIsPaged<Layout>) {
    using Paged = typename Layout::PagedT;
    check(cache, name).size(1, Paged::kPageBytes, "bytes of one page row");
  } else {
    check(cache, name).size(1, item_size_bytes, "item_size_bytes");
  }
  return Layout::slots(cache.size(0));
}

template <class Layout>
void check_item_size(int64_t item_size_bytes) {
  if constexpr (kIsPaged<Layout>) {
    using L = typename Layout::PagedT::LayoutT;
    check_range(item_size_bytes, L::kBytesPerToken, L::kBytesPerToken, "item_size_bytes");
  } else {
    check_range(item_size_bytes, 1, (int64_t(1) << 40) - 1, "item_size_bytes");
  }
}

// The two caches' checks (dtype, rank, unit last stride, device, row size against the layout, after
// item_size_bytes) and their TokenCaches; `dev` / `dev_name`: the argument the device buffer must share
// a device with.
template <class Layout>
TokenCaches token_caches(const TensorView& host_cache, const TensorView& device_buffer, int64_t item_size_bytes,
                         const TensorView& dev, const char* dev_name) {
  check_item_size<Layout>(item_size_bytes);
  check(host_cache, "host_cache").dtype<uint8_t>().ndim(2).rows_dense().on_backend_device_or_host();
  check(device_buffer, "device_buffer").dtype<uint8_t>().ndim(2).rows_dense().same_device(dev, dev_name);
  TokenCaches c{};
  c.host_cache = static_cast<const uint8_t*>(host_cache.data_ptr());
  c.host_stride = host_cache.stride(0);
  c.host_slots = cache_slots<Layout>(host_cache, "host_cache", item_size_bytes);
  c.device_buffer = static_cast<uint8_t*>(device_buffer.data_ptr());
  c.device_stride = device_buffer.stride(0);
  c.device_slots = cache_slots<Layout>(device_buffer, "device_buffer", item_size_bytes);
  c.item_bytes = item_size_bytes;
  return c;
}

// Steps 1-2 of the swap-in entry: the O(1) checks (dtypes, shapes, strides, devices, and the memory
// rule of ffi.h: no written argument shares memory with another) and the launch parameters.
template <int K, int H, int BlockSize, class Layout>
typename SwapIn<K, H, BlockSize, Layout>::Params swap_in_params(
    const TensorView& top_k_tokens, const TensorView& device_buffer_tokens, const TensorView& host_cache_locs,
    const TensorView& device_buffer_locs, const TensorView& host_cache, const TensorView& device_buffer,
    const TensorView& top_k_device_locs, const TensorView& req_pool_indices, const TensorView& seq_lens,
    const TensorView& lru_slots, int64_t item_size_bytes, const TensorView* num_real_reqs, const TensorView* miss_src,
    const TensorView* miss_dst, const TensorView* miss_count, const TensorView* counters) {
  const TensorView& dev = top_k_tokens;
  check(top_k_tokens, "top_k_tokens").dtype<int32_t>().ndim(2).rows_dense().on_backend_device();
  const int64_t bs = top_k_tokens.size(0);
  check(top_k_tokens, "top_k_tokens").size(1, K, "num_top_k");
  check(top_k_device_locs, "top_k_device_locs").dtype<int32_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(top_k_device_locs, "top_k_device_locs").size(0, bs, "batch size").size(1, K, "num_top_k");
  check(device_buffer_tokens, "device_buffer_tokens").dtype<int32_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  const int64_t max_reqs = device_buffer_tokens.size(0);
  if constexpr (kIsPaged<Layout>) {
    check(device_buffer_tokens, "device_buffer_tokens").size(1, H + Layout::PagedT::kPageSlots, "hot_buffer_size + page slots");
  } else if (device_buffer_tokens.size(1) < H + 1) {
    check(device_buffer_tokens, "device_buffer_tokens").size(1, H + 1, "at least hot_buffer_size + 1");
  }
  check(device_buffer_locs, "device_buffer_locs").dtype<int32_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(device_buffer_locs, "device_buffer_locs").size(0, max_reqs, "rows of device_buffer_tokens");
  check(device_buffer_locs, "device_buffer_locs").size(1, device_buffer_tokens.size(1), "columns of device_buffer_tokens");
  if (device_buffer_locs.stride(0) != device_buffer_tokens.stride(0)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `device_buffer_locs` must have the row stride of "
                              << "`device_buffer_tokens` (" << device_buffer_tokens.stride(0) << "), got "
                              << device_buffer_locs.stride(0);
  }
  check(host_cache_locs, "host_cache_locs").dtype<int64_t>().ndim(2).contiguous().same_device(dev, "top_k_tokens");
  check(host_cache_locs, "host_cache_locs").size(0, max_reqs, "rows of device_buffer_tokens");
  check(lru_slots, "lru_slots").dtype<int16_t>().ndim(2).rows_dense().same_device(dev, "top_k_tokens");
  check(lru_slots, "lru_slots").size(0, max_reqs, "rows of device_buffer_tokens").size(1, H, "hot_buffer_size");
  check(req_pool_indices, "req_pool_indices").ndim(1).contiguous().same_device(dev, "top_k_tokens");
  const bool req_is64 = check(req_pool_indices, "req_pool_indices").int32_or_int64();
  check(req_pool_indices, "req_pool_indices").size(0, bs, "batch size");
  check(seq_lens, "seq_lens").ndim(1).contiguous().same_device(dev, "top_k_tokens");
  const bool seq_is64 = check(seq_lens, "seq_lens").int32_or_int64();
  check(seq_lens, "seq_lens").size(0, bs, "batch size");
  using P = typename SwapIn<K, H, BlockSize, Layout>::Params;
  P p{};
  static_cast<TokenCaches&>(p) =
      token_caches<Layout>(host_cache, device_buffer, item_size_bytes, dev, "top_k_tokens");
  if (num_real_reqs) {
    check(*num_real_reqs, "num_real_reqs").dtype<int32_t>().ndim(1).size(0, 1).same_device(dev, "top_k_tokens");
    p.num_real_reqs = static_cast<const int32_t*>(num_real_reqs->data_ptr());
  }
  if ((miss_src != nullptr) != (miss_count != nullptr) || (miss_dst != nullptr) != (miss_count != nullptr)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: arguments `miss_src`, `miss_dst` and `miss_count` go together: pass all "
                              << "or none";
  }
  if (miss_count) {
    check(*miss_count, "miss_count").dtype<int32_t>().ndim(1).contiguous().size(0, bs, "batch size").same_device(dev, "top_k_tokens");
    check(*miss_src, "miss_src").dtype<int64_t>().ndim(2).rows_dense().size(0, bs, "batch size").same_device(dev, "top_k_tokens");
    check(*miss_dst, "miss_dst").ndim(2).rows_dense().size(0, bs, "batch size").same_device(dev, "top_k_tokens");
    p.miss_dst_is64 = check(*miss_dst, "miss_dst").int32_or_int64();
    if (miss_src->size(1) < K) check(*miss_src, "miss_src").size(1, K, "at least num_top_k");
    if (miss_dst->size(1) < K) check(*miss_dst, "miss_dst").size(1, K, "at least num_top_k");
    p.miss_src = static_cast<int64_t*>(miss_src->data_ptr());
    p.miss_dst = miss_dst->data_ptr();
    p.miss_count = static_cast<int32_t*>(miss_count->data_ptr());
    p.miss_src_stride = miss_src->stride(0);
    p.miss_dst_stride = miss_dst->stride(0);
  }
  if (counters) {
    check(*counters, "counters").dtype<int64_t>().ndim(1).contiguous().size(0, 3, "hits, misses, bytes").same_device(dev, "top_k_tokens");
    p.counters = static_cast<int64_t*>(counters->data_ptr());
  }
  // The kernel updates tables and caches in place and reads the top-k row again after writing the
  // output row: no written argument may share memory with any other argument.
  check_disjoint({read(top_k_tokens, "top_k_tokens"), written(device_buffer_tokens, "device_buffer_tokens"),
                  read(host_cache_locs, "host_cache_locs"), read(device_buffer_locs, "device_buffer_locs"),
                  read(host_cache, "host_cache"), written(device_buffer, "device_buffer"),
                  written(top_k_device_locs, "top_k_device_locs"), read(req_pool_indices, "req_pool_indices"),
                  read(seq_lens, "seq_lens"), written(lru_slots, "lru_slots"), read(num_real_reqs, "num_real_reqs"),
                  written(miss_src, "miss_src"), written(miss_dst, "miss_dst"), written(miss_count, "miss_count"),
                  written(counters, "counters")});
  p.top_k_tokens = static_cast<const int32_t*>(top_k_tokens.data_ptr());
  p.top_k_stride = top_k_tokens.stride(0);
  p.top_k_device_locs = static_cast<int32_t*>(top_k_device_locs.data_ptr());
  p.out_stride = top_k_device_locs.stride(0);
  p.device_buffer_tokens = static_cast<int32_t*>(device_buffer_tokens.data_ptr());
  p.device_buffer_locs = static_cast<const int32_t*>(device_buffer_locs.data_ptr());
  p.buffer_stride = device_buffer_tokens.stride(0);
  p.host_cache_locs = static_cast<const int64_t*>(host_cache_locs.data_ptr());
  p.max_len = host_cache_locs.size(1);
  p.lru_slots = static_cast<int16_t*>(lru_slots.data_ptr());
  p.lru_stride = lru_slots.stride(0);
  p.req_pool_indices = req_pool_indices.data_ptr();
  p.req_is64 = req_is64;
  p.seq_lens = seq_lens.data_ptr();
  p.seq_is64 = seq_is64;
  p.batch = bs;
  p.max_reqs = max_reqs;
  return p;
}

[[noreturn]] inline void duplicate_request_error(int64_t rid) {
  TVM_FFI_THROW(ValueError) << "sparsekv: argument `req_pool_indices` names request row " << rid
                            << " twice among the real batch rows (rows of one request, such as MTP draft tokens, go "
                            << "through the speculative swap-in, which serves them in batch order)";
}

// Host-readable tables, plain (not speculative): no request named by two real rows (on the device the kernel
// refuses such rows instead: they come out all -1 and change nothing).
template <class P>
void check_distinct_requests(const P& p) {
  const int64_t num_real = p.num_real_reqs ? *p.num_real_reqs : p.batch;
  std::vector<int64_t> rids;
  for (int64_t b = 0; b < std::min(num_real, p.batch); ++b) {
    const int64_t rid = load_index(p.req_pool_indices, p.req_is64, b);
    if (rid >= 0 && rid < p.max_reqs) rids.push_back(rid);
  }
  std::sort(rids.begin(), rids.end());
  const auto twice = std::adjacent_find(rids.begin(), rids.end());
  if (twice != rids.end()) duplicate_request_error(*twice);
}

[[noreturn]] inline void index_error(const char* name, int64_t row, int64_t col, int64_t value, int64_t limit,
                                     const char* why) {
  TVM_FFI_THROW(IndexError) << "sparsekv: argument `" << name << "`[" << row << ", " << col << "] = " << value
                            << " is out of range [0, " << limit << ") (" << why << ")";
}

// The index-check pass (IndexCheck::kThenRun): every index the swap-in would follow, on
// host-readable tables (the wrapper checks CUDA tables with torch in the same words:
// jit_kernel/hisparse.py check_swap_in_on_device), and the
// destination rule: the device slots a step may write (columns 0..H of the slow-path rows) are
// distinct across the batch, so no two copies land on one slot.
template <class P, int K, int H>
void validate_swap_in(const P& p) {
  const int64_t num_real = p.num_real_reqs ? *p.num_real_reqs : p.batch;
  check_range(num_real, 0, p.batch, "num_real_reqs");
  std::vector<int64_t> seen;
  std::vector<std::pair<int32_t, int64_t>> written_locs;  // (device slot, request row)
  for (int64_t b = 0; b < num_real; ++b) {
    const int64_t rid = load_index(p.req_pool_indices, p.req_is64, b);
    if (rid < 0 || rid >= p.max_reqs) index_error("req_pool_indices", b, 0, rid, p.max_reqs, "a real batch row");
    const bool seen_before = std::find(seen.begin(), seen.end(), rid) != seen.end();
    if (seen_before && !p.speculative) duplicate_request_error(rid);
    seen.push_back(rid);
    const int64_t n = load_index(p.seq_lens, p.seq_is64, b);
    const int32_t* top_k = p.top_k_tokens + b * p.top_k_stride;
    const int32_t* locs = p.device_buffer_locs + rid * p.buffer_stride;
    if (n <= H) {
      for (int64_t i = 0; i < std::min<int64_t>(n, K); ++i) {
        const int32_t tok = top_k[i];
        if (tok >= 0 && tok < n && (locs[tok] < 0 || locs[tok] >= p.device_slots)) {
          index_error("device_buffer_locs", rid, tok, locs[tok], p.device_slots, "the slot of a requested token");
        }
      }
      continue;
    }
    if (n > p.max_len) {
      TVM_FFI_THROW(IndexError) << "sparsekv: argument `seq_lens`[" << b << "] = " << n
                                << " exceeds the columns of `host_cache_locs` (" << p.max_len << ")";
    }
    const int16_t* lru = p.lru_slots + rid * p.lru_stride;
    std::vector<bool> listed(H, false);
    for (int j = 0; j < H; ++j) {
      if (lru[j] < 0 || lru[j] >= H || listed[lru[j]]) {
        TVM_FFI_THROW(ValueError) << "sparsekv: argument `lru_slots`[" << rid << "] must be a permutation of 0.."
                                  << H - 1 << " (entry " << j << " = " << lru[j] << ")";
      }
      listed[lru[j]] = true;
    }
    for (int j = 0; j <= H; ++j) {
      if (locs[j] < 0 || locs[j] >= p.device_slots) {
        index_error("device_buffer_locs", rid, j, locs[j], p.device_slots, "a hot slot");
      }
      if (!seen_before) written_locs.emplace_back(locs[j], rid);
    }
    const int32_t* held = p.device_buffer_tokens + rid * p.buffer_stride;
    const int64_t* host_locs = p.host_cache_locs + rid * p.max_len;
    for (int i = 0; i < K; ++i) {
      const int32_t tok = top_k[i];
      if (tok < 0 || tok >= n - 1 || std::find(held, held + H, tok) != held + H) continue;
      if (host_locs[tok] < 0 || host_locs[tok] >= p.host_slots) {
        index_error("host_cache_locs", rid, tok, host_locs[tok], p.host_slots, "the host slot of a missing token");
      }
    }
  }
  std::sort(written_locs.begin(), written_locs.end());
  for (size_t k = 1; k < written_locs.size(); ++k) {
    if (written_locs[k].first == written_locs[k - 1].first) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `device_buffer_locs` names device slot " << written_locs[k].first
                                << " twice (request rows " << written_locs[k - 1].second << " and "
                                << written_locs[k].second << ", columns 0..hot_buffer_size): two misses could be "
                                << "copied onto one slot";
    }
  }
}

}  // namespace sparsekv::hisparse
#endif
