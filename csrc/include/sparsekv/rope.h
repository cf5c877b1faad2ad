// rope: rotary position embedding of the trailing 64 channels of a team row (lane_reduce.h), from
// the model's float32 tables, so keys rotate by exactly the angles the model applies to its queries.
//
// Contract (row x of D channels, D a multiple of 64 and at least 128; position pos):
//   the tail is channels D - 64 .. D - 1; its interleaved pairs (2i, 2i + 1), i < 32, rotate by
//   c = cos[pos, i], s = sin[pos, i] (tables [max_position, 32] float32, row-major):
//     (y_2i, y_2i+1) <- (bf16(y_2i c - y_2i+1 s), bf16(y_2i s + y_2i+1 c))
//   every product and sum rounded as written (team::mul_rn / add_rn / sub_rn: no FMA contraction),
//   so the result is identical on both backends. The caller keeps pos inside the tables; the host
//   section checks a host-readable position and the tables' shapes.
#pragma once

#include <cstdint>

#include "sparsekv/fp8.h"
#include "sparsekv/lane_reduce.h"
#include "sparsekv/portability.h"

namespace sparsekv::rope {

inline constexpr int kDims = 64;
inline constexpr int kPairs = kDims / 2;

// The pair partner of channel c is c ^ 1 (virtual lane ^ 1); the tail is columns k >= (D - 64) / 32.
template <int D>
SPARSEKV_HOST_DEVICE void rotate_tail(team::Row<D>& x, const float* cos, const float* sin, int64_t pos, Lanes lanes) {
  static_assert(D % kDims == 0 && D >= 2 * kDims, "rope: the rope tail is 64 of at least 128 dims");
  using Row = team::Row<D>;
  for (int k = (D - kDims) / team::kTeamLanes; k < Row::kPerLane; ++k) {
    team::Share own;
    for (int j = 0; j < team::kVirtualPerThread; ++j) own.v[j] = x.v[j][k];
    const team::Share partner = team::exchange(own, 1);
    for (int j = 0; j < team::kVirtualPerThread; ++j) {
      const int t = Row::channel(lanes, j, k) - (D - kDims);
      const float c = cos[pos * kPairs + t / 2];
      const float s = sin[pos * kPairs + t / 2];
      const float v = (t & 1) == 0 ? team::sub_rn(team::mul_rn(own.v[j], c), team::mul_rn(partner.v[j], s))
                                   : team::add_rn(team::mul_rn(partner.v[j], s), team::mul_rn(own.v[j], c));
      x.v[j][k] = fp8::round_bf16(v);
    }
  }
}

}  // namespace sparsekv::rope

#ifdef SPARSEKV_HOST_ENTRY
#include "sparsekv/ffi.h"

namespace sparsekv::rope {

// A host-readable RoPE position of entry n must be a row of the table.
inline void check_position(int64_t pos, int64_t n, int64_t rope_positions, const char* name) {
  if (pos < 0 || pos >= rope_positions) {
    TVM_FFI_THROW(IndexError) << "sparsekv: argument `" << name << "`[" << n << "] gives RoPE position " << pos
                              << ", outside the RoPE table [0, " << rope_positions << ")";
  }
}

// The cos and sin tables: float32 [max_position, 32], contiguous, on the device of `other`.
inline void check_tables(TensorView rope_cos, TensorView rope_sin, TensorView other, const char* other_name) {
  check(rope_cos, "rope_cos").dtype<float>().ndim(2).contiguous().size(1, kPairs, "rope pairs (64 / 2)");
  check(rope_cos, "rope_cos").same_device(other, other_name);
  check(rope_sin, "rope_sin").dtype<float>().ndim(2).contiguous().size(1, kPairs, "rope pairs (64 / 2)");
  check(rope_sin, "rope_sin").same_device(other, other_name).size(0, rope_cos.size(0), "max positions of rope_cos");
}

}  // namespace sparsekv::rope
#endif
