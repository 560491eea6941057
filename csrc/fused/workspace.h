// Carving of the fused layer's device workspaces: one caller-owned allocation per call,
// split into 256-byte aligned pieces. Pure arithmetic, shared by the size queries and the
// calls.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/routing_plan.h"

namespace megamoe::fused {

// Throws INVALID_ARGUMENT unless T >= 0, 1 <= k <= 16, H and I positive multiples of 128,
// 1 <= E <= 1024 and T*k fits the kernels' int32 row indices.
void check_sizes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E);

// The routing plan's pieces, the same in the forward and the backward.
struct PlanWorkspace {
  size_t expert_counts, expert_offsets, tile_offsets;  // int32 [E], [E+1], [E+1]
  size_t row_token, row_slot, slot_row;                // int32 [T*k] each
  size_t invalid_count;                                // int32 [1]
  size_t plan_scratch;                                 // routing-plan temporaries
};

struct ForwardWorkspace {
  PlanWorkspace plan;
  size_t rows;        // bf16 [T*k, H]: the L2 output rows, in expert-sorted order
  size_t activation;  // bf16 [T*k, I]: silu(gate) * up
  size_t total;
};

// The backward's rows: unpadded ones in expert-sorted order, padded ones (P =
// padded_rows_bound(T*k, E)) at tile_offsets[e] * 128 + i, for the weight gradients.
struct BackwardWorkspace {
  PlanWorkspace plan;
  size_t h;           // bf16 [T*k, 2I] recomputed L1 output (absent when h was saved)
  size_t dh;          // bf16 [P, 2I]
  size_t a;           // bf16 [P, I] silu(g) u
  size_t dp_partial;  // fp32 [T*k, n-tiles of I]
  // bf16 [P, H], used three times in stream order: the dx rows before their combine, then
  // the p * dy rows of dW_down, then the x rows of dW_gate_up.
  size_t token_rows;
  size_t total;
};

ForwardWorkspace forward_workspace(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E);
BackwardWorkspace backward_workspace(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                                     bool h_saved);

template <class T>
T* piece(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// Throws INVALID_ARGUMENT unless `workspace` is a 256-byte aligned pointer to at least
// `needed` bytes; `size_query` names the ABI function that gives the size.
void check_workspace(const void* workspace, size_t bytes, size_t needed, const char* size_query);

// The routing plan's device pointers inside a workspace at `base`.
RoutingPlan plan_in(void* base, const PlanWorkspace& w);

}  // namespace megamoe::fused
