// entry_store: the last step of every kernel that stores compressed DSV4 entries (the fused store
// dsv4_store and the fused compress-store dsv4_compress_store): a float row held by a team
// (lane_reduce.h) is normalized, rotated, (Hadamard-transformed,) quantized and written into its
// paged cache slot. In namespace dsv4_store, whose cache kinds (V4, IndexerFp8, IndexerFp4) the
// instances of both families name.
//
// Contract, per entry n (row x of D floats, anchor position pos[n], token slot slots[n]):
//   x_c   = bf16(x_c)                                  (the compressor's bf16 cast)
//   ms    = (sum_c x_c^2) / D                          (team order, lane_reduce.h), inv = 1 / sqrt(ms + eps)
//   y_c   = bf16((x_c * inv) * weight_c)
//   RoPE on the trailing 64 dims (csrc/include/sparsekv/rope.h) from the model's float32 table
//   (rope_cos, rope_sin: [max_position, 32] each, what the model applies to its queries, so keys
//   and queries rotate by the same float32 angles):
//     c = rope_cos[pos, i], s = rope_sin[pos, i]
//     (y_2i, y_2i+1) <- (bf16(y_2i c - y_2i+1 s), bf16(y_2i s + y_2i+1 c))
//   An entry whose position is outside [0, max_position) is not stored (the host entries reject it
//   when the positions are host-readable).
//   main: store_v4(y) (csrc/include/sparsekv/row_store.h, the encoder dsv4_quant stores with).
//   Indexer: z = H y / sqrt(128) (H the 128-point Walsh-Hadamard matrix; butterflies of stride 1,
//   2, ..., 64, each (a, b) -> (a + b, a - b), then one multiply by 1/sqrt(128) rounded to float),
//   then store_indexer_fp8(z) or store_indexer_fp4(z).
// Every float operation is rounded as written on both backends (no FMA contraction; divide and
// sqrt correctly rounded IEEE float32 through team::div_rn / team::sqrt_rn, so inv is
// div_rn(1, sqrt_rn(ms + eps)), not an rsqrt), so the stored bytes are identical across backends
// and to a float32 torch reference that follows the same order. torch's own sqrt is not correctly
// rounded on every device (the CPU wheel's is one ulp off for about one float32 in six): the
// reference corrects it (sparsekv.testing.reference.dsv4_store.sqrt_rn).
#pragma once

#include <cstdint>

#include "sparsekv/fp8.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"
#include "sparsekv/rope.h"
#include "sparsekv/row_store.h"

namespace sparsekv::dsv4_store {

inline constexpr float kInvSqrt128 = 0.08838834764831845f;

enum class Cache { kV4, kIndexerFp8, kIndexerFp4 };

struct V4 {
  static constexpr Cache kCache = Cache::kV4;
  static constexpr int kDim = row_store::kDim;
  using Layout = kv_layout::V4;
};
struct IndexerFp8 {
  static constexpr Cache kCache = Cache::kIndexerFp8;
  static constexpr int kDim = row_store::kIndexerDim;
  using Layout = kv_layout::IndexerFp8;
};
struct IndexerFp4 {
  static constexpr Cache kCache = Cache::kIndexerFp4;
  static constexpr int kDim = row_store::kIndexerDim;
  using Layout = kv_layout::IndexerFp4;
};

struct StoreParams {
  const float* x;  // [N, D], row stride x_stride
  int64_t x_stride;
  const float* weight;  // [D]
  const int64_t* positions;
  const int64_t* slots;
  uint8_t* cache;
  int64_t num_entries;
  int64_t page_slots;
  int64_t page_stride;
  int64_t num_slots;
  float eps;
  const float* rope_cos;  // [rope_positions, rope::kPairs]
  const float* rope_sin;
  int64_t rope_positions;
};

template <class Kind>
struct EntryStore {
  static constexpr int kDim = Kind::kDim;
  using Row = team::Row<kDim>;

  SPARSEKV_HOST_DEVICE static void norm(Row& x, const StoreParams& p, Lanes lanes) {
    team::Share partial;
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      partial.v[j] = 0.0f;
      for (int k = 0; k < Row::kPerLane; ++k) partial.v[j] = team::add_rn(partial.v[j], team::mul_rn(x.v[j][k], x.v[j][k]));
    }
    const float ms = team::div_rn(team::sum(partial), static_cast<float>(kDim));
    const float inv = team::div_rn(1.0f, team::sqrt_rn(team::add_rn(ms, p.eps)));
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 0; k < Row::kPerLane; ++k) {
        const float y = team::mul_rn(team::mul_rn(x.v[j][k], inv), p.weight[Row::channel(lanes, j, k)]);
        x.v[j][k] = fp8::round_bf16(y);
      }
    }
  }

  // 128-point Walsh-Hadamard transform, strides 1 .. 64, then the 1/sqrt(128) scale.
  SPARSEKV_HOST_DEVICE static void hadamard(Row& x, Lanes lanes) {
    for (int h = 1; h < kDim; h *= 2) {
      if (h < team::kTeamLanes) {
        for (int k = 0; k < Row::kPerLane; ++k) {
          team::Share own;
          for (int j = 0; j < team::kVirtualPerThread; ++j) own.v[j] = x.v[j][k];
          const team::Share partner = team::exchange(own, h);
          for (int j = 0; j < team::kVirtualPerThread; ++j) {
            const bool high = (Row::channel(lanes, j, k) & h) != 0;
            x.v[j][k] = high ? team::sub_rn(partner.v[j], own.v[j]) : team::add_rn(own.v[j], partner.v[j]);
          }
        }
      } else {
        const int step = h / team::kTeamLanes;
        for (int j = 0; j < team::kVirtualPerThread; ++j) {
          for (int k = 0; k < Row::kPerLane; ++k) {
            if (k & step) continue;
            const float a = x.v[j][k], b = x.v[j][k + step];
            x.v[j][k] = team::add_rn(a, b);
            x.v[j][k + step] = team::sub_rn(a, b);
          }
        }
      }
    }
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 0; k < Row::kPerLane; ++k) x.v[j][k] = team::mul_rn(x.v[j][k], kInvSqrt128);
    }
  }

  // Rounds a loaded row to bf16, then norm, RoPE, (Hadamard,) quantize and store into slot `slot`.
  SPARSEKV_HOST_DEVICE static void finish(Row& x, const StoreParams& p, int64_t pos, int64_t slot, Lanes lanes) {
    if (pos < 0 || pos >= p.rope_positions) return;  // no angle for it in the table: not stored
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 0; k < Row::kPerLane; ++k) x.v[j][k] = fp8::round_bf16(x.v[j][k]);
    }
    norm(x, p, lanes);
    rope::rotate_tail<kDim>(x, p.rope_cos, p.rope_sin, pos, lanes);
    const auto token_of = [&p, slot] {
      return row_store::token_bytes<typename Kind::Layout>(p.cache, slot, p.page_slots, p.page_stride);
    };
    if constexpr (Kind::kCache == Cache::kV4) {
      row_store::store_v4(x, token_of, lanes);
    } else {
      hadamard(x, lanes);
      if constexpr (Kind::kCache == Cache::kIndexerFp8) {
        row_store::store_indexer_fp8(x, token_of, lanes);
      } else {
        row_store::store_indexer_fp4(x, token_of, lanes);
      }
    }
  }
};

}  // namespace sparsekv::dsv4_store

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_store {

// Validates the store arguments for `entries` rows and returns the store parameters (x unset).
template <class Kind>
StoreParams check_store(int64_t entries, TensorView weight, double eps, TensorView positions, TensorView cache,
                        TensorView slots, int64_t page_slots, TensorView rope_cos, TensorView rope_sin,
                        bool read_slots = true) {
  check(weight, "weight").dtype<float>().ndim(1).size(0, Kind::kDim, "head dim").contiguous();
  check(weight, "weight").same_device(cache, "cache");
  check(positions, "positions").dtype<int64_t>().ndim(1).contiguous().size(0, entries, "entries");
  check(positions, "positions").same_device(cache, "cache");
  check(slots, "slots").ndim(1).size(0, entries, "entries");
  rope::check_tables(rope_cos, rope_sin, cache, "cache");
  if (read_slots && positions.device().device_type != kDLCUDA) {  // positions are the entries' own
    const auto* pos = static_cast<const int64_t*>(positions.data_ptr());
    for (int64_t n = 0; n < entries; ++n) rope::check_position(pos[n], n, rope_cos.size(0), "positions");
  }
  if (!(eps >= 0.0)) TVM_FFI_THROW(ValueError) << "sparsekv: argument `eps` must be >= 0, got " << eps;
  const auto [page_stride, num_slots] =
      row_store::check_paged_cache<typename Kind::Layout>(cache, slots, page_slots, true, read_slots);
  StoreParams params{nullptr,
                     0,
                     static_cast<const float*>(weight.data_ptr()),
                     static_cast<const int64_t*>(positions.data_ptr()),
                     static_cast<const int64_t*>(slots.data_ptr()),
                     static_cast<uint8_t*>(cache.data_ptr()),
                     entries,
                     page_slots,
                     page_stride,
                     num_slots,
                     static_cast<float>(eps),
                     static_cast<const float*>(rope_cos.data_ptr()),
                     static_cast<const float*>(rope_sin.data_ptr()),
                     rope_cos.size(0)};
  return params;
}

}  // namespace sparsekv::dsv4_store
#endif
