// The SwiGLU backward epilogue of the FP8 dgrad of L2 on 256-wide tiles, run by warps of
// its own while the consumer warpgroups go on to their next tile's MMAs. It computes what
// SwiGLUBackwardEpilogue (epilogue_swiglu_backward.cuh) does:
//   da = p z,   dg = da u silu'(g),   du = da silu(g)   -> dh = [dg | du]
//   dp = <z, a>  (one partial per row and N-tile),      a = silu(g) u -> a_out (optional)
// That epilogue runs in the consumers, and at FP8 rates its traffic (h in, dh and a out:
// three quarters of the GEMM's bytes) took as long as the MMAs while the tensor cores
// waited. Here the consumers only hand z over through shared memory:
//
//   consumer warpgroup c: wait z_empty[c]; write its 64 x 256 slab of z (fp16, each row
//                         scaled by a power of two) and the rows' unscales; arrive z_full[c]
//   epilogue warps:       per tile, ask L2 for the tile's h; per slab, wait z_full[c]; each
//                         warp takes 4-row quads, box by box: h by cp.async (running ahead
//                         of z), z from shared memory, dh, a and the dp partials to global
//                         memory; arrive z_empty[c]
//
// z goes through fp16, not fp32 (128 KB would leave the mainloop two stages, not three),
// and not bf16, whose 8 bits would show in dh beyond dh's own rounding. Scaling each row by
// a power of two that puts its largest |z| in [2^14, 2^15) keeps fp16's 11 bits for every
// value down to 2^-29 of that largest; the power of two is undone exactly.
//
// The epilogue warps are warps 1-3 of the producer warpgroup (warp 0 holds the TMA
// producer's one thread): GroupedGemm runs run_warps there when kEpilogueWarps is set.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/epilogue_swiglu_backward.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

template <int kBlockN_>
class SwiGLUBackwardWarpsEpilogue {
 public:
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN == 256, "the FP8 dgrad's wide tiles; 128-wide ones use SwiGLUBackwardEpilogue");
  static constexpr int kOutCols = kBlockN;
  static constexpr BColumns kBColumns = BColumns::kContiguous;
  // The epilogue warps walk the round-robin order themselves, as the consumers do.
  static constexpr bool kRoundRobinTilesOnly = true;
  static constexpr int kEpilogueWarps = 3;
  // The epilogue warps need 72 registers without spills (their h waits in shared memory,
  // not in registers), which leaves the consumers 216, enough for the mainloop alone.
  using Registers = RegisterSplit<72, 216>;
  using Operands = SwiGLUBackwardOperands;

  struct Params {
    CUtensorMap map_h;  // h in 64 x 64 boxes, for the L2 prefetches
    Operands o;
  };
  static Params params(const __nv_bfloat16* h, int64_t h_rows, __nv_bfloat16* dh,
                       __nv_bfloat16* a_out, int64_t /*out_rows*/, bool padded,
                       const float* slot_weights, const int32_t* row_slot, float* dp_partial,
                       int64_t half_n) {
    Params p{};
    p.map_h = make_tensor_map(h, h_rows, 2 * half_n, 64);
    p.o = {h, dh, a_out, slot_weights, row_slot, dp_partial,
           static_cast<int32_t>(half_n / kBlockN), static_cast<int32_t>(half_n), padded};
    return p;
  }

 private:
  static constexpr int kBoxes = kBlockN / kStoreBoxCols;  // 64-column boxes of a slab
  // An epilogue warp's item: one box of a 4-row quad, a lane's 8 columns of it. Its h comes
  // by cp.async into the warp's ring of kRing items, kRing - 1 items ahead of the math: no
  // registers held, 3 KB in flight per warp.
  static constexpr int kRing = 4;

 public:
  struct Buffers {
    uint8_t z[2][kBoxes * kStoreBoxBytes];  // per consumer: its 64 x 256 fp16 z, swizzled
    float row_unscale[2][64];               // per consumer row: 2^(E - 14), E its exponent
    uint4 h[kEpilogueWarps][kRing][2][32];  // per warp and item: gate, up of each lane
  };
  struct Barriers {
    uint64_t z_full[2];   // consumer c's slab is written (its 128 threads arrive)
    uint64_t z_empty[2];  // the epilogue warps have read it (one arrival per warp)
  };
  __device__ __forceinline__ static void init(Barriers& b) {
    for (int c = 0; c < 2; ++c) {
      mbarrier_init(&b.z_full[c], 128);
      mbarrier_init(&b.z_empty[c], kEpilogueWarps);
    }
  }

  // ---- the consumers' side ----
  __device__ __forceinline__ SwiGLUBackwardWarpsEpilogue(const Params&, Buffers& buffers,
                                                         Barriers& barriers, int consumer)
      : buffers_(buffers), barriers_(barriers), consumer_(consumer) {}

  __device__ __forceinline__ void begin_tile(const Tile&) {}

  __device__ __forceinline__ void store(const Tile&, const float (&acc)[kBlockN / 2]) {
    float scale[2], unscale[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float amax = 0.f;  // NaN (a pad row's) is skipped by fmaxf
#pragma unroll
      for (int q = 0; q < kBlockN / 8; ++q) {
        amax = fmaxf(amax, fmaxf(fabsf(acc[Fragment::index(q, half, 0)]),
                                 fabsf(acc[Fragment::index(q, half, 1)])));
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the quad holds the row
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      // The biased exponent e of amax (Inf: 255), at least 15 so that both powers are normal.
      const int e = max(static_cast<int>(__float_as_uint(amax) >> 23), 15);
      scale[half] = __uint_as_float(static_cast<uint32_t>(268 - e) << 23);   // 2^(14 - E)
      unscale[half] = __uint_as_float(static_cast<uint32_t>(e - 14) << 23);  // 2^(E - 14)
    }
    mbarrier_wait(&barriers_.z_empty[consumer_], phase_ ^ 1);
    if (threadIdx.x % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        buffers_.row_unscale[consumer_][Fragment::row(half)] = unscale[half];
      }
    }
    stage_chunks<kBlockN / 8>(
        buffers_.z[consumer_],
        [&](int q, int half, int j) { return acc[Fragment::index(q, half, j)] * scale[half]; },
        PackHalf{});
    mbarrier_arrive(&barriers_.z_full[consumer_]);  // releases the slab's stores
    phase_ ^= 1;
  }
  __device__ __forceinline__ void finish() {}

  // ---- the epilogue warps ----
  template <class Scheduler>
  __device__ __forceinline__ static void run_warps(const Params& p, Buffers& buffers,
                                                   Barriers& barriers,
                                                   const Scheduler& scheduler) {
    const Operands o = p.o;
    const int warp = threadIdx.x / 32 - 1;
    const int lane = threadIdx.x % 32;
    const int chunk = lane % 8;  // the lane's 8 columns of each 64-column box
    const int64_t ld = 2 * int64_t(o.half_n);
    uint32_t phase = 0;
    scheduler.for_each_tile([&](const Tile& t) {
      // The tile's h (two slabs x four quarters x gate and up: 16 boxes) into L2 while the
      // consumers still run its MMAs.
      if (warp == 0 && lane < 16) {
        const int slab = lane / 8, quarter = (lane / 2) % 4, up = lane % 2;
        if (slab * 64 < t.rows) {
          tma_prefetch_2d(&p.map_h, t.n_tile * kBlockN + quarter * kStoreBoxCols + up * o.half_n,
                          t.row0 + slab * 64);
        }
      }
      const int col = t.n_tile * kBlockN + chunk * 8;
      // The warp's items: per slab its quads (warp, warp + 3, ..), per quad its four boxes.
      // h does not depend on z, so the copies run kRing - 1 items ahead of the math (the
      // first ones before z is even there). The next copy's item is counted along, not
      // divided out of an index.
      const int quads = (16 - warp + kEpilogueWarps - 1) / kEpilogueWarps;
      uint4(&ring)[kRing][2][32] = buffers.h[warp];
      int f_slab = 0, f_quad = 0, f_box = 0, f_slot = 0;
      const auto fetch = [&]() {
        const int tile_row = f_slab * 64 + (warp + kEpilogueWarps * f_quad) * 4 + lane / 8;
        if (f_slab < 2 && tile_row < t.rows) {
          const __nv_bfloat16* h_gate =
              o.h + (t.row0 + tile_row) * ld + col + f_box * kStoreBoxCols;
          cp_async_16(&ring[f_slot][0][lane], h_gate);
          cp_async_16(&ring[f_slot][1][lane], h_gate + o.half_n);
        }
        cp_async_commit_group();  // empty past the end: the waits count groups
        f_slot = (f_slot + 1) % kRing;
        if (++f_box == kBoxes) {
          f_box = 0;
          if (++f_quad == quads) {
            f_quad = 0;
            ++f_slab;
          }
        }
      };
#pragma unroll
      for (int i = 0; i < kRing - 1; ++i) fetch();
      // The router weights of the tile's rows (after the first copies, which need none of
      // them), lane l holding rows l + 32 m in weights[m].
      float weights[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int tile_row = lane + 32 * m;
        weights[m] = tile_row < t.rows
                         ? __ldg(&o.slot_weights[__ldg(&o.row_slot[t.row0 + tile_row])])
                         : 0.f;
      }
      int slot = 0;
#pragma unroll 1
      for (int slab = 0; slab < 2; ++slab) {
        mbarrier_wait(&barriers.z_full[slab], phase);
#pragma unroll 1
        for (int slab_quad = 0; slab_quad < quads; ++slab_quad) {
          const int quad = warp + kEpilogueWarps * slab_quad;
          const int r = quad * 4 + lane / 8;  // the lane's row of the slab
          const int tile_row = slab * 64 + r;
          const bool valid = tile_row < t.rows;
          // The row's router weight, from lane tile_row % 32 (the warp's rows share m).
          const int m = slab * 2 + quad / 8;
          const float weights_m = m == 0 ? weights[0] : m == 1 ? weights[1] : m == 2 ? weights[2] : weights[3];
          const float weight = __shfl_sync(0xffffffffu, weights_m, tile_row % 32);
          const float unscale = valid ? buffers.row_unscale[slab][r] : 0.f;
          const uint8_t* z_row = buffers.z[slab] + r * 128 + ((chunk ^ (r % 8)) * 16);
          // Pad rows (z may be anything there; h is zero) come out as zeros.
          const bool store = valid || o.padded;
          const int64_t out_row = t.row(o.padded) + tile_row;
          __nv_bfloat16* dg_out = o.dh + out_row * ld + col;
          __nv_bfloat16* a_out = o.a_out ? o.a_out + out_row * o.half_n + col : nullptr;
          float partial = 0.f;
#pragma unroll 1
          for (int box = 0; box < kBoxes; ++box) {
            fetch();
            cp_async_wait_group<kRing - 1>();  // this lane's copies of the item have landed
            const uint4 zq = *reinterpret_cast<const uint4*>(z_row + box * kStoreBoxBytes);
            const uint4 gq = valid ? ring[slot][0][lane] : make_uint4(0, 0, 0, 0);
            const uint4 uq = valid ? ring[slot][1][lane] : make_uint4(0, 0, 0, 0);
            slot = (slot + 1) % kRing;
            const uint32_t z_words[4] = {zq.x, zq.y, zq.z, zq.w};
            const uint32_t g_words[4] = {gq.x, gq.y, gq.z, gq.w};
            const uint32_t u_words[4] = {uq.x, uq.y, uq.z, uq.w};
            uint32_t dg[4], du[4], a[4];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              const float2 zf = __half22float2(*reinterpret_cast<const __half2*>(&z_words[w]));
              const float z[2] = {valid ? zf.x * unscale : 0.f, valid ? zf.y * unscale : 0.f};
              const SwiGLUGradPair out =
                  swiglu_backward_pair(z, g_words[w], u_words[w], weight, partial);
              dg[w] = *reinterpret_cast<const uint32_t*>(&out.dg);
              du[w] = *reinterpret_cast<const uint32_t*>(&out.du);
              a[w] = *reinterpret_cast<const uint32_t*>(&out.a);
            }
            if (store) {
              const int at = box * kStoreBoxCols;
              *reinterpret_cast<uint4*>(dg_out + at) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
              *reinterpret_cast<uint4*>(dg_out + o.half_n + at) = make_uint4(du[0], du[1], du[2], du[3]);
              if (a_out) *reinterpret_cast<uint4*>(a_out + at) = make_uint4(a[0], a[1], a[2], a[3]);
            }
          }
          // The row's partial over its 8 lanes, in a fixed order.
          partial += __shfl_xor_sync(0xffffffffu, partial, 1);
          partial += __shfl_xor_sync(0xffffffffu, partial, 2);
          partial += __shfl_xor_sync(0xffffffffu, partial, 4);
          if (valid && chunk == 0) {
            o.dp_partial[(t.row0 + tile_row) * int64_t(o.dp_columns) + t.n_tile] = partial;
          }
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&barriers.z_empty[slab]);  // after the warp's z reads
      }
      phase ^= 1;
    });
  }

 private:
  Buffers& buffers_;
  Barriers& barriers_;
  int consumer_;
  uint32_t phase_ = 0;  // tiles this consumer has handed over, mod 2
};

}  // namespace megamoe::sm90
