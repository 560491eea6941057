#include "chain/expert_chain.h"

#include "kernels/common/gather_padded.h"
#include "kernels/sm90/gemm.h"

namespace megamoe::chain {
namespace {

using sm90::RowLayout;

// The rows as the M dimension of an M-grouped GEMM. `allocated` (at least the sorted rows)
// sizes the GEMM's grid: the dgrad of L1, whose A is padded, passes the padded rows.
sm90::ExpertGroups groups_of(const Rows& r, int64_t allocated) {
  return {r.num_experts, r.plan.expert_offsets, r.plan.tile_offsets, allocated};
}

// A gathered from a token matrix by the GEMM's producer (no permuted copy of the tokens is
// written).
sm90::MGroupedA gathered(const Rows& r, const __nv_bfloat16* tokens) {
  return {tokens, r.tokens, RowLayout::kSorted, r.plan.row_token};
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
  sm90::MGroupedGemmArgs l1;
  l1.groups = groups_of(rows, rows.rows);
  l1.a = gathered(rows, rows.x);
  l1.b = w.w_gate_up;
  l1.k = H;
  l1.n = I;
  l1.c = {b.activation, I, rows.rows, RowLayout::kSorted};
  sm90::m_grouped_gemm_nt_swiglu(l1, saved_h, stream);

  sm90::MGroupedGemmArgs l2;
  l2.groups = groups_of(rows, rows.rows);
  l2.a = {b.activation, rows.rows, RowLayout::kSorted, nullptr};
  l2.b = w.w_down;
  l2.k = I;
  l2.n = H;
  l2.c = {b.out, H, rows.rows, RowLayout::kSorted};
  sm90::m_grouped_gemm_nt(l2, stream);
}

BackwardBuffers carve_backward(WorkspaceCarver& carver, int64_t rows, int64_t num_experts,
                               int64_t H, int64_t I, bool h_saved) {
  BackwardBuffers b{};
  b.padded_rows = padded_rows_bound(rows, num_experts);
  b.dp_parts = sm90::swiglu_backward_dp_columns(I);
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
    sm90::MGroupedGemmArgs l1;
    l1.groups = groups_of(rows, rows.rows);
    l1.a = gathered(rows, rows.x);
    l1.b = w.w_gate_up;
    l1.k = H;
    l1.n = 2 * I;
    l1.c = {b.h, 2 * I, rows.rows, RowLayout::kSorted};
    sm90::m_grouped_gemm_nt(l1, stream);
    h = b.h;
  }

  // z = w_down^T dy (dy rows gathered, w_down read N-major) -> dh and a, padded since they
  // feed the weight gradients, and the dp partials.
  sm90::MGroupedGemmArgs l2;
  l2.groups = groups_of(rows, rows.rows);
  l2.a = gathered(rows, rows.dy);
  l2.b = w.w_down;
  l2.k = H;
  l2.n = I;
  l2.c = {b.dh, 2 * I, b.padded_rows, RowLayout::kPadded};
  sm90::m_grouped_gemm_nn_swiglu_backward(
      l2, {h, rows.slot_weights, rows.plan.row_slot, b.dp_partial, b.a}, stream);

  if (!dx_rows) return;
  // dx rows = dh . w_gate_up (w_gate_up read N-major: K = 2I, N = H), in row order.
  sm90::MGroupedGemmArgs l1_dgrad;
  l1_dgrad.groups = groups_of(rows, b.padded_rows);
  l1_dgrad.a = {b.dh, b.padded_rows, RowLayout::kPadded, nullptr};
  l1_dgrad.b = w.w_gate_up;
  l1_dgrad.k = 2 * I;
  l1_dgrad.n = H;
  l1_dgrad.c = {b.token_rows, H, rows.rows, RowLayout::kSorted};
  sm90::m_grouped_gemm_nn(l1_dgrad, stream);
}

void backward_wgrad(const Rows& rows, const Experts& w, const BackwardBuffers& b,
                    const WeightGrad& d_w_gate_up, const WeightGrad& d_w_down,
                    cudaStream_t stream) {
  const int64_t H = w.hidden, I = w.intermediate, E = rows.num_experts;
  const auto wgrad = [&](const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, int64_t m,
                         int64_t n, const WeightGrad& g) {
    sm90::KGroupedGemmArgs args{lhs, rhs, b.padded_rows, m, n, E, rows.plan.tile_offsets};
    args.c = g.bf16;
    args.c_accumulate = g.f32;
    sm90::k_grouped_gemm_tn(args, stream);
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
