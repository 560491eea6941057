// Device side of the peer synchronisation (peer_exchange.h): generation counters,
// release/acquire signals at system scope, and waits with a timeout. Included by the .cu
// files of the expert-parallel kernels; every function runs in one block.
#pragma once

#include <cstdint>

#include "comm/peer_exchange.h"

namespace megamoe::comm {

// (phase + 1) << 8 | rank: what describe_error() decodes.
__device__ __forceinline__ int32_t error_code(Phase phase, int rank) {
  return ((int(phase) + 1) << 8) | rank;
}

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

// This call's generation of `phase` (the calls so far, this one included), advanced in
// this rank's own buffer. Every thread of the block gets it.
__device__ __forceinline__ uint32_t next_generation(const PeerTable& peers, Phase phase) {
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

// A failure's code into the error words (peer_exchange.h): [0], this call's, and [1], the
// first since [1] was last zeroed. An earlier code in either stays, and [1] takes what [0]
// holds, so that the two agree when codes race.
__device__ __forceinline__ void record_failure(int32_t* error, int32_t code) {
  const int32_t earlier = atomicCAS(error, 0, code);
  atomicCAS(error + 1, 0, earlier != 0 ? earlier : code);
}

__device__ __forceinline__ int32_t* group_failure_word(char* buffer) {
  return reinterpret_cast<int32_t*>(buffer + ControlLayout::kGroupFailure);
}

// The group's failure as this rank sees it (0: none): a peer's timeout, or its own.
__device__ __forceinline__ int32_t group_failure(const PeerTable& peers) {
  return *reinterpret_cast<const volatile int32_t*>(group_failure_word(peers.buffers[peers.rank]));
}

// `mark` (a group_failure_code) into every rank's group_failure word, where none is there
// yet. This rank goes on with rows that may be stale or missing and sends results computed
// from them; the fence puts the mark before every later store and signal of this thread, so
// a rank that acquires one of them sees a mark too (ep_combine.cu's take_group_failure),
// whether or not the rank that failed first has reached its word yet.
__device__ __forceinline__ void mark_group(const PeerTable& peers, int32_t mark) {
  for (int r = 0; r < peers.world_size; ++r) {
    atomicCAS_system(group_failure_word(peers.buffers[r]), 0, mark);
  }
  __threadfence_system();
}

// A wait that timed out: its code into this rank's error words and, as group_failure_code,
// into every rank's group_failure word.
__device__ __forceinline__ void record_timeout(const PeerTable& peers, int32_t* error,
                                               int32_t code) {
  record_failure(error, code);
  mark_group(peers, group_failure_code(code, peers.rank));
}

// A wait given up on because the group has failed: the group's code into this rank's error
// words, and passed on to every rank before this rank's later stores.
__device__ __forceinline__ void join_group_failure(const PeerTable& peers, int32_t* error,
                                                   int32_t mark) {
  record_failure(error, mark);
  mark_group(peers, mark);
}

// One block. Signals this phase's arrival on every rank (after this block's earlier writes
// to them), then waits for every rank's arrival here. Returns false on timeout, and at once
// when the group has failed (a timeout on any rank, this call or an earlier one): the call's
// outputs are NaN by then whatever arrives, so a dead peer costs the group one timeout
// instead of one per phase of every call from then on.
__device__ __forceinline__ bool arrive_and_wait(const PeerTable& peers, Phase phase, uint32_t generation,
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
      if (const int32_t mark = group_failure(peers); mark != 0) {
        join_group_failure(peers, error, mark);
        failed = 1;
        break;
      }
      if (global_time_ns() - start > static_cast<uint64_t>(timeout_ns)) {
        record_timeout(peers, error, error_code(phase, threadIdx.x));
        failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return failed == 0;
}

}  // namespace megamoe::comm
