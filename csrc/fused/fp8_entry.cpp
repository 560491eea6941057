// ABI entries of the fused layer in blockwise FP8 (megamoe_fused_fp8_*): the weights' FP8
// copies are checked here; everything else is the bf16 entries' (entries.h).
#include <cuda_fp8.h>

#include <string>

#include "core/error.h"
#include "core/layer_shape.h"
#include "core/tensor_check.h"
#include "fused/entries.h"
#include "kernels/common/device.h"

using namespace megamoe;

namespace {

// One of a weight's FP8 tensors: present, [E, rows, cols] of `dtype`, contiguous, on the
// device. Returns its data.
const void* fp8_tensor(const megamoe_tensor* t, const std::string& name, megamoe_dtype dtype,
                       int64_t E, int64_t rows, int64_t cols, const char* dims) {
  const megamoe_tensor& v = require_tensor(t, name.c_str());
  require_rank(v, name.c_str(), 3, dims);
  require_shape(v, name.c_str(), {{"E", E}, {"rows", rows}, {"cols", cols}}, "from the bf16 weights");
  require_dtype(v, name.c_str(), {dtype});
  require_contiguous(v, name.c_str());
  require_data(v, name.c_str());
  require_device_memory(v, name.c_str());
  return v.data;
}

// W [E, N, K]'s copy: q (forward, FP8 recompute), q_t (backward), scales.
chain::Fp8Weight fp8_weight(const std::string& name, const megamoe_tensor* q,
                            const megamoe_tensor* q_t, const megamoe_tensor* scales, int64_t E,
                            int64_t N, int64_t K, const char* q_dims, const char* t_dims,
                            const char* s_dims) {
  chain::Fp8Weight w;
  if (q != nullptr) {
    w.q = static_cast<const __nv_fp8_e4m3*>(
        fp8_tensor(q, name + "_q", MEGAMOE_DTYPE_FLOAT8_E4M3, E, N, K, q_dims));
  }
  if (q_t != nullptr) {
    w.q_t = static_cast<const __nv_fp8_e4m3*>(
        fp8_tensor(q_t, name + "_q_t", MEGAMOE_DTYPE_FLOAT8_E4M3, E, K, N, t_dims));
  }
  w.scales = static_cast<const float*>(
      fp8_tensor(scales, name + "_scales", MEGAMOE_DTYPE_FLOAT32, E, N / 128, K / 128, s_dims));
  return w;
}

}  // namespace

namespace megamoe::fused {

Fp8Experts fp8_forward_weights(const LayerShape& s, const megamoe_tensor* w_gate_up_q,
                               const megamoe_tensor* w_gate_up_scales,
                               const megamoe_tensor* w_down_q,
                               const megamoe_tensor* w_down_scales) {
  require_tensor(w_gate_up_q, "w_gate_up_q");
  require_tensor(w_down_q, "w_down_q");
  Fp8Experts fp8;
  fp8.precision = chain::Precision::kFp8;
  fp8.gate_up = fp8_weight("w_gate_up", w_gate_up_q, nullptr, w_gate_up_scales, s.E, 2 * s.I,
                           s.H, "[E, 2I, H]", "", "[E, 2I/128, H/128]");
  fp8.down = fp8_weight("w_down", w_down_q, nullptr, w_down_scales, s.E, s.H, s.I, "[E, H, I]",
                        "", "[E, H/128, I/128]");
  return fp8;
}

Fp8Experts fp8_backward_weights(const LayerShape& s, bool forward_fp8, bool h_saved,
                                const megamoe_tensor* w_gate_up_q,
                                const megamoe_tensor* w_gate_up_q_t,
                                const megamoe_tensor* w_gate_up_scales,
                                const megamoe_tensor* w_down_q_t,
                                const megamoe_tensor* w_down_scales) {
  require_tensor(w_gate_up_q_t, "w_gate_up_q_t");
  require_tensor(w_down_q_t, "w_down_q_t");
  // An FP8 recompute of L1 reads w_gate_up's values as the forward did.
  const bool recompute_fp8 = forward_fp8 && !h_saved;
  if (recompute_fp8) require_tensor(w_gate_up_q, "w_gate_up_q");
  Fp8Experts fp8;
  fp8.precision = forward_fp8 ? chain::Precision::kFp8 : chain::Precision::kFp8Backward;
  fp8.gate_up = fp8_weight("w_gate_up", recompute_fp8 ? w_gate_up_q : nullptr, w_gate_up_q_t,
                           w_gate_up_scales, s.E, 2 * s.I, s.H, "[E, 2I, H]", "[E, H, 2I]",
                           "[E, 2I/128, H/128]");
  fp8.down = fp8_weight("w_down", nullptr, w_down_q_t, w_down_scales, s.E, s.H, s.I,
                        "[E, H, I]", "[E, I, H]", "[E, H/128, I/128]");
  return fp8;
}

}  // namespace megamoe::fused

extern "C" {

MEGAMOE_API megamoe_status megamoe_fused_fp8_workspace_size(int64_t tokens, int64_t topk,
                                                            int64_t hidden,
                                                            int64_t intermediate,
                                                            int64_t num_experts, size_t* bytes) {
  return abi_call("megamoe_fused_fp8_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    *bytes = fused::forward_workspace_bytes(tokens, topk, hidden, intermediate, num_experts,
                                            chain::Precision::kFp8);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_fused_fp8_forward(
    const megamoe_tensor* x, const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* w_gate_up_q, const megamoe_tensor* w_gate_up_scales,
    const megamoe_tensor* w_down_q, const megamoe_tensor* w_down_scales, megamoe_tensor* y,
    megamoe_tensor* saved_h, void* workspace, size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_fused_fp8_forward", [&] {
    const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
    const fused::Fp8Experts fp8 = fused::fp8_forward_weights(s, w_gate_up_q, w_gate_up_scales,
                                                             w_down_q, w_down_scales);
    fused::run_forward(x, topk_ids, topk_weights, w_gate_up, w_down, y, saved_h, workspace,
                       workspace_bytes, cuda_stream, fp8);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_fused_fp8_backward_workspace_size(
    int64_t tokens, int64_t topk, int64_t hidden, int64_t intermediate, int64_t num_experts,
    int32_t h_saved, int32_t forward_fp8, size_t* bytes) {
  return abi_call("megamoe_fused_fp8_backward_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    *bytes = fused::backward_workspace_bytes(
        tokens, topk, hidden, intermediate, num_experts, h_saved != 0,
        forward_fp8 != 0 ? chain::Precision::kFp8 : chain::Precision::kFp8Backward);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_fused_fp8_backward(
    const megamoe_tensor* dy, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* w_gate_up_q,
    const megamoe_tensor* w_gate_up_q_t, const megamoe_tensor* w_gate_up_scales,
    const megamoe_tensor* w_down_q_t, const megamoe_tensor* w_down_scales, int32_t forward_fp8,
    const megamoe_tensor* saved_h,
    megamoe_tensor* dx, megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
    megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_fused_fp8_backward", [&] {
    const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
    const fused::Fp8Experts fp8 = fused::fp8_backward_weights(
        s, forward_fp8 != 0, saved_h != nullptr, w_gate_up_q, w_gate_up_q_t, w_gate_up_scales,
        w_down_q_t, w_down_scales);
    fused::run_backward(dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, dx,
                        d_topk_weights, d_w_gate_up, d_w_down, workspace, workspace_bytes,
                        cuda_stream, fp8);
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
