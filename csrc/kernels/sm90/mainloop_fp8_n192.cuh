// A blockwise-FP8 mainloop that keeps its own MMAs in flight while it promotes (opt-in,
// MEGAMOE_FP8_N192; not measured yet): the plain-store M-grouped FP8 GEMMs (weights scaled
// per 128 x 128 block, B rows contiguous) in 128 x 192 tiles.
//
// Why: MainloopFp8 waits for each 128-column group's MMAs before it promotes them (sum +=
// partial * sa * sb), so every promotion is time the warpgroup's tensor-core work stands
// still; the other consumer warpgroup's MMAs do not hide it all (docs/experiments.md). Its
// 256-wide tile has no registers for a second scratch: 128 sums and a 64-register scratch
// already fill the consumers' 232. A 192-wide tile as two 96-column groups (m64n96k32) has
// 96 sums and two 48-register scratches, the same 192 accumulators, and while one group is
// promoted the other's MMAs run. ptxas keeps the wgmma asynchronous only in straight-line
// code: a group carried in flight across the k-loop's back edge makes it serialize every
// wgmma of the kernel (C7514/C7517; the compile-only probe on branch probe-fp8-n96-chunks).
// So the loop runs k-blocks in chunks of two, straight-line, every group waited for by the
// chunk's end, and a trailing odd k-block as a chunk of one:
//
//   issue g0(kb), issue g1(kb); wait<1>: promote g0(kb)
//   issue g0(kb+1);             wait<1>: release stage kb, promote g1(kb)
//   issue g1(kb+1);             wait<1>: promote g0(kb+1)
//                               wait<0>: release stage kb+1, promote g1(kb+1)
//
// Only the chunk's last promotion has no MMAs of this warpgroup behind it (one in four
// instead of every one). Stage kb goes back once both its groups' MMAs are complete (the
// second wait) and the warp's A scales of it are in registers (read after its MMAs were
// issued; release()'s fence makes them complete before the arrival).
//
// B scales. N-tile j covers B rows [192j, 192j + 192): two 128-row scale blocks, b = 3j/2
// (rounded down) and b + 1, which the two groups straddle. Even j: group 0 is block b's rows
// 0-95; group 1 block b's rows 96-127 (its columns 0-31) then block b + 1's. Odd j: group 0
// is block b's rows 64-127 (its columns 0-63) then block b + 1's; group 1 block b + 1's.
// In the fragment's 8-column chunks q (0..11 per group, column 8q + ...), with lo, hi the
// scales of b, b + 1 and mid = (j odd ? hi : lo): group 0 takes lo for q < 8 and mid for the
// others, group 1 mid for q < 4 and hi for the others. One select per k-block chooses mid.
//
// Ragged N: the entries' N (multiples of 128) need not be multiples of 192, so the last
// N-tile may reach past the expert's B rows (by 64 or 128). Its loads read on into the next
// expert's rows (B is one [E * n, K] tensor map; past the last expert TMA fills zeros), which
// only the out-of-range output columns depend on: the epilogue masks them
// (StoreEpilogue's cols). Block b + 1 of such a tile may be past the expert's scale rows:
// its index is clamped to the last one (it scales those masked columns only).
//
// Same members as MainloopFp8<BScales::kBlocks128> (see there), which GroupedGemm and the
// loaders use; Params adds n_blocks.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/gemm_common.cuh"
#include "kernels/sm90/mainloop_fp8.cuh"

namespace megamoe::sm90 {

struct MainloopFp8N192Chunks {
  using Element = __nv_fp8_e4m3;
  static constexpr BScales kBScales = BScales::kBlocks128;
  static constexpr BColumns kBColumns = BColumns::kContiguous;
  static constexpr int kBlockN = 192;
  static constexpr int kGroupN = 96;  // columns of one MMA group (m64n96k32), promoted alone
  static constexpr int kPartials = kGroupN / 2;  // one group's scratch per thread
  static constexpr Major kAMajor = Major::kK;
  static constexpr Major kBMajor = Major::kK;
  static constexpr int kBlockK = 128;
  static constexpr bool kScaled = true;
  static constexpr bool kBRowScales = false;
  static constexpr int kBRowScaleSlots = 4;  // unused (block scales come from global memory)
  static constexpr int kAScaleBox = kBlockM + 4;  // as MainloopFp8's
  static constexpr int kAScaleSlots = 160;
  static constexpr int kTileBytesA = kBlockM * kBlockK;
  static constexpr int kTileBytesB = kBlockN * kBlockK;
  static constexpr int kStageBytes =
      kTileBytesA + kTileBytesB + int(sizeof(float)) * (kAScaleSlots + kBRowScaleSlots);
  static_assert(kTileBytesA % 1024 == 0 && kTileBytesB % 1024 == 0, "swizzle atoms per stage");
  static constexpr int kAccumulators = kBlockN / 2;  // 96 sums
  static constexpr int kExtraTmaBytes = 0;
  static constexpr int kConsumerArrivals = 4;  // each warp reads the stage's A scales
  // 96 sums and two 48-float scratches: the 192 accumulators of MainloopFp8's wide tile.
  using Registers = RegisterSplit<40, 232>;

  // Group 1's B rows start 96 rows into the stage's B tile. A K-major 128-byte-swizzled tile
  // is 8-row groups of 1024 bytes (the swizzle atom; the descriptor's stride byte offset),
  // so row 96 starts atom 12: 12 KB, 768 descriptor units of 16 bytes, on an atom boundary
  // (the swizzle pattern's phase is the atom's, as at the tile's start).
  static constexpr uint64_t kGroup1DescOffset = (kGroupN / 8) * 1024 / 16;
  static_assert(kGroupN % 8 == 0 && kGroup1DescOffset == 768);

  struct Params {
    const float* b_scales;
    int64_t s_expert;
    int32_t s_n, s_k;
    int32_t up_block;  // unused (contiguous B); kept so that the launcher fills both alike
    int32_t a_sorted_tma;
    int32_t n_blocks;  // 128-row scale blocks of an expert (N / 128): the clamp of b + 1
  };

  template <int kStages>
  struct Tiles {
    Element a[kStages][kBlockM * kBlockK];
    Element b[kStages][kBlockN * kBlockK];
    float a_scales[kStages][kAScaleSlots];
    float b_scales[kStages][kBRowScaleSlots];
  };

  __device__ __forceinline__ explicit MainloopFp8N192Chunks(const Params& p)
      : b_scales_(p.b_scales), s_expert_(p.s_expert), s_n_(p.s_n), s_k_(p.s_k),
        a_sorted_tma_(p.a_sorted_tma), n_blocks_(p.n_blocks) {}

  template <int kStages>
  __device__ __forceinline__ void load_extras(Tiles<kStages>&, int, uint64_t*, const Tile&,
                                              int) const {}

  template <bool kGenericProxyA, int kStages>
  __device__ __forceinline__ void mma(Tiles<kStages>& tiles, Pipeline<kStages>& pipe,
                                      PipelineState<kStages>& state, const Tile& t,
                                      float (&sum)[kAccumulators], int consumer) const {
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) sum[i] = 0.f;
    const float* b_scales = b_scales_ + t.expert * s_expert_;
    const int block = t.n_tile * 3 / 2;  // the block of the tile's first B row
    const float* row_lo = b_scales + block * s_n_;
    const float* row_hi = b_scales + min(block + 1, n_blocks_ - 1) * s_n_;
    const bool odd = t.n_tile & 1;
    const int a_offset = a_sorted_tma_ ? t.row0 & 3 : 0;
    const bool warp_leader = threadIdx.x % 32 == 0;
    const StepOf<kStages> step{tiles, pipe, consumer, a_offset, warp_leader};
    float acc0[kPartials], acc1[kPartials];  // groups 0 and 1's scratch

    int kb = 0;
    for (; kb + 2 <= t.k_blocks; kb += 2) {
      // The chunk's B scales first: global loads, whose latency the first waits cover.
      BScalesOf s0 = b_scales_of(row_lo, row_hi, kb, odd);
      BScalesOf s1 = b_scales_of(row_lo, row_hi, kb + 1, odd);
      PipelineState<kStages> next = state;
      next.advance();
      // k-block kb: both groups in flight, then group 0 promoted behind group 1.
      const Descs d0 = step.template wait_full<kGenericProxyA>(state);
      issue(acc0, d0.a, d0.b);
      issue(acc1, d0.a, d0.b + kGroup1DescOffset);
      float sa0[2];
      step.read_a_scales(state, sa0);
      wgmma_wait<1>();
      fence_all(acc0);
      promote(acc0, sum, 0, sa0, s0.lo, s0.mid, 8);
      // k-block kb + 1's group 0 goes in before group 1 of kb is promoted.
      const Descs d1 = step.template wait_full<kGenericProxyA>(next);
      issue(acc0, d1.a, d1.b);
      wgmma_wait<1>();
      fence_all(acc1);
      // Both groups of kb are complete and sa0 is in registers: stage kb goes back.
      step.release_stage(state);
      promote(acc1, sum, kPartials, sa0, s0.mid, s0.hi, 4);
      issue(acc1, d1.a, d1.b + kGroup1DescOffset);
      float sa1[2];
      step.read_a_scales(next, sa1);
      wgmma_wait<1>();
      fence_all(acc0);
      promote(acc0, sum, 0, sa1, s1.lo, s1.mid, 8);
      wgmma_wait<0>();
      fence_all(acc1);
      step.release_stage(next);
      promote(acc1, sum, kPartials, sa1, s1.mid, s1.hi, 4);
      state = next;
      state.advance();
    }
    if (kb < t.k_blocks) {
      // An odd k-block count's last k-block: a chunk of one; group 0's promotion still
      // runs behind group 1's MMAs.
      BScalesOf s0 = b_scales_of(row_lo, row_hi, kb, odd);
      const Descs d0 = step.template wait_full<kGenericProxyA>(state);
      issue(acc0, d0.a, d0.b);
      issue(acc1, d0.a, d0.b + kGroup1DescOffset);
      float sa0[2];
      step.read_a_scales(state, sa0);
      wgmma_wait<1>();
      fence_all(acc0);
      promote(acc0, sum, 0, sa0, s0.lo, s0.mid, 8);
      wgmma_wait<0>();
      fence_all(acc1);
      step.release_stage(state);
      promote(acc1, sum, kPartials, sa0, s0.mid, s0.hi, 4);
      state.advance();
    }
  }

  // A stage this warpgroup did not read: its arrivals, as after reading it (GroupedGemm's
  // passed tiles without k-blocks; M-grouped tiles always have k-blocks).
  template <int kStages>
  __device__ __forceinline__ static void release_unread(Pipeline<kStages>& pipe,
                                                        const PipelineState<kStages>& state) {
    MainloopFp8<BScales::kBlocks128>::release(pipe, state, threadIdx.x % 32 == 0);
  }

 private:
  struct Descs {
    uint64_t a, b;
  };
  // A k-block's two B block scales (lo: block b, hi: block b + 1) and the one group 0's last
  // and group 1's first columns take (mid).
  struct BScalesOf {
    float lo, mid, hi;
  };
  __device__ __forceinline__ BScalesOf b_scales_of(const float* row_lo, const float* row_hi,
                                                   int kb, bool odd) const {
    const float lo = __ldg(row_lo + kb * s_k_);
    const float hi = __ldg(row_hi + kb * s_k_);
    return {lo, odd ? hi : lo, hi};
  }

  // What one k-block's steps need of the stage ring and the warpgroup.
  template <int kStages>
  struct StepOf {
    Tiles<kStages>& tiles;
    Pipeline<kStages>& pipe;
    int consumer;
    int a_offset;
    bool warp_leader;

    // Waits for the stage's operands; its A (this warpgroup's 64 rows) and B descriptors.
    template <bool kGenericProxyA>
    __device__ __forceinline__ Descs wait_full(const PipelineState<kStages>& s) const {
      mbarrier_wait(&pipe.full[s.stage], s.phase);
      if constexpr (kGenericProxyA) fence_proxy_async_shared();
      return {smem_desc_k_major_sw128(tiles.a[s.stage] + consumer * 64 * kBlockK),
              smem_desc_k_major_sw128(tiles.b[s.stage])};
    }
    // This thread's two rows' A scales of the stage's k-block.
    __device__ __forceinline__ void read_a_scales(const PipelineState<kStages>& s,
                                                  float (&sa)[2]) const {
      const float* a_scales = tiles.a_scales[s.stage] + a_offset + consumer * 64;
      const int row = Fragment::row0();
      sa[0] = a_scales[row];
      sa[1] = a_scales[row + 8];
    }
    __device__ __forceinline__ void release_stage(const PipelineState<kStages>& s) const {
      MainloopFp8<BScales::kBlocks128>::release(pipe, s, warp_leader);
    }
  };

  // One group's four MMAs of a k-block (K = 32 each: 2 descriptor units of 16 bytes along K)
  // into its scratch, overwriting it, as one commit group.
  __device__ __forceinline__ static void issue(float (&acc)[kPartials], uint64_t desc_a,
                                               uint64_t desc_b) {
    fence_all(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 32; ++kk) {
      wgmma_e4m3_n96(acc, desc_a + 2 * kk, desc_b + 2 * kk, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  __device__ __forceinline__ static void fence_all(float (&acc)[kPartials]) {
#pragma unroll
    for (int i = 0; i < kPartials; ++i) fence_operand(acc[i]);
  }

  // sum[first..first + 47] += acc * sa * sb: sb_first for the group's chunks q < split,
  // sb_second for the others (first and split are constants once inlined).
  __device__ __forceinline__ static void promote(const float (&acc)[kPartials],
                                                 float (&sum)[kAccumulators], int first,
                                                 const float (&sa)[2], float sb_first,
                                                 float sb_second, int split) {
    const float scale[2][2] = {{sa[0] * sb_first, sa[1] * sb_first},
                               {sa[0] * sb_second, sa[1] * sb_second}};
#pragma unroll
    for (int q = 0; q < kGroupN / 8; ++q) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = Fragment::index(q, half, j);
          sum[first + i] = fmaf(acc[i], scale[q < split ? 0 : 1][half], sum[first + i]);
        }
      }
    }
  }

  const float* b_scales_;
  int64_t s_expert_;
  int s_n_, s_k_;
  bool a_sorted_tma_;
  int n_blocks_;
};

}  // namespace megamoe::sm90
