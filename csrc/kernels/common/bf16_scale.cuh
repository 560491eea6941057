// The product of 8 packed bf16 values and an fp32 factor, rounded back to bf16 (nearest
// even): the one rounding of a row scaled by its slot weight, shared by gather_rows_padded
// and the column quantizer that gathers its rows (quantize_fp8_columns_gathered), so that
// both give the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe {

__device__ __forceinline__ uint4 scale_bf16x8(uint4 q, float scale) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    h[i] = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  }
  return q;
}

}  // namespace megamoe
