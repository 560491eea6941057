// Routing plan on the device (contract in routing_plan.h). Three launches on the stream,
// two when hist is small (kFusedScanEntries): then each plan_scatter block computes what
// plan_scan would give it from the whole of hist, and block 0 writes the counts and offsets.
//
//  1. plan_hist:    block b counts the slots of its span [b*span, (b+1)*span) per expert
//                   -> hist[b][e] (scratch), and its invalid ids -> bad[b].
//  2. plan_scan:    one block: counts[e] = sum_b hist[b][e], then the expert and tile
//                   offsets (exclusive scans over e), then in place
//                   hist[b][e] <- expert_offsets[e] + sum_{b' < b} hist[b'][e],
//                   the first sorted row of expert e that block b owns.
//  3. plan_scatter: block b walks its span again in tiles of warps x 128 slots. Each warp
//                   counts its 128 slots per expert (peers from __match_any_sync), the
//                   block scans those counts across warps in warp order on top of a running
//                   row per expert, and each warp then ranks its slots: the rank of a slot
//                   is the number of same-expert slots before it in lower lanes of the same
//                   item, earlier items of the warp, lower warps of the tile, earlier tiles,
//                   earlier blocks and lower experts. So row = stable position of the slot,
//                   exactly a stable argsort by expert. Rows >= N of the span get -1.
//
// Determinism: every value written is an exact integer function of the ids. The only
// atomics are integer shared-memory additions into per-block counts (commutative, so the
// sums do not depend on their order); ranks come from ballots, popcounts and sequential
// scans in fixed order, never from atomic return values.
#include "kernels/common/routing_plan.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe {
namespace {

constexpr int kItems = 4;                        // slots per lane per tile
constexpr int kSlotsPerWarp = 32 * kItems;       // slots per warp per tile
constexpr int kMaxWarps = 8;                     // warps per block of hist / scatter
constexpr int64_t kSmemInts = 48 * 1024 / 4;     // default dynamic shared memory, in ints
constexpr int64_t kMaxHistEntries = 1 << 17;     // bound on blocks * E (scan cost)
constexpr int kScanThreads = 1024;
constexpr int kScanBatch = 16;                   // hist loads in flight per scan thread
// Largest blocks * E for which each scatter block scans hist itself instead of plan_scan
// (every block then reads all of hist: 8 MB from L2 at 131072 slots and 128 experts).
constexpr int64_t kFusedScanEntries = 1 << 14;

constexpr int32_t kKeyNone = -1;     // id -1: no expert
constexpr int32_t kKeyInvalid = -2;  // id < -1 or >= E: no expert, counted
constexpr int32_t kKeyOutside = -3;  // lane past the end of the span

static_assert(kMaxWarps * 32 <= 1024);

// Launch shape: a pure function of (n, E), so the scratch size is too.
struct PlanConfig {
  int warps;       // warps per block (hist and scatter)
  int64_t tile;    // slots per tile = warps * kSlotsPerWarp
  int64_t span;    // slots per block, a multiple of tile
  int64_t blocks;  // ceil(n / span); 0 when n = 0
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

PlanConfig plan_config(int64_t n, int64_t E) {
  PlanConfig c{};
  // The scatter block keeps (warps + 1) rows of E ints in shared memory.
  c.warps = static_cast<int>(std::min<int64_t>(kMaxWarps, kSmemInts / E - 1));
  c.tile = c.warps * int64_t{kSlotsPerWarp};
  if (n == 0) {
    c.span = c.tile;
    c.blocks = 0;
    return c;
  }
  const int64_t tiles = ceil_div(n, c.tile);
  const int64_t max_blocks = std::max<int64_t>(1, kMaxHistEntries / E);
  c.span = ceil_div(tiles, max_blocks) * c.tile;
  c.blocks = ceil_div(n, c.span);
  return c;
}

void check_experts(int64_t E) {
  if (E < 1 || E > kRoutingPlanMaxExperts) {
    throw_invalid("build_routing_plan: num_experts: expected a value in [1, " +
                  std::to_string(kRoutingPlanMaxExperts) + "], got " + std::to_string(E));
  }
}

template <class Id>
__device__ __forceinline__ int32_t classify(Id id, int32_t E) {
  if (id >= 0 && id < static_cast<Id>(E)) return static_cast<int32_t>(id);
  return id == Id(-1) ? kKeyNone : kKeyInvalid;
}

// keys[it] for slot first + 32 * it (first = this lane's slot of item 0).
template <class Id>
__device__ __forceinline__ void load_keys(const Id* __restrict__ ids, int64_t first, int64_t end,
                                          int32_t E, int32_t (&keys)[kItems]) {
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int64_t s = first + 32 * it;
    keys[it] = s < end ? classify(__ldg(ids + s), E) : kKeyOutside;
  }
}

template <class Id>
__global__ void __launch_bounds__(kMaxWarps * 32)
    plan_hist_kernel(const Id* __restrict__ ids, int64_t n, int32_t E, int64_t span,
                     int32_t* __restrict__ hist, int32_t* __restrict__ bad) {
  extern __shared__ int32_t count[];  // [E]
  __shared__ int32_t block_bad;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += blockDim.x) count[e] = 0;
  if (tid == 0) block_bad = 0;
  __syncthreads();

  const int64_t begin = blockIdx.x * span;
  const int64_t end = min(n, begin + span);
  const int64_t tile = (blockDim.x >> 5) * int64_t{kSlotsPerWarp};
  int32_t nbad = 0;
  for (int64_t t0 = begin; t0 < end; t0 += tile) {
    int32_t keys[kItems];
    load_keys(ids, t0 + warp * kSlotsPerWarp + lane, end, E, keys);
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      // One shared atomic per (warp, item, expert present) rather than per slot: all
      // slots to one expert would otherwise serialize on one address.
      const uint32_t peers = __match_any_sync(0xffffffffu, keys[it]);
      if (keys[it] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&count[keys[it]], __popc(peers));
      nbad += keys[it] == kKeyInvalid;
    }
  }
  nbad = __reduce_add_sync(0xffffffffu, nbad);
  if (lane == 0 && nbad != 0) atomicAdd(&block_bad, nbad);
  __syncthreads();
  int32_t* out = hist + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = tid; e < E; e += blockDim.x) out[e] = count[e];
  if (tid == 0) bad[blockIdx.x] = block_bad;
}

// Exclusive scan of one value per thread over the block (a multiple of 32 threads, at most
// 1024); `total` gets the sum. Starts with a barrier, so `warp_sums` (32 ints) may be reused
// by consecutive calls.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t v, int32_t* warp_sums,
                                                        int32_t& total) {
  const int kWarps = static_cast<int>(blockDim.x >> 5);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  __syncthreads();
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < kWarps) warp_sums[lane] = w;
  }
  __syncthreads();
  total = warp_sums[kWarps - 1];
  return (warp == 0 ? 0 : warp_sums[warp - 1]) + x - v;
}

__device__ __forceinline__ int32_t tiles_of(int32_t count, int32_t block_m) {
  return count / block_m + (count % block_m != 0);
}

// How many contiguous shares of the blocks each hist column is summed in by `threads`
// threads, one (share, expert) a thread (plan_scan and scan_in_block).
__host__ __device__ inline int scan_parts(int32_t E, int threads, int32_t blocks) {
  return max(1, min(threads / E, blocks));
}

// The first block of part p of the `parts` contiguous shares of [0, blocks).
__device__ __forceinline__ int part_first_block(int p, int32_t blocks, int parts) {
  return static_cast<int>(int64_t{p} * blocks / parts);
}

// Column e of hist at blocks b .. b + kScanBatch - 1, 0 from block b1 on: all of the batch's
// loads in flight before any is used.
__device__ __forceinline__ void load_hist_batch(const int32_t* hist, int32_t E, int e, int b,
                                                int b1, int32_t (&c)[kScanBatch]) {
#pragma unroll
  for (int u = 0; u < kScanBatch; ++u) {
    c[u] = b + u < b1 ? hist[static_cast<int64_t>(b + u) * E + e] : 0;
  }
}

// Column e of hist summed over part p's share of the blocks (the parts split [0, blocks)
// into contiguous shares): `all` over the share, `before` over its blocks below `below`.
// kScanBatch loads in flight; a warp's loads are coalesced across experts.
struct ColumnSums {
  int32_t before, all;
};
__device__ __forceinline__ ColumnSums sum_hist_column(const int32_t* hist, int32_t E, int e,
                                                      int32_t blocks, int p, int parts,
                                                      int below) {
  const int b1 = part_first_block(p + 1, blocks, parts);
  ColumnSums sums{0, 0};
  for (int b = part_first_block(p, blocks, parts); b < b1; b += kScanBatch) {
    int32_t c[kScanBatch];
    load_hist_batch(hist, E, e, b, b1, c);
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      sums.all += c[u];
      sums.before += b + u < below ? c[u] : 0;
    }
  }
  return sums;
}

// Exclusive scans over the experts of count[e] (shared memory) and of its M-tiles of
// block_m rows, thread tid owning the contiguous experts [e0, e1): visit(e, count[e], first
// row, first tile) for each, then c_total and t_total get the rows and tiles of all. visit
// may overwrite count[e] (it is read first).
template <class Visit>
__device__ __forceinline__ void scan_experts(const int32_t* count, int32_t E, int32_t block_m,
                                             int32_t* warp_sums, int32_t& c_total,
                                             int32_t& t_total, const Visit& visit) {
  const int per = (E + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int e0 = min(E, static_cast<int>(threadIdx.x) * per), e1 = min(E, e0 + per);
  int32_t c_sum = 0, t_sum = 0;
  for (int e = e0; e < e1; ++e) {
    c_sum += count[e];
    t_sum += tiles_of(count[e], block_m);
  }
  int32_t c_run = block_exclusive_scan(c_sum, warp_sums, c_total);
  int32_t t_run = block_exclusive_scan(t_sum, warp_sums, t_total);
  for (int e = e0; e < e1; ++e) {
    const int32_t c = count[e];
    visit(e, c, c_run, t_run);
    c_run += c;
    t_run += tiles_of(c, block_m);
  }
}

// One block. `parts` splits the blocks of each expert column among threads:
// thread work item i = (part p, expert e) covers hist rows [p*blocks/parts, (p+1)*blocks/parts).
__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(int32_t* __restrict__ hist, const int32_t* __restrict__ bad,
                     int32_t blocks, int32_t E, int32_t parts, int32_t block_m,
                     RoutingPlan plan) {
  extern __shared__ int32_t smem[];
  int32_t* partial = smem;          // [parts][E]
  int32_t* base = smem + parts * E; // [E]: counts, then expert offsets
  __shared__ int32_t warp_sums[32];
  const int tid = threadIdx.x;

  int32_t nbad = 0;
  for (int b = tid; b < blocks; b += kScanThreads) nbad += bad[b];
  int32_t total_bad = 0;
  (void)block_exclusive_scan(nbad, warp_sums, total_bad);
  if (tid == 0) *plan.invalid_count = total_bad;

  // 1. Partial sums per (part, expert).
  for (int i = tid; i < parts * E; i += kScanThreads) {
    const int p = i / E, e = i - p * E;
    partial[i] = sum_hist_column(hist, E, e, blocks, p, parts, 0).all;
  }
  __syncthreads();
  // 2. Exclusive scan over parts per expert; the totals are the counts.
  for (int e = tid; e < E; e += kScanThreads) {
    int32_t s = 0;
    for (int p = 0; p < parts; ++p) {
      const int32_t c = partial[p * E + e];
      partial[p * E + e] = s;
      s += c;
    }
    base[e] = s;
    plan.expert_counts[e] = s;
  }
  __syncthreads();
  // 3. Exclusive scans over experts.
  int32_t c_total = 0, t_total = 0;
  scan_experts(base, E, block_m, warp_sums, c_total, t_total,
               [&](int e, int32_t, int32_t first_row, int32_t first_tile) {
                 plan.expert_offsets[e] = first_row;
                 plan.tile_offsets[e] = first_tile;
                 base[e] = first_row;
               });
  if (tid == 0) {
    plan.expert_offsets[E] = c_total;
    plan.tile_offsets[E] = t_total;
  }
  __syncthreads();
  // 4. In place: hist[b][e] <- first sorted row of expert e owned by block b.
  for (int i = tid; i < parts * E; i += kScanThreads) {
    const int p = i / E, e = i - p * E;
    const int b1 = part_first_block(p + 1, blocks, parts);
    int32_t s = base[e] + partial[i];
    for (int b = part_first_block(p, blocks, parts); b < b1; b += kScanBatch) {
      // All loads of the batch before its stores: the compiler cannot tell the rows apart.
      int32_t c[kScanBatch];
      load_hist_batch(hist, E, e, b, b1, c);
#pragma unroll
      for (int u = 0; u < kScanBatch; ++u) {
        if (b + u < b1) hist[static_cast<int64_t>(b + u) * E + e] = s;
        s += c[u];
      }
    }
  }
}

// plan_scan's results for block blockIdx.x of the scatter, computed by that block itself
// from the whole of `hist` (every block the same integers; block 0 writes the plan's counts
// and offsets): run[e] = its first sorted row of expert e. Returns N. For a small hist
// (kFusedScanEntries), where reading all of it per block costs less than the scan's
// launch of one block, and E at most the block's threads. Shared memory: `total` [E] and
// `scratch` [scan_in_block_ints(E, threads, blocks)] (dynamic, so that the kernel's other
// launches keep their 48 KB for E up to kRoutingPlanMaxExperts).
__host__ __device__ inline int64_t scan_in_block_ints(int32_t E, int threads, int32_t blocks) {
  return 2 * int64_t{scan_parts(E, threads, blocks)} * E + 32;
}
__device__ int32_t scan_in_block(const int32_t* __restrict__ hist, const int32_t* __restrict__ bad,
                                 int32_t blocks, int32_t E, int32_t block_m, int32_t* run,
                                 int32_t* total, int32_t* scratch, RoutingPlan& plan) {
  const int tid = threadIdx.x, threads = blockDim.x;
  const int parts = scan_parts(E, threads, blocks);
  int32_t* part_before = scratch;              // [parts][E]
  int32_t* part_total = scratch + parts * E;   // [parts][E]
  int32_t* warp_sums = part_total + parts * E; // [32]
  // Per (part, expert): the counts of the blocks before this one and of all.
  for (int i = tid; i < parts * E; i += threads) {
    const int p = i / E, e = i - p * E;
    const ColumnSums sums = sum_hist_column(hist, E, e, blocks, p, parts, blockIdx.x);
    part_before[i] = sums.before;
    part_total[i] = sums.all;
  }
  __syncthreads();
  for (int e = tid; e < E; e += threads) {
    int32_t before = 0, all = 0;
    for (int p = 0; p < parts; ++p) {
      before += part_before[p * E + e];
      all += part_total[p * E + e];
    }
    run[e] = before;
    total[e] = all;
  }
  __syncthreads();
  int32_t c_total = 0, t_total = 0;
  const bool writer = blockIdx.x == 0;
  scan_experts(total, E, block_m, warp_sums, c_total, t_total,
               [&](int e, int32_t count, int32_t first_row, int32_t first_tile) {
                 run[e] += first_row;
                 if (writer) {
                   plan.expert_counts[e] = count;
                   plan.expert_offsets[e] = first_row;
                   plan.tile_offsets[e] = first_tile;
                 }
               });
  if (writer) {
    int32_t nbad = 0;
    for (int b = tid; b < blocks; b += threads) nbad += bad[b];
    int32_t total_bad = 0;
    (void)block_exclusive_scan(nbad, warp_sums, total_bad);
    if (tid == 0) {
      *plan.invalid_count = total_bad;
      plan.expert_offsets[E] = c_total;
      plan.tile_offsets[E] = t_total;
    }
  }
  __syncthreads();
  return c_total;
}

// fused_scan: the block computes its first rows itself (scan_in_block) from hist; else
// first_row = hist as plan_scan left it.
template <class Id>
__global__ void __launch_bounds__(kMaxWarps * 32)
    plan_scatter_kernel(const Id* __restrict__ ids, int64_t n, int32_t k, int32_t E,
                        int64_t span, const int32_t* __restrict__ first_row,
                        RoutingPlan plan, bool fused_scan, const int32_t* __restrict__ bad,
                        int32_t blocks, int32_t block_m) {
  extern __shared__ int32_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = blockDim.x >> 5;
  int32_t* run = smem;                // [E]: next row of each expert for this block
  int32_t* warp_rows = smem + E;      // [warps][E]: per-warp counts, then first rows
  int32_t* mine = warp_rows + warp * E;

  const int64_t begin = blockIdx.x * span;
  const int64_t end = min(n, begin + span);
  int64_t num_valid;
  if (fused_scan) {
    num_valid = scan_in_block(first_row, bad, blocks, E, block_m, run, warp_rows,
                              warp_rows + warps * E, plan);
  } else {
    num_valid = plan.expert_offsets[E];
    for (int e = tid; e < E; e += blockDim.x) {
      run[e] = first_row[static_cast<int64_t>(blockIdx.x) * E + e];
    }
  }
  // Rows >= N of this span: no pair lands there.
  for (int64_t r = max(begin, num_valid) + tid; r < end; r += blockDim.x) {
    plan.row_token[r] = -1;
    plan.row_slot[r] = -1;
  }

  const uint32_t lower = (1u << lane) - 1u;
  const int64_t tile = warps * int64_t{kSlotsPerWarp};
  for (int64_t t0 = begin; t0 < end; t0 += tile) {
    const int64_t first = t0 + warp * kSlotsPerWarp + lane;
    int32_t keys[kItems];
    uint32_t peers[kItems];
    load_keys(ids, first, end, E, keys);
    for (int e = lane; e < E; e += 32) mine[e] = 0;
    __syncwarp();
    // Count this warp's slots per expert (the lowest lane of each group adds its size).
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      peers[it] = __match_any_sync(0xffffffffu, keys[it]);
      if (keys[it] >= 0 && lane == __ffs(peers[it]) - 1) mine[keys[it]] += __popc(peers[it]);
      __syncwarp();
    }
    __syncthreads();
    // Per expert, in warp order: each warp's first row, and the block's next row.
    for (int e = tid; e < E; e += blockDim.x) {
      int32_t s = run[e];
      for (int w = 0; w < warps; ++w) {
        const int32_t c = warp_rows[w * E + e];
        warp_rows[w * E + e] = s;
        s += c;
      }
      run[e] = s;
    }
    __syncthreads();
    // Rank: items in order, lanes in order inside an item.
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int32_t key = keys[it];
      const bool leader = key >= 0 && lane == __ffs(peers[it]) - 1;
      int32_t row = 0;
      if (key >= 0) row = mine[key] + __popc(peers[it] & lower);
      __syncwarp();
      if (leader) mine[key] = row + __popc(peers[it]);  // the leader's rank is 0
      __syncwarp();
      const int64_t s = first + 32 * it;
      if (key >= 0) {
        const auto slot = static_cast<int32_t>(s);
        plan.row_token[row] = slot / k;
        plan.row_slot[row] = slot;
        plan.slot_row[slot] = row;
      } else if (key != kKeyOutside) {
        plan.slot_row[s] = -1;
      }
    }
    // No barrier needed before the next tile: a warp only touches its own row of
    // warp_rows outside the two barriers above, and `run` only between them.
  }
}

template <class Id>
void launch_plan(const Id* ids, int64_t n, int64_t k, int32_t E, int32_t block_m,
                 const RoutingPlan& plan, int32_t* scratch, cudaStream_t stream) {
  const PlanConfig c = plan_config(n, E);
  int32_t* hist = scratch;                              // [blocks][E]
  int32_t* bad = scratch ? scratch + c.blocks * E : nullptr;  // [blocks]
  const int threads = c.warps * 32;
  const auto blocks = static_cast<int32_t>(c.blocks);
  if (blocks > 0) {
    plan_hist_kernel<Id><<<blocks, threads, E * sizeof(int32_t), stream>>>(ids, n, E, c.span,
                                                                             hist, bad);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  }
  const bool fused_scan = blocks > 0 && c.blocks * E <= kFusedScanEntries && E <= threads;
  if (!fused_scan) {
    const int parts = scan_parts(E, kScanThreads, blocks);
    const size_t scan_smem = static_cast<size_t>(parts + 1) * E * sizeof(int32_t);
    plan_scan_kernel<<<1, kScanThreads, scan_smem, stream>>>(hist, bad, blocks, E, parts,
                                                             block_m, plan);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  }
  if (blocks > 0) {
    const int64_t ints = (c.warps + 1) * int64_t{E} +
                         (fused_scan ? scan_in_block_ints(E, threads, blocks) : 0);
    const size_t smem = static_cast<size_t>(ints) * sizeof(int32_t);
    plan_scatter_kernel<Id><<<blocks, threads, smem, stream>>>(
        ids, n, static_cast<int32_t>(k), E, c.span, hist, plan, fused_scan, bad, blocks,
        block_m);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  }
}

bool misaligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment != 0;
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&plan_scan_kernel);

}  // namespace

size_t routing_plan_scratch_bytes(int64_t num_slots, int64_t num_experts) {
  check_experts(num_experts);
  if (num_slots < 0 || num_slots > INT32_MAX) {
    throw_invalid("routing_plan_scratch_bytes: num_slots: expected a value in [0, 2147483647], "
                  "got " + std::to_string(num_slots));
  }
  const PlanConfig c = plan_config(num_slots, num_experts);
  return static_cast<size_t>(c.blocks * (num_experts + 1)) * sizeof(int32_t);
}

RoutingPlanWorkspace carve_routing_plan(WorkspaceCarver& carver, int64_t num_slots,
                                        int64_t num_experts) {
  RoutingPlanWorkspace w{};
  w.plan.expert_counts = carver.take<int32_t>(num_experts);
  w.plan.expert_offsets = carver.take<int32_t>(num_experts + 1);
  w.plan.tile_offsets = carver.take<int32_t>(num_experts + 1);
  w.plan.row_token = carver.take<int32_t>(num_slots);
  w.plan.row_slot = carver.take<int32_t>(num_slots);
  w.plan.slot_row = carver.take<int32_t>(num_slots);
  w.plan.invalid_count = carver.take<int32_t>(1);
  w.scratch = carver.take<char>(
      static_cast<int64_t>(routing_plan_scratch_bytes(num_slots, num_experts)));
  return w;
}

void build_routing_plan(const void* topk_ids, bool ids_are_int64, int64_t T, int64_t k, int64_t E,
                        int32_t block_m, const RoutingPlan& plan, void* scratch,
                        cudaStream_t stream) {
  check_experts(E);
  if (T < 0) throw_invalid("build_routing_plan: T: expected >= 0, got " + std::to_string(T));
  if (k < 1) throw_invalid("build_routing_plan: k: expected >= 1, got " + std::to_string(k));
  if (T > INT32_MAX / k) {
    throw_invalid("build_routing_plan: T*k = " + std::to_string(T) + "*" + std::to_string(k) +
                  " slots, expected fewer than 2^31");
  }
  if (block_m < 1) {
    throw_invalid("build_routing_plan: block_m: expected >= 1, got " + std::to_string(block_m));
  }
  const int64_t n = T * k;
  if (!plan.expert_counts || !plan.expert_offsets || !plan.tile_offsets || !plan.invalid_count) {
    throw_invalid("build_routing_plan: plan.expert_counts, expert_offsets, tile_offsets and "
                  "invalid_count must all be non-null");
  }
  if (n > 0) {
    if (!topk_ids) throw_invalid("build_routing_plan: topk_ids is null");
    if (!plan.row_token || !plan.row_slot || !plan.slot_row) {
      throw_invalid("build_routing_plan: plan.row_token, row_slot and slot_row must all be "
                    "non-null when T*k > 0");
    }
    if (!scratch) throw_invalid("build_routing_plan: scratch is null");
    if (misaligned(topk_ids, ids_are_int64 ? 8 : 4)) {
      throw_invalid("build_routing_plan: topk_ids is not aligned to its element size");
    }
    if (misaligned(scratch, 4)) throw_invalid("build_routing_plan: scratch is not 4-byte aligned");
  }
  auto* s = static_cast<int32_t*>(scratch);
  const auto experts = static_cast<int32_t>(E);
  if (ids_are_int64) {
    launch_plan(static_cast<const int64_t*>(topk_ids), n, k, experts, block_m, plan, s, stream);
  } else {
    launch_plan(static_cast<const int32_t*>(topk_ids), n, k, experts, block_m, plan, s, stream);
  }
}

}  // namespace megamoe
