// The final combine's sums (ep_combine.cu): one token's partial rows, one from each owner
// that received it, summed in fp32 in rank order and rounded once to bf16. Warp-wide, one
// warp a token.
//
// Each lane loads its columns of an owner's row, up to kChunks 16-byte pieces (columns
// lane * 8 + 256 j), before it sums any of them. A lane that summed each piece as it came
// kept one or two loads in flight, and the kernel then moved its rows at about half the
// DRAM rate (tools/final_combine_rate.cu; the performance log, fifteenth session of
// 2026-12-04). Each column still gets the same fmas in the same order, so the bits do not
// depend on kChunks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/bf16_row.cuh"

namespace megamoe::ep {

// partial: owner d's row of this token at partial + d * owner_stride; pos[d] < 0: owner d
// did not receive the token (its row is not read). H a multiple of 8.
template <int kChunks>
__device__ __forceinline__ void sum_partial_rows(const __nv_bfloat16* __restrict__ partial,
                                                 int64_t owner_stride,
                                                 const int32_t* __restrict__ pos, int world,
                                                 int H, __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  for (int c0 = lane * 8; c0 < H; c0 += 32 * 8 * kChunks) {
    float acc[kChunks][8] = {};
    for (int d = 0; d < world; ++d) {
      if (pos[d] < 0) continue;
      const __nv_bfloat16* row = partial + d * owner_stride;
      uint4 piece[kChunks];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = c0 + j * 32 * 8;
        if (c < H) piece[j] = *reinterpret_cast<const uint4*>(row + c);
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        if (c0 + j * 32 * 8 < H) fma_row(acc[j], 1.f, piece[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = c0 + j * 32 * 8;
      if (c < H) *reinterpret_cast<uint4*>(out + c) = pack_row(acc[j]);
    }
  }
}

}  // namespace megamoe::ep
