// Grouped GEMM over ragged expert groups, persistent and warp-specialized (sm_90a).
//
//   C[r, n] = sum_k A[r, k] * B_e[n, k]      for the rows r of expert e
//
// A: [rows, K] bf16, rows sorted by expert (expert_offsets), K-major: read by TMA, or
// gathered from a token matrix by cp.async (kGatherA). B: per expert either [n, K]
// (K-major, rows e * b_rows_per_expert..) or [K, n] (N-major, kBMajorN), read by TMA. Both
// land in a ring of 128-byte-swizzled shared-memory stages. Warpgroup 0 is the producer,
// warpgroups 1 and 2 each own 64 rows of the 128-row tile and run wgmma m64nNk16 (N = 128
// or 256) into fp32 registers. Tiles are (expert M-tile, N-tile) pairs enumerated from
// tile_offsets, handed out round-robin over a persistent grid; producer and consumers walk
// the same sequence.
//
// Epilogues (template):
//   kSwiGLU: B tile rows [0, N/2) are gate rows n0.., rows [N/2, N) the up rows I+n0..;
//            C[r, n0 + c] = silu(gate) * up for c < N/2 (output width I); optionally also
//            h = [gate | up] (h_out, the backward's saved mode).
//   kStore:  C[r, n0 + c] = acc for c < N.
//   kSwiGLUBackward: acc = z (dgrad of L2); writes dh and dp partials (see below).
// Full 64-row slabs leave through shared memory and TMA stores; partial ones through
// masked register stores.
#pragma once

#include <cuda_bf16.h>

#include "kernels/sm90/primitives.cuh"

namespace megamoe::sm90 {

enum class Epilogue { kStore, kSwiGLU, kSwiGLUBackward };

struct GroupedGemmParams {
  const int32_t* expert_offsets;  // [E+1] first row of each expert; [E] = rows in all
  const int32_t* tile_offsets;    // [E+1] first M-tile of each expert; [E] = all M-tiles
  int32_t num_experts;
  int32_t k;                      // reduction length (multiple of 64)
  int32_t b_rows_per_expert;      // rows of B per expert (2I for L1, H for L2)
  int32_t n_tiles;                // output tiles along N
  int32_t half_n;                 // kSwiGLU: I, offset of the up rows within an expert
  __nv_bfloat16* c;               // [rows, ldc]
  int64_t ldc;
  // Gathered A (kGatherA): row r of the sorted order is row a_row_index[r] of a_source.
  const __nv_bfloat16* a_source;  // [tokens, k] row-major
  const int32_t* a_row_index;     // [rows]
  // N-major B (kBMajorN): B_e is [k, n] with n contiguous, rows e*k.. of the tensor map;
  // descriptor strides of its shared-memory tile (see smem_desc_mn_major_sw128).
  uint32_t b_lbo, b_sbo;
  // kSwiGLUBackward (dgrad of L2): the accumulator is z = w_down_e^T dy for the row's slot.
  const __nv_bfloat16* h;         // [rows, 2I] recomputed L1 output [gate | up]
  __nv_bfloat16* dh;              // [rows, 2I] out: [dgate | dup]
  const float* slot_weights;      // [T*k] router weights p, indexed by slot
  const int32_t* row_slot;        // [rows] slot of each sorted row
  float* dp_partial;              // [rows, n_tiles] out: sum over the tile's columns of z*a
  __nv_bfloat16* a_out;           // [rows, I] out (optional): a = silu(g) u, for dW_down
  // Padded row layout (the backward's weight-gradient operands): expert e's rows start at
  // tile_offsets[e] * 128, pad rows up to the next 128 are zeros. a_padded: a materialised
  // A is laid out so; c_padded: the outputs (C, dh, a_out) are, pad rows written as zeros
  // by the kSwiGLUBackward epilogue.
  int32_t a_padded, c_padded;
  // kWgrad: C[e * wgrad_m + m, n] = sum over expert e's padded rows r of A[r, m] B[r, n],
  // A M-major [padded rows, wgrad_m], B N-major [padded rows, n]. With c_f32 set the
  // tile is added into that fp32 matrix instead of stored as bf16 into c.
  int32_t wgrad_m;
  float* c_f32;
  // kSwiGLU (optional): the L1 output before the activation, [rows, 2I] = [gate | up].
  __nv_bfloat16* h_out;
};

constexpr int kBlockM = 128;
constexpr int kBlockK = 64;
constexpr int kThreads = 384;
constexpr int kTileBytesA = kBlockM * kBlockK * 2;
constexpr int kSharedBudget = 224 * 1024;  // of the 227 KB a block may have
constexpr int kStoreBoxCols = 64;          // TMA store boxes: 64 rows x 64 bf16 (128 B)
constexpr int kStoreBoxBytes = 64 * kStoreBoxCols * 2;

// A tile of 128 rows x kBlockN columns of accumulators (kSwiGLU: kBlockN/2 gate + kBlockN/2
// up, kBlockN/2 output columns).
template <Epilogue kEpilogue, int kBlockN>
struct TileConfig {
  static_assert(kBlockN == 128 || kBlockN == 256);
  static constexpr int kTileBytesB = kBlockN * kBlockK * 2;
  static constexpr int kOutCols = kEpilogue == Epilogue::kSwiGLU ? kBlockN / 2 : kBlockN;
  // Each consumer warpgroup stages its 64 output rows for the TMA store.
  static constexpr int kStagingBytes = 64 * kOutCols * 2;
  // kSwiGLUBackward (256 wide): one 64-column quarter of the slab's h = [gate | up] comes in
  // by TMA, the gate box into the staging buffer's free last quarter (its outputs fill three
  // 64 x 64 boxes), the up box here.
  static constexpr bool kHByTma = kEpilogue == Epilogue::kSwiGLUBackward && kBlockN == 256;
  static constexpr int kHUpBytes = kHByTma ? kStoreBoxBytes : 0;
  static constexpr int kStages =
      (kSharedBudget - 2 * kStagingBytes - 2 * kHUpBytes) / (kTileBytesA + kTileBytesB);
  static constexpr int kAccumulators = kBlockN / 2;  // per consumer thread (m64nNk16)
};

template <Epilogue kEpilogue, int kBlockN>
struct alignas(1024) GemmSharedStorage {
  using Config = TileConfig<kEpilogue, kBlockN>;
  __nv_bfloat16 a[Config::kStages][kBlockM * kBlockK];
  __nv_bfloat16 b[Config::kStages][kBlockN * kBlockK];
  uint8_t staging[2][Config::kStagingBytes];
  uint8_t h_up[2][Config::kHByTma ? Config::kHUpBytes : 16];
  uint64_t full[Config::kStages];
  uint64_t empty[Config::kStages];
  uint64_t h_full[2];  // kHByTma: a quarter of h has landed (per consumer warpgroup)
};

// The tile's expert, first (unpadded) row, number of valid rows and N-tile index; the
// first row of a materialised A and of the outputs (padded or not); for kWgrad, the M
// offset and the expert's padded K rows.
struct TileCoords {
  int expert, row0, rows, n_tile;
  int a_row0, out_row0;
  int m0, k_row0, k_blocks;
};

__device__ __forceinline__ TileCoords locate_tile(const GroupedGemmParams& p, int tile) {
  const int m_tile = tile / p.n_tiles;
  TileCoords t;
  t.n_tile = tile % p.n_tiles;
  // Last expert whose first M-tile is <= m_tile (experts with no tiles are skipped).
  int lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(&p.tile_offsets[mid]) <= m_tile) lo = mid; else hi = mid - 1;
  }
  t.expert = lo;
  t.row0 = __ldg(&p.expert_offsets[lo]) + (m_tile - __ldg(&p.tile_offsets[lo])) * kBlockM;
  t.rows = min(kBlockM, __ldg(&p.expert_offsets[lo + 1]) - t.row0);
  t.a_row0 = p.a_padded ? m_tile * kBlockM : t.row0;
  t.out_row0 = p.c_padded ? m_tile * kBlockM : t.row0;
  t.m0 = 0;
  t.k_row0 = 0;
  t.k_blocks = p.k / kBlockK;
  return t;
}

// kWgrad tiles: (expert, M-tile of the weight, N-tile); K runs over the expert's padded rows.
__device__ __forceinline__ TileCoords locate_wgrad_tile(const GroupedGemmParams& p, int tile) {
  const int m_tiles = p.wgrad_m / kBlockM;
  TileCoords t;
  t.expert = tile / (m_tiles * p.n_tiles);
  const int rest = tile % (m_tiles * p.n_tiles);
  t.m0 = (rest / p.n_tiles) * kBlockM;
  t.n_tile = rest % p.n_tiles;
  t.row0 = t.a_row0 = 0;
  t.out_row0 = t.expert * p.wgrad_m + t.m0;
  t.rows = kBlockM;
  const int first = __ldg(&p.tile_offsets[t.expert]);
  t.k_row0 = first * kBlockM;
  t.k_blocks = (__ldg(&p.tile_offsets[t.expert + 1]) - first) * (kBlockM / kBlockK);
  return t;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// Accumulator fragment of m64nNk16: thread (warp w, lane l) holds rows 16w + l/4 (+8) and
// columns 8q + 2(l%4) (+1) in acc[4q + {0,1}] (row) and acc[4q + {2,3}] (row + 8).
// `emit(r, c, v0, v1)` receives the output values of row r (0..63 of the warpgroup's slab)
// and columns c, c + 1.
template <Epilogue kEpilogue, int kBlockN, class Emit>
__device__ __forceinline__ void for_each_output(const float (&acc)[kBlockN / 2], Emit&& emit) {
  const int thread = threadIdx.x % 128;
  const int row = (thread / 32) * 16 + (thread % 32) / 4;
  const int col = (thread % 4) * 2;
  constexpr int kOutCols = TileConfig<kEpilogue, kBlockN>::kOutCols;
  constexpr int kUpChunk = kBlockN / 2 / 8;  // first 8-column chunk of the up half
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < kOutCols / 8; ++q) {
      float v0 = acc[q * 4 + half * 2], v1 = acc[q * 4 + half * 2 + 1];
      if constexpr (kEpilogue == Epilogue::kSwiGLU) {
        v0 = silu(v0) * acc[(q + kUpChunk) * 4 + half * 2];
        v1 = silu(v1) * acc[(q + kUpChunk) * 4 + half * 2 + 1];
      }
      emit(row + half * 8, q * 8 + col, v0, v1);
    }
  }
}

// A slab with rows past the expert's end: plain masked stores from registers.
template <Epilogue kEpilogue, int kBlockN>
__device__ __forceinline__ void store_slab_direct(const GroupedGemmParams& p, const TileCoords& t,
                                                  const float (&acc)[kBlockN / 2], int warpgroup) {
  constexpr int kOutCols = TileConfig<kEpilogue, kBlockN>::kOutCols;
  const int slab = warpgroup * 64;
  __nv_bfloat16* base = p.c + int64_t(t.out_row0 + slab) * p.ldc + t.n_tile * kOutCols;
  for_each_output<kEpilogue, kBlockN>(acc, [&](int r, int c, float v0, float v1) {
    if (slab + r < t.rows) {
      *reinterpret_cast<__nv_bfloat162*>(base + int64_t(r) * p.ldc + c) =
          __floats2bfloat162_rn(v0, v1);
    }
  });
}

// A full slab: registers -> shared memory (the 128-byte swizzled layout of the store boxes,
// conflict-free for this fragment) -> TMA store, which drains while the warpgroup goes on
// to the next tile's MMAs. Thread 0 of the warpgroup owns the bulk stores.
template <Epilogue kEpilogue, int kBlockN>
__device__ __forceinline__ void store_slab_tma(const CUtensorMap& map_c, const TileCoords& t,
                                               const float (&acc)[kBlockN / 2], int warpgroup,
                                               uint8_t* staging) {
  constexpr int kOutCols = TileConfig<kEpilogue, kBlockN>::kOutCols;
  const bool leader = threadIdx.x % 128 == 0;
  if (leader) bulk_wait_group_read_all();  // the previous tile's stores have left staging
  named_barrier_sync(1 + warpgroup, 128);
  for_each_output<kEpilogue, kBlockN>(acc, [&](int r, int c, float v0, float v1) {
    const int box = c / kStoreBoxCols, cc = c % kStoreBoxCols;
    uint8_t* at =
        staging + box * kStoreBoxBytes + r * 128 + (((cc / 8) ^ (r % 8)) * 16) + (cc % 8) * 2;
    *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(v0, v1);
  });
  fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
  named_barrier_sync(1 + warpgroup, 128);
  if (leader) {
#pragma unroll
    for (int box = 0; box < kOutCols / kStoreBoxCols; ++box) {
      tma_store_2d(&map_c, staging + box * kStoreBoxBytes,
                   t.n_tile * kOutCols + box * kStoreBoxCols, t.out_row0 + warpgroup * 64);
    }
    bulk_commit_group();
  }
}

// kSwiGLU's saved mode: the slab's raw gate and up accumulators into h = [gate | up]
// (a partial slab: masked register stores).
template <int kBlockN>
__device__ __forceinline__ void store_slab_h(const GroupedGemmParams& p, const TileCoords& t,
                                             const float (&acc)[kBlockN / 2], int warpgroup) {
  const int slab = warpgroup * 64;
  const int64_t ld = 2 * int64_t(p.half_n);
  // Raw accumulators: read the fragment as a plain kStore tile of kBlockN columns, whose
  // first half are gate columns n0.. and second half up columns I + n0...
  for_each_output<Epilogue::kStore, kBlockN>(acc, [&](int r, int c, float v0, float v1) {
    if (slab + r >= t.rows) return;
    const int col = c < kBlockN / 2 ? t.n_tile * (kBlockN / 2) + c
                                    : p.half_n + t.n_tile * (kBlockN / 2) + c - kBlockN / 2;
    *reinterpret_cast<__nv_bfloat162*>(p.h_out + int64_t(t.out_row0 + slab + r) * ld + col) =
        __floats2bfloat162_rn(v0, v1);
  });
}

// The same for a full slab: the gate half, then the up half, of the raw accumulators through
// the staging buffer (one 64 x kBlockN/2 half fills it) and TMA stores into h. Direct
// stores of h from registers cost 0.2 ms (30b) to 0.8 ms (235b) of the forward.
template <int kBlockN>
__device__ __forceinline__ void store_slab_h_tma(const CUtensorMap& map_h,
                                                 const GroupedGemmParams& p, const TileCoords& t,
                                                 const float (&acc)[kBlockN / 2], int warpgroup,
                                                 uint8_t* staging) {
  constexpr int kHalf = kBlockN / 2;
  static_assert(kHalf == TileConfig<Epilogue::kSwiGLU, kBlockN>::kOutCols);
  const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
  for (int part = 0; part < 2; ++part) {  // 0: gate columns, 1: up columns
    if (leader) bulk_wait_group_read_all();  // the staging buffer's last store has read it
    named_barrier_sync(1 + warpgroup, 128);
    for_each_output<Epilogue::kStore, kBlockN>(acc, [&](int r, int c, float v0, float v1) {
      if ((c < kHalf) != (part == 0)) return;
      const int in_half = c - part * kHalf;
      const int box = in_half / kStoreBoxCols, cc = in_half % kStoreBoxCols;
      uint8_t* at =
          staging + box * kStoreBoxBytes + r * 128 + (((cc / 8) ^ (r % 8)) * 16) + (cc % 8) * 2;
      *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(v0, v1);
    });
    fence_proxy_async_shared();
    named_barrier_sync(1 + warpgroup, 128);
    if (leader) {
#pragma unroll
      for (int box = 0; box < kHalf / kStoreBoxCols; ++box) {
        tma_store_2d(&map_h, staging + box * kStoreBoxBytes,
                     part * p.half_n + t.n_tile * kHalf + box * kStoreBoxCols,
                     t.out_row0 + warpgroup * 64);
      }
      bulk_commit_group();
    }
  }
}

// kWgrad into an fp32 gradient buffer: C += acc. Each output tile has one owner (no races).
template <int kBlockN>
__device__ __forceinline__ void accumulate_slab_f32(const GroupedGemmParams& p,
                                                    const TileCoords& t,
                                                    const float (&acc)[kBlockN / 2],
                                                    int warpgroup) {
  float* base = p.c_f32 + int64_t(t.out_row0 + warpgroup * 64) * p.ldc + t.n_tile * kBlockN;
  for_each_output<Epilogue::kStore, kBlockN>(acc, [&](int r, int c, float v0, float v1) {
    float2* at = reinterpret_cast<float2*>(base + int64_t(r) * p.ldc + c);
    const float2 old = *at;
    *at = make_float2(old.x + v0, old.y + v1);
  });
}

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
    const float sig = 1.0f / (1.0f + __expf(-gs[j]));
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

// The slab's dp partials: the four lanes of a quad hold all columns of the same two rows;
// summed over the quad in a fixed order, one partial per (row, N-tile).
__device__ __forceinline__ void store_dp_partials(const GroupedGemmParams& p, const TileCoords& t,
                                                  float (&partial)[2], int slab) {
  const int thread = threadIdx.x % 128;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    partial[half] += __shfl_xor_sync(0xffffffffu, partial[half], 1);
    partial[half] += __shfl_xor_sync(0xffffffffu, partial[half], 2);
  }
  if (thread % 4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = slab + (thread / 32) * 16 + (thread % 32) / 4 + half * 8;
      if (r < t.rows) p.dp_partial[int64_t(t.row0 + r) * p.n_tiles + t.n_tile] = partial[half];
    }
  }
}

// dgrad of L2 fused with the SwiGLU backward, for one warpgroup's slab: with z = acc,
// a = silu(g) u, da = p z: dg = da u silu'(g), du = da silu(g), and the tile's share of
// dp = <z, a> (summed over the quad's lanes in a fixed order, one partial per N-tile).
// The h values of a row are loaded kLoadBatch 8-column chunks at a time, all issued before
// any is used: one row's loads one after the other made this epilogue latency-bound
// (1.87 ms of the 30b backward's dgrad, against 0.6 ms of MMA).
template <int kBlockN>
__device__ __forceinline__ void store_slab_swiglu_backward(const GroupedGemmParams& p,
                                                           const TileCoords& t,
                                                           const float (&acc)[kBlockN / 2],
                                                           int warpgroup) {
  constexpr int kChunks = kBlockN / 8;  // 8-column chunks of the tile; a thread has 2 columns of each
  constexpr int kLoadBatch = 16;
  static_assert(kChunks % kLoadBatch == 0);
  const int thread = threadIdx.x % 128;
  const int slab = warpgroup * 64;
  const int64_t ld = 2 * int64_t(p.half_n);
  const int col0 = t.n_tile * kBlockN + (thread % 4) * 2;
  float partial[2] = {0.f, 0.f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = (thread / 32) * 16 + (thread % 32) / 4 + half * 8;
    const int64_t out_row = t.out_row0 + slab + r;
    __nv_bfloat16* dg_out = p.dh + out_row * ld + col0;
    __nv_bfloat16* du_out = dg_out + p.half_n;
    __nv_bfloat16* a_out = p.a_out ? p.a_out + out_row * p.half_n + col0 : nullptr;
    if (slab + r >= t.rows) {
      if (p.c_padded) {  // pad rows of the weight-gradient operands are zeros
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
    const float weight = __ldg(&p.slot_weights[__ldg(&p.row_slot[row])]);
    const auto* h_gate = reinterpret_cast<const unsigned*>(p.h + row * ld + col0);
    const auto* h_up = reinterpret_cast<const unsigned*>(p.h + row * ld + p.half_n + col0);
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
        const float z[2] = {acc[q * 4 + half * 2], acc[q * 4 + half * 2 + 1]};
        const SwiGLUGradPair out = swiglu_backward_pair(z, g_bits[i], u_bits[i], weight, partial[half]);
        *reinterpret_cast<__nv_bfloat162*>(dg_out + q * 8) = out.dg;
        *reinterpret_cast<__nv_bfloat162*>(du_out + q * 8) = out.du;
        if (a_out) *reinterpret_cast<__nv_bfloat162*>(a_out + q * 8) = out.a;
      }
    }
  }
  store_dp_partials(p, t, partial, slab);
}

// Loads quarter `quarter` (64 columns) of the slab's h = [gate | up] by TMA: the gate box
// into the staging buffer's last 64 x 64 box, the up box into h_up. One thread.
template <int kBlockN>
__device__ __forceinline__ void load_h_quarter(const CUtensorMap& map_h_in,
                                               const GroupedGemmParams& p, const TileCoords& t,
                                               int warpgroup, int quarter, uint8_t* staging,
                                               uint8_t* h_up, uint64_t* bar) {
  const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
  const int row = t.row0 + warpgroup * 64;
  mbarrier_arrive_expect_tx(bar, 2 * kStoreBoxBytes);
  tma_load_2d(staging + 3 * kStoreBoxBytes, &map_h_in, bar, col, row);
  tma_load_2d(h_up, &map_h_in, bar, p.half_n + col, row);
}

// The same for the padded layout (every slab row is the expert's or a pad row) with
// 256-wide tiles: per 64-column quarter, dg, du and a of the slab go into three 64 x 64
// boxes of the staging buffer and leave by TMA stores, which drain while the next quarter
// is computed. (Register stores of 4 bytes per value made this epilogue cost about as much
// as the tile's MMAs.) The quarter's h arrives by TMA (load_h_quarter): quarter 0 was
// requested before the tile's MMAs, quarter q + 1 as soon as every thread has read quarter
// q. (With h loaded into registers a quarter's row at a time, ncu found the tensor pipe
// 47% busy and half of the warps' stall cycles waiting on those loads; this gained 4-7%.)
template <int kBlockN>
__device__ __forceinline__ void store_slab_swiglu_backward_tma(
    const CUtensorMap& map_dh, const CUtensorMap& map_a, const CUtensorMap& map_h_in,
    const GroupedGemmParams& p, const TileCoords& t, const float (&acc)[kBlockN / 2],
    int warpgroup, uint8_t* staging, uint8_t* h_up, uint64_t* h_bar, uint32_t& h_phase) {
  constexpr int kQuarters = kBlockN / kStoreBoxCols;
  constexpr int kChunksPerBox = kStoreBoxCols / 8;
  static_assert(4 * kStoreBoxBytes <=
                TileConfig<Epilogue::kSwiGLUBackward, kBlockN>::kStagingBytes);
  const int thread = threadIdx.x % 128;
  const bool leader = thread == 0;
  const int slab = warpgroup * 64;
  const int pair = (thread % 4) * 2;  // this thread's first column within each 8-column chunk
  const uint8_t* h_gate = staging + 3 * kStoreBoxBytes;
  float partial[2] = {0.f, 0.f};
  bool valid[2];
  float weight[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = (thread / 32) * 16 + (thread % 32) / 4 + half * 8;
    valid[half] = slab + r < t.rows;
    const int64_t row = valid[half] ? t.row0 + slab + r : 0;
    weight[half] = valid[half] ? __ldg(&p.slot_weights[__ldg(&p.row_slot[row])]) : 0.f;
  }
#pragma unroll
  for (int quarter = 0; quarter < kQuarters; ++quarter) {
    mbarrier_wait(h_bar, h_phase);
    h_phase ^= 1;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = (thread / 32) * 16 + (thread % 32) / 4 + half * 8;
      // The row's h values of the quarter from the swizzled boxes (rows past the expert's
      // end hold the next rows of h: read as zeros).
      unsigned g_bits[kChunksPerBox], u_bits[kChunksPerBox];
#pragma unroll
      for (int i = 0; i < kChunksPerBox; ++i) {
        const int at = r * 128 + ((i ^ (r % 8)) * 16) + pair * 2;
        g_bits[i] = valid[half] ? *reinterpret_cast<const unsigned*>(h_gate + at) : 0u;
        u_bits[i] = valid[half] ? *reinterpret_cast<const unsigned*>(h_up + at) : 0u;
      }
      if (half == 0) {
        if (leader) bulk_wait_group_read_all();  // the last quarter's stores have read staging
        named_barrier_sync(1 + warpgroup, 128);
      } else {
        // Every thread has this quarter's h in registers: request the next quarter.
        named_barrier_sync(1 + warpgroup, 128);
        if (leader && quarter + 1 < kQuarters) {
          load_h_quarter<kBlockN>(map_h_in, p, t, warpgroup, quarter + 1, staging, h_up, h_bar);
        }
      }
#pragma unroll
      for (int i = 0; i < kChunksPerBox; ++i) {
        const int q = quarter * kChunksPerBox + i;
        // Pad rows: z may be anything (their A rows were never copied); with z = 0 and
        // h = 0, dg = du = a = 0.
        const float z[2] = {valid[half] ? acc[q * 4 + half * 2] : 0.f,
                            valid[half] ? acc[q * 4 + half * 2 + 1] : 0.f};
        const SwiGLUGradPair out =
            swiglu_backward_pair(z, g_bits[i], u_bits[i], weight[half], partial[half]);
        const int at = r * 128 + ((i ^ (r % 8)) * 16) + pair * 2;
        *reinterpret_cast<__nv_bfloat162*>(staging + at) = out.dg;
        *reinterpret_cast<__nv_bfloat162*>(staging + kStoreBoxBytes + at) = out.du;
        *reinterpret_cast<__nv_bfloat162*>(staging + 2 * kStoreBoxBytes + at) = out.a;
      }
    }
    fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
    named_barrier_sync(1 + warpgroup, 128);
    if (leader) {
      const int col = t.n_tile * kBlockN + quarter * kStoreBoxCols;
      const int row = t.out_row0 + slab;
      tma_store_2d(&map_dh, staging, col, row);
      tma_store_2d(&map_dh, staging + kStoreBoxBytes, p.half_n + col, row);
      if (p.a_out != nullptr) tma_store_2d(&map_a, staging + 2 * kStoreBoxBytes, col, row);
      bulk_commit_group();
    }
  }
  store_dp_partials(p, t, partial, slab);
}

// setmaxnreg only moves registers within the block's launch allocation (384 x 168): what
// the consumers gain, 256 x (224 - 168), must equal what the producer gives up,
// 128 x (168 - 56); a larger total makes the consumers' setmaxnreg.inc wait forever.
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;

// B tile(s) of one k-block: the expert's weight rows for this N-tile.
template <Epilogue kEpilogue, int kBlockN, bool kBMajorN>
__device__ __forceinline__ void load_b(const CUtensorMap& map_b, const GroupedGemmParams& p,
                                       const TileCoords& t, __nv_bfloat16* dst, uint64_t* bar,
                                       int kb) {
  const int b_row = t.expert * p.b_rows_per_expert;
  if constexpr (kBMajorN) {
    static_assert(kEpilogue != Epilogue::kSwiGLU);
    // Boxes of 64 K-rows x 64 N-elements, one after the other along N. (kWgrad: K rows are
    // the expert's padded rows, t.k_row0.., and b_row is 0.)
#pragma unroll
    for (int box = 0; box < kBlockN / 64; ++box) {
      tma_load_2d(dst + box * 64 * kBlockK, &map_b, bar, t.n_tile * kBlockN + box * 64,
                  b_row + t.k_row0 + kb * kBlockK);
    }
  } else if constexpr (kEpilogue == Epilogue::kSwiGLU) {
    const int n = t.n_tile * (kBlockN / 2);
    tma_load_2d(dst, &map_b, bar, kb * kBlockK, b_row + n);
    tma_load_2d(dst + (kBlockN / 2) * kBlockK, &map_b, bar, kb * kBlockK, b_row + p.half_n + n);
  } else {
    tma_load_2d(dst, &map_b, bar, kb * kBlockK, b_row + t.n_tile * kBlockN);
  }
}

template <bool kWgrad>
__device__ __forceinline__ TileCoords locate(const GroupedGemmParams& p, int tile) {
  if constexpr (kWgrad) {
    return locate_wgrad_tile(p, tile);
  } else {
    return locate_tile(p, tile);
  }
}

// One thread: A and B tiles by TMA. kWgrad: A is M-major, two boxes of 64 K-rows x 64 M.
template <Epilogue kEpilogue, int kBlockN, bool kBMajorN, bool kWgrad>
__device__ __forceinline__ void produce_tma(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                            const GroupedGemmParams& p,
                                            GemmSharedStorage<kEpilogue, kBlockN>& smem,
                                            int num_tiles) {
  constexpr int kStages = TileConfig<kEpilogue, kBlockN>::kStages;
  prefetch_tensor_map(&map_a);
  prefetch_tensor_map(&map_b);
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileCoords t = locate<kWgrad>(p, tile);
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      mbarrier_wait(&smem.empty[stage], phase ^ 1);
      mbarrier_arrive_expect_tx(&smem.full[stage], kTileBytesA + TileConfig<kEpilogue, kBlockN>::kTileBytesB);
      if constexpr (kWgrad) {
        for (int box = 0; box < kBlockM / 64; ++box) {
          tma_load_2d(smem.a[stage] + box * 64 * kBlockK, &map_a, &smem.full[stage],
                      t.m0 + box * 64, t.k_row0 + kb * kBlockK);
        }
      } else {
        tma_load_2d(smem.a[stage], &map_a, &smem.full[stage], kb * kBlockK, t.a_row0);
      }
      load_b<kEpilogue, kBlockN, kBMajorN>(map_b, p, t, smem.b[stage], &smem.full[stage], kb);
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
  }
}

// The whole producer warpgroup: A rows gathered straight from the token matrix with
// cp.async (no permuted copy of x in memory), B by TMA from thread 0. Each warp instruction
// covers 4 rows x 128 contiguous bytes; the smem layout is TMA's 128-byte swizzle, which
// the wgmma descriptors expect: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
template <Epilogue kEpilogue, int kBlockN, bool kBMajorN>
__device__ __forceinline__ void produce_gathered(const CUtensorMap& map_b,
                                                 const GroupedGemmParams& p,
                                                 GemmSharedStorage<kEpilogue, kBlockN>& smem,
                                                 int num_tiles, int k_blocks) {
  constexpr int kStages = TileConfig<kEpilogue, kBlockN>::kStages;
  constexpr int kRowsPerThread = kBlockM / 16;
  const int thread = threadIdx.x;  // 0..127
  const int chunk = thread % 8;
  if (thread == 0) prefetch_tensor_map(&map_b);
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileCoords t = locate_tile(p, tile);
    // Token of each of this thread's rows; -1 past the expert's end (never stored: their
    // shared memory is left as it is). 32-bit to stay inside the producer's 56 registers.
    int32_t token[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = thread / 8 + 16 * i;
      token[i] = r < t.rows ? __ldg(&p.a_row_index[t.row0 + r]) : -1;
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbarrier_wait(&smem.empty[stage], phase ^ 1);
      if (thread == 0) {
        mbarrier_arrive_expect_tx(&smem.full[stage], TileConfig<kEpilogue, kBlockN>::kTileBytesB);
        load_b<kEpilogue, kBlockN, kBMajorN>(map_b, p, t, smem.b[stage], &smem.full[stage], kb);
      }
      uint8_t* a_tile = reinterpret_cast<uint8_t*>(smem.a[stage]);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int r = thread / 8 + 16 * i;
        if (token[i] >= 0) {
          cp_async_16(a_tile + r * 128 + ((chunk ^ (r % 8)) * 16),
                      p.a_source + int64_t(token[i]) * p.k + kb * kBlockK + chunk * 8);
        }
      }
      cp_async_mbarrier_arrive(&smem.full[stage]);
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
  }
}

template <Epilogue kEpilogue, int kBlockN, bool kGatherA, bool kBMajorN, bool kWgrad = false>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_c,
                        // kSwiGLU: the saved h; kSwiGLUBackward: a_out.
                        const __grid_constant__ CUtensorMap map_h,
                        // kSwiGLUBackward: h read in 64 x 64 boxes.
                        const __grid_constant__ CUtensorMap map_h_in, GroupedGemmParams p) {
  using Config = TileConfig<kEpilogue, kBlockN>;
  constexpr int kStages = Config::kStages;
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<GemmSharedStorage<kEpilogue, kBlockN>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      // TMA's expect_tx arrival, plus each producer thread's cp.async arrival when gathering.
      mbarrier_init(&smem.full[s], kGatherA ? 1 + 128 : 1);
      mbarrier_init(&smem.empty[s], 2);  // one arrival per consumer warpgroup
    }
    for (int w = 0; w < 2; ++w) mbarrier_init(&smem.h_full[w], 1);
    fence_barrier_init();
  }
  __syncthreads();

  static_assert(!(kWgrad && kGatherA));
  const int num_tiles = kWgrad ? p.num_experts * (p.wgrad_m / kBlockM) * p.n_tiles
                               : __ldg(&p.tile_offsets[p.num_experts]) * p.n_tiles;
  const int k_blocks = p.k / kBlockK;

  if (warpgroup == 0) {
    // The producer needs few registers: give them to the consumers' accumulators.
    setmaxnreg_dec<kProducerRegisters>();
    if constexpr (kGatherA) {
      produce_gathered<kEpilogue, kBlockN, kBMajorN>(map_b, p, smem, num_tiles, k_blocks);
    } else if (threadIdx.x == 0) {
      produce_tma<kEpilogue, kBlockN, kBMajorN, kWgrad>(map_a, map_b, p, smem, num_tiles);
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const bool releases = threadIdx.x % 128 == 0;
  float acc[Config::kAccumulators];
  int stage = 0;
  uint32_t phase = 0;
  uint32_t h_phase = 0;  // kHByTma: parity of this warpgroup's next h quarter
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileCoords t = locate<kWgrad>(p, tile);
    if constexpr (Config::kHByTma) {
      // The epilogue's first quarter of h, fetched under this tile's MMAs (the buffers were
      // released by the last tile's epilogue, whose final barrier every thread has passed).
      if (p.c_padded && releases) {
        load_h_quarter<kBlockN>(map_h_in, p, t, consumer, 0, smem.staging[consumer],
                                smem.h_up[consumer], &smem.h_full[consumer]);
      }
    }
    int previous = -1;
    if (t.k_blocks == 0) {  // an expert without tokens: its weight gradient is zero
#pragma unroll
      for (int i = 0; i < Config::kAccumulators; ++i) acc[i] = 0.f;
    }
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      mbarrier_wait(&smem.full[stage], phase);
      // Gathered A rows were written through the generic proxy; wgmma reads the async one.
      if constexpr (kGatherA) fence_proxy_async_shared();
      // kWgrad: this warpgroup's 64 M-rows are one 64-element box of the M-major A tile.
      const uint64_t desc_a =
          kWgrad ? smem_desc_mn_major_sw128(smem.a[stage] + consumer * 64 * kBlockK, 64 * 128, 8 * 128)
                 : smem_desc_k_major_sw128(smem.a[stage] + consumer * 64 * kBlockK);
      constexpr int kStepA = kWgrad ? 16 * 128 / 16 : 2;
      const uint64_t desc_b = kBMajorN
                                  ? smem_desc_mn_major_sw128(smem.b[stage], p.b_lbo, p.b_sbo)
                                  : smem_desc_k_major_sw128(smem.b[stage]);
      // Along K, 16 elements are 32 bytes in a K-major row but 16 rows of 128 bytes in an
      // N-major tile (descriptor units of 16 bytes).
      constexpr int kStepB = kBMajorN ? 16 * 128 / 16 : 2;
#pragma unroll
      for (int i = 0; i < Config::kAccumulators; ++i) fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        // 16 bf16 along K are 32 bytes: 2 in the descriptor's 16-byte address units.
        wgmma_bf16<kBlockN, kBMajorN ? 1 : 0, kWgrad ? 1 : 0>(
            acc, desc_a + kStepA * kk, desc_b + kStepB * kk, (kb > 0 || kk > 0) ? 1 : 0);
      }
      wgmma_commit();
      // Keep this k-block's MMAs in flight; the previous block's are done, so its stage
      // can go back to the producer.
      wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < Config::kAccumulators; ++i) fence_operand(acc[i]);
      if (previous >= 0 && releases) mbarrier_arrive(&smem.empty[previous]);
      previous = stage;
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < Config::kAccumulators; ++i) fence_operand(acc[i]);
    if (previous >= 0 && releases) mbarrier_arrive(&smem.empty[previous]);
    if constexpr (kWgrad) {
      if (p.c_f32 != nullptr) {
        accumulate_slab_f32<kBlockN>(p, t, acc, consumer);
        continue;
      }
    }
    if constexpr (kEpilogue == Epilogue::kSwiGLUBackward) {
      bool staged = false;
      if constexpr (kBlockN == 256) {  // 128-wide tiles' staging holds two boxes, not three
        if (p.c_padded) {
          store_slab_swiglu_backward_tma<kBlockN>(map_c, map_h, map_h_in, p, t, acc, consumer,
                                                  smem.staging[consumer], smem.h_up[consumer],
                                                  &smem.h_full[consumer], h_phase);
          staged = true;
        }
      }
      if (!staged) store_slab_swiglu_backward<kBlockN>(p, t, acc, consumer);
    } else if (t.rows - consumer * 64 >= 64) {
      store_slab_tma<kEpilogue, kBlockN>(map_c, t, acc, consumer, smem.staging[consumer]);
      if constexpr (kEpilogue == Epilogue::kSwiGLU) {
        if (p.h_out != nullptr) {
          store_slab_h_tma<kBlockN>(map_h, p, t, acc, consumer, smem.staging[consumer]);
        }
      }
    } else {
      store_slab_direct<kEpilogue, kBlockN>(p, t, acc, consumer);
      if constexpr (kEpilogue == Epilogue::kSwiGLU) {
        if (p.h_out != nullptr) store_slab_h<kBlockN>(p, t, acc, consumer);
      }
    }
  }
  if (releases) bulk_wait_group_all();  // shared memory must outlive the last stores
}

}  // namespace megamoe::sm90
