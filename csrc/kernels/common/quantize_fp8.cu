#include "kernels/common/quantize_fp8.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/bf16_scale.cuh"
#include "kernels/common/fp8_recipe.cuh"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/sm_count.h"

namespace megamoe {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Thread (rg, cg) of a tile holds rows 8 rg .. 8 rg + 7 and columns 8 cg .. 8 cg + 7: eight
// 16-byte loads, each half-warp reading 256 contiguous bytes of one row.
constexpr int kColGroups = 16;
constexpr int kRowsPerThread = 8;
// Dynamic shared memory of the looping kernels, which stage their next tile there (gathered
// columns, to rows, rows and columns): one tile of bf16 values, 16 bytes per thread and row.
constexpr int kStageBytes = kRowsPerThread * kThreads * 16;

// out[j] = byte j of a0, a1, a2, a3 (a0's in the low byte): a 4 x 4 byte transpose.
__device__ __forceinline__ void transpose4x4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t (&out)[4]) {
  const uint32_t t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a2, a3, 0x5140);
  const uint32_t t2 = __byte_perm(a0, a1, 0x7362), t3 = __byte_perm(a2, a3, 0x7362);
  out[0] = __byte_perm(t0, t1, 0x5410);
  out[1] = __byte_perm(t0, t1, 0x7632);
  out[2] = __byte_perm(t2, t3, 0x5410);
  out[3] = __byte_perm(t2, t3, 0x7632);
}

__device__ __forceinline__ uint32_t abs_max_bits(const uint4& v) {
  return max_halves(max_halves(v.x & kBf16AbsMask2, v.y & kBf16AbsMask2),
                    max_halves(v.z & kBf16AbsMask2, v.w & kBf16AbsMask2));
}

// Bytes of the packed e4m3 word that belong to non-finite columns become NaN.
__device__ __forceinline__ uint32_t mask_nan(uint32_t q, uint32_t nan_bytes) {
  return (q & ~nan_bytes) | (kE4m3NanX4 & nan_bytes);
}

// Thread (rg, cg) holds rows 8 rg .. 8 rg + 7 of a tile, as do the other 15 lanes of its
// half-warp. The per-row indices (a gathered row's token and slot, a row's destinations)
// are fetched one per lane and shuffled to the half-warp where used: lane cg holds those of
// row cg % 8, or entry cg of each row's destinations; row_lane(i) is the lane holding entry
// i. One register per index instead of eight, each half-warp's index loads coalesced.
__device__ __forceinline__ int row_lane(int i) { return (threadIdx.x % 32 & 16) + i; }

// The shared memory of one tile: the transposed e4m3 values, the column maxima per warp
// and the columns' multipliers (kColumns128, kTiles128). Its size is kept a multiple of 128
// bytes: the looping kernels' dynamic `stage` follows it, and their cp.async fills of `stage`
// ran 4% slower starting 16 bytes past a 128-byte boundary.
struct alignas(128) TileSmem {
  alignas(16) uint8_t staged[kTile * kTile];
  uint32_t partial_max[kWarps][kColGroups * 4];
  float column_r[kTile];
  uint32_t tile_max[2];  // kColumnTiles128: the tile's maximum as each of warps 0 and 1 has it
};

struct TilePos {
  int64_t b, ti, tj, row0, col0;
};

__device__ __forceinline__ TilePos tile_pos(int64_t tile, int64_t row_tiles, int64_t col_tiles) {
  const int64_t ti = (tile / col_tiles) % row_tiles, tj = tile % col_tiles;
  return {tile / (row_tiles * col_tiles), ti, tj, ti * kTile, tj * kTile};
}

// tile_pos in 32-bit arithmetic, for the looping kernels whose tile counts checked_grid
// keeps below 2^31: a 64-bit division's slow path needs stack, which the build refuses, at
// the 80 registers of 3 CTAs per SM.
__device__ __forceinline__ TilePos tile_pos32(uint32_t tile, uint32_t row_tiles,
                                              uint32_t col_tiles) {
  const uint32_t ti = tile / col_tiles % row_tiles, tj = tile % col_tiles;
  return {tile / (row_tiles * col_tiles), ti, tj, int64_t(ti) * kTile, int64_t(tj) * kTile};
}

// Tile `tile` of a gathered column quantization over `used` row tiles: column stripe
// tile / used, row tile tile % used (see quantize_fp8_kernel).
__device__ __forceinline__ TilePos gathered_pos(int64_t tile, int64_t used) {
  const int64_t ti = tile % used, tj = tile / used;
  return {0, ti, tj, ti * kTile, tj * kTile};
}

// This thread's 8 x 8 values of a tile of x; rows from a.rows on (padding) as zeros.
__device__ __forceinline__ void load_rows(const Fp8QuantizeArgs& a, const TilePos& t,
                                          uint4 (&v)[kRowsPerThread]) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
  const __nv_bfloat16* xb = a.x + t.b * a.x_batch + t.col0 + 8 * cg;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = t.row0 + kRowsPerThread * rg + i;
    v[i] = row < a.rows ? __ldg(reinterpret_cast<const uint4*>(xb + row * a.x_row))
                        : make_uint4(0, 0, 0, 0);
  }
}

// This thread's 8 x 8 values of a tile of x, loaded by cp.async into its 8 slots of `stage`
// (slot i at stage[i * kThreads + threadIdx.x]); rows from a.rows on as zeros. The next
// tile of the to-rows and the rows-and-columns kernels waits there instead of in 32
// registers (3 CTAs per SM instead of 2).
__device__ __forceinline__ void load_rows_async(const Fp8QuantizeArgs& a, const TilePos& t,
                                                uint4* stage) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
  const __nv_bfloat16* xb = a.x + t.b * a.x_batch + t.col0 + 8 * cg;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = t.row0 + kRowsPerThread * rg + i;
    const uint32_t dst =
        static_cast<uint32_t>(__cvta_generic_to_shared(stage + i * kThreads + threadIdx.x));
    // A row past the end reads nothing (source size 0) from a valid address: row 0's.
    const __nv_bfloat16* src = xb + (row < a.rows ? row : 0) * a.x_row;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(row < a.rows ? 16 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// ---- quantize_fp8_to_rows: where each row goes.

// Entry j of row `row`'s destinations, -1 for none (a negative entry, j >= per_row, or a
// row from `rows` on).
__device__ __forceinline__ int32_t dest_entry(const Fp8RowDests& dests, int64_t rows,
                                              int64_t row, int64_t j) {
  return j < dests.per_row && row < rows ? __ldg(&dests.rows[row * dests.per_row + j]) : -1;
}

// Entry cg of the destinations of each of this thread's rows: all of them for per_row <=
// 16, the first 16 otherwise (the others are read where used).
__device__ __forceinline__ void load_dests(const Fp8RowDests& dests, int64_t rows,
                                           const TilePos& t, int32_t (&d)[kRowsPerThread]) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    d[i] = dest_entry(dests, rows, t.row0 + kRowsPerThread * rg + i, cg);
  }
}

// ---- quantize_fp8_columns_gathered: where each padded row comes from.

// This lane's row of row tile ti (row cg % 8 of its eight) as the plan's sorted row:
// token -1 for a padding row (the expert's or the matrix's: zeros), slot only with weights.
struct GatherRow {
  int32_t token = -1, slot = -1;
};

__device__ __forceinline__ GatherRow gather_row(const Fp8PaddedSource& p, int64_t rows,
                                                int64_t ti) {
  // The tile belongs to one expert: the last whose first tile is <= ti (ti is below
  // tile_offsets[E]). tile_offsets is nondecreasing from tile_offsets[0] = 0, so that expert
  // is the number of e in [1, E) with tile_offsets[e] <= ti: counted 32 experts a ballot,
  // whose loads are independent, where a binary search waits for one load per step. Every
  // lane of the warp calls this (the ballot's full mask): the callers' tile tests are
  // uniform over the block.
  const int experts = static_cast<int>(p.num_experts), lane = threadIdx.x % 32;
  int lo = 0;
#pragma unroll 4
  for (int base = 1; base < experts; base += 32) {
    const int e = base + lane;
    lo += __popc(__ballot_sync(~0u, e < experts && __ldg(&p.tile_offsets[e]) <= ti));
  }
  const int32_t first = __ldg(&p.expert_offsets[lo]);
  const int64_t count = __ldg(&p.expert_offsets[lo + 1]) - first;
  const int rg = threadIdx.x / kColGroups, cg = threadIdx.x % kColGroups;
  const int64_t row = ti * kTile + kRowsPerThread * rg + cg % kRowsPerThread;
  const int64_t local = row - int64_t(__ldg(&p.tile_offsets[lo])) * kTile;
  GatherRow g;
  if (row < rows && local < count) {
    const int64_t r = first + local;
    g.token = __ldg(&p.row_token[r]);
    if (p.slot_weights != nullptr) g.slot = __ldg(&p.row_slot[r]);
  }
  return g;
}

__device__ __forceinline__ float slot_weight(const Fp8PaddedSource& p, const GatherRow& g) {
  return p.slot_weights != nullptr && g.slot >= 0 ? __ldg(&p.slot_weights[g.slot]) : 0.0f;
}

// The unscaled token rows of this thread's 8 x 8 values (padding rows: zeros), loaded by
// cp.async into its 8 slots of `stage` (slot i at stage[i * kThreads + threadIdx.x]): the
// values wait in shared memory instead of registers, which gives the gathered kernel 3 CTAs
// per SM (80 registers; it held the next tile in 32 more registers at 2 CTAs per SM).
__device__ __forceinline__ void load_gathered_async(const Fp8QuantizeArgs& a, const TilePos& t,
                                                    const GatherRow& g, uint4* stage) {
  const __nv_bfloat16* xb = a.x + t.col0 + 8 * (threadIdx.x % kColGroups);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int32_t token = __shfl_sync(~0u, g.token, row_lane(i));
    const uint32_t dst =
        static_cast<uint32_t>(__cvta_generic_to_shared(stage + i * kThreads + threadIdx.x));
    const __nv_bfloat16* src = xb + max(token, 0) * a.x_row;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(token >= 0 ? 16 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// The token rows times their slot weights, as gather_rows_padded rounds them (padding rows
// stay zeros). Applied when the tile is quantized, not at the load: the prefetched values
// are still in flight then.
__device__ __forceinline__ void scale_gathered(const Fp8PaddedSource& p, const GatherRow& g,
                                               float w, uint4 (&v)[kRowsPerThread]) {
  if (p.slot_weights == nullptr) return;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int32_t token = __shfl_sync(~0u, g.token, row_lane(i));
    const float wi = __shfl_sync(~0u, w, row_lane(i));
    if (token >= 0) v[i] = scale_bf16x8(v[i], wi);
  }
}

// ---- One tile, loaded: its blocks' scales, the e4m3 values written directly (to the rows
// `d` and `dests` give with kToRows) and/or transposed (through shared memory, as 8 x 8
// byte blocks transposed in registers; 8-byte chunks XOR-swizzled by column group so that
// both the stores and the 16-byte reads are free of bank conflicts).
//
// A CTA that quantizes tile after tile reuses the shared memory without a barrier of its
// own (kColumns128, kColumnTiles128): each array is written for the next tile only past a
// barrier that follows every read of it for this one. partial_max, read before this tile's
// second barrier, is written after its third; column_r (read before the third) and staged
// (read after it) are written after the next tile's first; tile_max (kColumnTiles128 has a
// barrier between its write and its reads, before the column_r one) after the next tile's
// first.
struct NoHook {
  __device__ void operator()() const {}
};

// after_max (kColumns128, kColumnTiles128): called once this thread's values have all been
// read (into the column maxima), before the tile's first barrier: the gathered kernel issues
// the next tile's loads into the slots they came from there.
template <Fp8Blocks kBlocks, bool kToRows, typename AfterMax = NoHook>
__device__ __forceinline__ void quantize_tile(const Fp8QuantizeArgs& a, const TilePos& t,
                                              const uint4 (&v)[kRowsPerThread],
                                              const Fp8RowDests& dests,
                                              const int32_t (&d)[kRowsPerThread],
                                              TileSmem& sm, const AfterMax& after_max = {}) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t ti = t.ti, tj = t.tj, row0 = t.row0, col0 = t.col0;

  uint32_t qlo[kRowsPerThread], qhi[kRowsPerThread];  // columns 0-3 and 4-7 of each row
  float* scales = a.scales + t.b * a.s_batch;
  if constexpr (kBlocks == Fp8Blocks::kRows1x128) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      uint32_t m = max_of_halves(abs_max_bits(v[i]));
#pragma unroll
      for (int off = 1; off < kColGroups; off *= 2) m = max(m, __shfl_xor_sync(~0u, m, off));
      const Fp8BlockScale s = fp8_block_scale_bf16(m);
      qlo[i] = s.nonfinite ? kE4m3NanX4 : fp8_quad(v[i].x, v[i].y, s.r, s.r, s.r, s.r);
      qhi[i] = s.nonfinite ? kE4m3NanX4 : fp8_quad(v[i].z, v[i].w, s.r, s.r, s.r, s.r);
      const int64_t row = row0 + kRowsPerThread * rg + i;
      if constexpr (kToRows) {
        if (dests.row_scales != nullptr) {
          // Once per row, by x's row (scatter_row_scales moves it to the destinations).
          if (cg == 0 && row < a.rows) dests.row_scales[row * (a.cols / kTile) + tj] = s.scale;
          continue;
        }
        // Every lane writes the scale of its destination entries of the row.
        const auto write = [&](int32_t dest) {
          if (dest >= 0) scales[dest * a.s_0 + tj * a.s_1] = s.scale;
        };
        write(d[i]);
        for (int64_t j0 = kColGroups; j0 < dests.per_row; j0 += kColGroups) {
          write(dest_entry(dests, a.rows, row, j0 + cg));
        }
      } else if (cg == 0 && row < a.rows) {
        scales[row * a.s_0 + tj * a.s_1] = s.scale;
      }
    }
  } else if constexpr (kBlocks == Fp8Blocks::kTiles128) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) m = max_halves(m, abs_max_bits(v[i]));
    m = max_of_halves(m);
#pragma unroll
    for (int off = 1; off < 32; off *= 2) m = max(m, __shfl_xor_sync(~0u, m, off));
    if (lane == 0) sm.partial_max[warp][0] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, sm.partial_max[w][0]);
    const Fp8BlockScale s = fp8_block_scale_bf16(m);
    if (threadIdx.x == 0) scales[ti * a.s_0 + tj * a.s_1] = s.scale;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      qlo[i] = s.nonfinite ? kE4m3NanX4 : fp8_quad(v[i].x, v[i].y, s.r, s.r, s.r, s.r);
      qhi[i] = s.nonfinite ? kE4m3NanX4 : fp8_quad(v[i].z, v[i].w, s.r, s.r, s.r, s.r);
    }
  } else {
    // Per column: the packed maxima of this thread's 8 rows, then of the 16 row groups.
    uint32_t c[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      c[0] = max_halves(c[0], v[i].x & kBf16AbsMask2);
      c[1] = max_halves(c[1], v[i].y & kBf16AbsMask2);
      c[2] = max_halves(c[2], v[i].z & kBf16AbsMask2);
      c[3] = max_halves(c[3], v[i].w & kBf16AbsMask2);
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) c[w] = max_halves(c[w], __shfl_xor_sync(~0u, c[w], 16));
    after_max();
    if (lane < kColGroups) {
#pragma unroll
      for (int w = 0; w < 4; ++w) sm.partial_max[warp][4 * cg + w] = c[w];
    }
    __syncthreads();
    constexpr bool kTileScale = kBlocks == Fp8Blocks::kColumnTiles128;
    if (threadIdx.x < kColGroups * 4) {  // two columns each: 2t and 2t + 1 (warps 0 and 1)
      uint32_t m = sm.partial_max[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = max_halves(m, sm.partial_max[w][threadIdx.x]);
      if constexpr (kTileScale) {
        m = max_of_halves(m);
#pragma unroll
        for (int off = 1; off < 32; off *= 2) m = max(m, __shfl_xor_sync(~0u, m, off));
        if (lane == 0) sm.tile_max[warp] = m;
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = 2 * threadIdx.x + h;
          const Fp8BlockScale s = fp8_block_scale_bf16(h ? m >> 16 : m & 0xFFFFu);
          sm.column_r[col] = s.nonfinite ? __uint_as_float(kFp8ScaleNanBits) : s.r;
          scales[(col0 + col) * a.s_0 + ti * a.s_1] = s.scale;
        }
      }
    }
    if constexpr (kTileScale) {
      __syncthreads();
      if (threadIdx.x < kColGroups * 4) {
        const Fp8BlockScale s = fp8_block_scale_bf16(max(sm.tile_max[0], sm.tile_max[1]));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = 2 * threadIdx.x + h;
          sm.column_r[col] = s.nonfinite ? __uint_as_float(kFp8ScaleNanBits) : s.r;
          scales[(col0 + col) * a.s_0 + ti * a.s_1] = s.scale;
        }
      }
    }
    __syncthreads();
    float r[8];
    uint32_t nan_lo = 0, nan_hi = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      r[j] = sm.column_r[8 * cg + j];
      const uint32_t byte = isnan(r[j]) ? 0xFFu << (8 * (j % 4)) : 0u;
      (j < 4 ? nan_lo : nan_hi) |= byte;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      qlo[i] = mask_nan(fp8_quad(v[i].x, v[i].y, r[0], r[1], r[2], r[3]), nan_lo);
      qhi[i] = mask_nan(fp8_quad(v[i].z, v[i].w, r[4], r[5], r[6], r[7]), nan_hi);
    }
  }

  constexpr bool kTransposedOnly =
      kBlocks == Fp8Blocks::kColumns128 || kBlocks == Fp8Blocks::kColumnTiles128;
  if (!kTransposedOnly && a.q != nullptr) {
    uint8_t* qb = a.q + t.b * a.q_batch + col0 + 8 * cg;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const uint2 q = make_uint2(qlo[i], qhi[i]);
      const int64_t row = row0 + kRowsPerThread * rg + i;
      if constexpr (kToRows) {
        // The half-warp writes the row to each destination in turn, entry j from lane j.
        // (Uniform loops: every lane shuffles, rows past a.rows have no destinations.)
        for (int64_t j0 = 0; j0 < dests.per_row; j0 += kColGroups) {
          const int32_t mine = j0 == 0 ? d[i] : dest_entry(dests, a.rows, row, j0 + cg);
          const int n = static_cast<int>(min(int64_t(kColGroups), dests.per_row - j0));
          for (int j = 0; j < n; ++j) {
            const int32_t dest = __shfl_sync(~0u, mine, row_lane(j));
            if (dest >= 0) *reinterpret_cast<uint2*>(qb + dest * a.q_row) = q;
          }
        }
      } else if (row < a.rows) {
        *reinterpret_cast<uint2*>(qb + row * a.q_row) = q;
      }
    }
  }

  if (kBlocks != Fp8Blocks::kRows1x128 && a.q_t != nullptr) {
    // Column j of this thread's block: rows 0-3 in .x, rows 4-7 in .y.
    uint32_t c03_r03[4], c03_r47[4], c47_r03[4], c47_r47[4];
    transpose4x4(qlo[0], qlo[1], qlo[2], qlo[3], c03_r03);
    transpose4x4(qlo[4], qlo[5], qlo[6], qlo[7], c03_r47);
    transpose4x4(qhi[0], qhi[1], qhi[2], qhi[3], c47_r03);
    transpose4x4(qhi[4], qhi[5], qhi[6], qhi[7], c47_r47);
    // Staged row c (a column of the tile) holds 16 chunks of 8 rows; chunk rg sits at rg ^ cg.
    uint8_t* chunk = sm.staged + 8 * cg * kTile + 8 * (rg ^ cg);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint2*>(chunk + j * kTile) = make_uint2(c03_r03[j], c03_r47[j]);
      *reinterpret_cast<uint2*>(chunk + (j + 4) * kTile) = make_uint2(c47_r03[j], c47_r47[j]);
    }
    __syncthreads();
    uint8_t* tb = a.q_t + t.b * a.t_batch + col0 * a.t_row + row0;
#pragma unroll
    for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
      const int idx = threadIdx.x + k * kThreads;
      const int c = idx / 8, m = idx % 8, key = c / 8;
      uint4 val = *reinterpret_cast<const uint4*>(sm.staged + c * kTile + 16 * (m ^ (key >> 1)));
      if (key & 1) val = make_uint4(val.z, val.w, val.x, val.y);
      *reinterpret_cast<uint4*>(tb + c * a.t_row + 16 * m) = val;
    }
  }
}

// A CTA of the kernels that loop (kToRows, kGathered) quantizes tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... (a persistent grid of a few CTAs per SM): each tile's loads
// are issued before the previous tile is quantized and stored (once the previous tile's
// values have been read, into each thread's own slots of shared memory by cp.async),
// so that a CTA has a tile's 32 KB in flight while it works (one tile per CTA left the
// loads of a CTA idle through its reductions, barriers and stores), and with the gathered
// rows the index loads that the addresses wait for (the expert search, row_token, row_slot
// -> slot_weights) are a tile further ahead still. kToRows: tiles go to CTAs in the order
// of one CTA per tile, so
// the CTAs at work at one time read neighbouring tiles. kGathered: the tile's rows are
// padded rows of a routing plan over the token matrix x (`dests` is then an
// Fp8PaddedSource), read as gather_rows_padded would write them, and the tiles go column
// stripe by column stripe (gathered_pos): every token is gathered into top-k experts' rows,
// and the CTAs at work at one time read one or two 128-column stripes of x (4 MB at 16384
// tokens of bf16), which stay in L2 across those k reads, where row-tile order reads whole
// token rows that L2 has evicted by the token's next expert.
template <Fp8Blocks kBlocks, bool kToRows = false, bool kGathered = false>
__global__ void __launch_bounds__(kThreads, 3)
    quantize_fp8_kernel(Fp8QuantizeArgs a, int64_t row_tiles, int64_t col_tiles,
                        std::conditional_t<kGathered, Fp8PaddedSource, Fp8RowDests> dests) {
  static_assert(!kToRows || kBlocks == Fp8Blocks::kRows1x128);
  static_assert(!kGathered || ((kBlocks == Fp8Blocks::kColumns128 ||
                                 kBlocks == Fp8Blocks::kColumnTiles128) && !kToRows));
  __shared__ TileSmem sm;
  const int32_t no_dests[kRowsPerThread] = {};  // (for the kernels without destinations)

  if constexpr (kGathered) {
    const Fp8PaddedSource& p = dests;
    // Row tiles from tile_offsets[E] on have no rows of the plan and are not written.
    const int64_t used = min(row_tiles, int64_t(max(__ldg(&p.tile_offsets[p.num_experts]), 0)));
    const int64_t tiles = used * col_tiles, stride = gridDim.x;
    int64_t tile = blockIdx.x;
    if (tile >= tiles) return;
    // Each thread's next-tile values wait in its own slots of `stage` (dynamic shared
    // memory, kStageBytes), written by its cp.async and read by it alone: no barrier.
    extern __shared__ __align__(128) uint4 stage[];
    GatherRow g = gather_row(p, a.rows, tile % used), g1;
    load_gathered_async(a, gathered_pos(tile, used), g, stage);
    float w = slot_weight(p, g);
    if (tile + stride < tiles) g1 = gather_row(p, a.rows, (tile + stride) % used);
    for (;;) {
      const int64_t next = tile + stride, after = next + stride;
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      uint4 v[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) v[i] = stage[i * kThreads + threadIdx.x];
      const float w1 = next < tiles ? slot_weight(p, g1) : 0.0f;
      GatherRow g2;
      if (after < tiles) g2 = gather_row(p, a.rows, after % used);
      scale_gathered(p, g, w, v);
      // The next tile's loads go out once v has been read (its slots are then free).
      const auto load_next = [&] {
        if (next < tiles) load_gathered_async(a, gathered_pos(next, used), g1, stage);
      };
      quantize_tile<kBlocks, false>(a, gathered_pos(tile, used), v, {}, no_dests, sm, load_next);
      if (next >= tiles) break;
      g = g1;
      w = w1;
      g1 = g2;
      tile = next;
    }
  } else if constexpr (kToRows) {
    const uint32_t tiles = static_cast<uint32_t>(a.batches * row_tiles * col_tiles);
    const auto pos_of = [&](uint32_t tile) { return tile_pos32(tile, row_tiles, col_tiles); };
    uint32_t tile = blockIdx.x;
    if (tile >= tiles) return;
    // As the gathered kernel: each thread's next-tile values in its own slots, no barrier.
    extern __shared__ __align__(128) uint4 stage[];
    TilePos pos = pos_of(tile);
    int32_t d[kRowsPerThread];
    load_rows_async(a, pos, stage);
    load_dests(dests, a.rows, pos, d);
    for (;;) {
      const uint32_t next = tile + gridDim.x;
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      uint4 v[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) v[i] = stage[i * kThreads + threadIdx.x];
      const TilePos npos = pos_of(next);
      int32_t dn[kRowsPerThread];
      if (next < tiles) {
        load_rows_async(a, npos, stage);
        load_dests(dests, a.rows, npos, dn);
      }
      quantize_tile<kBlocks, true>(a, pos, v, dests, d, sm);
      if (next >= tiles) break;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) d[i] = dn[i];
      tile = next;
      pos = npos;
    }
  } else {
    // One tile per CTA.
    const TilePos pos = tile_pos(blockIdx.x, row_tiles, col_tiles);
    uint4 v[kRowsPerThread];
    load_rows(a, pos, v);
    quantize_tile<kBlocks, false>(a, pos, v, {}, no_dests, sm);
  }
}

// quantize_fp8_to_rows with dests.sources: scales[j * s_1 + d] = row_scales[sources[d]]'s
// block j, one destination row a thread, so that a warp's stores of each block are
// contiguous. kQuads: a row's blocks read 16 bytes at a time, 8 loads in flight (blocks a
// multiple of 4; the scratch is 16-byte aligned).
template <bool kQuads>
__global__ void __launch_bounds__(256)
    scatter_row_scales_kernel(const float* __restrict__ row_scales, int64_t blocks,
                              const int32_t* __restrict__ sources, int64_t dest_rows,
                              float* __restrict__ scales, int64_t s_1) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; d < dest_rows; d += stride) {
    const int32_t src = __ldg(&sources[d]);
    if (src < 0) continue;
    const float* from = row_scales + int64_t(src) * blocks;
    if constexpr (kQuads) {
      constexpr int kBatch = 8;
      for (int64_t j0 = 0; j0 < blocks; j0 += 4 * kBatch) {
        float4 v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (j0 + 4 * b < blocks) v[b] = __ldg(reinterpret_cast<const float4*>(from + j0) + b);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (j0 + 4 * b >= blocks) break;
          float* to = scales + (j0 + 4 * b) * s_1 + d;
          to[0] = v[b].x;
          to[s_1] = v[b].y;
          to[2 * s_1] = v[b].z;
          to[3 * s_1] = v[b].w;
        }
      }
    } else {
#pragma unroll 4
      for (int64_t j = 0; j < blocks; ++j) scales[j * s_1 + d] = __ldg(&from[j]);
    }
  }
}

// quantize_fp8_rows_and_columns: each tile of x loaded once (the next tile staged as in the
// looping kernels above, its loads issued once the column maxima are taken, as the gathered
// kernel does) and quantized twice from the same registers, 128-row columns into `cols`
// and 1x128 into `rows`. Each half is quantize_fp8's code for its blocks on the same
// values, so each output has its kernel's bits. The rows need no shared memory, so the
// columns' reuse of it from tile to tile stays as quantize_tile describes. (Columns first:
// in the other order the 80 registers of 3 CTAs per SM spill.)
__global__ void __launch_bounds__(kThreads, 3)
    quantize_fp8_rows_and_columns_kernel(Fp8QuantizeArgs rows, Fp8QuantizeArgs cols,
                                         int64_t row_tiles, int64_t col_tiles) {
  __shared__ TileSmem sm;
  extern __shared__ __align__(128) uint4 stage[];
  const int32_t no_dests[kRowsPerThread] = {};
  const uint32_t tiles = static_cast<uint32_t>(rows.batches * row_tiles * col_tiles);
  uint32_t tile = blockIdx.x;
  if (tile >= tiles) return;
  TilePos pos = tile_pos32(tile, row_tiles, col_tiles);
  load_rows_async(rows, pos, stage);
  for (;;) {
    const uint32_t next = tile + gridDim.x;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    uint4 v[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) v[i] = stage[i * kThreads + threadIdx.x];
    const TilePos npos = tile_pos32(next, row_tiles, col_tiles);
    const auto load_next = [&] {
      if (next < tiles) load_rows_async(rows, npos, stage);
    };
    quantize_tile<Fp8Blocks::kColumns128, false>(cols, pos, v, {}, no_dests, sm, load_next);
    quantize_tile<Fp8Blocks::kRows1x128, false>(rows, pos, v, {}, no_dests, sm);
    if (next >= tiles) break;
    tile = next;
    pos = npos;
  }
}

// copy_fp8_to_rows: one warp per row. Lane j < per_row holds the row's destination j; the
// loops over a row's pieces run alike in every lane (bounds checked per piece), so that the
// shuffles of the destinations see the whole warp.
constexpr int kCopyBatch = 4;  // 16-byte loads a lane has in flight before it stores

__global__ void __launch_bounds__(kThreads)
    copy_fp8_to_rows_kernel(const Fp8RowsCopyArgs a, const Fp8RowDests dests) {
  const int lane = threadIdx.x % 32;
  const int64_t pieces = a.cols / 16, blocks = a.cols / kTile;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; row < a.rows;
       row += warps) {
    const int32_t dest = lane < dests.per_row ? __ldg(&dests.rows[row * dests.per_row + lane]) : -1;
    const unsigned to = __ballot_sync(0xffffffffu, dest >= 0);
    if (to == 0) continue;  // a row nobody needs is not read
    const uint4* src = reinterpret_cast<const uint4*>(a.q + row * a.cols);
    for (int64_t base = 0; base < pieces; base += 32 * kCopyBatch) {
      uint4 v[kCopyBatch];
#pragma unroll
      for (int b = 0; b < kCopyBatch; ++b) {
        const int64_t i = base + 32 * b + lane;
        if (i < pieces) v[b] = __ldg(src + i);
      }
      for (unsigned m = to; m != 0; m &= m - 1) {
        const int32_t r = __shfl_sync(0xffffffffu, dest, __ffs(m) - 1);
        uint4* dst = reinterpret_cast<uint4*>(a.out_q + int64_t(r) * a.cols);
#pragma unroll
        for (int b = 0; b < kCopyBatch; ++b) {
          const int64_t i = base + 32 * b + lane;
          if (i < pieces) dst[i] = v[b];
        }
      }
    }
    for (int64_t base = 0; base < blocks; base += 32) {
      const int64_t j = base + lane;
      const float s = j < blocks ? __ldg(&a.scales[j * a.scale_ld + row]) : 0.0f;
      for (unsigned m = to; m != 0; m &= m - 1) {
        const int32_t r = __shfl_sync(0xffffffffu, dest, __ffs(m) - 1);
        if (j < blocks) a.out_scales[j * a.out_scale_ld + r] = s;
      }
    }
  }
}

[[maybe_unused]] const bool kPreloadable =
    register_kernel_module(&quantize_fp8_kernel<Fp8Blocks::kRows1x128>);

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

[[noreturn]] void fail(const std::string& what) { throw_invalid("quantize_fp8: " + what); }

// `who` names the argument set in the messages of a call that takes two ("rows: ").
void check_sizes(Fp8Blocks blocks, const Fp8QuantizeArgs& a, const std::string& who) {
  if (a.cols <= 0 || a.cols % kTile) fail(who + "cols must be a positive multiple of 128");
  if (a.rows < 0 || a.batches < 0) fail(who + "negative rows or batches");
  if (blocks == Fp8Blocks::kTiles128 && a.rows % kTile) {
    fail(who + "rows must be a multiple of 128");
  }
}

// Pointers and strides of a call with work to do (frameworks hand out NULL for empty tensors).
void check_pointers(Fp8Blocks blocks, const Fp8QuantizeArgs& a, bool to_rows,
                    const std::string& who) {
  const bool direct = a.q != nullptr, transposed = a.q_t != nullptr;
  if (blocks == Fp8Blocks::kRows1x128 && (!direct || transposed)) {
    fail(who + "needs q and no q_t");
  }
  if ((blocks == Fp8Blocks::kColumns128 || blocks == Fp8Blocks::kColumnTiles128) &&
      (direct || !transposed)) {
    fail(who + "needs q_t and no q");
  }
  if (blocks == Fp8Blocks::kTiles128 && !direct && !transposed) fail(who + "needs q or q_t");
  if (!a.x || !a.scales) fail(who + "null pointer");
  if (!aligned16(a.x) || (direct && !aligned16(a.q)) || (transposed && !aligned16(a.q_t))) {
    fail(who + "x, q and q_t must be 16-byte aligned");
  }
  // Strides of dimensions of size 1 are never used (rows past the first one, batches past
  // the first one), so only the others must keep the 16-byte vectors aligned (q's rows are
  // used whenever rows have destinations, even for a one-row x).
  const bool rows = a.rows > 1, batches = a.batches > 1;
  const bool q_rows = rows || to_rows;
  if ((rows && a.x_row % 8) || (batches && a.x_batch % 8) ||
      (direct && ((q_rows && a.q_row % 16) || (batches && a.q_batch % 16))) ||
      (transposed && (a.t_row % 16 || (batches && a.t_batch % 16)))) {
    fail(who + "row and batch strides must be multiples of 16 bytes");
  }
}

int64_t row_tiles_of(const Fp8QuantizeArgs& a) { return (a.rows + kTile - 1) / kTile; }

// The grid of a call with work to do; 0 for none. Checks the arguments.
unsigned checked_grid(Fp8Blocks blocks, const Fp8QuantizeArgs& a, bool to_rows,
                      const std::string& who = "") {
  check_sizes(blocks, a, who);
  if (a.batches == 0 || a.rows == 0) return 0;
  check_pointers(blocks, a, to_rows, who);
  const int64_t tiles = a.batches * row_tiles_of(a) * (a.cols / kTile);
  if (tiles > INT_MAX) {
    throw_invalid("quantize_fp8: " + who + std::to_string(tiles) +
                  " tiles of 128 x 128, more than one launch can hold");
  }
  return static_cast<unsigned>(tiles);
}

// The grid of a kernel that loops over its `tiles` (launched with kStageBytes of dynamic
// shared memory): as many CTAs as fit on the SMs at once (sm_count(): the device's, or an
// SmLimit's), or one per tile when there are fewer. Static and dynamic shared memory can
// pass 48 KB, so the kernel is opted in on every call (the attribute is per device).
template <auto kKernel>
unsigned persistent_grid(unsigned tiles) {
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kStageBytes));
  static const int per_sm = [] {
    int n = 0;
    MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kThreads,
                                                                     kStageBytes));
    return n > 0 ? n : 1;
  }();
  return static_cast<unsigned>(std::min<int64_t>(tiles, int64_t(per_sm) * sm_count()));
}

}  // namespace

void quantize_fp8(Fp8Blocks blocks, const Fp8QuantizeArgs& a, cudaStream_t stream) {
  const unsigned grid = checked_grid(blocks, a, false);
  if (grid == 0) return;
  const int64_t row_tiles = row_tiles_of(a), col_tiles = a.cols / kTile;
  switch (blocks) {
    case Fp8Blocks::kRows1x128:
      quantize_fp8_kernel<Fp8Blocks::kRows1x128><<<grid, kThreads, 0, stream>>>(a, row_tiles, col_tiles, {});
      break;
    case Fp8Blocks::kTiles128:
      quantize_fp8_kernel<Fp8Blocks::kTiles128><<<grid, kThreads, 0, stream>>>(a, row_tiles, col_tiles, {});
      break;
    case Fp8Blocks::kColumns128:
      quantize_fp8_kernel<Fp8Blocks::kColumns128><<<grid, kThreads, 0, stream>>>(a, row_tiles, col_tiles, {});
      break;
    case Fp8Blocks::kColumnTiles128:
      quantize_fp8_kernel<Fp8Blocks::kColumnTiles128><<<grid, kThreads, 0, stream>>>(a, row_tiles, col_tiles, {});
      break;
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void quantize_fp8_columns_gathered(const Fp8QuantizeArgs& a, const Fp8PaddedSource& src,
                                   cudaStream_t stream, Fp8Blocks blocks) {
  if (blocks != Fp8Blocks::kColumns128 && blocks != Fp8Blocks::kColumnTiles128) {
    fail("a gathered column quantization takes kColumns128 or kColumnTiles128 blocks");
  }
  if (a.batches != 1) fail("a gathered column quantization takes one matrix (batches = 1)");
  if (src.num_experts < 1 || src.num_experts > INT_MAX) {
    fail("src.num_experts must be in [1, 2^31)");
  }
  const unsigned grid = checked_grid(blocks, a, false);
  if (grid == 0) return;
  // x's rows are tokens, any of which a padded row may name: its stride is always used.
  if (a.x_row % 8) fail("row and batch strides must be multiples of 16 bytes");
  if (!src.expert_offsets || !src.tile_offsets || !src.row_token ||
      (src.slot_weights && !src.row_slot)) {
    fail("null routing plan pointer in src");
  }
  const auto launch = [&](auto tile_scales) {
    constexpr auto kernel =
        &quantize_fp8_kernel<decltype(tile_scales)::value ? Fp8Blocks::kColumnTiles128
                                                          : Fp8Blocks::kColumns128,
                             false, true>;
    kernel<<<persistent_grid<kernel>(grid), kThreads, kStageBytes, stream>>>(
        a, row_tiles_of(a), a.cols / kTile, src);
  };
  if (blocks == Fp8Blocks::kColumnTiles128) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void quantize_fp8_to_rows(const Fp8QuantizeArgs& a, const Fp8RowDests& dests,
                          cudaStream_t stream) {
  if (dests.per_row < 1) fail("dests.per_row must be at least 1");
  const bool by_source = dests.row_scales != nullptr || dests.sources != nullptr;
  if (by_source) {
    if (!dests.row_scales || !dests.sources) {
      fail("dests.sources and dests.row_scales go together");
    }
    if (a.s_0 != 1 || a.batches > 1) {
      fail("dests.sources needs scales [block][row] (s_0 = 1) and one batch");
    }
    if (dests.dest_rows < 0) fail("negative dests.dest_rows");
    if (a.cols > kTile && dests.dest_rows > a.s_1) {
      fail("dests.dest_rows must be at most s_1, the scales' stride between blocks");
    }
    if (!aligned16(dests.row_scales)) fail("dests.row_scales must be 16-byte aligned");
  }
  const unsigned grid = checked_grid(Fp8Blocks::kRows1x128, a, true);
  if (grid == 0) return;
  if (dests.rows == nullptr) fail("null dests.rows");
  constexpr auto kernel = &quantize_fp8_kernel<Fp8Blocks::kRows1x128, true>;
  kernel<<<persistent_grid<kernel>(grid), kThreads, kStageBytes, stream>>>(
      a, row_tiles_of(a), a.cols / kTile, dests);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  if (by_source && dests.dest_rows > 0) {
    constexpr int kScatterThreads = 256;
    const int64_t blocks = std::min<int64_t>(
        (dests.dest_rows + kScatterThreads - 1) / kScatterThreads, 8 * int64_t(sm_count()));
    const auto kernel = (a.cols / kTile) % 4 == 0 ? &scatter_row_scales_kernel<true>
                                                   : &scatter_row_scales_kernel<false>;
    kernel<<<static_cast<unsigned>(blocks), kScatterThreads, 0, stream>>>(
        dests.row_scales, a.cols / kTile, dests.sources, dests.dest_rows, a.scales, a.s_1);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void copy_fp8_to_rows(const Fp8RowsCopyArgs& a, const Fp8RowDests& dests,
                      cudaStream_t stream) {
  if (a.cols <= 0 || a.cols % kTile) fail("copy: cols must be a positive multiple of 128");
  if (a.rows < 0) fail("copy: negative rows");
  if (dests.per_row < 1 || dests.per_row > 32) fail("copy: dests.per_row must be in [1, 32]");
  if (a.rows == 0) return;
  if (!a.q || !a.scales || !a.out_q || !a.out_scales || !dests.rows) fail("copy: null pointer");
  if (!aligned16(a.q) || !aligned16(a.out_q)) fail("copy: q and out_q must be 16-byte aligned");
  if (a.scale_ld < a.rows) fail("copy: scale_ld must be at least rows");
  const int64_t blocks = std::min<int64_t>((a.rows + kWarps - 1) / kWarps, 4 * int64_t(sm_count()));
  copy_fp8_to_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, dests);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void quantize_fp8_rows_and_columns(const Fp8QuantizeArgs& rows, const Fp8QuantizeArgs& columns,
                                   cudaStream_t stream) {
  // The sizes first, so that a call with no work is checked as far as quantize_fp8 would.
  check_sizes(Fp8Blocks::kRows1x128, rows, "rows: ");
  check_sizes(Fp8Blocks::kColumns128, columns, "columns: ");
  if (rows.x != columns.x || rows.x_row != columns.x_row || rows.x_batch != columns.x_batch ||
      rows.batches != columns.batches || rows.rows != columns.rows ||
      rows.cols != columns.cols) {
    fail("rows and columns must quantize the same x (x, x_row, x_batch, batches, rows and "
         "cols equal)");
  }
  const unsigned grid = checked_grid(Fp8Blocks::kRows1x128, rows, false, "rows: ");
  checked_grid(Fp8Blocks::kColumns128, columns, false, "columns: ");  // the same tiles
  if (grid == 0) return;
  constexpr auto kernel = &quantize_fp8_rows_and_columns_kernel;
  kernel<<<persistent_grid<kernel>(grid), kThreads, kStageBytes, stream>>>(
      rows, columns, row_tiles_of(rows), rows.cols / kTile);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe
