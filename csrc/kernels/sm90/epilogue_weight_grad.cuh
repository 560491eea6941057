// The weight gradient's epilogue (Grouping::kK, C = [E * m, n]): written in bf16 by the
// store epilogue (epilogue_store.cuh; these tiles are always full), or added into an fp32
// gradient, C += the tile, when Params::f32 is set. One kernel serves both outputs: the
// choice is per call.
#pragma once

#include <cstdint>

#include "kernels/sm90/epilogue_store.cuh"

namespace megamoe::sm90 {

template <int kBlockN_, int kStageCols = kBlockN_>
class WeightGradEpilogue {
 public:
  // The bf16 output; the tile is the same (kStageCols: epilogue_store.cuh).
  using Bf16 = StoreEpilogue<kBlockN_, AccumulatorValues<kBlockN_>, kStageCols>;
  static constexpr int kBlockN = Bf16::kBlockN, kOutCols = Bf16::kOutCols;
  static constexpr BColumns kBColumns = Bf16::kBColumns;

  struct Params {
    typename Bf16::Params bf16;  // used when f32 is null
    float* f32;                  // [E * m, ld]: C += the gradient
    int64_t ld;
  };
  // Exactly one of c (bf16, written) and c_f32 (fp32, accumulated into) is set.
  static Params params(__nv_bfloat16* c, float* c_f32, int64_t rows, int64_t ld) {
    Params p{};
    // Accumulating into fp32 goes through registers: no store map then.
    if (c_f32 == nullptr) p.bf16 = Bf16::params(c, rows, ld, false);
    p.f32 = c_f32;
    p.ld = ld;
    return p;
  }

  using Buffers = typename Bf16::Buffers;
  using Barriers = typename Bf16::Barriers;
  __device__ __forceinline__ static void init(Barriers& b) { Bf16::init(b); }

  __device__ __forceinline__ WeightGradEpilogue(const Params& p, Buffers& buffers,
                                                Barriers& barriers, int consumer)
      : f32_(p.f32), ld_(p.ld), bf16_(p.bf16, buffers, barriers, consumer), consumer_(consumer) {}

  __device__ __forceinline__ void begin_tile(const Tile&) {}

  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    if (f32_ != nullptr) {
      accumulate_f32(t, acc);
    } else {
      bf16_.store(t, acc);
    }
  }
  __device__ __forceinline__ void finish() { bf16_.finish(); }

 private:
  // Each output tile has one owner: a plain read-add-write, no atomics.
  __device__ __forceinline__ void accumulate_f32(const Tile& t, const float (&acc)[kBlockN / 2]) {
    float* base = f32_ + int64_t(t.row0 + consumer_ * 64) * ld_ + t.n_tile * kBlockN;
    for_each_output<kBlockN>(
        [&](int q, int half, int j) { return acc[Fragment::index(q, half, j)]; },
        [&](int r, int c, float v0, float v1) {
          float2* at = reinterpret_cast<float2*>(base + int64_t(r) * ld_ + c);
          const float2 old = *at;
          *at = make_float2(old.x + v0, old.y + v1);
        });
  }

  float* f32_;
  int64_t ld_;
  Bf16 bf16_;
  int consumer_;
};

}  // namespace megamoe::sm90
