// The bf16 wgmma mainloop of the grouped GEMM: the shared-memory stages it reads and the
// MMAs of one tile into a consumer warpgroup's fp32 accumulators.
//
// A mainloop is the part that knows the operands' element type and the MMA: it declares
// Element, kBlockN, kBlockK (K per stage: 128 bytes of a row), the majors of A and B, the
// tile bytes of a stage, Tiles<kStages> (its stage storage), Params (its constructor's),
// kExtraTmaBytes with load_extras() (per-stage loads besides A and B, issued by the
// producer's TMA thread), kScaled / kBRowScales (which block scales the loaders bring into
// a stage), kConsumerArrivals and mma(). The loaders and the tile scheduler take the element
// type, kBlockK and the tile bytes from it. Another element type is another file with the
// same members, chosen in gemm_variants.cuh: mainloop_fp8.cuh is blockwise FP8.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

template <int kBlockN_, Major kAMajor_, Major kBMajor_>
struct MainloopBf16 {
  static_assert(kBlockN_ == 128 || kBlockN_ == 256);
  using Element = __nv_bfloat16;
  static constexpr int kBlockN = kBlockN_;
  static constexpr Major kAMajor = kAMajor_;
  static constexpr Major kBMajor = kBMajor_;
  static constexpr int kBlockK = 64;
  static constexpr int kTileBytesA = kBlockM * kBlockK * 2;
  static constexpr int kTileBytesB = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kAccumulators = kBlockN / 2;  // per consumer thread (m64nNk16)
  static constexpr int kExtraTmaBytes = 0;
  static constexpr bool kScaled = false;      // no block scales (see mainloop_fp8.cuh)
  static constexpr bool kBRowScales = false;
  // Arrivals per consumer warpgroup that release a stage: one per warp, by its first lane.
  // The MMAs' reads are covered by wgmma_wait, which spans the warpgroup; the other reads of
  // a stage are of a passed tile's slot (for_each_passed_tile), by each warp's first lane, so
  // every thread that reads a stage hands it back itself (racecheck sees no order otherwise).
  static constexpr int kConsumerArrivals = 4;
  using Registers = WideConsumerRegisters;

  // Descriptor strides (bytes) of an MN-major B tile; the defaults of the host API describe
  // the layout the TMA boxes produce (see smem_desc_mn_major_sw128).
  struct Params {
    uint32_t b_lbo, b_sbo;
  };

  template <int kStages>
  struct Tiles {
    Element a[kStages][kBlockM * kBlockK];
    Element b[kStages][kBlockN * kBlockK];
  };

  __device__ __forceinline__ explicit MainloopBf16(const Params& p)
      : b_lbo_(p.b_lbo), b_sbo_(p.b_sbo) {}

  template <int kStages>
  __device__ __forceinline__ void load_extras(Tiles<kStages>&, int, uint64_t*, const Tile&,
                                              int) const {}

  // A stage this warpgroup did not read (it carried a tile without k-blocks): its
  // arrival, as after reading it.
  template <int kStages>
  __device__ __forceinline__ static void release_unread(Pipeline<kStages>& pipe,
                                                        const PipelineState<kStages>& state) {
    if (lane_id() == 0) mbarrier_arrive(&pipe.empty[state.stage]);
  }

  // The tile's MMAs for consumer warpgroup `consumer` (its 64 rows of the tile), walking the
  // ring from `state`. kGenericProxyA: A was written through the generic proxy (cp.async).
  template <bool kGenericProxyA, int kStages>
  __device__ __forceinline__ void mma(Tiles<kStages>& tiles, Pipeline<kStages>& pipe,
                                      PipelineState<kStages>& state, const Tile& t,
                                      float (&acc)[kAccumulators], int consumer) const {
    const bool releases = lane_id() == 0;
    int previous = -1;
    if (t.k_blocks == 0) {  // an expert without rows: its weight gradient is zero
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.f;
    }
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      mbarrier_wait(&pipe.full[state.stage], state.phase);
      if constexpr (kGenericProxyA) fence_proxy_async_shared();
      // This warpgroup's 64 rows of A: rows 64 c.. of a K-major tile, the 64-element box c
      // of an MN-major one; either way 64 * kBlockK elements in.
      const uint64_t desc_a = descriptor<kAMajor>(tiles.a[state.stage] + consumer * 64 * kBlockK,
                                                  64 * 128, 8 * 128);
      const uint64_t desc_b = descriptor<kBMajor>(tiles.b[state.stage], b_lbo_, b_sbo_);
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        wgmma_bf16<kBlockN, kBMajor == Major::kMN ? 1 : 0, kAMajor == Major::kMN ? 1 : 0>(
            acc, desc_a + kStepK<kAMajor> * kk, desc_b + kStepK<kBMajor> * kk,
            (kb > 0 || kk > 0) ? 1 : 0);
      }
      wgmma_commit();
      // Keep this k-block's MMAs in flight; the previous block's are done, so its stage
      // can go back to the producer.
      wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) fence_operand(acc[i]);
      if (previous >= 0 && releases) mbarrier_arrive(&pipe.empty[previous]);
      previous = state.stage;
      state.advance();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) fence_operand(acc[i]);
    if (previous >= 0 && releases) mbarrier_arrive(&pipe.empty[previous]);
  }

 private:
  template <Major kMajor>
  __device__ __forceinline__ static uint64_t descriptor(const Element* tile, uint32_t lbo,
                                                        uint32_t sbo) {
    if constexpr (kMajor == Major::kK) {
      return smem_desc_k_major_sw128(tile);
    } else {
      return smem_desc_mn_major_sw128(tile, lbo, sbo);
    }
  }
  // One k-step of 16 elements in the descriptor's 16-byte address units: 32 bytes along a
  // K-major row, 16 rows of 128 bytes of an MN-major tile.
  template <Major kMajor>
  static constexpr int kStepK = kMajor == Major::kK ? 2 : 16 * 128 / 16;

  uint32_t b_lbo_, b_sbo_;
};

}  // namespace megamoe::sm90
