// The fused layer's ABI entries' shared work: the checks of the megamoe_fused_* arguments
// and the call, for the bf16 entries (forward.cpp, backward_entry.cpp) and the FP8 ones
// (fp8_entry.cpp), which add the weights' FP8 copies. Throw megamoe::Error; the entries
// wrap them in abi_call.
#pragma once

#include <cstddef>

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

}  // namespace megamoe::fused
