// An expert-parallel call, phase by phase (the steps of ep_layer.h): the rows arrive by
// plan and dispatch, the expert chain runs on them, and the results leave by the combine.
#include "comm/ep_layer.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "comm/ep_phases.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/slot_reduce.h"
#include "kernels/common/sm_count.h"

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

CallWorkspace carve_checked(const Group& g, int64_t T, int64_t I, Pass pass,
                            chain::Precision precision, void* workspace, size_t workspace_size,
                            const char* size_query) {
  WorkspaceCarver c(workspace, workspace_size);
  const CallWorkspace w = carve_call(c, g, T, I, pass, precision);
  c.require_fits(size_query);
  return w;
}

// Steps 1-4: plan, counts, layout, dispatch (x rows, or in the FP8 forward's quantized
// dispatch x quantized here once; with dy, dy rows too), and the dispatch phase: afterwards
// this rank's received rows are in place (and, for the FP8 chain, the received tokens' slot
// rows of this call).
// x null: no x rows (the overlapped backward sends them later).
Call route_and_dispatch(const Group& g, const CallWorkspace& w, const __nv_bfloat16* x,
                        const __nv_bfloat16* dy, const void* topk_ids, bool ids_are_int64,
                        const float* topk_weights, int64_t T, cudaStream_t stream) {
  // Everything this call launches behind the first peer wait must be loaded already
  // (kernel_preload.h says why).
  preload_kernels();
  const Call c = begin_call(g, w, T);
  if (w.fp8_dispatch) chain::quantize_tokens(x, T, g.hidden, w.x_fp8_tokens, stream);
  plan(c, topk_ids, ids_are_int64, stream);
  dispatch(c, x, dy, topk_ids, ids_are_int64, topk_weights, stream);
  comm::phase_barrier(g.peers, comm::Phase::kDispatch, g.timeout_ns, c.error, stream);
  if (w.fp8_slot_row != nullptr) received_slot_rows(c, w.fp8_slot_row, stream);
  return c;
}

// The rows this rank computes: the received ones, in the expert-sorted order of the
// layout, gathered from the received tokens (FP8: quantized into them by the slot rows, or
// with the quantized dispatch, their e4m3 rows copied there). row_slot: the backward's
// identity map.
chain::Rows received_rows(const Call& c, int32_t* row_slot) {
  char* own = c.own();
  chain::Rows r{};
  r.plan.expert_offsets = c.w.recv_expert_offsets;
  r.plan.tile_offsets = c.w.recv_tile_offsets;
  r.plan.row_token = at<int32_t>(own, c.buffer.recv_row_token);
  r.plan.row_slot = row_slot;
  r.plan.slot_row = c.w.fp8_slot_row;
  r.topk = c.g.topk;
  r.rows = c.g.max_recv_rows;
  r.num_experts = c.e_local;
  r.tokens = c.g.peers.world_size * c.g.max_tokens;
  r.x = at<const __nv_bfloat16>(own, c.buffer.recv_x);
  r.dy = at<const __nv_bfloat16>(own, c.buffer.recv_dy);
  r.slot_weights = at<const float>(own, c.buffer.recv_weight);
  if (c.w.fp8_dispatch) {
    r.x = nullptr;  // recv_x holds the e4m3 tokens
    r.x_quantized.q = at<__nv_fp8_e4m3>(own, c.buffer.recv_x);
    r.x_quantized.scales = at<float>(own, c.buffer.recv_x_scales);
    r.x_quantized.scale_ld = c.buffer.recv_x_scale_ld;
  }
  return r;
}

// The epilogue combine's destination of L2's rows (backward: the L1 dgrad's dx rows): row r
// goes to slot recv_row_dest[r] of its source (ep_layout.h), whose counters
// final_combine_slots waits on.
sm90::PeerRowsOut slot_rows_to_peers(const Call& c) {
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

// The overlapped forward's second stream (and its fork and join events) of a rank: one per
// (device, rank's buffer), made at the rank's first overlapped call and kept for the
// process, or the caller's (set_side_stream). Keyed by the rank, not by the caller's stream,
// so that a CUDA graph captured on a stream of its own (torch's capture stream) finds the one
// made by an earlier eager call: creating them during a capture may not be allowed (the first
// call is then to come before the capture, as the kernel loads already ask). Per rank, not
// per device: emulated ranks share a device, and a rank's side work queued behind another
// rank's spinning phase kernel would wait for it. A rank's calls are collective, so they
// never run on two streams at once.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  bool made = false;  // stream is the library's (destroyed when replaced)
};
std::mutex& side_streams_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::pair<int, const char*>, SideStream>& side_streams() {
  static std::map<std::pair<int, const char*>, SideStream> streams;
  return streams;
}
std::pair<int, const char*> side_stream_key(const Group& g) {
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  return {device, g.peers.buffers[g.peers.rank]};
}
void make_events(SideStream& s) {
  if (s.fork != nullptr) return;
  MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
}
const SideStream& side_stream_for(const Call& c) {
  const auto key = side_stream_key(c.g);
  const std::lock_guard<std::mutex> lock(side_streams_mutex());
  SideStream& s = side_streams()[key];
  if (s.stream == nullptr) {
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    s.made = true;
  }
  make_events(s);
  return s;
}

// The side stream's next work waits for what `stream` has queued so far.
void fork_side(const SideStream& side, cudaStream_t stream) {
  MEGAMOE_CUDA_CHECK(cudaEventRecord(side.fork, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(side.stream, side.fork, 0));
}
// `stream`'s next work waits for what the side stream has queued so far.
void join_side(const SideStream& side, cudaStream_t stream) {
  MEGAMOE_CUDA_CHECK(cudaEventRecord(side.join, side.stream));
  MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, side.join, 0));
}

// The rows of one of the overlapped forward's two plans: the own rows (rows 0.., gathered
// from this rank's x) or the peers' rows (after them, gathered from the received tokens).
chain::Rows plan_rows(const Call& c, bool own, const __nv_bfloat16* x) {
  chain::Rows r = received_rows(c, nullptr);
  if (own) {
    r.plan.expert_offsets = c.w.own_expert_offsets;
    r.plan.tile_offsets = c.w.own_tile_offsets;
    r.plan.row_token = c.w.own_row_token;
    r.x = x;
    r.tokens = c.T;
  } else {
    r.plan.expert_offsets = c.w.peer_expert_offsets;
    r.plan.tile_offsets = c.w.peer_tile_offsets;
  }
  return r;
}

// Where L1 on either plan of the overlapped forward writes its rows of a saved h.
sm90::HRowShift h_rows(const Call& c, bool own) {
  if (own) return {c.w.own_h_shift, nullptr, nullptr};
  return {c.w.peer_h_shift_lo, c.w.peer_h_shift_hi, c.w.peer_h_split};
}

// The cap of a GEMM beside a copy: every round-robin grid's, not a grid whose tiles are
// handed out as blocks ask (MEGAMOE_DYNAMIC_TILES), whose blocks kept waiting by the copy
// just take fewer tiles (sm_count.h).
constexpr SmLimit::Scope kBesideCopy = SmLimit::Scope::kRoundRobinGrids;

// Copy SMs of the dispatch beside L1: num_comm_sms, or 16 by default (all of them would
// leave L1 nothing until the copy ends), at most half the SMs.
int overlap_copy_blocks(const Call& c) {
  const int sms = c.g.comm_sms > 0 ? c.g.comm_sms : 16;
  return 2 * std::max(1, std::min(sms, c.sms / 2));
}

}  // namespace

size_t forward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                               chain::Precision precision) {
  check_group(g);
  WorkspaceCarver c;
  carve_call(c, g, tokens, intermediate, Pass::kForward, precision);
  return c.bytes();
}

size_t backward_workspace_bytes(const Group& g, int64_t tokens, int64_t intermediate,
                                bool h_saved, chain::Precision precision) {
  check_group(g);
  WorkspaceCarver c;
  carve_call(c, g, tokens, intermediate, h_saved ? Pass::kBackwardSavedH : Pass::kBackward,
             precision);
  return c.bytes();
}

// The forward's steps 1-6 with the row traffic beside the own rows' GEMMs (Group::
// overlap_dispatch): plan in the own-first layout; the own rows' metadata (no copy); then
//   - forked onto the side stream, the peers' rows and the dispatch phase, while L1 runs on
//     the own rows from x;
//   - joined, L1 and L2 on the peers' rows;
//   - forked again (unless to_peers: L2's epilogue sends those rows itself), the peers'
//     partial sums sent back while L2 runs on the own rows, whose partial sums then go to
//     this rank's own combine area; joined.
// The GEMMs beside a copy are capped below the SMs (SmLimit) so that its blocks get SMs of
// their own: a persistent GEMM's blocks that waited for an SM would finish their share of
// tiles that much later. Nothing waits inside a GEMM, so no SM is held by a spinning kernel
// beside the copies. A saved h is written in the default layout (h_rows), where the
// backward reads it. The combine phase and the final combine are the caller's.
Call overlapped_chain(const Group& g, const CallWorkspace& w, const __nv_bfloat16* x,
                      const void* topk_ids, bool ids_are_int64, const float* topk_weights,
                      const chain::Experts& experts, int64_t T, bool to_peers,
                      __nv_bfloat16* saved_h, cudaStream_t stream) {
  preload_kernels();
  const Call c = begin_call(g, w, T);
  plan(c, topk_ids, ids_are_int64, stream, /*own_first=*/true);
  dispatch(c, x, nullptr, topk_ids, ids_are_int64, topk_weights, stream, DispatchPart::kSelf);
  const SideStream& side = side_stream_for(c);
  const int copy_blocks = overlap_copy_blocks(c);
  const int gemm_sms = std::max(1, c.sms - copy_blocks / 2);
  fork_side(side, stream);
  dispatch(c, x, nullptr, topk_ids, ids_are_int64, topk_weights, side.stream,
           DispatchPart::kPeers, copy_blocks);
  comm::phase_barrier(g.peers, comm::Phase::kDispatch, g.timeout_ns, c.error, side.stream);
  const sm90::PeerRowsOut out = to_peers ? slot_rows_to_peers(c) : sm90::PeerRowsOut{};
  const sm90::PeerRowsOut* l2_out = to_peers ? &out : nullptr;
  const chain::Rows own = plan_rows(c, true, x);
  const bool own_rows = own.tokens > 0;  // no x rows (T = 0): no own rows either
  if (own_rows) {
    const SmLimit cap(gemm_sms, kBesideCopy);
    chain::forward_l1(own, experts, w.forward, saved_h, stream, h_rows(c, true));
  }
  join_side(side, stream);
  const chain::Rows peer = plan_rows(c, false, x);
  if (peer.tokens > 0) {
    chain::forward_l1(peer, experts, w.forward, saved_h, stream, h_rows(c, false));
    chain::forward_l2(peer, experts, w.forward, stream, l2_out);
  }
  const float* row_weights = at<const float>(c.own(), c.buffer.recv_weight);
  if (!to_peers) {
    fork_side(side, stream);
    combine_send(c, w.forward.out, row_weights, nullptr, side.stream, copy_blocks,
                 DispatchPart::kPeers);
  }
  if (own_rows) {
    std::optional<SmLimit> cap;  // beside the send only
    if (!to_peers) cap.emplace(gemm_sms, kBesideCopy);
    chain::forward_l2(own, experts, w.forward, stream, l2_out);
  }
  if (!to_peers) {
    combine_send(c, w.forward.out, row_weights, nullptr, stream, 0, DispatchPart::kSelf);
    join_side(side, stream);
  }
  return c;
}

void set_side_stream(const Group& g, cudaStream_t side) {
  check_group(g);
  const auto key = side_stream_key(g);
  const std::lock_guard<std::mutex> lock(side_streams_mutex());
  auto& streams = side_streams();
  const auto it = streams.find(key);
  if (it != streams.end() && it->second.made) {
    // Work still queued on it completes; its resources go when it has.
    MEGAMOE_CUDA_CHECK(cudaStreamDestroy(it->second.stream));
    it->second.stream = nullptr;
    it->second.made = false;
  }
  if (side == nullptr) {
    if (it != streams.end()) {
      if (it->second.fork != nullptr) {
        MEGAMOE_CUDA_CHECK(cudaEventDestroy(it->second.fork));
        MEGAMOE_CUDA_CHECK(cudaEventDestroy(it->second.join));
      }
      streams.erase(it);
    }
    return;
  }
  SideStream& s = streams[key];
  s.stream = side;
  s.made = false;
  make_events(s);
}

void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const __nv_bfloat16* w_gate_up,
             const __nv_bfloat16* w_down, int64_t T, int64_t I, __nv_bfloat16* y,
             __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream) {
  forward(g, x, topk_ids, ids_are_int64, topk_weights,
          chain::Experts{w_gate_up, w_down, g.hidden, I}, T, y, saved_h, workspace,
          workspace_size, stream);
}

void forward(const Group& g, const __nv_bfloat16* x, const void* topk_ids, bool ids_are_int64,
             const float* topk_weights, const chain::Experts& experts, int64_t T,
             __nv_bfloat16* y, __nv_bfloat16* saved_h, void* workspace, size_t workspace_size,
             cudaStream_t stream) {
  const int64_t I = experts.intermediate;
  check_call(g, T, I);
  if (experts.hidden != g.hidden) throw_invalid("EP forward: the experts' H is not the group's");
  const CallWorkspace w =
      carve_checked(g, T, I, Pass::kForward, experts.precision, workspace, workspace_size,
                    experts.fp8_forward() ? "megamoe_ep_fp8_workspace_size"
                                          : "megamoe_ep_workspace_size");
  // The overlapped dispatch runs the bf16 GEMMs: an FP8 forward takes the other path.
  const bool bf16 = !experts.fp8_forward();
  if (bf16 && g.overlap_dispatch) {
    const Call c = overlapped_chain(g, w, x, topk_ids, ids_are_int64, topk_weights, experts, T,
                                    g.epilogue_combine, saved_h, stream);
    if (g.epilogue_combine) {
      final_combine_slots(c, topk_ids, ids_are_int64, topk_weights, y, nullptr, stream);
    } else {  // the partial sums are sent
      combine_phase(c, stream);
      final_combine(c, y, nullptr, stream);
    }
    take_group_failure(c, stream);
    poison_if_failed(c, y, T * g.hidden, stream);
    return;
  }
  const Call c =
      route_and_dispatch(g, w, x, nullptr, topk_ids, ids_are_int64, topk_weights, T, stream);
  const chain::Rows rows = received_rows(c, nullptr);
  if (g.epilogue_combine) {
    // L2's epilogue stores every row into its source's slot and counts it there; each rank
    // reduces its tokens as their slots complete (no combine send, no combine phase).
    const sm90::PeerRowsOut to_peers = slot_rows_to_peers(c);
    chain::forward(rows, experts, w.forward, saved_h, stream, &to_peers);
    final_combine_slots(c, topk_ids, ids_are_int64, topk_weights, y, nullptr, stream);
  } else {
    chain::forward(rows, experts, w.forward, saved_h, stream);
    combine_send(c, w.forward.out, rows.slot_weights, nullptr, stream);
    combine_phase(c, stream);
    final_combine(c, y, nullptr, stream);
  }
  take_group_failure(c, stream);
  poison_if_failed(c, y, T * g.hidden, stream);
}

void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const __nv_bfloat16* w_gate_up, const __nv_bfloat16* w_down, int64_t T, int64_t I,
              const __nv_bfloat16* saved_h, __nv_bfloat16* dx, float* d_topk_weights,
              chain::WeightGrad d_w_gate_up, chain::WeightGrad d_w_down, void* workspace,
              size_t workspace_size, cudaStream_t stream) {
  backward(g, dy, x, topk_ids, ids_are_int64, topk_weights,
           chain::Experts{w_gate_up, w_down, g.hidden, I}, T, saved_h, dx, d_topk_weights,
           d_w_gate_up, d_w_down, workspace, workspace_size, stream);
}

void backward(const Group& g, const __nv_bfloat16* dy, const __nv_bfloat16* x,
              const void* topk_ids, bool ids_are_int64, const float* topk_weights,
              const chain::Experts& experts, int64_t T, const __nv_bfloat16* saved_h,
              __nv_bfloat16* dx, float* d_topk_weights, chain::WeightGrad d_w_gate_up,
              chain::WeightGrad d_w_down, void* workspace, size_t workspace_size,
              cudaStream_t stream) {
  const int64_t I = experts.intermediate;
  check_call(g, T, I);
  if (experts.hidden != g.hidden) throw_invalid("EP backward: the experts' H is not the group's");
  // A rank with no tokens (T = 0) has empty dy, dx and d topk_weights, whose data a
  // framework may give as null (torch does); it still owns experts, so the weight gradients
  // are required on every rank.
  if ((T > 0 && (!dy || !dx || !d_topk_weights)) || !d_w_gate_up.wanted() ||
      !d_w_down.wanted()) {
    throw_invalid("EP backward: dy and every gradient are required in this version");
  }
  const CallWorkspace w = carve_checked(
      g, T, I, saved_h != nullptr ? Pass::kBackwardSavedH : Pass::kBackward, experts.precision,
      workspace, workspace_size,
      experts.fp8_backward() ? "megamoe_ep_fp8_backward_workspace_size"
                             : "megamoe_ep_backward_workspace_size");
  // With saved h, nothing before the weight gradients reads x's rows: the overlapped
  // backward sends dy's rows (and every row's metadata) first, and x's on the side stream
  // beside the L2 dgrad, which runs on the other SMs (SmLimit), with a phase of their own.
  const bool x_beside = g.overlap_backward && saved_h != nullptr;
  const Call c = route_and_dispatch(g, w, x_beside ? nullptr : x, dy, topk_ids, ids_are_int64,
                                    topk_weights, T, stream);
  const int64_t H = g.hidden, R = g.max_recv_rows;
  const SideStream* side = g.overlap_backward ? &side_stream_for(c) : nullptr;
  const int copy_blocks = overlap_copy_blocks(c);
  const int gemm_sms = std::max(1, c.sms - copy_blocks / 2);
  if (x_beside) {
    fork_side(*side, stream);
    dispatch(c, x, nullptr, topk_ids, ids_are_int64, topk_weights, side->stream,
             DispatchPart::kAll, copy_blocks, /*metadata=*/false);
    comm::phase_barrier(g.peers, comm::Phase::kDispatchX, g.timeout_ns, c.error, side->stream);
  }
  fill_identity(c, w.identity, R, stream);
  const chain::Rows rows = received_rows(c, w.identity);
  const chain::BackwardBuffers& b = w.backward;
  {
    std::optional<SmLimit> cap;  // beside x's rows only
    if (x_beside) cap.emplace(gemm_sms, kBesideCopy);
    chain::backward_dgrad(rows, experts, saved_h, b, /*dx_rows=*/false, stream);
  }
  if (g.epilogue_combine) {
    // The epilogue combine: each slot's d topk_weights, then its dx row from the L1 dgrad's
    // epilogue, straight into its slot on its source, which folds every slot's row as the
    // one-GPU layer does (dx bitwise its dx); no combine send, no combine phase.
    reduce_slot_partials(b.dp_partial, b.dp_parts, w.identity, R, w.dp_rows, stream);
    send_slot_dp(c, w.dp_rows, stream);
    const sm90::PeerRowsOut to_peers = slot_rows_to_peers(c);
    const chain::DgradDone done = chain::backward_dgrad_l1(
        rows, experts, b, stream, /*d_w_gate_up_wanted=*/true, &to_peers);
    if (x_beside) join_side(*side, stream);
    chain::backward_wgrad(rows, experts, b, d_w_gate_up, d_w_down, stream, done);
    final_combine_slots(c, topk_ids, ids_are_int64, nullptr, dx, d_topk_weights, stream);
  } else {
    const chain::DgradDone done =
        chain::backward_dgrad_l1(rows, experts, b, stream, /*d_w_gate_up_wanted=*/true);
    reduce_slot_partials(b.dp_partial, b.dp_parts, w.identity, R, w.dp_rows, stream);
    if (x_beside) join_side(*side, stream);
    // The dx rows are apart from what the weight gradients write when carved so (bf16) or
    // when those read the token matrices in place (FP8, unless a diagnostic switch says not).
    const bool apart = b.dx_rows != b.token_rows || !chain::wgrad_writes_token_rows(experts);
    if (g.overlap_backward && apart) {
      // The dx send on the side stream's copy blocks, launched first so that they find their
      // SMs; the weight gradients beside it on the others (SmLimit). Neither writes what the
      // other reads, and each output's bits are as in the default order.
      fork_side(*side, stream);
      combine_send(c, b.dx_rows, nullptr, w.dp_rows, side->stream, copy_blocks);
      {
        const SmLimit cap(gemm_sms, kBesideCopy);
        chain::backward_wgrad(rows, experts, b, d_w_gate_up, d_w_down, stream, done);
      }
      join_side(*side, stream);
    } else {
      combine_send(c, b.dx_rows, nullptr, w.dp_rows, stream);
      // The weight gradients stay here: they run while the peers finish.
      chain::backward_wgrad(rows, experts, b, d_w_gate_up, d_w_down, stream, done);
    }
    combine_phase(c, stream);

    final_combine(c, dx, d_topk_weights, stream);
  }
  take_group_failure(c, stream);
  poison_if_failed(c, dx, T * H, stream);
  poison_if_failed(c, d_topk_weights, T * g.topk, stream);
  const int64_t e_local = c.e_local;
  for (const auto& [grad, n] : {std::pair{d_w_gate_up, e_local * 2 * I * H},
                                std::pair{d_w_down, e_local * H * I}}) {
    poison_if_failed(c, grad.bf16, n, stream);
    poison_if_failed(c, grad.f32, n, stream);
  }
}

}  // namespace megamoe::ep
