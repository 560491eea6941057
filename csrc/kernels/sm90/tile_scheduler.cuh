// The tile scheduler of the grouped GEMM: which tiles exist and which block does which.
//
// Tiles are numbered, M-tile-major, and handed out round-robin over the persistent grid
// (tile blockIdx.x, then + gridDim.x, ...). The producer and both consumer warpgroups of a
// block walk this one sequence through for_each_tile, so they agree on every tile and on the
// order of the stages it fills. In a GEMM whose producer passes its tiles (GroupedGemm's
// kPassesTiles), only the producer walks the order (for_each_tile_to_pass) and the consumers
// read each tile beside its first stage (for_each_passed_tile, Pipeline::tile); then the
// order can also be the one in which blocks ask (Params::dynamic): the producer takes the
// next number from a counter in global memory, so that a block that starts late, its SM
// held by another kernel, does fewer tiles instead of ending late. Which block computes a
// tile changes no bits.
//   Grouping::kM: tile = (M-tile, N-tile). M-tiles are the experts' row ranges cut into
//     kBlockM rows (tile_offsets[e] is expert e's first M-tile); a tile of an expert's last
//     M-tile may hold fewer rows. Every tile reduces the whole K.
//   Grouping::kK: tile = (expert, M-tile of its gradient, N-tile). The reduction runs over the
//     expert's padded rows, tile_offsets[e] * kBlockM.. (pad rows hold zeros).
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

template <Grouping kGrouping, int kBlockK>
class TileScheduler {
 public:
  struct Params {
    const int32_t* tile_offsets;    // [E+1] first M-tile of each expert; [E] = all M-tiles
    const int32_t* expert_offsets;  // kM: [E+1] first sorted row of each expert
    int32_t num_experts;
    int32_t n_tiles;                // tiles along N
    int32_t k;                      // kM: the reduction length (a multiple of kBlockK)
    int32_t m;                      // kK: rows of an expert's gradient (a multiple of kBlockM)
    // Null, or [2] zeros (the next tile to hand out, the blocks done), left zeros by the
    // launch: tiles handed out as the blocks' producers ask for them.
    int32_t* dynamic = nullptr;
    // kM, probe: 0, or the N-tiles of a group (a divisor of n_tiles); tiles then run N-group
    // by N-group, M-tile-major within a group (MEGAMOE_N_GROUP, read once).
    int32_t n_group = 0;
  };

  static Params m_grouped(const int32_t* expert_offsets, const int32_t* tile_offsets,
                          int64_t num_experts, int64_t k, int64_t n_tiles) {
    static_assert(kGrouping == Grouping::kM);
    return {tile_offsets, expert_offsets, static_cast<int32_t>(num_experts),
            static_cast<int32_t>(n_tiles), static_cast<int32_t>(k), 0};
  }
  static Params k_grouped(const int32_t* tile_offsets, int64_t num_experts, int64_t m,
                          int64_t n_tiles) {
    static_assert(kGrouping == Grouping::kK);
    return {tile_offsets, nullptr, static_cast<int32_t>(num_experts),
            static_cast<int32_t>(n_tiles), 0, static_cast<int32_t>(m)};
  }

  // A bound on the tiles, for the grid: the host does not know the counts. kM: one partial
  // M-tile per expert beyond the sorted rows' own (`rows`: sorted rows allocated).
  static int64_t max_tiles(const Params& p, int64_t rows) {
    if constexpr (kGrouping == Grouping::kM) {
      return ((rows + kBlockM - 1) / kBlockM + p.num_experts) * int64_t(p.n_tiles);
    } else {
      return int64_t(p.num_experts) * (p.m / kBlockM) * p.n_tiles;
    }
  }

  __device__ __forceinline__ explicit TileScheduler(const Params& p)
      : p_(p),
        num_tiles_(kGrouping == Grouping::kK ? p.num_experts * (p.m / kBlockM) * p.n_tiles
                                             : __ldg(&p.tile_offsets[p.num_experts]) * p.n_tiles) {}

  // The one tile loop: calls f(tile) for this block's tiles, in order.
  template <class F>
  __device__ __forceinline__ void for_each_tile(F&& f) const {
    for (int tile = blockIdx.x; tile < num_tiles_; tile += gridDim.x) f(locate(tile));
  }

  // The consumers' loop when the producer passes the tiles: f(tile) for each, read from its
  // first stage's slot (expert -1: no more) after that stage's full barrier; a tile without
  // k-blocks (kK: an expert without rows) came in a stage of its own, without operands.
  template <int kStages, class F>
  __device__ __forceinline__ void for_each_passed_tile(Pipeline<kStages>& pipe,
                                                       const PipelineState<kStages>& state,
                                                       F&& f) const {
    for (;;) {
      mbarrier_wait(&pipe.full[state.stage], state.phase);
      // A copy (the producer rewrites the slot), read by each warp's first lane and shuffled
      // to the others: each warp's first lane hands the stage back (the mainloops'
      // kConsumerArrivals), and compute-sanitizer's racecheck orders a read before the
      // slot's next write only through the reading thread's own arrival, not through
      // __syncwarp or the warpgroup's wgmma wait (tools/racecheck_probe.cu).
      const Tile t = (threadIdx.x % 32 == 0 ? pipe.tile[state.stage] : Tile{}).shuffled(0);
      if (t.expert < 0) break;
      f(t);
    }
  }

  __device__ __forceinline__ bool dynamic() const { return p_.dynamic != nullptr; }
  // The loop of a producer that passes its tiles to the consumers (one thread): f(tile) for
  // each tile this block gets, as handed out (dynamic) or round-robin, then done() once.
  template <class F, class Done>
  __device__ __forceinline__ void for_each_tile_to_pass(F&& f, Done&& done) const {
    const bool dyn = dynamic();
    for (int tile = dyn ? atomicAdd(&p_.dynamic[0], 1) : int(blockIdx.x); tile < num_tiles_;
         tile = dyn ? atomicAdd(&p_.dynamic[0], 1) : tile + int(gridDim.x)) {
      f(locate(tile));
    }
    done();
    // Every block has taken its last number once the last one counts itself done: that one
    // leaves the counter at zero for the next launch on the stream.
    if (dyn && atomicAdd(&p_.dynamic[1], 1) == int(gridDim.x) - 1) {
      atomicExch(&p_.dynamic[0], 0);
      atomicExch(&p_.dynamic[1], 0);
    }
  }

 private:
  __device__ __forceinline__ Tile locate(int tile) const {
    Tile t;
    if constexpr (kGrouping == Grouping::kM) {
      int m_tile;
      if (p_.n_group > 0) {
        const int span = (num_tiles_ / p_.n_tiles) * p_.n_group;
        const int group = tile / span, rest = tile % span;
        m_tile = rest / p_.n_group;
        t.n_tile = group * p_.n_group + rest % p_.n_group;
      } else {
        m_tile = tile / p_.n_tiles;
        t.n_tile = tile % p_.n_tiles;
      }
      // Last expert whose first M-tile is <= m_tile (experts with no tiles are skipped).
      int lo = 0, hi = p_.num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (__ldg(&p_.tile_offsets[mid]) <= m_tile) lo = mid; else hi = mid - 1;
      }
      t.expert = lo;
      t.row0 = __ldg(&p_.expert_offsets[lo]) + (m_tile - __ldg(&p_.tile_offsets[lo])) * kBlockM;
      t.rows = min(kBlockM, __ldg(&p_.expert_offsets[lo + 1]) - t.row0);
      t.padded_row0 = m_tile * kBlockM;
      t.m0 = 0;
      t.k_row0 = 0;
      t.k_blocks = p_.k / kBlockK;
    } else {
      const int m_tiles = p_.m / kBlockM;
      t.expert = tile / (m_tiles * p_.n_tiles);
      const int rest = tile % (m_tiles * p_.n_tiles);
      t.m0 = (rest / p_.n_tiles) * kBlockM;
      t.n_tile = rest % p_.n_tiles;
      t.row0 = t.padded_row0 = t.expert * p_.m + t.m0;
      t.rows = kBlockM;
      const int first = __ldg(&p_.tile_offsets[t.expert]);
      t.k_row0 = first * kBlockM;
      t.k_blocks = (__ldg(&p_.tile_offsets[t.expert + 1]) - first) * (kBlockM / kBlockK);
    }
    return t;
  }

  const Params p_;  // a copy: loads through a reference to the kernel's params are not hoisted
  int num_tiles_;
};

}  // namespace megamoe::sm90
