// The expert chain: the grouped GEMMs of the experts, forward and backward, over the rows
// this GPU computes. The one-GPU layer (fused/layer.cpp) and the expert-parallel layer
// (comm/ep_layer.cpp) differ only in how the rows arrive (a routing plan over local x, or
// the rows received from every rank) and where the results go (a combine into y and dx
// here, or the combine send to the tokens' ranks). Both run this code in between, so their
// GEMMs see the same operands in the same order: an expert's rows in the same order give
// bitwise the same results on either path.
//
//   forward:  L1 + SwiGLU (A rows gathered from the token matrix; optionally saving h) ->
//             activation; L2 -> the output rows, unweighted, one per row.
//   backward: L1 recomputed unless h was saved; dgrad of L2 with the SwiGLU backward
//             (dh and a padded, per-tile partials of dp); dgrad of L1 -> the dx rows;
//             then, once the caller has taken the dx rows and dp partials, the weight
//             gradients (K-grouped over each expert's padded rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/workspace.h"
#include "kernels/common/routing_plan.h"

namespace megamoe::chain {

// The rows, in expert-sorted order: expert e's rows are [expert_offsets[e],
// expert_offsets[e+1]) with their M-tiles (128 rows) from tile_offsets[e]; row r is row
// row_token[r] of the token matrices and carries the router weight
// slot_weights[row_slot[r]].
struct Rows {
  // expert_offsets, tile_offsets [E+1], row_token [rows]; backward: row_slot [rows]. The
  // other members are not read.
  RoutingPlan plan;
  int64_t rows;               // rows allocated (at least expert_offsets[E])
  int64_t num_experts;        // E of the offsets, of the weights and of their gradients
  int64_t tokens;             // rows of x and dy
  const __nv_bfloat16* x;     // [tokens, H]
  const __nv_bfloat16* dy;    // [tokens, H], backward only
  const float* slot_weights;  // backward only
};

// The experts' weights: w_gate_up [E, 2I, H] and w_down [E, H, I] bf16.
struct Experts {
  const __nv_bfloat16* w_gate_up;
  const __nv_bfloat16* w_down;
  int64_t hidden;        // H, a multiple of 128
  int64_t intermediate;  // I, a multiple of 128
};

// A weight gradient: written in bf16 into `bf16`, or added into the fp32 buffer `f32`
// (one of them; neither skips it).
struct WeightGrad {
  __nv_bfloat16* bf16 = nullptr;
  float* f32 = nullptr;

  // The gradient of a tensor of `data`: added into when fp32, written when bf16.
  static WeightGrad of(void* data, bool is_fp32) {
    WeightGrad g;
    if (is_fp32) {
      g.f32 = static_cast<float*>(data);
    } else {
      g.bf16 = static_cast<__nv_bfloat16*>(data);
    }
    return g;
  }
  bool wanted() const { return bf16 != nullptr || f32 != nullptr; }
};

struct ForwardBuffers {
  __nv_bfloat16* activation;  // [rows, I] silu(gate) * up
  __nv_bfloat16* out;         // [rows, H] the L2 output rows
};
ForwardBuffers carve_forward(WorkspaceCarver& carver, int64_t rows, int64_t H, int64_t I);

// saved_h: null, or [rows, 2I] that receives h = [gate | up] for a backward in saved mode.
void forward(const Rows& rows, const Experts& w, const ForwardBuffers& b,
             __nv_bfloat16* saved_h, cudaStream_t stream);

// The backward's rows: unpadded ones in row order, padded ones (padded_rows =
// padded_rows_bound(rows, E)) at tile_offsets[e] * 128 + i, zeros in the pad rows, for the
// weight gradients.
struct BackwardBuffers {
  __nv_bfloat16* h;         // [rows, 2I] recomputed L1 output (null when h is saved)
  __nv_bfloat16* dh;        // [padded_rows, 2I]
  __nv_bfloat16* a;         // [padded_rows, I] silu(g) u
  float* dp_partial;        // [rows, dp_parts]
  // [padded_rows, H], used three times in stream order: the dx rows ([rows, H]) until the
  // caller has consumed them, then the p * dy rows of dW_down, then the x rows of
  // dW_gate_up.
  __nv_bfloat16* token_rows;
  int64_t padded_rows;
  int64_t dp_parts;         // partials of dp per row: one per N-tile of I
};
BackwardBuffers carve_backward(WorkspaceCarver& carver, int64_t rows, int64_t num_experts,
                               int64_t H, int64_t I, bool h_saved);

// L1 recompute (unless saved_h, the forward's h for the same rows), dgrad of L2 with the
// SwiGLU backward, and, when dx_rows, dgrad of L1 into b.token_rows. Afterwards, in stream
// order, b.dp_partial holds each row's dp partials and b.token_rows its dx row.
void backward_dgrad(const Rows& rows, const Experts& w, const __nv_bfloat16* saved_h,
                    const BackwardBuffers& b, bool dx_rows, cudaStream_t stream);

// The weight gradients dW_down = (p dy)^T a and dW_gate_up = dh^T x ([E, H, I] and
// [E, 2I, H]; zeros, or nothing added, for experts without rows). Overwrites b.token_rows:
// launch it after whatever reads the dx rows.
void backward_wgrad(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                    const WeightGrad& d_w_gate_up, const WeightGrad& d_w_down,
                    cudaStream_t stream);

}  // namespace megamoe::chain
