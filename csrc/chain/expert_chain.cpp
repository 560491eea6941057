#include "chain/expert_chain.h"

#include "kernels/common/gather_padded.h"
#include "kernels/sm90/grouped_gemm.h"

namespace megamoe::chain {
namespace {

// The rows as a grouped GEMM's M dimension, A materialised in row order.
sm90::GroupedGemmArgs row_args(const Rows& r) {
  sm90::GroupedGemmArgs a{};
  a.a_rows = r.rows;
  a.num_experts = r.num_experts;
  a.expert_offsets = r.plan.expert_offsets;
  a.tile_offsets = r.plan.tile_offsets;
  return a;
}

// The same, A gathered from a token matrix by the GEMM's producer (no permuted copy of the
// tokens is written).
sm90::GroupedGemmArgs gathered_args(const Rows& r, const __nv_bfloat16* tokens) {
  sm90::GroupedGemmArgs a = row_args(r);
  a.a = tokens;
  a.a_row_index = r.plan.row_token;
  a.a_source_rows = r.tokens;
  return a;
}

}  // namespace

ForwardBuffers carve_forward(WorkspaceCarver& carver, int64_t rows, int64_t H, int64_t I) {
  ForwardBuffers b{};
  b.activation = carver.take<__nv_bfloat16>(rows * I);
  b.out = carver.take<__nv_bfloat16>(rows * H);
  return b;
}

void forward(const Rows& rows, const Experts& w, const ForwardBuffers& b,
             __nv_bfloat16* saved_h, cudaStream_t stream) {
  const int64_t H = w.hidden, I = w.intermediate;
  sm90::GroupedGemmArgs l1 = gathered_args(rows, rows.x);
  l1.b = w.w_gate_up;
  l1.b_rows_per_expert = 2 * I;
  l1.k = H;
  l1.c = b.activation;
  l1.ldc = I;
  l1.h_out = saved_h;
  sm90::grouped_gemm_swiglu(l1, I, stream);

  sm90::GroupedGemmArgs l2 = row_args(rows);
  l2.a = b.activation;
  l2.b = w.w_down;
  l2.b_rows_per_expert = H;
  l2.k = I;
  l2.c = b.out;
  l2.ldc = H;
  sm90::grouped_gemm(l2, stream);
}

BackwardBuffers carve_backward(WorkspaceCarver& carver, int64_t rows, int64_t num_experts,
                               int64_t H, int64_t I, bool h_saved) {
  BackwardBuffers b{};
  b.padded_rows = padded_rows_bound(rows, num_experts);
  b.dp_parts = sm90::swiglu_backward_n_tiles(I);
  b.h = h_saved ? nullptr : carver.take<__nv_bfloat16>(rows * 2 * I);
  b.dh = carver.take<__nv_bfloat16>(b.padded_rows * 2 * I);
  b.a = carver.take<__nv_bfloat16>(b.padded_rows * I);
  b.dp_partial = carver.take<float>(rows * b.dp_parts);
  b.token_rows = carver.take<__nv_bfloat16>(b.padded_rows * H);
  return b;
}

void backward_dgrad(const Rows& rows, const Experts& w, const __nv_bfloat16* saved_h,
                    const BackwardBuffers& b, bool dx_rows, cudaStream_t stream) {
  const int64_t H = w.hidden, I = w.intermediate;
  // h = [gate | up] of every row: saved by the forward, or recomputed (x rows gathered).
  const __nv_bfloat16* h = saved_h;
  if (h == nullptr) {
    sm90::GroupedGemmArgs l1 = gathered_args(rows, rows.x);
    l1.b = w.w_gate_up;
    l1.b_rows_per_expert = 2 * I;
    l1.k = H;
    l1.c = b.h;
    l1.ldc = 2 * I;
    sm90::grouped_gemm(l1, stream);
    h = b.h;
  }

  // z = w_down^T dy (dy rows gathered, w_down read N-major) -> dh and a, padded since they
  // feed the weight gradients, and the dp partials.
  sm90::GroupedGemmArgs l2 = gathered_args(rows, rows.dy);
  l2.b = w.w_down;
  l2.k = H;
  l2.n = I;
  l2.c_padded = true;
  l2.c_rows = b.padded_rows;
  sm90::grouped_gemm_swiglu_backward(
      l2, {h, b.dh, rows.slot_weights, rows.plan.row_slot, b.dp_partial, b.a}, stream);

  if (!dx_rows) return;
  // dx rows = dh . w_gate_up (w_gate_up read N-major: K = 2I, N = H), in row order.
  sm90::GroupedGemmArgs l1_dgrad = row_args(rows);
  l1_dgrad.a = b.dh;
  l1_dgrad.a_padded = true;
  l1_dgrad.a_rows = b.padded_rows;
  l1_dgrad.b = w.w_gate_up;
  l1_dgrad.k = 2 * I;
  l1_dgrad.n = H;
  l1_dgrad.c = b.token_rows;
  l1_dgrad.ldc = H;
  l1_dgrad.c_rows = rows.rows;
  sm90::grouped_gemm_b_n_major(l1_dgrad, stream);
}

void backward_wgrad(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                    const WeightGrad& d_w_gate_up, const WeightGrad& d_w_down,
                    cudaStream_t stream) {
  const int64_t H = w.hidden, I = w.intermediate, E = rows.num_experts;
  const auto wgrad = [&](const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, int64_t m,
                         int64_t n, const WeightGrad& g) {
    sm90::WgradArgs args{lhs, rhs, b.padded_rows, m, n, E, rows.plan.tile_offsets, g.bf16};
    args.c_accumulate = g.f32;
    sm90::grouped_gemm_wgrad(args, stream);
  };
  if (d_w_down.wanted()) {
    gather_rows_padded(rows.dy, H, rows.plan, E, rows.slot_weights, b.padded_rows,
                       b.token_rows, stream);
    wgrad(b.token_rows, b.a, H, I, d_w_down);
  }
  if (d_w_gate_up.wanted()) {
    gather_rows_padded(rows.x, H, rows.plan, E, nullptr, b.padded_rows, b.token_rows, stream);
    wgrad(b.dh, b.token_rows, 2 * I, H, d_w_gate_up);
  }
}

}  // namespace megamoe::chain
