// row_store: one team row (lane_reduce.h) quantized into one token of a paged DSV4 cache, the
// building block of every kernel that writes those caches (the quantizer, the fused store, the
// fused compress-store).
//
// Encoders, x held by a team, written into token slot s of a paged [pages, page_bytes] cache:
//   store_v4 (512 wide, 584 B fp8_ds_mla V4):
//     dims 0-447, 7 blocks of 64: a = max(amax over the block (float32), 1e-4); e = the smallest
//       integer with 448 * 2^e >= a; value byte = e4m3 round-to-nearest-even of x / 2^e (saturating
//       at +-448; fp8::float_to_e4m3x2, the hardware convert on sm_89+); scale byte = e + 127.
//     dims 448-511: bf16 (round to nearest even), little-endian.
//     scale record: the 7 scale bytes, then one zero pad byte.
//   store_indexer_fp8 (128 wide, 132 B): one fp32 scale s = max(amax, 1e-4f) / 448 (not rounded to
//     a power of two); value byte i = e4m3(x_i / s). Both are IEEE float32 divisions rounded to
//     nearest even (team::div_rn), never a multiply by a rounded reciprocal: amax * float(1 / 448)
//     differs from amax / 448 in the last bit for about half of all amax, and x * (1 / s) from x / s
//     likewise.
//   store_indexer_fp4 (128 wide, 68 B): 4 blocks of 32: a = max(amax, 6 * 2^-126), e the smallest
//     integer with 6 * 2^e >= a; code = e2m1 round-to-nearest-even of x / 2^e, two codes per byte
//     (even element in the low nibble); scale byte = e + 127.
// Every encoder stages the token (the warp's shared memory on the GPU) and writes it in whole words:
// V4 as 16-byte words (write_v4), the indexer layouts as 16-byte words where the value record sits
// on a 16-byte boundary, else 4-byte words, and the scale as one 4-byte word (write_indexer).
// token_bytes addresses a slot's value and scale records (kv_layout.h). The host section checks a
// paged cache and its slots (every slot in the cache, optionally no slot twice).
#pragma once

#include <cstdint>
#include <cstring>

#include "sparsekv/fp8.h"
#include "sparsekv/kv_layout.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"

namespace sparsekv::row_store {

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
static_assert(V4::kValueBytes == kNopeDims + 2 * (kDim - kNopeDims), "row_store: V4 value record is 448 + 128 B");
static_assert(V4::kScaleBytes == kBlocks + 1, "row_store: V4 scale record is 7 scales + 1 pad");
static_assert(IndexerFp8::kValueBytes == kIndexerDim && IndexerFp8::kScaleBytes == 4, "row_store: 132 B indexer");
static_assert(IndexerFp4::kValueBytes == kIndexerDim / 2 && IndexerFp4::kScaleBytes == kIndexerDim / kFp4Block,
              "row_store: 68 B indexer");

// Byte address of a slot's value and scale records in a paged buffer (page_slots a power of two
// checked by the host entry; page_stride in bytes).
template <class L>
SPARSEKV_HOST_DEVICE kv_layout::TokenBytes<uint8_t> token_bytes(uint8_t* cache, int64_t slot, int64_t page_slots,
                                                                int64_t page_stride) {
  const int64_t page = slot / page_slots;
  const int64_t in_page = slot - page * page_slots;
  uint8_t* base = cache + page * page_stride;
  return {base + L::value_offset(in_page), base + L::scale_offset(in_page, page_slots)};
}

SPARSEKV_HOST_DEVICE void store_bf16(uint8_t* dst, float x) {
  const uint16_t b = fp8::float_to_bf16(x);
  dst[0] = static_cast<uint8_t>(b & 0xffu);
  dst[1] = static_cast<uint8_t>(b >> 8);
}

SPARSEKV_HOST_DEVICE float load_bf16(const uint8_t* src) {
  return fp8::bf16_to_float(static_cast<uint16_t>(src[0] | (src[1] << 8)));
}

// One token of layout L (V4, IndexerFp8, IndexerFp4) as a team assembles it before writing it: the
// value record, then the scale record.
template <class L>
struct alignas(16) Staged {
  uint8_t value[L::kValueBytes];
  uint8_t scale[L::kScaleBytes];
};

// The host's write of a staged token (write_v4, write_indexer): its two records, one memcpy each.
template <class L>
inline void copy_staged(const Staged<L>& staged, kv_layout::TokenBytes<uint8_t> token) {
  std::memcpy(token.value, staged.value, sizeof(staged.value));
  std::memcpy(token.scale, staged.scale, sizeof(staged.scale));
}

// Writes a staged V4 token whole. GPU: the warp's lanes read the stage back in 16-byte words and
// write the 576-byte value record as 36 STG.128 (lane l words l and l + 32) and the 8-byte scale
// record as one STG.64 (lane 4, idle in the second round); both records sit on such boundaries
// (a page is a multiple of 576 B, the cache 16-byte aligned: check_paged_cache). Host: two memcpy.
SPARSEKV_HOST_DEVICE void write_v4(const Staged<V4>& staged, kv_layout::TokenBytes<uint8_t> token, Lanes lanes) {
#ifdef __CUDA_ARCH__
  constexpr int kWords = V4::kValueBytes / 16;
  static_assert(V4::kValueBytes % 16 == 0 && kWords <= 2 * team::kTeamLanes && V4::kScaleBytes == 8,
                "row_store: a V4 token is two rounds of 16-byte words and one 8-byte word");
  __syncwarp();  // every lane's bytes of the stage are in place
  const auto* from = reinterpret_cast<const int4*>(staged.value);
  auto* to = reinterpret_cast<int4*>(token.value);
  to[lanes.lane] = from[lanes.lane];
  if (lanes.lane < kWords - team::kTeamLanes) to[team::kTeamLanes + lanes.lane] = from[team::kTeamLanes + lanes.lane];
  if (lanes.lane == kWords - team::kTeamLanes) {
    *reinterpret_cast<uint2*>(token.scale) = *reinterpret_cast<const uint2*>(staged.scale);
  }
  __syncwarp();  // the stage is read before the warp's next token overwrites it
#else
  (void)lanes;
  copy_staged(staged, token);
#endif
}

// Writes a 512-wide row held by a team into one V4 token. The lanes quantize their channels into a
// stage (the warp's slot of shared memory on the GPU, 8 per 256-thread warp-per-item block; a local
// on the host), then write_v4 writes it in whole words: a lane's channels are 32 apart, so its own
// bytes never make a word (the 26 byte stores per lane this replaces). token_of() gives the token's
// TokenBytes, called only then: its pointers are not live across the quantization (on sm_100a the
// fused compress-store's 64 registers would otherwise spill).
template <class TokenOf>
SPARSEKV_HOST_DEVICE void store_v4(const team::Row<kDim>& x, TokenOf token_of, Lanes lanes) {
  using Row = team::Row<kDim>;
#ifdef __CUDA_ARCH__
  __shared__ Staged<V4> warp_stages[kWarpPerItemThreads / kWarpSize];
#ifdef SPARSEKV_SIM
  const unsigned thread = threadIdx.x;
#else
  // Read here, not hoisted out of the driver's item loop: kept live across the fused compress-store
  // it would be the register sm_100a lacks (an 8-byte spill).
  unsigned thread;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(thread));
#endif
  Staged<V4>& staged = warp_stages[thread / kWarpSize];
#else
  Staged<V4> staged;
#endif
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
      // The lane's two channels of the block, 32 apart: one pair convert, two bytes of the stage.
      const uint16_t codes = fp8::float_to_e4m3x2(team::mul_rn(x.v[j][2 * b], inv_scale),
                                                  team::mul_rn(x.v[j][2 * b + 1], inv_scale));
      staged.value[Row::channel(lanes, j, 2 * b)] = static_cast<uint8_t>(codes & 0xffu);
      staged.value[Row::channel(lanes, j, 2 * b + 1)] = static_cast<uint8_t>(codes >> 8);
      if (lanes.lane + j == 0) staged.scale[b] = static_cast<uint8_t>(e + 127);
    }
  }
  for (int j = 0; j < team::kVirtualPerThread; ++j) {
    for (int k = kNopeDims / team::kTeamLanes; k < Row::kPerLane; ++k) {
      const int c = Row::channel(lanes, j, k);
      store_bf16(staged.value + kNopeDims + 2 * (c - kNopeDims), x.v[j][k]);
    }
    if (lanes.lane + j == 0) staged.scale[kBlocks] = 0;
  }
  write_v4(staged, token_of(), lanes);
}

// Writes a staged indexer token whole. GPU: when the value record sits on a 16-byte boundary (an
// aligned cache whose page stride is a multiple of 16: FP8 pages from 4 slots up, FP4 from 4),
// lanes 0..W-1 write it as W 16-byte words (W = 8 for FP8's 128 B, 4 for FP4's 64 B); else lanes
// write it as 4-byte words (32 for FP8, 16 for FP4): the records of a cache on a 4-byte boundary
// (check_paged_cache) always sit on one. Lane 31 writes the scale record as one 4-byte word. Host:
// two memcpy.
template <class L>
SPARSEKV_HOST_DEVICE void write_indexer(const Staged<L>& staged, kv_layout::TokenBytes<uint8_t> token,
                                        Lanes lanes) {
#ifdef __CUDA_ARCH__
  constexpr int kWide = L::kValueBytes / 16;
  constexpr int kNarrow = L::kValueBytes / 4;
  static_assert(L::kValueBytes % 16 == 0 && kWide < team::kTeamLanes && kNarrow <= team::kTeamLanes &&
                    L::kScaleBytes == 4,
                "row_store: an indexer value record is at most 32 4-byte words, its scale one");
  __syncwarp();  // every lane's bytes of the stage are in place
  if (reinterpret_cast<uintptr_t>(token.value) % 16 == 0) {
    if (lanes.lane < kWide) {
      reinterpret_cast<int4*>(token.value)[lanes.lane] = reinterpret_cast<const int4*>(staged.value)[lanes.lane];
    }
  } else if (lanes.lane < kNarrow) {
    reinterpret_cast<uint32_t*>(token.value)[lanes.lane] = reinterpret_cast<const uint32_t*>(staged.value)[lanes.lane];
  }
  if (lanes.lane == team::kTeamLanes - 1) {
    *reinterpret_cast<uint32_t*>(token.scale) = *reinterpret_cast<const uint32_t*>(staged.scale);
  }
  __syncwarp();  // the stage is read before the warp's next token overwrites it
#else
  (void)lanes;
  copy_staged(staged, token);
#endif
}

#ifdef __CUDA_ARCH__
// The warp's slot of a stage in shared memory (8 per 256-thread warp-per-item block), one array per
// stage type.
template <class Stage>
SPARSEKV_DEVICE Stage& warp_stage() {
  __shared__ Stage stages[kWarpPerItemThreads / kWarpSize];
  return stages[threadIdx.x / kWarpSize];
}
#endif

// Writes a 128-wide row held by a team into one IndexerFp8 token, staged (write_indexer).
template <class TokenOf>
SPARSEKV_HOST_DEVICE void store_indexer_fp8(const team::Row<kIndexerDim>& x, TokenOf token_of, Lanes lanes) {
  using Row = team::Row<kIndexerDim>;
#ifdef __CUDA_ARCH__
  Staged<IndexerFp8>& staged = warp_stage<Staged<IndexerFp8>>();
#else
  Staged<IndexerFp8> staged;
#endif
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
    for (int k = 0; k < Row::kPerLane; k += 2) {
      const uint16_t codes = fp8::float_to_e4m3x2(team::div_rn(x.v[j][k], scale), team::div_rn(x.v[j][k + 1], scale));
      staged.value[Row::channel(lanes, j, k)] = static_cast<uint8_t>(codes & 0xffu);
      staged.value[Row::channel(lanes, j, k + 1)] = static_cast<uint8_t>(codes >> 8);
    }
    if (lanes.lane + j == 0) {
      const uint32_t bits = fp8::float_bits(scale);
      for (int byte = 0; byte < 4; ++byte) staged.scale[byte] = static_cast<uint8_t>(bits >> (8 * byte));
    }
  }
  write_indexer(staged, token_of(), lanes);
}

// Writes a 128-wide row held by a team into one IndexerFp4 token, staged (write_indexer). Block b
// is k == b (32 channels, one per virtual lane); the even channel's lane packs its odd neighbour's
// code into the high nibble.
template <class TokenOf>
SPARSEKV_HOST_DEVICE void store_indexer_fp4(const team::Row<kIndexerDim>& x, TokenOf token_of, Lanes lanes) {
  using Row = team::Row<kIndexerDim>;
  constexpr float kFloor = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126
#ifdef __CUDA_ARCH__
  Staged<IndexerFp4>& staged = warp_stage<Staged<IndexerFp4>>();
#else
  Staged<IndexerFp4> staged;
#endif
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
        staged.value[c / 2] = static_cast<uint8_t>(static_cast<int>(code.v[j]) | (static_cast<int>(neighbour.v[j]) << 4));
      }
      if (lanes.lane + j == 0) staged.scale[k] = static_cast<uint8_t>(e + 127);
    }
  }
  write_indexer(staged, token_of(), lanes);
}

}  // namespace sparsekv::row_store

#ifdef SPARSEKV_HOST_ENTRY
#include <type_traits>
#include <utility>
#include <vector>

#include "sparsekv/ffi.h"

namespace sparsekv::row_store {

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

// Validates a paged cache of layout L and its slots; returns (page_stride, num_slots). A writer of
// V4 tokens (unique_slots) also needs its pages 16-byte aligned (write_v4), a writer of indexer
// tokens its cache 4-byte aligned (write_indexer).
template <class L>
std::pair<int64_t, int64_t> check_paged_cache(TensorView cache, TensorView slots, int64_t page_slots,
                                              bool unique_slots, bool read_slots = true) {
  check_page_slots(page_slots, "page_slots");
  check(cache, "cache").dtype<uint8_t>().ndim(2).rows_dense().on_backend_device();
  check(cache, "cache").size(1, L::page_bytes(page_slots), "page bytes for page_slots");
  check(slots, "slots").dtype<int64_t>().ndim(1).contiguous().same_device(cache, "cache");
  const int64_t num_slots = checked_product(cache.size(0), page_slots, "argument `cache`: pages x page_slots");
  if constexpr (std::is_same_v<L, V4>) {
    // write_v4 writes whole 16-byte words of the value records: every page on a 16-byte boundary.
    const auto start = reinterpret_cast<uintptr_t>(cache.data_ptr());
    if (unique_slots && (start % 16 != 0 || cache.stride(0) % 16 != 0)) {
      TVM_FFI_THROW(ValueError) << "sparsekv: argument `cache` must start on a 16-byte boundary and have a row "
                                << "stride that is a multiple of 16 bytes, got address % 16 = " << start % 16
                                << " and stride " << cache.stride(0);
    }
  } else if (unique_slots && reinterpret_cast<uintptr_t>(cache.data_ptr()) % 4 != 0) {
    // write_indexer writes 4-byte words at least (an indexer page is a multiple of 4 bytes).
    TVM_FFI_THROW(ValueError) << "sparsekv: argument `cache` must start on a 4-byte boundary, got address % 4 = "
                              << reinterpret_cast<uintptr_t>(cache.data_ptr()) % 4;
  }
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

}  // namespace sparsekv::row_store
#endif
