// A loader (see operand_tma.cuh) that gathers A's rows straight from a token matrix with
// cp.async: sorted row r is row row_index[r] of the source, so no permuted copy of the
// tokens is ever written. TMA cannot express a row gather, hence the whole producer
// warpgroup copies: each warp instruction covers 4 rows x 128 contiguous bytes. A scaled
// mainloop (FP8) also gets each row's block scale of the k-block, copied by one of the 8
// threads that copy the row (the one whose chunk index is the row's index among its rows).
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

template <class Mainloop>
struct AGathered {
  static_assert(Mainloop::kAMajor == Major::kK);
  static_assert(Mainloop::kBlockK * sizeof(typename Mainloop::Element) == 128);
  using Element = typename Mainloop::Element;
  static constexpr int kThreads = 128;
  static constexpr int kArrivals = 128;  // each thread's cp.async arrival
  static constexpr int kTmaBytes = 0;
  // cp.async writes through the generic proxy; wgmma reads through the async one.
  static constexpr bool kGenericProxy = true;

  struct Params {
    const Element* source;     // [source rows, k] row-major
    const int32_t* row_index;  // [sorted rows]
    int32_t k;
    // Scaled: the scale of source row r's k-block j at scales[j * scale_ld + r].
    const float* scales;
    int32_t scale_ld;
  };
  static Params params(const void* source, const int32_t* row_index, int64_t k,
                       const float* scales = nullptr, int64_t scale_ld = 0) {
    return {static_cast<const Element*>(source), row_index, static_cast<int32_t>(k), scales,
            static_cast<int32_t>(scale_ld)};
  }

  __device__ __forceinline__ explicit AGathered(const Params& p) : p_(p) {}
  __device__ __forceinline__ void prefetch() const {}

  // The token of each of this thread's rows; -1 past the expert's end (never copied: their
  // shared memory is left as it is). 32-bit to stay inside the producer's 56 registers.
  __device__ __forceinline__ void begin_tile(const Tile& t) {
    const int thread = threadIdx.x;  // 0..127
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = thread / 8 + 16 * i;
      token_[i] = r < t.rows ? __ldg(&p_.row_index[t.row0 + r]) : -1;
    }
  }

  template <class Tiles>
  __device__ __forceinline__ void load_tma(Tiles&, int, uint64_t*, const Tile&, int) const {}

  // This thread's 16-byte chunk of each of its rows, into TMA's 128-byte swizzle (the layout
  // the wgmma descriptors expect): chunk c of row r lands at chunk c ^ (r % 8).
  template <class Tiles>
  __device__ __forceinline__ void load_async(Tiles& tiles, int s, uint64_t* bar, const Tile&,
                                             int kb) const {
    const int thread = threadIdx.x;
    const int chunk = thread % 8;
    uint8_t* a_tile = reinterpret_cast<uint8_t*>(tiles.a[s]);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = thread / 8 + 16 * i;
      if (token_[i] >= 0) {
        cp_async_16(a_tile + r * 128 + ((chunk ^ (r % 8)) * 16),
                    p_.source + int64_t(token_[i]) * p_.k + kb * Mainloop::kBlockK +
                        chunk * kChunkElements);
        if constexpr (Mainloop::kScaled) {
          if (i == chunk) {
            cp_async_4(&tiles.a_scales[s][r], p_.scales + int64_t(kb) * p_.scale_ld + token_[i]);
          }
        }
      }
    }
    cp_async_mbarrier_arrive(bar);
  }

 private:
  static constexpr int kRowsPerThread = kBlockM / 16;
  static constexpr int kChunkElements = 16 / sizeof(Element);
  const Params p_;
  int32_t token_[kRowsPerThread];
};

// A loader that gathers A's rows by TMA, one box of 1 row x 128 bytes per row: one warp of
// the producer, 4 rows per lane. TMA swizzles by the shared-memory address, so a row box at
// row r of a stage lands in the 128-byte swizzle the wgmma descriptors expect, as a whole
// tile's box would. Rows past the expert's end load its last row again (the stage's bytes
// stay constant; the epilogue drops those rows). A scaled mainloop (FP8) gets each row's
// block scale of the k-block by cp.async from the same lane (4 bytes: below TMA's 16).
template <class Mainloop>
struct AGatheredTma {
  static_assert(Mainloop::kAMajor == Major::kK);
  static_assert(Mainloop::kBlockK * sizeof(typename Mainloop::Element) == 128);
  using Element = typename Mainloop::Element;
  static constexpr int kThreads = 32;
  static constexpr int kArrivals = Mainloop::kScaled ? 32 : 0;  // each lane's scale copies
  static constexpr int kTmaBytes = Mainloop::kTileBytesA;
  // The rows come through the async proxy; the scales (cp.async) are read by ld.shared.
  static constexpr bool kGenericProxy = false;

  struct Params {
    CUtensorMap map;           // the source [source rows, k], boxes of one row
    const int32_t* row_index;  // [sorted rows]
    // Scaled: the scale of source row r's k-block j at scales[j * scale_ld + r].
    const float* scales;
    int32_t scale_ld;
  };
  static Params params(const void* source, int64_t source_rows, const int32_t* row_index,
                       int64_t k, const float* scales = nullptr, int64_t scale_ld = 0) {
    return {make_tensor_map<Element>(source, source_rows, k, 1), row_index, scales,
            static_cast<int32_t>(scale_ld)};
  }

  __device__ __forceinline__ explicit AGatheredTma(const Params& p)
      : map_(p.map), row_index_(p.row_index), scales_(p.scales), scale_ld_(p.scale_ld) {}
  __device__ __forceinline__ void prefetch() const { prefetch_tensor_map(&map_); }

  __device__ __forceinline__ void begin_tile(const Tile& t) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      token_[i] = __ldg(&row_index_[t.row0 + min(lane + 32 * i, t.rows - 1)]);
    }
  }

  template <class Tiles>
  __device__ __forceinline__ void load_tma(Tiles&, int, uint64_t*, const Tile&, int) const {}

  template <class Tiles>
  __device__ __forceinline__ void load_async(Tiles& tiles, int s, uint64_t* bar, const Tile&,
                                             int kb) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = lane + 32 * i;
      tma_load_2d(tiles.a[s] + r * Mainloop::kBlockK, &map_, bar, kb * Mainloop::kBlockK,
                  token_[i]);
      if constexpr (Mainloop::kScaled) {
        cp_async_4(&tiles.a_scales[s][r], scales_ + int64_t(kb) * scale_ld_ + token_[i]);
      }
    }
    if constexpr (Mainloop::kScaled) cp_async_mbarrier_arrive(bar);
  }

 private:
  static constexpr int kRowsPerLane = kBlockM / 32;
  const CUtensorMap& map_;
  const int32_t* row_index_;
  const float* scales_;
  int32_t scale_ld_;
  int32_t token_[kRowsPerLane];
};

}  // namespace megamoe::sm90
