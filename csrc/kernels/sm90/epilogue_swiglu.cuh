// The SwiGLU epilogue (L1 of the expert MLP): the B tile's first half holds gate columns
// n0.., its second half the up columns I + n0.. (BColumns::kGateUpHalves), and
//   C[r, n0 + c] = silu(gate) * up,   c < kBlockN / 2 (C is [rows, I]).
#pragma once

#include "kernels/sm90/epilogue_store.cuh"

namespace megamoe::sm90 {

// Approximate division (MUFU.RCP and a multiply) instead of the IEEE division's
// instruction sequence: these feed bf16 outputs, whose rounding is far coarser. For
// g < -88, exp(-g) is inf and both give 0 (the sign of g aside).
// sigmoid's exp(-g) is ex2.approx.ftz of -g log2(e): __expf's guard for results below
// 2^-126 (three instructions an element) cannot change 1 + exp(-g), so the bits are __expf's.
__device__ __forceinline__ float sigmoid(float g) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return __fdividef(1.0f, 1.0f + e);
}
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

template <int kBlockN>
struct SwiGLUValues {
  static constexpr int kCols = kBlockN / 2;
  static constexpr BColumns kBColumns = BColumns::kGateUpHalves;
  __device__ __forceinline__ static float get(const float (&acc)[kBlockN / 2], int q, int half,
                                              int j) {
    constexpr int kUpChunk = kCols / 8;  // first 8-column chunk of the up half
    return silu(acc[Fragment::index(q, half, j)]) * acc[Fragment::index(q + kUpChunk, half, j)];
  }
};

template <int kBlockN>
using SwiGLUEpilogue = StoreEpilogue<kBlockN, SwiGLUValues<kBlockN>>;

}  // namespace megamoe::sm90
