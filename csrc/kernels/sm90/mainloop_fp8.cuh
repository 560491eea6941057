// The blockwise-FP8 wgmma mainloop of the grouped GEMM (the DeepSeek-V3 recipe): e4m3 A and
// B, both K-major, with fp32 scales per 128 of K. A has one scale per row and k-block (1x128
// blocks), brought into each stage by the A loader. B has either one scale per 128 x 128
// block of the expert's weight (kBlocks128; read from global memory, one scalar per k-block
// and 128 columns of the tile), or one per row and k-block like A (kRows: the weight
// gradients, whose B is an activation; brought into the stage by the B loader).
//
// Hopper's FP8 wgmma keeps fewer bits than fp32 while it accumulates, so each k-block's
// partial products go into scratch accumulators, which are then scaled and added into the
// fp32 sums the epilogue receives: sum += partial * sa * sb. The k-block's columns run as
// 64-column quarters (four m64n64k32 MMAs each) into two 32-register scratches in turn: a
// warpgroup issues quarter j + 1 (the next k-block's first after a k-block's last) before it
// waits for quarter j and promotes it, so its own MMAs keep running through its promotions.
// (Both warpgroups wait on the same full barriers and the tensor cores run their MMAs side by
// side, so they tend to finish together; with one scratch they then promoted together while
// the tensor cores idled.) The sums (128 per thread on a 256-wide tile) and both scratches
// (64) fit the consumers' registers. The wide tile moves 48 bytes of A and B per 128 x 256 x
// 128 MMA block instead of 64 per two 128 x 128 ones: less L2 and shared-memory traffic per
// FLOP, which is what limits the narrow tile at the FP8 rate.
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

enum class BScales { kBlocks128, kRows };

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
  static_assert(kTileBytesA % 1024 == 0 && kTileBytesB % 1024 == 0, "swizzle atoms per stage");
  static constexpr int kAccumulators = kBlockN / 2;
  static constexpr int kQuarters = kBlockN / 64;  // 64-column MMA quarters per k-block
  static constexpr int kQuarterPartials = 32;     // one quarter's scratch
  static constexpr int kExtraTmaBytes = 0;
  static constexpr int kConsumerArrivals = 4;
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
    if (t.k_blocks == 0) return;
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
    // Quarters of 64 columns into two scratches in turn: quarter q + 1's MMAs are issued
    // before quarter q's wait, so they run while it is promoted. (Issuing the next k-block's
    // first quarter before the last one's promotion, across the loop's back edge, makes
    // ptxas serialize every wgmma: C7514.)
    float scratch0[kQuarterPartials], scratch1[kQuarterPartials];
    const Scales scales{b_rows[0], b_rows[1], s_k_, a_offset + consumer * 64, row};
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      k_block<kGenericProxyA>(tiles, pipe, state, kb, scales, scratch0, scratch1, sum, consumer);
    }
  }

  // Where a k-block's scales are: B's block-scale rows (b_rows, k-block kb at kb * s_k), and
  // this thread's A-scale slot in a stage.
  struct Scales {
    const float* b_rows[2];
    int s_k;
    int a_slot;  // the stage's A scales of this warpgroup's rows start here
    int row;     // Fragment::row0()
  };

  // One k-block: waits for its stage, issues quarter 0, then per quarter q issues q + 1
  // (but after the last), waits for q and promotes it.
  template <bool kGenericProxyA, int kStages>
  __device__ __forceinline__ void k_block(Tiles<kStages>& tiles, Pipeline<kStages>& pipe,
                                          PipelineState<kStages>& state, int kb,
                                          const Scales& scales,
                                          float (&scratch0)[kQuarterPartials],
                                          float (&scratch1)[kQuarterPartials],
                                          float (&sum)[kAccumulators], int consumer) const {
    float sb[2] = {1.f, 1.f};
    if constexpr (!kBRowScales) {
      sb[0] = __ldg(scales.b_rows[0] + kb * scales.s_k);
      // A narrow contiguous tile lies in one block: its second scale is the first.
      constexpr bool kTwoBlocks = kHalves == 2 || kBColumns == BColumns::kGateUpHalves;
      sb[1] = kTwoBlocks ? __ldg(scales.b_rows[1] + kb * scales.s_k) : sb[0];
    }
    mbarrier_wait(&pipe.full[state.stage], state.phase);
    if constexpr (kGenericProxyA) fence_proxy_async_shared();
    issue_quarter(tiles, state, 0, scratch0, consumer);
    float sa[2];
#pragma unroll
    for (int q = 0; q < kQuarters; ++q) {
      // q is a constant once the loop unrolls: the scratches' roles are fixed per quarter.
      if (q % 2 == 0) {
        quarter(tiles, pipe, state, q, scales, sb, sa, scratch0, scratch1, consumer, sum);
      } else {
        quarter(tiles, pipe, state, q, scales, sb, sa, scratch1, scratch0, consumer, sum);
      }
    }
    if constexpr (kBRowScales) release(pipe, state, threadIdx.x % 32 == 0);
    state.advance();
  }

  // Quarter q of a k-block: quarter q + 1's MMAs into `next` unless q is the last, then q's
  // wait and its promotion out of `current`.
  template <int kStages>
  __device__ __forceinline__ void quarter(Tiles<kStages>& tiles, Pipeline<kStages>& pipe,
                                          const PipelineState<kStages>& state, int q,
                                          const Scales& scales, const float (&sb)[2],
                                          float (&sa)[2], float (&current)[kQuarterPartials],
                                          float (&next)[kQuarterPartials], int consumer,
                                          float (&sum)[kAccumulators]) const {
    if (q + 1 < kQuarters) {
      issue_quarter(tiles, state, q + 1, next, consumer);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
#pragma unroll
    for (int i = 0; i < kQuarterPartials; ++i) fence_operand(current[i]);
    if (q == 0) {
      const float* a_scales = tiles.a_scales[state.stage] + scales.a_slot;
      sa[0] = a_scales[scales.row];
      sa[1] = a_scales[scales.row + 8];
    }
    // Block scales: after the last quarter's MMAs the warp has read all of the stage it
    // needs (its A scales are in registers), so the stage goes back before the last
    // promotion.
    if constexpr (!kBRowScales) {
      if (q == kQuarters - 1) release(pipe, state, threadIdx.x % 32 == 0);
    }
    // A wide tile's 128-column group g (quarters 2g, 2g + 1) has one block scale; a narrow
    // tile's two quarters each have theirs (a gate-up tile's 64 gate and 64 up columns).
    promote(tiles, state, q, current, sum, sa, kHalves == 2 ? sb[q / 2] : sb[q]);
#pragma unroll
    for (int i = 0; i < kQuarterPartials; ++i) fence_operand(current[i]);
  }

  // Issues quarter q's MMAs (64 columns over the k-block's 128 of K) from the stage into
  // `scratch`.
  template <int kStages>
  __device__ __forceinline__ static void issue_quarter(Tiles<kStages>& tiles,
                                                       const PipelineState<kStages>& state, int q,
                                                       float (&scratch)[kQuarterPartials],
                                                       int consumer) {
    const uint64_t desc_a = smem_desc_k_major_sw128(tiles.a[state.stage] + consumer * 64 * kBlockK);
    // Quarter q's B rows start 64 q rows (8 KB, 512 descriptor units of 16 bytes) in.
    const uint64_t desc_b = smem_desc_k_major_sw128(tiles.b[state.stage]) + q * 512;
#pragma unroll
    for (int i = 0; i < kQuarterPartials; ++i) fence_operand(scratch[i]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 32; ++kk) {
      // 32 bytes along K per MMA: 2 descriptor units of 16 bytes.
      wgmma_e4m3_n64(scratch, desc_a + 2 * kk, desc_b + 2 * kk, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }

  // sum[quarter q's columns] += partial * sa * sb: B's scale per row (the stage's) or the
  // quarter's block scale sb.
  template <int kStages>
  __device__ __forceinline__ static void promote(const Tiles<kStages>& tiles,
                                                 const PipelineState<kStages>& state, int q,
                                                 const float (&partial)[kQuarterPartials],
                                                 float (&sum)[kAccumulators], const float (&sa)[2],
                                                 float sb) {
    const int base = q * kQuarterPartials;  // q is a constant once the caller's loop unrolls
    if constexpr (kBRowScales) {
      const float* b_row_scales = tiles.b_scales[state.stage] + q * 64 + Fragment::col0();
#pragma unroll
      for (int c = 0; c < 64 / 8; ++c) {
        const float2 sbc = *reinterpret_cast<const float2*>(b_row_scales + c * 8);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = Fragment::index(c, half, 0);
          sum[base + i] = fmaf(partial[i], sa[half] * sbc.x, sum[base + i]);
          sum[base + i + 1] = fmaf(partial[i + 1], sa[half] * sbc.y, sum[base + i + 1]);
        }
      }
    } else {
      const float scale[2] = {sa[0] * sb, sa[1] * sb};
#pragma unroll
      for (int c = 0; c < 64 / 8; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int i = Fragment::index(c, half, j);
            sum[base + i] = fmaf(partial[i], scale[half], sum[base + i]);
          }
        }
      }
    }
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
    if (warp_leader) mbarrier_arrive(&pipe.empty[state.stage]);
  }

 private:
  const float* b_scales_;
  int64_t s_expert_;
  int s_n_, s_k_, up_block_;
  bool a_sorted_tma_;
};

}  // namespace megamoe::sm90
