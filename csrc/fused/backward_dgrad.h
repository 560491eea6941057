// The fused layer's data-gradient half of the backward on one GPU (dx and d topk_weights):
// recompute L1 (gathering x rows), dgrad of L2 fused with the SwiGLU backward and dp,
// dgrad of L1, and the deterministic combine of dx. Internal: the weight gradients and the
// C ABI entry are still to come (docs/fused-backward-plan.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/routing_plan.h"

namespace megamoe::fused {

struct DgradBuffers {     // device memory, caller-allocated; no initialisation needed
  RoutingPlan plan;       // as for the forward, block_m = 128
  void* plan_scratch;     // routing_plan_scratch_bytes(T*k, E)
  __nv_bfloat16* h;       // [T*k, 2I] recomputed L1 output
  __nv_bfloat16* dh;      // [T*k, 2I]
  __nv_bfloat16* dxs;     // [T*k, H] per-row dx before the combine
  float* dp_partial;      // [T*k, sm90::swiglu_backward_n_tiles(I)]
};

// x, dy [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] bf16; topk_ids [T, k] int32/int64;
// topk_weights [T, k] fp32. Writes dx [T, H] bf16 and d_topk_weights [T, k] fp32 (0 for a
// slot with id -1). H and I multiples of 128.
void backward_dgrad(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
                    bool ids_are_int64, const float* topk_weights,
                    const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t T,
                    int64_t k, int64_t H, int64_t I, int64_t E, const DgradBuffers& buffers,
                    __nv_bfloat16* dx, float* d_topk_weights, cudaStream_t stream);

}  // namespace megamoe::fused
