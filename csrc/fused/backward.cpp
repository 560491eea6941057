#include "fused/backward.h"

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/combine_rows.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/slot_reduce.h"
#include "kernels/sm90/grouped_gemm.h"

namespace megamoe::fused {

void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
              bool ids_are_int64, const float* topk_weights, const __nv_bfloat16* w_gate_up,
              const __nv_bfloat16* w_down, const __nv_bfloat16* saved_h, int64_t T, int64_t k,
              int64_t H, int64_t I, int64_t E, const BackwardBuffers& b,
              const BackwardOutputs& out, cudaStream_t stream) {
  if (H % 128 || I % 128) throw_invalid("fused backward: H and I must be multiples of 128");
  if (T == 0) {  // no rows: bf16 weight gradients are zeros, fp32 ones get nothing added
    if (out.d_w_gate_up.bf16 != nullptr) {
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(out.d_w_gate_up.bf16, 0, E * 2 * I * H * 2, stream));
    }
    if (out.d_w_down.bf16 != nullptr) {
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(out.d_w_down.bf16, 0, E * H * I * 2, stream));
    }
    return;
  }
  const int64_t slots = T * k;
  const int64_t padded = padded_rows_bound(slots, E);
  build_routing_plan(topk_ids, ids_are_int64, T, k, E, sm90::kGroupedGemmBlockM, b.plan,
                     b.plan_scratch, stream);

  sm90::GroupedGemmArgs rows{};
  rows.a_source_rows = T;
  rows.a_rows = slots;
  rows.num_experts = E;
  rows.expert_offsets = b.plan.expert_offsets;
  rows.tile_offsets = b.plan.tile_offsets;

  // h = [gate | up] of every (token, expert) row: saved by the forward, or recomputed.
  const __nv_bfloat16* h = saved_h;
  if (h == nullptr) {
    sm90::GroupedGemmArgs l1 = rows;
    l1.a = x;
    l1.a_row_index = b.plan.row_token;
    l1.b = w_gate_up;
    l1.b_rows_per_expert = 2 * I;
    l1.k = H;
    l1.c = b.h;
    l1.ldc = 2 * I;
    sm90::grouped_gemm(l1, stream);
    h = b.h;
  }

  // z = w_down^T dy -> dh and a (padded: they feed the weight gradients) and dp partials.
  sm90::GroupedGemmArgs l2 = rows;
  l2.a = dy;
  l2.a_row_index = b.plan.row_token;
  l2.b = w_down;
  l2.k = H;
  l2.n = I;
  l2.c_padded = true;
  l2.c_rows = padded;
  sm90::grouped_gemm_swiglu_backward(
      l2, {h, b.dh, topk_weights, b.plan.row_slot, b.dp_partial, b.a}, stream);

  if (out.dx != nullptr) {
    // dx rows = dh . w_gate_up (w_gate_up read N-major: K = 2I, N = H), then combined.
    sm90::GroupedGemmArgs l1_dgrad = rows;
    l1_dgrad.a = b.dh;
    l1_dgrad.a_padded = true;
    l1_dgrad.a_rows = padded;
    l1_dgrad.b = w_gate_up;
    l1_dgrad.k = 2 * I;
    l1_dgrad.n = H;
    l1_dgrad.c = b.token_rows;
    l1_dgrad.ldc = H;
    l1_dgrad.c_rows = slots;
    sm90::grouped_gemm_b_n_major(l1_dgrad, stream);
    combine_rows(b.token_rows, H, b.plan.slot_row, nullptr, false, T, k, out.dx, stream);
  }
  if (out.d_topk_weights != nullptr) {
    reduce_slot_partials(b.dp_partial, sm90::swiglu_backward_n_tiles(I), b.plan.slot_row,
                         slots, out.d_topk_weights, stream);
  }

  const auto wgrad = [&](const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, int64_t m,
                         int64_t n, const WeightGrad& g) {
    sm90::WgradArgs w{lhs, rhs, padded, m, n, E, b.plan.tile_offsets, g.bf16};
    w.c_accumulate = g.f32;
    sm90::grouped_gemm_wgrad(w, stream);
  };
  if (out.d_w_down.bf16 != nullptr || out.d_w_down.f32 != nullptr) {
    gather_rows_padded(dy, H, b.plan, E, topk_weights, padded, b.token_rows, stream);
    wgrad(b.token_rows, b.a, H, I, out.d_w_down);
  }
  if (out.d_w_gate_up.bf16 != nullptr || out.d_w_gate_up.f32 != nullptr) {
    gather_rows_padded(x, H, b.plan, E, nullptr, padded, b.token_rows, stream);
    wgrad(b.dh, b.token_rows, 2 * I, H, out.d_w_gate_up);
  }
}

}  // namespace megamoe::fused
