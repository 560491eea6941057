// Operand loaders of the producer (producer.cuh) that move tiles by TMA: A (ATma) and B
// (BTma), either major order, as the mainloop's kAMajor / kBMajor say.
//
// A loader: Params; kThreads (producer threads it needs), kArrivals (arrivals on a stage's
// full barrier besides the TMA thread's), kTmaBytes (bytes per stage it brings by TMA),
// kGenericProxy (it writes shared memory through the generic proxy); prefetch(),
// begin_tile(tile), load_tma(stage, bar, tile, kb) (the TMA thread) and load_async(...) (every
// producer thread). A loader that waits before a tile (e.g. on arrival counters) does so in
// begin_tile. B loader: Params, kBytes, prefetch(), load(stage, bar, tile, kb).
// Loaders keep their scalars in members and refer to the kernel's params only for the
// tensor maps (TMA wants their address): loads through a reference to the params are not
// hoisted across the inline asm around them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

// The tile of kRows M/N-rows x kBlockK of one k-block, 128 bytes per row along K: a K-major
// tile is one box of kRows rows at (k0, mn0); an MN-major one is kRows / 64 boxes of kBlockK
// K-rows x 64 elements, one after the other along M/N (see smem_desc_mn_major_sw128).
template <Major kMajor, int kRows, int kBlockK, class Element>
__device__ __forceinline__ void load_operand_tile(Element* dst, const CUtensorMap& map,
                                                  uint64_t* bar, int mn0, int k0) {
  if constexpr (kMajor == Major::kK) {
    tma_load_2d(dst, &map, bar, k0, mn0);
  } else {
#pragma unroll
    for (int box = 0; box < kRows / 64; ++box) {
      tma_load_2d(dst + box * 64 * kBlockK, &map, bar, mn0 + box * 64, k0);
    }
  }
}

// A by TMA from one thread. K-major A (Grouping::kM): the tile's rows, sorted or padded;
// MN-major A (Grouping::kK, A = [rows, m]): the tile's M columns, the rows of the k-block.
template <class Mainloop>
struct ATma {
  static constexpr Major kMajor = Mainloop::kAMajor;
  static constexpr int kThreads = 1;
  static constexpr int kArrivals = 0;
  static constexpr int kTmaBytes = Mainloop::kTileBytesA;
  static constexpr bool kGenericProxy = false;

  struct Params {
    CUtensorMap map;
    int32_t padded;  // K-major: A's rows are in the padded layout
  };
  // A = [rows, cols] (K-major: cols = K; MN-major: cols = M).
  static Params params(const void* a, int64_t rows, int64_t cols, bool padded) {
    const int box_rows = kMajor == Major::kK ? kBlockM : Mainloop::kBlockK;
    return {make_tensor_map<typename Mainloop::Element>(a, rows, cols, box_rows), padded};
  }

  __device__ __forceinline__ explicit ATma(const Params& p) : map_(p.map), padded_(p.padded) {}
  __device__ __forceinline__ void prefetch() const { prefetch_tensor_map(&map_); }
  __device__ __forceinline__ void begin_tile(const Tile&) {}
  __device__ __forceinline__ void load_tma(typename Mainloop::Element* dst, uint64_t* bar,
                                           const Tile& t, int kb) const {
    const int mn0 = kMajor == Major::kK ? t.row(padded_) : t.m0;
    load_operand_tile<kMajor, kBlockM, Mainloop::kBlockK>(dst, map_, bar, mn0,
                                                          t.k_row0 + kb * Mainloop::kBlockK);
  }
  __device__ __forceinline__ void load_async(typename Mainloop::Element*, uint64_t*, const Tile&,
                                             int) const {}

 private:
  const CUtensorMap& map_;
  bool padded_;
};

// B by TMA: the expert's weight rows of the tile's N-tile. K-major B_e is [n, K], rows
// expert * expert_rows.. of the map; MN-major B_e is [K, n], K-rows expert * expert_rows +
// tile.k_row0.. (Grouping::kK: expert_rows = 0, the expert's rows start at k_row0).
template <class Mainloop, BColumns kColumns_ = BColumns::kContiguous>
struct BTma {
  static constexpr Major kMajor = Mainloop::kBMajor;
  static constexpr BColumns kColumns = kColumns_;
  static constexpr int kBlockN = Mainloop::kBlockN;
  static constexpr int kBytes = Mainloop::kTileBytesB;
  static_assert(kColumns == BColumns::kContiguous || kMajor == Major::kK);

  struct Params {
    CUtensorMap map;
    int32_t expert_rows;  // rows of the map per expert
    int32_t half_n;       // kGateUpHalves: I, where an expert's up rows start
  };
  // B = [rows, cols] row-major (K-major: cols = K; MN-major: cols = N).
  static Params params(const void* b, int64_t rows, int64_t cols, int64_t expert_rows,
                       int64_t half_n = 0) {
    const int box_rows = kMajor == Major::kMN ? Mainloop::kBlockK
                         : kColumns == BColumns::kGateUpHalves ? kBlockN / 2
                                                               : kBlockN;
    return {make_tensor_map<typename Mainloop::Element>(b, rows, cols, box_rows),
            static_cast<int32_t>(expert_rows),
            static_cast<int32_t>(half_n)};
  }

  __device__ __forceinline__ explicit BTma(const Params& p)
      : map_(p.map), expert_rows_(p.expert_rows), half_n_(p.half_n) {}
  __device__ __forceinline__ void prefetch() const { prefetch_tensor_map(&map_); }
  __device__ __forceinline__ void load(typename Mainloop::Element* dst, uint64_t* bar,
                                       const Tile& t, int kb) const {
    constexpr int kBlockK = Mainloop::kBlockK;
    const int b_row = t.expert * expert_rows_;
    if constexpr (kMajor == Major::kMN) {
      load_operand_tile<kMajor, kBlockN, kBlockK>(dst, map_, bar, t.n_tile * kBlockN,
                                                  b_row + t.k_row0 + kb * kBlockK);
    } else if constexpr (kColumns == BColumns::kGateUpHalves) {
      const int n = t.n_tile * (kBlockN / 2);
      tma_load_2d(dst, &map_, bar, kb * kBlockK, b_row + n);
      tma_load_2d(dst + (kBlockN / 2) * kBlockK, &map_, bar, kb * kBlockK, b_row + half_n_ + n);
    } else {
      load_operand_tile<kMajor, kBlockN, kBlockK>(dst, map_, bar, b_row + t.n_tile * kBlockN,
                                                  kb * kBlockK);
    }
  }

 private:
  const CUtensorMap& map_;
  int expert_rows_;
  int half_n_;
};

}  // namespace megamoe::sm90
