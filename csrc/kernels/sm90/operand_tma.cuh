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

// The k-block index of a tile's k-block kb along the whole reduction: the row of a block-
// scale map (kK: the expert's reduction starts at k_row0).
template <class Mainloop>
__device__ __forceinline__ int scale_block(const Tile& t, int kb) {
  return t.k_row0 / Mainloop::kBlockK + kb;
}

// A by TMA from one thread. K-major A: Grouping::kM, the tile's rows (sorted or padded) of
// A [rows, K]; Grouping::kK (FP8 weight gradients, A^T stored token-contiguous), the
// tile's M rows of A [m, rows], at the k-block's tokens. MN-major A (Grouping::kK, A =
// [rows, m]): the tile's M columns, the rows of the k-block. A scaled mainloop (FP8) also
// brings the tile rows' block scales of the k-block into the stage.
template <class Mainloop, Grouping kGrouping = Grouping::kM>
struct ATma {
  static constexpr Major kMajor = Mainloop::kAMajor;
  static constexpr int kThreads = 1;
  static constexpr int kArrivals = 0;
  static constexpr int kScaleBytes = [] {
    if constexpr (Mainloop::kScaled) return Mainloop::kAScaleBox * int(sizeof(float));
    return 0;
  }();
  static constexpr int kTmaBytes = Mainloop::kTileBytesA + kScaleBytes;
  static constexpr bool kGenericProxy = false;

  struct Params {
    CUtensorMap map;
    CUtensorMap scale_map;  // scaled: [K / kBlockK, scale_cols] fp32
    int32_t padded;         // K-major, kM: A's rows are in the padded layout
  };
  // A = [rows, cols] (K-major kM: cols = K; kK: rows = m, cols = K; MN-major: cols = M).
  // Scaled: `scales` [cols / kBlockK, scale_cols], the scale of row r's k-block j at
  // scales[j * scale_cols + r]. A box of scales starts at a multiple of 4 (TMA's 16 bytes),
  // the tile's first row or up to 3 before it: the mainloop skips those (a sorted tile
  // starts at any row).
  static Params params(const void* a, int64_t rows, int64_t cols, bool padded,
                       const float* scales = nullptr, int64_t scale_cols = 0) {
    const int box_rows = kMajor == Major::kK ? kBlockM : Mainloop::kBlockK;
    Params p{make_tensor_map<typename Mainloop::Element>(a, rows, cols, box_rows), {}, padded};
    if constexpr (Mainloop::kScaled) {
      p.scale_map =
          make_scale_tensor_map(scales, cols / Mainloop::kBlockK, scale_cols, Mainloop::kAScaleBox);
    }
    return p;
  }

  __device__ __forceinline__ explicit ATma(const Params& p)
      : map_(p.map), scale_map_(p.scale_map), padded_(p.padded) {}
  __device__ __forceinline__ void prefetch() const {
    prefetch_tensor_map(&map_);
    if constexpr (Mainloop::kScaled) prefetch_tensor_map(&scale_map_);
  }
  __device__ __forceinline__ void begin_tile(const Tile&) {}
  template <class Tiles>
  __device__ __forceinline__ void load_tma(Tiles& tiles, int s, uint64_t* bar, const Tile& t,
                                           int kb) const {
    const int mn0 = kMajor == Major::kMN || kGrouping == Grouping::kK ? t.m0 : t.row(padded_);
    load_operand_tile<kMajor, kBlockM, Mainloop::kBlockK>(tiles.a[s], map_, bar, mn0,
                                                          t.k_row0 + kb * Mainloop::kBlockK);
    if constexpr (Mainloop::kScaled) {
      tma_load_2d(tiles.a_scales[s], &scale_map_, bar, mn0 & ~3, scale_block<Mainloop>(t, kb));
    }
  }
  template <class Tiles>
  __device__ __forceinline__ void load_async(Tiles&, int, uint64_t*, const Tile&, int) const {}
  // The tile's boxes into L2 (K-major, Grouping::kM only: the others are read once per
  // tile row anyway).
  __device__ __forceinline__ void prefetch_tile(const Tile& t) const {
    if constexpr (kMajor == Major::kK && kGrouping == Grouping::kM) {
      for (int kb = 0; kb < t.k_blocks; ++kb) {
        tma_prefetch_l2_2d(&map_, kb * Mainloop::kBlockK, t.row(padded_));
      }
    }
  }

 private:
  const CUtensorMap& map_;
  const CUtensorMap& scale_map_;
  bool padded_;
};

// B by TMA: the expert's weight rows of the tile's N-tile. K-major B_e is [n, K], rows
// expert * expert_rows.. of the map, at the k-block's columns (Grouping::kK: from the
// expert's k_row0); MN-major B_e is [K, n], K-rows expert * expert_rows + tile.k_row0..
// (Grouping::kK: expert_rows = 0, the expert's rows start at k_row0). A mainloop with
// per-row B scales (FP8 weight gradients) also brings the tile's N rows' scales of the
// k-block into the stage.
template <class Mainloop, BColumns kColumns_ = BColumns::kContiguous>
struct BTma {
  static constexpr Major kMajor = Mainloop::kBMajor;
  static constexpr BColumns kColumns = kColumns_;
  static constexpr int kBlockN = Mainloop::kBlockN;
  static constexpr bool kRowScales = Mainloop::kBRowScales;
  static constexpr int kBytes =
      Mainloop::kTileBytesB + (kRowScales ? kBlockN * int(sizeof(float)) : 0);
  static_assert(kColumns == BColumns::kContiguous || kMajor == Major::kK);

  struct Params {
    CUtensorMap map;
    CUtensorMap scale_map;  // per-row scales: [K / kBlockK, rows] fp32
    int32_t expert_rows;    // rows of the map per expert
    int32_t half_n;         // kGateUpHalves: I, where an expert's up rows start
  };
  // B = [rows, cols] row-major (K-major: cols = K; MN-major: cols = N). Per-row scales:
  // `row_scales` [cols / kBlockK, rows].
  static Params params(const void* b, int64_t rows, int64_t cols, int64_t expert_rows,
                       int64_t half_n = 0, const float* row_scales = nullptr) {
    const int box_rows = kMajor == Major::kMN ? Mainloop::kBlockK
                         : kColumns == BColumns::kGateUpHalves ? kBlockN / 2
                                                               : kBlockN;
    Params p{make_tensor_map<typename Mainloop::Element>(b, rows, cols, box_rows), {},
             static_cast<int32_t>(expert_rows), static_cast<int32_t>(half_n)};
    if constexpr (kRowScales) {
      p.scale_map = make_scale_tensor_map(row_scales, cols / Mainloop::kBlockK, rows, kBlockN);
    }
    return p;
  }

  __device__ __forceinline__ explicit BTma(const Params& p)
      : map_(p.map), scale_map_(p.scale_map), expert_rows_(p.expert_rows), half_n_(p.half_n) {}
  __device__ __forceinline__ void prefetch() const {
    prefetch_tensor_map(&map_);
    if constexpr (kRowScales) prefetch_tensor_map(&scale_map_);
  }
  template <class Tiles>
  __device__ __forceinline__ void load(Tiles& tiles, int s, uint64_t* bar, const Tile& t,
                                       int kb) const {
    constexpr int kBlockK = Mainloop::kBlockK;
    auto* dst = tiles.b[s];
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
                                                  t.k_row0 + kb * kBlockK);
    }
    if constexpr (kRowScales) {
      tma_load_2d(tiles.b_scales[s], &scale_map_, bar, t.n_tile * kBlockN,
                  scale_block<Mainloop>(t, kb));
    }
  }
  // The tile's boxes of every k-block into L2, where load() will find them.
  __device__ __forceinline__ void prefetch_tile(const Tile& t) const {
    constexpr int kBlockK = Mainloop::kBlockK;
    const int b_row = t.expert * expert_rows_;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      if constexpr (kMajor == Major::kMN) {
#pragma unroll
        for (int box = 0; box < kBlockN / 64; ++box) {
          tma_prefetch_l2_2d(&map_, t.n_tile * kBlockN + box * 64, b_row + t.k_row0 + kb * kBlockK);
        }
      } else if constexpr (kColumns == BColumns::kGateUpHalves) {
        const int n = t.n_tile * (kBlockN / 2);
        tma_prefetch_l2_2d(&map_, kb * kBlockK, b_row + n);
        tma_prefetch_l2_2d(&map_, kb * kBlockK, b_row + half_n_ + n);
      } else {
        tma_prefetch_l2_2d(&map_, t.k_row0 + kb * kBlockK, b_row + t.n_tile * kBlockN);
      }
    }
  }

 private:
  const CUtensorMap& map_;
  const CUtensorMap& scale_map_;
  int expert_rows_;
  int half_n_;
};

}  // namespace megamoe::sm90
