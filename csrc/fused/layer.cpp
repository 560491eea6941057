#include "fused/layer.h"

#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/combine_rows.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/routing_plan.h"
#include "kernels/common/slot_reduce.h"
#include "kernels/sm90/gemm.h"

namespace megamoe::fused {
namespace {

constexpr int64_t kMaxTopk = 16;
constexpr int64_t kDimMultiple = 128;
constexpr int64_t kMaxExperts = 1024;

enum class Pass { kForward, kBackward, kBackwardSavedH };

// One call's workspace: the plan, then the chain's buffers over the T*k rows.
struct Workspace {
  RoutingPlanWorkspace plan;
  chain::ForwardBuffers forward;
  chain::BackwardBuffers backward;
};

// Shared by the size queries (a counting carver) and the calls.
Workspace carve(WorkspaceCarver& c, int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                Pass pass, chain::Precision precision) {
  check_sizes(T, k, H, I, E);
  Workspace w{};
  w.plan = carve_routing_plan(c, T * k, E);
  if (pass == Pass::kForward) {
    w.forward = chain::carve_forward(c, T * k, T, H, I, precision);
  } else {
    w.backward = chain::carve_backward(c, T * k, T, E, H, I, pass == Pass::kBackwardSavedH,
                                       precision);
  }
  return w;
}

Workspace carve_checked(void* workspace, size_t bytes, int64_t T, int64_t k, int64_t H,
                        int64_t I, int64_t E, Pass pass, chain::Precision precision,
                        const char* size_query) {
  WorkspaceCarver c(workspace, bytes);
  const Workspace w = carve(c, T, k, H, I, E, pass, precision);
  c.require_fits(size_query);
  c.require_aligned_base();
  return w;
}

// Every (token, expert) row of this GPU's tokens, in the plan's expert-sorted order.
chain::Rows rows_of(const RoutingPlan& plan, int64_t T, int64_t k, int64_t E,
                    const __nv_bfloat16* x, const __nv_bfloat16* dy,
                    const float* topk_weights) {
  chain::Rows r{};
  r.plan = plan;
  r.topk = k;
  r.rows = T * k;
  r.num_experts = E;
  r.tokens = T;
  r.x = x;
  r.dy = dy;
  r.slot_weights = topk_weights;
  r.row_token_inverts_slot_row = true;  // build_routing_plan's
  return r;
}

chain::Experts experts_of(const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t H,
                          int64_t I, const Fp8Experts& fp8) {
  chain::Experts e{w_gate_up, w_down, H, I};
  e.precision = fp8.precision;
  e.fp8_gate_up = fp8.gate_up;
  e.fp8_down = fp8.down;
  return e;
}

}  // namespace

void check_sizes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E) {
  if (T < 0) throw_invalid("tokens: expected >= 0, got " + std::to_string(T));
  if (k < 1 || k > kMaxTopk) {
    throw_invalid("topk: the fused layer takes 1 <= k <= 16, got " + std::to_string(k));
  }
  if (H < kDimMultiple || H % kDimMultiple || I < kDimMultiple || I % kDimMultiple) {
    throw_invalid("the fused layer needs H and I to be positive multiples of 128, got H=" +
                  std::to_string(H) + ", I=" + std::to_string(I));
  }
  if (E < 1 || E > kMaxExperts) {
    throw_invalid("num_experts: the fused layer takes 1 <= E <= 1024, got " + std::to_string(E));
  }
  // Padded rows (the backward) stay below 2^31 as well.
  if (padded_rows_bound(T * k, E) > INT32_MAX / 2) {
    throw_invalid("tokens * topk = " + std::to_string(T * k) +
                  " is more than int32 row indices hold");
  }
}

size_t forward_workspace_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                               chain::Precision precision) {
  WorkspaceCarver c;
  carve(c, T, k, H, I, E, Pass::kForward, precision);
  return c.bytes();
}

size_t backward_workspace_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                                bool h_saved, chain::Precision precision) {
  WorkspaceCarver c;
  carve(c, T, k, H, I, E, h_saved ? Pass::kBackwardSavedH : Pass::kBackward, precision);
  return c.bytes();
}

void forward(const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const void* topk_weights, bool weights_are_bf16, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t k, int64_t H, int64_t I,
             int64_t E, __nv_bfloat16* y, __nv_bfloat16* saved_h, void* workspace,
             size_t workspace_bytes, cudaStream_t stream, const Fp8Experts& fp8) {
  const Workspace w = carve_checked(workspace, workspace_bytes, T, k, H, I, E, Pass::kForward,
                                    fp8.precision,
                                    fp8.precision == chain::Precision::kBf16
                                        ? "megamoe_fused_workspace_size"
                                        : "megamoe_fused_fp8_workspace_size");
  if (T == 0) return;
  const RoutingPlan& plan = w.plan.plan;
  build_routing_plan(topk_ids, ids_are_int64, T, k, E, sm90::kGemmBlockM, plan,
                     w.plan.scratch, stream);
  // The forward reads no router weight: they are applied by the combine. Without y, only
  // what saved_h needs (L1): L2 and the combine make y alone.
  chain::forward(rows_of(plan, T, k, E, x, nullptr, nullptr),
                 experts_of(w_gate_up, w_down, H, I, fp8), w.forward, saved_h, stream, nullptr,
                 y != nullptr);
  if (y == nullptr) return;
  combine_rows(w.forward.out, H, plan.slot_row, topk_weights, weights_are_bf16, T, k, y,
               stream);
}

void backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const void* topk_ids,
              bool ids_are_int64, const float* topk_weights, const __nv_bfloat16* w_gate_up,
              const __nv_bfloat16* w_down, const __nv_bfloat16* saved_h, int64_t T, int64_t k,
              int64_t H, int64_t I, int64_t E, const BackwardOutputs& out, void* workspace,
              size_t workspace_bytes, cudaStream_t stream, const Fp8Experts& fp8) {
  const Workspace w =
      carve_checked(workspace, workspace_bytes, T, k, H, I, E,
                    saved_h != nullptr ? Pass::kBackwardSavedH : Pass::kBackward,
                    fp8.precision,
                    fp8.precision == chain::Precision::kBf16
                        ? "megamoe_fused_backward_workspace_size"
                        : "megamoe_fused_fp8_backward_workspace_size");
  if (T == 0) {  // no rows: bf16 weight gradients are zeros, fp32 ones get nothing added
    if (out.d_w_gate_up.bf16 != nullptr) {
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(out.d_w_gate_up.bf16, 0, E * 2 * I * H * 2, stream));
    }
    if (out.d_w_down.bf16 != nullptr) {
      MEGAMOE_CUDA_CHECK(cudaMemsetAsync(out.d_w_down.bf16, 0, E * H * I * 2, stream));
    }
    return;
  }
  const RoutingPlan& plan = w.plan.plan;
  build_routing_plan(topk_ids, ids_are_int64, T, k, E, sm90::kGemmBlockM, plan,
                     w.plan.scratch, stream);
  const chain::Rows rows = rows_of(plan, T, k, E, x, dy, topk_weights);
  const chain::Experts experts = experts_of(w_gate_up, w_down, H, I, fp8);
  const chain::BackwardBuffers& b = w.backward;
  const chain::DgradDone done = chain::backward_dgrad(rows, experts, saved_h, b,
                                                      out.dx != nullptr, stream,
                                                      out.d_w_gate_up.wanted());
  if (out.dx != nullptr) {
    combine_rows(b.dx_rows, H, plan.slot_row, nullptr, false, T, k, out.dx, stream);
  }
  if (out.d_topk_weights != nullptr) {
    reduce_slot_partials(b.dp_partial, b.dp_parts, plan.slot_row, T * k, out.d_topk_weights,
                         stream);
  }
  chain::backward_wgrad(rows, experts, b, out.d_w_gate_up, out.d_w_down, stream, done);
}

}  // namespace megamoe::fused
