// Rows copied by a warp through shared memory: each piece of a source row comes in by one
// bulk copy (1-D TMA) and the lanes store it to its destinations (the dispatch's peer
// stores, ep_dispatch.cu). The combine send's sums do the same with their loads
// (staged_row_sums.cuh says why: a copy SM whose lanes load the rows runs at no more than
// about 36 GB/s).
//
// Each warp works alone on its own ring of kStages stages of kStageBytes: it stores stage q
// while the bulk copies of the stages after it are in flight. The stores are the lanes'
// plain 16-byte stores, as before, so the destinations see them as they saw the lanes'
// copies (the kernel's closing fence and the phase signal after it).
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace megamoe::ep {

// One piece of a row: `bytes` (a multiple of 16, at most the stage's) from `src`; `token`,
// `kind` and `offset` are the caller's, handed back with the staged bytes.
struct StagedPiece {
  const void* src;
  int64_t token;
  int32_t bytes;
  int32_t kind;
  int32_t offset;
  int32_t pad;
};

template <int kWarps, int kStages, int kStageBytes>
struct StagedRowCopy {
  static_assert(kStageBytes % 512 == 0);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSlots = kWarps * kStages;
  // Per stage: its bytes, then its barrier and piece.
  static constexpr int kSharedBytes =
      kSlots * (kStageBytes + 8 + static_cast<int>(sizeof(StagedPiece)));

  // Warp-wide; every warp of the block calls it. next(StagedPiece&) fills the warp's next
  // piece and returns false when there is none (the same on every lane); store(piece, staged)
  // runs on every lane with the piece's bytes in shared memory.
  template <class Next, class Store>
  __device__ __forceinline__ static void run(uint8_t* smem, Next&& next, Store&& store) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* tiles = smem + warp * kStages * kStageBytes;
    uint8_t* meta = smem + kSlots * kStageBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(meta) + warp * kStages;
    StagedPiece* pieces = reinterpret_cast<StagedPiece*>(meta + kSlots * 8) + warp * kStages;
    if (lane < kStages) sm90::mbarrier_init(full + lane, 1);
    sm90::fence_barrier_init();
    __syncwarp();

    const auto issue = [&](int64_t q) -> bool {  // false: no piece left
      StagedPiece piece;
      if (!next(piece)) return false;
      const int st = static_cast<int>(q % kStages);
      if (lane == 0) {
        pieces[st] = piece;
        sm90::mbarrier_arrive_expect_tx(full + st, static_cast<uint32_t>(piece.bytes));
        sm90::bulk_load_1d(tiles + st * kStageBytes, piece.src,
                           static_cast<uint32_t>(piece.bytes), full + st);
      }
      return true;
    };

    int64_t issued = 0, stored = 0;
    bool more = true;
    while (true) {
      while (more && issued - stored < kStages) {
        more = issue(issued);
        issued += more;
      }
      if (stored == issued) break;
      const int st = static_cast<int>(stored % kStages);
      sm90::mbarrier_wait(full + st, static_cast<uint32_t>((stored / kStages) & 1));
      store(pieces[st], tiles + st * kStageBytes);
      __syncwarp();  // every lane's reads of the stage before its next copy
      ++stored;
    }
  }
};

}  // namespace megamoe::ep
