#include "comm/ep_layer.h"

#include <string>
#include <utility>

#include "comm/peer_sync.cuh"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/bf16_row.cuh"
#include "kernels/common/gather_padded.h"
#include "kernels/common/routing_plan.h"
#include "kernels/common/slot_reduce.h"
#include "kernels/sm90/grouped_gemm.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe::ep {
namespace {

constexpr size_t kAlign = 256;
constexpr int kCopyThreads = 256;
constexpr int kPlanThreads = 256;  // tokens per block of the token plan
constexpr int kBatch = 4;           // 16-byte loads a lane has in flight before it stores

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Carver {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t offset = at;
    at += align_up(bytes);
    return offset;
  }
};

// Pieces every call has: the local plan, the layout, and (owner side) an identity map of
// the received rows, their plan for the one-GPU kernels.
struct RouteWorkspace {
  size_t expert_counts, expert_offsets, tile_offsets, row_token, row_slot, slot_row;
  size_t invalid_count, plan_scratch;
  size_t recv_expert_offsets, recv_tile_offsets;  // int32 [E_local + 1] each
  size_t send_base;                               // int32 [E]
  size_t skip;                                    // int32 [1]
  size_t token_pos;                               // int32 [T, W]
  size_t token_count;                             // int32 [W]
  size_t block_counts;                            // int32 [token-plan blocks, W]
};

RouteWorkspace carve_route(Carver& c, const Group& g, int64_t T) {
  RouteWorkspace w{};
  const int64_t slots = T * g.topk, E = g.num_experts;
  const int64_t e_local = E / g.peers.world_size;
  w.expert_counts = c.take(E * 4);
  w.expert_offsets = c.take((E + 1) * 4);
  w.tile_offsets = c.take((E + 1) * 4);
  w.row_token = c.take(slots * 4);
  w.row_slot = c.take(slots * 4);
  w.slot_row = c.take(slots * 4);
  w.invalid_count = c.take(4);
  w.plan_scratch = c.take(routing_plan_scratch_bytes(slots, E));
  w.recv_expert_offsets = c.take((e_local + 1) * 4);
  w.recv_tile_offsets = c.take((e_local + 1) * 4);
  w.send_base = c.take(E * 4);
  w.skip = c.take(4);
  w.token_pos = c.take(T * g.peers.world_size * 4);
  w.token_count = c.take(comm::kMaxRanks * 4);
  w.block_counts = c.take(((T + kPlanThreads - 1) / kPlanThreads) * g.peers.world_size * 4);
  return w;
}

struct ForwardWorkspace {
  RouteWorkspace route;
  size_t activation;  // bf16 [max_recv_rows, I]
  size_t out_rows;    // bf16 [max_recv_rows, H]
  size_t total;
};

ForwardWorkspace carve_forward(const Group& g, int64_t T, int64_t I) {
  Carver c;
  ForwardWorkspace w{};
  w.route = carve_route(c, g, T);
  w.activation = c.take(g.max_recv_rows * I * 2);
  w.out_rows = c.take(g.max_recv_rows * g.hidden * 2);
  w.total = c.at;
  return w;
}

// The one-GPU backward's buffers over the received rows (R = max_recv_rows, P its padded
// bound): fused/backward.cpp's layout, with identity maps standing in for the token and
// slot of each row.
struct BackwardWorkspace {
  RouteWorkspace route;
  size_t identity;    // int32 [R] 0, 1, ...
  size_t h;           // bf16 [R, 2I]
  size_t dh;          // bf16 [P, 2I]
  size_t a;           // bf16 [P, I]
  size_t dp_partial;  // fp32 [R, n-tiles of I]
  size_t dp_rows;     // fp32 [R]
  size_t token_rows;  // bf16 [P, H]: dx rows, then p dy rows, then x rows
  size_t total;
};

BackwardWorkspace carve_backward(const Group& g, int64_t T, int64_t I, bool h_saved) {
  Carver c;
  BackwardWorkspace w{};
  const int64_t R = g.max_recv_rows;
  const int64_t P = padded_rows_bound(R, g.num_experts / g.peers.world_size);
  w.route = carve_route(c, g, T);
  w.identity = c.take(R * 4);
  w.h = h_saved ? 0 : c.take(R * 2 * I * 2);  // the forward's h in saved mode
  w.dh = c.take(P * 2 * I * 2);
  w.a = c.take(P * I * 2);
  w.dp_partial = c.take(R * sm90::swiglu_backward_n_tiles(I) * 4);
  w.dp_rows = c.take(R * 4);
  w.token_rows = c.take(P * g.hidden * 2);
  w.total = c.at;
  return w;
}

template <class T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// The buffer offsets and sizes the kernels need.
struct DeviceLayout {
  size_t recv_x, recv_dy, recv_token_count, recv_token_source, recv_slot_row, recv_row_token,
      recv_weight, combine_rows, combine_dp;
  int32_t hidden, topk, max_tokens;
};

DeviceLayout device_layout(const BufferLayout& b, const Group& g) {
  return {b.recv_x,         b.recv_dy,        b.recv_token_count, b.recv_token_source,
          b.recv_slot_row,  b.recv_row_token, b.recv_weight,      b.combine_rows,
          b.combine_dp,     static_cast<int32_t>(g.hidden), static_cast<int32_t>(g.topk),
          static_cast<int32_t>(g.max_tokens)};
}

template <class T>
__device__ __forceinline__ T* in(char* buffer, size_t offset) {
  return reinterpret_cast<T*>(buffer + offset);
}

// One warp copies a row of `hidden` bf16 to several places (16 bytes per lane, kBatch
// loads in flight before the stores); dst(i) gives the i-th destination row or null.
template <class Destination>
__device__ __forceinline__ void copy_row_to(const __nv_bfloat16* src, int hidden, int lane,
                                            int count, Destination dst) {
  const auto* s = reinterpret_cast<const uint4*>(src);
  const int n = hidden / 8;
  for (int base = lane; base < n; base += 32 * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (base + 32 * b < n) v[b] = s[base + 32 * b];
    }
    for (int i = 0; i < count; ++i) {
      auto* d = reinterpret_cast<uint4*>(dst(i));
      if (d == nullptr) continue;
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (base + 32 * b < n) d[base + 32 * b] = v[b];
      }
    }
  }
}

// 3. From the [W, E] counts of this exchange: this rank's receive offsets per local
// expert (sources in rank order), where this rank's rows of each global expert start in
// its owner's receive area, and the capacity check (every rank reaches the same verdict).
__global__ void __launch_bounds__(1024)
    layout_kernel(const __grid_constant__ comm::PeerTable peers, int32_t num_experts,
                  int32_t experts_per_rank, int64_t capacity, int32_t* recv_expert_offsets,
                  int32_t* recv_tile_offsets, int32_t* send_base, int32_t* skip,
                  int32_t* error) {
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
  for (int g = threadIdx.x; g < num_experts; g += blockDim.x) {
    const int first = (g / experts_per_rank) * experts_per_rank;
    int32_t base = 0;
    for (int e = first; e < g; ++e) base += totals[e];
    for (int s = 0; s < peers.rank; ++s) base += counts[s * num_experts + g];
    send_base[g] = base;
  }
  if (threadIdx.x < peers.world_size) {
    int64_t rows = 0;
    for (int e = 0; e < experts_per_rank; ++e) rows += totals[threadIdx.x * experts_per_rank + e];
    if (rows > capacity) {
      atomicCAS(error, 0, comm::error_code(comm::Phase::kCapacity, threadIdx.x));
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
      tiles += (n + sm90::kGroupedGemmBlockM - 1) / sm90::kGroupedGemmBlockM;
    }
    recv_expert_offsets[experts_per_rank] = offset;
    recv_tile_offsets[experts_per_rank] = tiles;
  }
}

// 1b. Which ranks each token goes to (the owners of its valid slots) and its place among
// this rank's tokens sent to each of them, tokens in order: token_pos [T, W] (-1: not
// sent), token_count [W]. Two passes over blocks of kPlanThreads tokens, one token a
// thread: the destination masks and each block's count per rank, then each token's place
// (earlier blocks' counts + a ballot prefix within the block).

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

// 4. Each token once to each rank that owns one of its experts: the x row (backward: and
// the dy row) into this rank's section of the owner's received tokens, and for each of
// its slots there the owner row (send_base: the expert-sorted layout), the router weight
// and the token's index on the owner. One warp per token.
template <class Id>
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_kernel(const __grid_constant__ comm::PeerTable peers,
                    const __grid_constant__ DeviceLayout layout,
                    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy,
                    const Id* __restrict__ topk_ids, const float* __restrict__ topk_weights,
                    const int32_t* __restrict__ slot_row,
                    const int32_t* __restrict__ expert_offsets,
                    const int32_t* __restrict__ send_base, const int32_t* __restrict__ token_pos,
                    const int32_t* __restrict__ token_count, const int32_t* __restrict__ skip,
                    int64_t T, int32_t experts_per_rank) {
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  if (*skip == 0) {
    if (blockIdx.x == 0 && threadIdx.x < world) {
      in<int32_t>(peers.buffers[threadIdx.x], layout.recv_token_count)[peers.rank] =
          token_count[threadIdx.x];
    }
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
    for (int64_t t = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
      int64_t id = -1, slot_owner = -1;
      int32_t r = -1;
      if (lane < k) {
        r = slot_row[t * k + lane];
        if (r >= 0) {
          id = static_cast<int64_t>(topk_ids[t * k + lane]);
          slot_owner = id / experts_per_rank;
        }
      }
      // The rows, read once, to every destination rank.
      const auto to = [&](size_t area) {
        return [&, area](int d) -> __nv_bfloat16* {
          const int32_t pos = token_pos[t * world + d];
          if (pos < 0) return nullptr;
          return in<__nv_bfloat16>(peers.buffers[d], area) +
                 (int64_t(peers.rank) * layout.max_tokens + pos) * H;
        };
      };
      copy_row_to(x + t * H, H, lane, world, to(layout.recv_x));
      if (dy != nullptr) copy_row_to(dy + t * H, H, lane, world, to(layout.recv_dy));
      for (int d = 0; d < world; ++d) {
        const int32_t pos = token_pos[t * world + d];
        if (pos < 0) continue;
        char* dst = peers.buffers[d];
        const int64_t i = int64_t(peers.rank) * layout.max_tokens + pos;  // token index there
        if (lane < k) {
          int32_t row = -1;
          if (slot_owner == d) {
            row = send_base[id] + (r - expert_offsets[id]);
            in<int32_t>(dst, layout.recv_row_token)[row] = static_cast<int32_t>(i);
            in<float>(dst, layout.recv_weight)[row] = topk_weights[t * k + lane];
          }
          in<int32_t>(dst, layout.recv_slot_row)[i * k + lane] = row;
        }
        if (lane == 0) in<int32_t>(dst, layout.recv_token_source)[i] = static_cast<int32_t>(t);
      }
    }
  }
  __threadfence_system();  // before the phase kernel's release signal
}

// 6. For each received token, the sum of its rows' results here (rows = this rank's
// expert-sorted outputs; forward: weighted by the router weight, backward: the dx rows,
// unweighted), over its slots in slot order in fp32, rounded once to bf16 and stored in its
// source's combine area at [this rank, token]; the backward also sends each slot's d
// topk_weights. One warp per received token; nothing when the call is skipped.
__global__ void __launch_bounds__(kCopyThreads)
    combine_send_kernel(const __grid_constant__ comm::PeerTable peers,
                        const __grid_constant__ DeviceLayout layout,
                        const __nv_bfloat16* __restrict__ rows,
                        const float* __restrict__ row_weights,  // null: 1
                        const float* __restrict__ dp_rows,      // null: forward
                        const int32_t* __restrict__ skip) {
  if (*skip) return;
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  const int lane = threadIdx.x % 32;
  char* own = peers.buffers[peers.rank];
  const int32_t* count = in<int32_t>(own, layout.recv_token_count);
  const int64_t tokens = int64_t(world) * layout.max_tokens;
  const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t i = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; i < tokens; i += warps) {
    const int source = static_cast<int>(i / layout.max_tokens);
    if (i - int64_t(source) * layout.max_tokens >= count[source]) continue;
    const int64_t t = in<int32_t>(own, layout.recv_token_source)[i];
    const int32_t my_row = lane < k ? in<int32_t>(own, layout.recv_slot_row)[i * k + lane] : -1;
    const float my_weight = my_row >= 0 && row_weights != nullptr ? row_weights[my_row] : 1.f;
    char* dst = peers.buffers[source];
    auto* out = in<__nv_bfloat16>(dst, layout.combine_rows) +
                (int64_t(peers.rank) * layout.max_tokens + t) * H;
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float acc[8] = {};
      for (int j0 = 0; j0 < k; j0 += kBatch) {  // kBatch rows' loads in flight, then in order
        uint4 v[kBatch];
        float w[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int32_t row = __shfl_sync(0xffffffffu, my_row, (j0 + b) % 32);
          w[b] = __shfl_sync(0xffffffffu, my_weight, (j0 + b) % 32);
          const bool used = j0 + b < k && row >= 0;
          v[b] = used ? *reinterpret_cast<const uint4*>(rows + int64_t(row) * H + c)
                      : make_uint4(0, 0, 0, 0);
          if (!used) w[b] = 0.f;
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) fma_row(acc, w[b], v[b]);
      }
      *reinterpret_cast<uint4*>(out + c) = pack_row(acc);
    }
    if (dp_rows != nullptr && my_row >= 0) in<float>(dst, layout.combine_dp)[t * k + lane] = dp_rows[my_row];
  }
  __threadfence_system();
}

// 7. y (backward: dx) of each of this rank's tokens: the owners' partial rows in rank order,
// summed in fp32; with d_topk_weights, also each valid slot's value from its owner (0 for
// an id of -1). One warp per token.
__global__ void __launch_bounds__(kCopyThreads)
    final_combine_kernel(const __grid_constant__ comm::PeerTable peers,
                         const __grid_constant__ DeviceLayout layout,
                         const int32_t* __restrict__ token_pos,
                         const int32_t* __restrict__ slot_row, int64_t T,
                         __nv_bfloat16* __restrict__ out, float* __restrict__ d_topk_weights) {
  const int world = peers.world_size, k = layout.topk, H = layout.hidden;
  const int lane = threadIdx.x % 32;
  const char* own = peers.buffers[peers.rank];
  const auto* partial = reinterpret_cast<const __nv_bfloat16*>(own + layout.combine_rows);
  const int64_t warps = int64_t(gridDim.x) * (kCopyThreads / 32);
  for (int64_t t = blockIdx.x * (kCopyThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float acc[8] = {};
      for (int d = 0; d < world; ++d) {
        if (token_pos[t * world + d] < 0) continue;
        fma_row(acc, 1.f, *reinterpret_cast<const uint4*>(
                               partial + (int64_t(d) * layout.max_tokens + t) * H + c));
      }
      *reinterpret_cast<uint4*>(out + t * H + c) = pack_row(acc);
    }
    if (d_topk_weights != nullptr && lane < k) {
      const int64_t s = t * k + lane;
      d_topk_weights[s] =
          slot_row[s] >= 0 ? reinterpret_cast<const float*>(own + layout.combine_dp)[s] : 0.f;
    }
  }
}

__global__ void phase_kernel(const __grid_constant__ comm::PeerTable peers, comm::Phase phase,
                             int64_t timeout_ns, int32_t* error) {
  const uint32_t generation = comm::next_generation(peers, phase);
  comm::arrive_and_wait(peers, phase, generation, timeout_ns, error);
}

// A skipped call (capacity) must not look like a result.
template <class T>
__global__ void poison_if_skipped_kernel(T* out, int64_t n, const int32_t* skip) {
  if (*skip == 0) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = T(__int_as_float(0x7fc00000));
  }
}

template <class T>
void poison_if_skipped(T* out, int64_t n, const int32_t* skip, int sms, cudaStream_t stream) {
  if (out == nullptr || n == 0) return;
  poison_if_skipped_kernel<T><<<sms, 256, 0, stream>>>(out, n, skip);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<int32_t>(i);
  }
}

void check_group(const Group& g) {
  const comm::PeerTable& p = g.peers;
  if (p.world_size < 1 || p.world_size > comm::kMaxRanks || p.rank < 0 || p.rank >= p.world_size) {
    throw_invalid("EP group: expected 0 <= rank < world_size <= 8, got rank " +
                  std::to_string(p.rank) + " of " + std::to_string(p.world_size));
  }
  for (int r = 0; r < p.world_size; ++r) {
    if (p.buffers[r] == nullptr) throw_invalid("EP group: no buffer for rank " + std::to_string(r));
  }
  if (g.num_experts < 1 || g.num_experts % p.world_size) {
    throw_invalid("EP group: num_experts " + std::to_string(g.num_experts) +
                  " is not a positive multiple of the world size " + std::to_string(p.world_size));
  }
  if (g.hidden < 128 || g.hidden % 128 || g.topk < 1 || g.topk > 16 || g.max_tokens < 0 ||
      g.max_recv_rows < 1 || g.timeout_ns < 1) {
    throw_invalid("EP group: bad sizes (H a multiple of 128, 1 <= k <= 16, max_recv_rows >= 1, "
                  "timeout > 0)");
  }
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&phase_kernel);

}  // namespace

BufferLayout buffer_layout(const Group& g) {
  check_group(g);
  Carver c;
  BufferLayout b{};
  const int64_t R = g.max_recv_rows, W = g.peers.world_size, k = g.topk;
  const int64_t tokens = W * g.max_tokens;  // received tokens: one section per source
  b.control = c.take(comm::ControlLayout::bytes(g.num_experts));
  b.error = c.take(sizeof(int32_t));
  b.recv_x = c.take(tokens * g.hidden * 2);
  b.recv_dy = c.take(tokens * g.hidden * 2);
  b.recv_token_count = c.take(comm::kMaxRanks * 4);
  b.recv_token_source = c.take(tokens * 4);
  b.recv_slot_row = c.take(tokens * k * 4);
  b.recv_row_token = c.take(R * 4);
  b.recv_weight = c.take(R * 4);
  b.combine_rows = c.take(tokens * g.hidden * 2);
  b.combine_dp = c.take(g.max_tokens * k * 4);
  b.total = c.at;
  return b;
}

size_t forward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate) {
  check_group(g);
  return carve_forward(g, tokens, intermediate).total;
}

size_t backward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                                bool h_saved) {
  check_group(g);
  return carve_backward(g, tokens, intermediate, h_saved).total;
}

namespace {

// What steps 1-4 leave for the rest of a call.
struct Routed {
  RoutingPlan plan;           // local, over all E experts
  RoutingPlan recv;           // the received rows' (owner side; row_token: received token)
  int32_t* token_pos;         // [T, W] (token_plan_kernel)
  int32_t* skip;
  int32_t* error;
  BufferLayout buffer;
  DeviceLayout layout;
  int64_t e_local;
  int sms;
  int copy_blocks;            // of the kernels that move rows between ranks
};

void check_call(const Group& g, int64_t T, int64_t I) {
  check_group(g);
  if (T < 0 || T > g.max_tokens) {
    throw_invalid("tokens: expected 0 <= T <= max_tokens_per_rank (" +
                  std::to_string(g.max_tokens) + "), got " + std::to_string(T));
  }
  if (I < 128 || I % 128) throw_invalid("intermediate: expected a positive multiple of 128");
}

// Steps 1-4: local plan, counts, layout, dispatch (x rows; with dy, dy rows and weights),
// and the dispatch phase.
Routed route_and_dispatch(const Group& g, const RouteWorkspace& w, void* workspace,
                          const __nv_bfloat16* x, const __nv_bfloat16* dy, const void* topk_ids,
                          bool ids_are_int64, const float* topk_weights, int64_t T,
                          cudaStream_t stream) {
  // Everything this call launches behind the first peer wait must be loaded already
  // (kernel_preload.h says why).
  preload_kernels();
  const comm::PeerTable& peers = g.peers;
  const int64_t E = g.num_experts, k = g.topk;
  Routed r{};
  r.e_local = E / peers.world_size;
  r.buffer = buffer_layout(g);
  r.layout = device_layout(r.buffer, g);
  char* own = peers.buffers[peers.rank];
  r.error = reinterpret_cast<int32_t*>(own + r.buffer.error);
  r.plan = {at<int32_t>(workspace, w.expert_counts), at<int32_t>(workspace, w.expert_offsets),
            at<int32_t>(workspace, w.tile_offsets),  at<int32_t>(workspace, w.row_token),
            at<int32_t>(workspace, w.row_slot),      at<int32_t>(workspace, w.slot_row),
            at<int32_t>(workspace, w.invalid_count)};
  build_routing_plan(topk_ids, ids_are_int64, T, k, E, sm90::kGroupedGemmBlockM, r.plan,
                     at<void>(workspace, w.plan_scratch), stream);
  r.token_pos = at<int32_t>(workspace, w.token_pos);
  auto* token_count = at<int32_t>(workspace, w.token_count);
  const auto token_plan = [&](auto* ids) {
    if (T == 0) {  // no token goes anywhere
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(token_count, 0, comm::kMaxRanks * 4, stream));
      return;
    }
    const int blocks = static_cast<int>((T + kPlanThreads - 1) / kPlanThreads);
    auto* block_counts = at<int32_t>(workspace, w.block_counts);
    const auto kk = static_cast<int32_t>(k), el = static_cast<int32_t>(r.e_local);
    token_count_kernel<<<blocks, kPlanThreads, 0, stream>>>(ids, r.plan.slot_row, T, kk, el,
                                                            peers.world_size, block_counts);
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
    token_pos_kernel<<<blocks, kPlanThreads, 0, stream>>>(ids, r.plan.slot_row, T, kk, el,
                                                          peers.world_size, block_counts,
                                                          r.token_pos, token_count);
  };
  if (ids_are_int64) {
    token_plan(static_cast<const int64_t*>(topk_ids));
  } else {
    token_plan(static_cast<const int32_t*>(topk_ids));
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  comm::exchange_counts(peers, r.plan.expert_counts, E, g.timeout_ns, r.error, stream);

  r.recv.expert_offsets = at<int32_t>(workspace, w.recv_expert_offsets);
  r.recv.tile_offsets = at<int32_t>(workspace, w.recv_tile_offsets);
  r.recv.row_token = reinterpret_cast<int32_t*>(own + r.buffer.recv_row_token);
  auto* send_base = at<int32_t>(workspace, w.send_base);
  r.skip = at<int32_t>(workspace, w.skip);
  layout_kernel<<<1, 1024, E * sizeof(int32_t), stream>>>(
      peers, static_cast<int32_t>(E), static_cast<int32_t>(r.e_local), g.max_recv_rows,
      r.recv.expert_offsets, r.recv.tile_offsets, send_base, r.skip, r.error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());

  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, device));
  r.copy_blocks = 2 * (g.comm_sms > 0 && g.comm_sms < r.sms ? g.comm_sms : r.sms);
  const auto dispatch = [&](auto* ids) {
    dispatch_kernel<<<r.copy_blocks, kCopyThreads, 0, stream>>>(
        peers, r.layout, x, dy, ids, topk_weights, r.plan.slot_row, r.plan.expert_offsets,
        send_base, r.token_pos, token_count, r.skip, T, static_cast<int32_t>(r.e_local));
  };
  if (ids_are_int64) {
    dispatch(static_cast<const int64_t*>(topk_ids));
  } else {
    dispatch(static_cast<const int32_t*>(topk_ids));
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  phase_kernel<<<1, 32, 0, stream>>>(peers, comm::Phase::kDispatch, g.timeout_ns, r.error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  return r;
}

// Step 6's sends (rows: this rank's expert-sorted results).
void send_back(const Group& g, const Routed& r, const __nv_bfloat16* rows,
               const float* row_weights, const float* dp_rows, cudaStream_t stream) {
  combine_send_kernel<<<r.copy_blocks, kCopyThreads, 0, stream>>>(g.peers, r.layout, rows,
                                                                  row_weights, dp_rows, r.skip);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

// Step 7 on this rank's tokens.
void final_combine(const Group& g, const Routed& r, int64_t T, __nv_bfloat16* out,
                   float* d_topk_weights, cudaStream_t stream) {
  if (T == 0) return;
  final_combine_kernel<<<r.copy_blocks, kCopyThreads, 0, stream>>>(
      g.peers, r.layout, r.token_pos, r.plan.slot_row, T, out, d_topk_weights);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void combine_phase(const Group& g, const Routed& r, cudaStream_t stream) {
  phase_kernel<<<1, 32, 0, stream>>>(g.peers, comm::Phase::kCombine, g.timeout_ns, r.error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

// The received rows as one-GPU GEMM arguments (expert-sorted; A gathered from the received
// tokens when `a` is set).
sm90::GroupedGemmArgs received_rows(const Group& g, const Routed& r,
                                    const __nv_bfloat16* tokens = nullptr) {
  sm90::GroupedGemmArgs a{};
  a.a_rows = g.max_recv_rows;
  a.num_experts = r.e_local;
  a.expert_offsets = r.recv.expert_offsets;
  a.tile_offsets = r.recv.tile_offsets;
  if (tokens != nullptr) {
    a.a = tokens;
    a.a_row_index = r.recv.row_token;
    a.a_source_rows = g.peers.world_size * g.max_tokens;
  }
  return a;
}

// A weight gradient GEMM's arguments, written in bf16 or added into fp32.
sm90::WgradArgs wgrad_args(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t rows,
                           int64_t m, int64_t n, int64_t experts, const int32_t* tile_offsets,
                           WeightGrad out) {
  sm90::WgradArgs args{a, b, rows, m, n, experts, tile_offsets, nullptr};
  if (out.accumulate) {
    args.c_accumulate = static_cast<float*>(out.data);
  } else {
    args.c = static_cast<__nv_bfloat16*>(out.data);
  }
  return args;
}

}  // namespace

void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t I, __nv_bfloat16* y,
             __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream) {
  check_call(g, T, I);
  const ForwardWorkspace w = carve_forward(g, T, I);
  if (workspace == nullptr || workspace_size < w.total) {
    throw_invalid("workspace: expected " + std::to_string(w.total) + " bytes");
  }
  const Routed r = route_and_dispatch(g, w.route, workspace, x, nullptr, topk_ids, ids_are_int64,
                                      topk_weights, T, stream);
  char* own = g.peers.buffers[g.peers.rank];
  const int64_t H = g.hidden;

  // The one-GPU GEMMs on the received rows, A gathered from the received tokens.
  auto* activation = at<__nv_bfloat16>(workspace, w.activation);
  auto* out_rows = at<__nv_bfloat16>(workspace, w.out_rows);
  sm90::GroupedGemmArgs l1 =
      received_rows(g, r, reinterpret_cast<const __nv_bfloat16*>(own + r.buffer.recv_x));
  l1.b = w_gate_up;
  l1.b_rows_per_expert = 2 * I;
  l1.k = H;
  l1.c = activation;
  l1.ldc = I;
  l1.h_out = saved_h;  // saved mode: h = [gate | up] of every received row, for the backward
  sm90::grouped_gemm_swiglu(l1, I, stream);
  sm90::GroupedGemmArgs l2 = received_rows(g, r);
  l2.a = activation;
  l2.b = w_down;
  l2.b_rows_per_expert = H;
  l2.k = I;
  l2.c = out_rows;
  l2.ldc = H;
  sm90::grouped_gemm(l2, stream);

  send_back(g, r, out_rows, reinterpret_cast<const float*>(own + r.buffer.recv_weight), nullptr,
            stream);
  combine_phase(g, r, stream);
  final_combine(g, r, T, y, nullptr, stream);
  poison_if_skipped(y, T * H, r.skip, r.sms, stream);
}

void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t T, int64_t I,
              const __nv_bfloat16* saved_h, __nv_bfloat16* dx, float* d_topk_weights,
              WeightGrad d_w_gate_up, WeightGrad d_w_down, void* workspace,
              size_t workspace_size, cudaStream_t stream) {
  check_call(g, T, I);
  if (!dy || !dx || !d_topk_weights || !d_w_gate_up.data || !d_w_down.data) {
    throw_invalid("EP backward: dy and every gradient are required in this version");
  }
  const BackwardWorkspace w = carve_backward(g, T, I, saved_h != nullptr);
  if (workspace == nullptr || workspace_size < w.total) {
    throw_invalid("workspace: expected " + std::to_string(w.total) + " bytes");
  }
  Routed r = route_and_dispatch(g, w.route, workspace, x, dy, topk_ids, ids_are_int64,
                                topk_weights, T, stream);
  char* own = g.peers.buffers[g.peers.rank];
  const int64_t H = g.hidden, R = g.max_recv_rows, E_local = r.e_local;
  const int64_t P = padded_rows_bound(R, E_local);
  auto* identity = at<int32_t>(workspace, w.identity);
  iota_kernel<<<r.sms, 256, 0, stream>>>(identity, R);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  r.recv.row_slot = identity;  // row i's router weight is recv_weight[i]
  const auto* recv_x = reinterpret_cast<const __nv_bfloat16*>(own + r.buffer.recv_x);
  const auto* recv_dy = reinterpret_cast<const __nv_bfloat16*>(own + r.buffer.recv_dy);
  const auto* recv_weight = reinterpret_cast<const float*>(own + r.buffer.recv_weight);
  const __nv_bfloat16* h = saved_h;
  auto* dh = at<__nv_bfloat16>(workspace, w.dh);
  auto* a = at<__nv_bfloat16>(workspace, w.a);
  auto* dp_partial = at<float>(workspace, w.dp_partial);
  auto* dp_rows = at<float>(workspace, w.dp_rows);
  auto* token_rows = at<__nv_bfloat16>(workspace, w.token_rows);

  if (saved_h == nullptr) {  // L1 recomputed on the received x rows
    auto* h_out = at<__nv_bfloat16>(workspace, w.h);
    sm90::GroupedGemmArgs l1 = received_rows(g, r, recv_x);
    l1.b = w_gate_up;
    l1.b_rows_per_expert = 2 * I;
    l1.k = H;
    l1.c = h_out;
    l1.ldc = 2 * I;
    sm90::grouped_gemm(l1, stream);
    h = h_out;
  }
  // dgrad of L2 with the SwiGLU backward: dh and a padded, dp partials per received row.
  sm90::GroupedGemmArgs l2 = received_rows(g, r, recv_dy);
  l2.b = w_down;
  l2.k = H;
  l2.n = I;
  l2.c_padded = true;
  l2.c_rows = P;
  sm90::grouped_gemm_swiglu_backward(l2, {h, dh, recv_weight, identity, dp_partial, a}, stream);
  // dgrad of L1: the dx rows, in received order.
  sm90::GroupedGemmArgs l1_dgrad = received_rows(g, r);
  l1_dgrad.a = dh;
  l1_dgrad.a_padded = true;
  l1_dgrad.a_rows = P;
  l1_dgrad.b = w_gate_up;
  l1_dgrad.k = 2 * I;
  l1_dgrad.n = H;
  l1_dgrad.c = token_rows;
  l1_dgrad.ldc = H;
  l1_dgrad.c_rows = R;
  sm90::grouped_gemm_b_n_major(l1_dgrad, stream);
  reduce_slot_partials(dp_partial, sm90::swiglu_backward_n_tiles(I), identity, R, dp_rows, stream);
  send_back(g, r, token_rows, nullptr, dp_rows, stream);

  // Weight gradients (local) while the peers finish: token_rows is free again.
  gather_rows_padded(recv_dy, H, r.recv, E_local, recv_weight, P, token_rows, stream);
  sm90::grouped_gemm_wgrad(wgrad_args(token_rows, a, P, H, I, E_local, r.recv.tile_offsets,
                                      d_w_down), stream);
  gather_rows_padded(recv_x, H, r.recv, E_local, nullptr, P, token_rows, stream);
  sm90::grouped_gemm_wgrad(wgrad_args(dh, token_rows, P, 2 * I, H, E_local,
                                      r.recv.tile_offsets, d_w_gate_up), stream);
  combine_phase(g, r, stream);

  final_combine(g, r, T, dx, d_topk_weights, stream);
  poison_if_skipped(dx, T * H, r.skip, r.sms, stream);
  poison_if_skipped(d_topk_weights, T * g.topk, r.skip, r.sms, stream);
  for (const auto& [grad, n] : {std::pair{d_w_gate_up, E_local * 2 * I * H},
                                std::pair{d_w_down, E_local * H * I}}) {
    if (grad.accumulate) {
      poison_if_skipped(static_cast<float*>(grad.data), n, r.skip, r.sms, stream);
    } else {
      poison_if_skipped(static_cast<__nv_bfloat16*>(grad.data), n, r.skip, r.sms, stream);
    }
  }
}

}  // namespace megamoe::ep
