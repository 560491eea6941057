// The fused layer's ABI entries' shared work: the checks of the megamoe_fused_* arguments
// and the call, for the bf16 entries (forward.cpp, backward_entry.cpp) and the FP8 ones
// (fp8_entry.cpp), which add the weights' FP8 copies; the expert-parallel FP8 entries
// (comm/ep_entry.cpp) check those copies the same way. Throw megamoe::Error; the entries
// wrap them in abi_call.
#pragma once

#include <cstddef>

#include "core/layer_shape.h"
#include "fused/layer.h"
#include "megamoe/megamoe.h"

namespace megamoe::fused {

void run_forward(const megamoe_tensor* x, const megamoe_tensor* topk_ids,
                 const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
                 const megamoe_tensor* w_down, megamoe_tensor* y, megamoe_tensor* saved_h,
                 void* workspace, size_t workspace_bytes, void* cuda_stream,
                 const Fp8Experts& fp8);

void run_backward(const megamoe_tensor* dy, const megamoe_tensor* x,
                  const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
                  const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
                  const megamoe_tensor* saved_h, megamoe_tensor* dx,
                  megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
                  megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes,
                  void* cuda_stream, const Fp8Experts& fp8);

// The weights' FP8 copies of a call on weights of shape s (w_gate_up [E, 2I, H], w_down
// [E, H, I]), each checked (present where needed, shape, dtype, contiguous device memory).
// Forward (precision "fp8"): the values and scales.
Fp8Experts fp8_forward_weights(const LayerShape& s, const megamoe_tensor* w_gate_up_q,
                               const megamoe_tensor* w_gate_up_scales,
                               const megamoe_tensor* w_down_q,
                               const megamoe_tensor* w_down_scales);
// Backward: the transposed values and scales, and w_gate_up's values where L1 is
// recomputed in FP8 (forward_fp8 and no saved h); precision "fp8" when forward_fp8, else
// "fp8_bwd".
Fp8Experts fp8_backward_weights(const LayerShape& s, bool forward_fp8, bool h_saved,
                                const megamoe_tensor* w_gate_up_q,
                                const megamoe_tensor* w_gate_up_q_t,
                                const megamoe_tensor* w_gate_up_scales,
                                const megamoe_tensor* w_down_q_t,
                                const megamoe_tensor* w_down_scales);

}  // namespace megamoe::fused
