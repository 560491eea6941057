// Token rows gathered into the backward's padded expert-sorted layout: expert e's rows at
// tile_offsets[e] * 128 + i, zeros in the pad rows up to its next multiple of 128 (so a
// weight-gradient GEMM can read whole 64-row blocks of one expert). Internal; asynchronous
// on `stream`, no host sync, capturable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/routing_plan.h"

namespace megamoe {

// out[tile_offsets[e] * 128 + i, :] = s * src[row_token[expert_offsets[e] + i], :] for the
// expert's rows i, with s = slot_weights[row_slot[row]] (or 1 when slot_weights is null);
// zeros in pad rows. Rows from tile_offsets[E] * 128 to padded_rows are left untouched.
// bf16 rows of H elements (H a multiple of 8, 16-byte aligned rows).
void gather_rows_padded(const __nv_bfloat16* src, int64_t H, const RoutingPlan& plan,
                        int64_t num_experts, const float* slot_weights, int64_t padded_rows,
                        __nv_bfloat16* out, cudaStream_t stream);

// Rows a padded buffer needs at most: tile_offsets[E] <= ceil(slots / 128) + E.
inline int64_t padded_rows_bound(int64_t slots, int64_t num_experts) {
  return ((slots + 127) / 128 + num_experts) * 128;
}

}  // namespace megamoe
