// The combine send's sums (ep_combine.cu): each received token's rows on this owner summed
// in fp32 (forward: weighted by the router weights) and rounded once to bf16, with the rows
// brought into shared memory by bulk copies (1-D TMA) instead of the lanes' own loads.
//
// Why: on the few SMs of a send beside a GEMM, a send whose lanes load the rows ran at no
// more than 36 GB/s per SM at EP = 2 whatever the number of loads a lane had in flight (two
// or four rows, 768 or 1024 threads); its warps stalled on those loads 60-72% of the time.
// Bulk copies keep the bytes in flight in the copy engine: 1.4-1.7x the rate on 16 or 32
// SMs, and 1.9-2.3x on every SM against two 256-thread blocks per SM, for the same bits
// (tools/send_rate.cu; the performance log, thirteenth session of 2026-12-04).
//
// Each warp works alone on its own ring of kStages stages in shared memory: a stage holds
// one token's rows over kCols columns (a 512-byte piece a row, at most kMaxRows rows), and
// the warp sums stage q while the copies of the stages after it are in flight. The rows of
// a token keep their slot order and each column's fmas run in that order from +0, one per
// row of this owner: another owner's slots are skipped, as the one-GPU combine
// (combine_rows.cu) skips unused ones.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/bf16_row.cuh"
#include "kernels/sm90/primitives.cuh"

namespace megamoe::ep {

// A warp's next token, as each lane sees it (done, out: the same on every lane).
struct StagedToken {
  bool done;          // no token left for this warp
  int32_t row;        // lane j < k: slot j's row in `rows`, -1 for another owner's or none
  float weight;       // lane j < k: slot j's weight
  __nv_bfloat16* out; // the token's H sums go to out[0, H)
};

template <int kMaxRows>
struct StagedRowSums {
  static_assert(kMaxRows == 8 || kMaxRows == 16);
  static constexpr int kCols = 256;  // columns of a stage: 16 bytes a lane
  static constexpr int kPieceBytes = kCols * 2;
  static constexpr int kStageBytes = kMaxRows * kPieceBytes;
  // 24 warps of two stages (192 KiB of rows) came out ahead of 8 warps of six stages and 16
  // of three on 16 and 32 SMs (tools/send_rate.cu, thirteenth session); a 16-row stage
  // (k > 8) halves the warps.
  static constexpr int kStages = 2;
  static constexpr int kWarps = 24 * 8 / kMaxRows;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSlots = kWarps * kStages;
  // Per stage: its rows, then its barrier, output, row count, columns and weights.
  static constexpr int kMetaBytes = 8 + 8 + 4 + 4 + 4 * kMaxRows;
  static constexpr int kSharedBytes = kSlots * (kStageBytes + kMetaBytes);

  // Warp-wide; every warp of the block calls it with its own `next` (a callable returning the
  // warp's next StagedToken). k <= kMaxRows; H a multiple of 8.
  template <class Next>
  __device__ __forceinline__ static void run(const __nv_bfloat16* __restrict__ rows, int H,
                                             int k, uint8_t* smem, Next&& next) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* tiles = smem + warp * kStages * kStageBytes;
    uint8_t* meta = smem + kSlots * kStageBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(meta) + warp * kStages;
    __nv_bfloat16** stage_out = reinterpret_cast<__nv_bfloat16**>(meta + kSlots * 8) +
                                warp * kStages;
    int32_t* stage_n = reinterpret_cast<int32_t*>(meta + kSlots * 16) + warp * kStages;
    int32_t* stage_cols = reinterpret_cast<int32_t*>(meta + kSlots * 20) + warp * kStages;
    float* stage_w = reinterpret_cast<float*>(meta + kSlots * 24) + warp * kStages * kMaxRows;
    if (lane < kStages) sm90::mbarrier_init(full + lane, 1);
    sm90::fence_barrier_init();
    __syncwarp();

    // The issue cursor: the current token's rows (lanes 0..n-1, slot order) and chunk.
    int n = 0, chunk = 0;
    int32_t row = -1;
    float weight = 0.f;
    __nv_bfloat16* out = nullptr;
    const int chunks = (H + kCols - 1) / kCols;
    const auto issue = [&](int64_t q) -> bool {  // false: no token left
      if (chunk == 0) {
        const StagedToken token = next();
        if (token.done) return false;
        const unsigned valid = __ballot_sync(0xffffffffu, lane < k && token.row >= 0);
        n = __popc(valid);
        const int from = lane < n ? static_cast<int>(__fns(valid, 0, lane + 1)) : lane;
        row = __shfl_sync(0xffffffffu, token.row, from);
        weight = __shfl_sync(0xffffffffu, token.weight, from);
        out = token.out;
      }
      const int st = static_cast<int>(q % kStages);
      const int c0 = chunk * kCols;
      const int cols = H - c0 < kCols ? H - c0 : kCols;
      if (lane == 0) {
        stage_out[st] = out + c0;
        stage_n[st] = n;
        stage_cols[st] = cols;
        sm90::mbarrier_arrive_expect_tx(full + st, static_cast<uint32_t>(n * cols * 2));
      }
      if (lane < n) stage_w[st * kMaxRows + lane] = weight;
      __syncwarp();
      if (lane < n) {
        sm90::bulk_load_1d(tiles + st * kStageBytes + lane * kPieceBytes,
                           rows + int64_t(row) * H + c0, static_cast<uint32_t>(cols * 2),
                           full + st);
      }
      if (++chunk == chunks) chunk = 0;
      return true;
    };

    int64_t issued = 0, summed = 0;
    bool more = true;
    while (true) {
      while (more && issued - summed < kStages) {
        more = issue(issued);
        issued += more;
      }
      if (summed == issued) break;
      const int st = static_cast<int>(summed % kStages);
      sm90::mbarrier_wait(full + st, static_cast<uint32_t>((summed / kStages) & 1));
      if (lane * 8 < stage_cols[st]) {
        float acc[8] = {};
        const int rows_here = stage_n[st];
        for (int j = 0; j < rows_here; ++j) {
          const uint4 v = *reinterpret_cast<const uint4*>(tiles + st * kStageBytes +
                                                          j * kPieceBytes + lane * 16);
          fma_row(acc, stage_w[st * kMaxRows + j], v);
        }
        *reinterpret_cast<uint4*>(stage_out[st] + lane * 8) = pack_row(acc);
      }
      __syncwarp();  // every lane's reads of the stage before its next copy
      ++summed;
    }
  }
};

}  // namespace megamoe::ep
