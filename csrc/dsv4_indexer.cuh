// dsv4_indexer: the DSV4 lightning indexer on a paged FP8 (132 B) or FP4 (68 B) indexer K cache:
// scores, then top-k with the logical-position -> cache-slot transform.
//
// Scores (IndexerScores<Layout, QT>). Query row b sits at raw position t = positions[b]; it sees the
// compressed entries i < n(b) = min(max(t + 1, 0) / 4, L) (C4: entry i closes at raw 4i + 3). The
// entry's cache slot is page_table[b, i / P] * P + i % P and its key k_i (128 dims) is dequantized
// from the slot: FP8 = e4m3 * fp32 scale; FP4 = e2m1 (two per byte, even element in the low
// nibble) * 2^(ue8m0 - 127) per 32 dims. Then
//   scores[b, i] = sum_h weights[b, h] * relu(q[b, h] . k_i)   for i < n(b)
//   scores[b, i] = -inf                                           for n(b) <= i < L,
// with L = scores.size(1). A page id outside [0, pages) gives -inf (the host entry rejects it
// first when the table is host-readable).
//
// Top-k (TopK). For row b with n(b) as above (n capped by the score row width), tokens[b, :] holds
// min(k, n) distinct entry positions in [0, n) with the largest scores, in ascending position, and
// -1 after them; of equal scores at the threshold the lower positions are taken; when n <= k every
// visible entry is taken. Both backends give this one answer: the swap-in assigns miss slots in
// top-k order and attention sums in index order, so an order left to the scheduler would make
// both vary from run to run. Scores are ordered as their float32 bit patterns (monotone key, NaN above +inf). With a
// page table, slots[b, j] = page_table[b, tok / P] * P + tok % P (-1 for -1, a negative page, or a
// slot past INT32_MAX; the host entry refuses such a page when the table is host-readable):
// tokens is what the HiSparse swap-in takes as top_k_tokens, slots is what sparse decode attention
// takes as indices into the fully resident cache.
//
// Selection: an exact radix select on the 32-bit keys: histograms of key digits among the keys
// that share the prefix found so far give, digit by digit, the key of the k-th largest; then one
// pass in position order writes the keys above it and the first `remaining` keys equal to it.
// GPU: 4 digits of 8 bits over the row, the last pass a tile of 1024 entries at a time with block
// prefix counts (warp ballots) giving each entry its output place; host: 2 digits of 16 bits, the
// second over the few keys of the first digit's bin.
//
// Launch shapes. Scores: cpu one (b, chunk of 256 entries) per item; cuda one warp per entry, the
// block's query in shared memory, blocks (x = entry chunk, y = row) with rows past gridDim.y's
// 65,535 taken by the same blocks in turn (a prefill chunk has more rows than that). Top-k: cpu one row per item; cuda one block of 1024 threads per
// row, histograms and output counters in shared memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsekv/fp8.h"
#include "sparsekv/host_simd.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/portability.h"
#include "sparsekv/query.h"

namespace sparsekv::dsv4_indexer {

inline constexpr int kDim = 128;
inline constexpr int kMaxHeads = 64;
inline constexpr int kRatio = 4;
inline constexpr int kFp4Block = 32;

// Entries visible from raw position t: i < (t + 1) / 4, computed without t + 1 (t may be INT64_MAX).
SPARSEKV_HOST_DEVICE int64_t visible(int64_t position) {
  return position < 0 ? 0 : position / kRatio + (position % kRatio == kRatio - 1 ? 1 : 0);
}

SPARSEKV_HOST_DEVICE int64_t load_position(const void* positions, bool is64, int64_t b) {
  return is64 ? static_cast<const int64_t*>(positions)[b] : static_cast<const int32_t*>(positions)[b];
}

// Entries of row b that its position can see, at most the row's width (the scores' and the top-k's
// Params: positions, positions_is64, width).
template <class P>
SPARSEKV_HOST_DEVICE int64_t visible_in_row(const P& p, int64_t b) {
  const int64_t n = visible(load_position(p.positions, p.positions_is64, b));
  return n < p.width ? n : p.width;
}

// Dimension d of an indexer key.
template <class Layout>
SPARSEKV_HOST_DEVICE float dequantize(const uint8_t* value, const uint8_t* scale, int d) {
  if constexpr (std::is_same_v<Layout, kv_layout::IndexerFp8>) {
    const uint32_t bits = static_cast<uint32_t>(scale[0]) | (static_cast<uint32_t>(scale[1]) << 8) |
                          (static_cast<uint32_t>(scale[2]) << 16) | (static_cast<uint32_t>(scale[3]) << 24);
    return fp8::e4m3_to_float(value[d]) * fp8::bits_float(bits);
  } else {
    static_assert(std::is_same_v<Layout, kv_layout::IndexerFp4>, "dsv4_indexer: IndexerFp8 or IndexerFp4 keys");
    const uint8_t code = (d & 1) ? (value[d / 2] >> 4) : (value[d / 2] & 0xF);
    return fp8::e2m1_to_float(code) * fp8::ue8m0_to_float(scale[d / kFp4Block]);
  }
}

// ---------------------------------------------------------------------------------------------
// Scores

// Host tile of 8 keys stored [dim][key] (so the 8 dot products of a head are independent lanes):
// score[t] = sum_h w[h] * relu(q[h] . key t).
inline constexpr int kHostTile = 8;

SPARSEKV_HOST_SIMD_CLONES static void host_tile_scores(const float (*q)[kDim], int64_t heads, const float* w,
                                                       const float (*keys)[kHostTile], float* score) {
  static_assert(kHostTile == 8, "dsv4_indexer: a host tile is one HostFloat8");
  const HostFloat8 zero = {};
  HostFloat8 total = {};
  for (int64_t h = 0; h < heads; ++h) {
    HostFloat8 dot = {};
    for (int d = 0; d < kDim; ++d) {
      HostFloat8 key;
      __builtin_memcpy(&key, keys[d], sizeof(key));
      dot += q[h][d] * key;
    }
    total += w[h] * (dot > zero ? dot : zero);
  }
  __builtin_memcpy(score, &total, sizeof(total));
}

template <class Layout, class QT>
struct IndexerScores {
  static_assert(std::is_same_v<QT, float> || std::is_same_v<QT, Bf16>, "dsv4_indexer: q must be float or Bf16");
  using LayoutT = Layout;
  static constexpr int kChunk = 256;  // host: entries per item

  struct Params {
    const QT* q;  // [batch, heads, 128], unit last stride
    int64_t q_stride_b;
    int64_t q_stride_h;
    const float* weights;  // [batch, heads], unit last stride
    int64_t weights_stride;
    const uint8_t* cache;  // [pages, page_bytes]
    int64_t page_stride;
    int64_t num_pages;
    int page_shift;
    const int32_t* page_table;  // [batch, max_pages]
    int64_t page_table_stride;
    int64_t max_pages;
    const void* positions;  // [batch] int32 or int64
    bool positions_is64;
    float* scores;  // [batch, width], unit last stride
    int64_t scores_stride;
    int64_t width;
    int64_t batch;
    int64_t heads;
  };

  // The key of entry i of row b, or false when its page is not in the cache.
  SPARSEKV_HOST_DEVICE static bool locate(const Params& p, int64_t b, int64_t i, const uint8_t** value,
                                          const uint8_t** scale) {
    const int64_t page_slots = int64_t{1} << p.page_shift;
    const int64_t page_index = i >> p.page_shift;
    if (page_index >= p.max_pages) return false;
    const int64_t page = p.page_table[b * p.page_table_stride + page_index];
    if (page < 0 || page >= p.num_pages) return false;
    const int64_t in_page = i & (page_slots - 1);
    const uint8_t* base = p.cache + page * p.page_stride;
    *value = base + Layout::value_offset(in_page);
    *scale = base + Layout::scale_offset(in_page, page_slots);
    return true;
  }

  static int64_t chunks(const Params& p) { return (p.width + kChunk - 1) / kChunk; }
  static int64_t num_items(const Params& p) { return p.batch * chunks(p); }

  // Host: item = (row, chunk of kChunk entries), keys kHostTile at a time.
  static void item(const Params& p, int64_t item, Lanes) {
    constexpr int T = kHostTile;
    const int64_t b = item / chunks(p);
    const int64_t first = (item - b * chunks(p)) * kChunk;
    const int64_t last = first + kChunk < p.width ? first + kChunk : p.width;
    const int64_t n = visible_in_row(p, b);
    alignas(64) float q[kMaxHeads][kDim];
    alignas(64) float keys[kDim][T];
    for (int64_t h = 0; h < p.heads; ++h)
      for (int d = 0; d < kDim; ++d) q[h][d] = load_q(p.q + b * p.q_stride_b + h * p.q_stride_h + d);
    const float* w = p.weights + b * p.weights_stride;
    float* out = p.scores + b * p.scores_stride;
    for (int64_t i0 = first; i0 < last; i0 += T) {
      bool valid[T];
      for (int t = 0; t < T; ++t) {
        const uint8_t *value, *scale;
        const int64_t i = i0 + t;
        valid[t] = i < last && i < n && locate(p, b, i, &value, &scale);
        for (int d = 0; d < kDim; ++d) keys[d][t] = valid[t] ? dequantize<Layout>(value, scale, d) : 0.0f;
      }
      float score[T];
      host_tile_scores(q, p.heads, w, keys, score);
      for (int t = 0; t < T && i0 + t < last; ++t) out[i0 + t] = valid[t] ? score[t] : -INFINITY;
    }
  }

#ifdef __CUDACC__
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kEntriesPerBlock = 64;
  static constexpr int64_t kMaxGridY = 65535;  // the hardware limit of gridDim.y
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
template <class K>
__global__ void __launch_bounds__(K::kThreads) scores_kernel(const typename K::Params p) {
  // q transposed, [dim][head]: lane h reads q_s[d][h], consecutive words, no bank conflicts.
  __shared__ float q_s[kDim][kMaxHeads];
  __shared__ float w_s[kMaxHeads];
  __shared__ float k_s[K::kWarps][kDim];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    if (b != blockIdx.y) __syncthreads();  // q_s and w_s of the previous row are still being read
    for (int x = threadIdx.x; x < kDim * kMaxHeads; x += K::kThreads) {
      const int h = x / kDim, d = x % kDim;
      q_s[d][h] = h < p.heads ? load_q(p.q + b * p.q_stride_b + h * p.q_stride_h + d) : 0.0f;
    }
    for (int h = threadIdx.x; h < kMaxHeads; h += K::kThreads) {
      w_s[h] = h < p.heads ? p.weights[b * p.weights_stride + h] : 0.0f;
    }
    __syncthreads();
    const int64_t n = visible_in_row(p, b);
    const int64_t first = static_cast<int64_t>(blockIdx.x) * K::kEntriesPerBlock;
    const int64_t last = first + K::kEntriesPerBlock < p.width ? first + K::kEntriesPerBlock : p.width;
    for (int64_t i = first + warp; i < last; i += K::kWarps) {
      const uint8_t *value = nullptr, *scale = nullptr;
      const bool valid = i < n && K::locate(p, b, i, &value, &scale);
      if (!valid) {
        if (lane == 0) p.scores[b * p.scores_stride + i] = -INFINITY;
        continue;
      }
      if constexpr (std::is_same_v<typename K::LayoutT, kv_layout::IndexerFp8>) {
        // 8 e4m3 bytes per lane from aligned 8-byte words (LDG.E.64, no byte loads): the same
        // products as dequantize.
        const float key_scale = fp8::bits_float(static_cast<uint32_t>(copy_detail::load_bytes8(scale, scale, scale + 4)));
        for (int g = lane; g < kDim / 8; g += kWarpSize) {
          const uint64_t codes = copy_detail::load_bytes8(value + 8 * g, value, value + kDim);
          for (int j = 0; j < 8; ++j) {
            k_s[warp][8 * g + j] = fp8::e4m3_to_float(static_cast<uint8_t>(codes >> (8 * j))) * key_scale;
          }
        }
      } else {
        for (int d = lane; d < kDim; d += kWarpSize) k_s[warp][d] = dequantize<typename K::LayoutT>(value, scale, d);
      }
      __syncwarp();
      float score = 0.0f;
      for (int h = lane; h < kMaxHeads; h += kWarpSize) {
        float dot = 0.0f;
        for (int d = 0; d < kDim; ++d) dot += q_s[d][h] * k_s[warp][d];
        score += w_s[h] * fmaxf(dot, 0.0f);
      }
      for (int off = kWarpSize / 2; off > 0; off /= 2) score += __shfl_xor_sync(0xffffffffu, score, off);
      if (lane == 0) p.scores[b * p.scores_stride + i] = score;
      __syncwarp();  // k_s is rewritten by the next entry
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Top-k

// Monotone uint32 key of a float: larger float, larger key (NaN with the sign bit clear on top).
SPARSEKV_HOST_DEVICE uint32_t order_key(float x) {
  const uint32_t u = fp8::float_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The highest of `bins` bins whose count, added to those of the bins above it, reaches
// `remaining`; `remaining` becomes the count still to take from that bin.
SPARSEKV_HOST_DEVICE int pick_bin(const uint32_t* hist, int bins, int64_t* remaining) {
  int64_t above = 0;
  for (int bin = bins - 1; bin > 0; --bin) {
    if (above + hist[bin] >= *remaining) {
      *remaining -= above;
      return bin;
    }
    above += hist[bin];
  }
  *remaining -= above;
  return 0;
}

// Slot of logical entry tok through a page table row, -1 for tok < 0 or a negative / missing page.
SPARSEKV_HOST_DEVICE int32_t entry_slot(const int32_t* page_row, int64_t max_pages, int page_shift, int32_t tok) {
  if (tok < 0) return -1;
  const int64_t page_index = static_cast<int64_t>(tok) >> page_shift;
  if (page_index >= max_pages) return -1;
  const int64_t page = page_row[page_index];
  if (page < 0) return -1;
  const int64_t slot = (page << page_shift) | (tok & ((int64_t{1} << page_shift) - 1));
  return slot > INT32_MAX ? -1 : static_cast<int32_t>(slot);  // never a wrapped slot on another page
}

struct TopK {
  struct Params {
    const float* scores;  // [batch, width], unit last stride
    int64_t scores_stride;
    int64_t width;
    const void* positions;
    bool positions_is64;
    int64_t batch;
    int64_t k;
    int32_t* tokens;  // [batch, k], unit last stride
    int64_t tokens_stride;
    int32_t* slots;  // [batch, k] or null
    int64_t slots_stride;
    const int32_t* page_table;  // [batch, max_pages] or null
    int64_t page_table_stride;
    int64_t max_pages;
    int page_shift;
  };

  SPARSEKV_HOST_DEVICE static void emit(const Params& p, int64_t b, int64_t j, int32_t tok) {
    p.tokens[b * p.tokens_stride + j] = tok;
    if (p.slots) {
      p.slots[b * p.slots_stride + j] =
          entry_slot(p.page_table + b * p.page_table_stride, p.max_pages, p.page_shift, tok);
    }
  }

  static int64_t num_items(const Params& p) { return p.batch; }

  // Host: one row per item. Pass 1: a 16-bit histogram of the keys' high halves gives the bin
  // holding the k-th largest. Pass 2: the keys inside that bin are set aside (few: a bin is 1/65536
  // of the key range); a 16-bit histogram of their low halves gives the exact threshold. Pass 3
  // writes the selected entries in position order.
  static constexpr int kHostBins = 1 << 16;
  static void item(const Params& p, int64_t b, Lanes) {
    const float* s = p.scores + b * p.scores_stride;
    const int64_t n = visible_in_row(p, b);
    int64_t j = 0;
    if (n <= p.k) {
      for (; j < n; ++j) emit(p, b, j, static_cast<int32_t>(j));
    } else {
      std::vector<uint32_t> hist(kHostBins, 0);
      for (int64_t i = 0; i < n; ++i) ++hist[order_key(s[i]) >> 16];
      int64_t remaining = p.k;
      const uint32_t high = static_cast<uint32_t>(pick_bin(hist.data(), kHostBins, &remaining));
      std::vector<uint32_t> candidates;
      candidates.reserve(static_cast<size_t>(hist[high]));
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t key = order_key(s[i]);
        if ((key >> 16) == high) candidates.push_back(key);
      }
      std::fill(hist.begin(), hist.end(), 0u);
      for (const uint32_t key : candidates) ++hist[key & 0xFFFFu];
      const uint32_t threshold = (high << 16) | static_cast<uint32_t>(pick_bin(hist.data(), kHostBins, &remaining));
      for (int64_t i = 0; i < n && j < p.k; ++i) {
        const uint32_t key = order_key(s[i]);
        if (key > threshold || (key == threshold && remaining-- > 0)) emit(p, b, j++, static_cast<int32_t>(i));
      }
    }
    for (; j < p.k; ++j) emit(p, b, j, -1);
  }

#ifdef __CUDACC__
  static constexpr int kThreads = 1024;
  static constexpr int kWarps = kThreads / kWarpSize;
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
__global__ void __launch_bounds__(TopK::kThreads) topk_kernel(const TopK::Params p) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int64_t remaining_s;
  __shared__ int64_t taken_s, equal_seen_s;
  __shared__ uint32_t warp_equal[TopK::kWarps], warp_taken[TopK::kWarps];
  const int64_t b = blockIdx.x;
  const float* s = p.scores + b * p.scores_stride;
  const int64_t n = visible_in_row(p, b);
  const int tid = threadIdx.x;
  if (n <= p.k) {
    for (int64_t j = tid; j < p.k; j += TopK::kThreads) TopK::emit(p, b, j, j < n ? static_cast<int32_t>(j) : -1);
    return;
  }
  if (tid == 0) {
    prefix_s = 0;
    mask_s = 0;
    remaining_s = p.k;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int x = tid; x < 256; x += TopK::kThreads) hist[x] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    for (int64_t i = tid; i < n; i += TopK::kThreads) {
      const uint32_t key = order_key(s[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      int64_t remaining = remaining_s;
      prefix_s = prefix | (static_cast<uint32_t>(pick_bin(hist, 256, &remaining)) << shift);
      mask_s = mask | (0xFFu << shift);
      remaining_s = remaining;
    }
    __syncthreads();
  }
  // One pass in position order, a tile of kThreads entries at a time: an entry's place is the number
  // of entries taken before it, and an equal key is taken while fewer than `remaining` equal keys
  // precede it. Warp ballots count within a warp, per-warp totals in shared memory across warps.
  const uint32_t threshold = prefix_s;
  const int64_t take_equal = remaining_s;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const uint32_t lanes_below = (1u << lane) - 1u;
  if (tid == 0) {
    taken_s = 0;       // entries taken so far
    equal_seen_s = 0;  // keys equal to the threshold seen so far
  }
  __syncthreads();
  for (int64_t base = 0; base < n; base += TopK::kThreads) {
    const int64_t i = base + tid;
    const uint32_t key = i < n ? order_key(s[i]) : 0u;
    const bool equal = i < n && key == threshold;
    const uint32_t equal_ballot = __ballot_sync(0xffffffffu, equal);
    if (lane == 0) warp_equal[warp] = __popc(equal_ballot);
    __syncthreads();
    int64_t equal_before = equal_seen_s + __popc(equal_ballot & lanes_below);
    for (int w = 0; w < warp; ++w) equal_before += warp_equal[w];
    const bool take = (i < n && key > threshold) || (equal && equal_before < take_equal);
    const uint32_t take_ballot = __ballot_sync(0xffffffffu, take);
    if (lane == 0) warp_taken[warp] = __popc(take_ballot);
    __syncthreads();
    int64_t place = taken_s + __popc(take_ballot & lanes_below);
    for (int w = 0; w < warp; ++w) place += warp_taken[w];
    if (take) TopK::emit(p, b, place, static_cast<int32_t>(i));
    __syncthreads();
    if (tid == 0) {
      for (int w = 0; w < TopK::kWarps; ++w) {
        equal_seen_s += warp_equal[w];
        taken_s += warp_taken[w];
      }
    }
    __syncthreads();
    if (taken_s >= p.k) break;  // uniform: every thread reads it after the barrier
  }
}

inline int TopK::run_on_cuda(const Params& p, void* stream) {
  if (p.batch == 0) return 0;
  return launch_kernel<topk_kernel>(static_cast<unsigned>(p.batch), kThreads, 0, stream, p);
}

template <class Layout, class QT>
int IndexerScores<Layout, QT>::run_on_cuda(const Params& p, void* stream) {
  if (p.batch == 0 || p.width == 0) return 0;
  const dim3 grid(static_cast<unsigned>((p.width + kEntriesPerBlock - 1) / kEntriesPerBlock),
                  static_cast<unsigned>(p.batch < kMaxGridY ? p.batch : kMaxGridY));
  return launch_kernel<scores_kernel<IndexerScores>>(grid, kThreads, 0, stream, p);
}
#endif

}  // namespace sparsekv::dsv4_indexer

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_indexer {

// positions: int32 or int64 [batch], contiguous; returns whether it is int64.
inline bool check_positions(const TensorView& positions, int64_t batch, const TensorView& like) {
  const bool is64 = check(positions, "positions").int32_or_int64();
  check(positions, "positions").ndim(1).contiguous().same_device(like, "scores");
  check(positions, "positions").size(0, batch, "batch");
  return is64;
}

inline void check_page_table(const TensorView& page_table, int64_t batch, const TensorView& like) {
  check(page_table, "page_table").dtype<int32_t>().ndim(2).rows_dense().same_device(like, "scores");
  check(page_table, "page_table").size(0, batch, "batch");
}

// Host-readable tables: the visible entries of every row fit its table row, and every page that
// holds an entry the kernel reads (the first `width`) is in [0, num_pages): the pages of the cache
// for scores, the pages whose slots fit int32 for top-k (`pages_are` says which, for the message).
inline void check_pages_in_use(const TensorView& page_table, const TensorView& positions, bool is64, int64_t width,
                               int page_shift, int64_t num_pages, const char* pages_are) {
  const auto* table = static_cast<const int32_t*>(page_table.data_ptr());
  for (int64_t b = 0; b < page_table.size(0); ++b) {
    const int64_t n_all = visible(load_position(positions.data_ptr(), is64, b));
    const int64_t pages_seen = (n_all + (int64_t{1} << page_shift) - 1) >> page_shift;
    if (pages_seen > page_table.size(1)) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `page_table` has " << page_table.size(1) << " pages per row, "
                                << "but row " << b << " sees " << n_all << " entries (" << pages_seen << " pages)";
    }
    const int64_t n = n_all < width ? n_all : width;
    const int64_t pages_used = (n + (int64_t{1} << page_shift) - 1) >> page_shift;
    for (int64_t i = 0; i < pages_used; ++i) {
      const int32_t page = table[b * page_table.stride(0) + i];
      if (page < 0 || page >= num_pages) {
        TVM_FFI_THROW(IndexError) << "sparsekv: argument `page_table`[" << b << ", " << i << "] = " << page
                                  << " is outside [0, " << num_pages << ") (" << pages_are
                                  << ") but holds visible entries";
      }
    }
  }
}

template <class Layout, class QT>
void indexer_scores(TensorView q, TensorView weights, TensorView k_cache, TensorView page_table, TensorView positions,
                    int64_t page_slots, TensorView scores) {
  // 1. Validate (memory first: the table checks read `page_table` and `positions`).
  check_disjoint({read(q, "q"), read(weights, "weights"), read(k_cache, "k_cache"), read(page_table, "page_table"),
                  read(positions, "positions"), written(scores, "out")});
  using K = IndexerScores<Layout, QT>;
  constexpr DLDataType kBf16{kDLBfloat, 16, 1};
  check(scores, "scores").dtype<float>().ndim(2).rows_dense().on_backend_device();
  const int64_t batch = scores.size(0), width = scores.size(1);
  check(q, "q").dtype(std::is_same_v<QT, float> ? dtype_of<float>() : kBf16).ndim(3).rows_dense();
  check(q, "q").same_device(scores, "scores").size(0, batch, "batch of scores").size(2, kDim, "index head dim");
  const int64_t heads = q.size(1);
  if (heads < 1 || heads > kMaxHeads) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `q` has " << heads << " heads; the indexer supports 1 to "
                              << kMaxHeads;
  }
  check(weights, "weights").dtype<float>().ndim(2).rows_dense().same_device(scores, "scores");
  check(weights, "weights").size(0, batch, "batch").size(1, heads, "heads of q");
  const int shift = check_page_slots(page_slots, "page_slots");
  check(k_cache, "k_cache").dtype<uint8_t>().ndim(2).rows_dense().same_device(scores, "scores");
  check(k_cache, "k_cache").size(1, Layout::page_bytes(page_slots), "page_bytes(page_slots) of the indexer layout");
  check_page_table(page_table, batch, scores);
  const bool is64 = check_positions(positions, batch, scores);
  if (width > INT32_MAX) TVM_FFI_THROW(ValueError) << "sparsekv: argument `scores` is wider than 2^31 - 1 entries";
  if (scores.device().device_type != kDLCUDA) {
    check_pages_in_use(page_table, positions, is64, width, shift, k_cache.size(0), "the pages of `k_cache`");
  }

  // 2. Derive the parameters.
  const typename K::Params params{static_cast<const QT*>(q.data_ptr()),
                                  q.stride(0),
                                  q.stride(1),
                                  static_cast<const float*>(weights.data_ptr()),
                                  weights.stride(0),
                                  static_cast<const uint8_t*>(k_cache.data_ptr()),
                                  k_cache.stride(0),
                                  k_cache.size(0),
                                  shift,
                                  static_cast<const int32_t*>(page_table.data_ptr()),
                                  page_table.stride(0),
                                  page_table.size(1),
                                  positions.data_ptr(),
                                  is64,
                                  static_cast<float*>(scores.data_ptr()),
                                  scores.stride(0),
                                  width,
                                  batch,
                                  heads};
  if (batch == 0 || width == 0) return;

  // 3. Launch.
  launch<K>(params, scores.device());
}

inline void indexer_topk(TensorView scores, TensorView positions, TensorView tokens,
                         tvm::ffi::Optional<TensorView> page_table, tvm::ffi::Optional<TensorView> slots,
                         int64_t page_slots) {
  // 1. Validate (memory first: the table checks read `page_table` and `positions`).
  check_disjoint({read(scores, "scores"), read(positions, "positions"), written(tokens, "out"),
                  read(optional_arg(page_table, "page_table"), "page_table"),
                  written(optional_arg(slots, "out_slots"), "out_slots")});
  check(scores, "scores").dtype<float>().ndim(2).rows_dense().on_backend_device();
  const int64_t batch = scores.size(0), width = scores.size(1);
  if (width > INT32_MAX) TVM_FFI_THROW(ValueError) << "sparsekv: argument `scores` is wider than 2^31 - 1 entries";
  const bool is64 = check_positions(positions, batch, scores);
  check(tokens, "out").dtype<int32_t>().ndim(2).rows_dense().same_device(scores, "scores");
  check(tokens, "out").size(0, batch, "batch");
  const int64_t k = tokens.size(1);
  if (k < 1) TVM_FFI_THROW(ValueError) << "sparsekv: argument `num_top_k` must be at least 1, got " << k;
  if (page_table.has_value() != slots.has_value()) {
    TVM_FFI_THROW(ValueError) << "sparsekv: arguments `page_table` and `out_slots` go together";
  }
  TopK::Params params{static_cast<const float*>(scores.data_ptr()),
                      scores.stride(0),
                      width,
                      positions.data_ptr(),
                      is64,
                      batch,
                      k,
                      static_cast<int32_t*>(tokens.data_ptr()),
                      tokens.stride(0),
                      nullptr,
                      0,
                      nullptr,
                      0,
                      0,
                      0};
  if (page_table.has_value()) {
    const TensorView table = page_table.value(), out_slots = slots.value();
    params.page_shift = check_page_slots(page_slots, "page_slots");
    check_page_table(table, batch, scores);
    check(out_slots, "out_slots").dtype<int32_t>().ndim(2).rows_dense().same_device(scores, "scores");
    check(out_slots, "out_slots").size(0, batch, "batch").size(1, k, "num_top_k");
    if (scores.device().device_type != kDLCUDA) {
      check_pages_in_use(table, positions, is64, width, params.page_shift, int64_t{1} << (31 - params.page_shift),
                         "pages whose slots fit int32");
    }
    params.slots = static_cast<int32_t*>(out_slots.data_ptr());
    params.slots_stride = out_slots.stride(0);
    params.page_table = static_cast<const int32_t*>(table.data_ptr());
    params.page_table_stride = table.stride(0);
    params.max_pages = table.size(1);
  }
  if (batch == 0) return;

  // 2. Launch.
  launch<TopK>(params, scores.device());
}

}  // namespace sparsekv::dsv4_indexer
#endif
