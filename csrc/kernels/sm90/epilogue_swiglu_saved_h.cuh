// SwiGLU with the saved h: the SwiGLU output (Out: the bf16 C of SwiGLUEpilogue, or the e4m3
// rows of epilogue_fp8_rows.cuh that the FP8 L2 reads), and when Params::h is set also
//   h[r, n0 + c] = gate, h[r, I + n0 + c] = up    (h = [gate | up], [rows, 2I], C's row layout)
// the L1 output before the activation, which the backward then reads instead of recomputing
// L1. One kernel serves both: h is optional per call. h is staged in Out's buffer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/epilogue_swiglu.cuh"
#include "kernels/sm90/gemm.h"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

template <int kBlockN_, class Out = SwiGLUEpilogue<kBlockN_>>
class SwiGLUSavedHEpilogue {
 public:
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kOutCols = Out::kOutCols;
  static constexpr BColumns kBColumns = Out::kBColumns;
  static constexpr int kHalf = kBlockN / 2;  // gate (or up) columns of the tile
  // The wide FP8 L1 with bf16 rows out spills with the dynamic tile order's loop; L1 never
  // runs beside a copy in FP8, and bf16's gathers its A (a round-robin producer anyway).
  static constexpr bool kRoundRobinTilesOnly = true;
  static_assert(kHalf == kOutCols);
  static_assert(sizeof(typename Out::Buffers) >= 2 * 64 * kHalf * 2, "a bf16 h half per slab");

  struct Params {
    typename Out::Params out;
    CUtensorMap map_h;     // h in kWarpBoxRows x 64 boxes (when h is set)
    __nv_bfloat16* h;      // optional [rows, 2I]
    int32_t half_n;        // I
    HRowShift shift;       // h's rows, where they are not C's
  };
  // h: null, or [rows, 2 * half_n] bf16 with C's rows (or C's moved by shift).
  static Params params(const typename Out::Params& out, __nv_bfloat16* h, int64_t rows,
                       int64_t half_n, HRowShift shift = {}) {
    return {out, h != nullptr ? make_tensor_map(h, rows, 2 * half_n, kWarpBoxRows) : CUtensorMap{}, h,
            static_cast<int32_t>(half_n), shift};
  }

  using Buffers = typename Out::Buffers;
  using Barriers = typename Out::Barriers;
  __device__ __forceinline__ static void init(Barriers& b) { Out::init(b); }

  __device__ __forceinline__ SwiGLUSavedHEpilogue(const Params& p, Buffers& buffers,
                                                  Barriers& barriers, int consumer)
      : map_h_(p.map_h), h_(p.h), half_n_(p.half_n), shift_(p.shift),
        out_(p.out, buffers, barriers, consumer) {}

  __device__ __forceinline__ void begin_tile(const Tile&) {}

  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    if (out_.full_slab(t)) {
      out_.store_staged(t, acc);
      if (h_ != nullptr) {
        const int row = t.row(out_.padded()) + out_.consumer() * 64;
        if (shift_.lo == nullptr) {
          store_h_staged(t, acc, row);
        } else {
          // A slab whose rows move by two shifts (it straddles a split) takes the row stores.
          const int shift = h_shift(t, row);
          if (shift == h_shift(t, row + 63)) {
            store_h_staged(t, acc, row + shift);
          } else {
            store_h_direct<true>(t, acc);
          }
        }
      }
    } else {
      out_.store_direct(t, acc);
      // Two copies of the row stores, so that the unshifted ones (every L1 but the
      // overlapped EP forward's) keep their code as it was.
      if (h_ != nullptr) {
        if (shift_.lo == nullptr) {
          store_h_direct<false>(t, acc);
        } else {
          store_h_direct<true>(t, acc);
        }
      }
    }
  }
  __device__ __forceinline__ void finish() { out_.finish(); }

 private:
  // The gate half, then the up half, of the raw accumulators through the staging buffer
  // and TMA stores, as C goes and for the same reason: h is twice C's size, and the bulk
  // stores drain under the next tile's MMAs where register stores would stall the warps.
  // Row r of the tile's expert in h: r moved by the shift that applies to it.
  __device__ __forceinline__ int h_shift(const Tile& t, int r) const {
    if (shift_.split != nullptr && r >= __ldg(shift_.split + t.expert)) {
      return __ldg(shift_.hi + t.expert);
    }
    return __ldg(shift_.lo + t.expert);
  }

  // row: the slab's first row of h.
  __device__ __forceinline__ void store_h_staged(const Tile& t, const float (&acc)[kBlockN / 2],
                                                 int row) {
    const int consumer = out_.consumer();
#pragma unroll
    for (int part = 0; part < 2; ++part) {  // 0: gate columns, 1: up columns
      store_slab_staged<kHalf>(map_h_, out_.staging(), consumer,
                               part * half_n_ + t.n_tile * kHalf, row,
                               [&](int q, int half, int j) {
                                 return acc[Fragment::index(part * kHalf / 8 + q, half, j)];
                               });
    }
  }

  // A partial slab: masked register stores of the raw accumulators, read as kBlockN columns
  // whose first half are gate columns n0.. and second half up columns I + n0...
  template <bool kShifted>
  __device__ __forceinline__ void store_h_direct(const Tile& t, const float (&acc)[kBlockN / 2]) {
    const int slab = out_.consumer() * 64;
    const int64_t ld = 2 * int64_t(half_n_);
    const int row0 = t.row(out_.padded());
    for_each_output<kBlockN>(
        [&](int q, int half, int j) { return acc[Fragment::index(q, half, j)]; },
        [&](int r, int c, float v0, float v1) {
          if (slab + r >= t.rows) return;
          const int col = c < kHalf ? t.n_tile * kHalf + c : half_n_ + t.n_tile * kHalf + c - kHalf;
          int row = row0 + slab + r;
          if constexpr (kShifted) row += h_shift(t, row);
          *reinterpret_cast<__nv_bfloat162*>(h_ + int64_t(row) * ld + col) =
              __floats2bfloat162_rn(v0, v1);
        });
  }

  const CUtensorMap& map_h_;
  __nv_bfloat16* h_;
  int half_n_;
  const HRowShift& shift_;  // in the kernel's parameters, as map_h_
  Out out_;
};

}  // namespace megamoe::sm90
