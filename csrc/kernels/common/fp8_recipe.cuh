// The blockwise FP8 recipe's device arithmetic, in one place: the block scale from a block's
// absolute maximum, and the e4m3 rounding. Every kernel that quantizes (the standalone
// quantizers, and the GEMM epilogues that will write FP8) goes through these functions, so
// all of them produce the bits of the reference quantizer python/megamoe/fp8.py.
//
//   a = max(amax, 2^-100); scale = a / 448; r = 448 / a (both fp32, round to nearest even)
//   q = e4m3(x * r), round to nearest even, saturating to +-448
//   a block with a NaN or an infinity: every q = 0x7F (e4m3 NaN), scale = NaN (0x7FC00000)
//
// The build has no fast-math, and these use the _rn intrinsics anyway: a division rounded
// differently from the reference would change a scale in the last bit and every value of
// its block with it.
#pragma once

#include <cstdint>

namespace megamoe {

inline constexpr float kE4m3Max = 448.0f;
// The smallest amax a block's scale is taken from: keeps the scale a normal nonzero fp32 and
// r finite for an all-zero block; far below any value a bf16 model carries.
inline constexpr float kFp8AmaxFloor = 0x1p-100f;
inline constexpr uint32_t kE4m3NanX4 = 0x7F7F7F7Fu;
inline constexpr uint32_t kFp8ScaleNanBits = 0x7FC00000u;
// bf16 bits with the sign cleared: as unsigned integers they order like |x|, with Inf
// (0x7F80) above every finite value and every NaN above Inf.
inline constexpr uint32_t kBf16AbsMask2 = 0x7FFF7FFFu;
inline constexpr uint32_t kBf16InfBits = 0x7F80u;

struct Fp8BlockScale {
  float scale;     // the dequantization scale: x ~= q * scale
  float r;         // the quantization multiplier: q = e4m3(x * r)
  bool nonfinite;  // the block is all NaN
};

// `amax`: the largest |x| of the block; NaN or Inf marks a non-finite block.
__device__ __forceinline__ Fp8BlockScale fp8_block_scale(float amax) {
  Fp8BlockScale s;
  s.nonfinite = !(fabsf(amax) <= 3.402823466e38f);  // false for Inf and NaN
  const float a = s.nonfinite ? kFp8AmaxFloor : fmaxf(amax, kFp8AmaxFloor);
  s.scale = s.nonfinite ? __uint_as_float(kFp8ScaleNanBits) : __fdiv_rn(a, kE4m3Max);
  s.r = __fdiv_rn(kE4m3Max, a);
  return s;
}

// The same from the largest (bf16 bits & 0x7FFF) of the block, the cheap integer amax.
__device__ __forceinline__ Fp8BlockScale fp8_block_scale_bf16(uint32_t amax_bits) {
  return fp8_block_scale(__uint_as_float(amax_bits << 16));
}

// Two products x * r rounded to e4m3 (nearest even, saturating): `lo` in the low byte.
__device__ __forceinline__ uint32_t fp8_pair(float lo, float hi) {
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
}

// The 16-bit max of each half of two packed words (the amax of packed bf16 abs bits).
__device__ __forceinline__ uint32_t max_halves(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }

// The larger half of a packed word, as a 16-bit value in the low bits.
__device__ __forceinline__ uint32_t max_of_halves(uint32_t a) {
  return max(a & 0xFFFFu, a >> 16);
}

// Four bf16 (packed in two words, element 0 in the low half of w01) times r0..r3, rounded
// to e4m3: four bytes, element 0 in the low byte.
__device__ __forceinline__ uint32_t fp8_quad(uint32_t w01, uint32_t w23, float r0, float r1,
                                             float r2, float r3) {
  const float x0 = __uint_as_float(w01 << 16), x1 = __uint_as_float(w01 & 0xFFFF0000u);
  const float x2 = __uint_as_float(w23 << 16), x3 = __uint_as_float(w23 & 0xFFFF0000u);
  const uint32_t lo = fp8_pair(__fmul_rn(x0, r0), __fmul_rn(x1, r1));
  const uint32_t hi = fp8_pair(__fmul_rn(x2, r2), __fmul_rn(x3, r3));
  return lo | (hi << 16);
}

}  // namespace megamoe
