// lane_reduce: 32 virtual lanes cooperating on one D-wide row, with the same float results on both backends.
//
// Virtual lane l holds channels l + 32 k (k < D / 32). On the GPU each lane of a warp is one
// virtual lane (kVirtualPerThread = 1); on the host one thread runs all 32 (kVirtualPerThread = 32),
// so a thread's share of a row is `float v[kVirtualPerThread][D / 32]`, virtual lane
// `lanes.lane + j` for j < kVirtualPerThread. Reductions follow one fixed order on both backends:
// every virtual lane first folds its own channels in k order, then the 32 partials meet in an
// xor butterfly (offsets 16, 8, 4, 2, 1; lane l adds its partner l ^ off to its own value). The
// host emulates the butterfly element for element, so sums (and anything computed from them,
// such as an RMS norm) are bit-identical between the cpu and cuda builds, and a torch reference
// that follows the same order reproduces them exactly.
//
// A kernel using a team must run one item per warp (the default warp-per-item driver).
#pragma once

#include <cmath>

#include "sparsekv/portability.h"

namespace sparsekv::team {

inline constexpr int kTeamLanes = 32;
#ifdef __CUDA_ARCH__
inline constexpr int kVirtualPerThread = 1;
#else
inline constexpr int kVirtualPerThread = kTeamLanes;
#endif

// One thread's values of a per-virtual-lane scalar.
struct Share {
  float v[kVirtualPerThread];
};

// IEEE float operations the compiler may not fuse or reorder (nvcc contracts a * b + c into an
// FMA by default; the host build does not), so both backends round every step alike.
SPARSEKV_HOST_DEVICE float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPARSEKV_HOST_DEVICE float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SPARSEKV_HOST_DEVICE float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// IEEE divide and square root, rounded to nearest even on both backends (nvcc's defaults give
// that too, but a --use_fast_math or -prec-div=false in SPARSEKV_EXTRA_CFLAGS would not).
SPARSEKV_HOST_DEVICE float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
SPARSEKV_HOST_DEVICE float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The value of virtual lane (own ^ offset) for each of this thread's virtual lanes.
SPARSEKV_HOST_DEVICE Share exchange(const Share& s, int offset) {
  Share out;
#ifdef __CUDA_ARCH__
  out.v[0] = __shfl_xor_sync(0xffffffffu, s.v[0], offset);
#else
  for (int j = 0; j < kVirtualPerThread; ++j) out.v[j] = s.v[j ^ offset];
#endif
  return out;
}

// Sum over the 32 virtual lanes in the fixed butterfly order; every lane gets the same value.
SPARSEKV_HOST_DEVICE float sum(Share s) {
  for (int offset = kTeamLanes / 2; offset > 0; offset /= 2) {
    const Share other = exchange(s, offset);
    for (int j = 0; j < kVirtualPerThread; ++j) s.v[j] = add_rn(s.v[j], other.v[j]);
  }
  return s.v[0];
}

// Maximum over the 32 virtual lanes (exact in any order).
SPARSEKV_HOST_DEVICE float max(Share s) {
  for (int offset = kTeamLanes / 2; offset > 0; offset /= 2) {
    const Share other = exchange(s, offset);
    for (int j = 0; j < kVirtualPerThread; ++j) s.v[j] = s.v[j] > other.v[j] ? s.v[j] : other.v[j];
  }
  return s.v[0];
}

// A thread's share of a D-wide row: v[j][k] is channel (lane + j) + 32 k.
template <int D>
struct Row {
  static_assert(D % kTeamLanes == 0, "team: the row width must be a multiple of 32");
  static constexpr int kPerLane = D / kTeamLanes;
  float v[kVirtualPerThread][kPerLane];

  SPARSEKV_HOST_DEVICE static int channel(Lanes lanes, int j, int k) { return lanes.lane + j + kTeamLanes * k; }
};

}  // namespace sparsekv::team
