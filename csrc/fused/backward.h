// The fused layer's backward on one GPU:
//   1. routing plan (rebuilt: deterministic, so the rows match the forward's);
//      L1 recompute h = [g | u] (x rows gathered in the GEMM), unless the forward saved h;
//   2. dgrad of L2:                 z = w_down^T dy (dy rows gathered, w_down read N-major),
//      epilogue: SwiGLU backward -> dh, a = silu(g) u, per-tile partials of dp = <z, a>;
//   3. dgrad of L1:                 dx rows = dh . w_gate_up (read N-major), then the
//      deterministic combine -> dx, and a fixed-order reduction -> d topk_weights;
//   4. weight gradients (K-grouped over each expert's rows, zero-padded to 128):
//      dW_down = (p dy)^T a, dW_gate_up = dh^T x.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/routing_plan.h"

namespace megamoe::fused {

// Device memory, caller-allocated, no initialisation needed. P = padded_rows_bound(T*k, E).
struct BackwardBuffers {
  RoutingPlan plan;       // block_m = 128
  void* plan_scratch;     // routing_plan_scratch_bytes(T*k, E)
  __nv_bfloat16* h;       // [T*k, 2I] recomputed L1 output (unused when h is saved)
  __nv_bfloat16* dh;      // [P, 2I] padded
  __nv_bfloat16* a;       // [P, I] padded
  float* dp_partial;      // [T*k, sm90::swiglu_backward_n_tiles(I)]
  // [P, H]: the dx rows before the combine, then the padded p * dy rows, then the padded
  // x rows (each consumed before the next is written, in stream order).
  __nv_bfloat16* token_rows;
};

// A weight gradient: written as bf16 into `bf16`, or added into the fp32 buffer `f32`
// (one of them, or neither to skip it).
struct WeightGrad {
  __nv_bfloat16* bf16 = nullptr;
  float* f32 = nullptr;
};

struct BackwardOutputs {
  __nv_bfloat16* dx;        // [T, H], or null to skip
  float* d_topk_weights;    // [T, k] (0 for an id of -1), or null to skip
  WeightGrad d_w_gate_up;   // [E, 2I, H]; zeros (or nothing added) for experts without tokens
  WeightGrad d_w_down;      // [E, H, I]
};

// x, dy [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] bf16; topk_ids [T, k] int32/int64;
// topk_weights [T, k] fp32. saved_h: the [T*k, 2I] h the forward wrote (grouped_gemm_swiglu's
// h_out with the same ids), or null to recompute it into buffers.h. H, I multiples of 128.
void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
              bool ids_are_int64, const float* topk_weights, const __nv_bfloat16* w_gate_up,
              const __nv_bfloat16* w_down, const __nv_bfloat16* saved_h, int64_t T, int64_t k,
              int64_t H, int64_t I, int64_t E, const BackwardBuffers& buffers,
              const BackwardOutputs& out, cudaStream_t stream);

}  // namespace megamoe::fused
