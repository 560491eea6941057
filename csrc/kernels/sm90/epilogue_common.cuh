// What the epilogues share: where each accumulator sits (Fragment), the walk over a thread's
// outputs, and the staging of a 64-row slab in shared memory for TMA stores.
//
// An epilogue is a type with: kBlockN; kOutCols (output columns per N-tile); kBColumns (the
// B tile it needs); Params (with its tensor maps) built on the host; Buffers (its shared
// memory, which the stage count leaves room for) and Barriers; init(barriers) (thread 0,
// before the kernel's first sync); a constructor (params, buffers, barriers, consumer);
// begin_tile(tile), before the tile's MMAs; store(tile, acc); finish(), after the last tile.
// Like every part, an epilogue copies its scalars out of the kernel's params when it is
// constructed and uses only the tensor maps in place (TMA wants their address): loads
// through a reference to the params are not hoisted across the inline asm around them, which
// costs instructions in every loop and breaks the folding of store addresses.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/gemm_common.cuh"

namespace megamoe::sm90 {

// Whether epilogue E keeps its GEMM on the round-robin tile order (E::kRoundRobinTilesOnly,
// where its consumers have no registers for the dynamic order's loop: GroupedGemm's
// kPassesTiles).
template <class E>
constexpr bool round_robin_tiles_only() {
  if constexpr (requires { E::kRoundRobinTilesOnly; }) {
    return E::kRoundRobinTilesOnly;
  } else {
    return false;
  }
}

// The accumulator fragment of wgmma m64nNk16 (fp32 D). Thread t of the warpgroup (warp
// w = t / 32, lane l = t % 32) holds, of each 8-column chunk q, columns 8q + 2(l % 4) and
// 8q + 2(l % 4) + 1 of row 16w + l / 4 (row half 0) and of the row 8 below it (half 1).
struct Fragment {
  // This thread's row of row half 0 (0..63 of the warpgroup's slab); half 1 is 8 below.
  __device__ __forceinline__ static int row0() {
    const int thread = threadIdx.x % 128;
    return (thread / 32) * 16 + (thread % 32) / 4;
  }
  // This thread's first column of chunk 0; chunk q's is 8q further.
  __device__ __forceinline__ static int col0() {
    const int thread = threadIdx.x % 128;
    return (thread % 4) * 2;
  }
  __device__ __forceinline__ static int row(int half) { return row0() + half * 8; }
  __device__ __forceinline__ static int col(int q) { return q * 8 + col0(); }
  // The register holding column j (0, 1) of this thread's pair of chunk q, row half `half`.
  __host__ __device__ static constexpr int index(int q, int half, int j) {
    return q * 4 + half * 2 + j;
  }
};

// Calls emit(r, c, v0, v1) for each of this thread's output pairs among the slab's kCols
// columns: row r of the slab, columns c and c + 1, v_j = value(q, half, j).
template <int kCols, class Value, class Emit>
__device__ __forceinline__ void for_each_output(Value&& value, Emit&& emit) {
  // Row and column offsets added to loop-invariant bases: the stores' addresses then differ
  // by immediates.
  const int row = Fragment::row0();
  const int col = Fragment::col0();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < kCols / 8; ++q) {
      emit(row + half * 8, q * 8 + col, value(q, half, 0), value(q, half, 1));
    }
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Writes kChunks 8-column chunks of the warpgroup's 64-row slab (value(q, half, j), as in
// for_each_output) into the staging buffer's 128-byte-swizzled 64 x 64 boxes (chunk c of row
// r at box c / 8, 16-byte slot (c % 8) ^ (r % 8)). One stmatrix stores two chunks of the
// warp's 16 rows: a quarter of the shared-memory store instructions of 4-byte stores.
template <int kChunks, class Value>
__device__ __forceinline__ void stage_chunks(uint8_t* staging, Value&& value) {
  static_assert(kChunks % 2 == 0);
  const int thread = threadIdx.x % 128;
  const int lane = thread % 32;
  const int j = lane % 8, matrix = lane / 8;  // this lane addresses row j of `matrix`
  const int row = (thread / 32) * 16 + (matrix % 2) * 8 + j;
  uint8_t* row_base = staging + row * 128;
#pragma unroll
  for (int q = 0; q < kChunks; q += 2) {
    // Matrices: (chunk q, rows 0-7), (q, rows 8-15), (q + 1, rows 0-7), (q + 1, rows 8-15).
    const uint32_t r0 = pack_bf16x2(value(q, 0, 0), value(q, 0, 1));
    const uint32_t r1 = pack_bf16x2(value(q, 1, 0), value(q, 1, 1));
    const uint32_t r2 = pack_bf16x2(value(q + 1, 0, 0), value(q + 1, 0, 1));
    const uint32_t r3 = pack_bf16x2(value(q + 1, 1, 0), value(q + 1, 1, 1));
    const int c = q + matrix / 2;
    stmatrix_x4(row_base + (c / 8) * kStoreBoxBytes + (((c % 8) ^ j) * 16), r0, r1, r2, r3);
  }
}

// A full slab through the staging buffer and TMA stores: stage(staging) writes kBoxes
// boxes of 64 rows x 128 bytes (kStoreBoxBytes apart, each 128-byte swizzled), box b going
// to (col + b * kBoxCols, row..) of `map` (kWarpBoxRows-row boxes). Each warp writes only
// its own 16 rows of every box and its first lane stores them, so a warp reuses its rows of
// the buffer once its own previous stores have read them. The stores drain while the
// warpgroup goes on to the next tile's MMAs.
template <int kBoxes, int kBoxCols, class Stage>
__device__ __forceinline__ void store_boxes_staged(const CUtensorMap& map, uint8_t* staging,
                                                   int, int col, int row, Stage&& stage) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
  if (lane == 0) bulk_wait_group_read_all();
  __syncwarp();
  stage(staging);
  fence_proxy_async_shared();  // the TMA engine reads what these stores wrote
  __syncwarp();
  if (lane == 0) {
    const int offset = warp * kWarpBoxRows * 128;
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      tma_store_2d(&map, staging + box * kStoreBoxBytes + offset, col + box * kBoxCols,
                   row + warp * kWarpBoxRows);
    }
    bulk_commit_group();
  }
}

// A full slab's kCols bf16 columns (value(q, half, j)) to (col.., row..) of `map`.
template <int kCols, class Value>
__device__ __forceinline__ void store_slab_staged(const CUtensorMap& map, uint8_t* staging,
                                                  int consumer, int col, int row,
                                                  Value&& value) {
  store_boxes_staged<kCols / kStoreBoxCols, kStoreBoxCols>(
      map, staging, consumer, col, row,
      [&](uint8_t* buffer) { stage_chunks<kCols / 8>(buffer, value); });
}

// The end of every epilogue that stores by TMA: shared memory must outlive the last stores.
__device__ __forceinline__ void wait_for_tma_stores() {
  if (threadIdx.x % 32 == 0) bulk_wait_group_all();  // each warp's stores (store_boxes_staged)
}

// The frame of an output that writes each tile's 64-row slab per warpgroup (StoreEpilogue,
// Fp8RowsEpilogue) of the output values Values gives (kCols columns, from the B tile
// kBColumns): its staging buffer (a bf16 slab per consumer warpgroup), the row layout, and
// store()'s choice between Derived's store_staged (a full slab) and store_direct (rows past
// the expert's end: masked stores from registers). The accessors serve the epilogues built
// on an output (the saved h stages in its buffer).
template <class Derived, int kBlockN_, class Values>
class SlabOutput {
 public:
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kOutCols = Values::kCols;
  static constexpr BColumns kBColumns = Values::kBColumns;

  struct Buffers {
    uint8_t staging[2][64 * kOutCols * 2];
  };
  struct Barriers {};
  __device__ __forceinline__ static void init(Barriers&) {}

  __device__ __forceinline__ SlabOutput(Buffers& buffers, int consumer, bool padded)
      : staging_(buffers.staging[consumer]), consumer_(consumer), padded_(padded) {}

  __device__ __forceinline__ void begin_tile(const Tile&) {}
  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    Derived& self = *static_cast<Derived*>(this);
    if (full_slab(t)) {
      self.store_staged(t, acc);
    } else {
      self.store_direct(t, acc);
    }
  }
  __device__ __forceinline__ void finish() { wait_for_tma_stores(); }

  __device__ __forceinline__ bool full_slab(const Tile& t) const {
    return t.rows - consumer_ * 64 >= 64;
  }
  __device__ __forceinline__ uint8_t* staging() const { return staging_; }
  __device__ __forceinline__ int consumer() const { return consumer_; }
  __device__ __forceinline__ bool padded() const { return padded_; }

 private:
  uint8_t* staging_;
  int consumer_;
  bool padded_;
};

}  // namespace megamoe::sm90
