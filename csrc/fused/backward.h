// The fused layer's backward on one GPU, recompute mode (the forward keeps only its inputs):
//   1. routing plan;                L1 recompute h = [g | u] (x rows gathered in the GEMM);
//   2. dgrad of L2:                 z = w_down^T dy (dy rows gathered, w_down read N-major),
//      epilogue: SwiGLU backward -> dh, a = silu(g) u, per-tile partials of dp = <z, a>;
//   3. dgrad of L1:                 dx rows = dh . w_gate_up (read N-major), then the
//      deterministic combine -> dx, and a fixed-order reduction -> d topk_weights;
//   4. weight gradients (K-grouped over each expert's rows, zero-padded to 128):
//      dW_down = (p dy)^T a, dW_gate_up = dh^T x.
// Internal: the C ABI entry and the Python autograd registration are still to come.
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
  __nv_bfloat16* h;       // [T*k, 2I] recomputed L1 output
  __nv_bfloat16* dh;      // [P, 2I] padded
  __nv_bfloat16* a;       // [P, I] padded
  __nv_bfloat16* dxs;     // [T*k, H] per-row dx before the combine
  float* dp_partial;      // [T*k, sm90::swiglu_backward_n_tiles(I)]
  __nv_bfloat16* dy_p;    // [P, H] padded p * dy rows
  __nv_bfloat16* xs;      // [P, H] padded x rows
};

// x, dy [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] bf16; topk_ids [T, k] int32/int64;
// topk_weights [T, k] fp32. Writes dx [T, H] bf16, d_topk_weights [T, k] fp32 (0 for an id
// of -1), d_w_gate_up [E, 2I, H] and d_w_down [E, H, I] bf16 (zeros for experts without
// tokens); the weight gradients are skipped when their pointers are null. H, I multiples of
// 128.
void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
              bool ids_are_int64, const float* topk_weights, const __nv_bfloat16* w_gate_up,
              const __nv_bfloat16* w_down, int64_t T, int64_t k, int64_t H, int64_t I,
              int64_t E, const BackwardBuffers& buffers, __nv_bfloat16* dx,
              float* d_topk_weights, __nv_bfloat16* d_w_gate_up, __nv_bfloat16* d_w_down,
              cudaStream_t stream);

}  // namespace megamoe::fused
