// The blockwise-FP8 wgmma mainloop of the grouped GEMM (the DeepSeek-V3 recipe): e4m3 A and
// B, both K-major, with fp32 scales per 128 of K. A has one scale per row and k-block (1x128
// blocks), brought into each stage by the A loader. B has either one scale per 128 x 128
// block of the expert's weight (kBlocks128; read from global memory, one or two scalars per
// k-block), or one per row and k-block like A (kRows: the weight gradients, whose B is an
// activation; brought into the stage by the B loader).
//
// Hopper's FP8 wgmma keeps fewer bits than fp32 while it accumulates, so each k-block's
// partial products (four m64n128k32 MMAs) go into scratch accumulators, which are then
// scaled and added into the fp32 sums the epilogue receives: sum += partial * sa * sb.
// The warpgroup waits for its MMAs before that promotion; the other consumer warpgroup's
// MMAs keep the tensor cores busy meanwhile.
//
// Same members as MainloopBf16 (see there), plus kScaled / kBRowScales for the loaders and
// kConsumerArrivals: every warp reads the stage's scales, so each warp releases the stage.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

enum class BScales { kBlocks128, kRows };

template <BScales kBScales_, BColumns kBColumns_ = BColumns::kContiguous>
struct MainloopFp8 {
  using Element = __nv_fp8_e4m3;
  static constexpr BScales kBScales = kBScales_;
  static constexpr BColumns kBColumns = kBColumns_;
  // 128 columns: the promotion doubles the accumulator registers, and 2 x 128 of a 256-wide
  // tile would not fit the consumers' 224.
  static constexpr int kBlockN = 128;
  static constexpr Major kAMajor = Major::kK;
  static constexpr Major kBMajor = Major::kK;
  static constexpr int kBlockK = 128;  // one scale block; 128 bytes of a row
  static constexpr bool kScaled = true;
  static constexpr bool kBRowScales = kBScales == BScales::kRows;
  static constexpr int kBRowScaleSlots = kBRowScales ? kBlockN : 4;
  // A's scales of a stage: a TMA box starts at a multiple of 4 rows, up to 3 before the
  // tile's first (sorted rows), so it holds 128 + 4; slots are kept 128-byte aligned.
  static constexpr int kAScaleBox = kBlockM + 4;
  static constexpr int kAScaleSlots = 160;
  static constexpr int kTileBytesA = kBlockM * kBlockK;
  static constexpr int kTileBytesB = kBlockN * kBlockK;
  static constexpr int kStageBytes =
      kTileBytesA + kTileBytesB + int(sizeof(float)) * (kAScaleSlots + kBRowScaleSlots);
  static constexpr int kAccumulators = kBlockN / 2;
  static constexpr int kExtraTmaBytes = 0;
  static constexpr int kConsumerArrivals = 4;
  // 128 accumulators per consumer thread (sums and partials) leave room to give the
  // producer more: its row gather also copies the rows' scales.
  using Registers = RegisterSplit<72, 216>;
  static_assert(kBColumns == BColumns::kContiguous || kBScales == BScales::kBlocks128);

  // kBlocks128: the scale of expert e's block (i, j) (B rows 128i.., K 128j..) at
  // b_scales[e * s_expert + i * s_n + j * s_k]; any strides, so W^T reads W's scales.
  struct Params {
    const float* b_scales;
    int64_t s_expert;
    int32_t s_n, s_k;
    int32_t up_block;  // kGateUpHalves: the block row of the expert's first up row (I / 128)
    // A by TMA in the sorted layout: its scale boxes start at row0 rounded down to 4.
    int32_t a_sorted_tma;
  };

  // 1024-byte multiples, like the bf16 stages: the epilogue's swizzled staging follows.
  template <int kStages>
  struct alignas(1024) Tiles {
    Element a[kStages][kBlockM * kBlockK];
    Element b[kStages][kBlockN * kBlockK];
    float a_scales[kStages][kAScaleSlots];
    float b_scales[kStages][kBRowScaleSlots];
  };

  __device__ __forceinline__ explicit MainloopFp8(const Params& p)
      : b_scales_(p.b_scales), s_expert_(p.s_expert), s_n_(p.s_n), s_k_(p.s_k),
        up_block_(p.up_block), a_sorted_tma_(p.a_sorted_tma) {}

  template <int kStages>
  __device__ __forceinline__ void load_extras(Tiles<kStages>&, int, uint64_t*, const Tile&,
                                              int) const {}

  template <bool kGenericProxyA, int kStages>
  __device__ __forceinline__ void mma(Tiles<kStages>& tiles, Pipeline<kStages>& pipe,
                                      PipelineState<kStages>& state, const Tile& t,
                                      float (&sum)[kAccumulators], int consumer) const {
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) sum[i] = 0.f;
    // This tile's B scale rows: the gate and up halves' blocks, or the one block.
    const float* b_scales = b_scales_ + t.expert * s_expert_;
    const int gate_block = kBColumns == BColumns::kGateUpHalves ? t.n_tile / 2 : t.n_tile;
    const float* b_first = b_scales + gate_block * s_n_;
    const float* b_second =
        kBColumns == BColumns::kGateUpHalves ? b_scales + (up_block_ + gate_block) * s_n_ : b_first;
    const int row = Fragment::row0();
    const int a_offset = a_sorted_tma_ ? t.row0 & 3 : 0;
    const bool warp_leader = threadIdx.x % 32 == 0;
    float partial[kAccumulators];
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      float sb0 = 1.f, sb1 = 1.f;
      if constexpr (!kBRowScales) {
        sb0 = __ldg(b_first + kb * s_k_);
        sb1 = kBColumns == BColumns::kGateUpHalves ? __ldg(b_second + kb * s_k_) : sb0;
      }
      mbarrier_wait(&pipe.full[state.stage], state.phase);
      if constexpr (kGenericProxyA) fence_proxy_async_shared();
      const uint64_t desc_a = smem_desc_k_major_sw128(tiles.a[state.stage] + consumer * 64 * kBlockK);
      const uint64_t desc_b = smem_desc_k_major_sw128(tiles.b[state.stage]);
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) fence_operand(partial[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) {
        // 32 bytes along K per MMA: 2 descriptor units of 16 bytes.
        wgmma_e4m3_n128(partial, desc_a + 2 * kk, desc_b + 2 * kk, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      const float* a_scales = tiles.a_scales[state.stage] + a_offset + consumer * 64;
      const float sa[2] = {a_scales[row], a_scales[row + 8]};
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) fence_operand(partial[i]);
      if constexpr (kBRowScales) {
        const float* b_row_scales = tiles.b_scales[state.stage] + Fragment::col0();
#pragma unroll
        for (int q = 0; q < kBlockN / 8; ++q) {
          const float2 sb = *reinterpret_cast<const float2*>(b_row_scales + q * 8);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int i = Fragment::index(q, half, 0);
            sum[i] = fmaf(partial[i], sa[half] * sb.x, sum[i]);
            sum[i + 1] = fmaf(partial[i + 1], sa[half] * sb.y, sum[i + 1]);
          }
        }
      } else {
        const float scale[2][2] = {{sa[0] * sb0, sa[0] * sb1}, {sa[1] * sb0, sa[1] * sb1}};
#pragma unroll
        for (int q = 0; q < kBlockN / 8; ++q) {
          // The second half of a gate-up tile's columns are the up rows'.
          const int b_half = q < kBlockN / 16 ? 0 : 1;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int i = Fragment::index(q, half, j);
              sum[i] = fmaf(partial[i], scale[half][b_half], sum[i]);
            }
          }
        }
      }
      // The warp's reads of the stage (MMAs and scales) are done once its values are used.
      __syncwarp();
      if (warp_leader) mbarrier_arrive(&pipe.empty[state.stage]);
      state.advance();
    }
  }

 private:
  const float* b_scales_;
  int64_t s_expert_;
  int s_n_, s_k_, up_block_;
  bool a_sorted_tma_;
};

}  // namespace megamoe::sm90
