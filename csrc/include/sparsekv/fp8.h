// fp8: bit-exact scalar encodings shared by every quantizing and dequantizing kernel.
//
//   e4m3 (OCP float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite 448,
//       subnormals down to 2^-9, no infinities; 0x7F / 0xFF are NaN.
//   bf16: the upper 16 bits of an IEEE float32.
//   ue8m0: an unsigned power-of-two scale, byte b = 2^(b - 127).
//   e2m1 (fp4): 1 sign, 2 exponent, 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//
// Every encoder rounds to nearest, ties to even, the rule of torch's casts and of PTX cvt.rn. The
// e4m3 and e2m1 encoders saturate at their largest finite value (a torch float8 cast does not:
// clamp before casting to compare). Everything is SPARSEKV_HOST_DEVICE and uses only integer and
// float arithmetic, so both backends produce the same bytes. The one exception is
// float_to_e4m3x2, which on sm_89+ is the hardware convert: it gives the software encoder's bytes
// for every input (so the e4m3 encoder writes every NaN as the hardware's canonical 0x7F, sign
// dropped, not as a signed NaN: torch's cast keeps the sign).
#pragma once

#include <cstdint>
#include <cstring>

#include "sparsekv/portability.h"

namespace sparsekv::fp8 {

SPARSEKV_HOST_DEVICE uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

SPARSEKV_HOST_DEVICE float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// ---------------------------------------------------------------------------------------------
// bf16

SPARSEKV_HOST_DEVICE uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

SPARSEKV_HOST_DEVICE float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// x rounded to the nearest bf16 (ties to even), as a float.
SPARSEKV_HOST_DEVICE float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// ---------------------------------------------------------------------------------------------
// ue8m0 power-of-two scales

// 2^e as a float for e in [-127, 127] (2^-127 is a float subnormal).
SPARSEKV_HOST_DEVICE float exp2_int(int e) {
  return e >= -126 ? bits_float(static_cast<uint32_t>(e + 127) << 23) : bits_float(0x00400000u);
}

SPARSEKV_HOST_DEVICE float ue8m0_to_float(uint8_t b) { return exp2_int(static_cast<int>(b) - 127); }

// The smallest integer e with max_finite * 2^e >= amax, for a positive normal float amax and a
// positive normal max_finite (448 for e4m3, 6 for e2m1). Exact: compares exponents and mantissas
// instead of dividing, so no rounding can make the scale one exponent low.
SPARSEKV_HOST_DEVICE int ceil_scale_exponent(float amax, float max_finite) {
  const uint32_t a = float_bits(amax), m = float_bits(max_finite);
  const int exponent_gap = static_cast<int>((a >> 23) & 0xffu) - static_cast<int>((m >> 23) & 0xffu);
  return exponent_gap + ((a & 0x7fffffu) > (m & 0x7fffffu) ? 1 : 0);
}

// ---------------------------------------------------------------------------------------------
// e4m3

inline constexpr float kE4m3Max = 448.0f;

// Round a non-negative float to the nearest integer, ties to even (both backends, any rounding mode).
SPARSEKV_HOST_DEVICE float round_half_even(float v) {
  const float lower = static_cast<float>(static_cast<int64_t>(v));  // v >= 0: truncation is floor
  const float diff = v - lower;
  if (diff > 0.5f) return lower + 1.0f;
  if (diff < 0.5f) return lower;
  return (static_cast<int64_t>(lower) & 1) ? lower + 1.0f : lower;
}

SPARSEKV_HOST_DEVICE uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7fu;                               // NaN: canonical, as cvt
  const float a = bits_float(abs_bits);
  if (a >= kE4m3Max) return static_cast<uint8_t>(sign | 0x7eu);           // saturate
  if (a < 0.015625f) {                                                     // below 2^-6: subnormal grid of 2^-9
    // round(a * 512) in [0, 8]; 8 is the smallest normal (exponent field 1, mantissa 0) = code 8.
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(round_half_even(a * 512.0f)));
  }
  int exponent = static_cast<int>((abs_bits >> 23) & 0xffu) - 127;  // in [-6, 8]
  uint32_t mantissa = (abs_bits & 0x7fffffu) >> 20;
  const uint32_t rest = abs_bits & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (mantissa & 1u))) ++mantissa;
  if (mantissa == 8u) {
    mantissa = 0;
    ++exponent;
  }
  // a < 448 rounds to at most 448 = exponent 8, mantissa 6: never the NaN code.
  return static_cast<uint8_t>(sign | (static_cast<uint32_t>(exponent + 7) << 3) | mantissa);
}

// Two e4m3 codes, lo's in the low byte. sm_89+: one hardware convert (PTX
// cvt.rn.satfinite.e4m3x2.f32, SASS F2FP.SATFINITE.E4M3.F32.PACK_AB), which rounds to nearest even,
// saturates finite values and infinities at +-448 and writes NaN as 0x7F, exactly as float_to_e4m3
// does (cuda_fp8.hpp's emulation of it agrees); elsewhere float_to_e4m3 twice.
SPARSEKV_HOST_DEVICE uint16_t float_to_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(SPARSEKV_SIM)
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
#else
  return static_cast<uint16_t>(float_to_e4m3(lo) | (float_to_e4m3(hi) << 8));
#endif
}

SPARSEKV_HOST_DEVICE float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xfu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) return bits_float(sign | float_bits(static_cast<float>(mantissa) * 0.001953125f));
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// ---------------------------------------------------------------------------------------------
// e2m1 (a 4-bit code in the low nibble: bit 3 sign, bits 2-1 exponent, bit 0 mantissa)

inline constexpr float kE2m1Max = 6.0f;

SPARSEKV_HOST_DEVICE uint8_t float_to_e2m1(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const float a = bits_float(u & 0x7fffffffu);
  // Midpoints between neighbouring magnitudes; a tie goes to the even code (<= for an even lower
  // neighbour, < for an odd one). NaN compares false everywhere and saturates to 6.
  uint8_t code;
  if (a <= 0.25f) code = 0;
  else if (a < 0.75f) code = 1;
  else if (a <= 1.25f) code = 2;
  else if (a < 1.75f) code = 3;
  else if (a <= 2.5f) code = 4;
  else if (a < 3.5f) code = 5;
  else if (a <= 5.0f) code = 6;
  else code = 7;
  return static_cast<uint8_t>(sign | code);
}

SPARSEKV_HOST_DEVICE float e2m1_to_float(uint8_t code) {
  // 0, 0.5, 1, 1.5, 2, 3, 4, 6 made on the float32 bits: magnitudes 2..7 are 0x3F000000 + (m << 22)
  // (the code's exponent and mantissa bit moved up and rebiased), 1 is 0.5 and 0 is 0; the sign is
  // bit 3. Integer operations and one select, no int-to-float convert.
  const uint32_t magnitude = code & 0x7u;
  const uint32_t bits = magnitude < 2 ? magnitude * 0x3F000000u : 0x3F000000u + (magnitude << 22);
  return bits_float(bits | (static_cast<uint32_t>(code & 0x8u) << 28));
}

}  // namespace sparsekv::fp8
