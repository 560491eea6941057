// The FP8-rows output: the tile's output values (Values, as StoreEpilogue takes them)
// written as the e4m3 rows with 1x128 scales that an FP8 GEMM reads as its A, instead of a
// bf16 C for quantize_fp8 to read back. For the wide SwiGLU tile, whose 128 output columns
// per row are exactly one 1x128 block, so a row's scale needs nothing outside the tile.
//
// The bits are those of the bf16 store followed by the rows quantizer (quantize_fp8.cu):
// each value is first rounded to bf16 as the bf16 store rounds it, the block's amax is the
// largest of those values' abs bits, and the scale and the e4m3 values come from the same
// recipe functions (fp8_recipe.cuh). A full 64-row slab leaves through the staging buffer
// and one TMA store (64 rows x 128 bytes); a slab with rows past the expert's end through
// masked stores from registers.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common/fp8_recipe.cuh"
#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

// This thread's part of a 64-row slab of 128 columns, quantized. Of row half `half`
// (Fragment::row(half)), word k holds the e4m3 bytes of columns 16k + col0 and + 1 (low
// half) and 16k + 8 + col0 and + 1 (high half): chunks 2k and 2k + 1 of the fragment.
struct QuantizedSlab {
  uint32_t words[2][8];
  float scale[2];
};

template <class Values, int kAccumulators>
__device__ __forceinline__ QuantizedSlab quantize_slab(const float (&acc)[kAccumulators]) {
  static_assert(Values::kCols == 128, "one 1x128 block per row");
  QuantizedSlab s;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t bf16[16];  // chunk q's pair, as the bf16 store would write it
    uint32_t amax = 0;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      bf16[q] = pack_bf16x2(Values::get(acc, q, half, 0), Values::get(acc, q, half, 1));
      amax = max_halves(amax, bf16[q] & kBf16AbsMask2);
    }
    amax = max_of_halves(amax);
    // The row's other 96 columns are held by the other three lanes of this lane's quad.
    amax = max(amax, __shfl_xor_sync(~0u, amax, 1));
    amax = max(amax, __shfl_xor_sync(~0u, amax, 2));
    const Fp8BlockScale b = fp8_block_scale_bf16(amax);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      s.words[half][k] =
          b.nonfinite ? kE4m3NanX4 : fp8_quad(bf16[2 * k], bf16[2 * k + 1], b.r, b.r, b.r, b.r);
    }
    s.scale[half] = b.scale;
  }
  return s;
}

template <int kBlockN_, class Values>
class Fp8RowsEpilogue
    : public SlabOutput<Fp8RowsEpilogue<kBlockN_, Values>, kBlockN_, Values> {
  // Staging sized as the bf16 store's, for the saved h's halves; a slab of e4m3 rows takes
  // the first half of a warpgroup's buffer.
  using Base = SlabOutput<Fp8RowsEpilogue, kBlockN_, Values>;
  static_assert(Values::kCols == 128, "a tile's output columns must be one 1x128 block");

 public:
  using Base::kBlockN, Base::kOutCols;

  struct Params {
    CUtensorMap map;  // q in kWarpBoxRows-row x 128-byte boxes
    uint8_t* q;
    float* scales;
    int64_t ld;        // q's row length: the output columns
    int64_t scale_ld;
    int32_t padded;    // the rows are in the padded layout
  };
  // q = [rows, ld] e4m3; the scale of row r's block j (columns 128j..) at
  // scales[j * scale_ld + r].
  static Params params(__nv_fp8_e4m3* q, float* scales, int64_t rows, int64_t ld,
                       int64_t scale_ld, bool padded) {
    return {make_tensor_map<__nv_fp8_e4m3>(q, rows, ld, kWarpBoxRows), reinterpret_cast<uint8_t*>(q),
            scales, ld, scale_ld, padded};
  }

  __device__ __forceinline__ Fp8RowsEpilogue(const Params& p, typename Base::Buffers& buffers,
                                             typename Base::Barriers&, int consumer)
      : Base(buffers, consumer, p.padded),
        map_(p.map),
        q_(p.q),
        scales_(p.scales),
        ld_(p.ld),
        scale_ld_(p.scale_ld) {}

  // The parts of store(), for the epilogues built on this one.
  __device__ __forceinline__ void store_staged(const Tile& t, const float (&acc)[kBlockN / 2]) {
    const QuantizedSlab s = quantize_slab<Values>(acc);
    const int row = t.row(this->padded()) + this->consumer() * 64;
    store_scales(t, row, s, 64);
    store_boxes_staged<1, 128>(map_, this->staging(), this->consumer(), t.n_tile * kOutCols,
                               row, [&](uint8_t* staging) {
#pragma unroll
                                 for (int half = 0; half < 2; ++half) {
                                   const int r = Fragment::row(half);
                                   uint8_t* base = staging + r * 128 + Fragment::col0();
#pragma unroll
                                   for (int k = 0; k < 8; ++k) {
                                     // 16-byte slot k of row r at k ^ (r % 8): the swizzle.
                                     store_pairs(base + ((k ^ (r % 8)) * 16), s.words[half][k]);
                                   }
                                 }
                               });
  }
  __device__ __forceinline__ void store_direct(const Tile& t, const float (&acc)[kBlockN / 2]) {
    const QuantizedSlab s = quantize_slab<Values>(acc);
    const int slab = this->consumer() * 64;
    const int row = t.row(this->padded()) + slab;
    store_scales(t, row, s, t.rows - slab);
    uint8_t* base = q_ + int64_t(row) * ld_ + t.n_tile * kOutCols + Fragment::col0();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = Fragment::row(half);
      if (slab + r >= t.rows) continue;
#pragma unroll
      for (int k = 0; k < 8; ++k) store_pairs(base + int64_t(r) * ld_ + 16 * k, s.words[half][k]);
    }
  }

 private:
  // A word's two byte pairs: columns col0.. and col0 + 8.. of the 16 bytes at `slot`.
  __device__ __forceinline__ static void store_pairs(uint8_t* slot, uint32_t word) {
    *reinterpret_cast<uint16_t*>(slot) = static_cast<uint16_t>(word);
    *reinterpret_cast<uint16_t*>(slot + 8) = static_cast<uint16_t>(word >> 16);
  }
  // The scales of the slab's first `rows` rows (from `row` on), one lane per quad.
  __device__ __forceinline__ void store_scales(const Tile& t, int row, const QuantizedSlab& s,
                                               int rows) const {
    if (Fragment::col0() != 0) return;
    float* scales = scales_ + t.n_tile * scale_ld_ + row;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = Fragment::row(half);
      if (r < rows) scales[r] = s.scale[half];
    }
  }

  // Scalars are copied out of the params (epilogue_common.cuh says why); the map is used in
  // place.
  const CUtensorMap& map_;
  uint8_t* q_;
  float* scales_;
  int64_t ld_;
  int64_t scale_ld_;
};

}  // namespace megamoe::sm90
