// dsv4_quant: the DSV4 "fp8_ds_mla" token quantizer and dequantizer (584 B V4 layout), and the
// per-row FP8 / FP4 encoders of the indexer caches, shared with the fused norm + RoPE + store
// (csrc/dsv4_store.cuh).
//
// Contract (V4, x a 512-wide row, written into token slot s of a paged [pages, page_bytes] cache):
//   dims 0-447, 7 blocks of 64: a = max(amax over the block (float32), 1e-4); e = the smallest
//     integer with 448 * 2^e >= a; value byte = e4m3 round-to-nearest-even of x / 2^e (saturating
//     at +-448); scale byte = e + 127. A float32 x is quantized from its own value (no bf16 step).
//   dims 448-511: bf16 (round to nearest even), little-endian.
//   scale record: the 7 scale bytes, then one zero pad byte.
// Dequantize: e4m3 * 2^(byte - 127) for dims 0-447, the bf16 values for 448-511.
//
// Indexer rows (128 wide):
//   IndexerFp8 (132 B): one fp32 scale s = max(amax, 1e-4f) / 448 (not rounded to a power of two);
//     value byte i = e4m3(x_i / s). Both are IEEE float32 divisions rounded to nearest even
//     (team::div_rn), never a multiply by a rounded reciprocal: amax * float(1 / 448) differs from
//     amax / 448 in the last bit for about half of all amax, and x * (1 / s) from x / s likewise.
//   IndexerFp4 (68 B): 4 blocks of 32: a = max(amax, 6 * 2^-126), e the smallest integer with
//     6 * 2^e >= a; code = e2m1 round-to-nearest-even of x / 2^e, two codes per byte (even element
//     in the low nibble); scale byte = e + 127.
//   quantize_indexer_fp8 / _fp4 store keys as given (no norm, no RoPE, no Hadamard); the fused store
//   (dsv4_store.cuh) calls the same row encoders on its normalized, rotated rows.
//
// Safety: a slot outside [0, num_slots) is skipped by the kernel; the host entry rejects such
// slots and duplicated slots before any byte is written when the slots are host-readable.
// GPU: one warp per token through the team helpers (csrc/include/sparsekv/team.h).
#pragma once

#include "sparsekv/fp8.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/portability.h"
#include "sparsekv/lane_reduce.h"

namespace sparsekv::dsv4_quant {

inline constexpr int kDim = 512;
inline constexpr int kNopeDims = 448;
inline constexpr int kBlock = 64;
inline constexpr int kBlocks = kNopeDims / kBlock;
inline constexpr float kFp8AmaxFloor = 1e-4f;
inline constexpr int kIndexerDim = 128;
inline constexpr int kFp4Block = 32;

using V4 = kv_layout::V4;
using IndexerFp8 = kv_layout::IndexerFp8;
using IndexerFp4 = kv_layout::IndexerFp4;
static_assert(V4::kValueBytes == kNopeDims + 2 * (kDim - kNopeDims), "dsv4_quant: V4 value record is 448 + 128 B");
static_assert(V4::kScaleBytes == kBlocks + 1, "dsv4_quant: V4 scale record is 7 scales + 1 pad");
static_assert(IndexerFp8::kValueBytes == kIndexerDim && IndexerFp8::kScaleBytes == 4, "dsv4_quant: 132 B indexer");
static_assert(IndexerFp4::kValueBytes == kIndexerDim / 2 && IndexerFp4::kScaleBytes == kIndexerDim / kFp4Block,
              "dsv4_quant: 68 B indexer");

// Byte address of a slot's value and scale records in a paged buffer (page_size a power of two
// checked by the host entry; page_stride in bytes).
template <class L>
SPARSEKV_HOST_DEVICE kv_layout::TokenBytes<uint8_t> token_bytes(uint8_t* cache, int64_t slot, int64_t page_size,
                                                                int64_t page_stride) {
  const int64_t page = slot / page_size;
  const int64_t in_page = slot - page * page_size;
  uint8_t* base = cache + page * page_stride;
  return {base + L::value_offset(in_page), base + L::scale_offset(in_page, page_size)};
}

SPARSEKV_HOST_DEVICE void store_bf16(uint8_t* dst, float x) {
  const uint16_t b = fp8::float_to_bf16(x);
  dst[0] = static_cast<uint8_t>(b & 0xffu);
  dst[1] = static_cast<uint8_t>(b >> 8);
}

SPARSEKV_HOST_DEVICE float load_bf16(const uint8_t* src) {
  return fp8::bf16_to_float(static_cast<uint16_t>(src[0] | (src[1] << 8)));
}

// Writes a 512-wide row held by a team into one V4 token.
SPARSEKV_HOST_DEVICE void store_v4(const team::Row<kDim>& x, kv_layout::TokenBytes<uint8_t> token, Lanes lanes) {
  using Row = team::Row<kDim>;
  for (int b = 0; b < kBlocks; ++b) {
    team::Share partial;
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      const float a0 = x.v[j][2 * b] < 0 ? -x.v[j][2 * b] : x.v[j][2 * b];
      const float a1 = x.v[j][2 * b + 1] < 0 ? -x.v[j][2 * b + 1] : x.v[j][2 * b + 1];
      partial.v[j] = a0 > a1 ? a0 : a1;
    }
    float amax = team::max(partial);
    amax = amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor;
    const int e = fp8::ceil_scale_exponent(amax, fp8::kE4m3Max);
    const float inv_scale = fp8::exp2_int(-e);  // exact: x * 2^-e rounds like x / 2^e
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      for (int k = 2 * b; k < 2 * b + 2; ++k) {
        token.value[Row::channel(lanes, j, k)] = fp8::float_to_e4m3(team::mul_rn(x.v[j][k], inv_scale));
      }
      if (lanes.lane + j == 0) token.scale[b] = static_cast<uint8_t>(e + 127);
    }
  }
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    for (int k = kNopeDims / team::kTeamLanes; k < Row::kPerLane; ++k) {
      const int c = Row::channel(lanes, j, k);
      store_bf16(token.value + kNopeDims + 2 * (c - kNopeDims), x.v[j][k]);
    }
    if (lanes.lane + j == 0) token.scale[kBlocks] = 0;
  }
}

// Writes a 128-wide row held by a team into one IndexerFp8 token.
SPARSEKV_HOST_DEVICE void store_indexer_fp8(const team::Row<kIndexerDim>& x, kv_layout::TokenBytes<uint8_t> token,
                                            Lanes lanes) {
  using Row = team::Row<kIndexerDim>;
  team::Share partial;
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    partial.v[j] = 0.0f;
    for (int k = 0; k < Row::kPerLane; ++k) {
      const float a = x.v[j][k] < 0 ? -x.v[j][k] : x.v[j][k];
      partial.v[j] = partial.v[j] > a ? partial.v[j] : a;
    }
  }
  float amax = team::max(partial);
  amax = amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor;
  const float scale = team::div_rn(amax, fp8::kE4m3Max);  // a true division, not amax * (1 / 448)
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    for (int k = 0; k < Row::kPerLane; ++k) {
      token.value[Row::channel(lanes, j, k)] = fp8::float_to_e4m3(team::div_rn(x.v[j][k], scale));
    }
    if (lanes.lane + j == 0) {
      const uint32_t bits = fp8::float_bits(scale);
      for (int byte = 0; byte < 4; ++byte) token.scale[byte] = static_cast<uint8_t>(bits >> (8 * byte));
    }
  }
}

// Writes a 128-wide row held by a team into one IndexerFp4 token. Block b is k == b (32 channels,
// one per virtual lane); the even channel's lane packs its odd neighbour's code into the high nibble.
SPARSEKV_HOST_DEVICE void store_indexer_fp4(const team::Row<kIndexerDim>& x, kv_layout::TokenBytes<uint8_t> token,
                                            Lanes lanes) {
  using Row = team::Row<kIndexerDim>;
  constexpr float kFloor = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126
  for (int k = 0; k < Row::kPerLane; ++k) {
    team::Share partial;
    for (int j = 0; j < team::kVirtualPerThread; ++j) partial.v[j] = x.v[j][k] < 0 ? -x.v[j][k] : x.v[j][k];
    float amax = team::max(partial);
    amax = amax > kFloor ? amax : kFloor;
    const int e = fp8::ceil_scale_exponent(amax, fp8::kE2m1Max);
    const float inv_scale = fp8::exp2_int(-e);
    team::Share code;
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      code.v[j] = static_cast<float>(fp8::float_to_e2m1(team::mul_rn(x.v[j][k], inv_scale)));
    }
    const team::Share neighbour = team::exchange(code, 1);
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      const int c = Row::channel(lanes, j, k);
      if ((c & 1) == 0) {
        token.value[c / 2] = static_cast<uint8_t>(static_cast<int>(code.v[j]) | (static_cast<int>(neighbour.v[j]) << 4));
      }
      if (lanes.lane + j == 0) token.scale[k] = static_cast<uint8_t>(e + 127);
    }
  }
}

struct QuantizeParams {
  const void* x;
  int64_t x_row_stride;  // elements
  const int64_t* slots;
  uint8_t* cache;
  int64_t num_tokens;
  int64_t page_size;
  int64_t page_stride;  // bytes
  int64_t num_slots;    // pages * page_size
};

// Row i of the quantizer input, held by a team. InT: float or uint16_t (bf16 bits, widened exactly).
template <int D, class InT>
SPARSEKV_HOST_DEVICE team::Row<D> load_row(const QuantizeParams& p, int64_t i, Lanes lanes) {
  const InT* row = static_cast<const InT*>(p.x) + i * p.x_row_stride;
  team::Row<D> x;
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    for (int k = 0; k < team::Row<D>::kPerLane; ++k) {
      const InT v = row[team::Row<D>::channel(lanes, j, k)];
      if constexpr (std::is_same_v<InT, float>) {
        x.v[j][k] = v;
      } else {
        x.v[j][k] = fp8::bf16_to_float(v);
      }
    }
  }
  return x;
}

// Rows into tokens of layout L: V4 (fp8_ds_mla, 512 wide), or IndexerFp8 (132 B) / IndexerFp4 (68 B)
// for 128-wide indexer keys as given (no norm, no RoPE, no Hadamard: the bytes the fused store writes
// for its rotated row). InT: float or uint16_t (bf16 bits).
template <class L, class InT>
struct QuantizeRows {
  static_assert(std::is_same_v<L, V4> || std::is_same_v<L, IndexerFp8> || std::is_same_v<L, IndexerFp4>,
                "dsv4_quant: a V4 or indexer layout");
  static_assert(std::is_same_v<InT, float> || std::is_same_v<InT, uint16_t>, "dsv4_quant: input is float or bf16");
  using Params = QuantizeParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_tokens; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t slot = p.slots[i];
    if (slot < 0 || slot >= p.num_slots) return;
    const auto token = token_bytes<L>(p.cache, slot, p.page_size, p.page_stride);
    if constexpr (std::is_same_v<L, V4>) {
      store_v4(load_row<kDim, InT>(p, i, lanes), token, lanes);
    } else if constexpr (std::is_same_v<L, IndexerFp8>) {
      store_indexer_fp8(load_row<kIndexerDim, InT>(p, i, lanes), token, lanes);
    } else {
      store_indexer_fp4(load_row<kIndexerDim, InT>(p, i, lanes), token, lanes);
    }
  }
};

template <class InT>
using QuantizeFp8DsMla = QuantizeRows<V4, InT>;

struct DequantizeParams {
  const uint8_t* cache;
  const int64_t* slots;
  float* out;
  int64_t num_tokens;
  int64_t page_size;
  int64_t page_stride;
  int64_t num_slots;
};

// Rows of out for slots outside [0, num_slots) are left as they are (the host entry rejects them).
struct DequantizeFp8DsMla {
  using Params = DequantizeParams;

  SPARSEKV_HOST_DEVICE static int64_t num_items(const Params& p) { return p.num_tokens; }

  SPARSEKV_HOST_DEVICE static void item(const Params& p, int64_t i, Lanes lanes) {
    const int64_t slot = p.slots[i];
    if (slot < 0 || slot >= p.num_slots) return;
    const auto token = token_bytes<V4>(const_cast<uint8_t*>(p.cache), slot, p.page_size, p.page_stride);
    float* row = p.out + i * kDim;
    for (int c = lanes.lane; c < kNopeDims; c += lanes.count) {
      row[c] = fp8::e4m3_to_float(token.value[c]) * fp8::ue8m0_to_float(token.scale[c / kBlock]);
    }
    for (int c = kNopeDims + lanes.lane; c < kDim; c += lanes.count) {
      row[c] = load_bf16(token.value + kNopeDims + 2 * (c - kNopeDims));
    }
  }
};

}  // namespace sparsekv::dsv4_quant

#ifdef SPARSEKV_HOST_ENTRY
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::dsv4_quant {

// Every slot in [0, num_slots) and no slot twice (a bitmap: one pass, no sort).
inline void check_unique_slots(const int64_t* slots, int64_t n, int64_t num_slots, const char* name) {
  check_indices_in_range(slots, n, num_slots, name);
  std::vector<bool> seen(static_cast<size_t>(num_slots), false);
  for (int64_t i = 0; i < n; ++i) {
    if (seen[static_cast<size_t>(slots[i])]) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `" << name << "` names slot " << slots[i]
                                << " twice (second time at position " << i << "); slots must be unique";
    }
    seen[static_cast<size_t>(slots[i])] = true;
  }
}

// Validates a paged cache of layout L and its slots; returns (page_stride, num_slots).
template <class L>
std::pair<int64_t, int64_t> check_paged_cache(TensorView cache, TensorView slots, int64_t page_size,
                                              bool unique_slots, bool read_slots = true) {
  check_page_size(page_size, "page_size");
  check(cache, "cache").dtype<uint8_t>().ndim(2).rows_dense().on_backend_device();
  check(cache, "cache").size(1, L::page_bytes(page_size), "page bytes for page_size");
  check(slots, "slots").dtype<int64_t>().ndim(1).contiguous().same_device(cache, "cache");
  const int64_t num_slots = checked_product(cache.size(0), page_size, "argument `cache`: pages x page_size");
  if (cache.device().device_type != kDLCUDA && read_slots) {
    const auto* s = static_cast<const int64_t*>(slots.data_ptr());
    if (unique_slots) {
      check_unique_slots(s, slots.size(0), num_slots, "slots");
    } else {
      check_indices_in_range(s, slots.size(0), num_slots, "slots");
    }
  }
  return {cache.stride(0), num_slots};
}

// Validates a quantizer call (float32 or bf16 rows of width D into unique slots of a paged cache of
// layout L); returns its parameters and whether the rows are float32.
template <class L, int D>
std::pair<QuantizeParams, bool> check_quantize(TensorView x, TensorView cache, TensorView slots, int64_t page_size) {
  check_disjoint({read(x, "x"), written(cache, "cache"), read(slots, "slots")});
  const bool is_float = x.dtype() == dtype_of<float>();
  if (!is_float && !(x.dtype() == DLDataType{kDLBfloat, 16, 1})) {
    TVM_FFI_THROW(TypeError) << "sparsekv: argument `x` must have dtype float32 or bfloat16, got "
                             << dtype_name(x.dtype());
  }
  check(x, "x").ndim(2).size(1, D, "head dim").rows_dense().same_device(cache, "cache");
  check(slots, "slots").ndim(1).size(0, x.size(0), "rows of x");
  const auto [page_stride, num_slots] = check_paged_cache<L>(cache, slots, page_size, true);
  return {QuantizeParams{x.data_ptr(), x.stride(0), static_cast<const int64_t*>(slots.data_ptr()),
                         static_cast<uint8_t*>(cache.data_ptr()), x.size(0), page_size, page_stride, num_slots},
          is_float};
}

inline void quantize_fp8_ds_mla(TensorView x, TensorView cache, TensorView slots, int64_t page_size) {
  // 1. Validate (memory first: the slot checks read `slots`) and derive sizes.
  const auto [params, is_float] = check_quantize<V4, kDim>(x, cache, slots, page_size);
  if (params.num_tokens == 0) return;

  // 2. Launch.
  if (is_float) {
    launch<QuantizeFp8DsMla<float>>(params, cache.device());
  } else {
    launch<QuantizeFp8DsMla<uint16_t>>(params, cache.device());
  }
}

// Plain indexer keys (no norm, no RoPE) into an IndexerFp8 or IndexerFp4 cache.
template <class L>
void quantize_indexer(TensorView x, TensorView cache, TensorView slots, int64_t page_size) {
  // 1. Validate (memory first: the slot checks read `slots`) and derive sizes.
  const auto [params, is_float] = check_quantize<L, kIndexerDim>(x, cache, slots, page_size);
  if (params.num_tokens == 0) return;

  // 2. Launch.
  if (is_float) {
    launch<QuantizeRows<L, float>>(params, cache.device());
  } else {
    launch<QuantizeRows<L, uint16_t>>(params, cache.device());
  }
}

inline void quantize_indexer_fp8(TensorView x, TensorView cache, TensorView slots, int64_t page_size) {
  quantize_indexer<IndexerFp8>(x, cache, slots, page_size);
}

inline void quantize_indexer_fp4(TensorView x, TensorView cache, TensorView slots, int64_t page_size) {
  quantize_indexer<IndexerFp4>(x, cache, slots, page_size);
}

inline void dequantize_fp8_ds_mla(TensorView cache, TensorView slots, int64_t page_size, TensorView out) {
  // 1. Validate.
  check_disjoint({read(cache, "cache"), read(slots, "slots"), written(out, "out")});
  const auto [page_stride, num_slots] = check_paged_cache<V4>(cache, slots, page_size, false);
  check(out, "out").dtype<float>().ndim(2).contiguous().same_device(cache, "cache");
  check(out, "out").size(0, slots.size(0), "length of slots").size(1, kDim, "head dim");

  // 2. Derive sizes and launch.
  const DequantizeParams params{static_cast<const uint8_t*>(cache.data_ptr()),
                                static_cast<const int64_t*>(slots.data_ptr()),
                                static_cast<float*>(out.data_ptr()),
                                slots.size(0),
                                page_size,
                                page_stride,
                                num_slots};
  if (params.num_tokens == 0) return;
  launch<DequantizeFp8DsMla>(params, cache.device());
}

}  // namespace sparsekv::dsv4_quant
#endif
