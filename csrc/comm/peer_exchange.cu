#include "comm/peer_exchange.h"
#include "comm/peer_sync.cuh"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"

namespace megamoe::comm {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    exchange_counts_kernel(const __grid_constant__ PeerTable peers,
                           const int32_t* __restrict__ local_counts,
                           int32_t num_experts, int64_t timeout_ns, int32_t* error) {
  if (threadIdx.x == 0) *error = 0;
  const uint32_t generation = next_generation(peers, Phase::kCounts);
  for (int dst = 0; dst < peers.world_size; ++dst) {
    int32_t* row = ControlLayout::counts(peers.buffers[dst], num_experts, generation) +
                   int64_t(peers.rank) * num_experts;
    for (int e = threadIdx.x; e < num_experts; e += kThreads) row[e] = local_counts[e];
  }
  arrive_and_wait(peers, Phase::kCounts, generation, timeout_ns, error);
}

__global__ void phase_kernel(const __grid_constant__ PeerTable peers, Phase phase,
                             int64_t timeout_ns, int32_t* error) {
  const uint32_t generation = next_generation(peers, phase);
  arrive_and_wait(peers, phase, generation, timeout_ns, error);
}

[[maybe_unused]] const bool kPreloadable = register_kernel_module(&exchange_counts_kernel);

}  // namespace

size_t ControlLayout::bytes(int64_t num_experts) {
  return kCounts + 2 * sizeof(int32_t) * kMaxRanks * static_cast<size_t>(num_experts);
}

void exchange_counts(const PeerTable& peers, const int32_t* local_counts, int64_t num_experts,
                     int64_t timeout_ns, int32_t* error, cudaStream_t stream) {
  if (peers.world_size < 1 || peers.world_size > kMaxRanks || peers.rank < 0 ||
      peers.rank >= peers.world_size) {
    throw_invalid("peer table: expected 0 <= rank < world_size <= 8, got rank " +
                  std::to_string(peers.rank) + " of " + std::to_string(peers.world_size));
  }
  for (int r = 0; r < peers.world_size; ++r) {
    if (peers.buffers[r] == nullptr) {
      throw_invalid("peer table: no buffer for rank " + std::to_string(r));
    }
  }
  if (num_experts < 1 || num_experts > INT32_MAX / kMaxRanks) {
    throw_invalid("num_experts: expected >= 1, got " + std::to_string(num_experts));
  }
  if (!local_counts || !error) throw_invalid("exchange_counts: null counts or error pointer");
  exchange_counts_kernel<<<1, kThreads, 0, stream>>>(
      peers, local_counts, static_cast<int32_t>(num_experts), timeout_ns, error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void phase_barrier(const PeerTable& peers, Phase phase, int64_t timeout_ns, int32_t* error,
                   cudaStream_t stream) {
  phase_kernel<<<1, 32, 0, stream>>>(peers, phase, timeout_ns, error);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

std::string describe_error(int32_t code) {
  if (code == 0) return "no error";
  if (const int waiting = (code >> 16) - 1; waiting >= 0) {
    return describe_error(code & 0xFFFF) + " of rank " + std::to_string(waiting) +
           ", which went on: the group's later outputs are NaN (make new buffers)";
  }
  const int phase = (code >> 8) - 1;
  const int rank = code & 0xFF;
  if (phase == int(Phase::kCapacity)) {
    return "rank " + std::to_string(rank) +
           " would receive more token rows than its capacity (max_recv_rows); nothing was "
           "sent and the outputs are NaN";
  }
  const char* name = phase == int(Phase::kCounts)     ? "counts"
                     : phase == int(Phase::kDispatch) ? "dispatch"
                     : phase == int(Phase::kCombine)  ? "combine"
                     : phase == int(Phase::kCombineRows) ? "combine rows"
                     : phase == int(Phase::kDispatchX) ? "dispatch x"
                                                      : "unknown";
  return "rank " + std::to_string(rank) + " did not arrive in phase '" + name +
         "' within the timeout";
}

}  // namespace megamoe::comm
