// An expert-parallel call, phase by phase (the steps of ep_layer.h): the rows arrive by
// plan and dispatch, the expert chain runs on them, and the results leave by the combine.
#include "comm/ep_layer.h"

#include <string>
#include <utility>

#include "comm/ep_phases.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/slot_reduce.h"

namespace megamoe::ep {
namespace {

void check_call(const Group& g, int64_t T, int64_t I) {
  check_group(g);
  if (T < 0 || T > g.max_tokens) {
    throw_invalid("tokens: expected 0 <= T <= max_tokens_per_rank (" +
                  std::to_string(g.max_tokens) + "), got " + std::to_string(T));
  }
  if (I < 128 || I % 128) throw_invalid("intermediate: expected a positive multiple of 128");
}

CallWorkspace carve_checked(const Group& g, int64_t T, int64_t I, Pass pass, void* workspace,
                            size_t workspace_size, const char* size_query) {
  WorkspaceCarver c(workspace, workspace_size);
  const CallWorkspace w = carve_call(c, g, T, I, pass);
  c.require_fits(size_query);
  return w;
}

// Steps 1-4: plan, counts, layout, dispatch (x rows; with dy, dy rows too), and the
// dispatch phase: afterwards this rank's received rows are in place.
Call route_and_dispatch(const Group& g, const CallWorkspace& w, const __nv_bfloat16* x,
                        const __nv_bfloat16* dy, const void* topk_ids, bool ids_are_int64,
                        const float* topk_weights, int64_t T, cudaStream_t stream) {
  // Everything this call launches behind the first peer wait must be loaded already
  // (kernel_preload.h says why).
  preload_kernels();
  const Call c = begin_call(g, w, T);
  plan(c, topk_ids, ids_are_int64, stream);
  dispatch(c, x, dy, topk_ids, ids_are_int64, topk_weights, stream);
  comm::phase_barrier(g.peers, comm::Phase::kDispatch, g.timeout_ns, c.error, stream);
  return c;
}

// The rows this rank computes: the received ones, in the expert-sorted order of the
// layout, gathered from the received tokens. row_slot: the backward's identity map.
chain::Rows received_rows(const Call& c, int32_t* row_slot) {
  char* own = c.own();
  chain::Rows r{};
  r.plan.expert_offsets = c.w.recv_expert_offsets;
  r.plan.tile_offsets = c.w.recv_tile_offsets;
  r.plan.row_token = at<int32_t>(own, c.buffer.recv_row_token);
  r.plan.row_slot = row_slot;
  r.rows = c.g.max_recv_rows;
  r.num_experts = c.e_local;
  r.tokens = c.g.peers.world_size * c.g.max_tokens;
  r.x = at<const __nv_bfloat16>(own, c.buffer.recv_x);
  r.dy = at<const __nv_bfloat16>(own, c.buffer.recv_dy);
  r.slot_weights = at<const float>(own, c.buffer.recv_weight);
  return r;
}

// The epilogue combine's L2 destination: row r goes to slot recv_row_dest[r] of its source
// (ep_layout.h), whose counters final_combine_slots waits on.
sm90::PeerRowsOut l2_to_peers(const Call& c) {
  sm90::PeerRowsOut out;
  for (int r = 0; r < c.g.peers.world_size; ++r) out.buffers[r] = c.g.peers.buffers[r];
  out.rows_offset = c.buffer.combine_slot_rows;
  out.done_offset = c.buffer.combine_slot_done;
  out.row_dest = at<const int32_t>(c.own(), c.buffer.recv_row_dest);
  out.skip = c.w.skip;
  out.slots_per_rank = c.g.max_tokens * c.g.topk;
  return out;
}

void combine_phase(const Call& c, cudaStream_t stream) {
  comm::phase_barrier(c.g.peers, comm::Phase::kCombine, c.g.timeout_ns, c.error, stream);
}

}  // namespace

size_t forward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate) {
  check_group(g);
  WorkspaceCarver c;
  carve_call(c, g, tokens, intermediate, Pass::kForward);
  return c.bytes();
}

size_t backward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                                bool h_saved) {
  check_group(g);
  WorkspaceCarver c;
  carve_call(c, g, tokens, intermediate, h_saved ? Pass::kBackwardSavedH : Pass::kBackward);
  return c.bytes();
}

void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t I, __nv_bfloat16* y,
             __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream) {
  check_call(g, T, I);
  const CallWorkspace w = carve_checked(g, T, I, Pass::kForward, workspace, workspace_size,
                                        "megamoe_ep_workspace_size");
  const Call c =
      route_and_dispatch(g, w, x, nullptr, topk_ids, ids_are_int64, topk_weights, T, stream);
  const chain::Rows rows = received_rows(c, nullptr);
  const chain::Experts experts{w_gate_up, w_down, g.hidden, I};
  if (g.epilogue_combine) {
    // L2's epilogue stores every row into its source's slot and counts it there; each rank
    // reduces its tokens as their slots complete (no combine send, no combine phase).
    const sm90::PeerRowsOut to_peers = l2_to_peers(c);
    chain::forward(rows, experts, w.forward, saved_h, stream, &to_peers);
    final_combine_slots(c, topk_ids, ids_are_int64, topk_weights, y, stream);
  } else {
    chain::forward(rows, experts, w.forward, saved_h, stream);
    combine_send(c, w.forward.out, rows.slot_weights, nullptr, stream);
    combine_phase(c, stream);
    final_combine(c, y, nullptr, stream);
  }
  poison_if_skipped(c, y, T * g.hidden, stream);
}

void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t T, int64_t I,
              const __nv_bfloat16* saved_h, __nv_bfloat16* dx, float* d_topk_weights,
              chain::WeightGrad d_w_gate_up, chain::WeightGrad d_w_down, void* workspace,
              size_t workspace_size, cudaStream_t stream) {
  check_call(g, T, I);
  if (!dy || !dx || !d_topk_weights || !d_w_gate_up.wanted() || !d_w_down.wanted()) {
    throw_invalid("EP backward: dy and every gradient are required in this version");
  }
  const CallWorkspace w =
      carve_checked(g, T, I, saved_h != nullptr ? Pass::kBackwardSavedH : Pass::kBackward,
                    workspace, workspace_size, "megamoe_ep_backward_workspace_size");
  const Call c =
      route_and_dispatch(g, w, x, dy, topk_ids, ids_are_int64, topk_weights, T, stream);
  const int64_t H = g.hidden, R = g.max_recv_rows;
  fill_identity(c, w.identity, R, stream);
  const chain::Rows rows = received_rows(c, w.identity);
  const chain::Experts experts{w_gate_up, w_down, H, I};
  const chain::BackwardBuffers& b = w.backward;
  chain::backward_dgrad(rows, experts, saved_h, b, true, stream);
  reduce_slot_partials(b.dp_partial, b.dp_parts, w.identity, R, w.dp_rows, stream);
  combine_send(c, b.token_rows, nullptr, w.dp_rows, stream);
  // The weight gradients stay here: they run while the peers finish.
  chain::backward_wgrad(rows, experts, b, d_w_gate_up, d_w_down, stream);
  combine_phase(c, stream);

  final_combine(c, dx, d_topk_weights, stream);
  poison_if_skipped(c, dx, T * H, stream);
  poison_if_skipped(c, d_topk_weights, T * g.topk, stream);
  const int64_t e_local = c.e_local;
  for (const auto& [grad, n] : {std::pair{d_w_gate_up, e_local * 2 * I * H},
                                std::pair{d_w_down, e_local * H * I}}) {
    poison_if_skipped(c, grad.bf16, n, stream);
    poison_if_skipped(c, grad.f32, n, stream);
  }
}

}  // namespace megamoe::ep
