// The producer warpgroup of the grouped GEMM: fills the ring of stages with each tile's
// k-blocks of A and B, in the tile scheduler's order, through an A loader and a B loader
// (operand_tma.cuh, operand_gathered.cuh). Thread 0 issues the TMA loads and the stage's
// expect_tx; an A loader that needs the whole warpgroup (kThreads = 128) adds its threads'
// copies and arrivals.
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

// 0: none; 1: the next tile's B into L2; 2: its A too.
#ifndef MEGAMOE_PREFETCH_NEXT_TILE
#define MEGAMOE_PREFETCH_NEXT_TILE 1
#endif

namespace megamoe::sm90 {

template <class Mainloop, class ALoad, class BLoad>
struct Producer {
  static_assert(ALoad::kThreads == 1 || ALoad::kThreads == 128);
  static constexpr int kThreads = ALoad::kThreads;
  // Arrivals that complete a stage's full barrier: the TMA thread's expect_tx, plus the A
  // loader's own.
  static constexpr int kFullArrivals = 1 + ALoad::kArrivals;
  static constexpr int kTmaBytes = ALoad::kTmaBytes + BLoad::kBytes + Mainloop::kExtraTmaBytes;

  // Run by threads 0..kThreads-1 of warpgroup 0.
  template <class Scheduler, int kStages>
  __device__ __forceinline__ static void run(const typename ALoad::Params& a_params,
                                             const typename BLoad::Params& b_params,
                                             const typename Mainloop::Params& mainloop_params,
                                             const Scheduler& scheduler,
                                             typename Mainloop::template Tiles<kStages>& tiles,
                                             Pipeline<kStages>& pipe) {
    const bool tma_thread = kThreads == 1 || threadIdx.x == 0;
    ALoad a(a_params);
    const BLoad b(b_params);
    const Mainloop mainloop(mainloop_params);
    if (tma_thread) {
      a.prefetch();
      b.prefetch();
    }
    PipelineState<kStages> state;
    if constexpr (kThreads > 1) {  // the gathering producers have no registers to spare
      scheduler.for_each_tile([&](const Tile& t) {
        a.begin_tile(t);
        for (int kb = 0; kb < t.k_blocks; ++kb) {
          const int s = state.stage;
          mbarrier_wait(&pipe.empty[s], state.phase ^ 1);
          if (tma_thread) {
            mbarrier_arrive_expect_tx(&pipe.full[s], kTmaBytes);
            a.load_tma(tiles, s, &pipe.full[s], t, kb);
            b.load(tiles, s, &pipe.full[s], t, kb);
            mainloop.load_extras(tiles, s, &pipe.full[s], t, kb);
          }
          a.load_async(tiles, s, &pipe.full[s], t, kb);
          state.advance();
        }
      });
      return;
    }
    const int count = scheduler.num_tiles();
    int tile = blockIdx.x;
    if (tile >= count) return;
    Tile t = scheduler.at(tile);
    while (true) {
      // The block's next tile, located once its first loads are out (and then reused as
      // the current one): with many experts its weights would otherwise come from DRAM
      // while its first stages wait, so its boxes go into L2 now.
      const int after = tile + int(gridDim.x);
      const bool has_next = after < count;
      Tile next = t;
      bool located = false;
      a.begin_tile(t);
      for (int kb = 0; kb < t.k_blocks; ++kb) {
        const int s = state.stage;
        mbarrier_wait(&pipe.empty[s], state.phase ^ 1);
        if (tma_thread) {
          mbarrier_arrive_expect_tx(&pipe.full[s], kTmaBytes);
          a.load_tma(tiles, s, &pipe.full[s], t, kb);
          b.load(tiles, s, &pipe.full[s], t, kb);
          mainloop.load_extras(tiles, s, &pipe.full[s], t, kb);
        }
        a.load_async(tiles, s, &pipe.full[s], t, kb);
        state.advance();
#if MEGAMOE_PREFETCH_NEXT_TILE > 0
        if (kb == 0 && has_next) {
          next = scheduler.at(after);
          located = true;
          if (tma_thread) {
            b.prefetch_tile(next);
            if constexpr (MEGAMOE_PREFETCH_NEXT_TILE > 1) a.prefetch_tile(next);
          }
        }
#endif
      }
      if (!has_next) return;
      t = located ? next : scheduler.at(after);
      tile = after;
    }
  }
};

}  // namespace megamoe::sm90
