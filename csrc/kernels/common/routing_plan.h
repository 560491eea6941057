// Routing plan on the device: per-expert counts and offsets, M-tile offsets for the grouped
// GEMMs, and the permutation between top-k slots and expert-sorted rows. Internal to the
// library (not part of the C ABI); called by the fused forward/backward.
//
// Sorted order is a stable counting sort by expert: the rows of expert e are
// [expert_offsets[e], expert_offsets[e+1]), and inside an expert they are ordered by slot
// index t*k+j ascending, i.e. the result equals a stable argsort of the ids (invalid and -1
// slots dropped). Every output is a pure function of the ids: bitwise identical run to run.
//
// Asynchronous on `stream`, no host sync, no allocation, capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/workspace.h"

namespace megamoe {

struct RoutingPlan {          // all device pointers, caller-allocated
  int32_t* expert_counts;     // [E]   pairs routed to expert e (ids in [0,E); -1 skipped)
  int32_t* expert_offsets;    // [E+1] exclusive prefix of counts; [E] = number of valid pairs N
  int32_t* tile_offsets;      // [E+1] exclusive prefix of ceil(count_e / block_m); [E] = M-tiles
  int32_t* row_token;         // [T*k] sorted row r < N: token t of the pair; rows >= N: -1
  int32_t* row_slot;          // [T*k] sorted row r < N: slot index t*k+j; rows >= N: -1
  int32_t* slot_row;          // [T*k] inverse: sorted row of slot t*k+j, or -1 for an id of -1
  int32_t* invalid_count;     // [1]   slots with id < -1 or >= E (treated like -1, counted)
  // Optional [E+1]: exclusive prefix of the experts whose last M-tile holds 1..block_m/2
  // rows (the grouped GEMMs run such a tile's N-tiles two at a time, one per consumer
  // warpgroup: tile_scheduler.cuh). Written when set.
  int32_t* short_tile_offsets = nullptr;
};

// Largest number of experts build_routing_plan accepts (its shared-memory histograms stay
// within the default 48 KiB per block).
constexpr int64_t kRoutingPlanMaxExperts = 4096;

// Bytes of device scratch build_routing_plan needs for `num_slots` = T*k slots and
// `num_experts` experts (0 when num_slots is 0). 4-byte alignment suffices. Throws
// megamoe::Error (INVALID_ARGUMENT) for sizes build_routing_plan would reject.
size_t routing_plan_scratch_bytes(int64_t num_slots, int64_t num_experts);

// A plan's arrays and build_routing_plan's scratch, for `num_slots` slots and `num_experts`
// experts, carved from a workspace: the one layout every caller of the plan uses.
struct RoutingPlanWorkspace {
  RoutingPlan plan;
  void* scratch;
};
RoutingPlanWorkspace carve_routing_plan(WorkspaceCarver& carver, int64_t num_slots,
                                        int64_t num_experts);

// topk_ids: device [T, k] int32 (ids_are_int64 = false) or int64, contiguous. T >= 0,
// k >= 1, T*k < 2^31, 1 <= E <= kRoutingPlanMaxExperts, block_m >= 1. `scratch` holds at
// least routing_plan_scratch_bytes(T*k, E) bytes (may be null when that is 0). All outputs
// of `plan` are overwritten; with T*k = 0 only the counts, offsets and invalid_count are
// written (zeros) and the [T*k] arrays may be null. Throws megamoe::Error on bad arguments
// or a failed launch.
void build_routing_plan(const void* topk_ids, bool ids_are_int64, int64_t T, int64_t k, int64_t E,
                        int32_t block_m, const RoutingPlan& plan, void* scratch,
                        cudaStream_t stream);

}  // namespace megamoe
