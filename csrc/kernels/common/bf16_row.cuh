// 16-byte pieces of bf16 rows summed in fp32: the row combines of the one-GPU layer
// (combine_rows.cu) and of the expert-parallel one (comm/ep_combine.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe {

// acc[i] += w * v[i] for the 8 bf16 of v, each a single fused multiply-add.
__device__ __forceinline__ void fma_row(float (&acc)[8], float w, const uint4& v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = __fmaf_rn(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = __fmaf_rn(w, f.y, acc[2 * i + 1]);
  }
}

// The 8 sums rounded to bf16 (to nearest even), as 16 bytes.
__device__ __forceinline__ uint4 pack_row(const float (&acc)[8]) {
  uint4 out;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return out;
}

}  // namespace megamoe
