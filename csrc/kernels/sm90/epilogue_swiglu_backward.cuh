// The SwiGLU backward epilogue, fused into the dgrad of L2. The accumulators are
// z = w_down_e^T dy for each sorted row (slot); with h = [g | u] the recomputed or saved L1
// output, a = silu(g) u and the router weight p of the row's slot:
//   da = p z,   dg = da u silu'(g),   du = da silu(g)   -> dh = [dg | du] (C, [rows, 2I])
//   dp = <z, a>                                         -> one partial per (row, N-tile)
//   a                                                   -> a_out (optional, for dW_down)
// In the padded layout, pad rows of dh and a_out are written as zeros: they are the weight
// gradients' operands.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm90/epilogue_common.cuh"
#include "kernels/sm90/epilogue_swiglu.cuh"
#include "kernels/sm90/tensor_map.h"

namespace megamoe::sm90 {

// The SwiGLU backward of one column pair of a row, from z = w_down^T dy (two accumulators),
// the row's [gate | up] values as bf16 pairs and its router weight p: dg, du and
// a = silu(g) u as bf16 pairs, and the pair's share of dp = <z, a> added to `partial`.
struct SwiGLUGradPair {
  __nv_bfloat162 dg, du, a;
};
__device__ __forceinline__ SwiGLUGradPair swiglu_backward_pair(const float (&z)[2],
                                                               unsigned g_bits, unsigned u_bits,
                                                               float weight, float& partial) {
  const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g_bits));
  const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u_bits));
  const float gs[2] = {g.x, g.y}, us[2] = {u.x, u.y};
  float dg[2], du[2], a[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float sig = sigmoid(gs[j]);
    const float silu_g = gs[j] * sig;
    a[j] = silu_g * us[j];
    partial += z[j] * a[j];
    const float da = weight * z[j];
    dg[j] = da * us[j] * sig * (1.0f + gs[j] * (1.0f - sig));
    du[j] = da * silu_g;
  }
  return {__floats2bfloat162_rn(dg[0], dg[1]), __floats2bfloat162_rn(du[0], du[1]),
          __floats2bfloat162_rn(a[0], a[1])};
}

// kHAhead (256-wide tiles): a quarter's h for both of a thread's fragment rows is read into
// registers before any of its math, so the next quarter's load runs under all of it instead
// of half; 16 more registers, which the FP8 consumers have in their epilogue (their
// mainloop's scratch is free there) and the bf16 ones at 224 do not. It also has each
// consumer warp load h for, and store, only its own 16 rows of a slab, so the epilogue has
// no warpgroup barrier and a warp never waits for its neighbours' math.
template <int kBlockN_, bool kHAhead = false>
class SwiGLUBackwardEpilogue {
 public:
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kOutCols = kBlockN;  // of a = silu(g) u; dh has two such tiles
  static constexpr BColumns kBColumns = BColumns::kContiguous;
  // Round-robin tiles, as before the producers passed them: with passed tiles the FP8 dgrad
  // ran 2-9% slower at 235b, for the same bits (the performance log, thirteenth session of
  // 2026-12-04). The bf16 dgrad gathers its A rows, so it walks the round-robin order anyway.
  static constexpr bool kRoundRobinTilesOnly = true;

  struct Operands {
    const __nv_bfloat16* h;      // [sorted rows, 2I]
    __nv_bfloat16* dh;           // [rows, 2I]
    __nv_bfloat16* a_out;        // optional [rows, I]
    const float* slot_weights;   // router weights p, by slot
    const int32_t* row_slot;     // [sorted rows] slot of each row
    float* dp_partial;           // [sorted rows, dp_columns]
    int32_t dp_columns;          // N-tiles: I / kBlockN
    int32_t half_n;              // I
    int32_t padded;              // dh and a_out are in the padded layout
  };
  // kHAhead: each consumer warp moves its own 16 rows of a slab (kBoxRows x 64 boxes; a
  // warp's rows are 2 KB of each 64-row box, swizzled as there), with its own h barrier and
  // bulk groups, so the warps of a warpgroup never wait for each other in the epilogue.
  static constexpr int kBoxRows = kHAhead ? 16 : 64;
  static constexpr int kHWarps = kHAhead ? 4 : 1;  // h barriers per consumer warpgroup
  // The kBoxRows-row part of a slab this thread's warp moves (its warp's 16 rows, or all 64)
  // and that part's byte offset in a 64-row box.
  __device__ __forceinline__ static int part() { return kHAhead ? threadIdx.x % 128 / 32 : 0; }
  __device__ __forceinline__ static int part_offset() { return part() * kBoxRows * 128; }
  struct Params {
    CUtensorMap map_dh;     // dh in kBoxRows x 64 boxes
    CUtensorMap map_a_out;  // a_out in kBoxRows x 64 boxes (when a_out is set)
    CUtensorMap map_h;      // h in kBoxRows x 64 boxes (read by TMA in the staged path)
    Operands o;
  };
  static Params params(const __nv_bfloat16* h, int64_t h_rows, __nv_bfloat16* dh,
                       __nv_bfloat16* a_out, int64_t out_rows, bool padded,
                       const float* slot_weights, const int32_t* row_slot, float* dp_partial,
                       int64_t half_n) {
    Params p{};
    p.map_dh = make_tensor_map(dh, out_rows, 2 * half_n, kBoxRows);
    if (a_out != nullptr) p.map_a_out = make_tensor_map(a_out, out_rows, half_n, kBoxRows);
    p.map_h = make_tensor_map(h, h_rows, 2 * half_n, kBoxRows);
    p.o = {h, dh, a_out, slot_weights, row_slot, dp_partial,
           static_cast<int32_t>(half_n / kBlockN), static_cast<int32_t>(half_n), padded};
    return p;
  }

 private:
  static constexpr int kStagingBytes = 64 * kBlockN * 2;
  // 256-wide tiles in the padded layout stage by TMA (store_staged): per 64-column quarter,
  // the gate box of h comes into the staging buffer's last 64 x 64 box (dg, du and a fill
  // the first three) and the up box into h_up. 128-wide tiles' staging holds two boxes, not
  // four: they use the register path.
  static constexpr bool kHByTma = kBlockN == 256;
  struct StagingOnly {
    uint8_t staging[2][kStagingBytes];
  };
  struct StagingAndHUp {
    uint8_t staging[2][kStagingBytes];
    uint8_t h_up[2][kStoreBoxBytes];
  };

 public:
  using Buffers = std::conditional_t<kHByTma, StagingAndHUp, StagingOnly>;
  struct Barriers {
    uint64_t h_full[2][kHWarps];  // kHByTma: a quarter of h has landed (per consumer / warp)
  };
  __device__ __forceinline__ static void init(Barriers& b) {
    for (int w = 0; w < 2; ++w) {
      for (int i = 0; i < kHWarps; ++i) mbarrier_init(&b.h_full[w][i], 1);
    }
  }

  __device__ __forceinline__ SwiGLUBackwardEpilogue(const Params& p, Buffers& buffers,
                                                    Barriers& barriers, int consumer)
      : p_(p), o_(p.o), buffers_(buffers),
        h_bar_(&barriers.h_full[consumer][part()]),
        consumer_(consumer) {}

  // The staged path's first quarter of h, fetched under this tile's MMAs (the buffers were
  // released by the last tile's epilogue, whose final barrier every thread has passed).
  __device__ __forceinline__ void begin_tile(const Tile& t) {
    if constexpr (kHByTma) {
      if (o_.padded && threadIdx.x % (kHAhead ? 32 : 128) == 0) load_h_quarter(t, 0);
    }
  }

  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    if constexpr (kHByTma) {
      if (o_.padded) {
        store_staged(t, acc);
        return;
      }
    }
    store_direct(t, acc);
  }
  __device__ __forceinline__ void finish() {
    if constexpr (kHAhead) {
      if (threadIdx.x % 32 == 0) bulk_wait_group_all();  // each warp's leader, its own stores
    } else {
      wait_for_tma_stores();
    }
  }

 private:
  // Register stores, for any layout. The h values of a row are loaded kLoadBatch 8-column
  // chunks at a time, all issued before any is used: one row's loads one after the other
  // leave the epilogue waiting on load latency.
  __device__ __forceinline__ void store_direct(const Tile& t, const float (&acc)[kBlockN / 2]) {
    constexpr int kChunks = kBlockN / 8;  // a thread has 2 columns of each
    constexpr int kLoadBatch = 16;
    static_assert(kChunks % kLoadBatch == 0);
    const int slab = consumer_ * 64;
    const int64_t ld = 2 * int64_t(o_.half_n);
    const int col0 = t.n_tile * kBlockN + Fragment::col(0);
    float partial[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = Fragment::row(half);
      const int64_t out_row = t.row(o_.padded) + slab + r;
      __nv_bfloat16* dg_out = o_.dh + out_row * ld + col0;
      __nv_bfloat16* du_out = dg_out + o_.half_n;
      __nv_bfloat16* a_out = o_.a_out ? o_.a_out + out_row * o_.half_n + col0 : nullptr;
      if (slab + r >= t.rows) {
        if (o_.padded) {  // pad rows of the weight-gradient operands are zeros
          const __nv_bfloat162 zero = __floats2bfloat162_rn(0.f, 0.f);
#pragma unroll
          for (int q = 0; q < kChunks; ++q) {
            *reinterpret_cast<__nv_bfloat162*>(dg_out + q * 8) = zero;
            *reinterpret_cast<__nv_bfloat162*>(du_out + q * 8) = zero;
            if (a_out) *reinterpret_cast<__nv_bfloat162*>(a_out + q * 8) = zero;
          }
        }
        continue;
      }
      const int64_t row = t.row0 + slab + r;
      const float weight = __ldg(&o_.slot_weights[__ldg(&o_.row_slot[row])]);
      const auto* h_gate = reinterpret_cast<const unsigned*>(o_.h + row * ld + col0);
      const auto* h_up = reinterpret_cast<const unsigned*>(o_.h + row * ld + o_.half_n + col0);
#pragma unroll
      for (int q0 = 0; q0 < kChunks; q0 += kLoadBatch) {
        unsigned g_bits[kLoadBatch], u_bits[kLoadBatch];
#pragma unroll
        for (int i = 0; i < kLoadBatch; ++i) {
          g_bits[i] = __ldg(h_gate + (q0 + i) * 4);  // 8 bf16 columns = 4 words apart
          u_bits[i] = __ldg(h_up + (q0 + i) * 4);
        }
#pragma unroll
        for (int i = 0; i < kLoadBatch; ++i) {
          const int q = q0 + i;
          const float z[2] = {acc[Fragment::index(q, half, 0)], acc[Fragment::index(q, half, 1)]};
          const SwiGLUGradPair out =
              swiglu_backward_pair(z, g_bits[i], u_bits[i], weight, partial[half]);
          *reinterpret_cast<__nv_bfloat162*>(dg_out + q * 8) = out.dg;
          *reinterpret_cast<__nv_bfloat162*>(du_out + q * 8) = out.du;
          if (a_out) *reinterpret_cast<__nv_bfloat162*>(a_out + q * 8) = out.a;
        }
      }
    }
    store_dp_partials(t, partial);
  }

  // Quarter `quarter` (64 columns) of the slab's h = [gate | up] by TMA: the gate box into
  // the staging buffer's last 64 x 64 box, the up box into h_up. One thread.
  // kHAhead: the calling warp's 16 rows of them.
  __device__ __forceinline__ void load_h_quarter(const Tile& t, int quarter) {
    const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
    const int row = t.row0 + consumer_ * 64 + part() * kBoxRows;
    const int offset = part_offset();
    mbarrier_arrive_expect_tx(h_bar_, 2 * kBoxRows * 128);
    tma_load_2d(buffers_.staging[consumer_] + 3 * kStoreBoxBytes + offset, &p_.map_h, h_bar_, col,
                row);
    tma_load_2d(buffers_.h_up[consumer_] + offset, &p_.map_h, h_bar_, o_.half_n + col, row);
  }

  // The padded layout with 256-wide tiles (every slab row is the expert's or a pad row): per
  // 64-column quarter, dg, du and a of the slab go into three 64 x 64 boxes of the staging
  // buffer and leave by TMA stores, which drain while the next quarter is computed (4-byte
  // register stores would cost about as much as the tile's MMAs). The quarter's h arrives by
  // TMA: quarter 0 was requested before the tile's MMAs (begin_tile), quarter q + 1 as soon as
  // every thread has read quarter q, so the loads hide under the math.
  __device__ __forceinline__ void store_staged(const Tile& t, const float (&acc)[kBlockN / 2]) {
    constexpr int kQuarters = kBlockN / kStoreBoxCols;
    constexpr int kChunksPerBox = kStoreBoxCols / 8;
    constexpr int kHalvesAtOnce = kHAhead ? 2 : 1;
    static_assert(4 * kStoreBoxBytes <= kStagingBytes);
    const int thread = threadIdx.x % 128;
    const bool leader = thread == 0;
    const int slab = consumer_ * 64;
    const int lane = thread % 32;
    uint8_t* staging = buffers_.staging[consumer_];
    const uint8_t* h_gate = staging + 3 * kStoreBoxBytes;
    const uint8_t* h_up = buffers_.h_up[consumer_];
    float partial[2] = {0.f, 0.f};
    bool valid[2];
    float weight[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = Fragment::row(half);
      valid[half] = slab + r < t.rows;
      const int64_t row = valid[half] ? t.row0 + slab + r : 0;
      weight[half] = valid[half] ? __ldg(&o_.slot_weights[__ldg(&o_.row_slot[row])]) : 0.f;
    }
#pragma unroll
    for (int quarter = 0; quarter < kQuarters; ++quarter) {
      mbarrier_wait(h_bar_, h_phase_);
      h_phase_ ^= 1;
      // ldmatrix and stmatrix move four 8-column chunks of a half's 8 rows per instruction:
      // lane l addresses row l % 8 of chunk i0 + l / 8, and each thread gets or gives the
      // values of its fragment row (a quarter of the instructions of 4-byte loads and stores).
      const auto box_offset = [&](int half, int i0) {
        const int mrow = (thread / 32) * 16 + half * 8 + lane % 8;
        return mrow * 128 + (((i0 + lane / 8) ^ (lane % 8)) * 16);
      };
#pragma unroll
      for (int h0 = 0; h0 < 2; h0 += kHalvesAtOnce) {
        // The h values of the fragment rows h0.. from the swizzled boxes (rows past the
        // expert's end hold the next rows of h: read as zeros).
        uint32_t g_bits[kHalvesAtOnce][kChunksPerBox], u_bits[kHalvesAtOnce][kChunksPerBox];
#pragma unroll
        for (int j = 0; j < kHalvesAtOnce; ++j) {
          const int half = h0 + j;
#pragma unroll
          for (int i0 = 0; i0 < kChunksPerBox; i0 += 4) {
            ldmatrix_x4(h_gate + box_offset(half, i0), g_bits[j][i0], g_bits[j][i0 + 1],
                        g_bits[j][i0 + 2], g_bits[j][i0 + 3]);
            ldmatrix_x4(h_up + box_offset(half, i0), u_bits[j][i0], u_bits[j][i0 + 1],
                        u_bits[j][i0 + 2], u_bits[j][i0 + 3]);
          }
#pragma unroll
          for (int i = 0; i < kChunksPerBox; ++i) {
            g_bits[j][i] = valid[half] ? g_bits[j][i] : 0u;
            u_bits[j][i] = valid[half] ? u_bits[j][i] : 0u;
          }
        }
        // Before the first writes to staging: the last quarter's stores have read it. Once
        // every thread has this quarter's h in registers: request the next quarter.
        if constexpr (kHAhead) {
          __syncwarp();
          if (lane == 0) {
            if (quarter + 1 < kQuarters) load_h_quarter(t, quarter + 1);
            bulk_wait_group_read_all();
          }
          __syncwarp();
        } else {
          if (h0 == 0 && leader) bulk_wait_group_read_all();
          consumer_barrier_sync(consumer_);
          if (h0 + kHalvesAtOnce == 2 && leader && quarter + 1 < kQuarters) {
            load_h_quarter(t, quarter + 1);
          }
        }
#pragma unroll
        for (int j = 0; j < kHalvesAtOnce; ++j) {
          const int half = h0 + j;
#pragma unroll
          for (int i0 = 0; i0 < kChunksPerBox; i0 += 4) {
            uint32_t dg[4], du[4], a[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
              const int q = quarter * kChunksPerBox + i0 + m;
              // Pad rows: z may be anything (their A rows were never copied); with z = 0 and
              // h = 0, dg = du = a = 0.
              const float z[2] = {valid[half] ? acc[Fragment::index(q, half, 0)] : 0.f,
                                  valid[half] ? acc[Fragment::index(q, half, 1)] : 0.f};
              const SwiGLUGradPair out = swiglu_backward_pair(
                  z, g_bits[j][i0 + m], u_bits[j][i0 + m], weight[half], partial[half]);
              dg[m] = *reinterpret_cast<const uint32_t*>(&out.dg);
              du[m] = *reinterpret_cast<const uint32_t*>(&out.du);
              a[m] = *reinterpret_cast<const uint32_t*>(&out.a);
            }
            uint8_t* at = staging + box_offset(half, i0);
            stmatrix_x4(at, dg[0], dg[1], dg[2], dg[3]);
            stmatrix_x4(at + kStoreBoxBytes, du[0], du[1], du[2], du[3]);
            stmatrix_x4(at + 2 * kStoreBoxBytes, a[0], a[1], a[2], a[3]);
          }
        }
      }
      fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
      if constexpr (kHAhead) {
        __syncwarp();
      } else {
        consumer_barrier_sync(consumer_);
      }
      if (kHAhead ? lane == 0 : leader) {
        const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
        const int row = t.row(o_.padded) + slab + part() * kBoxRows;
        const uint8_t* rows = staging + part_offset();
        tma_store_2d(&p_.map_dh, rows, col, row);
        tma_store_2d(&p_.map_dh, rows + kStoreBoxBytes, o_.half_n + col, row);
        if (o_.a_out != nullptr) tma_store_2d(&p_.map_a_out, rows + 2 * kStoreBoxBytes, col, row);
        bulk_commit_group();
      }
    }
    store_dp_partials(t, partial);
  }

  // The slab's dp partials: the four lanes of a quad hold all columns of the same two rows;
  // summed over the quad in a fixed order, one partial per (row, N-tile).
  __device__ __forceinline__ void store_dp_partials(const Tile& t, float (&partial)[2]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      partial[half] += __shfl_xor_sync(0xffffffffu, partial[half], 1);
      partial[half] += __shfl_xor_sync(0xffffffffu, partial[half], 2);
    }
    if (threadIdx.x % 128 % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = consumer_ * 64 + Fragment::row(half);
        if (r < t.rows) {
          o_.dp_partial[int64_t(t.row0 + r) * o_.dp_columns + t.n_tile] = partial[half];
        }
      }
    }
  }

  const Params& p_;  // for the tensor maps
  const Operands o_;  // a copy (epilogue_common.cuh says why)
  Buffers& buffers_;
  uint64_t* h_bar_;
  int consumer_;
  uint32_t h_phase_ = 0;  // parity of this warpgroup's next h quarter
};

}  // namespace megamoe::sm90
