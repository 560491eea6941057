// The SwiGLU backward epilogue, fused into the dgrad of L2. The accumulators are
// z = w_down_e^T dy for each sorted row (slot); with h = [g | u] the recomputed or saved L1
// output, a = silu(g) u and the router weight p of the row's slot:
//   da = p z,   dg = da u silu'(g),   du = da silu(g)   -> dh = [dg | du] (C, [rows, 2I])
//   dp = <z, a>                                         -> one partial per (row, N-tile)
//   a                                                   -> a_out (optional, for dW_down)
// In the padded layout, pad rows of dh and a_out are written as zeros: they are the weight
// gradients' operands.
//
// kFp8Dh (the FP8 backward, 256-wide tiles, padded layout): dh is not written in bf16 but as
// the two e4m3 copies its GEMMs read, the bits of the bf16 dh followed by
// quantize_fp8_rows_and_columns: its rows with 1x128 scales (the dx GEMM's A) and its
// token-contiguous copy with a scale per column and 128 rows (dW_gate_up's A). A tile's 128
// padded rows are exactly one such row block, so a column's scale needs the tile alone: the
// two warpgroups' slabs meet through shared memory. Each value is rounded to bf16 first, as
// the bf16 dh holds it, and the scales and e4m3 values come from fp8_recipe.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/fp8_recipe.cuh"
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

template <int kBlockN_, bool kFp8Dh_ = false>
class SwiGLUBackwardEpilogue {
 public:
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kFp8Dh = kFp8Dh_;
  static_assert(!kFp8Dh || kBlockN == 256, "FP8 dh leaves through the staged path");
  // kFp8Dh: the quantization's registers (the bf16 pairs of two quarters, beside the
  // accumulators of the loop over quarters) spill at the wide FP8 mainloop's 232; the
  // producer's one TMA thread fits in 24. Otherwise the mainloop's split (void).
  using Registers = std::conditional_t<kFp8Dh, RegisterSplit<24, 240>, void>;
  static constexpr int kOutCols = kBlockN;  // of a = silu(g) u; dh has two such tiles
  static constexpr BColumns kBColumns = BColumns::kContiguous;

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
    // kFp8Dh (dh null; its rows go through map_dh): the scale of row r's 1x128 block j at
    // row_scales[j * row_scale_ld + r]; the token-contiguous copy columns [2I, columns_ld]
    // (columns_ld: the padded rows), the scale of column c's rows 128b.. at
    // column_scales[b * 2I + c].
    float* row_scales;
    int64_t row_scale_ld;
    uint8_t* columns;
    float* column_scales;
    int64_t columns_ld;
  };
  struct Params {
    CUtensorMap map_dh;     // dh in 64 x 64 boxes (kFp8Dh: its e4m3 rows in 64 x 128)
    CUtensorMap map_a_out;  // a_out in 64 x 64 boxes (when a_out is set)
    CUtensorMap map_h;      // h in 64 x 64 boxes (read by TMA in the staged path)
    Operands o;
  };
  static Params params(const __nv_bfloat16* h, int64_t h_rows, __nv_bfloat16* dh,
                       __nv_bfloat16* a_out, int64_t out_rows, bool padded,
                       const float* slot_weights, const int32_t* row_slot, float* dp_partial,
                       int64_t half_n) {
    Params p{};
    p.map_dh = make_tensor_map(dh, out_rows, 2 * half_n, 64);
    if (a_out != nullptr) p.map_a_out = make_tensor_map(a_out, out_rows, half_n, 64);
    p.map_h = make_tensor_map(h, h_rows, 2 * half_n, 64);
    p.o = {h, dh, a_out, slot_weights, row_slot, dp_partial,
           static_cast<int32_t>(half_n / kBlockN), static_cast<int32_t>(half_n), padded,
           nullptr, 0, nullptr, nullptr, 0};
    return p;
  }
  // kFp8Dh: dh as e4m3 rows (dh_rows [out_rows, 2I], row_scales) and columns, for a padded
  // C of out_rows rows (a multiple of 128).
  static Params params_fp8(const __nv_bfloat16* h, int64_t h_rows, __nv_fp8_e4m3* dh_rows,
                           float* row_scales, int64_t row_scale_ld, __nv_fp8_e4m3* columns,
                           float* column_scales, __nv_bfloat16* a_out, int64_t out_rows,
                           const float* slot_weights, const int32_t* row_slot,
                           float* dp_partial, int64_t half_n) {
    Params p = params(h, h_rows, nullptr, a_out, out_rows, true, slot_weights, row_slot,
                      dp_partial, half_n);
    p.map_dh = make_tensor_map<__nv_fp8_e4m3>(dh_rows, out_rows, 2 * half_n, 64);
    p.o.row_scales = row_scales;
    p.o.row_scale_ld = row_scale_ld;
    p.o.columns = reinterpret_cast<uint8_t*>(columns);
    p.o.column_scales = column_scales;
    p.o.columns_ld = out_rows;
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
  // kFp8Dh: each warpgroup's column maxima over its 64 rows, per pair of columns (the bf16
  // abs bits of both, packed), for the quarters of even and of odd index.
  struct StagingHUpAndColumnMax {
    uint8_t staging[2][kStagingBytes];
    uint8_t h_up[2][kStoreBoxBytes];
    uint32_t column_max[2][2][64];  // [quarter % 2][consumer][pair: dg's 32, then du's 32]
  };

 public:
  using Buffers = std::conditional_t<
      kFp8Dh, StagingHUpAndColumnMax, std::conditional_t<kHByTma, StagingAndHUp, StagingOnly>>;
  struct Barriers {
    uint64_t h_full[2];  // kHByTma: a quarter of h has landed (per consumer warpgroup)
  };
  __device__ __forceinline__ static void init(Barriers& b) {
    for (int w = 0; w < 2; ++w) mbarrier_init(&b.h_full[w], 1);
  }

  __device__ __forceinline__ SwiGLUBackwardEpilogue(const Params& p, Buffers& buffers,
                                                    Barriers& barriers, int consumer)
      : p_(p), o_(p.o), buffers_(buffers), h_bar_(&barriers.h_full[consumer]), consumer_(consumer) {}

  // The staged path's first quarter of h, fetched under this tile's MMAs (the buffers were
  // released by the last tile's epilogue, whose final barrier every thread has passed).
  __device__ __forceinline__ void begin_tile(const Tile& t) {
    if constexpr (kHByTma) {
      if (o_.padded && threadIdx.x % 128 == 0) load_h_quarter(t, 0);
    }
  }

  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    if constexpr (kFp8Dh) {  // padded, as the host entry checks
      store_staged(t, acc);
      return;
    }
    if constexpr (kHByTma) {
      if (o_.padded) {
        store_staged(t, acc);
        return;
      }
    }
    store_direct(t, acc);
  }
  __device__ __forceinline__ void finish() { wait_for_tma_stores(); }

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
  __device__ __forceinline__ void load_h_quarter(const Tile& t, int quarter) {
    const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
    const int row = t.row0 + consumer_ * 64;
    mbarrier_arrive_expect_tx(h_bar_, 2 * kStoreBoxBytes);
    tma_load_2d(buffers_.staging[consumer_] + 3 * kStoreBoxBytes, &p_.map_h, h_bar_, col, row);
    tma_load_2d(buffers_.h_up[consumer_], &p_.map_h, h_bar_, o_.half_n + col, row);
  }

  // The padded layout with 256-wide tiles (every slab row is the expert's or a pad row): per
  // 64-column quarter, dg, du and a of the slab go into three 64 x 64 boxes of the staging
  // buffer and leave by TMA stores, which drain while the next quarter is computed (4-byte
  // register stores would cost about as much as the tile's MMAs). The quarter's h arrives by
  // TMA: quarter 0 was requested before the tile's MMAs (begin_tile), quarter q + 1 as soon as
  // every thread has read quarter q, so the loads hide under the math.
  //
  // kFp8Dh: the quarters run as a loop, not unrolled, over the first quarter's accumulators,
  // which the others move into after each quarter: the quantization makes a quarter's code
  // about 2,000 instructions, and four unrolled copies (135 KB of SASS) left the warps
  // waiting on instruction fetch for a quarter of the epilogue's time.
  __device__ __forceinline__ void store_staged(const Tile& t, const float (&acc)[kBlockN / 2]) {
    static_assert(4 * kStoreBoxBytes <= kStagingBytes);
    const int slab = consumer_ * 64;
    QuarterState s;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = Fragment::row(half);
      s.valid[half] = slab + r < t.rows;
      const int64_t row = s.valid[half] ? t.row0 + slab + r : 0;
      s.weight[half] = s.valid[half] ? __ldg(&o_.slot_weights[__ldg(&o_.row_slot[row])]) : 0.f;
    }
    if constexpr (kFp8Dh) {
      float z[kBlockN / 2];
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) z[i] = acc[i];
      // The bf16 dg and du pairs of the last quarter of even index, [half][chunk], for the
      // rows' quantization (a 1x128 block spans two quarters).
      uint32_t even_dg[2][kQuarterChunks], even_du[2][kQuarterChunks];
#pragma unroll 1
      for (int quarter = 0; quarter < kQuarters; ++quarter) {
        stage_quarter(t, quarter, *reinterpret_cast<const float(*)[kQuarterValues]>(z), s);
        store_quarter(t, quarter);
        store_fp8_columns(t, quarter, staging());
        if (quarter % 2 == 1) {
          // The rows go out through the same boxes, once every thread has read the columns.
          consumer_barrier_sync(consumer_);
          store_fp8_rows(t, quarter / 2, even_dg, s.dg, even_du, s.du, staging());
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int c = 0; c < kQuarterChunks; ++c) {
            even_dg[half][c] = s.dg[half][c];
            even_du[half][c] = s.du[half][c];
          }
        }
#pragma unroll
        for (int i = 0; i < kBlockN / 2 - kQuarterValues; ++i) z[i] = z[i + kQuarterValues];
      }
    } else {
#pragma unroll
      for (int quarter = 0; quarter < kQuarters; ++quarter) {
        stage_quarter(t, quarter,
                      *reinterpret_cast<const float(*)[kQuarterValues]>(acc + quarter * kQuarterValues), s);
        store_quarter(t, quarter);
      }
    }
    store_dp_partials(t, s.partial);
  }

  static constexpr int kQuarters = kBlockN / kStoreBoxCols;
  static constexpr int kQuarterChunks = kStoreBoxCols / 8;   // 8-column chunks of a quarter
  static constexpr int kQuarterValues = 4 * kQuarterChunks;  // a thread's accumulators of one
  // What the quarters of a tile share: the rows' validity and router weights, the dp
  // partials, and the quarter's bf16 dg and du pairs ([half][chunk]; kFp8Dh reads them).
  struct QuarterState {
    bool valid[2];
    float weight[2];
    float partial[2] = {0.f, 0.f};
    uint32_t dg[2][kQuarterChunks], du[2][kQuarterChunks];
  };
  __device__ __forceinline__ uint8_t* staging() const { return buffers_.staging[consumer_]; }

  // Quarter `quarter` of the slab from z, its accumulators: waits for its h, requests the
  // next quarter's, and stages dg, du and a in boxes 0-2 of the staging buffer.
  __device__ __forceinline__ void stage_quarter(const Tile& t, int quarter,
                                                const float (&z)[kQuarterValues], QuarterState& s) {
    const int thread = threadIdx.x % 128;
    const bool leader = thread == 0;
    const int lane = thread % 32;
    uint8_t* staging = this->staging();
    const uint8_t* h_gate = staging + 3 * kStoreBoxBytes;
    const uint8_t* h_up = buffers_.h_up[consumer_];
    mbarrier_wait(h_bar_, h_phase_);
    h_phase_ ^= 1;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // ldmatrix and stmatrix move four 8-column chunks of the half's 8 rows per
      // instruction: lane l addresses row l % 8 of chunk i0 + l / 8, and each thread gets
      // or gives the values of its fragment row (a quarter of the instructions of 4-byte
      // loads and stores).
      const int mrow = (thread / 32) * 16 + half * 8 + lane % 8;
      const auto box_offset = [&](int i0) {
        return mrow * 128 + (((i0 + lane / 8) ^ (lane % 8)) * 16);
      };
      // The row's h values of the quarter from the swizzled boxes (rows past the expert's
      // end hold the next rows of h: read as zeros).
      uint32_t g_bits[kQuarterChunks], u_bits[kQuarterChunks];
#pragma unroll
      for (int i0 = 0; i0 < kQuarterChunks; i0 += 4) {
        ldmatrix_x4(h_gate + box_offset(i0), g_bits[i0], g_bits[i0 + 1], g_bits[i0 + 2],
                    g_bits[i0 + 3]);
        ldmatrix_x4(h_up + box_offset(i0), u_bits[i0], u_bits[i0 + 1], u_bits[i0 + 2],
                    u_bits[i0 + 3]);
      }
#pragma unroll
      for (int i = 0; i < kQuarterChunks; ++i) {
        g_bits[i] = s.valid[half] ? g_bits[i] : 0u;
        u_bits[i] = s.valid[half] ? u_bits[i] : 0u;
      }
      if (half == 0) {
        if (leader) bulk_wait_group_read_all();  // the last quarter's stores have read staging
        consumer_barrier_sync(consumer_);
      } else {
        // Every thread has this quarter's h in registers: request the next quarter.
        consumer_barrier_sync(consumer_);
        if (leader && quarter + 1 < kQuarters) load_h_quarter(t, quarter + 1);
      }
#pragma unroll
      for (int i0 = 0; i0 < kQuarterChunks; i0 += 4) {
        uint32_t a[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int q = i0 + m;
          // Pad rows: z may be anything (their A rows were never copied); with z = 0 and
          // h = 0, dg = du = a = 0.
          const float zq[2] = {s.valid[half] ? z[Fragment::index(q, half, 0)] : 0.f,
                               s.valid[half] ? z[Fragment::index(q, half, 1)] : 0.f};
          const SwiGLUGradPair out =
              swiglu_backward_pair(zq, g_bits[q], u_bits[q], s.weight[half], s.partial[half]);
          s.dg[half][q] = *reinterpret_cast<const uint32_t*>(&out.dg);
          s.du[half][q] = *reinterpret_cast<const uint32_t*>(&out.du);
          a[m] = *reinterpret_cast<const uint32_t*>(&out.a);
        }
        const uint32_t(&dg)[kQuarterChunks] = s.dg[half];
        const uint32_t(&du)[kQuarterChunks] = s.du[half];
        uint8_t* at = staging + box_offset(i0);
        stmatrix_x4(at, dg[i0], dg[i0 + 1], dg[i0 + 2], dg[i0 + 3]);
        stmatrix_x4(at + kStoreBoxBytes, du[i0], du[i0 + 1], du[i0 + 2], du[i0 + 3]);
        stmatrix_x4(at + 2 * kStoreBoxBytes, a[0], a[1], a[2], a[3]);
      }
    }
  }

  // The staged quarter's TMA stores: dg and du (bf16 dh; not kFp8Dh) and a.
  __device__ __forceinline__ void store_quarter(const Tile& t, int quarter) {
    fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
    consumer_barrier_sync(consumer_);
    if (threadIdx.x % 128 == 0) {
      uint8_t* staging = this->staging();
      const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
      const int row = t.row(o_.padded) + consumer_ * 64;
      if constexpr (!kFp8Dh) {
        tma_store_2d(&p_.map_dh, staging, col, row);
        tma_store_2d(&p_.map_dh, staging + kStoreBoxBytes, o_.half_n + col, row);
      }
      if (o_.a_out != nullptr) tma_store_2d(&p_.map_a_out, staging + 2 * kStoreBoxBytes, col, row);
      bulk_commit_group();
    }
  }

  // kFp8Dh: the quarter's dg and du columns (boxes 0 and 1 of the staging: this warpgroup's
  // 64 rows) quantized per column over the tile's 128 rows, into the token-contiguous copy.
  // Warp w takes 16 column pairs of box w / 2; lanes 0-15 rows 0-31 of the slab, lanes 16-31
  // rows 32-63, which they read in the order 32 + (i ^ 4): their swizzled 16-byte slots are
  // then the other half of the row's 128 bytes, and each load of the warp hits 32 banks.
  // The values are read twice, for the maxima and after the barrier for the e4m3 bytes:
  // holding all 32 words across the barrier, beside the rows' words and the accumulators
  // of the quarters to come, spills.
  __device__ __forceinline__ void store_fp8_columns(const Tile& t, int quarter,
                                                    const uint8_t* staging) {
    const int thread = threadIdx.x % 128;
    const int lane = thread % 32, warp = thread / 32;
    const int box = warp / 2;  // 0: dg, 1: du
    const int pair = (warp % 2) * 16 + lane % 16;
    const bool upper = lane >= 16;
    const int flip = upper ? 4 : 0;
    const uint8_t* base = staging + box * kStoreBoxBytes + (upper ? 32 * 128 : 0) + (pair % 4) * 4;
    // The pair's bf16 values in row (i ^ flip) of the lane's 32.
    const auto load = [&](int i) {
      const int r = i ^ flip;
      return *reinterpret_cast<const uint32_t*>(base + r * 128 + (((pair / 4) ^ (r % 8)) * 16));
    };
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 32; ++i) m = max_halves(m, load(i) & kBf16AbsMask2);
    m = max_halves(m, __shfl_xor_sync(~0u, m, 16));
    uint32_t(&maxima)[2][64] = buffers_.column_max[quarter % 2];
    const int index = box * 32 + pair;
    if (!upper) maxima[consumer_][index] = m;
    consumers_barrier_sync();
    m = max_halves(maxima[0][index], maxima[1][index]);
    // dh's column of the pair's first value, and the lane's first row.
    const int col = box * o_.half_n + t.n_tile * kBlockN + quarter * kStoreBoxCols + 2 * pair;
    const int64_t row = t.padded_row0 + consumer_ * 64 + (upper ? 32 : 0);
    Fp8BlockScale s[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s[h] = fp8_block_scale_bf16(h ? m >> 16 : m & 0xFFFFu);
      if (consumer_ == 0 && !upper) {
        o_.column_scales[int64_t(t.padded_row0 / kBlockM) * (2 * o_.half_n) + col + h] = s[h].scale;
      }
    }
    uint32_t q[2][8];  // q[h][k]: the pair's value h in the rows 4k.. 4k + 3 of the load order
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t v[4] = {load(4 * k), load(4 * k + 1), load(4 * k + 2), load(4 * k + 3)};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t select = h ? 0x7632u : 0x5410u;
        const uint32_t w01 = __byte_perm(v[0], v[1], select);
        const uint32_t w23 = __byte_perm(v[2], v[3], select);
        q[h][k] = s[h].nonfinite ? kE4m3NanX4 : fp8_quad(w01, w23, s[h].r, s[h].r, s[h].r, s[h].r);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // In row order: the load order's groups of four rows k and k ^ 1 trade places in the
      // upper lanes.
      uint32_t ordered[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) ordered[k] = upper ? q[h][k ^ 1] : q[h][k];
      uint8_t* out = o_.columns + int64_t(col + h) * o_.columns_ld + row;
      *reinterpret_cast<uint4*>(out) = make_uint4(ordered[0], ordered[1], ordered[2], ordered[3]);
      *reinterpret_cast<uint4*>(out + 16) =
          make_uint4(ordered[4], ordered[5], ordered[6], ordered[7]);
    }
  }

  // kFp8Dh: the slab's rows of dg and of du over quarters 2 pair and 2 pair + 1, one 1x128
  // block each, quantized (as quantize_slab in epilogue_fp8_rows.cuh) and staged in boxes 0
  // (dg) and 1 (du) as 64 rows x 128 bytes for two TMA stores.
  __device__ __forceinline__ void store_fp8_rows(const Tile& t, int pair,
                                                 const uint32_t (&even_dg)[2][kQuarterChunks],
                                                 const uint32_t (&odd_dg)[2][kQuarterChunks],
                                                 const uint32_t (&even_du)[2][kQuarterChunks],
                                                 const uint32_t (&odd_du)[2][kQuarterChunks],
                                                 uint8_t* staging) {
    const int slab_row = t.padded_row0 + consumer_ * 64;
    const int col = t.n_tile * kBlockN + pair * 128;  // the dg block's first column
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const uint32_t(&even)[2][kQuarterChunks] = which == 0 ? even_dg : even_du;
      const uint32_t(&odd)[2][kQuarterChunks] = which == 0 ? odd_dg : odd_du;
      uint8_t* box = staging + which * kStoreBoxBytes;
      const int64_t block = (which * o_.half_n + col) / 128;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t amax = 0;
#pragma unroll
        for (int c = 0; c < kQuarterChunks; ++c) {
          amax = max_halves(amax, even[half][c] & kBf16AbsMask2);
          amax = max_halves(amax, odd[half][c] & kBf16AbsMask2);
        }
        amax = max_of_halves(amax);
        // The row's other 96 columns are held by the other three lanes of this lane's quad.
        amax = max(amax, __shfl_xor_sync(~0u, amax, 1));
        amax = max(amax, __shfl_xor_sync(~0u, amax, 2));
        const Fp8BlockScale b = fp8_block_scale_bf16(amax);
        const int r = Fragment::row(half);
        if (Fragment::col0() == 0) o_.row_scales[block * o_.row_scale_ld + slab_row + r] = b.scale;
        uint8_t* row_base = box + r * 128 + Fragment::col0();
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          // Word k: chunks 2k and 2k + 1 of the block (quarter k / 4 of the pair).
          const uint32_t(&words)[2][kQuarterChunks] = k < 4 ? even : odd;
          const uint32_t lo = words[half][2 * (k % 4)];
          const uint32_t hi = words[half][2 * (k % 4) + 1];
          const uint32_t word = b.nonfinite ? kE4m3NanX4 : fp8_quad(lo, hi, b.r, b.r, b.r, b.r);
          // 16-byte slot k of row r at k ^ (r % 8): the swizzle.
          uint8_t* slot = row_base + ((k ^ (r % 8)) * 16);
          *reinterpret_cast<uint16_t*>(slot) = static_cast<uint16_t>(word);
          *reinterpret_cast<uint16_t*>(slot + 8) = static_cast<uint16_t>(word >> 16);
        }
      }
    }
    fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
    consumer_barrier_sync(consumer_);
    if (threadIdx.x % 128 == 0) {
      tma_store_2d(&p_.map_dh, staging, col, slab_row);
      tma_store_2d(&p_.map_dh, staging + kStoreBoxBytes, o_.half_n + col, slab_row);
      bulk_commit_group();
    }
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
