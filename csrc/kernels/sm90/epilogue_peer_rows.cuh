// The peer-rows epilogue: each output row (bf16, unweighted, as StoreEpilogue writes it) goes
// straight into the combine slot of the token it was computed for, on the token's rank,
// through the peer pointer table; then the slot's counter there is advanced by the columns
// stored. The expert-parallel forward's L2 uses it so that the owner runs no combine pass and
// the source reduces each token as soon as its slots are complete
// (docs/expert-parallel.md, "Forward overlap").
//
// Why not TMA stores: consecutive rows of a tile belong to different ranks and slots. The
// slab is staged in shared memory as for the TMA stores (same swizzle), then copied out row by
// row with 16-byte stores, a warp covering one 256-column row (512 contiguous bytes) per
// instruction, or two 128-column rows.
//
// Memory ordering: a row's columns are stored by several threads, and the thread that signals
// is another one. So every storing thread fences at system scope (its stores are visible to
// every GPU before the fence completes), the warpgroup syncs, and one thread per row then adds
// kBlockN to the slot's counter with a release at system scope. A reader that acquires the
// counter at its full value (the row's N columns) sees every column.
//
// The fence waits until the thread's remote stores are acknowledged (an NVLink round trip).
// Right after the stores it would hold the warpgroup for that long on every tile, so a
// tile's fence and counts are deferred to the next tile's store() (or finish()): by then the
// stores have drained during that tile's MMAs. A slot completes one tile later, which the
// source, still busy with its own L2, does not notice.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/sm90/epilogue_common.cuh"

namespace megamoe::sm90 {

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <int kBlockN_>
class PeerRowsEpilogue {
 public:
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kOutCols = kBlockN;
  static constexpr BColumns kBColumns = BColumns::kContiguous;
  static constexpr int kMaxRanks = 8;

  struct Params {
    char* buffers[kMaxRanks];  // every rank's buffer, as this rank sees it
    uint64_t rows_offset;      // bf16 [slots_per_rank, ld] in every buffer
    uint64_t done_offset;      // uint32 [slots_per_rank] in every buffer
    const int32_t* row_dest;   // [C rows] source * slots_per_rank + slot; < 0: not stored
    const int32_t* skip;       // nonzero: store and signal nothing
    int32_t slots_per_rank;
    int32_t ld;                // columns of a slot row: the GEMM's n
  };

  // From a PeerRowsOut (gemm.h) and the GEMM's n.
  template <class Out>
  static Params params(const Out& out, int64_t n) {
    Params p{};
    for (int r = 0; r < kMaxRanks; ++r) p.buffers[r] = out.buffers[r];
    p.rows_offset = out.rows_offset;
    p.done_offset = out.done_offset;
    p.row_dest = out.row_dest;
    p.skip = out.skip;
    p.slots_per_rank = static_cast<int32_t>(out.slots_per_rank);
    p.ld = static_cast<int32_t>(n);
    return p;
  }

  struct Buffers {
    uint8_t staging[2][64 * kOutCols * 2];
  };
  struct Barriers {};
  __device__ __forceinline__ static void init(Barriers&) {}

  __device__ __forceinline__ PeerRowsEpilogue(const Params& p, Buffers& buffers, Barriers&,
                                              int consumer)
      : p_(p),
        staging_(buffers.staging[consumer]),
        consumer_(consumer),
        rows_offset_(p.rows_offset),
        done_offset_(p.done_offset),
        row_dest_(p.row_dest),
        slots_per_rank_(p.slots_per_rank),
        ld_(p.ld),
        skip_(*p.skip != 0) {}

  __device__ __forceinline__ void begin_tile(const Tile&) {}

  __device__ __forceinline__ void store(const Tile& t, const float (&acc)[kBlockN / 2]) {
    if (skip_) return;
    // The previous tile's rows: fenced and counted. Its barrier also frees the staging (every
    // thread's copy-out reads of it are done). Without rows pending no copy-out ran since
    // the last barrier.
    if (pending_rows_ > 0) signal_pending();
    const int slab = consumer_ * 64;
    const int rows = min(64, t.rows - slab);  // uniform over the warpgroup
    if (rows <= 0) return;
    stage_chunks<kOutCols / 8>(
        staging_, [&](int q, int half, int j) { return acc[Fragment::index(q, half, j)]; });
    consumer_barrier_sync(consumer_);

    constexpr int kChunks = kOutCols / 8;         // 16-byte chunks per row
    constexpr int kRowsPerPass = 128 / kChunks;   // rows the warpgroup copies at once
    const int thread = threadIdx.x % 128;
    const int c = thread % kChunks;
    const int64_t col_bytes = int64_t(t.n_tile) * kOutCols * 2 + c * 16;
    for (int r = thread / kChunks; r < rows; r += kRowsPerPass) {
      const int32_t dest = row_dest_[t.row0 + slab + r];
      if (dest < 0) continue;
      const int source = dest / slots_per_rank_;
      const int64_t slot = dest - int64_t(source) * slots_per_rank_;
      // Chunk c of row r in the staging buffer (stage_chunks' swizzle).
      const uint4 v = *reinterpret_cast<const uint4*>(
          staging_ + (c / 8) * kStoreBoxBytes + r * 128 + (((c % 8) ^ (r % 8)) * 16));
      char* row = p_.buffers[source] + rows_offset_ + slot * ld_ * 2;
      *reinterpret_cast<uint4*>(row + col_bytes) = v;
    }
    pending_row0_ = t.row0 + slab;
    pending_rows_ = rows;
  }

  __device__ __forceinline__ void finish() {
    if (!skip_ && pending_rows_ > 0) signal_pending();
  }

 private:
  // Fence this thread's stores of the pending rows, sync the warpgroup, then count each
  // pending row's kOutCols columns into its slot's counter (one thread per row).
  __device__ __forceinline__ void signal_pending() {
    __threadfence_system();
    consumer_barrier_sync(consumer_);
    const int thread = threadIdx.x % 128;
    if (thread < pending_rows_) {
      const int32_t dest = row_dest_[pending_row0_ + thread];
      if (dest >= 0) {
        const int source = dest / slots_per_rank_;
        const int64_t slot = dest - int64_t(source) * slots_per_rank_;
        red_release_sys_add(
            reinterpret_cast<uint32_t*>(p_.buffers[source] + done_offset_) + slot, kOutCols);
      }
    }
    pending_rows_ = 0;
  }

  // The pointer table is indexed at run time, so it stays in the params (a reference); the
  // scalars are copied out (epilogue_common.cuh says why).
  const Params& p_;
  uint8_t* staging_;
  int consumer_;
  uint64_t rows_offset_, done_offset_;
  const int32_t* row_dest_;
  int32_t slots_per_rank_;
  int32_t ld_;
  bool skip_;
  int pending_row0_ = 0;  // the rows stored by the last store() and not yet counted
  int pending_rows_ = 0;
};

}  // namespace megamoe::sm90
