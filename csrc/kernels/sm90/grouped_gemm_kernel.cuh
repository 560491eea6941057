// The grouped GEMM kernel, assembled from its parts, and its persistent launcher.
//
//   GroupedGemm<Grouping, Mainloop, ALoad, BLoad, Epilogue>
//     Grouping  -> TileScheduler (tile_scheduler.cuh): which tiles, in which order
//     Mainloop  (mainloop_bf16.cuh, mainloop_fp8.cuh): stage storage and the MMAs; owns the
//               element type
//     ALoad, BLoad (operand_tma.cuh, operand_gathered.cuh): how the producer fills a stage
//     Epilogue  (epilogue_*.cuh): what the accumulators become
//
// Warp-specialized and persistent: warpgroup 0 is the producer (producer.cuh), warpgroups 1
// and 2 each own 64 rows of the 128-row tile, run the mainloop into fp32 registers and then
// the epilogue. Producer and consumers meet in a ring of shared-memory stages (full / empty
// mbarriers, Pipeline); the stage count is what the shared-memory budget leaves after the
// epilogue's buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/common/sm_count.h"
#include "kernels/sm90/gemm_common.cuh"
#include "kernels/sm90/producer.cuh"
#include "kernels/sm90/tile_scheduler.cuh"
#include "kernels/sm90/tile_counters.h"

namespace megamoe::sm90 {

template <Grouping kGrouping_, class Mainloop_, class ALoad_, class BLoad_, class Epilogue_>
struct GroupedGemm {
  using Mainloop = Mainloop_;
  using ALoad = ALoad_;
  using BLoad = BLoad_;
  using Epilogue = Epilogue_;
  static constexpr Grouping kGrouping = kGrouping_;
  using Scheduler = TileScheduler<kGrouping, Mainloop::kBlockK>;
  using Producer = sm90::Producer<Mainloop, ALoad, BLoad>;
  // The producer locates each tile and passes it to the consumers beside its first stage,
  // so that the tiles can be handed out as blocks ask for them when the launch has counters
  // (tile_counters.h), round-robin otherwise: GEMMs whose producer is one TMA thread (a
  // 128-thread gathering producer has no registers for the loop's state at its 56) and
  // whose epilogue allows it; not the FP8 weight gradients, whose consumers spill 4 bytes
  // with it. In the others every warpgroup walks the round-robin order itself.
  static constexpr bool kPassesTiles = Producer::kThreads == 1 &&
                                        !round_robin_tiles_only<Epilogue>() &&
                                        !(kGrouping == Grouping::kK && Mainloop::kScaled);

  static_assert(Epilogue::kBlockN == Mainloop::kBlockN);
  static_assert(Epilogue::kBColumns == BLoad::kColumns, "the epilogue needs another B tile");
  // M-grouped A is [rows, K]. The weight gradient's A is [rows, m] (its tile M columns of
  // the expert's rows), or for FP8, whose wgmma reads K-major operands only, A^T [m, rows].
  static_assert(kGrouping == Grouping::kK || Mainloop::kAMajor == Major::kK);
  static_assert(kGrouping == Grouping::kM || ALoad::kThreads == 1);

  // The shared memory of a block with kS stages: the epilogue's staging first (swizzle
  // aligned at the start), then the stage ring, its barriers and the epilogue's. Only the
  // start of each stage tile needs 1024-byte alignment; the FP8 mainloop's scales follow the
  // tiles unaligned, so they take their bytes and no rounding to a 1024-byte multiple.
  template <int kS>
  struct alignas(1024) Storage {
    typename Epilogue::Buffers epilogue;
    alignas(1024) typename Mainloop::template Tiles<kS> tiles;
    Pipeline<kS> pipeline;
    typename Epilogue::Barriers epilogue_barriers;
  };
  template <int kS>
  static constexpr bool kFits = sizeof(Storage<kS>) <= kMaxSharedBytes;
  // As many stages as fit in the 227 KB a block may have, counted byte for byte (a stage
  // short of the limit is latency the ring cannot hide: the wide FP8 GEMMs sit within a few
  // KB of one more stage).
  template <int kS>
  static constexpr int most_stages() {
    if constexpr (kS <= 2 || kFits<kS>) {
      return kS;
    } else {
      return most_stages<kS - 1>();
    }
  }
  static constexpr int kStages = most_stages<kMaxSharedBytes / Mainloop::kStageBytes>();

  struct Params {
    typename Scheduler::Params scheduler;
    typename ALoad::Params a;
    typename BLoad::Params b;
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
  };

  using SharedStorage = Storage<kStages>;
  // The kernel's dynamic shared memory is declared 1024-aligned (and checked), so the
  // storage needs no slack for aligning it by hand.
  static constexpr size_t kSharedBytes = sizeof(SharedStorage);
  static_assert(kSharedBytes <= kMaxSharedBytes);
  static_assert(offsetof(SharedStorage, epilogue) % 1024 == 0, "staging must be swizzle-aligned");
  static_assert(offsetof(SharedStorage, tiles) % 1024 == 0, "tiles must be swizzle-aligned");
  static_assert(kStages >= 2);
};

template <class Gemm>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ typename Gemm::Params p) {
  using Mainloop = typename Gemm::Mainloop;
  using Epilogue = typename Gemm::Epilogue;
  using Producer = typename Gemm::Producer;
  constexpr int kStages = Gemm::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename Gemm::SharedStorage*>(smem_raw);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    // The swizzled tiles and staging need 1024-byte alignment; a kernel of this family has
    // no static shared memory, so the dynamic one starts at an aligned address.
    if (__cvta_generic_to_shared(smem_raw) % 1024 != 0) __trap();
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&smem.pipeline.full[s], Producer::kFullArrivals);
      mbarrier_init(&smem.pipeline.empty[s], 2 * Mainloop::kConsumerArrivals);
    }
    Epilogue::init(smem.epilogue_barriers);
    fence_barrier_init();
  }
  __syncthreads();

  const typename Gemm::Scheduler scheduler(p.scheduler);
  if (warpgroup == 0) {
    // The producer needs few registers: give them to the consumers' accumulators.
    setmaxnreg_dec<Mainloop::Registers::kProducerRegisters>();
    if (Producer::kThreads == 128 || threadIdx.x == 0) {
      Producer::template run<Gemm::kPassesTiles>(p.a, p.b, p.mainloop, scheduler, smem.tiles,
                                                  smem.pipeline);
    }
    return;
  }

  setmaxnreg_inc<Mainloop::Registers::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  Epilogue epilogue(p.epilogue, smem.epilogue, smem.epilogue_barriers, consumer);
  const Mainloop mainloop(p.mainloop);
  float acc[Mainloop::kAccumulators];
  PipelineState<kStages> state;
  const auto run_tile = [&](const Tile& t) {
    epilogue.begin_tile(t);
    mainloop.template mma<Gemm::ALoad::kGenericProxy>(smem.tiles, smem.pipeline, state, t, acc,
                                                      consumer);
    epilogue.store(t, acc);
  };
  if constexpr (Gemm::kPassesTiles) {
    // The producer passes each tile (in either order): the consumers never locate one.
    scheduler.for_each_passed_tile(smem.pipeline, state, [&](const Tile& t) {
      // A tile without k-blocks came alone in its stage: hand the stage back.
      if (t.k_blocks == 0) {
        Mainloop::release_unread(smem.pipeline, state);
        state.advance();
      }
      run_tile(t);
    });
  } else {
    scheduler.for_each_tile(run_tile);
  }
  epilogue.finish();
}

// The one launcher: a persistent grid of min(tiles, SMs) blocks over `max_tiles`, a bound
// on the tiles (the scheduler's). Nothing to do is no launch.
template <class Gemm>
void launch_grouped_gemm(const typename Gemm::Params& params, int64_t max_tiles,
                         cudaStream_t stream) {
  if (max_tiles <= 0) return;
  typename Gemm::Params p = params;
  if constexpr (Gemm::kPassesTiles) {
    p.scheduler.dynamic = dynamic_tile_counters(stream);  // null unless switched on
  }
  if constexpr (Gemm::kGrouping == Grouping::kM) {
    const int group = n_group_switch();
    if (group > 0 && p.scheduler.n_tiles % group == 0) p.scheduler.n_group = group;
  }
  const int sms = sm_count(/*tiles_handed_out=*/p.scheduler.dynamic != nullptr);
  const int grid = static_cast<int>(max_tiles < sms ? max_tiles : sms);
  auto* kernel = &grouped_gemm_kernel<Gemm>;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(Gemm::kSharedBytes)));
  kernel<<<grid, kThreads, Gemm::kSharedBytes, stream>>>(p);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::sm90
