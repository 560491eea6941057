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

// A token's k slot rows folded at one 16-byte piece as the one-GPU layer's combine folds
// them, which fixes the bits of y and dx: from +0, a single fma per used slot in slot order
// (unused slots skipped), the loads of kGroup slots issued before their fmas, rounded once.
// slot(j, w, v) says whether slot j is used and, if so, sets its weight w and piece v; it
// runs for every j of every group (past k too), in order, on every thread alike, so it may
// shuffle across a warp.
template <int kGroup, class Slot>
__device__ __forceinline__ uint4 fold_slot_pieces(int k, Slot&& slot) {
  float acc[8] = {};
  for (int j0 = 0; j0 < k; j0 += kGroup) {
    bool used[kGroup];
    float w[kGroup];
    uint4 v[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) used[u] = slot(j0 + u, w[u], v[u]);
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      if (used[u]) fma_row(acc, w[u], v[u]);
    }
  }
  return pack_row(acc);
}

}  // namespace megamoe
