#include "comm/ep_layout.h"

#include <cuda_bf16.h>

#include <string>

#include "core/error.h"
#include "kernels/common/sm_count.h"

namespace megamoe::ep {

void check_group(const Group& g) {
  const comm::PeerTable& p = g.peers;
  if (p.world_size < 1 || p.world_size > comm::kMaxRanks || p.rank < 0 || p.rank >= p.world_size) {
    throw_invalid("EP group: expected 0 <= rank < world_size <= 8, got rank " +
                  std::to_string(p.rank) + " of " + std::to_string(p.world_size));
  }
  for (int r = 0; r < p.world_size; ++r) {
    if (p.buffers[r] == nullptr) throw_invalid("EP group: no buffer for rank " + std::to_string(r));
  }
  if (g.num_experts < 1 || g.num_experts % p.world_size) {
    throw_invalid("EP group: num_experts " + std::to_string(g.num_experts) +
                  " is not a positive multiple of the world size " + std::to_string(p.world_size));
  }
  if (g.hidden < 128 || g.hidden % 128 || g.topk < 1 || g.topk > 16 || g.max_tokens < 0 ||
      g.max_recv_rows < 1 || g.timeout_ns < 1) {
    throw_invalid("EP group: bad sizes (H a multiple of 128, 1 <= k <= 16, max_recv_rows >= 1, "
                  "timeout > 0)");
  }
  // recv_row_dest codes every rank's slots in an int32.
  if (g.epilogue_combine && int64_t(p.world_size) * g.max_tokens * g.topk > INT32_MAX) {
    throw_invalid("EP group: world_size * max_tokens * topk must fit in int32 with "
                  "epilogue_combine");
  }
}

BufferLayout buffer_layout(const Group& g) {
  check_group(g);
  WorkspaceCarver c;
  BufferLayout b{};
  const int64_t R = g.max_recv_rows, W = g.peers.world_size, k = g.topk, H = g.hidden;
  const int64_t tokens = W * g.max_tokens;  // received tokens: one section per source
  const auto bf16 = sizeof(__nv_bfloat16), i32 = sizeof(int32_t), f32 = sizeof(float);
  b.control = c.take_bytes(comm::ControlLayout::bytes(g.num_experts));
  b.error = c.take_bytes(2 * i32);
  b.recv_x = c.take_bytes(tokens * H * bf16);
  // The e4m3 rows' W T H bytes are a multiple of 128: the scales start aligned.
  b.recv_x_scales = b.recv_x + static_cast<size_t>(tokens * H);
  b.recv_x_scale_ld = chain::fp8_scale_ld(tokens);
  b.recv_dy = c.take_bytes(tokens * H * bf16);
  b.recv_token_count = c.take_bytes(comm::kMaxRanks * i32);
  b.recv_token_source = c.take_bytes(tokens * i32);
  b.recv_slot_row = c.take_bytes(tokens * k * i32);
  b.recv_row_token = c.take_bytes(R * i32);
  b.recv_weight = c.take_bytes(R * f32);
  b.combine_rows = c.take_bytes(tokens * H * bf16);
  b.combine_dp = c.take_bytes(g.max_tokens * k * f32);
  const bool slots = g.epilogue_combine;
  b.recv_row_dest = c.take_bytes(slots ? R * i32 : 0);
  b.combine_slot_rows = c.take_bytes(slots ? g.max_tokens * k * H * bf16 : 0);
  b.combine_slot_done = c.take_bytes(slots ? g.max_tokens * k * i32 : 0);
  b.epilogue_combine = slots ? 1 : 0;
  b.total = c.bytes();
  b.hidden = static_cast<int32_t>(g.hidden);
  b.topk = static_cast<int32_t>(g.topk);
  b.max_tokens = static_cast<int32_t>(g.max_tokens);
  return b;
}

CallWorkspace carve_call(WorkspaceCarver& c, const Group& g, int64_t T, int64_t I, Pass pass,
                         chain::Precision precision) {
  CallWorkspace w{};
  const int64_t E = g.num_experts, W = g.peers.world_size, R = g.max_recv_rows;
  const int64_t e_local = E / W;
  const int64_t received_tokens = W * g.max_tokens;  // rows of recv_x
  w.local = carve_routing_plan(c, T * g.topk, E);
  w.recv_expert_offsets = c.take<int32_t>(e_local + 1);
  w.recv_tile_offsets = c.take<int32_t>(e_local + 1);
  w.send_base = c.take<int32_t>(E);
  w.skip = c.take<int32_t>(1);
  w.token_pos = c.take<int32_t>(T * W);
  w.token_count = c.take<int32_t>(comm::kMaxRanks);
  w.block_counts = c.take<int32_t>((T + kPlanThreads - 1) / kPlanThreads * W);
  const bool fp8_rows = pass == Pass::kForward ? precision == chain::Precision::kFp8
                                               : precision != chain::Precision::kBf16;
  if (pass == Pass::kForward) {
    w.forward = chain::carve_forward(c, R, received_tokens, g.hidden, I, precision);
    if (g.overlap_dispatch) {
      w.own_expert_offsets = c.take<int32_t>(e_local + 1);
      w.own_tile_offsets = c.take<int32_t>(e_local + 1);
      w.peer_expert_offsets = c.take<int32_t>(e_local + 1);
      w.peer_tile_offsets = c.take<int32_t>(e_local + 1);
      w.own_row_token = c.take<int32_t>(R);
      w.own_h_shift = c.take<int32_t>(e_local);
      w.peer_h_shift_lo = c.take<int32_t>(e_local);
      w.peer_h_shift_hi = c.take<int32_t>(e_local);
      w.peer_h_split = c.take<int32_t>(e_local);
    }
  } else {
    w.identity = c.take<int32_t>(R);
    w.dp_rows = c.take<float>(R);
    // The bf16 weight gradients gather into token_rows: the overlapped backward keeps the
    // dx rows apart, so that their send can run beside them (R x H bf16 more), unless the
    // epilogue combine sends them from the L1 dgrad's epilogue (no dx rows here).
    const bool separate_dx_rows =
        g.overlap_backward && !g.epilogue_combine && precision == chain::Precision::kBf16;
    w.backward = chain::carve_backward(c, R, received_tokens, e_local, g.hidden, I,
                                       pass == Pass::kBackwardSavedH, precision,
                                       separate_dx_rows);
  }
  if (fp8_rows) w.fp8_slot_row = c.take<int32_t>(received_tokens * g.topk);
  if (pass == Pass::kForward && precision == chain::Precision::kFp8 && !g.fp8_bf16_dispatch) {
    w.fp8_dispatch = true;
    w.x_fp8_tokens = chain::carve_fp8_rows(c, T, g.hidden);
  }
  return w;
}

Call begin_call(const Group& g, const CallWorkspace& w, int64_t T) {
  Call c{};
  c.g = g;
  c.buffer = buffer_layout(g);
  c.w = w;
  c.T = T;
  c.e_local = g.num_experts / g.peers.world_size;
  c.error = at<int32_t>(c.own(), c.buffer.error);
  c.sms = sm_count();
  c.copy_blocks = 2 * (g.comm_sms > 0 && g.comm_sms < c.sms ? g.comm_sms : c.sms);
  return c;
}

}  // namespace megamoe::ep
