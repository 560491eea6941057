// Carving of the fused layer's device workspace: one caller-owned allocation, split into
// 256-byte aligned pieces. Pure arithmetic, shared by the size query and the calls.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe::fused {

struct ForwardWorkspace {
  size_t expert_counts, expert_offsets, tile_offsets;  // int32 [E], [E+1], [E+1]
  size_t row_token, row_slot, slot_row;                // int32 [T*k] each
  size_t invalid_count;                                // int32 [1]
  size_t plan_scratch;                                 // routing-plan temporaries
  size_t rows;        // bf16 [T*k, H]: the L2 output rows, in expert-sorted order
  size_t activation;  // bf16 [T*k, I]: silu(gate) * up
  size_t total;
};

ForwardWorkspace forward_workspace(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E);

}  // namespace megamoe::fused
