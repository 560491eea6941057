#include "comm/peer_exchange.h"

#include "core/cuda_check.h"
#include "core/error.h"

namespace megamoe::comm {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t* signal_word(char* buffer, Phase phase, int src) {
  return reinterpret_cast<uint32_t*>(buffer + ControlLayout::kSignal) +
         int(phase) * kMaxRanks + src;
}

// Error code: (phase + 1) << 8 | the rank that did not arrive.
__device__ __forceinline__ int32_t error_code(Phase phase, int src) {
  return ((int(phase) + 1) << 8) | src;
}

// This call's generation of `phase` (the calls so far, this one included), advanced in
// this rank's own buffer. Every thread of the block gets it.
__device__ uint32_t next_generation(const PeerTable& peers, Phase phase) {
  __shared__ uint32_t generation;
  if (threadIdx.x == 0) {
    auto* own =
        reinterpret_cast<uint32_t*>(peers.buffers[peers.rank] + ControlLayout::kGeneration) +
        int(phase);
    generation = *own + 1;
    *own = generation;
  }
  __syncthreads();
  return generation;
}

// One block. Signals this phase's arrival on every rank (after this block's earlier writes
// to them), then waits for every rank's arrival here. Returns false on timeout.
__device__ bool arrive_and_wait(const PeerTable& peers, Phase phase, uint32_t generation,
                                int64_t timeout_ns, int32_t* error) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  // Each thread's stores to peer memory become visible system-wide before the barrier;
  // the release below then publishes them with the signal.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < peers.world_size) {
    store_release_sys(signal_word(peers.buffers[threadIdx.x], phase, peers.rank), generation);
    const uint32_t* arrived = signal_word(peers.buffers[peers.rank], phase, threadIdx.x);
    const uint64_t start = global_time_ns();
    // Generations only grow; a signal from a later call means this one's arrived too.
    while (static_cast<int32_t>(load_acquire_sys(arrived) - generation) < 0) {
      if (global_time_ns() - start > static_cast<uint64_t>(timeout_ns)) {
        atomicCAS(error, 0, error_code(phase, threadIdx.x));
        failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return failed == 0;
}

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

std::string describe_error(int32_t code) {
  if (code == 0) return "no error";
  const int phase = (code >> 8) - 1;
  const int rank = code & 0xFF;
  const char* name = phase == int(Phase::kCounts) ? "counts" : "unknown";
  return "rank " + std::to_string(rank) + " did not arrive in phase '" + name +
         "' within the timeout";
}

}  // namespace megamoe::comm
