// Device-side exchange between the ranks of an expert-parallel group over peer pointers
// (NVLink; the buffers come from torch symmetric memory, or from cudaMalloc with peer
// access in the C++ tests). No host sync, no per-call memset: each phase keeps a
// generation counter in device memory, advanced by every call, and a rank's arrival is
// the peer's signal word reaching that generation. A peer that never arrives ends the
// wait after `timeout_ns` with an error code naming the rank and the phase, and marks the
// group as failed (exchange_counts below).
//
// Two collectives: the exchange of the expert counts (the all-gather every rank needs to
// lay out the token rows it sends and receives), and a barrier per phase of a call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace megamoe::comm {

constexpr int kMaxRanks = 8;

enum class Phase : int32_t {
  kCounts = 0,
  kDispatch = 1,  // token rows sent to their experts' ranks
  kCombine = 2,   // result rows sent back to their tokens' ranks
  kCombineRows = 3,  // not a barrier: the source's wait for each slot's row from L2's epilogue
  kDispatchX = 4,    // the overlapped backward's x rows, sent after dy's (Group::overlap_backward)
  kCapacity = 6,  // not a wait: a rank would receive more rows than its capacity
  kNumPhases = 8
};

// Every rank's symmetric buffer, as seen from this rank (buffers[rank] is its own).
struct PeerTable {
  int32_t rank = 0;
  int32_t world_size = 1;
  char* buffers[kMaxRanks] = {};
};

// Control area at the start of each symmetric buffer, identical on every rank:
//   uint32 generation[kNumPhases]              this rank's calls so far, per phase
//   int32  group_failure                       at kGroupFailure: 0, or the first timeout
//                                              any rank of the group had (group_failure_code),
//                                              stored there by that rank; nothing resets it
//   uint32 signal[kNumPhases][kMaxRanks]       signal[phase][src]: written by rank src
//   int32  counts[2][kMaxRanks][num_experts]   counts[g % 2][src][e]: rank src's counts of
//                                              its g-th exchange
// Two count slots by generation parity: a rank that starts exchange g + 1 early writes the
// other slot, and it cannot reach exchange g + 2 before every rank has arrived in g + 1,
// i.e. is done with slot g % 2 (as long as ranks read their counts before the next
// exchange).
struct ControlLayout {
  static constexpr size_t kGeneration = 0;
  static constexpr size_t kGroupFailure = 128;
  static constexpr size_t kSignal = 256;
  static constexpr size_t kCounts = 512;
  static size_t bytes(int64_t num_experts);
  // The counts matrix [kMaxRanks][num_experts] of exchange `generation` in `buffer`.
  __host__ __device__ static int32_t* counts(char* buffer, int64_t num_experts,
                                             uint32_t generation) {
    return reinterpret_cast<int32_t*>(buffer + kCounts) +
           (generation % 2) * kMaxRanks * num_experts;
  }
};
static_assert(ControlLayout::kGroupFailure >= sizeof(uint32_t) * int(Phase::kNumPhases));
static_assert(ControlLayout::kSignal >= ControlLayout::kGroupFailure + sizeof(int32_t));
static_assert(ControlLayout::kCounts - ControlLayout::kSignal >=
              sizeof(uint32_t) * int(Phase::kNumPhases) * kMaxRanks);

// The control area needs zeros once, when the buffer is created; never again.

// Writes this rank's counts [E] into row `rank` of every rank's counts matrix of this
// exchange, signals, and waits until every rank's row has arrived in its own: afterwards
// ControlLayout::counts(own buffer, E, generation[kCounts]) holds every rank's counts. Collective: every rank of the table must
// call it, in the same order as its other exchanges. error: device int32 [2]: [0] written 0,
// then a code (describe_error) when a peer did not arrive in time; [1] the first such code
// since it was last zeroed (the caller zeroes it; a code there stays). A rank that times out
// also stores its code, as group_failure_code, into every rank's group_failure word (its
// own included), unless one is there: the ranks it goes on to send rows to (computed from a
// late peer's stale counts or missing rows) learn of it before their next phase ends. From
// then on every wait of every rank that has to wait gives up at once, taking that code into
// its error words (and passing it on): a dead peer costs the group one timeout.
void exchange_counts(const PeerTable& peers, const int32_t* local_counts, int64_t num_experts,
                     int64_t timeout_ns, int32_t* error, cudaStream_t stream);

// Signals this rank's arrival in `phase` on every rank, after this stream's earlier stores
// to them, then waits until every rank has arrived: kernels behind it on the stream see what
// every peer stored before its arrival. Collective like exchange_counts; error: as there.
void phase_barrier(const PeerTable& peers, Phase phase, int64_t timeout_ns, int32_t* error,
                   cudaStream_t stream);

// "rank 1 did not arrive in phase 'counts' within the timeout" for a nonzero error code;
// for a group_failure_code it also names the rank that waited.
std::string describe_error(int32_t code);

// A timeout's code as seen by the other ranks of the group: error_code(phase, late rank)
// with (the waiting rank + 1) << 16.
__host__ __device__ constexpr int32_t group_failure_code(int32_t code, int waiting_rank) {
  return code | ((waiting_rank + 1) << 16);
}


}  // namespace megamoe::comm
