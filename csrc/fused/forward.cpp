// ABI entry of the fused forward on one GPU (fused/layer.h does the work).
#include <cuda_bf16.h>

#include <string>

#include "core/error.h"
#include "core/layer_shape.h"
#include "core/tensor_check.h"
#include "fused/entries.h"
#include "fused/layer.h"
#include "kernels/common/device.h"

using namespace megamoe;

namespace {

// saved_h: [T*k, 2I], the L1 output rows in the layer's expert-sorted order.
void check_saved_h(const megamoe_tensor& h, const LayerShape& s) {
  require_rank(h, "saved_h", 2, "[T*k, 2I]");
  require_shape(h, "saved_h", {{"T*k", s.T * s.k}, {"2I", 2 * s.I}}, "from topk_ids, w_gate_up");
}

void check_forward_inputs(const megamoe_tensor* x, const megamoe_tensor* ids,
                          const megamoe_tensor* weights, const megamoe_tensor* wgu,
                          const megamoe_tensor* wd, const megamoe_tensor* y,
                          const megamoe_tensor* saved_h) {
  require_dtype(*x, "x", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*ids, "topk_ids", {MEGAMOE_DTYPE_INT32, MEGAMOE_DTYPE_INT64});
  require_dtype(*weights, "topk_weights", {MEGAMOE_DTYPE_FLOAT32, MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*wgu, "w_gate_up", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*wd, "w_down", {MEGAMOE_DTYPE_BFLOAT16});
  if (y != nullptr) require_dtype(*y, "y", {MEGAMOE_DTYPE_BFLOAT16});
  const std::pair<const megamoe_tensor*, const char*> all[] = {
      {x, "x"}, {ids, "topk_ids"}, {weights, "topk_weights"}, {wgu, "w_gate_up"}, {wd, "w_down"},
      {y, "y"}};
  for (const auto& [t, name] : all) {
    if (t == nullptr) continue;  // y: NULL with saved_h (checked by the caller)
    require_contiguous(*t, name);
    require_data(*t, name);
    require_device_memory(*t, name);
    if (y != nullptr && t != y) require_disjoint(*y, "y", *t, name);
    if (saved_h != nullptr) require_disjoint(*saved_h, "saved_h", *t, name);
  }
  if (saved_h != nullptr) {
    require_dtype(*saved_h, "saved_h", {MEGAMOE_DTYPE_BFLOAT16});
    require_contiguous(*saved_h, "saved_h");
    require_data(*saved_h, "saved_h");
    require_device_memory(*saved_h, "saved_h");
  }
}

}  // namespace

namespace megamoe::fused {

void run_forward(const megamoe_tensor* x, const megamoe_tensor* topk_ids,
                 const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
                 const megamoe_tensor* w_down, megamoe_tensor* y, megamoe_tensor* saved_h,
                 void* workspace, size_t workspace_bytes, void* cuda_stream,
                 const Fp8Experts& fp8) {
  const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
  if (y == nullptr && saved_h == nullptr) {
    throw_invalid("y: expected a tensor, got NULL (NULL only with saved_h, which is then all "
                  "the call computes)");
  }
  if (y != nullptr) check_token_rows(y, "y", s);
  if (saved_h != nullptr) check_saved_h(*saved_h, s);
  check_forward_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, y, saved_h);
  forward(static_cast<const __nv_bfloat16*>(x->data), topk_ids->data,
          topk_ids->dtype == MEGAMOE_DTYPE_INT64, topk_weights->data,
          topk_weights->dtype == MEGAMOE_DTYPE_BFLOAT16,
          static_cast<const __nv_bfloat16*>(w_gate_up->data),
          static_cast<const __nv_bfloat16*>(w_down->data), s.T, s.k, s.H, s.I, s.E,
          y != nullptr ? static_cast<__nv_bfloat16*>(y->data) : nullptr,
          saved_h != nullptr ? static_cast<__nv_bfloat16*>(saved_h->data) : nullptr, workspace,
          workspace_bytes, static_cast<cudaStream_t>(cuda_stream), fp8);
}

}  // namespace megamoe::fused

extern "C" {

MEGAMOE_API megamoe_status megamoe_fused_workspace_size(int64_t tokens, int64_t topk,
                                                        int64_t hidden, int64_t intermediate,
                                                        int64_t num_experts, size_t* bytes) {
  return abi_call("megamoe_fused_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    *bytes = fused::forward_workspace_bytes(tokens, topk, hidden, intermediate, num_experts);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_fused_forward(const megamoe_tensor* x,
                                                 const megamoe_tensor* topk_ids,
                                                 const megamoe_tensor* topk_weights,
                                                 const megamoe_tensor* w_gate_up,
                                                 const megamoe_tensor* w_down, megamoe_tensor* y,
                                                 megamoe_tensor* saved_h, void* workspace, size_t workspace_bytes,
                                                 void* cuda_stream) {
  return abi_call("megamoe_fused_forward", [&] {
    fused::run_forward(x, topk_ids, topk_weights, w_gate_up, w_down, y, saved_h, workspace,
                       workspace_bytes, cuda_stream, {});
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
