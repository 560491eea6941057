#include "fused/workspace.h"

#include <cuda_bf16.h>

#include <string>

#include "core/error.h"
#include "kernels/common/gather_padded.h"
#include "kernels/common/routing_plan.h"
#include "kernels/sm90/grouped_gemm.h"

namespace megamoe::fused {
namespace {

constexpr size_t kAlign = 256;
constexpr int64_t kMaxTopk = 16;
constexpr int64_t kDimMultiple = 128;
constexpr int64_t kMaxExperts = 1024;

// Hands out aligned offsets one after the other.
struct Carver {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t offset = at;
    at += (bytes + kAlign - 1) / kAlign * kAlign;
    return offset;
  }
};

PlanWorkspace carve_plan(Carver& c, int64_t slots, int64_t E) {
  PlanWorkspace w{};
  w.expert_counts = c.take(E * sizeof(int32_t));
  w.expert_offsets = c.take((E + 1) * sizeof(int32_t));
  w.tile_offsets = c.take((E + 1) * sizeof(int32_t));
  w.row_token = c.take(slots * sizeof(int32_t));
  w.row_slot = c.take(slots * sizeof(int32_t));
  w.slot_row = c.take(slots * sizeof(int32_t));
  w.invalid_count = c.take(sizeof(int32_t));
  w.plan_scratch = c.take(routing_plan_scratch_bytes(slots, E));
  return w;
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

ForwardWorkspace forward_workspace(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E) {
  check_sizes(T, k, H, I, E);
  Carver c;
  ForwardWorkspace w{};
  const auto slots = T * k;
  w.plan = carve_plan(c, slots, E);
  w.rows = c.take(slots * H * sizeof(__nv_bfloat16));
  w.activation = c.take(slots * I * sizeof(__nv_bfloat16));
  w.total = c.at;
  return w;
}

void check_workspace(const void* workspace, size_t bytes, size_t needed, const char* size_query) {
  if (workspace == nullptr || bytes < needed) {
    throw_invalid("workspace: expected " + std::to_string(needed) + " bytes (" + size_query +
                  "), got " + std::to_string(workspace == nullptr ? 0 : bytes));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    throw_invalid("workspace: expected a 256-byte aligned pointer");
  }
}

RoutingPlan plan_in(void* base, const PlanWorkspace& w) {
  RoutingPlan plan{};
  plan.expert_counts = piece<int32_t>(base, w.expert_counts);
  plan.expert_offsets = piece<int32_t>(base, w.expert_offsets);
  plan.tile_offsets = piece<int32_t>(base, w.tile_offsets);
  plan.row_token = piece<int32_t>(base, w.row_token);
  plan.row_slot = piece<int32_t>(base, w.row_slot);
  plan.slot_row = piece<int32_t>(base, w.slot_row);
  plan.invalid_count = piece<int32_t>(base, w.invalid_count);
  return plan;
}

BackwardWorkspace backward_workspace(int64_t T, int64_t k, int64_t H, int64_t I, int64_t E,
                                     bool h_saved) {
  check_sizes(T, k, H, I, E);
  Carver c;
  BackwardWorkspace w{};
  const auto slots = T * k;
  const int64_t padded = padded_rows_bound(slots, E);
  w.plan = carve_plan(c, slots, E);
  w.h = h_saved ? 0 : c.take(slots * 2 * I * sizeof(__nv_bfloat16));
  w.dh = c.take(padded * 2 * I * sizeof(__nv_bfloat16));
  w.a = c.take(padded * I * sizeof(__nv_bfloat16));
  w.dp_partial = c.take(slots * sm90::swiglu_backward_n_tiles(I) * sizeof(float));
  w.token_rows = c.take(padded * H * sizeof(__nv_bfloat16));
  w.total = c.at;
  return w;
}

}  // namespace megamoe::fused
