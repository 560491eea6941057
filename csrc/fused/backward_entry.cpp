// ABI entry of the fused backward on one GPU (fused/layer.h does the work).
#include <cuda_bf16.h>

#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/layer_shape.h"
#include "core/tensor_check.h"
#include "fused/entries.h"
#include "fused/layer.h"
#include "kernels/common/device.h"

using namespace megamoe;

namespace {

using Named = std::pair<const megamoe_tensor*, const char*>;

void require_device_tensor(const megamoe_tensor& t, const char* name) {
  require_contiguous(t, name);
  require_data(t, name);
  require_device_memory(t, name);
}

// A weight gradient: BFLOAT16 (written) or FLOAT32 (added into); none for NULL.
chain::WeightGrad weight_grad(megamoe_tensor* g) {
  if (g == nullptr) return {};
  return chain::WeightGrad::of(g->data, g->dtype == MEGAMOE_DTYPE_FLOAT32);
}

}  // namespace

namespace megamoe::fused {

void run_backward(const megamoe_tensor* dy, const megamoe_tensor* x,
                  const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
                  const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
                  const megamoe_tensor* saved_h, megamoe_tensor* dx,
                  megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
                  megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes,
                  void* cuda_stream, const Fp8Experts& fp8) {
  const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
  check_token_rows(dy, "dy", s);
  require_dtype(*dy, "dy", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*x, "x", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*topk_ids, "topk_ids", {MEGAMOE_DTYPE_INT32, MEGAMOE_DTYPE_INT64});
  require_dtype(*topk_weights, "topk_weights", {MEGAMOE_DTYPE_FLOAT32});
  require_dtype(*w_gate_up, "w_gate_up", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*w_down, "w_down", {MEGAMOE_DTYPE_BFLOAT16});
  std::vector<Named> inputs = {{dy, "dy"}, {x, "x"}, {topk_ids, "topk_ids"},
                               {topk_weights, "topk_weights"}, {w_gate_up, "w_gate_up"},
                               {w_down, "w_down"}};
  if (saved_h != nullptr) {
    require_rank(*saved_h, "saved_h", 2, "[T*k, 2I]");
    require_shape(*saved_h, "saved_h", {{"T*k", s.T * s.k}, {"2I", 2 * s.I}},
                  "from topk_ids, w_gate_up");
    require_dtype(*saved_h, "saved_h", {MEGAMOE_DTYPE_BFLOAT16});
    inputs.push_back({saved_h, "saved_h"});
  }
  std::vector<Named> outputs;
  if (dx != nullptr) {
    check_token_rows(dx, "dx", s);
    require_dtype(*dx, "dx", {MEGAMOE_DTYPE_BFLOAT16});
    outputs.push_back({dx, "dx"});
  }
  if (d_topk_weights != nullptr) {
    require_rank(*d_topk_weights, "d_topk_weights", 2, "[T, k]");
    require_shape(*d_topk_weights, "d_topk_weights", {{"T", s.T}, {"k", s.k}},
                  "from topk_ids");
    require_dtype(*d_topk_weights, "d_topk_weights", {MEGAMOE_DTYPE_FLOAT32});
    outputs.push_back({d_topk_weights, "d_topk_weights"});
  }
  if (d_w_gate_up != nullptr) {
    require_rank(*d_w_gate_up, "d_w_gate_up", 3, "[E, 2I, H]");
    require_shape(*d_w_gate_up, "d_w_gate_up", {{"E", s.E}, {"2I", 2 * s.I}, {"H", s.H}},
                  "from w_gate_up");
    require_dtype(*d_w_gate_up, "d_w_gate_up", {MEGAMOE_DTYPE_BFLOAT16, MEGAMOE_DTYPE_FLOAT32});
    outputs.push_back({d_w_gate_up, "d_w_gate_up"});
  }
  if (d_w_down != nullptr) {
    require_rank(*d_w_down, "d_w_down", 3, "[E, H, I]");
    require_shape(*d_w_down, "d_w_down", {{"E", s.E}, {"H", s.H}, {"I", s.I}}, "from w_down");
    require_dtype(*d_w_down, "d_w_down", {MEGAMOE_DTYPE_BFLOAT16, MEGAMOE_DTYPE_FLOAT32});
    outputs.push_back({d_w_down, "d_w_down"});
  }
  for (const auto& [t, name] : inputs) require_device_tensor(*t, name);
  for (size_t i = 0; i < outputs.size(); ++i) {
    require_device_tensor(*outputs[i].first, outputs[i].second);
    for (const auto& [t, name] : inputs) {
      require_disjoint(*outputs[i].first, outputs[i].second, *t, name);
    }
    for (size_t j = 0; j < i; ++j) {
      require_disjoint(*outputs[i].first, outputs[i].second, *outputs[j].first,
                       outputs[j].second);
    }
  }
  fused::BackwardOutputs out{};
  out.dx = dx != nullptr ? static_cast<__nv_bfloat16*>(dx->data) : nullptr;
  out.d_topk_weights =
      d_topk_weights != nullptr ? static_cast<float*>(d_topk_weights->data) : nullptr;
  out.d_w_gate_up = weight_grad(d_w_gate_up);
  out.d_w_down = weight_grad(d_w_down);
  backward(static_cast<const __nv_bfloat16*>(dy->data),
                  static_cast<const __nv_bfloat16*>(x->data), topk_ids->data,
                  topk_ids->dtype == MEGAMOE_DTYPE_INT64,
                  static_cast<const float*>(topk_weights->data),
                  static_cast<const __nv_bfloat16*>(w_gate_up->data),
                  static_cast<const __nv_bfloat16*>(w_down->data),
                  saved_h != nullptr ? static_cast<const __nv_bfloat16*>(saved_h->data)
                                     : nullptr,
                  s.T, s.k, s.H, s.I, s.E, out, workspace, workspace_bytes,
                  static_cast<cudaStream_t>(cuda_stream), fp8);
}

}  // namespace megamoe::fused

extern "C" {


MEGAMOE_API megamoe_status megamoe_fused_backward_workspace_size(int64_t tokens, int64_t topk,
                                                                 int64_t hidden,
                                                                 int64_t intermediate,
                                                                 int64_t num_experts,
                                                                 int32_t h_saved, size_t* bytes) {
  return abi_call("megamoe_fused_backward_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    *bytes = fused::backward_workspace_bytes(tokens, topk, hidden, intermediate, num_experts,
                                             h_saved != 0);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_fused_backward(
    const megamoe_tensor* dy, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* saved_h, megamoe_tensor* dx,
    megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up, megamoe_tensor* d_w_down,
    void* workspace, size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_fused_backward", [&] {
    fused::run_backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, dx,
                        d_topk_weights, d_w_gate_up, d_w_down, workspace, workspace_bytes,
                        cuda_stream, {});
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
