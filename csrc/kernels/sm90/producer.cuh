// The producer warpgroup of the grouped GEMM: fills the ring of stages with each tile's
// k-blocks of A and B, in the tile scheduler's order, through an A loader and a B loader
// (operand_tma.cuh, operand_gathered.cuh). Thread 0 issues the TMA loads and the stage's
// expect_tx; an A loader that needs the whole warpgroup (kThreads = 128) adds its threads'
// copies and arrivals.
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

template <class Mainloop, class ALoad, class BLoad>
struct Producer {
  static_assert(ALoad::kThreads == 1 || ALoad::kThreads == 128);
  static constexpr int kThreads = ALoad::kThreads;
  // Arrivals that complete a stage's full barrier: the TMA thread's expect_tx, plus the A
  // loader's own.
  static constexpr int kFullArrivals = 1 + ALoad::kArrivals;
  static constexpr int kTmaBytes = ALoad::kTmaBytes + BLoad::kBytes + Mainloop::kExtraTmaBytes;

  // Run by threads 0..kThreads-1 of warpgroup 0. kPass (one producer thread): each tile
  // passed to the consumers beside its first stage (Pipeline::tile), in the order the
  // scheduler hands them out (TileScheduler::for_each_tile_to_pass), and an end marker.
  template <bool kPass, class Scheduler, int kStages>
  __device__ __forceinline__ static void run(const typename ALoad::Params& a_params,
                                             const typename BLoad::Params& b_params,
                                             const typename Mainloop::Params& mainloop_params,
                                             const Scheduler& scheduler,
                                             typename Mainloop::template Tiles<kStages>& tiles,
                                             Pipeline<kStages>& pipe) {
    const bool tma_thread = kThreads == 1 || threadIdx.x == 0;
    ALoad a(a_params);
    const BLoad b(b_params);
    if (tma_thread) {
      a.prefetch();
      b.prefetch();
    }
    PipelineState<kStages> state;
    // kPass: a stage without operands that carries `t` to the consumers (a tile without
    // k-blocks, or expert -1: no more), its full barrier completed by the one arrival a
    // filled stage gets from the (only) producer thread.
    const auto pass_alone = [&](const Tile& t) {
      const int s = state.stage;
      mbarrier_wait(&pipe.empty[s], state.phase ^ 1);
      pipe.tile[s] = t;
      mbarrier_arrive(&pipe.full[s]);
      state.advance();
    };
    const auto produce = [&](const Tile& t) {
      a.begin_tile(t);
      if (kPass && t.k_blocks == 0) pass_alone(t);
      for (int kb = 0; kb < t.k_blocks; ++kb) {
        const int s = state.stage;
        mbarrier_wait(&pipe.empty[s], state.phase ^ 1);
        if (tma_thread) {
          if (kPass && kb == 0) pipe.tile[s] = t;  // for the consumers (Pipeline::tile)
          // Before the arrival: the mainloop's own copies into the stage (FP8: B's block
          // scales) must hold the phase open from the start.
          Mainloop::load_extras(mainloop_params, tiles, s, &pipe.full[s], t, kb);
          mbarrier_arrive_expect_tx(&pipe.full[s], kTmaBytes);
          a.load_tma(tiles, s, &pipe.full[s], t, kb);
          b.load(tiles, s, &pipe.full[s], t, kb);
        }
        a.load_async(tiles, s, &pipe.full[s], t, kb);
        state.advance();
      }
    };
    if constexpr (kPass) {
      static_assert(kThreads == 1 && kFullArrivals == 1);
      Tile none{};
      none.expert = -1;
      scheduler.for_each_tile_to_pass(produce, [&] { pass_alone(none); });
    } else {
      scheduler.for_each_tile(produce);
    }
  }
};

}  // namespace megamoe::sm90
