// The M-grouped tile scheduler's expert search (kernels/sm90/tile_scheduler.cuh), callable on
// the host too, so that the CPU tests check it against a plain search.
#pragma once

#include <cuda_runtime_api.h>

namespace megamoe {

// The last expert e in [0, num_experts) with tile_offsets[e] <= m_tile, where load(e) reads
// tile_offsets[e]: nondecreasing, tile_offsets[0] = 0 <= m_tile. Experts without tiles share
// their successor's offset, so the answer is the expert that holds M-tile m_tile.
//
// Both consumer warpgroups of a grouped GEMM search at the top of every tile with the
// tensor cores idle, so each round makes kProbes loads that do not depend on each other
// rather than one load a step: 128 experts take two rounds where a binary search takes
// seven dependent loads. The probes that hold form a prefix (the offsets are sorted), and
// the answer stays in [lo, hi].
template <int kProbes = 16, class Load>
__host__ __device__ __forceinline__ int last_expert_at_most(const Load& load, int num_experts,
                                                            int m_tile) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int step = (hi - lo + kProbes) / (kProbes + 1);  // >= 1, and lo + step <= hi
    int below = 0;  // probes j (at lo + (j + 1) * step, at most hi) with an offset <= m_tile
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int j = 0; j < kProbes; ++j) {
      const int e = lo + (j + 1) * step < hi ? lo + (j + 1) * step : hi;
      below += load(e) <= m_tile;
    }
    // Probes clamped to hi all hold or all fail, so the prefix is still a prefix.
    const int next_lo = below == 0 ? lo : (lo + below * step < hi ? lo + below * step : hi);
    if (below < kProbes) {
      const int fail = lo + (below + 1) * step;  // the first probe that failed, unclamped
      hi = (fail < hi + 1 ? fail : hi + 1) - 1;
    }
    lo = next_lo;
  }
  return lo;
}

}  // namespace megamoe
