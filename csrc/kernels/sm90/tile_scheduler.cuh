// The tile scheduler of the grouped GEMM: which tiles exist and which block does which.
//
// Tiles are numbered, M-tile-major, and handed out round-robin over the persistent grid
// (tile blockIdx.x, then + gridDim.x, ...). The producer and both consumer warpgroups of a
// block walk this one sequence through for_each_tile, so they agree on every tile and on the
// order of the stages it fills.
//   Grouping::kM: tile = (M-tile, N-tile). M-tiles are the experts' row ranges cut into
//     kBlockM rows (tile_offsets[e] is expert e's first M-tile); a tile of an expert's last
//     M-tile may hold fewer rows. Every tile reduces the whole K.
//     With Params::short_offsets (RoutingPlan::short_tile_offsets), an expert's last M-tile
//     of at most 64 rows comes as n_tiles / 2 paired tiles (Tile::paired: N-tiles 2j and
//     2j + 1, one per consumer warpgroup) and, for an odd n_tiles, one plain tile of the last
//     N-tile: half the tiles for such an M-tile, and as many tiles fewer in the grid's walk.
//   Grouping::kK: tile = (expert, M-tile of its gradient, N-tile). The reduction runs over the
//     expert's padded rows, tile_offsets[e] * kBlockM.. (pad rows hold zeros).
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

template <Grouping kGrouping, int kBlockK, bool kPairs = false>
class TileScheduler {
 public:
  struct Params {
    const int32_t* tile_offsets;    // [E+1] first M-tile of each expert; [E] = all M-tiles
    const int32_t* expert_offsets;  // kM: [E+1] first sorted row of each expert
    int32_t num_experts;
    int32_t n_tiles;                // tiles along N
    int32_t k;                      // kM: the reduction length (a multiple of kBlockK)
    int32_t m;                      // kK: rows of an expert's gradient (a multiple of kBlockM)
    const int32_t* short_offsets;   // kM, optional [E+1]: pairs the short last M-tiles' N-tiles
  };

  static Params m_grouped(const int32_t* expert_offsets, const int32_t* tile_offsets,
                          int64_t num_experts, int64_t k, int64_t n_tiles,
                          const int32_t* short_offsets = nullptr) {
    static_assert(kGrouping == Grouping::kM);
    return {tile_offsets, expert_offsets, static_cast<int32_t>(num_experts),
            static_cast<int32_t>(n_tiles), static_cast<int32_t>(k), 0,
            kPairs && n_tiles > 1 ? short_offsets : nullptr};
  }
  static Params k_grouped(const int32_t* tile_offsets, int64_t num_experts, int64_t m,
                          int64_t n_tiles) {
    static_assert(kGrouping == Grouping::kK);
    return {tile_offsets, nullptr, static_cast<int32_t>(num_experts),
            static_cast<int32_t>(n_tiles), 0, static_cast<int32_t>(m), nullptr};
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
        num_tiles_(kGrouping == Grouping::kK
                       ? p.num_experts * (p.m / kBlockM) * p.n_tiles
                       : __ldg(&p.tile_offsets[p.num_experts]) * p.n_tiles -
                             (kPairs && p.short_offsets ? __ldg(&p.short_offsets[p.num_experts]) *
                                                    (p.n_tiles / 2)
                                              : 0)) {}

  // The one tile loop: calls f(tile) for this block's tiles, in order.
  template <class F>
  __device__ __forceinline__ void for_each_tile(F&& f) const {
    for (int tile = blockIdx.x; tile < num_tiles_; tile += gridDim.x) f(locate(tile));
  }

 private:
  __device__ __forceinline__ Tile locate(int tile) const {
    Tile t;
    if constexpr (kGrouping == Grouping::kM) {
      int m_tile, lo = 0;
      t.paired = 0;
      if (!kPairs || p_.short_offsets == nullptr) {
        m_tile = tile / p_.n_tiles;
        t.n_tile = tile % p_.n_tiles;
        // Last expert whose first M-tile is <= m_tile (experts with no tiles are skipped).
        int hi = p_.num_experts - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) >> 1;
          if (__ldg(&p_.tile_offsets[mid]) <= m_tile) lo = mid; else hi = mid - 1;
        }
      } else {
        // Expert e's tiles start at tile_offsets[e] * n_tiles - short_offsets[e] * pairs.
        const int pairs = p_.n_tiles / 2;
        const auto first = [&](int e) {
          return __ldg(&p_.tile_offsets[e]) * p_.n_tiles - __ldg(&p_.short_offsets[e]) * pairs;
        };
        int hi = p_.num_experts - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) >> 1;
          if (first(mid) <= tile) lo = mid; else hi = mid - 1;
        }
        const int m_first = __ldg(&p_.tile_offsets[lo]);
        const int m_last = __ldg(&p_.tile_offsets[lo + 1]) - 1;
        const bool short_last =
            __ldg(&p_.short_offsets[lo + 1]) != __ldg(&p_.short_offsets[lo]);
        const int local = tile - first(lo);
        const int plain = (m_last + 1 - m_first - short_last) * p_.n_tiles;
        if (local < plain) {
          m_tile = m_first + local / p_.n_tiles;
          t.n_tile = local % p_.n_tiles;
        } else {
          const int j = local - plain;
          m_tile = m_last;
          t.paired = j < pairs;
          t.n_tile = t.paired ? 2 * j : p_.n_tiles - 1;
        }
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
      t.paired = 0;
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
