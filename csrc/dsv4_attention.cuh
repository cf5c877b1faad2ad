// dsv4_attention: sparse MQA decode attention over paged fp8_ds_mla (V4, 584 B) caches, with a
// per-head sink logit and an optional second ("extra") cache, split-KV with the combine folded into
// the last CTA of each row (cuda, sim) or a combine pass (cpu).
//
// Contract. For batch row b and head h, let J(b) be the valid entries of indices[b, :] (slots in
// [0, pages * page_slots) of kv_cache) followed by those of extra_indices[b, :] (slots of
// extra_kv_cache); -1 and any other out-of-range entry is skipped (a slot listed twice counts
// twice). With topk_length (int32 [batch], as FlashMLA's argument of that name), only the first
// topk_length[b] entries of indices[b, :] are candidates (a length outside [0, K] is clamped to it;
// host-readable lengths are checked). kv_j is the dequantized 512-wide row of slot j: dims 0..447 = e4m3 * 2^(ue8m0 - 127)
// per 64-dim block, dims 448..511 = bf16; key = value = kv_j. With l_j = softmax_scale * q[b,h].kv_j:
//   out[b,h] = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink[h]))
//   lse[b,h] = log sum_j exp(l_j)           (natural log, sink excluded)
// and a row with no valid entry gives out = 0, lse = +inf; a NaN logit (NaN in q or in a row) gives
// out = lse = NaN for its (b, h), whatever the split. Nothing but out, lse and the split
// workspace is written; its arrival counters are zero before and after every call.
//
// Split-KV. The concatenated list [indices[b] | extra_indices[b]] is cut into num_splits ranges of
// split_len entries. Each (b, split, h) keeps an online softmax state (m = running max, l = sum of
// exp(l_j - m), acc = sum of exp(l_j - m) kv_j). With one split the state is finished in place; with
// several, split s stores lse_s = m + log l (-inf when empty) and o_s = acc / l (0 when empty), and
// Combine merges them: M = max_s lse_s, L = sum_s exp(lse_s - M),
//   out = sum_s exp(lse_s - M) o_s / (L + exp(sink - M)),  lse = M + log L.
// cpu runs Combine as a pass after the partials. cuda and sim merge in the partial launch, in the
// last CTA of each (row, head group) to finish, with two int32 counters per group (part_arrivals
// [batch, ceil(heads / 16), 2]: tickets, stores, a pair per 16 heads, the finest group). A CTA done with its tiles takes a
// ticket (atomicAdd). Not the last: it stores its partial, fences (__threadfence: the stores
// visible device-wide first) and counts one store. The last ticket (num_splits - 1): it resets the
// tickets, waits until the stores count num_splits - 1 (the CTAs it waits on took their tickets
// first, so they are running and finish without waiting on anything), resets the stores, fences,
// and merges as Combine does (merge_splits): its own o_s = acc x factor from registers, never
// stored, the others' read from L2 past L1 (load_partial), each dim summing its splits in order.
// So no second launch, and the counters are zero after every launch as before it: the next call
// and a CUDA-graph replay find them so. The sim runs blocks one at a time, so the last ticket goes
// to the group's last block, its wait ends at once, and atomics and fences are trivially ordered.
//
// Launch shapes. cpu: one (b, split) per item, all heads at once (a row is dequantized once per
// entry, rows go 8 at a time), sequential. cuda and sim: partial_kernel (partial_unaligned_kernel
// when a cache's records are not all 16-byte aligned), one CTA of 8 warps per
// (b, split, group of 64 heads, or 32 or 16 while the CTAs fit one wave) on tensor cores
// (mma.sync m16n8k16 bf16 -> fp32, sparsekv/mma.h; its comment above the kernel gives the steps);
// split, the group's last CTA runs Combine, one warp per head.
//
// Precision of the tensor-core path: the rows are exact in bf16 (e4m3 times a power of two, and
// bf16 rope); a bf16 q is exact, a float q goes in as three bf16 terms (hi + mid + lo: all 24 bits);
// P goes in as two bf16 terms (16 bits); products accumulate in fp32. So it stays within the
// documented tolerance of the fp64 reference, and since the running maximum moves in whole powers of
// two, P's rounding does not depend on how the rows fall into tiles (permuting a row's entries moves
// results by fp32 summation order only).
//
// Design and instruction budget (nvcc 13.0; bf16 q: 246 registers on sm_90a, 244 on sm_100a, no
// stack, 128.1 KB of dynamic shared memory: one CTA per SM; float q: 246 / 254 registers, no
// stack). The tile loop has no inner loop left. partial_kernel, the instance for caches whose
// records are all 16-byte aligned (every page_slots but 1: run_on_cuda picks it), has no 8-byte
// fallback in its gather, and entry() resolves a row of either cache with one copy of the
// addressing: 1,124 instructions on sm_90a (1,111 on sm_100a; partial_unaligned_kernel 1,330 /
// 1,362), of which a warp issues about 1,000 per tile of 32 rows (the 128-FMUL rescale runs only
// when a head's maximum moved, the row resolve only on warp 0): 192 HMMA (QK^T 64, PV
// 128: P is two bf16 terms), 72 LDSM (ldmatrix: 3 per QK^T k-step, 12 per PV k-step), the gather
// and convert (per 16-byte fp8 chunk one LDG.E.128.CONSTANT, 4 SHF for the high pairs, 8
// F2FP.F16.E4M3.UNPACK_B, 16 HADD2.F32, 16 FMUL, 8 F2FP.BF16.F32.PACK_AB, 2 STS.128: 6.5 per
// converted pair), the softmax (8 logits, 8 MUFU.EX2, 8 bf16 packs and 6 shuffles per thread)
// and five barriers. At batch 64, top-k 512, 64 heads the default split is 2 (128 CTAs, one wave,
// 8 tiles each). tools/bench/bench_sass_budget.py (loop instructions x 8,192 warp trips / (128
// SMs x 4 schedulers x clock)): sm_90a 9.08 us of issue on an H200 against its 6.64 us roofline
// with fp32 out (1.37x; 1.58x against 5.77 us with bf16 out); sm_100a 9.05 us on a B200 against
// 3.98 us (2.27x). End to end it adds what moves after the loop, with no overlap: the output to
// HBM (fp32 8.4 MB; bf16 4.2 MB, rounded by the merge itself), and the first split's fp32 partial
// (8.4 MB) written to L2 and read back from it by the row's last CTA, which keeps its own in
// registers (16.8 MB of L2 traffic at an assumed 32 B per SM per clock: 8.4 TB/s on the H200).
// H200: 12.8 us, 1.93x the fp32 roofline; 12.0 us, 2.08x the bf16 one. B200: 11.9 us (2.99x),
// 11.4 us (3.29x). A separate Combine launch reading both partials back from HBM took it to 17.8
// us (2.69x) and 17.0 us (2.94x) on the H200; every split storing and the last reading all of
// them from L2, to 14.8 us (2.23x) and 14.0 us (2.42x). One split instead (64 CTAs, no partials)
// would issue the same 8,192 warp trips on 64 SMs: 18.2 us before the output, worse than any. What
// is left for 2x with bf16 out on the H200, and for the B200 (bound by the loop's issue): the
// gather of tile i + 1 overlapped with tile i's products; fewer instructions per converted pair;
// partials in bf16 for a bf16 output. Batch 1, top-k 512: 32 splits of 16 entries x 4 CTAs of 16 heads = 128 CTAs of one half-valid tile each (run_on_cuda takes 32 or
// 16 heads per CTA while the CTAs fit one wave), each with a quarter of a 64-head tile's
// products; a finer split alone would add partials without shortening a CTA (a tile is 32 rows
// of products whatever is valid).

#pragma once

#include <cmath>
#include <vector>

#include "sparsekv/fp8.h"
#include "sparsekv/host_simd.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/mma.h"
#include "sparsekv/portability.h"
#include "sparsekv/query.h"

namespace sparsekv::dsv4_attention {

using Layout = kv_layout::V4;
inline constexpr int kDim = 512;
inline constexpr int kNope = 448;
inline constexpr int kScaleBlock = 64;

// One paged cache and its index list.
struct Source {
  const uint8_t* cache;
  int64_t page_stride;  // bytes between pages
  int page_shift;       // log2(page_slots)
  int64_t num_slots;    // pages * page_slots: valid slots are [0, num_slots)
  const int32_t* indices;
  int64_t index_row_stride;
  int64_t count;  // entries per batch row (0: no such cache)
  const int32_t* lengths = nullptr;  // [batch]: entries j >= lengths[b] of row b are skipped (null: none)
};

// The value and scale records of entry j of row b, or false when the entry names no slot.
SPARSEKV_HOST_DEVICE bool resolve(const Source& s, int64_t b, int64_t j, const uint8_t** value, const uint8_t** scale) {
  if (s.lengths && j >= s.lengths[b]) return false;
  const int64_t slot = s.indices[b * s.index_row_stride + j];
  if (slot < 0 || slot >= s.num_slots) return false;
  const int64_t page_slots = int64_t{1} << s.page_shift;
  const uint8_t* page = s.cache + (slot >> s.page_shift) * s.page_stride;
  const int64_t in_page = slot & (page_slots - 1);
  *value = page + Layout::value_offset(in_page);
  *scale = page + Layout::scale_offset(in_page, page_slots);
  return true;
}

// Dimension d of a V4 row.
SPARSEKV_HOST_DEVICE float dequantize(const uint8_t* value, const uint8_t* scale, int d) {
  if (d < kNope) return fp8::e4m3_to_float(value[d]) * fp8::ue8m0_to_float(scale[d / kScaleBlock]);
  const uint8_t* rope = value + kNope + 2 * (d - kNope);  // little-endian bf16
  return fp8::bf16_to_float(static_cast<uint16_t>(rope[0] | (rope[1] << 8)));
}

template <class QT>
struct Params {
  static_assert(std::is_same_v<QT, float> || std::is_same_v<QT, Bf16>, "dsv4_attention: q must be float or Bf16");
  const QT* q;  // [batch, heads, 512], unit last stride
  int64_t q_stride_b;
  int64_t q_stride_h;
  Source main;
  Source extra;
  const float* sink;  // [heads]
  float softmax_scale;
  int64_t batch;
  int64_t heads;
  int64_t num_splits;
  int64_t split_len;
  float* out;       // [batch, heads, 512] contiguous (null when out_bf16 is set)
  float* lse;       // [batch, heads] contiguous
  float* part_out;  // [batch, num_splits, heads, 512] contiguous (num_splits > 1)
  float* part_lse;  // [batch, num_splits, heads]
  int64_t head_group = 64;  // heads per CTA of partial_kernel (64, 32 or 16): run_on_cuda sets it
  Bf16* out_bf16 = nullptr;  // [batch, heads, 512] contiguous: Combine writes here, rounded to nearest
                             // (ties to even), instead of `out` (num_splits > 1 only)
  int* arrivals = nullptr;   // [batch, arrival_groups(heads), 2] (num_splits > 1, cuda and sim): per row and
                             // head group, the splits that took a ticket and those that stored their
                             // partial; zero before and after every launch
};

// Arrival counters per batch row: one per 16 heads, the finest head group of partial_kernel.
inline constexpr int64_t kArrivalHeads = 16;
SPARSEKV_HOST_DEVICE int64_t arrival_groups(int64_t heads) { return (heads + kArrivalHeads - 1) / kArrivalHeads; }

// Entry j of the concatenated list [main | extra] of row b. The source is picked field by field and
// resolved once: one copy of the addressing code in the tile loop, not one per cache.
template <class QT>
SPARSEKV_HOST_DEVICE bool entry(const Params<QT>& p, int64_t b, int64_t j, const uint8_t** value,
                                const uint8_t** scale) {
  const bool in_main = j < p.main.count;
  return resolve(in_main ? p.main : p.extra, b, in_main ? j : j - p.main.count, value, scale);
}

template <class QT>
SPARSEKV_HOST_DEVICE int64_t total_entries(const Params<QT>& p) {
  return p.main.count + p.extra.count;
}

// exp(x) with exp(-inf) = 0 and no NaN from -inf - -inf (callers pass differences of maxima).
SPARSEKV_HOST_DEVICE float safe_exp(float x) { return x == -INFINITY ? 0.0f : expf(x); }

// Finishing one (b, h) from its online state (m, l, acc): the caller scales dims by the returned
// factor; writes lse. An empty state (l == 0) gives factor 0 and lse = +inf; a NaN logit (NaN in q
// or in a row) made l NaN, and NaN carries through (never mistaken for an empty row).
SPARSEKV_HOST_DEVICE float finish_factor(float m, float l, float sink) {
  if (l == 0.0f) return 0.0f;
  return 1.0f / (l + safe_exp(sink - m));
}
SPARSEKV_HOST_DEVICE float finish_lse(float m, float l) { return l == 0.0f ? INFINITY : m + logf(l); }
// What split s stores: lse_s and the factor that turns acc into o_s = acc / l.
SPARSEKV_HOST_DEVICE float split_lse(float m, float l) { return l == 0.0f ? -INFINITY : m + logf(l); }
SPARSEKV_HOST_DEVICE float split_factor(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// The merge of one (b, h)'s splits from their lse_s (lse_of(s)): M = max_s lse_s (NaN when any is
// NaN: fmaxf skips NaN, so it is looked for separately and carried through), L = sum_s exp(lse_s - M)
// and the denominator L + exp(sink - M). Split s then weighs in with exp(lse_s - M).
struct Merge {
  float m = -INFINITY;
  float total = 0.0f;
  float denominator = 0.0f;
  bool nan = false;
  // The output's value from sum_s exp(lse_s - M) o_s: NaN, 0 for a row with no valid entry, or it
  // over the denominator.
  SPARSEKV_HOST_DEVICE float value(float weighted) const {
    return nan ? NAN : m == -INFINITY ? 0.0f : weighted / denominator;
  }
  SPARSEKV_HOST_DEVICE float lse() const { return nan ? NAN : m == -INFINITY ? INFINITY : m + logf(total); }
  SPARSEKV_HOST_DEVICE bool weighs() const { return !nan && m != -INFINITY; }
};

template <class LseOf>
SPARSEKV_HOST_DEVICE Merge merge_splits(int64_t num_splits, const LseOf& lse_of, float sink) {
  Merge g;
  for (int64_t s = 0; s < num_splits; ++s) {
    const float lse_s = lse_of(s);
    g.m = fmaxf(g.m, lse_s);
    g.nan = g.nan || lse_s != lse_s;
  }
  if (!g.weighs()) return g;
  for (int64_t s = 0; s < num_splits; ++s) g.total += safe_exp(lse_of(s) - g.m);
  g.denominator = g.total + safe_exp(sink - g.m);
  return g;
}

// A split's partial as the combine reads it. On the GPU it bypasses L1 (ld.global.cg): the last
// CTA of a row reads what CTAs on other SMs wrote during the same launch, and an L1 line cached
// earlier in the launch (a neighbouring group's part_lse shares its 128 bytes) could be stale.
SPARSEKV_HOST_DEVICE float load_partial(const float* at) {
#ifdef __CUDA_ARCH__
  return __ldcg(at);
#else
  return *at;
#endif
}

// Dimension d of output row i (= b heads + h): float, or bf16 straight from the float result (no
// float pass), rounded to nearest, ties to even.
template <class QT>
SPARSEKV_HOST_DEVICE void store_out(const Params<QT>& p, int64_t i, int d, float value) {
  if (p.out_bf16) {
    p.out_bf16[i * kDim + d] = Bf16{fp8::float_to_bf16(value)};
  } else {
    p.out[i * kDim + d] = value;
  }
}

// ---------------------------------------------------------------------------------------------
// Combine: one (b, h) per item, lanes over the 512 dims: the cpu backend's pass after the partials
// (on cuda and sim the last CTA of a row merges them the same way: partial_tiles, 6.).
template <class QT>
struct Combine {
  using Params = dsv4_attention::Params<QT>;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.batch * p.heads; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t b = i / p.heads;
    const int64_t h = i - b * p.heads;
    const float* part_lse = p.part_lse + b * p.num_splits * p.heads + h;
    const auto lse_of = [&](int64_t s) { return load_partial(part_lse + s * p.heads); };
    const Merge g = merge_splits(p.num_splits, lse_of, p.sink[h]);
    // Four dims per lane at a time (d0 + lane + k x lanes), so each split's weight is computed once
    // per four dims; each dim sums its splits in order, s = 0, 1, ...
    constexpr int kDimsAtOnce = 4;
    const float* part_out = p.part_out + (b * p.num_splits * p.heads + h) * kDim;
    for (int d0 = 0; d0 < kDim; d0 += kDimsAtOnce * lanes.count) {
      float acc[kDimsAtOnce] = {};
      for (int64_t s = 0; g.weighs() && s < p.num_splits; ++s) {
        const float w = safe_exp(lse_of(s) - g.m);
        if (w <= 0.0f) continue;
        for (int k = 0; k < kDimsAtOnce; ++k) {
          const int d = d0 + lanes.lane + k * lanes.count;
          if (d < kDim) acc[k] += w * load_partial(part_out + s * p.heads * kDim + d);
        }
      }
      for (int k = 0; k < kDimsAtOnce; ++k) {
        const int d = d0 + lanes.lane + k * lanes.count;
        if (d < kDim) store_out(p, i, d, g.value(acc[k]));
      }
    }
    if (lanes.lane == 0) p.lse[i] = g.lse();
  }
};

// Host tiles of 8 rows: logit[t] = q . row t (rows stored [dim][row], so the 8 sums are
// independent lanes), and acc = acc * c + sum_t w[t] row t (rows stored [row][dim]). Padding rows
// are zero with w = 0.
inline constexpr int kHostTile = 8;

SPARSEKV_HOST_SIMD_CLONES static void host_tile_logits(const float* q, const float (*cols)[kHostTile], float* logit) {
  static_assert(kHostTile == 8, "dsv4_attention: a host tile is one HostFloat8");
  HostFloat8 sum = {};
  for (int d = 0; d < kDim; ++d) {
    HostFloat8 col;
    __builtin_memcpy(&col, cols[d], sizeof(col));
    sum += q[d] * col;
  }
  __builtin_memcpy(logit, &sum, sizeof(sum));
}

SPARSEKV_HOST_SIMD_CLONES static void host_tile_update(float* acc, const float (*rows)[kDim], const float* w,
                                                       float c) {
  for (int d = 0; d < kDim; ++d) {
    float a = acc[d] * c;
    for (int t = 0; t < kHostTile; ++t) a += w[t] * rows[t][d];
    acc[d] = a;
  }
}

// ---------------------------------------------------------------------------------------------
// Partial: the online softmax over one split of one row (all heads on the host; see run_on_cuda).
template <class QT>
struct Partial {
  using Params = dsv4_attention::Params<QT>;
  static int64_t num_items(const Params& p) { return p.batch * p.num_splits; }

  // Host: item i = (b, split), all heads. Rows are taken kHostTile at a time and stored twice,
  // [dim][row] for the logits (kHostTile independent sums per head: vectorizable without
  // reassociating a reduction) and [row][dim] for the value update. The accumulators live in the
  // output rows they finish into; (m, l) per head and the scaled query in one host vector.
  static void item(const Params& p, int64_t i, Lanes) {
    constexpr int T = kHostTile;
    const int64_t b = i / p.num_splits;
    const int64_t s = i - b * p.num_splits;
    const int64_t heads = p.heads;
    const bool single = p.num_splits == 1;
    float* acc = single ? p.out + b * heads * kDim : p.part_out + (b * p.num_splits + s) * heads * kDim;
    std::vector<float> q(static_cast<size_t>(heads) * kDim), m(heads, -INFINITY), l(heads, 0.0f);
    for (int64_t h = 0; h < heads; ++h) {
      for (int d = 0; d < kDim; ++d) {
        q[h * kDim + d] = p.softmax_scale * load_q(p.q + b * p.q_stride_b + h * p.q_stride_h + d);
        acc[h * kDim + d] = 0.0f;
      }
    }
    alignas(64) float rows[T][kDim];
    alignas(64) float cols[kDim][T];
    const int64_t first = s * p.split_len;
    const int64_t total = total_entries(p);
    const int64_t last = first + p.split_len < total ? first + p.split_len : total;
    int64_t j = first;
    while (j < last) {
      // 1. Gather up to T valid rows.
      int n = 0;
      for (; j < last && n < T; ++j) {
        const uint8_t *value, *scale;
        if (!entry(p, b, j, &value, &scale)) continue;
        for (int d = 0; d < kDim; ++d) rows[n][d] = dequantize(value, scale, d);
        ++n;
      }
      if (n == 0) break;
      for (int t = n; t < T; ++t)
        for (int d = 0; d < kDim; ++d) rows[t][d] = 0.0f;
      for (int d = 0; d < kDim; ++d)
        for (int t = 0; t < T; ++t) cols[d][t] = rows[t][d];
      for (int64_t h = 0; h < heads; ++h) {
        // 2. T logits of head h, then the online softmax over the tile.
        float logit[T];
        host_tile_logits(q.data() + h * kDim, cols, logit);
        float tile_max = -INFINITY;
        for (int t = 0; t < n; ++t) tile_max = logit[t] > tile_max ? logit[t] : tile_max;
        const float m_new = tile_max > m[h] ? tile_max : m[h];
        const float c = safe_exp(m[h] - m_new);
        float w[T] = {};
        for (int t = 0; t < n; ++t) w[t] = safe_exp(logit[t] - m_new);
        l[h] *= c;
        for (int t = 0; t < n; ++t) l[h] += w[t];
        m[h] = m_new;
        host_tile_update(acc + h * kDim, rows, w, c);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* a = acc + h * kDim;
      const float factor = single ? finish_factor(m[h], l[h], p.sink[h]) : split_factor(l[h]);
      for (int d = 0; d < kDim; ++d) a[d] *= factor;
      if (single) {
        p.lse[b * heads + h] = finish_lse(m[h], l[h]);
      } else {
        p.part_lse[(b * p.num_splits + s) * heads + h] = split_lse(m[h], l[h]);
      }
    }
  }

#ifdef __CUDACC__
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kHeads = 64;  // heads per CTA at most: 4 m-tiles of 16 (Params::head_group)
  static constexpr int64_t kWaveCtas = 132;  // CTAs of one wave on an H200: see run_on_cuda
  static constexpr int kMTiles = kHeads / 16;
  static constexpr int kRows = 32;                      // rows per tile
  static constexpr int kKvStride = kDim + 8;            // bf16 per row: fragment loads hit 32 banks
  static constexpr int kQStride = std::is_same_v<QT, float> ? kDim + 4 : kDim + 8;
  static constexpr int kScoreStride = kRows + 1;        // floats per head of the scores
  static constexpr int kPStride = kRows + 8;            // bf16 per head of P
  static constexpr int kDimsPerWarp = kDim / kWarps;    // PV: each warp owns 64 output dims
  static constexpr int kChunks = Layout::kValueBytes / 16;  // 16-byte chunks of a value record: 28 fp8, 8 bf16
  static_assert(kRows % 16 == 0 && kRows / 8 == 4, "dsv4_attention: QK^T gives each warp 4 n-tiles of 8 rows");
  static_assert(kWarps == 2 * kMTiles, "dsv4_attention: QK^T splits the 512 dims in two per m-tile");
  static_assert(kThreads == 4 * kHeads && kRows == 4 * 8, "dsv4_attention: the softmax is 4 threads x 8 rows per head");
  static_assert(Layout::kValueBytes == 16 * kChunks && kNope % 64 == 0, "dsv4_attention: 28 fp8 + 8 bf16 chunks");
  using QElem = std::conditional_t<std::is_same_v<QT, float>, float, uint16_t>;
  struct Shared {
    QElem q[kHeads][kQStride];
    uint16_t kv[kRows][kKvStride];  // the tile's rows, bf16
    float score[2][kHeads][kScoreStride];
    uint16_t prob[2][kHeads][kPStride];  // P = hi + lo, bf16 each
    float rescale[kHeads];
    float factor[kHeads];
    const uint8_t* value[kRows];
    uint64_t scales[kRows];  // the 7 UE8M0 bytes of each row (and the pad)
    int valid[kRows];
    float merge_m[kHeads];  // the combine's maximum per head (NaN: a NaN split)
    float merge_denominator[kHeads];
    int last;  // this CTA took the last ticket of its row and head group: it combines
  };
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
namespace tc {

// 2^k for an integer k <= 0 (exact; 0 below the normal range).
SPARSEKV_DEVICE float pow2(float k) { return k < -126.0f ? 0.0f : fp8::exp2_int(static_cast<int>(k)); }
SPARSEKV_DEVICE float safe_exp2(float x) { return x == -INFINITY ? 0.0f : exp2f(x); }

SPARSEKV_DEVICE uint32_t shared_word(const uint16_t* at) { return *reinterpret_cast<const uint32_t*>(at); }

// The 16 bytes at p: one LDG.128 when p is 16-byte aligned, which `Aligned` promises (then the
// 8-byte fallback is not compiled at all); otherwise 8-byte words, see copy_detail. The row
// pointers come through shared memory, so nvcc cannot tell they are global and would emit a
// generic LD.128; __ldg says so (and the caches are read-only for the kernel's life).
template <bool Aligned>
SPARSEKV_DEVICE uint4 load16(const uint8_t* p) {
#if defined(__CUDA_ARCH__) && !defined(SPARSEKV_SIM)
  if (Aligned || (reinterpret_cast<uintptr_t>(p) & 15) == 0) return __ldg(reinterpret_cast<const uint4*>(p));
#else
  if (Aligned || (reinterpret_cast<uintptr_t>(p) & 15) == 0) return *reinterpret_cast<const uint4*>(p);
#endif
  const uint64_t low = copy_detail::load_bytes8(p, p, p + 16), high = copy_detail::load_bytes8(p + 8, p, p + 16);
  return uint4{static_cast<unsigned>(low), static_cast<unsigned>(low >> 32), static_cast<unsigned>(high),
               static_cast<unsigned>(high >> 32)};
}

// Fragment of A = q[16 heads from m0][16 dims from k0] in `parts` bf16 terms: bf16 q is one term;
// float q is hi + mid + lo, which holds its 24 bits exactly.
template <int Parts, class QRows>
SPARSEKV_DEVICE void load_q_fragment(const QRows& q, int m0, int k0, int lane, mma::FragA (&a)[Parts]) {
  using QElem = std::remove_cv_t<std::remove_reference_t<decltype(q[0][0])>>;
  SPARSEKV_UNROLLED
  for (int r = 0; r < 4; ++r) {
    const int row = m0 + mma::a_row(lane, r), col = k0 + mma::a_col(lane, r, 0);
    if constexpr (std::is_same_v<QElem, float>) {
      float x0 = q[row][col], x1 = q[row][col + 1];
      SPARSEKV_UNROLLED
      for (int part = 0; part < Parts; ++part) {
        const uint32_t packed = mma::floats_to_bf16x2(x0, x1);
        a[part].x[r] = packed;
        x0 -= fp8::bf16_to_float(static_cast<uint16_t>(packed));
        x1 -= fp8::bf16_to_float(static_cast<uint16_t>(packed >> 16));
      }
    } else {
      a[0].x[r] = shared_word(&q[row][col]);
    }
  }
}

// The A fragment of the bf16 16 x 16 tile at rows[m0..][k0..] in one ldmatrix.
template <class Rows>
SPARSEKV_DEVICE mma::FragA ldmatrix_a(const Rows& rows, int m0, int k0, int lane) {
  mma::FragA a;
  mma::ldmatrix_x4(a.x, &rows[m0 + lane % 8 + 8 * ((lane / 8) % 2)][k0 + 8 * (lane / 16)]);
  return a;
}

}  // namespace tc

// One CTA per (b, split, group of Params::head_group heads: 64, 32 or 16), 8 warps. Per tile of 32
// rows of the split:
//   1. rows resolved (32 threads), then gathered in 16-byte chunks and converted to bf16 in shared
//      memory (e4m3 -> bf16 on the hardware convert, times the block's power-of-two scale; rope
//      copied); rows that name no slot are zero, with logit -inf;
//   2. S = Q K^T on mma.sync: warp w takes m-tile w % 4 and dims [256 (w / 4), +256) for all 32
//      rows, so each Q fragment is loaded once per tile; the two halves meet in shared memory;
//   3. online softmax in base 2, 4 threads per head: the running maximum is rounded up to an
//      integer, so every rescale is an exact power of two and P's rounding does not depend on how
//      rows fall into tiles; P = hi + lo in bf16 (16 bits of the fp32 probability);
//   4. O += P V on mma.sync: warp w owns output dims [64 w, +64) of all 64 heads: 4 x 8 fp32
//      fragments (128 registers), rescaled by 2^(m_old - m_new) first.
// The sink enters only the final normalization (1 / (l + 2^(sink log2 e - m))), as in Combine.
// `Aligned`: every value record is 16-byte aligned and every scale record 8-byte aligned (both
// caches' bases and page strides are multiples of 16: run_on_cuda checks), so the gather is one
// LDG.128 per chunk with no fallback in the loop; partial_kernel is that instance (the serving
// one), partial_unaligned_kernel the other (a page of one 584-byte slot, or a cache viewed off a
// 16-byte boundary).
template <class QT, bool Aligned>
SPARSEKV_DEVICE void partial_tiles(const Params<QT>& p) {
  using K = Partial<QT>;
  constexpr int kQParts = std::is_same_v<QT, float> ? 3 : 1;
  constexpr int R = K::kRows;
  auto& sh = *dynamic_shared<typename K::Shared>();
  const int64_t b = blockIdx.x / p.num_splits;
  const int64_t s = blockIdx.x - b * p.num_splits;
  const int64_t h0 = static_cast<int64_t>(blockIdx.y) * p.head_group;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int heads_here = static_cast<int>(p.heads - h0 < p.head_group ? p.heads - h0 : p.head_group);
  const int m_tiles = (heads_here + 15) / 16;  // m-tiles past the heads are skipped (CTA-uniform)
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // The query block into shared memory, once; heads past the last are zero.
  for (int h = warp; h < m_tiles * 16; h += K::kWarps) {
    auto* row = sh.q[h];
    if (h >= heads_here) {
      for (int d = lane; d < kDim; d += kWarpSize) row[d] = 0;
    } else if constexpr (std::is_same_v<QT, float>) {
      for (int d = lane; d < kDim; d += kWarpSize) row[d] = p.q[b * p.q_stride_b + (h0 + h) * p.q_stride_h + d];
    } else {
      copy_bytes(row, p.q + b * p.q_stride_b + (h0 + h) * p.q_stride_h, kDim * 2, Lanes{lane, kWarpSize});
    }
  }
  const int head = tid / 4, quarter = tid % 4;  // this thread's share of the softmax
  const bool softmax_lane = head < m_tiles * 16;  // warp-uniform: a warp holds 8 heads of one m-tile
  float m = -INFINITY, l = 0.0f;
  mma::FragC acc[K::kMTiles][K::kDimsPerWarp / 8] = {};

  const int64_t first = s * p.split_len;
  const int64_t total = total_entries(p);
  const int64_t last = first + p.split_len < total ? first + p.split_len : total;
  SPARSEKV_ROLLED
  for (int64_t j0 = first; j0 < last; j0 += R) {
    // 1. Resolve the tile's rows, then gather and convert them.
    if (tid < R) {
      const uint8_t *value = nullptr, *scale = nullptr;
      const bool valid = j0 + tid < last && entry(p, b, j0 + tid, &value, &scale);
      sh.value[tid] = value;
      if constexpr (Aligned) {
        sh.scales[tid] = valid ? *reinterpret_cast<const uint64_t*>(scale) : 0;
      } else {
        sh.scales[tid] = valid ? copy_detail::load_bytes8(scale, scale, scale + Layout::kScaleBytes) : 0;
      }
      sh.valid[tid] = valid;
    }
    __syncthreads();
    {
      // 8 threads per row: chunks part, part + 8, part + 16 (fp8), part + 24 (fp8 below 28, else
      // bf16 rope) and, for part < 4, part + 32 (rope).
      const int row = tid / 8, part = tid % 8;
      const bool valid = sh.valid[row];
      const uint8_t* value = sh.value[row];
      const uint64_t scales = sh.scales[row];
      uint16_t* kv = sh.kv[row];
      const auto fp8_chunk = [&](int chunk) {
        uint4 lo{0, 0, 0, 0}, hi{0, 0, 0, 0};
        if (valid) {
          const uint4 raw = tc::load16<Aligned>(value + 16 * chunk);
          const float factor = fp8::ue8m0_to_float(static_cast<uint8_t>(scales >> (8 * (chunk / (kScaleBlock / 16)))));
          lo = uint4{mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.x), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.x >> 16), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.y), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.y >> 16), factor)};
          hi = uint4{mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.z), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.z >> 16), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.w), factor),
                     mma::e4m3x2_to_bf16x2(static_cast<uint16_t>(raw.w >> 16), factor)};
        }
        reinterpret_cast<uint4*>(kv + 16 * chunk)[0] = lo;
        reinterpret_cast<uint4*>(kv + 16 * chunk)[1] = hi;
      };
      const auto rope_chunk = [&](int rope) {
        reinterpret_cast<uint4*>(kv + kNope + 8 * rope)[0] = valid ? tc::load16<Aligned>(value + kNope + 16 * rope)
                                                                   : uint4{0, 0, 0, 0};
      };
      static_assert(kNope / 16 == 28 && K::kChunks == 36 && K::kThreads == 8 * R, "dsv4_attention: chunk plan");
      fp8_chunk(part);
      fp8_chunk(part + 8);
      fp8_chunk(part + 16);
      if (part < 4) {
        fp8_chunk(part + 24);
        rope_chunk(part + 4);
      } else {
        rope_chunk(part - 4);
      }
    }
    __syncthreads();

    // 2. Partial scores of m-tile warp % 4 over half of the dims, all 32 rows.
    if (warp % K::kMTiles < m_tiles) {
      const int m0 = 16 * (warp % K::kMTiles), k_begin = (kDim / 2) * (warp / K::kMTiles);
      mma::FragC score[R / 8] = {};
      for (int k0 = k_begin; k0 < k_begin + kDim / 2; k0 += 16) {
        mma::FragA a[kQParts];
        if constexpr (kQParts == 1) {
          a[0] = tc::ldmatrix_a(sh.q, m0, k0, lane);
        } else {
          tc::load_q_fragment<kQParts>(sh.q, m0, k0, lane, a);
        }
        SPARSEKV_UNROLLED
        for (int n = 0; n < R / 8; n += 2) {
          // K^T fragments of n-tiles n and n + 1: matrix i = rows 8 (n + i / 2), dims k0 + 8 (i % 2).
          uint32_t kt[4];
          mma::ldmatrix_x4(kt, &sh.kv[8 * (n + lane / 16) + lane % 8][k0 + 8 * ((lane / 8) % 2)]);
          const mma::FragB first{{kt[0], kt[1]}}, second{{kt[2], kt[3]}};
          SPARSEKV_UNROLLED
          for (int part = 0; part < kQParts; ++part) {
            mma::mma_bf16(score[n], a[part], first);
            mma::mma_bf16(score[n + 1], a[part], second);
          }
        }
      }
      SPARSEKV_UNROLLED
      for (int n = 0; n < R / 8; ++n) {
        SPARSEKV_UNROLLED
        for (int i = 0; i < 4; ++i) {
          sh.score[warp / K::kMTiles][m0 + mma::c_row(lane, i)][8 * n + mma::c_col(lane, i)] = score[n].x[i];
        }
      }
    }
    __syncthreads();

    // 3. Online softmax of head `head` over rows [8 quarter, +8).
    if (softmax_lane) {
      float x[8];
      float tile_max = -INFINITY;
      bool tile_nan = false;  // fmaxf skips NaN: a NaN logit must not read as an empty tile
      SPARSEKV_UNROLLED
      for (int i = 0; i < 8; ++i) {
        const int row = 8 * quarter + i;
        x[i] = sh.valid[row] ? (sh.score[0][head][row] + sh.score[1][head][row]) * scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, x[i]);
        tile_nan = tile_nan || x[i] != x[i];
      }
      SPARSEKV_UNROLLED
      for (int offset = 1; offset < 4; offset *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
        tile_nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(tile_nan), offset) || tile_nan;
      }
      const float m_new = ceilf(fmaxf(m, tile_max));
      float c = 1.0f, sum = 0.0f;
      uint32_t hi[4] = {}, lo[4] = {};  // bf16x2: rows 8 quarter + 2i, + 2i + 1
      if (!(m_new == -INFINITY && !tile_nan)) {
        c = m == -INFINITY ? 0.0f : tc::pow2(m - m_new);
        SPARSEKV_UNROLLED
        for (int i = 0; i < 4; ++i) {
          const float e0 = tc::safe_exp2(x[2 * i] - m_new), e1 = tc::safe_exp2(x[2 * i + 1] - m_new);
          sum += e0;
          sum += e1;
          hi[i] = mma::floats_to_bf16x2(e0, e1);
          lo[i] = mma::floats_to_bf16x2(e0 - fp8::bf16_to_float(static_cast<uint16_t>(hi[i])),
                                        e1 - fp8::bf16_to_float(static_cast<uint16_t>(hi[i] >> 16)));
        }
      }
      SPARSEKV_UNROLLED
      for (int offset = 1; offset < 4; offset *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      l = l * c + sum;
      m = m_new == -INFINITY && !tile_nan ? m : m_new;
      SPARSEKV_UNROLLED
      for (int i = 0; i < 4; ++i) {
        *reinterpret_cast<uint32_t*>(&sh.prob[0][head][8 * quarter + 2 * i]) = hi[i];
        *reinterpret_cast<uint32_t*>(&sh.prob[1][head][8 * quarter + 2 * i]) = lo[i];
      }
      if (quarter == 0) sh.rescale[head] = c;
    }
    __syncthreads();

    // 4. O = O * c + P V over this warp's 64 dims.
    // The maximum moves in whole powers of two and seldom after the first tiles: skip the 128
    // multiplies when no head of the warp's fragments moved (one vote).
    float c_low[K::kMTiles], c_high[K::kMTiles];
    bool moved = false;
    SPARSEKV_UNROLLED
    for (int mt = 0; mt < K::kMTiles; ++mt) {
      c_low[mt] = mt < m_tiles ? sh.rescale[16 * mt + mma::c_row(lane, 0)] : 1.0f;
      c_high[mt] = mt < m_tiles ? sh.rescale[16 * mt + mma::c_row(lane, 2)] : 1.0f;
      moved = moved || c_low[mt] != 1.0f || c_high[mt] != 1.0f;
    }
    if (__any_sync(0xffffffffu, moved)) {
      SPARSEKV_UNROLLED
      for (int mt = 0; mt < K::kMTiles; ++mt) {
        SPARSEKV_UNROLLED
        for (int n = 0; n < K::kDimsPerWarp / 8; ++n) {
          acc[mt][n].x[0] *= c_low[mt];
          acc[mt][n].x[1] *= c_low[mt];
          acc[mt][n].x[2] *= c_high[mt];
          acc[mt][n].x[3] *= c_high[mt];
        }
      }
    }
    for (int k0 = 0; k0 < R; k0 += 16) {
      mma::FragA prob[K::kMTiles][2];
      SPARSEKV_UNROLLED
      for (int mt = 0; mt < K::kMTiles; ++mt) {
        if (mt >= m_tiles) continue;
        prob[mt][0] = tc::ldmatrix_a(sh.prob[0], 16 * mt, k0, lane);
        prob[mt][1] = tc::ldmatrix_a(sh.prob[1], 16 * mt, k0, lane);
      }
      SPARSEKV_UNROLLED
      for (int n = 0; n < K::kDimsPerWarp / 8; n += 2) {
        // V fragments of n-tiles n and n + 1, transposed: matrix i = rows k0 + 8 (i % 2), dims
        // d0 + 8 (i / 2).
        const int d0 = K::kDimsPerWarp * warp + 8 * n;
        uint32_t v[4];
        mma::ldmatrix_x4<true>(v, &sh.kv[k0 + 8 * ((lane / 8) % 2) + lane % 8][d0 + 8 * (lane / 16)]);
        const mma::FragB first{{v[0], v[1]}}, second{{v[2], v[3]}};
        SPARSEKV_UNROLLED
        for (int mt = 0; mt < K::kMTiles; ++mt) {
          if (mt >= m_tiles) continue;
          mma::mma_bf16(acc[mt][n], prob[mt][1], first);
          mma::mma_bf16(acc[mt][n], prob[mt][0], first);
          mma::mma_bf16(acc[mt][n + 1], prob[mt][1], second);
          mma::mma_bf16(acc[mt][n + 1], prob[mt][0], second);
        }
      }
    }
    __syncthreads();  // the next tile overwrites kv, score and prob
  }

  // 5. Finish: factor and lse per head (natural log), then this warp's dims of every head; split,
  //    a ticket first: the CTA that takes the last one of its row and head group keeps its partial
  //    in registers (6.), the others store theirs.
  const bool single = p.num_splits == 1;
  int* const tickets = single ? nullptr : p.arrivals + 2 * (b * arrival_groups(p.heads) + h0 / kArrivalHeads);
  if (tid == 0 && !single) {
    const bool last = atomicAdd(tickets, 1) == p.num_splits - 1;
    if (last) *tickets = 0;  // every split has its ticket: nothing else takes one in this launch
    sh.last = last;
  }
  __syncthreads();
  const bool keep = !single && sh.last;
  if (softmax_lane && quarter == 0) {
    const float sink2 = p.sink[h0 + head < p.heads ? h0 + head : 0] * 1.4426950408889634f;
    const float factor = single ? (l == 0.0f ? 0.0f : 1.0f / (l + tc::safe_exp2(sink2 - m))) : split_factor(l);
    const float lse2 = m + log2f(l);
    sh.factor[head] = factor;
    if (h0 + head < p.heads) {
      const float lse = l == 0.0f ? (single ? INFINITY : -INFINITY) : lse2 * 0.6931471805599453f;
      if (single) {
        p.lse[b * p.heads + h0 + head] = lse;
      } else if (keep) {
        sh.rescale[head] = lse;  // this split's lse_s, for 6.
      } else {
        p.part_lse[(b * p.num_splits + s) * p.heads + h0 + head] = lse;
      }
    }
  }
  __syncthreads();
  if (!keep) {
    SPARSEKV_UNROLLED
    for (int mt = 0; mt < K::kMTiles; ++mt) {
      if (mt >= m_tiles) continue;
      SPARSEKV_UNROLLED
      for (int half = 0; half < 2; ++half) {
        const int hh = 16 * mt + mma::c_row(lane, 2 * half);
        if (h0 + hh >= p.heads) continue;
        const float factor = sh.factor[hh];
        float* dst = single ? p.out + (b * p.heads + h0 + hh) * kDim
                            : p.part_out + ((b * p.num_splits + s) * p.heads + h0 + hh) * kDim;
        SPARSEKV_UNROLLED
        for (int n = 0; n < K::kDimsPerWarp / 8; ++n) {
          const int d = K::kDimsPerWarp * warp + 8 * n + mma::c_col(lane, 0);
          dst[d] = acc[mt][n].x[2 * half] * factor;  // two words: a caller's `out` may be 4-byte aligned only
          dst[d + 1] = acc[mt][n].x[2 * half + 1] * factor;
        }
      }
    }
    if (single) return;
    // Every thread's partial stores visible device-wide before thread 0 counts them stored.
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(tickets + 1, 1);
    return;
  }

  // 6. The last ticket: wait for the other splits' partials (their CTAs run: each took a ticket
  //    before this one), zero the stored count for the next launch (or graph replay), then merge
  //    as Combine does: this split's o_s = acc x factor from registers, the others' from L2, in
  //    split order, so the bits are those of a Combine pass over stored partials.
  if (tid == 0) {
    while (atomicAdd(tickets + 1, 0) != p.num_splits - 1) {
    }
    tickets[1] = 0;
  }
  __syncthreads();
  __threadfence();
  const float* part_lse = p.part_lse + b * p.num_splits * p.heads + h0;
  if (tid < heads_here) {
    const auto lse_of = [&](int64_t t) { return t == s ? sh.rescale[tid] : load_partial(part_lse + t * p.heads + tid); };
    const Merge g = merge_splits(p.num_splits, lse_of, p.sink[h0 + tid]);
    p.lse[b * p.heads + h0 + tid] = g.lse();
    sh.merge_m[tid] = g.nan ? NAN : g.m;
    sh.merge_denominator[tid] = g.denominator;
  }
  __syncthreads();
  SPARSEKV_UNROLLED
  for (int mt = 0; mt < K::kMTiles; ++mt) {
    if (mt >= m_tiles) continue;
    SPARSEKV_UNROLLED
    for (int half = 0; half < 2; ++half) {
      const int hh = 16 * mt + mma::c_row(lane, 2 * half);
      if (hh >= heads_here) continue;
      Merge g;
      g.m = sh.merge_m[hh];
      g.nan = g.m != g.m;
      g.denominator = sh.merge_denominator[hh];
      const float factor = sh.factor[hh];
      float weighted[K::kDimsPerWarp / 8][2] = {};
      for (int64_t t = 0; g.weighs() && t < p.num_splits; ++t) {
        const float w = safe_exp((t == s ? sh.rescale[hh] : load_partial(part_lse + t * p.heads + hh)) - g.m);
        if (w <= 0.0f) continue;
        const float* src = p.part_out + ((b * p.num_splits + t) * p.heads + h0 + hh) * kDim;
        SPARSEKV_UNROLLED
        for (int n = 0; n < K::kDimsPerWarp / 8; ++n) {
          const int d = K::kDimsPerWarp * warp + 8 * n + mma::c_col(lane, 0);
          SPARSEKV_UNROLLED
          for (int i = 0; i < 2; ++i) {
            weighted[n][i] += w * (t == s ? acc[mt][n].x[2 * half + i] * factor : load_partial(src + d + i));
          }
        }
      }
      SPARSEKV_UNROLLED
      for (int n = 0; n < K::kDimsPerWarp / 8; ++n) {
        const int d = K::kDimsPerWarp * warp + 8 * n + mma::c_col(lane, 0);
        store_out(p, b * p.heads + h0 + hh, d, g.value(weighted[n][0]));
        store_out(p, b * p.heads + h0 + hh, d + 1, g.value(weighted[n][1]));
      }
    }
  }
}

template <class QT>
__global__ void __launch_bounds__(Partial<QT>::kThreads, 1) partial_kernel(const Params<QT> p) {
  partial_tiles<QT, true>(p);
}

template <class QT>
__global__ void __launch_bounds__(Partial<QT>::kThreads, 1) partial_unaligned_kernel(const Params<QT> p) {
  partial_tiles<QT, false>(p);
}

// Whether every record of the source lies where partial_kernel's 16-byte loads may read it: value
// records sit at 576 x slot-in-page and scale records at 8-byte steps from a page, so a 16-byte
// aligned base and page stride make all of them aligned (a source without entries always is).
inline bool records_aligned(const Source& s) {
  return s.count == 0 || ((reinterpret_cast<uintptr_t>(s.cache) | static_cast<uintptr_t>(s.page_stride)) & 15) == 0;
}

template <class QT>
int Partial<QT>::run_on_cuda(const Params& p, void* stream) {
  if (p.batch == 0 || p.heads == 0) return 0;
  static_assert(Layout::kValueBytes % 16 == 0, "dsv4_attention: value records 16-byte aligned within a page");
  const bool aligned = records_aligned(p.main) && records_aligned(p.extra);
  constexpr size_t bytes = sizeof(Shared);
  const auto kernel = aligned ? partial_kernel<QT> : partial_unaligned_kernel<QT>;
  const int err = static_cast<int>(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (err != 0) return err;
  // Fewer heads per CTA while the CTAs still fit in one wave of an H200 (132 SMs; the split default
  // of jit_kernel/dsv4_attention.py aims at the same): at batch 1, top-k 512 (32 splits) 16 heads
  // per CTA give 128 CTAs instead of 32, each with a quarter of the products; at batch 64 (2
  // splits) 64 heads stay together, so each row is gathered once.
  Params launch_params = p;
  const int64_t rows = p.batch * p.num_splits;
  while (launch_params.head_group > 16 &&
         rows * ((p.heads + launch_params.head_group / 2 - 1) / (launch_params.head_group / 2)) <= kWaveCtas) {
    launch_params.head_group /= 2;
  }
  const int64_t groups = (p.heads + launch_params.head_group - 1) / launch_params.head_group;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(groups));
  return aligned ? launch_kernel<partial_kernel<QT>>(grid, kThreads, bytes, stream, launch_params)
                 : launch_kernel<partial_unaligned_kernel<QT>>(grid, kThreads, bytes, stream, launch_params);
}
#endif

}  // namespace sparsekv::dsv4_attention

#ifdef SPARSEKV_HOST_ENTRY
#include <tvm/ffi/optional.h>

#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_attention {

using tvm::ffi::Optional;

// Every entry of a host-readable index table is -1 or a slot of its cache.
inline void check_slots(const TensorView& indices, int64_t num_slots, const char* name) {
  const auto* base = static_cast<const int32_t*>(indices.data_ptr());
  for (int64_t b = 0; b < indices.size(0); ++b) {
    for (int64_t j = 0; j < indices.size(1); ++j) {
      const int32_t v = base[b * indices.stride(0) + j];
      if (v < -1 || v >= num_slots) {
        TVM_FFI_THROW(IndexError) << "sparsekv: argument `" << name << "`[" << b << ", " << j << "] = " << v
                                  << " is neither -1 nor a slot of its cache [0, " << num_slots << ")";
      }
    }
  }
}

inline Source make_source(const TensorView& cache, const char* cache_name, const TensorView& indices,
                          const char* indices_name, int64_t page_slots, const char* page_slots_name, int64_t batch,
                          const TensorView& device_of) {
  const int shift = check_page_slots(page_slots, page_slots_name);
  check(cache, cache_name).dtype<uint8_t>().ndim(2).rows_dense().same_device(device_of, "q");
  check(cache, cache_name).size(1, Layout::page_bytes(page_slots), "page_bytes(page_slots) of the 584 B V4 layout");
  check(indices, indices_name).dtype<int32_t>().ndim(2).rows_dense().same_device(device_of, "q");
  check(indices, indices_name).size(0, batch, "batch of q");
  const int64_t num_slots = checked_product(cache.size(0), page_slots, "pages x page_slots of the cache");
  if (num_slots > INT32_MAX) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << cache_name << "` holds " << num_slots
                              << " slots, more than int32 indices can name";
  }
  if (device_of.device().device_type != kDLCUDA) check_slots(indices, num_slots, indices_name);
  return Source{static_cast<const uint8_t*>(cache.data_ptr()),
                cache.stride(0),
                shift,
                num_slots,
                static_cast<const int32_t*>(indices.data_ptr()),
                indices.stride(0),
                indices.size(1)};
}

template <class QT>
void sparse_decode_attention(TensorView q, TensorView kv_cache, TensorView indices, TensorView sink, int64_t page_slots,
                             double softmax_scale, Optional<TensorView> extra_kv_cache,
                             Optional<TensorView> extra_indices, int64_t extra_page_slots, TensorView out,
                             TensorView lse, Optional<TensorView> part_out, Optional<TensorView> part_lse,
                             Optional<TensorView> part_arrivals, int64_t num_splits,
                             Optional<TensorView> topk_length) {
  // 1. Validate: memory, q, sink, outputs, both caches and their indices (host-readable indices in full).
  //    check_attention_arguments (jit_kernel/dsv4_attention.py) states the same checks, in this order and these
  //    words, for the Triton twin and FlashMLA; the op's header calls leave them to this entry.
  check_disjoint({read(q, "q"), read(kv_cache, "kv_cache"), read(indices, "indices"), read(sink, "sink"),
                  read(optional_arg(extra_kv_cache, "extra_kv_cache"), "extra_kv_cache"),
                  read(optional_arg(extra_indices, "extra_indices"), "extra_indices"),
                  read(optional_arg(topk_length, "topk_length"), "topk_length"), written(out, "out"),
                  written(lse, "lse"), written(optional_arg(part_out, "part_out"), "part_out"),
                  written(optional_arg(part_lse, "part_lse"), "part_lse"),
                  written(optional_arg(part_arrivals, "part_arrivals"), "part_arrivals")});
  constexpr DLDataType kBf16{kDLBfloat, 16, 1};
  check(q, "q").dtype(std::is_same_v<QT, float> ? dtype_of<float>() : kBf16).ndim(3).rows_dense();
  check(q, "q").size(2, kDim, "head dim").on_backend_device();
  const int64_t batch = q.size(0), heads = q.size(1);
  check(sink, "sink").dtype<float>().ndim(1).contiguous().same_device(q, "q");
  check(sink, "sink").size(0, heads, "heads of q");
  // A bf16 `out` is written by the combine, so only with num_splits > 1 (checked below).
  const bool out_bf16 = out.dtype() == kBf16;
  if (!out_bf16) check(out, "out").dtype<float>();
  check(out, "out").ndim(3).contiguous().same_device(q, "q");
  check(out, "out").size(0, batch, "batch").size(1, heads, "heads").size(2, kDim, "head dim");
  check(lse, "lse").dtype<float>().ndim(2).contiguous().same_device(q, "q");
  check(lse, "lse").size(0, batch, "batch").size(1, heads, "heads");
  if (!std::isfinite(softmax_scale)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `softmax_scale` must be finite, got " << softmax_scale;
  }
  if (extra_kv_cache.has_value() != extra_indices.has_value()) {
    TVM_FFI_THROW(ValueError) << "sparsekv: arguments `extra_kv_cache` and `extra_indices` go together: pass both "
                              << "or neither";
  }
  if (extra_kv_cache.has_value() != (extra_page_slots >= 0)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `extra_page_slots` is required exactly when `extra_kv_cache` is "
                              << "given";
  }
  Source main = make_source(kv_cache, "kv_cache", indices, "indices", page_slots, "page_slots", batch, q);
  if (topk_length.has_value()) {
    const TensorView lengths = topk_length.value();
    check(lengths, "topk_length").dtype<int32_t>().ndim(1).contiguous().same_device(q, "q");
    check(lengths, "topk_length").size(0, batch, "batch of q");
    main.lengths = static_cast<const int32_t*>(lengths.data_ptr());
    if (q.device().device_type != kDLCUDA) {
      for (int64_t b = 0; b < batch; ++b) check_range(main.lengths[b], 0, main.count, "topk_length");
    }
  }
  Source extra{nullptr, 0, 0, 0, nullptr, 0, 0};
  if (extra_kv_cache.has_value()) {
    extra = make_source(extra_kv_cache.value(), "extra_kv_cache", extra_indices.value(), "extra_indices",
                        extra_page_slots, "extra_page_slots", batch, q);
  }

  // 2. Derive the split: num_splits ranges of split_len entries of [indices | extra_indices].
  const int64_t total = main.count + extra.count;
  if (num_splits < 1 || num_splits > (total > 1 ? total : 1)) {
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `num_splits` must be in [1, max(1, K + K2) = "
                              << (total > 1 ? total : 1) << "], got " << num_splits;
  }
  const int64_t split_len = (total + num_splits - 1) / num_splits;
  if (out_bf16 && num_splits == 1) {
    TVM_FFI_THROW(TypeError) << "sparsekv: argument `out` is bfloat16, which the header writes only when "
                             << "num_splits > 1 (one split finishes in float32: pass a float32 `out`)";
  }
  float* part_out_ptr = nullptr;
  float* part_lse_ptr = nullptr;
  int* arrivals_ptr = nullptr;
  if (num_splits > 1) {
    if (!part_out.has_value() || !part_lse.has_value() || !part_arrivals.has_value()) {
      TVM_FFI_THROW(ValueError) << "sparsekv: arguments `part_out`, `part_lse` and `part_arrivals` are required when "
                                << "num_splits > 1";
    }
    const TensorView po = part_out.value(), pl = part_lse.value();
    check(po, "part_out").dtype<float>().ndim(4).contiguous().same_device(q, "q");
    check(po, "part_out").size(0, batch, "batch").size(1, num_splits, "num_splits").size(2, heads, "heads");
    check(po, "part_out").size(3, kDim, "head dim");
    check(pl, "part_lse").dtype<float>().ndim(3).contiguous().same_device(q, "q");
    check(pl, "part_lse").size(0, batch, "batch").size(1, num_splits, "num_splits").size(2, heads, "heads");
    part_out_ptr = static_cast<float*>(po.data_ptr());
    part_lse_ptr = static_cast<float*>(pl.data_ptr());
    // The arrival counters: zero before the call, and every call leaves them so (the last split of a
    // row resets its counter), so a zeroed buffer serves every later call and graph replay.
    const TensorView pa = part_arrivals.value();
    check(pa, "part_arrivals").dtype<int32_t>().ndim(3).contiguous().same_device(q, "q");
    check(pa, "part_arrivals").size(0, batch, "batch").size(1, arrival_groups(heads), "ceil(heads / 16)");
    check(pa, "part_arrivals").size(2, 2, "tickets and stores");
    arrivals_ptr = static_cast<int*>(pa.data_ptr());
    if (q.device().device_type != kDLCUDA) {
      for (int64_t i = 0; i < 2 * batch * arrival_groups(heads); ++i) {
        if (arrivals_ptr[i] != 0) {
          TVM_FFI_THROW(ValueError) << "sparsekv: argument `part_arrivals` must be all zero before a call (a "
                                    << "zeroed workspace stays zero: every call resets it), got " << arrivals_ptr[i]
                                    << " at flat index " << i;
        }
      }
    }
  }
  Params<QT> params{static_cast<const QT*>(q.data_ptr()),
                          q.stride(0),
                          q.stride(1),
                          main,
                          extra,
                          static_cast<const float*>(sink.data_ptr()),
                          static_cast<float>(softmax_scale),
                          batch,
                          heads,
                          num_splits,
                          split_len,
                          out_bf16 ? nullptr : static_cast<float*>(out.data_ptr()),
                          static_cast<float*>(lse.data_ptr()),
                          part_out_ptr,
                          part_lse_ptr};
  if (out_bf16) params.out_bf16 = static_cast<Bf16*>(out.data_ptr());
  params.arrivals = arrivals_ptr;
  if (batch == 0 || heads == 0) return;

  // 3. Launch on the caller's stream: the partial pass, then on the cpu backend the combine when
  //    split (on cuda and sim the partial pass's last CTA of each row combines it).
  launch<Partial<QT>>(params, q.device());
  if (num_splits > 1 && !(SPARSEKV_BACKEND_CUDA || SPARSEKV_BACKEND_SIM)) launch<Combine<QT>>(params, q.device());
}

}  // namespace sparsekv::dsv4_attention
#endif
