// An epilogue's 1x128 e4m3 copy of a bf16 output it writes, quantized where the values are:
// the four lanes of a quad hold a row's columns (Fragment), so a row's 128-column block is
// 16 packed bf16 pairs in each of four threads. Only fp8_recipe.cuh's arithmetic, on the
// bf16-rounded values the epilogue writes, with the amax over their abs bits: the bits of
// quantize_fp8's kRows1x128 applied to that bf16 output.
#pragma once

#include <cstdint>

#include "kernels/common/fp8_recipe.cuh"
#include "kernels/sm90/epilogue_common.cuh"

namespace megamoe::sm90 {

// The lanes of this thread's quad. The shuffles below name only them: quads of one warp may
// be on different paths (a pad row's and an expert row's), a quad never is.
__device__ __forceinline__ uint32_t quad_lanes() { return 0xFu << ((threadIdx.x % 32) & ~3u); }

// This thread's share of one row's block in e4m3: word k goes to bytes 16k +
// fp8_word_offset() .. + 3 of the block (so each 16-byte slot of the row is four words of
// one quad), and the block's scale.
struct Fp8RowBlock {
  uint32_t q[8];
  float scale;
};

// Lane t of the quad: t = 0 and 2 hold the 4 bytes at 0 and 4 of a slot, t = 1 and 3 those at
// 8 and 12.
__device__ __forceinline__ int fp8_word_offset() {
  const int t = threadIdx.x % 4;
  return ((t & 1) << 3) | ((t & 2) << 1);
}

// bf16[i]: this thread's pair of chunk i of the block (columns 8i + 2(l % 4), + 1, as the
// bf16x2 it stores). The quad's four lanes call it together.
__device__ __forceinline__ Fp8RowBlock quantize_row_block(const uint32_t (&bf16)[16]) {
  const uint32_t quad = quad_lanes();
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = max_halves(m, bf16[i] & kBf16AbsMask2);
  m = max_of_halves(m);
  m = max(m, __shfl_xor_sync(quad, m, 1));
  m = max(m, __shfl_xor_sync(quad, m, 2));
  const Fp8BlockScale s = fp8_block_scale_bf16(m);
  // pairs[k]: the e4m3 of this thread's columns of chunks 2k (low half) and 2k + 1.
  uint32_t pairs[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    pairs[k] = s.nonfinite ? kE4m3NanX4 : fp8_quad(bf16[2 * k], bf16[2 * k + 1], s.r, s.r, s.r, s.r);
  }
  // Lanes 2j and 2j + 1 swap halves: the even lane then holds 4 contiguous bytes of chunk 2k
  // (its columns and its partner's), the odd one those of chunk 2k + 1. One shuffle moves
  // the halves of two k, and the byte selectors differ by lane, not by k.
  const bool odd = threadIdx.x & 1;
  const uint32_t send = odd ? 0x5410u : 0x7632u;  // the low halves, or the high ones
  const uint32_t first = odd ? 0x3254u : 0x5410u, second = odd ? 0x3276u : 0x7610u;
  Fp8RowBlock b;
#pragma unroll
  for (int k = 0; k < 8; k += 2) {
    const uint32_t got = __shfl_xor_sync(quad, __byte_perm(pairs[k], pairs[k + 1], send), 1);
    b.q[k] = __byte_perm(pairs[k], got, first);
    b.q[k + 1] = __byte_perm(pairs[k + 1], got, second);
  }
  b.scale = s.scale;
  return b;
}

// Row `row` of a 64 x 128-byte staging box in the 128-byte swizzle of the TMA boxes (slot
// k of row r at (k ^ (r % 8)) * 16): the eight rows of a warp's store then fill all 32 banks.
__device__ __forceinline__ void stage_row_block(uint8_t* box, int row, const Fp8RowBlock& b) {
  uint8_t* at = box + row * 128 + fp8_word_offset();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    *reinterpret_cast<uint32_t*>(at + ((k ^ (row % 8)) * 16)) = b.q[k];
  }
}

// Straight to memory, `out` the block's first byte in its row: a warp's store covers 16
// contiguous bytes of each of its 8 rows.
__device__ __forceinline__ void store_row_block(uint8_t* out, const Fp8RowBlock& b) {
  uint8_t* at = out + fp8_word_offset();
#pragma unroll
  for (int k = 0; k < 8; ++k) *reinterpret_cast<uint32_t*>(at + 16 * k) = b.q[k];
}

}  // namespace megamoe::sm90
