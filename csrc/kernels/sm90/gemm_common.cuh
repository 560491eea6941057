// Shapes, enums and the stage ring shared by the parts of the grouped GEMM
// (grouped_gemm_kernel.cuh assembles them).
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace megamoe::sm90 {

constexpr int kBlockM = 128;  // rows of a tile: 64 for each consumer warpgroup
constexpr int kThreads = 384;  // warpgroup 0 produces, warpgroups 1 and 2 consume
constexpr int kMaxSharedBytes = 227 * 1024;  // dynamic shared memory a block may have
// A racecheck build (CMake option MEGAMOE_RACECHECK_ARRIVALS): the pipeline's consumers
// arrive thread by thread where they otherwise arrive warp by warp (mainloop_fp8.cuh).
#ifdef MEGAMOE_RACECHECK_ARRIVALS
constexpr bool kRacecheckArrivals = true;
#else
constexpr bool kRacecheckArrivals = false;
#endif
constexpr int kStoreBoxCols = 64;  // epilogue TMA boxes: 64 rows x 64 bf16 (128 B)
constexpr int kStoreBoxBytes = 64 * kStoreBoxCols * 2;

// Which index of an operand is contiguous in memory: K (A [rows, K], B_e [N, K]) or the M/N
// one (B_e [K, N]; the weight gradient's A [rows, M] and B [rows, N], K being the rows).
enum class Major { kK, kMN };

// What the experts split. kM: each expert owns a range of rows of A and C, all with the full
// K (forward, dgrad). kK: each expert owns a range of the reduction's rows and its own C
// (weight gradients).
enum class Grouping { kM, kK };

// How the N-tile of a B tile maps to B's rows (K-major B). kContiguous: N-tile j is rows
// j * kBlockN.. of the expert's B. kGateUpHalves: its first half is the gate rows
// j * kBlockN / 2.. and its second half the up rows I + j * kBlockN / 2.. (SwiGLU needs both
// halves of an output column in one thread's accumulators).
enum class BColumns { kContiguous, kGateUpHalves };

// The kernel's hardware named barriers (bar.sync ids). Each consumer warpgroup syncs its own
// 128 threads around the shared-memory staging of its epilogue on kConsumer0 + its index.
enum class NamedBarrier : int {
  kSyncThreads = 0,  // __syncthreads's
  kConsumer0 = 1,
  kConsumer1 = 2,
};
__device__ __forceinline__ void consumer_barrier_sync(int consumer) {
  named_barrier_sync(static_cast<int>(NamedBarrier::kConsumer0) + consumer, 128);
}

// setmaxnreg only moves registers within the block's launch allocation (384 x 168): what
// the consumers gain, 256 x (C - 168), must equal what the producer gives up,
// 128 x (168 - P); a larger total makes the consumers' setmaxnreg.inc wait forever. A
// mainloop picks its split (P, C) with RegisterSplit.
template <int kProducer, int kConsumer>
struct RegisterSplit {
  static_assert(256 * (kConsumer - 168) == 128 * (168 - kProducer) && kConsumer % 8 == 0);
  static constexpr int kProducerRegisters = kProducer;
  static constexpr int kConsumerRegisters = kConsumer;
};
// The bf16 mainloop's 256-wide tiles keep 128 accumulators per consumer thread.
using WideConsumerRegisters = RegisterSplit<56, 224>;

// One tile of work, as the tile scheduler hands it to the producer and the consumers.
struct Tile {
  int expert;
  int n_tile;
  int rows;         // rows that hold data (fewer than kBlockM in an expert's last M-tile)
  // kM: the tile's first row in the expert-sorted order, and in the padded layout (expert e's
  // rows from tile_offsets[e] * kBlockM, pad rows up to the next multiple of kBlockM).
  // kK: both are the tile's first row of C ([E * m, n], the experts' gradients stacked).
  int row0, padded_row0;
  int m0;           // kK: the tile's first row of the expert's gradient (a column of A)
  int k_row0;       // kK: the expert's first padded row, where its reduction starts; kM: 0
  int k_blocks;     // k-blocks to reduce (0 for an expert without rows: C is zero)
  __device__ __forceinline__ int row(bool padded) const { return padded ? padded_row0 : row0; }
  // Lane `src`'s tile, in every lane of the warp (field by field: a whole-struct copy
  // through an int array would put the tile in local memory).
  __device__ __forceinline__ Tile shuffled(int src) const {
    static_assert(sizeof(Tile) == 8 * sizeof(int), "shuffle each of Tile's fields");
    Tile t;
    t.expert = __shfl_sync(~0u, expert, src);
    t.n_tile = __shfl_sync(~0u, n_tile, src);
    t.rows = __shfl_sync(~0u, rows, src);
    t.row0 = __shfl_sync(~0u, row0, src);
    t.padded_row0 = __shfl_sync(~0u, padded_row0, src);
    t.m0 = __shfl_sync(~0u, m0, src);
    t.k_row0 = __shfl_sync(~0u, k_row0, src);
    t.k_blocks = __shfl_sync(~0u, k_blocks, src);
    return t;
  }
};

// The ring of shared-memory stages between the producer and the consumers: a stage's `full`
// barrier completes when its operands have landed, its `empty` barrier when both consumer
// warpgroups are done reading it. A producer that passes its tiles (GroupedGemm's
// kPassesTiles) also writes into `tile[s]` the tile whose first k-block stage s holds (a
// tile without k-blocks, or expert -1 for "no more", in a stage of its own without
// operands), before the stage's full barrier.
template <int kStages>
struct Pipeline {
  uint64_t full[kStages];
  uint64_t empty[kStages];
  Tile tile[kStages];
};

// A walker's position in the ring: the stage and the parity of its barriers' current phase.
// The producer and each consumer warpgroup hold one and advance it once per k-block.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};


}  // namespace megamoe::sm90
