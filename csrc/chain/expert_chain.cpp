#include "chain/expert_chain.h"

#include "kernels/common/gather_padded.h"
#include "kernels/sm90/gemm.h"

namespace megamoe::chain {
namespace {

using sm90::RowLayout;

// An M-grouped GEMM over the rows: A with k columns, the experts' weights b, and
// C = c [rows, n] in row order.
sm90::MGroupedGemmArgs over_rows(const Rows& r, const sm90::MGroupedA& a,
                                 const __nv_bfloat16* b, int64_t k, int64_t n,
                                 __nv_bfloat16* c) {
  sm90::MGroupedGemmArgs g;
  g.groups = {r.num_experts, r.plan.expert_offsets, r.plan.tile_offsets, r.rows};
  g.a = a;
  g.b = b;
  g.k = k;
  g.n = n;
  g.c = {c, n, r.rows, RowLayout::kSorted};
  return g;
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
  sm90::m_grouped_gemm_nt_swiglu(
      over_rows(rows, gathered(rows, rows.x), w.w_gate_up, H, I, b.activation), saved_h, stream);
  const sm90::MGroupedA activation{b.activation, rows.rows, RowLayout::kSorted, nullptr};
  sm90::m_grouped_gemm_nt(over_rows(rows, activation, w.w_down, I, H, b.out), stream);
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
    sm90::m_grouped_gemm_nt(over_rows(rows, gathered(rows, rows.x), w.w_gate_up, H, 2 * I, b.h),
                            stream);
    h = b.h;
  }

  // z = w_down^T dy (dy rows gathered, w_down read N-major) -> dh and a, padded since they
  // feed the weight gradients, and the dp partials.
  sm90::MGroupedGemmArgs l2 = over_rows(rows, gathered(rows, rows.dy), w.w_down, H, I, nullptr);
  l2.c = {b.dh, 2 * I, b.padded_rows, RowLayout::kPadded};
  sm90::m_grouped_gemm_nn_swiglu_backward(
      l2, {h, rows.slot_weights, rows.plan.row_slot, b.dp_partial, b.a}, stream);

  if (!dx_rows) return;
  // dx rows = dh . w_gate_up (w_gate_up read N-major: K = 2I, N = H), in row order.
  const sm90::MGroupedA dh{b.dh, b.padded_rows, RowLayout::kPadded, nullptr};
  sm90::MGroupedGemmArgs l1_dgrad = over_rows(rows, dh, w.w_gate_up, 2 * I, H, b.token_rows);
  l1_dgrad.groups.rows = b.padded_rows;  // A's padded rows, from which the grid is sized
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
