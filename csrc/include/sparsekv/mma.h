// mma: the warp-level tensor-core product mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 and the
// fp8 e4m3 -> bf16 convert that feeds it, for the cuda and sim backends (the convert on cpu too).
//
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", .bf16).
// Lane = 4 g + t: g = lane / 4 is the lane's group, t = lane % 4 its thread in the group. A 32-bit
// register holds two bf16, the element of the lower column (rows, for B) in its low 16 bits.
//   A, 16 x 16 (M x K), row:  a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
//                             a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   B, 16 x 8 (K x N), col:   b[0] = B[2t..2t+1][g]     b[1] = B[2t+8..2t+9][g]
//   C, D, 16 x 8 f32:         c[0], c[1] = C[g][2t], C[g][2t+1]    c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// The *_row / *_col helpers below state it once for the kernels.
//
// mma_bf16(d, a, b) does d += a b for the warp: every lane of the warp calls it together
// (warp-uniform control flow, as mma.sync.aligned requires). cuda: one HMMA.16816.F32.BF16. sim: a
// warp-collective operation with the same layout: each lane publishes its registers, the warp
// meets at __syncwarp, each lane computes its four elements of D from the registers of the lanes
// the layout says hold them, and the warp meets again before the registers can be reused; so a
// kernel that puts an element in the wrong register gets the wrong product on sim as it would on
// the GPU. Rounding: sim adds the 16 exact products and C in double and rounds once to float; the
// tensor core's internal order and rounding are not emulated (results agree to a few float ulps).
//
// ldmatrix_x4 loads fragments from shared memory in one instruction (its comment gives the layout).
//
// e2m1x8_to_bf16x2(codes, scale, out): eight e2m1 codes (a 32-bit word, code n in bits 4n..4n+3)
// times a UE8M0 scale as four bf16x2, out[p] = (code p, code p + 4): a pairing of dims the caller's
// query follows. Each magnitude's two bf16 bytes come from two 8-byte tables by one byte permute
// (PRMT) per four codes, a third permute interleaves them, the sign bits move in with one shift and
// one masked merge, and one bf16x2 multiply applies the scale (exact: the product of an e2m1 value
// and a power of two is a bf16 whenever it is a float; a multiply on bf16 keeps subnormals, so the
// scale byte 0, 2^-127, is exact too). About 5.5 instructions a pair on the GPU, no int-to-float
// convert and no select; cpu and sim run the same steps on the integer emulation of the permute and
// a float multiply rounded to bf16, so all backends give fp8::e2m1_to_float(code) * ue8m0_to_float(s)
// rounded to bf16 (NaN for a zero code times the scale byte 255, +inf).
//
// e4m3x2_to_bf16x2(pair, scale): two e4m3 bytes times a power-of-two scale as bf16x2. cuda: the
// hardware convert (F2FP.F16.E4M3.UNPACK_B: e4m3 values are exact in f16), f16 -> f32, one multiply
// by the scale, one F2FP.BF16.F32.PACK_AB; cpu and sim: the software decode of fp8.h, the same
// multiply and round. e4m3 values times a power of two are exact in bf16 while the product stays
// normal, so both give the same bits for every non-NaN byte; NaN stays NaN (payloads may differ).
#pragma once

#include <cstdint>

#include "sparsekv/fp8.h"
#include "sparsekv/portability.h"

#if defined(__CUDACC__) && !defined(SPARSEKV_SIM)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

namespace sparsekv::mma {

struct FragA {
  uint32_t x[4];
};
struct FragB {
  uint32_t x[2];
};
struct FragC {
  float x[4];
};

// Where each register element sits in its matrix; `half` 0 is the low 16 bits.
SPARSEKV_HOST_DEVICE int a_row(int lane, int reg) { return lane / 4 + 8 * (reg & 1); }
SPARSEKV_HOST_DEVICE int a_col(int lane, int reg, int half) { return 2 * (lane % 4) + half + 8 * (reg >> 1); }
SPARSEKV_HOST_DEVICE int b_row(int lane, int reg, int half) { return 2 * (lane % 4) + half + 8 * reg; }
SPARSEKV_HOST_DEVICE int b_col(int lane) { return lane / 4; }
SPARSEKV_HOST_DEVICE int c_row(int lane, int i) { return lane / 4 + 8 * (i >> 1); }
SPARSEKV_HOST_DEVICE int c_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

SPARSEKV_HOST_DEVICE uint32_t pack_bf16x2(uint16_t low, uint16_t high) {
  return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
}

// Two floats rounded to bf16 (nearest, ties to even) and packed, the first in the low half.
SPARSEKV_HOST_DEVICE uint32_t floats_to_bf16x2(float low, float high) {
#if defined(__CUDA_ARCH__) && !defined(SPARSEKV_SIM)
  const __nv_bfloat162 packed = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&packed);
#else
  return pack_bf16x2(fp8::float_to_bf16(low), fp8::float_to_bf16(high));
#endif
}

SPARSEKV_HOST_DEVICE uint32_t e4m3x2_to_bf16x2(uint16_t pair, float scale) {
#if defined(__CUDA_ARCH__) && !defined(SPARSEKV_SIM)
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  const float2 f = __half22float2(__half2(raw));
  return floats_to_bf16x2(f.x * scale, f.y * scale);
#else
  return floats_to_bf16x2(fp8::e4m3_to_float(static_cast<uint8_t>(pair & 0xffu)) * scale,
                          fp8::e4m3_to_float(static_cast<uint8_t>(pair >> 8)) * scale);
#endif
}

// PTX prmt.b32 (default mode) for selectors whose nibbles never set their sign-replicate bit 3:
// byte n of the result is byte (selector >> 4 n) & 7 of {a (bytes 0-3), b (bytes 4-7)}.
SPARSEKV_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__) && !defined(SPARSEKV_SIM)
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
#else
  const uint64_t bytes = static_cast<uint64_t>(a) | (static_cast<uint64_t>(b) << 32);
  uint32_t out = 0;
  for (int n = 0; n < 4; ++n) {
    out |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  }
  return out;
#endif
}

// Two bf16 products, each rounded to nearest even.
SPARSEKV_HOST_DEVICE uint32_t mul_bf16x2(uint32_t x, uint32_t y) {
#if defined(__CUDA_ARCH__) && !defined(SPARSEKV_SIM)
  const __nv_bfloat162 product =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x), *reinterpret_cast<const __nv_bfloat162*>(&y));
  return *reinterpret_cast<const uint32_t*>(&product);
#else
  const auto half = [](uint32_t reg, int h) { return fp8::bf16_to_float(static_cast<uint16_t>(reg >> (16 * h))); };
  return pack_bf16x2(fp8::float_to_bf16(half(x, 0) * half(y, 0)), fp8::float_to_bf16(half(x, 1) * half(y, 1)));
#endif
}

// The bf16x2 of a UE8M0 scale byte in both halves: 2^(s - 127) (the byte 0 the subnormal 2^-127, 255 +inf).
SPARSEKV_HOST_DEVICE uint32_t ue8m0_to_bf16x2(uint32_t s) { return (s != 0 ? s << 7 : 0x40u) * 0x10001u; }

// The e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16 (0000 3F00 3F80 3FC0 4000 4040 4080 40C0):
// their high bytes (of magnitudes 0-3, of 4-7) and their low bytes.
inline constexpr uint32_t kE2m1High0to3 = 0x3F3F3F00u, kE2m1High4to7 = 0x40404040u;
inline constexpr uint32_t kE2m1Low0to3 = 0xC0800000u, kE2m1Low4to7 = 0xC0804000u;

SPARSEKV_HOST_DEVICE void e2m1x8_to_bf16x2(uint32_t codes, uint32_t scale, uint32_t (&out)[4]) {
  // Magnitudes of codes 0, 1, 4, 5 in the low 16 bits of the first selector, of 2, 3, 6, 7 in the second's.
  const uint32_t first = byte_perm(codes & 0x77777777u, 0, 0x3120u);
  const uint32_t selectors[2] = {first, first >> 16};
  SPARSEKV_UNROLLED
  for (int half = 0; half < 2; ++half) {
    const uint32_t high = byte_perm(kE2m1High0to3, kE2m1High4to7, selectors[half]);
    const uint32_t low = byte_perm(kE2m1Low0to3, kE2m1Low4to7, selectors[half]);
    SPARSEKV_UNROLLED
    for (int e = 0; e < 2; ++e) {
      const int p = 2 * half + e;  // codes p and p + 4: their bytes 2 e and 2 e + 1 of `low` and `high`
      const uint32_t magnitudes = byte_perm(low, high, e == 0 ? 0x6240u : 0x7351u);
      const uint32_t signs = (codes << (12 - 4 * p)) & 0x80008000u;  // code p's bit 3 to 15, code p + 4's to 31
      out[p] = mul_bf16x2(magnitudes | signs, scale);
    }
  }
}

#ifdef __CUDACC__
#ifdef SPARSEKV_SIM
namespace sim_detail {

// The registers each lane published, per warp of the block (one launch at a time per OS thread:
// the fibers of a block all run on the launching thread).
struct Published {
  FragA a;
  FragB b;
};
inline thread_local Published registers[cuda_sim::kMaxThreadsPerBlock / kWarpSize][kWarpSize];
inline thread_local const uint16_t* rows[cuda_sim::kMaxThreadsPerBlock / kWarpSize][kWarpSize];  // ldmatrix

inline float bf16_half(uint32_t reg, int half) { return fp8::bf16_to_float(static_cast<uint16_t>(reg >> (16 * half))); }

}  // namespace sim_detail
#endif

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: four 8 x 8 matrices of 16-bit elements from
// shared memory, one instruction for a whole A fragment (or two B fragments). Lane 8 i + r passes
// the address of row r of matrix i (16 contiguous bytes, 16-byte aligned); register i of lane
// 4 g + t receives matrix i's elements (g, 2t) and (g, 2t + 1), or with `Trans` (2t, g) and
// (2t + 1, g), the first in the low half. So for a row-major 16 x 16 tile at `tile` (row stride
// `stride` elements), lane l passing &tile[l % 8 + 8 ((l / 8) % 2)][8 (l / 16)] gets its A fragment.
// sim: each lane publishes its address, the warp meets, each lane reads its elements from the rows
// the lanes named, the warp meets again.
template <bool Trans = false>
SPARSEKV_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row) {
#ifdef SPARSEKV_SIM
  const int linear = cuda_sim::g.current->linear;
  const int warp = linear / kWarpSize, lane = linear % kWarpSize;
  const uint16_t** published = sim_detail::rows[warp];
  published[lane] = row;
  __syncwarp();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const uint16_t low = Trans ? published[8 * i + 2 * t][g] : published[8 * i + g][2 * t];
    const uint16_t high = Trans ? published[8 * i + 2 * t + 1][g] : published[8 * i + g][2 * t + 1];
    r[i] = pack_bf16x2(low, high);
  }
  __syncwarp();
#else
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
  }
#endif
}

SPARSEKV_DEVICE void mma_bf16(FragC& d, const FragA& a, const FragB& b) {
#ifdef SPARSEKV_SIM
  const int linear = cuda_sim::g.current->linear;
  const int warp = linear / kWarpSize, lane = linear % kWarpSize;
  sim_detail::Published* published = sim_detail::registers[warp];
  published[lane] = sim_detail::Published{a, b};
  __syncwarp();
  for (int i = 0; i < 4; ++i) {
    const int row = c_row(lane, i), col = c_col(lane, i);
    double sum = d.x[i];
    for (int k = 0; k < 16; ++k) {
      // The inverse of the layout: A[row][k] is in lane 4 (row % 8) + (k % 8) / 2, register
      // (row / 8) + 2 (k / 8); B[k][col] in lane 4 col + (k % 8) / 2, register k / 8; half k % 2.
      const float x = sim_detail::bf16_half(published[4 * (row % 8) + (k % 8) / 2].a.x[row / 8 + 2 * (k / 8)], k % 2);
      const float y = sim_detail::bf16_half(published[4 * col + (k % 8) / 2].b.x[k / 8], k % 2);
      sum += static_cast<double>(x) * static_cast<double>(y);
    }
    d.x[i] = static_cast<float>(sum);
  }
  __syncwarp();
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
#endif
}
#endif

}  // namespace sparsekv::mma
