// Steps 1-3 of an expert-parallel call (ep_layer.h lists them all): the local routing plan
// and the token plan, the counts exchange, and the layout with the capacity verdict.
#include <string>

#include "comm/ep_phases.h"
#include "comm/peer_sync.cuh"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/sm90/gemm.h"

namespace megamoe::ep {
namespace {

// 1. The token plan, after the local routing plan: which ranks each token goes to (the
// owners of its valid slots) and its place among this rank's tokens sent to each of them,
// tokens in order: token_pos [T, W] (-1: not sent), token_count [W]. Two passes over
// blocks of kPlanThreads tokens, one token a thread: the destination masks and each
// block's count per rank, then each token's place (earlier blocks' counts + a ballot
// prefix within the block).

template <class Id>
__device__ __forceinline__ uint32_t destinations(const Id* topk_ids, const int32_t* slot_row,
                                                 int64_t t, int32_t k, int32_t experts_per_rank,
                                                 int32_t world) {
  uint32_t mask = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t id = static_cast<int64_t>(topk_ids[t * k + j]);
    const int64_t owner = id / experts_per_rank;
    if (slot_row[t * k + j] >= 0 && owner >= 0 && owner < world) mask |= 1u << owner;
  }
  return mask;
}

// For rank d of the mask bits of this block's tokens: each token's place within the block
// (ballot prefix per warp plus earlier warps' totals) and the block's total.
__device__ __forceinline__ void block_places(uint32_t mask, int world, int32_t* place,
                                             int32_t* block_total) {
  __shared__ int32_t warp_totals[comm::kMaxRanks][kPlanThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int d = 0; d < comm::kMaxRanks; ++d) {
    if (d >= world) break;
    const uint32_t ballot = __ballot_sync(0xffffffffu, (mask >> d) & 1);
    place[d] = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0) warp_totals[d][warp] = __popc(ballot);
  }
  __syncthreads();
#pragma unroll
  for (int d = 0; d < comm::kMaxRanks; ++d) {
    if (d >= world) break;
    int32_t before = 0, total = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      before += w < warp ? warp_totals[d][w] : 0;
      total += warp_totals[d][w];
    }
    place[d] += before;
    block_total[d] = total;
  }
}

template <class Id>
__global__ void __launch_bounds__(kPlanThreads)
    token_count_kernel(const Id* __restrict__ topk_ids, const int32_t* __restrict__ slot_row,
                       int64_t T, int32_t k, int32_t experts_per_rank, int32_t world,
                       int32_t* __restrict__ block_counts) {  // [blocks, W]
  const int64_t t = blockIdx.x * int64_t(kPlanThreads) + threadIdx.x;
  const uint32_t mask = t < T ? destinations(topk_ids, slot_row, t, k, experts_per_rank, world) : 0;
  int32_t place[comm::kMaxRanks], total[comm::kMaxRanks];
  block_places(mask, world, place, total);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int d = 0; d < comm::kMaxRanks; ++d) {
      if (d < world) block_counts[blockIdx.x * world + d] = total[d];
    }
  }
}

template <class Id>
__global__ void __launch_bounds__(kPlanThreads)
    token_pos_kernel(const Id* __restrict__ topk_ids, const int32_t* __restrict__ slot_row,
                     int64_t T, int32_t k, int32_t experts_per_rank, int32_t world,
                     const int32_t* __restrict__ block_counts, int32_t* __restrict__ token_pos,
                     int32_t* __restrict__ token_count) {
  __shared__ int32_t base[comm::kMaxRanks];
  if (threadIdx.x < world) {  // earlier blocks' tokens for rank d; the last block: all
    int32_t before = 0;
    for (int b = 0; b < blockIdx.x; ++b) before += block_counts[b * world + threadIdx.x];
    base[threadIdx.x] = before;
    if (blockIdx.x == gridDim.x - 1) {
      token_count[threadIdx.x] = before + block_counts[blockIdx.x * world + threadIdx.x];
    }
  }
  const int64_t t = blockIdx.x * int64_t(kPlanThreads) + threadIdx.x;
  const uint32_t mask = t < T ? destinations(topk_ids, slot_row, t, k, experts_per_rank, world) : 0;
  int32_t place[comm::kMaxRanks], total[comm::kMaxRanks];
  block_places(mask, world, place, total);  // (its __syncthreads also orders `base`)
  if (t >= T) return;
#pragma unroll
  for (int d = 0; d < comm::kMaxRanks; ++d) {
    if (d < world) token_pos[t * world + d] = (mask >> d) & 1 ? base[d] + place[d] : -1;
  }
}

// The overlapped forward's layout (own_first): every owner puts the rows it owns for itself
// first (expert-sorted, rows 0..), then the peers' rows (expert-sorted, sources in rank
// order), so that the own rows form a plan of their own that L1 and L2 can run on before
// any peer row has arrived. A row's results do not depend on where it sits, so y keeps its
// bits. This rank's two plans: the own rows' (own_*) and the peers' (peer_*, whose expert
// offsets start after the own rows; tiles numbered from 0 in each plan). A saved h stays in
// the default layout, where the backward reads it: per local expert e, the own rows (source
// this rank) sit after the rows of the lower sources there, and the peers' rows of sources
// below this rank keep their order while those above it come after the own rows; so L1 on
// the own plan shifts every row by one amount, and on the peers' plan by one amount below
// the split (the first row of a source above this rank) and another from it on.
struct OwnFirstPlans {
  int32_t* own_expert_offsets = nullptr;  // null: the default layout
  int32_t* own_tile_offsets = nullptr;
  int32_t* peer_expert_offsets = nullptr;
  int32_t* peer_tile_offsets = nullptr;
  int32_t* own_h_shift = nullptr;  // [E/W] each, as sm90::HRowShift reads them
  int32_t* peer_h_shift_lo = nullptr;
  int32_t* peer_h_shift_hi = nullptr;
  int32_t* peer_h_split = nullptr;
};

// 3. From the [W, E] counts of this exchange: this rank's receive offsets per local
// expert (sources in rank order), where this rank's rows of each global expert start in
// its owner's receive area, and the capacity check (every rank reaches the same verdict).
// With own_first plans: that layout instead, every rank computing every owner's alike.
__global__ void __launch_bounds__(1024)
    layout_kernel(const __grid_constant__ comm::PeerTable peers, int32_t num_experts,
                  int32_t experts_per_rank, int64_t capacity, int32_t* recv_expert_offsets,
                  int32_t* recv_tile_offsets, int32_t* send_base, int32_t* skip,
                  int32_t* error, OwnFirstPlans own_first) {
  extern __shared__ int32_t totals[];  // [E]: rows of each global expert, all sources
  __shared__ int over_capacity;
  char* own = peers.buffers[peers.rank];
  const uint32_t generation =
      reinterpret_cast<const uint32_t*>(own + comm::ControlLayout::kGeneration)[int(comm::Phase::kCounts)];
  const int32_t* counts = comm::ControlLayout::counts(own, num_experts, generation);
  if (threadIdx.x == 0) over_capacity = 0;
  for (int g = threadIdx.x; g < num_experts; g += blockDim.x) {
    int32_t total = 0;
    for (int s = 0; s < peers.world_size; ++s) total += counts[s * num_experts + g];
    totals[g] = total;
  }
  __syncthreads();
  const bool by_own_first = own_first.own_expert_offsets != nullptr;
  for (int g = threadIdx.x; g < num_experts; g += blockDim.x) {
    const int owner = g / experts_per_rank;
    const int first = owner * experts_per_rank;
    const int last = first + experts_per_rank;
    int32_t base = 0;
    if (!by_own_first) {
      for (int e = first; e < g; ++e) base += totals[e];
      for (int s = 0; s < peers.rank; ++s) base += counts[s * num_experts + g];
    } else if (owner == peers.rank) {  // among the owner's own rows
      for (int e = first; e < g; ++e) base += counts[owner * num_experts + e];
    } else {  // after all of the owner's own rows, among its peers' rows
      for (int e = first; e < last; ++e) base += counts[owner * num_experts + e];
      for (int e = first; e < g; ++e) base += totals[e] - counts[owner * num_experts + e];
      for (int s = 0; s < peers.rank; ++s) {
        if (s != owner) base += counts[s * num_experts + g];
      }
    }
    send_base[g] = base;
  }
  if (threadIdx.x < peers.world_size) {
    int64_t rows = 0;
    for (int e = 0; e < experts_per_rank; ++e) rows += totals[threadIdx.x * experts_per_rank + e];
    if (rows > capacity) {
      comm::record_failure(error, comm::error_code(comm::Phase::kCapacity, threadIdx.x));
      over_capacity = 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *skip = over_capacity;
    int32_t offset = 0, tiles = 0;
    for (int e = 0; e < experts_per_rank; ++e) {
      recv_expert_offsets[e] = offset;
      recv_tile_offsets[e] = tiles;
      const int32_t n = over_capacity ? 0 : totals[peers.rank * experts_per_rank + e];
      offset += n;
      tiles += (n + sm90::kGemmBlockM - 1) / sm90::kGemmBlockM;
    }
    recv_expert_offsets[experts_per_rank] = offset;
    recv_tile_offsets[experts_per_rank] = tiles;
    if (by_own_first) {
      const int first = peers.rank * experts_per_rank;
      int32_t own_rows = 0, own_tiles = 0;
      for (int e = 0; e < experts_per_rank; ++e) {
        own_first.own_expert_offsets[e] = own_rows;
        own_first.own_tile_offsets[e] = own_tiles;
        const int32_t n = over_capacity ? 0 : counts[peers.rank * num_experts + first + e];
        own_rows += n;
        own_tiles += (n + sm90::kGemmBlockM - 1) / sm90::kGemmBlockM;
      }
      own_first.own_expert_offsets[experts_per_rank] = own_rows;
      own_first.own_tile_offsets[experts_per_rank] = own_tiles;
      int32_t peer_rows = own_rows, peer_tiles = 0;
      for (int e = 0; e < experts_per_rank; ++e) {
        own_first.peer_expert_offsets[e] = peer_rows;
        own_first.peer_tile_offsets[e] = peer_tiles;
        const int32_t n =
            over_capacity ? 0
                          : totals[first + e] - counts[peers.rank * num_experts + first + e];
        peer_rows += n;
        peer_tiles += (n + sm90::kGemmBlockM - 1) / sm90::kGemmBlockM;
      }
      own_first.peer_expert_offsets[experts_per_rank] = peer_rows;
      own_first.peer_tile_offsets[experts_per_rank] = peer_tiles;
      for (int e = 0; e < experts_per_rank; ++e) {
        // Unread when the call is skipped (over capacity): no plan then has a row.
        int32_t below = 0;  // rows of expert e from the sources below this rank
        for (int s = 0; s < peers.rank; ++s) below += counts[s * num_experts + first + e];
        const int32_t own_n = counts[peers.rank * num_experts + first + e];
        own_first.own_h_shift[e] = recv_expert_offsets[e] + below - own_first.own_expert_offsets[e];
        const int32_t lo = recv_expert_offsets[e] - own_first.peer_expert_offsets[e];
        own_first.peer_h_shift_lo[e] = lo;
        own_first.peer_h_shift_hi[e] = lo + own_n;
        own_first.peer_h_split[e] = own_first.peer_expert_offsets[e] + below;
      }
    }
  }
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<int32_t>(i);
  }
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&layout_kernel);

}  // namespace

void plan(const Call& c, const void* topk_ids, bool ids_are_int64, cudaStream_t stream,
          bool own_first) {
  const comm::PeerTable& peers = c.g.peers;
  const int64_t E = c.g.num_experts, k = c.g.topk, T = c.T;
  const RoutingPlan& local = c.w.local.plan;
  build_routing_plan(topk_ids, ids_are_int64, T, k, E, sm90::kGemmBlockM, local,
                     c.w.local.scratch, stream);
  const auto token_plan = [&](auto* ids) {
    if (T == 0) {  // no token goes anywhere
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(c.w.token_count, 0, comm::kMaxRanks * 4, stream));
      return;
    }
    const int blocks = static_cast<int>((T + kPlanThreads - 1) / kPlanThreads);
    const auto kk = static_cast<int32_t>(k), el = static_cast<int32_t>(c.e_local);
    token_count_kernel<<<blocks, kPlanThreads, 0, stream>>>(ids, local.slot_row, T, kk, el,
                                                            peers.world_size, c.w.block_counts);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
    token_pos_kernel<<<blocks, kPlanThreads, 0, stream>>>(ids, local.slot_row, T, kk, el,
                                                          peers.world_size, c.w.block_counts,
                                                          c.w.token_pos, c.w.token_count);
  };
  if (ids_are_int64) {
    token_plan(static_cast<const int64_t*>(topk_ids));
  } else {
    token_plan(static_cast<const int32_t*>(topk_ids));
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  comm::exchange_counts(peers, local.expert_counts, E, c.g.timeout_ns, c.error, stream);

  layout_kernel<<<1, 1024, E * sizeof(int32_t), stream>>>(
      peers, static_cast<int32_t>(E), static_cast<int32_t>(c.e_local), c.g.max_recv_rows,
      c.w.recv_expert_offsets, c.w.recv_tile_offsets, c.w.send_base, c.w.skip, c.error,
      own_first ? OwnFirstPlans{c.w.own_expert_offsets, c.w.own_tile_offsets,
                                c.w.peer_expert_offsets, c.w.peer_tile_offsets,
                                c.w.own_h_shift, c.w.peer_h_shift_lo, c.w.peer_h_shift_hi,
                                c.w.peer_h_split}
                : OwnFirstPlans{});
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void fill_identity(const Call& c, int32_t* out, int64_t n, cudaStream_t stream) {
  iota_kernel<<<c.sms, 256, 0, stream>>>(out, n);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::ep
