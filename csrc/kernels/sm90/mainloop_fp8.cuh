// The blockwise-FP8 wgmma mainloop of the grouped GEMM (the DeepSeek-V3 recipe): e4m3 A and
// B, both K-major, with fp32 scales per 128 of K. A has one scale per row and k-block (1x128
// blocks), brought into each stage by the A loader. B has either one scale per 128 x 128
// block of the expert's weight (kBlocks128; read from global memory, one scalar per k-block
// and 128 columns of the tile), or one per row and k-block like A (kRows: the weight
// gradients, whose B is an activation; brought into the stage by the B loader). kRowTiles is
// kRows with each 128 rows' scales equal (the activation quantized in 128 x 128 tiles, its
// tile's scale repeated for each row): promoted with one scale per 128 columns, as
// kBlocks128, instead of a product sa * sb per element.
//
// Hopper's FP8 wgmma keeps fewer bits than fp32 while it accumulates, so each k-block's
// partial products go into scratch accumulators, which are then scaled and added into the
// fp32 sums the epilogue receives: sum += partial * sa * sb. The warpgroup waits for its MMAs
// before that promotion; the other consumer warpgroup's MMAs keep the tensor cores busy
// meanwhile. The scratch holds 128 columns (four m64n128k32 MMAs per k-block): a 256-wide
// tile runs and promotes its two 128-column halves in turn, so its sums (128 per thread)
// and one scratch (64) fit the consumers' registers. The wide tile moves 48 bytes of A and B
// per 128 x 256 x 128 MMA block instead of 64 per two 128 x 128 ones: less L2 and
// shared-memory traffic per FLOP, which is what limits the narrow tile at the FP8 rate.
//
// Same members as MainloopBf16 (see there), plus kScaled / kBRowScales for the loaders and
// kConsumerArrivals: every warp reads the stage's scales, so each warp releases the stage.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

enum class BScales { kBlocks128, kRows, kRowTiles };

template <BScales kBScales_, BColumns kBColumns_ = BColumns::kContiguous, int kBlockN_ = 128>
struct MainloopFp8 {
  using Element = __nv_fp8_e4m3;
  static constexpr BScales kBScales = kBScales_;
  static constexpr BColumns kBColumns = kBColumns_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHalves = kBlockN / 128;  // 128-column MMA groups, each promoted alone
  static_assert(kBlockN == 128 || kBlockN == 256);
  static constexpr Major kAMajor = Major::kK;
  static constexpr Major kBMajor = Major::kK;
  static constexpr int kBlockK = 128;  // one scale block; 128 bytes of a row
  static constexpr bool kScaled = true;
  static constexpr bool kBRowScales = kBScales != BScales::kBlocks128;  // in the stage
  static constexpr int kBRowScaleSlots = kBRowScales ? kBlockN : 4;
  // A's scales of a stage: a TMA box starts at a multiple of 4 rows, up to 3 before the
  // tile's first (sorted rows), so it holds 128 + 4; slots are kept 128-byte aligned.
  static constexpr int kAScaleBox = kBlockM + 4;
  static constexpr int kAScaleSlots = 160;
  static constexpr int kTileBytesA = kBlockM * kBlockK;
  static constexpr int kTileBytesB = kBlockN * kBlockK;
  static constexpr int kStageBytes =
      kTileBytesA + kTileBytesB + int(sizeof(float)) * (kAScaleSlots + kBRowScaleSlots);
  static_assert(kTileBytesA % 1024 == 0 && kTileBytesB % 1024 == 0, "swizzle atoms per stage");
  static constexpr int kAccumulators = kBlockN / 2;
  static constexpr int kPartials = 64;  // one 128-column group's scratch
  static constexpr int kExtraTmaBytes = 0;
  // Each warp's first lane hands the stage back for its warp; in a racecheck build
  // (MEGAMOE_RACECHECK_ARRIVALS, a CMake option) every consumer thread does, because
  // racecheck orders a thread's reads of the stage (the A scales) before the stage's next
  // fill only through that thread's own arrival, not through __syncwarp
  // (tools/racecheck_probe.cu).
  static constexpr int kConsumerArrivals = kRacecheckArrivals ? 128 : 4;
  // Narrow: 128 accumulators per consumer thread (sums and scratch) leave room to give the
  // producer more (its row gather also copies the rows' scales). Wide: 192 (128 sums, 64
  // scratch); its A comes by TMA, so the producer's one thread needs few.
  using Registers =
      std::conditional_t<kBlockN == 128, RegisterSplit<72, 216>, RegisterSplit<40, 232>>;
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

  // Each stage's A and B tiles are 1024-byte multiples (swizzle atoms) from a 1024-aligned
  // start (GroupedGemm's Storage); the scales after them need 16-byte (TMA) alignment only.
  template <int kStages>
  struct Tiles {
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
    // The B scale rows of the tile's 128-column groups. Gate-up tiles: group 0 of a wide tile
    // (the first half of a narrow one) is gate rows, the other up rows of the same block.
    const float* b_scales = b_scales_ + t.expert * s_expert_;
    const float* b_rows[2];
    if constexpr (kBColumns == BColumns::kGateUpHalves) {
      const int gate_block = t.n_tile * (kBlockN / 2) / 128;
      b_rows[0] = b_scales + gate_block * s_n_;
      b_rows[1] = b_scales + (up_block_ + gate_block) * s_n_;
    } else {
      b_rows[0] = b_scales + t.n_tile * kHalves * s_n_;
      b_rows[1] = b_rows[0] + (kHalves - 1) * s_n_;
    }
    const int row = Fragment::row0();
    const int a_offset = a_sorted_tma_ ? t.row0 & 3 : 0;
    const bool warp_leader = threadIdx.x % 32 == 0;
    float partial[kPartials];
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      float sb[2] = {1.f, 1.f};
      if constexpr (!kBRowScales) {
        sb[0] = __ldg(b_rows[0] + kb * s_k_);
        // A narrow contiguous tile lies in one block: its second scale is the first.
        constexpr bool kTwoBlocks = kHalves == 2 || kBColumns == BColumns::kGateUpHalves;
        sb[1] = kTwoBlocks ? __ldg(b_rows[1] + kb * s_k_) : sb[0];
      }
      mbarrier_wait(&pipe.full[state.stage], state.phase);
      if constexpr (kGenericProxyA) fence_proxy_async_shared();
      const uint64_t desc_a = smem_desc_k_major_sw128(tiles.a[state.stage] + consumer * 64 * kBlockK);
      const uint64_t desc_b = smem_desc_k_major_sw128(tiles.b[state.stage]);
      const float* a_scales = tiles.a_scales[state.stage] + a_offset + consumer * 64;
      float sa[2];
#pragma unroll
      for (int g = 0; g < kHalves; ++g) {
#pragma unroll
        for (int i = 0; i < kPartials; ++i) fence_operand(partial[i]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 32; ++kk) {
          // 32 bytes along K per MMA: 2 descriptor units of 16 bytes; group g's B rows start
          // 128 rows (16 KB, 1024 units) in.
          wgmma_e4m3_n128(partial, desc_a + 2 * kk, desc_b + g * 1024 + 2 * kk, kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        if (g == 0) {
          sa[0] = a_scales[row];
          sa[1] = a_scales[row + 8];
        }
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kPartials; ++i) fence_operand(partial[i]);
        // Block scales: after the last group's MMAs the warp has read all of the stage it
        // needs (its A scales are in registers), so the stage goes back before the last
        // promotion.
        if constexpr (!kBRowScales) {
          if (g == kHalves - 1) release(pipe, state, warp_leader);
        }
        // A narrow gate-up tile's group is 64 gate and 64 up columns, each with its block.
        if constexpr (kHalves == 2) {
          promote(tiles, state, g, partial, sum, sa, sb[g], sb[g]);
        } else {
          promote(tiles, state, g, partial, sum, sa, sb[0], sb[1]);
        }
      }
      if constexpr (kBRowScales) release(pipe, state, warp_leader);
      state.advance();
    }
  }

  // sum[group g's columns] += partial * sa * sb: B's scale per row (kRows: the stage's) or
  // one per 128 x 128 block (sb_lo for the group's first 64 columns, sb_hi for the others;
  // kRowTiles: the stage's first row's of the group, for all of them).
  template <int kStages>
  __device__ __forceinline__ static void promote(const Tiles<kStages>& tiles,
                                                 const PipelineState<kStages>& state, int g,
                                                 const float (&partial)[kPartials],
                                                 float (&sum)[kAccumulators], const float (&sa)[2],
                                                 float sb_lo, float sb_hi) {
    const int group = g * kPartials;  // g is a constant once the caller's loop unrolls
    if constexpr (kBScales == BScales::kRows) {
      const float* b_row_scales = tiles.b_scales[state.stage] + g * 128 + Fragment::col0();
#pragma unroll
      for (int q = 0; q < 128 / 8; ++q) {
        const float2 sbq = *reinterpret_cast<const float2*>(b_row_scales + q * 8);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = Fragment::index(q, half, 0);
          sum[group + i] = fmaf(partial[i], sa[half] * sbq.x, sum[group + i]);
          sum[group + i + 1] = fmaf(partial[i + 1], sa[half] * sbq.y, sum[group + i + 1]);
        }
      }
    } else {
      if constexpr (kBScales == BScales::kRowTiles) {
        sb_lo = sb_hi = tiles.b_scales[state.stage][g * 128];
      }
      const float scale[2][2] = {{sa[0] * sb_lo, sa[1] * sb_lo}, {sa[0] * sb_hi, sa[1] * sb_hi}};
#pragma unroll
      for (int q = 0; q < 128 / 8; ++q) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int i = Fragment::index(q, half, j);
            sum[group + i] = fmaf(partial[i], scale[q < 8 ? 0 : 1][half], sum[group + i]);
          }
        }
      }
    }
  }

  // A stage this warpgroup did not read (it carried a tile without k-blocks): its
  // arrivals, as after reading it.
  template <int kStages>
  __device__ __forceinline__ static void release_unread(Pipeline<kStages>& pipe,
                                                        const PipelineState<kStages>& state) {
    release(pipe, state, threadIdx.x % 32 == 0);
  }

  // The warp's reads of the stage are done: its leader's arrival (one of kConsumerArrivals).
  // The fence makes "done" true: ptxas issues the last scale loads (LDS) just before the
  // arrival and uses their values only after it, and nothing else waits for them, so the
  // arrival could reach the barrier first and the producer's next TMA fill of the stage
  // land before a load had read it (seen as wrong 16 x 8 blocks of the FP8 weight
  // gradients' fp32 output, whose code ptxas scheduled that way).
  template <int kStages>
  __device__ __forceinline__ static void release(Pipeline<kStages>& pipe,
                                                 const PipelineState<kStages>& state,
                                                 bool warp_leader) {
    __threadfence_block();
    __syncwarp();
    if (kRacecheckArrivals || warp_leader) mbarrier_arrive(&pipe.empty[state.stage]);
  }

 private:
  const float* b_scales_;
  int64_t s_expert_;
  int s_n_, s_k_, up_block_;
  bool a_sorted_tma_;
};

}  // namespace megamoe::sm90
