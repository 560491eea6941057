// A loader (see operand_tma.cuh) that gathers A's rows straight from a token matrix with
// cp.async: sorted row r is row row_index[r] of the source, so no permuted copy of the
// tokens is ever written. TMA cannot express a row gather, hence the whole producer
// warpgroup copies: each warp instruction covers 4 rows x 128 contiguous bytes. A scaled
// mainloop (FP8) also gets each row's block scale of the k-block, copied by one of the 8
// threads that copy the row (the one whose chunk index is the row's index among its rows).
#pragma once

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

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
  __device__ __forceinline__ void prefetch_tile(const Tile&) const {}

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

}  // namespace megamoe::sm90
