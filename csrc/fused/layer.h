// The fused layer on one GPU: the routing plan over this GPU's tokens, the expert chain
// (chain/expert_chain.h) on every (token, expert) row, and deterministic combines back into
// token order, all on the caller's stream.
//   forward:  plan -> chain forward -> y = the rows combined with their router weights;
//   backward: plan (rebuilt: deterministic, so the rows match the forward's) -> chain dgrad
//             -> dx = the dx rows combined in slot order, d topk_weights = the dp partials
//             reduced in a fixed order -> chain weight gradients.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "chain/expert_chain.h"

namespace megamoe::fused {

// Throws INVALID_ARGUMENT unless T >= 0, 1 <= k <= 16, H and I positive multiples of 128,
// 1 <= E <= 1024 and T*k fits the kernels' int32 row indices.
void check_sizes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E);

// The experts' GEMM precision and, for the FP8 ones, the weights' FP8 copies.
struct Fp8Experts {
  chain::Precision precision = chain::Precision::kBf16;
  chain::Fp8Weight gate_up, down;
};

// Bytes of device workspace of one call (checks the sizes first).
size_t forward_workspace_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                               chain::Precision precision = chain::Precision::kBf16);
size_t backward_workspace_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                                bool h_saved,
                                chain::Precision precision = chain::Precision::kBf16);

// x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] bf16; topk_ids [T, k] int32/int64;
// topk_weights [T, k] fp32, or bf16 when weights_are_bf16; y [T, H] bf16. saved_h: null, or
// [T*k, 2I] bf16 that receives h = [gate | up] in the layer's expert-sorted row order.
// workspace: 256-byte aligned, forward_workspace_bytes() of it.
void forward(const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const void* topk_weights, bool weights_are_bf16, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t k, int64_t H, int64_t I,
             int64_t E, __nv_bfloat16* y, __nv_bfloat16* saved_h, void* workspace,
             size_t workspace_bytes, cudaStream_t stream, const Fp8Experts& fp8 = {});

struct BackwardOutputs {
  __nv_bfloat16* dx;              // [T, H], or null to skip
  float* d_topk_weights;          // [T, k] (0 for an id of -1), or null to skip
  chain::WeightGrad d_w_gate_up;  // [E, 2I, H]; zeros (or nothing added) for unused experts
  chain::WeightGrad d_w_down;     // [E, H, I]
};

// dy [T, H] bf16 and the forward's inputs (topk_weights fp32). saved_h: null to recompute
// L1, or what forward() wrote for the same ids. workspace: 256-byte aligned,
// backward_workspace_bytes(..., saved_h != null) of it.
void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
              bool ids_are_int64, const float* topk_weights, const __nv_bfloat16* w_gate_up,
              const __nv_bfloat16* w_down, const __nv_bfloat16* saved_h, int64_t T, int64_t k,
              int64_t H, int64_t I, int64_t E, const BackwardOutputs& out, void* workspace,
              size_t workspace_bytes, cudaStream_t stream, const Fp8Experts& fp8 = {});

}  // namespace megamoe::fused
