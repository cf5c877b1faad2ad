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
// GPU: digits of 12, 12 and 8 bits, the keys at or above the threshold's bin copied on chip in
// position order as soon as they fit (see the design note at topk_kernel); host: 2 digits of 16
// bits, the second over the few keys of the first digit's bin.
//
// Launch shapes. Scores: cpu one (b, chunk of 256 entries) per item; cuda tensor
// cores (mma.sync, see the design note at scores_kernel), one warp per 16-entry tile, 256 entries
// per block, the block's query in shared memory as bf16, blocks (x = entry chunk, y = row) with
// rows past gridDim.y's 65,535 taken by the same blocks in turn (a prefill chunk has more rows than
// that). Both sum in float32, in different orders (cuda: bf16 operands, exact products: the e4m3
// codes, with the FP8 scale applied to the dot, and a float32 q split into bf16 high and low
// parts), so they agree within the scores' tolerance. Top-k: cpu one row per item; cuda one block
// of 1024 threads per row, histogram and candidates in shared memory, or, given a workspace at
// small batch, up to 32 blocks per row merged by the last to finish (TopK::split_of).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsekv/fp8.h"
#include "sparsekv/host_simd.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/mma.h"
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
  // Entry indices are below the row width (at most 2^31 - 1, the host entry checks), so 32-bit.
  SPARSEKV_HOST_DEVICE static bool locate(const Params& p, int64_t b, uint32_t i, const uint8_t** value,
                                          const uint8_t** scale) {
    const int64_t page_slots = int64_t{1} << p.page_shift;
    const uint32_t page_index = i >> p.page_shift;
    if (page_index >= p.max_pages) return false;
    const int64_t page = p.page_table[b * p.page_table_stride + page_index];
    if (page < 0 || page >= p.num_pages) return false;
    const uint32_t in_page = i & static_cast<uint32_t>(page_slots - 1);
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
        valid[t] = i < last && i < n && locate(p, b, static_cast<uint32_t>(i), &value, &scale);
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
  static constexpr int kTile = 16;  // entries of one warp MMA (its M side)
  static constexpr int kEntriesPerBlock = 256;  // each warp takes 2 tiles of a row
  static constexpr int kQParts = std::is_same_v<QT, float> ? 2 : 1;  // bf16 high (and low) parts of q
  static constexpr int kQStride = kDim + 8;  // bf16 per head row in shared memory (padding: fewer conflicts)
  static constexpr int64_t kMaxGridY = 65535;  // the hardware limit of gridDim.y
  static int run_on_cuda(const Params& p, void* stream);

  // Lane t of the MMA holds dims [32 t, 32 t + 32) of its two entries: the dot is a sum over all
  // dims, which any permutation of K applied to the query's B fragment too leaves unchanged, so each
  // K step s takes, as its fragment's k = 2 t, 2 t + 1 (half 0) and 2 t + 8, 2 t + 9 (half 1), the
  // pair of the lane's dims that key_pairs puts at 2 s + half and query_dims names. A lane then
  // reads its keys' 32 contiguous dims (FP8: 32 bytes; FP4: 16 bytes and the one block scale of
  // those dims) with 8-byte loads.
  struct LaneKey {
    uint64_t bytes[4];  // FP8: 32 e4m3 codes; FP4: bytes[0..1], 32 e2m1 nibbles (even dim low)
    uint32_t scale;     // FP8: the entry's fp32 scale's bits, applied to the dot; FP4: the block's UE8M0 byte
  };

  SPARSEKV_DEVICE static LaneKey load_lane_key(const uint8_t* value, const uint8_t* scale, int t) {
    LaneKey key{};
    if constexpr (std::is_same_v<Layout, kv_layout::IndexerFp8>) {
      for (int j = 0; j < 4; ++j) key.bytes[j] = copy_detail::load_bytes8(value + 32 * t + 8 * j, value, value + kDim);
      key.scale = static_cast<uint32_t>(copy_detail::load_bytes8(scale, scale, scale + 4));
    } else {
      for (int j = 0; j < 2; ++j) {
        key.bytes[j] = copy_detail::load_bytes8(value + 16 * t + 8 * j, value, value + kDim / 2);
      }
      key.scale = copy_detail::load_byte(scale + t);
    }
    return key;
  }

  // The dims (first, second) of the query that pair x (of 64; lane t's are 16 t .. 16 t + 15) multiplies:
  // FP8 2 x, 2 x + 1; FP4 8 (x / 4) + x % 4 and 4 more, the pairing of mma::e2m1x8_to_bf16x2.
  SPARSEKV_HOST_DEVICE static void query_dims(int x, int* first, int* second) {
    if constexpr (std::is_same_v<Layout, kv_layout::IndexerFp8>) {
      *first = 2 * x;
      *second = 2 * x + 1;
    } else {
      *first = 8 * (x / 4) + x % 4;
      *second = *first + 4;
    }
  }

  // The lane's 32 dims of a key as 16 bf16x2, pair x of the lane at pairs[x] (exact: e4m3 codes, or
  // e2m1 times a power of two).
  SPARSEKV_DEVICE static void key_pairs(const LaneKey& key, uint32_t (&pairs)[16]) {
    if constexpr (std::is_same_v<Layout, kv_layout::IndexerFp8>) {
      SPARSEKV_UNROLLED
      for (int x = 0; x < 16; ++x) {
        pairs[x] = mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(key.bytes[x / 4] >> (16 * (x % 4))), 1.0f);
      }
    } else {
      const uint32_t scale = mma::ue8m0_to_bf16x2(key.scale);
      SPARSEKV_UNROLLED
      for (int k = 0; k < 4; ++k) {
        uint32_t four[4];
        mma::e2m1x8_to_bf16x2(static_cast<uint32_t>(key.bytes[k / 2] >> (32 * (k % 2))), scale, four);
        for (int p = 0; p < 4; ++p) pairs[4 * k + p] = four[p];
      }
    }
  }

  SPARSEKV_DEVICE static float dot_scale(const LaneKey& key) {
    if constexpr (std::is_same_v<Layout, kv_layout::IndexerFp8>) {
      return fp8::bits_float(key.scale);
    } else {
      return 1.0f;
    }
  }
#endif
};

#ifdef __CUDACC__
// Design note. One row of 64 heads over 64k FP8 entries: 8.9 MB, 1.9 us of HBM on an H200 (FP4:
// 68-byte records, 4.5 MB, 0.99 us). Tensor cores: a warp takes 16 entries at a time, logits [16
// entries, 8 heads] per mma.sync m16n8k16 (bf16: the e4m3 codes through the hardware convert, exact,
// the fp32 key scale applied to the result; or e2m1 codes times their block's power of two, exact,
// mma::e2m1x8_to_bf16x2), float32 accumulation. A lane decodes its 32 dims of its two entries once
// (16 bf16x2 each), then the head tiles go two at a time (two independent accumulator chains), each
// 8 K steps then its relu * weight; the sum over heads in registers, two shuffles across the lane's
// group. 256 entries per 256-thread block: 256 blocks at 64k, two per SM (at most 128 registers a
// thread: the launch bound). The block stages the row's query in shared memory as bf16 (16 KB, from
// L2), about half the bytes of its FP8 keys, the price of spreading one row over the whole GPU.
// Instruction budget (nvcc 13, tools/bench/bench_sass_budget.py; estimates, no GPU has timed them):
// FP8, the tile loop is 691 SASS instructions per warp on sm_90a (64 HMMA.16816.F32.BF16, 32
// F2FP.F16.E4M3 converts of code pairs, 64 HADD2.F32 and 32 F2FP.BF16 packs, 32 LDS.128 of the
// query and 8 LDS.64 of the weights, 32 NOPs that space the HMMAs, the rest the epilogue and the
// 32-bit entry and 64-bit byte addresses), 109 registers, no stack; 4,096 tiles over 132 SMs x 4
// schedulers x 1.98 GHz = 2.7 us, 1.45x the H200 roofline (sm_100a: 626, 117 registers, 2.2 us
// against a B200's 1.1 us, 2.0x). FP4: 667 (72 PRMT and 32 HMUL2.BF16 of the decode, 86 registers),
// 2.6 us, 2.65x its 0.99 us (sm_100a: 588, 2.1 us, 3.5x its 0.59 us); 256k entries the same ratios. Before: the decode per K step
// inside the head-tile loop, 8 head tiles each checked per K step, and FP4 codes decoded one at a
// time on the float32 bits with a select (fp8::e2m1_to_float): FP8 933 (2.0x; sm_100a 872, 2.7x),
// FP4 1,439 (5.7x; sm_100a 1,313, 7.8x); before that (one warp per entry on CUDA cores, software
// e4m3 decode) FP8 7.4 us, 4.0x.
template <class K>
__global__ void __launch_bounds__(K::kThreads, 2) scores_kernel(const typename K::Params p) {
  // q as bf16x2 dim pairs (K::query_dims), [part][head][pair] (heads past p.heads zero, up to the
  // pair of head tiles that holds the last head); the weights likewise.
  __shared__ uint32_t q_s[K::kQParts][kMaxHeads][K::kQStride / 2];
  __shared__ float w_s[kMaxHeads];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // the lane's group (entry / head row) and its place in it
  const int head_tiles = static_cast<int>((p.heads + 7) / 8);
  const int staged_heads = 16 * ((head_tiles + 1) / 2);  // the head rows the tile pairs read
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    if (b != blockIdx.y) __syncthreads();  // q_s and w_s of the previous row are still being read
    for (int x = threadIdx.x; x < kDim / 2 * staged_heads; x += K::kThreads) {
      const int h = x / (kDim / 2), pair = x % (kDim / 2);
      int d[2];
      K::query_dims(pair, &d[0], &d[1]);
      float q[2] = {0.0f, 0.0f};
      if (h < p.heads) {
        for (int e = 0; e < 2; ++e) q[e] = load_q(p.q + b * p.q_stride_b + h * p.q_stride_h + d[e]);
      }
      const uint16_t high[2] = {fp8::float_to_bf16(q[0]), fp8::float_to_bf16(q[1])};
      q_s[0][h][pair] = mma::pack_bf16x2(high[0], high[1]);
      if constexpr (K::kQParts == 2) {
        q_s[K::kQParts - 1][h][pair] = mma::pack_bf16x2(fp8::float_to_bf16(q[0] - fp8::bf16_to_float(high[0])),
                                                         fp8::float_to_bf16(q[1] - fp8::bf16_to_float(high[1])));
      }
    }
    for (int h = threadIdx.x; h < staged_heads; h += K::kThreads) {
      w_s[h] = h < p.heads ? p.weights[b * p.weights_stride + h] : 0.0f;
    }
    __syncthreads();
    // Entry indices in 32 bits: the width is at most 2^31 - 1 (the host entry checks), so no index
    // here, a tile's last row included, reaches 2^32.
    const auto n = static_cast<uint32_t>(visible_in_row(p, b));
    const uint32_t block_first = blockIdx.x * static_cast<uint32_t>(K::kEntriesPerBlock);
    const int64_t block_end = int64_t{block_first} + K::kEntriesPerBlock;
    const auto last = static_cast<uint32_t>(block_end < p.width ? block_end : p.width);
    SPARSEKV_ROLLED
    for (uint32_t first = block_first + warp * K::kTile; first < last; first += K::kWarps * K::kTile) {
      // Rows g and g + 8 of the tile: entries first + g and first + g + 8.
      typename K::LaneKey keys[2];
      bool valid[2];
      for (int r = 0; r < 2; ++r) {
        const uint32_t i = first + g + 8 * r;
        const uint8_t *value = nullptr, *scale = nullptr;
        valid[r] = i < last && i < n && K::locate(p, b, i, &value, &scale);
        keys[r] = valid[r] ? K::load_lane_key(value, scale, t) : typename K::LaneKey{};
      }
      uint32_t pairs[2][16];
      for (int r = 0; r < 2; ++r) K::key_pairs(keys[r], pairs[r]);
      // Two head tiles at a time (two independent accumulator chains, so no MMA waits on the one
      // before it), their 8 K steps and then their epilogue: element i of tile j's C is entry row
      // g + 8 (i / 2), head 8 j + mma::c_col(lane, i). A tile past the heads has zero q rows and
      // weights, and adds +0 to the (never -0) scores.
      float score[2] = {0.0f, 0.0f};
      SPARSEKV_UNROLLED
      for (int j0 = 0; j0 < kMaxHeads / 8; j0 += 2) {
        if (j0 >= head_tiles) break;  // warp-uniform
        mma::FragC acc[2] = {};
        SPARSEKV_UNROLLED
        for (int s = 0; s < kDim / 16; ++s) {
          const mma::FragA a{{pairs[0][2 * s], pairs[1][2 * s], pairs[0][2 * s + 1], pairs[1][2 * s + 1]}};
          for (int part = 0; part < K::kQParts; ++part) {
            for (int jj = 0; jj < 2; ++jj) {
              const uint32_t* q_pairs = &q_s[part][8 * (j0 + jj) + g][16 * t + 2 * s];
              const mma::FragB bq{{q_pairs[0], q_pairs[1]}};
              mma::mma_bf16(acc[jj], a, bq);
            }
          }
        }
        for (int jj = 0; jj < 2; ++jj) {
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1, h = 8 * (j0 + jj) + mma::c_col(lane, i);
            score[r] += w_s[h] * fmaxf(acc[jj].x[i] * K::dot_scale(keys[r]), 0.0f);
          }
        }
      }
      for (int r = 0; r < 2; ++r) {
        for (int off = 1; off < 4; off *= 2) score[r] += __shfl_xor_sync(0xffffffffu, score[r], off);
        const uint32_t i = first + g + 8 * r;
        if (t == 0 && i < last) p.scores[b * p.scores_stride + i] = valid[r] ? score[r] : -INFINITY;
      }
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
    uint32_t* workspace;  // [batch, workspace_stride] (Workspace), or null when splits == 1
    int64_t workspace_stride;
    uint32_t slice;  // entries of a row per CTA (splits > 1)
    int splits;      // CTAs per row
  };

  // The workspace of split rows (uint32 words of a row): the global histogram of the first digit
  // and the arrival counter (zeroed by topk_clear_kernel), each CTA's candidate count, then each
  // CTA's segment: `slice` keys, then `slice` positions. Nothing is read before this call writes it.
  static constexpr int64_t kHistAt = 0;
  static constexpr int64_t kArrivedAt = 1 << 12;
  static constexpr int64_t kCountsAt = kArrivedAt + 1;
  static constexpr int64_t kMaxSplits = 32;  // at most a segment per warp in the gather
  static constexpr int64_t kSegmentsAt = 4160;  // 16-byte aligned, past the counts
  // Split rows: a row gets a CTA per kMinSlice entries, at most kMaxSplits, while batch x splits
  // stays within kSplitCtas (about one wave of CTAs on an H100 or H200); 1 at larger batch.
  static constexpr int64_t kMinSlice = 4096;
  static constexpr int64_t kSplitCtas = 128;
  struct Split {
    int splits;
    int64_t slice;
    int64_t words;  // workspace words of the call (0 when splits == 1)
  };
  static Split split_of(int64_t batch, int64_t width) {
    int64_t splits = std::min({(width + kMinSlice - 1) / kMinSlice, kMaxSplits, kSplitCtas / std::max<int64_t>(batch, 1)});
    if (splits <= 1) return Split{1, width, 0};
    const int64_t slice = ((width + splits - 1) / splits + 3) / 4 * 4;  // a multiple of 4: 16-byte aligned slices
    splits = (width + slice - 1) / slice;
    return Split{static_cast<int>(splits), slice, batch * (kSegmentsAt + 2 * splits * slice)};
  }

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
// Design note (top-k). The row is 64k float32 at the serving shape: 256 KB, read from HBM once by
// the first digit pass and from L2 after. One 1024-thread CTA per row is bound by one SM's load
// throughput and the passes' barriers, not HBM (the launch alone is about 3 us), so at small batch
// a row is split over several CTAs (a `workspace` given: TopK::splits).
// 1. Digits of 12, 12 and 8 bits, the most significant first. A digit pass histograms the keys
//    that share the prefix found so far (4,096 bins in shared memory) and a block scan over the
//    bins (4 per thread) picks the bin holding the k-th largest; the first pass reads the row.
// 2. As soon as the keys at or above the prefix (the entries taken so far plus the chosen bin,
//    k + a bin's population at most) fit kCandidates, two warp-contiguous passes copy them, key
//    and position, into shared memory in position order: a ballot count per warp, a scan over
//    the 32 warps, a ballot place per entry. With 12-bit digits this is usually after the first
//    digit (about 150 keys in the bin for 512 of 64k normal scores). The remaining digits are
//    then resolved over shared memory, and the output is two block scans over the candidates
//    (equal keys before each, then taken entries before each), each thread a run of at most 3.
// 3. Otherwise (k + the bin past kCandidates: k above 3,072 or many equal keys) the threshold is
//    resolved over the row and one position-ordered pass over it, a tile of 1,024 entries at a
//    time, writes the selection.
// 4. Several CTAs a row (grid (batch, splits), each a slice of `slice` entries; topk_clear_kernel
//    zeroes the row's global histogram and arrival counter first, so the workspace may hold
//    anything on entry). A CTA histograms its slice's first digit, adds its nonzero bins to the
//    row's global histogram (atomics in L2), picks its own slice's bin of the min(k, slice)-th
//    largest and copies the keys at or above it, in position order, to its segment of the
//    workspace (step 2's passes, to global memory). The global k-th largest is at or above every
//    slice's, so the segments hold every key at or above the global bin. The CTA that arrives last
//    (a fence, then an atomic count: no CTA waits for another, so any schedule and the simulator's
//    shuffled block order give the same answer) picks the global bin from the global histogram
//    and gathers the segments' keys at or above it on chip (32 / splits warps a segment, each a
//    contiguous share, 8 loads a lane in flight), in segment order (= position order); then steps
//    2-3 as for one CTA (past kCandidates: over the row, alone). Block scans sum the 32 warp sums
//    with 5 shuffles in every warp (was a loop of 32 shared loads a thread).
// Instruction budget (tools/bench/bench_sass_budget.py, sm_90a, H200 model: the row loops' SASS
// instructions x their warp trips / (4 schedulers x 1.98 GHz) on the SMs that run them, plus a hand
// allowance for the launch and the code outside the loops; see docs/sass.md). A warp's trip over
// 128 entries (a float4 a lane): histogram 64 instructions (its loop takes two float4 a lane),
// count 81, copy 146 (170 to a workspace segment); the gather 114 + 332 per 256 segment entries.
//   one CTA, 512 of 64k: 18.8 us of row loops (2,048 entries a warp) + 7 us = 26 us.
//   split, 512 of 64k (16 CTAs of 4,096): 1.5 us of slice loops + 3.6 us of gather (~9,600
//   published keys, 2 trips a warp per pass) + 9 us (two launches, the slice's and the merge's
//   straight-line code, fence and arrival) = 14 us.
//   split, 512 of 256k (32 CTAs of 8,192): 2.5 + 5.4 + 9 = 17 us (one CTA: about 4x 18.8 us).
namespace topk_detail {
inline constexpr int kDigits = 3;  // bits [20, 32), [8, 20), [0, 8)
inline constexpr int kBins = 1 << 12;
SPARSEKV_HOST_DEVICE constexpr int digit_shift(int digit) { return digit == 0 ? 20 : digit == 1 ? 8 : 0; }
SPARSEKV_HOST_DEVICE constexpr int digit_width(int digit) { return digit == 2 ? 8 : 12; }
inline constexpr int kCandidates = 3072;
inline constexpr uint32_t kGatherRun = 8;  // segment entries a lane loads at once in the gather

// Exclusive block prefix sum of one value a thread, and the block's sum. Uses `warp_sums` (kWarps
// words) and two barriers; every thread must call it.
static_assert(TopK::kWarps == kWarpSize, "dsv4_indexer: the block scan holds a warp's sum per lane");
struct Scan {
  uint32_t before;
  uint32_t total;
};
__device__ __forceinline__ Scan block_exclusive_scan(uint32_t v, uint32_t* warp_sums) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  uint32_t inclusive = v;
  for (int d = 1; d < kWarpSize; d *= 2) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  // Every warp scans the 32 warp sums itself, lane w holding warp w's (5 shuffles, not 32 loads).
  const uint32_t sum_of_lane = warp_sums[lane];
  uint32_t sums_inclusive = sum_of_lane;
  for (int d = 1; d < kWarpSize; d *= 2) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, sums_inclusive, d);
    if (lane >= d) sums_inclusive += up;
  }
  const uint32_t before = __shfl_sync(0xffffffffu, sums_inclusive - sum_of_lane, warp);
  const uint32_t sum = __shfl_sync(0xffffffffu, sums_inclusive, kWarpSize - 1);
  __syncthreads();  // warp_sums is free again
  return Scan{before + inclusive - v, sum};
}

// The block's pick_bin over hist[0, bins): thread t owns bins [t * per, (t + 1) * per); the thread
// whose bins hold the crossing writes the bin, the new `remaining` and the bin's count.
struct Pick {
  uint32_t bin;
  int64_t remaining;
  uint32_t count;
};
__device__ __forceinline__ void block_pick_bin(const uint32_t* hist, int bins, int64_t remaining, uint32_t* warp_sums,
                                      Pick* out) {
  const int per = bins >= TopK::kThreads ? bins / TopK::kThreads : 1;
  const int lo = static_cast<int>(threadIdx.x) * per;
  uint32_t mine = 0;
  if (lo < bins) {
    for (int x = 0; x < per; ++x) mine += hist[lo + x];
  }
  const Scan scan = block_exclusive_scan(mine, warp_sums);
  if (lo < bins) {
    int64_t above = static_cast<int64_t>(scan.total) - scan.before - mine;  // keys in the bins of higher threads
    if (above < remaining && above + mine >= remaining) {
      for (int bin = lo + per - 1; bin >= lo; --bin) {
        if (above + hist[bin] >= remaining || bin == 0) {
          *out = Pick{static_cast<uint32_t>(bin), remaining - above, hist[bin]};
          break;
        }
        above += hist[bin];
      }
    }
  }
  __syncthreads();
}

// Adds to hist the digit (bits [shift, shift + width)) of each key of s[begin, end) whose bits under
// `mask` equal `prefix`: 16-byte loads from a 16-byte aligned s + begin, 4-byte ones for the rest.
__device__ __forceinline__ void tally_row(const float* s, uint32_t begin, uint32_t end, uint32_t prefix, uint32_t mask,
                                          int shift, uint32_t digit_mask, uint32_t* hist) {
  const auto tally = [&](float x) {
    const uint32_t key = order_key(x);
    if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
  };
  const float* t = s + begin;
  const uint32_t row = end - begin;
  const uint32_t quads = (reinterpret_cast<uintptr_t>(t) & 15u) == 0 ? row / 4 : 0;
  const float4* t4 = reinterpret_cast<const float4*>(t);
  for (uint32_t v = threadIdx.x; v < quads; v += TopK::kThreads) {
    const float4 x = t4[v];
    tally(x.x);
    tally(x.y);
    tally(x.z);
    tally(x.w);
  }
  for (uint32_t i = 4 * quads + threadIdx.x; i < row; i += TopK::kThreads) tally(t[i]);
}

// Copies the keys >= prefix of s[begin, end) (the prefix's low bits are 0), key and position, in
// position order, to key_out / pos_out; returns their count (every thread). Warp w takes a
// contiguous run, a lane 4 consecutive entries a trip (one 16-byte load on an aligned row): entry c
// of lane l comes after lanes < l's kept entries and its own below c.
__device__ __forceinline__ uint32_t copy_at_or_above(const float* s, uint32_t begin, uint32_t end, uint32_t prefix,
                                                     uint32_t* key_out, int32_t* pos_out, uint32_t* warp_sums) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const uint32_t per_warp = (end - begin + 4 * TopK::kThreads - 1) / (4 * TopK::kThreads) * (4 * kWarpSize);
  const uint32_t first = begin + warp * per_warp < end ? begin + warp * per_warp : end;
  const uint32_t last = first + per_warp < end ? first + per_warp : end;
  const bool aligned = (reinterpret_cast<uintptr_t>(s + begin) & 15u) == 0;
  uint32_t keys[4];
  const auto kept = [&](uint32_t q) {  // bit c: entry q + c is kept; keys[c] its key
    if (aligned && q + 3 < last) {
      const float4 x = *reinterpret_cast<const float4*>(s + q);
      keys[0] = order_key(x.x);
      keys[1] = order_key(x.y);
      keys[2] = order_key(x.z);
      keys[3] = order_key(x.w);
    } else {
      for (uint32_t c = 0; c < 4; ++c) keys[c] = q + c < last ? order_key(s[q + c]) : 0u;
    }
    uint32_t bits = 0;
    for (uint32_t c = 0; c < 4; ++c) bits |= (q + c < last && keys[c] >= prefix ? 1u : 0u) << c;
    return bits;
  };
  uint32_t mine = 0;
  for (uint32_t base = first; base < last; base += 4 * kWarpSize) {
    const uint32_t bits = kept(base + 4 * lane);
    for (uint32_t c = 0; c < 4; ++c) mine += __popc(__ballot_sync(0xffffffffu, (bits >> c) & 1u));
  }
  const Scan scan = block_exclusive_scan(lane == 0 ? mine : 0u, warp_sums);
  uint32_t place = __shfl_sync(0xffffffffu, scan.before, 0);
  for (uint32_t base = first; base < last; base += 4 * kWarpSize) {
    const uint32_t q = base + 4 * lane;
    const uint32_t bits = kept(q);
    uint32_t at = place;
    for (uint32_t c = 0; c < 4; ++c) {
      const uint32_t ballot = __ballot_sync(0xffffffffu, (bits >> c) & 1u);
      at += __popc(ballot & lanes_below);
      place += __popc(ballot);
    }
    for (uint32_t c = 0; c < 4; ++c) {
      if ((bits >> c) & 1u) {
        key_out[at] = keys[c];
        pos_out[at++] = static_cast<int32_t>(q + c);
      }
    }
  }
  return scan.total;
}

// Split rows: the first digit of each CTA's slice, then the last CTA's gather of the segments
// (TopK::Workspace). Returns whether this CTA goes on to select the row; if so, hist holds the
// row's first-digit histogram, and `count` > 0 says the keys at or above its bin (`pick`) are on
// chip (count == 0: they did not fit, or are none, and the row is read again).
__device__ __forceinline__ bool split_first_digit(const TopK::Params& p, const float* s, uint32_t row, uint32_t* hist,
                                                  uint32_t* cand_key, int32_t* cand_pos, uint32_t* warp_sums,
                                                  Pick* pick_s, uint32_t* flag_s, uint32_t* count) {
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const uint32_t split = blockIdx.y, splits = gridDim.y;
  uint32_t* ws = p.workspace + static_cast<int64_t>(blockIdx.x) * p.workspace_stride;
  uint32_t* const global_hist = ws + TopK::kHistAt;
  uint32_t* const segment_key = ws + TopK::kSegmentsAt + static_cast<int64_t>(split) * 2 * p.slice;
  int32_t* const segment_pos = reinterpret_cast<int32_t*>(segment_key + p.slice);
  const uint32_t begin = split * p.slice < row ? split * p.slice : row;
  const uint32_t end = row - begin > p.slice ? begin + p.slice : row;
  for (int x = tid; x < kBins; x += TopK::kThreads) hist[x] = 0;
  __syncthreads();
  tally_row(s, begin, end, 0, 0, digit_shift(0), kBins - 1, hist);
  __syncthreads();
  for (int x = tid; x < kBins; x += TopK::kThreads) {
    if (hist[x] != 0) atomicAdd(&global_hist[x], hist[x]);
  }
  uint32_t kept = 0;
  if (end > begin) {
    const int64_t local_k = p.k < end - begin ? p.k : end - begin;
    block_pick_bin(hist, kBins, local_k, warp_sums, pick_s);
    kept = copy_at_or_above(s, begin, end, pick_s->bin << digit_shift(0), segment_key, segment_pos, warp_sums);
  }
  if (tid == 0) ws[TopK::kCountsAt + split] = kept;
  __threadfence();  // this CTA's segment, count and bins are visible before its arrival is
  __syncthreads();
  if (tid == 0) *flag_s = atomicAdd(&ws[TopK::kArrivedAt], 1u) == splits - 1;
  __syncthreads();
  if (!*flag_s) return false;
  __threadfence();  // the last to arrive: every other CTA's writes are visible from here
  for (int x = tid; x < kBins; x += TopK::kThreads) hist[x] = __ldcg(&global_hist[x]);
  __syncthreads();
  block_pick_bin(hist, kBins, p.k, warp_sums, pick_s);
  const uint32_t prefix = pick_s->bin << digit_shift(0);
  *count = 0;
  if (p.k - pick_s->remaining + pick_s->count > kCandidates) return true;
  // kWarps / splits warps gather each segment, a contiguous share each: a count pass, a scan over
  // the warps, a copy pass; a lane loads kGatherRun entries a trip (independent loads, in flight at once).
  const uint32_t lanes_below = (1u << lane) - 1u;
  const uint32_t warps_per_segment = TopK::kWarps / splits;
  const uint32_t segment = warp / warps_per_segment, part = warp % warps_per_segment;
  const uint32_t* const key_in = ws + TopK::kSegmentsAt + static_cast<int64_t>(segment) * 2 * p.slice;
  const int32_t* const pos_in = reinterpret_cast<const int32_t*>(key_in + p.slice);
  const uint32_t length = segment < splits ? __ldcg(&ws[TopK::kCountsAt + segment]) : 0u;
  const uint32_t share = (length + warps_per_segment - 1) / warps_per_segment;
  const uint32_t first = part * share < length ? part * share : length;
  const uint32_t last = first + share < length ? first + share : length;
  uint32_t keys[kGatherRun];
  const auto load = [&](uint32_t base) {
    SPARSEKV_UNROLLED
    for (uint32_t r = 0; r < kGatherRun; ++r) {
      const uint32_t at = base + r * kWarpSize + lane;
      keys[r] = at < last ? __ldcg(&key_in[at]) : 0u;
    }
  };
  uint32_t mine = 0;
  for (uint32_t base = first; base < last; base += kGatherRun * kWarpSize) {
    load(base);
    SPARSEKV_UNROLLED
    for (uint32_t r = 0; r < kGatherRun; ++r) {
      mine += __popc(__ballot_sync(0xffffffffu, base + r * kWarpSize + lane < last && keys[r] >= prefix));
    }
  }
  const Scan scan = block_exclusive_scan(lane == 0 ? mine : 0u, warp_sums);
  uint32_t place = __shfl_sync(0xffffffffu, scan.before, 0);
  for (uint32_t base = first; base < last; base += kGatherRun * kWarpSize) {
    load(base);
    SPARSEKV_UNROLLED
    for (uint32_t r = 0; r < kGatherRun; ++r) {
      const uint32_t at = base + r * kWarpSize + lane;
      const bool keep = at < last && keys[r] >= prefix;
      const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
      if (keep) {
        cand_key[place + __popc(ballot & lanes_below)] = keys[r];
        cand_pos[place + __popc(ballot & lanes_below)] = __ldcg(&pos_in[at]);
      }
      place += __popc(ballot);
    }
  }
  *count = scan.total;
  __syncthreads();
  return true;
}
}  // namespace topk_detail

static_assert(TopK::kMaxSplits <= TopK::kWarps, "dsv4_indexer: the gather takes a segment per warp");
static_assert(TopK::kSegmentsAt >= TopK::kCountsAt + TopK::kMaxSplits && TopK::kSegmentsAt % 4 == 0,
              "dsv4_indexer: the segments follow the counts, 16-byte aligned");

// Zeroes the global histogram and arrival counter of each row's workspace (split rows only).
__global__ void __launch_bounds__(TopK::kThreads) topk_clear_kernel(const TopK::Params p) {
  uint32_t* ws = p.workspace + static_cast<int64_t>(blockIdx.x) * p.workspace_stride;
  for (int x = threadIdx.x; x < TopK::kCountsAt; x += TopK::kThreads) ws[x] = 0;
}

__global__ void __launch_bounds__(TopK::kThreads) topk_kernel(const TopK::Params p) {
  using namespace topk_detail;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t cand_key[kCandidates];
  __shared__ int32_t cand_pos[kCandidates];
  __shared__ uint32_t warp_sums[TopK::kWarps];
  __shared__ Pick pick_s;
  __shared__ uint32_t warp_equal[TopK::kWarps], warp_taken[TopK::kWarps];
  __shared__ int64_t taken_s, equal_seen_s;
  __shared__ uint32_t last_s;
  const int64_t b = blockIdx.x;
  const float* s = p.scores + b * p.scores_stride;
  const int64_t n = visible_in_row(p, b);
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const uint32_t lanes_below = (1u << lane) - 1u;
  if (n <= p.k) {
    if (blockIdx.y != 0) return;
    for (int64_t j = tid; j < p.k; j += TopK::kThreads) TopK::emit(p, b, j, j < n ? static_cast<int32_t>(j) : -1);
    return;
  }
  // `on_chip`: the candidates are in shared memory.
  uint32_t prefix = 0, mask = 0;
  int64_t remaining = p.k;
  bool on_chip = false;
  const uint32_t row = static_cast<uint32_t>(n);  // n <= INT32_MAX: 32-bit indices below (i + 31 fits too)
  uint32_t count = 0;                              // candidates in shared memory
  int first_digit = 0;
  if (gridDim.y > 1) {
    if (!split_first_digit(p, s, row, hist, cand_key, cand_pos, warp_sums, &pick_s, &last_s, &count)) return;
    const Pick pick = pick_s;
    prefix = pick.bin << digit_shift(0);
    mask = static_cast<uint32_t>(kBins - 1) << digit_shift(0);
    remaining = pick.remaining;
    on_chip = count > 0;
    first_digit = 1;
  }
#pragma unroll 1  // one copy of the loop body: unrolled, its three copies spill at 64 registers
  for (int digit = first_digit; digit < kDigits; ++digit) {
    const int shift = digit_shift(digit), bins = 1 << digit_width(digit);
    const uint32_t digit_mask = static_cast<uint32_t>(bins - 1);
    for (int x = tid; x < bins; x += TopK::kThreads) hist[x] = 0;
    __syncthreads();
    if (on_chip) {
      for (uint32_t c = tid; c < count; c += TopK::kThreads) {
        const uint32_t key = cand_key[c];
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & digit_mask], 1u);
      }
    } else {
      tally_row(s, 0, row, prefix, mask, shift, digit_mask, hist);
    }
    __syncthreads();
    block_pick_bin(hist, bins, remaining, warp_sums, &pick_s);
    const Pick pick = pick_s;
    prefix |= pick.bin << shift;
    mask |= digit_mask << shift;
    remaining = pick.remaining;
    if (!on_chip && p.k - remaining + pick.count <= kCandidates) {
      count = copy_at_or_above(s, 0, row, prefix, cand_key, cand_pos, warp_sums);
      on_chip = true;
      __syncthreads();
    }
  }
  const uint32_t threshold = prefix;
  const int64_t take_equal = remaining;
  if (on_chip) {
    // Thread t takes the run [t * per, (t + 1) * per) of the candidates (position order).
    const uint32_t per = (count + TopK::kThreads - 1) / TopK::kThreads;
    const uint32_t lo = tid * per, hi = lo + per < count ? lo + per : count;
    uint32_t equal = 0;
    for (uint32_t c = lo; c < hi; ++c) equal += cand_key[c] == threshold;
    int64_t equal_before = block_exclusive_scan(equal, warp_sums).before;
    uint32_t taken = 0;
    for (uint32_t c = lo; c < hi; ++c) {
      const uint32_t key = cand_key[c];
      taken += key > threshold || (key == threshold && equal_before++ < take_equal);
    }
    int64_t place = block_exclusive_scan(taken, warp_sums).before;
    equal_before -= equal;
    for (uint32_t c = lo; c < hi; ++c) {
      const uint32_t key = cand_key[c];
      if (key > threshold || (key == threshold && equal_before++ < take_equal)) TopK::emit(p, b, place++, cand_pos[c]);
    }
    return;
  }
  // One pass in position order, a tile of kThreads entries at a time: an entry's place is the number
  // of entries taken before it, and an equal key is taken while fewer than `remaining` equal keys
  // precede it. Warp ballots count within a warp, per-warp totals in shared memory across warps.
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
  if (p.splits == 1) return launch_kernel<topk_kernel>(static_cast<unsigned>(p.batch), kThreads, 0, stream, p);
  const int cleared = launch_kernel<topk_clear_kernel>(static_cast<unsigned>(p.batch), kThreads, 0, stream, p);
  if (cleared != 0) return cleared;
  return launch_kernel<topk_kernel>(dim3(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.splits)), kThreads, 0,
                                    stream, p);
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

// The top-k's argument checks and launch parameters. `read_tables`: also check the values of a
// host-readable page table (the entry does; a caller that checks before another kernel writes
// `scores` leaves that to the entry, so that the scores' own table check still refuses first).
inline TopK::Params checked_topk_params(TensorView scores, TensorView positions, TensorView tokens,
                                        tvm::ffi::Optional<TensorView> page_table,
                                        tvm::ffi::Optional<TensorView> slots, int64_t page_slots,
                                        tvm::ffi::Optional<TensorView> workspace, bool read_tables) {
  // Memory first: the table checks read `page_table` and `positions`.
  check_disjoint({read(scores, "scores"), read(positions, "positions"), written(tokens, "out"),
                  read(optional_arg(page_table, "page_table"), "page_table"),
                  written(optional_arg(slots, "out_slots"), "out_slots"),
                  written(optional_arg(workspace, "workspace"), "workspace")});
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
                      0,
                      nullptr,
                      0,
                      0,
                      1};
  if (workspace.has_value()) {
    // A CUDA row split over several CTAs (TopK::split_of); the cpu backend takes a row per item and
    // leaves the workspace alone, but checks it the same.
    const TensorView ws = workspace.value();
    const TopK::Split split = TopK::split_of(batch, width);
    check(ws, "workspace").dtype<int32_t>().ndim(1).contiguous().same_device(scores, "scores");
    if (ws.size(0) < split.words) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `workspace` has " << ws.size(0) << " int32 elements; a top-k of "
                                << batch << " rows of " << width << " entries needs " << split.words
                                << " (topk_workspace_ints)";
    }
    if (split.splits > 1 && (SPARSEKV_BACKEND_CUDA || SPARSEKV_BACKEND_SIM)) {
      params.workspace = static_cast<uint32_t*>(ws.data_ptr());
      params.workspace_stride = split.words / batch;
      params.slice = static_cast<uint32_t>(split.slice);
      params.splits = split.splits;
    }
  }
  if (page_table.has_value()) {
    const TensorView table = page_table.value(), out_slots = slots.value();
    params.page_shift = check_page_slots(page_slots, "page_slots");
    check_page_table(table, batch, scores);
    check(out_slots, "out_slots").dtype<int32_t>().ndim(2).rows_dense().same_device(scores, "scores");
    check(out_slots, "out_slots").size(0, batch, "batch").size(1, k, "num_top_k");
    if (read_tables && scores.device().device_type != kDLCUDA) {
      check_pages_in_use(table, positions, is64, width, params.page_shift, int64_t{1} << (31 - params.page_shift),
                         "pages whose slots fit int32");
    }
    params.slots = static_cast<int32_t*>(out_slots.data_ptr());
    params.slots_stride = out_slots.stride(0);
    params.page_table = static_cast<const int32_t*>(table.data_ptr());
    params.page_table_stride = table.stride(0);
    params.max_pages = table.size(1);
  }
  return params;
}

inline void indexer_topk(TensorView scores, TensorView positions, TensorView tokens,
                         tvm::ffi::Optional<TensorView> page_table, tvm::ffi::Optional<TensorView> slots,
                         int64_t page_slots, tvm::ffi::Optional<TensorView> workspace) {
  // 1. Validate and derive.
  const TopK::Params params =
      checked_topk_params(scores, positions, tokens, page_table, slots, page_slots, workspace, true);
  if (params.batch == 0) return;

  // 2. Launch.
  launch<TopK>(params, scores.device());
}

// The checks of indexer_topk without the page table's values, and no launch: lightning_indexer runs
// them before the scores are written, so that a refused top-k leaves `scores` as it was (one FFI
// crossing where a Python mirror of these checks cost ~5 us a call).
inline void check_indexer_topk(TensorView scores, TensorView positions, TensorView tokens,
                               tvm::ffi::Optional<TensorView> page_table, tvm::ffi::Optional<TensorView> slots,
                               int64_t page_slots, tvm::ffi::Optional<TensorView> workspace) {
  checked_topk_params(scores, positions, tokens, page_table, slots, page_slots, workspace, false);
}

}  // namespace sparsekv::dsv4_indexer
#endif
