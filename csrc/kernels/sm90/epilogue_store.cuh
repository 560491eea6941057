// The store epilogue: C[row, n_tile * kOutCols + c] = the tile's output values in bf16, C in
// the sorted or the padded row layout. Values maps the accumulators to the output columns:
// the accumulators themselves here (C = A B, and the weight gradient in bf16: its tiles are
// always full), silu(gate) * up in epilogue_swiglu.cuh.
//
// A full 64-row slab leaves through shared memory and TMA stores; a slab with rows past the
// expert's end through masked stores from registers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

template <int kBlockN>
struct AccumulatorValues {
  static constexpr int kCols = kBlockN;
  static constexpr BColumns kBColumns = BColumns::kContiguous;
  __device__ __forceinline__ static float get(const float (&acc)[kBlockN / 2], int q, int half,
                                              int j) {
    return acc[Fragment::index(q, half, j)];
  }
};

template <int kBlockN_, class Values = AccumulatorValues<kBlockN_>>
class StoreEpilogue : public SlabOutput<StoreEpilogue<kBlockN_, Values>, kBlockN_, Values> {
  using Base = SlabOutput<StoreEpilogue, kBlockN_, Values>;

 public:
  using Base::kBlockN, Base::kOutCols;

  struct Params {
    CUtensorMap map;  // C in kWarpBoxRows x 64 boxes
    __nv_bfloat16* c;
    int64_t ld;
    int32_t padded;   // C's rows are in the padded layout
  };
  // C = [rows, ld] bf16.
  static Params params(__nv_bfloat16* c, int64_t rows, int64_t ld, bool padded) {
    return {make_tensor_map(c, rows, ld, kWarpBoxRows), c, ld, padded};
  }

  __device__ __forceinline__ StoreEpilogue(const Params& p, typename Base::Buffers& buffers,
                                           typename Base::Barriers&, int consumer)
      : Base(buffers, consumer, p.padded), map_(p.map), c_(p.c), ld_(p.ld) {}

  // The parts of store(), for the epilogues built on this one.
  __device__ __forceinline__ void store_staged(const Tile& t, const float (&acc)[kBlockN / 2]) {
    const int consumer = this->consumer();
    store_slab_staged<kOutCols>(map_, this->staging(), consumer, t.n_tile * kOutCols,
                                t.row(this->padded()) + consumer * 64,
                                [&](int q, int half, int j) { return Values::get(acc, q, half, j); });
  }
  __device__ __forceinline__ void store_direct(const Tile& t, const float (&acc)[kBlockN / 2]) {
    const int slab = this->consumer() * 64;
    __nv_bfloat16* base = c_ + int64_t(t.row(this->padded()) + slab) * ld_ + t.n_tile * kOutCols;
    for_each_output<kOutCols>(
        [&](int q, int half, int j) { return Values::get(acc, q, half, j); },
        [&](int r, int c, float v0, float v1) {
          if (slab + r < t.rows) {
            *reinterpret_cast<__nv_bfloat162*>(base + int64_t(r) * ld_ + c) =
                __floats2bfloat162_rn(v0, v1);
          }
        });
  }

 private:
  // Scalars are copied out of the params (epilogue_common.cuh says why); the map is used in
  // place.
  const CUtensorMap& map_;
  __nv_bfloat16* c_;
  int64_t ld_;
};

}  // namespace megamoe::sm90
