// ABI entries of the expert-parallel layer (comm/ep_layer.h does the work).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "comm/ep_layer.h"
#include "core/env_switch.h"
#include "core/error.h"
#include "core/layer_shape.h"
#include "core/tensor_check.h"
#include "fused/entries.h"
#include "kernels/common/device.h"

using namespace megamoe;

namespace {

// The internal group; the buffers may be absent for size queries.
ep::Group to_group(const megamoe_ep_group* g, bool need_buffers) {
  if (g == nullptr) throw_invalid("group: expected a pointer, got NULL");
  ep::Group out{};
  out.peers.rank = g->rank;
  out.peers.world_size = g->world_size;
  if (g->world_size < 1 || g->world_size > MEGAMOE_EP_MAX_RANKS) {
    throw_invalid("group.world_size: expected 1..8, got " + std::to_string(g->world_size));
  }
  for (int r = 0; r < g->world_size; ++r) {
    out.peers.buffers[r] = static_cast<char*>(g->buffers[r]);
    // Size queries: a placeholder the layout arithmetic never dereferences.
    if (!need_buffers && out.peers.buffers[r] == nullptr) {
      out.peers.buffers[r] = reinterpret_cast<char*>(256);
    }
  }
  out.num_experts = g->num_experts;
  out.max_tokens = g->max_tokens_per_rank;
  out.topk = g->topk;
  out.hidden = g->hidden;
  out.max_recv_rows = g->max_recv_rows;
  out.timeout_ns = g->timeout_ns;
  if (g->num_comm_sms < 0) {
    throw_invalid("group.num_comm_sms: expected >= 0 (0: every SM), got " +
                  std::to_string(g->num_comm_sms));
  }
  out.comm_sms = g->num_comm_sms;
  // The forward's epilogue combine (docs/expert-parallel.md, "Forward overlap"): off unless
  // MEGAMOE_EP_EPILOGUE_COMBINE is set to something other than "" or "0", for an A/B on the
  // GPUs. Read whenever a group is built, so that the buffer-size query and the calls agree
  // within a process; every rank must see the same value (megamoe.Buffer checks that the
  // ranks agree on both switches).
  out.epilogue_combine = env_switch("MEGAMOE_EP_EPILOGUE_COMBINE");
  // The forward's dispatch beside L1 on the own rows (docs/expert-parallel.md, "Forward
  // overlap" (b)): off unless MEGAMOE_EP_OVERLAP_DISPATCH is set (not "" or "0"). The
  // buffer layout does not depend on it, the workspace size does (read on every group).
  // Every rank must see the same value.
  out.overlap_dispatch = env_switch("MEGAMOE_EP_OVERLAP_DISPATCH");
  // The backward's dx send beside the weight gradients (docs/expert-parallel.md, "Backward
  // overlap"): off unless MEGAMOE_EP_OVERLAP_BACKWARD is set (not "" or "0"). The buffer
  // layout does not depend on it, the bf16 backward's workspace does (read on every
  // group). Every rank must see the same value.
  out.overlap_backward = env_switch("MEGAMOE_EP_OVERLAP_BACKWARD");
  // The FP8 forward's bf16 dispatch (docs/expert-parallel.md, "Blockwise FP8 under EP"): off
  // unless MEGAMOE_EP_FP8_BF16_DISPATCH is set (not "" or "0"), for an A/B of the quantized
  // dispatch on the GPUs. The workspace size depends on it (read on every group). Every rank
  // must see the same value.
  out.fp8_bf16_dispatch = env_switch("MEGAMOE_EP_FP8_BF16_DISPATCH");
  return out;
}

// The checks every EP call makes of the group against its inputs.
LayerShape check_ep_inputs(const ep::Group& g, const megamoe_ep_group* group,
                           const megamoe_tensor* x, const megamoe_tensor* topk_ids,
                           const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
                           const megamoe_tensor* w_down) {
  const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
  if (s.E * g.peers.world_size != g.num_experts) {
    throw_invalid("w_gate_up: expected E/W = " + std::to_string(g.num_experts) + "/" +
                  std::to_string(g.peers.world_size) + " local experts, got " +
                  std::to_string(s.E));
  }
  if (s.k != g.topk || s.H != g.hidden) {
    throw_invalid("topk_ids / x: the group was made for k=" + std::to_string(g.topk) +
                  ", H=" + std::to_string(g.hidden) + ", got k=" + std::to_string(s.k) +
                  ", H=" + std::to_string(s.H));
  }
  if (group->buffer_bytes < ep::buffer_layout(g).total) {
    throw_invalid("group.buffer_bytes: expected at least " +
                  std::to_string(ep::buffer_layout(g).total) + " (megamoe_ep_buffer_size)");
  }
  require_dtype(*x, "x", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*topk_ids, "topk_ids", {MEGAMOE_DTYPE_INT32, MEGAMOE_DTYPE_INT64});
  require_dtype(*topk_weights, "topk_weights", {MEGAMOE_DTYPE_FLOAT32});
  require_dtype(*w_gate_up, "w_gate_up", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*w_down, "w_down", {MEGAMOE_DTYPE_BFLOAT16});
  return s;
}

using Named = std::pair<const megamoe_tensor*, const char*>;

// Contiguous device data, outputs disjoint from everything else.
void check_memory(std::initializer_list<Named> inputs, std::initializer_list<Named> outputs) {
  for (const auto& [t, name] : inputs) {
    require_contiguous(*t, name);
    require_data(*t, name);
    require_device_memory(*t, name);
  }
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    require_contiguous(*o->first, o->second);
    require_data(*o->first, o->second);
    require_device_memory(*o->first, o->second);
    for (const auto& [t, name] : inputs) require_disjoint(*o->first, o->second, *t, name);
    for (auto p = outputs.begin(); p != o; ++p) {
      require_disjoint(*o->first, o->second, *p->first, p->second);
    }
  }
}

// The saved h of the EP saved mode: bf16 [max_recv_rows, 2I] (the rows this rank computes).
void check_saved_h(const megamoe_tensor& h, const ep::Group& g, const LayerShape& s) {
  require_rank(h, "saved_h", 2, "[max_recv_rows, 2I]");
  require_shape(h, "saved_h", {{"max_recv_rows", g.max_recv_rows}, {"2I", 2 * s.I}},
                "from the group and w_gate_up");
  require_dtype(h, "saved_h", {MEGAMOE_DTYPE_BFLOAT16});
}


// The experts of an EP call: the bf16 weights, and with fp8 (the FP8 entries' checked
// copies) their precision and FP8 copies.
chain::Experts experts_of(const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
                          const LayerShape& s, const fused::Fp8Experts* fp8) {
  chain::Experts e{static_cast<const __nv_bfloat16*>(w_gate_up->data),
                   static_cast<const __nv_bfloat16*>(w_down->data), s.H, s.I};
  if (fp8 != nullptr) {
    e.precision = fp8->precision;
    e.fp8_gate_up = fp8->gate_up;
    e.fp8_down = fp8->down;
  }
  return e;
}

void check_size_query(int64_t tokens, int64_t intermediate) {
  if (tokens < 0 || intermediate < 128 || intermediate % 128) {
    throw_invalid("tokens >= 0 and intermediate a positive multiple of 128 expected");
  }
}

// megamoe_ep_forward and megamoe_ep_fp8_forward (fp8: the weights' FP8 copies, checked).
void ep_forward(const megamoe_ep_group* group, const megamoe_tensor* x,
                const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
                const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down, megamoe_tensor* y,
                megamoe_tensor* saved_h, void* workspace, size_t workspace_bytes,
                void* cuda_stream, const fused::Fp8Experts* fp8) {
  const ep::Group g = to_group(group, true);
  const LayerShape s = check_ep_inputs(g, group, x, topk_ids, topk_weights, w_gate_up, w_down);
  check_token_rows(y, "y", s);
  require_dtype(*y, "y", {MEGAMOE_DTYPE_BFLOAT16});
  const std::initializer_list<Named> inputs = {{x, "x"}, {topk_ids, "topk_ids"},
                                               {topk_weights, "topk_weights"},
                                               {w_gate_up, "w_gate_up"}, {w_down, "w_down"}};
  if (saved_h != nullptr) {
    check_saved_h(*saved_h, g, s);
    check_memory(inputs, {{y, "y"}, {saved_h, "saved_h"}});
  } else {
    check_memory(inputs, {{y, "y"}});
  }
  ep::forward(g, static_cast<const __nv_bfloat16*>(x->data), topk_ids->data,
              topk_ids->dtype == MEGAMOE_DTYPE_INT64, static_cast<const float*>(topk_weights->data),
              experts_of(w_gate_up, w_down, s, fp8), s.T, static_cast<__nv_bfloat16*>(y->data),
              saved_h != nullptr ? static_cast<__nv_bfloat16*>(saved_h->data) : nullptr,
              workspace, workspace_bytes, static_cast<cudaStream_t>(cuda_stream));
}

// megamoe_ep_backward and megamoe_ep_fp8_backward.
void ep_backward(const megamoe_ep_group* group, const megamoe_tensor* dy,
                 const megamoe_tensor* x, const megamoe_tensor* topk_ids,
                 const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
                 const megamoe_tensor* w_down, const megamoe_tensor* saved_h, megamoe_tensor* dx,
                 megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
                 megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes,
                 void* cuda_stream, const fused::Fp8Experts* fp8) {
  const ep::Group g = to_group(group, true);
  const LayerShape s = check_ep_inputs(g, group, x, topk_ids, topk_weights, w_gate_up, w_down);
  check_token_rows(dy, "dy", s);
  check_token_rows(dx, "dx", s);
  require_dtype(*dy, "dy", {MEGAMOE_DTYPE_BFLOAT16});
  require_dtype(*dx, "dx", {MEGAMOE_DTYPE_BFLOAT16});
  for (const auto& [t, name] : {Named{d_topk_weights, "d_topk_weights"},
                                Named{d_w_gate_up, "d_w_gate_up"}, Named{d_w_down, "d_w_down"}}) {
    if (t == nullptr) throw_invalid(std::string(name) + ": required in this version");
  }
  require_shape(*d_topk_weights, "d_topk_weights", {{"T", s.T}, {"k", s.k}}, "from topk_ids");
  require_dtype(*d_topk_weights, "d_topk_weights", {MEGAMOE_DTYPE_FLOAT32});
  require_shape(*d_w_gate_up, "d_w_gate_up", {{"E", s.E}, {"2I", 2 * s.I}, {"H", s.H}},
                "from w_gate_up");
  require_dtype(*d_w_gate_up, "d_w_gate_up", {MEGAMOE_DTYPE_BFLOAT16, MEGAMOE_DTYPE_FLOAT32});
  require_shape(*d_w_down, "d_w_down", {{"E", s.E}, {"H", s.H}, {"I", s.I}}, "from w_down");
  require_dtype(*d_w_down, "d_w_down", {MEGAMOE_DTYPE_BFLOAT16, MEGAMOE_DTYPE_FLOAT32});
  const std::initializer_list<Named> outputs = {{dx, "dx"}, {d_topk_weights, "d_topk_weights"},
                                                {d_w_gate_up, "d_w_gate_up"},
                                                {d_w_down, "d_w_down"}};
  if (saved_h != nullptr) {
    check_saved_h(*saved_h, g, s);
    check_memory({{dy, "dy"}, {x, "x"}, {topk_ids, "topk_ids"}, {topk_weights, "topk_weights"},
                  {w_gate_up, "w_gate_up"}, {w_down, "w_down"}, {saved_h, "saved_h"}},
                 outputs);
  } else {
    check_memory({{dy, "dy"}, {x, "x"}, {topk_ids, "topk_ids"}, {topk_weights, "topk_weights"},
                  {w_gate_up, "w_gate_up"}, {w_down, "w_down"}},
                 outputs);
  }
  const auto grad = [](megamoe_tensor* t) {
    return chain::WeightGrad::of(t->data, t->dtype == MEGAMOE_DTYPE_FLOAT32);
  };
  ep::backward(g, static_cast<const __nv_bfloat16*>(dy->data),
               static_cast<const __nv_bfloat16*>(x->data), topk_ids->data,
               topk_ids->dtype == MEGAMOE_DTYPE_INT64,
               static_cast<const float*>(topk_weights->data),
               experts_of(w_gate_up, w_down, s, fp8), s.T,
               saved_h != nullptr ? static_cast<const __nv_bfloat16*>(saved_h->data) : nullptr,
               static_cast<__nv_bfloat16*>(dx->data), static_cast<float*>(d_topk_weights->data),
               grad(d_w_gate_up), grad(d_w_down), workspace, workspace_bytes,
               static_cast<cudaStream_t>(cuda_stream));
}

}  // namespace

extern "C" {

MEGAMOE_API megamoe_status megamoe_ep_buffer_size(const megamoe_ep_group* group, size_t* bytes) {
  return abi_call("megamoe_ep_buffer_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    *bytes = ep::buffer_layout(to_group(group, false)).total;
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_workspace_size(const megamoe_ep_group* group,
                                                     int64_t tokens, int64_t intermediate,
                                                     size_t* bytes) {
  return abi_call("megamoe_ep_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    check_size_query(tokens, intermediate);
    *bytes = ep::forward_workspace_bytes(to_group(group, false), tokens, intermediate);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_backward_workspace_size(const megamoe_ep_group* group,
                                                              int64_t tokens,
                                                              int64_t intermediate,
                                                              int32_t h_saved, size_t* bytes) {
  return abi_call("megamoe_ep_backward_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    check_size_query(tokens, intermediate);
    *bytes = ep::backward_workspace_bytes(to_group(group, false), tokens, intermediate,
                                          h_saved != 0);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_error_offset(const megamoe_ep_group* group, size_t* offset) {
  return abi_call("megamoe_ep_error_offset", [&] {
    if (offset == nullptr) throw_invalid("offset: expected a pointer, got NULL");
    *offset = ep::buffer_layout(to_group(group, false)).error;
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_describe_error(int32_t code, char* message, size_t size) {
  return abi_call("megamoe_ep_describe_error", [&] {
    if (message == nullptr || size == 0) throw_invalid("message: expected a buffer");
    const std::string text = comm::describe_error(code);
    const size_t n = std::min(size - 1, text.size());
    std::memcpy(message, text.data(), n);
    message[n] = '\0';
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_forward(const megamoe_ep_group* group,
                                              const megamoe_tensor* x,
                                              const megamoe_tensor* topk_ids,
                                              const megamoe_tensor* topk_weights,
                                              const megamoe_tensor* w_gate_up,
                                              const megamoe_tensor* w_down, megamoe_tensor* y,
                                              megamoe_tensor* saved_h, void* workspace,
                                              size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_ep_forward", [&] {
    ep_forward(group, x, topk_ids, topk_weights, w_gate_up, w_down, y, saved_h, workspace,
               workspace_bytes, cuda_stream, nullptr);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_fp8_workspace_size(const megamoe_ep_group* group,
                                                         int64_t tokens, int64_t intermediate,
                                                         size_t* bytes) {
  return abi_call("megamoe_ep_fp8_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    check_size_query(tokens, intermediate);
    *bytes = ep::forward_workspace_bytes(to_group(group, false), tokens, intermediate,
                                         chain::Precision::kFp8);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_fp8_forward(
    const megamoe_ep_group* group, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, const megamoe_tensor* w_gate_up_q,
    const megamoe_tensor* w_gate_up_scales, const megamoe_tensor* w_down_q,
    const megamoe_tensor* w_down_scales, megamoe_tensor* y, megamoe_tensor* saved_h,
    void* workspace, size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_ep_fp8_forward", [&] {
    const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
    const fused::Fp8Experts fp8 = fused::fp8_forward_weights(s, w_gate_up_q, w_gate_up_scales,
                                                             w_down_q, w_down_scales);
    ep_forward(group, x, topk_ids, topk_weights, w_gate_up, w_down, y, saved_h, workspace,
               workspace_bytes, cuda_stream, &fp8);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_backward(
    const megamoe_ep_group* group, const megamoe_tensor* dy, const megamoe_tensor* x,
    const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* saved_h, megamoe_tensor* dx, megamoe_tensor* d_topk_weights,
    megamoe_tensor* d_w_gate_up, megamoe_tensor* d_w_down, void* workspace,
    size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_ep_backward", [&] {
    ep_backward(group, dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, dx,
                d_topk_weights, d_w_gate_up, d_w_down, workspace, workspace_bytes, cuda_stream,
                nullptr);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_fp8_backward_workspace_size(
    const megamoe_ep_group* group, int64_t tokens, int64_t intermediate, int32_t h_saved,
    int32_t forward_fp8, size_t* bytes) {
  return abi_call("megamoe_ep_fp8_backward_workspace_size", [&] {
    if (bytes == nullptr) throw_invalid("bytes: expected a pointer, got NULL");
    check_size_query(tokens, intermediate);
    *bytes = ep::backward_workspace_bytes(
        to_group(group, false), tokens, intermediate, h_saved != 0,
        forward_fp8 != 0 ? chain::Precision::kFp8 : chain::Precision::kFp8Backward);
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_ep_fp8_backward(
    const megamoe_ep_group* group, const megamoe_tensor* dy, const megamoe_tensor* x,
    const megamoe_tensor* topk_ids, const megamoe_tensor* topk_weights,
    const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down,
    const megamoe_tensor* w_gate_up_q, const megamoe_tensor* w_gate_up_q_t,
    const megamoe_tensor* w_gate_up_scales, const megamoe_tensor* w_down_q_t,
    const megamoe_tensor* w_down_scales, int32_t forward_fp8, const megamoe_tensor* saved_h,
    megamoe_tensor* dx, megamoe_tensor* d_topk_weights, megamoe_tensor* d_w_gate_up,
    megamoe_tensor* d_w_down, void* workspace, size_t workspace_bytes, void* cuda_stream) {
  return abi_call("megamoe_ep_fp8_backward", [&] {
    const LayerShape s = check_layer_shapes(x, topk_ids, topk_weights, w_gate_up, w_down);
    const fused::Fp8Experts fp8 = fused::fp8_backward_weights(
        s, forward_fp8 != 0, saved_h != nullptr, w_gate_up_q, w_gate_up_q_t, w_gate_up_scales,
        w_down_q_t, w_down_scales);
    ep_backward(group, dy, x, topk_ids, topk_weights, w_gate_up, w_down, saved_h, dx,
                d_topk_weights, d_w_gate_up, d_w_down, workspace, workspace_bytes, cuda_stream,
                &fp8);
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
