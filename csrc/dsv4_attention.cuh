// dsv4_attention: sparse MQA decode attention over paged fp8_ds_mla (V4, 584 B) caches, with a
// per-head sink logit and an optional second ("extra") cache, split-KV with a separate combine.
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
// workspace is written.
//
// Split-KV. The concatenated list [indices[b] | extra_indices[b]] is cut into num_splits ranges of
// split_len entries. Each (b, split, h) keeps an online softmax state (m = running max, l = sum of
// exp(l_j - m), acc = sum of exp(l_j - m) kv_j). With one split the state is finished in place; with
// several, split s stores lse_s = m + log l (-inf when empty) and o_s = acc / l (0 when empty), and
// Combine merges them: M = max_s lse_s, L = sum_s exp(lse_s - M),
//   out = sum_s exp(lse_s - M) o_s / (L + exp(sink - M)),  lse = M + log L.
// The combine is the same item() on both backends.
//
// Launch shapes. cpu: one (b, split) per item, all heads at once (a row is dequantized once per
// entry, rows go 8 at a time), sequential. cuda: one block of 256 threads per (b, split, group of
// 8 heads): warps dequantize a tile of 8 rows into shared memory, compute the 64 logits of the
// tile, and every thread updates the accumulators of 2 dims x 8 heads; then Combine, one warp per
// (b, h).
#pragma once

#include <cmath>
#include <vector>

#include "sparsekv/fp8.h"
#include "sparsekv/host_simd.h"
#include "sparsekv/kv_layout.h"
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
  float* out;       // [batch, heads, 512] contiguous
  float* lse;       // [batch, heads] contiguous
  float* part_out;  // [batch, num_splits, heads, 512] contiguous (num_splits > 1)
  float* part_lse;  // [batch, num_splits, heads]
};

// Entry j of the concatenated list [main | extra] of row b.
template <class QT>
SPARSEKV_HOST_DEVICE bool entry(const Params<QT>& p, int64_t b, int64_t j, const uint8_t** value,
                                const uint8_t** scale) {
  return j < p.main.count ? resolve(p.main, b, j, value, scale) : resolve(p.extra, b, j - p.main.count, value, scale);
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

// ---------------------------------------------------------------------------------------------
// Combine: one (b, h) per item, lanes over the 512 dims.
template <class QT>
struct Combine {
  using Params = dsv4_attention::Params<QT>;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.batch * p.heads; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t b = i / p.heads;
    const int64_t h = i - b * p.heads;
    const float* part_lse = p.part_lse + b * p.num_splits * p.heads + h;
    float m = -INFINITY;
    bool nan = false;  // fmaxf skips NaN: a NaN split is looked for separately and carried through
    for (int64_t s = 0; s < p.num_splits; ++s) {
      m = fmaxf(m, part_lse[s * p.heads]);
      nan = nan || part_lse[s * p.heads] != part_lse[s * p.heads];
    }
    float* out = p.out + i * kDim;
    if (nan) {
      for (int d = lanes.lane; d < kDim; d += lanes.count) out[d] = NAN;
      if (lanes.lane == 0) p.lse[i] = NAN;
      return;
    }
    if (m == -INFINITY) {
      for (int d = lanes.lane; d < kDim; d += lanes.count) out[d] = 0.0f;
      if (lanes.lane == 0) p.lse[i] = INFINITY;
      return;
    }
    float total = 0.0f;
    for (int64_t s = 0; s < p.num_splits; ++s) total += safe_exp(part_lse[s * p.heads] - m);
    const float denominator = total + safe_exp(p.sink[h] - m);
    for (int d = lanes.lane; d < kDim; d += lanes.count) {
      float acc = 0.0f;
      for (int64_t s = 0; s < p.num_splits; ++s) {
        const float w = safe_exp(part_lse[s * p.heads] - m);
        if (w > 0.0f) acc += w * p.part_out[((b * p.num_splits + s) * p.heads + h) * kDim + d];
      }
      out[d] = acc / denominator;
    }
    if (lanes.lane == 0) p.lse[i] = m + logf(total);
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
  static constexpr int kHeadsPerBlock = 8;
  static constexpr int kTile = 8;  // rows per tile: one per warp
  static constexpr int kDimsPerThread = kDim / kThreads;
  static_assert(kTile == kThreads / kWarpSize, "dsv4_attention: one tile row per warp");
  static int run_on_cuda(const Params& p, void* stream);
#endif
};

#ifdef __CUDACC__
template <class QT>
__global__ void __launch_bounds__(Partial<QT>::kThreads) partial_kernel(const Params<QT> p) {
  using K = Partial<QT>;
  constexpr int G = K::kHeadsPerBlock, T = K::kTile, D = K::kDimsPerThread;
  __shared__ float q_s[G][kDim];
  __shared__ float kv_s[T][kDim];
  __shared__ float logit_s[G][T];
  __shared__ bool valid_s[T];
  const int64_t b = blockIdx.x / p.num_splits;
  const int64_t s = blockIdx.x - b * p.num_splits;
  const int64_t h0 = static_cast<int64_t>(blockIdx.y) * G;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;

  for (int k = tid; k < G * kDim; k += K::kThreads) {
    const int g = k / kDim, d = k % kDim;
    q_s[g][d] = h0 + g < p.heads ? load_q(p.q + b * p.q_stride_b + (h0 + g) * p.q_stride_h + d) : 0.0f;
  }
  float m[G], l[G], acc[G][D];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int k = 0; k < D; ++k) acc[g][k] = 0.0f;
  }
  const int64_t first = s * p.split_len;
  const int64_t total = total_entries(p);
  const int64_t last = first + p.split_len < total ? first + p.split_len : total;
  for (int64_t j0 = first; j0 < last; j0 += T) {
    // 1. One row per warp into shared memory; invalid rows get logit -inf.
    const int64_t j = j0 + warp;
    const uint8_t *value = nullptr, *scale = nullptr;
    const bool valid = j < last && entry(p, b, j, &value, &scale);
    for (int d = lane; d < kDim; d += kWarpSize) kv_s[warp][d] = valid ? dequantize(value, scale, d) : 0.0f;
    if (lane == 0) valid_s[warp] = valid;
    __syncthreads();
    // 2. G x T logits, each a warp-wide dot product.
    for (int pair = warp; pair < G * T; pair += T) {
      const int g = pair / T, t = pair % T;
      float sum = 0.0f;
      for (int d = lane; d < kDim; d += kWarpSize) sum += q_s[g][d] * kv_s[t][d];
      for (int off = kWarpSize / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) logit_s[g][t] = valid_s[t] ? p.softmax_scale * sum : -INFINITY;
    }
    __syncthreads();
    // 3. Online softmax update of this thread's dims, for every head of the group.
    for (int g = 0; g < G; ++g) {
      float tile_max = -INFINITY;
      bool tile_nan = false;  // fmaxf skips NaN: a NaN logit must not read as an empty tile
      for (int t = 0; t < T; ++t) {
        tile_max = fmaxf(tile_max, logit_s[g][t]);
        tile_nan = tile_nan || logit_s[g][t] != logit_s[g][t];
      }
      const float m_new = fmaxf(m[g], tile_max);
      if (m_new == -INFINITY && !tile_nan) continue;
      const float c = safe_exp(m[g] - m_new);
      float w[T];
      float wsum = 0.0f;
      for (int t = 0; t < T; ++t) {
        w[t] = safe_exp(logit_s[g][t] - m_new);
        wsum += w[t];
      }
      l[g] = l[g] * c + wsum;
      for (int k = 0; k < D; ++k) {
        float a = acc[g][k] * c;
        for (int t = 0; t < T; ++t) a += w[t] * kv_s[t][tid + k * K::kThreads];
        acc[g][k] = a;
      }
      m[g] = m_new;
    }
    __syncthreads();
  }
  const bool single = p.num_splits == 1;
  for (int g = 0; g < G; ++g) {
    const int64_t h = h0 + g;
    if (h >= p.heads) break;
    const float factor = single ? finish_factor(m[g], l[g], p.sink[h]) : split_factor(l[g]);
    float* dst = single ? p.out + (b * p.heads + h) * kDim : p.part_out + ((b * p.num_splits + s) * p.heads + h) * kDim;
    for (int k = 0; k < D; ++k) dst[tid + k * K::kThreads] = acc[g][k] * factor;
    if (tid == 0) {
      if (single) {
        p.lse[b * p.heads + h] = finish_lse(m[g], l[g]);
      } else {
        p.part_lse[(b * p.num_splits + s) * p.heads + h] = split_lse(m[g], l[g]);
      }
    }
  }
}

template <class QT>
int Partial<QT>::run_on_cuda(const Params& p, void* stream) {
  if (p.batch == 0 || p.heads == 0) return 0;
  const dim3 grid(static_cast<unsigned>(p.batch * p.num_splits),
                  static_cast<unsigned>((p.heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
  return launch_kernel<partial_kernel<QT>>(grid, kThreads, 0, stream, p);
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
                             int64_t num_splits, Optional<TensorView> topk_length) {
  // 1. Validate: memory, q, sink, outputs, both caches and their indices (host-readable indices in full).
  //    The op runs the same checks, in this order and these words, as one Python contract for every
  //    implementation (check_attention_arguments, jit_kernel/dsv4_attention.py); these serve direct callers.
  check_disjoint({read(q, "q"), read(kv_cache, "kv_cache"), read(indices, "indices"), read(sink, "sink"),
                  read(optional_arg(extra_kv_cache, "extra_kv_cache"), "extra_kv_cache"),
                  read(optional_arg(extra_indices, "extra_indices"), "extra_indices"),
                  read(optional_arg(topk_length, "topk_length"), "topk_length"), written(out, "out"),
                  written(lse, "lse"), written(optional_arg(part_out, "part_out"), "part_out"),
                  written(optional_arg(part_lse, "part_lse"), "part_lse")});
  constexpr DLDataType kBf16{kDLBfloat, 16, 1};
  check(q, "q").dtype(std::is_same_v<QT, float> ? dtype_of<float>() : kBf16).ndim(3).rows_dense();
  check(q, "q").size(2, kDim, "head dim").on_backend_device();
  const int64_t batch = q.size(0), heads = q.size(1);
  check(sink, "sink").dtype<float>().ndim(1).contiguous().same_device(q, "q");
  check(sink, "sink").size(0, heads, "heads of q");
  check(out, "out").dtype<float>().ndim(3).contiguous().same_device(q, "q");
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
  float* part_out_ptr = nullptr;
  float* part_lse_ptr = nullptr;
  if (num_splits > 1) {
    if (!part_out.has_value() || !part_lse.has_value()) {
      TVM_FFI_THROW(ValueError) << "sparsekv: arguments `part_out` and `part_lse` are required when num_splits > 1";
    }
    const TensorView po = part_out.value(), pl = part_lse.value();
    check(po, "part_out").dtype<float>().ndim(4).contiguous().same_device(q, "q");
    check(po, "part_out").size(0, batch, "batch").size(1, num_splits, "num_splits").size(2, heads, "heads");
    check(po, "part_out").size(3, kDim, "head dim");
    check(pl, "part_lse").dtype<float>().ndim(3).contiguous().same_device(q, "q");
    check(pl, "part_lse").size(0, batch, "batch").size(1, num_splits, "num_splits").size(2, heads, "heads");
    part_out_ptr = static_cast<float*>(po.data_ptr());
    part_lse_ptr = static_cast<float*>(pl.data_ptr());
  }
  const Params<QT> params{static_cast<const QT*>(q.data_ptr()),
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
                          static_cast<float*>(out.data_ptr()),
                          static_cast<float*>(lse.data_ptr()),
                          part_out_ptr,
                          part_lse_ptr};
  if (batch == 0 || heads == 0) return;

  // 3. Launch on the caller's stream: the partial pass, then the combine when split.
  launch<Partial<QT>>(params, q.device());
  if (num_splits > 1) launch<Combine<QT>>(params, q.device());
}

}  // namespace sparsekv::dsv4_attention
#endif
